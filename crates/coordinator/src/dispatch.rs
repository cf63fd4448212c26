//! Dispatch: the coordinator offers work over the workers' sessions.
//!
//! A round looks at every task, oldest first. A task in `new` is started (moved to
//! `research`); an approved gate moves on to the phase its artifact declares with a `Next:`
//! line, or to the default path (`automaton_workflow::progress`); a task with work (an open
//! phase with a deliverable) that nobody holds goes to an idle worker, chosen by
//! [`choose`], with a lease owned by that worker's session. The grant enforces every rule
//! (separation of duties included): a refused grant tries the next worker. The worker
//! accepts or refuses on its stream; an offer unanswered for [`OFFER_TIMEOUT`] is taken back.
//!
//! Rounds run when something changes (a lease ends, a task is created, approved or
//! transitioned, a worker joins or answers) and every [`ROUND_EVERY`] otherwise.
//!
//! Runs: workers report each agent run's lifecycle (seed 003: requested → starting → active
//! → stopping → stopped, with a stop reason); the last ones per task are kept for
//! `automaton status --task` and `automaton workers`, with a failed run's output tail (the
//! worker's last 16 KiB in memory, its last 4 KiB in `.state.dispatch`) and a run's warnings
//! (an implement that changed no code is also a `no_code_change` event). A failed run
//! releases its lease and is logged at WARN; its task is offered again only after a pause
//! ([`retry_pause`]: 1 s, doubled with each failure of the phase, at most 30 s, kept in
//! `.state.dispatch` across restarts) and to another fitting idle worker before the one that
//! failed it; after `max_attempts` failed runs of one phase the task is held from dispatch,
//! with the reason.
//!
//! Restarts: what dispatch must not forget — an operator's and the limits' holds, the failure
//! and iteration counts, when a task's first run was offered, the need a sub-task was first
//! dispatched with, what its runs used, its last runs — is each task's `.state.dispatch`
//! (store), written durably when a hold or count changes and when a run stops (a hold before
//! it is acknowledged), read for every task before the first round and before any change to
//! a task. The live runs are rebuilt from the workers: a resumed session reports the runs it
//! still has and the coordinator adopts them; a lease of a resumed session whose run the
//! worker no longer has ends (`run_lost`) and its task is offered again (see
//! [`Coordinator::resumed_runs`]); a `stopped` for a run the coordinator does not know is
//! applied to its lease all the same.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use automaton_proto::v1 as pb;
use automaton_store::{DispatchRecord, RunRecord};
use automaton_workflow::{AgentId, Artifact, State, TaskName};
use tokio::sync::{Notify, watch};
use tracing::Instrument as _;

use crate::Error;
use crate::state::Coordinator;
use automaton_engine::Live;
use automaton_engine::Presented;

/// Decisions of one round carried out at once.
const ROUND_CONCURRENCY: usize = 64;

/// A decision of a round, carried out after the round has decided them all.
struct Planned {
    task: TaskName,
    from: State,
    work: State,
    slot: Slot,
    need: Option<u64>,
    /// When the round found the work (the dispatch latency runs from here).
    found: Instant,
}

/// A round runs at least this often (the offer timeouts, a worker back from a refusal).
const ROUND_EVERY: Duration = Duration::from_millis(250);
/// Rounds start at most this often, however often they are poked.
const ROUND_GAP: Duration = Duration::from_millis(5);
/// An offer the worker has not answered in this long is taken back.
pub(crate) const OFFER_TIMEOUT: Duration = Duration::from_secs(10);
/// A worker that refused work is not offered more for this long.
const REFUSAL_PAUSE: Duration = Duration::from_secs(1);
/// Runs kept per task.
const RUNS_KEPT: usize = 10;
/// The most of a run's output tail kept in memory (what a worker sends at most).
const TAIL_KEPT: usize = 16 * 1024;
/// A run's warnings kept, and the length of each.
const WARNINGS_KEPT: usize = 4;
const WARNING_BYTES: usize = 400;
/// After a failed run its task waits this long before it is offered again, doubled with
/// each further failure of the same phase, up to `RETRY_MAX_PAUSE`.
const RETRY_FIRST_PAUSE: Duration = Duration::from_secs(1);
const RETRY_MAX_PAUSE: Duration = Duration::from_secs(30);
/// How an operator's hold begins (`automaton stop`).
const STOPPED_BY: &str = "stopped by an operator";

/// Whether a hold waits for a person's decision (a limit's, failed runs', MAX_PHASE_TIME's:
/// durable and not an operator's own stop), shown with seed 002's line.
fn awaits_a_person(why: &str, durable: bool) -> bool {
    durable && !why.starts_with(STOPPED_BY)
}

/// Why a task with work waits in manual mode.
fn manual_waiting(task: &TaskName, work: State) -> String {
    format!("manual mode (Autopilot: Disabled): `automaton run {task}` runs its {work}")
}

/// Manual mode: the command that moves a task in `state` on next, if any (`held`: it is held
/// from dispatch; `running`: it has a live lease or a run asked for).
pub(crate) fn next_command(task: &TaskName, state: State, held: bool, running: bool) -> String {
    use automaton_workflow::{Gate, Phase};
    if held {
        return format!("automaton stop {task} --resume");
    }
    if running || state.phase.is_terminal() {
        return String::new();
    }
    match (state.phase, state.gate) {
        (_, Gate::AwaitingApproval) => format!("automaton approve {task}"),
        // Its sub-tasks run, each on its own.
        (Phase::Decomposition, Gate::Approved) => String::new(),
        _ => format!("automaton run {task}"),
    }
}

/// The last `max` bytes of `s` at most (from a character boundary): an output's tail.
fn clip_front(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

/// The pause before a task whose phase failed `n` times (n ≥ 1) is offered again.
pub(crate) fn retry_pause(n: u32) -> Duration {
    RETRY_FIRST_PAUSE
        .saturating_mul(1u32 << n.saturating_sub(1).min(16))
        .min(RETRY_MAX_PAUSE)
}

/// `s` cut to at most `max` bytes (on a character boundary), marked when cut.
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

/// An idle worker: a live, attached, undrained session with room for more leases.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub session: Arc<str>,
    pub name: AgentId,
    pub free: usize,
    pub capacity: u32,
    /// The largest estimated peak context (tokens) the worker takes.
    pub budget: u64,
    /// Its GPU memory, for people (`24 GiB`).
    pub gpu: String,
}

struct Offer {
    task: TaskName,
    name: AgentId,
    session: Arc<str>,
    at: Instant,
}

/// Why a task is not dispatched; `durable`: kept across restarts (an operator's stop, the
/// limits). The others (an unreadable file, an illegal move) are found again by a round.
#[derive(Clone)]
struct Hold {
    why: String,
    durable: bool,
}

#[derive(Default)]
struct Inner {
    /// Every task the coordinator knows, with when it was created (oldest first wins).
    tasks: HashMap<TaskName, SystemTime>,
    seeded: bool,
    /// Tasks whose `.state.dispatch` was read (or that were made by this coordinator).
    loaded: HashSet<TaskName>,
    /// Tasks not to dispatch, with why.
    held: HashMap<TaskName, Hold>,
    /// Failed runs per task and state.
    failures: HashMap<(TaskName, State), u32>,
    /// Offers not answered yet, by lease id.
    offers: HashMap<String, Offer>,
    /// Recent runs per task, oldest first.
    runs: HashMap<TaskName, VecDeque<pb::Run>>,
    /// Workers that refused work lately.
    paused: HashMap<AgentId, Instant>,
    /// Why each task with work waits (as of the last round).
    waiting: HashMap<TaskName, String>,
    /// Decomposed parents' plans, as last read.
    plans: HashMap<TaskName, crate::waves::Plan>,
    /// Sub-tasks reported orphaned.
    orphans: std::collections::HashSet<TaskName>,
    /// (estimate, reported peak) of completed sub-task runs, and their sums per task.
    samples: Vec<(u64, u64)>,
    sized: HashMap<TaskName, (u64, u64)>,
    /// The need a sub-task was first dispatched with: corrections apply only to sub-tasks
    /// not yet dispatched.
    fixed: HashMap<TaskName, u64>,
    /// Each sub-task's wave, for listings.
    waves: HashMap<TaskName, (usize, u64)>,
    /// Phases completed per task (seed 002's iterations) and when its first run was offered.
    iterations: HashMap<TaskName, u32>,
    first_offered: HashMap<TaskName, (Instant, SystemTime)>,
    /// Terminal tasks already looked at (follow-ups made in manual mode).
    settled: std::collections::HashSet<TaskName>,
    /// Manual mode: tasks an operator asked to run (`automaton run`), with who asked; each
    /// runs one phase, then waits for the next request.
    requested: HashMap<TaskName, String>,
    /// Tasks whose last run failed: not offered again before the instant (a backoff), and
    /// then to another fitting worker before the one that failed it.
    /// When, also as wall-clock milliseconds (what `.state.dispatch` keeps).
    retry: HashMap<TaskName, (Instant, AgentId, u64)>,
}

