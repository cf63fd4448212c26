//! Where a decomposed parent stands with its sub-tasks (seed 002: the orchestrator "MUST
//! aggregate sub-task verdicts when reporting the parent task's status"), and seed 002's
//! `⚠️ **HUMAN INTERVENTION REQUIRED**: {reason}` line for a task that needs a person. Read
//! from the files alone, so the coordinator, `status --task` without one and every listing
//! say the same; nothing here writes.

use automaton_workflow::{
    Artifact, Decomposition, ParentOutcome, Phase, State, TaskName, Verdict, aggregate,
    parent_outcome, parse_decomposition, parse_verdict,
};
use serde::{Deserialize, Serialize};

use crate::{Error, Project};

/// A decomposed parent's sub-tasks' verdicts, counted over the sub-tasks its
/// `DECOMPOSITION.md` plans (an orphaned folder is not counted).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubtaskVerdicts {
    pub pass: u32,
    pub fail: u32,
    pub needs_review: u32,
    /// Sub-tasks without a verdict: not terminal yet, or terminal with no readable verdict.
    pub no_verdict: u32,
    /// The planned sub-tasks not in a terminal state yet, in the decomposition's order.
    pub not_terminal: Vec<String>,
    /// Seed 002's counts: `PASS: 2, FAIL: 1, NEEDS_REVIEW: 0, no verdict: 1`.
    pub summary: String,
}

/// A parent's standing: its sub-tasks' verdicts and what seed 002 makes of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParentStanding {
    pub verdicts: SubtaskVerdicts,
    pub outcome: ParentOutcome,
}

/// Seed 002's line for a task that needs a person, with its reason.
pub fn human_intervention_line(reason: &str) -> String {
    ParentOutcome::HumanIntervention {
        reason: reason.to_string(),
    }
    .to_string()
}

impl Project {
    /// `parent`'s standing, when it was decomposed (its state is `decomposition:approved` or
    /// terminal and its `DECOMPOSITION.md` reads as a plan); `None` otherwise.
    pub fn parent_standing(
        &self,
        parent: &TaskName,
        state: Option<State>,
    ) -> Result<Option<ParentStanding>, Error> {
        let decomposed = state
            .is_some_and(|s| s == State::approved(Phase::Decomposition) || s.phase.is_terminal());
        if parent.is_subtask() || !decomposed {
            return Ok(None);
        }
        let Some(text) = self.read_artifact_text(parent, Artifact::Decomposition)? else {
            return Ok(None);
        };
        let Ok(plan) = parse_decomposition(&text) else {
            return Ok(None);
        };
        Ok(Some(self.standing_of(parent, &plan)))
    }

    /// `parent`'s standing under `plan` (its parsed decomposition, as a caller that keeps one
    /// has it): each planned sub-task's state and verdict read from its files.
    pub fn standing_of(&self, parent: &TaskName, plan: &Decomposition) -> ParentStanding {
        let mut verdicts = Vec::new();
        let mut not_terminal = Vec::new();
        for spec in &plan.subtasks {
            let Ok(sub) = parent.subtask(&spec.name) else {
                continue;
            };
            let terminal = self
                .read_state(&sub)
                .ok()
                .flatten()
                .is_some_and(|s| s.phase.is_terminal());
            let verdict = if terminal {
                self.verdict_of(&sub)
            } else {
                not_terminal.push(spec.name.clone());
                None
            };
            verdicts.push((spec.name.clone(), verdict));
        }
        let agg = aggregate(&verdicts);
        let outcome = parent_outcome(&agg, self.verdict_of(parent));
        let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
        ParentStanding {
            verdicts: SubtaskVerdicts {
                pass: count(agg.pass),
                fail: count(agg.fail),
                needs_review: count(agg.needs_review),
                no_verdict: count(agg.missing),
                not_terminal,
                summary: agg.summary(),
            },
            outcome,
        }
    }

