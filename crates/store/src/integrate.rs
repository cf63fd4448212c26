//! A decomposed task's branch is its integration branch (issue 31): a sub-task's branch
//! starts at the parent's head ([`Project::task_branch`]) and, once the sub-task passed, is
//! merged back into it here — a fast-forward where the parent did not move, else a merge
//! commit built in memory by libgit2. Like every write of this crate it touches objects and
//! `refs/heads/automaton/*` only, never the checkout, its index or HEAD; the parent's branch
//! moves by compare-and-swap, recorded (fenced) and pushed first when there is a shared
//! remote. A merge that conflicts writes nothing and names the paths.

use git2::{MergeOptions, Oid, Repository, Signature};

use automaton_workflow::TaskName;

use crate::fsx::sync_dir;
use crate::git::{branch_name, branch_ref, parse_commit_id};
use crate::{Error, Project};

/// What [`Project::merge_into_parent`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Integrated {
    /// The project has no repository, or the sub-task never had a branch: nothing to merge.
    NoCode,
    /// The parent's branch already holds the sub-task's head (a retry, or no change).
    Already { parent_head: String },
    /// The parent's branch had not moved since the sub-task started: it now points at the
    /// sub-task's head.
    FastForward { parent_head: String },
    /// A merge commit of the parent's head and the sub-task's, new on the parent's branch.
    Merged { parent_head: String },
}

impl Integrated {
    /// The parent branch's head after the merge, when there is code.
    pub fn parent_head(&self) -> Option<&str> {
        match self {
            Integrated::NoCode => None,
            Integrated::Already { parent_head }
            | Integrated::FastForward { parent_head }
            | Integrated::Merged { parent_head } => Some(parent_head),
        }
    }
}

impl Project {
    /// Whether `sub`'s code is on its parent's branch: it has no branch (no code), or its
    /// head is the parent's head or an ancestor of it. A task without a parent: `true`.
    pub fn merged_into_parent(&self, sub: &TaskName) -> Result<bool, Error> {
        let Some(parent) = sub.parent() else {
            return Ok(true);
        };
        let Some(repo) = self.repository()? else {
            return Ok(true);
        };
        let Some(head) = self.branch_commit(&repo, &branch_ref(sub))? else {
            return Ok(true);
        };
        let Some(parent_head) = self.branch_commit(&repo, &branch_ref(&parent))? else {
            return Ok(false);
        };
        self.contains(&repo, parent_head, head)
    }

    /// Merges `sub`'s branch into its parent's: see [`Integrated`]. Idempotent: a sub-task
    /// already merged is answered [`Integrated::Already`] and nothing is written. A merge that
    /// conflicts is refused ([`Error::MergeConflict`], naming the paths) and writes nothing.
    pub fn merge_into_parent(&self, sub: &TaskName) -> Result<Integrated, Error> {
        let Some(parent) = sub.parent() else {
            return Err(Error::NotASubtask { task: sub.clone() });
        };
        if self.repository()?.is_none() {
            return Ok(Integrated::NoCode);
        }
        let repo = self.durable_repository()?;
        let Some(head) = self.branch_commit(&repo, &branch_ref(sub))? else {
            return Ok(Integrated::NoCode);
        };
        let parent_branch = branch_name(&parent);
        let parent_ref = branch_ref(&parent);
        for _attempt in 0..2 {
            let parent_head = match self.branch_commit(&repo, &parent_ref)? {
                Some(h) => h,
                None => {
                    let created = self.task_branch(&parent)?.ok_or_else(|| Error::NoBranch {
                        task: parent.clone(),
                        branch: parent_branch.clone(),
                    })?;
                    parse_commit_id(&created.commit)?
                }
            };
            if self.contains(&repo, parent_head, head)? {
                return Ok(Integrated::Already {
                    parent_head: parent_head.to_string(),
                });
            }
            let (new, fast_forward) = if self.contains(&repo, head, parent_head)? {
                (head, true)
            } else {
                (
                    self.merge_commit(&repo, sub, &parent, parent_head, head)?,
                    false,
                )
            };
            // With a shared remote: recorded (fenced) and pushed before the branch moves here.
            self.share_branch_head(&parent, &parent_branch, &new.to_string())?;
            let log = format!("automaton: merge {sub} into {parent}");
            match repo.reference_matching(&parent_ref, new, true, parent_head, &log) {
                Ok(_) => {
                    let parent_head = new.to_string();
                    return Ok(if fast_forward {
                        Integrated::FastForward { parent_head }
                    } else {
                        Integrated::Merged { parent_head }
                    });
                }
                // The parent's branch moved meanwhile: merge again onto its new head.
                Err(e) if e.code() == git2::ErrorCode::Modified => continue,
                Err(e) => return Err(self.git("move the parent's branch")(e)),
            }
        }
        Err(Error::BranchRace {
            task: parent,
            branch: parent_branch,
        })
    }

