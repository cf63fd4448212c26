//! How a task moves on without a person: which states a worker is given work in, where a
//! finished phase goes, and which phase follows an approved gate (the agent may declare it
//! with a `Next:` line in its artifact; otherwise the default path).

use crate::phase::{Gate, Phase, State};
use crate::verdict::{Verdict, parse_verdict};

/// Whether a task in `state` has work for an agent: an open phase with a deliverable.
/// (`new` is started by moving it to `research`; gates wait for people or move on by
/// [`after_approval`]; terminal states are done.)
pub fn has_work(state: State) -> bool {
    state.gate == Gate::Open && !state.phase.is_terminal() && state.phase.artifact().is_some()
}

/// Where a phase goes once its agent is done: a gated phase to `:awaiting_approval`; the
/// referee to `complete` on PASS and `human_intervention` otherwise (an unreadable verdict
/// included); every other phase to the next one. `verdict` is `VERDICT.md`'s text, for the
/// referee.
pub fn after_work(state: State, verdict: Option<&str>) -> Option<State> {
    if !has_work(state) {
        return None;
    }
    let p = state.phase;
    if p.is_gated() {
        return Some(State::awaiting(p));
    }
    Some(State::open(match p {
        Phase::Implement => Phase::CodeReview,
        Phase::BugFind => Phase::AdversarialBugFind,
        Phase::AdversarialBugFind => Phase::DocReview,
        Phase::DocReview => Phase::Referee,
        Phase::Referee => match verdict.and_then(parse_verdict) {
            Some(Verdict::Pass) => Phase::Complete,
            _ => Phase::HumanIntervention,
        },
        _ => return None,
    }))
}

/// Why an artifact's `Next:` line cannot be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{artifact} says 'Next: {named}', which is not a legal move from {from}: write one of {legal}"
)]
pub struct BadNext {
    pub artifact: &'static str,
    pub named: String,
    pub from: String,
    pub legal: String,
}

/// The `Next:` line of an artifact: the first line that, stripped of markdown emphasis and
/// list marks, reads `Next: <phase>` (any case for `Next`).
pub fn declared_next(text: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let cleaned: String = line
            .chars()
            .filter(|c| !matches!(c, '*' | '`' | '_'))
            .collect();
        let cleaned = cleaned.trim().trim_start_matches(['-', '>', '#']).trim();
        let (key, value) = cleaned.split_once(':')?;
        key.trim()
            .eq_ignore_ascii_case("next")
            .then(|| value.trim().trim_end_matches('.').to_ascii_lowercase())
    })
}

/// The phase that follows the approved gate `state`: the one the phase's artifact declares
/// with a `Next:` line, if it is a legal move, else the default path (research → design →
/// implement; test design → implement; code review → bug find). `Ok(None)`: nothing follows
/// on its own (an approved decomposition waits for its sub-tasks; not an approved state).
pub fn after_approval(state: State, artifact: Option<&str>) -> Result<Option<State>, BadNext> {
    if state.gate != Gate::Approved {
        return Ok(None);
    }
    let legal = state.legal_targets();
    if let Some(named) = artifact.and_then(declared_next) {
        let target = named
            .parse::<Phase>()
            .ok()
            .map(State::open)
            .filter(|t| legal.contains(t));
        return match target {
            Some(t) => Ok(Some(t)),
            None => Err(BadNext {
                artifact: state
                    .phase
                    .artifact()
                    .map_or("the artifact", |a| a.file_name()),
                named,
                from: state.to_string(),
                legal: legal
                    .iter()
                    .map(State::to_string)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        };
    }
    Ok(match state.phase {
        Phase::Research => Some(State::open(Phase::Design)),
        Phase::Design | Phase::TestDesign => Some(State::open(Phase::Implement)),
        Phase::CodeReview => Some(State::open(Phase::BugFind)),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> State {
        x.parse().expect("state")
    }

    #[test]
    fn the_default_path_after_each_gate() {
        for (from, to) in [
            ("research:approved", Some("design")),
            ("design:approved", Some("implement")),
            ("test_design:approved", Some("implement")),
            ("code_review:approved", Some("bug_find")),
            ("decomposition:approved", None),
            ("research", None),
            ("research:awaiting_approval", None),
        ] {
            assert_eq!(after_approval(s(from), None), Ok(to.map(s)), "after {from}");
        }
    }

    #[test]
    fn a_next_line_is_followed_when_legal_and_refused_naming_the_legal_moves_otherwise() {
        let spec = "# Spec\n\n**Next:** implement\n";
        assert_eq!(
            after_approval(s("research:approved"), Some(spec)),
            Ok(Some(s("implement")))
        );
        assert_eq!(
            after_approval(s("research:approved"), Some("- next: Decomposition.\n")),
            Ok(Some(s("decomposition")))
        );
        let e = after_approval(s("research:approved"), Some("Next: referee\n"))
            .expect_err("referee is not legal after research");
        assert_eq!(e.named, "referee");
        assert!(
            e.to_string().contains("decomposition, design, implement"),
            "{e}"
        );
        assert!(after_approval(s("design:approved"), Some("Next: banana")).is_err());
    }

    #[test]
    fn a_finished_phase_goes_to_its_gate_or_the_next_phase() {
        for (from, to) in [
            ("research", "research:awaiting_approval"),
            ("decomposition", "decomposition:awaiting_approval"),
            ("code_review", "code_review:awaiting_approval"),
            ("implement", "code_review"),
            ("bug_find", "adversarial_bug_find"),
            ("adversarial_bug_find", "doc_review"),
            ("doc_review", "referee"),
        ] {
            assert_eq!(after_work(s(from), None), Some(s(to)), "after {from}");
            assert!(
                s(from).legal_targets().contains(&s(to)),
                "{from} → {to} is legal"
            );
        }
        assert_eq!(
            after_work(s("referee"), Some("Verdict: PASS")),
            Some(s("complete"))
        );
        assert_eq!(
            after_work(s("referee"), Some("Verdict: FAIL")),
            Some(s("human_intervention"))
        );
        assert_eq!(
            after_work(s("referee"), Some("unreadable")),
            Some(s("human_intervention"))
        );
        for none in [
            "new",
            "complete",
            "research:awaiting_approval",
            "design:approved",
        ] {
            assert_eq!(after_work(s(none), None), None, "{none} has no work");
        }
    }
}
