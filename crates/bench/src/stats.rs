//! Latency and throughput figures of one operation at one concurrency.

use std::time::Duration;

use serde::Serialize;

/// What one phase measured: every successful operation's latency, the phase's wall time and
/// the failures.
#[derive(Debug, Default)]
pub struct Sample {
    pub latencies: Vec<Duration>,
    pub wall: Duration,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl Sample {
    /// Adds another phase's figures (latencies, wall time, failures).
    pub fn absorb(&mut self, other: Sample) {
        self.latencies.extend(other.latencies);
        self.wall += other.wall;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }

    pub fn merge(&mut self, other: ClientSample) {
        self.latencies.extend(other.latencies);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// One client's share of a phase.
#[derive(Debug, Default)]
pub struct ClientSample {
    pub latencies: Vec<Duration>,
    pub errors: u64,
    pub first_error: Option<String>,
}

impl ClientSample {
    pub fn with_capacity(n: usize) -> Self {
        ClientSample {
            latencies: Vec::with_capacity(n),
            ..ClientSample::default()
        }
    }

    pub fn error(&mut self, e: &anyhow::Error) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(format!("{e:#}"));
        }
    }
}

/// The figures printed and written to JSON for one system, operation and client count.
#[derive(Debug, Clone, Serialize)]
pub struct OpStats {
    pub system: String,
    pub op: String,
    pub clients: usize,
    pub ops: u64,
    pub errors: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Wall time of the measured phase(s), seconds.
    pub seconds: f64,
    pub ops_per_s: f64,
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

impl OpStats {
    pub fn new(system: &str, op: &str, clients: usize, mut s: Sample) -> OpStats {
        s.latencies.sort_unstable();
        let n = s.latencies.len();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let pct = |q: f64| -> f64 {
            if n == 0 {
                return 0.0;
            }
            // Nearest rank.
            let rank = ((q * n as f64).ceil() as usize).clamp(1, n);
            ms(s.latencies[rank - 1])
        };
        let total: Duration = s.latencies.iter().sum();
        let secs = s.wall.as_secs_f64();
        OpStats {
            system: system.to_string(),
            op: op.to_string(),
            clients,
            ops: n as u64,
            errors: s.errors,
            first_error: s.first_error,
            seconds: secs,
            ops_per_s: if secs > 0.0 { n as f64 / secs } else { 0.0 },
            mean_ms: if n > 0 { ms(total) / n as f64 } else { 0.0 },
            p50_ms: pct(0.50),
            p99_ms: pct(0.99),
            max_ms: s.latencies.last().map_or(0.0, |d| ms(*d)),
        }
    }
}

/// `0.55ms`, `12.3ms`, `1.20s`.
pub fn fmt_ms(ms: f64) -> String {
    if ms >= 1000.0 {
        format!("{:.2}s", ms / 1000.0)
    } else if ms >= 10.0 {
        format!("{ms:.1}ms")
    } else {
        format!("{ms:.2}ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let s = Sample {
            latencies: (1..=100).rev().map(Duration::from_millis).collect(),
            wall: Duration::from_secs(2),
            errors: 0,
            first_error: None,
        };
        let st = OpStats::new("x", "claim", 1, s);
        assert_eq!(st.ops, 100);
        assert!((st.ops_per_s - 50.0).abs() < 1e-9);
        assert!((st.p50_ms - 50.0).abs() < 1e-9);
        assert!((st.p99_ms - 99.0).abs() < 1e-9);
        assert!((st.max_ms - 100.0).abs() < 1e-9);
    }

    #[test]
    fn empty_sample_is_zero() {
        let st = OpStats::new("x", "renew", 4, Sample::default());
        assert_eq!(st.ops, 0);
        assert_eq!(st.ops_per_s, 0.0);
        assert_eq!(st.p99_ms, 0.0);
    }
}
