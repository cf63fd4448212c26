//! One REST call with the forge's token, retried: rate limits waited out as the forge asks,
//! connection errors and 5xx retried with backoff, all waits together within `max_wait`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use automaton_webhooks::http::{self, Failure, Response, TlsConnector};
use bytes::Bytes;
use hyper::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};
use hyper::{Method, StatusCode};

use crate::config::{Kind, Token};
use crate::{Action, Error, api};

/// Tries after the first for a connection error or a 5xx: four in all.
const RETRIES: u32 = 3;
/// The wait after the first failed try, doubled for each next one.
const BACKOFF: Duration = Duration::from_millis(250);
/// A rate limit's wait when the forge names none: doubled for each next one, up to a minute.
const RATE_WAIT: Duration = Duration::from_secs(1);
const MAX_RATE_WAIT: Duration = Duration::from_secs(60);

pub(crate) struct Client {
    pub kind: Kind,
    pub repository: String,
    /// The token's header among them (marked sensitive).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub token: Token,
    /// `token_file PATH` or `token_env NAME`: what an `Auth` error names.
    pub token_source: String,
    pub tls: Option<TlsConnector>,
    pub timeout: Duration,
    pub max_wait: Duration,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("token_source", &self.token_source)
            .field("tls", &self.tls.is_some())
            .field("timeout", &self.timeout)
            .field("max_wait", &self.max_wait)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Sends `method url` (with `body` as JSON) until the forge answers something other than
    /// a rate limit or a 5xx, and returns that answer, whatever its status.
    pub(crate) async fn call(
        &self,
        action: Action,
        method: Method,
        url: &str,
        body: Option<Bytes>,
    ) -> Result<Response, Error> {
        let mut headers = self.headers.clone();
        if body.is_some() {
            headers.push((CONTENT_TYPE, HeaderValue::from_static("application/json")));
        }
        let mut waited = Duration::ZERO;
        let mut failures = 0u32;
        let mut limits = 0u32;
        loop {
            let answer = http::request(
                method.clone(),
                url,
                &headers,
                body.clone(),
                self.timeout,
                self.tls.as_ref(),
                http::MAX_BODY,
            )
            .await;
            let (why, wait) = match answer {
                Err(Failure::Invalid(why)) => {
                    return Err(Error::Config(format!("api_url: {why}")));
                }
                Err(Failure::Transport(why)) => {
                    failures += 1;
                    if failures > RETRIES {
                        return Err(self.unavailable(
                            action,
                            format!("{why} ({failures} tries)"),
                            None,
                        ));
                    }
                    (why, backoff(failures))
                }
                Ok(r) if rate_limited(r.status, &r.headers, &r.body) => {
                    limits += 1;
                    let wait = asked_wait(&r.headers, unix_now())
                        .unwrap_or_else(|| rate_wait(limits))
                        // Never 0: each wait counts against max_wait, so the tries end.
                        .max(Duration::from_secs(1));
                    let why = format!("rate limited ({}): {}", r.status, self.excerpt(&r.body));
                    (why, wait)
                }
                Ok(r) if r.status.is_server_error() => {
                    failures += 1;
                    let why = format!("it answered {}: {}", r.status, self.excerpt(&r.body));
                    let asked = retry_after(&r.headers);
                    if failures > RETRIES {
                        return Err(self.unavailable(
                            action,
                            format!("{why} ({failures} tries)"),
                            asked,
                        ));
                    }
                    (why, asked.unwrap_or_else(|| backoff(failures)))
                }
                Ok(r) => return Ok(r),
            };
            let total = waited.saturating_add(wait);
            if total > self.max_wait {
                return Err(self.unavailable(
                    action,
                    format!(
                        "{why}; the next try is due in {}, past max_wait {} (waited {} already)",
                        humantime::format_duration(wait),
                        humantime::format_duration(self.max_wait),
                        humantime::format_duration(waited)
                    ),
                    Some(wait),
                ));
            }
            tracing::debug!(
                forge = %self.kind, %action,
                "{why}; trying again in {}", humantime::format_duration(wait)
            );
            tokio::time::sleep(wait).await;
            waited = total;
        }
    }

    /// The final error for an answer that is neither a success nor worth another try.
    pub(crate) fn refusal(&self, action: Action, r: &Response) -> Error {
        let status = r.status.as_u16();
        let mut message = self.excerpt(&r.body);
        match r.status {
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                return Error::Auth {
                    forge: self.kind,
                    action,
                    status,
                    message,
                    token_source: self.token_source.clone(),
                };
            }
            StatusCode::NOT_FOUND => message.push_str(&format!(
                " (check repository '{}' and api_url; a token that may not see a private \
                 repository gets 404 too)",
                self.repository
            )),
            s if s.is_redirection() => {
                let to = r
                    .headers
                    .get(LOCATION)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("?");
                message = format!(
                    "redirects are not followed: write the final api_url (it points to {})",
                    self.token.redact(to)
                );
            }
            _ => {}
        }
        Error::Refused {
            forge: self.kind,
            action,
            status,
            message,
        }
    }

    pub(crate) fn unavailable(
        &self,
        action: Action,
        reason: String,
        retry_after: Option<Duration>,
    ) -> Error {
        Error::Unavailable {
            forge: self.kind,
            action,
            reason: self.token.redact(&reason),
            retry_after,
        }
    }

    /// The forge's message, one line, without the token should the forge echo it.
    pub(crate) fn excerpt(&self, body: &[u8]) -> String {
        self.token.redact(&api::excerpt(body))
    }
}

