//! The metering proxy: what a real agent's model server says each request used. Agents that
//! talk to an OpenAI-compatible server (vLLM, llama.cpp, Ollama's `/v1`: chat completions,
//! completions, the Responses API), to its Anthropic-style `/v1/messages` (Claude Code) or
//! to Ollama's own API are pointed at `http://127.0.0.1:PORT/run/{id}` instead of the
//! server; every request is forwarded unchanged (bar hop-by-hop headers, and
//! `stream_options.include_usage` added to streamed completions so the last chunk carries
//! usage), and the response is streamed back as it arrives while the usage it carries is read
//! on the way. A run's peak context is the largest prompt + completion tokens over its
//! requests.
//!
//! The proxy never decides anything for the agent: a response it cannot read (not JSON, too
//! large, compressed, cut off) is passed through and simply not counted. A request to a
//! metered endpoint that fails (the server unreachable, or an error status) is counted as
//! failed, with why, for the run's report when it fails (`failure_note`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::header::{self, HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::Value;

use crate::probe::http::Url;

/// A non-streamed response larger than this is passed through unparsed.
pub const MAX_JSON_BODY: usize = 8 << 20;
/// An SSE or NDJSON line longer than this is passed through unparsed.
pub const MAX_LINE: usize = 1 << 20;
/// A request body larger than this is forwarded as it comes, without `include_usage` added.
pub const MAX_REWRITE: u64 = 16 << 20;
/// Connecting to the model server; the request itself may take as long as the model needs.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot meter --model-server {url}: {why}")]
    Upstream { url: String, why: String },
    #[error("cannot listen on 127.0.0.1 for the metering proxy: {0}")]
    Bind(std::io::Error),
}

/// What one run's requests reported.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Requests to a metered endpoint.
    pub requests: u64,
    /// Of those, responses whose usage could be read.
    pub counted: u64,
    /// The largest context (prompt + completion tokens) one request used.
    pub peak: Option<u64>,
}

/// What one run's requests to a metered endpoint that failed say: the model server could not
/// be reached, or answered with an error status (4xx, 5xx).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Failures {
    /// Requests that failed.
    pub failed: u64,
    /// Why the last one failed (`connection refused`, `HTTP 503 Service Unavailable`).
    pub last: Option<String>,
    /// Of those, the model server could not be reached at all.
    pub unreachable: u64,
}

/// For a run that failed or wrote no artifact: what its model requests say, if they failed.
/// Most of them failed (more than half): `model server unreachable (27 of 27 requests failed:
/// connection refused)` (`model server failing (…)` when it answered with errors); some:
/// `3 of 10 model requests failed: …`; none: `None`.
pub fn failure_note(u: &Usage, f: &Failures) -> Option<String> {
    if f.failed == 0 || u.requests == 0 {
        return None;
    }
    let why = f.last.as_deref().unwrap_or("unknown");
    Some(if f.failed * 2 > u.requests {
        let what = if f.unreachable * 2 > u.requests {
            "unreachable"
        } else {
            "failing"
        };
        format!(
            "model server {what} ({} of {} requests failed: {why})",
            f.failed, u.requests
        )
    } else {
        format!(
            "{} of {} model requests failed: {why}",
            f.failed, u.requests
        )
    })
}

/// Where a run's peak context came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeakSource {
    /// The agent's own `.automaton-task/usage.json`.
    Agent,
    /// The model server's `usage`, read by this proxy.
    ModelServer,
}

impl PeakSource {
    /// The wire name (`RunUpdate.peak_context_source`).
    pub fn as_str(self) -> &'static str {
        match self {
            PeakSource::Agent => "agent",
            PeakSource::ModelServer => "model_server",
        }
    }
}

/// A run's peak context and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peak {
    pub tokens: u64,
    pub source: PeakSource,
}

/// The run's peak: what the agent reported if it did, else what the model server reported.
pub fn peak_of(agent: Option<u64>, metered: Option<Usage>) -> Option<Peak> {
    match (agent, metered.and_then(|u| u.peak)) {
        (Some(tokens), _) => Some(Peak {
            tokens,
            source: PeakSource::Agent,
        }),
        (None, Some(tokens)) => Some(Peak {
            tokens,
            source: PeakSource::ModelServer,
        }),
        (None, None) => None,
    }
}

