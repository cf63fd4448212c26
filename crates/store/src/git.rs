//! The project's code in git (design §4): one branch per task, served to workers as a list of
//! files and moved forward by the changes an agent made.
//!
//! - The repository is the one at the project root (`Repository::open`, no search upward). A
//!   root that is not a repository has no code: `task_branch` says `None`.
//! - Branch names: `automaton/{task}` for a task, `automaton/{parent}--{sub}` for a sub-task.
//!   Task names are kebab-case and never hold `--`, so no two tasks share a branch, and git's
//!   rule that refs `a` and `a/b` cannot coexist is never hit.
//! - Only objects and `refs/heads/automaton/*` are written: never the working tree, the index
//!   file or HEAD, because the project folder is someone's checkout.
//! - Served trees leave out the task store (`.automaton` at the root, sent separately),
//!   symlinks and submodules; applying changes keeps whatever the branch already holds there.
//! - Durability: git2 0.21 has no safe switch for `GIT_OPT_ENABLE_FSYNC_GITDIR`, so every
//!   write opens the repository with `core.fsyncObjectFiles = true` layered over its config.
//!   libgit2 then fsyncs each loose object, ref and reflog file it writes, and the folder
//!   holding it, before the call returns; this module syncs `objects/` and `refs/heads/` for
//!   folders libgit2 just created. Nothing is acknowledged before it is durable.

use std::collections::{BTreeSet, HashSet};
use std::fs;
use std::path::Path;

use automaton_workflow::{TaskName, excerpt};
use git2::{
    Commit, ConfigLevel, ErrorCode, Index, IndexEntry, IndexTime, ObjectType, Oid, Repository,
    Signature, Tree,
};

use crate::fsx::{io_err, sync_dir, temp_name};
use crate::{Error, Project};

/// At most this many files are served from one tree.
pub const MAX_TREE_FILES: usize = 100_000;
/// At most this many bytes of file content are served from one tree.
pub const MAX_TREE_BYTES: u64 = 1 << 30;
/// The longest path a change may name, in bytes.
pub const MAX_PATH_LEN: usize = 4096;
/// Conflicting paths named in an error before "and N more".
const LISTED_PATHS: usize = 10;

const MODE_FILE: u32 = 0o100644;
const MODE_EXECUTABLE: u32 = 0o100755;
const MODE_SYMLINK: i32 = 0o120000;

/// The most bytes of `changes.diff` served to a review phase; a longer diff is cut there,
/// with a last line saying so (the agent still has the whole tree).
pub const MAX_DIFF_BYTES: usize = 4 << 20;

/// What a task's branch changed since it left the project's HEAD (a sub-task's: its parent's
/// branch): the change a review phase reviews.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskChanges {
    /// The commit the branch started from (its merge base with HEAD, or with the parent's
    /// branch for a sub-task), hex.
    pub base: String,
    /// The branch's head, hex.
    pub head: String,
    /// `git diff base head` as a unified patch, without the task store (`.automaton/`),
    /// at most [`MAX_DIFF_BYTES`].
    pub diff: Vec<u8>,
}

/// A task's branch and the commit it points at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BranchHead {
    /// Short name, e.g. `automaton/add-auth` (the ref is `refs/heads/{branch}`).
    pub branch: String,
    /// Full hexadecimal commit id.
    pub commit: String,
}

/// One regular file of a served tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeFile {
    /// Relative, `/`-separated.
    pub path: String,
    pub executable: bool,
    pub content: Vec<u8>,
}

/// One file the agent changed: new content, or `deleted`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub path: String,
    pub deleted: bool,
    pub executable: bool,
    pub content: Vec<u8>,
}

/// What `apply_changes` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Applied {
    /// The new commit on the branch; `None` when the changes changed nothing.
    pub commit: Option<String>,
    pub branch: String,
    pub files_changed: u32,
}

/// The branch of `task`: `automaton/{task}`, or `automaton/{parent}--{sub}` for a sub-task.
pub fn branch_name(task: &TaskName) -> String {
    task.branch()
}

/// The ref of `task`'s branch: `refs/heads/` and [`branch_name`].
pub(crate) fn branch_ref(task: &TaskName) -> String {
    format!("refs/heads/{}", branch_name(task))
}

/// `'a', 'b' and 3 more`, for the conflict error.
pub(crate) fn list_paths(paths: &[String]) -> String {
    let shown: Vec<String> = paths
        .iter()
        .take(LISTED_PATHS)
        .map(|p| format!("'{}'", excerpt(p)))
        .collect();
    let noun = if paths.len() == 1 { "path" } else { "paths" };
    let more = paths.len().saturating_sub(LISTED_PATHS);
    if more > 0 {
        format!("{noun} {} and {more} more", shown.join(", "))
    } else {
        format!("{noun} {}", shown.join(", "))
    }
}

impl Project {
    /// The task's branch, created on first use from the commit HEAD points at — for a
    /// sub-task, from its parent's branch head (the integration branch, which holds every
    /// sub-task merged so far). `None` when the project root is not a git repository.
    pub fn task_branch(&self, task: &TaskName) -> Result<Option<BranchHead>, Error> {
        let Some(repo) = self.repository()? else {
            return Ok(None);
        };
        let branch = branch_name(task);
        let refname = format!("refs/heads/{branch}");
        if let Some(commit) = self.branch_commit(&repo, &refname)? {
            return Ok(Some(BranchHead {
                branch,
                commit: commit.to_string(),
            }));
        }
        // First use: a second handle, opened for writing (see the module doc on fsync).
        let repo = self.durable_repository()?;
        // A sub-task starts on its parent's branch, the integration branch, as it is now:
        // with every sub-task it depends on merged (dispatch starts it only then).
        let parent_head = match task.parent() {
            Some(parent) => match self.task_branch(&parent)? {
                Some(h) => Some(parse_commit_id(&h.commit)?),
                None => None,
            },
            None => None,
        };
        let start = match parent_head {
            Some(id) => id,
            None => match repo.head() {
                Ok(head) => head
                    .peel_to_commit()
                    .map_err(self.git("read the commit HEAD points at"))?
                    .id(),
                Err(e) if matches!(e.code(), ErrorCode::UnbornBranch | ErrorCode::NotFound) => {
                    return Err(Error::NoCommits {
                        root: self.root.clone(),
                    });
                }
                Err(e) => return Err(self.git("read HEAD")(e)),
            },
        };
        // A top-level task remembers the branch it left: its delivery's default base.
        if task.parent().is_none() {
            self.record_base(task, &repo)?;
        }
        // With a shared remote the branch exists there (and in the record) before it exists
        // here: a later leader then has the branch a worker's changes are based on.
        self.share_branch_head(task, &branch, &start.to_string())?;
        let log = format!("automaton: branch for task {task}");
        let commit = match repo.reference(&refname, start, false, &log) {
            Ok(_) => start,
            // Another caller created it first: theirs is the branch.
            Err(e) if e.code() == ErrorCode::Exists => self
                .branch_commit(&repo, &refname)?
                .ok_or_else(|| self.git("create the task branch")(e))?,
            Err(e) => return Err(self.git("create the task branch")(e)),
        };
        // libgit2 syncs the ref's own folder; these may have just been created in theirs.
        let heads = repo.commondir().join("refs/heads");
        sync_dir(&heads)?;
        sync_dir(&heads.join("automaton"))?;
        Ok(Some(BranchHead {
            branch,
            commit: commit.to_string(),
        }))
    }

