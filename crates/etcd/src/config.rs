//! How to reach etcd: endpoints, the per-call timeout, TLS files and an optional user, and the
//! checks that turn a bad configuration into one clear line before anything connects. It must
//! not open connections (that is `client.rs`).

use std::path::PathBuf;
use std::time::Duration;

use tonic::transport::Uri;

use crate::Error;

/// Files for TLS to etcd (PEM). `cert` and `key` go together: a client certificate for etcd's
/// `--client-cert-auth`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// The CA that signed etcd's server certificates.
    pub ca: PathBuf,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// How to reach an etcd cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `http://host:port` or `https://host:port`, one per member (any subset works; more
    /// means the client survives more members down).
    pub endpoints: Vec<String>,
    /// The limit of one attempt of one call; a call retries across endpoints for a few
    /// times this (see [`Config::retry_budget`]).
    pub timeout: Duration,
    pub tls: Option<TlsConfig>,
    /// `(username, password)`: the client calls `Auth.Authenticate` and sends the token with
    /// each call, authenticating again when etcd says the token is invalid (expired).
    pub user: Option<(String, String)>,
}

/// The per-call timeout when none is given.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest per-call timeout taken (a call may retry for a few times this).
pub const MAX_TIMEOUT: Duration = Duration::from_secs(600);

/// How many timeouts a call may spend retrying: enough to ride out an etcd leader election
/// (about one election timeout, 1 s by default) plus a dead endpoint's timeout.
const RETRY_TIMEOUTS: u32 = 3;

impl Default for Config {
    fn default() -> Self {
        Config {
            endpoints: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
            tls: None,
            user: None,
        }
    }
}

impl Config {
    /// A configuration with these endpoints and the defaults otherwise.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Config {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            ..Config::default()
        }
    }

    /// How long one call may keep retrying across endpoints before it gives up.
    pub fn retry_budget(&self) -> Duration {
        self.timeout * RETRY_TIMEOUTS
    }

    /// Checks the configuration; the error says what to change.
    pub fn validate(&self) -> Result<(), Error> {
        if self.endpoints.is_empty() {
            return Err(Error::Config(
                "no endpoints: give at least one etcd URL such as http://127.0.0.1:2379".into(),
            ));
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(Error::Config(format!(
                "timeout {:?} is out of range: give the per-call timeout, 2 s by default, at most {MAX_TIMEOUT:?}",
                self.timeout
            )));
        }
        for url in &self.endpoints {
            let scheme = endpoint_scheme(url)?;
            if scheme == "https" && self.tls.is_none() {
                return Err(Error::Config(format!(
                    "endpoint {url:?} is https but no TLS is configured: give the CA file (tls.ca)"
                )));
            }
        }
        if let Some(tls) = &self.tls
            && tls.cert.is_some() != tls.key.is_some()
        {
            return Err(Error::Config(
                "TLS needs both a client certificate and its key, or neither".into(),
            ));
        }
        if let Some((user, _)) = &self.user
            && user.is_empty()
        {
            return Err(Error::Config(
                "the user name is empty: give a name or no user".into(),
            ));
        }
        Ok(())
    }
}

/// `http` or `https` for a valid endpoint URL (scheme, host and port, no path).
pub(crate) fn endpoint_scheme(url: &str) -> Result<&'static str, Error> {
    let uri: Uri = url.parse().map_err(|e| {
        Error::Config(format!(
            "endpoint {url:?} is not a URL ({e}): write it as http://host:port"
        ))
    })?;
    let scheme = match uri.scheme_str() {
        Some("http") => "http",
        Some("https") => "https",
        _ => {
            return Err(Error::Config(format!(
                "endpoint {url:?} needs the scheme http:// or https://"
            )));
        }
    };
    let host = uri.host().unwrap_or_default();
    if host.is_empty() {
        return Err(Error::Config(format!(
            "endpoint {url:?} has no host: write it as {scheme}://host:port"
        )));
    }
    if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
        return Err(Error::Config(format!(
            "endpoint {url:?} has a path: etcd serves at the root, write {scheme}://host:port"
        )));
    }
    Ok(scheme)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(endpoints: &[&str]) -> Result<(), Error> {
        Config::new(endpoints.iter().copied()).validate()
    }

    #[test]
    fn good_endpoints_pass_and_bad_ones_say_what_to_write() {
        check(&["http://127.0.0.1:2379", "http://etcd-1:2379/"]).expect("valid");
        for (bad, says) in [
            ("127.0.0.1:2379", "scheme"),
            ("ftp://x:1", "scheme"),
            ("http://x:1/v3", "path"),
            ("not a url", "not a URL"),
            ("https://x:1", "no TLS"),
        ] {
            let e = check(&[bad]).expect_err(bad).to_string();
            assert!(e.contains(says), "{bad}: {e}");
            assert!(!e.contains('\n'));
        }
        let e = check(&[]).expect_err("empty").to_string();
        assert!(e.contains("at least one"), "{e}");
    }
}
