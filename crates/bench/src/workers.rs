//! `automaton-bench workers`: many worker sessions against one coordinator.
//!
//! For each session count N, this one process opens N `Workers.Session` streams, each on its
//! own HTTP/2 connection (its own tonic `Channel`), registers them, and heartbeats each on
//! the coordinator's interval, the sessions' start times spread over one interval. Over the
//! steady state (`--duration`, after all are registered) it measures the coordinator's CPU
//! (utime+stime from /proc/PID/stat), its resident memory (VmRSS sampled, peak and end), the
//! heartbeat round trip (Heartbeat sent → its HeartbeatAck), and this load process's own CPU,
//! since both share the machine's cores.
//!
//! Then K sessions (`--kill`) each claim one task in their session and all stop at once
//! (stream and connection dropped): the time from each one's last heartbeat ack to its
//! lease's `lease_expired`/`session_expired` event on `Events.WatchEvents` is the lease-end
//! latency, set against the session timeout.
//!
//! A spawned coordinator (`--spawn-coordinator`, fresh per session count) gets
//! `--heartbeat-interval` = `--heartbeat` and `--session-timeout` = 5× it. Its dispatcher
//! runs (its rounds look at every session), but the bench's sessions register capacity 0 —
//! they run no agent — so it offers them nothing and the bench claims in them itself.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as Out;
use pb::worker_message::Msg as In;
use serde::Serialize;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

/// A length of time the coordinator sent; zero when unset or negative.
pub(crate) fn wire_duration(d: Option<&automaton_proto::prost_types::Duration>) -> Duration {
    d.and_then(|d| Duration::try_from(*d).ok())
        .unwrap_or_default()
}

use crate::stats::fmt_ms;
use crate::{coord, parse_duration, spawn};

/// The session timeout a spawned coordinator gets, in heartbeat intervals.
pub(crate) const TIMEOUT_FACTOR: u32 = 5;
/// The lease-end target: within the session timeout plus this, at p99.
const TARGET_EXCESS_MS: f64 = 100.0;
/// Linux's USER_HZ, the unit of /proc/PID/stat's times.
pub(crate) const CLK_TCK: f64 = 100.0;

#[derive(clap::Args)]
pub struct WorkersArgs {
    /// A running coordinator, e.g. http://127.0.0.1:7070 (its own heartbeat interval and
    /// session timeout apply; give --coordinator-pid for its CPU and memory).
    #[arg(long, conflicts_with = "spawn_coordinator")]
    pub(crate) coordinator: Option<String>,
    /// The running coordinator's process id, to read its CPU and memory from /proc.
    #[arg(long, requires = "coordinator")]
    pub(crate) coordinator_pid: Option<u32>,
    /// Start this coordinator binary on a fresh temp multi-agent project for each session
    /// count, with --heartbeat-interval HEARTBEAT and --session-timeout 5×HEARTBEAT.
    #[arg(long, value_name = "PATH")]
    pub(crate) spawn_coordinator: Option<PathBuf>,
    /// Session counts, each measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    pub(crate) sessions: Vec<usize>,
    /// Heartbeat interval given to a spawned coordinator.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) heartbeat: Duration,
    /// Steady state measured after all sessions are registered.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Sessions that claim a task and then go silent, for the lease-end latency.
    #[arg(long, default_value_t = 100)]
    pub(crate) kill: usize,
    /// Sessions connecting and registering at once.
    #[arg(long, default_value_t = 64)]
    pub(crate) connect_concurrency: usize,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    pub(crate) json_out: Option<PathBuf>,
    /// Keep the temp folders (projects, logs) of spawned coordinators.
    #[arg(long)]
    pub(crate) keep_temp: bool,
    /// Across a failover instead: a 3-member etcd cluster and two coordinators with
    /// `--store etcd` are spawned, every session claims a task in its session, and the
    /// leader is killed with SIGKILL; each session finds the new leader (following
    /// `automaton-leader`) and resumes with its lease.
    #[arg(long, requires = "spawn_coordinator")]
    pub(crate) failover: bool,
    /// With --failover: the coordinators' `[etcd] election_ttl`.
    #[arg(long, default_value = "2s", value_parser = parse_duration, requires = "failover")]
    pub(crate) election_ttl: Duration,
    /// With --failover: the etcd binary (3.4).
    #[arg(
        long,
        default_value = "etcd",
        value_name = "PATH",
        requires = "failover"
    )]
    pub(crate) etcd_bin: String,
}

