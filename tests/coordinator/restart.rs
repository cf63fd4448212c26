//! Durability across restarts: `kill -9` under load, SIGTERM, grace periods, fencing tokens.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use automaton_store::{Approval, Lease};
use automaton_workflow::{AgentId, State};
use tonic::Code;

use crate::harness::{Api, Coord, Env, poll};

/// What a client knows of one of its grants.
#[derive(Debug, Clone)]
struct Acked {
    agent: String,
    task: String,
    token: u64,
    lease_id: String,
    /// The release request was sent (it may or may not have been carried out).
    release_sent: bool,
    /// The release was acknowledged.
    released: bool,
}

type History = Arc<Mutex<Vec<Acked>>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A client looping claim → (short pause) → release over `tasks` until the coordinator goes
/// away, recording every acknowledged claim and release.
async fn churn(mut api: Api, agent: String, tasks: Vec<String>, history: History, ttl_ms: u64) {
    let mut i = 0usize;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let task = &tasks[i % tasks.len()];
        i += 1;
        let l = match api.claim(task, &agent, ttl_ms).await {
            Ok(l) => l,
            Err(s) if s.code() == Code::FailedPrecondition => continue,
            Err(_) => return, // the coordinator is gone
        };
        assert_eq!(l.agent, agent);
        let idx = {
            let mut h = lock(&history);
            h.push(Acked {
                agent: agent.clone(),
                task: task.clone(),
                token: l.token,
                lease_id: l.lease_id.clone(),
                release_sent: false,
                released: false,
            });
            h.len() - 1
        };
        // Hold it a moment: a kill may land while it is held.
        tokio::time::sleep(Duration::from_millis((i % 4) as u64)).await;
        lock(&history)[idx].release_sent = true;
        match api.release(&l.lease_id, l.token).await {
            Ok(_) => lock(&history)[idx].released = true,
            Err(s) if matches!(s.code(), Code::FailedPrecondition | Code::NotFound) => {
                panic!("{agent}: release of its own live lease refused: {s:?}")
            }
            Err(_) => return,
        }
    }
}

/// Parses every state file of every task: none may be torn. Returns the leases on disk.
fn assert_no_torn_file(env: &Env) -> BTreeMap<String, Lease> {
    let mut leases = BTreeMap::new();
    for task in env.task_names() {
        let read = |name: &str| {
            env.task_file(&task, name).map(|b| {
                String::from_utf8(b).unwrap_or_else(|_| panic!("{task}/{name}: not UTF-8"))
            })
        };
        let state = read(".state").unwrap_or_else(|| panic!("{task}: .state missing"));
        state
            .trim()
            .parse::<State>()
            .unwrap_or_else(|_| panic!("{task}: torn .state {state:?}"));
        if let Some(text) = read(".state.lock") {
            let l = Lease::parse(&text)
                .unwrap_or_else(|e| panic!("{task}: torn .state.lock ({e}): {text:?}"));
            leases.insert(task.clone(), l);
        }
        if let Some(text) = read(".state.approvals") {
            Approval::parse_log(&text)
                .unwrap_or_else(|e| panic!("{task}: torn .state.approvals {e:?}: {text:?}"));
        }
        if let Some(text) = read(".state.implementer") {
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                line.trim()
                    .parse::<AgentId>()
                    .unwrap_or_else(|_| panic!("{task}: torn .state.implementer: {text:?}"));
            }
        }
    }
    leases
}

