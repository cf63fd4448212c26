//! The coordinator: its parts (lease table, log, fencing, guards, views, events) and how it
//! opens. What it does lives beside it: `lease_ops.rs` (claims, renewals, releases, expiry),
//! `task_changes.rs` (transitions, approvals, creation), `recovery.rs` (start-up and the first
//! touch of a task), `holders.rs` (who held each phase), `events.rs`, `views.rs`, `commit.rs`.

use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use automaton_store::Project;
use automaton_workflow::{Policy, State, TaskName};
use tokio::sync::broadcast;

use crate::Error;
use crate::events::Event;
use crate::fencing::Fencing;
use crate::table::{Live, Table};
use crate::watchers::Watchers;

const GUARD_SHARDS: usize = 64;
/// Store reads (get, list, validate, audit) running on the blocking pool at once.
pub(crate) const MAX_BLOCKING_READS: usize = 32;

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
    /// A worker session silent this long is dead (`sessions.rs`).
    pub session_timeout: Duration,
    /// How often workers heartbeat.
    pub heartbeat_interval: Duration,
    /// How long an agent run may take (seed 002's MAX_PHASE_TIME).
    pub max_phase_time: Duration,
    /// Failed runs of one phase before its task is held from dispatch.
    pub max_attempts: u32,
    /// The largest artifact a worker may upload.
    pub max_artifact_bytes: u64,
    /// The bytes all uploads in flight together may hold in memory (`work_service.rs`).
    pub max_upload_memory_bytes: u64,
    /// Seed 002's MAX_ITERATIONS: completed runs of one task before it is held.
    pub max_iterations: u32,
    /// Seed 002's MAX_TOTAL_TIME: from a task's first run until it is held.
    pub max_total_time: Duration,
    /// Test hooks that fail the log's disk on purpose (`AUTOMATON_FAILPOINTS`).
    pub failpoints: automaton_backend::Failpoints,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            grace: Duration::from_secs(30),
            log_compact_bytes: 16 << 20,
            ttl: automaton_workflow::TtlBounds::DEFAULT,
            keepalive_max_ids: 1024,
            session_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(2),
            max_phase_time: Duration::from_secs(3600),
            max_attempts: 3,
            max_artifact_bytes: 8 << 20,
            max_upload_memory_bytes: crate::work_service::DEFAULT_UPLOAD_MEMORY_BYTES,
            max_iterations: 10,
            max_total_time: Duration::from_secs(24 * 3600),
            failpoints: automaton_backend::Failpoints::default(),
        }
    }
}

pub struct Coordinator {
    /// This coordinator's own `Arc`: a request cut off while its change commits hands the
    /// rest of the change to a task of its own (see [`Committing`]).
    pub(crate) me: std::sync::Weak<Coordinator>,
    pub(crate) project: Project,
    pub(crate) policy: Policy,
    pub(crate) options: Options,
    pub(crate) table: Mutex<Table>,
    pub(crate) fencing: Arc<Fencing>,
    /// Where every grant and end of a lease is made durable (`automaton-backend`).
    pub(crate) log: Arc<dyn automaton_backend::LeaseLog>,
    /// Lease holders on their way to the task files (`holders.rs`).
    pub(crate) holders: crate::holders::Holders,
    /// Serialise changes of one task with claims of it, so a claim never grants a lease on a
    /// state that a transition is replacing (held across the transition's disk writes).
    /// Sharded by task name: claims of different tasks do not wait for each other.
    pub(crate) guards: Vec<Arc<tokio::sync::Mutex<()>>>,
    /// Bounds the store reads running on the blocking pool at once (see [`Coordinator::read`]).
    pub(crate) reads: Arc<tokio::sync::Semaphore>,
    pub(crate) views: std::sync::mpsc::Sender<(TaskName, Option<automaton_store::Lease>)>,
    /// Each task's state as last read or written by this coordinator, the project's only
    /// writer while it runs: a claim then needs no path lookup (slow in a large `tasks/`
    /// folder on this filesystem). Filled on first use; updated under the task's guard by
    /// every change the coordinator makes.
    pub(crate) states: Mutex<std::collections::HashMap<TaskName, State>>,
    /// Every token up to this one may have been issued by a coordinator before this start
    /// (see `leases::adoptable`).
    pub(crate) log_mark: u64,
    pub(crate) events: broadcast::Sender<Event>,
    /// Live [`Subscription`]s: whether building an event is worth it.
    pub(crate) watchers_of_events: Arc<AtomicUsize>,
    pub(crate) watchers: Watchers,
    pub(crate) seq: AtomicU64,
    /// Worker sessions (`sessions.rs`).
    pub(crate) sessions: crate::sessions::Sessions,
    /// Dispatch, runs and held tasks (`dispatch.rs`).
    pub(crate) work: crate::dispatch::Work,
    /// Counters of the lease and dispatch paths (`metrics.rs`).
    pub(crate) metrics: crate::metrics::Metrics,
    /// The memory every upload in flight may hold, together (`work_service.rs`).
    pub(crate) uploads: crate::work_service::UploadBudget,
}

