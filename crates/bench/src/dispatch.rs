//! `automaton-bench dispatch`: one wave of S sub-tasks dispatched to W simulated workers.
//!
//! A spawned coordinator (dispatch on) on a fresh temp project. Before any worker joins (so
//! the dispatcher leaves them alone), the bench drives the parent tasks as an operator: create,
//! `research`, SPEC.md written into the task folder, `research:awaiting_approval`, approve,
//! `decomposition`, a DECOMPOSITION.md listing their sub-tasks in one wave (no dependencies)
//! written into the folder, `decomposition:awaiting_approval`. A decomposition lists at most
//! 200 sub-tasks (`MAX_SUBTASKS`), so S sub-tasks take ⌈S/200⌉ parents, approved together.
//!
//! Then W worker sessions are opened from this process, one HTTP/2 connection each (as
//! `workers` does), registered with `capacity: 1` and a budget (`max_peak_context_kb`, in
//! tokens) taken in turn from `--budgets` (a third each at 12k, 36k and 93k by default), and
//! heartbeating. Each answers every `Assignment` with `accepted: true` and holds the lease.
//! Sub-task i's estimate lies in the band of budget class i mod 3 (above the next smaller
//! budget, at most its own), so every sub-task fits someone and best fit has exactly one
//! class to choose.
//!
//! Timed by this process's receipt instants: t0 right before the approvals are sent; the
//! sub-tasks' creation is t0 → the last `subtask_created` event (WatchEvents); the dispatch
//! is t0 → the last `Assignment` received by a fake worker. Per decision: the dispatch after
//! the last creation (last `subtask_created` → last `Assignment`) over the assignments —
//! decisions with their moves and grants — and, from the coordinator's own counters (its
//! /metrics, scraped at t0 and at the end), the time its rounds spent deciding over the
//! decisions they made (`decide`: choosing the worker alone). The coordinator's CPU
//! (utime+stime from /proc) from t0 to the last assignment over the assignments. Every assignment is checked: a sub-task of the wave, its
//! first phase (`research`), its estimate, a worker whose budget holds it (and whether it is
//! the smallest budget that does), at most one per worker.
//!
//! The floor: after each run, in the same temp folder and the same minute, the bench makes
//! the durable writes the coordinator must make for S sub-tasks without the coordinator —
//! per sub-task a folder of four small files (each written to a temp file, fsynced,
//! renamed), the folder synced and renamed into `subtasks/`, `subtasks/` synced, then two
//! files rewritten in place the same way (the `new → research` move and the grant's
//! holders) — 64 sub-tasks at a time, as the coordinator does. `dispatch / floor` says how
//! much of the dispatch is the disk's cost of creating and syncing files at all.
//!
//! The runs' temp folders are removed after the last run, not between runs: on ext4 without
//! a journal (this machine's disk) the inode allocator skips inodes freed in the last minute
//! or more, checking each one, so creating files right after thousands were removed is slow
//! for minutes — a run started right after the previous run's removal would measure that
//! removal. A first run right after other mass removals (a test suite, an earlier bench)
//! shows it too: the floor, measured in the same minute, says so.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as Out;
use pb::worker_message::Msg as In;
use serde::Serialize;
use tokio::sync::{Semaphore, mpsc, watch};
use tonic::transport::{Channel, Endpoint};

use crate::stats::fmt_ms;
use crate::workers::{CLK_TCK, ensure_nofile, next_message};
use crate::{coord, spawn};

/// Sub-tasks one decomposition may list (`automaton_workflow::MAX_SUBTASKS`).
const PER_PARENT: usize = 200;
/// The target: approval → the last assignment.
const TARGET_S: f64 = 1.0;

