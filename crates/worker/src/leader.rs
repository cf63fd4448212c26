//! Which coordinator this worker talks to: the leader among the ones it was given
//! (`--coordinator a,b,c`, `store = etcd`), shared by the session and every run's `Work`
//! calls so that both always go to the same place.
//!
//! The session loop finds the leader at every (re)connect (`automaton_client::find_leader`:
//! each coordinator's health service, a follower's `automaton-leader` metadata followed) and
//! points the handle at it; any call or stream refused `UNAVAILABLE` naming a leader points
//! it there at once. A run's calls take the handle's channel at every try, so a call being
//! retried while the old leader is dead lands on the new one as soon as it is known, rather
//! than hammering a dead or follower address until its retry time is up.
//!
//! With one coordinator nothing is probed: it is its own leader, as before there were several.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tonic::transport::{Channel, Endpoint};

/// A coordinator's URL checked as the worker takes it: `http://` or `https://`, a host, and
/// nothing a gRPC endpoint cannot use.
pub fn check_url(url: &str) -> Result<(), String> {
    let bad = |why: &str| {
        Err(format!(
            "invalid coordinator address '{url}': {why}; write e.g. http://127.0.0.1:7070"
        ))
    };
    let Some(rest) = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
    else {
        return bad("it must start with http:// or https://");
    };
    if rest.is_empty() || rest.starts_with('/') || rest.starts_with(':') {
        return bad("it names no host");
    }
    if Endpoint::from_shared(url.to_string()).is_err() {
        return bad("it is not a URL");
    }
    Ok(())
}

/// How the worker connects to `url`, for the session and the `Work` calls alike.
pub fn endpoint(url: &str) -> Result<Endpoint, String> {
    Endpoint::from_shared(url.to_string())
        .map(|e| {
            e.connect_timeout(Duration::from_secs(5))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_while_idle(true)
        })
        .map_err(|_| {
            format!("invalid coordinator address '{url}': write e.g. http://127.0.0.1:7070")
        })
}

/// The coordinators given, and the one believed to lead now (cheap to clone: one handle).
#[derive(Clone)]
pub struct Leader {
    inner: Arc<Inner>,
}

struct Inner {
    given: Vec<String>,
    /// The leader as last found or named, and a lazy channel to it for the `Work` calls
    /// (it reconnects on its own while the address stays the same).
    current: RwLock<Current>,
    /// Bumped each time the calls are pointed elsewhere: a call waiting to be retried tries
    /// the new leader at once rather than after its backoff.
    moved: tokio::sync::watch::Sender<u64>,
}

struct Current {
    url: String,
    channel: Channel,
    /// Whether `url` was found or named as the leader (logged), rather than the first
    /// coordinator given, taken before anything was asked.
    known: bool,
    /// A leader a refusal named since the last search: the next connect goes straight there.
    named: bool,
}

impl Leader {
    /// A handle over `given` (at least one URL, each passing [`check_url`]); it starts at the
    /// first, unasked.
    pub fn new(given: Vec<String>) -> Result<Leader, String> {
        let first = given
            .first()
            .cloned()
            .ok_or_else(|| "no coordinator given: pass --coordinator URL[,URL…]".to_string())?;
        for url in &given {
            check_url(url)?;
        }
        let channel = endpoint(&first)?.connect_lazy();
        Ok(Leader {
            inner: Arc::new(Inner {
                given,
                current: RwLock::new(Current {
                    url: first,
                    channel,
                    known: false,
                    named: false,
                }),
                moved: tokio::sync::watch::Sender::new(0),
            }),
        })
    }

    fn current(&self) -> std::sync::RwLockReadGuard<'_, Current> {
        // A panic elsewhere while holding the lock leaves a plain value behind: keep using it.
        self.inner.current.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The coordinator the calls go to now.
    pub fn url(&self) -> String {
        self.current().url.clone()
    }

    /// The channel to the coordinator the calls go to now (a clone: calls on it stay there).
    pub fn channel(&self) -> Channel {
        self.current().channel.clone()
    }

