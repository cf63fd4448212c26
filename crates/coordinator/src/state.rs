//! The coordinator's state and every operation on it, independent of the wire format.

use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use automaton_store::{ApproveOutcome, Project, format_time};
use automaton_workflow::{AgentId, Policy, State, TaskName};
use tokio::sync::broadcast;

use crate::Error;
use crate::fencing::Fencing;
use crate::leases::{Live, Table};
use crate::wal::Wal;
use crate::watchers::{Lost, Watchers};

const GUARD_SHARDS: usize = 64;
/// Store reads (get, list, validate, audit) running on the blocking pool at once.
const MAX_BLOCKING_READS: usize = 32;

/// A task's `.state.lock` view is written once its latest change is this old: a lease
/// granted and ended within it never touches the disk at all.
const VIEW_DELAY: Duration = Duration::from_secs(1);
/// ...or once its oldest unwritten change is this old, so a task that keeps changing faster
/// than [`VIEW_DELAY`] still has its view written at this rhythm.
const VIEW_MAX_LAG: Duration = Duration::from_secs(5);

/// One entry of the operators' live feed.
#[derive(Debug, Clone)]
pub struct Event {
    pub seq: u64,
    pub at: SystemTime,
    pub kind: &'static str,
    pub task: String,
    pub agent: String,
    pub token: u64,
    pub detail: String,
}

/// A subscriber to the event feed; counted while it lives.
pub struct Subscription {
    pub rx: broadcast::Receiver<Event>,
    count: Arc<AtomicUsize>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a grant, renewal or release hands back.
#[derive(Debug, Clone)]
pub struct Granted {
    pub live: Live,
    pub renewed: bool,
}

/// How a mutating call proves it holds the lease.
#[derive(Debug, Clone, Default)]
pub struct Presented {
    pub agent: Option<AgentId>,
    pub lease_id: Option<String>,
    pub token: Option<u64>,
}

/// Why a renewal was refused: at once, or once the commit (the end of a lapsed lease, or a
/// barrier behind it) is durable.
pub(crate) enum Refused {
    Now(Error),
    OnceDurable(crate::wal::Commit, Error),
}

/// What a coordinator is opened with (from [`crate::Config`]).
#[derive(Debug, Clone)]
pub struct Options {
    /// After a restart every lease lives at least this long, so holders can reconnect.
    pub grace: Duration,
    /// Rewrite the lease log once this much was appended since its last rewrite.
    pub log_compact_bytes: u64,
    /// The TTLs a claim may ask for.
    pub ttl: automaton_workflow::TtlBounds,
    /// The most lease ids one KeepAlive message may name.
    pub keepalive_max_ids: usize,
    /// Test hooks that fail the log's disk on purpose (`AUTOMATON_FAILPOINTS`).
    pub failpoints: crate::wal::Failpoints,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            grace: Duration::from_secs(30),
            log_compact_bytes: 16 << 20,
            ttl: automaton_workflow::TtlBounds::DEFAULT,
            keepalive_max_ids: 1024,
            failpoints: crate::wal::Failpoints::default(),
        }
    }
}

pub struct Coordinator {
    /// This coordinator's own `Arc`: a request cut off while its change commits hands the
    /// rest of the change to a task of its own (see [`Committing`]).
    me: std::sync::Weak<Coordinator>,
    pub(crate) project: Project,
    policy: Policy,
    pub(crate) options: Options,
    table: Mutex<Table>,
    fencing: Arc<Fencing>,
    wal: Wal,
    /// Serialise changes of one task with claims of it, so a claim never grants a lease on a
    /// state that a transition is replacing (held across the transition's disk writes).
    /// Sharded by task name: claims of different tasks do not wait for each other.
    guards: Vec<Arc<tokio::sync::Mutex<()>>>,
    /// Bounds the store reads running on the blocking pool at once (see [`Coordinator::read`]).
    reads: Arc<tokio::sync::Semaphore>,
    views: std::sync::mpsc::Sender<(TaskName, Option<automaton_store::Lease>)>,
    /// Each task's state as last read or written by this coordinator, the project's only
    /// writer while it runs: a claim then needs no path lookup (slow in a large `tasks/`
    /// folder on this filesystem). Filled on first use; updated under the task's guard by
    /// every change the coordinator makes.
    states: Mutex<std::collections::HashMap<TaskName, State>>,
    events: broadcast::Sender<Event>,
    /// Live [`Subscription`]s: whether building an event is worth it.
    watchers_of_events: Arc<AtomicUsize>,
    pub(crate) watchers: Watchers,
    seq: AtomicU64,
}