#[derive(clap::Args)]
pub struct DispatchArgs {
    /// Start this coordinator binary on a fresh temp project for each run.
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: PathBuf,
    /// Simulated workers (capacity 1 each).
    #[arg(long, default_value_t = 1000)]
    workers: usize,
    /// Sub-tasks in the one wave.
    #[arg(long, default_value_t = 1000)]
    subtasks: usize,
    /// Worker budgets (max peak context, tokens), given to the workers in turn.
    #[arg(long, value_delimiter = ',', default_value = "12000,36000,93000")]
    budgets: Vec<u64>,
    /// Runs, each on a fresh coordinator.
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Give up when not every sub-task is assigned after this long.
    #[arg(long, default_value = "60s", value_parser = crate::parse_duration)]
    timeout: Duration,
    /// Sessions connecting and registering at once.
    #[arg(long, default_value_t = 64)]
    connect_concurrency: usize,
    /// Wait this long after the workers registered, before the approvals (to attach a
    /// profiler to the coordinator, whose pid is printed).
    #[arg(long, value_parser = crate::parse_duration)]
    pause: Option<Duration>,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Keep the temp folders (project, coordinator log).
    #[arg(long)]
    keep_temp: bool,
}

#[derive(Serialize, Clone)]
pub struct RunResult {
    workers: usize,
    subtasks: usize,
    parents: usize,
    /// Seconds to open and register the W sessions (not part of the dispatch).
    register_s: f64,
    /// t0 → the last `subtask_created` event.
    create_ms: f64,
    /// t0 → the first `Assignment` received.
    first_assignment_ms: f64,
    /// t0 → the last `Assignment` received: the figure with the target.
    dispatch_ms: f64,
    /// Last `subtask_created` → last `Assignment`, over the assignments.
    per_decision_us: f64,
    /// Coordinator CPU seconds from t0 to the last assignment.
    coordinator_cpu_s: Option<f64>,
    /// Of which in the kernel (stime).
    coordinator_cpu_sys_s: Option<f64>,
    /// That CPU over the assignments.
    coordinator_cpu_per_assignment_us: Option<f64>,
    /// The dispatcher's own time per decision (choosing a worker, without the moves and
    /// grants): `automaton_dispatch_decide_seconds_total` over
    /// `automaton_dispatch_decisions_total`, their growth from t0 to the end, scraped from
    /// the coordinator's /metrics.
    decide_us_per_decision: Option<f64>,
    assignments: usize,
    /// Assignments whose worker's budget holds the estimate.
    fitting: usize,
    /// Assignments that went to the smallest budget class that holds the estimate.
    best_fit: usize,
    /// Assignments that were wrong (unknown task, wrong phase or estimate, a second one to
    /// a worker); the first described.
    wrong: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_wrong: Option<String>,
    session_errors: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_error: Option<String>,
    target_met: bool,
    /// The floor (see the module's doc): the same durable writes without the coordinator,
    /// same folder, same minute.
    floor_ms: f64,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    coordinator: String,
    budgets: Vec<u64>,
    results: Vec<RunResult>,
}

/// One `Assignment` as a fake worker received it.
struct Got {
    at: Instant,
    worker: usize,
    task: String,
    phase: String,
    estimate: u64,
}

/// (utime, stime) of a process in clock ticks, from /proc/PID/stat.
fn cpu_split(pid: &str) -> Option<(u64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some((fields.get(11)?.parse().ok()?, fields.get(12)?.parse().ok()?))
}

fn worker_name(i: usize) -> String {
    format!("bench-d{i}")
}

fn parent_name(j: usize) -> String {
    format!("dispatch-p{j}")
}

fn sub_name(i: usize) -> String {
    format!("st{i}")
}

/// Sub-task i's estimate: in the band of budget class `i mod classes` (above the next smaller
/// budget, at most its own), spread over the band.
fn estimate(i: usize, sorted: &[u64]) -> u64 {
    let c = i % sorted.len();
    let lo = if c == 0 { 1_000 } else { sorted[c - 1] + 1 };
    let hi = sorted[c].max(lo);
    lo + (i as u64).wrapping_mul(7_919) % (hi - lo + 1)
}

