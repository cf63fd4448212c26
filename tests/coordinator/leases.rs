//! Leases over gRPC: claim, renew (Renew and KeepAlive), release, expiry, the events each
//! emits; 32 agents racing for one task; stale fencing tokens.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

use crate::harness::{Coord, Env, Events, expect_err, ms, poll};

/// Issue §Tests "claim, renew, release … and the events each one emits".
#[tokio::test(flavor = "multi_thread")]
async fn claim_renew_release_each_emit_their_event() {
    let coord = Coord::start(&Env::new(), &[]);
    let mut api = coord.api().await;
    let mut ev = Events::watch(&api).await;

    api.create("lease-me").await.expect("create");
    let e = ev.expect("task_created", "lease-me").await;
    assert_eq!(e.detail, "new");
    api.transition("lease-me", "research")
        .await
        .expect("research");
    let e = ev.expect("transitioned", "lease-me").await;
    assert_eq!(e.detail, "new → research");

    // Claim.
    let l = api
        .claim("lease-me", "agent-a", 30_000)
        .await
        .expect("claim");
    assert_eq!(
        (l.task.as_str(), l.agent.as_str(), l.state.as_str()),
        ("lease-me", "agent-a", "research")
    );
    assert!(l.token > 0 && !l.lease_id.is_empty() && !l.renewed, "{l:?}");
    assert_eq!(ms(&l.ttl), 30_000);
    assert!(
        ms(&l.remaining) > 29_000 && ms(&l.remaining) <= 30_000,
        "{l:?}"
    );
    let e = ev.expect("lease_granted", "lease-me").await;
    assert_eq!((e.agent.as_str(), e.token), ("agent-a", l.token));
    let held = api
        .lease_of("lease-me")
        .await
        .expect("GetTask shows the lease");
    assert_eq!(
        (held.lease_id.as_str(), held.token),
        (l.lease_id.as_str(), l.token)
    );
    let detail = api.get("lease-me").await.expect("get");
    assert_eq!(detail.summary.expect("summary").lease_holder, "agent-a");

    // Another agent is refused, and the refusal is an event naming the holder.
    let s = expect_err(
        api.claim("lease-me", "agent-b", 30_000).await,
        Code::FailedPrecondition,
        "is leased to agent-a",
        Some("refused"),
    );
    let e = ev.expect("lease_refused", "lease-me").await;
    assert_eq!(e.agent, "agent-b");
    assert_eq!(
        e.detail,
        s.message(),
        "the refusal event carries the message"
    );

    // The holder claiming again renews: same id and token.
    let again = api
        .claim("lease-me", "agent-a", 30_000)
        .await
        .expect("re-claim");
    assert!(again.renewed, "{again:?}");
    assert_eq!(
        (again.lease_id.as_str(), again.token),
        (l.lease_id.as_str(), l.token)
    );
    let e = ev.expect("lease_renewed", "lease-me").await;
    assert_eq!((e.agent.as_str(), e.token), ("agent-a", l.token));

    // Renew RPC.
    let r = api.renew(&l.lease_id, l.token).await.expect("renew");
    assert!(
        r.renewed && r.token == l.token && ms(&r.remaining) > 29_000,
        "{r:?}"
    );
    let e = ev.expect("lease_renewed", "lease-me").await;
    assert_eq!(e.token, l.token);
    // Renew without presenting the token (0) works for the live lease id.
    api.renew(&l.lease_id, 0)
        .await
        .expect("renew without token");
    ev.expect("lease_renewed", "lease-me").await;

    // KeepAlive stream renews it as well, and then reports its release as lost.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut stream = api
        .leases
        .keep_alive(ReceiverStream::new(rx))
        .await
        .expect("KeepAlive")
        .into_inner();
    tx.send(pb::KeepAliveRequest {
        lease_ids: vec![l.lease_id.clone()],
    })
    .await
    .expect("send");
    let m = next(&mut stream).await;
    assert_eq!(m.lease_id, l.lease_id);
    let kl = m.lease.expect("renewed lease on the stream");
    assert!(kl.renewed && kl.token == l.token, "{kl:?}");
    assert!(m.lost.is_none());
    ev.expect("lease_renewed", "lease-me").await;

    // Release.
    let rel = api.release(&l.lease_id, l.token).await.expect("release");
    assert_eq!(rel.released.expect("released lease").token, l.token);
    let e = ev.expect("lease_released", "lease-me").await;
    assert_eq!(
        (e.agent.as_str(), e.token, e.detail.as_str()),
        ("agent-a", l.token, "released")
    );
    assert!(
        api.lease_of("lease-me").await.is_none(),
        "released lease still live"
    );
    let m = next(&mut stream).await;
    let lost = m
        .lost
        .expect("release reported as lost on the KeepAlive stream");
    assert_eq!(
        (m.lease_id.as_str(), lost.reason.as_str()),
        (l.lease_id.as_str(), "released")
    );
    assert_eq!((lost.task.as_str(), lost.token), ("lease-me", l.token));

    // A lease id the server does not know is reported as lost (`unknown`).
    tx.send(pb::KeepAliveRequest {
        lease_ids: vec![l.lease_id.clone()],
    })
    .await
    .expect("send");
    let m = next(&mut stream).await;
    assert_eq!(m.lost.expect("lost").reason, "unknown");

    // The task can be claimed at once by another agent, with a higher token.
    let b = api
        .claim("lease-me", "agent-b", 30_000)
        .await
        .expect("claim after release");
    assert!(b.token > l.token);
    ev.expect("lease_granted", "lease-me").await;

    // Event sequence numbers are strictly increasing.
    let evs = ev.settle(Duration::from_millis(50)).await;
    assert!(evs.windows(2).all(|w| w[0].seq < w[1].seq), "{evs:#?}");
}

