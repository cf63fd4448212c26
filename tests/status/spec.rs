//! One test per acceptance criterion of the status-script spec (seed 004, main list and the
//! §14 hook list: `ac_…`) and per decision of issue 2's "What the seeds leave open — decided
//! here" and "Bad input" sections (`issue_…`). Claims, leases, `.state.implementer`,
//! reviewer ≠ implementer, fencing, races, crash atomicity and the `status.py` shim are
//! covered in `leases.rs`.

use std::fs;
use std::path::Path;
use std::process::Command;

use crate::harness::*;

/// sha256 of the bytes `spec v1\n`, `spec v2\n` and `content\n` (what `drive` writes).
const SHA_V1: &str = "f89f546b78a376fbc01ba0d2d9d22533a181ef63b48d72066a46cd376d8d129e";
const SHA_V2: &str = "c58cff8bf957f306090ca83b32b274b7dddcbcafc64eb6ee42c8fc193b12ec53";
const SHA_CONTENT: &str = "434728a410a78f56fc1b5899c3593436e61ab0c731e9072d95e96db290205e53";
/// sha256 of `spec\n`.
const SHA_SPEC: &str = "3b92cc255009c1a8541990fd00bcde181bc803a80b234f086647210c078bb7e4";

/// Every state, in lifecycle order.
const ALL_STATES: &[&str] = &[
    "new",
    "research",
    "research:awaiting_approval",
    "research:approved",
    "decomposition",
    "decomposition:awaiting_approval",
    "decomposition:approved",
    "design",
    "design:awaiting_approval",
    "design:approved",
    "test_design",
    "test_design:awaiting_approval",
    "test_design:approved",
    "implement",
    "code_review",
    "code_review:awaiting_approval",
    "code_review:approved",
    "bug_find",
    "adversarial_bug_find",
    "doc_review",
    "referee",
    "complete",
    "human_intervention",
];

/// 004 §5 with seed 001's code_review inserted and the issue's rule for a decomposed parent,
/// in the order the error message lists them.
const LEGAL: &[(&str, &[&str])] = &[
    ("new", &["research"]),
    ("research", &["research:awaiting_approval"]),
    (
        "research:approved",
        &["decomposition", "design", "implement"],
    ),
    ("decomposition", &["decomposition:awaiting_approval"]),
    (
        "decomposition:approved",
        &["complete", "human_intervention"],
    ),
    ("design", &["design:awaiting_approval"]),
    ("design:approved", &["test_design", "implement"]),
    ("test_design", &["test_design:awaiting_approval"]),
    ("test_design:approved", &["implement"]),
    ("implement", &["code_review"]),
    ("code_review", &["code_review:awaiting_approval"]),
    ("code_review:approved", &["bug_find"]),
    ("bug_find", &["adversarial_bug_find"]),
    ("adversarial_bug_find", &["doc_review"]),
    ("doc_review", &["referee"]),
    ("referee", &["complete", "human_intervention"]),
    ("complete", &[]),
    ("human_intervention", &[]),
];

const ARTIFACTS: &[&str] = &[
    "SPEC.md",
    "DECOMPOSITION.md",
    "DESIGN.md",
    "TEST_PLAN.md",
    "IMPLEMENTATION.md",
    "CODE_REVIEW.md",
    "BUG_REPORT.md",
    "ADVERSARIAL_BUG_REPORT.md",
    "DOC_REVIEW.md",
    "VERDICT.md",
];

