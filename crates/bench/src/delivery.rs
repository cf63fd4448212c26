//! `automaton-bench delivery`: what landing finished work costs (issue 31).
//!
//! **Top-level tasks into one `main`.** A fresh git project (`main`, one commit) with T tasks
//! prepared before the coordinator starts: each a folder at `referee` with a SPEC.md and a
//! PASS verdict, and a branch `automaton/NAME` one commit ahead of `main` adding its own file
//! (made with plumbing, the checkout untouched). The coordinator runs with `[delivery] mode =
//! "merge"` (strategy `merge`). The bench subscribes to `Events.WatchEvents`, then sends the T
//! `Tasks.Transition`s to `complete` at once, stamping each answer; the coordinator delivers
//! each (`delivery_requested`, then `merged` with `automaton/NAME into main at SHA (how)`).
//! Per task: its `complete` answer → its `merged` event (receipt instants of this process);
//! merges per second from the first answer to the last `merged`. Checked, or the bench
//! fails: every task merged exactly once, `main` holds every task's file and commit, the
//! checkout followed, and `main` has as many merge commits as the events say.
//!
//! The reference, in the same run: the same T branches merged into a fresh copy of the same
//! repository by the `git` CLI, `git merge --no-ff` one after the other in a checkout, as a
//! person or a script would. Runs alternate which of the two goes first. Bystanders: a few
//! tasks in `research` that nothing delivers, claimed and released one at a time before the
//! completes and while the deliveries run (does another task's change wait for the queue?).
//!
//! **A decomposition's integration.** A parent `p` with S sub-task folders `p/s01…` whose
//! branches `automaton/p--sNN` each add their own file on top of `main`, the parent's branch
//! at `main`. Each sub-task is merged into the parent's branch in-process by the store
//! (`Project::merge_into_parent`, as the coordinator does when a sub-task passes): the first
//! a fast-forward, the rest merge commits built in memory. Reference: the same S merges with
//! `git merge --no-ff` in a scratch checkout, each timed as a process.
//!
//! **Where a delivery's time goes.** The coordinator's steps for one top-level task, made
//! in-process on the store against a fresh copy with `main` checked out, one task after the
//! other as the base lock makes them: the five durable record writes (`requested`,
//! `preparing`, `ready`, `merging`, `merged`), building the merge (`prepare_delivery`) and
//! moving the base (`land_delivery`: `git merge --ff-only` in the checkout).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use automaton_store::{DeliveryRecord, DeliveryState, Prepared, Project, Strategy};
use automaton_workflow::TaskName;
use serde::Serialize;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::stats::fmt_ms;
use crate::workers::{CLK_TCK, Percentiles};
use crate::{coord, spawn};

const BASE: &str = "main";
const PARENT: &str = "p";
/// How long the bench keeps listening after the last `merged`, for a second one.
const SETTLE: Duration = Duration::from_millis(500);
/// Tasks in `research` that nothing delivers: claimed and released while the deliveries
/// run, to see whether other tasks' changes wait for them.
const BYSTANDERS: usize = 8;

#[derive(clap::Args)]
pub struct DeliveryArgs {
    /// Start this coordinator binary on a fresh temp project for each run.
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: PathBuf,
    /// Top-level tasks completed at once.
    #[arg(long, default_value_t = 100)]
    tasks: usize,
    /// Sub-tasks of the decomposition merged into their parent's branch.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u16).range(1..=99))]
    subtasks: u16,
    /// Runs, each on fresh repositories and a fresh coordinator.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Give up when not every task is merged after this long.
    #[arg(long, default_value = "5m", value_parser = crate::parse_duration)]
    timeout: Duration,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Keep the temp folders (repositories, coordinator logs).
    #[arg(long)]
    keep_temp: bool,
}

/// T top-level tasks completed at once, merged into `main` by the coordinator; the git CLI
/// merging the same branches as the reference.
#[derive(Serialize, Clone)]
struct TopLevel {
    tasks: usize,
    /// Which went first in this run: `coordinator` or `git`.
    first: &'static str,
    /// The T concurrent `Transition`s: the first send → the last answer.
    transitions_ms: f64,
    /// Per task: its `complete` answer → its `merged` event.
    complete_to_merged: Percentiles,
    /// Per task: its `complete` answer → its `delivery_requested` event.
    complete_to_requested: Percentiles,
    /// Between one `merged` event and the next (the base's turn passing on).
    merge_interval: Percentiles,
    /// The first `complete` answer → the last `merged`.
    span_ms: f64,
    merges_per_s: f64,
    fast_forwards: usize,
    merge_commits: usize,
    /// `delivery_failed` events (a step retried after a pause), and the first one's detail.
    delivery_failed: usize,
    first_failure: Option<String>,
    /// Coordinator CPU seconds (its own and its reaped git children's) over the span.
    coordinator_cpu_s: Option<f64>,
    /// `Leases.Claim` of a task nothing delivers, one at a time: before the completes, and
    /// from the first complete to the last merged.
    bystander_claim_before: Percentiles,
    bystander_claim_during: Percentiles,
    /// The git CLI: T `git merge --no-ff` in a row.
    git_span_ms: f64,
    git_merges_per_s: f64,
    git_merge: Percentiles,
    /// coordinator / git, merges per second.
    ratio: f64,
    /// Each task, in the order it merged: ms from the first `Transition` sent.
    timeline: Vec<TaskTimes>,
}

