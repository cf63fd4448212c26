//! Webhooks when a person is needed (issue 23): `[[webhooks]]` receivers get an HTTP POST
//! for the events they subscribe to (`awaiting_approval`, `human_intervention`, `held`,
//! `worker_lost`, `subtask_too_large`) and where finished work went (`merged`,
//! `pull_request_opened`, `delivery_failed`), signed with HMAC-SHA256 when they have a secret,
//! retried with exponential backoff, as JSON or as a Slack-compatible `{"text"}`.
//!
//! What it owns: the [`Webhook`] config and its validation, the bodies ([`Notification`]),
//! the signature ([`signature`], `docs/webhooks.md` has the receiver's recipe), and the
//! [`Webhooks`] dispatcher: one tokio task and one bounded queue per receiver, counters the
//! coordinator can export. Its HTTP client ([`http`]: one request over a new http or https
//! connection, bounded in time) is public: `automaton-forge` sends over it too.
//!
//! What it must not do: slow the coordinator. [`Webhooks::notify`] never waits (a full
//! queue drops the new notification and counts it), never fails, and needs no `.await`;
//! a receiver that hangs costs only its own task, bounded by `timeout` per attempt. It does
//! not decide *when* a person is needed (the coordinator calls `notify`), does not keep
//! notifications across restarts, and never logs a secret: not the secret file's content,
//! and not a URL's path (a Slack webhook's path is its secret; logs name scheme, host and
//! port only).

mod config;
mod hmac;
pub mod http;
mod notification;
mod send;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hyper::header::{HeaderName, HeaderValue};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use config::{
    EVENTS, Event, Format, MAX_ATTEMPTS, MAX_DURATION, MAX_QUEUE, Webhook, duration, redact,
};
pub use hmac::{constant_time_eq, hmac_sha256, signature, verify};
pub use notification::{Notification, slack_escape};

use send::Outcome;

/// The signature header: `sha256=` and the hex HMAC-SHA256 of `"{timestamp}.{body}"`.
pub const SIGNATURE_HEADER: &str = "x-automaton-signature";
/// Unix seconds when the attempt was signed (every attempt anew).
pub const TIMESTAMP_HEADER: &str = "x-automaton-timestamp";
/// The notification's id: the same in every attempt.
pub const DELIVERY_HEADER: &str = "x-automaton-delivery";
/// The event's name.
pub const EVENT_HEADER: &str = "x-automaton-event";

/// The longest wait between two attempts (before jitter), whatever `backoff` doubles to.
pub const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// How long deliveries still queued may go on after [`Webhooks`] is dropped without
/// [`Webhooks::close`].
pub const DROP_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `[[webhooks]]` entry that cannot work; `which` names it (its redacted url).
    #[error("[[webhooks]] {which}: {reason}")]
    Config { which: String, reason: String },
    #[error("webhooks: start them inside a tokio runtime")]
    NoRuntime,
}

/// What one receiver's deliveries came to, since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Notifications the receiver answered with a 2xx.
    pub delivered: u64,
    /// Notifications given up: a 4xx, or `max_attempts` attempts that failed.
    pub failed: u64,
    /// Notifications never attempted: the queue was full, or the dispatcher closed first.
    pub dropped: u64,
    /// Attempts after a notification's first.
    pub retried: u64,
}

impl std::ops::Add for Counts {
    type Output = Counts;
    fn add(self, o: Counts) -> Counts {
        Counts {
            delivered: self.delivered + o.delivered,
            failed: self.failed + o.failed,
            dropped: self.dropped + o.dropped,
            retried: self.retried + o.retried,
        }
    }
}

/// One receiver's counts, under the url a metric may carry ([`redact`]ed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceiverCounts {
    /// Its place in the config's `[[webhooks]]`, from 0.
    pub index: usize,
    /// Scheme, host and port only.
    pub url: String,
    pub counts: Counts,
    /// Notifications waiting in its queue now.
    pub queued: usize,
}

