//! `automaton top`: a full-screen dashboard of the fleet and the tasks. Each event on the
//! coordinator's stream triggers a re-fetch of `ListWorkers` and `ListTasks` (at most four a
//! second); a quiet second re-fetches the workers alone and a 1 s tick redraws, so heartbeat
//! ages stay true; `q`, Esc, Ctrl-C (or SIGINT, SIGTERM, SIGHUP) quit and restore the terminal.
//! The header says two things apart (seed 003): the connection to the event stream
//! (`connected`, `reconnecting (why)`) and how old the data shown is (`fresh`, `data 12s old`),
//! which keeps counting while disconnected: the screen never passes for current when it is
//! not ([`Freshness`]).
//!
//! The proto messages become a [`Snapshot`] in one function ([`snapshot`]); drawing is a pure
//! function of that snapshot ([`render`]), tested with ratatui's `TestBackend`.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Stdout};
use std::sync::Arc;
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use automaton_workflow::{State, WorkerState};
use clap::Args;
use ratatui::Frame;
use ratatui::Terminal;
use ratatui::backend::CrosstermBackend;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table};
use tokio::sync::{Notify, mpsc};
use tonic::transport::Channel;

use crate::backend::Failure;
use crate::watch::{Link, backoff, describe};

const WHAT: &str = "automaton top";

/// The deadline of each `ListWorkers` / `ListTasks` call.
const CALL: Duration = Duration::from_secs(5);

/// The smallest terminal the dashboard is drawn in; below it, one line says so.
pub(crate) const MIN_WIDTH: u16 = 72;
pub(crate) const MIN_HEIGHT: u16 = 16;

#[derive(Debug, Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub target: crate::workers::Target,
}

/// The fleet and the tasks as of one fetch.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Snapshot {
    pub workers: Vec<WorkerRow>,
    /// Tasks and sub-tasks.
    pub tasks: usize,
    /// `(state, how many)`, in lifecycle order; unknown states last.
    pub phases: Vec<(String, usize)>,
    /// Decomposed tasks and their waves.
    pub parents: Vec<Parent>,
    /// `(task, why it waits)`: for a worker, for a person, or held.
    pub waiting: Vec<(String, String)>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct WorkerRow {
    pub name: String,
    /// `idle`, `busy`, `draining`, `reconnecting`, `lost`.
    pub state: String,
    pub gpus: Vec<Gpu>,
    pub simulated: bool,
    /// The largest sub-task it takes (estimated peak context, tokens).
    pub budget_tokens: u64,
    /// `task (phase, run state)` per lease.
    pub work: Vec<String>,
    /// Heartbeat age when fetched.
    pub heard: Duration,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Gpu {
    pub name: String,
    pub free_bytes: u64,
    pub total_bytes: u64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Parent {
    pub task: String,
    pub state: String,
    pub waves: Vec<Wave>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Wave {
    pub number: u32,
    /// Sub-tasks that reached a terminal state (`complete`, `human_intervention`).
    pub done: usize,
    pub total: usize,
}

/// The only place that reads the coordinator's messages: everything `top` shows comes
/// through here.
pub(crate) fn snapshot(workers: Vec<pb::WorkerInfo>, tasks: Vec<pb::TaskSummary>) -> Snapshot {
    let workers = workers
        .into_iter()
        .map(|w| WorkerRow {
            work: w
                .leases
                .iter()
                .map(|l| match w.runs.iter().find(|r| r.token == l.token) {
                    Some(r) => format!("{} ({}, run {})", l.task, l.phase, r.state),
                    None => format!("{} ({})", l.task, l.phase),
                })
                .collect(),
            gpus: w
                .gpus
                .into_iter()
                .map(|g| Gpu {
                    name: g.name,
                    free_bytes: g.free_bytes,
                    total_bytes: g.total_bytes,
                })
                .collect(),
            budget_tokens: w.budget.map_or(0, |b| b.max_peak_context_kb),
            heard: Duration::from_millis(crate::from_wire::millis(w.heartbeat_age.as_ref())),
            name: w.name,
            state: w.state,
            simulated: w.simulated,
        })
        .collect();
    let all: Vec<&pb::TaskSummary> = tasks
        .iter()
        .flat_map(|t| std::iter::once(t).chain(t.subtasks.iter()))
        .collect();
    // Known states in lifecycle order (`State`'s order), then whatever else came.
    let mut phases: BTreeMap<(Option<State>, String), usize> = BTreeMap::new();
    for t in &all {
        let key = match t.state.parse::<State>() {
            Ok(s) => (Some(s), t.state.clone()),
            Err(_) if t.state.is_empty() => (None, "unknown".to_string()),
            Err(_) => (None, t.state.clone()),
        };
        *phases.entry(key).or_default() += 1;
    }
    let (known, unknown): (Vec<_>, Vec<_>) =
        phases.into_iter().partition(|((s, _), _)| s.is_some());
    let phases = known
        .into_iter()
        .chain(unknown)
        .map(|((_, name), n)| (name, n))
        .collect();
    let parents = tasks
        .iter()
        .filter_map(|t| {
            let mut waves: BTreeMap<u32, Wave> = BTreeMap::new();
            for s in t.subtasks.iter().filter(|s| s.wave > 0) {
                let w = waves.entry(s.wave).or_insert_with(|| Wave {
                    number: s.wave,
                    ..Wave::default()
                });
                w.total += 1;
                if s.state.parse::<State>().is_ok_and(State::is_terminal) {
                    w.done += 1;
                }
            }
            (!waves.is_empty()).then(|| Parent {
                task: t.task.clone(),
                state: t.state.clone(),
                waves: waves.into_values().collect(),
            })
        })
        .collect();
    let waiting = all
        .iter()
        .filter_map(|t| {
            let why = if !t.held.is_empty() {
                format!("HELD: {}", t.held)
            } else if !t.waiting.is_empty() {
                t.waiting.clone()
            } else if t.state.ends_with(":awaiting_approval") {
                format!("awaits approval: automaton approve {}", t.task)
            } else {
                return None;
            };
            Some((t.task.clone(), why))
        })
        .collect();
    Snapshot {
        workers,
        tasks: all.len(),
        phases,
        parents,
        waiting,
    }
}

/// The event stream, as the header says it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Connection {
    /// Not open yet.
    Connecting,
    Connected,
    /// Down, and why (reopened with backoff).
    Reconnecting(String),
}

impl Connection {
    pub(crate) fn text(&self) -> String {
        match self {
            Connection::Connecting => "connecting".into(),
            Connection::Connected => "connected".into(),
            Connection::Reconnecting(why) => format!("reconnecting ({why})"),
        }
    }
}

/// Data younger than this is `fresh`: the workers are re-fetched every quiet second.
pub(crate) const FRESH_FOR: Duration = Duration::from_secs(3);

/// When what `top` shows was last known current. The workers are as of their last fetch;
/// the tasks as of their last full fetch, or of a later workers-only fetch when the event
/// stream has been up since before that full fetch (no event, no change). The data is as old
/// as its older part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Freshness {
    workers: Instant,
    tasks: Instant,
}

impl Freshness {
    /// Everything fetched at `at`.
    pub(crate) fn new(at: Instant) -> Freshness {
        Freshness {
            workers: at,
            tasks: at,
        }
    }

    /// A fetch that started at `started` succeeded: the tasks too when `full`. `live_since`:
    /// since when the event stream has been up (`None`: it is down).
    pub(crate) fn fetched(&mut self, started: Instant, full: bool, live_since: Option<Instant>) {
        self.workers = self.workers.max(started);
        let unchanged = live_since.is_some_and(|l| l <= self.tasks);
        if full || unchanged {
            self.tasks = self.tasks.max(started);
        }
    }

    /// How old the data shown is at `now`.
    pub(crate) fn age(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.workers.min(self.tasks))
    }
}

