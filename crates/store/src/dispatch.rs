//! `.state.dispatch`: what a coordinator's dispatcher keeps of a task across its restarts —
//! why the task is held from dispatch (an operator's stop, `max_attempts`, seed 002's loop
//! limits), its failed runs per state, its completed runs, when its first run was offered,
//! the need a sub-task was first dispatched with, what its runs used against their estimates,
//! and its last runs (with the last 4 KiB of a failed run's output). Only a coordinator writes it, atomically and durably like every state
//! file; it is JSON, because its texts (reasons, details) are free.

use std::path::Path;

use automaton_workflow::{State, TaskName};
use serde::{Deserialize, Serialize};

use crate::fsx;
use crate::{Error, Project};

pub(crate) const DISPATCH: &str = ".state.dispatch";

/// The largest `.state.dispatch` read: a record holds a few reasons and ten runs, far less.
const MAX_DISPATCH_FILE: u64 = 1 << 20;

/// One task's dispatch record. Every field is optional on disk, so an older or newer
/// coordinator reads what it knows.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DispatchRecord {
    /// Why the task is held from dispatch; `None`: it is not.
    pub held: Option<String>,
    /// Failed runs per state, since the last resume.
    pub failures: Vec<(State, u32)>,
    /// Phases completed under a lease (seed 002's iterations), since the last resume.
    pub iterations: u32,
    /// When its first run was offered, in milliseconds since the Unix epoch.
    pub first_offered_ms: Option<u64>,
    /// The need (tokens) a sub-task was first dispatched with.
    pub need: Option<u64>,
    /// Σ estimated and Σ reported peak context (tokens) of its completed runs.
    pub sized: Option<(u64, u64)>,
    /// Its last runs, oldest first.
    pub runs: Vec<RunRecord>,
    /// Manual mode: an operator asked to run its next phase (`automaton run`), with who
    /// asked; used up when the phase's artifact moves the task on.
    pub run_requested: Option<String>,
    /// After a failed run: not offered again before this instant (milliseconds since the
    /// Unix epoch), and then to another worker before `retry_after`, the one that failed it.
    pub retry_until_ms: Option<u64>,
    pub retry_after: Option<String>,
    /// Times its code was sent back to implement because it could not land as reviewed (a
    /// conflicting merge into its parent's branch, or a delivery's).
    #[serde(skip_serializing_if = "is_zero")]
    pub reworks: u32,
    /// A rework decided and not yet carried out whole: the head it builds on, and why (kept
    /// first, so that a crash between its steps finishes it rather than merging the old code).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rework: Option<(String, String)>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A run as the coordinator shows it (`GetTask.runs`, `ListWorkers`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RunRecord {
    pub worker: String,
    pub phase: String,
    pub token: u64,
    pub state: String,
    pub stop_reason: String,
    pub detail: String,
    pub exit_code: i32,
    /// Milliseconds since the Unix epoch.
    pub started_ms: Option<u64>,
    pub ended_ms: Option<u64>,
    pub estimated_tokens: u64,
    pub peak_context_tokens: u64,
    pub why: String,
    pub peak_context_source: String,
    /// The last of a failed run's output, at most [`MAX_TAIL_KEPT`] bytes: the coordinator
    /// keeps the worker's full tail (16 KiB) in memory only, so ten runs stay far below the
    /// record's 1 MiB cap (even with every byte JSON-escaped six-fold).
    pub output_tail: String,
    /// What a person should know that did not fail the run, one line each.
    pub warnings: Vec<String>,
    /// The phase run's trace id (empty without trace export).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trace_id: String,
    /// The task branch's commit the run was served (what a review read).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub commit: String,
    /// The commit the run's own patch made on the task branch, the last if several.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub wrote: String,
}

/// How much of a run's output tail a record keeps.
pub const MAX_TAIL_KEPT: usize = 4 * 1024;

impl DispatchRecord {
    pub fn is_empty(&self) -> bool {
        self == &DispatchRecord::default()
    }
}

impl Project {
    /// `task`'s dispatch record; `Ok(None)` when it has none (or its folder is gone).
    pub fn read_dispatch(&self, task: &TaskName) -> Result<Option<DispatchRecord>, Error> {
        read_record(&self.meta, &self.task_dir(task).join(DISPATCH))
    }