impl Coordinator {
    /// Rebuilds the lease table from the log and the files, compacts the log, repairs the
    /// `.state.lock` views. Returns the coordinator and what recovery noticed.
    pub fn open(
        project: Project,
        options: Options,
    ) -> Result<(Arc<Coordinator>, Vec<String>), Error> {
        let files = automaton_backend::FileBackend {
            path: project.meta().join("leases.wal"),
            compact_bytes: options.log_compact_bytes,
            failpoints: options.failpoints,
        };
        Self::open_with(project, options, &files)
    }

    /// [`Coordinator::open`] over the lease log of `backend`.
    pub fn open_with(
        project: Project,
        options: Options,
        backend: &dyn automaton_backend::Backend,
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
        let log = backend.load().map_err(Error::Internal)?;
        let crate::recovery::Recovered {
            table,
            notes: recovered,
            log_mark,
            fencing_mark,
            holders,
        } = crate::recovery::recover(&project, &log, grace)?;
        // A task branch's ref lock left by a kill -9 mid-commit would refuse every later
        // move of that branch: nobody else writes them, and this process owns the project.
        match project.sweep_task_branch_locks() {
            Ok(swept) => notes.extend(swept.into_iter().map(|r| {
                format!("removed {r}, a task branch's lock left by a writer that was killed")
            })),
            Err(e) => notes.push(format!("cannot sweep the task branches' lock files: {e}")),
        }
        let holders = crate::holders::Holders::new(holders);
        notes.extend(recovered);
        let fencing = Fencing::new(project.clone(), fencing_mark);
        // The fresh log: the leases kept, and the holders not yet in their task's files.
        let mut records = table.records();
        records.extend(holders.records());
        let log = backend.start(&records).map_err(Error::Internal)?;
        // Views of the leases kept: written now. Every other `.state.lock` is looked at when
        // its task is first touched (see `touch`).
        let now = Instant::now();
        let mut written = std::collections::HashSet::new();
        let mut states = std::collections::HashMap::new();
        for l in table.live_tasks(now).filter_map(|t| table.live(t, now)) {
            project.write_lease_view(&l.task, Some(&l.view()))?;
            written.insert(l.task.clone());
            // Recovery read this task's state: it counts as touched.
            states.insert(l.task.clone(), l.state);
        }
        let views = crate::views::spawn_view_writer(project.clone(), written);
        let (events, _) = broadcast::channel(4096);
        let sessions =
            crate::sessions::Sessions::new(options.session_timeout, options.heartbeat_interval);
        let work = crate::dispatch::Work::new(&options);
        let uploads = crate::work_service::UploadBudget::new(options.max_upload_memory_bytes);
        let coord = Arc::new_cyclic(|me| Coordinator {
            me: me.clone(),
            project,
            policy,
            options,
            table: Mutex::new(table),
            fencing,
            log,
            holders,
            guards: (0..GUARD_SHARDS)
                .map(|_| Arc::new(tokio::sync::Mutex::new(())))
                .collect(),
            reads: Arc::new(tokio::sync::Semaphore::new(MAX_BLOCKING_READS)),
            views,
            states: Mutex::new(states),
            log_mark,
            events,
            watchers_of_events: Arc::new(AtomicUsize::new(0)),
            watchers: Watchers::default(),
            seq: AtomicU64::new(0),
            sessions,
            work,
            metrics: crate::metrics::Metrics::default(),
            uploads,
        });
        // Sessions that own live leases wait for their workers to resume them.
        coord.recover_sessions();
        Ok((coord, notes))
    }

    /// The guard of `task`'s shard.
    pub(crate) fn guard_of(&self, task: &TaskName) -> &Arc<tokio::sync::Mutex<()>> {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        task.hash(&mut h);
        &self.guards[(h.finish() % GUARD_SHARDS as u64) as usize]
    }

    pub(crate) async fn guard(&self, task: &TaskName) -> tokio::sync::MutexGuard<'_, ()> {
        self.guard_of(task).lock().await
    }

    /// Takes `task`'s guard, then runs `work` under it to completion on its own task. Waiting
    /// for the guard ends with the request (a request dropped at its deadline has changed
    /// nothing); once the guard is held, the change is carried out whole even if the request
    /// is dropped meanwhile. Otherwise a deadline could leave `.state` changed on disk but not
    /// in memory, the lease of the old phase alive, and the guard released while the disk
    /// write still runs.
    pub(crate) async fn to_completion<T, F, Fut>(
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

    pub(crate) fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the table cannot leave it half-updated in a way that matters
        // more than stopping the service would: keep serving.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every agent that held implement on `task`: its `.state.implementer`, and those the log
    /// knows that the file does not yet (see `holders.rs`).
    pub(crate) fn implementers(
        &self,
        task: &TaskName,
        in_file: &mut Vec<automaton_workflow::AgentId>,
    ) {
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

    /// Tests: the files backend's log, for its hooks.
    #[cfg(test)]
    pub(crate) fn file_log(&self) -> &automaton_backend::FileLog {
        self.log
            .as_any()
            .downcast_ref()
            .expect("tests open the files backend")
    }

    pub fn live_leases(&self) -> usize {
        self.table().len()
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

    pub(crate) fn states(&self) -> MutexGuard<'_, std::collections::HashMap<TaskName, State>> {
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
}
