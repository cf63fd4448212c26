//! High availability on etcd (issue 22): real coordinators with `--store etcd` over a real
//! 3-member etcd cluster on loopback (the harness of `tests/etcd`), real `kill -9` and
//! `SIGSTOP`. One leader; followers answer `UNAVAILABLE` naming it; a killed leader's
//! leases and tokens carry over to the next; a stopped leader, woken after another took
//! over, writes nothing, acknowledges nothing and steps down. Issue 30: a renewal queued in
//! a stopped leader is refused; a displaced lease stays ended across a failover; a follower
//! names the leader etcd names now; one project needs one `[etcd] name`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Code;

use crate::cluster::Cluster;
use crate::harness::{Api, Coord, Env, connect, signal};

const ELECTION_TTL: &str = "2s";

/// A project folder whose coordinator keeps its state in `cluster` under the name `name`.
pub(crate) fn env_on(cluster: &Cluster, name: &str) -> Arc<Env> {
    env_on_with(cluster, name, "")
}

/// [`env_on`] with more `[etcd]` keys (`extra`, TOML lines).
pub(crate) fn env_on_with(cluster: &Cluster, name: &str, extra: &str) -> Arc<Env> {
    Env::with_config(&format!("{}{extra}", etcd_toml(cluster, "", Some(name))))
}

/// A coordinator's TOML on `cluster`: `top` (keys before `[etcd]`), then `[etcd]` with the
/// endpoints, `name` (none: left out) and the tests' TTL and timeout.
pub(crate) fn etcd_toml(cluster: &Cluster, top: &str, name: Option<&str>) -> String {
    let endpoints: Vec<String> = cluster
        .endpoints()
        .iter()
        .map(|e| format!("{e:?}"))
        .collect();
    let name = name.map_or(String::new(), |n| format!("name = \"{n}\"\n"));
    format!(
        "{top}store = \"etcd\"\n[etcd]\nendpoints = [{}]\n{name}election_ttl = \"{ELECTION_TTL}\"\ntimeout = \"500ms\"\n",
        endpoints.join(", ")
    )
}

/// What one coordinator answers now: `Ok` as the leader, or the follower's status.
pub(crate) async fn ask(url: &str) -> Result<(), tonic::Status> {
    let mut api = Api::new(connect(url).await, None);
    api.list().await.map(drop)
}

