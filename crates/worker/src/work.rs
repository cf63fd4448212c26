//! One assignment, from offer to report: fetch the inputs and the code under the lease, build
//! a fresh workspace, run the agent, upload its artifact and the code it changed, complete the
//! phase — reporting each step of the run (seed 003) on the session.
//!
//! A run that did not complete reports the tail of the agent's output, and, when its model
//! requests failed, how many and why (`model server unreachable (3 of 3 requests failed:
//! connection refused)`). The changes are looked at before anything is sent: an implement run
//! whose changes hold no code (nothing, or only tool state such as `.aider*`) is reported as
//! such — a failed run under `.agent.md`'s `Require code change: yes` — and a read-only
//! phase's changes, never sent, are named in a warning. Failed runs are logged at WARN.
//!
//! The lease is the only authority: when it is lost (the session's `LeaseLost`, an operator's
//! stop, the worker shutting down), the agent's process group is killed and the workspace is
//! discarded; anything sent after the lease ended is refused by its fencing token anyway.
//!
//! Every `Work` call is retried with backoff while the coordinator is unreachable (a restart,
//! a network cut: `UNAVAILABLE`, `DEADLINE_EXCEEDED`, a broken connection), for up to
//! `Runner::retry_for`, and never after the lease is lost; a definite refusal is final.
//! Each try goes to the leader as the session knows it then (`crate::leader`): a call cut off
//! by a failover lands on the new leader once it is found, and a follower's refusal naming
//! the leader points every call there.
//! The code tree the run works on is pinned in the shared cache from the manifest until the
//! patch is made; a tree offered as cached but evicted by another worker before it was
//! pinned (or removed by hand) is fetched again in full, never a failed run.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use automaton_workflow::{State, sha256_hex};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tracing::Instrument as _;

use crate::agent::{AgentSpec, Outcome, RunSpec, RunState, Running, StopReason};
use crate::leader::Leader;
use crate::meter::Peak;
use crate::workspace::{Cache, InputFile, Pin, TreeFile, Workspace};
use automaton_proto::vocab::RunVocab;

/// Bytes per upload message.
const CHUNK: usize = 1 << 20;
/// The first wait before a `Work` call is retried; doubled each time up to `RETRY_MAX_WAIT`.
const RETRY_FIRST_WAIT: Duration = Duration::from_millis(100);
const RETRY_MAX_WAIT: Duration = Duration::from_secs(2);

/// What every run of this worker shares.
pub struct Runner {
    pub agent: AgentSpec,
    /// Fresh workspaces are made under here.
    pub work_dir: PathBuf,
    pub cache: Cache,
    pub budget_tokens: u64,
    pub model_server: Option<String>,
    /// The metering proxy in front of the model server, when usage is metered.
    pub meter: Option<Arc<crate::meter::Meter>>,
    pub num_ctx: Option<u64>,
    /// Between SIGTERM and SIGKILL of the agent's group.
    pub grace: Duration,
    pub bearer: Option<tonic::metadata::AsciiMetadataValue>,
    /// This machine's GPUs for people (`NVIDIA A100 80 GiB`, `no GPU`), on the run's span.
    pub gpu: String,
    /// How long a `Work` call is retried while the coordinator is unreachable (at least the
    /// coordinator's session timeout: a restart within it keeps the run's lease).
    pub retry_for: Duration,
    /// The worker's own secrets (its token, its pool secret), redacted from the output tails
    /// sent to the coordinator.
    pub secrets: Vec<String>,
    /// Paths that are an agent's tool state, never part of a patch
    /// (`crate::presets::DEFAULT_PATCH_EXCLUDES` and the worker's `--patch-exclude`s).
    pub patch_exclude: Vec<String>,
}

/// What a run's report carries besides its reason and detail.
#[derive(Debug, Default, Clone)]
struct Notes {
    /// The agent's output tail, for a run that did not complete.
    tail: String,
    /// What a person should know that did not fail the run.
    warnings: Vec<String>,
    /// An implement run whose changes held no code.
    code_unchanged: bool,
}

/// At most this many warnings per run, each at most `WARNING_BYTES`.
const MAX_WARNINGS: usize = 4;
const WARNING_BYTES: usize = 400;

/// What an implement run that changed no code is told (the warning, and the failure under
/// `Require code change: yes`).
pub const NO_CODE_CHANGE: &str = "implement changed no code";

/// Whether `path` is an agent tool's state rather than code (the patch-exclude list,
/// `crate::presets::DEFAULT_PATCH_EXCLUDES`): a change of only these is no code change.
pub fn is_tool_state(path: &str) -> bool {
    crate::presets::excluded(path, crate::presets::DEFAULT_PATCH_EXCLUDES)
}

/// `paths` for one line: the first ten, and how many more.
pub(crate) fn name_paths(paths: &[&str]) -> String {
    let mut out = paths
        .iter()
        .take(10)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if paths.len() > 10 {
        out.push_str(&format!(" and {} more", paths.len() - 10));
    }
    out
}

