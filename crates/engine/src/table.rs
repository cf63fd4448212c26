//! The live lease table: one entry per task at most, looked up by task and by lease id.
//!
//! Expiry is decided by the coordinator's monotonic clock (`Instant`), never by the wall
//! clock of whoever reads a `.state.lock`. The TTL is a minimum: a lease lives at least its
//! TTL after its acknowledgement and after its last renewal, and at least the grace period
//! after a restart. A grant whose record is still on its way to the log is `pending`: live
//! (nobody else gets its task) and never lapsed, whatever its deadline; its TTL starts when
//! it is durable and acknowledged ([`Table::confirm`]), not when it was decided.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use automaton_store::Lease;
use automaton_workflow::{AgentId, State, TaskName, TtlBounds};

use automaton_backend::Record;

/// A live lease as the coordinator holds it.
#[derive(Debug, Clone)]
pub struct Live {
    pub task: TaskName,
    pub agent: AgentId,
    pub lease_id: String,
    pub token: u64,
    pub state: State,
    pub ttl: Duration,
    pub deadline: Instant,
    pub claimed: SystemTime,
    /// The `expires:` last written to `.state.lock`: kept at or beyond the real expiry so a
    /// file reader never sees a live lease as expired.
    pub view_expires: SystemTime,
    /// Lapsed, its end queued for the log: it stays in the table (never live again) until
    /// that end is durable, so nobody is told it ended before a restart would agree.
    pub ending: bool,
    /// The worker session that owns the lease: it ends the moment the session dies.
    pub session: Option<Arc<str>>,
    /// Granted, its record not yet durable: live whatever the deadline (see the module).
    pub pending: bool,
}

impl Live {
    /// Whether the lease is live at `now`: pending, or before its deadline, and not ending.
    /// Once its end is queued nothing renews it, whatever instant the caller read: a
    /// renewal that read the clock before the sweep took the table's lock would otherwise
    /// see it live at that earlier instant and extend it, answered OK, while the end queued
    /// before it removes it from the log (issue 30).
    pub fn is_live(&self, now: Instant) -> bool {
        !self.ending && (self.pending || self.deadline > now)
    }

    /// The wall-clock time this lease ends unless renewed (for people and files).
    pub fn expires_at(&self, now: Instant) -> SystemTime {
        SystemTime::now() + self.deadline.saturating_duration_since(now)
    }

    /// The lease as the lease rules see it.
    pub fn holder(&self) -> automaton_workflow::lease::Holder<'_> {
        automaton_workflow::lease::Holder {
            agent: &self.agent,
            lease_id: &self.lease_id,
            token: self.token,
        }
    }

    pub(crate) fn as_record(&self) -> Record {
        self.as_grant().to_record()
    }

    /// The grant as the lease log takes it (borrowed: no copy on the claim path).
    pub(crate) fn as_grant(&self) -> automaton_backend::Grant<'_> {
        automaton_backend::Grant {
            task: &self.task,
            agent: &self.agent,
            lease_id: &self.lease_id,
            token: self.token,
            ttl: self.ttl,
            state: self.state,
            session: self.session.as_deref(),
        }
    }

    /// The `.state.lock` content for this lease.
    pub fn view(&self) -> Lease {
        Lease {
            agent: self.agent.clone(),
            phase: self.state,
            claimed: self.claimed,
            expires: self.view_expires,
            lease_id: self.lease_id.clone(),
            token: self.token,
        }
    }

    /// Extends the lease to `now + ttl`; returns whether its `.state.lock` view must be
    /// rewritten (only when the real expiry would pass the view's, see `next_view_expires`).
    pub fn extend(&mut self, now: Instant) -> bool {
        self.deadline = later(now, self.ttl);
        let rewrite = self.view_expires < self.expires_at(now);
        if rewrite {
            self.view_expires = self.next_view_expires();
        }
        rewrite
    }

    /// The lease as the store shows it, with its real expiry (for task views and the CLI).
    pub fn as_store_lease(&self, now: Instant) -> Lease {
        Lease {
            expires: self.expires_at(now),
            ..self.view()
        }
    }

    /// The view's expiry for a lease renewed now: two TTLs ahead, so that renewals every
    /// TTL/3 (the usual client rhythm) rewrite the file once per TTL, not every time.
    pub fn next_view_expires(&self) -> SystemTime {
        wall_later(SystemTime::now(), self.ttl.saturating_mul(2))
    }
}

/// `now + d`, saturating far in the future rather than panicking (TTLs are bounded at the
/// edge; this keeps anything read from disk from reaching an overflow).
pub fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d.min(TtlBounds::CEILING * 2))
        .unwrap_or(now)
}

/// The wall-clock `t + d`, saturating likewise.
pub(crate) fn wall_later(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d.min(TtlBounds::CEILING * 2)).unwrap_or(t)
}

#[derive(Debug, Default)]
pub struct Table {
    by_task: HashMap<TaskName, Live>,
    by_id: HashMap<String, TaskName>,
    /// The tasks each worker session holds leases on.
    by_session: HashMap<Arc<str>, HashSet<TaskName>>,
    pub(crate) next_token: u64,
}

impl Table {
    /// The live lease on `task`, if any.
    pub fn live(&self, task: &TaskName, now: Instant) -> Option<&Live> {
        self.by_task.get(task).filter(|l| l.is_live(now))
    }

