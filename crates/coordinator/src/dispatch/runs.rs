//! Runs: a worker's answer to an offer, its reports of each run's lifecycle, a failed run
//! (its pause and its count), runs adopted from a resumed session and runs lost with it, and
//! a review bound to the commit its run read (a gate whose branch moved goes back).

use std::sync::Arc;
use std::time::{Instant, SystemTime};

use automaton_engine::Live;
use automaton_proto::v1 as pb;
use automaton_proto::vocab::RunVocab;
use automaton_workflow::{
    AgentId, EventKind, LeaseEnd, Phase, RunState, State, StopReason, TaskName,
};

use crate::Error;
use crate::state::Coordinator;

use super::policy::{
    REFUSAL_PAUSE, RUNS_KEPT, TAIL_KEPT, WARNING_BYTES, WARNINGS_KEPT, clip, clip_front,
    retry_pause,
};
use super::work::wall_ms;

impl Coordinator {
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
        tracing::info!(task = %o.task, worker = %worker, reason = %a.reason, "offer declined");
        // An offer declined is the offer's outcome (seed 003: deferred), not a run: no agent
        // ran. Said as an event, with the worker's why.
        if let Some(l) = self
            .engine
            .live_of(&o.task)
            .filter(|l| l.lease_id == a.lease_id)
        {
            self.engine.emit(
                EventKind::OfferDeclined,
                &o.task.to_string(),
                worker.as_str(),
                l.token,
                format!("{}: {}", l.state, automaton_workflow::excerpt(&a.reason)),
            );
        }
        if let Some(l) = self
            .engine
            .live_of(&o.task)
            .filter(|l| l.lease_id == a.lease_id)
        {
            self.work.withdraw_offer(&o.task, worker.as_str(), l.token);
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
        run_state: RunState,
        reason: Option<StopReason>,
        detail: &str,
        exit_code: i32,
    ) {
        let now = Some(crate::wire::timestamp(SystemTime::now()));
        let mut inner = self.work.inner();
        // A run is its worker's until it has stopped (the fleet view and the offers count it).
        let unfinished = inner.unfinished.entry(worker.to_string()).or_default();
        if run_state.is_stopped() {
            unfinished.remove(&(task.clone(), token));
        } else {
            unfinished.insert((task.clone(), token));
        }
        let early = inner
            .early
            .remove(&(task.clone(), token))
            .unwrap_or_default();
        let runs = inner.runs.entry(task.clone()).or_default();
        match runs.iter_mut().rev().find(|r| r.token == token) {
            Some(r) => {
                r.set_state_kind(run_state);
                r.set_stop_kind(reason);
                r.detail = detail.into();
                r.exit_code = exit_code;
                if run_state.is_stopped() {
                    r.ended_at = now;
                }
            }
            None => {
                let mut run = pb::Run {
                    worker: worker.to_string(),
                    phase: state.to_string(),
                    token,
                    state: String::new(),
                    stop_reason: String::new(),
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
                    commit: early.read,
                    wrote: early.wrote,
                    ..pb::Run::default()
                };
                run.set_state_kind(run_state);
                run.set_stop_kind(reason);
                runs.push_back(run);
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
        // A step the vocabulary does not name is no step (a newer worker's word).
        let Some(run_state) = u.state_kind() else {
            return;
        };
        // A stop must say why: a reason this coordinator does not know is the agent's error,
        // its word kept in the detail.
        let reason = match (run_state, u.stop_kind()) {
            (RunState::Stopped, None) => Some(StopReason::AgentError),
            (RunState::Stopped, r) => r,
            _ => None,
        };
        self.load_dispatch(&task).await;
        // Only runs under a lease this worker was granted.
        match self.work.run_of(&task, u.token) {
            Some(r) if r.worker != worker.as_str() => return,
            // A stop is reported once: a repeat changes nothing, nor does a step after it (a
            // `run_lost` or `worker_lost` the coordinator guessed gives way to the worker's own
            // stop).
            Some(r)
                if r.state_kind() == Some(RunState::Stopped)
                    && (!r.stop_kind().is_some_and(StopReason::is_coordinators_guess)
                        || !run_state.is_stopped()) =>
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
                if self.adopt_run(&l, RunState::Active) {
                    tracing::info!(task = %task, worker = %worker, token = l.token, "a run not known to this coordinator reported: adopted");
                }
            }
        }
        let mut detail = clip(&u.detail, 400);
        if run_state.is_stopped() && u.stop_kind().is_none() {
            detail = format!(
                "reported '{}': {detail}",
                automaton_workflow::excerpt(&u.stop_reason)
            );
        }
        self.record_run(
            &task,
            worker,
            state,
            u.token,
            run_state,
            reason,
            &detail,
            u.exit_code,
        );
        let reason = reason.unwrap_or(StopReason::AgentError);
        match run_state {
            RunState::Active => self.engine.emit(
                EventKind::RunStarted,
                &task.to_string(),
                worker.as_str(),
                u.token,
                state.to_string(),
            ),
            RunState::Stopped => {
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
                        EventKind::NoCodeChange,
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
                    if reason == StopReason::Completed && task.parent().is_some() {
                        self.learned(&task, estimate, u.peak_context_tokens);
                    }
                }
                self.engine.emit(
                    EventKind::RunStopped,
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
                if reason == StopReason::Completed {
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
                    self.run_failed(&task, state, worker, &u.lease_id, u.token, reason, &detail)
                        .await;
                }
            }
            _ => {}
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn run_failed(
        &self,
        task: &TaskName,
        state: State,
        worker: &AgentId,
        lease_id: &str,
        token: u64,
        reason: StopReason,
        detail: &str,
    ) {
        // Seed 002: a phase past MAX_PHASE_TIME stops and reports human intervention; it is
        // not retried (max_attempts is for crashes and agent errors).
        if reason == StopReason::TimedOut {
            self.hold_as(
                task,
                format!(
                    "MAX_PHASE_TIME exceeded: {state} ran past max_phase_time {} on {worker}{}: a person decides how to go on, then `automaton stop {task} --resume`",
                    humantime::format_duration(self.work.max_phase_time),
                    if detail.is_empty() { String::new() } else { format!(" ({detail})") }
                ),
                true,
            );
        } else if !matches!(
            reason,
            StopReason::LeaseLost | StopReason::OperatorStopped | StopReason::Shutdown
        ) {
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

    /// `worker`'s session ended (`reason`): every run of it that has not stopped ends now —
    /// its agent died with the worker, or the worker stopped hearing from it. A run never
    /// stays `active` after its worker's session.
    /// `ended`: the session's leases that ended with it. A lease with no run on record (its
    /// run began before this coordinator's restart, and the worker never came back to report
    /// it) gets one, ended the same way: nothing that ran is left without an end.
    pub(crate) async fn end_runs_of(&self, worker: &str, reason: LeaseEnd, ended: &[Live]) {
        for l in ended {
            if self.work.run_of(&l.task, l.token).is_none() {
                self.adopt_run(l, RunState::Active);
            }
        }
        let open: Vec<(TaskName, u64)> = self
            .work
            .inner()
            .unfinished
            .remove(worker)
            .map(|s| s.into_iter().collect())
            .unwrap_or_default();
        // `worker_lost`: seed 003's `crashed`, as the coordinator sees it — its guess, which
        // gives way to the worker's own report should the worker come back (it was paused).
        let (stop, detail) = match reason {
            LeaseEnd::Released => (
                StopReason::Shutdown,
                "the worker deregistered before the run reported its end",
            ),
            LeaseEnd::SessionReplaced => (
                StopReason::WorkerLost,
                "the worker was replaced (a new process under its name): the run died with the old one",
            ),
            _ => (
                StopReason::WorkerLost,
                "the worker's session ended (it died or went silent, session_expired) before the run reported its end",
            ),
        };
        for (task, token) in open {
            let Some(run) = self.work.run_of(&task, token) else {
                continue;
            };
            if run.state_kind() == Some(RunState::Stopped) {
                continue;
            }
            let Ok(agent) = run.worker.parse::<AgentId>() else {
                continue;
            };
            let Ok(phase) = run.phase.parse::<State>() else {
                continue;
            };
            self.record_run(
                &task,
                &agent,
                phase,
                token,
                RunState::Stopped,
                Some(stop),
                detail,
                -1,
            );
            self.engine.emit(
                EventKind::RunStopped,
                &task.to_string(),
                worker,
                token,
                format!("{phase}: {stop} ({detail})"),
            );
            self.save_or_warn(&task).await;
        }
    }

    /// Records the run under lease `l` as `state` if this coordinator has no record of it
    /// (it began before this start): adopted. Whether it was.
    pub(crate) fn adopt_run(&self, l: &Live, state: RunState) -> bool {
        let state = if state.is_stopped() {
            RunState::Active
        } else {
            state
        };
        let mut inner = self.work.inner();
        let estimated = inner.fixed.get(&l.task).copied().unwrap_or(0);
        let runs = inner.runs.entry(l.task.clone()).or_default();
        if let Some(r) = runs.iter_mut().rev().find(|r| r.token == l.token) {
            if r.state_kind() != Some(RunState::Stopped) {
                r.set_state_kind(state);
                inner
                    .unfinished
                    .entry(l.agent.to_string())
                    .or_default()
                    .insert((l.task.clone(), l.token));
            }
            return false;
        }
        inner
            .unfinished
            .entry(l.agent.to_string())
            .or_default()
            .insert((l.task.clone(), l.token));
        let early = inner
            .early
            .remove(&(l.task.clone(), l.token))
            .unwrap_or_default();
        let runs = inner.runs.entry(l.task.clone()).or_default();
        let mut run = pb::Run {
            worker: l.agent.to_string(),
            phase: l.state.to_string(),
            token: l.token,
            state: String::new(),
            stop_reason: String::new(),
            detail: String::new(),
            exit_code: -1,
            started_at: Some(crate::wire::timestamp(l.claimed)),
            ended_at: None,
            estimated_tokens: estimated,
            output_tail: String::new(),
            warnings: Vec::new(),
            peak_context_tokens: 0,
            why: "adopted: the run began before the coordinator's restart".into(),
            peak_context_source: String::new(),
            trace_id: String::new(),
            commit: early.read,
            wrote: early.wrote,
            ..pb::Run::default()
        };
        run.set_state_kind(state);
        runs.push_back(run);
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
        adopted: Vec<(Live, RunState)>,
        lost: Vec<(Live, automaton_backend::Commit)>,
    ) {
        for (l, state) in adopted {
            self.load_dispatch(&l.task).await;
            if self.adopt_run(&l, state) {
                tracing::info!(task = %l.task, worker = %worker, token = l.token, "run adopted after a restart");
                self.engine.emit(
                    EventKind::RunAdopted,
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
            if let Err(e) = self.engine.end(ending, LeaseEnd::RunLost).await {
                tracing::warn!(task = %l.task, error = %e, "cannot end a lease whose run was lost");
                continue;
            }
            // A run whose stop was reported (its lease outlived it: the release was cut off
            // by the restart) keeps its reason.
            if self
                .work
                .run_of(&l.task, l.token)
                .is_some_and(|r| r.state_kind() == Some(RunState::Stopped))
            {
                tracing::info!(task = %l.task, token = l.token, "the lease of a stopped run outlived it: ended (run_lost)");
                continue;
            }
            const WHY: &str =
                "its worker resumed its session without this run: the run ended unreported";
            tracing::warn!(task = %l.task, worker = %worker, token = l.token, "{WHY}; the lease ended (run_lost)");
            self.adopt_run(&l, RunState::Active);
            self.record_run(
                &l.task,
                worker,
                l.state,
                l.token,
                RunState::Stopped,
                Some(StopReason::RunLost),
                WHY,
                -1,
            );
            self.engine.emit(
                EventKind::RunStopped,
                &l.task.to_string(),
                worker.as_str(),
                l.token,
                format!("{}: run_lost ({WHY})", l.state),
            );
            self.save_or_warn(&l.task).await;
        }
        self.work.poke();
    }
}

impl Coordinator {
    /// Where `task`'s reviews part from its branch, in `state` (the code review's gate or a
    /// later review phase): the commit they vouch for and the one found instead. `None` when
    /// they are bound to the head, or nothing says what they read (a review written by hand).
    pub(crate) async fn review_moved(
        &self,
        task: &TaskName,
        state: State,
    ) -> Option<(String, String)> {
        let runs: Vec<pb::Run> = self.work.runs(task).into_iter().collect();
        let t = task.clone();
        let with_approval = state.phase != Phase::CodeReview || state.is_approved();
        self.engine
            .read(move |p| {
                let approved = if with_approval {
                    p.latest_approval(&t, Phase::CodeReview)?
                        .and_then(|a| a.commit)
                } else {
                    None
                };
                let Some(head) = p.branch_head(&t)? else {
                    return Ok(None);
                };
                // doc_review's own patch, should its run's record of it be lost (a crash
                // between the commit and the record): its commits say whose they are.
                let fleet = |from: &str, to: &str| {
                    p.only_fleet_commits(&t, Phase::DocReview, from, to)
                        .unwrap_or(false)
                };
                Ok(review_chain_break(
                    state,
                    &runs,
                    approved.as_deref(),
                    &head,
                    &fleet,
                ))
            })
            .await
            .ok()
            .flatten()
    }

    /// The commit `task`'s last completed code review read, if known.
    pub(crate) fn review_read(&self, task: &TaskName) -> Option<String> {
        self.work
            .runs(task)
            .into_iter()
            .rev()
            .find(|r| {
                r.completed()
                    && r.phase
                        .parse::<State>()
                        .is_ok_and(|s| s.phase == Phase::CodeReview)
            })
            .map(|r| r.commit)
            .filter(|c| !c.is_empty())
    }

    /// Sends `task` back to its code review, to run again on the branch as it is now
    /// (issue 36: a review is bound to the commit it read).
    pub(crate) async fn review_again(
        self: &Arc<Self>,
        task: &TaskName,
        read: &str,
        head: &str,
    ) -> Result<(), Error> {
        let t = task.clone();
        let from = self.state_now(task).await?;
        let phase = Phase::CodeReview;
        let moved = self
            .engine
            .to_completion(task, move |c| async move {
                let project = c.project().clone();
                let t2 = t.clone();
                let moved = tokio::task::spawn_blocking(move || project.review_again(&t2))
                    .await
                    .map_err(|e| Error::Internal(format!("a review's reset failed: {e}")))?
                    .map_err(Error::from)?;
                c.states().insert(t, State::open(phase));
                Ok(moved)
            })
            .await?;
        if moved {
            self.engine.emit_moved(
                &task.to_string(),
                "",
                0,
                (from, State::open(phase)),
                "review stale",
            );
            self.engine.emit(
                EventKind::ReviewStale,
                &task.to_string(),
                "",
                0,
                format!(
                    "{from}: the reviews read commit {}, and the branch is at {} since: {phase} runs again on it (an approval does not authorize another revision)",
                    read.get(..12).unwrap_or(read),
                    head.get(..12).unwrap_or(head)
                ),
            );
            self.work.poke();
        }
        Ok(())
    }
}

/// Where a task's review chain parts from its branch, in `state`: the commit the reviews vouch
/// for and the commit found instead (a later review read it, or the branch is at it now).
///
/// The chain starts at the last completed code review's run: at its gate, what that run read;
/// once approved, the commit the approval names (a person may approve a newer revision than
/// the run read). Each later review must read the chain's commit; a run's own patch
/// (doc_review's) moves the chain to the commit it wrote. `None` when bound, or when nothing
/// says what the code review read.
pub(crate) fn review_chain_break(
    state: State,
    runs: &[pb::Run],
    approved: Option<&str>,
    head: &str,
    fleet: &dyn Fn(&str, &str) -> bool,
) -> Option<(String, String)> {
    let phase_of = |r: &pb::Run| r.phase.parse::<State>().ok().map(|s| s.phase);
    let completed = |r: &pb::Run| r.completed();
    let review = runs
        .iter()
        .rposition(|r| phase_of(r) == Some(Phase::CodeReview) && completed(r));
    let read = review
        .map(|i| runs[i].commit.as_str())
        .filter(|c| !c.is_empty());
    let mut bound = match (state.phase, state.gate) {
        (Phase::CodeReview, automaton_workflow::Gate::Open) => return None,
        (Phase::CodeReview, automaton_workflow::Gate::AwaitingApproval) => read?,
        _ => approved.or(read)?,
    }
    .to_string();
    let after = review.map_or(0, |i| i + 1);
    if state.phase != Phase::CodeReview {
        for r in &runs[after..] {
            if completed(r)
                && phase_of(r).is_some_and(Phase::reviews_code)
                && !r.commit.is_empty()
                && r.commit != bound
            {
                if !fleet(&bound, &r.commit) {
                    return Some((bound, r.commit.clone()));
                }
                bound = r.commit.clone();
            }
            if !r.wrote.is_empty() {
                bound = r.wrote.clone();
            }
        }
    }
    (head != bound && !(state.phase != Phase::CodeReview && fleet(&bound, head)))
        .then(|| (bound, head.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(phase: &str, read: &str, wrote: &str, reason: &str) -> pb::Run {
        pb::Run {
            phase: phase.into(),
            commit: read.into(),
            wrote: wrote.into(),
            stop_reason: reason.into(),
            state: "stopped".into(),
            ..pb::Run::default()
        }
    }

    fn st(s: &str) -> State {
        s.parse().expect("state")
    }

    fn broke(
        s: &str,
        runs: &[pb::Run],
        approved: Option<&str>,
        head: &str,
    ) -> Option<(String, String)> {
        // The fleet's own doc_review commits: `d` and `e` (on `x`).
        let fleet = |from: &str, to: &str| from == "x" && matches!(to, "d" | "e");
        review_chain_break(st(s), runs, approved, head, &fleet)
    }

    fn pair(a: &str, b: &str) -> Option<(String, String)> {
        Some((a.into(), b.into()))
    }

    #[test]
    fn a_review_chain_is_bound_to_what_the_code_review_read_and_doc_reviews_own_patch() {
        let implement = run("implement", "base", "x", "completed");
        let review = run("code_review", "x", "", "completed");
        // At the gate: what the review read, against the head.
        let runs = [implement.clone(), review.clone()];
        assert_eq!(
            broke("code_review:awaiting_approval", &runs, None, "x"),
            None
        );
        assert_eq!(
            broke("code_review:awaiting_approval", &runs, None, "y"),
            pair("x", "y")
        );
        // An open review has nothing to be bound to yet.
        assert_eq!(broke("code_review", &runs, None, "y"), None);
        // Approved: the approval's commit rules (a person approved the newer head).
        assert_eq!(broke("code_review:approved", &runs, Some("y"), "y"), None);
        assert_eq!(
            broke("code_review:approved", &runs, None, "y"),
            pair("x", "y")
        );
        // Later reviews read the approved commit; doc_review's patch moves the chain on.
        let chain = [
            implement.clone(),
            review.clone(),
            run("bug_find", "x", "", "completed"),
            run("adversarial_bug_find", "x", "", "completed"),
            run("doc_review", "x", "d", "completed"),
            run("referee", "d", "", "completed"),
        ];
        assert_eq!(broke("referee", &chain, Some("x"), "d"), None);
        assert_eq!(broke("referee", &chain, Some("x"), "p"), pair("d", "p"));
        // A person's commit between bug_find and the adversarial run: that run read it.
        let mut moved = chain[..4].to_vec();
        moved[3].commit = "p".into();
        assert_eq!(
            broke("adversarial_bug_find", &moved, Some("x"), "p"),
            pair("x", "p")
        );
        // doc_review's patch whose record was lost (a crash): its commits say it is the
        // fleet's, so the referee reading it, or the branch at it, breaks nothing; a
        // person's commit still does.
        let lost = [
            implement.clone(),
            review.clone(),
            run("bug_find", "x", "", "completed"),
            run("doc_review", "", "", "completed"),
            run("referee", "e", "", "completed"),
        ];
        assert_eq!(broke("referee", &lost, Some("x"), "e"), None);
        assert_eq!(broke("doc_review", &lost[..4], Some("x"), "e"), None);
        assert_eq!(broke("referee", &lost, Some("x"), "p"), pair("e", "p"));
        // At the code review's own gate nothing is the fleet's to add.
        assert_eq!(
            broke("code_review:awaiting_approval", &lost[..2], None, "e"),
            pair("x", "e")
        );
        // A failed run's read does not count; its patch does.
        let failed = [
            implement.clone(),
            review.clone(),
            run("bug_find", "x", "", "completed"),
            run("doc_review", "x", "d", "agent_error"),
            run("doc_review", "d", "", "completed"),
        ];
        assert_eq!(broke("referee", &failed, Some("x"), "d"), None);
        // Nothing says what the review read (written by hand): nothing to compare.
        let by_hand = [run("code_review", "", "", "completed")];
        assert_eq!(broke("bug_find", &by_hand, None, "z"), None);
        assert_eq!(
            broke("code_review:awaiting_approval", &by_hand, None, "z"),
            None
        );
        // The last completed code review starts the chain: an earlier cycle is forgotten.
        let again = [
            review.clone(),
            run("bug_find", "x", "", "completed"),
            run("implement", "x", "z", "completed"),
            run("code_review", "z", "", "completed"),
        ];
        assert_eq!(broke("bug_find", &again, Some("z"), "z"), None);
    }
}
