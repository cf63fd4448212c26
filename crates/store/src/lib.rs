//! The on-disk task store of automaton: the layout under `{project}/.automaton/`, atomic
//! `.state` writes, the append-only approvals log, `.state.lock` leases with fencing tokens,
//! `.state.implementer` and `.state.holders`, the coordinator's `.state.dispatch`, the
//! completion records that answer a retried completion, the layered lookup of framework
//! files, the audit (git2 for unauthorised modifications), and — with a coordinator on etcd —
//! the replica every durable write goes to first (`replica.rs`) and the task branches shared
//! through a git remote (`git_remote.rs`); a decomposed task's branch integrating its
//! sub-tasks' (`integrate.rs`).
//!
//! Policy comes from `automaton-workflow`; this crate only reads facts, asks the rules, and
//! writes the result durably under fs4 writer locks (one per task; the whole project's for
//! what changes its shape). It must not know about gRPC or
//! print anything: callers render what it returns.

mod audit;
mod dispatch;
mod fsx;
#[cfg(test)]
#[path = "../../workflow/src/fuzz.rs"]
mod fuzz;
#[cfg(test)]
mod fuzz_tests;
mod lease_store;
mod parents;
mod project;
mod records;
mod replica;

// The operations of `Project` (defined in project.rs): `impl Project` blocks, one concern a file.
mod change;
mod delivery;
mod fencing;
mod git;
mod git_remote;
mod integrate;
mod layered;
mod lease_files;
mod read;
mod scope;
mod view;
mod work;

use std::path::PathBuf;

use automaton_workflow::{
    AgentId, ApproveError, NameError, Phase, PolicyError, State, TaskName, TransitionError,
    UnknownPhase,
};

pub use audit::{AuditReport, AuditTask, Category3, Modification};
pub use change::{ApproveOutcome, COMPLETION_RECORD_AGE, Completion, TransitionOutcome, Upgraded};
pub use delivery::{
    CONFLICTS, Collected, DeliveryRecord, DeliveryState, Prepared, Rework, Strategy,
    head_branch_name,
};
pub use dispatch::{DispatchRecord, MAX_TAIL_KEPT, RunRecord};
pub use git::{
    Applied, BranchHead, Change, MAX_DIFF_BYTES, MAX_PATH_LEN, MAX_TREE_BYTES, MAX_TREE_FILES,
    TaskChanges, TreeFile, branch_name,
};
pub use integrate::Integrated;
pub use lease_files::new_lease_id;
pub use lease_store::{LeaseStore, check_lease_rules};
pub use parents::{ParentStanding, SubtaskVerdicts, human_intervention_line};
pub use project::Project;
pub use replica::{Replica, replicated};

/// The largest file a replica is read back for (an artifact is capped lower by the
/// coordinator's `max_artifact_bytes`).
pub const MAX_REPLICATED_BYTES: u64 = 64 << 20;
pub use read::{ArtifactInfo, Unaddressable};
pub use records::{
    Approval, Lease, MAX_TOKEN, clamp_time, format_time, format_time_millis, parse_time,
};
pub use view::{
    ApprovalView, FolderReport, ListEntry, Listing, ProjectFolders, TaskError, TaskView,
};
pub use work::{InputFile, SUBTASK_FILES};