#[derive(Serialize, Clone)]
struct TaskTimes {
    task: String,
    answered_ms: f64,
    requested_ms: Option<f64>,
    merged_ms: f64,
    how: String,
}

/// S sub-tasks merged into their parent's branch, one after the other.
#[derive(Serialize, Clone)]
struct Integration {
    subtasks: usize,
    /// `Project::merge_into_parent`, each call.
    store: Percentiles,
    store_ms: Vec<f64>,
    /// What each call did: `fast-forward` or `merge commit`.
    store_kinds: Vec<&'static str>,
    /// The merge commits alone (all but the first).
    store_merge_commits: Percentiles,
    /// `git merge --no-ff`, each process.
    git: Percentiles,
    git_ms: Vec<f64>,
    /// store p50 / git p50.
    ratio_p50: f64,
}

/// One top-level delivery's steps, made in-process as the coordinator makes them.
#[derive(Serialize, Clone)]
struct Split {
    tasks: usize,
    /// The five record writes of one delivery, together.
    records: Percentiles,
    /// `prepare_delivery`: the merge built in memory (objects written and synced).
    prepare: Percentiles,
    /// `land_delivery`: `git merge --ff-only` in the checkout.
    land: Percentiles,
    /// All of one delivery.
    total: Percentiles,
    /// T deliveries one after the other, per second.
    merges_per_s: f64,
}

#[derive(Serialize, Clone)]
struct RunResult {
    top_level: TopLevel,
    integration: Integration,
    split: Split,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    coordinator: String,
    clock: &'static str,
    runs: Vec<RunResult>,
}

// ---- git ---------------------------------------------------------------------------------

/// `git -C dir ARGS` with a fixed identity; its trimmed stdout, or an error naming the
/// command and git's own words.
fn git(dir: &Path, args: &[&str]) -> Result<String> {
    git_with(dir, args, &[])
}

fn git_with(dir: &Path, args: &[&str], envs: &[(&str, &Path)]) -> Result<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=bench",
            "-c",
            "user.email=bench@example.com",
        ])
        .args(args)
        .envs(envs.iter().map(|(k, v)| (*k, *v)))
        .stdin(Stdio::null())
        .output()
        .context("run git (is it installed?)")?;
    if !out.status.success() {
        bail!(
            "git {} in {}: {}",
            args.join(" "),
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// `git merge-base --is-ancestor a b`.
fn is_ancestor(dir: &Path, a: &str, b: &str) -> Result<bool> {
    let st = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["merge-base", "--is-ancestor", a, b])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("run git")?;
    match st.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => bail!(
            "git merge-base --is-ancestor {a} {b} in {}: {st}",
            dir.display()
        ),
    }
}

/// A fresh multi-agent project on `main` with one commit; the commit.
fn init_project(root: &Path) -> Result<String> {
    std::fs::create_dir_all(root)?;
    std::fs::write(root.join(".agent.md"), "Mode: multi-agent\n")
        .context("write the project's .agent.md")?;
    std::fs::write(root.join("README.md"), "# delivery bench\n")?;
    git(root, &["init", "-q", "-b", BASE])?;
    git(root, &["add", "README.md"])?;
    git(root, &["commit", "-q", "-m", "init"])?;
    git(root, &["rev-parse", "HEAD"])
}

/// One branch to make: `branch` one commit ahead of `main`, adding `path`.
struct Work {
    branch: String,
    path: String,
    content: String,
}

