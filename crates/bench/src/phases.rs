//! `automaton-bench phases`: tasks driven through every phase by real workers.
//!
//! A spawned coordinator on a fresh git-initialised project, N `automaton-worker --agent
//! scripted` processes (simulated GPUs, their own cache and work dirs), T tasks created at
//! once. The bench approves every gate as soon as its `transitioned … → X:awaiting_approval`
//! event arrives, until every task is `complete`. Everything is read from `Events.WatchEvents`,
//! timed by the bench's **receipt instants** (one stream, one reader task: each event is
//! stamped as it is decoded); the coordinator's own `at` (milliseconds) is kept as a
//! cross-check.
//!
//! **Phase turnaround** (ungated hand-offs: implement → code_review, bug_find →
//! adversarial_bug_find → doc_review → referee): the agent's exit is not an event; its proxy
//! is the phase's `artifact_uploaded` (the worker's first call after the agent exits), and the
//! turnaround runs to the next phase's `assigned` on the same task. It is split at the
//! `transitioned` event: upload → transition (patch upload, `CompletePhase`) and transition →
//! assignment (the dispatch round). With T ≫ N the next phase often waits for a worker (oldest
//! task first; a review needs a worker other than the implementer): hand-offs whose assigned
//! worker still held another lease when the transition arrived are **queued**, the rest
//! **immediate**; the target applies to the immediate ones. Each worker's own gap (its
//! `artifact_uploaded` → its next `assigned`, any task) is reported too.
//!
//! **Upload throughput**: before the workers join, the bench claims a task of its own in
//! `research` as an operator (no session, 1 h TTL, kept to the end so it is never
//! dispatched) and uploads an 8 MiB − 1 byte SPEC.md (the default limit is 8 MiB) in 1 MiB
//! chunks, each time different bytes. The reference is the same bytes written the way the
//! store writes an artifact (temp file, fsync, rename, directory fsync) into the same temp
//! dir, from this process.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use automaton_workflow::sha256_hex;
use serde::Serialize;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::stats::fmt_ms;
use crate::workers::{CLK_TCK, Percentiles, cpu_ticks};
use crate::{coord, spawn};

/// Phases whose completion hands the task straight to another phase (no gate), by the phase
/// that follows.
const UNGATED_AFTER: [(&str, &str); 4] = [
    ("code_review", "implement"),
    ("adversarial_bug_find", "bug_find"),
    ("doc_review", "adversarial_bug_find"),
    ("referee", "doc_review"),
];
/// The turnaround target at p99.
const TARGET_P99_MS: f64 = 50.0;
const MIB: usize = 1 << 20;
const UPLOAD_TASK: &str = "bench-upload";

#[derive(clap::Args)]
pub struct PhasesArgs {
    /// Start this coordinator binary on a fresh temp project (git-initialised).
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: PathBuf,
    /// The worker binary, started N times with `--agent scripted`.
    #[arg(long, value_name = "PATH")]
    worker: PathBuf,
    #[arg(long, default_value_t = 2)]
    workers: usize,
    #[arg(long, default_value_t = 50)]
    tasks: usize,
    /// 8 MiB − 1 byte uploads of SPEC.md (and as many reference writes); 0 skips them.
    #[arg(long, default_value_t = 7)]
    uploads: usize,
    /// Give up when the tasks are not all complete after this long.
    #[arg(long, default_value = "10m", value_parser = crate::parse_duration)]
    timeout: Duration,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Keep the temp folder (project, worker dirs, logs).
    #[arg(long)]
    keep_temp: bool,
}

/// One event as received.
#[derive(Clone)]
struct Seen {
    kind: String,
    task: String,
    agent: String,
    token: u64,
    detail: String,
    /// The coordinator's `at`, milliseconds since midnight UTC.
    at_ms: Option<i64>,
    rx: Instant,
    /// The receipt on the wall clock, to meet the workers' log lines.
    wall: SystemTime,
}

/// An event's time → milliseconds since midnight UTC.
fn at_ms(at: Option<&automaton_proto::prost_types::Timestamp>) -> Option<i64> {
    let t = at?;
    Some(t.seconds.rem_euclid(86_400) * 1000 + i64::from(t.nanos.clamp(0, 999_999_999)) / 1_000_000)
}