    /// The grant `lease_id` is durable and acknowledged now: its TTL runs from `now` (never
    /// shortened). Returns the lease as acknowledged, or `None` when it is no longer in the
    /// table as a live lease (its session died meanwhile: its end is queued after it).
    pub fn confirm(&mut self, task: &TaskName, lease_id: &str, now: Instant) -> Option<Live> {
        let l = self
            .by_task
            .get_mut(task)
            .filter(|l| l.lease_id == lease_id && !l.ending)?;
        l.pending = false;
        l.deadline = l.deadline.max(later(now, l.ttl));
        // The view is kept at or beyond the real expiry, which has just moved.
        if l.view_expires < l.expires_at(now) {
            l.view_expires = l.next_view_expires();
        }
        Some(l.clone())
    }

    /// `task`'s entry, live or lapsed.
    pub fn entry(&self, task: &TaskName) -> Option<&Live> {
        self.by_task.get(task)
    }

    /// The live lease with this id, if any.
    pub fn by_id(&self, lease_id: &str, now: Instant) -> Option<&Live> {
        self.by_id
            .get(lease_id)
            .and_then(|t| self.live(t, now))
            .filter(|l| l.lease_id == lease_id)
    }

    pub fn by_id_mut(&mut self, lease_id: &str, now: Instant) -> Option<&mut Live> {
        let task = self.by_id.get(lease_id)?;
        self.by_task
            .get_mut(task)
            .filter(|l| l.is_live(now) && l.lease_id == lease_id)
    }

    /// Inserts `live`, returning the lease it displaces on its task (a lapsed one: a live
    /// lease is never displaced). The caller queues that lease's end with the grant.
    pub fn insert(&mut self, live: Live) -> Option<Live> {
        let old = self.remove(&live.task);
        self.by_id.insert(live.lease_id.clone(), live.task.clone());
        if let Some(s) = &live.session {
            self.by_session
                .entry(s.clone())
                .or_default()
                .insert(live.task.clone());
        }
        self.by_task.insert(live.task.clone(), live);
        old
    }

    pub fn remove(&mut self, task: &TaskName) -> Option<Live> {
        let old = self.by_task.remove(task)?;
        self.by_id.remove(&old.lease_id);
        if let Some(s) = &old.session
            && let Some(tasks) = self.by_session.get_mut(s)
        {
            tasks.remove(task);
            if tasks.is_empty() {
                self.by_session.remove(s);
            }
        }
        Some(old)
    }

    /// Marks every lease of `session` as ending now and returns them (the session died):
    /// never live again, removed once their ends are durable, like [`Table::mark_lapsed`].
    pub fn mark_session_ending(&mut self, session: &str, now: Instant) -> Vec<Live> {
        let Some(tasks) = self.by_session.get(session) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(tasks.len());
        for t in tasks {
            if let Some(l) = self.by_task.get_mut(t)
                && !l.ending
            {
                l.ending = true;
                l.pending = false;
                l.deadline = l.deadline.min(now);
                out.push(l.clone());
            }
        }
        out
    }

    /// The live leases of `session`.
    pub fn of_session(&self, session: &str, now: Instant) -> Vec<&Live> {
        self.by_session
            .get(session)
            .into_iter()
            .flatten()
            .filter_map(|t| self.live(t, now))
            .collect()
    }

    /// Every session that owns a lease in the table (a start recovers them).
    pub fn sessions(&self) -> impl Iterator<Item = (&Arc<str>, &AgentId)> {
        self.by_session.iter().filter_map(|(s, tasks)| {
            let t = tasks.iter().next()?;
            Some((s, &self.by_task.get(t)?.agent))
        })
    }

    /// Removes `task`'s entry if it is still the lease `lease_id`.
    pub fn remove_lease(&mut self, task: &TaskName, lease_id: &str) -> Option<Live> {
        if self.by_task.get(task)?.lease_id != lease_id {
            return None;
        }
        self.remove(task)
    }

    /// Marks every lease past its deadline as ending and returns them; they stay in the table
    /// until their end is durable (then [`Table::remove_lease`]).
    pub fn mark_lapsed(&mut self, now: Instant) -> Vec<Live> {
        self.by_task
            .values_mut()
            .filter(|l| !l.is_live(now) && !l.ending)
            .map(|l| {
                l.ending = true;
                l.clone()
            })
            .collect()
    }

    /// Whether `lease_id` names a lease in the table that is past its deadline.
    pub fn lapsed(&self, lease_id: &str, now: Instant) -> bool {
        self.by_id
            .get(lease_id)
            .and_then(|t| self.by_task.get(t))
            .is_some_and(|l| l.lease_id == lease_id && !l.is_live(now))
    }

    /// Makes sure the next token is above `token` (an adopted lease's).
    pub fn bump_past(&mut self, token: u64) {
        self.next_token = self.next_token.max(token.saturating_add(1));
    }

    /// The next fencing token (the caller makes sure it is covered on disk, see `fencing.rs`).
    pub fn take_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token = self.next_token.saturating_add(1);
        t
    }

    /// The table as log records, for a rewrite: the token mark, then every lease whose end
    /// is not already queued.
    pub fn records(&self) -> Vec<Record> {
        std::iter::once(Record::Mark {
            token: self.next_token.saturating_sub(1),
        })
        .chain(
            self.by_task
                .values()
                .filter(|l| !l.ending)
                .map(Live::as_record),
        )
        .collect()
    }

    /// The tasks that hold a live lease.
    pub fn live_tasks(&self, now: Instant) -> impl Iterator<Item = &TaskName> {
        self.by_task
            .values()
            .filter(move |l| l.is_live(now))
            .map(|l| &l.task)
    }

    pub fn len(&self) -> usize {
        self.by_task.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_task.is_empty()
    }
}
