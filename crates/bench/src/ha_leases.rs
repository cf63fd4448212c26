//! `automaton-bench ha-leases`: claims and releases per second of the coordinator in etcd
//! mode, against clients doing the same work in etcd directly, on one spawned 3-member
//! cluster in one run.
//!
//! | system            | claim                                       | release                              |
//! |-------------------|---------------------------------------------|--------------------------------------|
//! | `automaton-etcd`  | `Leases.Claim` (the coordinator, `--store etcd`, group-committing fenced `Txn`s of ≤ 127 ops) | `Leases.Release` |
//! | `etcd-txn`        | one put-if-absent `Txn` per claim            | one `Txn` deleting the key if still the claim's |
//! | `automaton-files` | `Leases.Claim` (the coordinator on its own disk, `--store files`) | `Leases.Release` |
//!
//! Every acknowledged claim is durable in all three: in etcd's raft log on a majority of the
//! three members (which share this machine's disk), or in the files coordinator's
//! `fdatasync`ed log. The systems take turns in `--slices` per client count, as in `leases`,
//! through the same client (`--client`); the reference clients and the coordinator's etcd
//! client both talk to the raft leader (no forwarding hop for either). Each client works on
//! its own tasks (keys): nothing contends.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::backend::{self, Backend};
use crate::ha::{self, Cluster, Node};
use crate::rpc::{self, ClientKind};
use crate::stats::{OpStats, Sample, fmt_ms};
use crate::{coord, etcd, parse_duration, spawn};

const ETCD_MODE: &str = "automaton-etcd";
const TXN: &str = "etcd-txn";
const FILES: &str = "automaton-files";
/// Claims: the etcd-mode coordinator grants at least this many times the reference's.
const CLAIM_TARGET: f64 = 3.0;

#[derive(clap::Args)]
pub struct HaLeasesArgs {
    /// The coordinator binary: one is started with `--store etcd` on the spawned cluster
    /// (and one on files, unless --no-files).
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: PathBuf,
    /// The etcd binary (3.4).
    #[arg(long, default_value = "etcd", value_name = "PATH")]
    etcd_bin: String,
    /// Client counts, each measured in turn.
    #[arg(long, value_delimiter = ',', default_value = "16,64")]
    clients: Vec<usize>,
    /// How long claims and releases are measured per system and client count, over all
    /// slices.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    duration: Duration,
    /// The systems take turns this many times per client count.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=100))]
    slices: u16,
    /// Tasks (keys) per client, claimed and released per round.
    #[arg(long, default_value_t = 25)]
    tasks_per_client: usize,
    /// The load generator's gRPC client, the same for every system.
    #[arg(long, value_enum, default_value = "raw")]
    client: ClientKind,
    /// Lease TTL requested on claim.
    #[arg(long, default_value_t = 60_000)]
    ttl_ms: u64,
    /// Concurrent callers creating the coordinators' tasks before measuring.
    #[arg(long, default_value_t = 16)]
    prepare_workers: usize,
    /// Leave out the files-mode coordinator.
    #[arg(long)]
    no_files: bool,
    /// The etcd-mode coordinator's `[etcd] election_ttl`.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    election_ttl: Duration,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Keep the temp folder (projects, etcd data, logs).
    #[arg(long)]
    keep_temp: bool,
}

#[derive(Serialize)]
struct Prepared {
    system: &'static str,
    clients: usize,
    tasks: usize,
    seconds: f64,
    tasks_per_s: f64,
}

#[derive(Serialize)]
struct Comparison {
    op: String,
    clients: usize,
    automaton_etcd_ops_per_s: f64,
    etcd_txn_ops_per_s: f64,
    /// automaton-etcd / etcd-txn.
    ratio: f64,
    /// Claims: 3. Releases: none.
    target_ratio: Option<f64>,
    target_met: Option<bool>,
    automaton_etcd_p99_ms: f64,
    etcd_txn_p99_ms: f64,
    automaton_files_ops_per_s: Option<f64>,
    /// automaton-files / automaton-etcd: what replication to etcd costs.
    files_over_etcd_mode: Option<f64>,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    etcd_endpoints: Vec<String>,
    etcd_flags: Vec<&'static str>,
    clients: Vec<usize>,
    duration_s: f64,
    slices: u16,
    tasks_per_client: usize,
    client: ClientKind,
    results: Vec<OpStats>,
    prepare: Vec<Prepared>,
    comparisons: Vec<Comparison>,
    shutdown: Vec<String>,
}

#[derive(Default)]
struct Measured {
    claims: Sample,
    releases: Sample,
}

impl Measured {
    async fn slice<B: Backend>(
        &mut self,
        b: &Arc<B>,
        clients: usize,
        per_client: usize,
        slice: Duration,
    ) -> Result<()> {
        let (c, r) = backend::claim_release(b.clone(), clients, per_client, slice).await?;
        self.claims.absorb(c);
        self.releases.absorb(r);
        Ok(())
    }

