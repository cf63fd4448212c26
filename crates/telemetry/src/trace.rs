//! Logs and traces: the subscriber, the OTLP exporter and W3C trace context propagation.
//!
//! [`init`] installs one subscriber for a binary: an `EnvFilter` from `RUST_LOG` (default
//! `info`), human-readable lines on stderr (ANSI colours only on a terminal) or JSON lines,
//! and — only when `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is
//! set — an OpenTelemetry layer exporting spans over OTLP/gRPC in batches. Without an
//! endpoint nothing about OpenTelemetry is built: no thread, no exporter, no log line.
//!
//! The SDK reads the standard variables itself: `OTEL_SERVICE_NAME` and
//! `OTEL_RESOURCE_ATTRIBUTES` (the resource; the binary's name when neither names the
//! service), `OTEL_TRACES_SAMPLER` / `OTEL_TRACES_SAMPLER_ARG` (default
//! `parentbased_always_on`), `OTEL_BSP_*` (the batch processor), and the exporter's
//! `OTEL_EXPORTER_OTLP_*` (endpoint, headers, timeout, compression).
//!
//! The propagation helpers carry a span's context as W3C `traceparent`/`tracestate`: into
//! and out of gRPC metadata, and as plain strings for messages on a stream. Malformed input
//! is ignored (the span starts a trace of its own); nothing here panics on what it reads.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::str::FromStr;
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{Status, TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
#[cfg(feature = "otlp")]
use tonic::codegen::http;
#[cfg(feature = "otlp")]
use tonic::metadata::{KeyRef, MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// The variables that turn export on (either one).
pub const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// How long [`Guard::shutdown`] waits for the last spans to leave.
const FLUSH_WAIT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unknown --log-format '{0}': use text or json")]
    LogFormat(String),
    #[error("RUST_LOG is not a valid filter ({0}): e.g. RUST_LOG=info,automaton_coordinator=debug")]
    Filter(String),
    #[error("cannot start the trace exporter's runtime: {0}")]
    Runtime(std::io::Error),
    #[error(
        "cannot build the OTLP exporter ({0}): check OTEL_EXPORTER_OTLP_ENDPOINT, e.g. http://127.0.0.1:4317"
    )]
    Exporter(String),
    #[error("a log subscriber is already installed: {0}")]
    AlreadyInstalled(String),
}

/// How log lines look on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One human-readable line per event (colours on a terminal).
    #[default]
    Text,
    /// One JSON object per event.
    Json,
}

impl FromStr for LogFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<LogFormat, Error> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(Error::LogFormat(other.to_string())),
        }
    }
}

/// Keeps the exporter alive; [`Guard::shutdown`] flushes the spans not yet sent. Dropping it
/// flushes too (blocking): call `shutdown` outside any async runtime, after the program's
/// runtime has stopped, so the last spans (those its tasks closed) are in the batch.
pub struct Guard {
    provider: Option<SdkTracerProvider>,
    /// The exporter's own runtime: its gRPC channel lives here, so a flush works whatever
    /// the program's runtime is doing (stopped, or a current-thread one blocked on us).
    runtime: Option<tokio::runtime::Runtime>,
}

impl Guard {
    /// Whether spans are exported (an OTLP endpoint was set).
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans still buffered and stops the exporter.
    pub fn shutdown(mut self) {
        self.flush();
    }

    fn flush(&mut self) {
        if let Some(p) = self.provider.take() {
            // Blocks until the batch thread has exported what it holds (or its timeout).
            if let Err(e) = p.shutdown_with_timeout(FLUSH_WAIT) {
                eprintln!("WARNING: traces not all exported at shutdown: {e}");
            }
        }
        if let Some(rt) = self.runtime.take() {
            // Never blocks, so a guard dropped on an async thread cannot panic here.
            rt.shutdown_background();
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Whether an OTLP endpoint is configured (a set, non-empty variable).
pub fn export_configured() -> bool {
    ENDPOINT_VARS
        .iter()
        .any(|k| std::env::var(k).is_ok_and(|v| !v.trim().is_empty()))
}

/// Installs the process's subscriber for `service` (the default `service.name`): logs on
/// stderr in `format`, filtered by `RUST_LOG`, and spans exported over OTLP when an
/// endpoint is set. Call once, before any runtime is started.
pub fn init(service: &str, format: LogFormat) -> Result<Guard, Error> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => {
            EnvFilter::try_new(&v).map_err(|e| Error::Filter(e.to_string()))?
        }
        _ => EnvFilter::new("info"),
    };
    let logs = match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .boxed(),
    };
    #[cfg(feature = "otlp")]
    let (provider, runtime) = if export_configured() {
        let (p, rt) = provider(service)?;
        (Some(p), Some(rt))
    } else {
        (None, None)
    };
    #[cfg(not(feature = "otlp"))]
    let (provider, runtime): (Option<SdkTracerProvider>, Option<tokio::runtime::Runtime>) =
        if export_configured() {
            return Err(Error::Exporter(format!(
                "{service} was built without OTLP export (automaton-telemetry's `otlp` feature): unset the OTEL_EXPORTER_OTLP_* endpoint"
            )));
        } else {
            (None, None)
        };
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("automaton"))
            // The span tree is the point; threads and code locations add nothing to read.
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_tracked_inactivity(false)
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(logs)
        .with(otel)
        .try_init()
        .map_err(|e| Error::AlreadyInstalled(e.to_string()))?;
    Ok(Guard { provider, runtime })
}