/// 004 §10's table, extended with CODE_REVIEW.md (seed 001).
const FORBIDDEN: &[(&str, &[&str])] = &[
    (
        "new",
        &[
            "SPEC.md",
            "DESIGN.md",
            "DECOMPOSITION.md",
            "TEST_PLAN.md",
            "IMPLEMENTATION.md",
            "CODE_REVIEW.md",
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "research",
        &[
            "DESIGN.md",
            "DECOMPOSITION.md",
            "TEST_PLAN.md",
            "IMPLEMENTATION.md",
            "CODE_REVIEW.md",
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "decomposition",
        &[
            "DESIGN.md",
            "TEST_PLAN.md",
            "IMPLEMENTATION.md",
            "CODE_REVIEW.md",
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "design",
        &[
            "DECOMPOSITION.md",
            "TEST_PLAN.md",
            "IMPLEMENTATION.md",
            "CODE_REVIEW.md",
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "test_design",
        &[
            "DECOMPOSITION.md",
            "IMPLEMENTATION.md",
            "CODE_REVIEW.md",
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "implement",
        &[
            "CODE_REVIEW.md",
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "code_review",
        &[
            "BUG_REPORT.md",
            "ADVERSARIAL_BUG_REPORT.md",
            "DOC_REVIEW.md",
            "VERDICT.md",
        ],
    ),
    (
        "bug_find",
        &["ADVERSARIAL_BUG_REPORT.md", "DOC_REVIEW.md", "VERDICT.md"],
    ),
    ("adversarial_bug_find", &["DOC_REVIEW.md", "VERDICT.md"]),
    ("doc_review", &["VERDICT.md"]),
    ("referee", &[]),
    ("complete", &[]),
    ("human_intervention", &[]),
];

// ----- helpers ---------------------------------------------------------------------------

#[track_caller]
fn assert_line(out: &str, line: &str) {
    assert!(
        out.lines().any(|l| l == line),
        "missing line {line:?} in:\n{out}"
    );
}

#[track_caller]
fn assert_no_line_starting(out: &str, prefix: &str) {
    assert!(
        !out.lines().any(|l| l.starts_with(prefix)),
        "unexpected line starting {prefix:?} in:\n{out}"
    );
}

#[track_caller]
fn line_starting<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{out}"))
}

/// The `  - item` lines right below `header`.
fn block(out: &str, header: &str) -> Vec<String> {
    out.lines()
        .skip_while(|l| *l != header)
        .skip(1)
        .take_while(|l| l.starts_with("  - "))
        .map(|l| l.trim_start_matches("  - ").to_string())
        .collect()
}

/// Writes `.state` directly (a fixture, not a transition).
fn set_state(env: &Env, task: &str, state: &str) {
    fs::write(env.task_dir(task).join(".state"), format!("{state}\n")).expect("write .state");
}

/// Writes `.state` directly and, for an `:approved` state, the approval record `--approve`
/// would have left (a three-field line: bound to no content, so it never goes stale).
fn set_state_approved(env: &Env, task: &str, state: &str) {
    set_state(env, task, state);
    if let Some(phase) = state.strip_suffix(":approved") {
        let path = env.task_dir(task).join(".state.approvals");
        let mut log = fs::read_to_string(&path).unwrap_or_default();
        log.push_str(&format!("{phase}:approved|2026-06-14T14:30:00Z|user\n"));
        fs::write(path, log).expect("write .state.approvals");
    }
}

fn raw(env: &Env, task: &str, file: &str) -> String {
    fs::read_to_string(env.task_dir(task).join(file)).expect("read task file")
}

fn approvals(env: &Env, task: &str) -> Vec<String> {
    raw(env, task, ".state.approvals")
        .lines()
        .map(str::to_string)
        .collect()
}

fn is_iso(ts: &str) -> bool {
    let b = ts.as_bytes();
    b.len() == 20
        && b.iter().enumerate().all(|(i, c)| match i {
            4 | 7 => *c == b'-',
            10 => *c == b'T',
            13 | 16 => *c == b':',
            19 => *c == b'Z',
            _ => c.is_ascii_digit(),
        })
}

/// Checks one approvals line field by field and returns its timestamp.
#[track_caller]
fn check_approval_line(line: &str, phase: &str, approver: &str, sha: &str) -> String {
    let f: Vec<&str> = line.split('|').collect();
    assert_eq!(f.len(), 4, "{line}");
    assert_eq!(f[0], format!("{phase}:approved"), "{line}");
    assert!(is_iso(f[1]), "not ISO-8601: {line}");
    assert_eq!(f[2], approver, "{line}");
    assert_eq!(f[3], sha, "{line}");
    f[1].to_string()
}

/// Runs the binary in `cwd` without `--project`.
fn bare(env: &Env, cwd: &Path, args: &[&str]) -> Run {
    let o = Command::new(BIN)
        .arg("status")
        .args(args)
        .env("HOME", env.home.path())
        .current_dir(cwd)
        .output()
        .expect("run automaton");
    Run {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

fn git(env: &Env, args: &[&str]) {
    let o = Command::new("git")
        .args([
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.com",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "commit.gpgsign=false",
        ])
        .args(args)
        .current_dir(env.root())
        .env("HOME", env.home.path())
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .expect("run git");
    assert!(
        o.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn legal_of(state: &str) -> &'static [&'static str] {
    LEGAL
        .iter()
        .find(|(s, _)| *s == state)
        .map_or(&[], |(_, l)| l)
}

fn artifact_for(state: &str) -> Option<&'static str> {
    artifact_of(state.split(':').next().unwrap_or(""))
}

// ----- 004 acceptance criteria -----------------------------------------------------------

#[test]
fn ac_task_shows_phase_allowed_forbidden_next_artifact_next_phase() {
    let env = Env::new();
    let t = "add-user-auth";
    env.drive(t, &["research"]);
    let r = env.status(&["--task", t]);
    r.ok();
    let out = &r.stdout;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "Task: add-user-auth");
    assert_eq!(lines[1], "Phase: research (from .state)");
    assert_eq!(
        lines[2],
        format!("State file: {}", env.task_dir(t).join(".state").display())
    );
    let order = [
        "Task: ",
        "Phase: ",
        "State file: ",
        "Allowed actions:",
        "Forbidden actions:",
        "Next artifact needed: ",
        "Next phase: ",
        "Command to proceed: ",
    ];
    let pos: Vec<usize> = order
        .iter()
        .map(|p| {
            lines
                .iter()
                .position(|l| l.starts_with(p))
                .unwrap_or_else(|| panic!("{p} in\n{out}"))
        })
        .collect();
    assert!(
        pos.windows(2).all(|w| w[0] < w[1]),
        "sections out of order: {pos:?}\n{out}"
    );
    let allowed = block(out, "Allowed actions:");
    for a in [
        "Read project files",
        "Ask clarifying questions",
        "Write SPEC.md",
    ] {
        assert!(
            allowed.contains(&a.to_string()),
            "allowed lacks {a}: {allowed:?}"
        );
    }
    let forbidden = block(out, "Forbidden actions:");
    for f in [
        "Edit code",
        "Create IMPLEMENTATION.md",
        "Create DESIGN.md",
        "Skip to implementation",
    ] {
        assert!(
            forbidden.contains(&f.to_string()),
            "forbidden lacks {f}: {forbidden:?}"
        );
    }
    assert!(
        !forbidden.iter().any(|f| f.contains("SPEC.md")),
        "{forbidden:?}"
    );
    assert_line(out, "Next artifact needed: SPEC.md");
    assert_line(out, "Next phase: research:awaiting_approval");
    assert_line(
        out,
        "Command to proceed: automaton status --task add-user-auth --transition research:awaiting_approval",
    );

    // Approval sub-states are shown as the phase.
    env.drive(t, &["research:awaiting_approval"]);
    let out = env.status(&["--task", t]).ok().stdout.clone();
    assert_line(&out, "Phase: research:awaiting_approval (from .state)");
    assert_line(&out, "Next phase: research:approved");
    assert_line(
        &out,
        "Command to proceed: a person runs: automaton status --task add-user-auth --approve",
    );
    assert!(
        block(&out, "Forbidden actions:").contains(&"Approve your own work".to_string()),
        "{out}"
    );

    env.drive(t, &["research:approved"]);
    let out = env.status(&["--task", t]).ok().stdout.clone();
    assert_line(&out, "Phase: research:approved (from .state)");
    assert_line(&out, "Next phase: decomposition or design or implement");

    env.drive(t, &["implement"]);
    let out = env.status(&["--task", t]).ok().stdout.clone();
    assert_line(&out, "Phase: implement (from .state)");
    assert!(
        block(&out, "Allowed actions:").contains(&"Edit code".to_string()),
        "{out}"
    );
    assert!(
        block(&out, "Forbidden actions:").contains(&"Create BUG_REPORT.md".to_string()),
        "{out}"
    );
    assert_line(&out, "Next artifact needed: IMPLEMENTATION.md");
    assert_line(&out, "Next phase: code_review");
    assert_line(
        &out,
        "Command to proceed: automaton status --task add-user-auth --transition code_review",
    );
}

#[test]
fn ac_task_shows_approval_status_for_awaiting_and_approved() {
    let env = Env::new();
    env.drive("t", &["research", "research:awaiting_approval"]);
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert_line(
        &out,
        "Approval: awaiting approval of SPEC.md: a person runs --approve",
    );

    env.drive("t", &["research:approved"]);
    let ts = check_approval_line(&approvals(&env, "t")[0], "research", "user", SHA_CONTENT);
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert_line(
        &out,
        &format!(
            "Approval: approved by user at {ts} (SPEC.md sha256 {})",
            &SHA_CONTENT[..12]
        ),
    );

    // Phases without a gate show no approval status.
    env.drive("t", &["implement"]);
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert_no_line_starting(&out, "Approval:");
}

#[test]
fn ac_transition_validates_and_writes_state_including_approval_substates() {
    let env = Env::new();
    env.create("t");
    assert_eq!(raw(&env, "t", ".state"), "new\n");
    let steps: &[(&str, Option<&str>)] = &[
        ("research", None),
        ("research:awaiting_approval", Some("SPEC.md")),
        ("research:approved", None),
        ("design", None),
        ("design:awaiting_approval", Some("DESIGN.md")),
        ("design:approved", None),
        ("test_design", None),
        ("test_design:awaiting_approval", Some("TEST_PLAN.md")),
        ("test_design:approved", None),
        ("implement", None),
    ];
    let mut from = "new".to_string();
    for (to, write) in steps {
        if let Some(a) = write {
            env.artifact("t", a, "draft\n");
        }
        if to.ends_with(":approved") {
            env.status(&["--task", "t", "--approve"]).ok();
        } else {
            let r = env.status(&["--task", "t", "--transition", to]);
            r.ok();
            assert_eq!(
                r.stdout,
                format!("Transitioned task 't' from '{from}' to '{to}'.\n")
            );
        }
        assert_eq!(raw(&env, "t", ".state"), format!("{to}\n"), "after {to}");
        from = to.to_string();
    }
}

#[test]
fn ac_transition_full_lifecycle_new_to_complete_through_code_review() {
    let env = Env::new();
    env.drive("t", &TO_REFEREE[..4]);
    assert_eq!(env.state("t"), "implement");
    env.artifact("t", "IMPLEMENTATION.md", "done\n");
    // code_review is mandatory between implement and bug_find (seed 001).
    let r = env.refused(&["--task", "t", "--transition", "bug_find"]);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'implement' to 'bug_find'. Legal transitions from 'implement' are: code_review"
    );
    env.drive("t", &TO_REFEREE[4..]);
    assert_eq!(env.state("t"), "referee");
    env.drive("t", &["complete"]);
    assert_eq!(raw(&env, "t", ".state"), "complete\n");
    let log = approvals(&env, "t");
    assert_eq!(log.len(), 2, "{log:?}");
    check_approval_line(&log[0], "research", "user", SHA_CONTENT);
    check_approval_line(&log[1], "code_review", "user", SHA_CONTENT);
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert_line(&out, "Phase: complete (from .state)");
    assert_line(&out, "Next phase: —");
    assert_line(&out, "Command to proceed: none: the task is complete");
    for target in ["human_intervention", "referee", "research"] {
        let r = env.refused(&["--task", "t", "--transition", target]);
        assert_eq!(
            r.error_line(),
            format!(
                "ERROR: Cannot transition from 'complete' to '{target}'. Legal transitions from 'complete' are: (none: this is a terminal phase)"
            )
        );
    }
}

#[test]
fn ac_transition_refuses_from_awaiting_approval_to_anything_but_approved() {
    let env = Env::new();
    env.create("t");
    for gated in [
        "research",
        "decomposition",
        "design",
        "test_design",
        "code_review",
    ] {
        let awaiting = format!("{gated}:awaiting_approval");
        set_state(&env, "t", &awaiting);
        for a in ARTIFACTS {
            let _ = fs::remove_file(env.task_dir("t").join(a));
        }
        env.artifact(
            "t",
            artifact_of(gated).expect("gated phases have artifacts"),
            "draft\n",
        );
        for target in ALL_STATES {
            let r = env.refused(&["--task", "t", "--transition", target]);
            r.code(1);
            assert!(
                r.error_line().starts_with(&format!(
                    "ERROR: Cannot transition from '{awaiting}' to '{target}'."
                )),
                "{r:?}"
            );
            assert!(r.error_line().contains("only --approve"), "{r:?}");
        }
        assert_eq!(env.state("t"), awaiting);
    }
}

#[test]
fn ac_transition_refuses_past_awaiting_approval_without_approval() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    // Neither the approved sub-state nor a later phase can be reached by --transition.
    for target in ["research:approved", "design", "implement", "decomposition"] {
        let r = env.refused(&["--task", "t", "--transition", target]);
        r.code(1);
        assert_eq!(
            r.error_line(),
            format!(
                "ERROR: Cannot transition from 'research' to '{target}'. Legal transitions from 'research' are: research:awaiting_approval"
            )
        );
    }
    env.drive("t", &["research:awaiting_approval"]);
    for target in ["research:approved", "design", "implement", "decomposition"] {
        env.refused(&["--task", "t", "--transition", target])
            .code(1);
    }
    assert_eq!(
        raw(&env, "t", ".state.approvals"),
        "",
        "nothing approved yet"
    );
    env.status(&["--task", "t", "--approve"]).ok();
    env.status(&["--task", "t", "--transition", "implement"])
        .ok();
    assert_eq!(env.state("t"), "implement");
}

#[test]
fn ac_approve_transitions_awaiting_to_approved() {
    let env = Env::new();
    for gated in [
        "research",
        "decomposition",
        "design",
        "test_design",
        "code_review",
    ] {
        let task = gated.replace('_', "-");
        env.create(&task);
        set_state(&env, &task, &format!("{gated}:awaiting_approval"));
        env.artifact(&task, artifact_of(gated).expect("artifact"), "content\n");
        let r = env.status(&["--task", &task, "--approve"]);
        r.ok();
        assert!(
            r.stdout.starts_with(&format!(
                "Approved task '{task}': '{gated}:awaiting_approval' → '{gated}:approved' by user at "
            )),
            "{r:?}"
        );
        assert_eq!(raw(&env, &task, ".state"), format!("{gated}:approved\n"));
        let log = approvals(&env, &task);
        assert_eq!(log.len(), 1, "{log:?}");
        check_approval_line(&log[0], gated, "user", SHA_CONTENT);
    }
}

#[test]
fn ac_approve_refuses_if_current_phase_not_awaiting_approval() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    let r = env.refused(&["--task", "t", "--approve"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: Current phase is 'research' (not awaiting approval). Current sub-state must be 'research:awaiting_approval' before approval can be granted."
    );
    env.drive(
        "t",
        &["research:awaiting_approval", "research:approved", "design"],
    );
    env.artifact("t", "DESIGN.md", "design\n");
    let r = env.refused(&["--task", "t", "--approve"]);
    assert_eq!(
        r.error_line(),
        "ERROR: Current phase is 'design' (not awaiting approval). Current sub-state must be 'design:awaiting_approval' before approval can be granted."
    );
    // Already approved (and unchanged): nothing to approve.
    set_state(&env, "t", "research:approved");
    fs::remove_file(env.task_dir("t").join("DESIGN.md")).expect("rm");
    let r = env.refused(&["--task", "t", "--approve"]);
    r.code(1);
    assert!(
        r.error_line()
            .starts_with("ERROR: Current phase is 'research:approved' (not awaiting approval)."),
        "{r:?}"
    );
    assert_eq!(approvals(&env, "t").len(), 1);
}

#[test]
fn ac_approve_records_approval_in_state_approvals_log() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec v1\n");
    env.drive("t", &["research:awaiting_approval"]);
    let r = env.status(&["--task", "t", "--approve"]);
    r.ok();
    let log = approvals(&env, "t");
    assert_eq!(log.len(), 1);
    let ts = check_approval_line(&log[0], "research", "user", SHA_V1);
    assert_eq!(
        r.stdout,
        format!(
            "Approved task 't': 'research:awaiting_approval' → 'research:approved' by user at {ts} (SPEC.md sha256 {}).\n",
            &SHA_V1[..12]
        )
    );
    assert!(raw(&env, "t", ".state.approvals").ends_with('\n'));

    env.drive("u", &["research"]);
    env.artifact("u", "SPEC.md", "spec v2\n");
    env.drive("u", &["research:awaiting_approval"]);
    let r = env.status(&["--task", "u", "--approve", "--approver", "alice"]);
    r.ok();
    assert!(r.stdout.contains(" by alice at "), "{r:?}");
    check_approval_line(&approvals(&env, "u")[0], "research", "alice", SHA_V2);
}

#[test]
fn ac_approve_refuses_for_phases_that_do_not_require_approval() {
    let env = Env::new();
    env.create("t");
    for state in [
        "new",
        "implement",
        "bug_find",
        "adversarial_bug_find",
        "doc_review",
        "referee",
        "complete",
        "human_intervention",
    ] {
        set_state(&env, "t", state);
        let r = env.refused(&["--task", "t", "--approve"]);
        r.code(1);
        assert!(
            r.error_line()
                .starts_with("ERROR: This phase does not require approval"),
            "{state}: {r:?}"
        );
    }
    assert_eq!(raw(&env, "t", ".state.approvals"), "");
}

#[test]
fn ac_create_task_creates_folder_with_state_new_and_empty_approvals() {
    let env = Env::new();
    let r = env.status(&["--create-task", "add-user-auth"]);
    r.ok();
    assert_eq!(
        r.stdout,
        "Created task 'add-user-auth' in state 'new'. Use --transition research to begin.\n"
    );
    let dir = env.root().join(".automaton/tasks/add-user-auth");
    assert!(dir.is_dir());
    assert_eq!(fs::read(dir.join(".state")).expect("state"), b"new\n");
    assert_eq!(fs::read(dir.join(".state.approvals")).expect("log"), b"");
    let mut names: Vec<String> = fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, [".state", ".state.approvals"]);
}

#[test]
fn ac_create_task_validates_kebab_case() {
    let env = Env::new();
    env.create("existing");
    for bad in [
        "Add-User",
        "add_user",
        "add user",
        "add--user",
        "-add",
        "add-",
        "ADD",
        "add.user",
        "../x",
    ] {
        // `=` keeps a name that starts with '-' from being read as a flag.
        let r = env.refused(&[&format!("--create-task={bad}")]);
        r.code(2);
        assert!(
            r.error_line()
                .starts_with(&format!("ERROR: Invalid task name '{bad}': use kebab-case")),
            "{bad}: {r:?}"
        );
    }
    for good in ["add-user-auth", "v2", "a1-b2-c3"] {
        env.create(good);
        assert_eq!(env.state(good), "new");
    }
}

#[test]
fn ac_create_task_refuses_if_task_already_exists() {
    let env = Env::new();
    env.drive("add-user-auth", &["research"]);
    env.artifact("add-user-auth", "SPEC.md", "spec\n");
    let r = env.refused(&["--create-task", "add-user-auth"]);
    r.code(1);
    assert!(
        r.error_line().starts_with(&format!(
            "ERROR: Task 'add-user-auth' already exists in {}/",
            env.root().join(".automaton/tasks").display()
        )),
        "{r:?}"
    );
    assert_eq!(env.state("add-user-auth"), "research");
}

#[test]
fn ac_transition_refuses_if_forbidden_artifacts_exist() {
    let env = Env::new();
    env.drive("t", &["research"]);
    for (a, body) in [
        ("SPEC.md", "spec\n"),
        ("IMPLEMENTATION.md", "x\n"),
        ("BUG_REPORT.md", "x\n"),
    ] {
        env.artifact("t", a, body);
    }
    let r = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    r.code(1);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert_eq!(
        lines,
        [
            "ERROR: Cannot transition from 'research' to 'research:awaiting_approval'. Found forbidden artifact 'IMPLEMENTATION.md' in task folder. This indicates phase-skipping. Remove the artifact or revert to the correct phase.",
            "  - IMPLEMENTATION.md (belongs to implement phase)",
            "  - BUG_REPORT.md (belongs to bug_find phase)",
            "Remove out-of-order artifacts before transitioning.",
        ]
    );
    // 004 §13's example: implement with a BUG_REPORT.md; and seed 001's CODE_REVIEW.md.
    env.drive("u", TO_IMPLEMENT);
    env.artifact("u", "IMPLEMENTATION.md", "impl\n");
    env.artifact("u", "CODE_REVIEW.md", "early\n");
    let r = env.refused(&["--task", "u", "--transition", "code_review"]);
    assert!(
        r.error_line()
            .contains("Found forbidden artifact 'CODE_REVIEW.md'"),
        "{r:?}"
    );
    assert_line(
        &r.stderr,
        "  - CODE_REVIEW.md (belongs to code_review phase)",
    );
    fs::remove_file(env.task_dir("u").join("CODE_REVIEW.md")).expect("rm");
    env.status(&["--task", "u", "--transition", "code_review"])
        .ok();
}

#[test]
fn ac_transition_refuses_if_required_artifact_missing_or_empty() {
    let env = Env::new();
    let cases = [
        ("research", "research:awaiting_approval"),
        ("decomposition", "decomposition:awaiting_approval"),
        ("design", "design:awaiting_approval"),
        ("test_design", "test_design:awaiting_approval"),
        ("implement", "code_review"),
        ("code_review", "code_review:awaiting_approval"),
        ("bug_find", "adversarial_bug_find"),
        ("adversarial_bug_find", "doc_review"),
        ("doc_review", "referee"),
        ("referee", "complete"),
        ("research:approved", "implement"),
    ];
    for (from, to) in cases {
        let task = from.replace([':', '_'], "-");
        env.create(&task);
        set_state_approved(&env, &task, from);
        let artifact = artifact_for(from).expect("artifact");
        let want = format!(
            "ERROR: Cannot transition from '{from}' to '{to}'. Required artifact '{artifact}' is missing or empty in task folder."
        );
        let r = env.refused(&["--task", &task, "--transition", to]);
        r.code(1);
        assert_eq!(r.error_line(), want, "missing");
        env.artifact(&task, artifact, "");
        assert_eq!(
            env.refused(&["--task", &task, "--transition", to])
                .error_line(),
            want,
            "empty"
        );
        env.artifact(
            &task,
            artifact,
            if artifact == "VERDICT.md" {
                "Verdict: PASS\n"
            } else {
                "x\n"
            },
        );
        env.status(&["--task", &task, "--transition", to]).ok();
        assert_eq!(env.state(&task), to);
    }
}

#[test]
fn ac_list_shows_all_tasks_with_phase_and_approval_status() {
    let env = Env::new();
    env.drive("alpha", &["research", "research:awaiting_approval"]);
    env.create("alpha/sub-a");
    env.drive(
        "beta",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.drive(
        "gamma",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.artifact("gamma", "SPEC.md", "changed after approval\n");
    env.write(".automaton/tasks/delta/SPEC.md", "old task\n");
    env.create("eps");
    set_state(&env, "eps", "complete");
    env.create("zeta");

    let out = env.status(&["--list"]).ok().stdout.clone();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        ["Task", "Phase", "Next", "Step"],
        "{out}"
    );
    assert!(lines[0].starts_with("Task "), "{out}");
    let phase_col = lines[0].find("Phase").expect("Phase column");
    let next_col = lines[0].find("Next Step").expect("Next Step column");
    let row = |name: &str| -> &str {
        lines
            .iter()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name} in\n{out}"))
    };
    let cells = |name: &str| -> (String, String) {
        let r = row(name);
        (
            r[phase_col..next_col].trim().to_string(),
            r[next_col..].trim().to_string(),
        )
    };
    let (phase, next) = cells("alpha");
    assert_eq!(phase, "research:awaiting_approval");
    assert!(next.starts_with("research:approved"), "{out}");
    assert_eq!(
        cells("beta"),
        (
            "research:approved".into(),
            "decomposition or design or implement".into()
        )
    );
    assert_eq!(
        cells("gamma"),
        (
            "research:approved (stale approval)".into(),
            "decomposition or design or implement".into()
        )
    );
    assert_eq!(cells("delta").0, "research:awaiting_approval (untracked)");
    assert_eq!(cells("eps"), ("complete".into(), "—".into()));
    assert_eq!(cells("zeta"), ("new".into(), "research".into()));

    // The sub-task is indented directly under its parent.
    let parent_at = lines
        .iter()
        .position(|l| l.starts_with("alpha "))
        .expect("alpha row");
    let sub = lines[parent_at + 1];
    assert!(
        sub.starts_with("  ") && sub.trim_start().starts_with("alpha/sub-a"),
        "{out}"
    );
    assert_eq!(sub[phase_col..next_col].trim(), "new");
    let order: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split_whitespace().next().unwrap_or(""))
        .collect();
    assert_eq!(
        order,
        [
            "alpha",
            "alpha/sub-a",
            "beta",
            "delta",
            "eps",
            "gamma",
            "zeta"
        ]
    );
}

#[test]
fn ac_validate_folder_checks_out_of_order_artifacts() {
    let env = Env::new();
    env.drive("add-user-auth", &["research"]);
    env.artifact("add-user-auth", "SPEC.md", "spec\n");
    let r = env.status(&["--validate-folder", "--task", "add-user-auth"]);
    r.code(0);
    assert_eq!(
        r.stdout,
        "Task: add-user-auth\nPhase: research (from .state)\nFolder validation: PASS — no out-of-order artifacts found\n"
    );
    env.artifact("add-user-auth", "IMPLEMENTATION.md", "x\n");
    env.artifact("add-user-auth", "BUG_REPORT.md", "x\n");
    let before = env.snapshot();
    let r = env.status(&["--validate-folder", "--task", "add-user-auth"]);
    r.code(1);
    assert_eq!(
        r.stdout,
        "Task: add-user-auth\n\
         Phase: research (from .state)\n\
         Folder validation: FAIL — found out-of-order artifacts:\n\
         \x20 - IMPLEMENTATION.md (belongs to implement phase, not yet reached)\n\
         \x20 - BUG_REPORT.md (belongs to bug_find phase, not yet reached)\n\
         These artifacts indicate phase-skipping. The task is in research phase but has artifacts from future phases.\n\
         Remove the out-of-order artifacts or revert to the correct phase.\n"
    );
    assert!(
        before == env.snapshot(),
        "--validate-folder must not change files"
    );
}

#[test]
fn ac_validate_folder_flags_folder_without_state_as_manually_created() {
    let env = Env::new();
    env.write(".automaton/tasks/fix-broken-thing/SPEC.md", "spec\n");
    let before = env.snapshot();
    let r = env.status(&["--validate-folder", "--task", "fix-broken-thing"]);
    r.code(1);
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines[0], "Task: fix-broken-thing");
    assert_eq!(lines[1], "Phase: unknown (no .state file found)");
    assert!(
        lines[2].starts_with(
            "Folder validation: FAIL — task was created manually (no .state file). Use '"
        ) && lines[2].contains("--create-task"),
        "{r:?}"
    );
    assert!(
        before == env.snapshot(),
        "no .state may be written by --validate-folder"
    );
}

