//! What the coordinator does with worker sessions (the registry is `sessions.rs`): opens
//! and resumes them, hears their heartbeats, ends them and their leases, drains workers and
//! lists them for operators.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use automaton_engine::{Error, Live};
use automaton_proto::v1 as pb;
use automaton_proto::vocab::RunVocab;
use automaton_workflow::{AgentId, EventKind, LeaseEnd, RunState, WorkerState};
use tonic::Status;

use crate::sessions::{
    Attachment, BoundName, GIB, Gone, Joined, LOST_KEPT, Outbox, Push, Session, check_register,
    held,
};
use crate::state::Coordinator;

impl Coordinator {
    /// Rebuilds the sessions that own live leases (at start): each waits for its worker for
    /// max(grace, session timeout).
    pub(crate) fn recover_sessions(&self) {
        let wait = self.options.engine.grace.max(self.sessions.timeout);
        let deadline = automaton_engine::later(Instant::now(), wait);
        let table = self.engine.table();
        for (id, agent) in table.sessions() {
            self.sessions.recover(id, agent, deadline);
        }
    }

    /// Opens or resumes a session for a worker; `tx` is its stream's outbox. Refused while
    /// another live session holds the name (unless `replace`).
    pub(crate) async fn register(
        &self,
        bound: BoundName<'_>,
        mut reg: pb::Register,
        tx: Outbox,
    ) -> Result<Joined, Error> {
        let name = check_register(bound, &mut reg)?;
        let generation = self.sessions.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let now = Instant::now();
        let listed: Vec<pb::HeldLease> = std::mem::take(&mut reg.leases);
        let reported: Vec<pb::RunUpdate> = std::mem::take(&mut reg.runs);
        // Only a worker that says it reports its runs, and runs any, can have lost one.
        let checks_runs = reg.reports_runs && reg.capacity > 0;
        let resume: Option<Arc<str>> =
            (!reg.resume_session_id.is_empty()).then(|| Arc::from(reg.resume_session_id.as_str()));
        let replace = reg.replace;
        // Under the table's lock (then the sessions'): the leases kept are exactly those the
        // session owns at this moment.
        let mut replaced: Option<Arc<str>> = None;
        let mut adopted: Vec<(Live, RunState)> = Vec::new();
        let mut run_lost = Vec::new();
        let joined = {
            let mut table = self.engine.table();
            let mut inner = self.sessions.inner();
            let inner = &mut *inner;
            let resumable = resume
                .as_ref()
                .and_then(|id| inner.by_id.get_mut(id))
                .filter(|s| s.name == name);
            if let Some(s) = resumable {
                if let Some(old) = s.attached.take() {
                    let _ = old.tx.send(Push::End(Status::aborted(
                        "this session was resumed on another stream",
                    )));
                }
                s.attached = Some(Attachment { generation, tx });
                s.heard = now;
                s.deadline = automaton_engine::later(now, self.sessions.timeout);
                s.awaiting = false;
                s.reg = reg;
                // Each lease the session owns: its run reported (adopted), lost (ended, its
                // task offered again), or kept as it is (no run expected of it).
                let owned: Vec<Live> = table.of_session(&s.id, now).into_iter().cloned().collect();
                let mut kept: Vec<pb::HeldLease> = Vec::new();
                let mut ended: Vec<pb::HeldLease> = Vec::new();
                for l in owned {
                    let run = reported
                        .iter()
                        .find(|r| r.lease_id == l.lease_id && r.token == l.token);
                    if let Some(r) = run {
                        kept.push(held(&l));
                        adopted.push((l, r.state_kind().unwrap_or(RunState::Active)));
                    } else if checks_runs && self.run_expected(&l) {
                        match self.engine.take_and_end(&mut table, &l.task) {
                            Some(Ok(ending)) => {
                                ended.push(held(&l));
                                run_lost.push(ending);
                            }
                            Some(Err(e)) => {
                                tracing::warn!(task = %l.task, error = %e, "cannot end a lease whose run was lost");
                                kept.push(held(&l));
                            }
                            None => {}
                        }
                    } else {
                        kept.push(held(&l));
                    }
                }
                let mut lost: Vec<pb::HeldLease> = listed
                    .into_iter()
                    .filter(|h| !kept.iter().any(|k| k.lease_id == h.lease_id))
                    .filter(|h| !ended.iter().any(|k| k.lease_id == h.lease_id))
                    .collect();
                lost.extend(ended);
                Joined {
                    id: s.id.clone(),
                    name: name.clone(),
                    generation,
                    granted: pb::SessionGranted {
                        session_id: s.id.to_string(),
                        heartbeat_interval: Some(crate::wire::duration(self.sessions.heartbeat)),
                        session_timeout: Some(crate::wire::duration(self.sessions.timeout)),
                        resumed: true,
                        kept,
                        lost,
                        draining: inner.drained.contains(&name),
                        name: name.to_string(),
                    },
                    adopted: std::mem::take(&mut adopted),
                    run_lost: std::mem::take(&mut run_lost),
                }
            } else {
                if let Some(other) = inner.by_name.get(&name).cloned() {
                    let Some(first) = inner.by_id.get(&other) else {
                        return Err(Error::Internal("the session table lost a session".into()));
                    };
                    if !replace {
                        let host = if first.awaiting {
                            "(awaiting its worker since the coordinator restarted)".to_string()
                        } else {
                            format!("from host '{}'", first.reg.host)
                        };
                        return Err(Error::AlreadyExists(format!(
                            "worker '{name}' already has a live session {host}, {} old: stop that worker, wait {} for its session to expire, or start this one with --replace",
                            humantime::format_duration(Duration::from_secs(
                                SystemTime::now()
                                    .duration_since(first.started)
                                    .unwrap_or_default()
                                    .as_secs()
                            )),
                            humantime::format_duration(self.sessions.timeout)
                        )));
                    }
                    replaced = Some(other);
                }
                let id = self.sessions.new_id();
                inner.by_name.insert(name.clone(), id.clone());
                inner.gone.retain(|g| g.name != name);
                inner.by_id.insert(
                    id.clone(),
                    Session {
                        id: id.clone(),
                        name: name.clone(),
                        reg,
                        started: SystemTime::now(),
                        heard: now,
                        deadline: automaton_engine::later(now, self.sessions.timeout),
                        attached: Some(Attachment { generation, tx }),
                        awaiting: false,
                    },
                );
                Joined {
                    id: id.clone(),
                    name: name.clone(),
                    generation,
                    granted: pb::SessionGranted {
                        session_id: id.to_string(),
                        heartbeat_interval: Some(crate::wire::duration(self.sessions.heartbeat)),
                        session_timeout: Some(crate::wire::duration(self.sessions.timeout)),
                        resumed: false,
                        kept: vec![],
                        lost: listed,
                        draining: inner.drained.contains(&name),
                        name: name.to_string(),
                    },
                    adopted: Vec::new(),
                    run_lost: Vec::new(),
                }
            }
        };
        if let Some(old) = replaced {
            self.end_session(&old, LeaseEnd::SessionReplaced).await?;
        }
        let (kind, detail) = if joined.granted.resumed {
            (
                EventKind::WorkerResumed,
                format!(
                    "session {} resumed with {} lease(s); {} lost",
                    joined.id,
                    joined.granted.kept.len(),
                    joined.granted.lost.len()
                ),
            )
        } else {
            (EventKind::WorkerJoined, self.describe(&joined.id))
        };
        self.engine.emit(kind, "", name.as_str(), 0, detail);
        Ok(joined)
    }