    /// What `task`'s branch changed since it left HEAD, or a sub-task's since it left its
    /// parent's branch (see [`TaskChanges`]); `None` when
    /// the project has no repository or the task no branch yet.
    pub fn task_changes(&self, task: &TaskName) -> Result<Option<TaskChanges>, Error> {
        let Some(repo) = self.repository()? else {
            return Ok(None);
        };
        let refname = branch_ref(task);
        let Some(head) = self.branch_commit(&repo, &refname)? else {
            return Ok(None);
        };
        // A sub-task's change is against its parent's branch, where it started (its
        // dependencies' code is not its change); a task's against HEAD.
        let parent_head = match task.parent() {
            Some(parent) => self.branch_commit(&repo, &branch_ref(&parent))?,
            None => None,
        };
        let base = match parent_head {
            Some(p) => repo
                .merge_base(p, head)
                .map_err(self.git("find where the task branch started"))?,
            None => match repo.head().and_then(|h| h.peel_to_commit()) {
                Ok(main) => repo
                    .merge_base(main.id(), head)
                    .map_err(self.git("find where the task branch started"))?,
                // HEAD unreadable (detached at nothing, unborn): the branch against itself.
                Err(_) => head,
            },
        };
        let tree = |id: Oid| -> Result<Tree<'_>, Error> {
            self.find_commit(&repo, id)?
                .tree()
                .map_err(self.git("read a commit's tree"))
        };
        let (old, new) = (tree(base)?, tree(head)?);
        let diff = repo
            .diff_tree_to_tree(Some(&old), Some(&new), None)
            .map_err(self.git("diff the task branch"))?;
        let mut out = Vec::new();
        let mut cut = false;
        diff.print(git2::DiffFormat::Patch, |delta, _hunk, line| {
            // The task store is served on its own; its files are no part of the change.
            let store =
                |f: git2::DiffFile<'_>| f.path().is_some_and(|p| p.starts_with(".automaton"));
            if store(delta.old_file()) || store(delta.new_file()) {
                return true;
            }
            let origin = line.origin();
            let extra = usize::from(matches!(origin, '+' | '-' | ' '));
            if out.len() + line.content().len() + extra > MAX_DIFF_BYTES {
                cut = true;
                return false;
            }
            if extra == 1 {
                out.push(origin as u8);
            }
            out.extend_from_slice(line.content());
            true
        })
        .or_else(|e| if cut { Ok(()) } else { Err(e) })
        .map_err(self.git("print the task branch's diff"))?;
        if cut {
            out.extend_from_slice(
                format!("\n[changes.diff cut at {MAX_DIFF_BYTES} bytes: the whole change is in the tree]\n").as_bytes(),
            );
        }
        Ok(Some(TaskChanges {
            base: base.to_string(),
            head: head.to_string(),
            diff: out,
        }))
    }

    /// Every regular file of `commit`'s tree, sorted by path, without the task store
    /// (`.automaton` at the root), symlinks or submodules.
    pub fn read_tree(&self, commit: &str) -> Result<Vec<TreeFile>, Error> {
        self.read_tree_bounded(commit, MAX_TREE_FILES, MAX_TREE_BYTES)
    }

    fn read_tree_bounded(
        &self,
        commit: &str,
        max_files: usize,
        max_bytes: u64,
    ) -> Result<Vec<TreeFile>, Error> {
        let oid = parse_commit_id(commit)?;
        let repo = self.repository()?.ok_or_else(|| Error::NoRepository {
            root: self.root.clone(),
        })?;
        let tree = self
            .find_commit(&repo, oid)?
            .tree()
            .map_err(self.git("read a commit's tree"))?;
        let too_large = |limit: String| Error::TreeTooLarge {
            commit: oid.to_string(),
            limit,
        };
        // First the listing, then the sizes from object headers: nothing big is read before
        // the tree is known to fit.
        let mut found: Vec<(String, Oid, bool)> = Vec::new();
        let mut stack: Vec<(String, Tree<'_>)> = vec![(String::new(), tree)];
        while let Some((prefix, tree)) = stack.pop() {
            for entry in tree.iter() {
                let Ok(name) = entry.name() else {
                    return Err(Error::UnservablePath {
                        commit: oid.to_string(),
                        path: format!(
                            "{prefix}{}",
                            excerpt(&String::from_utf8_lossy(entry.name_bytes()))
                        ),
                        why: "not UTF-8",
                    });
                };
                if prefix.is_empty() && name == ".automaton" {
                    continue;
                }
                match entry.kind() {
                    Some(ObjectType::Tree) => {
                        let sub = repo
                            .find_tree(entry.id())
                            .map_err(self.git("read a tree"))?;
                        stack.push((format!("{prefix}{name}/"), sub));
                    }
                    Some(ObjectType::Blob) if entry.filemode() != MODE_SYMLINK => {
                        if found.len() == max_files {
                            return Err(too_large(format!("{max_files} files")));
                        }
                        let executable = entry.filemode() == MODE_EXECUTABLE as i32;
                        found.push((format!("{prefix}{name}"), entry.id(), executable));
                    }
                    // Symlinks and submodules (commits) are not served.
                    _ => {}
                }
            }
        }
        let odb = repo.odb().map_err(self.git("open the object database"))?;
        let mut total = 0u64;
        for (_, id, _) in &found {
            let (size, _) = odb.read_header(*id).map_err(self.git("read a blob"))?;
            total = total.saturating_add(size as u64);
            if total > max_bytes {
                return Err(too_large(format!("{max_bytes} bytes")));
            }
        }
        let mut files = Vec::with_capacity(found.len());
        for (path, id, executable) in found {
            let blob = repo.find_blob(id).map_err(self.git("read a blob"))?;
            files.push(TreeFile {
                path,
                executable,
                content: blob.content().to_vec(),
            });
        }
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(files)
    }

    /// Commits `changes`, made by `author` on top of `base_commit`, to the task's branch. A
    /// branch that moved since `base_commit` takes them only when none of their paths changed
    /// in between. The branch moves by compare-and-swap, retried once.
    pub fn apply_changes(
        &self,
        task: &TaskName,
        base_commit: &str,
        changes: &[Change],
        author: &str,
        message: &str,
    ) -> Result<Applied, Error> {
        self.apply_changes_with(task, base_commit, changes, author, message, &mut |_| {})
    }

    /// `apply_changes`, with `before_swap` run between the commit and the ref update (tests
    /// move the branch there to exercise the retry).
    fn apply_changes_with(
        &self,
        task: &TaskName,
        base_commit: &str,
        changes: &[Change],
        author: &str,
        message: &str,
        before_swap: &mut dyn FnMut(&Repository),
    ) -> Result<Applied, Error> {
        check_changes(changes)?;
        check_text("author", author, true)?;
        check_text("message", message, false)?;
        let base = parse_commit_id(base_commit)?;
        let repo = self.durable_repository()?;
        let branch = branch_name(task);
        let refname = format!("refs/heads/{branch}");
        let base_tree = self
            .find_commit(&repo, base)?
            .tree()
            .map_err(self.git("read a commit's tree"))?;
        let signature =
            Signature::now(author, &format!("{author}@automaton.invalid")).map_err(|_| {
                Error::BadCommitText {
                    field: "author",
                    value: excerpt(author),
                    why: "git cannot use it as a name",
                }
            })?;
        let log = format!(
            "automaton: {task}: {}",
            message.lines().next().unwrap_or_default()
        );
        for _attempt in 0..2 {
            let head_id = self
                .branch_commit(&repo, &refname)?
                .ok_or_else(|| Error::NoBranch {
                    task: task.clone(),
                    branch: branch.clone(),
                })?;
            let head = self.find_commit(&repo, head_id)?;
            let head_tree = head.tree().map_err(self.git("read a commit's tree"))?;
            if head_id != base
                && let Some(done) = self.landed_already(&repo, &head, changes, author, message)?
            {
                return Ok(Applied { branch, ..done });
            }
            if head_id != base {
                let conflicts =
                    conflicting_paths(&self.changed_paths(&repo, &base_tree, &head_tree)?, changes);
                if !conflicts.is_empty() {
                    return Err(Error::PatchConflict {
                        task: task.clone(),
                        paths: conflicts,
                    });
                }
            }
            let tree_id = build_tree(&repo, &head_tree, changes)
                .map_err(self.git("write the changed tree"))?;
            if tree_id == head_tree.id() {
                return Ok(Applied {
                    commit: None,
                    branch,
                    files_changed: 0,
                });
            }
            let tree = repo.find_tree(tree_id).map_err(self.git("read a tree"))?;
            let files_changed = self.changed_paths(&repo, &head_tree, &tree)?.len();
            let commit = repo
                .commit(None, &signature, &signature, message, &tree, &[&head])
                .map_err(self.git("write the commit"))?;
            // libgit2 synced each object and its `objects/xx` folder; a new `xx` needs this.
            sync_dir(&repo.commondir().join("objects"))?;
            before_swap(&repo);
            // With a shared remote: recorded (fenced) and pushed before the branch moves here.
            self.share_branch_head(task, &branch, &commit.to_string())?;
            match repo.reference_matching(&refname, commit, true, head_id, &log) {
                Ok(_) => {
                    return Ok(Applied {
                        commit: Some(commit.to_string()),
                        branch,
                        files_changed: u32::try_from(files_changed).unwrap_or(u32::MAX),
                    });
                }
                // Someone else moved the branch: redo everything against the new head.
                Err(e) if e.code() == ErrorCode::Modified => continue,
                Err(e) => return Err(self.git("move the task branch")(e)),
            }
        }
        Err(Error::BranchRace {
            task: task.clone(),
            branch,
        })
    }

    /// The answer `apply_changes` gave when these very changes made `head`: a retry whose
    /// first answer was lost. `head` must carry the same message and author (the message
    /// names the lease's fencing token, unique per lease), and `changes` applied to its parent
    /// must give its tree. Otherwise `None`, and the changes are judged as new (a conflict,
    /// say, or an empty patch that commits nothing).
    fn landed_already(
        &self,
        repo: &Repository,
        head: &Commit<'_>,
        changes: &[Change],
        author: &str,
        message: &str,
    ) -> Result<Option<Applied>, Error> {
        if head.message_bytes() != message.as_bytes()
            || head.author().name_bytes() != author.as_bytes()
            || head.parent_count() != 1
        {
            return Ok(None);
        }
        let tree = head.tree().map_err(self.git("read a commit's tree"))?;
        let parent = head
            .parent(0)
            .and_then(|p| p.tree())
            .map_err(self.git("read a commit's tree"))?;
        let patched =
            build_tree(repo, &parent, changes).map_err(self.git("write the changed tree"))?;
        if patched != tree.id() {
            return Ok(None);
        }
        let files_changed = self.changed_paths(repo, &parent, &tree)?.len();
        Ok(Some(Applied {
            commit: Some(head.id().to_string()),
            branch: String::new(),
            files_changed: u32::try_from(files_changed).unwrap_or(u32::MAX),
        }))
    }

    /// Removes the ref lock files (`refs/heads/automaton/**.lock`) a killed writer of the
    /// task branches left behind: libgit2 takes `NAME.lock` beside a ref while it moves it,
    /// and a `kill -9` in that instant leaves it there, refusing every later move of that
    /// branch ("failed to lock file … Locked"). Only the project's owner writes the task
    /// branches, so its start is the one moment no such writer is alive: call it then.
    /// Returns the refs unlocked.
    pub fn sweep_task_branch_locks(&self) -> Result<Vec<String>, Error> {
        let Some(repo) = self.repository()? else {
            return Ok(Vec::new());
        };
        let heads = repo.path().join("refs/heads/automaton");
        let mut removed = Vec::new();
        let mut dirs = vec![heads.clone()];
        while let Some(dir) = dirs.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err("list", &dir)(e)),
            };
            for entry in entries {
                let entry = entry.map_err(io_err("list", &dir))?;
                let path = entry.path();
                // `file_type` does not follow links: a link is neither followed nor removed.
                let ft = entry.file_type().map_err(io_err("stat", &path))?;
                if ft.is_dir() {
                    dirs.push(path);
                } else if ft.is_file() && path.extension().is_some_and(|x| x == "lock") {
                    fs::remove_file(&path).map_err(io_err("remove", &path))?;
                    removed.push(
                        path.strip_prefix(repo.path())
                            .unwrap_or(&path)
                            .display()
                            .to_string(),
                    );
                }
            }
        }
        Ok(removed)
    }

    /// The project's repository; `None` when the root is not one.
    pub(crate) fn repository(&self) -> Result<Option<Repository>, Error> {
        match Repository::open(&self.root) {
            Ok(repo) => Ok(Some(repo)),
            Err(e) if e.code() == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(self.git("open the repository")(e)),
        }
    }

    /// The repository for writing: libgit2 fsyncs what it writes through this handle.
    /// `core.fsyncObjectFiles` is read once, when the object and ref databases are created,
    /// so it is layered on (from a temporary app-level config file) before either exists.
    pub(crate) fn durable_repository(&self) -> Result<Repository, Error> {
        let repo = self.repository()?.ok_or_else(|| Error::NoRepository {
            root: self.root.clone(),
        })?;
        let tmp_dir = self.tmp_dir();
        fs::create_dir_all(&tmp_dir).map_err(io_err("create", &tmp_dir))?;
        let path = tmp_dir.join(temp_name("git-fsync.config"));
        fs::write(&path, "[core]\n\tfsyncObjectFiles = true\n").map_err(io_err("write", &path))?;
        let layered = (|| -> Result<(), git2::Error> {
            let mut config = repo.config()?;
            config.add_file(&path, ConfigLevel::App, true)?;
            // Drops lookups libgit2 may have cached while opening.
            repo.set_config(&config)?;
            repo.odb()?;
            match repo.find_reference("HEAD") {
                Err(e) if e.code() != ErrorCode::NotFound => Err(e),
                _ => Ok(()),
            }
        })();
        // The settings are read by now; a leftover of a crash is cleaned with the other
        // temporary files of dead processes.
        let _ = fs::remove_file(&path);
        layered.map_err(self.git("turn on fsync"))?;
        Ok(repo)
    }

    pub(crate) fn branch_commit(
        &self,
        repo: &Repository,
        refname: &str,
    ) -> Result<Option<Oid>, Error> {
        match repo.find_reference(refname) {
            Ok(r) => Ok(Some(
                r.peel_to_commit()
                    .map_err(self.git("read the task branch"))?
                    .id(),
            )),
            Err(e) if e.code() == ErrorCode::NotFound => Ok(None),
            Err(e) => Err(self.git("read the task branch")(e)),
        }
    }

    pub(crate) fn find_commit<'r>(
        &self,
        repo: &'r Repository,
        id: Oid,
    ) -> Result<Commit<'r>, Error> {
        repo.find_commit(id).map_err(|e| match e.code() {
            // Also a tree or blob id: libgit2 reports the wrong type as not found.
            ErrorCode::NotFound => Error::CommitNotFound {
                commit: id.to_string(),
                root: self.root.clone(),
            },
            _ => self.git("read a commit")(e),
        })
    }

    /// Paths that differ between two trees (both sides of each delta).
    pub(crate) fn changed_paths(
        &self,
        repo: &Repository,
        old: &Tree<'_>,
        new: &Tree<'_>,
    ) -> Result<BTreeSet<String>, Error> {
        let diff = repo
            .diff_tree_to_tree(Some(old), Some(new), None)
            .map_err(self.git("compare two trees"))?;
        let mut paths = BTreeSet::new();
        for delta in diff.deltas() {
            for file in [delta.old_file(), delta.new_file()] {
                if let Some(p) = file.path_bytes() {
                    paths.insert(String::from_utf8_lossy(p).into_owned());
                }
            }
        }
        Ok(paths)
    }

    pub(crate) fn git(&self, action: &'static str) -> impl FnOnce(git2::Error) -> Error + '_ {
        move |source| Error::Git {
            action,
            root: self.root.clone(),
            source,
        }
    }
}

