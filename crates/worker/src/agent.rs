//! Running the agent for one phase of a task: a shell command from a template (or the
//! built-in scripted agent) in the assignment's workspace, in its own process group, with a
//! time limit and a stop signal from the session. How a run ended is a value (`Outcome`),
//! never a log line; its states (seed 003 §5: requested → starting → active → stopping →
//! stopped) are reported through a callback as they happen.
//!
//! A failed run says why in words a person can act on: a shell's 127 is `command not found:
//! aider` (the program from the shell's complaint, else the command's first word), 126 `not
//! executable: …`, an artifact written anywhere but `.automaton-task/` names where it was
//! found and where it belongs. The last 16 KiB of the output are kept in memory (whatever the
//! log's cap), the worker's secrets redacted, for the run's report.
//!
//! The worker, not the shell, owns the agent's lifetime: on a timeout or a stop the whole
//! process group gets SIGTERM, then SIGKILL after a grace period, and the group is killed
//! once more after the leader exits, so nothing the agent started outlives the run (a process
//! that leaves the group with `setsid` is the one way out, and is outside our reach).
//!
//! The group's leader is not the agent but its guard (`crate::guard`: this binary's hidden
//! `agent-guard` subcommand), which starts the agent as its child in the same group and exits
//! as the agent did, so exit codes and signals read as before. The guard is there for the one
//! case the worker cannot handle itself, its own death: its stdin is the read end of a pipe
//! whose write end the worker holds for the run's whole life and never writes to. When the
//! worker dies, however it dies (SIGKILL included, where no handler runs), the kernel closes
//! the write end, the guard reads EOF and ends the group (SIGTERM, the grace, SIGKILL). A
//! pipe, not `PR_SET_PDEATHSIG`: that fires when the *thread* that forked exits, which tokio's
//! thread pool makes unpredictable, and it would take `unsafe`.

use std::ffi::OsString;
use std::future::Future;
use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use automaton_workflow::{Artifact, Phase};
use rustix::process::{Pid, Signal, kill_process_group, test_kill_process_group};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::workspace::TASK_DIR;

/// Between SIGTERM and SIGKILL, unless told otherwise.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// How much of the agent's output `agent.log` keeps, unless told otherwise.
pub const DEFAULT_LOG_CAP: u64 = 4 * 1024 * 1024;
/// The log's name inside `.automaton-task/`.
pub const LOG_FILE: &str = "agent.log";
/// How much of the end of the agent's output a run keeps in memory for its report
/// (`Outcome::tail`), whatever the log's cap: the log goes with the workspace, the tail
/// goes to the coordinator.
pub const TAIL_BYTES: usize = 16 * 1024;
/// Kept beyond `TAIL_BYTES` before a secret is redacted, so that a secret cut by the cut is
/// still found whole.
const TAIL_MARGIN: usize = 1024;
/// What a secret of the worker's is replaced by in the tail.
pub const REDACTED: &str = "[redacted]";
/// Where an agent may report what it used, inside `.automaton-task/`: JSON
/// `{"peak_context_tokens": N}` (the scripted agent always does).
pub const USAGE_FILE: &str = "usage.json";

/// The peak context (tokens) an agent reported in `{workspace}/.automaton-task/usage.json`,
/// if it wrote a readable one (at most 4 KiB is read).
pub fn reported_peak(workspace: &Path) -> Option<u64> {
    use std::io::Read;
    let f = std::fs::File::open(workspace.join(TASK_DIR).join(USAGE_FILE)).ok()?;
    let mut text = String::new();
    f.take(4096).read_to_string(&mut text).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    v.get("peak_context_tokens")?.as_u64().filter(|n| *n > 0)
}
/// seed 002's MAX_PHASE_TIME default.
pub const DEFAULT_MAX_PHASE_TIME: Duration = Duration::from_secs(60 * 60);
/// The worker's own credential; never handed to the agent.
pub(crate) const WORKER_TOKEN_VAR: &str = "AUTOMATON_TOKEN";
/// Where the worker's pool secret is (it mints its token from it); never handed to the agent.
pub(crate) const POOL_SECRET_VAR: &str = "AUTOMATON_POOL_SECRET_FILE";
/// Where the worker's token is; never handed to the agent.
pub(crate) const TOKEN_FILE_VAR: &str = "AUTOMATON_TOKEN_FILE";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("phase {0} produces no artifact: there is nothing for an agent to do")]
    NoArtifact(Phase),
    #[error(
        "the agent command is empty: give a template such as 'aider --yes --message-file {{prompt_file}}'"
    )]
    EmptyCommand,
    #[error("cannot locate the worker binary (the agent's guard): {0}")]
    CurrentExe(std::io::Error),
    #[error("cannot open the agent log {path}: {source}")]
    Log {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot make the pipe that tells the agent's guard the worker is alive: {0}")]
    Pipe(std::io::Error),
    #[error("cannot start the agent in {dir}: {source}")]
    Spawn {
        dir: PathBuf,
        source: std::io::Error,
    },
}

/// What to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentSpec {
    /// A template run with `sh -c` in the workspace, placeholders substituted shell-quoted.
    Command(String),
    /// The built-in deterministic agent: this binary's hidden `scripted-agent` subcommand.
    Scripted,
}

/// Everything one run needs; the `AUTOMATON_*` environment is built from it.
#[derive(Debug, Clone)]
pub struct RunSpec {
    pub agent: AgentSpec,
    /// The workspace directory (`Workspace::dir`).
    pub workspace: PathBuf,
    pub task: String,
    pub phase: Phase,
    pub lease_id: String,
    pub fencing_token: u64,
    pub budget_tokens: u64,
    /// The model server's URL, if the worker knows one.
    pub model_server: Option<String>,
    /// This run's prefix on the metering proxy (`crate::meter`), standing for the model
    /// server's root, when usage is metered.
    pub model_url: Option<String>,
    /// The context window the model server must be sent (Ollama's `num_ctx`).
    pub num_ctx: Option<u64>,
    /// The phase's estimated peak context (tokens), from the decomposition, if sized.
    pub estimated_tokens: Option<u64>,
    /// In a phase that reviews the change: the commit the task's branch started from (the
    /// base of `.automaton-task/changes.diff`).
    pub base_commit: Option<String>,
    /// Between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// How much output `agent.log` keeps; the rest is read and dropped.
    pub log_cap: u64,
    /// The worker binary, which runs the guard and the scripted agent; `None`: this
    /// process's own executable (tests that are not the worker binary name it).
    pub worker_exe: Option<PathBuf>,
    /// The worker's own secrets (its token, its pool secret): never handed to the agent, and
    /// replaced by `[redacted]` in the output tail should the agent print one anyway.
    pub secrets: Vec<String>,
    /// Where a copy of the output goes as it is read (`crate::output`: live output).
    pub output: Option<crate::output::OutputSink>,
}

impl RunSpec {
    /// A spec with no model server, a zero budget and the default grace and log cap.
    pub fn new(
        agent: AgentSpec,
        workspace: &Path,
        task: &str,
        phase: Phase,
        lease_id: &str,
        fencing_token: u64,
    ) -> RunSpec {
        RunSpec {
            agent,
            workspace: workspace.to_path_buf(),
            task: task.to_string(),
            phase,
            lease_id: lease_id.to_string(),
            fencing_token,
            budget_tokens: 0,
            model_server: None,
            model_url: None,
            num_ctx: None,
            estimated_tokens: None,
            base_commit: None,
            grace: DEFAULT_GRACE,
            log_cap: DEFAULT_LOG_CAP,
            worker_exe: None,
            secrets: Vec::new(),
            output: None,
        }
    }

    fn artifact(&self) -> Result<Artifact, Error> {
        self.phase.artifact().ok_or(Error::NoArtifact(self.phase))
    }

    fn task_dir(&self) -> PathBuf {
        self.workspace.join(TASK_DIR)
    }