/// Issue §Semantics "Durability. A claim or release that was acknowledged survives kill -9 of
/// the coordinator at any instant" and "No task is ever held by two agents at once, before or
/// after a restart"; §Tests "kill -9 the coordinator during a load of claims and releases,
/// restart it: no task with two live holders, no torn file, every approval intact, every
/// acknowledged claim still there".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_under_claim_release_load_loses_nothing_acknowledged() {
    const CLIENTS: usize = 8;
    const TASKS: usize = 6;
    const TTL_MS: u64 = 2_500;
    const ARGS: &[&str] = &["--grace-period", "1s"];
    let env = Env::new();
    let mut coord = Coord::start(&env, ARGS);
    let mut api = coord.api().await;

    // An approval on record before the load: it must come through byte for byte.
    api.approved_research(&env, "approved-before", None).await;
    let approvals = env
        .task_file("approved-before", ".state.approvals")
        .expect("approval log");
    let approved_state = env.task_file("approved-before", ".state").expect(".state");
    // An implementer record as well.
    api.approved_research(&env, "implemented", Some("implement"))
        .await;
    api.claim("implemented", "agent-impl", 60_000)
        .await
        .expect("claim implement");
    let implementer = api.get("implemented").await.expect("get").implementers;
    assert_eq!(implementer, ["agent-impl"]);

    let mut max_token_before = 0u64;
    for cycle in 0..2 {
        let tasks: Vec<String> = (0..TASKS).map(|i| format!("load-{cycle}-{i}")).collect();
        let holds: Vec<String> = (0..3).map(|i| format!("hold-{cycle}-{i}")).collect();
        for t in tasks.iter().chain(&holds) {
            api.claimable_task(t).await;
        }
        let history: History = Arc::new(Mutex::new(Vec::new()));
        let mut clients = Vec::new();
        for c in 0..CLIENTS {
            let api = coord.api().await;
            let mut mine = tasks.clone();
            mine.rotate_left(c % TASKS);
            clients.push(tokio::spawn(churn(
                api,
                format!("agent-{c}"),
                mine,
                history.clone(),
                TTL_MS,
            )));
        }
        // Holders claim now and then during the load and never release.
        let mut held = Vec::new();
        let load_started = Instant::now();
        for (i, t) in holds.iter().enumerate() {
            tokio::time::sleep(Duration::from_millis(150)).await;
            let l = api
                .claim(t, &format!("holder-{i}"), TTL_MS)
                .await
                .expect("holder claims during the load");
            held.push(l);
        }
        tokio::time::sleep(Duration::from_millis(200 + 150 * cycle as u64)).await;
        coord.kill9();
        let killed_after = load_started.elapsed();
        for c in clients {
            tokio::time::timeout(Duration::from_secs(40), c)
                .await
                .expect("clients stop once the coordinator is gone")
                .expect("client task");
        }
        let h = lock(&history).clone();
        let released = h.iter().filter(|a| a.released).count();
        eprintln!(
            "kill -9 cycle {cycle}: after {killed_after:?}, {} acknowledged claims, {released} acknowledged releases",
            h.len()
        );
        assert!(
            h.len() >= 20,
            "too little load before the kill: {}",
            h.len()
        );

        // Nothing torn even before the restart repairs anything.
        assert_no_torn_file(&env);

        coord = Coord::start(&env, ARGS);
        api = coord.api().await;
        let on_disk = assert_no_torn_file(&env);

        // Approvals and implementer records intact, byte for byte.
        assert_eq!(
            env.task_file("approved-before", ".state.approvals")
                .as_deref(),
            Some(&approvals[..]),
            "the approval log changed"
        );
        assert_eq!(
            env.task_file("approved-before", ".state").as_deref(),
            Some(&approved_state[..])
        );
        assert_eq!(
            api.get("implemented").await.expect("get").implementers,
            implementer,
            "the implementer is known after kill -9"
        );

        // Every acknowledged claim that was never let go is still there: same agent, same token.
        for l in &held {
            let now = api.lease_of(&l.task).await.unwrap_or_else(|| {
                panic!("acknowledged claim of {} lost by kill -9: {l:?}", l.task)
            });
            assert_eq!(
                (now.agent.as_str(), now.token, now.lease_id.as_str()),
                (l.agent.as_str(), l.token, l.lease_id.as_str())
            );
            max_token_before = max_token_before.max(l.token);
        }
        let mut latest: HashMap<&str, &Acked> = HashMap::new();
        for a in &h {
            max_token_before = max_token_before.max(a.token);
            if latest
                .get(a.task.as_str())
                .is_none_or(|b| b.token < a.token)
            {
                latest.insert(&a.task, a);
            }
        }
        let mut must_hold = Vec::new();
        for task in &tasks {
            let live = api.lease_of(task).await;
            // One holder at most, and the files agree with the coordinator.
            let file = on_disk.get(task);
            match (&live, file) {
                (Some(l), Some(f)) => assert_eq!(
                    (l.agent.as_str(), l.token, l.lease_id.as_str()),
                    (f.agent.as_str(), f.token, f.lease_id.as_str()),
                    "{task}: .state.lock disagrees with the coordinator"
                ),
                (None, None) => {}
                (l, f) => panic!("{task}: coordinator {l:?} but .state.lock {f:?}"),
            }
            let Some(last) = latest.get(task.as_str()) else {
                continue;
            };
            match &live {
                // Never released: it must survive.
                _ if !last.release_sent => {
                    let l = live.as_ref().unwrap_or_else(|| {
                        panic!("{task}: acknowledged claim {last:?} (release never sent) lost by kill -9")
                    });
                    assert_eq!(
                        (l.agent.as_str(), l.token, l.lease_id.as_str()),
                        (last.agent.as_str(), last.token, last.lease_id.as_str()),
                        "{task}: the acknowledged claim must still stand"
                    );
                    must_hold.push(l.clone());
                }
                // Release sent but not acknowledged: either it happened or the lease stands.
                Some(l) if !last.released && l.token == last.token => {
                    assert_eq!(l.agent, last.agent);
                    must_hold.push(l.clone());
                }
                // Anything standing now was granted after the last acknowledged claim.
                Some(l) => assert!(
                    l.token > last.token,
                    "{task}: live lease {l:?} is older than the acknowledged claim {last:?}"
                ),
                None => {}
            }
        }
        eprintln!(
            "kill -9 cycle {cycle}: {} held claims and {} unreleased acknowledged claims checked after the restart",
            held.len(),
            must_hold.len()
        );
        // And it stays with its holder until it expires.
        if cycle == 1 {
            let mut all = must_hold.clone();
            all.extend(held.iter().cloned());
            let deadline = Instant::now() + Duration::from_millis(TTL_MS + 4_000);
            let mut remaining: Vec<_> = all;
            while !remaining.is_empty() {
                assert!(
                    Instant::now() < deadline,
                    "leases never expired: {remaining:?}"
                );
                let mut still = Vec::new();
                for l in remaining {
                    match api.lease_of(&l.task).await {
                        Some(now) => {
                            assert_eq!(
                                (now.agent.as_str(), now.token),
                                (l.agent.as_str(), l.token),
                                "{}: holder changed before expiry",
                                l.task
                            );
                            still.push(l);
                        }
                        None => {
                            let after = coord.started.elapsed();
                            assert!(
                                after >= Duration::from_millis(TTL_MS - 500),
                                "{}: expired {after:?} after the restart, before its TTL",
                                l.task
                            );
                        }
                    }
                }
                remaining = still;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }

        // Tokens after the restart are above every token before it.
        let fresh = format!("fresh-{cycle}");
        api.claimable_task(&fresh).await;
        let l = api
            .claim(&fresh, "agent-new", 1_000)
            .await
            .expect("claim after restart");
        let disk_max = on_disk.values().map(|l| l.token).max().unwrap_or(0);
        assert!(
            l.token > max_token_before && l.token > disk_max,
            "token {} after restart is not above {max_token_before} (disk {disk_max})",
            l.token
        );
        max_token_before = l.token;
    }
}