    /// Seed 002's `⚠️ **HUMAN INTERVENTION REQUIRED**: {reason}` for a task in
    /// `human_intervention` (a parent's reason is its sub-tasks' aggregation; another task's,
    /// its verdict); `None` for a task in any other state.
    pub fn attention(
        &self,
        task: &TaskName,
        state: Option<State>,
        standing: Option<&ParentStanding>,
    ) -> Option<String> {
        if state.map(|s| s.phase) != Some(Phase::HumanIntervention) {
            return None;
        }
        if let Some(ParentStanding {
            outcome: o @ ParentOutcome::HumanIntervention { .. },
            ..
        }) = standing
        {
            return Some(o.to_string());
        }
        let reason = match self.verdict_of(task) {
            Some(v @ (Verdict::Fail | Verdict::NeedsReview)) => format!(
                "VERDICT.md says {v}: a person decides how to go on (fix, review or tie-break tasks; in manual mode they are made from the verdict)"
            ),
            _ => "the task is in human_intervention: a person decides how to go on".to_string(),
        };
        Some(human_intervention_line(&reason))
    }

    /// The verdict `task`'s `VERDICT.md` states, if it can be read.
    fn verdict_of(&self, task: &TaskName) -> Option<Verdict> {
        self.read_artifact_text(task, Artifact::Verdict)
            .ok()
            .flatten()
            .and_then(|t| parse_verdict(&t))
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::project::tests::{name, project};

    const PLAN: &str = "| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n| --- | --- | --- | --- |\n| a | - | 4 | a works |\n| b | a | 4 | b works |\n| c | - | 4 | c works |\n";

    fn sub(p: &Project, parent: &str, leaf: &str, state: &str, verdict: Option<&str>) {
        let dir = p.task_dir(&name(parent)).join("subtasks").join(leaf);
        fs::create_dir_all(&dir).expect("mkdir");
        fs::write(dir.join(".state"), format!("{state}\n")).expect("state");
        if let Some(v) = verdict {
            fs::write(
                dir.join("VERDICT.md"),
                format!("# Verdict\n\nVerdict: {v}\n"),
            )
            .expect("verdict");
        }
    }

    #[test]
    fn a_parent_counts_its_planned_subtasks_verdicts_and_names_the_open_ones() {
        let (_d, p) = project();
        let parent = name("shop");
        fs::create_dir_all(p.task_dir(&parent)).expect("mkdir");
        fs::write(p.task_dir(&parent).join("DECOMPOSITION.md"), PLAN).expect("plan");
        sub(&p, "shop", "a", "human_intervention", Some("FAIL"));
        sub(&p, "shop", "b", "new", None);
        sub(&p, "shop", "c", "complete", Some("PASS"));
        // An orphan is not counted.
        sub(&p, "shop", "gone", "complete", Some("FAIL"));
        let approved = Some(State::approved(Phase::Decomposition));
        let s = p
            .parent_standing(&parent, approved)
            .expect("read")
            .expect("a decomposed parent");
        assert_eq!(
            (s.verdicts.pass, s.verdicts.fail, s.verdicts.needs_review),
            (1, 1, 0)
        );
        assert_eq!(s.verdicts.no_verdict, 1);
        assert_eq!(s.verdicts.not_terminal, ["b"]);
        assert_eq!(
            s.verdicts.summary,
            "PASS: 1, FAIL: 1, NEEDS_REVIEW: 0, no verdict: 1"
        );
        assert!(matches!(s.outcome, ParentOutcome::HumanIntervention { .. }));
        // Before it was decomposed there is nothing to aggregate.
        let open = Some(State::open(Phase::Decomposition));
        assert_eq!(p.parent_standing(&parent, open).expect("read"), None);
        // Its line, once it needs a person.
        let hi = Some(State::open(Phase::HumanIntervention));
        let line = p.attention(&parent, hi, Some(&s)).expect("a line");
        assert!(
            line.starts_with("⚠️ **HUMAN INTERVENTION REQUIRED**: sub-task(s) a (FAIL)"),
            "{line}"
        );
        assert_eq!(p.attention(&parent, approved, Some(&s)), None);
    }

    #[test]
    fn a_task_in_human_intervention_says_so_with_its_verdict() {
        let (_d, p) = project();
        let t = name("t");
        fs::create_dir_all(p.task_dir(&t)).expect("mkdir");
        fs::write(p.task_dir(&t).join("VERDICT.md"), "Verdict: NEEDS_REVIEW\n").expect("v");
        let hi = Some(State::open(Phase::HumanIntervention));
        let line = p.attention(&t, hi, None).expect("a line");
        assert!(
            line.starts_with("⚠️ **HUMAN INTERVENTION REQUIRED**: VERDICT.md says NEEDS_REVIEW"),
            "{line}"
        );
        assert_eq!(
            p.attention(&t, Some(State::open(Phase::Complete)), None),
            None
        );
    }
}