#[test]
fn ac_validate_folder_uses_phase_to_forbidden_artifacts_mapping() {
    let env = Env::new();
    env.create("t");
    for a in ARTIFACTS {
        env.artifact("t", a, "x\n");
    }
    for (phase, forbidden) in FORBIDDEN {
        // The sub-state does not change the table.
        let mut states = vec![phase.to_string()];
        if [
            "research",
            "decomposition",
            "design",
            "test_design",
            "code_review",
        ]
        .contains(phase)
        {
            states.push(format!("{phase}:awaiting_approval"));
            states.push(format!("{phase}:approved"));
        }
        for state in states {
            set_state(&env, "t", &state);
            let r = env.status(&["--validate-folder", "--task", "t"]);
            let mut got: Vec<String> = r
                .stdout
                .lines()
                .filter_map(|l| l.strip_prefix("  - "))
                .map(|l| l.split(' ').next().unwrap_or("").to_string())
                .collect();
            got.sort();
            let mut want: Vec<String> = forbidden.iter().map(|s| s.to_string()).collect();
            want.sort();
            assert_eq!(got, want, "{state}: {r:?}");
            if forbidden.is_empty() {
                r.code(0);
                assert_line(
                    &r.stdout,
                    "Folder validation: PASS — no out-of-order artifacts found",
                );
            } else {
                r.code(1);
                assert_line(
                    &r.stdout,
                    "Folder validation: FAIL — found out-of-order artifacts:",
                );
                for a in *forbidden {
                    let owner = ARTIFACTS
                        .iter()
                        .position(|x| x == a)
                        .map(|i| {
                            [
                                "research",
                                "decomposition",
                                "design",
                                "test_design",
                                "implement",
                                "code_review",
                                "bug_find",
                                "adversarial_bug_find",
                                "doc_review",
                                "referee",
                            ][i]
                        })
                        .expect("known artifact");
                    assert_line(
                        &r.stdout,
                        &format!("  - {a} (belongs to {owner} phase, not yet reached)"),
                    );
                }
            }
        }
    }
}

#[test]
fn ac_validate_folder_excludes_non_artifact_files() {
    let env = Env::new();
    env.create("t");
    // `new` forbids every artifact, so anything counted as one would fail.
    for meta in ["VRAM_CONFIG.md", "PARENT_SPEC.md", "REVIEW.md", "NOTES.md"] {
        env.artifact("t", meta, "metadata\n");
    }
    fs::create_dir_all(env.task_dir("t").join("subtasks")).expect("mkdir");
    let r = env.status(&["--validate-folder", "--task", "t"]);
    r.code(0);
    assert_eq!(
        r.stdout,
        "Task: t\nPhase: new (from .state)\nFolder validation: PASS — no out-of-order artifacts found\n"
    );
    let audit = env.status(&["--audit"]);
    assert_line(&audit.stdout, "[PASS] t: no violations");
    audit.code(0);
}

