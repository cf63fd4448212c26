//! Issue 20: dispatch survives a coordinator restart. Holds (an operator's stop,
//! `max_attempts`), failure counts and run records live in each task's `.state.dispatch`;
//! the runs in flight are rebuilt from the workers when they resume their sessions. Real
//! coordinator (`kill -9`, restarted on the same port), real scripted workers; where a
//! worker must have lost a run's report (which the real one never does on purpose), a test
//! speaks the session protocol itself.

use std::process::Command;
use std::time::Duration;

use automaton_proto::v1 as pb;
use pb::worker_message::Msg as Out;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::harness::*;
use crate::work::{FLEET, git_init, scripted_worker};

/// Long enough for the workers to resume after a restart, short enough that a session never
/// resumed ends within the test.
const GRACE: &str = "5s";

fn args() -> Vec<&'static str> {
    let mut a = FLEET.to_vec();
    a.extend(["--grace-period", GRACE]);
    a
}

/// `kill -9`, then a fresh coordinator on the same project and port (the workers reconnect
/// to it).
fn kill_9_and_restart(coord: &mut Coord, args: &[&str], envs: &[(&str, &str)]) {
    let listen = format!("127.0.0.1:{}", coord.addr.port());
    coord.kill9();
    let mut a = args.to_vec();
    a.extend(["--listen", listen.as_str()]);
    *coord = Coord::start_with_env(&coord.env.clone(), &a, envs);
}

/// Why the task is held from dispatch ("" when it is not).
async fn held(api: &mut Api, task: &str) -> String {
    api.get(task)
        .await
        .ok()
        .and_then(|d| d.summary)
        .map(|s| s.held)
        .unwrap_or_default()
}

async fn runs(api: &mut Api, task: &str) -> Vec<pb::Run> {
    api.get(task).await.map(|d| d.runs).unwrap_or_default()
}

/// Waits until `task`'s `.state.dispatch` on disk mentions `what` (it is written a moment
/// after the change is seen over the API).
async fn on_disk(env: &Env, task: &str, what: &str) {
    poll(
        &format!("{task}/.state.dispatch mentions {what}"),
        Duration::from_secs(10),
        || async {
            env.task_file(task, ".state.dispatch")
                .filter(|b| String::from_utf8_lossy(b).contains(what))
                .map(|_| ())
        },
    )
    .await
}

/// Waits until worker `name` is attached again (resumed or joined) and idle or busy.
async fn worker_back(api: &Api, name: &str) {
    poll(&format!("{name} back"), Duration::from_secs(15), || {
        let mut c = api.workers.clone();
        let r = api.req(pb::ListWorkersRequest {});
        async move {
            let ws = c.list_workers(r).await.ok()?.into_inner().workers;
            ws.into_iter()
                .find(|w| w.name == name && (w.state == "idle" || w.state == "busy"))
                .map(|_| ())
        }
    })
    .await
}

/// Waits for `task` to reach `state`.
async fn reaches(api: &Api, task: &str, state: &str, within: Duration) {
    poll(&format!("{task} reaches {state}"), within, || {
        let mut api = api.clone();
        async move { (api.state(task).await == state).then_some(()) }
    })
    .await
}

/// The lease of the run that is active on `task`.
async fn active_run(api: &Api, task: &str) -> pb::Lease {
    poll(
        &format!("a run active on {task}"),
        Duration::from_secs(20),
        || {
            let mut api = api.clone();
            async move {
                let d = api.get(task).await.ok()?;
                let lease = d.lease?;
                d.runs
                    .iter()
                    .any(|r| r.state == "active" && r.token == lease.token)
                    .then_some(lease)
            }
        },
    )
    .await
}

