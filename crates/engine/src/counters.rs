//! The lease counters: what happens on the lease paths, counted with plain atomics where it
//! happens (a claim costs one relaxed `fetch_add`). The coordinator renders them for
//! Prometheus with what it derives at scrape time.

use std::time::{Duration, SystemTime};

use automaton_telemetry::metrics::{Counter, Histogram, PHASE_BUCKETS};
use automaton_workflow::{LeaseEnd, Phase};

use crate::Error;

const PHASES: usize = Phase::ALL.len();

/// How a lease ends, in the order of [`Counters::ended`]'s series.
pub const END_REASONS: &[LeaseEnd] = LeaseEnd::ALL;
const ENDS: usize = END_REASONS.len();

/// Why a claim or renewal was refused (a small fixed set: the label's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Another agent holds the task.
    Held,
    /// The fencing token is not the lease's.
    StaleToken,
    /// Separation of duties: the implementer may not take a review phase.
    ReviewerIsImplementer,
    /// The task's phase cannot be claimed (awaiting approval, terminal, …).
    Illegal,
    /// No such task, or no live lease with that id.
    NotFound,
    /// A malformed request (a bad TTL, name or id).
    Invalid,
    /// The caller may not act as that agent, or renew another's lease.
    PermissionDenied,
    /// A worker claim without a live session, or from a drained worker.
    NoSession,
    /// The lease log cannot be written: the coordinator is stopping.
    Unavailable,
    Other,
}

impl Refusal {
    pub const ALL: [Refusal; 10] = [
        Refusal::Held,
        Refusal::StaleToken,
        Refusal::ReviewerIsImplementer,
        Refusal::Illegal,
        Refusal::NotFound,
        Refusal::Invalid,
        Refusal::PermissionDenied,
        Refusal::NoSession,
        Refusal::Unavailable,
        Refusal::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Held => "held",
            Refusal::StaleToken => "stale_token",
            Refusal::ReviewerIsImplementer => "reviewer_is_implementer",
            Refusal::Illegal => "illegal",
            Refusal::NotFound => "not_found",
            Refusal::Invalid => "invalid",
            Refusal::PermissionDenied => "permission_denied",
            Refusal::NoSession => "no_session",
            Refusal::Unavailable => "unavailable",
            Refusal::Other => "other",
        }
    }

    pub fn of(e: &Error) -> Refusal {
        use automaton_store::Error as S;
        match e {
            Error::Store(s) => match s {
                S::Leased { .. } => Refusal::Held,
                S::StaleToken { .. } => Refusal::StaleToken,
                S::Separation { .. } => Refusal::ReviewerIsImplementer,
                S::NotClaimable { .. } => Refusal::Illegal,
                S::TaskNotFound { .. } | S::NoLease { .. } => Refusal::NotFound,
                S::HolderRequired { .. } | S::NotHolder { .. } => Refusal::PermissionDenied,
                _ => match s.kind() {
                    automaton_store::ErrorKind::Invalid => Refusal::Invalid,
                    automaton_store::ErrorKind::NotFound => Refusal::NotFound,
                    automaton_store::ErrorKind::Refused => Refusal::Illegal,
                    _ => Refusal::Other,
                },
            },
            Error::LeaseNotFound(_) => Refusal::NotFound,
            Error::Invalid(_) => Refusal::Invalid,
            Error::PermissionDenied(_) => Refusal::PermissionDenied,
            Error::Refused(_) => Refusal::NoSession,
            Error::Unavailable(_) | Error::NotLeading(_) => Refusal::Unavailable,
            _ => Refusal::Other,
        }
    }
}

/// The class of a task's waiting reason (as dispatch words it, see `dispatch::waiting_reason`
/// and `waves.rs`).
pub struct Counters {
    claims: Counter,
    renewals: Counter,
    releases: Counter,
    expiries: [Counter; ENDS],
    refusals: [Counter; Refusal::ALL.len()],
    phase_duration: Vec<Histogram>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            claims: Counter::new(),
            renewals: Counter::new(),
            releases: Counter::new(),
            expiries: Default::default(),
            refusals: Default::default(),
            phase_duration: (0..PHASES * END_REASONS.len())
                .map(|_| Histogram::new(PHASE_BUCKETS))
                .collect(),
        }
    }
}

