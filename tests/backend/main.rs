//! The etcd backend against a real etcd cluster (the harness of `tests/etcd`): the same
//! conformance suite as the files backend, the task store replicated through it and rebuilt
//! on another machine's folder, the coordinator's lease rules over it, and a deposed
//! leader's writes refused. No mock of etcd.

#[path = "../etcd/cluster.rs"]
#[allow(dead_code)]
mod cluster;

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use automaton_backend::conformance::check_lease_log;
use automaton_backend::{Backend, EtcdBackend};
use automaton_etcd::{Client, Election, Leadership};
use automaton_store::Project;
use cluster::Cluster;

const TTL: Duration = Duration::from_secs(2);

async fn lead(client: &Client, project: &str, who: &str) -> Arc<Leadership> {
    let e = Election::new(
        client.clone(),
        format!("{}leader", EtcdBackend::prefix_of(project)),
        who,
        TTL,
    )
    .expect("election");
    Arc::new(
        tokio::time::timeout(Duration::from_secs(20), e.campaign())
            .await
            .expect("elected in time")
            .expect("campaign"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_etcd_backend_conforms() {
    let cluster = Cluster::three().await;
    let client = cluster.client();
    let leadership = lead(&client, "conform", "a").await;
    let backend = EtcdBackend::new(
        client.clone(),
        leadership,
        EtcdBackend::prefix_of("conform"),
    );
    let started = Instant::now();
    check_lease_log(&backend).await.expect("conforms");
    println!(
        "conformance against 3 etcd members: {:?}",
        started.elapsed()
    );
}

/// A project whose task store writes through `backend`.
fn replicated(dir: &std::path::Path, backend: &EtcdBackend) -> Project {
    std::fs::write(dir.join(".agent.md"), "Mode: multi-agent\n").expect("agent.md");
    Project::open(dir, None).with_replica(backend.replica())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_store_replicated_through_etcd_is_rebuilt_on_another_machine() {
    let cluster = Cluster::one().await;
    let client = cluster.client();
    let backend = EtcdBackend::new(
        client.clone(),
        lead(&client, "view", "a").await,
        EtcdBackend::prefix_of("view"),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let p = replicated(dir.path(), &backend);
    let t: automaton_workflow::TaskName = "t".parse().expect("name");
    let now = SystemTime::now();
    tokio::task::spawn_blocking(move || {
        p.create_task(&t).expect("create");
        p.transition(&t, "research".parse().expect("state"), None, None, now)
            .expect("research");
        p.write_artifact(&t, automaton_workflow::Artifact::Spec, b"# spec\n")
            .expect("artifact");
        p.set_fencing_mark(4096).expect("mark");
        // Over the etcd backend's file cap: refused with what to do, nothing written.
        let big = vec![b'x'; automaton_backend::etcd::MAX_FILE_BYTES + 1];
        let e = p
            .write_artifact(&t, automaton_workflow::Artifact::Design, &big)
            .expect_err("too large");
        assert!(e.to_string().contains("at most 1048576 bytes"), "{e}");
        assert!(!p.task_dir(&t).join("DESIGN.md").exists());
    })
    .await
    .expect("store changes");
    let files = backend.files().await.expect("files");
    let names: Vec<&str> = files.iter().map(|(p, _)| p.as_str()).collect();
    assert!(names.contains(&"tasks/t/.state"), "{names:?}");
    assert!(names.contains(&"tasks/t/SPEC.md"), "{names:?}");
    assert!(names.contains(&"fencing"), "{names:?}");
    // Another coordinator's folder, from etcd alone.
    let other = tempfile::tempdir().expect("tempdir");
    let q = Project::open(other.path(), None);
    let (written, _) = q.restore_view(&files).expect("restore");
    assert_eq!(written, files.len());
    assert_eq!(
        q.read_state(&"t".parse().expect("name")).expect("read"),
        Some("research".parse().expect("state"))
    );
    assert_eq!(q.fencing_mark().expect("mark"), 4096);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deposed_leaders_lease_log_and_store_write_nothing() {
    let cluster = Cluster::one().await;
    let client = cluster.client();
    let first = lead(&client, "deposed", "a").await;
    let backend = EtcdBackend::new(
        client.clone(),
        first.clone(),
        EtcdBackend::prefix_of("deposed"),
    );
    let log = backend.start(&[]).expect("start");
    let task: automaton_workflow::TaskName = "t".parse().expect("name");
    let agent: automaton_workflow::AgentId = "agent-a".parse().expect("agent");
    let grant = |id: &'static str, token| automaton_backend::Grant {
        task: &task,
        agent: &agent,
        lease_id: id,
        token,
        ttl: Duration::from_secs(60),
        state: "implement".parse().expect("state"),
        session: None,
    };
    log.grant(grant("before", 1))
        .expect("queued")
        .await
        .expect("durable");
    // Another candidate takes the key over (the first's lease revoked behind its back, as
    // if it had been stopped past its TTL).
    client.revoke(first.lease_id()).await.expect("revoke");
    let second = lead(&client, "deposed", "b").await;
    assert!(second.revision() > first.revision(), "revisions increase");
    let refused = log.grant(grant("after", 2)).expect("queued").await;
    let why = refused.expect_err("a deposed leader's grant is refused");
    assert!(why.contains("deposed") || why.contains("lost"), "{why}");
    // Fail-stop: the log says why, and refuses everything after.
    let failed = tokio::time::timeout(Duration::from_secs(5), log.failed())
        .await
        .expect("failed resolves");
    assert!(!failed.is_empty());
    assert!(log.barrier().is_err() || log.barrier().expect("queued").await.is_err());
    let dir = tempfile::tempdir().expect("tempdir");
    let p = replicated(dir.path(), &backend);
    let created = tokio::task::spawn_blocking(move || p.create_task(&"u".parse().expect("n")))
        .await
        .expect("joined");
    assert!(
        created.is_err(),
        "a deposed leader's store write is refused"
    );
    assert!(!dir.path().join(".automaton/tasks/u").exists());
    // etcd holds the first grant only.
    let kept = backend.load().expect("load");
    let ids: Vec<String> = kept
        .iter()
        .filter_map(|r| match r {
            automaton_backend::Record::Grant { lease_id, .. } => Some(lease_id.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(ids, vec!["before".to_string()]);
    assert!(backend.files().await.expect("files").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_through_the_coordinator_over_etcd_follow_the_lease_rules() {
    let cluster = Cluster::one().await;
    let client = cluster.client();
    let backend = EtcdBackend::new(
        client.clone(),
        lead(&client, "rules", "a").await,
        EtcdBackend::prefix_of("rules"),
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let project = replicated(dir.path(), &backend);
    let options = automaton_engine::Options {
        ttl: automaton_workflow::TtlBounds {
            min: Duration::from_millis(10),
            max: Duration::from_secs(3600),
        },
        ..automaton_engine::Options::default()
    };
    let (coord, _) =
        automaton_engine::Engine::open_with(project, options, &backend).expect("open over etcd");
    let task: automaton_workflow::TaskName = "t".parse().expect("name");
    coord.create_task(&task).await.expect("create");
    coord
        .transition(
            &task,
            "research".parse().expect("state"),
            &automaton_engine::Presented::default(),
        )
        .await
        .expect("to research");
    automaton_store::check_lease_rules(&*coord, &task)
        .await
        .expect("the coordinator over etcd follows the lease rules");
    // The grant it holds is in etcd, and a restart over the same keys brings it back.
    let live: Vec<_> = automaton_backend::replay(&backend.load().expect("load"))
        .0
        .into_keys()
        .collect();
    assert_eq!(live, vec![task]);
}