/// Issue §Semantics "Shutdown. SIGTERM drains in-flight requests, keeps leases on disk for the
/// next start, and exits 0" and "Restart. On start the coordinator loads live leases … and
/// gives each at least a configurable grace period".
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_exits_0_keeps_leases_and_grace_period_extends_them() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &["--lease-ttl-min", "10ms"]);
    let mut api = coord.api().await;
    api.claimable_task("kept").await;
    api.claimable_task("graced").await;
    let kept = api.claim("kept", "agent-a", 60_000).await.expect("claim");
    let graced = api
        .claim("graced", "agent-b", 500)
        .await
        .expect("claim 500ms");
    drop(api);
    let t0 = Instant::now();
    let status = coord.terminate();
    let stop = t0.elapsed();
    assert!(
        status.success(),
        "SIGTERM must exit 0: {status:?}\n{}",
        coord.stderr()
    );
    assert_eq!(status.code(), Some(0));
    eprintln!("sigterm: exited in {stop:?}");
    assert!(
        stop < Duration::from_millis(400),
        "shutdown took {stop:?}: longer than the 500 ms lease, which may have expired meanwhile"
    );

    coord = Coord::start(&env, &["--grace-period", "3s"]);
    let restarted = coord.started;
    let mut api = coord.api().await;
    let l = api
        .lease_of("kept")
        .await
        .expect("the lease survives SIGTERM");
    assert_eq!(
        (
            l.agent.as_str(),
            l.token,
            l.lease_id.as_str(),
            l.state.as_str()
        ),
        ("agent-a", kept.token, kept.lease_id.as_str(), "research")
    );
    assert!(crate::harness::ms(&l.remaining) > 50_000, "{l:?}");
    api.renew(&kept.lease_id, kept.token)
        .await
        .expect("its holder renews after the restart");

    // 500 ms TTL, 3 s grace: still live 1 s after the restart.
    tokio::time::sleep_until((restarted + Duration::from_secs(1)).into()).await;
    let g = api
        .lease_of("graced")
        .await
        .expect("a 500 ms lease is still live 1 s after a restart with a 3 s grace");
    assert_eq!((g.agent.as_str(), g.token), ("agent-b", graced.token));
    assert!(crate::harness::ms(&g.remaining) >= 1_000, "{g:?}");
    // … then expires, around the end of the grace.
    let mut api2 = api.clone();
    poll("the graced lease expires", Duration::from_secs(6), || {
        let mut api = api2.clone();
        async move { api.lease_of("graced").await.is_none().then_some(()) }
    })
    .await;
    let gone = restarted.elapsed();
    assert!(
        gone >= Duration::from_millis(2_500) && gone < Duration::from_millis(5_000),
        "expired {gone:?} after the restart; the grace was 3 s"
    );
    let b = api2
        .claim("graced", "agent-c", 60_000)
        .await
        .expect("claimable again");
    assert!(b.token > kept.token);
    assert!(api.lease_of("kept").await.is_some());
}

