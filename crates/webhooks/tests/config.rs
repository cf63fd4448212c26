//! `[[webhooks]]` as the coordinator's TOML holds it: defaults, and one-line errors.

use std::time::Duration;

use automaton_webhooks::{EVENTS, Error, Event, Format, Webhook, Webhooks};

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[serde(default)]
    webhooks: Vec<Webhook>,
}

fn parse(text: &str) -> Result<Vec<Webhook>, String> {
    toml::from_str::<Config>(text)
        .map(|c| c.webhooks)
        .map_err(|e| e.to_string())
}

#[test]
fn a_webhooks_table_parses_with_its_defaults() {
    let hooks = parse(
        r#"
[[webhooks]]
url = "http://ops.example:8080/automaton"
events = ["awaiting_approval", "human_intervention"]

[[webhooks]]
url = "https://hooks.slack.com/services/T0/B0/XXXX"
events = ["*"]
format = "slack"
timeout = "2s"
max_attempts = 3
backoff = "500ms"
queue = 50
headers = { "X-Route" = "ops" }
"#,
    )
    .expect("parses");
    let a = &hooks[0];
    assert_eq!(a.format, Format::Json);
    assert_eq!(a.timeout, Duration::from_secs(5));
    assert_eq!(a.max_attempts, 5);
    assert_eq!(a.backoff, Duration::from_secs(1));
    assert_eq!(a.queue, 1000);
    assert_eq!(a.secret_file, None);
    assert_eq!(
        a.subscribed(),
        vec![Event::AwaitingApproval, Event::HumanIntervention]
    );
    a.validate().expect("valid");
    let b = &hooks[1];
    assert_eq!(
        (b.format, b.timeout, b.max_attempts, b.backoff, b.queue),
        (
            Format::Slack,
            Duration::from_secs(2),
            3,
            Duration::from_millis(500),
            50
        )
    );
    assert_eq!(b.headers.get("X-Route").map(String::as_str), Some("ops"));
    assert_eq!(b.subscribed().len(), EVENTS.len());
    // The config round-trips through TOML.
    #[derive(serde::Serialize)]
    struct Out<'a> {
        webhooks: &'a [Webhook],
    }
    let text = toml::to_string(&Out { webhooks: &hooks }).expect("serializes");
    assert_eq!(parse(&text).expect("parses again"), hooks);
}

#[test]
fn a_secret_in_the_config_itself_is_refused() {
    let e = parse(
        r#"
[[webhooks]]
url = "http://h/"
events = ["*"]
secret = "inline"
"#,
    )
    .expect_err("secret is not a field");
    assert!(e.contains("unknown field `secret`"), "{e}");
    let e = parse("[[webhooks]]\nurl = \"http://h/\"\nevents = [\"*\"]\ntimeout = \"soon\"\n")
        .expect_err("bad duration");
    assert!(e.contains("'soon' is not a duration"), "{e}");
}

#[test]
fn bad_webhook_config_gets_one_line_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty.secret");
    std::fs::write(&empty, "\n  \n").expect("write");
    let good = Webhook::new("http://127.0.0.1:9/hook", &["held"]);
    good.validate().expect("the base is valid");
    let with = |f: &dyn Fn(&mut Webhook)| {
        let mut h = good.clone();
        f(&mut h);
        h
    };
    let cases: Vec<(Webhook, &str)> = vec![
        (
            with(&|h| h.url = "ftp://h/x".into()),
            "write http://host[:port]/path or https://",
        ),
        (
            with(&|h| h.url = "hooks.example.com/x".into()),
            "write http://host[:port]/path",
        ),
        (
            with(&|h| h.url = "http://u:p@h/x".into()),
            "carries a user or password",
        ),
        (with(&|h| h.url = "http:///x".into()), "http://host"),
        (
            with(&|h| h.events = vec!["approved".into()]),
            "unknown event 'approved': write one of awaiting_approval, human_intervention, held, worker_lost, subtask_too_large, merged, pull_request_opened, delivery_failed, or \"*\" for all",
        ),
        (with(&|h| h.events = vec![]), "events is empty"),
        (
            with(&|h| h.secret_file = Some(dir.path().join("missing.secret"))),
            "missing.secret: No such file",
        ),
        (
            with(&|h| h.secret_file = Some(empty.clone())),
            "is empty: put the secret in it",
        ),
        (
            with(&|h| h.timeout = Duration::ZERO),
            "timeout '0s': write a duration above 0",
        ),
        (
            with(&|h| h.max_attempts = 0),
            "max_attempts 0: write 1 (no retry) to 20",
        ),
        (with(&|h| h.max_attempts = 100), "max_attempts 100"),
        (with(&|h| h.queue = 0), "queue 0: write 1 to"),
        (
            with(&|h| {
                h.headers.insert("Content-Type".into(), "text/plain".into());
            }),
            "is set by every delivery itself",
        ),
        (
            with(&|h| {
                h.headers.insert("X-Automaton-Signature".into(), "x".into());
            }),
            "is set by every delivery itself",
        ),
        (
            with(&|h| {
                h.headers.insert("X-Bad".into(), "a\nb".into());
            }),
            "a character a header cannot carry",
        ),
        (
            with(&|h| {
                h.headers.insert("Bad Name".into(), "x".into());
            }),
            "is not a header name",
        ),
        (
            with(&|h| h.ca_file = Some(dir.path().join("ca.pem"))),
            "ca_file is only for https://",
        ),
        (
            with(&|h| {
                h.url = "https://h/".into();
                h.ca_file = Some(dir.path().join("ca.pem"));
            }),
            "ca.pem: no such file",
        ),
    ];
    for (hook, want) in cases {
        let e = hook.validate().expect_err(want).to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(e.starts_with("[[webhooks]] "), "{e}");
        assert!(e.contains(want), "{e:?} should say {want:?}");
        // A url's path never shows (a Slack webhook's path is its secret).
        assert!(!e.contains("/hook"), "{e}");
    }
}

#[tokio::test]
async fn start_refuses_a_bad_receiver_by_its_place_and_starts_none() {
    let good = Webhook::new("http://127.0.0.1:9/", &["*"]);
    let bad = Webhook::new("http://127.0.0.1:9/secret-path", &["nope"]);
    let e = Webhooks::start(vec![good, bad])
        .expect_err("refused")
        .to_string();
    assert!(
        e.starts_with("[[webhooks]] #2 (http://127.0.0.1:9): unknown event 'nope'"),
        "{e}"
    );
    assert!(!e.contains("secret-path"), "{e}");
    let hooks = Webhooks::start(vec![]).expect("none is fine");
    assert!(hooks.is_empty());
    hooks.notify(automaton_webhooks::Notification::new(Event::Held, "x"));
}

#[test]
fn start_outside_a_runtime_is_an_error_not_a_panic() {
    let e =
        Webhooks::start(vec![Webhook::new("http://127.0.0.1:9/", &["*"])]).expect_err("no runtime");
    assert!(matches!(e, Error::NoRuntime), "{e}");
}

#[tokio::test]
async fn https_without_any_ca_bundle_says_to_set_ca_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_pem = dir.path().join("not.pem");
    std::fs::write(&not_pem, "hello").expect("write");
    let mut h = Webhook::new("https://127.0.0.1:9/", &["*"]);
    h.ca_file = Some(not_pem);
    let e = Webhooks::start(vec![h])
        .expect_err("no CA in it")
        .to_string();
    assert!(
        e.contains("no CA certificate in it: write a PEM file of CA certificates"),
        "{e}"
    );
}
