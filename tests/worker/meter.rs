//! The metering proxy (`automaton_worker::meter`) over real sockets: a model server on
//! `127.0.0.1:0` in a thread, the proxy in front of it, raw HTTP/1.1 clients.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use automaton_worker::meter::{Meter, Usage};

use crate::model_server::{ModelServer, Reply, Seen, openai};

/// A raw request through `base` (`http://127.0.0.1:PORT/run/rN`) + `path`; the status, the
/// head and the body (de-chunked), read to the end.
fn request(
    base: &str,
    method: &str,
    path: &str,
    headers: &[&str],
    body: &str,
) -> (u16, String, String) {
    let rest = base.strip_prefix("http://").unwrap();
    let (addr, prefix) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut req =
        format!("{method} {prefix}{path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8_lossy(&raw).to_string();
    // An interim `100 Continue` (answering `Expect`) precedes the response.
    let raw = raw
        .strip_prefix("HTTP/1.1 100 Continue\r\n\r\n")
        .unwrap_or(&raw);
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    (
        status,
        head.to_string(),
        if chunked {
            dechunk(body)
        } else {
            body.to_string()
        },
    )
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

fn chat(content_len: usize, max_tokens: u64, stream: bool) -> String {
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "0".repeat(content_len)}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_reads_usage_of_json_and_streamed_answers_and_keeps_the_peak() {
    let server = ModelServer::start(openai);
    let meter = Meter::start(&server.url).await.unwrap();
    let run = meter.register();
    let url = run.url().to_string();
    let (status, _, body) = request(
        &url,
        "POST",
        "/v1/chat/completions",
        &["Content-Type: application/json"],
        &chat(1000, 100, false),
    );
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains(r#""total_tokens":1100"#),
        "passed through unchanged: {body}"
    );
    let (status, _, body) = request(
        &url,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat(5000, 1000, true),
    );
    assert_eq!(status, 200);
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    // The proxy asked for the usage chunk; the agent sees it too.
    assert!(body.contains(r#""total_tokens":6000"#), "{body}");
    let (_, _, _) = request(
        &url,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat(3000, 200, true),
    );
    assert_eq!(
        run.usage(),
        Usage {
            requests: 3,
            counted: 3,
            peak: Some(6000)
        }
    );
    let seen = server.seen();
    let streamed: Vec<&Seen> = seen.iter().filter(|s| s.json()["stream"] == true).collect();
    assert_eq!(streamed.len(), 2);
    for s in streamed {
        assert_eq!(
            s.json()["stream_options"]["include_usage"],
            true,
            "{}",
            s.body
        );
        assert_eq!(s.header("content-length"), Some(s.body.len().to_string()));
    }
    // Prefix stripped, the rest of the path and the query kept.
    assert!(
        seen.iter().all(|s| s.path == "/v1/chat/completions"),
        "{seen:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_forwards_method_path_query_headers_and_body_but_not_hop_by_hop_headers() {
    fn echo(_: &Seen) -> Reply {
        Reply::Body(201, "text/plain", "made".into())
    }
    let server = ModelServer::start(echo);
    let meter = Meter::start(&format!("{}/base/", server.url))
        .await
        .unwrap();
    let run = meter.register();
    let (status, head, body) = request(
        run.url(),
        "PUT",
        "/v1/files/x?purpose=a%20b",
        &[
            "Expect: 100-continue",
            "Authorization: Bearer sk-local",
            "X-Custom: 1",
            "Connection: x-private",
            "X-Private: secret",
            "Keep-Alive: timeout=5",
        ],
        "raw body, not json",
    );
    assert_eq!((status, body.as_str()), (201, "made"));
    assert!(head.contains("text/plain"), "{head}");
    let s = &server.seen()[0];
    assert_eq!(s.method, "PUT");
    assert_eq!(s.path, "/base/v1/files/x?purpose=a%20b");
    assert_eq!(s.body, "raw body, not json");
    assert_eq!(
        s.header("authorization").as_deref(),
        Some("Bearer sk-local")
    );
    assert_eq!(s.header("x-custom").as_deref(), Some("1"));
    assert_eq!(
        s.header("x-private"),
        None,
        "named in Connection: hop-by-hop"
    );
    assert_eq!(s.header("keep-alive"), None);
    assert_eq!(s.header("expect"), None, "answered by the proxy");
    let host = server.url.trim_start_matches("http://");
    assert_eq!(s.header("host").as_deref(), Some(host));
    // Not a metered endpoint: nothing counted.
    assert_eq!(run.usage(), Usage::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_streams_sse_through_as_it_arrives_not_when_it_ends() {
    fn slow(_: &Seen) -> Reply {
        let chunk = |i: u32| {
            format!(
                "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{i}\"}}}}],\"usage\":null}}\n\n"
            )
        };
        Reply::Stream(
            "text/event-stream",
            vec![
                chunk(1),
                chunk(2),
                "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2}}\n\n".into(),
                "data: [DONE]\n\n".into(),
            ],
            Duration::from_millis(800),
        )
    }
    let server = ModelServer::start(slow);
    let meter = Meter::start(&server.url).await.unwrap();
    let run = meter.register();
    let url = run.url().to_string();
    let first = tokio::task::spawn_blocking(move || {
        let rest = url.strip_prefix("http://").unwrap();
        let (addr, prefix) = rest.split_at(rest.find('/').unwrap());
        let mut s = TcpStream::connect(addr).unwrap();
        let body = chat(10, 2, true);
        write!(s, "POST {prefix}/v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        let start = Instant::now();
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        let mut first = None;
        while let Ok(n) = s.read(&mut b) {
            if n == 0 {
                break;
            }
            got.extend_from_slice(&b[..n]);
            if first.is_none() && String::from_utf8_lossy(&got).contains("\"content\":\"1\"") {
                first = Some(start.elapsed());
            }
        }
        (first, start.elapsed(), String::from_utf8_lossy(&got).to_string())
    })
    .await
    .unwrap();
    let (first, total, got) = first;
    let first = first.unwrap_or_else(|| panic!("the first chunk never came: {got}"));
    assert!(total >= Duration::from_millis(2300), "{total:?}");
    assert!(
        first < Duration::from_millis(700),
        "the first chunk waited for the rest: {first:?} of {total:?}"
    );
    assert_eq!(run.usage().peak, Some(42));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_answers_502_with_one_line_when_the_model_server_is_down() {
    let gone = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", gone.local_addr().unwrap());
    drop(gone);
    let meter = Meter::start(&url).await.unwrap();
    let run = meter.register();
    let (status, head, body) = request(
        run.url(),
        "POST",
        "/v1/chat/completions",
        &[],
        &chat(10, 1, false),
    );
    assert_eq!(status, 502, "{head}");
    assert_eq!(body.lines().count(), 1, "{body}");
    assert!(
        body.contains(&format!("model server {url} unreachable")),
        "{body}"
    );
    assert_eq!(run.usage().peak, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_passes_an_unreadable_answer_through_and_counts_nothing() {
    fn garbage(_: &Seen) -> Reply {
        Reply::Body(200, "application/json", "{\"usage\": {\"prompt_tok".into())
    }
    let server = ModelServer::start(garbage);
    let meter = Meter::start(&server.url).await.unwrap();
    let run = meter.register();
    let (status, _, body) = request(run.url(), "POST", "/v1/chat/completions", &[], "not json {");
    assert_eq!((status, body.as_str()), (200, "{\"usage\": {\"prompt_tok"));
    assert_eq!(
        server.seen()[0].body,
        "not json {",
        "an unparsable request goes as it came"
    );
    assert_eq!(
        run.usage(),
        Usage {
            requests: 1,
            counted: 0,
            peak: None
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_reads_ollama_native_ndjson_done_line() {
    fn ollama(_: &Seen) -> Reply {
        Reply::Stream(
            "application/x-ndjson",
            vec![
                "{\"model\":\"q\",\"message\":{\"role\":\"assistant\",\"content\":\"o\"},\"done\":false}\n".into(),
                "{\"model\":\"q\",\"message\":{\"role\":\"assistant\",\"content\":\"\"},\"done\":true,\"prompt_eval_count\":3100,\"eval_count\":25}\n".into(),
            ],
            Duration::from_millis(10),
        )
    }
    let server = ModelServer::start(ollama);
    let meter = Meter::start(&server.url).await.unwrap();
    let run = meter.register();
    let (status, _, body) = request(
        run.url(),
        "POST",
        "/api/chat",
        &[],
        r#"{"model":"q","messages":[]}"#,
    );
    assert_eq!(status, 200);
    assert!(body.contains("\"done\":true"), "{body}");
    assert_eq!(run.usage().peak, Some(3125));
    // Ollama's native requests are forwarded as they are.
    assert_eq!(server.seen()[0].body, r#"{"model":"q","messages":[]}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_attributes_concurrent_runs_to_their_own_prefix_and_forgets_ended_ones() {
    let server = ModelServer::start(openai);
    let meter = Meter::start(&server.url).await.unwrap();
    let a = meter.register();
    let b = meter.register();
    assert_ne!(a.url(), b.url());
    let (ua, ub) = (a.url().to_string(), b.url().to_string());
    let ta = std::thread::spawn(move || {
        request(
            &ua,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat(700, 10, true),
        )
    });
    let tb = std::thread::spawn(move || {
        request(
            &ub,
            "POST",
            "/v1/chat/completions",
            &[],
            &chat(90, 10, false),
        )
    });
    assert_eq!(ta.join().unwrap().0, 200);
    assert_eq!(tb.join().unwrap().0, 200);
    assert_eq!(a.usage().peak, Some(710));
    assert_eq!(b.usage().peak, Some(100));
    let ended = a.url().to_string();
    drop(a);
    let (status, _, body) = request(
        &ended,
        "POST",
        "/v1/chat/completions",
        &[],
        &chat(1, 1, false),
    );
    assert_eq!(status, 404);
    assert!(body.contains("has ended"), "{body}");
    let root = format!("http://{}", meter.addr());
    let (status, _, body) = request(&root, "GET", "/v1/models", &[], "");
    assert_eq!(status, 404);
    assert!(body.contains("AUTOMATON_MODEL_URL"), "{body}");
}

#[test]
fn meter_usage_on_without_a_plain_http_model_server_is_refused_in_one_line() {
    let home = tempfile::tempdir().unwrap();
    let worker = |args: &[&str]| -> crate::run::Run {
        std::process::Command::new(env!("CARGO_BIN_EXE_automaton-worker"))
            .args(["--coordinator", "http://127.0.0.1:9", "--agent", "scripted"])
            .args(args)
            .env("HOME", home.path())
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
            .into()
    };
    let r = worker(&["--meter-usage", "on"]);
    r.code(2);
    assert_eq!(
        r.error_line(),
        "automaton-worker: --meter-usage on needs --model-server URL: the model server to meter"
    );
    let r = worker(&["--meter-usage", "on", "--model-server", "https://gpu:8000"]);
    r.code(2);
    assert!(
        r.error_line().contains("https is not supported")
            && r.error_line().contains("--meter-usage off"),
        "{}",
        r.stderr
    );
    let r = worker(&["--meter-usage", "sometimes"]);
    r.code(2);
    assert!(
        r.stderr.contains("[possible values: on, off]"),
        "{}",
        r.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meter_reads_anthropic_messages_for_claude_code_and_leaves_the_request_alone() {
    fn messages(_: &Seen) -> Reply {
        Reply::Stream(
            "text/event-stream",
            vec![
                "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":1200,\"cache_read_input_tokens\":800,\"output_tokens\":1}}}\n\n".into(),
                "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":90}}\n\n".into(),
                "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".into(),
            ],
            Duration::from_millis(10),
        )
    }
    let server = ModelServer::start(messages);
    let meter = Meter::start(&server.url).await.unwrap();
    let run = meter.register();
    let body = r#"{"model":"m","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#;
    let (status, _, got) = request(run.url(), "POST", "/v1/messages", &[], body);
    assert_eq!(status, 200);
    assert!(got.contains("message_stop"), "{got}");
    assert_eq!(run.usage().peak, Some(2090));
    assert_eq!(
        server.seen()[0].body,
        body,
        "no stream_options for the Messages API"
    );
}