impl Coordinator {
    /// Rebuilds the lease table from the log and the files, compacts the log, repairs the
    /// `.state.lock` views. Returns the coordinator and what recovery noticed.
    pub fn open(
        project: Project,
        options: Options,
    ) -> Result<(Arc<Coordinator>, Vec<String>), Error> {
        let mut policy = project.policy()?;
        let mut notes = Vec::new();
        let bounded = options.ttl.clamp(policy.lock_timeout);
        if bounded != policy.lock_timeout {
            notes.push(format!(
                "the project's lock timeout ({}) is outside the allowed TTLs: claims without a TTL get {}",
                humantime::format_duration(policy.lock_timeout),
                humantime::format_duration(bounded)
            ));
            policy.lock_timeout = bounded;
        }
        let grace = options.grace;
        let wal_path = project.meta().join("leases.wal");
        let log = crate::wal::read(&wal_path).map_err(Error::Internal)?;
        let crate::leases::Recovered {
            table,
            notes: recovered,
            files,
            fencing_mark,
        } = crate::leases::recover(&project, &log, grace)?;
        notes.extend(recovered);
        let fencing = Fencing::new(project.clone(), fencing_mark);
        let wal = Wal::create(
            &wal_path,
            &table.records(),
            options.log_compact_bytes,
            options.failpoints,
        )
        .map_err(|e| Error::Internal(format!("cannot write {}: {e}", wal_path.display())))?;
        // Views: every live lease written; every other lock file (stale or unreadable, as
        // recovery found them) removed.
        let now = Instant::now();
        let mut written = std::collections::HashSet::new();
        let touched: std::collections::BTreeSet<TaskName> = files
            .into_iter()
            .chain(table.live_tasks(now).cloned())
            .collect();
        for task in touched {
            let view = table.live(&task, now).map(Live::view);
            project.write_lease_view(&task, view.as_ref())?;
            if view.is_some() {
                written.insert(task);
            }
        }
        let views = spawn_view_writer(project.clone(), written);
        let (events, _) = broadcast::channel(4096);
        Ok((
            Arc::new_cyclic(|me| Coordinator {
                me: me.clone(),
                project,
                policy,
                options,
                table: Mutex::new(table),
                fencing,
                wal,
                guards: (0..GUARD_SHARDS)
                    .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                    .collect(),
                reads: Arc::new(tokio::sync::Semaphore::new(MAX_BLOCKING_READS)),
                views,
                states: Mutex::new(std::collections::HashMap::new()),
                events,
                watchers_of_events: Arc::new(AtomicUsize::new(0)),
                watchers: Watchers::default(),
                seq: AtomicU64::new(0),
            }),
            notes,
        ))
    }

