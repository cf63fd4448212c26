//! The pages, as pure functions over the coordinator's proto values: no I/O, so a benchmark
//! can time them and tests can read them. Every string that came from outside (task names,
//! states, reasons, artifacts, worker names) goes through [`escape`].
//!
//! Stable ids and classes, for browser tests and the page's script:
//! - `#fleet` holds one `.worker[data-name=NAME][data-state=STATE]` per worker, with one
//!   `.gpu` per GPU inside it; `.drain` / `.undrain` forms.
//! - `#board` holds one `.column[data-phase=PHASE]` per lifecycle phase (`new` …
//!   `complete`, `human_intervention`; `unknown` only when a task has no state); each task
//!   is a `.card[data-task=NAME][data-phase=PHASE]`; a parent's sub-tasks are cards inside
//!   `.wave[data-wave=N]` groups inside the parent's card; a top-level task's delivery is
//!   its card's `.delivery[data-state=STATE]` line.
//! - `#task` is a task's page: `#task-facts` (refreshed on events), `#approve` (the button,
//!   only while the task awaits approval), `#stop`, `#resume`, `#run`, `#artifacts`,
//!   `#approval` (`.stale` when the approval no longer matches), `#delivery[data-state]`
//!   with `#deliver` and `#abandon` (the buttons, only while they can apply), `#runs` (one
//!   `.run` per run), `#change` (not refreshed: one `.file[data-file]` per file, `.hunk`s,
//!   `.line.add` / `.line.del` / `.line.ctx`, `.ctl` for a control character, `.cut` when cut)
//!   and `#output`, the `pre` that live output is appended to (`.gap` marks skipped bytes).
//! - `#login-error` on the sign-in page, `#action-error` on a refused action's page.
//! - Any element with `data-refresh=URL` is replaced by what `URL` returns when an event
//!   arrives (the URL carries `fragment=1`); its `data-age-ms` says how old its data was
//!   when the console sent it, and `data-changes` where the console's feed stood when it
//!   was fetched (the page opens `/events?after=N` with it: a change since is told at once).
//! - `#liveness` in the header of every live page (board, fleet, task): `#connection`
//!   (`role=status`, `data-state` `connecting` / `connected` / `reconnecting`, its text the
//!   same word and, when reconnecting, why) and `#freshness` (`data-state` `fresh` /
//!   `stale`), holding `#stale` (`role=status`: `stale`, or empty) and `#age` (`role=timer`:
//!   `updated 3s ago`). Connection and freshness are two facts: connected with stale data
//!   is shown as such. The script keeps them up to date.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use automaton_proto::prost_types::Timestamp;
use automaton_proto::v1 as pb;
use automaton_proto::vocab::delivery_state;
use automaton_workflow::{DeliveryState, WorkerState};

pub use crate::markdown::escape;

/// The board's columns, in lifecycle order: the workflow's own phases.
pub fn phases() -> impl Iterator<Item = &'static str> {
    automaton_workflow::Phase::ALL.into_iter().map(|p| p.name())
}

const GIB: f64 = (1u64 << 30) as f64;

/// Renders an artifact (untrusted markdown) as escaped HTML.
pub fn render_markdown(src: &str) -> String {
    crate::markdown::to_html(src)
}

/// The phase of a state (`design:awaiting_approval` → `design`); `unknown` when empty.
pub fn phase_of(state: &str) -> &str {
    match state.split(':').next() {
        Some(p) if !p.is_empty() => p,
        _ => "unknown",
    }
}

/// Which tasks the board shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BoardFilter {
    /// Only tasks in this phase (`?phase=X`).
    pub phase: Option<String>,
    /// Only tasks that need a person: awaiting approval, in `human_intervention`, or with an
    /// attention line (`?needs=person`).
    pub needs_person: bool,
}

impl BoardFilter {
    /// The filter as a query string (without `?`), `fragment=1` appended when asked.
    pub fn query(&self, fragment: bool) -> String {
        let mut parts = Vec::new();
        if let Some(p) = &self.phase {
            parts.push(format!("phase={}", url_component(p)));
        }
        if self.needs_person {
            parts.push("needs=person".to_string());
        }
        if fragment {
            parts.push("fragment=1".to_string());
        }
        parts.join("&")
    }

    fn matches(&self, t: &pb::TaskSummary) -> bool {
        if let Some(p) = &self.phase
            && phase_of(&t.state) != p
        {
            return false;
        }
        !self.needs_person || needs_person(t)
    }
}

/// The task waits for a person: an approval, `human_intervention`, seed 002's warning, or a
/// delivery that waits (for an operator's approval, or a person's fix).
pub fn needs_person(t: &pb::TaskSummary) -> bool {
    t.state.ends_with(":awaiting_approval")
        || t.state
            .parse::<automaton_workflow::State>()
            .is_ok_and(|s| s.phase == automaton_workflow::Phase::HumanIntervention)
        || !t.attention.is_empty()
        || t.delivery
            .as_ref()
            .is_some_and(|d| !delivery_final(d) && !d.waiting.is_empty())
}

/// Percent-encodes a path or query component (task names are kebab-case, but the page must
/// not trust that).
pub fn url_component(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A task's page path, `/task/parent/sub` (each part encoded).
pub fn task_path(prefix: &str, name: &str) -> String {
    let parts: Vec<String> = name.split('/').map(url_component).collect();
    format!("{prefix}/{}", parts.join("/"))
}

/// How long ago `ts` was (zero for a time in the future or unset).
pub fn since(ts: Option<&Timestamp>, now: SystemTime) -> Option<Duration> {
    let ts = ts?;
    let at = UNIX_EPOCH
        + Duration::from_secs(u64::try_from(ts.seconds).ok()?)
        + Duration::from_nanos(u64::try_from(ts.nanos).unwrap_or(0));
    Some(now.duration_since(at).unwrap_or(Duration::ZERO))
}

/// A length of time for people: `42s`, `5m 3s`, `2h 5m`, `3d 4h`.
pub fn human_duration(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86400, (s % 86400) / 3600),
    }
}

/// A time as RFC 3339 UTC to the second; `-` when unset or out of range.
pub fn time_text(ts: Option<&Timestamp>) -> String {
    let Some(ts) = ts else {
        return "-".into();
    };
    let Ok(secs) = u64::try_from(ts.seconds) else {
        return "-".into();
    };
    let at = UNIX_EPOCH + Duration::from_secs(secs);
    humantime::format_rfc3339_seconds(at).to_string()
}

/// Tokens in thousands: `90k`.
fn ktokens(n: u64) -> String {
    if n == 0 {
        "-".into()
    } else if n < 1000 {
        format!("{n}")
    } else {
        format!("{}k", n / 1000)
    }
}

/// How often the event stream says it is alive (with the feed's state), so a page can tell
/// its data is still current when nothing changes, and a silent connection from a live one.
pub const ALIVE_EVERY: Duration = Duration::from_secs(2);
/// How long a page's data may go unconfirmed (no refresh, no word that nothing changed)
/// before the page marks it stale.
pub const STALE_AFTER: Duration = Duration::from_secs(10);

/// The whole page around a body. `operator` names who is signed in (a sign-out form is then
/// shown); `csrf` is the token that form carries.
pub fn page(
    project: &str,
    title: &str,
    operator: Option<&str>,
    csrf: Option<&str>,
    body: &str,
) -> String {
    page_with(project, title, operator, csrf, body, false)
}

/// [`page`] for a page that updates itself (board, fleet, task): its header says whether it
/// is connected and how old what it shows is ([`liveness`]).
pub fn live_page(
    project: &str,
    title: &str,
    operator: Option<&str>,
    csrf: Option<&str>,
    body: &str,
) -> String {
    page_with(project, title, operator, csrf, body, true)
}

/// The header's status of a live page: the connection and the freshness of the data, two
/// facts side by side, shown by the script (without it, a line says the page is not live).
pub fn liveness() -> String {
    format!(
        r#"<div id="liveness" class="liveness" data-alive-ms="{}" data-stale-after-ms="{}"><span id="connection" role="status" data-state="connecting" hidden>connecting</span><noscript>not live: scripts are off, reload to update</noscript><span id="freshness" data-state="fresh" hidden><span id="stale" role="status"></span> <span id="age" role="timer"></span></span></div>"#,
        ALIVE_EVERY.as_millis(),
        STALE_AFTER.as_millis(),
    )
}

