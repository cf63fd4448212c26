//! Issue 14: the gaps of `automaton status` against seeds 004, 001 and 002, one test per item
//! (`issue14_item…`), each running the real binary and, where a command is read-only or
//! refused, the `status.py` shim too. The items that need a running coordinator (the
//! ValidateFolder RPC, approval by a past holder through the coordinator, an empty
//! coordinator URL) are in `tests/coordinator/issue14.rs`.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::harness::*;

/// Runs `args` through the binary and through `deploy/status.py`, asserts both give the same
/// exit code, stdout and stderr, and returns the binary's run. Only for commands that leave
/// the files as they were (reads, refusals): each runs twice.
#[track_caller]
fn same_via_shim(env: &Env, args: &[&str]) -> Run {
    let direct = env.status(args);
    let shim = env.shim(args);
    assert_eq!(
        direct, shim,
        "status.py differs from the binary for {args:?}"
    );
    direct
}

fn set_state(env: &Env, task: &str, state: &str) {
    fs::write(env.task_dir(task).join(".state"), format!("{state}\n")).expect("write .state");
}

fn read(env: &Env, task: &str, file: &str) -> String {
    fs::read_to_string(env.task_dir(task).join(file)).expect("read task file")
}

/// Item 1: `--validate-folder` without `--task` (how seed 001's orchestrator calls it).
#[test]
fn issue14_item1_validate_folder_without_task_validates_every_task_and_subtask() {
    let env = Env::new();
    env.drive("alpha", &["research"]);
    env.create("alpha/sub-a");
    env.drive("beta", &["research"]);
    let r = same_via_shim(&env, &["--validate-folder"]);
    r.code(0);
    for header in ["Task: alpha", "Task: alpha/sub-a", "Task: beta"] {
        assert!(r.stdout.lines().any(|l| l == header), "{header}: {r:?}");
    }
    assert_eq!(
        r.stdout
            .matches("Folder validation: PASS — no out-of-order artifacts found")
            .count(),
        3,
        "{r:?}"
    );
    assert!(
        r.stdout
            .ends_with("Folder validation of 3 task folders: PASS\n"),
        "{r:?}"
    );
    // One sub-task with an artifact of a later phase fails the whole project.
    env.artifact("alpha/sub-a", "IMPLEMENTATION.md", "early\n");
    let r = same_via_shim(&env, &["--validate-folder"]);
    r.code(1);
    assert!(
        r.stdout
            .contains("Task: alpha/sub-a\nPhase: new (from .state)\nFolder validation: FAIL — found out-of-order artifacts:\n  - IMPLEMENTATION.md"),
        "{r:?}"
    );
    assert!(
        r.stdout
            .ends_with("Folder validation of 3 task folders: FAIL — 1 failed\n"),
        "{r:?}"
    );
    // A task that cannot be read: exit 2, the others still validated.
    set_state(&env, "beta", "bogus");
    let r = same_via_shim(&env, &["--validate-folder"]);
    r.code(2);
    assert!(
        r.stdout
            .contains("Task: beta\nFolder validation: ERROR — Unknown phase 'bogus'"),
        "{r:?}"
    );
    assert!(r.stdout.contains("Task: alpha\n"), "{r:?}");
    // JSON carries every report.
    set_state(&env, "beta", "research");
    fs::remove_file(env.task_dir("alpha/sub-a").join("IMPLEMENTATION.md")).expect("rm");
    let r = env.status(&["--validate-folder", "--json"]);
    r.code(0);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("JSON");
    assert_eq!(v["reports"].as_array().map(Vec::len), Some(3), "{v}");
}