/// The DECOMPOSITION.md of parent `j`: its sub-tasks (global indexes), one wave.
fn decomposition_md(subs: &[(usize, u64)]) -> String {
    let mut s = String::from(
        "# DECOMPOSITION\n\nOne wave, no dependencies.\n\n| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n| --- | --- | --- | --- |\n",
    );
    for (i, est) in subs {
        // 1000 or more: raw tokens.
        s.push_str(&format!(
            "| {} | - | {est} | part {i} of the bench wave; its tests pass |\n",
            sub_name(*i)
        ));
    }
    s
}

fn req<T>(r: std::result::Result<tonic::Response<T>, tonic::Status>, what: &str) -> Result<T> {
    r.map(tonic::Response::into_inner)
        .map_err(crate::rpc::status_err)
        .with_context(|| what.to_string())
}

async fn transition(
    t: &mut pb::tasks_client::TasksClient<Channel>,
    task: &str,
    to: &str,
) -> Result<()> {
    req(
        t.transition(pb::TransitionRequest {
            task: task.into(),
            target: to.into(),
            ..Default::default()
        })
        .await,
        &format!("{task} → {to}"),
    )
    .map(|_| ())
}

async fn approve(mut t: pb::tasks_client::TasksClient<Channel>, task: String) -> Result<()> {
    let r = t
        .approve(pb::ApproveRequest {
            task: task.clone(),
            approver: "ops".into(),
            ..Default::default()
        })
        .await;
    req(r, &format!("approve {task}")).map(|_| ())
}

/// Drives `parent` to `decomposition:awaiting_approval` with `subs` in its decomposition.
async fn prepare_parent(
    channel: &Channel,
    tasks_dir: &Path,
    parent: &str,
    subs: &[(usize, u64)],
) -> Result<()> {
    let mut t = pb::tasks_client::TasksClient::new(channel.clone());
    req(
        t.create_task(pb::CreateTaskRequest {
            task: parent.into(),
        })
        .await,
        &format!("create {parent}"),
    )?;
    let dir = tasks_dir.join(parent);
    transition(&mut t, parent, "research").await?;
    std::fs::write(
        dir.join("SPEC.md"),
        format!(
            "# SPEC — {parent}\n\nThe dispatch bench's parent task.\n\n**Next:** decomposition\n"
        ),
    )
    .context("write SPEC.md")?;
    transition(&mut t, parent, "research:awaiting_approval").await?;
    approve(t.clone(), parent.to_string()).await?;
    transition(&mut t, parent, "decomposition").await?;
    std::fs::write(dir.join("DECOMPOSITION.md"), decomposition_md(subs))
        .context("write DECOMPOSITION.md")?;
    transition(&mut t, parent, "decomposition:awaiting_approval").await
}