    /// Replaces `task`'s dispatch record durably (temporary file, fsync, rename, directory
    /// fsync); an empty record removes the file. A task whose folder is gone has nothing to
    /// keep. No writer lock: only a coordinator writes this file, one write per task at a
    /// time, and no other command reads it to decide anything.
    pub fn write_dispatch(&self, task: &TaskName, record: &DispatchRecord) -> Result<(), Error> {
        let dir = self.task_dir(task);
        if !dir.is_dir() {
            return Ok(());
        }
        let path = dir.join(DISPATCH);
        if record.is_empty() {
            return self.remove_durably(&path);
        }
        let bytes = serde_json::to_vec_pretty(record).map_err(|e| Error::CorruptDispatch {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        self.write(&path, &bytes)
    }
}

fn read_record(root: &Path, path: &Path) -> Result<Option<DispatchRecord>, Error> {
    let Some(bytes) = fsx::read_capped(root, path, MAX_DISPATCH_FILE)? else {
        return Ok(None);
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| Error::CorruptDispatch {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::project::tests::{name, project};

    fn record() -> DispatchRecord {
        DispatchRecord {
            held: Some("stopped by an operator (ops)\nsecond line \"quoted\"".into()),
            failures: vec![("research".parse().expect("state"), 2)],
            iterations: 3,
            first_offered_ms: Some(1_700_000_000_123),
            need: Some(12_000),
            sized: Some((u64::MAX, 0)),
            runs: vec![RunRecord {
                worker: "gpu-a".into(),
                phase: "research".into(),
                token: u64::MAX,
                state: "stopped".into(),
                stop_reason: "agent_error".into(),
                detail: "exit status 1\t…".into(),
                exit_code: -1,
                started_ms: Some(1),
                ended_ms: None,
                ..RunRecord::default()
            }],
            run_requested: Some("ops".into()),
            retry_until_ms: Some(u64::MAX),
            retry_after: Some("gpu-a".into()),
            reworks: u32::MAX,
            rework: Some(("b".repeat(40), "why \"quoted\"\nline".into())),
        }
    }

    #[test]
    fn a_dispatch_record_round_trips_and_an_empty_one_removes_the_file() {
        let (_d, p) = project();
        let t = name("t");
        p.create_task(&t).expect("create");
        assert_eq!(p.read_dispatch(&t).expect("read"), None);
        let r = record();
        p.write_dispatch(&t, &r).expect("write");
        assert_eq!(p.read_dispatch(&t).expect("read"), Some(r));
        p.write_dispatch(&t, &DispatchRecord::default())
            .expect("write empty");
        assert!(!p.task_dir(&t).join(DISPATCH).exists());
        assert_eq!(p.read_dispatch(&t).expect("read"), None);
        // Nothing is left in the temporary folder.
        let tmp: Vec<_> = fs::read_dir(p.tmp_dir())
            .map(|d| d.flatten().collect())
            .unwrap_or_default();
        assert!(tmp.is_empty(), "{tmp:?}");
    }

    #[test]
    fn a_corrupt_or_huge_dispatch_record_is_an_error_naming_the_file() {
        let (_d, p) = project();
        let t = name("t");
        p.create_task(&t).expect("create");
        let path = p.task_dir(&t).join(DISPATCH);
        for bad in [
            "{".to_string(),
            r#"{"failures": [["no-such-phase", 1]]}"#.to_string(),
            r#"{"iterations": -1}"#.to_string(),
            format!(
                "{{\"held\": \"{}\"}}",
                "x".repeat(MAX_DISPATCH_FILE as usize)
            ),
        ] {
            fs::write(&path, &bad).expect("write");
            let e = p.read_dispatch(&t).expect_err("corrupt");
            assert!(
                matches!(e.kind(), crate::ErrorKind::Corrupt | crate::ErrorKind::Io),
                "{e}"
            );
            assert!(e.to_string().contains(".state.dispatch"), "{e}");
        }
        // Unknown fields (a newer coordinator's) are ignored.
        fs::write(&path, r#"{"iterations": 2, "later": true}"#).expect("write");
        assert_eq!(
            p.read_dispatch(&t).expect("read").map(|r| r.iterations),
            Some(2)
        );
    }

    #[test]
    fn writing_the_record_of_a_task_whose_folder_is_gone_keeps_nothing() {
        let (_d, p) = project();
        let t = name("gone");
        p.write_dispatch(&t, &record()).expect("nothing to keep");
        assert!(!p.task_dir(&t).exists());
    }
}
