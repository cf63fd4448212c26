//! `[[webhooks]]`: one receiver each, as the coordinator's TOML holds them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::http::{BadUrl, Target};

/// The events a receiver can subscribe to, by name (`events = [...]`; `"*"` is all of them).
pub const EVENTS: &[&str] = &[
    "awaiting_approval",
    "human_intervention",
    "held",
    "worker_lost",
    "subtask_too_large",
    "merged",
    "pull_request_opened",
    "delivery_failed",
];

/// Why a person is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Event {
    /// A phase waits for a person's sign-off (`X:awaiting_approval`).
    AwaitingApproval,
    /// A task stopped for a person: a failed review, the referee's FAIL or NEEDS_REVIEW.
    HumanIntervention,
    /// A task is held: nothing offers it until a person lets it go.
    Held,
    /// A worker's session ended without it: its leases ended (`worker_lost`).
    WorkerLost,
    /// A sub-task is too large for any machine in the fleet (`subtask_too_large`).
    SubtaskTooLarge,
    /// A finished task's work landed on its base branch (`merged`).
    Merged,
    /// A finished task's pull request is open (`pull_request_opened`).
    PullRequestOpened,
    /// A step of a finished task's delivery failed (`delivery_failed`).
    DeliveryFailed,
}

impl Event {
    /// Every event, in [`EVENTS`]' order.
    pub const ALL: [Event; 8] = [
        Event::AwaitingApproval,
        Event::HumanIntervention,
        Event::Held,
        Event::WorkerLost,
        Event::SubtaskTooLarge,
        Event::Merged,
        Event::PullRequestOpened,
        Event::DeliveryFailed,
    ];

    /// The name in the config and in the body's `"event"`.
    pub fn name(self) -> &'static str {
        match self {
            Event::AwaitingApproval => "awaiting_approval",
            Event::HumanIntervention => "human_intervention",
            Event::Held => "held",
            Event::WorkerLost => "worker_lost",
            Event::SubtaskTooLarge => "subtask_too_large",
            Event::Merged => "merged",
            Event::PullRequestOpened => "pull_request_opened",
            Event::DeliveryFailed => "delivery_failed",
        }
    }
}

impl std::fmt::Display for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Event {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Event::ALL
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| {
                format!(
                    "unknown event '{s}': write one of {}, or \"*\" for all",
                    EVENTS.join(", ")
                )
            })
    }
}

/// The body a receiver gets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// `{"id","event","task","worker","summary","time","detail","link"}` (`docs/webhooks.md`).
    #[default]
    Json,
    /// `{"text": "..."}`: what a Slack (or Mattermost, Rocket.Chat…) incoming webhook takes.
    Slack,
}

/// The longest a configured duration may be: a day is already more than a webhook needs.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);
/// The most attempts of one delivery.
pub const MAX_ATTEMPTS: u32 = 20;
/// The most notifications one receiver's queue holds.
pub const MAX_QUEUE: usize = 100_000;

/// The headers a delivery sets itself, which `headers` may not name.
const RESERVED_HEADERS: &[&str] = &[
    "host",
    "content-type",
    "content-length",
    "transfer-encoding",
    "connection",
];