/// Item 2: task folders whose names are not kebab-case.
#[test]
fn issue14_item2_unaddressable_folders_are_listed_audited_and_left_alone_by_upgrade() {
    let env = Env::new();
    env.write(".automaton/tasks/Fix Login Bug/SPEC.md", "spec\n");
    fs::create_dir_all(env.root().join(".automaton/tasks/my_task")).expect("mkdir");
    // An audit of a project holding only such folders is not a PASS.
    let r = same_via_shim(&env, &["--audit"]);
    r.code(1);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with(
                "[FAIL] Fix Login Bug: manually created task folder — its name is not kebab-case"
            ) && l.ends_with("Rename the folder to 'fix-login-bug' to make it a task")),
        "{r:?}"
    );
    assert!(
        r.stdout
            .contains("  - my_task: invalid task folder name (its name is not kebab-case"),
        "{r:?}"
    );
    assert!(
        r.stdout.contains("\n2 tasks audited\n2 violations found\n"),
        "{r:?}"
    );
    assert!(!r.stdout.contains("[PASS] every task folder"), "{r:?}");
    // --list shows them, marked, with why and what to do.
    env.create("good");
    fs::create_dir_all(env.task_dir("good").join("subtasks/Bad Sub")).expect("mkdir");
    let r = same_via_shim(&env, &["--list"]);
    r.code(0);
    let row = |name: &str| {
        r.stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no row for {name}: {r:?}"))
            .to_string()
    };
    assert!(row("good ").contains("new"), "{r:?}");
    for (name, rename) in [
        ("Fix Login Bug", "fix-login-bug"),
        ("my_task", "my-task"),
        ("good/Bad Sub", "bad-sub"),
    ] {
        let line = row(name);
        assert!(line.contains("(invalid name)"), "{line}");
        assert!(
            line.contains(&format!("Rename the folder to '{rename}'")),
            "{line}"
        );
        assert!(line.contains("no command can name it"), "{line}");
    }
    // --upgrade reports them and leaves them alone.
    let before = env.snapshot();
    let r = env.status(&["--upgrade"]);
    r.ok();
    assert!(
        r.stdout
            .contains("Skipped 'Fix Login Bug': its name is not kebab-case"),
        "{r:?}"
    );
    assert!(r.stdout.contains("Skipped 'my_task'"), "{r:?}");
    assert!(r.stdout.contains("Skipped 'good/Bad Sub'"), "{r:?}");
    assert!(
        before == env.snapshot(),
        "--upgrade touched an unaddressable folder"
    );
    // --validate-folder over the whole project fails on them.
    let r = same_via_shim(&env, &["--validate-folder"]);
    r.code(1);
    assert!(
        r.stdout.contains(
            "Task folder: my_task\nFolder validation: FAIL — task folder created manually"
        ),
        "{r:?}"
    );
}

/// Item 3: an empty or whitespace-only file is not evidence.
#[test]
fn issue14_item3_empty_and_whitespace_artifacts_are_not_evidence() {
    let env = Env::new();
    // The heuristic and --upgrade ignore blank files.
    env.write(".automaton/tasks/old/SPEC.md", "  \n\t\n");
    env.write(".automaton/tasks/old/IMPLEMENTATION.md", "");
    let r = same_via_shim(&env, &["--task", "old"]);
    r.ok();
    assert!(
        r.stdout
            .lines()
            .any(|l| l == "Phase: unknown (no .state file found)"),
        "{r:?}"
    );
    env.status(&["--upgrade", "--task", "old"]).ok();
    assert_eq!(read(&env, "old", ".state"), "new\n");
    // A transition needs more than whitespace.
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "\n   \n\t\n");
    let r = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'research' to 'research:awaiting_approval'. Required artifact 'SPEC.md' is missing or empty in task folder."
    );
    // A blank file of a later phase is no phase-skipping either.
    env.artifact("t", "SPEC.md", "spec\n");
    env.artifact("t", "DESIGN.md", " \n");
    env.status(&["--task", "t", "--transition", "research:awaiting_approval"])
        .ok();
    // The audit: a passed phase whose artifact is whitespace lacks it.
    env.drive("done", &TO_IMPLEMENT[..3]);
    env.drive("done", &["implement"]);
    env.artifact("done", "IMPLEMENTATION.md", "impl\n");
    env.status(&["--task", "done", "--transition", "code_review"])
        .ok();
    env.artifact("done", "IMPLEMENTATION.md", "   \n");
    let r = same_via_shim(&env, &["--audit"]);
    r.code(1);
    assert!(
        r.stdout.contains(
            "[FAIL] done: .state says \"code_review\" but IMPLEMENTATION.md is missing or empty"
        ),
        "{r:?}"
    );
}