#[test]
fn ac_audit_runs_all_categories_across_all_tasks() {
    let env = Env::new();
    env.drive("add-user-auth", &["research"]);
    env.artifact("add-user-auth", "SPEC.md", "spec\n");
    env.drive("fix-login-bug", &["research"]);
    env.artifact("fix-login-bug", "SPEC.md", "spec\n");
    env.artifact("fix-login-bug", "IMPLEMENTATION.md", "impl\n");
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    let r = env.status(&["--audit"]);
    r.code(1);
    let out = &r.stdout;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        format!("Audit Report for {}", env.root().display())
    );
    let headers = [
        "=== Category 1: Out-of-order Artifacts ===",
        "=== Category 2: State-Artifact Inconsistency ===",
        "=== Category 3: Unauthorized Modifications ===",
        "=== Category 4: Manually Created Task Folders ===",
        "=== Summary ===",
    ];
    let pos: Vec<usize> = headers
        .iter()
        .map(|h| {
            lines
                .iter()
                .position(|l| l == h)
                .unwrap_or_else(|| panic!("{h} in\n{out}"))
        })
        .collect();
    assert!(pos.windows(2).all(|w| w[0] < w[1]), "{out}");
    assert_line(out, "[PASS] add-user-auth: no violations");
    assert_line(
        out,
        "[FAIL] fix-login-bug (phase: research): found IMPLEMENTATION.md (implement phase artifact)",
    );
    assert_line(
        out,
        "[PASS] add-user-auth: .state (\"research\") matches artifacts (SPEC.md exists)",
    );
    assert_line(
        out,
        "[FAIL] fix-login-bug: .state says \"research\" but IMPLEMENTATION.md exists — suggested correction: implement",
    );
    assert_line(out, "Skipped: not a git repository");
    assert!(
        line_starting(out, "[FAIL] manual: no .state file").contains("created manually"),
        "{out}"
    );
    assert_line(out, "3 tasks audited");
    assert_line(out, "3 violations found");
    let mut summary = block(out, "3 violations found");
    summary.sort();
    assert_eq!(
        summary,
        [
            "fix-login-bug: out-of-order artifact (IMPLEMENTATION.md)",
            "fix-login-bug: state-artifact mismatch (.state says \"research\" but IMPLEMENTATION.md exists)",
            "manual: manually created task folder (no .state file)",
        ],
        "{out}"
    );
}

#[test]
fn ac_audit_category1_out_of_order_artifacts_per_phase() {
    let env = Env::new();
    env.drive("clean", &["research"]);
    env.artifact("clean", "SPEC.md", "spec\n");
    env.create("designing");
    set_state(&env, "designing", "design");
    env.artifact("designing", "SPEC.md", "spec\n");
    env.artifact("designing", "TEST_PLAN.md", "early\n");
    env.artifact("designing", "VERDICT.md", "early\n");
    env.create("clean/sub");
    env.artifact("clean/sub", "SPEC.md", "early\n");
    let r = env.status(&["--audit"]);
    r.code(1);
    let out = &r.stdout;
    assert_line(out, "[PASS] clean: no violations");
    assert_line(
        out,
        "[FAIL] designing (phase: design): found TEST_PLAN.md (test_design phase artifact), VERDICT.md (referee phase artifact)",
    );
    assert_line(
        out,
        "[FAIL] clean/sub (phase: new): found SPEC.md (research phase artifact)",
    );
    assert_line(out, "  - designing: out-of-order artifact (TEST_PLAN.md)");
    assert_line(out, "  - designing: out-of-order artifact (VERDICT.md)");
    assert_line(out, "  - clean/sub: out-of-order artifact (SPEC.md)");
    assert_line(out, "3 tasks audited");
}

#[test]
fn ac_audit_category2_state_artifact_inconsistency_including_approval_substates() {
    let env = Env::new();
    env.drive(
        "good",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.drive(
        "stale",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.artifact("stale", "SPEC.md", "edited\n");
    env.create("no-record");
    set_state(&env, "no-record", "research:approved");
    env.artifact("no-record", "SPEC.md", "spec\n");
    env.create("await-no-art");
    set_state(&env, "await-no-art", "design:awaiting_approval");
    env.artifact("await-no-art", "SPEC.md", "spec\n");
    env.create("ahead");
    set_state(&env, "ahead", "research");
    env.artifact("ahead", "SPEC.md", "spec\n");
    env.artifact("ahead", "IMPLEMENTATION.md", "impl\n");
    let r = env.status(&["--audit"]);
    r.code(1);
    let out = &r.stdout;
    assert_line(
        out,
        "[PASS] good: .state (\"research:approved\") matches artifacts (SPEC.md exists)",
    );
    assert_line(
        out,
        "[FAIL] stale: .state says \"research:approved\" but SPEC.md changed after it was approved (run --approve again) — suggested correction: research:awaiting_approval",
    );
    assert_line(
        out,
        "[FAIL] no-record: .state says \"research:approved\" but .state.approvals has no research:approved record — suggested correction: research:awaiting_approval",
    );
    assert_line(
        out,
        "[FAIL] await-no-art: .state says \"design:awaiting_approval\" but DESIGN.md is missing or empty — suggested correction: design",
    );
    assert_line(
        out,
        "[FAIL] ahead: .state says \"research\" but IMPLEMENTATION.md exists — suggested correction: implement",
    );
    for t in ["stale", "no-record", "await-no-art", "ahead"] {
        assert!(
            out.lines()
                .any(|l| l.starts_with(&format!("  - {t}: state-artifact mismatch ("))),
            "{t} in summary:\n{out}"
        );
    }
    assert!(!out.lines().any(|l| l.starts_with("  - good:")), "{out}");
}

#[test]
fn ac_audit_category3_skips_gracefully_without_git() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    env.write("src/x.rs", "fn main() {}\n");
    let r = env.status(&["--audit"]);
    r.code(0);
    let lines: Vec<&str> = r.stdout.lines().collect();
    let h = lines
        .iter()
        .position(|l| *l == "=== Category 3: Unauthorized Modifications ===")
        .expect("category 3 header");
    assert_eq!(lines[h + 1], "Skipped: not a git repository");
    assert_line(&r.stdout, "0 violations found");
}

#[test]
fn ac_audit_category3_flags_code_committed_during_research_in_a_git_repo() {
    let env = Env::new();
    git(&env, &["init", "-q"]);
    env.write("README.md", "project\n");
    git(&env, &["add", "README.md"]);
    git(&env, &["commit", "-q", "-m", "initial"]);
    env.drive("t", &["research"]);
    let r = env.status(&["--audit"]);
    r.code(0);
    assert_line(
        &r.stdout,
        "[PASS] t: no code modifications outside implement phase",
    );
    assert_no_line_starting(&r.stdout, "Skipped:");

    // A commit strictly after the task's last transition (git times are in whole seconds).
    std::thread::sleep(std::time::Duration::from_millis(1100));
    env.write("src/x.rs", "fn main() {}\n");
    git(&env, &["add", "src/x.rs"]);
    git(&env, &["commit", "-q", "-m", "edit during research"]);
    let r = env.status(&["--audit"]);
    r.code(1);
    let fail = line_starting(
        &r.stdout,
        "[FAIL] t: src/x.rs was modified during research phase (state: research, commit ",
    );
    assert!(fail.ends_with(')'), "{fail}");
    assert_line(
        &r.stdout,
        "  - t: unauthorized modification (src/x.rs during research phase)",
    );
    assert_line(&r.stdout, "1 violations found");
}

#[test]
fn ac_audit_category4_manually_created_task_folders() {
    let env = Env::new();
    env.drive("tracked", &["research"]);
    env.artifact("tracked", "SPEC.md", "spec\n");
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    let r = env.status(&["--audit"]);
    r.code(1);
    assert_line(
        &r.stdout,
        "[FAIL] manual: no .state file — task was created manually. Use --create-task for new tasks, or --upgrade to track a task from before .state",
    );
    assert_line(
        &r.stdout,
        "  - manual: manually created task folder (no .state file)",
    );
    assert_no_line_starting(&r.stdout, "[PASS] every task folder has a .state file");
    env.status(&["--upgrade", "--task", "manual"]).ok();
    let r = env.status(&["--audit"]);
    r.code(0);
    assert_line(&r.stdout, "[PASS] every task folder has a .state file");
}

#[test]
fn ac_audit_outputs_structured_report_with_exit_codes_0_1_2() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    let before = env.snapshot();
    let r = env.status(&["--audit"]);
    r.code(0);
    assert_eq!(
        r.stdout,
        format!(
            "Audit Report for {}\n\n\
             === Category 1: Out-of-order Artifacts ===\n\
             [PASS] t: no violations\n\n\
             === Category 2: State-Artifact Inconsistency ===\n\
             [PASS] t: .state (\"research\") matches artifacts (SPEC.md exists)\n\n\
             === Category 3: Unauthorized Modifications ===\n\
             Skipped: not a git repository\n\n\
             === Category 4: Manually Created Task Folders ===\n\
             [PASS] every task folder has a .state file\n\n\
             === Summary ===\n\
             1 tasks audited\n\
             0 violations found\n",
            env.root().display()
        )
    );
    assert!(before == env.snapshot(), "--audit must not change files");

    env.artifact("t", "DESIGN.md", "early\n");
    env.status(&["--audit"]).code(1);

    fs::remove_file(env.task_dir("t").join("DESIGN.md")).expect("rm");
    env.create("broken");
    set_state(&env, "broken", "bogus");
    let r = env.status(&["--audit"]);
    r.code(2);
    assert!(
        r.stdout.lines().any(|l| l.starts_with("ERROR: ") && l.contains("Unknown phase 'bogus' in .state file")),
        "{r:?}"
    );
}

#[test]
fn ac_can_edit_returns_allowed_or_denied_by_phase() {
    let env = Env::new();
    env.create("t");
    for state in ["implement", "doc_review"] {
        set_state(&env, "t", state);
        let r = env.status(&["--can-edit", "--task", "t"]);
        r.code(0);
        assert_eq!(r.stdout, "ALLOWED\n");
    }
    for state in [
        "new",
        "research",
        "research:approved",
        "design",
        "code_review",
        "bug_find",
        "adversarial_bug_find",
        "referee",
        "complete",
    ] {
        set_state(&env, "t", state);
        let r = env.status(&["--can-edit", "--task", "t"]);
        r.code(1);
        assert_eq!(
            r.stdout,
            format!(
                "DENIED: Task 't' is in {state} phase. Code edits require implement or doc_review phase.\n"
            )
        );
    }
}

#[test]
fn ac_can_create_task_returns_allowed() {
    let env = Env::new();
    let r = env.status(&["--can-create-task"]);
    r.code(0);
    assert_eq!(r.stdout, "ALLOWED\n");
    env.create("t");
    let r = env.status(&["--can-create-task"]);
    r.code(0);
    assert_eq!(r.stdout, "ALLOWED\n");
}