    /// The guard of `task`'s shard.
    fn guard_of(&self, task: &TaskName) -> &Arc<tokio::sync::Mutex<()>> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        task.hash(&mut h);
        &self.guards[(h.finish() % GUARD_SHARDS as u64) as usize]
    }

    async fn guard(&self, task: &TaskName) -> tokio::sync::MutexGuard<'_, ()> {
        self.guard_of(task).lock().await
    }

    /// Takes `task`'s guard, then runs `work` under it to completion on its own task. Waiting
    /// for the guard ends with the request (a request dropped at its deadline has changed
    /// nothing); once the guard is held, the change is carried out whole even if the request
    /// is dropped meanwhile. Otherwise a deadline could leave `.state` changed on disk but not
    /// in memory, the lease of the old phase alive, and the guard released while the disk
    /// write still runs.
    async fn to_completion<T, F, Fut>(
        self: &Arc<Self>,
        task: &TaskName,
        work: F,
    ) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Coordinator>) -> Fut,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
    {
        let guard = self.guard_of(task).clone().lock_owned().await;
        let work = work(self.clone());
        tokio::spawn(async move {
            let out = work.await;
            drop(guard);
            out
        })
        .await
        .map_err(|e| Error::Internal(format!("a task change failed: {e}")))?
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the table cannot leave it half-updated in a way that matters
        // more than stopping the service would: keep serving.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves with the reason once the lease log has failed (the coordinator must stop).
    pub async fn log_failed(&self) -> String {
        self.wal.failed().await
    }

    pub fn live_leases(&self) -> usize {
        self.table().len()
    }

    /// A feed of every event, for as long as the returned subscription lives.
    pub fn subscribe_events(&self) -> Subscription {
        self.watchers_of_events.fetch_add(1, Ordering::Relaxed);
        Subscription {
            rx: self.events.subscribe(),
            count: self.watchers_of_events.clone(),
        }
    }

    pub(crate) fn emit(
        &self,
        kind: &'static str,
        task: &str,
        agent: &str,
        token: u64,
        detail: String,
    ) {
        if !self.watched() {
            return;
        }
        tracing::debug!(kind, task, agent, token, detail = %detail, "event");
        let _ = self.events.send(Event {
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            at: SystemTime::now(),
            kind,
            task: task.to_string(),
            agent: agent.to_string(),
            token,
            detail,
        });
    }

    fn view(&self, task: &TaskName, lease: Option<automaton_store::Lease>) {
        let _ = self.views.send((task.clone(), lease));
    }

    pub(crate) fn emit_renewed(&self, l: &Live) {
        if self.watched() {
            self.emit(
                "lease_renewed",
                &l.task.to_string(),
                l.agent.as_str(),
                l.token,
                String::new(),
            );
        }
    }

    /// The live lease on `task`.
    pub(crate) fn live_of(&self, task: &TaskName) -> Option<Live> {
        self.table().live(task, Instant::now()).cloned()
    }

    /// The live lease on `task`, as the store's type (for task views).
    pub fn lease_of(&self, task: &TaskName) -> Option<automaton_store::Lease> {
        let now = Instant::now();
        self.table().live(task, now).map(|l| l.as_store_lease(now))
    }

    /// Grants `task` to `agent` (or renews it for its holder). Acknowledged only once the
    /// grant is in the log on disk.
    pub async fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> Result<Granted, Error> {
        let result = self.claim_inner(task, agent, ttl).await;
        if let Err(e) = &result
            && self.watched()
        {
            self.emit(
                "lease_refused",
                &task.to_string(),
                agent.as_str(),
                0,
                e.to_string(),
            );
        }
        result
    }

    async fn claim_inner(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> Result<Granted, Error> {
        let ttl =
            match ttl {
                Some(t) => self.options.ttl.check(t).map_err(|r| {
                    automaton_store::Error::from_refusal(task, r, SystemTime::now())
                })?,
                None => self.policy.lock_timeout,
            };
        let guard = self.guard(task).await;
        let state = self.state_of(task)?;
        self.project
            .claimable_in(task, state, agent, &self.policy)?;
        let now = Instant::now();
        // Decide under the table lock; anything that awaits happens after it is released.
        let renewal = {
            let mut table = self.table();
            match table.live(task, now) {
                Some(l) if &l.agent != agent => {
                    return Err(Error::Store(automaton_store::Error::Leased {
                        task: task.clone(),
                        holder: l.agent.clone(),
                        expires: l.expires_at(now),
                        token: l.token,
                    }));
                }
                Some(l) => {
                    let id = l.lease_id.clone();
                    let Some(l) = table.by_id_mut(&id, now) else {
                        return Err(Error::Internal(
                            "the lease table changed under its lock".into(),
                        ));
                    };
                    let longer = ttl > l.ttl;
                    l.ttl = ttl;
                    let rewrite = l.extend(now);
                    Some((l.clone(), longer, rewrite))
                }
                None => None,
            }
        };
        if let Some((l, longer, rewrite)) = renewal {
            drop(guard);
            // Nothing is acknowledged before it is durable: the grant this claim repeats may
            // still be on its way to the log (its own claim cut off, say). A restart gives
            // every lease max(logged TTL, grace), so a longer TTL is logged before it is
            // promised; otherwise a barrier waits for what is queued.
            let logged = if longer {
                self.wal.grant(&l)
            } else {
                self.wal.barrier()
            };
            logged
                .map_err(Error::Unavailable)?
                .await
                .map_err(Error::Unavailable)?;
            if rewrite {
                self.view(task, Some(l.view()));
            }
            self.emit_renewed(&l);
            return Ok(Granted {
                live: l,
                renewed: true,
            });
        }
        let (live, displaced) = {
            let mut table = self.table();
            let token = table.take_token();
            self.fencing.cover(token)?;
            let claimed = SystemTime::now();
            let mut live = Live {
                task: task.clone(),
                agent: agent.clone(),
                lease_id: automaton_store::new_lease_id(task, agent, token, claimed),
                token,
                state,
                ttl,
                deadline: crate::leases::later(now, ttl),
                claimed,
                view_expires: claimed,
                ending: false,
            };
            live.view_expires = live.next_view_expires();
            // A lease displaced here had lapsed; the grant's record is its end at replay.
            let displaced = table.insert(live.clone()).filter(|d| !d.ending);
            (live, displaced)
        };
        drop(guard);
        let commit = match self.wal.grant(&live) {
            Ok(commit) => commit,
            Err(e) => {
                self.unclaim(&live);
                return Err(Error::Unavailable(e));
            }
        };
        let (live, logged) = Committing::new(
            self,
            commit,
            (live, displaced),
            |c, (live, displaced), logged| match logged {
                Ok(()) => {
                    if let Some(d) = displaced {
                        c.after_end(d, "expired");
                    }
                    c.after_grant(live)
                }
                Err(_) => c.unclaim(live),
            },
        )
        .finish()
        .await;
        logged.map_err(Error::Unavailable)?;
        let (live, _) = live;
        // The implementer is recorded once the grant is durable, before it is acknowledged:
        // a grant taken back leaves no trace, and a crash in between is repaired at start
        // (every surviving implement grant's agent is recorded then).
        if let Err(e) = self.record_implementer(&live) {
            self.unclaim(&live);
            return Err(e);
        }
        Ok(Granted {
            live,
            renewed: false,
        })
    }

    /// Records the agent of an implement grant in `.state.implementer`, once per task and
    /// agent (the file is read only the first time).
    fn record_implementer(&self, live: &Live) -> Result<(), Error> {
        if live.state.phase != automaton_workflow::Phase::Implement {
            return Ok(());
        }
        self.project
            .record_implementer(&live.task, &live.agent, live.state)?;
        Ok(())
    }

    fn after_grant(&self, live: &Live) {
        self.view(&live.task, Some(live.view()));
        if self.watched() {
            self.emit(
                "lease_granted",
                &live.task.to_string(),
                live.agent.as_str(),
                live.token,
                format!("{}", live.state),
            );
        }
    }

    /// Takes back a grant that was never acknowledged. Its end goes to the log too: a log
    /// rewrite may have put the grant into its snapshot meanwhile.
    fn unclaim(&self, live: &Live) {
        self.table().remove_lease(&live.task, &live.lease_id);
        self.wal.append_end_nowait(&live.lease_id);
    }

    /// A task's state: from memory, or read once from `.state` (call under the task's guard).
    fn state_of(&self, task: &TaskName) -> Result<State, Error> {
        if let Some(s) = self.states().get(task) {
            return Ok(*s);
        }
        let s = self.project.tracked_state(task)?;
        self.states().insert(task.clone(), s);
        Ok(s)
    }

    fn states(&self) -> MutexGuard<'_, std::collections::HashMap<TaskName, State>> {
        self.states.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Extends a live lease to now + its TTL. No disk sync: the log records TTLs, not
    /// expiries, and a restart gives every lease at least max(TTL, grace) again. `who`: the
    /// agent a caller with an agent token speaks for (it may renew only its own leases).
    pub async fn renew(
        &self,
        lease_id: &str,
        token: Option<u64>,
        who: Option<&AgentId>,
    ) -> Result<Live, Error> {
        match self.renew_with(lease_id, token, who, Live::clone) {
            Ok(l) => Ok(l),
            Err(Refused::Now(e)) => Err(e),
            Err(Refused::OnceDurable(commit, e)) => {
                commit.await.map_err(Error::Unavailable)?;
                Err(e)
            }
        }
    }

    /// Renews and builds the answer from the lease in place (no copy): the KeepAlive stream
    /// is the hottest path of the service. A lease found lapsed is refused only once its end
    /// is durable (etcd's lessor waits for the revoke likewise): the caller awaits the commit
    /// in [`Refused::OnceDurable`] before answering, so no restart can bring back a lease
    /// somebody was told had ended.
    pub(crate) fn renew_with<R>(
        &self,
        lease_id: &str,
        token: Option<u64>,
        who: Option<&AgentId>,
        answer: impl FnOnce(&Live) -> R,
    ) -> Result<R, Refused> {
        let now = Instant::now();
        let mut table = self.table();
        let Some(l) = table.by_id_mut(lease_id, now) else {
            let lapsed = table.lapsed(lease_id, now);
            drop(table);
            let not_found = Error::LeaseNotFound(automaton_workflow::excerpt(lease_id));
            if !lapsed {
                return Err(Refused::Now(not_found));
            }
            // Queue the ends of whatever has lapsed (the sweep may not have run yet), then
            // wait for everything queued so far.
            self.expire();
            return match self.wal.barrier() {
                Ok(commit) => Err(Refused::OnceDurable(commit, not_found)),
                Err(e) => Err(Refused::Now(Error::Unavailable(e))),
            };
        };
        if let Some(who) = who
            && who != &l.agent
        {
            return Err(Refused::Now(Error::PermissionDenied(format!(
                "lease '{}' is not held by '{who}': an agent renews only its own leases",
                automaton_workflow::excerpt(lease_id)
            ))));
        }
        if let Some(t) = token
            && t != l.token
        {
            return Err(Refused::Now(Error::Store(
                automaton_store::Error::StaleToken {
                    task: l.task.clone(),
                    given: t,
                    current: Some(l.token),
                },
            )));
        }
        let rewrite = l.extend(now);
        let out = answer(l);
        let view = rewrite.then(|| (l.task.clone(), l.view()));
        drop(table);
        if let Some((task, v)) = view {
            self.view(&task, Some(v));
        }
        Ok(out)
    }

    /// Whether anyone watches the events (building an event costs allocations).
    pub(crate) fn watched(&self) -> bool {
        // Not `events.receiver_count()`: that takes the channel's lock, on every request.
        self.watchers_of_events.load(Ordering::Relaxed) > 0
    }

    /// Ends a lease at its holder's request; acknowledged once the end is in the log. `who`:
    /// the agent a caller speaks for (an agent token's name, or the request's agent).
    pub async fn release(
        &self,
        lease_id: &str,
        token: Option<u64>,
        who: Option<&AgentId>,
    ) -> Result<Live, Error> {
        let now = Instant::now();
        let found = {
            let mut table = self.table();
            match table.by_id(lease_id, now) {
                None => Err(table.lapsed(lease_id, now)),
                Some(l) => {
                    let presented = automaton_workflow::lease::Presented {
                        agent: who,
                        lease_id: Some(lease_id),
                        token,
                    };
                    automaton_workflow::lease::check_release(l.holder(), &presented).map_err(
                        |r| automaton_store::Error::from_refusal(&l.task, r, l.expires_at(now)),
                    )?;
                    let task = l.task.clone();
                    Ok(table.remove(&task))
                }
            }
        };
        let l = match found {
            Ok(Some(l)) => l,
            Ok(None) => {
                return Err(Error::Internal(
                    "the lease table changed under its lock".into(),
                ));
            }
            Err(lapsed) => {
                if lapsed {
                    // Refused only once its end is durable (see `renew_with`).
                    self.expire();
                    self.wal
                        .barrier()
                        .map_err(Error::Unavailable)?
                        .await
                        .map_err(Error::Unavailable)?;
                }
                return Err(Error::LeaseNotFound(automaton_workflow::excerpt(lease_id)));
            }
        };
        self.end(l, "released").await
    }

    /// Logs the end of a removed lease durably, then updates the view and tells the world. If
    /// the log cannot take it, the lease goes back into the table (the coordinator is
    /// stopping: nothing may look ended that a restart would bring back).
    async fn end(&self, l: Live, reason: &'static str) -> Result<Live, Error> {
        let commit = match self.wal.end(&l.lease_id) {
            Ok(c) => c,
            Err(e) => {
                self.restore(&l);
                return Err(Error::Unavailable(e));
            }
        };
        let ((l, _), logged) =
            Committing::new(self, commit, (l, reason), |c, (l, reason), logged| {
                if logged.is_ok() {
                    c.after_end(l, reason);
                } else {
                    c.restore(l);
                }
            })
            .finish()
            .await;
        logged.map_err(Error::Unavailable)?;
        Ok(l)
    }

    /// Puts back a lease whose end never reached the log, unless its task moved on.
    fn restore(&self, l: &Live) {
        let mut table = self.table();
        if table.entry(&l.task).is_none() {
            table.insert(l.clone());
        }
    }

    fn after_end(&self, l: &Live, reason: &'static str) {
        self.view(&l.task, None);
        // Without a KeepAlive stream, building the notice is wasted work.
        if self.watchers.any() {
            self.watchers.lost(&Lost {
                lease_id: l.lease_id.clone(),
                task: l.task.clone(),
                token: l.token,
                reason,
            });
        }
        if self.watched() {
            let kind = if reason == "expired" {
                "lease_expired"
            } else {
                "lease_released"
            };
            self.emit(
                kind,
                &l.task.to_string(),
                l.agent.as_str(),
                l.token,
                reason.to_string(),
            );
        }
    }

    /// Rewrites the lease log with only the live leases if it has grown enough (see
    /// `Wal::wants_rewrite`); the rewrite happens on the log's thread.
    pub fn compact_log(&self) -> bool {
        if !self.wal.wants_rewrite() {
            return false;
        }
        // Snapshot and queue under the table's lock: no change can fall between the two, so
        // every record queued before the rewrite is reflected in the snapshot.
        let table = self.table();
        drop(self.wal.rewrite(&table.records()));
        true
    }

    /// Ends every lease past its deadline: their ends go to the log, and only once that is
    /// durable are they removed and announced (views, loss notices, events). Until then they
    /// stay in the table, lapsed: never live, never renewed, superseded by a new grant.
    pub fn expire(&self) -> usize {
        let lapsed = self.table().mark_lapsed(Instant::now());
        if lapsed.is_empty() {
            return 0;
        }
        let n = lapsed.len();
        let commit = match self.wal.ends(lapsed.iter().map(|l| l.lease_id.as_str())) {
            Ok(c) => c,
            // The writer has stopped: the coordinator is stopping, and a restart replays
            // these leases (they get the grace, as if the crash came first).
            Err(_) => return 0,
        };
        let Some(me) = self.me.upgrade() else {
            return 0;
        };
        let finish = move |me: &Coordinator, logged: Result<(), String>| {
            if logged.is_err() {
                return;
            }
            for l in &lapsed {
                me.table().remove_lease(&l.task, &l.lease_id);
                me.after_end(l, "expired");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    let logged = commit.await;
                    finish(&me, logged);
                });
            }
            // Off any runtime, this thread may wait.
            Err(_) => finish(&me, commit.wait_blocking()),
        }
        n
    }

    /// Checks a mutating call against the task's live lease (the rules are
    /// `automaton_workflow::lease::check_change`, shared with the CLI's local mode).
    fn check_presented(&self, task: &TaskName, p: &Presented) -> Result<Option<Live>, Error> {
        let now = Instant::now();
        let table = self.table();
        let live = table.live(task, now);
        let presented = automaton_workflow::lease::Presented {
            agent: p.agent.as_ref(),
            lease_id: p.lease_id.as_deref(),
            token: p.token,
        };
        automaton_workflow::lease::check_change(live.map(Live::holder), &presented).map_err(
            |r| {
                automaton_store::Error::from_refusal(
                    task,
                    r,
                    live.map_or_else(SystemTime::now, |l| l.expires_at(now)),
                )
            },
        )?;
        Ok(live.cloned())
    }

    /// Moves `task` to `target`; the lease (if any) ends with the phase it was granted for.
    pub async fn transition(
        self: &Arc<Self>,
        task: &TaskName,
        target: State,
        p: &Presented,
    ) -> Result<(State, Option<Live>), Error> {
        let (t, p) = (task.clone(), p.clone());
        self.to_completion(task, move |c| async move {
            c.transition_guarded(&t, target, &p).await
        })
        .await
    }

    /// [`Coordinator::transition`] under the task's guard.
    async fn transition_guarded(
        &self,
        task: &TaskName,
        target: State,
        p: &Presented,
    ) -> Result<(State, Option<Live>), Error> {
        let live = self.check_presented(task, p)?;
        let project = self.project.clone();
        let t = task.clone();
        let from = tokio::task::spawn_blocking(move || project.transition_owned(&t, target))
            .await
            .map_err(|e| Error::Internal(format!("transition task failed: {e}")))??;
        self.states().insert(task.clone(), target);
        let ended = match live {
            Some(l) => {
                let removed = self.table().remove(task);
                match removed {
                    Some(r) => Some(self.end(r, "transitioned").await?),
                    None => Some(l),
                }
            }
            None => None,
        };
        self.emit(
            "transitioned",
            &task.to_string(),
            p.agent.as_ref().map_or("", |a| a.as_str()),
            0,
            format!("{from} → {target}"),
        );
        Ok((from, ended))
    }

    /// Approves for `approver`; the live lease holder is never its own approver.
    pub async fn approve(
        self: &Arc<Self>,
        task: &TaskName,
        approver: &str,
    ) -> Result<ApproveOutcome, Error> {
        let (t, a) = (task.clone(), approver.to_string());
        self.to_completion(
            task,
            move |c| async move { c.approve_guarded(&t, &a).await },
        )
        .await
    }

    /// [`Coordinator::approve`] under the task's guard.
    async fn approve_guarded(
        &self,
        task: &TaskName,
        approver: &str,
    ) -> Result<ApproveOutcome, Error> {
        let holder = self.lease_of(task).map(|l| l.agent);
        let project = self.project.clone();
        let (t, a) = (task.clone(), approver.to_string());
        let out = tokio::task::spawn_blocking(move || {
            project.approve_as(&t, &a, holder.as_ref(), SystemTime::now())
        })
        .await
        .map_err(|e| Error::Internal(format!("approve task failed: {e}")))??;
        self.states().insert(task.clone(), out.to);
        self.emit(
            "approved",
            &task.to_string(),
            approver,
            0,
            format!("{} → {}", out.from, out.to),
        );
        Ok(out)
    }

    pub async fn create_task(self: &Arc<Self>, task: &TaskName) -> Result<(), Error> {
        let t = task.clone();
        self.to_completion(
            task,
            move |c| async move { c.create_task_guarded(&t).await },
        )
        .await
    }

    /// [`Coordinator::create_task`] under the task's guard.
    async fn create_task_guarded(&self, task: &TaskName) -> Result<(), Error> {
        let project = self.project.clone();
        let t = task.clone();
        tokio::task::spawn_blocking(move || project.create_task(&t))
            .await
            .map_err(|e| Error::Internal(format!("create task failed: {e}")))??;
        self.states()
            .insert(task.clone(), State::open(automaton_workflow::Phase::New));
        self.emit("task_created", &task.to_string(), "", 0, "new".into());
        Ok(())
    }

    /// Runs a read-only store query off the async threads. At most [`MAX_BLOCKING_READS`] run
    /// at once: a read cannot be stopped once it runs on the blocking pool, so without a bound
    /// callers that time out and retry could pile up work there; a request that times out
    /// while waiting for its turn never starts.
    pub async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Project) -> Result<T, automaton_store::Error> + Send + 'static,
    ) -> Result<T, Error> {
        let project = self.project.clone();
        let permit = self
            .reads
            .clone()
            .acquire_owned()
            .await
            .map_err(|e| Error::Internal(format!("read limit closed: {e}")))?;
        tokio::task::spawn_blocking(move || {
            let out = f(&project);
            drop(permit);
            out
        })
        .await
        .map_err(|e| Error::Internal(format!("read task failed: {e}")))?
        .map_err(Error::from)
    }
}

