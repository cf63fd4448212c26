//! Finished work, delivered (issue 31): a top-level task's branch lands on its base branch
//! (`merge`), and a task whose code cannot land as it was reviewed goes back to `implement`
//! on top of the head it must build on (`rework_onto`, for a sub-task's conflicting merge
//! into its parent's branch as for a delivery's).
//!
//! The delivery's own record is `.state.delivery` (seed 003's worktree lifecycle, JSON, written
//! like every state file: temporary file, synced, renamed, replicated first). This module
//! owns the git side of each step: the merge built in memory ([`Project::prepare_delivery`]:
//! only a fast-forward, or a merge that changed no path the task touched, is the reviewed
//! tree), and the base moved by compare-and-swap ([`Project::land_delivery`]: a ref update
//! from the head the merge was built on, or a push with git's `--force-with-lease`, or — for
//! a base checked out in the project — git's own `merge --ff-only`, which refuses to overwrite
//! a person's uncommitted changes). Each step can be run again after a crash: a landed commit
//! is recognised, never landed twice. The coordinator decides when each step runs.

use std::path::Path;

use automaton_workflow::{Artifact, Phase, State, TaskName};
use git2::{FileFavor, MergeOptions, Oid, Repository};
use serde::{Deserialize, Serialize};

use crate::fsx::{self, sync_dir};
use crate::git::{branch_name, branch_ref, parse_commit_id};
use crate::git_remote::run_git;
use crate::project::STATE;
use crate::{Error, Project};

/// The delivery record of a top-level task.
pub(crate) const DELIVERY: &str = ".state.delivery";
/// The branch HEAD named when the task's branch was made (its default base).
pub(crate) const BASE: &str = ".state.base";
/// What a task sent back to `implement` is told of the conflict: served to its agents with
/// its artifacts, named in the built-in implement prompt.
pub const CONFLICTS: &str = "CONFLICTS.md";
/// The largest delivery record read.
const MAX_DELIVERY_FILE: u64 = 1 << 20;
/// Paths whose two sides `CONFLICTS.md` shows, and the bytes of each side shown.
const SHOWN_PATHS: usize = 20;
const SHOWN_BYTES: usize = 16 * 1024;
/// Where a remote base is fetched to (not a branch: nothing a person checks out).
const FETCHED: &str = "refs/automaton/delivery/";

pub use automaton_workflow::DeliveryState;

/// How a branch lands on its base.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Strategy {
    /// Only when the base has not moved: the base then points at the reviewed commit.
    #[serde(rename = "ff-only")]
    FfOnly,
    /// A fast-forward when the base has not moved, else a merge commit of the two.
    #[serde(rename = "merge")]
    Merge,
    /// One new commit on the base with the branch's tree (merged).
    #[serde(rename = "squash")]
    Squash,
}

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::FfOnly => "ff-only",
            Strategy::Merge => "merge",
            Strategy::Squash => "squash",
        }
    }

    pub fn parse(s: &str) -> Option<Strategy> {
        match s {
            "ff-only" => Some(Strategy::FfOnly),
            "merge" => Some(Strategy::Merge),
            "squash" => Some(Strategy::Squash),
            _ => None,
        }
    }
}

/// A top-level task's delivery. Every field is optional on disk.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeliveryRecord {
    pub state: DeliveryState,
    /// `merge` or `pull_request`.
    pub mode: String,
    /// `ff-only`, `merge` or `squash` (`merge` mode).
    pub strategy: String,
    /// The branch it lands on.
    pub base: String,
    /// The task's branch.
    pub branch: String,
    /// Where the base lives: a git remote, or empty for this repository.
    pub remote: String,
    /// The task branch's head when it completed: the revision that was reviewed, and the
    /// only one this delivery lands.
    pub revision: String,
    /// The base's head the landing commit was built on.
    pub base_before: String,
    /// The commit the base points at once landed (the revision itself, a merge or a squash).
    pub commit: String,
    /// `fast-forward`, `merge commit` or `squash commit`.
    pub how: String,
    /// The pull request (`pull_request` mode).
    pub url: String,
    pub number: u64,
    /// With `approve = true`: the operator who let it land.
    pub approved_by: String,
    /// Why it waits for a person; empty when it does not.
    pub waiting: String,
    /// The last failure, and how many there were.
    pub failure: String,
    pub failures: u32,
    /// Who abandoned it, and why.
    pub abandoned_by: String,
    /// Milliseconds since the Unix epoch.
    pub requested_ms: u64,
    pub updated_ms: u64,
}

/// What [`Project::prepare_delivery`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prepared {
    /// The base holds the revision already (landed earlier, or by a person).
    Already { commit: String },
    /// `commit` lands by moving the base from `base_before`.
    Ready {
        base_before: String,
        commit: String,
        how: &'static str,
    },
    /// No tree the base could get is the reviewed one: `why`, with the paths both changed.
    NotAsReviewed {
        base_head: String,
        paths: Vec<String>,
        why: String,
    },
}

/// What [`Project::rework_onto`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rework {
    /// The paths both sides changed (their conflict, or the overlap).
    pub paths: Vec<String>,
    /// The task branch's head now (it contains the head it builds on).
    pub head: String,
    /// Whether this call moved the task to `implement` (false: an earlier one had).
    pub moved: bool,
}

/// A task branch [`Project::collect_branches`] looked at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collected {
    pub task: TaskName,
    pub branch: String,
    /// Removed (or, in a dry run, would be).
    pub removed: bool,
    /// Why it goes, or why it stays.
    pub why: String,
}

/// The branch HEAD names in `root`'s repository now, if it names one.
pub fn head_branch_name(repo: &Repository) -> Option<String> {
    let head = repo.find_reference("HEAD").ok()?;
    let target = head.symbolic_target().ok().flatten()?;
    target.strip_prefix("refs/heads/").map(str::to_string)
}

fn short(id: &str) -> &str {
    id.get(..12).unwrap_or(id)
}

/// `sub`'s bounded excerpt of a blob, as text.
fn side(repo: &Repository, tree: Option<&git2::Tree<'_>>, path: &str) -> String {
    let Some(tree) = tree else {
        return "(no such commit)".into();
    };
    let Ok(entry) = tree.get_path(Path::new(path)) else {
        return "(absent: deleted on this side)".into();
    };
    let Ok(blob) = repo.find_blob(entry.id()) else {
        return "(not a file)".into();
    };
    let bytes = blob.content();
    if blob.is_binary() {
        return format!("(binary, {} bytes)", bytes.len());
    }
    let cut = bytes.len() > SHOWN_BYTES;
    let mut text = String::from_utf8_lossy(&bytes[..bytes.len().min(SHOWN_BYTES)]).into_owned();
    if cut {
        text.push_str(&format!(
            "\n… (cut at {SHOWN_BYTES} of {} bytes)",
            bytes.len()
        ));
    }
    text
}