pub(crate) struct Work {
    inner: Mutex<Inner>,
    /// Per task: its `.state.dispatch` as last written, held while it is written (one write
    /// of a task at a time, the latest state each time).
    saved: Mutex<HashMap<TaskName, Arc<tokio::sync::Mutex<Option<DispatchRecord>>>>>,
    pub(crate) wake: Notify,
    pub(crate) max_phase_time: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) max_artifact_bytes: u64,
    /// Seed 002's loop limits: completed runs per task, and time from its first run.
    pub(crate) max_iterations: u32,
    pub(crate) max_total_time: Duration,
}

impl Work {
    pub(crate) fn new(o: &crate::Options) -> Work {
        Work {
            inner: Mutex::default(),
            saved: Mutex::default(),
            wake: Notify::new(),
            max_phase_time: o.max_phase_time,
            max_attempts: o.max_attempts.max(1),
            max_artifact_bytes: o.max_artifact_bytes,
            max_iterations: o.max_iterations.max(1),
            max_total_time: o.max_total_time,
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Something changed: run a round soon.
    pub(crate) fn poke(&self) {
        self.wake.notify_one();
    }

    pub(crate) fn task_created(&self, task: &TaskName) {
        let mut inner = self.inner();
        inner
            .tasks
            .entry(task.clone())
            .or_insert_with(SystemTime::now);
        // A new task has no record to read.
        inner.loaded.insert(task.clone());
        drop(inner);
        self.poke();
    }

    pub(crate) fn plan(&self, parent: &TaskName) -> Option<crate::waves::Plan> {
        self.inner().plans.get(parent).cloned()
    }

    pub(crate) fn set_plan(&self, parent: &TaskName, plan: crate::waves::Plan) {
        self.inner().plans.insert(parent.clone(), plan);
    }

    /// Whether `task` is newly known as orphaned.
    pub(crate) fn mark_orphan(&self, task: &TaskName) -> bool {
        self.inner().orphans.insert(task.clone())
    }

    /// The need of a sub-task estimated at `estimate` tokens: fixed once dispatched, else
    /// corrected by what runs reported.
    pub(crate) fn need_of(&self, task: &TaskName, estimate: u64) -> u64 {
        let inner = self.inner();
        if let Some(n) = inner.fixed.get(task) {
            return *n;
        }
        match crate::waves::ratio(&inner.samples) {
            Some(r) => ((estimate as f64) * r).ceil() as u64,
            None => estimate,
        }
    }

    /// Records a completed run's estimate and reported peak; the new ratio when it moved.
    pub(crate) fn learn(&self, task: &TaskName, estimate: u64, actual: u64) -> Option<f64> {
        let mut inner = self.inner();
        let before = crate::waves::ratio(&inner.samples);
        inner.samples.push((estimate, actual));
        let sums = inner.sized.entry(task.clone()).or_insert((0, 0));
        *sums = (
            sums.0.saturating_add(estimate),
            sums.1.saturating_add(actual),
        );
        let after = crate::waves::ratio(&inner.samples);
        (before.map(|b| (b * 100.0).round()) != after.map(|a| (a * 100.0).round()))
            .then_some(after)
            .flatten()
    }

    /// The learned ratio (Σ reported / Σ estimated), if any run reported.
    pub(crate) fn learned_ratio(&self) -> Option<f64> {
        crate::waves::ratio(&self.inner().samples)
    }

    /// A sub-task's wave and current estimate, as of the last dispatch round.
    pub(crate) fn wave_of(&self, task: &TaskName) -> Option<(usize, u64)> {
        self.inner().waves.get(task).copied()
    }

    /// Why `task` waits for a worker (as of the last dispatch round), if it does.
    pub(crate) fn waiting(&self, task: &TaskName) -> Option<String> {
        self.inner().waiting.get(task).cloned()
    }

    /// How many tasks wait (as of the last dispatch round) in each class `class` puts their
    /// reason in, and how many are held (`held`).
    pub(crate) fn waiting_classes(
        &self,
        class: fn(&str) -> &'static str,
    ) -> HashMap<&'static str, u64> {
        let inner = self.inner();
        let mut out: HashMap<&'static str, u64> = HashMap::new();
        for why in inner.waiting.values() {
            *out.entry(class(why)).or_insert(0) += 1;
        }
        if !inner.held.is_empty() {
            out.insert("held", inner.held.len() as u64);
        }
        out
    }

    /// Why `task` is held from dispatch, if it is.
    pub(crate) fn held(&self, task: &TaskName) -> Option<String> {
        self.inner().held.get(task).map(|h| h.why.clone())
    }

    /// Seed 002's line when a hold means a person must decide (a loop limit, MAX_PHASE_TIME,
    /// failed runs; not an operator's own stop).
    pub(crate) fn attention(&self, task: &TaskName) -> Option<String> {
        let inner = self.inner();
        let h = inner.held.get(task)?;
        awaits_a_person(&h.why, h.durable).then(|| automaton_store::human_intervention_line(&h.why))
    }

    /// Manual mode: whether an operator asked to run `task`'s next phase.
    pub(crate) fn requested(&self, task: &TaskName) -> bool {
        self.inner().requested.contains_key(task)
    }

    pub(crate) fn runs(&self, task: &TaskName) -> Vec<pb::Run> {
        self.inner()
            .runs
            .get(task)
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// `task`'s last failed run in one line: its stop reason and detail, and the last line
    /// of the agent's output (`agent_error: command not found: aider — sh: 1: aider: not
    /// found`).
    pub(crate) fn last_failure(&self, task: &TaskName) -> Option<String> {
        let inner = self.inner();
        let r = inner.runs.get(task)?.iter().rev().find(|r| {
            r.state == "stopped" && !r.stop_reason.is_empty() && r.stop_reason != "completed"
        })?;
        let mut line = r.stop_reason.clone();
        if !r.detail.is_empty() {
            line.push_str(&format!(": {}", r.detail));
        }
        if let Some(last) = r.output_tail.lines().rev().find(|l| !l.trim().is_empty()) {
            line.push_str(&format!(" — {}", clip(last.trim(), 160)));
        }
        Some(line)
    }

    /// The last run on `task` under fencing token `token`.
    pub(crate) fn run_of(&self, task: &TaskName, token: u64) -> Option<pb::Run> {
        self.inner()
            .runs
            .get(task)
            .and_then(|r| r.iter().rev().find(|r| r.token == token).cloned())
    }

    /// Offers not yet answered by `session`.
    fn offered_to(&self, session: &str) -> usize {
        self.inner()
            .offers
            .values()
            .filter(|o| &*o.session == session)
            .count()
    }

    /// A phase's work moved `task` on under its lease (seed 002's `iteration_count++`,
    /// counted when the artifact moves the task, whatever order the run's messages come in);
    /// in manual mode, the operator's `automaton run` is used up (whether one was).
    pub(crate) fn phase_done(&self, task: &TaskName) -> bool {
        let mut inner = self.inner();
        *inner.iterations.entry(task.clone()).or_insert(0) += 1;
        inner.requested.remove(task).is_some()
    }

    fn is_loaded(&self, task: &TaskName) -> bool {
        self.inner().loaded.contains(task)
    }

    /// `task`'s record as it would be written now.
    fn record_of(&self, task: &TaskName) -> DispatchRecord {
        let inner = self.inner();
        let mut failures: Vec<(State, u32)> = inner
            .failures
            .iter()
            .filter(|((t, _), _)| t == task)
            .map(|((_, s), n)| (*s, *n))
            .collect();
        failures.sort_by_key(|(s, _)| s.to_string());
        DispatchRecord {
            held: inner
                .held
                .get(task)
                .filter(|h| h.durable)
                .map(|h| h.why.clone()),
            failures,
            iterations: inner.iterations.get(task).copied().unwrap_or(0),
            first_offered_ms: inner.first_offered.get(task).map(|(_, at)| wall_ms(*at)),
            need: inner.fixed.get(task).copied(),
            sized: inner.sized.get(task).copied(),
            runs: inner
                .runs
                .get(task)
                .map(|r| r.iter().map(run_record).collect())
                .unwrap_or_default(),
            run_requested: inner.requested.get(task).cloned(),
            retry_until_ms: inner.retry.get(task).map(|(_, _, ms)| *ms),
            retry_after: inner.retry.get(task).map(|(_, w, _)| w.to_string()),
        }
    }

    /// Takes in `task`'s record as read at start (once; what this coordinator did to the task
    /// meanwhile wins). A record that cannot be read holds the task (it may say it was held):
    /// the reason is returned.
    /// `live`: the token of the task's live lease, if any (a run under any other token that
    /// the record shows as running has ended with the coordinator that knew it).
    fn take_in(
        &self,
        task: &TaskName,
        read: Result<Option<DispatchRecord>, String>,
        live: Option<u64>,
    ) -> Option<String> {
        let mut inner = self.inner();
        if !inner.loaded.insert(task.clone()) {
            return None;
        }
        let r = match read {
            Ok(Some(r)) => r,
            Ok(None) => return None,
            Err(e) => {
                let why = format!(
                    "cannot read its dispatch record: {e} Then `automaton stop {task} --resume`"
                );
                inner.held.insert(
                    task.clone(),
                    Hold {
                        why: why.clone(),
                        durable: false,
                    },
                );
                return Some(why);
            }
        };
        if let Some(why) = r.held {
            inner
                .held
                .entry(task.clone())
                .or_insert(Hold { why, durable: true });
        }
        for (state, n) in r.failures {
            let c = inner.failures.entry((task.clone(), state)).or_insert(0);
            *c = (*c).max(n);
        }
        let it = inner.iterations.entry(task.clone()).or_insert(0);
        *it = (*it).max(r.iterations);
        if let Some(ms) = r.first_offered_ms {
            let at = from_ms(ms);
            let age = SystemTime::now().duration_since(at).unwrap_or_default();
            let then = Instant::now().checked_sub(age).unwrap_or_else(Instant::now);
            inner
                .first_offered
                .entry(task.clone())
                .or_insert((then, at));
        }
        if let Some(n) = r.need {
            inner.fixed.entry(task.clone()).or_insert(n);
        }
        if let Some(by) = r.run_requested {
            inner.requested.entry(task.clone()).or_insert(by);
        }
        // A retry pause goes on across the restart, for what is left of it.
        if let (Some(ms), Some(w)) = (r.retry_until_ms, r.retry_after.as_deref())
            && let Ok(w) = w.parse::<AgentId>()
        {
            let left = from_ms(ms)
                .duration_since(SystemTime::now())
                .unwrap_or_default();
            let until = Instant::now()
                .checked_add(left)
                .unwrap_or_else(|| Instant::now() + RETRY_MAX_PAUSE);
            inner.retry.entry(task.clone()).or_insert((until, w, ms));
        }
        if let Some((e, a)) = r.sized
            && !inner.sized.contains_key(task)
        {
            inner.sized.insert(task.clone(), (e, a));
            inner.samples.push((e, a));
        }
        // The runs read go before those this coordinator has recorded since its start.
        let known = inner.runs.remove(task).unwrap_or_default();
        let mut runs: VecDeque<pb::Run> = r
            .runs
            .iter()
            .filter(|old| !known.iter().any(|k| k.token == old.token))
            .map(|old| {
                let mut run = run_pb(old);
                if run.state != "stopped" && live != Some(run.token) {
                    run.state = "stopped".into();
                    run.stop_reason = "run_lost".into();
                    run.detail = "the coordinator restarted and its lease did not survive".into();
                }
                run
            })
            .collect();
        runs.extend(known);
        while runs.len() > RUNS_KEPT {
            runs.pop_front();
        }
        if !runs.is_empty() {
            inner.runs.insert(task.clone(), runs);
        }
        None
    }

    /// The slot that serialises `task`'s record writes.
    fn save_slot(&self, task: &TaskName) -> Arc<tokio::sync::Mutex<Option<DispatchRecord>>> {
        self.saved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(task.clone())
            .or_default()
            .clone()
    }
}

fn wall_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn from_ms(ms: u64) -> SystemTime {
    automaton_store::clamp_time(
        SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_millis(ms))
            .unwrap_or(SystemTime::UNIX_EPOCH),
    )
}

fn ts_ms(t: &Option<automaton_proto::prost_types::Timestamp>) -> Option<u64> {
    t.as_ref()
        .and_then(|t| SystemTime::try_from(*t).ok())
        .map(wall_ms)
}

fn run_record(r: &pb::Run) -> RunRecord {
    RunRecord {
        worker: r.worker.clone(),
        phase: r.phase.clone(),
        token: r.token,
        state: r.state.clone(),
        stop_reason: r.stop_reason.clone(),
        detail: r.detail.clone(),
        exit_code: r.exit_code,
        started_ms: ts_ms(&r.started_at),
        ended_ms: ts_ms(&r.ended_at),
        estimated_tokens: r.estimated_tokens,
        peak_context_tokens: r.peak_context_tokens,
        why: r.why.clone(),
        peak_context_source: r.peak_context_source.clone(),
        // Durably only the end of it: ten runs stay far below the record's cap.
        output_tail: clip_front(&r.output_tail, automaton_store::MAX_TAIL_KEPT),
        warnings: r.warnings.clone(),
        trace_id: r.trace_id.clone(),
    }
}

/// A run read from a record; its texts bounded as a worker's report is.
fn run_pb(r: &RunRecord) -> pb::Run {
    pb::Run {
        worker: clip(&r.worker, 256),
        phase: clip(&r.phase, 64),
        token: r.token,
        state: clip(&r.state, 16),
        stop_reason: clip(&r.stop_reason, 400),
        detail: clip(&r.detail, 400),
        exit_code: r.exit_code,
        started_at: r
            .started_ms
            .map(|ms| crate::service::timestamp(from_ms(ms))),
        ended_at: r.ended_ms.map(|ms| crate::service::timestamp(from_ms(ms))),
        estimated_tokens: r.estimated_tokens,
        peak_context_tokens: r.peak_context_tokens,
        why: clip(&r.why, 400),
        peak_context_source: clip(&r.peak_context_source, 40),
        output_tail: clip_front(&r.output_tail, automaton_store::MAX_TAIL_KEPT),
        warnings: r
            .warnings
            .iter()
            .take(WARNINGS_KEPT)
            .map(|w| clip(w, WARNING_BYTES))
            .collect(),
        trace_id: clip(&r.trace_id, 32),
    }
}

/// The dispatcher's one decision: which of the idle workers should get a phase whose work
/// needs `need` tokens of context (its estimated peak; `None`: unsized), in order of
/// preference (the grant may still refuse one, e.g. reviewer ≠ implementer). Only workers
/// whose budget holds the need; **best fit**: the smallest budget that holds it first, so
/// large GPUs stay free for large work; then the most free room, then by name.
pub(crate) fn choose(need: Option<u64>, idle: &[Slot]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..idle.len())
        .filter(|&i| idle[i].free > 0 && need.is_none_or(|n| idle[i].budget >= n))
        .collect();
    order.sort_by(|&a, &b| {
        let fit = match need {
            Some(_) => idle[a].budget.cmp(&idle[b].budget),
            None => std::cmp::Ordering::Equal,
        };
        fit.then_with(|| idle[b].free.cmp(&idle[a].free))
            .then_with(|| idle[a].name.cmp(&idle[b].name))
    });
    order
}