/// Marks a refreshable part (the `data-refresh` element `html` opens with) with how old its
/// data is (`data-age-ms`: the page counts its freshness from the data's fetch, not from when
/// it arrived) and the feed's count of changes when it was fetched (`data-changes`). `html` is
/// one of this module's parts; anything else is left as it is.
pub fn with_data_stamp(html: String, age: Duration, changes: u64) -> String {
    let Some(at) = html.find(" data-refresh=\"") else {
        return html;
    };
    if html[..at].contains('>') {
        return html;
    }
    let mut out = String::with_capacity(html.len() + 48);
    out.push_str(&html[..at]);
    let _ = write!(
        out,
        " data-age-ms=\"{}\" data-changes=\"{changes}\"",
        age.as_millis()
    );
    out.push_str(&html[at..]);
    out
}

fn page_with(
    project: &str,
    title: &str,
    operator: Option<&str>,
    csrf: Option<&str>,
    body: &str,
    live: bool,
) -> String {
    let live = if live { liveness() } else { String::new() };
    let mut who = String::new();
    if let (Some(op), Some(csrf)) = (operator, csrf) {
        let _ = write!(
            who,
            "<span class=\"operator\">{}</span><form method=\"post\" action=\"/logout\" class=\"logout\">{}<button type=\"submit\">Sign out</button></form>",
            escape(op),
            csrf_field(csrf)
        );
    }
    format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · {}</title><link rel=\"stylesheet\" href=\"/static/console.css\">\
         <script src=\"/static/console.js\" defer></script></head>\n<body>\
         <header><span class=\"project\">{}</span><nav><a href=\"/board\">Board</a> \
         <a href=\"/board?needs=person\">Needs a person</a> <a href=\"/fleet\">Fleet</a></nav>{live}{who}</header>\n\
         <main id=\"content\">{body}</main></body></html>\n",
        escape(title),
        escape(project),
        escape(project),
    )
}

/// The sign-in page; `error` is the one-line reason the last attempt was refused.
pub fn render_login(project: &str, error: Option<&str>) -> String {
    let err = error
        .map(|e| format!("<p id=\"login-error\" class=\"error\">{}</p>", escape(e)))
        .unwrap_or_default();
    page(
        project,
        "Sign in",
        None,
        None,
        &format!(
            "<section id=\"login\"><h1>Sign in</h1>{err}<form method=\"post\" action=\"/login\">\
             <label>Operator token <input type=\"password\" name=\"token\" autocomplete=\"current-password\" required autofocus></label> \
             <button type=\"submit\">Sign in</button></form></section>"
        ),
    )
}

/// A refused action's page: the coordinator's (or the console's) one line, and a way back.
pub fn render_action_error(project: &str, message: &str, back: &str) -> String {
    page(
        project,
        "Refused",
        None,
        None,
        &format!(
            "<section><h1>Refused</h1><p id=\"action-error\" class=\"error\">{}</p><p><a href=\"{}\">Back</a></p></section>",
            escape(message),
            escape(back)
        ),
    )
}

/// A page that could not be shown (the coordinator refused or is away).
pub fn render_error(message: &str) -> String {
    format!(
        "<section class=\"failure\"><p class=\"error\">{}</p></section>",
        escape(message)
    )
}

fn csrf_field(csrf: &str) -> String {
    format!(
        "<input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        escape(csrf)
    )
}

/// One action button: a POST form with the CSRF field and `fields` hidden.
fn action_form(
    id: Option<&str>,
    class: &str,
    action: &str,
    label: &str,
    csrf: &str,
    fields: &[(&str, &str)],
) -> String {
    let mut hidden = csrf_field(csrf);
    for (k, v) in fields {
        let _ = write!(
            hidden,
            "<input type=\"hidden\" name=\"{}\" value=\"{}\">",
            escape(k),
            escape(v)
        );
    }
    let id = id
        .map(|i| format!(" id=\"{}\"", escape(i)))
        .unwrap_or_default();
    format!(
        "<form method=\"post\" action=\"/action/{action}\" class=\"action {class}\">{hidden}<button type=\"submit\"{id}>{}</button></form>",
        escape(label)
    )
}

// --- Board ----------------------------------------------------------------------------------

/// When each task's current run started, from the fleet (a run is matched to its task by
/// its lease's fencing token).
fn run_starts(workers: &[pb::WorkerInfo]) -> HashMap<&str, &Timestamp> {
    let mut starts = HashMap::new();
    for w in workers {
        for l in &w.leases {
            if let Some(ts) = w
                .runs
                .iter()
                .find(|r| r.token == l.token)
                .and_then(|r| r.started_at.as_ref())
            {
                starts.insert(l.task.as_str(), ts);
            }
        }
    }
    starts
}

/// The board: every task in its phase's column, sub-tasks grouped by wave in their parent's
/// card. `workers` (may be empty) says how long each running task's run has gone on.
pub fn render_board(
    tasks: &[pb::TaskSummary],
    workers: &[pb::WorkerInfo],
    filter: &BoardFilter,
    now: SystemTime,
) -> String {
    let starts = run_starts(workers);
    let mut columns: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for t in tasks {
        let subs: Vec<&pb::TaskSummary> = t.subtasks.iter().filter(|s| filter.matches(s)).collect();
        if !filter.matches(t) && subs.is_empty() {
            continue;
        }
        let card = card(t, &subs, &starts, now);
        columns.entry(phase_of(&t.state)).or_default().push(card);
    }
    let mut out = format!(
        "<section id=\"board\" data-refresh=\"/board?{}\">",
        escape(&filter.query(true))
    );
    out.push_str(&filters(filter));
    out.push_str("<div class=\"columns\">");
    let known: Vec<&str> = phases().collect();
    let extra: Vec<&str> = columns
        .keys()
        .copied()
        .filter(|p| !known.contains(p))
        .collect();
    for phase in known.iter().chain(extra.iter()) {
        let cards = columns.get(phase).map(Vec::as_slice).unwrap_or_default();
        let _ = write!(
            out,
            "<section class=\"column\" data-phase=\"{p}\"><h2>{p} <span class=\"count\">{}</span></h2>{}</section>",
            cards.len(),
            cards.concat(),
            p = escape(phase),
        );
    }
    out.push_str("</div>");
    if tasks.is_empty() {
        out.push_str("<p class=\"empty\">No tasks: create one with <code>automaton status --create-task NAME</code>.</p>");
    }
    out.push_str("</section>");
    out
}

/// The filter links above the columns.
fn filters(filter: &BoardFilter) -> String {
    let mut out = String::from("<nav class=\"filters\">");
    let link = |label: &str, f: BoardFilter, out: &mut String| {
        let q = f.query(false);
        let current = if &f == filter {
            " class=\"current\""
        } else {
            ""
        };
        let _ = write!(
            out,
            "<a href=\"/board{}{}\"{current}>{}</a> ",
            if q.is_empty() { "" } else { "?" },
            escape(&q),
            escape(label)
        );
    };
    link("all", BoardFilter::default(), &mut out);
    link(
        "needs a person",
        BoardFilter {
            phase: None,
            needs_person: true,
        },
        &mut out,
    );
    for p in phases() {
        link(
            p,
            BoardFilter {
                phase: Some(p.to_string()),
                needs_person: false,
            },
            &mut out,
        );
    }
    out.push_str("</nav>");
    out
}

