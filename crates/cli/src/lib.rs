//! The `automaton` command. `automaton status …` implements every command of the status
//! script spec (seed 004) plus seed 001's leases, with the flags, output lines, messages
//! and exit codes that prompts written for `status.py` expect; `--json` gives the same facts
//! to machines. `init` writes a project's `.automaton/` skeleton. The operators' commands
//! talk to the coordinator: `workers`, `tasks`, `stop`, `run` (manual mode), `approve`, and
//! the live views `watch` (the event stream) and `top` (a dashboard).
//!
//! This crate parses arguments and renders results. It must not decide policy: every check
//! lives in `automaton-workflow` and every file operation in `automaton-store`.

mod backend;
mod demo;
mod from_wire;
mod init;
mod logs;
mod render;
mod top;
mod watch;
mod workers;

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use automaton_store::{ErrorKind, Project};

use crate::backend::{Backend, Failure};
use automaton_workflow::{AgentId, State, TaskName, parse_duration};
use clap::{ArgGroup, Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "automaton",
    version,
    about = "Coordinate fleets of LLM coding agents through a strict task lifecycle"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The status commands of the status-script spec (what `status.py` did).
    Status(StatusArgs),
    /// Write the project's `.automaton/` skeleton (`.agent.md`, `.gitignore`, the prompts to
    /// edit), keeping every file that exists; prints one line per file.
    Init(init::InitArgs),
    /// The fleet: every worker with its GPUs, budget, state, task and heartbeat age.
    Workers(workers::WorkersArgs),
    /// Stop the agent run on a task (`operator_stopped`) and hold the task from dispatch;
    /// `--resume` lets it be dispatched again.
    Stop(workers::StopArgs),
    /// Manual mode (`Autopilot: Disabled`): run a task's next phase, once, on the first idle
    /// worker that fits.
    Run(workers::RunArgs),
    /// Approve the artifact a task awaits sign-off on (as `status --task T --approve`).
    Approve(workers::ApproveArgs),
    /// Let a finished task's delivery go on: the approval `[delivery] approve = true` waits
    /// for, or a retry after a person fixed what stopped it.
    Deliver(workers::DeliverArgs),
    /// Give up a finished task's delivery: nothing more of it lands.
    Abandon(workers::AbandonArgs),
    /// Remove what is no longer needed: `--branches`, the task branches whose work is merged
    /// into its base or abandoned.
    Gc(workers::GcArgs),
    /// Every task and sub-task: phase, holder, wave, estimate and why it waits.
    Tasks(workers::TasksArgs),
    /// The coordinator's events as they happen, one line each (`--json`: one object each).
    Watch(watch::WatchArgs),
    /// A task's run output as the agent prints it (`-f`: follow it until the run ends).
    Logs(logs::LogsArgs),
    /// A live dashboard of the fleet and the tasks (needs a terminal; `q` quits).
    Top(top::TopArgs),
    /// The whole product on this machine: a coordinator and three simulated GPU workers take
    /// a task planned in two waves of sub-tasks to `complete`, approving gates themselves.
    Demo(demo::DemoArgs),
}

