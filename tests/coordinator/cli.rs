//! One owner per project, and the `automaton status` CLI forwarding to it.

use std::time::Duration;

use crate::harness::{Coord, Env, Events, Run, lock_view};

/// Issue §Semantics "One owner … A second coordinator on the same project refuses to start and
/// says which process owns it"; §Tests "a second coordinator on the same project refuses to
/// start".
#[tokio::test(flavor = "multi_thread")]
async fn second_coordinator_on_same_project_refuses_naming_the_owner() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.create("owned").await.expect("create");
    let before = env.snapshot();

    let second = env.run_coordinator(&[], &[], Duration::from_secs(20));
    assert_ne!(
        second.code, 0,
        "a second coordinator must refuse: {second:?}"
    );
    assert!(!second.stdout.contains("listening on"), "{second:?}");
    assert!(
        second.stderr.contains("owned by another coordinator"),
        "{second:?}"
    );
    assert!(
        second.stderr.contains(&format!("pid: {}", coord.pid())),
        "the refusal names the owner's pid {}: {second:?}",
        coord.pid()
    );
    assert!(
        second.stderr.contains(&coord.url),
        "the refusal names the owner's address {}: {second:?}",
        coord.url
    );
    // Also with another port and --insecure: still the same project, still refused.
    let third = env.run_coordinator(
        &["--listen", "127.0.0.1:0", "--insecure"],
        &[],
        Duration::from_secs(20),
    );
    assert_ne!(third.code, 0, "{third:?}");

    // The owner is undisturbed.
    assert!(before == env.snapshot(), "the refused start changed files");
    assert_eq!(api.state("owned").await, "new");
    let lock = std::fs::read_to_string(env.root().join(".automaton/coordinator.lock"))
        .expect("coordinator.lock");
    assert!(lock.contains(&format!("pid: {}", coord.pid())), "{lock}");
    assert!(lock.contains(&format!("address: {}", coord.url)), "{lock}");
}

/// The same read-only command forwarded and with `--local`: identical stdout, stderr, exit.
pub(crate) fn same_as_local(env: &Env, args: &[&str]) -> Run {
    let forwarded = env.cli(args);
    let mut local_args = args.to_vec();
    local_args.push("--local");
    let local = env.cli(&local_args);
    assert_eq!(
        forwarded, local,
        "`automaton status {args:?}` differs from --local"
    );
    forwarded
}

