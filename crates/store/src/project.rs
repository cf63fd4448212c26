//! One project's task store and every operation of the status commands.

use std::fs;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, SystemTime};

use automaton_workflow::{
    AgentId, ApprovalRecord, Artifact, Facts, Guidance, Phase, Policy, PolicyFile, State, TaskName,
    check_approve, check_transition, guidance, infer_state, out_of_order, parse_verdict,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::Error;
use crate::fsx::{self, ProjectLock, atomic_write, io_err, read_optional, remove_durably};
use crate::records::{Approval, Lease, parse_implementers};

const STATE: &str = ".state";
const APPROVALS: &str = ".state.approvals";
const LOCK: &str = ".state.lock";
const IMPLEMENTER: &str = ".state.implementer";
const SUBTASKS: &str = "subtasks";

/// A project: where its tasks live and who the user is (for `~/.automaton`).
#[derive(Debug, Clone)]
pub struct Project {
    root: PathBuf,
    /// `{project}/.automaton`, or `~/.automaton` itself when the project is that folder.
    meta: PathBuf,
    tasks: PathBuf,
    home: Option<PathBuf>,
}

/// An artifact file in a task folder.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ArtifactInfo {
    pub artifact: Artifact,
    pub bytes: u64,
}

/// Where a gated phase stands with its approval.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ApprovalView {
    /// The phase is open: its artifact needs a person's sign-off once written.
    Required {
        artifact: Artifact,
    },
    Awaiting {
        artifact: Artifact,
    },
    Approved {
        artifact: Artifact,
        record: Option<Approval>,
        stale: bool,
    },
}