/// Item 4: `echo research:approved > .state` does not pass the gate.
#[test]
fn issue14_item4_hand_written_approved_state_cannot_pass_the_gate() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    set_state(&env, "t", "research:approved");
    assert_eq!(read(&env, "t", ".state.approvals"), "");
    let r = env.refused(&["--task", "t", "--transition", "implement"]);
    r.code(1);
    assert!(
        r.error_line().starts_with(
            "ERROR: Cannot transition from 'research:approved' to 'implement'. .state.approvals has no record of the research approval"
        ) && r.error_line().contains("Run --approve"),
        "{r:?}"
    );
    assert_eq!(env.shim(&["--task", "t", "--transition", "implement"]), r);
    let r = same_via_shim(&env, &["--task", "t"]);
    assert!(
        r.stdout.lines().any(|l| l
            == "Approval: NOT RECORDED: .state.approvals has no record of approving SPEC.md, so this state cannot be left. A person runs --approve"),
        "{r:?}"
    );
    let r = same_via_shim(&env, &["--list"]);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with("t ") && l.contains("research:approved (no approval record)")),
        "{r:?}"
    );
    let r = same_via_shim(&env, &["--audit"]);
    r.code(1);
    assert!(
        r.stdout.contains("[FAIL] t: .state says \"research:approved\" but .state.approvals has no research:approved record — suggested correction: research:awaiting_approval"),
        "{r:?}"
    );
    // A later phase written by hand is reported too.
    env.create("u");
    env.artifact("u", "SPEC.md", "spec\n");
    set_state(&env, "u", "implement");
    let r = same_via_shim(&env, &["--audit"]);
    assert!(
        r.stdout.contains("[FAIL] u: .state says \"implement\" but .state.approvals has no research:approved record (the gate was passed without --approve) — suggested correction: research:awaiting_approval"),
        "{r:?}"
    );
    // --approve is the way on: it records the approval in place, then the gate opens.
    env.status(&["--task", "t", "--approve", "--approver", "alice"])
        .ok();
    assert_eq!(env.state("t"), "research:approved");
    assert!(
        read(&env, "t", ".state.approvals").starts_with("research:approved|"),
        "recorded"
    );
    env.status(&["--task", "t", "--transition", "implement"])
        .ok();
}

