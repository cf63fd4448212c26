//! What `status --task` tells an agent: allowed and forbidden actions, the next artifact,
//! the next phase and the command to proceed (004 §2).

use serde::{Deserialize, Serialize};

use crate::artifact::forbidden_in;
use crate::phase::{Gate, Phase, State};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Guidance {
    pub allowed: Vec<String>,
    pub forbidden: Vec<String>,
    /// The file to write next, or `None` when the phase writes nothing.
    pub next_artifact: Option<String>,
    /// The states to move to next, in preference order.
    pub next: Vec<State>,
    pub command: String,
}

fn own_work(phase: Phase) -> &'static [&'static str] {
    match phase {
        Phase::New => &["Read project files"],
        Phase::Research => &["Read project files", "Ask clarifying questions"],
        Phase::Decomposition => &[
            "Read project files",
            "Split the task into sub-tasks and waves",
        ],
        Phase::Design => &["Read project files", "Design the solution"],
        Phase::TestDesign => &["Read project files", "Plan the tests"],
        Phase::Implement => &["Read project files", "Edit code", "Write and run tests"],
        Phase::CodeReview => &["Read the code and the spec", "Run the tests"],
        Phase::BugFind => &["Read the code", "Run and write tests that expose bugs"],
        Phase::AdversarialBugFind => &[
            "Read the code",
            "Attack the implementation with hostile input",
        ],
        Phase::DocReview => &["Read the code", "Edit documentation and code comments"],
        Phase::Referee => &["Read every artifact", "Weigh the reports"],
        Phase::Complete => &["Read the task's artifacts"],
        Phase::HumanIntervention => &["Read the task's artifacts", "Wait for a person's decision"],
    }
}

fn phase_bans(phase: Phase) -> &'static [&'static str] {
    match phase {
        Phase::Implement => &["Review your own code"],
        Phase::CodeReview => &[
            "Edit code (code review is read-only)",
            "Fix the issues you find",
            "Return to implement",
            "Review work you implemented",
        ],
        Phase::BugFind | Phase::AdversarialBugFind => &["Edit code", "Fix the bugs you find"],
        Phase::DocReview => &["Change behaviour"],
        Phase::Complete | Phase::HumanIntervention => {
            &["Edit code", "Change this task's artifacts"]
        }
        _ => &["Edit code", "Skip to implementation"],
    }
}

/// The guidance for a task called `task` in `state`.
pub fn guidance(task: &str, state: State) -> Guidance {
    let phase = state.phase;
    let mut allowed: Vec<String> = own_work(phase).iter().map(|s| s.to_string()).collect();
    let mut forbidden: Vec<String> = Vec::new();
    let transition = |to: &State| format!("automaton status --task {task} --transition {to}");
    match state.gate {
        Gate::AwaitingApproval => {
            let a = phase.artifact().map_or("the artifact", |a| a.file_name());
            allowed = vec![
                format!("Present {a} for sign-off"),
                format!("Revise {a} on feedback"),
            ];
            forbidden = vec![
                "Edit code".into(),
                "Approve your own work".into(),
                "Transition before a person approves".into(),
            ];
            return Guidance {
                allowed,
                forbidden,
                next_artifact: None,
                next: vec![State::approved(phase)],
                command: format!("a person runs: automaton status --task {task} --approve"),
            };
        }
        Gate::Approved => {
            let a = phase.artifact().map_or("the artifact", |a| a.file_name());
            let next = state.legal_targets();
            allowed = vec![format!(
                "Start the next phase: {}",
                next.iter()
                    .map(State::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )];
            forbidden = vec![
                format!("Edit {a} (its approval would go stale)"),
                "Edit code".into(),
            ];
            let next_artifact = next
                .first()
                .and_then(|s| s.phase.artifact())
                .map(|a| a.to_string());
            let command = next.first().map(transition).unwrap_or_default();
            return Guidance {
                allowed,
                forbidden,
                next_artifact,
                next,
                command,
            };
        }
        Gate::Open => {}
    }
    let next = state.legal_targets();
    if let Some(a) = phase.artifact() {
        if phase == Phase::Referee {
            allowed.push("Write VERDICT.md with a line 'Verdict: PASS', 'Verdict: FAIL' or 'Verdict: NEEDS_REVIEW'".into());
        } else {
            allowed.push(format!("Write {a}"));
        }
    }
    for s in phase_bans(phase) {
        forbidden.push(s.to_string());
    }
    for a in forbidden_in(phase) {
        forbidden.push(format!("Create {a}"));
    }
    let command = match phase {
        Phase::Complete => "none: the task is complete".to_string(),
        Phase::HumanIntervention => {
            "none: a person decides (e.g. creates fix tasks with --create-task)".to_string()
        }
        Phase::Referee => format!(
            "automaton status --task {task} --transition complete (PASS) or --transition human_intervention (FAIL, NEEDS_REVIEW)"
        ),
        _ => next.first().map(transition).unwrap_or_default(),
    };
    Guidance {
        allowed,
        forbidden,
        next_artifact: phase.artifact().map(|a| a.to_string()),
        next,
        command,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn research_guidance_matches_spec_example() {
        let g = guidance("add-user-auth", "research".parse().expect("valid"));
        assert!(g.allowed.contains(&"Write SPEC.md".to_string()));
        assert!(g.allowed.contains(&"Ask clarifying questions".to_string()));
        for f in [
            "Edit code",
            "Create IMPLEMENTATION.md",
            "Create DESIGN.md",
            "Skip to implementation",
        ] {
            assert!(g.forbidden.contains(&f.to_string()), "{f}");
        }
        assert_eq!(g.next_artifact.as_deref(), Some("SPEC.md"));
        assert_eq!(
            g.next,
            vec!["research:awaiting_approval".parse().expect("valid")]
        );
    }

    #[test]
    fn every_state_has_guidance_and_nonterminal_states_a_way_on() {
        for s in State::all() {
            let g = guidance("t", s);
            assert!(!g.allowed.is_empty() && !g.forbidden.is_empty(), "{s}");
            assert!(!g.command.is_empty(), "{s}");
            if !s.is_terminal() {
                assert!(!g.next.is_empty(), "{s} must name a next state");
            }
        }
    }
}
