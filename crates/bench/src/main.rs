//! `automaton-bench leases`: lease throughput and latency of the automaton coordinator, side
//! by side with etcd 3.4 doing the equivalent work with its own leases.
//!
//! | op      | automaton                                  | etcd                                    |
//! |---------|--------------------------------------------|-----------------------------------------|
//! | claim   | `Leases.Claim` of a task in `research`     | `LeaseGrant` + put-if-absent `Txn`      |
//! | renew   | one `KeepAlive` request → one response     | one `LeaseKeepAlive` request → response |
//! | release | `Leases.Release` with lease id and token   | `LeaseRevoke`                           |
//!
//! Each of C clients works on its own tasks (keys), so every call succeeds and nothing
//! contends: the figures are throughput, not refusals. Clients are closed-loop (one call in
//! flight each). By default each client has its own HTTP/2 connection (`--connections 0`),
//! for both systems alike; `--connections N` spreads the clients over N shared connections
//! (tonic client only). Both systems are called through the same client (`rpc.rs`): by
//! default the raw one of `wire.rs`, which takes the least CPU from the servers on a shared
//! machine; `--client tonic` measures through the stock tonic client instead.
//! The two systems take turns (`--slices`, 5 by default): each measures for duration/slices,
//! then the other, and so on, and each system's slices are added up. The disk under both
//! changes its sync speed from minute to minute; taking turns lets that drift reach both
//! alike instead of deciding the ratio. See `backend.rs` for how the phases are timed.
//!
//! `--spawn-echo` (or `--echo URL`) adds a third system to the same slices: this binary's
//! `echo-server`, the coordinator's API with no work behind it, measured through the same
//! client as the others. Its renewals are the zero-work ceiling of a bidi `KeepAlive` round
//! trip on this machine, and the coordinator's renewals are reported as a share of it
//! (target ≥ 0.8). Its claims and releases, answered from nothing, are the ceiling of a
//! unary call: shown as a share too, with no target (the coordinator's are durable). The echo
//! needs no preparation: it grants any task.

mod backend;
mod console;
mod coord;
mod delivery;
mod dispatch;
mod echo;
mod etcd;
mod failover;
mod ha;
mod ha_leases;
mod ha_workers;
mod inline;
mod otlp;
mod phases;
mod restart;
mod rpc;
mod spawn;
mod stats;
mod wire;
mod workers;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use serde::Serialize;
use tonic::transport::Channel;

use crate::backend::Backend;
use crate::rpc::ClientKind;
use crate::stats::{OpStats, Sample, fmt_ms};

const AUTOMATON: &str = "automaton";
const ETCD: &str = "etcd";
/// The zero-work echo server (`--spawn-echo`, `--echo URL`).
const ECHO: &str = "echo";
/// Renewals reach at least this share of the echo server's in the same run.
const ECHO_TARGET: f64 = 0.8;
/// The coordinator exporting traces (`leases --compare-export`).
const TRACED: &str = "automaton+otlp";
/// The second coordinator of an A/A control run (`--export-control`): exporting nothing.
const CONTROL: &str = "automaton-b";
/// With export on, claims keep at least this share of their throughput with it off.
const EXPORT_TARGET: f64 = 0.90;
const OPS: [&str; 3] = ["claim", "renew", "release"];

