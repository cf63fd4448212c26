//! Issue 11: workers do the work. A real coordinator dispatches to real `automaton-worker`
//! processes running the scripted agent (a real child process); the project is a real git
//! repository; operators approve with the real CLI.

use std::process::Command;
use std::time::{Duration, Instant};

use automaton_proto::v1 as pb;
use pb::work_client::WorkClient;
use sha2::{Digest, Sha256};
use tonic::Code;

use crate::harness::*;
use crate::workers::Worker;

/// Short session timings, so worker deaths are noticed fast.
pub const FLEET: [&str; 4] = ["--session-timeout", "1s", "--heartbeat-interval", "200ms"];

/// Makes the project a git repository with one commit (README.md, src/lib.rs).
pub fn git_init(env: &Env) {
    let root = env.root();
    std::fs::create_dir_all(root.join("src")).expect("mkdir src");
    std::fs::write(root.join("README.md"), "# demo\n").expect("readme");
    std::fs::write(root.join("src/lib.rs"), "pub fn f() {}\n").expect("lib");
    for args in [
        vec!["init", "-q", "-b", "main"],
        vec!["add", "README.md", "src/lib.rs"],
        vec![
            "-c",
            "user.name=test",
            "-c",
            "user.email=test@example.com",
            "commit",
            "-q",
            "-m",
            "init",
        ],
    ] {
        let st = Command::new("git")
            .args(&args)
            .current_dir(root)
            .env("HOME", env.home.path())
            .status()
            .expect("run git");
        assert!(st.success(), "git {args:?}");
    }
}

