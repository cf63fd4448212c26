//! `status --audit`: the four categories of 004 §11 across every task of a project.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use automaton_workflow::{
    Artifact, Finding, Severity, State, TaskName, check_consistency, out_of_order,
};
use serde::{Deserialize, Serialize};

use crate::{Error, Project, Unaddressable};

/// One task's findings in categories 1, 2 and 4.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditTask {
    pub task: TaskName,
    pub state: Option<State>,
    pub tracked: bool,
    pub present: Vec<Artifact>,
    pub out_of_order: Vec<Artifact>,
    pub consistency: Vec<Finding>,
    /// The task could not be read (corrupt `.state`, …): the audit exits 2.
    pub error: Option<String>,
}

/// A commit that changed code while a task was in a phase that forbids code edits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Modification {
    pub task: TaskName,
    pub state: State,
    pub path: String,
    pub commit: String,
    pub commit_time: String,
    /// `false` when another task was in an edit phase at audit time, so the change may be
    /// its: reported as a warning, not a violation.
    pub attributed: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Category3 {
    Skipped {
        reason: String,
    },
    Checked {
        /// The tasks that were in a no-edit phase and so were checked.
        checked: Vec<TaskName>,
        modifications: Vec<Modification>,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditReport {
    pub project: PathBuf,
    pub tasks: Vec<AuditTask>,
    pub category3: Category3,
    /// One line per violation, as the summary lists them.
    pub violations: Vec<String>,
    pub errors: Vec<String>,
    /// Folders under the tasks folder whose names no command can address (Category 4).
    #[serde(default)]
    pub unaddressable: Vec<Unaddressable>,
}

impl AuditReport {
    /// 0 clean, 1 violations, 2 error (004 §11).
    pub fn exit_code(&self) -> i32 {
        if !self.errors.is_empty() {
            2
        } else if !self.violations.is_empty() {
            1
        } else {
            0
        }
    }
}

impl Project {
    pub fn audit(&self) -> Result<AuditReport, Error> {
        let mut tasks = Vec::new();
        let mut violations = Vec::new();
        let mut errors = Vec::new();
        let mut mtimes = Vec::new();
        for t in self.all_task_names()? {
            let folder = match self.folder(&t) {
                Ok(f) => f,
                Err(e) => {
                    errors.push(format!("{t}: {e}"));
                    tasks.push(AuditTask {
                        task: t,
                        state: None,
                        tracked: false,
                        present: vec![],
                        out_of_order: vec![],
                        consistency: vec![],
                        error: Some(e.to_string()),
                    });
                    continue;
                }
            };
            let mut facts = folder.facts();
            let mut entry = AuditTask {
                task: t.clone(),
                state: folder.state,
                tracked: folder.state.is_some(),
                present: facts.present.clone(),
                out_of_order: vec![],
                consistency: vec![],
                error: None,
            };
            match folder.state {
                None => violations.push(format!(
                    "{t}: manually created task folder (no .state file)"
                )),
                Some(state) => {
                    entry.out_of_order = out_of_order(state, &facts.present);
                    for a in &entry.out_of_order {
                        violations.push(format!("{t}: out-of-order artifact ({a})"));
                    }
                    let record = self.approved_phases(&folder).and_then(|approved| {
                        facts.approved = approved;
                        self.approval_record(&t, &folder, state)
                    });
                    match record {
                        Ok(record) => entry.consistency = check_consistency(state, &facts, record),
                        Err(e) => {
                            errors.push(format!("{t}: {e}"));
                            entry.error = Some(e.to_string());
                        }
                    }
                    for f in entry
                        .consistency
                        .iter()
                        .filter(|f| f.severity == Severity::Fail)
                    {
                        violations.push(format!("{t}: state-artifact mismatch ({})", f.message));
                    }
                    if let Some(m) = self.state_mtime(&folder) {
                        mtimes.push((t.clone(), state, m));
                    }
                }
            }
            tasks.push(entry);
        }
        let unaddressable = self.unaddressable()?;
        for u in &unaddressable {
            violations.push(format!(
                "{}: invalid task folder name ({}; {})",
                u.folder,
                u.why,
                u.advice()
            ));
        }
        let category3 = match git_modifications(self.root(), self.meta(), &mtimes) {
            Ok(c) => c,
            Err(e) => {
                errors.push(format!("git: {e}"));
                Category3::Skipped {
                    reason: format!("git history could not be read ({e})"),
                }
            }
        };
        if let Category3::Checked { modifications, .. } = &category3 {
            for m in modifications.iter().filter(|m| m.attributed) {
                violations.push(format!(
                    "{}: unauthorized modification ({} during {} phase)",
                    m.task, m.path, m.state
                ));
            }
        }
        Ok(AuditReport {
            project: self.root().to_path_buf(),
            tasks,
            category3,
            violations,
            errors,
            unaddressable,
        })
    }
}

/// Category 3 (004's heuristic): a commit after a task's last transition (`.state` mtime)
/// that changed a file outside the task store, while the task is in a phase that forbids
/// code edits. Without per-task attribution in git, a change made while another task is in
/// `implement`/`doc_review` may be that task's, so it is only a warning then.
fn git_modifications(
    root: &Path,
    meta: &Path,
    tasks: &[(TaskName, State, SystemTime)],
) -> Result<Category3, git2::Error> {
    let repo = match git2::Repository::discover(root) {
        Ok(r) => r,
        Err(_) => {
            return Ok(Category3::Skipped {
                reason: "not a git repository".into(),
            });
        }
    };
    let Some(workdir) = repo.workdir().and_then(|w| std::fs::canonicalize(w).ok()) else {
        return Ok(Category3::Skipped {
            reason: "bare git repository".into(),
        });
    };
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let prefix = root
        .strip_prefix(&workdir)
        .unwrap_or(Path::new(""))
        .to_path_buf();
    let meta_rel = std::fs::canonicalize(meta)
        .ok()
        .and_then(|m| m.strip_prefix(&root).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from(".automaton"));
    let editing = tasks.iter().any(|(_, s, _)| s.phase.allows_code_edits());
    let checked: Vec<&(TaskName, State, SystemTime)> = tasks
        .iter()
        .filter(|(_, s, _)| {
            !s.phase.allows_code_edits()
                && !s.is_terminal()
                && s.phase != automaton_workflow::Phase::New
        })
        .collect();
    let mut modifications = Vec::new();
    let Some(since) = checked.iter().map(|(_, _, m)| *m).min() else {
        return Ok(Category3::Checked {
            checked: vec![],
            modifications,
        });
    };
    let since_secs = secs(since);
    let mut walk = repo.revwalk()?;
    if walk.push_head().is_err() {
        // An unborn HEAD: no commits, nothing modified.
        return Ok(Category3::Checked {
            checked: checked.iter().map(|c| c.0.clone()).collect(),
            modifications,
        });
    }
    walk.set_sorting(git2::Sort::TIME)?;
    for oid in walk {
        let commit = repo.find_commit(oid?)?;
        let when = commit.time().seconds();
        if when <= since_secs {
            break;
        }
        let tree = commit.tree()?;
        let parent_tree = match commit.parent(0) {
            Ok(p) => Some(p.tree()?),
            Err(_) => None,
        };
        let diff = repo.diff_tree_to_tree(parent_tree.as_ref(), Some(&tree), None)?;
        let mut paths = Vec::new();
        for d in diff.deltas() {
            let Some(path) = d.new_file().path().or_else(|| d.old_file().path()) else {
                continue;
            };
            let Ok(rel) = path.strip_prefix(&prefix) else {
                continue;
            };
            if rel.starts_with(&meta_rel) || rel == Path::new(".agent.md") {
                continue;
            }
            paths.push(rel.display().to_string());
        }
        for (task, state, mtime) in &checked {
            if when <= secs(*mtime) {
                continue;
            }
            for p in &paths {
                modifications.push(Modification {
                    task: task.clone(),
                    state: *state,
                    path: p.clone(),
                    commit: oid_short(&commit),
                    commit_time: crate::format_time(
                        UNIX_EPOCH + Duration::from_secs(when.max(0) as u64),
                    ),
                    attributed: !editing,
                });
            }
        }
    }
    Ok(Category3::Checked {
        checked: checked.iter().map(|c| c.0.clone()).collect(),
        modifications,
    })
}

fn secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

fn oid_short(c: &git2::Commit<'_>) -> String {
    c.id().to_string().chars().take(10).collect()
}
