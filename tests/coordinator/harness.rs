//! Starts the real `automaton-coordinator` binary on a throw-away project, talks to it over
//! real gRPC, and runs the real `automaton` CLI against the same project.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use automaton_proto::prost_types;
use automaton_proto::v1 as pb;
use pb::events_client::EventsClient;
use pb::leases_client::LeasesClient;
use pb::tasks_client::TasksClient;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

pub const COORDINATOR: &str = env!("CARGO_BIN_EXE_automaton-coordinator");

/// How long a coordinator may take to print its `listening on` line.
const START_TIMEOUT: Duration = Duration::from_secs(20);

pub const OPERATOR_TOKEN: &str = "operator-secret-0123456789";
pub const AGENT_TOKEN: &str = "agent-secret-0123456789ab";
/// A second agent's token (`agent-b`).
pub const AGENT_B_TOKEN: &str = "agent-b-secret-0123456789";

/// One operator (`ops`) and two agent tokens, each bound to its agent (`agent-a`, `agent-b`).
pub const TOKENS_TOML: &str = r#"
[[tokens]]
name = "ops"
role = "operator"
token = "operator-secret-0123456789"

[[tokens]]
name = "agent-a"
role = "agent"
token = "agent-secret-0123456789ab"

[[tokens]]
name = "agent-b"
role = "agent"
token = "agent-b-secret-0123456789"

[[tokens]]
name = "gpu-a"
role = "worker"
token = "worker-a-secret-0123456789"

[[tokens]]
name = "gpu-b"
role = "worker"
token = "worker-b-secret-0123456789"
"#;

/// Worker tokens, bound to `gpu-a` and `gpu-b`.
pub const WORKER_A_TOKEN: &str = "worker-a-secret-0123456789";
pub const WORKER_B_TOKEN: &str = "worker-b-secret-0123456789";
/// A third worker's token, bound to `gpu-c` (in [`tokens_with_gpu_c`] only).
pub const WORKER_C_TOKEN: &str = "worker-c-secret-0123456789";

/// [`TOKENS_TOML`] and a third worker, `gpu-c`.
pub fn tokens_with_gpu_c() -> String {
    format!(
        "{TOKENS_TOML}\n[[tokens]]\nname = \"gpu-c\"\nrole = \"worker\"\ntoken = \"{WORKER_C_TOKEN}\"\n"
    )
}

/// Environment variables that would make a child depend on the machine running the tests.
pub const SCRUBBED_ENV: &[&str] = &[
    "AUTOMATON_COORDINATOR",
    "AUTOMATON_TOKEN",
    "AUTOMATON_CONFIG",
    "AUTOMATON_PROJECT",
    "AUTOMATON_LISTEN",
    "AUTOMATON_INSECURE",
    "AUTOMATON_GRACE_PERIOD",
    "AUTOMATON_RPC_TIMEOUT",
    "AUTOMATON_MAX_IN_FLIGHT",
    "AUTOMATON_MAX_MESSAGE_BYTES",
    "AUTOMATON_TLS_CERT",
    "AUTOMATON_TLS_KEY",
    "AUTOMATON_TRACE_URL",
    "AUTOMATON_STORE",
    "AUTOMATON_ETCD",
    "AUTOMATON_ETCD_NAME",
    "AUTOMATON_ADVERTISE",
    "AUTOMATON_WEB_MAX_STREAMS",
    "AUTOMATON_WEB_STALL_TIMEOUT",
    "AUTOMATON_WEB_LISTEN",
    "AUTOMATON_OPERATOR_TOKEN",
    "AUTOMATON_AGENT_TOKEN",
    "AUTOMATON_WORKER_TOKEN",
    "AUTOMATON_TOKEN_FILE",
    "AUTOMATON_POOL_SECRET_FILE",
    "AUTOMATON_SESSION_TIMEOUT",
    "AUTOMATON_HEARTBEAT_INTERVAL",
    "AUTOMATON_CALL_TIMEOUT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// The `automaton` CLI binary, built next to the coordinator by `cargo test --workspace`.
pub fn cli_bin() -> PathBuf {
    sibling_bin("automaton")
}

/// The `automaton-worker` binary, built next to the coordinator by `cargo test --workspace`.
pub fn worker_bin() -> PathBuf {
    sibling_bin("automaton-worker")
}

fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    let bin = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the `{name}` binary is missing at {}: run `cargo test --workspace` (or `cargo build --workspace`) first",
        bin.display()
    );
    bin
}

