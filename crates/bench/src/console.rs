//! `automaton-bench console`: the operator's console (issue 23) under a large project.
//!
//! A coordinator is spawned with `--web-listen 127.0.0.1:0` (no tokens: the console serves
//! loopback clients without sign-in; `AUTOMATON_WEB_MAX_STREAMS` above `--streams`, since
//! every stream comes from one address), `--tasks` tasks are created through the API (every
//! other one moved on to `research`, so the board has two full columns) and `--workers`
//! worker sessions register over `Workers.Session`, each with one simulated GPU, and
//! heartbeat for the whole run. Then:
//!
//! 1. **Pages**: `/board`, `/board?fragment=1` (what an open page fetches on an event),
//!    `/fleet` and `/task/NAME`, each fetched `--requests` times one after another over
//!    loopback (a fresh connection each): the time from sending the request to the last
//!    byte of the response (p50/p99), and the body's bytes. On loopback that is the
//!    console's time to ask the coordinator and render, plus the coordinator's answer.
//! 2. **Streams**: `--streams` `/events` streams held open for `--stream-duration` while a
//!    churn loop creates and moves on a task every `--churn-every` (two events each): the
//!    coordinator's CPU (utime+stime from /proc/PID/stat) over that time, its resident
//!    memory (VmRSS) when the streams are open and at the end (and the peak sampled), and
//!    the events each stream received.
//!
//! Between the two, **refresh**: after an event, `--streams` `/board?fragment=1` requests at
//! once (what that many open boards send), five rounds: the time until the last is served
//! and the coordinator's CPU per round.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as Out;
use pb::worker_message::Msg as In;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Semaphore, watch};
use tonic::transport::{Channel, Endpoint};

use crate::workers::{CLK_TCK, Percentiles, cpu_ticks, open_session, status_mib};
use crate::{parse_duration, spawn};

#[derive(clap::Args)]
pub struct ConsoleArgs {
    /// The coordinator binary to spawn (with `--web-listen 127.0.0.1:0`) on a fresh temp
    /// project.
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: PathBuf,
    /// Tasks created before measuring.
    #[arg(long, default_value_t = 1000)]
    tasks: usize,
    /// Worker sessions registered (one simulated GPU each) and kept alive.
    #[arg(long, default_value_t = 100)]
    workers: usize,
    /// Requests per page, one after another.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// `/events` streams held open at once.
    #[arg(long, default_value_t = 100)]
    streams: usize,
    /// How long the streams are held open.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    stream_duration: Duration,
    /// While the streams are open, a task is created and moved on every this long (two
    /// events each).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    churn_every: Duration,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Keep the temp folder (project, logs).
    #[arg(long)]
    keep_temp: bool,
}

#[derive(Serialize)]
struct PageResult {
    page: String,
    requests: usize,
    time: Percentiles,
    bytes: usize,
}

#[derive(Serialize)]
struct Refresh {
    /// Boards re-fetched at once after an event.
    pages: usize,
    rounds: usize,
    /// From the first request to the last response, per round.
    wall: Percentiles,
    /// The coordinator's CPU per round, in milliseconds.
    coordinator_cpu_ms: f64,
}

#[derive(Serialize)]
struct StreamResult {
    streams: usize,
    seconds: f64,
    events_sent: u64,
    /// Coordinator CPU over the window, in cores (1.0 = one core busy throughout).
    cpu_cores: Option<f64>,
    rss_open_mib: Option<f64>,
    rss_end_mib: Option<f64>,
    rss_peak_mib: Option<f64>,
    /// Change events each stream received: the least and the most.
    events_min: u64,
    events_max: u64,
    streams_ended_early: usize,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    tasks: usize,
    workers: usize,
    pages: Vec<PageResult>,
    refresh: Refresh,
    streams: StreamResult,
}

/// One GET over a fresh loopback connection: status, body bytes, time to the last byte.
async fn get(addr: &str, path: &str) -> Result<(u16, usize, Duration)> {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connect {addr}"))?;
    s.set_nodelay(true)?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::with_capacity(64 * 1024);
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .with_context(|| format!("GET {path}: no full answer within 30 s"))??;
    let took = started.elapsed();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("GET {path}: no HTTP header"))?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    Ok((status, raw.len() - split - 4, took))
}

