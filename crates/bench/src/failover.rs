//! `automaton-bench failover`: how long a project cannot grant a claim when its leading
//! coordinator dies.
//!
//! It spawns a 3-member etcd cluster on loopback (free ports, `--heartbeat-interval 100
//! --election-timeout 1000`) and two coordinators with `--store etcd` on it (separate project
//! folders, one project name in etcd, each on a fixed port). Each round: find the leader,
//! create a claimable task through it, then `kill -9` it at T0 and claim that task through
//! whichever coordinator leads, as a client given both addresses does: each refusal naming
//! a leader (`automaton-leader`) is followed, any other failure (a refused connection, a
//! follower that knows no leader yet) is retried after `--poll`, until a claim is granted at
//! T1. Then the killed coordinator is started again on its address and the round ends once
//! it follows the new leader.
//!
//! While the client claims, the leader key in etcd is read every 10 ms: when the dead
//! leader's key was first seen gone (its etcd lease expired), and when the next leader's key
//! (another create revision) was first seen. That splits T1 − T0 into: the key's remaining
//! life, the election, and the new leader's rebuild and first answer.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use serde::Serialize;
use tonic::transport::Channel;

use crate::ha::{self, Cluster, Node};
use crate::stats::fmt_ms;
use crate::workers::Percentiles;
use crate::{coord, parse_duration, spawn};

/// The target: p99 of kill -9 → a granted claim, with etcd's election timeout at 1 s.
const TARGET_P99_MS: f64 = 3000.0;

#[derive(clap::Args)]
pub struct FailoverArgs {
    /// The coordinator binary; two are started with `--store etcd`.
    #[arg(long, value_name = "PATH")]
    spawn_coordinator: PathBuf,
    /// Leaders killed, one per round.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=1000))]
    failovers: u32,
    /// The coordinators' `[etcd] election_ttl`: how long a dead leader's key outlives it.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    election_ttl: Duration,
    /// The etcd binary (3.4).
    #[arg(long, default_value = "etcd", value_name = "PATH")]
    etcd_bin: String,
    /// The client's pause before trying again after a refusal that names no leader.
    #[arg(long, default_value = "20ms", value_parser = parse_duration)]
    poll: Duration,
    /// Write every figure here as JSON.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// Keep the temp folder (projects, etcd data, logs).
    #[arg(long)]
    keep_temp: bool,
}

#[derive(Serialize, Clone)]
struct Round {
    round: u32,
    killed: String,
    /// The coordinator that granted the claim.
    granted_by: String,
    /// T0 → the dead leader's key first seen gone.
    key_gone_s: Option<f64>,
    /// T0 → the next leader's key first seen.
    elected_s: Option<f64>,
    /// T0 → the new leader's log: its folder rebuilt from etcd, serving.
    rebuilt_s: Option<f64>,
    serving_s: Option<f64>,
    /// T0 → the claim granted (T1 − T0).
    claim_s: f64,
    /// Claims sent until one was granted.
    attempts: u32,
    /// The last refusal before the grant.
    last_refusal: Option<String>,
    /// The restart of the killed coordinator → it follows the new leader.
    rejoin_s: f64,
}

#[derive(Serialize)]
struct Summary {
    failovers: usize,
    /// kill -9 → claim granted.
    total: Percentiles,
    /// kill -9 → old key gone.
    key_gone: Percentiles,
    /// old key gone → new leader's key.
    election: Percentiles,
    /// new leader's key → claim granted (rebuild, serve, the client's next try).
    serve: Percentiles,
    /// new leader's key → its log says serving (the rebuild from etcd and the open).
    rebuild: Percentiles,
    target_p99_ms: f64,
    target_met: bool,
}

#[derive(Serialize)]
struct Report {
    command: String,
    unix_time: u64,
    election_ttl_ms: u64,
    etcd_flags: Vec<&'static str>,
    poll_ms: f64,
    rounds: Vec<Round>,
    summary: Summary,
    shutdown: Vec<String>,
}

