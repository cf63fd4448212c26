//! Worker sessions: who is connected, with what, and what happens the moment one goes
//! silent.
//!
//! A worker holds one session (one `Workers.Session` stream). Its heartbeats keep the session
//! alive, one small message per interval however many leases it holds (Chubby's session
//! KeepAlive); a lease granted in the session is bounded by its own TTL as any other, and ends
//! at once when the session dies (ZooKeeper's ephemeral nodes): silent past the timeout
//! (`session_expired`), replaced (`session_replaced`) or deregistered (`released`). Those ends
//! go through the lease log like every other end, and are announced only once durable.
//!
//! Sessions live in memory. What must survive a restart is which leases a session owns: the
//! grant records name it, so a start rebuilds each session that owns a live lease as
//! *awaiting* its worker for the grace period. The worker resumes it (same id, its leases
//! kept) or, if it never comes, its leases end as if it had gone silent. A resume also holds
//! the session's leases against the runs its worker reports: adopted, or ended `run_lost`
//! (`dispatch.rs`, `Coordinator::resumed_runs`).
//!
//! Lock order: the lease table, then the sessions.

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use automaton_proto::v1 as pb;
use automaton_workflow::AgentId;
use tokio::sync::mpsc;
use tonic::Status;

use automaton_engine::{Error, Live};

use crate::state::Coordinator;

/// Lost workers remembered for `ListWorkers` (oldest forgotten first).
const LOST_KEPT: usize = 1024;
/// Limits on what a registration may carry (it is kept in memory for every session).
const MAX_TEXT: usize = 256;
const MAX_GPUS: usize = 64;
const MAX_CAPACITY: u32 = 1024;

/// What the coordinator pushes on a session's stream.
#[derive(Debug)]
pub enum Push {
    Msg(Box<pb::CoordinatorMessage>),
    /// End the stream with this status.
    End(Status),
}

pub(crate) type Outbox = mpsc::UnboundedSender<Push>;

/// The stream a session is attached to, by generation: a stream that ended after another
/// took its place must not detach the newer one.
struct Attachment {
    generation: u64,
    tx: Outbox,
}

struct Session {
    id: Arc<str>,
    name: AgentId,
    reg: pb::Register,
    started: SystemTime,
    heard: Instant,
    deadline: Instant,
    attached: Option<Attachment>,
    /// Rebuilt at start from the log, its worker not back yet.
    awaiting: bool,
}

/// A worker whose session ended, remembered for operators.
struct Gone {
    name: AgentId,
    reg: pb::Register,
    started: SystemTime,
    heard: Instant,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<Arc<str>, Session>,
    by_name: HashMap<AgentId, Arc<str>>,
    gone: VecDeque<Gone>,
    drained: HashSet<AgentId>,
}

pub(crate) struct Sessions {
    inner: Mutex<Inner>,
    pub(crate) timeout: Duration,
    pub(crate) heartbeat: Duration,
    generation: AtomicU64,
    ids: std::collections::hash_map::RandomState,
    counter: AtomicU64,
}

/// Whether `s` can be a session id (it is written into the lease log).
pub(crate) use automaton_backend::valid_session_id as valid_id;

/// What a register hands back.
pub(crate) struct Joined {
    pub id: Arc<str>,
    pub name: AgentId,
    pub generation: u64,
    pub granted: pb::SessionGranted,
    /// A resume's findings for [`Coordinator::resumed_runs`], once `granted` is sent: the
    /// runs reported under kept leases, and the leases whose runs were lost (ends queued).
    pub adopted: Vec<(Live, String)>,
    pub run_lost: Vec<(Live, automaton_backend::Commit)>,
}

/// Who opened a session stream: the name a worker token is bound to, or none (an operator,
/// or no tokens configured) — then the register names the worker.
pub(crate) type BoundName<'a> = Option<&'a str>;

fn held(l: &Live) -> pb::HeldLease {
    pb::HeldLease {
        lease_id: l.lease_id.clone(),
        token: l.token,
    }
}

fn too_long(what: &str, s: &str) -> Option<Error> {
    (s.len() > MAX_TEXT).then(|| {
        Error::Invalid(format!(
            "{what} '{}' is longer than {MAX_TEXT} bytes",
            automaton_workflow::excerpt(s)
        ))
    })
}