fn cli_stop(env: &Env, coord: &Coord, task: &str, resume: bool) -> String {
    let mut c = Command::new(cli_bin());
    c.args(["stop", task, "--coordinator", &coord.url]);
    if resume {
        c.arg("--resume");
    }
    let out = c
        .env("HOME", env.home.path())
        .env_remove("AUTOMATON_TOKEN")
        .output()
        .expect("automaton stop");
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Issue 20 (2): "stop, kill -9, restart: still held; `--resume` after the restart resumes".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_survives_kill_9_and_resume_after_restart_resumes() {
    let env = Env::new();
    git_init(&env);
    let args = args();
    let mut coord = Coord::start(&env, &args);
    let mut api = coord.api().await;
    let _w = scripted_worker(
        &coord,
        "gpu-a",
        "sim:24GiB",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=1500")],
    );
    api.create("t").await.expect("create");
    active_run(&api, "t").await;
    let said = cli_stop(&env, &coord, "t", false);
    assert!(said.contains("gpu-a"), "{said}");
    assert!(held(&mut api, "t").await.contains("stopped by an operator"));
    // Durable before `stop` returned.
    let record = env.task_file("t", ".state.dispatch").expect("the record");
    assert!(
        String::from_utf8_lossy(&record).contains("stopped by an operator"),
        "{}",
        String::from_utf8_lossy(&record)
    );
    // The run's own end, written as it comes in.
    on_disk(&env, "t", "operator_stopped").await;

    kill_9_and_restart(&mut coord, &args, &[]);
    let mut api = coord.api().await;
    worker_back(&api, "gpu-a").await;
    // An idle worker, a task with work: still held, nothing offered.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        api.lease_of("t").await.is_none(),
        "offered after the restart"
    );
    let why = held(&mut api, "t").await;
    assert!(why.contains("stopped by an operator"), "held: {why:?}");
    let out = env.cli(&["--task", "t"]);
    assert!(
        out.stdout
            .contains("Held from dispatch: stopped by an operator"),
        "{}",
        out.stdout
    );
    // The stopped run is still listed, with its reason.
    assert!(
        runs(&mut api, "t")
            .await
            .iter()
            .any(|r| r.stop_reason == "operator_stopped"),
        "{:#?}",
        runs(&mut api, "t").await
    );

    cli_stop(&env, &coord, "t", true);
    assert_eq!(held(&mut api, "t").await, "");
    reaches(
        &api,
        "t",
        "research:awaiting_approval",
        Duration::from_secs(30),
    )
    .await;
    // And the resume is durable too.
    kill_9_and_restart(&mut coord, &args, &[]);
    let mut api = coord.api().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(held(&mut api, "t").await, "");
}

/// Issue 20 (2): a `max_attempts` hold and the failure count behind it survive `kill -9`.
/// Two failed runs hold the task: one before the kill, one after (a count that restarted
/// from zero would need two more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_attempts_hold_and_its_failure_count_survive_kill_9() {
    let env = Env::new();
    git_init(&env);
    let args = args();
    let envs = [("AUTOMATON_MAX_ATTEMPTS", "2")];
    let mut coord = Coord::start_with_env(&env, &args, &envs);
    let api = coord.api().await;
    // Each run fails after a while: the kill comes between the first failure and the second.
    let _w = scripted_worker(
        &coord,
        "gpu-a",
        "sim:24GiB",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "fail-after=2000")],
    );
    api.clone().create("t").await.expect("create");
    poll("the first failed run", Duration::from_secs(20), || {
        let mut api = api.clone();
        async move {
            runs(&mut api, "t")
                .await
                .iter()
                .any(|r| r.stop_reason == "agent_error")
                .then_some(())
        }
    })
    .await;
    on_disk(&env, "t", "agent_error").await;

    kill_9_and_restart(&mut coord, &args, &envs);
    let api = coord.api().await;
    let why = poll(
        "held after the second failed run",
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            async move {
                let h = held(&mut api, "t").await;
                (!h.is_empty()).then_some(h)
            }
        },
    )
    .await;
    assert!(why.contains("2 failed runs of research"), "held: {why:?}");
    // Two failed runs in all, the first from before the kill (the other may have failed
    // another way: a Work call cut off by the kill is an `agent_error`).
    let all = runs(&mut api.clone(), "t").await;
    let failed: Vec<&pb::Run> = all
        .iter()
        .filter(|r| {
            r.state == "stopped"
                && !["lease_lost", "operator_stopped", "shutdown", "run_lost"]
                    .contains(&r.stop_reason.as_str())
        })
        .collect();
    assert_eq!(failed.len(), 2, "{all:#?}");
    assert_eq!(failed[0].stop_reason, "agent_error", "{all:#?}");

    // Held across another kill, with a worker idle.
    kill_9_and_restart(&mut coord, &args, &envs);
    let mut api = coord.api().await;
    worker_back(&api, "gpu-a").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(api.lease_of("t").await.is_none(), "offered while held");
    assert_eq!(held(&mut api, "t").await, why);
    cli_stop(&env, &coord, "t", true);
    poll("offered again", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move { api.lease_of("t").await.map(|_| ()) }
    })
    .await;
}