#[derive(Serialize, Clone, Default)]
pub(crate) struct Percentiles {
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    pub(crate) fn of(mut v: Vec<Duration>) -> Percentiles {
        v.sort_unstable();
        let n = v.len();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let pct = |q: f64| {
            if n == 0 {
                return 0.0;
            }
            let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
            ms(v[rank - 1])
        };
        Percentiles {
            count: n,
            p50_ms: pct(0.5),
            p99_ms: pct(0.99),
            max_ms: v.last().map_or(0.0, |d| ms(*d)),
        }
    }
}

#[derive(Serialize, Clone)]
pub struct RunResult {
    sessions: usize,
    heartbeat_ms: u64,
    session_timeout_ms: u64,
    /// Seconds from the first connect to all N sessions granted.
    register_s: f64,
    steady_s: f64,
    /// Coordinator CPU over the steady state, in cores; None without its pid.
    coordinator_cpu_cores: Option<f64>,
    coordinator_rss_peak_mib: Option<f64>,
    coordinator_rss_end_mib: Option<f64>,
    /// The coordinator's lifetime peak (VmHWM), registration included.
    coordinator_rss_hwm_mib: Option<f64>,
    load_cpu_cores: f64,
    load_rss_end_mib: f64,
    heartbeats_per_s: f64,
    heartbeat_rtt: Percentiles,
    session_errors: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_error: Option<String>,
    killed: usize,
    leases_ended: usize,
    workers_lost: usize,
    /// Last heartbeat ack → the lease's `lease_expired`/`session_expired` event.
    lease_end: Percentiles,
    lease_end_p99_excess_ms: f64,
    lease_end_met: bool,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    coordinator: String,
    results: Vec<RunResult>,
}

/// utime+stime (clock ticks) of a process, from /proc/PID/stat.
pub(crate) fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    let u: u64 = fields.get(11)?.parse().ok()?;
    let s: u64 = fields.get(12)?.parse().ok()?;
    Some(u + s)
}

/// A `kB` line of /proc/PID/status (`VmRSS`, `VmHWM`), in MiB.
pub(crate) fn status_mib(pid: &str, key: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// The soft and hard RLIMIT_NOFILE of this process, from /proc/self/limits.
fn nofile() -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    Some((f.get(3)?.parse().ok()?, f.get(4)?.parse().ok()?))
}

/// Raises this process's soft open-file limit to the hard one (with `prlimit`) when `need`
/// is above it. A spawned coordinator inherits the limit.
pub(crate) fn ensure_nofile(need: u64) -> Result<()> {
    let Some((soft, hard)) = nofile() else {
        return Ok(());
    };
    if soft >= need {
        return Ok(());
    }
    if soft < hard {
        let pid = std::process::id().to_string();
        let st = std::process::Command::new("prlimit")
            .args(["--pid", &pid, &format!("--nofile={hard}:{hard}")])
            .status();
        eprintln!("raised the open-file limit from {soft} to {hard}: {st:?}");
    }
    match nofile() {
        Some((soft, _)) if soft >= need => Ok(()),
        Some((soft, hard)) => bail!(
            "need about {need} open files, the limit is {soft} (hard {hard}): raise it (ulimit -n)"
        ),
        None => Ok(()),
    }
}

/// What one session did.
#[derive(Default)]
struct SessionOut {
    /// (sent at, round trip) of every answered heartbeat.
    rtts: Vec<(Instant, Duration)>,
    last_ack: Option<Instant>,
    error: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Run,
    /// The killed sessions stop.
    Kill,
    /// Everyone stops.
    Stop,
}

struct Registered {
    index: usize,
    session_id: String,
    heartbeat: Duration,
    timeout: Duration,
}

pub(crate) fn worker_name(i: usize) -> String {
    format!("bench-w{i}")
}

