//! Issue 24: the orchestrator as seed 002 describes it, with real processes — a failed
//! sub-task pauses the waves after it; manual mode executes nothing until an operator runs a
//! phase; MAX_PHASE_TIME holds for a person; MAX_ITERATIONS is exact; a parent's status
//! carries its sub-tasks' verdicts and seed 002's `⚠️ **HUMAN INTERVENTION REQUIRED**` line;
//! a parent whose own VERDICT.md says PASS over a failed sub-task ends in
//! `human_intervention`; a missing VRAM_CONFIG.md is made again.

use std::time::Duration;

use automaton_proto::v1 as pb;
use tonic::Code;

use crate::harness::*;
use crate::waves::{approve_all, approved_decomposition, ended};
use crate::work::{FLEET, git_init, scripted_worker as worker};
use crate::workers::Worker;

/// Seed 002's line.
const HUMAN: &str = "⚠️ **HUMAN INTERVENTION REQUIRED**: ";

/// A SPEC.md planning `rows` (sub-task, depends on, k tokens, scope); a scope with
/// `SCRIPTED: FAIL` makes that sub-task's scripted referee say FAIL.
fn spec(rows: &[(&str, &str, u64, &str)]) -> String {
    let mut s = String::from(
        "# SPEC\n\nPlanned as sub-tasks.\n\n\
         | sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n\
         | --- | --- | --- | --- |\n",
    );
    for (name, deps, k, scope) in rows {
        s.push_str(&format!("| {name} | {deps} | {k} | {scope} |\n"));
    }
    s
}

/// The table alone: a DECOMPOSITION.md.
fn table(rows: &[(&str, &str, u64, &str)]) -> String {
    let s = spec(rows);
    s[s.find('|').unwrap_or(0)..].to_string()
}

/// `kill -9`, then a fresh coordinator on the same port (workers reconnect to it).
fn kill_9_and_restart(coord: &mut Coord, args: &[&str]) {
    let listen = format!("127.0.0.1:{}", coord.addr.port());
    coord.kill9();
    let mut a = args.to_vec();
    a.extend(["--listen", listen.as_str()]);
    *coord = Coord::start(&coord.env.clone(), &a);
}

/// Creates `parent` in research with the planned SPEC.md.
async fn plan(api: &mut Api, env: &Env, parent: &str, rows: &[(&str, &str, u64, &str)]) {
    api.create(parent).await.expect("create");
    api.transition(parent, "research")
        .await
        .expect("to research");
    env.artifact(parent, "SPEC.md", &spec(rows));
}

/// `automaton status --task TASK` (text) against `coord`.
fn status(env: &Env, coord: &Coord, task: &str, json: bool) -> Run {
    let mut args = vec!["status", "--task", task];
    if json {
        args.push("--json");
    }
    cli_at(env, coord, &args)
}

/// `automaton tasks --json`: the row of `task` (a top-level task or a sub-task).
fn tasks_row(env: &Env, coord: &Coord, task: &str) -> serde_json::Value {
    let out = cli_at(env, coord, &["tasks", "--json"]);
    out.ok();
    let all: serde_json::Value = serde_json::from_str(&out.stdout).expect("tasks --json");
    all.as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| {
            std::iter::once(t.clone()).chain(t["subtasks"].as_array().cloned().unwrap_or_default())
        })
        .find(|t| t["task"] == task)
        .unwrap_or_else(|| panic!("no {task} in {all:#}"))
}

fn summary(d: &pb::TaskDetail) -> pb::TaskSummary {
    d.summary.clone().unwrap_or_default()
}

