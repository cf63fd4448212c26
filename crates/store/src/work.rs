//! What an assignment needs from the task store and gives back to it: the task's own files
//! and the framework files of its phase (through the layered lookup, the phase prompt falling
//! back to the built-in one) as the worker's inputs,
//! and the artifact the worker uploads, written atomically.

use std::fs;
use std::path::Path;

use automaton_workflow::{Artifact, Phase, TaskName};

use crate::Error;
use crate::fsx::{self, io_err};
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

/// Reads an input of at most `budget` bytes, through no link below `root`: a link is refused
/// ([`Error::Symlink`], naming it), never served and never skipped, so that the operator
/// sees it.
fn read_small(root: &Path, path: &Path, budget: &mut u64) -> Result<Option<Vec<u8>>, Error> {
    use std::io::Read;
    let f = match fsx::open_found(root, path)? {
        fsx::Found::File(f) => f,
        // Anything but a regular file (a folder, a FIFO) is not an input.
        fsx::Found::Absent | fsx::Found::Other => return Ok(None),
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
    /// each through the layered lookup (the project's `.automaton/`, else `~/.automaton/`);
    /// a phase prompt found in neither layer is the built-in one
    /// ([`automaton_workflow::built_in_prompt`]), served byte for byte like a file's.
    /// Nothing is read through a link in the task folder or the project's layer: a link there
    /// refuses the whole workspace ([`Error::Symlink`], naming it), rather than being served or
    /// silently left out.
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
            .chain([crate::CONFLICTS])
            .chain(previous.iter().map(String::as_str));
        for name in names {
            if let Some(content) = read_small(&self.meta, &dir.join(name), &mut budget)? {
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
            let found = match self.layered(rel) {
                Some(p) => read_small(self.links_stop_at(&p), &p, &mut budget)?,
                None => None,
            };
            // No prompt file in either layer (or something there that is not a file): the
            // built-in one, whose first line says so, rather than an agent with no prompt.
            let content = match found {
                None if kind == "prompt" => {
                    automaton_workflow::built_in_prompt(phase).map(String::into_bytes)
                }
                found => found,
            };
            if let Some(content) = content {
                out.push(InputFile {
                    kind,
                    path: path.to_string(),
                    content,
                });
            }
        }
        if let Some(contracts) = self.layered("contracts")
            && fsx::open_dir(self.links_stop_at(&contracts), &contracts)?.is_some()
        {
            let mut names: Vec<_> = fs::read_dir(&contracts)
                .map_err(io_err("list", &contracts))?
                .filter_map(Result::ok)
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.ends_with(".md") && !n.starts_with('.'))
                .collect();
            names.sort();
            for n in names {
                let path = contracts.join(&n);
                if let Some(content) = read_small(self.links_stop_at(&path), &path, &mut budget)? {
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

    /// An artifact of `task` read whole (at most 64 MiB), through no link below `.automaton/`
    /// ([`Error::Symlink`]) and never blocking on a FIFO; `None` when it does not exist. For
    /// what the coordinator reads itself (a verdict, a decomposition, the artifacts a follow-up
    /// task starts with): each is served to agents later, or decides what they are given.
    pub fn read_artifact(
        &self,
        task: &TaskName,
        artifact: Artifact,
    ) -> Result<Option<Vec<u8>>, Error> {
        let path = self.task_dir(task).join(artifact.file_name());
        fsx::read_capped(&self.meta, &path, fsx::MAX_STATE_FILE)
    }

    /// [`Project::read_artifact`] as text ([`Error::NotUtf8`] when it is not UTF-8).
    pub fn read_artifact_text(
        &self,
        task: &TaskName,
        artifact: Artifact,
    ) -> Result<Option<String>, Error> {
        self.read_optional(&self.task_dir(task).join(artifact.file_name()))
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
    /// Writes `name` (one of [`SUBTASK_FILES`]) into the existing sub-task `sub` when it is
    /// missing (seed 002: a sub-task whose `VRAM_CONFIG.md` is missing gets one made from
    /// the values detected now). Anything already there — a file, a link — is left as it is.
    /// Whether it was written.
    pub fn restore_subtask_file(
        &self,
        sub: &TaskName,
        name: &str,
        content: &[u8],
    ) -> Result<bool, Error> {
        let Some(parent) = sub.parent() else {
            return Ok(false);
        };
        if !SUBTASK_FILES.contains(&name) {
            return Err(Error::NotAnArtifact {
                name: name.to_string(),
            });
        }
        let _lock = self.lock(&parent)?;
        let dir = self.task_dir(sub);
        if !dir.is_dir() {
            return Ok(false);
        }
        let path = dir.join(name);
        match fs::symlink_metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Ok(_) => return Ok(false),
            Err(e) => return Err(io_err("inspect", &path)(e)),
        }
        self.write(&path, content)?;
        Ok(true)
    }

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
        // `subtasks/` a link: the folders would be renamed into wherever it points.
        if let Err(e) = fs::create_dir_all(&subtasks)
            .map_err(io_err("create", &subtasks))
            .and_then(|()| self.is_real_dir(&subtasks))
        {
            cleanup(&staged);
            return Err(e);
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
        if task.parent().is_none() || !SUBTASK_FILES.contains(&name) || !self.is_real_dir(&dir)? {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let target = dir.join(name);
        // A link in the file's place is not "the same bytes": it is replaced by the file.
        if fsx::read_capped(&self.meta, &target, bytes.len() as u64)
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
        if !self.is_real_dir(&dir)? {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let target = dir.join(artifact.file_name());
        // A link in the artifact's place is not "the same bytes": it is replaced by the file.
        if fsx::read_capped(&self.meta, &target, bytes.len() as u64)
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

    /// A link planted where `work_inputs` reads: refused naming it, its target's bytes not
    /// served; the same folder without it is served.
    #[test]
    fn symlink_inputs_of_a_task_refuse_the_workspace_naming_the_link() {
        use std::os::unix::fs::symlink;
        let home = tempfile::tempdir().expect("home");
        let outside = tempfile::tempdir().expect("outside");
        let secret = outside.path().join("coordinator.toml");
        fs::write(&secret, "token = \"operator-secret\"\n").expect("secret");
        let (d, _) = project();
        let p = Project::open(d.path(), Some(home.path()));
        let parent: TaskName = "big".parse().expect("name");
        let sub: TaskName = "big/a".parse().expect("name");
        p.create_task(&parent).expect("parent");
        p.create_subtasks(&parent, &[(sub.clone(), vec![])])
            .expect("sub");
        let cases: [(&TaskName, &str, &Path); 5] = [
            (&parent, "PREVIOUS_SPEC.md", Path::new("/etc/passwd")),
            (&parent, "SPEC.md", &secret),
            (&parent, "PREVIOUS_BUG_REPORT.md", &secret),
            (&sub, "PARENT_SPEC.md", &secret),
            (&sub, "VRAM_CONFIG.md", &secret),
        ];
        for (task, file, target) in cases {
            let link = p.task_dir(task).join(file);
            symlink(target, &link).expect("link");
            let err = p.work_inputs(task, Phase::Implement).expect_err(file);
            assert!(
                matches!(&err, Error::Symlink { path } if *path == link),
                "{file}: {err:?}"
            );
            let text = err.to_string();
            assert!(text.contains(file) && !text.contains("secret\""), "{text}");
            assert!(!text.contains("root:"), "{text}");
            fs::remove_file(&link).expect("unlink");
            assert!(p.work_inputs(task, Phase::Implement).is_ok(), "{file}");
        }
        // A FIFO in a file's place is still not an input (and never blocks).
        let fifo = p.task_dir(&parent).join("DESIGN.md");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .expect("mkfifo");
        assert!(made.success());
        let left: Vec<&str> = p
            .work_inputs(&parent, Phase::Implement)
            .expect("inputs")
            .iter()
            .map(|f| f.kind)
            .collect();
        assert_eq!(left, vec!["prompt"], "only the built-in prompt");
    }

    /// The phase prompt: the project's, else the user's, else the built-in one — never none.
    #[test]
    fn issue21_prompts_the_project_prompt_overrides_the_users_which_overrides_the_built_in() {
        let home = tempfile::tempdir().expect("home");
        let (d, _) = project();
        let p = Project::open(d.path(), Some(home.path()));
        let t: TaskName = "t".parse().expect("name");
        p.create_task(&t).expect("create");
        let prompt = |phase| -> Vec<u8> {
            let inputs = p.work_inputs(&t, phase).expect("inputs");
            let prompts: Vec<_> = inputs.iter().filter(|f| f.kind == "prompt").collect();
            assert_eq!(prompts.len(), 1, "one prompt: {inputs:?}");
            assert_eq!(prompts[0].path, "prompt.md");
            prompts[0].content.clone()
        };
        for phase in automaton_workflow::prompt_phases() {
            let built_in = automaton_workflow::built_in_prompt(phase).expect("built in");
            assert_eq!(prompt(phase), built_in.into_bytes(), "{phase}");
        }
        let user = home.path().join(".automaton/prompts");
        fs::create_dir_all(&user).expect("mkdir");
        fs::write(user.join("research.md"), "user prompt").expect("user");
        assert_eq!(prompt(Phase::Research), b"user prompt");
        let own = d.path().join(".automaton/prompts");
        fs::create_dir_all(&own).expect("mkdir");
        fs::write(own.join("research.md"), "own prompt").expect("own");
        assert_eq!(prompt(Phase::Research), b"own prompt");
        // Other phases still fall back, each to its own built-in prompt.
        let design = String::from_utf8(prompt(Phase::Design)).expect("utf-8");
        assert!(
            design.starts_with("<!-- automaton: built-in prompt for design;"),
            "{design}"
        );
        // A folder where the prompt file would be is not a prompt: the built-in one is served.
        fs::create_dir_all(own.join("design.md")).expect("mkdir");
        assert_eq!(prompt(Phase::Design), design.into_bytes());
        // A link in the project's layer is still refused, not passed over for a fallback.
        std::os::unix::fs::symlink(user.join("research.md"), own.join("implement.md"))
            .expect("link");
        assert!(matches!(
            p.work_inputs(&t, Phase::Implement),
            Err(Error::Symlink { .. })
        ));
    }

    /// The project's layer follows no link; the user's `~/.automaton/` is the operator's
    /// own and may use them.
    #[test]
    fn symlink_layered_inputs_follow_links_in_the_users_folder_only() {
        use std::os::unix::fs::symlink;
        let home = tempfile::tempdir().expect("home");
        let outside = tempfile::tempdir().expect("outside");
        fs::create_dir_all(outside.path().join("prompts")).expect("mkdir");
        let prompt = outside.path().join("prompts/design.md");
        fs::write(&prompt, "dotfiles prompt").expect("prompt");
        fs::create_dir_all(outside.path().join("contracts")).expect("mkdir");
        fs::write(outside.path().join("contracts/api.md"), "api").expect("contract");
        let (d, _) = project();
        let p = Project::open(d.path(), Some(home.path()));
        let t: TaskName = "t".parse().expect("name");
        p.create_task(&t).expect("create");
        let user = home.path().join(".automaton");
        fs::create_dir_all(user.join("prompts")).expect("mkdir");
        symlink(&prompt, user.join("prompts/design.md")).expect("link");
        symlink(outside.path().join("contracts"), user.join("contracts")).expect("link");
        let got: Vec<(&str, Vec<u8>)> = p
            .work_inputs(&t, Phase::Design)
            .expect("the user's links are followed")
            .into_iter()
            .map(|f| (f.kind, f.content))
            .collect();
        assert_eq!(
            got,
            vec![
                ("prompt", b"dotfiles prompt".to_vec()),
                ("contract", b"api".to_vec())
            ]
        );
        // The same links in the project's layer: refused, naming them.
        let own = d.path().join(".automaton");
        for (link, target) in [
            (own.join("prompts"), outside.path().join("prompts")),
            (own.join(".rules.md"), prompt.clone()),
            (own.join("contracts"), outside.path().join("contracts")),
        ] {
            symlink(&target, &link).expect("link");
            let err = p
                .work_inputs(&t, Phase::Design)
                .expect_err("a project link");
            assert!(
                matches!(&err, Error::Symlink { path } if *path == link),
                "{link:?}: {err:?}"
            );
            fs::remove_file(&link).expect("unlink");
        }
        // A dangling link in the project's layer is refused too, not passed over.
        let dangling = own.join(".rules.md");
        symlink(outside.path().join("gone"), &dangling).expect("link");
        assert!(matches!(
            p.work_inputs(&t, Phase::Design),
            Err(Error::Symlink { path }) if path == dangling
        ));
        fs::remove_file(&dangling).expect("unlink");
        // When the project is ~/.automaton itself, its layer is the operator's own.
        let mine = Project::open(&user, Some(home.path()));
        fs::write(user.join(".rules.md"), "rules").expect("rules");
        mine.create_task(&t).expect("create");
        assert_eq!(
            mine.work_inputs(&t, Phase::Design).expect("inputs").len(),
            3
        );
    }

    #[test]
    fn symlink_an_upload_replaces_a_linked_artifact_and_leaves_its_target_alone() {
        use std::os::unix::fs::symlink;
        let outside = tempfile::tempdir().expect("outside");
        let target = outside.path().join("passwd");
        fs::write(&target, "same").expect("target");
        let (d, _) = project();
        let p = Project::open(d.path(), None);
        let t: TaskName = "t".parse().expect("name");
        p.create_task(&t).expect("create");
        let link = p.task_dir(&t).join("SPEC.md");
        symlink(&target, &link).expect("link");
        // Even the target's own bytes are a change: the link is not the artifact.
        assert!(
            p.write_artifact(&t, Artifact::Spec, b"same")
                .expect("write")
        );
        assert!(fs::symlink_metadata(&link).expect("spec").is_file());
        assert_eq!(fs::read(&link).expect("spec"), b"same");
        assert_eq!(fs::read(&target).expect("target"), b"same");
        fs::write(&target, "other").expect("target");
        let sub: TaskName = "t/s".parse().expect("name");
        p.create_subtasks(&t, &[(sub.clone(), vec![])])
            .expect("sub");
        let link = p.task_dir(&sub).join("PARENT_SPEC.md");
        symlink(&target, &link).expect("link");
        assert!(
            p.write_subtask_file(&sub, "PARENT_SPEC.md", b"other")
                .expect("write")
        );
        assert!(fs::symlink_metadata(&link).expect("file").is_file());
        assert_eq!(fs::read(&target).expect("target"), b"other");
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