/// Issue §Semantics "Expiry by the coordinator's monotonic clock … an event is emitted, and
/// the task can be claimed again. The TTL is a minimum"; proto: KeepAlive "tells the client at
/// once … when any lease it has named is lost (expired …)".
#[tokio::test(flavor = "multi_thread")]
async fn short_ttl_expires_emits_lease_expired_and_keepalive_reports_lost() {
    let coord = Coord::start(&Env::new(), &["--lease-ttl-min", "10ms"]);
    let mut api = coord.api().await;
    api.claimable_task("short").await;
    let mut ev = Events::watch(&api).await;

    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut stream = api
        .leases
        .keep_alive(ReceiverStream::new(rx))
        .await
        .expect("KeepAlive")
        .into_inner();

    let l = api.claim("short", "agent-a", 300).await.expect("claim");
    assert_eq!(ms(&l.ttl), 300);
    // Name it once on the stream (this renews it), then go silent. The server renews after
    // this send, so the lease must outlive `sent + TTL`.
    let sent = Instant::now();
    tx.send(pb::KeepAliveRequest {
        lease_ids: vec![l.lease_id.clone()],
    })
    .await
    .expect("send");
    let m = next(&mut stream).await;
    assert!(m.lease.is_some(), "{m:?}");

    // Still live well inside the TTL (a minimum). The check means something only if its answer
    // came back inside the TTL: a stalled test machine must not turn into a false failure.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let live = api.lease_of("short").await.is_some();
    if sent.elapsed() < Duration::from_millis(280) {
        assert!(live, "expired before its TTL");
    }

    let m = tokio::time::timeout(Duration::from_secs(3), stream.message())
        .await
        .expect("lost within 3 s")
        .expect("stream ok")
        .expect("message");
    let lost_after = sent.elapsed();
    let lost = m.lost.expect("a lost notice");
    assert_eq!(
        (
            m.lease_id.as_str(),
            lost.reason.as_str(),
            lost.task.as_str(),
            lost.token
        ),
        (l.lease_id.as_str(), "expired", "short", l.token)
    );
    assert!(
        lost_after >= Duration::from_millis(300),
        "the TTL is a minimum: lost {lost_after:?} after the last renewal"
    );
    let e = ev.expect("lease_expired", "short").await;
    // An expired lease is removed from `.state.lock`.
    crate::harness::lock_view(&coord.env, "short", None).await;
    assert_eq!((e.agent.as_str(), e.token), ("agent-a", l.token));

    // Gone for readers, renewals and releases; claimable again.
    assert!(api.lease_of("short").await.is_none());
    expect_err(
        api.renew(&l.lease_id, l.token).await,
        Code::NotFound,
        "No live lease",
        Some("notfound"),
    );
    let b = api
        .claim("short", "agent-b", 30_000)
        .await
        .expect("claim after expiry");
    assert!(b.token > l.token);
    let g = ev.expect("lease_granted", "short").await;
    assert_eq!((g.agent.as_str(), g.token), ("agent-a", l.token));
    let g = ev.expect("lease_granted", "short").await;
    assert_eq!((g.agent.as_str(), g.token), ("agent-b", b.token));
    // The order of the feed: granted(a) < expired(a) < granted(b).
    assert!(e.seq < g.seq, "{e:?} {g:?}");

    // The `.state.lock` view follows: agent-b's lease.
    let env = coord.env.clone();
    poll(".state.lock shows agent-b", Duration::from_secs(3), || {
        let env = env.clone();
        async move {
            let text = String::from_utf8(env.task_file("short", ".state.lock")?).ok()?;
            text.contains("agent: agent-b").then_some(())
        }
    })
    .await;
}