    /// `ancestor` is `descendant` or one of its ancestors.
    pub(crate) fn contains(
        &self,
        repo: &Repository,
        descendant: Oid,
        ancestor: Oid,
    ) -> Result<bool, Error> {
        Ok(descendant == ancestor
            || repo
                .graph_descendant_of(descendant, ancestor)
                .map_err(self.git("compare two commits"))?)
    }

    /// A merge commit of `ours` (the parent's head) and `theirs` (the sub-task's), its tree
    /// built in memory; refused with the conflicting paths.
    fn merge_commit(
        &self,
        repo: &Repository,
        sub: &TaskName,
        parent: &TaskName,
        ours: Oid,
        theirs: Oid,
    ) -> Result<Oid, Error> {
        let (o, t) = (
            self.find_commit(repo, ours)?,
            self.find_commit(repo, theirs)?,
        );
        let mut opts = MergeOptions::new();
        opts.fail_on_conflict(false);
        let mut index = repo
            .merge_commits(&o, &t, Some(&opts))
            .map_err(self.git("merge the sub-task's branch"))?;
        if index.has_conflicts() {
            let mut paths: Vec<String> = index
                .conflicts()
                .map_err(self.git("list the merge's conflicts"))?
                .filter_map(Result::ok)
                .filter_map(|c| c.our.or(c.their).or(c.ancestor))
                .map(|e| String::from_utf8_lossy(&e.path).into_owned())
                .collect();
            paths.sort();
            paths.dedup();
            return Err(Error::MergeConflict {
                task: sub.clone(),
                paths,
            });
        }
        let tree_id = index
            .write_tree_to(repo)
            .map_err(self.git("write the merged tree"))?;
        let tree = repo.find_tree(tree_id).map_err(self.git("read a tree"))?;
        // Deterministic: the same two heads always make the same commit, so a merge retried
        // after a crash between its push to the shared remote and the local ref's move makes
        // the commit already pushed (a no-op there), not a second one the remote refuses.
        let message = format!(
            "automaton: merge {sub} into {parent}\n\nSub-task {sub} passed; its branch {} is merged into the integration branch {}.\n",
            branch_name(sub),
            branch_name(parent)
        );
        let commit = self.deterministic_commit(repo, &message, &tree, &[&o, &t], None)?;
        Ok(commit)
    }

