//! The coordinator: the lease engine (`automaton-engine`) wired to dispatch, the worker
//! sessions and the gRPC edge. The engine hears nothing of them but through [`Hooks`],
//! implemented here by [`Wiring`].

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::time::Duration;

use automaton_engine::{Engine, Error, Hooks, Live};
use automaton_store::Project;
use automaton_workflow::{AgentId, TaskName};

use crate::dispatch::{Limits, Work};
use crate::sessions::Sessions;

/// What a coordinator is opened with (from [`crate::Config`]).
#[derive(Debug, Clone)]
pub struct Options {
    /// The lease engine's: grace, log compaction, TTL bounds, failpoints.
    pub engine: automaton_engine::Options,
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
    /// Where finished work goes (`[delivery]`).
    pub delivery: crate::config::Delivery,
    /// `[etcd] git_remote`: a delivery's default remote with `store = etcd`.
    pub shared_remote: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            engine: automaton_engine::Options::default(),
            keepalive_max_ids: 1024,
            session_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(2),
            max_phase_time: Duration::from_secs(3600),
            max_attempts: 3,
            max_artifact_bytes: 8 << 20,
            max_upload_memory_bytes: crate::uploads::DEFAULT_UPLOAD_MEMORY_BYTES,
            max_iterations: 10,
            max_total_time: Duration::from_secs(24 * 3600),
            delivery: crate::config::Delivery::default(),
            shared_remote: None,
        }
    }
}

pub struct Coordinator {
    /// This coordinator's own `Arc`, for work that outlives a request.
    pub(crate) me: Weak<Coordinator>,
    /// Leases, fencing, task changes, recovery, views, events (`automaton-engine`).
    pub engine: Arc<Engine>,
    pub(crate) options: Options,
    /// Worker sessions (`sessions.rs`).
    pub(crate) sessions: Arc<Sessions>,
    /// Dispatch, runs and held tasks (`dispatch/`).
    pub(crate) work: Arc<Work>,
    /// Counters of the dispatch path (`metrics.rs`); the lease counters are the engine's.
    pub(crate) metrics: crate::counters::Metrics,
    /// The memory every upload in flight may hold, together (`work_service.rs`).
    pub(crate) uploads: crate::uploads::UploadBudget,
}

impl Coordinator {
    /// Opens the engine over the files backend (the lease log in `.automaton/leases.wal`)
    /// and wires it. Returns the coordinator and what recovery noticed.
    pub fn open(
        project: Project,
        options: Options,
    ) -> Result<(Arc<Coordinator>, Vec<String>), Error> {
        let (engine, notes) = Engine::open(project, options.engine.clone())?;
        Ok((Self::wire(engine, options), notes))
    }

    /// [`Coordinator::open`] over the lease log of `backend`.
    pub fn open_with(
        project: Project,
        options: Options,
        backend: &dyn automaton_backend::Backend,
    ) -> Result<(Arc<Coordinator>, Vec<String>), Error> {
        let (engine, notes) = Engine::open_with(project, options.engine.clone(), backend)?;
        Ok((Self::wire(engine, options), notes))
    }

    fn wire(engine: Arc<Engine>, options: Options) -> Arc<Coordinator> {
        let sessions = Arc::new(Sessions::new(
            options.session_timeout,
            options.heartbeat_interval,
        ));
        let work = Arc::new(Work::new(&Limits {
            max_phase_time: options.max_phase_time,
            max_attempts: options.max_attempts,
            max_artifact_bytes: options.max_artifact_bytes,
            max_iterations: options.max_iterations,
            max_total_time: options.max_total_time,
        }));
        let uploads = crate::uploads::UploadBudget::new(options.max_upload_memory_bytes);
        let coord = Arc::new_cyclic(|me: &Weak<Coordinator>| Coordinator {
            me: me.clone(),
            engine: engine.clone(),
            options,
            sessions: sessions.clone(),
            work: work.clone(),
            metrics: crate::counters::Metrics::default(),
            uploads,
        });
        engine.set_hooks(Arc::new(Wiring {
            sessions,
            work,
            coord: Arc::downgrade(&coord),
        }));
        // Sessions that own live leases wait for their workers to resume them.
        coord.recover_sessions();
        coord
    }

    /// Resolves with the reason once the lease log has failed (the coordinator must stop).
    pub async fn log_failed(&self) -> String {
        self.engine.log_failed().await
    }

    pub fn live_leases(&self) -> usize {
        self.engine.live_leases()
    }

    /// Writes every lease holder the log knows and the task files do not yet: at shutdown,
    /// so the files alone are complete for the CLI's local mode.
    pub fn flush_holders(&self) -> Result<(), Error> {
        self.engine.flush_holders()
    }
}

/// What the engine tells dispatch and the sessions. It holds them, not the coordinator, so
/// the calls on the lease path cost no upgrade of a weak reference; only the writes of
/// dispatch records (on transitions) go through the coordinator.
struct Wiring {
    sessions: Arc<Sessions>,
    work: Arc<Work>,
    coord: Weak<Coordinator>,
}

impl Hooks for Wiring {
    fn session_for_claim(&self, agent: &AgentId, requested: &str) -> Result<Arc<str>, Error> {
        self.sessions.for_claim(agent, requested)
    }

    fn lease_ended(&self, l: &Live, reason: automaton_workflow::LeaseEnd) {
        self.sessions.tell(l, reason);
        // The task may be dispatched again — by a worker: with none in session, a round
        // (which walks every task) would find nobody to give it to. This poke cost every
        // Release a round over thousands of tasks (issue 20, finding 8); the periodic round
        // still looks at everything.
        if self.sessions.len() > 0 {
            self.work.poke();
        }
    }

    fn task_changed(&self) {
        self.work.poke();
    }

    fn task_created(&self, task: &TaskName) {
        self.work.task_created(task);
    }

    fn load_counts<'a>(
        &'a self,
        task: &'a TaskName,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            if let Some(c) = self.coord.upgrade() {
                c.load_dispatch(task).await;
            }
        })
    }

    fn phase_done(&self, task: &TaskName) -> bool {
        self.work.phase_done(task)
    }

    fn save_run_request<'a>(
        &'a self,
        task: &'a TaskName,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(async move {
            if let Some(c) = self.coord.upgrade() {
                c.save_or_warn(task).await;
            }
        })
    }
}