/// One fake worker: connect, register with `budget`, heartbeat, accept every assignment and
/// hold it, until told to stop.
#[allow(clippy::too_many_arguments)]
async fn session(
    index: usize,
    budget: u64,
    endpoint: Endpoint,
    connecting: Arc<Semaphore>,
    registered: mpsc::UnboundedSender<Result<usize, String>>,
    got: mpsc::UnboundedSender<Got>,
    mut stop: watch::Receiver<bool>,
) -> Option<String> {
    let permit = connecting.acquire_owned().await;
    let register = pb::Register {
        name: worker_name(index),
        host: "bench".into(),
        budget: Some(pb::Budget {
            max_peak_context_kb: budget,
            source: "automaton-bench dispatch".into(),
            ..Default::default()
        }),
        capacity: 1,
        version: "bench".into(),
        simulated: true,
        replace: true,
        ..Default::default()
    };
    let opened = crate::workers::open_session(&endpoint, register, 8).await;
    drop(permit);
    let (_channel, tx, mut inbound, granted) = match opened {
        Ok(o) => o,
        Err(e) => {
            let msg = format!("worker {index}: {e:#}");
            let _ = registered.send(Err(msg.clone()));
            return Some(msg);
        }
    };
    let _ = registered.send(Ok(index));
    let interval = crate::workers::wire_duration(granted.heartbeat_interval.as_ref())
        .max(Duration::from_millis(1));
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut seq = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                if tx.send(pb::WorkerMessage { msg: Some(In::Heartbeat(pb::Heartbeat { seq })) }).await.is_err() {
                    return Some(format!("worker {index}: the request stream closed"));
                }
            }
            m = next_message(&mut inbound) => match m {
                Ok(Some(Out::Assign(a))) => {
                    let at = Instant::now();
                    let lease_id = a.lease.as_ref().map(|l| l.lease_id.clone()).unwrap_or_default();
                    let _ = got.send(Got { at, worker: index, task: a.task, phase: a.phase, estimate: a.estimated_tokens });
                    let answer = pb::AssignmentAnswer { lease_id, accepted: true, reason: String::new() };
                    if tx.send(pb::WorkerMessage { msg: Some(In::Answer(answer)) }).await.is_err() {
                        return Some(format!("worker {index}: the request stream closed"));
                    }
                }
                Ok(Some(Out::Lost(l))) => return Some(format!("worker {index}: lease lost on {}: {}", l.task, l.reason)),
                Ok(Some(_)) => {}
                Ok(None) => return Some(format!("worker {index}: the coordinator ended the stream")),
                Err(e) => return Some(format!("worker {index}: {e:#}")),
            },
            _ = stop.changed() => {
                let bye = pb::WorkerMessage { msg: Some(In::Deregister(pb::Deregister {})) };
                if tx.send(bye).await.is_ok() {
                    let ended = async { while let Ok(Some(_)) = next_message(&mut inbound).await {} };
                    let _ = tokio::time::timeout(Duration::from_secs(5), ended).await;
                }
                return None;
            }
        }
    }
}

