//! The lease operations: claim, renew, release, expire, and the check of a lease presented
//! with a change. Every rule comes from `automaton_workflow::lease`; every grant and end is
//! acknowledged only once the log has it on disk.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use automaton_workflow::{AgentId, EventKind, LeaseEnd, TaskName};

use crate::Error;
use crate::commit::Committing;
use crate::counters::Refusal;
use crate::engine::Engine;
use crate::table::Live;
use crate::watchers::Lost;

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
pub enum Refused {
    Now(Error),
    OnceDurable(automaton_backend::Commit, Error),
}

impl Engine {
    /// Grants `task` to `agent` (or renews it for its holder). Acknowledged only once the
    /// grant is in the log on disk.
    pub async fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> Result<Granted, Error> {
        self.claim_in(task, agent, ttl, None).await
    }

    /// A claim, in a worker session when `session` is given (the session's id, or empty for
    /// the agent's live session): the lease then ends when the session dies.
    pub async fn claim_in(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
        session: Option<&str>,
    ) -> Result<Granted, Error> {
        let result = self.claim_inner(task, agent, ttl, session).await;
        if let Err(e) = &result {
            self.counters.refused(Refusal::of(e));
        }
        if let Err(e) = &result
            && self.watched()
        {
            self.emit(
                EventKind::LeaseRefused,
                &task.to_string(),
                agent.as_str(),
                0,
                e.to_string(),
            );
        }
        result
    }

