//! The checks every state change must pass, as pure functions over what the store read.

use serde::{Deserialize, Serialize};

use crate::artifact::{Artifact, out_of_order};
use crate::phase::{Phase, State};
use crate::verdict::Verdict;

/// What the store found in a task folder, handed to the rules.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    /// Artifacts that exist with content. An empty or whitespace-only file is not evidence
    /// (seed 002: "always check that artifacts are non-empty"): the store leaves it out.
    pub present: Vec<Artifact>,
    /// Artifacts that exist and hold something other than whitespace.
    pub non_empty: Vec<Artifact>,
    /// `VERDICT.md`'s verdict, when it exists and states one.
    pub verdict: Option<Verdict>,
    /// In an `:approved` state: the approved artifact changed since its approval.
    pub approval_stale: bool,
    /// In an `:approved` state: `.state.approvals` has no record of this phase's approval
    /// (the state was written by hand, not by `--approve`).
    pub approval_missing: bool,
    /// The gated phases `.state.approvals` holds a record for (read by the audit).
    pub approved: Vec<Phase>,
    /// A parent's sub-tasks that are not in a terminal state, as `name (state)`.
    pub open_subtasks: Vec<String>,
}

/// Why a `--transition` is refused. Each message is 004 §12's line, followed by what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error(
        "Cannot transition from '{current}' to '{target}'. '{current}' waits for a person's sign-off: only --approve moves it on, to '{}:approved'.",
        current.phase
    )]
    AwaitingApproval { current: State, target: State },
    #[error(
        "Cannot transition from '{current}' to '{target}'. Legal transitions from '{current}' are: {}",
        list(legal)
    )]
    Illegal {
        current: State,
        target: State,
        legal: Vec<State>,
    },
    #[error(
        "Cannot transition from '{current}' to '{target}'. Found forbidden artifact '{}' in task folder. This indicates phase-skipping. Remove the artifact or revert to the correct phase.{}",
        artifacts[0],
        forbidden_lines(artifacts)
    )]
    Forbidden {
        current: State,
        target: State,
        artifacts: Vec<Artifact>,
    },
    #[error(
        "Cannot transition from '{current}' to '{target}'. Required artifact '{artifact}' is missing or empty in task folder."
    )]
    MissingArtifact {
        current: State,
        target: State,
        artifact: Artifact,
    },
    #[error(
        "Cannot transition from '{current}' to '{target}'. The approval of {artifact} is stale: the file changed after it was approved. Run --approve to approve the new content, or restore the approved file."
    )]
    StaleApproval {
        current: State,
        target: State,
        artifact: Artifact,
    },
    #[error(
        "Cannot transition from '{current}' to '{target}'. .state.approvals has no record of the {} approval: '{current}' was not reached through --approve. Run --approve (a person) to approve {artifact}, then retry.",
        current.phase
    )]
    NoApproval {
        current: State,
        target: State,
        artifact: Artifact,
    },
    #[error(
        "Cannot transition from '{current}' to '{target}'. VERDICT.md states no verdict that can be read: add a line 'Verdict: PASS' to complete (or 'Verdict: FAIL' / 'Verdict: NEEDS_REVIEW'), or transition to 'human_intervention'."
    )]
    NoVerdict { current: State, target: State },
    #[error(
        "Cannot transition from '{current}' to '{target}'. Sub-tasks not in a terminal state: {}. A parent is complete only when every sub-task is complete or human_intervention.",
        open.join(", ")
    )]
    OpenSubtasks {
        current: State,
        target: State,
        open: Vec<String>,
    },
    #[error(
        "Cannot transition from '{current}' to '{target}'. VERDICT.md says {verdict}: transition to '{expected}' instead."
    )]
    VerdictMismatch {
        current: State,
        target: State,
        verdict: Verdict,
        expected: State,
    },
}