/// The tracer provider: the resource from the standard variables (or `service`), the
/// sampler from `OTEL_TRACES_SAMPLER`, a batch exporter over OTLP/gRPC.
#[cfg(feature = "otlp")]
fn provider(service: &str) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), Error> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    // The channel (connected lazily) spawns its worker on the runtime entered here.
    let _entered = runtime.enter();
    // The endpoint: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()
        .map_err(|e| Error::Exporter(e.to_string()))?;
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::new("service.name"))
        .is_some_and(|v| !v.as_str().starts_with("unknown_service"));
    let resource = if named {
        detected
    } else {
        Resource::builder()
            .with_service_name(service.to_string())
            .build()
    };
    let provider = SdkTracerProvider::builder()
        .with_resource(resource)
        .with_batch_exporter(exporter)
        .build();
    drop(_entered);
    Ok((provider, runtime))
}

/// A carrier over gRPC metadata.
#[cfg(feature = "otlp")]
struct Metadata<'a>(&'a mut MetadataMap);

#[cfg(feature = "otlp")]
impl Injector for Metadata<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

#[cfg(feature = "otlp")]
struct MetadataRead<'a>(&'a MetadataMap);

#[cfg(feature = "otlp")]
impl Extractor for MetadataRead<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                KeyRef::Ascii(k) => Some(k.as_str()),
                KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

#[cfg(feature = "otlp")]
struct Headers<'a>(&'a http::HeaderMap);

#[cfg(feature = "otlp")]
impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Puts the current span's trace context into `metadata` (`traceparent`, `tracestate`).
/// Nothing when no span is exported.
#[cfg(feature = "otlp")]
pub fn inject(metadata: &mut MetadataMap) {
    inject_span(&tracing::Span::current(), metadata);
}

/// Puts `span`'s trace context into `metadata`.
#[cfg(feature = "otlp")]
pub fn inject_span(span: &tracing::Span, metadata: &mut MetadataMap) {
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut Metadata(metadata));
}

/// Whether a request's headers carry a `traceparent` (the caller is traced).
#[cfg(feature = "otlp")]
pub fn has_traceparent(headers: &http::HeaderMap) -> bool {
    headers.contains_key("traceparent")
}

/// Makes `span` a child of the context in `headers` (an HTTP/2 request's, before tonic
/// parses it). Call before `span` is first entered; a bad or absent `traceparent` changes
/// nothing.
#[cfg(feature = "otlp")]
pub fn set_parent_from_headers(span: &tracing::Span, headers: &http::HeaderMap) {
    set_parent(
        span,
        TraceContextPropagator::new().extract(&Headers(headers)),
    );
}

/// Makes `span` a child of the context in gRPC `metadata`.
#[cfg(feature = "otlp")]
pub fn set_parent_from_metadata(span: &tracing::Span, metadata: &MetadataMap) {
    set_parent(
        span,
        TraceContextPropagator::new().extract(&MetadataRead(metadata)),
    );
}

/// A span's context as W3C strings, for a message on a stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceParent {
    /// `00-{trace id}-{span id}-{flags}`; empty when the span is not exported.
    pub traceparent: String,
    /// Vendor entries (`k=v,…`); usually empty.
    pub tracestate: String,
}