/// Issue 20 (1): a worker mid-run when the coordinator is `kill -9`ed reports the run when it
/// resumes; the restarted coordinator adopts it: the lease is not ended, the run completes
/// under it, the task moves on, and the run is listed with its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_in_flight_at_kill_9_is_adopted_and_completes_under_its_lease() {
    let env = Env::new();
    git_init(&env);
    let args = args();
    let mut coord = Coord::start(&env, &args);
    let api = coord.api().await;
    let w = scripted_worker(
        &coord,
        "gpu-a",
        "sim:24GiB",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=2500")],
    );
    api.clone().create("t").await.expect("create");
    let lease = active_run(&api, "t").await;

    kill_9_and_restart(&mut coord, &args, &[]);
    let api = coord.api().await;
    reaches(
        &api,
        "t",
        "research:awaiting_approval",
        Duration::from_secs(30),
    )
    .await;
    // Its `stopped` follows the phase's completion.
    let all = poll("the run's stop", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move {
            let all = runs(&mut api, "t").await;
            all.iter()
                .any(|r| r.token == lease.token && r.state == "stopped")
                .then_some(all)
        }
    })
    .await;
    let run = all
        .iter()
        .find(|r| r.token == lease.token)
        .unwrap_or_else(|| panic!("the run is not listed: {all:#?}"));
    assert_eq!(run.state, "stopped", "{run:?}");
    assert_eq!(run.stop_reason, "completed", "{run:?}");
    assert!(run.why.starts_with("adopted"), "{run:?}");
    assert!(
        all.iter().all(|r| r.token == lease.token),
        "one run, under the lease granted before the kill: {all:#?}"
    );
    assert!(
        !w.stderr().contains("lease lost"),
        "the worker lost its lease:\n{}",
        w.stderr()
    );
    // `automaton workers` showed it while it ran; now the worker is idle again.
    worker_back(&api, "gpu-a").await;
}

/// A worker's session over the protocol itself: register (or resume), heartbeat, and read
/// what the coordinator sends.
pub(crate) struct Session {
    tx: mpsc::Sender<pb::WorkerMessage>,
    inbound: tonic::Streaming<pb::CoordinatorMessage>,
    granted: pb::SessionGranted,
    _beat: tokio::task::JoinHandle<()>,
}

impl Session {
    pub(crate) async fn open(url: &str, register: pb::Register) -> Session {
        let mut client = pb::workers_client::WorkersClient::new(connect(url).await);
        let (tx, rx) = mpsc::channel(64);
        tx.send(pb::WorkerMessage {
            msg: Some(Out::Register(register)),
        })
        .await
        .expect("queue the register");
        let mut inbound = client
            .session(ReceiverStream::new(rx))
            .await
            .expect("session")
            .into_inner();
        let granted = match inbound.next().await {
            Some(Ok(pb::CoordinatorMessage {
                msg: Some(pb::coordinator_message::Msg::Granted(g)),
            })) => g,
            other => panic!("no SessionGranted: {other:?}"),
        };
        let beat = {
            let tx = tx.clone();
            tokio::spawn(async move {
                for seq in 1.. {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let hb = pb::WorkerMessage {
                        msg: Some(Out::Heartbeat(pb::Heartbeat { seq })),
                    };
                    if tx.send(hb).await.is_err() {
                        return;
                    }
                }
            })
        };
        Session {
            tx,
            inbound,
            granted,
            _beat: beat,
        }
    }

    /// The next assignment (acks skipped).
    pub(crate) async fn assignment(&mut self) -> pb::Assignment {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let m = tokio::time::timeout_at(deadline, self.inbound.next())
                .await
                .expect("an assignment in time");
            match m {
                Some(Ok(pb::CoordinatorMessage {
                    msg: Some(pb::coordinator_message::Msg::Assign(a)),
                })) => return a,
                Some(Ok(_)) => {}
                other => panic!("the stream ended before an assignment: {other:?}"),
            }
        }
    }

    pub(crate) async fn send(&self, m: Out) {
        self.tx
            .send(pb::WorkerMessage { msg: Some(m) })
            .await
            .expect("send on the session");
    }
}

pub(crate) fn register(name: &str) -> pb::Register {
    pb::Register {
        name: name.into(),
        host: "test".into(),
        capacity: 1,
        simulated: true,
        version: "test".into(),
        ..Default::default()
    }
}