/// A change's log record on its way to disk, awaited by the request that made the change.
/// What follows the commit (`then`: the view, the event, the loss notices, or taking back a
/// grant whose record failed) must not depend on whether that request is still there: cut
/// off by its deadline while the log commits, it hands the wait and `then` to a task of
/// their own. No hop on the common path.
struct Committing<'a, T: Send + 'static> {
    coord: &'a Coordinator,
    pending: Option<(crate::wal::Commit, T)>,
    then: fn(&Coordinator, &T, &Result<(), String>),
}

impl<'a, T: Send + 'static> Committing<'a, T> {
    fn new(
        coord: &'a Coordinator,
        commit: crate::wal::Commit,
        item: T,
        then: fn(&Coordinator, &T, &Result<(), String>),
    ) -> Self {
        Committing {
            coord,
            pending: Some((commit, item)),
            then,
        }
    }

    /// Waits for the commit, runs `then`, and gives `item` back with the outcome.
    async fn finish(mut self) -> (T, Result<(), String>) {
        let (commit, _) = self.pending.as_mut().expect("pending until finished");
        let logged = commit.await;
        let (_, item) = self.pending.take().expect("pending until finished");
        (self.then)(self.coord, &item, &logged);
        (item, logged)
    }
}

impl<T: Send + 'static> Drop for Committing<'_, T> {
    fn drop(&mut self) {
        let Some((commit, item)) = self.pending.take() else {
            return;
        };
        let then = self.then;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                if let Some(coord) = self.coord.me.upgrade() {
                    runtime.spawn(async move {
                        let logged = commit.await;
                        then(&coord, &item, &logged);
                    });
                }
            }
            // Off any runtime, this thread may wait.
            Err(_) => then(self.coord, &item, &commit.wait_blocking()),
        }
    }
}

