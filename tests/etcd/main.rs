//! `automaton-etcd` against real etcd clusters started by `cluster.rs`: KV, transactions and
//! their limits, authentication, leader election, fenced writes, and the faults HA has to
//! survive (kill -9 of the etcd leader, a frozen member). It must not mock etcd, and each
//! test names what it checks. Timings are printed (`--nocapture`) for the record.

mod cluster;

use std::sync::Arc;
use std::time::{Duration, Instant};

use automaton_etcd::pb::auth_client::AuthClient;
use automaton_etcd::pb::{AuthEnableRequest, AuthUserAddRequest, AuthUserGrantRoleRequest};
use automaton_etcd::{
    Client, Cmp, Compare, Config, Election, Error, Leadership, MAX_TXN_OPS, Op, OpResponse,
    TlsConfig, Txn, leader,
};
use cluster::Cluster;
use tokio::sync::Mutex;

const KEY: &str = "/automaton/test/leader";
const TTL: Duration = Duration::from_secs(3);

fn election(client: &Client, value: &str) -> Election {
    Election::new(client.clone(), KEY, value, TTL).expect("election")
}

/// Campaigns, failing the test after `within`.
async fn win(e: &Election, within: Duration) -> Leadership {
    tokio::time::timeout(within, e.campaign())
        .await
        .expect("campaign within time")
        .expect("campaign")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_put_get_range_txn_against_a_real_cluster() {
    let cluster = Cluster::three().await;
    let c = cluster.client();
    assert_eq!(c.get("/kv/none").await.expect("get"), None);

    // Puts and what etcd keeps about a key.
    let r1 = c.put("/kv/a", "1", None).await.expect("put");
    let r2 = c.put("/kv/a", "2", None).await.expect("put again");
    assert!(r2 > r1);
    let a = c.get("/kv/a").await.expect("get").expect("present");
    assert_eq!(
        (
            a.key.as_slice(),
            a.value.as_slice(),
            a.create_revision,
            a.mod_revision,
            a.version,
            a.lease
        ),
        (&b"/kv/a"[..], &b"2"[..], r1, r2, 2, 0)
    );

    // A key on a lease goes with the lease.
    let lease = c.grant(Duration::from_secs(10)).await.expect("grant");
    c.put("/kv/leased", "x", Some(lease))
        .await
        .expect("put on lease");
    assert_eq!(
        c.get("/kv/leased")
            .await
            .expect("get")
            .expect("present")
            .lease,
        lease
    );
    assert!(c.keep_alive_once(lease).await.expect("keepalive") > 0);
    assert!(c.time_to_live(lease).await.expect("ttl").is_some());
    c.revoke(lease).await.expect("revoke");
    assert_eq!(c.get("/kv/leased").await.expect("get"), None);
    assert_eq!(
        c.keep_alive_once(lease)
            .await
            .expect("keepalive of a gone lease"),
        0
    );
    assert_eq!(c.time_to_live(lease).await.expect("ttl"), None);
    c.revoke(lease).await.expect("revoking twice is fine");

    // A prefix larger than one page (256 keys) reads whole and in order; the prefix's
    // neighbours stay out.
    let ops: Vec<Op> = (0..600)
        .map(|i| Op::put(format!("/kv/p/{i:04}"), format!("v{i}")))
        .collect();
    c.txn_in_batches(&[], ops).await.expect("batched puts");
    c.put("/kv/p", "not under the prefix", None)
        .await
        .expect("put");
    c.put("/kv/q/0", "neither", None).await.expect("put");
    let all = c.range_prefix("/kv/p/").await.expect("range");
    assert_eq!(all.len(), 600);
    for (i, kv) in all.iter().enumerate() {
        assert_eq!(kv.key, format!("/kv/p/{i:04}").into_bytes());
        assert_eq!(kv.value, format!("v{i}").into_bytes());
    }

    // Transactions: compares on value, version, mod and create revision; both branches.
    let txn = Txn::new()
        .when([
            Compare::value("/kv/a", Cmp::Equal, "2"),
            Compare::version("/kv/a", Cmp::Greater, 1),
            Compare::mod_revision("/kv/a", Cmp::Equal, r2),
            Compare::create_revision("/kv/a", Cmp::Less, r2),
            Compare::absent("/kv/none"),
        ])
        .and_then([
            Op::put("/kv/b", "from txn"),
            Op::get("/kv/a"),
            Op::delete("/kv/q/0"),
        ])
        .or_else([Op::put("/kv/failed", "x")]);
    let t = c.txn(&txn).await.expect("txn");
    assert!(t.succeeded);
    assert!(t.revision > r2);
    match &t.responses[..] {
        [OpResponse::Put, OpResponse::Get(kvs), OpResponse::Delete(1)] => {
            assert_eq!(kvs[0].value, b"2")
        }
        other => panic!("unexpected responses {other:?}"),
    }
    let t = c
        .txn(
            &Txn::new()
                .when([Compare::value("/kv/a", Cmp::NotEqual, "2")])
                .and_then([Op::put("/kv/never", "x")])
                .or_else([Op::get("/kv/b")]),
        )
        .await
        .expect("txn");
    assert!(!t.succeeded);
    assert!(matches!(&t.responses[..], [OpResponse::Get(kvs)] if kvs[0].value == b"from txn"));
    assert_eq!(c.get("/kv/never").await.expect("get"), None);

    // Deletes.
    assert_eq!(c.delete("/kv/b").await.expect("delete"), 1);
    assert_eq!(c.delete("/kv/b").await.expect("delete again"), 0);
    assert_eq!(c.delete_prefix("/kv/p/").await.expect("delete prefix"), 600);
    assert!(
        c.get("/kv/p").await.expect("get").is_some(),
        "not under the prefix"
    );

    // Compaction: up to now is fine, a future revision is refused with etcd's reason.
    let now = c.put("/kv/c", "c", None).await.expect("put");
    c.compact(now).await.expect("compact");
    let e = c.compact(now + 1000).await.expect_err("future revision");
    assert!(e.to_string().contains("future revision"), "{e}");

    // Status: three members, one leader known to all.
    let statuses = c.members_status().await;
    assert_eq!(statuses.len(), 3);
    let statuses: Vec<_> = statuses
        .into_iter()
        .map(|(_, s)| s.expect("status"))
        .collect();
    assert_eq!(statuses.iter().filter(|s| s.is_leader()).count(), 1);
    assert!(
        statuses
            .iter()
            .all(|s| s.leader == statuses[0].leader && s.db_size > 0)
    );
    assert!(
        statuses[0].version.starts_with("3."),
        "{}",
        statuses[0].version
    );
    let leader_url = c.leader_endpoint().await.expect("leader endpoint");
    assert_eq!(
        leader_url,
        cluster.members[cluster.leader().await].client_url
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn txn_batches_of_more_than_127_ops_are_split_and_all_applied() {
    let cluster = Cluster::one().await;
    let c = cluster.client();
    let ops = |n: usize, tag: &str| -> Vec<Op> {
        (0..n)
            .map(|i| Op::put(format!("/batch/{tag}/{i:04}"), tag))
            .collect::<Vec<_>>()
    };

    // One transaction over etcd's --max-txn-ops (128) is refused, saying how to split it.
    let e = c
        .txn(&Txn::new().and_then(ops(129, "one")))
        .await
        .expect_err("129 ops");
    assert!(e.to_string().contains("MAX_TXN_OPS"), "{e}");
    c.txn(&Txn::new().and_then(ops(MAX_TXN_OPS, "max")))
        .await
        .expect("127 ops");

    // 300 guarded puts: three transactions, every key written.
    c.put("/batch/guard", "go", None).await.expect("put");
    let guard = [Compare::value("/batch/guard", Cmp::Equal, "go")];
    let done = c
        .txn_in_batches(&guard, ops(300, "ok"))
        .await
        .expect("batches");
    assert_eq!(done.len(), 3);
    assert!(done.iter().all(|t| t.succeeded));
    assert!(done.windows(2).all(|w| w[0].revision < w[1].revision));
    assert_eq!(
        c.range_prefix("/batch/ok/").await.expect("range").len(),
        300
    );

    // A failing guard stops at the first transaction: nothing written.
    c.put("/batch/guard", "stop", None).await.expect("put");
    let done = c
        .txn_in_batches(&guard, ops(300, "no"))
        .await
        .expect("batches");
    assert_eq!(done.len(), 1);
    assert!(!done[0].succeeded);
    assert!(
        c.range_prefix("/batch/no/")
            .await
            .expect("range")
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_over_etcds_request_limit_gets_a_clear_error() {
    let cluster = Cluster::one().await;
    let c = cluster.client();
    c.put("/big/ok", vec![7u8; 1024 * 1024], None)
        .await
        .expect("1 MiB fits");
    // Over --max-request-bytes (1.5 MiB): etcd's "request is too large"; over it plus 512 KiB:
    // gRPC's own limit. Both at once, not retried.
    for size in [1600 * 1024, 3 * 1024 * 1024] {
        let started = Instant::now();
        let e = c
            .put("/big/no", vec![7u8; size], None)
            .await
            .expect_err("too large");
        assert!(
            started.elapsed() < Duration::from_millis(400),
            "retried: {:?}",
            started.elapsed()
        );
        assert!(
            matches!(e, Error::TooLarge { bytes, .. } if bytes > size),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(
            text.contains("max-request-bytes") && !text.contains('\n'),
            "{text}"
        );
        println!("{size} bytes: {text}");
    }
    assert_eq!(c.get("/big/no").await.expect("get"), None);
    assert_eq!(
        c.get("/big/ok")
            .await
            .expect("get")
            .expect("present")
            .value
            .len(),
        1024 * 1024
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_tokens_are_sent_and_renewed_when_etcd_expires_them() {
    // Simple tokens that expire after 1 s unused.
    let cluster = Cluster::start(1, &["--auth-token-ttl", "1"]).await;
    let url = cluster.endpoints()[0].clone();
    let mut auth = AuthClient::connect(url.clone()).await.expect("connect");
    auth.user_add(AuthUserAddRequest {
        name: "root".into(),
        password: "secret".into(),
    })
    .await
    .expect("user add");
    auth.user_grant_role(AuthUserGrantRoleRequest {
        user: "root".into(),
        role: "root".into(),
    })
    .await
    .expect("grant root");
    auth.auth_enable(AuthEnableRequest {})
        .await
        .expect("auth enable");

    let with = |user: Option<(&str, &str)>| {
        let mut cfg = Config::new([url.clone()]);
        cfg.timeout = Duration::from_millis(500);
        cfg.user = user.map(|(u, p)| (u.to_string(), p.to_string()));
        Client::connect(cfg).expect("client")
    };
    let c = with(Some(("root", "secret")));
    c.put("/auth/a", "1", None).await.expect("put with a token");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // The token expired: the client authenticates again by itself.
    assert_eq!(
        c.get("/auth/a")
            .await
            .expect("get after expiry")
            .expect("present")
            .value,
        b"1"
    );

    let e = with(None).get("/auth/a").await.expect_err("no user");
    assert!(matches!(e, Error::Auth(_)), "{e:?}");
    let e = with(Some(("root", "wrong")))
        .get("/auth/a")
        .await
        .expect_err("bad password");
    assert!(
        matches!(&e, Error::Auth(m) if m.contains("password")),
        "{e:?}"
    );
    println!("{e}");
}

/// TLS to etcd (`https://` endpoints, `[etcd] ca`/`cert`/`key`): with etcd's CA and a client
/// certificate the client reads and writes; without the client certificate, with another CA,
/// or with no TLS at all it is refused in one line that says what to check, and nothing is
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_to_etcd_works_with_its_ca_and_a_client_certificate_and_anything_else_is_refused() {
    let cluster = Cluster::start_tls(1).await;
    let url = cluster.endpoints()[0].clone();
    assert!(url.starts_with("https://"), "{url}");
    let with = |tls: Option<TlsConfig>| {
        let mut cfg = Config::new([url.clone()]);
        cfg.timeout = Duration::from_millis(500);
        cfg.tls = tls;
        Client::connect(cfg)
    };
    let good = cluster.tls.clone().expect("TLS cluster");
    let c = with(Some(good.clone())).expect("client");
    c.put("/tls/a", "1", None).await.expect("put over TLS");
    assert_eq!(
        c.get("/tls/a").await.expect("get").expect("present").value,
        b"1"
    );

    // No client certificate: etcd's --client-cert-auth refuses the handshake.
    let no_cert = TlsConfig {
        cert: None,
        key: None,
        ..good.clone()
    };
    let other_ca = TlsConfig {
        ca: cluster::fixture("other-ca.crt"),
        ..good.clone()
    };
    for (what, tls, says) in [
        (
            "no client certificate",
            no_cert,
            "give tls.cert and tls.key",
        ),
        ("another CA", other_ca, "UnknownIssuer"),
    ] {
        let e = match with(Some(tls)) {
            Ok(c) => c.put("/tls/b", "x", None).await.expect_err(what),
            Err(e) => e,
        };
        let line = e.to_string();
        println!("{what}: {line}");
        assert!(!line.contains('\n'), "{what}: not one line: {line}");
        assert!(matches!(e, Error::Unavailable(_)), "{what}: {e:?}");
        assert!(line.contains(says), "{what}: {line}");
    }
    // https without TLS configured, and a certificate without its key: refused before
    // connecting.
    let e = with(None).err().expect("https without TLS is refused");
    assert!(e.to_string().contains("no TLS is configured"), "{e}");
    let half = TlsConfig {
        key: None,
        ..good.clone()
    };
    let e = with(Some(half))
        .err()
        .expect("a certificate without its key");
    assert!(
        e.to_string()
            .contains("both a client certificate and its key"),
        "{e}"
    );
    let missing = TlsConfig {
        ca: cluster::fixture("no-such-ca.crt"),
        ..good
    };
    let e = with(Some(missing)).err().expect("a missing CA file");
    assert!(e.to_string().contains("cannot read the TLS CA"), "{e}");
    assert_eq!(
        c.get("/tls/b").await.expect("get"),
        None,
        "nothing was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_among_two_candidates_and_the_other_names_it() {
    let cluster = Cluster::three().await;
    let eps = cluster.endpoints();
    let ca = cluster.client_on(&eps);
    let cb = cluster.client_on(&[eps[2].clone(), eps[1].clone(), eps[0].clone()]);
    let a = election(&ca, "http://a:1");
    let b = election(&cb, "http://b:2");
    let (first, value, other) = tokio::select! {
        l = a.campaign() => (l.expect("a"), "http://a:1", b.clone()),
        l = b.campaign() => (l.expect("b"), "http://b:2", a.clone()),
    };
    assert!(first.is_leader());
    // The other keeps waiting while the first leads.
    let waiting = tokio::time::timeout(Duration::from_millis(1500), other.campaign()).await;
    assert!(
        waiting.is_err(),
        "a second leader while the first holds the key"
    );
    assert!(first.is_leader());
    let named = other
        .leader()
        .await
        .expect("leader")
        .expect("someone leads");
    assert_eq!(named, (value.as_bytes().to_vec(), first.revision()));
    assert_eq!(leader(&ca, KEY).await.expect("leader"), Some(named));
    first.resign().await.expect("resign");
    assert_eq!(leader(&ca, KEY).await.expect("leader"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resigned_leader_hands_over_within_seconds() {
    let cluster = Cluster::three().await;
    let c = cluster.client();
    let a = win(&election(&c, "a"), Duration::from_secs(5)).await;
    let b = election(&c, "b");
    let waiting = tokio::spawn(async move { b.campaign().await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    let started = Instant::now();
    a.resign().await.expect("resign");
    assert_eq!(a.lost().await, "resigned");
    assert!(!a.is_leader());
    let b = tokio::time::timeout(Duration::from_secs(3), waiting)
        .await
        .expect("handed over within 3 s")
        .expect("task")
        .expect("campaign");
    let took = started.elapsed();
    println!("hand-over after resign: {took:?}");
    assert!(b.is_leader());
    assert!(b.revision() > a.revision());
    // The old leader's fenced write is refused.
    let e = a
        .txn(Txn::new().and_then([Op::put("/t/x", "a")]))
        .await
        .expect_err("resigned");
    assert!(matches!(e, Error::Deposed(_)), "{e:?}");
    assert_eq!(c.get("/t/x").await.expect("get"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_keepalive_stops_loses_leadership_before_another_wins() {
    let cluster = Cluster::three().await;
    // A reaches etcd only through one follower; freezing that member stalls A's keepalives
    // (a partitioned leader) while the cluster, and B on the other members, carry on.
    let etcd_leader = cluster.leader().await;
    let f = (etcd_leader + 1) % 3;
    let eps = cluster.endpoints();
    let others: Vec<String> = (0..3).filter(|i| *i != f).map(|i| eps[i].clone()).collect();
    let ca = cluster.client_on(&[eps[f].clone()]);
    let cb = cluster.client_on(&others);
    let a = win(&election(&ca, "a"), Duration::from_secs(5)).await;
    let b = election(&cb, "b");

    cluster.pause(f);
    let stopped = Instant::now();
    let b_won = tokio::spawn(async move {
        let l = b.campaign().await.expect("b campaign");
        (l, Instant::now())
    });
    let reason = tokio::time::timeout(Duration::from_secs(5), a.lost())
        .await
        .expect("a lost in time");
    let lost_at = Instant::now();
    assert!(!a.is_leader());
    let (b, b_at) = tokio::time::timeout(Duration::from_secs(8), b_won)
        .await
        .expect("b wins in time")
        .expect("task");
    println!(
        "stalled leader: lost after {:?} ({reason}); other won after {:?}",
        lost_at - stopped,
        b_at - stopped
    );
    assert!(lost_at < b_at, "B won before A knew it lost");
    assert!(reason.contains("keepalive"), "{reason}");
    assert!(b.revision() > a.revision());

    // A's etcd comes back: its fenced write is refused and writes nothing.
    cluster.resume(f);
    let e = a
        .txn(Txn::new().and_then([Op::put("/t/stale", "a")]))
        .await
        .expect_err("deposed");
    assert!(matches!(e, Error::Deposed(_)), "{e:?}");
    // The same write fenced on A's revision, sent straight to etcd: refused by etcd too.
    let fenced = Txn::new()
        .when([Compare::create_revision(KEY, Cmp::Equal, a.revision())])
        .and_then([Op::put("/t/stale", "a")]);
    assert!(
        !ca.txn(&fenced)
            .await
            .expect("txn through the thawed member")
            .succeeded
    );
    assert_eq!(cb.get("/t/stale").await.expect("get"), None);
    b.txn(Txn::new().and_then([Op::put("/t/fresh", "b")]))
        .await
        .expect("b writes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_txn_of_a_deposed_leader_writes_nothing() {
    let cluster = Cluster::one().await;
    let c = cluster.client();
    // A long TTL: A's own key check (after each keepalive, every 3 s) does not run before
    // its write, so the refusal below is etcd's compare, not A's local state.
    let a = win(
        &Election::new(c.clone(), KEY, "a", Duration::from_secs(9)).expect("election"),
        Duration::from_secs(5),
    )
    .await;
    a.txn(Txn::new().and_then([Op::put("/t/a1", "a")]))
        .await
        .expect("a writes while leading");
    // A's key vanishes behind its back (as when its lease expired) and B wins.
    c.delete(KEY).await.expect("delete");
    let b = win(&election(&c, "b"), Duration::from_secs(3)).await;
    assert!(
        a.is_leader(),
        "A does not know yet: election is not fencing"
    );
    let ops: Vec<Op> = (0..200)
        .map(|i| Op::put(format!("/t/a2/{i}"), "a"))
        .collect();
    let e = a.txn_in_batches(ops).await.expect_err("deposed");
    let Error::Deposed(m) = &e else {
        panic!("{e:?}")
    };
    assert!(
        m.contains(&format!("created at revision {}", b.revision())),
        "{m}"
    );
    tokio::time::timeout(Duration::from_secs(1), a.lost())
        .await
        .expect("lost at once");
    assert!(!a.is_leader());
    assert!(c.range_prefix("/t/a2/").await.expect("range").is_empty());
    // The caller's own failed compare is not deposition.
    let t = b
        .txn(
            Txn::new()
                .when([Compare::value("/t/a1", Cmp::Equal, "nope")])
                .and_then([Op::put("/t/b", "b")])
                .or_else([Op::get("/t/a1")]),
        )
        .await
        .expect("b's txn");
    assert!(!t.succeeded);
    assert!(matches!(&t.responses[..], [OpResponse::Get(kvs)] if kvs[0].value == b"a"));
    assert!(b.is_leader());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_carries_on_when_the_etcd_leader_is_killed() {
    let mut cluster = Cluster::three().await;
    // The default timeout (2 s, so 6 s of retries per call): what the coordinator uses, and
    // longer than an etcd election.
    let c = Client::connect(Config::new(cluster.endpoints())).expect("client");
    let writer = {
        let c = c.clone();
        tokio::spawn(async move {
            let (mut acked, mut failed, mut slowest) = (Vec::new(), 0, Duration::ZERO);
            let until = Instant::now() + Duration::from_secs(5);
            let mut i = 0;
            while Instant::now() < until {
                let started = Instant::now();
                match c.put(format!("/loop/{i:05}"), format!("{i}"), None).await {
                    Ok(_) => acked.push(i),
                    Err(e) => {
                        failed += 1;
                        println!("put {i} failed: {e}");
                    }
                }
                slowest = slowest.max(started.elapsed());
                i += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            (acked, failed, slowest, i)
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed_at = Instant::now();
    let killed = cluster.kill_leader().await;
    let new_leader = cluster.leader().await;
    println!(
        "etcd leader m{killed} killed; m{new_leader} leads after {:?}",
        killed_at.elapsed()
    );
    assert_ne!(killed, new_leader);
    let (acked, failed, slowest, sent) = writer.await.expect("writer");
    println!(
        "{sent} puts, {} acknowledged, {failed} failed, slowest {slowest:?}",
        acked.len()
    );
    assert_eq!(failed, 0, "puts failed across the etcd leader kill");
    assert!(acked.len() > 50, "puts did not resume: {}", acked.len());

    // The killed member comes back and catches up; no acknowledged put is lost.
    cluster.restart(killed);
    let back = cluster.client_on(&[cluster.members[killed].client_url.clone()]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let all = loop {
        match back.range_prefix("/loop/").await {
            Ok(all) if all.len() >= acked.len() => break all,
            _ if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(200)).await,
            other => panic!(
                "restarted member did not catch up: {:?}",
                other.map(|a| a.len())
            ),
        }
    };
    let stored: std::collections::HashMap<Vec<u8>, Vec<u8>> =
        all.into_iter().map(|kv| (kv.key, kv.value)).collect();
    for i in acked {
        assert_eq!(
            stored.get(format!("/loop/{i:05}").as_bytes()),
            Some(&format!("{i}").into_bytes()),
            "acknowledged put {i} lost"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leadership_survives_an_etcd_leader_kill_or_is_lost_cleanly() {
    let mut cluster = Cluster::three().await;
    let ca = cluster.client();
    let cb = cluster.client();
    let a = Arc::new(win(&election(&ca, "a"), Duration::from_secs(5)).await);
    let b_slot: Arc<Mutex<Option<Leadership>>> = Arc::new(Mutex::new(None));
    let mut b_campaign = {
        let (b, slot) = (election(&cb, "b"), b_slot.clone());
        tokio::spawn(async move {
            let l = b.campaign().await.expect("b campaign");
            *slot.lock().await = Some(l);
        })
    };
    // Both write fenced every 50 ms while they believe they lead; each success is recorded
    // with its revision.
    let writes: Arc<Mutex<Vec<(&str, i64)>>> = Arc::default();
    let until = Instant::now() + Duration::from_secs(6);
    let a_writer = {
        let (a, writes) = (a.clone(), writes.clone());
        tokio::spawn(async move {
            while Instant::now() < until {
                if a.is_leader()
                    && let Ok(t) = a.txn(Txn::new().and_then([Op::put("/t/owner", "a")])).await
                {
                    writes.lock().await.push(("a", t.revision));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let b_writer = {
        let (slot, writes) = (b_slot.clone(), writes.clone());
        tokio::spawn(async move {
            while Instant::now() < until {
                if let Some(b) = slot.lock().await.as_ref().filter(|b| b.is_leader())
                    && let Ok(t) = b.txn(Txn::new().and_then([Op::put("/t/owner", "b")])).await
                {
                    writes.lock().await.push(("b", t.revision));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(800)).await;
    let killed_at = Instant::now();
    let killed = cluster.kill_leader().await;
    cluster.leader().await;
    println!(
        "etcd leader m{killed} killed; new etcd leader after {:?}",
        killed_at.elapsed()
    );
    a_writer.await.expect("a writer");
    b_writer.await.expect("b writer");

    let writes = writes.lock().await.clone();
    let last_a = writes.iter().filter(|w| w.0 == "a").map(|w| w.1).max();
    let first_b = writes.iter().filter(|w| w.0 == "b").map(|w| w.1).min();
    if let (Some(last_a), Some(first_b)) = (last_a, first_b) {
        assert!(
            last_a < first_b,
            "A wrote at {last_a} after B at {first_b}: two leaders"
        );
    }
    if a.is_leader() {
        println!(
            "A kept leading through the kill ({} fenced writes)",
            writes.len()
        );
        let holder = leader(&ca, KEY).await.expect("leader");
        assert_eq!(holder, Some((b"a".to_vec(), a.revision())));
        assert!(b_slot.lock().await.is_none());
        assert!(last_a.is_some() && first_b.is_none());
    } else {
        let reason = tokio::time::timeout(Duration::from_secs(1), a.lost())
            .await
            .expect("lost");
        println!("A lost leadership cleanly: {reason}");
        // A gave its lease back on losing: B takes over.
        tokio::time::timeout(Duration::from_secs(5), &mut b_campaign)
            .await
            .expect("B leads after A lost")
            .expect("B's task");
        let slot = b_slot.lock().await;
        let b = slot.as_ref().expect("B won");
        assert!(b.revision() > a.revision());
        let holder = leader(&ca, KEY).await.expect("leader");
        assert_eq!(holder, Some((b"b".to_vec(), b.revision())));
    }
    b_campaign.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_strictly_increase_across_leadership_changes() {
    let cluster = Cluster::three().await;
    let c = cluster.client();
    let a = election(&c, "a");
    let b = election(&c, "b");
    let first = win(&a, Duration::from_secs(5)).await;
    first.resign().await.expect("resign");
    let second = win(&b, Duration::from_secs(3)).await;
    assert!(second.revision() > first.revision());
    // Dropped without resigning: the key stays until etcd expires the lease (up to one
    // keepalive period, ttl/3, was already used).
    let (lease, second_revision) = (second.lease_id(), second.revision());
    drop(second);
    let dropped = Instant::now();
    let third = win(&a, Duration::from_secs(8)).await;
    let took = dropped.elapsed();
    println!("a dropped leader's key expired and was taken after {took:?} (TTL {TTL:?})");
    assert!(
        took >= TTL - TTL / 3 - Duration::from_millis(100),
        "taken before the lease could expire: {took:?}"
    );
    assert_eq!(c.time_to_live(lease).await.expect("ttl"), None);
    assert!(third.revision() > second_revision);
}
