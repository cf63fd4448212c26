//! The load generator's gRPC client, either transport behind one interface: the stock tonic
//! client or the raw one in `wire.rs` (`--client`). The systems under test are written once
//! against this and are measured through the same client.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use prost::Message;
use tokio::sync::{Mutex, OwnedMutexGuard, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::{Channel, Endpoint};
use tonic_prost::ProstCodec;

use crate::wire;

/// Which client the load generator uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientKind {
    /// HTTP/2 frames written and read by the calling task (`wire.rs`): the least CPU taken
    /// from the systems under test.
    Raw,
    /// tonic's generated-client path (`Channel`), as an application would use it.
    Tonic,
}

/// One client connection.
#[derive(Clone)]
pub enum Client {
    Tonic(Channel),
    Raw(Arc<Mutex<wire::Conn>>),
}

/// `http://host:port` → `host:port`, for the raw client (which speaks cleartext HTTP/2 only).
pub fn host_port(url: &str) -> Result<&str> {
    url.strip_prefix("http://")
        .map(|r| r.trim_end_matches('/'))
        .filter(|r| !r.is_empty() && !r.contains('/'))
        .ok_or_else(|| {
            anyhow!("--client raw needs an http://host:port URL, not {url:?}; use --client tonic for https")
        })
}

/// Opens `n` connections to `url`.
pub async fn connect(kind: ClientKind, url: &str, n: usize) -> Result<Vec<Client>> {
    let mut out = Vec::with_capacity(n);
    match kind {
        ClientKind::Tonic => {
            for ch in tonic_channels(url, n).await? {
                out.push(Client::Tonic(ch));
            }
        }
        ClientKind::Raw => {
            let addr = host_port(url)?;
            for _ in 0..n {
                out.push(Client::Raw(Arc::new(Mutex::new(
                    wire::Conn::connect(addr).await?,
                ))));
            }
        }
    }
    Ok(out)
}

/// `n` tonic channels to `url`, each its own HTTP/2 connection.
pub async fn tonic_channels(url: &str, n: usize) -> Result<Vec<Channel>> {
    let endpoint = Endpoint::from_shared(url.to_string())
        .with_context(|| format!("bad URL {url}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(5));
    let mut channels = Vec::with_capacity(n);
    for _ in 0..n {
        channels.push(
            endpoint
                .connect()
                .await
                .with_context(|| format!("connect to {url}"))?,
        );
    }
    Ok(channels)
}

/// A tonic client on `ch`, once the channel can take a call.
async fn ready(ch: &Channel) -> Result<tonic::client::Grpc<Channel>> {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready()
        .await
        .map_err(|e| anyhow!("connection not ready: {e}"))?;
    Ok(grpc)
}

pub fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow!("{:?}: {}", s.code(), s.message())
}

impl Client {
    /// A unary call to `path` (`/package.Service/Method`).
    pub async fn unary<Q, R>(&self, path: &'static str, request: Q) -> Result<R>
    where
        Q: Message + Send + Sync + 'static,
        R: Message + Default + Send + 'static,
    {
        match self {
            Client::Tonic(ch) => {
                let response = ready(ch)
                    .await?
                    .unary(
                        tonic::Request::new(request),
                        PathAndQuery::from_static(path),
                        ProstCodec::<Q, R>::default(),
                    )
                    .await
                    .map_err(status_err)?;
                Ok(response.into_inner())
            }
            Client::Raw(conn) => conn.lock().await.unary(path, &request).await,
        }
    }

    /// Opens a bidirectional stream to `path` and sends `first` on it. A raw stream has its
    /// connection to itself until it is dropped.
    pub async fn stream<Q, R>(&self, path: &'static str, first: Q) -> Result<Stream<Q, R>>
    where
        Q: Message + Send + Sync + 'static,
        R: Message + Default + Send + 'static,
    {
        match self {
            Client::Tonic(ch) => {
                let mut grpc = ready(ch).await?;
                let (tx, rx) = mpsc::channel(1);
                // Queued before the call: a server may send its response headers only with
                // the first message.
                tx.send(first).await.context("queue the first message")?;
                let responses = grpc
                    .streaming(
                        tonic::Request::new(ReceiverStream::new(rx)),
                        PathAndQuery::from_static(path),
                        ProstCodec::<Q, R>::default(),
                    )
                    .await
                    .map_err(status_err)?
                    .into_inner();
                Ok(Stream::Tonic {
                    tx,
                    responses: Box::new(responses),
                })
            }
            Client::Raw(conn) => {
                let mut conn = conn.clone().lock_owned().await;
                conn.open(path)?;
                conn.send_message(&first, false).await?;
                Ok(Stream::Raw(conn, PhantomData))
            }
        }
    }
}

/// A bidirectional stream: requests `Q`, responses `R`.
pub enum Stream<Q, R> {
    Tonic {
        tx: mpsc::Sender<Q>,
        responses: Box<tonic::Streaming<R>>,
    },
    Raw(OwnedMutexGuard<wire::Conn>, PhantomData<fn(Q) -> R>),
}

impl<Q, R> Stream<Q, R>
where
    Q: Message + Send + 'static,
    R: Message + Default + Send + 'static,
{
    pub async fn send(&mut self, message: Q) -> Result<()> {
        match self {
            Stream::Tonic { tx, .. } => tx.send(message).await.context("the request stream closed"),
            Stream::Raw(conn, _) => conn.send_message(&message, false).await,
        }
    }

    /// The next response, or `None` once the server ended the stream.
    pub async fn receive(&mut self) -> Result<Option<R>> {
        match self {
            Stream::Tonic { responses, .. } => responses.message().await.map_err(status_err),
            Stream::Raw(conn, _) => conn.receive().await,
        }
    }
}