pub(crate) async fn next_message(
    inbound: &mut tonic::Streaming<pb::CoordinatorMessage>,
) -> Result<Option<Out>> {
    loop {
        match inbound.message().await {
            Ok(Some(pb::CoordinatorMessage { msg: Some(m) })) => return Ok(Some(m)),
            Ok(Some(_)) => continue,
            Ok(None) => return Ok(None),
            Err(s) => return Err(crate::rpc::status_err(s)),
        }
    }
}

/// A session the bench opened: its connection, its outbound queue, the coordinator's stream
/// and the grant.
pub(crate) type Opened = (
    Channel,
    mpsc::Sender<pb::WorkerMessage>,
    tonic::Streaming<pb::CoordinatorMessage>,
    pb::SessionGranted,
);

/// Connects, sends `register` as the session's first message (outbound queue of `queue`
/// messages) and waits for the grant: the opening both the `workers` and the `dispatch`
/// benches' fake workers share.
pub(crate) async fn open_session(
    endpoint: &Endpoint,
    register: pb::Register,
    queue: usize,
) -> Result<Opened> {
    let channel = endpoint.connect().await.context("connect")?;
    let mut client = pb::workers_client::WorkersClient::new(channel.clone());
    let (tx, rx) = mpsc::channel::<pb::WorkerMessage>(queue);
    tx.send(pb::WorkerMessage {
        msg: Some(In::Register(register)),
    })
    .await
    .context("queue Register")?;
    let mut inbound = client
        .session(ReceiverStream::new(rx))
        .await
        .map_err(crate::rpc::status_err)?
        .into_inner();
    let granted = match next_message(&mut inbound).await? {
        Some(Out::Granted(g)) => g,
        other => bail!("expected SessionGranted, got {other:?}"),
    };
    Ok((channel, tx, inbound, granted))
}

/// One worker session: connect, register, heartbeat on the grid until told to stop.
#[allow(clippy::too_many_arguments)]
async fn session(
    index: usize,
    n: usize,
    endpoint: Endpoint,
    connecting: Arc<Semaphore>,
    epoch: Instant,
    killed: bool,
    registered: mpsc::UnboundedSender<Result<Registered, String>>,
    mut phase: watch::Receiver<Phase>,
) -> SessionOut {
    let mut out = SessionOut::default();
    let permit = connecting.acquire_owned().await;
    let register = pb::Register {
        name: worker_name(index),
        host: "bench".into(),
        // Sessions only: these workers run no agent, so the coordinator offers them no work
        // (the bench claims in their sessions itself).
        capacity: 0,
        version: "bench".into(),
        simulated: true,
        replace: true,
        ..Default::default()
    };
    let opened = open_session(&endpoint, register, 4).await;
    drop(permit);
    let (channel, tx, mut inbound, granted) = match opened {
        Ok(o) => o,
        Err(e) => {
            let msg = format!("session {index}: {e:#}");
            let _ = registered.send(Err(msg.clone()));
            out.error = Some(msg);
            return out;
        }
    };
    let interval = wire_duration(granted.heartbeat_interval.as_ref()).max(Duration::from_millis(1));
    let _ = registered.send(Ok(Registered {
        index,
        session_id: granted.session_id.clone(),
        heartbeat: interval,
        timeout: wire_duration(granted.session_timeout.as_ref()),
    }));
    // The session's place on the grid: epoch + interval·index/N + k·interval.
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
    loop {
        tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                let sent = Instant::now();
                if tx.send(pb::WorkerMessage { msg: Some(In::Heartbeat(pb::Heartbeat { seq })) }).await.is_err() {
                    out.error = Some(format!("session {index}: the request stream closed"));
                    break;
                }
                let acked = loop {
                    match next_message(&mut inbound).await {
                        Ok(Some(Out::Ack(a))) if a.seq == seq => break Ok(()),
                        Ok(Some(_)) => continue,
                        Ok(None) => break Err("the coordinator ended the stream".to_string()),
                        Err(e) => break Err(format!("{e:#}")),
                    }
                };
                if let Err(e) = acked {
                    out.error = Some(format!("session {index}: {e}"));
                    break;
                }
                let at = Instant::now();
                out.rtts.push((sent, at - sent));
                out.last_ack = Some(at);
            }
            changed = phase.changed() => {
                let p = *phase.borrow();
                if p == Phase::Kill && killed {
                    break;
                }
                if changed.is_err() || p == Phase::Stop {
                    // End cleanly, so a reused coordinator has no leftovers expiring.
                    let bye = pb::WorkerMessage { msg: Some(In::Deregister(pb::Deregister {})) };
                    if tx.send(bye).await.is_ok() {
                        let ended = async {
                            while let Ok(Some(_)) = next_message(&mut inbound).await {}
                        };
                        let _ = tokio::time::timeout(Duration::from_secs(5), ended).await;
                    }
                    break;
                }
            }
        }
    }
    // A killed session's stream and connection go at once, without a Deregister: the
    // session lives on until its timeout.
    drop(tx);
    drop(inbound);
    drop(channel);
    out
}