impl Project {
    /// `task`'s delivery record, if it has one.
    pub fn read_delivery(&self, task: &TaskName) -> Result<Option<DeliveryRecord>, Error> {
        let path = self.task_dir(task).join(DELIVERY);
        let Some(bytes) = fsx::read_capped(&self.meta, &path, MAX_DELIVERY_FILE)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| Error::CorruptDelivery {
                path,
                detail: e.to_string(),
            })
    }

    /// Writes `task`'s delivery record durably (replicated first).
    pub fn write_delivery(&self, task: &TaskName, record: &DeliveryRecord) -> Result<(), Error> {
        let dir = self.task_dir(task);
        if !self.is_real_dir(&dir)? {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: String::new(),
            });
        }
        let path = dir.join(DELIVERY);
        let bytes = serde_json::to_vec_pretty(record).map_err(|e| Error::CorruptDelivery {
            path: path.clone(),
            detail: e.to_string(),
        })?;
        self.write(&path, &bytes)
    }

    /// The branch HEAD named when `task`'s branch was made (see `task_branch`), else the one
    /// it names now; `None` without a repository or with a detached HEAD.
    pub fn base_of(&self, task: &TaskName) -> Result<Option<String>, Error> {
        if let Some(text) = self.read_optional(&self.task_dir(task).join(BASE))? {
            let name = text.trim();
            if !name.is_empty() {
                return Ok(Some(name.to_string()));
            }
        }
        Ok(self.repository()?.as_ref().and_then(head_branch_name))
    }

    /// Records the branch HEAD names as `task`'s base, once (a top-level task's branch is
    /// being made).
    pub(crate) fn record_base(&self, task: &TaskName, repo: &Repository) -> Result<(), Error> {
        let Some(name) = head_branch_name(repo) else {
            return Ok(());
        };
        let path = self.task_dir(task).join(BASE);
        if task.parent().is_some() || self.read_optional(&path)?.is_some() {
            return Ok(());
        }
        if !self.is_real_dir(&self.task_dir(task))? {
            return Ok(());
        }
        self.write(&path, format!("{name}\n").as_bytes())
    }

    /// The head of `task`'s branch, if it has one.
    pub fn branch_head(&self, task: &TaskName) -> Result<Option<String>, Error> {
        let Some(repo) = self.repository()? else {
            return Ok(None);
        };
        Ok(self
            .branch_commit(&repo, &branch_ref(task))?
            .map(|c| c.to_string()))
    }

    /// The base's head: in this repository, or fetched from `remote`.
    fn base_head(
        &self,
        repo: &Repository,
        task: &TaskName,
        base: &str,
        remote: Option<&str>,
    ) -> Result<Oid, Error> {
        let no_base = |where_: String| Error::NoBase {
            task: task.clone(),
            base: base.to_string(),
            where_,
        };
        let refname = match remote {
            Some(remote) => {
                let fetched = format!("{FETCHED}{base}");
                let spec = format!("+refs/heads/{base}:{fetched}");
                run_git(&self.root, &["fetch", "--quiet", remote, &spec]).map_err(|why| {
                    if why.contains("couldn't find remote ref") {
                        no_base(format!("the remote {remote}"))
                    } else {
                        Error::SharedRemote {
                            action: "fetch the base branch from",
                            remote: remote.to_string(),
                            why,
                        }
                    }
                })?;
                fetched
            }
            None => format!("refs/heads/{base}"),
        };
        self.branch_commit(repo, &refname)?
            .ok_or_else(|| no_base(self.root.display().to_string()))
    }

    /// Builds what lands `revision` (the reviewed head of `task`'s branch) on `base` by
    /// `strategy`, in memory, writing objects only. The base gets the reviewed tree or
    /// nothing: a fast-forward, or (strategy `merge`/`squash`) a merge that changed no path
    /// the task changed; anything else is [`Prepared::NotAsReviewed`].
    pub fn prepare_delivery(
        &self,
        task: &TaskName,
        base: &str,
        strategy: Strategy,
        revision: &str,
        remote: Option<&str>,
        title: &str,
    ) -> Result<Prepared, Error> {
        let repo = self.durable_repository()?;
        let base_head = self.base_head(&repo, task, base, remote)?;
        let rev = parse_commit_id(revision)?;
        let rev_commit = self.find_commit(&repo, rev)?;
        let base_commit = self.find_commit(&repo, base_head)?;
        if self.contains(&repo, base_head, rev)? {
            return Ok(Prepared::Already {
                commit: base_head.to_string(),
            });
        }
        let not_as_reviewed = |paths: Vec<String>, why: String| {
            Ok(Prepared::NotAsReviewed {
                base_head: base_head.to_string(),
                paths,
                why,
            })
        };
        let fork = match repo.merge_base(base_head, rev) {
            Ok(f) => f,
            Err(e) if e.code() == git2::ErrorCode::NotFound => {
                return not_as_reviewed(
                    Vec::new(),
                    format!("'{base}' and the task's branch share no history"),
                );
            }
            Err(e) => return Err(self.git("find where the branch left its base")(e)),
        };
        let message = format!(
            "{title}\n\nautomaton: task {task} delivered from {} at {revision} ({}).\n",
            branch_name(task),
            strategy.name()
        );
        if fork == base_head {
            return Ok(match strategy {
                Strategy::FfOnly | Strategy::Merge => Prepared::Ready {
                    base_before: base_head.to_string(),
                    commit: revision.to_string(),
                    how: "fast-forward",
                },
                Strategy::Squash => {
                    let tree = rev_commit.tree().map_err(self.git("read a tree"))?;
                    let c = self.deterministic_commit(
                        &repo,
                        &message,
                        &tree,
                        &[&base_commit],
                        Some(&rev_commit),
                    )?;
                    Prepared::Ready {
                        base_before: base_head.to_string(),
                        commit: c.to_string(),
                        how: "squash commit",
                    }
                }
            });
        }
        if strategy == Strategy::FfOnly {
            return not_as_reviewed(
                Vec::new(),
                format!(
                    "'{base}' moved on since the task's branch left it ({} → {}), and the strategy is ff-only",
                    short(&fork.to_string()),
                    short(&base_head.to_string())
                ),
            );
        }
        let fork_tree = self
            .find_commit(&repo, fork)?
            .tree()
            .map_err(self.git("read a tree"))?;
        let rev_tree = rev_commit.tree().map_err(self.git("read a tree"))?;
        let base_tree = base_commit.tree().map_err(self.git("read a tree"))?;
        let ours = self.changed_paths(&repo, &fork_tree, &rev_tree)?;
        let theirs = self.changed_paths(&repo, &fork_tree, &base_tree)?;
        let both: Vec<String> = ours.intersection(&theirs).cloned().collect();
        if !both.is_empty() {
            return not_as_reviewed(
                both.clone(),
                format!(
                    "'{base}' changed {} since the task's branch left it, and so did the task: merged, the task's code would not be what was reviewed",
                    crate::git::list_paths(&both)
                ),
            );
        }
        let mut index = repo
            .merge_commits(&base_commit, &rev_commit, None)
            .map_err(self.git("merge the task's branch"))?;
        if index.has_conflicts() {
            let paths = conflict_paths(&mut index);
            return not_as_reviewed(
                paths.clone(),
                format!(
                    "the task's branch conflicts with '{base}' in {}",
                    crate::git::list_paths(&paths)
                ),
            );
        }
        let tree_id = index
            .write_tree_to(&repo)
            .map_err(self.git("write the merged tree"))?;
        let tree = repo.find_tree(tree_id).map_err(self.git("read a tree"))?;
        let (parents, how): (Vec<&git2::Commit<'_>>, _) = match strategy {
            Strategy::Squash => (vec![&base_commit], "squash commit"),
            _ => (vec![&base_commit, &rev_commit], "merge commit"),
        };
        let c = self.deterministic_commit(&repo, &message, &tree, &parents, Some(&rev_commit))?;
        Ok(Prepared::Ready {
            base_before: base_head.to_string(),
            commit: c.to_string(),
            how,
        })
    }

    /// Moves `base` from `base_before` to `commit`, or finds it landed already. In this
    /// repository: a compare-and-swap of the ref, or — when `base` is the branch checked out
    /// here — git's `merge --ff-only` (the checkout follows; a person's uncommitted change it
    /// would overwrite refuses it: [`Error::CheckoutBusy`]). On `remote`: a push with
    /// `--force-with-lease` on `base_before`. A base that moved elsewhere is
    /// [`Error::BaseMoved`], and nothing is overwritten. Returns whether this call moved it.
    pub fn land_delivery(
        &self,
        task: &TaskName,
        base: &str,
        base_before: &str,
        commit: &str,
        remote: Option<&str>,
    ) -> Result<bool, Error> {
        let repo = self.durable_repository()?;
        let target = parse_commit_id(commit)?;
        let before = parse_commit_id(base_before)?;
        let now = self.base_head(&repo, task, base, remote)?;
        if self.contains(&repo, now, target)? {
            return Ok(false);
        }
        let moved = |now: Oid| Error::BaseMoved {
            task: task.clone(),
            base: base.to_string(),
            moved: format!(
                "it is at {}, the merge was built on {}",
                short(&now.to_string()),
                short(base_before)
            ),
        };
        if let Some(remote) = remote {
            // The lease is the compare-and-swap: the push lands only if the remote's base is
            // still `base_before`, whatever the fetch above saw.
            let lease = format!("--force-with-lease=refs/heads/{base}:{base_before}");
            let spec = format!("{commit}:refs/heads/{base}");
            return match run_git(&self.root, &["push", "--quiet", &lease, remote, &spec]) {
                Ok(_) => Ok(true),
                Err(why) if why.contains("stale info") || why.contains("rejected") => {
                    let now = self.base_head(&repo, task, base, Some(remote))?;
                    if self.contains(&repo, now, target)? {
                        Ok(false)
                    } else {
                        Err(moved(now))
                    }
                }
                Err(why) => Err(Error::SharedRemote {
                    action: "push the base branch to",
                    remote: remote.to_string(),
                    why,
                }),
            };
        }
        if now != before {
            return Err(moved(now));
        }
        let checked_out = !repo.is_bare() && head_branch_name(&repo).as_deref() == Some(base);
        if checked_out {
            return match run_git(
                &self.root,
                &[
                    "-c",
                    "core.fsync=all",
                    "merge",
                    "--ff-only",
                    "--quiet",
                    "--no-edit",
                    commit,
                ],
            ) {
                Ok(_) => Ok(true),
                Err(why) if why.contains("Not possible to fast-forward") => {
                    let repo = self.repository()?.ok_or_else(|| Error::NoRepository {
                        root: self.root.clone(),
                    })?;
                    Err(moved(self.base_head(&repo, task, base, None)?))
                }
                Err(why) => Err(Error::CheckoutBusy {
                    task: task.clone(),
                    base: base.to_string(),
                    why: format!(
                        "{} ({})",
                        why.lines().next().unwrap_or("git merge failed"),
                        self.root.display()
                    ),
                }),
            };
        }
        let refname = format!("refs/heads/{base}");
        let log = format!("automaton: deliver {task}");
        match repo.reference_matching(&refname, target, true, before, &log) {
            Ok(_) => {}
            Err(e) if e.code() == git2::ErrorCode::Modified => {
                return Err(moved(self.base_head(&repo, task, base, None)?));
            }
            Err(e) => return Err(self.git("move the base branch")(e)),
        }
        let heads = repo.commondir().join(&refname);
        if let Some(dir) = heads.parent() {
            sync_dir(dir)?;
        }
        Ok(true)
    }

    /// Whether this repository has commit `id` (a delivery's commit built by another leader
    /// may not have reached it: it is then built again, to the same id).
    pub fn has_commit(&self, id: &str) -> Result<bool, Error> {
        let Some(repo) = self.repository()? else {
            return Ok(false);
        };
        let Ok(oid) = parse_commit_id(id) else {
            return Ok(false);
        };
        Ok(repo.find_commit(oid).is_ok())
    }

    /// Pushes `revision` to `task`'s branch on `remote` (a pull request's head): a
    /// fast-forward, never forced.
    pub fn push_task_branch(
        &self,
        task: &TaskName,
        revision: &str,
        remote: &str,
    ) -> Result<(), Error> {
        parse_commit_id(revision)?;
        let spec = format!("{revision}:refs/heads/{}", branch_name(task));
        run_git(&self.root, &["push", "--quiet", remote, &spec])
            .map(drop)
            .map_err(|why| Error::SharedRemote {
                action: "push the task branch to",
                remote: remote.to_string(),
                why,
            })
    }

    /// Sends `task` back to `implement` on top of `onto` (its parent branch's head, or its
    /// base's), from `complete`: its branch gets a commit that merges `onto` (a path both
    /// changed takes `onto`'s side), `CONFLICTS.md` gives its agent the paths and both sides,
    /// its later phases' artifacts become `PREVIOUS_*` (its reviews run again: the revision
    /// changed), and then its state moves. Each step can be run again: a task already moved
    /// back is left as it is.
    pub fn rework_onto(&self, task: &TaskName, onto: &str, why: &str) -> Result<Rework, Error> {
        let _lock = self.lock(task)?;
        let (folder, state) = self.tracked(task)?;
        let repo = self.durable_repository()?;
        let refname = branch_ref(task);
        let head = self
            .branch_commit(&repo, &refname)?
            .ok_or_else(|| Error::NoBranch {
                task: task.clone(),
                branch: branch_name(task),
            })?;
        if state == State::open(Phase::Implement) {
            return Ok(Rework {
                paths: Vec::new(),
                head: head.to_string(),
                moved: false,
            });
        }
        if state != State::open(Phase::Complete) {
            return Err(Error::Transition(
                automaton_workflow::TransitionError::Illegal {
                    current: state,
                    target: State::open(Phase::Implement),
                    legal: state.legal_targets(),
                },
            ));
        }
        let onto_id = parse_commit_id(onto)?;
        let onto_commit = self.find_commit(&repo, onto_id)?;
        let head_commit = self.find_commit(&repo, head)?;
        let fork = repo.merge_base(onto_id, head).ok();
        // The paths both sides changed since they parted.
        let mut plain = repo
            .merge_commits(&onto_commit, &head_commit, None)
            .map_err(self.git("merge the task's branch"))?;
        let mut paths = if plain.has_conflicts() {
            conflict_paths(&mut plain)
        } else {
            Vec::new()
        };
        if paths.is_empty()
            && let Some(fork) = fork
        {
            let fork_tree = self
                .find_commit(&repo, fork)?
                .tree()
                .map_err(self.git("read a tree"))?;
            let ours = self.changed_paths(
                &repo,
                &fork_tree,
                &head_commit.tree().map_err(self.git("read a tree"))?,
            )?;
            let theirs = self.changed_paths(
                &repo,
                &fork_tree,
                &onto_commit.tree().map_err(self.git("read a tree"))?,
            )?;
            paths = ours.intersection(&theirs).cloned().collect();
        }
        let fork_tree = match fork {
            Some(f) => Some(
                self.find_commit(&repo, f)?
                    .tree()
                    .map_err(self.git("read a tree"))?,
            ),
            None => None,
        };
        let conflicts = conflicts_md(
            task,
            why,
            onto,
            &head.to_string(),
            &paths,
            |p| side(&repo, fork_tree.as_ref(), p),
            |p| side(&repo, head_commit.tree().ok().as_ref(), p),
            |p| side(&repo, onto_commit.tree().ok().as_ref(), p),
        );
        // 1. The branch, unless it holds `onto` already (a retry).
        let new_head = if self.contains(&repo, head, onto_id)? {
            head
        } else {
            let mut opts = MergeOptions::new();
            opts.file_favor(FileFavor::Ours);
            let mut index = repo
                .merge_commits(&onto_commit, &head_commit, Some(&opts))
                .map_err(self.git("merge the task's branch"))?;
            take_ours(&mut index).map_err(self.git("settle the merge's conflicts"))?;
            let tree_id = index
                .write_tree_to(&repo)
                .map_err(self.git("write the merged tree"))?;
            let tree = repo.find_tree(tree_id).map_err(self.git("read a tree"))?;
            let message = format!(
                "automaton: rework {task} onto {}\n\n{why}\nWhere both sides changed a path, it holds {}'s side: see {CONFLICTS}.\n",
                short(onto),
                short(onto)
            );
            let c = self.deterministic_commit(
                &repo,
                &message,
                &tree,
                &[&head_commit, &onto_commit],
                None,
            )?;
            let branch = branch_name(task);
            self.share_branch_head(task, &branch, &c.to_string())?;
            let log = format!("automaton: rework {task}");
            match repo.reference_matching(&refname, c, true, head, &log) {
                Ok(_) => {}
                Err(e) if e.code() == git2::ErrorCode::Modified => {
                    return Err(Error::BranchRace {
                        task: task.clone(),
                        branch,
                    });
                }
                Err(e) => return Err(self.git("move the task branch")(e)),
            }
            c
        };
        // 2. What the agent is told.
        self.write(&folder.dir.join(CONFLICTS), conflicts.as_bytes())?;
        // 3. The reviews of the old revision, kept as context; 4. the state, last: a crash
        // before it leaves the task complete, and the caller's record of the rework makes it
        // run this again.
        self.reopen_at(&folder, Phase::Implement)?;
        Ok(Rework {
            paths,
            head: new_head.to_string(),
            moved: true,
        })
    }

    /// `automaton gc --branches`: removes the task branches whose work is safe without
    /// them — a top-level task's (and its sub-tasks') once its delivery is `merged` and its
    /// base holds the branch's head, or once a person abandoned the delivery. Each branch is
    /// removed only if it still points where it was checked (a branch moved meanwhile
    /// stays), here and, with a shared remote, there. Every other delivered task's branch is
    /// listed with why it stays. `dry_run`: nothing is removed.
    pub fn collect_branches(&self, dry_run: bool) -> Result<Vec<Collected>, Error> {
        let Some(_) = self.repository()? else {
            return Ok(Vec::new());
        };
        let repo = self.durable_repository()?;
        let mut out = Vec::new();
        for entry in self.list(std::time::SystemTime::now())? {
            let task = entry.task.clone();
            let Some(record) = self.read_delivery(&task)? else {
                continue;
            };
            let mut branches = vec![task.clone()];
            branches.extend(entry.subtasks.iter().map(|s| s.task.clone()));
            let safe: Result<String, String> = match record.state {
                DeliveryState::Abandoned => Ok(format!(
                    "its delivery was abandoned by {}",
                    if record.abandoned_by.is_empty() {
                        "a person"
                    } else {
                        &record.abandoned_by
                    }
                )),
                DeliveryState::Merged => {
                    let remote = (!record.remote.is_empty()).then_some(record.remote.as_str());
                    match self.base_head(&repo, &task, &record.base, remote) {
                        Ok(base) => Ok(base.to_string()),
                        Err(e) => Err(format!("cannot read its base: {e}")),
                    }
                }
                other => Err(format!("its delivery is {}", other.name())),
            };
            for t in branches {
                let refname = branch_ref(&t);
                let Some(head) = self.branch_commit(&repo, &refname)? else {
                    continue;
                };
                let verdict = match &safe {
                    Err(why) => Err(why.clone()),
                    Ok(base) if record.state == DeliveryState::Merged => {
                        let base_id = parse_commit_id(base)?;
                        if self.contains(&repo, base_id, head)? {
                            Ok(format!("merged into {} ({})", record.base, short(base)))
                        } else {
                            Err(format!(
                                "its head {} is not on {}: it changed after the merge",
                                short(&head.to_string()),
                                record.base
                            ))
                        }
                    }
                    Ok(why) => Ok(why.clone()),
                };
                let branch = branch_name(&t);
                let (removed, why) = match verdict {
                    Err(why) => (false, why),
                    Ok(why) if dry_run => (true, why),
                    Ok(why) => match self.remove_branch(&repo, &t, &refname, head) {
                        Ok(()) => (true, why),
                        Err(e) => (false, format!("not removed: {e}")),
                    },
                };
                out.push(Collected {
                    task: t,
                    branch,
                    removed,
                    why,
                });
            }
        }
        Ok(out)
    }

    /// Removes `refname` if it still points at `head`: on the shared remote first (so that a
    /// new leader does not fetch it back), then here.
    fn remove_branch(
        &self,
        repo: &Repository,
        task: &TaskName,
        refname: &str,
        head: Oid,
    ) -> Result<(), Error> {
        if let Some(remote) = self.git_remote() {
            let lease = format!("--force-with-lease={refname}:{head}");
            let spec = format!(":{refname}");
            run_git(&self.root, &["push", "--quiet", &lease, remote, &spec]).map_err(|why| {
                Error::SharedRemote {
                    action: "remove the task branch from",
                    remote: remote.to_string(),
                    why,
                }
            })?;
        }
        let mut r = match repo.find_reference(refname) {
            Ok(r) => r,
            Err(e) if e.code() == git2::ErrorCode::NotFound => return Ok(()),
            Err(e) => return Err(self.git("read the task branch")(e)),
        };
        if r.target() != Some(head) {
            return Err(Error::BranchRace {
                task: task.clone(),
                branch: branch_name(task),
            });
        }
        r.delete().map_err(self.git("remove the task branch"))?;
        if let Some(dir) = repo.commondir().join(refname).parent() {
            sync_dir(dir).or_else(|e| match e {
                // A folder emptied by the deletion may be gone.
                Error::Io { .. } => Ok(()),
                e => Err(e),
            })?;
        }
        Ok(())
    }

    /// Moves the task in `folder` back to open `phase`: the artifacts of later phases become
    /// `PREVIOUS_*` (kept as context, out of the lifecycle's way), then `.state` says `phase`,
    /// last. Each step can run again.
    fn reopen_at(&self, folder: &crate::read::Folder, phase: Phase) -> Result<(), Error> {
        let present: Vec<Artifact> = folder.artifacts.iter().map(|a| a.artifact).collect();
        for artifact in automaton_workflow::out_of_order(State::open(phase), &present) {
            let from = folder.dir.join(artifact.file_name());
            if let Some(bytes) = fsx::read_capped(&self.meta, &from, fsx::MAX_STATE_FILE)? {
                let name = format!("{}{}", crate::work::PREVIOUS, artifact.file_name());
                self.write(&folder.dir.join(name), &bytes)?;
            }
            self.remove_durably(&from)?;
        }
        self.write(
            &folder.dir.join(STATE),
            format!("{}\n", State::open(phase)).as_bytes(),
        )
    }

    /// Whether `to` is `from` plus only the fleet's own `phase` commits on `task`'s branch:
    /// each commit on the first-parent path back to `from` is one a run's patch made
    /// (`UploadPatch`: its message `{task}: {phase} by {agent} (fencing token N)`, authored by
    /// that agent). The review chain recognises doc_review's patch this way when the run's
    /// record of it was lost to a crash. At most 64 commits are walked; false beyond, or when
    /// `from` is not an ancestor of `to`, or either is not a commit.
    pub fn only_fleet_commits(
        &self,
        task: &TaskName,
        phase: Phase,
        from: &str,
        to: &str,
    ) -> Result<bool, Error> {
        let Some(repo) = self.repository()? else {
            return Ok(false);
        };
        let (Ok(from), Ok(mut at)) = (Oid::from_str(from), Oid::from_str(to)) else {
            return Ok(false);
        };
        let prefix = format!("{task}: {phase} by ");
        for _ in 0..64 {
            if at == from {
                return Ok(true);
            }
            let Ok(c) = repo.find_commit(at) else {
                return Ok(false);
            };
            let message = c.message().unwrap_or_default();
            let Some(rest) = message.strip_prefix(&prefix) else {
                return Ok(false);
            };
            let agent = rest.split(' ').next().unwrap_or_default();
            if !rest.contains("(fencing token ") || c.author().name().ok() != Some(agent) {
                return Ok(false);
            }
            let Ok(parent) = c.parent_id(0) else {
                return Ok(false);
            };
            at = parent;
        }
        Ok(false)
    }

    /// Sends a task back to its code review, to run again on the branch as it is now: the
    /// branch moved since the reviews read it (seed 003: a review goes stale when the
    /// candidate revision changes; an approval does not authorize another revision). From
    /// the code review's gate or any later review phase. The review's artifact stays, to be
    /// written again by the next run (its approval, bound to the old commit, no longer
    /// matches); artifacts of later phases become `PREVIOUS_*`. Whether the state moved
    /// (false: it was back already).
    pub fn review_again(&self, task: &TaskName) -> Result<bool, Error> {
        let _lock = self.lock(task)?;
        let (folder, state) = self.tracked(task)?;
        let back = State::open(Phase::CodeReview);
        if state == back {
            return Ok(false);
        }
        if !state.phase.reviews_code() {
            return Err(Error::Transition(
                automaton_workflow::TransitionError::Illegal {
                    current: state,
                    target: back,
                    legal: state.legal_targets(),
                },
            ));
        }
        self.reopen_at(&folder, Phase::CodeReview)?;
        Ok(true)
    }
}

