//! The history and its checker: a pure function over what the clients recorded (no clock, no
//! sockets), so each rule can be shown to fire on a hand-made history.
//!
//! Times are microseconds since the run began. A call's `start` is when its request was sent
//! and `end` when its answer (or error) arrived; the operation took effect, if at all,
//! somewhere in between.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use tonic::Code;

/// Microseconds since the run began.
pub type Us = u64;

/// Disjoint, sorted [from, to) intervals.
type Set = Vec<(Us, Us)>;

/// A lease as an answer named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    pub task: String,
    pub agent: String,
    pub lease_id: String,
    pub token: u64,
    pub ttl_ms: u64,
    /// The state it was granted for (empty when the answer did not say).
    pub state: String,
}

/// What a call presented or asked about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Claim {
        task: String,
        agent: String,
        ttl_ms: u64,
    },
    /// `probe`: sent right after a restart for a lease certainly live at the kill (rule 4).
    Renew {
        lease: LeaseInfo,
        probe: bool,
    },
    /// One lease named on a KeepAlive stream; `notice` when nothing was asked (a loss notice
    /// that arrived by itself: `start == end` == when it was read).
    KeepAlive {
        lease: LeaseInfo,
        notice: bool,
    },
    Release {
        lease: LeaseInfo,
    },
    /// A transition presenting `lease` (its agent, id and token).
    Transition {
        lease: LeaseInfo,
        target: String,
    },
    Get {
        task: String,
    },
    Approve {
        task: String,
    },
}

impl Op {
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Claim { .. } => "claim",
            Op::Renew { probe: false, .. } => "renew",
            Op::Renew { probe: true, .. } => "renew (post-restart probe)",
            Op::KeepAlive { notice: false, .. } => "keepalive",
            Op::KeepAlive { notice: true, .. } => "keepalive (unasked notice)",
            Op::Release { .. } => "release",
            Op::Transition { .. } => "transition",
            Op::Get { .. } => "get",
            Op::Approve { .. } => "approve",
        }
    }

    /// The lease a write presents.
    fn presented(&self) -> Option<&LeaseInfo> {
        match self {
            Op::Renew { lease, .. } | Op::Release { lease } | Op::Transition { lease, .. } => {
                Some(lease)
            }
            _ => None,
        }
    }
}

/// The answer to a call that succeeded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Claim, Renew, or a KeepAlive renewal: the lease is live.
    Lease {
        lease: LeaseInfo,
        renewed: bool,
    },
    /// GetTask: the state and the live lease, if any.
    Task {
        state: String,
        lease: Option<LeaseInfo>,
    },
    /// Release, or a transition (with the lease that ended with the phase).
    Ended {
        to: String,
        released: Option<LeaseInfo>,
    },
    Done,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Ok(Answer),
    /// A definite refusal: nothing changed.
    Refused(Code, String),
    /// A KeepAlive loss notice (`expired`, `released`, `transitioned`, `unknown`).
    Lost(String),
    /// Transport error, UNAVAILABLE, DEADLINE_EXCEEDED, cut off by a kill: a change may or may
    /// not have happened.
    Ambiguous(String),
}

