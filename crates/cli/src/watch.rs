//! `automaton watch`: the coordinator's event stream, one line per event (coloured on a
//! terminal) or one JSON object per line (`--json`), reconnecting when the coordinator
//! restarts. Also the link to the coordinator that `watch` and `top` share: a stream needs a
//! channel without the per-call deadline the status commands stamp on every request.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use automaton_proto::v1 as pb;
use automaton_store::Project;
use automaton_workflow::{EventKind, TaskName};
use clap::Args;
use tonic::transport::Channel;

use crate::backend::{self, Failure};

#[derive(Debug, Args)]
pub struct WatchArgs {
    /// Only this task's events; a parent's include its sub-tasks' (`parent/…`).
    #[arg(long, value_name = "NAME")]
    pub task: Option<String>,
    #[command(flatten)]
    pub target: crate::workers::Target,
    /// One JSON object per event and line: seq, at, kind, task, agent, token, detail.
    #[arg(long)]
    pub json: bool,
}

/// Where the coordinator is and how to reach it; shared by `watch` and `top`.
pub(crate) struct Link {
    project: Project,
    flag: Option<String>,
    bearer: Option<tonic::metadata::AsciiMetadataValue>,
}

impl Link {
    /// The project and `AUTOMATON_TOKEN`; the address is looked up at each connection, so a
    /// coordinator restarted on another port (`coordinator.lock`) is found again.
    pub(crate) fn new(project: Option<&Path>, flag: Option<&str>) -> Result<Link, Failure> {
        let cwd = std::env::current_dir()
            .map_err(|e| Failure::Usage(format!("cannot read the current directory: {e}")))?;
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let project = Project::open(project.unwrap_or(&cwd), home.as_deref());
        let bearer = match std::env::var("AUTOMATON_TOKEN") {
            Ok(t) if !t.is_empty() => Some(format!("Bearer {t}").parse().map_err(|_| {
                Failure::Usage("AUTOMATON_TOKEN holds characters a header cannot carry".into())
            })?),
            _ => None,
        };
        Ok(Link {
            project,
            flag: flag.map(str::to_string),
            bearer,
        })
    }

    /// The coordinator's address now: `--coordinator`, `AUTOMATON_COORDINATOR`, or the live
    /// owner of the project. `what` names the command in the error when there is none.
    pub(crate) fn address(&self, what: &str) -> Result<String, Failure> {
        backend::find_coordinator(&self.project, self.flag.as_deref())?.ok_or_else(|| {
            Failure::Usage(format!(
                "{what} needs a running coordinator: start automaton-coordinator, or pass --coordinator URL (or AUTOMATON_COORDINATOR)"
            ))
        })
    }

    /// [`Link::address`], and of several coordinators the one that leads now.
    pub(crate) async fn leader(&self, what: &str) -> Result<String, Failure> {
        backend::leader_of(&self.address(what)?).await
    }

    /// A lazily connecting channel (inside a runtime). HTTP/2 keep-alives notice a coordinator
    /// that stopped answering while a stream is quiet.
    pub(crate) fn channel(address: &str) -> Result<Channel, Failure> {
        Ok(Channel::from_shared(address.to_string())
            .map_err(|_| {
                Failure::Usage(format!(
                    "invalid coordinator address '{address}': write e.g. http://127.0.0.1:7070"
                ))
            })?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .connect_lazy())
    }

    /// A request with the bearer token and, for unary calls, a deadline (none for streams).
    pub(crate) fn request<T>(&self, msg: T, deadline: Option<Duration>) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(v) = &self.bearer {
            req.metadata_mut().insert("authorization", v.clone());
        }
        if let Some(d) = deadline {
            req.set_timeout(d);
        }
        req
    }

    /// Opens the event stream at the coordinator's current address.
    pub(crate) async fn events(
        &self,
        what: &str,
    ) -> Result<(String, tonic::Streaming<pb::Event>), Failure> {
        let address = self.leader(what).await?;
        let mut client = pb::events_client::EventsClient::new(Link::channel(&address)?);
        let stream = client
            .watch_events(self.request(pb::WatchEventsRequest {}, None))
            .await
            .map_err(|s| match s.code() {
                // Retrying cannot cure these: the caller is told, not made to wait.
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                    Failure::Refused(s.message().to_string())
                }
                _ => Failure::from(s),
            })?
            .into_inner();
        Ok((address, stream))
    }
}