/// Checks a registration's shape; returns the worker's name.
fn check_register(bound: BoundName<'_>, r: &mut pb::Register) -> Result<AgentId, Error> {
    let name = match bound {
        Some(b) if r.name.is_empty() || r.name == b => b.to_string(),
        Some(b) => {
            return Err(Error::PermissionDenied(format!(
                "this worker token is bound to '{b}': register as '{b}' (or leave the name empty), not as '{}'",
                automaton_workflow::excerpt(&r.name)
            )));
        }
        None if r.name.is_empty() => {
            return Err(Error::Invalid(
                "a register must name the worker (--name NAME)".into(),
            ));
        }
        None => r.name.clone(),
    };
    let name: AgentId = name
        .parse()
        .map_err(|e: automaton_workflow::NameError| Error::Invalid(format!("worker name: {e}")))?;
    r.name = name.to_string();
    for (what, s) in [("host", &r.host), ("version", &r.version)] {
        if let Some(e) = too_long(what, s) {
            return Err(e);
        }
    }
    if r.gpus.len() > MAX_GPUS {
        return Err(Error::Invalid(format!(
            "a register lists {} GPUs: at most {MAX_GPUS}",
            r.gpus.len()
        )));
    }
    for g in &r.gpus {
        for (what, s) in [
            ("GPU name", &g.name),
            ("GPU uuid", &g.uuid),
            ("driver", &g.driver),
        ] {
            if let Some(e) = too_long(what, s) {
                return Err(e);
            }
        }
        if g.free_bytes > g.total_bytes {
            return Err(Error::Invalid(format!(
                "GPU {} reports more free memory ({} bytes) than it has ({} bytes)",
                g.index, g.free_bytes, g.total_bytes
            )));
        }
    }
    if let Some(b) = &r.budget {
        for (what, s) in [
            ("budget source", &b.source),
            ("context source", &b.context_source),
        ] {
            if s.len() > 4 * MAX_TEXT {
                return Err(Error::Invalid(format!(
                    "{what} is longer than {} bytes",
                    4 * MAX_TEXT
                )));
            }
        }
        if !(0.0..1.0).contains(&b.headroom) {
            return Err(Error::Invalid(format!(
                "budget headroom {} is outside [0, 1): send a fraction such as 0.25",
                b.headroom
            )));
        }
    }
    if r.capacity > MAX_CAPACITY {
        return Err(Error::Invalid(format!(
            "capacity {} is above {MAX_CAPACITY}",
            r.capacity
        )));
    }
    if r.leases.len() > MAX_CAPACITY as usize * 4 {
        return Err(Error::Invalid(format!(
            "a register lists {} held leases: at most {}",
            r.leases.len(),
            MAX_CAPACITY * 4
        )));
    }
    if r.runs.len() > MAX_CAPACITY as usize * 4 {
        return Err(Error::Invalid(format!(
            "a register lists {} runs: at most {}",
            r.runs.len(),
            MAX_CAPACITY * 4
        )));
    }
    if !r.resume_session_id.is_empty() && !valid_id(&r.resume_session_id) {
        return Err(Error::Invalid(format!(
            "'{}' is not a session id: send the session_id a SessionGranted returned, or none",
            automaton_workflow::excerpt(&r.resume_session_id)
        )));
    }
    Ok(name)
}

