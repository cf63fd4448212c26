//! Sign-in sessions: the only state the console keeps. A session maps a random cookie id
//! to the operator's name, their token (sent on every gRPC call made for them) and a CSRF
//! token; it lives 12 hours, in memory, and at most [`MAX_SESSIONS`] are kept (the oldest
//! go first).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

/// The cookie that carries the session id.
pub const COOKIE: &str = "automaton_console";
/// How long a session lives after sign-in.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 60 * 60);
/// The most sessions kept; signing in past it evicts the oldest.
pub const MAX_SESSIONS: usize = 10_000;

/// A signed-in operator.
#[derive(Clone, Debug)]
pub struct Session {
    /// The operator's name, as the coordinator's [`crate::Authenticate`] gave it.
    pub operator: String,
    /// The token they signed in with.
    pub token: String,
    /// What every form of theirs must carry back.
    pub csrf: String,
    /// When the session ends.
    pub expires: Instant,
    seq: u64,
}

/// The live sessions, bounded.
#[derive(Debug)]
pub struct Sessions {
    by_id: HashMap<String, Session>,
    /// Sign-in order (oldest first) to evict by.
    order: BTreeMap<u64, String>,
    next_seq: u64,
    cap: usize,
}

impl Sessions {
    /// An empty store holding at most `cap` sessions.
    pub fn new(cap: usize) -> Sessions {
        Sessions {
            by_id: HashMap::new(),
            order: BTreeMap::new(),
            next_seq: 0,
            cap: cap.max(1),
        }
    }

    /// How many sessions are kept (expired ones included until they are looked up or
    /// evicted).
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// No session is kept.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Starts a session for `operator` signed in with `token`; returns its cookie id.
    pub fn create(
        &mut self,
        operator: String,
        token: String,
        now: Instant,
    ) -> Result<String, String> {
        let id = random_hex(32)?;
        let csrf = random_hex(32)?;
        while self.by_id.len() >= self.cap {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.by_id.remove(&oldest);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.order.insert(seq, id.clone());
        self.by_id.insert(
            id.clone(),
            Session {
                operator,
                token,
                csrf,
                expires: now + SESSION_TTL,
                seq,
            },
        );
        Ok(id)
    }

    /// The live session with cookie id `id`; an expired one is dropped.
    pub fn get(&mut self, id: &str, now: Instant) -> Option<Session> {
        let s = self.by_id.get(id)?;
        if s.expires <= now {
            self.remove(id);
            return None;
        }
        Some(s.clone())
    }

    /// Ends the session `id` (sign-out).
    pub fn remove(&mut self, id: &str) {
        if let Some(s) = self.by_id.remove(id) {
            self.order.remove(&s.seq);
        }
    }

    /// The token of the newest live session, for the shared event feed.
    pub fn newest_token(&self, now: Instant) -> Option<String> {
        self.order
            .values()
            .rev()
            .filter_map(|id| self.by_id.get(id))
            .find(|s| s.expires > now)
            .map(|s| s.token.clone())
    }
}

/// `n` random bytes from the OS, as lowercase hex.
pub fn random_hex(n: usize) -> Result<String, String> {
    let mut buf = vec![0u8; n];
    getrandom::fill(&mut buf).map_err(|e| format!("no randomness from the OS: {e}"))?;
    Ok(automaton_workflow::hex(&buf))
}

/// Compares two secrets in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The `Set-Cookie` value that starts a session.
pub fn session_cookie(id: &str, secure: bool) -> String {
    format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}{}",
        SESSION_TTL.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` value that ends one.
pub fn clear_cookie(secure: bool) -> String {
    format!(
        "{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0{}",
        if secure { "; Secure" } else { "" }
    )
}

/// The session id in a `Cookie` header's value, if it names one.
pub fn cookie_id(header: &str) -> Option<&str> {
    header
        .split(';')
        .filter_map(|kv| kv.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.trim())
        .filter(|v| !v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_attributes() {
        let c = session_cookie("abc", false);
        assert!(c.starts_with("automaton_console=abc;"));
        for attr in ["HttpOnly", "SameSite=Strict", "Path=/"] {
            assert!(c.contains(attr), "{c}");
        }
        assert!(!c.contains("Secure"));
        assert!(session_cookie("abc", true).ends_with("; Secure"));
        assert!(clear_cookie(true).contains("Max-Age=0"));
    }

    #[test]
    fn cookie_header_parsing() {
        assert_eq!(cookie_id("a=b; automaton_console=xyz; c=d"), Some("xyz"));
        assert_eq!(cookie_id("automaton_console="), None);
        assert_eq!(cookie_id("other=1"), None);
        assert_eq!(cookie_id(""), None);
    }

    #[test]
    fn ids_are_random_32_byte_hex() {
        let a = random_hex(32).expect("random");
        let b = random_hex(32).expect("random");
        assert_eq!(a.len(), 64);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }

    #[test]
    fn constant_time_compare() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(!constant_time_eq(b"", b"a"));
    }

    #[test]
    fn sessions_are_bounded_oldest_evicted() {
        let now = Instant::now();
        let mut s = Sessions::new(3);
        let ids: Vec<String> = (0..5)
            .map(|i| {
                s.create(format!("op{i}"), format!("t{i}"), now)
                    .expect("create")
            })
            .collect();
        assert_eq!(s.len(), 3);
        assert!(s.get(&ids[0], now).is_none());
        assert!(s.get(&ids[1], now).is_none());
        assert_eq!(s.get(&ids[4], now).map(|x| x.operator), Some("op4".into()));
        assert_eq!(s.newest_token(now), Some("t4".into()));
    }

    #[test]
    fn sessions_expire_and_sign_out() {
        let now = Instant::now();
        let mut s = Sessions::new(10);
        let id = s.create("ann".into(), "tok".into(), now).expect("create");
        assert!(s.get(&id, now + Duration::from_secs(60)).is_some());
        assert!(s.get(&id, now + SESSION_TTL).is_none());
        assert!(s.is_empty());
        let id = s.create("ann".into(), "tok".into(), now).expect("create");
        s.remove(&id);
        assert!(s.get(&id, now).is_none());
        assert_eq!(s.newest_token(now), None);
    }
}