/// Makes each branch with plumbing (the checkout, its index and HEAD untouched): the blobs
/// in one `hash-object`, each tree in a temp index, the refs in one `update-ref --stdin`.
/// The commits, in order.
fn make_branches(root: &Path, scratch: &Path, work: &[Work]) -> Result<Vec<String>> {
    let blobs_dir = scratch.join("blobs");
    std::fs::create_dir_all(&blobs_dir)?;
    let mut files = Vec::with_capacity(work.len());
    for (i, w) in work.iter().enumerate() {
        let f = blobs_dir.join(i.to_string());
        std::fs::write(&f, &w.content)?;
        files.push(f);
    }
    let mut args: Vec<&str> = vec!["hash-object", "-w", "--"];
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    args.extend(names.iter().map(String::as_str));
    let blobs: Vec<String> = git(root, &args)?.lines().map(str::to_string).collect();
    if blobs.len() != work.len() {
        bail!(
            "git hash-object gave {} ids for {} files",
            blobs.len(),
            work.len()
        );
    }
    let mut commits = Vec::with_capacity(work.len());
    let mut refs = String::new();
    for (i, (w, blob)) in work.iter().zip(&blobs).enumerate() {
        let index = scratch.join(format!("index-{i}"));
        let env = [("GIT_INDEX_FILE", index.as_path())];
        git_with(root, &["read-tree", BASE], &env)?;
        let info = format!("100644,{blob},{}", w.path);
        git_with(root, &["update-index", "--add", "--cacheinfo", &info], &env)?;
        let tree = git_with(root, &["write-tree"], &env)?;
        let _ = std::fs::remove_file(&index);
        let msg = format!("add {}", w.path);
        let commit = git(root, &["commit-tree", &tree, "-p", BASE, "-m", &msg])?;
        refs.push_str(&format!("create refs/heads/{} {commit}\n", w.branch));
        commits.push(commit);
    }
    let refs_file = scratch.join("refs.txt");
    std::fs::write(&refs_file, refs)?;
    let out = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(["update-ref", "--stdin"])
        .stdin(std::fs::File::open(&refs_file)?)
        .output()
        .context("run git update-ref")?;
    if !out.status.success() {
        bail!(
            "git update-ref --stdin: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let _ = std::fs::remove_dir_all(&blobs_dir);
    Ok(commits)
}

/// A fresh checkout of `main` holding every branch of `from`, at `to` (packed, as a clone
/// would be).
fn copy_repository(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    git(to, &["init", "-q", "-b", BASE])?;
    let src = from.display().to_string();
    git(
        to,
        &[
            "fetch",
            "-q",
            "--update-head-ok",
            &src,
            "refs/heads/*:refs/heads/*",
        ],
    )?;
    git(to, &["reset", "-q", "--hard", BASE])?;
    Ok(())
}

/// `git merge --no-ff` of each branch in turn in the checkout `dir`; each process's time.
fn git_merges(dir: &Path, branches: &[String]) -> Result<Vec<Duration>> {
    let mut took = Vec::with_capacity(branches.len());
    for b in branches {
        let t = Instant::now();
        git(dir, &["merge", "--no-ff", "-q", "--no-edit", b])?;
        took.push(t.elapsed());
    }
    Ok(took)
}

/// Every path is in the tree of `rev`.
fn check_files(dir: &Path, rev: &str, paths: &[String]) -> Result<()> {
    let listed = git(dir, &["ls-tree", "-r", "--name-only", rev])?;
    let listed: HashSet<&str> = listed.lines().collect();
    let missing: Vec<&String> = paths
        .iter()
        .filter(|p| !listed.contains(p.as_str()))
        .collect();
    if !missing.is_empty() {
        bail!(
            "{rev} in {} lacks {} of the {} files, first {}",
            dir.display(),
            missing.len(),
            paths.len(),
            missing[0]
        );
    }
    Ok(())
}

// ---- top-level tasks ---------------------------------------------------------------------

/// One event as received.
struct Seen {
    kind: String,
    task: String,
    detail: String,
    rx: Instant,
}

async fn watch(channel: Channel) -> Result<mpsc::UnboundedReceiver<Seen>> {
    let mut events = pb::events_client::EventsClient::new(channel)
        .watch_events(pb::WatchEventsRequest {})
        .await
        .map_err(crate::rpc::status_err)
        .context("WatchEvents")?
        .into_inner();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(e)) = events.message().await {
            let seen = Seen {
                rx: Instant::now(),
                kind: e.kind,
                task: e.task,
                detail: e.detail,
            };
            if tx.send(seen).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// `automaton/NAME into main at SHA (how)` → (SHA, how).
fn merged_detail(detail: &str) -> Option<(String, String)> {
    let rest = &detail[detail.find(" at ")? + 4..];
    let (sha, how) = rest.split_once(" (")?;
    Some((sha.to_string(), how.strip_suffix(')')?.to_string()))
}

/// utime + stime + cutime + cstime of `pid`, in clock ticks.
fn cpu_with_children(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    (11..=14).map(|i| fields.get(i)?.parse::<u64>().ok()).sum()
}

fn task_name(i: usize) -> String {
    format!("dl-{:03}", i + 1)
}

/// The project with its T finished tasks; the reference copy beside it. The names, files
/// and commits.
fn prepare_top_level(dir: &Path, tasks: usize) -> Result<(Vec<String>, Vec<String>, Vec<String>)> {
    let project = dir.join("project");
    init_project(&project)?;
    let names: Vec<String> = (0..tasks).map(task_name).collect();
    let files: Vec<String> = names.iter().map(|n| format!("files/{n}.txt")).collect();
    let work: Vec<Work> = names
        .iter()
        .zip(&files)
        .map(|(n, f)| Work {
            branch: format!("automaton/{n}"),
            path: f.clone(),
            content: format!("{n}\n"),
        })
        .collect();
    let commits = make_branches(&project, dir, &work)?;
    for i in 0..BYSTANDERS {
        let t = project.join(".automaton/tasks").join(bystander(i));
        std::fs::create_dir_all(&t)?;
        std::fs::write(t.join(".state"), "research\n")?;
    }
    for (n, f) in names.iter().zip(&files) {
        let t = project.join(".automaton/tasks").join(n);
        std::fs::create_dir_all(&t)?;
        std::fs::write(t.join(".state"), "referee\n")?;
        std::fs::write(t.join("SPEC.md"), format!("# {n}: add {f}\n"))?;
        std::fs::write(t.join("VERDICT.md"), "# VERDICT\n\nVerdict: PASS\n")?;
    }
    copy_repository(&project, &dir.join("reference"))?;
    std::fs::write(
        dir.join("coordinator.toml"),
        "[delivery]\nmode = \"merge\"\n",
    )?;
    Ok((names, files, commits))
}

/// What the coordinator did, as the events said.
struct Delivered {
    /// The first `Transition` sent.
    t0: Instant,
    transitions: Duration,
    answered: HashMap<String, Instant>,
    requested: HashMap<String, Instant>,
    /// Each `merged` event in order: task, receipt, SHA, how.
    merged: Vec<(String, Instant, String, String)>,
    failed: Vec<String>,
    cpu_s: Option<f64>,
    claims_before: Vec<Duration>,
    claims_during: Vec<Duration>,
}

fn bystander(i: usize) -> String {
    format!("by-{:02}", i + 1)
}

/// Claims and releases `task` as an operator; the claim's round trip.
async fn claim_release(channel: &Channel, task: &str) -> Result<Duration> {
    let mut leases = pb::leases_client::LeasesClient::new(channel.clone());
    let t = Instant::now();
    let lease = leases
        .claim(pb::ClaimRequest {
            task: task.to_string(),
            agent: "bench-bystander".into(),
            ..pb::ClaimRequest::default()
        })
        .await
        .map_err(crate::rpc::status_err)
        .with_context(|| format!("claim {task}"))?
        .into_inner();
    let took = t.elapsed();
    leases
        .release(pb::ReleaseRequest {
            lease_id: lease.lease_id,
            token: lease.token,
            ..pb::ReleaseRequest::default()
        })
        .await
        .map_err(crate::rpc::status_err)
        .with_context(|| format!("release {task}"))?;
    Ok(took)
}

async fn coordinator_delivers(
    args: &DeliveryArgs,
    dir: &Path,
    names: &[String],
) -> Result<Delivered> {
    let project = dir.join("project");
    let config = dir.join("coordinator.toml");
    let mut s = spawn::coordinator_with(
        &args.spawn_coordinator,
        &project,
        dir,
        &["--config".into(), config.display().to_string()],
    )?;
    eprintln!("  coordinator at {} (pid {})", s.url, s.pid());
    let pid = s.pid().to_string();
    let out = drive(args, &s.url.clone(), &pid, names).await;
    let how = s.stop();
    if out.is_err() {
        eprintln!("  {how} (log: {})", s.log.display());
    }
    out
}

async fn drive(args: &DeliveryArgs, url: &str, pid: &str, names: &[String]) -> Result<Delivered> {
    let channel = crate::connect_retry(url).await?;
    coord::wait_ready(&channel, Duration::from_secs(30)).await?;
    let mut events = watch(channel.clone()).await?;
    let mut claims_before = Vec::new();
    for round in 0..4 {
        for i in 0..BYSTANDERS {
            let took = claim_release(&channel, &bystander(i)).await?;
            if round > 0 {
                claims_before.push(took);
            }
        }
    }
    // Claims of other tasks, one at a time, until the last merge.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let probe = {
        let channel = channel.clone();
        tokio::spawn(async move {
            let mut took = Vec::new();
            let mut i = 0;
            while !*stop_rx.borrow() {
                took.push(claim_release(&channel, &bystander(i % BYSTANDERS)).await?);
                i += 1;
            }
            anyhow::Ok(took)
        })
    };
    let c0 = cpu_with_children(pid);
    let t0 = Instant::now();
    let mut calls = tokio::task::JoinSet::new();
    for n in names {
        let mut tasks = pb::tasks_client::TasksClient::new(channel.clone());
        let task = n.clone();
        calls.spawn(async move {
            let r = tasks
                .transition(pb::TransitionRequest {
                    task: task.clone(),
                    target: "complete".into(),
                    ..pb::TransitionRequest::default()
                })
                .await;
            (task, r.map(|_| Instant::now()))
        });
    }
    let mut answered = HashMap::new();
    while let Some(done) = calls.join_next().await {
        let (task, r) = done.context("a Transition call panicked")?;
        let at = r
            .map_err(crate::rpc::status_err)
            .with_context(|| format!("Transition {task} to complete"))?;
        answered.insert(task, at);
    }
    let transitions = t0.elapsed();

    let wanted: HashSet<&str> = names.iter().map(String::as_str).collect();
    let mut requested = HashMap::new();
    let mut merged: Vec<(String, Instant, String, String)> = Vec::new();
    let mut merged_tasks: HashSet<String> = HashSet::new();
    let mut failed = Vec::new();
    let mut c1 = None;
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut settle: Option<tokio::time::Instant> = None;
    loop {
        let until = settle.unwrap_or(deadline);
        let e = match tokio::time::timeout_at(until, events.recv()).await {
            Ok(Some(e)) => e,
            Ok(None) => bail!("the event stream ended"),
            Err(_) if settle.is_some() => break,
            Err(_) => bail!(
                "{} of {} tasks merged within {:?} ({} delivery_failed, first: {})",
                merged_tasks.len(),
                names.len(),
                args.timeout,
                failed.len(),
                failed.first().map_or("none", String::as_str)
            ),
        };
        if e.kind == "lagged" {
            bail!("the event stream lagged ({}): events were lost", e.detail);
        }
        if !wanted.contains(e.task.as_str()) {
            continue;
        }
        match e.kind.as_str() {
            "delivery_requested" => {
                requested.entry(e.task).or_insert(e.rx);
            }
            "merged" => {
                let (sha, how) = merged_detail(&e.detail)
                    .with_context(|| format!("an unexpected merged detail: {:?}", e.detail))?;
                merged_tasks.insert(e.task.clone());
                merged.push((e.task, e.rx, sha, how));
                if merged_tasks.len() == names.len() && settle.is_none() {
                    c1 = cpu_with_children(pid);
                    let _ = stop_tx.send(true);
                    settle = Some(tokio::time::Instant::now() + SETTLE);
                }
            }
            "delivery_failed" => failed.push(format!("{}: {}", e.task, e.detail)),
            "rework" | "delivery_awaiting_approval" | "delivery_abandoned" => {
                bail!("{} {}: {}", e.task, e.kind, e.detail)
            }
            _ => {}
        }
    }
    let claims_during = probe.await.context("the claim probe panicked")??;
    let cpu_s = match (c0, c1) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / CLK_TCK),
        _ => None,
    };
    Ok(Delivered {
        t0,
        transitions,
        answered,
        requested,
        merged,
        failed,
        cpu_s,
        claims_before,
        claims_during,
    })
}