struct Shared {
    upstream: Url,
    /// `--model-server` as given, for messages.
    server: String,
    runs: Mutex<HashMap<String, Usage>>,
    /// Per run, its failed requests.
    failures: Mutex<HashMap<String, Failures>>,
    next: AtomicU64,
}

impl Shared {
    /// Counts a failed request of run `id`.
    fn failed(&self, id: &str, why: String, unreachable: bool) {
        let mut f = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = f.get_mut(id) {
            f.failed += 1;
            f.unreachable += u64::from(unreachable);
            f.last = Some(why);
        }
    }

    fn with_run(&self, id: &str, f: impl FnOnce(&mut Usage)) -> bool {
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        match runs.get_mut(id) {
            Some(u) => {
                f(u);
                true
            }
            None => false,
        }
    }
}

/// The proxy, listening on 127.0.0.1; stops when dropped.
pub struct Meter {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: tokio::task::JoinHandle<()>,
}

impl std::fmt::Debug for Meter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Meter")
            .field("addr", &self.addr)
            .field("server", &self.shared.server)
            .finish_non_exhaustive()
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl Meter {
    /// Listens on `127.0.0.1:0` in front of `model_server` (`http://HOST[:PORT][/PREFIX]`).
    /// Must be called inside a tokio runtime.
    pub async fn start(model_server: &str) -> Result<Meter, Error> {
        let upstream = Url::parse(model_server).map_err(|e| Error::Upstream {
            url: model_server.to_string(),
            why: match e {
                crate::probe::ProbeError::Url { why, .. } => why,
                other => other.to_string(),
            },
        })?;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(Error::Bind)?;
        let addr = listener.local_addr().map_err(Error::Bind)?;
        let shared = Arc::new(Shared {
            upstream,
            server: model_server.trim_end_matches('/').to_string(),
            runs: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Meter {
            addr,
            shared,
            accept,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A fresh prefix for one run; its usage is kept until the returned handle is dropped.
    pub fn register(&self) -> Metered {
        let n = self.shared.next.fetch_add(1, Ordering::Relaxed);
        let id = format!("r{n}");
        self.shared
            .runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), Usage::default());
        self.shared
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id.clone(), Failures::default());
        Metered {
            url: format!("http://{}/run/{id}", self.addr),
            id,
            shared: self.shared.clone(),
        }
    }
}

/// One run's prefix on the proxy. Requests under it after the handle is dropped get 404.
pub struct Metered {
    id: String,
    url: String,
    shared: Arc<Shared>,
}

impl Metered {
    /// `http://127.0.0.1:PORT/run/{id}`: stands for the model server's root.
    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn usage(&self) -> Usage {
        let mut u = Usage::default();
        self.shared.with_run(&self.id, |x| u = *x);
        u
    }

    /// The run's failed requests so far.
    pub fn failures(&self) -> Failures {
        self.shared
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&self.id)
            .cloned()
            .unwrap_or_default()
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        self.shared
            .runs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        self.shared
            .failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of file descriptors, most likely: wait rather than spin.
                tracing::warn!(error = %e, "metering proxy: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| handle(shared.clone(), req));
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await
            {
                tracing::debug!(error = %e, "metering proxy: connection ended");
            }
        });
    }
}

type ProxyBody = UnsyncBoxBody<Bytes, hyper::Error>;

