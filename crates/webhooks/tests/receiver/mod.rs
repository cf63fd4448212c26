//! A real HTTP receiver on 127.0.0.1:0 (hyper's server), optionally over TLS, that records
//! what it gets and answers as a test says.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{HeaderMap, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// One request as the receiver got it.
#[derive(Debug)]
pub struct Received {
    pub at: Instant,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

impl Received {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("the body is JSON")
    }
}

/// How the receiver answers its n-th request (from 0).
#[derive(Debug, Clone)]
pub enum Answer {
    Status(u16),
    /// A status and a `Retry-After` in seconds.
    RetryAfter(u16, u64),
    /// Records the request and never answers.
    Hang,
}

pub struct Receiver {
    pub url: String,
    pub got: mpsc::UnboundedReceiver<Received>,
    pub accepted: Arc<AtomicUsize>,
}

impl Receiver {
    /// The next request, within `within`.
    pub async fn next(&mut self, within: Duration) -> Option<Received> {
        tokio::time::timeout(within, self.got.recv())
            .await
            .ok()
            .flatten()
    }

    /// No request within `within`.
    pub async fn nothing_for(&mut self, within: Duration) -> bool {
        self.next(within).await.is_none()
    }
}

pub async fn start(answer: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Receiver {
    start_with(answer, None).await
}

pub async fn start_tls(answer: impl Fn(usize) -> Answer + Send + Sync + 'static) -> Receiver {
    start_with(answer, Some(acceptor())).await
}

/// The repository's throw-away test certificates (`tests/coordinator/fixtures/README.md`).
pub fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/coordinator/fixtures")
}

fn acceptor() -> tokio_rustls::TlsAcceptor {
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(fixtures().join("server.crt"))
            .expect("server.crt")
            .collect::<Result<_, _>>()
            .expect("server.crt parses");
    let key = PrivateKeyDer::from_pem_file(fixtures().join("server.key")).expect("server.key");
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("cert and key");
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

async fn start_with(
    answer: impl Fn(usize) -> Answer + Send + Sync + 'static,
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> Receiver {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let (tx, got) = mpsc::unbounded_channel();
    let answer = Arc::new(answer);
    let count = Arc::new(AtomicUsize::new(0));
    let accepted = Arc::new(AtomicUsize::new(0));
    let accepted2 = accepted.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            accepted2.fetch_add(1, Ordering::SeqCst);
            let (tx, answer, count, tls) = (tx.clone(), answer.clone(), count.clone(), tls.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    move |req: hyper::Request<hyper::body::Incoming>| {
                        let (tx, answer, count) = (tx.clone(), answer.clone(), count.clone());
                        async move {
                            let at = Instant::now();
                            let path = req.uri().path().to_string();
                            let headers = req.headers().clone();
                            let body = req.into_body().collect().await?.to_bytes().to_vec();
                            let n = count.fetch_add(1, Ordering::SeqCst);
                            let _ = tx.send(Received {
                                at,
                                path,
                                headers,
                                body,
                            });
                            let mut response = Response::new(Full::new(Bytes::new()));
                            match answer(n) {
                                Answer::Status(s) => {
                                    *response.status_mut() =
                                        StatusCode::from_u16(s).expect("status");
                                }
                                Answer::RetryAfter(s, secs) => {
                                    *response.status_mut() =
                                        StatusCode::from_u16(s).expect("status");
                                    response.headers_mut().insert(
                                        hyper::header::RETRY_AFTER,
                                        secs.to_string().parse().expect("header"),
                                    );
                                }
                                Answer::Hang => std::future::pending::<()>().await,
                            }
                            Ok::<_, hyper::Error>(response)
                        }
                    },
                );
                let builder = hyper::server::conn::http1::Builder::new();
                match tls {
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(stream).await {
                            let _ = builder
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        }
                    }
                    None => {
                        let _ = builder
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    }
                }
            });
        }
    });
    Receiver {
        url: format!("{scheme}://127.0.0.1:{port}/hook"),
        got,
        accepted,
    }
}