/// Issue §Semantics "Fencing. Tokens strictly increase per project, also across restarts".
#[tokio::test(flavor = "multi_thread")]
async fn fencing_tokens_increase_across_restarts() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    for t in ["one", "two", "three", "four"] {
        api.claimable_task(t).await;
    }
    let t1 = api
        .claim("one", "agent-a", 60_000)
        .await
        .expect("claim")
        .token;
    let t1b = api
        .claim("four", "agent-a", 1_000)
        .await
        .expect("claim")
        .token;
    assert!(t1b > t1);

    coord.restart(&["--lease-ttl-min", "10ms"]);
    let mut api = coord.api().await;
    let t2 = api
        .claim("two", "agent-b", 60_000)
        .await
        .expect("claim")
        .token;
    assert!(t2 > t1b, "after SIGTERM: {t2} ≤ {t1b}");
    assert_eq!(api.lease_of("one").await.expect("kept").token, t1);

    coord.restart_after_kill(&["--lease-ttl-min", "10ms"]);
    let mut api = coord.api().await;
    let t3 = api
        .claim("three", "agent-c", 60_000)
        .await
        .expect("claim")
        .token;
    assert!(t3 > t2, "after kill -9: {t3} ≤ {t2}");
    let l = api.lease_of("one").await.expect("kept");
    api.release(&l.lease_id, l.token).await.expect("release");
    let t4 = api
        .claim("one", "agent-d", 60_000)
        .await
        .expect("claim")
        .token;
    assert!(t4 > t3);
}

/// design §2 "Never grant one task to two holders" / docs "a promise made before the crash is
/// never shortened": a holder that re-claims with a longer TTL keeps it across `kill -9`,
/// although the log first recorded the shorter one.
#[tokio::test(flavor = "multi_thread")]
async fn longer_ttl_from_a_reclaim_survives_kill_9() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &["--grace-period", "1s", "--lease-ttl-min", "10ms"]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let first = api.claim("t", "agent-a", 300).await.expect("claim");
    let again = api.claim("t", "agent-a", 20_000).await.expect("re-claim");
    assert!(again.renewed);
    assert_eq!(
        (again.lease_id.as_str(), again.token),
        (first.lease_id.as_str(), first.token)
    );
    coord.restart_after_kill(&["--grace-period", "1s", "--lease-ttl-min", "10ms"]);
    let mut api = coord.api().await;
    // Past both the first TTL and the grace period: only the longer TTL keeps it alive.
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let l = api
        .lease_of("t")
        .await
        .expect("the 20 s lease must survive the restart");
    assert_eq!((l.agent.as_str(), l.token), ("agent-a", first.token));
    assert!(
        api.claim("t", "agent-b", 60_000).await.is_err(),
        "nobody else may take it"
    );
}

