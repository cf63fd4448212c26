//! `automaton-worker doctor`: one dry implement phase in a scratch workspace, run exactly as
//! the worker runs an assignment (the same workspace, the built-in implement prompt, the
//! agent under its guard, the metering proxy in front of the model server), then one line per
//! check, `PASS` or `FAIL` with the fix:
//!
//! 1. `program`: the agent's program is on `PATH` (a preset's programs; a template's first
//!    word after `VAR=` assignments; or the one the shell said it could not find);
//! 2. `model-server`: the model server answers and its context window is read (the probe's
//!    own context detection);
//! 3. `metering`: the agent's requests passed through the metering proxy and reported usage;
//! 4. `artifact`: `.automaton-task/IMPLEMENTATION.md` was written (or where it was found
//!    instead);
//! 5. `code`: code changed in the workspace root, tool state left out (or where it landed
//!    instead, e.g. under `.automaton-task/`).
//!
//! Nothing is sent anywhere: there is no coordinator. The scratch folder is removed at the end
//! unless kept. Secrets never reach the output: the template is never echoed (it may hold an
//! API key), and the agent's output tail, shown only when a check failed, has the values of
//! the usual key variables redacted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use automaton_workflow::Phase;

use crate::agent::{AgentSpec, Outcome, RunSpec, Running, StopReason};
use crate::meter::{Failures, Meter, Usage};
use crate::probe::context;
use crate::workspace::{Cache, InputFile, TASK_DIR, TreeFile, Workspace};

/// The scratch tree's commit name in its private cache.
const SCRATCH_COMMIT: &str = "doctor-scratch";
/// The task the dry phase is for.
const TASK: &str = "doctor";
/// The artifact the implement phase writes.
const ARTIFACT: &str = "IMPLEMENTATION.md";

/// Variables whose values are credentials an agent may be given: redacted from the tail.
const SECRET_VARS: &[&str] = &[
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_AUTH_TOKEN",
    "AUTOMATON_TOKEN",
    "GEMINI_API_KEY",
    "GOOGLE_API_KEY",
    "HF_TOKEN",
    "OPENROUTER_API_KEY",
];

/// Why the doctor could not run at all (bad usage, or the scratch could not be made): exit 2.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "--agent is empty: give a preset (aider, codex, claude-code), `scripted` or a command template"
    )]
    EmptyAgent,
    #[error(transparent)]
    Preset(#[from] crate::presets::PresetError),
    #[error("--timeout must be more than 0 s: give e.g. --timeout 120s")]
    ZeroTimeout,
    #[error("cannot make the scratch workspace under {dir}: {why}")]
    Scratch { dir: PathBuf, why: String },
    #[error("cannot start the async runtime: {0}")]
    Runtime(std::io::Error),
}

/// What `doctor` is asked to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--agent`: a preset, `scripted`, or a command template.
    pub agent: String,
    pub model: Option<String>,
    pub model_server: Option<String>,
    /// The agent's time limit.
    pub timeout: Duration,
    /// Keep the scratch folder (its path is printed on stderr).
    pub keep: bool,
    /// Where the scratch folder is made (default: the system's temp dir).
    pub work_dir: Option<PathBuf>,
    /// Between SIGTERM and SIGKILL of the agent's group.
    pub grace: Duration,
}

/// One check's result: its line is `PASS name: what` or `FAIL name: what — fix: fix`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub name: &'static str,
    pub pass: bool,
    pub what: String,
    pub fix: Option<String>,
}

impl Check {
    fn pass(name: &'static str, what: impl Into<String>) -> Check {
        Check {
            name,
            pass: true,
            what: what.into(),
            fix: None,
        }
    }

    fn fail(name: &'static str, what: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            pass: false,
            what: what.into(),
            fix: Some(fix.into()),
        }
    }

    /// The check's one line.
    pub fn line(&self) -> String {
        match (&self.fix, self.pass) {
            (_, true) | (None, false) => {
                format!("{} {}: {}", self.verdict(), self.name, self.what)
            }
            (Some(fix), false) => format!("FAIL {}: {} — fix: {fix}", self.name, self.what),
        }
    }

    fn verdict(&self) -> &'static str {
        if self.pass { "PASS" } else { "FAIL" }
    }
}