#[derive(Default)]
struct Stats {
    delivered: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    retried: AtomicU64,
    /// A full queue has been logged (reset by the next delivery).
    warned_full: AtomicBool,
}

impl Stats {
    fn counts(&self) -> Counts {
        Counts {
            delivered: self.delivered.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            retried: self.retried.load(Ordering::Relaxed),
        }
    }
}

/// The secret, never printed.
struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

struct Receiver {
    url: String,
    subscribed: Vec<Event>,
    queue: usize,
    tx: mpsc::Sender<Arc<Notification>>,
    stats: Arc<Stats>,
    task: JoinHandle<()>,
}

/// The dispatcher: one task and one bounded queue per receiver. Dropping it lets queued
/// deliveries go on for up to [`DROP_GRACE`] in the background; [`Webhooks::close`] waits.
pub struct Webhooks {
    receivers: Vec<Receiver>,
    /// When deliveries must stop: set by close or drop.
    deadline: watch::Sender<Option<Instant>>,
}

impl std::fmt::Debug for Webhooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhooks")
            .field(
                "receivers",
                &self.receivers.iter().map(|r| &r.url).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Webhooks {
    /// Validates every receiver, reads their secrets and CA bundles, and starts one task
    /// each (inside the current tokio runtime). No receivers: a dispatcher that sends nothing.
    pub fn start(hooks: Vec<Webhook>) -> Result<Webhooks, Error> {
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| Error::NoRuntime)?;
        let (deadline, deadline_rx) = watch::channel(None);
        let mut workers = Vec::with_capacity(hooks.len());
        for (index, hook) in hooks.into_iter().enumerate() {
            let which = format!("#{} ({})", index + 1, redact(&hook.url));
            let bad = |reason: String| Error::Config {
                which: which.clone(),
                reason,
            };
            hook.validate().map_err(|e| match e {
                Error::Config { reason, .. } => bad(reason),
                other => other,
            })?;
            let target = hook.target().map_err(bad)?;
            let tls = if target.tls {
                Some(http::tls_connector(hook.ca_file.as_deref()).map_err(bad)?)
            } else {
                None
            };
            let secret = match &hook.secret_file {
                Some(path) => Some(Secret(config::read_secret(path).map_err(bad)?)),
                None => None,
            };
            let mut headers = Vec::with_capacity(hook.headers.len());
            for (name, value) in &hook.headers {
                let name = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|e| bad(format!("header '{name}': {e}")))?;
                let value = HeaderValue::from_str(value)
                    .map_err(|e| bad(format!("header '{name}': {e}")))?;
                headers.push((name, value));
            }
            workers.push((
                hook.subscribed(),
                hook.queue,
                Worker {
                    url: redact(&hook.url),
                    target,
                    tls,
                    secret,
                    format: hook.format,
                    timeout: hook.timeout,
                    max_attempts: hook.max_attempts,
                    backoff: hook.backoff,
                    headers,
                    stats: Arc::new(Stats::default()),
                    deadline: deadline_rx.clone(),
                },
            ));
        }
        // Nothing is spawned until every receiver is known good.
        let receivers = workers
            .into_iter()
            .map(|(subscribed, queue, worker)| {
                let (tx, rx) = mpsc::channel(queue);
                let url = worker.url.clone();
                let stats = worker.stats.clone();
                let task = runtime.spawn(worker.run(rx));
                Receiver {
                    url,
                    subscribed,
                    queue,
                    tx,
                    stats,
                    task,
                }
            })
            .collect();
        Ok(Webhooks {
            receivers,
            deadline,
        })
    }

    /// Queues `n` for every receiver subscribed to its event, without waiting: a receiver
    /// whose queue is full has `n` dropped and counted (and a warning logged, once until it
    /// delivers again). Callable from anywhere, async or not.
    pub fn notify(&self, n: Notification) {
        let n = Arc::new(n);
        for r in self
            .receivers
            .iter()
            .filter(|r| r.subscribed.contains(&n.event))
        {
            match r.tx.try_send(n.clone()) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    r.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    if !r.stats.warned_full.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            url = %r.url,
                            queue = r.queue,
                            "webhook receiver's queue is full (it is slow or down): new \
                             notifications are dropped and counted until it takes them again"
                        );
                    }
                }
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    r.stats.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Every receiver's counts, in the config's order.
    pub fn counts(&self) -> Vec<ReceiverCounts> {
        self.receivers
            .iter()
            .enumerate()
            .map(|(index, r)| ReceiverCounts {
                index,
                url: r.url.clone(),
                counts: r.stats.counts(),
                queued: r.queue.saturating_sub(r.tx.capacity()),
            })
            .collect()
    }

    /// All receivers' counts added up.
    pub fn totals(&self) -> Counts {
        self.receivers
            .iter()
            .fold(Counts::default(), |sum, r| sum + r.stats.counts())
    }

    /// How many receivers there are.
    pub fn len(&self) -> usize {
        self.receivers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.receivers.is_empty()
    }

    /// Stops taking notifications and lets the queued ones be delivered for up to `wait`:
    /// then what is still queued is dropped, an attempt under way is cut (failed), and the
    /// final counts are returned.
    pub async fn close(mut self, wait: Duration) -> Vec<ReceiverCounts> {
        let _ = self.deadline.send(Some(Instant::now() + wait));
        let receivers = std::mem::take(&mut self.receivers);
        // Each task stops by itself at the deadline; the extra second is for one that cannot
        // (it is aborted then).
        let until = Instant::now() + wait + Duration::from_secs(1);
        // No more notifications: each queue ends once drained.
        let tasks: Vec<_> = receivers
            .into_iter()
            .map(|r| (r.url, r.stats, r.task))
            .collect();
        let mut out = Vec::with_capacity(tasks.len());
        for (index, (url, stats, mut task)) in tasks.into_iter().enumerate() {
            if tokio::time::timeout_at(until, &mut task).await.is_err() {
                task.abort();
            }
            out.push(ReceiverCounts {
                index,
                url,
                counts: stats.counts(),
                queued: 0,
            });
        }
        out
    }
}

