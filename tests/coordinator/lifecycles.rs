//! Issue 36: small lifecycles that always end (seed 003). A run whose worker is killed ends,
//! with a reason, within the session timeout — and after a coordinator restart too; a run
//! still stopping is shown on its worker, which is offered nothing meanwhile (no declined
//! offer becomes a run); a hold that waits for a fresh approval lifts when the approval is.

use std::time::Duration;

use automaton_proto::v1 as pb;

use crate::harness::*;
use crate::work::{FLEET, git_init};
use crate::workers::Worker;

/// A scripted worker whose agent hangs (ignoring SIGTERM) and is killed `grace` after a stop.
fn hanging_worker(coord: &Coord, name: &str, grace: &str) -> Worker {
    Worker::start(
        &coord.url,
        &[
            "--name",
            name,
            "--simulate-gpu",
            "sim:24GiB",
            "--agent",
            "scripted",
            "--kill-grace",
            grace,
        ],
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "hang")],
    )
}

/// Waits for `task`'s run to be `active`; its lease.
async fn running(api: &Api, task: &str) -> pb::Lease {
    poll(&format!("{task} running"), Duration::from_secs(15), || {
        let mut api = api.clone();
        let task = task.to_string();
        async move {
            let d = api.get(&task).await.ok()?;
            d.runs
                .iter()
                .any(|r| r.state == "active")
                .then_some(d.lease?)
        }
    })
    .await
}

/// Waits for the run under `token` on `task` to stop; the run.
async fn stopped(api: &Api, task: &str, token: u64, within: Duration) -> pb::Run {
    poll(&format!("{task}'s run {token} stopped"), within, || {
        let mut api = api.clone();
        let task = task.to_string();
        async move {
            let d = api.get(&task).await.ok()?;
            d.runs
                .into_iter()
                .find(|r| r.token == token && r.state == "stopped")
        }
    })
    .await
}

async fn workers(api: &Api) -> Vec<pb::WorkerInfo> {
    let mut client = api.workers.clone();
    client
        .list_workers(api.req(pb::ListWorkersRequest {}))
        .await
        .expect("ListWorkers")
        .into_inner()
        .workers
}

/// Issue 36, item 1: `kill -9` of a worker mid-run. Its session ends at the timeout (1 s
/// here), its lease with it — and its run ends too, `worker_lost` (seed 003's `crashed`, as the
/// coordinator sees it) with why, instead of staying
/// `active` for ever; the fleet view shows the worker lost with no run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_run_leaves_a_run_that_ends_worker_lost_within_the_session_timeout() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let api = coord.api().await;
    let mut w = hanging_worker(&coord, "gpu-a", "300ms");
    api.clone().create("t").await.expect("create");
    let lease = running(&api, "t").await;
    let _ = w.child.kill();
    let _ = w.child.wait();
    let run = stopped(&api, "t", lease.token, Duration::from_secs(5)).await;
    assert_eq!(run.stop_reason, "worker_lost", "{run:?}");
    assert!(run.detail.contains("session"), "{run:?}");
    assert!(run.ended_at.is_some());
    let fleet = workers(&api).await;
    let a = fleet
        .iter()
        .find(|w| w.name == "gpu-a")
        .expect("gpu-a listed");
    assert_eq!(a.state, "lost");
    assert!(a.runs.iter().all(|r| r.state == "stopped"), "{a:?}");
}

/// Issue 36, item 1, after a restart: the coordinator and the worker both `kill -9`ed
/// mid-run. The restarted coordinator keeps the lease through its grace period waiting for
/// the worker, which never comes back: the session ends, and the run with it, `worker_lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_whose_worker_never_comes_back_after_a_coordinator_restart_ends_worker_lost() {
    let env = Env::new();
    git_init(&env);
    let args = [&FLEET[..], &["--grace-period", "2s"]].concat();
    let mut coord = Coord::start(&env, &args);
    let api = coord.api().await;
    let mut w = hanging_worker(&coord, "gpu-a", "300ms");
    api.clone().create("t").await.expect("create");
    let lease = running(&api, "t").await;
    // Its record is durable (the run's start is in `.state.dispatch` once a round saves it).
    tokio::time::sleep(Duration::from_millis(500)).await;
    coord.kill9();
    let _ = w.child.kill();
    let _ = w.child.wait();
    coord.restart_after_kill(&args);
    let api = coord.api().await;
    let run = stopped(&api, "t", lease.token, Duration::from_secs(10)).await;
    assert_eq!(run.stop_reason, "worker_lost", "{run:?}");
    let d = api.clone().get("t").await.expect("get");
    assert!(
        d.runs.iter().all(|r| r.state == "stopped"),
        "a run stayed open: {:?}",
        d.runs
    );
}

