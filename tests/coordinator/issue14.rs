//! Issue 14's items that need a running coordinator: `ValidateFolder` without a task (item 1),
//! a past holder refused as the approver through the coordinator (item 5), and an empty
//! coordinator URL (companion item B). The rest of issue 14 is in `tests/status/issue14.rs`.

use tonic::Code;

use crate::harness::{Coord, Env, expect_err};

/// Item 1 through the coordinator: an empty task in `ValidateFolder` validates every task and
/// sub-task, and the CLI's `--validate-folder` without `--task` forwards to it with the same
/// output as on the files.
#[tokio::test(flavor = "multi_thread")]
async fn issue14_item1_validate_folder_rpc_with_empty_task_validates_every_task() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.create("alpha").await.expect("create");
    api.create("alpha/sub-a").await.expect("create");
    api.create("beta").await.expect("create");
    let r = api
        .tasks
        .validate_folder(api.req(automaton_proto::v1::ValidateFolderRequest {
            task: String::new(),
        }))
        .await
        .expect("ValidateFolder without a task")
        .into_inner();
    assert_eq!(r.exit_code, 0, "{r:?}");
    let tasks: Vec<&str> = r.reports.iter().map(|x| x.task.as_str()).collect();
    assert_eq!(tasks, ["alpha", "alpha/sub-a", "beta"]);

    env.artifact("alpha/sub-a", "DESIGN.md", "early\n");
    let forwarded = env.cli(&["--validate-folder"]);
    forwarded.code(1);
    assert!(
        forwarded
            .stdout
            .contains("Task: alpha/sub-a\nPhase: new (from .state)\nFolder validation: FAIL"),
        "{forwarded:?}"
    );
    let local = env.cli(&["--validate-folder", "--local"]);
    assert_eq!(forwarded, local, "forwarded output differs from the files'");
}

/// Item 5 through the coordinator: the agent that held `code_review` (granted by the
/// coordinator, recorded by `record_holder`) may not approve that phase's gate.
#[tokio::test(flavor = "multi_thread")]
async fn issue14_item5_past_holder_refused_as_approver_through_the_coordinator() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.approved_research(&env, "t", Some("implement")).await;
    let l = api.claim("t", "impl-1", 60_000).await.expect("claim");
    env.artifact("t", "IMPLEMENTATION.md", "done\n");
    api.transition_under("t", "code_review", &l)
        .await
        .expect("to code_review");
    let l = api.claim("t", "reviewer-1", 60_000).await.expect("claim");
    env.artifact("t", "CODE_REVIEW.md", "review\n");
    api.transition_under("t", "code_review:awaiting_approval", &l)
        .await
        .expect("to awaiting");
    assert_eq!(
        env.task_file("t", ".state.holders").map(String::from_utf8),
        Some(Ok("implement|impl-1\ncode_review|reviewer-1\n".to_string()))
    );
    let before = env.snapshot();
    expect_err(
        api.approve("t", "reviewer-1").await,
        Code::FailedPrecondition,
        "'reviewer-1' held task 't' in its code_review phase",
        Some("refused"),
    );
    // The CLI through the coordinator says the same, and nothing changed.
    let r = env.cli(&["--task", "t", "--approve", "--approver", "reviewer-1"]);
    r.code(1);
    assert!(
        r.stderr
            .starts_with("ERROR: 'reviewer-1' held task 't' in its code_review phase"),
        "{r:?}"
    );
    assert!(before == env.snapshot(), "a refused approval changed files");
    api.approve("t", "carol").await.expect("another approver");
    assert_eq!(api.state("t").await, "code_review:approved");
}

/// Companion item B: an empty `AUTOMATON_COORDINATOR` (or `--coordinator ""`) is an error
/// that says what to do; it never makes the CLI write files behind the owning coordinator.
#[tokio::test(flavor = "multi_thread")]
async fn issue14_item_b_empty_coordinator_url_is_an_error_while_a_coordinator_owns_the_project() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let before = env.snapshot();
    let commands: &[&[&str]] = &[
        &["--create-task", "sneaky"],
        &["--task", "t", "--transition", "research:awaiting_approval"],
        &["--task", "t", "--claim", "--agent", "a"],
        &["--upgrade"],
        &["--list"],
    ];
    for args in commands {
        let r = env.cli_env(args, &[("AUTOMATON_COORDINATOR", "")]);
        r.code(2);
        assert_eq!(
            r.stderr.lines().next().unwrap_or(""),
            "ERROR: AUTOMATON_COORDINATOR is empty. Give a coordinator URL (e.g. http://127.0.0.1:7070), or leave it unset to use the coordinator that owns the project (or the files when none does).",
            "{args:?}"
        );
        let mut flagged = args.to_vec();
        flagged.extend(["--coordinator", ""]);
        let r = env.cli(&flagged);
        r.code(2);
        assert!(
            r.stderr.starts_with("ERROR: --coordinator is empty."),
            "{args:?}: {r:?}"
        );
    }
    assert!(
        before == env.snapshot(),
        "an empty coordinator URL wrote files"
    );
    assert!(!env.task_dir("sneaky").exists());
    assert_eq!(api.state("t").await, "research");
}