#[derive(Parser)]
#[command(name = "automaton-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Claim, renew (KeepAlive) and release throughput and latency at each client count.
    Leases(LeasesArgs),
    /// Time from `kill -9` to serving again on a project with many task folders, against a
    /// small project's restart.
    Restart(restart::RestartArgs),
    /// Many worker sessions (one connection each) heartbeating one coordinator: its CPU and
    /// memory, the heartbeat round trip, and how soon a silent session's leases end.
    Workers(workers::WorkersArgs),
    /// kill -9 of the leading coordinator of an HA pair on a 3-member etcd cluster, again and
    /// again: the time until a claim is granted through whichever coordinator leads.
    Failover(failover::FailoverArgs),
    /// Claims and releases per second of the coordinator with `--store etcd` on a spawned
    /// 3-member cluster, against one etcd `Txn` per claim and per release on the same
    /// cluster (and the files-mode coordinator), in one run.
    HaLeases(ha_leases::HaLeasesArgs),
    /// Tasks driven through every phase by `automaton-worker --agent scripted` processes,
    /// gates approved at once: phase turnaround, artifact upload throughput, tasks/minute.
    Phases(phases::PhasesArgs),
    /// One wave of sub-tasks dispatched to many simulated workers of mixed budgets: the time
    /// from the decomposition's approval to the last assignment, every assignment checked.
    Dispatch(dispatch::DispatchArgs),
    /// Top-level tasks completing at once with `merge` delivery into one `main`: complete →
    /// merged per task and merges per second, against `git merge` one after another; a
    /// decomposition's sub-tasks merged into their parent's branch, against `git merge`.
    Delivery(delivery::DeliveryArgs),
    /// The operator's console (`--web-listen`) over a large project: board, fleet and task
    /// page times and bytes; then many open event streams, the coordinator's CPU and memory.
    Console(console::ConsoleArgs),
    /// An OTLP/gRPC trace sink that counts what it is sent and keeps nothing (export to it
    /// with OTEL_EXPORTER_OTLP_ENDPOINT=http://ADDR).
    OtlpSink {
        #[arg(long, default_value = "127.0.0.1:4317")]
        listen: std::net::SocketAddr,
    },
    /// The coordinator's API with no work behind it (no leases, no disk): what tonic and the
    /// kernel cost here, the ceiling for `leases --coordinator URL`.
    EchoServer {
        #[arg(long, default_value = "127.0.0.1:0")]
        listen: std::net::SocketAddr,
        /// Serve on the h2 crate directly instead of tonic and hyper, each `KeepAlive` stream
        /// answered in its connection's task: the ceiling without hyper's task per stream.
        #[arg(long)]
        inline: bool,
    },
}

#[derive(clap::Args)]
struct LeasesArgs {
    /// A running coordinator, e.g. http://127.0.0.1:7070 (the benchmark creates tasks
    /// `bench-c{C}-{i}` in its project).
    #[arg(long, conflicts_with = "spawn_coordinator")]
    coordinator: Option<String>,
    /// Start this coordinator binary on a fresh temp project (`--listen 127.0.0.1:0`) and
    /// stop it at the end.
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: Option<PathBuf>,
    /// A running etcd 3.4, e.g. http://127.0.0.1:2379: adds etcd rows and ratios.
    #[arg(long, conflicts_with = "spawn_etcd")]
    etcd: Option<String>,
    /// Start etcd (`--etcd-bin`) on a temp data dir on 127.0.0.1 with free ports, and stop
    /// it at the end.
    #[arg(long)]
    spawn_etcd: bool,
    /// The etcd binary for --spawn-etcd.
    #[arg(long, default_value = "etcd", value_name = "PATH")]
    etcd_bin: String,
    /// A running `automaton-bench echo-server`, e.g. http://127.0.0.1:7071: adds echo rows
    /// and the coordinator's share of this zero-work ceiling.
    #[arg(long, value_name = "URL", conflicts_with_all = ["spawn_echo", "compare_export"])]
    echo: Option<String>,
    /// Start this binary's `echo-server` on 127.0.0.1 (a free port) and stop it at the end:
    /// measured in the same slices as the others, the zero-work ceiling.
    #[arg(long, conflicts_with = "compare_export")]
    spawn_echo: bool,
    /// With --spawn-echo: the `--inline` echo server (h2 directly, no task per stream)
    /// instead of the one on tonic and hyper the coordinator is built on.
    #[arg(long, requires = "spawn_echo")]
    echo_inline: bool,
    /// Client counts, each measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    clients: Vec<usize>,
    /// Which measurements to run: `claim-release` (claim and release, measured in the same
    /// rounds) and/or `renew`.
    #[arg(long, value_delimiter = ',', default_value = "claim-release,renew", value_parser = ["claim-release", "renew"])]
    ops: Vec<String>,
    /// The systems take turns this many times per client count, each measuring for
    /// duration/slices at a time.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=100))]
    slices: u16,
    /// How long each operation is measured at each client count, over all slices: `10s`,
    /// `500ms`, `1m`.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Tasks (etcd keys) per client, claimed and released per round.
    #[arg(long, default_value_t = 100)]
    tasks_per_client: usize,
    /// HTTP/2 connections per system and client count; 0 = one per client. Sharing
    /// connections needs `--client tonic`.
    #[arg(long, default_value_t = 0)]
    connections: usize,
    /// The load generator's gRPC client, the same for both systems: `raw` writes HTTP/2
    /// frames from the calling task (least CPU taken from the servers, which share this
    /// machine's cores); `tonic` is the stock client, for a cross-check.
    #[arg(long, value_enum, default_value = "raw")]
    client: ClientKind,
    /// Lease TTL requested on claim (etcd gets it rounded up to whole seconds).
    #[arg(long, default_value_t = 60_000)]
    ttl_ms: u64,
    /// Concurrent callers creating the coordinator's tasks before measuring.
    #[arg(long, default_value_t = 16)]
    prepare_workers: usize,
    /// Keep the temp folder (project, data dirs, logs) of spawned systems.
    #[arg(long)]
    keep_temp: bool,
    /// The cost of trace export: spawn two coordinators (--spawn-coordinator), one without
    /// an OTLP endpoint and one exporting (default sampler) to a sink the benchmark serves,
    /// measured in turns; the ratio is export on / off.
    #[arg(long, requires = "spawn_coordinator", conflicts_with_all = ["etcd", "spawn_etcd"])]
    compare_export: bool,
    /// With --compare-export: an A/A control, the second coordinator exports nothing either;
    /// its ratio is the noise floor of the comparison on this machine.
    #[arg(long, requires = "compare_export")]
    export_control: bool,
}