    fn stats(self, system: &str, clients: usize) -> [OpStats; 2] {
        let out = [
            OpStats::new(system, "claim", clients, self.claims),
            OpStats::new(system, "release", clients, self.releases),
        ];
        for s in &out {
            let err = match &s.first_error {
                Some(e) => format!("  errors {} (first: {e})", s.errors),
                None => String::new(),
            };
            eprintln!(
                "  {:<16} {:<8} C={:<3} {:>9.0} ops/s  p50 {}  p99 {}  max {}{err}",
                s.system,
                s.op,
                s.clients,
                s.ops_per_s,
                fmt_ms(s.p50_ms),
                fmt_ms(s.p99_ms),
                fmt_ms(s.max_ms)
            );
        }
        out
    }
}

pub async fn run(args: HaLeasesArgs) -> Result<()> {
    if args.clients.is_empty() || args.clients.iter().any(|&c| c == 0 || c > 4096) {
        bail!("--clients must list counts between 1 and 4096");
    }
    if args.tasks_per_client == 0 || args.tasks_per_client > 100_000 {
        bail!("--tasks-per-client must be between 1 and 100000");
    }
    let scratch = spawn::scratch_dir()?;
    let mut cluster = None;
    let mut node = None;
    let mut files = None;
    let outcome = measure(&args, &scratch, &mut cluster, &mut node, &mut files).await;
    let mut shutdown = Vec::new();
    if let Some(how) = node.as_mut().and_then(Node::stop) {
        shutdown.push(how);
    }
    if let Some(f) = files.as_mut() {
        shutdown.push(spawn::Spawned::stop(f));
    }
    if let Some(c) = cluster.as_mut() {
        shutdown.extend(c.stop());
    }
    if args.keep_temp || outcome.is_err() {
        eprintln!("kept {}", scratch.display());
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let mut report = outcome?;
    report.shutdown = shutdown;
    print!("{}", table(&report));
    if let Some(path) = &args.json_out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

async fn prepare(
    url: &str,
    system: &'static str,
    c: usize,
    args: &HaLeasesArgs,
) -> Result<Prepared> {
    let channels = rpc::tonic_channels(url, args.prepare_workers.clamp(1, c)).await?;
    let (tasks, seconds) =
        coord::prepare(&channels, c, args.tasks_per_client, args.prepare_workers).await?;
    let p = Prepared {
        system,
        clients: c,
        tasks,
        seconds,
        tasks_per_s: tasks as f64 / seconds.max(1e-9),
    };
    eprintln!(
        "  {system}: prepared {tasks} tasks in {seconds:.2}s ({:.0} tasks/s)",
        p.tasks_per_s
    );
    Ok(p)
}

async fn measure(
    args: &HaLeasesArgs,
    scratch: &std::path::Path,
    cluster: &mut Option<Cluster>,
    node: &mut Option<Node>,
    files: &mut Option<spawn::Spawned>,
) -> Result<Report> {
    let c = Cluster::start(&args.etcd_bin, scratch, 3).await?;
    let endpoints = c.endpoints_leader_first().await?;
    eprintln!(
        "etcd cluster: {} (raft leader first; {:?})",
        endpoints.join(", "),
        spawn::RAFT_FLAGS
    );
    *cluster = Some(c);
    let mut n = Node::new(
        scratch.join("coordinator-etcd"),
        &endpoints,
        args.election_ttl,
        &[],
    )?;
    n.start(&args.spawn_coordinator)?;
    eprintln!("coordinator (store = etcd) at {}", n.url);
    let etcd_url = n.url.clone();
    *node = Some(n);
    ha::leader_of(
        std::slice::from_ref(node.as_ref().context("no node")?),
        Duration::from_secs(60),
    )
    .await?;
    let mut files_url = None;
    if !args.no_files {
        let dir = scratch.join("coordinator-files");
        std::fs::create_dir_all(&dir)?;
        let s = spawn::coordinator(&args.spawn_coordinator, &dir)?;
        eprintln!("coordinator (store = files) at {}", s.url);
        let ch = crate::connect_retry(&s.url).await?;
        coord::wait_ready(&ch, Duration::from_secs(30)).await?;
        files_url = Some(s.url.clone());
        *files = Some(s);
    }
    let cluster = cluster.as_ref().context("no cluster")?;
    let mut results = Vec::new();
    let mut prepared = Vec::new();
    for &clients in &args.clients {
        eprintln!(
            "C={clients}: one connection per client, {:?} client",
            args.client
        );
        prepared.push(prepare(&etcd_url, ETCD_MODE, clients, args).await?);
        if let Some(url) = &files_url {
            prepared.push(prepare(url, FILES, clients, args).await?);
        }
        let per = args.tasks_per_client;
        let on_etcd = Arc::new(coord::Coordinator::new(
            rpc::connect(args.client, &etcd_url, clients).await?,
            clients,
            per,
            args.ttl_ms,
        ));
        let on_files = match &files_url {
            Some(url) => Some(Arc::new(coord::Coordinator::new(
                rpc::connect(args.client, url, clients).await?,
                clients,
                per,
                args.ttl_ms,
            ))),
            None => None,
        };
        let leader = cluster.raft_leader().await?;
        let txn = Arc::new(etcd::EtcdTxn::new(
            rpc::connect(args.client, &leader, clients).await?,
            clients,
            per,
        ));
        let slice = args.duration / args.slices as u32;
        let (mut a, mut f, mut e) = (
            Measured::default(),
            Measured::default(),
            Measured::default(),
        );
        for _ in 0..args.slices {
            a.slice(&on_etcd, clients, per, slice).await?;
            if let Some(b) = &on_files {
                f.slice(b, clients, per, slice).await?;
            }
            e.slice(&txn, clients, per, slice).await?;
        }
        results.extend(a.stats(ETCD_MODE, clients));
        if on_files.is_some() {
            results.extend(f.stats(FILES, clients));
        }
        results.extend(e.stats(TXN, clients));
    }
    let comparisons = compare(&results, &args.clients);
    Ok(Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        etcd_endpoints: endpoints,
        etcd_flags: spawn::RAFT_FLAGS.to_vec(),
        clients: args.clients.clone(),
        duration_s: args.duration.as_secs_f64(),
        slices: args.slices,
        tasks_per_client: args.tasks_per_client,
        client: args.client,
        results,
        prepare: prepared,
        comparisons,
        shutdown: Vec::new(),
    })
}

fn find<'a>(results: &'a [OpStats], system: &str, op: &str, c: usize) -> Option<&'a OpStats> {
    results
        .iter()
        .find(|s| s.system == system && s.op == op && s.clients == c)
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { 0.0 }
}

