//! Reading a task folder and the tasks folder: `.state`, artifacts (blank ones are no
//! evidence), `.state.lock`, `.state.approvals` and whether an approval is stale, the holders
//! and implementers records, the facts the rules need, and which tasks (and unaddressable
//! folders) exist. Nothing here writes.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use automaton_workflow::{
    AgentId, ApprovalRecord, Artifact, Facts, Phase, State, TaskName, hex, parse_verdict,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::fsx::{self, io_err};
use crate::project::{APPROVALS, HOLDERS, IMPLEMENTER, LOCK, STATE, SUBTASKS};
use crate::records::{Approval, Lease, parse_holders, parse_implementers};
use crate::{Error, Project};

/// An artifact file in a task folder.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArtifactInfo {
    pub artifact: Artifact,
    pub bytes: u64,
    /// Empty or whitespace only: shown, but not evidence of anything (seed 002).
    #[serde(default)]
    pub blank: bool,
}

/// A folder under the tasks folder whose name no command can address: not kebab-case
/// (`tasks/Fix Login Bug/`, `tasks/my_task/`), so it was made by hand. Listed, audited
/// (Category 4) and left alone by `--upgrade`; never skipped silently.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Unaddressable {
    /// The folder as a task address would name it: `Fix Login Bug` or `parent/my_sub`.
    pub folder: String,
    pub path: PathBuf,
    /// Why no command can name it.
    pub why: String,
    /// A kebab-case name to rename it to, when one can be derived.
    pub rename_to: Option<String>,
}

impl Unaddressable {
    /// What to do about it, as one sentence.
    pub fn advice(&self) -> String {
        match &self.rename_to {
            Some(n) => format!("Rename the folder to '{n}' to make it a task"),
            None => "Rename the folder to a kebab-case name to make it a task".to_string(),
        }
    }
}

/// Whether a file holds nothing but whitespace (or nothing). Reads only until the first
/// other byte, which for a real artifact is almost always in the first block.
fn is_blank(f: &mut fs::File, path: &Path) -> Result<bool, Error> {
    use std::io::Read;
    let mut buf = [0u8; 4096];
    loop {
        let n = f.read(&mut buf).map_err(io_err("read", path))?;
        if n == 0 {
            return Ok(true);
        }
        if !buf[..n].iter().all(u8::is_ascii_whitespace) {
            return Ok(false);
        }
    }
}

/// A kebab-case version of a folder name (`Fix Login Bug` → `fix-login-bug`), if one exists.
fn kebab(name: &str) -> Option<String> {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.is_empty() && !out.ends_with('-') {
            out.push('-');
        }
    }
    let out = out.trim_end_matches('-').to_string();
    out.parse::<TaskName>().ok().map(|_| out)
}

/// What a task folder holds, read once per command.
pub(crate) struct Folder {
    pub dir: PathBuf,
    pub state: Option<State>,
    pub artifacts: Vec<ArtifactInfo>,
}

impl Folder {
    /// The folder's artifacts as evidence: an empty or whitespace-only file counts as absent
    /// everywhere (heuristic, upgrade, audit, transitions, folder validation).
    pub fn facts(&self) -> Facts {
        let evidence: Vec<Artifact> = self
            .artifacts
            .iter()
            .filter(|a| !a.blank)
            .map(|a| a.artifact)
            .collect();
        Facts {
            present: evidence.clone(),
            non_empty: evidence,
            ..Facts::default()
        }
    }
}

