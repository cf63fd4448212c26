//! The coordinator's Prometheus metrics (`--metrics-listen`, docs/observability.md).
//!
//! What happens on the lease paths is counted with plain atomics where it happens (a claim
//! costs one relaxed `fetch_add`); everything derived — workers by GPU model and state,
//! leases held, tasks by phase, tasks waiting and why — is computed when Prometheus scrapes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use automaton_telemetry::metrics::{
    Counter, Histogram, Kind, LATENCY_BUCKETS, PHASE_BUCKETS, Render, Text,
};
use automaton_workflow::Phase;

use crate::Error;
use crate::state::Coordinator;

const PHASES: usize = Phase::ALL.len();

/// Why a lease ended: the reasons `after_end` is given.
const END_REASONS: [&str; 5] = [
    "released",
    "transitioned",
    "expired",
    "session_expired",
    "session_replaced",
];

/// Why a claim or renewal was refused (a small fixed set: the label's values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Another agent holds the task.
    Held,
    /// The fencing token is not the lease's.
    StaleToken,
    /// Separation of duties: the implementer may not take a review phase.
    ReviewerIsImplementer,
    /// The task's phase cannot be claimed (awaiting approval, terminal, …).
    Illegal,
    /// No such task, or no live lease with that id.
    NotFound,
    /// A malformed request (a bad TTL, name or id).
    Invalid,
    /// The caller may not act as that agent, or renew another's lease.
    PermissionDenied,
    /// A worker claim without a live session, or from a drained worker.
    NoSession,
    /// The lease log cannot be written: the coordinator is stopping.
    Unavailable,
    Other,
}

impl Refusal {
    const ALL: [Refusal; 10] = [
        Refusal::Held,
        Refusal::StaleToken,
        Refusal::ReviewerIsImplementer,
        Refusal::Illegal,
        Refusal::NotFound,
        Refusal::Invalid,
        Refusal::PermissionDenied,
        Refusal::NoSession,
        Refusal::Unavailable,
        Refusal::Other,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Refusal::Held => "held",
            Refusal::StaleToken => "stale_token",
            Refusal::ReviewerIsImplementer => "reviewer_is_implementer",
            Refusal::Illegal => "illegal",
            Refusal::NotFound => "not_found",
            Refusal::Invalid => "invalid",
            Refusal::PermissionDenied => "permission_denied",
            Refusal::NoSession => "no_session",
            Refusal::Unavailable => "unavailable",
            Refusal::Other => "other",
        }
    }

    pub(crate) fn of(e: &Error) -> Refusal {
        use automaton_store::Error as S;
        match e {
            Error::Store(s) => match s {
                S::Leased { .. } => Refusal::Held,
                S::StaleToken { .. } => Refusal::StaleToken,
                S::Separation { .. } => Refusal::ReviewerIsImplementer,
                S::NotClaimable { .. } => Refusal::Illegal,
                S::TaskNotFound { .. } | S::NoLease { .. } => Refusal::NotFound,
                S::HolderRequired { .. } | S::NotHolder { .. } => Refusal::PermissionDenied,
                _ => match s.kind() {
                    automaton_store::ErrorKind::Invalid => Refusal::Invalid,
                    automaton_store::ErrorKind::NotFound => Refusal::NotFound,
                    automaton_store::ErrorKind::Refused => Refusal::Illegal,
                    _ => Refusal::Other,
                },
            },
            Error::LeaseNotFound(_) => Refusal::NotFound,
            Error::Invalid(_) => Refusal::Invalid,
            Error::PermissionDenied(_) => Refusal::PermissionDenied,
            Error::Refused(_) => Refusal::NoSession,
            Error::Unavailable(_) => Refusal::Unavailable,
            _ => Refusal::Other,
        }
    }
}

/// The class of a task's waiting reason (as dispatch words it, see `dispatch::waiting_reason`
/// and `waves.rs`).
fn waiting_class(why: &str) -> &'static str {
    if why.contains("no worker that takes work is connected") {
        "no_worker"
    } else if why.contains("no worker fits") {
        "no_worker_fits"
    } else if why.contains("reviewer ≠ implementer") {
        "implementer_only"
    } else if why.contains("busy") || why.contains("largest idle worker holds") {
        // Workers that fit exist, all of them busy.
        "workers_busy"
    } else if why.contains("wave ") {
        "wave_not_ready"
    } else if why.starts_with("orphaned") {
        "orphaned"
    } else if why.contains("decomposition") {
        "decomposition_unreadable"
    } else {
        "other"
    }
}

