//! Issue 21, "failures that say why" and "an implement run that changed no code", with real
//! processes: a real coordinator, real workers running `sh -c` agents, the real CLI. A missing
//! program is named; a failed run's output tail reaches `GetTask.runs`, `status --task` and
//! `tasks`; an artifact written at the workspace root says where it belongs; a model server
//! that refuses every request is named with the counts; an implement run that changed no
//! code is a `no_code_change` event (and a failed run under `Require code change: yes`); a
//! read-only phase's dropped changes are named; a retry waits and goes to the other worker.

use std::time::Duration;

use automaton_proto::v1 as pb;

use crate::harness::*;
use crate::work::{FLEET, git_init};
use crate::workers::Worker;

/// A worker named `name` running the command template `agent` (optionally in front of a
/// model server).
fn agent_worker(coord: &Coord, name: &str, agent: &str, model_server: Option<&str>) -> Worker {
    let mut args = vec![
        "--name",
        name,
        "--simulate-gpu",
        "sim:24GiB",
        "--agent",
        agent,
        "--kill-grace",
        "300ms",
    ];
    if let Some(url) = model_server {
        args.extend(["--model-server", url]);
    }
    Worker::start(&coord.url, &args, &[])
}

/// A coordinator over `env` that holds a task after its first failed run.
fn coordinator(env: &std::sync::Arc<Env>) -> Coord {
    Coord::start_with_env(env, &FLEET, &[("AUTOMATON_MAX_ATTEMPTS", "1")])
}