/// `10s`, `500ms`, `1m`, `2.5s`, or a bare number of seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: f64 = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (e.g. 10s, 500ms, 1m)"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" => n * 60.0,
        _ => return Err(format!("unknown unit in {s:?}: use ms, s or m")),
    };
    if !(secs > 0.0 && secs <= 3600.0) {
        return Err(format!("duration {s:?} must be above 0 and at most 1h"));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[derive(Serialize)]
struct Prepared {
    clients: usize,
    tasks: usize,
    seconds: f64,
    tasks_per_s: f64,
}

#[derive(Serialize)]
struct Comparison {
    op: String,
    clients: usize,
    automaton_ops_per_s: f64,
    etcd_ops_per_s: f64,
    throughput_ratio: f64,
    /// The target ratio (it applies at 16 and 64 clients).
    target_ratio: f64,
    target_applies: bool,
    throughput_met: bool,
    automaton_p99_ms: f64,
    etcd_p99_ms: f64,
    p99_met: bool,
}

/// The coordinator against the zero-work echo server in the same slices, one operation at
/// one client count.
#[derive(Serialize)]
struct CeilingComparison {
    op: String,
    clients: usize,
    automaton_ops_per_s: f64,
    echo_ops_per_s: f64,
    /// automaton / echo: the share of the zero-work ceiling reached.
    ceiling_ratio: f64,
    /// Renewals: 0.8 (80 % of the zero-work ceiling). None for claims and releases: the
    /// echo answers them from nothing, the coordinator durably.
    target_ratio: Option<f64>,
    /// The target applies at 16 clients and more, as the ones against etcd.
    target_applies: bool,
    throughput_met: Option<bool>,
    automaton_p99_ms: f64,
    echo_p99_ms: f64,
}

/// Export on against export off, one operation at one client count.
#[derive(Serialize)]
struct ExportComparison {
    /// The second coordinator: `automaton+otlp`, or `automaton-b` in a control run.
    system: String,
    op: String,
    clients: usize,
    off_ops_per_s: f64,
    on_ops_per_s: f64,
    /// on / off.
    throughput_ratio: f64,
    target_ratio: f64,
    throughput_met: bool,
    off_p99_ms: f64,
    on_p99_ms: f64,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    coordinator: Option<String>,
    etcd: Option<String>,
    /// The echo server's URL, and which one was spawned (`echo-server`, `echo-server
    /// --inline`; `given` for --echo URL).
    echo: Option<String>,
    echo_server: Option<&'static str>,
    clients: Vec<usize>,
    duration_s: f64,
    tasks_per_client: usize,
    connections: String,
    client: ClientKind,
    slices: u16,
    ttl_ms: u64,
    results: Vec<OpStats>,
    prepare: Vec<Prepared>,
    comparisons: Vec<Comparison>,
    /// automaton / echo per operation and client count.
    ceiling_comparisons: Vec<CeilingComparison>,
    export_comparisons: Vec<ExportComparison>,
    /// Spans the sink received from the exporting coordinator (`--compare-export`).
    otlp_spans_received: Option<u64>,
    shutdown: Vec<String>,
}

fn target(op: &str) -> f64 {
    match op {
        "claim" => 6.0,
        "renew" => 8.0,
        "release" => 3.0,
        _ => 0.0,
    }
}

fn progress(s: &OpStats) {
    let err = match &s.first_error {
        Some(e) => format!("  errors {} (first: {e})", s.errors),
        None => String::new(),
    };
    eprintln!(
        "  {:<10} {:<8} C={:<3} {:>9.0} ops/s  p50 {}  p99 {}  max {}{err}",
        s.system,
        s.op,
        s.clients,
        s.ops_per_s,
        fmt_ms(s.p50_ms),
        fmt_ms(s.p99_ms),
        fmt_ms(s.max_ms)
    );
}

/// What one system measured at one client count, accumulated over the slices.
#[derive(Default)]
struct Measured {
    claims: Sample,
    releases: Sample,
    renews: Sample,
}

impl Measured {
    fn stats(self, system: &str, clients: usize, args: &LeasesArgs) -> Vec<OpStats> {
        let mut out = Vec::new();
        if args.ops.iter().any(|o| o == "claim-release") {
            out.push(OpStats::new(system, "claim", clients, self.claims));
            out.push(OpStats::new(system, "release", clients, self.releases));
        }
        if args.ops.iter().any(|o| o == "renew") {
            out.push(OpStats::new(system, "renew", clients, self.renews));
        }
        for s in &out {
            progress(s);
        }
        out
    }
}

/// One slice of `duration` of every chosen measurement, added to `into`.
async fn measure_slice<B: Backend>(
    backend: &Arc<B>,
    clients: usize,
    duration: Duration,
    args: &LeasesArgs,
    into: &mut Measured,
) -> Result<()> {
    if args.ops.iter().any(|o| o == "claim-release") {
        let (claims, releases) =
            backend::claim_release(backend.clone(), clients, args.tasks_per_client, duration)
                .await?;
        into.claims.absorb(claims);
        into.releases.absorb(releases);
    }
    if args.ops.iter().any(|o| o == "renew") {
        into.renews
            .absorb(backend::renew(backend.clone(), clients, duration).await?);
    }
    Ok(())
}

fn find<'a>(results: &'a [OpStats], system: &str, op: &str, c: usize) -> Option<&'a OpStats> {
    results
        .iter()
        .find(|s| s.system == system && s.op == op && s.clients == c)
}