/// Claims `task` through `nodes` (by URL), following `automaton-leader`, until granted or
/// `limit` passes.
pub(crate) async fn claim_following(
    nodes: &[(String, Channel)],
    task: &str,
    agent: &str,
    poll: Duration,
    limit: Duration,
) -> Result<(Instant, String, u32, Option<String>)> {
    let deadline = Instant::now() + limit;
    let mut next = 0usize;
    let mut attempts = 0u32;
    let mut last: Option<String> = None;
    loop {
        let (url, channel) = &nodes[next];
        attempts += 1;
        let mut leases = pb::leases_client::LeasesClient::new(channel.clone());
        let request = pb::ClaimRequest {
            task: task.to_string(),
            agent: agent.to_string(),
            ttl: Some(automaton_proto::prost_types::Duration {
                seconds: 60,
                nanos: 0,
            }),
            ..Default::default()
        };
        let answer = tokio::time::timeout(Duration::from_secs(1), leases.claim(request)).await;
        let refusal = match answer {
            Ok(Ok(lease)) => {
                let at = Instant::now();
                let lease = lease.into_inner();
                if lease.lease_id.is_empty() || lease.token == 0 {
                    bail!("{url} granted {task} without a lease id or token");
                }
                return Ok((at, url.clone(), attempts, last));
            }
            Ok(Err(s)) => {
                if let Some(leader) = automaton_client::leader_named(&s)
                    && let Some(i) = nodes.iter().position(|(u, _)| *u == leader)
                    && i != next
                {
                    // Named: ask it at once.
                    last = Some(format!("{url}: a follower of {leader}"));
                    next = i;
                    continue;
                }
                if refuses_the_claim_itself(s.code()) {
                    // Not a failover's refusal but the claim's own (a bug of the bench or of
                    // the coordinator): say so rather than retry for a minute.
                    bail!(
                        "{url} refused the claim of {task}: {:?}: {}",
                        s.code(),
                        s.message()
                    );
                }
                format!("{url}: {}", first_words(s.message()))
            }
            Err(_) => format!("{url}: no answer within 1 s"),
        };
        last = Some(refusal);
        if Instant::now() >= deadline {
            bail!(
                "no claim of {task} granted within {limit:?} ({attempts} attempts; last: {})",
                last.unwrap_or_default()
            );
        }
        next = (next + 1) % nodes.len();
        tokio::time::sleep(poll).await;
    }
}

/// Codes that answer the claim itself; every other one (UNAVAILABLE from a follower, a
/// broken or refused connection: CANCELLED, UNKNOWN) is the failover's and is retried.
fn refuses_the_claim_itself(code: tonic::Code) -> bool {
    use tonic::Code::*;
    matches!(
        code,
        InvalidArgument
            | NotFound
            | AlreadyExists
            | PermissionDenied
            | FailedPrecondition
            | Unauthenticated
            | OutOfRange
            | Unimplemented
    )
}

fn first_words(s: &str) -> String {
    s.chars().take(100).collect()
}