impl Project {
    pub(crate) fn folder(&self, task: &TaskName) -> Result<Folder, Error> {
        let dir = self.task_dir(task);
        if !self.is_real_dir(&dir)? {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let state_path = dir.join(STATE);
        let state = match self.read_optional(&state_path)? {
            None => None,
            Some(text) => {
                Some(
                    text.trim()
                        .parse::<State>()
                        .map_err(|source| Error::UnknownPhase {
                            source,
                            path: state_path.clone(),
                        })?,
                )
            }
        };
        let mut artifacts = Vec::new();
        for (name, path, ft) in fsx::list_dir(&dir)? {
            if let Some(artifact) = Artifact::from_file_name(&name)
                && !ft.is_dir()
            {
                // Opened, not stat'ed by name: a link is refused, never measured through.
                let (bytes, blank) = match fsx::open_found(&self.meta, &path)? {
                    fsx::Found::File(mut f) => {
                        let bytes = f.metadata().map_err(io_err("stat", &path))?.len();
                        (bytes, bytes == 0 || is_blank(&mut f, &path)?)
                    }
                    // Gone since the listing, or a FIFO: nothing to read, no evidence.
                    fsx::Found::Absent | fsx::Found::Other => (0, true),
                };
                artifacts.push(ArtifactInfo {
                    artifact,
                    bytes,
                    blank,
                });
            }
        }
        Ok(Folder {
            dir,
            state,
            artifacts,
        })
    }

    pub(crate) fn tracked(&self, task: &TaskName) -> Result<(Folder, State), Error> {
        let folder = self.folder(task)?;
        match folder.state {
            Some(s) => Ok((folder, s)),
            None => Err(Error::Untracked { task: task.clone() }),
        }
    }

    pub(crate) fn lease(&self, dir: &Path) -> Result<Option<Lease>, Error> {
        let path = dir.join(LOCK);
        match self.read_optional(&path)? {
            None => Ok(None),
            Some(text) => Lease::parse(&text)
                .map(Some)
                .map_err(|detail| Error::CorruptLease { path, detail }),
        }
    }

    pub(crate) fn approvals(&self, dir: &Path) -> Result<Vec<Approval>, Error> {
        let path = dir.join(APPROVALS);
        match self.read_optional(&path)? {
            None => Ok(Vec::new()),
            Some(text) => Approval::parse_log(&text)
                .map_err(|(line, detail)| Error::CorruptApprovals { path, line, detail }),
        }
    }

    pub(crate) fn implementers(&self, dir: &Path) -> Result<Vec<AgentId>, Error> {
        let path = dir.join(IMPLEMENTER);
        match self.read_optional(&path)? {
            None => Ok(Vec::new()),
            Some(text) => parse_implementers(&text)
                .map_err(|(line, detail)| Error::CorruptImplementers { path, line, detail }),
        }
    }

    pub(crate) fn holders(&self, dir: &Path) -> Result<Vec<(Phase, AgentId)>, Error> {
        let path = dir.join(HOLDERS);
        match self.read_optional(&path)? {
            None => Ok(Vec::new()),
            Some(text) => parse_holders(&text).map_err(|(line, detail)| Error::CorruptHolders {
                path,
                line,
                detail,
            }),
        }
    }

    /// A parent's sub-tasks that are not finished, as `parent/sub (state)`.
    fn open_subtasks(&self, task: &TaskName) -> Result<Vec<String>, Error> {
        if task.is_subtask() {
            return Ok(Vec::new());
        }
        let mut open = Vec::new();
        for sub in self.subtask_names(task)? {
            // Called under the parent's writer lock: each sub-task's state is read under its
            // own lock (shared), so a move still being synced by its writer is waited for.
            let _read = crate::fsx::read_lock(&self.meta, &self.task_dir(&sub));
            let state = match self.tracked_state(&sub) {
                Ok(s) if s.is_terminal() => continue,
                Ok(s) => s.to_string(),
                Err(Error::Untracked { .. }) => "untracked".to_string(),
                // Not known to be finished; the parent's other moves stay open.
                Err(_) => "unreadable .state".to_string(),
            };
            open.push(format!("{sub} ({state})"));
        }
        for u in self.unaddressable_under(task)? {
            open.push(format!("{} (unaddressable: {})", u.folder, u.why));
        }
        Ok(open)
    }

    /// The sha256 (hex) of an artifact, `None` when it does not exist.
    pub(crate) fn artifact_sha(
        &self,
        dir: &Path,
        artifact: Artifact,
    ) -> Result<Option<String>, Error> {
        let path = dir.join(artifact.file_name());
        let Some(mut f) = fsx::open_regular(&self.meta, &path)? else {
            return Ok(None);
        };
        // Streamed: an artifact may be large.
        let mut hasher = Sha256::new();
        std::io::copy(&mut f, &mut hasher).map_err(io_err("read", &path))?;
        Ok(Some(hex(&hasher.finalize())))
    }

    /// The latest approval of `phase` in `task`'s `.state.approvals`, if any.
    pub fn latest_approval(
        &self,
        task: &TaskName,
        phase: Phase,
    ) -> Result<Option<Approval>, Error> {
        let folder = self.folder(task)?;
        Ok(self
            .approvals(&folder.dir)?
            .into_iter()
            .rev()
            .find(|a| a.phase == phase))
    }

    /// The latest approval of `phase`, and whether what it approved changed since: the
    /// artifact's content, or (for a code review) the task branch's commit.
    pub(crate) fn approval_status(
        &self,
        task: &TaskName,
        dir: &Path,
        phase: Phase,
        log: &[Approval],
    ) -> Result<(Option<Approval>, ApprovalRecord), Error> {
        let Some(record) = log.iter().rev().find(|a| a.phase == phase).cloned() else {
            return Ok((None, ApprovalRecord::Missing));
        };
        let Some(artifact) = phase.artifact() else {
            return Ok((Some(record), ApprovalRecord::Fresh));
        };
        let status = match &record.sha256 {
            // A line from before approvals recorded content hashes cannot go stale.
            None => ApprovalRecord::Fresh,
            Some(h) => match self.artifact_sha(dir, artifact)? {
                Some(now) if &now == h => ApprovalRecord::Fresh,
                _ => ApprovalRecord::Stale,
            },
        };
        // A review's approval authorizes the revision it names, not the branch as it is now.
        let status = match &record.commit {
            Some(c) if status == ApprovalRecord::Fresh => match self.branch_head(task)? {
                Some(head) if head != *c => ApprovalRecord::Stale,
                _ => status,
            },
            _ => status,
        };
        Ok((Some(record), status))
    }

    /// The facts the rules need for a state change of `task` from `state`.
    pub(crate) fn facts_for(
        &self,
        task: &TaskName,
        folder: &Folder,
        state: State,
    ) -> Result<Facts, Error> {
        let mut facts = folder.facts();
        if state.is_approved() {
            let log = self.approvals(&folder.dir)?;
            let status = self
                .approval_status(task, &folder.dir, state.phase, &log)?
                .1;
            facts.approval_stale = status == ApprovalRecord::Stale;
            facts.approval_missing = status == ApprovalRecord::Missing;
        }
        if state.phase == Phase::Referee {
            let path = folder.dir.join(Artifact::Verdict.file_name());
            facts.verdict = self
                .read_optional(&path)?
                .as_deref()
                .and_then(parse_verdict);
        }
        if state
            .legal_targets()
            .iter()
            .any(|t| t.phase == Phase::Complete)
        {
            facts.open_subtasks = self.open_subtasks(task)?;
        }
        Ok(facts)
    }

    pub(crate) fn subtask_names(&self, parent: &TaskName) -> Result<Vec<TaskName>, Error> {
        let dir = self.task_dir(parent).join(SUBTASKS);
        Ok(fsx::list_dir(&dir)?
            .into_iter()
            .filter(|(_, _, ft)| ft.is_dir())
            .filter_map(|(name, _, _)| parent.subtask(&name).ok())
            .collect())
    }

    /// Every task (top level, sorted) — folders whose names are not task names are skipped.
    pub fn task_names(&self) -> Result<Vec<TaskName>, Error> {
        Ok(fsx::list_dir(&self.tasks)?
            .into_iter()
            .filter(|(_, _, ft)| ft.is_dir())
            .filter_map(|(name, _, _)| name.parse::<TaskName>().ok())
            .collect())
    }

    /// Every task and sub-task, parents first.
    pub fn all_task_names(&self) -> Result<Vec<TaskName>, Error> {
        let mut out = Vec::new();
        for t in self.task_names()? {
            let subs = self.subtask_names(&t)?;
            out.push(t);
            out.extend(subs);
        }
        Ok(out)
    }

    /// Every folder under the tasks folder (and under each task's `subtasks/`) whose name
    /// is not a task name, so that no command can address it.
    pub fn unaddressable(&self) -> Result<Vec<Unaddressable>, Error> {
        let mut out = Vec::new();
        for (name, path) in dirs_lossy(&self.tasks)? {
            match name.parse::<TaskName>() {
                Ok(t) if !t.is_subtask() => out.extend(self.unaddressable_under(&t)?),
                _ => out.push(unaddressable(name, path)),
            }
        }
        Ok(out)
    }

    fn unaddressable_under(&self, parent: &TaskName) -> Result<Vec<Unaddressable>, Error> {
        let dir = self.task_dir(parent).join(SUBTASKS);
        Ok(dirs_lossy(&dir)?
            .into_iter()
            .filter(|(name, _)| parent.subtask(name).is_err())
            .map(|(name, path)| unaddressable(format!("{parent}/{name}"), path))
            .collect())
    }

    /// A tracked task's state, read from `.state` alone (not the whole folder).
    pub fn tracked_state(&self, task: &TaskName) -> Result<State, Error> {
        let dir = self.task_dir(task);
        let state_path = dir.join(STATE);
        match self.read_optional(&state_path)? {
            Some(text) => text
                .trim()
                .parse::<State>()
                .map_err(|source| Error::UnknownPhase {
                    source,
                    path: state_path.clone(),
                }),
            None if self.is_real_dir(&dir)? => Err(Error::Untracked { task: task.clone() }),
            None => Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            }),
        }
    }

    /// The state in a task's `.state`, `None` when the folder has none.
    pub fn read_state(&self, task: &TaskName) -> Result<Option<State>, Error> {
        Ok(self.folder(task)?.state)
    }

    pub(crate) fn approval_record(
        &self,
        task: &TaskName,
        folder: &Folder,
        state: State,
    ) -> Result<Option<ApprovalRecord>, Error> {
        if !state.is_approved() {
            return Ok(None);
        }
        let log = self.approvals(&folder.dir)?;
        Ok(Some(
            self.approval_status(task, &folder.dir, state.phase, &log)?
                .1,
        ))
    }

    /// The gated phases `.state.approvals` holds a record for.
    pub(crate) fn approved_phases(&self, folder: &Folder) -> Result<Vec<Phase>, Error> {
        Ok(self
            .approvals(&folder.dir)?
            .into_iter()
            .map(|a| a.phase)
            .collect())
    }

    pub(crate) fn state_mtime(&self, folder: &Folder) -> Option<SystemTime> {
        fs::symlink_metadata(folder.dir.join(STATE))
            .and_then(|m| m.modified())
            .ok()
    }
}

