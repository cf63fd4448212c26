//! What operators see of a running process: logs (text on a terminal, JSON with
//! `--log-format json`, filtered by `RUST_LOG`), OpenTelemetry traces exported over OTLP when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set (W3C trace context carried in gRPC metadata), and a
//! Prometheus endpoint.
//!
//! It must not know about tasks, leases or workers: the coordinator and the worker name their
//! own spans and metrics; this crate only wires them to the standard tools.

pub mod metrics;
pub mod trace;
