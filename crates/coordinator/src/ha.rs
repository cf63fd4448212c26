//! High availability on etcd (`store = etcd`): any number of coordinators serve one project,
//! one of them leader. Each process loops: as a follower it answers every call
//! `UNAVAILABLE` with the leader's address in the `automaton-leader` metadata (clients given
//! several coordinators follow it) while it campaigns; once elected it rebuilds its folder
//! from etcd, opens the coordinator over the etcd backend and serves until leadership is lost
//! — then it steps down and follows again. It owns that loop and nothing of what a leader
//! does: the coordinator is the same one the files store runs.
//!
//! Election is not fencing: every write the leader makes is fenced in etcd by its leader
//! key's revision (`automaton-backend`'s etcd backend), so a deposed leader that still
//! believes it leads writes nothing before it notices.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use automaton_backend::EtcdBackend;
use automaton_etcd::{Client, Election};
use automaton_store::Project;
use tokio::sync::watch;
use tonic::codegen::http;

use crate::{Config, Coordinator, Error, Options};

pub use automaton_client::LEADER_METADATA;

/// Serves `project` as one of the coordinators of an etcd-backed fleet until `shutdown`.
/// `listener` is bound once and served in turn by the follower and the leader; `advertise`
/// is this coordinator's URL as clients reach it.
pub async fn serve_on_etcd(
    cfg: &Config,
    project: Project,
    options: Options,
    listener: std::net::TcpListener,
    metrics: Option<tokio::net::TcpListener>,
    advertise: String,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    // `/metrics` through every term: the leader's coordinator while there is one, and
    // `automaton_leader 0` while following (the dashboard shows who leads).
    let current: Current = Arc::default();
    if let Some(listener) = metrics {
        automaton_telemetry::metrics::spawn(listener, render(current.clone()))
            .map_err(|e| Error::Internal(format!("cannot read the metrics address: {e}")))?;
    }
    let client = Client::connect(cfg.etcd.client_config()?)
        .map_err(|e| Error::Config(format!("etcd: {e}")))?;
    let prefix = EtcdBackend::prefix_of(&cfg.etcd_name());
    let key = format!("{prefix}leader");
    let election = Election::new(
        client.clone(),
        key.clone(),
        advertise.clone(),
        cfg.etcd.election_ttl,
    )
    .map_err(|e| Error::Config(format!("etcd: {e}")))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::Internal(format!("cannot use the listener: {e}")))?;
    let (stop_tx, stop) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    });
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    loop {
        // Follower: answer with the leader's address, read from etcd, while campaigning.
        let leader_view = Arc::new(LeaderView::new(client.clone(), key.clone().into_bytes()));
        let (end_follower, follower_ends) = tokio::sync::oneshot::channel::<()>();
        let follower = tokio::spawn(follow(
            clone_listener(&listener)?,
            leader_view,
            cfg.tls.clone(),
            async move {
                let _ = follower_ends.await;
            },
        ));
        tracing::info!(address = %advertise, key = %key, "following; standing for leader");
        let elected = tokio::select! {
            l = election.campaign() => Some(l),
            _ = stopped(stop.clone()) => None,
        };
        let _ = end_follower.send(());
        match follower.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the follower's server failed"),
            Err(e) => tracing::warn!(error = %e, "the follower's server stopped"),
        }
        let Some(leadership) = elected else {
            return Ok(());
        };
        let leadership =
            Arc::new(leadership.map_err(|e| Error::Config(format!("etcd election: {e}")))?);
        tracing::info!(
            address = %advertise,
            revision = leadership.revision(),
            "elected leader: rebuilding the task store from etcd"
        );
        let term = Term {
            listener: &listener,
            client: &client,
            prefix: &prefix,
            leadership: &leadership,
            current: &current,
        };
        let led = lead(cfg, &project, &options, term, stop.clone()).await;
        *current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        match led {
            Ok(()) => {
                // Stopped on purpose: hand over at once rather than after the lease's TTL.
                if let Err(e) = leadership.resign().await {
                    tracing::warn!(error = %e, "cannot resign leadership: it ends with its lease");
                }
                return Ok(());
            }
            Err(Error::Unavailable(why)) => {
                tracing::warn!(reason = %why, "stepped down: no longer the leader");
            }
            Err(e) => {
                let _ = leadership.resign().await;
                return Err(e);
            }
        }
        if *stop.borrow() {
            return Ok(());
        }
    }
}

fn clone_listener(l: &std::net::TcpListener) -> Result<tokio::net::TcpListener, Error> {
    l.try_clone()
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|e| Error::Internal(format!("cannot use the listener: {e}")))
}

