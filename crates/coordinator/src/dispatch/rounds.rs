//! Dispatch rounds: the dispatcher's loop, the records read before a task changes and
//! written after, the idle workers, a round's decisions and how each is carried out (a move
//! on, or an offer to a worker's session), and offers taken back when unanswered.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use automaton_engine::Presented;
use automaton_proto::v1 as pb;
use automaton_store::DispatchRecord;
use automaton_workflow::{AgentId, EventKind, State, TaskName};
use tokio::sync::watch;
use tracing::Instrument as _;

use crate::Error;
use crate::state::Coordinator;

use super::policy::{
    OFFER_TIMEOUT, ROUND_EVERY, ROUND_GAP, Slot, choose, leaves_a_reviewer, manual_waiting, names,
    offer_order, waiting_reason,
};
use super::work::Offer;

/// Decisions of one round carried out at once.
pub(crate) const ROUND_CONCURRENCY: usize = 64;

/// A decision of a round, carried out after the round has decided them all.
pub(crate) struct Planned {
    pub(crate) task: TaskName,
    pub(crate) from: State,
    pub(crate) work: State,
    pub(crate) slot: Slot,
    pub(crate) need: Option<u64>,
    /// When the round found the work (the dispatch latency runs from here).
    pub(crate) found: Instant,
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
    pub(crate) async fn seed_tasks(&self) -> Result<(), Error> {
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
    pub(crate) fn take_in(&self, task: &TaskName, read: Result<Option<DispatchRecord>, String>) {
        let live = self.engine.live_of(task).map(|l| l.token);
        if let Some(why) = self.work.take_in(task, read, live) {
            tracing::warn!(task = %task, why = %why, "task held from dispatch");
            self.engine
                .emit(EventKind::TaskHeld, &task.to_string(), "", 0, why);
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
    pub(crate) fn idle_slots(&self) -> Vec<Slot> {
        let now = Instant::now();
        let mut slots = self.sessions.slots(&self.engine.table(), now);
        {
            let mut inner = self.work.inner();
            inner.paused.retain(|_, until| *until > now);
            slots.retain(|s| !inner.paused.contains_key(&s.name));
        }
        for s in &mut slots {
            s.free = s.free.saturating_sub(self.work.offered_to(&s.session));
            // A run still stopping after its lease was released holds its worker: offering
            // it more work would only be declined.
            let unleased = self
                .work
                .unfinished_of(s.name.as_str())
                .iter()
                .filter(|(t, r)| self.engine.live_of(t).is_none_or(|l| l.token != r.token))
                .count();
            s.free = s.free.saturating_sub(unleased);
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
        let mut deliveries: Vec<TaskName> = Vec::new();
        let mut reworks: Vec<TaskName> = Vec::new();
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
            // A rework decided before a crash is finished first: its old code never lands.
            if self.work.inner().rework.contains_key(&task) {
                reworks.push(task);
                continue;
            }
            if state.phase.is_terminal() {
                self.settle(&task, state).await;
                if state.phase == automaton_workflow::Phase::Complete
                    && self.delivery_due(&task).await
                {
                    deliveries.push(task);
                }
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
            // Reviews whose branch moved since they read it send the task back to its code
            // review (seed 003: an approval does not authorize another revision). Checked at
            // once on an approved gate (it moves on this round), else every few seconds: a
            // repository read for every waiting review on every round cost the hand-offs
            // ~6 ms (the phases bench). A review offered in between records what it read,
            // and the chain catches the move when it ends.
            if state.phase.reviews_code()
                && state != State::open(automaton_workflow::Phase::CodeReview)
                && (state.is_approved() || self.work.review_check_due(&task))
                && let Some((read, head)) = self.review_moved(&task, state).await
            {
                if let Err(e) = self.review_again(&task, &read, &head).await {
                    self.hold_until_changed(&task, format!("cannot send the review back: {e}"));
                }
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
                    self.hold_until_changed(&task, e.to_string());
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
            let policy = self.engine.policy();
            let separated = policy.separated.contains(&work.phase);
            let implementers = if separated || work.phase == automaton_workflow::Phase::Implement {
                self.implementers_now(&task).await
            } else {
                Vec::new()
            };
            // Who may not claim it: the one rule the grant applies too.
            let refused: Vec<AgentId> = implementers
                .iter()
                .filter(|a| {
                    automaton_workflow::separation(
                        policy,
                        work.phase,
                        a,
                        &implementers,
                        automaton_workflow::Duty::Claim,
                    )
                    .is_err()
                })
                .cloned()
                .collect();
            let (excluded, preferred): (&[AgentId], &[AgentId]) = if separated {
                (&refused, &[])
            } else {
                (&[], &implementers)
            };
            let mut order = offer_order(
                sizing.need,
                &idle,
                excluded,
                preferred,
                retry.as_ref().map(|(_, failed, _)| failed),
            );
            // Implement never takes the last worker that could review it.
            if !preferred.is_empty() && !order.is_empty() {
                let live = self.sessions.working_names();
                order.retain(|&i| leaves_a_reviewer(&idle[i].name, preferred, &live));
                if order.is_empty() {
                    waiting.insert(
                        task.clone(),
                        format!(
                            "waiting: implement stays with the workers that implemented it ({}): on any other idle worker, no worker would be left to review it (reviewer ≠ implementer)",
                            names(preferred)
                        ),
                    );
                    continue;
                }
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
                            names(excluded)
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
        // Deliveries run beside the rounds, not in them: a merge queue or a forge's rate
        // limit must not hold up the offering of work. One at a time per task.
        for task in deliveries {
            if !self.work.inner().delivering.insert(task.clone()) {
                continue;
            }
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.advance_delivery(&task).await {
                    tracing::warn!(task = %task, error = %e, "delivery step failed");
                }
                me.work.inner().delivering.remove(&task);
            });
        }
        for task in reworks {
            let me = self.clone();
            running.spawn(async move {
                if let Err(e) = me.resume_rework(&task).await {
                    me.hold(&task, format!("cannot finish its rework: {e}"));
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
    pub(crate) async fn implementers_now(&self, task: &TaskName) -> Vec<AgentId> {
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
    pub(crate) async fn carry_out(self: &Arc<Self>, p: Planned) {
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
    pub(crate) async fn state_now(&self, task: &TaskName) -> Result<State, Error> {
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
    pub(crate) async fn next_work(
        &self,
        task: &TaskName,
        state: State,
    ) -> Result<Option<State>, Error> {
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
    pub(crate) async fn move_on(
        self: &Arc<Self>,
        task: &TaskName,
        state: State,
        target: State,
    ) -> bool {
        match self
            .engine
            .transition(task, target, &Presented::default())
            .await
        {
            Ok(_) => {
                self.engine.emit(
                    EventKind::Dispatched,
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
                self.hold_until_changed(task, format!("cannot move {state} → {target}: {e}"));
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
    pub(crate) async fn offer(
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
        self.record_run(
            task,
            &slot.name,
            state,
            live.token,
            automaton_workflow::RunState::Requested,
            None,
            "",
            -1,
        );
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
                lease: Some(crate::wire::lease_pb(&live, false)),
                artifact: state
                    .phase
                    .artifact()
                    .map(|a| a.file_name().to_string())
                    .unwrap_or_default(),
                can_edit: state.phase.allows_code_edits(),
                require_code_change: self.engine.policy().require_code_change,
                max_phase_time: Some(crate::wire::duration(self.work.max_phase_time)),
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
            EventKind::Assigned,
            &task.to_string(),
            slot.name.as_str(),
            live.token,
            format!("{state} (attempt {attempt}): {why}"),
        );
        Ok(true)
    }

    /// Offers nobody answered in time: their leases are released and the tasks offered again.
    pub(crate) async fn take_back_stale_offers(&self) {
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
                    self.engine.emit(
                        EventKind::OfferUnanswered,
                        &o.task.to_string(),
                        o.name.as_str(),
                        l.token,
                        format!(
                            "{}: no answer within {OFFER_TIMEOUT:?}: taken back",
                            l.state
                        ),
                    );
                    self.work.withdraw_offer(&o.task, o.name.as_str(), l.token);
                }
                let _ = self.engine.release(&id, None, None).await;
            }
        }
    }
}