fn full(b: impl Into<Bytes>) -> ProxyBody {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

/// A one-line plain-text answer from the proxy itself.
fn text(status: StatusCode, line: String) -> Response<ProxyBody> {
    let mut r = Response::new(full(format!("{line}\n")));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Which usage a path's responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`, `/v1/completions`: `usage`, streamed as SSE only when asked
    /// for with `stream_options.include_usage`.
    Completions,
    /// Anthropic's `/v1/messages` (vLLM, llama.cpp, Ollama serve it for Claude Code): `usage`
    /// with `input_tokens` (+ cache) and `output_tokens`; streamed in `message_start` and
    /// `message_delta`.
    Messages,
    /// The Responses API, `/v1/responses`: `usage` with `input_tokens` and `output_tokens`;
    /// streamed in `response.completed`.
    Responses,
    /// Ollama's `/api/chat`, `/api/generate`: `prompt_eval_count` + `eval_count`, NDJSON.
    Ollama,
}

impl Endpoint {
    /// The endpoint a path (below the server's root) names, if it is metered.
    pub fn of(path: &str) -> Option<Endpoint> {
        let path = path.trim_end_matches('/');
        if path.ends_with("/chat/completions") || path.ends_with("/v1/completions") {
            Some(Endpoint::Completions)
        } else if path.ends_with("/v1/messages") {
            Some(Endpoint::Messages)
        } else if path.ends_with("/v1/responses") {
            Some(Endpoint::Responses)
        } else if path == "/api/chat" || path == "/api/generate" {
            Some(Endpoint::Ollama)
        } else {
            None
        }
    }
}

/// Headers that belong to one connection, not to the request (RFC 9110 §7.6.1).
fn strip_hop_by_hop(h: &mut HeaderMap) {
    let named: Vec<HeaderName> = h
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .collect();
    for n in named {
        h.remove(n);
    }
    for n in [
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    ] {
        h.remove(n);
    }
}

/// `body` with `stream_options.include_usage: true` added when it asks to stream and does
/// not say; `None` when it is left as it is.
pub fn with_include_usage(body: &[u8]) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let obj = v.as_object_mut()?;
    if obj.get("stream") != Some(&Value::Bool(true)) {
        return None;
    }
    match obj.get_mut("stream_options") {
        None | Some(Value::Null) => {
            obj.insert(
                "stream_options".into(),
                serde_json::json!({"include_usage": true}),
            );
        }
        Some(Value::Object(o)) if !o.contains_key("include_usage") => {
            o.insert("include_usage".into(), Value::Bool(true));
        }
        // The agent said (even `false`): its choice stands.
        _ => return None,
    }
    serde_json::to_vec(&v).ok()
}

async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    let path = req.uri().path().to_string();
    let Some((id, tail)) = path.strip_prefix("/run/").map(|r| match r.find('/') {
        Some(i) => (&r[..i], &r[i..]),
        None => (r, "/"),
    }) else {
        return Ok(text(
            StatusCode::NOT_FOUND,
            format!(
                "automaton-worker metering proxy: {path} is not a run's path: use $AUTOMATON_MODEL_URL"
            ),
        ));
    };
    let endpoint = Endpoint::of(tail);
    let known = shared.with_run(id, |u| {
        if endpoint.is_some() {
            u.requests += 1;
        }
    });
    if !known {
        return Ok(text(
            StatusCode::NOT_FOUND,
            format!("automaton-worker metering proxy: no run {id} (it has ended)"),
        ));
    }
    let id = id.to_string();
    let query = req
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let target = format!("{}{tail}{query}", shared.upstream.prefix);
    let (mut parts, incoming) = req.into_parts();
    parts.uri = match target.parse() {
        Ok(u) => u,
        Err(_) => {
            return Ok(text(
                StatusCode::BAD_REQUEST,
                format!("automaton-worker metering proxy: cannot forward {target}"),
            ));
        }
    };
    parts.version = hyper::Version::HTTP_11;
    strip_hop_by_hop(&mut parts.headers);
    let host = if shared.upstream.host.contains(':') {
        format!("[{}]", shared.upstream.host)
    } else {
        shared.upstream.host.clone()
    };
    let authority = if shared.upstream.port == 80 {
        host
    } else {
        format!("{host}:{}", shared.upstream.port)
    };
    if let Ok(v) = HeaderValue::from_str(&authority) {
        parts.headers.insert(header::HOST, v);
    }
    // The proxy answers `Expect: 100-continue` itself (hyper does, as it reads the body).
    parts.headers.remove(header::EXPECT);
    if endpoint.is_some() {
        // A compressed answer could not be read on the way.
        parts.headers.remove(header::ACCEPT_ENCODING);
    }
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let body = match (endpoint, &parts.method, declared) {
        (Some(Endpoint::Completions), &Method::POST, Some(n)) if n <= MAX_REWRITE => {
            let bytes = match Limited::new(incoming, MAX_REWRITE as usize).collect().await {
                Ok(c) => c.to_bytes(),
                Err(e) => {
                    return Ok(text(
                        StatusCode::BAD_REQUEST,
                        format!("automaton-worker metering proxy: cannot read the request: {e}"),
                    ));
                }
            };
            match with_include_usage(&bytes) {
                Some(changed) => {
                    parts
                        .headers
                        .insert(header::CONTENT_LENGTH, HeaderValue::from(changed.len()));
                    full(changed)
                }
                None => full(bytes),
            }
        }
        _ => incoming.boxed_unsync(),
    };
    let response = match forward(&shared, Request::from_parts(parts, body)).await {
        Ok(r) => r,
        Err(why) => {
            if endpoint.is_some() {
                shared.failed(&id, why.clone(), true);
            }
            tracing::warn!(server = %shared.server, error = %why, "metering proxy: model server unreachable");
            return Ok(text(
                StatusCode::BAD_GATEWAY,
                format!(
                    "automaton-worker metering proxy: model server {} unreachable: {why}",
                    shared.server
                ),
            ));
        }
    };
    let (mut parts, body) = response.into_parts();
    if endpoint.is_some() && (parts.status.is_client_error() || parts.status.is_server_error()) {
        shared.failed(&id, format!("HTTP {}", parts.status), false);
    }
    strip_hop_by_hop(&mut parts.headers);
    let scanner = endpoint.and_then(|e| Scanner::for_response(e, &parts.headers));
    let body = match scanner {
        Some(scan) => Metering {
            inner: body,
            scan,
            shared,
            id,
            counted: false,
        }
        .boxed_unsync(),
        None => body.boxed_unsync(),
    };
    Ok(Response::from_parts(parts, body))
}