    /// A commit signed by automaton at the latest time of its parents and `also` (the first
    /// of equals): the same inputs make the same commit, so a step retried after a crash makes no second
    /// one. Its objects' folder is synced (libgit2 syncs each object and its `objects/xx`
    /// folder; a new `xx` needs this).
    pub(crate) fn deterministic_commit(
        &self,
        repo: &Repository,
        message: &str,
        tree: &git2::Tree<'_>,
        parents: &[&git2::Commit<'_>],
        also: Option<&git2::Commit<'_>>,
    ) -> Result<Oid, Error> {
        let mut when = parents.first().map(|p| p.time()).ok_or_else(|| {
            self.git("sign the commit")(git2::Error::from_str("a commit without parents"))
        })?;
        for p in parents.iter().copied().chain(also) {
            if p.time().seconds() > when.seconds() {
                when = p.time();
            }
        }
        let signature = Signature::new("automaton", "automaton@automaton.invalid", &when)
            .map_err(self.git("sign the commit"))?;
        let c = repo
            .commit(None, &signature, &signature, message, tree, parents)
            .map_err(self.git("write the commit"))?;
        sync_dir(&repo.commondir().join("objects"))?;
        Ok(c)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::git::tests::{branch_target, change, checkout, checkout_state};
    use crate::project::tests::name;

    /// Commits `files` (path, content) to `task`'s branch as an agent's patch would.
    pub(crate) fn work(project: &Project, task: &str, files: &[(&str, &[u8])]) -> String {
        let t = name(task);
        let base = project
            .task_branch(&t)
            .expect("branch")
            .expect("repo")
            .commit;
        let changes: Vec<_> = files.iter().map(|(p, c)| change(p, c)).collect();
        project
            .apply_changes(&t, &base, &changes, "agent", &format!("{task}: implement"))
            .expect("apply")
            .commit
            .expect("a commit")
    }

    pub(crate) fn file_at(repo: &Repository, commit: &str, path: &str) -> Option<Vec<u8>> {
        let c = repo
            .find_commit(Oid::from_str(commit).expect("oid"))
            .expect("commit");
        let entry = c
            .tree()
            .expect("tree")
            .get_path(std::path::Path::new(path))
            .ok()?;
        Some(repo.find_blob(entry.id()).expect("blob").content().to_vec())
    }

    #[test]
    fn a_dependent_starts_on_the_parent_branch_holding_its_dependencys_code() {
        let (_dir, project, repo, head) = checkout();
        work(
            &project,
            "shop/cart",
            &[("src/cart.rs", b"pub struct Cart;\n")],
        );
        let merged = project
            .merge_into_parent(&name("shop/cart"))
            .expect("merge");
        assert!(
            matches!(merged, Integrated::FastForward { .. }),
            "{merged:?}"
        );
        assert!(
            project
                .merged_into_parent(&name("shop/cart"))
                .expect("merged")
        );
        // The dependent's branch starts where the parent is now: with the cart's code.
        let api = project
            .task_branch(&name("shop/api"))
            .expect("branch")
            .expect("repo");
        assert_eq!(Some(api.commit.as_str()), merged.parent_head());
        assert_eq!(
            file_at(&repo, &api.commit, "src/cart.rs").as_deref(),
            Some(&b"pub struct Cart;\n"[..])
        );
        // A top-level task still starts at HEAD.
        let other = project.task_branch(&name("other")).expect("b").expect("r");
        assert_eq!(other.commit, head.to_string());
        // The dependent's change, as its reviewers see it, is its own only.
        work(&project, "shop/api", &[("src/api.rs", b"use cart;\n")]);
        let changes = project
            .task_changes(&name("shop/api"))
            .expect("changes")
            .expect("some");
        let diff = String::from_utf8(changes.diff).expect("utf-8");
        assert!(diff.contains("src/api.rs"), "{diff}");
        assert!(!diff.contains("src/cart.rs"), "{diff}");
    }

    #[test]
    fn sub_tasks_of_one_wave_on_disjoint_files_all_land_and_the_checkout_is_untouched() {
        let (dir, project, repo, _head) = checkout();
        let before = checkout_state(dir.path(), &repo);
        // Three sub-tasks started from the same parent head, each on its own file.
        for (t, f) in [("p/a", "a.rs"), ("p/b", "b.rs"), ("p/c", "c.rs")] {
            project.task_branch(&name(t)).expect("branch");
            work(&project, t, &[(f, t.as_bytes())]);
        }
        let first = project.merge_into_parent(&name("p/b")).expect("b");
        assert!(matches!(first, Integrated::FastForward { .. }), "{first:?}");
        for t in ["p/c", "p/a"] {
            let m = project.merge_into_parent(&name(t)).expect(t);
            assert!(matches!(m, Integrated::Merged { .. }), "{t}: {m:?}");
        }
        let parent = branch_target(&repo, "p")
            .expect("parent branch")
            .to_string();
        for (t, f) in [("p/a", "a.rs"), ("p/b", "b.rs"), ("p/c", "c.rs")] {
            assert_eq!(
                file_at(&repo, &parent, f).as_deref(),
                Some(t.as_bytes()),
                "{t}"
            );
            assert!(project.merged_into_parent(&name(t)).expect("merged"), "{t}");
        }
        // Twice is once: nothing new is written.
        let again = project.merge_into_parent(&name("p/a")).expect("again");
        assert_eq!(
            again,
            Integrated::Already {
                parent_head: parent.clone()
            }
        );
        assert_eq!(
            branch_target(&repo, "p").map(|o| o.to_string()),
            Some(parent)
        );
        // The person's checkout, index and HEAD never moved.
        assert_eq!(checkout_state(dir.path(), &repo), before);
    }

    /// A crash after the merge commit was made (and, with a shared remote, pushed) but before
    /// the parent's ref moved here: the retry makes the very same commit.
    #[test]
    fn a_merge_retried_after_a_crash_before_the_ref_moved_makes_the_same_commit() {
        let (_dir, project, repo, _head) = checkout();
        for (t, f) in [("p/a", "a.rs"), ("p/b", "b.rs")] {
            project.task_branch(&name(t)).expect("branch");
            work(&project, t, &[(f, t.as_bytes())]);
        }
        project.merge_into_parent(&name("p/a")).expect("a");
        let before = branch_target(&repo, "p").expect("parent");
        let first = project.merge_into_parent(&name("p/b")).expect("b");
        assert!(matches!(first, Integrated::Merged { .. }), "{first:?}");
        // The ref back where it was: as if the process died before moving it.
        repo.reference("refs/heads/automaton/p", before, true, "test: crash")
            .expect("reset");
        // A second later: a commit signed with the clock would differ.
        std::thread::sleep(std::time::Duration::from_millis(1100));
        let again = project.merge_into_parent(&name("p/b")).expect("retry");
        assert_eq!(again, first, "the retry made another commit");
    }

    #[test]
    fn a_conflicting_merge_names_the_paths_and_writes_nothing() {
        let (_dir, project, repo, _head) = checkout();
        for t in ["p/a", "p/b"] {
            project.task_branch(&name(t)).expect("branch");
        }
        work(
            &project,
            "p/a",
            &[("README.md", b"a's words\n"), ("a.rs", b"a\n")],
        );
        work(
            &project,
            "p/b",
            &[("README.md", b"b's words\n"), ("b.rs", b"b\n")],
        );
        project
            .merge_into_parent(&name("p/a"))
            .expect("a lands first");
        let parent = branch_target(&repo, "p");
        let e = project
            .merge_into_parent(&name("p/b"))
            .expect_err("b conflicts");
        assert!(
            matches!(&e, Error::MergeConflict { paths, .. } if paths == &["README.md".to_string()]),
            "{e}"
        );
        assert_eq!(e.kind(), crate::ErrorKind::Refused);
        let line = e.to_string();
        assert!(
            line.contains("'README.md'") && !line.contains('\n'),
            "{line}"
        );
        assert_eq!(branch_target(&repo, "p"), parent, "nothing half-merged");
        assert!(
            !project
                .merged_into_parent(&name("p/b"))
                .expect("not merged")
        );
    }

    #[test]
    fn no_repository_or_no_branch_is_nothing_to_merge_and_a_task_is_not_a_sub_task() {
        let (_dir, plain) = crate::project::tests::project();
        assert_eq!(
            plain.merge_into_parent(&name("p/a")).expect("no repo"),
            Integrated::NoCode
        );
        assert!(plain.merged_into_parent(&name("p/a")).expect("no repo"));
        let (_dir, project, _repo, _head) = checkout();
        assert_eq!(
            project.merge_into_parent(&name("p/a")).expect("no branch"),
            Integrated::NoCode
        );
        let e = project
            .merge_into_parent(&name("p"))
            .expect_err("not a sub-task");
        assert!(matches!(e, Error::NotASubtask { .. }), "{e}");
    }
}