pub async fn run(args: FailoverArgs) -> Result<()> {
    let scratch = spawn::scratch_dir()?;
    let mut cluster = None;
    let mut nodes = Vec::new();
    let outcome = rounds(&args, &scratch, &mut cluster, &mut nodes).await;
    let mut shutdown = Vec::new();
    for n in &mut nodes {
        if let Some(how) = n.stop() {
            shutdown.push(how);
        }
    }
    if let Some(c) = cluster.as_mut() {
        shutdown.extend(c.stop());
    }
    if args.keep_temp || outcome.is_err() {
        eprintln!("kept {}", scratch.display());
    } else {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    let rounds = outcome?;
    let report = report(&args, rounds, shutdown);
    print!("{}", table(&report));
    if let Some(path) = &args.json_out {
        let json = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, json + "\n").with_context(|| format!("write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

/// Starts the cluster and a pair of coordinators over it into `cluster` and `nodes` (so the
/// caller stops them whatever happens); waits until one leads.
pub(crate) async fn start_pair(
    bin: &std::path::Path,
    etcd_bin: &str,
    scratch: &std::path::Path,
    election_ttl: Duration,
    extra: &[String],
    cluster: &mut Option<Cluster>,
    nodes: &mut Vec<Node>,
) -> Result<()> {
    let c = Cluster::start(etcd_bin, scratch, 3).await?;
    eprintln!(
        "etcd cluster: {} ({:?})",
        c.endpoints.join(", "),
        spawn::RAFT_FLAGS
    );
    let endpoints = c.endpoints.clone();
    *cluster = Some(c);
    for i in 0..2 {
        let mut n = Node::new(
            scratch.join(format!("coordinator-{i}")),
            &endpoints,
            election_ttl,
            extra,
        )?;
        n.start(bin)?;
        eprintln!(
            "coordinator {i} at {} (pid {})",
            n.url,
            n.pid().unwrap_or_default()
        );
        nodes.push(n);
    }
    ha::leader_of(nodes, Duration::from_secs(60)).await?;
    Ok(())
}

async fn rounds(
    args: &FailoverArgs,
    scratch: &std::path::Path,
    cluster: &mut Option<Cluster>,
    nodes: &mut Vec<Node>,
) -> Result<Vec<Round>> {
    start_pair(
        &args.spawn_coordinator,
        &args.etcd_bin,
        scratch,
        args.election_ttl,
        &[],
        cluster,
        nodes,
    )
    .await?;
    let cluster = cluster.as_ref().context("no cluster")?;
    let urls: Vec<(String, Channel)> = nodes
        .iter()
        .map(|n| (n.url.clone(), n.channel.clone()))
        .collect();
    let mut out = Vec::new();
    for round in 1..=args.failovers {
        let l = ha::leader_of(nodes, Duration::from_secs(60)).await?;
        let task = format!("fo-{round}");
        let mut tasks = pb::tasks_client::TasksClient::new(nodes[l].channel.clone());
        coord::prepare_one(&mut tasks, &task)
            .await
            .with_context(|| format!("prepare {task} on the leader"))?;
        let (holder, old_revision) = cluster
            .leader_key_now()
            .await?
            .context("the leader key is absent while a coordinator leads")?;
        if holder != nodes[l].url {
            bail!(
                "the leader key names {holder}, but {} answers as leader",
                nodes[l].url
            );
        }
        // The kill falls at a different point of the leader's keepalive cycle (every TTL/3)
        // each round: a pause spread evenly over one TTL (golden-ratio steps), so the rounds
        // sample the dead leader's key life from nearly a full TTL down to 2/3 of it.
        let spread = (f64::from(round) * 0.618_033_988_75).fract();
        tokio::time::sleep(args.election_ttl.mul_f64(spread)).await;
        let watch = ha::watch_handover(
            cluster.client.clone(),
            old_revision,
            Duration::from_secs(60),
        );
        let killed = nodes[l].url.clone();
        let survivor = 1 - l;
        let t0_wall = std::time::SystemTime::now();
        let t0 = Instant::now();
        nodes[l].kill9();
        let (at, url, attempts, last_refusal) = claim_following(
            &urls,
            &task,
            "bench-failover",
            args.poll,
            Duration::from_secs(60),
        )
        .await?;
        let handover = watch.await.context("the leader-key watch panicked")?;
        let term = ha::term_after(&nodes[survivor].log(), t0_wall);
        if url == killed {
            bail!("the killed coordinator {killed} granted a claim");
        }
        let restarted = Instant::now();
        nodes[l].start(&args.spawn_coordinator)?;
        ha::wait_follower_of(&nodes[l], &url, Duration::from_secs(60)).await?;
        let r = Round {
            round,
            killed,
            granted_by: url,
            key_gone_s: ha::secs_since(t0, handover.gone),
            elected_s: ha::secs_since(t0, handover.elected),
            rebuilt_s: term.rebuilt_s,
            serving_s: term.serving_s,
            claim_s: at.saturating_duration_since(t0).as_secs_f64(),
            attempts,
            last_refusal,
            rejoin_s: restarted.elapsed().as_secs_f64(),
        };
        eprintln!("{}", round_line(&r));
        out.push(r);
    }
    Ok(out)
}

fn opt_s(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_string(), |s| format!("{s:.2}s"))
}

fn round_line(r: &Round) -> String {
    format!(
        "  round {:>3}: killed {} -> granted by {}: key gone {}, elected {}, serving {}, claim {:.2}s ({} attempts), rejoined in {:.2}s",
        r.round,
        r.killed,
        r.granted_by,
        opt_s(r.key_gone_s),
        opt_s(r.elected_s),
        opt_s(r.serving_s),
        r.claim_s,
        r.attempts,
        r.rejoin_s
    )
}

fn report(args: &FailoverArgs, rounds: Vec<Round>, shutdown: Vec<String>) -> Report {
    let d = Duration::from_secs_f64;
    let total = Percentiles::of(rounds.iter().map(|r| d(r.claim_s)).collect());
    let key_gone = Percentiles::of(rounds.iter().filter_map(|r| r.key_gone_s.map(d)).collect());
    let election = Percentiles::of(
        rounds
            .iter()
            .filter_map(|r| Some(d((r.elected_s? - r.key_gone_s?).max(0.0))))
            .collect(),
    );
    let serve = Percentiles::of(
        rounds
            .iter()
            .filter_map(|r| Some(d((r.claim_s - r.elected_s?).max(0.0))))
            .collect(),
    );
    let rebuild = Percentiles::of(
        rounds
            .iter()
            .filter_map(|r| Some(d((r.serving_s? - r.elected_s?).max(0.0))))
            .collect(),
    );
    let target_met = total.count > 0 && total.p99_ms <= TARGET_P99_MS;
    Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        unix_time: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default(),
        election_ttl_ms: args.election_ttl.as_millis() as u64,
        etcd_flags: spawn::RAFT_FLAGS.to_vec(),
        poll_ms: args.poll.as_secs_f64() * 1e3,
        summary: Summary {
            failovers: rounds.len(),
            total,
            key_gone,
            election,
            serve,
            rebuild,
            target_p99_ms: TARGET_P99_MS,
            target_met,
        },
        rounds,
        shutdown,
    }
}

fn table(r: &Report) -> String {
    let s = &r.summary;
    let line = |name: &str, p: &Percentiles| {
        format!(
            "{name:<38} {:>8} {:>8} {:>8}   (n={})\n",
            fmt_ms(p.p50_ms),
            fmt_ms(p.p99_ms),
            fmt_ms(p.max_ms),
            p.count
        )
    };
    let mut out = format!(
        "{} failovers, election TTL {}, etcd {}\n{:<38} {:>8} {:>8} {:>8}\n",
        s.failovers,
        fmt_ms(r.election_ttl_ms as f64),
        r.etcd_flags.join(" "),
        "",
        "p50",
        "p99",
        "max"
    );
    out.push_str(&line("kill -9 -> claim granted", &s.total));
    out.push_str(&line("  kill -9 -> old leader key gone", &s.key_gone));
    out.push_str(&line("  key gone -> new leader key", &s.election));
    out.push_str(&line("  new leader key -> claim granted", &s.serve));
    out.push_str(&line("    of which: key -> log says serving", &s.rebuild));
    out.push_str(&format!(
        "target: p99 of kill -9 -> claim granted <= {}: {}\n",
        fmt_ms(s.target_p99_ms),
        if s.target_met { "met" } else { "NOT met" }
    ));
    out
}
