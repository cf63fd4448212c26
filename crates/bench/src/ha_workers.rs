//! `automaton-bench workers --failover`: N worker sessions on an HA pair of coordinators,
//! across a `kill -9` of the leader.
//!
//! For each session count N: a 3-member etcd cluster and two coordinators with `--store
//! etcd` (`failover::start_pair`; `--heartbeat-interval` = `--heartbeat`, `--session-timeout`
//! = 5× it), N tasks created through the leader. The simulated sessions are the `workers`
//! bench's (capacity 0, heartbeats on the grid), each on its own connections, given both
//! coordinators' addresses: a session opens where it is told the leader is (a follower's
//! `automaton-leader`; any other refusal, or a refused connection, moves on to the next
//! address after a pause of 100–200 ms) and claims its task in its session. After
//! `--duration` of heartbeats the leader is killed with SIGKILL at T0. Every session's
//! stream breaks; it finds the new leader the same way and registers again with
//! `resume_session_id` and its lease. Per session: T0 → its `SessionGranted` (resume time),
//! whether the grant says `resumed` and keeps its lease, and a heartbeat acked after it.
//! Once all are back, each task's lease is read from the new leader: the same lease id,
//! token and session as before the kill, or it is counted lost.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as Out;
use pb::worker_message::Msg as In;
use serde::Serialize;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::failover::start_pair;
use crate::ha::{self, Cluster, Node};
use crate::stats::fmt_ms;
use crate::workers::{
    Percentiles, TIMEOUT_FACTOR, WorkersArgs, next_message, wire_duration, worker_name,
};
use crate::{coord, spawn};

/// The pause before a session tries the next address, plus up to as much again (spread so
/// N sessions do not knock in step).
const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// The lease each session holds: long enough to outlive the run without renewals.
const LEASE_TTL_S: i64 = 600;
/// How long the sessions may take to come back after the kill.
const BACK_WITHIN: Duration = Duration::from_secs(120);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Run,
    Stop,
}

/// What a session reports once it is up.
struct Up {
    index: usize,
    session_id: String,
    lease: pb::Lease,
    heartbeat: Duration,
    timeout: Duration,
}

/// A session's grant after the kill.
struct Back {
    at: Instant,
    resumed: bool,
    kept_own: bool,
    lost: usize,
    session_id: String,
    url: String,
}

#[derive(Default)]
struct SessionOut {
    /// The first grant after the stream broke (None: it never came back).
    back: Option<Back>,
    /// Opens tried until then.
    attempts: u32,
    /// Heartbeats acked after coming back.
    acks_after: u32,
    /// A failure before the kill, or one that ended the session.
    error: Option<String>,
    /// Streams that broke (1 with a single failover).
    breaks: u32,
}

/// Why an open failed: the coordinator's refusal, or the transport's.
enum OpenError {
    Status(tonic::Status),
    Other(String),
}

type Stream = (
    mpsc::Sender<pb::WorkerMessage>,
    tonic::Streaming<pb::CoordinatorMessage>,
    pb::SessionGranted,
);

/// Opens a session on `channel`: `register` first, then the grant.
async fn open_on(channel: &Channel, register: pb::Register) -> Result<Stream, OpenError> {
    let mut client = pb::workers_client::WorkersClient::new(channel.clone());
    let (tx, rx) = mpsc::channel::<pb::WorkerMessage>(4);
    tx.send(pb::WorkerMessage {
        msg: Some(In::Register(register)),
    })
    .await
    .map_err(|_| OpenError::Other("queue Register".into()))?;
    let opened = tokio::time::timeout(
        Duration::from_secs(5),
        client.session(ReceiverStream::new(rx)),
    )
    .await
    .map_err(|_| OpenError::Other("no answer within 5 s".into()))?;
    let mut inbound = opened.map_err(OpenError::Status)?.into_inner();
    let first = tokio::time::timeout(Duration::from_secs(5), next_message(&mut inbound))
        .await
        .map_err(|_| OpenError::Other("no grant within 5 s".into()))?;
    match first {
        Ok(Some(Out::Granted(g))) => Ok((tx, inbound, g)),
        Ok(other) => Err(OpenError::Other(format!(
            "expected SessionGranted, got {other:?}"
        ))),
        Err(e) => Err(OpenError::Other(format!("{e:#}"))),
    }
}