/// One term as leader: the view rebuilt from etcd (or etcd seeded from it, the first time),
/// the coordinator opened over the etcd backend and served until `stop` (`Ok`) or until
/// leadership is lost (`Unavailable`).
async fn lead(
    cfg: &Config,
    project: &Project,
    options: &Options,
    term: Term<'_>,
    stop: watch::Receiver<bool>,
) -> Result<(), Error> {
    let Term {
        listener,
        client,
        prefix,
        leadership,
        current,
    } = term;
    let backend = EtcdBackend::new(client.clone(), leadership.clone(), prefix.to_string());
    let project = &match &cfg.etcd.git_remote {
        Some(url) => project.clone().with_git_remote(url.clone()),
        None => project.clone(),
    };
    let unavailable = |what: &str, e: String| Error::Unavailable(format!("{what}: {e}"));
    if backend.seeded().await.map_err(|e| unavailable("etcd", e))? {
        let files = backend
            .files()
            .await
            .map_err(|e| unavailable("reading the task store from etcd", e))?;
        let with_branch = tasks_recording_a_branch(&files);
        let p = project.clone();
        let (written, removed) = tokio::task::spawn_blocking(move || p.restore_view(&files))
            .await
            .map_err(|e| Error::Internal(format!("the view rebuild failed: {e}")))??;
        tracing::info!(written, removed, "task store rebuilt from etcd");
        // The task branches from the shared remote, at the heads etcd records. Through the
        // replica: a record corrected here is a fenced write.
        let p = project.clone().with_replica(backend.replica());
        let (set, corrected) =
            tokio::task::spawn_blocking(move || p.sync_task_branches(&with_branch))
                .await
                .map_err(|e| Error::Internal(format!("the branch sync failed: {e}")))??;
        if project.git_remote().is_some() {
            tracing::info!(
                set,
                corrected,
                "task branches taken from the shared git remote"
            );
        }
    } else {
        // The first leader of this project in etcd: its own folder is the truth.
        let p = project.clone();
        let files = tokio::task::spawn_blocking(move || p.replicated_files())
            .await
            .map_err(|e| Error::Internal(format!("reading the task store failed: {e}")))??;
        let n = files.len();
        let p = project.clone();
        tokio::task::spawn_blocking(move || p.push_task_branches())
            .await
            .map_err(|e| Error::Internal(format!("pushing the task branches failed: {e}")))??;
        backend
            .seed(&files)
            .await
            .map_err(|e| unavailable("seeding etcd from the task store", e))?;
        tracing::info!(files = n, "etcd seeded from this coordinator's task store");
    }
    let replicated = project.clone().with_replica(backend.replica());
    let (coord, notes) = Coordinator::open_with(replicated, options.clone(), &backend)?;
    for n in &notes {
        tracing::warn!(note = %n, "recovery");
    }
    tracing::info!(leases = coord.live_leases(), "leading: serving");
    *current.lock().unwrap_or_else(|p| p.into_inner()) = Some(coord.clone());
    let stopped = async move {
        let mut stop = stop;
        let _ = stop.wait_for(|s| *s).await;
    };
    crate::serve(coord, cfg, clone_listener(listener)?, stopped).await
}

/// What one term as leader works with.
struct Term<'a> {
    listener: &'a std::net::TcpListener,
    client: &'a Client,
    prefix: &'a str,
    leadership: &'a Arc<automaton_etcd::Leadership>,
    current: &'a Current,
}

/// The coordinator of the current term, while this process leads.
type Current = Arc<std::sync::Mutex<Option<Arc<Coordinator>>>>;

/// `/metrics`: the leading coordinator's, with `automaton_leader 1`; `automaton_leader 0`
/// alone while following.
fn render(current: Current) -> automaton_telemetry::metrics::Render {
    Arc::new(move || {
        let coord = current.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Box::pin(async move {
            const HELP: &str = "# HELP automaton_leader 1 while this coordinator leads its project (store = etcd), 0 while it follows.\n# TYPE automaton_leader gauge\n";
            match coord {
                Some(c) => format!("{HELP}automaton_leader 1\n{}", c.metrics_text().await),
                None => format!("{HELP}automaton_leader 0\n"),
            }
        })
    })
}

