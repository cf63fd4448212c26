//! `automaton demo`: the whole product on one machine, in one command. A fresh project (a git
//! repository with one commit), the real coordinator, and three real workers with simulated
//! GPUs of 8, 24 and 80 GiB running the scripted agent; a parent task whose SPEC.md plans
//! three sub-tasks of different sizes in two waves. The demo approves every gate itself (a
//! real fleet leaves that to people), prints each notable event as it happens, and ends with
//! a table: which worker ran each phase of each sub-task and why it fit, the implementer and
//! the reviewer, the reported peak context and the verdicts.
//!
//! Every child is stopped (SIGTERM, then SIGKILL) when the demo ends, however it ends; the
//! temporary folder is removed unless `--keep`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use automaton_proto::vocab;
use automaton_workflow::{EventKind, Gate, Phase};
use clap::Args;
use tonic::transport::Channel;

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Make the demo's project here (a folder that is empty or does not exist); it is kept.
    /// Default: a fresh temporary folder, removed at the end.
    #[arg(long, value_name = "DIR")]
    pub project: Option<PathBuf>,
    /// Keep the temporary folder (project, worker homes, logs) and print its path.
    #[arg(long)]
    pub keep: bool,
    /// Print the summary as JSON on stdout (progress goes to stderr).
    #[arg(long)]
    pub json: bool,
    /// After the task ends, keep the coordinator, its console and the workers running until
    /// Ctrl-C, to look around in the console (its URL is printed at the start).
    #[arg(long)]
    pub stay: bool,
    /// Give up when the parent has not ended within this many seconds.
    #[arg(long, value_name = "SECS", default_value_t = 60, hide = true)]
    pub timeout: u64,
}

/// The parent task the demo runs.
const PARENT: &str = "checkout";

/// The demo's plan: (sub-task, depends on, estimated peak context in k tokens, scope).
/// With simulated GPUs the budgets are 12k (8 GiB), 36k (24 GiB) and 93k (80 GiB) tokens:
/// cart-model fits every worker, payment-gateway all but the 8 GiB one, checkout-api only the
/// 80 GiB one (its code review, which needs half, fits the 24 GiB one).
const PLAN: [(&str, &str, u64, &str); 3] = [
    (
        "cart-model",
        "-",
        8,
        "cart items, totals and discounts; its unit tests pass",
    ),
    (
        "payment-gateway",
        "-",
        30,
        "card payments through the gateway client; its contract tests pass",
    ),
    (
        "checkout-api",
        "cart-model, payment-gateway",
        60,
        "POST /checkout ties the cart to a payment; an API test checks a cart out",
    ),
];

/// The workers: (name, simulated GPU).
const FLEET: [(&str, &str); 3] = [
    ("gpu-8", "sim-8:8GiB"),
    ("gpu-24", "sim-24:24GiB"),
    ("gpu-80", "sim-80:80GiB"),
];

/// Runs `automaton demo`; prints and returns the exit code.
pub fn run(args: &DemoArgs) -> i32 {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("ERROR: cannot start the async runtime: {e}");
            return 2;
        }
    };
    let out = Out::new(args.json);
    let result = runtime.block_on(async {
        tokio::select! {
            r = demo(args, &out) => r,
            _ = interrupted() => match out.staying.get() {
                Some(code) => Ok(code),
                None => Err(Failed::new(130, "interrupted: stopping the fleet")),
            },
        }
    });
    // The fleet and the folder are gone once `demo` returned or was dropped.
    match result {
        Ok(code) => code,
        Err(f) => {
            eprintln!("ERROR: {}", f.message);
            f.code
        }
    }
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
}

/// Why the demo failed, and the exit code.
#[derive(Debug)]
struct Failed {
    code: i32,
    message: String,
}

impl Failed {
    fn new(code: i32, message: impl Into<String>) -> Failed {
        Failed {
            code,
            message: message.into(),
        }
    }
    fn setup(message: impl Into<String>) -> Failed {
        Failed::new(2, message)
    }
}

/// Where progress goes (stdout, or stderr with `--json`) and whether it may be coloured.
struct Out {
    json: bool,
    colour: bool,
    /// When the fleet started (reset after any build), for the stamps and the summary.
    start: std::cell::Cell<Instant>,
    /// With `--stay`: the demo is over (this is its exit code) and the fleet waits for Ctrl-C.
    staying: std::cell::Cell<Option<i32>>,
}

impl Out {
    fn new(json: bool) -> Out {
        let colour = std::env::var_os("NO_COLOR").is_none()
            && if json {
                std::io::stderr().is_terminal()
            } else {
                std::io::stdout().is_terminal()
            };
        Out {
            json,
            colour,
            start: std::cell::Cell::new(Instant::now()),
            staying: std::cell::Cell::new(None),
        }
    }

    fn paint(&self, code: &str, s: &str) -> String {
        if self.colour {
            format!("\x1b[{code}m{s}\x1b[0m")
        } else {
            s.to_string()
        }
    }

    /// One progress line, stamped with the seconds since the demo started.
    fn line(&self, s: &str) {
        let stamp = format!("{:>5.1}s", self.start.get().elapsed().as_secs_f64());
        let text = format!("{}  {s}\n", self.paint("2", &stamp));
        self.raw(&text);
    }

    /// Unstamped text on the progress stream.
    fn raw(&self, s: &str) {
        if self.json {
            let mut e = std::io::stderr().lock();
            let _ = e.write_all(s.as_bytes());
        } else {
            crate::print(s);
        }
    }
}

/// The children and the temporary folder: stopped and removed on drop, however the demo ends.
struct Fleet {
    /// (name, process), in start order; stopped in reverse (workers before the coordinator).
    children: Vec<(String, Child)>,
    /// The temporary folder, removed on drop unless kept.
    base: PathBuf,
    keep: bool,
}