impl Drop for Webhooks {
    fn drop(&mut self) {
        if !self.receivers.is_empty() {
            let _ = self.deadline.send(Some(Instant::now() + DROP_GRACE));
        }
    }
}

/// One receiver's task.
struct Worker {
    url: String,
    target: http::Target,
    tls: Option<tokio_rustls::TlsConnector>,
    secret: Option<Secret>,
    format: Format,
    timeout: Duration,
    max_attempts: u32,
    backoff: Duration,
    headers: Vec<(HeaderName, HeaderValue)>,
    stats: Arc<Stats>,
    deadline: watch::Receiver<Option<Instant>>,
}

impl Worker {
    async fn run(mut self, mut rx: mpsc::Receiver<Arc<Notification>>) {
        while let Some(n) = rx.recv().await {
            if self.deadline_passed() {
                rx.close();
                let mut left = 1;
                while rx.try_recv().is_ok() {
                    left += 1;
                }
                self.stats.dropped.fetch_add(left, Ordering::Relaxed);
                break;
            }
            self.deliver(&n).await;
        }
    }

    fn deadline(&self) -> Option<Instant> {
        *self.deadline.borrow()
    }

    fn deadline_passed(&self) -> bool {
        self.deadline().is_some_and(|d| Instant::now() >= d)
    }

    /// Resolves when the deadline (once set) passes; never if it is not set and cannot be.
    async fn at_deadline(deadline: &mut watch::Receiver<Option<Instant>>) {
        loop {
            let d = *deadline.borrow_and_update();
            if let Some(d) = d {
                tokio::time::sleep_until(d).await;
                return;
            }
            if deadline.changed().await.is_err() {
                // The dispatcher is gone without a deadline (it always sets one): wait on.
                std::future::pending::<()>().await;
            }
        }
    }