#[path = "../common/run.rs"]
mod run;
pub use run::Run;

/// A project folder, a HOME folder and (optionally) a config file, removed on drop.
pub struct Env {
    pub project: tempfile::TempDir,
    pub home: tempfile::TempDir,
    pub config: Option<PathBuf>,
}

impl Env {
    pub fn new() -> Arc<Env> {
        Arc::new(Env::bare())
    }

    fn bare() -> Env {
        Env {
            project: tempfile::tempdir().expect("project tempdir"),
            home: tempfile::tempdir().expect("home tempdir"),
            config: None,
        }
    }

    /// A project whose coordinator reads `toml` as its config file (`--config`).
    pub fn with_config(toml: &str) -> Arc<Env> {
        let mut env = Env::bare();
        let path = env.home.path().join("coordinator.toml");
        std::fs::write(&path, toml).expect("write config");
        env.config = Some(path);
        Arc::new(env)
    }

    pub fn root(&self) -> &Path {
        self.project.path()
    }

    pub fn task_dir(&self, task: &str) -> PathBuf {
        let mut p = self.root().join(".automaton/tasks");
        match task.split_once('/') {
            Some((parent, sub)) => p.extend([parent, "subtasks", sub]),
            None => p.push(task),
        }
        p
    }

    /// Writes an artifact (or any file) into a task folder.
    pub fn artifact(&self, task: &str, name: &str, content: &str) {
        std::fs::write(self.task_dir(task).join(name), content).expect("write artifact");
    }

    /// A file of a task folder, `None` when absent.
    pub fn task_file(&self, task: &str, name: &str) -> Option<Vec<u8>> {
        std::fs::read(self.task_dir(task).join(name)).ok()
    }