    /// `{ws}/.automaton-task/prompt.md`.
    pub fn prompt_file(&self) -> PathBuf {
        self.task_dir().join("prompt.md")
    }

    /// The artifact's full path, or `None` for a phase without one.
    pub fn artifact_path(&self) -> Option<PathBuf> {
        self.phase
            .artifact()
            .map(|a| self.task_dir().join(a.file_name()))
    }

    /// Where the agent should send model requests: the metering proxy's prefix for this run,
    /// else the model server itself, else empty.
    pub fn model_url(&self) -> String {
        self.model_url
            .clone()
            .or_else(|| self.model_server.clone())
            .map(|u| u.trim_end_matches('/').to_string())
            .unwrap_or_default()
    }

    /// The variables the agent sees (besides the worker's own environment, less
    /// `AUTOMATON_TOKEN`). `OPENAI_BASE_URL` is set (to the proxy's `/v1`) only when usage is
    /// metered; otherwise the agent's own is left alone.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        let mut env = vec![
            ("AUTOMATON_TASK", self.task.clone()),
            ("AUTOMATON_PHASE", self.phase.name().to_string()),
            ("AUTOMATON_LEASE_ID", self.lease_id.clone()),
            ("AUTOMATON_FENCING_TOKEN", self.fencing_token.to_string()),
            (
                "AUTOMATON_ARTIFACT",
                self.artifact_path().map(path).unwrap_or_default(),
            ),
            ("AUTOMATON_WORKSPACE", path(self.workspace.clone())),
            ("AUTOMATON_PROMPT_FILE", path(self.prompt_file())),
            ("AUTOMATON_BUDGET_TOKENS", self.budget_tokens.to_string()),
            (
                "AUTOMATON_ESTIMATED_TOKENS",
                self.estimated_tokens
                    .map(|n| n.to_string())
                    .unwrap_or_default(),
            ),
            (
                "AUTOMATON_USAGE_FILE",
                path(self.task_dir().join(USAGE_FILE)),
            ),
            (
                "AUTOMATON_MODEL_SERVER",
                self.model_server.clone().unwrap_or_default(),
            ),
            (
                "AUTOMATON_BASE_COMMIT",
                self.base_commit.clone().unwrap_or_default(),
            ),
            (
                "AUTOMATON_NUM_CTX",
                self.num_ctx.map(|n| n.to_string()).unwrap_or_default(),
            ),
            ("AUTOMATON_MODEL_URL", self.model_url()),
        ];
        if self.model_url.is_some() {
            env.push(("OPENAI_BASE_URL", format!("{}/v1", self.model_url())));
        }
        env
    }

    /// The command line for `sh -c`: `template` with `{workspace}`, `{prompt_file}`,
    /// `{task}`, `{phase}`, `{artifact}` and `{model_url}` replaced by their shell-quoted values. Other
    /// braces (`${HOME}`, `{x}`) are left alone.
    pub fn render(&self, template: &str) -> String {
        let path = |p: PathBuf| p.to_string_lossy().into_owned();
        let value = |name: &str| -> Option<String> {
            Some(match name {
                "workspace" => path(self.workspace.clone()),
                "prompt_file" => path(self.prompt_file()),
                "task" => self.task.clone(),
                "phase" => self.phase.name().to_string(),
                "artifact" => self.artifact_path().map(path).unwrap_or_default(),
                "model_url" => self.model_url(),
                _ => return None,
            })
        };
        let mut out = String::with_capacity(template.len());
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            out.push_str(&rest[..open]);
            let after = &rest[open + 1..];
            match after
                .find('}')
                .and_then(|close| value(&after[..close]).map(|v| (close, v)))
            {
                Some((close, v)) => {
                    out.push_str(&shell_quote(&v));
                    rest = &after[close + 1..];
                }
                None => {
                    out.push('{');
                    rest = after;
                }
            }
        }
        out.push_str(rest);
        out
    }
}

/// `value` as one POSIX shell word: single-quoted, each `'` written `'\''`.
pub fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', r"'\''"))
}

/// A run's lifecycle and stop reasons: the fleet's one vocabulary (`automaton-workflow`).
pub use automaton_workflow::{RunState, StopReason};

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub reason: StopReason,
    /// For a person: `exit status 3`, `no VERDICT.md written`, `killed by signal 9`, ….
    pub detail: String,
    /// The leader's exit code, when it exited rather than being killed.
    pub exit_code: Option<i32>,
    pub elapsed: Duration,
    /// The last of the agent's output (at most `TAIL_BYTES`, cut at a character boundary,
    /// the spec's secrets redacted).
    pub tail: String,
}

type OnState = Box<dyn FnMut(RunState) + Send>;

/// The agent's output, appended to `agent.log` up to a cap; past it, read and dropped so the
/// agent never blocks on a full pipe. Its last `TAIL_BYTES` (and a margin) are kept in
/// memory whatever the cap, for the run's report.
struct Log {
    file: std::fs::File,
    kept: u64,
    cap: u64,
    truncated: bool,
    tail: std::collections::VecDeque<u8>,
    /// Live output: a copy of everything read, the log's cap aside.
    sink: Option<crate::output::OutputSink>,
}

impl Log {
    fn write(&mut self, buf: &[u8]) {
        if let Some(sink) = &self.sink {
            sink.send(buf);
        }
        let keep = TAIL_BYTES + TAIL_MARGIN;
        let from = buf.len().saturating_sub(keep);
        self.tail.extend(&buf[from..]);
        let over = self.tail.len().saturating_sub(keep);
        self.tail.drain(..over);
        let room = self.cap.saturating_sub(self.kept);
        let take = buf.len().min(usize::try_from(room).unwrap_or(usize::MAX));
        if take > 0 && self.file.write_all(&buf[..take]).is_ok() {
            self.kept += take as u64;
        }
        if take < buf.len() && !self.truncated {
            self.truncated = true;
            let _ = writeln!(
                self.file,
                "\n[automaton-worker: log cap of {} bytes reached; the rest is dropped]",
                self.cap
            );
        }
    }
}

/// How much of the start of stderr is kept to recognise the guard's "cannot start" line.
const STDERR_HEAD: usize = 1024;

/// Copies `from` into the log; with `head`, also keeps the first `STDERR_HEAD` bytes there.
fn pump(
    mut from: impl AsyncRead + Unpin + Send + 'static,
    log: Arc<Mutex<Log>>,
    head: Option<Arc<Mutex<Vec<u8>>>>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if let Some(Ok(mut head)) = head.as_ref().map(|h| h.lock()) {
                        let take = n.min(STDERR_HEAD.saturating_sub(head.len()));
                        head.extend_from_slice(&buf[..take]);
                    }
                    if let Ok(mut log) = log.lock() {
                        log.write(&buf[..n]);
                    }
                }
            }
        }
    })
}

/// `bytes`, the end of some output, as text for a person: `secrets` replaced by
/// `[redacted]`, then at most `TAIL_BYTES` of its end, starting on a character boundary
/// (invalid UTF-8 shown as U+FFFD).
pub fn tail_text(bytes: &[u8], secrets: &[String]) -> String {
    // A cut through a character leaves continuation bytes at the start: skip them.
    let start = bytes
        .iter()
        .take(3)
        .take_while(|b| (**b & 0xC0) == 0x80)
        .count();
    let mut text = String::from_utf8_lossy(&bytes[start..]).into_owned();
    for s in secrets.iter().filter(|s| s.len() >= 8) {
        if text.contains(s.as_str()) {
            text = text.replace(s.as_str(), REDACTED);
        }
    }
    if text.len() > TAIL_BYTES {
        let mut cut = text.len() - TAIL_BYTES;
        while !text.is_char_boundary(cut) {
            cut += 1;
        }
        text.drain(..cut);
    }
    text
}

