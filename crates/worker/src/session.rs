//! The worker's one session with the coordinator: register (or resume), heartbeat, hear
//! lease losses and drains, reconnect with exponential backoff and jitter, deregister on
//! `SIGTERM`.
//!
//! The session is what keeps this worker's leases alive: if it cannot heartbeat for the
//! session timeout, the coordinator ends every lease it holds. So a broken stream is resumed
//! at once (same session id, the leases it still holds listed, and its runs: those still
//! going and those whose `stopped` is not yet sent, so that a restarted coordinator adopts
//! them), and a session the coordinator no longer knows is replaced by a fresh one, its
//! leases reported lost. A run whose lease the resume reports lost is stopped.
//!
//! Given several coordinators (`store = etcd`), every (re)connect first finds the leader
//! (`crate::leader`) and the session goes there; the runs' `Work` calls follow the same
//! handle. Agents keep running while no coordinator leads, and the new leader is resumed
//! exactly as a restarted coordinator is: it rebuilt the session from the leases it owns.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as In;
use pb::worker_message::Msg as Out;
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::agent::{RunState, StopReason};
use crate::leader::Leader;
use crate::probe::Probe;
use crate::work::Runner;
use automaton_proto::vocab::RunVocab;

/// How a session ends for good.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The coordinator refused this worker for a reason retrying cannot fix (a bad or missing
    /// token, a name that is not its own, an invalid registration).
    #[error("the coordinator refused this worker: {0}")]
    Refused(String),
    /// A coordinator URL the worker cannot use (the message names it and says what to write).
    #[error("{0}")]
    Address(String),
    #[error(
        "the worker token holds characters a header cannot carry: check --token or --token-file"
    )]
    Token,
}

