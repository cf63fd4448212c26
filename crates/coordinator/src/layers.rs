//! Tower layers of the server, each with its reason. Besides the gate below, the server uses
//! tonic's per-connection concurrency limit: it bounds the work one connection can pile onto
//! the server (further requests wait, as HTTP/2 back-pressure).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::codegen::http;

use crate::auth::Callers;

/// The gate every request passes, in one layer (one pass over the request, no boxing):
/// - authentication: the bearer token is checked and the [`crate::auth::Caller`] put into
///   the request's extensions for the handlers; health and reflection stay open, so load
///   balancers and `grpcurl list` work without a token;
/// - a timeout: a stuck request (a disk that hangs) must not hold its client forever. It is
///   answered DEADLINE_EXCEEDED after `rpc_timeout`, or sooner if the client's own
///   `grpc-timeout` is shorter. It bounds the time to the response headers: a stream, once
///   open, lives on;
/// - tonic answers a request message over the size limit with OUT_OF_RANGE; the API
///   promises RESOURCE_EXHAUSTED (what gRPC itself uses for a message over the limit), so
///   the gate rewrites it.
#[derive(Clone)]
pub struct Gate {
    callers: Arc<Callers>,
    timeout: Duration,
}

impl Gate {
    pub fn new(callers: Callers, timeout: Duration) -> Gate {
        Gate {
            callers: Arc::new(callers),
            timeout,
        }
    }
}

impl<S> tower::Layer<S> for Gate {
    type Service = GateService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GateService {
            inner,
            callers: self.callers.clone(),
            timeout: self.timeout,
        }
    }
}

#[derive(Clone)]
pub struct GateService<S> {
    inner: S,
    callers: Arc<Callers>,
    timeout: Duration,
}

/// The client's deadline from a `grpc-timeout` header ("100m", "5S", …), if it sent one.
fn client_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (n, unit) = v.split_at(v.len() - 1);
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn open_path(path: &str) -> bool {
    path.starts_with("/grpc.health.v1.") || path.starts_with("/grpc.reflection.")
}

impl<S, B, R> tower::Service<http::Request<B>> for GateService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    R: Default,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = GateFuture<S::Future, R>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if !open_path(req.uri().path()) {
            match self.callers.check(req.headers()) {
                Ok(Some(caller)) => {
                    req.extensions_mut().insert(caller);
                }
                Ok(None) => {}
                Err(status) => {
                    return GateFuture::Refused {
                        response: Some(status.into_http()),
                    };
                }
            }
        }
        let limit = client_timeout(req.headers()).map_or(self.timeout, |t| t.min(self.timeout));
        GateFuture::Inner {
            fut: self.inner.call(req),
            deadline: tokio::time::sleep(limit),
            limit,
        }
    }
}

pin_project_lite::pin_project! {
    #[project = GateProj]
    pub enum GateFuture<F, R> {
        Inner { #[pin] fut: F, #[pin] deadline: tokio::time::Sleep, limit: Duration },
        Refused { response: Option<http::Response<R>> },
    }
}

impl<F, R, E> Future for GateFuture<F, R>
where
    F: Future<Output = Result<http::Response<R>, E>>,
    R: Default,
{
    type Output = Result<http::Response<R>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            GateProj::Refused { response } => match response.take() {
                Some(r) => Poll::Ready(Ok(r)),
                None => Poll::Pending,
            },
            GateProj::Inner {
                fut,
                deadline,
                limit,
            } => {
                let mut resp = match fut.poll(cx) {
                    Poll::Ready(Ok(r)) => r,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => {
                        if deadline.poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        let status = tonic::Status::deadline_exceeded(format!(
                            "no answer within {limit:?} (the server's rpc_timeout or the call's deadline): \
                             the coordinator is overloaded or its disk is stuck; retry, and check \
                             whether the change was made before repeating it"
                        ));
                        return Poll::Ready(Ok(status.into_http()));
                    }
                };
                if is_oversize(&resp) {
                    resp.headers_mut()
                        .insert("grpc-status", http::HeaderValue::from_static("8"));
                }
                Poll::Ready(Ok(resp))
            }
        }
    }
}

/// tonic's "message length too large" status (OUT_OF_RANGE), in the response headers.
fn is_oversize<R>(resp: &http::Response<R>) -> bool {
    resp.headers().get("grpc-status").is_some_and(|v| v == "11")
        && resp
            .headers()
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|m| {
                m.contains("message%20length%20too%20large")
                    || m.contains("message length too large")
            })
}

/// Joins a traced caller's trace: a request that carries a W3C `traceparent` (a worker's
/// call made under its agent run, an operator's traced tool) gets a server span, child of the
/// caller's span, around everything the request does; its gRPC error, if any, is recorded
/// on it. A request without one gets no span here: the lease hot path (claims from agents
/// that do not trace) pays one header lookup, nothing more.
#[derive(Clone, Copy, Default)]
pub struct Trace;

impl<S> tower::Layer<S> for Trace {
    type Service = TraceService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        TraceService { inner }
    }
}

#[derive(Clone)]
pub struct TraceService<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for TraceService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = TraceFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if !automaton_telemetry::trace::has_traceparent(req.headers()) {
            return TraceFuture::Plain {
                fut: self.inner.call(req),
            };
        }
        let path = req.uri().path();
        let (service, method) = path
            .trim_start_matches('/')
            .split_once('/')
            .unwrap_or(("", path));
        let span = tracing::info_span!(
            "rpc",
            otel.name = %path.trim_start_matches('/'),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.service = %service,
            rpc.method = %method,
            rpc.grpc.status_code = tracing::field::Empty,
        );
        automaton_telemetry::trace::set_parent_from_headers(&span, req.headers());
        let fut = span.in_scope(|| self.inner.call(req));
        TraceFuture::Traced { fut, span }
    }
}

pin_project_lite::pin_project! {
    #[project = TraceProj]
    pub enum TraceFuture<F> {
        Plain { #[pin] fut: F },
        Traced { #[pin] fut: F, span: tracing::Span },
    }
}

impl<F, R, E> Future for TraceFuture<F>
where
    F: Future<Output = Result<http::Response<R>, E>>,
{
    type Output = Result<http::Response<R>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            TraceProj::Plain { fut } => fut.poll(cx),
            TraceProj::Traced { fut, span } => {
                let out = {
                    let _in = span.enter();
                    fut.poll(cx)
                };
                if let Poll::Ready(Ok(resp)) = &out {
                    record_status(span, resp);
                }
                out
            }
        }
    }
}

/// The gRPC status of a response whose status is in its headers (an error answered at
/// once); a status in the trailers (every success) is not seen here: the handlers' own spans
/// record their errors.
fn record_status<R>(span: &tracing::Span, resp: &http::Response<R>) {
    let Some(code) = resp
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
    else {
        return;
    };
    span.record("rpc.grpc.status_code", code);
    if code != "0" {
        let message = resp
            .headers()
            .get("grpc-message")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        automaton_telemetry::trace::record_error(
            span,
            &format!("gRPC status {code}: {}", percent_decode(message)),
        );
    }
}

/// `grpc-message` is percent-encoded; decoded for people (invalid escapes kept as sent).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |at: usize| b.get(at).and_then(|c| (*c as char).to_digit(16));
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (hex(i + 1), hex(i + 2))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_messages_are_decoded_for_the_span_and_bad_escapes_kept() {
        assert_eq!(percent_decode("no%20live%20lease"), "no live lease");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz%2"), "%zz%2");
        assert_eq!(percent_decode("%C3%A9t%C3%A9"), "été");
    }
}