    fn headers_for(&self, n: &Notification, body: &[u8]) -> Vec<(HeaderName, HeaderValue)> {
        let mut headers = self.headers.clone();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut push = |name: &'static str, value: String| {
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.push((HeaderName::from_static(name), v));
            }
        };
        push(DELIVERY_HEADER, n.id.clone());
        push(EVENT_HEADER, n.event.name().to_string());
        if let Some(secret) = &self.secret {
            push(TIMESTAMP_HEADER, now.to_string());
            push(SIGNATURE_HEADER, signature(&secret.0, now, body));
        }
        headers
    }

    /// The wait after failed attempt `attempt` (from 1): `backoff` doubled per attempt, at
    /// most [`MAX_BACKOFF`], less a random part of up to half.
    fn backoff_after(&self, attempt: u32) -> Duration {
        let full = self
            .backoff
            .saturating_mul(1u32 << (attempt - 1).min(20))
            .min(MAX_BACKOFF.max(self.backoff));
        let half = full / 2;
        let nanos = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX);
        let jitter = if nanos == 0 {
            0
        } else {
            notification::random_u64() % (nanos + 1)
        };
        full - Duration::from_nanos(jitter)
    }

    async fn deliver(&mut self, n: &Notification) {
        let body = Bytes::from(match self.format {
            Format::Json => n.json_body(),
            Format::Slack => n.slack_body(),
        });
        let mut last = String::new();
        let mut attempts = 0;
        for attempt in 1..=self.max_attempts {
            let mut timeout = self.timeout;
            if let Some(d) = self.deadline() {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    last = format!("{last} (closed before attempt {attempt})");
                    break;
                }
                timeout = timeout.min(left);
            }
            if attempt > 1 {
                self.stats.retried.fetch_add(1, Ordering::Relaxed);
            }
            attempts = attempt;
            let headers = self.headers_for(n, &body);
            let send = send::post(
                &self.target,
                self.tls.as_ref(),
                &headers,
                body.clone(),
                timeout,
            );
            let mut deadline = self.deadline.clone();
            let outcome = tokio::select! {
                o = send => o,
                () = Self::at_deadline(&mut deadline) => Outcome::Refused("cut: the dispatcher closed".to_string()),
            };
            match outcome {
                Outcome::Delivered => {
                    self.stats.delivered.fetch_add(1, Ordering::Relaxed);
                    self.stats.warned_full.store(false, Ordering::Relaxed);
                    tracing::debug!(url = %self.url, event = %n.event, delivery = %n.id, attempt, "webhook delivered");
                    return;
                }
                Outcome::Refused(why) => {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        url = %self.url, event = %n.event, delivery = %n.id, attempt,
                        "webhook not delivered, not retried: {why}"
                    );
                    return;
                }
                Outcome::Retry { why, after } => {
                    last = why;
                    if attempt == self.max_attempts {
                        break;
                    }
                    let wait = after.unwrap_or_else(|| self.backoff_after(attempt));
                    tracing::debug!(url = %self.url, delivery = %n.id, attempt, "webhook attempt failed ({last}); next in {wait:?}");
                    let until = Instant::now() + wait;
                    if self.deadline().is_some_and(|d| until > d) {
                        last = format!("{last} (closed before the next attempt)");
                        break;
                    }
                    let mut deadline = self.deadline.clone();
                    let slept = tokio::select! {
                        () = tokio::time::sleep_until(until) => true,
                        () = Self::at_deadline(&mut deadline) => false,
                    };
                    if !slept || self.deadline().is_some_and(|d| until > d) {
                        last = format!("{last} (closed before the next attempt)");
                        break;
                    }
                }
            }
        }
        self.stats.failed.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            url = %self.url, event = %n.event, delivery = %n.id, attempts,
            "webhook given up after {attempts} attempt(s): {last}"
        );
    }
}
