//! Where a coordinator's acknowledged lease changes land: the seam between the lease engine
//! (`automaton-coordinator`) and its storage. A backend is a [`LeaseLog`] — grants and ends
//! of leases, queued under the engine's table lock and acknowledged once durable, in the
//! order they were queued — opened by a [`Backend`], which also hands back every record that
//! was durable when it opened (recovery replays them). Task files (states, approvals,
//! holders, run records) are written through `automaton_store::Project`, whose durable writes
//! a backend may replicate (`automaton_store::Replica`).
//!
//! Two implementations: [`files`] (the default: one append-only file with group commit) and
//! an etcd one (cargo feature `etcd`, which the coordinator turns on: without it nothing here
//! needs gRPC). Both pass [`conformance::check_lease_log`]. A backend owns durability and
//! ordering only: it must not interpret leases (expiry, who may hold what: the engine's, by
//! `automaton_workflow::lease`), and it must never acknowledge a record it could lose.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use automaton_workflow::{AgentId, State, TaskName};
use tokio::sync::oneshot;

pub mod conformance;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod files;

#[cfg(feature = "etcd")]
pub use etcd::EtcdBackend;
pub use files::{DELIVERY_STALL, Failpoints, FileBackend, FileLog};

/// One durable lease record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Record {
    Grant {
        task: TaskName,
        agent: AgentId,
        lease_id: String,
        token: u64,
        ttl: Duration,
        state: State,
        /// The worker session that owns the lease (it ends with the session).
        session: Option<String>,
    },
    /// Released, expired, ended by a transition, or displaced by a new grant of its task
    /// (written with that grant: [`LeaseLog::grant_displacing`]).
    End { lease_id: String },
    /// Every token up to this one may have been issued by a coordinator: written at the head
    /// of every rewrite, so a start can tell its own `.state.lock` views (never adopted: the
    /// log knows their fate) from leases the CLI took while no coordinator ran.
    Mark { token: u64 },
    /// An agent held a phase of a task whose files do not say so yet (the coordinator's
    /// `holders.rs`): written by a rewrite, for the grants it drops.
    Holder {
        task: TaskName,
        agent: AgentId,
        state: State,
    },
}

/// A grant as the engine holds it, borrowed: queued without copying its fields.
#[derive(Debug, Clone, Copy)]
pub struct Grant<'a> {
    pub task: &'a TaskName,
    pub agent: &'a AgentId,
    pub lease_id: &'a str,
    pub token: u64,
    pub ttl: Duration,
    pub state: State,
    pub session: Option<&'a str>,
}

impl Grant<'_> {
    pub fn to_record(&self) -> Record {
        Record::Grant {
            task: self.task.clone(),
            agent: self.agent.clone(),
            lease_id: self.lease_id.to_string(),
            token: self.token,
            ttl: self.ttl,
            state: self.state,
            session: self.session.map(str::to_string),
        }
    }

    /// The grant's line (see [`Record::render`]).
    pub fn render(&self, out: &mut String) {
        let _ = write!(
            out,
            "G\t{}\t{}\t{}\t{}\t{}\t{}",
            self.task,
            self.agent,
            self.lease_id,
            self.token,
            self.ttl.as_millis(),
            self.state
        );
        // A grant outside any session keeps the original seven fields.
        if let Some(s) = self.session {
            let _ = write!(out, "\t{s}");
        }
        out.push('\n');
    }
}