/// Writes `.state.lock` views off the request path, at low priority. A task's view is written
/// once its latest change is [`VIEW_DELAY`] old (or its oldest unwritten one [`VIEW_MAX_LAG`]
/// old), with only the latest view of that task; removing a view that was never written is
/// skipped. So a lease that lives less than `VIEW_DELAY` never touches the disk,
/// and the file work (path lookups in a large `tasks/` folder are slow on this filesystem)
/// does not compete with requests for the CPU. The thread sleeps between passes rather than
/// waiting on the channel, so senders never have to wake it.
fn spawn_view_writer(
    project: Project,
    written_at_start: std::collections::HashSet<TaskName>,
) -> std::sync::mpsc::Sender<(TaskName, Option<automaton_store::Lease>)> {
    let (tx, rx) = std::sync::mpsc::channel::<(TaskName, Option<automaton_store::Lease>)>();
    let _ = std::thread::Builder::new()
        .name("lease-views".into())
        .spawn(move || {
            // The views are a cache for file readers: under load they wait for spare CPU
            // (and coalesce further) rather than compete with requests. On Linux the
            // priority of "this process" set from a thread is that thread's alone.
            #[cfg(unix)]
            if let Err(e) = rustix::process::setpriority_process(None, 19) {
                tracing::debug!(error = %e, "cannot lower the lease-view thread's priority");
            }
            // Per task: its latest view, when its oldest unwritten change came, and when
            // its latest one did.
            let mut pending: std::collections::HashMap<
                TaskName,
                (Option<automaton_store::Lease>, Instant, Instant),
            > = std::collections::HashMap::new();
            // Views on disk: those the repair at start wrote, then what this thread writes.
            let mut on_disk = written_at_start;
            let tick = VIEW_DELAY / 10;
            loop {
                loop {
                    match rx.try_recv() {
                        Ok((task, lease)) => {
                            let now = Instant::now();
                            match pending.entry(task) {
                                Entry::Occupied(mut e) => {
                                    let e = e.get_mut();
                                    e.0 = lease;
                                    e.2 = now;
                                }
                                Entry::Vacant(e) => {
                                    e.insert((lease, now, now));
                                }
                            }
                        }
                        Err(std::sync::mpsc::TryRecvError::Empty) => break,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                    }
                }
                let due: Vec<TaskName> = pending
                    .iter()
                    .filter(|(_, (_, first, last))| {
                        last.elapsed() >= VIEW_DELAY || first.elapsed() >= VIEW_MAX_LAG
                    })
                    .map(|(t, _)| t.clone())
                    .collect();
                for task in due {
                    let Some((lease, _, _)) = pending.remove(&task) else {
                        continue;
                    };
                    if lease.is_none() && !on_disk.contains(&task) {
                        continue;
                    }
                    match project.write_lease_view(&task, lease.as_ref()) {
                        Ok(()) if lease.is_some() => {
                            on_disk.insert(task);
                        }
                        Ok(()) => {
                            on_disk.remove(&task);
                        }
                        Err(e) => {
                            tracing::warn!(task = %task, error = %e, "cannot write the lease view")
                        }
                    }
                }
                std::thread::sleep(tick);
            }
        });
    tx
}