/// Every task merged exactly once; `main` holds every file and commit, its merge commits are
/// the ones the events name, its head is the last `merged` commit, and the checkout followed.
fn verify_top_level(
    project: &Path,
    init: &str,
    names: &[String],
    files: &[String],
    commits: &[String],
    d: &Delivered,
) -> Result<()> {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for (t, ..) in &d.merged {
        *count.entry(t.as_str()).or_default() += 1;
    }
    for n in names {
        match count.get(n.as_str()) {
            Some(1) => {}
            Some(k) => bail!("{n} was merged {k} times (merged events)"),
            None => bail!("{n} was never merged"),
        }
    }
    let head = git(project, &["rev-parse", BASE])?;
    let last = &d.merged.last().context("no merged event")?.2;
    if &head != last {
        bail!("main is at {head}, the last merged event says {last}");
    }
    let branch = git(project, &["symbolic-ref", "--short", "HEAD"])?;
    if branch != BASE {
        bail!("the project's checkout is on {branch}, not {BASE}");
    }
    check_files(project, BASE, files)?;
    for (n, c) in names.iter().zip(commits) {
        if !is_ancestor(project, c, BASE)? {
            bail!("{n}'s commit {c} is not on main");
        }
    }
    let said = d.merged.iter().filter(|m| m.3 == "merge commit").count();
    let range = format!("{init}..{BASE}");
    let merges: usize = git(project, &["rev-list", "--merges", "--count", &range])?.parse()?;
    if merges != said {
        bail!("main has {merges} merge commits since the start; the events say {said}");
    }
    let others: usize = git(project, &["rev-list", "--no-merges", "--count", &range])?.parse()?;
    if others != names.len() {
        bail!(
            "main has {others} other commits since the start, not the {} tasks' commits",
            names.len()
        );
    }
    for (f, n) in files.iter().zip(names) {
        let on_disk = std::fs::read_to_string(project.join(f))
            .with_context(|| format!("the checkout lacks {f}"))?;
        if on_disk != format!("{n}\n") {
            bail!("the checkout's {f} is not the task's");
        }
    }
    let changed = git(project, &["status", "--porcelain", "--untracked-files=no"])?;
    if !changed.is_empty() {
        bail!("the checkout differs from main: {changed}");
    }
    Ok(())
}