/// The first stopped run of `task`.
async fn first_stopped(api: &Api, task: &str, w: &Worker) -> pb::Run {
    let run = poll(
        &format!("a stopped run of {task}"),
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            async move {
                let runs = api.get(task).await.ok()?.runs;
                runs.into_iter().find(|r| r.state == "stopped")
            }
        },
    )
    .await;
    assert!(!run.stop_reason.is_empty(), "{run:#?}\n{}", w.stderr());
    run
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_a_missing_program_is_named_and_its_output_shown() {
    let env = Env::new();
    git_init(&env);
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    let w = agent_worker(
        &coord,
        "gpu-a",
        "no-such-agent-xyz --yes --message-file {prompt_file}",
        None,
    );
    api.create("t").await.expect("create");
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(run.stop_reason, "agent_error", "{run:#?}");
    assert_eq!(
        run.detail, "command not found: no-such-agent-xyz",
        "{run:#?}"
    );
    assert_eq!(run.exit_code, 127, "{run:#?}");
    assert!(
        run.output_tail.contains("no-such-agent-xyz: not found"),
        "the shell's own words: {run:#?}"
    );
    // Held after its one failed run: `status --task` shows why and the tail, `tasks` the
    // one-line excerpt.
    poll("the task held", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move {
            let d = api.get("t").await.ok()?;
            (!d.summary?.held.is_empty()).then_some(())
        }
    })
    .await;
    let out = cli_at(&env, &coord, &["status", "--task", "t"]);
    assert!(
        out.stdout
            .contains("(agent_error): command not found: no-such-agent-xyz"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("Output of the research run by gpu-a"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout
            .lines()
            .any(|l| l.starts_with("      ") && l.contains("no-such-agent-xyz: not found")),
        "the tail, indented: {}",
        out.stdout
    );
    let out = cli_at(&env, &coord, &["tasks"]);
    assert!(
        out.stdout.lines().any(|l| l
            .trim_start()
            .starts_with("last run: agent_error: command not found: no-such-agent-xyz — ")
            && l.contains("not found")),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_an_agent_that_prints_then_fails_has_its_tail_in_the_run() {
    let env = Env::new();
    git_init(&env);
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    let w = agent_worker(
        &coord,
        "gpu-a",
        "for i in $(seq 1 40); do echo \"step $i\"; done; sleep 0.2; echo 'the model said no' >&2; exit 1",
        None,
    );
    api.create("t").await.expect("create");
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(
        (run.stop_reason.as_str(), run.detail.as_str()),
        ("agent_error", "exit status 1"),
        "{run:#?}"
    );
    assert!(
        run.output_tail.contains("step 1\n")
            && run.output_tail.contains("step 40\n")
            && run.output_tail.ends_with("the model said no\n"),
        "{run:#?}"
    );
    let out = cli_at(&env, &coord, &["status", "--task", "t"]);
    assert!(
        out.stdout.contains("last 20 of 41 lines:"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("\n      step 40\n"), "{}", out.stdout);
    assert!(
        out.stdout.contains("\n      the model said no\n"),
        "{}",
        out.stdout
    );
    assert!(
        !out.stdout.contains("      step 20\n"),
        "only the last lines: {}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_an_artifact_at_the_workspace_root_says_where_it_belongs() {
    let env = Env::new();
    git_init(&env);
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    let w = agent_worker(&coord, "gpu-a", "echo '# spec' > SPEC.md", None);
    api.create("t").await.expect("create");
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(run.stop_reason, "agent_error", "{run:#?}");
    assert_eq!(
        run.detail,
        "no SPEC.md written at .automaton-task/SPEC.md (found SPEC.md at the workspace root: write it to $AUTOMATON_ARTIFACT)",
        "{run:#?}"
    );
}

/// Three chat completions through `$OPENAI_BASE_URL`, whatever they answer; no artifact.
const CALLING_AGENT: &str = r#"for i in 1 2 3; do
  curl -q -sS --noproxy '*' -X POST -H 'Content-Type: application/json' --data-binary '{"model":"m","messages":[]}' "$OPENAI_BASE_URL/chat/completions" || true
done
exit 0"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_a_model_server_refusing_connections_is_named_with_the_counts() {
    // A port nobody listens on: every connection is refused.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr").port()
    };
    let server = format!("http://127.0.0.1:{port}");
    let env = Env::new();
    git_init(&env);
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    let w = agent_worker(&coord, "gpu-a", CALLING_AGENT, Some(&server));
    api.create("t").await.expect("create");
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(run.stop_reason, "agent_error", "{run:#?}");
    assert_eq!(
        run.detail,
        "model server unreachable (3 of 3 requests failed: connection refused); no SPEC.md written",
        "{run:#?}\n{}",
        w.stderr()
    );
    // The proxy's own answer is in the agent's output.
    assert!(run.output_tail.contains("unreachable"), "{run:#?}");
    assert!(
        w.stderr()
            .lines()
            .any(|l| l.contains("WARN") && l.contains("with_usage=0")),
        "with_usage=0 at WARN: {}",
        w.stderr()
    );
}

/// An implement that writes only its artifact and aider's chat history.
const NO_CODE_AGENT: &str =
    "echo chat > .aider.chat.history.md; echo '# done' > \"$AUTOMATON_ARTIFACT\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_an_implement_that_changes_no_code_is_reported_and_can_fail() {
    // Without the key: completed, with a warning in the run and a `no_code_change` event.
    let env = Env::new();
    git_init(&env);
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    api.approved_research(&env, "t", Some("implement")).await;
    let w = agent_worker(&coord, "gpu-a", NO_CODE_AGENT, None);
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(run.stop_reason, "completed", "{run:#?}");
    assert_eq!(
        run.warnings,
        vec!["implement changed no code (only tool state: .aider.chat.history.md)".to_string()],
        "{run:#?}"
    );
    let e = events.expect("no_code_change", "t").await;
    assert_eq!(e.agent, "gpu-a");
    assert!(e.detail.contains("implement changed no code"), "{e:?}");
    let out = cli_at(&env, &coord, &["status", "--task", "t"]);
    assert!(
        out.stdout
            .contains("      warning: implement changed no code (only tool state"),
        "{}",
        out.stdout
    );
    drop(w);

    // `Require code change: yes`: a failed run, and nothing sent.
    let env = Env::new();
    git_init(&env);
    std::fs::create_dir_all(env.root().join(".automaton")).expect("meta");
    std::fs::write(
        env.root().join(".automaton/.agent.md"),
        "- **Require code change**: yes\n",
    )
    .expect("agent.md");
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    api.approved_research(&env, "t", Some("implement")).await;
    let w = agent_worker(&coord, "gpu-a", NO_CODE_AGENT, None);
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(
        (run.stop_reason.as_str(), run.detail.as_str()),
        ("agent_error", "implement changed no code"),
        "{run:#?}"
    );
    assert_eq!(
        env.task_file("t", "IMPLEMENTATION.md"),
        None,
        "nothing sent"
    );
    assert_eq!(api.state("t").await, "implement");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_a_read_only_phases_code_changes_are_named() {
    let env = Env::new();
    git_init(&env);
    let coord = coordinator(&env);
    let mut api = coord.api().await;
    let w = agent_worker(
        &coord,
        "gpu-a",
        "echo 'pub fn g() {}' > src/lib.rs; echo x > src/new.rs; echo '# spec' > {artifact}",
        None,
    );
    api.create("t").await.expect("create");
    let run = first_stopped(&api, "t", &w).await;
    assert_eq!(run.stop_reason, "completed", "{run:#?}");
    assert_eq!(
        run.warnings,
        vec!["code changes in a read-only phase were dropped: src/lib.rs, src/new.rs".to_string()],
        "{run:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_failures_a_retry_waits_and_goes_to_the_other_idle_worker() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // Fails the first run (wherever it runs), then writes the artifact.
    let marks = tempfile::tempdir().expect("tempdir");
    let mark = marks.path().join("failed-once");
    let agent = format!(
        "if [ -e '{m}' ]; then echo '# spec' > {{artifact}}; else touch '{m}'; echo first try fails; exit 1; fi",
        m = mark.display()
    );
    let mut events = Events::watch(&api).await;
    let a = agent_worker(&coord, "gpu-a", &agent, None);
    let b = agent_worker(&coord, "gpu-b", &agent, None);
    api.create("t").await.expect("create");
    let first = first_stopped(&api, "t", &a).await;
    assert_eq!(first.stop_reason, "agent_error", "{first:#?}");
    let second = poll("a second run", Duration::from_secs(20), || {
        let mut api = api.clone();
        async move {
            let runs = api.get("t").await.ok()?.runs;
            runs.get(1).cloned()
        }
    })
    .await;
    assert_ne!(
        second.worker,
        first.worker,
        "the retry goes to the other idle worker: {first:#?} {second:#?}\n{}\n{}",
        a.stderr(),
        b.stderr()
    );
    // The coordinator's own clock: from the failure to the next offer.
    let at = |e: &pb::Event| std::time::SystemTime::try_from(e.at.expect("at")).expect("a time");
    let stopped = events.expect("run_stopped", "t").await;
    let _first_offer = events.expect("assigned", "t").await;
    let retried = events.expect("assigned", "t").await;
    let waited = at(&retried)
        .duration_since(at(&stopped))
        .unwrap_or_default();
    assert!(
        waited >= Duration::from_millis(950),
        "the retry waited {waited:?}, not the 1 s pause"
    );
    let done = poll("the retry completed", Duration::from_secs(20), || {
        let mut api = api.clone();
        async move {
            let runs = api.get("t").await.ok()?.runs;
            runs.get(1).filter(|r| r.state == "stopped").cloned()
        }
    })
    .await;
    assert_eq!(done.stop_reason, "completed", "{done:#?}");
}