    /// `automaton-coordinator --project ROOT [--listen 127.0.0.1:0] [--config FILE] ARGS`,
    /// with HOME isolated and no `AUTOMATON_*` variable inherited.
    pub fn coordinator_command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(COORDINATOR);
        c.arg("--project").arg(self.root());
        if !args.contains(&"--listen") {
            c.args(["--listen", "127.0.0.1:0"]);
        }
        if let Some(cfg) = &self.config
            && !args.contains(&"--config")
        {
            c.arg("--config").arg(cfg);
        }
        c.args(args);
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        c.env("HOME", self.home.path())
            .env("RUST_LOG", "info")
            .current_dir(self.root());
        c
    }

    /// Runs the coordinator to completion (for refusals and `--print-config`), killing it if
    /// it has not exited within `timeout`.
    pub fn run_coordinator(&self, args: &[&str], envs: &[(&str, &str)], timeout: Duration) -> Run {
        let mut c = self.coordinator_command(args);
        c.envs(envs.iter().copied());
        run_bounded(c, timeout)
    }

    /// A `Command` for `automaton status ARGS --project ROOT`, with HOME isolated.
    pub fn cli_command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(cli_bin());
        c.arg("status").args(args).arg("--project").arg(self.root());
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        c.env("HOME", self.home.path()).current_dir(self.root());
        c
    }

    /// Runs `automaton status ARGS --project ROOT`.
    pub fn cli(&self, args: &[&str]) -> Run {
        run_bounded(self.cli_command(args), Duration::from_secs(60))
    }

    /// Runs `automaton status ARGS --project ROOT` with extra environment variables.
    pub fn cli_env(&self, args: &[&str], envs: &[(&str, &str)]) -> Run {
        let mut c = self.cli_command(args);
        c.envs(envs.iter().copied());
        run_bounded(c, Duration::from_secs(60))
    }

    /// Every file under the project (path → bytes), except the coordinator's own bookkeeping
    /// (`.automaton/leases.wal`, `.automaton/coordinator.lock`, `.automaton/tmp/`,
    /// `.automaton/fencing`): compared before and after a refused call to prove nothing
    /// changed.
    pub fn snapshot(&self) -> BTreeMap<PathBuf, Vec<u8>> {
        let skip: Vec<PathBuf> = [
            ".automaton/leases.wal",
            ".automaton/coordinator.lock",
            ".automaton/tmp",
            ".automaton/fencing",
        ]
        .iter()
        .map(PathBuf::from)
        .collect();
        fn walk(dir: &Path, base: &Path, skip: &[PathBuf], out: &mut BTreeMap<PathBuf, Vec<u8>>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let p = e.path();
                let rel = p.strip_prefix(base).expect("under base").to_path_buf();
                if skip.iter().any(|s| rel.starts_with(s)) {
                    continue;
                }
                if p.is_dir() {
                    out.insert(rel.join(""), Vec::new());
                    walk(&p, base, skip, out);
                } else if let Ok(bytes) = std::fs::read(&p) {
                    out.insert(rel, bytes);
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(self.root(), self.root(), &skip, &mut out);
        out
    }

    /// Every task name under `.automaton/tasks` (sub-tasks as `parent/sub`).
    pub fn task_names(&self) -> Vec<String> {
        let mut out = Vec::new();
        let tasks = self.root().join(".automaton/tasks");
        let Ok(entries) = std::fs::read_dir(&tasks) else {
            return out;
        };
        for e in entries.flatten() {
            if !e.path().is_dir() {
                continue;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            if let Ok(subs) = std::fs::read_dir(e.path().join("subtasks")) {
                for s in subs.flatten() {
                    out.push(format!("{name}/{}", s.file_name().to_string_lossy()));
                }
            }
            out.push(name);
        }
        out.sort();
        out
    }
}

/// Runs `c` to completion with its output captured, killing it after `timeout`.
/// `automaton ARGS --coordinator URL` in `env`'s project, as an operator at a shell would.
pub fn cli_at(env: &Env, coord: &Coord, args: &[&str]) -> Run {
    let mut c = Command::new(cli_bin());
    c.args(args).args(["--coordinator", &coord.url]);
    for k in SCRUBBED_ENV {
        c.env_remove(k);
    }
    c.env("HOME", env.home.path()).current_dir(env.root());
    run_bounded(c, Duration::from_secs(30))
}

pub fn run_bounded(mut c: Command, timeout: Duration) -> Run {
    c.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn");
    let out = child.stdout.take().expect("stdout");
    let err = child.stderr.take().expect("stderr");
    let read = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            s
        })
    };
    let (out, err) = (read(Box::new(out)), read(Box::new(err)));
    let status = wait_bounded(&mut child, timeout).unwrap_or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{c:?} did not finish within {timeout:?}");
    });
    Run::from(std::process::Output {
        status,
        stdout: out.join().expect("stdout reader"),
        stderr: err.join().expect("stderr reader"),
    })
}

/// Waits for `child` at most `timeout`.
pub fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A running coordinator. Killed (SIGKILL) on drop.
pub struct Coord {
    pub env: Arc<Env>,
    /// Where to connect: `127.0.0.1:PORT` (also when it listens on `0.0.0.0`).
    pub addr: SocketAddr,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The address exactly as printed on the `listening on` line.
    pub printed: String,
    /// The console's URL (`--web-listen`), from its `console on URL` line.
    pub console: Option<String>,
    pub child: Child,
    stderr: Arc<Mutex<String>>,
    /// When the `listening on` line was read.
    pub started: Instant,
}

impl Coord {
    /// Starts the coordinator on `env`'s project and waits for its `listening on` line.
    pub fn start(env: &Arc<Env>, args: &[&str]) -> Coord {
        Coord::start_with_env(env, args, &[])
    }

