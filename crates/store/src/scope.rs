//! The checks prompts run before they act: `--scope-check` (is a file inside the project or
//! `~/.automaton/`), `--same-session` (how old a task is) and `--can-edit` (does its phase
//! allow code edits). They only read.

use std::fs;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use automaton_workflow::{State, TaskName};

use crate::fsx::io_err;
use crate::project::APPROVALS;
use crate::{Error, Project};

impl Project {
    /// `status --can-edit`: the task's state when it allows code edits, else `Err(state)`.
    pub fn can_edit(&self, task: &TaskName) -> Result<Result<State, State>, Error> {
        let (_, state) = self.tracked(task)?;
        Ok(if state.phase.allows_code_edits() {
            Ok(state)
        } else {
            Err(state)
        })
    }

    /// `status --same-session`: how long ago the task was created (its folder's birth time
    /// where the filesystem records one, else the `.state.approvals` file's, which is created
    /// with the task and only ever replaced by approvals).
    pub fn task_age(&self, task: &TaskName, now: SystemTime) -> Result<Duration, Error> {
        let folder = self.folder(task)?;
        let meta = fs::metadata(&folder.dir).map_err(io_err("stat", &folder.dir))?;
        let created = meta
            .created()
            .or_else(|_| fs::metadata(folder.dir.join(APPROVALS)).and_then(|m| m.modified()))
            .or_else(|_| meta.modified())
            .map_err(io_err("stat", &folder.dir))?;
        Ok(now.duration_since(created).unwrap_or_default())
    }

    /// `status --scope-check`: is `file` (relative to `cwd`) inside the project or
    /// `~/.automaton/`? `..` and symlinks are resolved before comparing.
    pub fn in_scope(&self, file: &Path, cwd: &Path) -> bool {
        let resolve = |p: &Path| {
            resolve_path(&if p.is_absolute() {
                p.to_path_buf()
            } else {
                cwd.join(p)
            })
        };
        let file = resolve(file);
        let root = resolve(&self.root);
        let user = self.home.as_ref().map(|h| resolve(&h.join(".automaton")));
        file.starts_with(&root) || user.is_some_and(|u| file.starts_with(u))
    }
}

/// Makes a path absolute without `.`/`..`, resolving symlinks of the longest prefix that exists.
fn resolve_path(p: &Path) -> PathBuf {
    let mut lexical = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                lexical.pop();
            }
            Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    let mut existing = lexical.clone();
    let mut rest = Vec::new();
    while !existing.exists() {
        match existing.file_name() {
            Some(name) => {
                rest.push(name.to_os_string());
                existing.pop();
            }
            None => break,
        }
    }
    let mut out = fs::canonicalize(&existing).unwrap_or(existing);
    for name in rest.into_iter().rev() {
        out.push(name);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::Path;

    use crate::Project;
    use crate::project::tests::project;

    #[test]
    fn scope_resolves_dotdot_and_user_folder() {
        let home = tempfile::tempdir().expect("home");
        fs::create_dir_all(home.path().join(".automaton")).expect("mkdir");
        let (d, _) = project();
        let p = Project::open(d.path(), Some(home.path()));
        assert!(p.in_scope(Path::new("src/main.rs"), d.path()));
        assert!(!p.in_scope(Path::new("../outside"), d.path()));
        assert!(!p.in_scope(Path::new("src/../../escape"), d.path()));
        assert!(p.in_scope(&home.path().join(".automaton/scripts/x"), d.path()));
        assert!(!p.in_scope(Path::new("/etc/passwd"), d.path()));
    }
}