/// `span`'s context as `traceparent`/`tracestate` strings (empty when not exported).
pub fn traceparent(span: &tracing::Span) -> TraceParent {
    if span.is_disabled() {
        return TraceParent::default();
    }
    let mut carrier: HashMap<String, String> = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    TraceParent {
        traceparent: carrier.remove("traceparent").unwrap_or_default(),
        tracestate: carrier.remove("tracestate").unwrap_or_default(),
    }
}

/// Makes `span` a child of the context in `traceparent`/`tracestate` strings (from a
/// message). Empty or malformed strings change nothing.
pub fn set_parent_from_traceparent(span: &tracing::Span, traceparent: &str, tracestate: &str) {
    if traceparent.is_empty() {
        return;
    }
    let mut carrier: HashMap<String, String> = HashMap::new();
    carrier.insert("traceparent".into(), traceparent.to_string());
    if !tracestate.is_empty() {
        carrier.insert("tracestate".into(), tracestate.to_string());
    }
    set_parent(span, TraceContextPropagator::new().extract(&carrier));
}

fn set_parent(span: &tracing::Span, cx: opentelemetry::Context) {
    // An invalid traceparent extracts as an empty context: keep the span a root then.
    if !cx.span().span_context().is_valid() || span.is_disabled() {
        return;
    }
    // Fails only without the OpenTelemetry layer or once the span has started: then
    // there is nothing to join.
    let _ = span.set_parent(cx);
}

/// Marks `span` failed, with `message` (OpenTelemetry status ERROR and its description).
pub fn record_error(span: &tracing::Span, message: &str) {
    if span.is_disabled() {
        return;
    }
    span.set_status(Status::error(message.to_string()));
}

/// The W3C trace id of `span` (32 hex digits), when it is exported; for log lines and
/// tests.
pub fn trace_id(span: &tracing::Span) -> Option<String> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_format_parses_text_and_json_and_names_the_choices_otherwise() {
        assert_eq!("text".parse::<LogFormat>().ok(), Some(LogFormat::Text));
        assert_eq!("json".parse::<LogFormat>().ok(), Some(LogFormat::Json));
        let e = "yaml".parse::<LogFormat>().err().map(|e| e.to_string());
        assert_eq!(
            e.as_deref(),
            Some("unknown --log-format 'yaml': use text or json")
        );
    }

    #[test]
    fn bad_traceparent_strings_are_ignored_without_a_subscriber() {
        let span = tracing::Span::none();
        for bad in [
            "",
            "garbage",
            "00-zz-yy-01",
            "00-00000000000000000000000000000000-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra-\u{1F600}",
        ] {
            set_parent_from_traceparent(&span, bad, "x=\u{0}");
        }
        assert_eq!(traceparent(&span), TraceParent::default());
        assert_eq!(trace_id(&span), None);
    }

    #[test]
    fn inject_writes_nothing_for_a_span_that_is_not_exported() {
        let mut md = MetadataMap::new();
        inject_span(&tracing::Span::none(), &mut md);
        assert!(md.is_empty());
    }

    #[test]
    fn traceparent_round_trips_through_metadata_and_headers() {
        // With the layer installed for this thread only: a child of an extracted context
        // carries the same trace id out again.
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            let mut headers = http::HeaderMap::new();
            headers.insert("traceparent", http::HeaderValue::from_static(tp));
            assert!(has_traceparent(&headers));
            let span = tracing::info_span!("child");
            set_parent_from_headers(&span, &headers);
            assert_eq!(
                trace_id(&span).as_deref(),
                Some("4bf92f3577b34da6a3ce929d0e0e4736")
            );
            let mut md = MetadataMap::new();
            inject_span(&span, &mut md);
            let sent = md.get("traceparent").and_then(|v| v.to_str().ok());
            assert!(
                sent.is_some_and(|s| s.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-")
                    && !s.contains("00f067aa0ba902b7")),
                "{sent:?}"
            );
            let next = tracing::info_span!("grandchild");
            set_parent_from_metadata(&next, &md);
            assert_eq!(trace_id(&next), trace_id(&span));
            let strings = traceparent(&next);
            let last = tracing::info_span!("from a message");
            set_parent_from_traceparent(&last, &strings.traceparent, &strings.tracestate);
            assert_eq!(trace_id(&last), trace_id(&span));
            // A malformed one leaves the span a root of a new trace.
            let lone = tracing::info_span!("lone");
            set_parent_from_traceparent(&lone, "00-not-a-trace-01", "");
            assert_ne!(trace_id(&lone), trace_id(&span));
        });
    }
}
