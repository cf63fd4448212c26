//! The service's limits and stream life cycle, across processes: the per-request timeout
//! (`rpc_timeout`, or the caller's shorter `grpc-timeout`), the per-connection concurrency
//! limit (`max_in_flight`), a change cut off by its deadline carried out whole, KeepAlive loss
//! notices that reach only the streams that renewed the lease, and SIGTERM with streams still
//! open.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use automaton_proto::v1 as pb;
use pb::tasks_client::TasksClient;
use sha2::Digest;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Request, Streaming};

use crate::harness::{
    Api, Coord, Env, Events, expect_err, lock_view, run_bounded, signal, wait_bounded,
};

/// The slow call must take at least this long for the timing claims to have a wide margin.
const MIN_SLOW: Duration = Duration::from_millis(150);

/// A small task whose `GetTask` is fast: one folder, nothing to hash.
const PROBE: &str = "probe";
/// A `research:approved` task with a large SPEC.md: `Audit` and `ListTasks` hash the approved
/// artifact to tell whether the approval went stale, so they are slow, while their answers
/// stay small (a large answer would blur "which call completed first" on the client).
const HEAVY: &str = "heavy";

/// Writes a task folder the way `CreateTask` lays one out, in `state`.
fn task_on_disk(env: &Env, task: &str, state: &str) -> PathBuf {
    let dir = env.task_dir(task);
    std::fs::create_dir_all(&dir).expect("create the task folder");
    std::fs::write(dir.join(".state"), format!("{state}\n")).expect("write .state");
    std::fs::write(dir.join(".state.approvals"), "").expect("write .state.approvals");
    dir
}