/// The report: the checks in order, and what the agent's run said (for a person, when a
/// check failed).
#[derive(Debug)]
pub struct Report {
    pub checks: Vec<Check>,
    /// How the agent's run ended, e.g. `exit status 1`, `no result after 2m`.
    pub outcome: String,
    /// The last lines of the agent's output, secrets redacted.
    pub tail: String,
    /// The scratch folder, when kept.
    pub kept: Option<PathBuf>,
}

impl Report {
    pub fn passed(&self) -> bool {
        self.checks.iter().all(|c| c.pass)
    }
}

/// What the agent is and which programs it needs.
struct Agent {
    spec: AgentSpec,
    /// The programs to find on `PATH`, and the install hint for each.
    programs: Vec<String>,
    /// How to install them (a preset's `needs`).
    needs: Option<&'static str>,
}

/// The programs a preset's template runs, in the order they are needed.
fn preset_programs(name: &str) -> Vec<String> {
    match name {
        "aider" => vec!["git".into(), "aider".into()],
        "codex" => vec!["codex".into()],
        "claude-code" => vec!["claude".into()],
        other => vec![other.to_string()],
    }
}

fn agent_of(o: &Options) -> Result<Agent, Error> {
    let a = o.agent.trim();
    if a.is_empty() {
        return Err(Error::EmptyAgent);
    }
    if a == "scripted" {
        return Ok(Agent {
            spec: AgentSpec::Scripted,
            programs: Vec::new(),
            needs: None,
        });
    }
    if let Some(p) = crate::presets::find(a) {
        let t = p.template(o.model.as_deref(), o.model_server.is_some())?;
        return Ok(Agent {
            spec: AgentSpec::Command(t),
            programs: preset_programs(p.name),
            needs: Some(p.needs),
        });
    }
    Ok(Agent {
        spec: AgentSpec::Command(o.agent.clone()),
        programs: crate::agent::first_program(&o.agent).into_iter().collect(),
        needs: None,
    })
}

/// Shell builtins a template may start with: nothing to look up.
const BUILTINS: &[&str] = &[
    "cd", "export", "set", "true", "false", ":", "echo", "printf", "test", "[", "eval", "exec",
    "if", "for", "while", "case", "{", "!", "read", "unset", "umask", ".", "source",
];

/// Where `program` is found: a path is taken as it is (relative to the workspace), a name is
/// looked up on `PATH`; `None` when it is not there or not executable.
fn find_program(program: &str, workspace: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        let p = workspace.join(program);
        return executable(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| executable(p))
}

/// A scratch folder of its own under `root`.
fn make_scratch(root: &Path) -> Result<PathBuf, Error> {
    let err = |why: String| Error::Scratch {
        dir: root.to_path_buf(),
        why,
    };
    std::fs::create_dir_all(root).map_err(|e| err(e.to_string()))?;
    for n in 0u32..100 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = root.join(format!(
            "automaton-doctor-{}-{nanos:09}-{n}",
            std::process::id()
        ));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(err(e.to_string())),
        }
    }
    Err(err("no free name".into()))
}

/// The tiny code tree the dry phase works on.
fn scratch_tree() -> Vec<TreeFile> {
    let file = |path: &str, content: &str| TreeFile {
        path: path.into(),
        executable: false,
        content: content.as_bytes().to_vec(),
    };
    vec![
        file(
            "Cargo.toml",
            "[package]\nname = \"doctor-scratch\"\nversion = \"0.1.0\"\nedition = \"2021\"\n",
        ),
        file(
            "src/lib.rs",
            "/// Adds two numbers.\npub fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n",
        ),
    ]
}

/// The SPEC.md the dry phase implements.
const SPEC: &str = "# SPEC: subtraction\n\nThis is a dry run of `automaton-worker doctor`: a tiny task to check that the agent\nworks in the workspace.\n\n## Requirements\n\n1. `src/lib.rs` has `pub fn sub(a: i32, b: i32) -> i32` returning `a - b`, next to `add`.\n2. A unit test of `sub` in `src/lib.rs`.\n";