/// The data's age as the header says it: `fresh`, `data 12s old`, `data 3m05s old`.
pub(crate) fn data_age(d: Duration) -> String {
    if d < FRESH_FOR {
        return "fresh".into();
    }
    let s = d.as_secs();
    if s < 60 {
        format!("data {s}s old")
    } else if s < 3600 {
        format!("data {}m{:02}s old", s / 60, s % 60)
    } else {
        format!("data {}h{:02}m old", s / 3600, s % 3600 / 60)
    }
}

/// Everything one frame shows.
pub(crate) struct Screen<'a> {
    pub snapshot: &'a Snapshot,
    pub address: &'a str,
    pub connection: &'a Connection,
    /// How old the data shown is ([`Freshness::age`]): it grows while disconnected.
    pub data_age: Duration,
    /// Why the last fetch failed (cleared by the next that succeeds).
    pub refresh_failed: Option<&'a str>,
    /// Since the workers were fetched (heartbeat ages grow by it).
    pub since: Duration,
}

const GIB: f64 = (1u64 << 30) as f64;

fn age(d: Duration) -> String {
    let s = d.as_secs();
    if s < 60 {
        format!("{:.1}s", d.as_secs_f64())
    } else if s < 3600 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{}h{:02}m", s / 3600, s % 3600 / 60)
    }
}