fn list(states: &[State]) -> String {
    if states.is_empty() {
        return "(none: this is a terminal phase)".into();
    }
    states
        .iter()
        .map(State::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

fn forbidden_lines(artifacts: &[Artifact]) -> String {
    let mut s = String::new();
    for a in artifacts {
        s.push_str(&format!("\n  - {a} (belongs to {} phase)", a.phase()));
    }
    s.push_str("\nRemove out-of-order artifacts before transitioning.");
    s
}

/// Checks `--transition target` from `current`, in the order a person fixes things:
/// the gate, the move itself, out-of-order artifacts, the phase's own artifact, a stale
/// approval, and finally the referee's verdict.
pub fn check_transition(
    current: State,
    target: State,
    facts: &Facts,
) -> Result<(), TransitionError> {
    if current.is_awaiting_approval() {
        return Err(TransitionError::AwaitingApproval { current, target });
    }
    let legal = current.legal_targets();
    if !legal.contains(&target) {
        return Err(TransitionError::Illegal {
            current,
            target,
            legal,
        });
    }
    let forbidden = out_of_order(current, &facts.present);
    if !forbidden.is_empty() {
        return Err(TransitionError::Forbidden {
            current,
            target,
            artifacts: forbidden,
        });
    }
    if let Some(artifact) = current.phase.artifact() {
        if !facts.non_empty.contains(&artifact) {
            return Err(TransitionError::MissingArtifact {
                current,
                target,
                artifact,
            });
        }
        if current.is_approved() && facts.approval_missing {
            return Err(TransitionError::NoApproval {
                current,
                target,
                artifact,
            });
        }
        if current.is_approved() && facts.approval_stale {
            return Err(TransitionError::StaleApproval {
                current,
                target,
                artifact,
            });
        }
    }
    if current.phase == Phase::Referee {
        let expected = match facts.verdict {
            // A verdict nobody can read is no PASS: the safe way out, a person's decision,
            // stays open; completing is refused with the line format that would be read.
            None if target.phase == Phase::HumanIntervention => target,
            None => return Err(TransitionError::NoVerdict { current, target }),
            Some(Verdict::Pass) => State::open(Phase::Complete),
            Some(_) => State::open(Phase::HumanIntervention),
        };
        if target != expected {
            return Err(TransitionError::VerdictMismatch {
                current,
                target,
                verdict: facts.verdict.unwrap_or(Verdict::NeedsReview),
                expected,
            });
        }
    }
    if target.phase == Phase::Complete && !facts.open_subtasks.is_empty() {
        return Err(TransitionError::OpenSubtasks {
            current,
            target,
            open: facts.open_subtasks.clone(),
        });
    }
    Ok(())
}

/// The orchestrator's move of a task to `human_intervention` (seed 002: a decomposed parent
/// one of whose sub-tasks did not pass, whatever the parent's own `VERDICT.md` says). Only
/// the gate and the move itself are checked: out-of-order artifacts do not refuse it — the
/// move hands them to the person who must look at them.
pub fn check_escalation(current: State) -> Result<State, TransitionError> {
    let target = State::open(Phase::HumanIntervention);
    if current.is_awaiting_approval() {
        return Err(TransitionError::AwaitingApproval { current, target });
    }
    let legal = current.legal_targets();
    if !legal.contains(&target) {
        return Err(TransitionError::Illegal {
            current,
            target,
            legal,
        });
    }
    Ok(target)
}

/// Why an `--approve` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApproveError {
    #[error(
        "This phase does not require approval. '{state}' has no approval gate: use --transition {next} to move on.",
        state = .0,
        next = .0.legal_targets().first().map_or_else(String::new, State::to_string)
    )]
    NotGated(State),
    #[error(
        "This phase does not require approval. '{0}' is a terminal phase: the task is finished and nothing moves it on (create a follow-up task with --create-task)."
    )]
    Terminal(State),
    #[error(
        "Current phase is '{0}' (not awaiting approval). Current sub-state must be '{phase}:awaiting_approval' before approval can be granted.",
        phase = .0.phase
    )]
    NotAwaiting(State),
    #[error(
        "Cannot approve '{current}': required artifact '{artifact}' is missing or empty in task folder. Write it, then ask for approval again."
    )]
    MissingArtifact { current: State, artifact: Artifact },
}