/// `YYYY-MM-DDTHH:MM:SS[.frac]Z` → the instant (UTC).
fn parse_utc(s: &str) -> Option<SystemTime> {
    let y: i64 = s.get(0..4)?.parse().ok()?;
    let mo: i64 = s.get(5..7)?.parse().ok()?;
    let d: i64 = s.get(8..10)?.parse().ok()?;
    // Days from the civil date (H. Hinnant's algorithm).
    let yy = if mo <= 2 { y - 1 } else { y };
    let era = yy.div_euclid(400);
    let yoe = yy - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let h: i64 = s.get(11..13)?.parse().ok()?;
    let mi: i64 = s.get(14..16)?.parse().ok()?;
    let se: i64 = s.get(17..19)?.parse().ok()?;
    let frac = s.get(19..)?.strip_prefix('.').unwrap_or("");
    let digits: String = frac
        .chars()
        .take_while(char::is_ascii_digit)
        .take(9)
        .collect();
    let nanos: u64 = if digits.is_empty() {
        0
    } else {
        digits.parse::<u64>().ok()? * 10u64.pow(9 - digits.len() as u32)
    };
    let secs = u64::try_from(days * 86_400 + (h * 60 + mi) * 60 + se).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_nanos(nanos))
}

/// The worker log's `agent stopped task=T phase=P reason=completed` lines: (task, phase) →
/// when.
fn agent_exits(log: &str) -> Vec<((String, String), SystemTime)> {
    log.lines()
        .filter(|l| l.contains(" agent stopped ") && l.contains("reason=completed"))
        .filter_map(|l| {
            let at = parse_utc(l.split_whitespace().next()?)?;
            let field = |k: &str| {
                l.split_whitespace()
                    .find_map(|w| w.strip_prefix(k))
                    .map(str::to_string)
            };
            Some(((field("task=")?, field("phase=")?), at))
        })
        .collect()
}

fn ms_between(a: Option<i64>, b: Option<i64>) -> Option<Duration> {
    let (a, b) = (a?, b?);
    let mut d = b - a;
    if d < -43_200_000 {
        d += 86_400_000;
    }
    Some(Duration::from_millis(d.max(0) as u64))
}

#[derive(Serialize, Clone)]
struct Handoff {
    task: String,
    from: String,
    to: String,
    worker_from: String,
    worker_to: String,
    queued: bool,
    /// artifact_uploaded → assigned (receipt instants).
    total_ms: f64,
    /// artifact_uploaded → transitioned.
    complete_ms: f64,
    /// transitioned → assigned.
    dispatch_ms: f64,
    /// The same span by the coordinator's `at` (millisecond resolution).
    coordinator_total_ms: Option<f64>,
    /// The worker's log line `agent stopped` (the agent's real exit) → assigned (receipt,
    /// wall clock), when the line was found.
    agent_exit_total_ms: Option<f64>,
    /// `agent stopped` → artifact_uploaded (receipt): the worker reading, hashing and
    /// uploading the artifact.
    agent_exit_to_upload_ms: Option<f64>,
    #[serde(skip)]
    upload_wall: Option<SystemTime>,
    #[serde(skip)]
    assigned_wall: Option<SystemTime>,
}

#[derive(Serialize)]
struct Upload {
    size: usize,
    chunk: usize,
    uploads: Vec<f64>,
    mb_per_s: Percentiles,
    p50_mb_per_s: f64,
    reference: &'static str,
    reference_mb_per_s_list: Vec<f64>,
    reference_p50_mb_per_s: f64,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    workers: usize,
    tasks: usize,
    completed: usize,
    /// Tasks created → the last `complete`, seconds.
    total_s: f64,
    tasks_per_min: f64,
    phases_assigned: usize,
    approvals: usize,
    clock: &'static str,
    proxy: &'static str,
    turnaround_all: Percentiles,
    turnaround_immediate: Percentiles,
    turnaround_queued: Percentiles,
    immediate_upload_to_transition: Percentiles,
    immediate_transition_to_assigned: Percentiles,
    turnaround_all_coordinator_clock: Percentiles,
    /// A worker's artifact_uploaded → its own next assignment (any task).
    worker_gap: Percentiles,
    /// `approved` → the next phase's `assigned` on the same task, a worker free at approval.
    gate_handoff: Percentiles,
    /// The same where the worker that took it was busy when the approval arrived.
    gate_handoff_queued: Percentiles,
    /// From the workers' logs: `agent stopped` → assigned, immediate hand-offs.
    immediate_agent_exit_to_assigned: Percentiles,
    /// `agent stopped` → artifact_uploaded, immediate hand-offs.
    immediate_agent_exit_to_upload: Percentiles,
    target_p99_ms: f64,
    target_met: bool,
    coordinator_cpu_cores: Option<f64>,
    upload: Option<Upload>,
    handoffs: Vec<Handoff>,
}

