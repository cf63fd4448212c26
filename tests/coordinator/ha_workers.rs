//! Workers under high availability (issue 22): real `automaton-worker` processes (simulated
//! GPUs, the built-in scripted agent) given several real coordinators with `--store etcd`
//! over a real 3-member etcd cluster. A worker finds the leader whatever order it is given
//! the coordinators in, or follows a follower's `automaton-leader` metadata; a run in flight
//! when the leader is `kill -9`ed (or frozen by `SIGSTOP`) keeps going, its worker resumes on
//! the next leader, its calls follow — retried while nobody leads, or dropped from the frozen
//! leader — and the run lands there once, under its own lease.

use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;

use crate::cluster::Cluster;
use crate::ha::{ask, env_on, leader_of};
use crate::harness::*;
use crate::work::{FLEET, git_init};
use crate::workers::Worker;

/// A scripted worker on a simulated GPU, given `coordinators` (a comma-separated list).
fn worker(coordinators: &str, name: &str, envs: &[(&str, &str)]) -> Worker {
    crate::work::scripted_worker_at(coordinators, name, "sim:24GiB", envs)
}

/// The workers `url` lists, as an operator sees them.
async fn workers_on(url: &str) -> Vec<pb::WorkerInfo> {
    let api = Api::new(connect(url).await, None);
    let mut c = api.workers.clone();
    c.list_workers(api.req(pb::ListWorkersRequest {}))
        .await
        .map(|r| r.into_inner().workers)
        .unwrap_or_default()
}

