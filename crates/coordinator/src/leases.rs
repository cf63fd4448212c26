//! The live lease table and how it is rebuilt at start.
//!
//! Expiry is decided by the coordinator's monotonic clock (`Instant`), never by the wall
//! clock of whoever reads a `.state.lock`. The TTL is a minimum: a lease lives at least its
//! TTL after its last renewal, and at least the grace period after a restart.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};

use automaton_store::{Lease, Project};
use automaton_workflow::{AgentId, Phase, State, TaskName, TtlBounds};

use crate::wal::Record;

use crate::fencing::TOKEN_BLOCK;

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
}

impl Live {
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
        Record::Grant {
            task: self.task.clone(),
            agent: self.agent.clone(),
            lease_id: self.lease_id.clone(),
            token: self.token,
            ttl: self.ttl,
            state: self.state,
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
pub(crate) fn later(now: Instant, d: Duration) -> Instant {
    now.checked_add(d.min(TtlBounds::CEILING * 2))
        .unwrap_or(now)
}

/// The wall-clock `t + d`, saturating likewise.
pub(crate) fn wall_later(t: SystemTime, d: Duration) -> SystemTime {
    t.checked_add(d.min(TtlBounds::CEILING * 2)).unwrap_or(t)
}

#[derive(Debug, Default)]
pub(crate) struct Table {
    by_task: HashMap<TaskName, Live>,
    by_id: HashMap<String, TaskName>,
    next_token: u64,
}

impl Table {
    /// The live lease on `task`, if any.
    pub fn live(&self, task: &TaskName, now: Instant) -> Option<&Live> {
        self.by_task.get(task).filter(|l| l.deadline > now)
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
            .filter(|l| l.deadline > now && l.lease_id == lease_id)
    }

    /// Inserts `live`, returning the lease it displaces on its task (a lapsed one: a live
    /// lease is never displaced). Replay treats the new grant as that lease's end.
    pub fn insert(&mut self, live: Live) -> Option<Live> {
        let old = self.by_task.remove(&live.task);
        if let Some(old) = &old {
            self.by_id.remove(&old.lease_id);
        }
        self.by_id.insert(live.lease_id.clone(), live.task.clone());
        self.by_task.insert(live.task.clone(), live);
        old
    }

    pub fn remove(&mut self, task: &TaskName) -> Option<Live> {
        let old = self.by_task.remove(task)?;
        self.by_id.remove(&old.lease_id);
        Some(old)
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
            .filter(|l| l.deadline <= now && !l.ending)
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
            .is_some_and(|l| l.lease_id == lease_id && l.deadline <= now)
    }

    /// The next fencing token (the caller makes sure it is covered on disk, see `fencing.rs`).
    pub fn take_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
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
            .filter(move |l| l.deadline > now)
            .map(|l| &l.task)
    }

    pub fn len(&self) -> usize {
        self.by_task.len()
    }
}

/// What a start found: the table, what it noticed, and the tasks that have a `.state.lock`
/// on disk (readable or not), whose views the start must rewrite or remove.
pub(crate) struct Recovered {
    pub table: Table,
    pub notes: Vec<String>,
    pub files: HashSet<TaskName>,
    /// The fencing mark on disk: every token up to it is reserved.
    pub fencing_mark: u64,
}

/// Replays the log: the grants that no later record ended, at most one per task, and the
/// highest token any coordinator may have issued. A grant ends every earlier grant of its
/// task (a claim that displaced a lapsed lease wrote no end of its own); a grant older than
/// one already seen for its task is superseded already.
pub(crate) fn replay(log: &[Record]) -> (HashMap<TaskName, Record>, u64) {
    let mut by_task: HashMap<TaskName, Record> = HashMap::new();
    let mut by_id: HashMap<String, TaskName> = HashMap::new();
    let mut mark = 0;
    for r in log {
        match r {
            Record::Grant {
                lease_id,
                task,
                token,
                ..
            } => {
                mark = mark.max(*token);
                let superseded = match by_task.get(task) {
                    Some(Record::Grant { token: held, .. }) => held > token,
                    _ => false,
                };
                if superseded {
                    continue;
                }
                if let Some(Record::Grant { lease_id: old, .. }) =
                    by_task.insert(task.clone(), r.clone())
                {
                    by_id.remove(&old);
                }
                by_id.insert(lease_id.clone(), task.clone());
            }
            Record::End { lease_id } => {
                if let Some(task) = by_id.remove(lease_id) {
                    by_task.remove(&task);
                }
            }
            Record::Mark { token } => mark = mark.max(*token),
        }
    }
    (by_task, mark)
}

/// Rebuilds the table from the log, then reconciles it with the files:
/// - a `.state.lock` with a token above every token the log says a coordinator may have
///   issued was claimed by the CLI while no coordinator ran, and is adopted while live; any
///   other `.state.lock` is this coordinator's view, whose fate the log knows;
/// - a lease whose task has since moved to another state is dropped (a lease is for a phase);
/// - every surviving lease gets at least `grace` from now, so its holder can reconnect;
/// - the implementer of every surviving implement lease is recorded (the grant was durable
///   before its implementer was written);
/// - the fencing mark moves past every token seen, and a fresh block is reserved.
pub(crate) fn recover(
    project: &Project,
    log: &[Record],
    grace: Duration,
) -> Result<Recovered, automaton_store::Error> {
    let mut notes = Vec::new();
    let mut files = HashSet::new();
    let (grants, log_mark) = replay(log);
    let mut max_token = log_mark;
    let mut by_task: HashMap<TaskName, (AgentId, String, u64, Duration, State)> = grants
        .into_iter()
        .filter_map(|(task, r)| match r {
            Record::Grant {
                agent,
                lease_id,
                token,
                ttl,
                state,
                ..
            } => Some((task, (agent, lease_id, token, ttl, state))),
            _ => None,
        })
        .collect();
    let now_wall = SystemTime::now();
    for task in project.all_task_names()? {
        let file = match project.read_lease(&task) {
            Ok(f) => {
                if f.is_some() {
                    files.insert(task.clone());
                }
                f
            }
            Err(e) => {
                files.insert(task.clone());
                notes.push(format!(
                    "{task}: unreadable .state.lock replaced from the log ({e})"
                ));
                None
            }
        };
        if let Some(l) = file {
            max_token = max_token.max(l.token);
            if l.token > log_mark && l.expires > now_wall {
                let ttl = l.expires.duration_since(l.claimed).unwrap_or(grace);
                notes.push(format!(
                    "{task}: adopted the lease of {} (token {}) taken without the coordinator",
                    l.agent, l.token
                ));
                by_task.insert(task.clone(), (l.agent, l.lease_id, l.token, ttl, l.phase));
            }
        }
    }
    let mut table = Table::default();
    let now = Instant::now();
    for (task, (agent, lease_id, token, ttl, state)) in by_task {
        match project.read_state(&task) {
            Ok(Some(current)) if current == state => {}
            Ok(current) => {
                notes.push(format!(
                    "{task}: dropped the lease of {agent} (token {token}): it was for '{state}', the task is now '{}'",
                    current.map_or("untracked".to_string(), |s| s.to_string())
                ));
                continue;
            }
            Err(e) => {
                notes.push(format!("{task}: dropped the lease of {agent}: {e}"));
                continue;
            }
        }
        if state.phase == Phase::Implement {
            project.record_implementer(&task, &agent, state)?;
        }
        // A TTL read from disk is bounded like one from a request.
        let ttl = ttl.min(TtlBounds::CEILING);
        let live = ttl.max(grace);
        let l = Live {
            task,
            agent,
            lease_id,
            token,
            state,
            ttl,
            deadline: later(now, live),
            claimed: now_wall,
            view_expires: wall_later(now_wall, live.saturating_add(ttl)),
            ending: false,
        };
        table.insert(l);
    }
    let mark = project.fencing_mark()?.max(max_token);
    table.next_token = mark.saturating_add(1);
    let fencing_mark = mark.saturating_add(TOKEN_BLOCK);
    project.set_fencing_mark(fencing_mark)?;
    Ok(Recovered {
        table,
        notes,
        files,
        fencing_mark,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(task: &str, id: &str, token: u64) -> Record {
        Record::Grant {
            task: task.parse().expect("task"),
            agent: "a".parse().expect("agent"),
            lease_id: id.into(),
            token,
            ttl: Duration::from_secs(30),
            state: "research".parse().expect("state"),
        }
    }

    fn end(id: &str) -> Record {
        Record::End {
            lease_id: id.into(),
        }
    }

    fn survivors(log: &[Record]) -> Vec<String> {
        let mut ids: Vec<String> = replay(log)
            .0
            .into_values()
            .filter_map(|r| match r {
                Record::Grant { lease_id, .. } => Some(lease_id),
                _ => None,
            })
            .collect();
        ids.sort();
        ids
    }

    #[test]
    fn a_later_grant_ends_every_earlier_grant_of_its_task() {
        // A lapsed, B took over (no end written for A), B released: nothing is live.
        let log = [grant("t", "A", 1), grant("t", "B", 2), end("B")];
        assert!(survivors(&log).is_empty(), "A must not come back");
        // A grant replayed after a rewrite that already holds a newer one stays superseded.
        let log = [grant("t", "B", 2), grant("t", "A", 1)];
        assert_eq!(survivors(&log), ["B"]);
        // A repeat of the same grant (a longer TTL) is one lease.
        let log = [grant("t", "A", 1), grant("t", "A", 1), grant("u", "C", 3)];
        assert_eq!(survivors(&log), ["A", "C"]);
        let log = [grant("t", "A", 1), grant("t", "A", 1), end("A")];
        assert!(survivors(&log).is_empty());
    }

    #[test]
    fn the_mark_covers_every_token_the_log_has_seen() {
        let log = [Record::Mark { token: 40 }, grant("t", "A", 7), end("A")];
        assert_eq!(replay(&log).1, 40);
        let log = [grant("t", "A", 70), end("A")];
        assert_eq!(replay(&log).1, 70);
    }
}
