//! Prometheus exposition: counters, gauges and histograms on plain atomics, the text format
//! 0.0.4 they are written in, and the small HTTP endpoint that serves it (`GET /metrics`).
//!
//! The hot paths only touch atomics (`Counter::inc`, `Histogram::observe`); everything else a
//! process exposes is computed when it is scraped, by the [`Render`] it hands to [`serve`].
//! The encoder is written out here rather than taken from a crate: the four metric kinds it
//! needs are a few lines each, and the format is exact and checked by the tests below.
//!
//! The endpoint is HTTP/1.x, one request per connection: a request head larger than
//! [`MAX_HEAD`] gets 431 (414 for a request line that long), a client slower than
//! [`READ_TIMEOUT`] gets 408, at most [`MAX_CONNECTIONS`] are served at once, and an error
//! answer is followed by a lingering close so the client reads it even if it is still
//! sending.

use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A monotonically increasing count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    pub const fn new() -> Counter {
        Counter(AtomicU64::new(0))
    }

    #[inline]
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down.
#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    pub const fn new() -> Gauge {
        Gauge(AtomicI64::new(0))
    }

    pub fn set(&self, v: i64) {
        self.0.store(v, Ordering::Relaxed);
    }

    pub fn add(&self, n: i64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Bucket bounds (seconds) for request-scale latencies: 100 µs to 10 s.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Bucket bounds (seconds) for agent runs and phases: 1 s to a day.
pub const PHASE_BUCKETS: &[f64] = &[
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0,
    28800.0, 86400.0,
];

/// Durations in fixed buckets. The count is the sum of the buckets, so a scrape always sees
/// a histogram whose `+Inf` bucket equals its `_count`.
#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// One per bound, then the overflow (above the last bound); not cumulative.
    buckets: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// `bounds` must be increasing (see [`LATENCY_BUCKETS`], [`PHASE_BUCKETS`]).
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.bounds.partition_point(|b| *b < secs);
        if let Some(b) = self.buckets.get(i) {
            b.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum()
    }

    pub fn sum_seconds(&self) -> f64 {
        self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9
    }
}

/// The kind a metric family is declared with (`# TYPE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// A scrape's text, family by family: [`Text::family`] once, then its samples.
#[derive(Debug, Default)]
pub struct Text {
    out: String,
}

impl Text {
    pub fn new() -> Text {
        Text::default()
    }

    /// Starts the family `name`: its `# HELP` and `# TYPE` lines.
    pub fn family(&mut self, name: &str, kind: Kind, help: &str) -> &mut Self {
        let help = help.replace('\\', "\\\\").replace('\n', "\\n");
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {}", kind.as_str());
        self
    }

    /// One sample of the current family.
    pub fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) -> &mut Self {
        self.out.push_str(name);
        write_labels(&mut self.out, labels, None);
        self.out.push(' ');
        write_value(&mut self.out, value);
        self.out.push('\n');
        self
    }

    /// A whole counter family with one unlabelled sample.
    pub fn counter(&mut self, name: &str, help: &str, value: u64) -> &mut Self {
        self.family(name, Kind::Counter, help)
            .sample(name, &[], value as f64)
    }

    /// A whole gauge family with one unlabelled sample.
    pub fn gauge(&mut self, name: &str, help: &str, value: f64) -> &mut Self {
        self.family(name, Kind::Gauge, help)
            .sample(name, &[], value)
    }

    /// One labelled series of the current histogram family: its cumulative buckets, sum and
    /// count.
    pub fn histogram(&mut self, name: &str, labels: &[(&str, &str)], h: &Histogram) -> &mut Self {
        let counts: Vec<u64> = h
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let mut cumulative = 0u64;
        let bucket = format!("{name}_bucket");
        for (i, n) in counts.iter().enumerate() {
            cumulative += n;
            let le = match h.bounds.get(i) {
                Some(b) => format_value(*b),
                None => "+Inf".to_string(),
            };
            self.out.push_str(&bucket);
            write_labels(&mut self.out, labels, Some(&le));
            let _ = writeln!(self.out, " {cumulative}");
        }
        self.sample(&format!("{name}_sum"), labels, h.sum_seconds());
        self.sample(&format!("{name}_count"), labels, cumulative as f64)
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn write_labels(out: &mut String, labels: &[(&str, &str)], le: Option<&str>) {
    if labels.is_empty() && le.is_none() {
        return;
    }
    out.push('{');
    let mut first = true;
    for (k, v) in labels.iter().copied().chain(le.map(|le| ("le", le))) {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(k);
        out.push_str("=\"");
        for c in v.chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                '"' => out.push_str("\\\""),
                '\n' => out.push_str("\\n"),
                c => out.push(c),
            }
        }
        out.push('"');
    }
    out.push('}');
}