fn compare(results: &[OpStats], clients: &[usize]) -> Vec<Comparison> {
    let mut out = Vec::new();
    for &c in clients {
        for op in OPS {
            let (Some(a), Some(e)) = (find(results, AUTOMATON, op, c), find(results, ETCD, op, c))
            else {
                continue;
            };
            let ratio = throughput_ratio(a, e);
            out.push(Comparison {
                op: op.to_string(),
                clients: c,
                automaton_ops_per_s: a.ops_per_s,
                etcd_ops_per_s: e.ops_per_s,
                throughput_ratio: ratio,
                target_ratio: target(op),
                target_applies: c >= 16,
                throughput_met: ratio >= target(op),
                automaton_p99_ms: a.p99_ms,
                etcd_p99_ms: e.p99_ms,
                p99_met: a.ops > 0 && e.ops > 0 && a.p99_ms <= e.p99_ms,
            });
        }
    }
    out
}

/// `a`'s throughput as a share of `reference`'s (0 when the reference did nothing).
fn throughput_ratio(a: &OpStats, reference: &OpStats) -> f64 {
    if reference.ops_per_s > 0.0 {
        a.ops_per_s / reference.ops_per_s
    } else {
        0.0
    }
}

fn compare_ceiling(results: &[OpStats], clients: &[usize]) -> Vec<CeilingComparison> {
    let mut out = Vec::new();
    for &c in clients {
        for op in OPS {
            let (Some(a), Some(e)) = (find(results, AUTOMATON, op, c), find(results, ECHO, op, c))
            else {
                continue;
            };
            let ratio = throughput_ratio(a, e);
            let target = (op == "renew").then_some(ECHO_TARGET);
            out.push(CeilingComparison {
                op: op.to_string(),
                clients: c,
                automaton_ops_per_s: a.ops_per_s,
                echo_ops_per_s: e.ops_per_s,
                ceiling_ratio: ratio,
                target_ratio: target,
                target_applies: target.is_some() && c >= 16,
                throughput_met: target.map(|t| ratio >= t),
                automaton_p99_ms: a.p99_ms,
                echo_p99_ms: e.p99_ms,
            });
        }
    }
    out
}

