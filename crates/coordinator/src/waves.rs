//! Decomposed tasks: the sub-tasks a parent's `DECOMPOSITION.md` names, the waves they run
//! in, how large each is, and how the parent ends.
//!
//! - When a parent reaches `decomposition:approved`, each sub-task of its decomposition is
//!   created (`parent/sub`, with `PARENT_SPEC.md` and `VRAM_CONFIG.md`, "Fits within VRAM"
//!   judged against the fleet registered at that moment). Running it again changes nothing;
//!   an edited decomposition creates the new sub-tasks and reports the orphans.
//! - A sub-task is ready when everything it depends on is terminal; it needs a worker whose
//!   budget holds its estimated peak context (its separated phases — by default code review,
//!   which its implementer may not take — need half, so a sub-task only one worker can hold
//!   can still be reviewed).
//! - Sizing learns: the peak context agents report against their sub-task's estimate gives a
//!   ratio (bounded to 0.5–2) that corrects the estimates of the sub-tasks not yet dispatched.
//! - The parent completes when every sub-task passed; any FAIL or NEEDS_REVIEW makes it
//!   `human_intervention` with seed 002's counts.

use std::sync::Arc;
use std::time::SystemTime;

use automaton_workflow::{Decomposition, ParentOutcome, Phase, State, TaskName};

use crate::Error;
use crate::lease_ops::Presented;
use crate::state::Coordinator;

/// What a separated phase (its implementer may not take it) needs of the sub-task's estimate.
const SEPARATED_SHARE: f64 = 0.5;
/// Bounds of the learned correction.
const RATIO_MIN: f64 = 0.5;
const RATIO_MAX: f64 = 2.0;

/// What stands between a task and a worker besides its state.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sizing {
    /// The estimated peak context (tokens) a worker's budget must hold; `None`: unsized.
    pub need: Option<u64>,
    /// Why it may not start yet (its wave's predecessors), if so.
    pub blocked: Option<String>,
    /// Its wave (1, 2, …), for a sub-task.
    pub wave: Option<usize>,
}

/// A parent's decomposition as last read, with the file's identity (size, mtime).
#[derive(Clone)]
pub(crate) struct Plan {
    stamp: (u64, Option<SystemTime>),
    pub decomposition: Arc<Decomposition>,
    /// The folders of this plan's parent were checked for orphans (once per version of the
    /// decomposition: a listing of every task is not for every dispatch round).
    pub orphans_checked: bool,
}

fn sub_of(parent: &TaskName, leaf: &str) -> Result<TaskName, Error> {
    format!("{parent}/{leaf}")
        .parse()
        .map_err(|e: automaton_workflow::NameError| Error::Invalid(format!("sub-task name: {e}")))
}

