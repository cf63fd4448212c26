//! The deliverables each phase produces, and which of them may not exist yet (004 §10).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::phase::{Phase, State};

/// A phase deliverable. Everything else in a task folder (`.state*`, `VRAM_CONFIG.md`,
/// `PARENT_SPEC.md`, `REVIEW.md`, `subtasks/`) is metadata and never checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Artifact {
    Spec,
    Decomposition,
    Design,
    TestPlan,
    Implementation,
    CodeReview,
    BugReport,
    AdversarialBugReport,
    DocReview,
    Verdict,
}

impl Artifact {
    /// Every artifact, in lifecycle order.
    pub const ALL: [Artifact; 10] = [
        Artifact::Spec,
        Artifact::Decomposition,
        Artifact::Design,
        Artifact::TestPlan,
        Artifact::Implementation,
        Artifact::CodeReview,
        Artifact::BugReport,
        Artifact::AdversarialBugReport,
        Artifact::DocReview,
        Artifact::Verdict,
    ];

    pub fn file_name(self) -> &'static str {
        match self {
            Artifact::Spec => "SPEC.md",
            Artifact::Decomposition => "DECOMPOSITION.md",
            Artifact::Design => "DESIGN.md",
            Artifact::TestPlan => "TEST_PLAN.md",
            Artifact::Implementation => "IMPLEMENTATION.md",
            Artifact::CodeReview => "CODE_REVIEW.md",
            Artifact::BugReport => "BUG_REPORT.md",
            Artifact::AdversarialBugReport => "ADVERSARIAL_BUG_REPORT.md",
            Artifact::DocReview => "DOC_REVIEW.md",
            Artifact::Verdict => "VERDICT.md",
        }
    }

    pub fn from_file_name(name: &str) -> Option<Artifact> {
        Artifact::ALL.into_iter().find(|a| a.file_name() == name)
    }

    /// The phase that produces this artifact.
    pub fn phase(self) -> Phase {
        match self {
            Artifact::Spec => Phase::Research,
            Artifact::Decomposition => Phase::Decomposition,
            Artifact::Design => Phase::Design,
            Artifact::TestPlan => Phase::TestDesign,
            Artifact::Implementation => Phase::Implement,
            Artifact::CodeReview => Phase::CodeReview,
            Artifact::BugReport => Phase::BugFind,
            Artifact::AdversarialBugReport => Phase::AdversarialBugFind,
            Artifact::DocReview => Phase::DocReview,
            Artifact::Verdict => Phase::Referee,
        }
    }
}

impl fmt::Display for Artifact {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.file_name())
    }
}

impl Serialize for Artifact {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.file_name())
    }
}

impl<'de> Deserialize<'de> for Artifact {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        Artifact::from_file_name(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown artifact '{name}'")))
    }
}

/// Artifacts that must NOT exist while a task is in `phase`: 004 §10's table, with
/// `CODE_REVIEW.md` forbidden before `code_review` (seed 001). The sub-state does not matter.
pub fn forbidden_in(phase: Phase) -> &'static [Artifact] {
    use Artifact::*;
    match phase {
        Phase::New => &[
            Spec,
            Design,
            Decomposition,
            TestPlan,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ],
        Phase::Research => &[
            Design,
            Decomposition,
            TestPlan,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ],
        Phase::Decomposition => &[
            Design,
            TestPlan,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ],
        Phase::Design => &[
            Decomposition,
            TestPlan,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ],
        Phase::TestDesign => &[
            Decomposition,
            Implementation,
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ],
        Phase::Implement => &[
            CodeReview,
            BugReport,
            AdversarialBugReport,
            DocReview,
            Verdict,
        ],
        Phase::CodeReview => &[BugReport, AdversarialBugReport, DocReview, Verdict],
        Phase::BugFind => &[AdversarialBugReport, DocReview, Verdict],
        Phase::AdversarialBugFind => &[DocReview, Verdict],
        Phase::DocReview => &[Verdict],
        Phase::Referee | Phase::Complete | Phase::HumanIntervention => &[],
    }
}

/// The forbidden artifacts among `present`, in lifecycle order.
pub fn out_of_order(state: State, present: &[Artifact]) -> Vec<Artifact> {
    forbidden_in(state.phase)
        .iter()
        .copied()
        .filter(|a| present.contains(a))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}