/// One task's card; `subs` are the sub-tasks the filter lets through.
fn card(
    t: &pb::TaskSummary,
    subs: &[&pb::TaskSummary],
    starts: &HashMap<&str, &Timestamp>,
    now: SystemTime,
) -> String {
    let mut out = card_open(t, starts, now);
    // Only a top-level task is delivered (its sub-tasks come together on its branch first).
    if let Some(d) = &t.delivery {
        let _ = write!(
            out,
            "<div class=\"delivery\" data-state=\"{}\">{}</div>",
            escape(&d.state),
            delivery_summary(d)
        );
    }
    if !subs.is_empty() {
        let mut waves: BTreeMap<u32, Vec<&pb::TaskSummary>> = BTreeMap::new();
        for s in subs {
            waves.entry(s.wave).or_default().push(s);
        }
        out.push_str("<div class=\"waves\">");
        for (wave, subs) in waves {
            let label = if wave == 0 {
                "no wave".to_string()
            } else {
                format!("wave {wave}")
            };
            let _ = write!(
                out,
                "<div class=\"wave\" data-wave=\"{wave}\"><h4>{label}</h4>"
            );
            for s in subs {
                out.push_str(&card_open(s, starts, now));
                out.push_str("</article>");
            }
            out.push_str("</div>");
        }
        out.push_str("</div>");
    }
    out.push_str("</article>");
    out
}

/// A card's opening tag and facts (the caller closes it, after any sub-task waves).
fn card_open(t: &pb::TaskSummary, starts: &HashMap<&str, &Timestamp>, now: SystemTime) -> String {
    let phase = phase_of(&t.state);
    let person = if needs_person(t) { " needs-person" } else { "" };
    let mut out = format!(
        "<article class=\"card{person}\" data-task=\"{}\" data-phase=\"{}\"><a class=\"name\" href=\"{}\">{}</a>\
         <div class=\"state\">{}</div>",
        escape(&t.task),
        escape(phase),
        escape(&task_path("/task", &t.task)),
        escape(&t.task),
        escape(if t.state.is_empty() { "?" } else { &t.state }),
    );
    let mut line = |class: &str, text: String| {
        let _ = write!(out, "<div class=\"{class}\">{}</div>", escape(&text));
    };
    if !t.error.is_empty() {
        line("error", t.error.clone());
    }
    if !t.lease_holder.is_empty() {
        line("holder", format!("held by {}", t.lease_holder));
    }
    if let Some(d) = starts
        .get(t.task.as_str())
        .and_then(|ts| since(Some(ts), now))
    {
        line("age", format!("running {}", human_duration(d)));
    }
    if !t.held.is_empty() {
        line("held", format!("HELD: {}", t.held));
    } else if !t.waiting.is_empty() {
        line("waiting", t.waiting.clone());
    }
    if !t.attention.is_empty() {
        line("attention", t.attention.clone());
    }
    if t.approval_stale {
        line("stale", "approval stale: the artifact changed".into());
    }
    if t.estimated_tokens > 0 {
        line(
            "estimate",
            format!("~{} tokens", ktokens(t.estimated_tokens)),
        );
    }
    if let Some(v) = &t.verdicts {
        line("verdicts", format!("sub-task verdicts: {}", v.summary));
    }
    if !t.next_command.is_empty() {
        line("next", format!("next: {}", t.next_command));
    }
    out
}

// --- Fleet ----------------------------------------------------------------------------------

/// The fleet: one `.worker` per worker. With `csrf`, drain/undrain buttons.
pub fn render_fleet(workers: &[pb::WorkerInfo], csrf: Option<&str>, now: SystemTime) -> String {
    let mut out = String::from("<section id=\"fleet\" data-refresh=\"/fleet?fragment=1\">");
    if workers.is_empty() {
        out.push_str("<p class=\"empty\">No workers: start <code>automaton-worker --coordinator URL</code> on each GPU machine.</p>");
    }
    for w in workers {
        out.push_str(&worker(w, csrf, now));
    }
    out.push_str("</section>");
    out
}

fn worker(w: &pb::WorkerInfo, csrf: Option<&str>, now: SystemTime) -> String {
    let b = w.budget.clone().unwrap_or_default();
    let mut out = format!(
        "<article class=\"worker\" data-name=\"{n}\" data-state=\"{s}\"><h2>{n} <span class=\"state state-{s}\">{s}</span></h2>",
        n = escape(&w.name),
        s = escape(&w.state),
    );
    let host = if w.host.is_empty() { "-" } else { &w.host };
    let heartbeat = w
        .heartbeat_age
        .as_ref()
        .map(|d| {
            let ms = u64::try_from(d.seconds).unwrap_or(0) * 1000
                + u64::try_from(d.nanos).unwrap_or(0) / 1_000_000;
            format!("{:.1}s ago", ms as f64 / 1000.0)
        })
        .unwrap_or_else(|| "-".into());
    let session = since(w.since.as_ref(), now)
        .map(|d| format!("up {}", human_duration(d)))
        .unwrap_or_else(|| "-".into());
    let _ = write!(
        out,
        "<dl class=\"facts\"><dt>host</dt><dd>{}</dd><dt>version</dt><dd>{}</dd><dt>machine</dt><dd>{} CPUs, {:.1} GiB RAM</dd>\
         <dt>heartbeat</dt><dd>{}</dd><dt>session</dt><dd>{}</dd><dt>capacity</dt><dd class=\"capacity\">{} at once</dd></dl>",
        escape(host),
        escape(&w.version),
        w.cpus,
        w.ram_bytes as f64 / GIB,
        escape(&heartbeat),
        escape(&session),
        w.capacity,
    );
    out.push_str("<ul class=\"gpus\">");
    if w.gpus.is_empty() {
        out.push_str("<li class=\"no-gpu\">no GPU</li>");
    }
    for g in &w.gpus {
        let _ = write!(
            out,
            "<li class=\"gpu\" data-index=\"{}\">{} — {:.1}/{:.1} GiB free{}</li>",
            g.index,
            escape(&g.name),
            g.free_bytes as f64 / GIB,
            g.total_bytes as f64 / GIB,
            if w.simulated { " (simulated)" } else { "" }
        );
    }
    out.push_str("</ul>");
    let _ = write!(
        out,
        "<p class=\"budget\">context window {} ({}); takes sub-tasks up to {}; recommended {} per phase, headroom {:.0}%; budget from {}</p>",
        ktokens(b.model_context_kb),
        escape(if b.context_source.is_empty() {
            "-"
        } else {
            &b.context_source
        }),
        ktokens(b.max_peak_context_kb),
        ktokens(b.recommended_kb),
        b.headroom * 100.0,
        escape(if b.source.is_empty() { "-" } else { &b.source }),
    );
    out.push_str(&worker_runs(w, now));
    let state = automaton_proto::vocab::worker_state(w);
    if let Some(csrf) = csrf
        && state != Some(WorkerState::Lost)
    {
        let name = w.name.as_str();
        out.push_str(&if state == Some(WorkerState::Draining) {
            action_form(
                None,
                "undrain",
                "undrain",
                "Undrain",
                csrf,
                &[("worker", name), ("back", "/fleet")],
            )
        } else {
            action_form(
                None,
                "drain",
                "drain",
                "Drain",
                csrf,
                &[("worker", name), ("back", "/fleet")],
            )
        });
    }
    out.push_str("</article>");
    out
}

/// What a worker runs now: each lease, with its run's state and how long it has gone on.
fn worker_runs(w: &pb::WorkerInfo, now: SystemTime) -> String {
    if w.leases.is_empty() {
        return "<p class=\"runs idle\">runs nothing</p>".into();
    }
    let mut out = String::from("<ul class=\"runs\">");
    for l in &w.leases {
        let run = w.runs.iter().find(|r| r.token == l.token);
        let state = run
            .map(|r| format!(", run {}", r.state))
            .unwrap_or_default();
        let age = run
            .and_then(|r| since(r.started_at.as_ref(), now))
            .map(|d| format!(", for {}", human_duration(d)))
            .unwrap_or_default();
        let _ = write!(
            out,
            "<li class=\"lease\" data-task=\"{}\"><a href=\"{}\">{}</a> ({}{}{})</li>",
            escape(&l.task),
            escape(&task_path("/task", &l.task)),
            escape(&l.task),
            escape(&l.phase),
            escape(&state),
            escape(&age),
        );
    }
    out.push_str("</ul>");
    out
}

// --- Task -----------------------------------------------------------------------------------

/// What a task page needs besides the task.
#[derive(Clone, Debug)]
pub struct TaskView<'a> {
    /// With a session (or in no-auth mode): the CSRF token the action buttons carry. `None`:
    /// no buttons.
    pub csrf: Option<&'a str>,
    /// A trace UI URL with `{trace_id}` (config `trace_url`): each run's trace id links
    /// there. `None`: the ids are shown as text.
    pub trace_url: Option<&'a str>,
    /// The time ages are measured to.
    pub now: SystemTime,
}