    /// One line for the `worker_joined` event: host, GPUs, budget.
    fn describe(&self, id: &str) -> String {
        let inner = self.sessions.inner();
        let Some(s) = inner.by_id.get(id) else {
            return String::new();
        };
        let gpus: Vec<String> = s
            .reg
            .gpus
            .iter()
            .map(|g| format!("{} {:.0} GiB", g.name, g.total_bytes as f64 / GIB))
            .collect();
        let budget = s.reg.budget.as_ref().map_or("no budget".to_string(), |b| {
            format!("max peak context {} tokens", b.max_peak_context_kb)
        });
        format!(
            "host {}; GPUs: {}{}; {budget}",
            s.reg.host,
            if gpus.is_empty() {
                "none".to_string()
            } else {
                gpus.join(", ")
            },
            if s.reg.simulated { " (simulated)" } else { "" }
        )
    }

    /// A heartbeat on stream `generation` of session `id`.
    pub(crate) fn heartbeat(&self, id: &str, generation: u64) -> Result<(), Status> {
        // An ack promises the session (and so its leases) lives on: only from a leader.
        self.engine.leading().map_err(crate::status)?;
        self.sessions.heard(id, generation)
    }

    /// The worker said goodbye: its session ends now, its leases are released.
    pub(crate) async fn deregister(&self, id: &str, generation: u64) -> Result<(), Error> {
        let ours = {
            let inner = self.sessions.inner();
            inner.by_id.get(id).is_some_and(|s| {
                s.attached
                    .as_ref()
                    .is_some_and(|a| a.generation == generation)
            })
        };
        if ours {
            self.end_session(id, LeaseEnd::Released).await?;
        }
        Ok(())
    }