/// A small deterministic spread for session `i`'s `n`-th pause.
fn jitter(i: usize, n: u32) -> Duration {
    let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ u64::from(n).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 31;
    RETRY_PAUSE.mul_f64((x % 1000) as f64 / 1000.0)
}

/// Opens a session where the leader is among `nodes`, starting at `*at` and following
/// `automaton-leader`; `*at` is left on the one that granted it.
async fn open_following(
    index: usize,
    nodes: &[(String, Channel)],
    at: &mut usize,
    register: &pb::Register,
    attempts: &mut u32,
    deadline: Instant,
) -> Result<Stream> {
    loop {
        *attempts += 1;
        let (url, channel) = &nodes[*at];
        let last = match open_on(channel, register.clone()).await {
            Ok(s) => return Ok(s),
            Err(OpenError::Status(s)) => {
                if let Some(leader) = automaton_client::leader_named(&s)
                    && let Some(i) = nodes.iter().position(|(u, _)| *u == leader)
                    && i != *at
                {
                    *at = i;
                    continue;
                }
                if s.code() == tonic::Code::AlreadyExists
                    || s.code() == tonic::Code::InvalidArgument
                {
                    bail!("{url} refused the session: {:?}: {}", s.code(), s.message());
                }
                format!("{url}: {:?}: {}", s.code(), s.message())
            }
            Err(OpenError::Other(e)) => format!("{url}: {e}"),
        };
        if Instant::now() >= deadline {
            bail!("no coordinator granted the session ({attempts} tries; last: {last})");
        }
        *at = (*at + 1) % nodes.len();
        tokio::time::sleep(RETRY_PAUSE + jitter(index, *attempts)).await;
    }
}