impl Record {
    /// A grant record as the borrowed [`Grant`] a [`LeaseLog`] takes.
    pub fn as_grant(&self) -> Option<Grant<'_>> {
        match self {
            Record::Grant {
                task,
                agent,
                lease_id,
                token,
                ttl,
                state,
                session,
            } => Some(Grant {
                task,
                agent,
                lease_id,
                token: *token,
                ttl: *ttl,
                state: *state,
                session: session.as_deref(),
            }),
            _ => None,
        }
    }

    /// The record as one tab-separated line, newline included: the form every backend
    /// stores (the file appends it; etcd keeps it as a key's value).
    pub fn render(&self, out: &mut String) {
        if let Some(g) = self.as_grant() {
            return g.render(out);
        }
        match self {
            // Rendered above, through the borrowed grant.
            Record::Grant { .. } => {}
            Record::End { lease_id } => render_end(lease_id, out),
            Record::Mark { token } => {
                let _ = writeln!(out, "M\t{token}");
            }
            Record::Holder { task, agent, state } => {
                let _ = writeln!(out, "H\t{task}\t{agent}\t{state}");
            }
        }
    }

    /// Parses one line (without its newline); `None` for anything that is not a record.
    pub fn parse(line: &str) -> Option<Record> {
        let f: Vec<&str> = line.split('\t').collect();
        match f.as_slice() {
            ["G", task, agent, lease_id, token, ttl, state, session @ ..] if session.len() <= 1 => {
                Some(Record::Grant {
                    task: task.parse().ok()?,
                    agent: agent.parse().ok()?,
                    lease_id: lease_id.to_string(),
                    token: parse_token(token)?,
                    ttl: Duration::from_millis(ttl.parse().ok()?),
                    state: state.parse().ok()?,
                    session: match session {
                        [s] if valid_session_id(s) => Some(s.to_string()),
                        [_] => return None,
                        _ => None,
                    },
                })
            }
            ["E", lease_id] => Some(Record::End {
                lease_id: lease_id.to_string(),
            }),
            ["M", token] => Some(Record::Mark {
                token: parse_token(token)?,
            }),
            ["H", task, agent, state] => Some(Record::Holder {
                task: task.parse().ok()?,
                agent: agent.parse().ok()?,
                state: state.parse().ok()?,
            }),
            _ => None,
        }
    }
}

/// Whether `s` can be a worker session's id (it is written into lease records).
pub fn valid_session_id(s: &str) -> bool {
    s.len() > 2
        && s.len() <= 64
        && s.starts_with("s-")
        && s[2..].bytes().all(|b| b.is_ascii_hexdigit())
}

/// A token from a record: at most `automaton_store::MAX_TOKEN`, like one from a lock file,
/// so the next token can always be counted (a record beyond it is not a lease record).
fn parse_token(text: &str) -> Option<u64> {
    text.parse()
        .ok()
        .filter(|t| *t <= automaton_store::MAX_TOKEN)
}

fn render_end(lease_id: &str, out: &mut String) {
    out.push_str("E\t");
    out.push_str(lease_id);
    out.push('\n');
}

/// Replays the log: the grants that no later record ended, at most one per task, and the
/// highest token any coordinator may have issued. Every end is in the log (a displacement
/// writes its end with the grant); as a second line of defence, and for logs written before
/// that, a grant also ends every earlier grant of its task, and a grant older than one already
/// seen for its task is superseded already.
pub fn replay(log: &[Record]) -> (HashMap<TaskName, Record>, u64) {
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
            Record::Holder { .. } => {}
        }
    }
    (by_task, mark)
}

/// Every (task, agent, state) the log says held a lease: its grants, ended or not, and its
/// `H` records.
pub fn holders_in(log: &[Record]) -> Vec<(TaskName, AgentId, State)> {
    let mut seen = std::collections::HashSet::new();
    log.iter()
        .filter_map(|r| match r {
            Record::Grant {
                task, agent, state, ..
            }
            | Record::Holder { task, agent, state } => Some((task.clone(), agent.clone(), *state)),
            _ => None,
        })
        .filter(|k| seen.insert(k.clone()))
        .collect()
}

/// Records queued with a backend: resolves once they are durable, or with why they are not.
pub struct Commit(oneshot::Receiver<Result<(), String>>);

impl Commit {
    /// A commit and the sender that settles it (for a backend's writer).
    pub fn channel() -> (oneshot::Sender<Result<(), String>>, Commit) {
        let (tx, rx) = oneshot::channel();
        (tx, Commit(rx))
    }

