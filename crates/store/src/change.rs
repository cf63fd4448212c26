//! The task writes: `--create-task`, `--transition` (local, and the coordinator's
//! `transition_owned`), `--approve` (the approvals log first, then `.state`) and `--upgrade`.
//! Each checks the rules of `automaton-workflow` and writes under the task's writer lock
//! (creating a top-level task: the whole project's; see `fsx::TaskLock`); the lease files
//! are `lease_files.rs`'s.
//!
//! Completions: a transition that ends a coordinator's lease leaves a record of it in
//! `.automaton/completions/{lease_id}` (the task, the token, the agent, from and to), written
//! after `.state` and before the lease's end is in the coordinator's log. A retry of that
//! completion arrives under the ended lease and names nothing else, hence a record per lease
//! rather than per task; records older than [`COMPLETION_RECORD_AGE`] are pruned.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use automaton_workflow::{
    AgentId, Phase, State, TaskName, check_approve, check_transition, infer_state,
};
use serde::{Deserialize, Serialize};

use crate::fsx::{self, ProjectLock, io_err};
use crate::project::{APPROVALS, LOCK, STATE};
use crate::read::Folder;
use crate::records::{Approval, Lease};
use crate::{Error, Project};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TransitionOutcome {
    pub task: TaskName,
    pub from: State,
    pub to: State,
    /// The lease that ended with the phase it was granted for.
    pub released: Option<Lease>,
}

/// The folder of completion records, under `.automaton/`.
const COMPLETIONS: &str = "completions";
/// How long a completion record is kept: far longer than any retry of its call.
pub const COMPLETION_RECORD_AGE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// The lease whose transition moved a task: what a retry of its completion is answered with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    pub lease_id: String,
    pub token: u64,
    pub agent: AgentId,
    pub task: TaskName,
    pub from: State,
    pub to: State,
}

impl Completion {
    fn render(&self) -> String {
        format!(
            "lease: {}\ntoken: {}\nagent: {}\ntask: {}\nfrom: {}\nto: {}\n",
            self.lease_id, self.token, self.agent, self.task, self.from, self.to
        )
    }

    fn parse(text: &str) -> Option<Completion> {
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix(": "))
                .map(str::to_string)
        };
        Some(Completion {
            lease_id: field("lease")?,
            token: field("token")?.parse().ok()?,
            agent: field("agent")?.parse().ok()?,
            task: field("task")?.parse().ok()?,
            from: field("from")?.parse().ok()?,
            to: field("to")?.parse().ok()?,
        })
    }
}

