//! One HTTP/1.1 POST over a new connection (http or https), and what its answer means.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use crate::config::Target;

/// The longest `Retry-After` honoured.
pub(crate) const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// What one attempt came to.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// A 2xx.
    Delivered,
    /// Worth another attempt: a connection error, a timeout, a 5xx, 408 or 429.
    Retry {
        why: String,
        /// The receiver's `Retry-After`, in seconds, capped.
        after: Option<Duration>,
    },
    /// Another attempt would get the same: any other status.
    Refused(String),
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
pub(crate) fn tls_connector(ca_file: Option<&std::path::Path>) -> Result<TlsConnector, String> {
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

/// POSTs `body` with `headers` to `target`; the caller bounds the time.
pub(crate) async fn post(
    target: &Target,
    tls: Option<&TlsConnector>,
    headers: &[(hyper::header::HeaderName, hyper::header::HeaderValue)],
    body: Bytes,
) -> Outcome {
    let tcp = match TcpStream::connect((target.host.as_str(), target.port)).await {
        Ok(s) => s,
        Err(e) => return retry(format!("connect: {e}")),
    };
    let _ = tcp.set_nodelay(true);
    match (target.tls, tls) {
        (true, Some(connector)) => {
            let name = match ServerName::try_from(target.host.clone()) {
                Ok(n) => n,
                Err(e) => return Outcome::Refused(format!("tls: host name: {e}")),
            };
            match connector.connect(name, tcp).await {
                Ok(stream) => exchange(TokioIo::new(stream), target, headers, body).await,
                Err(e) => retry(format!("tls: {e}")),
            }
        }
        (true, None) => Outcome::Refused("https without a TLS client".to_string()),
        (false, _) => exchange(TokioIo::new(tcp), target, headers, body).await,
    }
}

async fn exchange<I>(
    io: I,
    target: &Target,
    headers: &[(hyper::header::HeaderName, hyper::header::HeaderValue)],
    body: Bytes,
) -> Outcome
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(io).await {
        Ok(x) => x,
        Err(e) => return retry(format!("http: {e}")),
    };
    let mut request = Request::post(target.path.as_str())
        .header(hyper::header::HOST, target.authority.as_str())
        .header(hyper::header::CONTENT_TYPE, "application/json")
        .header(
            hyper::header::USER_AGENT,
            concat!("automaton-webhooks/", env!("CARGO_PKG_VERSION")),
        )
        .header(hyper::header::CONNECTION, "close");
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = match request.body(Full::new(body)) {
        Ok(r) => r,
        Err(e) => return Outcome::Refused(format!("request: {e}")),
    };
    // The connection is driven here, not spawned: when the caller's timeout drops this future,
    // the socket goes with it (a receiver that hangs leaves nothing behind).
    let mut conn = std::pin::pin!(conn);
    let mut send = std::pin::pin!(sender.send_request(request));
    let response = tokio::select! {
        biased;
        r = &mut send => r,
        c = &mut conn => match c {
            // The connection may end with the answer in hand (`Connection: close`).
            Ok(()) => send.await,
            Err(e) => return retry(format!("http: {e}")),
        },
    };
    let response = match response {
        Ok(r) => r,
        Err(e) => return retry(format!("http: {e}")),
    };
    classify(response.status(), response.headers())
}

fn retry(why: String) -> Outcome {
    Outcome::Retry { why, after: None }
}

/// 2xx delivered; 408, 429 and 5xx retried (with `Retry-After` in seconds, if any); the rest
/// refused (a redirect is not followed: the url should be the final one).
pub(crate) fn classify(status: StatusCode, headers: &hyper::HeaderMap) -> Outcome {
    if status.is_success() {
        return Outcome::Delivered;
    }
    if status.is_server_error()
        || status == StatusCode::TOO_MANY_REQUESTS
        || status == StatusCode::REQUEST_TIMEOUT
    {
        let after = headers
            .get(hyper::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(|s| Duration::from_secs(s).min(MAX_RETRY_AFTER));
        return Outcome::Retry {
            why: format!("the receiver answered {status}"),
            after,
        };
    }
    if status.is_redirection() {
        return Outcome::Refused(format!(
            "the receiver answered {status}: redirects are not followed, write the final url"
        ));
    }
    Outcome::Refused(format!("the receiver answered {status}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        let h = hyper::HeaderMap::new();
        assert!(matches!(classify(StatusCode::OK, &h), Outcome::Delivered));
        assert!(matches!(
            classify(StatusCode::NO_CONTENT, &h),
            Outcome::Delivered
        ));
        assert!(matches!(
            classify(StatusCode::BAD_GATEWAY, &h),
            Outcome::Retry { after: None, .. }
        ));
        assert!(matches!(
            classify(StatusCode::NOT_FOUND, &h),
            Outcome::Refused(_)
        ));
        assert!(matches!(
            classify(StatusCode::FOUND, &h),
            Outcome::Refused(_)
        ));
        let mut h = hyper::HeaderMap::new();
        h.insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("7"),
        );
        assert!(matches!(
            classify(StatusCode::TOO_MANY_REQUESTS, &h),
            Outcome::Retry { after: Some(d), .. } if d == Duration::from_secs(7)
        ));
        h.insert(
            hyper::header::RETRY_AFTER,
            hyper::header::HeaderValue::from_static("86400"),
        );
        assert!(matches!(
            classify(StatusCode::SERVICE_UNAVAILABLE, &h),
            Outcome::Retry { after: Some(d), .. } if d == MAX_RETRY_AFTER
        ));
    }
}