/// Before the kill: worker `z-old` (over the protocol) holds `t`'s research under a lease it
/// accepted, and the real worker `gpu-b` is idle. Returns the session and the lease.
async fn a_lease_held_over_the_protocol(coord: &Coord) -> (Session, pb::Lease) {
    let mut api = coord.api().await;
    let mut s = Session::open(&coord.url, register("z-old")).await;
    api.create("t").await.expect("create");
    let a = s.assignment().await;
    let lease = a.lease.clone().expect("the assignment's lease");
    s.send(Out::Answer(pb::AssignmentAnswer {
        lease_id: lease.lease_id.clone(),
        accepted: true,
        reason: String::new(),
    }))
    .await;
    for state in ["starting", "active"] {
        s.send(Out::Run(pb::RunUpdate {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            task: "t".into(),
            phase: a.phase.clone(),
            state: state.into(),
            exit_code: -1,
            ..Default::default()
        }))
        .await;
    }
    poll("the run active", Duration::from_secs(5), || {
        let mut api = api.clone();
        async move {
            runs(&mut api, "t")
                .await
                .iter()
                .any(|r| r.state == "active")
                .then_some(())
        }
    })
    .await;
    (s, lease)
}

/// Issue 20 (1): "a lease whose run no worker reports after resume is ended (with a reason)
/// and its task re-offered". The worker resumes its session listing the lease but no run (its
/// run stopped and the report was lost with the coordinator): the lease ends `run_lost`, and
/// the task goes to another worker and completes its phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_run_the_resuming_worker_no_longer_has_ends_run_lost_and_its_task_completes()
{
    let env = Env::new();
    git_init(&env);
    let args = args();
    let mut coord = Coord::start(&env, &args);
    let (s, lease) = a_lease_held_over_the_protocol(&coord).await;
    let session = s.granted.session_id.clone();
    let _b = scripted_worker(&coord, "gpu-b", "sim:24GiB", &[]);

    kill_9_and_restart(&mut coord, &args, &[]);
    drop(s);
    // gpu-b first: the task then goes to it, not back to a worker that never runs it.
    worker_back(&coord.api().await, "gpu-b").await;
    let api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let resumed = Session::open(
        &coord.url,
        pb::Register {
            resume_session_id: session.clone(),
            leases: vec![pb::HeldLease {
                lease_id: lease.lease_id.clone(),
                token: lease.token,
            }],
            runs: vec![],
            reports_runs: true,
            ..register("z-old")
        },
    )
    .await;
    assert!(resumed.granted.resumed, "{:?}", resumed.granted);
    assert!(resumed.granted.kept.is_empty(), "{:?}", resumed.granted);
    assert_eq!(
        resumed
            .granted
            .lost
            .iter()
            .map(|l| l.token)
            .collect::<Vec<_>>(),
        [lease.token]
    );
    let ended = events
        .find("the lease's end", Duration::from_secs(5), |e| {
            e.kind == "lease_released" && e.task == "t" && e.token == lease.token
        })
        .await;
    assert_eq!(ended.detail, "run_lost", "{ended:?}");
    reaches(
        &api,
        "t",
        "research:awaiting_approval",
        Duration::from_secs(30),
    )
    .await;
    let all = poll("gpu-b's run's stop", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move {
            let all = runs(&mut api, "t").await;
            all.iter()
                .any(|r| r.worker == "gpu-b" && r.state == "stopped")
                .then_some(all)
        }
    })
    .await;
    let lost = all
        .iter()
        .find(|r| r.token == lease.token)
        .unwrap_or_else(|| panic!("{all:#?}"));
    assert_eq!(
        (
            lost.worker.as_str(),
            lost.state.as_str(),
            lost.stop_reason.as_str()
        ),
        ("z-old", "stopped", "run_lost"),
        "{lost:?}"
    );
    assert!(
        all.iter()
            .any(|r| r.worker == "gpu-b" && r.stop_reason == "completed"),
        "{all:#?}"
    );
}