/// A trace UI link: `template` with `{trace_id}` replaced.
pub fn trace_link(template: &str, trace_id: &str) -> String {
    template.replace("{trace_id}", &url_component(trace_id))
}

/// The refreshable part of a task's page (`#task-facts`).
pub fn render_task(d: &pb::TaskDetail, view: &TaskView<'_>) -> String {
    let s = d.summary.clone().unwrap_or_default();
    let mut out = format!(
        "<section id=\"task-facts\" data-refresh=\"{}?fragment=1\" data-task=\"{}\">",
        escape(&task_path("/task", &s.task)),
        escape(&s.task)
    );
    let _ = write!(
        out,
        "<h1>{}</h1><p class=\"state\" data-phase=\"{}\">{}</p>",
        escape(&s.task),
        escape(phase_of(&s.state)),
        escape(if s.state.is_empty() { "?" } else { &s.state })
    );
    out.push_str(&task_lines(d, &s));
    if let Some(csrf) = view.csrf {
        out.push_str(&task_actions(d, &s, csrf));
    }
    out.push_str(&approval(d, &s));
    if let Some(dl) = &s.delivery {
        out.push_str(&delivery(&s.task, dl, view.csrf, view.now));
    }
    out.push_str(&artifacts(d));
    out.push_str(&runs(&d.runs, view.trace_url, view.now));
    out.push_str(&guidance(d.guidance.as_ref()));
    out.push_str("</section>");
    out
}

/// The live output panel (not refreshed: the script appends to `#output`).
pub fn render_output_panel(task: &str) -> String {
    format!(
        "<section id=\"live\"><h2>Live output</h2><p class=\"output-status\" id=\"output-status\"></p>\
         <pre id=\"output\" data-src=\"{}\"></pre></section>",
        escape(&task_path("/output", task))
    )
}

/// Holder, implementers, waiting and held lines, parent and sub-tasks.
fn task_lines(d: &pb::TaskDetail, s: &pb::TaskSummary) -> String {
    let mut out = String::from("<dl class=\"facts\">");
    let mut fact = |k: &str, v: &str| {
        let _ = write!(
            out,
            "<dt>{}</dt><dd class=\"{}\">{}</dd>",
            escape(k),
            escape(k),
            escape(v)
        );
    };
    if let Some(l) = &d.lease {
        fact(
            "holder",
            &format!("{} (since {})", l.agent, time_text(l.claimed_at.as_ref())),
        );
    } else if !s.lease_holder.is_empty() {
        fact("holder", &s.lease_holder);
    }
    if !d.implementers.is_empty() {
        fact("implementers", &d.implementers.join(", "));
    }
    if !s.waiting.is_empty() {
        fact("waiting", &s.waiting);
    }
    if !s.held.is_empty() {
        fact("held", &s.held);
    }
    if !s.last_failure.is_empty() {
        fact("last failure", &s.last_failure);
    }
    if !s.attention.is_empty() {
        fact("attention", &s.attention);
    }
    if !s.next_command.is_empty() {
        fact("next", &s.next_command);
    }
    if s.estimated_tokens > 0 {
        fact(
            "estimate",
            &format!("~{} tokens", ktokens(s.estimated_tokens)),
        );
    }
    if let Some(v) = &s.verdicts {
        fact("sub-task verdicts", &v.summary);
    }
    out.push_str("</dl>");
    if let Some(p) = &d.parent {
        let _ = write!(
            out,
            "<p class=\"parent\">sub-task of <a href=\"{}\">{}</a> ({})</p>",
            escape(&task_path("/task", &p.task)),
            escape(&p.task),
            escape(&p.state)
        );
    }
    if !d.subtasks.is_empty() {
        out.push_str("<ul class=\"subtasks\">");
        for st in &d.subtasks {
            let _ = write!(
                out,
                "<li><a href=\"{}\">{}</a></li>",
                escape(&task_path("/task", st)),
                escape(st)
            );
        }
        out.push_str("</ul>");
    }
    out
}

/// The buttons this task's state offers; the coordinator still decides.
fn task_actions(d: &pb::TaskDetail, s: &pb::TaskSummary, csrf: &str) -> String {
    let back = task_path("/task", &s.task);
    let fields = [("task", s.task.as_str()), ("back", back.as_str())];
    let mut out = String::from("<div class=\"actions\">");
    let awaiting = s.state.ends_with(":awaiting_approval")
        || d.approval.as_ref().is_some_and(|a| a.status == "awaiting");
    if awaiting {
        out.push_str(&action_form(
            Some("approve"),
            "approve",
            "approve",
            "Approve",
            csrf,
            &fields,
        ));
    }
    let running = d.lease.is_some()
        || d.runs.iter().any(|r| {
            automaton_proto::vocab::RunVocab::state_kind(r)
                != Some(automaton_workflow::RunState::Stopped)
                && r.ended_at.is_none()
        });
    if running {
        out.push_str(&action_form(
            Some("stop"),
            "stop",
            "stop",
            "Stop run",
            csrf,
            &fields,
        ));
    }
    if !s.held.is_empty() {
        out.push_str(&action_form(
            Some("resume"),
            "resume",
            "resume",
            "Resume",
            csrf,
            &fields,
        ));
    }
    if s.next_command.starts_with("automaton run ") {
        out.push_str(&action_form(
            Some("run"),
            "run",
            "run",
            "Run next phase",
            csrf,
            &fields,
        ));
    }
    out.push_str("</div>");
    out
}

/// Where the gated phase stands with its approval: who, when, which bytes; stale marked.
fn approval(d: &pb::TaskDetail, s: &pb::TaskSummary) -> String {
    let Some(a) = &d.approval else {
        return String::new();
    };
    let stale = a.stale || s.approval_stale;
    let mut out = format!(
        "<section id=\"approval\" class=\"approval{}\"><h2>Approval</h2><p>{} — {}{}</p>",
        if stale { " stale" } else { "" },
        escape(&a.artifact),
        escape(&a.status),
        match (
            stale,
            a.record.as_ref().is_some_and(|r| !r.commit.is_empty())
        ) {
            (true, true) => {
                " <span class=\"stale\">stale: the artifact or the task branch changed since it was approved</span>"
            }
            (true, false) => {
                " <span class=\"stale\">stale: the artifact changed since it was approved</span>"
            }
            _ => "",
        }
    );
    if let Some(r) = &a.record {
        let _ = write!(
            out,
            "<p class=\"record\">{} approved by <span class=\"approver\">{}</span> at {}; sha256 <code class=\"sha256\">{}</code></p>",
            escape(&r.phase),
            escape(&r.approver),
            escape(&time_text(r.approved_at.as_ref())),
            escape(if r.sha256.is_empty() {
                "(not recorded)"
            } else {
                &r.sha256
            }),
        );
        if !r.commit.is_empty() {
            let _ = write!(
                out,
                "<p class=\"record\">of commit <code class=\"commit\">{}</code></p>",
                escape(&r.commit)
            );
        }
    } else if s.approval_missing {
        out.push_str("<p class=\"record missing\">no approval record in .state.approvals</p>");
    }
    out.push_str("</section>");
    out
}

// --- Delivery -------------------------------------------------------------------------------

/// A delivery that has ended (`merged`, `opened`, `abandoned`): nothing more happens to it.
pub fn delivery_final(d: &pb::Delivery) -> bool {
    delivery_state(d).is_some_and(DeliveryState::is_final)
}

/// It waits for an operator's `automaton deliver` (`[delivery] approve = true`), as the
/// coordinator words its `waiting` line.
fn awaiting_approval(d: &pb::Delivery) -> bool {
    d.waiting.starts_with("awaiting an operator")
}

/// `url` when a page may link it: http or https, without whitespace or control characters.
pub fn web_url(url: &str) -> Option<&str> {
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    let web = lower.starts_with("https://") || lower.starts_with("http://");
    (web && !url.chars().any(|c| c.is_whitespace() || c.is_control())).then_some(url)
}

