//! The operator's console (issue 23): the web page a coordinator serves with
//! `--web-listen` — the fleet (`/fleet`), the board of tasks by lifecycle phase (`/board`),
//! a task's page with its artifacts, approvals, runs and live output (`/task/NAME`), and
//! buttons for the operator's actions (approve, stop, resume, run, drain, undrain, deliver,
//! abandon), with a task's delivery and its change (the diff a reviewer reads, `diff.rs`).
//!
//! What it owns: the HTML (server-rendered by the pure functions of [`render`], with a
//! little embedded vanilla JavaScript and CSS, no inline script: the CSP forbids it), the
//! sign-in sessions (in memory, bounded, 12 hours) and their rate limit (5 refused sign-ins a
//! minute per client address), the CSRF and cross-site checks of every POST, without tokens
//! the check that every request names this console by a loopback name (no DNS rebinding),
//! and two kinds of live stream: one shared `WatchEvents` feed per console fanned out to
//! every open page as server-sent events (with an `alive` event every 2 s saying whether the
//! feed is up: a page shows, apart, whether it is connected and how old its data is), and a
//! task's `TailOutput`, both bounded per session and cut when their client stops reading
//! (`streams.rs`).
//!
//! What it must not do: decide policy or keep state beyond sessions. It is a client of the
//! coordinator's own gRPC API (`automaton_proto`): every page is a read the CLI could make,
//! every button is the call the CLI's command makes, sent with the signed-in operator's
//! token as `authorization: Bearer …`, so every check (who may approve, what a state
//! allows) is the coordinator's, and a refusal is shown as the coordinator's one line. It
//! never shows a token, and never trusts what it renders: task names, reasons and artifacts
//! are escaped, and so is every byte of a task's diff (the agents' code).

mod diff;
mod feed;
mod grpc;
mod limit;
mod markdown;
pub mod render;
mod session;
mod streams;
mod tls;
mod web;

pub use diff::{escape_code, render_change, task_branch};
pub use feed::{Utf8Carry, alive_json, event_json, output_json};
pub use grpc::http_status;
pub use limit::{MAX_FAILURES, SignInLimit, WINDOW};
pub use render::{
    BoardFilter, TaskView, escape, render_board, render_fleet, render_markdown, render_task,
};
pub use session::{
    COOKIE, MAX_SESSIONS, SESSION_TTL, Session, Sessions, clear_cookie, constant_time_eq,
    cookie_id, session_cookie,
};
pub use streams::{DEFAULT_STALL_TIMEOUT, DEFAULT_STREAMS_PER_SESSION, StreamLimits};
pub use web::{
    CSP, CSRF_REFUSED, cross_site, csrf_ok, is_loopback, loopback_named, safe_back,
    too_many_sign_ins,
};

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ConnectInfo;
use tokio::sync::watch;
use tokio::task::JoinSet;

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
    /// How many live streams one session may hold, and how long a client may read nothing.
    pub streams: StreamLimits,
}

/// What can stop the console from serving.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("console: {0}")]
    Serve(String),
}

/// How long connections may finish what they do after `shutdown` before they are cut.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Serves the console on `listener` until `shutdown` resolves: https when `opts.tls` is
/// set, else http. Each connection knows its peer's address (the loopback check of no-auth
/// mode), and a write to it that makes no progress for `opts.streams.stall_timeout` ends it.
/// At shutdown the listener closes, event and output streams end, and connections get
/// [`SHUTDOWN_GRACE`] to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    opts: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    let acceptor = match &opts.tls {
        Some((chain, key)) => Some(tls::acceptor(chain, key).map_err(Error::Serve)?),
        None => None,
    };
    let local = listener
        .local_addr()
        .map_err(|e| Error::Serve(format!("cannot read the console's address: {e}")))?;
    let stall = opts.streams.stall_timeout;
    let (stop_tx, stop_rx) = watch::channel(false);
    let app = Arc::new(web::App::new(opts, local, stop_rx.clone()).map_err(Error::Serve)?);
    let feed = tokio::spawn(feed::run(app.clone()));
    let router = web::router(app);
    let mut conns = JoinSet::new();
    let shutdown = std::pin::pin!(shutdown);
    let mut shutdown = shutdown;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    // Under TLS too: a client that stops reading stalls the raw socket.
                    let stream = streams::WriteDeadline::new(stream, stall, peer);
                    conns.spawn(connection(stream, peer, router.clone(), acceptor.clone(), stop_rx.clone()));
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait a moment, then go on.
                    tracing::warn!(error = %e, "console: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    let _ = stop_tx.send(true);
    feed.abort();
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        conns.abort_all();
    }
    Ok(())
}

/// One connection: TLS first when configured, then HTTP/1.1 until it closes or shutdown.
async fn connection(
    stream: streams::WriteDeadline<tokio::net::TcpStream>,
    peer: SocketAddr,
    router: axum::Router,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    stop: watch::Receiver<bool>,
) {
    match acceptor {
        None => drive(stream, peer, router, stop).await,
        Some(acceptor) => {
            match tokio::time::timeout(tls::HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => drive(tls, peer, router, stop).await,
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "console: TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "console: TLS handshake timed out"),
            }
        }
    }
}

/// Serves HTTP/1.1 on `io`, every request told its peer (`ConnectInfo`).
async fn drive<I>(io: I, peer: SocketAddr, router: axum::Router, mut stop: watch::Receiver<bool>)
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tower::ServiceExt as _;
    let service =
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ConnectInfo(peer));
            router.clone().oneshot(req)
        });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30))
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "console: connection ended");
            }
        }
        _ = async { stop.wait_for(|s| *s).await.map(drop) } => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}
