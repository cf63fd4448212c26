//! Dispatch's state ([`Work`]): the tasks it knows, their holds, failure and iteration
//! counts, offers, runs, plans and sizing samples, and each task's `.state.dispatch` record
//! as it reads and writes it. It knows neither the coordinator nor the engine.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use automaton_proto::v1 as pb;
use automaton_proto::vocab::RunVocab;
use automaton_store::{DispatchRecord, RunRecord};
use automaton_workflow::{AgentId, RunState, State, StopReason, TaskName};
use tokio::sync::Notify;

use super::policy::{
    RETRY_MAX_PAUSE, RUNS_KEPT, WARNING_BYTES, WARNINGS_KEPT, awaits_a_person, clip, clip_front,
};

/// The limits dispatch enforces (from the coordinator's options).
pub(crate) struct Limits {
    pub(crate) max_phase_time: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) max_artifact_bytes: u64,
    pub(crate) max_iterations: u32,
    pub(crate) max_total_time: Duration,
}

pub(crate) struct Offer {
    pub(crate) task: TaskName,
    pub(crate) name: AgentId,
    pub(crate) session: Arc<str>,
    pub(crate) at: Instant,
}

/// Why a task is not dispatched; `durable`: kept across restarts (an operator's stop, the
/// limits). The others (an unreadable file, an illegal move) are found again by a round.
#[derive(Clone)]
pub(crate) struct Hold {
    pub(crate) why: String,
    pub(crate) durable: bool,
    /// The lifecycle refused a move the task's own files decide (a stale approval, an
    /// artifact's bad `Next:` line): lifted as soon as an approval or a transition changes
    /// the task, without a person's `--resume`.
    pub(crate) lifts_on_change: bool,
}

/// How often a round compares a waiting review gate's branch with what its review read.
pub(crate) const REVIEW_CHECK_EVERY: Duration = Duration::from_secs(2);

/// Served commits kept for runs not recorded yet (bounded: a worker that never reports).
const SERVED_KEPT: usize = 4096;

/// What a run read and wrote (`Run.commit`, `Run.wrote`) before its run record existed.
#[derive(Debug, Default)]
pub(crate) struct RunCommits {
    pub(crate) read: String,
    pub(crate) wrote: String,
}

#[derive(Default)]
pub(crate) struct Inner {
    /// Every task the coordinator knows, with when it was created (oldest first wins).
    pub(crate) tasks: HashMap<TaskName, SystemTime>,
    pub(crate) seeded: bool,
    /// Tasks whose `.state.dispatch` was read (or that were made by this coordinator).
    pub(crate) loaded: HashSet<TaskName>,
    /// Tasks not to dispatch, with why.
    pub(crate) held: HashMap<TaskName, Hold>,
    /// Failed runs per task and state.
    pub(crate) failures: HashMap<(TaskName, State), u32>,
    /// Offers not answered yet, by lease id.
    pub(crate) offers: HashMap<String, Offer>,
    /// Recent runs per task, oldest first.
    pub(crate) runs: HashMap<TaskName, VecDeque<pb::Run>>,
    /// Workers that refused work lately.
    pub(crate) paused: HashMap<AgentId, Instant>,
    /// Why each task with work waits (as of the last round).
    pub(crate) waiting: HashMap<TaskName, String>,
    /// Decomposed parents' plans, as last read.
    pub(crate) plans: HashMap<TaskName, super::waves::Plan>,
    /// Sub-tasks reported orphaned.
    pub(crate) orphans: std::collections::HashSet<TaskName>,
    /// (estimate, reported peak) of completed sub-task runs, and their sums per task.
    pub(crate) samples: Vec<(u64, u64)>,
    pub(crate) sized: HashMap<TaskName, (u64, u64)>,
    /// The need a sub-task was first dispatched with: corrections apply only to sub-tasks
    /// not yet dispatched.
    pub(crate) fixed: HashMap<TaskName, u64>,
    /// Each sub-task's wave, for listings.
    pub(crate) waves: HashMap<TaskName, (usize, u64)>,
    /// Phases completed per task (seed 002's iterations) and when its first run was offered.
    pub(crate) iterations: HashMap<TaskName, u32>,
    pub(crate) first_offered: HashMap<TaskName, (Instant, SystemTime)>,
    /// Terminal tasks already looked at (follow-ups made in manual mode).
    pub(crate) settled: std::collections::HashSet<TaskName>,
    /// Manual mode: tasks an operator asked to run (`automaton run`), with who asked; each
    /// runs one phase, then waits for the next request.
    pub(crate) requested: HashMap<TaskName, String>,
    /// Tasks whose last run failed: not offered again before the instant (a backoff), and
    /// then to another fitting worker before the one that failed it.
    /// When, also as wall-clock milliseconds (what `.state.dispatch` keeps).
    pub(crate) retry: HashMap<TaskName, (Instant, AgentId, u64)>,
    /// Times each task was sent back to implement for a conflict, and a rework decided and
    /// not yet carried out whole (the head it builds on, and why).
    pub(crate) reworks: HashMap<TaskName, u32>,
    pub(crate) rework: HashMap<TaskName, (String, String)>,
    /// Delivery records as last read or written (`None`: the task has none).
    pub(crate) deliveries: HashMap<TaskName, Option<automaton_store::DeliveryRecord>>,
    /// A delivery that failed: not tried again before the instant; the pause it was given.
    pub(crate) delivery_pause: HashMap<TaskName, (Instant, Duration)>,
    /// One delivery into a base at a time, per (remote, base).
    pub(crate) base_locks: HashMap<(String, String), Arc<tokio::sync::Mutex<()>>>,
    /// Deliveries being driven now (each by one task beside the rounds).
    pub(crate) delivering: HashSet<TaskName>,
    /// Each worker's runs that have not stopped (task, token): a run stays its worker's
    /// until it has stopped, lease or no lease (a stopping run whose lease was released).
    pub(crate) unfinished: HashMap<String, HashSet<(TaskName, u64)>>,
    /// The commits a run read and wrote before its run record existed.
    pub(crate) early: HashMap<(TaskName, u64), RunCommits>,
    /// When each review gate's branch was last compared with what its review read.
    pub(crate) review_checked: HashMap<TaskName, Instant>,
}