async fn top_level(args: &DeliveryArgs, dir: &Path, git_first: bool) -> Result<TopLevel> {
    let (names, files, commits) = prepare_top_level(dir, args.tasks)?;
    let project = dir.join("project");
    let init = git(&project, &["rev-parse", BASE])?;
    let reference = dir.join("reference");
    let branches: Vec<String> = names.iter().map(|n| format!("automaton/{n}")).collect();
    let reference_merges = || -> Result<(Duration, Vec<Duration>)> {
        let t = Instant::now();
        let each = git_merges(&reference, &branches)?;
        let span = t.elapsed();
        check_files(&reference, BASE, &files)?;
        Ok((span, each))
    };
    let mut reference_run = if git_first {
        Some(reference_merges()?)
    } else {
        None
    };
    let d = coordinator_delivers(args, dir, &names).await?;
    verify_top_level(&project, &init, &names, &files, &commits, &d)?;
    let (git_span, git_each) = match reference_run.take() {
        Some(r) => r,
        None => reference_merges()?,
    };

    let first = d.answered.values().min().copied().context("no answers")?;
    let last = d.merged.last().context("no merged event")?.1;
    let span = last.saturating_duration_since(first);
    let merged_at: HashMap<&str, Instant> = d
        .merged
        .iter()
        .map(|(t, rx, ..)| (t.as_str(), *rx))
        .collect();
    let since_answer = |at: &HashMap<&str, Instant>| {
        Percentiles::of(
            names
                .iter()
                .filter_map(|n| Some(at.get(n.as_str())?.saturating_duration_since(d.answered[n])))
                .collect(),
        )
    };
    let requested: HashMap<&str, Instant> = d
        .requested
        .iter()
        .map(|(t, rx)| (t.as_str(), *rx))
        .collect();
    let intervals = d
        .merged
        .windows(2)
        .map(|w| w[1].1.saturating_duration_since(w[0].1))
        .collect();
    let per_s = |n: usize, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let merges_per_s = per_s(names.len(), span);
    let git_merges_per_s = per_s(names.len(), git_span);
    Ok(TopLevel {
        tasks: names.len(),
        first: if git_first { "git" } else { "coordinator" },
        transitions_ms: ms(d.transitions),
        complete_to_merged: since_answer(&merged_at),
        complete_to_requested: since_answer(&requested),
        merge_interval: Percentiles::of(intervals),
        span_ms: ms(span),
        merges_per_s,
        fast_forwards: d.merged.iter().filter(|m| m.3 == "fast-forward").count(),
        merge_commits: d.merged.iter().filter(|m| m.3 == "merge commit").count(),
        delivery_failed: d.failed.len(),
        first_failure: d.failed.first().cloned(),
        coordinator_cpu_s: d.cpu_s,
        bystander_claim_before: Percentiles::of(d.claims_before.clone()),
        bystander_claim_during: Percentiles::of(d.claims_during.clone()),
        git_span_ms: ms(git_span),
        git_merges_per_s,
        git_merge: Percentiles::of(git_each),
        ratio: merges_per_s / git_merges_per_s.max(1e-9),
        timeline: d
            .merged
            .iter()
            .map(|(t, rx, _, how)| TaskTimes {
                task: t.clone(),
                answered_ms: ms(d.answered[t].saturating_duration_since(d.t0)),
                requested_ms: d
                    .requested
                    .get(t)
                    .map(|r| ms(r.saturating_duration_since(d.t0))),
                merged_ms: ms(rx.saturating_duration_since(d.t0)),
                how: how.clone(),
            })
            .collect(),
    })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

// ---- a decomposition's integration -------------------------------------------------------

/// The parent's project: `p` and its sub-tasks' folders, their branches; a reference copy
/// beside it. The sub-tasks' names and files.
fn prepare_integration(dir: &Path, subtasks: usize) -> Result<(Vec<String>, Vec<String>)> {
    let project = dir.join("project");
    init_project(&project)?;
    let subs: Vec<String> = (1..=subtasks).map(|i| format!("s{i:02}")).collect();
    let files: Vec<String> = subs.iter().map(|s| format!("parts/{s}.txt")).collect();
    let work: Vec<Work> = subs
        .iter()
        .zip(&files)
        .map(|(s, f)| Work {
            branch: format!("automaton/{PARENT}--{s}"),
            path: f.clone(),
            content: format!("{PARENT}/{s}\n"),
        })
        .collect();
    make_branches(&project, dir, &work)?;
    git(&project, &["branch", &format!("automaton/{PARENT}"), BASE])?;
    let parent = project.join(".automaton/tasks").join(PARENT);
    std::fs::create_dir_all(&parent)?;
    std::fs::write(parent.join(".state"), "implement\n")?;
    std::fs::write(
        parent.join("SPEC.md"),
        format!("# {PARENT}: {subtasks} parts\n"),
    )?;
    for (s, f) in subs.iter().zip(&files) {
        let d = parent.join("subtasks").join(s);
        std::fs::create_dir_all(&d)?;
        std::fs::write(d.join(".state"), "complete\n")?;
        std::fs::write(d.join("SPEC.md"), format!("# {PARENT}/{s}: add {f}\n"))?;
        std::fs::write(d.join("VERDICT.md"), "# VERDICT\n\nVerdict: PASS\n")?;
    }
    copy_repository(&project, &dir.join("reference"))?;
    Ok((subs, files))
}

fn integration(dir: &Path, subtasks: usize) -> Result<Integration> {
    let (subs, files) = prepare_integration(dir, subtasks)?;
    let project = dir.join("project");
    let store = Project::open(&project, None);
    let mut store_each = Vec::with_capacity(subs.len());
    let mut kinds = Vec::with_capacity(subs.len());
    for s in &subs {
        let name: TaskName = format!("{PARENT}/{s}")
            .parse()
            .with_context(|| format!("the sub-task name {PARENT}/{s}"))?;
        let t = Instant::now();
        let done = store
            .merge_into_parent(&name)
            .with_context(|| format!("merge {name} into {PARENT}"))?;
        store_each.push(t.elapsed());
        kinds.push(match done {
            automaton_store::Integrated::FastForward { .. } => "fast-forward",
            automaton_store::Integrated::Merged { .. } => "merge commit",
            other => bail!("merging {name} into {PARENT} did nothing: {other:?}"),
        });
    }
    let parent_branch = format!("automaton/{PARENT}");
    check_files(&project, &parent_branch, &files)?;

    let reference = dir.join("reference");
    git(&reference, &["checkout", "-q", &parent_branch])?;
    let branches: Vec<String> = subs
        .iter()
        .map(|s| format!("automaton/{PARENT}--{s}"))
        .collect();
    let git_each = git_merges(&reference, &branches)?;
    check_files(&reference, &parent_branch, &files)?;

    let store_p = Percentiles::of(store_each.clone());
    let git_p = Percentiles::of(git_each.clone());
    Ok(Integration {
        subtasks: subs.len(),
        ratio_p50: store_p.p50_ms / git_p.p50_ms.max(1e-9),
        store_merge_commits: Percentiles::of(store_each.iter().skip(1).copied().collect()),
        store: store_p,
        store_ms: store_each.into_iter().map(ms).collect(),
        store_kinds: kinds,
        git: git_p,
        git_ms: git_each.into_iter().map(ms).collect(),
    })
}

// ---- where one delivery's time goes --------------------------------------------------------

/// The coordinator's steps of T deliveries into the checked-out `main`, in-process, one
/// after the other.
fn split(dir: &Path, tasks: usize) -> Result<Split> {
    let (names, files, _) = prepare_top_level(dir, tasks)?;
    let project = dir.join("project");
    let store = Project::open(&project, None);
    let (mut records, mut prepare, mut land, mut total) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let t0 = Instant::now();
    for n in &names {
        let task: TaskName = n.parse().with_context(|| format!("the task name {n}"))?;
        let start = Instant::now();
        let mut in_records = Duration::ZERO;
        let mut record = DeliveryRecord {
            mode: "merge".into(),
            strategy: "merge".into(),
            base: BASE.into(),
            branch: format!("automaton/{n}"),
            ..DeliveryRecord::default()
        };
        let mut save = |r: &DeliveryRecord| -> Result<()> {
            let t = Instant::now();
            store
                .write_delivery(&task, r)
                .with_context(|| format!("write {n}'s delivery record"))?;
            in_records += t.elapsed();
            Ok(())
        };
        save(&record)?;
        record.revision = store
            .branch_head(&task)?
            .with_context(|| format!("{n} has no branch"))?;
        record.state = DeliveryState::Preparing;
        save(&record)?;
        let t = Instant::now();
        let prepared = store.prepare_delivery(
            &task,
            BASE,
            Strategy::Merge,
            &record.revision,
            None,
            &format!("{n}: add a file"),
        )?;
        prepare.push(t.elapsed());
        let Prepared::Ready {
            base_before,
            commit,
            ..
        } = prepared
        else {
            bail!("{n}'s delivery did not prepare a merge");
        };
        record.base_before = base_before;
        record.commit = commit;
        record.state = DeliveryState::Ready;
        save(&record)?;
        record.state = DeliveryState::Merging;
        save(&record)?;
        let t = Instant::now();
        if !store.has_commit(&record.commit)? {
            bail!("{n}'s merge commit is missing");
        }
        store.land_delivery(&task, BASE, &record.base_before, &record.commit, None)?;
        land.push(t.elapsed());
        record.state = DeliveryState::Merged;
        save(&record)?;
        records.push(in_records);
        total.push(start.elapsed());
    }
    let span = t0.elapsed();
    check_files(&project, BASE, &files)?;
    Ok(Split {
        tasks: names.len(),
        records: Percentiles::of(records),
        prepare: Percentiles::of(prepare),
        land: Percentiles::of(land),
        total: Percentiles::of(total),
        merges_per_s: names.len() as f64 / span.as_secs_f64().max(1e-9),
    })
}

// ---- report -------------------------------------------------------------------------------

fn prow(name: &str, p: &Percentiles) -> String {
    format!(
        "  {name:<46} {:>5} {:>9} {:>9} {:>9}\n",
        p.count,
        fmt_ms(p.p50_ms),
        fmt_ms(p.p99_ms),
        fmt_ms(p.max_ms)
    )
}

fn run_table(i: usize, r: &RunResult) -> String {
    let t = &r.top_level;
    let mut out = format!(
        "run {}: {} tasks complete at once, merge delivery into main ({} first)\n",
        i + 1,
        t.tasks,
        t.first
    );
    out.push_str(&format!(
        "  {:<46} {:>5} {:>9} {:>9} {:>9}\n",
        "", "count", "p50", "p99", "max"
    ));
    out.push_str(&prow("complete answered -> merged", &t.complete_to_merged));
    out.push_str(&prow(
        "complete answered -> delivery_requested",
        &t.complete_to_requested,
    ));
    out.push_str(&prow("merged -> next merged", &t.merge_interval));
    out.push_str(&prow("git merge --no-ff, each (reference)", &t.git_merge));
    out.push_str(&prow(
        "another task's Claim, before the completes",
        &t.bystander_claim_before,
    ));
    out.push_str(&prow(
        "another task's Claim, while the deliveries run",
        &t.bystander_claim_during,
    ));
    out.push_str(&format!(
        "  coordinator: {} merged in {} ({:.1} merges/s; {} fast-forward, {} merge commits; {} delivery_failed; CPU {}); the {} transitions answered in {}\n",
        t.tasks,
        fmt_ms(t.span_ms),
        t.merges_per_s,
        t.fast_forwards,
        t.merge_commits,
        t.delivery_failed,
        t.coordinator_cpu_s.map_or("-".into(), |c| format!("{c:.2}s")),
        t.tasks,
        fmt_ms(t.transitions_ms),
    ));
    out.push_str(&format!(
        "  git CLI:     {} merged in {} ({:.1} merges/s); coordinator / git = {:.2}\n",
        t.tasks,
        fmt_ms(t.git_span_ms),
        t.git_merges_per_s,
        t.ratio
    ));
    let s = &r.split;
    out.push_str(&format!(
        "  in-process, one delivery after the other ({:.1} merges/s):\n",
        s.merges_per_s
    ));
    out.push_str(&prow("five record writes", &s.records));
    out.push_str(&prow("prepare_delivery (merge built, synced)", &s.prepare));
    out.push_str(&prow("land_delivery (git merge --ff-only)", &s.land));
    out.push_str(&prow("the whole delivery", &s.total));
    let g = &r.integration;
    out.push_str(&format!(
        "  {} sub-tasks merged into the parent's branch, one after the other:\n",
        g.subtasks
    ));
    out.push_str(&prow("store merge_into_parent, each", &g.store));
    out.push_str(&prow(
        "  the merge commits (all but the first)",
        &g.store_merge_commits,
    ));
    out.push_str(&prow("git merge --no-ff, each (reference)", &g.git));
    out.push_str(&format!("  store / git (p50) = {:.2}\n", g.ratio_p50));
    out
}

/// `a–b` of a figure over the runs.
fn range(runs: &[RunResult], f: &dyn Fn(&RunResult) -> f64, fmt: fn(f64) -> String) -> String {
    let lo = runs.iter().map(&f).fold(f64::INFINITY, f64::min);
    let hi = runs.iter().map(&f).fold(f64::NEG_INFINITY, f64::max);
    format!("{}–{}", fmt(lo), fmt(hi))
}

fn summary(runs: &[RunResult]) -> String {
    fn n1(v: f64) -> String {
        format!("{v:.1}")
    }
    fn n2(v: f64) -> String {
        format!("{v:.2}")
    }
    let mut out = format!("over {} run(s), ranges:\n", runs.len());
    let mut row = |name: &str, f: &dyn Fn(&RunResult) -> f64, fmt: fn(f64) -> String| {
        out.push_str(&format!("  {name:<46} {}\n", range(runs, f, fmt)));
    };
    row(
        "complete -> merged p50",
        &|r| r.top_level.complete_to_merged.p50_ms,
        fmt_ms,
    );
    row(
        "complete -> merged p99",
        &|r| r.top_level.complete_to_merged.p99_ms,
        fmt_ms,
    );
    row(
        "complete -> merged max",
        &|r| r.top_level.complete_to_merged.max_ms,
        fmt_ms,
    );
    row(
        "merged -> next merged p50",
        &|r| r.top_level.merge_interval.p50_ms,
        fmt_ms,
    );
    row("coordinator merges/s", &|r| r.top_level.merges_per_s, n1);
    row("git CLI merges/s", &|r| r.top_level.git_merges_per_s, n1);
    row("coordinator / git", &|r| r.top_level.ratio, n2);
    row(
        "another task's Claim while delivering, max",
        &|r| r.top_level.bystander_claim_during.max_ms,
        fmt_ms,
    );
    row("in-process delivery p50", &|r| r.split.total.p50_ms, fmt_ms);
    row(
        "  of which land (git merge --ff-only) p50",
        &|r| r.split.land.p50_ms,
        fmt_ms,
    );
    row(
        "sub-task into parent, store p50",
        &|r| r.integration.store.p50_ms,
        fmt_ms,
    );
    row(
        "sub-task into parent, store p99",
        &|r| r.integration.store.p99_ms,
        fmt_ms,
    );
    row(
        "sub-task into parent, git --no-ff p50",
        &|r| r.integration.git.p50_ms,
        fmt_ms,
    );
    out
}

pub async fn run(args: DeliveryArgs) -> Result<()> {
    if args.tasks == 0 || args.runs == 0 {
        bail!("--tasks and --runs must be at least 1");
    }
    if args.tasks > 999 {
        bail!("--tasks is at most 999 (the task names are dl-001 … dl-999)");
    }
    let scratch = spawn::scratch_dir()?;
    let outcome = async {
        let mut runs = Vec::new();
        for i in 0..args.runs {
            let dir = scratch.join(format!("run-{}", i + 1));
            eprintln!("run {} of {} in {}", i + 1, args.runs, dir.display());
            let top = top_level(&args, &dir.join("top"), i % 2 == 1).await?;
            let integration = tokio::task::block_in_place(|| {
                integration(&dir.join("integration"), usize::from(args.subtasks))
            })?;
            let split = tokio::task::block_in_place(|| split(&dir.join("split"), args.tasks))?;
            let r = RunResult {
                top_level: top,
                integration,
                split,
            };
            eprint!("{}", run_table(i, &r));
            runs.push(r);
        }
        anyhow::Ok(runs)
    }
    .await;
    // Removed after the last run, not between runs (see `dispatch`: a disk that has just
    // deleted many files creates new ones slower for a minute).
    if args.keep_temp || outcome.is_err() {
        eprintln!("kept {}", scratch.display());
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let runs = outcome?;
    for (i, r) in runs.iter().enumerate() {
        print!("{}", run_table(i, r));
    }
    print!("{}", summary(&runs));
    if let Some(path) = &args.json_out {
        let report = Report {
            command: std::env::args().collect::<Vec<_>>().join(" "),
            unix_time: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or_default(),
            coordinator: args.spawn_coordinator.display().to_string(),
            clock: "the bench's receipt instants: Transition answers and Events.WatchEvents",
            runs,
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
    fn reads_the_merged_events_detail() {
        assert_eq!(
            merged_detail("automaton/dl-001 into main at 0123abcd (fast-forward)"),
            Some(("0123abcd".into(), "fast-forward".into()))
        );
        assert_eq!(
            merged_detail("automaton/dl-002 into main on origin at 89ef (merge commit)"),
            Some(("89ef".into(), "merge commit".into()))
        );
        assert_eq!(merged_detail("garbage"), None);
    }
}