/// `s` cut to at most `max` bytes on a character boundary, marked when cut.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Why a step failed: the lease ended (nothing more to do), the run was told to stop while a
/// call was being retried, the coordinator could not be reached (retried), or something else
/// went wrong.
#[derive(Debug)]
enum Failed {
    LeaseLost(String),
    Stopped(StopReason),
    /// With the leader a follower named, if it named one.
    Unreachable(String, Option<String>),
    Error(String),
    /// The agent exited well, but what it left fails the run (an implement that changed no
    /// code under `Require code change: yes`): nothing was sent.
    Judged(String),
}

impl From<tonic::Status> for Failed {
    fn from(s: tonic::Status) -> Self {
        let why = format!("{:?}: {}", s.code(), s.message());
        match s.code() {
            // Ended, or superseded: the fencing token says so.
            tonic::Code::NotFound | tonic::Code::FailedPrecondition
                if s.message().contains("lease") || s.message().contains("token") =>
            {
                Failed::LeaseLost(s.message().to_string())
            }
            _ if transient(&s) => Failed::Unreachable(why, automaton_client::leader_named(&s)),
            _ => Failed::Error(why),
        }
    }
}

/// Whether a call's failure says nothing about the request, only that the coordinator was
/// not there to answer it: no connection (`UNAVAILABLE`, which tonic gives connect errors
/// too), no answer in time, or a connection that broke mid-call (hyper's "operation was
/// canceled": the connection went away under the call — the worker cancels nothing itself but
/// by stopping the run, which `retrying` sees first). Every other code is the coordinator's
/// answer, and final.
fn transient(s: &tonic::Status) -> bool {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded => true,
        tonic::Code::Unknown | tonic::Code::Cancelled | tonic::Code::Internal => {
            let m = s.message();
            m.contains("transport error")
                || m.contains("h2 protocol error")
                || m.contains("connection")
                || m.contains("broken pipe")
                || m.contains("operation was canceled")
        }
        _ => false,
    }
}

/// A random fraction in [0, 1) for jitter (the std hasher's random keys).
fn jitter() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Runs `call` until it succeeds, fails for good, or the run is told to stop; a failure
/// that only says the coordinator was unreachable is tried again after a jittered wait
/// (100 ms doubling to 2 s) for up to `retry_for`. Each try sends the whole request again:
/// the coordinator takes the same upload twice as success. A refusal naming the leader
/// points `calls` there, for the next try and every other call; once `calls` point at
/// another coordinator the waiting call is tried again at once.
async fn retrying<T, F, Fut>(
    what: &'static str,
    retry_for: Duration,
    stop: &watch::Receiver<Option<StopReason>>,
    calls: &Calls,
    mut call: F,
) -> Result<T, Failed>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failed>>,
{
    let deadline = Instant::now() + retry_for;
    let mut wait = RETRY_FIRST_WAIT;
    let mut tries = 0u32;
    loop {
        // Before the call: a leader found while it fails is tried at once.
        let mut moved = calls.leader.watch();
        let mut moved_during = false;
        let answer = tokio::select! {
            biased;
            a = call() => a,
            // Moved while the call waits on a leader that is gone or frozen (SIGSTOP: its
            // connection still open, no answer until the keep-alive gives up): the call is
            // dropped and sent to the new leader. The old one, deposed, can write nothing
            // of it, and the new one answers a repeat as the first.
            Ok(()) = moved.changed() => {
                moved_during = true;
                Err(Failed::Unreachable("the leader changed during the call".into(), None))
            }
        };
        let why = match answer {
            Ok(v) => return Ok(v),
            Err(Failed::Unreachable(why, named)) => {
                if let Some(url) = named {
                    calls.leader.follow_url(&url);
                }
                why
            }
            Err(e) => return Err(e),
        };
        tries += 1;
        if let Some(r) = *stop.borrow() {
            return Err(Failed::Stopped(r));
        }
        let pause = wait.mul_f64(0.5 + jitter() / 2.0);
        if Instant::now() + pause > deadline {
            return Err(Failed::Error(format!(
                "{what}: the coordinator was unreachable for {} ({tries} tries): {why}",
                humantime::format_duration(retry_for)
            )));
        }
        if moved_during {
            // Already told: the new leader is tried now.
            tracing::info!(call = what, tries, leader = %calls.leader.url(), "the leader changed during the call: sending it there");
            continue;
        }
        tracing::warn!(call = what, tries, error = %why, wait_ms = pause.as_millis() as u64, "the coordinator is unreachable: retrying");
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            // The session found (or a refusal named) another leader: try it now.
            Ok(()) = moved.changed() => {}
            r = stopped(stop.clone()) => return Err(Failed::Stopped(r)),
        }
        wait = (wait * 2).min(RETRY_MAX_WAIT);
    }
}