/// One request on a fresh connection: agents send a request every few seconds at most, and
/// the model server is local, so a pool would buy nothing.
async fn forward(shared: &Shared, req: Request<ProxyBody>) -> Result<Response<Incoming>, String> {
    let addr = (shared.upstream.host.as_str(), shared.upstream.port);
    let stream =
        match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(io_why(&e)),
            Err(_) => {
                return Err(format!(
                    "no connection after {}s",
                    CONNECT_TIMEOUT.as_secs()
                ));
            }
        };
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "metering proxy: model server connection ended");
        }
    });
    sender.send_request(req).await.map_err(|e| e.to_string())
}

/// A connection error in a few words (`connection refused`), the OS's text otherwise.
fn io_why(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused => "connection refused".into(),
        K::ConnectionReset => "connection reset".into(),
        K::TimedOut => "connection timed out".into(),
        K::HostUnreachable => "host unreachable".into(),
        K::NetworkUnreachable => "network unreachable".into(),
        K::AddrNotAvailable => "address not available".into(),
        _ => e.to_string(),
    }
}

/// The response body on its way back, frames passed on as they come, read as they pass.
struct Metering {
    inner: Incoming,
    scan: Scanner,
    shared: Arc<Shared>,
    id: String,
    counted: bool,
}

impl Metering {
    fn note(&mut self) {
        let Some(ctx) = self.scan.context() else {
            return;
        };
        let first = !self.counted;
        self.counted = true;
        self.shared.with_run(&self.id, |u| {
            if first {
                u.counted += 1;
            }
            u.peak = Some(u.peak.map_or(ctx, |p| p.max(ctx)));
        });
    }
}

impl Body for Metering {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.scan.feed(data);
                }
                // Hyper may not ask again once the length is reached.
                if this.inner.is_end_stream() {
                    this.scan.finish();
                }
                this.note();
            }
            Poll::Ready(None) => {
                this.scan.finish();
                this.note();
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// How a response body is read: line by line (SSE `data:` lines, NDJSON) or as one JSON
/// document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Lines,
    Whole,
}