/// The table's line for a ceiling comparison.
fn ceiling_line(k: &CeilingComparison) -> String {
    let verdict = match (k.target_ratio, k.throughput_met) {
        (Some(t), Some(met)) if k.target_applies => format!(
            "target >= {t} (80 % of the zero-work ceiling): {}",
            if met { "met" } else { "NOT met" }
        ),
        (Some(_), _) => "target applies at 16 and 64 clients".to_string(),
        _ => "the zero-work ceiling; no target".to_string(),
    };
    format!(
        "{:<12} {:<8} {:>7} {:>8.2}x   (automaton / echo; p99 automaton {} vs echo {}; {verdict})\n",
        "ceiling",
        k.op,
        k.clients,
        k.ceiling_ratio,
        fmt_ms(k.automaton_p99_ms),
        fmt_ms(k.echo_p99_ms),
    )
}

fn compare_export(results: &[OpStats], clients: &[usize], second: &str) -> Vec<ExportComparison> {
    let mut out = Vec::new();
    for &c in clients {
        for op in OPS {
            let (Some(off), Some(on)) = (
                find(results, AUTOMATON, op, c),
                find(results, second, op, c),
            ) else {
                continue;
            };
            let ratio = throughput_ratio(on, off);
            out.push(ExportComparison {
                system: second.to_string(),
                op: op.to_string(),
                clients: c,
                off_ops_per_s: off.ops_per_s,
                on_ops_per_s: on.ops_per_s,
                throughput_ratio: ratio,
                target_ratio: EXPORT_TARGET,
                throughput_met: ratio >= EXPORT_TARGET,
                off_p99_ms: off.p99_ms,
                on_p99_ms: on.p99_ms,
            });
        }
    }
    out
}

fn row(s: &OpStats) -> String {
    let errors = if s.errors > 0 {
        format!("   errors {}", s.errors)
    } else {
        String::new()
    };
    format!(
        "{:<12} {:<8} {:>7} {:>9.0} {:>8} {:>8} {:>8}{errors}",
        s.system,
        s.op,
        s.clients,
        s.ops_per_s,
        fmt_ms(s.p50_ms),
        fmt_ms(s.p99_ms),
        fmt_ms(s.max_ms)
    )
}

fn table(
    results: &[OpStats],
    comparisons: &[Comparison],
    ceilings: &[CeilingComparison],
    exports: &[ExportComparison],
    clients: &[usize],
) -> String {
    let mut out = format!(
        "{:<12} {:<8} {:>7} {:>9} {:>8} {:>8} {:>8}\n",
        "system", "op", "clients", "ops/s", "p50", "p99", "max"
    );
    for &c in clients {
        for op in OPS {
            for system in [AUTOMATON, TRACED, CONTROL, ECHO, ETCD] {
                if let Some(s) = find(results, system, op, c) {
                    out.push_str(&row(s));
                    out.push('\n');
                }
            }
            if let Some(k) = exports.iter().find(|k| k.op == op && k.clients == c) {
                out.push_str(&format!(
                    "{:<12} {:<8} {:>7} {:>8.2}x   ({} / automaton; p99 {} vs {}; target >= {}: {})\n",
                    "ratio",
                    op,
                    c,
                    k.throughput_ratio,
                    k.system,
                    fmt_ms(k.on_p99_ms),
                    fmt_ms(k.off_p99_ms),
                    k.target_ratio,
                    if k.throughput_met { "met" } else { "NOT met" },
                ));
            }
            if let Some(k) = comparisons.iter().find(|k| k.op == op && k.clients == c) {
                let verdict = if !k.target_applies {
                    "target applies at 16 and 64 clients".to_string()
                } else {
                    format!(
                        "target >= {}x: {}; p99: {}",
                        k.target_ratio,
                        if k.throughput_met { "met" } else { "NOT met" },
                        if k.p99_met { "met" } else { "NOT met" }
                    )
                };
                out.push_str(&format!(
                    "{:<12} {:<8} {:>7} {:>8.1}x   (p99 automaton {} vs etcd {}; {verdict})\n",
                    "ratio",
                    op,
                    c,
                    k.throughput_ratio,
                    fmt_ms(k.automaton_p99_ms),
                    fmt_ms(k.etcd_p99_ms),
                ));
            }
            if let Some(k) = ceilings.iter().find(|k| k.op == op && k.clients == c) {
                out.push_str(&ceiling_line(k));
            }
        }
    }
    out
}