impl Runner {
    fn req<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(b) = &self.bearer {
            r.metadata_mut().insert("authorization", b.clone());
        }
        // The call joins the run's trace (W3C `traceparent` in the metadata).
        automaton_telemetry::trace::inject(r.metadata_mut());
        r
    }
}

/// A run's reporter: every state change goes to the session as a `RunUpdate`.
#[derive(Clone)]
struct Report {
    tx: mpsc::UnboundedSender<pb::RunUpdate>,
    lease_id: String,
    token: u64,
    task: String,
    phase: String,
}

impl Report {
    fn send(&self, state: RunState, reason: Option<StopReason>, detail: &str, code: Option<i32>) {
        self.send_peak(state, reason, detail, code, None, Notes::default());
    }

    fn send_peak(
        &self,
        state: RunState,
        reason: Option<StopReason>,
        detail: &str,
        code: Option<i32>,
        peak: Option<Peak>,
        notes: Notes,
    ) {
        let mut update = pb::RunUpdate {
            lease_id: self.lease_id.clone(),
            token: self.token,
            task: self.task.clone(),
            phase: self.phase.clone(),
            detail: detail.into(),
            exit_code: code.unwrap_or(-1),
            peak_context_tokens: peak.map_or(0, |p| p.tokens),
            peak_context_source: peak.map(|p| p.source.as_str().into()).unwrap_or_default(),
            output_tail: notes.tail,
            warnings: notes
                .warnings
                .iter()
                .take(MAX_WARNINGS)
                .map(|w| clip(w, WARNING_BYTES))
                .collect(),
            code_unchanged: notes.code_unchanged,
            ..Default::default()
        };
        update.set_state_kind(state);
        update.set_stop_kind(reason);
        let _ = self.tx.send(update);
    }
}

/// Waits for a stop reason from the session.
async fn stopped(mut stop: watch::Receiver<Option<StopReason>>) -> StopReason {
    loop {
        if let Some(r) = *stop.borrow() {
            return r;
        }
        if stop.changed().await.is_err() {
            return StopReason::Shutdown;
        }
    }
}

/// Runs one assignment to its end; the last update sent is `stopped`. The run is one span,
/// `agent.run`, a child of the coordinator's dispatch decision when the assignment carries its
/// trace context; every call to the coordinator carries the run's context on.
pub async fn run(
    runner: Arc<Runner>,
    leader: Leader,
    a: pb::Assignment,
    stop: watch::Receiver<Option<StopReason>>,
    updates: mpsc::UnboundedSender<pb::RunUpdate>,
    finishing: Arc<std::sync::atomic::AtomicBool>,
) {
    let Some(lease) = a.lease.clone() else {
        return;
    };
    let span = tracing::info_span!(
        "agent.run",
        automaton.task = %a.task,
        automaton.phase = %a.phase,
        automaton.agent = %lease.agent,
        automaton.worker = %lease.agent,
        automaton.lease_id = %lease.lease_id,
        automaton.token = lease.token,
        automaton.gpu = %runner.gpu,
        automaton.budget_tokens = runner.budget_tokens,
        automaton.need_tokens = a.estimated_tokens,
        automaton.attempt = a.attempt,
        automaton.stop_reason = tracing::field::Empty,
        automaton.detail = tracing::field::Empty,
        automaton.exit_code = tracing::field::Empty,
        automaton.peak_context_tokens = tracing::field::Empty,
        automaton.peak_context_source = tracing::field::Empty,
        automaton.output_last_line = tracing::field::Empty,
        automaton.warnings = tracing::field::Empty,
    );
    automaton_telemetry::trace::set_parent_from_traceparent(&span, &a.traceparent, &a.tracestate);
    let report = Report {
        tx: updates,
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        task: a.task.clone(),
        phase: a.phase.clone(),
    };
    async {
        report.send(RunState::Starting, None, "", None);
        let started = std::time::Instant::now();
        let metrics = &crate::metrics::METRICS;
        metrics.runs_active.add(1);
        let mut notes = Notes::default();
        let (reason, detail, code, peak) = match attempt(
            &runner,
            &Calls { leader },
            &a,
            &lease,
            stop,
            &report,
            &finishing,
            &mut notes,
        )
        .await
        {
            Ok((o, peak)) => (o.reason, o.detail, o.exit_code, peak),
            Err(Failed::LeaseLost(why)) => (StopReason::LeaseLost, why, None, None),
            Err(Failed::Stopped(r)) => (
                r,
                "stopped while the coordinator was unreachable: nothing more sent".into(),
                None,
                None,
            ),
            Err(Failed::Error(why) | Failed::Unreachable(why, _) | Failed::Judged(why)) => {
                (StopReason::AgentError, why, None, None)
            }
        };
        // A completed run's artifact says what happened; a failed one's output is the clue.
        if reason == StopReason::Completed {
            notes.tail.clear();
        }
        metrics.runs_active.add(-1);
        if let Ok(state) = a.phase.parse::<State>() {
            metrics.run_stopped(state.phase, reason, started.elapsed());
        }
        let span = tracing::Span::current();
        span.record("automaton.stop_reason", reason.name());
        span.record("automaton.detail", detail.as_str());
        if let Some(c) = code {
            span.record("automaton.exit_code", c);
        }
        if let Some(p) = peak {
            span.record("automaton.peak_context_tokens", p.tokens);
            span.record("automaton.peak_context_source", p.source.as_str());
        }
        if let Some(line) = notes.tail.lines().rev().find(|l| !l.trim().is_empty()) {
            span.record(
                "automaton.output_last_line",
                clip(line.trim(), 200).as_str(),
            );
        }
        if !notes.warnings.is_empty() {
            span.record("automaton.warnings", notes.warnings.join("; ").as_str());
        }
        // Stopped by a person or by the worker's own shutdown: not the run's failure.
        if !matches!(
            reason,
            StopReason::Completed | StopReason::OperatorStopped | StopReason::Shutdown
        ) {
            automaton_telemetry::trace::record_error(&span, &format!("{reason}: {detail}"));
        }
        if reason == StopReason::Completed {
            tracing::info!(
                task = %a.task,
                phase = %a.phase,
                reason = %reason,
                detail = %detail,
                peak_context_tokens = peak.map_or(0, |p| p.tokens),
                peak_source = peak.map_or("none", |p| p.source.as_str()),
                warnings = %notes.warnings.join("; "),
                "run stopped"
            );
        } else {
            // A failed run is what an operator looks for first.
            tracing::warn!(
                task = %a.task,
                phase = %a.phase,
                reason = %reason,
                detail = %detail,
                peak_context_tokens = peak.map_or(0, |p| p.tokens),
                peak_source = peak.map_or("none", |p| p.source.as_str()),
                "run stopped"
            );
        }
        report.send_peak(RunState::Stopped, Some(reason), &detail, code, peak, notes);
    }
    .instrument(span)
    .await
}

