//! The task lifecycle of automaton: phases and their approval sub-states, the legal
//! transitions between them, each phase's required artifact and the artifacts it forbids,
//! the referee's verdict, task names, the policy read from `.agent.md`, the lease rules
//! every lease store applies, the pool tokens that bind a worker to its name, the
//! built-in phase prompts (compiled in, filled from the lifecycle's own tables), and the one
//! spelling of a digest every crate writes (lowercase hex, SHA-256 as hex: [`digest`]).
//!
//! Everything here is a pure function over values. This crate must not touch the disk, the
//! clock or the network; `automaton-store` reads the files and hands the facts in.

mod artifact;
mod decomposition;
pub mod digest;
mod duties;
#[cfg(test)]
mod fuzz;
#[cfg(test)]
mod fuzz_tests;
mod guidance;
pub mod lease;
mod names;
mod phase;
mod policy;
pub mod pool_token;
pub mod progress;
mod prompts;
mod rules;
mod subtasks;
mod verdict;
mod vocab;

pub use artifact::{Artifact, forbidden_in, out_of_order};
pub use decomposition::{
    Decomposition, DecompositionError, MAX_ESTIMATE_TOKENS, MAX_SUBTASKS, SubtaskSpec,
    check_decomposition, parse_decomposition,
};
pub use digest::{hex, sha256_hex};
pub use duties::{Duty, leaves_a_reviewer, separation};
pub use guidance::{Guidance, guidance};
pub use lease::TtlBounds;
pub use names::{AgentId, MAX_NAME_LEN, NameError, TaskName, excerpt};
pub use phase::{Gate, Phase, State, UnknownPhase};
pub use policy::{
    DEFAULT_LOCK_TIMEOUT, MAX_DURATION, Policy, PolicyError, PolicyFile, parse_duration,
};
pub use prompts::{
    BUILT_IN_MARK, TASK_DIR, artifact_path, built_in_header, built_in_prompt, prompt_body,
    prompt_phases, prompt_template,
};
pub use rules::{
    ApprovalRecord, ApproveError, Facts, Finding, Severity, TransitionError, check_approve,
    check_consistency, check_escalation, check_transition, gates_passed, infer_state, required_by,
};
pub use subtasks::{
    Aggregate, FOLLOW_UP_COPY, FollowUp, FollowUpKind, ParentOutcome, VramConfig, aggregate,
    follow_up_tasks, parent_outcome, parent_spec_md, vram_config_md,
};
pub use verdict::{Verdict, parse_verdict};
pub use vocab::{
    DeliveryState, EventKind, LeaseEnd, RunState, StopReason, UnknownName, WorkerState,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// The legal moves, written out by hand from 004 §5 with seed 001's code_review inserted
    /// (implement → code_review instead of implement → bug_find) and the rule that a
    /// decomposed parent leaves decomposition:approved only for complete or human_intervention.
    const LEGAL: &[(&str, &str)] = &[
        ("new", "research"),
        ("research", "research:awaiting_approval"),
        ("research:approved", "decomposition"),
        ("research:approved", "design"),
        ("research:approved", "implement"),
        ("decomposition", "decomposition:awaiting_approval"),
        ("decomposition:approved", "complete"),
        ("decomposition:approved", "human_intervention"),
        ("design", "design:awaiting_approval"),
        ("design:approved", "test_design"),
        ("design:approved", "implement"),
        ("test_design", "test_design:awaiting_approval"),
        ("test_design:approved", "implement"),
        ("implement", "code_review"),
        ("code_review", "code_review:awaiting_approval"),
        ("code_review:approved", "bug_find"),
        ("bug_find", "adversarial_bug_find"),
        ("adversarial_bug_find", "doc_review"),
        ("doc_review", "referee"),
        ("referee", "complete"),
        ("referee", "human_intervention"),
    ];

    /// Every artifact present and non-empty, with the verdict each referee move needs: the
    /// only thing that can refuse a legal move then is the move itself.
    fn permissive_facts(current: State, target: State) -> Facts {
        let present: Vec<Artifact> = Artifact::ALL
            .into_iter()
            .filter(|a| !forbidden_in(current.phase).contains(a))
            .collect();
        Facts {
            non_empty: present.clone(),
            present,
            verdict: Some(if target.phase == Phase::Complete {
                Verdict::Pass
            } else {
                Verdict::Fail
            }),
            approval_stale: false,
            approval_missing: false,
            approved: Phase::ALL.into_iter().filter(|p| p.is_gated()).collect(),
            open_subtasks: vec![],
        }
    }

    #[test]
    fn every_phase_target_pair_is_legal_exactly_as_the_spec_says() {
        let all = State::all();
        assert_eq!(
            all.len(),
            23,
            "13 phases + 2 sub-states for each of 5 gated phases"
        );
        let mut legal_seen = 0;
        for &from in &all {
            for &to in &all {
                let expected =
                    LEGAL.contains(&(from.to_string().as_str(), to.to_string().as_str()));
                let got = check_transition(from, to, &permissive_facts(from, to));
                assert_eq!(got.is_ok(), expected, "{from} -> {to}: {got:?}");
                if expected {
                    legal_seen += 1;
                } else if from.is_awaiting_approval() {
                    assert!(
                        matches!(got, Err(TransitionError::AwaitingApproval { .. })),
                        "{from} -> {to}"
                    );
                } else {
                    assert!(
                        matches!(got, Err(TransitionError::Illegal { .. })),
                        "{from} -> {to}"
                    );
                }
            }
        }
        assert_eq!(legal_seen, LEGAL.len());
    }

    #[test]
    fn approval_is_the_only_way_past_each_gate() {
        for s in State::all() {
            match s.approval_target() {
                Some(t) => {
                    assert!(s.is_awaiting_approval());
                    assert_eq!(t, State::approved(s.phase));
                    assert!(
                        s.legal_targets().is_empty(),
                        "{s} must not be left by --transition"
                    );
                }
                None => assert!(!s.is_awaiting_approval()),
            }
        }
    }

    #[test]
    fn states_round_trip_and_unknown_phases_are_refused() {
        for s in State::all() {
            assert_eq!(s.to_string().parse::<State>(), Ok(s));
        }
        for bad in [
            "",
            "Research",
            "implement:approved",
            "research:done",
            "bugfind",
            "new\n",
            "research:",
        ] {
            let e = bad.parse::<State>().expect_err(bad);
            assert_eq!(
                e.to_string(),
                format!("Unknown phase '{bad}' in .state file")
            );
        }
    }

    #[test]
    fn required_artifact_per_phase_matches_spec_section_6() {
        let expect = [
            ("research", Some("SPEC.md")),
            ("decomposition", Some("DECOMPOSITION.md")),
            ("design", Some("DESIGN.md")),
            ("test_design", Some("TEST_PLAN.md")),
            ("implement", Some("IMPLEMENTATION.md")),
            ("code_review", Some("CODE_REVIEW.md")),
            ("bug_find", Some("BUG_REPORT.md")),
            ("adversarial_bug_find", Some("ADVERSARIAL_BUG_REPORT.md")),
            ("doc_review", Some("DOC_REVIEW.md")),
            ("referee", Some("VERDICT.md")),
            ("new", None),
            ("complete", None),
            ("human_intervention", None),
        ];
        for (phase, artifact) in expect {
            let p: Phase = phase.parse().expect("valid");
            assert_eq!(p.artifact().map(|a| a.file_name()), artifact, "{phase}");
        }
    }

    #[test]
    fn forbidden_table_matches_spec_section_10_plus_code_review() {
        let expect: &[(&str, &str)] = &[
            (
                "new",
                "SPEC DESIGN DECOMPOSITION TEST_PLAN IMPLEMENTATION CODE_REVIEW BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            (
                "research",
                "DESIGN DECOMPOSITION TEST_PLAN IMPLEMENTATION CODE_REVIEW BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            (
                "decomposition",
                "DESIGN TEST_PLAN IMPLEMENTATION CODE_REVIEW BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            (
                "design",
                "DECOMPOSITION TEST_PLAN IMPLEMENTATION CODE_REVIEW BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            (
                "test_design",
                "DECOMPOSITION IMPLEMENTATION CODE_REVIEW BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            (
                "implement",
                "CODE_REVIEW BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            (
                "code_review",
                "BUG_REPORT ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT",
            ),
            ("bug_find", "ADVERSARIAL_BUG_REPORT DOC_REVIEW VERDICT"),
            ("adversarial_bug_find", "DOC_REVIEW VERDICT"),
            ("doc_review", "VERDICT"),
            ("referee", ""),
            ("complete", ""),
            ("human_intervention", ""),
        ];
        for (phase, names) in expect {
            let p: Phase = phase.parse().expect("valid");
            let mut want: Vec<String> = names
                .split_whitespace()
                .map(|n| format!("{n}.md"))
                .collect();
            let mut got: Vec<String> = forbidden_in(p).iter().map(|a| a.to_string()).collect();
            want.sort();
            got.sort();
            assert_eq!(got, want, "{phase}");
        }
    }

    #[test]
    fn metadata_files_are_never_artifacts() {
        for name in [
            ".state",
            ".state.approvals",
            ".state.lock",
            ".state.implementer",
            ".state.holders",
            "VRAM_CONFIG.md",
            "PARENT_SPEC.md",
            "REVIEW.md",
        ] {
            assert_eq!(Artifact::from_file_name(name), None, "{name}");
        }
    }
}