/// A failure as one line, for a status line or a reconnection notice.
pub(crate) fn describe(f: &Failure) -> String {
    match f {
        Failure::Store(e) => e.to_string(),
        Failure::Usage(m) | Failure::Refused(m) => m.clone(),
        Failure::Remote { message, .. } => message.clone(),
    }
}

/// Waits before reconnection attempt `attempt` (0, 1, …): 100 ms doubling to 5 s, with up to
/// a quarter of jitter so that many watchers do not return in step.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let base = Duration::from_millis(100).saturating_mul(1u32 << attempt.min(6));
    let base = base.min(Duration::from_secs(5));
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    base + base / 4 * (nanos % 1000) / 1000
}

/// One event as `watch` prints it. The only place that reads a `pb::Event`'s fields; the
/// JSON field names are stable (docs/running.md, "Live views").
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct EventLine {
    pub seq: u64,
    /// RFC 3339, UTC, milliseconds.
    pub at: String,
    pub kind: String,
    pub task: String,
    pub agent: String,
    pub token: u64,
    pub detail: String,
    /// `kind` in the vocabulary (`None`: a word this CLI does not know, from a newer
    /// coordinator: shown as it came, uncoloured).
    #[serde(skip)]
    pub typed: Option<EventKind>,
}

/// An event's time, RFC 3339 with milliseconds as `--json` documents it; empty when unset.
/// Whatever a server sends is clamped to 1970..=9999 first (`automaton_store::clamp_time`).
fn event_time(t: Option<automaton_proto::prost_types::Timestamp>) -> String {
    use std::time::{SystemTime, UNIX_EPOCH};
    t.map(|t| {
        // Outside what this machine's clock holds: a time past either end, which the clamp
        // then moves into range.
        let far = std::time::Duration::from_secs(1 << 40);
        let at = SystemTime::try_from(t).unwrap_or(if t.seconds < 0 {
            UNIX_EPOCH
        } else {
            UNIX_EPOCH.checked_add(far).unwrap_or(UNIX_EPOCH)
        });
        automaton_store::format_time_millis(at)
    })
    .unwrap_or_default()
}

pub(crate) fn event_line(e: pb::Event) -> EventLine {
    EventLine {
        typed: automaton_proto::vocab::event_kind(&e),
        seq: e.seq,
        at: event_time(e.at),
        kind: e.kind,
        task: e.task,
        agent: e.agent,
        token: e.token,
        detail: e.detail,
    }
}

/// Whether `--task T` shows an event: T's own, its sub-tasks' when T is a parent, and the
/// notice that events were dropped (some may have been T's).
fn shown(filter: Option<&TaskName>, e: &EventLine) -> bool {
    match filter {
        None => true,
        Some(_) if e.typed == Some(EventKind::Lagged) => true,
        Some(t) => {
            let t = t.to_string();
            e.task == t
                || e.task
                    .strip_prefix(t.as_str())
                    .is_some_and(|rest| rest.starts_with('/'))
        }
    }
}

/// Control characters (a newline, an escape sequence) written as escapes: one event stays one
/// line, and nothing a field holds can drive the reader's terminal.
fn printable(s: &str) -> String {
    if !s.contains(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Colours only for a terminal, and never when NO_COLOR is set to anything (no-color.org).
fn colour(stdout_is_terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    stdout_is_terminal && no_color.is_none_or(|v| v.is_empty())
}

/// The ANSI colour of a kind: green for progress, cyan for leases and dispatch, yellow for
/// what ended or stalls, red for refusals, lost workers and what needs a person.
fn kind_colour(kind: Option<EventKind>) -> Option<&'static str> {
    use EventKind::*;
    Some(match kind? {
        TaskCreated | SubtaskCreated | Transitioned | Approved | RunStarted | ArtifactUploaded
        | CodeCommitted | FollowUpCreated | ParentEnded | WorkerJoined | WorkerResumed
        | WorkerUndrained | TaskResumed | Merged | PullRequestOpened | SubtaskMerged => "32",
        LeaseGranted | LeaseRenewed | LeaseReleased | Dispatched | Assigned | SizingLearned => "36",
        LeaseExpired | RunStopped | WorkerLeft | WorkerDrained | TaskHeld | SubtaskOrphaned
        | Lagged | OfferDeclined | OfferUnanswered | ReviewStale | Rework => "33",
        LeaseRefused | WorkerLost | SubtaskTooLarge | HumanIntervention | DeliveryFailed => "31",
        _ => return None,
    })
}

/// `08:12:03.123Z  transitioned    t1                       agent-a       #5   new → research`
fn text(e: &EventLine, colour: bool) -> String {
    let or_dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            printable(s)
        }
    };
    // The time of day: an event stream is read live; `--json` carries the whole timestamp.
    let time = e.at.split_once('T').map_or(e.at.as_str(), |(_, t)| t);
    let kind = format!("{:<17}", printable(&e.kind));
    let kind = match kind_colour(e.typed) {
        Some(c) if colour => format!("\x1b[{c}m{kind}\x1b[0m"),
        _ => kind,
    };
    let token = if e.token == 0 {
        "-".to_string()
    } else {
        format!("#{}", e.token)
    };
    let detail = printable(&e.detail);
    let line = format!(
        "{:<13} {kind} {:<24} {:<14} {token:<5} {detail}",
        or_dash(time),
        or_dash(&e.task),
        or_dash(&e.agent),
    );
    line.trim_end().to_string()
}

