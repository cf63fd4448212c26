//! A small W3C WebDriver client for the console's browser test: Debian's `chromedriver`
//! driving a headless `chromium`, spoken to over HTTP/1.1 on a std `TcpStream` with
//! `serde_json` (no WebDriver crate: the test needs a dozen commands).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The key W3C WebDriver names an element reference by.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How long one WebDriver command may take (a page load included).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// `name` on `PATH`, if it is there.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// A headless Chromium under a `chromedriver` this test started; both end on drop.
pub struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
}

impl Browser {
    /// Starts `chromedriver` and a headless Chromium session. `None` (after saying why on
    /// stderr) when either is missing and `CI` is unset; under CI a missing one fails the
    /// test: `tests/setup` installs both.
    pub fn start_or_skip(test: &str) -> Option<Browser> {
        let (chromium, driver) = (which("chromium"), which("chromedriver"));
        let (Some(chromium), Some(driver)) = (chromium, driver) else {
            let msg = format!(
                "{test}: `chromium` and `chromedriver` are needed (Debian packages chromium, chromium-driver; run tests/setup)"
            );
            assert!(std::env::var_os("CI").is_none(), "{msg}");
            eprintln!("SKIPPED {msg}");
            return None;
        };
        Some(Browser::start(&chromium, &driver))
    }

    fn start(chromium: &Path, driver: &Path) -> Browser {
        // A free port for chromedriver (it cannot be told to pick one and say which).
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        // Its own process group, which the Chromium it starts joins: dropping the browser
        // ends them all, even when the session could not be ended politely.
        let child = Command::new(driver)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn chromedriver");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let mut b = Browser {
            driver: child,
            addr,
            session: String::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium.display().to_string(),
                // We run as root (no sandbox), in containers (small /dev/shm), without a GPU.
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1400,900",
                         "--hide-scrollbars"],
            },
        }}});
        let v = b
            .call("POST", "/session", Some(caps))
            .expect("a Chromium session");
        b.session = v["sessionId"]
            .as_str()
            .expect("the new session's id")
            .to_string();
        b
    }

    /// One WebDriver command; its `value`, or the driver's error as one line.
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut s = TcpStream::connect(self.addr).map_err(|e| format!("connect: {e}"))?;
        s.set_read_timeout(Some(COMMAND_TIMEOUT))
            .map_err(|e| e.to_string())?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            self.addr,
            body.len()
        );
        s.write_all(req.as_bytes()).map_err(|e| e.to_string())?;
        let payload = read_response(&mut s).map_err(|e| format!("{method} {path}: {e}"))?;
        let v: Value = serde_json::from_slice(&payload)
            .map_err(|e| format!("{method} {path}: not JSON ({e})"))?;
        let value = v.get("value").cloned().unwrap_or(Value::Null);
        if let Some(err) = value.get("error").and_then(Value::as_str) {
            let msg = value["message"].as_str().unwrap_or("");
            return Err(format!(
                "{method} {path}: {err}: {}",
                msg.lines().next().unwrap_or("")
            ));
        }
        Ok(value)
    }

    fn session_call(&self, method: &str, path: &str, body: Option<Value>) -> Result<Value, String> {
        self.call(method, &format!("/session/{}{path}", self.session), body)
    }

    /// Loads `url` (waits for the load).
    pub fn goto(&self, url: &str) {
        self.session_call("POST", "/url", Some(json!({ "url": url })))
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// The page's URL now.
    pub fn url(&self) -> String {
        self.session_call("GET", "/url", None)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }

    /// The first element matching the CSS selector `css`, if any.
    pub fn find(&self, css: &str) -> Option<String> {
        let v = self
            .session_call(
                "POST",
                "/element",
                Some(json!({"using": "css selector", "value": css})),
            )
            .ok()?;
        v[ELEMENT].as_str().map(str::to_string)
    }

    /// Every element matching `css`.
    pub fn find_all(&self, css: &str) -> Vec<String> {
        self.session_call(
            "POST",
            "/elements",
            Some(json!({"using": "css selector", "value": css})),
        )
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|e| e[ELEMENT].as_str().map(str::to_string))
        .collect()
    }

    /// An element's rendered text (empty when it went stale).
    pub fn text(&self, element: &str) -> String {
        self.session_call("GET", &format!("/element/{element}/text"), None)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }

    /// The text of the first element matching `css` (empty when there is none).
    pub fn text_of(&self, css: &str) -> String {
        self.find(css).map(|e| self.text(&e)).unwrap_or_default()
    }

    /// An element's attribute.
    pub fn attr(&self, element: &str, name: &str) -> Option<String> {
        self.session_call("GET", &format!("/element/{element}/attribute/{name}"), None)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
    }

    /// The first element matching `css`, waiting up to 10 s for it.
    pub fn element(&self, css: &str) -> String {
        self.wait(css, Duration::from_secs(10), |b| b.find(css))
    }

    /// Clicks the button at `css` as a person would (it submits a form), and waits for the
    /// next page (the button's page has gone).
    pub fn submit(&self, css: &str) {
        let el = self.element(css);
        self.session_call("POST", &format!("/element/{el}/click"), Some(json!({})))
            .unwrap_or_else(|e| panic!("{e}"));
        self.wait("the next page", Duration::from_secs(10), |b| {
            b.session_call("GET", &format!("/element/{el}/enabled"), None)
                .is_err()
                .then_some(())
        });
        self.wait("the next page to load", Duration::from_secs(10), |b| {
            (b.script("return document.readyState;") == json!("complete")).then_some(())
        });
    }

    /// Types `text` into the first element matching `css`.
    pub fn type_into(&self, css: &str, text: &str) {
        let el = self.element(css);
        self.session_call("POST", &format!("/element/{el}/clear"), Some(json!({})))
            .unwrap_or_else(|e| panic!("{e}"));
        self.session_call(
            "POST",
            &format!("/element/{el}/value"),
            Some(json!({ "text": text })),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Runs `script` (a function body) in the page; what it returns.
    pub fn script(&self, script: &str) -> Value {
        self.session_call(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
        .unwrap_or_else(|e| panic!("{e}"))
    }

    /// Saves a screenshot of the window as `dir/NAME.png`; its path.
    pub fn screenshot(&self, dir: &Path, name: &str) -> PathBuf {
        let v = self
            .session_call("GET", "/screenshot", None)
            .unwrap_or_else(|e| panic!("{e}"));
        let png = base64_decode(v.as_str().expect("base64 PNG")).expect("valid base64");
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        std::fs::create_dir_all(dir).expect("screenshot dir");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write screenshot");
        path
    }

    /// Calls `f` every 100 ms until it returns something, for at most `timeout`; panics
    /// with `what` (and the page's URL) if it never does.
    pub fn wait<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut f: impl FnMut(&Browser) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = f(self) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "waited {timeout:?} for {what}; the page ({}) shows:\n{}",
                self.url(),
                self.text_of("body")
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self.call("DELETE", &format!("/session/{}", self.session), None);
        }
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.driver.id())])
            .status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Reads one HTTP/1.1 response's body: chromedriver keeps the connection open whatever the