pub(crate) struct Work {
    pub(crate) inner: Mutex<Inner>,
    /// Per task: its `.state.dispatch` as last written, held while it is written (one write
    /// of a task at a time, the latest state each time).
    pub(crate) saved: Mutex<HashMap<TaskName, Arc<tokio::sync::Mutex<Option<DispatchRecord>>>>>,
    pub(crate) wake: Notify,
    pub(crate) max_phase_time: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) max_artifact_bytes: u64,
    /// Seed 002's loop limits: completed runs per task, and time from its first run.
    pub(crate) max_iterations: u32,
    pub(crate) max_total_time: Duration,
}

impl Work {
    pub(crate) fn new(o: &Limits) -> Work {
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

    pub(crate) fn inner(&self) -> MutexGuard<'_, Inner> {
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

    pub(crate) fn plan(&self, parent: &TaskName) -> Option<super::waves::Plan> {
        self.inner().plans.get(parent).cloned()
    }

    pub(crate) fn set_plan(&self, parent: &TaskName, plan: super::waves::Plan) {
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
        match super::waves::ratio(&inner.samples) {
            Some(r) => ((estimate as f64) * r).ceil() as u64,
            None => estimate,
        }
    }

    /// Records a completed run's estimate and reported peak; the new ratio when it moved.
    pub(crate) fn learn(&self, task: &TaskName, estimate: u64, actual: u64) -> Option<f64> {
        let mut inner = self.inner();
        let before = super::waves::ratio(&inner.samples);
        inner.samples.push((estimate, actual));
        let sums = inner.sized.entry(task.clone()).or_insert((0, 0));
        *sums = (
            sums.0.saturating_add(estimate),
            sums.1.saturating_add(actual),
        );
        let after = super::waves::ratio(&inner.samples);
        (before.map(|b| (b * 100.0).round()) != after.map(|a| (a * 100.0).round()))
            .then_some(after)
            .flatten()
    }

    /// The learned ratio (Σ reported / Σ estimated), if any run reported.
    pub(crate) fn learned_ratio(&self) -> Option<f64> {
        super::waves::ratio(&self.inner().samples)
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
            r.state_kind() == Some(RunState::Stopped) && !r.stop_reason.is_empty() && !r.completed()
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

    /// Records that the run under `token` on `task` was served `commit` (its workspace's
    /// code); kept until the run is recorded, if it is not yet.
    pub(crate) fn served(&self, task: &TaskName, token: u64, commit: &str) {
        self.note_commit(task, token, commit, false);
    }

    /// Records that the run under `token` on `task` committed `commit` on the task branch
    /// (its own patch); kept until the run is recorded, if it is not yet.
    pub(crate) fn wrote(&self, task: &TaskName, token: u64, commit: &str) {
        self.note_commit(task, token, commit, true);
    }

    fn note_commit(&self, task: &TaskName, token: u64, commit: &str, wrote: bool) {
        let mut inner = self.inner();
        if let Some(r) = inner
            .runs
            .get_mut(task)
            .and_then(|r| r.iter_mut().rev().find(|r| r.token == token))
        {
            *(if wrote { &mut r.wrote } else { &mut r.commit }) = commit.to_string();
            return;
        }
        if inner.early.len() >= SERVED_KEPT {
            inner.early.clear();
        }
        let e = inner.early.entry((task.clone(), token)).or_default();
        *(if wrote { &mut e.wrote } else { &mut e.read }) = commit.to_string();
    }

    /// Whether a round should compare `task`'s review gate with its branch now: at most every
    /// [`REVIEW_CHECK_EVERY`] (a task may wait at a gate for hours; reading its branch on
    /// every round of 250 ms would be a repository open each time). An approval checks at once.
    pub(crate) fn review_check_due(&self, task: &TaskName) -> bool {
        let now = Instant::now();
        let mut inner = self.inner();
        match inner.review_checked.get(task) {
            Some(at) if now.duration_since(*at) < REVIEW_CHECK_EVERY => false,
            _ => {
                inner.review_checked.insert(task.clone(), now);
                true
            }
        }
    }

    /// Withdraws the run record an offer made (`requested`) when the offer was declined or
    /// never answered: no agent ran, so there is no run to end (seed 003: the offer's outcome,
    /// not the run's). A run its worker already reported is kept.
    pub(crate) fn withdraw_offer(&self, task: &TaskName, worker: &str, token: u64) {
        let mut inner = self.inner();
        if let Some(open) = inner.unfinished.get_mut(worker) {
            open.remove(&(task.clone(), token));
        }
        if let Some(runs) = inner.runs.get_mut(task) {
            runs.retain(|r| {
                !(r.token == token
                    && r.worker == worker
                    && r.state_kind() == Some(RunState::Requested))
            });
        }
        inner.early.remove(&(task.clone(), token));
    }

    /// `worker`'s runs that have not stopped, with their state (the fleet view shows them;
    /// a stopping run whose lease was released still holds its worker).
    pub(crate) fn unfinished_of(&self, worker: &str) -> Vec<(TaskName, pb::Run)> {
        let inner = self.inner();
        let Some(open) = inner.unfinished.get(worker) else {
            return Vec::new();
        };
        let mut out: Vec<(TaskName, pb::Run)> = open
            .iter()
            .filter_map(|(task, token)| {
                inner
                    .runs
                    .get(task)
                    .and_then(|r| r.iter().rev().find(|r| r.token == *token))
                    .filter(|r| r.state_kind() != Some(RunState::Stopped))
                    .map(|r| (task.clone(), r.clone()))
            })
            .collect();
        out.sort_by_key(|(_, r)| r.token);
        out
    }

    /// Offers not yet answered by `session`.
    pub(crate) fn offered_to(&self, session: &str) -> usize {
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

    pub(crate) fn is_loaded(&self, task: &TaskName) -> bool {
        self.inner().loaded.contains(task)
    }

    /// `task`'s record as it would be written now.
    pub(crate) fn record_of(&self, task: &TaskName) -> DispatchRecord {
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
            reworks: inner.reworks.get(task).copied().unwrap_or(0),
            rework: inner.rework.get(task).cloned(),
        }
    }

    /// Takes in `task`'s record as read at start (once; what this coordinator did to the task
    /// meanwhile wins). A record that cannot be read holds the task (it may say it was held):
    /// the reason is returned.
    /// `live`: the token of the task's live lease, if any (a run under any other token that
    /// the record shows as running has ended with the coordinator that knew it).
    pub(crate) fn take_in(
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
                        lifts_on_change: false,
                    },
                );
                return Some(why);
            }
        };
        if let Some(why) = r.held {
            inner.held.entry(task.clone()).or_insert(Hold {
                why,
                durable: true,
                lifts_on_change: false,
            });
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
        if r.reworks > 0 {
            let n = inner.reworks.entry(task.clone()).or_insert(0);
            *n = (*n).max(r.reworks);
        }
        if let Some(pending) = r.rework {
            inner.rework.entry(task.clone()).or_insert(pending);
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
                if run.state_kind() != Some(RunState::Stopped) && live != Some(run.token) {
                    run.set_state_kind(RunState::Stopped);
                    run.set_stop_kind(Some(StopReason::RunLost));
                    run.detail = "the coordinator restarted and its lease did not survive".into();
                }
                run
            })
            .collect();
        runs.extend(known);
        while runs.len() > RUNS_KEPT {
            runs.pop_front();
        }
        for r in runs
            .iter()
            .filter(|r| r.state_kind() != Some(RunState::Stopped))
        {
            inner
                .unfinished
                .entry(r.worker.clone())
                .or_default()
                .insert((task.clone(), r.token));
        }
        if !runs.is_empty() {
            inner.runs.insert(task.clone(), runs);
        }
        None
    }

    /// The lock that serialises deliveries into `base` on `remote`.
    pub(crate) fn base_lock(&self, remote: &str, base: &str) -> Arc<tokio::sync::Mutex<()>> {
        self.inner()
            .base_locks
            .entry((remote.to_string(), base.to_string()))
            .or_default()
            .clone()
    }

    /// The slot that serialises `task`'s record writes.
    pub(crate) fn save_slot(
        &self,
        task: &TaskName,
    ) -> Arc<tokio::sync::Mutex<Option<DispatchRecord>>> {
        self.saved
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(task.clone())
            .or_default()
            .clone()
    }
}

