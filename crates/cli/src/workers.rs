//! `automaton workers`: the fleet as the coordinator sees it, and `drain` / `undrain`.

use std::path::PathBuf;

use automaton_proto::v1 as pb;
use automaton_store::Project;
use automaton_workflow::DeliveryState;
use clap::{Args, Subcommand};

use crate::backend::{self, Backend, Failure};
use crate::from_wire;

/// Which coordinator a command talks to: `--project` finds it, `--coordinator` names it.
#[derive(Debug, Args)]
pub struct Target {
    /// Project folder (default: the current directory): finds its coordinator.
    #[arg(long, value_name = "PATH")]
    pub project: Option<PathBuf>,
    /// The coordinator, or the leader of several (comma-separated). Default:
    /// AUTOMATON_COORDINATOR, else the one that owns the project.
    #[arg(long, value_name = "URL")]
    pub coordinator: Option<String>,
}

#[derive(Debug, Args)]
pub struct WorkersArgs {
    #[command(subcommand)]
    pub action: Option<WorkersAction>,
    /// Project folder (default: the current directory): finds its coordinator.
    #[arg(long, value_name = "PATH", global = true)]
    pub project: Option<PathBuf>,
    /// The coordinator, or the leader of several (comma-separated). Default:
    /// AUTOMATON_COORDINATOR, else the one that owns the project.
    #[arg(long, value_name = "URL", global = true)]
    pub coordinator: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StopArgs {
    /// The task whose run to stop (`name` or `parent/sub`).
    pub task: String,
    /// Let a stopped (or held) task be dispatched again instead.
    #[arg(long)]
    pub resume: bool,
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The task whose next phase to run (`name` or `parent/sub`).
    pub task: String,
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct DeliverArgs {
    /// The top-level task whose delivery goes on.
    pub task: String,
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct AbandonArgs {
    /// The top-level task whose delivery to give up.
    pub task: String,
    /// Why (kept in the record and the event).
    #[arg(long, default_value = "")]
    pub reason: String,
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    /// Remove the task branches whose work is delivered (merged into their base) or
    /// abandoned; every other delivered task's branch is listed with why it stays.
    #[arg(long)]
    pub branches: bool,
    /// List what would be removed; remove nothing.
    #[arg(long)]
    pub dry_run: bool,
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ApproveArgs {
    /// The task (`name` or `parent/sub`).
    pub task: String,
    /// Who approves (default: the token's name, or `user`).
    #[arg(long)]
    pub approver: Option<String>,
    /// A code review whose branch moved since its review: the head commit you read and
    /// approve (7 to 64 hex digits).
    #[arg(long, value_name = "SHA")]
    pub revision: Option<String>,
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct TasksArgs {
    #[command(flatten)]
    pub target: crate::workers::Target,
    #[arg(long)]
    pub json: bool,
}

/// A parent's sub-task verdicts as JSON (`tasks --json`, the demo's summary).
pub(crate) fn verdicts_json(v: &pb::SubtaskVerdicts) -> serde_json::Value {
    serde_json::json!({
        "pass": v.pass,
        "fail": v.fail,
        "needs_review": v.needs_review,
        "no_verdict": v.no_verdict,
        "not_terminal": v.not_terminal,
        "summary": v.summary,
    })
}

fn task_json(t: &pb::TaskSummary) -> serde_json::Value {
    serde_json::json!({
        "task": t.task,
        "state": t.state,
        "holder": t.lease_holder,
        "wave": t.wave,
        "estimated_tokens": t.estimated_tokens,
        "waiting": t.waiting,
        "held": t.held,
        "verdicts": t.verdicts.as_ref().map(verdicts_json),
        "attention": t.attention,
        "next_command": t.next_command,
        "last_failure": t.last_failure,
        "delivery": t.delivery.as_ref().map(delivery_json),
        "subtasks": t.subtasks.iter().map(task_json).collect::<Vec<_>>(),
    })
}

/// A delivery as `--json` prints it.
pub fn delivery_json(d: &pb::Delivery) -> serde_json::Value {
    serde_json::json!({
        "state": d.state,
        "mode": d.mode,
        "strategy": d.strategy,
        "base": d.base,
        "branch": d.branch,
        "remote": d.remote,
        "revision": d.revision,
        "commit": d.commit,
        "how": d.how,
        "url": d.url,
        "number": d.number,
        "approved_by": d.approved_by,
        "waiting": d.waiting,
        "failure": d.failure,
        "failures": d.failures,
        "abandoned_by": d.abandoned_by,
        "reworks": d.reworks,
        "requested_at": crate::from_wire::time_text(d.requested_at.as_ref()),
        "updated_at": crate::from_wire::time_text(d.updated_at.as_ref()),
    })
}

/// A delivery in one line: where the work went, or why it has not yet.
pub fn delivery_line(d: &pb::Delivery) -> String {
    let into = if d.remote.is_empty() {
        format!("into {}", d.base)
    } else {
        format!("into {} on {}", d.base, d.remote)
    };
    let state = automaton_proto::vocab::delivery_state(d);
    let mut l = match state {
        Some(DeliveryState::Merged) => format!("merged {into} at {} ({})", d.commit, d.how),
        Some(DeliveryState::Opened) => format!("pull request #{} open: {}", d.number, d.url),
        Some(DeliveryState::Abandoned) => format!(
            "abandoned by {}: {} (its branch {} goes with automaton gc --branches)",
            d.abandoned_by, d.failure, d.branch
        ),
        _ => format!("{} {into} ({} {})", d.state, d.mode, d.strategy),
    };
    if !d.waiting.is_empty() {
        l.push_str(&format!(" — {}", d.waiting));
    } else if !d.failure.is_empty() && !state.is_some_and(DeliveryState::is_final) {
        l.push_str(&format!(
            " — last failure ({} so far): {}",
            d.failures, d.failure
        ));
    }
    if d.reworks > 0 {
        l.push_str(&format!(" [sent back to implement {} time(s)]", d.reworks));
    }
    l
}

fn tasks_text(tasks: &[pb::TaskSummary]) -> String {
    if tasks.is_empty() {
        return "No tasks: create one with automaton status --create-task NAME.\n".into();
    }
    let mut out = String::new();
    let mut line = |t: &pb::TaskSummary, indent: &str| {
        let mut l = format!(
            "{indent}{}  {}",
            t.task,
            if t.state.is_empty() { "?" } else { &t.state }
        );
        if t.wave > 0 {
            l.push_str(&format!("  wave {}", t.wave));
        }
        if t.estimated_tokens > 0 {
            l.push_str(&format!("  ~{}k tokens", t.estimated_tokens / 1000));
        }
        if !t.lease_holder.is_empty() {
            l.push_str(&format!("  held by {}", t.lease_holder));
        }
        if !t.held.is_empty() {
            l.push_str(&format!("  HELD: {}", t.held));
        } else if !t.waiting.is_empty() {
            l.push_str(&format!("  ({})", t.waiting));
        }
        if let Some(v) = &t.verdicts {
            let not_terminal = if v.not_terminal.is_empty() {
                String::new()
            } else {
                format!(" (not terminal yet: {})", v.not_terminal.join(", "))
            };
            l.push_str(&format!("  sub-task verdicts: {}{not_terminal}", v.summary));
        }
        if !t.next_command.is_empty() {
            l.push_str(&format!("  next: {}", t.next_command));
        }
        out.push_str(&l);
        out.push('\n');
        // Seed 002's line on a line of its own, under the task it is about.
        if !t.attention.is_empty() {
            let pad = " ".repeat(indent.chars().count());
            out.push_str(&format!("{pad}    {}\n", t.attention));
        }
        // A held task's last failed run, in one line: why it stopped, what it said last.
        if !t.held.is_empty() && !t.last_failure.is_empty() {
            let pad = " ".repeat(indent.chars().count());
            out.push_str(&format!("{pad}    last run: {}\n", t.last_failure));
        }
        if let Some(d) = &t.delivery {
            let pad = " ".repeat(indent.chars().count());
            out.push_str(&format!("{pad}    delivery: {}\n", delivery_line(d)));
        }
    };
    for t in tasks {
        line(t, "");
        for s in &t.subtasks {
            line(s, "  └ ");
        }
    }
    out
}

fn tasks_act(args: &TasksArgs) -> Result<String, Failure> {
    let backend = backend_of(
        args.target.project.as_deref(),
        args.target.coordinator.as_deref(),
    )?;
    let tasks = backend.task_summaries()?;
    Ok(if args.json {
        format!(
            "{}\n",
            serde_json::Value::Array(tasks.iter().map(task_json).collect())
        )
    } else {
        tasks_text(&tasks)
    })
}

/// Runs `automaton tasks`; prints and returns the exit code.
pub fn tasks(args: &TasksArgs) -> i32 {
    finish(tasks_act(args), args.json)
}

#[derive(Debug, Subcommand)]
pub enum WorkersAction {
    /// Stop new work for a worker (it keeps what it holds).
    Drain { name: String },
    /// Let a drained worker take work again.
    Undrain { name: String },
}

const GIB: f64 = (1u64 << 30) as f64;

fn json(w: &pb::WorkerInfo) -> serde_json::Value {
    let b = w.budget.clone().unwrap_or_default();
    serde_json::json!({
        "name": w.name,
        "host": w.host,
        "state": w.state,
        "simulated": w.simulated,
        "gpus": w.gpus.iter().map(|g| serde_json::json!({
            "index": g.index,
            "name": g.name,
            "uuid": g.uuid,
            "total_bytes": g.total_bytes,
            "free_bytes": g.free_bytes,
            "driver": g.driver,
        })).collect::<Vec<_>>(),
        "ram_bytes": w.ram_bytes,
        "cpus": w.cpus,
        "budget": {
            "model_context_kb": b.model_context_kb,
            "framework_overhead_tokens": b.framework_overhead_tokens,
            "recommended_kb": b.recommended_kb,
            "headroom": b.headroom,
            "max_peak_context_kb": b.max_peak_context_kb,
            "source": b.source,
            "context_source": b.context_source,
            "num_ctx": b.num_ctx,
        },
        "capacity": w.capacity,
        "leases": w.leases.iter().map(|l| serde_json::json!({"task": l.task, "phase": l.phase})).collect::<Vec<_>>(),
        "runs": runs_json(&w.runs),
        "heartbeat_age_ms": from_wire::millis(w.heartbeat_age.as_ref()),
        "since": from_wire::time_text(w.since.as_ref()),
        "session_id": w.session_id,
        "version": w.version,
    })
}

/// Agent runs as JSON (for `workers --json` and `status --task --json`).
pub fn runs_json(runs: &[pb::Run]) -> serde_json::Value {
    serde_json::Value::Array(
        runs.iter()
            .map(|r| {
                serde_json::json!({
                    "worker": r.worker,
                    "phase": r.phase,
                    "token": r.token,
                    "state": r.state,
                    "stop_reason": r.stop_reason,
                    "detail": r.detail,
                    "exit_code": r.exit_code,
                    "started_at": from_wire::time_text(r.started_at.as_ref()),
                    "ended_at": from_wire::time_text(r.ended_at.as_ref()),
                    "estimated_tokens": r.estimated_tokens,
                    "peak_context_tokens": r.peak_context_tokens,
                    "peak_context_source": r.peak_context_source,
                    "why": r.why,
                    "commit": r.commit,
                })
            })
            .collect(),
    )
}

fn gpus(w: &pb::WorkerInfo) -> String {
    if w.gpus.is_empty() {
        return "none".into();
    }
    let list: Vec<String> = w
        .gpus
        .iter()
        .map(|g| {
            format!(
                "{} {:.1}/{:.1} GiB free",
                g.name,
                g.free_bytes as f64 / GIB,
                g.total_bytes as f64 / GIB
            )
        })
        .collect();
    format!(
        "{}{}",
        list.join(", "),
        if w.simulated { " (simulated)" } else { "" }
    )
}

fn table(workers: &[pb::WorkerInfo]) -> String {
    if workers.is_empty() {
        return "No workers: start automaton-worker --coordinator URL on each GPU machine.\n"
            .into();
    }
    let rows: Vec<[String; 7]> = workers
        .iter()
        .map(|w| {
            let budget = w.budget.clone().unwrap_or_default();
            let work = if w.leases.is_empty() {
                "-".to_string()
            } else {
                w.leases
                    .iter()
                    .map(|l| {
                        let run = w
                            .runs
                            .iter()
                            .find(|r| r.phase == l.phase)
                            .map(|r| format!(", run {}", r.state))
                            .unwrap_or_default();
                        format!("{} ({}{run})", l.task, l.phase)
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            [
                w.name.clone(),
                w.state.clone(),
                if w.host.is_empty() {
                    "-".into()
                } else {
                    w.host.clone()
                },
                gpus(w),
                format!("{}k ({})", budget.max_peak_context_kb / 1000, budget.source),
                work,
                format!(
                    "{:.1}s",
                    from_wire::millis(w.heartbeat_age.as_ref()) as f64 / 1000.0
                ),
            ]
        })
        .collect();
    let head = [
        "NAME",
        "STATE",
        "HOST",
        "GPUS",
        "BUDGET (max peak context)",
        "TASK (PHASE)",
        "HEARD",
    ];
    let mut width = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: Vec<&str>, out: &mut String| {
        let mut l = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                l.push_str(c);
            } else {
                l.push_str(&format!("{c:<w$}  ", w = width[i]));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(head.to_vec(), &mut out);
    for r in &rows {
        line(r.iter().map(String::as_str).collect(), &mut out);
    }
    out
}

fn backend_of(
    project: Option<&std::path::Path>,
    coordinator: Option<&str>,
) -> Result<Backend, Failure> {
    let cwd = std::env::current_dir()
        .map_err(|e| Failure::Usage(format!("cannot read the current directory: {e}")))?;
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let project = Project::open(project.unwrap_or(&cwd), home.as_deref());
    Ok(match backend::find_coordinator(&project, coordinator)? {
        Some(address) => Backend::remote(project, address)?,
        None => Backend::Local(project),
    })
}

/// The task an operator's command names, and the coordinator (or files) to act on.
fn task_and_backend(
    task: &str,
    target: &Target,
) -> Result<(automaton_workflow::TaskName, Backend), Failure> {
    let task = task
        .parse()
        .map_err(|e: automaton_workflow::NameError| Failure::Store(e.into()))?;
    let backend = backend_of(target.project.as_deref(), target.coordinator.as_deref())?;
    Ok((task, backend))
}

fn stop_act(args: &StopArgs) -> Result<String, Failure> {
    let (task, backend) = task_and_backend(&args.task, &args.target)?;
    let out = backend.stop_run(&task, args.resume)?;
    Ok(if args.json {
        format!(
            "{}
",
            serde_json::json!({"task": out.task, "worker": out.worker, "held": out.held, "resumed": args.resume})
        )
    } else if args.resume {
        format!(
            "Task '{}' may be dispatched again.
",
            out.task
        )
    } else if out.worker.is_empty() {
        format!(
            "No run on '{}'; it is held from dispatch (automaton stop {} --resume to undo).
",
            out.task, out.task
        )
    } else {
        format!(
            "Stopped the run of '{}' on {} (operator_stopped); the task is held from dispatch (automaton stop {} --resume to undo).
",
            out.task, out.worker, out.task
        )
    })
}

/// Runs `automaton stop …`; prints and returns the exit code.
pub fn stop(args: &StopArgs) -> i32 {
    finish(stop_act(args), args.json)
}

fn run_act(args: &RunArgs) -> Result<String, Failure> {
    let (task, backend) = task_and_backend(&args.task, &args.target)?;
    let out = backend.run_task(&task)?;
    Ok(if args.json {
        format!(
            "{}\n",
            serde_json::json!({"task": out.task, "phase": out.phase})
        )
    } else {
        format!(
            "Task '{}' runs its {} next: the first idle worker that fits takes it (automaton watch follows it).\n",
            out.task, out.phase
        )
    })
}

fn deliver_act(args: &DeliverArgs) -> Result<String, Failure> {
    let (task, backend) = task_and_backend(&args.task, &args.target)?;
    let d = backend.deliver(&task)?;
    Ok(if args.json {
        format!("{}\n", delivery_json(&d))
    } else {
        format!(
            "Task '{task}': its delivery goes on ({}); automaton watch follows it.\n",
            delivery_line(&d)
        )
    })
}

/// Runs `automaton deliver TASK`; prints and returns the exit code.
pub fn deliver(args: &DeliverArgs) -> i32 {
    finish(deliver_act(args), args.json)
}

fn abandon_act(args: &AbandonArgs) -> Result<String, Failure> {
    let (task, backend) = task_and_backend(&args.task, &args.target)?;
    let d = backend.abandon(&task, &args.reason)?;
    Ok(if args.json {
        format!("{}\n", delivery_json(&d))
    } else {
        format!("Task '{task}': delivery {}.\n", delivery_line(&d))
    })
}

/// Runs `automaton abandon TASK`; prints and returns the exit code.
pub fn abandon(args: &AbandonArgs) -> i32 {
    finish(abandon_act(args), args.json)
}

fn gc_act(args: &GcArgs) -> Result<String, Failure> {
    if !args.branches {
        return Err(Failure::Usage(
            "automaton gc: say what to collect: --branches (task branches whose work is delivered or abandoned)".into(),
        ));
    }
    let backend = backend_of(
        args.target.project.as_deref(),
        args.target.coordinator.as_deref(),
    )?;
    let branches = backend.collect_branches(args.dry_run)?;
    if args.json {
        let v: Vec<serde_json::Value> = branches
            .iter()
            .map(|b| serde_json::json!({"task": b.task, "branch": b.branch, "removed": b.removed, "why": b.why}))
            .collect();
        return Ok(format!("{}\n", serde_json::Value::Array(v)));
    }
    if branches.is_empty() {
        return Ok("No delivered task has a branch left.\n".into());
    }
    let verb = if args.dry_run {
        "would remove"
    } else {
        "removed"
    };
    let mut out = String::new();
    for b in &branches {
        out.push_str(&format!(
            "{} {}: {}\n",
            if b.removed { verb } else { "kept" },
            b.branch,
            b.why
        ));
    }
    Ok(out)
}

/// Runs `automaton gc --branches`; prints and returns the exit code.
pub fn gc(args: &GcArgs) -> i32 {
    finish(gc_act(args), args.json)
}

/// Runs `automaton run TASK` (manual mode); prints and returns the exit code.
pub fn run_task(args: &RunArgs) -> i32 {
    finish(run_act(args), args.json)
}

fn act(args: &WorkersArgs) -> Result<String, Failure> {
    let backend = backend_of(args.project.as_deref(), args.coordinator.as_deref())?;
    let one = |w: pb::WorkerInfo, verb: &str| {
        if args.json {
            format!("{}\n", json(&w))
        } else {
            format!("Worker '{}' {verb} (state: {}).\n", w.name, w.state)
        }
    };
    match &args.action {
        None => {
            let workers = backend.list_workers()?;
            Ok(if args.json {
                format!(
                    "{}\n",
                    serde_json::Value::Array(workers.iter().map(json).collect())
                )
            } else {
                table(&workers)
            })
        }
        Some(WorkersAction::Drain { name }) => Ok(one(
            backend.drain_worker(name, false)?,
            "is draining: it takes no new work",
        )),
        Some(WorkersAction::Undrain { name }) => {
            Ok(one(backend.drain_worker(name, true)?, "takes work again"))
        }
    }
}

/// Runs `automaton workers …`; prints and returns the exit code.
pub fn run(args: &WorkersArgs) -> i32 {
    finish(act(args), args.json)
}

fn finish(out: Result<String, Failure>, json: bool) -> i32 {
    match out {
        Ok(out) => {
            crate::print(&out);
            0
        }
        Err(f) => crate::report_failure(f, json),
    }
}
