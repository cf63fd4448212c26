//! A fake forge on `127.0.0.1:0` (hyper's server) that speaks GitHub's, GitLab's or Gitea's
//! REST API for pull requests: list and create, with the forges' documented shapes, statuses
//! and error bodies. It keeps pull requests in memory (a second create for the same head and
//! base gets the forge's "already exists"), checks the token header (401 with the forge's
//! body), records every request, and answers first from a queue of canned answers (rate
//! limits, 5xx, slow answers) a test pushes.
//!
//! Include it with `#[path = ".../tests/common/forge.rs"] mod forge;`; it needs hyper
//! (`server`, `http1`), hyper-util (`tokio`), http-body-util, bytes, serde_json and tokio. Start
//! it inside the test's tokio runtime; it stops on [`FakeForge::shutdown`] or when dropped.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};

/// The token a fake forge takes unless started with another.
pub const TOKEN: &str = "fake-forge-token-5f3c9a7e";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeKind {
    GitHub,
    GitLab,
    Gitea,
}

impl FakeKind {
    pub const ALL: [FakeKind; 3] = [FakeKind::GitHub, FakeKind::GitLab, FakeKind::Gitea];

    /// The name `[delivery.forge] kind` takes.
    pub fn name(self) -> &'static str {
        match self {
            FakeKind::GitHub => "github",
            FakeKind::GitLab => "gitlab",
            FakeKind::Gitea => "gitea",
        }
    }

    /// The API's root path under the server (GitHub's API is at the root, like api.github.com).
    pub fn prefix(self) -> &'static str {
        match self {
            FakeKind::GitHub => "",
            FakeKind::GitLab => "/api/v4",
            FakeKind::Gitea => "/api/v1",
        }
    }
}

/// A request as the fake got it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub at: Instant,
    pub method: String,
    /// Path and query, as sent (still percent-encoded).
    pub path: String,
    /// Names in lower case, in the order sent.
    pub headers: Vec<(String, String)>,
    /// The JSON body, or `Null` when there was none (or it was not JSON).
    pub body: Value,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The path without its query.
    pub fn route(&self) -> &str {
        self.path.split('?').next().unwrap_or("")
    }

    /// The query parameter `name`, decoded.
    pub fn query(&self, name: &str) -> Option<String> {
        query_param(&self.path, name)
    }
}

/// A pull request (merge request) the fake holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FakePull {
    pub repo: String,
    pub number: u64,
    pub head: String,
    pub base: String,
    pub title: String,
    pub body: String,
    pub open: bool,
}

struct Canned {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
    delay: Duration,
}

struct State {
    token: String,
    pulls: Vec<FakePull>,
    requests: Vec<Recorded>,
    canned: VecDeque<Canned>,
}