/// Why a phase needing `need` tokens waits, given the idle workers and the fleet's largest
/// budget: e.g. `needs 90k tokens; largest idle worker holds 38k (gpu-b, 24 GiB)`.
pub(crate) fn waiting_reason(
    need: Option<u64>,
    idle: &[Slot],
    largest: Option<&(u64, AgentId, String)>,
) -> String {
    let k = |t: u64| format!("{}k", t / 1000);
    match (need, largest) {
        (_, None) => "waiting: no worker that takes work is connected".into(),
        (Some(n), Some((max, who, gpu))) if *max < n => format!(
            "waiting: needs {} tokens; the largest worker holds {} ({who}, {gpu}): no worker fits — split it",
            k(n),
            k(*max)
        ),
        (Some(n), Some(_)) => match idle.iter().filter(|s| s.free > 0).max_by_key(|s| s.budget) {
            Some(s) => format!(
                "waiting: needs {} tokens; largest idle worker holds {} ({}, {})",
                k(n),
                k(s.budget),
                s.name,
                s.gpu
            ),
            None => format!(
                "waiting: needs {} tokens; every worker that fits is busy",
                k(n)
            ),
        },
        (None, Some(_)) => "waiting: every worker is busy".into(),
    }
}

impl Coordinator {
    /// Runs dispatch rounds until `stop` turns true.
    pub(crate) fn spawn_dispatcher(self: &Arc<Self>, mut stop: watch::Receiver<bool>) {
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                let started = tokio::time::Instant::now();
                if let Err(e) = me.dispatch_round().await {
                    tracing::warn!(error = %e, "dispatch round failed");
                }
                tokio::select! {
                    _ = me.work.wake.notified() => {}
                    _ = tokio::time::sleep(ROUND_EVERY) => {}
                    _ = stop.changed() => return,
                }
                // A round walks every task: pokes that come faster than this (a burst of
                // releases with workers connected) are served together by the next one.
                tokio::time::sleep_until(started + ROUND_GAP).await;
            }
        });
    }

    /// Every task, once (the store's list, off the async threads), with its dispatch record:
    /// no task is offered before its holds are known.
    async fn seed_tasks(&self) -> Result<(), Error> {
        if self.work.inner().seeded {
            return Ok(());
        }
        let now = SystemTime::now();
        type Found = (
            TaskName,
            SystemTime,
            Result<Option<DispatchRecord>, automaton_store::Error>,
        );
        let found: Vec<Found> = self
            .engine
            .read(move |p| {
                let mut out = Vec::new();
                for e in p.list(now)? {
                    for row in e.rows() {
                        let age = p.task_age(&row.task, now).unwrap_or_default();
                        let record = p.read_dispatch(&row.task);
                        out.push((row.task.clone(), now - age, record));
                    }
                }
                Ok(out)
            })
            .await?;
        for (t, created, record) in found {
            self.take_in(&t, record.map_err(|e| e.to_string()));
            self.work.inner().tasks.entry(t).or_insert(created);
        }
        self.work.inner().seeded = true;
        Ok(())
    }

    /// Takes in a record read for `task` (see [`Work::take_in`]); a hold it causes is an event.
    fn take_in(&self, task: &TaskName, read: Result<Option<DispatchRecord>, String>) {
        let live = self.engine.live_of(task).map(|l| l.token);
        if let Some(why) = self.work.take_in(task, read, live) {
            tracing::warn!(task = %task, why = %why, "task held from dispatch");
            self.engine.emit("task_held", &task.to_string(), "", 0, why);
        }
    }

    /// Reads `task`'s dispatch record if this coordinator has not yet (before any change to
    /// its holds, counts or runs).
    pub(crate) async fn load_dispatch(&self, task: &TaskName) {
        if self.work.is_loaded(task) {
            return;
        }
        let t = task.clone();
        let read = self.engine.read(move |p| p.read_dispatch(&t)).await;
        self.take_in(task, read.map_err(|e| e.to_string()));
    }

    /// Makes `task`'s dispatch record durable as it stands now: once this returns, every
    /// change made before the call is on disk. Writes of one task go one at a time, each the
    /// latest state (a write that finds its change written already is skipped). It runs on
    /// its own task: a caller that goes away cannot leave two writes of one file racing.
    pub(crate) async fn save_dispatch(&self, task: &TaskName) -> Result<(), Error> {
        let Some(me) = self.me.upgrade() else {
            return Err(Error::Unavailable("the coordinator is stopping".into()));
        };
        let task = task.clone();
        tokio::spawn(async move {
            let slot = me.work.save_slot(&task);
            let mut written = slot.lock().await;
            let record = me.work.record_of(&task);
            if written.as_ref() == Some(&record) {
                return Ok(());
            }
            let (t, r) = (task.clone(), record.clone());
            me.engine.read(move |p| p.write_dispatch(&t, &r)).await?;
            *written = Some(record);
            Ok(())
        })
        .await
        .map_err(|e| Error::Internal(format!("writing a dispatch record failed: {e}")))?
    }

    /// The idle workers now.
    fn idle_slots(&self) -> Vec<Slot> {
        let now = Instant::now();
        let mut slots = self.sessions.slots(&self.engine.table(), now);
        {
            let mut inner = self.work.inner();
            inner.paused.retain(|_, until| *until > now);
            slots.retain(|s| !inner.paused.contains_key(&s.name));
        }
        for s in &mut slots {
            s.free = s.free.saturating_sub(self.work.offered_to(&s.session));
        }
        slots.retain(|s| s.free > 0);
        slots
    }

    /// One round: start new tasks, move approved gates on, offer work to idle workers, take
    /// back offers nobody answered.
    pub(crate) async fn dispatch_round(self: &Arc<Self>) -> Result<(), Error> {
        self.seed_tasks().await?;
        self.take_back_stale_offers().await;
        let deciding = Instant::now();
        let mut tasks: Vec<(SystemTime, TaskName)> = {
            let inner = self.work.inner();
            inner
                .tasks
                .iter()
                .filter(|(t, _)| !inner.held.contains_key(*t))
                .map(|(t, c)| (*c, t.clone()))
                .collect()
        };
        tasks.sort();
        let mut idle = self.idle_slots();
        let largest = self.sessions.largest_budget();
        let mut waiting: HashMap<TaskName, String> = HashMap::new();
        let mut plans: Vec<Planned> = Vec::new();
        let mut parents: Vec<TaskName> = Vec::new();
        for (_, task) in tasks {
            if self.engine.live_of(&task).is_some() {
                continue;
            }
            let state = match self.state_now(&task).await {
                Ok(s) => s,
                Err(e) => {
                    self.hold(&task, format!("cannot be read: {e}"));
                    continue;
                }
            };
            if state.phase.is_terminal() {
                self.settle(&task, state).await;
                continue;
            }
            // Seed 002's loop limits: a hold kept across restarts.
            if let Some(why) = self.over_limits(&task) {
                if self.hold_as(&task, why, true)
                    && let Err(e) = self.save_dispatch(&task).await
                {
                    tracing::warn!(task = %task, error = %e, "cannot make a hold durable");
                }
                continue;
            }
            // A failed run's task waits out its pause before it is offered again.
            let retry = self.work.inner().retry.get(&task).cloned();
            if let Some((until, _, _)) = &retry
                && *until > Instant::now()
            {
                let left = until.saturating_duration_since(Instant::now());
                waiting.insert(
                    task.clone(),
                    format!(
                        "waiting: offered again in {:.1}s, after a failed run",
                        left.as_secs_f64()
                    ),
                );
                continue;
            }
            // A decomposed parent: its sub-tasks are made, and it ends when they have. Each
            // parent's lock is its own: they are advanced together with the round's work.
            if state == State::approved(automaton_workflow::Phase::Decomposition) {
                parents.push(task);
                continue;
            }
            // Where the work is: the state itself, or the phase a start or an approved gate
            // leads to (moved there only when a worker is about to take it).
            let work = match self.next_work(&task, state).await {
                Ok(Some(w)) => w,
                Ok(None) => continue,
                Err(e) => {
                    self.hold(&task, e.to_string());
                    continue;
                }
            };
            // Manual mode (seed 002): nothing runs on its own; an operator runs each phase.
            if !self.engine.policy().autopilot && !self.work.requested(&task) {
                waiting.insert(task.clone(), manual_waiting(&task, work));
                continue;
            }
            // A sub-task waits for its wave, and needs a worker whose budget holds it.
            let sizing = self.sizing(&task, work).await;
            if let Some(w) = sizing.wave {
                self.work
                    .inner()
                    .waves
                    .insert(task.clone(), (w, sizing.need.unwrap_or(0)));
            }
            if let Some(why) = sizing.blocked {
                waiting.insert(task.clone(), why);
                continue;
            }
            // The implementer never gets a separated phase (the grant refuses it too; leaving
            // it out here lets the round give the phase to someone else at once).
            let excluded = if self.engine.policy().separated.contains(&work.phase) {
                self.implementers_now(&task).await
            } else {
                Vec::new()
            };
            let mut order: Vec<usize> = choose(sizing.need, &idle)
                .into_iter()
                .filter(|&i| !excluded.contains(&idle[i].name))
                .collect();
            // The worker whose run just failed is tried last (a stable sort keeps the rest
            // in their order of preference).
            if let Some((_, failed, _)) = &retry {
                order.sort_by_key(|&i| &idle[i].name == failed);
            }
            let Some(&first) = order.first() else {
                let reason = if excluded.is_empty() {
                    waiting_reason(sizing.need, &idle, largest.as_ref())
                } else {
                    let fits: Vec<usize> = choose(sizing.need, &idle);
                    if fits.is_empty() {
                        waiting_reason(sizing.need, &idle, largest.as_ref())
                    } else {
                        format!(
                            "waiting: the only idle worker that fits implemented it ({}): reviewer ≠ implementer",
                            excluded
                                .iter()
                                .map(AgentId::as_str)
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    }
                };
                waiting.insert(task.clone(), reason);
                continue;
            };
            idle[first].free -= 1;
            plans.push(Planned {
                task: task.clone(),
                from: state,
                work,
                slot: idle[first].clone(),
                need: sizing.need,
                found: Instant::now(),
            });
            idle.retain(|s| s.free > 0);
        }
        self.metrics
            .decided(plans.len() + waiting.len(), deciding.elapsed());
        // Carried out concurrently: each is a move and a grant with their own disk writes,
        // and the log's group commit syncs concurrent grants together.
        let mut running = tokio::task::JoinSet::new();
        for parent in parents {
            let me = self.clone();
            running.spawn(async move {
                if let Err(e) = me.advance_parent(&parent).await {
                    me.hold(&parent, e.to_string());
                }
            });
        }
        let permits = Arc::new(tokio::sync::Semaphore::new(ROUND_CONCURRENCY));
        for p in plans {
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let me = self.clone();
            running.spawn(async move {
                me.carry_out(p).await;
                drop(permit);
            });
        }
        while running.join_next().await.is_some() {}
        self.work.inner().waiting = waiting;
        Ok(())
    }

    /// Every worker that implemented `task` (its file and what the log knows).
    async fn implementers_now(&self, task: &TaskName) -> Vec<AgentId> {
        let t = task.clone();
        let mut v = self
            .engine
            .read(move |p| p.implementers_of(&t))
            .await
            .unwrap_or_default();
        self.engine.implementers(task, &mut v);
        v
    }

    /// One decision of a round: move the task on if needed, grant and send the assignment.
    /// Its span is the root of the phase run's trace and carries the decision (task, phase,
    /// worker, its GPU and budget, the need, the lease and why); the move, the grant and —
    /// through the assignment's `traceparent` — the worker's run are its children.
    #[tracing::instrument(
        name = "assign",
        skip_all,
        fields(
            automaton.task = %p.task,
            automaton.phase = %p.work,
            automaton.worker = %p.slot.name,
            automaton.agent = %p.slot.name,
            automaton.gpu = %p.slot.gpu,
            automaton.budget_tokens = p.slot.budget,
            automaton.need_tokens = p.need.unwrap_or(0),
            automaton.lease_id = tracing::field::Empty,
            automaton.token = tracing::field::Empty,
            automaton.attempt = tracing::field::Empty,
            automaton.why = tracing::field::Empty,
            automaton.outcome = tracing::field::Empty,
        )
    )]
    async fn carry_out(self: &Arc<Self>, p: Planned) {
        if p.work != p.from && !self.move_on(&p.task, p.from, p.work).await {
            tracing::Span::current().record(
                "automaton.outcome",
                format!("not moved {} → {}: nothing offered", p.from, p.work),
            );
            return;
        }
        match self.offer(&p.task, p.work, &p.slot, p.need, p.found).await {
            Ok(_) => {}
            Err(e) => {
                automaton_telemetry::trace::record_error(&tracing::Span::current(), &e.to_string());
                tracing::warn!(task = %p.task, worker = %p.slot.name, error = %e, "cannot offer work")
            }
        }
    }

    /// The task's state as the coordinator knows it (read once from `.state`).
    async fn state_now(&self, task: &TaskName) -> Result<State, Error> {
        if let Some(s) = self.engine.states().get(task) {
            return Ok(*s);
        }
        let _guard = self.engine.guard(task).await;
        self.engine.touch(task).await
    }

    /// The state whose work a worker would do next on `task`: an open phase with a
    /// deliverable as it is; `new` → `research`; an approved gate → the phase its artifact
    /// declares (`Next:`) or the default path. `None`: nothing to do (awaiting approval,
    /// terminal, an approved decomposition waiting for its sub-tasks).
    async fn next_work(&self, task: &TaskName, state: State) -> Result<Option<State>, Error> {
        use automaton_workflow::{Gate, Phase};
        if automaton_workflow::progress::has_work(state) {
            return Ok(Some(state));
        }
        match (state.phase, state.gate) {
            (Phase::New, _) => Ok(Some(State::open(Phase::Research))),
            (p, Gate::Approved) => {
                let text = match p.artifact() {
                    // Through the store: never a link, a FIFO or a file without end.
                    Some(a) => {
                        let t = task.clone();
                        self.engine
                            .read(move |p| p.read_artifact_text(&t, a))
                            .await?
                    }
                    None => None,
                };
                automaton_workflow::progress::after_approval(state, text.as_deref())
                    .map_err(|bad| Error::Refused(bad.to_string()))
            }
            _ => Ok(None),
        }
    }

    /// Moves `task` from `state` to `target` where no agent is needed (a start, an approved
    /// gate). Whether it moved (someone else may have moved it meanwhile).
    async fn move_on(self: &Arc<Self>, task: &TaskName, state: State, target: State) -> bool {
        match self
            .engine
            .transition(task, target, &Presented::default())
            .await
        {
            Ok(_) => {
                self.engine.emit(
                    "dispatched",
                    &task.to_string(),
                    "",
                    0,
                    format!("{state} → {target} (no agent needed)"),
                );
                true
            }
            // The lifecycle refuses the move (an artifact out of order, say): nothing a retry
            // can cure, so the task is held with the reason, for a person to see.
            Err(Error::Store(e)) if e.kind() == automaton_store::ErrorKind::Refused => {
                self.hold(task, format!("cannot move {state} → {target}: {e}"));
                false
            }
            Err(e) => {
                tracing::debug!(task = %task, error = %e, "could not move the task on");
                false
            }
        }
    }

    /// Grants `task` to the worker of `slot` in its session and sends the assignment, in the
    /// decision's span (see `carry_out`). `Ok(false)`: the grant was refused for this worker.
    async fn offer(
        &self,
        task: &TaskName,
        state: State,
        slot: &Slot,
        need: Option<u64>,
        found: Instant,
    ) -> Result<bool, Error> {
        let span = tracing::Span::current();
        let grant = tracing::info_span!(
            "lease.grant",
            automaton.task = %task,
            automaton.phase = %state,
            automaton.agent = %slot.name,
            automaton.worker = %slot.name,
            automaton.lease_id = tracing::field::Empty,
            automaton.token = tracing::field::Empty,
            automaton.ttl_ms = tracing::field::Empty,
        );
        let claimed = self
            .engine
            .claim_in(task, &slot.name, None, Some(&slot.session))
            .instrument(grant.clone())
            .await;
        match &claimed {
            Ok(g) => {
                grant.record("automaton.lease_id", g.live.lease_id.as_str());
                grant.record("automaton.token", g.live.token);
                grant.record("automaton.ttl_ms", g.live.ttl.as_millis() as u64);
            }
            Err(e) => automaton_telemetry::trace::record_error(&grant, &e.to_string()),
        }
        drop(grant);
        let granted = match claimed {
            Ok(g) if !g.renewed => g,
            // It holds the task already (an offer in flight): nothing new to send.
            Ok(_) => {
                span.record("automaton.outcome", "held already");
                return Ok(false);
            }
            Err(Error::Store(e)) if e.kind() == automaton_store::ErrorKind::Refused => {
                tracing::debug!(task = %task, worker = %slot.name, reason = %e, "not this worker");
                span.record("automaton.outcome", "refused: try the next worker");
                return Ok(false);
            }
            Err(Error::Refused(_)) => {
                span.record("automaton.outcome", "refused: try the next worker");
                return Ok(false);
            }
            Err(e) => {
                // The caller records the error on the span.
                return Err(e);
            }
        };
        let attempt = self
            .work
            .inner()
            .failures
            .get(&(task.clone(), state))
            .copied()
            .unwrap_or(0)
            + 1;
        let why = match need {
            Some(n) => format!(
                "best fit: needs {}k tokens; {} holds {}k ({}), the smallest idle budget that does",
                n / 1000,
                slot.name,
                slot.budget / 1000,
                slot.gpu
            ),
            None => format!(
                "oldest waiting task; {} is idle ({} of {} slots free)",
                slot.name,
                // The round counted this assignment already.
                slot.free + 1,
                slot.capacity
            ),
        };
        let live = granted.live;
        if let Some(n) = need
            && task.parent().is_some()
        {
            self.work.inner().fixed.entry(task.clone()).or_insert(n);
        }
        self.work
            .inner()
            .first_offered
            .entry(task.clone())
            .or_insert_with(|| (Instant::now(), SystemTime::now()));
        self.work.inner().offers.insert(
            live.lease_id.clone(),
            Offer {
                task: task.clone(),
                name: slot.name.clone(),
                session: slot.session.clone(),
                at: Instant::now(),
            },
        );
        self.record_run(task, &slot.name, state, live.token, "requested", "", "", -1);
        if let Some(r) = self
            .work
            .inner()
            .runs
            .get_mut(task)
            .and_then(|r| r.iter_mut().rev().find(|r| r.token == live.token))
        {
            r.estimated_tokens = need.unwrap_or(0);
            r.why = why.clone();
            r.trace_id = automaton_telemetry::trace::trace_id(&span).unwrap_or_default();
        }
        span.record("automaton.lease_id", live.lease_id.as_str());
        span.record("automaton.token", live.token);
        span.record("automaton.attempt", attempt);
        span.record("automaton.why", why.as_str());
        span.record("automaton.outcome", "offered");
        let trace = automaton_telemetry::trace::traceparent(&span);
        self.sessions.push(
            &slot.session,
            pb::coordinator_message::Msg::Assign(pb::Assignment {
                task: task.to_string(),
                phase: state.to_string(),
                lease: Some(crate::service::lease_pb(&live, false)),
                artifact: state
                    .phase
                    .artifact()
                    .map(|a| a.file_name().to_string())
                    .unwrap_or_default(),
                can_edit: state.phase.allows_code_edits(),
                require_code_change: self.engine.policy().require_code_change,
                max_phase_time: Some(crate::service::duration(self.work.max_phase_time)),
                attempt,
                why: why.clone(),
                estimated_tokens: need.unwrap_or(0),
                traceparent: trace.traceparent,
                tracestate: trace.tracestate,
            }),
        );
        self.metrics.assigned(state.phase, found.elapsed());
        tracing::info!(task = %task, worker = %slot.name, token = live.token, phase = %state, why = %why, "assigned");
        self.engine.emit(
            "assigned",
            &task.to_string(),
            slot.name.as_str(),
            live.token,
            format!("{state} (attempt {attempt}): {why}"),
        );
        Ok(true)
    }

    /// Offers nobody answered in time: their leases are released and the tasks offered again.
    async fn take_back_stale_offers(&self) {
        let now = Instant::now();
        let stale: Vec<String> = self
            .work
            .inner()
            .offers
            .iter()
            .filter(|(_, o)| now.duration_since(o.at) > OFFER_TIMEOUT)
            .map(|(id, _)| id.clone())
            .collect();
        for id in stale {
            let taken = self.work.inner().offers.remove(&id);
            if let Some(o) = taken {
                tracing::warn!(task = %o.task, worker = %o.name, "offer not answered in time: taken back");
                if let Some(l) = self.engine.live_of(&o.task).filter(|l| l.lease_id == id) {
                    self.record_run(
                        &o.task,
                        &o.name,
                        l.state,
                        l.token,
                        "stopped",
                        "no answer",
                        "",
                        -1,
                    );
                }
                let _ = self.engine.release(&id, None, None).await;
            }
        }
    }

    /// A worker's answer to an offer.
    pub(crate) async fn answered(&self, worker: &AgentId, a: pb::AssignmentAnswer) {
        let offer = {
            let mut inner = self.work.inner();
            match inner.offers.get(&a.lease_id) {
                Some(o) if &o.name == worker => inner.offers.remove(&a.lease_id),
                _ => None,
            }
        };
        let Some(o) = offer else {
            return;
        };
        self.metrics.answered(a.accepted, o.at.elapsed());
        if a.accepted {
            return;
        }
        tracing::info!(task = %o.task, worker = %worker, reason = %a.reason, "offer refused");
        if let Some(l) = self
            .engine
            .live_of(&o.task)
            .filter(|l| l.lease_id == a.lease_id)
        {
            let reason = format!("refused: {}", automaton_workflow::excerpt(&a.reason));
            self.record_run(
                &o.task, worker, l.state, l.token, "stopped", &reason, "", -1,
            );
        }
        self.work
            .inner()
            .paused
            .insert(worker.clone(), Instant::now() + REFUSAL_PAUSE);
        let _ = self.engine.release(&a.lease_id, None, Some(worker)).await;
        self.work.poke();
    }

    /// Records a run's step (for `status --task` and `workers`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn record_run(
        &self,
        task: &TaskName,
        worker: &AgentId,
        state: State,
        token: u64,
        run_state: &str,
        reason: &str,
        detail: &str,
        exit_code: i32,
    ) {
        let now = Some(crate::service::timestamp(SystemTime::now()));
        let mut inner = self.work.inner();
        let runs = inner.runs.entry(task.clone()).or_default();
        match runs.iter_mut().rev().find(|r| r.token == token) {
            Some(r) => {
                r.state = run_state.into();
                r.stop_reason = reason.into();
                r.detail = detail.into();
                r.exit_code = exit_code;
                if run_state == "stopped" {
                    r.ended_at = now;
                }
            }
            None => {
                runs.push_back(pb::Run {
                    worker: worker.to_string(),
                    phase: state.to_string(),
                    token,
                    state: run_state.into(),
                    stop_reason: reason.into(),
                    detail: detail.into(),
                    exit_code,
                    started_at: now,
                    ended_at: None,
                    estimated_tokens: 0,
                    peak_context_tokens: 0,
                    why: String::new(),
                    peak_context_source: String::new(),
                    trace_id: String::new(),
                    output_tail: String::new(),
                    warnings: Vec::new(),
                });
                while runs.len() > RUNS_KEPT {
                    runs.pop_front();
                }
            }
        }
    }

    /// A run update from `worker`'s session `session`. A run that stopped without completing
    /// releases its lease (if it still stands) and counts against the phase; too many, and the
    /// task is held. A run this coordinator does not know (it restarted, and the worker did not
    /// report the run when it resumed) is adopted if its lease is this worker's, in this
    /// session, with this token: its `stopped` then ends the lease as any other.
    pub(crate) async fn run_update(&self, worker: &AgentId, session: &str, u: pb::RunUpdate) {
        let Ok(task) = u.task.parse::<TaskName>() else {
            return;
        };
        let Ok(state) = u.phase.parse::<State>() else {
            return;
        };
        self.load_dispatch(&task).await;
        // Only runs under a lease this worker was granted.
        match self.work.run_of(&task, u.token) {
            Some(r) if r.worker != worker.as_str() => return,
            // A stop is reported once: a repeat changes nothing, nor does a step after it (a
            // `run_lost` the coordinator guessed gives way to the worker's own stop).
            Some(r)
                if r.state == "stopped"
                    && (r.stop_reason != "run_lost" || u.state != "stopped") =>
            {
                return;
            }
            Some(_) => {}
            None => {
                let lease = self.engine.live_of(&task).filter(|l| {
                    l.lease_id == u.lease_id
                        && l.token == u.token
                        && &l.agent == worker
                        && l.session.as_deref() == Some(session)
                });
                let Some(l) = lease else {
                    return;
                };
                if self.adopt_run(&l, "active") {
                    tracing::info!(task = %task, worker = %worker, token = l.token, "a run not known to this coordinator reported: adopted");
                }
            }
        }
        let detail = clip(&u.detail, 400);
        let reason = automaton_workflow::excerpt(&u.stop_reason);
        self.record_run(
            &task,
            worker,
            state,
            u.token,
            &u.state,
            &reason,
            &detail,
            u.exit_code,
        );
        match u.state.as_str() {
            "active" => self.engine.emit(
                "run_started",
                &task.to_string(),
                worker.as_str(),
                u.token,
                state.to_string(),
            ),
            "stopped" => {
                // What the worker kept of a failed run's output, and its warnings.
                if !u.output_tail.is_empty() || !u.warnings.is_empty() {
                    let mut inner = self.work.inner();
                    if let Some(r) = inner
                        .runs
                        .get_mut(&task)
                        .and_then(|r| r.iter_mut().rev().find(|r| r.token == u.token))
                    {
                        r.output_tail = clip_front(&u.output_tail, TAIL_KEPT);
                        r.warnings = u
                            .warnings
                            .iter()
                            .take(WARNINGS_KEPT)
                            .map(|w| clip(w, WARNING_BYTES))
                            .collect();
                    }
                }
                if u.code_unchanged {
                    let warning = u
                        .warnings
                        .first()
                        .map(|w| clip(w, WARNING_BYTES))
                        .unwrap_or_else(|| "implement changed no code".into());
                    tracing::warn!(task = %task, worker = %worker, token = u.token, "{warning}");
                    self.engine.emit(
                        "no_code_change",
                        &task.to_string(),
                        worker.as_str(),
                        u.token,
                        format!("{state}: {warning}"),
                    );
                }
                if u.peak_context_tokens > 0 {
                    let estimate = {
                        let mut inner = self.work.inner();
                        let run = inner
                            .runs
                            .get_mut(&task)
                            .and_then(|r| r.iter_mut().rev().find(|r| r.token == u.token));
                        run.map(|r| {
                            r.peak_context_tokens = u.peak_context_tokens;
                            r.peak_context_source = clip(&u.peak_context_source, 40);
                            r.estimated_tokens
                        })
                        .unwrap_or(0)
                    };
                    if reason == "completed" && task.parent().is_some() {
                        self.learned(&task, estimate, u.peak_context_tokens);
                    }
                }
                self.engine.emit(
                    "run_stopped",
                    &task.to_string(),
                    worker.as_str(),
                    u.token,
                    format!(
                        "{state}: {reason}{}",
                        if detail.is_empty() {
                            String::new()
                        } else {
                            format!(" ({detail})")
                        }
                    ),
                );
                if reason == "completed" {
                    // Its iteration was counted when its artifact moved the task on
                    // (`Coordinator::phase_done`); the runs and the sizing are kept.
                    self.work.inner().retry.remove(&task);
                    self.save_or_warn(&task).await;
                } else {
                    let last = u
                        .output_tail
                        .lines()
                        .rev()
                        .find(|l| !l.trim().is_empty())
                        .map(|l| clip(l.trim(), 200))
                        .unwrap_or_default();
                    tracing::warn!(task = %task, worker = %worker, token = u.token, phase = %state, reason = %reason, detail = %detail, last_output = %last, "run failed");
                    self.run_failed(&task, state, worker, &u.lease_id, u.token, &reason, &detail)
                        .await;
                }
            }
            _ => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_failed(
        &self,
        task: &TaskName,
        state: State,
        worker: &AgentId,
        lease_id: &str,
        token: u64,
        reason: &str,
        detail: &str,
    ) {
        // Seed 002: a phase past MAX_PHASE_TIME stops and reports human intervention; it is
        // not retried (max_attempts is for crashes and agent errors).
        if reason == "timed_out" {
            self.hold_as(
                task,
                format!(
                    "MAX_PHASE_TIME exceeded: {state} ran past max_phase_time {} on {worker}{}: a person decides how to go on, then `automaton stop {task} --resume`",
                    humantime::format_duration(self.work.max_phase_time),
                    if detail.is_empty() { String::new() } else { format!(" ({detail})") }
                ),
                true,
            );
        } else if reason != "lease_lost" && reason != "operator_stopped" && reason != "shutdown" {
            // Losing the lease is not the run's fault.
            let n = {
                let mut inner = self.work.inner();
                let n = inner.failures.entry((task.clone(), state)).or_insert(0);
                *n += 1;
                *n
            };
            // Offered again after a pause that grows with each failure, to another worker
            // first.
            let pause = retry_pause(n);
            self.work.inner().retry.insert(
                task.clone(),
                (
                    Instant::now() + pause,
                    worker.clone(),
                    wall_ms(SystemTime::now() + pause),
                ),
            );
            if n >= self.work.max_attempts {
                self.hold_as(
                    task,
                    format!(
                        "{n} failed runs of {state} (last: {reason}{}): fix the cause, then `automaton stop {task} --resume`",
                        if detail.is_empty() { String::new() } else { format!(", {detail}") }
                    ),
                    true,
                );
            }
        }
        // The count and any hold are durable before the lease is released (and the task
        // could be offered again).
        self.save_or_warn(task).await;
        if self
            .engine
            .live_of(task)
            .is_some_and(|l| l.lease_id == lease_id && l.token == token)
        {
            let _ = self
                .engine
                .release(lease_id, Some(token), Some(worker))
                .await;
        }
        self.work.poke();
    }

    /// [`Coordinator::save_dispatch`] where nobody waits for the answer: a failure is logged
    /// (the record is written again with the task's next change).
    pub(crate) async fn save_or_warn(&self, task: &TaskName) {
        if let Err(e) = self.save_dispatch(task).await {
            tracing::warn!(task = %task, error = %e, "cannot write the task's dispatch record");
        }
    }

    /// Records the run under lease `l` as `state` if this coordinator has no record of it
    /// (it began before this start): adopted. Whether it was.
    fn adopt_run(&self, l: &Live, state: &str) -> bool {
        let state = match state {
            "requested" | "starting" | "active" | "stopping" => state,
            _ => "active",
        };
        let mut inner = self.work.inner();
        let estimated = inner.fixed.get(&l.task).copied().unwrap_or(0);
        let runs = inner.runs.entry(l.task.clone()).or_default();
        if let Some(r) = runs.iter_mut().rev().find(|r| r.token == l.token) {
            if r.state != "stopped" {
                r.state = state.into();
            }
            return false;
        }
        runs.push_back(pb::Run {
            worker: l.agent.to_string(),
            phase: l.state.to_string(),
            token: l.token,
            state: state.into(),
            stop_reason: String::new(),
            detail: String::new(),
            exit_code: -1,
            started_at: Some(crate::service::timestamp(l.claimed)),
            ended_at: None,
            estimated_tokens: estimated,
            output_tail: String::new(),
            warnings: Vec::new(),
            peak_context_tokens: 0,
            why: "adopted: the run began before the coordinator's restart".into(),
            peak_context_source: String::new(),
            trace_id: String::new(),
        });
        while runs.len() > RUNS_KEPT {
            runs.pop_front();
        }
        true
    }

    /// Whether lease `l`, owned by a resumed session whose worker reports its runs, has a run
    /// its worker should have reported: it was granted before this start (this coordinator
    /// knows of no other use of it), or this coordinator saw its run offered and answered. An
    /// offer not yet answered is left to its timeout; a lease claimed by hand in the session
    /// (no run) is kept.
    pub(crate) fn run_expected(&self, l: &Live) -> bool {
        let inner = self.work.inner();
        if inner.offers.contains_key(&l.lease_id) {
            return false;
        }
        l.token <= self.engine.log_mark()
            || inner
                .runs
                .get(&l.task)
                .is_some_and(|r| r.iter().any(|r| r.token == l.token))
    }

    /// What a session's resume found (sessions.rs): the runs its worker reported under the
    /// leases it keeps are adopted; the leases whose run it no longer has (`lost`, their ends
    /// queued in the log) end with `run_lost`, and their tasks are offered again.
    pub(crate) async fn resumed_runs(
        &self,
        worker: &AgentId,
        adopted: Vec<(Live, String)>,
        lost: Vec<(Live, automaton_backend::Commit)>,
    ) {
        for (l, state) in adopted {
            self.load_dispatch(&l.task).await;
            if self.adopt_run(&l, &state) {
                tracing::info!(task = %l.task, worker = %worker, token = l.token, "run adopted after a restart");
                self.engine.emit(
                    "run_adopted",
                    &l.task.to_string(),
                    worker.as_str(),
                    l.token,
                    format!(
                        "{}: reported by its worker when it resumed its session",
                        l.state
                    ),
                );
            }
        }
        for ending in lost {
            let l = ending.0.clone();
            self.load_dispatch(&l.task).await;
            if let Err(e) = self.engine.end(ending, "run_lost").await {
                tracing::warn!(task = %l.task, error = %e, "cannot end a lease whose run was lost");
                continue;
            }
            // A run whose stop was reported (its lease outlived it: the release was cut off
            // by the restart) keeps its reason.
            if self
                .work
                .run_of(&l.task, l.token)
                .is_some_and(|r| r.state == "stopped")
            {
                tracing::info!(task = %l.task, token = l.token, "the lease of a stopped run outlived it: ended (run_lost)");
                continue;
            }
            const WHY: &str =
                "its worker resumed its session without this run: the run ended unreported";
            tracing::warn!(task = %l.task, worker = %worker, token = l.token, "{WHY}; the lease ended (run_lost)");
            self.adopt_run(&l, "active");
            self.record_run(
                &l.task, worker, l.state, l.token, "stopped", "run_lost", WHY, -1,
            );
            self.engine.emit(
                "run_stopped",
                &l.task.to_string(),
                worker.as_str(),
                l.token,
                format!("{}: run_lost ({WHY})", l.state),
            );
            self.save_or_warn(&l.task).await;
        }
        self.work.poke();
    }

    /// Why `task` may run no more under seed 002's loop limits, if so.
    fn over_limits(&self, task: &TaskName) -> Option<String> {
        let inner = self.work.inner();
        let n = inner.iterations.get(task).copied().unwrap_or(0);
        if n >= self.work.max_iterations {
            return Some(format!(
                "MAX_ITERATIONS reached: {n} completed runs (max_iterations {}): a person decides how to go on, then `automaton stop {task} --resume`",
                self.work.max_iterations
            ));
        }
        let (first, _) = inner.first_offered.get(task)?;
        (first.elapsed() >= self.work.max_total_time).then(|| {
            format!(
                "MAX_TOTAL_TIME reached: running for {} (max_total_time {}): a person decides how to go on, then `automaton stop {task} --resume`",
                humantime::format_duration(Duration::from_secs(first.elapsed().as_secs())),
                humantime::format_duration(self.work.max_total_time)
            )
        })
    }

    /// A task that ended, looked at once: in manual mode (`Autopilot: Disabled`), a task in
    /// `human_intervention` gets the follow-up tasks its verdict names (seeds 000/002: fix,
    /// review, tie-break), seeded with the original's artifacts at their starting phase. In
    /// autopilot none are made: a person decides (an event says so).
    async fn settle(self: &Arc<Self>, task: &TaskName, state: State) {
        if !self.work.inner().settled.insert(task.clone()) {
            return;
        }
        if state.phase != automaton_workflow::Phase::HumanIntervention {
            return;
        }
        // Through the store (never a link): what a follow-up starts with is served to agents.
        let read = |a| self.engine.project().read_artifact(task, a).ok().flatten();
        let verdict = read(Artifact::Verdict)
            .and_then(|v| String::from_utf8(v).ok())
            .unwrap_or_default();
        // Seed 002's line, with the reason the files give.
        let line = {
            let t = task.clone();
            self.engine
                .read(move |p| {
                    let standing = p.parent_standing(&t, Some(state))?;
                    Ok(p.attention(&t, Some(state), standing.as_ref()))
                })
                .await
                .ok()
                .flatten()
                .unwrap_or_else(|| {
                    automaton_store::human_intervention_line("a person decides how to go on")
                })
        };
        if self.engine.policy().autopilot {
            self.engine.emit(
                "human_intervention",
                &task.to_string(),
                "",
                0,
                format!("{line} (autopilot creates no fix, review or tie-break tasks: a person decides how to go on)"),
            );
            return;
        }
        self.engine.emit(
            "human_intervention",
            &task.to_string(),
            "",
            0,
            format!("{line} (manual mode: the fix, review and tie-break tasks its verdict names are made)"),
        );
        let parent = task.parent();
        for f in automaton_workflow::follow_up_tasks(task, &verdict, parent.as_ref()) {
            if self.engine.project().task_dir(&f.name).exists() {
                continue;
            }
            let mut files: Vec<(&str, Vec<u8>)> = f
                .copy
                .iter()
                .filter_map(|n| Some((*n, read(Artifact::from_file_name(n)?)?)))
                .collect();
            if f.empty_implementation {
                files.push(("IMPLEMENTATION.md", Vec::new()));
            }
            let (name, start) = (f.name.clone(), State::open(f.start_phase));
            match self
                .engine
                .read(move |p| p.create_follow_up(&name, start, &files).map(|_| ()))
                .await
            {
                Ok(()) => {
                    self.work.task_created(&f.name);
                    self.engine.emit(
                        "follow_up_created",
                        &f.name.to_string(),
                        "",
                        0,
                        format!(
                            "{} task for {task}, starting at {}: {}",
                            f.kind.word(),
                            f.start_phase,
                            automaton_workflow::excerpt(&f.item)
                        ),
                    );
                }
                Err(e) => {
                    tracing::warn!(task = %f.name, error = %e, "cannot create a follow-up task")
                }
            }
        }
    }

    /// Holds `task` from dispatch with `why` (an event says so), until a round finds it
    /// again or an operator resumes it; not kept across restarts (see [`Coordinator::hold_as`]).
    pub(crate) fn hold(&self, task: &TaskName, why: String) {
        self.hold_as(task, why, false);
    }

    /// Holds `task` with `why`; `durable`: kept in its dispatch record (the caller saves it).
    /// Whether the hold is new.
    pub(crate) fn hold_as(&self, task: &TaskName, why: String, durable: bool) -> bool {
        let new = {
            let mut inner = self.work.inner();
            let hold = Hold {
                why: why.clone(),
                durable,
            };
            inner
                .held
                .insert(task.clone(), hold)
                .is_none_or(|old| old.why != why || old.durable != durable)
        };
        if new {
            tracing::warn!(task = %task, why = %why, "task held from dispatch");
            // A hold that waits for a person's decision says so as seed 002 does.
            let detail = if awaits_a_person(&why, durable) {
                automaton_store::human_intervention_line(&why)
            } else {
                why
            };
            self.engine
                .emit("task_held", &task.to_string(), "", 0, detail);
        }
        new
    }

    /// `automaton run TASK` (manual mode): asks for `task`'s next phase to run, once; durable
    /// before it is acknowledged. Returns the state whose work runs.
    pub(crate) async fn run_task(&self, task: &TaskName, by: &str) -> Result<State, Error> {
        if self.engine.policy().autopilot {
            return Err(Error::Refused(format!(
                "autopilot is on: dispatch runs {task} on its own; `automaton run` is for manual mode (write 'Autopilot: Disabled' in .agent.md and restart the coordinator)"
            )));
        }
        if !self.engine.project().task_dir(task).is_dir() {
            return Err(Error::Store(automaton_store::Error::TaskNotFound {
                task: task.clone(),
                tasks: String::new(),
            }));
        }
        self.load_dispatch(task).await;
        if let Some(why) = self.work.held(task) {
            return Err(Error::Refused(format!(
                "{task} is held ({why}): `automaton stop {task} --resume` first"
            )));
        }
        if let Some(l) = self.engine.live_of(task) {
            return Err(Error::Refused(format!(
                "{task} is running {} on {} already: wait for it, or `automaton stop {task}`",
                l.state, l.agent
            )));
        }
        let state = self.state_now(task).await?;
        let refuse = |why: String| Err(Error::Refused(format!("{task} is {state}: {why}")));
        if state.phase.is_terminal() {
            return refuse("it has ended; nothing runs".into());
        }
        if state.is_awaiting_approval() {
            return refuse(format!(
                "a person approves it first: `automaton approve {task}`"
            ));
        }
        if state == State::approved(automaton_workflow::Phase::Decomposition) {
            return refuse(format!(
                "its sub-tasks run, each with `automaton run {task}/SUB` (`automaton tasks` lists them)"
            ));
        }
        let Some(work) = self.next_work(task, state).await? else {
            return refuse("it has nothing to run".into());
        };
        let before = self
            .work
            .inner()
            .requested
            .insert(task.clone(), by.to_string());
        if let Err(e) = self.save_dispatch(task).await {
            let mut inner = self.work.inner();
            match before {
                Some(b) => inner.requested.insert(task.clone(), b),
                None => inner.requested.remove(task),
            };
            return Err(e);
        }
        self.engine.emit(
            "run_requested",
            &task.to_string(),
            "",
            0,
            format!("{work}, by {by} (manual mode)"),
        );
        self.work.poke();
        Ok(work)
    }

    /// `automaton stop TASK`: ends the run on `task` (`operator_stopped`) and holds the task;
    /// with `resume`, lets it be dispatched again. Returns the worker whose run stopped.
    pub(crate) async fn stop_run(
        &self,
        task: &TaskName,
        resume: bool,
        by: &str,
    ) -> Result<(Option<AgentId>, bool), Error> {
        if !self.engine.project().task_dir(task).is_dir() {
            return Err(Error::Store(automaton_store::Error::TaskNotFound {
                task: task.clone(),
                tasks: String::new(),
            }));
        }
        // Its record first: what it says is what this changes.
        self.load_dispatch(task).await;
        if resume {
            // The counts start again: a person has decided to go on (a MAX_ITERATIONS or
            // MAX_TOTAL_TIME hold would otherwise come straight back).
            {
                let mut inner = self.work.inner();
                inner.held.remove(task);
                inner.failures.retain(|(t, _), _| t != task);
                inner.iterations.remove(task);
                inner.first_offered.remove(task);
            }
            self.save_dispatch(task).await?;
            self.engine
                .emit("task_resumed", &task.to_string(), "", 0, format!("by {by}"));
            self.work.poke();
            return Ok((None, false));
        }
        let before = self.work.inner().held.get(task).cloned();
        let asked = self.work.inner().requested.remove(task);
        self.hold_as(task, format!("{STOPPED_BY} ({by})"), true);
        // Acknowledged only once durable; if it cannot be, the task is as it was.
        if let Err(e) = self.save_dispatch(task).await {
            let mut inner = self.work.inner();
            match before {
                Some(h) => inner.held.insert(task.clone(), h),
                None => inner.held.remove(task),
            };
            if let Some(by) = asked {
                inner.requested.insert(task.clone(), by);
            }
            return Err(e);
        }
        let Some(l) = self.engine.live_of(task) else {
            return Ok((None, true));
        };
        if let Some(s) = &l.session {
            self.sessions.push(
                s,
                pb::coordinator_message::Msg::Stop(pb::StopRun {
                    lease_id: l.lease_id.clone(),
                    task: task.to_string(),
                    reason: "operator_stopped".into(),
                }),
            );
        }
        self.engine
            .release(&l.lease_id, Some(l.token), None)
            .await?;
        Ok((Some(l.agent), true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_tasks_pause_doubles_from_one_second_to_thirty() {
        let secs: Vec<u64> = (1..=8).map(|n| retry_pause(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_pause(u32::MAX), RETRY_MAX_PAUSE);
    }

    #[test]
    fn a_runs_tail_is_kept_whole_in_memory_and_its_last_4_kib_in_the_record() {
        // 16 KiB of two-byte characters and control bytes (escaped six-fold in JSON).
        let tail: String = "é\u{1}".repeat(TAIL_KEPT / 3) + "last line\n";
        let run = pb::Run {
            output_tail: clip_front(&tail, TAIL_KEPT),
            warnings: vec!["w".repeat(1000); 9],
            ..Default::default()
        };
        assert!(run.output_tail.ends_with("last line\n"));
        let kept = run_record(&run);
        assert!(kept.output_tail.len() <= automaton_store::MAX_TAIL_KEPT);
        assert!(kept.output_tail.ends_with("last line\n"));
        let back = run_pb(&kept);
        assert_eq!(back.output_tail, kept.output_tail);
        assert_eq!(back.warnings.len(), WARNINGS_KEPT);
        assert!(back.warnings.iter().all(|w| w.len() <= WARNING_BYTES + 3));
        // Ten such runs stay well under the record's 1 MiB cap.
        let record = DispatchRecord {
            runs: vec![run_record(&back); RUNS_KEPT],
            ..DispatchRecord::default()
        };
        let bytes = serde_json::to_vec_pretty(&record).expect("json");
        assert!(bytes.len() < 512 * 1024, "{}", bytes.len());
    }

    fn record() -> DispatchRecord {
        DispatchRecord {
            held: Some("stopped by an operator (ops)".into()),
            failures: vec![("research".parse().expect("state"), 2)],
            iterations: 3,
            first_offered_ms: Some(wall_ms(SystemTime::now() - Duration::from_secs(60))),
            need: Some(12_000),
            sized: Some((10_000, 9_000)),
            runs: vec![
                RunRecord {
                    worker: "gpu-a".into(),
                    phase: "research".into(),
                    token: 7,
                    state: "stopped".into(),
                    stop_reason: "agent_error".into(),
                    started_ms: Some(1_000),
                    ended_ms: Some(2_000),
                    ..RunRecord::default()
                },
                RunRecord {
                    worker: "gpu-a".into(),
                    phase: "research".into(),
                    token: 8,
                    state: "active".into(),
                    started_ms: Some(3_000),
                    ..RunRecord::default()
                },
            ],
            run_requested: Some("ops".into()),
            retry_until_ms: Some(wall_ms(SystemTime::now() + Duration::from_secs(20))),
            retry_after: Some("gpu-b".into()),
        }
    }

    #[test]
    fn a_record_read_at_start_is_what_the_next_write_holds_and_runs_without_a_lease_are_lost() {
        let work = Work::new(&crate::Options::default());
        let t: TaskName = "t".parse().expect("name");
        // One record for both sides: `record()` reads the clock.
        let read = record();
        assert!(work.take_in(&t, Ok(Some(read.clone())), None).is_none());
        assert_eq!(
            work.held(&t).as_deref(),
            Some("stopped by an operator (ops)")
        );
        assert!(work.learned_ratio().is_some_and(|r| (r - 0.9).abs() < 1e-9));
        let again = work.record_of(&t);
        let mut want = read;
        // The run that was going has no lease after the restart: it ended with the old
        // coordinator.
        want.runs[1].state = "stopped".into();
        want.runs[1].stop_reason = "run_lost".into();
        want.runs[1].detail = "the coordinator restarted and its lease did not survive".into();
        // Times round-trip to the second (the wire's precision for runs).
        assert_eq!(again.held, want.held);
        assert_eq!(again.failures, want.failures);
        assert_eq!(again.iterations, want.iterations);
        assert_eq!(again.first_offered_ms, want.first_offered_ms);
        assert_eq!((again.need, again.sized), (want.need, want.sized));
        assert_eq!(again.runs, want.runs);
        // Read once: a second read changes nothing.
        let other = DispatchRecord {
            iterations: 99,
            ..DispatchRecord::default()
        };
        work.take_in(&t, Ok(Some(other)), None);
        assert_eq!(work.record_of(&t).iterations, 3);
    }

    #[test]
    fn a_run_under_the_live_lease_stays_going_and_an_unreadable_record_holds_only_in_memory() {
        let work = Work::new(&crate::Options::default());
        let t: TaskName = "t".parse().expect("name");
        work.take_in(&t, Ok(Some(record())), Some(8));
        assert_eq!(work.run_of(&t, 8).map(|r| r.state), Some("active".into()));

        let u: TaskName = "u".parse().expect("name");
        let why = work
            .take_in(&u, Err("Corrupt dispatch record x: EOF.".into()), None)
            .expect("held");
        assert!(why.contains("automaton stop u --resume"), "{why}");
        assert_eq!(work.held(&u), Some(why));
        // Not written back as a hold: a resume writes the record afresh.
        assert_eq!(work.record_of(&u), DispatchRecord::default());
    }
}
