//! `automaton-bench restart`: how long a coordinator takes from `kill -9` to serving again,
//! on a project with many task folders, against the same restart on an empty project (the
//! reference: what starting a process, opening the log and binding a socket cost here).
//!
//! Each round: the coordinator is started on the project, claims `--live-leases` tasks (so
//! the log has leases to replay and views to repair), is killed with SIGKILL, the page cache
//! is dropped when the machine allows it (`/proc/sys/vm/drop_caches`, root), and a new
//! coordinator is started; "serving" is its first answered `Claim` of a task it has not
//! touched yet, timed from the spawn. The reference project holds only the leased tasks.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use automaton_proto::v1 as pb;
use serde::Serialize;

use crate::spawn;

#[derive(clap::Args)]
pub struct RestartArgs {
    /// The coordinator binary to start (and kill, and start again).
    #[arg(long, value_name = "PATH")]
    pub spawn_coordinator: PathBuf,
    /// Task folders in the project.
    #[arg(long, default_value_t = 100_000)]
    pub tasks: usize,
    /// Leases live at the kill (replayed from the log at the restart).
    #[arg(long, default_value_t = 100)]
    pub live_leases: usize,
    /// Rounds of kill -9 and restart, each against the reference.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=20))]
    pub rounds: u16,
    /// Write the figures here as JSON.
    #[arg(long, value_name = "FILE")]
    pub json_out: Option<PathBuf>,
    /// Keep the temp folder (projects, logs).
    #[arg(long)]
    pub keep_temp: bool,
}

#[derive(Serialize)]
struct Round {
    round: u16,
    cold_cache: bool,
    /// Spawn to `listening on`, and spawn to the first answered claim.
    listening_s: f64,
    serving_s: f64,
    reference_listening_s: f64,
    reference_serving_s: f64,
}

#[derive(Serialize)]
struct Report {
    command: String,
    tasks: usize,
    live_leases: usize,
    rounds: Vec<Round>,
}

/// Writes `n` task folders in `research` (each with its `.state`) under `project`.
fn make_project(project: &Path, n: usize) -> Result<()> {
    let tasks = project.join(".automaton/tasks");
    fs::create_dir_all(&tasks).with_context(|| format!("create {}", tasks.display()))?;
    for i in 0..n {
        let dir = tasks.join(format!("restart-{i}"));
        fs::create_dir_all(&dir)?;
        fs::write(dir.join(".state"), "research\n")?;
    }
    Ok(())
}

/// Empties the page cache if this process may (root, writable /proc/sys).
fn drop_caches() -> bool {
    // Sync first, so dirty pages can be dropped too.
    let _ = std::process::Command::new("sync").status();
    fs::write("/proc/sys/vm/drop_caches", "3\n").is_ok()
}

async fn claim(url: &str, task: &str, deadline: Instant) -> Result<pb::Lease> {
    loop {
        let attempt = async {
            let mut c = pb::leases_client::LeasesClient::connect(url.to_string()).await?;
            let l = c
                .claim(pb::ClaimRequest {
                    task: task.into(),
                    agent: "bench".into(),
                    ttl: Some(automaton_proto::prost_types::Duration {
                        seconds: 600,
                        nanos: 0,
                    }),
                    ..Default::default()
                })
                .await?
                .into_inner();
            anyhow::Ok(l)
        };
        match attempt.await {
            Ok(l) => return Ok(l),
            Err(e) if Instant::now() >= deadline => {
                return Err(e).context(format!("claim {task}"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// Starts a coordinator on `project`, claims `leases` tasks, kills it; then drops the cache,
/// restarts it, and times listening and the first claim of an untouched task.
async fn one_restart(
    bin: &Path,
    project: &Path,
    scratch: &Path,
    leases: usize,
    probe: &str,
) -> Result<(bool, f64, f64)> {
    let mut first = spawn::coordinator_on(bin, project, scratch)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    for i in 0..leases {
        claim(&first.url, &format!("restart-{i}"), deadline).await?;
    }
    first.kill9();
    let cold = drop_caches();
    let started = Instant::now();
    let second = spawn::coordinator_on(bin, project, scratch)?;
    let listening = started.elapsed();
    claim(&second.url, probe, Instant::now() + Duration::from_secs(60)).await?;
    let serving = started.elapsed();
    let mut second = second;
    second.kill9();
    Ok((cold, listening.as_secs_f64(), serving.as_secs_f64()))
}

pub async fn run(args: RestartArgs) -> Result<()> {
    let scratch = spawn::scratch_dir()?;
    let big = scratch.join("big");
    let small = scratch.join("reference");
    eprintln!("writing {} task folders…", args.tasks);
    let made = Instant::now();
    make_project(&big, args.tasks)?;
    make_project(&small, args.live_leases.max(1) + args.rounds as usize)?;
    eprintln!("  done in {:.1}s", made.elapsed().as_secs_f64());
    let mut rounds = Vec::new();
    for round in 1..=args.rounds {
        // Probe a task no earlier round touched, so its folder is read cold.
        let probe = format!("restart-{}", args.live_leases + round as usize - 1);
        let (cold, listening_s, serving_s) = one_restart(
            &args.spawn_coordinator,
            &big,
            &scratch,
            args.live_leases,
            &probe,
        )
        .await?;
        let (_, reference_listening_s, reference_serving_s) = one_restart(
            &args.spawn_coordinator,
            &small,
            &scratch,
            args.live_leases,
            &probe,
        )
        .await?;
        eprintln!(
            "  round {round}: {} folders: listening {listening_s:.3}s, serving {serving_s:.3}s; small reference: listening {reference_listening_s:.3}s, serving {reference_serving_s:.3}s; page cache {}",
            args.tasks,
            if cold {
                "dropped"
            } else {
                "warm (cannot drop it here)"
            },
        );
        rounds.push(Round {
            round,
            cold_cache: cold,
            listening_s,
            serving_s,
            reference_listening_s,
            reference_serving_s,
        });
    }
    let report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        tasks: args.tasks,
        live_leases: args.live_leases,
        rounds,
    };
    let json = serde_json::to_string_pretty(&report)?;
    match &args.json_out {
        Some(p) => fs::write(p, &json).with_context(|| format!("write {}", p.display()))?,
        None => println!("{json}"),
    }
    if args.keep_temp {
        eprintln!("kept {}", scratch.display());
    } else {
        let _ = fs::remove_dir_all(&scratch);
    }
    Ok(())
}
