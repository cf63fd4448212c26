//! The proto's enums and `automaton-workflow`'s vocabulary, one to one, and how a run's state
//! and stop reason are read from the wire: the enum where a peer set it, else the string
//! field beside it (what an older peer sends). Writers set both.

use automaton_workflow::{DeliveryState, EventKind, LeaseEnd, RunState, StopReason, WorkerState};

use crate::v1 as pb;

/// The proto numbers each enum's values as the vocabulary lists them (`ALL`, from 1; 0 is
/// unspecified), with the same names: the mapping is the position, and the test below holds
/// every value to its name.
macro_rules! one_to_one {
    ($($ours:ident => $wire:ty),+ $(,)?) => {$(
        impl From<$ours> for $wire {
            fn from(v: $ours) -> Self {
                let i = $ours::ALL.iter().position(|x| *x == v).map_or(0, |i| i + 1);
                <$wire>::try_from(i as i32).unwrap_or_default()
            }
        }

        impl TryFrom<$wire> for $ours {
            type Error = ();

            /// `Err` for the unspecified value.
            fn try_from(v: $wire) -> Result<Self, ()> {
                usize::try_from(v as i32 - 1)
                    .ok()
                    .and_then(|i| $ours::ALL.get(i).copied())
                    .ok_or(())
            }
        }
    )+};
}

one_to_one!(
    RunState => pb::RunState,
    StopReason => pb::StopReason,
    LeaseEnd => pb::LeaseEnd,
    EventKind => pb::EventKind,
    DeliveryState => pb::DeliveryState,
    WorkerState => pb::WorkerState,
);

/// A worker's state, typed: the enum if set, else the string.
pub fn worker_state(w: &pb::WorkerInfo) -> Option<WorkerState> {
    WorkerState::try_from(w.worker_state())
        .ok()
        .or_else(|| w.state.parse().ok())
}

/// A delivery's state, typed: the enum if set, else the string.
pub fn delivery_state(d: &pb::Delivery) -> Option<DeliveryState> {
    DeliveryState::try_from(d.delivery_state())
        .ok()
        .or_else(|| d.state.parse().ok())
}

/// An event's kind, typed: the enum if the coordinator set it, else the string.
pub fn event_kind(e: &pb::Event) -> Option<EventKind> {
    EventKind::try_from(e.event_kind())
        .ok()
        .or_else(|| e.kind.parse().ok())
}

/// The state a `transitioned` event's task entered: `to_state`, else the detail's `→` side
/// (an older coordinator's).
pub fn entered(e: &pb::Event) -> Option<automaton_workflow::State> {
    if !e.to_state.is_empty() {
        return e.to_state.parse().ok();
    }
    e.detail
        .rsplit(" → ")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
}

/// A run's state and stop reason, typed, on the messages that carry them.
pub trait RunVocab {
    /// The run's state: the enum if set, else the string; `None` when neither names one.
    fn state_kind(&self) -> Option<RunState>;
    /// Why it stopped: the enum if set, else the string; `None` while it has not.
    fn stop_kind(&self) -> Option<StopReason>;
    /// Sets the state, enum and string.
    fn set_state_kind(&mut self, s: RunState);
    /// Sets the stop reason (or clears it), enum and string.
    fn set_stop_kind(&mut self, r: Option<StopReason>);

    /// Whether it stopped having completed its phase.
    fn completed(&self) -> bool {
        self.stop_kind() == Some(StopReason::Completed)
    }
}

macro_rules! run_vocab {
    ($msg:ty, $state:ident, $reason:ident) => {
        impl RunVocab for $msg {
            fn state_kind(&self) -> Option<RunState> {
                RunState::try_from(self.run_state())
                    .ok()
                    .or_else(|| self.$state.parse().ok())
            }

            fn stop_kind(&self) -> Option<StopReason> {
                StopReason::try_from(self.reason())
                    .ok()
                    .or_else(|| self.$reason.parse().ok())
            }

            fn set_state_kind(&mut self, s: RunState) {
                self.$state = s.name().to_string();
                self.set_run_state(s.into());
            }

            fn set_stop_kind(&mut self, r: Option<StopReason>) {
                match r {
                    Some(r) => {
                        self.$reason = r.name().to_string();
                        self.set_reason(r.into());
                    }
                    None => {
                        self.$reason.clear();
                        self.set_reason(pb::StopReason::Unspecified);
                    }
                }
            }
        }
    };
}

run_vocab!(pb::Run, state, stop_reason);
run_vocab!(pb::RunUpdate, state, stop_reason);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_value_crosses_the_wire_and_an_older_peers_string_is_read() {
        // Each value maps to the proto's value of the same name, and back.
        macro_rules! same {
            ($($ours:ident, $wire:ty, $prefix:literal;)+) => {$(
                for v in $ours::ALL {
                    let w = <$wire>::from(*v);
                    assert_eq!(
                        w.as_str_name(),
                        format!("{}{}", $prefix, v.name().to_ascii_uppercase())
                    );
                    assert_eq!($ours::try_from(w), Ok(*v));
                }
            )+};
        }
        same! {
            RunState, pb::RunState, "RUN_STATE_";
            StopReason, pb::StopReason, "STOP_REASON_";
            LeaseEnd, pb::LeaseEnd, "LEASE_END_";
            EventKind, pb::EventKind, "EVENT_KIND_";
            DeliveryState, pb::DeliveryState, "DELIVERY_STATE_";
            WorkerState, pb::WorkerState, "WORKER_STATE_";
        }
        // The unspecified value is none of them.
        assert_eq!(EventKind::try_from(pb::EventKind::Unspecified), Err(()));
        let mut run = pb::Run::default();
        assert_eq!((run.state_kind(), run.stop_kind()), (None, None));
        run.set_state_kind(RunState::Stopped);
        run.set_stop_kind(Some(StopReason::WorkerLost));
        assert_eq!(
            (run.state.as_str(), run.stop_reason.as_str()),
            ("stopped", "worker_lost")
        );
        assert_eq!(run.stop_kind(), Some(StopReason::WorkerLost));
        // An older worker sends the strings only.
        let old = pb::RunUpdate {
            state: "stopped".into(),
            stop_reason: "completed".into(),
            ..Default::default()
        };
        assert_eq!(old.state_kind(), Some(RunState::Stopped));
        assert!(old.completed());
        run.set_stop_kind(None);
        assert_eq!((run.stop_kind(), run.stop_reason.as_str()), (None, ""));
    }
}
