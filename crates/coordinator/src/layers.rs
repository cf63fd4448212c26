//! Tower layers of the server, each with its reason.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::codegen::http;

/// tonic answers a request message over the size limit with OUT_OF_RANGE; the API promises
/// RESOURCE_EXHAUSTED (what gRPC itself uses for a message over the limit), so rewrite it.
#[derive(Clone, Default)]
pub struct OversizeIsResourceExhausted;

impl<S> tower::Layer<S> for OversizeIsResourceExhausted {
    type Service = OversizeService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        OversizeService { inner }
    }
}

#[derive(Clone)]
pub struct OversizeService<S> {
    inner: S,
}

impl<S, B, R> tower::Service<http::Request<B>> for OversizeService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let oversize = resp.headers().get("grpc-status").is_some_and(|v| v == "11")
                && resp
                    .headers()
                    .get("grpc-message")
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|m| {
                        m.contains("message%20length%20too%20large")
                            || m.contains("message length too large")
                    });
            if oversize {
                resp.headers_mut()
                    .insert("grpc-status", http::HeaderValue::from_static("8"));
            }
            Ok(resp)
        })
    }
}
