//! Seed 001's separation of duties — a reviewer is never the implementer — in one place.
//! The store (claims and approvals without a coordinator), the engine (claims through the
//! coordinator, whose implementers may not be in `.state.implementer` yet) and dispatch
//! (whom to offer a phase) all ask [`separation`]; dispatch also asks [`leaves_a_reviewer`]
//! before it places implement.

use crate::{AgentId, Phase, Policy};

/// What an agent would do on a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Duty {
    /// Hold the phase's lease (do its work).
    Claim,
    /// Sign the phase's artifact off.
    Approve,
}

impl Duty {
    pub fn name(self) -> &'static str {
        match self {
            Duty::Claim => "claim",
            Duty::Approve => "approve",
        }
    }
}

/// Whether `agent` may take `duty` on a task in `phase`, given every agent that implemented
/// the task: `Err(duty)` when it implemented it and `phase` is one the policy separates
/// (default: `code_review`).
pub fn separation(
    policy: &Policy,
    phase: Phase,
    agent: &AgentId,
    implementers: &[AgentId],
    duty: Duty,
) -> Result<(), Duty> {
    if policy.separated.contains(&phase) && implementers.contains(agent) {
        Err(duty)
    } else {
        Ok(())
    }
}

/// Whether implement may run on `worker`, given the task's past `implementers` and the live
/// workers that take work: a past implementer may, and so may any worker while another one
/// that has not implemented the task is left to review it. (The first implement may run
/// anywhere: any other worker can review it.)
pub fn leaves_a_reviewer(worker: &AgentId, implementers: &[AgentId], live: &[AgentId]) -> bool {
    implementers.is_empty()
        || implementers.contains(worker)
        || live
            .iter()
            .any(|w| w != worker && !implementers.contains(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(n: &str) -> AgentId {
        n.parse().expect("agent")
    }

    #[test]
    fn an_implementer_may_neither_claim_nor_approve_a_separated_phase() {
        let p = Policy::default();
        let imp = [a("gpu-a")];
        for duty in [Duty::Claim, Duty::Approve] {
            assert_eq!(
                separation(&p, Phase::CodeReview, &a("gpu-a"), &imp, duty),
                Err(duty)
            );
            assert_eq!(
                separation(&p, Phase::CodeReview, &a("gpu-b"), &imp, duty),
                Ok(())
            );
            assert_eq!(
                separation(&p, Phase::BugFind, &a("gpu-a"), &imp, duty),
                Ok(())
            );
        }
        let none = Policy {
            separated: vec![],
            ..Policy::default()
        };
        assert_eq!(
            separation(&none, Phase::CodeReview, &a("gpu-a"), &imp, Duty::Claim),
            Ok(())
        );
    }
}
