//! Decomposed tasks, as dispatch drives them: a parent's plan read from its
//! `DECOMPOSITION.md`, each sub-task's sizing, each passed sub-task merged into the parent's
//! branch (a dependent waits for that merge), a parent moved on as its waves pass or fail,
//! orphans reported, and what completed runs teach the sizing ratio.

use std::sync::Arc;
use std::time::SystemTime;

use automaton_engine::Presented;
use automaton_workflow::{Decomposition, EventKind, ParentOutcome, Phase, State, TaskName};

use super::waves::{
    Dep, Plan, RATIO_MAX, RATIO_MIN, SEPARATED_SHARE, Sizing, Unready, VRAM_CONFIG, ready,
};
use crate::Error;
use crate::state::Coordinator;

fn sub_of(parent: &TaskName, leaf: &str) -> Result<TaskName, Error> {
    format!("{parent}/{leaf}")
        .parse()
        .map_err(|e: automaton_workflow::NameError| Error::Invalid(format!("sub-task name: {e}")))
}

impl Coordinator {
    /// `parent`'s decomposition, parsed (again only when the file changed).
    pub(crate) async fn plan_of(&self, parent: &TaskName) -> Result<Plan, Error> {
        let path = self
            .engine
            .project()
            .task_dir(parent)
            .join(automaton_workflow::Artifact::Decomposition.file_name());
        let meta = std::fs::symlink_metadata(&path).ok();
        let stamp = (
            meta.as_ref().map_or(0, |m| m.len()),
            meta.as_ref().and_then(|m| m.modified().ok()),
        );
        if let Some(p) = self.work.plan(parent)
            && p.stamp == stamp
        {
            return Ok(p);
        }
        // Through the store (never a link): its sections become sub-tasks' PARENT_SPEC.md.
        let t = parent.clone();
        let text = self
            .engine
            .read(move |p| p.read_artifact_text(&t, automaton_workflow::Artifact::Decomposition))
            .await?
            .ok_or_else(|| {
                Error::Refused(format!(
                    "{parent}: cannot read {} (it does not exist): write it, then approve again",
                    path.display()
                ))
            })?;
        let d = automaton_workflow::parse_decomposition(&text)
            .map_err(|e| Error::Refused(format!("{parent}: DECOMPOSITION.md: {e}")))?;
        let plan = Plan {
            stamp,
            decomposition: Arc::new(d),
            orphans_checked: false,
        };
        self.work.set_plan(parent, plan.clone());
        Ok(plan)
    }