/// Flags are spelled as seed 004 spells them, so `status.py` prompts keep working.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("action").multiple(false).args([
    "transition", "approve", "create_task", "list", "validate_folder", "audit", "can_edit",
    "can_create_task", "scope_check", "same_session", "upgrade", "claim", "release",
])))]
pub struct StatusArgs {
    /// The task (`name` or `parent/sub`). Alone: show its phase, allowed and forbidden actions.
    #[arg(long, value_name = "NAME")]
    pub task: Option<String>,
    /// Project folder (default: the current directory). Tasks live in {project}/.automaton/tasks/.
    #[arg(long, value_name = "PATH")]
    pub project: Option<PathBuf>,
    /// Move the task to PHASE, if the lifecycle allows it.
    #[arg(long, value_name = "PHASE")]
    pub transition: Option<String>,
    /// Approve the artifact awaiting sign-off (`:awaiting_approval` → `:approved`).
    #[arg(long)]
    pub approve: bool,
    /// Who approves (default `user`).
    #[arg(
        long,
        value_name = "NAME",
        default_value = "user",
        requires = "approve"
    )]
    pub approver: String,
    /// With --approve of a code review whose branch moved since the review read it: the
    /// commit (its head, 7 to 64 hex digits) a person read and approves instead.
    #[arg(long, value_name = "SHA", requires = "approve")]
    pub revision: Option<String>,
    /// Create a task (kebab-case; `parent/sub` for a sub-task) in state `new`.
    #[arg(long, value_name = "NAME")]
    pub create_task: Option<String>,
    /// List all tasks with their phase and next step.
    #[arg(long)]
    pub list: bool,
    /// Check the task folder for artifacts of phases not yet reached (exit 0 PASS, 1 FAIL, 2 error).
    #[arg(long)]
    pub validate_folder: bool,
    /// Audit every task (exit 0 clean, 1 violations, 2 error).
    #[arg(long)]
    pub audit: bool,
    /// Hook: may code be edited in the task's phase? (exit 0 ALLOWED, 1 DENIED)
    #[arg(long)]
    pub can_edit: bool,
    /// Hook: may a task be created? (always ALLOWED)
    #[arg(long)]
    pub can_create_task: bool,
    /// Hook: is --file inside the project or ~/.automaton/? (exit 0 IN_SCOPE, 1 OUT_OF_SCOPE)
    #[arg(long, requires = "file")]
    pub scope_check: bool,
    /// The file for --scope-check.
    #[arg(long, value_name = "PATH")]
    pub file: Option<PathBuf>,
    /// Hook: was the task created within --window? (exit 1 SAME_SESSION, 0 DIFFERENT_SESSION)
    #[arg(long)]
    pub same_session: bool,
    /// The window for --same-session (e.g. 30m, 1h; a bare number means minutes).
    #[arg(long, value_name = "DURATION", default_value = "30m")]
    pub window: String,
    /// Write .state for task folders that have none, from their artifacts (all, or --task).
    #[arg(long)]
    pub upgrade: bool,
    /// Claim the task's lease for --agent (multi-agent mode).
    #[arg(long, requires = "agent")]
    pub claim: bool,
    /// Release --agent's lease on the task.
    #[arg(long, requires = "agent")]
    pub release: bool,
    /// The agent id for --claim, --release, and --transition under a lease.
    #[arg(long, value_name = "ID")]
    pub agent: Option<String>,
    /// The fencing token of the lease, checked by --transition when given.
    #[arg(long, value_name = "N")]
    pub token: Option<u64>,
    /// Lease length for --claim (default: .agent.md's lock timeout, else 30m).
    #[arg(long, value_name = "DURATION")]
    pub ttl: Option<String>,
    /// The lease id, presented with --transition under a coordinator's lease.
    #[arg(long, value_name = "ID")]
    pub lease: Option<String>,
    /// Send the request to this coordinator, or to the leader of several (comma-separated:
    /// coordinators sharing the project on etcd). Default: AUTOMATON_COORDINATOR, else the
    /// one that owns the project, found in .automaton/coordinator.lock. Each call waits at most
    /// 60 s for its answer, or AUTOMATON_CALL_TIMEOUT (e.g. 2m).
    #[arg(long, value_name = "URL")]
    pub coordinator: Option<String>,
    /// Work on the files even if a coordinator owns the project (reads only are safe).
    #[arg(long, hide = true)]
    pub local: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// The actions other than showing, changing or leasing a task.
fn other_action(args: &StatusArgs) -> bool {
    args.create_task.is_some()
        || args.list
        || args.validate_folder
        || args.audit
        || args.can_edit
        || args.can_create_task
        || args.scope_check
        || args.same_session
        || args.upgrade
}

fn usage(msg: impl Into<String>) -> Failure {
    Failure::Usage(msg.into())
}

/// What a command printed and the exit code it ends with.
pub struct Output {
    pub stdout: String,
    pub code: i32,
    /// A line for stderr after the output (why a command that printed ends non-zero).
    pub note: Option<String>,
}

impl Output {
    fn ok(stdout: String) -> Output {
        Output::with_code(stdout, 0)
    }