/// The paths of an index's conflicts, sorted.
fn conflict_paths(index: &mut git2::Index) -> Vec<String> {
    let mut paths: Vec<String> = index
        .conflicts()
        .map(|c| {
            c.filter_map(Result::ok)
                .filter_map(|c| c.our.or(c.their).or(c.ancestor))
                .map(|e| String::from_utf8_lossy(&e.path).into_owned())
                .collect()
        })
        .unwrap_or_default();
    paths.sort();
    paths.dedup();
    paths
}

/// Settles every conflict left in `index` with our side (or our deletion).
fn take_ours(index: &mut git2::Index) -> Result<(), git2::Error> {
    let conflicts: Vec<git2::IndexConflict> = index.conflicts()?.filter_map(Result::ok).collect();
    for c in conflicts {
        let Some(path) = c
            .our
            .as_ref()
            .or(c.their.as_ref())
            .or(c.ancestor.as_ref())
            .map(|e| e.path.clone())
        else {
            continue;
        };
        let path = String::from_utf8_lossy(&path).into_owned();
        index.conflict_remove(Path::new(&path))?;
        if let Some(our) = c.our {
            index.add(&our)?;
        }
    }
    Ok(())
}

/// The text of `CONFLICTS.md`.
#[allow(clippy::too_many_arguments)]
fn conflicts_md(
    task: &TaskName,
    why: &str,
    onto: &str,
    old_head: &str,
    paths: &[String],
    base: impl Fn(&str) -> String,
    mine: impl Fn(&str) -> String,
    theirs: impl Fn(&str) -> String,
) -> String {
    let mut s = format!(
        "# Conflicts: {task} goes back to implement\n\n{why}\n\nYour branch now builds on {onto} (your previous head was {old_head}). Where both sides changed a path, the branch holds the other side's version: bring your change back into it, keeping theirs, then write IMPLEMENTATION.md again. The reviews of the previous revision are in the PREVIOUS_*.md files; they run again on the new one.\n\n## Paths both changed\n\n"
    );
    if paths.is_empty() {
        s.push_str("(none named: check the whole change against the new head)\n");
    }
    for p in paths {
        s.push_str(&format!("- `{p}`\n"));
    }
    for p in paths.iter().take(SHOWN_PATHS) {
        s.push_str(&format!(
            "\n## `{p}`\n\n### Where the two sides parted\n\n```\n{}\n```\n\n### Your side (previous head)\n\n```\n{}\n```\n\n### The other side (now on the branch)\n\n```\n{}\n```\n",
            base(p),
            mine(p),
            theirs(p)
        ));
    }
    if paths.len() > SHOWN_PATHS {
        s.push_str(&format!(
            "\n({} more paths not shown: compare them with git)\n",
            paths.len() - SHOWN_PATHS
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::process::Command;

    use super::*;
    use crate::git::tests::checkout;
    use crate::integrate::tests::{file_at, work};
    use crate::project::tests::name;

    /// `git ARGS` in `dir` as a person would run it; its stdout, trimmed.
    fn git(dir: &Path, args: &[&str]) -> String {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["-c", "user.name=p", "-c", "user.email=p@x"])
            .args(args)
            .output()
            .expect("git");
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A person's commit on the branch checked out in `dir`, through git itself.
    fn person_commits(dir: &Path, path: &str, content: &str) -> String {
        fs::write(dir.join(path), content).expect("write");
        git(dir, &["add", path]);
        git(dir, &["commit", "-q", "-m", "a person's commit"]);
        git(dir, &["rev-parse", "HEAD"])
    }

    fn main_head(repo: &Repository) -> String {
        repo.find_reference("refs/heads/main")
            .expect("main")
            .target()
            .expect("target")
            .to_string()
    }

    fn task(project: &Project, t: &str) -> TaskName {
        project.create_task(&name(t)).expect("create");
        name(t)
    }

    #[test]
    fn merge_delivery_fast_forwards_the_checked_out_base_and_the_checkout_follows() {
        let (dir, project, repo, _) = checkout();
        let t = task(&project, "job");
        let rev = work(&project, "job", &[("new.rs", b"fn new() {}\n")]);
        assert_eq!(project.base_of(&t).expect("base").as_deref(), Some("main"));
        let p = project
            .prepare_delivery(&t, "main", Strategy::Merge, &rev, None, "T")
            .expect("prepare");
        let Prepared::Ready {
            base_before,
            commit,
            how,
        } = p
        else {
            panic!("{p:?}")
        };
        assert_eq!((commit.as_str(), how), (rev.as_str(), "fast-forward"));
        assert!(
            project
                .land_delivery(&t, "main", &base_before, &commit, None)
                .expect("land")
        );
        assert_eq!(main_head(&repo), rev);
        assert_eq!(
            fs::read(dir.path().join("new.rs")).expect("checkout"),
            b"fn new() {}\n"
        );
        // Again (a retry after a crash): found landed, nothing moves.
        assert!(
            !project
                .land_delivery(&t, "main", &base_before, &commit, None)
                .expect("again")
        );
    }

    #[test]
    fn main_moved_on_other_paths_gets_a_merge_commit_holding_both() {
        let (dir, project, repo, _) = checkout();
        let t = task(&project, "job");
        let rev = work(&project, "job", &[("new.rs", b"fn new() {}\n")]);
        let person = person_commits(dir.path(), "other.txt", "theirs\n");
        for strategy in [Strategy::Merge, Strategy::Squash] {
            let p = project
                .prepare_delivery(&t, "main", strategy, &rev, None, "T")
                .expect("prepare");
            let Prepared::Ready {
                base_before, how, ..
            } = &p
            else {
                panic!("{p:?}")
            };
            assert_eq!(base_before, &person);
            assert_eq!(
                *how,
                if strategy == Strategy::Merge {
                    "merge commit"
                } else {
                    "squash commit"
                }
            );
        }
        let Prepared::Ready {
            base_before,
            commit,
            ..
        } = project
            .prepare_delivery(&t, "main", Strategy::Merge, &rev, None, "T")
            .expect("prepare")
        else {
            panic!("not ready")
        };
        project
            .land_delivery(&t, "main", &base_before, &commit, None)
            .expect("land");
        let head = main_head(&repo);
        assert_eq!(head, commit);
        assert!(file_at(&repo, &head, "new.rs").is_some());
        assert!(file_at(&repo, &head, "other.txt").is_some());
        // ff-only does not land it.
        let t2 = task(&project, "job2");
        let rev2 = work(&project, "job2", &[("two.rs", b"2\n")]);
        person_commits(dir.path(), "third.txt", "3\n");
        let p = project
            .prepare_delivery(&t2, "main", Strategy::FfOnly, &rev2, None, "T2")
            .expect("prepare");
        assert!(
            matches!(&p, Prepared::NotAsReviewed { why, .. } if why.contains("ff-only")),
            "{p:?}"
        );
    }

    #[test]
    fn main_changed_a_path_the_task_changed_is_not_merged_and_says_which() {
        let (dir, project, repo, _) = checkout();
        let t = task(&project, "job");
        let rev = work(&project, "job", &[("shared.rs", b"task\n")]);
        let person = person_commits(dir.path(), "shared.rs", "person\n");
        let p = project
            .prepare_delivery(&t, "main", Strategy::Merge, &rev, None, "T")
            .expect("prepare");
        let Prepared::NotAsReviewed {
            base_head, paths, ..
        } = p
        else {
            panic!("{p:?}")
        };
        assert_eq!(
            (base_head.as_str(), paths),
            (person.as_str(), vec!["shared.rs".to_string()])
        );
        assert_eq!(main_head(&repo), person);
    }

    #[test]
    fn a_base_moved_between_prepare_and_land_is_never_overwritten() {
        let (dir, project, repo, _) = checkout();
        let t = task(&project, "job");
        let rev = work(&project, "job", &[("new.rs", b"1\n")]);
        let Prepared::Ready {
            base_before,
            commit,
            ..
        } = project
            .prepare_delivery(&t, "main", Strategy::Merge, &rev, None, "T")
            .expect("prepare")
        else {
            panic!("not ready")
        };
        let person = person_commits(dir.path(), "other.txt", "x\n");
        let e = project
            .land_delivery(&t, "main", &base_before, &commit, None)
            .expect_err("moved");
        assert!(matches!(e, Error::BaseMoved { .. }), "{e}");
        assert_eq!(main_head(&repo), person);
        // A base that is not checked out moves by compare-and-swap, the same way.
        let t2 = task(&project, "job2");
        let rev2 = work(&project, "job2", &[("two.rs", b"2\n")]);
        repo.reference(
            "refs/heads/release",
            repo.head().expect("h").target().expect("t"),
            true,
            "t",
        )
        .expect("release");
        let Prepared::Ready {
            base_before,
            commit,
            ..
        } = project
            .prepare_delivery(&t2, "release", Strategy::Merge, &rev2, None, "T2")
            .expect("prepare")
        else {
            panic!("not ready")
        };
        let elsewhere = repo
            .find_reference("refs/heads/automaton/job")
            .expect("t")
            .target()
            .expect("t");
        repo.reference("refs/heads/release", elsewhere, true, "a person")
            .expect("moved");
        let e = project
            .land_delivery(&t2, "release", &base_before, &commit, None)
            .expect_err("moved");
        assert!(matches!(e, Error::BaseMoved { .. }), "{e}");
    }

    #[test]
    fn a_remote_base_is_pushed_with_a_lease_and_a_commit_pushed_meanwhile_survives() {
        let (dir, project, repo, _) = checkout();
        let remote = tempfile::tempdir().expect("remote");
        let r = remote.path().to_str().expect("utf-8");
        Repository::init_bare(remote.path()).expect("bare");
        let git = |args: &[&str]| {
            let out = Command::new("git")
                .arg("-C")
                .arg(dir.path())
                .args(args)
                .output()
                .expect("git");
            assert!(out.status.success(), "{args:?}: {out:?}");
        };
        git(&["push", "-q", r, "main"]);
        let t = task(&project, "job");
        let rev = work(&project, "job", &[("new.rs", b"1\n")]);
        let Prepared::Ready {
            base_before,
            commit,
            ..
        } = project
            .prepare_delivery(&t, "main", Strategy::Merge, &rev, Some(r), "T")
            .expect("prepare")
        else {
            panic!("not ready")
        };
        // Someone pushes to the remote's main meanwhile.
        let other = person_commits(dir.path(), "other.txt", "x\n");
        git(&["push", "-q", r, "main"]);
        let e = project
            .land_delivery(&t, "main", &base_before, &commit, Some(r))
            .expect_err("moved");
        assert!(matches!(e, Error::BaseMoved { .. }), "{e}");
        let bare = Repository::open_bare(remote.path()).expect("open");
        let remote_main = |b: &Repository| {
            b.find_reference("refs/heads/main")
                .expect("main")
                .target()
                .expect("t")
                .to_string()
        };
        assert_eq!(remote_main(&bare), other);
        // Built again on the new head, it lands; and again is a no-op.
        let Prepared::Ready {
            base_before,
            commit,
            ..
        } = project
            .prepare_delivery(&t, "main", Strategy::Merge, &rev, Some(r), "T")
            .expect("prepare")
        else {
            panic!("not ready")
        };
        assert!(
            project
                .land_delivery(&t, "main", &base_before, &commit, Some(r))
                .expect("land")
        );
        assert_eq!(remote_main(&bare), commit);
        assert!(
            !project
                .land_delivery(&t, "main", &base_before, &commit, Some(r))
                .expect("again")
        );
        // The local main is the person's, untouched.
        assert_eq!(main_head(&repo), other);
    }

    #[test]
    fn rework_onto_sends_a_complete_task_back_to_implement_with_both_sides() {
        let (dir, project, repo, _) = checkout();
        let t = task(&project, "job");
        let rev = work(
            &project,
            "job",
            &[("shared.rs", &b"task side\n"[..]), ("mine.rs", &b"m\n"[..])],
        );
        let person = person_commits(dir.path(), "shared.rs", "person side\n");
        let task_dir = project.task_dir(&t);
        fs::write(task_dir.join(".state"), "complete\n").expect("state");
        for a in ["IMPLEMENTATION.md", "CODE_REVIEW.md", "VERDICT.md"] {
            fs::write(task_dir.join(a), format!("{a} of {rev}\n")).expect("artifact");
        }
        let done = project
            .rework_onto(&t, &person, "main changed shared.rs")
            .expect("rework");
        assert!(done.moved);
        assert_eq!(done.paths, vec!["shared.rs".to_string()]);
        assert_eq!(
            fs::read_to_string(task_dir.join(".state")).expect("state"),
            "implement\n"
        );
        let conflicts = fs::read_to_string(task_dir.join(CONFLICTS)).expect("conflicts");
        for want in [
            "shared.rs",
            "task side",
            "person side",
            "main changed shared.rs",
        ] {
            assert!(conflicts.contains(want), "{want}: {conflicts}");
        }
        assert!(!task_dir.join("VERDICT.md").exists());
        assert!(task_dir.join("PREVIOUS_VERDICT.md").exists());
        assert!(task_dir.join("PREVIOUS_CODE_REVIEW.md").exists());
        assert!(task_dir.join("IMPLEMENTATION.md").exists());
        // The branch builds on the person's commit, keeps the task's other work, and holds
        // the other side where both changed.
        let head = &done.head;
        assert!(
            repo.graph_descendant_of(
                Oid::from_str(head).expect("oid"),
                Oid::from_str(&person).expect("oid")
            )
            .expect("graph")
        );
        assert_eq!(
            file_at(&repo, head, "mine.rs").as_deref(),
            Some(&b"m\n"[..])
        );
        assert_eq!(
            file_at(&repo, head, "shared.rs").as_deref(),
            Some(&b"person side\n"[..])
        );
        // Again: nothing more happens.
        let again = project.rework_onto(&t, &person, "again").expect("again");
        assert!(!again.moved);
        assert_eq!(&again.head, head);
        // Served to the implement phase's agent.
        let inputs = project.work_inputs(&t, Phase::Implement).expect("inputs");
        assert!(inputs.iter().any(|i| i.path == CONFLICTS));
    }

    /// Issue 36: a code review's approval names the branch's commit; another revision is
    /// refused with nothing written; the approval goes stale when the branch moves, and a
    /// person's approval of the new head (`--revision`) binds it again.
    #[test]
    fn a_code_review_approval_is_bound_to_the_branch_head_and_goes_stale_when_it_moves() {
        let (_dir, project, _repo, _) = checkout();
        let t = task(&project, "job");
        let first = work(&project, "job", &[("a.rs", &b"a\n"[..])]);
        let task_dir = project.task_dir(&t);
        for a in ["IMPLEMENTATION.md", "CODE_REVIEW.md"] {
            fs::write(task_dir.join(a), format!("{a}\n")).expect("artifact");
        }
        fs::write(task_dir.join(".state"), "code_review:awaiting_approval\n").expect("state");
        let files = || {
            (
                fs::read_to_string(task_dir.join(".state")).expect("state"),
                fs::read_to_string(task_dir.join(".state.approvals")).unwrap_or_default(),
            )
        };
        let before = files();
        let now = std::time::SystemTime::now();
        for (revision, moved) in [
            ("0000000", true),
            ("xyz", false),
            ("abc", false),
            (&*"f".repeat(65), false),
        ] {
            let e = project
                .approve(&t, "ops", Some(revision), now)
                .expect_err("another revision");
            assert_eq!(matches!(e, Error::RevisionMoved { .. }), moved, "{e}");
            assert!(!e.to_string().contains('\n'), "{e}");
            assert_eq!(files(), before, "{revision}: nothing written");
        }
        let out = project.approve(&t, "ops", None, now).expect("approve");
        assert_eq!(out.approval.commit.as_deref(), Some(first.as_str()));
        assert!(files().1.trim_end().ends_with(&format!("|{first}")));
        let stale = |project: &Project| match project.view(&t, now).expect("view").approval {
            Some(crate::ApprovalView::Approved { stale, .. }) => stale,
            other => panic!("{other:?}"),
        };
        assert!(!stale(&project));
        // A commit after the approval: the approval no longer authorizes the branch.
        let second = work(&project, "job", &[("b.rs", &b"b\n"[..])]);
        assert!(stale(&project));
        // A person who read the new head approves it by name.
        let again = project
            .approve(&t, "ops", Some(&second[..9]), now)
            .expect("the new head approved");
        assert_eq!(again.approval.commit.as_deref(), Some(second.as_str()));
        assert!(!stale(&project));
        // Other phases take no revision.
        fs::write(task_dir.join("SPEC.md"), "spec\n").expect("spec");
        fs::write(task_dir.join(".state"), "research:awaiting_approval\n").expect("state");
        let e = project
            .approve(&t, "ops", Some(&second), now)
            .expect_err("research is not bound to a commit");
        assert!(matches!(e, Error::BadRevision { .. }), "{e}");
    }

    /// The review chain's fallback when a run's record of its patch was lost: the fleet's
    /// doc_review commits are recognised from git, a person's commit is not.
    #[test]
    fn only_the_fleets_own_doc_review_commits_count_as_the_fleets() {
        let (dir, project, _repo, _) = checkout();
        let t = task(&project, "job");
        let reviewed = work(&project, "job", &[("a.rs", &b"a\n"[..])]);
        let doc = project
            .apply_changes(
                &t,
                &reviewed,
                &[crate::git::tests::change("README.md", b"docs\n")],
                "gpu-a",
                "job: doc_review by gpu-a (fencing token 7)",
            )
            .expect("apply")
            .commit
            .expect("a commit");
        let fleet = |from: &str, to: &str| {
            project
                .only_fleet_commits(&t, Phase::DocReview, from, to)
                .expect("walk")
        };
        assert!(fleet(&reviewed, &doc));
        assert!(fleet(&doc, &doc));
        // Not the other way round, not another phase's, not a person's.
        assert!(!fleet(&doc, &reviewed));
        assert!(
            !project
                .only_fleet_commits(&t, Phase::Implement, &reviewed, &doc)
                .expect("walk")
        );
        let person = commit_on_branch(dir.path(), "automaton/job", &doc);
        assert!(!fleet(&reviewed, &person));
        assert!(!fleet(&reviewed, "not a commit"));
    }

    /// A person's commit on top of `parent` on `branch`, through git itself (a forged
    /// message would say so; this one says what a person writes).
    fn commit_on_branch(dir: &Path, branch: &str, parent: &str) -> String {
        let tree = git(dir, &["rev-parse", &format!("{parent}^{{tree}}")]);
        let c = git(
            dir,
            &["commit-tree", &tree, "-p", parent, "-m", "a person's fix"],
        );
        git(dir, &["update-ref", &format!("refs/heads/{branch}"), &c]);
        c
    }

    #[test]
    fn the_delivery_record_round_trips_and_a_corrupt_one_says_how_to_recover() {
        let (_dir, project, _repo, _) = checkout();
        let t = task(&project, "job");
        assert_eq!(project.read_delivery(&t).expect("none"), None);
        let r = DeliveryRecord {
            state: DeliveryState::Merged,
            mode: "merge".into(),
            commit: "a".repeat(40),
            number: u64::MAX,
            failure: "line \"one\"\nline two".into(),
            ..DeliveryRecord::default()
        };
        project.write_delivery(&t, &r).expect("write");
        assert_eq!(project.read_delivery(&t).expect("read"), Some(r));
        fs::write(project.task_dir(&t).join(DELIVERY), "{not json").expect("corrupt");
        let e = project.read_delivery(&t).expect_err("corrupt");
        assert!(e.to_string().contains("Remove it"), "{e}");
        assert!(
            project
                .write_delivery(&name("absent"), &DeliveryRecord::default())
                .is_err()
        );
    }

    #[test]
    fn gc_removes_only_branches_merged_into_their_base_or_abandoned_and_a_dry_run_nothing() {
        let (_dir, project, repo, _) = checkout();
        let record = |state, base: &str| DeliveryRecord {
            state,
            base: base.into(),
            abandoned_by: "ops".into(),
            ..DeliveryRecord::default()
        };
        // Merged: main holds its head.
        let merged = task(&project, "merged");
        let head = work(&project, "merged", &[("m.rs", b"m\n")]);
        repo.reference(
            "refs/heads/release",
            Oid::from_str(&head).expect("oid"),
            true,
            "t",
        )
        .expect("release");
        project
            .write_delivery(&merged, &record(DeliveryState::Merged, "release"))
            .expect("record");
        // Merged, but its branch moved since: it stays.
        let moved = task(&project, "moved");
        work(&project, "moved", &[("a.rs", b"a\n")]);
        project
            .write_delivery(&moved, &record(DeliveryState::Merged, "main"))
            .expect("record");
        // Abandoned by a person, and one still in flight.
        let gone = task(&project, "gone");
        work(&project, "gone", &[("g.rs", b"g\n")]);
        project
            .write_delivery(&gone, &record(DeliveryState::Abandoned, "main"))
            .expect("record");
        let busy = task(&project, "busy");
        work(&project, "busy", &[("b.rs", b"b\n")]);
        project
            .write_delivery(&busy, &record(DeliveryState::Ready, "main"))
            .expect("record");
        let exists = |t: &str| {
            repo.find_reference(&format!("refs/heads/automaton/{t}"))
                .is_ok()
        };
        let dry = project.collect_branches(true).expect("dry run");
        let verdict = |list: &[Collected], t: &str| {
            list.iter()
                .find(|c| c.task.to_string() == t)
                .map(|c| (c.removed, c.why.clone()))
        };
        assert_eq!(verdict(&dry, "merged").map(|v| v.0), Some(true), "{dry:?}");
        assert_eq!(verdict(&dry, "gone").map(|v| v.0), Some(true), "{dry:?}");
        assert!(verdict(&dry, "moved").is_some_and(|v| !v.0 && v.1.contains("not on main")));
        assert!(verdict(&dry, "busy").is_some_and(|v| !v.0 && v.1.contains("ready")));
        for t in ["merged", "moved", "gone", "busy"] {
            assert!(exists(t), "a dry run removed {t}");
        }
        let done = project.collect_branches(false).expect("gc");
        assert_eq!(verdict(&done, "merged").map(|v| v.0), Some(true));
        assert!(!exists("merged") && !exists("gone"));
        assert!(exists("moved") && exists("busy"));
        // Again: nothing left to remove, nothing else touched.
        let again = project.collect_branches(false).expect("again");
        assert!(again.iter().all(|c| !c.removed), "{again:?}");
    }
}