    /// Ends every session silent past its deadline (the sweeper calls this).
    pub fn expire_sessions(&self) -> usize {
        let overdue = self.sessions.overdue(Instant::now());
        let n = overdue.len();
        if n == 0 {
            return 0;
        }
        let Some(me) = self.me.upgrade() else {
            return 0;
        };
        let spawn = tokio::runtime::Handle::try_current();
        for id in overdue {
            let me = me.clone();
            match &spawn {
                Ok(rt) => {
                    rt.spawn(async move {
                        if let Err(e) = me.end_session(&id, LeaseEnd::SessionExpired).await {
                            tracing::warn!(session = %id, error = %e, "cannot end an expired session");
                        }
                    });
                }
                Err(_) => return 0,
            }
        }
        n
    }

    /// Ends session `id` and every lease it owns, with `reason` (`session_expired`,
    /// `session_replaced`, `released`). The leases are marked ending and their ends queued
    /// under the table's lock in one step; they are removed and announced once durable.
    pub(crate) async fn end_session(&self, id: &str, reason: LeaseEnd) -> Result<(), Error> {
        let now = Instant::now();
        let (ending, commit, gone) = {
            let mut table = self.engine.table();
            let mut inner = self.sessions.inner();
            let Some(mut s) = inner.by_id.remove(id) else {
                return Ok(());
            };
            // A session that was expired is only ended if it is still overdue: a heartbeat
            // may have come in between the sweep and here.
            if reason == LeaseEnd::SessionExpired && s.deadline > now {
                inner.by_id.insert(s.id.clone(), s);
                return Ok(());
            }
            if inner.by_name.get(&s.name) == Some(&s.id) {
                inner.by_name.remove(&s.name);
            }
            if let Some(a) = s.attached.take() {
                let why = match reason {
                    LeaseEnd::SessionExpired => Status::not_found(format!(
                        "session {} expired: silent for more than {}; its leases have ended: register again",
                        s.id,
                        humantime::format_duration(self.sessions.timeout)
                    )),
                    LeaseEnd::SessionReplaced => Status::aborted(format!(
                        "session {} was replaced by another worker named '{}' (--replace)",
                        s.id, s.name
                    )),
                    _ => Status::ok("deregistered"),
                };
                if reason != LeaseEnd::Released {
                    let _ = a.tx.send(Push::End(why));
                }
            }
            let ending = table.mark_session_ending(id, now);
            let commit = if ending.is_empty() {
                None
            } else {
                Some(
                    self.engine
                        .log()
                        .ends(&mut ending.iter().map(|l| l.lease_id.as_str()))
                        .map_err(Error::Unavailable)?,
                )
            };
            let gone = Gone {
                name: s.name.clone(),
                reg: std::mem::take(&mut s.reg),
                started: s.started,
                heard: s.heard,
            };
            (ending, commit, gone)
        };
        let name = gone.name.clone();
        let silent = now.saturating_duration_since(gone.heard);
        let n = ending.len();
        if reason != LeaseEnd::Released {
            let mut inner = self.sessions.inner();
            if inner.gone.len() >= LOST_KEPT {
                inner.gone.pop_front();
            }
            inner.gone.push_back(gone);
        }
        if let Some(commit) = commit {
            let logged = commit.await;
            if let Err(e) = logged {
                return Err(Error::Unavailable(e));
            }
            for l in &ending {
                self.engine.table().remove_lease(&l.task, &l.lease_id);
                self.engine.after_end(l, reason);
            }
        }
        let (kind, detail) = match reason {
            LeaseEnd::SessionExpired => (
                EventKind::WorkerLost,
                format!(
                    "session {id} silent for {:.1}s (timeout {}): {n} lease(s) ended (session_expired)",
                    silent.as_secs_f64(),
                    humantime::format_duration(self.sessions.timeout)
                ),
            ),
            LeaseEnd::SessionReplaced => (
                EventKind::WorkerLost,
                format!("session {id} replaced: {n} lease(s) ended (session_replaced)"),
            ),
            _ => (
                EventKind::WorkerLeft,
                format!("session {id} deregistered: {n} lease(s) released"),
            ),
        };
        tracing::info!(worker = %name, session = %id, leases = n, reason = reason.name(), "worker session ended");
        self.engine.emit(kind, "", name.as_str(), 0, detail);
        // Its runs end with it: whatever ran there is gone or unheard of.
        self.end_runs_of(name.as_str(), reason, &ending).await;
        Ok(())
    }

