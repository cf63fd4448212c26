//! The routes: who may see a page (a session, or loopback in no-auth mode, where every
//! request must also name this console by a loopback name), the CSRF and cross-site checks
//! of every POST, the live streams' bound per session, and the calls each page and button
//! makes.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use automaton_proto::v1 as pb;
use axum::Router;
use axum::extract::{ConnectInfo, Form, Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use futures_util::Stream;
use serde::Deserialize;
use tokio::sync::{Notify, broadcast, watch};

use crate::grpc::{self, Stamp};
use crate::limit::SignInLimit;
use crate::render::{self, BoardFilter, TaskView};
use crate::session::{self, Sessions};
use crate::streams::{Held, Holder, Slots};
use crate::{Authenticate, Options};

/// The security headers of every response.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'";
/// What a refused POST says.
pub const CSRF_REFUSED: &str = "missing or wrong CSRF token: reload the page and try again";
/// What a non-loopback peer is told in no-auth mode.
pub const LOOPBACK_ONLY: &str = "the coordinator has no tokens, so its console serves this machine (loopback) only: configure operator tokens to sign in from elsewhere";
/// How often an idle event stream gets a keep-alive comment.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// How many events the shared feed buffers for slow pages before they are told to reload.
pub const FEED_BUFFER: usize = 256;
/// How much of a run's kept output a new output panel starts with.
pub const OUTPUT_TAIL_BYTES: u64 = 64 * 1024;
/// Why the feed is down before it first opens.
pub const FEED_CONNECTING: &str = "connecting to the coordinator's event stream";
/// How long the board's task list may be reused when no event has arrived since it was
/// fetched (the bound on its age when the feed is down).
pub const TASKS_REUSE: Duration = Duration::from_secs(1);

/// The task list as last fetched for a board, and where the feed stood then.
pub(crate) struct TasksSnapshot {
    changes: u64,
    at: Instant,
    tasks: Arc<Vec<pb::TaskSummary>>,
}

/// A board's task list, when it was fetched, and the feed's count of changes then.
type BoardTasks = (Arc<Vec<pb::TaskSummary>>, Instant, u64);

/// What every handler shares.
pub(crate) struct App {
    pub channel: tonic::transport::Channel,
    pub auth: Option<Arc<dyn Authenticate>>,
    pub project: String,
    /// A trace UI URL with `{trace_id}`: each run's trace id on a task page links there.
    pub trace_url: Option<String>,
    /// Mark the cookie `Secure` (https).
    pub secure: bool,
    pub sessions: Mutex<Sessions>,
    /// Refused sign-ins by client address (guessing tokens is throttled).
    pub sign_in_limit: Mutex<SignInLimit>,
    /// The CSRF token of every page in no-auth mode (per process).
    pub csrf_secret: String,
    /// The shared event feed: JSON of each event, fanned out to every `/events` page.
    pub events: broadcast::Sender<String>,
    /// Why the shared feed is down (`None` while it is up): each page's stream says it with
    /// every `alive` event, so a page connected to a console that lost the coordinator's
    /// events does not take its quiet for "nothing changed".
    pub feed_down: watch::Sender<Option<String>>,
    /// Someone signed in: the feed may have a token to watch with now.
    pub signed_in: Notify,
    /// Events the feed has passed on (and its reconnects): a task list fetched before the
    /// latest one is out of date.
    pub changes: AtomicU64,
    /// The board's last task list, shared by every page: after an event, each open board
    /// re-fetches, and one `ListTasks` answers them all. The lock makes concurrent fetches
    /// one.
    pub tasks: tokio::sync::Mutex<Option<TasksSnapshot>>,
    /// Becomes true at shutdown: streams end.
    pub stop: watch::Receiver<bool>,
    /// The address the console listens on: without tokens, requests must name it.
    pub local: SocketAddr,
    /// The live streams each session (or client address) holds open.
    pub slots: Slots,
}

impl App {
    pub fn new(
        opts: Options,
        local: SocketAddr,
        stop: watch::Receiver<bool>,
    ) -> Result<App, String> {
        let (events, _) = broadcast::channel(FEED_BUFFER);
        Ok(App {
            channel: opts.channel,
            auth: opts.auth,
            project: opts.project,
            trace_url: opts.trace_url,
            secure: opts.tls.is_some(),
            sessions: Mutex::new(Sessions::new(session::MAX_SESSIONS)),
            sign_in_limit: Mutex::new(SignInLimit::new()),
            csrf_secret: session::random_hex(32)?,
            events,
            feed_down: watch::channel(Some(FEED_CONNECTING.to_string())).0,
            signed_in: Notify::new(),
            changes: AtomicU64::new(0),
            tasks: tokio::sync::Mutex::new(None),
            stop,
            local,
            slots: Slots::new(opts.streams.per_session),
        })
    }

    pub fn sessions(&self) -> MutexGuard<'_, Sessions> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn sign_in_limit(&self) -> MutexGuard<'_, SignInLimit> {
        self.sign_in_limit.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The feed saw a change (or reconnected): shared task lists are out of date.
    pub fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// The task list for a board: the shared one while no change has come since it was
    /// fetched (for at most [`TASKS_REUSE`]), else a fresh `ListTasks` with `stamp`; with
    /// when it was fetched and the feed's count of changes then. Every caller here is a
    /// signed-in operator (or loopback without tokens), and operators all see the same list.
    async fn board_tasks(&self, stamp: Stamp) -> Result<BoardTasks, tonic::Status> {
        let mut shared = self.tasks.lock().await;
        let changes = self.changes.load(Ordering::Acquire);
        if let Some(s) = shared.as_ref()
            && s.changes == changes
            && s.at.elapsed() < TASKS_REUSE
        {
            return Ok((s.tasks.clone(), s.at, s.changes));
        }
        let tasks = Arc::new(
            grpc::tasks(&self.channel, stamp)
                .list_tasks(pb::ListTasksRequest {})
                .await?
                .into_inner()
                .tasks,
        );
        let at = Instant::now();
        *shared = Some(TasksSnapshot {
            changes,
            at,
            tasks: tasks.clone(),
        });
        Ok((tasks, at, changes))
    }
}

/// Who a request is for: the signed-in operator (or nobody in no-auth mode), the token their
/// calls carry and the CSRF token their forms carry.
#[derive(Clone, Debug)]
pub(crate) struct Caller {
    pub operator: Option<String>,
    pub token: Option<String>,
    pub csrf: String,
    /// Whose count its live streams go to.
    pub holder: Holder,
}

impl Caller {
    fn stamp(&self, deadline: Option<Duration>) -> Result<Stamp, Denied> {
        Stamp::new(self.token.as_deref(), deadline)
            .map_err(|e| Denied::Refused(StatusCode::FORBIDDEN, e))
    }
}

/// Why a request is not served.
#[derive(Debug)]
enum Denied {
    /// A page without a session: to the sign-in page.
    SignIn,
    /// A stream or action without a session.
    Unauthenticated,
    /// Anything else, with its one line.
    Refused(StatusCode, String),
}

impl IntoResponse for Denied {
    fn into_response(self) -> Response {
        match self {
            Denied::SignIn => Redirect::to("/login").into_response(),
            Denied::Unauthenticated => plain(StatusCode::UNAUTHORIZED, "sign in first: /login"),
            Denied::Refused(code, line) => plain(code, &line),
        }
    }
}

/// What a request without a session gets: pages a redirect, the rest a 401.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Want {
    Page,
    Api,
}

/// A peer is on this machine (IPv4-mapped IPv6 included).
pub fn is_loopback(peer: &SocketAddr) -> bool {
    peer.ip().to_canonical().is_loopback()
}

/// The request says it comes from another site: `Sec-Fetch-Site` other than `same-origin`
/// or `none`, or an `Origin` whose host is not this `Host`.
pub fn cross_site(headers: &HeaderMap) -> bool {
    if let Some(site) = headers.get("sec-fetch-site") {
        match site.to_str() {
            Ok("same-origin") | Ok("none") => {}
            _ => return true,
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let Ok(origin) = origin.to_str() else {
            return true;
        };
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        let authority = origin.split_once("://").map(|(_, a)| a).unwrap_or("");
        if authority.is_empty() || !authority.eq_ignore_ascii_case(host) {
            return true;
        }
    }
    false
}

/// A POST may go on: same-site, and its CSRF field is the caller's (constant-time).
pub fn csrf_ok(headers: &HeaderMap, expected: &str, given: &str) -> bool {
    !cross_site(headers)
        && !expected.is_empty()
        && session::constant_time_eq(expected.as_bytes(), given.as_bytes())
}

/// A local path to go back to after an action; anything else goes to the board. No
/// control character or whitespace at all: browsers drop a TAB or a newline from a
/// `Location`, so `/\t/evil.example/` would be `//evil.example/`, another site.
pub fn safe_back(back: &str) -> &str {
    let local = back.starts_with('/')
        && !back.starts_with("//")
        && !back
            .chars()
            .any(|c| c == '\\' || c.is_control() || c.is_whitespace());
    if local { back } else { "/board" }
}

/// Without tokens, a request must name this console by a loopback name: `Host` (and
/// `Origin`, when sent) is `localhost`, `127.0.0.1`, `[::1]` or the console's own loopback
/// address, with its port (bare on the scheme's default port). A page of another site whose
/// name resolves to 127.0.0.1 (DNS rebinding) sends its own name, so it is refused: else it
/// could read every page, take the CSRF token and press every button. `Err` is the line
/// shown (403).
pub fn loopback_named(headers: &HeaderMap, local: SocketAddr, secure: bool) -> Result<(), String> {
    let scheme = if secure { "https" } else { "http" };
    let port = local.port();
    let refuse = |what: &str, value: &str| {
        let shown: String = value.chars().take(80).collect();
        Err(format!(
            "this console has no tokens, so it answers only requests to localhost, 127.0.0.1 or [::1] on port {port}; {what} was '{shown}': open {scheme}://127.0.0.1:{port}/ (or configure operator tokens)"
        ))
    };
    let named = |authority: &str| {
        let (host, given_port) = match authority.rsplit_once(':') {
            Some((h, p))
                if !authority.ends_with(']') && (h.starts_with('[') || !h.contains(':')) =>
            {
                (h, p.parse::<u16>().ok())
            }
            _ => (authority, Some(if secure { 443 } else { 80 })),
        };
        let own = match local.ip() {
            std::net::IpAddr::V4(ip) => ip.to_string(),
            std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        };
        given_port == Some(port)
            && (host.eq_ignore_ascii_case("localhost")
                || host == "127.0.0.1"
                || host == "[::1]"
                || (local.ip().is_loopback() && host == own))
    };
    let one = |name: header::HeaderName| -> Result<Option<String>, String> {
        let mut all = headers.get_all(&name).iter();
        let first = all.next();
        if all.next().is_some() {
            return Err(format!("more than one {name} header"));
        }
        match first.map(|v| v.to_str()) {
            None => Ok(None),
            Some(Ok(v)) => Ok(Some(v.to_string())),
            Some(Err(_)) => Err(format!("{name} is not text")),
        }
    };
    let host = match one(header::HOST) {
        Ok(Some(h)) => h,
        Ok(None) => return refuse("Host", "(none)"),
        Err(e) => return refuse("the request", &e),
    };
    if !named(&host) {
        return refuse("Host", &host);
    }
    match one(header::ORIGIN) {
        Ok(None) => Ok(()),
        Ok(Some(origin)) => {
            let authority = origin
                .strip_prefix(scheme)
                .and_then(|r| r.strip_prefix("://"));
            match authority {
                Some(a) if named(a) => Ok(()),
                _ => refuse("Origin", &origin),
            }
        }
        Err(e) => refuse("the request", &e),
    }
}

/// Without tokens, every request (pages, streams, actions, static files) is checked before
/// any route runs: a loopback peer that names this console by a loopback name.
async fn loopback_only(
    State(app): State<Arc<App>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if app.auth.is_none() {
        let peer = req
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        if !peer.is_some_and(|p| is_loopback(&p)) {
            return plain(StatusCode::FORBIDDEN, LOOPBACK_ONLY);
        }
        if let Err(why) = loopback_named(req.headers(), app.local, app.secure) {
            return plain(StatusCode::FORBIDDEN, &why);
        }
    }
    next.run(req).await
}

/// [`caller`] and the stamp its gRPC calls carry (`deadline` on each unary call).
fn calling(
    app: &App,
    headers: &HeaderMap,
    peer: &SocketAddr,
    want: Want,
    deadline: Option<Duration>,
) -> Result<(Caller, Stamp), Denied> {
    let c = caller(app, headers, peer, want)?;
    let stamp = c.stamp(deadline)?;
    Ok((c, stamp))
}

fn caller(app: &App, headers: &HeaderMap, peer: &SocketAddr, want: Want) -> Result<Caller, Denied> {
    let Some(_) = &app.auth else {
        if !is_loopback(peer) {
            return Err(Denied::Refused(StatusCode::FORBIDDEN, LOOPBACK_ONLY.into()));
        }
        return Ok(Caller {
            operator: None,
            token: None,
            csrf: app.csrf_secret.clone(),
            holder: Holder::Peer(peer.ip().to_canonical()),
        });
    };
    let session = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(session::cookie_id)
        .and_then(|id| Some((id, app.sessions().get(id, Instant::now())?)));
    match session {
        Some((id, s)) => Ok(Caller {
            operator: Some(s.operator),
            token: Some(s.token),
            csrf: s.csrf,
            holder: Holder::Session(id.to_string()),
        }),
        None if want == Want::Page => Err(Denied::SignIn),
        None => Err(Denied::Unauthenticated),
    }
}

/// The router over `app`, security headers on every response.
pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/", get(|| async { Redirect::to("/board") }))
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/board", get(board))
        .route("/fleet", get(fleet))
        .route("/task/{*name}", get(task))
        .route("/output/{*name}", get(output))
        .route("/events", get(events))
        .route("/action/{kind}", post(action))
        .route("/static/console.js", get(script))
        .route("/static/console.css", get(style))
        .fallback(|| async { html(StatusCode::NOT_FOUND, render::render_error("no such page")) })
        .with_state(app.clone())
        // Before any route: without tokens, only this machine, by a loopback name.
        .layer(axum::middleware::from_fn_with_state(app, loopback_only))
        .layer(axum::middleware::map_response(security_headers))
}

async fn security_headers(mut r: Response) -> Response {
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    r
}

fn html(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

/// A one-line refusal, as a small page.
fn plain(status: StatusCode, line: &str) -> Response {
    html(status, render::render_error(line))
}

/// A full live page for `caller`, or only the refreshable part with `?fragment=1`.
fn respond(app: &App, c: &Caller, title: &str, fragment: bool, body: String) -> Response {
    if fragment {
        return html(StatusCode::OK, body);
    }
    html(
        StatusCode::OK,
        render::live_page(
            &app.project,
            title,
            c.operator.as_deref(),
            Some(&c.csrf),
            &body,
        ),
    )
}

/// A coordinator's refusal of a page: its one line, with the matching status.
fn refused(app: &App, c: &Caller, title: &str, status: &tonic::Status) -> Response {
    let (code, msg) = grpc::http_status(status);
    let body = render::render_error(&msg);
    html(
        code,
        render::page(
            &app.project,
            title,
            c.operator.as_deref(),
            Some(&c.csrf),
            &body,
        ),
    )
}

/// A page: who asks (else the sign-in page or the refusal), `fetch` with the calls' stamp,
/// and `show` of what it fetched, as a live page titled `title` or as its refreshable part
/// (`fragment`). A coordinator's refusal is its one line, on a page titled `title`.
async fn page<T, F>(
    app: &App,
    headers: &HeaderMap,
    peer: &SocketAddr,
    title: &str,
    fragment: bool,
    fetch: impl FnOnce(Stamp) -> F,
    show: impl FnOnce(&Caller, T) -> String,
) -> Response
where
    F: Future<Output = Result<T, tonic::Status>>,
{
    let (c, stamp) = match calling(app, headers, peer, Want::Page, Some(grpc::CALL_TIMEOUT)) {
        Ok(cs) => cs,
        Err(r) => return r.into_response(),
    };
    match fetch(stamp).await {
        Ok(fetched) => {
            let body = show(&c, fetched);
            respond(app, &c, title, fragment, body)
        }
        Err(s) => refused(app, &c, title, &s),
    }
}

async fn script() -> Response {
    static_file(
        "text/javascript; charset=utf-8",
        include_str!("../static/console.js"),
    )
}

async fn style() -> Response {
    static_file(
        "text/css; charset=utf-8",
        include_str!("../static/console.css"),
    )
}

fn static_file(kind: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

// --- Sign-in --------------------------------------------------------------------------------

async fn login_page(State(app): State<Arc<App>>) -> Response {
    if app.auth.is_none() {
        return Redirect::to("/board").into_response();
    }
    html(StatusCode::OK, render::render_login(&app.project, None))
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

/// What a client past the sign-in limit is told, with the seconds to wait.
pub fn too_many_sign_ins(wait_secs: u64) -> String {
    format!(
        "too many refused sign-ins from your address: try again in {wait_secs} s (at most {} a minute)",
        crate::limit::MAX_FAILURES
    )
}

async fn login(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    let Some(auth) = &app.auth else {
        return Redirect::to("/board").into_response();
    };
    let refuse = |why: &str| {
        html(
            StatusCode::FORBIDDEN,
            render::render_login(&app.project, Some(why)),
        )
    };
    if cross_site(&headers) {
        return refuse(CSRF_REFUSED);
    }
    let token = f.token.trim();
    if token.is_empty() {
        return refuse("enter your operator token");
    }
    // Checked before the token: while blocked, a right token gets the same answer.
    let blocked = app.sign_in_limit().blocked(peer.ip(), Instant::now());
    if let Some(wait) = blocked {
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let mut r = html(
            StatusCode::TOO_MANY_REQUESTS,
            render::render_login(&app.project, Some(&too_many_sign_ins(secs))),
        );
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        return r;
    }
    let checked = Stamp::new(Some(token), None).and_then(|_| auth.operator(token));
    let operator = match checked {
        Ok(name) => {
            app.sign_in_limit().succeeded(peer.ip());
            name
        }
        Err(why) => {
            app.sign_in_limit().failed(peer.ip(), Instant::now());
            return refuse(why.lines().next().unwrap_or("refused"));
        }
    };
    let id = match app
        .sessions()
        .create(operator, token.to_string(), Instant::now())
    {
        Ok(id) => id,
        Err(e) => return plain(StatusCode::INTERNAL_SERVER_ERROR, &e),
    };
    app.signed_in.notify_one();
    let mut r = Redirect::to("/board").into_response();
    if let Ok(v) = HeaderValue::from_str(&session::session_cookie(&id, app.secure)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

#[derive(Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

async fn logout(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Form(f): Form<CsrfForm>,
) -> Result<Response, Denied> {
    if app.auth.is_none() {
        return Ok(Redirect::to("/board").into_response());
    }
    let c = caller(&app, &headers, &peer, Want::Page)?;
    if !csrf_ok(&headers, &c.csrf, &f.csrf) {
        return Err(Denied::Refused(StatusCode::FORBIDDEN, CSRF_REFUSED.into()));
    }
    if let Some(id) = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(session::cookie_id)
    {
        app.sessions().remove(id);
    }
    let mut r = Redirect::to("/login").into_response();
    if let Ok(v) = HeaderValue::from_str(&session::clear_cookie(app.secure)) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    Ok(r)
}

// --- Pages ----------------------------------------------------------------------------------

#[derive(Deserialize, Default)]
struct PageQuery {
    phase: Option<String>,
    needs: Option<String>,
    fragment: Option<String>,
}

impl PageQuery {
    fn fragment(&self) -> bool {
        self.fragment
            .as_deref()
            .is_some_and(|f| f == "1" || f == "true")
    }
}

async fn board(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let app: &App = &app;
    let fetch = |stamp: Stamp| async move {
        let mut workers = grpc::workers(&app.channel, stamp.clone());
        let (t, w) = tokio::join!(
            app.board_tasks(stamp),
            workers.list_workers(pb::ListWorkersRequest {})
        );
        // The fleet only adds run ages: a board without them beats no board.
        let workers = w.map(|w| w.into_inner().workers).unwrap_or_default();
        t.map(|t| (t, workers))
    };
    let filter = BoardFilter {
        phase: q.phase.clone().filter(|p| !p.is_empty()),
        needs_person: q.needs.as_deref() == Some("person"),
    };
    let show = |_: &Caller, ((tasks, fetched, changes), workers): (BoardTasks, Vec<_>)| {
        let body = render::render_board(&tasks, &workers, &filter, SystemTime::now());
        render::with_data_stamp(body, fetched.elapsed(), changes)
    };
    page(app, &headers, &peer, "Board", q.fragment(), fetch, show).await
}

async fn fleet(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(q): Query<PageQuery>,
) -> Response {
    let app: &App = &app;
    let fetch = |stamp: Stamp| async move {
        let changes = app.changes.load(Ordering::Acquire);
        grpc::workers(&app.channel, stamp)
            .list_workers(pb::ListWorkersRequest {})
            .await
            .map(|w| (w.into_inner().workers, Instant::now(), changes))
    };
    let show = |c: &Caller, (workers, fetched, changes): (Vec<_>, Instant, u64)| {
        let body = render::render_fleet(&workers, Some(&c.csrf), SystemTime::now());
        render::with_data_stamp(body, fetched.elapsed(), changes)
    };
    page(app, &headers, &peer, "Fleet", q.fragment(), fetch, show).await
}

async fn task(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(q): Query<PageQuery>,
) -> Response {
    let (app, name, fragment): (&App, &str, bool) = (&app, &name, q.fragment());
    let fetch = |stamp: Stamp| async move {
        let changes = app.changes.load(Ordering::Acquire);
        grpc::tasks(&app.channel, stamp)
            .get_task(pb::GetTaskRequest {
                task: name.to_string(),
                // The page renders each artifact's text (escaped markdown).
                with_contents: true,
                // The change is read once per page, not on every refresh: a diff of up to 1 MiB
                // per open page and event would cost the coordinator more than it shows anyone.
                with_changes: !fragment,
            })
            .await
            .map(|d| (d.into_inner(), Instant::now(), changes))
    };
    let show = |c: &Caller, (detail, fetched, changes): (pb::TaskDetail, Instant, u64)| {
        let view = TaskView {
            csrf: Some(&c.csrf),
            trace_url: app.trace_url.as_deref(),
            now: SystemTime::now(),
        };
        let facts = render::render_task(&detail, &view);
        let facts = render::with_data_stamp(facts, fetched.elapsed(), changes);
        if fragment {
            return facts;
        }
        // A delivered task's record names its branch; any other is named as the store names it.
        let branch = detail
            .summary
            .as_ref()
            .and_then(|s| s.delivery.as_ref())
            .map(|d| d.branch.clone())
            .filter(|b| !b.is_empty())
            .unwrap_or_else(|| crate::diff::task_branch(name));
        format!(
            "<div id=\"task\">{facts}{}{}</div>",
            crate::diff::render_change(detail.changes.as_ref(), &branch),
            render::render_output_panel(name)
        )
    };
    page(app, &headers, &peer, name, fragment, fetch, show).await
}

// --- Actions --------------------------------------------------------------------------------

#[derive(Deserialize)]
struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    task: String,
    #[serde(default)]
    worker: String,
    #[serde(default)]
    back: String,
    /// Why a delivery is abandoned (optional).
    #[serde(default)]
    reason: String,
}

async fn action(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(kind): Path<String>,
    Form(f): Form<ActionForm>,
) -> Result<Response, Denied> {
    let c = caller(&app, &headers, &peer, Want::Api)?;
    let back = safe_back(&f.back).to_string();
    let fail = |status: StatusCode, msg: &str| {
        Ok(html(
            status,
            render::render_action_error(&app.project, msg, &back),
        ))
    };
    if !csrf_ok(&headers, &c.csrf, &f.csrf) {
        return fail(StatusCode::FORBIDDEN, CSRF_REFUSED);
    }
    let stamp = c.stamp(Some(grpc::CALL_TIMEOUT))?;
    match call_action(&app, stamp, &kind, &f).await {
        Ok(()) => Ok(Redirect::to(&back).into_response()),
        Err(r) => {
            let (status, msg) = r.http_status();
            fail(status, &msg)
        }
    }
}

/// Why an action was not done: the console's own check, or the coordinator's refusal.
enum Refusal {
    Console(StatusCode, String),
    Coordinator(tonic::Status),
}

impl From<tonic::Status> for Refusal {
    fn from(s: tonic::Status) -> Refusal {
        Refusal::Coordinator(s)
    }
}

impl Refusal {
    /// The HTTP status that says the same, and the one line shown.
    fn http_status(self) -> (StatusCode, String) {
        match self {
            Refusal::Console(status, msg) => (status, msg),
            Refusal::Coordinator(s) => grpc::http_status(&s),
        }
    }
}

/// The call each button makes: the same the CLI makes for that command.
async fn call_action(app: &App, stamp: Stamp, kind: &str, f: &ActionForm) -> Result<(), Refusal> {
    let need = |v: &str, what: &str| {
        if v.is_empty() {
            Err(Refusal::Console(
                StatusCode::BAD_REQUEST,
                format!("no {what} named"),
            ))
        } else {
            Ok(v.to_string())
        }
    };
    let mut workers = grpc::workers(&app.channel, stamp.clone());
    match kind {
        // `automaton approve TASK`: the approver defaults to the token's operator.
        "approve" => {
            grpc::tasks(&app.channel, stamp)
                .approve(pb::ApproveRequest {
                    task: need(&f.task, "task")?,
                    approver: String::new(),
                    ..Default::default()
                })
                .await?;
        }
        // `automaton stop TASK` / `automaton stop TASK --resume`.
        "stop" | "resume" => {
            workers
                .stop_run(pb::StopRunRequest {
                    task: need(&f.task, "task")?,
                    resume: kind == "resume",
                })
                .await?;
        }
        // `automaton run TASK` (manual mode).
        "run" => {
            workers
                .run_task(pb::RunTaskRequest {
                    task: need(&f.task, "task")?,
                })
                .await?;
        }
        // `automaton deliver TASK`: the approval a delivery waits for, or a retry after a fix.
        "deliver" => {
            workers
                .deliver(pb::DeliverRequest {
                    task: need(&f.task, "task")?,
                })
                .await?;
        }
        // `automaton abandon TASK --reason WHY`.
        "abandon" => {
            workers
                .abandon(pb::AbandonRequest {
                    task: need(&f.task, "task")?,
                    reason: f.reason.trim().to_string(),
                })
                .await?;
        }
        // `automaton workers drain|undrain NAME`.
        "drain" | "undrain" => {
            workers
                .drain_worker(pb::DrainWorkerRequest {
                    name: need(&f.worker, "worker")?,
                    undo: kind == "undrain",
                })
                .await?;
        }
        _ => {
            return Err(Refusal::Console(
                StatusCode::NOT_FOUND,
                format!("no such action: {kind}"),
            ));
        }
    }
    Ok(())
}

// --- Streams --------------------------------------------------------------------------------

type EventStream = std::pin::Pin<Box<dyn Stream<Item = Result<Event, Infallible>> + Send>>;

/// A stream's response; it holds `slot` until it ends or its connection closes.
fn sse(stream: EventStream, slot: crate::streams::Slot) -> Response {
    Sse::new(Held::new(stream, slot))
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response()
}

/// One more live stream for `c`, or the 429 that says why not.
fn stream_slot(app: &App, c: &Caller) -> Result<crate::streams::Slot, Denied> {
    app.slots
        .take(c.holder.clone())
        .map_err(|why| Denied::Refused(StatusCode::TOO_MANY_REQUESTS, why))
}

#[derive(Deserialize, Default)]
struct EventsQuery {
    /// The feed's count of changes when the page's data was fetched (`data-changes`).
    after: Option<u64>,
}

async fn events(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Response, Denied> {
    let slot = stream_slot(&app, &caller(&app, &headers, &peer, Want::Api)?)?;
    Ok(sse(Box::pin(crate::feed::subscribe(&app, q.after)), slot))
}

async fn output(
    State(app): State<Arc<App>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, Denied> {
    let (c, stamp) = calling(&app, &headers, &peer, Want::Api, None)?;
    // Taken before the call: a refused stream costs the coordinator nothing.
    let slot = stream_slot(&app, &c)?;
    let req = pb::TailOutputRequest {
        task: name,
        follow: true,
        lease_id: String::new(),
        tail_bytes: OUTPUT_TAIL_BYTES,
    };
    let stream = match grpc::workers(&app.channel, stamp).tail_output(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => {
            let (_, msg) = grpc::http_status(&s);
            return Ok(sse(
                Box::pin(futures_util::stream::once(async move {
                    Ok(Event::default().event("error").data(msg))
                })),
                slot,
            ));
        }
    };
    Ok(sse(
        Box::pin(crate::feed::output(stream, app.stop.clone())),
        slot,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn loopback_check() {
        let ok = ["127.0.0.1:80", "[::1]:80", "[::ffff:127.0.0.1]:80"];
        for a in ok {
            assert!(is_loopback(&a.parse().expect("addr")), "{a}");
        }
        for a in ["10.0.0.1:80", "[::ffff:10.0.0.1]:80", "0.0.0.0:80"] {
            assert!(!is_loopback(&a.parse().expect("addr")), "{a}");
        }
    }

    #[test]
    fn csrf_verification() {
        let same = headers(&[("host", "console:8080"), ("origin", "http://console:8080")]);
        assert!(csrf_ok(&same, "secret", "secret"));
        assert!(!csrf_ok(&same, "secret", "secreT"));
        assert!(!csrf_ok(&same, "secret", ""));
        assert!(!csrf_ok(&same, "", ""));
        let evil = headers(&[("host", "console:8080"), ("origin", "http://evil.example")]);
        assert!(!csrf_ok(&evil, "secret", "secret"));
        let null = headers(&[("host", "console:8080"), ("origin", "null")]);
        assert!(!csrf_ok(&null, "secret", "secret"));
        let cross = headers(&[("host", "console:8080"), ("sec-fetch-site", "cross-site")]);
        assert!(!csrf_ok(&cross, "secret", "secret"));
        let sibling = headers(&[("sec-fetch-site", "same-site")]);
        assert!(cross_site(&sibling));
        let fine = headers(&[("sec-fetch-site", "same-origin")]);
        assert!(csrf_ok(&fine, "secret", "secret"));
        assert!(csrf_ok(&HeaderMap::new(), "secret", "secret"));
    }

    #[test]
    fn back_is_local() {
        assert_eq!(safe_back("/task/a/b"), "/task/a/b");
        assert_eq!(safe_back("//evil.example"), "/board");
        assert_eq!(safe_back("https://evil.example"), "/board");
        assert_eq!(safe_back("/\\evil"), "/board");
        assert_eq!(safe_back(""), "/board");
    }

    /// A TAB, any other control character or any whitespace in `back` sends to the board:
    /// browsers strip TAB and newlines from a `Location`, so `/\t/evil.example/` would leave.
    #[test]
    fn back_with_a_control_character_or_whitespace_is_refused() {
        for bad in [
            "/\t/evil.example/",
            "/\n/evil.example/",
            "/\r/evil.example/",
            "/\x0b/evil.example/",
            "/\x0c/evil.example/",
            "/\x00/evil.example/",
            "/\x7f/evil.example/",
            "/\u{85}/evil.example/",
            "/ /evil.example/",
            "/\u{a0}/evil.example/",
            "/\u{2028}/evil.example/",
            "/task/a b",
        ] {
            assert_eq!(safe_back(bad), "/board", "{bad:?}");
        }
        assert_eq!(safe_back("/task/shop/api?x=1"), "/task/shop/api?x=1");
    }

    fn local() -> SocketAddr {
        "127.0.0.1:8080".parse().expect("addr")
    }

    /// DNS rebinding: without tokens only loopback names with the console's port pass, in
    /// `Host` and in `Origin`.
    #[test]
    fn only_loopback_names_with_the_port_pass_without_tokens() {
        for (host, origin) in [
            ("127.0.0.1:8080", None),
            ("localhost:8080", Some("http://localhost:8080")),
            ("LOCALHOST:8080", Some("http://127.0.0.1:8080")),
            ("[::1]:8080", Some("http://[::1]:8080")),
        ] {
            let mut h = headers(&[("host", host)]);
            if let Some(o) = origin {
                h.insert(header::ORIGIN, HeaderValue::from_static(o));
            }
            assert_eq!(
                loopback_named(&h, local(), false),
                Ok(()),
                "{host} {origin:?}"
            );
        }
        for (host, origin) in [
            ("attacker.example:8080", None),
            (
                "attacker.example:8080",
                Some("http://attacker.example:8080"),
            ),
            ("127.0.0.1:8080", Some("http://attacker.example:8080")),
            ("127.0.0.1:8081", None),
            ("127.0.0.1", None),
            ("localhost.:8080", None),
            ("127.0.0.1.attacker.example:8080", None),
            ("", None),
            ("127.0.0.1:8080", Some("null")),
            ("127.0.0.1:8080", Some("https://127.0.0.1:8080")),
            ("127.0.0.1:8080", Some("http://127.0.0.1:8080/x")),
            ("127.0.0.1:8080", Some("http://127.0.0.1")),
        ] {
            let mut h = headers(&[("host", host)]);
            if let Some(o) = origin {
                h.insert(header::ORIGIN, HeaderValue::from_static(o));
            }
            let why = loopback_named(&h, local(), false).expect_err(host);
            assert!(
                why.contains("only requests to localhost, 127.0.0.1 or [::1] on port 8080"),
                "{why}"
            );
            assert!(!why.contains('\n'), "{why}");
        }
        let why = loopback_named(&HeaderMap::new(), local(), false).expect_err("no host");
        assert!(why.contains("Host was '(none)'"), "{why}");
        let mut two = headers(&[("host", "127.0.0.1:8080")]);
        two.append(
            header::HOST,
            HeaderValue::from_static("attacker.example:8080"),
        );
        assert!(loopback_named(&two, local(), false).is_err());
        // On the scheme's default port the port may be left out; https wants https origins.
        let on_80: SocketAddr = "127.0.0.1:80".parse().expect("addr");
        assert_eq!(
            loopback_named(&headers(&[("host", "localhost")]), on_80, false),
            Ok(())
        );
        let tls = headers(&[
            ("host", "localhost:8080"),
            ("origin", "https://localhost:8080"),
        ]);
        assert_eq!(loopback_named(&tls, local(), true), Ok(()));
        // The console's own loopback address passes too (an IP literal cannot be rebound).
        let own: SocketAddr = "127.0.0.2:8080".parse().expect("addr");
        assert_eq!(
            loopback_named(&headers(&[("host", "127.0.0.2:8080")]), own, false),
            Ok(())
        );
        assert!(loopback_named(&headers(&[("host", "127.0.0.2:8080")]), local(), false).is_err());
    }
}