impl Coordinator {
    /// `parent`'s decomposition, parsed (again only when the file changed).
    pub(crate) async fn plan_of(&self, parent: &TaskName) -> Result<Plan, Error> {
        let path = self
            .project
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
        let is_terminal = |dep: &str| {
            // A dependency that cannot name a sub-task is not waited for.
            let Ok(sub) = sub_of(&parent, dep) else {
                return true;
            };
            let terminal = self
                .states()
                .get(&sub)
                .is_some_and(|s| s.phase.is_terminal());
            terminal
                || (!self.states().contains_key(&sub)
                    && self
                        .project
                        .read_state(&sub)
                        .ok()
                        .flatten()
                        .is_some_and(|s| s.phase.is_terminal()))
        };
        if let Err(open) = ready(spec, is_terminal) {
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
        let base = self.work.need_of(task, spec.peak_context_tokens);
        let need = if self.policy.separated.contains(&state.phase) {
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
        for spec in &d.subtasks {
            let sub = sub_of(parent, &spec.name)?;
            planned.push(sub.clone());
            if self.project.task_dir(&sub).is_dir() {
                continue;
            }
            let wave = d.wave_of(&spec.name).unwrap_or(1);
            let fits = largest
                .as_ref()
                .is_some_and(|(b, _, _)| *b >= spec.peak_context_tokens);
            let config = self.sessions.vram_config_for(spec.peak_context_tokens);
            let vram = automaton_workflow::vram_config_md(
                &config,
                spec.peak_context_tokens,
                fits,
                largest.as_ref().map(|(b, w, _)| (w.as_str(), *b)),
            );
            let parent_spec =
                automaton_workflow::parent_spec_md(parent, spec, wave, &spec.depends_on);
            missing.push((
                sub.clone(),
                vec![
                    ("PARENT_SPEC.md", parent_spec.into_bytes()),
                    ("VRAM_CONFIG.md", vram.into_bytes()),
                ],
            ));
            notes.push((sub, wave, spec.peak_context_tokens, fits));
        }
        // All of them in one go: their folders' syncs run in parallel.
        let created = if missing.is_empty() {
            Vec::new()
        } else {
            let p = parent.clone();
            self.read(move |project| project.create_subtasks(&p, &missing))
                .await?
        };
        for (sub, wave, estimate, fits) in notes {
            if !created.contains(&sub) {
                continue;
            }
            self.states()
                .insert(sub.clone(), State::open(automaton_workflow::Phase::New));
            self.emit("task_created", &sub.to_string(), "", 0, "new".into());
            self.work.task_created(&sub);
            self.emit(
                "subtask_created",
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
                self.emit(
                    "subtask_too_large",
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
        self.end_parent(parent, &planned).await
    }

    /// Reports the sub-task folders of `parent` that `planned` no longer names (once each).
    async fn report_orphans(&self, parent: &TaskName, planned: &[TaskName]) -> Result<(), Error> {
        let on_disk = self
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
                self.emit(
                    "subtask_orphaned",
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

    /// Ends `parent` once its planned sub-tasks have (seed 002's aggregation).
    async fn end_parent(
        self: &Arc<Self>,
        parent: &TaskName,
        planned: &[TaskName],
    ) -> Result<(), Error> {
        // The parent ends when its sub-tasks have.
        let mut verdicts = Vec::new();
        for sub in planned {
            let state = self.state_of(sub).await;
            let verdict = if state.is_some_and(|s| s.phase.is_terminal()) {
                let verdict = automaton_workflow::Artifact::Verdict;
                (self.project.read_artifact_text(sub, verdict).ok().flatten())
                    .and_then(|t| automaton_workflow::parse_verdict(&t))
            } else {
                None
            };
            verdicts.push((sub.leaf().to_string(), verdict));
        }
        let agg = automaton_workflow::aggregate(&verdicts);
        let own = (self.project)
            .read_artifact_text(parent, automaton_workflow::Artifact::Verdict)
            .ok()
            .flatten()
            .and_then(|t| automaton_workflow::parse_verdict(&t));
        let (target, why) = match automaton_workflow::parent_outcome(&agg, own) {
            ParentOutcome::Waiting => return Ok(()),
            ParentOutcome::Complete => (
                Phase::Complete,
                format!("every sub-task passed ({})", agg.summary()),
            ),
            ParentOutcome::HumanIntervention { reason } => (Phase::HumanIntervention, reason),
        };
        self.transition(parent, State::open(target), &Presented::default())
            .await?;
        self.emit("parent_ended", &parent.to_string(), "", 0, why);
        Ok(())
    }

    /// A task's state, read once if not yet known.
    async fn state_of(&self, task: &TaskName) -> Option<State> {
        if let Some(s) = self.states().get(task) {
            return Some(*s);
        }
        let _guard = self.guard(task).await;
        self.touch(task).await.ok()
    }

    /// A completed run reported the peak context it used: learn from it.
    pub(crate) fn learned(&self, task: &TaskName, estimate: u64, actual: u64) {
        if estimate == 0 || actual == 0 {
            return;
        }
        if let Some(ratio) = self.work.learn(task, estimate, actual) {
            self.emit(
                "sizing_learned",
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

/// A sub-task's readiness: every sub-task it depends on is terminal. `Err`: the ones that
/// are not, in the order written.
pub(crate) fn ready(
    spec: &automaton_workflow::SubtaskSpec,
    is_terminal: impl Fn(&str) -> bool,
) -> Result<(), Vec<String>> {
    let open: Vec<String> = spec
        .depends_on
        .iter()
        .filter(|d| !is_terminal(d))
        .cloned()
        .collect();
    if open.is_empty() { Ok(()) } else { Err(open) }
}

/// The learned correction from (estimate, actual) pairs: Σ actual / Σ estimate, bounded.
pub(crate) fn ratio(samples: &[(u64, u64)]) -> Option<f64> {
    let (e, a) = samples.iter().fold((0u128, 0u128), |(e, a), (x, y)| {
        (e + *x as u128, a + *y as u128)
    });
    (e > 0).then(|| (a as f64 / e as f64).clamp(RATIO_MIN, RATIO_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_learned_ratio_is_actual_over_estimate_and_bounded() {
        assert_eq!(ratio(&[]), None);
        assert_eq!(ratio(&[(10_000, 8_000), (10_000, 10_000)]), Some(0.9));
        assert_eq!(ratio(&[(10_000, 1)]), Some(RATIO_MIN));
        assert_eq!(ratio(&[(10, 1_000_000)]), Some(RATIO_MAX));
    }
}