/// Waits until exactly one of `coords` leads; returns its index.
pub(crate) async fn leader_of(coords: &[&Coord], within: Duration) -> usize {
    let deadline = Instant::now() + within;
    loop {
        let mut leading = Vec::new();
        for (i, c) in coords.iter().enumerate() {
            if ask(&c.url).await.is_ok() {
                leading.push(i);
            }
        }
        match leading.as_slice() {
            [one] => return *one,
            [] => {}
            many => panic!("more than one coordinator serves as leader: {many:?}"),
        }
        assert!(
            Instant::now() < deadline,
            "no leader within {within:?}; stderr:\n{}",
            coords
                .iter()
                .map(|c| c.stderr())
                .collect::<Vec<_>>()
                .join("\n---\n")
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_one_leader_and_the_follower_names_it() {
    let cluster = Cluster::three().await;
    let metrics = ["--metrics-listen", "127.0.0.1:0"];
    let a = Coord::start(&env_on(&cluster, "ha-names"), &metrics);
    let b = Coord::start(&env_on(&cluster, "ha-names"), &metrics);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let (leader, follower) = if l == 0 { (&a, &b) } else { (&b, &a) };
    // The follower names the leader, in the metadata and in words, until it notices.
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        let s = ask(&follower.url).await.expect_err("a follower refuses");
        if s.metadata().get("automaton-leader").is_some() || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert_eq!(
        status
            .metadata()
            .get("automaton-leader")
            .and_then(|v| v.to_str().ok()),
        Some(leader.url.as_str()),
        "{status:?}"
    );
    assert!(status.message().contains(&leader.url), "{status:?}");
    // The dashboard tells them apart: the leader's scrape is its coordinator's, with
    // automaton_leader 1; the follower's says 0.
    let scrape = |c: &Coord| crate::metrics::scrape(crate::metrics::metrics_addr(|| c.stderr()));
    let (l, f) = (scrape(leader), scrape(follower));
    assert_eq!(l.get("automaton_leader", &[]), Some(1.0));
    assert_eq!(f.get("automaton_leader", &[]), Some(0.0));
    assert_eq!(l.get("automaton_leases_held", &[]), Some(0.0));
    assert_eq!(f.get("automaton_leases_held", &[]), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_kill9_of_the_leader_hands_over_its_leases_and_tokens() {
    let cluster = Cluster::three().await;
    let mut a = Coord::start(&env_on(&cluster, "ha-kill"), &[]);
    let mut b = Coord::start(&env_on(&cluster, "ha-kill"), &[]);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let mut api = Api::new(connect(if l == 0 { &a.url } else { &b.url }).await, None);
    api.claimable_task("t").await;
    let held = api.claim("t", "agent-a", 60_000).await.expect("claim");
    let killed = Instant::now();
    if l == 0 {
        a.kill9();
    } else {
        b.kill9();
    }
    let survivor = if l == 0 { &b } else { &a };
    let deadline = Instant::now() + Duration::from_secs(20);
    while ask(&survivor.url).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "the survivor never took over; stderr:\n{}",
            survivor.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "kill -9 of the leader to the next one serving: {:?}",
        killed.elapsed()
    );
    // The new leader: the lease its predecessor acknowledged is still agent-a's.
    let mut api = Api::new(connect(&survivor.url).await, None);
    let lease = api.lease_of("t").await.expect("the lease carried over");
    assert_eq!(lease.agent, "agent-a");
    assert_eq!(lease.token, held.token);
    let refused = api.claim("t", "agent-b", 60_000).await;
    assert_eq!(
        refused.expect_err("leased").code(),
        Code::FailedPrecondition
    );
    // Its holder renews it against the new leader and lets it go.
    api.renew(&held.lease_id, held.token).await.expect("renew");
    api.release(&held.lease_id, held.token)
        .await
        .expect("release");
    let next = api.claim("t", "agent-b", 60_000).await.expect("claim");
    assert!(
        next.token > held.token,
        "tokens increase across the failover: {} after {}",
        next.token,
        held.token
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_stopped_leader_woken_after_another_took_over_writes_nothing_and_steps_down() {
    let cluster = Cluster::three().await;
    let a = Coord::start(&env_on(&cluster, "ha-stop"), &[]);
    let b = Coord::start(&env_on(&cluster, "ha-stop"), &[]);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let (old, new) = if l == 0 { (&a, &b) } else { (&b, &a) };
    let mut api = Api::new(connect(&old.url).await, None);
    api.claimable_task("t").await;
    // A short lease: it lapses while its leader is stopped, so the leader's first act when
    // woken is to end it — a write it must not make.
    let held = api.claim("t", "agent-a", 1_000).await.expect("claim");
    signal(old.pid(), "-STOP");
    let new_api_url = new.url.clone();
    let deadline = Instant::now() + Duration::from_secs(20);
    while ask(&new_api_url).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "no takeover within 20 s; stderr:\n{}",
            new.stderr()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut api = Api::new(connect(&new.url).await, None);
    api.claimable_task("u").await;
    let prefix = "/automaton/ha-stop/";
    let etcd = cluster.client();
    let keys = || async {
        etcd.range_prefix(prefix)
            .await
            .expect("range")
            .into_iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(&kv.key).into_owned(),
                    String::from_utf8_lossy(&kv.value).into_owned(),
                    kv.mod_revision,
                )
            })
            .collect::<Vec<_>>()
    };
    let before = keys().await;
    let files_before = old.env.snapshot();
    signal(old.pid(), "-CONT");
    // It steps down: a follower naming the new leader.
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        match ask(&old.url).await {
            Err(s) if s.metadata().get("automaton-leader").is_some() => break s,
            _ if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!(
                "the woken leader did not step down: {other:?}; stderr:\n{}",
                old.stderr()
            ),
        }
    };
    assert_eq!(
        status
            .metadata()
            .get("automaton-leader")
            .and_then(|v| v.to_str().ok()),
        Some(new.url.as_str())
    );
    assert!(
        old.wait_stderr("stepped down", Duration::from_secs(5)),
        "{}",
        old.stderr()
    );
    // It wrote nothing: not to etcd, not to its folder.
    assert_eq!(keys().await, before, "the deposed leader wrote to etcd");
    assert_eq!(
        old.env.snapshot(),
        files_before,
        "the deposed leader wrote to its folder"
    );
    // The lease it would have ended lapsed under the new leader's clock, not its own.
    let _ = held;
    assert_eq!(api.state("u").await, "research");
}

/// Issue 30 (2): a lapsed lease displaced by a new grant is ended by that grant on etcd too.
/// Agent A claims with a 30 ms TTL; just after it lapses (usually before the expiry sweep
/// ends it) agent B's claim displaces it; B releases. After `kill -9` of the leader, the next
/// leader replays etcd: A's lease is not live again, A's renewal of its old token is
/// refused, and the next claim's token is above B's (the displaced lease's key used to
/// outlive its successor's and come back at replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_displaced_lease_stays_ended_after_a_failover_and_its_token_never_comes_back() {
    let cluster = Cluster::three().await;
    let args = ["--lease-ttl-min", "10ms", "--grace-period", "30s"];
    let mut a = Coord::start(&env_on(&cluster, "ha-displaced"), &args);
    let mut b = Coord::start(&env_on(&cluster, "ha-displaced"), &args);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let mut api = Api::new(connect(if l == 0 { &a.url } else { &b.url }).await, None);
    let tasks: Vec<String> = (0..12).map(|i| format!("d{i}")).collect();
    let mut displaced = Vec::new();
    for t in &tasks {
        api.claimable_task(t).await;
        let first = api.claim(t, "agent-a", 30).await.expect("A claims");
        tokio::time::sleep(Duration::from_millis(31)).await;
        let second = api.claim(t, "agent-b", 60_000).await.expect("B takes over");
        assert!(second.token > first.token);
        api.release(&second.lease_id, second.token)
            .await
            .expect("B releases");
        displaced.push((t.clone(), first, second.token));
    }
    if l == 0 {
        a.kill9();
    } else {
        b.kill9();
    }
    let survivor = if l == 0 { &b } else { &a };
    leader_of(&[survivor], Duration::from_secs(30)).await;
    let mut api = Api::new(connect(&survivor.url).await, None);
    for (t, first, b_token) in &displaced {
        if let Some(l) = api.lease_of(t).await {
            panic!("{t}: an ended lease is live again after the failover: {l:?}");
        }
        let renewed = api.renew(&first.lease_id, first.token).await;
        assert!(
            renewed.is_err(),
            "{t}: the displaced lease's token {} was renewed after the failover: {renewed:?}",
            first.token
        );
        let c = api.claim(t, "agent-c", 60_000).await.expect("C claims");
        assert!(c.token > *b_token, "{t}: token went backwards");
    }
}

/// Issue 30 (1): a leader stopped past its election TTL, woken with a renewal waiting on its
/// connection after another coordinator took over, refuses it (`UNAVAILABLE`) rather than
/// acknowledge it from memory — and so no second holder is granted the task inside a window
/// the first was promised. With a 1 s grace and a 4 s lease the new leader grants the task
/// 4 s after its start: inside the 4 s an acknowledged renewal, sent after that start, would
/// promise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_renewal_queued_across_the_leaders_pause_is_refused_and_no_second_holder_overlaps() {
    let cluster = Cluster::three().await;
    let cfg = etcd_toml(&cluster, "grace_period = \"1s\"\n", Some("ha-pause"));
    let a = Coord::start(&Env::with_config(&cfg), &[]);
    let b = Coord::start(&Env::with_config(&cfg), &[]);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let (old, new) = if l == 0 { (&a, &b) } else { (&b, &a) };
    let mut api = Api::new(connect(&old.url).await, None);
    api.claimable_task("t").await;
    const TTL_MS: u64 = 4_000;
    let held = api.claim("t", "agent-a", TTL_MS).await.expect("claim");
    // The connection is up before the pause: the renewal waits in the stopped leader's socket.
    api.lease_of("t").await.expect("the leader answers");
    signal(old.pid(), "-STOP");
    let deadline = Instant::now() + Duration::from_secs(20);
    while ask(&new.url).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "no takeover within 20 s; stderr:\n{}",
            new.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let serving = Instant::now();
    let sent = Instant::now();
    let renewal = {
        let (id, token) = (held.lease_id.clone(), held.token);
        tokio::spawn(async move { api.renew(&id, token).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    signal(old.pid(), "-CONT");
    let answered = renewal.await.expect("the renewal task");
    // Another agent claims at the new leader until it is granted the task.
    let mut other = Api::new(connect(&new.url).await, None);
    let deadline = Instant::now() + Duration::from_secs(30);
    let granted_at = loop {
        match other.claim("t", "agent-b", 60_000).await {
            Ok(_) => break Instant::now(),
            Err(s) if s.code() == Code::FailedPrecondition && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => panic!(
                "agent-b never got the task: {s:?}; stderr:\n{}",
                new.stderr()
            ),
        }
    };
    println!(
        "new leader serving to agent-b's grant: {:?}; the renewal's answer: {:?}",
        granted_at - serving,
        answered.as_ref().map(|l| l.token).map_err(|s| s.code())
    );
    match answered {
        Ok(l) => panic!(
            "the deposed leader acknowledged a renewal (token {}) promising the lease until {:?} after it was sent; agent-b was granted the task {:?} after it was sent",
            l.token,
            Duration::from_millis(TTL_MS),
            granted_at - sent
        ),
        Err(s) => {
            assert_eq!(s.code(), Code::Unavailable, "{s:?}");
            assert!(s.message().contains("cannot prove it still leads"), "{s:?}");
        }
    }
    // And it stepped down.
    assert!(
        old.wait_stderr("stepped down", Duration::from_secs(10)),
        "{}",
        old.stderr()
    );
}

/// Issue 30 (4): a follower names the leader etcd names now, not one it remembers. The
/// leader of three is stopped; the moment etcd's leader key names another coordinator, the
/// third one, asked, names that one (a follower that polled its view named the stopped
/// leader for up to a poll period, costing a client one more deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_follower_names_the_leader_etcd_names_now_not_the_stopped_one() {
    let cluster = Cluster::three().await;
    let coords = [
        Coord::start(&env_on(&cluster, "ha-view"), &[]),
        Coord::start(&env_on(&cluster, "ha-view"), &[]),
        Coord::start(&env_on(&cluster, "ha-view"), &[]),
    ];
    let all: Vec<&Coord> = coords.iter().collect();
    let l = leader_of(&all, Duration::from_secs(20)).await;
    let old = &coords[l];
    let etcd = cluster.client();
    let key = "/automaton/ha-view/leader";
    let named = |found: Option<(Vec<u8>, i64)>| {
        found.map(|(v, _)| String::from_utf8_lossy(&v).into_owned())
    };
    // Every follower has read the leader before the pause (so one that remembers, would).
    for (i, c) in coords.iter().enumerate() {
        if i != l {
            let s = ask(&c.url).await.expect_err("a follower refuses");
            assert_eq!(
                s.metadata()
                    .get("automaton-leader")
                    .and_then(|v| v.to_str().ok()),
                Some(old.url.as_str()),
                "{s:?}"
            );
        }
    }
    signal(old.pid(), "-STOP");
    let deadline = Instant::now() + Duration::from_secs(20);
    let new = loop {
        let now = named(automaton_etcd::leader(&etcd, key).await.unwrap_or(None));
        if let Some(url) = now.filter(|u| *u != old.url) {
            break url;
        }
        assert!(Instant::now() < deadline, "etcd never named another leader");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let third = coords
        .iter()
        .find(|c| c.url != old.url && c.url != new)
        .expect("the third coordinator");
    let s = ask(&third.url).await.expect_err("the third one follows");
    let says = s
        .metadata()
        .get("automaton-leader")
        .and_then(|v| v.to_str().ok());
    signal(old.pid(), "-CONT");
    assert_eq!(
        says,
        Some(new.as_str()),
        "etcd named {new} but the follower named {says:?} (the stopped leader was {}): {s:?}",
        old.url
    );
    assert!(s.message().contains(&new), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_the_cli_and_the_status_shim_follow_the_leader() {
    let cluster = Cluster::three().await;
    let a = Coord::start(&env_on(&cluster, "ha-cli"), &[]);
    let b = Coord::start(&env_on(&cluster, "ha-cli"), &[]);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let (leader, follower) = if l == 0 { (&a, &b) } else { (&b, &a) };
    let mut api = Api::new(connect(&leader.url).await, None);
    api.claimable_task("listed").await;
    // The follower first: the CLI asks it, is told the leader, and goes there.
    let both = format!("{},{}", follower.url, leader.url);
    let env = Env::new();
    let run = env.cli(&["--task", "listed", "--coordinator", &both]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("research"), "{run:?}");
    // Only the follower: refused, naming the leader.
    // (A follower learns the leader by reading etcd; on a busy machine that may take a
    // moment after the election: until then it says no leader is known.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let run = loop {
        let run = env.cli(&["--task", "listed", "--coordinator", &follower.url]);
        if run.stderr.contains(&leader.url) || Instant::now() > deadline {
            break run;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_ne!(run.code, 0, "{run:?}");
    assert!(run.stderr.contains(&leader.url), "{run:?}");
    // The shim prompts call, with the list in AUTOMATON_COORDINATOR.
    let shim = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/status.py");
    let mut c = std::process::Command::new("python3");
    c.arg(shim)
        .args(["--task", "listed", "--project"])
        .arg(env.root())
        .env("AUTOMATON_BIN", crate::harness::cli_bin())
        .env("AUTOMATON_COORDINATOR", &both)
        .env("HOME", env.home.path());
    let run = crate::harness::run_bounded(c, Duration::from_secs(60));
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("research"), "{run:?}");
}

/// Issue 30 (5): one project, one name. Two coordinators of one project started from folders
/// named differently used to take their folders' names and lead two projects in etcd, each
/// granting the same tasks. Without `[etcd] name` each is refused in one line that says what
/// to set; with one name in both, exactly one leads and the other names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_two_folders_of_one_project_are_refused_without_a_name_and_one_leads_with_it() {
    let cluster = Cluster::three().await;
    let cfg = etcd_toml(&cluster, "", None);
    let (one, two) = (Env::with_config(&cfg), Env::with_config(&cfg));
    assert_ne!(
        one.project.path().file_name(),
        two.project.path().file_name(),
        "two folders named differently"
    );
    for env in [&one, &two] {
        let run = env.run_coordinator(&[], &[], Duration::from_secs(20));
        assert_eq!(run.code, 2, "{run:?}");
        assert_eq!(run.stderr.trim().lines().count(), 1, "{run:?}");
        assert!(run.stderr.contains("set [etcd] name"), "{run:?}");
        assert!(run.stdout.is_empty(), "nothing listened: {run:?}");
    }
    // Named alike (here through the environment), the two folders are one project.
    let named = [("AUTOMATON_ETCD_NAME", "ha-one-name")];
    let a = Coord::start_with_env(&one, &[], &named);
    let b = Coord::start_with_env(&two, &[], &named);
    let l = leader_of(&[&a, &b], Duration::from_secs(20)).await;
    let (leader, follower) = if l == 0 { (&a, &b) } else { (&b, &a) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = ask(&follower.url).await.expect_err("the other one follows");
        let says = s
            .metadata()
            .get("automaton-leader")
            .and_then(|v| v.to_str().ok());
        if says == Some(leader.url.as_str()) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the follower never named the leader: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn ha_bad_etcd_configuration_is_refused_in_one_line_before_anything_binds() {
    let env = Env::new();
    let short = Duration::from_secs(20);
    for (args, says) in [
        (vec!["--store", "etcd"], "needs its endpoints"),
        (
            vec!["--store", "etcd", "--etcd", "ftp://x"],
            "http:// or https://",
        ),
        (
            vec![
                "--store",
                "etcd",
                "--etcd",
                "http://127.0.0.1:1",
                "--listen",
                "0.0.0.0:0",
                "--insecure",
            ],
            "pass --advertise URL",
        ),
        (
            vec![
                "--store",
                "etcd",
                "--etcd",
                "http://127.0.0.1:1",
                "--advertise",
                "x:1",
            ],
            "is not a URL",
        ),
    ] {
        let run = env.run_coordinator(&args, &[], short);
        assert_eq!(run.code, 2, "{args:?}: {run:?}");
        assert!(run.stderr.contains(says), "{args:?}: {run:?}");
        assert_eq!(run.stderr.trim().lines().count(), 1, "{args:?}: {run:?}");
        assert!(run.stdout.is_empty(), "nothing listened: {run:?}");
    }
    let run = env.run_coordinator(&["--store", "bogus"], &[], short);
    assert_ne!(run.code, 0, "{run:?}");
    assert!(run.stderr.contains("write files or etcd"), "{run:?}");
}

/// `[etcd]` with `ca`, `cert` and `key` over an etcd that serves TLS only and requires client
/// certificates: the coordinator is elected and serves. With another CA it never leads,
/// refuses calls as a follower, and says why (the certificate) in its log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_over_tls_to_etcd_a_coordinator_leads_and_a_wrong_ca_is_named_in_its_log() {
    let cluster = Cluster::start_tls(1).await;
    let tls = cluster.tls.clone().expect("a TLS cluster");
    let keys = |ca: &std::path::Path| {
        format!(
            "ca = {:?}\ncert = {:?}\nkey = {:?}\n",
            ca.display().to_string(),
            tls.cert.as_ref().expect("cert").display().to_string(),
            tls.key.as_ref().expect("key").display().to_string()
        )
    };
    let env = env_on_with(&cluster, "ha-tls", &keys(&tls.ca));
    let a = Coord::start(&env, &[]);
    assert_eq!(leader_of(&[&a], Duration::from_secs(20)).await, 0);
    let mut api = Api::new(connect(&a.url).await, None);
    api.create("t").await.expect("create over TLS to etcd");
    let lease = api.claim("t", "agent-1", 30_000).await.expect("claim");
    assert!(lease.token > 0);
    // The task's state is in etcd, under the project's name.
    let stored = cluster
        .client()
        .range_prefix("/automaton/ha-tls/")
        .await
        .expect("read etcd over TLS");
    assert!(
        stored
            .iter()
            .any(|kv| String::from_utf8_lossy(&kv.key).contains("/t/")),
        "{:?}",
        stored
            .iter()
            .map(|kv| String::from_utf8_lossy(&kv.key).into_owned())
            .collect::<Vec<_>>()
    );

    let wrong = env_on_with(
        &cluster,
        "ha-tls-wrong",
        &keys(&crate::cluster::fixture("other-ca.crt")),
    );
    let b = Coord::start(&wrong, &[]);
    assert!(
        b.wait_stderr("UnknownIssuer", Duration::from_secs(20)),
        "the certificate problem is not in the log:\n{}",
        b.stderr()
    );
    let s = ask(&b.url).await.expect_err("never leads");
    assert_eq!(s.code(), Code::Unavailable, "{s:?}");
}
