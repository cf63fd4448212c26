//! Seed 001's multi-agent mode without a coordinator: `.state.lock` leases, fencing tokens,
//! reviewer ≠ implementer, and what many processes at once (or a `kill -9`) can do.

use std::fs;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::harness::*;

fn lock_field(env: &Env, task: &str, key: &str) -> Option<String> {
    let text = fs::read_to_string(env.task_dir(task).join(".state.lock")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}: ")).map(str::to_string))
}

fn token(env: &Env, task: &str) -> u64 {
    lock_field(env, task, "token")
        .and_then(|t| t.parse().ok())
        .expect("token line")
}

/// A task in `research`, claimable.
fn research_task(env: &Env, task: &str) {
    env.create(task);
    env.status(&["--task", task, "--transition", "research"])
        .ok();
}

#[test]
fn claim_writes_state_lock_with_seed_001_fields_lease_and_token() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    let run = env.status(&["--task", "t", "--claim", "--agent", "agent-1"]);
    run.ok();
    assert!(
        run.stdout
            .starts_with("Claimed task 't' for agent-1 until "),
        "{}",
        run.stdout
    );
    let text = fs::read_to_string(env.task_dir("t").join(".state.lock")).expect("lock");
    let keys: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once(':').map(|(k, _)| k))
        .collect();
    assert_eq!(
        keys,
        ["agent", "phase", "claimed", "expires", "lease", "token"]
    );
    assert_eq!(lock_field(&env, "t", "agent").as_deref(), Some("agent-1"));
    assert_eq!(lock_field(&env, "t", "phase").as_deref(), Some("research"));
    assert!(token(&env, "t") >= 1);
    let shown = env.status(&["--task", "t"]);
    assert!(
        shown.stdout.contains("Lease: held by agent-1 until "),
        "{}",
        shown.stdout
    );
}

#[test]
fn claim_default_ttl_is_agent_md_lock_timeout() {
    let env = Env::new();
    env.write(
        ".automaton/.agent.md",
        "Mode: multi-agent\nLock timeout: 90s\n",
    );
    research_task(&env, "t");
    env.status(&["--task", "t", "--claim", "--agent", "a", "--json"])
        .ok();
    let claimed = automaton_store::parse_time(&lock_field(&env, "t", "claimed").expect("claimed"))
        .expect("time");
    let expires = automaton_store::parse_time(&lock_field(&env, "t", "expires").expect("expires"))
        .expect("time");
    assert_eq!(
        expires.duration_since(claimed).expect("after"),
        Duration::from_secs(90)
    );
}

#[test]
fn claim_refused_outside_multi_agent_mode() {
    let env = Env::new();
    research_task(&env, "t");
    let run = env.refused(&["--task", "t", "--claim", "--agent", "a"]);
    run.code(1);
    assert!(
        run.error_line().contains("add 'Mode: multi-agent'"),
        "{}",
        run.stderr
    );
}

#[test]
fn claim_multi_agent_mode_from_user_agent_md() {
    let env = Env::new();
    fs::create_dir_all(env.home.path().join(".automaton")).expect("mkdir");
    fs::write(
        env.home.path().join(".automaton/.agent.md"),
        "Mode: multi-agent\n",
    )
    .expect("write");
    research_task(&env, "t");
    env.status(&["--task", "t", "--claim", "--agent", "a"]).ok();
}

#[test]
fn claim_refused_while_live_lease_held_naming_holder_and_expiry() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.status(&["--task", "t", "--claim", "--agent", "a"]).ok();
    let expires = lock_field(&env, "t", "expires").expect("expires");
    let run = env.refused(&["--task", "t", "--claim", "--agent", "b"]);
    run.code(1);
    assert!(
        run.error_line().contains("is leased to a until"),
        "{}",
        run.stderr
    );
    assert!(run.error_line().contains(&expires), "{}", run.stderr);
}

#[test]
fn claim_by_holder_renews_same_lease() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.status(&["--task", "t", "--claim", "--agent", "a", "--ttl", "1m"])
        .ok();
    let (id, tok) = (lock_field(&env, "t", "lease"), token(&env, "t"));
    let run = env.status(&["--task", "t", "--claim", "--agent", "a", "--ttl", "2h"]);
    run.ok();
    assert!(
        run.stdout.starts_with("Renewed the lease on task 't'"),
        "{}",
        run.stdout
    );
    assert_eq!(
        (lock_field(&env, "t", "lease"), token(&env, "t")),
        (id, tok)
    );
}

