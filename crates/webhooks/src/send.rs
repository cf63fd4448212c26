//! One delivery attempt: a POST over [`crate::http`], and what its answer means.

use std::time::Duration;

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use hyper::{Method, StatusCode};
use tokio_rustls::TlsConnector;

use crate::http::{self, Failure, Target};

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

/// POSTs `body` as JSON with `headers` (after our own) to `target`, all of it within `timeout`.
pub(crate) async fn post(
    target: &Target,
    tls: Option<&TlsConnector>,
    headers: &[(HeaderName, HeaderValue)],
    body: Bytes,
    timeout: Duration,
) -> Outcome {
    let mut all = Vec::with_capacity(headers.len() + 2);
    all.push((
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    ));
    all.push((
        hyper::header::USER_AGENT,
        HeaderValue::from_static(concat!("automaton-webhooks/", env!("CARGO_PKG_VERSION"))),
    ));
    all.extend(headers.iter().cloned());
    // The body is not read: a receiver's answer is its status (and Retry-After).
    match http::send(target, Method::POST, &all, Some(body), timeout, tls, 0).await {
        Ok(response) => classify(response.status, &response.headers),
        Err(Failure::Transport(why)) => retry(why),
        Err(Failure::Invalid(why)) => Outcome::Refused(why),
    }
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