fn json(e: &EventLine) -> String {
    serde_json::to_string(e)
        .unwrap_or_else(|err| format!("{{\"error\": \"cannot encode JSON: {err}\"}}"))
}

/// How the watch ended, when it ended well.
enum End {
    /// Ctrl-C, or stdout closed (`| head -3`).
    Stopped,
}

async fn watch(args: &WatchArgs, filter: Option<&TaskName>) -> Result<End, Failure> {
    const WHAT: &str = "automaton watch";
    let link = Link::new(
        args.target.project.as_deref(),
        args.target.coordinator.as_deref(),
    )?;
    let colour = colour(
        std::io::stdout().is_terminal(),
        std::env::var_os("NO_COLOR"),
    );
    let (mut address, mut stream) = link.events(WHAT).await?;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let next = tokio::select! {
            m = stream.message() => m,
            _ = &mut interrupted => return Ok(End::Stopped),
        };
        let why = match next {
            Ok(Some(e)) => {
                let e = event_line(e);
                if !shown(filter, &e) {
                    continue;
                }
                let line = if args.json {
                    json(&e)
                } else {
                    text(&e, colour)
                };
                let mut out = std::io::stdout().lock();
                // A closed stdout is the reader saying it has seen enough.
                if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                    return Ok(End::Stopped);
                }
                continue;
            }
            Ok(None) => "the stream ended".to_string(),
            Err(s) => s.message().to_string(),
        };
        // The same words as `top`'s header: `reconnecting (why)`, then `connected`.
        eprintln!("{}", lost_line(&address, &why));
        let lost = std::time::Instant::now();
        let mut attempt = 0;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff(attempt)) => {}
                _ = &mut interrupted => return Ok(End::Stopped),
            }
            attempt = attempt.saturating_add(1);
            // Connecting is bounded by the channel's connect timeout.
            let opened = tokio::select! {
                o = link.events(WHAT) => o,
                _ = &mut interrupted => return Ok(End::Stopped),
            };
            match opened {
                Ok((a, s)) => {
                    (address, stream) = (a, s);
                    eprintln!("{}", back_line(&address, lost.elapsed()));
                    break;
                }
                // The restarted coordinator does not accept our token.
                Err(f @ Failure::Refused(_)) => return Err(f),
                // Not back yet.
                Err(_) => {}
            }
        }
    }
}

/// What `watch` says on stderr when the stream breaks.
fn lost_line(address: &str, why: &str) -> String {
    format!("automaton watch: lost the coordinator at {address}; reconnecting ({why})")
}

/// What `watch` says on stderr when the stream is open again, `gap` after it broke.
fn back_line(address: &str, gap: Duration) -> String {
    format!(
        "automaton watch: connected to {address} again after {:.1}s; events missed while disconnected are not shown",
        gap.as_secs_f64()
    )
}

/// Runs `automaton watch`; returns the exit code (0 on Ctrl-C or a closed stdout).
pub fn run(args: &WatchArgs) -> i32 {
    let filter = match args.task.as_deref().map(str::parse::<TaskName>).transpose() {
        Ok(f) => f,
        Err(e) => return crate::report_failure(Failure::Store(e.into()), args.json),
    };
    match block_on(watch(args, filter.as_ref())) {
        Ok(End::Stopped) => 0,
        Err(f) => crate::report_failure(f, args.json),
    }
}