impl Outcome {
    pub fn label(&self) -> String {
        match self {
            Outcome::Ok(_) => "ok".into(),
            Outcome::Refused(c, _) => format!("refused {c:?}"),
            Outcome::Lost(r) => format!("lost {r}"),
            Outcome::Ambiguous(_) => "ambiguous".into(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Call {
    pub client: usize,
    pub op: Op,
    pub start: Us,
    pub end: Us,
    pub outcome: Outcome,
    /// The client chose a lease it knew had ended (a deliberate stale write).
    pub stale: bool,
}

/// One `kill -9` and the restart after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restart {
    /// When the old process was certainly dead (SIGKILL sent and the process reaped): it may
    /// answer until then, never after.
    pub kill: Us,
    /// Just before the new process was spawned: it loads the log after this, and every lease it
    /// restores lives at least max(TTL, grace) from its load, so from `spawn` too.
    pub spawn: Us,
    /// When its `listening on` line was read.
    pub listening: Us,
}

#[derive(Debug, Clone, Default)]
pub struct History {
    pub calls: Vec<Call>,
    /// In time order.
    pub restarts: Vec<Restart>,
    pub grace_ms: u64,
}

#[derive(Debug, Clone)]
pub struct Violation {
    pub rule: u8,
    pub task: String,
    pub what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rule {} on {}: {}", self.rule, self.task, self.what)
    }
}

/// What the checker found: how many checks each rule made, and every violation.
#[derive(Debug, Clone, Default)]
pub struct Checked {
    /// Index 1..=5: checks made by that rule.
    pub checks: [u64; 6],
    pub violations: Vec<Violation>,
}

impl Checked {
    pub fn of_rule(&self, rule: u8) -> Vec<&Violation> {
        self.violations.iter().filter(|v| v.rule == rule).collect()
    }
}

/// Everything the history says about one lease id.
#[derive(Debug, Default)]
struct Facts {
    task: String,
    agent: String,
    token: u64,
    min_ttl_ms: u64,
    /// (send, answer, TTL in µs) of each acknowledged grant or renewal.
    live: Vec<(Us, Us, Us)>,
    /// Renewals that may or may not have happened (no answer), each of which would have set
    /// the deadline afresh: (send, the end of the process that may have done it, the TTL it
    /// would have set, `None` for the lease's own).
    maybe: Vec<(Us, Us, Option<Us>)>,
    /// The first send of a write that may end it (release, transition), done or ambiguous.
    end_sent: Option<Us>,
    /// Acknowledged ends: when, and how.
    ends: Vec<(Us, String)>,
    /// Answers that reported it live: (send, answer, call index).
    reports: Vec<(Us, Us, usize)>,
}

impl Facts {
    fn first_end(&self) -> Option<&(Us, String)> {
        self.ends.iter().min_by_key(|e| e.0)
    }
}

fn facts_of<'a>(all: &'a mut HashMap<String, Facts>, l: &LeaseInfo) -> &'a mut Facts {
    let f = all.entry(l.lease_id.clone()).or_insert_with(|| Facts {
        task: l.task.clone(),
        agent: l.agent.clone(),
        token: l.token,
        min_ttl_ms: u64::MAX,
        ..Facts::default()
    });
    if f.task.is_empty() {
        f.task = l.task.clone();
    }
    if f.agent.is_empty() {
        f.agent = l.agent.clone();
    }
    f
}

/// A Claim answered OK: (send, answer, lease).
struct ClaimAck<'a> {
    send: Us,
    answer: Us,
    lease: &'a LeaseInfo,
}

pub fn ms(us: Us) -> String {
    format!("{:.3}s", us as f64 / 1e6)
}

