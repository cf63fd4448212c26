//! The sign-in rate limit: at most [`MAX_FAILURES`] refused tokens per client address in any
//! [`WINDOW`]; past it, every sign-in from that address (a right token too, so guessing
//! learns nothing) is answered 429 with `Retry-After` until the oldest failure leaves the
//! window. A success forgets the address's failures. Behind a reverse proxy every client
//! shares the proxy's address, and so its budget.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Refused sign-ins an address may make within [`WINDOW`].
pub const MAX_FAILURES: usize = 5;
/// The sliding window failures are counted in.
pub const WINDOW: Duration = Duration::from_secs(60);
/// The most addresses remembered; past it, addresses with no failure in the window go first,
/// then the one whose last failure is oldest.
pub const MAX_ADDRESSES: usize = 10_000;

/// Failed sign-ins by client address (IPv4-mapped IPv6 counted as IPv4).
#[derive(Debug, Default)]
pub struct SignInLimit {
    failures: HashMap<IpAddr, VecDeque<Instant>>,
}

impl SignInLimit {
    pub fn new() -> SignInLimit {
        SignInLimit::default()
    }

    /// `Some(wait)` when `ip` has used up its failures: how long until it may try again.
    pub fn blocked(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let times = self.failures.get(&ip.to_canonical())?;
        if times.len() < MAX_FAILURES {
            return None;
        }
        let oldest = *times.front()?;
        let age = now.saturating_duration_since(oldest);
        (age < WINDOW).then(|| WINDOW - age)
    }

    /// Notes a refused sign-in from `ip`.
    pub fn failed(&mut self, ip: IpAddr, now: Instant) {
        let ip = ip.to_canonical();
        if !self.failures.contains_key(&ip) && self.failures.len() >= MAX_ADDRESSES {
            self.make_room(now);
        }
        let times = self.failures.entry(ip).or_default();
        times.push_back(now);
        while times.len() > MAX_FAILURES {
            times.pop_front();
        }
    }

    /// Forgets `ip`'s failures (it signed in).
    pub fn succeeded(&mut self, ip: IpAddr) {
        self.failures.remove(&ip.to_canonical());
    }

    /// How many addresses are remembered.
    pub fn len(&self) -> usize {
        self.failures.len()
    }

    /// No address is remembered.
    pub fn is_empty(&self) -> bool {
        self.failures.is_empty()
    }

    fn make_room(&mut self, now: Instant) {
        self.failures.retain(|_, t| {
            t.back()
                .is_some_and(|last| now.saturating_duration_since(*last) < WINDOW)
        });
        if self.failures.len() >= MAX_ADDRESSES {
            let oldest = self
                .failures
                .iter()
                .min_by_key(|(_, t)| t.back().copied())
                .map(|(ip, _)| *ip);
            if let Some(ip) = oldest {
                self.failures.remove(&ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn five_failures_a_minute_then_blocked_until_the_oldest_leaves_the_window() {
        let mut l = SignInLimit::new();
        let t0 = Instant::now();
        let a = ip("10.0.0.1");
        for i in 0..MAX_FAILURES {
            assert_eq!(l.blocked(a, t0), None, "attempt {i}");
            l.failed(a, t0 + Duration::from_secs(i as u64));
        }
        // The oldest failure was at t0: free again at t0 + 60 s.
        let now = t0 + Duration::from_secs(10);
        assert_eq!(l.blocked(a, now), Some(Duration::from_secs(50)));
        // Another address is not affected; the IPv4-mapped form is the same address.
        assert_eq!(l.blocked(ip("10.0.0.2"), now), None);
        assert_eq!(
            l.blocked(ip("::ffff:10.0.0.1"), now),
            Some(Duration::from_secs(50))
        );
        assert_eq!(l.blocked(a, t0 + WINDOW), None);
        // One more failure then: the window now starts at the second one (t0 + 1 s).
        l.failed(a, t0 + WINDOW);
        assert_eq!(
            l.blocked(a, t0 + WINDOW),
            Some(Duration::from_secs(1)),
            "four failures within the window plus this one"
        );
    }

    #[test]
    fn success_forgets_and_memory_is_bounded() {
        let mut l = SignInLimit::new();
        let t0 = Instant::now();
        let a = ip("192.0.2.7");
        for _ in 0..MAX_FAILURES {
            l.failed(a, t0);
        }
        assert!(l.blocked(a, t0).is_some());
        l.succeeded(a);
        assert_eq!(l.blocked(a, t0), None);
        assert!(l.is_empty());
        for i in 0..(MAX_ADDRESSES as u32 + 50) {
            l.failed(IpAddr::from(i.to_be_bytes()), t0);
        }
        assert!(l.len() <= MAX_ADDRESSES, "{}", l.len());
        // Stale addresses go first when room is needed.
        let later = t0 + WINDOW + Duration::from_secs(1);
        l.failed(ip("198.51.100.1"), later);
        assert_eq!(l.len(), 1);
    }
}