/// The sub-folders of `dir` with their names (lossily decoded: a name that is not UTF-8 is
/// still a folder to report), sorted; nothing when `dir` does not exist.
fn dirs_lossy(dir: &Path) -> Result<Vec<(String, PathBuf)>, Error> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err("read directory", dir)(e)),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(io_err("read directory", dir))?;
        if e.file_type().map_err(io_err("stat", &e.path()))?.is_dir() {
            out.push((e.file_name().to_string_lossy().into_owned(), e.path()));
        }
    }
    out.sort();
    Ok(out)
}

fn unaddressable(folder: String, path: PathBuf) -> Unaddressable {
    let leaf = folder.rsplit('/').next().unwrap_or(&folder).to_string();
    Unaddressable {
        why: "its name is not kebab-case (lowercase letters and digits joined by single hyphens, at most 64 characters), so no command can name it".into(),
        rename_to: kebab(&leaf),
        folder,
        path,
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;
    use std::path::Path;
    use std::time::SystemTime;

    use automaton_workflow::{Artifact, Phase, State};

    use crate::project::tests::{name, project};
    use crate::{Error, ErrorKind, Project};

    const SECRET: &str = "token = \"operator-secret-0123456789\"\n";

    /// A file outside the project that a planted link points at.
    fn secret() -> (tempfile::TempDir, std::path::PathBuf) {
        let d = tempfile::tempdir().expect("tempdir");
        let f = d.path().join("coordinator.toml");
        std::fs::write(&f, SECRET).expect("secret");
        (d, f)
    }

    /// `r` refused with [`Error::Symlink`] naming `link`, the target's bytes nowhere.
    #[track_caller]
    fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, Error>, link: &Path) {
        let err = r.expect_err(what);
        assert!(
            matches!(&err, Error::Symlink { path } if path == link),
            "{what}: {err:?}"
        );
        assert_eq!(err.kind(), ErrorKind::Refused, "{what}");
        let text = err.to_string();
        assert!(text.contains(&link.display().to_string()), "{what}: {text}");
        assert!(
            !text.contains("operator-secret") && !text.contains('\n'),
            "{text}"
        );
    }

    fn relink(p: &Project, task: &str, file: &str, to: &Path) -> std::path::PathBuf {
        let path = p.task_dir(&name(task)).join(file);
        let _ = std::fs::remove_file(&path);
        symlink(to, &path).expect("link");
        path
    }

    #[test]
    fn symlink_every_reader_of_a_task_file_refuses_a_link_naming_it() {
        let (_s, secret) = secret();
        let (_d, p) = project();
        let t = name("t");
        let now = SystemTime::now();
        p.create_task(&t).expect("create");
        let dir = p.task_dir(&t);
        let link = relink(&p, "t", ".state", &secret);
        refused("tracked_state", p.tracked_state(&t), &link);
        refused("read_state", p.read_state(&t), &link);
        refused("view", p.view(&t, now), &link);
        let row = p.list(now).expect("list").remove(0);
        assert!(
            row.error
                .as_deref()
                .is_some_and(|e| e.contains("symbolic link"))
        );
        std::fs::remove_file(&link).expect("unlink");
        std::fs::write(&link, "design:approved\n").expect("state");
        for (file, read) in [
            (
                ".state.lock",
                (|p: &Project, d: &Path| p.lease(d).map(drop))
                    as fn(&Project, &Path) -> Result<(), Error>,
            ),
            (".state.approvals", |p, d| p.approvals(d).map(drop)),
            (".state.implementer", |p, d| p.implementers(d).map(drop)),
            (".state.holders", |p, d| p.holders(d).map(drop)),
        ] {
            let link = relink(&p, "t", file, &secret);
            refused(file, read(&p, &dir), &link);
            std::fs::remove_file(&link).expect("unlink");
        }
        // Artifacts: listed (status, GetTask), hashed (approvals), read whole.
        let link = relink(&p, "t", "SPEC.md", Path::new("/etc/passwd"));
        refused("view", p.view(&t, now), &link);
        refused("read_artifact", p.read_artifact(&t, Artifact::Spec), &link);
        refused("sha", p.artifact_sha(&dir, Artifact::Spec), &link);
        std::fs::remove_file(&link).expect("unlink");
        let link = relink(&p, "t", "DESIGN.md", &secret);
        let log = vec![
            crate::Approval::parse_line(&format!(
                "design:approved|2026-06-14T14:30:00Z|ops|{}",
                "0".repeat(64)
            ))
            .expect("line"),
        ];
        refused(
            "approval",
            p.approval_status(&"t".parse().expect("name"), &dir, Phase::Design, &log),
            &link,
        );
        std::fs::remove_file(&link).expect("unlink");
        let link = relink(&p, "t", "VERDICT.md", &secret);
        refused(
            "verdict",
            p.read_artifact_text(&t, Artifact::Verdict),
            &link,
        );
        // A move reads the folder first: refused, and nothing is written.
        let before = std::fs::read(dir.join(".state")).expect("state");
        refused(
            "transition",
            p.transition(&t, State::open(Phase::Implement), None, None, now),
            &link,
        );
        assert_eq!(std::fs::read(dir.join(".state")).expect("state"), before);
        assert_eq!(std::fs::read_to_string(&secret).expect("secret"), SECRET);
    }

    #[test]
    fn symlink_a_linked_task_or_subtask_folder_is_refused_and_nothing_is_written_through_it() {
        let (s, secret) = secret();
        let (_d, p) = project();
        p.create_task(&name("p")).expect("parent");
        p.create_task(&name("p/sub")).expect("sub");
        // Elsewhere: a folder that looks like a task, with the secret as its spec.
        let elsewhere = s.path().join("elsewhere");
        std::fs::create_dir_all(elsewhere.join("subtasks/sub")).expect("mkdir");
        for d in [elsewhere.clone(), elsewhere.join("subtasks/sub")] {
            std::fs::write(d.join(".state"), "implement\n").expect("state");
            std::fs::copy(&secret, d.join("SPEC.md")).expect("spec");
        }
        let snapshot = || {
            let mut files = Vec::new();
            for d in [elsewhere.clone(), elsewhere.join("subtasks/sub")] {
                for e in std::fs::read_dir(&d).expect("dir").flatten() {
                    files.push((e.path(), std::fs::read(e.path()).ok()));
                }
            }
            files.sort();
            files
        };
        let before = snapshot();
        let now = SystemTime::now();
        let swap = |dir: &Path, to: &Path| {
            let aside = dir.with_extension("real");
            std::fs::rename(dir, &aside).expect("aside");
            symlink(to, dir).expect("link");
            aside
        };
        let check = |task: &str, link: &Path| {
            let t = name(task);
            refused("tracked_state", p.tracked_state(&t), link);
            refused("view", p.view(&t, now), link);
            refused("read_lease", p.read_lease(&t), link);
            refused("work_inputs", p.work_inputs(&t, Phase::Implement), link);
            refused(
                "write_artifact",
                p.write_artifact(&t, Artifact::Spec, b"x"),
                link,
            );
            refused(
                "transition",
                p.transition(&t, State::open(Phase::Research), None, None, now),
                link,
            );
            refused("lease view", p.write_lease_view(&t, None), link);
        };
        // tasks/p itself, for p and for its sub-task.
        let top = p.task_dir(&name("p"));
        let aside = swap(&top, &elsewhere);
        check("p", &top);
        check("p/sub", &top);
        refused("create", p.create_task(&name("p/other")), &top);
        std::fs::remove_file(&top).expect("unlink");
        std::fs::rename(&aside, &top).expect("back");
        // tasks/p/subtasks/sub, and tasks/p/subtasks.
        let sub = p.task_dir(&name("p/sub"));
        let aside = swap(&sub, &elsewhere.join("subtasks/sub"));
        check("p/sub", &sub);
        std::fs::remove_file(&sub).expect("unlink");
        std::fs::rename(&aside, &sub).expect("back");
        let subtasks = top.join("subtasks");
        let aside = swap(&subtasks, &elsewhere.join("subtasks"));
        check("p/sub", &subtasks);
        let files = vec![("PARENT_SPEC.md", b"x".to_vec())];
        refused(
            "create_subtasks",
            p.create_subtasks(&name("p"), &[(name("p/new"), files)]),
            &subtasks,
        );
        std::fs::remove_file(&subtasks).expect("unlink");
        std::fs::rename(&aside, &subtasks).expect("back");
        // The whole tasks folder.
        let tasks = p.tasks_dir().to_path_buf();
        let aside = swap(&tasks, s.path());
        refused("read_state", p.read_state(&name("elsewhere")), &tasks);
        std::fs::remove_file(&tasks).expect("unlink");
        std::fs::rename(&aside, &tasks).expect("back");
        assert_eq!(snapshot(), before, "something was written through a link");
        // Put back, everything reads again.
        assert_eq!(
            p.tracked_state(&name("p/sub")).expect("state"),
            State::open(Phase::New)
        );
    }
}
