//! An agent run's own small lifecycle (seed 003 §5): REQUESTED → STARTING → ACTIVE →
//! STOPPING → STOPPED, with a required stop reason that the exit code alone does not decide.
//! One vocabulary for the worker that runs it, the coordinator that records it, and every
//! client that shows it; the wire carries the same names (and the proto's enums).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where a run stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RunState {
    Requested,
    Starting,
    Active,
    Stopping,
    Stopped,
}

/// Why a run stopped: what its worker reports, or the coordinator's own word when the worker
/// could not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StopReason {
    /// Exit 0 and the phase's artifact written, non-blank.
    Completed,
    /// A non-zero exit, or exit 0 without the artifact.
    AgentError,
    /// Killed by a signal nobody here sent.
    Crashed,
    /// MAX_PHASE_TIME passed.
    TimedOut,
    /// The coordinator ended the lease: nothing of the run may be kept.
    LeaseLost,
    /// A person stopped it (`automaton stop`).
    OperatorStopped,
    /// The worker itself was stopping (or deregistered before it reported the run's end).
    Shutdown,
    /// The coordinator's word: the worker's session ended (dead or silent) before the run
    /// reported its end (seed 003's `crashed`, seen from the coordinator).
    WorkerLost,
    /// The coordinator's word: after a restart, the resumed worker no longer had the run.
    RunLost,
}

macro_rules! names {
    ($ty:ident, $what:literal, $($v:ident => $n:literal),+ $(,)?) => {
        impl $ty {
            /// Every value, in lifecycle order.
            pub const ALL: &'static [$ty] = &[$($ty::$v),+];

            /// Its name on the wire, in records and in every view.
            pub const fn name(self) -> &'static str {
                match self {
                    $($ty::$v => $n),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $ty::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name() == s)
                    .ok_or_else(|| UnknownName {
                        what: $what,
                        name: crate::excerpt(s),
                        known: $ty::ALL.iter().map(|v| v.name()).collect::<Vec<_>>().join(", "),
                    })
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> Deserialize<'de> for $ty {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

names!(RunState, "run state",
    Requested => "requested",
    Starting => "starting",
    Active => "active",
    Stopping => "stopping",
    Stopped => "stopped",
);

names!(StopReason, "stop reason",
    Completed => "completed",
    AgentError => "agent_error",
    Crashed => "crashed",
    TimedOut => "timed_out",
    LeaseLost => "lease_lost",
    OperatorStopped => "operator_stopped",
    Shutdown => "shutdown",
    WorkerLost => "worker_lost",
    RunLost => "run_lost",
);

impl StopReason {
    /// The reasons a worker reports of its own runs (the rest are the coordinator's).
    pub const REPORTED: [StopReason; 7] = [
        StopReason::Completed,
        StopReason::AgentError,
        StopReason::Crashed,
        StopReason::TimedOut,
        StopReason::LeaseLost,
        StopReason::OperatorStopped,
        StopReason::Shutdown,
    ];

    /// Whether the coordinator, not the worker, said it: a worker that comes back and reports
    /// the run's end replaces it.
    pub fn is_coordinators_guess(self) -> bool {
        matches!(self, StopReason::WorkerLost | StopReason::RunLost)
    }
}

impl RunState {
    /// Whether the run has ended (it no longer holds its worker).
    pub fn is_stopped(self) -> bool {
        self == RunState::Stopped
    }
}

/// A name that is none of a vocabulary's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} '{name}': expected one of {known}")]
pub struct UnknownName {
    pub what: &'static str,
    pub name: String,
    pub known: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_reads_back_and_an_unknown_one_says_what_is_known() {
        for s in RunState::ALL {
            assert_eq!(s.name().parse::<RunState>(), Ok(*s));
        }
        for r in StopReason::ALL {
            assert_eq!(r.name().parse::<StopReason>(), Ok(*r));
        }
        let e = "refused: busy".parse::<StopReason>().expect_err("unknown");
        assert!(e.to_string().contains("worker_lost"), "{e}");
        assert!(
            StopReason::REPORTED
                .iter()
                .all(|r| !r.is_coordinators_guess())
        );
    }
}