async fn page(addr: &str, path: &str, requests: usize) -> Result<PageResult> {
    let mut times = Vec::with_capacity(requests);
    let mut bytes = 0;
    for _ in 0..requests {
        let (status, b, took) = get(addr, path).await?;
        if status != 200 {
            bail!("GET {path}: HTTP {status}");
        }
        bytes = b;
        times.push(took);
    }
    Ok(PageResult {
        page: path.to_string(),
        requests,
        time: Percentiles::of(times),
        bytes,
    })
}

/// A worker session that heartbeats on the granted interval until `stop`.
async fn worker(endpoint: Endpoint, i: usize, mut stop: watch::Receiver<bool>) -> Result<()> {
    let register = pb::Register {
        name: format!("console-w{i}"),
        host: format!("gpu-host-{i}"),
        gpus: vec![pb::Gpu {
            index: 0,
            name: "NVIDIA H200".into(),
            uuid: format!("SIM-{i}"),
            total_bytes: 141 << 30,
            free_bytes: 120 << 30,
            driver: "bench".into(),
        }],
        // Sessions only: no agent behind them, so the coordinator offers them nothing.
        capacity: 0,
        version: "bench".into(),
        simulated: true,
        replace: true,
        ram_bytes: 64 << 30,
        cpus: 16,
        ..Default::default()
    };
    let (_channel, tx, mut inbound, granted) = open_session(&endpoint, register, 4).await?;
    let interval = crate::workers::wire_duration(granted.heartbeat_interval.as_ref())
        .max(Duration::from_millis(100));
    let mut tick = tokio::time::interval(interval);
    let mut seq = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {
                seq += 1;
                let hb = pb::WorkerMessage { msg: Some(In::Heartbeat(pb::Heartbeat { seq })) };
                if tx.send(hb).await.is_err() {
                    bail!("worker {i}: the session's stream closed");
                }
            }
            m = crate::workers::next_message(&mut inbound) => match m? {
                Some(Out::Ack(_)) | Some(_) => {}
                None => bail!("worker {i}: the coordinator ended the session"),
            },
            _ = stop.changed() => {
                let bye = pb::WorkerMessage { msg: Some(In::Deregister(pb::Deregister {})) };
                let _ = tx.send(bye).await;
                return Ok(());
            }
        }
    }
}

/// One `/events` stream: counts `change` events until `stop`; false if it ended early.
async fn stream(addr: String, counter: Arc<AtomicU64>, mut stop: watch::Receiver<bool>) -> bool {
    let Ok(mut s) = TcpStream::connect(&addr).await else {
        return false;
    };
    let req = format!("GET /events HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n");
    if s.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = vec![0u8; 16 * 1024];
    let needle = b"event: change";
    // The tail of the last read, so a marker split across two reads is still counted.
    let mut carry: Vec<u8> = Vec::new();
    loop {
        tokio::select! {
            r = s.read(&mut buf) => match r {
                Ok(0) | Err(_) => return false,
                Ok(n) => {
                    carry.extend_from_slice(&buf[..n]);
                    let found = carry.windows(needle.len()).filter(|w| w == needle).count();
                    counter.fetch_add(found as u64, Ordering::Relaxed);
                    let keep = carry.len().min(needle.len() - 1);
                    carry.drain(..carry.len() - keep);
                }
            },
            _ = stop.changed() => return true,
        }
    }
}

fn project(scratch: &Path) -> Result<PathBuf> {
    let project = scratch.join("project");
    std::fs::create_dir_all(&project)?;
    std::fs::write(project.join(".agent.md"), "Mode: multi-agent\n")
        .context("write the project's .agent.md")?;
    Ok(project)
}

