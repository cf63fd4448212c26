//! Issue 10: workers join the fleet. The real `automaton-worker` binary (simulated GPUs)
//! holds a session with the real coordinator; leases claimed in its session end when it dies.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use pb::workers_client::WorkersClient;
use tonic::Code;

use crate::harness::*;

/// Session timeout and heartbeat used by these tests (short, so they run fast).
const TIMEOUT: &str = "1s";
const HEARTBEAT: &str = "200ms";
const TIMEOUT_D: Duration = Duration::from_secs(1);

/// Sessions only: these tests claim in the workers' sessions themselves (`work.rs` tests
/// dispatch).
fn fleet_args() -> Vec<&'static str> {
    vec![
        "--session-timeout",
        TIMEOUT,
        "--heartbeat-interval",
        HEARTBEAT,
        "--no-dispatch",
    ]
}

/// A running `automaton-worker`.
pub struct Worker {
    pub child: Child,
    /// Its HOME (the probe's cache, the code cache, the workspaces): never the real one.
    _home: tempfile::TempDir,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

fn pump(r: impl std::io::Read + Send + 'static, sink: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(r);
        let mut line = String::new();
        while let Ok(n) = r.read_line(&mut line) {
            if n == 0 {
                break;
            }
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_str(&line);
            line.clear();
        }
    });
}

impl Worker {
    /// Starts a worker against `url` with `args` and waits until it has joined.
    pub fn start(url: &str, args: &[&str], envs: &[(&str, &str)]) -> Worker {
        let w = Worker::spawn(url, args, envs);
        assert!(
            w.wait_stdout("joined ", Duration::from_secs(20)),
            "the worker did not join;\nstdout:\n{}\nstderr:\n{}",
            w.stdout(),
            w.stderr()
        );
        w
    }

    pub fn spawn(url: &str, args: &[&str], envs: &[(&str, &str)]) -> Worker {
        let home = tempfile::tempdir().expect("worker home");
        let mut c = Command::new(worker_bin());
        c.args(["--coordinator", url, "--max-backoff", "200ms"]);
        c.arg("--work-dir").arg(home.path().join("work"));
        c.args(args);
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        c.env("RUST_LOG", "info")
            .env("HOME", home.path())
            .envs(envs.iter().copied());
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn automaton-worker");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        pump(child.stdout.take().expect("stdout"), stdout.clone());
        pump(child.stderr.take().expect("stderr"), stderr.clone());
        Worker {
            child,
            _home: home,
            stdout,
            stderr,
        }
    }

