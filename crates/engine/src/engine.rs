//! The engine: its parts (lease table, log, fencing, guards, views, events, counters) and
//! the small services it gives the rest. What it does lives beside it: `open.rs` (how it
//! opens), `lease_ops.rs` (claims, renewals, releases, expiry), `task_changes.rs`
//! (transitions, approvals, creation), `recovery.rs` (start-up and the first touch of a task),
//! `holders.rs` (who held each phase), `events.rs`, `views.rs`, `commit.rs`.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use automaton_store::Project;
use automaton_workflow::{EventKind, Policy, State, TaskName};

use crate::Error;
use crate::counters::Counters;
use crate::events::{Feed, Subscription};
use crate::fencing::Fencing;
use crate::holders::Holders;
use crate::hooks::Hooks;
use crate::table::{Live, Table};
use crate::views::Views;
use crate::watchers::Watchers;

pub(crate) const GUARD_SHARDS: usize = 64;
/// Store reads (get, list, validate, audit) running on the blocking pool at once.
pub const MAX_BLOCKING_READS: usize = 32;

/// What an engine is opened with.
#[derive(Debug, Clone)]
pub struct Options {
    /// After a restart every lease lives at least this long, so holders can reconnect.
    pub grace: Duration,
    /// Rewrite the lease log once this much was appended since its last rewrite.
    pub log_compact_bytes: u64,
    /// The TTLs a claim may ask for.
    pub ttl: automaton_workflow::TtlBounds,
    /// Test hooks that fail the log's disk on purpose (`AUTOMATON_FAILPOINTS`).
    pub failpoints: automaton_backend::Failpoints,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            grace: Duration::from_secs(30),
            log_compact_bytes: 16 << 20,
            ttl: automaton_workflow::TtlBounds::DEFAULT,
            failpoints: automaton_backend::Failpoints::default(),
        }
    }
}

/// One project's lease engine: opened once per start (`open.rs`), shared as `Arc<Engine>`.
pub struct Engine {
    /// This engine's own `Arc`: a request cut off while its change commits hands the rest
    /// of the change to a task of its own (`commit.rs`).
    pub(crate) me: std::sync::Weak<Engine>,
    pub(crate) project: Project,
    pub(crate) policy: Policy,
    pub(crate) options: Options,
    pub(crate) table: Mutex<Table>,
    pub(crate) fencing: Arc<Fencing>,
    /// Where every grant and end of a lease is made durable (`automaton-backend`).
    pub(crate) log: Arc<dyn automaton_backend::LeaseLog>,
    /// Lease holders on their way to the task files (`holders.rs`).
    pub(crate) holders: Holders,
    /// Serialise changes of one task with claims of it, so a claim never grants a lease on a
    /// state that a transition is replacing (held across the transition's disk writes).
    /// Sharded by task name: claims of different tasks do not wait for each other.
    pub(crate) guards: Vec<Arc<tokio::sync::Mutex<()>>>,
    /// Bounds the store reads running on the blocking pool at once (see [`Engine::read`]).
    pub(crate) reads: Arc<tokio::sync::Semaphore>,
    pub(crate) views: Views,
    /// Each task's state as last read or written by this engine, the project's only
    /// writer while it runs: a claim then needs no path lookup (slow in a large `tasks/`
    /// folder on this filesystem). Filled on first use; updated under the task's guard by
    /// every change the engine makes.
    pub(crate) states: Mutex<std::collections::HashMap<TaskName, State>>,
    /// Every token up to this one may have been issued by a coordinator before this start
    /// (see `recovery::adoptable`).
    pub(crate) log_mark: u64,
    pub(crate) feed: Feed,
    /// KeepAlive streams waiting to hear of their leases' ends.
    pub(crate) watchers: Watchers,
    /// Counters of the lease paths.
    pub(crate) counters: Counters,
    /// What dispatch and the worker sessions hear (set once, by whoever wires the engine).
    pub(crate) hooks: OnceLock<Arc<dyn Hooks>>,
}

