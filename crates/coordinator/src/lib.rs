//! The automaton coordinator: the one writer of a project's task store while it runs. It
//! owns the leases (expiry by its own monotonic clock, fencing tokens that strictly increase
//! across restarts, reviewer ≠ implementer at claim time), makes every acknowledged claim and
//! release durable through its backend's log (`automaton-backend`: a group-committed file,
//! or etcd), holds the workers' sessions (a dead
//! session's leases end at once), dispatches work to them (waves, best fit by VRAM budget),
//! takes their artifacts and code under the lease, applies task changes through
//! `automaton-store`, and streams events — all over gRPC (`automaton.v1`). Each dispatch
//! decision roots the trace of its phase run; traced callers' requests join their trace
//! (`layers.rs`); it counts what it does for Prometheus (`metrics.rs`, served by
//! `automaton-telemetry`; both in `docs/observability.md`). With `store = etcd` several
//! coordinators serve one project and only the elected leader writes (`ha.rs`).
//!
//! It must not parse markdown or decide lifecycle rules itself: `automaton-workflow` decides,
//! `automaton-store` reads and writes the files. Leases, fencing, task changes, recovery,
//! holders, views and events are the lease engine's (`automaton-engine`): this crate wires
//! the engine to dispatch (`dispatch/`) and the worker sessions, and is the only one that
//! speaks gRPC — [`status`] is the one place that chooses a refusal's code.

pub mod auth;
pub mod config;
mod counters;
mod dispatch;
#[cfg(test)]
mod dispatch_props;
#[cfg(test)]
#[path = "../../workflow/src/fuzz.rs"]
mod fuzz;
pub mod ha;
mod keepalive;
mod layers;
pub mod metrics;
pub mod output;
pub mod owner;
mod service;
mod sessions;
mod state;
mod uploads;
#[cfg(test)]
mod wal_fuzz;
pub mod web;
mod webhooks;
mod wire;
mod work_service;
mod worker_service;
mod worker_sessions;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use automaton_proto::v1 as pb;
use automaton_store::ErrorKind;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::Status;
use tonic::metadata::MetadataValue;

pub use automaton_backend::Failpoints;
pub use automaton_engine::{Engine, Error, Event, Granted, Live, Presented};
pub use config::{Config, Overrides, Role, StoreKind};
pub use owner::Ownership;
pub use state::{Coordinator, Options};

/// The one place that chooses gRPC codes. The `automaton-error-kind` metadata lets the CLI
/// give the same exit code it gives without a coordinator.
pub fn status(e: Error) -> Status {
    let (code, kind) = match &e {
        Error::Store(s) => {
            let code = match s.kind() {
                ErrorKind::Refused => tonic::Code::FailedPrecondition,
                ErrorKind::Invalid => tonic::Code::InvalidArgument,
                ErrorKind::NotFound => tonic::Code::NotFound,
                ErrorKind::AlreadyExists => tonic::Code::AlreadyExists,
                ErrorKind::Corrupt => tonic::Code::DataLoss,
                ErrorKind::Io => tonic::Code::Internal,
            };
            (code, s.kind())
        }
        Error::LeaseNotFound(_) => (tonic::Code::NotFound, ErrorKind::NotFound),
        Error::Invalid(_) => (tonic::Code::InvalidArgument, ErrorKind::Invalid),
        Error::PermissionDenied(_) => (tonic::Code::PermissionDenied, ErrorKind::Refused),
        Error::Refused(_) => (tonic::Code::FailedPrecondition, ErrorKind::Refused),
        Error::AlreadyExists(_) => (tonic::Code::AlreadyExists, ErrorKind::AlreadyExists),
        Error::Owned { .. } | Error::Config(_) => {
            (tonic::Code::FailedPrecondition, ErrorKind::Refused)
        }
        Error::Internal(_) => (tonic::Code::Internal, ErrorKind::Io),
        Error::Unavailable(_) | Error::NotLeading(_) => (tonic::Code::Unavailable, ErrorKind::Io),
    };
    let mut status = Status::new(code, e.to_string());
    status.metadata_mut().insert(
        "automaton-error-kind",
        MetadataValue::from_static(kind.as_str()),
    );
    status
}

/// [`status`] as a method: `From<Error> for Status` is out of reach here (both types are
/// foreign to this crate).
pub(crate) trait IntoStatus {
    fn into_status(self) -> Status;
}

impl IntoStatus for Error {
    fn into_status(self) -> Status {
        status(self)
    }
}

/// `builder` serving TLS with the configured certificate and key.
pub(crate) fn tls_builder(
    builder: tonic::transport::Server,
    tls: &config::Tls,
) -> Result<tonic::transport::Server, Error> {
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| Error::Config(format!("cannot read {}: {e}", p.display())))
    };
    let identity = tonic::transport::Identity::from_pem(read(&tls.cert)?, read(&tls.key)?);
    builder
        .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
        .map_err(|e| Error::Config(format!("invalid TLS certificate or key: {e}")))
}

/// How often expired leases are swept: the granularity by which a lease may outlive its TTL.
const EXPIRY_SWEEP: Duration = Duration::from_millis(20);

