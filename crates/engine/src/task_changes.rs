//! Changes of a task through the store — transition, approve, create — each under the task's
//! guard and carried out whole once started (see `Engine::to_completion`).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use automaton_store::ApproveOutcome;
use automaton_workflow::{EventKind, LeaseEnd, State, TaskName};

use crate::Error;
use crate::engine::Engine;
use crate::lease_ops::Presented;
use crate::table::Live;

/// Completion records written since the last prune, by this process.
static RECORDED: AtomicU64 = AtomicU64::new(0);

/// Prunes old completion records at the first completion after a start and every 1024
/// after: the folder holds about a day of completions.
pub(crate) fn prune_now_and_then(project: &automaton_store::Project) {
    if !RECORDED
        .fetch_add(1, Ordering::Relaxed)
        .is_multiple_of(1024)
    {
        return;
    }
    let before = SystemTime::now()
        .checked_sub(automaton_store::COMPLETION_RECORD_AGE)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    if let Err(e) = project.prune_completions(before) {
        tracing::warn!("pruning old completion records failed: {e}");
    }
}

impl Engine {
    /// Moves `task` to `target`; the lease (if any) ends with the phase it was granted for.
    #[tracing::instrument(
        name = "task.transition",
        skip_all,
        fields(
            automaton.task = %task,
            automaton.target = %target,
            automaton.agent = p.agent.as_ref().map(|a| a.as_str()),
            automaton.token = p.token,
            automaton.from = tracing::field::Empty,
        )
    )]
    pub async fn transition(
        self: &Arc<Self>,
        task: &TaskName,
        target: State,
        p: &Presented,
    ) -> Result<(State, Option<Live>), Error> {
        let (t, p) = (task.clone(), p.clone());
        let out = self
            .to_completion(task, move |c| async move {
                c.transition_guarded(&t, target, &p).await
            })
            .await;
        let span = tracing::Span::current();
        match &out {
            Ok((from, _)) => {
                span.record("automaton.from", tracing::field::display(from));
            }
            Err(e) => automaton_telemetry::trace::record_error(&span, &e.to_string()),
        }
        out
    }

    /// [`Engine::transition`] under the task's guard.
    pub async fn transition_guarded(
        &self,
        task: &TaskName,
        target: State,
        p: &Presented,
    ) -> Result<(State, Option<Live>), Error> {
        self.touch_for_change(task).await?;
        let live = self.check_presented(task, p)?;
        if live.is_some()
            && let Some(h) = self.hooks()
        {
            // Its counts are known before the move changes them.
            h.load_counts(task).await;
        }
        let project = self.project.clone();
        let holders = self.holders.clone();
        let t = task.clone();
        let ending = live.clone();
        let from = tokio::task::spawn_blocking(move || {
            // The phase's holders in the task's files before the task moves on: by the time
            // anyone can approve or review it, the files say who held it. A move the
            // lifecycle refuses writes nothing at all.
            project.check_transition_owned(&t, target)?;
            holders.flush(&project, &t)?;
            let from = project.transition_owned(&t, target)?;
            // Which lease moved the task, before its end is logged: a retry of this
            // completion under the ended lease is answered from it (`work_service.rs`).
            if let Some(l) = ending {
                let done = automaton_store::Completion {
                    lease_id: l.lease_id,
                    token: l.token,
                    agent: l.agent,
                    task: t.clone(),
                    from,
                    to: target,
                };
                if let Err(e) = project.record_completion(&done) {
                    tracing::warn!(task = %t, "no completion record (a retry will be refused): {e}");
                }
                prune_now_and_then(&project);
            }
            Ok::<_, Error>(from)
        })
        .await
        .map_err(|e| Error::Internal(format!("transition task failed: {e}")))??;
        self.states().insert(task.clone(), target);
        let ended = match live {
            Some(l) => {
                // Counted before the lease ends: no round can offer the next phase first.
                let asked = self.hooks().is_some_and(|h| h.phase_done(task));
                let removed = self.take_and_end(&mut self.table(), task);
                let ended = match removed {
                    Some(r) => Some(self.end(r?, LeaseEnd::Transitioned).await?),
                    None => Some(l),
                };
                // A manual-mode run request just used up is gone from disk before the answer
                // (a restart must not run a phase nobody asked for). The count itself is in
                // force at once (the limit is exact) and is written with the run's `stopped`,
                // which follows: the hand-off waits for no write of its own.
                if asked && let Some(h) = self.hooks() {
                    h.save_run_request(task).await;
                }
                ended
            }
            None => None,
        };
        self.emit_moved(
            &task.to_string(),
            p.agent.as_ref().map_or("", |a| a.as_str()),
            0,
            (from, target),
            "",
        );
        self.task_changed();
        Ok((from, ended))
    }

    /// Moves `task` to `human_intervention` for a person, as the orchestrator: artifacts out
    /// of order do not refuse it (see `Project::escalate_owned`). A task under a live lease
    /// is left to its holder. Returns the state it left.
    pub async fn escalate(self: &Arc<Self>, task: &TaskName) -> Result<State, Error> {
        let t = task.clone();
        self.to_completion(task, move |c| async move {
            c.touch_for_change(&t).await?;
            if c.live_of(&t).is_some() {
                return Err(Error::Refused(format!(
                    "{t} is held under a lease: its holder moves it"
                )));
            }
            let (project, t2) = (c.project.clone(), t.clone());
            let from = tokio::task::spawn_blocking(move || project.escalate_owned(&t2))
                .await
                .map_err(|e| Error::Internal(format!("escalate task failed: {e}")))??;
            let target = State::open(automaton_workflow::Phase::HumanIntervention);
            c.states().insert(t.clone(), target);
            c.emit_moved(&t.to_string(), "", 0, (from, target), "");
            c.task_changed();
            Ok(from)
        })
        .await
    }

    /// Approves for `approver`; the live lease holder is never its own approver.
    /// A code review's approval is bound to the task branch's head, which must be
    /// `revision` when one is given.
    pub async fn approve(
        self: &Arc<Self>,
        task: &TaskName,
        approver: &str,
        revision: Option<String>,
    ) -> Result<ApproveOutcome, Error> {
        let (t, a) = (task.clone(), approver.to_string());
        self.to_completion(task, move |c| async move {
            c.approve_guarded(&t, &a, revision).await
        })
        .await
    }

    /// [`Engine::approve`] under the task's guard.
    pub async fn approve_guarded(
        &self,
        task: &TaskName,
        approver: &str,
        revision: Option<String>,
    ) -> Result<ApproveOutcome, Error> {
        self.touch_for_change(task).await?;
        let holder = self.lease_of(task).map(|l| l.agent);
        let project = self.project.clone();
        let holders = self.holders.clone();
        let (t, a) = (task.clone(), approver.to_string());
        let out = tokio::task::spawn_blocking(move || {
            // Every holder of the task in its files first: none may approve its own phase.
            holders.flush(&project, &t)?;
            project
                .approve_as(
                    &t,
                    &a,
                    holder.as_ref(),
                    revision.as_deref(),
                    SystemTime::now(),
                )
                .map_err(Error::from)
        })
        .await
        .map_err(|e| Error::Internal(format!("approve task failed: {e}")))??;
        self.states().insert(task.clone(), out.to);
        self.emit(
            EventKind::Approved,
            &task.to_string(),
            approver,
            0,
            format!("{} → {}", out.from, out.to),
        );
        self.task_changed();
        Ok(out)
    }

    pub async fn create_task(self: &Arc<Self>, task: &TaskName) -> Result<(), Error> {
        let t = task.clone();
        self.to_completion(
            task,
            move |c| async move { c.create_task_guarded(&t).await },
        )
        .await
    }

    /// [`Engine::create_task`] under the task's guard.
    pub async fn create_task_guarded(&self, task: &TaskName) -> Result<(), Error> {
        let project = self.project.clone();
        let t = task.clone();
        tokio::task::spawn_blocking(move || project.create_task(&t))
            .await
            .map_err(|e| Error::Internal(format!("create task failed: {e}")))??;
        self.states()
            .insert(task.clone(), State::open(automaton_workflow::Phase::New));
        self.emit(
            EventKind::TaskCreated,
            &task.to_string(),
            "",
            0,
            "new".into(),
        );
        if let Some(h) = self.hooks() {
            h.task_created(task);
        }
        Ok(())
    }

    /// Tells dispatch a task changed.
    fn task_changed(&self) {
        if let Some(h) = self.hooks() {
            h.task_changed();
        }
    }
}