fn count(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

fn gpu_text(w: &WorkerRow) -> String {
    if w.gpus.is_empty() {
        return "none".into();
    }
    let list: Vec<String> = w
        .gpus
        .iter()
        .map(|g| {
            format!(
                "{} {:.1}/{:.1} GiB",
                g.name,
                g.free_bytes as f64 / GIB,
                g.total_bytes as f64 / GIB
            )
        })
        .collect();
    format!(
        "{}{}",
        list.join(", "),
        if w.simulated { " (sim)" } else { "" }
    )
}

fn state_style(state: Option<WorkerState>) -> Style {
    match state {
        Some(WorkerState::Idle) => Style::new().fg(Color::Green),
        Some(WorkerState::Busy) => Style::new().fg(Color::Cyan),
        Some(WorkerState::Draining | WorkerState::Reconnecting) => Style::new().fg(Color::Yellow),
        Some(WorkerState::Lost) => Style::new().fg(Color::Red),
        None => Style::new(),
    }
}

fn width(cells: impl Iterator<Item = usize>, head: &str, cap: usize) -> Constraint {
    let w = cells.max().unwrap_or(0).max(head.chars().count()).min(cap);
    Constraint::Length(u16::try_from(w).unwrap_or(u16::MAX))
}

/// Draws one frame. Pure: the same screen gives the same cells.
pub(crate) fn render(frame: &mut Frame, s: &Screen) {
    let area = frame.area();
    if area.width < MIN_WIDTH || area.height < MIN_HEIGHT {
        let msg = format!(
            "Terminal too small ({}x{}): automaton top needs {MIN_WIDTH}x{MIN_HEIGHT}. q quits.",
            area.width, area.height
        );
        frame.render_widget(Paragraph::new(msg), area);
        return;
    }
    let snap = s.snapshot;
    let workers_h = u16::try_from(snap.workers.len().max(1) + 3).unwrap_or(u16::MAX);
    let waiting_h = u16::try_from(snap.waiting.len().clamp(1, 8) + 2).unwrap_or(10);
    let [head, workers, middle, waiting] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Max(workers_h),
        Constraint::Min(5),
        Constraint::Length(waiting_h),
    ])
    .areas(area);

    frame.render_widget(Paragraph::new(header(s, snap)), head);

    let block = |title: String| Block::new().borders(Borders::ALL).title(title);
    if snap.workers.is_empty() {
        frame.render_widget(
            Paragraph::new(
                "No workers: start automaton-worker --coordinator URL on each GPU machine.",
            )
            .block(block(" Workers ".into())),
            workers,
        );
    } else {
        let rows: Vec<[String; 6]> = snap
            .workers
            .iter()
            .map(|w| {
                [
                    w.name.clone(),
                    w.state.clone(),
                    gpu_text(w),
                    format!("{}k", w.budget_tokens / 1000),
                    if w.work.is_empty() {
                        "-".into()
                    } else {
                        w.work.join(", ")
                    },
                    age(w.heard + s.since),
                ]
            })
            .collect();
        let head = [
            "NAME",
            "STATE",
            "GPU (FREE/TOTAL VRAM)",
            "BUDGET",
            "TASK (PHASE)",
            "HEARD",
        ];
        let col =
            |i: usize, cap: usize| width(rows.iter().map(|r| r[i].chars().count()), head[i], cap);
        let widths = [
            col(0, 24),
            col(1, 12),
            col(2, 48),
            col(3, 8),
            Constraint::Fill(1),
            col(5, 8),
        ];
        let table = Table::new(
            rows.iter().zip(&snap.workers).map(|(r, w)| {
                Row::new(r.iter().enumerate().map(|(i, c)| {
                    let cell = Cell::from(c.clone());
                    if i == 1 {
                        cell.style(state_style(w.state.parse().ok()))
                    } else {
                        cell
                    }
                }))
            }),
            widths,
        )
        .header(Row::new(head).style(Style::new().add_modifier(Modifier::BOLD)))
        .block(block(format!(" Workers ({}) ", snap.workers.len())));
        frame.render_widget(table, workers);
    }

    let [phases, waves] =
        Layout::horizontal([Constraint::Length(36), Constraint::Fill(1)]).areas(middle);
    let phase_lines: Vec<Line> = if snap.phases.is_empty() {
        vec![Line::raw("No tasks")]
    } else {
        snap.phases
            .iter()
            .map(|(p, n)| Line::raw(format!("{n:>4}  {p}")))
            .collect()
    };
    frame.render_widget(
        Paragraph::new(phase_lines).block(block(format!(" Tasks by phase ({}) ", snap.tasks))),
        phases,
    );

    let mut wave_lines: Vec<Line> = Vec::new();
    for p in &snap.parents {
        wave_lines.push(Line::from(vec![
            Span::styled(p.task.clone(), Style::new().add_modifier(Modifier::BOLD)),
            Span::raw(format!("  {}", p.state)),
        ]));
        let current = p.waves.iter().find(|w| w.done < w.total).map(|w| w.number);
        for w in &p.waves {
            let mut l = format!("  wave {}: {}/{}", w.number, w.done, w.total);
            if Some(w.number) == current {
                l.push_str("  <- now");
            }
            wave_lines.push(Line::raw(l));
        }
    }
    if wave_lines.is_empty() {
        wave_lines.push(Line::raw("No decomposed tasks"));
    }
    frame.render_widget(
        Paragraph::new(wave_lines).block(block(" Waves (done/total) ".into())),
        waves,
    );

    let wait_lines: Vec<Line> = if snap.waiting.is_empty() {
        vec![Line::raw("Nothing waits")]
    } else {
        snap.waiting
            .iter()
            .map(|(t, why)| {
                Line::from(vec![
                    Span::styled(t.clone(), Style::new().add_modifier(Modifier::BOLD)),
                    Span::raw(format!("  {why}")),
                ])
            })
            .collect()
    };
    frame.render_widget(
        Paragraph::new(wait_lines).block(block(format!(" Waiting ({}) ", snap.waiting.len()))),
        waiting,
    );
}