/// Everything `status --task` shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskView {
    pub task: TaskName,
    pub state_file: PathBuf,
    /// `.state` exists; otherwise `state` is the artifact heuristic's guess.
    pub tracked: bool,
    /// `None`: untracked and no artifact to guess from ("unknown").
    pub state: Option<State>,
    pub parent: Option<(TaskName, Option<State>)>,
    pub artifacts: Vec<ArtifactInfo>,
    pub approval: Option<ApprovalView>,
    /// The live lease, if any.
    pub lease: Option<Lease>,
    pub implementers: Vec<AgentId>,
    pub subtasks: Vec<TaskName>,
    pub guidance: Option<Guidance>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TransitionOutcome {
    pub task: TaskName,
    pub from: State,
    pub to: State,
    /// The lease that ended with the phase it was granted for.
    pub released: Option<Lease>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproveOutcome {
    pub task: TaskName,
    pub from: State,
    pub to: State,
    pub approval: Approval,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListEntry {
    pub task: TaskName,
    pub state: Option<State>,
    pub tracked: bool,
    pub next: Vec<State>,
    pub approval_stale: bool,
    pub lease_holder: Option<AgentId>,
    pub subtasks: Vec<ListEntry>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FolderReport {
    pub task: TaskName,
    pub state: Option<State>,
    pub tracked: bool,
    pub out_of_order: Vec<Artifact>,
}

impl FolderReport {
    pub fn passed(&self) -> bool {
        self.tracked && self.out_of_order.is_empty()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Upgraded {
    pub task: TaskName,
    pub state: State,
    /// `true` when artifacts suggested the state, `false` for an empty folder (written `new`).
    pub inferred: bool,
}

/// What a task folder holds, read once per command.
pub(crate) struct Folder {
    pub dir: PathBuf,
    pub state: Option<State>,
    pub artifacts: Vec<ArtifactInfo>,
}

impl Folder {
    pub fn facts(&self) -> Facts {
        Facts {
            present: self.artifacts.iter().map(|a| a.artifact).collect(),
            non_empty: self
                .artifacts
                .iter()
                .filter(|a| a.bytes > 0)
                .map(|a| a.artifact)
                .collect(),
            verdict: None,
            approval_stale: false,
        }
    }
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
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn tasks_dir(&self) -> &Path {
        &self.tasks
    }

    fn tmp_dir(&self) -> PathBuf {
        self.meta.join("tmp")
    }

    /// The writer lock, for a command on an existing `task`. Without a `.automaton/` folder
    /// no task exists: say so without creating anything.
    fn lock(&self, task: &TaskName) -> Result<ProjectLock, Error> {
        if !self.meta.is_dir() {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        ProjectLock::acquire(&self.meta, &self.tmp_dir())
    }

    fn write(&self, target: &Path, bytes: &[u8]) -> Result<(), Error> {
        atomic_write(&self.tmp_dir(), target, bytes)
    }

    pub fn task_dir(&self, task: &TaskName) -> PathBuf {
        match task.parent() {
            Some(p) => self.tasks.join(p.leaf()).join(SUBTASKS).join(task.leaf()),
            None => self.tasks.join(task.leaf()),
        }
    }

    fn tasks_display(&self) -> String {
        self.tasks.display().to_string()
    }

    /// The project's policy: its `.agent.md` over `~/.automaton/.agent.md`.
    pub fn policy(&self) -> Result<Policy, Error> {
        let read = |path: PathBuf| -> Result<PolicyFile, Error> {
            match read_optional(&path)? {
                None => Ok(PolicyFile::default()),
                Some(text) => {
                    PolicyFile::parse(&text).map_err(|source| Error::Policy { source, path })
                }
            }
        };
        let project = read(self.root.join(".agent.md"))?;
        let user = match &self.home {
            Some(h) if h.join(".automaton") != self.root => {
                read(h.join(".automaton").join(".agent.md"))?
            }
            _ => PolicyFile::default(),
        };
        Ok(Policy::layered(&project, &user))
    }

    // ----- reading ---------------------------------------------------------------------

    pub(crate) fn folder(&self, task: &TaskName) -> Result<Folder, Error> {
        let dir = self.task_dir(task);
        if !dir.is_dir() {
            return Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            });
        }
        let state_path = dir.join(STATE);
        let state = match read_optional(&state_path)? {
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
                let bytes = fs::metadata(&path).map_err(io_err("stat", &path))?.len();
                artifacts.push(ArtifactInfo { artifact, bytes });
            }
        }
        Ok(Folder {
            dir,
            state,
            artifacts,
        })
    }

    fn tracked(&self, task: &TaskName) -> Result<(Folder, State), Error> {
        let folder = self.folder(task)?;
        match folder.state {
            Some(s) => Ok((folder, s)),
            None => Err(Error::Untracked { task: task.clone() }),
        }
    }

    fn lease(&self, dir: &Path) -> Result<Option<Lease>, Error> {
        let path = dir.join(LOCK);
        match read_optional(&path)? {
            None => Ok(None),
            Some(text) => Lease::parse(&text)
                .map(Some)
                .map_err(|detail| Error::CorruptLease { path, detail }),
        }
    }

    fn approvals(&self, dir: &Path) -> Result<Vec<Approval>, Error> {
        let path = dir.join(APPROVALS);
        match read_optional(&path)? {
            None => Ok(Vec::new()),
            Some(text) => Approval::parse_log(&text)
                .map_err(|(line, detail)| Error::CorruptApprovals { path, line, detail }),
        }
    }

    fn implementers(&self, dir: &Path) -> Result<Vec<AgentId>, Error> {
        let path = dir.join(IMPLEMENTER);
        match read_optional(&path)? {
            None => Ok(Vec::new()),
            Some(text) => parse_implementers(&text)
                .map_err(|(line, detail)| Error::CorruptImplementers { path, line, detail }),
        }
    }

    /// The sha256 (hex) of an artifact, `None` when it does not exist.
    fn artifact_sha(&self, dir: &Path, artifact: Artifact) -> Result<Option<String>, Error> {
        let path = dir.join(artifact.file_name());
        match fs::read(&path) {
            Ok(bytes) => Ok(Some(hex(&Sha256::digest(&bytes)))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err("read", &path)(e)),
        }
    }

    /// The latest approval of `phase`, and whether the artifact changed since it.
    fn approval_status(
        &self,
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
        Ok((Some(record), status))
    }

    /// The facts the rules need for a state change from `state`.
    fn facts_for(&self, folder: &Folder, state: State) -> Result<Facts, Error> {
        let mut facts = folder.facts();
        if state.is_approved() {
            let log = self.approvals(&folder.dir)?;
            facts.approval_stale =
                self.approval_status(&folder.dir, state.phase, &log)?.1 == ApprovalRecord::Stale;
        }
        if state.phase == Phase::Referee {
            let path = folder.dir.join(Artifact::Verdict.file_name());
            facts.verdict = read_optional(&path)?.as_deref().and_then(parse_verdict);
        }
        Ok(facts)
    }

    /// `status --task`.
    pub fn view(&self, task: &TaskName, now: SystemTime) -> Result<TaskView, Error> {
        let folder = self.folder(task)?;
        let tracked = folder.state.is_some();
        let state = folder
            .state
            .or_else(|| infer_state(&folder.facts().present));
        let parent = match task.parent() {
            Some(p) => {
                let pf = self.folder(&p)?;
                Some((p, pf.state))
            }
            None => None,
        };
        let approval = match state {
            Some(s) if s.phase.is_gated() => {
                let artifact = s.phase.artifact().expect("gated phases have artifacts");
                Some(match s.gate {
                    automaton_workflow::Gate::Open => ApprovalView::Required { artifact },
                    automaton_workflow::Gate::AwaitingApproval => {
                        ApprovalView::Awaiting { artifact }
                    }
                    automaton_workflow::Gate::Approved => {
                        let log = self.approvals(&folder.dir)?;
                        let (record, status) = self.approval_status(&folder.dir, s.phase, &log)?;
                        ApprovalView::Approved {
                            artifact,
                            record,
                            stale: status == ApprovalRecord::Stale,
                        }
                    }
                })
            }
            _ => None,
        };
        let lease = self.lease(&folder.dir)?.filter(|l| l.is_live(now));
        let subtasks = if task.is_subtask() {
            Vec::new()
        } else {
            self.subtask_names(task)?
        };
        Ok(TaskView {
            task: task.clone(),
            state_file: folder.dir.join(STATE),
            tracked,
            state,
            parent,
            approval,
            lease,
            implementers: self.implementers(&folder.dir)?,
            subtasks,
            guidance: state.map(|s| guidance(&task.to_string(), s)),
            artifacts: folder.artifacts,
        })
    }

    fn subtask_names(&self, parent: &TaskName) -> Result<Vec<TaskName>, Error> {
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

    /// `status --list`.
    pub fn list(&self, now: SystemTime) -> Result<Vec<ListEntry>, Error> {
        let entry = |t: &TaskName| -> Result<ListEntry, Error> {
            let folder = self.folder(t)?;
            let state = folder
                .state
                .or_else(|| infer_state(&folder.facts().present));
            let approval_stale = match folder.state {
                Some(s) if s.is_approved() => self.facts_for(&folder, s)?.approval_stale,
                _ => false,
            };
            Ok(ListEntry {
                task: t.clone(),
                tracked: folder.state.is_some(),
                next: state.map(State::legal_targets).unwrap_or_default(),
                state,
                approval_stale,
                lease_holder: self
                    .lease(&folder.dir)?
                    .filter(|l| l.is_live(now))
                    .map(|l| l.agent),
                subtasks: Vec::new(),
            })
        };
        let mut out = Vec::new();
        for t in self.task_names()? {
            let mut e = entry(&t)?;
            for s in self.subtask_names(&t)? {
                e.subtasks.push(entry(&s)?);
            }
            out.push(e);
        }
        Ok(out)
    }

    /// `status --validate-folder`.
    pub fn validate_folder(&self, task: &TaskName) -> Result<FolderReport, Error> {
        let folder = self.folder(task)?;
        Ok(FolderReport {
            task: task.clone(),
            state: folder.state,
            tracked: folder.state.is_some(),
            out_of_order: folder
                .state
                .map(|s| out_of_order(s, &folder.facts().present))
                .unwrap_or_default(),
        })
    }

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

    // ----- writing ---------------------------------------------------------------------

    /// `status --create-task`: the folder appears whole (with `.state` = `new` and an empty
    /// `.state.approvals`) or not at all.
    pub fn create_task(&self, task: &TaskName) -> Result<PathBuf, Error> {
        let _lock = match task.parent() {
            Some(p) => self.lock(&p).map_err(|e| match e {
                Error::TaskNotFound { task, tasks } => Error::ParentNotFound {
                    parent: task,
                    tasks,
                },
                e => e,
            })?,
            None => {
                fs::create_dir_all(&self.meta).map_err(io_err("create", &self.meta))?;
                ProjectLock::acquire(&self.meta, &self.tmp_dir())?
            }
        };
        if let Some(p) = task.parent() {
            let pdir = self.task_dir(&p);
            if !pdir.is_dir() {
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
        let staging = self
            .tmp_dir()
            .join(fsx::temp_name(&format!("create-{}", task.leaf())));
        let built = (|| {
            fs::create_dir_all(&staging).map_err(io_err("create", &staging))?;
            for (name, content) in [(STATE, &b"new\n"[..]), (APPROVALS, &b""[..])] {
                let path = staging.join(name);
                let f = fs::File::create(&path).map_err(io_err("create", &path))?;
                std::io::Write::write_all(&mut &f, content).map_err(io_err("write", &path))?;
                f.sync_all().map_err(io_err("sync", &path))?;
            }
            fsx::sync_dir(&staging)?;
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
    fn apply_transition(&self, folder: &Folder, from: State, target: State) -> Result<(), Error> {
        check_transition(from, target, &self.facts_for(folder, from)?)?;
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
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        let lease = self.lease(&folder.dir)?;
        self.check_holder(task, lease.as_ref(), agent, token, now)?;
        self.apply_transition(&folder, from, target)?;
        if lease.is_some() {
            remove_durably(&folder.dir.join(LOCK))?;
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
    pub fn transition_owned(&self, task: &TaskName, target: State) -> Result<State, Error> {
        let _lock = self.lock(task)?;
        let (folder, from) = self.tracked(task)?;
        self.apply_transition(&folder, from, target)?;
        Ok(from)
    }

    /// `status --approve` without a coordinator: the lease holder is read from `.state.lock`.
    pub fn approve(
        &self,
        task: &TaskName,
        approver: &str,
        now: SystemTime,
    ) -> Result<ApproveOutcome, Error> {
        self.approve_inner(task, approver, now, |dir| {
            Ok(self.lease(dir)?.filter(|l| l.is_live(now)).map(|l| l.agent))
        })
    }

    /// `--approve` by the coordinator, which knows the live lease holder itself.
    pub fn approve_as(
        &self,
        task: &TaskName,
        approver: &str,
        holder: Option<&AgentId>,
        now: SystemTime,
    ) -> Result<ApproveOutcome, Error> {
        self.approve_inner(task, approver, now, |_| Ok(holder.cloned()))
    }

    /// Records who approved which content, then moves to `:approved`.
    fn approve_inner(
        &self,
        task: &TaskName,
        approver: &str,
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
        if policy.separated.contains(&from.phase)
            && self.implementers(&folder.dir)?.contains(&approver_id)
        {
            return Err(Error::Separation {
                task: task.clone(),
                agent: approver.to_string(),
                phase: from.phase,
                action: "approve",
            });
        }
        if holder(&folder.dir)?.as_ref() == Some(&approver_id) {
            return Err(Error::SelfApproval {
                task: task.clone(),
                agent: approver.to_string(),
            });
        }
        let to = check_approve(from, &self.facts_for(&folder, from)?)?;
        let artifact = from.phase.artifact().expect("gated phases have artifacts");
        let approval = Approval {
            phase: from.phase,
            at: now,
            approver: approver.to_string(),
            sha256: self.artifact_sha(&folder.dir, artifact)?,
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

    /// May `agent` hold `task` now, lease aside? The task must be tracked, neither waiting for
    /// approval nor finished, and `agent` must not be barred from its phase (reviewer ≠
    /// implementer). Returns the task's state.
    pub fn claimable(
        &self,
        task: &TaskName,
        agent: &AgentId,
        policy: &Policy,
    ) -> Result<State, Error> {
        let state = self.tracked_state(task)?;
        self.claimable_in(task, state, agent, policy)?;
        Ok(state)
    }

    /// A tracked task's state, read from `.state` alone (not the whole folder).
    pub fn tracked_state(&self, task: &TaskName) -> Result<State, Error> {
        let dir = self.task_dir(task);
        let state_path = dir.join(STATE);
        match read_optional(&state_path)? {
            Some(text) => text
                .trim()
                .parse::<State>()
                .map_err(|source| Error::UnknownPhase {
                    source,
                    path: state_path.clone(),
                }),
            None if dir.is_dir() => Err(Error::Untracked { task: task.clone() }),
            None => Err(Error::TaskNotFound {
                task: task.clone(),
                tasks: self.tasks_display(),
            }),
        }
    }

    /// The claim rules for a task known to be in `state` (a caller that owns the project may
    /// know it without reading `.state`).
    pub fn claimable_in(
        &self,
        task: &TaskName,
        state: State,
        agent: &AgentId,
        policy: &Policy,
    ) -> Result<(), Error> {
        let why = if state.is_awaiting_approval() {
            Some("it waits for a person's approval (--approve)")
        } else if state.is_terminal() {
            Some("the task is finished")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::NotClaimable {
                task: task.clone(),
                state,
                why,
            });
        }
        if policy.separated.contains(&state.phase)
            && self.implementers(&self.task_dir(task))?.contains(agent)
        {
            return Err(Error::Separation {
                task: task.clone(),
                agent: agent.to_string(),
                phase: state.phase,
                action: "claim",
            });
        }
        Ok(())
    }

    /// Adds `agent` to `.state.implementer` when it takes the implement phase.
    pub fn record_implementer(
        &self,
        task: &TaskName,
        agent: &AgentId,
        state: State,
    ) -> Result<(), Error> {
        if state.phase != Phase::Implement {
            return Ok(());
        }
        let dir = self.task_dir(task);
        let implementers = self.implementers(&dir)?;
        if implementers.contains(agent) {
            return Ok(());
        }
        let mut text: String = implementers.iter().map(|a| format!("{a}\n")).collect();
        text.push_str(&format!("{agent}\n"));
        self.write(&dir.join(IMPLEMENTER), text.as_bytes())
    }

    /// `status --claim` without a coordinator: grants (or, for the holder, renews) the
    /// task's lease in `.state.lock`.
    pub fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
        now: SystemTime,
    ) -> Result<(Lease, bool), Error> {
        let policy = self.policy()?;
        if !policy.multi_agent {
            return Err(Error::NotMultiAgent {
                project: self.root.clone(),
            });
        }
        let bounds = automaton_workflow::TtlBounds::DEFAULT;
        let ttl = match ttl {
            Some(t) => bounds
                .check(t)
                .map_err(|r| Error::from_refusal(task, r, now))?,
            None => bounds.clamp(policy.lock_timeout),
        };
        let _lock = self.lock(task)?;
        let state = self.claimable(task, agent, &policy)?;
        let dir = self.task_dir(task);
        let lock_path = dir.join(LOCK);
        if let Some(l) = self.lease(&dir)?.filter(|l| l.is_live(now)) {
            if &l.agent != agent {
                return Err(Error::Leased {
                    task: task.clone(),
                    holder: l.agent,
                    expires: l.expires,
                    token: l.token,
                });
            }
            let renewed = Lease {
                expires: now + ttl,
                ..l
            };
            self.write(&lock_path, renewed.render().as_bytes())?;
            return Ok((renewed, true));
        }
        let token = self.fencing_mark()? + 1;
        self.set_fencing_mark(token)?;
        self.record_implementer(task, agent, state)?;
        let lease = Lease {
            agent: agent.clone(),
            phase: state,
            claimed: now,
            expires: now + ttl,
            lease_id: new_lease_id(task, agent, token, now),
            token,
        };
        self.write(&lock_path, lease.render().as_bytes())?;
        Ok((lease, false))
    }

    /// The project's fencing high-water mark: no token at or below it will be issued again.
    pub fn fencing_mark(&self) -> Result<u64, Error> {
        let path = self.meta.join("fencing");
        match read_optional(&path)? {
            None => Ok(0),
            Some(t) => t
                .trim()
                .parse::<u64>()
                .map_err(|_| Error::CorruptFencing { path }),
        }
    }

    /// Persists a new high-water mark (durably: tokens must never repeat after a crash).
    pub fn set_fencing_mark(&self, mark: u64) -> Result<(), Error> {
        fs::create_dir_all(&self.meta).map_err(io_err("create", &self.meta))?;
        self.write(&self.meta.join("fencing"), format!("{mark}\n").as_bytes())
    }

    /// `status --release` without a coordinator: ends `agent`'s own lease.
    pub fn release(
        &self,
        task: &TaskName,
        agent: &AgentId,
        now: SystemTime,
    ) -> Result<Lease, Error> {
        let _lock = self.lock(task)?;
        let (folder, _) = self.tracked(task)?;
        match self.lease(&folder.dir)? {
            // The holder may remove its own lock file, live or lapsed.
            Some(l) if &l.agent == agent => {
                remove_durably(&folder.dir.join(LOCK))?;
                Ok(l)
            }
            Some(l) if l.is_live(now) => {
                let presented = automaton_workflow::lease::Presented {
                    agent: Some(agent),
                    ..Default::default()
                };
                Err(
                    automaton_workflow::lease::check_release(l.holder(), &presented)
                        .err()
                        .map_or(
                            Error::NoLease {
                                task: task.clone(),
                                agent: agent.clone(),
                            },
                            |r| Error::from_refusal(task, r, l.expires),
                        ),
                )
            }
            _ => Err(Error::NoLease {
                task: task.clone(),
                agent: agent.clone(),
            }),
        }
    }

    /// The lease mirrored in a task's `.state.lock`, if any.
    pub fn read_lease(&self, task: &TaskName) -> Result<Option<Lease>, Error> {
        self.lease(&self.task_dir(task))
    }

    /// The coordinator's materialised view of a lease: `.state.lock` rewritten (or removed)
    /// atomically but without a sync of its own. The coordinator's log is what is durable;
    /// it repairs these files at start.
    pub fn write_lease_view(&self, task: &TaskName, lease: Option<&Lease>) -> Result<(), Error> {
        let dir = self.task_dir(task);
        let path = dir.join(LOCK);
        match lease {
            None => match fs::remove_file(&path) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(io_err("remove", &path)(e)),
            },
            Some(l) if dir.is_dir() => {
                fsx::replace_unsynced(&self.tmp_dir(), &path, l.render().as_bytes())
            }
            // The task folder is gone: there is nothing to mirror into.
            Some(_) => Ok(()),
        }
    }

    /// The state in a task's `.state`, `None` when the folder has none.
    pub fn read_state(&self, task: &TaskName) -> Result<Option<State>, Error> {
        Ok(self.folder(task)?.state)
    }

    /// `{project}/.automaton` (or `~/.automaton`): where the coordinator keeps its files.
    pub fn meta(&self) -> &Path {
        &self.meta
    }

    /// `status --upgrade`: writes `.state` (and an empty `.state.approvals`) for task folders
    /// that predate `.state`, from the artifact heuristic; an empty folder becomes `new`.
    pub fn upgrade(&self, only: Option<&TaskName>) -> Result<Vec<Upgraded>, Error> {
        let (_lock, tasks) = match only {
            Some(t) => (self.lock(t)?, vec![t.clone()]),
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

    pub(crate) fn approval_record(
        &self,
        folder: &Folder,
        state: State,
    ) -> Result<Option<ApprovalRecord>, Error> {
        if !state.is_approved() {
            return Ok(None);
        }
        let log = self.approvals(&folder.dir)?;
        Ok(Some(
            self.approval_status(&folder.dir, state.phase, &log)?.1,
        ))
    }

    pub(crate) fn state_mtime(&self, folder: &Folder) -> Option<SystemTime> {
        fs::metadata(folder.dir.join(STATE))
            .and_then(|m| m.modified())
            .ok()
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A lease id unique per grant: a hash of what makes this grant different from every other.
/// The CLI's local mode and the coordinator both name their leases with it.
pub fn new_lease_id(task: &TaskName, agent: &AgentId, token: u64, now: SystemTime) -> String {
    let nanos = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let seed = format!("{task}|{agent}|{token}|{nanos}|{}", std::process::id());
    hex(&Sha256::digest(seed.as_bytes())[..8])
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
    use super::*;

    fn project() -> (tempfile::TempDir, Project) {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = Project::open(dir.path(), None);
        (dir, p)
    }

    fn name(s: &str) -> TaskName {
        s.parse().expect("valid name")
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

    #[test]
    fn user_automaton_folder_keeps_tasks_directly_under_it() {
        let home = tempfile::tempdir().expect("home");
        let meta = home.path().join(".automaton");
        fs::create_dir_all(&meta).expect("mkdir");
        let p = Project::open(&meta, Some(home.path()));
        assert_eq!(p.tasks_dir(), meta.join("tasks"));
    }

    #[test]
    fn fencing_tokens_strictly_increase() {
        let (_d, p) = project();
        fs::write(p.root().join(".agent.md"), "Mode: multi-agent\n").expect("agent.md");
        p.create_task(&name("t")).expect("create");
        let now = SystemTime::now();
        p.transition(
            &name("t"),
            "research".parse().expect("valid"),
            None,
            None,
            now,
        )
        .expect("research");
        let a: AgentId = "a".parse().expect("valid");
        let mut last = 0;
        for _ in 0..5 {
            let (lease, renewed) = p.claim(&name("t"), &a, None, now).expect("claim");
            assert!(!renewed);
            assert!(lease.token > last);
            last = lease.token;
            p.release(&name("t"), &a, now).expect("release");
        }
    }
}