/// Runs the doctor. `Err` only for bad usage or a scratch folder that cannot be made.
pub fn run(o: &Options) -> Result<Report, Error> {
    let agent = agent_of(o)?;
    if o.timeout.is_zero() {
        return Err(Error::ZeroTimeout);
    }
    let root = o.work_dir.clone().unwrap_or_else(std::env::temp_dir);
    let scratch = make_scratch(&root)?;
    let result = run_in(o, &agent, &scratch);
    let kept = if o.keep {
        Some(scratch)
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
        None
    };
    result.map(|r| Report { kept, ..r })
}

fn run_in(o: &Options, agent: &Agent, scratch: &Path) -> Result<Report, Error> {
    let scratch_err = |why: String| Error::Scratch {
        dir: scratch.to_path_buf(),
        why,
    };
    // The model server first: the probe's detection is blocking, and bounded (6 s).
    let server_check = model_server_check(o.model_server.as_deref());
    let cache = Cache::open(&scratch.join("cache")).map_err(|e| scratch_err(e.to_string()))?;
    let tree = scratch_tree();
    let pin = cache
        .store(SCRATCH_COMMIT, tree.clone())
        .map_err(|e| scratch_err(e.to_string()))?;
    let prompt = automaton_workflow::built_in_prompt(Phase::Implement).unwrap_or_default();
    let inputs = [
        InputFile {
            kind: "prompt".into(),
            path: "prompt.md".into(),
            content: prompt.into_bytes(),
        },
        InputFile {
            kind: "task".into(),
            path: "SPEC.md".into(),
            content: SPEC.as_bytes().to_vec(),
        },
    ];
    let ws = Workspace::create(&scratch.join("work"), TASK, &cache, Some(&pin), &inputs)
        .map_err(|e| scratch_err(e.to_string()))?;
    let mut checks = vec![program_check(agent, ws.dir())];
    checks.push(server_check.check);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    let secrets: Vec<String> = SECRET_VARS
        .iter()
        .filter_map(|v| std::env::var(v).ok())
        .filter(|v| !v.trim().is_empty())
        .collect();
    let (outcome, metering) = runtime.block_on(async {
        // Only plain http:// is metered (as by the worker).
        let meter = match o.model_server.as_deref() {
            Some(url) if url.starts_with("http://") => Some(Meter::start(url).await),
            _ => None,
        };
        let (meter, meter_error) = match meter {
            Some(Ok(m)) => (Some(m), None),
            Some(Err(e)) => (None, Some(e.to_string())),
            None => (None, None),
        };
        let metered = meter.as_ref().map(Meter::register);
        let mut spec = RunSpec::new(
            agent.spec.clone(),
            ws.dir(),
            TASK,
            Phase::Implement,
            TASK,
            1,
        );
        spec.budget_tokens = server_check.window.unwrap_or(0);
        spec.model_server = o.model_server.clone();
        spec.model_url = metered.as_ref().map(|m| m.url().to_string());
        spec.grace = o.grace;
        spec.secrets = secrets;
        let outcome = match Running::start(spec, |_| {}) {
            Ok(r) => {
                let stop = async {
                    // Ctrl-C ends the agent's group and still cleans the scratch up; without
                    // a handler the run just goes on to its timeout.
                    if tokio::signal::ctrl_c().await.is_err() {
                        std::future::pending::<()>().await;
                    }
                    StopReason::Shutdown
                };
                r.wait(o.timeout, stop).await
            }
            Err(e) => Outcome {
                reason: StopReason::AgentError,
                detail: format!("cannot start the agent: {e}"),
                exit_code: None,
                elapsed: Duration::ZERO,
                tail: String::new(),
            },
        };
        let metering = match (&metered, meter_error) {
            (Some(m), _) => Metering::Counted(m.usage(), m.failures()),
            (None, Some(e)) => Metering::NoProxy(format!("the metering proxy cannot start: {e}")),
            (None, None) => Metering::NoProxy(match o.model_server.as_deref() {
                Some(_) => "the metering proxy forwards plain http:// only".into(),
                None => "no --model-server given".into(),
            }),
        };
        (outcome, metering)
    });

    // The program the shell could not find, if it said so (a later word of the template).
    let missing =
        if outcome.exit_code == Some(127) || outcome.detail.starts_with("command not found") {
            crate::agent::shell_complaint(&outcome.tail, 127).or_else(|| {
                outcome
                    .detail
                    .strip_prefix("command not found: ")
                    .map(str::to_string)
            })
        } else {
            None
        };
    if let (Some(p), true) = (&missing, checks[0].pass) {
        checks[0] = Check::fail(
            "program",
            format!("the agent's shell says: command not found: {p}"),
            install_hint(p, agent.needs),
        );
    }
    // Nothing the agent should have done can be judged if it never ran.
    let did_not_run = !checks[0].pass && outcome.reason != StopReason::Completed;
    let not_run = |name| {
        Check::fail(
            name,
            format!("not checked: the agent did not run ({})", outcome.detail),
            "fix 'program' first",
        )
    };
    let scripted = matches!(agent.spec, AgentSpec::Scripted);
    if scripted {
        // The built-in agent asks no model: the server and the proxy are not its concern.
        checks[1] = Check::pass("model-server", "not used by the scripted agent");
        checks.push(Check::pass("metering", "not used by the scripted agent"));
        checks.push(artifact_check(ws.dir()));
        checks.push(code_check(&ws, &tree));
    } else if did_not_run {
        checks.push(not_run("metering"));
        checks.push(not_run("artifact"));
        checks.push(not_run("code"));
    } else {
        checks.push(metering_check(&metering));
        checks.push(artifact_check(ws.dir()));
        checks.push(code_check(&ws, &tree));
    }
    let tail = last_lines(&outcome.tail, 12);
    let outcome = match outcome.reason {
        StopReason::TimedOut => format!(
            "{} (--timeout {})",
            outcome.detail,
            humantime::format_duration(o.timeout)
        ),
        _ => outcome.detail,
    };
    drop(pin);
    Ok(Report {
        checks,
        outcome,
        tail,
        kept: None,
    })
}