/// A full hexadecimal commit id; git2 would read a short one as a zero-padded full one.
pub(crate) fn parse_commit_id(commit: &str) -> Result<Oid, Error> {
    let bad = || Error::BadCommit {
        commit: excerpt(commit).escape_debug().to_string(),
    };
    if commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(bad());
    }
    Oid::from_str(commit).map_err(|_| bad())
}

fn check_changes(changes: &[Change]) -> Result<(), Error> {
    let mut seen = HashSet::new();
    for change in changes {
        let why = path_problem(&change.path)
            .or_else(|| (!seen.insert(change.path.as_str())).then_some("it is listed twice"));
        if let Some(why) = why {
            return Err(Error::BadPath {
                path: excerpt(&change.path).escape_debug().to_string(),
                why,
            });
        }
    }
    Ok(())
}

/// Why git (with `core.protectHFS` and `core.protectNTFS` on, as on macOS and Windows) would
/// refuse `path` in a tree, or why the task store does; `None`: it may be committed. git's
/// own rules (`verify_path` in read-cache.c, `is_ntfs_dotgit` in path.c, `is_hfs_dotgit` in
/// utf8.c): no `.git` in any component, in any case, nor what NTFS or HFS+ reads as `.git`; a
/// backslash is a separator to NTFS. Stricter than git: the aliases of `.gitmodules`,
/// `.gitattributes`, `.gitignore` and `.mailmap` (which git refuses only as links) are refused
/// in any component (the exact names are fine), and so are `.automaton`'s at the root.
fn path_problem(path: &str) -> Option<&'static str> {
    if path.is_empty() {
        return Some("it is empty");
    }
    if path.len() > MAX_PATH_LEN {
        return Some("it is longer than 4096 bytes");
    }
    if path.contains('\0') {
        return Some("it holds a NUL byte");
    }
    if path.starts_with('/') {
        return Some("it is absolute");
    }
    for (i, part) in path.split('/').enumerate() {
        match part {
            "" => return Some("it has an empty component ('//' or a trailing '/')"),
            "." | ".." => return Some("it has a '.' or '..' component"),
            _ => {}
        }
        for (j, name) in part.split('\\').enumerate() {
            if is_dotgit(name) {
                return Some(
                    "it names .git, or what NTFS or HFS+ reads as .git (any case, a trailing '.' or ' ', a ':' stream, git~1, an ignorable code point such as U+200C, '\\' as a separator); git refuses them all",
                );
            }
            if GIT_DOTFILES
                .iter()
                .any(|(file, short)| is_alias_of(name, file, Some(short)))
            {
                return Some(
                    "it is what NTFS or HFS+ reads as .gitmodules, .gitattributes, .gitignore or .mailmap, under another spelling: use the exact name",
                );
            }
            if i == 0 && j == 0 && (name == ".automaton" || is_alias_of(name, "automaton", None)) {
                return Some("it is inside .automaton/ (the task store is not code)");
            }
        }
    }
    None
}