/// One `[[webhooks]]` receiver.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Webhook {
    /// `http://host[:port]/path` or `https://…` (no user or password in it).
    pub url: String,
    /// The [`EVENTS`] it gets, or `["*"]` for all. At least one.
    pub events: Vec<String>,
    /// A file holding the HMAC-SHA256 secret (its surrounding whitespace is not part of it):
    /// deliveries then carry `X-Automaton-Signature`. Never the secret itself in the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
    /// `json` (the default) or `slack`.
    #[serde(default)]
    pub format: Format,
    /// One attempt: connecting, TLS, sending and the answer's status (default 5s).
    #[serde(default = "default_timeout", with = "duration")]
    pub timeout: Duration,
    /// Attempts of one delivery before it is given up (default 5; 1 is no retry).
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// The wait before the first retry (default 1s), doubled for each next one up to a
    /// minute (or this, if longer), less a random part of up to half (jitter). A receiver's
    /// `Retry-After` (seconds, at most a minute) replaces it.
    #[serde(default = "default_backoff", with = "duration")]
    pub backoff: Duration,
    /// Notifications waiting for this receiver, at most (default 1000): past it a new one is
    /// dropped and counted, never waited for.
    #[serde(default = "default_queue")]
    pub queue: usize,
    /// More headers on every delivery (e.g. a routing key). Not for secrets: the config is
    /// not a secret store, use `secret_file`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub headers: BTreeMap<String, String>,
    /// For `https://`: the PEM file of the CA certificates to trust instead of the system's
    /// bundle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
}

fn default_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_max_attempts() -> u32 {
    5
}
fn default_backoff() -> Duration {
    Duration::from_secs(1)
}
fn default_queue() -> usize {
    1000
}

impl Webhook {
    /// A receiver of `events` at `url` with every other field its default.
    pub fn new(url: impl Into<String>, events: &[&str]) -> Webhook {
        Webhook {
            url: url.into(),
            events: events.iter().map(|e| e.to_string()).collect(),
            secret_file: None,
            format: Format::Json,
            timeout: default_timeout(),
            max_attempts: default_max_attempts(),
            backoff: default_backoff(),
            queue: default_queue(),
            headers: BTreeMap::new(),
            ca_file: None,
        }
    }

    /// Checks everything that can be checked before starting, the secret file's content
    /// included; the error is one line that says what to write instead.
    pub fn validate(&self) -> Result<(), Error> {
        self.check().map_err(|reason| Error::Config {
            which: redact(&self.url),
            reason,
        })?;
        if let Some(path) = &self.secret_file {
            read_secret(path).map_err(|reason| Error::Config {
                which: redact(&self.url),
                reason,
            })?;
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        self.target()?;
        if self.events.is_empty() {
            return Err(format!(
                "events is empty: write some of {}, or [\"*\"] for all",
                EVENTS.join(", ")
            ));
        }
        for e in &self.events {
            if e != "*" {
                e.parse::<Event>()?;
            }
        }
        if self.timeout.is_zero() || self.timeout > MAX_DURATION {
            return Err(format!(
                "timeout '{}': write a duration above 0 and at most a day, e.g. '5s'",
                humantime::format_duration(self.timeout)
            ));
        }
        if self.backoff > MAX_DURATION {
            return Err("backoff: write at most a day, e.g. '1s'".to_string());
        }
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS {
            return Err(format!(
                "max_attempts {}: write 1 (no retry) to {MAX_ATTEMPTS}",
                self.max_attempts
            ));
        }
        if self.queue == 0 || self.queue > MAX_QUEUE {
            return Err(format!("queue {}: write 1 to {MAX_QUEUE}", self.queue));
        }
        for (name, value) in &self.headers {
            let lower = name.to_ascii_lowercase();
            if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(format!(
                    "header '{name}' is not a header name: letters, digits and '-'"
                ));
            }
            if RESERVED_HEADERS.contains(&lower.as_str()) || lower.starts_with("x-automaton-") {
                return Err(format!(
                    "header '{name}' is set by every delivery itself: leave it out of headers"
                ));
            }
            if hyper::header::HeaderValue::from_str(value).is_err() {
                return Err(format!(
                    "header '{name}': its value has a character a header cannot carry (a newline?)"
                ));
            }
        }
        if let Some(ca) = &self.ca_file {
            if !self.url.starts_with("https://") {
                return Err("ca_file is only for https:// urls: leave it out".to_string());
            }
            if !ca.is_file() {
                return Err(format!(
                    "ca_file {}: no such file: write the path of a PEM file of CA certificates",
                    ca.display()
                ));
            }
        }
        Ok(())
    }