/// The header: counts, then the data's age, then the connection — two facts, each in its own
/// words and colour; what can be long (why) comes last.
fn header<'a>(s: &Screen, snap: &Snapshot) -> Line<'a> {
    let attention = Style::new().fg(Color::Yellow).add_modifier(Modifier::BOLD);
    let data = data_age(s.data_age);
    let data_style = if s.data_age < FRESH_FOR {
        Style::new().fg(Color::Green)
    } else {
        attention
    };
    let connection_style = match s.connection {
        Connection::Connected => Style::new().fg(Color::Green),
        _ => attention,
    };
    let mut spans = vec![
        Span::styled("automaton top", Style::new().add_modifier(Modifier::BOLD)),
        Span::raw(format!(
            " (q quits)  {}  {}, {}  ",
            s.address,
            count(snap.workers.len(), "worker"),
            count(snap.tasks, "task"),
        )),
        Span::styled(data, data_style),
        Span::raw("  "),
        Span::styled(s.connection.text(), connection_style),
    ];
    // Connected but not current: say why (while reconnecting, the connection says it).
    if let (Connection::Connected, Some(why)) = (s.connection, s.refresh_failed) {
        spans.push(Span::styled(format!("  refresh failed ({why})"), attention));
    }
    Line::from(spans)
}

/// What the dashboard's loop reacts to.
enum Update {
    /// A fetch that started at `started` (of the tasks too when `full`) ended.
    Fetched {
        result: Result<Snapshot, String>,
        started: Instant,
        full: bool,
    },
    /// The event stream opened or broke, at that instant.
    Link(Connection, Instant),
    Redraw,
    Quit,
}

/// Raw mode and the alternate screen for as long as it lives; restored on drop, so every
/// way out (quit, error, panic) gives the terminal back as it was.
struct Tui;

impl Tui {
    fn enter() -> std::io::Result<(Tui, Terminal<CrosstermBackend<Stdout>>)> {
        use ratatui::crossterm::{cursor, execute, terminal};
        terminal::enable_raw_mode()?;
        let tui = Tui;
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            Tui::restore();
            previous(info);
        }));
        execute!(
            std::io::stdout(),
            terminal::EnterAlternateScreen,
            cursor::Hide
        )?;
        let terminal = Terminal::new(CrosstermBackend::new(std::io::stdout()))?;
        Ok((tui, terminal))
    }

    fn restore() {
        use ratatui::crossterm::{cursor, execute, terminal};
        let _ = terminal::disable_raw_mode();
        let _ = execute!(
            std::io::stdout(),
            terminal::LeaveAlternateScreen,
            cursor::Show
        );
    }
}

impl Drop for Tui {
    fn drop(&mut self) {
        Tui::restore();
    }
}

/// What the refresher keeps between fetches: the channel (while the address stays the same)
/// and the last task list (a tick re-fetches only the workers).
#[derive(Default)]
struct Cache {
    channel: Option<(String, Channel)>,
    tasks: Option<Vec<pb::TaskSummary>>,
}

/// Fetches the workers, and the tasks when `tasks` is set or none were fetched yet.
async fn fetch(link: &Link, cache: &mut Cache, tasks: bool) -> Result<Snapshot, Failure> {
    let address = link.leader(WHAT).await?;
    let channel = match &cache.channel {
        Some((a, c)) if *a == address => c.clone(),
        _ => {
            let c = Link::channel(&address)?;
            cache.channel = Some((address, c.clone()));
            c
        }
    };
    let workers = pb::workers_client::WorkersClient::new(channel.clone())
        .list_workers(link.request(pb::ListWorkersRequest {}, Some(CALL)))
        .await?
        .into_inner()
        .workers;
    let tasks = match (&cache.tasks, tasks) {
        (Some(t), false) => t.clone(),
        _ => {
            let t = pb::tasks_client::TasksClient::new(channel)
                .list_tasks(link.request(pb::ListTasksRequest {}, Some(CALL)))
                .await?
                .into_inner()
                .tasks;
            cache.tasks = Some(t.clone());
            t
        }
    };
    Ok(snapshot(workers, tasks))
}

/// Follows the event stream: every event wakes the refresher; a broken stream is reopened
/// with backoff, and the dashboard says so meanwhile.
async fn follow(link: Arc<Link>, tx: mpsc::Sender<Update>, wake: Arc<Notify>) {
    let mut attempt = 0;
    loop {
        let why = match link.events(WHAT).await {
            Ok((_, mut stream)) => {
                attempt = 0;
                // Before the wake: the fetch it causes starts after the stream was up.
                let opened = Update::Link(Connection::Connected, Instant::now());
                if tx.send(opened).await.is_err() {
                    return;
                }
                // What changed while the stream was down.
                wake.notify_one();
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => wake.notify_one(),
                        Ok(None) => break "the stream ended".to_string(),
                        Err(s) => break s.message().to_string(),
                    }
                }
            }
            Err(f) => describe(&f),
        };
        let broke = Update::Link(Connection::Reconnecting(why), Instant::now());
        if tx.send(broke).await.is_err() {
            return;
        }
        tokio::time::sleep(backoff(attempt)).await;
        attempt = attempt.saturating_add(1);
    }
}