/// One simulated worker: opens, claims its task in its session, heartbeats on the grid,
/// and after a broken stream finds the leader and resumes with its lease.
#[allow(clippy::too_many_arguments)]
async fn session(
    index: usize,
    n: usize,
    nodes: Vec<(String, Channel)>,
    first_leader: usize,
    task: String,
    connecting: Arc<Semaphore>,
    epoch: Instant,
    up: mpsc::UnboundedSender<Result<Up, String>>,
    back_tx: mpsc::UnboundedSender<usize>,
    mut phase: watch::Receiver<Phase>,
) -> SessionOut {
    let mut out = SessionOut::default();
    let name = worker_name(index);
    let register = pb::Register {
        name: name.clone(),
        host: "bench".into(),
        capacity: 0,
        version: "bench".into(),
        simulated: true,
        replace: true,
        ..Default::default()
    };
    let mut at = first_leader;
    let mut attempts = 0;
    let permit = connecting.acquire_owned().await;
    let deadline = Instant::now() + Duration::from_secs(300);
    let opened = open_following(index, &nodes, &mut at, &register, &mut attempts, deadline).await;
    let (mut tx, mut inbound, granted) = match opened {
        Ok(s) => s,
        Err(e) => {
            let msg = format!("session {index}: {e:#}");
            let _ = up.send(Err(msg.clone()));
            out.error = Some(msg);
            return out;
        }
    };
    let session_id = granted.session_id.clone();
    let claimed = pb::leases_client::LeasesClient::new(nodes[at].1.clone())
        .claim(pb::ClaimRequest {
            task: task.clone(),
            agent: name.clone(),
            session_id: session_id.clone(),
            ttl: Some(automaton_proto::prost_types::Duration {
                seconds: LEASE_TTL_S,
                nanos: 0,
            }),
        })
        .await;
    drop(permit);
    let lease = match claimed {
        Ok(l) => l.into_inner(),
        Err(s) => {
            let msg = format!(
                "session {index}: claim {task}: {:?}: {}",
                s.code(),
                s.message()
            );
            let _ = up.send(Err(msg.clone()));
            out.error = Some(msg);
            return out;
        }
    };
    let held = pb::HeldLease {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
    };
    let interval = wire_duration(granted.heartbeat_interval.as_ref()).max(Duration::from_millis(1));
    let _ = up.send(Ok(Up {
        index,
        session_id: session_id.clone(),
        lease,
        heartbeat: interval,
        timeout: wire_duration(granted.session_timeout.as_ref()),
    }));
    let offset = interval.mul_f64(index as f64 / n.max(1) as f64);
    let now = Instant::now();
    let mut first = epoch + offset;
    if first < now {
        let behind = (now - first).as_nanos() / interval.as_nanos().max(1);
        first += interval * (behind as u32 + 1);
    }
    let mut tick = tokio::time::interval_at(first.into(), interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut seq = 0u64;
    attempts = 0;
    loop {
        let broke = tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                let hb = pb::WorkerMessage { msg: Some(In::Heartbeat(pb::Heartbeat { seq })) };
                if tx.send(hb).await.is_err() {
                    true
                } else {
                    let acked = loop {
                        match next_message(&mut inbound).await {
                            Ok(Some(Out::Ack(a))) if a.seq == seq => break true,
                            Ok(Some(_)) => continue,
                            Ok(None) | Err(_) => break false,
                        }
                    };
                    if acked && out.back.is_some() {
                        out.acks_after += 1;
                    }
                    !acked
                }
            }
            changed = phase.changed() => {
                if changed.is_err() || *phase.borrow() == Phase::Stop {
                    let bye = pb::WorkerMessage { msg: Some(In::Deregister(pb::Deregister {})) };
                    if tx.send(bye).await.is_ok() {
                        let ended = async { while let Ok(Some(_)) = next_message(&mut inbound).await {} };
                        let _ = tokio::time::timeout(Duration::from_secs(5), ended).await;
                    }
                    return out;
                }
                false
            }
        };
        if !broke {
            continue;
        }
        // The stream broke: find the leader and resume with the lease.
        out.breaks += 1;
        let resume = pb::Register {
            resume_session_id: session_id.clone(),
            leases: vec![held.clone()],
            ..register.clone()
        };
        let deadline = Instant::now() + BACK_WITHIN;
        let reopened =
            open_following(index, &nodes, &mut at, &resume, &mut attempts, deadline).await;
        match reopened {
            Ok((t, i, g)) => {
                if out.back.is_none() {
                    out.back = Some(Back {
                        at: Instant::now(),
                        resumed: g.resumed,
                        kept_own: g
                            .kept
                            .iter()
                            .any(|k| k.lease_id == held.lease_id && k.token == held.token),
                        lost: g.lost.len(),
                        session_id: g.session_id.clone(),
                        url: nodes[at].0.clone(),
                    });
                    out.attempts = attempts;
                    let _ = back_tx.send(index);
                }
                tx = t;
                inbound = i;
            }
            Err(e) => {
                out.error = Some(format!("session {index}: {e:#}"));
                let _ = back_tx.send(index);
                return out;
            }
        }
    }
}