#[allow(clippy::too_many_arguments)]
async fn attempt(
    runner: &Arc<Runner>,
    work: &Calls,
    a: &pb::Assignment,
    lease: &pb::Lease,
    stop: watch::Receiver<Option<StopReason>>,
    report: &Report,
    finishing: &std::sync::atomic::AtomicBool,
    notes: &mut Notes,
) -> Result<(Outcome, Option<Peak>), Failed> {
    let phase: State = a
        .phase
        .parse()
        .map_err(|_| Failed::Error(format!("unknown phase '{}'", a.phase)))?;
    // The trees offered are not pinned (a worker fetching would keep every tree from
    // eviction): one evicted meanwhile by another worker sharing the cache is fetched again.
    let offered = runner.cache.commits();
    let (manifest, inputs, code) =
        retrying("FetchWorkspace", runner.retry_for, &stop, work, || {
            fetch(runner, work.client(), lease, offered.clone())
        })
        .await?;
    let commit = (!manifest.commit.is_empty()).then_some(manifest.commit.clone());
    // Pinned from here until the patch is made: no worker evicts it meanwhile.
    let mut tree = match (&commit, code) {
        (Some(c), Some(files)) => Some(store(runner, c, files)?),
        (Some(c), None) => match runner.cache.pin(c) {
            Ok(Some(pin)) => Some(pin),
            _ => Some(fetch_tree(runner, work, lease, c, &stop, EVICTED_MEANWHILE).await?),
        },
        (None, _) => None,
    };
    let name = format!("{}-{}", a.task.replace('/', "--"), lease.token);
    let made = Workspace::create(
        &runner.work_dir,
        &name,
        &runner.cache,
        tree.as_ref(),
        &inputs,
    );
    let ws = match (made, &commit) {
        // Gone all the same (removed by hand): a cache miss, fetched again, never a failure.
        (Err(crate::workspace::Error::NotCached(_)), Some(c)) => {
            tree = Some(fetch_tree(runner, work, lease, c, &stop, PINNED_GONE).await?);
            Workspace::create(
                &runner.work_dir,
                &name,
                &runner.cache,
                tree.as_ref(),
                &inputs,
            )
        }
        (made, _) => made,
    }
    .map_err(|e| Failed::Error(format!("cannot make the workspace: {e}")))?;
    let mut spec = RunSpec::new(
        runner.agent.clone(),
        ws.dir(),
        &a.task,
        phase.phase,
        &lease.lease_id,
        lease.token,
    );
    spec.budget_tokens = runner.budget_tokens;
    spec.model_server = runner.model_server.clone();
    // Held to the end of the attempt: the run's prefix answers 404 once it is dropped.
    let metered = runner.meter.as_ref().map(|m| m.register());
    spec.model_url = metered.as_ref().map(|m| m.url().to_string());
    spec.num_ctx = runner.num_ctx;
    spec.estimated_tokens = (a.estimated_tokens > 0).then_some(a.estimated_tokens);
    spec.base_commit = (!manifest.base_commit.is_empty()).then(|| manifest.base_commit.clone());
    spec.grace = runner.grace;
    spec.secrets = runner.secrets.clone();
    // Live output: a copy of what the agent prints goes to the coordinator as it runs.
    let (sink, source) = crate::output::channel();
    spec.output = Some(sink);
    let live_output = {
        let (runner, leader) = (runner.clone(), work.leader.clone());
        let (lease_id, token) = (lease.lease_id.clone(), lease.token);
        let secrets = runner.secrets.clone();
        tokio::spawn(crate::output::stream(
            move |chunks| {
                let mut client = pb::work_client::WorkClient::new(leader.channel());
                let req = runner.req(chunks);
                async move { client.stream_output(req).await }
            },
            lease_id,
            token,
            source,
            secrets,
        ))
    };
    let r2 = report.clone();
    let running = match Running::start(spec, move |s| {
        // `starting` was sent already; `stopped` is sent once uploads are done.
        if matches!(s, RunState::Active | RunState::Stopping) {
            r2.send(s, None, "", None);
        }
    }) {
        Ok(r) => r,
        Err(e) => {
            let _ = ws.discard();
            return Err(Failed::Error(format!("cannot start the agent: {e}")));
        }
    };
    let max =
        crate::session::wire_duration(a.max_phase_time.as_ref()).max(Duration::from_millis(1));
    let mut outcome = running.wait(max, stopped(stop.clone())).await;
    // Its output has ended; the streamer sends the rest (bounded) before the run reports.
    let _ = tokio::time::timeout(Duration::from_secs(2), live_output).await;
    notes.tail = std::mem::take(&mut outcome.tail);
    let usage = metered.as_ref().map(|m| m.usage());
    let failures = metered.as_ref().map(|m| m.failures()).unwrap_or_default();
    if let Some(u) = usage {
        if u.requests > 0 && (u.counted == 0 || failures.failed > 0) {
            // Requests that said nothing of their usage, or failed: the run's peak is unknown,
            // and the model server may be why the run failed.
            tracing::warn!(
                task = %a.task,
                requests = u.requests,
                with_usage = u.counted,
                failed = failures.failed,
                last_failure = failures.last.as_deref().unwrap_or(""),
                peak_context_tokens = u.peak.unwrap_or(0),
                "model server usage"
            );
        } else {
            tracing::info!(
                task = %a.task,
                requests = u.requests,
                with_usage = u.counted,
                peak_context_tokens = u.peak.unwrap_or(0),
                "model server usage"
            );
        }
        if outcome.reason != StopReason::Completed
            && let Some(note) = crate::meter::failure_note(&u, &failures)
        {
            outcome.detail = format!("{note}; {}", outcome.detail);
        }
    }
    let peak = crate::meter::peak_of(crate::agent::reported_peak(ws.dir()), usage);
    if outcome.reason != StopReason::Completed {
        // Nothing of a run that did not complete is kept or sent.
        let _ = ws.discard();
        return Ok((outcome, peak));
    }
    // The lease may have been lost while the agent finished: send nothing then.
    if let Some(r) = *stop.borrow() {
        let _ = ws.discard();
        return Ok((
            Outcome {
                reason: r,
                detail: "the lease ended as the agent finished: nothing sent".into(),
                ..outcome
            },
            peak,
        ));
    }
    let result = report_back(runner, work, a, lease, &ws, tree, &stop, finishing, notes).await;
    let _ = ws.discard();
    match result {
        Ok(()) => Ok((outcome, peak)),
        // Judged after the agent exited: the run failed, though the agent did not.
        Err(Failed::Judged(detail)) => Ok((
            Outcome {
                reason: StopReason::AgentError,
                detail,
                ..outcome
            },
            peak,
        )),
        Err(e) => Err(e),
    }
}