/// The last `n` non-empty lines of `text`.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn install_hint(program: &str, needs: Option<&str>) -> String {
    match needs {
        Some(needs) => format!("install what the preset needs: {needs}"),
        None => format!(
            "install {program}, or put the folder that holds it on PATH, or name it by its full path in --agent"
        ),
    }
}

fn program_check(agent: &Agent, workspace: &Path) -> Check {
    if matches!(agent.spec, AgentSpec::Scripted) {
        return Check::pass("program", "the built-in scripted agent (this binary)");
    }
    let mut found = Vec::new();
    for p in &agent.programs {
        if BUILTINS.contains(&p.as_str()) {
            found.push(format!("{p} (a shell builtin)"));
            // A builtin first: the program that matters comes later, and the shell says
            // whether it is found.
            continue;
        }
        match find_program(p, workspace) {
            Some(at) => found.push(format!("{p} ({})", at.display())),
            None => {
                return Check::fail(
                    "program",
                    format!("{p} is not on PATH"),
                    install_hint(p, agent.needs),
                );
            }
        }
    }
    if found.is_empty() {
        return Check::fail(
            "program",
            "the agent template names no program",
            "give --agent a command such as 'aider --message-file {prompt_file} {artifact}', or a preset",
        );
    }
    Check::pass("program", format!("found: {}", found.join(", ")))
}

/// The model server's check, and the window read (the run's budget).
struct ServerCheck {
    check: Check,
    window: Option<u64>,
}