/// Receipt instants of the `subtask_created` events.
async fn watch_created(channel: Channel) -> Result<mpsc::UnboundedReceiver<Instant>> {
    let mut events = pb::events_client::EventsClient::new(channel)
        .watch_events(pb::WatchEventsRequest {})
        .await
        .map_err(crate::rpc::status_err)?
        .into_inner();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(e)) = events.message().await {
            if e.kind == "subtask_created" && tx.send(Instant::now()).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

async fn one_run(
    args: &DispatchArgs,
    url: &str,
    metrics: Option<&str>,
    pid: &str,
    tasks_dir: &Path,
) -> Result<RunResult> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .with_context(|| format!("bad URL {url}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10));
    let control = crate::connect_retry(url).await?;
    coord::wait_ready(&control, Duration::from_secs(30)).await?;

    let mut sorted = args.budgets.clone();
    sorted.sort_unstable();
    sorted.dedup();
    let estimates: Vec<u64> = (0..args.subtasks).map(|i| estimate(i, &sorted)).collect();
    // (parent, sub-task) by sub-task name; each sub-task's estimate.
    let parents = args.subtasks.div_ceil(PER_PARENT);
    let mut expected: HashMap<String, u64> = HashMap::new();
    for j in 0..parents {
        let subs: Vec<(usize, u64)> = (j * PER_PARENT..((j + 1) * PER_PARENT).min(args.subtasks))
            .map(|i| (i, estimates[i]))
            .collect();
        prepare_parent(&control, tasks_dir, &parent_name(j), &subs)
            .await
            .with_context(|| format!("prepare {}", parent_name(j)))?;
        for (i, e) in subs {
            expected.insert(format!("{}/{}", parent_name(j), sub_name(i)), e);
        }
    }
    let mut created = watch_created(control.clone()).await?;

    // The fleet.
    let budget_of = |i: usize| args.budgets[i % args.budgets.len()];
    let (stop_tx, stop_rx) = watch::channel(false);
    let (reg_tx, mut reg_rx) = mpsc::unbounded_channel();
    let (got_tx, mut got_rx) = mpsc::unbounded_channel();
    let connecting = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
    let r0 = Instant::now();
    let mut handles = Vec::with_capacity(args.workers);
    for i in 0..args.workers {
        handles.push(tokio::spawn(session(
            i,
            budget_of(i),
            endpoint.clone(),
            connecting.clone(),
            reg_tx.clone(),
            got_tx.clone(),
            stop_rx.clone(),
        )));
    }
    drop(reg_tx);
    drop(got_tx);
    let mut ok = 0;
    let mut reg_errors = Vec::new();
    let reg_deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    while ok + reg_errors.len() < args.workers {
        match tokio::time::timeout_at(reg_deadline, reg_rx.recv()).await {
            Ok(Some(Ok(_))) => ok += 1,
            Ok(Some(Err(e))) => reg_errors.push(e),
            Ok(None) => break,
            Err(_) => bail!(
                "only {ok} of {} workers registered within 300 s",
                args.workers
            ),
        }
    }
    let register_s = r0.elapsed().as_secs_f64();
    if let Some(e) = reg_errors.first() {
        let _ = stop_tx.send(true);
        bail!(
            "{} of {} workers failed to register; first: {e}",
            reg_errors.len(),
            args.workers
        );
    }
    eprintln!("  {} workers registered in {register_s:.2}s", args.workers);
    // Nothing is offered before the approval (every parent awaits it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    if let Ok(g) = got_rx.try_recv() {
        bail!(
            "{} was assigned {} before the approval",
            worker_name(g.worker),
            g.task
        );
    }

    if let Some(p) = args.pause {
        eprintln!("  pausing {p:?} before the approvals");
        tokio::time::sleep(p).await;
    }
    // The wave: approve every parent's decomposition at once.
    let m0 = match metrics {
        Some(m) => decide_counters(m).await,
        None => None,
    };
    let t0 = Instant::now();
    let c0 = cpu_split(pid);
    let mut approvals = Vec::new();
    for j in 0..parents {
        let t = pb::tasks_client::TasksClient::new(control.clone());
        approvals.push(tokio::spawn(approve(t, parent_name(j))));
    }
    let mut got: Vec<Got> = Vec::with_capacity(args.subtasks);
    let deadline = tokio::time::Instant::now() + args.timeout;
    while got.len() < args.subtasks {
        match tokio::time::timeout_at(deadline, got_rx.recv()).await {
            Ok(Some(g)) => got.push(g),
            Ok(None) | Err(_) => break,
        }
    }
    let c1 = cpu_split(pid);
    for a in approvals {
        a.await.context("an approval panicked")??;
    }
    // Anything more (there should be nothing: one sub-task each, capacity 1 each).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let m1 = match metrics {
        Some(m) => decide_counters(m).await,
        None => None,
    };
    let decide_us_per_decision = match (m0, m1) {
        (Some((s0, n0)), Some((s1, n1))) if n1 > n0 => Some((s1 - s0) * 1e6 / (n1 - n0)),
        _ => None,
    };
    while let Ok(g) = got_rx.try_recv() {
        got.push(g);
    }
    let mut created_at = Vec::new();
    while let Ok(at) = created.try_recv() {
        created_at.push(at);
    }
    let _ = stop_tx.send(true);
    let mut errors = Vec::new();
    for h in handles {
        if let Some(e) = h.await.context("a worker panicked")? {
            errors.push(e);
        }
    }

    // Checks.
    let mut fitting = 0;
    let mut best_fit = 0;
    let mut wrong = Vec::new();
    let mut per_worker: HashSet<usize> = HashSet::new();
    let mut per_task: HashSet<&str> = HashSet::new();
    for g in &got {
        let budget = budget_of(g.worker);
        let Some(&est) = expected.get(&g.task) else {
            wrong.push(format!("{} is not a sub-task of the wave", g.task));
            continue;
        };
        if g.phase != "research" {
            wrong.push(format!("{} assigned in {}, not research", g.task, g.phase));
        }
        if g.estimate != est {
            wrong.push(format!(
                "{} assigned with estimate {} (written {est})",
                g.task, g.estimate
            ));
        }
        if !per_worker.insert(g.worker) {
            wrong.push(format!(
                "{} got a second assignment ({})",
                worker_name(g.worker),
                g.task
            ));
        }
        if !per_task.insert(&g.task) {
            wrong.push(format!("{} assigned twice", g.task));
        }
        if budget >= est {
            fitting += 1;
            if sorted.iter().find(|&&b| b >= est) == Some(&budget) {
                best_fit += 1;
            }
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let last = got.iter().map(|g| g.at).max();
    let first = got.iter().map(|g| g.at).min();
    let last_created = created_at.iter().copied().max();
    let dispatch_ms = last.map_or(f64::NAN, |l| ms(l - t0));
    let n = got.len().max(1) as f64;
    let per_decision_us = match (last, last_created) {
        (Some(l), Some(c)) => l.saturating_duration_since(c).as_secs_f64() * 1e6 / n,
        _ => f64::NAN,
    };
    let (cpu, cpu_sys) = match (c0, c1) {
        (Some((u0, s0)), Some((u1, s1))) => {
            let sys = s1.saturating_sub(s0) as f64 / CLK_TCK;
            (
                Some(u1.saturating_sub(u0) as f64 / CLK_TCK + sys),
                Some(sys),
            )
        }
        _ => (None, None),
    };
    if created_at.len() != args.subtasks {
        wrong.push(format!(
            "{} subtask_created events for {} sub-tasks",
            created_at.len(),
            args.subtasks
        ));
    }
    let complete = got.len() == args.subtasks && wrong.is_empty() && errors.is_empty();
    Ok(RunResult {
        workers: args.workers,
        subtasks: args.subtasks,
        parents,
        register_s,
        create_ms: last_created.map_or(f64::NAN, |c| ms(c - t0)),
        first_assignment_ms: first.map_or(f64::NAN, |f| ms(f - t0)),
        dispatch_ms,
        per_decision_us,
        coordinator_cpu_s: cpu,
        coordinator_cpu_sys_s: cpu_sys,
        coordinator_cpu_per_assignment_us: cpu.map(|c| c * 1e6 / n),
        decide_us_per_decision,
        assignments: got.len(),
        fitting,
        best_fit,
        wrong: wrong.len(),
        first_wrong: wrong.first().cloned(),
        session_errors: errors.len(),
        first_error: errors.first().cloned(),
        target_met: complete && dispatch_ms / 1e3 < TARGET_S,
        floor_ms: f64::NAN,
    })
}

/// The coordinator's decision counters from its /metrics at `addr`: (seconds spent deciding,
/// decisions). `None` when it cannot be scraped.
async fn decide_counters(addr: &str) -> Option<(f64, f64)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let read = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut body = String::new();
        s.read_to_string(&mut body).await.ok()?;
        let value = |name: &str| {
            body.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        };
        Some((
            value("automaton_dispatch_decide_seconds_total")?,
            value("automaton_dispatch_decisions_total")?,
        ))
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .ok()
        .flatten()
}

/// The metrics address a coordinator started with `--metrics-listen 127.0.0.1:0` logged
/// (`metrics listening on http://ADDR/metrics`), waiting up to 10 s for the line.
fn metrics_address(log: &Path) -> Option<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(addr) = text.lines().find_map(|l| {
            let rest = l.split("metrics listening on http://").nth(1)?;
            rest.split("/metrics").next().map(str::to_string)
        }) {
            return Some(addr);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sub-tasks whose files the floor writes at once (the coordinator's `ROUND_CONCURRENCY`).
const FLOOR_CONCURRENCY: usize = 64;

/// One sub-task's durable writes (see the module's doc), under `root`.
fn floor_one(root: &Path, i: usize) -> std::io::Result<()> {
    let parent = root.join(parent_name(i / PER_PARENT)).join("subtasks");
    let staging = root.join(format!(".new-{i}"));
    std::fs::create_dir(&staging)?;
    for (name, bytes) in [
        (".state", &b"new\n"[..]),
        (".state.approvals", &b""[..]),
        ("PARENT_SPEC.md", &[b'x'; 600][..]),
        ("VRAM_CONFIG.md", &[b'y'; 400][..]),
    ] {
        spawn::durable_write(&staging, name, bytes)?;
    }
    spawn::sync_dir(&staging)?;
    let folder = parent.join(sub_name(i));
    std::fs::rename(&staging, &folder)?;
    spawn::sync_dir(&parent)?;
    spawn::durable_write(&folder, ".state", b"research\n")?;
    spawn::sync_dir(&folder)?;
    spawn::durable_write(&folder, ".state.holders", b"research agent 1\n")?;
    spawn::sync_dir(&folder)
}

/// The floor for `n` sub-tasks in a fresh folder under `scratch`: wall time.
fn floor(scratch: &Path, n: usize) -> Result<Duration> {
    let root = scratch.join("floor");
    for j in 0..n.div_ceil(PER_PARENT) {
        std::fs::create_dir_all(root.join(parent_name(j)).join("subtasks"))
            .context("create the floor's folders")?;
    }
    let t0 = Instant::now();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let failed: std::sync::Mutex<Option<std::io::Error>> = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..FLOOR_CONCURRENCY.min(n) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    if let Err(e) = floor_one(&root, i) {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert(e);
                        }
                        break;
                    }
                }
            });
        }
    });
    let took = t0.elapsed();
    if let Some(e) = failed.into_inner().ok().flatten() {
        return Err(e).context("the floor's writes");
    }
    Ok(took)
}