impl Sessions {
    pub(crate) fn new(timeout: Duration, heartbeat: Duration) -> Sessions {
        Sessions {
            inner: Mutex::default(),
            timeout,
            heartbeat,
            generation: AtomicU64::new(0),
            ids: std::collections::hash_map::RandomState::new(),
            counter: AtomicU64::new(0),
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn new_id(&self) -> Arc<str> {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let mut a = self.ids.build_hasher();
        a.write_u128(nanos);
        a.write_u64(n);
        let mut b = self.ids.build_hasher();
        b.write_u64(a.finish());
        b.write_u32(std::process::id());
        Arc::from(format!("s-{:016x}{:016x}", a.finish(), b.finish()))
    }

    /// A session rebuilt at start: it owns live leases; its worker has until `deadline`.
    pub(crate) fn recover(&self, id: &Arc<str>, name: &AgentId, deadline: Instant) {
        let mut inner = self.inner();
        if inner.by_id.contains_key(id) {
            return;
        }
        inner.by_name.insert(name.clone(), id.clone());
        inner.by_id.insert(
            id.clone(),
            Session {
                id: id.clone(),
                name: name.clone(),
                reg: pb::Register {
                    name: name.to_string(),
                    capacity: 1,
                    ..Default::default()
                },
                started: SystemTime::now(),
                heard: Instant::now(),
                deadline,
                attached: None,
                awaiting: true,
            },
        );
    }

    /// The session a claim by `agent` goes into: `requested`, or (empty) `agent`'s live
    /// session. Checked under the lease table's lock, so a session cannot die between this
    /// check and the grant's insertion without the grant being ended with it.
    pub(crate) fn for_claim(&self, agent: &AgentId, requested: &str) -> Result<Arc<str>, Error> {
        let inner = self.inner();
        let id = if requested.is_empty() {
            inner.by_name.get(agent).cloned().ok_or_else(|| {
                Error::Refused(format!(
                    "worker '{agent}' has no live session: start automaton-worker (it registers), then claim"
                ))
            })?
        } else {
            Arc::from(requested)
        };
        let s = inner.by_id.get(&id).ok_or_else(|| {
            Error::Refused(format!(
                "session '{}' has ended: the worker must register again",
                automaton_workflow::excerpt(&id)
            ))
        })?;
        if &s.name != agent {
            return Err(Error::PermissionDenied(format!(
                "session '{}' belongs to worker '{}', not '{agent}'",
                s.id, s.name
            )));
        }
        if inner.drained.contains(agent) {
            return Err(Error::Refused(format!(
                "worker '{agent}' is draining: it takes no new work (an operator can undo it: automaton workers undrain {agent})"
            )));
        }
        Ok(s.id.clone())
    }

    /// Tells the session that owns `l` that it ended (the engine's `after_end`, through
    /// `Hooks::lease_ended`).
    pub(crate) fn tell(&self, l: &Live, reason: &'static str) {
        if let Some(s) = &l.session {
            self.push(
                s,
                pb::coordinator_message::Msg::Lost(pb::LeaseLost {
                    task: l.task.to_string(),
                    token: l.token,
                    reason: reason.into(),
                }),
            );
        }
    }

    /// The name of a live session (for a claim an operator makes in it).
    pub(crate) fn name_of(&self, id: &str) -> Option<AgentId> {
        self.inner().by_id.get(id).map(|s| s.name.clone())
    }

    /// Records a heartbeat of the stream `generation` of session `id`.
    pub(crate) fn heard(&self, id: &str, generation: u64) -> Result<(), Status> {
        let now = Instant::now();
        let mut inner = self.inner();
        match inner.by_id.get_mut(id) {
            Some(s)
                if s.attached
                    .as_ref()
                    .is_some_and(|a| a.generation == generation) =>
            {
                s.heard = now;
                s.deadline = automaton_engine::later(now, self.timeout);
                Ok(())
            }
            Some(_) => Err(Status::aborted(
                "this session was resumed on another stream: this stream is closed",
            )),
            None => Err(Status::not_found(
                "this session has ended (silent past its timeout, replaced, or deregistered): register again",
            )),
        }
    }

    /// The stream `generation` of session `id` ended; the session lives on until its
    /// deadline, for the worker to resume.
    pub(crate) fn detach(&self, id: &str, generation: u64) {
        let mut inner = self.inner();
        if let Some(s) = inner.by_id.get_mut(id)
            && s.attached
                .as_ref()
                .is_some_and(|a| a.generation == generation)
        {
            s.attached = None;
        }
    }

    /// Pushes `msg` to session `id`'s stream, if attached.
    pub(crate) fn push(&self, id: &str, msg: pb::coordinator_message::Msg) {
        let inner = self.inner();
        if let Some(a) = inner.by_id.get(id).and_then(|s| s.attached.as_ref()) {
            let _ = a.tx.send(Push::Msg(Box::new(pb::CoordinatorMessage {
                msg: Some(msg),
            })));
        }
    }

    /// Sessions past their deadline.
    fn overdue(&self, now: Instant) -> Vec<Arc<str>> {
        self.inner()
            .by_id
            .values()
            .filter(|s| s.deadline <= now)
            .map(|s| s.id.clone())
            .collect()
    }

    /// Ends every stream (shutdown): the workers reconnect to the next start and resume.
    pub(crate) fn stop_all(&self) {
        let mut inner = self.inner();
        for s in inner.by_id.values_mut() {
            if let Some(a) = s.attached.take() {
                let _ = a.tx.send(Push::End(Status::unavailable(
                    "the coordinator is stopping: reconnect and resume this session",
                )));
            }
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.inner().by_id.len()
    }

    /// The sessions that can take work now: attached, not awaiting their worker, not
    /// drained, with fewer leases than their capacity. Call under the table's lock.
    pub(crate) fn slots(
        &self,
        table: &automaton_engine::Table,
        now: Instant,
    ) -> Vec<crate::dispatch::Slot> {
        let inner = self.inner();
        inner
            .by_id
            .values()
            .filter(|s| s.attached.is_some() && !s.awaiting && !inner.drained.contains(&s.name))
            .filter_map(|s| {
                let held = table.of_session(&s.id, now).len();
                // Capacity 0: a worker without an agent, offered no work.
                let cap = s.reg.capacity;
                (held < cap as usize).then(|| crate::dispatch::Slot {
                    session: s.id.clone(),
                    name: s.name.clone(),
                    free: cap as usize - held,
                    capacity: cap,
                    budget: budget_of(&s.reg),
                    gpu: gpu_label(&s.reg),
                })
            })
            .collect()
    }

    /// The VRAM figures a sub-task needing `need` tokens is written against: the
    /// best-fitting live worker's (the smallest budget that holds it), else the largest's.
    pub(crate) fn vram_config_for(&self, need: u64) -> automaton_workflow::VramConfig {
        let inner = self.inner();
        let mut live: Vec<&Session> = inner
            .by_id
            .values()
            .filter(|s| s.reg.capacity > 0 && !s.awaiting)
            .collect();
        live.sort_by_key(|s| budget_of(&s.reg));
        let pick = live
            .iter()
            .find(|s| budget_of(&s.reg) >= need)
            .or(live.last());
        let Some(s) = pick else {
            return automaton_workflow::VramConfig {
                auto_detect: true,
                target_kb: 0,
                headroom: 0.25,
                max_peak_context_kb: 0,
                gpu_vram_gb: None,
                ram_gb: 0.0,
                model_context_kb: None,
                framework_overhead_tokens: 0,
            };
        };
        let b = s.reg.budget.clone().unwrap_or_default();
        let vram: u64 = s.reg.gpus.iter().map(|g| g.total_bytes).sum();
        automaton_workflow::VramConfig {
            auto_detect: !b.source.contains("config.md"),
            target_kb: b.recommended_kb / 1000,
            headroom: b.headroom,
            max_peak_context_kb: b.max_peak_context_kb / 1000,
            gpu_vram_gb: (vram > 0).then(|| vram as f64 / GIB),
            ram_gb: s.reg.ram_bytes as f64 / GIB,
            model_context_kb: (b.model_context_kb > 0).then_some(b.model_context_kb / 1000),
            framework_overhead_tokens: b.framework_overhead_tokens,
        }
    }

    /// The largest budget among the live workers that take work (busy or not): its tokens,
    /// the worker and its GPU memory.
    pub(crate) fn largest_budget(&self) -> Option<(u64, AgentId, String)> {
        let inner = self.inner();
        inner
            .by_id
            .values()
            .filter(|s| s.reg.capacity > 0 && !s.awaiting)
            .map(|s| (budget_of(&s.reg), s.name.clone(), gpu_label(&s.reg)))
            .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(&a.1)))
    }
}

/// A worker's budget: the largest sub-task (estimated peak context, tokens) it takes.
fn budget_of(reg: &pb::Register) -> u64 {
    reg.budget.as_ref().map_or(0, |b| b.max_peak_context_kb)
}

/// A worker's GPU memory for people, e.g. `24 GiB` (`no GPU` without one).
pub(crate) fn gpu_label(reg: &pb::Register) -> String {
    let total: u64 = reg.gpus.iter().map(|g| g.total_bytes).sum();
    if total == 0 {
        "no GPU".into()
    } else {
        format!("{:.0} GiB", total as f64 / GIB)
    }
}

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
        let mut adopted: Vec<(Live, String)> = Vec::new();
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
                        adopted.push((l, r.state.clone()));
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
                        heartbeat_interval: Some(crate::service::duration(self.sessions.heartbeat)),
                        session_timeout: Some(crate::service::duration(self.sessions.timeout)),
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
                        heartbeat_interval: Some(crate::service::duration(self.sessions.heartbeat)),
                        session_timeout: Some(crate::service::duration(self.sessions.timeout)),
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
            self.end_session(&old, "session_replaced").await?;
        }
        let (kind, detail) = if joined.granted.resumed {
            (
                "worker_resumed",
                format!(
                    "session {} resumed with {} lease(s); {} lost",
                    joined.id,
                    joined.granted.kept.len(),
                    joined.granted.lost.len()
                ),
            )
        } else {
            ("worker_joined", self.describe(&joined.id))
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
            self.end_session(id, "released").await?;
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
                        if let Err(e) = me.end_session(&id, "session_expired").await {
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
    pub(crate) async fn end_session(&self, id: &str, reason: &'static str) -> Result<(), Error> {
        let now = Instant::now();
        let (ending, commit, gone) = {
            let mut table = self.engine.table();
            let mut inner = self.sessions.inner();
            let Some(mut s) = inner.by_id.remove(id) else {
                return Ok(());
            };
            // A session that was expired is only ended if it is still overdue: a heartbeat
            // may have come in between the sweep and here.
            if reason == "session_expired" && s.deadline > now {
                inner.by_id.insert(s.id.clone(), s);
                return Ok(());
            }
            if inner.by_name.get(&s.name) == Some(&s.id) {
                inner.by_name.remove(&s.name);
            }
            if let Some(a) = s.attached.take() {
                let why = match reason {
                    "session_expired" => Status::not_found(format!(
                        "session {} expired: silent for more than {}; its leases have ended: register again",
                        s.id,
                        humantime::format_duration(self.sessions.timeout)
                    )),
                    "session_replaced" => Status::aborted(format!(
                        "session {} was replaced by another worker named '{}' (--replace)",
                        s.id, s.name
                    )),
                    _ => Status::ok("deregistered"),
                };
                if reason != "released" {
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
        if reason != "released" {
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
            "session_expired" => (
                "worker_lost",
                format!(
                    "session {id} silent for {:.1}s (timeout {}): {n} lease(s) ended (session_expired)",
                    silent.as_secs_f64(),
                    humantime::format_duration(self.sessions.timeout)
                ),
            ),
            "session_replaced" => (
                "worker_lost",
                format!("session {id} replaced: {n} lease(s) ended (session_replaced)"),
            ),
            _ => (
                "worker_left",
                format!("session {id} deregistered: {n} lease(s) released"),
            ),
        };
        tracing::info!(worker = %name, session = %id, leases = n, reason, "worker session ended");
        self.engine.emit(kind, "", name.as_str(), 0, detail);
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
                "worker_undrained"
            } else {
                "worker_drained"
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
                    "draining"
                } else if s.awaiting {
                    "reconnecting"
                } else if leases.len() >= s.reg.capacity.max(1) as usize {
                    "busy"
                } else {
                    "idle"
                };
                let shown = secrets || me == Some(s.name.as_str());
                let runs = table
                    .of_session(&s.id, now)
                    .into_iter()
                    .filter_map(|l| self.work.run_of(&l.task, l.token))
                    .collect();
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
                    "lost",
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

const GIB: f64 = (1u64 << 30) as f64;

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
    state: &str,
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
        state: state.into(),
        leases,
        heartbeat_age: Some(crate::service::duration(age)),
        since: Some(crate::service::timestamp(started)),
        session_id: String::new(),
        ram_bytes: reg.ram_bytes,
        cpus: reg.cpus,
        runs: vec![],
    }
}