/// Waits until `url` lists worker `name` attached (idle or busy).
async fn attached(url: &str, name: &str, within: Duration) {
    poll(&format!("{name} attached at {url}"), within, || async {
        workers_on(url)
            .await
            .into_iter()
            .find(|w| w.name == name && (w.state == "idle" || w.state == "busy"))
            .map(drop)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_worker_given_both_coordinators_joins_the_leader() {
    let cluster = Cluster::three().await;
    let a = Coord::start(&env_on(&cluster, "ha-join"), &FLEET);
    let b = Coord::start(&env_on(&cluster, "ha-join"), &FLEET);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let (leader, follower) = if l == 0 { (&a, &b) } else { (&b, &a) };
    // The follower first: the worker must not settle for it.
    let both = worker(&format!("{},{}", follower.url, leader.url), "gpu-a", &[]);
    assert!(
        both.stdout()
            .contains(&format!("joined {} as gpu-a", leader.url)),
        "{}\n{}",
        both.stdout(),
        both.stderr()
    );
    assert!(
        both.stderr().contains(&format!("leader={}", leader.url)),
        "the leader is logged:\n{}",
        both.stderr()
    );
    attached(&leader.url, "gpu-a", Duration::from_secs(10)).await;
    // Given the follower alone, a worker follows the leader it names (once it knows it: a
    // follower learns the leader from etcd within a fraction of the election TTL).
    let one = worker(&follower.url, "gpu-b", &[]);
    assert!(
        one.stdout()
            .contains(&format!("joined {} as gpu-b", leader.url)),
        "{}\n{}",
        one.stdout(),
        one.stderr()
    );
    attached(&leader.url, "gpu-b", Duration::from_secs(10)).await;
    // The follower holds no session: it serves nothing, ListWorkers included.
    let refused = ask(&follower.url).await.expect_err("a follower refuses");
    assert_eq!(refused.code(), tonic::Code::Unavailable);
}

/// How the leader goes away mid-run.
#[derive(Clone, Copy, Debug)]
enum Down {
    /// `kill -9`: its connections are reset at once.
    Kill9,
    /// `SIGSTOP`, never woken (SIGKILLed at the end of the test): its connections stay open
    /// and a call on them waits for an answer that never comes.
    Frozen,
}

/// What a research run across the loss of the leader came to.
struct Failover {
    /// The coordinators (the survivor alive), and the etcd cluster under them, kept to the
    /// end of the test.
    _cluster: Cluster,
    _coords: (Coord, Coord),
    worker: Worker,
    /// The new leader's API, URL and folder.
    api: Api,
    url: String,
    env: std::sync::Arc<Env>,
    /// The research run as the first leader saw it active.
    run: pb::Run,
}

/// One worker (its scripted agent taking `slow_ms`) runs task `t`'s research under the
/// leader of two coordinators, which goes `down` `kill_after_ms` into the run; waits until
/// the other one has accepted the run (research awaiting its approval) and prints how long
/// each step took after the leader went.
async fn research_across_failover(
    project: &str,
    down: Down,
    slow_ms: u64,
    kill_after_ms: u64,
) -> Failover {
    let cluster = Cluster::three().await;
    let mut args: Vec<&str> = FLEET.to_vec();
    // Recovery gives the dead leader's leases max(TTL, grace) and holds its worker sessions
    // awaiting for the grace: the worker has that long to resume on the new leader.
    args.extend(["--grace-period", "10s"]);
    let (ea, eb) = (env_on(&cluster, project), env_on(&cluster, project));
    git_init(&ea);
    git_init(&eb);
    let mut a = Coord::start(&ea, &args);
    let mut b = Coord::start(&eb, &args);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let slow = format!("slow={slow_ms}");
    let w = worker(
        &format!("{},{}", a.url, b.url),
        "gpu-a",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", slow.as_str())],
    );
    let (leader, survivor, env) = if l == 0 {
        (&mut a, &b, eb.clone())
    } else {
        (&mut b, &a, ea.clone())
    };
    let mut api = Api::new(connect(&leader.url).await, None);
    api.create("t").await.expect("CreateTask");
    let run = poll(
        "the research run is active",
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            async move {
                let runs = api.get("t").await.ok()?.runs;
                runs.into_iter()
                    .find(|r| r.phase == "research" && r.state == "active")
            }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(kill_after_ms)).await;
    let killed = Instant::now();
    match down {
        Down::Kill9 => leader.kill9(),
        Down::Frozen => signal(leader.pid(), "-STOP"),
    }
    let url = survivor.url.clone();
    let deadline = Instant::now() + Duration::from_secs(25);
    while ask(&url).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the survivor never took over; stderr:\n{}",
            survivor.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let serving = killed.elapsed();
    attached(&url, "gpu-a", Duration::from_secs(25)).await;
    let registered = killed.elapsed();
    let mut api = Api::new(connect(&url).await, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    while api.state("t").await != "research:awaiting_approval" {
        assert!(
            Instant::now() < deadline,
            "research was not accepted by the new leader in 30 s; runs: {:?}\nworker:\n{}\nnew leader:\n{}",
            api.get("t").await.map(|d| d.runs),
            w.stderr(),
            survivor.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let accepted = killed.elapsed();
    println!(
        "{project}: agent {slow_ms} ms, leader {down:?} {kill_after_ms} ms into it; after that: new leader serving {serving:?}, worker re-registered {registered:?}, run accepted {accepted:?}"
    );
    Failover {
        _cluster: cluster,
        _coords: (a, b),
        worker: w,
        api,
        url,
        env,
        run,
    }
}

/// What every failover must leave: the worker resumed its session on the new leader and
/// logged it; the run was dispatched once, completed under its own lease, its artifact on
/// the new leader's disk; the task moves on once, its next lease after the first in token
/// order.
async fn landed_once(f: &mut Failover) {
    let log = f.worker.stderr();
    assert!(log.contains("session resumed"), "{log}");
    assert!(
        log.contains(&format!("leader={}", f.url)),
        "the new leader is logged:\n{log}"
    );
    assert!(!log.contains("agent_error"), "{log}");
    assert!(
        !log.contains("lease lost") && !log.contains("no longer knew this session"),
        "{log}"
    );
    // Dispatched once: one assignment taken, one research run, under the first lease.
    assert_eq!(log.matches("assignment taken").count(), 1, "{log}");
    let run = f.run.clone();
    let runs = f.api.get("t").await.expect("GetTask").runs;
    let research: Vec<_> = runs.iter().filter(|r| r.phase == "research").collect();
    assert_eq!(research.len(), 1, "{runs:#?}");
    assert_eq!(research[0].token, run.token, "{runs:#?}");
    assert!(
        matches!(research[0].stop_reason.as_str(), "completed" | ""),
        "{runs:#?}"
    );
    let spec = String::from_utf8(f.env.task_file("t", "SPEC.md").expect("SPEC.md")).expect("utf-8");
    assert!(
        spec.contains(&format!("fencing token {}", run.token)),
        "{spec}"
    );
    f.api.approve("t", "ops").await.expect("approve research");
    let next = poll("the next phase's lease", Duration::from_secs(20), || {
        let mut api = f.api.clone();
        async move { api.lease_of("t").await.filter(|l| l.token != run.token) }
    })
    .await;
    assert!(
        next.token > run.token,
        "tokens increase across the failover: {} after {}",
        next.token,
        run.token
    );
    let state = f.api.state("t").await;
    assert!(state.starts_with("design"), "{state}");
    let runs = f.api.get("t").await.expect("GetTask").runs;
    assert_eq!(
        runs.iter().filter(|r| r.phase == "research").count(),
        1,
        "{runs:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_run_in_flight_survives_kill9_of_the_leader() {
    // The agent takes 5 s: the leader dies 1 s into it, and the next one serves (after the
    // 2 s election TTL) while the agent still runs.
    let mut f = research_across_failover("ha-run", Down::Kill9, 5_000, 1_000).await;
    // The worker was back in its session while its agent still ran.
    let log = f.worker.stderr();
    let resumed = log.find("session resumed").expect("resumed");
    let done = log.find("agent stopped").expect("the agent stopped");
    assert!(
        resumed < done,
        "the agent was done before the worker resumed (a slow election?):\n{log}"
    );
    landed_once(&mut f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_run_finishing_while_no_coordinator_leads_uploads_to_the_new_leader() {
    // The agent is done 0.3 s after the kill, seconds before the next leader serves: its
    // upload is retried while nobody leads and lands on the new leader once it is found.
    let mut f = research_across_failover("ha-upload", Down::Kill9, 1_800, 1_500).await;
    let log = f.worker.stderr();
    assert!(
        log.lines()
            .any(|l| l.contains("the coordinator is unreachable: retrying")
                && (l.contains("UploadArtifact") || l.contains("CompletePhase"))),
        "the upload was not retried:\n{log}"
    );
    landed_once(&mut f).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_call_hanging_on_a_frozen_leader_is_sent_to_the_new_one() {
    // The leader is stopped just before the agent is done: the upload goes to it and waits,
    // the connection open; once the session (its heartbeats unanswered) finds the next
    // leader, the call is dropped and sent there instead of waiting out the keep-alive.
    let mut f = research_across_failover("ha-frozen", Down::Frozen, 1_800, 1_500).await;
    let log = f.worker.stderr();
    assert!(
        log.contains("the leader changed during the call"),
        "no call was moved off the frozen leader:\n{log}"
    );
    landed_once(&mut f).await;
}