    /// [`Coord::start`] with extra environment variables (failpoints, say).
    pub fn start_with_env(env: &Arc<Env>, args: &[&str], envs: &[(&str, &str)]) -> Coord {
        let mut c = env.coordinator_command(args);
        c.envs(envs.iter().copied());
        c.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn automaton-coordinator");
        let stderr = Arc::new(Mutex::new(String::new()));
        {
            let err = child.stderr.take().expect("stderr");
            let sink = stderr.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(err);
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
        let (tx, rx) = mpsc::channel::<String>();
        {
            let out = child.stdout.take().expect("stdout");
            std::thread::spawn(move || {
                let mut lines = BufReader::new(out).lines();
                let mut sent = false;
                while let Some(Ok(l)) = lines.next() {
                    if !sent {
                        // The console's line (with `--web-listen`) comes first.
                        sent = !l.starts_with("console on ");
                        let _ = tx.send(l);
                    } else {
                        // The contract is one line; later lines are ignored (but drained).
                    }
                }
            });
        }
        let mut console = None;
        let line = loop {
            match rx.recv_timeout(START_TIMEOUT) {
                Ok(l) => match l.strip_prefix("console on ") {
                    Some(url) => console = Some(url.trim().to_string()),
                    None => break l,
                },
                Err(e) => {
                    let _ = child.kill();
                    let status = child.wait();
                    std::thread::sleep(Duration::from_millis(50));
                    panic!(
                        "automaton-coordinator {args:?} printed no `listening on` line ({e:?}, exit {status:?});\nstderr:\n{}",
                        stderr.lock().unwrap_or_else(|p| p.into_inner())
                    );
                }
            }
        };
        let printed = line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first stdout line must be `listening on ADDR`: {line:?}"))
            .trim()
            .to_string();
        let listen: SocketAddr = printed
            .parse()
            .unwrap_or_else(|_| panic!("unparsable address in {line:?}"));
        let addr = SocketAddr::from(([127, 0, 0, 1], listen.port()));
        Coord {
            env: env.clone(),
            addr,
            url: format!("http://{addr}"),
            printed,
            console,
            child,
            stderr,
            started: Instant::now(),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits (bounded) until stderr contains `needle`; returns whether it did.
    pub fn wait_stderr(&self, needle: &str, timeout: Duration) -> bool {
        wait_until(timeout, || self.stderr().contains(needle))
    }

    /// Sends SIGTERM and waits (bounded) for the exit.
    pub fn terminate(&mut self) -> ExitStatus {
        signal(self.pid(), "-TERM");
        wait_bounded(&mut self.child, Duration::from_secs(20)).unwrap_or_else(|| {
            let _ = self.child.kill();
            panic!(
                "the coordinator did not exit within 20 s of SIGTERM;\nstderr:\n{}",
                self.stderr()
            )
        })
    }

    /// SIGKILL, at once, and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (which must exit 0), then a fresh coordinator on the same project.
    pub fn restart(&mut self, args: &[&str]) {
        let status = self.terminate();
        assert!(
            status.success(),
            "SIGTERM must exit 0, got {status:?};\nstderr:\n{}",
            self.stderr()
        );
        *self = Coord::start(&self.env, args);
    }

    /// SIGKILL, then a fresh coordinator on the same project.
    pub fn restart_after_kill(&mut self, args: &[&str]) {
        self.kill9();
        *self = Coord::start(&self.env, args);
    }

    pub async fn channel(&self) -> Channel {
        connect(&self.url).await
    }

    /// Clients without a token.
    pub async fn api(&self) -> Api {
        Api::new(self.channel().await, None)
    }

    /// Clients that send `authorization: Bearer TOKEN`.
    pub async fn api_as(&self, token: &str) -> Api {
        Api::new(self.channel().await, Some(token.to_string()))
    }
}

impl Drop for Coord {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `kill SIG PID`.
/// `ms` milliseconds as the wire carries a duration.
pub fn wire_ms(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// A wire duration in whole milliseconds (0 when unset).
pub fn ms(d: &Option<prost_types::Duration>) -> u64 {
    d.map_or(0, |d| {
        (d.seconds as u64) * 1000 + (d.nanos as u64) / 1_000_000
    })
}

pub fn signal(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .arg(sig)
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(st.success(), "kill {sig} {pid} failed");
}

pub async fn connect(url: &str) -> Channel {
    Channel::from_shared(url.to_string())
        .expect("url")
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"))
}

/// A request with `authorization: Bearer TOKEN`.
pub fn bearer<T>(msg: T, token: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert(
        "authorization",
        format!("Bearer {token}").parse().expect("header value"),
    );
    r
}

/// The three automaton clients on one channel, with an optional bearer token.
#[derive(Clone)]
pub struct Api {
    pub tasks: TasksClient<Channel>,
    pub leases: LeasesClient<Channel>,
    pub events: EventsClient<Channel>,
    pub workers: pb::workers_client::WorkersClient<Channel>,
    pub token: Option<String>,
}

type R<T> = Result<T, Status>;

impl Api {
    pub fn new(ch: Channel, token: Option<String>) -> Api {
        Api {
            tasks: TasksClient::new(ch.clone()),
            leases: LeasesClient::new(ch.clone()),
            events: EventsClient::new(ch.clone()),
            workers: pb::workers_client::WorkersClient::new(ch),
            token,
        }
    }

    pub fn req<T>(&self, msg: T) -> Request<T> {
        match &self.token {
            Some(t) => bearer(msg, t),
            None => Request::new(msg),
        }
    }

    pub async fn create(&mut self, task: &str) -> R<pb::TaskSummary> {
        let r = self.req(pb::CreateTaskRequest { task: task.into() });
        self.tasks.create_task(r).await.map(|r| r.into_inner())
    }

    pub async fn get(&mut self, task: &str) -> R<pb::TaskDetail> {
        let r = self.req(pb::GetTaskRequest {
            task: task.into(),
            ..Default::default()
        });
        self.tasks.get_task(r).await.map(|r| r.into_inner())
    }

    pub async fn list(&mut self) -> R<pb::ListTasksResponse> {
        let r = self.req(pb::ListTasksRequest {});
        self.tasks.list_tasks(r).await.map(|r| r.into_inner())
    }

    /// The task's `.state` as the coordinator reports it.
    pub async fn state(&mut self, task: &str) -> String {
        self.get(task)
            .await
            .unwrap_or_else(|s| panic!("GetTask {task}: {s:?}"))
            .summary
            .expect("summary")
            .state
    }

    /// The task's live lease as GetTask reports it.
    pub async fn lease_of(&mut self, task: &str) -> Option<pb::Lease> {
        self.get(task)
            .await
            .unwrap_or_else(|s| panic!("GetTask {task}: {s:?}"))
            .lease
    }

    /// A transition without a lease.
    pub async fn transition(&mut self, task: &str, target: &str) -> R<pb::TransitionResponse> {
        let r = self.req(pb::TransitionRequest {
            task: task.into(),
            target: target.into(),
            ..Default::default()
        });
        self.tasks.transition(r).await.map(|r| r.into_inner())
    }

    /// A transition presenting `agent`, `lease_id` and `token`.
    pub async fn transition_as(
        &mut self,
        task: &str,
        target: &str,
        agent: &str,
        lease_id: &str,
        token: u64,
    ) -> R<pb::TransitionResponse> {
        let r = self.req(pb::TransitionRequest {
            task: task.into(),
            target: target.into(),
            agent: agent.into(),
            lease_id: lease_id.into(),
            token,
        });
        self.tasks.transition(r).await.map(|r| r.into_inner())
    }

    /// A transition under `lease` (its agent, id and token).
    pub async fn transition_under(
        &mut self,
        task: &str,
        target: &str,
        lease: &pb::Lease,
    ) -> R<pb::TransitionResponse> {
        self.transition_as(task, target, &lease.agent, &lease.lease_id, lease.token)
            .await
    }

    /// `automaton run TASK` (manual mode).
    pub async fn run_task(&mut self, task: &str) -> R<pb::RunTaskResponse> {
        let req = self.req(pb::RunTaskRequest { task: task.into() });
        self.workers.run_task(req).await.map(|r| r.into_inner())
    }

    pub async fn approve(&mut self, task: &str, approver: &str) -> R<pb::ApproveResponse> {
        self.approve_revision(task, approver, "").await
    }

    /// An approval naming the commit approved (`""`: none).
    pub async fn approve_revision(
        &mut self,
        task: &str,
        approver: &str,
        revision: &str,
    ) -> R<pb::ApproveResponse> {
        let r = self.req(pb::ApproveRequest {
            task: task.into(),
            approver: approver.into(),
            revision: revision.into(),
        });
        self.tasks.approve(r).await.map(|r| r.into_inner())
    }

    /// A claim for `ttl_ms` milliseconds; 0 leaves the TTL unset (the project's default).
    pub async fn claim(&mut self, task: &str, agent: &str, ttl_ms: u64) -> R<pb::Lease> {
        let r = self.req(pb::ClaimRequest {
            task: task.into(),
            agent: agent.into(),
            ttl: (ttl_ms != 0).then(|| wire_ms(ttl_ms)),
            ..Default::default()
        });
        self.leases.claim(r).await.map(|r| r.into_inner())
    }

    pub async fn renew(&mut self, lease_id: &str, token: u64) -> R<pb::Lease> {
        let r = self.req(pb::RenewRequest {
            lease_id: lease_id.into(),
            token,
        });
        self.leases.renew(r).await.map(|r| r.into_inner())
    }

    /// One KeepAlive request naming `ids` on a fresh stream: its first answer, or the
    /// status that ended the stream (5 s at most).
    pub async fn keep_alive_once(&mut self, ids: Vec<String>) -> R<Option<pb::KeepAliveResponse>> {
        let req = self.req(tokio_stream::iter(vec![pb::KeepAliveRequest {
            lease_ids: ids,
        }]));
        let mut stream = self.leases.keep_alive(req).await?.into_inner();
        tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("a KeepAlive answer within 5 s")
    }

    pub async fn release(&mut self, lease_id: &str, token: u64) -> R<pb::ReleaseResponse> {
        let r = self.req(pb::ReleaseRequest {
            lease_id: lease_id.into(),
            token,
            ..Default::default()
        });
        self.leases.release(r).await.map(|r| r.into_inner())
    }

    /// Creates `task` and moves it to `research`, where it can be claimed.
    pub async fn claimable_task(&mut self, task: &str) {
        self.create(task)
            .await
            .unwrap_or_else(|s| panic!("CreateTask {task}: {s:?}"));
        self.transition(task, "research")
            .await
            .unwrap_or_else(|s| panic!("Transition {task} research: {s:?}"));
    }

    /// Creates `task` and drives it to `research:awaiting_approval` (writing SPEC.md),
    /// approves it (as the caller), and moves it on to `next` when given.
    pub async fn approved_research(&mut self, env: &Env, task: &str, next: Option<&str>) {
        self.claimable_task(task).await;
        env.artifact(task, "SPEC.md", "# Spec\nwhat to build\n");
        self.transition(task, "research:awaiting_approval")
            .await
            .unwrap_or_else(|s| panic!("Transition {task} research:awaiting_approval: {s:?}"));
        self.approve(task, "")
            .await
            .unwrap_or_else(|s| panic!("Approve {task}: {s:?}"));
        if let Some(n) = next {
            self.transition(task, n)
                .await
                .unwrap_or_else(|s| panic!("Transition {task} {n}: {s:?}"));
        }
    }
}

/// The services server reflection lists on channel `$ch`, asked in version `$v` (`v1` or
/// `v1alpha`: the same messages in two packages).
macro_rules! reflected_services {
    ($v:ident, $ch:expr) => {{
        use tonic_reflection::pb::$v::ServerReflectionRequest;
        use tonic_reflection::pb::$v::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$v::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$v::server_reflection_response::MessageResponse;
        let mut refl = ServerReflectionClient::new($ch);
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut stream = refl
            .server_reflection_info(tokio_stream::iter(vec![req]))
            .await
            .expect("reflection")
            .into_inner();
        let msg = tokio::time::timeout(std::time::Duration::from_secs(5), stream.message())
            .await
            .expect("reflection answers")
            .expect("ok")
            .expect("one response");
        let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
            panic!("not a ListServicesResponse: {msg:?}");
        };
        list.service
            .into_iter()
            .map(|s| s.name)
            .collect::<Vec<String>>()
    }};
}
pub(crate) use reflected_services;

/// Asserts that `r` failed with `code`, a message containing `contains`, and (when given)
/// the `automaton-error-kind` metadata `kind`. Returns the status.
#[track_caller]
pub fn expect_err<T: std::fmt::Debug>(
    r: Result<T, Status>,
    code: Code,
    contains: &str,
    kind: Option<&str>,
) -> Status {
    let s = match r {
        Ok(v) => panic!("expected {code:?} ({contains:?}), got Ok({v:?})"),
        Err(s) => s,
    };
    assert_eq!(s.code(), code, "wrong code: {s:?}");
    assert!(
        s.message().contains(contains),
        "message {:?} should contain {contains:?}",
        s.message()
    );
    assert!(
        !s.message().contains('\n'),
        "the message must be one line: {:?}",
        s.message()
    );
    if let Some(k) = kind {
        let got = s
            .metadata()
            .get("automaton-error-kind")
            .and_then(|v| v.to_str().ok());
        assert_eq!(got, Some(k), "automaton-error-kind of {s:?}");
    }
    s
}

/// A live `WatchEvents` subscription: every event is kept, and `expect` finds the first one
/// not yet taken that matches, waiting (bounded) for it to arrive.
pub struct Events {
    rx: tokio::sync::mpsc::UnboundedReceiver<pb::Event>,
    pub all: Vec<pb::Event>,
    taken: Vec<bool>,
}

impl Events {
    /// Subscribes; once this returns, every later change is delivered.
    pub async fn watch(api: &Api) -> Events {
        let mut client = api.events.clone();
        let mut stream = client
            .watch_events(api.req(pb::WatchEventsRequest {}))
            .await
            .expect("WatchEvents")
            .into_inner();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Ok(Some(e)) = stream.message().await {
                if tx.send(e).is_err() {
                    return;
                }
            }
        });
        Events {
            rx,
            all: Vec::new(),
            taken: Vec::new(),
        }
    }

    fn pull(&mut self) {
        while let Ok(e) = self.rx.try_recv() {
            self.all.push(e);
            self.taken.push(false);
        }
    }

    /// The first untaken event matching `pred`, waiting up to `timeout`.
    pub async fn find(
        &mut self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&pb::Event) -> bool,
    ) -> pb::Event {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            self.pull();
            if let Some(i) = (0..self.all.len()).find(|&i| !self.taken[i] && pred(&self.all[i])) {
                self.taken[i] = true;
                return self.all[i].clone();
            }
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(e)) => {
                    self.all.push(e);
                    self.taken.push(false);
                }
                Ok(None) => panic!("event stream ended before {what}; seen: {:#?}", self.all),
                Err(_) => panic!("no {what} within {timeout:?}; seen: {:#?}", self.all),
            }
        }
    }

    /// The first untaken event of `kind` on `task`.
    pub async fn expect(&mut self, kind: &str, task: &str) -> pb::Event {
        self.find(&format!("{kind} on {task}"), Duration::from_secs(5), |e| {
            e.kind == kind && e.task == task
        })
        .await
    }

    /// Waits `quiet` and returns every event received so far.
    pub async fn settle(&mut self, quiet: Duration) -> &[pb::Event] {
        tokio::time::sleep(quiet).await;
        self.pull();
        &self.all
    }
}

