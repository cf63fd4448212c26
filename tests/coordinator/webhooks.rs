//! Webhooks when a person is needed (issue 23), end to end: a real coordinator and a real
//! worker, a receiver on loopback that checks the signature, and one that never answers.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::{Coord, Env, poll};
use crate::work::{FLEET, git_init, scripted_worker};

/// One delivery as the receiver saw it.
#[derive(Debug, Clone)]
struct Delivery {
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Delivery {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// An HTTP/1.1 receiver on 127.0.0.1:0 that records each POST and answers 200 — or, with
/// `hang`, reads it and never answers.
fn receiver(hang: bool) -> (String, Arc<Mutex<Vec<Delivery>>>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/hook", l.local_addr().expect("addr"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut conn) = conn else { continue };
            let s = s.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(conn.try_clone().expect("clone"));
                let mut headers = Vec::new();
                let mut line = String::new();
                let mut len = 0usize;
                loop {
                    line.clear();
                    if r.read_line(&mut line).unwrap_or(0) == 0 {
                        return;
                    }
                    let l = line.trim_end();
                    if l.is_empty() {
                        break;
                    }
                    if let Some((k, v)) = l.split_once(':') {
                        let (k, v) = (k.trim().to_string(), v.trim().to_string());
                        if k.eq_ignore_ascii_case("content-length") {
                            len = v.parse().unwrap_or(0);
                        }
                        headers.push((k, v));
                    }
                }
                let mut body = vec![0; len];
                if r.read_exact(&mut body).is_err() {
                    return;
                }
                s.lock().expect("seen").push(Delivery { headers, body });
                if hang {
                    std::thread::sleep(Duration::from_secs(120));
                    return;
                }
                let _ = conn.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                );
            });
        }
    });
    (url, seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gate_awaiting_approval_posts_a_signed_webhook_and_a_hanging_receiver_slows_nothing() {
    let (good, seen) = receiver(false);
    let (hung, hung_seen) = receiver(true);
    let secret_dir = tempfile::tempdir().expect("tempdir");
    let secret = secret_dir.path().join("hook.secret");
    std::fs::write(&secret, "hook-secret-0123456789\n").expect("secret");
    let env = Env::with_config(&format!(
        r#"
[[webhooks]]
url = "{good}"
events = ["awaiting_approval", "held"]
secret_file = "{}"

[[webhooks]]
url = "{hung}"
events = ["*"]
timeout = "30s"
"#,
        secret.display()
    ));
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let _w = scripted_worker(&coord, "gpu-a", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    let started = Instant::now();
    let d = poll(
        "the awaiting_approval webhook",
        Duration::from_secs(30),
        || {
            let seen = seen.clone();
            async move {
                let s = seen.lock().expect("seen");
                s.iter()
                    .find(|d| d.header("x-automaton-event") == Some("awaiting_approval"))
                    .cloned()
            }
        },
    )
    .await;
    let body: serde_json::Value = serde_json::from_slice(&d.body).expect("json body");
    assert_eq!(body["event"], "awaiting_approval", "{body}");
    assert_eq!(body["task"], "t", "{body}");
    assert!(
        body["summary"]
            .as_str()
            .is_some_and(|s| s.contains("research:awaiting_approval")),
        "{body}"
    );
    // Signed: the receiver's recipe verifies it, and a changed byte does not.
    let ts: u64 = d
        .header("x-automaton-timestamp")
        .and_then(|t| t.parse().ok())
        .expect("a timestamp");
    let sig = d.header("x-automaton-signature").expect("a signature");
    assert!(automaton_webhooks::verify(
        b"hook-secret-0123456789",
        ts,
        &d.body,
        sig
    ));
    let mut changed = d.body.clone();
    changed[0] ^= 1;
    assert!(!automaton_webhooks::verify(
        b"hook-secret-0123456789",
        ts,
        &changed,
        sig
    ));
    // The hanging receiver got its copy too, and holds it: nothing else waits on it. Its own
    // queue may still be reading the first POST on a busy machine, so wait for it a little.
    poll(
        "a delivery at the hanging receiver",
        Duration::from_secs(10),
        || {
            let hung_seen = hung_seen.clone();
            async move { (!hung_seen.lock().expect("hung").is_empty()).then_some(()) }
        },
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(40));
    // The coordinator answers at once while a receiver hangs.
    let t0 = Instant::now();
    for _ in 0..20 {
        api.get("t").await.expect("get");
    }
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // Only what it subscribed to reached it: no lease or transition chatter.
    env.cli(&["--task", "t", "--approve", "--approver", "ops"])
        .ok();
    tokio::time::sleep(Duration::from_millis(500)).await;
    for d in seen.lock().expect("seen").iter() {
        let e = d.header("x-automaton-event").unwrap_or_default();
        assert!(matches!(e, "awaiting_approval" | "held"), "{d:?}");
    }
}

#[test]
fn bad_webhooks_config_is_refused_in_one_line_before_anything_binds() {
    for (toml, says) in [
        (
            "[[webhooks]]\nurl = \"ftp://x\"\nevents = [\"held\"]\n",
            "[[webhooks]] #1",
        ),
        (
            "[[webhooks]]\nurl = \"http://127.0.0.1:9/h\"\nevents = [\"approved\"]\n",
            "unknown event 'approved'",
        ),
        (
            "[[webhooks]]\nurl = \"http://127.0.0.1:9/h\"\nevents = [\"held\"]\nsecret_file = \"/nonexistent/secret\"\n",
            "secret_file",
        ),
        (
            "[[webhooks]]\nurl = \"http://127.0.0.1:9/h\"\nevents = [\"held\"]\nsecret = \"inline\"\n",
            "secret",
        ),
    ] {
        crate::harness::refused_before_binding(toml, says);
    }
}

/// Issue 30 §7: `--print-config` shows a webhook's URL as the logs do, scheme, host and port
/// only: a Slack-style URL's path is its secret, and a user and password never show either.
#[test]
fn print_config_masks_webhook_urls() {
    let secret = "T00000000/B00000000/XXXXXXXXXXXXsecretXXXXXXXX";
    let toml = format!(
        "[[webhooks]]\nurl = \"https://hooks.slack.example/services/{secret}?token=q1\"\nevents = [\"*\"]\nformat = \"slack\"\n\n[[webhooks]]\nurl = \"http://127.0.0.1:9/hook/{secret}\"\nevents = [\"held\"]\n"
    );
    let env = Env::with_config(&toml);
    let run = env.run_coordinator(&["--print-config"], &[], Duration::from_secs(20));
    assert_eq!(run.code, 0, "{run:?}");
    assert!(!run.stdout.contains("secret"), "{}", run.stdout);
    assert!(!run.stdout.contains("T00000000"), "{}", run.stdout);
    assert!(!run.stdout.contains("token=q1"), "{}", run.stdout);
    let v: toml::Value = toml::from_str(&run.stdout).expect("--print-config prints TOML");
    let urls: Vec<&str> = v["webhooks"]
        .as_array()
        .expect("webhooks")
        .iter()
        .filter_map(|h| h["url"].as_str())
        .collect();
    assert_eq!(
        urls,
        ["https://hooks.slack.example", "http://127.0.0.1:9"],
        "{}",
        run.stdout
    );
}