type Fetched = (pb::WorkspaceManifest, Vec<InputFile>, Option<Vec<TreeFile>>);

type Client = pb::work_client::WorkClient<Channel>;

/// Where a run's `Work` calls go: the leader as the session knows it at each try.
struct Calls {
    leader: Leader,
}

impl Calls {
    /// A client on the leader's channel as it is now (a call stays on it; the next try takes
    /// the leader anew).
    fn client(&self) -> Client {
        pb::work_client::WorkClient::new(self.leader.channel()).max_decoding_message_size(8 << 20)
    }
}

/// Stores a tree the coordinator sent, pinned.
fn store(runner: &Runner, commit: &str, files: Vec<TreeFile>) -> Result<Pin, Failed> {
    runner
        .cache
        .store(commit, files)
        .map_err(|e| Failed::Error(format!("cannot cache the code: {e}")))
}

/// Why a tree is fetched again: offered as cached, then evicted by another worker before this
/// one pinned it (expected under churn) …
const EVICTED_MEANWHILE: &str = "the tree offered as cached was evicted meanwhile";
/// … or gone while pinned (removed by hand: a pinned tree is never evicted).
const PINNED_GONE: &str = "a pinned tree is gone from the cache";

/// `commit`'s whole tree, fetched again (nothing offered as cached) and stored pinned: for a
/// tree this worker needs but no longer holds. The task's head must still be `commit`.
async fn fetch_tree(
    runner: &Runner,
    work: &Calls,
    lease: &pb::Lease,
    commit: &str,
    stop: &watch::Receiver<Option<StopReason>>,
    why: &'static str,
) -> Result<Pin, Failed> {
    if why == PINNED_GONE {
        tracing::warn!(commit = %commit, "{why}: fetching it in full");
    } else {
        tracing::info!(commit = %commit, "{why}: fetching it in full");
    }
    let (manifest, _, code) = retrying("FetchWorkspace", runner.retry_for, stop, work, || {
        fetch(runner, work.client(), lease, vec![])
    })
    .await?;
    match code {
        Some(files) if manifest.commit == commit => store(runner, commit, files),
        Some(_) => Err(Failed::Error(format!(
            "the task's branch moved from {commit} to {} during the run",
            manifest.commit
        ))),
        None => Err(Failed::Error(format!(
            "the coordinator sent no code for {commit}, though none was cached"
        ))),
    }
}