/// When to fetch: everything when an event woke it, at most four times a second however
/// fast events come (wake-ups during a fetch or the pause after it collapse into one); the
/// workers alone after a quiet second, so heartbeat ages stay true between events.
struct Pacer {
    wake: Arc<Notify>,
    last_full: Option<tokio::time::Instant>,
}

impl Pacer {
    const GAP: Duration = Duration::from_millis(250);
    const QUIET: Duration = Duration::from_secs(1);

    /// Waits for the next fetch; true when it should fetch everything.
    async fn next(&mut self) -> bool {
        if let Some(t) = self.last_full {
            tokio::time::sleep_until(t + Pacer::GAP).await;
        }
        let everything = tokio::select! {
            _ = self.wake.notified() => true,
            _ = tokio::time::sleep(Pacer::QUIET) => false,
        };
        if everything {
            self.last_full = Some(tokio::time::Instant::now());
        }
        everything
    }
}

async fn refresh(link: Arc<Link>, mut cache: Cache, tx: mpsc::Sender<Update>, wake: Arc<Notify>) {
    let mut pacer = Pacer {
        wake,
        last_full: None,
    };
    // After a failed fetch the next is a full one: the event that asked for the last may
    // have gone unanswered.
    let mut owed = false;
    loop {
        let full = pacer.next().await || owed;
        let started = Instant::now();
        let result = fetch(&link, &mut cache, full)
            .await
            .map_err(|f| describe(&f));
        owed = result.is_err();
        let update = Update::Fetched {
            result,
            started,
            full,
        };
        if tx.send(update).await.is_err() {
            return;
        }
    }
}

/// Reads keys on a thread of its own (crossterm's reads block) until the dashboard ends.
fn keys(tx: mpsc::Sender<Update>) {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
    std::thread::spawn(move || {
        while !tx.is_closed() {
            match event::poll(Duration::from_millis(100)) {
                Ok(false) => continue,
                Ok(true) => {}
                Err(_) => {
                    let _ = tx.blocking_send(Update::Quit);
                    return;
                }
            }
            let update = match event::read() {
                Ok(Event::Key(k)) if k.kind == KeyEventKind::Press => match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => Update::Quit,
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                        Update::Quit
                    }
                    _ => continue,
                },
                Ok(Event::Resize(..)) => Update::Redraw,
                Ok(_) => continue,
                Err(_) => Update::Quit,
            };
            if tx.blocking_send(update).is_err() {
                return;
            }
        }
    });
}

/// Resolves on SIGINT, SIGTERM or SIGHUP (the terminal went away): every way the dashboard is
/// told to stop gives the terminal back. A signal that cannot be watched never fires.
async fn stopped() {
    use tokio::signal::unix::{Signal, SignalKind, signal};
    async fn on(s: Option<Signal>) {
        match s {
            Some(mut s) => {
                s.recv().await;
            }
            None => std::future::pending().await,
        }
    }
    tokio::select! {
        _ = on(signal(SignalKind::interrupt()).ok()) => {}
        _ = on(signal(SignalKind::terminate()).ok()) => {}
        _ = on(signal(SignalKind::hangup()).ok()) => {}
    }
}

async fn dashboard(link: Link) -> Result<(), Failure> {
    let mut address = link.address(WHAT)?;
    // Before the screen changes: a coordinator that cannot answer is a one-line error.
    let mut cache = Cache::default();
    let started = Instant::now();
    let mut snap = fetch(&link, &mut cache, true).await?;
    let mut fetched = Instant::now();
    let mut freshness = Freshness::new(started);
    let mut connection = Connection::Connecting;
    let mut live_since: Option<Instant> = None;
    let mut fetch_error: Option<String> = None;

    let (_tui, mut terminal) =
        Tui::enter().map_err(|e| Failure::Usage(format!("cannot take over the terminal: {e}")))?;
    let link = Arc::new(link);
    let (tx, mut rx) = mpsc::channel(64);
    let wake = Arc::new(Notify::new());
    let follower = tokio::spawn(follow(link.clone(), tx.clone(), wake.clone()));
    let refresher = tokio::spawn(refresh(link.clone(), cache, tx.clone(), wake));
    keys(tx);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let interrupted = stopped();
    tokio::pin!(interrupted);
    let outcome = loop {
        let screen = Screen {
            snapshot: &snap,
            address: &address,
            connection: &connection,
            data_age: freshness.age(Instant::now()),
            refresh_failed: fetch_error.as_deref(),
            since: fetched.elapsed(),
        };
        if let Err(e) = terminal.draw(|f| render(f, &screen)) {
            break Err(Failure::Usage(format!("cannot draw on the terminal: {e}")));
        }
        tokio::select! {
            u = rx.recv() => match u {
                Some(Update::Fetched { result: Ok(s), started, full }) => {
                    snap = s;
                    fetched = Instant::now();
                    freshness.fetched(started, full, live_since);
                    fetch_error = None;
                    if let Ok(a) = link.address(WHAT) {
                        address = a;
                    }
                }
                Some(Update::Fetched { result: Err(e), .. }) => fetch_error = Some(e),
                Some(Update::Link(c, at)) => {
                    live_since = (c == Connection::Connected).then_some(at);
                    connection = c;
                }
                Some(Update::Redraw) => {}
                Some(Update::Quit) | None => break Ok(()),
            },
            _ = tick.tick() => {}
            _ = &mut interrupted => break Ok(()),
        }
    };
    follower.abort();
    refresher.abort();
    drop(terminal);
    outcome
}

