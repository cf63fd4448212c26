//! The two live streams: the shared event feed (ONE `WatchEvents` stream per console,
//! fanned out to every open page through a broadcast channel, reconnected with backoff) and
//! a task's live output (`TailOutput`, one per open task page).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use axum::response::sse::Event;
use futures_util::Stream;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;

use crate::grpc::{self, Stamp};
use crate::web::App;

/// The first wait before reconnecting a broken feed; it doubles up to [`MAX_BACKOFF`].
pub const MIN_BACKOFF: Duration = Duration::from_millis(500);
/// The longest wait between two reconnects.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// One event as the page's script reads it (no fencing token: a page has no use for it).
pub fn event_json(e: &pb::Event) -> String {
    serde_json::json!({
        "seq": e.seq,
        "kind": e.kind,
        "task": e.task,
        "agent": e.agent,
        "detail": e.detail,
    })
    .to_string()
}

/// Keeps the shared `WatchEvents` stream open for as long as the console runs. With
/// sign-in, it watches with the newest signed-in operator's token (and waits for a sign-in
/// when there is none); without, it sends no token.
pub(crate) async fn run(app: Arc<App>) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let token = if app.auth.is_some() {
            let newest = app.sessions().newest_token(Instant::now());
            match newest {
                Some(t) => Some(t),
                None => {
                    app.feed_down
                        .send_replace(Some("waiting for an operator to sign in".into()));
                    app.signed_in.notified().await;
                    continue;
                }
            }
        } else {
            None
        };
        match watch_once(&app, token.as_deref()).await {
            Ok(()) => backoff = MIN_BACKOFF,
            Err(e) => {
                tracing::warn!(error = %e, "console: event feed broke; reconnecting");
                app.feed_down.send_replace(Some(e));
            }
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One `WatchEvents` stream, until it ends or fails.
async fn watch_once(app: &App, token: Option<&str>) -> Result<(), String> {
    let stamp = Stamp::new(token, None)?;
    let mut stream = grpc::events(&app.channel, stamp)
        .watch_events(pb::WatchEventsRequest {})
        .await
        .map_err(|s| grpc::http_status(&s).1)?
        .into_inner();
    app.feed_down.send_replace(None);
    // Pages may have missed events while the feed was down: they refresh once.
    app.changed();
    let _ = app.events.send(r#"{"kind":"resync"}"#.to_string());
    loop {
        match stream.message().await {
            Ok(Some(e)) => {
                app.changed();
                // No receivers is fine: nobody has a page open.
                let _ = app.events.send(event_json(&e));
            }
            Ok(None) => return Err("the coordinator ended the stream".into()),
            Err(s) => return Err(grpc::http_status(&s).1),
        }
    }
}

/// What an `alive` event says: the feed is `up`, or `down` and why.
pub fn alive_json(feed_down: Option<&str>) -> String {
    match feed_down {
        None => serde_json::json!({ "feed": "up" }),
        Some(why) => serde_json::json!({ "feed": "down", "why": why }),
    }
    .to_string()
}

/// One page's `/events`: each feed event as a `change` event, and at once then every
/// [`ALIVE_EVERY`](crate::render::ALIVE_EVERY) an `alive` event with the feed's state (a page
/// takes "alive, feed up, no change" as "what I show is still current"); a page that reads
/// too slowly for the broadcast gets one `reload` event and its stream ends (it never queues
/// more than the broadcast's buffer). `after`: the feed's count of changes when the page's
/// data was fetched; any other count now means it missed one, and it is told at once (a
/// `change` of kind `resync`). Ends at shutdown.
pub(crate) fn subscribe(
    app: &App,
    after: Option<u64>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    // The first at once: the page learns the feed's state as its stream opens.
    let mut alive = tokio::time::interval(crate::render::ALIVE_EVERY);
    alive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Subscribed before the count is read: a change after it comes through `rx`.
    let rx = app.events.subscribe();
    let missed = after.is_some_and(|n| n != app.changes.load(std::sync::atomic::Ordering::Acquire));
    let page = Page {
        rx,
        missed,
        stop: app.stop.clone(),
        feed_down: app.feed_down.subscribe(),
        alive,
        done: false,
    };
    futures_util::stream::unfold(page, |mut p| async move {
        if p.done || *p.stop.borrow() {
            return None;
        }
        if std::mem::take(&mut p.missed) {
            let ev = Event::default()
                .event("change")
                .data(r#"{"kind":"resync"}"#);
            return Some((Ok(ev), p));
        }
        tokio::select! {
            // Events first: an `alive` must never overtake a change it would vouch past.
            biased;
            r = p.rx.recv() => match r {
                Ok(json) => {
                    let ev = if json.contains(r#""kind":"lagged""#) {
                        Event::default().event("reload").data("lagged")
                    } else {
                        Event::default().event("change").data(json)
                    };
                    Some((Ok(ev), p))
                }
                Err(RecvError::Lagged(n)) => {
                    p.done = true;
                    Some((Ok(Event::default().event("reload").data(format!("lagged {n}"))), p))
                }
                Err(RecvError::Closed) => None,
            },
            _ = p.stop.changed() => None,
            _ = p.alive.tick() => {
                let json = alive_json(p.feed_down.borrow().as_deref());
                Some((Ok(Event::default().event("alive").data(json)), p))
            }
        }
    })
}

/// One page's stream state.
struct Page {
    rx: tokio::sync::broadcast::Receiver<String>,
    /// A change came between the page's fetch and this subscription.
    missed: bool,
    stop: watch::Receiver<bool>,
    feed_down: watch::Receiver<Option<String>>,
    alive: tokio::time::Interval,
    done: bool,
}

/// Turns a run's output bytes into text without splitting a UTF-8 character across two
/// chunks: an incomplete character at a chunk's end waits for the next; invalid bytes
/// become U+FFFD.
#[derive(Debug, Default)]
pub struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    /// The text of `bytes` (after what was held back), holding back an incomplete
    /// character at the end.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (good, bad) = rest.split_at(e.valid_up_to());
                    out.push_str(&String::from_utf8_lossy(good));
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &bad[n..];
                        }
                        None => {
                            rest = bad;
                            break;
                        }
                    }
                }
            }
        }
        self.pending = rest.to_vec();
        out
    }

    /// What is held back, when the output ends.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