fn model_server_check(server: Option<&str>) -> ServerCheck {
    const NAME: &str = "model-server";
    let Some(server) = server else {
        return ServerCheck {
            check: Check::fail(
                NAME,
                "no --model-server given",
                "give --model-server http://HOST:PORT, the server the agent's model runs on (vLLM, llama.cpp, Ollama)",
            ),
            window: None,
        };
    };
    // The server alone: no flag, table or default may answer in its place.
    let answer = context::detect(&context::Inputs {
        flag: None,
        config_override: None,
        script: None,
        server: Some(server),
        max_position: None,
        model: None,
    });
    if answer.source.starts_with("model server ") || answer.source.contains("; model server ") {
        return ServerCheck {
            check: Check::pass(
                NAME,
                format!(
                    "context window {} tokens ({})",
                    answer.window, answer.source
                ),
            ),
            window: Some(answer.window),
        };
    }
    let prefix = format!("--model-server {server}: ");
    let why = answer
        .source
        .strip_suffix("fell through to 128k default")
        .unwrap_or(&answer.source)
        .trim_end_matches("; ");
    let why = why.strip_prefix(&prefix).unwrap_or(why).to_string();
    let down = why.contains("cannot connect") || why.contains("timed out");
    let check = if down {
        Check::fail(
            NAME,
            format!("{server} does not answer ({why})"),
            format!("start the model server, or fix --model-server: nothing answers at {server}"),
        )
    } else {
        Check::fail(
            NAME,
            format!("{server} answers, but its context window was not read ({why})"),
            "point --model-server at a vLLM, llama.cpp or Ollama server (they report their window), or check the URL",
        )
    };
    ServerCheck {
        check,
        window: None,
    }
}

/// What the metering proxy saw.
enum Metering {
    Counted(Usage, Failures),
    /// No proxy ran, and why.
    NoProxy(String),
}

fn metering_check(m: &Metering) -> Check {
    const NAME: &str = "metering";
    let point = "point the agent at $AUTOMATON_MODEL_URL (the worker's metering proxy; $OPENAI_BASE_URL is $AUTOMATON_MODEL_URL/v1), not at the model server itself";
    match m {
        Metering::NoProxy(why) => Check::fail(
            NAME,
            format!("usage not metered: {why}"),
            "give --model-server as http://HOST:PORT",
        ),
        Metering::Counted(u, _) if u.requests == 0 => Check::fail(
            NAME,
            "no model request passed through the metering proxy",
            point,
        ),
        Metering::Counted(u, f) if f.failed > 0 => {
            let note = crate::meter::failure_note(u, f).unwrap_or_else(|| {
                format!(
                    "{} of {} model requests failed: {}",
                    f.failed,
                    u.requests,
                    f.last.as_deref().unwrap_or("")
                )
            });
            let fix = if f.unreachable > 0 {
                "start the model server, or fix --model-server: the proxy cannot reach it"
            } else {
                "read the model server's log: it answered the agent's requests with errors (a wrong model name? give --model as the server names it)"
            };
            Check::fail(NAME, note, fix)
        }
        Metering::Counted(u, _) if u.counted == 0 => Check::fail(
            NAME,
            format!(
                "{} model requests passed through the proxy, none with usage",
                u.requests
            ),
            "use a model server that reports usage (vLLM, llama.cpp, Ollama do), on an endpoint the proxy reads (chat completions, completions, Responses, Anthropic messages, Ollama)",
        ),
        Metering::Counted(u, _) => Check::pass(
            NAME,
            format!(
                "{} model requests through the metering proxy, {} with usage, peak context {} tokens",
                u.requests,
                u.counted,
                u.peak.unwrap_or(0)
            ),
        ),
    }
}

fn artifact_check(workspace: &Path) -> Check {
    const NAME: &str = "artifact";
    let path = workspace.join(TASK_DIR).join(ARTIFACT);
    let want = format!("{TASK_DIR}/{ARTIFACT}");
    let written =
        std::fs::read(&path).is_ok_and(|b| !String::from_utf8_lossy(&b).trim().is_empty());
    if written {
        return Check::pass(NAME, format!("{want} written"));
    }
    let fix = "have the agent write the artifact at $AUTOMATON_ARTIFACT (the {artifact} placeholder), the path the prompt names";
    match crate::agent::misplaced_artifact(workspace, ARTIFACT) {
        Some(at) => {
            let place = if at.parent() == Some(Path::new("")) {
                "the workspace root".to_string()
            } else {
                at.display().to_string()
            };
            Check::fail(
                NAME,
                format!("{ARTIFACT} was written at {place}, not at {want}"),
                fix,
            )
        }
        None => Check::fail(NAME, format!("no {want} written"), fix),
    }
}