/// The files git protects beside `.git` (without the dot), with the prefix of the hashed
/// NTFS short name Windows may give each (git's `is_ntfs_dotgitmodules` and siblings).
const GIT_DOTFILES: [(&str, &str); 4] = [
    ("gitmodules", "gi7eba"),
    ("gitignore", "gi250a"),
    ("gitattributes", "gi7d29"),
    ("mailmap", "maba30"),
];

/// Code points HFS+ leaves out of a file name when it compares names (git's
/// `next_hfs_char`): `.g\u{200c}it` is `.git` there.
fn hfs_ignorable(c: char) -> bool {
    matches!(
        c,
        '\u{200c}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{206a}'..='\u{206f}' | '\u{feff}'
    )
}

/// Whether HFS+ reads the component `name` as `.{needle}` (`needle` lowercase ASCII): ASCII
/// case folded, ignorable code points dropped (git's `is_hfs_dot_generic`).
fn is_hfs_dot(name: &str, needle: &str) -> bool {
    let mut chars = name.chars().filter(|c| !hfs_ignorable(*c));
    chars.next() == Some('.')
        && needle
            .chars()
            .all(|n| chars.next().is_some_and(|c| c.to_ascii_lowercase() == n))
        && chars.next().is_none()
}

/// The rest of an NTFS name after what it aliases: NTFS drops trailing spaces and periods,
/// and a `:` starts an alternate data stream of the same file (`.git::$INDEX_ALLOCATION`).
fn ntfs_same_name(rest: &[u8]) -> bool {
    for &c in rest {
        if c == b':' {
            return true;
        }
        if c != b' ' && c != b'.' {
            return false;
        }
    }
    true
}

/// Whether the component `name` is `.git` to git: on any disk, or to NTFS (`.git`, or its
/// short name `git~1`, in any case, then [`ntfs_same_name`]; git's `is_ntfs_dotgit`) or
/// HFS+ ([`is_hfs_dot`]).
fn is_dotgit(name: &str) -> bool {
    let b = name.as_bytes();
    let rest = if b.len() >= 4 && b[0] == b'.' && b[1..4].eq_ignore_ascii_case(b"git") {
        &b[4..]
    } else if b.len() >= 5 && b[..5].eq_ignore_ascii_case(b"git~1") {
        &b[5..]
    } else {
        return is_hfs_dot(name, "git");
    };
    ntfs_same_name(rest) || is_hfs_dot(name, "git")
}

/// Whether the component `name` is another spelling of `.{file}` to NTFS or HFS+ (git's
/// `is_ntfs_dot_generic` and `is_hfs_dot_generic`): any case, then [`ntfs_same_name`]; the
/// short name (the first six characters, `~1` to `~4`); with `short`, the hashed short name
/// (up to six of its characters, `~`, digits: eight in all). The exact `.{file}` is not.
fn is_alias_of(name: &str, file: &str, short: Option<&str>) -> bool {
    let (b, f) = (name.as_bytes(), file.as_bytes());
    if b.first() == Some(&b'.') && &b[1..] == f {
        return false;
    }
    if is_hfs_dot(name, file) {
        return true;
    }
    if b.len() > f.len() && b[0] == b'.' && b[1..=f.len()].eq_ignore_ascii_case(f) {
        return ntfs_same_name(&b[f.len() + 1..]);
    }
    if b.len() >= 8
        && b[..6].eq_ignore_ascii_case(&f[..6])
        && b[6] == b'~'
        && (b'1'..=b'4').contains(&b[7])
    {
        return ntfs_same_name(&b[8..]);
    }
    let Some(short) = short.map(str::as_bytes) else {
        return false;
    };
    let at = |i: usize| b.get(i).copied().unwrap_or(0);
    let (mut i, mut tilde) = (0, false);
    while i < 8 {
        let c = at(i);
        if c == 0 {
            return false;
        } else if tilde {
            if !c.is_ascii_digit() {
                return false;
            }
        } else if c == b'~' {
            i += 1;
            if !(b'1'..=b'9').contains(&at(i)) {
                return false;
            }
            tilde = true;
        } else if i >= 6 || c.to_ascii_lowercase() != short[i] {
            return false;
        }
        i += 1;
    }
    ntfs_same_name(&b[8..])
}

