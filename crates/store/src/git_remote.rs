//! Code across coordinators (`store = etcd`): the coordinators of one project share a git
//! remote (`[etcd] git_remote`, a bare repository any of them can push to). The leader
//! records each task branch's new head in the task's `.state.branch` — a store file, so it
//! reaches the replica first, fenced by the leadership — then pushes the commit to the
//! remote's task branch (a fast-forward: never forced), and only then moves its own branch.
//! A deposed leader's record is refused before anything is pushed; a push refused as not a
//! fast-forward means another coordinator writes the branch, and the change is refused too.
//! A new leader fetches the remote's task branches and sets its own to the heads recorded
//! (`sync_task_branches`). A head recorded but never pushed (a crash between the two) was
//! never acknowledged: the branch stays at the remote's head, and the record follows it.
//!
//! It shells out to `git` (the operator's transports and credentials: ssh, https, a path),
//! each call bounded in time. It must not decide anything about tasks or leases.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use automaton_workflow::TaskName;

use crate::{Error, Project};

/// The store file that records a task branch's head (with a shared remote only).
pub(crate) const BRANCH: &str = ".state.branch";

/// How long one `git` call to the remote may take.
const GIT_TIMEOUT: Duration = Duration::from_secs(60);

impl Project {
    /// This project with its task branches shared through the git remote `url`.
    pub fn with_git_remote(mut self, url: String) -> Project {
        self.git_remote = Some(url);
        self
    }

    /// The shared remote, if any.
    pub fn git_remote(&self) -> Option<&str> {
        self.git_remote.as_deref()
    }

    /// Before a task branch moves to `commit`: the head recorded (replicated, fenced), then
    /// the commit pushed to the remote's branch as a fast-forward. Nothing without a remote.
    pub(crate) fn share_branch_head(
        &self,
        task: &TaskName,
        branch: &str,
        commit: &str,
    ) -> Result<(), Error> {
        let Some(remote) = &self.git_remote else {
            return Ok(());
        };
        self.write(
            &self.task_dir(task).join(BRANCH),
            format!("{commit}\n").as_bytes(),
        )?;
        let refspec = format!("{commit}:refs/heads/{branch}");
        git(&self.root, &["push", "--quiet", remote, &refspec])
            .map(drop)
            .map_err(|why| Error::SharedRemote {
                action: "push the task branch to",
                remote: remote.clone(),
                why,
            })
    }

    /// Pushes every task branch this repository has to the remote (a first leader seeding
    /// it); each a fast-forward.
    pub fn push_task_branches(&self) -> Result<(), Error> {
        let Some(remote) = &self.git_remote else {
            return Ok(());
        };
        if self.repository()?.is_none() {
            return Ok(());
        }
        git(
            &self.root,
            &[
                "push",
                "--quiet",
                remote,
                "refs/heads/automaton/*:refs/heads/automaton/*",
            ],
        )
        .map(drop)
        .map_err(|why| Error::SharedRemote {
            action: "push the task branches to",
            remote: remote.clone(),
            why,
        })
    }

    /// A new leader's branches: the remote's task branches fetched over its own, then each
    /// set to the head its task records when that commit is there; a head that never reached
    /// the remote (never acknowledged) gives way to the remote's. Returns how many branches
    /// were set from records and how many records were corrected.
    pub fn sync_task_branches(&self, tasks: &[TaskName]) -> Result<(usize, usize), Error> {
        let Some(remote) = &self.git_remote else {
            return Ok((0, 0));
        };
        if self.repository()?.is_none() {
            return Ok((0, 0));
        }
        let shared = |action: &'static str| {
            let remote = remote.clone();
            move |why| Error::SharedRemote {
                action,
                remote,
                why,
            }
        };
        git(
            &self.root,
            &[
                "fetch",
                "--quiet",
                "--update-head-ok",
                remote,
                "+refs/heads/automaton/*:refs/heads/automaton/*",
            ],
        )
        .map_err(shared("fetch the task branches from"))?;
        let (mut set, mut corrected) = (0, 0);
        for task in tasks {
            let record = self.task_dir(task).join(BRANCH);
            let Some(text) = self.read_optional(&record)? else {
                continue;
            };
            let commit = text.trim();
            let branch = crate::git::branch_name(task);
            let present = crate::git::parse_commit_id(commit).is_ok()
                && git(
                    &self.root,
                    &["cat-file", "-e", &format!("{commit}^{{commit}}")],
                )
                .is_ok();
            if present {
                git(
                    &self.root,
                    &["update-ref", &format!("refs/heads/{branch}"), commit],
                )
                .map_err(shared("set a task branch from"))?;
                set += 1;
            } else {
                let head = git(
                    &self.root,
                    &[
                        "rev-parse",
                        "--verify",
                        "--quiet",
                        &format!("refs/heads/{branch}"),
                    ],
                );
                match head {
                    Ok(h) => self.write(&record, format!("{}\n", h.trim()).as_bytes())?,
                    Err(_) => self.remove_durably(&record)?,
                }
                corrected += 1;
            }
        }
        Ok((set, corrected))
    }
}

