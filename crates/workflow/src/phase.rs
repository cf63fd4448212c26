//! Phases, approval sub-states and the legal moves between them.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::artifact::Artifact;

/// A lifecycle phase, without its approval sub-state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    New,
    Research,
    Decomposition,
    Design,
    TestDesign,
    Implement,
    CodeReview,
    BugFind,
    AdversarialBugFind,
    DocReview,
    Referee,
    Complete,
    HumanIntervention,
}

impl Phase {
    /// Every phase, in lifecycle order.
    pub const ALL: [Phase; 13] = [
        Phase::New,
        Phase::Research,
        Phase::Decomposition,
        Phase::Design,
        Phase::TestDesign,
        Phase::Implement,
        Phase::CodeReview,
        Phase::BugFind,
        Phase::AdversarialBugFind,
        Phase::DocReview,
        Phase::Referee,
        Phase::Complete,
        Phase::HumanIntervention,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::New => "new",
            Phase::Research => "research",
            Phase::Decomposition => "decomposition",
            Phase::Design => "design",
            Phase::TestDesign => "test_design",
            Phase::Implement => "implement",
            Phase::CodeReview => "code_review",
            Phase::BugFind => "bug_find",
            Phase::AdversarialBugFind => "adversarial_bug_find",
            Phase::DocReview => "doc_review",
            Phase::Referee => "referee",
            Phase::Complete => "complete",
            Phase::HumanIntervention => "human_intervention",
        }
    }

    /// Phases that stop at `:awaiting_approval` for a person's sign-off.
    pub fn is_gated(self) -> bool {
        matches!(
            self,
            Phase::Research
                | Phase::Decomposition
                | Phase::Design
                | Phase::TestDesign
                | Phase::CodeReview
        )
    }

    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Complete | Phase::HumanIntervention)
    }

    /// The deliverable this phase produces; it must exist and be non-empty to leave the phase.
    pub fn artifact(self) -> Option<Artifact> {
        Some(match self {
            Phase::Research => Artifact::Spec,
            Phase::Decomposition => Artifact::Decomposition,
            Phase::Design => Artifact::Design,
            Phase::TestDesign => Artifact::TestPlan,
            Phase::Implement => Artifact::Implementation,
            Phase::CodeReview => Artifact::CodeReview,
            Phase::BugFind => Artifact::BugReport,
            Phase::AdversarialBugFind => Artifact::AdversarialBugReport,
            Phase::DocReview => Artifact::DocReview,
            Phase::Referee => Artifact::Verdict,
            Phase::New | Phase::Complete | Phase::HumanIntervention => return None,
        })
    }

    /// Phases in which an agent may edit the project's code (004 §14 `--can-edit`).
    /// The phases that read the implementation and vouch for it: from the code review to
    /// the referee. They are bound to the commit they read (issue 36).
    pub fn reviews_code(self) -> bool {
        matches!(
            self,
            Phase::CodeReview
                | Phase::BugFind
                | Phase::AdversarialBugFind
                | Phase::DocReview
                | Phase::Referee
        )
    }

    pub fn allows_code_edits(self) -> bool {
        matches!(self, Phase::Implement | Phase::DocReview)
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Phase {
    type Err = UnknownPhase;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Phase::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| UnknownPhase(s.to_string()))
    }
}

/// Where a gated phase stands with respect to its approval gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Gate {
    /// Work in progress (the plain phase name).
    Open,
    AwaitingApproval,
    Approved,
}

/// A task's full state: the string stored in `.state`, e.g. `design:awaiting_approval`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct State {
    pub phase: Phase,
    pub gate: Gate,
}

/// A `.state` value that names no phase; the message is 004 §12's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Unknown phase '{0}' in .state file")]
pub struct UnknownPhase(pub String);

impl State {
    pub const fn open(phase: Phase) -> State {
        State {
            phase,
            gate: Gate::Open,
        }
    }

    pub const fn awaiting(phase: Phase) -> State {
        State {
            phase,
            gate: Gate::AwaitingApproval,
        }
    }

    pub const fn approved(phase: Phase) -> State {
        State {
            phase,
            gate: Gate::Approved,
        }
    }

    /// Every state a task can be in: 13 phases plus two sub-states for each of the 5 gated ones.
    pub fn all() -> Vec<State> {
        let mut out = Vec::with_capacity(23);
        for p in Phase::ALL {
            out.push(State::open(p));
            if p.is_gated() {
                out.push(State::awaiting(p));
                out.push(State::approved(p));
            }
        }
        out
    }

    pub fn is_awaiting_approval(self) -> bool {
        self.gate == Gate::AwaitingApproval
    }

    pub fn is_approved(self) -> bool {
        self.gate == Gate::Approved
    }

    pub fn is_terminal(self) -> bool {
        self.phase.is_terminal()
    }

    /// The states `--transition` may move to from here (approval is not a transition).
    pub fn legal_targets(self) -> Vec<State> {
        use Phase::*;
        let open = State::open;
        match (self.phase, self.gate) {
            (New, Gate::Open) => vec![open(Research)],
            (p, Gate::Open) if p.is_gated() => vec![State::awaiting(p)],
            (_, Gate::AwaitingApproval) => vec![],
            (Research, Gate::Approved) => vec![open(Decomposition), open(Design), open(Implement)],
            // A decomposed parent waits here while its sub-tasks run; the aggregation of their
            // verdicts ends it.
            (Decomposition, Gate::Approved) => vec![open(Complete), open(HumanIntervention)],
            (Design, Gate::Approved) => vec![open(TestDesign), open(Implement)],
            (TestDesign, Gate::Approved) => vec![open(Implement)],
            (CodeReview, Gate::Approved) => vec![open(BugFind)],
            (Implement, Gate::Open) => vec![open(CodeReview)],
            (BugFind, Gate::Open) => vec![open(AdversarialBugFind)],
            (AdversarialBugFind, Gate::Open) => vec![open(DocReview)],
            (DocReview, Gate::Open) => vec![open(Referee)],
            (Referee, Gate::Open) => vec![open(Complete), open(HumanIntervention)],
            _ => vec![],
        }
    }

    /// The state `--approve` moves to, if this state waits for approval.
    pub fn approval_target(self) -> Option<State> {
        self.is_awaiting_approval()
            .then(|| State::approved(self.phase))
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.gate {
            Gate::Open => write!(f, "{}", self.phase),
            Gate::AwaitingApproval => write!(f, "{}:awaiting_approval", self.phase),
            Gate::Approved => write!(f, "{}:approved", self.phase),
        }
    }
}

impl FromStr for State {
    type Err = UnknownPhase;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || UnknownPhase(s.to_string());
        let (phase, gate) = match s.split_once(':') {
            None => (s, Gate::Open),
            Some((p, "awaiting_approval")) => (p, Gate::AwaitingApproval),
            Some((p, "approved")) => (p, Gate::Approved),
            Some(_) => return Err(unknown()),
        };
        let phase: Phase = phase.parse().map_err(|_| unknown())?;
        if gate != Gate::Open && !phase.is_gated() {
            return Err(unknown());
        }
        Ok(State { phase, gate })
    }
}

impl Serialize for State {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl Serialize for Phase {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for State {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for Phase {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}
