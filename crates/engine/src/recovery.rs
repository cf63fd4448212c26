//! Recovery: a start rebuilds the lease table from the log alone (`replay`, `recover`); each
//! task's files are reconciled with it when the task is first touched (`touch`), and by a
//! background pass at the lowest CPU priority. A lease dropped because its task moved on
//! (a crash inside its own transition) gets the completion record that transition would
//! have written.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use automaton_store::{Lease, Project};
use automaton_workflow::{AgentId, State, TaskName, TtlBounds};

use crate::Error;
use crate::engine::Engine;
use crate::fencing::TOKEN_BLOCK;
use crate::table::{Live, Table, later, wall_later};
use automaton_backend::{Record, holders_in, replay};

/// What a start found: the table, what it noticed, and the token mark.
pub(crate) struct Recovered {
    pub table: Table,
    pub notes: Vec<String>,
    /// Every token up to this one may have been issued by a coordinator: a `.state.lock`
    /// with a higher token was taken by the CLI while none ran (see [`adoptable`]).
    pub log_mark: u64,
    /// The fencing mark on disk: every token up to it is reserved.
    pub fencing_mark: u64,
    /// Every holder the log names (grants and `H` records), for `holders.rs` to make sure
    /// the task files say so.
    pub holders: Vec<(TaskName, AgentId, State)>,
}

/// Rebuilds the table from the log alone — the log is the truth, and a start reads no task
/// folder but those of the leases it keeps (100,000 folders cost seconds on a cold cache):
/// - a lease whose task has since moved to another state is dropped (a lease is for a phase);
/// - every surviving lease gets at least `grace` from now, so its holder can reconnect;
/// - every holder the log names is handed to `holders.rs`, which writes the task files in
///   the background (an approval writes its task's first);
/// - the fencing mark moves past every token seen, and a fresh block is reserved.
///
/// The files are reconciled task by task when a task is first touched (see
/// `Engine::touch`): a `.state.lock` the CLI wrote while no coordinator ran is adopted
/// then, before the task can be granted; any other is a stale view and is removed.
pub(crate) fn recover(
    project: &Project,
    log: &[Record],
    grace: Duration,
) -> Result<Recovered, automaton_store::Error> {
    let mut notes = Vec::new();
    let (grants, log_mark) = replay(log);
    let now_wall = SystemTime::now();
    let mut table = Table::default();
    let now = Instant::now();
    for (task, r) in grants {
        let Record::Grant {
            agent,
            lease_id,
            token,
            ttl,
            state,
            session,
            ..
        } = r
        else {
            continue;
        };
        match project.read_state(&task) {
            Ok(Some(current)) if current == state => {}
            Ok(current) => {
                notes.push(format!(
                    "{task}: dropped the lease of {agent} (token {token}): it was for '{state}', the task is now '{}'",
                    current.map_or("untracked".to_string(), |s| s.to_string())
                ));
                // Only the lease's own transition moves a leased task, and a crash after its
                // `.state` and before its record leaves none: a retry of it finds one here.
                if let Some(to) = current
                    && project.completion(&lease_id).ok().flatten().is_none()
                {
                    let done = automaton_store::Completion {
                        lease_id,
                        token,
                        agent,
                        task,
                        from: state,
                        to,
                    };
                    if let Err(e) = project.record_completion(&done) {
                        notes.push(format!("{}: no completion record: {e}", done.task));
                    }
                }
                continue;
            }
            Err(e) => {
                notes.push(format!("{task}: dropped the lease of {agent}: {e}"));
                continue;
            }
        }
        let mut live = Live::recovered(
            task, agent, lease_id, token, ttl, state, grace, now, now_wall,
        );
        live.session = session.map(Arc::from);
        table.insert(live);
    }
    // The CLI moves the fencing mark past every token it issues: no folder need be read.
    let mark = project.fencing_mark()?.max(log_mark);
    table.next_token = mark.saturating_add(1);
    let fencing_mark = mark.saturating_add(TOKEN_BLOCK);
    project.set_fencing_mark(fencing_mark)?;
    Ok(Recovered {
        table,
        notes,
        log_mark,
        fencing_mark,
        holders: holders_in(log),
    })
}