/// The tasks whose store files record a branch head (`tasks/{t}/.state.branch`,
/// `tasks/{p}/subtasks/{s}/.state.branch`).
fn tasks_recording_a_branch(files: &[(String, Vec<u8>)]) -> Vec<automaton_workflow::TaskName> {
    files
        .iter()
        .filter_map(|(path, _)| {
            let rest = path
                .strip_prefix("tasks/")?
                .strip_suffix("/.state.branch")?;
            let name = match rest.split_once("/subtasks/") {
                Some((parent, sub)) => format!("{parent}/{sub}"),
                None => rest.to_string(),
            };
            name.parse().ok()
        })
        .collect()
}

/// A follower's server: every call, health included (so a load balancer sends nothing
/// here), is answered `UNAVAILABLE` naming the leader.
async fn follow(
    listener: tokio::net::TcpListener,
    leader: Arc<LeaderView>,
    tls: Option<crate::config::Tls>,
    stop: impl Future<Output = ()>,
) -> Result<(), Error> {
    let mut builder = tonic::transport::Server::builder();
    if let Some(tls) = &tls {
        builder = crate::tls_builder(builder, tls)?;
    }
    builder
        .layer(Follower { leader })
        .add_routes(tonic::service::Routes::default())
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop,
        )
        .await
        .map_err(|e| Error::Internal(format!("the follower's server failed: {e}")))
}

/// One read of the leader key: the leader's URL (or none), or why etcd could not be read.
type LeaderRead = Result<Option<String>, String>;

/// How long a follower answers from one read of the leader key: calls that arrive together
/// share a read, and none is answered from a read older than this.
const LEADER_READ_FRESH: Duration = Duration::from_millis(100);

/// Who leads, as a follower tells its callers: read from etcd when asked (at most one read in
/// flight, shared by the calls that arrive while it runs or within [`LEADER_READ_FRESH`] of
/// it), never remembered past that. A view polled now and then named a stopped leader for up
/// to a poll period after another was elected, sending clients back to it for one more
/// deadline (issue 30, finding 4).
struct LeaderView {
    client: Client,
    key: Vec<u8>,
    /// The last read: when it was sent, and the leader's URL (or none), or why it failed.
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, LeaderRead)>>,
}

impl LeaderView {
    fn new(client: Client, key: Vec<u8>) -> LeaderView {
        LeaderView {
            client,
            key,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The leader now, as etcd says: `Ok(None)` when nobody leads, `Err` when etcd cannot be
    /// read (then no leader is named: an old answer could be a stopped one).
    async fn read(&self) -> LeaderRead {
        let mut last = self.last.lock().await;
        if let Some((at, answer)) = &*last
            && at.elapsed() < LEADER_READ_FRESH
        {
            return answer.clone();
        }
        let sent = tokio::time::Instant::now();
        let answer = match automaton_etcd::leader(&self.client, &self.key).await {
            Ok(found) => Ok(found.and_then(|(v, _)| String::from_utf8(v).ok())),
            Err(e) => Err(e.to_string()),
        };
        *last = Some((sent, answer.clone()));
        answer
    }
}

/// The refusal of a follower, with the leader's URL when one is known.
pub(crate) fn not_the_leader(leader: Option<&str>) -> tonic::Status {
    match leader {
        Some(url) => {
            let mut s = tonic::Status::unavailable(format!(
                "this coordinator is a follower; the leader is {url}: send the call there (the CLI and workers given several coordinators follow it on their own)"
            ));
            if let Ok(v) = url.parse() {
                s.metadata_mut().insert(LEADER_METADATA, v);
            }
            s
        }
        None => tonic::Status::unavailable(
            "this coordinator is a follower and no leader is elected yet: retry in a few seconds",
        ),
    }
}

/// A follower's refusal when etcd cannot tell it who leads: it names nobody.
fn leader_unknown(why: &str) -> tonic::Status {
    let why: String = why.chars().take(200).collect();
    tonic::Status::unavailable(format!(
        "this coordinator is a follower and cannot read who leads from etcd ({why}): retry in a few seconds, or ask another coordinator"
    ))
}

#[derive(Clone)]
struct Follower {
    leader: Arc<LeaderView>,
}

impl<S> tower::Layer<S> for Follower {
    type Service = FollowerService;
    fn layer(&self, _inner: S) -> FollowerService {
        FollowerService {
            leader: self.leader.clone(),
        }
    }
}

#[derive(Clone)]
struct FollowerService {
    leader: Arc<LeaderView>,
}

impl<B> tower::Service<http::Request<B>> for FollowerService {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _req: http::Request<B>) -> Self::Future {
        let leader = self.leader.clone();
        Box::pin(async move {
            let status = match leader.read().await {
                Ok(url) => not_the_leader(url.as_deref()),
                Err(why) => leader_unknown(&why),
            };
            Ok(status.into_http())
        })
    }
}
