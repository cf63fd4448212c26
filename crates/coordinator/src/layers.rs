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