/// Issue §Tests "claim … and the events each one emits": transitions, approvals and a lease
/// ended by a transition.
#[tokio::test(flavor = "multi_thread")]
async fn transition_under_lease_and_approve_emit_events() {
    let coord = Coord::start(&Env::new(), &[]);
    let env = coord.env.clone();
    let mut api = coord.api().await;
    let mut ev = Events::watch(&api).await;
    api.claimable_task("evt").await;
    ev.expect("task_created", "evt").await;
    ev.expect("transitioned", "evt").await;

    let l = api.claim("evt", "agent-a", 30_000).await.expect("claim");
    ev.expect("lease_granted", "evt").await;
    env.artifact("evt", "SPEC.md", "spec\n");
    // A KeepAlive stream that names the lease hears that the transition ended it.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut stream = api
        .leases
        .keep_alive(ReceiverStream::new(rx))
        .await
        .expect("KeepAlive")
        .into_inner();
    tx.send(pb::KeepAliveRequest {
        lease_ids: vec![l.lease_id.clone()],
    })
    .await
    .expect("send");
    assert!(next(&mut stream).await.lease.is_some());
    let t = api
        .transition_under("evt", "research:awaiting_approval", &l)
        .await
        .expect("transition under the lease");
    assert_eq!(
        (t.from.as_str(), t.to.as_str()),
        ("research", "research:awaiting_approval")
    );
    assert_eq!(
        t.released.expect("the lease ended with its phase").token,
        l.token
    );
    let e = ev.expect("transitioned", "evt").await;
    assert_eq!(e.detail, "research → research:awaiting_approval");
    assert_eq!(e.agent, "agent-a");
    let e = ev.expect("lease_released", "evt").await;
    assert_eq!((e.token, e.detail.as_str()), (l.token, "transitioned"));
    assert!(api.lease_of("evt").await.is_none());
    let m = next(&mut stream).await;
    let lost = m.lost.expect("lost notice");
    assert_eq!(
        (m.lease_id.as_str(), lost.reason.as_str(), lost.token),
        (l.lease_id.as_str(), "transitioned", l.token)
    );

    let a = api.approve("evt", "").await.expect("approve");
    assert_eq!(
        (a.from.as_str(), a.to.as_str()),
        ("research:awaiting_approval", "research:approved")
    );
    assert_eq!(
        a.approver, "user",
        "no tokens: the caller is the operator 'user'"
    );
    let e = ev.expect("approved", "evt").await;
    assert_eq!(e.detail, "research:awaiting_approval → research:approved");
    assert_eq!(api.state("evt").await, "research:approved");
}

async fn next(stream: &mut tonic::Streaming<pb::KeepAliveResponse>) -> pb::KeepAliveResponse {
    tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .expect("a KeepAlive response within 5 s")
        .expect("stream ok")
        .expect("stream open")
}

#[derive(Debug, Clone)]
struct Grant {
    round: usize,
    agent: String,
    token: u64,
    lease_id: String,
    /// Global order of the acknowledgement.
    acked: u64,
    /// Global order of its release's acknowledgement.
    released: u64,
}

