//! What an assignment needs from the task store and gives back to it: the task's own files
//! and the framework files of its phase (through the layered lookup) as the worker's inputs,
//! and the artifact the worker uploads, written atomically.

use std::fs;
use std::path::Path;

use automaton_workflow::{Artifact, Phase, TaskName};

use crate::Error;
use crate::fsx::io_err;
use crate::project::Project;

/// Files a sub-task carries besides its artifacts (seed 002).
pub const SUBTASK_FILES: [&str; 2] = ["PARENT_SPEC.md", "VRAM_CONFIG.md"];
/// The prefix of an artifact a follow-up task carries from its original as context.
pub const PREVIOUS: &str = "PREVIOUS_";
/// The most bytes of framework files (prompt, rules, contracts) served for one phase.
const MAX_FRAMEWORK_BYTES: u64 = 16 << 20;

/// A sub-task to create and its own files (name, content).
pub type NewSubtask<'a> = (TaskName, Vec<(&'a str, Vec<u8>)>);

/// A sub-task folder written in the staging area, with its files, not yet in place.
/// A sub-task being created: its name, its folder in `.automaton/tmp/`, its own files.
type Staged<'a> = (TaskName, std::path::PathBuf, &'a [(&'a str, Vec<u8>)]);

/// One input file of an assignment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InputFile {
    /// `task`, `prompt`, `rules` or `contract`.
    pub kind: &'static str,
    /// A file name (`SPEC.md`, `api.md`); `prompt.md` / `rules.md` for those kinds.
    pub path: String,
    pub content: Vec<u8>,
}

fn read_small(path: &std::path::Path, budget: &mut u64) -> Result<Option<Vec<u8>>, Error> {
    use std::io::Read;
    // Anything but a regular file (a folder, a FIFO) is not an input.
    let f = match crate::fsx::open_regular(path) {
        Ok(Some(f)) => f,
        Ok(None) => return Ok(None),
        Err(_) if !path.is_file() => return Ok(None),
        Err(e) => return Err(io_err("read", path)(e)),
    };
    let mut bytes = Vec::new();
    f.take(budget.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(io_err("read", path))?;
    if bytes.len() as u64 > *budget {
        return Err(Error::InputTooLarge {
            path: path.to_path_buf(),
            limit: MAX_FRAMEWORK_BYTES,
        });
    }
    *budget -= bytes.len() as u64;
    Ok(Some(bytes))
}

impl Project {
    /// The inputs of `phase` of `task`: the task's artifacts so far and its sub-task files,
    /// then the phase prompt (`prompts/{phase}.md`), `.rules.md` and every `contracts/*.md`,
    /// each through the layered lookup (the project's `.automaton/`, else `~/.automaton/`).
    pub fn work_inputs(&self, task: &TaskName, phase: Phase) -> Result<Vec<InputFile>, Error> {
        let dir = self.task_dir(task);
        let mut budget = MAX_FRAMEWORK_BYTES;
        let mut out = Vec::new();
        let previous: Vec<String> = Artifact::ALL
            .iter()
            .map(|a| format!("{PREVIOUS}{}", a.file_name()))
            .collect();
        let names = Artifact::ALL
            .iter()
            .map(|a| a.file_name())
            .chain(SUBTASK_FILES)
            .chain(previous.iter().map(String::as_str));
        for name in names {
            if let Some(content) = read_small(&dir.join(name), &mut budget)? {
                out.push(InputFile {
                    kind: "task",
                    path: name.to_string(),
                    content,
                });
            }
        }
        let prompt = format!("prompts/{}.md", phase.name());
        for (kind, rel, path) in [
            ("prompt", prompt.as_str(), "prompt.md"),
            ("rules", ".rules.md", "rules.md"),
        ] {
            if let Some(p) = self.layered(rel)
                && let Some(content) = read_small(&p, &mut budget)?
            {
                out.push(InputFile {
                    kind,
                    path: path.to_string(),
                    content,
                });
            }
        }
        if let Some(contracts) = self.layered("contracts") {
            let mut names: Vec<_> = fs::read_dir(&contracts)
                .map_err(io_err("list", &contracts))?
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.ends_with(".md") && !n.starts_with('.'))
                .collect();
            names.sort();
            for n in names {
                if let Some(content) = read_small(&contracts.join(&n), &mut budget)? {
                    out.push(InputFile {
                        kind: "contract",
                        path: n,
                        content,
                    });
                }
            }
        }
        Ok(out)
    }

    /// Every agent `.state.implementer` names for `task` (empty when none).
    pub fn implementers_of(
        &self,
        task: &TaskName,
    ) -> Result<Vec<automaton_workflow::AgentId>, Error> {
        self.implementers(&self.task_dir(task))
    }

    /// Creates the sub-tasks of `parent` that do not exist yet, each with `.state` = `new`,
    /// an empty `.state.approvals` and its own files ([`SUBTASK_FILES`]), under one hold of
    /// the parent's lock. Each folder appears whole or not at all, as with `create_task`: it is
    /// built and synced in `.automaton/tmp/`, then renamed into place. The folders are built
    /// in parallel and every one is synced before any is renamed, so a decomposition of 200
    /// sub-tasks costs one round of syncs, not 200. Returns the ones created (an existing
    /// sub-task is left alone).
    pub fn create_subtasks(
        &self,
        parent: &TaskName,
        subs: &[NewSubtask<'_>],
    ) -> Result<Vec<TaskName>, Error> {
        use crate::fsx::{sync_dir, temp_name};
        // The sub-tasks live in the parent's folder: the parent's lock keeps out a second
        // creation and the parent's own moves (its `complete` reads them), and other
        // parents' sub-tasks are created meanwhile.
        let _lock = self.lock(parent).map_err(|e| match e {
            Error::TaskNotFound { task, tasks } => Error::ParentNotFound {
                parent: task,
                tasks,
            },
            e => e,
        })?;
        // Everything checked before anything is written.
        let mut staged: Vec<Staged> = Vec::new();
        for (sub, files) in subs {
            if sub.parent().as_ref() != Some(parent) {
                return Err(Error::ParentNotFound {
                    parent: parent.clone(),
                    tasks: self.tasks_display(),
                });
            }
            if let Some((name, _)) = files
                .iter()
                .find(|(n, _)| !n.starts_with('.') && !SUBTASK_FILES.contains(n))
            {
                return Err(Error::NotAnArtifact {
                    name: name.to_string(),
                });
            }
            if self.task_dir(sub).exists() {
                continue;
            }
            let staging = self
                .tmp_dir()
                .join(temp_name(&format!("create-{}", sub.leaf())));
            staged.push((sub.clone(), staging, files.as_slice()));
        }
        if staged.is_empty() {
            return Ok(Vec::new());
        }
        let cleanup = |staged: &[Staged]| {
            for (_, dir, _) in staged {
                let _ = fs::remove_dir_all(dir);
            }
        };
        // One folder: its files written and synced, then the folder itself.
        let build = |staging: &Path, files: &[(&str, Vec<u8>)]| -> Result<(), Error> {
            fs::create_dir_all(staging).map_err(io_err("create", staging))?;
            let own = [
                (crate::project::STATE, &b"new\n"[..]),
                (crate::project::APPROVALS, &b""[..]),
            ];
            for (name, content) in own
                .into_iter()
                .chain(files.iter().map(|(n, c)| (*n, c.as_slice())))
            {
                let path = staging.join(name);
                let mut f = fs::File::create(&path).map_err(io_err("create", &path))?;
                std::io::Write::write_all(&mut f, content).map_err(io_err("write", &path))?;
                f.sync_all().map_err(io_err("sync", &path))?;
            }
            sync_dir(staging)
        };
        let threads = 16.min(staged.len());
        let chunk = staged.len().div_ceil(threads);
        let built: Result<(), Error> = std::thread::scope(|scope| {
            let handles: Vec<_> = staged
                .chunks(chunk)
                .map(|part| {
                    scope.spawn(move || {
                        for (_, staging, files) in part {
                            build(staging, files)?;
                        }
                        Ok::<(), Error>(())
                    })
                })
                .collect();
            let mut out = Ok(());
            for h in handles {
                let r = h.join().unwrap_or_else(|_| {
                    Err(Error::Io {
                        action: "create",
                        path: self.tmp_dir(),
                        source: std::io::Error::other("a sub-task folder's writer panicked"),
                    })
                });
                if out.is_ok() {
                    out = r;
                }
            }
            out
        });
        if let Err(e) = built {
            cleanup(&staged);
            return Err(e);
        }
        let subtasks = self.task_dir(parent).join(crate::project::SUBTASKS);
        if let Err(e) = fs::create_dir_all(&subtasks) {
            cleanup(&staged);
            return Err(io_err("create", &subtasks)(e));
        }
        let mut created = Vec::new();
        for (i, (sub, staging, _)) in staged.iter().enumerate() {
            let dir = self.task_dir(sub);
            if let Err(e) = fs::rename(staging, &dir) {
                cleanup(&staged[i..]);
                return Err(io_err("rename into place", &dir)(e));
            }
            created.push(sub.clone());
        }
        sync_dir(&subtasks)?;
        sync_dir(&self.task_dir(parent))?;
        Ok(created)
    }

    /// Writes one of a sub-task's own files ([`SUBTASK_FILES`]: `PARENT_SPEC.md`,
    /// `VRAM_CONFIG.md`) atomically; `false` when it already held exactly these bytes.
    pub fn write_subtask_file(
        &self,
        task: &TaskName,
        name: &str,
        bytes: &[u8],
    ) -> Result<bool, Error> {
        let dir = self.task_dir(task);
        if task.parent().is_none() || !SUBTASK_FILES.contains(&name) || !dir.is_dir() {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let target = dir.join(name);
        if crate::fsx::read_capped(&target, bytes.len() as u64)
            .is_ok_and(|old| old.as_deref() == Some(bytes))
        {
            return Ok(false);
        }
        self.write(&target, bytes)?;
        Ok(true)
    }

    /// Writes `artifact` of `task` atomically (temp file, fsync, rename, directory fsync).
    /// Returns `false` when the folder already held exactly these bytes (nothing written).
    pub fn write_artifact(
        &self,
        task: &TaskName,
        artifact: Artifact,
        bytes: &[u8],
    ) -> Result<bool, Error> {
        let dir = self.task_dir(task);
        if !dir.is_dir() {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let target = dir.join(artifact.file_name());
        if crate::fsx::read_capped(&target, bytes.len() as u64)
            .is_ok_and(|old| old.as_deref() == Some(bytes))
        {
            return Ok(false);
        }
        self.write(&target, bytes)?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::project::tests::project;

    #[test]
    fn inputs_are_the_task_files_then_the_layered_framework_files() {
        let home = tempfile::tempdir().expect("home");
        let (d, _) = project();
        let p = Project::open(d.path(), Some(home.path()));
        let t: TaskName = "t".parse().expect("name");
        p.create_task(&t).expect("create");
        fs::write(p.task_dir(&t).join("SPEC.md"), "# spec\n").expect("spec");
        fs::write(p.task_dir(&t).join("notes.txt"), "not an input").expect("notes");
        let user = home.path().join(".automaton");
        fs::create_dir_all(user.join("prompts")).expect("mkdir");
        fs::create_dir_all(user.join("contracts")).expect("mkdir");
        fs::write(user.join("prompts/design.md"), "user prompt").expect("prompt");
        fs::write(user.join(".rules.md"), "user rules").expect("rules");
        fs::write(user.join("contracts/api.md"), "api").expect("contract");
        fs::create_dir_all(d.path().join(".automaton/prompts")).expect("mkdir");
        fs::write(d.path().join(".automaton/prompts/design.md"), "own prompt").expect("own");
        let got: Vec<(&str, String, Vec<u8>)> = p
            .work_inputs(&t, Phase::Design)
            .expect("inputs")
            .into_iter()
            .map(|f| (f.kind, f.path, f.content))
            .collect();
        assert_eq!(
            got,
            vec![
                ("task", "SPEC.md".into(), b"# spec\n".to_vec()),
                ("prompt", "prompt.md".into(), b"own prompt".to_vec()),
                ("rules", "rules.md".into(), b"user rules".to_vec()),
                ("contract", "api.md".into(), b"api".to_vec()),
            ]
        );
    }

    #[test]
    fn subtasks_are_created_whole_once_and_existing_ones_are_left_alone() {
        let (d, _) = project();
        let p = Project::open(d.path(), None);
        let parent: TaskName = "big".parse().expect("name");
        p.create_task(&parent).expect("parent");
        let a: TaskName = "big/a".parse().expect("name");
        let b: TaskName = "big/b".parse().expect("name");
        let files = |x: &str| {
            vec![
                ("PARENT_SPEC.md", x.as_bytes().to_vec()),
                ("VRAM_CONFIG.md", b"v".to_vec()),
            ]
        };
        let made = p
            .create_subtasks(&parent, &[(a.clone(), files("a")), (b.clone(), files("b"))])
            .expect("create");
        assert_eq!(made, vec![a.clone(), b.clone()]);
        assert_eq!(
            fs::read_to_string(p.task_dir(&a).join(".state")).expect("state"),
            "new\n"
        );
        assert_eq!(
            fs::read(p.task_dir(&b).join("PARENT_SPEC.md")).expect("spec"),
            b"b"
        );
        // Again: nothing is created or changed.
        fs::write(p.task_dir(&a).join("PARENT_SPEC.md"), "edited").expect("edit");
        assert!(
            p.create_subtasks(&parent, &[(a.clone(), files("x"))])
                .expect("again")
                .is_empty()
        );
        assert_eq!(
            fs::read(p.task_dir(&a).join("PARENT_SPEC.md")).expect("spec"),
            b"edited"
        );
        // Only the sub-task files may be written; nothing is left behind on a refusal.
        let c: TaskName = "big/c".parse().expect("name");
        assert!(
            p.create_subtasks(&parent, &[(c.clone(), vec![("SPEC.md", vec![])])])
                .is_err()
        );
        assert!(!p.task_dir(&c).exists());
    }

    #[test]
    fn an_artifact_is_written_once_and_the_same_bytes_again_change_nothing() {
        let (d, _) = project();
        let p = Project::open(d.path(), None);
        let t: TaskName = "t".parse().expect("name");
        p.create_task(&t).expect("create");
        assert!(p.write_artifact(&t, Artifact::Spec, b"a").expect("write"));
        assert!(!p.write_artifact(&t, Artifact::Spec, b"a").expect("again"));
        assert!(
            p.write_artifact(&t, Artifact::Spec, b"b")
                .expect("new bytes")
        );
        assert_eq!(
            fs::read(p.task_dir(&t).join("SPEC.md")).expect("read"),
            b"b"
        );
        let missing: TaskName = "nope".parse().expect("name");
        assert!(p.write_artifact(&missing, Artifact::Spec, b"a").is_err());
    }
}
