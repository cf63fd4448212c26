//! Holds and manual mode: the limits that hold a task from dispatch (attempts, iterations,
//! total time), a finished task's follow-ups, an operator's hold, `automaton run` and
//! `automaton stop`.

use std::sync::Arc;
use std::time::Duration;

use automaton_proto::v1 as pb;
use automaton_workflow::{AgentId, Artifact, EventKind, State, TaskName};

use crate::Error;
use crate::state::Coordinator;

use super::policy::{STOPPED_BY, awaits_a_person};
use super::work::Hold;

impl Coordinator {
    /// Why `task` may run no more under seed 002's loop limits, if so.
    pub(crate) fn over_limits(&self, task: &TaskName) -> Option<String> {
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
    pub(crate) async fn settle(self: &Arc<Self>, task: &TaskName, state: State) {
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
                EventKind::HumanIntervention,
                &task.to_string(),
                "",
                0,
                format!("{line} (autopilot creates no fix, review or tie-break tasks: a person decides how to go on)"),
            );
            return;
        }
        self.engine.emit(
            EventKind::HumanIntervention,
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
                        EventKind::FollowUpCreated,
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
        self.hold_with(task, why, durable, false)
    }

    /// Holds `task` because the lifecycle refused a move its own files decide (a stale
    /// approval, a bad `Next:` line): lifted by the next approval or transition of the task
    /// ([`Coordinator::task_changed_by_person`]), not only by `--resume`.
    pub(crate) fn hold_until_changed(&self, task: &TaskName, why: String) {
        self.hold_with(task, why, false, true);
    }

    fn hold_with(&self, task: &TaskName, why: String, durable: bool, lifts: bool) -> bool {
        let new = {
            let mut inner = self.work.inner();
            let hold = Hold {
                why: why.clone(),
                durable,
                lifts_on_change: lifts,
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
                .emit(EventKind::TaskHeld, &task.to_string(), "", 0, detail);
        }
        new
    }

    /// A person approved or moved `task`: a hold waiting for exactly that (see
    /// [`Coordinator::hold_until_changed`]) is lifted, and dispatch looks at the task again.
    pub(crate) fn task_changed_by_person(&self, task: &TaskName, what: &str) {
        let lifted = {
            let mut inner = self.work.inner();
            match inner.held.get(task) {
                Some(h) if h.lifts_on_change => inner.held.remove(task),
                _ => None,
            }
        };
        if let Some(h) = lifted {
            self.engine.emit(
                EventKind::TaskResumed,
                &task.to_string(),
                "",
                0,
                format!("{what}: the hold ({}) is lifted", h.why),
            );
        }
        self.work.poke();
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
            EventKind::RunRequested,
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
            self.engine.emit(
                EventKind::TaskResumed,
                &task.to_string(),
                "",
                0,
                format!("by {by}"),
            );
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