/// Broad classes of failure; the CLI maps them to exit codes, the coordinator to gRPC codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Well-formed request that policy refuses (illegal transition, held lease, …).
    Refused,
    /// Malformed input: a bad name, id or value.
    Invalid,
    NotFound,
    AlreadyExists,
    /// A state file that cannot be read as its format says.
    Corrupt,
    Io,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 6] = [
        ErrorKind::Refused,
        ErrorKind::Invalid,
        ErrorKind::NotFound,
        ErrorKind::AlreadyExists,
        ErrorKind::Corrupt,
        ErrorKind::Io,
    ];

    /// The name used in JSON errors and in the coordinator's `automaton-error-kind` metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Refused => "refused",
            ErrorKind::Invalid => "invalid",
            ErrorKind::NotFound => "notfound",
            ErrorKind::AlreadyExists => "alreadyexists",
            ErrorKind::Corrupt => "corrupt",
            ErrorKind::Io => "io",
        }
    }

    pub fn parse(name: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

/// Why a store operation failed. Every message is one line that says what is wrong and what
/// to do (004's multi-line messages keep their extra lines below the first).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "Task '{task}' not found in {tasks}/. Run --list to see the tasks, or --create-task {task} to create it."
    )]
    TaskNotFound { task: TaskName, tasks: String },
    #[error(
        "Parent task '{parent}' not found in {tasks}/. Create it first with --create-task {parent}."
    )]
    ParentNotFound { parent: TaskName, tasks: String },
    #[error(
        "Task '{task}' already exists in {tasks}/. Choose another name, or run --task {task} to see it."
    )]
    AlreadyExists { task: TaskName, tasks: String },
    #[error(
        "Task '{task}' is untracked (no .state file). Run --upgrade --task {task} to bootstrap .state from its artifacts, then retry."
    )]
    Untracked { task: TaskName },
    #[error("{source}. Fix {}: it must hold one phase name, e.g. 'research'.", path.display())]
    UnknownPhase { source: UnknownPhase, path: PathBuf },
    #[error("{0}")]
    Name(#[from] NameError),
    #[error("{0}")]
    Transition(#[from] TransitionError),
    #[error("{0}")]
    Approve(#[from] ApproveError),
    #[error(
        "Project folder not found: {}. Check --project (it defaults to the current directory), or create the folder first.",
        root.display()
    )]
    ProjectNotFound { root: PathBuf },
    #[error("Cannot read {}: {source}.", path.display())]
    Policy { source: PolicyError, path: PathBuf },
    #[error(
        "Claims need multi-agent mode: add 'Mode: multi-agent' to {}/.agent.md (or ~/.automaton/.agent.md), then retry.",
        project.display()
    )]
    NotMultiAgent { project: PathBuf },
    #[error(
        "Task '{task}' is leased to {holder} until {} (token {token}). Wait for the lease to expire or be released, then retry.",
        format_time(*expires)
    )]
    Leased {
        task: TaskName,
        holder: AgentId,
        expires: std::time::SystemTime,
        token: u64,
    },
    #[error(
        "Task '{task}' is leased to {holder} until {}: pass --agent {holder} (the holder) to change it, or wait for the lease to end.",
        format_time(*expires)
    )]
    HolderRequired {
        task: TaskName,
        holder: AgentId,
        expires: std::time::SystemTime,
    },
    #[error("Task '{task}' is leased to {holder}, not {agent}: only the holder can release it.")]
    NotHolder {
        task: TaskName,
        holder: AgentId,
        agent: AgentId,
    },
    #[error(
        "A lease of {ttl_ms} ms is outside the allowed {} to {}: ask for a TTL between them, or none for the project's lock timeout.",
        humantime::format_duration(*min),
        humantime::format_duration(*max)
    )]
    TtlOutOfBounds {
        ttl_ms: u64,
        min: std::time::Duration,
        max: std::time::Duration,
    },
    #[error("Task '{task}' has no live lease held by {agent}; there is nothing to release.")]
    NoLease { task: TaskName, agent: AgentId },
    #[error(
        "Fencing token {given} is stale for task '{task}' (the live lease has token {}): your lease was lost. Claim the task again.",
        current.map_or("none".to_string(), |t| t.to_string())
    )]
    StaleToken {
        task: TaskName,
        given: u64,
        current: Option<u64>,
    },
    #[error("Task '{task}' cannot be claimed in '{state}': {why}.")]
    NotClaimable {
        task: TaskName,
        state: State,
        why: &'static str,
    },
    #[error(
        "Agent '{agent}' implemented task '{task}' and may not {action} its {phase} (reviewer ≠ implementer). Let a different agent do it."
    )]
    Separation {
        task: TaskName,
        agent: String,
        phase: Phase,
        action: &'static str,
    },
    #[error(
        "'{agent}' holds the lease on task '{task}' and may not approve its own work. A person (an operator) must approve it."
    )]
    SelfApproval { task: TaskName, agent: String },
    #[error(
        "'{agent}' held task '{task}' in its {phase} phase and may not approve that phase's work. A person (an operator) or an agent that did not hold it must approve it."
    )]
    HeldPhase {
        task: TaskName,
        agent: String,
        phase: Phase,
    },
    #[error(
        "Corrupt lease file {}: {detail}. Fix it, or remove it if no agent holds the task.",
        path.display()
    )]
    CorruptLease { path: PathBuf, detail: String },
    #[error(
        "Corrupt approvals log {} line {line}: {detail}. Each line must be '{{phase}}:approved|{{ISO-8601}}|{{approver}}' with an optional '|{{sha256}}'.",
        path.display()
    )]
    CorruptApprovals {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    #[error("Corrupt implementer file {} line {line}: {detail}. It must list one agent id per line.", path.display())]
    CorruptImplementers {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    #[error("Corrupt holders file {} line {line}: {detail}. Each line must be '{{phase}}|{{agent}}'.", path.display())]
    CorruptHolders {
        path: PathBuf,
        line: usize,
        detail: String,
    },
    #[error(
        "Corrupt dispatch record {}: {detail}. Fix it, or remove it (the task's holds, counts and run history are then forgotten).",
        path.display()
    )]
    CorruptDispatch { path: PathBuf, detail: String },
    #[error("Corrupt fencing counter {}: it must hold one number. Restore it from the highest 'token:' in any .state.lock.", path.display())]
    CorruptFencing { path: PathBuf },
    #[error(
        "{} is a symbolic link, and nothing under a project's .automaton/ is read through one (task files, prompts, rules and contracts are served to agents). Replace the link with a copy of what it points to, or remove it, then retry.",
        path.display()
    )]
    Symlink { path: PathBuf },
    #[error("{} is not UTF-8 text. Rewrite it as UTF-8.", path.display())]
    NotUtf8 { path: PathBuf },
    #[error("'{name}' is not an artifact: a follow-up task copies artifacts only.")]
    NotAnArtifact { name: String },
    #[error("{} is larger than one assignment may carry ({limit} bytes in all): shorten it.", path.display())]
    InputTooLarge { path: PathBuf, limit: u64 },
    #[error(
        "{} is not a git repository: the project has no code to serve. Run 'git init' there and make a first commit.",
        root.display()
    )]
    NoRepository { root: PathBuf },
    #[error(
        "The git repository at {} has no commits (HEAD is unborn), so task branches have nothing to start from. Make a first commit, then retry.",
        root.display()
    )]
    NoCommits { root: PathBuf },
    #[error(
        "Task '{task}' has no branch '{branch}' yet. Serve the task's code first (task_branch creates it), then apply changes."
    )]
    NoBranch { task: TaskName, branch: String },
    #[error("Invalid commit id '{commit}': give the full hexadecimal id (40 characters).")]
    BadCommit { commit: String },
    #[error(
        "Commit {commit} not found in {}. Use a commit served for this task (its branch head).",
        root.display()
    )]
    CommitNotFound { commit: String, root: PathBuf },
    #[error(
        "Invalid path '{path}' in the changes: {why}. Send relative '/'-separated paths inside the project's code."
    )]
    BadPath { path: String, why: &'static str },
    #[error("Invalid {field} '{value}' for the commit: {why}.")]
    BadCommitText {
        field: &'static str,
        value: String,
        why: &'static str,
    },
    #[error(
        "Commit {commit} holds a path git2 cannot serve as text: '{path}' ({why}). Rename it in the repository, then retry."
    )]
    UnservablePath {
        commit: String,
        path: String,
        why: &'static str,
    },
    #[error(
        "Commit {commit}'s tree is too large to serve: more than {limit}. Keep large files and generated trees out of the repository (or in .automaton/), then retry."
    )]
    TreeTooLarge { commit: String, limit: String },
    #[error(
        "Task '{task}': the changes touch {} that changed on the task branch since their base commit. Fetch the branch head again and redo the change there.",
        git::list_paths(paths)
    )]
    PatchConflict { task: TaskName, paths: Vec<String> },
    #[error(
        "Sub-task '{task}' cannot be merged into its parent's branch: both changed {}. Nothing was merged; redo the sub-task on the parent's branch as it is now.",
        git::list_paths(paths)
    )]
    MergeConflict { task: TaskName, paths: Vec<String> },
    #[error("Task '{task}' is not a sub-task: only a sub-task merges into a parent's branch.")]
    NotASubtask { task: TaskName },
    /// An approval of a revision that is not the task branch's head.
    #[error(
        "{task}'s branch is at {head}, not {revision}: read what is there and approve it with --revision {}, or let the review run again on it",
        head.get(..12).unwrap_or(head)
    )]
    RevisionMoved {
        task: TaskName,
        revision: String,
        head: String,
    },
    #[error("--revision '{revision}' for {task}: {why}")]
    BadRevision {
        task: TaskName,
        revision: String,
        why: &'static str,
    },
    #[error(
        "Branch '{base}' moved while {task} was delivered ({moved}). Nothing was overwritten; the delivery builds the merge again on the new head."
    )]
    BaseMoved {
        task: TaskName,
        base: String,
        moved: String,
    },
    #[error(
        "Cannot deliver {task} into '{base}', the branch checked out in the project: {why}. Commit or stash the changes there; the delivery retries on its own."
    )]
    CheckoutBusy {
        task: TaskName,
        base: String,
        why: String,
    },
    #[error(
        "Branch '{base}' does not exist in {where_}. Name an existing branch with [delivery] base, or create it, then `automaton deliver {task}`."
    )]
    NoBase {
        task: TaskName,
        base: String,
        where_: String,
    },
    #[error(
        "Corrupt delivery record {}: {detail}. Remove it to request the delivery again (nothing merged is undone).",
        path.display()
    )]
    CorruptDelivery { path: PathBuf, detail: String },
    #[error(
        "Task '{task}': branch '{branch}' kept moving while the changes were applied (tried twice). Retry the apply."
    )]
    BranchRace { task: TaskName, branch: String },
    #[error("Cannot {action} in the git repository at {}: {source}. Check the repository (git fsck) and its permissions.", root.display())]
    Git {
        action: &'static str,
        root: PathBuf,
        source: git2::Error,
    },
    #[error("Cannot {action} {}: {source}. Check the path and its permissions.", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "Cannot {action} the shared git remote {remote}: {why}. If another coordinator leads now, this one no longer writes the task branches; otherwise check the remote and retry."
    )]
    SharedRemote {
        action: &'static str,
        remote: String,
        why: String,
    },
    #[error("Cannot store {} in the replica: {detail}. Nothing was written; retry (against the leader, if it changed).", path.display())]
    Replica { path: PathBuf, detail: String },
}