/// The assignment's inputs and (unless `cached` holds its commit) code, checked against
/// the manifest.
async fn fetch(
    runner: &Runner,
    mut work: Client,
    lease: &pb::Lease,
    cached: Vec<String>,
) -> Result<Fetched, Failed> {
    let mut stream = work
        .fetch_workspace(runner.req(pb::FetchWorkspaceRequest {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            cached_commits: cached,
        }))
        .await?
        .into_inner();
    let manifest = match stream.next().await {
        Some(Ok(pb::WorkspaceChunk {
            part: Some(pb::workspace_chunk::Part::Manifest(m)),
        })) => m,
        Some(Err(s)) => return Err(s.into()),
        _ => {
            return Err(Failed::Error(
                "the workspace stream did not start with its manifest".into(),
            ));
        }
    };
    let mut bodies: std::collections::HashMap<(String, String), Vec<u8>> = manifest
        .files
        .iter()
        .map(|f| {
            (
                (f.kind.clone(), f.path.clone()),
                Vec::with_capacity(f.size as usize),
            )
        })
        .collect();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk?;
        if let Some(pb::workspace_chunk::Part::Data(d)) = chunk.part {
            let Some(body) = bodies.get_mut(&(d.kind.clone(), d.path.clone())) else {
                return Err(Failed::Error(format!(
                    "data for {} is not in the manifest",
                    d.path
                )));
            };
            body.extend_from_slice(&d.data);
        }
    }
    let mut inputs = Vec::new();
    let mut code = Vec::new();
    for f in &manifest.files {
        let content = bodies
            .remove(&(f.kind.clone(), f.path.clone()))
            .unwrap_or_default();
        if content.len() as u64 != f.size || sha256_hex(&content) != f.sha256 {
            return Err(Failed::Error(format!(
                "{} arrived damaged (size or sha256 differs from the manifest)",
                f.path
            )));
        }
        if f.kind == "code" {
            code.push(TreeFile {
                path: f.path.clone(),
                executable: f.executable,
                content,
            });
        } else {
            inputs.push(InputFile {
                kind: f.kind.clone(),
                path: f.path.clone(),
                content,
            });
        }
    }
    let code = manifest.code_included.then_some(code);
    Ok((manifest, inputs, code))
}

