//! The console over real sockets against a fake coordinator: pages, sign-in, CSRF, actions
//! (and the token they carry), refusals mapped to HTTP statuses, both live streams, and a
//! finished task's delivery (its buttons) and change (the diff, escaped and bounded).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use automaton_console::{Authenticate, Options, StreamLimits, serve};
use automaton_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

type Calls = Arc<Mutex<Vec<String>>>;
type Boxed<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A coordinator that answers from fixtures and writes down each call with its bearer.
#[derive(Clone)]
struct Fake {
    calls: Calls,
    events: broadcast::Sender<pb::Event>,
}

impl Fake {
    fn note<T>(&self, what: &str, req: &Request<T>) {
        let auth = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("-")
            .to_string();
        self.calls
            .lock()
            .expect("calls")
            .push(format!("{what} {auth}"));
    }
}

#[tonic::async_trait]
impl pb::tasks_server::Tasks for Fake {
    async fn create_task(
        &self,
        _: Request<pb::CreateTaskRequest>,
    ) -> Result<Response<pb::TaskSummary>, Status> {
        Err(Status::unimplemented("no"))
    }

    async fn get_task(
        &self,
        req: Request<pb::GetTaskRequest>,
    ) -> Result<Response<pb::TaskDetail>, Status> {
        let what = format!(
            "get_task {} changes={}",
            req.get_ref().task,
            req.get_ref().with_changes
        );
        self.note(&what, &req);
        let r = req.into_inner();
        let name = r.task;
        if let Some(d) = finished(&name, r.with_changes) {
            return Ok(Response::new(d));
        }
        if name != "shop/api" {
            return Err(Status::not_found(format!("no task '{name}'")));
        }
        // As the coordinator does: the texts only when asked for.
        let content = |text: &str| {
            if r.with_contents {
                text.to_string()
            } else {
                String::new()
            }
        };
        Ok(Response::new(pb::TaskDetail {
            artifacts: vec![
                pb::ArtifactFile {
                    artifact: "DESIGN.md".into(),
                    bytes: 52,
                    content: content("# Design\n<script>alert('owned')</script> **bold**"),
                    ..Default::default()
                },
                pb::ArtifactFile {
                    artifact: "SPEC.md".into(),
                    bytes: 400_000,
                    content: content("# Spec\nlong"),
                    truncated: r.with_contents,
                    ..Default::default()
                },
            ],
            runs: vec![pb::Run {
                worker: "gpu-a".into(),
                phase: "design".into(),
                state: "stopped".into(),
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                ..Default::default()
            }],
            summary: Some(pb::TaskSummary {
                task: name,
                state: "design:awaiting_approval".into(),
                ..Default::default()
            }),
            approval: Some(pb::ApprovalStatus {
                status: "awaiting".into(),
                artifact: "DESIGN.md".into(),
                ..Default::default()
            }),
            ..Default::default()
        }))
    }

    async fn list_tasks(
        &self,
        req: Request<pb::ListTasksRequest>,
    ) -> Result<Response<pb::ListTasksResponse>, Status> {
        self.note("list_tasks", &req);
        let shop = pb::TaskSummary {
            task: "shop".into(),
            state: "decomposition:approved".into(),
            subtasks: vec![pb::TaskSummary {
                task: "shop/api".into(),
                state: "design:awaiting_approval".into(),
                wave: 1,
                ..Default::default()
            }],
            ..Default::default()
        };
        let evil = pb::TaskSummary {
            task: "<script>alert(1)</script>".into(),
            state: "new".into(),
            ..Default::default()
        };
        let landed = pb::TaskSummary {
            task: "landed".into(),
            state: "complete".into(),
            delivery: Some(pb::Delivery {
                commit: "abc123def4567890abc123def4567890abc123de".into(),
                how: "merge commit".into(),
                ..cart_delivery("merged")
            }),
            ..Default::default()
        };
        let cart = finished("cart", false)
            .and_then(|d| d.summary)
            .expect("cart is a fixture");
        Ok(Response::new(pb::ListTasksResponse {
            tasks: vec![shop, evil, cart, landed],
            sizing_ratio: 0.0,
        }))
    }

    async fn transition(
        &self,
        _: Request<pb::TransitionRequest>,
    ) -> Result<Response<pb::TransitionResponse>, Status> {
        Err(Status::unimplemented("no"))
    }

    async fn approve(
        &self,
        req: Request<pb::ApproveRequest>,
    ) -> Result<Response<pb::ApproveResponse>, Status> {
        self.note("approve", &req);
        let r = req.into_inner();
        if r.task != "shop/api" {
            return Err(Status::failed_precondition("not awaiting approval"));
        }
        Ok(Response::new(pb::ApproveResponse {
            task: r.task,
            ..Default::default()
        }))
    }

    async fn validate_folder(
        &self,
        _: Request<pb::ValidateFolderRequest>,
    ) -> Result<Response<pb::ValidateFolderResponse>, Status> {
        Err(Status::unimplemented("no"))
    }

    async fn audit(
        &self,
        _: Request<pb::AuditRequest>,
    ) -> Result<Response<pb::AuditResponse>, Status> {
        Err(Status::unimplemented("no"))
    }
}

#[tonic::async_trait]
impl pb::workers_server::Workers for Fake {
    type SessionStream = Boxed<pb::CoordinatorMessage>;
    type TailOutputStream = Boxed<pb::OutputEvent>;

    async fn session(
        &self,
        _: Request<tonic::Streaming<pb::WorkerMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        Err(Status::unimplemented("no"))
    }

