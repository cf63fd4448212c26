//! Issue 20: uploads under load and Work calls retried. Four 260 MiB patch streams at once
//! stay within the coordinator's upload memory (its peak RSS read from `/proc/PID/status`);
//! the same artifact, patch or completion sent twice, and again after a `kill -9`, lands once
//! and is answered the same. The real coordinator binary, real gRPC, a real git repository.

use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use pb::work_client::WorkClient;
use tonic::Code;

use crate::harness::*;
use crate::work::{artifact, git, git_init, manifest};

const MIB: u64 = 1 << 20;
/// What docs/coordinator.md promises: the coordinator's peak RSS stays under
/// `max_upload_memory_bytes` (512 MiB by default) plus this much.
const RSS_ABOVE_BUDGET: u64 = 64 * MIB;

/// A field of `/proc/PID/status` in bytes (`VmHWM`: the peak resident set; `VmRSS`: now).
fn proc_status_bytes(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().strip_suffix(" kB"))
        .and_then(|kb| kb.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// A patch of one file, `mib` MiB long, made chunk by chunk as the stream is read (the test
/// never holds it).
fn big_patch(
    lease_id: &str,
    token: u64,
    base: &str,
    mib: usize,
) -> impl tokio_stream::Stream<Item = pb::PatchChunk> + Send + 'static {
    let (lease_id, base) = (lease_id.to_string(), base.to_string());
    tokio_stream::iter((0..mib).map(move |i| pb::PatchChunk {
        lease_id: if i == 0 {
            lease_id.clone()
        } else {
            String::new()
        },
        token,
        base_commit: if i == 0 { base.clone() } else { String::new() },
        change: Some(pb::FileChange {
            path: "big.bin".into(),
            deleted: false,
            executable: false,
            data: vec![(i % 251) as u8; MIB as usize],
            last: i + 1 == mib,
        }),
    }))
}

fn small_patch(lease: &pb::Lease, base: &str, path: &str, body: &[u8]) -> Vec<pb::PatchChunk> {
    vec![pb::PatchChunk {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        base_commit: base.into(),
        change: Some(pb::FileChange {
            path: path.into(),
            deleted: false,
            executable: false,
            data: body.to_vec(),
            last: true,
        }),
    }]
}

/// `t` in implement, leased to `agent-x`.
async fn implement_lease(api: &mut Api, env: &Env) -> pb::Lease {
    api.approved_research(env, "t", Some("implement")).await;
    api.claim("t", "agent-x", 60_000)
        .await
        .expect("claim implement")
}