/// The program a shell's "not found" (127) or "Permission denied" (126) line names, read
/// from the last lines of `tail`: dash's `sh: 1: aider: not found`, bash's `sh: line 1:
/// aider: command not found`, busybox's `sh: aider: not found`, zsh's `zsh: command not
/// found: aider`; for 127 also bash's `./x: No such file or directory`, for another code
/// only the "not found" forms. Only lines a shell wrote (`sh:`, `bash:`, `/bin/sh:`, …)
/// count.
pub fn shell_complaint(tail: &str, code: i32) -> Option<String> {
    let (suffixes, infix): (&[&str], Option<&str>) = match code {
        126 => (&[": Permission denied", ": cannot execute"], None),
        127 => (
            &[
                ": not found",
                ": command not found",
                ": No such file or directory",
            ],
            Some("command not found: "),
        ),
        _ => (
            &[": not found", ": command not found"],
            Some("command not found: "),
        ),
    };
    for line in tail.lines().rev().take(8) {
        let line = line.trim();
        let shell = line
            .split_once(':')
            .map(|(first, _)| first.rsplit('/').next().unwrap_or(first))
            .is_some_and(|s| matches!(s, "sh" | "bash" | "dash" | "zsh" | "ash" | "ksh"));
        if !shell {
            continue;
        }
        if let Some(i) = infix
            && let Some(at) = line.find(i)
        {
            let name = line[at + i.len()..].trim();
            if !name.is_empty() {
                return Some(name.to_string());
            }
        }
        for suffix in suffixes {
            if let Some(rest) = line.strip_suffix(suffix) {
                let name = rest.rsplit(": ").next().unwrap_or(rest).trim();
                if !name.is_empty() && !name.contains(' ') {
                    return Some(name.to_string());
                }
            }
        }
    }
    None
}

/// The program a rendered command line runs first: its first word that is not a variable
/// assignment (`FOO=1 aider …`) nor `exec`/`env`/`command`, quotes taken off.
pub fn first_program(command: &str) -> Option<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    for c in command.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => quote = Some(c),
            (None, c) if c.is_whitespace() || matches!(c, ';' | '&' | '|' | '(' | ')') => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                if !c.is_whitespace() {
                    break;
                }
            }
            (None, c) => word.push(c),
        }
        if words.len() > 16 {
            break;
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words.into_iter().find(|w| {
        let assignment = w.split_once('=').is_some_and(|(k, _)| {
            !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        });
        !assignment && !matches!(w.as_str(), "exec" | "env" | "command" | "nohup")
    })
}

/// Where else in `workspace` a file called `name` is (a relative path, `.git` and the task
/// folder's own copy left out), looking at most 6 folders deep and 20 000 entries: the place
/// an agent that missed `.automaton-task/` wrote its artifact.
pub fn misplaced_artifact(workspace: &Path, name: &str) -> Option<PathBuf> {
    let mut queue = std::collections::VecDeque::from([(workspace.to_path_buf(), 0usize)]);
    let mut seen = 0usize;
    let mut found: Vec<PathBuf> = Vec::new();
    while let Some((dir, depth)) = queue.pop_front() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        let mut entries: Vec<_> = entries.flatten().collect();
        entries.sort_by_key(|e| e.file_name());
        for e in entries {
            seen += 1;
            if seen > 20_000 {
                return found.into_iter().next();
            }
            let Ok(kind) = e.file_type() else { continue };
            let path = e.path();
            if kind.is_dir() {
                if depth < 6 && e.file_name() != ".git" {
                    queue.push_back((path, depth + 1));
                }
            } else if kind.is_file()
                && e.file_name() == name
                && path.parent() != Some(&workspace.join(TASK_DIR))
                && std::fs::metadata(&path).is_ok_and(|m| m.len() > 0)
                && let Ok(rel) = path.strip_prefix(workspace)
            {
                found.push(rel.to_path_buf());
            }
        }
        if !found.is_empty() {
            // Breadth first: the shallowest is the likeliest.
            return found.into_iter().next();
        }
    }
    None
}

/// A started agent. Dropping it without `wait` kills its process group (a backstop).
pub struct Running {
    spec: RunSpec,
    /// The guard, which exits as the agent does.
    child: Child,
    pgid: Pid,
    /// The write end of the guard's stdin: held, never written, closed by the kernel when
    /// this process dies, which is what tells the guard to end the group. `None` only in a
    /// test that closes it to play the worker's death.
    alive: Option<std::io::PipeWriter>,
    /// The start of the guard's stderr: its one line when it cannot start the agent.
    stderr_head: Arc<Mutex<Vec<u8>>>,
    /// The output log, whose in-memory tail the outcome carries.
    log: Arc<Mutex<Log>>,
    started: Instant,
    pumps: Vec<JoinHandle<()>>,
    on_state: OnState,
    /// The group has been dealt with: `Drop` must not signal a group id that may be reused.
    finished: bool,
}

/// What `Running::spawn` started.
struct Spawned {
    child: Child,
    pgid: Pid,
    alive: std::io::PipeWriter,
    stderr_head: Arc<Mutex<Vec<u8>>>,
    log: Arc<Mutex<Log>>,
    pumps: Vec<JoinHandle<()>>,
}

/// This process's executable, for the guard to run: `/proc/self/exe` where there is one (it
/// still runs this very binary after an upgrade replaced the file), else its path.
fn own_exe() -> Result<PathBuf, Error> {
    let proc = Path::new("/proc/self/exe");
    if proc.exists() {
        return Ok(proc.to_path_buf());
    }
    std::env::current_exe().map_err(Error::CurrentExe)
}

impl std::fmt::Debug for Running {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Running")
            .field("task", &self.spec.task)
            .field("phase", &self.spec.phase)
            .field("pgid", &self.pgid)
            .finish_non_exhaustive()
    }
}

impl Running {
    /// Reports `requested` and `starting`, starts the agent under its guard in a process
    /// group of their own in the workspace (stdin null, output to `.automaton-task/agent.log`),
    /// reports `active`. On an error nothing runs and `stopped` is reported. Must be called
    /// inside a tokio runtime.
    pub fn start(
        spec: RunSpec,
        on_state: impl FnMut(RunState) + Send + 'static,
    ) -> Result<Running, Error> {
        Self::start_with(spec, Box::new(on_state), None)
    }

    /// `start`, with the agent's program and arguments given instead of derived from the spec.
    fn start_with(
        spec: RunSpec,
        mut on_state: OnState,
        agent: Option<Vec<OsString>>,
    ) -> Result<Running, Error> {
        on_state(RunState::Requested);
        on_state(RunState::Starting);
        let spawned = Self::spawn(&spec, agent);
        // The log holds the only sink: the live output ends when the pumps do.
        let mut spec = spec;
        spec.output = None;
        match spawned {
            Ok(Spawned {
                child,
                pgid,
                alive,
                stderr_head,
                log,
                pumps,
            }) => {
                tracing::info!(task = %spec.task, phase = %spec.phase, pgid = pgid.as_raw_pid(), "agent started");
                on_state(RunState::Active);
                Ok(Running {
                    spec,
                    child,
                    pgid,
                    alive: Some(alive),
                    stderr_head,
                    log,
                    started: Instant::now(),
                    pumps,
                    on_state,
                    finished: false,
                })
            }
            Err(e) => {
                on_state(RunState::Stopped);
                Err(e)
            }
        }
    }

