//! Starts the real `automaton` binary on a throw-away project.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const BIN: &str = env!("CARGO_BIN_EXE_automaton");

/// A project folder and a HOME folder, both removed on drop.
pub struct Env {
    pub project: tempfile::TempDir,
    pub home: tempfile::TempDir,
}

#[path = "../common/run.rs"]
mod run;
pub use run::Run;

impl Env {
    pub fn new() -> Env {
        Env {
            project: tempfile::tempdir().expect("project tempdir"),
            home: tempfile::tempdir().expect("home tempdir"),
        }
    }

    /// A project with `Mode: multi-agent` in its `.agent.md`.
    pub fn multi_agent() -> Env {
        let env = Env::new();
        env.write(
            ".automaton/.agent.md",
            "# Agent config\n- **Mode**: multi-agent\n",
        );
        env
    }

    pub fn root(&self) -> &Path {
        self.project.path()
    }

    pub fn task_dir(&self, task: &str) -> PathBuf {
        let mut p = self.root().join(".automaton/tasks");
        match task.split_once('/') {
            Some((parent, sub)) => p.extend([parent, "subtasks", sub]),
            None => p.push(task),
        }
        p
    }

    /// A `Command` for `automaton status ARGS --project ROOT`, with HOME isolated.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.arg("status").args(args).arg("--project").arg(self.root());
        c.env("HOME", self.home.path())
            .env_remove("AUTOMATON_COORDINATOR")
            .current_dir(self.root());
        c
    }

    /// Runs `automaton status ARGS --project ROOT`.
    pub fn status(&self, args: &[&str]) -> Run {
        Run::from(self.command(args).output().expect("run automaton"))
    }

    /// Runs `python3 deploy/status.py ARGS --project ROOT` (the shim prompts call), with the
    /// binary under test as `AUTOMATON_BIN`.
    pub fn shim(&self, args: &[&str]) -> Run {
        let out = Command::new("python3")
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../deploy/status.py"
            ))
            .args(args)
            .arg("--project")
            .arg(self.root())
            .env("AUTOMATON_BIN", BIN)
            .env("HOME", self.home.path())
            .env_remove("AUTOMATON_COORDINATOR")
            .current_dir(self.root())
            .output()
            .expect("python3 must be installed to run the status.py shim");
        Run::from(out)
    }

    /// Writes a file relative to the project root, creating folders.
    pub fn write(&self, rel: &str, content: &str) {
        let p = self.root().join(rel);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(p, content).expect("write");
    }

    /// Writes an artifact (or any file) into a task folder.
    pub fn artifact(&self, task: &str, name: &str, content: &str) {
        fs::write(self.task_dir(task).join(name), content).expect("write artifact");
    }

    pub fn state(&self, task: &str) -> String {
        fs::read_to_string(self.task_dir(task).join(".state"))
            .expect("read .state")
            .trim()
            .to_string()
    }

    pub fn create(&self, task: &str) {
        self.status(&["--create-task", task]).ok();
    }

    /// Creates a task and drives it to `target` through the real commands, writing a
    /// one-line artifact for each phase it passes and approving every gate.
    pub fn drive(&self, task: &str, path: &[&str]) {
        if !self.task_dir(task).exists() {
            self.create(task);
        }
        for step in path {
            if step.ends_with(":approved") {
                self.status(&["--task", task, "--approve"]).ok();
                continue;
            }
            let current = self.state(task);
            let phase = current.split(':').next().unwrap_or("").to_string();
            if let Some(a) = artifact_of(&phase)
                && !self.task_dir(task).join(a).exists()
            {
                let body = if a == "VERDICT.md" {
                    "Verdict: PASS\n"
                } else {
                    "content\n"
                };
                self.artifact(task, a, body);
            }
            self.status(&["--task", task, "--transition", step]).ok();
        }
    }

    /// Every file under the project (path → bytes): compared before and after a refused
    /// command to prove nothing changed.
    pub fn snapshot(&self) -> BTreeMap<PathBuf, Vec<u8>> {
        fn walk(dir: &Path, base: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
            let Ok(entries) = fs::read_dir(dir) else {
                return;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    out.insert(
                        p.strip_prefix(base).expect("under base").join(""),
                        Vec::new(),
                    );
                    walk(&p, base, out);
                } else {
                    out.insert(
                        p.strip_prefix(base).expect("under base").to_path_buf(),
                        fs::read(&p).expect("read"),
                    );
                }
            }
        }
        let mut out = BTreeMap::new();
        walk(self.root(), self.root(), &mut out);
        out
    }

    /// Runs a command that must be refused: non-zero exit, a one-line `ERROR:` first line,
    /// and every file under the project byte-for-byte unchanged. Returns the run.
    pub fn refused(&self, args: &[&str]) -> Run {
        let before = self.snapshot();
        let run = self.status(args);
        assert_ne!(run.code, 0, "{args:?} should be refused: {run:?}");
        assert!(
            run.error_line().starts_with("ERROR: "),
            "{args:?}: first line must be the error: {run:?}"
        );
        let after = self.snapshot();
        assert!(before == after, "{args:?} changed files although refused");
        run
    }
}

/// The artifact a phase produces.
pub fn artifact_of(phase: &str) -> Option<&'static str> {
    Some(match phase {
        "research" => "SPEC.md",
        "decomposition" => "DECOMPOSITION.md",
        "design" => "DESIGN.md",
        "test_design" => "TEST_PLAN.md",
        "implement" => "IMPLEMENTATION.md",
        "code_review" => "CODE_REVIEW.md",
        "bug_find" => "BUG_REPORT.md",
        "adversarial_bug_find" => "ADVERSARIAL_BUG_REPORT.md",
        "doc_review" => "DOC_REVIEW.md",
        "referee" => "VERDICT.md",
        _ => return None,
    })
}

/// From `new` to `referee` through every mandatory phase (seed 001's code_review included).
/// A parent's path to an approved decomposition (its sub-tasks may then run).
pub const TO_DECOMPOSED: &[&str] = &[
    "research",
    "research:awaiting_approval",
    "research:approved",
    "decomposition",
    "decomposition:awaiting_approval",
    "decomposition:approved",
];

pub const TO_REFEREE: &[&str] = &[
    "research",
    "research:awaiting_approval",
    "research:approved",
    "implement",
    "code_review",
    "code_review:awaiting_approval",
    "code_review:approved",
    "bug_find",
    "adversarial_bug_find",
    "doc_review",
    "referee",
];

/// The path from `new` to `implement` through research and its approval.
pub const TO_IMPLEMENT: &[&str] = &[
    "research",
    "research:awaiting_approval",
    "research:approved",
    "implement",
];