fn check_text(field: &'static str, value: &str, is_name: bool) -> Result<(), Error> {
    let why = if value.contains('\0') {
        Some("it holds a NUL byte")
    } else if is_name && value.trim().is_empty() {
        Some("it is empty")
    } else if is_name
        && value
            .chars()
            .any(|c| c.is_control() || c == '<' || c == '>')
    {
        Some("a name may not hold '<', '>' or control characters")
    } else {
        None
    };
    match why {
        Some(why) => Err(Error::BadCommitText {
            field,
            value: excerpt(value).escape_debug().to_string(),
            why,
        }),
        None => Ok(()),
    }
}

/// The change paths that meet a path changed on the branch: the same path, or one inside the
/// other (a file that became a folder, or the reverse). Sorted.
fn conflicting_paths(changed: &BTreeSet<String>, changes: &[Change]) -> Vec<String> {
    let mut conflicts: Vec<String> = changes
        .iter()
        .map(|c| c.path.as_str())
        .filter(|path| {
            let inside = format!("{path}/");
            changed.contains(*path)
                || changed
                    .range(inside.clone()..)
                    .next()
                    .is_some_and(|p| p.starts_with(&inside))
                || path
                    .match_indices('/')
                    .any(|(i, _)| changed.contains(&path[..i]))
        })
        .map(str::to_string)
        .collect();
    conflicts.sort();
    conflicts
}

