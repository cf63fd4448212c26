//! The agent's guard (`automaton_worker::guard`) across real processes: a real
//! `automaton-worker` takes an assignment from a fake coordinator (a gRPC server in this test
//! that grants a session, assigns one research phase and serves an empty workspace), runs a
//! real agent that starts children, and is killed with SIGKILL mid-run. Nothing of the agent
//! may outlive it.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use automaton_proto::prost_types;
use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as In;
use pb::worker_message::Msg as Out;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

type Stream_<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A coordinator that grants every session and assigns it the research phase of task `t`,
/// once per session; the workspace it serves holds nothing.
#[derive(Clone, Default)]
struct FakeCoordinator;

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap(),
        nanos: i32::try_from(d.subsec_nanos()).unwrap(),
    }
}

#[tonic::async_trait]
impl pb::workers_server::Workers for FakeCoordinator {
    type SessionStream = Stream_<pb::CoordinatorMessage>;
    type TailOutputStream = Stream_<pb::OutputEvent>;

    async fn tail_output(
        &self,
        _: Request<pb::TailOutputRequest>,
    ) -> Result<Response<Self::TailOutputStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn session(
        &self,
        request: Request<Streaming<pb::WorkerMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(async move {
            let send = |m: In| pb::CoordinatorMessage { msg: Some(m) };
            while let Some(Ok(m)) = inbound.next().await {
                let reply = match m.msg {
                    Some(Out::Register(_)) => vec![
                        send(In::Granted(pb::SessionGranted {
                            session_id: "s1".into(),
                            heartbeat_interval: Some(duration(Duration::from_millis(200))),
                            session_timeout: Some(duration(Duration::from_secs(60))),
                            name: "gpu-a".into(),
                            ..Default::default()
                        })),
                        send(In::Assign(pb::Assignment {
                            task: "t".into(),
                            phase: "research".into(),
                            lease: Some(pb::Lease {
                                task: "t".into(),
                                agent: "gpu-a".into(),
                                lease_id: "lease-1".into(),
                                token: 7,
                                state: "research".into(),
                                session_id: "s1".into(),
                                ..Default::default()
                            }),
                            artifact: "SPEC.md".into(),
                            max_phase_time: Some(duration(Duration::from_secs(600))),
                            attempt: 1,
                            ..Default::default()
                        })),
                    ],
                    Some(Out::Heartbeat(h)) => {
                        vec![send(In::Ack(pb::HeartbeatAck { seq: h.seq }))]
                    }
                    _ => vec![],
                };
                for r in reply {
                    if tx.send(Ok(r)).await.is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn list_workers(
        &self,
        _: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn drain_worker(
        &self,
        _: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn stop_run(
        &self,
        _: Request<pb::StopRunRequest>,
    ) -> Result<Response<pb::StopRunResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn run_task(
        &self,
        _: Request<pb::RunTaskRequest>,
    ) -> Result<Response<pb::RunTaskResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn deliver(
        &self,
        _: Request<pb::DeliverRequest>,
    ) -> Result<Response<pb::Delivery>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn abandon(
        &self,
        _: Request<pb::AbandonRequest>,
    ) -> Result<Response<pb::Delivery>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn collect_branches(
        &self,
        _: Request<pb::CollectBranchesRequest>,
    ) -> Result<Response<pb::CollectBranchesResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

#[tonic::async_trait]
impl pb::work_server::Work for FakeCoordinator {
    type FetchWorkspaceStream = Stream_<pb::WorkspaceChunk>;

    async fn stream_output(
        &self,
        _: Request<Streaming<pb::OutputChunk>>,
    ) -> Result<Response<pb::StreamOutputResponse>, Status> {
        Err(Status::unimplemented("not in this test"))
    }

    async fn fetch_workspace(
        &self,
        _: Request<pb::FetchWorkspaceRequest>,
    ) -> Result<Response<Self::FetchWorkspaceStream>, Status> {
        let manifest = pb::WorkspaceChunk {
            part: Some(pb::workspace_chunk::Part::Manifest(pb::WorkspaceManifest {
                task: "t".into(),
                phase: "research".into(),
                branch: "automaton/t".into(),
                ..Default::default()
            })),
        };
        Ok(Response::new(Box::pin(tokio_stream::iter([Ok(manifest)]))))
    }

    async fn upload_artifact(
        &self,
        _: Request<Streaming<pb::ArtifactChunk>>,
    ) -> Result<Response<pb::UploadResult>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn upload_patch(
        &self,
        _: Request<Streaming<pb::PatchChunk>>,
    ) -> Result<Response<pb::PatchResult>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn complete_phase(
        &self,
        _: Request<pb::CompletePhaseRequest>,
    ) -> Result<Response<pb::CompletePhaseResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// Serves the fake coordinator on 127.0.0.1:0 for the rest of the test; returns its URL.
async fn fake_coordinator() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::workers_server::WorkersServer::new(FakeCoordinator))
            .add_service(pb::work_server::WorkServer::new(FakeCoordinator))
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    url
}

/// Alive and not a zombie: a zombie is dead, only not yet reaped by its new parent.
fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => {
            let state = stat.rsplit(')').next().unwrap_or("").trim_start();
            !state.starts_with('Z') && !state.starts_with('X')
        }
        Err(_) => false,
    }
}

fn pids(file: &Path) -> Vec<i32> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// A worker process, SIGKILLed on drop (a failing test leaves nothing running).
struct Worker(Child);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// SIGKILLs `pids`: what a failing test must not leave running.
fn kill_all(pids: &[i32]) {
    for p in pids {
        let _ = Command::new("kill")
            .args(["-KILL", &p.to_string()])
            .status();
    }
}

/// A worker (the binary `exe`) with `agent` as its agent command, talking to `coordinator`;
/// its stderr goes to `dir/worker.log`.
fn start_worker(exe: &Path, coordinator: &str, agent: &str, dir: &Path) -> Worker {
    let log = std::fs::File::create(dir.join("worker.log")).unwrap();
    Command::new(exe)
        .args(["--coordinator", coordinator, "--name", "gpu-a"])
        .args(["--simulate-gpu", "sim:24GiB", "--kill-grace", "300ms"])
        .args(["--agent", agent])
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--cache-dir")
        .arg(dir.join("cache"))
        .env("HOME", dir)
        .env_remove("AUTOMATON_TOKEN")
        .env_remove("AUTOMATON_COORDINATOR")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map(Worker)
        .unwrap()
}

fn quoted(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

/// Starts a worker (from a copy of the binary, deleted once it runs, when `delete_binary`),
/// waits for its agent and the agent's children, SIGKILLs the worker, and asserts that all
/// of them are gone after the grace.
async fn kill_the_worker_mid_run(delete_binary: bool) {
    let dir = tempfile::tempdir().unwrap();
    let file: PathBuf = dir.path().join("pids");
    let f = quoted(&file);
    // A background child, the agent's guard ($PPID) and the agent, which (like a grandchild)
    // ignores SIGTERM: only the guard's SIGKILL after the grace ends them.
    let agent = format!(
        "trap '' TERM; sleep 300 & echo $! >> {f}; (exec sleep 301) & echo $! >> {f}; \
         echo $PPID >> {f}; echo $$ >> {f}; wait"
    );
    let coordinator = fake_coordinator().await;
    let mut exe = PathBuf::from(env!("CARGO_BIN_EXE_automaton-worker"));
    if delete_binary {
        let copy = dir.path().join("automaton-worker");
        std::fs::copy(&exe, &copy).unwrap();
        exe = copy;
    }
    let mut worker = start_worker(&exe, &coordinator, &agent, dir.path());
    if delete_binary {
        // What an upgrade that replaces the file does to the running worker's binary: the
        // worker has only just started, long before it is assigned work.
        std::fs::remove_file(&exe).unwrap();
    }
    let worker_log = || std::fs::read_to_string(dir.path().join("worker.log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(20);
    let started = loop {
        let p = pids(&file);
        if p.len() == 4 {
            break p;
        }
        if Instant::now() >= deadline {
            kill_all(&p);
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not start: {p:?}; worker:\n{}",
            worker_log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    if let Some(p) = started.iter().find(|&&p| !alive(p)) {
        kill_all(&started);
        panic!("{p} of {started:?} is not running before the kill");
    }
    let guard =
        std::fs::read_to_string(format!("/proc/{}/cmdline", started[2])).unwrap_or_default();
    if !guard.contains("agent-guard") {
        kill_all(&started);
        panic!("the agent's parent is not its guard: {guard}");
    }
    // A SIGKILL: the worker runs no handler, stops nothing itself.
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let killed = Instant::now();
    // The grace (300 ms) and a margin.
    while started.iter().any(|&p| alive(p)) && killed.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left: Vec<i32> = started.iter().copied().filter(|&p| alive(p)).collect();
    kill_all(&left);
    assert!(
        left.is_empty(),
        "{left:?} of {started:?} outlived the worker by {:?}; worker:\n{}",
        killed.elapsed(),
        worker_log()
    );
    // They ignored the SIGTERM: the SIGKILL came after the grace.
    assert!(
        killed.elapsed() >= Duration::from_millis(200),
        "{:?}",
        killed.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_and_its_children_die_when_the_worker_is_killed_with_sigkill() {
    kill_the_worker_mid_run(false).await;
}

/// The guard runs `/proc/self/exe`: a worker whose binary was deleted (an upgrade in place)
/// still starts, and guards, its agents.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_binary_was_deleted_still_starts_and_guards_its_agents() {
    kill_the_worker_mid_run(true).await;
}
