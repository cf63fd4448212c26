//! The live lease table and how it is rebuilt at start.
//!
//! Expiry is decided by the coordinator's monotonic clock (`Instant`), never by the wall
//! clock of whoever reads a `.state.lock`. The TTL is a minimum: a lease lives at least its
//! TTL after its last renewal, and at least the grace period after a restart.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};

use automaton_store::{Lease, Project};
use automaton_workflow::{AgentId, State, TaskName};

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
}

impl Live {
    /// The wall-clock time this lease ends unless renewed (for people and files).
    pub fn expires_at(&self, now: Instant) -> SystemTime {
        SystemTime::now() + self.deadline.saturating_duration_since(now)
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
        self.deadline = now + self.ttl;
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
        SystemTime::now() + self.ttl * 2
    }
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

    pub fn insert(&mut self, live: Live) {
        if let Some(old) = self.by_task.remove(&live.task) {
            self.by_id.remove(&old.lease_id);
        }
        self.by_id.insert(live.lease_id.clone(), live.task.clone());
        self.by_task.insert(live.task.clone(), live);
    }

    pub fn remove(&mut self, task: &TaskName) -> Option<Live> {
        let old = self.by_task.remove(task)?;
        self.by_id.remove(&old.lease_id);
        Some(old)
    }

    /// Removes and returns every lease whose deadline has passed.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Live> {
        let expired: Vec<TaskName> = self
            .by_task
            .values()
            .filter(|l| l.deadline <= now)
            .map(|l| l.task.clone())
            .collect();
        expired.iter().filter_map(|t| self.remove(t)).collect()
    }

    /// The next fencing token (the caller makes sure it is covered on disk, see `fencing.rs`).
    pub fn take_token(&mut self) -> u64 {
        let t = self.next_token;
        self.next_token += 1;
        t
    }

    pub fn records(&self) -> Vec<Record> {
        self.by_task.values().map(Live::as_record).collect()
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

/// Rebuilds the table from the log, then reconciles it with the files:
/// - a `.state.lock` with a higher token than anything the log knows for its task was
///   claimed without the coordinator (the CLI's local mode) and is adopted while live;
/// - a lease whose task has since moved to another state is dropped (a lease is for a phase);
/// - every surviving lease gets at least `grace` from now, so its holder can reconnect;
/// - the fencing mark moves past every token seen, and a fresh block is reserved.
pub(crate) fn recover(
    project: &Project,
    log: &[Record],
    grace: Duration,
) -> Result<Recovered, automaton_store::Error> {
    let mut notes = Vec::new();
    let mut files = HashSet::new();
    let mut grants: HashMap<String, Record> = HashMap::new();
    let mut max_token_by_task: HashMap<TaskName, u64> = HashMap::new();
    let mut max_token = 0;
    for r in log {
        match r {
            Record::Grant {
                lease_id,
                task,
                token,
                ..
            } => {
                max_token = max_token.max(*token);
                let m = max_token_by_task.entry(task.clone()).or_default();
                *m = (*m).max(*token);
                grants.insert(lease_id.clone(), r.clone());
            }
            Record::End { lease_id } => {
                grants.remove(lease_id);
            }
        }
    }
    // At most one lease per task: the highest token wins.
    let mut by_task: HashMap<TaskName, (AgentId, String, u64, Duration, State)> = HashMap::new();
    for r in grants.into_values() {
        if let Record::Grant {
            task,
            agent,
            lease_id,
            token,
            ttl,
            state,
        } = r
            && by_task.get(&task).is_none_or(|e| e.2 < token)
        {
            by_task.insert(task, (agent, lease_id, token, ttl, state));
        }
    }
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
            let known = max_token_by_task.get(&task).copied().unwrap_or(0);
            if l.token > known && l.expires > now_wall {
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
        let live = ttl.max(grace);
        let mut l = Live {
            task,
            agent,
            lease_id,
            token,
            state,
            ttl,
            deadline: now + live,
            claimed: now_wall,
            view_expires: now_wall,
        };
        l.view_expires = now_wall + live + ttl;
        table.insert(l);
    }
    let mark = project.fencing_mark()?.max(max_token);
    table.next_token = mark + 1;
    let fencing_mark = mark + TOKEN_BLOCK;
    project.set_fencing_mark(fencing_mark)?;
    Ok(Recovered {
        table,
        notes,
        files,
        fencing_mark,
    })
}
