//! One HTTP/1.1 request over a new connection (http or https), bounded in time, its answer's
//! body read up to a cap. The webhooks' POST and `automaton-forge`'s REST calls both go
//! through [`send`]: one client stack (hyper over rustls and ring, tonic's), not two.
//!
//! What it must not do: log. A URL's path or a header may be a secret; the caller decides
//! what of a request a log line may carry.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{HeaderName, HeaderValue};
use hyper::{HeaderMap, Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// The TLS client [`tls_connector`] builds, for a caller to keep.
pub use tokio_rustls::TlsConnector;

/// A sensible cap on an answer's body for a caller that reads it: a REST answer is far smaller.
pub const MAX_BODY: usize = 1 << 20;

/// A parsed `http://` or `https://` URL: where to connect and what to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub tls: bool,
    /// The host to connect to and to name in TLS (IPv6 without its brackets).
    pub host: String,
    pub port: u16,
    /// The `Host` header: the authority as written.
    pub authority: String,
    /// Path and query, at least `/`.
    pub path: String,
}

/// Why a string is not a URL [`Target::parse`] takes; its `Display` says what to write.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadUrl {
    #[error("url: write http://host[:port]/path or https://…")]
    Scheme,
    #[error("url is not a URL ({0}): write http://host[:port]/path or https://…")]
    NotUrl(String),
    #[error("url has no host: write http://host[:port]/path")]
    NoHost,
    #[error("url carries a user or password: leave them out")]
    UserInfo,
    #[error("url: port 0 cannot be reached: write the server's port")]
    PortZero,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, BadUrl> {
        let tls = if url.starts_with("https://") {
            true
        } else if url.starts_with("http://") {
            false
        } else {
            return Err(BadUrl::Scheme);
        };
        let uri: hyper::Uri = url.parse().map_err(|e| BadUrl::NotUrl(format!("{e}")))?;
        let authority = uri.authority().ok_or(BadUrl::NoHost)?;
        if authority.as_str().contains('@') {
            return Err(BadUrl::UserInfo);
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(BadUrl::NoHost);
        }
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        if port == 0 {
            return Err(BadUrl::PortZero);
        }
        let path = uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/".to_string());
        Ok(Target {
            tls,
            host: host.to_string(),
            port,
            authority: authority.as_str().to_string(),
            path,
        })
    }
}

/// An answer: its status, headers and (up to the caller's cap) body.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The body was longer than the cap: `body` is its beginning.
    pub truncated: bool,
}

/// Why no answer came.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The request cannot be made as given (a URL, a host name for TLS, a header): another
    /// try gets the same.
    #[error("{0}")]
    Invalid(String),
    /// Connecting, TLS or HTTP failed, or no answer within the timeout: another try may work.
    #[error("{0}")]
    Transport(String),
}

/// Where a PEM bundle of CA certificates usually is (`SSL_CERT_FILE` first).
const SYSTEM_BUNDLES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
];

/// A TLS client over rustls and ring (tonic's stack), trusting `ca_file` or else the system's
/// bundle.
pub fn tls_connector(ca_file: Option<&std::path::Path>) -> Result<TlsConnector, String> {
    let path = match ca_file {
        Some(p) => p.to_path_buf(),
        None => std::env::var_os("SSL_CERT_FILE")
            .map(std::path::PathBuf::from)
            .into_iter()
            .chain(SYSTEM_BUNDLES.iter().map(std::path::PathBuf::from))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "https: no CA bundle found ({}): set ca_file to a PEM file of CA certificates",
                    SYSTEM_BUNDLES.join(", ")
                )
            })?,
    };
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(&path).map_err(|e| {
        format!(
            "ca_file {}: {e}: write a PEM file of CA certificates",
            path.display()
        )
    })?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("ca_file {}: {e}", path.display()))?;
        // A bundle may hold a certificate rustls cannot use: the others still count.
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        return Err(format!(
            "ca_file {}: no CA certificate in it: write a PEM file of CA certificates",
            path.display()
        ));
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsConnector::from(Arc::new(config)))
}

/// [`send`] to a URL given as text.
pub async fn request(
    method: Method,
    url: &str,
    headers: &[(HeaderName, HeaderValue)],
    body: Option<Bytes>,
    timeout: Duration,
    tls: Option<&TlsConnector>,
    max_body: usize,
) -> Result<Response, Failure> {
    let target = Target::parse(url).map_err(|e| Failure::Invalid(e.to_string()))?;
    send(&target, method, headers, body, timeout, tls, max_body).await
}