fn backoff(failures: u32) -> Duration {
    BACKOFF.saturating_mul(1 << failures.saturating_sub(1).min(10))
}

fn rate_wait(limits: u32) -> Duration {
    RATE_WAIT
        .saturating_mul(1 << limits.saturating_sub(1).min(10))
        .min(MAX_RATE_WAIT)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn header<'a>(headers: &'a HeaderMap, names: &[&str]) -> Option<&'a str> {
    names
        .iter()
        .find_map(|n| headers.get(*n))
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
}

/// A rate limit: 429; or a 403 that says it is one (`Retry-After`, no requests remaining,
/// or GitHub's "secondary rate limit" message). Any other 403 is the token's.
pub(crate) fn rate_limited(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> bool {
    if status == StatusCode::TOO_MANY_REQUESTS {
        return true;
    }
    status == StatusCode::FORBIDDEN
        && (headers.contains_key(RETRY_AFTER)
            || header(headers, &["x-ratelimit-remaining", "ratelimit-remaining"]) == Some("0")
            || api::excerpt(body)
                .to_ascii_lowercase()
                .contains("rate limit"))
}

/// `Retry-After` in seconds (the HTTP-date form is taken as absent).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    header(headers, &["retry-after"])?
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// How long the forge asks to wait: `Retry-After`, else until `X-RateLimit-Reset` (GitHub) or
/// `RateLimit-Reset` (GitLab), Unix seconds (a small number is taken as seconds from now).
pub(crate) fn asked_wait(headers: &HeaderMap, now: u64) -> Option<Duration> {
    if let Some(d) = retry_after(headers) {
        return Some(d);
    }
    let reset = header(headers, &["x-ratelimit-reset", "ratelimit-reset"])?
        .parse::<u64>()
        .ok()?;
    // A Unix time is past 2001; a delta that large would be over 30 years.
    let secs = if reset >= 1_000_000_000 {
        // One second more: the forge's clock and ours may differ by a little.
        reset.saturating_sub(now).saturating_add(1)
    } else {
        reset
    };
    Some(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        h
    }

    #[test]
    fn rate_limits_are_told_from_a_refused_token() {
        let none = HeaderMap::new();
        assert!(rate_limited(StatusCode::TOO_MANY_REQUESTS, &none, b""));
        assert!(rate_limited(
            StatusCode::FORBIDDEN,
            &headers(&[("retry-after", "30")]),
            b""
        ));
        assert!(rate_limited(
            StatusCode::FORBIDDEN,
            &headers(&[("x-ratelimit-remaining", "0")]),
            b""
        ));
        assert!(rate_limited(
            StatusCode::FORBIDDEN,
            &none,
            br#"{"message":"You have exceeded a secondary rate limit."}"#
        ));
        assert!(!rate_limited(
            StatusCode::FORBIDDEN,
            &headers(&[("x-ratelimit-remaining", "4999")]),
            br#"{"message":"Resource not accessible by integration"}"#
        ));
        assert!(!rate_limited(StatusCode::UNAUTHORIZED, &none, b""));
        assert!(!rate_limited(StatusCode::SERVICE_UNAVAILABLE, &none, b""));
    }

    #[test]
    fn the_wait_is_what_the_forge_asks() {
        let now = 1_700_000_000;
        assert_eq!(
            asked_wait(&headers(&[("retry-after", " 7 ")]), now),
            Some(Duration::from_secs(7))
        );
        // Retry-After wins over the reset time.
        assert_eq!(
            asked_wait(
                &headers(&[("retry-after", "2"), ("x-ratelimit-reset", "1700000100")]),
                now
            ),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            asked_wait(&headers(&[("x-ratelimit-reset", "1700000030")]), now),
            Some(Duration::from_secs(31))
        );
        assert_eq!(
            asked_wait(&headers(&[("ratelimit-reset", "1699999000")]), now),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            asked_wait(&headers(&[("ratelimit-reset", "20")]), now),
            Some(Duration::from_secs(20))
        );
        assert_eq!(
            asked_wait(
                &headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")]),
                now
            ),
            None
        );
        assert_eq!(asked_wait(&headers(&[("retry-after", "-1")]), now), None);
        let max = u64::MAX.to_string();
        assert_eq!(
            asked_wait(&headers(&[("x-ratelimit-reset", &max)]), now),
            Some(Duration::from_secs(u64::MAX - now + 1))
        );
        assert_eq!(
            asked_wait(&headers(&[("retry-after", &max)]), 0),
            Some(Duration::from_secs(u64::MAX))
        );
        assert_eq!(asked_wait(&HeaderMap::new(), now), None);
    }

    #[test]
    fn backoffs_double_and_stay_bounded() {
        assert_eq!(backoff(1), Duration::from_millis(250));
        assert_eq!(backoff(3), Duration::from_secs(1));
        assert_eq!(rate_wait(1), Duration::from_secs(1));
        assert_eq!(rate_wait(4), Duration::from_secs(8));
        assert_eq!(rate_wait(u32::MAX), MAX_RATE_WAIT);
        assert!(backoff(u32::MAX) <= Duration::from_secs(256));
    }
}