fn req_ok<T>(r: Result<tonic::Response<T>, tonic::Status>, what: &str) -> Result<T> {
    r.map(tonic::Response::into_inner)
        .map_err(crate::rpc::status_err)
        .with_context(|| what.to_string())
}

fn git(project: &Path, args: &[&str]) -> Result<()> {
    let out = Command::new("git")
        .arg("-C")
        .arg(project)
        .args([
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@example.com",
        ])
        .args(args)
        .output()
        .context("run git (is it installed?)")?;
    if !out.status.success() {
        bail!(
            "git {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A fresh multi-agent project with one commit.
fn prepare_project(scratch: &Path) -> Result<PathBuf> {
    let project = scratch.join("project");
    std::fs::create_dir_all(&project)?;
    std::fs::write(project.join(".agent.md"), "Mode: multi-agent\n")
        .context("write the project's .agent.md")?;
    std::fs::write(project.join("README.md"), "# bench project\n")?;
    git(&project, &["init", "-q"])?;
    git(&project, &["add", "README.md"])?;
    git(&project, &["commit", "-q", "-m", "init"])?;
    Ok(project)
}

/// The events, stamped on receipt.
async fn watch(channel: Channel) -> Result<mpsc::UnboundedReceiver<Seen>> {
    let mut events = pb::events_client::EventsClient::new(channel)
        .watch_events(pb::WatchEventsRequest {})
        .await
        .map_err(crate::rpc::status_err)?
        .into_inner();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(e)) = events.message().await {
            let seen = Seen {
                rx: Instant::now(),
                wall: SystemTime::now(),
                at_ms: at_ms(e.at.as_ref()),
                kind: e.kind,
                task: e.task,
                agent: e.agent,
                token: e.token,
                detail: e.detail,
            };
            if tx.send(seen).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// `size` bytes of valid UTF-8 markdown, different for each `round`.
fn spec_body(size: usize, round: usize) -> Vec<u8> {
    let head = format!("# SPEC (bench upload {round})\n\n");
    let line = format!("upload {round}: the quick brown fox jumps over the lazy dog.\n");
    let mut body = head.into_bytes();
    while body.len() < size {
        body.extend_from_slice(line.as_bytes());
    }
    body.truncate(size);
    body
}

fn mb_per_s(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / 1e6 / d.as_secs_f64().max(1e-9)
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n => s[(n - 1) / 2],
    }
}

/// Throughput percentiles of MB/s figures, stored as `Percentiles` over "durations" of
/// 1 ms per MB/s (so p50/p99/max read in MB/s).
fn rate_stats(rates: &[f64]) -> Percentiles {
    Percentiles::of(
        rates
            .iter()
            .map(|r| Duration::from_secs_f64(r.max(0.0) / 1e3))
            .collect(),
    )
}

async fn measure_uploads(channel: &Channel, scratch: &Path, n: usize) -> Result<Upload> {
    let size = 8 * MIB - 1;
    let mut tasks = pb::tasks_client::TasksClient::new(channel.clone());
    coord::prepare_one(&mut tasks, UPLOAD_TASK).await?;
    let lease = req_ok(
        pb::leases_client::LeasesClient::new(channel.clone())
            .claim(pb::ClaimRequest {
                task: UPLOAD_TASK.into(),
                agent: "bench-uploader".into(),
                ttl: Some(automaton_proto::prost_types::Duration {
                    seconds: 3600,
                    nanos: 0,
                }),
                ..Default::default()
            })
            .await,
        "claim the upload task",
    )?;
    let mut work = pb::work_client::WorkClient::new(channel.clone());
    let mut uploads = Vec::new();
    for round in 0..n {
        let body = spec_body(size, round);
        let sha = sha256_hex(&body);
        let mut chunks: Vec<pb::ArtifactChunk> = body
            .chunks(MIB)
            .map(|c| pb::ArtifactChunk {
                data: c.to_vec(),
                ..Default::default()
            })
            .collect();
        chunks[0].lease_id = lease.lease_id.clone();
        chunks[0].token = lease.token;
        chunks[0].name = "SPEC.md".into();
        chunks[0].sha256 = sha;
        chunks[0].size = size as u64;
        let t0 = Instant::now();
        let r = req_ok(
            work.upload_artifact(tokio_stream::iter(chunks)).await,
            "UploadArtifact",
        )?;
        let d = t0.elapsed();
        if r.unchanged || r.size != size as u64 {
            bail!("upload {round} was not written as sent: {r:?}");
        }
        uploads.push(mb_per_s(size, d));
    }
    // The reference: the store's way of writing an artifact, from here.
    let dir = scratch.join("reference");
    std::fs::create_dir_all(&dir)?;
    let mut reference = Vec::new();
    for round in 0..n {
        let body = spec_body(size, round + n);
        let t0 = Instant::now();
        crate::spawn::durable_write(&dir, "SPEC.md", &body)?;
        crate::spawn::sync_dir(&dir)?;
        reference.push(mb_per_s(size, t0.elapsed()));
    }
    Ok(Upload {
        size,
        chunk: MIB,
        mb_per_s: rate_stats(&uploads),
        p50_mb_per_s: median(&uploads),
        uploads,
        reference: "write + fsync + rename + dir fsync of the same size into the same temp dir",
        reference_p50_mb_per_s: median(&reference),
        reference_mb_per_s_list: reference,
    })
}

/// What happened on one task so far.
#[derive(Default)]
struct TaskLog {
    /// The lease token of each assignment, with its phase and worker.
    leases: HashMap<u64, (String, String)>,
    last_token: Option<u64>,
    /// The first `artifact_uploaded` of each lease.
    uploaded: HashMap<u64, Seen>,
    last_transition: Option<(String, String, Seen)>,
    approved: Option<Seen>,
    complete: bool,
}

/// The phase an `assigned` event's detail names: `design (attempt 1): …`.
fn assigned_phase(detail: &str) -> String {
    detail
        .split([' ', ':'])
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `from → to` → (from, to).
fn transition(detail: &str) -> Option<(String, String)> {
    let (a, b) = detail.split_once('→')?;
    Some((a.trim().to_string(), b.trim().to_string()))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Drive {
    handoffs: Vec<Handoff>,
    worker_gaps: Vec<Duration>,
    gate_handoffs: Vec<Duration>,
    gate_queued: Vec<Duration>,
    completed: usize,
    assigned: usize,
    approvals: usize,
    total: Duration,
}

async fn drive(
    channel: &Channel,
    events: &mut mpsc::UnboundedReceiver<Seen>,
    names: &[String],
    tasks: usize,
    timeout: Duration,
) -> Result<Drive> {
    let mut creator = pb::tasks_client::TasksClient::new(channel.clone());
    let mut log: HashMap<String, TaskLog> = HashMap::new();
    let t0 = Instant::now();
    for i in 0..tasks {
        let task = format!("ph-{i}");
        req_ok(
            creator
                .create_task(pb::CreateTaskRequest { task: task.clone() })
                .await,
            "CreateTask",
        )?;
        log.insert(task, TaskLog::default());
    }
    // Per worker: the task it holds a lease on, and its last upload not yet followed by an
    // assignment.
    let mut holding: HashMap<String, Option<String>> =
        names.iter().map(|n| (n.clone(), None)).collect();
    let mut last_upload: HashMap<String, Instant> = HashMap::new();
    let mut free_since: HashMap<String, Instant> = HashMap::new();
    let (approve_tx, mut approve_rx) = mpsc::unbounded_channel::<Result<(), String>>();
    let mut out = Drive {
        handoffs: Vec::new(),
        worker_gaps: Vec::new(),
        gate_handoffs: Vec::new(),
        gate_queued: Vec::new(),
        completed: 0,
        assigned: 0,
        approvals: 0,
        total: Duration::ZERO,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last_done = t0;
    while out.completed < tasks {
        let e = tokio::select! {
            e = events.recv() => match e {
                Some(e) => e,
                None => bail!("the event stream ended"),
            },
            Some(r) = approve_rx.recv() => {
                if let Err(e) = r {
                    bail!("{e}");
                }
                continue;
            }
            _ = tokio::time::sleep_until(deadline) => bail!(
                "only {} of {tasks} tasks complete after {}s",
                out.completed,
                timeout.as_secs()
            ),
        };
        if e.kind == "task_held" && log.contains_key(&e.task) {
            bail!("task {} held from dispatch: {}", e.task, e.detail);
        }
        let Some(t) = log.get_mut(&e.task) else {
            continue;
        };
        match e.kind.as_str() {
            "assigned" => {
                out.assigned += 1;
                let phase = assigned_phase(&e.detail);
                let worker = e.agent.clone();
                if let Some(up) = last_upload.remove(&worker) {
                    out.worker_gaps.push(e.rx.saturating_duration_since(up));
                }
                // An ungated hand-off?
                let after = UNGATED_AFTER
                    .iter()
                    .find(|(to, _)| *to == phase)
                    .map(|(_, from)| *from);
                if let (Some(from), Some(prev), Some((tf, tt, tr))) =
                    (after, t.last_token, t.last_transition.as_ref())
                    && tf == from
                    && *tt == phase
                    && let Some(up) = t.uploaded.get(&prev)
                {
                    let worker_from = t.leases.get(&prev).map(|l| l.1.clone()).unwrap_or_default();
                    // Queued: the worker that got it was still busy with another task when
                    // the transition arrived (it became free only after).
                    let queued = free_since.get(&worker).is_some_and(|f| *f > tr.rx);
                    out.handoffs.push(Handoff {
                        task: e.task.clone(),
                        from: from.to_string(),
                        to: phase.clone(),
                        worker_from,
                        worker_to: worker.clone(),
                        queued,
                        total_ms: ms(e.rx.saturating_duration_since(up.rx)),
                        complete_ms: ms(tr.rx.saturating_duration_since(up.rx)),
                        dispatch_ms: ms(e.rx.saturating_duration_since(tr.rx)),
                        coordinator_total_ms: ms_between(up.at_ms, e.at_ms).map(ms),
                        agent_exit_total_ms: None,
                        agent_exit_to_upload_ms: None,
                        upload_wall: Some(up.wall),
                        assigned_wall: Some(e.wall),
                    });
                }
                if let Some(a) = t.approved.take() {
                    let d = e.rx.saturating_duration_since(a.rx);
                    if free_since.get(&worker).is_some_and(|f| *f > a.rx) {
                        out.gate_queued.push(d);
                    } else {
                        out.gate_handoffs.push(d);
                    }
                }
                t.leases.insert(e.token, (phase, worker.clone()));
                t.last_token = Some(e.token);
                holding.insert(worker, Some(e.task.clone()));
            }
            "artifact_uploaded" => {
                if let std::collections::hash_map::Entry::Vacant(v) = t.uploaded.entry(e.token) {
                    last_upload.insert(e.agent.clone(), e.rx);
                    v.insert(e);
                }
            }
            "transitioned" => {
                let Some((from, to)) = transition(&e.detail) else {
                    continue;
                };
                // A phase's work ended: its worker holds nothing now.
                for (w, h) in holding.iter_mut() {
                    if h.as_deref() == Some(e.task.as_str()) {
                        *h = None;
                        free_since.insert(w.clone(), e.rx);
                    }
                }
                if to.ends_with(":awaiting_approval") {
                    let mut c = pb::tasks_client::TasksClient::new(channel.clone());
                    let tx = approve_tx.clone();
                    let task = e.task.clone();
                    out.approvals += 1;
                    tokio::spawn(async move {
                        let r = c
                            .approve(pb::ApproveRequest {
                                task: task.clone(),
                                approver: "ops".into(),
                                ..Default::default()
                            })
                            .await
                            .map(|_| ())
                            .map_err(|s| {
                                format!("approve {task}: {:?}: {}", s.code(), s.message())
                            });
                        let _ = tx.send(r);
                    });
                }
                if to == "complete" && !t.complete {
                    t.complete = true;
                    out.completed += 1;
                    last_done = e.rx;
                }
                if to == "human_intervention" {
                    bail!("task {} went to human_intervention ({from} → {to})", e.task);
                }
                t.last_transition = Some((from, to, e));
            }
            "approved" => t.approved = Some(e),
            "run_stopped" => {
                for (w, h) in holding.iter_mut() {
                    if h.as_deref() == Some(e.task.as_str()) && !e.detail.contains("completed") {
                        *h = None;
                        free_since.insert(w.clone(), e.rx);
                    }
                }
            }
            _ => {}
        }
    }
    out.total = last_done.saturating_duration_since(t0);
    Ok(out)
}

fn prow(name: &str, p: &Percentiles) -> String {
    format!(
        "{name:<44} {:>6} {:>9} {:>9} {:>9}\n",
        p.count,
        fmt_ms(p.p50_ms),
        fmt_ms(p.p99_ms),
        fmt_ms(p.max_ms)
    )
}

fn table(r: &Report) -> String {
    let mut out = format!(
        "{} workers, {} tasks: {} complete in {:.2}s ({:.1} tasks/min), {} assignments, {} approvals\n\n",
        r.workers, r.tasks, r.completed, r.total_s, r.tasks_per_min, r.phases_assigned, r.approvals
    );
    out.push_str(&format!(
        "{:<44} {:>6} {:>9} {:>9} {:>9}\n",
        "hand-off (bench receipt clock)", "count", "p50", "p99", "max"
    ));
    out.push_str(&prow(
        "ungated: artifact_uploaded -> assigned, all",
        &r.turnaround_all,
    ));
    out.push_str(&prow(
        "  immediate (a worker was free)",
        &r.turnaround_immediate,
    ));
    out.push_str(&prow(
        "    upload -> transitioned",
        &r.immediate_upload_to_transition,
    ));
    out.push_str(&prow(
        "    transitioned -> assigned",
        &r.immediate_transition_to_assigned,
    ));
    out.push_str(&prow(
        "    agent exit (worker log) -> assigned",
        &r.immediate_agent_exit_to_assigned,
    ));
    out.push_str(&prow(
        "    agent exit (worker log) -> uploaded",
        &r.immediate_agent_exit_to_upload,
    ));
    out.push_str(&prow(
        "  queued (waited for a worker)",
        &r.turnaround_queued,
    ));
    out.push_str(&prow(
        "  all, by the coordinator's `at` (1 ms res.)",
        &r.turnaround_all_coordinator_clock,
    ));
    out.push_str(&prow(
        "worker: its upload -> its next assigned",
        &r.worker_gap,
    ));
    out.push_str(&prow(
        "gate: approved -> next assigned, immediate",
        &r.gate_handoff,
    ));
    out.push_str(&prow(
        "gate: approved -> next assigned, queued",
        &r.gate_handoff_queued,
    ));
    out.push_str(&format!(
        "target: immediate p99 < {TARGET_P99_MS}ms: {}\n",
        if r.target_met { "met" } else { "NOT met" }
    ));
    if let Some(u) = &r.upload {
        out.push_str(&format!(
            "\nupload SPEC.md {} bytes in {} KiB chunks, {} times: p50 {:.0} MB/s (min {:.0}, max {:.0}); reference ({}): p50 {:.0} MB/s\n",
            u.size,
            u.chunk / 1024,
            u.uploads.len(),
            u.p50_mb_per_s,
            u.uploads.iter().copied().fold(f64::INFINITY, f64::min),
            u.uploads.iter().copied().fold(0.0, f64::max),
            u.reference,
            u.reference_p50_mb_per_s,
        ));
    }
    if let Some(c) = r.coordinator_cpu_cores {
        out.push_str(&format!("coordinator CPU over the run: {c:.2} cores\n"));
    }
    out
}

pub async fn run(args: PhasesArgs) -> Result<()> {
    if args.workers == 0 || args.tasks == 0 {
        bail!("--workers and --tasks must be at least 1");
    }
    let scratch = spawn::scratch_dir()?;
    let mut spawned: Vec<spawn::Spawned> = Vec::new();
    let outcome = run_in(&args, &scratch, &mut spawned).await;
    // Workers first (they deregister), then the coordinator.
    for s in spawned.iter_mut().rev() {
        let how = s.stop();
        if outcome.is_err() {
            eprintln!("{how} (log: {})", s.log.display());
        }
    }
    if args.keep_temp || outcome.is_err() {
        eprintln!("kept {}", scratch.display());
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let report = outcome?;
    print!("{}", table(&report));
    if let Some(path) = &args.json_out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn run_in(
    args: &PhasesArgs,
    scratch: &Path,
    spawned: &mut Vec<spawn::Spawned>,
) -> Result<Report> {
    let project = prepare_project(scratch)?;
    let coordinator = spawn::coordinator_on(&args.spawn_coordinator, &project, scratch)?;
    let url = coordinator.url.clone();
    let pid = coordinator.pid().to_string();
    spawned.push(coordinator);
    eprintln!("spawned coordinator at {url} (pid {pid})");
    let channel = crate::connect_retry(&url).await?;
    coord::wait_ready(&channel, Duration::from_secs(30)).await?;

    let upload = if args.uploads > 0 {
        let u = measure_uploads(&channel, scratch, args.uploads).await?;
        eprintln!(
            "upload: p50 {:.0} MB/s over {} uploads; reference p50 {:.0} MB/s",
            u.p50_mb_per_s,
            u.uploads.len(),
            u.reference_p50_mb_per_s
        );
        Some(u)
    } else {
        None
    };

    let mut events = watch(channel.clone()).await?;
    let names: Vec<String> = (0..args.workers).map(|i| format!("bench-w{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        let dir = scratch.join(name);
        std::fs::create_dir_all(&dir)?;
        let mut cmd = Command::new(&args.worker);
        cmd.args(["--coordinator", &url, "--name", name, "--agent", "scripted"])
            .args(["--simulate-gpu", &format!("sim-{i}:24GiB")])
            .arg("--cache-dir")
            .arg(dir.join("cache"))
            .arg("--work-dir")
            .arg(dir.join("work"))
            // The probe's cache and config lookup stay in the temp dir.
            .env("HOME", &dir);
        spawned.push(spawn::process("worker", cmd, dir.join("worker.log"))?);
    }
    let mut joined = std::collections::HashSet::new();
    let join_deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while joined.len() < names.len() {
        match tokio::time::timeout_at(join_deadline, events.recv()).await {
            Ok(Some(e)) if e.kind == "worker_joined" => {
                joined.insert(e.agent);
            }
            Ok(Some(_)) => {}
            Ok(None) => bail!("the event stream ended"),
            Err(_) => bail!(
                "only {} of {} workers joined within 60 s (logs under {})",
                joined.len(),
                names.len(),
                scratch.display()
            ),
        }
    }
    eprintln!(
        "{} workers joined; creating {} tasks",
        names.len(),
        args.tasks
    );

    let c0 = cpu_ticks(&pid);
    let w0 = Instant::now();
    let mut d = drive(&channel, &mut events, &names, args.tasks, args.timeout).await?;
    // The agents' real exits, from the workers' logs.
    let mut exits: HashMap<(String, String), SystemTime> = HashMap::new();
    for name in &names {
        let text =
            std::fs::read_to_string(scratch.join(name).join("worker.log")).unwrap_or_default();
        exits.extend(agent_exits(&text));
    }
    for h in &mut d.handoffs {
        let Some(exit) = exits.get(&(h.task.clone(), h.from.clone())) else {
            continue;
        };
        let since = |w: Option<SystemTime>| w.and_then(|w| w.duration_since(*exit).ok()).map(ms);
        h.agent_exit_total_ms = since(h.assigned_wall);
        h.agent_exit_to_upload_ms = since(h.upload_wall);
    }
    let cpu = match (c0, cpu_ticks(&pid)) {
        (Some(a), Some(b)) => {
            Some(b.saturating_sub(a) as f64 / CLK_TCK / w0.elapsed().as_secs_f64().max(1e-9))
        }
        _ => None,
    };

    let dur = |f: &dyn Fn(&Handoff) -> f64, pick: &dyn Fn(&Handoff) -> bool| {
        Percentiles::of(
            d.handoffs
                .iter()
                .filter(|h| pick(h))
                .map(|h| Duration::from_secs_f64(f(h) / 1e3))
                .collect(),
        )
    };
    let immediate = dur(&|h| h.total_ms, &|h| !h.queued);
    let target_met = immediate.count > 0 && immediate.p99_ms < TARGET_P99_MS;
    let total_s = d.total.as_secs_f64();
    Ok(Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        workers: args.workers,
        tasks: args.tasks,
        completed: d.completed,
        total_s,
        tasks_per_min: d.completed as f64 * 60.0 / total_s.max(1e-9),
        phases_assigned: d.assigned,
        approvals: d.approvals,
        clock: "the bench's receipt instants of Events.WatchEvents (coordinator `at` as a cross-check)",
        proxy: "agent exit ~ the phase's artifact_uploaded event; next phase = its assigned event on the same task",
        turnaround_all: dur(&|h| h.total_ms, &|_| true),
        turnaround_immediate: immediate,
        turnaround_queued: dur(&|h| h.total_ms, &|h| h.queued),
        immediate_upload_to_transition: dur(&|h| h.complete_ms, &|h| !h.queued),
        immediate_transition_to_assigned: dur(&|h| h.dispatch_ms, &|h| !h.queued),
        turnaround_all_coordinator_clock: Percentiles::of(
            d.handoffs
                .iter()
                .filter_map(|h| h.coordinator_total_ms)
                .map(|m| Duration::from_secs_f64(m / 1e3))
                .collect(),
        ),
        worker_gap: Percentiles::of(d.worker_gaps),
        gate_handoff: Percentiles::of(d.gate_handoffs),
        gate_handoff_queued: Percentiles::of(d.gate_queued),
        immediate_agent_exit_to_assigned: dur(
            &|h| h.agent_exit_total_ms.unwrap_or_default(),
            &|h| !h.queued && h.agent_exit_total_ms.is_some(),
        ),
        immediate_agent_exit_to_upload: dur(
            &|h| h.agent_exit_to_upload_ms.unwrap_or_default(),
            &|h| !h.queued && h.agent_exit_to_upload_ms.is_some(),
        ),
        target_p99_ms: TARGET_P99_MS,
        target_met,
        coordinator_cpu_cores: cpu,
        upload,
        handoffs: d.handoffs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_event_details_and_times() {
        assert_eq!(
            assigned_phase("code_review (attempt 1): why"),
            "code_review"
        );
        assert_eq!(
            transition("implement → code_review"),
            Some(("implement".into(), "code_review".into()))
        );
        let at = automaton_proto::prost_types::Timestamp {
            seconds: 1_796_083_200 + 21_846, // 2026-12-01T06:04:06Z
            nanos: 123_000_000,
        };
        assert_eq!(at_ms(Some(&at)), Some(21_846_123));
        assert_eq!(
            parse_utc("1970-01-02T00:00:01.5Z"),
            Some(UNIX_EPOCH + Duration::from_millis(86_401_500))
        );
        assert_eq!(
            parse_utc("2000-03-01T00:00:00Z"),
            Some(UNIX_EPOCH + Duration::from_secs(951_868_800))
        );
        let exits = agent_exits(
            "2026-12-01T06:10:31.866442Z  INFO automaton_worker::agent: agent stopped task=ph-0 phase=research reason=completed detail=SPEC.md written\nother",
        );
        assert_eq!(exits.len(), 1);
        assert_eq!(exits[0].0, ("ph-0".to_string(), "research".to_string()));
        assert_eq!(
            ms_between(Some(86_399_990), Some(5)),
            Some(Duration::from_millis(15))
        );
        let body = spec_body(8 * MIB - 1, 3);
        assert_eq!(body.len(), 8 * MIB - 1);
        assert!(std::str::from_utf8(&body).is_ok());
        assert_ne!(spec_body(100, 1), spec_body(100, 2));
    }
}
