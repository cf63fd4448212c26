//! Where a status command is carried out: on the files directly (no coordinator), or by the
//! coordinator that owns the project. Both hand back the store's types, so the output is
//! rendered by one code path and is identical either way.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use automaton_proto::v1 as pb;
use automaton_store::{
    Approval, ApproveOutcome, AuditReport, Error, ErrorKind, FolderReport, Lease, ListEntry,
    Project, ProjectFolders, TaskView, TransitionOutcome,
};
use automaton_workflow::{AgentId, State, TaskName};
use tonic::transport::Channel;

use crate::from_wire::{self, lease as lease_from_pb, state};

/// A failure, with the exit code it ends the command with.
pub enum Failure {
    Store(Error),
    Usage(String),
    /// A well-formed request refused by the command line itself (exit 1).
    Refused(String),
    /// A refusal or error reported by the coordinator: its message and error kind.
    Remote {
        message: String,
        kind: String,
    },
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Store(e)
    }
}

impl From<tonic::Status> for Failure {
    fn from(s: tonic::Status) -> Self {
        let kind = s
            .metadata()
            .get("automaton-error-kind")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
            // Not from a coordinator's handler (a proxy, the transport, authentication).
            .unwrap_or_else(|| {
                match s.code() {
                    tonic::Code::FailedPrecondition
                    | tonic::Code::PermissionDenied
                    | tonic::Code::AlreadyExists => ErrorKind::Refused,
                    tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted => {
                        ErrorKind::Invalid
                    }
                    tonic::Code::NotFound => ErrorKind::NotFound,
                    _ => ErrorKind::Io,
                }
                .as_str()
                .to_string()
            });
        let message = match s.code() {
            tonic::Code::Unavailable => format!(
                "the coordinator is unavailable ({}): start it, or pass --coordinator URL",
                s.message()
            ),
            _ => s.message().to_string(),
        };
        Failure::Remote { message, kind }
    }
}

/// What a coordinator adds to `status --task`: the task's last runs, why it is held, and in
/// manual mode the command that moves it on (all empty on the files).
#[derive(Debug, Default)]
pub struct Dispatch {
    pub runs: Vec<pb::Run>,
    pub held: String,
    pub next_command: String,
    /// A top-level task's delivery at `complete`.
    pub delivery: Option<pb::Delivery>,
}

pub enum Backend {
    Local(Project),
    Remote(Box<Remote>),
}

/// A coordinator and what it takes to call it from this synchronous command.
pub struct Remote {
    project: Project,
    address: String,
    runtime: tokio::runtime::Runtime,
    channel: Channel,
    stamp: Stamp,
}

/// How long a call may take unless `AUTOMATON_CALL_TIMEOUT` says otherwise.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What every call carries: `AUTOMATON_TOKEN` as `authorization: Bearer …`, and the call's
/// deadline as `grpc-timeout`, so a coordinator that cannot answer in time says so itself.
#[derive(Clone)]
struct Stamp {
    bearer: Option<tonic::metadata::AsciiMetadataValue>,
    deadline: Duration,
}

impl tonic::service::Interceptor for Stamp {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.bearer {
            req.metadata_mut().insert("authorization", v.clone());
        }
        req.set_timeout(self.deadline);
        Ok(req)
    }
}

type Intercepted = tonic::service::interceptor::InterceptedService<Channel, Stamp>;

impl Remote {
    fn tasks(&self) -> pb::tasks_client::TasksClient<Intercepted> {
        pb::tasks_client::TasksClient::with_interceptor(self.channel.clone(), self.stamp.clone())
    }

    fn leases(&self) -> pb::leases_client::LeasesClient<Intercepted> {
        pb::leases_client::LeasesClient::with_interceptor(self.channel.clone(), self.stamp.clone())
    }

    fn workers(&self) -> pb::workers_client::WorkersClient<Intercepted> {
        pb::workers_client::WorkersClient::with_interceptor(
            self.channel.clone(),
            self.stamp.clone(),
        )
    }