/// Item 5: every agent that held a phase is refused as the approver of its gate.
#[test]
fn issue14_item5_every_holder_of_a_phase_is_refused_as_its_approver() {
    let env = Env::multi_agent();
    // research, held by writer-1, who then asks for its own approval.
    env.drive("t", &["research"]);
    env.status(&["--task", "t", "--claim", "--agent", "writer-1"])
        .ok();
    env.artifact("t", "SPEC.md", "spec\n");
    env.status(&[
        "--task",
        "t",
        "--transition",
        "research:awaiting_approval",
        "--agent",
        "writer-1",
    ])
    .ok();
    assert!(
        !env.task_dir("t").join(".state.lock").exists(),
        "the lease ended with its phase"
    );
    let r = env.refused(&["--task", "t", "--approve", "--approver", "writer-1"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: 'writer-1' held task 't' in its research phase and may not approve that phase's work. A person (an operator) or an agent that did not hold it must approve it."
    );
    assert_eq!(
        env.shim(&["--task", "t", "--approve", "--approver", "writer-1"]),
        r,
        "status.py"
    );
    env.status(&["--task", "t", "--approve", "--approver", "alice"])
        .ok();
    // code_review, held by a reviewer who wrote CODE_REVIEW.md and moved to awaiting.
    env.drive("t", &["implement"]);
    env.status(&["--task", "t", "--claim", "--agent", "impl-1"])
        .ok();
    env.artifact("t", "IMPLEMENTATION.md", "done\n");
    env.status(&[
        "--task",
        "t",
        "--transition",
        "code_review",
        "--agent",
        "impl-1",
    ])
    .ok();
    env.status(&["--task", "t", "--claim", "--agent", "reviewer-1"])
        .ok();
    env.artifact("t", "CODE_REVIEW.md", "review\n");
    env.status(&[
        "--task",
        "t",
        "--transition",
        "code_review:awaiting_approval",
        "--agent",
        "reviewer-1",
    ])
    .ok();
    assert_eq!(
        read(&env, "t", ".state.holders"),
        "research|writer-1\nimplement|impl-1\ncode_review|reviewer-1\n"
    );
    assert_eq!(read(&env, "t", ".state.implementer"), "impl-1\n");
    for who in ["reviewer-1", "impl-1"] {
        let r = env.refused(&["--task", "t", "--approve", "--approver", who]);
        r.code(1);
    }
    env.status(&["--task", "t", "--approve", "--approver", "writer-1"])
        .ok();
    assert_eq!(env.state("t"), "code_review:approved");
}

/// Item 6: a parent completes only after all its sub-tasks.
#[test]
fn issue14_item6_parent_cannot_complete_before_its_subtasks() {
    let env = Env::new();
    env.drive("parent", TO_DECOMPOSED);
    env.create("parent/sub-a");
    env.create("parent/sub-b");
    set_state(&env, "parent/sub-b", "complete");
    let r = env.refused(&["--task", "parent", "--transition", "complete"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'decomposition:approved' to 'complete'. Sub-tasks not in a terminal state: parent/sub-a (new). A parent is complete only when every sub-task is complete or human_intervention."
    );
    assert_eq!(
        env.shim(&["--task", "parent", "--transition", "complete"]),
        r
    );
    // A sub-task that cannot be read is not known to be finished either.
    set_state(&env, "parent/sub-a", "bogus");
    let r = env.refused(&["--task", "parent", "--transition", "complete"]);
    assert!(
        r.error_line().contains("parent/sub-a (unreadable .state)"),
        "{r:?}"
    );
    set_state(&env, "parent/sub-a", "human_intervention");
    env.status(&["--task", "parent", "--transition", "complete"])
        .ok();
    assert_eq!(env.state("parent"), "complete");
}

/// Item 7: a verdict that cannot be read leaves only the safe way out.
#[test]
fn issue14_item7_unreadable_verdict_allows_human_intervention_only() {
    let env = Env::new();
    for (task, body) in [("a", "Result: PASS\n"), ("b", "The verdict is PASS.\n")] {
        env.drive(task, TO_REFEREE);
        env.artifact(task, "VERDICT.md", body);
        let r = env.refused(&["--task", task, "--transition", "complete"]);
        r.code(1);
        assert!(
            r.error_line()
                .contains("add a line 'Verdict: PASS' to complete"),
            "{r:?}"
        );
        assert_eq!(env.shim(&["--task", task, "--transition", "complete"]), r);
        env.status(&["--task", task, "--transition", "human_intervention"])
            .ok();
        assert_eq!(env.state(task), "human_intervention");
    }
}

/// Item 8: `--approve` outside a gate says 004's sentence; a terminal phase says it is one.
#[test]
fn issue14_item8_approve_outside_a_gate_uses_the_spec_sentence() {
    let env = Env::new();
    env.drive("t", TO_IMPLEMENT);
    let r = env.refused(&["--task", "t", "--approve"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: This phase does not require approval. 'implement' has no approval gate: use --transition code_review to move on."
    );
    assert_eq!(same_via_shim(&env, &["--task", "t", "--approve"]), r);
    env.create("n");
    let r = env.refused(&["--task", "n", "--approve"]);
    assert!(
        r.error_line()
            .starts_with("ERROR: This phase does not require approval. "),
        "{r:?}"
    );
    set_state(&env, "n", "complete");
    let r = env.refused(&["--task", "n", "--approve"]);
    assert!(
        r.error_line().starts_with(
            "ERROR: This phase does not require approval. 'complete' is a terminal phase"
        ),
        "{r:?}"
    );
    assert!(!r.error_line().contains("--transition"), "{r:?}");
}

/// Item 9: a project folder that does not exist is an error for every command.
#[test]
fn issue14_item9_missing_project_folder_is_an_error_for_every_command() {
    let env = Env::new();
    let missing = env.home.path().join("no/such/project");
    let m = missing.to_str().expect("utf-8 path");
    let commands: &[&[&str]] = &[
        &["--audit"],
        &["--list"],
        &["--create-task", "x"],
        &["--task", "x"],
        &["--task", "x", "--transition", "research"],
        &["--task", "x", "--approve"],
        &["--validate-folder"],
        &["--validate-folder", "--task", "x"],
        &["--upgrade"],
        &["--can-edit", "--task", "x"],
        &["--can-create-task"],
        &["--scope-check", "--file", "a.rs"],
        &["--same-session", "--task", "x"],
        &["--task", "x", "--claim", "--agent", "a"],
    ];
    for args in commands {
        let run = |shim: bool| {
            let mut c = if shim {
                let mut c = Command::new("python3");
                c.arg(concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../../deploy/status.py"
                ))
                .env("AUTOMATON_BIN", BIN);
                c
            } else {
                let mut c = Command::new(BIN);
                c.arg("status");
                c
            };
            c.args(*args)
                .args(["--project", m])
                .env("HOME", env.home.path())
                .env_remove("AUTOMATON_COORDINATOR")
                .current_dir(env.root());
            Run::from(c.output().expect("run"))
        };
        let r = run(false);
        r.code(2);
        assert_eq!(
            r.error_line(),
            format!(
                "ERROR: Project folder not found: {m}. Check --project (it defaults to the current directory), or create the folder first."
            ),
            "{args:?}"
        );
        assert_eq!(run(true), r, "status.py for {args:?}");
        assert!(!missing.exists(), "{args:?} created the project folder");
        assert!(
            !Path::new(m).parent().is_some_and(Path::exists),
            "{args:?} created a parent folder"
        );
    }
}

/// Item 10: one corrupt `.state` does not blank `--list`.
#[test]
fn issue14_item10_list_shows_every_task_when_one_state_is_corrupt() {
    let env = Env::new();
    env.drive("alpha", &["research"]);
    env.create("broken");
    set_state(&env, "broken", "bogus");
    env.create("gamma");
    env.create("gamma/sub");
    let r = same_via_shim(&env, &["--list"]);
    r.code(2);
    let rows: Vec<&str> = r.stdout.lines().collect();
    assert!(rows[0].starts_with("Task "), "{r:?}");
    assert!(
        rows.iter()
            .any(|l| l.starts_with("alpha ") && l.contains("research")),
        "{r:?}"
    );
    assert!(
        rows.iter()
            .any(|l| l.starts_with("gamma ") && l.contains("new")),
        "{r:?}"
    );
    assert!(rows.iter().any(|l| l.starts_with("  gamma/sub ")), "{r:?}");
    let broken = rows
        .iter()
        .find(|l| l.starts_with("broken "))
        .expect("a row for the broken task");
    assert!(
        broken.contains("(unreadable)")
            && broken.contains("ERROR: Unknown phase 'bogus' in .state file"),
        "{broken}"
    );
    assert_eq!(
        r.error_line(),
        "ERROR: 1 task could not be read (broken). Fix the file each row names, then retry."
    );
    // JSON: every row, the broken one with its error.
    let r = env.status(&["--list", "--json"]);
    r.code(2);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("JSON");
    assert_eq!(v.as_array().map(Vec::len), Some(3), "{v}");
    assert!(
        v[1]["error"].as_str().is_some_and(|e| e.contains("bogus")),
        "{v}"
    );
}

/// Item 11: an invalid `.agent.md` value stops every command that needs the policy alike.
#[test]
fn issue14_item11_invalid_agent_md_fails_every_policy_command_alike() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    env.drive("t", &["research:awaiting_approval"]);
    env.drive("u", &["research"]);
    env.write(
        ".automaton/.agent.md",
        "Mode: multi-agent\nLock timeout: soon\n",
    );
    let want = format!(
        "ERROR: Cannot read {}: key 'Lock timeout' has the invalid value 'soon': write a number with a unit, e.g. 'Lock timeout: 30m' ('90s', '1h' and '30 minutes' work too).",
        env.root().join(".automaton/.agent.md").display()
    );
    for args in [
        &["--task", "t"][..],
        &["--task", "t", "--approve"],
        &["--task", "u", "--transition", "research:awaiting_approval"],
        &["--task", "u", "--claim", "--agent", "a"],
        &["--task", "u", "--release", "--agent", "a"],
    ] {
        let r = env.refused(args);
        r.code(2);
        assert_eq!(r.error_line(), want, "{args:?}");
        assert_eq!(r.stderr.lines().count(), 1, "one line: {r:?}");
        assert_eq!(env.shim(args), r, "status.py for {args:?}");
    }
    // The transition that used to go through is refused before it writes anything.
    env.artifact("u", "SPEC.md", "spec\n");
    let r = env.refused(&["--task", "u", "--transition", "research:awaiting_approval"]);
    r.code(2);
    assert_eq!(env.state("u"), "research");
}

/// Item A: `.agent.md` is read from `{project}/.automaton/`, over `~/.automaton/`, file by file.
#[test]
fn issue14_item_a_agent_md_read_from_the_project_automaton_folder() {
    let env = Env::new();
    env.create("t");
    let multi = |env: &Env| -> Run {
        let r = env.status(&["--task", "t"]);
        r.ok();
        r
    };
    let leased = |r: &Run| r.stdout.lines().any(|l| l.starts_with("Lease: none"));
    env.write(".automaton/.agent.md", "Mode: multi-agent\n");
    let r = multi(&env);
    assert!(leased(&r), "{r:?}");
    assert_eq!(r.stderr, "", "no warning for the right place");
    // Only a root-level .agent.md: honoured, with a warning naming the right place.
    fs::remove_file(env.root().join(".automaton/.agent.md")).expect("rm");
    env.write(".agent.md", "Mode: multi-agent\n");
    let r = multi(&env);
    assert!(leased(&r), "still honoured: {r:?}");
    assert_eq!(
        r.stderr,
        format!(
            "WARNING: {} is read, but the project's .agent.md belongs in {}: move it there.\n",
            env.root().join(".agent.md").display(),
            env.root().join(".automaton/.agent.md").display()
        )
    );
    assert_eq!(env.shim(&["--task", "t"]), r, "status.py");
    // Both: the one in .automaton/ wins, and the other is said to be ignored.
    env.write(".automaton/.agent.md", "Mode: single-agent\n");
    let r = multi(&env);
    assert!(!leased(&r), "{r:?}");
    assert!(r.stderr.contains("is ignored"), "{r:?}");
    // File-level precedence: the project's file is the whole answer, the user's unread.
    fs::remove_file(env.root().join(".agent.md")).expect("rm");
    env.write(".automaton/.agent.md", "Lock timeout: 10m\n");
    fs::create_dir_all(env.home.path().join(".automaton")).expect("mkdir");
    fs::write(
        env.home.path().join(".automaton/.agent.md"),
        "Mode: multi-agent\n",
    )
    .expect("write");
    assert!(!leased(&multi(&env)), "the user's file is not merged in");
    fs::remove_file(env.root().join(".automaton/.agent.md")).expect("rm");
    assert!(
        leased(&multi(&env)),
        "the user's file when the project has none"
    );
}