fn compare(results: &[OpStats], clients: &[usize]) -> Vec<Comparison> {
    let mut out = Vec::new();
    for &c in clients {
        for op in ["claim", "release"] {
            let (Some(a), Some(e)) = (find(results, ETCD_MODE, op, c), find(results, TXN, op, c))
            else {
                continue;
            };
            let r = ratio(a.ops_per_s, e.ops_per_s);
            let target = (op == "claim").then_some(CLAIM_TARGET);
            let files = find(results, FILES, op, c);
            out.push(Comparison {
                op: op.to_string(),
                clients: c,
                automaton_etcd_ops_per_s: a.ops_per_s,
                etcd_txn_ops_per_s: e.ops_per_s,
                ratio: r,
                target_ratio: target,
                target_met: target.map(|t| a.errors == 0 && r >= t),
                automaton_etcd_p99_ms: a.p99_ms,
                etcd_txn_p99_ms: e.p99_ms,
                automaton_files_ops_per_s: files.map(|f| f.ops_per_s),
                files_over_etcd_mode: files.map(|f| ratio(f.ops_per_s, a.ops_per_s)),
            });
        }
    }
    out
}

fn table(r: &Report) -> String {
    let mut out = format!(
        "{:<16} {:<8} {:>7} {:>9} {:>8} {:>8} {:>8}\n",
        "system", "op", "clients", "ops/s", "p50", "p99", "max"
    );
    for &c in &r.clients {
        for op in ["claim", "release"] {
            for system in [ETCD_MODE, FILES, TXN] {
                if let Some(s) = find(&r.results, system, op, c) {
                    let errors = if s.errors > 0 {
                        format!("   errors {}", s.errors)
                    } else {
                        String::new()
                    };
                    out.push_str(&format!(
                        "{:<16} {:<8} {:>7} {:>9.0} {:>8} {:>8} {:>8}{errors}\n",
                        s.system,
                        s.op,
                        s.clients,
                        s.ops_per_s,
                        fmt_ms(s.p50_ms),
                        fmt_ms(s.p99_ms),
                        fmt_ms(s.max_ms)
                    ));
                }
            }
            if let Some(k) = r.comparisons.iter().find(|k| k.op == op && k.clients == c) {
                let verdict = match (k.target_ratio, k.target_met) {
                    (Some(t), Some(met)) => {
                        format!("target >= {t}x: {}", if met { "met" } else { "NOT met" })
                    }
                    _ => "no target".to_string(),
                };
                let files = k
                    .files_over_etcd_mode
                    .map(|x| format!("; files mode {x:.2}x etcd mode"))
                    .unwrap_or_default();
                out.push_str(&format!(
                    "{:<16} {:<8} {:>7} {:>8.2}x   ({ETCD_MODE} / {TXN}; p99 {} vs {}; {verdict}{files})\n",
                    "ratio",
                    op,
                    c,
                    k.ratio,
                    fmt_ms(k.automaton_etcd_p99_ms),
                    fmt_ms(k.etcd_txn_p99_ms),
                ));
            }
        }
    }
    out
}