/// Reads the context a response reports, fed its bytes as they pass. Bounded: lines over
/// `MAX_LINE` and documents over `MAX_JSON_BODY` are skipped, never buffered whole.
#[derive(Debug)]
pub struct Scanner {
    mode: Mode,
    buf: Vec<u8>,
    /// The current line (or the document) went over its limit: drop it.
    skipping: bool,
    found: Option<u64>,
    /// Input and output counted apart (Anthropic, Responses API): a stream reports them in
    /// different events.
    input: Option<u64>,
    output: Option<u64>,
    finished: bool,
}

impl Scanner {
    /// A scanner for SSE or NDJSON bodies.
    pub fn lines() -> Scanner {
        Scanner::new(Mode::Lines)
    }

    /// A scanner for one JSON document.
    pub fn whole() -> Scanner {
        Scanner::new(Mode::Whole)
    }

    fn new(mode: Mode) -> Scanner {
        Scanner {
            mode,
            buf: Vec::new(),
            skipping: false,
            found: None,
            input: None,
            output: None,
            finished: false,
        }
    }

    /// The scanner for a response of `endpoint` with these headers; `None` when its body
    /// cannot be read (compressed).
    fn for_response(endpoint: Endpoint, headers: &HeaderMap) -> Option<Scanner> {
        let encoded = headers
            .get(header::CONTENT_ENCODING)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| !v.trim().eq_ignore_ascii_case("identity"));
        if encoded {
            return None;
        }
        let ctype = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        let streamed = ctype.starts_with("text/event-stream")
            || ctype.starts_with("application/x-ndjson")
            || ctype.starts_with("application/jsonl")
            // Ollama's native API streams NDJSON by default, whatever it is labelled.
            || endpoint == Endpoint::Ollama;
        Some(if streamed {
            Scanner::lines()
        } else {
            Scanner::whole()
        })
    }

    /// The largest context the response has reported so far.
    pub fn context(&self) -> Option<u64> {
        self.found
    }

    pub fn feed(&mut self, mut data: &[u8]) {
        if self.finished {
            return;
        }
        match self.mode {
            Mode::Whole => {
                if self.skipping {
                    return;
                }
                if self.buf.len() + data.len() > MAX_JSON_BODY {
                    self.skipping = true;
                    self.buf = Vec::new();
                    return;
                }
                self.buf.extend_from_slice(data);
            }
            Mode::Lines => {
                while let Some(nl) = data.iter().position(|b| *b == b'\n') {
                    let (line, rest) = data.split_at(nl);
                    if !self.skipping && self.buf.len() + line.len() <= MAX_LINE {
                        self.buf.extend_from_slice(line);
                        let line = std::mem::take(&mut self.buf);
                        self.line(&line);
                    }
                    self.buf.clear();
                    self.skipping = false;
                    data = &rest[1..];
                }
                if self.skipping {
                    return;
                }
                if self.buf.len() + data.len() > MAX_LINE {
                    self.skipping = true;
                    self.buf = Vec::new();
                } else {
                    self.buf.extend_from_slice(data);
                }
            }
        }
    }

    /// The body ended: read what is left (a document, a last line without its newline).
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let rest = std::mem::take(&mut self.buf);
        if self.skipping {
            return;
        }
        match self.mode {
            Mode::Whole => {
                if let Ok(v) = serde_json::from_slice::<Value>(&rest) {
                    self.seen(reported(&v));
                }
            }
            Mode::Lines => self.line(&rest),
        }
    }

    fn line(&mut self, line: &[u8]) {
        let line = line.trim_ascii();
        // SSE: `data: {...}`; other fields (`event:`, `id:`, `: comment`) carry no usage.
        let json = match line.strip_prefix(b"data:") {
            Some(d) => d.trim_ascii_start(),
            None => line,
        };
        if json.first() != Some(&b'{') {
            return;
        }
        if let Ok(v) = serde_json::from_slice::<Value>(json) {
            self.seen(reported(&v));
        }
    }

    fn seen(&mut self, r: Option<Reported>) {
        let max = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        let ctx = match r {
            None => return,
            Some(Reported::Context(c)) => c,
            Some(Reported::Parts { input, output }) => {
                self.input = max(self.input, input);
                self.output = max(self.output, output);
                self.input
                    .unwrap_or(0)
                    .saturating_add(self.output.unwrap_or(0))
            }
        };
        if ctx > 0 {
            self.found = max(self.found, Some(ctx));
        }
    }
}

