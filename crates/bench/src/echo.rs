//! `automaton-bench echo-server`: the coordinator's gRPC API with no work behind it — claims
//! and releases answered at once from nothing, renewals echoed on the `KeepAlive` stream. It
//! is not a coordinator (no leases, no disk): it measures what tonic and the kernel cost on
//! this machine with the load generator's own clients, the ceiling any coordinator built on
//! them can reach. `automaton-bench leases --coordinator URL` runs against it unchanged.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use automaton_proto::v1 as pb;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

type Res<T> = Result<Response<T>, Status>;

#[derive(Default)]
struct Echo {
    token: AtomicU64,
}

// The answers, shared with the `--inline` server (`inline.rs`). Each carries the fields the
// coordinator's answer to the same call carries, so both put the same bytes on the wire.

/// The TTL an echo lease reports.
const MINUTE: automaton_proto::prost_types::Duration = automaton_proto::prost_types::Duration {
    seconds: 60,
    nanos: 0,
};

/// Now, as the coordinator's `expires_at` and `claimed_at` carry it.
fn now() -> automaton_proto::prost_types::Timestamp {
    std::time::SystemTime::now().into()
}

/// A claim granted from nothing, with the next token. The lease id is the token in 16 hex
/// digits (the coordinator's are 16 hex digits too), so a renewal naming it can answer with
/// its token.
pub(crate) fn claimed(r: pb::ClaimRequest, tokens: &AtomicU64) -> pb::Lease {
    let token = tokens.fetch_add(1, Ordering::Relaxed) + 1;
    let now = now();
    pb::Lease {
        lease_id: format!("{token:016x}"),
        task: r.task,
        agent: r.agent,
        token,
        state: "research".into(),
        ttl: Some(MINUTE),
        expires_at: Some(now),
        remaining: Some(MINUTE),
        claimed_at: Some(now),
        ..Default::default()
    }
}

pub(crate) fn renewed(r: pb::RenewRequest) -> pb::Lease {
    pb::Lease {
        lease_id: r.lease_id,
        token: r.token,
        renewed: true,
        ..Default::default()
    }
}

/// The released lease as the coordinator describes it, less the task and agent (a release
/// names neither, and the echo keeps nothing).
pub(crate) fn released(r: pb::ReleaseRequest) -> pb::ReleaseResponse {
    let now = now();
    pb::ReleaseResponse {
        released: Some(pb::Lease {
            lease_id: r.lease_id,
            token: r.token,
            state: "research".into(),
            ttl: Some(MINUTE),
            expires_at: Some(now),
            remaining: Some(MINUTE),
            claimed_at: Some(now),
            ..Default::default()
        }),
    }
}

/// The answer the coordinator gives on `KeepAlive`: one response for the lease named, with
/// the fields the coordinator's has (lease id, token, ttl, remaining, renewed). The token is
/// read back from an echo lease id; 0 for any other.
pub(crate) fn kept_alive(m: pb::KeepAliveRequest) -> pb::KeepAliveResponse {
    let id = m.lease_ids.into_iter().next().unwrap_or_default();
    let token = u64::from_str_radix(&id, 16).unwrap_or(0);
    pb::KeepAliveResponse {
        lease: Some(pb::Lease {
            lease_id: id.clone(),
            token,
            ttl: Some(MINUTE),
            remaining: Some(MINUTE),
            renewed: true,
            ..Default::default()
        }),
        lease_id: id,
        lost: None,
    }
}

#[tonic::async_trait]
impl pb::tasks_server::Tasks for Echo {
    async fn create_task(&self, _r: Request<pb::CreateTaskRequest>) -> Res<pb::TaskSummary> {
        Ok(Response::new(pb::TaskSummary::default()))
    }
    async fn get_task(&self, _r: Request<pb::GetTaskRequest>) -> Res<pb::TaskDetail> {
        Ok(Response::new(pb::TaskDetail::default()))
    }
    async fn list_tasks(&self, _r: Request<pb::ListTasksRequest>) -> Res<pb::ListTasksResponse> {
        Ok(Response::new(pb::ListTasksResponse::default()))
    }
    async fn transition(&self, _r: Request<pb::TransitionRequest>) -> Res<pb::TransitionResponse> {
        Ok(Response::new(pb::TransitionResponse::default()))
    }
    async fn approve(&self, _r: Request<pb::ApproveRequest>) -> Res<pb::ApproveResponse> {
        Err(Status::unimplemented("the echo server approves nothing"))
    }
    async fn validate_folder(
        &self,
        _r: Request<pb::ValidateFolderRequest>,
    ) -> Res<pb::ValidateFolderResponse> {
        Err(Status::unimplemented("the echo server has no folders"))
    }
    async fn audit(&self, _r: Request<pb::AuditRequest>) -> Res<pb::AuditResponse> {
        Err(Status::unimplemented(
            "the echo server has nothing to audit",
        ))
    }
}

#[tonic::async_trait]
impl pb::leases_server::Leases for Echo {
    async fn claim(&self, r: Request<pb::ClaimRequest>) -> Res<pb::Lease> {
        Ok(Response::new(claimed(r.into_inner(), &self.token)))
    }
    async fn renew(&self, r: Request<pb::RenewRequest>) -> Res<pb::Lease> {
        Ok(Response::new(renewed(r.into_inner())))
    }
    async fn release(&self, r: Request<pb::ReleaseRequest>) -> Res<pb::ReleaseResponse> {
        Ok(Response::new(released(r.into_inner())))
    }

    type KeepAliveStream =
        Pin<Box<dyn Stream<Item = Result<pb::KeepAliveResponse, Status>> + Send>>;

    async fn keep_alive(
        &self,
        r: Request<Streaming<pb::KeepAliveRequest>>,
    ) -> Res<Self::KeepAliveStream> {
        let out = r.into_inner().map(|m| Ok(kept_alive(m?)));
        Ok(Response::new(Box::pin(out)))
    }
}

/// Serves on `listen` until killed (with `inline`, the server of `inline.rs`); prints
/// `listening on ADDR` like the coordinator.
pub async fn serve(listen: std::net::SocketAddr, inline: bool) -> Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    println!("listening on {}", listener.local_addr()?);
    if inline {
        crate::inline::serve_on(listener).await
    } else {
        serve_on(listener).await
    }
}

/// Serves on a bound listener until killed.
pub async fn serve_on(listener: tokio::net::TcpListener) -> Result<()> {
    tonic::transport::Server::builder()
        .add_service(pb::tasks_server::TasksServer::new(Echo::default()))
        .add_service(pb::leases_server::LeasesServer::new(Echo::default()))
        .serve_with_incoming(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        )
        .await
        .context("the echo server failed")
}