    fn with_code(stdout: String, code: i32) -> Output {
        Output {
            stdout,
            code,
            note: None,
        }
    }
}

/// The project the command names: `--project`, else the current directory.
fn open_project(args: &StatusArgs) -> Result<(Project, PathBuf), Failure> {
    let cwd = std::env::current_dir()
        .map_err(|e| usage(format!("cannot read the current directory: {e}")))?;
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let project = Project::open(args.project.as_deref().unwrap_or(&cwd), home.as_deref());
    Ok((project, cwd))
}

/// A `.agent.md` at the project root instead of `{project}/.automaton/` (seed 002).
fn misplaced_agent_md_warning(args: &StatusArgs) -> Option<String> {
    let (project, _) = open_project(args).ok()?;
    let (legacy, honoured) = project.misplaced_agent_md()?;
    let right = project.meta().join(".agent.md");
    Some(if honoured {
        format!(
            "WARNING: {} is read, but the project's .agent.md belongs in {}: move it there.",
            legacy.display(),
            right.display()
        )
    } else {
        format!(
            "WARNING: {} is ignored: the policy is read from {}. Merge what it says into that file and remove it.",
            legacy.display(),
            right.display()
        )
    })
}

/// Runs a parsed command line; prints and returns the exit code.
pub fn run(cli: Cli) -> i32 {
    match cli.command {
        Command::Init(args) => init::run(&args),
        Command::Workers(args) => workers::run(&args),
        Command::Stop(args) => workers::stop(&args),
        Command::Logs(args) => logs::run(&args),
        Command::Run(args) => workers::run_task(&args),
        Command::Deliver(args) => workers::deliver(&args),
        Command::Abandon(args) => workers::abandon(&args),
        Command::Gc(args) => workers::gc(&args),
        Command::Approve(args) => {
            let mut argv: Vec<std::ffi::OsString> = vec![
                "automaton".into(),
                "status".into(),
                "--task".into(),
                args.task.into(),
                "--approve".into(),
            ];
            if let Some(a) = args.approver {
                argv.extend(["--approver".into(), a.into()]);
            }
            if let Some(r) = args.revision {
                argv.extend(["--revision".into(), r.into()]);
            }
            if let Some(p) = args.target.project {
                argv.extend(["--project".into(), p.into_os_string()]);
            }
            if let Some(c) = args.target.coordinator {
                argv.extend(["--coordinator".into(), c.into()]);
            }
            if args.json {
                argv.push("--json".into());
            }
            match Cli::try_parse_from(argv) {
                Ok(cli) => run(cli),
                Err(e) => {
                    eprintln!("ERROR: {}", e.to_string().lines().next().unwrap_or(""));
                    2
                }
            }
        }
        Command::Tasks(args) => workers::tasks(&args),
        Command::Watch(args) => watch::run(&args),
        Command::Top(args) => top::run(&args),
        Command::Demo(args) => demo::run(&args),
        Command::Status(args) => {
            let json = args.json;
            let warning = misplaced_agent_md_warning(&args);
            let code = match status(&args) {
                Ok(out) => {
                    print(&out.stdout);
                    if let Some(note) = out.note {
                        eprintln!("{note}");
                    }
                    out.code
                }
                Err(f) => report_failure(f, json),
            };
            // Last, so that a refusal's first line stays its `ERROR:` line.
            if let Some(w) = warning {
                eprintln!("{w}");
            }
            code
        }
    }
}

/// Prints a failure as every command does (one `ERROR:` line, or a JSON object with
/// `--json`) and returns its exit code.
pub(crate) fn report_failure(f: Failure, json: bool) -> i32 {
    let (msg, kind) = match f {
        Failure::Store(e) => (e.to_string(), e.kind()),
        Failure::Usage(m) => (m, ErrorKind::Invalid),
        Failure::Refused(m) => (m, ErrorKind::Refused),
        Failure::Remote { message, kind } => {
            (message, ErrorKind::parse(&kind).unwrap_or(ErrorKind::Io))
        }
    };
    let code = exit_code(kind);
    if json {
        let v = serde_json::json!({"error": msg, "kind": kind.as_str(), "exit_code": code});
        print(&format!("{v}\n"));
    } else {
        eprintln!("ERROR: {msg}");
    }
    code
}