impl Engine {
    /// The guard of `task`'s shard.
    pub(crate) fn guard_of(&self, task: &TaskName) -> &Arc<tokio::sync::Mutex<()>> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        task.hash(&mut h);
        &self.guards[(h.finish() % GUARD_SHARDS as u64) as usize]
    }

    /// `task`'s guard: changes of one task and claims of it are serialised under it.
    pub async fn guard(&self, task: &TaskName) -> tokio::sync::MutexGuard<'_, ()> {
        self.guard_of(task).lock().await
    }

    /// Takes `task`'s guard, then runs `work` under it to completion on its own task. Waiting
    /// for the guard ends with the request (a request dropped at its deadline has changed
    /// nothing); once the guard is held, the change is carried out whole even if the request
    /// is dropped meanwhile. Otherwise a deadline could leave `.state` changed on disk but not
    /// in memory, the lease of the old phase alive, and the guard released while the disk
    /// write still runs.
    pub async fn to_completion<T, F, Fut>(
        self: &Arc<Self>,
        task: &TaskName,
        work: F,
    ) -> Result<T, Error>
    where
        T: Send + 'static,
        F: FnOnce(Arc<Engine>) -> Fut,
        Fut: Future<Output = Result<T, Error>> + Send + 'static,
    {
        let guard = self.guard_of(task).clone().lock_owned().await;
        let work = work(self.clone());
        // In the caller's span: the change is part of the request's trace.
        tokio::spawn(tracing::Instrument::instrument(
            async move {
                let out = work.await;
                drop(guard);
                out
            },
            tracing::Span::current(),
        ))
        .await
        .map_err(|e| Error::Internal(format!("a task change failed: {e}")))?
    }

    /// The lease table, locked (for the session registry and dispatch, which act under its
    /// lock; lock order: the table, then the sessions). Hold it briefly: every lease path
    /// takes it.
    #[inline]
    pub fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the table cannot leave it half-updated in a way that matters
        // more than stopping the service would: keep serving.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every agent that held implement on `task`: its `.state.implementer`, and those the log
    /// knows that the file does not yet (see `holders.rs`).
    pub fn implementers(&self, task: &TaskName, in_file: &mut Vec<automaton_workflow::AgentId>) {
        for a in self.holders.pending_implementers(task) {
            if !in_file.contains(&a) {
                in_file.push(a);
            }
        }
    }

    /// Writes every lease holder the log knows and the task files do not yet (see
    /// `holders.rs`): at shutdown, so the files alone are complete for the CLI's local mode.
    pub fn flush_holders(&self) -> Result<(), Error> {
        self.holders.flush_all(&self.project)
    }

    /// Resolves with the reason once the lease log has failed (the coordinator must stop).
    pub async fn log_failed(&self) -> String {
        self.log.failed().await
    }

    pub fn live_leases(&self) -> usize {
        self.table().len()
    }

    /// The live lease on `task`.
    pub fn live_of(&self, task: &TaskName) -> Option<Live> {
        self.table().live(task, Instant::now()).cloned()
    }

    /// The live lease on `task`, as the store's type (for task views).
    pub fn lease_of(&self, task: &TaskName) -> Option<automaton_store::Lease> {
        let now = Instant::now();
        self.table().live(task, now).map(|l| l.as_store_lease(now))
    }

    pub fn states(&self) -> MutexGuard<'_, std::collections::HashMap<TaskName, State>> {
        self.states.lock().unwrap_or_else(|p| p.into_inner())
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

    /// Wires dispatch and the worker sessions in: what they hear of (see [`Hooks`]). Once;
    /// a second call is ignored.
    pub fn set_hooks(&self, hooks: Arc<dyn Hooks>) {
        let _ = self.hooks.set(hooks);
    }

    #[inline]
    pub(crate) fn hooks(&self) -> Option<&dyn Hooks> {
        self.hooks.get().map(|h| &**h)
    }

    pub fn project(&self) -> &Project {
        &self.project
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    #[inline]
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// The lease log, for the session registry (a session's leases end in one step under
    /// the table's lock, with their ends queued).
    pub fn log(&self) -> &Arc<dyn automaton_backend::LeaseLog> {
        &self.log
    }

    /// The KeepAlive streams' registry (`keepalive.rs` in the coordinator).
    #[inline]
    pub fn watchers(&self) -> &Watchers {
        &self.watchers
    }

    #[inline]
    /// The permits of [`Engine::read`] (tests take them all).
    #[doc(hidden)]
    pub fn read_permits(&self) -> &Arc<tokio::sync::Semaphore> {
        &self.reads
    }

    /// Every token up to this one may have been issued by a coordinator before this start.
    pub fn log_mark(&self) -> u64 {
        self.log_mark
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// A feed of every event, for as long as the returned subscription lives.
    pub fn subscribe_events(&self) -> Subscription {
        self.feed.subscribe()
    }

    /// Puts an event on the feed (nothing is built when nobody watches).
    pub fn emit(&self, kind: EventKind, task: &str, agent: &str, token: u64, detail: String) {
        self.feed.emit(kind, task, agent, token, detail);
    }

    /// A `transitioned` event, its states structured (`detail`: why, if anything to add).
    #[inline]
    pub fn emit_moved(
        &self,
        task: &str,
        agent: &str,
        token: u64,
        moved: (State, State),
        detail: &str,
    ) {
        self.feed.emit_moved(task, agent, token, moved, detail);
    }

    #[inline]
    pub fn emit_renewed(&self, l: &Live) {
        self.feed.emit_renewed(l);
    }

    /// Whether anyone watches the events (building an event costs allocations).
    #[inline]
    pub fn watched(&self) -> bool {
        self.feed.watched()
    }

    /// Queues `task`'s `.state.lock` view.
    pub fn view(&self, task: &TaskName, lease: Option<automaton_store::Lease>) {
        self.views.send(task, lease);
    }

    /// `l`'s view, sent under the table's lock (see `views.rs`).
    pub fn view_of(&self, l: &Live, shown: bool) {
        self.views.of(&self.table(), l, shown);
    }
}