    /// A task's size and readiness for the work `state`.
    pub(crate) async fn sizing(&self, task: &TaskName, state: State) -> Sizing {
        let Some(parent) = task.parent() else {
            return Sizing::default();
        };
        let plan = match self.plan_of(&parent).await {
            Ok(p) => p,
            Err(e) => {
                return Sizing {
                    blocked: Some(format!("waiting: the parent's decomposition: {e}")),
                    ..Sizing::default()
                };
            }
        };
        let d = &plan.decomposition;
        let leaf = task.leaf().to_string();
        let Some(spec) = d.get(&leaf) else {
            return Sizing {
                blocked: Some(
                    "orphaned: no longer in the parent's DECOMPOSITION.md (not dispatched)".into(),
                ),
                ..Sizing::default()
            };
        };
        let wave = d.wave_of(&leaf);
        let dep = |dep: &str| {
            // A dependency that cannot name a sub-task is not waited for.
            let Ok(sub) = sub_of(&parent, dep) else {
                return Dep::Passed;
            };
            let known = self.engine.states().get(&sub).copied();
            // Not known yet: its file (read with the states' lock released).
            let state = known.or_else(|| self.engine.project().read_state(&sub).ok().flatten());
            match state.map(|s| s.phase) {
                // Its code must be on the parent's branch, where the dependent starts.
                Some(Phase::Complete) => match self.engine.project().merged_into_parent(&sub) {
                    Ok(true) => Dep::Passed,
                    Ok(false) | Err(_) => Dep::Unmerged,
                },
                Some(p) if p.is_terminal() => Dep::Ended(p.to_string()),
                _ => Dep::Open,
            }
        };
        match ready(spec, dep) {
            Ok(()) => {}
            Err(Unready { failed, .. }) if !failed.is_empty() => {
                // Seed 002: on FAIL the orchestrator pauses for a person; the next wave starts
                // only when what it depends on passed.
                return Sizing {
                    blocked: Some(format!(
                        "waiting for a person: {} did not pass ({}), and wave {} starts only when what it depends on passes: fix it, or drop the dependency from the parent's DECOMPOSITION.md",
                        failed
                            .iter()
                            .map(|(n, _)| n.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        failed
                            .iter()
                            .map(|(_, s)| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        wave.unwrap_or(0),
                    )),
                    wave,
                    ..Sizing::default()
                };
            }
            Err(Unready { open, unmerged, .. }) if open.is_empty() => {
                return Sizing {
                    blocked: Some(format!(
                        "waiting: wave {} starts when {} {} merged into {}'s branch",
                        wave.unwrap_or(0),
                        unmerged.join(", "),
                        if unmerged.len() == 1 { "is" } else { "are" },
                        parent
                    )),
                    wave,
                    ..Sizing::default()
                };
            }
            Err(Unready { open, .. }) => {
                return Sizing {
                    blocked: Some(format!(
                        "waiting: wave {} starts when {} {} terminal",
                        wave.unwrap_or(0),
                        open.join(", "),
                        if open.len() == 1 { "is" } else { "are" }
                    )),
                    wave,
                    ..Sizing::default()
                };
            }
        }
        let base = self.work.need_of(task, spec.peak_context_tokens);
        let need = if self.engine.policy().separated.contains(&state.phase) {
            ((base as f64) * SEPARATED_SHARE).ceil() as u64
        } else {
            base
        };
        Sizing {
            need: Some(need),
            blocked: None,
            wave,
        }
    }

    /// A parent at `decomposition:approved`: makes its sub-tasks (idempotent), reports
    /// orphans, and ends it once its sub-tasks have.
    pub(crate) async fn advance_parent(self: &Arc<Self>, parent: &TaskName) -> Result<(), Error> {
        let plan = self.plan_of(parent).await?;
        let d = plan.decomposition.clone();
        let largest = self.sessions.largest_budget();
        let mut planned = Vec::new();
        let mut missing = Vec::new();
        let mut notes = Vec::new();
        let mut restore = Vec::new();
        for spec in &d.subtasks {
            let sub = sub_of(parent, &spec.name)?;
            planned.push(sub.clone());
            let fits = largest
                .as_ref()
                .is_some_and(|(b, _, _)| *b >= spec.peak_context_tokens);
            let vram = || {
                let config = self.sessions.vram_config_for(spec.peak_context_tokens);
                automaton_workflow::vram_config_md(
                    &config,
                    spec.peak_context_tokens,
                    fits,
                    largest.as_ref().map(|(b, w, _)| (w.as_str(), *b)),
                )
            };
            let dir = self.engine.project().task_dir(&sub);
            if dir.is_dir() {
                // Seed 002: a missing VRAM_CONFIG.md is made again from what is detected now.
                if std::fs::symlink_metadata(dir.join(VRAM_CONFIG)).is_err() {
                    restore.push((sub.clone(), vram()));
                }
                continue;
            }
            let wave = d.wave_of(&spec.name).unwrap_or(1);
            let vram = vram();
            let parent_spec =
                automaton_workflow::parent_spec_md(parent, spec, wave, &spec.depends_on);
            missing.push((
                sub.clone(),
                vec![
                    ("PARENT_SPEC.md", parent_spec.into_bytes()),
                    (VRAM_CONFIG, vram.into_bytes()),
                ],
            ));
            notes.push((sub, wave, spec.peak_context_tokens, fits));
        }
        for (sub, vram) in restore {
            let s = sub.clone();
            if self
                .engine
                .read(move |p| p.restore_subtask_file(&s, VRAM_CONFIG, vram.as_bytes()))
                .await?
            {
                self.engine.emit(
                    EventKind::VramConfigRecreated,
                    &sub.to_string(),
                    "",
                    0,
                    "VRAM_CONFIG.md was missing: made again from the fleet registered now (seed 002)"
                        .into(),
                );
            }
        }
        // All of them in one go: their folders' syncs run in parallel.
        let created = if missing.is_empty() {
            Vec::new()
        } else {
            let p = parent.clone();
            self.engine
                .read(move |project| project.create_subtasks(&p, &missing))
                .await?
        };
        for (sub, wave, estimate, fits) in notes {
            if !created.contains(&sub) {
                continue;
            }
            self.engine
                .states()
                .insert(sub.clone(), State::open(automaton_workflow::Phase::New));
            self.engine.emit(
                EventKind::TaskCreated,
                &sub.to_string(),
                "",
                0,
                "new".into(),
            );
            self.work.task_created(&sub);
            self.engine.emit(
                EventKind::SubtaskCreated,
                &sub.to_string(),
                "",
                0,
                format!(
                    "wave {wave}, estimated peak context {}k tokens{}",
                    estimate / 1000,
                    if fits {
                        ""
                    } else {
                        ", fits no registered worker"
                    }
                ),
            );
            if !fits {
                self.engine.emit(
                    EventKind::SubtaskTooLarge,
                    &sub.to_string(),
                    "",
                    0,
                    format!(
                        "needs {}k tokens; the largest worker holds {}: split it (seed 002's VRAM-aware splitting) or add a larger worker",
                        estimate / 1000,
                        largest
                            .as_ref()
                            .map_or("nothing (no worker)".to_string(), |(b, w, g)| format!(
                                "{}k ({w}, {g})",
                                b / 1000
                            ))
                    ),
                );
            }
        }
        // Folders the decomposition no longer names: reported once, left out of the end.
        // Looked for once per version of the decomposition.
        if !plan.orphans_checked {
            self.report_orphans(parent, &planned).await?;
            self.work.set_plan(
                parent,
                Plan {
                    orphans_checked: true,
                    ..plan
                },
            );
        }
        let merged = self.integrate(parent, &planned).await?;
        self.end_parent(parent, d, merged).await
    }

    /// Merges every planned sub-task that passed into `parent`'s branch (issue 31), under the
    /// parent's guard, each once: a sub-task already merged writes nothing. A merge that
    /// conflicts is an error naming the paths (the caller holds the parent with it, for a
    /// person), and nothing of it is written. Returns whether every planned sub-task's code
    /// is now on the parent's branch (one without a branch has none to merge).
    async fn integrate(
        self: &Arc<Self>,
        parent: &TaskName,
        planned: &[TaskName],
    ) -> Result<bool, Error> {
        let project = self.engine.project();
        let mut all = true;
        for sub in planned {
            if project.merged_into_parent(sub).unwrap_or(false) {
                continue;
            }
            // Read from the files, as the parent's standing is: a sub-task's move to
            // `complete` is durable there before the table of states hears of it.
            let passed = project
                .read_state(sub)
                .ok()
                .flatten()
                .is_some_and(|st| st.phase == Phase::Complete);
            // A sub-task being sent back to implement is not merged: its code is the old one.
            if !passed || self.work.inner().rework.contains_key(sub) {
                all = false;
                continue;
            }
            let s = sub.clone();
            let merged = self
                .engine
                .to_completion(parent, move |c| async move {
                    let project = c.project().clone();
                    tokio::task::spawn_blocking(move || project.merge_into_parent(&s))
                        .await
                        .map_err(|e| Error::Internal(format!("a merge failed: {e}")))?
                        .map_err(Error::from)
                })
                .await;
            let merged = match merged {
                Ok(m) => m,
                // Another sub-task changed the same lines first: this one goes back to
                // implement on the parent's head as it is now (or waits for a person).
                Err(Error::Store(automaton_store::Error::MergeConflict { paths, .. })) => {
                    all = false;
                    let p = parent.clone();
                    let onto = self
                        .engine
                        .read(move |pr| pr.branch_head(&p))
                        .await?
                        .unwrap_or_default();
                    let why = format!(
                        "{sub}'s merge into {}'s branch conflicts in {}",
                        parent,
                        paths.join(", ")
                    );
                    match self.rework(sub, onto, why).await? {
                        super::delivery::Reworked::Sent => continue,
                        super::delivery::Reworked::ForAPerson(line) => {
                            if self.hold_as(parent, line, true) {
                                self.save_dispatch(parent).await?;
                            }
                            return Ok(false);
                        }
                    }
                }
                Err(e) => return Err(e),
            };
            let how = match &merged {
                automaton_store::Integrated::NoCode => continue,
                automaton_store::Integrated::Already { .. } => continue,
                automaton_store::Integrated::FastForward { .. } => "fast-forward",
                automaton_store::Integrated::Merged { .. } => "merge commit",
            };
            self.engine.emit(
                EventKind::SubtaskMerged,
                &sub.to_string(),
                "",
                0,
                format!(
                    "into {} at {} ({how})",
                    automaton_store::branch_name(parent),
                    merged.parent_head().unwrap_or_default()
                ),
            );
        }
        Ok(all)
    }

    /// Reports the sub-task folders of `parent` that `planned` no longer names (once each).
    async fn report_orphans(&self, parent: &TaskName, planned: &[TaskName]) -> Result<(), Error> {
        let on_disk = self
            .engine
            .read({
                let parent = parent.clone();
                move |p| {
                    Ok(p.list(SystemTime::now())?
                        .into_iter()
                        .find(|e| e.task == parent)
                        .map(|e| e.subtasks.into_iter().map(|s| s.task).collect::<Vec<_>>())
                        .unwrap_or_default())
                }
            })
            .await?;
        for orphan in on_disk.iter().filter(|s| !planned.contains(s)) {
            if self.work.mark_orphan(orphan) {
                self.engine.emit(
                    EventKind::SubtaskOrphaned,
                    &orphan.to_string(),
                    "",
                    0,
                    "no longer in the parent's DECOMPOSITION.md: left out of the parent's completion"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// Ends `parent` once its planned sub-tasks have (seed 002's aggregation, read from the
    /// files as every view reads it) — `complete` only once every one is merged into its
    /// branch. A parent that needs a person goes to `human_intervention` whatever artifacts
    /// it holds (its own `VERDICT.md` saying PASS, say): the move hands them to that person.
    async fn end_parent(
        self: &Arc<Self>,
        parent: &TaskName,
        plan: Arc<Decomposition>,
        merged: bool,
    ) -> Result<(), Error> {
        let p = parent.clone();
        // The plan as this round has it (parsed once per version of the file).
        let standing = self
            .engine
            .read(move |pr| Ok(pr.standing_of(&p, &plan)))
            .await?;
        let why = match standing.outcome {
            ParentOutcome::Waiting => return Ok(()),
            // Every verdict says PASS, but a sub-task whose verdict is written may not be
            // `complete` (nor merged) yet: the parent holds all their code before it ends.
            ParentOutcome::Complete if !merged => return Ok(()),
            ParentOutcome::Complete => {
                self.engine
                    .transition(parent, State::open(Phase::Complete), &Presented::default())
                    .await?;
                format!("every sub-task passed ({})", standing.verdicts.summary)
            }
            o @ ParentOutcome::HumanIntervention { .. } => {
                self.engine.escalate(parent).await?;
                o.to_string()
            }
        };
        self.engine
            .emit(EventKind::ParentEnded, &parent.to_string(), "", 0, why);
        Ok(())
    }

    /// A completed run reported the peak context it used: learn from it.
    pub(crate) fn learned(&self, task: &TaskName, estimate: u64, actual: u64) {
        if estimate == 0 || actual == 0 {
            return;
        }
        if let Some(ratio) = self.work.learn(task, estimate, actual) {
            self.engine.emit(
                EventKind::SizingLearned,
                &task.to_string(),
                "",
                0,
                format!(
                    "used {}k of an estimated {}k tokens; estimates of sub-tasks not yet dispatched are now scaled by {ratio:.2} (bounded {RATIO_MIN}–{RATIO_MAX})",
                    actual / 1000,
                    estimate / 1000
                ),
            );
        }
    }
}