    /// Runs one call to completion. A coordinator that cannot finish the call by its deadline
    /// answers so itself; one that never answers (hung, or the connection dead) is given up
    /// on at the deadline, with the same advice.
    fn run<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, Failure> {
        match self.runtime.block_on(call) {
            Ok(answer) => Ok(answer.into_inner()),
            // tonic's own deadline, from the `grpc-timeout` the stamp sets.
            Err(s)
                if s.code() == tonic::Code::Cancelled
                    && s.message() == tonic::TimeoutExpired(()).to_string() =>
            {
                Err(Failure::Remote {
                    message: format!(
                        "no answer from the coordinator at {} within {}s: it is overloaded, \
                         stuck, or unreachable (see its log); retry, and check whether the change \
                         was made before repeating it (AUTOMATON_CALL_TIMEOUT sets the limit)",
                        self.address,
                        self.stamp.deadline.as_secs()
                    ),
                    kind: ErrorKind::Io.as_str().to_string(),
                })
            }
            Err(s) => Err(s.into()),
        }
    }
}

/// The coordinator to talk to: `--coordinator URL`, else `AUTOMATON_COORDINATOR`, else the
/// address in `.automaton/coordinator.lock` while a live coordinator holds that lock. An
/// empty URL is refused: it used to mean "work on the files", which would write behind the
/// back of a coordinator that owns the project.
pub fn find_coordinator(project: &Project, flag: Option<&str>) -> Result<Option<String>, Failure> {
    let (source, url) = match flag {
        Some(url) => ("--coordinator", Some(url.to_string())),
        None => (
            "AUTOMATON_COORDINATOR",
            std::env::var_os("AUTOMATON_COORDINATOR").map(|v| v.to_string_lossy().into_owned()),
        ),
    };
    match url {
        Some(url) if url.trim().is_empty() => Err(Failure::Usage(format!(
            "{source} is empty. Give a coordinator URL (e.g. http://127.0.0.1:7070), or leave it unset to use the coordinator that owns the project (or the files when none does)."
        ))),
        Some(url) => Ok(Some(url)),
        None => Ok(owner_of(project)),
    }
}

/// The address in `.automaton/coordinator.lock`, while a live coordinator holds that lock.
fn owner_of(project: &Project) -> Option<String> {
    let path = project.meta().join("coordinator.lock");
    let file = std::fs::File::open(&path).ok()?;
    // A lock we can take is a lock nobody holds: the coordinator that wrote the file is gone.
    if fs4::FileExt::try_lock_shared(&file).is_ok() {
        return None;
    }
    std::fs::read_to_string(&path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("address: ").map(|a| a.trim().to_string()))
}

/// A length of time as the wire carries it (saturating at the largest it can hold).
fn pb_duration(d: Duration) -> automaton_proto::prost_types::Duration {
    automaton_proto::prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: d.subsec_nanos() as i32,
    }
}

/// An endpoint for one coordinator URL, or a usage error that says how to write one.
pub(crate) fn endpoint_of(address: &str) -> Result<tonic::transport::Endpoint, Failure> {
    Channel::from_shared(address.to_string()).map_err(|_| {
        Failure::Usage(format!(
            "invalid coordinator address '{address}': write e.g. http://127.0.0.1:7070 (several, comma-separated, for coordinators on etcd)"
        ))
    })
}

/// The coordinator to send calls to: `address` itself, or — when it lists several
/// (`a,b,c`: coordinators sharing a project on etcd) — the one that leads now, waiting out
/// an election (`AUTOMATON_LEADER_WAIT`, default 30s).
pub(crate) async fn leader_of(address: &str) -> Result<String, Failure> {
    let urls = automaton_client::split(address);
    for u in &urls {
        endpoint_of(u)?;
    }
    let wait = match std::env::var("AUTOMATON_LEADER_WAIT") {
        Ok(v) if !v.is_empty() => automaton_workflow::parse_duration(&v).ok_or_else(|| {
            Failure::Usage(format!(
                "invalid AUTOMATON_LEADER_WAIT '{v}': write a number with a unit, e.g. '30s'"
            ))
        })?,
        _ => automaton_client::DEFAULT_WAIT,
    };
    automaton_client::find_leader(&urls, wait, |u| {
        Channel::from_shared(u.to_string())
            .map(|e| e.connect_timeout(Duration::from_secs(2)))
            .map_err(|e| format!("invalid coordinator address '{u}': {e}"))
    })
    .await
    .map_err(|why| Failure::Remote {
        message: why,
        kind: ErrorKind::Io.as_str().to_string(),
    })
}