/// The sessions that go silent: K of N, spread over the grid.
fn kill_set(n: usize, k: usize) -> Vec<usize> {
    let k = k.min(n);
    (0..k).map(|i| i * n / k.max(1)).collect()
}

fn task_name(n: usize, i: usize) -> String {
    format!("w-n{n}-{i}")
}

/// Events seen on WatchEvents: for each task, when its session-expired lease end arrived.
#[derive(Default)]
struct Seen {
    ended: HashMap<String, Instant>,
    lost: usize,
}

async fn watch_events(
    channel: Channel,
    tasks: Vec<String>,
    workers: std::collections::HashSet<String>,
) -> Result<mpsc::UnboundedReceiver<(String, String, Instant)>> {
    let mut events = pb::events_client::EventsClient::new(channel)
        .watch_events(pb::WatchEventsRequest {})
        .await
        .map_err(crate::rpc::status_err)?
        .into_inner();
    let (tx, rx) = mpsc::unbounded_channel();
    let wanted: std::collections::HashSet<String> = tasks.into_iter().collect();
    tokio::spawn(async move {
        while let Ok(Some(e)) = events.message().await {
            let at = Instant::now();
            let ours = (e.kind == "lease_expired"
                && e.detail.contains("session_expired")
                && wanted.contains(&e.task))
                || (e.kind == "worker_lost" && workers.contains(&e.agent));
            if ours && tx.send((e.kind, e.task, at)).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

fn mib(pid: Option<&str>, key: &str) -> Option<f64> {
    pid.and_then(|p| status_mib(p, key))
}

async fn one_count(
    args: &WorkersArgs,
    url: &str,
    pid: Option<&str>,
    n: usize,
) -> Result<RunResult> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .with_context(|| format!("bad URL {url}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10));
    let control = crate::connect_retry(url).await?;
    coord::wait_ready(&control, Duration::from_secs(30)).await?;

    let killed = kill_set(n, args.kill);
    let tasks: Vec<String> = (0..killed.len()).map(|i| task_name(n, i)).collect();
    {
        let mut t = pb::tasks_client::TasksClient::new(control.clone());
        for task in &tasks {
            coord::prepare_one(&mut t, task)
                .await
                .with_context(|| format!("prepare task {task}"))?;
        }
    }
    let names = killed.iter().map(|&i| worker_name(i)).collect();
    let mut events = watch_events(control.clone(), tasks.clone(), names).await?;

    // Open and register the sessions.
    let (phase_tx, phase_rx) = watch::channel(Phase::Run);
    let (reg_tx, mut reg_rx) = mpsc::unbounded_channel();
    let connecting = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
    let epoch = Instant::now();
    let kill_flags: std::collections::HashSet<usize> = killed.iter().copied().collect();
    let mut handles = Vec::with_capacity(n);
    for i in 0..n {
        handles.push(tokio::spawn(session(
            i,
            n,
            endpoint.clone(),
            connecting.clone(),
            epoch,
            kill_flags.contains(&i),
            reg_tx.clone(),
            phase_rx.clone(),
        )));
    }
    drop(reg_tx);
    let mut ids: HashMap<usize, String> = HashMap::new();
    let mut intervals = None;
    let mut reg_errors = Vec::new();
    let reg_deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while ids.len() + reg_errors.len() < n {
        match tokio::time::timeout_at(reg_deadline, reg_rx.recv()).await {
            Ok(Some(Ok(r))) => {
                intervals.get_or_insert((r.heartbeat, r.timeout));
                ids.insert(r.index, r.session_id);
            }
            Ok(Some(Err(e))) => reg_errors.push(e),
            Ok(None) => break,
            Err(_) => bail!("only {} of {n} sessions registered within 300 s", ids.len()),
        }
    }
    let register_s = epoch.elapsed().as_secs_f64();
    if let Some(e) = reg_errors.first() {
        let _ = phase_tx.send(Phase::Stop);
        bail!(
            "{} of {n} sessions failed to register; first: {e}",
            reg_errors.len()
        );
    }
    let (heartbeat, timeout) = intervals.context("no session registered")?;
    eprintln!(
        "  N={n}: {n} sessions registered in {register_s:.2}s (heartbeat {}, session timeout {})",
        fmt_ms(heartbeat.as_secs_f64() * 1e3),
        fmt_ms(timeout.as_secs_f64() * 1e3)
    );

    // Steady state.
    let self_pid = std::process::id().to_string();
    let m0 = Instant::now();
    let c0 = pid.and_then(cpu_ticks);
    let l0 = cpu_ticks(&self_pid);
    let mut rss_peak: Option<f64> = None;
    while m0.elapsed() < args.duration {
        if let Some(r) = mib(pid, "VmRSS:") {
            rss_peak = Some(rss_peak.map_or(r, |p: f64| p.max(r)));
        }
        let left = args.duration.saturating_sub(m0.elapsed());
        tokio::time::sleep(left.min(Duration::from_millis(250))).await;
    }
    let steady = m0.elapsed();
    let m1 = Instant::now();
    let c1 = pid.and_then(cpu_ticks);
    let l1 = cpu_ticks(&self_pid);
    let rss_end = mib(pid, "VmRSS:");
    if let Some(r) = rss_end {
        rss_peak = Some(rss_peak.map_or(r, |p| p.max(r)));
    }
    let hwm = mib(pid, "VmHWM:");
    let cores = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / CLK_TCK / steady.as_secs_f64()),
        _ => None,
    };
    let coordinator_cpu = cores(c0, c1);
    let load_cpu = cores(l0, l1).unwrap_or_default();
    let load_rss = status_mib(&self_pid, "VmRSS:").unwrap_or_default();

    // Lease end: K sessions claim a task each, then all go silent.
    let mut leases = pb::leases_client::LeasesClient::new(control.clone());
    for (task, &i) in tasks.iter().zip(&killed) {
        let session_id = ids.get(&i).cloned().context("a killed session has no id")?;
        let lease = leases
            .claim(pb::ClaimRequest {
                task: task.clone(),
                agent: worker_name(i),
                session_id: session_id.clone(),
                ..Default::default()
            })
            .await
            .map_err(crate::rpc::status_err)
            .with_context(|| format!("claim {task} in session {session_id}"))?
            .into_inner();
        if lease.session_id != session_id {
            bail!(
                "the lease on {task} belongs to session {:?}, not {session_id}",
                lease.session_id
            );
        }
    }
    let _ = phase_tx.send(Phase::Kill);
    let mut last_ack: HashMap<String, Instant> = HashMap::new();
    let mut outs = Vec::with_capacity(n);
    let mut rest = Vec::with_capacity(n);
    for (i, h) in handles.into_iter().enumerate() {
        if kill_flags.contains(&i) {
            let o = h.await.context("a session panicked")?;
            if let Some(pos) = killed.iter().position(|&k| k == i)
                && let Some(at) = o.last_ack
            {
                last_ack.insert(tasks[pos].clone(), at);
            }
            outs.push(o);
        } else {
            rest.push(h);
        }
    }
    let mut seen = Seen::default();
    let wait_until = tokio::time::Instant::now() + timeout * 2 + Duration::from_secs(5);
    while seen.ended.len() < tasks.len() {
        match tokio::time::timeout_at(wait_until, events.recv()).await {
            Ok(Some((kind, task, at))) => {
                if kind == "worker_lost" {
                    seen.lost += 1;
                } else {
                    seen.ended.entry(task).or_insert(at);
                }
            }
            Ok(None) | Err(_) => break,
        }
    }
    // worker_lost events may trail the lease ends by a moment.
    while let Ok(Some((kind, _, _))) =
        tokio::time::timeout(Duration::from_millis(200), events.recv()).await
    {
        if kind == "worker_lost" {
            seen.lost += 1;
        }
    }
    let _ = phase_tx.send(Phase::Stop);
    for h in rest {
        outs.push(h.await.context("a session panicked")?);
    }

    let mut rtts = Vec::new();
    let mut errors = 0;
    let mut first_error = None;
    for o in outs {
        rtts.extend(
            o.rtts
                .into_iter()
                .filter(|(sent, _)| *sent >= m0 && *sent < m1)
                .map(|(_, d)| d),
        );
        if let Some(e) = o.error {
            errors += 1;
            first_error.get_or_insert(e);
        }
    }
    let heartbeats_per_s = rtts.len() as f64 / steady.as_secs_f64();
    let lease_end: Vec<Duration> = seen
        .ended
        .iter()
        .filter_map(|(task, at)| last_ack.get(task).map(|l| at.saturating_duration_since(*l)))
        .collect();
    let lease_end = Percentiles::of(lease_end);
    let timeout_ms = timeout.as_secs_f64() * 1e3;
    let excess = lease_end.p99_ms - timeout_ms;
    Ok(RunResult {
        sessions: n,
        heartbeat_ms: heartbeat.as_millis() as u64,
        session_timeout_ms: timeout.as_millis() as u64,
        register_s,
        steady_s: steady.as_secs_f64(),
        coordinator_cpu_cores: coordinator_cpu,
        coordinator_rss_peak_mib: rss_peak,
        coordinator_rss_end_mib: rss_end,
        coordinator_rss_hwm_mib: hwm,
        load_cpu_cores: load_cpu,
        load_rss_end_mib: load_rss,
        heartbeats_per_s,
        heartbeat_rtt: Percentiles::of(rtts),
        session_errors: errors,
        first_error,
        killed: tasks.len(),
        leases_ended: seen.ended.len(),
        workers_lost: seen.lost,
        lease_end_met: seen.ended.len() == tasks.len() && excess <= TARGET_EXCESS_MS,
        lease_end,
        lease_end_p99_excess_ms: excess,
    })
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".to_string(), f)
}

fn table(results: &[RunResult]) -> String {
    let mut out = format!(
        "{:>8} {:>7} {:>8} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}\n",
        "sessions",
        "hb",
        "timeout",
        "reg",
        "coord cpu",
        "rss peak",
        "rss end",
        "hb/s",
        "rtt p50",
        "rtt p99",
        "load cpu"
    );
    for r in results {
        out.push_str(&format!(
            "{:>8} {:>7} {:>8} {:>7.1}s {:>10} {:>9} {:>9} {:>8.0} {:>8} {:>8} {:>8.2}\n",
            r.sessions,
            fmt_ms(r.heartbeat_ms as f64),
            fmt_ms(r.session_timeout_ms as f64),
            r.register_s,
            opt(r.coordinator_cpu_cores, |c| format!("{c:.3}")),
            opt(r.coordinator_rss_peak_mib, |m| format!("{m:.0}MiB")),
            opt(r.coordinator_rss_end_mib, |m| format!("{m:.0}MiB")),
            r.heartbeats_per_s,
            fmt_ms(r.heartbeat_rtt.p50_ms),
            fmt_ms(r.heartbeat_rtt.p99_ms),
            r.load_cpu_cores,
        ));
    }
    out.push_str(&format!(
        "\nlease end (last heartbeat ack -> lease_expired/session_expired event):\n{:>8} {:>7} {:>6} {:>5} {:>9} {:>9} {:>9} {:>11}  target\n",
        "sessions", "killed", "ended", "lost", "p50", "p99", "max", "p99-timeout"
    ));
    for r in results {
        out.push_str(&format!(
            "{:>8} {:>7} {:>6} {:>5} {:>9} {:>9} {:>9} {:>+9.1}ms  {} (<= timeout + {TARGET_EXCESS_MS}ms)\n",
            r.sessions,
            r.killed,
            r.leases_ended,
            r.workers_lost,
            fmt_ms(r.lease_end.p50_ms),
            fmt_ms(r.lease_end.p99_ms),
            fmt_ms(r.lease_end.max_ms),
            r.lease_end_p99_excess_ms,
            if r.lease_end_met { "met" } else { "NOT met" },
        ));
    }
    if results.iter().any(|r| r.session_errors > 0) {
        for r in results.iter().filter(|r| r.session_errors > 0) {
            out.push_str(&format!(
                "N={}: {} session(s) failed; first: {}\n",
                r.sessions,
                r.session_errors,
                r.first_error.as_deref().unwrap_or("?")
            ));
        }
    }
    out
}

fn prepare_project(scratch: &Path) -> Result<PathBuf> {
    let project = scratch.join("project");
    std::fs::create_dir_all(&project)?;
    std::fs::write(project.join(".agent.md"), "Mode: multi-agent\n")
        .context("write the project's .agent.md")?;
    Ok(project)
}

pub async fn run(args: WorkersArgs) -> Result<()> {
    if args.sessions.is_empty() || args.sessions.contains(&0) {
        bail!("--sessions must list counts of at least 1");
    }
    if args.coordinator.is_none() && args.spawn_coordinator.is_none() {
        bail!("give --coordinator URL or --spawn-coordinator PATH");
    }
    let hb_ms = args.heartbeat.as_millis() as u64;
    if hb_ms == 0 {
        bail!("--heartbeat must be at least 1ms");
    }
    let max = args.sessions.iter().copied().max().unwrap_or(0) as u64;
    if args.failover {
        // A session may hold a connection to each of the two coordinators.
        ensure_nofile(2 * max + 256)?;
        return crate::ha_workers::run(&args).await;
    }
    // Each session holds one socket here and one in a spawned coordinator (same limit).
    ensure_nofile(max + 256)?;
    if args.spawn_coordinator.is_some() {
        eprintln!(
            "spawned coordinators get --heartbeat-interval {hb_ms}ms --session-timeout {}ms ({TIMEOUT_FACTOR}x the heartbeat)",
            hb_ms * TIMEOUT_FACTOR as u64
        );
    }
    let mut results = Vec::new();
    for &n in &args.sessions {
        let r = if let Some(bin) = &args.spawn_coordinator {
            let scratch = spawn::scratch_dir()?;
            let outcome = async {
                let project = prepare_project(&scratch)?;
                let extra = vec![
                    "--heartbeat-interval".to_string(),
                    format!("{hb_ms}ms"),
                    "--session-timeout".to_string(),
                    format!("{}ms", hb_ms * TIMEOUT_FACTOR as u64),
                ];
                let mut s = spawn::coordinator_with(bin, &project, &scratch, &extra)?;
                eprintln!("spawned coordinator at {} (pid {})", s.url, s.pid());
                let pid = s.pid().to_string();
                let r = one_count(&args, &s.url.clone(), Some(&pid), n).await;
                let how = s.stop();
                eprintln!("{how} (log: {})", s.log.display());
                r
            }
            .await;
            if args.keep_temp || outcome.is_err() {
                eprintln!("kept {}", scratch.display());
            } else {
                let _ = std::fs::remove_dir_all(&scratch);
            }
            outcome?
        } else {
            let url = args.coordinator.as_deref().unwrap_or_default();
            let pid = args.coordinator_pid.map(|p| p.to_string());
            one_count(&args, url, pid.as_deref(), n).await?
        };
        eprintln!(
            "{}",
            table(std::slice::from_ref(&r)).lines().nth(1).unwrap_or("")
        );
        results.push(r);
    }
    let text = table(&results);
    print!("{text}");
    if let Some(path) = &args.json_out {
        let report = Report {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
            coordinator: args
                .coordinator
                .clone()
                .or_else(|| {
                    args.spawn_coordinator
                        .as_ref()
                        .map(|p| p.display().to_string())
                })
                .unwrap_or_default(),
            results,
        };
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kill_set_spreads_over_the_sessions() {
        assert_eq!(kill_set(10, 5), vec![0, 2, 4, 6, 8]);
        assert_eq!(kill_set(3, 5), vec![0, 1, 2]);
        assert!(kill_set(10, 0).is_empty());
    }

    #[test]
    fn reads_this_process_figures() {
        let me = std::process::id().to_string();
        assert!(cpu_ticks(&me).is_some());
        assert!(status_mib(&me, "VmRSS:").is_some_and(|m| m > 0.0));
        assert!(nofile().is_some());
    }
}