/// The head tree with `changes` applied, written to the object database. An in-memory index:
/// the repository's own index file is never read or written.
fn build_tree(repo: &Repository, head: &Tree<'_>, changes: &[Change]) -> Result<Oid, git2::Error> {
    let mut index = Index::new()?;
    index.read_tree(head)?;
    for change in changes {
        if change.deleted {
            index.remove_path(Path::new(&change.path))?;
            continue;
        }
        let id = repo.blob(&change.content)?;
        let zero = IndexTime::new(0, 0);
        index.add(&IndexEntry {
            ctime: zero,
            mtime: zero,
            dev: 0,
            ino: 0,
            mode: if change.executable {
                MODE_EXECUTABLE
            } else {
                MODE_FILE
            },
            uid: 0,
            gid: 0,
            file_size: u32::try_from(change.content.len()).unwrap_or(u32::MAX),
            id,
            flags: 0,
            flags_extended: 0,
            path: change.path.as_bytes().to_vec(),
        })?;
    }
    index.write_tree_to(repo)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::ErrorKind;
    use crate::project::tests::name;
    use git2::Time;

    /// `(path, content, mode)`
    pub(crate) type Files<'a> = &'a [(&'a str, &'a [u8], u32)];

    pub(crate) const BASE: Files<'static> = &[
        ("README.md", b"hello\n", MODE_FILE),
        ("bin/run.sh", b"#!/bin/sh\n", MODE_EXECUTABLE),
        ("src/lib.rs", b"pub fn f() {}\n", MODE_FILE),
        (".automaton/tasks/t/.state", b"implement\n", MODE_FILE),
        (".automaton-notes.md", b"served\n", MODE_FILE),
        ("docs/.automaton/x.md", b"served too\n", MODE_FILE),
    ];

    pub(crate) fn signature() -> Signature<'static> {
        Signature::new(
            "tester",
            "tester@example.invalid",
            &Time::new(1_700_000_000, 0),
        )
        .expect("signature")
    }

    /// A commit of `files` on top of `parent`'s tree, without touching any ref.
    pub(crate) fn commit(repo: &Repository, parent: Option<Oid>, files: Files<'_>) -> Oid {
        let mut index = Index::new().expect("index");
        let parent = parent.map(|p| repo.find_commit(p).expect("parent"));
        if let Some(p) = &parent {
            index
                .read_tree(&p.tree().expect("tree"))
                .expect("read tree");
        }
        for (path, content, mode) in files {
            let id = if *mode == 0o160000 {
                Oid::from_str("1234567890123456789012345678901234567890").expect("oid")
            } else {
                repo.blob(content).expect("blob")
            };
            let zero = IndexTime::new(0, 0);
            index
                .add(&IndexEntry {
                    ctime: zero,
                    mtime: zero,
                    dev: 0,
                    ino: 0,
                    mode: *mode,
                    uid: 0,
                    gid: 0,
                    file_size: 0,
                    id,
                    flags: 0,
                    flags_extended: 0,
                    path: path.as_bytes().to_vec(),
                })
                .expect("add");
        }
        let tree = repo
            .find_tree(index.write_tree_to(repo).expect("write tree"))
            .expect("tree");
        let parents: Vec<&Commit<'_>> = parent.iter().collect();
        repo.commit(None, &signature(), &signature(), "test", &tree, &parents)
            .expect("commit")
    }

    /// A checkout of `BASE` on `main`: HEAD, an index file and working files, as a person
    /// would have it.
    pub(crate) fn checkout() -> (tempfile::TempDir, Project, Repository, Oid) {
        let (dir, project) = crate::project::tests::project();
        let repo = Repository::init(dir.path()).expect("init");
        let head = commit(&repo, None, BASE);
        repo.reference("refs/heads/main", head, true, "test")
            .expect("main");
        repo.set_head("refs/heads/main").expect("HEAD");
        {
            let tree = repo.find_commit(head).expect("c").tree().expect("tree");
            let mut index = repo.index().expect("index");
            index.read_tree(&tree).expect("read tree");
            index.write().expect("write index");
        }
        for (path, content, _) in BASE {
            let file = dir.path().join(path);
            fs::create_dir_all(file.parent().expect("parent")).expect("mkdir");
            fs::write(file, content).expect("write");
        }
        (dir, project, repo, head)
    }

    pub(crate) fn branch_target(repo: &Repository, task: &str) -> Option<Oid> {
        repo.find_reference(&branch_ref(&name(task)))
            .ok()
            .and_then(|r| r.target())
    }

    pub(crate) fn change(path: &str, content: &[u8]) -> Change {
        Change {
            path: path.into(),
            deleted: false,
            executable: false,
            content: content.to_vec(),
        }
    }

    fn deletion(path: &str) -> Change {
        Change {
            path: path.into(),
            deleted: true,
            executable: false,
            content: vec![],
        }
    }

    /// Everything a person's checkout holds outside the objects and task refs.
    pub(crate) fn checkout_state(dir: &Path, repo: &Repository) -> Vec<(String, Vec<u8>)> {
        let mut state = vec![
            (
                "HEAD ref".to_string(),
                fs::read(dir.join(".git/HEAD")).expect("HEAD"),
            ),
            (
                "HEAD commit".to_string(),
                repo.head()
                    .expect("head")
                    .target()
                    .expect("target")
                    .to_string()
                    .into_bytes(),
            ),
            (
                "index".to_string(),
                fs::read(dir.join(".git/index")).expect("index"),
            ),
        ];
        for (path, _, _) in BASE {
            state.push((path.to_string(), fs::read(dir.join(path)).expect("file")));
        }
        state
    }

    fn files(project: &Project, commit: &str) -> Vec<(String, bool, Vec<u8>)> {
        project
            .read_tree(commit)
            .expect("read tree")
            .into_iter()
            .map(|f| (f.path, f.executable, f.content))
            .collect()
    }

    #[test]
    fn branch_names_of_parent_and_subtask_differ() {
        assert_eq!(branch_name(&name("add-auth")), "automaton/add-auth");
        assert_eq!(branch_name(&name("add-auth/db")), "automaton/add-auth--db");
    }

    #[test]
    fn task_branch_starts_at_head_and_is_reused() {
        let (_dir, project, repo, head) = checkout();
        let task = name("add-auth");
        assert_eq!(branch_target(&repo, "add-auth"), None);
        let first = project.task_branch(&task).expect("branch").expect("repo");
        assert_eq!(first.branch, "automaton/add-auth");
        assert_eq!(first.commit, head.to_string());
        assert_eq!(branch_target(&repo, "add-auth"), Some(head));
        // main moves on; the task keeps its branch.
        let later = commit(&repo, Some(head), &[("README.md", b"later\n", MODE_FILE)]);
        repo.reference("refs/heads/main", later, true, "test")
            .expect("main");
        let again = project.task_branch(&task).expect("branch").expect("repo");
        assert_eq!(again, first);
        let other = project
            .task_branch(&name("other"))
            .expect("branch")
            .expect("repo");
        assert_eq!(other.commit, later.to_string());
    }

    #[test]
    fn parent_and_subtask_branches_coexist() {
        let (_dir, project, repo, head) = checkout();
        for tasks in [["a", "a/b"], ["c/d", "c"]] {
            for t in tasks {
                let b = project.task_branch(&name(t)).expect(t).expect("repo");
                assert_eq!(b.commit, head.to_string());
                assert_eq!(branch_target(&repo, t), Some(head), "{t}");
            }
        }
        assert_ne!(branch_name(&name("a")), branch_name(&name("a/b")));
    }

    #[test]
    fn project_without_repository_has_no_code() {
        let (_dir, project) = crate::project::tests::project();
        assert_eq!(project.task_branch(&name("t")).expect("no repo"), None);
        let err = project
            .read_tree("1234567890123456789012345678901234567890")
            .expect_err("no repo");
        assert!(matches!(err, Error::NoRepository { .. }), "{err}");
        assert_eq!(err.kind(), ErrorKind::NotFound);
    }

    #[test]
    fn a_task_branch_lock_left_by_a_killed_writer_is_swept_and_the_branch_moves_again() {
        let (_d, p, _repo, _) = checkout();
        let heads = p.root().join(".git/refs/heads/automaton");
        fs::create_dir_all(heads.join("sub")).expect("mkdir");
        fs::write(heads.join("t.lock"), "").expect("stale lock");
        fs::write(heads.join("sub/u.lock"), "").expect("stale lock");
        fs::write(heads.join("keep"), "").expect("not a lock");
        let mut swept = p.sweep_task_branch_locks().expect("sweep");
        swept.sort();
        assert_eq!(
            swept,
            [
                "refs/heads/automaton/sub/u.lock",
                "refs/heads/automaton/t.lock"
            ]
        );
        assert!(heads.join("keep").exists());
        assert!(!heads.join("t.lock").exists());
        assert_eq!(
            p.sweep_task_branch_locks().expect("again"),
            Vec::<String>::new()
        );
    }

    #[test]
    fn repository_without_commits_asks_for_a_first_commit() {
        let (dir, project) = crate::project::tests::project();
        Repository::init(dir.path()).expect("init");
        let err = project.task_branch(&name("t")).expect_err("unborn");
        assert!(matches!(err, Error::NoCommits { .. }), "{err}");
        assert!(err.to_string().contains("first commit"), "{err}");
        assert_eq!(err.kind(), ErrorKind::Refused);
    }

    #[test]
    fn read_tree_serves_files_with_exec_bits_without_task_store() {
        let (_dir, project, repo, head) = checkout();
        let with_links = commit(
            &repo,
            Some(head),
            &[
                ("link", b"README.md", MODE_SYMLINK as u32),
                ("vendor/sub", b"", 0o160000),
            ],
        );
        let got = files(&project, &with_links.to_string());
        let want = vec![
            (
                ".automaton-notes.md".to_string(),
                false,
                b"served\n".to_vec(),
            ),
            ("README.md".into(), false, b"hello\n".to_vec()),
            ("bin/run.sh".into(), true, b"#!/bin/sh\n".to_vec()),
            (
                "docs/.automaton/x.md".into(),
                false,
                b"served too\n".to_vec(),
            ),
            ("src/lib.rs".into(), false, b"pub fn f() {}\n".to_vec()),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn read_tree_refuses_trees_over_the_bounds() {
        let (_dir, project, _repo, head) = checkout();
        let head = head.to_string();
        assert_eq!(
            project
                .read_tree_bounded(&head, 5, 100)
                .expect("fits")
                .len(),
            5
        );
        for (max_files, max_bytes) in [(4, 100), (5, 40)] {
            let err = project
                .read_tree_bounded(&head, max_files, max_bytes)
                .expect_err("too large");
            assert!(matches!(err, Error::TreeTooLarge { .. }), "{err}");
            assert_eq!(err.kind(), ErrorKind::Refused);
        }
    }

    #[test]
    fn unknown_or_malformed_commit_ids_are_errors() {
        let (_dir, project, repo, head) = checkout();
        for bad in ["", "zzz", "abc", &"g".repeat(40), &"a".repeat(1 << 20)] {
            let err = project.read_tree(bad).expect_err("malformed");
            assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
            assert!(err.to_string().len() < 300);
        }
        let tree = repo.find_commit(head).expect("c").tree_id().to_string();
        for unknown in ["1234567890123456789012345678901234567890", tree.as_str()] {
            let err = project.read_tree(unknown).expect_err("unknown");
            assert!(matches!(err, Error::CommitNotFound { .. }), "{err}");
            assert_eq!(err.kind(), ErrorKind::NotFound);
        }
        project.task_branch(&name("t")).expect("branch");
        let err = project
            .apply_changes(&name("t"), "abc", &[], "agent", "m")
            .expect_err("malformed base");
        assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    }

    #[test]
    fn apply_commits_as_the_author_and_moves_only_the_branch() {
        let (dir, project, repo, head) = checkout();
        let task = name("add-auth");
        project.task_branch(&task).expect("branch");
        let before = checkout_state(dir.path(), &repo);
        let mut script = change("bin/new.sh", b"#!/bin/sh\necho\n");
        script.executable = true;
        let applied = project
            .apply_changes(
                &task,
                &head.to_string(),
                &[change("README.md", b"changed\n"), script],
                "agent-7",
                "Add the auth module\n\nDetails.",
            )
            .expect("apply");
        let id = Oid::from_str(applied.commit.as_deref().expect("a commit")).expect("oid");
        assert_eq!(applied.branch, "automaton/add-auth");
        assert_eq!(applied.files_changed, 2);
        assert_eq!(branch_target(&repo, "add-auth"), Some(id));
        let c = repo.find_commit(id).expect("commit");
        assert_eq!(c.parent_ids().collect::<Vec<_>>(), vec![head]);
        assert_eq!(c.message().ok(), Some("Add the auth module\n\nDetails."));
        for sig in [c.author(), c.committer()] {
            assert_eq!(sig.name().ok(), Some("agent-7"));
            assert_eq!(sig.email().ok(), Some("agent-7@automaton.invalid"));
        }
        let got = files(&project, &id.to_string());
        assert!(got.contains(&("README.md".into(), false, b"changed\n".to_vec())));
        assert!(got.contains(&("bin/new.sh".into(), true, b"#!/bin/sh\necho\n".to_vec())));
        assert!(got.contains(&("src/lib.rs".into(), false, b"pub fn f() {}\n".to_vec())));
        // The task store on the branch is kept as it was.
        let tree = c.tree().expect("tree");
        assert!(
            tree.get_path(Path::new(".automaton/tasks/t/.state"))
                .is_ok()
        );
        assert_eq!(checkout_state(dir.path(), &repo), before);
        assert_eq!(repo.head().expect("head").target(), Some(head));
    }

    #[test]
    fn no_op_changes_make_no_commit() {
        let (_dir, project, repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        for changes in [
            vec![],
            vec![change("README.md", b"hello\n")],
            vec![deletion("no/such/file")],
        ] {
            let applied = project
                .apply_changes(&task, &head.to_string(), &changes, "agent", "m")
                .expect("apply");
            assert_eq!(applied.commit, None, "{changes:?}");
            assert_eq!(applied.files_changed, 0);
            assert_eq!(branch_target(&repo, "t"), Some(head));
        }
    }

    #[test]
    fn deletion_removes_the_file() {
        let (_dir, project, _repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        let applied = project
            .apply_changes(
                &task,
                &head.to_string(),
                &[deletion("src/lib.rs")],
                "agent",
                "rm",
            )
            .expect("apply");
        assert_eq!(applied.files_changed, 1);
        let got = files(&project, applied.commit.as_deref().expect("commit"));
        assert!(got.iter().all(|f| f.0 != "src/lib.rs"), "{got:?}");
        assert!(got.iter().any(|f| f.0 == "README.md"));
    }

    #[test]
    fn the_same_patch_again_is_answered_with_its_commit_and_commits_nothing() {
        let (_dir, project, repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        let base = head.to_string();
        let changes = [change("README.md", b"first\n"), deletion("bin/run.sh")];
        let msg = "t: implement by a1 (fencing token 7)";
        let first = project
            .apply_changes(&task, &base, &changes, "a1", msg)
            .expect("first");
        assert_eq!(first.files_changed, 2);
        let tip = branch_target(&repo, "t");
        let again = project
            .apply_changes(&task, &base, &changes, "a1", msg)
            .expect("the same patch again");
        assert_eq!(again, first, "the same answer");
        assert_eq!(branch_target(&repo, "t"), tip, "no second commit");
        // An empty patch of the same lease made nothing: it is not taken for the retry.
        let empty = project
            .apply_changes(&task, &base, &[], "a1", msg)
            .expect("empty");
        assert_eq!(empty.commit, None);
        // Another lease's (another message), or other content, is judged as new: a conflict.
        for (content, author, msg) in [
            (
                &b"first\n"[..],
                "a2",
                "t: implement by a2 (fencing token 8)",
            ),
            (&b"other\n"[..], "a1", msg),
        ] {
            let err = project
                .apply_changes(&task, &base, &[change("README.md", content)], author, msg)
                .expect_err("not a retry");
            assert!(matches!(err, Error::PatchConflict { .. }), "{err}");
            assert_eq!(branch_target(&repo, "t"), tip);
        }
    }

    #[test]
    fn stale_base_touching_a_path_changed_since_is_refused() {
        let (_dir, project, repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        let base = head.to_string();
        project
            .apply_changes(&task, &base, &[change("README.md", b"first\n")], "a1", "1")
            .expect("first");
        let moved = branch_target(&repo, "t");
        for path in ["README.md", "README.md/inside"] {
            let err = project
                .apply_changes(
                    &task,
                    &base,
                    &[change("zzz.txt", b"x"), change(path, b"second\n")],
                    "a2",
                    "2",
                )
                .expect_err("conflict");
            let Error::PatchConflict { paths, .. } = &err else {
                panic!("not a conflict: {err}");
            };
            assert_eq!(paths, &vec![path.to_string()]);
            assert!(err.to_string().contains(path), "{err}");
            assert_eq!(err.kind(), ErrorKind::Refused);
            assert_eq!(branch_target(&repo, "t"), moved);
        }
    }

    #[test]
    fn stale_base_with_an_independent_change_applies_on_the_head() {
        let (_dir, project, repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        let base = head.to_string();
        let first = project
            .apply_changes(&task, &base, &[change("README.md", b"first\n")], "a1", "1")
            .expect("first");
        let second = project
            .apply_changes(
                &task,
                &base,
                &[change("src/lib.rs", b"// new\n")],
                "a2",
                "2",
            )
            .expect("independent");
        let id = Oid::from_str(second.commit.as_deref().expect("commit")).expect("oid");
        let parent = repo
            .find_commit(id)
            .expect("c")
            .parent_id(0)
            .expect("parent");
        assert_eq!(Some(parent.to_string()), first.commit);
        let got = files(&project, &id.to_string());
        assert!(got.contains(&("README.md".into(), false, b"first\n".to_vec())));
        assert!(got.contains(&("src/lib.rs".into(), false, b"// new\n".to_vec())));
    }

    #[test]
    fn bad_paths_are_refused_and_nothing_changes() {
        let (_dir, project, repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        let long = "a".repeat(1 << 20);
        for bad in [
            "../x",
            "/etc/passwd",
            ".git/config",
            "src/.git/config",
            ".automaton/tasks/t/.state",
            ".automaton",
            "a//b",
            "a/./b",
            "a/",
            "",
            "a\0b",
            long.as_str(),
        ] {
            let err = project
                .apply_changes(
                    &task,
                    &head.to_string(),
                    &[change("ok.txt", b"fine"), change(bad, b"evil")],
                    "agent",
                    "m",
                )
                .expect_err(bad);
            assert!(matches!(err, Error::BadPath { .. }), "{err}");
            assert_eq!(err.kind(), ErrorKind::Invalid);
            assert!(err.to_string().len() < 300, "{err}");
            assert_eq!(branch_target(&repo, "t"), Some(head));
        }
        let twice = [change("a", b"1"), change("a", b"2")];
        let err = project
            .apply_changes(&task, &head.to_string(), &twice, "agent", "m")
            .expect_err("twice");
        assert!(err.to_string().contains("twice"), "{err}");
        for author in ["", "a<b>", "a\nb"] {
            let err = project
                .apply_changes(&task, &head.to_string(), &[change("x", b"1")], author, "m")
                .expect_err("bad author");
            assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
        }
        assert_eq!(branch_target(&repo, "t"), Some(head));
    }

    #[test]
    fn apply_needs_the_task_branch() {
        let (_dir, project, _repo, head) = checkout();
        let err = project
            .apply_changes(&name("t"), &head.to_string(), &[], "agent", "m")
            .expect_err("no branch");
        assert!(matches!(err, Error::NoBranch { .. }), "{err}");
        assert_eq!(err.kind(), ErrorKind::NotFound);
    }

    #[test]
    fn a_branch_moved_during_apply_is_retried_then_given_up() {
        let (_dir, project, _repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        let refname = "refs/heads/automaton/t";
        let mut moves = 0;
        let mut racer = |r: &Repository| {
            if moves == 0 {
                let tip = r
                    .find_reference(refname)
                    .expect("ref")
                    .target()
                    .expect("oid");
                let next = commit(r, Some(tip), &[("other.txt", b"racer\n", MODE_FILE)]);
                r.reference(refname, next, true, "racer").expect("move");
            }
            moves += 1;
        };
        let applied = project
            .apply_changes_with(
                &task,
                &head.to_string(),
                &[change("README.md", b"mine\n")],
                "agent",
                "m",
                &mut racer,
            )
            .expect("retried");
        assert_eq!(moves, 2);
        let id = Oid::from_str(applied.commit.as_deref().expect("commit")).expect("oid");
        let got = files(&project, &id.to_string());
        assert!(got.contains(&("other.txt".into(), false, b"racer\n".to_vec())));
        assert!(got.contains(&("README.md".into(), false, b"mine\n".to_vec())));

        let mut always = |r: &Repository| {
            let tip = r
                .find_reference(refname)
                .expect("ref")
                .target()
                .expect("oid");
            let next = commit(r, Some(tip), &[("other.txt", tip.as_bytes(), MODE_FILE)]);
            r.reference(refname, next, true, "racer").expect("move");
        };
        let err = project
            .apply_changes_with(
                &task,
                &id.to_string(),
                &[change("src/lib.rs", b"x\n")],
                "agent",
                "m",
                &mut always,
            )
            .expect_err("gave up");
        assert!(matches!(err, Error::BranchRace { .. }), "{err}");
    }

    /// Aliases of `.git` that git itself refuses (core.protectNTFS and core.protectHFS on).
    const DOTGIT_ALIASES: &[&str] = &[
        ".git/config",
        ".GIT/config",
        ".Git/HEAD",
        "src/.git/config",
        "src/.git",
        ".g\u{200c}it/config",
        "\u{200c}.git/x",
        ".git\u{200d}/x",
        ".gi\u{200e}t/x",
        ".g\u{200f}it",
        ".g\u{202a}it/x",
        ".g\u{202e}it/x",
        ".g\u{206a}it/x",
        ".g\u{206f}it/x",
        ".g\u{feff}it/x",
        ".git./config",
        ".git /config",
        ".git . ./x",
        ".git::$INDEX_ALLOCATION/x",
        ".git:/x",
        ".git:stream",
        "git~1/config",
        "GIT~1/config",
        "git~1. /x",
        ".git\\config",
        "a\\.git\\config",
        "a\\git~1\\b",
    ];

    /// Other spellings of the files git protects as links: git refuses them as symlinks
    /// only; the store refuses them in any component.
    const DOTFILE_ALIASES: &[&str] = &[
        "gitmod~1",
        "GITMOD~4",
        ".gitmodules.",
        ".gitmodules ",
        ".GITMODULES",
        ".gitmodules::$DATA",
        ".git\u{200c}modules",
        "gi7eba~1",
        "gi7eb~12",
        "sub/gitmod~2",
        "gitign~1",
        "gi250a~1",
        ".gitignore.",
        ".GitIgnore",
        "gitatt~1",
        "gi7d29~1",
        ".gitattributes ",
        "mailma~1",
        "maba30~1",
        ".mailmap.",
    ];

    /// What git must accept, and so must the store.
    const LEGIT: &[&str] = &[
        ".github/workflows/ci.yml",
        "git/x",
        ".gitkeep",
        "a.git/x",
        "x.git",
        "git~2/x",
        "git~10/x",
        ".git~1/x",
        ".git.foo",
        ".gitfoo/x",
        ".gitmodules",
        ".gitignore",
        "src/.gitignore",
        ".gitattributes",
        ".mailmap",
        "gitmod~5",
        ".gitmodulesx",
        "my.gitignore",
        "a\\b.txt",
        "automaton/x",
        "src/.automaton/x",
        "\u{200c}file.txt",
        "d\u{e9}j\u{e0}.md",
    ];

    /// Whether git (2.x, with core.protectNTFS and core.protectHFS on) lets `path` into an
    /// index as a file of `mode` (`100644`, or `120000` for a link): git's own verify_path.
    fn git_accepts(repo: &Path, path: &str, mode: &str) -> bool {
        let blob = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391";
        std::process::Command::new("git")
            .args(["-c", "core.protectNTFS=true", "-c", "core.protectHFS=true"])
            .args(["update-index", "--add", "--cacheinfo"])
            .arg(format!("{mode},{blob},{path}"))
            .current_dir(repo)
            .env("GIT_INDEX_FILE", repo.join("probe-index"))
            .stderr(std::process::Stdio::null())
            .status()
            .expect("run git")
            .success()
    }

    #[test]
    fn git_path_aliases_are_refused_as_git_refuses_them_and_git_legit_names_pass() {
        let (dir, project, repo, head) = checkout();
        let task = name("t");
        project.task_branch(&task).expect("branch");
        for bad in DOTGIT_ALIASES {
            assert!(!git_accepts(dir.path(), bad, "100644"), "git takes {bad:?}");
        }
        for bad in DOTFILE_ALIASES {
            // git takes them as files; as links, the .gitmodules ones are refused.
            assert!(
                git_accepts(dir.path(), bad, "100644"),
                "git refuses {bad:?}"
            );
            if bad.contains("mod") || bad.contains("gi7eb") {
                assert!(!git_accepts(dir.path(), bad, "120000"), "git links {bad:?}");
            }
        }
        let root_aliases = [
            ".AUTOMATON/tasks/t/.state",
            ".automaton./x",
            ".automaton /x",
            ".autom\u{200c}aton/x",
            "automa~1/x",
            ".automaton\\tasks\\t\\.state",
        ];
        for bad in DOTGIT_ALIASES
            .iter()
            .chain(DOTFILE_ALIASES)
            .chain(&root_aliases)
        {
            let err = project
                .apply_changes(
                    &task,
                    &head.to_string(),
                    &[change("ok.txt", b"fine"), change(bad, b"evil")],
                    "agent",
                    "m",
                )
                .expect_err(bad);
            assert!(matches!(err, Error::BadPath { .. }), "{bad:?}: {err}");
            assert_eq!(err.kind(), ErrorKind::Invalid, "{bad:?}");
            let text = err.to_string();
            assert!(text.len() < 400 && !text.contains('\n'), "{text}");
            assert_eq!(branch_target(&repo, "t"), Some(head), "{bad:?}");
        }
        for ok in LEGIT {
            assert_eq!(path_problem(ok), None, "{ok:?}");
            assert!(git_accepts(dir.path(), ok, "100644"), "git refuses {ok:?}");
        }
        // Each legit name commits, and git fsck finds nothing wrong with the result.
        let changes: Vec<Change> = LEGIT.iter().map(|p| change(p, b"x\n")).collect();
        let applied = project
            .apply_changes(&task, &head.to_string(), &changes, "agent", "m")
            .expect("legit names commit");
        assert!(applied.commit.is_some());
        let fsck = std::process::Command::new("git")
            .args(["fsck", "--strict", "--no-dangling"])
            .current_dir(dir.path())
            .output()
            .expect("git fsck");
        assert!(fsck.status.success(), "{fsck:?}");
    }

    #[test]
    fn conflict_message_lists_ten_paths_then_a_count() {
        let paths: Vec<String> = (0..13).map(|i| format!("f{i:02}")).collect();
        let listed = list_paths(&paths);
        assert!(
            listed.contains("'f09'") && !listed.contains("'f10'"),
            "{listed}"
        );
        assert!(listed.ends_with("and 3 more"), "{listed}");
        assert_eq!(list_paths(&paths[..1]), "path 'f00'");
    }
}