impl Backend {
    /// Talks to `address` (lazily: the first call connects); with several addresses, to
    /// the one that leads.
    pub fn remote(project: Project, address: String) -> Result<Backend, Failure> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Failure::Usage(format!("cannot start the async runtime: {e}")))?;
        let address = if address.contains(',') {
            runtime.block_on(leader_of(&address))?
        } else {
            address
        };
        let endpoint = Channel::from_shared(address.clone())
            .map_err(|_| {
                Failure::Usage(format!(
                    "invalid coordinator address '{address}': write e.g. http://127.0.0.1:7070"
                ))
            })?
            .connect_timeout(Duration::from_secs(5));
        let deadline = match std::env::var("AUTOMATON_CALL_TIMEOUT") {
            Ok(v) if !v.is_empty() => automaton_workflow::parse_duration(&v).ok_or_else(|| {
                Failure::Usage(format!(
                    "invalid AUTOMATON_CALL_TIMEOUT '{v}': write a number with a unit, e.g. '30s' or '2m'"
                ))
            })?,
            _ => CALL_TIMEOUT,
        };
        let channel = {
            let _guard = runtime.enter();
            endpoint.connect_lazy()
        };
        let bearer = match std::env::var("AUTOMATON_TOKEN") {
            Ok(t) if !t.is_empty() => Some(format!("Bearer {t}").parse().map_err(|_| {
                Failure::Usage("AUTOMATON_TOKEN holds characters a header cannot carry".into())
            })?),
            _ => None,
        };
        Ok(Backend::Remote(Box::new(Remote {
            project,
            address,
            runtime,
            channel,
            stamp: Stamp { bearer, deadline },
        })))
    }

    /// The coordinator, for the commands that exist only with one (the fleet's).
    fn remote_only(&self, what: &str) -> Result<&Remote, Failure> {
        match self {
            Backend::Remote(r) => Ok(r),
            Backend::Local(_) => Err(Failure::Usage(format!(
                "{what} needs a running coordinator: start automaton-coordinator, or pass --coordinator URL (or AUTOMATON_COORDINATOR)"
            ))),
        }
    }

    pub fn list_workers(&self) -> Result<Vec<pb::WorkerInfo>, Failure> {
        let r = self.remote_only("automaton workers")?;
        Ok(r.run(r.workers().list_workers(pb::ListWorkersRequest {}))?
            .workers)
    }

    pub fn drain_worker(&self, name: &str, undo: bool) -> Result<pb::WorkerInfo, Failure> {
        let r = self.remote_only("automaton workers drain")?;
        r.run(r.workers().drain_worker(pb::DrainWorkerRequest {
            name: name.to_string(),
            undo,
        }))
    }

    pub fn coordinator(&self) -> Option<&str> {
        match self {
            Backend::Local(_) => None,
            Backend::Remote(r) => Some(&r.address),
        }
    }

    pub fn create_task(&self, task: &TaskName) -> Result<PathBuf, Failure> {
        match self {
            Backend::Local(p) => Ok(p.create_task(task)?),
            Backend::Remote(r) => {
                let req = pb::CreateTaskRequest {
                    task: task.to_string(),
                };
                r.run(r.tasks().create_task(req))?;
                Ok(r.project.task_dir(task))
            }
        }
    }

    /// The task's view, with its last agent runs and why it is held from dispatch (only a
    /// coordinator knows those: none on the files).
    pub fn view_with_runs(&self, task: &TaskName) -> Result<(TaskView, Dispatch), Failure> {
        match self {
            Backend::Local(p) => Ok((p.view(task, SystemTime::now())?, Dispatch::default())),
            Backend::Remote(r) => {
                let req = pb::GetTaskRequest {
                    task: task.to_string(),
                    with_contents: false,
                    with_changes: false,
                };
                let d = r.run(r.tasks().get_task(req))?;
                let (held, next_command, delivery) = d
                    .summary
                    .as_ref()
                    .map(|s| (s.held.clone(), s.next_command.clone(), s.delivery.clone()))
                    .unwrap_or_default();
                let view = from_wire::view(&d)?;
                Ok((
                    view,
                    Dispatch {
                        runs: d.runs,
                        held,
                        next_command,
                        delivery,
                    },
                ))
            }
        }
    }

    /// Every task as the coordinator sees it (with waiting reasons, waves, estimates); on the
    /// files, the listing alone.
    pub fn task_summaries(&self) -> Result<Vec<pb::TaskSummary>, Failure> {
        match self {
            Backend::Remote(r) => Ok(r.run(r.tasks().list_tasks(pb::ListTasksRequest {}))?.tasks),
            Backend::Local(p) => {
                fn row(e: &ListEntry) -> pb::TaskSummary {
                    pb::TaskSummary {
                        task: e.task.to_string(),
                        state: e.state.map(|s| s.to_string()).unwrap_or_default(),
                        tracked: e.tracked,
                        lease_holder: e
                            .lease_holder
                            .as_ref()
                            .map(|a| a.to_string())
                            .unwrap_or_default(),
                        subtasks: e.subtasks.iter().map(row).collect(),
                        verdicts: e.verdicts.as_ref().map(|v| pb::SubtaskVerdicts {
                            pass: v.pass,
                            fail: v.fail,
                            needs_review: v.needs_review,
                            no_verdict: v.no_verdict,
                            not_terminal: v.not_terminal.clone(),
                            summary: v.summary.clone(),
                        }),
                        attention: e.attention.clone().unwrap_or_default(),
                        ..Default::default()
                    }
                }
                Ok(p.list(SystemTime::now())?.iter().map(row).collect())
            }
        }
    }

    pub fn stop_run(&self, task: &TaskName, resume: bool) -> Result<pb::StopRunResponse, Failure> {
        let r = self.remote_only("automaton stop")?;
        r.run(r.workers().stop_run(pb::StopRunRequest {
            task: task.to_string(),
            resume,
        }))
    }

    pub fn deliver(&self, task: &TaskName) -> Result<pb::Delivery, Failure> {
        let r = self.remote_only("automaton deliver")?;
        r.run(r.workers().deliver(pb::DeliverRequest {
            task: task.to_string(),
        }))
    }

    pub fn abandon(&self, task: &TaskName, reason: &str) -> Result<pb::Delivery, Failure> {
        let r = self.remote_only("automaton abandon")?;
        r.run(r.workers().abandon(pb::AbandonRequest {
            task: task.to_string(),
            reason: reason.to_string(),
        }))
    }

    /// `automaton gc --branches`: through the coordinator that owns the project, or on the
    /// files when none runs.
    pub fn collect_branches(&self, dry_run: bool) -> Result<Vec<pb::CollectedBranch>, Failure> {
        match self {
            Backend::Remote(r) => Ok(r
                .run(
                    r.workers()
                        .collect_branches(pb::CollectBranchesRequest { dry_run }),
                )?
                .branches),
            Backend::Local(p) => Ok(p
                .collect_branches(dry_run)?
                .into_iter()
                .map(|c| pb::CollectedBranch {
                    task: c.task.to_string(),
                    branch: c.branch,
                    removed: c.removed,
                    why: c.why,
                })
                .collect()),
        }
    }

    pub fn run_task(&self, task: &TaskName) -> Result<pb::RunTaskResponse, Failure> {
        let r = self.remote_only("automaton run")?;
        r.run(r.workers().run_task(pb::RunTaskRequest {
            task: task.to_string(),
        }))
    }

    pub fn list(&self) -> Result<Vec<ListEntry>, Failure> {
        match self {
            Backend::Local(p) => Ok(p.list(SystemTime::now())?),
            Backend::Remote(r) => r
                .run(r.tasks().list_tasks(pb::ListTasksRequest {}))?
                .tasks
                .iter()
                .map(from_wire::list_entry)
                .collect(),
        }
    }

    pub fn transition(
        &self,
        task: &TaskName,
        target: State,
        agent: Option<&AgentId>,
        lease_id: Option<&str>,
        fencing: Option<u64>,
    ) -> Result<TransitionOutcome, Failure> {
        match self {
            Backend::Local(p) => {
                Ok(p.transition(task, target, agent, fencing, SystemTime::now())?)
            }
            Backend::Remote(r) => {
                let req = pb::TransitionRequest {
                    task: task.to_string(),
                    target: target.to_string(),
                    agent: agent.map(|a| a.to_string()).unwrap_or_default(),
                    lease_id: lease_id.unwrap_or_default().to_string(),
                    token: fencing.unwrap_or(0),
                };
                let out = r.run(r.tasks().transition(req))?;
                Ok(TransitionOutcome {
                    task: task.clone(),
                    from: state(&out.from)?,
                    to: state(&out.to)?,
                    released: out.released.as_ref().map(lease_from_pb).transpose()?,
                })
            }
        }
    }

    pub fn approve(
        &self,
        task: &TaskName,
        approver: &str,
        revision: Option<&str>,
    ) -> Result<ApproveOutcome, Failure> {
        match self {
            Backend::Local(p) => Ok(p.approve(task, approver, revision, SystemTime::now())?),
            Backend::Remote(r) => {
                let req = pb::ApproveRequest {
                    task: task.to_string(),
                    approver: approver.to_string(),
                    revision: revision.unwrap_or_default().to_string(),
                };
                let out = r.run(r.tasks().approve(req))?;
                let from = state(&out.from)?;
                Ok(ApproveOutcome {
                    task: task.clone(),
                    from,
                    to: state(&out.to)?,
                    approval: Approval {
                        phase: from.phase,
                        at: from_wire::time(out.approved_at.as_ref())
                            .unwrap_or_else(SystemTime::now),
                        approver: out.approver,
                        sha256: (!out.sha256.is_empty()).then_some(out.sha256),
                        commit: (!out.commit.is_empty()).then_some(out.commit),
                    },
                })
            }
        }
    }

    pub fn validate_folder(&self, task: &TaskName) -> Result<FolderReport, Failure> {
        match self {
            Backend::Local(p) => Ok(p.validate_folder(task)?),
            Backend::Remote(r) => {
                let req = pb::ValidateFolderRequest {
                    task: task.to_string(),
                };
                match r.run(r.tasks().validate_folder(req))?.reports.first() {
                    Some(report) => from_wire::folder_report(report),
                    None => Err(Failure::Usage(format!(
                        "the coordinator sent no report for '{task}': use an automaton built from the same proto as the coordinator"
                    ))),
                }
            }
        }
    }

    /// `--validate-folder` without `--task`: every task (an empty task in the request).
    pub fn validate_all(&self) -> Result<ProjectFolders, Failure> {
        match self {
            Backend::Local(p) => Ok(p.validate_all()?),
            Backend::Remote(r) => {
                let req = pb::ValidateFolderRequest {
                    task: String::new(),
                };
                from_wire::project_folders(&r.run(r.tasks().validate_folder(req))?)
            }
        }
    }

    pub fn audit(&self) -> Result<AuditReport, Failure> {
        match self {
            Backend::Local(p) => Ok(p.audit()?),
            Backend::Remote(r) => from_wire::audit(&r.run(r.tasks().audit(pb::AuditRequest {}))?),
        }
    }

    pub fn claim(
        &self,
        task: &TaskName,
        agent: &AgentId,
        ttl: Option<Duration>,
    ) -> Result<(Lease, bool), Failure> {
        match self {
            Backend::Local(p) => Ok(p.claim(task, agent, ttl, SystemTime::now())?),
            Backend::Remote(r) => {
                let req = pb::ClaimRequest {
                    task: task.to_string(),
                    agent: agent.to_string(),
                    ttl: ttl.map(pb_duration),
                    ..Default::default()
                };
                let out = r.run(r.leases().claim(req))?;
                Ok((lease_from_pb(&out)?, out.renewed))
            }
        }
    }

    /// Releases `agent`'s lease on `task`. The coordinator releases by lease id, so the CLI
    /// looks the live lease up first and refuses exactly as the local mode does.
    pub fn release(&self, task: &TaskName, agent: &AgentId) -> Result<Lease, Failure> {
        match self {
            Backend::Local(p) => Ok(p.release(task, agent, SystemTime::now())?),
            Backend::Remote(r) => {
                let req = pb::GetTaskRequest {
                    task: task.to_string(),
                    with_contents: false,
                    with_changes: false,
                };
                let live = match r.run(r.tasks().get_task(req))?.lease {
                    Some(l) if l.agent == agent.as_str() => l,
                    Some(l) => {
                        return Err(Error::NotHolder {
                            task: task.clone(),
                            holder: l.agent.parse().map_err(|_| {
                                Failure::Usage("the coordinator sent an unreadable holder".into())
                            })?,
                            agent: agent.clone(),
                        }
                        .into());
                    }
                    None => {
                        return Err(Error::NoLease {
                            task: task.clone(),
                            agent: agent.clone(),
                        }
                        .into());
                    }
                };
                let req = pb::ReleaseRequest {
                    lease_id: live.lease_id.clone(),
                    token: live.token,
                    agent: agent.to_string(),
                };
                r.run(r.leases().release(req))?;
                lease_from_pb(&live)
            }
        }
    }
}
