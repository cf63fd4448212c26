//! The store's writer locks, across real processes. Every writer of a task holds the
//! project's lock (`.automaton/`) shared and the task's folder exclusively through its syncs;
//! a command that changes the project's shape holds the project's lock exclusively; a
//! parent's `complete` reads each sub-task under its lock. The test process plays the other
//! writer by taking the same flocks, and watches the command wait in the kernel's lock wait.

use std::fs::File;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::harness::{Env, TO_DECOMPOSED, TO_REFEREE};

/// A lock the test holds, as a writer in flight would.
fn hold(path: &Path, shared: bool) -> File {
    let f = File::open(path).expect("open for locking");
    if shared {
        fs4::FileExt::lock_shared(&f).expect("lock shared");
    } else {
        fs4::FileExt::lock(&f).expect("lock");
    }
    f
}

fn spawn(env: &Env, args: &[&str]) -> Child {
    env.command(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn automaton")
}

/// Waits until `child` sleeps in the kernel's file-lock wait (`/proc/PID/wchan`), proving it
/// waits for the lock the test holds. Panics when it exits first. Where wchan cannot be
/// read, being alive after a second is taken as waiting.
fn waits_for_a_lock(child: &mut Child, what: &str) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("{what}: finished ({status}) instead of waiting for the lock");
        }
        match std::fs::read_to_string(format!("/proc/{}/wchan", child.id())) {
            Ok(w) if w.contains("lock") => return,
            Ok(w) if (w.is_empty() || w == "0") && start.elapsed() > Duration::from_secs(1) => {
                return;
            }
            _ => {}
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{what}: never waited for the lock"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for `child` to end and asserts it succeeded.
fn succeeds(mut child: Child, what: &str) {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                std::io::Read::read_to_string(&mut e, &mut err).ok();
            }
            assert!(status.success(), "{what}: {status}: {err}");
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{what}: still running after 30 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn two_tasks_in_research() -> Env {
    let env = Env::new();
    for t in ["a", "b"] {
        env.drive(t, &["research"]);
        env.artifact(t, "SPEC.md", "content\n");
    }
    env
}

#[test]
fn lock_writes_to_one_task_do_not_wait_for_a_write_to_another() {
    let env = two_tasks_in_research();
    let meta = env.root().join(".automaton");
    // A writer of `a` in flight, between its write and its last sync.
    let project = hold(&meta, true);
    let a = hold(&env.task_dir("a"), false);
    // `b` moves on meanwhile.
    succeeds(
        spawn(
            &env,
            &["--task", "b", "--transition", "research:awaiting_approval"],
        ),
        "a move of b while a is being written",
    );
    assert_eq!(env.state("b"), "research:awaiting_approval");
    // `a` waits for its writer, then moves.
    let mut child = spawn(
        &env,
        &["--task", "a", "--transition", "research:awaiting_approval"],
    );
    waits_for_a_lock(&mut child, "a move of a while a is being written");
    assert_eq!(env.state("a"), "research", "nothing written while it waits");
    drop(a);
    drop(project);
    succeeds(child, "a move of a once its writer is done");
    assert_eq!(env.state("a"), "research:awaiting_approval");
}

#[test]
fn lock_creating_a_task_waits_for_task_writes_in_flight_and_they_wait_for_it() {
    let env = two_tasks_in_research();
    let meta = env.root().join(".automaton");
    // A writer of `a` in flight: a new task waits until it is done.
    let project = hold(&meta, true);
    let a = hold(&env.task_dir("a"), false);
    let mut create = spawn(&env, &["--create-task", "c"]);
    waits_for_a_lock(&mut create, "a create while a task is being written");
    assert!(
        !env.task_dir("c").exists(),
        "nothing created while it waits"
    );
    drop(a);
    drop(project);
    succeeds(create, "the create once the write is done");
    assert_eq!(env.state("c"), "new");
    // A change of the project's shape in flight: task writes wait for it.
    let whole = hold(&meta, false);
    let mut moved = spawn(
        &env,
        &["--task", "b", "--transition", "research:awaiting_approval"],
    );
    waits_for_a_lock(&mut moved, "a move while the project is locked whole");
    drop(whole);
    succeeds(moved, "the move once the project is unlocked");
    assert_eq!(env.state("b"), "research:awaiting_approval");
}

#[test]
fn lock_a_subtask_is_created_under_its_parents_lock_alone() {
    let env = two_tasks_in_research();
    let meta = env.root().join(".automaton");
    let project = hold(&meta, true);
    let a = hold(&env.task_dir("a"), false);
    // Another parent's sub-task is created meanwhile …
    succeeds(
        spawn(&env, &["--create-task", "b/sub"]),
        "a sub-task of b while a is being written",
    );
    assert_eq!(env.state("b/sub"), "new");
    // … and one of `a` waits for a's writer.
    let mut child = spawn(&env, &["--create-task", "a/sub"]);
    waits_for_a_lock(&mut child, "a sub-task of a while a is being written");
    assert!(!env.task_dir("a/sub").exists());
    drop(a);
    drop(project);
    succeeds(child, "a sub-task of a once its writer is done");
    assert_eq!(env.state("a/sub"), "new");
}

#[test]
fn lock_a_parent_completes_only_after_reading_each_subtask_under_its_lock() {
    let env = Env::new();
    env.drive("parent", TO_DECOMPOSED);
    env.drive("parent/sub-a", TO_REFEREE);
    env.drive("parent/sub-a", &["complete"]);
    // The sub-task's writer is still syncing its move to `complete`: the parent's move,
    // which depends on it, waits until that move is durable.
    let sub = hold(&env.task_dir("parent/sub-a"), false);
    let mut child = spawn(&env, &["--task", "parent", "--transition", "complete"]);
    waits_for_a_lock(
        &mut child,
        "the parent's complete while its sub-task is written",
    );
    assert_eq!(env.state("parent"), "decomposition:approved");
    drop(sub);
    succeeds(child, "the parent's complete once the sub-task is written");
    assert_eq!(env.state("parent"), "complete");
}

#[test]
fn lock_a_killed_writers_leftovers_are_swept_by_the_next_command_that_writes() {
    let env = two_tasks_in_research();
    let tmp = env.root().join(".automaton/tmp");
    // A writer killed mid-write (a pid that cannot exist) left a file and a sub-task folder
    // being built; a live process (pid 1) has work in progress.
    let dead_file = tmp.join("4194303999.7..state.tmp");
    let dead_dir = tmp.join("4194303999.8.create-sub.tmp");
    let live = tmp.join("1.9..state.tmp");
    std::fs::create_dir_all(&dead_dir).expect("mkdir");
    std::fs::write(dead_dir.join(".state"), "new\n").expect("write");
    std::fs::write(&dead_file, "research\n").expect("write");
    std::fs::write(&live, "research\n").expect("write");
    succeeds(
        spawn(
            &env,
            &["--task", "a", "--transition", "research:awaiting_approval"],
        ),
        "a task move",
    );
    assert!(
        !dead_file.exists(),
        "a dead writer's temporary file is swept"
    );
    assert!(!dead_dir.exists(), "a dead writer's folder is swept");
    assert!(live.exists(), "a live writer's work is left alone");
}

/// Waits (at most 20 s) for `child`; its status and stderr. Kills it and panics when it
/// blocks.
fn finishes(mut child: Child, what: &str) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: blocked for 20 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        std::io::Read::read_to_string(&mut e, &mut err).ok();
    }
    (status, err)
}