/// Issue §Semantics "`automaton status …` run while a coordinator owns the project sends its
/// request to that coordinator instead of writing files … with identical output and exit
/// codes"; §Tests "the CLI forwards to the running one".
#[tokio::test(flavor = "multi_thread")]
async fn cli_forwards_to_the_running_coordinator_with_identical_output() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let mut ev = Events::watch(&api).await;

    // Mutations go through the coordinator: it emits their events.
    let r = env.cli(&["--create-task", "alpha"]);
    r.ok();
    assert!(
        r.stdout.contains("Created task 'alpha' in state 'new'"),
        "{r:?}"
    );
    ev.expect("task_created", "alpha").await;
    env.cli(&["--create-task", "beta"]).ok();
    ev.expect("task_created", "beta").await;
    env.cli(&["--create-task", "alpha/sub-one"]).ok();
    ev.expect("task_created", "alpha/sub-one").await;
    let r = env.cli(&["--task", "alpha", "--transition", "research"]);
    r.ok();
    ev.expect("transitioned", "alpha").await;
    assert_eq!(api.state("alpha").await, "research");
    env.cli(&["--task", "beta", "--transition", "research"])
        .ok();
    ev.expect("transitioned", "beta").await;

    // Read-only commands: identical to the file mode.
    same_as_local(&env, &["--list"]).ok();
    same_as_local(&env, &["--list", "--json"]).ok();
    let r = same_as_local(&env, &["--task", "alpha"]);
    r.ok();
    assert!(r.stdout.contains("research"), "{r:?}");
    same_as_local(&env, &["--task", "alpha", "--json"]).ok();
    same_as_local(&env, &["--task", "alpha/sub-one"]).ok();
    same_as_local(&env, &["--task", "alpha", "--validate-folder"]);
    same_as_local(&env, &["--audit"]);
    same_as_local(&env, &["--audit", "--json"]);
    // Refusals too.
    let r = same_as_local(&env, &["--task", "no-such-task"]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.error_line()
            .starts_with("ERROR: Task 'no-such-task' not found"),
        "{r:?}"
    );
    let r = same_as_local(&env, &["--task", "no-such-task", "--json"]);
    assert_eq!(r.code, 2, "{r:?}");
    let r = same_as_local(&env, &["--task", "Bad_Name"]);
    assert_eq!(r.code, 2, "{r:?}");
    same_as_local(&env, &["--task", "alpha/nope"]);

    // An illegal transition: refused by the coordinator with the file mode's message and exit
    // code (compared on a twin project without a coordinator), nothing changed.
    let twin = Env::new();
    twin.cli(&["--create-task", "alpha"]).ok();
    twin.cli(&["--task", "alpha", "--transition", "research"])
        .ok();
    let before = env.snapshot();
    for target in ["implement", "research:approved", "complete"] {
        let args = ["--task", "alpha", "--transition", target];
        let forwarded = env.cli(&args);
        let file_mode = twin.cli(&args);
        assert_eq!(forwarded.code, 1, "{forwarded:?}");
        assert_eq!(
            (forwarded.code, forwarded.error_line()),
            (file_mode.code, file_mode.error_line()),
            "{target}"
        );
    }
    let forwarded = env.cli(&["--task", "alpha", "--approve"]);
    let file_mode = twin.cli(&["--task", "alpha", "--approve"]);
    assert_eq!(
        (forwarded.code, forwarded.error_line()),
        (file_mode.code, file_mode.error_line())
    );
    let forwarded = env.cli(&["--create-task", "alpha"]);
    assert_eq!(forwarded.code, 1, "already exists: {forwarded:?}");
    assert!(
        forwarded.error_line().contains("already exists"),
        "{forwarded:?}"
    );
    assert!(
        before == env.snapshot(),
        "refused CLI commands changed files"
    );

    // Claims (no multi-agent mode needed with a coordinator).
    let r = env.cli(&[
        "--task", "alpha", "--claim", "--agent", "agent-x", "--ttl", "60s",
    ]);
    r.ok();
    let l = api
        .lease_of("alpha")
        .await
        .expect("the coordinator holds agent-x's lease");
    assert_eq!(l.agent, "agent-x");
    assert!(r.stdout.contains(&l.token.to_string()), "{r:?} vs {l:?}");
    let e = ev.expect("lease_granted", "alpha").await;
    assert_eq!((e.agent.as_str(), e.token), ("agent-x", l.token));
    let json = env.cli(&["--task", "alpha", "--claim", "--agent", "agent-x", "--json"]);
    json.ok();
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("claim JSON");
    assert_eq!(v["renewed"], serde_json::Value::Bool(true), "{v}");
    assert_eq!(v["lease"]["token"].as_u64(), Some(l.token), "{v}");
    // Another agent: refused, exit 1, the coordinator's message.
    let refused = env.cli(&["--task", "alpha", "--claim", "--agent", "agent-y"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused
            .error_line()
            .starts_with("ERROR: Task 'alpha' is leased to agent-x until "),
        "{refused:?}"
    );
    assert!(
        refused
            .error_line()
            .contains(&format!("(token {})", l.token)),
        "{refused:?}"
    );
    ev.expect("lease_refused", "alpha").await;
    // A transition without the lease is refused; under it, it works.
    env.artifact("alpha", "SPEC.md", "spec\n");
    let refused = env.cli(&[
        "--task",
        "alpha",
        "--transition",
        "research:awaiting_approval",
    ]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.error_line().contains("is leased to agent-x"),
        "{refused:?}"
    );
    let stale = env.cli(&[
        "--task",
        "alpha",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "agent-x",
        "--lease",
        &l.lease_id,
        "--token",
        &(l.token + 7).to_string(),
    ]);
    assert_eq!(stale.code, 1, "{stale:?}");
    assert!(stale.error_line().contains("is stale"), "{stale:?}");
    assert_eq!(api.state("alpha").await, "research");
    // One set of lease rules: another agent's name is refused, the holder's name alone is
    // enough, as in the local mode (it used to be refused when forwarded).
    let other = env.cli(&[
        "--task",
        "alpha",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "agent-y",
    ]);
    assert_eq!(other.code, 1, "{other:?}");
    assert!(
        other.error_line().contains("is leased to agent-x"),
        "{other:?}"
    );
    let r = env.cli(&[
        "--task",
        "alpha",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "agent-x",
    ]);
    r.ok();
    assert_eq!(api.state("alpha").await, "research:awaiting_approval");
    assert!(
        api.lease_of("alpha").await.is_none(),
        "the lease ended with its phase"
    );
    ev.expect("transitioned", "alpha").await;
    // Approve, forwarded.
    env.cli(&["--task", "alpha", "--approve", "--approver", "alice"])
        .ok();
    assert_eq!(api.state("alpha").await, "research:approved");
    assert_eq!(ev.expect("approved", "alpha").await.agent, "alice");

    // Release, forwarded; then a release with nothing held is refused.
    api.claim("beta", "agent-z", 60_000)
        .await
        .expect("claim beta");
    let refused = env.cli(&["--task", "beta", "--release", "--agent", "agent-q"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.error_line().contains("only the holder can release"),
        "{refused:?}"
    );
    let r = env.cli(&["--task", "beta", "--release", "--agent", "agent-z"]);
    r.ok();
    assert!(r.stdout.starts_with("Released task 'beta'"), "{r:?}");
    assert!(api.lease_of("beta").await.is_none());
    ev.expect("lease_released", "beta").await;
    let refused = env.cli(&["--task", "beta", "--release", "--agent", "agent-z"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused
            .error_line()
            .contains("has no live lease held by agent-z"),
        "{refused:?}"
    );

    // Read-only views still agree after all that (no live lease left, views settled).
    lock_view(&env, "alpha", None).await;
    lock_view(&env, "beta", None).await;
    same_as_local(&env, &["--list"]).ok();
    same_as_local(&env, &["--task", "alpha"]).ok();
    same_as_local(&env, &["--task", "beta", "--json"]).ok();

    // Once the coordinator is gone, the CLI works on the files again.
    let status = coord.terminate();
    assert!(status.success());
    let r = env.cli(&["--task", "alpha"]);
    r.ok();
    assert!(r.stdout.contains("research:approved"), "{r:?}");
    env.cli(&["--create-task", "gamma"]).ok();
    assert!(env.task_dir("gamma").join(".state").is_file());
    drop(ev);
    coord = Coord::start(&env, &[]);
    assert_eq!(coord.api().await.state("gamma").await, "new");
}

/// Bad input / production expectation: a coordinator that never answers (a hung process, a
/// connection that went dead) costs the CLI its deadline, not forever, and the error is one
/// line that says what to do, exit 2, nothing written.
#[test]
fn cli_gives_up_on_a_coordinator_that_never_answers_in_one_line() {
    let env = Env::new();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("address"));
    // Accepts connections and holds them open, reading and answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            match conn {
                Ok(c) => held.push(c),
                Err(_) => return,
            }
        }
    });
    let before = env.snapshot();
    let started = std::time::Instant::now();
    let r = env.cli_env(
        &[
            "--task",
            "t",
            "--transition",
            "research",
            "--coordinator",
            &url,
        ],
        &[("AUTOMATON_CALL_TIMEOUT", "1s")],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.error_line().starts_with(&format!(
            "ERROR: no answer from the coordinator at {url} within 1s"
        )) && r.error_line().contains("retry"),
        "{r:?}"
    );
    assert_eq!(r.stderr.lines().count(), 1, "one line: {r:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "gave up after {:?}",
        started.elapsed()
    );
    assert_eq!(env.snapshot(), before, "nothing written");

    let r = env.cli_env(
        &["--list", "--coordinator", &url],
        &[("AUTOMATON_CALL_TIMEOUT", "soon")],
    );
    assert_eq!(r.code, 2, "{r:?}");
    assert!(r.error_line().contains("AUTOMATON_CALL_TIMEOUT"), "{r:?}");
}