/// Sends one request to `target` over a new connection (`Connection: close`) and returns its
/// answer with up to `max_body` bytes of its body; `max_body` 0 reads none (status and
/// headers only). `headers` follow `Host` and `Connection` in order, none replaced. All of it,
/// from connecting to the body's last byte, within `timeout`. Redirects are not followed.
pub async fn send(
    target: &Target,
    method: Method,
    headers: &[(HeaderName, HeaderValue)],
    body: Option<Bytes>,
    timeout: Duration,
    tls: Option<&TlsConnector>,
    max_body: usize,
) -> Result<Response, Failure> {
    let attempt = connect_and_exchange(target, method, headers, body, tls, max_body);
    // Dropping the attempt on timeout drops its socket too: nothing is left running.
    tokio::time::timeout(timeout, attempt)
        .await
        .unwrap_or_else(|_| {
            Err(Failure::Transport(format!(
                "no answer within {}",
                humantime::format_duration(timeout)
            )))
        })
}

async fn connect_and_exchange(
    target: &Target,
    method: Method,
    headers: &[(HeaderName, HeaderValue)],
    body: Option<Bytes>,
    tls: Option<&TlsConnector>,
    max_body: usize,
) -> Result<Response, Failure> {
    let tcp = TcpStream::connect((target.host.as_str(), target.port))
        .await
        .map_err(|e| Failure::Transport(format!("connect: {e}")))?;
    let _ = tcp.set_nodelay(true);
    match (target.tls, tls) {
        (true, Some(connector)) => {
            let name = ServerName::try_from(target.host.clone())
                .map_err(|e| Failure::Invalid(format!("tls: host name: {e}")))?;
            let stream = connector
                .connect(name, tcp)
                .await
                .map_err(|e| Failure::Transport(format!("tls: {e}")))?;
            exchange(
                TokioIo::new(stream),
                target,
                method,
                headers,
                body,
                max_body,
            )
            .await
        }
        (true, None) => Err(Failure::Invalid("https without a TLS client".to_string())),
        (false, _) => exchange(TokioIo::new(tcp), target, method, headers, body, max_body).await,
    }
}

async fn exchange<I>(
    io: I,
    target: &Target,
    method: Method,
    headers: &[(HeaderName, HeaderValue)],
    body: Option<Bytes>,
    max_body: usize,
) -> Result<Response, Failure>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let transport = |e: hyper::Error| Failure::Transport(format!("http: {e}"));
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(transport)?;
    let mut request = Request::builder()
        .method(method)
        .uri(target.path.as_str())
        .header(hyper::header::HOST, target.authority.as_str())
        .header(hyper::header::CONNECTION, "close");
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = request
        .body(Full::new(body.unwrap_or_default()))
        .map_err(|e| Failure::Invalid(format!("request: {e}")))?;
    // The connection is driven here, not spawned: when the caller's timeout drops this future,
    // the socket goes with it (a server that hangs leaves nothing behind).
    let mut conn = std::pin::pin!(conn);
    let mut conn_done = false;
    let mut send = std::pin::pin!(sender.send_request(request));
    let response = tokio::select! {
        biased;
        r = &mut send => r,
        c = &mut conn => {
            c.map_err(transport)?;
            // The connection may end with the answer in hand (`Connection: close`).
            conn_done = true;
            send.await
        }
    }
    .map_err(transport)?;
    let (parts, mut incoming) = response.into_parts();
    let mut out = Vec::new();
    let mut truncated = false;
    while max_body > 0 && !truncated {
        let frame = if conn_done {
            incoming.frame().await
        } else {
            tokio::select! {
                biased;
                f = incoming.frame() => f,
                c = &mut conn => {
                    c.map_err(transport)?;
                    // What the connection read is in the body's channel: read on from there.
                    conn_done = true;
                    continue;
                }
            }
        };
        let Some(frame) = frame else { break };
        let Ok(data) = frame.map_err(transport)?.into_data() else {
            continue; // trailers
        };
        let room = max_body - out.len();
        if data.len() > room {
            out.extend_from_slice(&data[..room]);
            truncated = true;
            break;
        }
        out.extend_from_slice(&data);
    }
    Ok(Response {
        status: parts.status,
        headers: parts.headers,
        body: Bytes::from(out),
        truncated,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_targets() {
        let t = Target::parse("http://127.0.0.1:8080/hook?x=1").expect("parses");
        assert_eq!(
            (
                t.tls,
                t.host.as_str(),
                t.port,
                t.authority.as_str(),
                t.path.as_str()
            ),
            (false, "127.0.0.1", 8080, "127.0.0.1:8080", "/hook?x=1")
        );
        let t = Target::parse("https://hooks.example.com").expect("parses");
        assert_eq!((t.tls, t.port, t.path.as_str()), (true, 443, "/"));
        let t = Target::parse("http://[::1]:9/").expect("parses");
        assert_eq!((t.host.as_str(), t.authority.as_str()), ("::1", "[::1]:9"));
    }

    #[test]
    fn bad_urls_say_why() {
        assert_eq!(Target::parse("ftp://h/x"), Err(BadUrl::Scheme));
        assert_eq!(Target::parse("http://u:p@h/x"), Err(BadUrl::UserInfo));
        assert_eq!(Target::parse("http://h:0/x"), Err(BadUrl::PortZero));
        assert!(matches!(
            Target::parse("http:///x"),
            Err(BadUrl::NoHost | BadUrl::NotUrl(_))
        ));
    }
}