/// `p`'s place in [`Phase::ALL`].
pub fn phase_index(p: Phase) -> usize {
    Phase::ALL.iter().position(|q| *q == p).unwrap_or(0)
}

impl Counters {
    #[inline]
    pub fn granted(&self) {
        self.claims.inc();
    }

    #[inline]
    pub fn renewed(&self) {
        self.renewals.inc();
    }

    pub fn refused(&self, why: Refusal) {
        if let Some(c) = Refusal::ALL
            .iter()
            .position(|r| *r == why)
            .and_then(|i| self.refusals.get(i))
        {
            c.inc();
        }
    }

    /// A lease granted at `claimed` on `phase` ended for `reason`.
    pub fn ended(&self, phase: Phase, claimed: SystemTime, reason: LeaseEnd) {
        let r = END_REASONS.iter().position(|x| *x == reason);
        match reason {
            LeaseEnd::Released | LeaseEnd::Transitioned => self.releases.inc(),
            _ => {
                if let Some(c) = r.and_then(|r| self.expiries.get(r)) {
                    c.inc();
                }
            }
        }
        let held = SystemTime::now()
            .duration_since(claimed)
            .unwrap_or(Duration::ZERO);
        if let Some(h) = r.and_then(|r| {
            self.phase_duration
                .get(phase_index(phase) * END_REASONS.len() + r)
        }) {
            h.observe(held);
        }
    }

    /// Leases granted.
    pub fn claims(&self) -> u64 {
        self.claims.get()
    }

    /// Leases renewed.
    pub fn renewals(&self) -> u64 {
        self.renewals.get()
    }

    /// Leases ended by their holder (released or transitioned).
    pub fn releases(&self) -> u64 {
        self.releases.get()
    }

    /// Leases ended for `END_REASONS[i]` without their holder.
    pub fn expiries(&self, i: usize) -> u64 {
        self.expiries.get(i).map_or(0, Counter::get)
    }

    /// Claims and renewals refused for `Refusal::ALL[i]`.
    pub fn refusals(&self, i: usize) -> u64 {
        self.refusals.get(i).map_or(0, Counter::get)
    }

    /// How long leases of `Phase::ALL[phase]` were held that ended for `END_REASONS[reason]`.
    pub fn phase_duration(&self, phase: usize, reason: usize) -> Option<&Histogram> {
        self.phase_duration.get(phase * END_REASONS.len() + reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_end_counts_as_a_release_or_an_expiry_by_its_reason() {
        let m = Counters::default();
        let claimed = SystemTime::now() - Duration::from_secs(2);
        m.ended(Phase::Design, claimed, LeaseEnd::Released);
        m.ended(Phase::Design, claimed, LeaseEnd::Transitioned);
        m.ended(Phase::Implement, claimed, LeaseEnd::Expired);
        m.ended(Phase::Implement, claimed, LeaseEnd::SessionExpired);
        assert_eq!(m.releases(), 2);
        assert_eq!(
            (0..END_REASONS.len())
                .map(|i| m.expiries(i))
                .collect::<Vec<_>>(),
            [0, 0, 1, 1, 0, 0]
        );
        let h = m
            .phase_duration(phase_index(Phase::Implement), 2)
            .expect("a series");
        assert_eq!(h.count(), 1);
        assert!(h.sum_seconds() >= 2.0, "{}", h.sum_seconds());
    }

    #[test]
    fn refusals_are_classified_by_what_refused_them() {
        let task: automaton_workflow::TaskName = "t".parse().expect("task");
        for (e, r) in [
            (Error::LeaseNotFound("x".into()), Refusal::NotFound),
            (Error::Invalid("x".into()), Refusal::Invalid),
            (Error::Refused("x".into()), Refusal::NoSession),
            (
                Error::Store(automaton_store::Error::StaleToken {
                    task: task.clone(),
                    given: 1,
                    current: Some(2),
                }),
                Refusal::StaleToken,
            ),
            (
                Error::Store(automaton_store::Error::TaskNotFound {
                    task,
                    tasks: String::new(),
                }),
                Refusal::NotFound,
            ),
        ] {
            assert_eq!(Refusal::of(&e), r, "{e}");
        }
    }
}