fn complete(lease: &pb::Lease, token: u64) -> pb::CompletePhaseRequest {
    pb::CompletePhaseRequest {
        lease_id: lease.lease_id.clone(),
        token,
        target: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_260_mib_patches_are_refused_and_the_rss_stays_under_the_upload_memory_bound()
 {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    let lease = implement_lease(&mut api, &env).await;
    let mut work = WorkClient::new(coord.channel().await);
    let base = manifest(&mut work, &lease).await.commit;
    let tip = git(&env, &["rev-parse", "automaton/t"]);
    let pid = coord.pid();
    let before = proc_status_bytes(pid, "VmHWM");
    // Each stream on its own connection, as four workers would send them; and one under a
    // forged token.
    let mut calls = Vec::new();
    for token in [lease.token; 4].into_iter().chain([lease.token + 1000]) {
        let mut w = WorkClient::new(coord.channel().await).max_encoding_message_size(8 << 20);
        let stream = big_patch(&lease.lease_id, token, &base, 260);
        calls.push(tokio::spawn(async move { w.upload_patch(stream).await }));
    }
    // VmHWM is the peak; VmRSS sampled meanwhile shows the shape (reported on failure).
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut most = 0;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                most = most.max(proc_status_bytes(pid, "VmRSS"));
                std::thread::sleep(Duration::from_millis(20));
            }
            most
        })
    };
    let started = Instant::now();
    let mut codes = Vec::new();
    for c in calls {
        let s = c.await.expect("join").expect_err("a 260 MiB patch");
        assert!(
            !s.message().contains('\n') && s.message().len() < 300,
            "one short line: {s:?}"
        );
        codes.push((s.code(), s.message().to_string()));
    }
    let took = started.elapsed();
    let peak = proc_status_bytes(pid, "VmHWM");
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let sampled = sampler.join().expect("sampler");
    eprintln!(
        "4 x 260 MiB + 1 forged: {took:?}; VmHWM {} MiB before, {} MiB after (VmRSS sampled up to {} MiB); {codes:#?}",
        before / MIB,
        peak / MIB,
        sampled / MIB
    );
    let forged = codes.pop().expect("five calls");
    assert_eq!(forged.0, Code::FailedPrecondition, "{forged:?}");
    for (code, message) in &codes {
        assert_eq!(*code, Code::ResourceExhausted, "{message}");
        assert!(
            message.contains("max_upload_memory_bytes") || message.contains("larger than"),
            "says why and what to do: {message}"
        );
    }
    let bound = 512 * MIB + RSS_ABOVE_BUDGET;
    assert!(
        peak < bound,
        "the coordinator's peak RSS {} MiB passed the documented bound {} MiB",
        peak / MIB,
        bound / MIB
    );
    assert_eq!(
        git(&env, &["rev-parse", "automaton/t"]),
        tip,
        "the branch moved"
    );
    // The budget is given back: a patch of a sane size lands afterwards.
    let ok = work
        .upload_patch(tokio_stream::iter(small_patch(
            &lease,
            &base,
            "README.md",
            b"# after\n",
        )))
        .await
        .expect("a small patch after the storm")
        .into_inner();
    assert_eq!(ok.files_changed, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_takes_its_announced_size_from_the_upload_budget_at_once() {
    let env = Env::new();
    let coord = Coord::start_with_env(
        &env,
        &["--no-dispatch"],
        &[
            ("AUTOMATON_MAX_ARTIFACT_BYTES", "4194304"),
            ("AUTOMATON_MAX_UPLOAD_MEMORY_BYTES", "6291456"),
        ],
    );
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    let body = vec![b'a'; 4 << 20];
    let mut chunks = artifact(&lease, "SPEC.md", &body);
    let rest = chunks[0].data.split_off(1 << 20);
    // The first announces 4 MiB and sends 1 MiB, then waits.
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(chunks.remove(0)).await.expect("send");
    let mut w1 = WorkClient::new(coord.channel().await);
    let first = tokio::spawn(async move {
        w1.upload_artifact(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // 4 of the 6 MiB are taken: a second one announcing 3 MiB is refused at once.
    let mut w2 = WorkClient::new(coord.channel().await);
    let s = w2
        .upload_artifact(tokio_stream::iter(artifact(
            &lease,
            "SPEC.md",
            &vec![b'b'; 3 << 20],
        )))
        .await
        .expect_err("over the budget");
    assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
    assert!(s.message().contains("retry this upload later"), "{s:?}");
    assert_eq!(env.task_file("t", "SPEC.md"), None, "nothing written");
    // The first finishes; its bytes are given back and the second, retried, lands.
    tx.send(pb::ArtifactChunk {
        data: rest,
        ..Default::default()
    })
    .await
    .expect("send the rest");
    drop(tx);
    let ok = first.await.expect("join").expect("the first").into_inner();
    assert_eq!(ok.size, 4 << 20);
    let again = w2
        .upload_artifact(tokio_stream::iter(artifact(
            &lease,
            "SPEC.md",
            &vec![b'b'; 3 << 20],
        )))
        .await
        .expect("retried once the budget is back")
        .into_inner();
    assert_eq!(again.size, 3 << 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_artifact_twice_and_again_after_a_kill_9_is_one_artifact_with_the_same_answer() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    let spec = b"# Spec\nonce\n".to_vec();
    let mut answers = Vec::new();
    for round in 0..3 {
        if round == 2 {
            coord.restart_after_kill(&["--no-dispatch"]);
        }
        let mut work = WorkClient::new(coord.channel().await);
        let a = work
            .upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", &spec)))
            .await
            .unwrap_or_else(|s| panic!("upload {round}: {s:?}"))
            .into_inner();
        answers.push(a);
    }
    for a in &answers {
        assert_eq!(
            (a.name.as_str(), a.size, a.sha256.as_str()),
            ("SPEC.md", spec.len() as u64, answers[0].sha256.as_str())
        );
    }
    // Only the first wrote: the others found these bytes there already.
    let unchanged: Vec<bool> = answers.iter().map(|a| a.unchanged).collect();
    assert_eq!(unchanged, [false, true, true]);
    assert_eq!(env.task_file("t", "SPEC.md"), Some(spec));
    let names: Vec<String> = std::fs::read_dir(env.task_dir("t"))
        .expect("task folder")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(names, ["SPEC.md"], "one artifact, no leftovers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_patch_twice_and_again_after_a_kill_9_is_one_commit_with_the_same_answer() {
    let env = Env::new();
    git_init(&env);
    let mut coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    let lease = implement_lease(&mut api, &env).await;
    let mut work = WorkClient::new(coord.channel().await);
    let base = manifest(&mut work, &lease).await.commit;
    let patch = small_patch(&lease, &base, "README.md", b"# patched once\n");
    let mut answers = Vec::new();
    for round in 0..3 {
        if round == 2 {
            coord.restart_after_kill(&["--no-dispatch"]);
            work = WorkClient::new(coord.channel().await);
        }
        let r = work
            .upload_patch(tokio_stream::iter(patch.clone()))
            .await
            .unwrap_or_else(|s| panic!("patch {round}: {s:?}"))
            .into_inner();
        answers.push(r);
    }
    assert_ne!(answers[0].commit, "", "the first commits");
    assert_eq!(answers[0].files_changed, 1);
    assert!(answers.iter().all(|a| *a == answers[0]), "{answers:#?}");
    assert_eq!(
        git(&env, &["rev-parse", "automaton/t"]).trim(),
        answers[0].commit
    );
    assert_eq!(
        git(
            &env,
            &["rev-list", "--count", &format!("{base}..automaton/t")]
        )
        .trim(),
        "1",
        "one commit"
    );
    // Another patch of the same path against the old base is still a conflict.
    let s = work
        .upload_patch(tokio_stream::iter(small_patch(
            &lease,
            &base,
            "README.md",
            b"# other\n",
        )))
        .await
        .expect_err("a real conflict");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_completion_twice_and_again_after_a_kill_9_is_one_transition_with_the_same_answer()
{
    let env = Env::new();
    let mut coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    // A lease that ends without completing: a stale one.
    let stale = api.claim("t", "agent-x", 60_000).await.expect("claim");
    api.release(&stale.lease_id, stale.token)
        .await
        .expect("release");
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    let mut events = Events::watch(&api).await;
    let mut work = WorkClient::new(coord.channel().await);
    work.upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", b"# Spec\n")))
        .await
        .expect("upload");
    let first = work
        .complete_phase(complete(&lease, lease.token))
        .await
        .expect("complete")
        .into_inner();
    assert_eq!(
        (first.from.as_str(), first.to.as_str()),
        ("research", "research:awaiting_approval")
    );
    let again = work
        .complete_phase(complete(&lease, lease.token))
        .await
        .expect("the same completion again")
        .into_inner();
    assert_eq!(again, first);
    let transitions = events
        .settle(Duration::from_millis(300))
        .await
        .iter()
        .filter(|e| e.kind == "transitioned" && e.task == "t")
        .count();
    assert_eq!(transitions, 1, "one transition");
    // Not the same completion: another token, another target, the stale lease.
    let mut other_target = complete(&lease, lease.token);
    other_target.target = "implement".into();
    for (what, req) in [
        ("another token", complete(&lease, lease.token + 1)),
        ("another target", other_target),
        ("the stale lease", complete(&stale, stale.token)),
    ] {
        let s = work.complete_phase(req).await.expect_err(what);
        assert_eq!(s.code(), Code::NotFound, "{what}: {s:?}");
    }
    coord.restart_after_kill(&["--no-dispatch"]);
    let mut work = WorkClient::new(coord.channel().await);
    let after = work
        .complete_phase(complete(&lease, lease.token))
        .await
        .expect("the same completion after a kill -9")
        .into_inner();
    assert_eq!(after, first);
    let s = work
        .complete_phase(complete(&stale, stale.token))
        .await
        .expect_err("the stale lease after the restart");
    assert_eq!(s.code(), Code::NotFound, "{s:?}");
    let mut api = coord.api().await;
    assert_eq!(api.state("t").await, "research:awaiting_approval");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_cut_off_by_kill_9_after_its_state_write_is_answered_as_done_on_retry() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    let mut work = WorkClient::new(coord.channel().await);
    work.upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", b"# Spec\n")))
        .await
        .expect("upload");
    // The transition's `.state` reached the disk, then the process died: no record, and the
    // lease's end is not in the log.
    coord.kill9();
    std::fs::write(
        env.task_dir("t").join(".state"),
        "research:awaiting_approval\n",
    )
    .expect("write .state");
    coord = Coord::start(&env, &["--no-dispatch"]);
    let mut work = WorkClient::new(coord.channel().await);
    let r = work
        .complete_phase(complete(&lease, lease.token))
        .await
        .expect("the completion, retried")
        .into_inner();
    assert_eq!(
        (r.from.as_str(), r.to.as_str()),
        ("research", "research:awaiting_approval")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_gives_its_memory_back_at_the_rpc_timeout() {
    let env = Env::new();
    let coord = Coord::start_with_env(
        &env,
        &["--no-dispatch"],
        &[
            ("AUTOMATON_RPC_TIMEOUT", "1s"),
            ("AUTOMATON_MAX_ARTIFACT_BYTES", "4194304"),
            ("AUTOMATON_MAX_UPLOAD_MEMORY_BYTES", "4194304"),
        ],
    );
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    // Announces the whole budget, sends one chunk, and never another.
    let mut chunks = artifact(&lease, "SPEC.md", &vec![b'a'; 4 << 20]);
    chunks[0].data.truncate(1 << 20);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tx.send(chunks.remove(0)).await.expect("send");
    let mut w1 = WorkClient::new(coord.channel().await);
    let stalled = tokio::spawn(async move {
        w1.upload_artifact(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
    });
    let s = stalled.await.expect("join").expect_err("cut off");
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
    drop(tx);
    let mut w2 = WorkClient::new(coord.channel().await);
    let ok = w2
        .upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", b"# Spec\n")))
        .await
        .expect("the budget is back")
        .into_inner();
    assert_eq!(ok.size, 7);
}