/// The pull request: `#N` (or `pull request`) linked when its URL is a web URL.
fn pull_request(d: &pb::Delivery) -> String {
    let label = if d.number > 0 {
        format!("pull request #{}", d.number)
    } else {
        "pull request".to_string()
    };
    match web_url(&d.url) {
        Some(u) => format!(
            "<a class=\"pull-request\" href=\"{}\" rel=\"noopener noreferrer\">{}</a>",
            escape(u),
            escape(&label)
        ),
        None if d.url.is_empty() => escape(&label),
        None => format!("{} ({})", escape(&label), escape(&d.url)),
    }
}

/// A delivery in a few words (HTML): where the work went, or what it waits for.
pub fn delivery_summary(d: &pb::Delivery) -> String {
    let base = if d.base.is_empty() {
        "the base"
    } else {
        &d.base
    };
    let s = d.state.as_str();
    let text = match delivery_state(d) {
        Some(DeliveryState::Merged) => {
            let mut l = format!("merged into {base}");
            if !d.commit.is_empty() {
                l.push_str(&format!(" at {}", crate::diff::short_commit(&d.commit)));
            }
            if !d.how.is_empty() {
                l.push_str(&format!(" ({})", d.how));
            }
            l
        }
        Some(DeliveryState::Opened) => return pull_request(d),
        Some(DeliveryState::Abandoned) => "abandoned".to_string(),
        _ if awaiting_approval(d) && d.mode == "pull_request" => {
            format!("awaiting approval to open a pull request into {base}")
        }
        _ if awaiting_approval(d) => format!("awaiting approval to land on {base}"),
        _ if !d.waiting.is_empty() => format!("waits: {}", d.waiting),
        _ if d.failures > 0 => format!("delivery {s} into {base}, {} failed tries", d.failures),
        _ => format!("delivery {s} into {base}"),
    };
    escape(&text)
}

/// The `#delivery` section: every fact of the record, and with `csrf` the Deliver button
/// (while it waits: for an approval or a person's fix) and the Abandon form (until it ends).
fn delivery(task: &str, d: &pb::Delivery, csrf: Option<&str>, now: SystemTime) -> String {
    let mut out = format!(
        "<section id=\"delivery\" class=\"delivery\" data-state=\"{}\"><h2>Delivery</h2><p class=\"summary\">{}</p><dl class=\"facts\">",
        escape(&d.state),
        delivery_summary(d)
    );
    // (name, HTML) of each fact that has a value.
    let mut facts: Vec<(&str, String)> = Vec::new();
    let mut fact = |k: &'static str, v: &str| {
        if !v.is_empty() {
            facts.push((k, escape(v)));
        }
    };
    fact("state", &d.state);
    fact(
        "mode",
        &match (d.mode.as_str(), d.strategy.as_str()) {
            ("", s) | (s, "") => s.to_string(),
            (m, s) => format!("{m}, strategy {s}"),
        },
    );
    fact(
        "base",
        &if d.remote.is_empty() {
            d.base.clone()
        } else {
            format!("{} on {}", d.base, d.remote)
        },
    );
    fact("branch", &d.branch);
    fact("revision", &d.revision);
    fact("commit", &d.commit);
    fact("how", &d.how);
    fact("waiting", &d.waiting);
    if delivery_state(d) == Some(DeliveryState::Abandoned) {
        fact("reason", &d.failure);
    } else if !d.failure.is_empty() {
        fact(
            "last failure",
            &format!("{} ({} failed so far)", d.failure, d.failures),
        );
    }
    fact("approved by", &d.approved_by);
    fact("abandoned by", &d.abandoned_by);
    if d.reworks > 0 {
        fact(
            "reworks",
            &format!("sent back to implement {} time(s)", d.reworks),
        );
    }
    let at = |ts: Option<&Timestamp>| {
        since(ts, now)
            .map(|ago| format!("{} ({} ago)", time_text(ts), human_duration(ago)))
            .unwrap_or_default()
    };
    fact("requested", &at(d.requested_at.as_ref()));
    fact("updated", &at(d.updated_at.as_ref()));
    if !d.url.is_empty() {
        facts.push(("pull request", pull_request(d)));
    }
    for (k, v) in facts {
        let _ = write!(
            out,
            "<dt>{k}</dt><dd class=\"{}\">{v}</dd>",
            k.replace(' ', "-")
        );
    }
    out.push_str("</dl>");
    if let Some(csrf) = csrf
        && !delivery_final(d)
    {
        let back = task_path("/task", task);
        out.push_str("<div class=\"actions\">");
        if !d.waiting.is_empty() {
            out.push_str(&action_form(
                Some("deliver"),
                "deliver",
                "deliver",
                "Deliver",
                csrf,
                &[("task", task), ("back", &back)],
            ));
        }
        let _ = write!(
            out,
            "<form method=\"post\" action=\"/action/abandon\" class=\"action abandon\" data-confirm=\"Abandon this delivery? Nothing more of it lands.\">{}\
             <input type=\"hidden\" name=\"task\" value=\"{}\"><input type=\"hidden\" name=\"back\" value=\"{}\">\
             <input type=\"text\" name=\"reason\" maxlength=\"200\" placeholder=\"reason (optional)\" aria-label=\"reason\"> \
             <button type=\"submit\" id=\"abandon\">Abandon</button></form>",
            csrf_field(csrf),
            escape(task),
            escape(&back)
        );
        out.push_str("</div>");
    }
    out.push_str("</section>");
    out
}

/// The artifact files, then each one's text (when the coordinator sent it, `with_contents`)
/// rendered from markdown, escaped; a text cut at the API's limit says so.
fn artifacts(d: &pb::TaskDetail) -> String {
    let mut out = String::from("<section id=\"artifacts\"><h2>Artifacts</h2>");
    if d.artifacts.is_empty() {
        out.push_str("<p class=\"empty\">none yet</p>");
    } else {
        out.push_str("<ul>");
        for a in &d.artifacts {
            let _ = write!(
                out,
                "<li class=\"artifact\" data-artifact=\"{n}\">{n} ({} bytes{})</li>",
                a.bytes,
                if a.blank { ", blank" } else { "" },
                n = escape(&a.artifact),
            );
        }
        out.push_str("</ul>");
    }
    for a in d.artifacts.iter().filter(|a| !a.content.trim().is_empty()) {
        let cut = if a.truncated {
            format!(
                "<p class=\"truncated\">truncated: the first {} of {} bytes are shown</p>",
                a.content.len(),
                a.bytes
            )
        } else {
            String::new()
        };
        let _ = write!(
            out,
            "<article class=\"artifact-text{}\" data-artifact=\"{n}\"><h3>{n}</h3>{}{cut}</article>",
            if a.truncated { " truncated" } else { "" },
            render_markdown(&a.content),
            n = escape(&a.artifact),
        );
    }
    out.push_str("</section>");
    out
}

/// A run's trace id: a link through `trace_url` when one is configured, else the id.
fn trace_cell(trace_id: &str, trace_url: Option<&str>) -> String {
    if trace_id.is_empty() {
        return "-".into();
    }
    match trace_url {
        Some(t) => format!(
            "<a class=\"trace\" href=\"{}\" rel=\"noopener noreferrer\"><code>{}</code></a>",
            escape(&trace_link(t, trace_id)),
            escape(trace_id)
        ),
        None => format!("<code class=\"trace\">{}</code>", escape(trace_id)),
    }
}

