//! The operator's console (issue 23): the web page a coordinator serves with
//! `--web-listen`. SKELETON — the real crate is being written.

use std::future::Future;
use std::sync::Arc;

/// Checks a token someone signs in with. The coordinator implements it over its own
/// configured callers, so the console never keeps a second copy of the tokens.
pub trait Authenticate: Send + Sync + 'static {
    /// The operator's name for `token`, or a one-line reason it may not sign in (unknown,
    /// or an agent's or a worker's token).
    fn operator(&self, token: &str) -> Result<String, String>;
}

/// How the console reaches the coordinator and who may use it.
pub struct Options {
    /// A channel to the coordinator's own gRPC API (lazy: the console is its client and
    /// every action is the same call the CLI makes).
    pub channel: tonic::transport::Channel,
    /// `None`: the coordinator has no tokens; only loopback clients are served and calls
    /// carry no token. `Some`: operators sign in with their token.
    pub auth: Option<Arc<dyn Authenticate>>,
    /// A trace UI URL with `{trace_id}` in it, e.g. `http://jaeger:16686/trace/{trace_id}`.
    pub trace_url: Option<String>,
    /// The project's name, shown in the title.
    pub project: String,
    /// PEM certificate chain and key: serve https (and mark the cookie `Secure`).
    pub tls: Option<(Vec<u8>, Vec<u8>)>,
}

/// What can stop the console from serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("console: {0}")]
    Serve(String),
}

/// Serves the console on `listener` until `shutdown` resolves. For now every page answers
/// 503: the pages are being built (issue 23); the wiring, sign-in check and options are real.
pub async fn serve(
    listener: tokio::net::TcpListener,
    opts: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let _ = opts;
    let app = axum::Router::new().fallback(|| async {
        (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "the console's pages are not built yet: use the CLI (automaton workers, tasks, logs, approve)\n",
        )
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| Error::Serve(e.to_string()))
}