#[test]
fn ac_scope_check_returns_in_scope_or_out_of_scope() {
    let env = Env::new();
    env.create("t");
    let root = env.root().display().to_string();
    let inside_abs = env.root().join("src/main.rs").display().to_string();
    for file in [
        "src/main.rs",
        "./README.md",
        inside_abs.as_str(),
        "src/../lib.rs",
    ] {
        let r = env.status(&["--scope-check", "--task", "t", "--file", file]);
        r.code(0);
        assert_eq!(r.stdout, "IN_SCOPE\n", "{file}");
    }
    let home_other = env.home.path().join("notes.txt").display().to_string();
    for file in [
        "/etc/passwd",
        "../x",
        "src/../../escape",
        home_other.as_str(),
    ] {
        let r = env.status(&["--scope-check", "--task", "t", "--file", file]);
        r.code(1);
        assert_eq!(
            r.stdout,
            format!("OUT_OF_SCOPE: File '{file}' is outside project '{root}'.\n"),
            "{file}"
        );
    }
    // ~/.automaton/ is in scope too.
    fs::create_dir_all(env.home.path().join(".automaton/scripts")).expect("mkdir");
    let user = env
        .home
        .path()
        .join(".automaton/scripts/status.py")
        .display()
        .to_string();
    let r = env.status(&["--scope-check", "--task", "t", "--file", &user]);
    r.code(0);
    assert_eq!(r.stdout, "IN_SCOPE\n");
    let sneaky = format!("{}/.automaton/../notes.txt", env.home.path().display());
    env.status(&["--scope-check", "--task", "t", "--file", &sneaky])
        .code(1);
}

#[test]
fn ac_same_session_returns_same_or_different_session() {
    let env = Env::new();
    env.create("t");
    let r = env.status(&["--same-session", "--task", "t"]);
    r.code(1);
    assert_eq!(r.stdout, "SAME_SESSION\n");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let r = env.status(&["--same-session", "--task", "t", "--window", "1s"]);
    r.code(0);
    assert_eq!(r.stdout, "DIFFERENT_SESSION\n");
    let r = env.status(&["--same-session", "--task", "t"]);
    r.code(1);
    assert_eq!(r.stdout, "SAME_SESSION\n", "default window is 30 minutes");
}

#[test]
fn ac_fallback_to_artifact_heuristic_when_state_missing() {
    let env = Env::new();
    env.write(".automaton/tasks/old-task/SPEC.md", "spec\n");
    env.write(".automaton/tasks/old-task/IMPLEMENTATION.md", "impl\n");
    env.write(".automaton/tasks/only-spec/SPEC.md", "spec\n");
    fs::create_dir_all(env.root().join(".automaton/tasks/empty")).expect("mkdir");
    let before = env.snapshot();
    let out = env.status(&["--task", "old-task"]).ok().stdout.clone();
    let phase = line_starting(&out, "Phase: ");
    assert!(
        phase.starts_with("Phase: implement (inferred from artifacts;"),
        "{out}"
    );
    assert!(phase.contains("untracked"), "{out}");
    assert_line(&out, "Next phase: code_review");
    let out = env.status(&["--task", "only-spec"]).ok().stdout.clone();
    assert!(
        line_starting(&out, "Phase: ").starts_with("Phase: research:awaiting_approval (inferred"),
        "{out}"
    );
    // Neither .state nor artifacts: "unknown".
    let out = env.status(&["--task", "empty"]).ok().stdout.clone();
    assert_line(&out, "Phase: unknown (no .state file found)");
    assert!(before == env.snapshot(), "--task only reads");
}

#[test]
fn ac_atomic_writes_for_state_file() {
    let env = Env::new();
    env.drive(
        "t",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
            "implement",
        ],
    );
    env.status(&["--upgrade"]).ok();
    assert_eq!(
        fs::read(env.task_dir("t").join(".state")).expect("state"),
        b"implement\n"
    );
    let mut names: Vec<String> = fs::read_dir(env.task_dir("t"))
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [".state", ".state.approvals", "SPEC.md"],
        "no .state.tmp left behind"
    );
    for e in walk_files(env.root()) {
        assert!(!e.ends_with(".tmp"), "temporary file left: {e}");
    }
}

fn walk_files(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in fs::read_dir(dir).expect("dir").flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk_files(&p));
        } else {
            out.push(p.display().to_string());
        }
    }
    out
}

#[test]
fn ac_approval_log_is_created_and_maintained() {
    let env = Env::new();
    env.create("t");
    assert_eq!(raw(&env, "t", ".state.approvals"), "");
    env.drive("t", &TO_REFEREE[..3]);
    let first = approvals(&env, "t");
    assert_eq!(first.len(), 1);
    env.drive("t", &TO_REFEREE[3..7]);
    let log = approvals(&env, "t");
    assert_eq!(log.len(), 2);
    assert_eq!(
        log[0], first[0],
        "append-only: earlier lines are kept as they were"
    );
    check_approval_line(&log[1], "code_review", "user", SHA_CONTENT);
    env.drive("t", &TO_REFEREE[7..]);
    env.drive("t", &["complete"]);
    assert_eq!(approvals(&env, "t"), log, "transitions never touch the log");
    // --upgrade creates the log for an old task folder.
    env.write(".automaton/tasks/old/SPEC.md", "spec\n");
    env.status(&["--upgrade", "--task", "old"]).ok();
    assert_eq!(raw(&env, "old", ".state.approvals"), "");
}

#[test]
fn ac_transition_only_legal_transitions_allowed_including_approval_substates() {
    let env = Env::new();
    env.create("t");
    for a in ARTIFACTS {
        env.artifact("t", a, "x\n");
    }
    for state in ALL_STATES
        .iter()
        .filter(|s| !s.ends_with(":awaiting_approval"))
    {
        set_state(&env, "t", state);
        let legal = legal_of(state);
        let list = if legal.is_empty() {
            "(none: this is a terminal phase)".to_string()
        } else {
            legal.join(", ")
        };
        for target in ALL_STATES.iter().filter(|t| !legal.contains(t)) {
            let r = env.refused(&["--task", "t", "--transition", target]);
            r.code(1);
            assert_eq!(
                r.error_line(),
                format!(
                    "ERROR: Cannot transition from '{state}' to '{target}'. Legal transitions from '{state}' are: {list}"
                )
            );
        }
    }
    // Every legal move is accepted (with its artifact, and the verdict the referee needs).
    for (i, (from, targets)) in LEGAL.iter().enumerate() {
        for (j, to) in targets.iter().enumerate() {
            let task = format!("m{i}-{j}");
            env.create(&task);
            set_state_approved(&env, &task, from);
            if let Some(a) = artifact_for(from) {
                let body = if *to == "human_intervention" {
                    "Verdict: FAIL\n"
                } else {
                    "Verdict: PASS\n"
                };
                env.artifact(&task, a, body);
            }
            let r = env.status(&["--task", &task, "--transition", to]);
            r.ok();
            assert_eq!(
                raw(&env, &task, ".state"),
                format!("{to}\n"),
                "{from} -> {to}"
            );
        }
    }
}

#[test]
fn ac_clear_error_messages_for_every_kind_of_refusal() {
    let env = Env::new();
    env.drive("t", &["research"]);
    // Illegal transition.
    let r = env.refused(&["--task", "t", "--transition", "bug_find"]);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'research' to 'bug_find'. Legal transitions from 'research' are: research:awaiting_approval"
    );
    // Missing artifact.
    let r = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'research' to 'research:awaiting_approval'. Required artifact 'SPEC.md' is missing or empty in task folder."
    );
    // Out-of-order artifact.
    env.artifact("t", "SPEC.md", "spec\n");
    env.artifact("t", "DESIGN.md", "early\n");
    let r = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'research' to 'research:awaiting_approval'. Found forbidden artifact 'DESIGN.md' in task folder. This indicates phase-skipping. Remove the artifact or revert to the correct phase."
    );
    fs::remove_file(env.task_dir("t").join("DESIGN.md")).expect("rm");
    // Approval violations.
    let r = env.refused(&["--task", "t", "--approve"]);
    assert!(
        r.error_line()
            .starts_with("ERROR: Current phase is 'research' (not awaiting approval)."),
        "{r:?}"
    );
    env.drive("t", &["research:awaiting_approval"]);
    let r = env.refused(&["--task", "t", "--transition", "research:approved"]);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'research:awaiting_approval' to 'research:approved'. 'research:awaiting_approval' waits for a person's sign-off: only --approve moves it on, to 'research:approved'."
    );
    // Invalid state.
    set_state(&env, "t", "bogus");
    let r = env.refused(&["--task", "t"]);
    r.code(2);
    assert!(
        r.error_line()
            .starts_with("ERROR: Unknown phase 'bogus' in .state file"),
        "{r:?}"
    );
    // Unknown task.
    let r = env.refused(&["--task", "nope"]);
    r.code(2);
    assert!(
        r.error_line().starts_with(&format!(
            "ERROR: Task 'nope' not found in {}/",
            env.root().join(".automaton/tasks").display()
        )),
        "{r:?}"
    );
}

#[test]
fn ac_subtask_support_reads_state_from_subtask_folder() {
    let env = Env::new();
    env.drive("parent-task", &["research"]);
    env.create("parent-task/subtask-a");
    let sub_dir = env
        .root()
        .join(".automaton/tasks/parent-task/subtasks/subtask-a");
    assert_eq!(
        fs::read_to_string(sub_dir.join(".state")).expect("sub state"),
        "new\n"
    );
    env.status(&[
        "--task",
        "parent-task/subtask-a",
        "--transition",
        "research",
    ])
    .ok();
    assert_eq!(
        fs::read_to_string(sub_dir.join(".state")).expect("sub state"),
        "research\n"
    );
    assert_eq!(
        env.state("parent-task"),
        "research",
        "the parent's .state is untouched"
    );
    let out = env
        .status(&["--task", "parent-task/subtask-a"])
        .ok()
        .stdout
        .clone();
    assert_line(&out, "Task: parent-task/subtask-a");
    assert_line(&out, "Phase: research (from .state)");
    assert_line(
        &out,
        &format!("State file: {}", sub_dir.join(".state").display()),
    );
    assert_line(&out, "Parent task: parent-task (phase: research)");
    let out = env.status(&["--task", "parent-task"]).ok().stdout.clone();
    assert_line(&out, "Sub-tasks: parent-task/subtask-a");
    assert_no_line_starting(&out, "Parent task:");
    // It really reads the sub-task's own .state.
    fs::write(sub_dir.join(".state"), "bogus\n").expect("write");
    let r = env.refused(&["--task", "parent-task/subtask-a"]);
    assert!(
        r.error_line()
            .starts_with("ERROR: Unknown phase 'bogus' in .state file"),
        "{r:?}"
    );
    env.status(&["--task", "parent-task"]).ok();
    let r = env.refused(&["--task", "parent-task/nope"]);
    assert!(
        r.error_line()
            .starts_with("ERROR: Task 'parent-task/nope' not found in "),
        "{r:?}"
    );
}

