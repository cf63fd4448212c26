//! The fleet's one vocabulary: an agent run's own small lifecycle (seed 003 §5: REQUESTED →
//! STARTING → ACTIVE → STOPPING → STOPPED, with a required stop reason that the exit code
//! alone does not decide), why a lease ended, and the kinds of event the coordinator tells
//! its watchers. Shared by the worker, the coordinator, the CLI, the console and the
//! webhooks; the wire carries the same names (and the proto's enums, one to one).

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

/// Why a lease ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LeaseEnd {
    /// Its holder released it (or a worker's run stopped and gave it back).
    Released,
    /// The task moved on with the phase it was granted for.
    Transitioned,
    /// Its TTL passed without a renewal.
    Expired,
    /// Its worker's session went silent past the session timeout.
    SessionExpired,
    /// A new process registered under its worker's name (`--replace`).
    SessionReplaced,
    /// After a coordinator restart, the worker that resumed its session no longer had the run.
    RunLost,
}

names!(LeaseEnd, "lease end",
    Released => "released",
    Transitioned => "transitioned",
    Expired => "expired",
    SessionExpired => "session_expired",
    SessionReplaced => "session_replaced",
    RunLost => "run_lost",
);

impl LeaseEnd {
    /// Whether time ended it, not anyone's act (`lease_expired`, not `lease_released`).
    pub fn is_expiry(self) -> bool {
        matches!(self, LeaseEnd::Expired | LeaseEnd::SessionExpired)
    }
}

/// Where a delivery stands (seed 003's worktree lifecycle; `docs/delivery.md` says where it
/// departs from it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeliveryState {
    /// Recorded when the task completed; waits here for an operator with `approve = true`.
    #[default]
    Requested,
    /// The merge is being built (or the branch pushed, for a pull request).
    Preparing,
    /// The commit that lands is built and recorded; a failed landing comes back here.
    Ready,
    /// The base is being moved (or the pull request opened).
    Merging,
    /// On the base branch (`commit`).
    Merged,
    /// A pull request is open (`url`): the forge's merge is a person's.
    Opened,
    /// Given up by a person (`automaton abandon`).
    Abandoned,
}

names!(DeliveryState, "delivery state",
    Requested => "requested",
    Preparing => "preparing",
    Ready => "ready",
    Merging => "merging",
    Merged => "merged",
    Opened => "opened",
    Abandoned => "abandoned",
);

impl DeliveryState {
    /// Nothing more happens on its own.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            DeliveryState::Merged | DeliveryState::Opened | DeliveryState::Abandoned
        )
    }
}

/// Where a worker stands in the fleet view.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerState {
    /// In session, with a free slot.
    Idle,
    /// In session, every slot taken (a run still stopping counts).
    Busy,
    /// Takes no new work (`automaton workers drain`).
    Draining,
    /// Its session waits for it to come back after a coordinator restart.
    Reconnecting,
    /// Its session ended without a goodbye (dead, silent, or replaced).
    Lost,
}

names!(WorkerState, "worker state",
    Idle => "idle",
    Busy => "busy",
    Draining => "draining",
    Reconnecting => "reconnecting",
    Lost => "lost",
);

impl WorkerState {
    /// Whether it is there to take work at all (in session, heard of).
    pub fn is_present(self) -> bool {
        !matches!(self, WorkerState::Lost | WorkerState::Reconnecting)
    }
}

/// What an event on the coordinator's feed (`WatchEvents`, the console, webhooks) is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    // Tasks.
    TaskCreated,
    Transitioned,
    Approved,
    TaskHeld,
    TaskResumed,
    HumanIntervention,
    ParentEnded,
    ReviewStale,
    Rework,
    FollowUpCreated,
    VramConfigRecreated,
    ArtifactUploaded,
    CodeCommitted,
    NoCodeChange,
    // Leases.
    LeaseGranted,
    LeaseRenewed,
    LeaseReleased,
    LeaseExpired,
    LeaseRefused,
    // Workers.
    WorkerJoined,
    WorkerResumed,
    WorkerLeft,
    WorkerLost,
    WorkerDrained,
    WorkerUndrained,
    // Dispatch and runs.
    Dispatched,
    Assigned,
    OfferDeclined,
    OfferUnanswered,
    RunRequested,
    RunStarted,
    RunStopped,
    RunAdopted,
    SizingLearned,
    // Sub-tasks.
    SubtaskCreated,
    SubtaskMerged,
    SubtaskOrphaned,
    SubtaskTooLarge,
    // Delivery.
    DeliveryRequested,
    DeliveryAwaitingApproval,
    DeliveryApproved,
    DeliveryFailed,
    DeliveryAbandoned,
    Merged,
    PullRequestOpened,
    BranchRemoved,
    // The watcher's own stream: events were dropped for it.
    Lagged,
}

names!(EventKind, "event kind",
    TaskCreated => "task_created",
    Transitioned => "transitioned",
    Approved => "approved",
    TaskHeld => "task_held",
    TaskResumed => "task_resumed",
    HumanIntervention => "human_intervention",
    ParentEnded => "parent_ended",
    ReviewStale => "review_stale",
    Rework => "rework",
    FollowUpCreated => "follow_up_created",
    VramConfigRecreated => "vram_config_recreated",
    ArtifactUploaded => "artifact_uploaded",
    CodeCommitted => "code_committed",
    NoCodeChange => "no_code_change",
    LeaseGranted => "lease_granted",
    LeaseRenewed => "lease_renewed",
    LeaseReleased => "lease_released",
    LeaseExpired => "lease_expired",
    LeaseRefused => "lease_refused",
    WorkerJoined => "worker_joined",
    WorkerResumed => "worker_resumed",
    WorkerLeft => "worker_left",
    WorkerLost => "worker_lost",
    WorkerDrained => "worker_drained",
    WorkerUndrained => "worker_undrained",
    Dispatched => "dispatched",
    Assigned => "assigned",
    OfferDeclined => "offer_declined",
    OfferUnanswered => "offer_unanswered",
    RunRequested => "run_requested",
    RunStarted => "run_started",
    RunStopped => "run_stopped",
    RunAdopted => "run_adopted",
    SizingLearned => "sizing_learned",
    SubtaskCreated => "subtask_created",
    SubtaskMerged => "subtask_merged",
    SubtaskOrphaned => "subtask_orphaned",
    SubtaskTooLarge => "subtask_too_large",
    DeliveryRequested => "delivery_requested",
    DeliveryAwaitingApproval => "delivery_awaiting_approval",
    DeliveryApproved => "delivery_approved",
    DeliveryFailed => "delivery_failed",
    DeliveryAbandoned => "delivery_abandoned",
    Merged => "merged",
    PullRequestOpened => "pull_request_opened",
    BranchRemoved => "branch_removed",
    Lagged => "lagged",
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
        for e in LeaseEnd::ALL {
            assert_eq!(e.name().parse::<LeaseEnd>(), Ok(*e));
        }
        let mut kinds: Vec<&str> = EventKind::ALL.iter().map(|k| k.name()).collect();
        for k in EventKind::ALL {
            assert_eq!(k.name().parse::<EventKind>(), Ok(*k));
        }
        kinds.sort_unstable();
        kinds.dedup();
        assert_eq!(kinds.len(), EventKind::ALL.len(), "two kinds share a name");
        let e = "refused: busy".parse::<StopReason>().expect_err("unknown");
        assert!(e.to_string().contains("worker_lost"), "{e}");
        assert!(
            StopReason::REPORTED
                .iter()
                .all(|r| !r.is_coordinators_guess())
        );
    }
}