#[derive(Serialize, Clone)]
pub struct FailoverResult {
    sessions: usize,
    heartbeat_ms: u64,
    session_timeout_ms: u64,
    election_ttl_ms: u64,
    /// Seconds from the first connect to all N sessions granted and holding their lease.
    register_s: f64,
    killed: String,
    new_leader: Option<String>,
    /// T0 → the dead leader's key first seen gone / the next leader's key first seen.
    key_gone_s: Option<f64>,
    elected_s: Option<f64>,
    /// T0 → the new leader's log: elected, its folder rebuilt from etcd, serving.
    new_leader_term: ha::Term,
    /// Sessions granted again after the kill, and of those: `resumed` (the same session).
    back: usize,
    resumed: usize,
    /// Granted a new session instead (their lease is lost with the old one).
    new_sessions: usize,
    /// Sessions whose grant kept their own lease.
    leases_kept: usize,
    /// Leases a grant listed as lost, plus leases the new leader does not hold as before.
    leases_lost: usize,
    /// Tasks whose lease on the new leader is the one claimed before the kill (same id,
    /// token and session).
    leases_on_new_leader: usize,
    /// T0 → SessionGranted, over the sessions that came back.
    resume: Percentiles,
    /// Opens tried per session until it was back (p50, p99 and max as counts).
    attempts_p50: u32,
    attempts_max: u32,
    /// Sessions with a heartbeat acked after coming back.
    heartbeating_after: usize,
    session_errors: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_error: Option<String>,
    /// Every session back, resumed with its lease, none lost.
    met: bool,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    etcd_flags: Vec<&'static str>,
    results: Vec<FailoverResult>,
}