#[test]
fn ac_project_path_defaults_to_cwd_and_handles_user_automaton() {
    let env = Env::new();
    let r = bare(&env, env.root(), &["--create-task", "t"]);
    r.ok();
    assert_eq!(env.state("t"), "new");
    let r = bare(&env, env.root(), &["--task", "t"]);
    r.ok();
    assert_line(
        &r.stdout,
        &format!("State file: {}", env.task_dir("t").join(".state").display()),
    );
    assert!(
        bare(&env, env.root(), &["--list"])
            .ok()
            .stdout
            .lines()
            .any(|l| l.starts_with("t "))
    );
    // From another folder without --project, the task is not there.
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let r = bare(&env, elsewhere.path(), &["--task", "t"]);
    r.code(2);
    assert!(
        r.stderr.starts_with(&format!(
            "ERROR: Task 't' not found in {}/",
            elsewhere.path().join(".automaton/tasks").display()
        )),
        "{r:?}"
    );

    // Running from ~/.automaton/ uses ~/.automaton/tasks/.
    let user = env.home.path().join(".automaton");
    fs::create_dir_all(&user).expect("mkdir");
    bare(&env, &user, &["--create-task", "global-task"]).ok();
    assert_eq!(
        fs::read_to_string(user.join("tasks/global-task/.state")).expect("state"),
        "new\n"
    );
    assert!(
        !user.join(".automaton").exists(),
        "no nested .automaton/.automaton"
    );
    let r = bare(
        &env,
        elsewhere.path(),
        &[
            "--task",
            "global-task",
            "--project",
            &user.display().to_string(),
        ],
    );
    r.ok();
    assert_line(
        &r.stdout,
        &format!(
            "State file: {}",
            user.join("tasks/global-task/.state").display()
        ),
    );
}

// ----- issue 2: decided here -------------------------------------------------------------

#[test]
fn issue_validate_folder_exit_codes_0_1_2() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.status(&["--validate-folder", "--task", "t"]).code(0);
    env.artifact("t", "VERDICT.md", "early\n");
    env.status(&["--validate-folder", "--task", "t"]).code(1);
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    env.status(&["--validate-folder", "--task", "manual"])
        .code(1);
    env.refused(&["--validate-folder", "--task", "nope"])
        .code(2);
    env.refused(&["--validate-folder", "--task", "Bad_Name"])
        .code(2);
    set_state(&env, "t", "bogus");
    let r = env.refused(&["--validate-folder", "--task", "t"]);
    r.code(2);
    assert!(
        r.error_line()
            .starts_with("ERROR: Unknown phase 'bogus' in .state file"),
        "{r:?}"
    );
}

#[test]
fn issue_refused_commands_exit_nonzero_1_for_policy_2_for_errors() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    // Policy refusals: 1.
    env.refused(&["--task", "t", "--transition", "implement"])
        .code(1);
    env.refused(&["--task", "t", "--transition", "research:awaiting_approval"])
        .code(1);
    env.refused(&["--task", "t", "--approve"]).code(1);
    let r = env.refused(&["--task", "manual", "--transition", "research"]);
    r.code(1);
    // Errors: 2.
    env.refused(&["--task", "nope"]).code(2);
    env.refused(&["--task", "nope", "--transition", "research"])
        .code(2);
    env.refused(&["--task", "A_B"]).code(2);
    env.refused(&["--task", "t", "--transition", "bogus"])
        .code(2);
    env.refused(&["--same-session", "--task", "t", "--window", "soon"])
        .code(2);
    // Something already there: refused, non-zero.
    assert_ne!(env.refused(&["--create-task", "t"]).code, 0);
}

#[test]
fn issue_refusals_start_with_one_line_then_spec_detail_lines() {
    let env = Env::new();
    env.drive("t", &["research"]);
    // Single-line refusals: exactly one line, which says what to do.
    let r = env.refused(&["--task", "nope"]);
    assert_eq!(r.stderr.lines().count(), 1, "{r:?}");
    assert!(r.error_line().contains("--create-task nope"), "{r:?}");
    let r = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    assert_eq!(r.stderr.lines().count(), 1, "{r:?}");
    let r = env.refused(&["--create-task", "A_B"]);
    assert_eq!(r.stderr.lines().count(), 1, "{r:?}");
    assert!(r.error_line().contains("e.g. 'add-user-auth'"), "{r:?}");
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    let r = env.refused(&["--task", "manual", "--transition", "research"]);
    assert!(r.error_line().contains("--upgrade --task manual"), "{r:?}");
    // 004's longer message keeps its extra lines below the first.
    env.artifact("t", "SPEC.md", "spec\n");
    env.artifact("t", "BUG_REPORT.md", "early\n");
    let r = env.refused(&["--task", "t", "--transition", "research:awaiting_approval"]);
    let lines: Vec<&str> = r.stderr.lines().collect();
    assert!(lines[0].starts_with("ERROR: Cannot transition from 'research' to 'research:awaiting_approval'. Found forbidden artifact 'BUG_REPORT.md'"), "{r:?}");
    assert_eq!(
        &lines[1..],
        [
            "  - BUG_REPORT.md (belongs to bug_find phase)",
            "Remove out-of-order artifacts before transitioning."
        ]
    );
}

#[test]
fn issue_task_names_kebab_case_at_most_64_characters() {
    let env = Env::new();
    env.create("seed");
    let max = "a".repeat(64);
    let long = "a".repeat(65);
    for good in ["a", "a1", "0-9", "add-user-auth", max.as_str()] {
        env.create(good);
        assert_eq!(env.state(good), "new", "{good}");
    }
    for bad in [
        long.as_str(),
        "a--b",
        "-a",
        "a-",
        "Add",
        "a_b",
        "a b",
        "é",
        "a.b",
        ".",
        "..",
    ] {
        let r = env.refused(&[&format!("--create-task={bad}")]);
        r.code(2);
        assert!(
            r.error_line().starts_with("ERROR: Invalid task name '"),
            "{bad}: {r:?}"
        );
    }
}

#[test]
fn issue_create_task_parent_sub_creates_subtask_under_existing_parent() {
    let env = Env::new();
    env.create("parent");
    let r = env.status(&["--create-task", "parent/sub-a"]);
    r.ok();
    assert_eq!(
        r.stdout,
        "Created task 'parent/sub-a' in state 'new'. Use --transition research to begin.\n"
    );
    let dir = env.root().join(".automaton/tasks/parent/subtasks/sub-a");
    assert_eq!(fs::read(dir.join(".state")).expect("state"), b"new\n");
    assert_eq!(fs::read(dir.join(".state.approvals")).expect("log"), b"");
    let r = env.refused(&["--create-task", "missing/sub-a"]);
    r.code(2);
    assert!(
        r.error_line()
            .starts_with("ERROR: Parent task 'missing' not found in "),
        "{r:?}"
    );
    for bad in [
        "parent/Sub",
        "Parent/sub",
        "parent/sub/x",
        "parent/",
        "/sub",
    ] {
        env.refused(&["--create-task", bad]).code(2);
    }
    assert_ne!(env.refused(&["--create-task", "parent/sub-a"]).code, 0);
}

#[test]
fn issue_agent_md_keys_read_case_insensitively_in_both_forms() {
    let env = Env::new();
    env.create("t");
    let lease_line = |env: &Env| {
        env.status(&["--task", "t"])
            .ok()
            .stdout
            .lines()
            .any(|l| l.starts_with("Lease: none"))
    };
    assert!(!lease_line(&env), "single-agent by default");
    for text in [
        "Mode: multi-agent\n",
        "- **Mode**: multi-agent\n",
        "# Config\nMODE: Multi-Agent\n",
        "- **mode**: MULTI-AGENT\n- **Lock Timeout**: 45 minutes\n",
        "Mode: multi-agent\nLock timeout: 90s\n",
        "Mode: multi-agent\nlock timeout: 1h\n",
        "Mode: multi-agent\nLock timeout: 30\n",
    ] {
        env.write(".automaton/.agent.md", text);
        assert!(lease_line(&env), "{text:?}");
    }
    // A lock timeout that is not a duration is refused, saying what to write.
    env.write(
        ".automaton/.agent.md",
        "Mode: multi-agent\nLock timeout: soon\n",
    );
    let r = env.refused(&["--task", "t"]);
    assert!(
        r.error_line()
            .contains("key 'Lock timeout' has the invalid value 'soon'"),
        "{r:?}"
    );
    // The user's ~/.automaton/.agent.md applies when the project sets nothing…
    fs::remove_file(env.root().join(".automaton/.agent.md")).expect("rm");
    fs::create_dir_all(env.home.path().join(".automaton")).expect("mkdir");
    fs::write(
        env.home.path().join(".automaton/.agent.md"),
        "- **Mode**: multi-agent\n",
    )
    .expect("write");
    assert!(lease_line(&env), "from ~/.automaton/.agent.md");
    // …and the project's own file wins.
    env.write(".automaton/.agent.md", "Mode: single-agent\n");
    assert!(!lease_line(&env), "project override");
}

#[test]
fn issue_stale_approval_reported_by_task_and_list() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec v1\n");
    env.drive("t", &["research:awaiting_approval", "research:approved"]);
    let ts = check_approval_line(&approvals(&env, "t")[0], "research", "user", SHA_V1);
    env.artifact("t", "SPEC.md", "spec v2\n");
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert_line(
        &out,
        &format!(
            "Approval: STALE: SPEC.md changed after user approved it at {ts}. Run --approve to approve the new content"
        ),
    );
    assert!(
        env.status(&["--list"])
            .ok()
            .stdout
            .contains("research:approved (stale approval)")
    );
    // Restoring the approved content makes it fresh again.
    env.artifact("t", "SPEC.md", "spec v1\n");
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert!(
        line_starting(&out, "Approval: ").starts_with("Approval: approved by user at "),
        "{out}"
    );
}

#[test]
fn issue_stale_approval_blocks_leaving_approved_until_reapproved() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec v1\n");
    env.drive("t", &["research:awaiting_approval", "research:approved"]);
    env.artifact("t", "SPEC.md", "spec v2\n");
    for target in ["implement", "design", "decomposition"] {
        let r = env.refused(&["--task", "t", "--transition", target]);
        r.code(1);
        assert_eq!(
            r.error_line(),
            format!(
                "ERROR: Cannot transition from 'research:approved' to '{target}'. The approval of SPEC.md is stale: the file changed after it was approved. Run --approve to approve the new content, or restore the approved file."
            )
        );
    }
    // --approve re-approves: a new line with the new content's sha256.
    let r = env.status(&["--task", "t", "--approve"]);
    r.ok();
    assert!(
        r.stdout
            .contains("'research:approved' → 'research:approved'"),
        "{r:?}"
    );
    assert_eq!(raw(&env, "t", ".state"), "research:approved\n");
    let log = approvals(&env, "t");
    assert_eq!(log.len(), 2, "{log:?}");
    check_approval_line(&log[0], "research", "user", SHA_V1);
    check_approval_line(&log[1], "research", "user", SHA_V2);
    // Fresh again: a second --approve is refused, and the task can move on.
    env.refused(&["--task", "t", "--approve"]).code(1);
    env.status(&["--task", "t", "--transition", "implement"])
        .ok();
    assert_eq!(env.state("t"), "implement");
}