/// Uploads the artifact and (in phases that may edit code) the changed files, then completes
/// the phase. The changes are looked at first: an implement run whose changes hold no code
/// (nothing, or only tool state) is noted, and under `require_code_change` fails before
/// anything is sent; a read-only phase's changes are named in a warning (they are never sent).
#[allow(clippy::too_many_arguments)]
async fn report_back(
    runner: &Runner,
    work: &Calls,
    a: &pb::Assignment,
    lease: &pb::Lease,
    ws: &Workspace,
    tree: Option<Pin>,
    stop: &watch::Receiver<Option<StopReason>>,
    finishing: &std::sync::atomic::AtomicBool,
    notes: &mut Notes,
) -> Result<(), Failed> {
    let implement = a
        .phase
        .parse::<State>()
        .is_ok_and(|s| s.phase == automaton_workflow::Phase::Implement);
    // The changes against the tree the run started from (none without a tree).
    let mut base = None;
    let changes = match tree {
        Some(pin) => {
            base = Some(pin.commit().to_string());
            let files = match runner.cache.load(&pin) {
                // Gone all the same (removed by hand): fetched again, never a failed run.
                Err(crate::workspace::Error::NotCached(_)) => {
                    let again =
                        fetch_tree(runner, work, lease, pin.commit(), stop, PINNED_GONE).await?;
                    runner.cache.load(&again)
                }
                loaded => loaded,
            }
            .map_err(|e| Failed::Error(format!("cannot read the cached code: {e}")))?;
            // The tree is read: it may go.
            drop(pin);
            // Everything, tool state included, to name it; the patch leaves it out.
            match ws.changes_excluding::<&str>(&files, &[]) {
                Ok(c) => c,
                Err(e) if a.can_edit => {
                    return Err(Failed::Error(format!("cannot diff the workspace: {e}")));
                }
                Err(e) => {
                    notes
                        .warnings
                        .push(format!("cannot tell what a read-only phase changed: {e}"));
                    Vec::new()
                }
            }
        }
        None => Vec::new(),
    };
    let code: Vec<&str> = changes
        .iter()
        .map(|c| c.path.as_str())
        .filter(|p| !crate::presets::excluded(p, &runner.patch_exclude))
        .collect();
    if implement && code.is_empty() {
        if a.require_code_change {
            return Err(Failed::Judged(NO_CODE_CHANGE.into()));
        }
        notes.code_unchanged = true;
        let junk: Vec<&str> = changes.iter().map(|c| c.path.as_str()).collect();
        notes.warnings.push(if junk.is_empty() {
            NO_CODE_CHANGE.to_string()
        } else {
            format!("{NO_CODE_CHANGE} (only tool state: {})", name_paths(&junk))
        });
        tracing::warn!(task = %a.task, files = changes.len(), "{NO_CODE_CHANGE}");
    }
    if !a.can_edit && !code.is_empty() {
        let line = format!(
            "code changes in a read-only phase were dropped: {}",
            name_paths(&code)
        );
        tracing::warn!(task = %a.task, phase = %a.phase, "{line}");
        notes.warnings.push(line);
    }
    // What goes onto the branch: never an agent's tool state.
    let changes: Vec<_> = changes
        .into_iter()
        .filter(|c| !crate::presets::excluded(&c.path, &runner.patch_exclude))
        .collect();
    let path = ws.artifact_path(&a.artifact);
    let bytes = std::fs::read(&path)
        .map_err(|e| Failed::Error(format!("cannot read {}: {e}", path.display())))?;
    let sha = sha256_hex(&bytes);
    let size = bytes.len() as u64;
    let mut chunks: Vec<pb::ArtifactChunk> = bytes
        .chunks(CHUNK)
        .map(|c| pb::ArtifactChunk {
            data: c.to_vec(),
            ..Default::default()
        })
        .collect();
    if chunks.is_empty() {
        chunks.push(pb::ArtifactChunk::default());
    }
    chunks[0].lease_id = lease.lease_id.clone();
    chunks[0].token = lease.token;
    chunks[0].name = a.artifact.clone();
    chunks[0].sha256 = sha;
    chunks[0].size = size;
    retrying("UploadArtifact", runner.retry_for, stop, work, || {
        let mut work = work.client();
        let chunks = chunks.clone();
        async move {
            work.upload_artifact(runner.req(tokio_stream::iter(chunks)))
                .await?;
            Ok(())
        }
    })
    .await?;
    if a.can_edit
        && let Some(base) = base
        && !changes.is_empty()
    {
        let mut msgs = Vec::new();
        for c in changes {
            if c.deleted || c.content.is_empty() {
                msgs.push(pb::FileChange {
                    path: c.path,
                    deleted: c.deleted,
                    executable: c.executable,
                    data: vec![],
                    last: true,
                });
                continue;
            }
            let parts: Vec<&[u8]> = c.content.chunks(CHUNK).collect();
            let n = parts.len();
            for (i, p) in parts.into_iter().enumerate() {
                msgs.push(pb::FileChange {
                    path: c.path.clone(),
                    deleted: false,
                    executable: c.executable,
                    data: p.to_vec(),
                    last: i + 1 == n,
                });
            }
        }
        let mut chunks: Vec<pb::PatchChunk> = msgs
            .into_iter()
            .map(|c| pb::PatchChunk {
                change: Some(c),
                ..Default::default()
            })
            .collect();
        chunks[0].lease_id = lease.lease_id.clone();
        chunks[0].token = lease.token;
        chunks[0].base_commit = base;
        let out = retrying("UploadPatch", runner.retry_for, stop, work, || {
            let mut work = work.client();
            let chunks = chunks.clone();
            async move {
                Ok(work
                    .upload_patch(runner.req(tokio_stream::iter(chunks)))
                    .await?
                    .into_inner())
            }
        })
        .await?;
        tracing::info!(task = %a.task, commit = %out.commit, files = out.files_changed, "code committed");
    }
    // Completing ends the lease, and the coordinator may offer new work at once.
    finishing.store(true, std::sync::atomic::Ordering::Release);
    retrying("CompletePhase", runner.retry_for, stop, work, || {
        let mut work = work.client();
        async move {
            work.complete_phase(runner.req(pb::CompletePhaseRequest {
                lease_id: lease.lease_id.clone(),
                token: lease.token,
                target: String::new(),
            }))
            .await?;
            Ok(())
        }
    })
    .await?;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use tonic::Status;

    /// A call that fails with `fail` for its first `n` tries, then answers `tries`.
    async fn flaky(
        retry_for: Duration,
        stop: &watch::Receiver<Option<StopReason>>,
        fail: Status,
        n: u32,
    ) -> (Result<u32, Failed>, u32) {
        let calls = AtomicU32::new(0);
        // Nothing listens there, and nothing is sent: the calls here are `call`'s own.
        let to = Calls {
            leader: Leader::new(vec!["http://127.0.0.1:9".into()]).unwrap(),
        };
        let out = retrying("Test", retry_for, stop, &to, || {
            let k = calls.fetch_add(1, Ordering::SeqCst) + 1;
            let fail = fail.clone();
            async move { if k <= n { Err(fail.into()) } else { Ok(k) } }
        })
        .await;
        (out, calls.load(Ordering::SeqCst))
    }

    #[tokio::test]
    async fn work_calls_are_retried_while_the_coordinator_is_unreachable() {
        let (_tx, stop) = watch::channel(None);
        for s in [
            Status::unavailable("tcp connect error"),
            Status::deadline_exceeded("timeout expired"),
            Status::unknown("h2 protocol error: error reading a body from connection"),
            // The coordinator killed under a call (issue20_c saw it end a run as agent_error).
            Status::cancelled("operation was canceled"),
        ] {
            let (out, calls) = flaky(Duration::from_secs(10), &stop, s.clone(), 2).await;
            assert_eq!(out.unwrap(), 3, "{s:?}");
            assert_eq!(calls, 3);
        }
    }

    #[tokio::test]
    async fn a_definite_refusal_is_never_retried() {
        let (_tx, stop) = watch::channel(None);
        for s in [
            Status::failed_precondition("the changes touch path 'a'"),
            Status::invalid_argument("bad"),
            Status::not_found("No live lease 'x'"),
            Status::permission_denied("not yours"),
            Status::resource_exhausted("too big"),
            Status::unauthenticated("no token"),
            Status::unknown("boom"),
            Status::internal("oops"),
        ] {
            let (out, calls) = flaky(Duration::from_secs(10), &stop, s.clone(), 5).await;
            assert!(
                matches!(out, Err(Failed::Error(_) | Failed::LeaseLost(_))),
                "{s:?}: {out:?}"
            );
            assert_eq!(calls, 1, "{s:?}");
        }
    }

    #[tokio::test]
    async fn a_retried_call_stops_at_once_when_the_lease_is_lost() {
        let (tx, stop) = watch::channel(None);
        // Sent while the loop waits between tries (the waits are 0.8 s and more by then).
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            let _ = tx.send(Some(StopReason::LeaseLost));
        });
        let t = Instant::now() + Duration::from_millis(1500);
        let (out, _) = flaky(
            Duration::from_secs(60),
            &stop,
            Status::unavailable("down"),
            u32::MAX,
        )
        .await;
        assert!(
            matches!(out, Err(Failed::Stopped(StopReason::LeaseLost))),
            "{out:?}"
        );
        let late = Instant::now().saturating_duration_since(t);
        assert!(
            late < Duration::from_millis(200),
            "stopped {late:?} after the loss"
        );
    }

    #[tokio::test]
    async fn a_call_unreachable_for_longer_than_retry_for_fails_saying_so() {
        let (_tx, stop) = watch::channel(None);
        let t = Instant::now();
        let (out, calls) = flaky(
            Duration::from_millis(400),
            &stop,
            Status::unavailable("tcp connect error"),
            u32::MAX,
        )
        .await;
        let Err(Failed::Error(why)) = out else {
            panic!("{out:?}")
        };
        assert!(
            why.contains("unreachable") && why.contains("tcp connect error"),
            "{why}"
        );
        assert!(calls >= 2, "{calls}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }

    #[tokio::test]
    async fn a_call_hanging_on_a_leader_that_moved_is_sent_to_the_new_one_at_once() {
        let (_tx, stop) = watch::channel(None);
        let to = Calls {
            leader: Leader::new(vec![
                "http://127.0.0.1:9".into(),
                "http://127.0.0.1:10".into(),
            ])
            .unwrap(),
        };
        let leader = to.leader.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            leader.follow_url("http://127.0.0.1:10");
        });
        let tries = AtomicU32::new(0);
        let t = Instant::now();
        let out = retrying("Test", Duration::from_secs(60), &stop, &to, || {
            let first = tries.fetch_add(1, Ordering::SeqCst) == 0;
            let url = to.leader.url();
            async move {
                if first {
                    // A frozen leader: the connection stays open, no answer comes.
                    std::future::pending::<()>().await;
                }
                Ok(url)
            }
        })
        .await;
        assert_eq!(out.unwrap(), "http://127.0.0.1:10");
        assert_eq!(tries.load(Ordering::SeqCst), 2);
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }

    #[test]
    fn jitter_is_a_fraction() {
        for _ in 0..100 {
            let j = jitter();
            assert!((0.0..1.0).contains(&j), "{j}");
        }
    }
}