/// Every waiting class, so each is exposed (at 0) before it first happens.
const WAITING_CLASSES: [&str; 9] = [
    "no_worker",
    "no_worker_fits",
    "workers_busy",
    "implementer_only",
    "wave_not_ready",
    "orphaned",
    "decomposition_unreadable",
    "held",
    "other",
];

const WORKER_STATES: [&str; 5] = ["idle", "busy", "draining", "reconnecting", "lost"];

/// The counters and histograms the lease and dispatch paths update.
pub(crate) struct Metrics {
    claims: Counter,
    renewals: Counter,
    releases: Counter,
    expiries: [Counter; END_REASONS.len()],
    refusals: [Counter; Refusal::ALL.len()],
    dispatch_latency: Histogram,
    assignments: [Counter; PHASES],
    /// By phase, then end reason.
    phase_duration: Vec<Histogram>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            claims: Counter::new(),
            renewals: Counter::new(),
            releases: Counter::new(),
            expiries: Default::default(),
            refusals: Default::default(),
            dispatch_latency: Histogram::new(LATENCY_BUCKETS),
            assignments: Default::default(),
            phase_duration: (0..PHASES * END_REASONS.len())
                .map(|_| Histogram::new(PHASE_BUCKETS))
                .collect(),
        }
    }
}

fn phase_index(p: Phase) -> usize {
    Phase::ALL.iter().position(|q| *q == p).unwrap_or(0)
}

impl Metrics {
    #[inline]
    pub(crate) fn granted(&self) {
        self.claims.inc();
    }

    #[inline]
    pub(crate) fn renewed(&self) {
        self.renewals.inc();
    }

    pub(crate) fn refused(&self, why: Refusal) {
        if let Some(c) = Refusal::ALL
            .iter()
            .position(|r| *r == why)
            .and_then(|i| self.refusals.get(i))
        {
            c.inc();
        }
    }

    /// A lease granted at `claimed` on `phase` ended for `reason`.
    pub(crate) fn ended(&self, phase: Phase, claimed: SystemTime, reason: &str) {
        let r = END_REASONS.iter().position(|x| *x == reason);
        match reason {
            "released" | "transitioned" => self.releases.inc(),
            _ => {
                if let Some(c) = r.and_then(|r| self.expiries.get(r)) {
                    c.inc();
                }
            }
        }
        let held = SystemTime::now()
            .duration_since(claimed)
            .unwrap_or(Duration::ZERO);
        if let Some(h) = r.and_then(|r| {
            self.phase_duration
                .get(phase_index(phase) * END_REASONS.len() + r)
        }) {
            h.observe(held);
        }
    }

    /// An assignment of `phase` was handed to a worker's stream, `latency` after the round
    /// that found the work.
    pub(crate) fn assigned(&self, phase: Phase, latency: Duration) {
        self.dispatch_latency.observe(latency);
        if let Some(c) = self.assignments.get(phase_index(phase)) {
            c.inc();
        }
    }
}