#[test]
fn claim_takes_over_expired_lock_with_higher_token() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.status(&["--task", "t", "--claim", "--agent", "a", "--ttl", "1s"])
        .ok();
    let first = token(&env, "t");
    std::thread::sleep(Duration::from_millis(1100));
    env.status(&["--task", "t", "--claim", "--agent", "b"]).ok();
    assert_eq!(lock_field(&env, "t", "agent").as_deref(), Some("b"));
    assert!(token(&env, "t") > first);
}

#[test]
fn stale_token_after_expiry_and_regrant_is_refused_and_changes_nothing() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.artifact("t", "SPEC.md", "spec\n");
    env.status(&["--task", "t", "--claim", "--agent", "a", "--ttl", "1s"])
        .ok();
    let old = token(&env, "t").to_string();
    std::thread::sleep(Duration::from_millis(1100));
    env.status(&["--task", "t", "--claim", "--agent", "b"]).ok();
    let run = env.refused(&[
        "--task",
        "t",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "a",
        "--token",
        &old,
    ]);
    assert!(
        run.error_line()
            .contains(&format!("Fencing token {old} is stale")),
        "{}",
        run.stderr
    );
    // The holder's own token works.
    let current = token(&env, "t").to_string();
    env.status(&[
        "--task",
        "t",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "b",
        "--token",
        &current,
    ])
    .ok();
}

#[test]
fn transition_under_live_lease_needs_the_holder() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.artifact("t", "SPEC.md", "spec\n");
    env.status(&["--task", "t", "--claim", "--agent", "a"]).ok();
    let run = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    assert!(
        run.error_line().contains("pass --agent a"),
        "{}",
        run.stderr
    );
    env.refused(&[
        "--task",
        "t",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "b",
    ]);
    let ok = env.status(&[
        "--task",
        "t",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "a",
    ]);
    ok.ok();
    assert!(
        ok.stdout.contains("Released the lease of a"),
        "{}",
        ok.stdout
    );
    assert!(
        !env.task_dir("t").join(".state.lock").exists(),
        "the lease ends with its phase"
    );
}

#[test]
fn release_removes_only_your_own_lock() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.status(&["--task", "t", "--claim", "--agent", "a"]).ok();
    let run = env.refused(&["--task", "t", "--release", "--agent", "b"]);
    assert!(
        run.error_line().contains("only the holder can release it"),
        "{}",
        run.stderr
    );
    env.status(&["--task", "t", "--release", "--agent", "a"])
        .ok();
    assert!(!env.task_dir("t").join(".state.lock").exists());
    env.refused(&["--task", "t", "--release", "--agent", "a"]);
}

#[test]
fn claim_refused_at_approval_gate_and_when_finished() {
    let env = Env::multi_agent();
    env.drive("t", &["research", "research:awaiting_approval"]);
    let run = env.refused(&["--task", "t", "--claim", "--agent", "a"]);
    assert!(
        run.error_line().contains("waits for a person's approval"),
        "{}",
        run.stderr
    );
    env.create("done");
    env.artifact("done", ".state", "complete\n");
    let run = env.refused(&["--task", "done", "--claim", "--agent", "a"]);
    assert!(
        run.error_line().contains("the task is finished"),
        "{}",
        run.stderr
    );
}

/// Walks `t` to code_review with `implementers` each having claimed implement in turn.
fn implemented_by(env: &Env, implementers: &[&str]) {
    env.drive("t", TO_IMPLEMENT);
    for a in implementers {
        env.status(&["--task", "t", "--claim", "--agent", a]).ok();
        env.status(&["--task", "t", "--release", "--agent", a]).ok();
    }
    env.artifact("t", "IMPLEMENTATION.md", "done\n");
    env.status(&["--task", "t", "--transition", "code_review"])
        .ok();
}