pub fn git(env: &Env, args: &[&str]) -> String {
    let out = Command::new("git")
        .args(args)
        .current_dir(env.root())
        .env("HOME", env.home.path())
        .output()
        .expect("run git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn worker(coord: &Coord, name: &str, envs: &[(&str, &str)]) -> Worker {
    scripted_worker(coord, name, "sim:24GiB", envs)
}

/// A worker running the scripted agent on a simulated GPU `gpu` (e.g. `sim:24GiB`).
pub fn scripted_worker(coord: &Coord, name: &str, gpu: &str, envs: &[(&str, &str)]) -> Worker {
    scripted_worker_at(&coord.url, name, gpu, envs)
}

/// [`scripted_worker`] given coordinator URLs (one, or a comma-separated list).
pub fn scripted_worker_at(url: &str, name: &str, gpu: &str, envs: &[(&str, &str)]) -> Worker {
    Worker::start(
        url,
        &[
            "--name",
            name,
            "--simulate-gpu",
            gpu,
            "--agent",
            "scripted",
            "--kill-grace",
            "300ms",
        ],
        envs,
    )
}

/// Drives `task` to a terminal state, approving each gate with `approve`; returns the state.
async fn drive(api: &mut Api, task: &str, timeout: Duration, mut approve: impl FnMut()) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let state = api.state(task).await;
        if state.ends_with(":awaiting_approval") {
            approve();
        } else if state == "complete" || state == "human_intervention" {
            return state;
        }
        assert!(
            Instant::now() < deadline,
            "{task} is stuck in {state}; runs: {:#?}",
            api.get(task).await.map(|d| d.runs)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn cli_approve(env: &Env, task: &str) {
    env.cli(&["--task", task, "--approve", "--approver", "ops"])
        .ok();
}

/// The live processes running the scripted agent of worker `w` (in a workspace under its work
/// dir; zombies excluded), with their fencing token.
fn scripted_agents(w: &Worker) -> Vec<(u32, String)> {
    let mine = w.work_dir();
    live_processes()
        .into_iter()
        .filter(|p| p.cmdline.contains("scripted-agent"))
        .filter(|p| std::fs::read_link(p.dir.join("cwd")).is_ok_and(|d| d.starts_with(&mine)))
        .map(|p| {
            let environ = std::fs::read(p.dir.join("environ")).unwrap_or_default();
            let token = environ
                .split(|b| *b == 0)
                .filter_map(|v| std::str::from_utf8(v).ok())
                .find_map(|v| v.strip_prefix("AUTOMATON_FENCING_TOKEN="))
                .unwrap_or("")
                .to_string();
            (p.pid, token)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_scripted_workers_take_a_task_from_new_to_complete_with_cli_approvals() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let _a = worker(&coord, "gpu-a", &[]);
    let _b = worker(&coord, "gpu-b", &[]);
    env.cli(&["--create-task", "t"]).ok();
    let end = drive(&mut api, "t", Duration::from_secs(90), || {
        cli_approve(&env, "t")
    })
    .await;
    assert_eq!(end, "complete");
    // Every artifact of the path taken is in the task folder.
    for a in [
        "SPEC.md",
        "DESIGN.md",
        "IMPLEMENTATION.md",
        "CODE_REVIEW.md",
        "BUG_REPORT.md",
        "ADVERSARIAL_BUG_REPORT.md",
        "DOC_REVIEW.md",
        "VERDICT.md",
    ] {
        let body = env.task_file("t", a).unwrap_or_default();
        assert!(!body.is_empty(), "{a} missing or empty");
    }
    let runs = api.get("t").await.expect("GetTask").runs;
    let by = |phase: &str| -> String {
        runs.iter()
            .find(|r| r.phase == phase && r.stop_reason == "completed")
            .unwrap_or_else(|| panic!("no completed {phase} run: {runs:#?}"))
            .worker
            .clone()
    };
    let (implementer, reviewer) = (by("implement"), by("code_review"));
    assert_ne!(implementer, reviewer, "reviewer ≠ implementer");
    // The task branch holds the implement commit, authored by the implementing worker.
    let log = git(&env, &["log", "--format=%an|%s", "automaton/t"]);
    assert!(
        log.lines()
            .any(|l| l.starts_with(&format!("{implementer}|t: implement by {implementer}"))),
        "{log}"
    );
    let file = git(&env, &["show", "automaton/t:AUTOMATON_SCRIPTED.md"]);
    assert!(file.contains("implement"), "{file}");
    // The default branch and the working tree are untouched.
    assert_eq!(git(&env, &["log", "--format=%s", "main"]).trim(), "init");
    assert!(!env.root().join("AUTOMATON_SCRIPTED.md").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_a_worker_mid_phase_the_other_takes_it_within_the_session_timeout_and_it_completes()
{
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    // gpu-a is slow: it is mid-phase when it dies.
    let mut a = worker(
        &coord,
        "gpu-a",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=20000")],
    );
    api.create("t").await.expect("create");
    let first = events
        .find("the research assignment", Duration::from_secs(10), |e| {
            e.kind == "assigned" && e.task == "t"
        })
        .await;
    assert_eq!(first.agent, "gpu-a");
    let b = worker(&coord, "gpu-b", &[]);
    let killed = Instant::now();
    a.kill9();
    let second = events
        .find("the reassignment", Duration::from_secs(10), |e| {
            e.kind == "assigned" && e.task == "t" && e.agent == "gpu-b"
        })
        .await;
    let took = killed.elapsed();
    assert!(
        took < Duration::from_millis(1000 + 1000),
        "reassigned {took:?} after kill -9 (session timeout 1 s)"
    );
    assert!(second.token > first.token);
    // A fresh worker to review what gpu-b implements.
    let _c = worker(&coord, "gpu-c", &[]);
    let end = drive(&mut api, "t", Duration::from_secs(90), || {
        cli_approve(&env, "t")
    })
    .await;
    assert_eq!(end, "complete");
    drop(b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstop_a_worker_mid_phase_past_the_timeout_then_sigcont_its_agent_group_is_gone_and_nothing_it_sent_lands()
 {
    let env = Env::with_config(&tokens_with_gpu_c());
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    // Straight to implement (research and design approved by the operator).
    ops.approved_research(&env, "t", Some("design")).await;
    env.artifact("t", "DESIGN.md", "# Design\n");
    ops.transition("t", "design:awaiting_approval")
        .await
        .expect("await");
    ops.approve("t", "").await.expect("approve design");
    let mut events = Events::watch(&ops).await;
    // gpu-a's agent hangs (ignoring SIGTERM) in implement.
    let a = Worker::start(
        &coord.url,
        &[
            "--token",
            WORKER_A_TOKEN,
            "--agent",
            "scripted",
            "--kill-grace",
            "300ms",
        ],
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "hang")],
    );
    let first = events
        .find(
            "implement assigned to gpu-a",
            Duration::from_secs(10),
            |e| e.kind == "assigned" && e.task == "t",
        )
        .await;
    assert_eq!(first.agent, "gpu-a");
    let theirs = first.token.to_string();
    poll("gpu-a's agent runs", Duration::from_secs(10), || async {
        scripted_agents(&a)
            .iter()
            .any(|(_, t)| *t == theirs)
            .then_some(())
    })
    .await;
    signal(a.pid(), "-STOP");
    // Past the session timeout: the lease ends; another worker takes implement and finishes
    // it. (gpu-c is there to review it: with gpu-b alone, implement would wait for gpu-a, its
    // only implementer, rather than leave nobody to review it.)
    let _b = Worker::start(
        &coord.url,
        &["--token", WORKER_B_TOKEN, "--agent", "scripted"],
        &[],
    );
    let _c = Worker::start(
        &coord.url,
        &["--token", WORKER_C_TOKEN, "--agent", "scripted"],
        &[],
    );
    events
        .find("gpu-b's implement done", Duration::from_secs(15), |e| {
            e.kind == "transitioned" && e.task == "t" && e.detail == "implement → code_review"
        })
        .await;
    let before_files = env.task_file("t", "IMPLEMENTATION.md");
    let before_branch = git(&env, &["log", "--format=%an|%s", "automaton/t"]);
    // gpu-a's agent is still there while its worker is stopped...
    assert!(
        scripted_agents(&a).iter().any(|(_, t)| *t == theirs),
        "gpu-a's agent died while its worker was stopped: {:?};\ngpu-a:\n{}",
        scripted_agents(&a),
        a.stderr()
    );
    signal(a.pid(), "-CONT");
    // ...and gone once the worker learns its lease is lost (SIGTERM ignored: SIGKILL).
    let deadline = Instant::now() + Duration::from_secs(10);
    while scripted_agents(&a).iter().any(|(_, t)| *t == theirs) {
        assert!(
            Instant::now() < deadline,
            "gpu-a's agent group still runs: {:?};\ngpu-a:\n{}",
            scripted_agents(&a),
            a.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        a.wait_stdout_n("joined ", 2, Duration::from_secs(10)),
        "gpu-a registers again: {}",
        a.stderr()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Nothing of gpu-a's reached the folder or the branch.
    assert_eq!(env.task_file("t", "IMPLEMENTATION.md"), before_files);
    let after_branch = git(&env, &["log", "--format=%an|%s", "automaton/t"]);
    assert_eq!(after_branch, before_branch);
    assert!(!after_branch.contains("gpu-a|"), "{after_branch}");
    let runs = ops.get("t").await.expect("GetTask").runs;
    let lost = runs
        .iter()
        .find(|r| r.token == first.token)
        .expect("gpu-a's run is recorded");
    assert_eq!(lost.state, "stopped", "{runs:#?}");
    assert_eq!(lost.stop_reason, "lease_lost", "{runs:#?}");
}

/// FetchWorkspace under `lease`, offering no cached tree (it creates the task's branch).
pub async fn fetch_workspace(
    work: &mut WorkClient<tonic::transport::Channel>,
    lease: &pb::Lease,
) -> tonic::Streaming<pb::WorkspaceChunk> {
    work.fetch_workspace(pb::FetchWorkspaceRequest {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        cached_commits: vec![],
    })
    .await
    .expect("FetchWorkspace")
    .into_inner()
}

/// The workspace manifest for `lease`, from a FetchWorkspace that offers no cached tree
/// (fetching it creates the task's branch).
pub async fn manifest(
    work: &mut WorkClient<tonic::transport::Channel>,
    lease: &pb::Lease,
) -> pb::WorkspaceManifest {
    let mut fetch = fetch_workspace(work, lease).await;
    let Some(pb::WorkspaceChunk {
        part: Some(pb::workspace_chunk::Part::Manifest(m)),
    }) = fetch.message().await.expect("manifest")
    else {
        panic!("the workspace starts with its manifest");
    };
    m
}

pub fn sha(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

pub fn artifact(lease: &pb::Lease, name: &str, body: &[u8]) -> Vec<pb::ArtifactChunk> {
    vec![pb::ArtifactChunk {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        name: name.into(),
        sha256: sha(body),
        size: body.len() as u64,
        data: body.to_vec(),
    }]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_uploads_are_refused_with_the_right_code_and_leave_the_folder_and_branch_unchanged() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start_with_env(
        &env,
        &["--no-dispatch"],
        &[("AUTOMATON_MAX_ARTIFACT_BYTES", "4096")],
    );
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    let mut work = WorkClient::new(coord.channel().await);
    let before = env.snapshot();
    let spec = b"# Spec\nreal\n".to_vec();
    let mut wrong_sum = artifact(&lease, "SPEC.md", &spec);
    wrong_sum[0].sha256 = sha(b"other");
    let mut oversized_declared = artifact(&lease, "SPEC.md", &[b'a'; 5000]);
    oversized_declared[0].data.truncate(10);
    let mut more_than_declared = artifact(&lease, "SPEC.md", b"abc");
    more_than_declared.push(pb::ArtifactChunk {
        data: vec![b'x'; 100],
        ..Default::default()
    });
    let mut stale = artifact(&lease, "SPEC.md", &spec);
    stale[0].token = lease.token + 1;
    let cases: Vec<(&str, Vec<pb::ArtifactChunk>, Code, &str)> = vec![
        ("wrong checksum", wrong_sum, Code::InvalidArgument, "sha256"),
        (
            "hidden name",
            artifact(&lease, ".state", &spec),
            Code::InvalidArgument,
            "not an artifact name",
        ),
        (
            "a path",
            artifact(&lease, "../x", &spec),
            Code::InvalidArgument,
            "not an artifact name",
        ),
        (
            "a subfolder",
            artifact(&lease, "a/SPEC.md", &spec),
            Code::InvalidArgument,
            "not an artifact name",
        ),
        (
            "another phase's",
            artifact(&lease, "DESIGN.md", &spec),
            Code::FailedPrecondition,
            "upload SPEC.md",
        ),
        (
            "not UTF-8",
            artifact(&lease, "SPEC.md", &[0xff, 0xfe, b'\n']),
            Code::InvalidArgument,
            "UTF-8",
        ),
        (
            "declared too large",
            oversized_declared,
            Code::ResourceExhausted,
            "4096",
        ),
        (
            "more than declared",
            more_than_declared,
            Code::ResourceExhausted,
            "more bytes",
        ),
        ("stale token", stale, Code::FailedPrecondition, "token"),
    ];
    for (what, chunks, code, contains) in cases {
        let s = work
            .upload_artifact(tokio_stream::iter(chunks))
            .await
            .expect_err(what);
        assert_eq!(s.code(), code, "{what}: {s:?}");
        assert!(s.message().contains(contains), "{what}: {s:?}");
        assert!(
            s.message().len() < 400 && !s.message().contains('\n'),
            "{what}: {s:?}"
        );
    }
    assert!(env.snapshot() == before, "a refused upload changed files");
    // The real thing lands; the same bytes again is success, unchanged.
    let ok = work
        .upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", &spec)))
        .await
        .expect("upload")
        .into_inner();
    assert!(!ok.unchanged);
    assert_eq!(env.task_file("t", "SPEC.md"), Some(spec.clone()));
    let again = work
        .upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", &spec)))
        .await
        .expect("again")
        .into_inner();
    assert!(again.unchanged);
    // Research may not change code.
    let patch = |lease: &pb::Lease, base: &str, path: &str, body: &[u8]| {
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
    };
    let head = git(&env, &["rev-parse", "HEAD"]).trim().to_string();
    let s = work
        .upload_patch(tokio_stream::iter(patch(&lease, &head, "README.md", b"x")))
        .await
        .expect_err("research edits no code");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    // After the lease ends, nothing is accepted under it.
    api.release(&lease.lease_id, lease.token)
        .await
        .expect("release");
    let s = work
        .upload_artifact(tokio_stream::iter(artifact(&lease, "SPEC.md", b"late\n")))
        .await
        .expect_err("an ended lease");
    assert_eq!(s.code(), Code::NotFound, "{s:?}");
    assert_eq!(env.task_file("t", "SPEC.md"), Some(spec));

    // Patches in implement: one applies; a second against the old base touching the same
    // path is refused naming it; a bad path is refused; the branch is unchanged by both.
    api.transition("t", "research:awaiting_approval")
        .await
        .expect("await");
    api.approve("t", "").await.expect("approve");
    api.transition("t", "implement").await.expect("implement");
    let lease = api
        .claim("t", "agent-x", 60_000)
        .await
        .expect("claim implement");
    let m = manifest(&mut work, &lease).await;
    assert_eq!(m.branch, "automaton/t");
    assert!(m.code_included);
    assert!(
        m.files
            .iter()
            .any(|f| f.kind == "code" && f.path == "src/lib.rs")
    );
    assert!(
        m.files
            .iter()
            .any(|f| f.kind == "task" && f.path == "SPEC.md")
    );
    assert!(!m.files.iter().any(|f| f.path.starts_with(".automaton")));
    let base = m.commit.clone();
    let first = work
        .upload_patch(tokio_stream::iter(patch(
            &lease,
            &base,
            "README.md",
            b"# one\n",
        )))
        .await
        .expect("first patch")
        .into_inner();
    assert_eq!(first.files_changed, 1);
    let tip = git(&env, &["rev-parse", "automaton/t"]);
    for (what, chunks, code, contains) in [
        (
            "a conflict",
            patch(&lease, &base, "README.md", b"# two\n"),
            Code::FailedPrecondition,
            "README.md",
        ),
        (
            "a path out of the tree",
            patch(&lease, &base, "../x", b"x"),
            Code::InvalidArgument,
            "../x",
        ),
        (
            "the task store",
            patch(&lease, &base, ".automaton/tasks/t/.state", b"complete\n"),
            Code::InvalidArgument,
            ".automaton",
        ),
    ] {
        let s = work
            .upload_patch(tokio_stream::iter(chunks))
            .await
            .expect_err(what);
        assert_eq!(s.code(), code, "{what}: {s:?}");
        assert!(s.message().contains(contains), "{what}: {s:?}");
        assert_eq!(
            git(&env, &["rev-parse", "automaton/t"]),
            tip,
            "{what} moved the branch"
        );
    }
    // An empty patch is fine and commits nothing.
    let empty = work
        .upload_patch(tokio_stream::iter(vec![pb::PatchChunk {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            base_commit: base,
            change: None,
        }]))
        .await
        .expect("empty patch")
        .into_inner();
    assert_eq!(empty.commit, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_agents_end_with_their_stop_reason_are_offered_again_and_then_held() {
    // A phase past MAX_PHASE_TIME is held at once (seed 002), not retried.
    for (behaviour, reason, detail, held_as, runs) in [
        (
            "exit-1",
            "agent_error",
            "exit status 1",
            "2 failed runs of research",
            2,
        ),
        (
            "no-artifact",
            "agent_error",
            "no SPEC.md written",
            "2 failed runs of research",
            2,
        ),
        (
            "hang",
            "timed_out",
            "",
            "MAX_PHASE_TIME exceeded: research",
            1,
        ),
    ] {
        let env = Env::new();
        git_init(&env);
        let mut args = FLEET.to_vec();
        args.extend(["--max-phase-time", "1s"]);
        let coord = Coord::start_with_env(&env, &args, &[("AUTOMATON_MAX_ATTEMPTS", "2")]);
        let mut api = coord.api().await;
        let _w = worker(
            &coord,
            "gpu-a",
            &[("AUTOMATON_SCRIPTED_BEHAVIOUR", behaviour)],
        );
        api.create("t").await.expect("create");
        let detail_of = poll(
            &format!("{behaviour}: the task held after {runs} failed runs"),
            Duration::from_secs(30),
            || {
                let mut api = api.clone();
                async move {
                    let d = api.get("t").await.ok()?;
                    (!held(&d).is_empty()).then_some(d)
                }
            },
        )
        .await;
        let failed: Vec<&pb::Run> = detail_of
            .runs
            .iter()
            .filter(|r| r.state == "stopped")
            .collect();
        assert_eq!(failed.len(), runs, "{behaviour}: {:#?}", detail_of.runs);
        for r in &failed {
            assert_eq!(r.stop_reason, reason, "{behaviour}: {r:?}");
            assert!(r.detail.contains(detail), "{behaviour}: {r:?}");
        }
        assert!(
            held(&detail_of).contains(held_as),
            "{behaviour}: {}",
            held(&detail_of)
        );
        // Held: nothing more is dispatched; the CLI shows why and the runs.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(api.lease_of("t").await.is_none(), "{behaviour}");
        let out = env.cli(&["--task", "t"]);
        assert!(
            out.stdout
                .contains(&format!("Held from dispatch: {held_as}")),
            "{}",
            out.stdout
        );
        assert!(
            out.stdout.contains(&format!("({reason})")),
            "{}",
            out.stdout
        );
        // An operator resumes it: it is offered again. A fast-failing agent can take and
        // end its lease between two polls, so "offered again" is a new run (or a live lease).
        let runs_before = detail_of.runs.len();
        let mut c = Command::new(cli_bin());
        c.args(["stop", "t", "--resume", "--coordinator", &coord.url])
            .env("HOME", env.home.path());
        assert!(c.output().expect("stop --resume").status.success());
        poll(
            &format!("{behaviour}: offered again"),
            Duration::from_secs(20),
            || {
                let mut api = api.clone();
                async move {
                    let d = api.get("t").await.ok()?;
                    (d.lease.is_some() || d.runs.len() > runs_before).then_some(())
                }
            },
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn automaton_stop_kills_the_run_with_operator_stopped_and_holds_the_task() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let w = worker(&coord, "gpu-a", &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "hang")]);
    api.create("t").await.expect("create");
    let lease = poll("research running", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move {
            let d = api.get("t").await.ok()?;
            d.runs
                .iter()
                .any(|r| r.state == "active")
                .then_some(d.lease?)
        }
    })
    .await;
    let token = lease.token.to_string();
    assert!(scripted_agents(&w).iter().any(|(_, t)| *t == token));
    let out = Command::new(cli_bin())
        .args(["stop", "t", "--coordinator", &coord.url])
        .env("HOME", env.home.path())
        .output()
        .expect("automaton stop");
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("gpu-a"),
        "{out:?}"
    );
    let run = poll("the run stopped", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move {
            let d = api.get("t").await.ok()?;
            d.runs
                .into_iter()
                .find(|r| r.token == lease.token && r.state == "stopped")
        }
    })
    .await;
    assert_eq!(run.stop_reason, "operator_stopped");
    poll("the agent is gone", Duration::from_secs(10), || async {
        (!scripted_agents(&w).iter().any(|(_, t)| *t == token)).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let d = api.get("t").await.expect("GetTask");
    assert!(held(&d).contains("stopped by an operator"), "{}", held(&d));
    assert!(d.lease.is_none(), "held: not dispatched again");
}

/// With two workers, implement re-run after a stop goes back to the worker that implemented
/// it, not to the other one: otherwise both would be implementers and nobody could review the
/// code (reviewer ≠ implementer), and the task would wait for ever. (A leader's failover or a
/// restart that loses a just-granted implement run ends the same way: `ha_waves` found it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rerun_of_implement_goes_to_its_past_implementer_so_a_reviewer_is_left() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // Only gpu-b at first: it takes research to implement (slowly, so the stop lands).
    let _b = worker(
        &coord,
        "gpu-b",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=2000")],
    );
    api.create("t").await.expect("create");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = api.state("t").await;
        if state.ends_with(":awaiting_approval") {
            let _ = api.approve("t", "ops").await;
        } else if state.starts_with("implement")
            && api.get("t").await.is_ok_and(|d| {
                d.runs
                    .iter()
                    .any(|r| r.phase == "implement" && r.state == "active")
            })
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "t never reached implement: {state}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stop = |extra: &[&str]| {
        let out = Command::new(cli_bin())
            .args(["stop", "t", "--coordinator", &coord.url])
            .args(extra)
            .env("HOME", env.home.path())
            .output()
            .expect("automaton stop");
        assert!(out.status.success(), "{out:?}");
    };
    stop(&[]);
    poll("the implement run stopped", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move {
            let d = api.get("t").await.ok()?;
            (d.lease.is_none() && d.runs.iter().all(|r| r.state == "stopped")).then_some(())
        }
    })
    .await;
    // gpu-a joins (first by name among equals), then the operator resumes the task.
    let _a = worker(&coord, "gpu-a", &[]);
    stop(&["--resume"]);
    assert_eq!(to_the_end(&mut api, "t").await, "complete");
    let d = api.get("t").await.expect("GetTask");
    assert_eq!(d.implementers, ["gpu-b"], "runs: {:#?}", d.runs);
    let by = |phase: &str| -> Vec<String> {
        d.runs
            .iter()
            .filter(|r| r.phase == phase && r.stop_reason == "completed")
            .map(|r| r.worker.clone())
            .collect()
    };
    assert_eq!(by("implement"), ["gpu-b"]);
    assert_eq!(by("code_review"), ["gpu-a"]);
}

/// With two workers, an implementer killed mid-implement is not replaced by the other one:
/// the task waits for it, saying why, and when it is back it implements and the other
/// reviews. (Replacing it would make both implementers: once it is back, nobody could review.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn implement_waits_for_its_implementer_rather_than_take_the_last_reviewer() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut a = worker(
        &coord,
        "gpu-a",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=3000")],
    );
    api.create("t").await.expect("create");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = api.state("t").await;
        if state.ends_with(":awaiting_approval") {
            let _ = api.approve("t", "ops").await;
        } else if state.starts_with("implement")
            && api.get("t").await.is_ok_and(|d| {
                d.runs
                    .iter()
                    .any(|r| r.phase == "implement" && r.state == "active")
            })
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "t never reached implement: {state}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    a.kill9();
    let _b = worker(&coord, "gpu-b", &[]);
    // gpu-a's session times out and its lease ends; gpu-b alone is idle, and may not take it.
    let waiting = poll(
        "t waits for its implementer",
        Duration::from_secs(15),
        || {
            let mut api = api.clone();
            async move {
                let d = api.get("t").await.ok()?;
                let w = d.summary?.waiting;
                (d.lease.is_none() && w.contains("implement stays with")).then_some(w)
            }
        },
    )
    .await;
    assert!(waiting.contains("gpu-a"), "{waiting}");
    // gpu-a is back: it implements again and gpu-b reviews.
    let _a = worker(&coord, "gpu-a", &[]);
    assert_eq!(to_the_end(&mut api, "t").await, "complete");
    let d = api.get("t").await.expect("GetTask");
    assert_eq!(d.implementers, ["gpu-a"], "runs: {:#?}", d.runs);
    let reviewers: Vec<&str> = d
        .runs
        .iter()
        .filter(|r| r.phase == "code_review" && r.stop_reason == "completed")
        .map(|r| r.worker.as_str())
        .collect();
    assert_eq!(reviewers, ["gpu-b"]);
}

/// Why the task is held from dispatch ("" when it is not).
fn held(d: &pb::TaskDetail) -> &str {
    d.summary.as_ref().map_or("", |s| s.held.as_str())
}

/// Drives `task` until it is terminal, approving every gate as an operator (and in manual
/// mode running each phase, as the coordinator's next command says).
async fn to_the_end(api: &mut Api, task: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let state = api.state(task).await;
        if state.ends_with(":awaiting_approval") {
            let _ = api.approve(task, "ops").await;
        } else if state == "complete" || state == "human_intervention" {
            return state;
        } else if let Ok(d) = api.get(task).await
            && d.summary
                .is_some_and(|s| s.next_command.starts_with("automaton run "))
        {
            let _ = api.run_task(task).await;
        }
        if Instant::now() >= deadline {
            let d = api.get(task).await.expect("GetTask");
            panic!(
                "{task} stuck in {state}; held: {:?}; runs: {:#?}",
                held(&d),
                d.runs
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual_mode_creates_the_fix_task_from_a_fail_verdict_and_autopilot_does_not() {
    for manual in [true, false] {
        let env = Env::new();
        git_init(&env);
        if manual {
            std::fs::create_dir_all(env.root().join(".automaton")).expect("meta");
            std::fs::write(
                env.root().join(".automaton/.agent.md"),
                "- **Autopilot**: Disabled\n",
            )
            .expect("agent.md");
        }
        let coord = Coord::start(&env, &FLEET);
        let mut api = coord.api().await;
        let mut events = Events::watch(&api).await;
        api.claimable_task("login").await;
        // A person's spec asks the scripted referee to fail.
        env.artifact("login", "SPEC.md", "# Login\n\nSCRIPTED: FAIL\n");
        let _a = worker(&coord, "gpu-a", &[]);
        let _b = worker(&coord, "gpu-b", &[]);
        assert_eq!(to_the_end(&mut api, "login").await, "human_intervention");
        let fix = "login-fix-scripted-failure-requested-by-the-task";
        if manual {
            let created = events
                .find("the fix task", Duration::from_secs(10), |e| {
                    e.kind == "follow_up_created" && e.task == fix
                })
                .await;
            assert!(
                created
                    .detail
                    .contains("fix task for login, starting at bug_find"),
                "{created:?}"
            );
            // Seeded as seeds 000/002 say: the original's artifacts copied, an empty
            // IMPLEMENTATION.md, starting at bug_find; then dispatched and completed.
            assert_eq!(
                env.task_file(fix, "SPEC.md"),
                env.task_file("login", "SPEC.md")
            );
            assert!(
                env.task_file(fix, "BUG_REPORT.md")
                    .is_some_and(|b| !b.is_empty())
            );
            assert_eq!(env.task_file(fix, "IMPLEMENTATION.md"), Some(vec![]));
            assert_eq!(to_the_end(&mut api, fix).await, "complete");
        } else {
            events
                .find(
                    "autopilot's human intervention",
                    Duration::from_secs(10),
                    |e| e.kind == "human_intervention" && e.task == "login",
                )
                .await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(!env.task_dir(fix).exists(), "autopilot creates no fix task");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_calls_under_another_workers_lease_or_a_forged_one_are_refused_and_change_nothing() {
    let env = Env::with_config(TOKENS_TOML);
    git_init(&env);
    let mut args = FLEET.to_vec();
    args.push("--no-dispatch");
    let coord = Coord::start(&env, &args);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    ops.claimable_task("t").await;
    // gpu-a holds a session and claims t in it.
    let _a = Worker::start(&coord.url, &["--token", WORKER_A_TOKEN], &[]);
    let mut as_a = coord.api_as(WORKER_A_TOKEN).await;
    let lease = as_a.claim("t", "", 60_000).await.expect("gpu-a claims");
    let before = env.snapshot();
    let spec = b"# Spec\nforged\n".to_vec();
    let forged = |lease_id: &str, token: u64| {
        let mut c = artifact(&lease, "SPEC.md", &spec);
        c[0].lease_id = lease_id.to_string();
        c[0].token = token;
        c
    };
    let big_id = "x".repeat(1 << 20);
    let as_b = coord.api_as(WORKER_B_TOKEN).await;
    let mut work_b = WorkClient::new(coord.channel().await);
    let mut work_a = WorkClient::new(coord.channel().await);
    // gpu-b presents gpu-a's lease: refused, whatever the token.
    let s = work_b
        .upload_artifact(as_b.req(tokio_stream::iter(forged(&lease.lease_id, lease.token))))
        .await
        .expect_err("another worker's lease");
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    let s = work_b
        .fetch_workspace(as_b.req(pb::FetchWorkspaceRequest {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            cached_commits: vec![],
        }))
        .await
        .expect_err("another worker's workspace");
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    let s = work_b
        .complete_phase(as_b.req(pb::CompletePhaseRequest {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            target: String::new(),
        }))
        .await
        .expect_err("another worker's phase");
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    // gpu-a itself with forged ids and tokens.
    let cases: Vec<(&str, Vec<pb::ArtifactChunk>, Code)> = vec![
        (
            "u64::MAX token",
            forged(&lease.lease_id, u64::MAX),
            Code::FailedPrecondition,
        ),
        (
            "token 0",
            forged(&lease.lease_id, 0),
            Code::FailedPrecondition,
        ),
        ("an empty lease id", forged("", lease.token), Code::NotFound),
        (
            "a 1 MiB lease id",
            forged(&big_id, lease.token),
            Code::NotFound,
        ),
    ];
    for (what, chunks, code) in cases {
        let s = work_a
            .upload_artifact(as_a.req(tokio_stream::iter(chunks)))
            .await
            .expect_err(what);
        assert_eq!(s.code(), code, "{what}: {s:?}");
        assert!(s.message().len() < 400, "{what}: one short line: {s:?}");
    }
    // A completion of a phase whose artifact is missing is refused by the lifecycle.
    let s = work_a
        .complete_phase(as_a.req(pb::CompletePhaseRequest {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            target: String::new(),
        }))
        .await
        .expect_err("no SPEC.md yet");
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    // An agent token is not a worker, and an operator's StopRun of an unknown task is clear.
    let mut agent_workers = coord.api_as(AGENT_TOKEN).await;
    let s = agent_workers
        .workers
        .stop_run(agent_workers.req(pb::StopRunRequest {
            task: "t".into(),
            resume: false,
        }))
        .await
        .expect_err("agents may not stop runs");
    assert_eq!(s.code(), Code::PermissionDenied, "{s:?}");
    let s = ops
        .workers
        .stop_run(ops.req(pb::StopRunRequest {
            task: "nope".into(),
            resume: false,
        }))
        .await
        .expect_err("unknown task");
    assert_eq!(s.code(), Code::NotFound, "{s:?}");
    let after = env.snapshot();
    let changed: Vec<_> = after
        .iter()
        .filter(|(p, b)| before.get(*p) != Some(*b))
        .map(|(p, _)| p.clone())
        .chain(before.keys().filter(|p| !after.contains_key(*p)).cloned())
        .collect();
    assert!(
        changed.is_empty(),
        "a refused call changed files: {changed:?}"
    );
    // The lease is still gpu-a's, untouched.
    assert_eq!(ops.lease_of("t").await.map(|l| l.token), Some(lease.token));
}