    /// The events this receiver gets.
    pub fn subscribed(&self) -> Vec<Event> {
        if self.events.iter().any(|e| e == "*") {
            return Event::ALL.to_vec();
        }
        Event::ALL
            .into_iter()
            .filter(|e| self.events.iter().any(|n| n == e.name()))
            .collect()
    }

    /// Where deliveries go, from `url`.
    pub(crate) fn target(&self) -> Result<Target, String> {
        Target::parse(&self.url).map_err(|e| match e {
            BadUrl::UserInfo => {
                "url carries a user or password: leave them out (sign with secret_file)".to_string()
            }
            BadUrl::PortZero => {
                "url: port 0 cannot be reached: write the receiver's port".to_string()
            }
            other => other.to_string(),
        })
    }
}

/// What a log line or a metric may say of `url`: its scheme, host and port. The path can be
/// the secret itself (a Slack webhook's is).
pub fn redact(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) if s == "http" || s == "https" => (s, r),
        _ => return "(not an http url)".to_string(),
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let authority = authority.rsplit('@').next().unwrap_or("");
    format!("{scheme}://{authority}")
}

/// The secret in `path`, less its surrounding whitespace; an error is the reason, in a line.
pub(crate) fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path).map_err(|e| {
        format!(
            "secret_file {}: {e}: write the path of a file that holds the secret",
            path.display()
        )
    })?;
    let start = bytes.iter().position(|b| !b.is_ascii_whitespace());
    let end = bytes.iter().rposition(|b| !b.is_ascii_whitespace());
    match (start, end) {
        (Some(s), Some(e)) => Ok(bytes[s..=e].to_vec()),
        _ => Err(format!(
            "secret_file {} is empty: put the secret in it",
            path.display()
        )),
    }
}

/// A duration in a config (serde `with`): `500ms`, `30s`, `5m` (humantime), or a bare number
/// of seconds; shared with the forge's config. The coordinator's config writes and refuses its
/// durations the same way, read with its own grammar ([`deserialize_with`]).
pub mod duration {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Whole seconds as `30s`, else milliseconds as `1500ms`.
    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        if d.subsec_millis() == 0 {
            s.serialize_str(&format!("{}s", d.as_secs()))
        } else {
            s.serialize_str(&format!("{}ms", d.as_millis()))
        }
    }

    /// A string read with [`parse`].
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        deserialize_with(d, parse)
    }

    /// A bare number of seconds, else humantime (`500ms`, `5m`, `1h 30m`).
    pub fn parse(text: &str) -> Option<Duration> {
        let t = text.trim();
        t.parse::<u64>()
            .ok()
            .map(Duration::from_secs)
            .or_else(|| humantime::parse_duration(t).ok())
    }

    /// A string read with `parse`; one it does not take is refused with what to write.
    pub fn deserialize_with<'de, D: Deserializer<'de>>(
        d: D,
        parse: impl FnOnce(&str) -> Option<Duration>,
    ) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse(&text).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "'{text}' is not a duration: write e.g. '500ms', '30s', '5m'"
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_is_logged_without_its_path() {
        assert_eq!(
            redact("https://hooks.slack.com/services/T0/B0/XXXX"),
            "https://hooks.slack.com"
        );
        assert_eq!(redact("http://u:p@h:1/x"), "http://h:1");
        assert_eq!(redact("ftp://h/x"), "(not an http url)");
    }

    #[test]
    fn star_subscribes_to_everything_and_names_pick() {
        assert_eq!(
            Webhook::new("http://h/", &["*"]).subscribed(),
            Event::ALL.to_vec()
        );
        assert_eq!(
            Webhook::new("http://h/", &["held", "worker_lost"]).subscribed(),
            vec![Event::Held, Event::WorkerLost]
        );
        assert_eq!(EVENTS.len(), Event::ALL.len());
        for (e, n) in Event::ALL.iter().zip(EVENTS) {
            assert_eq!(e.name(), *n);
        }
    }
}