/// 1 for a well-formed request that policy refuses, 2 for bad input or unreadable files.
pub fn exit_code(kind: ErrorKind) -> i32 {
    match kind {
        ErrorKind::Refused | ErrorKind::AlreadyExists => 1,
        ErrorKind::Invalid | ErrorKind::NotFound | ErrorKind::Corrupt | ErrorKind::Io => 2,
    }
}

fn print(s: &str) {
    let mut out = std::io::stdout().lock();
    // A closed pipe (`| head`) is not an error worth a panic.
    let _ = out.write_all(s.as_bytes());
    let _ = out.flush();
}

fn task_arg(args: &StatusArgs, what: &str) -> Result<TaskName, Failure> {
    let raw = args
        .task
        .as_deref()
        .ok_or_else(|| usage(format!("{what} needs --task NAME: name the task to act on")))?;
    raw.parse::<TaskName>()
        .map_err(|e| Failure::Store(e.into()))
}

fn agent_arg(args: &StatusArgs) -> Result<Option<AgentId>, Failure> {
    args.agent
        .as_deref()
        .map(|a| a.parse::<AgentId>().map_err(|e| Failure::Store(e.into())))
        .transpose()
}

fn duration_arg(flag: &str, value: &str) -> Result<Duration, Failure> {
    parse_duration(value).ok_or_else(|| {
        usage(format!(
            "Invalid {flag} '{value}': write a number with a unit, e.g. '90s', '30m', '1h' or '30 minutes'"
        ))
    })
}