/// Names under `.automaton-task/` that are the run's own (inputs, log, artifact, usage) or a
/// preset's tool state; anything else there is something that belonged in the root.
fn is_task_dir_own(rel: &str) -> bool {
    let first = rel.split('/').next().unwrap_or(rel);
    matches!(
        first,
        "prompt.md"
            | "rules.md"
            | "SPEC.md"
            | "agent.log"
            | "usage.json"
            | "contracts"
            | "codex-home"
            | "claude-home"
            | ARTIFACT
    ) || first.starts_with("aider")
        || first.starts_with(".aider")
}

/// Files under `{ws}/.automaton-task/` (relative to it) that are not the run's own.
fn strays_in_task_dir(workspace: &Path) -> Vec<String> {
    let base = workspace.join(TASK_DIR);
    let mut out = Vec::new();
    let mut stack = vec![base.clone()];
    let mut seen = 0usize;
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            seen += 1;
            if seen > 10_000 {
                return out;
            }
            let path = e.path();
            let Ok(rel) = path.strip_prefix(&base) else {
                continue;
            };
            let rel = rel.to_string_lossy().into_owned();
            if is_task_dir_own(&rel) {
                continue;
            }
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(t) if t.is_file() => out.push(rel),
                _ => {}
            }
        }
    }
    out.sort();
    out
}

fn code_check(ws: &Workspace, base: &[TreeFile]) -> Check {
    const NAME: &str = "code";
    let changes = match ws.changes_excluding::<&str>(base, &[]) {
        Ok(c) => c,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("cannot read what changed: {e}"),
                "make the agent change fewer, smaller files",
            );
        }
    };
    let (tool, code): (Vec<&str>, Vec<&str>) = changes
        .iter()
        .map(|c| c.path.as_str())
        .partition(|p| crate::work::is_tool_state(p));
    if !code.is_empty() {
        return Check::pass(
            NAME,
            format!(
                "{} file(s) changed in the workspace root: {}",
                code.len(),
                crate::work::name_paths(&code)
            ),
        );
    }
    let strays = strays_in_task_dir(ws.dir());
    if !strays.is_empty() {
        let strays: Vec<&str> = strays.iter().map(String::as_str).collect();
        return Check::fail(
            NAME,
            format!(
                "no code changed in the workspace root; the agent wrote under {TASK_DIR}/ instead: {}",
                crate::work::name_paths(&strays)
            ),
            "run the agent with the workspace root as its root ($AUTOMATON_WORKSPACE; aider: a git repository there, as the aider preset makes); nothing under .automaton-task/ but the artifact is kept",
        );
    }
    let fix = "let the agent edit files without asking (e.g. Claude Code's --permission-mode acceptEdits, aider's --yes-always) and run it in the workspace ($AUTOMATON_WORKSPACE)";
    if tool.is_empty() {
        Check::fail(NAME, crate::work::NO_CODE_CHANGE, fix)
    } else {
        Check::fail(
            NAME,
            format!(
                "{} (only tool state: {})",
                crate::work::NO_CODE_CHANGE,
                crate::work::name_paths(&tool)
            ),
            fix,
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_check_is_one_line_with_its_fix() {
        let c = Check::fail("program", "aider is not on PATH", "install it");
        assert_eq!(
            c.line(),
            "FAIL program: aider is not on PATH — fix: install it"
        );
        assert_eq!(Check::pass("code", "1 file").line(), "PASS code: 1 file");
    }

    #[test]
    fn a_preset_names_its_programs_and_a_template_its_first() {
        let o = |agent: &str| Options {
            agent: agent.into(),
            model: Some("m".into()),
            model_server: Some("http://127.0.0.1:1".into()),
            timeout: Duration::from_secs(1),
            keep: false,
            work_dir: None,
            grace: Duration::from_secs(1),
        };
        assert_eq!(agent_of(&o("aider")).unwrap().programs, ["git", "aider"]);
        assert_eq!(agent_of(&o("claude-code")).unwrap().programs, ["claude"]);
        assert_eq!(
            agent_of(&o("FOO=1 BAR='x y' my-agent --go {prompt_file}"))
                .unwrap()
                .programs,
            ["my-agent"]
        );
        assert!(matches!(agent_of(&o("  ")), Err(Error::EmptyAgent)));
    }
}