/// Removes the runs' temp folders.
fn remove_all(scratches: &[PathBuf]) {
    for s in scratches {
        let _ = std::fs::remove_dir_all(s);
    }
}

fn table(results: &[RunResult]) -> String {
    let mut out = format!(
        "{:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>11} {:>9} {:>13} {:>11} {:>8} {:>7} {:>8} {:>9} {:>11}  target\n",
        "workers",
        "subtasks",
        "parents",
        "created",
        "first",
        "last",
        "per decis.",
        "decide",
        "cpu (sys) s",
        "cpu/assign",
        "assigned",
        "fit",
        "best fit",
        "floor",
        "last/floor"
    );
    for r in results {
        out.push_str(&format!(
            "{:>7} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9.0}us {:>9} {:>13} {:>9}us {:>8} {:>7} {:>8} {:>9} {:>11.2}  {} (< {TARGET_S}s)\n",
            r.workers,
            r.subtasks,
            r.parents,
            fmt_ms(r.create_ms),
            fmt_ms(r.first_assignment_ms),
            fmt_ms(r.dispatch_ms),
            r.per_decision_us,
            r.decide_us_per_decision
                .map_or("-".into(), |d| format!("{d:.1}us")),
            match (r.coordinator_cpu_s, r.coordinator_cpu_sys_s) {
                (Some(c), Some(sys)) => format!("{c:.2} ({sys:.2})"),
                _ => "-".into(),
            },
            r.coordinator_cpu_per_assignment_us.map_or("-".into(), |c| format!("{c:.0}")),
            r.assignments,
            r.fitting,
            r.best_fit,
            fmt_ms(r.floor_ms),
            r.dispatch_ms / r.floor_ms,
            if r.target_met { "met" } else { "NOT met" },
        ));
        if let Some(w) = &r.first_wrong {
            out.push_str(&format!("  {} wrong; first: {w}\n", r.wrong));
        }
        if let Some(e) = &r.first_error {
            out.push_str(&format!(
                "  {} worker error(s); first: {e}\n",
                r.session_errors
            ));
        }
    }
    out.push_str("(times from the approval of the decomposition: created = last subtask_created event, first/last = Assignment received by a fake worker; floor = the same durable file writes without the coordinator, same folder, same minute)\n");
    out
}

