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

pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// Lost workers remembered for `ListWorkers` (oldest forgotten first).
pub(crate) const LOST_KEPT: usize = 1024;
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
pub(crate) struct Attachment {
    pub(crate) generation: u64,
    pub(crate) tx: Outbox,
}

pub(crate) struct Session {
    pub(crate) id: Arc<str>,
    pub(crate) name: AgentId,
    pub(crate) reg: pb::Register,
    pub(crate) started: SystemTime,
    pub(crate) heard: Instant,
    pub(crate) deadline: Instant,
    pub(crate) attached: Option<Attachment>,
    /// Rebuilt at start from the log, its worker not back yet.
    pub(crate) awaiting: bool,
}

/// A worker whose session ended, remembered for operators.
pub(crate) struct Gone {
    pub(crate) name: AgentId,
    pub(crate) reg: pb::Register,
    pub(crate) started: SystemTime,
    pub(crate) heard: Instant,
}

#[derive(Default)]
pub(crate) struct Inner {
    pub(crate) by_id: HashMap<Arc<str>, Session>,
    pub(crate) by_name: HashMap<AgentId, Arc<str>>,
    pub(crate) gone: VecDeque<Gone>,
    pub(crate) drained: HashSet<AgentId>,
}

pub(crate) struct Sessions {
    inner: Mutex<Inner>,
    pub(crate) timeout: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) generation: AtomicU64,
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
    pub adopted: Vec<(Live, automaton_workflow::RunState)>,
    pub run_lost: Vec<(Live, automaton_backend::Commit)>,
}

/// Who opened a session stream: the name a worker token is bound to, or none (an operator,
/// or no tokens configured) — then the register names the worker.
pub(crate) type BoundName<'a> = Option<&'a str>;

pub(crate) fn held(l: &Live) -> pb::HeldLease {
    pb::HeldLease {
        lease_id: l.lease_id.clone(),
        token: l.token,
    }
}

pub(crate) fn too_long(what: &str, s: &str) -> Option<Error> {
    (s.len() > MAX_TEXT).then(|| {
        Error::Invalid(format!(
            "{what} '{}' is longer than {MAX_TEXT} bytes",
            automaton_workflow::excerpt(s)
        ))
    })
}

/// Checks a registration's shape; returns the worker's name.
pub(crate) fn check_register(bound: BoundName<'_>, r: &mut pb::Register) -> Result<AgentId, Error> {
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

    pub(crate) fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn new_id(&self) -> Arc<str> {
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
    pub(crate) fn tell(&self, l: &Live, reason: automaton_workflow::LeaseEnd) {
        if let Some(s) = &l.session {
            self.push(
                s,
                pb::coordinator_message::Msg::Lost(pb::LeaseLost {
                    task: l.task.to_string(),
                    token: l.token,
                    reason: reason.name().into(),
                    end: pb::LeaseEnd::from(reason) as i32,
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
    pub(crate) fn overdue(&self, now: Instant) -> Vec<Arc<str>> {
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

    /// The names of the live workers that take work (busy or not; not drained).
    pub(crate) fn working_names(&self) -> Vec<AgentId> {
        let inner = self.inner();
        inner
            .by_id
            .values()
            .filter(|s| s.reg.capacity > 0 && !s.awaiting && !inner.drained.contains(&s.name))
            .map(|s| s.name.clone())
            .collect()
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
pub(crate) fn budget_of(reg: &pb::Register) -> u64 {
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
