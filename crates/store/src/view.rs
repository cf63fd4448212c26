//! What the status reads show: `status --task` (`TaskView`), `--list` (`ListEntry`,
//! `Listing`) and `--validate-folder` (`FolderReport`, `ProjectFolders`), built from the
//! reads in `read.rs`. Nothing here writes or renders: callers print what it returns.

use std::path::PathBuf;
use std::time::SystemTime;

use automaton_workflow::{
    AgentId, ApprovalRecord, Artifact, Guidance, State, TaskName, guidance, infer_state,
    out_of_order,
};
use serde::{Deserialize, Serialize};

use crate::parents::SubtaskVerdicts;
use crate::project::STATE;
use crate::records::{Approval, Lease};
use crate::{ArtifactInfo, Error, Project, Unaddressable};

/// Where a gated phase stands with its approval.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ApprovalView {
    /// The phase is open: its artifact needs a person's sign-off once written.
    Required {
        artifact: Artifact,
    },
    Awaiting {
        artifact: Artifact,
    },
    Approved {
        artifact: Artifact,
        record: Option<Approval>,
        stale: bool,
    },
}

/// Everything `status --task` shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskView {
    pub task: TaskName,
    pub state_file: PathBuf,
    /// `.state` exists; otherwise `state` is the artifact heuristic's guess.
    pub tracked: bool,
    /// `None`: untracked and no artifact to guess from ("unknown").
    pub state: Option<State>,
    pub parent: Option<(TaskName, Option<State>)>,
    pub artifacts: Vec<ArtifactInfo>,
    pub approval: Option<ApprovalView>,
    /// The live lease, if any.
    pub lease: Option<Lease>,
    pub implementers: Vec<AgentId>,
    pub subtasks: Vec<TaskName>,
    pub guidance: Option<Guidance>,
    /// A decomposed parent's sub-tasks' verdicts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdicts: Option<SubtaskVerdicts>,
    /// Seed 002's `⚠️ **HUMAN INTERVENTION REQUIRED**: {reason}`, when the task needs a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListEntry {
    pub task: TaskName,
    pub state: Option<State>,
    pub tracked: bool,
    pub next: Vec<State>,
    pub approval_stale: bool,
    /// An `:approved` state with no record in `.state.approvals` (written by hand).
    #[serde(default)]
    pub approval_missing: bool,
    pub lease_holder: Option<AgentId>,
    pub subtasks: Vec<ListEntry>,
    /// The task could not be read (a corrupt `.state`, …): the other rows are still listed,
    /// and `--list` exits 2.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A decomposed parent's sub-tasks' verdicts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verdicts: Option<SubtaskVerdicts>,
    /// Seed 002's `⚠️ **HUMAN INTERVENTION REQUIRED**: {reason}`, when the task needs a person.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<String>,
}

impl ListEntry {
    /// This row and its sub-tasks' rows.
    pub fn rows(&self) -> impl Iterator<Item = &ListEntry> {
        std::iter::once(self).chain(self.subtasks.iter())
    }
}

/// `--list`: every task, and the folders no command can address.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Listing {
    pub tasks: Vec<ListEntry>,
    pub unaddressable: Vec<Unaddressable>,
}

impl Listing {
    /// 2 when a task could not be read, else 0.
    pub fn exit_code(&self) -> i32 {
        if self
            .tasks
            .iter()
            .flat_map(ListEntry::rows)
            .any(|e| e.error.is_some())
        {
            2
        } else {
            0
        }
    }
}

/// A task a whole-project command could not read.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskError {
    pub task: TaskName,
    pub error: String,
}

/// `--validate-folder` without `--task`: one report per task and sub-task.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProjectFolders {
    pub reports: Vec<FolderReport>,
    pub errors: Vec<TaskError>,
    pub unaddressable: Vec<Unaddressable>,
}

impl ProjectFolders {
    pub fn passed(&self) -> bool {
        self.errors.is_empty()
            && self.unaddressable.is_empty()
            && self.reports.iter().all(FolderReport::passed)
    }