    /// Tells of the next time the calls are pointed at another coordinator.
    pub fn watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.inner.moved.subscribe()
    }

    /// Whether more than one coordinator was given (a fleet under `store = etcd`).
    pub fn several(&self) -> bool {
        self.inner.given.len() > 1
    }

    /// Whether a refusal named the leader since the last search (the next connect goes there).
    pub fn named(&self) -> bool {
        self.current().named
    }

    /// Points the calls at `url`, the leader as found or named; logs a change.
    fn point_at(&self, url: &str, named: bool) -> Result<(), String> {
        let mut cur = self
            .inner
            .current
            .write()
            .unwrap_or_else(|p| p.into_inner());
        cur.named = named;
        if cur.url == url {
            if !cur.known && self.several() {
                tracing::info!(leader = %url, "following the leader");
            }
            cur.known = true;
            return Ok(());
        }
        // A follower may name a URL the worker was not given: check it as if it had been.
        check_url(url)?;
        let channel = endpoint(url)?.connect_lazy();
        tracing::info!(leader = %url, previous = %cur.url, "following the leader");
        *cur = Current {
            url: url.to_string(),
            channel,
            known: true,
            named,
        };
        drop(cur);
        self.inner.moved.send_modify(|n| *n += 1);
        Ok(())
    }

    /// Follows the leader a refusal named (`automaton_client::leader_named`).
    pub fn follow_url(&self, url: &str) {
        if let Err(why) = self.point_at(url, true) {
            tracing::warn!(error = %why, "a coordinator named a leader this worker cannot use");
        }
    }

    /// Follows the leader `status` names (a follower's `UNAVAILABLE` with the
    /// `automaton-leader` metadata); whether it named one.
    pub fn follow(&self, status: &tonic::Status) -> bool {
        let Some(url) = automaton_client::leader_named(status) else {
            return false;
        };
        self.follow_url(&url);
        true
    }

    /// The coordinator to connect the session to: the leader a refusal just named, else the
    /// leader found among the coordinators given within `wait` (one coordinator: itself,
    /// unasked). The calls are pointed at it too.
    pub async fn find(&self, wait: Duration) -> Result<String, String> {
        {
            let mut cur = self
                .inner
                .current
                .write()
                .unwrap_or_else(|p| p.into_inner());
            if std::mem::take(&mut cur.named) {
                return Ok(cur.url.clone());
            }
        }
        let url = automaton_client::find_leader(&self.inner.given, wait, |u| {
            // A health check that cannot connect within its bound says little: keep it short.
            endpoint(u).map(|e| e.connect_timeout(Duration::from_secs(2)))
        })
        .await?;
        self.point_at(&url, false)?;
        Ok(url)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_coordinator_url_needs_a_scheme_and_a_host_and_the_error_is_one_line() {
        for ok in [
            "http://127.0.0.1:7070",
            "https://coordinator-0.example:7070",
            "http://[::1]:7070",
        ] {
            assert!(check_url(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("127.0.0.1:7070", "must start with http:// or https://"),
            ("grpc://h:1", "must start with http:// or https://"),
            ("http://", "names no host"),
            ("http://:7070", "names no host"),
            ("http://a b:7070", "is not a URL"),
        ] {
            let e = check_url(bad).unwrap_err();
            assert!(
                e.contains(why) && e.contains(bad) && !e.contains('\n'),
                "{bad}: {e}"
            );
        }
    }

    #[tokio::test]
    async fn one_coordinator_is_its_own_leader_unasked_and_a_named_leader_is_followed() {
        // Nothing listens there: one coordinator is never probed.
        let l = Leader::new(vec!["http://127.0.0.1:9".into()]).unwrap();
        assert_eq!(
            l.find(Duration::from_millis(10)).await.unwrap(),
            "http://127.0.0.1:9"
        );
        let mut refusal = tonic::Status::unavailable("a follower");
        refusal.metadata_mut().insert(
            automaton_client::LEADER_METADATA,
            "http://127.0.0.1:10".parse().unwrap(),
        );
        let moved = l.watch();
        assert!(l.follow(&refusal));
        assert_eq!(l.url(), "http://127.0.0.1:10");
        assert!(moved.has_changed().unwrap(), "a waiting call is told");
        // The next connect goes straight to the named leader, then searches again.
        assert_eq!(
            l.find(Duration::from_millis(10)).await.unwrap(),
            "http://127.0.0.1:10"
        );
        assert_eq!(
            l.find(Duration::from_millis(10)).await.unwrap(),
            "http://127.0.0.1:9"
        );
        assert!(!l.follow(&tonic::Status::unavailable("no leader named")));
        assert!(Leader::new(vec![]).is_err());
        assert!(Leader::new(vec!["http://h:1".into(), "nope".into()]).is_err());
    }
}