/// The run history, oldest first: where, why, how it ended, peak context vs estimate, and
/// its trace.
fn runs(runs: &[pb::Run], trace_url: Option<&str>, now: SystemTime) -> String {
    let mut out = String::from("<section id=\"runs\"><h2>Runs</h2>");
    if runs.is_empty() {
        out.push_str("<p class=\"empty\">no runs yet</p></section>");
        return out;
    }
    out.push_str(
        "<table><thead><tr><th>worker</th><th>phase</th><th>state</th><th>started</th><th>took</th>\
         <th>peak / estimate</th><th>why</th><th>trace</th></tr></thead><tbody>",
    );
    for r in runs {
        let took = match (since(r.started_at.as_ref(), now), r.ended_at.as_ref()) {
            (Some(_), Some(_)) => {
                let start = since(r.started_at.as_ref(), now).unwrap_or_default();
                let end = since(r.ended_at.as_ref(), now).unwrap_or_default();
                human_duration(start.saturating_sub(end))
            }
            (Some(d), None) => format!("{} so far", human_duration(d)),
            _ => "-".into(),
        };
        let mut state = r.state.clone();
        if !r.stop_reason.is_empty() {
            state = format!("{state}: {}", r.stop_reason);
        }
        if !r.detail.is_empty() {
            state = format!("{state} ({})", r.detail);
        }
        let peak = if r.peak_context_source.is_empty() {
            ktokens(r.peak_context_tokens)
        } else {
            format!(
                "{} ({})",
                ktokens(r.peak_context_tokens),
                r.peak_context_source
            )
        };
        let _ = write!(
            out,
            "<tr class=\"run\" data-token=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} / {}</td><td class=\"why\">{}</td><td>{}</td></tr>",
            r.token,
            escape(&r.worker),
            escape(&r.phase),
            escape(&state),
            escape(&time_text(r.started_at.as_ref())),
            escape(&took),
            escape(&peak),
            escape(&ktokens(r.estimated_tokens)),
            escape(&r.why),
            trace_cell(&r.trace_id, trace_url),
        );
        if !r.warnings.is_empty() || !r.output_tail.is_empty() {
            out.push_str("<tr class=\"run-extra\"><td colspan=\"8\">");
            for w in &r.warnings {
                let _ = write!(out, "<p class=\"warning\">{}</p>", escape(w));
            }
            if !r.output_tail.is_empty() {
                let _ = write!(
                    out,
                    "<details><summary>last output</summary><pre class=\"tail\">{}</pre></details>",
                    escape(&r.output_tail)
                );
            }
            out.push_str("</td></tr>");
        }
    }
    out.push_str("</tbody></table></section>");
    out
}