/// A lease id as a file name: hexadecimal, as `new_lease_id` makes them; anything else has
/// no record.
fn lease_file_name(lease_id: &str) -> Option<&str> {
    (!lease_id.is_empty()
        && lease_id.len() <= 64
        && lease_id.bytes().all(|b| b.is_ascii_hexdigit()))
    .then_some(lease_id)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproveOutcome {
    pub task: TaskName,
    pub from: State,
    pub to: State,
    pub approval: Approval,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Upgraded {
    pub task: TaskName,
    pub state: State,
    /// `true` when artifacts suggested the state, `false` for an empty folder (written `new`).
    pub inferred: bool,
}

impl Project {
    /// `status --create-task`: the folder appears whole (with `.state` = `new` and an empty
    /// `.state.approvals`) or not at all.
    pub fn create_task(&self, task: &TaskName) -> Result<PathBuf, Error> {
        self.create_task_with(task, "new", &[])
    }

    /// A follow-up task of seeds 000/002 (fix, review, tie-break): created at `start` (e.g.
    /// `bug_find`) with copies of the original's artifacts (`files`: artifact file names and
    /// their content; an empty `IMPLEMENTATION.md` where the seeds say so). A copy that the
    /// starting phase forbids (004 §10: `ADVERSARIAL_BUG_REPORT.md` before its phase) is
    /// kept as `PREVIOUS_{NAME}` — context for the agent, not an out-of-order artifact that
    /// would block the task. The folder appears whole or not at all; an existing task is
    /// `AlreadyExists`.
    pub fn create_follow_up(
        &self,
        task: &TaskName,
        start: State,
        files: &[(&str, Vec<u8>)],
    ) -> Result<PathBuf, Error> {
        for (name, _) in files {
            if !automaton_workflow::Artifact::ALL
                .iter()
                .any(|a| a.file_name() == *name)
            {
                return Err(Error::NotAnArtifact {
                    name: name.to_string(),
                });
            }
        }
        let forbidden = automaton_workflow::forbidden_in(start.phase);
        let renamed: Vec<(String, &[u8])> = files
            .iter()
            .map(|(n, c)| {
                let blocked = forbidden.iter().any(|a| a.file_name() == *n);
                let name = if blocked {
                    format!("{}{n}", crate::work::PREVIOUS)
                } else {
                    n.to_string()
                };
                (name, c.as_slice())
            })
            .collect();
        let files: Vec<(&str, &[u8])> = renamed.iter().map(|(n, c)| (n.as_str(), *c)).collect();
        self.create_task_with(task, &start.to_string(), &files)
    }

    fn create_task_with(
        &self,
        task: &TaskName,
        state: &str,
        files: &[(&str, &[u8])],
    ) -> Result<PathBuf, Error> {
        let (_parent_lock, _project_lock) = match task.parent() {
            // A sub-task lives in its parent's folder: the parent's lock is enough.
            Some(p) => (
                Some(self.lock(&p).map_err(|e| match e {
                    Error::TaskNotFound { task, tasks } => Error::ParentNotFound {
                        parent: task,
                        tasks,
                    },
                    e => e,
                })?),
                None,
            ),
            None => {
                fs::create_dir_all(&self.meta).map_err(io_err("create", &self.meta))?;
                (
                    None,
                    Some(ProjectLock::acquire(&self.meta, &self.tmp_dir())?),
                )
            }
        };
        if let Some(p) = task.parent() {
            let pdir = self.task_dir(&p);
            if !self.is_real_dir(&pdir)? {
                return Err(Error::ParentNotFound {
                    parent: p,
                    tasks: self.tasks_display(),
                });
            }
        }
        let dir = self.task_dir(task);
        if dir.exists() {
            return Err(Error::AlreadyExists {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let parent_dir = dir
            .parent()
            .expect("a task folder has a parent")
            .to_path_buf();
        fs::create_dir_all(&parent_dir).map_err(io_err("create", &parent_dir))?;
        // `tasks/` or `subtasks/` a link: the folder would be renamed into wherever it points.
        self.is_real_dir(&parent_dir)?;
        let staging = self
            .tmp_dir()
            .join(fsx::temp_name(&format!("create-{}", task.leaf())));
        let built = (|| {
            fs::create_dir_all(&staging).map_err(io_err("create", &staging))?;
            let state_line = format!("{state}\n");
            let own = [(STATE, state_line.as_bytes()), (APPROVALS, &b""[..])];
            for (name, content) in own.into_iter().chain(files.iter().copied()) {
                let path = staging.join(name);
                let f = fs::File::create(&path).map_err(io_err("create", &path))?;
                std::io::Write::write_all(&mut &f, content).map_err(io_err("write", &path))?;
                f.sync_all().map_err(io_err("sync", &path))?;
            }
            fsx::sync_dir(&staging)?;
            // The replica first: a folder on disk that it lacks would vanish at the next
            // leader's view.
            let named: Vec<(PathBuf, &[u8])> = own
                .into_iter()
                .chain(files.iter().copied())
                .map(|(name, content)| (dir.join(name), content))
                .collect();
            let refs: Vec<(&Path, &[u8])> = named.iter().map(|(p, b)| (p.as_path(), *b)).collect();
            self.replicate(&refs)?;
            fs::rename(&staging, &dir).map_err(io_err("rename into place", &dir))
        })();
        if built.is_err() {
            let _ = fs::remove_dir_all(&staging);
        }
        built?;
        fsx::sync_dir(&parent_dir)?;
        Ok(dir)
    }

    /// Checks the lease rules for a change made by `agent` (with `token`, if presented)
    /// against the lease in `.state.lock`.
    fn check_holder(
        &self,
        task: &TaskName,
        lease: Option<&Lease>,
        agent: Option<&AgentId>,
        token: Option<u64>,
        now: SystemTime,
    ) -> Result<(), Error> {
        let live = lease.filter(|l| l.is_live(now));
        let presented = automaton_workflow::lease::Presented {
            agent,
            lease_id: None,
            token,
        };
        automaton_workflow::lease::check_change(live.map(Lease::holder), &presented)
            .map_err(|r| Error::from_refusal(task, r, live.map_or(now, |l| l.expires)))
    }

    /// Checks `from → target` against the lifecycle and writes `.state`.
    fn apply_transition(
        &self,
        task: &TaskName,
        folder: &Folder,
        from: State,
        target: State,
    ) -> Result<(), Error> {
        check_transition(from, target, &self.facts_for(task, folder, from)?)?;
        self.write(&folder.dir.join(STATE), format!("{target}\n").as_bytes())
    }

    /// `status --transition` without a coordinator. A live lease in `.state.lock` must be
    /// held by `agent` (and match `token` when given); the lease ends with the phase it was
    /// granted for.
    pub fn transition(
        &self,
        task: &TaskName,
        target: State,
        agent: Option<&AgentId>,
        token: Option<u64>,
        now: SystemTime,
    ) -> Result<TransitionOutcome, Error> {
        // The policy governs how a task may change: a broken .agent.md stops every change.
        self.policy()?;
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        let lease = self.lease(&folder.dir)?;
        self.check_holder(task, lease.as_ref(), agent, token, now)?;
        self.apply_transition(task, &folder, from, target)?;
        if lease.is_some() {
            self.remove_durably(&folder.dir.join(LOCK))?;
        }
        Ok(TransitionOutcome {
            task: task.clone(),
            from,
            to: target,
            released: lease.filter(|l| l.is_live(now)),
        })
    }

    /// A transition by the coordinator, which has already checked its own lease table:
    /// `.state.lock` is neither read nor touched. Returns the state it left.
    /// Whether [`Project::transition_owned`] would move `task` to `target` now (every check,
    /// nothing written): so a caller that writes something first (the coordinator's holder
    /// records) writes nothing for a move the lifecycle refuses.
    pub fn check_transition_owned(&self, task: &TaskName, target: State) -> Result<State, Error> {
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        check_transition(from, target, &self.facts_for(task, &folder, from)?)?;
        Ok(from)
    }

    pub fn transition_owned(&self, task: &TaskName, target: State) -> Result<State, Error> {
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        self.apply_transition(task, &folder, from, target)?;
        Ok(from)
    }

    /// The coordinator's move of `task` to `human_intervention` for a person
    /// ([`automaton_workflow::check_escalation`]: artifacts out of order do not refuse it).
    /// Returns the state it left.
    pub fn escalate_owned(&self, task: &TaskName) -> Result<State, Error> {
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        let target = automaton_workflow::check_escalation(from)?;
        self.write(&folder.dir.join(STATE), format!("{target}\n").as_bytes())?;
        Ok(from)
    }

    /// Records that `c.lease_id`'s transition moved its task, durably. Called after the
    /// move is on disk and before the lease's end is: see the module doc.
    pub fn record_completion(&self, c: &Completion) -> Result<(), Error> {
        let Some(name) = lease_file_name(&c.lease_id) else {
            return Ok(());
        };
        let dir = self.meta.join(COMPLETIONS);
        if !dir.is_dir() {
            fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
            fsx::sync_dir(&self.meta)?;
        }
        self.write(&dir.join(name), c.render().as_bytes())
    }

    /// The completion `lease_id`'s transition left, if any (a record that cannot be read as
    /// one is none: a retry is then refused as any call under an ended lease).
    pub fn completion(&self, lease_id: &str) -> Result<Option<Completion>, Error> {
        let Some(name) = lease_file_name(lease_id) else {
            return Ok(None);
        };
        let path = self.meta.join(COMPLETIONS).join(name);
        let text = match fsx::read_optional(&self.meta, &path) {
            Ok(t) => t,
            Err(Error::NotUtf8 { .. }) => None,
            Err(e) => return Err(e),
        };
        Ok(text
            .as_deref()
            .and_then(Completion::parse)
            .filter(|c| c.lease_id == lease_id))
    }

    /// Removes the completion records last written before `before`; returns how many.
    pub fn prune_completions(&self, before: SystemTime) -> Result<usize, Error> {
        let dir = self.meta.join(COMPLETIONS);
        let mut removed = 0;
        for (_, path, ft) in fsx::list_dir(&dir)? {
            let old = ft.is_file()
                && fs::symlink_metadata(&path)
                    .and_then(|m| m.modified())
                    .is_ok_and(|t| t < before);
            if old && self.remove_durably(&path).is_ok() {
                removed += 1;
            }
        }
        if removed > 0 {
            fsx::sync_dir(&dir)?;
        }
        Ok(removed)
    }

    /// `status --approve` without a coordinator: the lease holder is read from `.state.lock`.
    pub fn approve(
        &self,
        task: &TaskName,
        approver: &str,
        revision: Option<&str>,
        now: SystemTime,
    ) -> Result<ApproveOutcome, Error> {
        self.approve_inner(task, approver, revision, now, |dir| {
            Ok(self.lease(dir)?.filter(|l| l.is_live(now)).map(|l| l.agent))
        })
    }

    /// `--approve` by the coordinator, which knows the live lease holder itself.
    pub fn approve_as(
        &self,
        task: &TaskName,
        approver: &str,
        holder: Option<&AgentId>,
        revision: Option<&str>,
        now: SystemTime,
    ) -> Result<ApproveOutcome, Error> {
        self.approve_inner(task, approver, revision, now, |_| Ok(holder.cloned()))
    }

    /// Records who approved which content (and, for a code review, which commit of the task
    /// branch: its head, which must be `revision` when one is given), then moves to
    /// `:approved`.
    fn approve_inner(
        &self,
        task: &TaskName,
        approver: &str,
        revision: Option<&str>,
        now: SystemTime,
        holder: impl FnOnce(&Path) -> Result<Option<AgentId>, Error>,
    ) -> Result<ApproveOutcome, Error> {
        let approver_id: AgentId = approver.parse()?;
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        // Read (and so validate) the log before anything else: a corrupt log is refused,
        // never appended to.
        let log = self.approvals(&folder.dir)?;
        let policy = self.policy()?;
        if let Err(duty) = automaton_workflow::separation(
            &policy,
            from.phase,
            &approver_id,
            &self.implementers(&folder.dir)?,
            automaton_workflow::Duty::Approve,
        ) {
            return Err(Error::Separation {
                task: task.clone(),
                agent: approver.to_string(),
                phase: from.phase,
                action: duty.name(),
            });
        }
        if holder(&folder.dir)?.as_ref() == Some(&approver_id) {
            return Err(Error::SelfApproval {
                task: task.clone(),
                agent: approver.to_string(),
            });
        }
        // Whoever held a lease on this phase did its work: they may not sign it off.
        if self
            .holders(&folder.dir)?
            .iter()
            .any(|(p, a)| *p == from.phase && a == &approver_id)
        {
            return Err(Error::HeldPhase {
                task: task.clone(),
                agent: approver.to_string(),
                phase: from.phase,
            });
        }
        let to = check_approve(from, &self.facts_for(task, &folder, from)?)?;
        let commit = self.approved_commit(task, from.phase, revision)?;
        let artifact = from.phase.artifact().expect("gated phases have artifacts");
        let approval = Approval {
            phase: from.phase,
            at: now,
            approver: approver.to_string(),
            sha256: self.artifact_sha(&folder.dir, artifact)?,
            commit,
        };
        // The log first: a crash between the two writes leaves an approval on record and the
        // task still awaiting, and approving again is harmless. The reverse order could leave
        // an `:approved` state that nobody approved.
        let mut text: String = log.iter().map(Approval::render).collect();
        text.push_str(&approval.render());
        self.write(&folder.dir.join(APPROVALS), text.as_bytes())?;
        self.write(&folder.dir.join(STATE), format!("{to}\n").as_bytes())?;
        Ok(ApproveOutcome {
            task: task.clone(),
            from,
            to,
            approval,
        })
    }

    /// The commit a code review's approval is bound to: the task branch's head (none without
    /// a repository or branch), which must start with `revision` when one is given.
    fn approved_commit(
        &self,
        task: &TaskName,
        phase: Phase,
        revision: Option<&str>,
    ) -> Result<Option<String>, Error> {
        let bad = |why| Error::BadRevision {
            task: task.clone(),
            revision: automaton_workflow::excerpt(revision.unwrap_or_default()),
            why,
        };
        if let Some(r) = revision {
            if phase != Phase::CodeReview {
                return Err(bad(
                    "only a code review's approval is bound to a commit: approve without --revision",
                ));
            }
            if !(7..=64).contains(&r.len()) || !r.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bad(
                    "not a commit id: give 7 to 64 hex digits of the branch's head",
                ));
            }
        }
        if phase != Phase::CodeReview {
            return Ok(None);
        }
        let head = self.branch_head(task)?;
        match (revision, head) {
            (Some(_), None) => Err(bad("the task has no branch yet, so no commit to approve")),
            (Some(r), Some(h)) if !h.starts_with(&r.to_ascii_lowercase()) => {
                Err(Error::RevisionMoved {
                    task: task.clone(),
                    revision: r.to_string(),
                    head: h,
                })
            }
            (_, head) => Ok(head),
        }
    }

    /// `status --upgrade`: writes `.state` (and an empty `.state.approvals`) for task folders
    /// that predate `.state`, from the artifact heuristic; an empty folder becomes `new`.
    pub fn upgrade(&self, only: Option<&TaskName>) -> Result<Vec<Upgraded>, Error> {
        let (_lock, tasks) = match only {
            Some(t) => (self.lock_project(t)?, vec![t.clone()]),
            // Without a tasks folder there is nothing to upgrade, and nothing to lock.
            None if !self.meta.is_dir() => return Ok(Vec::new()),
            None => (
                ProjectLock::acquire(&self.meta, &self.tmp_dir())?,
                self.all_task_names()?,
            ),
        };
        let mut out = Vec::new();
        for t in tasks {
            let folder = self.folder(&t)?;
            if folder.state.is_some() {
                continue;
            }
            let guess = infer_state(&folder.facts().present);
            let state = guess.unwrap_or(State::open(Phase::New));
            let approvals = folder.dir.join(APPROVALS);
            if !approvals.exists() {
                self.write(&approvals, b"")?;
            }
            self.write(&folder.dir.join(STATE), format!("{state}\n").as_bytes())?;
            out.push(Upgraded {
                task: t,
                state,
                inferred: guess.is_some(),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::fs;

    use crate::Error;
    use crate::project::tests::{name, project};

    #[test]
    fn completion_records_round_trip_refuse_odd_lease_ids_and_are_pruned() {
        let (_d, p) = project();
        let done = super::Completion {
            lease_id: "00ff00ff00ff00ff".into(),
            token: u64::MAX,
            agent: "agent-x".parse().expect("agent"),
            task: name("a/b"),
            from: "research".parse().expect("state"),
            to: "research:awaiting_approval".parse().expect("state"),
        };
        p.record_completion(&done).expect("record");
        assert_eq!(
            p.completion("00ff00ff00ff00ff").expect("read"),
            Some(done.clone())
        );
        for id in [
            "",
            "../../tasks/t/.state",
            "00FF/..",
            &"a".repeat(65),
            "nothere0",
        ] {
            assert_eq!(p.completion(id).expect("read"), None, "{id:?}");
        }
        // A record that is not one is none.
        let path = p.meta.join("completions").join("00ff00ff00ff00ff");
        fs::write(&path, b"\xff\xfe").expect("garble");
        assert_eq!(p.completion("00ff00ff00ff00ff").expect("read"), None);
        fs::write(&path, b"lease: 00ff00ff00ff00ff\n").expect("truncate");
        assert_eq!(p.completion("00ff00ff00ff00ff").expect("read"), None);
        p.record_completion(&done).expect("record");
        let past = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        assert_eq!(p.prune_completions(past).expect("prune"), 0, "young kept");
        let future = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
        assert_eq!(p.prune_completions(future).expect("prune"), 1);
        assert_eq!(p.completion("00ff00ff00ff00ff").expect("read"), None);
    }

    #[test]
    fn create_task_writes_new_and_empty_approvals() {
        let (_d, p) = project();
        let dir = p.create_task(&name("add-user-auth")).expect("create");
        assert_eq!(
            fs::read_to_string(dir.join(".state")).expect("state"),
            "new\n"
        );
        assert_eq!(
            fs::read_to_string(dir.join(".state.approvals")).expect("log"),
            ""
        );
        assert!(matches!(
            p.create_task(&name("add-user-auth")),
            Err(Error::AlreadyExists { .. })
        ));
        assert!(matches!(
            p.create_task(&name("nope/sub")),
            Err(Error::ParentNotFound { .. })
        ));
        p.create_task(&name("add-user-auth/sub-a"))
            .expect("subtask");
        assert_eq!(p.all_task_names().expect("list").len(), 2);
        assert_eq!(
            fs::read_dir(p.tmp_dir()).expect("tmp").count(),
            0,
            "no staging left behind"
        );
    }
}
