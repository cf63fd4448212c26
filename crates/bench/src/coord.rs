//! The automaton coordinator as a system under test, over its own gRPC API.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1::tasks_client::TasksClient;
use automaton_proto::v1::{
    ClaimRequest, CreateTaskRequest, GetTaskRequest, KeepAliveRequest, KeepAliveResponse, Lease,
    ReleaseRequest, ReleaseResponse, TransitionRequest,
};
use tonic::transport::Channel;

use crate::backend::{Backend, Renewer};
use crate::rpc::{Client, Stream, status_err};

/// The phase the benchmark's tasks are claimed in.
const PHASE: &str = "research";

const CLAIM: &str = "/automaton.v1.Leases/Claim";
const RELEASE: &str = "/automaton.v1.Leases/Release";
const KEEP_ALIVE: &str = "/automaton.v1.Leases/KeepAlive";

pub struct Coordinator {
    clients: Vec<Client>,
    /// How many clients the tasks were prepared for (part of their names).
    count: usize,
    per_client: usize,
    ttl_ms: u64,
}

pub struct CoordLease {
    id: String,
    token: u64,
}

impl Coordinator {
    pub fn new(clients: Vec<Client>, count: usize, per_client: usize, ttl_ms: u64) -> Self {
        Coordinator {
            clients,
            count,
            per_client,
            ttl_ms,
        }
    }

    fn client(&self, client: usize) -> &Client {
        &self.clients[client % self.clients.len()]
    }

    /// `bench-c{C}-{i}`: client `client` owns `i` in `client*per_client .. (client+1)*per_client`.
    fn task(&self, client: usize, slot: usize) -> String {
        task_name(self.count, client * self.per_client + slot)
    }
}

fn task_name(clients: usize, i: usize) -> String {
    format!("bench-c{clients}-{i}")
}

fn agent(client: usize) -> String {
    format!("bench-agent-{client}")
}

impl Backend for Coordinator {
    type Lease = CoordLease;
    type Renewer = CoordRenewer;

    async fn claim(&self, client: usize, slot: usize) -> Result<CoordLease> {
        let request = ClaimRequest {
            task: self.task(client, slot),
            agent: agent(client),
            ttl: Some(automaton_proto::prost_types::Duration {
                seconds: (self.ttl_ms / 1000) as i64,
                nanos: ((self.ttl_ms % 1000) * 1_000_000) as i32,
            }),
            ..Default::default()
        };
        let lease: Lease = self.client(client).unary(CLAIM, request).await?;
        if lease.lease_id.is_empty() || lease.token == 0 {
            bail!("Claim answered without a lease id or token");
        }
        Ok(CoordLease {
            id: lease.lease_id,
            token: lease.token,
        })
    }

    async fn release(&self, client: usize, lease: CoordLease) -> Result<()> {
        let request = ReleaseRequest {
            lease_id: lease.id,
            token: lease.token,
            ..Default::default()
        };
        let _: ReleaseResponse = self.client(client).unary(RELEASE, request).await?;
        Ok(())
    }

    async fn renewer(&self, client: usize, lease: &CoordLease) -> Result<CoordRenewer> {
        let request = KeepAliveRequest {
            lease_ids: vec![lease.id.clone()],
        };
        let stream = self
            .client(client)
            .stream(KEEP_ALIVE, request.clone())
            .await?;
        let mut r = CoordRenewer { stream, request };
        r.receive().await?;
        Ok(r)
    }
}

pub struct CoordRenewer {
    stream: Stream<KeepAliveRequest, KeepAliveResponse>,
    request: KeepAliveRequest,
}

impl CoordRenewer {
    async fn receive(&mut self) -> Result<()> {
        match self.stream.receive().await? {
            Some(KeepAliveResponse {
                lost: Some(lost), ..
            }) => bail!("lease lost: {} (task {})", lost.reason, lost.task),
            Some(KeepAliveResponse { lease: Some(_), .. }) => Ok(()),
            Some(r) => bail!(
                "KeepAlive answered neither lease nor lost for {}",
                r.lease_id
            ),
            None => bail!("the coordinator closed the KeepAlive stream"),
        }
    }
}

impl Renewer for CoordRenewer {
    async fn renew(&mut self) -> Result<()> {
        self.stream.send(self.request.clone()).await?;
        self.receive().await
    }
}

/// Creates `clients × per_client` tasks `bench-c{clients}-{i}` and moves each to `research`,
/// with `workers` concurrent callers. Tasks left by an earlier run are reused.
/// Returns (tasks, seconds).
pub async fn prepare(
    channels: &[Channel],
    clients: usize,
    per_client: usize,
    workers: usize,
) -> Result<(usize, f64)> {
    let total = clients * per_client;
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut handles = Vec::new();
    for w in 0..workers.max(1) {
        let mut tasks = TasksClient::new(channels[w % channels.len()].clone());
        let next = next.clone();
        handles.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    return Ok::<(), anyhow::Error>(());
                }
                let task = task_name(clients, i);
                prepare_one(&mut tasks, &task)
                    .await
                    .with_context(|| format!("prepare task {task}"))?;
            }
        }));
    }
    for h in handles {
        h.await.context("a preparing task panicked")??;
    }
    Ok((total, t0.elapsed().as_secs_f64()))
}

/// Creates `task` (or finds it) and moves it to `research`.
pub async fn prepare_one(tasks: &mut TasksClient<Channel>, task: &str) -> Result<()> {
    match tasks
        .create_task(CreateTaskRequest {
            task: task.to_string(),
        })
        .await
    {
        Ok(_) => {}
        Err(s) if s.code() == tonic::Code::AlreadyExists => {}
        Err(s) => return Err(status_err(s).context("CreateTask")),
    }
    let moved = tasks
        .transition(TransitionRequest {
            task: task.to_string(),
            target: PHASE.to_string(),
            ..TransitionRequest::default()
        })
        .await;
    if let Err(s) = moved {
        // Already in `research` from an earlier run is fine.
        let detail = tasks
            .get_task(GetTaskRequest {
                task: task.to_string(),
                with_contents: false,
                with_changes: false,
            })
            .await
            .map_err(status_err)?
            .into_inner();
        let state = detail.summary.map(|s| s.state).unwrap_or_default();
        if state != PHASE {
            return Err(status_err(s).context(format!("Transition to {PHASE} (state {state})")));
        }
    }
    Ok(())
}

/// Waits until the coordinator answers a read, for at most `limit`.
pub async fn wait_ready(channel: &Channel, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut tasks = TasksClient::new(channel.clone());
    loop {
        match tasks
            .list_tasks(automaton_proto::v1::ListTasksRequest {})
            .await
        {
            Ok(_) => return Ok(()),
            Err(s) if Instant::now() >= deadline => {
                return Err(status_err(s).context("the coordinator does not answer ListTasks"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
