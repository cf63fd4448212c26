//! https: the PEM certificate chain and key of `Options::tls`, served with rustls (ring).

use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::{self, ServerConfig};

/// How long a client may take over the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// An acceptor for the PEM `chain` and `key`, or a one-line reason they cannot serve.
pub fn acceptor(chain: &[u8], key: &[u8]) -> Result<TlsAcceptor, String> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("console TLS certificate: {e}"))?;
    if certs.is_empty() {
        return Err("console TLS certificate: no PEM certificate in it".into());
    }
    let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("console TLS key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("console TLS: {e}"))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| format!("console TLS certificate and key: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let Err(e) = acceptor(b"not pem", b"not pem") else {
            panic!("junk accepted");
        };
        assert!(e.contains("certificate"), "{e}");
    }
}