fn status(args: &StatusArgs) -> Result<Output, Failure> {
    let (project, cwd) = open_project(args)?;
    // Every command: a project that does not exist is an error, and nothing is created.
    project.ensure_exists()?;
    let now = SystemTime::now();
    let mutating = args.transition.is_some()
        || args.approve
        || args.create_task.is_some()
        || args.claim
        || args.release
        || args.upgrade;
    // The commands whose outcome .agent.md governs fail alike on a broken one, on either
    // backend (a coordinator read it when it started; the file may have changed since).
    let reads_policy = (args.task.is_some() && !other_action(args))
        || args.transition.is_some()
        || args.approve
        || args.claim
        || args.release;
    if reads_policy {
        project.policy()?;
    }
    let backend = match backend::find_coordinator(&project, args.coordinator.as_deref())? {
        Some(address) if args.local && mutating => {
            return Err(Failure::Refused(format!(
                "A coordinator owns this project ({address}): --local is for reads; send changes through the coordinator (drop --local)."
            )));
        }
        Some(address) if !args.local => Backend::remote(project.clone(), address)?,
        _ => Backend::Local(project.clone()),
    };
    let json = args.json;
    let emit = |value: &dyn erased::Json, text: String| -> String {
        if json { value.to_json() } else { text }
    };

    if let Some(target) = &args.transition {
        let task = task_arg(args, "--transition")?;
        let target: State = target.parse().map_err(|_| {
            usage(format!(
                "Unknown phase '{target}': name one of {}",
                State::all()
                    .iter()
                    .map(State::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        let out = backend.transition(
            &task,
            target,
            agent_arg(args)?.as_ref(),
            args.lease.as_deref(),
            args.token,
        )?;
        return Ok(Output::ok(emit(&out, render::transitioned(&out))));
    }
    if args.approve {
        let task = task_arg(args, "--approve")?;
        let out = backend.approve(&task, &args.approver, args.revision.as_deref())?;
        return Ok(Output::ok(emit(&out, render::approved(&out))));
    }
    if let Some(name) = &args.create_task {
        let task: TaskName = name
            .parse()
            .map_err(|e: automaton_workflow::NameError| Failure::Store(e.into()))?;
        let dir = backend.create_task(&task)?;
        let text =
            format!("Created task '{task}' in state 'new'. Use --transition research to begin.\n");
        let value = serde_json::json!({"task": task, "state": "new", "folder": dir});
        return Ok(Output::ok(emit(&value, text)));
    }
    if args.list {
        // Folders no command can address are read here on either backend: they are not
        // tasks, so the coordinator does not know them.
        let listing = automaton_store::Listing {
            tasks: backend.list()?,
            unaddressable: project.unaddressable()?,
        };
        // JSON: the task rows, then one object per unaddressable folder (`folder`, `why`).
        let value: Vec<serde_json::Value> = listing
            .tasks
            .iter()
            .map(serde_json::to_value)
            .chain(listing.unaddressable.iter().map(serde_json::to_value))
            .collect::<Result<_, _>>()
            .map_err(|e| usage(format!("cannot encode JSON: {e}")))?;
        let mut out = Output::with_code(
            emit(&value, render::list(&project, &listing)),
            listing.exit_code(),
        );
        let broken: Vec<String> = listing
            .tasks
            .iter()
            .flat_map(automaton_store::ListEntry::rows)
            .filter(|e| e.error.is_some())
            .map(|e| e.task.to_string())
            .collect();
        if !broken.is_empty() && !json {
            out.note = Some(format!(
                "ERROR: {} task{} could not be read ({}). Fix the file each row names, then retry.",
                broken.len(),
                if broken.len() == 1 { "" } else { "s" },
                broken.join(", ")
            ));
        }
        return Ok(out);
    }
    if args.validate_folder {
        if args.task.is_none() {
            let all = backend.validate_all()?;
            let text = render::folders(&project, &all);
            return Ok(Output::with_code(emit(&all, text), all.exit_code()));
        }
        let task = task_arg(args, "--validate-folder")?;
        let report = backend.validate_folder(&task)?;
        let code = if report.passed() { 0 } else { 1 };
        return Ok(Output::with_code(
            emit(&report, render::folder(&report)),
            code,
        ));
    }
    if args.audit {
        let report = backend.audit()?;
        return Ok(Output::with_code(
            emit(&report, render::audit(&report)),
            report.exit_code(),
        ));
    }
    if args.can_edit {
        let task = task_arg(args, "--can-edit")?;
        return Ok(match project.can_edit(&task)? {
            Ok(state) => Output::ok(emit(
                &serde_json::json!({"allowed": true, "state": state}),
                "ALLOWED\n".into(),
            )),
            Err(state) => Output::with_code(
                emit(
                    &serde_json::json!({"allowed": false, "state": state}),
                    format!(
                        "DENIED: Task '{task}' is in {state} phase. Code edits require implement or doc_review phase.\n"
                    ),
                ),
                1,
            ),
        });
    }
    if args.can_create_task {
        return Ok(Output::ok(emit(
            &serde_json::json!({"allowed": true}),
            "ALLOWED\n".into(),
        )));
    }
    if args.scope_check {
        if let Some(raw) = &args.task {
            let task: TaskName = raw
                .parse()
                .map_err(|e: automaton_workflow::NameError| Failure::Store(e.into()))?;
            project.validate_folder(&task)?;
        }
        let file = args
            .file
            .as_deref()
            .ok_or_else(|| usage("--scope-check needs --file PATH"))?;
        let inside = project.in_scope(file, &cwd);
        let text = if inside {
            "IN_SCOPE\n".to_string()
        } else {
            format!(
                "OUT_OF_SCOPE: File '{}' is outside project '{}'.\n",
                file.display(),
                project.root().display()
            )
        };
        return Ok(Output::with_code(
            emit(&serde_json::json!({"in_scope": inside, "file": file}), text),
            if inside { 0 } else { 1 },
        ));
    }
    if args.same_session {
        let task = task_arg(args, "--same-session")?;
        let window = duration_arg("--window", &args.window)?;
        let age = project.task_age(&task, now)?;
        let same = age < window;
        let word = if same {
            "SAME_SESSION"
        } else {
            "DIFFERENT_SESSION"
        };
        return Ok(Output::with_code(
            emit(
                &serde_json::json!({"same_session": same, "age_seconds": age.as_secs()}),
                format!("{word}\n"),
            ),
            if same { 1 } else { 0 },
        ));
    }
    if args.upgrade {
        let only = args
            .task
            .as_deref()
            .map(|t| t.parse::<TaskName>().map_err(|e| Failure::Store(e.into())))
            .transpose()?;
        if let Some(address) = backend.coordinator() {
            return Err(Failure::Refused(format!(
                "A coordinator owns this project ({address}): stop it to run --upgrade, which writes task files directly."
            )));
        }
        let done = project.upgrade(only.as_ref())?;
        // Folders no command can address are reported, never touched.
        let skipped = if only.is_none() {
            project.unaddressable()?
        } else {
            Vec::new()
        };
        // JSON: the upgraded tasks, then one object per unaddressable folder (as --list).
        let value: Vec<serde_json::Value> = done
            .iter()
            .map(serde_json::to_value)
            .chain(skipped.iter().map(serde_json::to_value))
            .collect::<Result<_, _>>()
            .map_err(|e| usage(format!("cannot encode JSON: {e}")))?;
        return Ok(Output::ok(emit(&value, render::upgraded(&done, &skipped))));
    }
    if args.claim {
        let task = task_arg(args, "--claim")?;
        let agent = agent_arg(args)?.ok_or_else(|| usage("--claim needs --agent ID"))?;
        let ttl = args
            .ttl
            .as_deref()
            .map(|t| duration_arg("--ttl", t))
            .transpose()?;
        let (lease, renewed) = backend.claim(&task, &agent, ttl)?;
        let value = serde_json::json!({"task": task, "lease": lease, "renewed": renewed});
        return Ok(Output::ok(emit(
            &value,
            render::claimed(&task, &lease, renewed),
        )));
    }
    if args.release {
        let task = task_arg(args, "--release")?;
        let agent = agent_arg(args)?.ok_or_else(|| usage("--release needs --agent ID"))?;
        let lease = backend.release(&task, &agent)?;
        let value = serde_json::json!({"task": task, "released": lease});
        return Ok(Output::ok(emit(
            &value,
            format!(
                "Released task '{task}' (lease {}, token {}) held by {}.\n",
                lease.lease_id, lease.token, lease.agent
            ),
        )));
    }
    let task = task_arg(args, "automaton status")?;
    let policy = project.policy()?;
    let (view, d) = backend.view_with_runs(&task)?;
    let (runs, held) = (d.runs, d.held);
    let mut text = render::task(&view, policy.multi_agent);
    text.push_str(&render::runs(&runs, &held));
    if !d.next_command.is_empty() {
        text.push_str(&format!("Next command (manual mode): {}\n", d.next_command));
    }
    if let Some(line) = &view.attention {
        text.push_str(line);
        text.push('\n');
    }
    if let Some(d) = &d.delivery {
        text.push_str(&format!("Delivery: {}\n", workers::delivery_line(d)));
    }
    // The spec's fields unchanged; a coordinator's runs and hold added when there are any.
    let mut value =
        serde_json::to_value(&view).map_err(|e| usage(format!("cannot encode JSON: {e}")))?;
    if let Some(obj) = value.as_object_mut() {
        if !runs.is_empty() {
            obj.insert("runs".into(), workers::runs_json(&runs));
        }
        if !held.is_empty() {
            obj.insert("held".into(), serde_json::Value::String(held));
        }
        if let Some(delivery) = &d.delivery {
            obj.insert("delivery".into(), workers::delivery_json(delivery));
        }
        if !d.next_command.is_empty() {
            obj.insert(
                "next_command".into(),
                serde_json::Value::String(d.next_command),
            );
        }
    }
    Ok(Output::ok(emit(&value, text)))
}

/// Object-safe JSON rendering, so one `emit` serves every result type.
mod erased {
    pub trait Json {
        fn to_json(&self) -> String;
    }
    impl<T: serde::Serialize> Json for T {
        fn to_json(&self) -> String {
            match serde_json::to_string_pretty(self) {
                Ok(s) => s + "\n",
                Err(e) => format!("{{\"error\": \"cannot encode JSON: {e}\"}}\n"),
            }
        }
    }
}