/// Checks `--approve` in `current`; returns the `:approved` state to write. An `:approved`
/// state whose artifact changed since (`stale`), or that has no record at all, may be
/// approved again, and stays `:approved`.
pub fn check_approve(current: State, facts: &Facts) -> Result<State, ApproveError> {
    if current.is_terminal() {
        return Err(ApproveError::Terminal(current));
    }
    if !current.phase.is_gated() {
        return Err(ApproveError::NotGated(current));
    }
    // An `:approved` state whose record is stale or missing is approved (again) in place.
    let ok = current.is_awaiting_approval()
        || (current.is_approved() && (facts.approval_stale || facts.approval_missing));
    if !ok {
        return Err(ApproveError::NotAwaiting(current));
    }
    let artifact = current
        .phase
        .artifact()
        .expect("every gated phase has an artifact");
    if !facts.non_empty.contains(&artifact) {
        return Err(ApproveError::MissingArtifact { current, artifact });
    }
    Ok(State::approved(current.phase))
}

/// The state a task folder's artifacts suggest when it has no `.state` (004 §3's fallback):
/// the phase that produced the furthest artifact, at its approval gate if it has one.
/// `None` when there is no artifact at all.
pub fn infer_state(present: &[Artifact]) -> Option<State> {
    let furthest = present.iter().max()?;
    let phase = furthest.phase();
    Some(if phase.is_gated() {
        State::awaiting(phase)
    } else {
        State::open(phase)
    })
}

/// Severity of an audit finding: a violation changes the exit code, a warning does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    Warn,
    Fail,
}

/// One finding of the state/artifact consistency check (004 §11, Category 2).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    pub severity: Severity,
    pub message: String,
    /// The state that would match the files, when one can be named.
    pub suggestion: Option<State>,
}

/// Where an `:approved` state's approval stands, for the consistency check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApprovalRecord {
    /// There is an approval line for this phase and the artifact still matches it (or the line
    /// predates content hashes).
    Fresh,
    Stale,
    Missing,
}

/// Artifacts a task in `state` must already have: those of the mandatory phases it has
/// passed, plus its own once it waits for or has approval.
pub fn required_by(state: State, present: &[Artifact]) -> Vec<Artifact> {
    use Phase::*;
    let p = state.phase;
    let mut req = Vec::new();
    let after = |x: Phase| p > x && !p.is_terminal();
    if after(Research) {
        req.push(Artifact::Spec);
    }
    if p == TestDesign {
        req.push(Artifact::Design);
    }
    for (phase, artifact) in [
        (Implement, Artifact::Implementation),
        (CodeReview, Artifact::CodeReview),
        (BugFind, Artifact::BugReport),
        (AdversarialBugFind, Artifact::AdversarialBugReport),
        (DocReview, Artifact::DocReview),
    ] {
        if after(phase) {
            req.push(artifact);
        }
    }
    if p.is_terminal() {
        // A task ends through the referee's verdict, or (a decomposed parent) through the
        // aggregation of its sub-tasks.
        req.push(Artifact::Spec);
        if !present.contains(&Artifact::Decomposition) {
            req.push(Artifact::Verdict);
        }
    }
    if state.gate != crate::phase::Gate::Open {
        req.extend(p.artifact());
    }
    req.sort();
    req.dedup();
    req
}

/// The approval gates a task in `state` must have passed on its way there, given the
/// artifacts it holds: research for everything past it; decomposition, design and
/// test_design when their artifact exists; code_review for everything past it that did not
/// end as a decomposed parent. The gate of an `:approved` state itself is not included.
pub fn gates_passed(state: State, present: &[Artifact]) -> Vec<Phase> {
    use Phase::*;
    let p = state.phase;
    let has = |a: Artifact| present.contains(&a);
    let mut out = Vec::new();
    if p > Research {
        out.push(Research);
    }
    if p.is_terminal() && has(Artifact::Decomposition) {
        out.push(Decomposition);
    }
    if p > Design && has(Artifact::Design) {
        out.push(Design);
    }
    if p > TestDesign && has(Artifact::TestPlan) {
        out.push(TestDesign);
    }
    let via_referee = !p.is_terminal() || has(Artifact::Verdict) || !has(Artifact::Decomposition);
    if p > CodeReview && via_referee {
        out.push(CodeReview);
    }
    out
}