fn format_value(v: f64) -> String {
    let mut s = String::new();
    write_value(&mut s, v);
    s
}

/// Integers without a fraction; other values as Rust's shortest round-trip form, which Go's
/// `ParseFloat` (Prometheus) reads back exactly.
fn write_value(out: &mut String, v: f64) {
    if v.is_nan() {
        out.push_str("NaN");
    } else if v.is_infinite() {
        out.push_str(if v > 0.0 { "+Inf" } else { "-Inf" });
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        let _ = write!(out, "{}", v as i64);
    } else {
        let _ = write!(out, "{v}");
    }
}

/// What a scrape answers: the whole text, computed when asked.
pub type Render = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = String> + Send>> + Send + Sync>;

/// The content type of text format 0.0.4.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";
/// The largest request head (request line and headers) read.
pub const MAX_HEAD: usize = 8 * 1024;
/// How long a client may take to send its request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long writing an answer may take.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long computing an answer may take before the scrape gets 503.
const RENDER_TIMEOUT: Duration = Duration::from_secs(20);
/// Connections served at once; more are closed at once.
pub const MAX_CONNECTIONS: usize = 32;
/// After an error answer, what is read and dropped (bytes, time) before closing, so the
/// client reads the answer instead of a reset.
const LINGER_BYTES: usize = 4 << 20;
const LINGER_TIME: Duration = Duration::from_secs(2);

/// Serves `render` on `listener` for as long as the process runs (a scrape needs nothing
/// drained at exit), and logs where (`metrics listening on http://ADDR/metrics`, which the
/// benches read). Must be called inside a tokio runtime.
pub fn spawn(listener: TcpListener, render: Render) -> std::io::Result<std::net::SocketAddr> {
    let at = listener.local_addr()?;
    tracing::info!(address = %at, "metrics listening on http://{at}/metrics");
    tokio::spawn(serve(listener, render, std::future::pending()));
    Ok(at)
}

/// Serves `GET /metrics` (and `HEAD`) on `listener` with what `render` returns, until
/// `shutdown` resolves.
pub async fn serve(listener: TcpListener, render: Render, shutdown: impl Future<Output = ()>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => return,
        };
        let (stream, _) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors, say: wait rather than spin.
                tracing::warn!(error = %e, "metrics endpoint cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // Shed load: a flood of connections gets closed, not queued.
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let render = render.clone();
        tokio::spawn(async move {
            connection(stream, render).await;
            drop(permit);
        });
    }
}

/// Why a request head could not be read.
enum Head {
    /// Larger than [`MAX_HEAD`]; whether its request line ended within it.
    TooLarge { line_ended: bool },
    /// The client closed or the socket failed.
    Gone,
}

async fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, Head> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await.map_err(|_| Head::Gone)?;
        if n == 0 {
            return Err(Head::Gone);
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = head_end(&buf) {
            buf.truncate(end);
            return Ok(buf);
        }
        if buf.len() > MAX_HEAD {
            return Err(Head::TooLarge {
                line_ended: buf.contains(&b'\n'),
            });
        }
    }
}

/// Where the head ends (a blank line), if it does.
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = buf.windows(2).position(|w| w == b"\n\n");
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What a request asks for, judged from its request line.
#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics { head_only: bool },
    NotFound,
    MethodNotAllowed,
    BadRequest,
}

fn route(head: &[u8]) -> Route {
    let line_end = head.iter().position(|b| *b == b'\n').unwrap_or(head.len());
    let Ok(line) = std::str::from_utf8(&head[..line_end]) else {
        return Route::BadRequest;
    };
    let mut parts = line.trim_end_matches('\r').split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Route::BadRequest;
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Route::BadRequest;
    }
    let path = target.split('?').next().unwrap_or(target);
    if path != "/metrics" {
        return Route::NotFound;
    }
    match method {
        "GET" => Route::Metrics { head_only: false },
        "HEAD" => Route::Metrics { head_only: true },
        _ => Route::MethodNotAllowed,
    }
}