/// Runs `automaton top`; returns the exit code.
pub fn run(args: &TopArgs) -> i32 {
    let out = (|| {
        if !std::io::stdout().is_terminal() {
            return Err(Failure::Usage(
                "automaton top needs a terminal; use `automaton watch --json`".into(),
            ));
        }
        let link = Link::new(
            args.target.project.as_deref(),
            args.target.coordinator.as_deref(),
        )?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Failure::Usage(format!("cannot start the async runtime: {e}")))?;
        runtime.block_on(dashboard(link))
    })();
    match out {
        Ok(()) => 0,
        Err(f) => crate::report_failure(f, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ratatui::backend::TestBackend;

    fn gpu(name: &str, gib: u64, free_gib: u64) -> pb::Gpu {
        pb::Gpu {
            name: name.into(),
            total_bytes: gib << 30,
            free_bytes: free_gib << 30,
            ..Default::default()
        }
    }

    fn worker(name: &str, state: &str, gpus: Vec<pb::Gpu>, budget: u64) -> pb::WorkerInfo {
        pb::WorkerInfo {
            name: name.into(),
            state: state.into(),
            gpus,
            simulated: true,
            budget: Some(pb::Budget {
                max_peak_context_kb: budget,
                ..Default::default()
            }),
            heartbeat_age: Some(automaton_proto::prost_types::Duration {
                seconds: 0,
                nanos: 400_000_000,
            }),
            ..Default::default()
        }
    }

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

    /// Three workers of different GPUs, a parent in wave 2, a task waiting for a worker.
    fn fleet() -> Snapshot {
        let mut busy = worker("gpu-b", "busy", vec![gpu("sim-b", 24, 20)], 38_000);
        busy.leases = vec![pb::WorkerLease {
            task: "feature/api".into(),
            phase: "implement".into(),
            token: 7,
        }];
        busy.runs = vec![pb::Run {
            phase: "implement".into(),
            token: 7,
            state: "active".into(),
            ..Default::default()
        }];
        let workers = vec![
            worker("gpu-a", "idle", vec![gpu("sim-a", 8, 8)], 9_000),
            busy,
            worker(
                "gpu-h",
                "draining",
                vec![gpu("sim-h0", 80, 80), gpu("sim-h1", 80, 79)],
                120_000,
            ),
        ];
        let mut parent = task("feature", "decomposition:approved");
        parent.subtasks = vec![
            sub("feature/schema", "complete", 1),
            sub("feature/model", "complete", 1),
            sub("feature/api", "implement", 2),
            sub("feature/ui", "new", 2),
            sub("feature/docs", "new", 3),
        ];
        parent.subtasks[3].waiting =
            "waiting: needs 90k tokens; largest idle worker holds 9k (gpu-a, 8 GiB)".into();
        let gate = task("fix-login", "design:awaiting_approval");
        snapshot(workers, vec![parent, gate])
    }

    fn draw(snap: &Snapshot, w: u16, h: u16) -> String {
        draw_with(
            snap,
            w,
            h,
            &Connection::Connected,
            Duration::from_millis(600),
            None,
        )
    }

    fn draw_with(
        snap: &Snapshot,
        w: u16,
        h: u16,
        connection: &Connection,
        data_age: Duration,
        refresh_failed: Option<&str>,
    ) -> String {
        let mut terminal = Terminal::new(TestBackend::new(w, h)).expect("test backend");
        let screen = Screen {
            snapshot: snap,
            address: "http://127.0.0.1:7070",
            connection,
            data_age,
            refresh_failed,
            since: Duration::from_millis(600),
        };
        terminal
            .draw(|f| render(f, &screen))
            .expect("draw on the test backend");
        let buf = terminal.backend().buffer();
        buf.content()
            .chunks(usize::from(w))
            .map(|row| row.iter().map(|c| c.symbol()).collect::<String>())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn line_with<'a>(screen: &'a str, needle: &str) -> &'a str {
        screen
            .lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line shows {needle:?}:\n{screen}"))
    }

    #[test]
    fn render_shows_three_workers_with_their_gpus_budget_task_and_heartbeat() {
        let screen = draw(&fleet(), 140, 30);
        let a = line_with(&screen, "gpu-a");
        assert!(
            a.contains("idle") && a.contains("sim-a 8.0/8.0 GiB") && a.contains("9k"),
            "{a}"
        );
        let b = line_with(&screen, "gpu-b");
        assert!(
            b.contains("busy") && b.contains("sim-b 20.0/24.0 GiB") && b.contains("38k"),
            "{b}"
        );
        assert!(b.contains("feature/api (implement, run active)"), "{b}");
        // The heartbeat age as fetched plus the time since: 0.4 s + 0.6 s.
        assert!(b.contains("1.0s"), "{b}");
        let h = line_with(&screen, "gpu-h");
        assert!(
            h.contains("draining") && h.contains("sim-h0 80.0/80.0 GiB, sim-h1 79.0/80.0 GiB"),
            "{h}"
        );
        assert!(h.contains("120k"), "{h}");
        assert!(screen.contains("Workers (3)"), "{screen}");
    }

    #[test]
    fn render_shows_the_decomposed_parent_in_wave_2_and_phase_counts() {
        let screen = draw(&fleet(), 140, 30);
        assert!(line_with(&screen, "wave 1: 2/2").contains("wave 1: 2/2"));
        assert!(
            line_with(&screen, "wave 2: 0/2").contains("<- now"),
            "{screen}"
        );
        assert!(
            !line_with(&screen, "wave 3: 0/1").contains("<- now"),
            "{screen}"
        );
        assert!(line_with(&screen, "   2  complete").contains("complete"));
        assert!(line_with(&screen, "   2  new").contains("new"));
        assert!(screen.contains("Tasks by phase (7)"), "{screen}");
    }

    #[test]
    fn render_shows_waiting_tasks_with_their_reasons() {
        let screen = draw(&fleet(), 140, 30);
        let ui = line_with(&screen, "feature/ui  waiting: needs 90k tokens");
        assert!(ui.contains("largest idle worker holds 9k"), "{ui}");
        assert!(
            line_with(&screen, "fix-login  awaits approval")
                .contains("automaton approve fix-login"),
            "{screen}"
        );
        assert!(screen.contains("Waiting (2)"), "{screen}");
    }

    #[test]
    fn phases_are_counted_in_lifecycle_order() {
        let snap = fleet();
        let counts: Vec<(&str, usize)> =
            snap.phases.iter().map(|(p, n)| (p.as_str(), *n)).collect();
        assert_eq!(
            counts,
            [
                ("new", 2),
                ("decomposition:approved", 1),
                ("design:awaiting_approval", 1),
                ("implement", 1),
                ("complete", 2),
            ]
        );
    }

    #[test]
    fn a_terminal_too_small_gets_one_line_not_a_panic() {
        for (w, h) in [
            (40, 10),
            (1, 1),
            (MIN_WIDTH - 1, MIN_HEIGHT),
            (MIN_WIDTH, MIN_HEIGHT - 1),
        ] {
            let screen = draw(&fleet(), w, h);
            let message = format!("Terminal too small ({w}x{h}): automaton top needs");
            let first = screen.lines().next().unwrap_or("").trim_end();
            assert!(!first.is_empty(), "{w}x{h}: an empty screen");
            assert!(
                message.starts_with(first) || first.starts_with(&message),
                "{w}x{h}: {screen}"
            );
            assert!(!screen.contains("gpu-a"), "{w}x{h}: {screen}");
        }
        // At the minimum, the dashboard itself.
        assert!(draw(&fleet(), MIN_WIDTH, MIN_HEIGHT).contains("gpu-a"));
    }

    #[tokio::test]
    async fn refreshes_are_paced_to_four_a_second_however_fast_events_come() {
        let wake = Arc::new(Notify::new());
        let storm = {
            let wake = wake.clone();
            tokio::spawn(async move {
                loop {
                    wake.notify_one();
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        };
        let mut pacer = Pacer {
            wake,
            last_full: None,
        };
        let start = tokio::time::Instant::now();
        let mut full = 0;
        while start.elapsed() < Duration::from_secs(2) {
            assert!(
                pacer.next().await,
                "events keep coming: every fetch is a full one"
            );
            full += 1;
        }
        storm.abort();
        // 2 s at one per 250 ms, plus the first at once.
        assert!((5..=9).contains(&full), "{full} full fetches in 2 s");
    }

    #[tokio::test]
    async fn a_quiet_second_fetches_the_workers_alone() {
        let mut pacer = Pacer {
            wake: Arc::new(Notify::new()),
            last_full: None,
        };
        let start = tokio::time::Instant::now();
        assert!(!pacer.next().await);
        assert!(start.elapsed() >= Pacer::QUIET);
    }

    fn head(connection: &Connection, data_age: Duration, failed: Option<&str>) -> String {
        let screen = draw_with(&fleet(), 140, 30, connection, data_age, failed);
        screen.lines().next().unwrap_or("").trim_end().to_string()
    }

    /// Seed 003: the connection and the data's age are two facts, each in its own words, side
    /// by side: connected and fresh, reconnecting with data 12 s old, and connected with
    /// data 15 s old because refreshes fail (never one slot for both).
    #[test]
    fn header_says_the_connection_and_the_datas_age_apart() {
        let h = head(&Connection::Connected, Duration::from_millis(600), None);
        assert!(h.ends_with("3 workers, 7 tasks  fresh  connected"), "{h}");
        let why = Connection::Reconnecting("connection refused".into());
        let h = head(&why, Duration::from_secs(12), Some("connection refused"));
        assert!(
            h.ends_with("3 workers, 7 tasks  data 12s old  reconnecting (connection refused)"),
            "{h}"
        );
        let h = head(
            &Connection::Connected,
            Duration::from_secs(15),
            Some("deadline has elapsed"),
        );
        assert!(
            h.ends_with("data 15s old  connected  refresh failed (deadline has elapsed)"),
            "{h}"
        );
        let h = head(&Connection::Connecting, Duration::ZERO, None);
        assert!(h.ends_with("fresh  connecting"), "{h}");
        for h in [h, head(&why, Duration::from_secs(90), None)] {
            assert!(!h.contains("live") && !h.contains("updated"), "{h}");
        }
    }

    #[test]
    fn the_datas_age_reads_fresh_then_in_whole_seconds_minutes_hours() {
        for (ms, says) in [
            (0, "fresh"),
            (2_999, "fresh"),
            (3_000, "data 3s old"),
            (12_400, "data 12s old"),
            (65_000, "data 1m05s old"),
            (3_720_000, "data 1h02m old"),
        ] {
            assert_eq!(data_age(Duration::from_millis(ms)), says, "{ms} ms");
        }
    }

    /// The data's age keeps counting while the stream is down (workers-only fetches that
    /// succeed then vouch for the workers, not for the tasks), and a reopened stream vouches
    /// for nothing until a full fetch after it.
    #[test]
    fn the_datas_age_counts_on_while_disconnected_until_a_full_fetch_after_reconnecting() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut f = Freshness::new(t0);
        // The stream opens at 1 s; its wake's full fetch at 2 s; quiet seconds after.
        f.fetched(at(2), true, Some(at(1)));
        f.fetched(at(3), false, Some(at(1)));
        assert_eq!(f.age(at(3)), Duration::ZERO);
        // Down from 3.5 s: workers-only fetches vouch for the workers alone.
        f.fetched(at(4), false, None);
        assert_eq!(f.age(at(5)), Duration::from_secs(2));
        // Nothing answers: the age grows.
        assert_eq!(f.age(at(15)), Duration::from_secs(12));
        // Back at 16 s: a workers-only fetch before the full one does not vouch for tasks.
        f.fetched(at(17), false, Some(at(16)));
        assert_eq!(f.age(at(17)), Duration::from_secs(14));
        f.fetched(at(18), true, Some(at(16)));
        assert_eq!(f.age(at(18)), Duration::ZERO);
        // A late answer to an older fetch does not make the data look older.
        f.fetched(at(10), true, Some(at(16)));
        assert_eq!(f.age(at(18)), Duration::ZERO);
    }

    #[test]
    fn header_shows_the_address_and_the_counts() {
        let h = head(&Connection::Connected, Duration::ZERO, None);
        assert!(
            h.contains("(q quits)  http://127.0.0.1:7070  3 workers, 7 tasks"),
            "{h}"
        );
        let one = snapshot(
            vec![worker("gpu-a", "idle", vec![], 0)],
            vec![task("t", "new")],
        );
        let head = draw(&one, 140, 30);
        assert!(head.contains("1 worker, 1 task  fresh"), "{head}");
    }

    #[test]
    fn no_workers_and_no_tasks_say_so() {
        let screen = draw(&snapshot(vec![], vec![]), 100, 20);
        assert!(
            screen.contains("No workers: start automaton-worker"),
            "{screen}"
        );
        assert!(screen.contains("No tasks"), "{screen}");
        assert!(screen.contains("Nothing waits"), "{screen}");
    }

    #[test]
    fn two_leases_in_one_phase_show_each_its_own_run() {
        let mut w = worker("gpu-c", "busy", vec![gpu("sim-c", 80, 60)], 90_000);
        w.capacity = 2;
        w.leases = vec![
            pb::WorkerLease {
                task: "p/a".into(),
                phase: "implement".into(),
                token: 11,
            },
            pb::WorkerLease {
                task: "p/b".into(),
                phase: "implement".into(),
                token: 12,
            },
        ];
        // Runs are listed in another order than the leases.
        w.runs = vec![
            pb::Run {
                phase: "implement".into(),
                token: 12,
                state: "finishing".into(),
                ..Default::default()
            },
            pb::Run {
                phase: "implement".into(),
                token: 11,
                state: "active".into(),
                ..Default::default()
            },
        ];
        let s = snapshot(vec![w], vec![]);
        assert_eq!(
            s.workers[0].work,
            vec![
                "p/a (implement, run active)".to_string(),
                "p/b (implement, run finishing)".to_string()
            ]
        );
    }
}