pub async fn run(args: &WorkersArgs) -> Result<()> {
    let mut results = Vec::new();
    for &n in &args.sessions {
        let scratch = spawn::scratch_dir()?;
        let mut cluster = None;
        let mut nodes = Vec::new();
        let outcome = one_count(args, n, &scratch, &mut cluster, &mut nodes).await;
        for node in &mut nodes {
            if let Some(how) = node.stop() {
                eprintln!("{how} (log: {})", node.log().display());
            }
        }
        if let Some(c) = cluster.as_mut() {
            c.stop();
        }
        if args.keep_temp || outcome.is_err() {
            eprintln!("kept {}", scratch.display());
        } else {
            let _ = std::fs::remove_dir_all(&scratch);
        }
        let r = outcome?;
        eprintln!(
            "{}",
            table(std::slice::from_ref(&r)).lines().nth(1).unwrap_or("")
        );
        results.push(r);
    }
    print!("{}", table(&results));
    if let Some(path) = &args.json_out {
        let report = Report {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
            etcd_flags: spawn::RAFT_FLAGS.to_vec(),
            results,
        };
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn one_count(
    args: &WorkersArgs,
    n: usize,
    scratch: &std::path::Path,
    cluster: &mut Option<Cluster>,
    nodes: &mut Vec<Node>,
) -> Result<FailoverResult> {
    let bin = args
        .spawn_coordinator
        .as_ref()
        .context("--failover needs --spawn-coordinator")?;
    let hb_ms = args.heartbeat.as_millis() as u64;
    let extra = vec![
        "--heartbeat-interval".to_string(),
        format!("{hb_ms}ms"),
        "--session-timeout".to_string(),
        format!("{}ms", hb_ms * TIMEOUT_FACTOR as u64),
    ];
    start_pair(
        bin,
        &args.etcd_bin,
        scratch,
        args.election_ttl,
        &extra,
        cluster,
        nodes,
    )
    .await?;
    let cluster = cluster.as_ref().context("no cluster")?;
    let l = ha::leader_of(nodes, Duration::from_secs(60)).await?;
    let (prepared, secs) = coord::prepare(&[nodes[l].channel.clone()], n, 1, 16).await?;
    eprintln!("  N={n}: prepared {prepared} tasks on the leader in {secs:.2}s");
    let task = |i: usize| format!("bench-c{n}-{i}");

    let (phase_tx, phase_rx) = watch::channel(Phase::Run);
    let (up_tx, mut up_rx) = mpsc::unbounded_channel();
    let (back_tx, mut back_rx) = mpsc::unbounded_channel();
    let connecting = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
    let epoch = Instant::now();
    let urls: Vec<String> = nodes.iter().map(|n| n.url.clone()).collect();
    let mut handles = Vec::with_capacity(n);
    for i in 0..n {
        // Each session its own connections, to each coordinator.
        let own: Vec<(String, Channel)> = urls
            .iter()
            .map(|u| Ok((u.clone(), ha::lazy_channel(u)?)))
            .collect::<Result<_>>()?;
        handles.push(tokio::spawn(session(
            i,
            n,
            own,
            // Half start at the follower: they are sent on to the leader.
            i % urls.len(),
            task(i),
            connecting.clone(),
            epoch,
            up_tx.clone(),
            back_tx.clone(),
            phase_rx.clone(),
        )));
    }
    drop(up_tx);
    drop(back_tx);
    let mut ups: HashMap<usize, Up> = HashMap::new();
    let mut errors = Vec::new();
    let up_deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while ups.len() + errors.len() < n {
        match tokio::time::timeout_at(up_deadline, up_rx.recv()).await {
            Ok(Some(Ok(u))) => {
                ups.insert(u.index, u);
            }
            Ok(Some(Err(e))) => errors.push(e),
            Ok(None) => break,
            Err(_) => bail!("only {} of {n} sessions up within 300 s", ups.len()),
        }
    }
    let register_s = epoch.elapsed().as_secs_f64();
    if let Some(e) = errors.first() {
        let _ = phase_tx.send(Phase::Stop);
        bail!(
            "{} of {n} sessions failed to start; first: {e}",
            errors.len()
        );
    }
    let (heartbeat, timeout) = ups
        .values()
        .next()
        .map(|u| (u.heartbeat, u.timeout))
        .context("no session")?;
    eprintln!(
        "  N={n}: {n} sessions up, each holding its task's lease, in {register_s:.2}s (heartbeat {}, session timeout {})",
        fmt_ms(heartbeat.as_secs_f64() * 1e3),
        fmt_ms(timeout.as_secs_f64() * 1e3)
    );
    tokio::time::sleep(args.duration).await;

    // The failover.
    let (holder, old_revision) = cluster
        .leader_key_now()
        .await?
        .context("no leader key while a coordinator leads")?;
    let l = ha::leader_of(nodes, Duration::from_secs(10)).await?;
    if holder != nodes[l].url {
        bail!(
            "the leader key names {holder}, not the leader {}",
            nodes[l].url
        );
    }
    let watch = ha::watch_handover(
        cluster.client.clone(),
        old_revision,
        Duration::from_secs(60),
    );
    let killed = nodes[l].url.clone();
    let t0_wall = std::time::SystemTime::now();
    let t0 = Instant::now();
    nodes[l].kill9();
    eprintln!("  N={n}: killed the leader {killed} (kill -9)");
    let mut back = 0;
    let back_deadline = tokio::time::Instant::now() + BACK_WITHIN + Duration::from_secs(10);
    while back < n {
        match tokio::time::timeout_at(back_deadline, back_rx.recv()).await {
            Ok(Some(_)) => back += 1,
            Ok(None) | Err(_) => break,
        }
    }
    let handover = watch.await.context("the leader-key watch panicked")?;
    let term = ha::term_after(&nodes[1 - l].log(), t0_wall);
    eprintln!(
        "  N={n}: {back} of {n} sessions back {:.2}s after the kill",
        t0.elapsed().as_secs_f64()
    );
    // Heartbeats on the new leader.
    tokio::time::sleep(heartbeat * 2 + Duration::from_millis(200)).await;

    // The leases as the new leader holds them.
    let leader = ha::leader_of(nodes, Duration::from_secs(30)).await?;
    let mut tasks_client = pb::tasks_client::TasksClient::new(nodes[leader].channel.clone());
    let mut on_leader = 0;
    let mut missing = 0;
    for (i, u) in &ups {
        let detail = tasks_client
            .get_task(pb::GetTaskRequest {
                task: task(*i),
                ..Default::default()
            })
            .await
            .map_err(crate::rpc::status_err)
            .with_context(|| format!("GetTask {}", task(*i)))?
            .into_inner();
        match detail.lease {
            Some(l)
                if l.lease_id == u.lease.lease_id
                    && l.token == u.lease.token
                    && l.session_id == u.session_id =>
            {
                on_leader += 1
            }
            _ => missing += 1,
        }
    }
    let _ = phase_tx.send(Phase::Stop);
    let mut outs = Vec::with_capacity(n);
    for h in handles {
        outs.push(h.await.context("a session panicked")?);
    }

    let mut resume = Vec::new();
    let mut attempts = Vec::new();
    let (mut resumed, mut new_sessions, mut kept, mut lost_listed, mut after, mut errs) =
        (0, 0, 0, 0, 0, 0);
    let mut first_error = None;
    let mut new_leader = None;
    for (i, o) in outs.iter().enumerate() {
        if let Some(b) = &o.back {
            resume.push(b.at.saturating_duration_since(t0));
            attempts.push(o.attempts);
            let same = ups.get(&i).is_some_and(|u| u.session_id == b.session_id);
            if b.resumed && same {
                resumed += 1;
            } else {
                new_sessions += 1;
            }
            if b.kept_own {
                kept += 1;
            }
            lost_listed += b.lost;
            new_leader.get_or_insert_with(|| b.url.clone());
            if o.acks_after > 0 {
                after += 1;
            }
        }
        if let Some(e) = &o.error {
            errs += 1;
            first_error.get_or_insert_with(|| e.clone());
        }
        if o.breaks > 1 && first_error.is_none() {
            first_error = Some(format!("session {i}: its stream broke {} times", o.breaks));
        }
    }
    attempts.sort_unstable();
    let back_n = resume.len();
    let leases_lost = lost_listed + missing;
    Ok(FailoverResult {
        sessions: n,
        heartbeat_ms: heartbeat.as_millis() as u64,
        session_timeout_ms: timeout.as_millis() as u64,
        election_ttl_ms: args.election_ttl.as_millis() as u64,
        register_s,
        killed,
        new_leader,
        key_gone_s: ha::secs_since(t0, handover.gone),
        elected_s: ha::secs_since(t0, handover.elected),
        new_leader_term: term,
        back: back_n,
        resumed,
        new_sessions,
        leases_kept: kept,
        leases_lost,
        leases_on_new_leader: on_leader,
        resume: Percentiles::of(resume),
        attempts_p50: attempts.get(attempts.len() / 2).copied().unwrap_or(0),
        attempts_max: attempts.last().copied().unwrap_or(0),
        heartbeating_after: after,
        session_errors: errs,
        first_error,
        met: back_n == n && resumed == n && kept == n && leases_lost == 0 && on_leader == n,
    })
}

fn opt_s(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |s| format!("{s:.2}s"))
}

fn table(results: &[FailoverResult]) -> String {
    let mut out = format!(
        "{:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8}  all resumed, 0 lost\n",
        "sessions",
        "ttl",
        "key gone",
        "elected",
        "serving",
        "back",
        "resumed",
        "kept",
        "lost",
        "resume p50",
        "p99",
        "max",
        "on new",
        "hb after"
    );
    for r in results {
        out.push_str(&format!(
            "{:>8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} {:>9} {:>9} {:>9} {:>8} {:>8}  {}\n",
            r.sessions,
            fmt_ms(r.election_ttl_ms as f64),
            opt_s(r.key_gone_s),
            opt_s(r.elected_s),
            opt_s(r.new_leader_term.serving_s),
            r.back,
            r.resumed,
            r.leases_kept,
            r.leases_lost,
            fmt_ms(r.resume.p50_ms),
            fmt_ms(r.resume.p99_ms),
            fmt_ms(r.resume.max_ms),
            r.leases_on_new_leader,
            r.heartbeating_after,
            if r.met { "met" } else { "NOT met" },
        ));
        if let Some(e) = &r.first_error {
            out.push_str(&format!(
                "N={}: {} session error(s); first: {e}\n",
                r.sessions, r.session_errors
            ));
        }
    }
    out
}