impl Fleet {
    /// SIGTERM to every child still running (newest first), then SIGKILL to any still alive
    /// after a few seconds.
    fn stop(&mut self) {
        for (_, child) in self.children.iter_mut().rev() {
            if let Ok(None) = child.try_wait() {
                let _ = Command::new("kill")
                    .args(["-TERM", &child.id().to_string()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
                // Workers deregister before the coordinator goes.
                let deadline = Instant::now() + Duration::from_secs(5);
                while let Ok(None) = child.try_wait() {
                    if Instant::now() >= deadline {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
        self.children.clear();
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.stop();
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }
}

/// `automaton-coordinator` and `automaton-worker`, next to this binary. Under `cargo run`
/// (`CARGO` and `CARGO_MANIFEST_DIR` set) they are built first with the same profile, since
/// `cargo run --bin automaton` builds only this binary.
fn siblings(out: &Out) -> Result<(PathBuf, PathBuf), Failed> {
    let exe = std::env::current_exe()
        .map_err(|e| Failed::setup(format!("cannot find this binary: {e}")))?;
    let dir = exe
        .parent()
        .ok_or_else(|| Failed::setup("this binary has no folder"))?
        .to_path_buf();
    let bin = |n: &str| dir.join(format!("{n}{}", std::env::consts::EXE_SUFFIX));
    let (coord, worker) = (bin("automaton-coordinator"), bin("automaton-worker"));
    if let (Some(cargo), Some(manifest)) = (
        std::env::var_os("CARGO"),
        std::env::var_os("CARGO_MANIFEST_DIR"),
    ) {
        let profile = dir.file_name().and_then(|n| n.to_str()).unwrap_or("debug");
        out.line(&format!(
            "building automaton-coordinator and automaton-worker ({profile}; cargo run builds only automaton)…"
        ));
        let mut c = Command::new(cargo);
        c.arg("build").current_dir(manifest);
        // What `cargo run` set for this binary, not the user's environment: a build script
        // that watches one of these (ring watches CARGO_MANIFEST_DIR) would otherwise be
        // rebuilt, with everything above it, by every `cargo run` and again by this build.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy();
            if k.starts_with("CARGO_PKG_")
                || [
                    "CARGO_MANIFEST_DIR",
                    "CARGO_MANIFEST_PATH",
                    "CARGO_CRATE_NAME",
                    "CARGO_BIN_NAME",
                    "CARGO_PRIMARY_PACKAGE",
                    "OUT_DIR",
                ]
                .contains(&k.as_ref())
            {
                c.env_remove(k.as_ref());
            }
        }
        match profile {
            "debug" => {}
            "release" => {
                c.arg("--release");
            }
            other => {
                c.args(["--profile", other]);
            }
        }
        c.args(["-p", "automaton-coordinator", "-p", "automaton-worker"]);
        c.stdout(Stdio::null()).stderr(Stdio::inherit());
        let st = c
            .status()
            .map_err(|e| Failed::setup(format!("cannot run cargo build: {e}")))?;
        if !st.success() {
            return Err(Failed::setup(format!(
                "cargo build of automaton-coordinator and automaton-worker failed ({st})"
            )));
        }
    }
    for b in [&coord, &worker] {
        if !b.is_file() {
            return Err(Failed::setup(format!(
                "{} is missing: the demo runs the coordinator and worker binaries that sit next to automaton; build all three with `cargo build --release` (or run `cargo run --release --bin automaton -- demo`)",
                b.display()
            )));
        }
    }
    Ok((coord, worker))
}

/// Removes every `AUTOMATON_*` variable, so the children depend only on their flags.
fn scrub(c: &mut Command) {
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("AUTOMATON_") {
            c.env_remove(&k);
        }
    }
}

fn mkdir(p: &Path) -> Result<(), Failed> {
    std::fs::create_dir_all(p)
        .map_err(|e| Failed::setup(format!("cannot create {}: {e}", p.display())))
}

fn write(p: &Path, text: &str) -> Result<(), Failed> {
    std::fs::write(p, text).map_err(|e| Failed::setup(format!("cannot write {}: {e}", p.display())))
}

fn log_file(p: &Path) -> Result<std::fs::File, Failed> {
    std::fs::File::create(p)
        .map_err(|e| Failed::setup(format!("cannot create {}: {e}", p.display())))
}

/// A fresh temporary folder (`automaton-demo-PID-N` under the system's temp dir).
fn temp_base() -> Result<PathBuf, Failed> {
    let tmp = std::env::temp_dir();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    for i in 0..100u32 {
        let p = tmp.join(format!(
            "automaton-demo-{}-{nanos:x}{i}",
            std::process::id()
        ));
        match std::fs::create_dir(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => {
                return Err(Failed::setup(format!(
                    "cannot create a folder in {}: {e}",
                    tmp.display()
                )));
            }
        }
    }
    Err(Failed::setup(format!(
        "cannot create a fresh folder in {}",
        tmp.display()
    )))
}

/// `git init` with one commit (README.md, src/lib.rs); false when git is not there.
fn git_init(root: &Path, home: &Path) -> Result<bool, Failed> {
    let have_git = Command::new("git")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !have_git {
        return Ok(false);
    }
    mkdir(&root.join("src"))?;
    write(
        &root.join("README.md"),
        "# shop\n\nThe project of `automaton demo`.\n",
    )?;
    write(&root.join("src/lib.rs"), "pub fn shop() {}\n")?;
    for args in [
        vec!["-c", "init.defaultBranch=main", "init", "-q"],
        vec!["add", "README.md", "src/lib.rs"],
        vec![
            "-c",
            "user.name=automaton-demo",
            "-c",
            "user.email=demo@automaton.invalid",
            "commit",
            "-q",
            "-m",
            "init",
        ],
    ] {
        let out = Command::new("git")
            .args(&args)
            .current_dir(root)
            .env("HOME", home)
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| Failed::setup(format!("cannot run git: {e}")))?;
        if !out.status.success() {
            return Err(Failed::setup(format!(
                "git {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
    }
    Ok(true)
}

/// The parent's SPEC.md: the request and the plan the scripted agent turns into DECOMPOSITION.md.
fn spec_md() -> String {
    let mut s = format!(
        "# SPEC — {PARENT}\n\n\
         Add a checkout to the shop: a cart model, a payment gateway client, and the checkout\n\
         API on top of both. Too large for one agent's context: planned as three sub-tasks.\n\n\
         ## Plan\n\n\
         | sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n\
         | --- | --- | --- | --- |\n"
    );
    for (name, deps, k, scope) in PLAN {
        s.push_str(&format!("| {name} | {deps} | {k} | {scope} |\n"));
    }
    s
}

/// The coordinator's clients.
#[derive(Clone)]
struct Api {
    tasks: pb::tasks_client::TasksClient<Channel>,
    workers: pb::workers_client::WorkersClient<Channel>,
    events: pb::events_client::EventsClient<Channel>,
}

/// A worker as the demo saw it when the fleet had joined.
#[derive(Clone, Debug)]
struct WorkerView {
    name: String,
    gpu: String,
    budget: u64,
}

fn k(tokens: u64) -> String {
    format!("{}k", (tokens + 500) / 1000)
}

/// Starts the coordinator with its console; returns its URL and the console's once it
/// printed `console on URL` and `listening on ADDR`.
fn start_coordinator(
    fleet: &mut Fleet,
    bin: &Path,
    project: &Path,
    home: &Path,
    config: &Path,
    log: &Path,
) -> Result<(String, String), Failed> {
    let mut c = Command::new(bin);
    scrub(&mut c);
    c.arg("--project")
        .arg(project)
        .arg("--config")
        .arg(config)
        .args([
            "--listen",
            "127.0.0.1:0",
            "--web-listen",
            "127.0.0.1:0",
            "--session-timeout",
            "2s",
            "--heartbeat-interval",
            "500ms",
        ])
        .env("HOME", home)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file(log)?);
    let mut child = c
        .spawn()
        .map_err(|e| Failed::setup(format!("cannot start {}: {e}", bin.display())))?;
    let stdout = child.stdout.take();
    fleet.children.push(("coordinator".into(), child));
    let Some(stdout) = stdout else {
        return Err(Failed::setup("the coordinator's stdout is not readable"));
    };
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        // The first line is the address; the rest is drained so the child never blocks.
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            let _ = tx.send(line);
        }
    });
    let silent = || {
        Failed::setup(format!(
            "the coordinator printed no `listening on` line within 20 s: see {}",
            log.display()
        ))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut console = String::new();
    let line = loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .map_err(|_| silent())?;
        match line.strip_prefix("console on ") {
            Some(u) => console = u.trim().to_string(),
            None => break line,
        }
    };
    let addr = line
        .strip_prefix("listening on ")
        .map(str::trim)
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
        .ok_or_else(|| {
            Failed::setup(format!(
                "the coordinator's first line is not `listening on ADDR`: {line:?}"
            ))
        })?;
    Ok((format!("http://127.0.0.1:{}", addr.port()), console))
}

fn start_worker(
    fleet: &mut Fleet,
    bin: &Path,
    url: &str,
    name: &str,
    gpu: &str,
    dir: &Path,
    logs: &Path,
) -> Result<(), Failed> {
    let home = dir.join("home");
    mkdir(&home)?;
    let log = logs.join(format!("{name}.log"));
    let out = log_file(&log)?;
    let err = out
        .try_clone()
        .map_err(|e| Failed::setup(format!("cannot open {}: {e}", log.display())))?;
    let mut c = Command::new(bin);
    scrub(&mut c);
    c.args(["--coordinator", url, "--name", name, "--simulate-gpu", gpu])
        .args([
            "--agent",
            "scripted",
            "--max-backoff",
            "200ms",
            "--kill-grace",
            "300ms",
        ])
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .env("HOME", &home)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    let child = c
        .spawn()
        .map_err(|e| Failed::setup(format!("cannot start {}: {e}", bin.display())))?;
    fleet.children.push((name.to_string(), child));
    Ok(())
}

/// The demo's project: `--project DIR` (empty or absent), else `{base}/project`.
fn project_dir(args: &DemoArgs, base: &Path) -> Result<PathBuf, Failed> {
    let Some(p) = &args.project else {
        let p = base.join("project");
        mkdir(&p)?;
        return Ok(p);
    };
    if p.exists() {
        let mut entries = std::fs::read_dir(p).map_err(|e| {
            Failed::setup(format!(
                "--project {}: not a readable folder ({e})",
                p.display()
            ))
        })?;
        if entries.next().is_some() {
            return Err(Failed::setup(format!(
                "--project {}: the folder is not empty; name an empty or new folder",
                p.display()
            )));
        }
    } else {
        mkdir(p)?;
    }
    std::path::absolute(p).map_err(|e| Failed::setup(format!("--project {}: {e}", p.display())))
}

async fn demo(args: &DemoArgs, out: &Out) -> Result<i32, Failed> {
    let (coord_bin, worker_bin) = siblings(out)?;
    out.start.set(Instant::now());
    let base = temp_base()?;
    let mut fleet = Fleet {
        children: Vec::new(),
        base: base.clone(),
        keep: args.keep,
    };
    let project = project_dir(args, &base)?;
    let home = base.join("home");
    let logs = base.join("logs");
    mkdir(&home)?;
    mkdir(&logs)?;
    let git = git_init(&project, &home)?;
    mkdir(&project.join(".automaton"))?;
    write(
        &project.join(".automaton/.agent.md"),
        "# Agent policy\n\nMode: multi-agent\n",
    )?;

    out.raw(&format!(
        "{}\n",
        out.paint(
            "1",
            "automaton demo: one coordinator, three simulated GPU workers running the scripted agent, one task planned in two waves"
        )
    ));
    out.raw(&format!(
        "  project      {}{}\n",
        project.display(),
        if git {
            " (a git repository with one commit)"
        } else {
            " (git is not installed: no repository, agents write artifacts only)"
        }
    ));
    // Finished work lands on the project's `main`, merged as reviewed (docs/delivery.md).
    let config = base.join("coordinator.toml");
    write(
        &config,
        "# The demo's coordinator: finished work is merged into the branch it started from.\n[delivery]\nmode = \"merge\"\nstrategy = \"merge\"\n",
    )?;
    let (url, console) = start_coordinator(
        &mut fleet,
        &coord_bin,
        &project,
        &home,
        &config,
        &logs.join("coordinator.log"),
    )?;
    out.raw(&format!(
        "  coordinator  {url}  (log {})\n",
        logs.join("coordinator.log").display()
    ));
    if !console.is_empty() {
        out.raw(&format!(
            "  console      {console}  (open it in a browser{})\n",
            if args.stay {
                "; it stays up after the task ends, until Ctrl-C"
            } else {
                " while the demo runs; --stay keeps it up"
            }
        ));
    }
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .map_err(|e| Failed::setup(format!("bad coordinator address {url}: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| Failed::setup(format!("cannot connect to the coordinator at {url}: {e}")))?;
    let mut api = Api {
        tasks: pb::tasks_client::TasksClient::new(channel.clone()),
        workers: pb::workers_client::WorkersClient::new(channel.clone()),
        events: pb::events_client::EventsClient::new(channel),
    };
    // Subscribed before anything happens, so no event is missed.
    let mut stream = api
        .events
        .watch_events(pb::WatchEventsRequest {})
        .await
        .map_err(|e| Failed::setup(format!("WatchEvents: {}", e.message())))?
        .into_inner();
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel::<pb::Event>();
    tokio::spawn(async move {
        while let Ok(Some(e)) = stream.message().await {
            if tx.send(e).is_err() {
                return;
            }
        }
    });

    // The task and its plan first, the workers next: the research that reads the plan is
    // dispatched only once a worker is there.
    api.tasks
        .create_task(pb::CreateTaskRequest {
            task: PARENT.into(),
        })
        .await
        .map_err(|e| Failed::setup(format!("CreateTask {PARENT}: {}", e.message())))?;
    // SPEC.md is research's artifact: it may be written once the task is in research.
    api.tasks
        .transition(pb::TransitionRequest {
            task: PARENT.into(),
            target: "research".into(),
            ..Default::default()
        })
        .await
        .map_err(|e| Failed::setup(format!("Transition {PARENT} to research: {}", e.message())))?;
    let parent_dir = project.join(".automaton/tasks").join(PARENT);
    write(&parent_dir.join("SPEC.md"), &spec_md())?;

    for (name, gpu) in FLEET {
        let dir = base.join("workers").join(name);
        mkdir(&dir)?;
        start_worker(&mut fleet, &worker_bin, &url, name, gpu, &dir, &logs)?;
    }
    let workers = joined(&mut api, &mut fleet, &logs).await?;
    for w in &workers {
        out.raw(&format!(
            "  worker       {:<7} {:<16} holds sub-tasks up to {} tokens  (log {})\n",
            w.name,
            w.gpu,
            k(w.budget),
            logs.join(format!("{}.log", w.name)).display()
        ));
    }
    let plan: Vec<String> = PLAN
        .iter()
        .map(|(n, d, e, _)| {
            if *d == "-" {
                format!("{n} {e}k")
            } else {
                format!("{n} {e}k after {d}")
            }
        })
        .collect();
    out.raw(&format!(
        "  task         {PARENT}: SPEC.md plans {}\n",
        plan.join("; ")
    ));
    out.raw(&format!(
        "{}\n\n",
        out.paint(
            "33",
            "NOTE: the demo approves every gate itself, as an operator; a real fleet leaves that to people (automaton approve TASK)."
        )
    ));

    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let mut watch = Watch::new(&workers);
    let mut tick = tokio::time::interval(Duration::from_millis(300));
    let (_, why) = loop {
        tokio::select! {
            e = events.recv() => {
                let Some(e) = e else {
                    return Err(Failed::new(1, format!("the coordinator's event stream ended (see {})", logs.join("coordinator.log").display())));
                };
                if vocab::event_kind(&e) == Some(EventKind::Transitioned)
                    && vocab::entered(&e).is_some_and(|s| s.gate == Gate::AwaitingApproval)
                {
                    approve(&mut api, &e.task).await;
                }
                watch.event(&e, out);
                if let Some(end) = watch.parent_end.clone() {
                    break end;
                }
            }
            _ = tick.tick() => {
                if Instant::now() >= deadline {
                    let state = parent_state(&mut api).await;
                    return Err(Failed::new(1, format!(
                        "the parent '{PARENT}' did not end within {} s (it is {state}); rerun with --keep to look at the logs",
                        args.timeout
                    )));
                }
                // A safety net for a gate whose event was missed, and the waiting reasons.
                if let Some(end) = sweep(&mut api, &mut watch, out).await {
                    break end;
                }
            }
        }
    };
    // The state as the coordinator has it now (the loop ends on the parent's end).
    let state = parent_state(&mut api).await;
    // A complete parent's work is delivered: wait (bounded) for its merge into `main`.
    let complete = state.parse::<automaton_workflow::State>().ok()
        == Some(automaton_workflow::State::open(Phase::Complete));
    if complete && git {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let d = parent_delivery(&mut api).await;
            if let Some(d) = &d
                && (vocab::delivery_state(d)
                    .is_some_and(automaton_workflow::DeliveryState::is_final)
                    || !d.waiting.is_empty())
            {
                break;
            }
            if Instant::now() >= until {
                out.line(&out.paint(
                    "33",
                    &format!("{PARENT}: its delivery did not end within 30 s: see automaton status --task {PARENT}"),
                ));
                break;
            }
            tokio::select! {
                e = events.recv() => {
                    let Some(e) = e else { break };
                    watch.event(&e, out);
                }
                _ = tick.tick() => {}
            }
        }
    }
    let summary = summary(&mut api, &project, &workers, &state, &why, out).await;
    let code = if complete { 0 } else { 1 };
    if args.json {
        let mut v = summary;
        if let Some(o) = v.as_object_mut() {
            o.insert("kept".into(), serde_json::Value::Bool(args.keep));
            o.insert("console".into(), serde_json::Value::String(console.clone()));
            o.insert(
                "folder".into(),
                serde_json::Value::String(base.display().to_string()),
            );
        }
        crate::print(&format!(
            "{}\n",
            serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string())
        ));
    } else {
        crate::print(&table(&summary, out));
    }
    if args.keep {
        out.raw(&format!(
            "Kept {} (project {}, logs {}).\n",
            base.display(),
            project.display(),
            logs.display()
        ));
    } else if args.project.is_some() {
        out.raw(&format!("The project is kept at {}.\n", project.display()));
    }
    if code != 0 {
        eprintln!("ERROR: the parent '{PARENT}' ended {state}: {why}");
    }
    if args.stay {
        out.raw(&format!(
            "The fleet stays up: console {console}, coordinator {url}. Ctrl-C stops it.\n"
        ));
        // Ctrl-C (or SIGTERM) ends the demo with this code; dropping it stops the fleet.
        out.staying.set(Some(code));
        std::future::pending::<()>().await;
    }
    fleet.stop();
    Ok(code)
}

/// Waits (bounded) until every worker of the fleet has joined; their budgets.
async fn joined(api: &mut Api, fleet: &mut Fleet, logs: &Path) -> Result<Vec<WorkerView>, Failed> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        for (name, child) in fleet.children.iter_mut() {
            if let Ok(Some(st)) = child.try_wait() {
                return Err(Failed::setup(format!(
                    "{name} exited ({st}) before joining: see {}",
                    logs.join(format!("{name}.log")).display()
                )));
            }
        }
        let listed = api
            .workers
            .list_workers(pb::ListWorkersRequest {})
            .await
            .map(|r| r.into_inner().workers)
            .unwrap_or_default();
        let views: Vec<WorkerView> = FLEET
            .iter()
            .filter_map(|(name, _)| {
                let w = listed.iter().find(|w| {
                    w.name == *name
                        && vocab::worker_state(w) != Some(automaton_workflow::WorkerState::Lost)
                })?;
                let gpu = w
                    .gpus
                    .first()
                    .map(|g| {
                        format!(
                            "{} {} GiB",
                            g.name,
                            (g.total_bytes as f64 / (1u64 << 30) as f64).round()
                        )
                    })
                    .unwrap_or_default();
                Some(WorkerView {
                    name: w.name.clone(),
                    gpu,
                    budget: w.budget.as_ref().map_or(0, |b| b.max_peak_context_kb),
                })
            })
            .collect();
        if views.len() == FLEET.len() {
            return Ok(views);
        }
        if Instant::now() >= deadline {
            return Err(Failed::setup(format!(
                "the workers did not all join within 20 s (joined: {}); see the logs in {}",
                views
                    .iter()
                    .map(|w| w.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                logs.display()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Approves `task`'s gate as an operator; a gate already approved (the sweep and the event
/// raced) is not an error.
async fn approve(api: &mut Api, task: &str) {
    let _ = api
        .tasks
        .approve(pb::ApproveRequest {
            task: task.into(),
            approver: "automaton-demo".into(),
            ..Default::default()
        })
        .await;
}

/// The parent's delivery, as the coordinator reports it.
async fn parent_delivery(api: &mut Api) -> Option<pb::Delivery> {
    api.tasks
        .get_task(pb::GetTaskRequest {
            task: PARENT.into(),
            with_contents: false,
            with_changes: false,
        })
        .await
        .ok()
        .and_then(|d| d.into_inner().summary.and_then(|s| s.delivery))
}

async fn parent_state(api: &mut Api) -> String {
    api.tasks
        .get_task(pb::GetTaskRequest {
            task: PARENT.into(),
            with_contents: false,
            with_changes: false,
        })
        .await
        .ok()
        .and_then(|d| d.into_inner().summary.map(|s| s.state))
        .unwrap_or_else(|| "unknown".into())
}

/// Every few hundred ms: approves any gate still waiting, reports new waiting reasons, and
/// notices a parent that ended (should its event have been missed).
async fn sweep(api: &mut Api, watch: &mut Watch, out: &Out) -> Option<(String, String)> {
    let list = api
        .tasks
        .list_tasks(pb::ListTasksRequest {})
        .await
        .ok()?
        .into_inner();
    let mut all = Vec::new();
    for t in list.tasks {
        all.extend(t.subtasks.iter().cloned());
        all.push(t);
    }
    for t in &all {
        if t.state.ends_with(":awaiting_approval") {
            approve(api, &t.task).await;
        }
        if t.task.contains('/')
            && t.waiting.contains("no worker fits")
            && watch.stuck.insert(t.task.clone())
        {
            out.line(&out.paint("33", &format!("{}: {}", t.task, t.waiting)));
        }
        // The parent's own event normally ends the wait; this is the net if it never comes.
        if t.task == PARENT
            && t.state
                .parse::<automaton_workflow::State>()
                .is_ok_and(|s| matches!(s.phase, Phase::Complete | Phase::HumanIntervention))
        {
            watch.parent_sweeps += 1;
            if watch.parent_sweeps >= 3 {
                return Some((
                    t.state.clone(),
                    watch.parent_why.clone().unwrap_or_default(),
                ));
            }
        }
    }
    None
}

/// What the event stream has shown so far.
struct Watch {
    workers: Vec<WorkerView>,
    /// Sub-task → wave.
    waves: BTreeMap<String, u32>,
    /// Sub-tasks that reached a terminal state, with it.
    ended: HashMap<String, String>,
    waves_done: HashSet<u32>,
    /// Sub-tasks reported as fitting no worker.
    stuck: HashSet<String>,
    parent_why: Option<String>,
    parent_end: Option<(String, String)>,
    /// Sweeps that saw the parent ended (its event not yet seen).
    parent_sweeps: u32,
}

impl Watch {
    fn new(workers: &[WorkerView]) -> Watch {
        Watch {
            workers: workers.to_vec(),
            waves: BTreeMap::new(),
            ended: HashMap::new(),
            waves_done: HashSet::new(),
            stuck: HashSet::new(),
            parent_why: None,
            parent_end: None,
            parent_sweeps: 0,
        }
    }

    fn prefix(&self, task: &str) -> String {
        match self.waves.get(task) {
            Some(w) => format!("wave {w}  {}", leaf(task)),
            None => task.to_string(),
        }
    }

    fn event(&mut self, e: &pb::Event, out: &Out) {
        let kind = vocab::event_kind(e);
        let entered = vocab::entered(e).filter(|_| kind == Some(EventKind::Transitioned));
        let ended = entered
            .map(|s| s.phase)
            .filter(|p| matches!(p, Phase::Complete | Phase::HumanIntervention));
        let Some(kind) = kind else {
            return;
        };
        match kind {
            EventKind::SubtaskCreated => {
                let wave = e
                    .detail
                    .strip_prefix("wave ")
                    .and_then(|r| r.split(',').next())
                    .and_then(|w| w.trim().parse::<u32>().ok())
                    .unwrap_or(0);
                self.waves.insert(e.task.clone(), wave);
                let estimate = PLAN
                    .iter()
                    .find(|p| p.0 == leaf(&e.task))
                    .map_or(0, |p| p.2 * 1000);
                let fits: Vec<String> = self
                    .workers
                    .iter()
                    .filter(|w| estimate > 0 && w.budget >= estimate)
                    .map(|w| format!("{} ({})", w.name, k(w.budget)))
                    .collect();
                let fits = if estimate == 0 {
                    String::new()
                } else if fits.is_empty() {
                    "; fits no worker".into()
                } else if fits.len() == self.workers.len() {
                    format!("; fits every worker: {}", fits.join(", "))
                } else {
                    format!("; fits {}", fits.join(", "))
                };
                // The detail reads `wave N, estimated peak context …`: the wave leads the line.
                let detail = e
                    .detail
                    .split_once(", ")
                    .map_or(e.detail.as_str(), |(_, rest)| rest);
                out.line(&format!(
                    "{}  {} created: {detail}{fits}",
                    out.paint("1", &format!("wave {wave}")),
                    leaf(&e.task),
                ));
            }
            EventKind::SubtaskTooLarge => {
                self.stuck.insert(e.task.clone());
                out.line(&out.paint("33", &format!("{}: too large: {}", e.task, e.detail)));
            }
            EventKind::Assigned => {
                // `{state} (attempt n): {why}`
                let (state, why) = e.detail.split_once(": ").unwrap_or((&e.detail, ""));
                let state = state.trim_end_matches(" (attempt 1)");
                out.line(&format!(
                    "{}: {state} → {}  ({why})",
                    self.prefix(&e.task),
                    out.paint("36", &e.agent)
                ));
            }
            EventKind::RunStopped => {
                let (state, reason) = e.detail.split_once(": ").unwrap_or((&e.detail, ""));
                let (word, rest) = reason.split_at(reason.find(' ').unwrap_or(reason.len()));
                if word.parse() == Ok(automaton_workflow::StopReason::Completed) {
                    out.line(&format!(
                        "{}: {state} {} on {}{rest}",
                        self.prefix(&e.task),
                        out.paint("32", "done"),
                        e.agent
                    ));
                } else {
                    out.line(&out.paint(
                        "31",
                        &format!(
                            "{}: {state} stopped on {}: {reason}",
                            self.prefix(&e.task),
                            e.agent
                        ),
                    ));
                }
            }
            EventKind::SizingLearned => {
                out.line(&format!("sizing: {} {}", leaf(&e.task), e.detail));
            }
            EventKind::SubtaskMerged => {
                out.line(&format!("{}: merged {}", self.prefix(&e.task), e.detail));
            }
            EventKind::Merged | EventKind::PullRequestOpened => {
                out.line(&out.paint("1;32", &format!("{}: delivered: {}", e.task, e.detail)));
            }
            EventKind::Rework | EventKind::DeliveryFailed | EventKind::DeliveryAwaitingApproval => {
                out.line(&out.paint("33", &format!("{}: {}: {}", e.task, e.kind, e.detail)));
            }
            EventKind::WorkerLost
            | EventKind::WorkerLeft
            | EventKind::TaskHeld
            | EventKind::SubtaskOrphaned => {
                out.line(&out.paint(
                    "33",
                    &format!(
                        "{}: {} {}",
                        e.kind,
                        if e.task.is_empty() { &e.agent } else { &e.task },
                        e.detail
                    ),
                ));
            }
            EventKind::Transitioned => {
                if let Some(to) = ended.filter(|_| self.waves.contains_key(&e.task)) {
                    self.ended.insert(e.task.clone(), to.name().to_string());
                    out.line(&format!(
                        "{}: {}",
                        self.prefix(&e.task),
                        out.paint(if to == Phase::Complete { "32" } else { "31" }, to.name())
                    ));
                    self.wave_check(out);
                }
            }
            _ => {}
        }
        if e.task == PARENT {
            if let Some(to) = ended {
                self.ended.insert(PARENT.into(), to.name().to_string());
            }
            if kind == EventKind::ParentEnded {
                let state = self
                    .ended
                    .get(PARENT)
                    .cloned()
                    .unwrap_or_else(|| "ended".into());
                let complete = state.parse::<Phase>() == Ok(Phase::Complete);
                out.line(&out.paint(
                    if complete { "1;32" } else { "1;31" },
                    &format!("{PARENT}: {state} — {}", e.detail),
                ));
                self.parent_why = Some(e.detail.clone());
                self.parent_end = Some((state, e.detail.clone()));
            }
        }
    }

    /// Prints `wave N done` for each wave whose sub-tasks have all ended.
    fn wave_check(&mut self, out: &Out) {
        let waves: HashSet<u32> = self.waves.values().copied().collect();
        let mut waves: Vec<u32> = waves.into_iter().collect();
        waves.sort_unstable();
        for w in waves {
            if self.waves_done.contains(&w) {
                continue;
            }
            let subs: Vec<&String> = self
                .waves
                .iter()
                .filter(|(_, v)| **v == w)
                .map(|(t, _)| t)
                .collect();
            if subs.iter().all(|t| self.ended.contains_key(*t)) {
                self.waves_done.insert(w);
                let list: Vec<String> = subs
                    .iter()
                    .map(|t| {
                        format!(
                            "{} {}",
                            leaf(t),
                            self.ended.get(*t).map_or("", String::as_str)
                        )
                    })
                    .collect();
                out.line(&out.paint("1", &format!("wave {w} done: {}", list.join(", "))));
            }
        }
    }
}

fn leaf(task: &str) -> &str {
    task.rsplit('/').next().unwrap_or(task)
}

/// The phases that are not code review (the separated phase).
const REVIEW: &str = "code_review";

/// The summary: every sub-task with its wave, estimate, peak, ratio, the worker of each phase
/// and why it fit, implementer, reviewer and verdict; the parent's end.
async fn summary(
    api: &mut Api,
    project: &Path,
    workers: &[WorkerView],
    state: &str,
    why: &str,
    out: &Out,
) -> serde_json::Value {
    let list = api
        .tasks
        .list_tasks(pb::ListTasksRequest {})
        .await
        .map(|r| r.into_inner())
        .unwrap_or_default();
    let parent = list.tasks.iter().find(|t| t.task == PARENT);
    let subs: Vec<pb::TaskSummary> = parent.map(|t| t.subtasks.clone()).unwrap_or_default();
    // Seed 002's aggregation, as the coordinator reports the parent.
    let verdicts = parent.and_then(|t| t.verdicts.clone());
    let attention = parent.map(|t| t.attention.clone()).unwrap_or_default();
    let budget = |w: &str| workers.iter().find(|v| v.name == w).map_or(0, |v| v.budget);
    let store = automaton_store::Project::open(project, None);
    let mut rows = Vec::new();
    let mut subs = subs;
    subs.sort_by_key(|s| (s.wave, PLAN.iter().position(|p| p.0 == leaf(&s.task))));
    for s in &subs {
        let runs = api
            .tasks
            .get_task(pb::GetTaskRequest {
                task: s.task.clone(),
                with_contents: false,
                with_changes: false,
            })
            .await
            .map(|d| d.into_inner().runs)
            .unwrap_or_default();
        let done: Vec<&pb::Run> = runs
            .iter()
            .filter(|r| automaton_proto::vocab::RunVocab::completed(*r))
            .collect();
        let by = |phase: &str| {
            done.iter()
                .rev()
                .find(|r| r.phase == phase)
                .map(|r| r.worker.clone())
                .unwrap_or_default()
        };
        let estimate = PLAN
            .iter()
            .find(|p| p.0 == leaf(&s.task))
            .map_or(s.estimated_tokens, |p| p.2 * 1000);
        // The producing phases' largest reported peak, against the need they were sized for
        // (the estimate as corrected when the sub-task was first dispatched).
        let (peak, sized) = done
            .iter()
            .filter(|r| r.phase != REVIEW)
            .map(|r| (r.peak_context_tokens, r.estimated_tokens))
            .max()
            .unwrap_or((0, 0));
        let verdict = s
            .task
            .parse::<automaton_workflow::TaskName>()
            .ok()
            .and_then(|t| std::fs::read_to_string(store.task_dir(&t).join("VERDICT.md")).ok())
            .and_then(|t| automaton_workflow::parse_verdict(&t))
            .map_or("-".to_string(), |v| v.to_string());
        let phases: Vec<serde_json::Value> = done
            .iter()
            .map(|r| {
                serde_json::json!({
                    "phase": r.phase,
                    "worker": r.worker,
                    "need_tokens": r.estimated_tokens,
                    "budget_tokens": budget(&r.worker),
                    "peak_context_tokens": r.peak_context_tokens,
                    "why": r.why,
                })
            })
            .collect();
        rows.push(serde_json::json!({
            "task": s.task,
            "name": leaf(&s.task),
            "wave": s.wave,
            "state": s.state,
            "estimated_tokens": estimate,
            "corrected_estimate_tokens": s.estimated_tokens,
            "peak_context_tokens": peak,
            "sized_tokens": sized,
            "ratio": if sized > 0 && peak > 0 { Some(((peak as f64 / sized as f64) * 100.0).round() / 100.0) } else { None },
            "implementer": by("implement"),
            "reviewer": by(REVIEW),
            "verdict": verdict,
            "phases": phases,
        }));
    }
    let delivery = parent.and_then(|t| t.delivery.as_ref());
    serde_json::json!({
        "parent": {
            "task": PARENT,
            "state": state,
            "why": why,
            "verdicts": verdicts.as_ref().map(crate::workers::verdicts_json),
            "attention": attention,
            "delivery": delivery.map(crate::workers::delivery_json),
        },
        "elapsed_ms": out.start.get().elapsed().as_millis() as u64,
        "sizing_ratio": list.sizing_ratio,
        "workers": workers.iter().map(|w| serde_json::json!({"name": w.name, "gpu": w.gpu, "budget_tokens": w.budget})).collect::<Vec<_>>(),
        "subtasks": rows,
    })
}

/// Phases run together on one worker (joined), the worker, why it fit.
type PhaseGroup = (String, String, String);

/// The summary as text: a table, then each sub-task's phases grouped by worker with why.
fn table(v: &serde_json::Value, out: &Out) -> String {
    let s = |v: &serde_json::Value, key: &str| -> String {
        match &v[key] {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Null => "-".into(),
            other => other.to_string(),
        }
    };
    let n = |v: &serde_json::Value, key: &str| v[key].as_u64().unwrap_or(0);
    let empty = Vec::new();
    let subs = v["subtasks"].as_array().unwrap_or(&empty);
    let head = [
        "SUB-TASK",
        "WAVE",
        "ESTIMATE (→ SIZED)",
        "PEAK",
        "PEAK/SIZED",
        "IMPLEMENTER",
        "REVIEWER",
        "VERDICT",
    ];
    let rows: Vec<[String; 8]> = subs
        .iter()
        .map(|t| {
            [
                s(t, "name"),
                s(t, "wave"),
                match (n(t, "estimated_tokens"), n(t, "sized_tokens")) {
                    (e, z) if z > 0 && k(z) != k(e) => format!("{} → {}", k(e), k(z)),
                    (e, _) => k(e),
                },
                if n(t, "peak_context_tokens") > 0 {
                    k(n(t, "peak_context_tokens"))
                } else {
                    "-".into()
                },
                t["ratio"]
                    .as_f64()
                    .map_or("-".into(), |r| format!("{r:.2}")),
                s(t, "implementer"),
                s(t, "reviewer"),
                s(t, "verdict"),
            ]
        })
        .collect();
    let mut width = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let mut text = String::from("\n");
    let line = |cells: Vec<String>, text: &mut String| {
        let l: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = width[i]))
            .collect();
        text.push_str(l.join("  ").trim_end());
        text.push('\n');
    };
    line(head.iter().map(|h| h.to_string()).collect(), &mut text);
    for r in &rows {
        line(r.to_vec(), &mut text);
    }
    text.push('\n');
    // Per sub-task: consecutive phases on one worker with the same need form one group.
    let mut blocks: Vec<(String, Vec<PhaseGroup>)> = Vec::new();
    for t in subs {
        let empty = Vec::new();
        let phases = t["phases"].as_array().unwrap_or(&empty);
        let mut groups: Vec<(Vec<String>, String, u64, u64)> = Vec::new();
        for p in phases {
            let (phase, worker, need, budget) = (
                s(p, "phase"),
                s(p, "worker"),
                n(p, "need_tokens"),
                n(p, "budget_tokens"),
            );
            match groups.last_mut() {
                Some(g) if g.1 == worker && g.2 == need => g.0.push(phase),
                _ => groups.push((vec![phase], worker, need, budget)),
            }
        }
        let lines = groups
            .into_iter()
            .map(|(phases, worker, need, budget)| {
                let why = if need > 0 {
                    format!(
                        "needs {}, holds {}: the smallest idle budget that does",
                        k(need),
                        k(budget)
                    )
                } else {
                    "unsized".into()
                };
                (phases.join(", "), worker, why)
            })
            .collect();
        blocks.push((s(t, "name"), lines));
    }
    let wp = blocks
        .iter()
        .flat_map(|b| b.1.iter().map(|l| l.0.chars().count()))
        .max()
        .unwrap_or(0);
    let ww = blocks
        .iter()
        .flat_map(|b| b.1.iter().map(|l| l.1.chars().count()))
        .max()
        .unwrap_or(0);
    for (name, lines) in blocks {
        text.push_str(&format!("{name}: who ran each phase, and why it fit\n"));
        for (phases, worker, why) in lines {
            text.push_str(&format!("  {phases:<wp$}  {worker:<ww$}  {why}\n"));
        }
    }
    let ratio = v["sizing_ratio"].as_f64().unwrap_or(0.0);
    if ratio > 0.0 {
        text.push_str(&format!(
            "\nLearned sizing ratio (reported peak / sized, bounded 0.5–2): {ratio:.2}; it scaled the estimates of sub-tasks not yet dispatched.\n"
        ));
    }
    let p = &v["parent"];
    let state = s(p, "state");
    text.push_str(&format!(
        "\n{}: {}{}  ({:.1} s)\n",
        PARENT,
        out.paint(
            if state.parse::<Phase>() == Ok(Phase::Complete) {
                "1;32"
            } else {
                "1;31"
            },
            &state
        ),
        match s(p, "why").as_str() {
            "" | "-" => String::new(),
            w => format!(" — {w}"),
        },
        n(v, "elapsed_ms") as f64 / 1000.0
    ));
    if let Some(summary) = p["verdicts"]["summary"].as_str() {
        text.push_str(&format!("Sub-task verdicts: {summary}\n"));
    }
    match p["attention"].as_str() {
        Some(line) if !line.is_empty() => text.push_str(&format!("{line}\n")),
        _ => {}
    }
    let d = &p["delivery"];
    if d.is_object() {
        let line = if s(d, "state").parse() == Ok(automaton_workflow::DeliveryState::Merged) {
            format!(
                "Delivered: {} merged into {} at {} ({})",
                s(d, "branch"),
                s(d, "base"),
                s(d, "commit"),
                s(d, "how")
            )
        } else {
            format!(
                "Delivery: {} ({})",
                s(d, "state"),
                [s(d, "waiting"), s(d, "failure")]
                    .into_iter()
                    .find(|w| !w.is_empty() && w != "-")
                    .unwrap_or_default()
            )
        };
        text.push_str(&format!("{line}\n"));
    }
    text
}