/// Issue §Semantics "(also --coordinator URL / AUTOMATON_COORDINATOR)".
#[tokio::test(flavor = "multi_thread")]
async fn cli_honours_coordinator_flag_and_env() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.create("remote-only").await.expect("create");

    // Another folder, no coordinator of its own: pointed at ours, it shows our tasks.
    let other = Env::new();
    let r = other.cli(&["--list", "--coordinator", &coord.url]);
    r.ok();
    assert!(
        r.stdout.contains("remote-only"),
        "--coordinator is honoured: {r:?}"
    );
    let r = other.cli_env(&["--list"], &[("AUTOMATON_COORDINATOR", &coord.url)]);
    r.ok();
    assert!(
        r.stdout.contains("remote-only"),
        "AUTOMATON_COORDINATOR is honoured: {r:?}"
    );
    let r = other.cli_env(
        &["--task", "remote-only", "--transition", "research"],
        &[("AUTOMATON_COORDINATOR", &coord.url)],
    );
    r.ok();
    assert_eq!(api.state("remote-only").await, "research");
    assert!(
        !other.root().join(".automaton").exists(),
        "forwarded commands must not write the local folder"
    );
    let r = other.cli(&["--list"]);
    assert!(
        !r.stdout.contains("remote-only"),
        "without either, the local folder: {r:?}"
    );

    // Both beat the lock file: a dead address is reported as unavailable (exit 2).
    let dead = "http://127.0.0.1:1";
    let r = env.cli(&["--list", "--coordinator", dead]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.error_line().contains("coordinator is unavailable"),
        "{r:?}"
    );
    let r = env.cli_env(&["--list"], &[("AUTOMATON_COORDINATOR", dead)]);
    assert_eq!(r.code, 2, "{r:?}");
    assert!(
        r.error_line().contains("coordinator is unavailable"),
        "{r:?}"
    );
    // The flag beats the environment.
    let r = env.cli_env(
        &["--list", "--coordinator", &coord.url],
        &[("AUTOMATON_COORDINATOR", dead)],
    );
    r.ok();
    assert!(r.stdout.contains("remote-only"), "{r:?}");
}