    pub async fn claim_inner(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
        session: Option<&str>,
    ) -> Result<Granted, Error> {
        let ttl =
            match ttl {
                Some(t) => self.options.ttl.check(t).map_err(|r| {
                    automaton_store::Error::from_refusal(task, r, SystemTime::now())
                })?,
                None => self.policy.lock_timeout,
            };
        let guard = self.guard(task).await;
        let state = self.touch(task).await?;
        self.project
            // The implementers not in `.state.implementer` yet (`holders.rs`) count too.
            .claimable_in(
                task,
                state,
                agent,
                &self.policy,
                &self.holders.pending_implementers(task),
            )?;
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
                    // Nothing is acknowledged before it is durable: the grant this claim
                    // repeats may still be on its way to the log (its own claim cut off,
                    // say). A restart gives every lease max(logged TTL, grace), so a longer
                    // TTL is logged before it is promised — queued under the table's lock, so
                    // no end of this lease can be queued before it and be undone at replay;
                    // otherwise a barrier waits for what is queued, and a shorter TTL is
                    // applied only after it: a claim refused because the lease lapsed
                    // during the wait has changed nothing.
                    let (logged, rewrite) = if ttl > l.ttl {
                        l.ttl = ttl;
                        let rewrite = l.extend(now);
                        (self.log.grant(l.as_grant()), rewrite)
                    } else {
                        (self.log.barrier(), false)
                    };
                    Some((l.clone(), logged, rewrite))
                }
                None => None,
            }
        };
        if let Some((l, logged, rewrite)) = renewal {
            drop(guard);
            logged
                .map_err(Error::Unavailable)?
                .await
                .map_err(Error::Unavailable)?;
            // A barrier may have cost no write at all: the promise below is made only while
            // this process can prove it leads.
            self.leading()?;
            // The TTL runs from the acknowledgement, which is now: the wait for the log may
            // have taken a good part of it. A lease that lapsed meanwhile has ended.
            let (l, rewrite) = {
                let mut table = self.table();
                let Some(now_l) = table.by_id_mut(&l.lease_id, Instant::now()) else {
                    return Err(Error::LeaseNotFound(l.lease_id.clone()));
                };
                now_l.ttl = ttl;
                let again = now_l.extend(Instant::now());
                (now_l.clone(), rewrite || again)
            };
            if rewrite {
                self.view_of(&l, true);
            }
            self.counters.renewed();
            self.emit_renewed(&l);
            return Ok(Granted {
                live: l,
                renewed: true,
            });
        }
        let (live, displaced, commit) = {
            let mut table = self.table();
            // Under the table's lock: a session that dies after this check finds this grant
            // in the table and ends it too.
            let session = session
                .map(|s| self.session_for_claim(agent, s))
                .transpose()?;
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
                deadline: crate::table::later(now, ttl),
                claimed,
                view_expires: claimed,
                ending: false,
                session: session.clone(),
                // Live, never lapsed, until its record is durable; its TTL starts then.
                pending: true,
            };
            live.view_expires = live.next_view_expires();
            // A lease displaced here had lapsed, and its end was not queued (an ending one's
            // was): the end goes with the grant, so no backend keeps it once the grant ends.
            let displaced = table.insert(live.clone()).filter(|d| !d.ending);
            self.holders.granted(task, agent, state);
            // Queued under the table's lock, like every record: whatever is queued after
            // this grant became visible (a barrier, an end of it) is queued after it too.
            let commit = match &displaced {
                Some(d) => self.log.grant_displacing(live.as_grant(), &d.lease_id),
                None => self.log.grant(live.as_grant()),
            };
            (live, displaced, commit)
        };
        drop(guard);
        let commit = match commit {
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
                    c.holders.committed(&live.task, &live.agent, live.state);
                    if let Some(d) = displaced {
                        c.after_end(d, LeaseEnd::Expired);
                    }
                    // Durable: the TTL starts now, as the grant is acknowledged.
                    let confirmed = c
                        .table()
                        .confirm(&live.task, &live.lease_id, Instant::now());
                    if let Some(l) = confirmed {
                        c.after_grant(&l);
                    }
                }
                Err(_) => c.unclaim(live),
            },
        )
        .finish()
        .await;
        logged.map_err(Error::Unavailable)?;
        // The grant is durable (a fenced write on etcd); it is promised only while this
        // process can still prove it leads. Refused, it stays: a new leader replays it with
        // its grace, and the agent's next claim renews it there.
        self.leading()?;
        let (live, _) = live;
        // The lease as acknowledged (its deadline from now); gone only if its worker session
        // ended while the grant was being logged (its end follows the grant in the log).
        let acked = self
            .table()
            .confirm(&live.task, &live.lease_id, Instant::now());
        let Some(live) = acked else {
            return Err(Error::LeaseNotFound(live.lease_id));
        };
        Ok(Granted {
            live,
            renewed: false,
        })
    }

    /// Ok while this process may promise leases: always with the files store; with etcd,
    /// only while its leadership is provably held (the last acknowledged keepalive's send
    /// time + the election TTL − a margin, on the monotonic clock, not passed).
    pub fn leading(&self) -> Result<(), Error> {
        self.log.serving().map_err(Error::NotLeading)
    }

    /// The session a claim goes into (see [`crate::Hooks::session_for_claim`]); without
    /// sessions wired in, none exists.
    fn session_for_claim(&self, agent: &AgentId, requested: &str) -> Result<Arc<str>, Error> {
        match self.hooks() {
            Some(h) => h.session_for_claim(agent, requested),
            None => Err(Error::Refused(format!(
                "worker '{agent}' has no live session: start automaton-worker (it registers), then claim"
            ))),
        }
    }

    pub fn after_grant(&self, live: &Live) {
        self.counters.granted();
        self.view_of(live, true);
        if self.watched() {
            self.emit(
                EventKind::LeaseGranted,
                &live.task.to_string(),
                live.agent.as_str(),
                live.token,
                format!("{}", live.state),
            );
        }
    }

    /// Takes back a grant that was never acknowledged. Its end goes to the log too: a log
    /// rewrite may have put the grant into its snapshot meanwhile.
    pub fn unclaim(&self, live: &Live) {
        self.table().remove_lease(&live.task, &live.lease_id);
        self.holders.taken_back(&live.task, &live.agent, live.state);
        self.log.end_nowait(&live.lease_id);
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
    pub fn renew_with<R>(
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
            self.counters.refused(Refusal::NotFound);
            return Err(self.not_found(lease_id, lapsed));
        };
        if let Some(who) = who
            && who != &l.agent
        {
            self.counters.refused(Refusal::PermissionDenied);
            return Err(Refused::Now(Error::PermissionDenied(format!(
                "lease '{}' is not held by '{who}': an agent renews only its own leases",
                automaton_workflow::excerpt(lease_id)
            ))));
        }
        if let Some(t) = token
            && t != l.token
        {
            self.counters.refused(Refusal::StaleToken);
            return Err(Refused::Now(Error::Store(
                automaton_store::Error::StaleToken {
                    task: l.task.clone(),
                    given: t,
                    current: Some(l.token),
                },
            )));
        }
        // A renewal writes nothing: the only proof that this process may still promise
        // anything is its leadership's deadline, checked here, after the request arrived and
        // before the answer (docs/backends.md, "A leader that cannot prove it leads").
        if let Err(e) = self.leading() {
            drop(table);
            self.counters.refused(Refusal::Unavailable);
            return Err(Refused::Now(e));
        }
        let rewrite = l.extend(now);
        self.counters.renewed();
        let out = answer(l);
        if rewrite {
            // Under the table's lock: no later end's removal can be sent before it.
            self.view(&l.task, Some(l.view()));
        }
        drop(table);
        Ok(out)
    }

    /// The refusal of a lease id with no live lease, answered once every end queued before it
    /// is durable: a release, transition or expiry takes a lease out of the table and queues
    /// its end in one step under the table's lock, so the barrier queued after this lookup
    /// covers that end (without pending records it costs no sync). `lapsed`: the lease is
    /// still in the table past its deadline, its end perhaps not queued yet.
    fn not_found(&self, lease_id: &str, lapsed: bool) -> Refused {
        if lapsed {
            self.expire();
        }
        let not_found = Error::LeaseNotFound(automaton_workflow::excerpt(lease_id));
        match self.log.barrier() {
            Ok(commit) => Refused::OnceDurable(commit, not_found),
            Err(e) => Refused::Now(Error::Unavailable(e)),
        }
    }

    /// The live lease `lease_id` for work under it (a worker's fetch, upload or completion):
    /// the token must be its own, and a caller bound to a name (`who`) must be its holder.
    /// An ended lease is refused once its end is durable, like a renewal.
    pub async fn lease_for_work(
        &self,
        lease_id: &str,
        token: u64,
        who: Option<&AgentId>,
    ) -> Result<Live, Error> {
        let now = Instant::now();
        let found = {
            let table = self.table();
            match table.by_id(lease_id, now) {
                Some(l) => Ok(l.clone()),
                None => Err(table.lapsed(lease_id, now)),
            }
        };
        let l = match found {
            Ok(l) => l,
            Err(lapsed) => {
                return match self.not_found(lease_id, lapsed) {
                    Refused::Now(e) => Err(e),
                    Refused::OnceDurable(commit, e) => {
                        commit.await.map_err(Error::Unavailable)?;
                        Err(e)
                    }
                };
            }
        };
        if let Some(who) = who
            && who != &l.agent
        {
            return Err(Error::PermissionDenied(format!(
                "lease '{}' is not held by '{who}': a worker works only under its own leases",
                automaton_workflow::excerpt(lease_id)
            )));
        }
        if token != l.token {
            return Err(Error::Store(automaton_store::Error::StaleToken {
                task: l.task.clone(),
                given: token,
                current: Some(l.token),
            }));
        }
        Ok(l)
    }

    /// Ends a lease at its holder's request; acknowledged once the end is in the log. `who`:
    /// the agent a caller speaks for (an agent token's name, or the request's agent).
    pub async fn release(
        &self,
        lease_id: &str,
        token: Option<u64>,
        who: Option<&AgentId>,
    ) -> Result<Live, Error> {
        // A deposed leader's end could not be written anyway; its table may be stale.
        self.leading()?;
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
                    Ok(self.take_and_end(&mut table, &task))
                }
            }
        };
        match found {
            Ok(Some(ended)) => self.end(ended?, LeaseEnd::Released).await,
            Ok(None) => Err(Error::Internal(
                "the lease table changed under its lock".into(),
            )),
            Err(lapsed) => match self.not_found(lease_id, lapsed) {
                Refused::Now(e) => Err(e),
                Refused::OnceDurable(commit, e) => {
                    commit.await.map_err(Error::Unavailable)?;
                    Err(e)
                }
            },
        }
    }

    /// Takes `task`'s lease out of `table` and queues its end, in one step under the table's
    /// lock (see [`Engine::not_found`]). If the log takes nothing more, the lease stays.
    pub fn take_and_end(
        &self,
        table: &mut crate::table::Table,
        task: &TaskName,
    ) -> Option<Result<(Live, automaton_backend::Commit), Error>> {
        let l = table.remove(task)?;
        Some(match self.log.end(&l.lease_id) {
            Ok(commit) => Ok((l, commit)),
            Err(e) => {
                table.insert(l);
                Err(Error::Unavailable(e))
            }
        })
    }

    /// Logs the end of a removed lease durably, then updates the view and tells the world. If
    /// the log cannot take it, the lease goes back into the table (the coordinator is
    /// stopping: nothing may look ended that a restart would bring back).
    pub async fn end(
        &self,
        (l, commit): (Live, automaton_backend::Commit),
        reason: LeaseEnd,
    ) -> Result<Live, Error> {
        let ((l, _), logged) =
            Committing::new(self, commit, (l, reason), |c, (l, reason), logged| {
                if logged.is_ok() {
                    c.after_end(l, *reason);
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
    pub fn restore(&self, l: &Live) {
        let mut table = self.table();
        if table.entry(&l.task).is_none() {
            table.insert(l.clone());
        }
    }

    pub fn after_end(&self, l: &Live, reason: LeaseEnd) {
        self.counters.ended(l.state.phase, l.claimed, reason);
        self.view_of(l, false);
        // Its session hears of it; its task may be dispatched again.
        if let Some(h) = self.hooks() {
            h.lease_ended(l, reason);
        }
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
            let kind = if reason.is_expiry() {
                EventKind::LeaseExpired
            } else {
                EventKind::LeaseReleased
            };
            self.emit(
                kind,
                &l.task.to_string(),
                l.agent.as_str(),
                l.token,
                reason.name().to_string(),
            );
        }
    }

    /// Rewrites the lease log with only the live leases if it has grown enough (see
    /// `Wal::wants_rewrite`); the rewrite happens on the log's thread.
    pub fn compact_log(&self) -> bool {
        if !self.log.wants_rewrite() {
            return false;
        }
        // Snapshot and queue under the table's lock: no change can fall between the two, so
        // every record queued before the rewrite is reflected in the snapshot.
        let table = self.table();
        let mut records = table.records();
        // Holders of grants the rewrite drops, not yet in their task's files.
        records.extend(self.holders.records());
        drop(self.log.rewrite(&records));
        true
    }

    /// Ends every lease past its deadline: their ends go to the log, and only once that is
    /// durable are they removed and announced (views, loss notices, events). Until then they
    /// stay in the table, lapsed: never live, never renewed, superseded by a new grant.
    pub fn expire(&self) -> usize {
        // Marked and queued in one step under the table's lock (see `not_found`).
        let (lapsed, commit) = {
            let mut table = self.table();
            let lapsed = table.mark_lapsed(Instant::now());
            if lapsed.is_empty() {
                return 0;
            }
            let commit = self
                .log
                .ends(&mut lapsed.iter().map(|l| l.lease_id.as_str()));
            (lapsed, commit)
        };
        let n = lapsed.len();
        let commit = match commit {
            Ok(c) => c,
            // The writer has stopped: the coordinator is stopping, and a restart replays
            // these leases (they get the grace, as if the crash came first).
            Err(_) => return 0,
        };
        let Some(me) = self.me.upgrade() else {
            return 0;
        };
        let finish = move |me: &Engine, logged: Result<(), String>| {
            if logged.is_err() {
                return;
            }
            for l in &lapsed {
                me.table().remove_lease(&l.task, &l.lease_id);
                me.after_end(l, LeaseEnd::Expired);
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
    pub fn check_presented(&self, task: &TaskName, p: &Presented) -> Result<Option<Live>, Error> {
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
}

/// The coordinator's log-backed table as a lease store: the same rules as the files (see
/// `automaton_store::check_lease_rules`), every answer durable before it is given.
impl automaton_store::LeaseStore for Engine {
    type Error = Error;

    async fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> Result<(automaton_store::Lease, bool), Error> {
        let g = Engine::claim(self, task, agent, ttl).await?;
        Ok((g.live.as_store_lease(Instant::now()), g.renewed))
    }

    async fn live(&self, task: &TaskName) -> Result<Option<automaton_store::Lease>, Error> {
        self.touch_guarded(task).await?;
        Ok(self.lease_of(task))
    }

    async fn release(
        &self,
        task: &TaskName,
        agent: &AgentId,
        token: u64,
    ) -> Result<automaton_store::Lease, Error> {
        let Some(l) = self.live_of(task) else {
            return Err(automaton_store::Error::NoLease {
                task: task.clone(),
                agent: agent.clone(),
            }
            .into());
        };
        let ended = Engine::release(self, &l.lease_id, Some(token), Some(agent)).await?;
        Ok(ended.view())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use automaton_store::Project;

    use super::*;
    use crate::engine::Options;
    use crate::events::{Event, Subscription};

    fn name<T: std::str::FromStr>(s: &str) -> T
    where
        T::Err: std::fmt::Debug,
    {
        s.parse().expect("a valid name")
    }

    /// A coordinator over a fresh project with one task in `research`.
    async fn coordinator(dir: &std::path::Path) -> (Arc<Engine>, Arc<automaton_backend::FileLog>) {
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
        let files = automaton_backend::FileBackend {
            path: project.meta().join("leases.wal"),
            compact_bytes: options.log_compact_bytes,
            failpoints: options.failpoints,
        };
        let hooked = Hooked {
            files,
            log: std::sync::Mutex::new(None),
        };
        let (coord, _) = Engine::open_with(project, options, &hooked).expect("open");
        let log = hooked
            .log
            .lock()
            .expect("hooked")
            .take()
            .expect("the engine started its log");
        let task: TaskName = name("t");
        coord.create_task(&task).await.expect("create");
        let p = Presented::default();
        coord
            .transition(&task, name("research"), &p)
            .await
            .expect("to research");
        (coord, log)
    }

    /// The files backend, keeping a handle on the log it starts: the tests' hooks (hold its
    /// commits, fail the next one) without the engine exposing its log.
    struct Hooked {
        files: automaton_backend::FileBackend,
        log: std::sync::Mutex<Option<Arc<automaton_backend::FileLog>>>,
    }

    impl automaton_backend::Backend for Hooked {
        fn name(&self) -> &'static str {
            "files"
        }

        fn load(&self) -> Result<Vec<automaton_backend::Record>, String> {
            self.files.load()
        }

        fn start(
            &self,
            live: &[automaton_backend::Record],
        ) -> Result<Arc<dyn automaton_backend::LeaseLog>, String> {
            let log = Arc::new(
                automaton_backend::FileLog::create(
                    &self.files.path,
                    live,
                    self.files.compact_bytes,
                    self.files.failpoints,
                )
                .map_err(|e| e.to_string())?,
            );
            *self.log.lock().expect("hooked") = Some(log.clone());
            Ok(log)
        }
    }

    /// Polls `coord`'s change `f` once, with the log held so it cannot commit yet, and drops
    /// it: a request cut off by its deadline while its change commits.
    fn cut_off<T: std::fmt::Debug, F: Future<Output = T>>(log: &automaton_backend::FileLog, f: F) {
        let held = log.hold_commits();
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
    async fn the_coordinator_follows_the_same_lease_rules_as_the_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, _log) = coordinator(dir.path()).await;
        automaton_store::check_lease_rules(&*coord, &name("t"))
            .await
            .expect("the coordinator follows the rules");
    }

    #[tokio::test]
    async fn a_late_end_never_removes_the_view_of_the_lease_that_followed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, log) = coordinator(dir.path()).await;
        let task: TaskName = name("t");
        coord
            .claim(&task, &name("a"), Some(Duration::from_millis(10)))
            .await
            .expect("claim a");
        tokio::time::sleep(Duration::from_millis(30)).await;
        let b = {
            // A's end and B's grant commit in one batch; their follow-ups then race.
            let held = log.hold_commits();
            coord.expire();
            let agent_b: AgentId = name("b");
            let claim = coord.claim(&task, &agent_b, None);
            let mut claim = Box::pin(claim);
            assert!(
                claim
                    .as_mut()
                    .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
                    .is_pending()
            );
            drop(held);
            claim.await.expect("claim b")
        };
        let lock = dir.path().join(".automaton/tasks/t/.state.lock");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let on_disk = std::fs::read_to_string(&lock).ok();
            if let Some(text) = &on_disk
                && automaton_store::Lease::parse(text).map(|l| l.token) == Ok(b.live.token)
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "B's view never settled on disk: {on_disk:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let text = std::fs::read_to_string(&lock).expect("B's view stays");
        assert_eq!(
            automaton_store::Lease::parse(&text).map(|l| l.token),
            Ok(b.live.token)
        );
    }

    /// Issue 20, finding 1: a grant's TTL runs from its acknowledgement. While its record
    /// commits (held here past the whole TTL) it is live: never lapsed, never displaced by
    /// another agent's claim; once acknowledged, its whole TTL is ahead of it.
    #[tokio::test]
    // The log is held on purpose while b's claim is awaited: its refusal needs no commit.
    #[allow(clippy::await_holding_lock)]
    async fn a_grant_is_live_while_it_commits_and_its_ttl_starts_at_the_acknowledgement() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, log) = coordinator(dir.path()).await;
        let task: TaskName = name("t");
        let ttl = Duration::from_millis(200);
        let held = log.hold_commits();
        let agent_a: AgentId = name("a");
        let mut claim = Box::pin(coord.claim(&task, &agent_a, Some(ttl)));
        assert!(
            claim
                .as_mut()
                .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
                .is_pending()
        );
        std::thread::sleep(ttl + Duration::from_millis(100));
        assert_eq!(
            coord.expire(),
            0,
            "a grant on its way to the log never lapses"
        );
        let agent_b: AgentId = name("b");
        let b = tokio::time::timeout(Duration::from_secs(5), coord.claim(&task, &agent_b, None));
        match b.await {
            Ok(Err(Error::Store(automaton_store::Error::Leased { holder, .. }))) => {
                assert_eq!(holder.as_str(), "a")
            }
            other => panic!("b must be refused while a's grant commits: {other:?}"),
        }
        drop(held);
        let acked = claim.await.expect("claim a");
        let left = acked
            .live
            .deadline
            .saturating_duration_since(Instant::now());
        assert!(
            left + Duration::from_millis(50) >= ttl,
            "acknowledged with {left:?} of its {ttl:?} left"
        );
    }

    #[tokio::test]
    async fn a_claim_dropped_while_the_log_commits_still_gets_its_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, log) = coordinator(dir.path()).await;
        let mut events = coord.subscribe_events();
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        cut_off(&log, coord.claim(&task, &agent, None));
        let e = next_event(&mut events).await;
        assert_eq!((e.kind, e.task.as_str()), (EventKind::LeaseGranted, "t"));
        assert_eq!(coord.live_leases(), 1, "the grant stands");
        // The same agent claiming again gets that lease back.
        let again = coord.claim(&task, &agent, None).await.expect("re-claim");
        assert!(again.renewed);
    }

    #[tokio::test]
    async fn a_claim_dropped_while_its_log_write_fails_is_taken_back_and_the_log_stops() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, log) = coordinator(dir.path()).await;
        let mut events = coord.subscribe_events();
        let task: TaskName = name("t");
        log.fail_next_commit();
        cut_off(&log, coord.claim(&task, &name("a"), None));
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
        let (coord, log) = coordinator(dir.path()).await;
        let mut events = coord.subscribe_events();
        let task: TaskName = name("t");
        let g = coord
            .claim(&task, &name("a"), Some(Duration::from_millis(10)))
            .await
            .expect("claim");
        let _ = next_event(&mut events).await; // granted
        tokio::time::sleep(Duration::from_millis(30)).await;
        let held = log.hold_commits();
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
        assert_eq!((e.kind, e.task.as_str()), (EventKind::LeaseExpired, "t"));
        let log =
            automaton_backend::files::read(&dir.path().join(".automaton/leases.wal")).expect("log");
        assert!(
            log.contains(&automaton_backend::Record::End {
                lease_id: g.live.lease_id.clone()
            }),
            "the end is in the log: {log:?}"
        );
    }

    #[tokio::test]
    async fn a_repeat_claim_is_acknowledged_only_once_the_grant_is_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, log) = coordinator(dir.path()).await;
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        // The first claim is cut off while its grant commits; the repeat must wait for it.
        let held = log.hold_commits();
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
        let (coord, _log) = coordinator(dir.path()).await;
        for ms in [u64::MAX, 1 << 53, 1] {
            let e = coord
                .claim(&name("t"), &name("a"), Some(Duration::from_millis(ms)))
                .await
                .expect_err("out of bounds");
            // The edge answers it INVALID_ARGUMENT.
            assert!(
                matches!(&e, Error::Store(s) if s.kind() == automaton_store::ErrorKind::Invalid),
                "{e:?}"
            );
            assert!(e.to_string().contains("10ms"), "{e}");
        }
        assert_eq!(coord.live_leases(), 0);
    }

    #[tokio::test]
    async fn a_release_dropped_while_the_log_commits_still_gets_its_event() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (coord, log) = coordinator(dir.path()).await;
        let (task, agent): (TaskName, AgentId) = (name("t"), name("a"));
        let granted = coord.claim(&task, &agent, None).await.expect("claim");
        let mut events = coord.subscribe_events();
        cut_off(
            &log,
            coord.release(&granted.live.lease_id, Some(granted.live.token), None),
        );
        let e = next_event(&mut events).await;
        assert_eq!((e.kind, e.task.as_str()), (EventKind::LeaseReleased, "t"));
        assert_eq!(coord.live_leases(), 0);
    }
}