impl Coordinator {
    /// The scrape: counters as they stand, and what is derived from the coordinator's state
    /// now.
    pub async fn metrics_text(self: &Arc<Self>) -> String {
        let m = &self.metrics;
        let mut t = Text::new();

        let workers = self.workers(true, None);
        let mut by_model: std::collections::BTreeMap<String, u64> = Default::default();
        let mut by_state: HashMap<&str, u64> = HashMap::new();
        for w in &workers {
            *by_state.entry(w.state.as_str()).or_insert(0) += 1;
            if w.state != "lost" && w.state != "reconnecting" {
                let model = w
                    .gpus
                    .first()
                    .map(|g| g.name.clone())
                    .filter(|n| !n.is_empty())
                    .unwrap_or_else(|| "none".into());
                *by_model.entry(model).or_insert(0) += 1;
            }
        }
        t.family(
            "automaton_workers_connected",
            Kind::Gauge,
            "Live worker sessions by the model of the worker's first GPU (none without a GPU).",
        );
        for (model, n) in &by_model {
            t.sample(
                "automaton_workers_connected",
                &[("gpu_model", model)],
                *n as f64,
            );
        }
        t.family(
            "automaton_workers",
            Kind::Gauge,
            "Known workers by state: idle, busy, draining, reconnecting, lost.",
        );
        for s in WORKER_STATES {
            let n = by_state.get(s).copied().unwrap_or(0);
            t.sample("automaton_workers", &[("state", s)], n as f64);
        }

        t.gauge(
            "automaton_leases_held",
            "Leases in the coordinator's table now.",
            self.live_leases() as f64,
        );
        t.counter(
            "automaton_lease_claims_total",
            "Leases granted: agents' claims and dispatch grants.",
            m.claims.get(),
        );
        t.counter(
            "automaton_lease_renewals_total",
            "Leases renewed: KeepAlive, Renew, or a claim by the holder.",
            m.renewals.get(),
        );
        t.counter(
            "automaton_lease_releases_total",
            "Leases ended by their holder: released, or ended by a transition.",
            m.releases.get(),
        );
        t.family(
            "automaton_lease_expiries_total",
            Kind::Counter,
            "Leases that ended without their holder: TTL passed (expired), or the worker session died (session_expired) or was replaced (session_replaced).",
        );
        for (i, reason) in END_REASONS.iter().enumerate().skip(2) {
            let n = m.expiries.get(i).map_or(0, Counter::get);
            t.sample(
                "automaton_lease_expiries_total",
                &[("reason", reason)],
                n as f64,
            );
        }
        t.family(
            "automaton_lease_refusals_total",
            Kind::Counter,
            "Claims and renewals refused, by reason.",
        );
        for (i, r) in Refusal::ALL.iter().enumerate() {
            let n = m.refusals.get(i).map_or(0, Counter::get);
            t.sample(
                "automaton_lease_refusals_total",
                &[("reason", r.as_str())],
                n as f64,
            );
        }

        t.family(
            "automaton_dispatch_latency_seconds",
            Kind::Histogram,
            "From the dispatch round that found the work to the assignment handed to the worker's session stream.",
        );
        t.histogram(
            "automaton_dispatch_latency_seconds",
            &[],
            &m.dispatch_latency,
        );
        t.family(
            "automaton_dispatch_assignments_total",
            Kind::Counter,
            "Assignments sent to workers, by phase.",
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            let n = m.assignments.get(i).map_or(0, Counter::get);
            t.sample(
                "automaton_dispatch_assignments_total",
                &[("phase", p.name())],
                n as f64,
            );
        }
        t.family(
            "automaton_phase_duration_seconds",
            Kind::Histogram,
            "From a lease's grant to its end, by the phase it was granted on and how it ended (outcome: released, transitioned, expired, session_expired, session_replaced).",
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            for (j, outcome) in END_REASONS.iter().enumerate() {
                let Some(h) = m.phase_duration.get(i * END_REASONS.len() + j) else {
                    continue;
                };
                // Only series that happened: 13 phases × 5 outcomes of empty buckets is noise.
                if h.count() > 0 {
                    t.histogram(
                        "automaton_phase_duration_seconds",
                        &[("phase", p.name()), ("outcome", outcome)],
                        h,
                    );
                }
            }
        }

        t.family(
            "automaton_tasks",
            Kind::Gauge,
            "Tasks and sub-tasks by phase (the state before ':').",
        );
        match self.tasks_by_phase().await {
            Ok(counts) => {
                for (i, p) in Phase::ALL.iter().enumerate() {
                    let n = counts.get(i).copied().unwrap_or(0);
                    t.sample("automaton_tasks", &[("phase", p.name())], n as f64);
                }
            }
            Err(e) => tracing::warn!(error = %e, "metrics: cannot count the tasks by phase"),
        }
        t.family(
            "automaton_tasks_waiting",
            Kind::Gauge,
            "Tasks with work that no worker took in the last dispatch round, by reason class; held: held from dispatch.",
        );
        let waiting = self.work.waiting_classes(waiting_class);
        for class in WAITING_CLASSES {
            let n = waiting.get(class).copied().unwrap_or(0);
            t.sample("automaton_tasks_waiting", &[("reason", class)], n as f64);
        }
        t.finish()
    }