async fn connection(mut stream: TcpStream, render: Render) {
    let head = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Ok(Ok(head)) => head,
        Ok(Err(Head::Gone)) => return,
        Ok(Err(Head::TooLarge { line_ended })) => {
            let (status, why) = if line_ended {
                (
                    "431 Request Header Fields Too Large",
                    "request head too large",
                )
            } else {
                ("414 URI Too Long", "request line too long")
            };
            return refuse(stream, status, why).await;
        }
        Err(_) => return refuse(stream, "408 Request Timeout", "request too slow").await,
    };
    let (status, body, head_only) = match route(&head) {
        Route::Metrics { head_only } => {
            match tokio::time::timeout(RENDER_TIMEOUT, render()).await {
                Ok(text) => ("200 OK", text, head_only),
                Err(_) => (
                    "503 Service Unavailable",
                    "metrics took too long to compute\n".to_string(),
                    head_only,
                ),
            }
        }
        Route::NotFound => (
            "404 Not Found",
            "not found: metrics are at /metrics\n".to_string(),
            false,
        ),
        Route::MethodNotAllowed => (
            "405 Method Not Allowed",
            "use GET /metrics\n".to_string(),
            false,
        ),
        Route::BadRequest => return refuse(stream, "400 Bad Request", "malformed request").await,
    };
    let allow = if status.starts_with("405") {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let answer = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        body.len()
    );
    let _ = tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(answer.as_bytes()).await?;
        if !head_only {
            stream.write_all(body.as_bytes()).await?;
        }
        stream.shutdown().await
    })
    .await;
}

/// Answers an error and closes lingering: the rest of what the client sends is read and
/// dropped (bounded), so closing does not reset the connection before it reads the answer.
async fn refuse(mut stream: TcpStream, status: &str, why: &str) {
    let answer = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{why}\n",
        why.len() + 1
    );
    let written = tokio::time::timeout(WRITE_TIMEOUT, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
    if !matches!(written, Ok(Ok(()))) {
        return;
    }
    let _ = tokio::time::timeout(LINGER_TIME, async {
        let mut sink = [0u8; 8192];
        let mut read = 0usize;
        while read < LINGER_BYTES {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => read += n,
            }
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_is_cumulative_with_le_last_and_count_equal_to_inf() {
        let h = Histogram::new(&[0.01, 0.1, 1.0]);
        for ms in [5, 10, 50, 2000] {
            h.observe(Duration::from_millis(ms));
        }
        let mut t = Text::new();
        t.family("x_seconds", Kind::Histogram, "x");
        t.histogram("x_seconds", &[("phase", "design")], &h);
        let text = t.finish();
        let expected = "# HELP x_seconds x\n# TYPE x_seconds histogram\n\
            x_seconds_bucket{phase=\"design\",le=\"0.01\"} 2\n\
            x_seconds_bucket{phase=\"design\",le=\"0.1\"} 3\n\
            x_seconds_bucket{phase=\"design\",le=\"1\"} 3\n\
            x_seconds_bucket{phase=\"design\",le=\"+Inf\"} 4\n\
            x_seconds_sum{phase=\"design\"} 2.065\n\
            x_seconds_count{phase=\"design\"} 4\n";
        assert_eq!(text, expected);
    }

    #[test]
    fn label_values_and_help_are_escaped() {
        let mut t = Text::new();
        t.family("g", Kind::Gauge, "a \\ b\nc");
        t.sample("g", &[("m", "say \"hi\"\\\n")], 1.5);
        assert_eq!(
            t.finish(),
            "# HELP g a \\\\ b\\nc\n# TYPE g gauge\ng{m=\"say \\\"hi\\\"\\\\\\n\"} 1.5\n"
        );
    }

    #[test]
    fn values_are_written_as_prometheus_reads_them() {
        for (v, s) in [
            (0.0, "0"),
            (3.0, "3"),
            (-2.0, "-2"),
            (0.25, "0.25"),
            (1e20, "100000000000000000000"),
            (f64::INFINITY, "+Inf"),
            (f64::NEG_INFINITY, "-Inf"),
            (f64::NAN, "NaN"),
        ] {
            assert_eq!(format_value(v), s, "{v}");
        }
    }

    #[test]
    fn requests_are_routed_by_method_and_path() {
        let r = |s: &str| route(s.as_bytes());
        assert_eq!(
            r("GET /metrics HTTP/1.1\r\nHost: x"),
            Route::Metrics { head_only: false }
        );
        assert_eq!(
            r("GET /metrics?x=1 HTTP/1.0"),
            Route::Metrics { head_only: false }
        );
        assert_eq!(
            r("HEAD /metrics HTTP/1.1"),
            Route::Metrics { head_only: true }
        );
        assert_eq!(r("GET /nope HTTP/1.1"), Route::NotFound);
        assert_eq!(r("POST /metrics HTTP/1.1"), Route::MethodNotAllowed);
        assert_eq!(r("GET /metrics"), Route::BadRequest);
        assert_eq!(r("GET /metrics HTTP/2 x"), Route::BadRequest);
        assert_eq!(r("GET metrics HTTP/1.1"), Route::BadRequest);
        assert_eq!(route(b"GET /\xff HTTP/1.1"), Route::BadRequest);
    }

    #[test]
    fn the_head_ends_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nbody"), Some(20));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n"), None);
    }
}