/// What an agent in this state may and may not do.
fn guidance(g: Option<&pb::Guidance>) -> String {
    let Some(g) = g else {
        return String::new();
    };
    let list = |items: &[String]| -> String {
        items
            .iter()
            .map(|i| format!("<li>{}</li>", escape(i)))
            .collect()
    };
    format!(
        "<section id=\"guidance\"><h2>Guidance</h2><h3>allowed</h3><ul>{}</ul><h3>forbidden</h3><ul>{}</ul>{}</section>",
        list(&g.allowed),
        list(&g.forbidden),
        if g.command.is_empty() {
            String::new()
        } else {
            format!("<p>next: <code>{}</code></p>", escape(&g.command))
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(name: &str, state: &str) -> pb::TaskSummary {
        pb::TaskSummary {
            task: name.into(),
            state: state.into(),
            ..Default::default()
        }
    }

    fn sub(name: &str, state: &str, wave: u32) -> pb::TaskSummary {
        pb::TaskSummary {
            wave,
            ..task(name, state)
        }
    }

    fn ts(secs: i64) -> Option<Timestamp> {
        Some(Timestamp {
            seconds: secs,
            nanos: 0,
        })
    }

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_000_000)
    }

    #[test]
    fn board_columns_and_waves() {
        let mut shop = task("shop", "decomposition:approved");
        shop.subtasks = vec![
            sub("shop/api", "implement", 1),
            sub("shop/db", "complete", 1),
            sub("shop/ui", "new", 2),
        ];
        let tasks = vec![shop, task("docs", "design:awaiting_approval")];
        let html = render_board(&tasks, &[], &BoardFilter::default(), now());
        for p in phases() {
            assert!(
                html.contains(&format!("class=\"column\" data-phase=\"{p}\"")),
                "{p}"
            );
        }
        assert!(html.contains("data-task=\"docs\" data-phase=\"design\""));
        let w1 = html.find("data-wave=\"1\"").expect("wave 1");
        let w2 = html.find("data-wave=\"2\"").expect("wave 2");
        let api = html.find("data-task=\"shop/api\"").expect("api");
        let db = html.find("data-task=\"shop/db\"").expect("db");
        let ui = html.find("data-task=\"shop/ui\"").expect("ui");
        assert!(w1 < api && api < w2 && db < w2 && w2 < ui, "{html}");
        assert!(html.contains("href=\"/task/shop/api\""));
        // The parent's card is in its column, its sub-tasks inside it.
        let col = html
            .find("data-phase=\"decomposition\"><h2>")
            .expect("column");
        assert!(col < w1);
    }

    #[test]
    fn board_filters() {
        let mut shop = task("shop", "decomposition:approved");
        shop.subtasks = vec![
            sub("shop/api", "implement", 1),
            sub("shop/db", "complete", 1),
        ];
        let mut stuck = task("stuck", "implement");
        stuck.attention = "⚠️ **HUMAN INTERVENTION REQUIRED**: loop".into();
        let tasks = vec![
            shop,
            task("docs", "design:awaiting_approval"),
            stuck,
            task("x", "human_intervention"),
        ];
        let f = BoardFilter {
            phase: Some("implement".into()),
            needs_person: false,
        };
        let html = render_board(&tasks, &[], &f, now());
        assert!(html.contains("data-task=\"shop/api\""));
        assert!(!html.contains("data-task=\"shop/db\""));
        assert!(!html.contains("data-task=\"docs\""));
        assert!(html.contains("data-refresh=\"/board?phase=implement&amp;fragment=1\""));
        let f = BoardFilter {
            phase: None,
            needs_person: true,
        };
        let html = render_board(&tasks, &[], &f, now());
        assert!(html.contains("data-task=\"docs\""));
        assert!(html.contains("data-task=\"stuck\""));
        assert!(html.contains("data-task=\"x\""));
        assert!(!html.contains("data-task=\"shop\""));
    }

    #[test]
    fn board_escapes_names_and_shows_ages() {
        let mut t = task("<script>alert(1)</script>", "implement");
        t.lease_holder = "w1/agent".into();
        t.waiting = "<b>needs</b>".into();
        let workers = vec![pb::WorkerInfo {
            name: "w1".into(),
            leases: vec![pb::WorkerLease {
                task: t.task.clone(),
                phase: "implement".into(),
                token: 7,
            }],
            runs: vec![pb::Run {
                token: 7,
                started_at: ts(1_000_000 - 125),
                ..Default::default()
            }],
            ..Default::default()
        }];
        let html = render_board(&[t], &workers, &BoardFilter::default(), now());
        assert!(!html.contains("<script>"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        assert!(
            html.contains("href=\"/task/%3Cscript%3Ealert%281%29%3C/script%3E\""),
            "{html}"
        );
        assert!(html.contains("running 2m 5s"), "{html}");
    }

    #[test]
    fn fleet_workers_and_gpus() {
        let w = pb::WorkerInfo {
            name: "gpu-a".into(),
            state: "busy".into(),
            capacity: 2,
            gpus: vec![
                pb::Gpu {
                    name: "NVIDIA H200".into(),
                    total_bytes: 140 << 30,
                    free_bytes: 100 << 30,
                    ..Default::default()
                },
                pb::Gpu {
                    index: 1,
                    name: "NVIDIA H200".into(),
                    ..Default::default()
                },
            ],
            budget: Some(pb::Budget {
                model_context_kb: 128_000,
                max_peak_context_kb: 90_000,
                source: "vram-physics (llama-3.1-8b, 24 GiB free)".into(),
                ..Default::default()
            }),
            leases: vec![pb::WorkerLease {
                task: "shop/api".into(),
                phase: "implement".into(),
                token: 3,
            }],
            runs: vec![pb::Run {
                token: 3,
                state: "active".into(),
                started_at: ts(1_000_000 - 42),
                ..Default::default()
            }],
            ..Default::default()
        };
        let lost = pb::WorkerInfo {
            name: "<i>x".into(),
            state: "lost".into(),
            ..Default::default()
        };
        let html = render_fleet(&[w, lost], Some("tok"), now());
        assert!(html.contains("class=\"worker\" data-name=\"gpu-a\" data-state=\"busy\""));
        assert_eq!(html.matches("class=\"gpu\"").count(), 2);
        assert!(html.contains("100.0/140.0 GiB free"));
        assert!(html.contains("context window 128k"));
        assert!(html.contains("llama-3.1-8b"));
        assert!(
            html.contains("shop/api</a> (implement, run active, for 42s)"),
            "{html}"
        );
        assert!(html.contains("action=\"/action/drain\""));
        assert!(html.contains("name=\"csrf\" value=\"tok\""));
        assert!(html.contains("data-name=\"&lt;i&gt;x\""));
        assert_eq!(
            html.matches("/action/drain").count(),
            1,
            "no drain for a lost worker"
        );
        let ro = render_fleet(&[], None, now());
        assert!(!ro.contains("<form"));
    }

    fn detail(state: &str) -> pb::TaskDetail {
        pb::TaskDetail {
            summary: Some(task("shop/<script>x</script>", state)),
            ..Default::default()
        }
    }

    fn view(csrf: Option<&str>) -> TaskView<'_> {
        TaskView {
            csrf,
            trace_url: None,
            now: now(),
        }
    }

    #[test]
    fn task_page_escapes_and_offers_approve() {
        let mut d = detail("design:awaiting_approval");
        d.approval = Some(pb::ApprovalStatus {
            status: "awaiting".into(),
            artifact: "DESIGN.md".into(),
            ..Default::default()
        });
        d.artifacts = vec![
            pb::ArtifactFile {
                artifact: "DESIGN.md".into(),
                bytes: 34,
                content: "# Plan\n<script>alert(1)</script>".into(),
                ..Default::default()
            },
            pb::ArtifactFile {
                artifact: "SPEC.md".into(),
                bytes: 300_000,
                content: "x".repeat(10),
                truncated: true,
                ..Default::default()
            },
            pb::ArtifactFile {
                artifact: "blank.md".into(),
                bytes: 1,
                content: "\n".into(),
                blank: true,
                ..Default::default()
            },
        ];
        let html = render_task(&d, &view(Some("c")));
        assert!(!html.contains("<script"), "{html}");
        assert!(html.contains("id=\"approve\""));
        assert!(
            html.contains("data-artifact=\"DESIGN.md\"><h3>DESIGN.md</h3><h1>Plan</h1>"),
            "{html}"
        );
        assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
        // A text cut at the API's limit says so; only it is marked.
        assert_eq!(html.matches("class=\"artifact-text truncated\"").count(), 1);
        assert!(html.contains("truncated: the first 10 of 300000 bytes are shown"));
        // A blank file is listed, but has no text to render.
        assert!(html.contains("blank.md (1 bytes, blank)"));
        assert_eq!(html.matches("class=\"artifact-text").count(), 2);
        assert!(!render_task(&d, &view(None)).contains("id=\"approve\""));
        assert!(!render_task(&detail("implement"), &view(Some("c"))).contains("id=\"approve\""));
    }

    #[test]
    fn task_page_approval_runs_and_trace() {
        let mut d = detail("design:approved");
        d.approval = Some(pb::ApprovalStatus {
            status: "approved".into(),
            artifact: "DESIGN.md".into(),
            stale: true,
            record: Some(pb::ApprovalRecord {
                phase: "design".into(),
                approved_at: ts(0),
                approver: "ann".into(),
                sha256: "ab12".into(),
                commit: String::new(),
            }),
        });
        d.runs = vec![pb::Run {
            worker: "gpu-a".into(),
            phase: "implement".into(),
            state: "stopped".into(),
            stop_reason: "agent_error".into(),
            started_at: ts(1_000_000 - 100),
            ended_at: ts(1_000_000 - 40),
            estimated_tokens: 90_000,
            peak_context_tokens: 70_000,
            peak_context_source: "agent".into(),
            why: "largest free budget".into(),
            output_tail: "<oops>".into(),
            trace_id: "0af7651916cd43dd8448eb211c80319c".into(),
            ..Default::default()
        }];
        d.summary = Some(pb::TaskSummary {
            held: "3 failed runs".into(),
            ..task("shop", "design:approved")
        });
        let plain = render_task(&d, &view(Some("c")));
        assert!(
            plain.contains("<code class=\"trace\">0af7651916cd43dd8448eb211c80319c</code>"),
            "{plain}"
        );
        assert!(!plain.contains("href=\"http://j/"));
        let v = TaskView {
            trace_url: Some("http://j/trace/{trace_id}?x=<y>"),
            ..view(Some("c"))
        };
        let html = render_task(&d, &v);
        assert!(html.contains("class=\"stale\""));
        assert!(html.contains("<span class=\"approver\">ann</span> at 1970-01-01T00:00:00Z"));
        assert!(html.contains("<code class=\"sha256\">ab12</code>"));
        assert!(html.contains("70k (agent) / 90k"));
        assert!(html.contains("1m 0s"));
        assert!(html.contains("largest free budget"));
        assert!(html.contains("&lt;oops&gt;"));
        assert!(html.contains("id=\"resume\""));
        assert!(!html.contains("id=\"stop\""));
        assert!(
            html.contains(
                "<a class=\"trace\" href=\"http://j/trace/0af7651916cd43dd8448eb211c80319c?x=&lt;y&gt;\" rel=\"noopener noreferrer\"><code>0af7651916cd43dd8448eb211c80319c</code></a>"
            ),
            "{html}"
        );
    }

    #[test]
    fn output_panel_and_paths() {
        assert!(
            render_output_panel("shop/api")
                .contains("<pre id=\"output\" data-src=\"/output/shop/api\">")
        );
        assert_eq!(task_path("/task", "a b/c"), "/task/a%20b/c");
        assert_eq!(url_component("a&b"), "a%26b");
    }

    #[test]
    fn durations() {
        assert_eq!(human_duration(Duration::from_secs(42)), "42s");
        assert_eq!(human_duration(Duration::from_secs(303)), "5m 3s");
        assert_eq!(human_duration(Duration::from_secs(7500)), "2h 5m");
        assert_eq!(
            human_duration(Duration::from_secs(3 * 86400 + 4 * 3600)),
            "3d 4h"
        );
        assert_eq!(since(ts(2_000_000).as_ref(), now()), Some(Duration::ZERO));
        assert_eq!(time_text(None), "-");
    }

    fn delivery(state: &str) -> pb::Delivery {
        pb::Delivery {
            state: state.into(),
            mode: "merge".into(),
            strategy: "merge".into(),
            base: "main".into(),
            branch: "automaton/cart".into(),
            revision: "1111111111111111".into(),
            ..Default::default()
        }
    }

    fn delivered(d: pb::Delivery) -> pb::TaskSummary {
        pb::TaskSummary {
            delivery: Some(d),
            ..task("cart", "complete")
        }
    }

    #[test]
    fn board_shows_each_delivery_in_a_few_words() {
        let merged = pb::Delivery {
            commit: "abc123def4567890".into(),
            how: "merge commit".into(),
            ..delivery("merged")
        };
        let opened = pb::Delivery {
            mode: "pull_request".into(),
            number: 3,
            url: "https://forge.example/acme/shop/pull/3".into(),
            ..delivery("opened")
        };
        let approval = pb::Delivery {
            waiting: "awaiting an operator: `automaton deliver cart` lets 111 land on main".into(),
            ..delivery("requested")
        };
        let person = pb::Delivery {
            waiting: "⚠️ **HUMAN INTERVENTION REQUIRED**: <b>src/a.rs</b> changed on both sides"
                .into(),
            ..delivery("preparing")
        };
        let cases = [
            (merged, "merged into main at abc123def456 (merge commit)"),
            (
                opened,
                "<a class=\"pull-request\" href=\"https://forge.example/acme/shop/pull/3\" rel=\"noopener noreferrer\">pull request #3</a>",
            ),
            (approval, "awaiting approval to land on main"),
            (
                person,
                "waits: ⚠️ **HUMAN INTERVENTION REQUIRED**: &lt;b&gt;src/a.rs&lt;/b&gt; changed on both sides",
            ),
            (delivery("abandoned"), "abandoned"),
        ];
        for (d, want) in cases {
            let state = d.state.clone();
            let html = render_board(&[delivered(d)], &[], &BoardFilter::default(), now());
            assert!(
                html.contains(&format!(
                    "<div class=\"delivery\" data-state=\"{state}\">{want}</div>"
                )),
                "{state}: {html}"
            );
        }
        // Only http(s) URLs are links.
        let evil = pb::Delivery {
            number: 4,
            url: "javascript:alert(1)".into(),
            ..delivery("opened")
        };
        let html = render_board(&[delivered(evil)], &[], &BoardFilter::default(), now());
        assert!(!html.contains("href=\"javascript"), "{html}");
        assert!(
            html.contains("pull request #4 (javascript:alert(1))"),
            "{html}"
        );
        assert_eq!(web_url("HTTPS://x.example/1"), Some("HTTPS://x.example/1"));
        assert_eq!(web_url("https://x.example/ 1"), None);
    }

    #[test]
    fn a_waiting_delivery_needs_a_person_and_a_final_one_does_not() {
        let waits = delivered(pb::Delivery {
            waiting: "awaiting an operator".into(),
            ..delivery("requested")
        });
        assert!(needs_person(&waits));
        assert!(!needs_person(&delivered(delivery("merged"))));
        assert!(!needs_person(&delivered(delivery("preparing"))));
    }

    #[test]
    fn task_page_shows_the_delivery_and_offers_deliver_and_abandon_while_it_waits() {
        let d = pb::Delivery {
            waiting: "awaiting an operator: `automaton deliver cart` lets 111 land on main".into(),
            failure: "main moved <again>".into(),
            failures: 2,
            reworks: 1,
            requested_at: ts(1_000_000 - 90),
            remote: "origin".into(),
            ..delivery("requested")
        };
        let waiting = pb::TaskDetail {
            summary: Some(delivered(d)),
            ..Default::default()
        };
        let html = render_task(&waiting, &view(Some("c")));
        for want in [
            "<section id=\"delivery\" class=\"delivery\" data-state=\"requested\"><h2>Delivery</h2>",
            "<dt>base</dt><dd class=\"base\">main on origin</dd>",
            "<dt>branch</dt><dd class=\"branch\">automaton/cart</dd>",
            "<dt>revision</dt><dd class=\"revision\">1111111111111111</dd>",
            "<dt>mode</dt><dd class=\"mode\">merge, strategy merge</dd>",
            "<dt>last failure</dt><dd class=\"last-failure\">main moved &lt;again&gt; (2 failed so far)</dd>",
            "<dt>reworks</dt><dd class=\"reworks\">sent back to implement 1 time(s)</dd>",
            "<dt>requested</dt><dd class=\"requested\">1970-01-12T13:45:10Z (1m 30s ago)</dd>",
            "action=\"/action/deliver\"",
            "id=\"deliver\"",
            "action=\"/action/abandon\"",
            "name=\"reason\"",
            "id=\"abandon\"",
        ] {
            assert!(html.contains(want), "{want}: {html}");
        }
        // Without a session's CSRF token: the facts, no buttons.
        let ro = render_task(&waiting, &view(None));
        assert!(ro.contains("id=\"delivery\""));
        assert!(
            !ro.contains("/action/deliver") && !ro.contains("/action/abandon"),
            "{ro}"
        );
        // Going on by itself (nothing to approve): Abandon only.
        let going = pb::TaskDetail {
            summary: Some(delivered(delivery("ready"))),
            ..Default::default()
        };
        let html = render_task(&going, &view(Some("c")));
        assert!(!html.contains("id=\"deliver\""), "{html}");
        assert!(html.contains("id=\"abandon\""), "{html}");
        // Ended: no buttons at all; who and why are shown.
        for end in ["merged", "opened", "abandoned"] {
            let ended = pb::Delivery {
                waiting: "stale line".into(),
                abandoned_by: "ann".into(),
                failure: "superseded".into(),
                approved_by: "bob".into(),
                ..delivery(end)
            };
            let ended = pb::TaskDetail {
                summary: Some(delivered(ended)),
                ..Default::default()
            };
            let html = render_task(&ended, &view(Some("c")));
            assert!(!html.contains("id=\"deliver\""), "{end}: {html}");
            assert!(!html.contains("id=\"abandon\""), "{end}: {html}");
            assert!(
                html.contains("<dd class=\"approved-by\">bob</dd>"),
                "{html}"
            );
        }
        let gone = pb::TaskDetail {
            summary: Some(delivered(pb::Delivery {
                abandoned_by: "ann".into(),
                failure: "superseded".into(),
                ..delivery("abandoned")
            })),
            ..Default::default()
        };
        let html = render_task(&gone, &view(Some("c")));
        assert!(
            html.contains("<dt>reason</dt><dd class=\"reason\">superseded</dd>"),
            "{html}"
        );
        assert!(
            html.contains("<dd class=\"abandoned-by\">ann</dd>"),
            "{html}"
        );
        // No delivery: no section.
        assert!(!render_task(&detail("complete"), &view(Some("c"))).contains("id=\"delivery\""));
    }

    /// A live page's header says the connection and the data's freshness apart, in words a
    /// screen reader gets (`role=status`; the ticking age a `timer`, not announced each
    /// second), with the periods the script works by; other pages have no such status.
    #[test]
    fn a_live_page_says_its_connection_and_its_datas_freshness_apart() {
        let html = live_page("p", "Board", Some("ann"), Some("c"), "<section></section>");
        let header = &html
            [html.find("<header>").expect("a header")..html.find("</header>").expect("its end")];
        for part in [
            "<div id=\"liveness\" class=\"liveness\" data-alive-ms=\"2000\" data-stale-after-ms=\"10000\">",
            "<span id=\"connection\" role=\"status\" data-state=\"connecting\" hidden>connecting</span>",
            "<span id=\"freshness\" data-state=\"fresh\" hidden>",
            "<span id=\"stale\" role=\"status\"></span>",
            "<span id=\"age\" role=\"timer\"></span>",
            "<noscript>not live: scripts are off, reload to update</noscript>",
        ] {
            assert!(header.contains(part), "{part}: {header}");
        }
        // Before who is signed in: the operator's name stays last.
        assert!(
            header.find("liveness") < header.find("class=\"operator\""),
            "{header}"
        );
        for other in [
            page("p", "Refused", None, None, "x"),
            render_login("p", None),
            render_action_error("p", "no", "/board"),
        ] {
            assert!(!other.contains("id=\"liveness\""), "{other}");
        }
    }

    /// Each refreshable part says how old its data was when sent and where the feed stood
    /// when it was fetched (in its own opening tag); anything else is left as it was.
    #[test]
    fn a_refreshable_part_carries_its_datas_age_and_the_feeds_count() {
        let board = with_data_stamp(
            render_board(&[task("a", "new")], &[], &BoardFilter::default(), now()),
            Duration::from_millis(1500),
            42,
        );
        assert!(
            board.starts_with(
                "<section id=\"board\" data-age-ms=\"1500\" data-changes=\"42\" data-refresh=\"/board?fragment=1\">"
            ),
            "{board}"
        );
        let fleet = with_data_stamp(render_fleet(&[], None, now()), Duration::ZERO, 0);
        assert!(
            fleet.starts_with(
                "<section id=\"fleet\" data-age-ms=\"0\" data-changes=\"0\" data-refresh="
            ),
            "{fleet}"
        );
        let facts = with_data_stamp(
            render_task(&detail("new"), &view(None)),
            Duration::from_millis(7),
            3,
        );
        assert!(
            facts.starts_with(
                "<section id=\"task-facts\" data-age-ms=\"7\" data-changes=\"3\" data-refresh="
            ),
            "{facts}"
        );
        assert_eq!(facts.matches("data-age-ms").count(), 1, "{facts}");
        for other in [
            "<p>no part</p>",
            "<div><section data-refresh=\"/x\"></section></div>",
        ] {
            assert_eq!(with_data_stamp(other.to_string(), Duration::ZERO, 1), other);
        }
    }

    #[test]
    fn login_and_errors_escape() {
        let html = render_login("p<", Some("unknown <token>"));
        assert!(html.contains("id=\"login-error\""));
        assert!(html.contains("unknown &lt;token&gt;"));
        assert!(html.contains("<title>Sign in · p&lt;</title>"));
        let html = render_action_error("p", "no <way>", "/board");
        assert!(html.contains("<p id=\"action-error\" class=\"error\">no &lt;way&gt;</p>"));
    }
}