/// Issue 36, items 2 and 3: a run stopped by an operator whose agent ignores SIGTERM stays
/// `stopping` until the worker kills it (5 s here). Meanwhile the fleet view shows that run on
/// its worker (busy, not idle), and the worker is offered nothing: no declined offer becomes a
/// run of the other task. Once the run has stopped, the other task runs there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_run_is_shown_on_its_worker_and_no_declined_offer_becomes_a_run() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let api = coord.api().await;
    let _w = hanging_worker(&coord, "gpu-a", "5s");
    api.clone().create("t").await.expect("create");
    let lease = running(&api, "t").await;
    let stop = cli_at(&env, &coord, &["stop", "t"]);
    stop.ok();
    api.clone().create("u").await.expect("create u");
    poll("t's run stopping", Duration::from_secs(5), || {
        let mut api = api.clone();
        async move {
            let d = api.get("t").await.ok()?;
            d.runs
                .iter()
                .any(|r| r.token == lease.token && r.state == "stopping")
                .then_some(())
        }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let fleet = workers(&api).await;
    let a = fleet.iter().find(|w| w.name == "gpu-a").expect("gpu-a");
    assert_eq!(a.state, "busy", "{a:?}");
    assert!(
        a.runs
            .iter()
            .any(|r| r.token == lease.token && r.state == "stopping"),
        "the stopping run is not on its worker: {a:?}"
    );
    let u = api.clone().get("u").await.expect("get u");
    assert!(
        u.runs.iter().all(|r| !r.stop_reason.starts_with("refused")),
        "a declined offer became a run: {:?}",
        u.runs
    );
    assert!(u.runs.is_empty(), "{:?}", u.runs);
    // The run ends (killed after the grace), and then the worker takes u.
    let run = stopped(&api, "t", lease.token, Duration::from_secs(15)).await;
    assert_eq!(run.stop_reason, "operator_stopped");
    running(&api, "u").await;
}

/// Issue 36, item 4: an approved SPEC.md edited. Dispatch holds the task (the approval is
/// stale: `--approve` again); the `--approve` makes it fresh — and the hold lifts by itself,
/// the task moving on without `automaton stop T --resume`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_approval_hold_lifts_when_the_approval_is_fresh_again() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    api.approved_research(&env, "t", None).await;
    env.artifact(
        "t",
        "SPEC.md",
        "# Spec\nwhat to build, edited after approval\n",
    );
    let _w = crate::work::scripted_worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let held = events
        .find("the stale hold", Duration::from_secs(15), |e| {
            e.kind == "task_held" && e.task == "t"
        })
        .await;
    assert!(held.detail.to_lowercase().contains("stale"), "{held:?}");
    assert_eq!(api.state("t").await, "research:approved");
    api.approve("t", "ops").await.expect("approve again");
    events.expect("task_resumed", "t").await;
    poll("t moved on", Duration::from_secs(15), || {
        let mut api = api.clone();
        async move {
            let s = api.state("t").await;
            (s != "research:approved").then_some(s)
        }
    })
    .await;
    let d = api.get("t").await.expect("get");
    assert!(
        d.summary.as_ref().is_some_and(|s| s.held.is_empty()),
        "{:?}",
        d.summary
    );
}

/// Issue 36, item 5's first part: every run records the commit of the task branch it was
/// served — what a review read — in `GetTask.runs`, `status --task` and across a restart
/// (its dispatch record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_run_records_the_commit_it_was_served_and_status_shows_it() {
    let env = Env::new();
    git_init(&env);
    let mut coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let _a = crate::work::scripted_worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = crate::work::scripted_worker(&coord, "gpu-b", "sim:24GiB", &[]);
    let approver = crate::waves::approve_all(&api);
    api.create("t").await.expect("create");
    crate::waves::ended(&mut api, "t", Duration::from_secs(60)).await;
    approver.abort();
    let head = crate::work::git(&env, &["rev-parse", "automaton/t"])
        .trim()
        .to_string();
    let runs = api.get("t").await.expect("get").runs;
    let completed: Vec<&pb::Run> = runs
        .iter()
        .filter(|r| r.stop_reason == "completed")
        .collect();
    assert!(completed.len() >= 5, "{runs:#?}");
    for r in &completed {
        assert!(
            r.commit.len() == 40 && r.commit.bytes().all(|b| b.is_ascii_hexdigit()),
            "{r:?}"
        );
    }
    let referee = completed
        .iter()
        .rev()
        .find(|r| r.phase == "referee")
        .expect("the referee's run");
    assert_eq!(referee.commit, head, "the referee read the branch's head");
    let review = completed
        .iter()
        .rev()
        .find(|r| r.phase == "code_review")
        .expect("the code review's run");
    let reviewed = crate::work::git(
        &env,
        &["merge-base", "--is-ancestor", &review.commit, &head],
    );
    assert!(reviewed.is_empty());
    let status = cli_at(&env, &coord, &["status", "--task", "t"]);
    assert!(
        status
            .ok()
            .stdout
            .contains(&format!("read {}", &head[..12])),
        "{}",
        status.stdout
    );
    // Kept across a restart (its dispatch record is read by the first round).
    coord.restart(&FLEET);
    let api = coord.api().await;
    poll(
        "the referee's run read back",
        Duration::from_secs(10),
        || {
            let mut api = api.clone();
            let head = head.clone();
            async move {
                let runs = api.get("t").await.ok()?.runs;
                runs.iter()
                    .any(|r| r.phase == "referee" && r.commit == head)
                    .then_some(())
            }
        },
    )
    .await;
}