#[test]
fn issue_verdict_pass_goes_to_complete_only() {
    let env = Env::new();
    env.drive("t", TO_REFEREE);
    env.artifact("t", "VERDICT.md", "# Verdict\n\nVerdict: PASS\n");
    let r = env.refused(&["--task", "t", "--transition", "human_intervention"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: Cannot transition from 'referee' to 'human_intervention'. VERDICT.md says PASS: transition to 'complete' instead."
    );
    env.status(&["--task", "t", "--transition", "complete"])
        .ok();
    assert_eq!(raw(&env, "t", ".state"), "complete\n");
}

#[test]
fn issue_verdict_fail_or_needs_review_goes_to_human_intervention_only() {
    let env = Env::new();
    env.drive("t", TO_REFEREE);
    for (body, word) in [
        ("Verdict: FAIL\n", "FAIL"),
        ("Verdict: NEEDS_REVIEW\n", "NEEDS_REVIEW"),
    ] {
        set_state(&env, "t", "referee");
        env.artifact("t", "VERDICT.md", body);
        let r = env.refused(&["--task", "t", "--transition", "complete"]);
        r.code(1);
        assert_eq!(
            r.error_line(),
            format!(
                "ERROR: Cannot transition from 'referee' to 'complete'. VERDICT.md says {word}: transition to 'human_intervention' instead."
            )
        );
        env.status(&["--task", "t", "--transition", "human_intervention"])
            .ok();
        assert_eq!(raw(&env, "t", ".state"), "human_intervention\n");
        env.refused(&["--task", "t", "--transition", "complete"])
            .code(1);
    }
}

#[test]
fn issue_verdict_missing_is_refused_saying_what_to_write() {
    let env = Env::new();
    env.drive("t", TO_REFEREE);
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert!(
        block(&out, "Allowed actions:")
            .contains(&"Write VERDICT.md with a line 'Verdict: PASS', 'Verdict: FAIL' or 'Verdict: NEEDS_REVIEW'".to_string()),
        "{out}"
    );
    for body in [
        "The tests PASS mostly.\n",
        "Verdict: PASSED\n",
        "pass\n",
        "# Verdict\n\nLooks fine.\n",
    ] {
        env.artifact("t", "VERDICT.md", body);
        // Completing needs a verdict that can be read (human_intervention, the safe path,
        // stays open: issue 14, item 7).
        let r = env.refused(&["--task", "t", "--transition", "complete"]);
        r.code(1);
        assert_eq!(
            r.error_line(),
            "ERROR: Cannot transition from 'referee' to 'complete'. VERDICT.md states no verdict that can be read: add a line 'Verdict: PASS' to complete (or 'Verdict: FAIL' / 'Verdict: NEEDS_REVIEW'), or transition to 'human_intervention'.",
            "{body:?}"
        );
    }
    assert_eq!(env.state("t"), "referee");
}

#[test]
fn issue_verdict_first_line_stripped_of_markdown_or_verdict_key() {
    let env = Env::new();
    env.drive("t", TO_REFEREE);
    let cases = [
        ("PASS\n", "complete"),
        ("# PASS\n", "complete"),
        ("**PASS**\n", "complete"),
        ("- PASS\n", "complete"),
        ("## Verdict: PASS\n", "complete"),
        ("**Verdict:** pass\n", "complete"),
        ("- **Verdict**: needs_review\n", "human_intervention"),
        (
            "# Review\n\nSummary of findings.\n\n**FAIL**\n",
            "human_intervention",
        ),
        ("FAIL\nPASS\n", "human_intervention"),
    ];
    for (body, target) in cases {
        set_state(&env, "t", "referee");
        env.artifact("t", "VERDICT.md", body);
        let r = env.status(&["--task", "t", "--transition", target]);
        assert_eq!(r.code, 0, "{body:?} -> {target}: {r:?}");
        assert_eq!(env.state("t"), target);
    }
}

#[test]
fn issue_audit_work_in_progress_is_a_warning_and_exit_stays_0() {
    let env = Env::new();
    env.drive("t", TO_IMPLEMENT);
    let r = env.status(&["--audit"]);
    r.code(0);
    assert_line(
        &r.stdout,
        "[WARN] t: work in progress: .state says \"implement\" and IMPLEMENTATION.md is not written yet",
    );
    assert_line(&r.stdout, "0 violations found");
    env.artifact("t", "IMPLEMENTATION.md", "impl\n");
    let r = env.status(&["--audit"]);
    r.code(0);
    assert_line(
        &r.stdout,
        "[PASS] t: .state (\"implement\") matches artifacts (IMPLEMENTATION.md, SPEC.md exist)",
    );
}

#[test]
fn issue_decomposed_parent_leaves_decomposition_approved_only_for_complete_or_human_intervention() {
    let env = Env::new();
    env.drive("parent", TO_DECOMPOSED);
    env.drive(
        "parent/sub-a",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
            "implement",
        ],
    );
    assert_eq!(
        env.state("parent"),
        "decomposition:approved",
        "the parent waits while sub-tasks run"
    );
    for target in [
        "design",
        "implement",
        "test_design",
        "research",
        "referee",
        "bug_find",
    ] {
        let r = env.refused(&["--task", "parent", "--transition", target]);
        r.code(1);
        assert_eq!(
            r.error_line(),
            format!(
                "ERROR: Cannot transition from 'decomposition:approved' to '{target}'. Legal transitions from 'decomposition:approved' are: complete, human_intervention"
            )
        );
    }
    let out = env.status(&["--task", "parent"]).ok().stdout.clone();
    assert_line(&out, "Next phase: complete or human_intervention");
    // The parent completes once its sub-task has (issue 14, item 6).
    env.drive("parent/sub-a", &TO_REFEREE[4..]);
    env.drive("parent/sub-a", &["complete"]);
    assert_eq!(env.state("parent/sub-a"), "complete");
    env.status(&["--task", "parent", "--transition", "complete"])
        .ok();
    assert_eq!(env.state("parent"), "complete");
    env.drive("other", TO_DECOMPOSED);
    env.status(&["--task", "other", "--transition", "human_intervention"])
        .ok();
    assert_eq!(env.state("other"), "human_intervention");
}

#[test]
fn issue_untracked_folder_reported_refused_and_upgrade_writes_state() {
    let env = Env::new();
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    env.write(".automaton/tasks/manual/IMPLEMENTATION.md", "impl\n");
    fs::create_dir_all(env.root().join(".automaton/tasks/blank")).expect("mkdir");
    env.create("tracked");
    let out = env.status(&["--task", "manual"]).ok().stdout.clone();
    assert_line(
        &out,
        "Phase: implement (inferred from artifacts; untracked: no .state file. Run --upgrade --task manual to track it)",
    );
    // Commands that change state refuse an untracked task and say how to fix it.
    for args in [
        vec!["--task", "manual", "--transition", "code_review"],
        vec!["--task", "manual", "--approve"],
        vec!["--can-edit", "--task", "manual"],
    ] {
        let r = env.refused(&args);
        r.code(1);
        assert_eq!(
            r.error_line(),
            "ERROR: Task 'manual' is untracked (no .state file). Run --upgrade --task manual to bootstrap .state from its artifacts, then retry."
        );
    }
    let r = env.status(&["--upgrade", "--task", "manual"]);
    r.ok();
    assert_eq!(
        r.stdout,
        "Upgraded 'manual': wrote .state = implement (inferred from artifacts)\n"
    );
    assert_eq!(raw(&env, "manual", ".state"), "implement\n");
    assert_eq!(raw(&env, "manual", ".state.approvals"), "");
    assert_line(
        &env.status(&["--task", "manual"]).ok().stdout,
        "Phase: implement (from .state)",
    );
    // Without --task: every untracked folder; an empty one starts as new; tracked ones untouched.
    let before = raw(&env, "tracked", ".state");
    let r = env.status(&["--upgrade"]);
    r.ok();
    assert_eq!(
        r.stdout,
        "Upgraded 'blank': wrote .state = new (no artifacts: starts as new)\n"
    );
    assert_eq!(raw(&env, "blank", ".state"), "new\n");
    assert_eq!(raw(&env, "tracked", ".state"), before);
    assert_eq!(
        env.status(&["--upgrade"]).ok().stdout,
        "Nothing to upgrade: every task has a .state file.\n"
    );
}

#[test]
fn issue_approvals_log_accepts_three_and_four_field_lines() {
    let env = Env::new();
    env.create("t");
    set_state(&env, "t", "research:approved");
    env.artifact("t", "SPEC.md", "spec\n");
    env.artifact(
        "t",
        ".state.approvals",
        "research:approved|2026-06-14T14:30:00Z|user\n",
    );
    let out = env.status(&["--task", "t"]).ok().stdout.clone();
    assert_line(
        &out,
        "Approval: approved by user at 2026-06-14T14:30:00Z (no content hash recorded)",
    );
    env.status(&["--audit"]).code(0);
    env.status(&["--task", "t", "--transition", "implement"])
        .ok();

    env.create("u");
    set_state(&env, "u", "research:approved");
    env.artifact("u", "SPEC.md", "spec v1\n");
    env.artifact(
        "u",
        ".state.approvals",
        &format!("research:approved|2026-06-14T14:30:00Z|bob|{SHA_V1}\n"),
    );
    let out = env.status(&["--task", "u"]).ok().stdout.clone();
    assert_line(
        &out,
        &format!(
            "Approval: approved by bob at 2026-06-14T14:30:00Z (SPEC.md sha256 {})",
            &SHA_V1[..12]
        ),
    );
    env.status(&["--task", "u", "--transition", "design"]).ok();
}