/// RFC 3339 with milliseconds, for events.
pub fn format_millis(t: SystemTime) -> String {
    let secs = format_time(t);
    let ms = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_millis())
        .unwrap_or(0);
    format!("{}.{ms:03}Z", secs.trim_end_matches('Z'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name<T: std::str::FromStr>(s: &str) -> T
    where
        T::Err: std::fmt::Debug,
    {
        s.parse().expect("a valid name")
    }

    /// A coordinator over a fresh project with one task in `research`.
    async fn coordinator(dir: &std::path::Path) -> Arc<Coordinator> {
        let project = Project::open(dir, None);
        let options = Options {
            grace: Duration::from_secs(1),
            log_compact_bytes: 1 << 20,
            ttl: automaton_workflow::TtlBounds {
                min: Duration::from_millis(10),
                max: Duration::from_secs(3600),
            },
            ..Options::default()
        };
        let (coord, _) = Coordinator::open(project, options).expect("open");
        let task: TaskName = name("t");
        coord.create_task(&task).await.expect("create");
        let p = Presented::default();
        coord
            .transition(&task, name("research"), &p)
            .await
            .expect("to research");
        coord
    }

    /// Polls `coord`'s change `f` once, with the log held so it cannot commit yet, and drops
    /// it: a request cut off by its deadline while its change commits.
    fn cut_off<T: std::fmt::Debug, F: Future<Output = T>>(coord: &Coordinator, f: F) {
        let held = coord.wal.hold_commits();
        {
            let mut f = std::pin::pin!(f);
            let once = f
                .as_mut()
                .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
            assert!(once.is_pending(), "the call finished in one poll: {once:?}");
        } // `f` dropped here, the log still held.
        drop(held);
    }

    async fn next_event(events: &mut Subscription) -> Event {
        tokio::time::timeout(Duration::from_secs(5), events.rx.recv())
            .await
            .expect("an event within 5 s")
            .expect("the event feed is open")
    }

    #[tokio::test]
    async fn a_claim_dropped_while_the_log_commits_still_gets_its_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path()).await;
        let mut events = coord.subscribe_events();
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        cut_off(&coord, coord.claim(&task, &agent, None));
        let e = next_event(&mut events).await;
        assert_eq!((e.kind, e.task.as_str()), ("lease_granted", "t"));
        assert_eq!(coord.live_leases(), 1, "the grant stands");
        // The same agent claiming again gets that lease back.
        let again = coord.claim(&task, &agent, None).await.expect("re-claim");
        assert!(again.renewed);
    }

    #[tokio::test]
    async fn a_claim_dropped_while_its_log_write_fails_is_taken_back_and_the_log_stops() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path()).await;
        let mut events = coord.subscribe_events();
        let task: TaskName = name("t");
        coord.wal.fail_next_commit();
        cut_off(&coord, coord.claim(&task, &name("a"), None));
        let deadline = Instant::now() + Duration::from_secs(5);
        while coord.live_leases() != 0 {
            assert!(
                Instant::now() < deadline,
                "a grant that never reached the log still holds the task"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            events.rx.try_recv().is_err(),
            "nothing was granted, so nothing may be announced"
        );
        // Fail-stop: after a failed sync the log takes nothing more, and says why.
        let why = tokio::time::timeout(Duration::from_secs(5), coord.log_failed())
            .await
            .expect("the failure is reported");
        assert!(why.contains("fdatasync"), "{why}");
        let refused = coord
            .claim(&task, &name("b"), None)
            .await
            .expect_err("no grant after the log failed");
        assert!(matches!(refused, Error::Unavailable(_)), "{refused:?}");
    }

    #[tokio::test]
    async fn a_lapsed_lease_is_refused_and_announced_only_once_its_end_is_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path()).await;
        let mut events = coord.subscribe_events();
        let task: TaskName = name("t");
        let g = coord
            .claim(&task, &name("a"), Some(Duration::from_millis(10)))
            .await
            .expect("claim");
        let _ = next_event(&mut events).await; // granted
        tokio::time::sleep(Duration::from_millis(30)).await;
        let held = coord.wal.hold_commits();
        let renewal = coord.renew(&g.live.lease_id, None, None);
        let mut renewal = std::pin::pin!(renewal);
        let once = renewal
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        assert!(
            once.is_pending(),
            "a lapsed lease must not be refused before its end is on disk: {once:?}"
        );
        assert!(
            events.rx.try_recv().is_err(),
            "nor announced: a restart now would bring it back"
        );
        drop(held);
        let e = renewal.await.expect_err("lapsed");
        assert!(matches!(e, Error::LeaseNotFound(_)), "{e:?}");
        let e = next_event(&mut events).await;
        assert_eq!((e.kind, e.task.as_str()), ("lease_expired", "t"));
        let log = crate::wal::read(&dir.path().join(".automaton/leases.wal")).expect("log");
        assert!(
            log.contains(&crate::wal::Record::End {
                lease_id: g.live.lease_id.clone()
            }),
            "the end is in the log: {log:?}"
        );
    }

    #[tokio::test]
    async fn a_repeat_claim_is_acknowledged_only_once_the_grant_is_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path()).await;
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        // The first claim is cut off while its grant commits; the repeat must wait for it.
        let held = coord.wal.hold_commits();
        {
            let first = coord.claim(&task, &agent, None);
            let mut first = std::pin::pin!(first);
            assert!(
                first
                    .as_mut()
                    .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
                    .is_pending()
            );
        }
        let again = coord.claim(&task, &agent, None);
        let mut again = std::pin::pin!(again);
        let once = again
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        assert!(
            once.is_pending(),
            "a repeat claim acknowledged before the grant is durable: {once:?}"
        );
        drop(held);
        assert!(again.await.expect("repeat claim").renewed);
    }

    #[tokio::test]
    async fn a_ttl_outside_the_bounds_is_invalid_and_names_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path()).await;
        for ms in [u64::MAX, 1 << 53, 1] {
            let e = coord
                .claim(&name("t"), &name("a"), Some(Duration::from_millis(ms)))
                .await
                .expect_err("out of bounds");
            let status = tonic::Status::from(e);
            assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
            assert!(status.message().contains("10ms"), "{}", status.message());
        }
        assert_eq!(coord.live_leases(), 0);
    }

    #[tokio::test]
    async fn a_release_dropped_while_the_log_commits_still_gets_its_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path()).await;
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        let granted = coord.claim(&task, &agent, None).await.expect("claim");
        let mut events = coord.subscribe_events();
        cut_off(
            &coord,
            coord.release(&granted.live.lease_id, Some(granted.live.token), None),
        );
        let e = next_event(&mut events).await;
        assert_eq!((e.kind, e.task.as_str()), ("lease_released", "t"));
        assert_eq!(coord.live_leases(), 0);
    }
}