/// The console's `host:port`, from the coordinator's `console on http://ADDR/` line.
fn console_addr(stdout_log: &Path) -> Result<String> {
    let text = std::fs::read_to_string(stdout_log)
        .with_context(|| format!("read {}", stdout_log.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("console on http://"))
        .map(|a| a.trim_end_matches('/').to_string())
        .with_context(|| format!("no `console on` line in {}", stdout_log.display()))
}

async fn create_tasks(channel: &Channel, n: usize) -> Result<()> {
    let gate = Arc::new(Semaphore::new(16));
    let mut set = tokio::task::JoinSet::new();
    for i in 0..n {
        let mut tasks = pb::tasks_client::TasksClient::new(channel.clone());
        let gate = gate.clone();
        set.spawn(async move {
            let _permit = gate.acquire().await;
            let task = format!("bench-{i:04}");
            tasks
                .create_task(pb::CreateTaskRequest { task: task.clone() })
                .await
                .map_err(crate::rpc::status_err)?;
            if i % 2 == 1 {
                tasks
                    .transition(pb::TransitionRequest {
                        task,
                        target: "research".into(),
                        ..Default::default()
                    })
                    .await
                    .map_err(crate::rpc::status_err)?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r.context("join")??;
    }
    Ok(())
}

/// Rounds of [`refresh`].
const REFRESH_ROUNDS: usize = 5;

/// After an event, `--streams` concurrent `/board?fragment=1` requests (what that many open
/// boards send): the time until the last is served, and the coordinator's CPU per round.
async fn refresh(args: &ConsoleArgs, channel: &Channel, web: &str, pid: &str) -> Result<Refresh> {
    let mut walls = Vec::new();
    let mut ticks = 0u64;
    let mut tasks = pb::tasks_client::TasksClient::new(channel.clone());
    for round in 0..REFRESH_ROUNDS {
        tasks
            .create_task(pb::CreateTaskRequest {
                task: format!("refresh-{round}"),
            })
            .await
            .map_err(crate::rpc::status_err)?;
        // The event reaches the console's feed (pages would re-fetch 500 ms after it).
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = cpu_ticks(pid);
        let started = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..args.streams {
            let web = web.to_string();
            set.spawn(async move { get(&web, "/board?fragment=1").await });
        }
        while let Some(r) = set.join_next().await {
            let (status, _, _) = r.context("join")??;
            if status != 200 {
                bail!("GET /board?fragment=1: HTTP {status}");
            }
        }
        walls.push(started.elapsed());
        if let (Some(a), Some(b)) = (before, cpu_ticks(pid)) {
            ticks += b.saturating_sub(a);
        }
    }
    Ok(Refresh {
        pages: args.streams,
        rounds: REFRESH_ROUNDS,
        wall: Percentiles::of(walls),
        coordinator_cpu_ms: ticks as f64 / CLK_TCK * 1e3 / REFRESH_ROUNDS as f64,
    })
}

async fn measure(args: &ConsoleArgs, grpc_url: &str, web: &str, pid: &str) -> Result<Report> {
    let endpoint = Endpoint::from_shared(grpc_url.to_string())?;
    let channel = endpoint.connect().await.context("connect to the API")?;
    let t = Instant::now();
    create_tasks(&channel, args.tasks).await?;
    eprintln!("created {} tasks in {:.1?}", args.tasks, t.elapsed());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut workers = tokio::task::JoinSet::new();
    for i in 0..args.workers {
        workers.spawn(worker(endpoint.clone(), i, stop_rx.clone()));
    }
    // Every session registered before the pages are timed.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed = pb::workers_client::WorkersClient::new(channel.clone())
            .list_workers(pb::ListWorkersRequest {})
            .await
            .map_err(crate::rpc::status_err)?
            .into_inner()
            .workers;
        if listed.len() >= args.workers {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "{} of {} workers registered in 60 s",
                listed.len(),
                args.workers
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!("{} worker sessions registered", args.workers);

    let mut pages = Vec::new();
    for path in ["/board", "/board?fragment=1", "/fleet", "/task/bench-0001"] {
        // One unmeasured request warms the connection to the API.
        get(web, path).await?;
        let r = page(web, path, args.requests).await?;
        eprintln!(
            "{path}: p50 {:.2} ms, p99 {:.2} ms, {} bytes",
            r.time.p50_ms, r.time.p99_ms, r.bytes
        );
        pages.push(r);
    }

    // What the pages ask the coordinator, alone: the share of a page's time that is the API's.
    for (what, list_tasks) in [("ListTasks (gRPC)", true), ("ListWorkers (gRPC)", false)] {
        let mut times = Vec::with_capacity(args.requests);
        let mut bytes = 0;
        for _ in 0..args.requests {
            let t = Instant::now();
            bytes = if list_tasks {
                let r = pb::tasks_client::TasksClient::new(channel.clone())
                    .list_tasks(pb::ListTasksRequest {})
                    .await
                    .map_err(crate::rpc::status_err)?;
                prost::Message::encoded_len(r.get_ref())
            } else {
                let r = pb::workers_client::WorkersClient::new(channel.clone())
                    .list_workers(pb::ListWorkersRequest {})
                    .await
                    .map_err(crate::rpc::status_err)?;
                prost::Message::encoded_len(r.get_ref())
            };
            times.push(t.elapsed());
        }
        let r = PageResult {
            page: what.to_string(),
            requests: args.requests,
            time: Percentiles::of(times),
            bytes,
        };
        eprintln!(
            "{what}: p50 {:.2} ms, p99 {:.2} ms, {} bytes",
            r.time.p50_ms, r.time.p99_ms, r.bytes
        );
        pages.push(r);
    }

    // Every open board re-fetches after an event: `--streams` boards at once, after each of
    // a few events.
    let refresh = refresh(args, &channel, web, pid).await?;
    eprintln!(
        "{} boards refreshing at once: all served in p50 {:.0} ms, coordinator CPU {:.0} ms a round",
        refresh.pages, refresh.wall.p50_ms, refresh.coordinator_cpu_ms
    );

    // The streams, with events flowing from a churn loop.
    let counters: Vec<Arc<AtomicU64>> = (0..args.streams)
        .map(|_| Arc::new(AtomicU64::new(0)))
        .collect();
    let (sstop_tx, sstop_rx) = watch::channel(false);
    let mut streams = tokio::task::JoinSet::new();
    for c in &counters {
        streams.spawn(stream(web.to_string(), c.clone(), sstop_rx.clone()));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_open = status_mib(pid, "VmRSS:");
    let ticks0 = cpu_ticks(pid);
    let started = Instant::now();
    let mut peak = rss_open.unwrap_or(0.0);
    let mut sent = 0u64;
    let mut churn = tokio::time::interval(args.churn_every);
    let mut tasks = pb::tasks_client::TasksClient::new(channel.clone());
    let mut i = 0usize;
    while started.elapsed() < args.stream_duration {
        churn.tick().await;
        let task = format!("churn-{i:05}");
        i += 1;
        tasks
            .create_task(pb::CreateTaskRequest { task: task.clone() })
            .await
            .map_err(crate::rpc::status_err)?;
        tasks
            .transition(pb::TransitionRequest {
                task,
                target: "research".into(),
                ..Default::default()
            })
            .await
            .map_err(crate::rpc::status_err)?;
        sent += 2;
        if let Some(m) = status_mib(pid, "VmRSS:") {
            peak = peak.max(m);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let ticks1 = cpu_ticks(pid);
    let rss_end = status_mib(pid, "VmRSS:");
    // Let the last events arrive before the streams close.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = sstop_tx.send(true);
    let mut ended_early = 0;
    while let Some(r) = streams.join_next().await {
        if !r.unwrap_or(false) {
            ended_early += 1;
        }
    }
    let counts: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    let cpu_cores = match (ticks0, ticks1) {
        (Some(a), Some(b)) => Some((b.saturating_sub(a)) as f64 / CLK_TCK / seconds),
        _ => None,
    };
    let _ = stop_tx.send(true);
    while let Some(r) = workers.join_next().await {
        if let Ok(Err(e)) = r {
            eprintln!("a worker session failed: {e:#}");
        }
    }
    Ok(Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        tasks: args.tasks,
        workers: args.workers,
        pages,
        refresh,
        streams: StreamResult {
            streams: args.streams,
            seconds,
            events_sent: sent,
            cpu_cores,
            rss_open_mib: rss_open,
            rss_end_mib: rss_end,
            rss_peak_mib: Some(peak).filter(|p| *p > 0.0),
            events_min: counts.iter().copied().min().unwrap_or(0),
            events_max: counts.iter().copied().max().unwrap_or(0),
            streams_ended_early: ended_early,
        },
    })
}

fn table(r: &Report) -> String {
    let mut out = format!(
        "console: {} tasks, {} worker sessions\n| page | requests | p50 ms | p99 ms | bytes |\n| --- | --- | --- | --- | --- |\n",
        r.tasks, r.workers
    );
    for p in &r.pages {
        out.push_str(&format!(
            "| `{}` | {} | {:.2} | {:.2} | {} |\n",
            p.page, p.requests, p.time.p50_ms, p.time.p99_ms, p.bytes
        ));
    }
    out.push_str(&format!(
        "\n{} boards re-fetched at once after an event ({} rounds): all served in p50 {:.0} ms (max {:.0} ms); coordinator CPU {:.0} ms a round\n",
        r.refresh.pages,
        r.refresh.rounds,
        r.refresh.wall.p50_ms,
        r.refresh.wall.max_ms,
        r.refresh.coordinator_cpu_ms
    ));
    let s = &r.streams;
    let mib = |v: Option<f64>| v.map(|m| format!("{m:.1}")).unwrap_or_else(|| "-".into());
    out.push_str(&format!(
        "\n| streams | seconds | events sent | coordinator CPU (cores) | RSS open MiB | RSS end MiB | RSS peak MiB | events per stream (min–max) | ended early |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n| {} | {:.0} | {} | {} | {} | {} | {} | {}–{} | {} |\n",
        s.streams,
        s.seconds,
        s.events_sent,
        s.cpu_cores.map(|c| format!("{c:.3}")).unwrap_or_else(|| "-".into()),
        mib(s.rss_open_mib),
        mib(s.rss_end_mib),
        mib(s.rss_peak_mib),
        s.events_min,
        s.events_max,
        s.streams_ended_early,
    ));
    out
}

pub async fn run(args: ConsoleArgs) -> Result<()> {
    if args.requests == 0 || args.churn_every.is_zero() {
        bail!("--requests and --churn-every must be above 0");
    }
    crate::workers::ensure_nofile((args.workers + args.streams) as u64 * 2 + 256)?;
    let scratch = spawn::scratch_dir()?;
    let outcome = async {
        let project = project(&scratch)?;
        let extra = vec![
            "--web-listen".to_string(),
            "127.0.0.1:0".to_string(),
            "--heartbeat-interval".to_string(),
            "2s".to_string(),
            "--session-timeout".to_string(),
            "10s".to_string(),
        ];
        // Every stream comes from one address with no tokens: room for all of them.
        let cap = ("AUTOMATON_WEB_MAX_STREAMS", (args.streams + 16).to_string());
        let mut s =
            spawn::coordinator_env(&args.spawn_coordinator, &project, &scratch, &extra, &[cap])?;
        let web = console_addr(&scratch.join("coordinator.stdout"))?;
        eprintln!(
            "spawned coordinator at {} (pid {}), console on http://{web}/",
            s.url,
            s.pid()
        );
        let pid = s.pid().to_string();
        let r = measure(&args, &s.url.clone(), &web, &pid).await;
        let how = s.stop();
        eprintln!("{how} (log: {})", s.log.display());
        r
    }
    .await;
    if args.keep_temp || outcome.is_err() {
        eprintln!("kept {}", scratch.display());
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let report = outcome?;
    print!("{}", table(&report));
    if let Some(path) = &args.json_out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_console_address_comes_from_its_line() {
        let dir = tempfile::tempdir().expect("tmp");
        let out = dir.path().join("coordinator.stdout");
        std::fs::write(
            &out,
            "console on http://127.0.0.1:4321/\nlistening on 127.0.0.1:7070\n",
        )
        .expect("write");
        assert_eq!(console_addr(&out).expect("addr"), "127.0.0.1:4321");
        std::fs::write(&out, "listening on 127.0.0.1:7070\n").expect("write");
        let e = console_addr(&out).expect_err("no console line");
        assert!(e.to_string().contains("no `console on` line"), "{e}");
    }
}