async fn leases(args: LeasesArgs) -> Result<()> {
    if args.clients.is_empty()
        || args.clients.contains(&0)
        || args.clients.iter().any(|&c| c > 4096)
    {
        bail!("--clients must list counts between 1 and 4096");
    }
    if args.tasks_per_client == 0 || args.tasks_per_client > 100_000 {
        bail!("--tasks-per-client must be between 1 and 100000");
    }
    if args.client == ClientKind::Raw {
        if args.connections != 0 {
            bail!(
                "--connections shares connections between clients, which --client raw cannot (one call at a time per connection): add --client tonic"
            );
        }
        for url in [&args.coordinator, &args.etcd, &args.echo]
            .into_iter()
            .flatten()
        {
            rpc::host_port(url)?;
        }
    }
    let want_coord = args.coordinator.is_some() || args.spawn_coordinator.is_some();
    let want_etcd = args.etcd.is_some() || args.spawn_etcd;
    let want_echo = args.echo.is_some() || args.spawn_echo;
    if !want_coord && !want_etcd && !want_echo {
        bail!(
            "nothing to measure: give --coordinator URL or --spawn-coordinator PATH, and/or --etcd URL or --spawn-etcd, and/or --echo URL or --spawn-echo"
        );
    }
    let scratch = if args.spawn_coordinator.is_some() || args.spawn_etcd || args.spawn_echo {
        Some(spawn::scratch_dir()?)
    } else {
        None
    };

    let mut spawned = Vec::new();
    let outcome = run(&args, scratch.as_deref(), &mut spawned).await;
    let mut shutdown = Vec::new();
    for s in spawned.iter_mut() {
        let how = s.stop();
        eprintln!("{how} (log: {})", s.log.display());
        shutdown.push(how);
    }
    if let Some(dir) = &scratch {
        if args.keep_temp || outcome.is_err() {
            eprintln!("kept {}", dir.display());
        } else {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    let (mut report, mut text, sink) = outcome?;
    report.shutdown = shutdown;
    // Read after the coordinators stopped: the exporting one flushed its last spans on SIGTERM.
    if let Some(s) = sink {
        text.push_str(&format!(
            "the OTLP sink received {} spans in {} export requests from the exporting coordinator\n",
            s.spans(),
            s.requests()
        ));
        report.otlp_spans_received = Some(s.spans());
    }
    print!("{text}");
    if let Some(path) = &args.json_out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn run(
    args: &LeasesArgs,
    scratch: Option<&std::path::Path>,
    spawned: &mut Vec<spawn::Spawned>,
) -> Result<(Report, String, Option<otlp::Counts>)> {
    let mut etcd_url = args.etcd.clone();
    if args.spawn_etcd {
        let dir = scratch.context("no temp dir")?;
        let s = spawn::etcd(&args.etcd_bin, dir)?;
        eprintln!("spawned etcd at {} (log {})", s.url, s.log.display());
        etcd_url = Some(s.url.clone());
        spawned.push(s);
    }
    let mut echo_url = args.echo.clone();
    let mut echo_server = args.echo.as_ref().map(|_| "given");
    if args.spawn_echo {
        let dir = scratch.context("no temp dir")?;
        let me = std::env::current_exe().context("find this benchmark's own binary")?;
        let s = spawn::echo(&me, args.echo_inline, dir)?;
        let kind = if args.echo_inline {
            "echo-server --inline"
        } else {
            "echo-server"
        };
        eprintln!("spawned {kind} at {} (log {})", s.url, s.log.display());
        echo_url = Some(s.url.clone());
        echo_server = Some(kind);
        spawned.push(s);
    }
    let mut coord_url = args.coordinator.clone();
    let mut traced_url = None;
    let mut sink = None;
    if let Some(bin) = &args.spawn_coordinator {
        let dir = scratch.context("no temp dir")?;
        if args.compare_export {
            // Two coordinators on projects of their own: one without an endpoint, one
            // exporting to the sink served here.
            let (counts, url) =
                otlp::start(std::net::SocketAddr::from(([127, 0, 0, 1], 0))).await?;
            eprintln!("OTLP sink at {url}");
            for (on, into) in [(false, &mut coord_url), (true, &mut traced_url)] {
                let d = dir.join(if on { "export-on" } else { "export-off" });
                std::fs::create_dir_all(d.join("project"))?;
                let envs = if on && !args.export_control {
                    vec![("OTEL_EXPORTER_OTLP_ENDPOINT", url.clone())]
                } else {
                    vec![]
                };
                let s = spawn::coordinator_env(bin, &d.join("project"), &d, &[], &envs)?;
                eprintln!(
                    "spawned coordinator (export {}) at {} (log {})",
                    if on { "on" } else { "off" },
                    s.url,
                    s.log.display()
                );
                *into = Some(s.url.clone());
                spawned.push(s);
            }
            sink = Some(counts);
        } else {
            let s = spawn::coordinator(bin, dir)?;
            eprintln!("spawned coordinator at {} (log {})", s.url, s.log.display());
            coord_url = Some(s.url.clone());
            spawned.push(s);
        }
    }
    if let Some(url) = &etcd_url {
        let ch = connect_retry(url).await?;
        etcd::wait_ready(&rpc::Client::Tonic(ch), Duration::from_secs(30)).await?;
    }
    // The echo server answers ListTasks as the coordinator does.
    for url in coord_url.iter().chain(&traced_url).chain(&echo_url) {
        let ch = connect_retry(url).await?;
        coord::wait_ready(&ch, Duration::from_secs(30)).await?;
    }

    let ttl_s = args.ttl_ms.div_ceil(1000).max(1) as i64;
    let mut results = Vec::new();
    let mut prepare = Vec::new();
    for &c in &args.clients {
        let n = if args.connections == 0 {
            c
        } else {
            args.connections.min(c)
        };
        eprintln!(
            "C={c}: {n} connection(s) per system, {:?} client",
            args.client
        );
        let mut coord_backend = None;
        let mut traced_backend = None;
        let mut etcd_backend = None;
        let mut echo_backend = None;
        if let Some(url) = &traced_url {
            let channels = rpc::tonic_channels(url, args.prepare_workers.clamp(1, n)).await?;
            coord::prepare(&channels, c, args.tasks_per_client, args.prepare_workers).await?;
        }
        if let Some(url) = &coord_url {
            let channels = rpc::tonic_channels(url, args.prepare_workers.clamp(1, n)).await?;
            let (tasks, secs) =
                coord::prepare(&channels, c, args.tasks_per_client, args.prepare_workers).await?;
            drop(channels);
            eprintln!(
                "  prepared {tasks} tasks in {secs:.2}s ({:.0} tasks/s: CreateTask + Transition)",
                tasks as f64 / secs.max(1e-9)
            );
            prepare.push(Prepared {
                clients: c,
                tasks,
                seconds: secs,
                tasks_per_s: tasks as f64 / secs.max(1e-9),
            });
            coord_backend = Some(Arc::new(coord::Coordinator::new(
                rpc::connect(args.client, url, n).await?,
                c,
                args.tasks_per_client,
                args.ttl_ms,
            )));
        }
        // Connected once both are prepared: a connection left idle through the other's
        // preparation would meet the server's keep-alive unanswered (the raw client reads
        // only during its calls) and be closed.
        if let Some(url) = &traced_url {
            traced_backend = Some(Arc::new(coord::Coordinator::new(
                rpc::connect(args.client, url, n).await?,
                c,
                args.tasks_per_client,
                args.ttl_ms,
            )));
        }
        // The echo grants any task: nothing to prepare.
        if let Some(url) = &echo_url {
            echo_backend = Some(Arc::new(coord::Coordinator::new(
                rpc::connect(args.client, url, n).await?,
                c,
                args.tasks_per_client,
                args.ttl_ms,
            )));
        }
        if let Some(url) = &etcd_url {
            etcd_backend = Some(Arc::new(etcd::Etcd::new(
                rpc::connect(args.client, url, n).await?,
                c,
                args.tasks_per_client,
                ttl_s,
            )));
        }
        // The systems take turns, slice by slice, so a drift of the shared machine (the
        // disk's sync speed changes from minute to minute) reaches both alike.
        let slice = args.duration / args.slices as u32;
        let (mut a, mut t, mut z, mut e) = (
            Measured::default(),
            Measured::default(),
            Measured::default(),
            Measured::default(),
        );
        for _ in 0..args.slices {
            if let Some(b) = &coord_backend {
                measure_slice(b, c, slice, args, &mut a).await?;
            }
            if let Some(b) = &traced_backend {
                measure_slice(b, c, slice, args, &mut t).await?;
            }
            if let Some(b) = &echo_backend {
                measure_slice(b, c, slice, args, &mut z).await?;
            }
            if let Some(b) = &etcd_backend {
                measure_slice(b, c, slice, args, &mut e).await?;
            }
        }
        if coord_backend.is_some() {
            results.extend(a.stats(AUTOMATON, c, args));
        }
        if traced_backend.is_some() {
            results.extend(t.stats(second_name(args), c, args));
        }
        if echo_backend.is_some() {
            results.extend(z.stats(ECHO, c, args));
        }
        if etcd_backend.is_some() {
            results.extend(e.stats(ETCD, c, args));
        }
    }
    let comparisons = compare(&results, &args.clients);
    let ceilings = compare_ceiling(&results, &args.clients);
    let exports = compare_export(&results, &args.clients, second_name(args));
    let text = table(&results, &comparisons, &ceilings, &exports, &args.clients);
    let report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        coordinator: coord_url,
        etcd: etcd_url,
        echo: echo_url,
        echo_server,
        clients: args.clients.clone(),
        duration_s: args.duration.as_secs_f64(),
        tasks_per_client: args.tasks_per_client,
        connections: if args.connections == 0 {
            "one per client".to_string()
        } else {
            format!("{} shared", args.connections)
        },
        client: args.client,
        slices: args.slices,
        ttl_ms: args.ttl_ms,
        results,
        prepare,
        comparisons,
        ceiling_comparisons: ceilings,
        export_comparisons: exports,
        otlp_spans_received: None,
        shutdown: Vec::new(),
    };
    Ok((report, text, sink))
}

/// The second coordinator's name in a `--compare-export` run.
fn second_name(args: &LeasesArgs) -> &'static str {
    if args.export_control { CONTROL } else { TRACED }
}

/// A freshly spawned server may need a moment before it accepts connections.
async fn connect_retry(url: &str) -> Result<Channel> {
    let mut last = None;
    for _ in 0..100 {
        match rpc::tonic_channels(url, 1).await {
            Ok(mut ch) => return ch.pop().context("no channel"),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("cannot connect to {url}")))
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Cmd::Leases(args) => leases(args).await,
        Cmd::Restart(args) => restart::run(args).await,
        Cmd::Workers(args) => workers::run(args).await,
        Cmd::Failover(args) => failover::run(args).await,
        Cmd::HaLeases(args) => ha_leases::run(args).await,
        Cmd::Phases(args) => phases::run(args).await,
        Cmd::Dispatch(args) => dispatch::run(args).await,
        Cmd::Delivery(args) => delivery::run(args).await,
        Cmd::Console(args) => console::run(args).await,
        Cmd::EchoServer { listen, inline } => echo::serve(listen, inline).await,
        Cmd::OtlpSink { listen } => otlp::serve(listen).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("x").is_err());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