/// The sub-task that `bad-part` fails, `after-bad` depends on, `good` stands alone: the
/// parent ends in human_intervention, and `after-bad` waits for a person.
async fn failed_wave(env: &std::sync::Arc<Env>) -> (Coord, Events, Vec<Worker>) {
    git_init(env);
    let coord = Coord::start(env, &FLEET);
    let mut api = coord.api().await;
    let events = Events::watch(&api).await;
    plan(
        &mut api,
        env,
        "p",
        &[
            ("bad-part", "-", 8, "bad-part works. SCRIPTED: FAIL"),
            ("after-bad", "bad-part", 8, "after-bad works"),
            ("good", "-", 8, "good works"),
        ],
    )
    .await;
    let workers = vec![
        worker(&coord, "gpu-a", "sim:24GiB", &[]),
        worker(&coord, "gpu-b", "sim:24GiB", &[]),
    ];
    let approver = approve_all(&api);
    poll("the sub-tasks made", Duration::from_secs(30), || {
        let mut api = api.clone();
        async move { api.get("p/good").await.ok().map(|_| ()) }
    })
    .await;
    assert_eq!(
        ended(&mut api, "p/bad-part", Duration::from_secs(60)).await,
        "human_intervention"
    );
    assert_eq!(
        ended(&mut api, "p/good", Duration::from_secs(60)).await,
        "complete"
    );
    assert_eq!(
        ended(&mut api, "p", Duration::from_secs(20)).await,
        "human_intervention"
    );
    approver.abort();
    (coord, events, workers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_1_a_wave_after_a_failed_subtask_waits_for_a_person_and_never_runs() {
    let env = Env::new();
    let (coord, mut events, _w) = failed_wave(&env).await;
    let mut api = coord.api().await;
    // Two idle workers, and a round every 250 ms: the dependent is still not dispatched.
    let seen = events.settle(Duration::from_millis(1500)).await;
    assert!(
        !seen
            .iter()
            .any(|e| e.kind == "assigned" && e.task == "p/after-bad"),
        "after-bad was dispatched after bad-part failed"
    );
    assert_eq!(api.state("p/after-bad").await, "new");
    let row = summary(&api.get("p/after-bad").await.expect("GetTask"));
    assert!(
        row.waiting
            .starts_with("waiting for a person: bad-part did not pass (human_intervention)"),
        "{row:?}"
    );
    // The CLI says the same.
    let t = tasks_row(&env, &coord, "p/after-bad");
    assert!(
        t["waiting"]
            .as_str()
            .is_some_and(|w| w.contains("bad-part did not pass")),
        "{t:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_5_the_parents_status_carries_its_subtasks_verdicts_everywhere() {
    let env = Env::new();
    let (coord, _events, _w) = failed_wave(&env).await;
    let mut api = coord.api().await;
    let want = "PASS: 1, FAIL: 1, NEEDS_REVIEW: 0, no verdict: 1";
    // GetTask and ListTasks.
    let d = summary(&api.get("p").await.expect("GetTask"));
    let v = d.verdicts.clone().expect("GetTask: verdicts");
    assert_eq!(
        (v.pass, v.fail, v.needs_review, v.no_verdict),
        (1, 1, 0, 1),
        "{v:?}"
    );
    assert_eq!(v.not_terminal, ["after-bad"]);
    assert_eq!(v.summary, want);
    let list = api.list().await.expect("ListTasks");
    let p = list.tasks.iter().find(|t| t.task == "p").expect("p listed");
    assert_eq!(p.verdicts.as_ref().map(|v| v.summary.as_str()), Some(want));
    // A sub-task carries none.
    assert!(p.subtasks.iter().all(|s| s.verdicts.is_none()), "{p:?}");
    // status --task, text and JSON.
    let text = status(&env, &coord, "p", false);
    text.ok();
    assert!(
        text.stdout.contains(&format!(
            "Sub-task verdicts: {want} (not terminal yet: after-bad)"
        )),
        "{}",
        text.stdout
    );
    let json = status(&env, &coord, "p", true);
    json.ok();
    let j: serde_json::Value = serde_json::from_str(&json.stdout).expect("status --json");
    assert_eq!(j["verdicts"]["fail"], 1, "{j:#}");
    assert_eq!(j["verdicts"]["not_terminal"][0], "after-bad", "{j:#}");
    // automaton tasks, JSON and text.
    let row = tasks_row(&env, &coord, "p");
    assert_eq!(row["verdicts"]["summary"], want, "{row:#}");
    let out = cli_at(&env, &coord, &["tasks"]);
    out.ok();
    assert!(
        out.stdout.contains(&format!(
            "sub-task verdicts: {want} (not terminal yet: after-bad)"
        )),
        "{}",
        out.stdout
    );
    // Without a coordinator, from the files: the same counts.
    drop(_w);
    let mut coord = coord;
    coord.terminate();
    let files = env.cli(&["--task", "p"]);
    files.ok();
    assert!(
        files.stdout.contains(&format!("Sub-task verdicts: {want}")),
        "{}",
        files.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_6_human_intervention_required_is_shown_in_status_tasks_and_events() {
    let env = Env::new();
    let (coord, mut events, _w) = failed_wave(&env).await;
    let mut api = coord.api().await;
    let reason = "sub-task(s) bad-part (FAIL) did not pass; create fix tasks for them.";
    let line = format!("{HUMAN}{reason}");
    // The events' detail: the parent's end and the autopilot's pause.
    let ended = events
        .find("parent_ended", Duration::from_secs(5), |e| {
            e.kind == "parent_ended" && e.task == "p"
        })
        .await;
    assert!(ended.detail.starts_with(&line), "{ended:?}");
    let paused = events
        .find(
            "the sub-task's human_intervention",
            Duration::from_secs(5),
            |e| e.kind == "human_intervention" && e.task == "p/bad-part",
        )
        .await;
    assert!(
        paused
            .detail
            .starts_with(&format!("{HUMAN}VERDICT.md says FAIL")),
        "{paused:?}"
    );
    // GetTask, status --task and automaton tasks.
    let d = summary(&api.get("p").await.expect("GetTask"));
    assert!(d.attention.starts_with(&line), "{d:?}");
    let text = status(&env, &coord, "p", false);
    text.ok();
    assert!(
        text.stdout.lines().any(|l| l.starts_with(&line)),
        "{}",
        text.stdout
    );
    let out = cli_at(&env, &coord, &["tasks"]);
    out.ok();
    assert!(out.stdout.contains(&line), "{}", out.stdout);
    assert!(
        out.stdout.contains(&format!("{HUMAN}VERDICT.md says FAIL")),
        "the failed sub-task's line: {}",
        out.stdout
    );
    // A task that needs nobody has no line.
    let good = summary(&api.get("p/good").await.expect("GetTask"));
    assert_eq!(good.attention, "", "{good:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_7_a_parent_verdict_pass_over_a_failed_subtask_ends_in_human_intervention() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    approved_decomposition(
        &mut api,
        &env,
        "q",
        &table(&[("bad", "-", 8, "bad works. SCRIPTED: FAIL")]),
    )
    .await;
    // The parent's own verdict says PASS (out of order for its phase).
    env.artifact("q", "VERDICT.md", "# Verdict\n\nVerdict: PASS\n");
    let _a = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = worker(&coord, "gpu-b", "sim:24GiB", &[]);
    let approver = approve_all(&api);
    assert_eq!(
        ended(&mut api, "q/bad", Duration::from_secs(60)).await,
        "human_intervention"
    );
    let end = ended(&mut api, "q", Duration::from_secs(20)).await;
    approver.abort();
    assert_eq!(end, "human_intervention");
    let seed = "Parent task VERDICT.md says PASS, but sub-task bad has VERDICT.md with FAIL. Create a fix task for the failing sub-task.";
    let e = events
        .find("parent_ended", Duration::from_secs(5), |e| {
            e.kind == "parent_ended" && e.task == "q"
        })
        .await;
    assert!(e.detail.starts_with(&format!("{HUMAN}{seed}")), "{e:?}");
    let d = summary(&api.get("q").await.expect("GetTask"));
    assert!(d.attention.starts_with(&format!("{HUMAN}{seed}")), "{d:?}");
    // Never held for the phase-skipping the artifact would mean to an agent.
    assert_eq!(d.held, "", "{d:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_8_a_missing_vram_config_md_is_recreated_after_a_restart() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    approved_decomposition(
        &mut api,
        &env,
        "shop",
        &table(&[
            ("cart", "-", 8, "cart works"),
            ("pay", "cart", 20, "pay works"),
        ]),
    )
    .await;
    events.expect("subtask_created", "shop/pay").await;
    let path = env.task_dir("shop/pay").join("VRAM_CONFIG.md");
    let first = std::fs::read_to_string(&path).expect("VRAM_CONFIG.md");
    std::fs::remove_file(&path).expect("delete VRAM_CONFIG.md");
    kill_9_and_restart(&mut coord, &[]);
    let api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let e = events.expect("vram_config_recreated", "shop/pay").await;
    assert!(e.detail.contains("VRAM_CONFIG.md was missing"), "{e:?}");
    let again = std::fs::read_to_string(&path).expect("VRAM_CONFIG.md made again");
    assert!(
        again.contains("**This sub-task's estimated peak context**: 20k tokens"),
        "{again}"
    );
    assert_eq!(again, first, "the same fleet (none): the same file");
    // The other sub-task's file is left as it was.
    assert!(env.task_file("shop/cart", "VRAM_CONFIG.md").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_3_max_phase_time_holds_the_task_for_a_person_and_is_not_retried() {
    let env = Env::new();
    git_init(&env);
    let mut args = FLEET.to_vec();
    args.extend(["--max-phase-time", "1s"]);
    let coord = Coord::start_with_env(&env, &args, &[("AUTOMATON_MAX_ATTEMPTS", "3")]);
    let mut api = coord.api().await;
    let _w = worker(
        &coord,
        "gpu-a",
        "sim:24GiB",
        &[("AUTOMATON_SCRIPTED_BEHAVIOUR", "hang")],
    );
    api.create("t").await.expect("create");
    let held = poll(
        "held after the timed-out run",
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            async move {
                let s = summary(&api.get("t").await.ok()?);
                (!s.held.is_empty()).then_some(s)
            }
        },
    )
    .await;
    assert!(
        held.held
            .starts_with("MAX_PHASE_TIME exceeded: research ran past max_phase_time 1s"),
        "{held:?}"
    );
    assert!(
        held.attention
            .starts_with(&format!("{HUMAN}MAX_PHASE_TIME exceeded")),
        "{held:?}"
    );
    // One run, never a second attempt, though max_attempts allows three.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let runs = api.get("t").await.expect("GetTask").runs;
    assert_eq!(runs.len(), 1, "{runs:#?}");
    assert_eq!(runs[0].stop_reason, "timed_out", "{runs:#?}");
    assert!(api.lease_of("t").await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_4_max_iterations_is_exact_whatever_the_order_of_messages() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start_with_env(&env, &FLEET, &[("AUTOMATON_MAX_ITERATIONS", "3")]);
    let mut api = coord.api().await;
    let _a = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = worker(&coord, "gpu-b", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    let approver = approve_all(&api);
    let held = poll("held at MAX_ITERATIONS", Duration::from_secs(60), || {
        let mut api = api.clone();
        async move {
            let s = summary(&api.get("t").await.ok()?);
            (!s.held.is_empty()).then_some(s)
        }
    })
    .await;
    // Runs still stopping report in; nothing more is granted.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    approver.abort();
    assert!(
        held.held.starts_with("MAX_ITERATIONS reached: 3"),
        "{held:?}"
    );
    let runs = api.get("t").await.expect("GetTask").runs;
    let completed = runs.iter().filter(|r| r.stop_reason == "completed").count();
    assert_eq!(completed, 3, "{runs:#?}");
    assert_eq!(runs.len(), 3, "no fourth run was granted: {runs:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_2_manual_mode_executes_nothing_until_an_operator_runs_a_phase() {
    let env = Env::new();
    git_init(&env);
    std::fs::create_dir_all(env.root().join(".automaton")).expect("meta");
    std::fs::write(
        env.root().join(".automaton/.agent.md"),
        "- **Autopilot**: Disabled\n",
    )
    .expect("agent.md");
    let mut coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let _w = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    // A connected, idle worker: nothing runs on its own.
    let seen = events.settle(Duration::from_millis(1500)).await;
    assert!(
        !seen.iter().any(|e| e.kind == "assigned"),
        "manual mode dispatched: {seen:#?}"
    );
    assert_eq!(api.state("t").await, "new");
    // Everything that shows the task says what the next command is.
    let row = summary(&api.get("t").await.expect("GetTask"));
    assert_eq!(row.next_command, "automaton run t", "{row:?}");
    assert!(row.waiting.starts_with("manual mode"), "{row:?}");
    let text = status(&env, &coord, "t", false);
    text.ok();
    assert!(
        text.stdout
            .contains("Next command (manual mode): automaton run t"),
        "{}",
        text.stdout
    );
    assert_eq!(
        tasks_row(&env, &coord, "t")["next_command"],
        "automaton run t"
    );
    // The operator runs one phase: research runs, and the task waits at its gate.
    let out = cli_at(&env, &coord, &["run", "t"]);
    out.ok();
    assert!(
        out.stdout.contains("runs its research next"),
        "{}",
        out.stdout
    );
    let first = events.expect("assigned", "t").await;
    assert!(first.detail.starts_with("research"), "{first:?}");
    poll("research awaits approval", Duration::from_secs(20), || {
        let mut api = api.clone();
        async move { (api.state("t").await == "research:awaiting_approval").then_some(()) }
    })
    .await;
    assert_eq!(
        summary(&api.get("t").await.expect("GetTask")).next_command,
        "automaton approve t"
    );
    // A run at a gate is refused, clearly, and changes nothing.
    let refused = cli_at(&env, &coord, &["run", "t"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(
        refused.stderr.contains("automaton approve t"),
        "{}",
        refused.stderr
    );
    api.approve("t", "ops").await.expect("approve");
    // Approved: still nothing runs until the next `run`, across a restart too.
    kill_9_and_restart(&mut coord, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let seen = events.settle(Duration::from_millis(2000)).await;
    assert!(
        !seen.iter().any(|e| e.kind == "assigned"),
        "dispatched after approval: {seen:#?}"
    );
    assert_eq!(api.state("t").await, "research:approved");
    api.run_task("t").await.expect("RunTask");
    let second = events.expect("assigned", "t").await;
    assert!(!second.detail.starts_with("research"), "{second:?}");
    // RunTask is for operators in manual mode: an unknown task and a garbage name say so.
    let e = api.run_task("nope").await.expect_err("unknown task");
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = api
        .run_task(&"x".repeat(1 << 20))
        .await
        .expect_err("1 MiB name");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue24_2_automaton_run_in_autopilot_is_refused_with_what_to_do() {
    let env = Env::new();
    let coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    api.create("t").await.expect("create");
    let out = cli_at(&env, &coord, &["run", "t"]);
    assert_ne!(out.code, 0, "{out:?}");
    assert!(
        out.stderr.contains("autopilot is on") && out.stderr.contains("Autopilot: Disabled"),
        "{}",
        out.stderr
    );
    assert_eq!(out.stderr.trim().lines().count(), 1, "{}", out.stderr);
    assert_eq!(
        api.run_task("t").await.expect_err("autopilot").code(),
        Code::FailedPrecondition
    );
}