    /// Stops (or, with `undo`, resumes) new work for worker `name`; it stays drained across
    /// reconnects until undone.
    pub(crate) fn drain(&self, name: &AgentId, undo: bool) -> Result<pb::WorkerInfo, Error> {
        let id = {
            let mut inner = self.sessions.inner();
            let id = inner.by_name.get(name).cloned();
            if id.is_none() && !inner.gone.iter().any(|g| &g.name == name) {
                return Err(Error::Refused(format!(
                    "no worker named '{name}': see automaton workers"
                )));
            }
            if undo {
                inner.drained.remove(name);
            } else {
                inner.drained.insert(name.clone());
            }
            id
        };
        if let Some(id) = &id {
            self.sessions.push(
                id,
                pb::coordinator_message::Msg::Drain(pb::Drain { draining: !undo }),
            );
        }
        self.engine.emit(
            if undo {
                EventKind::WorkerUndrained
            } else {
                EventKind::WorkerDrained
            },
            "",
            name.as_str(),
            0,
            if undo {
                "takes new work again".into()
            } else {
                "takes no new work".into()
            },
        );
        self.workers(true, None)
            .into_iter()
            .find(|w| w.name == name.as_str())
            .ok_or_else(|| Error::Internal("the drained worker vanished".into()))
    }

    /// Every known worker: live ones first (by name), then the lost. `secrets`: show
    /// session ids (operators); `me`: the caller's own name (it sees its own).
    pub(crate) fn workers(&self, secrets: bool, me: Option<&str>) -> Vec<pb::WorkerInfo> {
        let now = Instant::now();
        let table = self.engine.table();
        let inner = self.sessions.inner();
        let mut out: Vec<pb::WorkerInfo> = inner
            .by_id
            .values()
            .map(|s| {
                let leases: Vec<pb::WorkerLease> = table
                    .of_session(&s.id, now)
                    .into_iter()
                    .map(|l| pb::WorkerLease {
                        task: l.task.to_string(),
                        phase: l.state.to_string(),
                        token: l.token,
                    })
                    .collect();
                let drained = inner.drained.contains(&s.name);
                let state = if drained {
                    WorkerState::Draining
                } else if s.awaiting {
                    WorkerState::Reconnecting
                } else if leases
                    .len()
                    .max(self.work.unfinished_of(s.name.as_str()).len())
                    >= s.reg.capacity.max(1) as usize
                {
                    WorkerState::Busy
                } else {
                    WorkerState::Idle
                };
                let shown = secrets || me == Some(s.name.as_str());
                let mut runs: Vec<pb::Run> = table
                    .of_session(&s.id, now)
                    .into_iter()
                    .filter_map(|l| self.work.run_of(&l.task, l.token))
                    .collect();
                // A run that has not stopped is its worker's, lease or not (one stopping after
                // its lease was released, say).
                for (_, r) in self.work.unfinished_of(s.name.as_str()) {
                    if !runs.iter().any(|k| k.token == r.token) {
                        runs.push(r);
                    }
                }
                let mut w = info(
                    &s.reg,
                    state,
                    leases,
                    now.saturating_duration_since(s.heard),
                    s.started,
                )
                .with_session(shown.then(|| s.id.to_string()));
                w.runs = runs;
                w
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        let live: HashSet<String> = out.iter().map(|w| w.name.clone()).collect();
        let mut lost: Vec<pb::WorkerInfo> = inner
            .gone
            .iter()
            .rev()
            .filter(|g| !live.contains(g.name.as_str()))
            .filter({
                let mut seen = HashSet::new();
                move |g| seen.insert(g.name.clone())
            })
            .map(|g| {
                let mut w = info(
                    &g.reg,
                    WorkerState::Lost,
                    vec![],
                    now.saturating_duration_since(g.heard),
                    g.started,
                );
                w.name = g.name.to_string();
                w
            })
            .collect();
        lost.sort_by(|a, b| a.name.cmp(&b.name));
        out.extend(lost);
        out
    }

    /// The live sessions (for metrics and tests).
    pub fn sessions_live(&self) -> usize {
        self.sessions.len()
    }

    /// The worker whose live session is `id`.
    pub(crate) fn session_name(&self, id: &str) -> Option<AgentId> {
        self.sessions.name_of(id)
    }
}

trait WithSession {
    fn with_session(self, id: Option<String>) -> Self;
}

impl WithSession for pb::WorkerInfo {
    fn with_session(mut self, id: Option<String>) -> Self {
        self.session_id = id.unwrap_or_default();
        self
    }
}

fn info(
    reg: &pb::Register,
    state: WorkerState,
    leases: Vec<pb::WorkerLease>,
    age: Duration,
    started: SystemTime,
) -> pb::WorkerInfo {
    pb::WorkerInfo {
        name: reg.name.clone(),
        host: reg.host.clone(),
        gpus: reg.gpus.clone(),
        budget: reg.budget.clone(),
        capacity: reg.capacity,
        version: reg.version.clone(),
        simulated: reg.simulated,
        state: state.name().into(),
        worker_state: pb::WorkerState::from(state) as i32,
        leases,
        heartbeat_age: Some(crate::wire::duration(age)),
        since: Some(crate::wire::timestamp(started)),
        session_id: String::new(),
        ram_bytes: reg.ram_bytes,
        cpus: reg.cpus,
        runs: vec![],
    }
}