/// Runs `git ARGS` in `root`, bounded by [`GIT_TIMEOUT`]; its stdout, or why it failed (the
/// last line git wrote to stderr).
/// Runs `git -C root args…`, bounded in time; its stdout, or why it failed.
pub(crate) fn run_git(root: &Path, args: &[&str]) -> Result<String, String> {
    git(root, args)
}

fn git(root: &Path, args: &[&str]) -> Result<String, String> {
    let mut child = Command::new("git")
        .arg("-C")
        .arg(root)
        .args(args)
        .env("GIT_TERMINAL_PROMPT", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run git: {e} (install git)"))?;
    let deadline = Instant::now() + GIT_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("git {} took over {GIT_TIMEOUT:?}", args[0]));
            }
            Err(e) => return Err(format!("cannot wait for git: {e}")),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("cannot read git's output: {e}"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let out_text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = err
        .lines()
        .chain(out_text.lines())
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("hint:"))
        .collect();
    // git's verdict ("! [rejected] … (non-fast-forward)", "fatal: …") over its progress.
    let why = lines
        .iter()
        .find(|l| l.contains("[rejected]"))
        .or_else(|| {
            lines
                .iter()
                .find(|l| l.starts_with("fatal:") || l.starts_with("error:"))
        })
        .or(lines.last())
        .copied()
        .unwrap_or("no message")
        .to_string();
    Err(format!("git {} failed: {why}", args[0]))
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;
    use crate::Change;
    use crate::project::tests::name;

    fn sh(dir: &Path, args: &[&str]) -> String {
        let out = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(args)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()
            .expect("git");
        assert!(out.status.success(), "git {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// A first coordinator's repository with one commit, the shared bare remote cloned from
    /// it, and a second coordinator's clone of the remote; the first's task `t` created.
    fn fleet() -> (tempfile::TempDir, Project, Project, String) {
        let top = tempfile::tempdir().expect("tempdir");
        let a = top.path().join("a");
        fs::create_dir_all(&a).expect("mkdir");
        sh(&a, &["init", "-q", "-b", "main"]);
        fs::write(a.join("README"), "hello\n").expect("write");
        sh(&a, &["add", "README"]);
        sh(&a, &["commit", "-q", "-m", "first"]);
        let remote = top.path().join("shared.git");
        sh(top.path(), &["clone", "-q", "--bare", "a", "shared.git"]);
        sh(top.path(), &["clone", "-q", "shared.git", "b"]);
        let url = remote.display().to_string();
        let meta = a.join(".automaton");
        fs::create_dir_all(&meta).expect("meta");
        fs::write(meta.join(".agent.md"), "Mode: multi-agent\n").expect("agent.md");
        let first = Project::open(&a, None).with_git_remote(url.clone());
        first.create_task(&name("t")).expect("create");
        let second = Project::open(&top.path().join("b"), None).with_git_remote(url.clone());
        (top, first, second, url)
    }

    /// A change to `t`'s branch on top of its head.
    fn edit(p: &Project, content: &str) -> Result<crate::Applied, Error> {
        let head = p
            .task_branch(&name("t"))
            .expect("branch")
            .expect("a repository");
        edit_on(p, &head.commit, content)
    }

    fn edit_on(p: &Project, base: &str, content: &str) -> Result<crate::Applied, Error> {
        p.apply_changes(
            &name("t"),
            base,
            &[Change {
                path: "src/lib.rs".into(),
                deleted: false,
                executable: false,
                content: content.as_bytes().to_vec(),
            }],
            "agent-a",
            "implement t",
        )
    }

    /// The first coordinator's store files, as the second's view would be rebuilt.
    fn copy_view(from: &Project, to: &Project) {
        let files = from.replicated_files().expect("files");
        to.restore_view(&files).expect("restore");
    }

    #[test]
    fn a_commit_reaches_the_shared_remote_and_the_next_leader_takes_its_branch() {
        let (top, first, second, _) = fleet();
        let applied = edit(&first, "pub fn f() {}\n").expect("applied");
        let commit = applied.commit.expect("a commit");
        let remote = top.path().join("shared.git");
        assert_eq!(
            sh(&remote, &["rev-parse", "refs/heads/automaton/t"]),
            commit
        );
        let recorded = fs::read_to_string(first.task_dir(&name("t")).join(BRANCH)).expect("rec");
        assert_eq!(recorded.trim(), commit);
        // The next leader: its view from the replica, its branch from the remote.
        copy_view(&first, &second);
        assert_eq!(
            second.sync_task_branches(&[name("t")]).expect("sync"),
            (1, 0)
        );
        let b = second
            .task_branch(&name("t"))
            .expect("branch")
            .expect("repo");
        assert_eq!(b.commit, commit);
        // It goes on from there, and the remote follows.
        let next = edit(&second, "pub fn g() {}\n").expect("applied");
        assert_eq!(
            sh(&remote, &["rev-parse", "refs/heads/automaton/t"]),
            next.commit.expect("a commit")
        );
    }

    #[test]
    fn a_branch_served_before_any_change_is_on_the_remote_for_the_next_leader() {
        let (top, first, second, _) = fleet();
        // A worker fetched the code: the branch exists, no change yet.
        let head = first
            .task_branch(&name("t"))
            .expect("branch")
            .expect("repo");
        let remote = top.path().join("shared.git");
        assert_eq!(
            sh(&remote, &["rev-parse", "refs/heads/automaton/t"]),
            head.commit
        );
        // The next leader takes the worker's changes on that base.
        copy_view(&first, &second);
        second.sync_task_branches(&[name("t")]).expect("sync");
        let applied =
            edit_on(&second, &head.commit, "pub fn f() {}\n").expect("applied on the new leader");
        assert!(applied.commit.is_some());
    }

    #[test]
    fn a_writer_behind_the_remote_is_refused_and_moves_nothing() {
        let (top, first, second, _) = fleet();
        second.create_task(&name("t")).expect("create");
        // The second moved the branch on the remote first (it leads now) ...
        second.task_branch(&name("t")).expect("branch");
        edit(&second, "pub fn second() {}\n").expect("applied");
        // ... so the first, deposed without knowing, cannot start or move it: not a
        // fast-forward of the remote's.
        let e = first.task_branch(&name("t")).expect_err("refused");
        assert!(matches!(e, Error::SharedRemote { .. }), "{e}");
        assert!(e.to_string().contains("rejected"), "{e}");
        assert!(
            git(
                first.root(),
                &["rev-parse", "--verify", "--quiet", "refs/heads/automaton/t"]
            )
            .is_err(),
            "the refused writer has no branch of its own"
        );
        let e = edit_on(
            &first,
            &sh(second.root(), &["rev-parse", "main"]),
            "pub fn first() {}\n",
        )
        .expect_err("refused");
        assert!(
            matches!(e, Error::SharedRemote { .. } | Error::NoBranch { .. }),
            "{e}"
        );
        let remote = top.path().join("shared.git");
        assert_eq!(
            sh(&remote, &["rev-parse", "refs/heads/automaton/t"]),
            sh(second.root(), &["rev-parse", "refs/heads/automaton/t"]),
            "the remote keeps the leader's branch"
        );
    }

    #[test]
    fn a_head_recorded_but_never_pushed_gives_way_to_the_remotes() {
        let (_top, first, second, _) = fleet();
        let applied = edit(&first, "pub fn f() {}\n").expect("applied");
        copy_view(&first, &second);
        // A crash between the record and the push: the record names a commit nobody has.
        let record = second.task_dir(&name("t")).join(BRANCH);
        fs::write(&record, "0123456789abcdef0123456789abcdef01234567\n").expect("write");
        assert_eq!(
            second.sync_task_branches(&[name("t")]).expect("sync"),
            (0, 1)
        );
        let kept = fs::read_to_string(&record).expect("record");
        assert_eq!(kept.trim(), applied.commit.expect("commit"));
    }
}