#[test]
fn lock_a_fifo_in_a_tasks_place_is_not_found_and_never_blocks() {
    let env = two_tasks_in_research();
    // Opening a FIFO for reading blocks until a writer comes: the lock must not open it.
    let fifo = env.root().join(".automaton/tasks/pipe");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let child = spawn(
        &env,
        &[
            "--task",
            "pipe",
            "--transition",
            "research:awaiting_approval",
        ],
    );
    let (status, err) = finishes(child, "a move of a FIFO");
    assert!(!status.success());
    assert!(err.contains("not found"), "{err}");
}

#[test]
fn lock_a_task_folder_linked_to_the_project_folder_is_refused_naming_the_link_and_never_blocks() {
    let env = two_tasks_in_research();
    // `tasks/evil -> ..`: locking it would take `.automaton/` exclusively while holding it
    // shared, and wait for itself forever (holding up every create).
    std::os::unix::fs::symlink("..", env.root().join(".automaton/tasks/evil")).expect("link");
    let child = spawn(
        &env,
        &[
            "--task",
            "evil",
            "--transition",
            "research:awaiting_approval",
        ],
    );
    let (status, err) = finishes(child, "a move of a linked folder");
    assert!(!status.success());
    // Issue 20: a link under .automaton/ is refused by name (it is no task), not "not found".
    assert!(err.contains("tasks/evil is a symbolic link"), "{err}");
    let (status, err) = finishes(spawn(&env, &["--create-task", "c"]), "a create after it");
    assert!(status.success(), "{err}");
}

#[test]
fn lock_a_fifo_in_place_of_a_state_file_is_refused_and_blocks_nobody() {
    let env = two_tasks_in_research();
    env.status(&["--task", "a", "--transition", "research:awaiting_approval"])
        .ok();
    let log = env.task_dir("a").join(".state.approvals");
    std::fs::remove_file(&log).expect("remove the log");
    let made = std::process::Command::new("mkfifo")
        .arg(&log)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let (status, err) = finishes(spawn(&env, &["--task", "a", "--approve"]), "an approve");
    assert!(!status.success());
    assert!(err.contains("not a regular file"), "{err}");
    // Nothing is held up: another task moves, a task is created.
    let (status, err) = finishes(
        spawn(
            &env,
            &["--task", "b", "--transition", "research:awaiting_approval"],
        ),
        "a move of b",
    );
    assert!(status.success(), "{err}");
    let (status, err) = finishes(spawn(&env, &["--create-task", "c"]), "a create");
    assert!(status.success(), "{err}");
}

#[test]
fn lock_a_subtask_is_written_only_while_its_parent_is_not_being_changed() {
    let env = two_tasks_in_research();
    env.create("a/sub");
    // The parent's writer (creating sub-tasks not yet synced, or moving the parent to
    // complete) holds the parent's folder: the sub-task's move waits for it.
    let parent = hold(&env.task_dir("a"), false);
    let mut child = spawn(&env, &["--task", "a/sub", "--transition", "research"]);
    waits_for_a_lock(&mut child, "a sub-task move while its parent is written");
    assert_eq!(env.state("a/sub"), "new");
    drop(parent);
    succeeds(child, "the sub-task move once the parent is done");
    assert_eq!(env.state("a/sub"), "research");
}