#[test]
fn implementer_recorded_and_refused_code_review_claim() {
    let env = Env::multi_agent();
    implemented_by(&env, &["alice", "bob"]);
    let recorded =
        fs::read_to_string(env.task_dir("t").join(".state.implementer")).expect("implementer file");
    assert_eq!(recorded, "alice\nbob\n");
    for a in ["alice", "bob"] {
        let run = env.refused(&["--task", "t", "--claim", "--agent", a]);
        assert!(
            run.error_line().contains("reviewer ≠ implementer"),
            "{}",
            run.stderr
        );
    }
    env.status(&["--task", "t", "--claim", "--agent", "carol"])
        .ok();
}

#[test]
fn implementer_refused_code_review_approval() {
    let env = Env::multi_agent();
    implemented_by(&env, &["alice"]);
    env.artifact("t", "CODE_REVIEW.md", "looks fine\n");
    env.status(&[
        "--task",
        "t",
        "--transition",
        "code_review:awaiting_approval",
    ])
    .ok();
    let run = env.refused(&["--task", "t", "--approve", "--approver", "alice"]);
    assert!(
        run.error_line().contains("may not approve its code_review"),
        "{}",
        run.stderr
    );
    env.status(&["--task", "t", "--approve", "--approver", "dave"])
        .ok();
    assert_eq!(env.state("t"), "code_review:approved");
}

#[test]
fn separated_phases_configurable_in_agent_md() {
    let env = Env::new();
    env.write(
        ".automaton/.agent.md",
        "Mode: multi-agent\nSeparated phases: none\n",
    );
    implemented_by(&env, &["alice"]);
    env.status(&["--task", "t", "--claim", "--agent", "alice"])
        .ok();
}