    fn spawn(spec: &RunSpec, agent: Option<Vec<OsString>>) -> Result<Spawned, Error> {
        spec.artifact()?;
        let worker = match &spec.worker_exe {
            Some(p) => p.clone(),
            None => own_exe()?,
        };
        let agent = match (agent, &spec.agent) {
            (Some(argv), _) => argv,
            (None, AgentSpec::Command(template)) => {
                if template.trim().is_empty() {
                    return Err(Error::EmptyCommand);
                }
                vec!["sh".into(), "-c".into(), spec.render(template).into()]
            }
            (None, AgentSpec::Scripted) => {
                vec![worker.clone().into_os_string(), "scripted-agent".into()]
            }
        };
        let log_path = spec.task_dir().join(LOG_FILE);
        let log_err = |source| Error::Log {
            path: log_path.clone(),
            source,
        };
        std::fs::create_dir_all(spec.task_dir()).map_err(log_err)?;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(log_err)?;
        // Both ends close-on-exec: only the guard (as its stdin) and this process hold them.
        let (alive_reader, alive) = std::io::pipe().map_err(Error::Pipe)?;
        let mut cmd = Command::new(&worker);
        // `ps` shows the worker's name, not /proc/self/exe.
        cmd.arg0(std::env::current_exe().unwrap_or_else(|_| worker.clone()))
            .arg(crate::guard::SUBCOMMAND)
            .arg("--grace")
            .arg(humantime::format_duration(spec.grace).to_string())
            .arg("--")
            .args(agent);
        // The guard passes its cwd and environment on to the agent unchanged.
        cmd.current_dir(&spec.workspace)
            .env_remove(WORKER_TOKEN_VAR)
            .env_remove(POOL_SECRET_VAR)
            .env_remove(TOKEN_FILE_VAR)
            .envs(spec.env())
            .stdin(alive_reader)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|source| Error::Spawn {
            dir: spec.workspace.clone(),
            source,
        })?;
        // The command's copy of the read end goes now: the guard has its own.
        drop(cmd);
        // process_group(0): the group id is the leader's pid.
        let pgid = child
            .id()
            .and_then(|id| i32::try_from(id).ok())
            .and_then(Pid::from_raw)
            .expect("a just-spawned child has a pid");
        let log = Arc::new(Mutex::new(Log {
            file,
            kept: 0,
            cap: spec.log_cap,
            truncated: false,
            tail: std::collections::VecDeque::new(),
            sink: spec.output.clone(),
        }));
        let stderr_head = Arc::new(Mutex::new(Vec::new()));
        let mut pumps = Vec::new();
        if let Some(out) = child.stdout.take() {
            pumps.push(pump(out, log.clone(), None));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump(err, log.clone(), Some(stderr_head.clone())));
        }
        Ok(Spawned {
            child,
            pgid,
            alive,
            stderr_head,
            log,
            pumps,
        })
    }

    /// The process group id (= the leader's pid).
    pub fn pgid(&self) -> i32 {
        self.pgid.as_raw_pid()
    }

    /// Runs until the agent exits, `max_phase_time` passes, or `stop` resolves with a reason
    /// (`lease_lost`, `operator_stopped`, `shutdown`). On a timeout or a stop the group gets
    /// SIGTERM, then SIGKILL after the grace; in every case the group is SIGKILLed once the
    /// leader is gone, so no process of it survives. Reports `stopping`, then `stopped`.
    pub async fn wait(
        mut self,
        max_phase_time: Duration,
        stop: impl Future<Output = StopReason>,
    ) -> Outcome {
        let exited = tokio::select! {
            status = self.child.wait() => Some(status),
            () = tokio::time::sleep(max_phase_time) => None,
            reason = stop => {
                (self.on_state)(RunState::Stopping);
                let detail = format!("stopped: {reason}");
                return self.terminate(reason, detail).await;
            }
        };
        (self.on_state)(RunState::Stopping);
        let Some(status) = exited else {
            let detail = format!(
                "no result after {}",
                humantime::format_duration(max_phase_time)
            );
            return self.terminate(StopReason::TimedOut, detail).await;
        };
        self.reap_group().await;
        let (reason, detail, exit_code) = match status {
            Ok(status) => self.judge(status),
            Err(e) => (
                StopReason::Crashed,
                format!("cannot wait for the agent: {e}"),
                None,
            ),
        };
        self.finish(reason, detail, exit_code)
    }

    /// SIGTERM the group, give it the grace, SIGKILL it, wait for the leader.
    async fn terminate(mut self, reason: StopReason, detail: String) -> Outcome {
        tracing::info!(task = %self.spec.task, reason = %reason, "stopping the agent");
        signal_group(self.pgid, Signal::TERM);
        let status = match tokio::time::timeout(self.spec.grace, self.child.wait()).await {
            Ok(status) => status.ok(),
            Err(_) => {
                tracing::warn!(task = %self.spec.task, "agent still running after the grace: SIGKILL");
                signal_group(self.pgid, Signal::KILL);
                self.child.wait().await.ok()
            }
        };
        self.reap_group().await;
        let exit_code = status.and_then(|s| s.code());
        self.finish(reason, detail, exit_code)
    }

    /// The leader is gone: kill whatever of its group is left (background children, a
    /// grandchild ignoring SIGTERM) and wait, briefly, for the kernel to say the group is
    /// empty and for the output pipes to close.
    async fn reap_group(&mut self) {
        if test_kill_process_group(self.pgid).is_ok() {
            if group_alive(self.pgid) {
                tracing::warn!(task = %self.spec.task, "the agent left processes behind: killing its group");
            }
            signal_group(self.pgid, Signal::KILL);
            let deadline = Instant::now() + Duration::from_secs(2);
            while group_alive(self.pgid) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        self.finished = true;
        for pump in self.pumps.drain(..) {
            // A process that escaped the group (setsid) may hold the pipe open: stop reading.
            let abort = pump.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), pump)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        // Read to the end: the live output ends here.
        if let Ok(mut log) = self.log.lock() {
            log.sink = None;
        }
    }

    fn judge(&self, status: ExitStatus) -> (StopReason, String, Option<i32>) {
        if let Some(code) = status.code() {
            if let Some(why) = self.cannot_start(code) {
                // As when the worker itself could not start it: no exit code, the reason.
                return (StopReason::AgentError, why, None);
            }
            if code != 0 {
                return (StopReason::AgentError, self.exit_detail(code), Some(code));
            }
            let name = self
                .spec
                .artifact()
                .map(|a| a.file_name())
                .unwrap_or("artifact");
            let written = self
                .spec
                .artifact_path()
                .and_then(|p| std::fs::read(p).ok())
                .is_some_and(|b| !String::from_utf8_lossy(&b).trim().is_empty());
            if written {
                return (StopReason::Completed, format!("{name} written"), Some(0));
            }
            let detail = match misplaced_artifact(&self.spec.workspace, name) {
                Some(at) => {
                    let place = if at.parent() == Some(Path::new("")) {
                        "the workspace root".to_string()
                    } else {
                        at.display().to_string()
                    };
                    format!(
                        "no {name} written at {TASK_DIR}/{name} (found {name} at {place}: write it to $AUTOMATON_ARTIFACT)"
                    )
                }
                None => format!("no {name} written"),
            };
            return (StopReason::AgentError, detail, Some(0));
        }
        let signal = status.signal().unwrap_or(0);
        (
            StopReason::Crashed,
            format!("killed by signal {signal}"),
            None,
        )
    }

    /// The in-memory tail of the agent's output, as text.
    fn tail(&self) -> String {
        match self.log.lock() {
            Ok(log) => {
                let (a, b) = log.tail.as_slices();
                tail_text(&[a, b].concat(), &self.spec.secrets)
            }
            Err(_) => String::new(),
        }
    }

    /// What a non-zero exit says: a shell's 127 names the program it did not find, 126 the
    /// one it could not execute (from its complaint in the output, else the command's first
    /// word); a shell's "not found" among the last lines names it with any other code too.
    fn exit_detail(&self, code: i32) -> String {
        let tail = self.tail();
        let program = || match &self.spec.agent {
            AgentSpec::Command(t) => first_program(&self.spec.render(t)),
            AgentSpec::Scripted => None,
        };
        match code {
            127 => match shell_complaint(&tail, 127).or_else(program) {
                Some(p) => format!("command not found: {p}"),
                None => format!("exit status {code}"),
            },
            126 => match shell_complaint(&tail, 126).or_else(program) {
                Some(p) => format!("not executable: {p}"),
                None => format!("exit status {code}"),
            },
            _ => match shell_complaint(&tail, 0) {
                Some(p) => format!("command not found: {p} (exit status {code})"),
                None => format!("exit status {code}"),
            },
        }
    }

    /// The guard's "cannot start the agent …" line, when it exited for that reason.
    fn cannot_start(&self, code: i32) -> Option<String> {
        if code != crate::guard::CANNOT_START {
            return None;
        }
        let head = self.stderr_head.lock().ok()?;
        let text = String::from_utf8_lossy(&head);
        let line = text.lines().next()?;
        line.starts_with(crate::guard::CANNOT_START_LINE).then(|| {
            let why = line
                .strip_prefix("automaton-worker agent-guard: ")
                .unwrap_or(line);
            format!("cannot start the agent: {why}")
        })
    }

    fn finish(mut self, reason: StopReason, detail: String, exit_code: Option<i32>) -> Outcome {
        // The guard has exited and its group is dealt with: nobody is left to tell.
        drop(self.alive.take());
        (self.on_state)(RunState::Stopped);
        let outcome = Outcome {
            reason,
            detail,
            exit_code,
            elapsed: self.started.elapsed(),
            tail: self.tail(),
        };
        if outcome.reason == StopReason::Completed {
            tracing::info!(task = %self.spec.task, phase = %self.spec.phase, reason = %outcome.reason, detail = %outcome.detail, "agent stopped");
        } else {
            tracing::warn!(task = %self.spec.task, phase = %self.spec.phase, reason = %outcome.reason, detail = %outcome.detail, "agent stopped");
        }
        outcome
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.finished {
            signal_group(self.pgid, Signal::KILL);
        }
    }
}