/// (Re)writes HEAVY's SPEC.md with `mib` MiB and its approval, bound to that content.
fn heavy_spec(env: &Env, mib: usize) {
    let dir = env.task_dir(HEAVY);
    let line = "A line of the specification, one of very many, all of them read and hashed.\n";
    let spec = line.repeat(mib * 1024 * 1024 / line.len());
    let sha: String = sha2::Sha256::digest(spec.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::write(dir.join("SPEC.md"), &spec).expect("write SPEC.md");
    let approval = automaton_store::Approval {
        phase: "research".parse().expect("a phase"),
        at: SystemTime::now(),
        approver: "ops".into(),
        sha256: Some(sha),
        commit: None,
    };
    std::fs::write(dir.join(".state.approvals"), approval.render()).expect("write approvals");
}

/// PROBE and HEAVY (SPEC.md of `mib` MiB), on disk before any coordinator starts.
fn slow_project(env: &Env, mib: usize) {
    task_on_disk(env, PROBE, "research");
    task_on_disk(env, HEAVY, "research:approved");
    heavy_spec(env, mib);
}

/// One `Audit`, timed; it must succeed (a fresh approval: exit code 0).
async fn timed_audit(tasks: &mut TasksClient<Channel>) -> Duration {
    let t = Instant::now();
    let r = tasks
        .audit(pb::AuditRequest {})
        .await
        .unwrap_or_else(|s| panic!("Audit with the default limits: {s:?}"))
        .into_inner();
    let took = t.elapsed();
    assert_eq!(r.exit_code, 0, "a clean project audits clean: {r:?}");
    took
}

/// Makes HEAVY big enough that `Audit` takes at least [`MIN_SLOW`] on this machine and
/// build (`mib` MiB first, then larger), and returns the fastest of two timed audits.
async fn make_audit_slow(env: &Env, tasks: &mut TasksClient<Channel>, mut mib: usize) -> Duration {
    loop {
        let fastest = timed_audit(tasks).await.min(timed_audit(tasks).await);
        if fastest >= MIN_SLOW {
            eprintln!("Audit with a {mib} MiB approved artifact takes {fastest:?}");
            return fastest;
        }
        assert!(
            mib < 256,
            "Audit still takes only {fastest:?} with a {mib} MiB artifact"
        );
        mib *= 4;
        heavy_spec(env, mib);
    }
}

/// A config file in the env's HOME; returns `--config PATH` arguments for `Coord::start`.
fn config_file(env: &Env, name: &str, toml: &str) -> String {
    let path = env.home.path().join(name);
    std::fs::write(&path, toml).expect("write config");
    path.to_str().expect("a UTF-8 temp path").to_string()
}

fn get_req(task: &str) -> pb::GetTaskRequest {
    pb::GetTaskRequest {
        task: task.into(),
        ..Default::default()
    }
}

/// `%XX`-decodes a `grpc-message` header value.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Calls `Tasks/Audit` with a `grpc-timeout: 20m` header through curl, a client that sends the
/// caller's deadline but does not enforce it itself (a tonic client cancels the call on its own
/// timer, racing the server's answer), and returns the response headers: what the server
/// answered on its own. curl older than 8.x reports a stream the server resets with NO_ERROR
/// after a complete early answer (legal HTTP/2, sent when the request body was not read yet)
/// as error 92: such an attempt is repeated.
fn audit_with_header_deadline(env: &Env, url: &str) -> Vec<(String, String)> {
    let version = Command::new("curl").arg("--version").output();
    let version = match version {
        Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
        Err(e) => panic!(
            "this test needs curl (with HTTP/2) as a client that does not enforce grpc-timeout itself: {e}"
        ),
    };
    assert!(
        version.contains("HTTP2"),
        "this test needs a curl with HTTP/2 support:\n{version}"
    );
    let body = env.home.path().join("audit-request.bin");
    // One gRPC message frame: uncompressed, length 0 (AuditRequest has no fields).
    std::fs::write(&body, [0u8; 5]).expect("write the request body");
    let mut last = None;
    for _ in 0..5 {
        let mut c = Command::new("curl");
        // `-q` first: no ~/.curlrc; no proxy for the loopback address.
        c.args(["-q", "-sS", "--noproxy", "*", "--http2-prior-knowledge"])
            .args(["--max-time", "30", "-X", "POST"])
            .args(["-H", "content-type: application/grpc", "-H", "te: trailers"])
            .args(["-H", "grpc-timeout: 20m", "-D", "-", "-o", "/dev/null"])
            .arg("--data-binary")
            .arg(format!("@{}", body.display()))
            .arg(format!("{url}/automaton.v1.Tasks/Audit"));
        let run = run_bounded(c, Duration::from_secs(60));
        if run.code == 92 {
            last = Some(run);
            continue;
        }
        assert_eq!(run.code, 0, "curl failed: {run:?}");
        let mut lines = run.stdout.lines();
        let status = lines.next().unwrap_or_default().trim();
        assert_eq!(status, "HTTP/2 200", "gRPC answers HTTP 200: {run:?}");
        return lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
    }
    panic!("curl failed 5 times with error 92: {last:?}");
}

/// Issue: "a stuck request … is answered DEADLINE_EXCEEDED after `rpc_timeout`, or sooner if the
/// client's own `grpc-timeout` is shorter" (layers.rs, the Gate). A read answered so changes
/// nothing, and the coordinator keeps serving.
#[tokio::test(flavor = "multi_thread")]
async fn rpc_timeout_answers_deadline_exceeded_and_changes_nothing() {
    let env = Env::new();
    slow_project(&env, 8);
    // The defaults first: how slow the slow call is, here.
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let full = make_audit_slow(&env, &mut api.tasks, 8).await;

    // The server's rpc_timeout, tiny (no lower bound in the config's validation).
    let tight = config_file(&env, "tight.toml", "rpc_timeout = \"1ms\"\n");
    coord.restart(&["--config", &tight]);
    let mut api = coord.api().await;
    let before = env.snapshot();
    let t = Instant::now();
    let s = expect_err(
        api.tasks.audit(pb::AuditRequest {}).await,
        Code::DeadlineExceeded,
        "no answer within 1ms",
        None,
    );
    eprintln!(
        "rpc_timeout 1ms: Audit answered {:?} after {:?} (a full audit takes {full:?})",
        s.code(),
        t.elapsed()
    );
    expect_err(
        api.list().await,
        Code::DeadlineExceeded,
        "no answer within 1ms",
        None,
    );
    // The shorter of the two wins: a 10 s deadline of the caller does not lengthen it.
    let mut req = Request::new(pb::AuditRequest {});
    req.set_timeout(Duration::from_secs(10));
    expect_err(
        api.tasks.audit(req).await,
        Code::DeadlineExceeded,
        "no answer within 1ms",
        None,
    );
    assert!(
        before == env.snapshot(),
        "a call answered DEADLINE_EXCEEDED changed the project's files"
    );
    assert!(
        coord.child.try_wait().expect("try_wait").is_none(),
        "the coordinator died:\n{}",
        coord.stderr()
    );

    // Back to the default rpc_timeout (30 s): the caller's own, shorter deadline applies.
    coord.restart(&[]);
    let mut api = coord.api().await;
    let before = env.snapshot();
    // Sent by a client that leaves the deadline to the server.
    let headers = audit_with_header_deadline(&env, &coord.url);
    let header = |k: &str| {
        headers
            .iter()
            .find(|(name, _)| name == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {k} in the answer: {headers:?}"))
    };
    let code = header("grpc-status");
    let message = percent_decode(&header("grpc-message"));
    assert_eq!(
        (code.as_str(), message.contains("no answer within 20ms")),
        ("4", true),
        "the server must answer DEADLINE_EXCEEDED (4) after the caller's 20 ms: {message:?}"
    );
    assert!(!message.contains('\n'), "one line: {message:?}");
    // A tonic caller's deadline: tonic also enforces it on the client, so whichever fires
    // first fails the call: the server's DEADLINE_EXCEEDED, or tonic's own CANCELLED "Timeout
    // expired" (the usual winner: its timer starts first). Hence curl above.
    let mut req = Request::new(pb::AuditRequest {});
    req.set_timeout(Duration::from_millis(20));
    let t = Instant::now();
    let s = api
        .tasks
        .audit(req)
        .await
        .expect_err("a 20 ms deadline on a slow Audit must fail it");
    let took = t.elapsed();
    match s.code() {
        Code::DeadlineExceeded => assert!(s.message().contains("no answer within 20ms"), "{s:?}"),
        Code::Cancelled => assert_eq!(s.message(), "Timeout expired", "{s:?}"),
        _ => panic!("a 20 ms deadline: {s:?}"),
    }
    eprintln!("tonic deadline 20 ms: {:?} after {took:?}", s.code());
    assert!(
        before == env.snapshot(),
        "a call answered DEADLINE_EXCEEDED changed the project's files"
    );

    // The timeout is what failed them: without a deadline the same calls succeed, and a fast one
    // is not affected at all.
    timed_audit(&mut api.tasks).await;
    assert_eq!(api.list().await.expect("ListTasks").tasks.len(), 2);
    let probe = api.get(PROBE).await.expect("GetTask of a small task");
    assert_eq!(probe.summary.expect("summary").state, "research");
}

/// An `Approve` that its caller's deadline cuts off after it has started is carried out whole:
/// on disk, in the coordinator's memory (a claim sees the approved state) and in the events.
/// Dropping it half-way used to leave `.state` approved on disk while the coordinator still
/// refused claims as "waiting for approval", and released the task's guard while the disk
/// work still ran.
#[tokio::test]
async fn a_change_cut_off_by_its_deadline_is_carried_out_whole() {
    const BIG: &str = "big";
    let env = Env::new();
    let dir = task_on_disk(&env, BIG, "research:awaiting_approval");
    // Approve hashes the artifact it binds the approval to: 64 MiB take well over 20 ms.
    let line = "A line of the specification, one of very many, all of them read and hashed.\n";
    std::fs::write(dir.join("SPEC.md"), line.repeat((64 << 20) / line.len()))
        .expect("write SPEC.md");
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;

    let mut req = api.req(pb::ApproveRequest {
        task: BIG.into(),
        approver: "ops".into(),
        ..Default::default()
    });
    req.set_timeout(Duration::from_millis(20));
    let t = Instant::now();
    let cut = api
        .tasks
        .approve(req)
        .await
        .expect_err("a 20 ms deadline must cut off an Approve that hashes 64 MiB");
    assert!(
        matches!(cut.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{cut:?}"
    );
    eprintln!("Approve cut off after {:?}: {:?}", t.elapsed(), cut.code());

    // It finishes anyway, and the coordinator knows it did.
    let approved = events
        .find("the approval", Duration::from_secs(30), |e| {
            e.kind == "approved" && e.task == BIG
        })
        .await;
    assert!(
        approved.detail.contains("research:approved"),
        "{approved:?}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(".state"))
            .expect("read .state")
            .trim(),
        "research:approved"
    );
    let lease = api
        .claim(BIG, "agent-x", 60_000)
        .await
        .unwrap_or_else(|s| panic!("a claim after the approval landed: {s:?}"));
    assert_eq!(lease.state, "research:approved");
    assert!(
        coord.child.try_wait().expect("try_wait").is_none(),
        "the coordinator died:\n{}",
        coord.stderr()
    );
}

/// When each call completed, from the start of the slow one.
#[derive(Debug)]
struct Trial {
    fast_sent: Duration,
    slow_done: Duration,
    fast_done: Duration,
}

impl Trial {
    fn fast_first(&self) -> bool {
        self.fast_done < self.slow_done
    }

    /// How long the fast call took.
    fn fast_latency(&self) -> Duration {
        self.fast_done - self.fast_sent
    }
}

/// Starts a slow `Audit` on `slow`, drives it alone for 30 ms (it is on the wire and being
/// served by then), then sends a fast `GetTask` on `fast`; returns when each completed.
async fn trial(mut slow: TasksClient<Channel>, mut fast: TasksClient<Channel>) -> Trial {
    const LEAD: Duration = Duration::from_millis(30);
    let t0 = Instant::now();
    let mut slow_call = Box::pin(async move {
        let r = slow.audit(pb::AuditRequest {}).await;
        (r.map(|_| ()), t0.elapsed())
    });
    assert!(
        tokio::time::timeout(LEAD, &mut slow_call).await.is_err(),
        "the slow call finished within {LEAD:?}: the project is not slow enough"
    );
    let fast_sent = t0.elapsed();
    let mut fast_call = Box::pin(async move {
        let r = fast.get_task(get_req(PROBE)).await;
        (r.map(|_| ()), t0.elapsed())
    });
    // Polled slow-first: when both answers are in at the same wake-up, the slow one is
    // recorded first, in the order they came off the connection.
    let (mut slow_out, mut fast_out) = (None, None);
    let both = async {
        while slow_out.is_none() || fast_out.is_none() {
            tokio::select! {
                biased;
                r = &mut slow_call, if slow_out.is_none() => slow_out = Some(r),
                r = &mut fast_call, if fast_out.is_none() => fast_out = Some(r),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), both)
        .await
        .expect("both calls complete within 60 s");
    let (slow_r, slow_done) = slow_out.expect("slow done");
    let (fast_r, fast_done) = fast_out.expect("fast done");
    slow_r.unwrap_or_else(|s| panic!("the slow Audit failed: {s:?}"));
    fast_r.unwrap_or_else(|s| panic!("the fast GetTask failed: {s:?}"));
    Trial {
        fast_sent,
        slow_done,
        fast_done,
    }
}

/// config.rs: "`max_in_flight`: requests served at once per connection; further ones wait
/// (HTTP/2 back-pressure) until one finishes".
#[tokio::test(flavor = "multi_thread")]
async fn concurrency_limit_per_connection_makes_further_requests_wait() {
    const TRIALS: usize = 3;
    const SLACK: Duration = Duration::from_millis(5);
    let env = Env::new();
    slow_project(&env, 8);
    let one = config_file(&env, "one.toml", "max_in_flight = 1\n");
    let many = config_file(&env, "many.toml", "max_in_flight = 64\n");

    let mut coord = Coord::start(&env, &["--config", &one]);
    {
        // Measured on a connection of its own.
        let mut api = coord.api().await;
        make_audit_slow(&env, &mut api.tasks, 8).await;
    }
    // One connection: both clients share one HTTP/2 connection (a tonic Channel is one).
    let ch = coord.channel().await;
    for i in 0..TRIALS {
        let t = trial(TasksClient::new(ch.clone()), TasksClient::new(ch.clone())).await;
        eprintln!("max_in_flight 1, one connection, trial {i}: {t:?}");
        // The server starts the fast call only once the slow one has its answer, so the fast
        // one cannot complete before the slow one does, give or take the slow answer's way
        // back to this task (a few scheduler ticks at most on a busy machine). Without the
        // limit it completes some 100 ms before (below).
        assert!(
            t.fast_done + SLACK >= t.slow_done,
            "max_in_flight = 1: the second request on the connection completed before the first: {t:?}"
        );
        assert!(
            t.fast_latency() >= MIN_SLOW / 2,
            "max_in_flight = 1: the fast request must have waited for the slow one: {t:?}"
        );
    }
    // The limit is per connection: on another connection the fast call does not wait.
    let other = coord.channel().await;
    let mut fast_first = 0;
    for i in 0..TRIALS {
        let t = trial(
            TasksClient::new(ch.clone()),
            TasksClient::new(other.clone()),
        )
        .await;
        eprintln!("max_in_flight 1, two connections, trial {i}: {t:?}");
        fast_first += usize::from(t.fast_first());
    }
    assert!(
        fast_first * 2 > TRIALS,
        "max_in_flight = 1 limits one connection only: a fast call on another one should not wait ({fast_first}/{TRIALS} completed first)"
    );

    coord.restart(&["--config", &many]);
    let ch = coord.channel().await;
    let mut fast_first = 0;
    for i in 0..TRIALS {
        let t = trial(TasksClient::new(ch.clone()), TasksClient::new(ch.clone())).await;
        eprintln!("max_in_flight 64, one connection, trial {i}: {t:?}");
        fast_first += usize::from(t.fast_first());
    }
    assert!(
        fast_first * 2 > TRIALS,
        "max_in_flight = 64: a fast call next to a slow one on the same connection should not wait ({fast_first}/{TRIALS} completed first)"
    );
}

/// A KeepAlive stream: the sender of its requests and its responses.
struct KeepAlive {
    tx: mpsc::Sender<pb::KeepAliveRequest>,
    rx: Streaming<pb::KeepAliveResponse>,
}

impl KeepAlive {
    async fn open(api: &Api) -> KeepAlive {
        let (tx, rx) = mpsc::channel(8);
        let mut leases = api.leases.clone();
        let rx = leases
            .keep_alive(api.req(ReceiverStream::new(rx)))
            .await
            .expect("KeepAlive")
            .into_inner();
        KeepAlive { tx, rx }
    }

    /// Names `lease` on this stream and waits for its renewal.
    async fn renew(&mut self, lease: &pb::Lease) {
        self.tx
            .send(pb::KeepAliveRequest {
                lease_ids: vec![lease.lease_id.clone()],
            })
            .await
            .expect("send on the KeepAlive stream");
        let m = self.next(Duration::from_secs(5)).await.unwrap_or_else(|| {
            panic!("no renewal of {} within 5 s", lease.task);
        });
        assert_eq!(m.lease_id, lease.lease_id, "{m:?}");
        let l = m.lease.expect("a renewal, not a loss");
        assert!(l.renewed && l.token == lease.token, "{l:?}");
    }

    /// The next response within `within`, `None` if none came.
    async fn next(&mut self, within: Duration) -> Option<pb::KeepAliveResponse> {
        match tokio::time::timeout(within, self.rx.message()).await {
            Err(_) => None,
            Ok(Ok(Some(m))) => Some(m),
            Ok(Ok(None)) => panic!("the KeepAlive stream ended"),
            Ok(Err(s)) => panic!("the KeepAlive stream failed: {s:?}"),
        }
    }

    /// Waits (bounded) for the loss notice of `lease` and checks it.
    async fn expect_lost(&mut self, who: &str, lease: &pb::Lease, reason: &str, within: Duration) {
        let m = self
            .next(within)
            .await
            .unwrap_or_else(|| panic!("{who}: no loss notice of {} within {within:?}", lease.task));
        let lost = m
            .lost
            .unwrap_or_else(|| panic!("{who}: expected the loss of {}, got a renewal", lease.task));
        assert_eq!(
            (
                m.lease_id.as_str(),
                lost.task.as_str(),
                lost.token,
                lost.reason.as_str()
            ),
            (
                lease.lease_id.as_str(),
                lease.task.as_str(),
                lease.token,
                reason
            ),
            "{who}"
        );
    }

    /// Nothing arrives for `quiet`.
    async fn expect_silence(&mut self, who: &str, quiet: Duration) {
        if let Some(m) = self.next(quiet).await {
            panic!("{who} must hear nothing of a lease it never named, got {m:?}");
        }
    }
}

/// watchers.rs: "each KeepAlive stream registers the leases it renews; when a lease ends only
/// the streams that named it are told"; proto: KeepAlive tells the client "when any lease it
/// has named is lost (expired, released by someone else, …)".
#[tokio::test(flavor = "multi_thread")]
async fn keepalive_loss_notice_reaches_only_the_stream_that_renewed_the_lease() {
    const QUIET: Duration = Duration::from_millis(300);
    let coord = Coord::start(&Env::new(), &["--lease-ttl-min", "10ms"]);
    let mut ops = coord.api().await;
    for t in ["x", "y", "z", "w"] {
        ops.claimable_task(t).await;
    }
    // Two agents, each on its own connection and stream.
    let mut a_api = coord.api().await;
    let mut b_api = coord.api().await;
    let x = a_api.claim("x", "agent-a", 60_000).await.expect("claim x");
    let y = b_api.claim("y", "agent-b", 60_000).await.expect("claim y");
    let mut a = KeepAlive::open(&a_api).await;
    let mut b = KeepAlive::open(&b_api).await;
    a.renew(&x).await;
    b.renew(&y).await;

    // X released (by its holder, over a plain Release): only A hears of it.
    ops.release(&x.lease_id, x.token).await.expect("release x");
    a.expect_lost("stream A", &x, "released", Duration::from_secs(5))
        .await;
    b.expect_silence("stream B", QUIET).await;
    // Y released: only B.
    ops.release(&y.lease_id, y.token).await.expect("release y");
    b.expect_lost("stream B", &y, "released", Duration::from_secs(5))
        .await;
    a.expect_silence("stream A", QUIET).await;

    // A lease named by both streams: both hear of its end, once each.
    let w = a_api.claim("w", "agent-a", 60_000).await.expect("claim w");
    a.renew(&w).await;
    b.renew(&w).await;
    ops.release(&w.lease_id, w.token).await.expect("release w");
    a.expect_lost("stream A", &w, "released", Duration::from_secs(5))
        .await;
    b.expect_lost("stream B", &w, "released", Duration::from_secs(5))
        .await;

    // Expiry: Z (500 ms TTL) named once on A, never renewed again.
    let z = a_api.claim("z", "agent-a", 500).await.expect("claim z");
    let renewed = Instant::now();
    a.renew(&z).await;
    a.expect_lost("stream A", &z, "expired", Duration::from_secs(5))
        .await;
    assert!(
        renewed.elapsed() >= Duration::from_millis(500),
        "the TTL is a minimum: lost {:?} after the renewal",
        renewed.elapsed()
    );
    b.expect_silence("stream B", QUIET).await;
    a.expect_silence("stream A", QUIET).await;
    assert!(ops.lease_of("z").await.is_none(), "z expired");
}

/// lib.rs: "Streams never finish on their own: tell them to end so the drain can complete";
/// issue: "SIGTERM drains in-flight requests, keeps leases on disk for the next start, and
/// exits 0". restart.rs's SIGTERM test closes its clients first; here a KeepAlive stream (and
/// an event feed) are still open when the signal comes.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_ends_open_keepalive_streams_and_exits_0() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.claimable_task("held").await;
    let held = api.claim("held", "agent-a", 60_000).await.expect("claim");
    let mut ka = KeepAlive::open(&api).await;
    ka.renew(&held).await;
    let mut events = api
        .events
        .clone()
        .watch_events(api.req(pb::WatchEventsRequest {}))
        .await
        .expect("WatchEvents")
        .into_inner();
    // The view is on disk before the signal.
    lock_view(&env, "held", Some(held.token)).await;

    let t0 = Instant::now();
    signal(coord.pid(), "-TERM");
    // Both streams end (cleanly or with an error), without any loss notice: the lease stays.
    match tokio::time::timeout(Duration::from_secs(5), ka.rx.message()).await {
        Err(_) => panic!(
            "the KeepAlive stream is still open 5 s after SIGTERM;\nstderr:\n{}",
            coord.stderr()
        ),
        Ok(Ok(Some(m))) => panic!("the KeepAlive stream must just end, got {m:?}"),
        Ok(Ok(None)) | Ok(Err(_)) => {}
    }
    let ka_ended = t0.elapsed();
    match tokio::time::timeout(Duration::from_secs(5), events.message()).await {
        Err(_) => panic!("the event feed is still open 5 s after SIGTERM"),
        Ok(Ok(Some(e))) => panic!("no event expected at shutdown, got {e:?}"),
        Ok(Ok(None)) | Ok(Err(_)) => {}
    }
    // The process exits 0 although the client still holds its connection and stream sender.
    let status = wait_bounded(&mut coord.child, Duration::from_secs(10)).unwrap_or_else(|| {
        panic!(
            "the coordinator did not exit within 10 s of SIGTERM with a KeepAlive stream open;\nstderr:\n{}",
            coord.stderr()
        )
    });
    let exited = t0.elapsed();
    eprintln!("SIGTERM: KeepAlive stream ended after {ka_ended:?}, exit after {exited:?}");
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM must exit 0: {status:?}\n{}",
        coord.stderr()
    );
    drop(ka);
    let log = coord.stderr();
    assert!(
        log.contains("shutting down") && log.contains("leases kept on disk"),
        "{log}"
    );

    // The lease is still on disk, and a fresh coordinator has it: same holder, id and token.
    let on_disk = env
        .task_file("held", ".state.lock")
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .expect("the lease view survives SIGTERM");
    let l = automaton_store::Lease::parse(&on_disk).expect("a readable .state.lock");
    assert_eq!(
        (l.agent.as_str(), l.token, l.lease_id.as_str()),
        ("agent-a", held.token, held.lease_id.as_str())
    );
    coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let now = api
        .lease_of("held")
        .await
        .expect("the lease survives SIGTERM with a stream open");
    assert_eq!(
        (now.agent.as_str(), now.token, now.lease_id.as_str()),
        ("agent-a", held.token, held.lease_id.as_str())
    );
    // Its holder carries on, on a new stream.
    let mut ka = KeepAlive::open(&api).await;
    ka.renew(&held).await;
}
