//! The crate's one error type and the mapping from a gRPC status (etcd's or the transport's)
//! to it, including which failures are worth another attempt on another endpoint. It must not
//! retry anything itself (that is `client.rs`), and every message is one line that says what to
//! do about it.

use tonic::{Code, Status};

/// What can go wrong talking to etcd. Every message is one line.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work (no endpoint, a bad URL, an unreadable certificate).
    #[error("etcd client configuration: {0}")]
    Config(String),
    /// No endpoint answered in time: all down, partitioned, or the cluster has no leader.
    #[error("etcd unavailable: {0}")]
    Unavailable(String),
    /// A fenced write found that this candidate no longer holds the leader key.
    #[error("deposed: {0}")]
    Deposed(String),
    /// etcd refused a request over its size limit (`--max-request-bytes`, 1.5 MiB by default).
    #[error(
        "{what}: the request ({bytes} bytes) is over etcd's request size limit (--max-request-bytes, 1.5 MiB by default): split it or raise the limit ({message})"
    )]
    TooLarge {
        what: String,
        bytes: usize,
        message: String,
    },
    /// Authentication failed or the user may not do this.
    #[error("etcd authentication: {0}")]
    Auth(String),
    /// A read at a revision etcd has compacted away.
    #[error("etcd: {0}")]
    Compacted(String),
    /// Any other answer from etcd that a retry will not change.
    #[error("etcd: {0}")]
    Etcd(String),
}

/// How the retry loop should treat a failed attempt.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Transient: try the next endpoint (transport errors, `Unavailable`, no leader, ...).
    Retry(String),
    /// The auth token is missing or expired: authenticate again, then retry.
    Reauthenticate(String),
    /// Final: return this.
    Fail(Error),
}

/// etcd's own errors all start with this; anything else in an `Unknown`/`Cancelled` status
/// comes from the transport (a reset connection, a killed member) and is worth a retry.
const ETCD_PREFIX: &str = "etcdserver:";

pub(crate) fn classify(what: &str, bytes: usize, status: &Status) -> Verdict {
    let message = status.message().replace('\n', " ");
    let from_etcd = message.starts_with(ETCD_PREFIX);
    match status.code() {
        // Covers "no leader", "leader changed", "request timed out", "server stopped", "not
        // capable", "unhealthy cluster" and a connection that could not be made.
        Code::Unavailable | Code::DeadlineExceeded => Verdict::Retry(message),
        Code::Unknown | Code::Cancelled | Code::Aborted if !from_etcd => Verdict::Retry(message),
        Code::Unauthenticated if message.contains("invalid auth token") => {
            Verdict::Reauthenticate(message)
        }
        // With auth on, a request without a token is taken as from the empty user name.
        Code::InvalidArgument if message.contains("user name is empty") => {
            Verdict::Reauthenticate(message)
        }
        // "etcdserver: request is too large" (over --max-request-bytes) or gRPC's own limit
        // ("received message larger than max"), which etcd sets at that plus 512 KiB.
        Code::InvalidArgument if message.contains("request is too large") => {
            Verdict::Fail(Error::TooLarge {
                what: what.to_string(),
                bytes,
                message,
            })
        }
        Code::ResourceExhausted if message.contains("larger than max") => {
            Verdict::Fail(Error::TooLarge {
                what: what.to_string(),
                bytes,
                message,
            })
        }
        Code::Unauthenticated | Code::PermissionDenied => Verdict::Fail(Error::Auth(format!(
            "{what}: {message}; check the configured user, its password and its roles"
        ))),
        Code::InvalidArgument if message.contains("authentication failed") => {
            Verdict::Fail(Error::Auth(format!(
                "{what}: {message}; check the configured user and password"
            )))
        }
        Code::OutOfRange if message.contains("compacted") => Verdict::Fail(Error::Compacted(
            format!("{what}: {message}; read again at the current revision"),
        )),
        Code::InvalidArgument if message.contains("too many operations") => {
            Verdict::Fail(Error::Etcd(format!(
                "{what}: {message}; split the transaction (see MAX_TXN_OPS and txn_in_batches)"
            )))
        }
        Code::InvalidArgument if message.contains("duplicate key") => Verdict::Fail(Error::Etcd(
            format!("{what}: {message}; a transaction may put or delete each key only once"),
        )),
        Code::ResourceExhausted if message.contains("too many requests") => Verdict::Retry(message),
        code => Verdict::Fail(Error::Etcd(format!("{what}: {code:?}: {message}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(code: Code, message: &str) -> Verdict {
        classify("Put", 10, &Status::new(code, message))
    }

    #[test]
    fn etcds_transient_errors_are_retried_and_the_rest_are_not() {
        for (code, message) in [
            (Code::Unavailable, "etcdserver: no leader"),
            (Code::Unavailable, "etcdserver: leader changed"),
            (Code::Unavailable, "etcdserver: request timed out"),
            (Code::Unavailable, "tcp connect error"),
            (Code::Unknown, "transport error"),
            (Code::Cancelled, "h2 protocol error: connection reset"),
        ] {
            assert!(
                matches!(verdict(code, message), Verdict::Retry(_)),
                "{code:?} {message}"
            );
        }
        assert!(matches!(
            verdict(Code::InvalidArgument, "etcdserver: request is too large"),
            Verdict::Fail(Error::TooLarge { bytes: 10, .. })
        ));
        assert!(matches!(
            verdict(Code::Unauthenticated, "etcdserver: invalid auth token"),
            Verdict::Reauthenticate(_)
        ));
        assert!(matches!(
            verdict(Code::Unknown, "etcdserver: something new"),
            Verdict::Fail(Error::Etcd(_))
        ));
        assert!(matches!(
            verdict(
                Code::OutOfRange,
                "etcdserver: mvcc: required revision has been compacted"
            ),
            Verdict::Fail(Error::Compacted(_))
        ));
    }

    #[test]
    fn messages_are_one_line() {
        let e = classify("Put", 1, &Status::new(Code::Internal, "a\nb"));
        let Verdict::Fail(e) = e else {
            panic!("internal is final")
        };
        assert!(!e.to_string().contains('\n'), "{e}");
    }
}
