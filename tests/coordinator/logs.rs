//! Live agent output (issue 23): the worker streams each run's output to the coordinator,
//! which keeps a bounded tail and serves it to `automaton logs [--follow]`.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use tonic::Code;

use crate::harness::{
    AGENT_B_TOKEN, AGENT_TOKEN, Coord, Env, OPERATOR_TOKEN, TOKENS_TOML, WORKER_A_TOKEN, bearer,
    cli_bin, poll,
};
use crate::work::{FLEET, git_init, scripted_worker};

/// `automaton logs ARGS` against `coord` as `token`, with its stdout read line by line.
struct Logs {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    stderr: Arc<Mutex<String>>,
}

fn logs(env: &Env, coord: &Coord, token: &str, args: &[&str]) -> Logs {
    let mut c = Command::new(cli_bin());
    c.arg("logs")
        .args(args)
        .args(["--coordinator", &coord.url])
        .env("HOME", env.home.path())
        .env("AUTOMATON_TOKEN", token)
        .env_remove("AUTOMATON_COORDINATOR")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn automaton logs");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stderr = Arc::new(Mutex::new(String::new()));
    let (out, err) = (
        child.stdout.take().expect("stdout"),
        child.stderr.take().expect("stderr"),
    );
    let l = lines.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            l.lock().expect("lines").push((Instant::now(), line));
        }
    });
    let e = stderr.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(err).lines().map_while(Result::ok) {
            let mut e = e.lock().expect("stderr");
            e.push_str(&line);
            e.push('\n');
        }
    });
    Logs {
        child,
        lines,
        stderr,
    }
}

impl Logs {
    fn text(&self) -> String {
        self.lines
            .lock()
            .expect("lines")
            .iter()
            .map(|(_, l)| format!("{l}\n"))
            .collect()
    }

    fn first(&self, needle: &str) -> Option<Instant> {
        let lines = self.lines.lock().expect("lines");
        lines
            .iter()
            .find(|(_, l)| l.contains(needle))
            .map(|(t, _)| *t)
    }

    fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                // The readers finish with the pipes.
                std::thread::sleep(Duration::from_millis(100));
                return Some(s);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automaton_logs_follow_shows_a_running_agents_output_live_redacted_and_ends_with_the_run() {
    let env = Env::with_config(TOKENS_TOML);
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    let leaked = format!("the agent printed {WORKER_A_TOKEN} by mistake");
    let _w = scripted_worker(
        &coord,
        "gpu-a",
        "sim:24GiB",
        &[
            ("AUTOMATON_TOKEN", WORKER_A_TOKEN),
            ("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=4000"),
            ("AUTOMATON_SCRIPTED_SAY", &leaked),
        ],
    );
    ops.create("t").await.expect("create");
    poll("research running", Duration::from_secs(20), || {
        let mut api = ops.clone();
        async move {
            let d = api.get("t").await.ok()?;
            d.runs.iter().any(|r| r.state == "active").then_some(())
        }
    })
    .await;
    let mut follow = logs(&env, &coord, OPERATOR_TOKEN, &["t", "--follow"]);
    // Live: a step the agent printed is read while the run still holds its lease.
    let step = poll("a step printed", Duration::from_secs(20), || {
        let f = follow.first("working on t: step 2");
        async move { f }
    })
    .await;
    assert!(
        ops.lease_of("t").await.is_some(),
        "the output came while the run was live: {}",
        follow.text()
    );
    let status = follow
        .wait(Duration::from_secs(30))
        .expect("logs --follow ends when the run's output does");
    assert!(
        status.success(),
        "{status:?}: {}",
        follow.stderr.lock().expect("stderr")
    );
    let text = follow.text();
    assert!(text.contains("scripted agent: research of t"), "{text}");
    assert!(
        text.contains("the agent printed [redacted] by mistake"),
        "{text}"
    );
    assert!(
        !text.contains(WORKER_A_TOKEN),
        "a secret reached the output: {text}"
    );
    let stderr = follow.stderr.lock().expect("stderr").clone();
    assert!(stderr.contains("output ended (output closed)"), "{stderr}");
    // Lines came over seconds, not all at the end.
    let last = follow.first("working on t: step 30").expect("a later step");
    assert!(last > step + Duration::from_secs(1), "{text}");

    // Without --follow: what is kept, then the end.
    let mut once = logs(&env, &coord, OPERATOR_TOKEN, &["t"]);
    assert!(
        once.wait(Duration::from_secs(20))
            .is_some_and(|s| s.success())
    );
    assert!(
        once.text().contains("working on t: step 1"),
        "{}",
        once.text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automaton_logs_is_for_operators_and_says_when_nothing_is_kept() {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &[]);
    coord
        .api_as(OPERATOR_TOKEN)
        .await
        .create("t")
        .await
        .expect("create");
    let mut agent = logs(&env, &coord, AGENT_TOKEN, &["t"]);
    let s = agent.wait(Duration::from_secs(20)).expect("exits");
    assert!(!s.success());
    let err = agent.stderr.lock().expect("stderr").clone();
    assert!(err.contains("operator"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let mut none = logs(&env, &coord, OPERATOR_TOKEN, &["t"]);
    assert!(!none.wait(Duration::from_secs(20)).expect("exits").success());
    let err = none.stderr.lock().expect("stderr").clone();
    assert!(err.contains("no output of 't' is kept"), "{err}");
    let mut bad = logs(&env, &coord, OPERATOR_TOKEN, &["../etc"]);
    assert!(!bad.wait(Duration::from_secs(20)).expect("exits").success());
}

fn chunk(lease: &pb::Lease, offset: u64, data: &[u8]) -> pb::OutputChunk {
    pb::OutputChunk {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        offset,
        data: data.to_vec(),
        ended: false,
    }
}

async fn stream(
    coord: &Coord,
    token: &str,
    chunks: Vec<pb::OutputChunk>,
) -> Result<pb::StreamOutputResponse, tonic::Status> {
    let mut c = pb::work_client::WorkClient::new(coord.channel().await);
    c.stream_output(bearer(tokio_stream::iter(chunks), token))
        .await
        .map(|r| r.into_inner())
}

async fn tail(coord: &Coord, task: &str) -> Result<Vec<pb::OutputEvent>, tonic::Status> {
    use tokio_stream::StreamExt;
    let mut c = pb::workers_client::WorkersClient::new(coord.channel().await);
    let req = pb::TailOutputRequest {
        task: task.into(),
        ..Default::default()
    };
    let mut s = c
        .tail_output(bearer(req, OPERATOR_TOKEN))
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        out.push(ev?);
    }
    Ok(out)
}

fn bytes_of(events: &[pb::OutputEvent]) -> Vec<u8> {
    events.iter().flat_map(|e| e.data.clone()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_output_under_another_agents_lease_a_stale_token_or_bad_sizes_is_refused_and_keeps_nothing()
 {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &[]);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    ops.claimable_task("t").await;
    let mut a = coord.api_as(AGENT_TOKEN).await;
    let lease = a.claim("t", "agent-a", 60_000).await.expect("claim");
    let ok = stream(&coord, AGENT_TOKEN, vec![chunk(&lease, 0, b"hello\n")])
        .await
        .expect("the holder streams");
    assert_eq!(ok.end, 6);
    let refused = [
        // Another agent naming agent-a's lease.
        (
            AGENT_B_TOKEN,
            chunk(&lease, 6, b"B\n"),
            Code::PermissionDenied,
        ),
        // A stale fencing token.
        (
            AGENT_TOKEN,
            pb::OutputChunk {
                token: lease.token + 1,
                ..chunk(&lease, 6, b"stale\n")
            },
            Code::FailedPrecondition,
        ),
        // No such lease, an empty id.
        (
            AGENT_TOKEN,
            pb::OutputChunk {
                lease_id: String::new(),
                ..chunk(&lease, 6, b"x\n")
            },
            Code::NotFound,
        ),
        // 1 MiB in one chunk.
        (
            AGENT_TOKEN,
            chunk(&lease, 6, &vec![b'x'; 1 << 20]),
            Code::InvalidArgument,
        ),
        // An offset at u64::MAX.
        (
            AGENT_TOKEN,
            chunk(&lease, u64::MAX, b"x"),
            Code::InvalidArgument,
        ),
    ];
    for (token, c, code) in refused {
        let e = stream(&coord, token, vec![c]).await.expect_err("refused");
        assert_eq!(e.code(), code, "{e:?}");
        assert!(
            !e.message().is_empty() && !e.message().contains('\n'),
            "{e:?}"
        );
    }
    assert_eq!(
        bytes_of(&tail(&coord, "t").await.expect("tail")),
        b"hello\n"
    );
    // Sent again (a worker after a failover): kept once.
    stream(
        &coord,
        AGENT_TOKEN,
        vec![chunk(&lease, 0, b"hello\nworld\n")],
    )
    .await
    .expect("again");
    assert_eq!(
        bytes_of(&tail(&coord, "t").await.expect("tail")),
        b"hello\nworld\n"
    );
    // Once the lease ends, nothing more is taken.
    a.release(&lease.lease_id, lease.token)
        .await
        .expect("release");
    let e = stream(&coord, AGENT_TOKEN, vec![chunk(&lease, 12, b"late\n")])
        .await
        .expect_err("after the release");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let events = tail(&coord, "t").await.expect("tail");
    assert_eq!(bytes_of(&events), b"hello\nworld\n");
    let last = events.last().expect("an event");
    assert!(last.ended, "{last:?}");
    assert_eq!(last.end_reason, "the run's lease ended");
}
