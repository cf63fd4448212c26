//! How an engine opens: the lease table rebuilt from the log and the files, the log
//! started afresh, the views of the leases kept written.

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

use automaton_store::Project;

use crate::Error;
use crate::counters::Counters;
use crate::engine::{Engine, GUARD_SHARDS, MAX_BLOCKING_READS, Options};
use crate::events::Feed;
use crate::fencing::Fencing;
use crate::holders::Holders;
use crate::recovery::{Recovered, recover};
use crate::views::spawn_view_writer;
use crate::watchers::Watchers;

impl Engine {
    /// Rebuilds the lease table from the log and the files, compacts the log, repairs the
    /// `.state.lock` views. Returns the engine and what recovery noticed.
    pub fn open(project: Project, options: Options) -> Result<(Arc<Engine>, Vec<String>), Error> {
        let files = automaton_backend::FileBackend {
            path: project.meta().join("leases.wal"),
            compact_bytes: options.log_compact_bytes,
            failpoints: options.failpoints,
        };
        Self::open_with(project, options, &files)
    }

    /// [`Engine::open`] over the lease log of `backend`.
    pub fn open_with(
        project: Project,
        options: Options,
        backend: &dyn automaton_backend::Backend,
    ) -> Result<(Arc<Engine>, Vec<String>), Error> {
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
        let Recovered {
            table,
            notes: recovered,
            log_mark,
            fencing_mark,
            holders,
        } = recover(&project, &log, grace)?;
        // A task branch's ref lock left by a kill -9 mid-commit would refuse every later
        // move of that branch: nobody else writes them, and this process owns the project.
        match project.sweep_task_branch_locks() {
            Ok(swept) => notes.extend(swept.into_iter().map(|r| {
                format!("removed {r}, a task branch's lock left by a writer that was killed")
            })),
            Err(e) => notes.push(format!("cannot sweep the task branches' lock files: {e}")),
        }
        let holders = Holders::new(holders);
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
        let views = spawn_view_writer(project.clone(), written);
        let coord = Arc::new_cyclic(|me| Engine {
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
            feed: Feed::new(),
            watchers: Watchers::default(),
            counters: Counters::default(),
            hooks: OnceLock::new(),
        });
        Ok((coord, notes))
    }
}