/// Serves `coord` on `listener` until `shutdown` resolves, then drains in-flight requests,
/// ends the streams, and returns. Leases stay on disk for the next start.
pub async fn serve(
    coord: Arc<Coordinator>,
    cfg: &Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let (stop_tx, stop_rx) = watch::channel(false);
    let svc = service::Service {
        coord: coord.clone(),
        shutdown: stop_rx.clone(),
        outputs: Arc::default(),
    };
    let limit = cfg.max_message_bytes;
    let tasks = pb::tasks_server::TasksServer::new(svc.clone()).max_decoding_message_size(limit);
    let leases = pb::leases_server::LeasesServer::new(svc.clone()).max_decoding_message_size(limit);
    let events = pb::events_server::EventsServer::new(svc.clone()).max_decoding_message_size(limit);
    let workers =
        pb::workers_server::WorkersServer::new(svc.clone()).max_decoding_message_size(limit);
    let work = pb::work_server::WorkServer::new(svc).max_decoding_message_size(limit);

    let (health, health_svc) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::tasks_server::TasksServer<service::Service>>()
        .await;
    health
        .set_serving::<pb::leases_server::LeasesServer<service::Service>>()
        .await;
    health
        .set_serving::<pb::events_server::EventsServer<service::Service>>()
        .await;
    health
        .set_serving::<pb::workers_server::WorkersServer<service::Service>>()
        .await;
    health
        .set_serving::<pb::work_server::WorkServer<service::Service>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    // Reflection in both versions: grpcurl and current tools speak v1; grpcio's reflection
    // client, Postman and older grpcurl speak only v1alpha.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection()
        .build_v1()
        .map_err(|e| Error::Internal(format!("cannot build reflection: {e}")))?;
    let reflection_v1alpha = reflection()
        .build_v1alpha()
        .map_err(|e| Error::Internal(format!("cannot build reflection: {e}")))?;

    coord.engine.spawn_reconciler();
    // A bad receiver was refused by `Config::validate` before anything bound.
    let hooks = if cfg.webhooks.is_empty() {
        None
    } else {
        let w = automaton_webhooks::Webhooks::start(cfg.webhooks.clone())
            .map_err(|e| Error::Config(e.to_string()))?;
        Some(webhooks::spawn(&coord, w, None, stop_rx.clone()))
    };
    if cfg.dispatch {
        coord.spawn_dispatcher(stop_rx.clone());
    }
    let sweeper = {
        let coord = coord.clone();
        let mut stop = stop_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(EXPIRY_SWEEP);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => {
                        coord.engine.expire();
                        coord.expire_sessions();
                        coord.engine.compact_log();
                    }
                    _ = stop.changed() => return,
                }
            }
        })
    };

    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &cfg.tls {
        builder = tls_builder(builder, tls)?;
    }
    // Fail-stop: once the lease log cannot be written, stop serving (health first, so load
    // balancers stop sending), end the streams, and return the reason as an error.
    let log_failure: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let signal = {
        let health = health.clone();
        let coord = coord.clone();
        let log_failure = log_failure.clone();
        async move {
            tokio::select! {
                _ = shutdown => {
                    tracing::info!("shutting down: draining in-flight requests");
                }
                why = coord.log_failed() => {
                    tracing::error!(error = %why, "the lease log failed: not serving, stopping");
                    *log_failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                }
            }
            health
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            // Streams never finish on their own: tell them to end so the drain can complete.
            let _ = stop_tx.send(true);
            coord.engine.watchers().stop_all();
            coord.sessions.stop_all();
        }
    };
    let result = builder
        // Bound the work one connection can pile onto the server.
        .concurrency_limit_per_connection(cfg.max_in_flight)
        // Dead peers are noticed even on idle KeepAlive streams.
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        // A traced caller's requests join its trace (outermost: refusals are recorded too).
        .layer(layers::Trace)
        .layer(layers::Gate::new(
            auth::Callers::new(&cfg.tokens, &cfg.worker_pools),
            cfg.rpc_timeout,
        ))
        .add_service(health_svc)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(tasks)
        .add_service(leases)
        .add_service(events)
        .add_service(workers)
        .add_service(work)
        .serve_with_incoming_shutdown(
            // Small request/response messages: Nagle plus delayed ACKs would add ~40 ms.
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            signal,
        )
        .await
        .map_err(|e| Error::Internal(format!("server failed: {e}")));
    sweeper.abort();
    if let Some(h) = hooks {
        // Deliveries queued get a few seconds to go out (bounded in `webhooks::spawn`).
        let _ = tokio::time::timeout(Duration::from_secs(7), h).await;
    }
    result?;
    // A clean stop leaves the task files complete: every holder written (after a crash the
    // next start has them from the log).
    if log_failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .is_none()
    {
        let c = coord.clone();
        match tokio::task::spawn_blocking(move || c.flush_holders()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "cannot record every lease holder at shutdown")
            }
            Err(e) => tracing::warn!(error = %e, "cannot record every lease holder at shutdown"),
        }
    }
    match log_failure.lock().unwrap_or_else(|p| p.into_inner()).take() {
        Some(why) => Err(Error::Unavailable(why)),
        None => Ok(()),
    }
}
