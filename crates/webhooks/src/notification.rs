//! What is sent: a [`Notification`], and its JSON and Slack bodies.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::config::Event;

/// One reason a person is needed, sent to every receiver subscribed to its event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// Unique per notification (32 hex digits), the same in every attempt and every receiver's
    /// copy: a receiver that sees an id twice has seen a retry (`X-Automaton-Delivery`).
    pub id: String,
    pub event: Event,
    /// The task it is about, if one.
    pub task: Option<String>,
    /// The worker it is about, if one.
    pub worker: Option<String>,
    /// One line for a person, e.g. "design of add-auth waits for approval".
    pub summary: String,
    /// More facts, by name (e.g. `phase`, `reason`, `vram_needed`).
    pub detail: BTreeMap<String, String>,
    pub time: SystemTime,
    /// Where a person acts on it (e.g. the console's task page): `http(s)://…`.
    pub link: Option<String>,
}

impl Notification {
    /// A notification of `event` now, with a new id; `summary` is kept to its first line.
    pub fn new(event: Event, summary: impl Into<String>) -> Notification {
        let summary: String = summary.into();
        let summary = summary.lines().next().unwrap_or("").trim().to_string();
        Notification {
            id: new_id(),
            event,
            task: None,
            worker: None,
            summary,
            detail: BTreeMap::new(),
            time: SystemTime::now(),
            link: None,
        }
    }

    pub fn task(mut self, task: impl Into<String>) -> Self {
        self.task = Some(task.into());
        self
    }

    pub fn worker(mut self, worker: impl Into<String>) -> Self {
        self.worker = Some(worker.into());
        self
    }

    pub fn detail(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.detail.insert(name.into(), value.into());
        self
    }

    /// A link that is not `http://` or `https://` is left out (a body never carries a
    /// `javascript:` or similar to click).
    pub fn link(mut self, url: impl Into<String>) -> Self {
        let url = url.into();
        self.link = (url.starts_with("https://") || url.starts_with("http://")).then_some(url);
        self
    }

    /// `time` as RFC 3339 UTC to the second.
    pub fn time_rfc3339(&self) -> String {
        // humantime panics past 9999-12-31: a computed time is clamped, never a panic.
        let max = UNIX_EPOCH + Duration::from_secs(253_402_300_799);
        let t = self.time.clamp(UNIX_EPOCH, max);
        humantime::format_rfc3339_seconds(t).to_string()
    }

    /// The `json` body: every key always present, `null` where there is nothing.
    pub fn json_body(&self) -> Vec<u8> {
        let body = json!({
            "id": self.id,
            "event": self.event.name(),
            "task": self.task,
            "worker": self.worker,
            "summary": self.summary,
            "time": self.time_rfc3339(),
            "detail": self.detail,
            "link": self.link,
        });
        body.to_string().into_bytes()
    }

    /// The `slack` body: `{"text": ...}`, the event, task and worker, the summary, the
    /// details, and the link as `<url|open>`; what came from outside has `&`, `<` and `>`
    /// escaped, so a summary cannot mention `@channel` or make a link of its own.
    pub fn slack_body(&self) -> Vec<u8> {
        let mut text = format!("*{}*", self.event.name());
        if let Some(task) = &self.task {
            text.push_str(&format!(" task `{}`", slack_escape(task)));
        }
        if let Some(worker) = &self.worker {
            text.push_str(&format!(" worker `{}`", slack_escape(worker)));
        }
        text.push_str(": ");
        text.push_str(&slack_escape(&self.summary));
        for (name, value) in &self.detail {
            text.push_str(&format!(
                "\n• {}: {}",
                slack_escape(name),
                slack_escape(value)
            ));
        }
        if let Some(link) = &self.link {
            // In a link `|` would end the URL: percent-encoded, it stays part of it.
            let url = slack_escape(link).replace('|', "%7C");
            text.push_str(&format!("\n<{url}|open>"));
        }
        json!({ "text": text }).to_string().into_bytes()
    }
}

/// Slack's three control characters, as its message formatting asks.
pub fn slack_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// 32 hex digits: a process-wide counter and the clock, mixed under a key random per
/// process (std's `RandomState`): unique in a process, and across processes but by chance.
fn new_id() -> String {
    format!("{:016x}{:016x}", random_u64(), random_u64())
}

/// A random-enough 64 bits (ids and jitter; nothing secret).
pub(crate) fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let mut h = KEYS
        .get_or_init(std::collections::hash_map::RandomState::new)
        .build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.write_u128(nanos);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_body_has_its_documented_shape() {
        let n = Notification::new(Event::AwaitingApproval, "design of a waits\nsecond line")
            .task("a")
            .detail("phase", "design")
            .link("https://console/tasks/a");
        let v: serde_json::Value = serde_json::from_slice(&n.json_body()).expect("json");
        let keys: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(|k| k.as_str())
            .collect();
        let mut want = vec![
            "id", "event", "task", "worker", "summary", "time", "detail", "link",
        ];
        want.sort_unstable();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(keys, want);
        assert_eq!(v["event"], "awaiting_approval");
        assert_eq!(v["task"], "a");
        assert_eq!(v["worker"], serde_json::Value::Null);
        assert_eq!(v["summary"], "design of a waits");
        assert_eq!(v["detail"]["phase"], "design");
        assert_eq!(v["link"], "https://console/tasks/a");
        assert_eq!(v["id"].as_str().map(str::len), Some(32));
        assert!(v["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    }

    #[test]
    fn ids_are_unique_and_links_are_http_only() {
        let ids: std::collections::HashSet<String> = (0..10_000)
            .map(|_| Notification::new(Event::Held, "x").id)
            .collect();
        assert_eq!(ids.len(), 10_000);
        assert_eq!(
            Notification::new(Event::Held, "x")
                .link("javascript:alert(1)")
                .link,
            None
        );
    }

    #[test]
    fn slack_text_escapes_what_came_from_outside() {
        let n = Notification::new(
            Event::HumanIntervention,
            "<!channel> a & b <http://evil|click>",
        )
        .task("t<1>")
        .detail("reason", "x > y")
        .link("https://console.example/tasks/t?a=1&b=2|x");
        let v: serde_json::Value = serde_json::from_slice(&n.slack_body()).expect("json");
        let text = v["text"].as_str().expect("text");
        assert!(
            text.contains("&lt;!channel&gt; a &amp; b &lt;http://evil|click&gt;"),
            "{text}"
        );
        assert!(text.contains("`t&lt;1&gt;`"), "{text}");
        assert!(text.contains("reason: x &gt; y"), "{text}");
        assert!(
            text.ends_with("<https://console.example/tasks/t?a=1&amp;b=2%7Cx|open>"),
            "{text}"
        );
        // The only `<` left is the link's own.
        assert_eq!(text.matches('<').count(), 1, "{text}");
        assert_eq!(v.as_object().map(|o| o.len()), Some(1));
    }
}