/// What the worker registers with, and how it connects.
#[derive(Debug, Clone)]
pub struct Options {
    /// The coordinators given (one, or the several of a `store = etcd` fleet).
    pub coordinators: Vec<String>,
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
/// How long the runs may take to stop at shutdown (the agent's grace is within it).
const RUNS_STOP_WAIT: Duration = Duration::from_secs(10);
/// How long one search for the leader among several coordinators may take: an election
/// (the leadership TTL, 5 s by default) may be under way; the reconnect backoff goes around
/// it, so a longer one is only tried again.
const FIND_WAIT: Duration = Duration::from_secs(5);

/// What this worker knows of its session.
#[derive(Debug, Default)]
struct State {
    session: Option<String>,
    /// A session was granted since the last reconnect.
    joined: bool,
    /// lease id → token, as the coordinator last said.
    leases: BTreeMap<String, u64>,
    /// The runs in progress, by lease id: they outlive a broken stream (the session is
    /// resumed with their leases).
    runs: HashMap<String, RunHandle>,
    /// Run updates not yet sent (the stream broke): sent first on the next stream.
    pending: VecDeque<pb::RunUpdate>,
    draining: bool,
}

#[derive(Debug)]
struct RunHandle {
    task: String,
    token: u64,
    /// The state it works in, and the run state it last reported (for a resume's report).
    phase: String,
    reported: RunState,
    stop: watch::Sender<Option<StopReason>>,
    /// Set by the run once all it sends is sent but the phase's completion: from then on the
    /// coordinator may offer this worker new work before the run has said it stopped.
    finishing: Arc<std::sync::atomic::AtomicBool>,
}

impl State {
    /// Tells every run matching `which` to stop with `reason`.
    /// The first reason a run is told is the one it stops with (an operator's stop is
    /// followed by the loss of the lease it ended: the run stays `operator_stopped`).
    fn stop_runs(&self, reason: StopReason, which: impl Fn(&RunHandle) -> bool) {
        for r in self.runs.values().filter(|r| which(r)) {
            r.stop.send_if_modified(|v| {
                if v.is_some() {
                    return false;
                }
                *v = Some(reason);
                true
            });
        }
    }
}

/// What running work needs: the agent runner (none: this worker takes no work), where the
/// `Work` calls go (the leader, as the session last found it), and the runs' updates on
/// their way to the session.
pub struct Work {
    pub runner: Option<Arc<Runner>>,
    leader: Option<Leader>,
    updates_tx: mpsc::UnboundedSender<pb::RunUpdate>,
    updates_rx: mpsc::UnboundedReceiver<pb::RunUpdate>,
}

impl Work {
    pub fn new(runner: Option<Arc<Runner>>) -> Work {
        let (updates_tx, updates_rx) = mpsc::unbounded_channel();
        Work {
            runner,
            leader: None,
            updates_tx,
            updates_rx,
        }
    }
}

/// Why one connection ended.
enum Ended {
    /// Asked to stop: deregistered (or tried to).
    Shutdown,
    /// The stream broke or was ended by the coordinator (or refused by a follower):
    /// reconnect.
    Broken(String),
    /// Refused for a reason retrying cannot cure.
    Fatal(String),
}

fn register(probe: &Probe, opts: &Options, state: &State, work_enabled: bool) -> pb::Register {
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
        // A worker without an agent holds its session but is offered no work.
        capacity: if work_enabled { opts.capacity } else { 0 },
        version: env!("CARGO_PKG_VERSION").into(),
        simulated: probe.simulated,
        ram_bytes: probe.ram_bytes,
        cpus: probe.cpus,
        resume_session_id: state.session.clone().unwrap_or_default(),
        runs: runs_report(state),
        reports_runs: true,
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

/// The runs a resume reports: each still going, as last reported, and each whose `stopped`
/// waits to be sent.
fn runs_report(state: &State) -> Vec<pb::RunUpdate> {
    let going = state.runs.iter().map(|(lease_id, r)| {
        let mut u = pb::RunUpdate {
            lease_id: lease_id.clone(),
            token: r.token,
            task: r.task.clone(),
            phase: r.phase.clone(),
            exit_code: -1,
            ..Default::default()
        };
        u.set_state_kind(r.reported);
        u
    });
    let stopped = state
        .pending
        .iter()
        .filter(|u| u.state_kind() == Some(RunState::Stopped))
        .cloned();
    going.chain(stopped).collect()
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
    mut work: Work,
    mut stop: watch::Receiver<bool>,
) -> Result<(), Error> {
    let leader = Leader::new(opts.coordinators.clone()).map_err(Error::Address)?;
    let bearer: Option<tonic::metadata::AsciiMetadataValue> = match &opts.token {
        Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| Error::Token)?),
        None => None,
    };
    // The `Work` calls go through the same handle: they reconnect on their own across
    // session streams, and follow the session to each new leader.
    work.leader = Some(leader.clone());
    let mut state = State::default();
    let mut backoff = FIRST_BACKOFF;
    loop {
        if *stop.borrow() {
            return Ok(());
        }
        // Racing the stop: a search during an election may take seconds. (One coordinator
        // is found at once, and `biased` takes it: then, as ever, a stop that comes while
        // connecting is heard on the stream, which says goodbye.)
        let found = tokio::select! {
            biased;
            f = leader.find(FIND_WAIT) => f,
            _ = stop.changed() => {
                // No stream to say goodbye on: stop the runs; their leases end with the
                // session.
                state.stop_runs(StopReason::Shutdown, |_| true);
                return Ok(());
            }
        };
        let ended = match connect(found).await {
            Ok((url, channel)) => {
                session(
                    &channel,
                    &url,
                    &leader,
                    bearer.as_ref(),
                    &probe,
                    &opts,
                    &mut state,
                    &mut work,
                    &mut stop,
                )
                .await
            }
            Err(why) => Ended::Broken(why),
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
        // Jitter: a fleet cut off at once does not come back at once. A follower that named
        // the leader is no failure: the leader is tried next without the backoff growing.
        let wait = if leader.named() {
            FIRST_BACKOFF.mul_f64(0.5 + jitter() / 2.0)
        } else {
            let w = backoff.mul_f64(0.5 + jitter() / 2.0);
            backoff = (backoff * 2).min(opts.max_backoff);
            w
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.changed() => {
                // No stream to say goodbye on: stop the runs; their leases end with the
                // session.
                state.stop_runs(StopReason::Shutdown, |_| true);
                return Ok(());
            }
        }
    }
}

/// Connects to the coordinator found to hold the session with (the leader, when several
/// were given).
async fn connect(found: Result<String, String>) -> Result<(String, Channel), String> {
    let url = found?;
    let channel = crate::leader::endpoint(&url)?
        .connect()
        .await
        .map_err(|e| format!("cannot connect to {url}: {e}"))?;
    Ok((url, channel))
}

/// One stream to `url`: register, then heartbeat until it breaks or the worker stops.
#[allow(clippy::too_many_arguments)]
async fn session(
    channel: &Channel,
    url: &str,
    leader: &Leader,
    bearer: Option<&tonic::metadata::AsciiMetadataValue>,
    probe: &Probe,
    opts: &Options,
    state: &mut State,
    work: &mut Work,
    stop: &mut watch::Receiver<bool>,
) -> Ended {
    let ended = stream(channel, url, leader, bearer, probe, opts, state, work, stop).await;
    crate::metrics::METRICS.connected.set(0);
    match ended {
        Ok(e) | Err(e) => e,
    }
}

#[allow(clippy::too_many_arguments)]
async fn stream(
    channel: &Channel,
    url: &str,
    leader: &Leader,
    bearer: Option<&tonic::metadata::AsciiMetadataValue>,
    probe: &Probe,
    opts: &Options,
    state: &mut State,
    work: &mut Work,
    stop: &mut watch::Receiver<bool>,
) -> Result<Ended, Ended> {
    let (tx, rx) = mpsc::channel::<pb::WorkerMessage>(64);
    let send = |m: Out| pb::WorkerMessage { msg: Some(m) };
    tx.send(send(Out::Register(register(
        probe,
        opts,
        state,
        work.runner.is_some(),
    ))))
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
        Err(s) => {
            // A follower names the leader: the next connect goes there.
            leader.follow(&s);
            return Err(Ended::Broken(format!("{:?}: {}", s.code(), s.message())));
        }
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
        Some(Err(s)) => {
            leader.follow(&s);
            return Err(Ended::Broken(s.message().to_string()));
        }
        None => return Err(Ended::Broken("the coordinator closed the stream".into())),
    };
    state.joined = true;
    crate::metrics::METRICS.connected.set(1);
    let before = state.session.replace(granted.session_id.clone());
    for l in &granted.lost {
        state.leases.remove(&l.lease_id);
        // Its run's work would be refused: stop it (one that completed its phase already
        // ended its lease itself: nothing to stop).
        if let Some(r) = state.runs.get(&l.lease_id)
            && r.token == l.token
            && granted.resumed
            && !r.finishing.load(std::sync::atomic::Ordering::Acquire)
        {
            tracing::warn!(task = %r.task, token = r.token, "the resumed session lost this run's lease: stop its work");
            state.stop_runs(StopReason::LeaseLost, |x| {
                x.token == l.token && x.task == r.task
            });
        }
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
        // Their leases are gone with the old session: stop them.
        state.stop_runs(StopReason::LeaseLost, |_| true);
        println!(
            "joined {url} as {} (session {})",
            granted.name, granted.session_id
        );
    }
    state.draining = granted.draining;
    if granted.draining {
        tracing::warn!("this worker is drained: it takes no new work");
    }
    // Updates a broken stream could not carry.
    while let Some(u) = state.pending.pop_front() {
        if tx.send(send(Out::Run(u.clone()))).await.is_err() {
            state.pending.push_front(u);
            return Err(Ended::Broken("the outbound stream closed".into()));
        }
    }
    let interval =
        wire_duration(granted.heartbeat_interval.as_ref()).max(Duration::from_millis(10));
    let timeout = wire_duration(granted.session_timeout.as_ref()).max(Duration::from_millis(30));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0u64;
    let mut heard = Instant::now();
    // The last heartbeat sent and when, for its round trip.
    let mut sent: Option<(u64, Instant)> = None;
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
                sent = Some((seq, Instant::now()));
                if tx.send(send(Out::Heartbeat(pb::Heartbeat { seq }))).await.is_err() {
                    return Err(Ended::Broken("the outbound stream closed".into()));
                }
            }
            m = inbound.next() => match m {
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Ack(a)) })) => {
                    heard = Instant::now();
                    if let Some((s, at)) = sent
                        && s == a.seq
                    {
                        crate::metrics::METRICS.heartbeat_rtt.observe(heard.duration_since(at));
                        sent = None;
                    }
                }
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Lost(l)) })) => {
                    heard = Instant::now();
                    state.leases.retain(|_, t| *t != l.token);
                    // A run that completed its phase ended its own lease: nothing to stop.
                    let working = state.runs.values().any(|r| {
                        r.token == l.token
                            && r.task == l.task
                            && !r.finishing.load(std::sync::atomic::Ordering::Acquire)
                    });
                    if working {
                        tracing::warn!(task = %l.task, token = l.token, reason = %l.reason, "lease lost: stop its work");
                        state.stop_runs(StopReason::LeaseLost, |r| r.token == l.token && r.task == l.task);
                    } else {
                        tracing::debug!(task = %l.task, token = l.token, reason = %l.reason, "lease ended");
                    }
                }
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Stop(s)) })) => {
                    heard = Instant::now();
                    // A person's stop is said so; anything else ends the lease under the run.
                    let reason = match s.reason.parse() {
                        Ok(StopReason::OperatorStopped) => StopReason::OperatorStopped,
                        _ => StopReason::LeaseLost,
                    };
                    tracing::warn!(task = %s.task, reason = %s.reason, "told to stop a run");
                    state.stop_runs(reason, |r| r.task == s.task);
                }
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Assign(a)) })) => {
                    heard = Instant::now();
                    let answer = take(a, opts, state, work);
                    if tx.send(send(Out::Answer(answer))).await.is_err() {
                        return Err(Ended::Broken("the outbound stream closed".into()));
                    }
                }
                Some(Ok(pb::CoordinatorMessage { msg: Some(In::Drain(d)) })) => {
                    heard = Instant::now();
                    state.draining = d.draining;
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
                    // A leader that stepped down names its successor.
                    leader.follow(&s);
                    // A session the coordinator ended cannot be resumed: start afresh. Its
                    // leases are gone with it: any run under them stops.
                    if s.code() == tonic::Code::NotFound || s.code() == tonic::Code::Aborted {
                        state.session = None;
                        tracing::warn!(reason = %s.message(), "the coordinator ended this session: its leases are gone; registering again");
                        state.stop_runs(StopReason::LeaseLost, |_| true);
                    }
                    return Err(Ended::Broken(format!("{:?}: {}", s.code(), s.message())));
                }
                None => return Err(Ended::Broken("the coordinator closed the stream".into())),
            },
            u = work.updates_rx.recv() => {
                let Some(u) = u else { continue };
                match u.state_kind() {
                    Some(RunState::Stopped) => {
                        state.runs.remove(&u.lease_id);
                    }
                    Some(s) => {
                        if let Some(r) = state.runs.get_mut(&u.lease_id) {
                            r.reported = s;
                        }
                    }
                    None => {}
                }
                if tx.send(send(Out::Run(u.clone()))).await.is_err() {
                    state.pending.push_back(u);
                    return Err(Ended::Broken("the outbound stream closed".into()));
                }
            }
            _ = stop.changed() => {
                // Stop the runs (their agents killed, nothing sent), report them, then say
                // goodbye: the session ends now and its leases are released at once, rather
                // than after the session timeout.
                state.stop_runs(StopReason::Shutdown, |_| true);
                let _ = tokio::time::timeout(RUNS_STOP_WAIT, async {
                    while !state.runs.is_empty() {
                        let Some(u) = work.updates_rx.recv().await else { break };
                        if u.state_kind() == Some(RunState::Stopped) {
                            state.runs.remove(&u.lease_id);
                        }
                        let _ = tx.send(send(Out::Run(u))).await;
                    }
                })
                .await;
                let _ = tx.send(send(Out::Deregister(pb::Deregister {}))).await;
                let _ = tokio::time::timeout(DEREGISTER_WAIT, async {
                    while let Some(Ok(_)) = inbound.next().await {}
                })
                .await;
                println!("left {url} (session {})", granted.session_id);
                return Ok(Ended::Shutdown);
            }
        }
    }
}