/// One output event as the page's script reads it.
pub fn output_json(e: &pb::OutputEvent, text: &str) -> String {
    serde_json::json!({
        "text": text,
        "offset": e.offset,
        "skipped": e.skipped,
        "ended": e.ended,
        "end_reason": e.end_reason,
        "worker": e.worker,
        "phase": e.phase,
    })
    .to_string()
}

type Output = tonic::Streaming<pb::OutputEvent>;

/// A task's live output as SSE `output` events (JSON text, gaps as `skipped`), an `ended`
/// event last; an `error` event when the coordinator's stream fails. Ends at shutdown.
pub(crate) fn output(
    stream: Output,
    stop: watch::Receiver<bool>,
) -> impl Stream<Item = Result<Event, Infallible>> + Send + 'static {
    let state = (stream, stop, Utf8Carry::default(), false);
    futures_util::stream::unfold(
        state,
        |(mut stream, mut stop, mut carry, done)| async move {
            if done || *stop.borrow() {
                return None;
            }
            let next = tokio::select! {
                m = stream.message() => m,
                _ = stop.changed() => return None,
            };
            let ev = match next {
                Ok(Some(e)) => {
                    let mut text = carry.push(&e.data);
                    if e.ended {
                        text.push_str(&carry.finish());
                    }
                    let kind = if e.ended { "ended" } else { "output" };
                    let ev = Event::default().event(kind).data(output_json(&e, &text));
                    return Some((Ok(ev), (stream, stop, carry, e.ended)));
                }
                Ok(None) => Event::default()
                    .event("ended")
                    .data(r#"{"text":"","ended":true,"end_reason":"the stream closed"}"#),
                Err(s) => Event::default()
                    .event("error")
                    .data(grpc::http_status(&s).1),
            };
            Some((Ok(ev), (stream, stop, carry, true)))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_split_across_chunks() {
        let mut c = Utf8Carry::default();
        let bytes = "aé€😀b".as_bytes();
        let mut out = String::new();
        for b in bytes {
            out.push_str(&c.push(std::slice::from_ref(b)));
        }
        out.push_str(&c.finish());
        assert_eq!(out, "aé€😀b");
        let mut c = Utf8Carry::default();
        assert_eq!(c.push(b"a\xffb"), "a\u{FFFD}b");
        assert_eq!(c.push(b"\xe2\x82"), "");
        assert_eq!(c.finish(), "\u{FFFD}");
    }

    #[tokio::test]
    async fn a_lagging_page_is_told_to_reload() {
        use futures_util::StreamExt as _;
        let (app, _stop) = app();
        let mut page = std::pin::pin!(subscribe(&app, None));
        for i in 0..crate::web::FEED_BUFFER * 2 {
            let _ = app.events.send(format!("{{\"seq\":{i}}}"));
        }
        let first = page.next().await.expect("an event").expect("infallible");
        assert!(format!("{first:?}").contains("reload"), "{first:?}");
        assert!(page.next().await.is_none(), "the lagging stream ends");
    }

    /// An app, and the sender of its stop (its streams end when it is dropped).
    fn app() -> (App, watch::Sender<bool>) {
        let opts = crate::Options {
            channel: tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy(),
            auth: None,
            trace_url: None,
            project: "p".into(),
            tls: None,
            streams: crate::StreamLimits::default(),
        };
        let (stop_tx, stop) = watch::channel(false);
        let app = App::new(opts, "127.0.0.1:8080".parse().expect("addr"), stop).expect("app");
        (app, stop_tx)
    }

    /// At once, then every [`ALIVE_EVERY`](crate::render::ALIVE_EVERY), a page's stream says
    /// it is alive and whether the feed is up: down (and why) until it opens, up after, down
    /// when it breaks.
    #[tokio::test]
    async fn a_pages_stream_says_alive_with_the_feeds_state() {
        use futures_util::StreamExt as _;
        let (app, _stop) = app();
        let mut page = std::pin::pin!(subscribe(&app, None));
        let next = std::time::Instant::now();
        let first = page.next().await.expect("an event").expect("infallible");
        let first = format!("{first:?}");
        assert!(first.contains("alive"), "{first}");
        assert!(
            first.contains(r#"\"feed\":\"down\""#) && first.contains(crate::web::FEED_CONNECTING),
            "{first}"
        );
        assert!(next.elapsed() < crate::render::ALIVE_EVERY / 2, "at once");
        app.feed_down.send_replace(None);
        let next = std::time::Instant::now();
        let up = format!(
            "{:?}",
            page.next().await.expect("an event").expect("infallible")
        );
        assert!(up.contains(r#"\"feed\":\"up\""#), "{up}");
        let took = next.elapsed();
        assert!(
            took >= crate::render::ALIVE_EVERY - Duration::from_millis(50),
            "{took:?}"
        );
        // A change goes before an `alive` that would vouch for the page past it.
        app.feed_down
            .send_replace(Some("unknown bearer token".into()));
        let _ = app.events.send("{\"kind\":\"transitioned\"}".into());
        let change = format!(
            "{:?}",
            page.next().await.expect("an event").expect("infallible")
        );
        assert!(change.contains("change"), "{change}");
        let down = format!(
            "{:?}",
            page.next().await.expect("an event").expect("infallible")
        );
        assert!(down.contains("unknown bearer token"), "{down}");
    }

    /// A page whose data was fetched before a change it has not heard of (the feed's count
    /// moved on since its `data-changes`) is told at once to refresh; one that is up to date
    /// is not.
    #[tokio::test]
    async fn a_page_that_missed_a_change_before_subscribing_is_told_at_once() {
        use futures_util::StreamExt as _;
        let (app, _stop) = app();
        app.changed();
        let now = app.changes.load(std::sync::atomic::Ordering::Acquire);
        for (after, says) in [
            (Some(now - 1), "resync"),
            (Some(now), "alive"),
            (None, "alive"),
        ] {
            let mut page = std::pin::pin!(subscribe(&app, after));
            let first = page.next().await.expect("an event").expect("infallible");
            let first = format!("{first:?}");
            assert!(first.contains(says), "{after:?}: {first}");
        }
    }

    #[test]
    fn alive_says_up_or_down_and_why_as_json() {
        assert_eq!(alive_json(None), r#"{"feed":"up"}"#);
        let v: serde_json::Value =
            serde_json::from_str(&alive_json(Some("a \"quoted\" <why>\n"))).expect("json");
        assert_eq!(v["feed"], "down");
        assert_eq!(v["why"], "a \"quoted\" <why>\n");
    }

    #[test]
    fn json_is_escaped() {
        let e = pb::OutputEvent {
            skipped: 5,
            ..Default::default()
        };
        let j = output_json(&e, "</script>\"\n");
        let v: serde_json::Value = serde_json::from_str(&j).expect("json");
        assert_eq!(v["text"], "</script>\"\n");
        assert_eq!(v["skipped"], 5);
        assert!(!j.contains('\n'));
        let ev = pb::Event {
            kind: "transitioned".into(),
            task: "a/b".into(),
            token: 99,
            ..Default::default()
        };
        let j = event_json(&ev);
        assert!(j.contains("\"task\":\"a/b\""));
        assert!(!j.contains("99"));
    }
}