#[test]
fn lease_holder_cannot_approve_own_work() {
    let env = Env::multi_agent();
    env.drive(
        "t",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    // An `:approved` state is claimable; editing its artifact makes the approval stale, and a
    // stale approval can be approved again: but not by the agent holding the lease.
    env.status(&["--task", "t", "--claim", "--agent", "a"]).ok();
    env.artifact("t", "SPEC.md", "spec, edited by the holder\n");
    let run = env.refused(&["--task", "t", "--approve", "--approver", "a"]);
    run.code(1);
    assert!(
        run.error_line()
            .contains("'a' holds the lease on task 't' and may not approve its own work"),
        "{}",
        run.stderr
    );
    env.status(&["--task", "t", "--approve", "--approver", "operator"])
        .ok();
}

#[test]
fn corrupt_state_lock_refuses_claims_and_changes_nothing() {
    let env = Env::multi_agent();
    research_task(&env, "t");
    env.artifact("t", ".state.lock", "agent: a\nthis is not a lease\n");
    let run = env.refused(&["--task", "t", "--claim", "--agent", "b"]);
    run.code(2);
    assert!(
        run.error_line().contains("Corrupt lease file"),
        "{}",
        run.stderr
    );
}

/// Spawns `automaton status ARGS` without waiting.
fn spawn(env: &Env, args: &[&str]) -> Child {
    env.command(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn automaton")
}

#[test]
fn claim_race_16_processes_many_rounds_exactly_one_wins() {
    const PROCS: usize = 16;
    const ROUNDS: usize = 25;
    let env = Env::multi_agent();
    research_task(&env, "t");
    let mut last_token = 0;
    for round in 0..ROUNDS {
        let agents: Vec<String> = (0..PROCS).map(|i| format!("agent-{i}")).collect();
        let children: Vec<(String, Child)> = agents
            .iter()
            .map(|a| {
                (
                    a.clone(),
                    spawn(&env, &["--task", "t", "--claim", "--agent", a]),
                )
            })
            .collect();
        let mut winners = Vec::new();
        for (agent, child) in children {
            let out = child.wait_with_output().expect("wait");
            match out.status.code() {
                Some(0) => winners.push(agent),
                Some(1) => {
                    let err = String::from_utf8_lossy(&out.stderr);
                    assert!(
                        err.contains("is leased to"),
                        "round {round}: loser said {err}"
                    );
                }
                other => panic!(
                    "round {round}: unexpected exit {other:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                ),
            }
        }
        assert_eq!(winners.len(), 1, "round {round}: winners {winners:?}");
        assert_eq!(
            lock_field(&env, "t", "agent").as_deref(),
            Some(winners[0].as_str())
        );
        let tok = token(&env, "t");
        assert!(
            tok > last_token,
            "round {round}: token {tok} after {last_token}"
        );
        last_token = tok;
        env.status(&["--task", "t", "--release", "--agent", &winners[0]])
            .ok();
    }
}

/// A small deterministic generator for kill delays (no rand dependency).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % bound
    }
}

#[test]
fn state_write_survives_kill_9_at_any_instant() {
    const TASKS: usize = 120;
    let env = Env::new();
    let names: Vec<String> = (0..TASKS).map(|i| format!("t{i}")).collect();
    for n in &names {
        env.create(n);
    }
    // Kills land anywhere in a transition's life on this machine at this moment: the window
    // is twice the slowest of three whole transitions timed first (a loaded machine is slower).
    let mut whole = Duration::ZERO;
    for i in 0..3 {
        let calib = format!("calibrate{i}");
        env.create(&calib);
        let t = Instant::now();
        let mut child = spawn(&env, &["--task", &calib, "--transition", "research"]);
        let _ = child.wait();
        whole = whole.max(t.elapsed());
    }
    let window = u64::try_from(whole.as_micros() * 2)
        .unwrap_or(u64::MAX)
        .max(4000);
    let mut rng = Lcg(0x5eed);
    let started = Instant::now();
    let mut killed = 0;
    for n in &names {
        let mut child = spawn(&env, &["--task", n, "--transition", "research"]);
        std::thread::sleep(Duration::from_micros(rng.next(window)));
        if child.kill().is_ok() {
            killed += 1;
        }
        let _ = child.wait();
    }
    assert!(started.elapsed() < Duration::from_secs(120));
    let mut moved = 0;
    for n in &names {
        let dir = env.task_dir(n);
        let state = fs::read_to_string(dir.join(".state")).expect(".state must always exist");
        assert!(
            state == "new\n" || state == "research\n",
            "{n}: torn .state {state:?}"
        );
        moved += usize::from(state == "research\n");
        for e in fs::read_dir(&dir).expect("task dir").flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            assert!(
                !name.contains("tmp"),
                "{n}: temporary file {name} left in the task folder"
            );
        }
    }
    // Both outcomes must have happened for the test to mean anything.
    assert!(
        killed > 0 && moved > 0 && moved < TASKS,
        "killed {killed}, moved {moved} of {TASKS} (kills within {window} µs)"
    );
    // The next writer clears whatever a killed writer left in the staging folder.
    env.status(&["--task", &names[0], "--list"]);
    env.create("after");
    let tmp = env.root().join(".automaton/tmp");
    let left = fs::read_dir(&tmp).map(|d| d.count()).unwrap_or(0);
    assert_eq!(left, 0, "staging folder not cleaned");
    env.status(&["--list"]).ok();
}

#[test]
fn status_py_shim_forwards_arguments_output_and_exit_code() {
    let env = Env::new();
    let scripts = env.home.path().join(".automaton/scripts");
    fs::create_dir_all(&scripts).expect("mkdir");
    let shim = scripts.join("status.py");
    fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/status.py"),
        &shim,
    )
    .expect("copy shim");
    let py = |args: &[&str]| {
        let out = Command::new("python3")
            .arg(&shim)
            .args(args)
            .arg("--project")
            .arg(env.root())
            .env("AUTOMATON_BIN", BIN)
            .env("HOME", env.home.path())
            .output()
            .expect("python3 must be installed to run the status.py shim");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let created = py(&["--create-task", "x"]);
    assert_eq!(created.0, Some(0));
    assert_eq!(
        created.1,
        "Created task 'x' in state 'new'. Use --transition research to begin.\n"
    );
    let direct = env.status(&["--task", "x"]);
    assert_eq!(
        py(&["--task", "x"]),
        (
            Some(direct.code),
            direct.stdout.clone(),
            direct.stderr.clone()
        )
    );
    let refused = py(&["--task", "x", "--transition", "implement"]);
    assert_eq!(refused.0, Some(1));
    assert!(
        refused
            .2
            .starts_with("ERROR: Cannot transition from 'new' to 'implement'."),
        "{}",
        refused.2
    );
}