/// Takes an assignment (starting its run) or refuses it, saying why.
fn take(a: pb::Assignment, opts: &Options, state: &mut State, work: &Work) -> pb::AssignmentAnswer {
    let lease_id = a
        .lease
        .as_ref()
        .map(|l| l.lease_id.clone())
        .unwrap_or_default();
    let refuse = |reason: &str| pb::AssignmentAnswer {
        lease_id: lease_id.clone(),
        accepted: false,
        reason: reason.into(),
    };
    let (Some(runner), Some(leader), Some(lease)) =
        (work.runner.clone(), work.leader.clone(), a.lease.clone())
    else {
        return refuse("this worker has no agent (start it with --agent)");
    };
    if state.draining {
        return refuse("draining");
    }
    let busy = state
        .runs
        .values()
        .filter(|r| !r.finishing.load(std::sync::atomic::Ordering::Acquire))
        .count();
    if busy >= opts.capacity as usize {
        return refuse("busy");
    }
    tracing::info!(task = %a.task, phase = %a.phase, token = lease.token, why = %a.why, "assignment taken");
    let (stop_tx, stop_rx) = watch::channel(None);
    let finishing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    state.runs.insert(
        lease.lease_id.clone(),
        RunHandle {
            task: a.task.clone(),
            token: lease.token,
            phase: a.phase.clone(),
            reported: RunState::Requested,
            stop: stop_tx,
            finishing: finishing.clone(),
        },
    );
    state.leases.insert(lease.lease_id.clone(), lease.token);
    tokio::spawn(crate::work::run(
        runner,
        leader,
        a,
        stop_rx,
        work.updates_tx.clone(),
        finishing,
    ));
    pb::AssignmentAnswer {
        lease_id,
        accepted: true,
        reason: String::new(),
    }
}