/// Collects the facts of every lease, the superseding grants included.
fn collect(h: &History) -> (HashMap<String, Facts>, BTreeMap<&str, Vec<ClaimAck<'_>>>) {
    let mut all: HashMap<String, Facts> = HashMap::new();
    let mut claims: BTreeMap<&str, Vec<ClaimAck>> = BTreeMap::new();
    // The end of the process that may have answered a request sent at `t`: the next kill.
    let life_end = |t: Us| {
        h.restarts
            .iter()
            .map(|r| r.kill)
            .find(|&k| k > t)
            .unwrap_or(Us::MAX)
    };
    let mut unanswered_claims: Vec<(&str, &str, Us, Us)> = Vec::new();
    for (i, c) in h.calls.iter().enumerate() {
        match (&c.op, &c.outcome) {
            (Op::Renew { lease, .. } | Op::KeepAlive { lease, .. }, Outcome::Ambiguous(_)) => {
                facts_of(&mut all, lease)
                    .maybe
                    .push((c.start, life_end(c.start), None));
            }
            (
                Op::Claim {
                    task,
                    agent,
                    ttl_ms,
                },
                Outcome::Ambiguous(_),
            ) => unanswered_claims.push((task, agent, c.start, ttl_ms * 1000)),
            _ => {}
        }
        // A write that may end the lease it presents: from its send on, it may be gone.
        if let Op::Release { lease } | Op::Transition { lease, .. } = &c.op
            && matches!(c.outcome, Outcome::Ok(_) | Outcome::Ambiguous(_))
        {
            let f = facts_of(&mut all, lease);
            f.end_sent = Some(f.end_sent.map_or(c.start, |e| e.min(c.start)));
        }
        match (&c.op, &c.outcome) {
            (
                Op::Claim { .. } | Op::Renew { .. } | Op::KeepAlive { .. },
                Outcome::Ok(Answer::Lease { lease, .. }),
            ) => {
                let known = match &c.op {
                    Op::Renew { lease, .. } | Op::KeepAlive { lease, .. } => Some(lease),
                    _ => None,
                };
                // A KeepAlive answer names only the id, token and TTL: take the rest from
                // what was asked.
                let mut l = lease.clone();
                if let Some(k) = known {
                    l.task = k.task.clone();
                    l.agent = k.agent.clone();
                }
                let f = facts_of(&mut all, &l);
                f.min_ttl_ms = f.min_ttl_ms.min(l.ttl_ms);
                f.live.push((c.start, c.end, l.ttl_ms * 1000));
                f.reports.push((c.start, c.end, i));
                if let Op::Claim { task, .. } = &c.op {
                    claims.entry(task.as_str()).or_default().push(ClaimAck {
                        send: c.start,
                        answer: c.end,
                        lease,
                    });
                }
            }
            (Op::Get { .. }, Outcome::Ok(Answer::Task { lease: Some(l), .. })) => {
                facts_of(&mut all, l).reports.push((c.start, c.end, i));
            }
            (Op::Release { lease }, Outcome::Ok(_)) => {
                facts_of(&mut all, lease)
                    .ends
                    .push((c.end, "released (Release ok)".into()));
            }
            (
                Op::Transition { target, .. },
                Outcome::Ok(Answer::Ended {
                    released: Some(l), ..
                }),
            ) => {
                facts_of(&mut all, l)
                    .ends
                    .push((c.end, format!("ended by a transition to {target}")));
            }
            (Op::Renew { lease, .. }, Outcome::Refused(Code::NotFound, _)) => {
                facts_of(&mut all, lease)
                    .ends
                    .push((c.end, "gone (Renew NOT_FOUND)".into()));
            }
            (Op::Release { lease }, Outcome::Refused(Code::NotFound, _)) => {
                facts_of(&mut all, lease)
                    .ends
                    .push((c.end, "gone (Release NOT_FOUND)".into()));
            }
            (Op::KeepAlive { lease, .. }, Outcome::Lost(reason)) => {
                facts_of(&mut all, lease)
                    .ends
                    .push((c.end, format!("lost ({reason}) on KeepAlive")));
            }
            _ => {}
        }
    }
    // A claim without an answer by a lease's holder may have renewed it with its own TTL.
    if !unanswered_claims.is_empty() {
        let mut by_holder: HashMap<(String, String), Vec<String>> = HashMap::new();
        for (id, f) in &all {
            by_holder
                .entry((f.task.clone(), f.agent.clone()))
                .or_default()
                .push(id.clone());
        }
        for (task, agent, send, ttl) in unanswered_claims {
            let key = (task.to_string(), agent.to_string());
            for id in by_holder.get(&key).into_iter().flatten() {
                if let Some(f) = all.get_mut(id) {
                    f.maybe.push((send, life_end(send), Some(ttl)));
                }
            }
        }
    }
    // Superseded: once a grant with a higher token on the task is acknowledged, every lease
    // with a lower token has ended.
    let mut by_task: HashMap<&str, Vec<(u64, Us, &str)>> = HashMap::new();
    for (task, acks) in &claims {
        for a in acks {
            by_task.entry(task).or_default().push((
                a.lease.token,
                a.answer,
                a.lease.lease_id.as_str(),
            ));
        }
    }
    for v in by_task.values_mut() {
        // Highest token first; a running minimum of answer times over higher tokens.
        v.sort_by_key(|x| std::cmp::Reverse(x.0));
    }
    for (id, f) in all.iter_mut() {
        let Some(v) = by_task.get(f.task.as_str()) else {
            continue;
        };
        // Only a grant acknowledged after this lease was: with the tokens out of order, which
        // of the two came first is rule 2's finding, not an end of this one.
        let known = f.reports.iter().map(|r| r.1).min().unwrap_or(Us::MAX);
        let mut first: Option<(Us, &str, u64)> = None;
        for &(token, at, other) in v {
            if token <= f.token {
                break;
            }
            if other != id && at > known && first.is_none_or(|(t, _, _)| at < t) {
                first = Some((at, other, token));
            }
        }
        if let Some((at, other, token)) = first {
            f.ends
                .push((at, format!("superseded by {other} (token {token})")));
        }
    }
    (all, claims)
}