pub struct FakeForge {
    kind: FakeKind,
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl FakeForge {
    /// A fake `kind` forge taking [`TOKEN`].
    pub async fn start(kind: FakeKind) -> FakeForge {
        FakeForge::start_with_token(kind, TOKEN).await
    }

    pub async fn start_with_token(kind: FakeKind, token: &str) -> FakeForge {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("the listener's address");
        let state = Arc::new(Mutex::new(State {
            token: token.to_string(),
            pulls: Vec::new(),
            requests: Vec::new(),
            canned: VecDeque::new(),
        }));
        let (stop, mut stopped) = oneshot::channel::<()>();
        let shared = state.clone();
        let task = tokio::spawn(async move {
            // Connections live in the set: when this task ends or is aborted, they go too.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        while connections.try_join_next().is_some() {}
                        let state = shared.clone();
                        connections.spawn(async move {
                            let service = hyper::service::service_fn(move |req| {
                                let state = state.clone();
                                async move { Ok::<_, Infallible>(handle(kind, addr, state, req).await) }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                }
            }
        });
        FakeForge {
            kind,
            addr,
            state,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn kind(&self) -> FakeKind {
        self.kind
    }

    /// What `[delivery.forge] api_url` takes: `http://127.0.0.1:PORT` plus the API's path.
    pub fn api_url(&self) -> String {
        format!("{}{}", self.web_url(), self.kind.prefix())
    }

    /// Where the web pages of pull requests are: `http://127.0.0.1:PORT`.
    pub fn web_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next request not yet answered by an earlier canned answer gets this one, whatever
    /// it asks and whatever token it carries.
    pub fn push_answer(&self, status: u16, headers: &[(&str, &str)], body: &str) {
        self.push_slow_answer(Duration::ZERO, status, headers, body);
    }

    /// [`FakeForge::push_answer`], sent after `delay`.
    pub fn push_slow_answer(
        &self,
        delay: Duration,
        status: u16,
        headers: &[(&str, &str)],
        body: &str,
    ) {
        self.lock().canned.push_back(Canned {
            status,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.to_string(),
            delay,
        });
    }

    /// Opens a pull request from `head` into `base` in `repo` directly (as another client
    /// would have); returns its number.
    pub fn add_open(&self, repo: &str, head: &str, base: &str) -> u64 {
        let mut s = self.lock();
        add(&mut s, repo, head, base, "opened elsewhere", "")
    }

    /// Closes pull request `number` of `repo`.
    pub fn close(&self, repo: &str, number: u64) {
        let mut s = self.lock();
        if let Some(p) = s
            .pulls
            .iter_mut()
            .find(|p| p.repo == repo && p.number == number)
        {
            p.open = false;
        }
    }

    pub fn pulls(&self) -> Vec<FakePull> {
        self.lock().pulls.clone()
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    /// How many requests had `method` (`"GET"`, `"POST"`).
    pub fn count(&self, method: &str) -> usize {
        self.lock()
            .requests
            .iter()
            .filter(|r| r.method == method)
            .count()
    }

    /// Stops accepting and closes every connection.
    pub async fn shutdown(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("the fake forge's state")
    }
}

impl Drop for FakeForge {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

fn add(s: &mut State, repo: &str, head: &str, base: &str, title: &str, body: &str) -> u64 {
    let number = s.pulls.iter().filter(|p| p.repo == repo).count() as u64 + 1;
    s.pulls.push(FakePull {
        repo: repo.to_string(),
        number,
        head: head.to_string(),
        base: base.to_string(),
        title: title.to_string(),
        body: body.to_string(),
        open: true,
    });
    number
}

async fn handle(
    kind: FakeKind,
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    req: Request<Incoming>,
) -> Response<Full<Bytes>> {
    let method = req.method().as_str().to_string();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".to_string());
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let bytes = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    let recorded = Recorded {
        at: Instant::now(),
        method,
        path,
        headers,
        body,
    };
    let canned = {
        let mut s = state.lock().expect("the fake forge's state");
        s.requests.push(recorded.clone());
        s.canned.pop_front()
    };
    if let Some(c) = canned {
        tokio::time::sleep(c.delay).await;
        return reply(c.status, &c.headers, c.body);
    }
    let web = format!("http://{addr}");
    let mut s = state.lock().expect("the fake forge's state");
    let (status, extra, body) = answer(kind, &web, &mut s, &recorded);
    reply(status, &extra, body.to_string())
}

fn reply(status: u16, headers: &[(String, String)], body: String) -> Response<Full<Bytes>> {
    let mut r = Response::builder().status(status);
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        r = r.header("content-type", "application/json; charset=utf-8");
    }
    for (k, v) in headers {
        r = r.header(k.as_str(), v.as_str());
    }
    r.body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::from_static(b"bad canned answer"))))
}

type Answer = (u16, Vec<(String, String)>, Value);

fn answer(kind: FakeKind, web: &str, s: &mut State, r: &Recorded) -> Answer {
    if !authorized(kind, &s.token, r) {
        return (401, vec![], unauthorized(kind, web, r));
    }
    let route = r.route().strip_prefix(kind.prefix()).unwrap_or("");
    let segments: Vec<&str> = route.trim_start_matches('/').split('/').collect();
    let repo = match (kind, segments.as_slice()) {
        (FakeKind::GitHub | FakeKind::Gitea, ["repos", owner, name, "pulls"]) => {
            format!("{}/{}", decode(owner), decode(name))
        }
        (FakeKind::GitLab, ["projects", id, "merge_requests"]) => decode(id),
        _ => return (404, vec![], not_found(kind, web)),
    };
    match r.method.as_str() {
        "GET" => list(kind, web, s, &repo, r),
        "POST" => create(kind, web, s, &repo, r),
        _ => (404, vec![], not_found(kind, web)),
    }
}

fn authorized(kind: FakeKind, token: &str, r: &Recorded) -> bool {
    let auth = r.header("authorization");
    let bearer = auth == Some(format!("Bearer {token}").as_str());
    match kind {
        FakeKind::GitHub => bearer || auth == Some(format!("token {token}").as_str()),
        FakeKind::GitLab => bearer || r.header("private-token") == Some(token),
        FakeKind::Gitea => bearer || auth == Some(format!("token {token}").as_str()),
    }
}

fn unauthorized(kind: FakeKind, web: &str, r: &Recorded) -> Value {
    match kind {
        FakeKind::GitHub => json!({
            "message": "Bad credentials",
            "documentation_url": "https://docs.github.com/rest",
            "status": "401"
        }),
        FakeKind::GitLab => json!({"message": "401 Unauthorized"}),
        FakeKind::Gitea => {
            let message = if r.header("authorization").is_none() {
                "token is required"
            } else {
                "user does not exist [uid: 0, name: ]"
            };
            json!({"message": message, "url": format!("{web}/api/swagger")})
        }
    }
}

fn not_found(kind: FakeKind, web: &str) -> Value {
    match kind {
        FakeKind::GitHub => json!({
            "message": "Not Found",
            "documentation_url": "https://docs.github.com/rest",
            "status": "404"
        }),
        FakeKind::GitLab => json!({"message": "404 Project Not Found"}),
        FakeKind::Gitea => json!({
            "message": "The target couldn't be found.",
            "url": format!("{web}/api/swagger"),
            "errors": []
        }),
    }
}

/// A pull request as the forge shows it.
fn shown(kind: FakeKind, web: &str, p: &FakePull) -> Value {
    let owner = p.repo.split('/').next().unwrap_or("");
    let id = 1000 + p.number;
    match kind {
        FakeKind::GitHub => json!({
            "id": id,
            "number": p.number,
            "state": if p.open { "open" } else { "closed" },
            "title": p.title,
            "body": p.body,
            "draft": false,
            "url": format!("{web}/repos/{}/pulls/{}", p.repo, p.number),
            "html_url": format!("{web}/{}/pull/{}", p.repo, p.number),
            "head": {"ref": p.head, "label": format!("{owner}:{}", p.head), "sha": "0".repeat(40)},
            "base": {"ref": p.base, "label": format!("{owner}:{}", p.base), "sha": "1".repeat(40)},
        }),
        FakeKind::GitLab => json!({
            "id": id,
            "iid": p.number,
            "project_id": 1,
            "title": p.title,
            "description": p.body,
            "state": if p.open { "opened" } else { "closed" },
            "source_branch": p.head,
            "target_branch": p.base,
            "source_project_id": 1,
            "target_project_id": 1,
            "web_url": format!("{web}/{}/-/merge_requests/{}", p.repo, p.number),
        }),
        FakeKind::Gitea => json!({
            "id": id,
            "number": p.number,
            "state": if p.open { "open" } else { "closed" },
            "title": p.title,
            "body": p.body,
            "url": format!("{web}/{}/pulls/{}", p.repo, p.number),
            "html_url": format!("{web}/{}/pulls/{}", p.repo, p.number),
            "head": {"ref": p.head, "label": p.head, "sha": "0".repeat(40), "repo_id": 1},
            "base": {"ref": p.base, "label": p.base, "sha": "1".repeat(40), "repo_id": 1},
        }),
    }
}

fn list(kind: FakeKind, web: &str, s: &State, repo: &str, r: &Recorded) -> Answer {
    let q = |name: &str| r.query(name);
    let owner = repo.split('/').next().unwrap_or("");
    let state = q("state");
    let matching = s.pulls.iter().filter(|p| p.repo == repo);
    match kind {
        FakeKind::GitHub => {
            // `head` is `owner:branch`; `state` is open unless asked otherwise.
            let head = q("head");
            let head = head
                .as_deref()
                .map(|h| h.split_once(':').unwrap_or(("", h)));
            let base = q("base");
            let state = state.unwrap_or_else(|| "open".into());
            let items: Vec<Value> = matching
                .filter(|p| head.is_none_or(|(o, b)| o == owner && b == p.head))
                .filter(|p| base.as_deref().is_none_or(|b| b == p.base))
                .filter(|p| state == "all" || (state == "open") == p.open)
                .map(|p| shown(kind, web, p))
                .collect();
            (200, vec![], Value::Array(items))
        }
        FakeKind::GitLab => {
            let source = q("source_branch");
            let target = q("target_branch");
            let state = state.unwrap_or_else(|| "all".into());
            let items: Vec<Value> = matching
                .filter(|p| source.as_deref().is_none_or(|b| b == p.head))
                .filter(|p| target.as_deref().is_none_or(|b| b == p.base))
                .filter(|p| state == "all" || (state == "opened") == p.open)
                .map(|p| shown(kind, web, p))
                .collect();
            (200, vec![], Value::Array(items))
        }
        FakeKind::Gitea => {
            // No branch filter: pages of `limit` (at most 50), X-Total-Count for them all.
            let state = state.unwrap_or_else(|| "open".into());
            let page = q("page")
                .and_then(|p| p.parse::<usize>().ok())
                .unwrap_or(1)
                .max(1);
            let limit = q("limit")
                .and_then(|l| l.parse::<usize>().ok())
                .unwrap_or(30)
                .clamp(1, 50);
            let all: Vec<&FakePull> = matching
                .filter(|p| state == "all" || (state == "open") == p.open)
                .collect();
            let items: Vec<Value> = all
                .iter()
                .skip((page - 1).saturating_mul(limit))
                .take(limit)
                .map(|p| shown(kind, web, p))
                .collect();
            let total = vec![("x-total-count".to_string(), all.len().to_string())];
            (200, total, Value::Array(items))
        }
    }
}

fn create(kind: FakeKind, web: &str, s: &mut State, repo: &str, r: &Recorded) -> Answer {
    let field = |name: &str| r.body.get(name).and_then(Value::as_str).unwrap_or("");
    let (head, base, title, body) = match kind {
        FakeKind::GitLab => (
            field("source_branch"),
            field("target_branch"),
            field("title"),
            field("description"),
        ),
        FakeKind::GitHub | FakeKind::Gitea => {
            (field("head"), field("base"), field("title"), field("body"))
        }
    };
    let missing = [("head", head), ("base", base), ("title", title)]
        .into_iter()
        .find(|(_, v)| v.is_empty())
        .map(|(k, _)| k);
    if let Some(missing) = missing {
        return match kind {
            FakeKind::GitHub => (
                422,
                vec![],
                json!({
                    "message": "Validation Failed",
                    "errors": [{"resource": "PullRequest", "field": missing, "code": "missing_field"}],
                    "documentation_url": "https://docs.github.com/rest/pulls/pulls#create-a-pull-request",
                    "status": "422"
                }),
            ),
            FakeKind::GitLab => (
                400,
                vec![],
                json!({"error": format!("{missing} is missing")}),
            ),
            FakeKind::Gitea => (
                422,
                vec![],
                json!({"message": format!("[{missing}]: Required"), "url": format!("{web}/api/swagger")}),
            ),
        };
    }
    let owner = repo.split('/').next().unwrap_or("");
    let existing = s
        .pulls
        .iter()
        .find(|p| p.repo == repo && p.open && p.head == head && p.base == base);
    if let Some(p) = existing {
        return match kind {
            FakeKind::GitHub => (
                422,
                vec![],
                json!({
                    "message": "Validation Failed",
                    "errors": [{
                        "resource": "PullRequest",
                        "code": "custom",
                        "message": format!("A pull request already exists for {owner}:{head}.")
                    }],
                    "documentation_url": "https://docs.github.com/rest/pulls/pulls#create-a-pull-request",
                    "status": "422"
                }),
            ),
            FakeKind::GitLab => (
                409,
                vec![],
                json!({"message": [format!(
                    "Another open merge request already exists for this source branch: !{}",
                    p.number
                )]}),
            ),
            FakeKind::Gitea => (
                409,
                vec![],
                json!({
                    "message": format!(
                        "pull request already exists for these targets [id: {}, issue_id: {}, \
                         head_repo_id: 1, base_repo_id: 1, head_branch: {head}, base_branch: {base}]",
                        1000 + p.number, p.number
                    ),
                    "url": format!("{web}/api/swagger")
                }),
            ),
        };
    }
    let number = add(s, repo, head, base, title, body);
    let p = s
        .pulls
        .iter()
        .find(|p| p.repo == repo && p.number == number)
        .expect("the pull request just added");
    (201, vec![], shown(kind, web, p))
}

/// The query parameter `name` of `path`, percent-decoded (`+` is a space).
fn query_param(path: &str, name: &str) -> Option<String> {
    let (_, query) = path.split_once('?')?;
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (decode(k) == name).then(|| decode(v))
    })
}

fn decode(s: &str) -> String {
    let hex = |b: &u8| (*b as char).to_digit(16).map(|d| d as u8);
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%'
            && let (Some(h), Some(l)) = (
                bytes.get(i + 1).and_then(hex),
                bytes.get(i + 2).and_then(hex),
            )
        {
            out.push(h * 16 + l);
            i += 3;
            continue;
        }
        out.push(if b == b'+' { b' ' } else { b });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