/// Checks `f` every 10 ms until it holds, at most `timeout`; whether it did. For waits on a
/// child's output, off the async runtime.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `f` every 20 ms until it returns `Some`, at most `timeout`.
pub async fn poll<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (bounded) until the task's `.state.lock` view shows the lease with `token`, or is
/// gone when `token` is `None`: the coordinator rewrites these views off the request path.
pub async fn lock_view(env: &Env, task: &str, token: Option<u64>) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let on_disk = env
            .task_file(task, ".state.lock")
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        let now = on_disk.as_deref().map(|t| {
            automaton_store::Lease::parse(t)
                .map(|l| l.token)
                .unwrap_or_else(|e| panic!("{task}: unreadable .state.lock ({e}): {t:?}"))
        });
        if now == token {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{task}: .state.lock still shows {on_disk:?}, want token {token:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A live process of this machine, as `/proc` shows it.
pub struct Process {
    pub pid: u32,
    /// Its command line, arguments joined by spaces.
    pub cmdline: String,
    /// `/proc/{pid}`.
    pub dir: PathBuf,
}

/// Every live process (zombies excluded): what tests look through for agents that outlived
/// their run.
pub fn live_processes() -> Vec<Process> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            if state.starts_with('Z') || state.is_empty() {
                return None;
            }
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            Some(Process {
                pid,
                cmdline: String::from_utf8_lossy(&cmd).replace('\0', " "),
                dir: e.path(),
            })
        })
        .collect()
}

/// A coordinator started with the config `toml` exits non-zero before it listens, with one
/// line on stderr that contains `says`.
pub fn refused_before_binding(toml: &str, says: &str) {
    let env = Env::with_config(toml);
    let run = env.run_coordinator(&[], &[], Duration::from_secs(20));
    assert_ne!(run.code, 0, "{toml}: {run:?}");
    assert!(run.stderr.contains(says), "{toml}: {}", run.stderr);
    assert!(!run.stdout.contains("listening"), "{toml}: {run:?}");
    assert_eq!(
        run.stderr.trim().lines().count(),
        1,
        "{toml}: {}",
        run.stderr
    );
}