/// Category 2: does `.state` match the artifacts in the folder?
pub fn check_consistency(
    state: State,
    facts: &Facts,
    approval: Option<ApprovalRecord>,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let fail = |message: String, suggestion: Option<State>| Finding {
        severity: Severity::Fail,
        message,
        suggestion,
    };
    for a in out_of_order(state, &facts.present) {
        out.push(fail(
            format!(".state says \"{state}\" but {a} exists"),
            infer_state(&facts.present),
        ));
    }
    for a in required_by(state, &facts.present) {
        if !facts.non_empty.contains(&a) {
            out.push(fail(
                format!(".state says \"{state}\" but {a} is missing or empty"),
                Some(State::open(a.phase())),
            ));
        }
    }
    if state.is_approved() {
        match approval {
            Some(ApprovalRecord::Missing) => out.push(fail(
                format!(".state says \"{state}\" but .state.approvals has no {state} record"),
                Some(State::awaiting(state.phase)),
            )),
            Some(ApprovalRecord::Stale) => out.push(fail(
                format!(
                    ".state says \"{state}\" but {} changed after it was approved (run --approve again)",
                    state.phase.artifact().map_or("the artifact", Artifact::file_name)
                ),
                Some(State::awaiting(state.phase)),
            )),
            Some(ApprovalRecord::Fresh) | None => {}
        }
    }
    // A gate left behind without a record was passed by editing `.state`, not by --approve.
    for gate in gates_passed(state, &facts.present) {
        if !facts.approved.contains(&gate) {
            out.push(fail(
                format!(
                    ".state says \"{state}\" but .state.approvals has no {gate}:approved record (the gate was passed without --approve)"
                ),
                Some(State::awaiting(gate)),
            ));
        }
    }
    if let Some(own) = state.phase.artifact()
        && state.gate == crate::phase::Gate::Open
        && !facts.non_empty.contains(&own)
    {
        out.push(Finding {
            severity: Severity::Warn,
            message: format!(
                "work in progress: .state says \"{state}\" and {own} is not written yet"
            ),
            suggestion: None,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use Artifact::*;

    fn facts(present: &[Artifact]) -> Facts {
        Facts {
            present: present.to_vec(),
            non_empty: present.to_vec(),
            approved: Phase::ALL.into_iter().filter(|p| p.is_gated()).collect(),
            ..Facts::default()
        }
    }

    fn st(s: &str) -> State {
        s.parse().expect("valid state")
    }

    #[test]
    fn transition_refused_from_awaiting_even_to_approved() {
        let f = facts(&[Spec]);
        for target in State::all() {
            let e = check_transition(st("research:awaiting_approval"), target, &f);
            assert!(
                matches!(e, Err(TransitionError::AwaitingApproval { .. })),
                "{target}"
            );
        }
    }

    #[test]
    fn transition_requires_current_phase_artifact_non_empty() {
        let mut f = facts(&[]);
        let e = check_transition(st("research"), st("research:awaiting_approval"), &f);
        assert_eq!(
            e.expect_err("missing").to_string(),
            "Cannot transition from 'research' to 'research:awaiting_approval'. Required artifact 'SPEC.md' is missing or empty in task folder."
        );
        f.present = vec![Spec];
        assert!(
            check_transition(st("research"), st("research:awaiting_approval"), &f).is_err(),
            "empty"
        );
        f.non_empty = vec![Spec];
        assert!(check_transition(st("research"), st("research:awaiting_approval"), &f).is_ok());
    }

    #[test]
    fn transition_refused_with_forbidden_artifacts_listing_all() {
        let f = facts(&[Spec, Implementation, BugReport]);
        let e = check_transition(st("research"), st("research:awaiting_approval"), &f)
            .expect_err("forbidden");
        let msg = e.to_string();
        assert!(msg.starts_with("Cannot transition from 'research' to 'research:awaiting_approval'. Found forbidden artifact 'IMPLEMENTATION.md' in task folder. This indicates phase-skipping."), "{msg}");
        assert!(msg.contains("\n  - IMPLEMENTATION.md (belongs to implement phase)"));
        assert!(msg.contains("\n  - BUG_REPORT.md (belongs to bug_find phase)"));
    }

    #[test]
    fn referee_follows_verdict() {
        let mut f = facts(&[
            Spec,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ]);
        let referee = st("referee");
        assert!(matches!(
            check_transition(referee, st("complete"), &f),
            Err(TransitionError::NoVerdict { .. })
        ));
        assert!(
            check_transition(referee, st("human_intervention"), &f).is_ok(),
            "an unreadable verdict may always go to a person"
        );
        f.verdict = Some(crate::Verdict::Pass);
        assert!(check_transition(referee, st("complete"), &f).is_ok());
        assert!(check_transition(referee, st("human_intervention"), &f).is_err());
        for v in [crate::Verdict::Fail, crate::Verdict::NeedsReview] {
            f.verdict = Some(v);
            assert!(check_transition(referee, st("human_intervention"), &f).is_ok());
            let e = check_transition(referee, st("complete"), &f).expect_err("not PASS");
            assert!(
                e.to_string()
                    .contains("transition to 'human_intervention' instead"),
                "{e}"
            );
        }
    }

    #[test]
    fn stale_approval_blocks_leaving_approved() {
        let mut f = facts(&[Spec]);
        assert!(check_transition(st("research:approved"), st("design"), &f).is_ok());
        f.approval_stale = true;
        assert!(matches!(
            check_transition(st("research:approved"), st("design"), &f),
            Err(TransitionError::StaleApproval { .. })
        ));
    }

    #[test]
    fn approve_only_from_awaiting_or_stale_approved() {
        let mut f = facts(&[
            Spec,
            Design,
            TestPlan,
            Decomposition,
            Implementation,
            CodeReview,
        ]);
        for s in State::all() {
            let r = check_approve(s, &f);
            if s.is_awaiting_approval() {
                assert_eq!(r, Ok(State::approved(s.phase)), "{s}");
            } else if s.phase.is_gated() {
                assert_eq!(r, Err(ApproveError::NotAwaiting(s)), "{s}");
            } else if s.is_terminal() {
                assert_eq!(r, Err(ApproveError::Terminal(s)), "{s}");
            } else {
                assert_eq!(r, Err(ApproveError::NotGated(s)), "{s}");
            }
        }
        f.approval_stale = true;
        assert_eq!(
            check_approve(st("design:approved"), &f),
            Ok(st("design:approved"))
        );
        assert_eq!(
            ApproveError::NotAwaiting(st("research")).to_string(),
            "Current phase is 'research' (not awaiting approval). Current sub-state must be 'research:awaiting_approval' before approval can be granted."
        );
        assert!(
            ApproveError::NotGated(st("implement"))
                .to_string()
                .starts_with("This phase does not require approval")
        );
    }

    #[test]
    fn approved_state_without_record_cannot_be_left_but_can_be_approved() {
        let mut f = facts(&[Spec]);
        f.approval_missing = true;
        assert!(matches!(
            check_transition(st("research:approved"), st("implement"), &f),
            Err(TransitionError::NoApproval { .. })
        ));
        assert_eq!(
            check_approve(st("research:approved"), &f),
            Ok(st("research:approved"))
        );
    }

    #[test]
    fn parent_completes_only_with_every_subtask_terminal() {
        let mut f = facts(&[Spec, Decomposition]);
        f.open_subtasks = vec!["p/a (new)".into()];
        let e = check_transition(st("decomposition:approved"), st("complete"), &f)
            .expect_err("open sub-task");
        assert!(e.to_string().contains("p/a (new)"), "{e}");
        assert!(
            check_transition(st("decomposition:approved"), st("human_intervention"), &f).is_ok()
        );
    }

    #[test]
    fn gates_passed_follow_the_path_the_artifacts_show() {
        use Phase as P;
        assert_eq!(gates_passed(st("research:approved"), &[Spec]), vec![]);
        assert_eq!(gates_passed(st("implement"), &[Spec]), vec![P::Research]);
        assert_eq!(
            gates_passed(st("implement"), &[Spec, Design, TestPlan]),
            vec![P::Research, P::Design, P::TestDesign]
        );
        assert_eq!(
            gates_passed(st("bug_find"), &[Spec, Implementation, CodeReview]),
            vec![P::Research, P::CodeReview]
        );
        assert_eq!(
            gates_passed(st("complete"), &[Spec, Decomposition]),
            vec![P::Research, P::Decomposition]
        );
        let none = Facts {
            approved: vec![],
            ..facts(&[Spec])
        };
        let gated = check_consistency(st("implement"), &none, None);
        assert!(
            gated[0].message.contains("no research:approved record"),
            "{gated:?}"
        );
        assert_eq!(gated[0].suggestion, Some(st("research:awaiting_approval")));
    }

    #[test]
    fn approve_refused_when_artifact_deleted_meanwhile() {
        assert!(matches!(
            check_approve(st("design:awaiting_approval"), &facts(&[Spec])),
            Err(ApproveError::MissingArtifact {
                artifact: Design,
                ..
            })
        ));
    }

    #[test]
    fn heuristic_infers_furthest_artifact_phase() {
        assert_eq!(infer_state(&[]), None);
        assert_eq!(infer_state(&[Spec]), Some(st("research:awaiting_approval")));
        assert_eq!(infer_state(&[Spec, Implementation]), Some(st("implement")));
        assert_eq!(
            infer_state(&[Spec, Implementation, CodeReview]),
            Some(st("code_review:awaiting_approval"))
        );
        assert_eq!(infer_state(&[Verdict, Spec]), Some(st("referee")));
    }

    #[test]
    fn consistency_flags_ahead_behind_and_approvals() {
        let ahead = check_consistency(st("research"), &facts(&[Spec, Implementation]), None);
        assert_eq!(ahead[0].severity, Severity::Fail);
        assert_eq!(
            ahead[0].message,
            ".state says \"research\" but IMPLEMENTATION.md exists"
        );
        assert_eq!(ahead[0].suggestion, Some(st("implement")));

        let behind =
            check_consistency(st("bug_find"), &facts(&[Spec, CodeReview, BugReport]), None);
        assert_eq!(behind.len(), 1, "{behind:?}");
        assert_eq!(behind[0].suggestion, Some(st("implement")));

        let wip = check_consistency(st("implement"), &facts(&[Spec]), None);
        assert_eq!(wip.len(), 1);
        assert_eq!(
            wip[0].severity,
            Severity::Warn,
            "work in progress is only a warning"
        );

        let missing = check_consistency(
            st("design:approved"),
            &facts(&[Spec, Design]),
            Some(ApprovalRecord::Missing),
        );
        assert_eq!(missing[0].suggestion, Some(st("design:awaiting_approval")));
        let stale = check_consistency(
            st("design:approved"),
            &facts(&[Spec, Design]),
            Some(ApprovalRecord::Stale),
        );
        assert!(
            stale[0]
                .message
                .contains("DESIGN.md changed after it was approved")
        );
        assert!(
            check_consistency(
                st("design:approved"),
                &facts(&[Spec, Design]),
                Some(ApprovalRecord::Fresh)
            )
            .is_empty()
        );

        let awaiting = check_consistency(st("research:awaiting_approval"), &facts(&[]), None);
        assert_eq!(awaiting[0].severity, Severity::Fail);
    }

    #[test]
    fn consistency_accepts_complete_tasks_both_ways() {
        let full = [
            Spec,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ];
        assert!(check_consistency(st("complete"), &facts(&full), None).is_empty());
        assert!(check_consistency(st("complete"), &facts(&[Spec, Decomposition]), None).is_empty());
        assert_eq!(
            check_consistency(st("complete"), &facts(&[Spec]), None).len(),
            1
        );
    }
}