/// Issue 20 (1): "a late `stopped` for a run the coordinator does not know is still applied
/// to its lease". A worker that does not report its runs when it resumes (one that predates
/// the report) sends the `stopped` of a run the restarted coordinator never heard of: from the
/// right worker, in the right session, with the lease's token, it releases the lease, counts
/// against the phase, and the task is offered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_stopped_for_a_run_the_restarted_coordinator_does_not_know_releases_its_lease() {
    let env = Env::new();
    git_init(&env);
    let args = args();
    let mut coord = Coord::start(&env, &args);
    let (s, lease) = a_lease_held_over_the_protocol(&coord).await;
    let session = s.granted.session_id.clone();
    let _b = scripted_worker(&coord, "gpu-b", "sim:24GiB", &[]);

    kill_9_and_restart(&mut coord, &args, &[]);
    drop(s);
    // gpu-b first: the task then goes to it, not back to a worker that never runs it.
    worker_back(&coord.api().await, "gpu-b").await;
    let mut api = coord.api().await;
    let resumed = Session::open(
        &coord.url,
        pb::Register {
            resume_session_id: session.clone(),
            leases: vec![pb::HeldLease {
                lease_id: lease.lease_id.clone(),
                token: lease.token,
            }],
            ..register("z-old")
        },
    )
    .await;
    assert!(resumed.granted.resumed, "{:?}", resumed.granted);
    assert_eq!(resumed.granted.kept.len(), 1, "{:?}", resumed.granted);
    // Nothing is known of the run, so nothing happens to the lease...
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(api.lease_of("t").await.map(|l| l.token), Some(lease.token));
    // ...until its stop: a stale token or another lease id changes nothing either.
    let stopped = |lease_id: &str, token: u64| {
        Out::Run(pb::RunUpdate {
            lease_id: lease_id.into(),
            token,
            task: "t".into(),
            phase: "research".into(),
            state: "stopped".into(),
            stop_reason: "agent_error".into(),
            detail: "Unavailable: tcp connect error".into(),
            exit_code: -1,
            ..Default::default()
        })
    };
    resumed.send(stopped("not-the-lease", lease.token)).await;
    resumed
        .send(stopped(&lease.lease_id, lease.token + 1))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(api.lease_of("t").await.map(|l| l.token), Some(lease.token));
    let mut events = Events::watch(&api).await;
    resumed.send(stopped(&lease.lease_id, lease.token)).await;
    let ended = events
        .find("the lease's release", Duration::from_secs(5), |e| {
            e.kind == "lease_released" && e.task == "t" && e.token == lease.token
        })
        .await;
    assert_eq!(ended.detail, "released", "{ended:?}");
    reaches(
        &api,
        "t",
        "research:awaiting_approval",
        Duration::from_secs(30),
    )
    .await;
    let all = runs(&mut api, "t").await;
    let late = all
        .iter()
        .find(|r| r.token == lease.token)
        .unwrap_or_else(|| panic!("{all:#?}"));
    assert_eq!(late.stop_reason, "agent_error", "{late:?}");
    assert!(late.detail.contains("tcp connect error"), "{late:?}");
}

/// A failed run's retry pause survives `kill -9`: three failures make it 4 s; the coordinator
/// is killed at once and restarted; the next run starts no sooner than the pause allows
/// (forgotten, the task was offered as soon as the worker resumed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_pause_survives_kill_9() {
    let env = Env::new();
    git_init(&env);
    let args = args();
    let envs = [("AUTOMATON_MAX_ATTEMPTS", "10")];
    let mut coord = Coord::start_with_env(&env, &args, &envs);
    let api = coord.api().await;
    let _w = scripted_worker(
        &coord,
        "gpu-a",
        "sim:24GiB",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "exit-1")],
    );
    api.clone().create("t").await.expect("create");
    let third = poll("three failed runs", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move {
            let failed: Vec<pb::Run> = runs(&mut api, "t")
                .await
                .into_iter()
                .filter(|r| r.stop_reason == "agent_error")
                .collect();
            (failed.len() >= 3).then(|| failed[2].clone())
        }
    })
    .await;
    // The third failure's record (its count and its 4 s pause) is on disk: the runs are
    // listed a moment before it is written.
    poll(
        "the third failure on disk",
        Duration::from_secs(10),
        || async {
            let v: serde_json::Value =
                serde_json::from_slice(&env.task_file("t", ".state.dispatch")?).ok()?;
            (v["failures"][0][1].as_u64()? >= 3 && v["retry_until_ms"].is_u64()).then_some(())
        },
    )
    .await;
    kill_9_and_restart(&mut coord, &args, &envs);
    let api = coord.api().await;
    let next = poll("the run after the pause", Duration::from_secs(30), || {
        let mut api = api.clone();
        let after = third.token;
        async move {
            runs(&mut api, "t")
                .await
                .into_iter()
                .find(|r| r.token > after)
        }
    })
    .await;
    let at = |t: &Option<automaton_proto::prost_types::Timestamp>| {
        t.as_ref()
            .map(|t| t.seconds as f64 + f64::from(t.nanos) / 1e9)
            .unwrap_or(0.0)
    };
    let gap = at(&next.started_at) - at(&third.ended_at);
    // The pause after the third failure is 4 s; the clocks are the coordinator's own.
    assert!(
        gap >= 3.5,
        "offered {gap:.2}s after the third failure, across a restart: {next:?}"
    );
}