/// Whether a `.state.lock` found on a task's first touch is a lease the CLI took while no
/// coordinator ran (adopt it while live and for the task's current state), rather than a
/// view some coordinator wrote (whose fate the log knows).
pub(crate) fn adoptable(file: &Lease, log_mark: u64, state: State, now: SystemTime) -> bool {
    file.token > log_mark && file.expires > now && file.phase == state
}

impl Live {
    /// A lease rebuilt at start (from the log or an adopted file): it lives at least
    /// max(TTL, grace) from now. A TTL read from disk is bounded like one from a request.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn recovered(
        task: TaskName,
        agent: AgentId,
        lease_id: String,
        token: u64,
        ttl: Duration,
        state: State,
        grace: Duration,
        now: Instant,
        now_wall: SystemTime,
    ) -> Live {
        let ttl = ttl.min(TtlBounds::CEILING);
        let live = ttl.max(grace);
        Live {
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
            session: None,
            pending: false,
        }
    }
}

impl Engine {
    /// A task's state: from memory, or read once from `.state` when the task is first
    /// touched, which is also when its `.state.lock` is reconciled with the log: a lease the
    /// CLI took while no coordinator ran is adopted (logged durably first), any other file
    /// is a stale or broken view and is removed. Call under the task's guard.
    pub async fn touch(&self, task: &TaskName) -> Result<State, Error> {
        if let Some(s) = self.states().get(task) {
            return Ok(*s);
        }
        let project = self.project.clone();
        let t = task.clone();
        let (state, file) = tokio::task::spawn_blocking(move || {
            let state = project.tracked_state(&t)?;
            Ok::<_, automaton_store::Error>((state, project.read_lease(&t)))
        })
        .await
        .map_err(|e| Error::Internal(format!("reading task {task} failed: {e}")))??;
        let now_wall = SystemTime::now();
        let ours = |id: &str| self.table().entry(task).is_some_and(|l| l.lease_id == id);
        match file {
            Ok(Some(l)) if ours(&l.lease_id) => {}
            Ok(Some(l)) if adoptable(&l, self.log_mark, state, now_wall) => {
                let live = Live::recovered(
                    task.clone(),
                    l.agent.clone(),
                    l.lease_id.clone(),
                    l.token,
                    l.expires
                        .duration_since(l.claimed)
                        .unwrap_or(self.options.grace),
                    state,
                    self.options.grace,
                    Instant::now(),
                    now_wall,
                );
                // In the table and queued for the log in one step (as every grant), and in
                // the log before this task goes on: the next start must know it and its end.
                // The task's guard is held, so nothing else can change it meanwhile.
                let commit = {
                    let mut table = self.table();
                    table.bump_past(l.token);
                    table.insert(live.clone());
                    self.holders.granted(task, &live.agent, state);
                    self.log.grant(live.as_grant())
                };
                let logged = match commit {
                    Ok(c) => c.await,
                    Err(e) => Err(e),
                };
                if let Err(e) = logged {
                    self.table().remove_lease(task, &live.lease_id);
                    self.holders.taken_back(task, &live.agent, state);
                    return Err(Error::Unavailable(e));
                }
                self.holders.committed(task, &live.agent, state);
                tracing::warn!(task = %task, agent = %l.agent, token = l.token, "adopted a lease taken without the coordinator");
            }
            Ok(Some(_)) | Err(_) => {
                if let Err(e) = &file {
                    tracing::warn!(task = %task, error = %e, "unreadable .state.lock removed");
                }
                self.project.write_lease_view(task, None)?;
            }
            Ok(None) => {}
        }
        self.states().insert(task.clone(), state);
        Ok(state)
    }

    /// [`Engine::touch`] before a change of the task (under its guard): a task the store
    /// will refuse anyway (unknown, untracked) is left to the store to explain.
    pub async fn touch_for_change(&self, task: &TaskName) -> Result<(), Error> {
        match self.touch(task).await {
            Err(e @ (Error::Unavailable(_) | Error::Internal(_))) => Err(e),
            _ => Ok(()),
        }
    }