pub(crate) fn wall_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) fn from_ms(ms: u64) -> SystemTime {
    automaton_store::clamp_time(
        SystemTime::UNIX_EPOCH
            .checked_add(Duration::from_millis(ms))
            .unwrap_or(SystemTime::UNIX_EPOCH),
    )
}

pub(crate) fn ts_ms(t: &Option<automaton_proto::prost_types::Timestamp>) -> Option<u64> {
    t.as_ref()
        .and_then(|t| SystemTime::try_from(*t).ok())
        .map(wall_ms)
}

pub(crate) fn run_record(r: &pb::Run) -> RunRecord {
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
        commit: r.commit.clone(),
        wrote: r.wrote.clone(),
    }
}

/// A run read from a record; its texts bounded as a worker's report is.
pub(crate) fn run_pb(r: &RunRecord) -> pb::Run {
    pb::Run {
        worker: clip(&r.worker, 256),
        phase: clip(&r.phase, 64),
        token: r.token,
        state: clip(&r.state, 16),
        stop_reason: clip(&r.stop_reason, 400),
        detail: clip(&r.detail, 400),
        exit_code: r.exit_code,
        started_at: r.started_ms.map(|ms| crate::wire::timestamp(from_ms(ms))),
        ended_at: r.ended_ms.map(|ms| crate::wire::timestamp(from_ms(ms))),
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
        commit: clip(&r.commit, 64),
        wrote: clip(&r.wrote, 64),
        // The enums beside the strings, where the record's names are the vocabulary's (a
        // record from an older coordinator may hold other words: they stay strings).
        run_state: r
            .state
            .parse::<RunState>()
            .map_or(0, |s| pb::RunState::from(s) as i32),
        reason: r
            .stop_reason
            .parse::<StopReason>()
            .map_or(0, |s| pb::StopReason::from(s) as i32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::policy::TAIL_KEPT;

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
            reworks: 1,
            rework: Some(("a".repeat(40), "a conflict".into())),
        }
    }

    fn limits() -> Limits {
        Limits {
            max_phase_time: Duration::from_secs(3600),
            max_attempts: 3,
            max_artifact_bytes: 8 << 20,
            max_iterations: 10,
            max_total_time: Duration::from_secs(24 * 3600),
        }
    }

    #[test]
    fn a_record_read_at_start_is_what_the_next_write_holds_and_runs_without_a_lease_are_lost() {
        let work = Work::new(&limits());
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
        let work = Work::new(&limits());
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
