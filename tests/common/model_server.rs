//! A small OpenAI-compatible model server on `127.0.0.1:0` (one thread per connection), for
//! the tests of the worker's metering proxy; shared by `tests/worker` and `tests/coordinator`,
//! each of which includes this file. It answers like vLLM: a non-streamed chat completion
//! carries `usage`; a streamed one ends with a usage chunk (empty `choices`) only when the
//! request asked for it with `stream_options.include_usage`.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    /// The header lines, as sent.
    pub head: String,
    pub body: String,
}

impl Seen {
    /// The value of header `name` (case-insensitive), if sent.
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

pub enum Reply {
    /// Status, content type, body; with Content-Length.
    Body(u16, &'static str, String),
    /// Chunked, one chunk per part, `pause` before each part after the first.
    Stream(&'static str, Vec<String>, Duration),
}

pub struct ModelServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl ModelServer {
    pub fn start(route: fn(&Seen) -> Reply) -> ModelServer {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind the model server");
        let url = format!("http://{}", l.local_addr().expect("its address"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(s) = s else { continue };
                let log = log.clone();
                std::thread::spawn(move || answer(s, route, log));
            }
        });
        ModelServer { url, seen }
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn answer(mut s: TcpStream, route: fn(&Seen) -> Reply, log: Arc<Mutex<Vec<Seen>>>) {
    let Some(req) = read_request(&mut s) else {
        return;
    };
    log.lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(req.clone());
    match route(&req) {
        Reply::Body(status, ctype, b) => {
            let _ = write!(
                s,
                "HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
                b.len()
            );
        }
        Reply::Stream(ctype, parts, pause) => {
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: {ctype}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
            );
            for (i, p) in parts.iter().enumerate() {
                if i > 0 {
                    std::thread::sleep(pause);
                }
                let _ = write!(s, "{:x}\r\n{p}\r\n", p.len());
                let _ = s.flush();
            }
            let _ = write!(s, "0\r\n\r\n");
        }
    }
}

fn read_request(s: &mut TcpStream) -> Option<Seen> {
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut buf = Vec::new();
    let mut b = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match s.read(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let (first, headers) = head.split_once("\r\n").unwrap_or((&head, ""));
    let seen = Seen {
        method: first.split_whitespace().next().unwrap_or("").to_string(),
        path: first.split_whitespace().nth(1).unwrap_or("").to_string(),
        head: headers.replace("\r\n", "\n"),
        body: String::new(),
    };
    let len = seen
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    while buf.len() < head_end + 4 + len {
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
    Some(Seen {
        body: String::from_utf8_lossy(&buf[head_end + 4..]).to_string(),
        ..seen
    })
}

/// The usage this server reports for a request: one prompt token per character of the
/// messages' contents (or of `prompt`), `max_tokens` (default 16) completion tokens.
pub fn usage_for(req: &serde_json::Value) -> (u64, u64) {
    let prompt = match req.get("messages").and_then(|m| m.as_array()) {
        Some(msgs) => msgs
            .iter()
            .filter_map(|m| m.get("content").and_then(|c| c.as_str()))
            .map(|c| c.chars().count() as u64)
            .sum(),
        None => req
            .get("prompt")
            .and_then(|p| p.as_str())
            .map_or(0, |p| p.chars().count() as u64),
    };
    let completion = req.get("max_tokens").and_then(|m| m.as_u64()).unwrap_or(16);
    (prompt, completion)
}

/// `/v1/chat/completions` as vLLM answers it (see the file's doc); 404 for anything else,
/// which is also what the worker's probe gets for `/v1/models`, `/props` and `/api/ps`.
pub fn openai(req: &Seen) -> Reply {
    if req.method != "POST" || !req.path.ends_with("/v1/chat/completions") {
        return Reply::Body(404, "application/json", r#"{"error":"not found"}"#.into());
    }
    let v = req.json();
    let (p, c) = usage_for(&v);
    let usage = format!(
        r#"{{"prompt_tokens":{p},"completion_tokens":{c},"total_tokens":{}}}"#,
        p + c
    );
    if v.get("stream").and_then(|s| s.as_bool()) != Some(true) {
        return Reply::Body(
            200,
            "application/json",
            format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion","choices":[{{"index":0,"message":{{"role":"assistant","content":"ok"}},"finish_reason":"stop"}}],"usage":{usage}}}"#
            ),
        );
    }
    let include = v
        .pointer("/stream_options/include_usage")
        .and_then(|b| b.as_bool())
        == Some(true);
    let null = if include { r#","usage":null"# } else { "" };
    let mut parts = vec![
        format!(
            "data: {{\"id\":\"chatcmpl-2\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"o\"}}}}]{null}}}\n\n"
        ),
        format!(
            "data: {{\"id\":\"chatcmpl-2\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"k\"}},\"finish_reason\":\"stop\"}}]{null}}}\n\n"
        ),
    ];
    if include {
        parts.push(format!(
            "data: {{\"id\":\"chatcmpl-2\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{usage}}}\n\n"
        ));
    }
    parts.push("data: [DONE]\n\n".into());
    Reply::Stream("text/event-stream", parts, Duration::from_millis(20))
}
