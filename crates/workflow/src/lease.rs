//! The lease rules, once for every lease store (the CLI's files without a coordinator, the
//! coordinator's log-backed table, an etcd-backed store later): what a TTL may be, what a
//! change made under a lease must present, and who may release one. Pure functions over
//! values; the stores supply the live lease and map a [`Refusal`] to their own errors.

use std::time::Duration;

use crate::AgentId;

/// The shortest and longest TTL a claim may ask for. A TTL bounds how long a stuck agent holds
/// a task, and every expiry computed from it must stay far inside what clocks can represent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtlBounds {
    pub min: Duration,
    pub max: Duration,
}

impl TtlBounds {
    /// 1 s to 7 days: shorter leases expire between two renewals of a healthy client, longer
    /// ones hold a task for a week after its agent died.
    pub const DEFAULT: TtlBounds = TtlBounds {
        min: Duration::from_secs(1),
        max: Duration::from_secs(7 * 24 * 3600),
    };

    /// No configuration may raise the maximum past this: expiries stay representable.
    pub const CEILING: Duration = Duration::from_secs(366 * 24 * 3600);

    /// `ttl` if it lies within the bounds.
    pub fn check(&self, ttl: Duration) -> Result<Duration, Refusal> {
        if ttl < self.min || ttl > self.max {
            return Err(Refusal::TtlOutOfBounds {
                ttl_ms: ttl.as_millis().min(u64::MAX as u128) as u64,
                min: self.min,
                max: self.max,
            });
        }
        Ok(ttl)
    }

    /// A default TTL (the project's lock timeout) brought inside the bounds.
    pub fn clamp(&self, ttl: Duration) -> Duration {
        ttl.clamp(self.min, self.max)
    }
}

impl Default for TtlBounds {
    fn default() -> Self {
        TtlBounds::DEFAULT
    }
}

/// The live lease a change is checked against, as any store holds it.
#[derive(Debug, Clone, Copy)]
pub struct Holder<'a> {
    pub agent: &'a AgentId,
    /// Empty for lock files written before leases had ids.
    pub lease_id: &'a str,
    pub token: u64,
}

/// What a change presents to prove it is made under the lease.
#[derive(Debug, Clone, Copy, Default)]
pub struct Presented<'a> {
    pub agent: Option<&'a AgentId>,
    pub lease_id: Option<&'a str>,
    pub token: Option<u64>,
}

impl Presented<'_> {
    /// Whether the change names a lease (by id or token), not only an agent.
    pub fn names_a_lease(&self) -> bool {
        self.lease_id.is_some() || self.token.is_some()
    }
}

/// Why a lease rule refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A token or lease id that is not the live lease's: the presenter's lease was lost.
    Stale { given: u64, current: Option<u64> },
    /// A live lease stands and the change does not come from its holder.
    HolderRequired { holder: AgentId },
    /// Only the holder may release.
    NotHolder { holder: AgentId, agent: AgentId },
    TtlOutOfBounds {
        ttl_ms: u64,
        min: Duration,
        max: Duration,
    },
}

/// A change of a task (a transition) made while `live` stands, or with no live lease. With a
/// live lease, the change must come from its holder: it names the holder as its agent or
/// presents the lease's id or token, and whatever it presents must be the live lease's (a
/// stale token or id is refused even when the agent is right: that is what fences a paused
/// process off). With no live lease, a presented id or token is stale; an agent alone is fine.
pub fn check_change(live: Option<Holder<'_>>, p: &Presented<'_>) -> Result<(), Refusal> {
    let stale = |current: Option<u64>| Refusal::Stale {
        given: p.token.unwrap_or(0),
        current,
    };
    let Some(l) = live else {
        return if p.names_a_lease() {
            Err(stale(None))
        } else {
            Ok(())
        };
    };
    let wrong_token = p.token.is_some_and(|t| t != l.token);
    let wrong_id = p
        .lease_id
        .is_some_and(|id| !l.lease_id.is_empty() && id != l.lease_id);
    if wrong_token || wrong_id {
        return Err(stale(Some(l.token)));
    }
    match p.agent {
        Some(a) if a != l.agent => Err(Refusal::HolderRequired {
            holder: l.agent.clone(),
        }),
        None if !p.names_a_lease() => Err(Refusal::HolderRequired {
            holder: l.agent.clone(),
        }),
        _ => Ok(()),
    }
}

/// A release of `live` by `p`: only its holder may end it, with nothing stale presented.
pub fn check_release(live: Holder<'_>, p: &Presented<'_>) -> Result<(), Refusal> {
    if let Some(a) = p.agent
        && a != live.agent
    {
        return Err(Refusal::NotHolder {
            holder: live.agent.clone(),
            agent: a.clone(),
        });
    }
    check_change(Some(live), p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agent(s: &str) -> AgentId {
        s.parse().expect("valid agent")
    }

    #[test]
    fn ttl_outside_the_bounds_is_refused_and_names_them() {
        let b = TtlBounds::DEFAULT;
        assert!(b.check(Duration::from_millis(999)).is_err());
        assert!(b.check(Duration::from_millis(u64::MAX)).is_err());
        assert!(b.check(Duration::from_secs(1)).is_ok());
        assert!(b.check(Duration::from_secs(7 * 24 * 3600)).is_ok());
        assert_eq!(
            b.clamp(Duration::from_secs(30 * 24 * 3600)),
            Duration::from_secs(7 * 24 * 3600)
        );
    }

    #[test]
    fn a_change_under_a_live_lease_needs_its_holder_and_nothing_stale() {
        let (a, b) = (agent("a"), agent("b"));
        let live = Holder {
            agent: &a,
            lease_id: "L1",
            token: 7,
        };
        let by = |agent, lease_id, token| Presented {
            agent,
            lease_id,
            token,
        };
        assert!(check_change(Some(live), &by(Some(&a), None, None)).is_ok());
        assert!(check_change(Some(live), &by(None, Some("L1"), Some(7))).is_ok());
        assert!(matches!(
            check_change(Some(live), &by(None, None, None)),
            Err(Refusal::HolderRequired { .. })
        ));
        assert!(matches!(
            check_change(Some(live), &by(Some(&b), Some("L1"), Some(7))),
            Err(Refusal::HolderRequired { .. })
        ));
        assert!(matches!(
            check_change(Some(live), &by(Some(&a), None, Some(6))),
            Err(Refusal::Stale {
                given: 6,
                current: Some(7)
            })
        ));
        assert!(matches!(
            check_change(Some(live), &by(Some(&a), Some("L0"), None)),
            Err(Refusal::Stale { .. })
        ));
        // No live lease: an agent alone may act, a presented lease is stale.
        assert!(check_change(None, &by(Some(&a), None, None)).is_ok());
        assert!(matches!(
            check_change(None, &by(Some(&a), None, Some(7))),
            Err(Refusal::Stale { current: None, .. })
        ));
    }

    #[test]
    fn only_the_holder_releases() {
        let (a, b) = (agent("a"), agent("b"));
        let live = Holder {
            agent: &a,
            lease_id: "L1",
            token: 7,
        };
        let p = Presented {
            agent: Some(&b),
            lease_id: Some("L1"),
            token: Some(7),
        };
        assert!(matches!(
            check_release(live, &p),
            Err(Refusal::NotHolder { .. })
        ));
        let p = Presented {
            agent: Some(&a),
            ..p
        };
        assert!(check_release(live, &p).is_ok());
    }
}