    /// Waits on this thread, which must not be a runtime's.
    pub fn wait_blocking(self) -> Result<(), String> {
        settled(self.0.blocking_recv())
    }
}

fn writer_stopped() -> String {
    "the lease log has stopped (a disk failure, or leadership lost)".to_string()
}

/// The writer's answer, or why there is none.
fn settled(answer: Result<Result<(), String>, oneshot::error::RecvError>) -> Result<(), String> {
    answer.map_err(|_| writer_stopped())?
}

impl Future for Commit {
    type Output = Result<(), String>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        Pin::new(&mut self.0).poll(cx).map(settled)
    }
}

/// A future a backend hands back (the trait is used as `Arc<dyn LeaseLog>`).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The append side of a backend: what the lease engine consumes.
///
/// Ordering is the contract the engine is built on: every call queues its records behind
/// every record queued by an earlier call (the engine queues under its table lock, so what
/// became visible first is queued first), and a [`Commit`] resolves `Ok` only once its
/// records and everything queued before them are durable. After the first failure the log
/// refuses everything, for good ([`LeaseLog::failed`] resolves): the coordinator stops
/// serving rather than acknowledge what a restart could not bring back.
pub trait LeaseLog: Send + Sync + 'static {
    /// Queues a grant (a claim, or a renewal that lengthened the lease's TTL).
    fn grant(&self, grant: Grant<'_>) -> Result<Commit, String>;

    /// Queues a grant that displaces `ended`, a lapsed lease of the same task whose end was
    /// not queued yet: the end first, then the grant, in one write (so no backend can keep
    /// the displaced lease once the grant is gone: on etcd its key would otherwise outlive
    /// the new lease's and come back, live, at the next leader's replay).
    fn grant_displacing(&self, grant: Grant<'_>, ended: &str) -> Result<Commit, String>;

    /// Queues the ends of these leases, as one write.
    fn ends(&self, lease_ids: &mut dyn Iterator<Item = &str>) -> Result<Commit, String>;

    /// Queues the end of one lease.
    fn end(&self, lease_id: &str) -> Result<Commit, String> {
        self.ends(&mut std::iter::once(lease_id))
    }

    /// Resolves once everything queued before it is durable (free when nothing is pending).
    fn barrier(&self) -> Result<Commit, String>;

    /// Queues an end nobody waits for: a grant taken back before it was acknowledged.
    fn end_nowait(&self, lease_id: &str);

    /// Resolves with the reason once the log has stopped for good.
    fn failed(&self) -> BoxFuture<'_, String>;

    /// Whether this writer may still promise anything now: checked by the engine right
    /// before every answer that promises a lease (a grant, a renewal, a release, a session's
    /// heartbeat). A backend whose writer is one of several (etcd) answers `Err` once it can
    /// no longer prove it leads; a log only one process can open always may.
    fn serving(&self) -> Result<(), String> {
        Ok(())
    }

    /// Whether the log has grown enough since its last rewrite to be worth one.
    fn wants_rewrite(&self) -> bool;

    /// Replaces the log's contents with exactly `live`, after everything queued before it.
    /// `live` must be a snapshot of the engine's table taken after every change whose record
    /// was queued before this call: records queued later may repeat a grant of the snapshot
    /// (replay keeps one) or end a lease it no longer holds (replay ignores it).
    fn rewrite(&self, live: &[Record]) -> Commit;
}

/// Opens a backend's log.
pub trait Backend: Send + Sync {
    /// The backend's name, for logs and `/metrics` (`files`, `etcd`).
    fn name(&self) -> &'static str;

    /// Every record durable now, in the order they were made durable: what recovery
    /// replays. Nothing is changed.
    fn load(&self) -> Result<Vec<Record>, String>;

    /// Starts the log holding exactly `live` (what recovery kept of [`Backend::load`]),
    /// durably, before it returns.
    fn start(&self, live: &[Record]) -> Result<Arc<dyn LeaseLog>, String>;
}
