//! The worker's one session with the coordinator: register (or resume), heartbeat, hear
//! lease losses and drains, reconnect with exponential backoff and jitter, deregister on
//! `SIGTERM`.
//!
//! The session is what keeps this worker's leases alive: if it cannot heartbeat for the
//! session timeout, the coordinator ends every lease it holds. So a broken stream is resumed
//! at once (same session id, the leases it still holds listed), and a session the
//! coordinator no longer knows is replaced by a fresh one, its leases reported lost.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as In;
use pb::worker_message::Msg as Out;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::probe::Probe;

/// How a session ends for good.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The coordinator refused this worker for a reason retrying cannot fix (a bad or missing
    /// token, a name that is not its own, an invalid registration).
    #[error("the coordinator refused this worker: {0}")]
    Refused(String),
    #[error("invalid coordinator address '{0}': write e.g. http://127.0.0.1:7070")]
    Address(String),
    #[error("--token holds characters a header cannot carry")]
    Token,
}

/// What the worker registers with, and how it connects.
#[derive(Debug, Clone)]
pub struct Options {
    pub coordinator: String,
    pub name: String,
    pub token: Option<String>,
    pub capacity: u32,
    pub replace: bool,
    /// The longest wait between reconnection attempts.
    pub max_backoff: Duration,
}

/// The first wait before reconnecting; doubled each failure up to `max_backoff`.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// How long a goodbye may take at shutdown.
const DEREGISTER_WAIT: Duration = Duration::from_secs(2);

/// What this worker knows of its session.
#[derive(Debug, Default)]
struct State {
    session: Option<String>,
    /// A session was granted since the last reconnect.
    joined: bool,
    /// lease id → token, as the coordinator last said.
    leases: BTreeMap<String, u64>,
}

/// Why one connection ended.
enum Ended {
    /// Asked to stop: deregistered (or tried to).
    Shutdown,
    /// The stream broke or was ended by the coordinator: reconnect.
    Broken(String),
    /// Refused for a reason retrying cannot cure.
    Fatal(String),
}

fn register(probe: &Probe, opts: &Options, state: &State) -> pb::Register {
    pb::Register {
        name: opts.name.clone(),
        host: probe.host.clone(),
        gpus: probe
            .gpus
            .iter()
            .map(|g| pb::Gpu {
                index: g.index,
                name: g.name.clone(),
                uuid: g.uuid.clone(),
                total_bytes: g.total_bytes,
                free_bytes: g.free_bytes,
                driver: g.driver.clone(),
            })
            .collect(),
        budget: Some(pb::Budget {
            model_context_kb: probe.budget.model_context_kb,
            framework_overhead_tokens: probe.budget.framework_overhead_tokens,
            recommended_kb: probe.budget.recommended_kb,
            headroom: probe.budget.headroom,
            max_peak_context_kb: probe.budget.max_peak_context_kb,
            source: probe.budget.source.clone(),
            context_source: probe.budget.context_source.clone(),
            num_ctx: probe.budget.num_ctx.unwrap_or(0),
        }),
        capacity: opts.capacity,
        version: env!("CARGO_PKG_VERSION").into(),
        simulated: probe.simulated,
        ram_bytes: probe.ram_bytes,
        cpus: probe.cpus,
        resume_session_id: state.session.clone().unwrap_or_default(),
        leases: state
            .leases
            .iter()
            .map(|(id, token)| pb::HeldLease {
                lease_id: id.clone(),
                token: *token,
            })
            .collect(),
        replace: opts.replace,
    }
}

/// A random fraction in [0, 1) (jitter needs no more than the std hasher's random keys).
fn jitter() -> f64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Whether a refusal cannot be cured by retrying.
fn fatal(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unauthenticated | tonic::Code::PermissionDenied | tonic::Code::InvalidArgument
    )
}

/// Runs the session until `stop` turns true (then deregisters and returns `Ok`), or until
/// the coordinator refuses this worker for good.
pub async fn run(
    probe: Probe,
    opts: Options,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Error> {
    let endpoint = Endpoint::from_shared(opts.coordinator.clone())
        .map_err(|_| Error::Address(opts.coordinator.clone()))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    let bearer: Option<tonic::metadata::AsciiMetadataValue> = match &opts.token {
        Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| Error::Token)?),
        None => None,
    };
    let mut state = State::default();
    let mut backoff = FIRST_BACKOFF;
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        let ended = match endpoint.connect().await {
            Ok(channel) => {
                session(
                    &channel,
                    bearer.as_ref(),
                    &probe,
                    &opts,
                    &mut state,
                    &mut stop,
                )
                .await
            }
            Err(e) => Ended::Broken(format!("cannot connect to {}: {e}", opts.coordinator)),
        };
        match ended {
            Ended::Shutdown => return Ok(()),
            Ended::Fatal(why) => return Err(Error::Refused(why)),
            Ended::Broken(why) => tracing::warn!(reason = %why, "no session; reconnecting"),
        }
        // A session that was up resets the backoff.
        if std::mem::take(&mut state.joined) {
            backoff = FIRST_BACKOFF;
        }
        // Jitter: a fleet cut off at once does not come back at once.
        let wait = backoff.mul_f64(0.5 + jitter() / 2.0);
        backoff = (backoff * 2).min(opts.max_backoff);
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => return Ok(()),
        }
    }
}