    /// Every task and sub-task, counted by phase: the state this coordinator knows, else
    /// its `.state` file (read off the async threads).
    async fn tasks_by_phase(&self) -> Result<[u64; PHASES], Error> {
        let names = self.read(|p| p.all_task_names()).await?;
        let mut counts = [0u64; PHASES];
        let mut unknown = Vec::new();
        {
            let states = self.states();
            for n in names {
                match states.get(&n) {
                    Some(s) => counts[phase_index(s.phase)] += 1,
                    None => unknown.push(n),
                }
            }
        }
        if !unknown.is_empty() {
            let read = self
                .read(move |p| {
                    Ok(unknown
                        .iter()
                        .filter_map(|t| p.read_state(t).ok().flatten())
                        .map(|s| s.phase)
                        .collect::<Vec<_>>())
                })
                .await?;
            for p in read {
                counts[phase_index(p)] += 1;
            }
        }
        Ok(counts)
    }
}

/// The endpoint's answer: this coordinator's scrape.
pub fn render(coord: Arc<Coordinator>) -> Render {
    Arc::new(move || {
        let c = coord.clone();
        Box::pin(async move { c.metrics_text().await })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_waiting_reason_dispatch_words_has_its_class() {
        use crate::dispatch::{Slot, waiting_reason};
        let slot = |budget: u64, free: usize| Slot {
            session: Arc::from("s-1"),
            name: "w".parse().expect("name"),
            free,
            capacity: 1,
            budget,
            gpu: "24 GiB".into(),
        };
        let largest = (
            100_000u64,
            "big".parse().expect("name"),
            "80 GiB".to_string(),
        );
        let small = (
            10_000u64,
            "small".parse().expect("name"),
            "8 GiB".to_string(),
        );
        for (why, class) in [
            (waiting_reason(Some(5_000), &[], None), "no_worker"),
            (
                waiting_reason(Some(50_000), &[], Some(&small)),
                "no_worker_fits",
            ),
            (
                waiting_reason(Some(50_000), &[slot(20_000, 1)], Some(&largest)),
                "workers_busy",
            ),
            (
                waiting_reason(Some(50_000), &[], Some(&largest)),
                "workers_busy",
            ),
            (waiting_reason(None, &[], Some(&largest)), "workers_busy"),
            (
                "waiting: the only idle worker that fits implemented it (w): reviewer ≠ implementer"
                    .to_string(),
                "implementer_only",
            ),
            (
                "waiting: wave 2 starts when a, b are terminal".to_string(),
                "wave_not_ready",
            ),
            (
                "orphaned: no longer in the parent's DECOMPOSITION.md (not dispatched)"
                    .to_string(),
                "orphaned",
            ),
            (
                "waiting: the parent's decomposition: p: cannot read DECOMPOSITION.md".to_string(),
                "decomposition_unreadable",
            ),
        ] {
            assert_eq!(waiting_class(&why), class, "{why}");
        }
    }

    #[test]
    fn a_lease_end_counts_as_a_release_or_an_expiry_by_its_reason() {
        let m = Metrics::default();
        let claimed = SystemTime::now() - Duration::from_secs(2);
        m.ended(Phase::Design, claimed, "released");
        m.ended(Phase::Design, claimed, "transitioned");
        m.ended(Phase::Implement, claimed, "expired");
        m.ended(Phase::Implement, claimed, "session_expired");
        assert_eq!(m.releases.get(), 2);
        assert_eq!(
            m.expiries.iter().map(Counter::get).collect::<Vec<_>>(),
            [0, 0, 1, 1, 0]
        );
        let h = &m.phase_duration[phase_index(Phase::Implement) * END_REASONS.len() + 2];
        assert_eq!(h.count(), 1);
        assert!(h.sum_seconds() >= 2.0, "{}", h.sum_seconds());
    }

    #[test]
    fn refusals_are_classified_by_what_refused_them() {
        let task: automaton_workflow::TaskName = "t".parse().expect("task");
        for (e, r) in [
            (Error::LeaseNotFound("x".into()), Refusal::NotFound),
            (Error::Invalid("x".into()), Refusal::Invalid),
            (Error::Refused("x".into()), Refusal::NoSession),
            (
                Error::Store(automaton_store::Error::StaleToken {
                    task: task.clone(),
                    given: 1,
                    current: Some(2),
                }),
                Refusal::StaleToken,
            ),
            (
                Error::Store(automaton_store::Error::TaskNotFound {
                    task,
                    tasks: String::new(),
                }),
                Refusal::NotFound,
            ),
        ] {
            assert_eq!(Refusal::of(&e), r, "{e}");
        }
    }
}
