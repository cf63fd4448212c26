//! The coordinator's Prometheus metrics (`--metrics-listen`, docs/observability.md).
//!
//! What happens on the lease paths is counted with plain atomics where it happens (a claim
//! costs one relaxed `fetch_add`); everything derived — workers by GPU model and state,
//! leases held, tasks by phase, tasks waiting and why — is computed when Prometheus scrapes.
//! The one part that reads the store (tasks by phase) is computed by one scrape at a time, on
//! its own blocking thread rather than with the permits of the store reads that dispatch and
//! the API wait for, and reused for `DERIVED_TTL` (`counters.rs`): a flood of scrapes cannot starve them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use automaton_engine::{END_REASONS, Error, Refusal, phase_index};
use automaton_telemetry::metrics::{Counter, Kind, Render, Text};
use automaton_workflow::{Phase, WorkerState};

use crate::counters::PHASES;
use crate::state::Coordinator;

fn waiting_class(why: &str) -> &'static str {
    if why.starts_with("manual mode") {
        "manual_mode"
    } else if why.contains("no worker that takes work is connected") {
        "no_worker"
    } else if why.contains("no worker fits") {
        "no_worker_fits"
    } else if why.contains("reviewer ≠ implementer") {
        "implementer_only"
    } else if why.contains("busy") || why.contains("largest idle worker holds") {
        // Workers that fit exist, all of them busy.
        "workers_busy"
    } else if why.contains("did not pass") {
        "dependency_failed"
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
const WAITING_CLASSES: [&str; 11] = [
    "manual_mode",
    "no_worker",
    "no_worker_fits",
    "workers_busy",
    "implementer_only",
    "wave_not_ready",
    "dependency_failed",
    "orphaned",
    "decomposition_unreadable",
    "held",
    "other",
];

impl Coordinator {
    /// The scrape: counters as they stand, and what is derived from the coordinator's state
    /// now.
    pub async fn metrics_text(self: &Arc<Self>) -> String {
        let m = &self.metrics;
        let c = self.engine.counters();
        let mut t = Text::new();

        let workers = self.workers(true, None);
        let mut by_model: std::collections::BTreeMap<String, u64> = Default::default();
        let mut by_state: HashMap<WorkerState, u64> = HashMap::new();
        for w in &workers {
            let state = automaton_proto::vocab::worker_state(w);
            if let Some(s) = state {
                *by_state.entry(s).or_insert(0) += 1;
            }
            if state.is_some_and(WorkerState::is_present) {
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
        for s in WorkerState::ALL {
            let n = by_state.get(s).copied().unwrap_or(0);
            t.sample("automaton_workers", &[("state", s.name())], n as f64);
        }

        t.gauge(
            "automaton_leases_held",
            "Leases in the coordinator's table now.",
            self.live_leases() as f64,
        );
        t.counter(
            "automaton_lease_claims_total",
            "Leases granted: agents' claims and dispatch grants.",
            c.claims(),
        );
        t.counter(
            "automaton_lease_renewals_total",
            "Leases renewed: KeepAlive, Renew, or a claim by the holder.",
            c.renewals(),
        );
        t.counter(
            "automaton_lease_releases_total",
            "Leases ended by their holder: released, or ended by a transition.",
            c.releases(),
        );
        t.family(
            "automaton_lease_expiries_total",
            Kind::Counter,
            "Leases that ended without their holder: TTL passed (expired), or the worker session died (session_expired) or was replaced (session_replaced), or its run was lost to a restart (run_lost).",
        );
        for (i, reason) in END_REASONS.iter().enumerate().skip(2) {
            let n = c.expiries(i);
            t.sample(
                "automaton_lease_expiries_total",
                &[("reason", reason.name())],
                n as f64,
            );
        }
        t.family(
            "automaton_lease_refusals_total",
            Kind::Counter,
            "Claims and renewals refused, by reason.",
        );
        for (i, r) in Refusal::ALL.iter().enumerate() {
            let n = c.refusals(i);
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
            "automaton_dispatch_answer_seconds",
            Kind::Histogram,
            "From an assignment queued on the worker's session stream to the worker's answer (answer: accepted, refused): the network and the worker taking the run on.",
        );
        for (i, answer) in ["accepted", "refused"].into_iter().enumerate() {
            t.histogram(
                "automaton_dispatch_answer_seconds",
                &[("answer", answer)],
                &m.answers[i],
            );
        }
        t.family(
            "automaton_dispatch_decisions_total",
            Kind::Counter,
            "Tasks dispatch rounds decided about: given a worker, or left waiting with a reason.",
        );
        t.sample(
            "automaton_dispatch_decisions_total",
            &[],
            m.decisions.get() as f64,
        );
        t.family(
            "automaton_dispatch_decide_seconds_total",
            Kind::Counter,
            "Time dispatch rounds spent deciding (choosing workers), without the moves and grants that carry the decisions out.",
        );
        t.sample(
            "automaton_dispatch_decide_seconds_total",
            &[],
            m.decide_nanos.get() as f64 / 1e9,
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
            "From a lease's grant to its end, by the phase it was granted on and how it ended (outcome: released, transitioned, expired, session_expired, session_replaced, run_lost).",
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            for (j, outcome) in END_REASONS.iter().enumerate() {
                let Some(h) = c.phase_duration(i, j) else {
                    continue;
                };
                // Only series that happened: 13 phases × 5 outcomes of empty buckets is noise.
                if h.count() > 0 {
                    t.histogram(
                        "automaton_phase_duration_seconds",
                        &[("phase", p.name()), ("outcome", outcome.name())],
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
        t.counter(
            "automaton_scrape_store_reads_total",
            "Times a scrape read the store to count the tasks by phase: one at a time, at most once per 5 s; other scrapes reuse the last counts.",
            m.derived.reads.get(),
        );
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

    /// Every task and sub-task, counted by phase, as read at most `DERIVED_TTL` ago; while
    /// another scrape reads the store, the last counts however old. One read at a time, on a
    /// blocking thread of its own: never a permit of [`Coordinator::read`], which dispatch
    /// and the API wait for.
    async fn tasks_by_phase(self: &Arc<Self>) -> Result<[u64; PHASES], Error> {
        let d = &self.metrics.derived;
        if let Some(c) = d.fresh() {
            return Ok(c);
        }
        let flight = match d.flight.clone().try_lock_owned() {
            Ok(f) => f,
            Err(_) => {
                if let Some(c) = d.any() {
                    return Ok(c);
                }
                // The first counts are being read: wait for them.
                let f = d.flight.clone().lock_owned().await;
                if let Some(c) = d.fresh() {
                    return Ok(c);
                }
                f
            }
        };
        let me = self.clone();
        tokio::spawn(async move {
            let _flight = flight;
            me.metrics.derived.reads.inc();
            let counts = me.count_tasks_by_phase().await?;
            *me.metrics.derived.last() = Some((Instant::now(), counts));
            Ok(counts)
        })
        .await
        .map_err(|e| Error::Internal(format!("counting the tasks failed: {e}")))?
    }

    /// Every task and sub-task, counted by phase: the state this coordinator knows, else
    /// its `.state` file (read off the async threads).
    async fn count_tasks_by_phase(&self) -> Result<[u64; PHASES], Error> {
        let names = self.read_for_scrape(|p| p.all_task_names()).await?;
        let mut counts = [0u64; PHASES];
        let mut unknown = Vec::new();
        {
            let states = self.engine.states();
            for n in names {
                match states.get(&n) {
                    Some(s) => counts[phase_index(s.phase)] += 1,
                    None => unknown.push(n),
                }
            }
        }
        if !unknown.is_empty() {
            let read = self
                .read_for_scrape(move |p| {
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

    /// A store read on the blocking pool outside [`Coordinator::read`]'s permits: the caller
    /// (the one scrape in flight) bounds it.
    async fn read_for_scrape<T: Send + 'static>(
        &self,
        f: impl FnOnce(&automaton_store::Project) -> Result<T, automaton_store::Error> + Send + 'static,
    ) -> Result<T, Error> {
        let project = self.engine.project().clone();
        tokio::task::spawn_blocking(move || f(&project))
            .await
            .map_err(|e| Error::Internal(format!("read task failed: {e}")))?
            .map_err(Error::from)
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
    use std::time::Duration;

    use super::*;
    use crate::counters::DERIVED_TTL;

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
                "manual mode (Autopilot: Disabled): `automaton run t` runs its research"
                    .to_string(),
                "manual_mode",
            ),
            (
                "waiting for a person: a did not pass (human_intervention), and wave 2 starts only when what it depends on passes".to_string(),
                "dependency_failed",
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

    /// A coordinator over a fresh project with `n` tasks.
    async fn coordinator(dir: &std::path::Path, n: usize) -> Arc<Coordinator> {
        let project = automaton_store::Project::open(dir, None);
        let (coord, _) =
            Coordinator::open(project, crate::state::Options::default()).expect("open");
        for i in 0..n {
            let task: automaton_workflow::TaskName = format!("t-{i}").parse().expect("name");
            coord.engine.create_task(&task).await.expect("create");
        }
        coord
    }

    fn counted(text: &str) -> u64 {
        text.lines()
            .filter(|l| l.starts_with("automaton_tasks{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    fn store_reads(text: &str) -> Option<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix("automaton_scrape_store_reads_total "))
            .and_then(|v| v.parse().ok())
    }

    #[tokio::test]
    async fn a_scrape_takes_no_shared_read_permit_and_reuses_its_counts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path(), 3).await;
        // Every permit of the reads dispatch and the API wait for is taken: a scrape still
        // answers, with the tasks counted.
        let _all = coord
            .engine
            .read_permits()
            .clone()
            .acquire_many_owned(automaton_engine::MAX_BLOCKING_READS as u32)
            .await
            .expect("permits");
        let text = tokio::time::timeout(Duration::from_secs(10), coord.metrics_text())
            .await
            .expect("a scrape needs no shared read permit");
        assert_eq!(counted(&text), 3, "{text}");
        assert_eq!(store_reads(&text), Some(1), "{text}");
        // Within the cache window: the same counts, no second read.
        let again = coord.metrics_text().await;
        assert_eq!(counted(&again), 3);
        assert_eq!(store_reads(&again), Some(1), "{again}");
    }

    #[tokio::test]
    async fn while_a_count_is_in_flight_no_second_one_starts() {
        let dir = tempfile::tempdir().expect("tempdir");
        let coord = coordinator(dir.path(), 2).await;
        let d = &coord.metrics.derived;
        // A read in flight (as a scrape cut off by its timeout leaves it).
        let in_flight = d.flight.clone().lock_owned().await;
        // No counts yet: a scrape waits for the read in flight rather than starting its own.
        assert!(
            tokio::time::timeout(Duration::from_millis(200), coord.tasks_by_phase())
                .await
                .is_err(),
            "a second count started beside the one in flight"
        );
        assert_eq!(d.reads.get(), 0);
        // Stale counts: served at once while the read is in flight, nothing read.
        let stale = [7u64; PHASES];
        *d.last() = Some((Instant::now() - DERIVED_TTL * 2, stale));
        let got = tokio::time::timeout(Duration::from_secs(5), coord.tasks_by_phase())
            .await
            .expect("stale counts at once")
            .expect("counts");
        assert_eq!(got, stale);
        assert_eq!(d.reads.get(), 0);
        // Once it ends, the next scrape reads the store again (once).
        drop(in_flight);
        let fresh = coord.tasks_by_phase().await.expect("counts");
        assert_eq!(fresh.iter().sum::<u64>(), 2);
        assert_eq!(d.reads.get(), 1);
    }
}