/// Runs a streaming command's future on a runtime of its own (`watch`, `logs`).
pub(crate) fn block_on<T>(
    f: impl std::future::Future<Output = Result<T, Failure>>,
) -> Result<T, Failure> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::Usage(format!("cannot start the async runtime: {e}")))?
        .block_on(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, task: &str) -> EventLine {
        event_line(pb::Event {
            seq: 7,
            at: Some(automaton_proto::prost_types::Timestamp {
                seconds: 1_796_112_723,
                nanos: 123_000_000,
            }),
            kind: kind.into(),
            task: task.into(),
            agent: "agent-a".into(),
            token: 5,
            detail: "new → research".into(),
            ..Default::default()
        })
    }

    #[test]
    fn task_filter_shows_the_task_and_its_subtasks_only() {
        let on = |task: &str| event("transitioned", task);
        let p: TaskName = "p".parse().expect("name");
        assert!(shown(Some(&p), &on("p")));
        assert!(shown(Some(&p), &on("p/s1")));
        assert!(!shown(Some(&p), &on("p-x")));
        assert!(!shown(Some(&p), &on("px/s1")));
        assert!(!shown(Some(&p), &on("")));
        assert!(shown(None, &on("")));
        let sub: TaskName = "p/s1".parse().expect("name");
        assert!(!shown(Some(&sub), &on("p")));
        assert!(shown(Some(&sub), &on("p/s1")));
        // Dropped events may have been p's: the notice passes every filter.
        assert!(shown(Some(&p), &event("lagged", "")));
    }

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(!colour(false, None));
        assert!(!colour(true, Some("1".into())));
        // An empty NO_COLOR does not count (no-color.org).
        assert!(colour(true, Some("".into())));
    }

    #[test]
    fn text_line_has_time_kind_task_agent_token_detail_and_colours_the_kind() {
        let e = event("transitioned", "t1");
        let plain = text(&e, false);
        assert_eq!(
            plain.split_whitespace().collect::<Vec<_>>(),
            [
                "08:12:03.123Z",
                "transitioned",
                "t1",
                "agent-a",
                "#5",
                "new",
                "→",
                "research"
            ]
        );
        assert!(!plain.contains('\x1b'));
        assert!(text(&e, true).contains("\x1b[32mtransitioned"));
    }

    #[test]
    fn control_characters_are_escaped_so_a_line_stays_one_line_and_inert() {
        let mut e = event("lease_refused", "t1");
        e.detail = "one\ntwo \x1b[2J".into();
        e.agent = "a\x1b]0;x\x07".into();
        let line = text(&e, false);
        assert_eq!(line.lines().count(), 1, "{line}");
        assert!(!line.contains(char::is_control), "{line:?}");
        assert!(line.ends_with(r"one\ntwo \u{1b}[2J"), "{line}");
    }

    #[test]
    fn json_line_has_the_documented_fields() {
        let v: serde_json::Value =
            serde_json::from_str(&json(&event("lease_granted", "t1"))).expect("json");
        let mut keys: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["agent", "at", "detail", "kind", "seq", "task", "token"]
        );
        assert_eq!(v["at"], "2026-12-01T08:12:03.123Z");
    }

    /// The outage in `top`'s words (`reconnecting (why)`, `connected`), and the gap said plainly.
    #[test]
    fn lost_and_back_lines_say_reconnecting_then_connected_and_that_missed_events_are_not_shown() {
        assert_eq!(
            lost_line("http://127.0.0.1:7070", "transport error"),
            "automaton watch: lost the coordinator at http://127.0.0.1:7070; reconnecting (transport error)"
        );
        assert_eq!(
            back_line("http://127.0.0.1:7071", Duration::from_millis(4_250)),
            "automaton watch: connected to http://127.0.0.1:7071 again after 4.2s; events missed while disconnected are not shown"
        );
    }

    #[test]
    fn backoff_grows_to_five_seconds_with_jitter() {
        assert!(backoff(0) >= Duration::from_millis(100));
        assert!(backoff(0) <= Duration::from_millis(125));
        assert!(backoff(30) >= Duration::from_secs(5));
        assert!(backoff(30) <= Duration::from_millis(6250));
    }

    #[test]
    fn an_event_time_out_of_range_is_clamped_not_a_panic() {
        use automaton_proto::prost_types::Timestamp;
        let at = |seconds, nanos| event_time(Some(Timestamp { seconds, nanos }));
        assert_eq!(at(-1, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(i64::MIN, 0), "1970-01-01T00:00:00.000Z");
        assert_eq!(at(i64::MAX, 999_999_999), "9999-12-31T23:59:59.999Z");
        assert_eq!(at(253_402_300_800, 0), "9999-12-31T23:59:59.999Z");
        assert_eq!(at(0, -5), "1970-01-01T00:00:00.000Z");
        assert_eq!(event_time(None), "");
    }
}