/// Whether a process of the group still runs. Zombies do not count: they are dead, only not
/// yet reaped by their new parent (init, which in some containers never reaps), yet
/// `kill(-pgid, 0)` still finds them. Reads `/proc`; without it, asks the kernel.
fn group_alive(pgid: Pid) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return test_kill_process_group(pgid).is_ok();
    };
    let want = pgid.as_raw_pid().to_string();
    entries.flatten().any(|e| {
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            return false;
        }
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            return false;
        };
        // "pid (comm) state ppid pgrp …": comm may hold spaces and ')', so split after the last.
        let mut fields = stat
            .rsplit_once(')')
            .map(|(_, r)| r)
            .unwrap_or("")
            .split_whitespace();
        let state = fields.next().unwrap_or("Z");
        let pgrp = fields.nth(1).unwrap_or("");
        pgrp == want && !state.starts_with(['Z', 'X'])
    })
}

/// Signals every process of the group; a group already empty is not an error.
fn signal_group(pgid: Pid, sig: Signal) {
    if let Err(e) = kill_process_group(pgid, sig)
        && e != rustix::io::Errno::SRCH
    {
        tracing::warn!(pgid = pgid.as_raw_pid(), error = %e, "cannot signal the agent's process group");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec(ws: &Path, phase: Phase, template: &str) -> RunSpec {
        let mut s = RunSpec::new(
            AgentSpec::Command(template.to_string()),
            ws,
            "fix-login",
            phase,
            "lease-1",
            42,
        );
        s.grace = Duration::from_millis(300);
        s.worker_exe = Some(worker_bin());
        s
    }

    /// The `automaton-worker` binary, which runs the guard: this test binary is not it.
    /// `cargo test -p automaton-worker` builds it next to `deps/` (its integration tests need
    /// it); `--lib` alone does not, and would run a stale one.
    fn worker_bin() -> PathBuf {
        let exe = std::env::current_exe().unwrap();
        let bin = exe
            .parent()
            .and_then(Path::parent)
            .unwrap()
            .join("automaton-worker");
        assert!(
            bin.is_file(),
            "{} is missing: run `cargo test -p automaton-worker` (or `cargo build -p automaton-worker`) first",
            bin.display()
        );
        bin
    }

    fn never() -> impl Future<Output = StopReason> {
        std::future::pending()
    }

    async fn run(s: RunSpec, max: Duration) -> (Outcome, Vec<RunState>) {
        let states = Arc::new(Mutex::new(vec![]));
        let seen = states.clone();
        let r = Running::start(s, move |st| seen.lock().unwrap().push(st)).unwrap();
        let out = r.wait(max, never()).await;
        let states = states.lock().unwrap().clone();
        (out, states)
    }

    /// Alive and not a zombie: a zombie is dead, only not yet reaped by its new parent.
    fn alive(pid: i32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => {
                let state = stat.rsplit(')').next().unwrap_or("").trim_start();
                !state.starts_with('Z') && !state.starts_with('X')
            }
            Err(_) => false,
        }
    }

    fn pids_in(dir: &Path) -> Vec<i32> {
        let mut pids = vec![];
        for name in ["child", "grandchild", "leader"] {
            let s = std::fs::read_to_string(dir.join(name)).unwrap_or_default();
            pids.extend(s.split_whitespace().map(|p| p.parse::<i32>().unwrap()));
        }
        pids
    }

    /// A leader and children that ignore SIGTERM, and a grandchild in its own shell.
    const STUBBORN: &str = "trap '' TERM; echo $$ > .automaton-task/leader; \
         sleep 1000 & echo $! > .automaton-task/child; \
         sh -c 'sleep 1000 & echo $! > .automaton-task/grandchild; wait' & \
         sleep 1000";

    async fn wait_for_pids(dir: &Path) -> Vec<i32> {
        for _ in 0..200 {
            let pids = pids_in(dir);
            if pids.len() == 3 {
                return pids;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("the agent did not write its pids: {:?}", pids_in(dir));
    }

    fn assert_all_gone(pids: &[i32], pgid: i32) {
        for &pid in pids {
            assert!(!alive(pid), "process {pid} survived the stop");
        }
        // And nothing else of the group either.
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            let fields: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap()
                .split_whitespace()
                .collect();
            // fields: state ppid pgrp …
            if fields.get(2) == Some(&pgid.to_string().as_str()) {
                assert!(
                    !alive(pid),
                    "process {pid} of group {pgid} survived: {stat}"
                );
            }
        }
    }

    #[tokio::test]
    async fn exit_zero_with_artifact_completes() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(
            ws.path(),
            Phase::Referee,
            "echo hello; printf 'Verdict: PASS\\n' > {artifact}",
        );
        let (out, states) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed, "{out:?}");
        assert_eq!(out.exit_code, Some(0));
        assert_eq!(
            states,
            vec![
                RunState::Requested,
                RunState::Starting,
                RunState::Active,
                RunState::Stopping,
                RunState::Stopped
            ]
        );
        let log = std::fs::read_to_string(ws.path().join(".automaton-task/agent.log")).unwrap();
        assert_eq!(log, "hello\n");
    }

    #[tokio::test]
    async fn exit_zero_without_artifact_is_agent_error() {
        let ws = tempfile::tempdir().unwrap();
        let (out, _) = run(
            spec(ws.path(), Phase::Referee, "true"),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(out.reason, StopReason::AgentError);
        assert_eq!(out.detail, "no VERDICT.md written");
        // A blank artifact is no artifact.
        let s = spec(ws.path(), Phase::Design, "printf '  \\n' > {artifact}");
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::AgentError);
        assert_eq!(out.detail, "no DESIGN.md written");
    }

    #[tokio::test]
    async fn non_zero_exit_is_agent_error_with_status() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(
            ws.path(),
            Phase::Design,
            "echo x > {artifact}; echo oops >&2; exit 3",
        );
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::AgentError);
        assert_eq!(out.detail, "exit status 3");
        assert_eq!(out.exit_code, Some(3));
        let log = std::fs::read_to_string(ws.path().join(".automaton-task/agent.log")).unwrap();
        assert_eq!(log, "oops\n");
    }

    #[tokio::test]
    async fn killed_by_a_signal_is_crashed() {
        let ws = tempfile::tempdir().unwrap();
        let (out, _) = run(
            spec(ws.path(), Phase::Design, "kill -9 $$"),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(out.reason, StopReason::Crashed);
        assert_eq!(out.detail, "killed by signal 9");
        assert_eq!(out.exit_code, None);
    }

    #[tokio::test]
    async fn timeout_kills_the_whole_group_even_processes_ignoring_sigterm() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(ws.path(), Phase::Implement, STUBBORN);
        let r = Running::start(s, |_| {}).unwrap();
        let pgid = r.pgid();
        let task = ws.path().join(".automaton-task");
        let wait = tokio::spawn(r.wait(Duration::from_millis(500), never()));
        let pids = wait_for_pids(&task).await;
        assert!(pids.iter().all(|&p| alive(p)));
        let out = wait.await.unwrap();
        assert_eq!(out.reason, StopReason::TimedOut, "{out:?}");
        assert!(
            out.elapsed >= Duration::from_millis(800),
            "SIGTERM was ignored: the grace passed"
        );
        assert_all_gone(&pids, pgid);
    }

    #[tokio::test]
    async fn lease_lost_stops_the_whole_group() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(ws.path(), Phase::Implement, STUBBORN);
        let states = Arc::new(Mutex::new(vec![]));
        let seen = states.clone();
        let r = Running::start(s, move |st| seen.lock().unwrap().push(st)).unwrap();
        let pgid = r.pgid();
        let (tx, rx) = tokio::sync::oneshot::channel::<StopReason>();
        let stop = async move { rx.await.unwrap_or(StopReason::Shutdown) };
        let wait = tokio::spawn(r.wait(Duration::from_secs(60), stop));
        let pids = wait_for_pids(&ws.path().join(".automaton-task")).await;
        tx.send(StopReason::LeaseLost).unwrap();
        let out = wait.await.unwrap();
        assert_eq!(out.reason, StopReason::LeaseLost);
        assert!(out.elapsed < Duration::from_secs(10));
        assert_all_gone(&pids, pgid);
        assert_eq!(
            states.lock().unwrap().last().copied(),
            Some(RunState::Stopped)
        );
    }

    #[tokio::test]
    async fn a_polite_agent_ends_at_sigterm_without_waiting_the_grace() {
        let ws = tempfile::tempdir().unwrap();
        let mut s = spec(ws.path(), Phase::Implement, "sleep 1000");
        s.grace = Duration::from_secs(30);
        let r = Running::start(s, |_| {}).unwrap();
        let out = r
            .wait(Duration::from_secs(60), async {
                StopReason::OperatorStopped
            })
            .await;
        assert_eq!(out.reason, StopReason::OperatorStopped);
        assert!(out.elapsed < Duration::from_secs(5), "{out:?}");
    }

    #[tokio::test]
    async fn children_left_behind_after_a_normal_exit_are_killed() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(
            ws.path(),
            Phase::Design,
            "sleep 1000 > /dev/null 2>&1 & echo $! > .automaton-task/child; echo d > {artifact}",
        );
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed);
        let pids = pids_in(&ws.path().join(".automaton-task"));
        assert_eq!(pids.len(), 1);
        assert!(!alive(pids[0]), "the background child survived");
    }

    #[tokio::test]
    async fn placeholders_are_shell_quoted() {
        let root = tempfile::tempdir().unwrap();
        let ws = root.path().join("a dir with 'quotes' and $(spaces)");
        std::fs::create_dir_all(&ws).unwrap();
        let evil = "x'; touch pwned; echo '\"$(touch pwned2)\"";
        let mut s = spec(
            &ws,
            Phase::Research,
            "printf '%s\\n' {task} {workspace} {phase} > {artifact}",
        );
        s.task = evil.to_string();
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed, "{out:?}");
        let got = std::fs::read_to_string(ws.join(".automaton-task/SPEC.md")).unwrap();
        assert_eq!(got, format!("{evil}\n{}\nresearch\n", ws.display()));
        assert!(!ws.join("pwned").exists() && !ws.join("pwned2").exists());
        // Unknown braces are left alone.
        assert_eq!(
            spec(&ws, Phase::Research, "${HOME} {x} {").render("${HOME} {x} {"),
            "${HOME} {x} {"
        );
    }

    const ENV_AGENT: &str = "env | grep '^AUTOMATON_' | sort > {artifact}; \
         echo \"token=${AUTOMATON_TOKEN-unset}\" >> {artifact}; \
         echo \"pool=${AUTOMATON_POOL_SECRET_FILE-unset}\" >> {artifact}; \
         echo \"token_file=${AUTOMATON_TOKEN_FILE-unset}\" >> {artifact}";

    fn env_spec(ws: &Path) -> RunSpec {
        let mut s = spec(ws, Phase::CodeReview, ENV_AGENT);
        s.model_server = Some("http://127.0.0.1:11434".into());
        s.num_ctx = Some(32768);
        s.budget_tokens = 24000;
        s.base_commit = Some("0123abcd".into());
        s
    }

    #[tokio::test]
    async fn environment_is_set_for_the_agent() {
        let ws = tempfile::tempdir().unwrap();
        let (out, _) = run(env_spec(ws.path()), Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed, "{out:?}");
        let got =
            std::fs::read_to_string(ws.path().join(".automaton-task/CODE_REVIEW.md")).unwrap();
        let ws_s = ws.path().display().to_string();
        for line in [
            "AUTOMATON_TASK=fix-login".to_string(),
            "AUTOMATON_PHASE=code_review".into(),
            "AUTOMATON_LEASE_ID=lease-1".into(),
            "AUTOMATON_FENCING_TOKEN=42".into(),
            format!("AUTOMATON_ARTIFACT={ws_s}/.automaton-task/CODE_REVIEW.md"),
            format!("AUTOMATON_WORKSPACE={ws_s}"),
            format!("AUTOMATON_PROMPT_FILE={ws_s}/.automaton-task/prompt.md"),
            "AUTOMATON_BUDGET_TOKENS=24000".into(),
            "AUTOMATON_MODEL_SERVER=http://127.0.0.1:11434".into(),
            "AUTOMATON_NUM_CTX=32768".into(),
            "AUTOMATON_BASE_COMMIT=0123abcd".into(),
            // Not metered: the model server itself.
            "AUTOMATON_MODEL_URL=http://127.0.0.1:11434".into(),
        ] {
            assert!(got.lines().any(|l| l == line), "missing {line} in:\n{got}");
        }
    }

    #[test]
    fn a_metered_run_gets_its_proxy_prefix_as_model_url_and_openai_base_url() {
        let ws = Path::new("/ws");
        let mut s = env_spec(ws);
        let get = |s: &RunSpec, k: &str| s.env().into_iter().find(|(n, _)| *n == k).map(|(_, v)| v);
        assert_eq!(get(&s, "OPENAI_BASE_URL"), None, "not metered: left alone");
        assert_eq!(s.render("{model_url}"), "'http://127.0.0.1:11434'");
        s.model_url = Some("http://127.0.0.1:4242/run/r7".into());
        assert_eq!(
            get(&s, "AUTOMATON_MODEL_URL").as_deref(),
            Some("http://127.0.0.1:4242/run/r7")
        );
        assert_eq!(
            get(&s, "OPENAI_BASE_URL").as_deref(),
            Some("http://127.0.0.1:4242/run/r7/v1")
        );
        assert_eq!(
            get(&s, "AUTOMATON_MODEL_SERVER").as_deref(),
            Some("http://127.0.0.1:11434")
        );
        assert_eq!(
            s.render("curl {model_url}/v1/models"),
            "curl 'http://127.0.0.1:4242/run/r7'/v1/models"
        );
    }

    /// Run by `worker_token_and_pool_secret_are_not_passed_to_the_agent` in a copy of this test binary whose
    /// environment holds `AUTOMATON_TOKEN` (and the two file variables): setting it here would take `unsafe`.
    #[tokio::test]
    #[ignore = "a helper: run through worker_token_and_pool_secret_are_not_passed_to_the_agent"]
    async fn token_helper_runs_an_agent_in_dir_from_env() {
        let dir = std::env::var("AUTOMATON_TEST_WS").expect("set by the outer test");
        assert_eq!(
            std::env::var("AUTOMATON_TOKEN").as_deref(),
            Ok("worker-secret")
        );
        assert!(std::env::var("AUTOMATON_POOL_SECRET_FILE").is_ok());
        assert!(std::env::var("AUTOMATON_TOKEN_FILE").is_ok());
        let (out, _) = run(env_spec(Path::new(&dir)), Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed, "{out:?}");
    }

    #[test]
    fn worker_token_and_pool_secret_are_not_passed_to_the_agent() {
        let ws = tempfile::tempdir().unwrap();
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "agent::tests::token_helper_runs_an_agent_in_dir_from_env",
                "--ignored",
                "--quiet",
            ])
            .env("AUTOMATON_TOKEN", "worker-secret")
            .env("AUTOMATON_POOL_SECRET_FILE", "/etc/pool-secret")
            .env("AUTOMATON_TOKEN_FILE", "/run/worker-token")
            .env("AUTOMATON_TEST_WS", ws.path())
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "the helper failed: {status}");
        let got =
            std::fs::read_to_string(ws.path().join(".automaton-task/CODE_REVIEW.md")).unwrap();
        assert!(got.contains("AUTOMATON_FENCING_TOKEN=42"), "{got}");
        assert!(got.lines().any(|l| l == "token=unset"), "{got}");
        assert!(!got.contains("worker-secret"), "{got}");
        assert!(got.lines().any(|l| l == "pool=unset"), "{got}");
        assert!(!got.contains("/etc/pool-secret"), "{got}");
        assert!(got.lines().any(|l| l == "token_file=unset"), "{got}");
        assert!(!got.contains("/run/worker-token"), "{got}");
    }

    #[test]
    fn reasons_and_states_have_their_wire_names() {
        let reasons = StopReason::REPORTED.map(StopReason::name);
        assert_eq!(
            reasons,
            [
                "completed",
                "agent_error",
                "crashed",
                "timed_out",
                "lease_lost",
                "operator_stopped",
                "shutdown"
            ]
        );
        let states = [
            RunState::Requested,
            RunState::Starting,
            RunState::Active,
            RunState::Stopping,
            RunState::Stopped,
        ]
        .map(RunState::name);
        assert_eq!(
            states,
            ["requested", "starting", "active", "stopping", "stopped"]
        );
    }

    #[tokio::test]
    async fn a_phase_without_artifact_or_an_empty_command_is_refused() {
        let ws = tempfile::tempdir().unwrap();
        let states = Arc::new(Mutex::new(vec![]));
        let seen = states.clone();
        let e = Running::start(spec(ws.path(), Phase::Complete, "true"), move |st| {
            seen.lock().unwrap().push(st)
        })
        .unwrap_err();
        assert!(matches!(e, Error::NoArtifact(Phase::Complete)), "{e}");
        assert_eq!(
            states.lock().unwrap().last().copied(),
            Some(RunState::Stopped)
        );
        let e = Running::start(spec(ws.path(), Phase::Design, "  "), |_| {}).unwrap_err();
        assert!(matches!(e, Error::EmptyCommand), "{e}");
    }

    #[tokio::test]
    async fn log_keeps_at_most_the_cap() {
        let ws = tempfile::tempdir().unwrap();
        let mut s = spec(
            ws.path(),
            Phase::Design,
            "head -c 100000 /dev/zero | tr '\\0' x; echo d > {artifact}",
        );
        s.log_cap = 1000;
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed);
        let log = std::fs::read_to_string(ws.path().join(".automaton-task/agent.log")).unwrap();
        assert!(log.starts_with(&"x".repeat(1000)));
        assert!(log.len() < 1200, "{}", log.len());
        assert!(log.contains("log cap of 1000 bytes reached"));
    }

    /// The command line of a live process.
    fn cmdline(pid: i32) -> String {
        std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
            .unwrap_or_default()
    }

    #[tokio::test]
    async fn the_guard_leads_the_group_and_reports_the_agents_exit_code_and_signal_as_before() {
        let ws = tempfile::tempdir().unwrap();
        // The leader is the guard; the agent is its child in the same group.
        let s = spec(
            ws.path(),
            Phase::Design,
            "echo $$ > .automaton-task/leader; sleep 1000",
        );
        let r = Running::start(s, |_| {}).unwrap();
        let pgid = r.pgid();
        let wait = tokio::spawn(r.wait(Duration::from_secs(60), async {
            tokio::time::sleep(Duration::from_millis(500)).await;
            StopReason::OperatorStopped
        }));
        let task = ws.path().join(".automaton-task");
        let deadline = Instant::now() + Duration::from_secs(10);
        let agent = loop {
            if let Some(p) = pids_in(&task).first() {
                break *p;
            }
            assert!(Instant::now() < deadline, "the agent did not start");
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_ne!(agent, pgid, "the agent is not the leader");
        assert!(cmdline(pgid).contains("agent-guard"), "{}", cmdline(pgid));
        let out = wait.await.unwrap();
        assert_eq!(out.reason, StopReason::OperatorStopped);
        assert_all_gone(&[agent], pgid);
        // Exit codes, and deaths by signal (SIGPIPE too, which Rust ignores by default,
        // SIGTERM, which the guard catches, and a real-time one), read as if the worker had started the agent.
        for (template, reason, detail, code) in [
            ("exit 3", StopReason::AgentError, "exit status 3", Some(3)),
            (
                "exit 0",
                StopReason::AgentError,
                "no DESIGN.md written",
                Some(0),
            ),
            (
                "kill -9 $$",
                StopReason::Crashed,
                "killed by signal 9",
                None,
            ),
            (
                "kill -TERM $$",
                StopReason::Crashed,
                "killed by signal 15",
                None,
            ),
            (
                "kill -PIPE $$",
                StopReason::Crashed,
                "killed by signal 13",
                None,
            ),
            (
                "kill -SEGV $$",
                StopReason::Crashed,
                "killed by signal 11",
                None,
            ),
            // A real-time signal (SIGRTMIN on glibc), which signal-hook cannot emulate.
            (
                "kill -34 $$",
                StopReason::Crashed,
                "killed by signal 34",
                None,
            ),
        ] {
            let (out, _) = run(
                spec(ws.path(), Phase::Design, template),
                Duration::from_secs(10),
            )
            .await;
            assert_eq!(
                (out.reason, out.detail.as_str(), out.exit_code),
                (reason, detail, code),
                "{template}"
            );
        }
    }

    #[tokio::test]
    async fn a_sigterm_to_the_group_on_a_timeout_leaves_the_status_to_the_agent() {
        let ws = tempfile::tempdir().unwrap();
        // The worker's SIGTERM reaches the guard too: the agent's own exit decides.
        let mut s = spec(
            ws.path(),
            Phase::Implement,
            "trap 'exit 7' TERM; sleep 1000 & wait",
        );
        s.grace = Duration::from_secs(30);
        let r = Running::start(s, |_| {}).unwrap();
        let out = r.wait(Duration::from_millis(300), never()).await;
        assert_eq!(out.reason, StopReason::TimedOut, "{out:?}");
        assert_eq!(out.exit_code, Some(7), "{out:?}");
        assert!(out.elapsed < Duration::from_secs(10), "{out:?}");
    }

    #[tokio::test]
    async fn an_agent_the_guard_cannot_start_is_reported_as_not_started() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(ws.path(), Phase::Design, "unused");
        let r = Running::start_with(
            s,
            Box::new(|_| {}),
            Some(vec!["/no/such/agent".into(), "x".into()]),
        )
        .unwrap();
        let out = r.wait(Duration::from_secs(10), never()).await;
        assert_eq!(out.reason, StopReason::AgentError);
        assert_eq!(out.exit_code, None);
        let want = format!(
            "cannot start the agent: cannot start the agent in {}: No such file or directory (os error 2)",
            ws.path().display()
        );
        assert_eq!(out.detail, want);
        let log = std::fs::read_to_string(ws.path().join(".automaton-task/agent.log")).unwrap();
        assert_eq!(
            log,
            format!(
                "automaton-worker agent-guard: {}\n",
                want.trim_start_matches("cannot start the agent: ")
            )
        );
        // A shell's own exit 127 names the program it did not find; the code stays.
        let (out, _) = run(
            spec(
                ws.path(),
                Phase::Design,
                "no-such-command-xyz --yes {artifact}",
            ),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(out.detail, "command not found: no-such-command-xyz");
        assert_eq!(out.exit_code, Some(127));
        assert!(out.tail.contains("no-such-command-xyz"), "{}", out.tail);
        // Found in the shell's complaint, past a variable and a `cd`.
        let (out, _) = run(
            spec(
                ws.path(),
                Phase::Design,
                "X=1 cd . && missing-agent-abc run",
            ),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(out.detail, "command not found: missing-agent-abc");
        // 126: found but not executable.
        std::fs::write(ws.path().join("not-exec.sh"), "echo hi\n").unwrap();
        let (out, _) = run(
            spec(ws.path(), Phase::Design, "./not-exec.sh"),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(out.detail, "not executable: ./not-exec.sh");
        assert_eq!(out.exit_code, Some(126));
    }

    #[tokio::test]
    async fn the_tail_keeps_the_end_of_the_output_and_redacts_the_workers_secrets() {
        let ws = tempfile::tempdir().unwrap();
        let mut s = spec(
            ws.path(),
            Phase::Design,
            "head -c 50000 /dev/zero | tr '\\0' x; echo; echo 'token sekrit-token-1234 end'; sleep 0.2; echo last line >&2; exit 1",
        );
        s.secrets = vec!["sekrit-token-1234".into(), "short".into()];
        s.log_cap = 100;
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.detail, "exit status 1");
        assert!(out.tail.len() <= TAIL_BYTES, "{}", out.tail.len());
        assert!(out.tail.len() > TAIL_BYTES - 100, "{}", out.tail.len());
        assert!(
            out.tail.ends_with("token [redacted] end\nlast line\n"),
            "{:?}",
            &out.tail[out.tail.len() - 60..]
        );
        assert!(!out.tail.contains("sekrit"));
    }

    #[test]
    fn a_tail_is_cut_on_a_character_boundary_and_shell_complaints_name_the_program() {
        let text = "é".repeat(TAIL_BYTES);
        let bytes = text.as_bytes();
        // Cut through a character: its continuation byte is skipped.
        let t = tail_text(&bytes[bytes.len() - 1001..], &[]);
        assert_eq!(t, "é".repeat(500));
        let long = tail_text(bytes, &[]);
        assert_eq!(long.len(), TAIL_BYTES);
        for (line, code, want) in [
            ("sh: 1: aider: not found", 127, Some("aider")),
            ("sh: line 1: aider: command not found", 127, Some("aider")),
            ("bash: codex: command not found", 127, Some("codex")),
            ("zsh: command not found: claude", 127, Some("claude")),
            (
                "/bin/sh: ./run.sh: No such file or directory",
                127,
                Some("./run.sh"),
            ),
            ("sh: 1: ./a.sh: Permission denied", 126, Some("./a.sh")),
            ("error: file not found", 127, None),
            ("sh: 1: cannot open x: No such file", 2, None),
            ("sh: 1: aider: not found", 1, Some("aider")),
        ] {
            assert_eq!(
                shell_complaint(&format!("noise\n{line}\n"), code).as_deref(),
                want,
                "{line}"
            );
        }
        assert_eq!(first_program("aider --yes x").as_deref(), Some("aider"));
        assert_eq!(
            first_program("FOO='a b' exec '/opt/my agent' run").as_deref(),
            Some("/opt/my agent")
        );
        assert_eq!(first_program("  ").as_deref(), None);
    }

    #[tokio::test]
    async fn an_artifact_written_elsewhere_is_found_and_named() {
        let ws = tempfile::tempdir().unwrap();
        let (out, _) = run(
            spec(ws.path(), Phase::Research, "echo spec > SPEC.md"),
            Duration::from_secs(10),
        )
        .await;
        assert_eq!(
            out.detail,
            "no SPEC.md written at .automaton-task/SPEC.md (found SPEC.md at the workspace root: write it to $AUTOMATON_ARTIFACT)"
        );
        std::fs::remove_file(ws.path().join("SPEC.md")).unwrap();
        let (out, _) = run(
            spec(
                ws.path(),
                Phase::Research,
                "mkdir -p docs/x && echo s > docs/x/SPEC.md",
            ),
            Duration::from_secs(10),
        )
        .await;
        assert!(
            out.detail
                .contains("(found SPEC.md at docs/x/SPEC.md: write it to $AUTOMATON_ARTIFACT)"),
            "{}",
            out.detail
        );
    }

    #[tokio::test]
    async fn the_guard_adds_nothing_to_the_agents_environment() {
        let ws = tempfile::tempdir().unwrap();
        let s = spec(ws.path(), Phase::Design, "env -0 > {artifact}");
        let mut want: std::collections::BTreeMap<String, String> = std::env::vars()
            .filter(|(k, _)| {
                ![WORKER_TOKEN_VAR, POOL_SECRET_VAR, TOKEN_FILE_VAR].contains(&k.as_str())
            })
            .collect();
        want.extend(s.env().into_iter().map(|(k, v)| (k.to_string(), v)));
        let (out, _) = run(s, Duration::from_secs(10)).await;
        assert_eq!(out.reason, StopReason::Completed, "{out:?}");
        let got = std::fs::read(ws.path().join(".automaton-task/DESIGN.md")).unwrap();
        let got: std::collections::BTreeMap<String, String> = got
            .split(|b| *b == 0)
            .filter_map(|v| std::str::from_utf8(v).ok()?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            // What `sh` itself sets.
            .filter(|(k, _)| !["PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str()))
            .collect();
        want.retain(|k, _| !["PWD", "OLDPWD", "SHLVL", "_"].contains(&k.as_str()));
        assert_eq!(got, want);
    }

    #[tokio::test]
    async fn when_the_alive_pipe_closes_the_guard_ends_the_group_after_the_grace() {
        let ws = tempfile::tempdir().unwrap();
        let mut s = spec(ws.path(), Phase::Implement, STUBBORN);
        s.grace = Duration::from_millis(500);
        let mut r = Running::start(s, |_| {}).unwrap();
        let pgid = r.pgid();
        let pids = wait_for_pids(&ws.path().join(".automaton-task")).await;
        // What the kernel does when the worker dies: the write end closes.
        let closed = Instant::now();
        drop(r.alive.take());
        let status = r.child.wait().await.unwrap();
        // SIGTERM is ignored by all of them: only the SIGKILL after the grace ends them.
        assert_eq!(status.signal(), Some(9), "{status:?}");
        assert!(closed.elapsed() >= Duration::from_millis(500));
        let deadline = Instant::now() + Duration::from_secs(5);
        while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_all_gone(&pids, pgid);
        r.finished = true;
    }
}