/// request says, so the body ends where `Content-Length` (or the last chunk) says.
fn read_response(s: &mut TcpStream) -> Result<Vec<u8>, String> {
    let mut raw = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let mut fill = |raw: &mut Vec<u8>| -> Result<bool, String> {
        let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        raw.extend_from_slice(&buf[..n]);
        Ok(n > 0)
    };
    let split = loop {
        if let Some(at) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        if !fill(&mut raw)? {
            return Err("the connection closed before the headers ended".into());
        }
    };
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let body_at = split + 4;
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok());
    if let Some(len) = length {
        while raw.len() < body_at + len {
            if !fill(&mut raw)? {
                return Err("the connection closed mid-body".into());
            }
        }
        return Ok(raw[body_at..body_at + len].to_vec());
    }
    if head.contains("transfer-encoding: chunked") {
        loop {
            if raw[body_at..].ends_with(b"0\r\n\r\n")
                && let Ok(body) = dechunk(&raw[body_at..])
            {
                return Ok(body);
            }
            if !fill(&mut raw)? {
                return dechunk(&raw[body_at..]);
            }
        }
    }
    // Neither: the body runs to the close.
    while fill(&mut raw)? {}
    Ok(raw[body_at..].to_vec())
}

/// Undoes HTTP/1.1 chunked transfer encoding.
fn dechunk(mut b: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("bad chunk header")?;
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| format!("bad chunk size {size_text:?}"))?;
        b = &b[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = b.get(..size).ok_or("short chunk")?;
        out.extend_from_slice(chunk);
        b = b.get(size + 2..).ok_or("short chunk end")?;
    }
}

/// Standard base64 (with padding) to bytes.
fn base64_decode(s: &str) -> Result<Vec<u8>, String> {
    let val = |c: u8| -> Result<u32, String> {
        Ok(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(format!("not base64: {:?}", c as char)),
        } as u32)
    };
    let clean: Vec<u8> = s
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for quad in clean.chunks(4) {
        let mut n = 0u32;
        for (i, c) in quad.iter().enumerate() {
            n |= val(*c)? << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..quad.len().saturating_sub(1)]);
    }
    Ok(out)
}

#[test]
fn base64_and_chunks_decode() {
    assert_eq!(base64_decode("aGVsbG8=").as_deref(), Ok(&b"hello"[..]));
    assert_eq!(base64_decode("aGk=").as_deref(), Ok(&b"hi"[..]));
    assert_eq!(base64_decode("YWJj").as_deref(), Ok(&b"abc"[..]));
    assert!(base64_decode("a*==").is_err());
    assert_eq!(
        dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").as_deref(),
        Ok(&b"abcde"[..])
    );
    assert!(dechunk(b"zz\r\n").is_err());
}