/// One stream: register, then heartbeat until it breaks or the worker stops.
async fn session(
    channel: &Channel,
    bearer: Option<&tonic::metadata::AsciiMetadataValue>,
    probe: &Probe,
    opts: &Options,
    state: &mut State,
    stop: &mut watch::Receiver<bool>,
) -> Ended {
    match stream(channel, bearer, probe, opts, state, stop).await {
        Ok(e) | Err(e) => e,
    }
}

async fn stream(
    channel: &Channel,
    bearer: Option<&tonic::metadata::AsciiMetadataValue>,
    probe: &Probe,
    opts: &Options,
    state: &mut State,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ended, Ended> {
    let (tx, rx) = mpsc::channel::<pb::WorkerMessage>(16);
    let send = |m: Out| pb::WorkerMessage { msg: Some(m) };
    tx.send(send(Out::Register(register(probe, opts, state))))
        .await
        .map_err(|_| Ended::Broken("the outbound queue closed".into()))?;
    let mut req = tonic::Request::new(ReceiverStream::new(rx));
    if let Some(b) = bearer {
        req.metadata_mut().insert("authorization", b.clone());
    }
    let mut client = pb::workers_client::WorkersClient::new(channel.clone());
    let mut inbound = match client.session(req).await {
        Ok(r) => r.into_inner(),
        Err(s) if fatal(&s) => return Err(Ended::Fatal(s.message().to_string())),
        Err(s) => return Err(Ended::Broken(format!("{:?}: {}", s.code(), s.message()))),
    };
    let granted = match inbound.next().await {
        Some(Ok(pb::CoordinatorMessage {
            msg: Some(In::Granted(g)),
        })) => g,
        Some(Ok(_)) => {
            return Err(Ended::Broken(
                "the coordinator answered out of order".into(),
            ));
        }
        Some(Err(s)) => return Err(Ended::Broken(s.message().to_string())),
        None => return Err(Ended::Broken("the coordinator closed the stream".into())),
    };
    state.joined = true;
    let before = state.session.replace(granted.session_id.clone());
    for l in &granted.lost {
        state.leases.remove(&l.lease_id);
    }
    for l in &granted.kept {
        state.leases.insert(l.lease_id.clone(), l.token);
    }
    if granted.resumed {
        tracing::info!(session = %granted.session_id, kept = granted.kept.len(), "session resumed");
    } else {
        if let Some(old) = before {
            tracing::warn!(
                old = %old,
                session = %granted.session_id,
                lost = granted.lost.len(),
                "the coordinator no longer knew this session: registered again, its leases are gone"
            );
        }
        state.leases.clear();
        println!(
            "joined {} as {} (session {})",
            opts.coordinator, granted.name, granted.session_id
        );
    }
    if granted.draining {
        tracing::warn!("this worker is drained: it takes no new work");
    }
    let interval = Duration::from_millis(granted.heartbeat_interval_ms.max(10));
    let timeout = Duration::from_millis(granted.session_timeout_ms.max(30));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut heard = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if heard.elapsed() > timeout {
                    return Err(Ended::Broken(format!(
                        "no answer from the coordinator for {}",
                        humantime::format_duration(timeout)
                    )));
                }
                seq += 1;
                if tx.send(send(Out::Heartbeat(pb::Heartbeat { seq }))).await.is_err() {
                    return Err(Ended::Broken("the outbound stream closed".into()));
                }
            }
            m = inbound.next() => match m {
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Ack(_)) })) => heard = Instant::now(),
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Lost(l)) })) => {
                    heard = Instant::now();
                    state.leases.retain(|_, t| *t != l.token);
                    tracing::warn!(task = %l.task, token = l.token, reason = %l.reason, "lease lost: stop its work");
                }
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Drain(d)) })) => {
                    heard = Instant::now();
                    if d.draining {
                        tracing::warn!("drained by an operator: taking no new work");
                    } else {
                        tracing::info!("an operator undid the drain: taking work again");
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(s)) => {
                    if fatal(&s) {
                        return Err(Ended::Fatal(s.message().to_string()));
                    }
                    // A session the coordinator ended cannot be resumed: start afresh.
                    if s.code() == tonic::Code::NotFound || s.code() == tonic::Code::Aborted {
                        state.session = None;
                    }
                    return Err(Ended::Broken(format!("{:?}: {}", s.code(), s.message())));
                }
                None => return Err(Ended::Broken("the coordinator closed the stream".into())),
            },
            _ = stop.changed() => {
                // Goodbye: the session ends now and its leases are released at once, rather
                // than after the session timeout.
                let _ = tx.send(send(Out::Deregister(pb::Deregister {}))).await;
                let _ = tokio::time::timeout(DEREGISTER_WAIT, async {
                    while let Some(Ok(_)) = inbound.next().await {}
                })
                .await;
                println!("left {} (session {})", opts.coordinator, granted.session_id);
                return Ok(Ended::Shutdown);
            }
        }
    }
}