/// What one response document (or chunk) reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reported {
    /// The whole context of the request.
    Context(u64),
    /// Input and output apart, either possibly missing (a stream's first event has the input,
    /// a later one the output).
    Parts {
        input: Option<u64>,
        output: Option<u64>,
    },
}

/// What one response document (or chunk) reports: OpenAI's `usage.prompt_tokens +
/// usage.completion_tokens` (else `usage.total_tokens`); Anthropic's and the Responses API's
/// `input_tokens` (+ `cache_creation_input_tokens` + `cache_read_input_tokens`) and
/// `output_tokens`, in `usage`, `message.usage` or `response.usage`; or Ollama's
/// `prompt_eval_count + eval_count`. `None` when it reports none (`usage: null`).
pub fn reported(v: &Value) -> Option<Reported> {
    let n = |o: &Value, k: &str| o.get(k).and_then(Value::as_u64);
    let sum = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    };
    let usage = ["/usage", "/message/usage", "/response/usage"]
        .iter()
        .filter_map(|p| v.pointer(p))
        .find(|u| u.is_object());
    let Some(u) = usage else {
        return sum(n(v, "prompt_eval_count"), n(v, "eval_count")).map(Reported::Context);
    };
    if let Some(c) = sum(n(u, "prompt_tokens"), n(u, "completion_tokens")) {
        return Some(Reported::Context(c));
    }
    let cached = sum(
        n(u, "cache_creation_input_tokens"),
        n(u, "cache_read_input_tokens"),
    );
    let input = sum(n(u, "input_tokens"), cached);
    let output = n(u, "output_tokens");
    if input.is_some() || output.is_some() {
        return Some(Reported::Parts { input, output });
    }
    n(u, "total_tokens").map(Reported::Context)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn scan_lines(chunks: &[&[u8]]) -> Option<u64> {
        let mut s = Scanner::lines();
        for c in chunks {
            s.feed(c);
        }
        s.finish();
        s.context()
    }

    const SSE: &str = "data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n\
        data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":4000,\"completion_tokens\":250,\"total_tokens\":4250}}\n\n\
        data: [DONE]\n\n";

    #[test]
    fn usage_is_read_from_a_non_streamed_json_response() {
        let mut s = Scanner::whole();
        s.feed(br#"{"choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":1200,"#);
        s.feed(br#""completion_tokens":34,"total_tokens":1234}}"#);
        assert_eq!(s.context(), None, "not before the end");
        s.finish();
        assert_eq!(s.context(), Some(1234));
    }

    #[test]
    fn usage_is_read_from_the_last_sse_chunk_and_null_usage_is_skipped() {
        assert_eq!(scan_lines(&[SSE.as_bytes()]), Some(4250));
    }

    #[test]
    fn usage_is_read_when_sse_chunks_split_anywhere() {
        let bytes = SSE.as_bytes();
        for cut in 1..bytes.len() {
            let (a, b) = bytes.split_at(cut);
            assert_eq!(scan_lines(&[a, b]), Some(4250), "split at {cut}");
        }
        // Byte by byte, with CRLF line ends.
        let crlf = SSE.replace('\n', "\r\n");
        let bytes: Vec<&[u8]> = crlf.as_bytes().chunks(1).collect();
        assert_eq!(scan_lines(&bytes), Some(4250));
    }

    #[test]
    fn malformed_json_and_missing_usage_count_nothing() {
        assert_eq!(
            scan_lines(&[b"data: {\"usage\": {\"prompt_tokens\": 12\n\n"]),
            None
        );
        assert_eq!(
            scan_lines(&[b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"]),
            None
        );
        assert_eq!(scan_lines(&[b"garbage\n: comment\nevent: x\n\n"]), None);
        let mut s = Scanner::whole();
        s.feed(b"<html>502 Bad Gateway</html>");
        s.finish();
        assert_eq!(s.context(), None);
        let mut s = Scanner::whole();
        s.feed(br#"{"usage":{"prompt_tokens":"many"}}"#);
        s.finish();
        assert_eq!(s.context(), None, "a string is no count");
        let mut s = Scanner::whole();
        s.feed(br#"{"usage":null}"#);
        s.finish();
        assert_eq!(s.context(), None);
    }

    #[test]
    fn a_huge_line_or_document_is_skipped_not_buffered_and_later_lines_still_count() {
        let huge = vec![b'x'; MAX_LINE + 10];
        let mut s = Scanner::lines();
        s.feed(b"data: {\"usage\":{\"prompt_tokens\":1,");
        for c in huge.chunks(4096) {
            s.feed(c);
            assert!(s.buf.len() <= MAX_LINE);
        }
        s.feed(b"}}\n\ndata: {\"usage\":{\"prompt_tokens\":70,\"completion_tokens\":7}}\n\n");
        s.finish();
        assert_eq!(s.context(), Some(77));
        let mut s = Scanner::whole();
        s.feed(br#"{"usage":{"prompt_tokens":5,"completion_tokens":5},"pad":""#);
        for c in vec![b'y'; MAX_JSON_BODY].chunks(1 << 16) {
            s.feed(c);
            assert!(s.buf.len() <= MAX_JSON_BODY);
        }
        s.feed(b"\"}");
        s.finish();
        assert_eq!(s.context(), None, "over the limit: passed through unparsed");
    }

    #[test]
    fn ollama_native_ndjson_reports_prompt_eval_count_plus_eval_count_on_the_done_line() {
        let body = b"{\"model\":\"m\",\"message\":{\"content\":\"a\"},\"done\":false}\n\
            {\"model\":\"m\",\"message\":{\"content\":\"\"},\"done\":true,\"prompt_eval_count\":900,\"eval_count\":100}";
        // The last line has no newline: it counts at the end.
        assert_eq!(scan_lines(&[body]), Some(1000));
    }

    /// The context one JSON document reports, read whole.
    fn ctx(v: Value) -> Option<u64> {
        let mut s = Scanner::whole();
        s.feed(v.to_string().as_bytes());
        s.finish();
        s.context()
    }

    #[test]
    fn total_tokens_alone_is_used_and_zero_is_nothing() {
        assert_eq!(
            ctx(serde_json::json!({"usage": {"total_tokens": 77}})),
            Some(77)
        );
        assert_eq!(
            ctx(serde_json::json!({"usage": {"prompt_tokens": 0, "completion_tokens": 0}})),
            None
        );
        assert_eq!(
            ctx(serde_json::json!({"usage": {"prompt_tokens": u64::MAX, "completion_tokens": 5}})),
            Some(u64::MAX)
        );
    }

    #[test]
    fn anthropic_messages_count_input_with_cache_plus_output_across_stream_events() {
        // Not streamed: one document.
        assert_eq!(
            ctx(serde_json::json!({"type": "message", "usage": {
                "input_tokens": 100, "cache_creation_input_tokens": 20,
                "cache_read_input_tokens": 4000, "output_tokens": 80}})),
            Some(4200)
        );
        // Streamed: the input in message_start, the (cumulative) output in message_delta.
        let sse = [
            "event: message_start",
            r#"data: {"type":"message_start","message":{"id":"m","usage":{"input_tokens":900,"cache_read_input_tokens":100,"output_tokens":1}}}"#,
            "",
            "event: content_block_delta",
            r#"data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#,
            "",
            "event: message_delta",
            r#"data: {"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":60}}"#,
            "",
            "event: message_delta",
            r#"data: {"type":"message_delta","delta":{},"usage":{"output_tokens":75}}"#,
            "",
            "event: message_stop",
            r#"data: {"type":"message_stop"}"#,
            "",
        ]
        .join("\n");
        assert_eq!(scan_lines(&[sse.as_bytes()]), Some(1075));
    }

    #[test]
    fn responses_api_usage_is_read_from_response_completed() {
        let sse = [
            "event: response.created",
            r#"data: {"type":"response.created","response":{"id":"r","usage":null}}"#,
            "",
            "event: response.completed",
            r#"data: {"type":"response.completed","response":{"id":"r","usage":{"input_tokens":2500,"input_tokens_details":{"cached_tokens":2000},"output_tokens":300,"total_tokens":2800}}}"#,
            "",
        ]
        .join("\n");
        assert_eq!(scan_lines(&[sse.as_bytes()]), Some(2800));
        assert_eq!(
            ctx(
                serde_json::json!({"object": "response", "usage": {"input_tokens": 10, "output_tokens": 5}})
            ),
            Some(15)
        );
    }

    #[test]
    fn include_usage_is_added_to_streamed_requests_only_and_an_explicit_choice_stands() {
        let added = with_include_usage(br#"{"model":"m","stream":true}"#).unwrap();
        let v: Value = serde_json::from_slice(&added).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], Value::Bool(true));
        assert_eq!(v["model"], "m");
        let merged = with_include_usage(
            br#"{"stream":true,"stream_options":{"continuous_usage_stats":true}}"#,
        )
        .unwrap();
        let v: Value = serde_json::from_slice(&merged).unwrap();
        assert_eq!(v["stream_options"]["include_usage"], Value::Bool(true));
        assert_eq!(
            v["stream_options"]["continuous_usage_stats"],
            Value::Bool(true)
        );
        assert_eq!(with_include_usage(br#"{"stream":false}"#), None);
        assert_eq!(with_include_usage(br#"{"messages":[]}"#), None);
        assert_eq!(
            with_include_usage(br#"{"stream":true,"stream_options":{"include_usage":false}}"#),
            None
        );
        assert_eq!(with_include_usage(b"not json"), None);
        assert_eq!(with_include_usage(b"[1,2]"), None);
    }

    #[test]
    fn endpoints_metered_are_the_completions_and_ollama_native_ones() {
        assert_eq!(
            Endpoint::of("/v1/chat/completions"),
            Some(Endpoint::Completions)
        );
        assert_eq!(Endpoint::of("/v1/completions"), Some(Endpoint::Completions));
        assert_eq!(Endpoint::of("/v1/messages"), Some(Endpoint::Messages));
        assert_eq!(Endpoint::of("/v1/messages/count_tokens"), None);
        assert_eq!(Endpoint::of("/v1/responses"), Some(Endpoint::Responses));
        assert_eq!(Endpoint::of("/api/chat"), Some(Endpoint::Ollama));
        assert_eq!(Endpoint::of("/api/generate"), Some(Endpoint::Ollama));
        assert_eq!(Endpoint::of("/v1/models"), None);
        assert_eq!(Endpoint::of("/api/ps"), None);
    }

    #[test]
    fn failed_model_requests_are_named_when_most_or_some_failed() {
        let u = |requests| Usage {
            requests,
            counted: 0,
            peak: None,
        };
        let f = |failed, unreachable, why: &str| Failures {
            failed,
            unreachable,
            last: Some(why.into()),
        };
        assert_eq!(
            failure_note(&u(27), &f(27, 27, "connection refused")).as_deref(),
            Some("model server unreachable (27 of 27 requests failed: connection refused)")
        );
        assert_eq!(
            failure_note(&u(4), &f(3, 0, "HTTP 503 Service Unavailable")).as_deref(),
            Some("model server failing (3 of 4 requests failed: HTTP 503 Service Unavailable)")
        );
        assert_eq!(
            failure_note(&u(10), &f(2, 2, "connection reset")).as_deref(),
            Some("2 of 10 model requests failed: connection reset")
        );
        assert_eq!(failure_note(&u(5), &Failures::default()), None);
        assert_eq!(failure_note(&u(0), &Failures::default()), None);
    }

    #[test]
    fn the_agents_report_wins_over_the_model_servers() {
        let metered = Usage {
            requests: 3,
            counted: 3,
            peak: Some(6000),
        };
        assert_eq!(
            peak_of(Some(5000), Some(metered)),
            Some(Peak {
                tokens: 5000,
                source: PeakSource::Agent
            })
        );
        assert_eq!(
            peak_of(None, Some(metered)),
            Some(Peak {
                tokens: 6000,
                source: PeakSource::ModelServer
            })
        );
        assert_eq!(peak_of(None, Some(Usage::default())), None);
        assert_eq!(peak_of(None, None), None);
    }
}