/// Issue §Tests "32 agents racing for one task over 500 rounds: exactly one wins each round; a
/// history of every grant shows no overlap between holders and strictly increasing tokens".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn race_32_agents_500_rounds_one_winner_each_increasing_tokens() {
    const AGENTS: usize = 32;
    const ROUNDS: usize = 500;
    let coord = Coord::start(&Env::new(), &[]);
    let mut api = coord.api().await;
    api.claimable_task("contested").await;
    let mut ev = Events::watch(&api).await;

    let started = Instant::now();
    let clock = Arc::new(AtomicU64::new(0));
    let start = Arc::new(tokio::sync::Barrier::new(AGENTS));
    let claimed = Arc::new(tokio::sync::Barrier::new(AGENTS));
    let mut handles = Vec::new();
    for i in 0..AGENTS {
        let mut api = coord.api().await;
        let (clock, start, claimed) = (clock.clone(), start.clone(), claimed.clone());
        handles.push(tokio::spawn(async move {
            let agent = format!("agent-{i:02}");
            let mut grants = Vec::new();
            let mut refusals = 0usize;
            for round in 0..ROUNDS {
                start.wait().await;
                let won = match api.claim("contested", &agent, 60_000).await {
                    Ok(l) => {
                        let acked = clock.fetch_add(1, Ordering::SeqCst);
                        assert!(
                            !l.renewed,
                            "{agent} round {round}: a fresh grant, not a renewal"
                        );
                        assert_eq!(l.agent, agent);
                        Some(Grant {
                            round,
                            agent: agent.clone(),
                            token: l.token,
                            lease_id: l.lease_id,
                            acked,
                            released: 0,
                        })
                    }
                    Err(s) => {
                        assert_eq!(s.code(), Code::FailedPrecondition, "{agent}: {s:?}");
                        assert!(s.message().contains("is leased to agent-"), "{s:?}");
                        refusals += 1;
                        None
                    }
                };
                // Every claim of this round is answered before the winner lets go.
                claimed.wait().await;
                if let Some(mut g) = won {
                    api.release(&g.lease_id, g.token)
                        .await
                        .unwrap_or_else(|s| panic!("{agent} release round {round}: {s:?}"));
                    g.released = clock.fetch_add(1, Ordering::SeqCst);
                    grants.push(g);
                }
            }
            (grants, refusals)
        }));
    }
    let mut grants = Vec::new();
    let mut refusals = 0;
    for h in handles {
        let (g, r) = h.await.expect("agent task");
        grants.extend(g);
        refusals += r;
    }
    let elapsed = started.elapsed();
    eprintln!("race: {AGENTS} agents × {ROUNDS} rounds in {elapsed:?}");

    // Exactly one winner per round.
    grants.sort_by_key(|g| g.round);
    let rounds: Vec<usize> = grants.iter().map(|g| g.round).collect();
    assert_eq!(
        rounds,
        (0..ROUNDS).collect::<Vec<_>>(),
        "one winner in every round, never two"
    );
    assert_eq!(refusals, ROUNDS * (AGENTS - 1));
    // Strictly increasing tokens, unique lease ids.
    assert!(
        grants.windows(2).all(|w| w[0].token < w[1].token),
        "tokens must strictly increase round after round"
    );
    let ids: HashSet<&str> = grants.iter().map(|g| g.lease_id.as_str()).collect();
    assert_eq!(ids.len(), ROUNDS, "lease ids are unique per grant");
    // No overlap: every holder's release was acknowledged before the next grant.
    for w in grants.windows(2) {
        assert!(
            w[0].acked < w[0].released && w[0].released < w[1].acked,
            "holders overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
    let winners: HashSet<&str> = grants.iter().map(|g| g.agent.as_str()).collect();
    eprintln!("race: {} distinct winners", winners.len());

    // The server's own history: granted and released strictly alternate, same token each pair.
    ev.find("the last release", Duration::from_secs(10), |e| {
        e.kind == "lease_released" && e.token == grants[ROUNDS - 1].token
    })
    .await;
    let history: Vec<&pb::Event> = ev
        .all
        .iter()
        .filter(|e| e.kind != "lease_refused")
        .collect();
    if history.iter().any(|e| e.kind == "lagged") {
        eprintln!("race: the event watcher lagged; server history check skipped");
    } else {
        eprintln!("race: server history of {} events checked", history.len());
        assert_eq!(history.len(), 2 * ROUNDS, "granted + released per round");
        for (pair, g) in history.chunks(2).zip(&grants) {
            assert_eq!(
                (pair[0].kind.as_str(), pair[0].token, pair[0].agent.as_str()),
                ("lease_granted", g.token, g.agent.as_str())
            );
            assert_eq!(
                (pair[1].kind.as_str(), pair[1].token),
                ("lease_released", g.token)
            );
        }
    }
    assert!(api.lease_of("contested").await.is_none());
}

/// Issue §Semantics "Fencing … a stale or foreign one is refused with FAILED_PRECONDITION and
/// changes nothing"; §Tests "a stale token after expiry and re-grant is refused and nothing
/// changes".
#[tokio::test(flavor = "multi_thread")]
async fn stale_token_after_expiry_and_regrant_is_refused_and_changes_nothing() {
    let coord = Coord::start(&Env::new(), &["--lease-ttl-min", "10ms"]);
    let env = coord.env.clone();
    let mut api = coord.api().await;
    api.claimable_task("fenced").await;
    env.artifact("fenced", "SPEC.md", "spec\n");

    let old = api.claim("fenced", "agent-a", 300).await.expect("claim a");
    poll("agent-a's lease expires", Duration::from_secs(3), || {
        let mut api = api.clone();
        async move { api.lease_of("fenced").await.is_none().then_some(()) }
    })
    .await;
    let new = api
        .claim("fenced", "agent-b", 60_000)
        .await
        .expect("claim b");
    assert!(new.token > old.token);
    // Let the `.state.lock` view catch up with the new grant before taking the snapshot.
    let want = format!("token: {}", new.token);
    poll(
        ".state.lock shows agent-b's token",
        Duration::from_secs(3),
        || {
            let env = env.clone();
            let want = want.clone();
            async move {
                let text = String::from_utf8(env.task_file("fenced", ".state.lock")?).ok()?;
                text.contains(&want).then_some(())
            }
        },
    )
    .await;
    let state = env.task_file("fenced", ".state").expect(".state");
    let lock = env.task_file("fenced", ".state.lock").expect(".state.lock");
    let before = env.snapshot();

    // Transition with the old lease (its own id and token).
    let s = expect_err(
        api.transition_under("fenced", "research:awaiting_approval", &old)
            .await,
        Code::FailedPrecondition,
        &format!("Fencing token {} is stale", old.token),
        Some("refused"),
    );
    assert!(
        s.message().contains(&format!("has token {}", new.token)),
        "{s:?}"
    );
    // The old token with the new lease id, and the new token with the old lease id.
    expect_err(
        api.transition_as(
            "fenced",
            "research:awaiting_approval",
            "agent-a",
            &new.lease_id,
            old.token,
        )
        .await,
        Code::FailedPrecondition,
        "is stale",
        Some("refused"),
    );
    expect_err(
        api.transition_as(
            "fenced",
            "research:awaiting_approval",
            "agent-b",
            &old.lease_id,
            new.token,
        )
        .await,
        Code::FailedPrecondition,
        "is stale",
        Some("refused"),
    );
    // Renew / Release with the old lease id: no such live lease.
    expect_err(
        api.renew(&old.lease_id, old.token).await,
        Code::NotFound,
        "No live lease",
        Some("notfound"),
    );
    expect_err(
        api.release(&old.lease_id, old.token).await,
        Code::NotFound,
        "No live lease",
        Some("notfound"),
    );
    // Renew / Release of the live lease id with the stale token.
    expect_err(
        api.renew(&new.lease_id, old.token).await,
        Code::FailedPrecondition,
        &format!("Fencing token {} is stale", old.token),
        Some("refused"),
    );
    expect_err(
        api.release(&new.lease_id, old.token).await,
        Code::FailedPrecondition,
        &format!("Fencing token {} is stale", old.token),
        Some("refused"),
    );

    // Nothing changed: files, state, the live lease.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        env.task_file("fenced", ".state").as_deref(),
        Some(&state[..])
    );
    assert_eq!(
        env.task_file("fenced", ".state.lock").as_deref(),
        Some(&lock[..])
    );
    assert!(
        before == env.snapshot(),
        "a refused stale call changed files"
    );
    let live = api
        .lease_of("fenced")
        .await
        .expect("agent-b still holds it");
    assert_eq!(
        (live.agent.as_str(), live.token, live.lease_id.as_str()),
        ("agent-b", new.token, new.lease_id.as_str())
    );
    assert_eq!(api.state("fenced").await, "research");

    // The real holder can still use its lease.
    api.transition_under("fenced", "research:awaiting_approval", &new)
        .await
        .expect("the current holder transitions");
}