    pub fn stdout(&self) -> String {
        self.stdout
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits (bounded) until stdout has `needle` at least `times` times.
    pub fn wait_stdout_n(&self, needle: &str, times: usize, timeout: Duration) -> bool {
        wait_until(timeout, || self.stdout().matches(needle).count() >= times)
    }

    pub fn wait_stdout(&self, needle: &str, timeout: Duration) -> bool {
        self.wait_stdout_n(needle, 1, timeout)
    }

    /// Waits (bounded) until stderr has `needle`: after an exit its last lines may still be
    /// on their way through the pipe.
    pub fn wait_stderr(&self, needle: &str, timeout: Duration) -> bool {
        wait_until(timeout, || self.stderr().contains(needle))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Where its workspaces are made (`--work-dir`).
    pub fn work_dir(&self) -> std::path::PathBuf {
        self._home.path().join("work")
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, and the exit (bounded).
    pub fn terminate(&mut self) -> ExitStatus {
        signal(self.pid(), "-TERM");
        wait_bounded(&mut self.child, Duration::from_secs(10)).unwrap_or_else(|| {
            let _ = self.child.kill();
            panic!(
                "the worker did not exit within 10 s of SIGTERM;\nstderr:\n{}",
                self.stderr()
            )
        })
    }

    /// Waits (bounded) for the exit of a worker that stops on its own.
    pub fn exit(&mut self, timeout: Duration) -> ExitStatus {
        wait_bounded(&mut self.child, timeout).unwrap_or_else(|| {
            let _ = self.child.kill();
            panic!("the worker did not exit;\nstderr:\n{}", self.stderr())
        })
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // A stopped process must be continued to die promptly. SIGTERM first: the worker
            // stops its agents' process groups and reports the runs (after a SIGKILL only
            // the agents' guards would, a grace later), then SIGKILL.
            let pid = self.pid().to_string();
            let _ = Command::new("kill").args(["-CONT", &pid]).status();
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            if wait_bounded(&mut self.child, Duration::from_secs(3)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

fn workers_client(api: &Api) -> WorkersClient<tonic::transport::Channel> {
    api.workers.clone()
}

async fn list(api: &Api) -> Vec<pb::WorkerInfo> {
    workers_client(api)
        .list_workers(api.req(pb::ListWorkersRequest {}))
        .await
        .expect("ListWorkers")
        .into_inner()
        .workers
}

async fn worker_named(api: &Api, name: &str) -> Option<pb::WorkerInfo> {
    list(api).await.into_iter().find(|w| w.name == name)
}

/// Claims `task` for worker `name` in its live session (as an operator, naming the session).
async fn claim_in_session(api: &mut Api, task: &str, name: &str) -> pb::Lease {
    let session = worker_named(api, name)
        .await
        .unwrap_or_else(|| panic!("{name} is not listed"))
        .session_id;
    assert!(!session.is_empty(), "operators see session ids");
    let r = api.req(pb::ClaimRequest {
        task: task.into(),
        session_id: session.clone(),
        ..Default::default()
    });
    let l = api
        .leases
        .claim(r)
        .await
        .unwrap_or_else(|s| panic!("claim {task} in {name}'s session: {s:?}"))
        .into_inner();
    assert_eq!(l.agent, name);
    assert_eq!(l.session_id, session);
    l
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_with_simulated_24_and_80_gib_join_and_the_larger_has_the_larger_budget() {
    let env = Env::new();
    let coord = Coord::start(&env, &fleet_args());
    let _a = Worker::start(
        &coord.url,
        &["--name", "gpu-a", "--simulate-gpu", "sim-a:24GiB"],
        &[],
    );
    let _b = Worker::start(
        &coord.url,
        &["--name", "gpu-b", "--simulate-gpu", "sim-b:80GiB"],
        &[],
    );
    let out = Command::new(cli_bin())
        .args(["workers", "--json", "--coordinator", &coord.url])
        .env("HOME", env.home.path())
        .env_remove("AUTOMATON_TOKEN")
        .output()
        .expect("run automaton workers");
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let ws = v.as_array().expect("an array of workers");
    assert_eq!(ws.len(), 2, "{v:#}");
    let budget = |name: &str| {
        let w = ws
            .iter()
            .find(|w| w["name"] == name)
            .unwrap_or_else(|| panic!("{name} missing: {v:#}"));
        assert_eq!(w["state"], "idle");
        assert_eq!(w["simulated"], true);
        assert_eq!(w["gpus"].as_array().map(Vec::len), Some(1));
        assert!(
            w["budget"]["source"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        );
        w["budget"]["max_peak_context_kb"]
            .as_u64()
            .expect("max_peak_context_kb")
    };
    let (a, b) = (budget("gpu-a"), budget("gpu-b"));
    assert!(
        a > 0 && b > a,
        "the 80 GiB worker must hold more than the 24 GiB one: {a} vs {b}"
    );
    let gib = |name: &str| {
        ws.iter().find(|w| w["name"] == name).expect("listed")["gpus"][0]["total_bytes"]
            .as_u64()
            .expect("total_bytes")
    };
    assert_eq!(gib("gpu-a"), 24 << 30);
    assert_eq!(gib("gpu-b"), 80 << 30);
    // The table names both, with their state.
    let out = Command::new(cli_bin())
        .args(["workers", "--coordinator", &coord.url])
        .env("HOME", env.home.path())
        .output()
        .expect("run automaton workers");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("gpu-a") && table.contains("gpu-b") && table.contains("idle"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_a_worker_holding_a_lease_ends_it_within_the_session_timeout_with_the_reason() {
    let env = Env::new();
    let coord = Coord::start(&env, &fleet_args());
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let mut w = Worker::start(
        &coord.url,
        &["--name", "gpu-a", "--simulate-gpu", "a:24GiB"],
        &[],
    );
    let lease = claim_in_session(&mut api, "t", "gpu-a").await;
    let listed = worker_named(&api, "gpu-a").await.expect("listed");
    assert_eq!(listed.leases.len(), 1);
    assert_eq!(listed.leases[0].task, "t");
    assert_eq!(listed.state, "busy");
    let mut events = Events::watch(&api).await;
    let killed = Instant::now();
    w.kill9();
    let ended = events
        .find("the lease's end", TIMEOUT_D * 4, |e| {
            e.kind == "lease_expired" && e.task == "t"
        })
        .await;
    let took = killed.elapsed();
    assert_eq!(ended.detail, "session_expired", "{ended:?}");
    assert_eq!(ended.token, lease.token);
    // Within the session timeout plus a margin (a heartbeat interval may have passed
    // before the kill; the sweep runs every 20 ms).
    assert!(
        took <= TIMEOUT_D + Duration::from_millis(700),
        "the lease ended {took:?} after kill -9 (session timeout {TIMEOUT_D:?})"
    );
    let lost = events
        .find("worker_lost", Duration::from_secs(2), |e| {
            e.kind == "worker_lost" && e.agent == "gpu-a"
        })
        .await;
    assert!(lost.detail.contains("session_expired"), "{lost:?}");
    // Claimable again, by anyone.
    let again = api
        .claim("t", "agent-x", 60_000)
        .await
        .expect("claimable again");
    assert!(again.token > lease.token);
    // Its calls under the old lease are refused.
    expect_err(
        api.renew(&lease.lease_id, lease.token).await,
        Code::NotFound,
        "No live lease",
        None,
    );
    assert_eq!(
        worker_named(&api, "gpu-a")
            .await
            .expect("still listed")
            .state,
        "lost"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_past_the_session_timeout_then_sigcont_its_leases_are_gone_refused_and_it_registers_again()
 {
    let env = Env::new();
    let coord = Coord::start(&env, &fleet_args());
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let w = Worker::start(
        &coord.url,
        &["--name", "gpu-a", "--simulate-gpu", "a:24GiB"],
        &[],
    );
    let first = worker_named(&api, "gpu-a")
        .await
        .expect("listed")
        .session_id;
    let lease = claim_in_session(&mut api, "t", "gpu-a").await;
    let mut events = Events::watch(&api).await;
    signal(w.pid(), "-STOP");
    let ended = events
        .find("the lease's end", TIMEOUT_D * 4, |e| {
            e.kind == "lease_expired" && e.task == "t"
        })
        .await;
    assert_eq!(ended.detail, "session_expired");
    signal(w.pid(), "-CONT");
    // It notices its session is gone and registers again, under a new session.
    assert!(
        w.wait_stdout_n("joined ", 2, Duration::from_secs(10)),
        "no second join;\nstdout:\n{}\nstderr:\n{}",
        w.stdout(),
        w.stderr()
    );
    let second = poll("a new session", Duration::from_secs(5), || async {
        worker_named(&api, "gpu-a")
            .await
            .filter(|w| w.state == "idle" && w.session_id != first)
            .map(|w| w.session_id)
    })
    .await;
    assert_ne!(first, second);
    // Its calls under the old lease are refused, and nothing of it came back.
    expect_err(
        api.renew(&lease.lease_id, lease.token).await,
        Code::NotFound,
        "No live lease",
        None,
    );
    assert!(api.lease_of("t").await.is_none());
    assert!(
        w.stderr().contains("lease lost") || w.stderr().contains("leases are gone"),
        "the worker must say its lease is gone:\n{}",
        w.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_kill_9_and_restart_the_worker_resumes_its_session_and_keeps_its_lease() {
    let env = Env::new();
    let mut args = fleet_args();
    args.extend(["--grace-period", "5s"]);
    let mut coord = Coord::start(&env, &args);
    let port = coord.addr.port().to_string();
    let listen = format!("127.0.0.1:{port}");
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let w = Worker::start(
        &coord.url,
        &["--name", "gpu-a", "--simulate-gpu", "a:24GiB"],
        &[],
    );
    let session = worker_named(&api, "gpu-a")
        .await
        .expect("listed")
        .session_id;
    let lease = claim_in_session(&mut api, "t", "gpu-a").await;
    coord.kill9();
    let mut restarted_args = args.clone();
    restarted_args.extend(["--listen", listen.as_str()]);
    let coord = Coord::start(&env, &restarted_args);
    let api = coord.api().await;
    // The worker resumes the same session; the lease is still its own, past the session
    // timeout and the grace period.
    poll("the session resumed", Duration::from_secs(10), || async {
        worker_named(&api, "gpu-a")
            .await
            .filter(|w| w.session_id == session && w.state == "busy")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let mut api = api;
    let held = api.lease_of("t").await.expect("the lease survived");
    assert_eq!(held.lease_id, lease.lease_id);
    assert_eq!(held.session_id, session);
    assert!(w.stderr().contains("session resumed"), "{}", w.stderr());
    assert_eq!(w.stdout().matches("joined ").count(), 1, "{}", w.stdout());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_the_worker_never_resumes_after_a_restart_ends_its_leases_after_the_grace() {
    let env = Env::new();
    let mut args = fleet_args();
    args.extend(["--grace-period", "1s"]);
    let mut coord = Coord::start(&env, &args);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let mut w = Worker::start(
        &coord.url,
        &["--name", "gpu-a", "--simulate-gpu", "a:24GiB"],
        &[],
    );
    let lease = claim_in_session(&mut api, "t", "gpu-a").await;
    w.kill9();
    coord.kill9();
    let coord = Coord::start(&env, &args);
    let mut api = coord.api().await;
    // Right after the start the lease is held for its session...
    assert_eq!(
        api.lease_of("t").await.map(|l| l.token),
        Some(lease.token),
        "the lease is kept for its worker to resume"
    );
    // ...which never comes back: it ends after the grace (1 s here; TTL was 30 min).
    poll("the lease ended", Duration::from_secs(5), || async {
        api.clone().lease_of("t").await.is_none().then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_worker_token_is_unauthenticated_and_claiming_as_another_name_is_permission_denied()
 {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &fleet_args());
    // The real worker with a wrong or missing token stops with the coordinator's reason.
    for token in [Some("not-a-real-token-000000"), None] {
        let mut args = vec!["--name", "gpu-a"];
        if let Some(t) = token {
            args.extend(["--token", t]);
        }
        let mut w = Worker::spawn(&coord.url, &args, &[]);
        let status = w.exit(Duration::from_secs(10));
        assert_eq!(status.code(), Some(2), "{}", w.stderr());
        assert!(
            w.stderr().contains("bearer token"),
            "the reason: {}",
            w.stderr()
        );
    }
    // Over the API: a session without a token.
    let api = coord.api().await;
    let mut c = workers_client(&api);
    let reg = pb::WorkerMessage {
        msg: Some(pb::worker_message::Msg::Register(pb::Register {
            name: "gpu-a".into(),
            ..Default::default()
        })),
    };
    expect_err(
        c.session(tokio_stream::iter(vec![reg.clone()])).await,
        Code::Unauthenticated,
        "bearer token",
        None,
    );
    // A worker token registering as another name.
    let mut bad = reg.clone();
    if let Some(pb::worker_message::Msg::Register(r)) = &mut bad.msg {
        r.name = "gpu-b".into();
    }
    expect_err(
        c.session(bearer(tokio_stream::iter(vec![bad]), WORKER_A_TOKEN))
            .await,
        Code::PermissionDenied,
        "bound to 'gpu-a'",
        None,
    );
    // With its own token it joins, and claims only as itself.
    let _w = Worker::start(&coord.url, &["--token", WORKER_A_TOKEN], &[]);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    ops.claimable_task("t").await;
    let mut as_a = coord.api_as(WORKER_A_TOKEN).await;
    expect_err(
        as_a.claim("t", "gpu-b", 60_000).await,
        Code::PermissionDenied,
        "may act only as itself",
        Some("refused"),
    );
    expect_err(
        as_a.claim("t", "agent-a", 60_000).await,
        Code::PermissionDenied,
        "may act only as itself",
        Some("refused"),
    );
    // Its own claim lands in its session.
    let l = as_a.claim("t", "", 60_000).await.expect("claims as itself");
    assert_eq!(l.agent, "gpu-a");
    assert!(!l.session_id.is_empty());
    // Another worker's token cannot claim in gpu-a's session.
    let mut as_b = coord.api_as(WORKER_B_TOKEN).await;
    ops.claimable_task("u").await;
    let r = as_b.req(pb::ClaimRequest {
        task: "u".into(),
        session_id: l.session_id.clone(),
        ..Default::default()
    });
    expect_err(
        as_b.leases.claim(r).await.map(|r| r.into_inner()),
        Code::PermissionDenied,
        "belongs to worker 'gpu-a'",
        None,
    );
    // A worker without a live session cannot claim at all.
    expect_err(
        as_b.claim("u", "", 60_000).await,
        Code::FailedPrecondition,
        "no live session",
        None,
    );
    // An agent token cannot open a session.
    let as_agent = coord.api_as(AGENT_TOKEN).await;
    let mut c = workers_client(&as_agent);
    expect_err(
        c.session(bearer(tokio_stream::iter(vec![reg]), AGENT_TOKEN))
            .await,
        Code::PermissionDenied,
        "needs a worker token",
        None,
    );
}

/// A worker pool: `pool-` names, one secret.
const POOL_SECRET: &str = "pool-secret-0123456789abcdef0123456789";

/// A coordinator with the listed tokens and the `pool-` pool, and a file holding the pool's
/// secret (with a trailing newline, as an editor leaves it).
fn pool_coordinator() -> (Arc<Env>, Coord, std::path::PathBuf) {
    let env = Env::with_config(&format!(
        "{TOKENS_TOML}\n[[worker_pools]]\nprefix = \"pool-\"\nsecret = \"{POOL_SECRET}\"\n"
    ));
    let coord = Coord::start(&env, &fleet_args());
    let secret_file = env.root().join("pool.secret");
    std::fs::write(&secret_file, format!("{POOL_SECRET}\n")).expect("secret file");
    (env, coord, secret_file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_workers_join_with_tokens_minted_from_the_pool_secret_bound_to_their_names() {
    use automaton_workflow::pool_token;
    let (env, coord, secret_file) = pool_coordinator();
    let secret_arg = secret_file.to_str().expect("utf-8 path");
    // The real worker mints its token from the file and joins under its name.
    let w = Worker::start(
        &coord.url,
        &["--name", "pool-a", "--pool-secret-file", secret_arg],
        &[],
    );
    let ops = coord.api_as(OPERATOR_TOKEN).await;
    assert!(
        worker_named(&ops, "pool-a").await.is_some(),
        "pool-a is listed"
    );
    // Bound to its name like a listed token: it claims as itself, in its session only.
    let mut as_a = coord
        .api_as(&pool_token::mint(POOL_SECRET.as_bytes(), "pool-a"))
        .await;
    let mut ops_api = coord.api_as(OPERATOR_TOKEN).await;
    ops_api.claimable_task("t").await;
    expect_err(
        as_a.claim("t", "pool-b", 60_000).await,
        Code::PermissionDenied,
        "may act only as itself",
        Some("refused"),
    );
    let l = as_a.claim("t", "", 60_000).await.expect("claims as itself");
    assert_eq!(l.agent, "pool-a");
    assert!(!l.session_id.is_empty(), "in its session");
    // Refused: a name outside the prefix (MAC right), another secret, a changed MAC, a MAC
    // for another name, the bare prefix.
    let good = pool_token::mint(POOL_SECRET.as_bytes(), "pool-a");
    let (_, mac) = pool_token::split(&good).expect("shape");
    let flipped = format!(
        "pool:pool-a:{}{}",
        if mac.starts_with('0') { "1" } else { "0" },
        &mac[1..]
    );
    for (why, token) in [
        (
            "outside the prefix",
            pool_token::mint(POOL_SECRET.as_bytes(), "gpu-a"),
        ),
        (
            "another secret",
            pool_token::mint(b"another-secret-0123456789abcdef0123", "pool-a"),
        ),
        ("a changed MAC", flipped),
        ("another name's MAC", format!("pool:pool-b:{mac}")),
        (
            "the bare prefix",
            pool_token::mint(POOL_SECRET.as_bytes(), "pool-"),
        ),
    ] {
        let mut api = coord.api_as(&token).await;
        let s = expect_err(
            api.claim("t", "", 60_000).await,
            Code::Unauthenticated,
            "pool token refused",
            None,
        );
        assert!(!s.message().contains(POOL_SECRET), "{why}: {s:?}");
    }
    // Refused, each with its reason, and the worker exits 2: a secret the coordinator does not
    // know; a short secret (before anything is sent); a folder, a FIFO (opened without
    // blocking: only a regular file is read) and a file over 4096 bytes (never read whole),
    // at once and in one line.
    let wrong = env.root().join("wrong.secret");
    std::fs::write(&wrong, "another-secret-0123456789abcdef0123").expect("write");
    let short = env.root().join("short.secret");
    std::fs::write(&short, "too-short").expect("write");
    let fifo = env.root().join("fifo.secret");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success(), "mkfifo: {made}");
    let big = env.root().join("big.secret");
    std::fs::write(&big, "s".repeat(5 * 1024)).expect("write");
    for (flag, file, reason) in [
        ("--pool-secret-file", wrong.as_path(), "pool token refused"),
        (
            "--pool-secret-file",
            short.as_path(),
            "shorter than 32 bytes",
        ),
        ("--pool-secret-file", env.root(), "is not a file"),
        ("--pool-secret-file", fifo.as_path(), "is not a file"),
        (
            "--pool-secret-file",
            big.as_path(),
            "holds more than 4096 bytes",
        ),
        ("--token-file", fifo.as_path(), "is not a file"),
        ("--token-file", big.as_path(), "holds more than 4096 bytes"),
    ] {
        let path = file.to_str().expect("utf-8");
        let started = Instant::now();
        let mut bad = Worker::spawn(&coord.url, &["--name", "pool-b", flag, path], &[]);
        let status = bad.exit(Duration::from_secs(10));
        let elapsed = started.elapsed();
        let found = bad.wait_stderr(reason, Duration::from_secs(5));
        let err = bad.stderr();
        assert_eq!(status.code(), Some(2), "{flag} {reason}: {err}");
        assert!(found, "{flag} {reason}: {err}");
        if reason != "pool token refused" {
            assert_eq!(err.lines().count(), 1, "{flag} {reason}: one line: {err}");
            assert!(
                elapsed < Duration::from_secs(5),
                "{flag} {reason}: not at once ({elapsed:?})"
            );
        }
    }
    drop(w);
}

/// Runs `automaton-worker ARGS` to its end, within 10 s: (exit code, stdout, stderr).
fn worker_output(args: &[&str], envs: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut c = Command::new(worker_bin());
    c.args(args);
    for k in SCRUBBED_ENV {
        c.env_remove(k);
    }
    let home = tempfile::tempdir().expect("worker home");
    let mut child = c
        .env("HOME", home.path())
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn automaton-worker");
    let stdout = Arc::new(Mutex::new(String::new()));
    let stderr = Arc::new(Mutex::new(String::new()));
    pump(child.stdout.take().expect("stdout"), stdout.clone());
    pump(child.stderr.take().expect("stderr"), stderr.clone());
    let read = |s: &Arc<Mutex<String>>| s.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let Some(status) = wait_bounded(&mut child, Duration::from_secs(10)) else {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "automaton-worker {args:?} did not exit within 10 s;\nstderr:\n{}",
            read(&stderr)
        );
    };
    // The pipes close with the process: wait (bounded) for the pumps to read them out.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Arc::strong_count(&stdout) + Arc::strong_count(&stderr) > 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    (status.code(), read(&stdout), read(&stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_workers_can_join_with_a_token_minted_beforehand_into_a_token_file() {
    use automaton_workflow::pool_token;
    let (env, coord, secret_file) = pool_coordinator();
    let secret_arg = secret_file.to_str().expect("utf-8 path");
    // `mint-token` prints the token alone, one line; the worker reads it from a file and
    // joins under the token's name, never holding the secret.
    let (code, out, err) = worker_output(
        &[
            "mint-token",
            "--pool-secret-file",
            secret_arg,
            "--name",
            "pool-c",
        ],
        &[],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(
        out,
        format!("{}\n", pool_token::mint(POOL_SECRET.as_bytes(), "pool-c"))
    );
    assert_eq!(err, "");
    let token_file = env.root().join("pool-c.token");
    std::fs::write(&token_file, &out).expect("token file");
    let token_arg = token_file.to_str().expect("utf-8 path");
    let w = Worker::start(&coord.url, &["--token-file", token_arg], &[]);
    let ops = coord.api_as(OPERATOR_TOKEN).await;
    assert!(
        worker_named(&ops, "pool-c").await.is_some(),
        "pool-c is listed"
    );
    drop(w);
    // AUTOMATON_TOKEN_FILE does the same.
    let w = Worker::start(
        &coord.url,
        &["--replace"],
        &[("AUTOMATON_TOKEN_FILE", token_arg)],
    );
    drop(w);
    // `mint-token` refuses a name that is not an agent id, in one line.
    let (code, out, err) = worker_output(
        &[
            "mint-token",
            "--pool-secret-file",
            secret_arg,
            "--name",
            "no such",
        ],
        &[],
    );
    assert_eq!(code, Some(2), "{err}");
    assert_eq!(out, "");
    assert!(
        err.contains("is not a worker name") && err.lines().count() == 1,
        "{err}"
    );
    // Two credentials at once: refused in one line naming both, whether flags or variables
    // (a pool secret file in the environment never silently beats --token).
    for (args, envs, a, b) in [
        (
            vec!["--token", "worker-token-0123456789"],
            vec![("AUTOMATON_POOL_SECRET_FILE", secret_arg)],
            "--token",
            "AUTOMATON_POOL_SECRET_FILE",
        ),
        (
            vec!["--token-file", token_arg],
            vec![("AUTOMATON_TOKEN", "worker-token-0123456789")],
            "AUTOMATON_TOKEN",
            "--token-file",
        ),
        (
            vec!["--token-file", token_arg, "--pool-secret-file", secret_arg],
            vec![],
            "--token-file",
            "--pool-secret-file",
        ),
    ] {
        let mut all = vec!["--coordinator", coord.url.as_str(), "--name", "pool-d"];
        all.extend(args);
        let (code, _, err) = worker_output(&all, &envs);
        assert_eq!(code, Some(2), "{a} {b}: {err}");
        assert!(
            err.contains(&format!("both {a} and {b} are given")) && err.lines().count() == 1,
            "{a} {b}: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_session_under_one_name_is_refused_with_the_first_host_and_age_unless_replace() {
    let env = Env::new();
    let coord = Coord::start(&env, &fleet_args());
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let first = Worker::start(&coord.url, &["--name", "gpu-a"], &[]);
    let lease = claim_in_session(&mut api, "t", "gpu-a").await;
    // Over the API: ALREADY_EXISTS naming the first's host and age.
    let host = worker_named(&api, "gpu-a").await.expect("listed").host;
    let mut c = workers_client(&api);
    let reg = pb::WorkerMessage {
        msg: Some(pb::worker_message::Msg::Register(pb::Register {
            name: "gpu-a".into(),
            host: "other-box".into(),
            ..Default::default()
        })),
    };
    let s = expect_err(
        c.session(tokio_stream::iter(vec![reg])).await,
        Code::AlreadyExists,
        "already has a live session",
        None,
    );
    assert!(
        s.message().contains(&format!("from host '{host}'")) && s.message().contains(" old"),
        "{s:?}"
    );
    // `--replace`: the first session ends (its lease with it), the second joins.
    let mut events = Events::watch(&api).await;
    let second = Worker::start(&coord.url, &["--name", "gpu-a", "--replace"], &[]);
    let ended = events.expect("lease_released", "t").await;
    assert_eq!(ended.detail, "session_replaced");
    expect_err(
        api.renew(&lease.lease_id, lease.token).await,
        Code::NotFound,
        "No live lease",
        None,
    );
    let _ = (first, second);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_deregisters_releases_its_leases_at_once_and_exits_0() {
    let env = Env::new();
    // A long session timeout: the release must come from the goodbye, not the expiry.
    let coord = Coord::start(&env, &["--session-timeout", "60s", "--no-dispatch"]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let mut w = Worker::start(&coord.url, &["--name", "gpu-a"], &[]);
    claim_in_session(&mut api, "t", "gpu-a").await;
    let mut events = Events::watch(&api).await;
    let status = w.terminate();
    assert!(status.success(), "exit {status:?}: {}", w.stderr());
    let ended = events.expect("lease_released", "t").await;
    assert_eq!(ended.detail, "released");
    events
        .find("worker_left", Duration::from_secs(2), |e| {
            e.kind == "worker_left" && e.agent == "gpu-a"
        })
        .await;
    assert!(
        worker_named(&api, "gpu-a").await.is_none(),
        "a worker that left is not listed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_stops_new_work_for_a_worker_is_an_event_and_undrain_undoes_it() {
    let env = Env::new();
    let coord = Coord::start(&env, &fleet_args());
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let w = Worker::start(&coord.url, &["--name", "gpu-a"], &[]);
    let mut events = Events::watch(&api).await;
    let run = |args: &[&str]| {
        let mut c = Command::new(cli_bin());
        c.args(["workers"])
            .args(args)
            .args(["--coordinator", &coord.url]);
        c.env("HOME", env.home.path()).env_remove("AUTOMATON_TOKEN");
        c.output().expect("run automaton workers")
    };
    let out = run(&["drain", "gpu-a"]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("draining"));
    events
        .find("worker_drained", Duration::from_secs(2), |e| {
            e.kind == "worker_drained" && e.agent == "gpu-a"
        })
        .await;
    assert!(
        w.wait_stdout("", Duration::from_millis(1))
            && poll_stderr(&w, "drained by an operator").await,
        "the worker is told: {}",
        w.stderr()
    );
    assert_eq!(
        worker_named(&api, "gpu-a").await.expect("listed").state,
        "draining"
    );
    let session = worker_named(&api, "gpu-a")
        .await
        .expect("listed")
        .session_id;
    let r = api.req(pb::ClaimRequest {
        task: "t".into(),
        session_id: session,
        ..Default::default()
    });
    expect_err(
        api.leases.claim(r).await.map(|r| r.into_inner()),
        Code::FailedPrecondition,
        "is draining",
        None,
    );
    // An unknown worker is an error with a clear line.
    let out = run(&["drain", "no-such-worker"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no worker named 'no-such-worker'"));
    let out = run(&["undrain", "gpu-a"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        worker_named(&api, "gpu-a").await.expect("listed").state,
        "idle"
    );
    claim_in_session(&mut api, "t", "gpu-a").await;
}

async fn poll_stderr(w: &Worker, needle: &str) -> bool {
    for _ in 0..200 {
        if w.stderr().contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_session_input_gets_clear_errors_and_never_a_session() {
    let env = Env::new();
    let coord = Coord::start(&env, &fleet_args());
    let api = coord.api().await;
    let mut c = workers_client(&api);
    let register = |r: pb::Register| pb::WorkerMessage {
        msg: Some(pb::worker_message::Msg::Register(r)),
    };
    let ok = || pb::Register {
        name: "gpu-z".into(),
        ..Default::default()
    };
    let cases: Vec<(pb::WorkerMessage, Code, &str)> = vec![
        (
            pb::WorkerMessage {
                msg: Some(pb::worker_message::Msg::Heartbeat(pb::Heartbeat { seq: 1 })),
            },
            Code::FailedPrecondition,
            "first message of a session must be a Register",
        ),
        (
            register(pb::Register::default()),
            Code::InvalidArgument,
            "must name the worker",
        ),
        (
            register(pb::Register {
                name: "Not A Name".into(),
                ..Default::default()
            }),
            Code::InvalidArgument,
            "worker name",
        ),
        (
            register(pb::Register {
                host: "h".repeat(1 << 20),
                ..ok()
            }),
            Code::InvalidArgument,
            "host",
        ),
        (
            register(pb::Register {
                capacity: u32::MAX,
                ..ok()
            }),
            Code::InvalidArgument,
            "capacity",
        ),
        (
            register(pb::Register {
                resume_session_id: "../../etc/passwd".into(),
                ..ok()
            }),
            Code::InvalidArgument,
            "not a session id",
        ),
        (
            register(pb::Register {
                gpus: vec![pb::Gpu {
                    total_bytes: 1,
                    free_bytes: u64::MAX,
                    ..Default::default()
                }],
                ..ok()
            }),
            Code::InvalidArgument,
            "more free memory",
        ),
        (
            register(pb::Register {
                budget: Some(pb::Budget {
                    headroom: f64::NAN,
                    ..Default::default()
                }),
                ..ok()
            }),
            Code::InvalidArgument,
            "headroom",
        ),
    ];
    for (msg, code, contains) in cases {
        expect_err(
            c.session(tokio_stream::iter(vec![msg])).await,
            code,
            contains,
            None,
        );
    }
    assert!(list(&api).await.is_empty(), "no session was opened");
    // A claim naming a session that is not one.
    let mut api = api;
    api.claimable_task("t").await;
    for (id, code) in [
        ("s-0000", Code::FailedPrecondition),
        (&"x".repeat(1 << 20)[..], Code::InvalidArgument),
    ] {
        let r = api.req(pb::ClaimRequest {
            task: "t".into(),
            session_id: id.to_string(),
            ..Default::default()
        });
        let s = api.leases.claim(r).await.expect_err("refused");
        assert_eq!(s.code(), code, "{s:?}");
        assert!(s.message().len() < 400, "one short line: {s:?}");
    }
    // The coordinator is still serving.
    assert!(list(&api).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_implementer_worker_never_claims_code_review_whatever_the_request_says() {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &fleet_args());
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    ops.approved_research(&env, "t", None).await;
    // design → implement, then gpu-a implements under its lease.
    for step in ["design"] {
        ops.transition("t", step).await.expect("to design");
    }
    env.artifact("t", "DESIGN.md", "# Design\n");
    ops.transition("t", "design:awaiting_approval")
        .await
        .expect("await");
    ops.approve("t", "").await.expect("approve design");
    ops.transition("t", "implement")
        .await
        .expect("to implement");
    let _a = Worker::start(&coord.url, &["--token", WORKER_A_TOKEN], &[]);
    let _b = Worker::start(&coord.url, &["--token", WORKER_B_TOKEN], &[]);
    let mut as_a = coord.api_as(WORKER_A_TOKEN).await;
    let l = as_a.claim("t", "", 60_000).await.expect("gpu-a implements");
    env.artifact("t", "IMPLEMENTATION.md", "# Done\n");
    as_a.transition_under("t", "code_review", &l)
        .await
        .expect("to code_review");
    expect_err(
        as_a.claim("t", "", 60_000).await,
        Code::FailedPrecondition,
        "gpu-a",
        Some("refused"),
    );
    let mut as_b = coord.api_as(WORKER_B_TOKEN).await;
    let review = as_b.claim("t", "", 60_000).await.expect("gpu-b reviews");
    assert_eq!(review.agent, "gpu-b");
}