    /// As with `--task`: 0 PASS, 1 FAIL, 2 a task could not be read.
    pub fn exit_code(&self) -> i32 {
        if !self.errors.is_empty() {
            2
        } else if self.passed() {
            0
        } else {
            1
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FolderReport {
    pub task: TaskName,
    pub state: Option<State>,
    pub tracked: bool,
    pub out_of_order: Vec<Artifact>,
}

impl FolderReport {
    pub fn passed(&self) -> bool {
        self.tracked && self.out_of_order.is_empty()
    }
}

impl Project {
    /// `status --task`.
    pub fn view(&self, task: &TaskName, now: SystemTime) -> Result<TaskView, Error> {
        let folder = self.folder(task)?;
        let tracked = folder.state.is_some();
        let state = folder
            .state
            .or_else(|| infer_state(&folder.facts().present));
        let parent = match task.parent() {
            Some(p) => {
                let pf = self.folder(&p)?;
                Some((p, pf.state))
            }
            None => None,
        };
        let approval = match state {
            Some(s) if s.phase.is_gated() => {
                let artifact = s.phase.artifact().expect("gated phases have artifacts");
                Some(match s.gate {
                    automaton_workflow::Gate::Open => ApprovalView::Required { artifact },
                    automaton_workflow::Gate::AwaitingApproval => {
                        ApprovalView::Awaiting { artifact }
                    }
                    automaton_workflow::Gate::Approved => {
                        let log = self.approvals(&folder.dir)?;
                        let (record, status) =
                            self.approval_status(task, &folder.dir, s.phase, &log)?;
                        ApprovalView::Approved {
                            artifact,
                            record,
                            stale: status == ApprovalRecord::Stale,
                        }
                    }
                })
            }
            _ => None,
        };
        let lease = self.lease(&folder.dir)?.filter(|l| l.is_live(now));
        let subtasks = if task.is_subtask() {
            Vec::new()
        } else {
            self.subtask_names(task)?
        };
        let standing = self.parent_standing(task, state)?;
        let attention = self.attention(task, state, standing.as_ref());
        Ok(TaskView {
            verdicts: standing.map(|s| s.verdicts),
            attention,
            task: task.clone(),
            state_file: folder.dir.join(STATE),
            tracked,
            state,
            parent,
            approval,
            lease,
            implementers: self.implementers(&folder.dir)?,
            subtasks,
            guidance: state.map(|s| guidance(&task.to_string(), s)),
            artifacts: folder.artifacts,
        })
    }

    fn list_entry(&self, t: &TaskName, now: SystemTime) -> Result<ListEntry, Error> {
        let folder = self.folder(t)?;
        let state = folder
            .state
            .or_else(|| infer_state(&folder.facts().present));
        let approval = match folder.state {
            Some(s) if s.is_approved() => {
                let log = self.approvals(&folder.dir)?;
                Some(self.approval_status(t, &folder.dir, s.phase, &log)?.1)
            }
            _ => None,
        };
        let standing = self.parent_standing(t, state)?;
        let attention = self.attention(t, state, standing.as_ref());
        Ok(ListEntry {
            verdicts: standing.map(|s| s.verdicts),
            attention,
            task: t.clone(),
            tracked: folder.state.is_some(),
            next: state.map(State::legal_targets).unwrap_or_default(),
            state,
            approval_stale: approval == Some(ApprovalRecord::Stale),
            approval_missing: approval == Some(ApprovalRecord::Missing),
            lease_holder: self
                .lease(&folder.dir)?
                .filter(|l| l.is_live(now))
                .map(|l| l.agent),
            subtasks: Vec::new(),
            error: None,
        })
    }

    /// `status --list`: every task, sub-tasks under their parent. A task that cannot be read
    /// is still a row, carrying its error.
    pub fn list(&self, now: SystemTime) -> Result<Vec<ListEntry>, Error> {
        let entry = |t: &TaskName| {
            self.list_entry(t, now).unwrap_or_else(|e| ListEntry {
                task: t.clone(),
                state: None,
                tracked: false,
                next: Vec::new(),
                approval_stale: false,
                approval_missing: false,
                lease_holder: None,
                subtasks: Vec::new(),
                error: Some(e.to_string()),
                verdicts: None,
                attention: None,
            })
        };
        let mut out = Vec::new();
        for t in self.task_names()? {
            let mut e = entry(&t);
            match self.subtask_names(&t) {
                Ok(subs) => e.subtasks = subs.iter().map(entry).collect(),
                Err(err) if e.error.is_none() => e.error = Some(err.to_string()),
                Err(_) => {}
            }
            out.push(e);
        }
        Ok(out)
    }

    /// `status --list` with the folders no command can address.
    pub fn listing(&self, now: SystemTime) -> Result<Listing, Error> {
        Ok(Listing {
            tasks: self.list(now)?,
            unaddressable: self.unaddressable()?,
        })
    }

    /// `status --validate-folder`.
    pub fn validate_folder(&self, task: &TaskName) -> Result<FolderReport, Error> {
        let folder = self.folder(task)?;
        Ok(FolderReport {
            task: task.clone(),
            state: folder.state,
            tracked: folder.state.is_some(),
            out_of_order: folder
                .state
                .map(|s| out_of_order(s, &folder.facts().present))
                .unwrap_or_default(),
        })
    }

    /// `status --validate-folder` without `--task`: every task and sub-task (how seed 001's
    /// orchestrator calls it), and every folder no command can address.
    pub fn validate_all(&self) -> Result<ProjectFolders, Error> {
        let mut out = ProjectFolders {
            reports: Vec::new(),
            errors: Vec::new(),
            unaddressable: self.unaddressable()?,
        };
        for t in self.all_task_names()? {
            match self.validate_folder(&t) {
                Ok(r) => out.reports.push(r),
                Err(e) => out.errors.push(TaskError {
                    task: t,
                    error: e.to_string(),
                }),
            }
        }
        Ok(out)
    }
}