/// Merges overlapping intervals (sorted by start).
fn merge(mut v: Vec<(Us, Us)>) -> Vec<(Us, Us)> {
    v.sort();
    let mut out: Vec<(Us, Us)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

fn contains(set: &[(Us, Us)], t: Us) -> bool {
    set.iter().any(|&(a, b)| a <= t && t < b)
}

fn covers(set: &[(Us, Us)], from: Us, to: Us) -> bool {
    set.iter().any(|&(a, b)| a <= from && to < b)
}

/// Every renewal that did or may have set the lease's deadline afresh: (send, latest time it
/// may have happened, the TTL it set).
fn resets(f: &Facts) -> Vec<(Us, Us, Us)> {
    let shortest = f
        .live
        .iter()
        .map(|r| r.2)
        .chain(f.maybe.iter().filter_map(|m| m.2))
        .min()
        .unwrap_or(0);
    f.live
        .iter()
        .copied()
        .chain(
            f.maybe
                .iter()
                .map(|&(s, e, t)| (s, e, t.unwrap_or(shortest))),
        )
        .collect()
}

/// [answer, send + TTL) of each acknowledged grant or renewal. A renewal sets the deadline to
/// its own time + the lease's TTL, and a Claim by the holder may set a shorter TTL: so an
/// interval is also cut where a renewal with a shorter TTL that may have come after it (one
/// answered, or possibly done, after it was sent) ends.
fn renewed_intervals(live: &[(Us, Us, Us)], resets: &[(Us, Us, Us)]) -> Vec<(Us, Us)> {
    let same_ttl = resets.windows(2).all(|w| w[0].2 == w[1].2);
    live.iter()
        .map(|&(send, answer, ttl)| {
            let mut until = send + ttl;
            if !same_ttl {
                for &(s, latest, t) in resets {
                    if latest > send && t < ttl {
                        until = until.min(s.max(send) + t);
                    }
                }
            }
            (answer, until)
        })
        .filter(|&(a, b)| a < b)
        .collect()
}

/// When the lease was certainly live: the union of its renewed intervals (above); at a kill
/// inside that set, also until the restart's spawn + max(TTL, grace) (or an earlier deadline
/// set by a renewal after the restart); all of it cut at the first send of a release or
/// transition presenting it.
fn certainly_live(f: &Facts, restarts: &[Restart], grace_ms: u64) -> Vec<(Us, Us)> {
    let resets = resets(f);
    let mut set = merge(renewed_intervals(&f.live, &resets));
    let cut = f.end_sent.unwrap_or(Us::MAX);
    let ttl = if f.min_ttl_ms == u64::MAX {
        0
    } else {
        f.min_ttl_ms
    };
    for r in restarts {
        if r.kill >= cut {
            break;
        }
        if contains(&set, r.kill) {
            // A renewal in the new process (done or maybe) resets the deadline to its time +
            // TTL, which may come before spawn + max(TTL, grace): an acknowledged one's own
            // interval takes over from there.
            let mut until = r.spawn + ttl.max(grace_ms) * 1000;
            for &(send, latest, t) in &resets {
                if latest > r.spawn {
                    until = until.min(send.max(r.spawn) + t);
                }
            }
            if until > r.kill {
                set.push((r.kill, until));
                set = merge(set);
            }
        }
    }
    set.into_iter()
        .filter(|&(a, _)| a < cut)
        .map(|(a, b)| (a, b.min(cut)))
        .collect()
}

/// The leases certainly live at `at` by the history so far (for the post-restart probes).
pub fn live_at(h: &History, at: Us) -> Vec<LeaseInfo> {
    let (all, _) = collect(h);
    let mut out: Vec<LeaseInfo> = all
        .iter()
        .filter(|(_, f)| f.ends.is_empty() && !f.task.is_empty())
        .filter(|(_, f)| contains(&certainly_live(f, &h.restarts, h.grace_ms), at))
        .map(|(id, f)| LeaseInfo {
            task: f.task.clone(),
            agent: f.agent.clone(),
            lease_id: id.clone(),
            token: f.token,
            ttl_ms: f.min_ttl_ms,
            state: String::new(),
        })
        .collect();
    out.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
    out
}

/// Checks the five rules over the whole history.
pub fn check(h: &History) -> Checked {
    let mut out = Checked::default();
    let (all, claims) = collect(h);
    let live: HashMap<&str, Vec<(Us, Us)>> = all
        .iter()
        .map(|(id, f)| (id.as_str(), certainly_live(f, &h.restarts, h.grace_ms)))
        .collect();
    rule1(&all, &live, &mut out);
    rule2(h, &claims, &mut out);
    rule3(h, &all, &mut out);
    rule4(h, &all, &live, &mut out);
    rule5(h, &all, &mut out);
    out
}

/// Rule 1: At no instant are two leases of one task certainly live.
fn rule1(all: &HashMap<String, Facts>, live: &HashMap<&str, Vec<(Us, Us)>>, out: &mut Checked) {
    let mut by_task: BTreeMap<&str, Vec<(Us, Us, &str)>> = BTreeMap::new();
    for (id, set) in live {
        let task = all[*id].task.as_str();
        for &(a, b) in set {
            by_task.entry(task).or_default().push((a, b, id));
        }
    }
    for (task, mut v) in by_task {
        v.sort();
        let mut reach: Option<(Us, &str)> = None;
        let mut seen = std::collections::HashSet::new();
        for (a, b, id) in v {
            out.checks[1] += 1;
            if let Some((end, other)) = reach
                && a < end
                && other != id
                && seen.insert((other, id))
            {
                let (x, y) = (&all[other], &all[id]);
                out.violations.push(Violation {
                    rule: 1,
                    task: task.to_string(),
                    what: format!(
                        "two leases certainly live at once over [{}, {}): {other} ({}, token {}) and {id} ({}, token {})",
                        ms(a),
                        ms(b.min(end)),
                        x.agent,
                        x.token,
                        y.agent,
                        y.token
                    ),
                });
            }
            if reach.is_none_or(|(end, _)| b > end) {
                reach = Some((b, id));
            }
        }
    }
}

/// The two highest-token acknowledged grants of different leases.
#[derive(Default)]
struct Top2<'a>([Option<&'a ClaimAck<'a>>; 2]);

impl<'a> Top2<'a> {
    fn insert(&mut self, x: &'a ClaimAck<'a>) {
        let higher = |t: Option<&ClaimAck>| t.is_none_or(|t| x.lease.token > t.lease.token);
        let same = |t: Option<&ClaimAck>| t.is_some_and(|t| t.lease.lease_id == x.lease.lease_id);
        let [t0, t1] = self.0;
        if same(t0) {
            if higher(t0) {
                self.0[0] = Some(x);
            }
        } else if same(t1) {
            if higher(t1) {
                self.0[1] = Some(x);
            }
            if higher(t0) {
                self.0 = [Some(x), t0];
            }
        } else if higher(t0) {
            self.0 = [Some(x), t0];
        } else if higher(t1) {
            self.0[1] = Some(x);
        }
    }
}

/// Rule 2: Tokens of successive acknowledged grants of a task strictly increase; no two leases of a
/// task share a token, and a lease keeps its token.
fn rule2(h: &History, claims: &BTreeMap<&str, Vec<ClaimAck<'_>>>, out: &mut Checked) {
    for (task, acks) in claims {
        let mut by_answer: Vec<&ClaimAck> = acks.iter().collect();
        by_answer.sort_by_key(|a| a.answer);
        let mut by_send: Vec<&ClaimAck> = acks.iter().collect();
        by_send.sort_by_key(|a| a.send);
        // The two highest-token grants (of different leases) answered before the current send.
        let mut top = Top2::default();
        let mut next = 0;
        for y in by_send {
            while next < by_answer.len() && by_answer[next].answer < y.send {
                top.insert(by_answer[next]);
                next += 1;
            }
            let x = top
                .0
                .iter()
                .flatten()
                .find(|x| x.lease.lease_id != y.lease.lease_id);
            out.checks[2] += 1;
            if let Some(x) = x
                && x.lease.token >= y.lease.token
            {
                out.violations.push(Violation {
                    rule: 2,
                    task: task.to_string(),
                    what: format!(
                        "token did not increase: {} ({}, token {}) was acknowledged at {}, then a Claim sent at {} answered {} ({}, token {}{})",
                        x.lease.lease_id,
                        x.lease.agent,
                        x.lease.token,
                        ms(x.answer),
                        ms(y.send),
                        y.lease.lease_id,
                        y.lease.agent,
                        y.lease.token,
                        if y.lease.token < x.lease.token {
                            ": an older lease is live again"
                        } else {
                            ""
                        }
                    ),
                });
            }
        }
    }
    // One token per lease, one lease per token, in every answer that names a lease.
    let mut token_of: HashMap<&str, (u64, usize)> = HashMap::new();
    let mut lease_of: HashMap<(&str, u64), &str> = HashMap::new();
    for (i, c) in h.calls.iter().enumerate() {
        let named: Vec<(&str, &LeaseInfo)> = match (&c.op, &c.outcome) {
            (
                Op::Renew { lease: asked, .. } | Op::KeepAlive { lease: asked, .. },
                Outcome::Ok(Answer::Lease { lease, .. }),
            ) => vec![(asked.task.as_str(), lease)],
            (Op::Claim { task, .. }, Outcome::Ok(Answer::Lease { lease, .. })) => {
                vec![(task.as_str(), lease)]
            }
            (Op::Get { task }, Outcome::Ok(Answer::Task { lease: Some(l), .. })) => {
                vec![(task.as_str(), l)]
            }
            (
                _,
                Outcome::Ok(Answer::Ended {
                    released: Some(l), ..
                }),
            ) => {
                vec![(l.task.as_str(), l)]
            }
            _ => vec![],
        };
        for (task, l) in named {
            out.checks[2] += 1;
            if let Some(&(t, j)) = token_of.get(l.lease_id.as_str())
                && t != l.token
            {
                out.violations.push(Violation {
                    rule: 2,
                    task: task.to_string(),
                    what: format!(
                        "lease {} answered with token {t} ({} at {}) and token {} ({} at {})",
                        l.lease_id,
                        h.calls[j].op.kind(),
                        ms(h.calls[j].end),
                        l.token,
                        c.op.kind(),
                        ms(c.end)
                    ),
                });
            }
            token_of.entry(&l.lease_id).or_insert((l.token, i));
            let other = *lease_of.entry((task, l.token)).or_insert(&l.lease_id);
            if other != l.lease_id {
                out.violations.push(Violation {
                    rule: 2,
                    task: task.to_string(),
                    what: format!(
                        "two leases with token {}: {other} and {} ({} at {})",
                        l.token,
                        l.lease_id,
                        c.op.kind(),
                        ms(c.end)
                    ),
                });
            }
        }
    }
}

/// Rule 3: A lease acknowledged as ended is never reported live by an answer to a request sent
/// after that acknowledgement.
fn rule3(h: &History, all: &HashMap<String, Facts>, out: &mut Checked) {
    let mut ids: Vec<&String> = all.keys().collect();
    ids.sort();
    for id in ids {
        let f = &all[id];
        let Some((ended, how)) = f.first_end() else {
            continue;
        };
        for &(send, answer, i) in &f.reports {
            out.checks[3] += 1;
            if send > *ended {
                let c = &h.calls[i];
                out.violations.push(Violation {
                    rule: 3,
                    task: f.task.clone(),
                    what: format!(
                        "{id} ({}, token {}) was {how} at {}, yet {} (client {}) sent at {} answered at {} reports it live",
                        f.agent,
                        f.token,
                        ms(*ended),
                        c.op.kind(),
                        c.client,
                        ms(send),
                        ms(answer)
                    ),
                });
            }
        }
    }
}

/// Rule 4: A lease certainly live while a call was in flight is found live by it: its renewal is
/// not refused, KeepAlive does not call it lost, GetTask shows it. This covers restarts: a lease
/// live at a kill is certainly live until the restart's spawn + max(TTL, grace), and a renewal is
/// sent right after each restart for a sample of them.
fn rule4(
    h: &History,
    all: &HashMap<String, Facts>,
    live: &HashMap<&str, Vec<(Us, Us)>>,
    out: &mut Checked,
) {
    let mut live_by_task: HashMap<&str, Vec<(&str, &Set)>> = HashMap::new();
    for (id, set) in live {
        if !set.is_empty() {
            live_by_task
                .entry(all[*id].task.as_str())
                .or_default()
                .push((id, set));
        }
    }
    for c in &h.calls {
        match &c.op {
            Op::Renew { lease, .. } | Op::KeepAlive { lease, .. } => {
                let Some(set) = live.get(lease.lease_id.as_str()) else {
                    continue;
                };
                if !covers(set, c.start, c.end) {
                    continue;
                }
                out.checks[4] += 1;
                if matches!(c.outcome, Outcome::Refused(..) | Outcome::Lost(_)) {
                    out.violations.push(Violation {
                        rule: 4,
                        task: lease.task.clone(),
                        what: format!(
                            "{} ({}, token {}) was certainly live over [{}, {}], yet {} (client {}) got {}",
                            lease.lease_id,
                            lease.agent,
                            lease.token,
                            ms(c.start),
                            ms(c.end),
                            c.op.kind(),
                            c.client,
                            describe(&c.outcome)
                        ),
                    });
                }
            }
            Op::Get { task } => {
                let Outcome::Ok(Answer::Task { lease: shown, .. }) = &c.outcome else {
                    continue;
                };
                for (id, set) in live_by_task.get(task.as_str()).into_iter().flatten() {
                    if !covers(set, c.start, c.end) {
                        continue;
                    }
                    out.checks[4] += 1;
                    if shown.as_ref().is_none_or(|l| l.lease_id != *id) {
                        let f = &all[*id];
                        out.violations.push(Violation {
                            rule: 4,
                            task: task.clone(),
                            what: format!(
                                "{id} ({}, token {}) was certainly live over [{}, {}], yet GetTask (client {}) showed {}",
                                f.agent,
                                f.token,
                                ms(c.start),
                                ms(c.end),
                                c.client,
                                shown.as_ref().map_or("no lease".to_string(), |l| format!(
                                    "{} (token {})",
                                    l.lease_id, l.token
                                ))
                            ),
                        });
                    }
                }
            }
            _ => {}
        }
    }
}

/// Rule 5: A write presenting a lease acknowledged as ended before the write was sent is refused.
fn rule5(h: &History, all: &HashMap<String, Facts>, out: &mut Checked) {
    for c in &h.calls {
        let Some(lease) = c.op.presented() else {
            continue;
        };
        let Some((ended, how)) = all.get(lease.lease_id.as_str()).and_then(|f| f.first_end())
        else {
            continue;
        };
        if c.start <= *ended {
            continue;
        }
        out.checks[5] += 1;
        if matches!(c.outcome, Outcome::Ok(_)) {
            out.violations.push(Violation {
                rule: 5,
                task: lease.task.clone(),
                what: format!(
                    "{} ({}, token {}) was {how} at {}, yet {} (client {}{}) sent at {} under it was accepted: {}",
                    lease.lease_id,
                    lease.agent,
                    lease.token,
                    ms(*ended),
                    c.op.kind(),
                    c.client,
                    if c.stale { ", a deliberate stale write" } else { "" },
                    ms(c.start),
                    describe(&c.outcome)
                ),
            });
        }
    }
}

fn describe(o: &Outcome) -> String {
    match o {
        Outcome::Ok(Answer::Lease { lease, .. }) => {
            format!("ok, live with token {}", lease.token)
        }
        Outcome::Ok(Answer::Ended { to, released }) => format!(
            "ok, now {to}{}",
            released
                .as_ref()
                .map_or(String::new(), |l| format!(", ended {}", l.lease_id))
        ),
        Outcome::Ok(a) => format!("ok {a:?}"),
        Outcome::Refused(code, msg) => format!("{code:?} {msg:?}"),
        Outcome::Lost(r) => format!("a loss notice ({r})"),
        Outcome::Ambiguous(e) => format!("no answer ({e})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(task: &str, agent: &str, token: u64, ttl_ms: u64) -> LeaseInfo {
        LeaseInfo {
            task: task.into(),
            agent: agent.into(),
            lease_id: format!("{task}-{agent}-{token}"),
            token,
            ttl_ms,
            state: "research".into(),
        }
    }

    fn call(op: Op, start: Us, end: Us, outcome: Outcome) -> Call {
        Call {
            client: 0,
            op,
            start,
            end,
            outcome,
            stale: false,
        }
    }

    fn claim(l: &LeaseInfo, start: Us, end: Us) -> Call {
        call(
            Op::Claim {
                task: l.task.clone(),
                agent: l.agent.clone(),
                ttl_ms: l.ttl_ms,
            },
            start,
            end,
            Outcome::Ok(Answer::Lease {
                lease: l.clone(),
                renewed: false,
            }),
        )
    }

    fn rules(c: &Checked) -> Vec<u8> {
        let mut r: Vec<u8> = c.violations.iter().map(|v| v.rule).collect();
        r.dedup();
        r
    }

    #[test]
    fn a_clean_history_has_no_violation() {
        // A holds for 100 ms and releases; B claims after the release was acknowledged.
        let a = lease("t", "a", 1, 100);
        let b = lease("t", "b", 2, 100);
        let h = History {
            calls: vec![
                claim(&a, 0, 1_000),
                call(
                    Op::Release { lease: a.clone() },
                    50_000,
                    51_000,
                    Outcome::Ok(Answer::Ended {
                        to: String::new(),
                        released: Some(a.clone()),
                    }),
                ),
                claim(&b, 52_000, 53_000),
                call(
                    Op::Get { task: "t".into() },
                    60_000,
                    61_000,
                    Outcome::Ok(Answer::Task {
                        state: "research".into(),
                        lease: Some(b.clone()),
                    }),
                ),
            ],
            restarts: vec![],
            grace_ms: 1_000,
        };
        let c = check(&h);
        assert!(c.violations.is_empty(), "{:#?}", c.violations);
        assert!(
            c.checks[1] >= 2 && c.checks[2] >= 2 && c.checks[4] >= 1,
            "{c:?}"
        );
    }

    #[test]
    fn overlapping_grants_and_a_lower_token_fire_rules_1_and_2() {
        // B is granted while A is certainly live (rule 1), with a lower token (rule 2).
        let a = lease("t", "a", 5, 1_000);
        let b = lease("t", "b", 4, 1_000);
        let h = History {
            calls: vec![claim(&a, 0, 1_000), claim(&b, 10_000, 11_000)],
            restarts: vec![],
            grace_ms: 1_000,
        };
        let c = check(&h);
        assert_eq!(rules(&c), vec![1, 2], "{:#?}", c.violations);
        assert!(
            c.of_rule(1)[0].what.contains("t-a-5") && c.of_rule(1)[0].what.contains("t-b-4"),
            "{}",
            c.of_rule(1)[0]
        );
    }

    #[test]
    fn an_expired_lease_live_again_after_a_restart_fires_rules_2_3_and_5() {
        // Bug (a): A (30 ms) lapses, B claims and releases, kill -9, restart: A is back.
        let a = lease("t", "a", 1, 30);
        let b = lease("t", "b", 2, 10_000);
        let h = History {
            calls: vec![
                claim(&a, 0, 1_000),
                call(
                    Op::Renew {
                        lease: a.clone(),
                        probe: false,
                    },
                    40_000,
                    41_000,
                    Outcome::Refused(Code::NotFound, "no such lease".into()),
                ),
                claim(&b, 50_000, 51_000),
                call(
                    Op::Release { lease: b.clone() },
                    60_000,
                    61_000,
                    Outcome::Ok(Answer::Ended {
                        to: String::new(),
                        released: Some(b.clone()),
                    }),
                ),
                // After the restart: GetTask shows A, A's holder re-claims and gets A back,
                // and a stale release under A is accepted.
                call(
                    Op::Get { task: "t".into() },
                    300_000,
                    301_000,
                    Outcome::Ok(Answer::Task {
                        state: "research".into(),
                        lease: Some(a.clone()),
                    }),
                ),
                call(
                    Op::Claim {
                        task: "t".into(),
                        agent: "a".into(),
                        ttl_ms: 30,
                    },
                    310_000,
                    311_000,
                    Outcome::Ok(Answer::Lease {
                        lease: a.clone(),
                        renewed: true,
                    }),
                ),
                Call {
                    stale: true,
                    ..call(
                        Op::Release { lease: a.clone() },
                        320_000,
                        321_000,
                        Outcome::Ok(Answer::Ended {
                            to: String::new(),
                            released: Some(a.clone()),
                        }),
                    )
                },
            ],
            restarts: vec![Restart {
                kill: 100_000,
                spawn: 101_000,
                listening: 200_000,
            }],
            grace_ms: 1_000,
        };
        let c = check(&h);
        assert_eq!(rules(&c), vec![2, 3, 5], "{:#?}", c.violations);
        assert_eq!(
            c.of_rule(3).len(),
            2,
            "GetTask and the re-claim: {:#?}",
            c.of_rule(3)
        );
        assert!(
            c.of_rule(3)[0].what.contains("gone (Renew NOT_FOUND)"),
            "{}",
            c.of_rule(3)[0]
        );
    }

    #[test]
    fn an_unanswered_shorter_reclaim_before_a_kill_promises_nothing() {
        // A (10 s) re-claimed by its holder with 50 ms, unanswered, then a kill: the re-claim
        // may have happened, so A may have lapsed and been swept before the kill.
        let a = lease("t", "a", 1, 10_000);
        let h = History {
            calls: vec![
                claim(&a, 0, 1_000),
                call(
                    Op::Claim {
                        task: "t".into(),
                        agent: "a".into(),
                        ttl_ms: 50,
                    },
                    1_000_000,
                    1_200_000,
                    Outcome::Ambiguous("cut off by the kill".into()),
                ),
                call(
                    Op::Get { task: "t".into() },
                    2_000_000,
                    2_001_000,
                    Outcome::Ok(Answer::Task {
                        state: "research".into(),
                        lease: None,
                    }),
                ),
            ],
            restarts: vec![Restart {
                kill: 1_200_000,
                spawn: 1_201_000,
                listening: 1_300_000,
            }],
            grace_ms: 1_000,
        };
        let c = check(&h);
        assert!(c.violations.is_empty(), "{:#?}", c.violations);
        // Answered (with the 10 s TTL), the same GetTask is a violation.
        let mut h = h;
        h.calls[1].outcome = Outcome::Ok(Answer::Lease {
            lease: a.clone(),
            renewed: true,
        });
        h.calls[1].end = 1_100_000;
        assert_eq!(rules(&check(&h)), vec![4]);
    }

    #[test]
    fn a_lease_lost_over_a_restart_fires_rule_4() {
        // A (10 s) is live at the kill; the probe after the restart is refused.
        let a = lease("t", "a", 1, 10_000);
        let probe = |start, outcome| {
            call(
                Op::Renew {
                    lease: a.clone(),
                    probe: true,
                },
                start,
                start + 1_000,
                outcome,
            )
        };
        let mut h = History {
            calls: vec![claim(&a, 0, 1_000)],
            restarts: vec![Restart {
                kill: 5_000_000,
                spawn: 5_001_000,
                listening: 5_100_000,
            }],
            grace_ms: 1_000,
        };
        let ids: Vec<String> = live_at(&h, 5_000_000)
            .into_iter()
            .map(|l| l.lease_id)
            .collect();
        assert_eq!(
            ids,
            vec![a.lease_id.clone()],
            "A is certainly live at the kill"
        );
        h.calls.push(probe(
            5_200_000,
            Outcome::Refused(Code::NotFound, "no such lease".into()),
        ));
        let c = check(&h);
        assert_eq!(rules(&c), vec![4], "{:#?}", c.violations);
        // Past spawn + max(TTL, grace) nothing is promised any more.
        h.calls.pop();
        h.calls.push(probe(
            15_100_000,
            Outcome::Refused(Code::NotFound, "no such lease".into()),
        ));
        let c = check(&h);
        assert!(c.violations.is_empty(), "{:#?}", c.violations);
    }
}