pub async fn run(args: DispatchArgs) -> Result<()> {
    if args.workers == 0 || args.subtasks == 0 || args.runs == 0 {
        bail!("--workers, --subtasks and --runs must be at least 1");
    }
    if args.budgets.is_empty() || args.budgets.iter().any(|&b| b < 1_000) {
        bail!("--budgets must list budgets of at least 1000 tokens");
    }
    ensure_nofile(args.workers as u64 + 256)?;
    let mut results = Vec::new();
    let mut scratches: Vec<PathBuf> = Vec::new();
    for run in 0..args.runs {
        let scratch = spawn::scratch_dir()?;
        let outcome = async {
            let project = scratch.join("project");
            std::fs::create_dir_all(&project)?;
            std::fs::write(project.join(".agent.md"), "Mode: multi-agent\n")
                .context("write the project's .agent.md")?;
            let mut s = spawn::coordinator_with(
                &args.spawn_coordinator,
                &project,
                &scratch,
                &["--metrics-listen".into(), "127.0.0.1:0".into()],
            )?;
            let metrics = metrics_address(&s.log);
            if metrics.is_none() {
                eprintln!(
                    "  the coordinator's metrics address is not in {}: no decision cost",
                    s.log.display()
                );
            }
            eprintln!(
                "run {}: spawned coordinator at {} (pid {})",
                run + 1,
                s.url,
                s.pid()
            );
            let pid = s.pid().to_string();
            let tasks_dir = project.join(".automaton").join("tasks");
            let r = one_run(&args, &s.url.clone(), metrics.as_deref(), &pid, &tasks_dir).await;
            let how = s.stop();
            eprintln!("{how} (log: {})", s.log.display());
            let mut r = r?;
            let took = tokio::task::block_in_place(|| floor(&scratch, args.subtasks))?;
            r.floor_ms = took.as_secs_f64() * 1e3;
            anyhow::Ok(r)
        }
        .await;
        if args.keep_temp || outcome.is_err() {
            eprintln!("kept {}", scratch.display());
        } else {
            // Removed after the last run, not now (see the module's doc).
            scratches.push(scratch);
        }
        let r = match outcome {
            Ok(r) => r,
            Err(e) => {
                remove_all(&scratches);
                return Err(e);
            }
        };
        eprint!(
            "{}",
            table(std::slice::from_ref(&r))
                .lines()
                .nth(1)
                .map(|l| format!("{l}\n"))
                .unwrap_or_default()
        );
        results.push(r);
    }
    remove_all(&scratches);
    print!("{}", table(&results));
    if let Some(path) = &args.json_out {
        let report = Report {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
            coordinator: args.spawn_coordinator.display().to_string(),
            budgets: args.budgets.clone(),
            results: results.clone(),
        };
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    if let Some(r) = results.iter().find(|r| {
        r.assignments != r.subtasks
            || r.fitting != r.assignments
            || r.wrong > 0
            || r.session_errors > 0
    }) {
        bail!(
            "not every sub-task was assigned once to a worker that fits: {} of {} assigned, {} fit, {} wrong, {} worker errors",
            r.assignments,
            r.subtasks,
            r.fitting,
            r.wrong,
            r.session_errors
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_estimate_fits_exactly_one_smallest_budget_class() {
        let sorted = [12_000, 36_000, 93_000];
        for i in 0..3_000 {
            let e = estimate(i, &sorted);
            let class = i % 3;
            assert!(e <= sorted[class], "{i}: {e}");
            assert!(e >= 1_000, "{i}: {e}");
            if class > 0 {
                assert!(e > sorted[class - 1], "{i}: {e}");
            }
        }
    }

    #[test]
    fn the_decomposition_lists_one_wave() {
        let md = decomposition_md(&[(0, 5_000), (1, 20_000)]);
        assert!(md.contains("| st0 | - | 5000 |"), "{md}");
        assert!(md.contains("| st1 | - | 20000 |"), "{md}");
    }
}
