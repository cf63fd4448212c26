//! The dispatch path's counters, updated where it happens with plain atomics, and the cache
//! of the one part of a scrape that reads the store. `metrics.rs` renders them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use automaton_engine::phase_index;
use automaton_telemetry::metrics::{Counter, Histogram, LATENCY_BUCKETS};
use automaton_workflow::Phase;

pub(crate) const PHASES: usize = Phase::ALL.len();

/// How long the store-derived part of a scrape (tasks by phase) is reused before a scrape
/// reads the store again.
pub(crate) const DERIVED_TTL: Duration = Duration::from_secs(5);

/// The counters and histograms the dispatch path updates (the lease counters are the
/// engine's), and the store-derived part of a scrape.
pub(crate) struct Metrics {
    pub(crate) dispatch_latency: Histogram,
    pub(crate) assignments: [Counter; PHASES],
    /// From the assignment queued on a worker's stream to the worker's answer: accepted,
    /// refused.
    pub(crate) answers: [Histogram; 2],
    /// Tasks dispatch rounds decided about (a worker chosen, or a waiting reason).
    pub(crate) decisions: Counter,
    /// Time rounds spent deciding, in nanoseconds (not the moves and grants that follow).
    pub(crate) decide_nanos: Counter,
    /// The store-derived part of a scrape.
    pub(crate) derived: Derived,
}

/// Tasks by phase, the part of a scrape that reads the store: read by one scrape at a time
/// and reused for [`DERIVED_TTL`].
#[derive(Default)]
pub(crate) struct Derived {
    /// The last counts and when they were read.
    pub(crate) last: Mutex<Option<(Instant, [u64; PHASES])>>,
    /// Held by the read in flight — by the task doing it, not by the scrape that started it,
    /// so a scrape that times out does not let a second read start beside the first.
    pub(crate) flight: Arc<tokio::sync::Mutex<()>>,
    /// Store reads done for scrapes.
    pub(crate) reads: Counter,
}

impl Derived {
    pub(crate) fn last(&self) -> std::sync::MutexGuard<'_, Option<(Instant, [u64; PHASES])>> {
        self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The last counts if younger than [`DERIVED_TTL`].
    pub(crate) fn fresh(&self) -> Option<[u64; PHASES]> {
        self.last()
            .filter(|(at, _)| at.elapsed() < DERIVED_TTL)
            .map(|(_, c)| c)
    }

    /// The last counts, however old.
    pub(crate) fn any(&self) -> Option<[u64; PHASES]> {
        self.last().map(|(_, c)| c)
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            dispatch_latency: Histogram::new(LATENCY_BUCKETS),
            assignments: Default::default(),
            answers: [
                Histogram::new(LATENCY_BUCKETS),
                Histogram::new(LATENCY_BUCKETS),
            ],
            decisions: Counter::new(),
            decide_nanos: Counter::new(),
            derived: Derived::default(),
        }
    }
}

impl Metrics {
    /// A worker answered an assignment queued `after` ago.
    pub(crate) fn answered(&self, accepted: bool, after: Duration) {
        self.answers[usize::from(!accepted)].observe(after);
    }

    /// A dispatch round decided about `decisions` tasks in `took`.
    pub(crate) fn decided(&self, decisions: usize, took: Duration) {
        self.decisions.add(decisions as u64);
        self.decide_nanos
            .add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
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