/// Issue §Restart "loads live leases from the .state.lock files": a lock file that cannot be
/// read is a broken view, not a lease — the coordinator starts, and removes it.
#[tokio::test(flavor = "multi_thread")]
async fn corrupt_state_lock_is_repaired_at_start() {
    let env = Env::new();
    env.cli(&["--create-task", "t"]).ok();
    env.cli(&["--task", "t", "--transition", "research"]).ok();
    env.artifact("t", ".state.lock", "agent: a\nthis is not a lease\n");
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    assert!(api.lease_of("t").await.is_none());
    assert!(
        env.task_file("t", ".state.lock").is_none(),
        "the corrupt view must be removed at start"
    );
    api.claim("t", "agent-a", 60_000)
        .await
        .expect("claimable again");
}

/// docs/coordinator.md "the `.state.lock` files are the log's materialised view": a view that
/// the start-up repair wrote is removed when its lease ends after the restart.
#[tokio::test(flavor = "multi_thread")]
async fn view_written_at_start_is_removed_when_its_lease_ends() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let l = api.claim("t", "agent-a", 60_000).await.expect("claim");
    crate::harness::lock_view(&env, "t", Some(l.token)).await;
    coord.restart(&[]);
    let mut api = coord.api().await;
    crate::harness::lock_view(&env, "t", Some(l.token)).await;
    api.release(&l.lease_id, l.token)
        .await
        .expect("release after the restart");
    crate::harness::lock_view(&env, "t", None).await;
}

/// docs/coordinator.md "its size stays bounded by the live leases": with a small threshold the
/// log is rewritten while the coordinator runs, and the rewrites lose nothing acknowledged —
/// leases held across many of them survive `kill -9`.
#[tokio::test(flavor = "multi_thread")]
async fn lease_log_is_compacted_while_running_and_keeps_live_leases_across_kill_9() {
    let env = Env::with_config("log_compact_bytes = 4096\n");
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    for t in ["held-one", "held-two", "churn"] {
        api.claimable_task(t).await;
    }
    let one = api
        .claim("held-one", "agent-a", 60_000)
        .await
        .expect("claim");
    let two = api
        .claim("held-two", "agent-b", 60_000)
        .await
        .expect("claim");
    let log = env.root().join(".automaton").join("leases.wal");
    let mut written = 0;
    for _ in 0..400 {
        let l = api.claim("churn", "agent-c", 60_000).await.expect("claim");
        api.release(&l.lease_id, l.token).await.expect("release");
        // A grant line and an end line, as the log spells them.
        written += format!(
            "G\tchurn\tagent-c\t{}\t{}\t60000\tresearch\nE\t{}\n",
            l.lease_id, l.token, l.lease_id
        )
        .len();
    }
    // The sweeper (every 20 ms) decides about rewrites: give it a few rounds.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The records end where the zeroed space kept ahead of them begins.
    let bytes = std::fs::read(&log).expect("the log exists");
    let size = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    assert!(
        written > 20_000,
        "the churn wrote {written} bytes of records"
    );
    assert!(
        size < 8192,
        "the log holds {size} bytes after {written} bytes of records: not compacted"
    );
    let text = String::from_utf8_lossy(&bytes[..size]);
    assert!(
        text.contains(&one.lease_id) && text.contains(&two.lease_id),
        "the rewritten log must hold the live leases:\n{text}"
    );

    coord.restart_after_kill(&[]);
    let mut api = coord.api().await;
    for (task, held) in [("held-one", &one), ("held-two", &two)] {
        let l = api
            .lease_of(task)
            .await
            .unwrap_or_else(|| panic!("{task}'s lease must survive the rewrites and kill -9"));
        assert_eq!(
            (l.lease_id.as_str(), l.token),
            (held.lease_id.as_str(), held.token)
        );
    }
    assert!(
        api.lease_of("churn").await.is_none(),
        "every churn lease was released"
    );
}