#[test]
fn issue_json_output_parses_for_machines() {
    let env = Env::new();
    env.drive("t", &["research"]);
    let parse = |args: &[&str]| -> (serde_json::Value, i32) {
        let r = env.status(args);
        let v: serde_json::Value = serde_json::from_str(&r.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", r.stdout));
        (v, r.code)
    };
    let (v, code) = parse(&["--task", "t", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(v["task"], "t");
    assert_eq!(v["state"], "research");
    assert_eq!(v["tracked"], true);
    let (v, _) = parse(&["--list", "--json"]);
    assert_eq!(v[0]["task"], "t");
    assert_eq!(v[0]["state"], "research");
    let (v, code) = parse(&["--validate-folder", "--task", "t", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(v["out_of_order"], serde_json::json!([]));
    let (_, code) = parse(&["--audit", "--json"]);
    assert_eq!(code, 0);
    env.artifact("t", "SPEC.md", "spec\n");
    let (v, code) = parse(&[
        "--task",
        "t",
        "--transition",
        "research:awaiting_approval",
        "--json",
    ]);
    assert_eq!(code, 0);
    assert_eq!(v["to"], "research:awaiting_approval");
    let (v, code) = parse(&["--task", "t", "--approve", "--json"]);
    assert_eq!(code, 0);
    assert_eq!(v["to"], "research:approved");
    assert_eq!(v["approval"]["sha256"], SHA_SPEC);
    let (v, code) = parse(&["--can-edit", "--task", "t", "--json"]);
    assert_eq!(code, 1);
    assert_eq!(v["allowed"], false);
    // Errors are JSON too, with the exit code.
    let (v, code) = parse(&["--task", "nope", "--json"]);
    assert_eq!(code, 2);
    assert_eq!(v["exit_code"], 2);
    assert!(
        v["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("Task 'nope' not found in ")),
        "{v}"
    );
}

// ----- issue 2: bad input ----------------------------------------------------------------

#[test]
fn issue_bad_input_unknown_task() {
    let env = Env::new();
    env.create("real");
    for args in [
        vec!["--task", "nope"],
        vec!["--task", "nope", "--transition", "research"],
        vec!["--task", "nope", "--approve"],
        vec!["--validate-folder", "--task", "nope"],
        vec!["--can-edit", "--task", "nope"],
        vec!["--same-session", "--task", "nope"],
        vec!["--upgrade", "--task", "nope"],
        vec!["--task", "real/nope"],
    ] {
        let r = env.refused(&args);
        r.code(2);
        let name = args[args.iter().position(|a| *a == "--task").expect("--task") + 1];
        assert!(
            r.error_line().starts_with(&format!(
                "ERROR: Task '{name}' not found in {}/",
                env.root().join(".automaton/tasks").display()
            )),
            "{args:?}: {r:?}"
        );
    }
}

#[test]
fn issue_bad_input_unknown_task_in_fresh_project_creates_nothing() {
    // A project with no .automaton folder yet: a refused command must not create one.
    let env = Env::new();
    env.write("README.md", "project\n");
    for args in [
        vec!["--task", "nope"],
        vec!["--task", "nope", "--transition", "research"],
        vec!["--task", "nope", "--approve"],
        vec!["--create-task", "nope/sub"],
        vec!["--upgrade", "--task", "nope"],
    ] {
        env.refused(&args).code(2);
    }
    assert!(!env.root().join(".automaton").exists());
}

#[test]
fn issue_bad_input_illegal_transition() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    for target in ["bug_find", "complete", "new", "research", "implement"] {
        let r = env.refused(&["--task", "t", "--transition", target]);
        r.code(1);
        assert!(
            r.error_line()
                .contains("Legal transitions from 'research' are: research:awaiting_approval"),
            "{r:?}"
        );
    }
    // A target that is no phase at all.
    for target in ["bogus", "Research", "implement:approved", ""] {
        let r = env.refused(&["--task", "t", "--transition", target]);
        r.code(2);
        assert!(
            r.error_line()
                .starts_with(&format!("ERROR: Unknown phase '{target}'")),
            "{r:?}"
        );
    }
    assert_eq!(env.state("t"), "research");
}

#[test]
fn issue_bad_input_missing_or_empty_artifact() {
    let env = Env::new();
    env.drive("t", TO_IMPLEMENT);
    env.refused(&["--task", "t", "--transition", "code_review"])
        .code(1);
    env.artifact("t", "IMPLEMENTATION.md", "");
    env.refused(&["--task", "t", "--transition", "code_review"])
        .code(1);
    // Approval of an artifact deleted meanwhile.
    env.drive("u", &["research", "research:awaiting_approval"]);
    fs::remove_file(env.task_dir("u").join("SPEC.md")).expect("rm");
    let r = env.refused(&["--task", "u", "--approve"]);
    r.code(1);
    assert!(
        r.error_line()
            .contains("required artifact 'SPEC.md' is missing or empty"),
        "{r:?}"
    );
    assert_eq!(raw(&env, "u", ".state.approvals"), "");
}

#[test]
fn issue_bad_input_forbidden_artifact() {
    let env = Env::new();
    env.drive("t", TO_IMPLEMENT);
    env.artifact("t", "IMPLEMENTATION.md", "impl\n");
    env.artifact("t", "VERDICT.md", "Verdict: PASS\n");
    let r = env.refused(&["--task", "t", "--transition", "code_review"]);
    r.code(1);
    assert!(
        r.error_line()
            .contains("Found forbidden artifact 'VERDICT.md'"),
        "{r:?}"
    );
}

#[test]
fn issue_bad_input_approval_outside_gate() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    let r = env.refused(&["--task", "t", "--approve"]);
    r.code(1);
    assert_eq!(
        r.error_line(),
        "ERROR: Current phase is 'research' (not awaiting approval). Current sub-state must be 'research:awaiting_approval' before approval can be granted."
    );
    env.drive("u", TO_IMPLEMENT);
    env.artifact("u", "IMPLEMENTATION.md", "impl\n");
    let r = env.refused(&["--task", "u", "--approve"]);
    r.code(1);
    assert!(
        r.error_line()
            .starts_with("ERROR: This phase does not require approval"),
        "{r:?}"
    );
    // An approver id that would break the log's line format.
    env.drive("v", &["research", "research:awaiting_approval"]);
    for bad in ["a|b", "", "a b", "a\nb"] {
        env.refused(&["--task", "v", "--approve", "--approver", bad])
            .code(2);
    }
    assert_eq!(raw(&env, "v", ".state.approvals"), "");
}

#[test]
fn issue_bad_input_malformed_names_exit_2_for_every_command() {
    let env = Env::new();
    env.drive("real", &["research"]);
    env.artifact("real", "SPEC.md", "spec\n");
    let long = "a".repeat(300);
    for name in [
        "../x",
        "A_B",
        "",
        long.as_str(),
        "a/b/c",
        "real/../real",
        "/real",
    ] {
        let commands: Vec<Vec<&str>> = vec![
            vec!["--create-task", name],
            vec!["--task", name],
            vec!["--task", name, "--transition", "research"],
            vec!["--task", name, "--approve"],
            vec!["--validate-folder", "--task", name],
            vec!["--can-edit", "--task", name],
            vec!["--same-session", "--task", name],
            vec!["--upgrade", "--task", name],
            vec!["--scope-check", "--task", name, "--file", "src/x.rs"],
        ];
        for args in commands {
            let r = env.refused(&args);
            r.code(2);
            assert!(
                r.error_line().starts_with("ERROR: Invalid task name '"),
                "{args:?}: {r:?}"
            );
        }
    }
    assert!(!env.root().join(".automaton/x").exists());
    assert_eq!(env.state("real"), "research");
}

#[test]
fn issue_bad_input_corrupt_state() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    for bad in [
        "bogus",
        "",
        "Research",
        "research:done",
        "implement:approved",
    ] {
        set_state(&env, "t", bad);
        for args in [
            vec!["--task", "t"],
            vec!["--task", "t", "--transition", "research:awaiting_approval"],
            vec!["--task", "t", "--approve"],
            vec!["--validate-folder", "--task", "t"],
            vec!["--can-edit", "--task", "t"],
        ] {
            let r = env.refused(&args);
            r.code(2);
            assert!(
                r.error_line()
                    .starts_with(&format!("ERROR: Unknown phase '{bad}' in .state file")),
                "{bad:?} {args:?}: {r:?}"
            );
        }
        // --list names the error in the task's row and exits 2 (issue 14, item 10).
        let r = env.refused(&["--list"]);
        r.code(2);
        assert!(
            r.stdout
                .contains(&format!("ERROR: Unknown phase '{bad}' in .state file")),
            "{bad:?}: {r:?}"
        );
    }
}

#[test]
fn issue_bad_input_corrupt_state_lock() {
    let env = Env::new();
    env.drive("t", &["research"]);
    env.artifact("t", "SPEC.md", "spec\n");
    env.artifact("t", ".state.lock", "garbage\n");
    for args in [
        vec!["--task", "t", "--transition", "research:awaiting_approval"],
        vec!["--task", "t"],
    ] {
        let r = env.refused(&args);
        r.code(2);
        assert!(
            r.error_line().starts_with("ERROR: Corrupt lease file "),
            "{args:?}: {r:?}"
        );
    }
    assert_eq!(env.state("t"), "research");
}

#[test]
fn issue_bad_input_corrupt_state_approvals_from_approved() {
    let env = Env::new();
    env.drive(
        "t",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.artifact("t", ".state.approvals", "garbage\n");
    for args in [
        vec!["--task", "t", "--transition", "implement"],
        vec!["--task", "t", "--approve"],
        vec!["--task", "t"],
    ] {
        let r = env.refused(&args);
        r.code(2);
        assert!(
            r.error_line().starts_with("ERROR: Corrupt approvals log "),
            "{args:?}: {r:?}"
        );
        assert!(r.error_line().contains("line 1"), "{r:?}");
    }
    // A bad sha256 field is corrupt too.
    env.artifact(
        "t",
        ".state.approvals",
        "research:approved|2026-06-14T14:30:00Z|user|xyz\n",
    );
    env.refused(&["--task", "t", "--transition", "implement"])
        .code(2);
}

#[test]
fn ac_audit_exit_2_on_corrupt_approvals_without_claiming_a_pass() {
    let env = Env::new();
    env.drive(
        "t",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.artifact("t", ".state.approvals", "garbage\n");
    let r = env.status(&["--audit"]);
    r.code(2);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.starts_with("ERROR: t: Corrupt approvals log ")),
        "{r:?}"
    );
    // Category 2 could not be checked for this task: it must not say the task matches.
    assert_no_line_starting(&r.stdout, "[PASS] t: .state");
}

#[test]
fn issue_bad_input_corrupt_state_approvals_refuses_approve_from_awaiting() {
    let env = Env::new();
    env.drive("t", &["research", "research:awaiting_approval"]);
    env.artifact("t", ".state.approvals", "garbage\n");
    let r = env.refused(&["--task", "t", "--approve"]);
    r.code(2);
    assert!(
        r.error_line().starts_with("ERROR: Corrupt approvals log "),
        "{r:?}"
    );
    assert_eq!(raw(&env, "t", ".state.approvals"), "garbage\n");
    assert_eq!(env.state("t"), "research:awaiting_approval");
}

#[test]
fn issue_bad_input_leaves_files_byte_for_byte() {
    // One project holding tasks in many states; every refused command must leave it as is
    // (refused() compares the whole tree before and after).
    let env = Env::multi_agent();
    env.drive("awaiting", &["research", "research:awaiting_approval"]);
    env.drive(
        "approved",
        &[
            "research",
            "research:awaiting_approval",
            "research:approved",
        ],
    );
    env.drive("impl", TO_IMPLEMENT);
    env.drive("referee", TO_REFEREE);
    env.artifact("referee", "VERDICT.md", "no verdict here\n");
    env.drive("parent", &["research"]);
    env.create("parent/sub");
    env.write(".automaton/tasks/manual/SPEC.md", "spec\n");
    env.create("corrupt");
    set_state(&env, "corrupt", "bogus");
    env.create("bad-log");
    set_state(&env, "bad-log", "design:approved");
    env.artifact("bad-log", "SPEC.md", "spec\n");
    env.artifact("bad-log", "DESIGN.md", "design\n");
    env.artifact(
        "bad-log",
        ".state.approvals",
        "design:approved|not-a-time|user\n",
    );
    env.create("bad-lock");
    set_state(&env, "bad-lock", "research");
    env.artifact("bad-lock", "SPEC.md", "spec\n");
    env.artifact("bad-lock", ".state.lock", "agent: a\nphase: nowhere\n");
    let long = "x".repeat(300);
    let cases: Vec<Vec<&str>> = vec![
        vec!["--task", "ghost"],
        vec!["--task", "ghost", "--transition", "research"],
        vec!["--task", "awaiting", "--transition", "research:approved"],
        vec!["--task", "awaiting", "--transition", "implement"],
        vec!["--task", "approved", "--approve"],
        vec!["--task", "approved", "--transition", "bug_find"],
        vec!["--task", "impl", "--transition", "code_review"],
        vec!["--task", "impl", "--approve"],
        vec!["--task", "referee", "--transition", "complete"],
        vec![
            "--task",
            "parent",
            "--transition",
            "research:awaiting_approval",
        ],
        vec!["--task", "parent/sub", "--transition", "implement"],
        vec!["--task", "manual", "--transition", "research"],
        vec!["--task", "corrupt"],
        vec!["--task", "corrupt", "--transition", "research"],
        vec!["--task", "bad-log", "--transition", "implement"],
        vec!["--task", "bad-log", "--approve"],
        vec![
            "--task",
            "bad-lock",
            "--transition",
            "research:awaiting_approval",
        ],
        vec!["--create-task", "approved"],
        vec!["--create-task", "parent/sub"],
        vec!["--create-task", "ghost/sub"],
        vec!["--create-task", "../x"],
        vec!["--create-task", "A_B"],
        vec!["--create-task", ""],
        vec!["--create-task", long.as_str()],
        vec!["--create-task", "a/b/c"],
        vec!["--task", "../x", "--transition", "research"],
        vec!["--task", "approved", "--approve", "--approver", "a|b"],
        vec!["--validate-folder", "--task", "corrupt"],
        vec!["--task", "approved", "--transition", "nowhere"],
    ];
    for args in cases {
        env.refused(&args);
    }
}
