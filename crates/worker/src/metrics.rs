//! The worker's Prometheus metrics (`automaton-worker --metrics-listen ADDR`, see
//! docs/worker.md): its session, its runs, its GPUs' memory and its budget.
//!
//! One set per process ([`METRICS`]): the session and the runs update it where they happen;
//! the scrape reads it.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use automaton_telemetry::metrics::{
    Counter, Gauge, Histogram, Kind, LATENCY_BUCKETS, PHASE_BUCKETS, Render, Text,
};
use automaton_workflow::Phase;

use crate::agent::StopReason;

const PHASES: usize = Phase::ALL.len();

/// One GPU as detected at start: its index, total and free memory (bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuMemory {
    pub index: u32,
    pub total: u64,
    pub free: u64,
}

pub struct Metrics {
    pub connected: Gauge,
    pub runs_active: Gauge,
    /// By phase, then outcome.
    runs: Vec<Counter>,
    run_duration: Vec<Histogram>,
    pub heartbeat_rtt: Histogram,
    pub budget_tokens: Gauge,
    gpus: Mutex<Vec<GpuMemory>>,
}

/// This process's metrics.
pub static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

fn phase_index(p: Phase) -> usize {
    Phase::ALL.iter().position(|q| *q == p).unwrap_or(0)
}

impl Metrics {
    /// Everything at zero.
    fn new() -> Metrics {
        Metrics {
            connected: Gauge::new(),
            runs_active: Gauge::new(),
            runs: (0..PHASES * StopReason::REPORTED.len())
                .map(|_| Counter::new())
                .collect(),
            run_duration: (0..PHASES).map(|_| Histogram::new(PHASE_BUCKETS)).collect(),
            heartbeat_rtt: Histogram::new(LATENCY_BUCKETS),
            budget_tokens: Gauge::new(),
            gpus: Mutex::new(Vec::new()),
        }
    }

    /// What the probe found at start: the GPUs' memory and the budget.
    pub fn detected(&self, gpus: Vec<GpuMemory>, budget_tokens: u64) {
        *self.gpus.lock().unwrap_or_else(|p| p.into_inner()) = gpus;
        self.budget_tokens
            .set(i64::try_from(budget_tokens).unwrap_or(i64::MAX));
    }

    /// A run of `phase` stopped for `reason` after `took`.
    pub fn run_stopped(&self, phase: Phase, reason: StopReason, took: Duration) {
        let p = phase_index(phase);
        if let Some(o) = StopReason::REPORTED.iter().position(|r| *r == reason)
            && let Some(c) = self.runs.get(p * StopReason::REPORTED.len() + o)
        {
            c.inc();
        }
        if let Some(h) = self.run_duration.get(p) {
            h.observe(took);
        }
    }

    pub fn text(&self) -> String {
        let mut t = Text::new();
        t.gauge(
            "automaton_worker_connected",
            "1 while this worker's session with the coordinator is live.",
            self.connected.get() as f64,
        );
        t.gauge(
            "automaton_worker_runs_active",
            "Agent runs in progress.",
            self.runs_active.get() as f64,
        );
        t.family(
            "automaton_worker_runs_total",
            Kind::Counter,
            "Agent runs that stopped, by phase and stop reason (outcome).",
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            for (j, o) in StopReason::REPORTED.iter().enumerate() {
                let n = self
                    .runs
                    .get(i * StopReason::REPORTED.len() + j)
                    .map_or(0, Counter::get);
                if n > 0 {
                    t.sample(
                        "automaton_worker_runs_total",
                        &[("phase", p.name()), ("outcome", o.name())],
                        n as f64,
                    );
                }
            }
        }
        t.family(
            "automaton_worker_run_duration_seconds",
            Kind::Histogram,
            "From an assignment taken to its run stopped, by phase.",
        );
        for (i, p) in Phase::ALL.iter().enumerate() {
            if let Some(h) = self.run_duration.get(i)
                && h.count() > 0
            {
                t.histogram(
                    "automaton_worker_run_duration_seconds",
                    &[("phase", p.name())],
                    h,
                );
            }
        }
        t.family(
            "automaton_worker_gpu_memory_bytes",
            Kind::Gauge,
            "Each GPU's memory as detected at start (kind: total, free), by GPU index.",
        );
        for g in self.gpus.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let index = g.index.to_string();
            for (kind, v) in [("total", g.total), ("free", g.free)] {
                t.sample(
                    "automaton_worker_gpu_memory_bytes",
                    &[("gpu", &index), ("kind", kind)],
                    v as f64,
                );
            }
        }
        t.gauge(
            "automaton_worker_budget_tokens",
            "The largest estimated peak context (tokens) this worker takes: its max peak context.",
            self.budget_tokens.get() as f64,
        );
        t.family(
            "automaton_worker_heartbeat_rtt_seconds",
            Kind::Histogram,
            "From a heartbeat sent to its acknowledgement from the coordinator.",
        );
        t.histogram(
            "automaton_worker_heartbeat_rtt_seconds",
            &[],
            &self.heartbeat_rtt,
        );
        t.finish()
    }
}

/// The endpoint's answer: this process's metrics.
pub fn render() -> Render {
    Arc::new(|| Box::pin(async { METRICS.text() }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stopped_run_counts_under_its_phase_and_outcome() {
        let m = Metrics::new();
        m.run_stopped(Phase::Design, StopReason::TimedOut, Duration::from_secs(3));
        m.detected(
            vec![GpuMemory {
                index: 0,
                total: 8,
                free: 5,
            }],
            38_000,
        );
        let text = m.text();
        for line in [
            "automaton_worker_runs_total{phase=\"design\",outcome=\"timed_out\"} 1",
            "automaton_worker_run_duration_seconds_count{phase=\"design\"} 1",
            "automaton_worker_gpu_memory_bytes{gpu=\"0\",kind=\"free\"} 5",
            "automaton_worker_budget_tokens 38000",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
    }
}