impl Error {
    /// A lease rule's refusal for `task`; `expires` is the live lease's end, for people.
    pub fn from_refusal(
        task: &TaskName,
        refusal: automaton_workflow::lease::Refusal,
        expires: std::time::SystemTime,
    ) -> Error {
        use automaton_workflow::lease::Refusal;
        match refusal {
            Refusal::Stale { given, current } => Error::StaleToken {
                task: task.clone(),
                given,
                current,
            },
            Refusal::HolderRequired { holder } => Error::HolderRequired {
                task: task.clone(),
                holder,
                expires,
            },
            Refusal::NotHolder { holder, agent } => Error::NotHolder {
                task: task.clone(),
                holder,
                agent,
            },
            Refusal::TtlOutOfBounds { ttl_ms, min, max } => {
                Error::TtlOutOfBounds { ttl_ms, min, max }
            }
        }
    }

    pub fn kind(&self) -> ErrorKind {
        use Error::*;
        match self {
            TaskNotFound { .. }
            | ParentNotFound { .. }
            | ProjectNotFound { .. }
            | NoRepository { .. }
            | NoBranch { .. }
            | NoBase { .. }
            | CommitNotFound { .. } => ErrorKind::NotFound,
            AlreadyExists { .. } => ErrorKind::AlreadyExists,
            Name(_)
            | TtlOutOfBounds { .. }
            | BadCommit { .. }
            | BadRevision { .. }
            | BadPath { .. }
            | BadCommitText { .. }
            | UnservablePath { .. }
            | NotAnArtifact { .. } => ErrorKind::Invalid,
            UnknownPhase { .. }
            | Policy { .. }
            | CorruptLease { .. }
            | CorruptApprovals { .. }
            | CorruptImplementers { .. }
            | CorruptHolders { .. }
            | CorruptFencing { .. }
            | CorruptDispatch { .. }
            | CorruptDelivery { .. }
            | NotUtf8 { .. } => ErrorKind::Corrupt,
            Io { .. } | Git { .. } | Replica { .. } | SharedRemote { .. } => ErrorKind::Io,
            Untracked { .. }
            | Transition(_)
            | Approve(_)
            | NotMultiAgent { .. }
            | Leased { .. }
            | HolderRequired { .. }
            | NotHolder { .. }
            | NoLease { .. }
            | StaleToken { .. }
            | NotClaimable { .. }
            | Separation { .. }
            | SelfApproval { .. }
            | HeldPhase { .. }
            | InputTooLarge { .. }
            | Symlink { .. }
            | NoCommits { .. }
            | TreeTooLarge { .. }
            | PatchConflict { .. }
            | MergeConflict { .. }
            | NotASubtask { .. }
            | BaseMoved { .. }
            | RevisionMoved { .. }
            | CheckoutBusy { .. }
            | BranchRace { .. } => ErrorKind::Refused,
        }
    }
}