/// Issue 36, item 5: a commit on the task's branch after its code review was written. The
/// review read the older commit, so its gate does not pass: the coordinator sends the task
/// back to `code_review`, the review runs again on the new head, and only that review's
/// approval moves the task on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_code_review_sends_the_review_back_and_only_a_review_of_the_new_head_passes()
{
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let _a = crate::work::scripted_worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = crate::work::scripted_worker(&coord, "gpu-b", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    at_code_review_gate(&api, "t").await;
    // A person's commit on the branch, after the review.
    let head = crate::delivery::commit_on(&env, "automaton/t", "automaton/t", "late.rs", "late");
    let stale = events
        .find("the review going stale", Duration::from_secs(10), |e| {
            e.kind == "review_stale" && e.task == "t"
        })
        .await;
    assert!(stale.detail.contains(&head[..12]), "{stale:?}");
    // It runs again, on the new head, and waits at the gate again.
    let again = poll(
        "the review of the new head",
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            let head = head.clone();
            async move {
                let d = api.get("t").await.ok()?;
                let s = d.summary.as_ref()?.state.clone();
                let run = last_completed(&d.runs, "code_review")?;
                (s == "code_review:awaiting_approval" && run.commit == head).then_some(run)
            }
        },
    )
    .await;
    assert_eq!(again.commit, head);
    let approved = api
        .approve("t", "ops")
        .await
        .expect("the review of the new head is approved");
    // The answer, not a read afterwards: autopilot may have moved on to bug_find already.
    assert_eq!(
        (approved.from.as_str(), approved.to.as_str()),
        ("code_review:awaiting_approval", "code_review:approved")
    );
}

