//! Deliveries to real HTTP receivers on 127.0.0.1 (no mock of hyper): signature, retries and
//! backoff, timeouts of a receiver that hangs, the queue bound, Slack, TLS.

mod receiver;

use std::time::Duration;

use automaton_webhooks::{Counts, Event, Format, Notification, Webhook, Webhooks};
use receiver::Answer;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);

fn hook(url: &str, events: &[&str]) -> Webhook {
    let mut h = Webhook::new(url, events);
    h.timeout = Duration::from_millis(200);
    h.backoff = Duration::from_millis(50);
    h.max_attempts = 3;
    h
}

/// Polls the totals until `done` holds (or panics after [`WAIT`]).
async fn until(hooks: &Webhooks, done: impl Fn(&Counts) -> bool) -> Counts {
    let start = Instant::now();
    loop {
        let c = hooks.totals();
        if done(&c) {
            return c;
        }
        assert!(start.elapsed() < WAIT, "counts never came to it: {c:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn approval(task: &str) -> Notification {
    Notification::new(
        Event::AwaitingApproval,
        format!("design of {task} waits for approval"),
    )
    .task(task)
    .detail("phase", "design")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_is_signed_and_the_receiver_can_verify_it() {
    let mut rx = receiver::start(|_| Answer::Status(204)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("hook.secret");
    std::fs::write(&secret_file, "  s3cret-for-the-test\n").expect("write secret");
    let mut h = hook(&rx.url, &["awaiting_approval"]);
    h.secret_file = Some(secret_file);
    h.headers.insert("X-Route".into(), "ops".into());
    let hooks = Webhooks::start(vec![h]).expect("start");
    let n = approval("add-auth").link("https://console.example/tasks/add-auth");
    let id = n.id.clone();
    hooks.notify(n);

    let got = rx.next(WAIT).await.expect("a delivery");
    assert_eq!(got.path, "/hook");
    assert_eq!(got.header("content-type"), "application/json");
    assert_eq!(got.header("x-automaton-delivery"), id);
    assert_eq!(got.header("x-automaton-event"), "awaiting_approval");
    assert_eq!(got.header("x-route"), "ops");
    // The receiver's recipe (docs/webhooks.md): recompute over "{timestamp}.{body}" with the
    // secret (whitespace around it in the file is not part of it), compare in constant time,
    // refuse an old timestamp.
    let ts: u64 = got
        .header("x-automaton-timestamp")
        .parse()
        .expect("a timestamp");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs();
    assert!(now.abs_diff(ts) < 300, "timestamp {ts}, now {now}");
    let mut signed = format!("{ts}.").into_bytes();
    signed.extend_from_slice(&got.body);
    let want = format!(
        "sha256={}",
        automaton_workflow::hex(&automaton_webhooks::hmac_sha256(
            b"s3cret-for-the-test",
            &signed
        ))
    );
    assert!(automaton_webhooks::constant_time_eq(
        want.as_bytes(),
        got.header("x-automaton-signature").as_bytes()
    ));
    assert!(automaton_webhooks::verify(
        b"s3cret-for-the-test",
        ts,
        &got.body,
        got.header("x-automaton-signature")
    ));
    assert!(!automaton_webhooks::verify(
        b"another secret",
        ts,
        &got.body,
        got.header("x-automaton-signature")
    ));
    let body = got.json();
    assert_eq!(body["id"], id.as_str());
    assert_eq!(body["event"], "awaiting_approval");
    assert_eq!(body["task"], "add-auth");
    assert_eq!(body["link"], "https://console.example/tasks/add-auth");
    assert_eq!(body["detail"]["phase"], "design");
    let c = until(&hooks, |c| c.delivered == 1).await;
    assert_eq!(
        c,
        Counts {
            delivered: 1,
            ..Counts::default()
        }
    );
    let secretless = hooks.counts();
    assert_eq!(secretless[0].url, rx.url.trim_end_matches("/hook"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_without_a_secret_is_not_signed() {
    let mut rx = receiver::start(|_| Answer::Status(200)).await;
    let hooks = Webhooks::start(vec![hook(&rx.url, &["*"])]).expect("start");
    hooks.notify(approval("a"));
    let got = rx.next(WAIT).await.expect("a delivery");
    assert_eq!(got.header("x-automaton-signature"), "");
    assert_eq!(got.header("x-automaton-timestamp"), "");
    assert_eq!(got.header("x-automaton-delivery").len(), 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_answering_500_twice_gets_the_third_attempt_with_backoff() {
    let mut rx = receiver::start(|n| Answer::Status(if n < 2 { 500 } else { 200 })).await;
    let mut h = hook(&rx.url, &["*"]);
    h.backoff = Duration::from_millis(100);
    h.max_attempts = 5;
    let hooks = Webhooks::start(vec![h]).expect("start");
    hooks.notify(approval("a"));
    let first = rx.next(WAIT).await.expect("attempt 1");
    let second = rx.next(WAIT).await.expect("attempt 2");
    let third = rx.next(WAIT).await.expect("attempt 3");
    // The same delivery, three times.
    let id = first.header("x-automaton-delivery").to_string();
    assert_eq!(second.header("x-automaton-delivery"), id);
    assert_eq!(third.header("x-automaton-delivery"), id);
    assert_eq!(first.body, third.body);
    // Backoff: 100ms then 200ms, each less up to half of it (jitter).
    let gap1 = second.at - first.at;
    let gap2 = third.at - second.at;
    assert!(gap1 >= Duration::from_millis(50), "first wait {gap1:?}");
    assert!(gap2 >= Duration::from_millis(100), "second wait {gap2:?}");
    assert!(
        gap1 < Duration::from_secs(3) && gap2 < Duration::from_secs(3),
        "{gap1:?} {gap2:?}"
    );
    let c = until(&hooks, |c| c.delivered == 1).await;
    assert_eq!(
        c,
        Counts {
            delivered: 1,
            retried: 2,
            ..Counts::default()
        }
    );
    assert!(
        rx.nothing_for(Duration::from_millis(300)).await,
        "no fourth attempt"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_with_retry_after_is_retried_that_much_later() {
    let mut rx = receiver::start(|n| {
        if n == 0 {
            Answer::RetryAfter(429, 1)
        } else {
            Answer::Status(200)
        }
    })
    .await;
    let hooks = Webhooks::start(vec![hook(&rx.url, &["*"])]).expect("start");
    hooks.notify(approval("a"));
    let first = rx.next(WAIT).await.expect("attempt 1");
    let second = rx.next(WAIT).await.expect("attempt 2");
    // The receiver's second, not the 50ms backoff.
    assert!(
        second.at - first.at >= Duration::from_millis(900),
        "{:?}",
        second.at - first.at
    );
    until(&hooks, |c| c.delivered == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_hangs_times_out_and_never_slows_notify() {
    let mut rx = receiver::start(|_| Answer::Hang).await;
    let mut h = hook(&rx.url, &["*"]);
    h.max_attempts = 2;
    h.queue = 64;
    let hooks = Webhooks::start(vec![h]).expect("start");
    hooks.notify(approval("first"));
    let first = rx.next(WAIT).await.expect("attempt 1 arrives (and hangs)");

    // While the receiver hangs, notify does not wait for it.
    let n = 50;
    let notes: Vec<Notification> = (0..n).map(|i| approval(&format!("t{i}"))).collect();
    let start = std::time::Instant::now();
    let mut slowest = Duration::ZERO;
    for note in notes {
        let one = std::time::Instant::now();
        hooks.notify(note);
        slowest = slowest.max(one.elapsed());
    }
    let all = start.elapsed();
    // Well under a millisecond each (microseconds in fact): 50 in under 100ms and none near
    // the 200ms timeout, with room for a loaded machine's scheduling.
    assert!(
        all < Duration::from_millis(50),
        "{n} notify calls took {all:?}"
    );
    assert!(
        slowest < Duration::from_millis(20),
        "the slowest notify took {slowest:?}"
    );

    // Each attempt is cut at the timeout (200ms), then retried after the backoff.
    let second = rx
        .next(WAIT)
        .await
        .expect("attempt 2 after the first timed out");
    assert_eq!(
        second.header("x-automaton-delivery"),
        first.header("x-automaton-delivery")
    );
    let gap = second.at - first.at;
    assert!(
        gap >= Duration::from_millis(200),
        "the first attempt ended after {gap:?}"
    );
    assert!(
        gap < Duration::from_secs(3),
        "the first attempt ended after {gap:?}"
    );
    let c = until(&hooks, |c| c.failed >= 1).await;
    assert_eq!(c.delivered, 0);
    assert!(c.retried >= 1, "{c:?}");
    // Closing does not wait for the hung receiver beyond the bound given.
    let start = std::time::Instant::now();
    let counts = hooks.close(Duration::from_millis(100)).await;
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "close took {:?}",
        start.elapsed()
    );
    let c = counts[0].counts;
    assert_eq!(c.delivered, 0);
    assert_eq!(
        c.failed + c.dropped,
        1 + n as u64,
        "every notification accounted for: {c:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_4xx_is_not_retried() {
    let mut rx = receiver::start(|_| Answer::Status(404)).await;
    let hooks = Webhooks::start(vec![hook(&rx.url, &["*"])]).expect("start");
    hooks.notify(approval("a"));
    rx.next(WAIT).await.expect("one attempt");
    let c = until(&hooks, |c| c.failed == 1).await;
    assert_eq!(
        c,
        Counts {
            failed: 1,
            ..Counts::default()
        }
    );
    // Three backoffs' worth of waiting: no second attempt.
    assert!(
        rx.nothing_for(Duration::from_millis(400)).await,
        "a 404 was retried"
    );
    assert_eq!(hooks.totals().retried, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_receiver_is_retried_then_given_up() {
    // A port nothing listens on: bound, then let go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let hooks =
        Webhooks::start(vec![hook(&format!("http://127.0.0.1:{port}/"), &["*"])]).expect("start");
    hooks.notify(approval("a"));
    let c = until(&hooks, |c| c.failed == 1).await;
    assert_eq!(
        c,
        Counts {
            failed: 1,
            retried: 2,
            ..Counts::default()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_not_subscribed_are_not_sent() {
    let mut rx = receiver::start(|_| Answer::Status(200)).await;
    let hooks = Webhooks::start(vec![hook(&rx.url, &["held", "worker_lost"])]).expect("start");
    hooks.notify(approval("a"));
    hooks.notify(Notification::new(Event::SubtaskTooLarge, "b needs 200 GiB").task("b"));
    hooks.notify(Notification::new(Event::WorkerLost, "gpu-3 is gone").worker("gpu-3"));
    // One queue, in order: had the first two been sent, they would have come first.
    let got = rx.next(WAIT).await.expect("the worker_lost delivery");
    assert_eq!(got.json()["event"], "worker_lost");
    assert_eq!(got.json()["worker"], "gpu-3");
    assert_eq!(got.json()["task"], serde_json::Value::Null);
    assert!(rx.nothing_for(Duration::from_millis(200)).await);
    assert_eq!(until(&hooks, |c| c.delivered == 1).await.dropped, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slack_body_escapes_angle_brackets_and_carries_the_link() {
    let mut rx = receiver::start(|_| Answer::Status(200)).await;
    let mut h = hook(&rx.url, &["human_intervention"]);
    h.format = Format::Slack;
    let hooks = Webhooks::start(vec![h]).expect("start");
    hooks.notify(
        Notification::new(
            Event::HumanIntervention,
            "referee: FAIL <!channel> & <https://evil|here>",
        )
        .task("add-auth")
        .link("https://console.example/tasks/add-auth"),
    );
    let got = rx.next(WAIT).await.expect("a delivery");
    assert_eq!(got.header("content-type"), "application/json");
    let body = got.json();
    assert_eq!(body.as_object().map(|o| o.len()), Some(1), "{body}");
    let text = body["text"].as_str().expect("text");
    assert!(
        text.contains("*human_intervention* task `add-auth`"),
        "{text}"
    );
    assert!(
        text.contains("referee: FAIL &lt;!channel&gt; &amp; &lt;https://evil|here&gt;"),
        "{text}"
    );
    assert!(
        text.contains("<https://console.example/tasks/add-auth|open>"),
        "{text}"
    );
    assert!(!text.contains("<!channel>"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_drops_and_counts_without_blocking() {
    let mut rx = receiver::start(|_| Answer::Hang).await;
    let mut h = hook(&rx.url, &["*"]);
    h.queue = 4;
    h.max_attempts = 1;
    // Long enough that the first stays in flight while the test fills the queue.
    h.timeout = Duration::from_secs(5);
    let hooks = Webhooks::start(vec![h]).expect("start");
    hooks.notify(approval("in-flight"));
    rx.next(WAIT)
        .await
        .expect("the first is being sent (and hangs)");
    let start = std::time::Instant::now();
    for i in 0..20 {
        hooks.notify(approval(&format!("t{i}")));
    }
    assert!(
        start.elapsed() < Duration::from_millis(50),
        "20 notify took {:?}",
        start.elapsed()
    );
    // Four fit in the queue (the fifth is the one in flight): sixteen are dropped.
    let counts = hooks.counts();
    assert_eq!(counts[0].counts.dropped, 16, "{counts:?}");
    assert_eq!(counts[0].queued, 4, "{counts:?}");
    let c = hooks.close(Duration::from_millis(50)).await[0].counts;
    assert_eq!(c.delivered, 0);
    assert_eq!(c.failed + c.dropped, 21, "{c:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_lets_queued_deliveries_finish() {
    let mut rx = receiver::start(|_| Answer::Status(200)).await;
    let hooks = Webhooks::start(vec![hook(&rx.url, &["*"])]).expect("start");
    for i in 0..10 {
        hooks.notify(approval(&format!("t{i}")));
    }
    let counts = hooks.close(Duration::from_secs(5)).await;
    assert_eq!(
        counts[0].counts,
        Counts {
            delivered: 10,
            ..Counts::default()
        }
    );
    let mut tasks = Vec::new();
    while let Some(r) = rx.next(Duration::from_millis(50)).await {
        tasks.push(r.json()["task"].as_str().unwrap_or("").to_string());
    }
    let want: Vec<String> = (0..10).map(|i| format!("t{i}")).collect();
    assert_eq!(tasks, want, "in order, each once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subscribed_receiver_gets_its_copy() {
    let mut a = receiver::start(|_| Answer::Status(200)).await;
    let mut b = receiver::start(|_| Answer::Hang).await;
    let mut hb = hook(&b.url, &["*"]);
    hb.max_attempts = 1;
    let hooks = Webhooks::start(vec![hook(&a.url, &["*"]), hb]).expect("start");
    hooks.notify(approval("a"));
    let got_a = a.next(WAIT).await.expect("a's copy");
    let got_b = b.next(WAIT).await.expect("b's copy");
    assert_eq!(
        got_a.header("x-automaton-delivery"),
        got_b.header("x-automaton-delivery")
    );
    // A hung receiver holds up only itself.
    let counts = hooks.counts();
    let c = until(&hooks, |c| c.delivered == 1 && c.failed == 1).await;
    assert_eq!(c.delivered, 1, "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_receiver_gets_the_delivery_over_rustls() {
    let mut rx = receiver::start_tls(|_| Answer::Status(200)).await;
    let mut h = hook(&rx.url, &["*"]);
    h.timeout = Duration::from_secs(2);
    h.ca_file = Some(receiver::fixtures().join("ca.crt"));
    let hooks = Webhooks::start(vec![h]).expect("start");
    hooks.notify(approval("a"));
    let got = rx.next(WAIT).await.expect("a delivery over TLS");
    assert_eq!(got.json()["task"], "a");
    until(&hooks, |c| c.delivered == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_receiver_with_an_untrusted_certificate_gets_nothing() {
    let mut rx = receiver::start_tls(|_| Answer::Status(200)).await;
    let dir = tempfile::tempdir().expect("tempdir");
    // Trusting only the server's own certificate, which is not a CA: the handshake fails.
    let mut h = hook(&rx.url, &["*"]);
    h.max_attempts = 1;
    h.timeout = Duration::from_secs(2);
    let other = dir.path().join("other.pem");
    std::fs::copy(receiver::fixtures().join("server.crt"), &other).expect("copy");
    h.ca_file = Some(other);
    let hooks = Webhooks::start(vec![h]).expect("start");
    hooks.notify(approval("a"));
    until(&hooks, |c| c.failed == 1).await;
    assert!(rx.nothing_for(Duration::from_millis(100)).await);
}
