//! `Project`: one project's task store — where its files live (`{project}/.automaton/`, or
//! `~/.automaton` itself), the names of a task's files, the writer lock and atomic writes that
//! every operation shares. The operations are `impl Project` blocks in sibling files, one
//! concern each (see `lib.rs`).

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use automaton_workflow::{AgentId, Phase, TaskName};

use crate::Error;
use crate::fsx::{self, ProjectLock, TaskLock, atomic_write};

pub(crate) const STATE: &str = ".state";
pub(crate) const APPROVALS: &str = ".state.approvals";
pub(crate) const LOCK: &str = ".state.lock";
pub(crate) const IMPLEMENTER: &str = ".state.implementer";
/// Every agent that held a lease on the task, per phase: `{phase}|{agent}` lines.
pub(crate) const HOLDERS: &str = ".state.holders";
pub(crate) const AGENT_MD: &str = ".agent.md";
pub(crate) const SUBTASKS: &str = "subtasks";

/// A project: where its tasks live and who the user is (for `~/.automaton`).
#[derive(Debug, Clone)]
pub struct Project {
    pub(crate) root: PathBuf,
    /// `{project}/.automaton`, or `~/.automaton` itself when the project is that folder.
    pub(crate) meta: PathBuf,
    pub(crate) tasks: PathBuf,
    pub(crate) home: Option<PathBuf>,
    /// Holders this process has already recorded (task, phase, agent), shared by clones: a
    /// coordinator grants thousands of leases a second and must not re-read `.state.holders`
    /// for a holder it wrote itself.
    pub(crate) recorded: Arc<Mutex<HashSet<(TaskName, Phase, AgentId)>>>,
    /// Receives every durable write before the local files (`replica.rs`).
    pub(crate) replica: Option<crate::replica::Attached>,
    /// The git remote the task branches are shared through (`git_remote.rs`).
    pub(crate) git_remote: Option<String>,
}

impl Project {
    /// `home` is the user's home folder, for `~/.automaton/.agent.md` and for recognising
    /// `~/.automaton` itself as a project whose tasks live in `~/.automaton/tasks/`.
    pub fn open(root: &Path, home: Option<&Path>) -> Project {
        let root = std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf());
        let user_meta = home.map(|h| h.join(".automaton"));
        let is_user_meta = user_meta.as_ref().is_some_and(|m| {
            fs::canonicalize(m).ok() == fs::canonicalize(&root).ok() && m.exists()
        });
        let meta = if is_user_meta {
            root.clone()
        } else {
            root.join(".automaton")
        };
        Project {
            tasks: meta.join("tasks"),
            meta,
            root,
            home: home.map(Path::to_path_buf),
            recorded: Arc::default(),
            replica: None,
            git_remote: None,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn tasks_dir(&self) -> &Path {
        &self.tasks
    }

    pub(crate) fn tmp_dir(&self) -> PathBuf {
        self.meta.join("tmp")
    }

    /// The writer lock for a command on an existing `task` ([`TaskLock`]): writes to other
    /// tasks go on in parallel. Without the task's folder (or a `.automaton/` folder) the
    /// task does not exist: say so without creating anything.
    pub(crate) fn lock(&self, task: &TaskName) -> Result<TaskLock, Error> {
        let missing = || Error::TaskNotFound {
            task: task.clone(),
            tasks: self.tasks_display(),
        };
        if !self.meta.is_dir() {
            return Err(missing());
        }
        let parent = task.parent().map(|p| self.task_dir(&p));
        TaskLock::acquire(
            &self.meta,
            &self.tmp_dir(),
            parent.as_deref(),
            &self.task_dir(task),
        )?
        .ok_or_else(missing)
    }

    /// The writer lock of the whole project, for a command that changes its shape or
    /// something every task shares (creating tasks, the fencing counter, upgrading every
    /// task): it waits for every task write in flight. Without a `.automaton/` folder no
    /// task exists: `task` is named as not found, and nothing is created.
    pub(crate) fn lock_project(&self, task: &TaskName) -> Result<ProjectLock, Error> {
        if !self.meta.is_dir() {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        ProjectLock::acquire(&self.meta, &self.tmp_dir())
    }

    /// Reads a file of the task store that may be absent (at most 64 MiB, UTF-8), through no
    /// link below `.automaton/` ([`Error::Symlink`]).
    pub(crate) fn read_optional(&self, path: &Path) -> Result<Option<String>, Error> {
        fsx::read_optional(&self.meta, path)
    }

    /// Whether `dir` is a real folder of the task store, reached through no link: checked
    /// before a write into it, so that nothing is written outside the store.
    pub(crate) fn is_real_dir(&self, dir: &Path) -> Result<bool, Error> {
        fsx::is_real_dir(&self.meta, dir)
    }

    pub(crate) fn write(&self, target: &Path, bytes: &[u8]) -> Result<(), Error> {
        self.replicate(&[(target, bytes)])?;
        atomic_write(&self.tmp_dir(), target, bytes)
    }

    pub fn task_dir(&self, task: &TaskName) -> PathBuf {
        match task.parent() {
            Some(p) => self.tasks.join(p.leaf()).join(SUBTASKS).join(task.leaf()),
            None => self.tasks.join(task.leaf()),
        }
    }

    pub(crate) fn tasks_display(&self) -> String {
        self.tasks.display().to_string()
    }

    /// Refuses a project folder that does not exist, before anything reads or creates in it.
    pub fn ensure_exists(&self) -> Result<(), Error> {
        if self.root.is_dir() {
            Ok(())
        } else {
            Err(Error::ProjectNotFound {
                root: self.root.clone(),
            })
        }
    }

    /// `{project}/.automaton` (or `~/.automaton`): where the coordinator keeps its files.
    pub fn meta(&self) -> &Path {
        &self.meta
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn project() -> (tempfile::TempDir, Project) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = Project::open(dir.path(), None);
        (dir, p)
    }

    pub(crate) fn name(s: &str) -> TaskName {
        s.parse().expect("valid name")
    }

    #[test]
    fn user_automaton_folder_keeps_tasks_directly_under_it() {
        let home = tempfile::tempdir().expect("home");
        let meta = home.path().join(".automaton");
        fs::create_dir_all(&meta).expect("mkdir");
        let p = Project::open(&meta, Some(home.path()));
        assert_eq!(p.tasks_dir(), meta.join("tasks"));
    }
}