/// Approves every gate of `task` but the code review's as it comes, until the task waits at
/// its code review's gate.
async fn at_code_review_gate(api: &Api, task: &str) {
    let gates = {
        let api = api.clone();
        let task = task.to_string();
        tokio::spawn(async move {
            loop {
                let mut api = api.clone();
                let s = api.state(&task).await;
                if s.ends_with(":awaiting_approval") && !s.starts_with("code_review") {
                    let _ = api.approve(&task, "ops").await;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    poll(
        &format!("{task} at its code review's gate"),
        Duration::from_secs(60),
        || {
            let mut api = api.clone();
            let task = task.to_string();
            async move { (api.state(&task).await == "code_review:awaiting_approval").then_some(()) }
        },
    )
    .await;
    gates.abort();
}

/// Issue 36: an approval of a review whose branch moved is refused — it would authorize
/// code nobody reviewed — naming both commits, and nothing changes; a person who read the
/// new head approves it by name (`--approve --revision`), the approval records that commit,
/// and the task goes on without reviewing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approving_a_moved_code_review_is_refused_until_a_person_names_the_new_revision() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let _a = crate::work::scripted_worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = crate::work::scripted_worker(&coord, "gpu-b", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    at_code_review_gate(&api, "t").await;
    // The gate can come before the worker's report of the run's end: wait for it.
    let read = poll("the review's run", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move { last_completed(&api.get("t").await.ok()?.runs, "code_review") }
    })
    .await
    .commit;
    // Held, so that the coordinator does not send the review back meanwhile.
    cli_at(&env, &coord, &["stop", "t"]).ok();
    let head = crate::delivery::commit_on(&env, "automaton/t", "automaton/t", "late.rs", "late");
    let before = env.snapshot();
    let refused = env.cli(&["--task", "t", "--approve", "--approver", "ops"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    let line = refused.stderr.trim();
    assert_eq!(line.lines().count(), 1, "{line}");
    for want in [read.as_str(), head.as_str(), "--revision"] {
        assert!(line.contains(want), "{want}: {line}");
    }
    // Another revision than the head: refused too, and nothing written either way.
    let other = env.cli(&[
        "--task",
        "t",
        "--approve",
        "--approver",
        "ops",
        "--revision",
        &read,
    ]);
    assert_ne!(other.code, 0, "{other:?}");
    assert!(other.stderr.contains("--revision"), "{other:?}");
    assert_eq!(env.snapshot(), before, "a refused approval changed files");
    assert_eq!(api.state("t").await, "code_review:awaiting_approval");
    // The new head, named by a person who read it.
    let ok = env.cli(&[
        "--task",
        "t",
        "--approve",
        "--approver",
        "ops",
        "--revision",
        &head[..10],
    ]);
    ok.ok();
    assert!(ok.stdout.contains(&head[..12]), "{}", ok.stdout);
    let log = std::fs::read_to_string(env.root().join(".automaton/tasks/t/.state.approvals"))
        .expect("approvals");
    assert!(
        log.lines()
            .last()
            .is_some_and(|l| l.starts_with("code_review:approved|") && l.ends_with(&head)),
        "{log}"
    );
    // Resumed: bug_find reads the approved head; the review is not sent back.
    cli_at(&env, &coord, &["stop", "t", "--resume"]).ok();
    let bug_find = poll("bug_find's run", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move { last_completed(&api.get("t").await.ok()?.runs, "bug_find") }
    })
    .await;
    assert_eq!(bug_find.commit, head);
    assert!(
        events
            .settle(Duration::ZERO)
            .await
            .iter()
            .all(|e| !(e.kind == "review_stale" && e.task == "t")),
        "the approved revision was sent back"
    );
}

/// Issue 36: a commit after the code review's gate was passed, while a later review runs,
/// sends the task back to its code review: the approval named the older commit, so nothing
/// after it vouches for the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_during_bug_find_sends_the_task_back_to_code_review_on_the_new_head() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let slow = [("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=1500")];
    let _a = crate::work::scripted_worker(&coord, "gpu-a", "sim:24GiB", &slow);
    let _b = crate::work::scripted_worker(&coord, "gpu-b", "sim:24GiB", &slow);
    api.create("t").await.expect("create");
    at_code_review_gate(&api, "t").await;
    let approved = api.approve("t", "ops").await.expect("approve");
    assert_eq!(approved.commit.len(), 40, "{approved:?}");
    // bug_find runs; a person commits meanwhile.
    poll("bug_find running", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move {
            api.get("t")
                .await
                .ok()?
                .runs
                .into_iter()
                .find(|r| r.phase == "bug_find" && r.state == "active")
        }
    })
    .await;
    let head = crate::delivery::commit_on(&env, "automaton/t", "automaton/t", "late.rs", "late");
    let stale = events
        .find("the reviews going stale", Duration::from_secs(30), |e| {
            e.kind == "review_stale" && e.task == "t"
        })
        .await;
    assert!(
        stale.detail.contains(&approved.commit[..12]) && stale.detail.contains(&head[..12]),
        "{stale:?}"
    );
    // The code review runs again, on the new head, and waits at its gate.
    poll(
        "the review of the new head",
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            let head = head.clone();
            async move {
                let d = api.get("t").await.ok()?;
                let run = last_completed(&d.runs, "code_review")?;
                (d.summary.as_ref()?.state == "code_review:awaiting_approval" && run.commit == head)
                    .then_some(())
            }
        },
    )
    .await;
    assert!(
        !env.root().join(".automaton/tasks/t/BUG_REPORT.md").exists(),
        "the stale bug report was not set aside"
    );
}

/// Issue 36: an offer declined is the offer's outcome (`offer_declined`), not a run — no
/// `requested` run is left behind on the task or on the worker, and the worker keeps its
/// slot: it is offered the task again after the pause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declined_offer_leaves_no_run_behind_and_the_worker_keeps_its_slot() {
    use pb::worker_message::Msg as Out;
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    // A worker over the protocol that declines what it is offered.
    let mut s = crate::durable::Session::open(&coord.url, crate::durable::register("z")).await;
    api.create("t").await.expect("create");
    for n in 1..=2 {
        let a = s.assignment().await;
        let lease = a.lease.clone().expect("the offer's lease");
        s.send(Out::Answer(pb::AssignmentAnswer {
            lease_id: lease.lease_id.clone(),
            accepted: false,
            reason: "busy elsewhere".into(),
        }))
        .await;
        let declined = events
            .find(&format!("decline {n}"), Duration::from_secs(10), |e| {
                e.kind == "offer_declined" && e.task == "t"
            })
            .await;
        assert!(declined.detail.contains("busy elsewhere"), "{declined:?}");
    }
    let runs = api.get("t").await.expect("get").runs;
    assert!(runs.is_empty(), "a declined offer left runs: {runs:#?}");
    let fleet = workers(&api).await;
    let w = fleet.iter().find(|w| w.name == "z").expect("z");
    assert!(w.runs.is_empty(), "{w:?}");
}

/// `runs`' last completed run of `phase`.
fn last_completed(runs: &[pb::Run], phase: &str) -> Option<pb::Run> {
    runs.iter()
        .rev()
        .find(|r| r.phase == phase && r.stop_reason == "completed")
        .cloned()
}