    /// [`Engine::touch_for_change`] under the task's guard, for paths that do not hold
    /// it (reads): only a failure to make an adoption durable is an error.
    pub async fn touch_guarded(&self, task: &TaskName) -> Result<(), Error> {
        if self.states().contains_key(task) {
            return Ok(());
        }
        let _guard = self.guard(task).await;
        self.touch_for_change(task).await
    }

    /// Touches every task in the background, at the lowest CPU priority: stale views are
    /// removed and leases the CLI took are adopted within seconds of a start, without
    /// holding the start up (a request that touches a task first does it itself). First, the
    /// lease holders the log names are written to their task files.
    pub fn spawn_reconciler(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let me = Arc::downgrade(self);
        let project = self.project.clone();
        let _ = std::thread::Builder::new()
            .name("reconcile".into())
            .spawn(move || {
                #[cfg(unix)]
                let _ = rustix::process::setpriority_process(None, 19);
                // First, the holders the log brought back go to their files, at this
                // thread's low priority, so they do not ride along in every rewrite of the
                // log (each start after a crash would otherwise carry more of them).
                if let Some(coord) = me.upgrade()
                    && let Err(e) = coord.flush_holders()
                {
                    tracing::warn!(error = %e, "cannot record the recovered lease holders");
                }
                let started = Instant::now();
                let tasks = match project.all_task_names() {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot list the tasks to reconcile");
                        return;
                    }
                };
                let n = tasks.len();
                for task in tasks {
                    let Some(coord) = me.upgrade() else { return };
                    if let Err(e) = runtime.block_on(coord.touch_guarded(&task)) {
                        tracing::debug!(task = %task, error = %e, "not reconciled");
                    }
                }
                tracing::info!(
                    tasks = n,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "every task folder reconciled with the lease log"
                );
            });
    }
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
            session: None,
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
    fn every_holder_the_log_names_is_recovered_once() {
        let holder = Record::Holder {
            task: "u".parse().expect("task"),
            agent: "b".parse().expect("agent"),
            state: "implement".parse().expect("state"),
        };
        let log = [
            grant("t", "A", 1),
            end("A"),
            grant("t", "A2", 2),
            holder.clone(),
        ];
        let got = holders_in(&log);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(
            got.iter()
                .any(|(t, a, _)| t.to_string() == "t" && a.as_str() == "a")
        );
        assert!(got.iter().any(|(t, a, s)| t.to_string() == "u"
            && a.as_str() == "b"
            && s.phase == automaton_workflow::Phase::Implement));
    }

    fn name<T: std::str::FromStr>(s: &str) -> T
    where
        T::Err: std::fmt::Debug,
    {
        s.parse().expect("a valid name")
    }

    fn options() -> crate::engine::Options {
        crate::engine::Options {
            grace: Duration::from_millis(500),
            log_compact_bytes: 1 << 20,
            ttl: TtlBounds {
                min: Duration::from_millis(10),
                max: Duration::from_secs(3600),
            },
            ..crate::engine::Options::default()
        }
    }

    /// An engine over the project in `dir`, opened as a start opens it.
    fn open(dir: &std::path::Path) -> Arc<Engine> {
        Engine::open(Project::open(dir, None), options())
            .expect("open")
            .0
    }

    /// A fresh project with task `t` in `research`.
    async fn project_with_task(dir: &std::path::Path) -> Arc<Engine> {
        let coord = open(dir);
        let task: TaskName = name("t");
        coord.create_task(&task).await.expect("create");
        coord
            .transition(&task, name("research"), &crate::Presented::default())
            .await
            .expect("to research");
        coord
    }

    /// A restart: everything queued is durable (as after a kill, where the page cache keeps
    /// what was written), the engine goes, a new one opens the same project.
    async fn restart(coord: Arc<Engine>, dir: &std::path::Path) -> Arc<Engine> {
        coord
            .log()
            .barrier()
            .expect("log open")
            .await
            .expect("durable");
        drop(coord);
        open(dir)
    }

    /// Issue 30, finding 3: a renewal (or the holder's re-claim) that read the clock before
    /// taking the table's lock, while the expiry sweep took it, found the lease live at its
    /// earlier instant although the sweep had just found it lapsed and queued its end: it
    /// extended a lease that was ending and was answered OK. Once that end was durable the
    /// lease was gone, from the table and from the log (so after any restart), inside the
    /// TTL just promised; a re-claim with a longer TTL also logged a grant after the end, so
    /// a restart brought back a lease announced as expired. Reproduced by holding the table's
    /// lock while a renewal and a re-claim (`reclaim_ttl`) wait on it past the lease's
    /// deadline, then letting the sweep in first; whatever was answered OK must hold, in the
    /// table and after a restart.
    async fn renewals_racing_the_sweep(reclaim_ttl: Duration) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut coord = project_with_task(dir.path()).await;
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        let ttl = Duration::from_secs(1);
        let mut raced = 0;
        for attempt in 0..20 {
            let g = coord.claim(&task, &agent, Some(ttl)).await.expect("claim");
            let id = g.live.lease_id.clone();
            let deadline = g.live.deadline;
            let held = coord.table();
            // Both read the clock just before the deadline, then wait on the lock: what
            // they answer promises nearly a whole TTL ahead.
            std::thread::sleep(
                deadline.saturating_duration_since(Instant::now() + Duration::from_millis(20)),
            );
            let renewer = {
                let (c, id) = (coord.clone(), id.clone());
                std::thread::spawn(move || c.renew_with(&id, None, None, Live::clone).is_ok())
            };
            let reclaimer = {
                let (c, t, a) = (coord.clone(), task.clone(), agent.clone());
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("runtime");
                    rt.block_on(c.claim(&t, &a, Some(reclaim_ttl)))
                        .map(|g| g.live.lease_id)
                })
            };
            std::thread::sleep(
                deadline.saturating_duration_since(Instant::now()) + Duration::from_millis(5),
            );
            drop(held);
            // Straight after the unlock this thread takes the lock again before the woken
            // waiters run (nearly always; when not, they renew in time and this is retried).
            let swept = coord.expire();
            let renewed = renewer.join().expect("renewer");
            let reclaimed = reclaimer.join().expect("re-claimer").ok();
            // Until the sweep's end is durable and carried out.
            let until = Instant::now() + Duration::from_secs(5);
            while coord.table().entry(&task).is_some_and(|l| l.ending) {
                assert!(Instant::now() < until, "the sweep's end never completed");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if swept == 1 {
                raced += 1;
                let promised = reclaimed.clone().or(renewed.then(|| id.clone()));
                let shown = coord.live_of(&task).map(|l| l.lease_id);
                coord = restart(coord, dir.path()).await;
                let after = coord.live_of(&task).map(|l| l.lease_id);
                assert!(
                    shown == promised && after == promised,
                    "attempt {attempt}: the sweep ended {id}, then its renewal answered {renewed} and its re-claim {reclaimed:?}; the task's lease is now {shown:?}, after a restart {after:?}"
                );
            }
            if let Some(l) = coord.live_of(&task) {
                coord
                    .release(&l.lease_id, None, None)
                    .await
                    .expect("release");
            }
            if raced >= 2 {
                break;
            }
        }
        assert!(
            raced > 0,
            "the sweep never went first: the race was not exercised"
        );
    }

    /// The shape: the re-claim asks for a shorter TTL (logged as a barrier only).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_renewal_that_read_the_clock_before_the_sweep_ended_its_lease_is_refused() {
        renewals_racing_the_sweep(Duration::from_millis(500)).await;
    }

    /// A re-claim with a longer TTL logs a grant: never after the end of the lease it renews.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reclaim_that_read_the_clock_before_the_sweep_ended_its_lease_gets_a_new_one() {
        renewals_racing_the_sweep(Duration::from_secs(3)).await;
    }

    #[test]
    fn the_mark_covers_every_token_the_log_has_seen() {
        let log = [Record::Mark { token: 40 }, grant("t", "A", 7), end("A")];
        assert_eq!(replay(&log).1, 40);
        let log = [grant("t", "A", 70), end("A")];
        assert_eq!(replay(&log).1, 70);
    }
}