    async fn list_workers(
        &self,
        req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        self.note("list_workers", &req);
        Ok(Response::new(pb::ListWorkersResponse {
            workers: vec![pb::WorkerInfo {
                name: "gpu-a".into(),
                state: "idle".into(),
                gpus: vec![pb::Gpu {
                    name: "NVIDIA H200".into(),
                    total_bytes: 140 << 30,
                    free_bytes: 139 << 30,
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }))
    }

    async fn drain_worker(
        &self,
        req: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        self.note("drain_worker", &req);
        Err(Status::not_found(format!(
            "no worker '{}'",
            req.into_inner().name
        )))
    }

    async fn stop_run(
        &self,
        req: Request<pb::StopRunRequest>,
    ) -> Result<Response<pb::StopRunResponse>, Status> {
        self.note(
            if req.get_ref().resume {
                "resume"
            } else {
                "stop"
            },
            &req,
        );
        Err(Status::permission_denied("operators only"))
    }

    async fn run_task(
        &self,
        _: Request<pb::RunTaskRequest>,
    ) -> Result<Response<pb::RunTaskResponse>, Status> {
        Err(Status::failed_precondition("autopilot"))
    }

    async fn deliver(
        &self,
        req: Request<pb::DeliverRequest>,
    ) -> Result<Response<pb::Delivery>, Status> {
        self.note(&format!("deliver {}", req.get_ref().task), &req);
        let task = req.into_inner().task;
        if task != "cart" {
            return Err(Status::failed_precondition(format!(
                "{task} is design:awaiting_approval: its delivery starts when it is complete"
            )));
        }
        Ok(Response::new(pb::Delivery {
            approved_by: "ann".into(),
            waiting: String::new(),
            ..cart_delivery("requested")
        }))
    }

    async fn abandon(
        &self,
        req: Request<pb::AbandonRequest>,
    ) -> Result<Response<pb::Delivery>, Status> {
        let what = format!(
            "abandon {} reason={}",
            req.get_ref().task,
            req.get_ref().reason
        );
        self.note(&what, &req);
        let r = req.into_inner();
        if r.task != "cart" {
            return Err(Status::failed_precondition(format!(
                "{} has no delivery to abandon (it is not complete, or [delivery] mode is branch)",
                r.task
            )));
        }
        Ok(Response::new(pb::Delivery {
            abandoned_by: "ann".into(),
            failure: r.reason,
            ..cart_delivery("abandoned")
        }))
    }

    async fn collect_branches(
        &self,
        _: Request<pb::CollectBranchesRequest>,
    ) -> Result<Response<pb::CollectBranchesResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn tail_output(
        &self,
        req: Request<pb::TailOutputRequest>,
    ) -> Result<Response<Self::TailOutputStream>, Status> {
        self.note("tail_output", &req);
        let ev = |data: &[u8], skipped, ended| pb::OutputEvent {
            task: "shop/api".into(),
            data: data.to_vec(),
            skipped,
            ended,
            end_reason: if ended {
                "output closed".into()
            } else {
                String::new()
            },
            ..Default::default()
        };
        let items = vec![
            Ok(ev(b"hello <b>\n", 0, false)),
            Ok(ev(b"later", 42, false)),
            Ok(ev(b"", 0, true)),
        ];
        Ok(Response::new(Box::pin(tokio_stream::iter(items))))
    }
}

#[tonic::async_trait]
impl pb::events_server::Events for Fake {
    type WatchEventsStream = Boxed<pb::Event>;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        self.note("watch_events", &req);
        let rx = tokio_stream::wrappers::BroadcastStream::new(self.events.subscribe());
        let s = tokio_stream::StreamExt::filter_map(rx, |e| e.ok().map(Ok));
        Ok(Response::new(Box::pin(s)))
    }
}

/// `cart`'s delivery in `state`: into `main`, waiting for an operator's approval.
fn cart_delivery(state: &str) -> pb::Delivery {
    pb::Delivery {
        state: state.into(),
        mode: "merge".into(),
        strategy: "merge".into(),
        base: "main".into(),
        branch: "automaton/cart".into(),
        revision: "0123456789abcdef0123456789abcdef01234567".into(),
        waiting: "awaiting an operator: `automaton deliver cart` lets 0123456789ab land on main"
            .into(),
        requested_at: Some(automaton_proto::prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 0,
        }),
        ..Default::default()
    }
}

/// A change whose line and file name carry `<script>`, and a control character.
const CART_DIFF: &str = concat!(
    "diff --git a/src/cart.rs b/src/cart.rs\n",
    "index 1111111..2222222 100644\n",
    "--- a/src/cart.rs\n",
    "+++ b/src/cart.rs\n",
    "@@ -1,2 +1,3 @@\n",
    " fn total() {}\n",
    "-// old <b>\n",
    "+// <script>alert(1)</script>\n",
    "+let red = \"\u{1b}[31m\";\n",
    "diff --git a/<script>alert(1)</script>.js b/<script>alert(1)</script>.js\n",
    "new file mode 100644\n",
    "--- /dev/null\n",
    "+++ b/<script>alert(1)</script>.js\n",
    "@@ -0,0 +1 @@\n",
    "+x\n",
);

/// The finished top-level tasks: `cart` (delivery awaiting approval, a small change) and
/// `huge` (a change far past what a page shows). The change only when asked for, as the
/// coordinator does.
fn finished(name: &str, with_changes: bool) -> Option<pb::TaskDetail> {
    let diff = match name {
        "cart" => CART_DIFF.to_string(),
        "huge" => {
            let mut d = String::new();
            for f in 0..300 {
                d.push_str(&format!(
                    "diff --git a/f{f}.rs b/f{f}.rs\n@@ -0,0 +1,50 @@\n"
                ));
                for l in 0..50 {
                    d.push_str(&format!("+line {l} of file {f}\n"));
                }
            }
            d
        }
        _ => return None,
    };
    Some(pb::TaskDetail {
        summary: Some(pb::TaskSummary {
            task: name.into(),
            state: "complete".into(),
            delivery: (name == "cart").then(|| cart_delivery("requested")),
            ..Default::default()
        }),
        changes: with_changes.then(|| pb::TaskChanges {
            base_commit: "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".into(),
            head_commit: "0123456789abcdef0123456789abcdef01234567".into(),
            diff,
            truncated: false,
        }),
        ..Default::default()
    })
}

/// Starts the fake coordinator; returns its channel.
async fn coordinator(fake: Fake) -> tonic::transport::Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::tasks_server::TasksServer::new(fake.clone()))
            .add_service(pb::workers_server::WorkersServer::new(fake.clone()))
            .add_service(pb::events_server::EventsServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .expect("url")
        .connect_lazy()
}

struct Tokens;

impl Authenticate for Tokens {
    fn operator(&self, token: &str) -> Result<String, String> {
        match token {
            "good" => Ok("ann".into()),
            "agent" => Err("an agent's token cannot sign in".into()),
            _ => Err("unknown token".into()),
        }
    }
}

/// Starts a console; returns its address and what stops it.
async fn console(
    channel: tonic::transport::Channel,
    auth: Option<Arc<dyn Authenticate>>,
) -> (SocketAddr, oneshot::Sender<()>) {
    console_with(channel, auth, None).await
}

/// [`console`] with a trace UI URL.
async fn console_with(
    channel: tonic::transport::Channel,
    auth: Option<Arc<dyn Authenticate>>,
    trace_url: Option<&str>,
) -> (SocketAddr, oneshot::Sender<()>) {
    console_limited(channel, auth, trace_url, StreamLimits::default()).await
}

/// [`console_with`] with bounds on its live streams.
async fn console_limited(
    channel: tonic::transport::Channel,
    auth: Option<Arc<dyn Authenticate>>,
    trace_url: Option<&str>,
    streams: StreamLimits,
) -> (SocketAddr, oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let opts = Options {
        channel,
        auth,
        trace_url: trace_url.map(str::to_string),
        project: "demo".into(),
        tls: None,
        streams,
    };
    tokio::spawn(serve(listener, opts, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// One HTTP/1.1 request (connection closed after); the whole response as text.
async fn http(addr: SocketAddr, method: &str, path: &str, headers: &str, body: &str) -> String {
    http_to(addr, &addr.to_string(), method, path, headers, body).await
}

/// [`http`] with `host` as its `Host` header.
async fn http_to(
    addr: SocketAddr,
    host: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n{headers}\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("response in time")
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

fn form_headers(cookie: &str) -> String {
    format!("Content-Type: application/x-www-form-urlencoded\r\n{cookie}")
}

/// Reads a streaming response until `needle` shows up.
async fn stream_until(addr: SocketAddr, path: &str, headers: &str, needle: &str) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !seen.contains(needle) {
        let n = tokio::time::timeout_at(deadline, s.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {seen}"))
            .expect("read");
        if n == 0 {
            break;
        }
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    seen
}

fn status(resp: &str) -> u16 {
    resp.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn csrf(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("csrf field") + 19;
    page[at..].split('"').next().expect("value").to_string()
}

fn fake() -> (Fake, Calls) {
    let calls = Calls::default();
    let (events, _) = broadcast::channel(16);
    (
        Fake {
            calls: calls.clone(),
            events,
        },
        calls,
    )
}

#[tokio::test]
async fn no_auth_pages_actions_and_streams() {
    let (fake, calls) = fake();
    let events = fake.events.clone();
    let (addr, _stop) = console(coordinator(fake).await, None).await;

    let board = http(addr, "GET", "/board", "", "").await;
    assert_eq!(status(&board), 200, "{board}");
    for h in [
        "content-security-policy: default-src 'self'; script-src 'self'",
        "x-content-type-options: nosniff",
        "referrer-policy: same-origin",
        "cache-control: no-store",
    ] {
        assert!(board.to_ascii_lowercase().contains(h), "{h}: {board}");
    }
    assert!(!board.contains("<script>alert"), "{board}");
    assert!(board.contains("data-task=\"&lt;script&gt;alert(1)&lt;/script&gt;\""));
    assert!(board.contains("<div class=\"wave\" data-wave=\"1\">"));
    assert!(board.contains("data-task=\"shop/api\" data-phase=\"design\""));

    let fragment = http(addr, "GET", "/board?needs=person&fragment=1", "", "").await;
    assert!(fragment.contains("<section id=\"board\""));
    assert!(!fragment.contains("<html"));

    let fleet = http(addr, "GET", "/fleet", "", "").await;
    assert!(
        fleet.contains("class=\"worker\" data-name=\"gpu-a\""),
        "{fleet}"
    );
    assert!(fleet.contains("class=\"gpu\""));

    let page = http(addr, "GET", "/task/shop/api", "", "").await;
    assert_eq!(status(&page), 200, "{page}");
    assert!(page.contains("id=\"approve\""));
    assert!(page.contains("<pre id=\"output\" data-src=\"/output/shop/api\">"));
    let token = csrf(&page);

    let missing = http(addr, "GET", "/task/nope", "", "").await;
    assert_eq!(status(&missing), 404, "{missing}");
    assert!(missing.contains("no task &#39;nope&#39;"));

    // No CSRF token, a wrong one, or another site: refused before any call (another site's
    // Origin already by the no-tokens check of every request).
    let before = calls.lock().expect("calls").len();
    let csrf_refused = "missing or wrong CSRF token";
    let not_loopback = "this console has no tokens, so it answers only requests to localhost";
    for (body, extra, says) in [
        ("task=shop%2Fapi".to_string(), "", csrf_refused),
        ("task=shop%2Fapi&csrf=wrong".to_string(), "", csrf_refused),
        (
            format!("task=shop%2Fapi&csrf={token}"),
            "Sec-Fetch-Site: cross-site\r\n",
            csrf_refused,
        ),
        (
            format!("task=shop%2Fapi&csrf={token}"),
            "Origin: http://evil.example\r\n",
            not_loopback,
        ),
    ] {
        let r = http(addr, "POST", "/action/approve", &form_headers(extra), &body).await;
        assert_eq!(status(&r), 403, "{r}");
        assert!(r.contains(says), "{r}");
    }
    assert_eq!(calls.lock().expect("calls").len(), before);

    let body = format!("task=shop%2Fapi&csrf={token}&back=%2Ftask%2Fshop%2Fapi");
    let r = http(addr, "POST", "/action/approve", &form_headers(""), &body).await;
    assert_eq!(status(&r), 303, "{r}");
    assert!(
        r.to_ascii_lowercase().contains("location: /task/shop/api"),
        "{r}"
    );
    assert!(
        calls
            .lock()
            .expect("calls")
            .contains(&"approve -".to_string())
    );

    let body = format!("worker=gpu-z&csrf={token}&back=%2Ffleet");
    let r = http(addr, "POST", "/action/drain", &form_headers(""), &body).await;
    assert_eq!(status(&r), 404, "{r}");
    assert!(
        r.contains("<p id=\"action-error\" class=\"error\">no worker &#39;gpu-z&#39;</p>"),
        "{r}"
    );
    let body = format!("task=shop%2Fapi&csrf={token}");
    let r = http(addr, "POST", "/action/stop", &form_headers(""), &body).await;
    assert_eq!(status(&r), 403, "{r}");
    assert!(r.contains("operators only"));
    let r = http(addr, "POST", "/action/run", &form_headers(""), &body).await;
    assert_eq!(status(&r), 409, "{r}");

    let out = stream_until(addr, "/output/shop/api", "", "event: ended").await;
    assert!(out.contains("text/event-stream"), "{out}");
    assert!(out.contains(r#""text":"hello <b>\n""#), "{out}");
    assert!(out.contains(r#""skipped":42"#), "{out}");

    let js = http(addr, "GET", "/static/console.js", "", "").await;
    assert!(js.contains("text/javascript"));
    assert!(js.contains("EventSource"));

    // One shared feed: a change reaches an open /events page.
    let sender = events.clone();
    tokio::spawn(async move {
        for seq in 0..50 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = sender.send(pb::Event {
                seq,
                kind: "transitioned".into(),
                task: "shop".into(),
                token: 777,
                ..Default::default()
            });
        }
    });
    let feed = stream_until(addr, "/events", "", "\"kind\":\"transitioned\"").await;
    assert!(feed.contains("event: change"), "{feed}");
    assert!(
        !feed.contains("777"),
        "no fencing token on the page: {feed}"
    );
}

#[tokio::test]
async fn sign_in_sessions_and_tokens() {
    let (fake, calls) = fake();
    let auth: Arc<dyn Authenticate> = Arc::new(Tokens);
    let (addr, stop) = console(coordinator(fake).await, Some(auth)).await;

    let r = http(addr, "GET", "/board", "", "").await;
    assert_eq!(status(&r), 303, "{r}");
    assert!(r.to_ascii_lowercase().contains("location: /login"));
    assert_eq!(status(&http(addr, "GET", "/events", "", "").await), 401);
    assert_eq!(
        status(&http(addr, "GET", "/output/shop/api", "", "").await),
        401
    );
    assert_eq!(
        status(&http(addr, "GET", "/static/console.css", "", "").await),
        200
    );

    let login = http(addr, "GET", "/login", "", "").await;
    assert!(login.contains("name=\"token\""));
    let r = http(addr, "POST", "/login", &form_headers(""), "token=agent").await;
    assert_eq!(status(&r), 403);
    assert!(
        r.contains("<p id=\"login-error\" class=\"error\">an agent&#39;s token cannot sign in</p>"),
        "{r}"
    );

    let r = http(addr, "POST", "/login", &form_headers(""), "token=good").await;
    assert_eq!(status(&r), 303, "{r}");
    let cookie_line = r
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("cookie")
        .to_string();
    assert!(cookie_line.contains("HttpOnly; SameSite=Strict; Path=/"));
    assert!(!cookie_line.contains("Secure"));
    let id = cookie_line
        .split_once("automaton_console=")
        .and_then(|(_, v)| v.split(';').next())
        .expect("id");
    assert_eq!(id.len(), 64);
    let cookie = format!("Cookie: automaton_console={id}\r\n");

    let board = http(addr, "GET", "/board", &cookie, "").await;
    assert_eq!(status(&board), 200, "{board}");
    assert!(board.contains("<span class=\"operator\">ann</span>"));
    assert!(
        calls
            .lock()
            .expect("calls")
            .contains(&"list_tasks Bearer good".to_string())
    );
    // The shared feed watches with a signed-in operator's token.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !calls
        .lock()
        .expect("calls")
        .contains(&"watch_events Bearer good".to_string())
    {
        assert!(tokio::time::Instant::now() < deadline, "no feed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let page = http(addr, "GET", "/task/shop/api", &cookie, "").await;
    let token = csrf(&page);
    let body = format!("task=shop%2Fapi&csrf={token}");
    let r = http(
        addr,
        "POST",
        "/action/approve",
        &form_headers(&cookie),
        &body,
    )
    .await;
    assert_eq!(status(&r), 303, "{r}");
    assert!(
        calls
            .lock()
            .expect("calls")
            .contains(&"approve Bearer good".to_string())
    );
    // Another session's CSRF token does not do.
    let r = http(addr, "POST", "/action/approve", &form_headers(""), &body).await;
    assert_eq!(status(&r), 401, "{r}");

    let r = http(
        addr,
        "POST",
        "/logout",
        &form_headers(&cookie),
        "csrf=wrong",
    )
    .await;
    assert_eq!(status(&r), 403, "{r}");
    let r = http(
        addr,
        "POST",
        "/logout",
        &form_headers(&cookie),
        &format!("csrf={token}"),
    )
    .await;
    assert_eq!(status(&r), 303, "{r}");
    assert!(r.contains("Max-Age=0"));
    assert_eq!(status(&http(addr, "GET", "/board", &cookie, "").await), 303);
    let _ = stop.send(());
}

#[tokio::test]
async fn an_unreachable_coordinator_is_a_503_page() {
    let channel = tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy();
    let (addr, _stop) = console(channel, None).await;
    let r = http(addr, "GET", "/board", "", "").await;
    assert_eq!(status(&r), 503, "{r}");
    assert!(r.contains("class=\"error\""));
}

/// A TLS client that trusts the fixtures' test CA.
fn tls_client() -> tokio_rustls::TlsConnector {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(include_bytes!("fixtures/ca.pem")) {
        roots.add(c.expect("ca pem")).expect("ca");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

#[tokio::test]
async fn https_with_a_secure_cookie() {
    let (fake, _) = fake();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let opts = Options {
        channel: coordinator(fake).await,
        auth: Some(Arc::new(Tokens)),
        trace_url: None,
        project: "demo".into(),
        tls: Some((
            include_bytes!("fixtures/cert.pem").to_vec(),
            include_bytes!("fixtures/key.pem").to_vec(),
        )),
        streams: Default::default(),
    };
    let (tx, rx) = oneshot::channel::<()>();
    let served = tokio::spawn(serve(listener, opts, async move {
        let _ = rx.await;
    }));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let mut tls = tls_client().connect(name, tcp).await.expect("handshake");
    let body = "token=good";
    let req = format!(
        "POST /login HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out)).await;
    let resp = String::from_utf8_lossy(&out);
    assert_eq!(status(&resp), 303, "{resp}");
    assert!(
        resp.contains("SameSite=Strict; Path=/; Max-Age=43200; Secure"),
        "{resp}"
    );
    // Plain http to an https console gets nowhere.
    let mut plain = TcpStream::connect(addr).await.expect("connect");
    plain
        .write_all(b"GET /login HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut buf)).await;
    assert!(!String::from_utf8_lossy(&buf).contains("200 OK"));
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("stops")
        .expect("join")
        .expect("served");
}

#[tokio::test]
async fn bad_tls_material_is_an_error() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let opts = Options {
        channel: tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy(),
        auth: None,
        trace_url: None,
        project: "demo".into(),
        tls: Some((b"junk".to_vec(), b"junk".to_vec())),
        streams: Default::default(),
    };
    let e = serve(listener, opts, async {}).await.expect_err("refused");
    assert!(e.to_string().contains("console TLS certificate"), "{e}");
}

#[tokio::test]
async fn shutdown_ends_open_streams() {
    let (fake, _) = fake();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let opts = Options {
        channel: coordinator(fake).await,
        auth: None,
        trace_url: None,
        project: "demo".into(),
        tls: None,
        streams: Default::default(),
    };
    let (tx, rx) = oneshot::channel::<()>();
    let served = tokio::spawn(serve(listener, opts, async move {
        let _ = rx.await;
    }));
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET /events HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .expect("write");
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("headers")
        .expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).contains("text/event-stream"));
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(3), served)
        .await
        .expect("stops well before the grace period")
        .expect("join")
        .expect("served");
}

/// The task page asks for the artifacts' texts and renders them as escaped markdown (an
/// artifact's `<script>` is text on the page), marks a truncated one, and links each run's
/// trace id through `trace_url`; without `trace_url` the id is plain text.
#[tokio::test]
async fn task_page_renders_artifact_text_escaped_and_links_traces() {
    let (fake, _) = fake();
    let channel = coordinator(fake).await;
    let (addr, _stop) = console_with(
        channel.clone(),
        None,
        Some("http://jaeger:16686/trace/{trace_id}"),
    )
    .await;
    let page = http(addr, "GET", "/task/shop/api", "", "").await;
    assert_eq!(status(&page), 200, "{page}");
    assert!(!page.contains("<script>alert"), "{page}");
    assert!(
        page.contains("&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt; <strong>bold</strong>"),
        "{page}"
    );
    assert!(page.contains("<h3>DESIGN.md</h3><h1>Design</h1>"), "{page}");
    assert!(
        page.contains("class=\"artifact-text truncated\" data-artifact=\"SPEC.md\""),
        "{page}"
    );
    assert!(page.contains("truncated: the first 11 of 400000 bytes are shown"));
    assert!(
        page.contains(
            "href=\"http://jaeger:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736\" rel=\"noopener noreferrer\""
        ),
        "{page}"
    );
    // The refreshed fragment carries the same texts.
    let fragment = http(addr, "GET", "/task/shop/api?fragment=1", "", "").await;
    assert!(fragment.contains("&lt;script&gt;alert("), "{fragment}");

    let (plain, _stop2) = console(channel, None).await;
    let page = http(plain, "GET", "/task/shop/api", "", "").await;
    assert!(
        page.contains("<code class=\"trace\">4bf92f3577b34da6a3ce929d0e0e4736</code>"),
        "{page}"
    );
    assert!(!page.contains("jaeger"), "{page}");
}

/// Refused sign-ins are limited per client address: five a minute, then 429 with
/// `Retry-After`, and while blocked even the right token is refused the same way.
#[tokio::test]
async fn sign_in_is_rate_limited_per_address() {
    let (fake, _) = fake();
    let auth: Arc<dyn Authenticate> = Arc::new(Tokens);
    let (addr, _stop) = console(coordinator(fake).await, Some(auth)).await;
    // A success forgets earlier failures.
    for _ in 0..(automaton_console::MAX_FAILURES - 1) {
        let r = http(addr, "POST", "/login", &form_headers(""), "token=guess").await;
        assert_eq!(status(&r), 403, "{r}");
    }
    let r = http(addr, "POST", "/login", &form_headers(""), "token=good").await;
    assert_eq!(status(&r), 303, "{r}");
    for i in 0..automaton_console::MAX_FAILURES {
        let r = http(addr, "POST", "/login", &form_headers(""), "token=guess").await;
        assert_eq!(status(&r), 403, "attempt {i}: {r}");
        assert!(r.contains("unknown token"), "{r}");
    }
    for token in ["guess", "good"] {
        let r = http(
            addr,
            "POST",
            "/login",
            &form_headers(""),
            &format!("token={token}"),
        )
        .await;
        assert_eq!(status(&r), 429, "{token}: {r}");
        let retry: u64 = r
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("retry-after:")
                    .map(|v| v.trim().to_string())
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("a Retry-After header: {r}"));
        assert!((1..=60).contains(&retry), "{retry}");
        assert!(
            r.contains("too many refused sign-ins from your address: try again in"),
            "{r}"
        );
        assert!(!r.to_ascii_lowercase().contains("set-cookie"), "{r}");
    }
}

/// Open boards share one task list: a second board with no event since the first asks the
/// coordinator nothing new; an event (or a second's age) makes the next board fetch afresh.
#[tokio::test]
async fn boards_share_one_task_list_until_an_event() {
    let (fake, calls) = fake();
    let events = fake.events.clone();
    let (addr, _stop) = console(coordinator(fake).await, None).await;
    let list_calls = || {
        calls
            .lock()
            .expect("calls")
            .iter()
            .filter(|c| c.starts_with("list_tasks"))
            .count()
    };
    // The feed is up (it counts changes from here on).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !calls
        .lock()
        .expect("calls")
        .iter()
        .any(|c| c.starts_with("watch_events"))
    {
        assert!(tokio::time::Instant::now() < deadline, "no feed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The feed counts its (re)connection as a change once its stream is open.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for path in [
        "/board",
        "/board?fragment=1",
        "/board?needs=person&fragment=1",
    ] {
        let r = http(addr, "GET", path, "", "").await;
        assert_eq!(status(&r), 200, "{r}");
        assert!(r.contains("data-task=\"shop/api\""), "{r}");
    }
    assert_eq!(list_calls(), 1);
    // An event reaches the console (seen on a page's stream): the next board fetches.
    let sender = events.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let _ = sender.send(pb::Event {
            seq: 1,
            kind: "transitioned".into(),
            task: "shop".into(),
            ..Default::default()
        });
    });
    stream_until(addr, "/events", "", "\"kind\":\"transitioned\"").await;
    http(addr, "GET", "/board?fragment=1", "", "").await;
    assert_eq!(list_calls(), 2);
    http(addr, "GET", "/board?fragment=1", "", "").await;
    assert_eq!(list_calls(), 2);
    // Without events, a list is reused for a second at most.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    http(addr, "GET", "/board", "", "").await;
    assert_eq!(list_calls(), 3);
}

/// Issue 30 (DNS rebinding): without tokens, a request that names the console by another
/// name — `Host` or `Origin` of `attacker.example` resolving to 127.0.0.1 — is refused 403
/// with one line on every route, pages, streams, static files and actions alike, and no call
/// reaches the coordinator; `127.0.0.1:PORT`, `localhost:PORT` and `[::1]:PORT` still work.
#[tokio::test]
async fn no_tokens_refuses_a_rebound_host_or_origin_on_every_request() {
    let (fake, calls) = fake();
    let (addr, _stop) = console(coordinator(fake).await, None).await;
    let port = addr.port();
    let page = http(addr, "GET", "/task/shop/api", "", "").await;
    let token = csrf(&page);
    let before = calls.lock().expect("calls").len();
    let evil = format!("attacker.example:{port}");
    let evil_origin = format!("Origin: http://attacker.example:{port}\r\n");
    let approve = format!("task=shop%2Fapi&csrf={token}");
    for (host, method, path, extra, body) in [
        (evil.as_str(), "GET", "/fleet", "", ""),
        (evil.as_str(), "GET", "/board", "", ""),
        (evil.as_str(), "GET", "/events", "", ""),
        (evil.as_str(), "GET", "/output/shop/api", "", ""),
        (evil.as_str(), "GET", "/static/console.js", "", ""),
        (evil.as_str(), "GET", "/nowhere", "", ""),
        (
            evil.as_str(),
            "POST",
            "/action/approve",
            evil_origin.as_str(),
            approve.as_str(),
        ),
        (
            evil.as_str(),
            "POST",
            "/action/drain",
            evil_origin.as_str(),
            "worker=gpu-a",
        ),
        (
            &addr.to_string(),
            "POST",
            "/action/approve",
            evil_origin.as_str(),
            approve.as_str(),
        ),
        (&addr.to_string(), "GET", "/fleet", evil_origin.as_str(), ""),
    ] {
        let headers = format!("Content-Type: application/x-www-form-urlencoded\r\n{extra}");
        let r = http_to(addr, host, method, path, &headers, body).await;
        assert_eq!(status(&r), 403, "{host} {method} {path}: {r}");
        assert!(
            r.contains(&format!(
                "this console has no tokens, so it answers only requests to localhost, 127.0.0.1 or [::1] on port {port}"
            )),
            "{r}"
        );
        assert!(!r.contains("gpu-a\""), "nothing of the fleet shown: {r}");
    }
    assert_eq!(
        calls.lock().expect("calls").len(),
        before,
        "no refused request reached the coordinator"
    );
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("LocalHost:{port}"),
    ] {
        let r = http_to(addr, &host, "GET", "/fleet", "", "").await;
        assert_eq!(status(&r), 200, "{host}: {r}");
        let origin = format!("{}Origin: http://{host}\r\n", form_headers(""));
        let r = http_to(addr, &host, "POST", "/action/approve", &origin, &approve).await;
        assert_eq!(status(&r), 303, "{host}: {r}");
    }
}

/// Sends `GET path` with `headers` and reads up to the end of the response's headers; the
/// socket is left open, nothing more read. When the answer is not 200: its status line,
/// headers and body as text.
async fn open_stream(addr: SocketAddr, path: &str, headers: &str) -> Result<TcpStream, String> {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{headers}\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    let mut byte = [0u8; 1];
    while !seen.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .expect("headers in time")
            .expect("read");
        if n == 0 {
            break;
        }
        seen.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&seen).into_owned();
    if status(&head) == 200 {
        return Ok(s);
    }
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    Err(format!("{head}{}", String::from_utf8_lossy(&rest)))
}

/// Signs in with the fake's good token; the `Cookie:` header line of the new session.
async fn sign_in(addr: SocketAddr) -> String {
    let r = http(addr, "POST", "/login", &form_headers(""), "token=good").await;
    let id = r
        .lines()
        .find_map(|l| l.split_once("automaton_console="))
        .and_then(|(_, v)| v.split(';').next())
        .unwrap_or_else(|| panic!("a session cookie: {r}"))
        .to_string();
    format!("Cookie: automaton_console={id}\r\n")
}

/// Issue 30: live streams are capped per signed-in session: past the cap a stream (events or
/// output) is refused 429 with one line, another session is not affected, and a closed
/// stream frees its place.
#[tokio::test]
async fn live_streams_are_capped_per_session_and_the_next_is_429() {
    let (fake, _) = fake();
    let auth: Arc<dyn Authenticate> = Arc::new(Tokens);
    let limits = StreamLimits {
        per_session: 2,
        ..StreamLimits::default()
    };
    let (addr, _stop) = console_limited(coordinator(fake).await, Some(auth), None, limits).await;
    let ann = sign_in(addr).await;
    let other = sign_in(addr).await;
    let first = open_stream(addr, "/events", &ann)
        .await
        .expect("first stream");
    let _second = open_stream(addr, "/events", &ann)
        .await
        .expect("second stream");
    for path in ["/events", "/output/shop/api"] {
        let refused = open_stream(addr, path, &ann)
            .await
            .expect_err("over the cap");
        assert_eq!(status(&refused), 429, "{refused}");
        assert!(
            refused.contains(
                "too many live streams open for this session (2 at most, web_max_streams)"
            ),
            "{refused}"
        );
    }
    let _theirs = open_stream(addr, "/events", &other)
        .await
        .expect("another session has its own places");
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match open_stream(addr, "/events", &ann).await {
            Ok(_) => break,
            Err(r) => {
                assert_eq!(status(&r), 429, "{r}");
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "a closed stream frees its place"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Issue 30: a client that opens `/events` and never reads is cut once a write to it has
/// made no progress for the stall timeout (its place is free again, its connection closed),
/// while the console keeps answering everyone else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_events_reader_is_cut_after_the_stall_timeout_while_pages_answer() {
    let (fake, _) = fake();
    let events = fake.events.clone();
    let stall = Duration::from_secs(1);
    let limits = StreamLimits {
        per_session: 1,
        stall_timeout: stall,
    };
    let (addr, _stop) = console_limited(coordinator(fake).await, None, None, limits).await;
    // A reader with a small receive buffer that reads nothing past the headers.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stalled = socket.connect(addr).await.expect("connect");
    let req = format!("GET /events HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    stalled.write_all(req.as_bytes()).await.expect("write");
    let mut head = [0u8; 64];
    let n = stalled.read(&mut head).await.expect("the headers");
    assert!(String::from_utf8_lossy(&head[..n]).starts_with("HTTP/1.1 200"));
    // 16 MiB of events: more than the kernel's buffers and hyper's hold together.
    let detail = "x".repeat(256 * 1024);
    for seq in 0..64 {
        let _ = events.send(pb::Event {
            seq,
            kind: "transitioned".into(),
            task: "shop".into(),
            detail: detail.clone(),
            ..Default::default()
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let sent = std::time::Instant::now();
    // The stalled stream holds the one place; the console still answers pages.
    let refused = open_stream(addr, "/events", "")
        .await
        .expect_err("the place is held");
    assert_eq!(status(&refused), 429, "{refused}");
    let board = http(addr, "GET", "/board", "", "").await;
    assert_eq!(status(&board), 200, "{board}");
    // Within the stall timeout (and some slack) the stalled stream is dropped: its place is
    // free.
    loop {
        match open_stream(addr, "/events", "").await {
            Ok(_) => break,
            Err(r) => {
                assert_eq!(status(&r), 429, "{r}");
                assert!(
                    sent.elapsed() < stall + Duration::from_secs(3),
                    "the stalled stream still holds its place after {:?}",
                    sent.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    // And its connection is closed: what was buffered, then the end.
    let mut rest = Vec::new();
    let drained =
        tokio::time::timeout(Duration::from_secs(10), stalled.read_to_end(&mut rest)).await;
    assert!(drained.is_ok(), "the stalled connection was closed");
}

/// The board shows a finished task's delivery in a few words (awaiting approval, merged at a
/// short commit); its page shows the record's facts with Deliver and Abandon, and its change
/// per file and hunk, every line escaped (a `<script>` in a line and in a file name is text,
/// a control character shown as its code point). The change is read with the page, not with
/// each refresh.
#[tokio::test]
async fn board_and_task_page_show_the_delivery_and_the_change_escaped() {
    let (fake, calls) = fake();
    let (addr, _stop) = console(coordinator(fake).await, None).await;
    let board = http(addr, "GET", "/board", "", "").await;
    assert_eq!(status(&board), 200, "{board}");
    assert!(
        board.contains(
            "<div class=\"delivery\" data-state=\"requested\">awaiting approval to land on main</div>"
        ),
        "{board}"
    );
    assert!(
        board.contains("merged into main at abc123def456 (merge commit)"),
        "{board}"
    );
    // A delivery that waits for an operator needs a person.
    let needs = http(addr, "GET", "/board?needs=person&fragment=1", "", "").await;
    assert!(needs.contains("data-task=\"cart\""), "{needs}");
    assert!(!needs.contains("data-task=\"landed\""), "{needs}");

    let page = http(addr, "GET", "/task/cart", "", "").await;
    assert_eq!(status(&page), 200, "{page}");
    for want in [
        "<section id=\"delivery\" class=\"delivery\" data-state=\"requested\">",
        "<dt>branch</dt><dd class=\"branch\">automaton/cart</dd>",
        "<dt>revision</dt><dd class=\"revision\">0123456789abcdef0123456789abcdef01234567</dd>",
        "<dt>requested</dt><dd class=\"requested\">2023-11-14T22:13:20Z",
        "id=\"deliver\"",
        "id=\"abandon\"",
        "<section id=\"change\"><h2>Change</h2>",
        "<code class=\"base\" title=\"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\">aaaaaaaaaaaa</code> → <code class=\"head\" title=\"0123456789abcdef0123456789abcdef01234567\">0123456789ab</code>",
        "<article class=\"file\" id=\"file-0\" data-file=\"src/cart.rs\"><h3 class=\"file-name\">src/cart.rs</h3>",
        "<pre class=\"hunk-header\">@@ -1,2 +1,3 @@</pre>",
        "<span class=\"line ctx\"> fn total() {}</span>",
        "<span class=\"line del\">-// old &lt;b&gt;</span>",
        "<span class=\"line add\">+// &lt;script&gt;alert(1)&lt;/script&gt;</span>",
        "<span class=\"line add\">+let red = &quot;<span class=\"ctl\">U+001B</span>[31m&quot;;</span>",
        "data-file=\"&lt;script&gt;alert(1)&lt;/script&gt;.js\"><h3 class=\"file-name\">&lt;script&gt;alert(1)&lt;/script&gt;.js</h3>",
    ] {
        assert!(page.contains(want), "{want}: {page}");
    }
    assert_eq!(page.matches("<article class=\"file\"").count(), 2, "{page}");
    assert_eq!(page.matches("<div class=\"hunk\">").count(), 2, "{page}");
    assert!(!page.contains("<script>alert"), "{page}");
    assert!(!page.contains('\u{1b}'), "{page}");
    assert!(!page.contains("class=\"cut\""), "{page}");
    // The refreshed part carries the delivery, not the change (nor asks for it).
    let fragment = http(addr, "GET", "/task/cart?fragment=1", "", "").await;
    assert!(fragment.contains("id=\"delivery\""), "{fragment}");
    assert!(!fragment.contains("id=\"change\""), "{fragment}");
    let calls = calls.lock().expect("calls").clone();
    assert!(
        calls.contains(&"get_task cart changes=true -".to_string()),
        "{calls:?}"
    );
    assert!(
        calls.contains(&"get_task cart changes=false -".to_string()),
        "{calls:?}"
    );
    // A task without a change says so in one line.
    let page = http(addr, "GET", "/task/shop/api", "", "").await;
    assert!(
        page.contains("<p class=\"empty\">no change to show: the task has no branch yet"),
        "{page}"
    );
    assert!(!page.contains("id=\"delivery\""), "{page}");
}

/// A change past what a page shows is cut (at most `LINES_SHOWN` lines), with a note that the
/// whole change is on the task's branch.
#[tokio::test]
async fn a_huge_change_is_cut_with_a_note_naming_the_branch() {
    let (fake, _) = fake();
    let (addr, _stop) = console(coordinator(fake).await, None).await;
    let page = http(addr, "GET", "/task/huge", "", "").await;
    assert_eq!(status(&page), 200, "{page}");
    let shown = page.matches("<span class=\"line add\">").count();
    assert!(shown > 0 && shown < 300 * 50, "{shown}");
    assert!(
        page.contains("<p class=\"cut\">cut: the whole change is on branch <code>automaton/huge</code> (300 files"),
        "{}",
        &page[page.len().saturating_sub(2000)..]
    );
    // The cut files are still listed, without a link.
    assert!(
        page.contains("<span class=\"cut-file\">f99.rs</span>"),
        "cut files named"
    );
    assert!(!page.contains("f150.rs"), "the list is bounded too");
}

/// Deliver and Abandon on a task's page POST to `/action/deliver` and `/action/abandon`,
/// which call `Deliver` and `Abandon` with the task (and the reason) and the signed-in
/// operator's token, then go back to the page; the coordinator's refusal is its one line;
/// a wrong CSRF token or another site reaches no RPC.
#[tokio::test]
async fn deliver_and_abandon_buttons_call_the_rpcs_as_the_signed_in_operator() {
    let (fake, calls) = fake();
    let auth: Arc<dyn Authenticate> = Arc::new(Tokens);
    let (addr, _stop) = console(coordinator(fake).await, Some(auth)).await;
    let cookie = sign_in(addr).await;
    let page = http(addr, "GET", "/task/cart", &cookie, "").await;
    assert_eq!(status(&page), 200, "{page}");
    assert!(page.contains("action=\"/action/deliver\""), "{page}");
    assert!(page.contains("action=\"/action/abandon\""), "{page}");
    let token = csrf(&page);
    let count = |prefix: &str| {
        calls
            .lock()
            .expect("calls")
            .iter()
            .filter(|c| c.starts_with(prefix))
            .count()
    };

    for (body, extra) in [
        ("task=cart&csrf=wrong".to_string(), ""),
        (
            format!("task=cart&csrf={token}"),
            "Sec-Fetch-Site: cross-site\r\n",
        ),
        (
            format!("task=cart&csrf={token}"),
            "Origin: http://evil.example\r\n",
        ),
    ] {
        for action in ["/action/deliver", "/action/abandon"] {
            let headers = format!("{}{extra}", form_headers(&cookie));
            let r = http(addr, "POST", action, &headers, &body).await;
            assert_eq!(status(&r), 403, "{action} {body} {extra}: {r}");
            assert!(r.contains("missing or wrong CSRF token"), "{r}");
        }
    }
    assert_eq!(
        count("deliver") + count("abandon"),
        0,
        "no refused POST reached an RPC"
    );

    let body = format!("task=cart&csrf={token}&back=%2Ftask%2Fcart");
    let r = http(
        addr,
        "POST",
        "/action/deliver",
        &form_headers(&cookie),
        &body,
    )
    .await;
    assert_eq!(status(&r), 303, "{r}");
    assert!(
        r.to_ascii_lowercase().contains("location: /task/cart"),
        "{r}"
    );
    assert!(
        calls
            .lock()
            .expect("calls")
            .contains(&"deliver cart Bearer good".to_string()),
        "{:?}",
        calls.lock().expect("calls")
    );

    let body =
        format!("task=cart&csrf={token}&back=%2Ftask%2Fcart&reason=+superseded+by+%3Cb%3Ecart-2+");
    let r = http(
        addr,
        "POST",
        "/action/abandon",
        &form_headers(&cookie),
        &body,
    )
    .await;
    assert_eq!(status(&r), 303, "{r}");
    assert!(
        calls
            .lock()
            .expect("calls")
            .contains(&"abandon cart reason=superseded by <b>cart-2 Bearer good".to_string()),
        "{:?}",
        calls.lock().expect("calls")
    );

    // The coordinator refuses: its one line, as every action shows it.
    let body = format!("task=shop%2Fapi&csrf={token}&back=%2Ftask%2Fshop%2Fapi");
    let r = http(
        addr,
        "POST",
        "/action/deliver",
        &form_headers(&cookie),
        &body,
    )
    .await;
    assert_eq!(status(&r), 409, "{r}");
    assert!(
        r.contains("<p id=\"action-error\" class=\"error\">shop/api is design:awaiting_approval: its delivery starts when it is complete</p>"),
        "{r}"
    );
    let r = http(
        addr,
        "POST",
        "/action/abandon",
        &form_headers(&cookie),
        &body,
    )
    .await;
    assert_eq!(status(&r), 409, "{r}");
    assert!(r.contains("shop/api has no delivery to abandon"), "{r}");
    // No task named: the console's own line, no call.
    let before = count("deliver");
    let r = http(
        addr,
        "POST",
        "/action/deliver",
        &form_headers(&cookie),
        &format!("csrf={token}"),
    )
    .await;
    assert_eq!(status(&r), 400, "{r}");
    assert!(r.contains("no task named"), "{r}");
    assert_eq!(count("deliver"), before);
}

/// Without a signed-in operator's session the task page is the sign-in page (no Deliver or
/// Abandon button), and a POST to either action, even with a real session's CSRF token, is
/// refused 401 before any call.
#[tokio::test]
async fn without_an_operator_session_no_delivery_buttons_and_their_posts_are_refused() {
    let (fake, calls) = fake();
    let auth: Arc<dyn Authenticate> = Arc::new(Tokens);
    let (addr, _stop) = console(coordinator(fake).await, Some(auth)).await;
    let page = http(addr, "GET", "/task/cart", "", "").await;
    assert_eq!(status(&page), 303, "{page}");
    assert!(
        page.to_ascii_lowercase().contains("location: /login"),
        "{page}"
    );
    assert!(!page.contains("/action/deliver") && !page.contains("/action/abandon"));
    // An agent's token does not sign in, so it never gets a page with the buttons.
    let r = http(addr, "POST", "/login", &form_headers(""), "token=agent").await;
    assert_eq!(status(&r), 403, "{r}");
    assert!(!r.to_ascii_lowercase().contains("set-cookie"), "{r}");

    let cookie = sign_in(addr).await;
    let token = csrf(&http(addr, "GET", "/task/cart", &cookie, "").await);
    for action in ["/action/deliver", "/action/abandon"] {
        let body = format!("task=cart&csrf={token}&reason=x");
        let r = http(addr, "POST", action, &form_headers(""), &body).await;
        assert_eq!(status(&r), 401, "{action}: {r}");
        assert!(r.contains("sign in first"), "{r}");
        let r = http(
            addr,
            "POST",
            action,
            &form_headers("Cookie: automaton_console=0000\r\n"),
            &body,
        )
        .await;
        assert_eq!(status(&r), 401, "{action}: {r}");
    }
    assert!(
        !calls
            .lock()
            .expect("calls")
            .iter()
            .any(|c| c.starts_with("deliver") || c.starts_with("abandon")),
        "no RPC was called"
    );
}

/// Issue 36: every live page (board, fleet, task) has the header's status — the connection
/// and the data's freshness apart — and each refreshable part, whole page or fragment, says
/// how old its data was when sent and where the feed stood when it was fetched (a stream
/// opened `?after=` an older count is told to refresh at once); a page that does not update
/// itself has no such status.
#[tokio::test]
async fn live_pages_say_connection_and_freshness_and_each_part_its_datas_age() {
    let (fake, _) = fake();
    let (addr, _stop) = console(coordinator(fake).await, None).await;
    for (path, part) in [
        ("/board", "<section id=\"board\" data-age-ms=\""),
        ("/fleet", "<section id=\"fleet\" data-age-ms=\""),
        (
            "/task/shop/api",
            "<section id=\"task-facts\" data-age-ms=\"",
        ),
    ] {
        let page = http(addr, "GET", path, "", "").await;
        assert_eq!(status(&page), 200, "{page}");
        assert!(page.contains("<div id=\"liveness\""), "{path}: {page}");
        assert!(
            page.contains("<span id=\"connection\" role=\"status\""),
            "{path}: {page}"
        );
        assert!(page.contains("<span id=\"age\" role=\"timer\">"), "{path}");
        assert!(page.contains(part), "{path}: {page}");
        let fragment = http(addr, "GET", &format!("{path}?fragment=1"), "", "").await;
        let body = fragment.split("\r\n\r\n").nth(1).unwrap_or("");
        assert!(body.starts_with(part), "{path}: {fragment}");
        assert!(!body.contains("liveness"), "{path}: {fragment}");
    }
    let missing = http(addr, "GET", "/task/nope", "", "").await;
    assert_eq!(status(&missing), 404, "{missing}");
    assert!(!missing.contains("liveness"), "{missing}");
    // Where the feed stood when the data was fetched: a page whose count is behind is told
    // at once, before anything else, to refresh.
    let board = http(addr, "GET", "/board", "", "").await;
    let at = board.find("data-changes=\"").expect("data-changes") + 14;
    let n: u64 = board[at..]
        .split('"')
        .next()
        .and_then(|n| n.parse().ok())
        .expect("a count");
    let behind = format!("/events?after={}", n + 1000);
    let told = stream_until(addr, &behind, "", "\n\n").await;
    assert!(
        told.contains("event: change\ndata: {\"kind\":\"resync\"}"),
        "{told}"
    );
}

/// Issue 36: a page's `/events` says `alive` at once and every 2 s with the feed's state
/// (`up` once the console watches the coordinator's events), which is how a page knows its
/// data is still current when nothing changes; and `HEAD /events` answers as a stream's opening would —
/// 200 (its place given back at once), 401 without a session, 429 past `web_max_streams` —
/// which is how a page whose stream broke learns why.
#[tokio::test]
async fn events_say_alive_with_the_feed_up_and_head_events_says_whether_a_stream_would_open() {
    let (fake, _) = fake();
    let auth: Arc<dyn Authenticate> = Arc::new(Tokens);
    let limits = StreamLimits {
        per_session: 1,
        ..StreamLimits::default()
    };
    let (addr, _stop) = console_limited(coordinator(fake).await, Some(auth), None, limits).await;
    let r = http(addr, "HEAD", "/events", "", "").await;
    assert_eq!(status(&r), 401, "{r}");
    let ann = sign_in(addr).await;
    for _ in 0..3 {
        let r = http(addr, "HEAD", "/events", &ann, "").await;
        assert_eq!(status(&r), 200, "{r}");
        assert!(r.contains("text/event-stream"), "{r}");
        assert!(r.ends_with("\r\n\r\n"), "no body: {r}");
    }
    let feed = stream_until(addr, "/events", &ann, r#""feed":"up""#).await;
    assert!(feed.contains("event: alive"), "{feed}");
    let _held = open_stream(addr, "/events", &ann)
        .await
        .expect("the one place");
    let r = http(addr, "HEAD", "/events", &ann, "").await;
    assert_eq!(status(&r), 429, "{r}");
}

/// Issue 36, connected but not current: a console that cannot reach the coordinator's event
/// stream keeps a page's stream open and says on it, at once and every 2 s, that the feed is
/// down and why — the page shows itself connected to the console with data it cannot vouch
/// for.
#[tokio::test]
async fn a_console_without_the_coordinators_events_says_the_feed_is_down_and_why() {
    let channel = tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy();
    let (addr, _stop) = console(channel, None).await;
    let feed = stream_until(addr, "/events", "", r#""feed":"down""#).await;
    let line = feed
        .lines()
        .find(|l| l.contains(r#""feed":"down""#))
        .expect("the alive event's data");
    let v: serde_json::Value =
        serde_json::from_str(line.trim_start_matches("data:").trim()).expect("JSON");
    let why = v["why"].as_str().expect("why");
    assert!(!why.is_empty() && !why.contains('\n'), "{why}");
    assert!(feed.contains("event: alive"), "{feed}");
}