/// Design §2 "the lease is mirrored to `.state.lock` … so file readers see who holds what":
/// the views stay right while other tasks change at the same time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_views_follow_claims_under_concurrent_task_changes() {
    const TASKS: usize = 40;
    const ROUNDS: usize = 10;
    let coord = Coord::start(&Env::new(), &[]);
    let env = coord.env.clone();
    let mut api = coord.api().await;
    for i in 0..TASKS {
        api.claimable_task(&format!("view-{i}")).await;
    }
    // One client changes tasks (each change takes the store's writer lock) while others claim.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut changers = Vec::new();
    for k in 0..2 {
        let mut api = coord.api().await;
        let stop = stop.clone();
        changers.push(tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) && n < 2_000 {
                api.create(&format!("other-{k}-{n}")).await.expect("create");
                n += 1;
            }
            n
        }));
    }
    let mut claimers = Vec::new();
    for c in 0..4 {
        let mut api = coord.api().await;
        claimers.push(tokio::spawn(async move {
            let mut held = Vec::new();
            let agent = format!("agent-{c}");
            for i in (c..TASKS).step_by(4) {
                let task = format!("view-{i}");
                // Claimed and released a few times (a view write each), then kept.
                for _ in 0..ROUNDS {
                    let l = api.claim(&task, &agent, 60_000).await.expect("claim");
                    api.release(&l.lease_id, l.token).await.expect("release");
                }
                held.push(api.claim(&task, &agent, 60_000).await.expect("claim"));
            }
            held
        }));
    }
    let mut held = Vec::new();
    for c in claimers {
        held.extend(c.await.expect("claimer"));
    }
    stop.store(true, Ordering::SeqCst);
    let mut created = 0;
    for c in changers {
        created += c.await.expect("changer");
    }
    eprintln!(
        "views: {} claims during {created} task creations",
        held.len() * (ROUNDS + 1)
    );
    // Give the view writer time to catch up, then compare every view with its lease.
    let deadline = Instant::now() + Duration::from_secs(2);
    let wrong = loop {
        let wrong: Vec<String> = held
            .iter()
            .filter_map(|l| {
                let text = env
                    .task_file(&l.task, ".state.lock")
                    .map(|b| String::from_utf8_lossy(&b).into_owned());
                let ok = text.as_deref().is_some_and(|t| {
                    automaton_store::Lease::parse(t).is_ok_and(|v| {
                        v.token == l.token
                            && v.agent.as_str() == l.agent
                            && v.lease_id == l.lease_id
                    })
                });
                (!ok).then(|| format!("{} (token {}): .state.lock = {text:?}", l.task, l.token))
            })
            .collect();
        if wrong.is_empty() || Instant::now() > deadline {
            break wrong;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let warnings: Vec<String> = coord
        .stderr()
        .lines()
        .filter(|l| l.contains("lease view"))
        .map(str::to_string)
        .collect();
    assert!(
        wrong.is_empty() && warnings.is_empty(),
        "{} of {} lease views never written:\n{}\ncoordinator warnings:\n{}",
        wrong.len(),
        held.len(),
        wrong.join("\n"),
        warnings.join("\n")
    );
    // The coordinator itself is right all along.
    for l in held.iter().take(10) {
        assert_eq!(api.lease_of(&l.task).await.expect("live").token, l.token);
    }
}

/// Issue §Semantics "Separation of duties … enforced here atomically at claim time": claims of
/// the implement phase on many tasks at once, while other tasks change, each record their own
/// implementer in their own task, and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_implement_claims_record_each_implementer_in_its_own_task() {
    const TASKS: usize = 24;
    let coord = Coord::start(&Env::new(), &[]);
    let env = coord.env.clone();
    let mut api = coord.api().await;
    for i in 0..TASKS {
        api.approved_research(&env, &format!("impl-{i}"), Some("implement"))
            .await;
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let changer = {
        let mut api = coord.api().await;
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) && n < 1_000 {
                api.create(&format!("busy-{n}")).await.expect("create");
                n += 1;
            }
        })
    };
    let mut claimers = Vec::new();
    for i in 0..TASKS {
        let mut api = coord.api().await;
        claimers.push(tokio::spawn(async move {
            let task = format!("impl-{i}");
            let agent = format!("coder-{i}");
            let r = api.claim(&task, &agent, 60_000).await;
            (task, agent, r)
        }));
    }
    let mut failures = Vec::new();
    let mut granted = Vec::new();
    for c in claimers {
        let (task, agent, r) = c.await.expect("claimer");
        match r {
            Ok(l) => granted.push((task, agent, l)),
            Err(s) => failures.push(format!("{task} by {agent}: {s:?}")),
        }
    }
    stop.store(true, Ordering::SeqCst);
    changer.await.expect("changer");
    let mut wrong = Vec::new();
    let mut api = coord.api().await;
    for (task, agent, _) in &granted {
        let got = api.get(task).await.expect("get").implementers;
        if got != [agent.as_str()] {
            wrong.push(format!(
                "{task}: .state.implementer = {got:?}, want [{agent}]"
            ));
        }
    }
    assert!(
        failures.is_empty() && wrong.is_empty(),
        "claims failed:\n{}\nwrong implementer records:\n{}",
        failures.join("\n"),
        wrong.join("\n")
    );
}