/// A length of time the coordinator sent; zero when unset or negative (callers floor it).
/// The longest duration the worker takes from the wire (a heartbeat interval, a session
/// timeout, a phase's time limit): a year. Anything longer is a year, so timers built from it
/// (`Instant + d`) cannot overflow whatever a coordinator sends.
pub(crate) const WIRE_DURATION_MAX: Duration = Duration::from_secs(365 * 24 * 3600);

/// A duration from the wire: 0 when unset or negative, at most `WIRE_DURATION_MAX`.
pub(crate) fn wire_duration(d: Option<&automaton_proto::prost_types::Duration>) -> Duration {
    d.and_then(|d| Duration::try_from(*d).ok())
        .unwrap_or_default()
        .min(WIRE_DURATION_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use automaton_proto::prost_types;

    #[tokio::test]
    async fn a_huge_or_negative_wire_duration_is_bounded_and_a_timer_built_from_it_does_not_panic()
    {
        let huge = prost_types::Duration {
            seconds: i64::MAX,
            nanos: 999_999_999,
        };
        let d = wire_duration(Some(&huge));
        assert_eq!(d, WIRE_DURATION_MAX);
        // What the heartbeat loop does with it: an interval (its second tick computes
        // `now + period`) and a deadline.
        let mut tick = tokio::time::interval(d);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        let _deadline = tokio::time::Instant::now() + d;
        let negative = prost_types::Duration {
            seconds: -5,
            nanos: 0,
        };
        assert_eq!(wire_duration(Some(&negative)), Duration::ZERO);
        assert_eq!(wire_duration(None), Duration::ZERO);
    }
}
