//! The gRPC services: proto in, `Coordinator` operations, proto out.

use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use automaton_engine::{Live, Presented};
use automaton_proto::v1 as pb;
use automaton_workflow::{AgentId, EventKind, State, TaskName};
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::Error;
use crate::IntoStatus;
use crate::auth::{Caller, caller};
use crate::config::Role;
use crate::state::Coordinator;
use crate::wire::{agent_id, bound_agent, duration_arg, lease_pb, operator, task_name, timestamp};

type Res<T> = Result<Response<T>, Status>;

#[derive(Clone)]
pub struct Service {
    pub(crate) coord: Arc<Coordinator>,
    pub(crate) shutdown: watch::Receiver<bool>,
    /// Live agent output (`output.rs`): the edge's, not the engine's: nothing durable.
    pub(crate) outputs: Arc<crate::output::Outputs>,
}

fn state_str(s: Option<State>) -> String {
    s.map(|s| s.to_string()).unwrap_or_default()
}

fn unaddressable(u: &automaton_store::Unaddressable) -> pb::Unaddressable {
    pb::Unaddressable {
        folder: u.folder.clone(),
        path: u.path.display().to_string(),
        why: u.why.clone(),
        rename_to: u.rename_to.clone().unwrap_or_default(),
    }
}

fn folder_report(r: &automaton_store::FolderReport) -> pb::FolderReport {
    pb::FolderReport {
        task: r.task.to_string(),
        state: state_str(r.state),
        tracked: r.tracked,
        out_of_order: r.out_of_order.iter().map(|a| a.to_string()).collect(),
    }
}

fn audit_pb(r: &automaton_store::AuditReport) -> pb::AuditResponse {
    use automaton_store::Category3;
    let code_edits = match &r.category3 {
        Category3::Skipped { reason } => pb::code_edits::Result::Skipped(reason.clone()),
        Category3::Checked {
            checked,
            modifications,
        } => pb::code_edits::Result::Checked(pb::CodeEditsChecked {
            checked: checked.iter().map(|t| t.to_string()).collect(),
            modifications: modifications
                .iter()
                .map(|m| pb::Modification {
                    task: m.task.to_string(),
                    state: m.state.to_string(),
                    path: m.path.clone(),
                    commit: m.commit.clone(),
                    commit_time: automaton_store::parse_time(&m.commit_time).map(timestamp),
                    attributed: m.attributed,
                })
                .collect(),
        }),
    };
    pb::AuditResponse {
        exit_code: r.exit_code(),
        project: r.project.display().to_string(),
        tasks: r
            .tasks
            .iter()
            .map(|t| pb::AuditTask {
                task: t.task.to_string(),
                state: state_str(t.state),
                tracked: t.tracked,
                present: t.present.iter().map(|a| a.to_string()).collect(),
                out_of_order: t.out_of_order.iter().map(|a| a.to_string()).collect(),
                consistency: t
                    .consistency
                    .iter()
                    .map(|f| pb::Finding {
                        severity: match f.severity {
                            automaton_workflow::Severity::Warn => "warn",
                            automaton_workflow::Severity::Fail => "fail",
                        }
                        .into(),
                        message: f.message.clone(),
                        suggestion: state_str(f.suggestion),
                    })
                    .collect(),
                error: t.error.clone().unwrap_or_default(),
            })
            .collect(),
        code_edits: Some(pb::CodeEdits {
            result: Some(code_edits),
        }),
        violations: r.violations.clone(),
        errors: r.errors.clone(),
        unaddressable: r.unaddressable.iter().map(unaddressable).collect(),
    }
}

fn approval_pb(a: &automaton_store::ApprovalView) -> pb::ApprovalStatus {
    use automaton_store::ApprovalView;
    match a {
        ApprovalView::Required { artifact } => pb::ApprovalStatus {
            status: "required".into(),
            artifact: artifact.to_string(),
            ..Default::default()
        },
        ApprovalView::Awaiting { artifact } => pb::ApprovalStatus {
            status: "awaiting".into(),
            artifact: artifact.to_string(),
            ..Default::default()
        },
        ApprovalView::Approved {
            artifact,
            record,
            stale,
        } => pb::ApprovalStatus {
            status: "approved".into(),
            artifact: artifact.to_string(),
            record: record.as_ref().map(|r| pb::ApprovalRecord {
                phase: r.phase.to_string(),
                approved_at: Some(timestamp(r.at)),
                approver: r.approver.clone(),
                sha256: r.sha256.clone().unwrap_or_default(),
                commit: r.commit.clone().unwrap_or_default(),
            }),
            stale: *stale,
        },
    }
}

/// The most of one artifact `GetTask` sends with `with_contents`.
/// The most of a task's diff GetTask sends.
const CHANGES_SHOWN: usize = 1 << 20;
const ARTIFACT_SHOWN: usize = 256 * 1024;

/// At most `max` bytes of `bytes` as text: cut before a character that does not fit whole,
/// invalid UTF-8 replaced.
fn text_prefix(bytes: &[u8], max: usize) -> String {
    let mut end = bytes.len().min(max);
    if end < bytes.len() {
        // Back off over continuation bytes to the start of the cut character.
        while end > 0 && end > bytes.len().min(max).saturating_sub(3) && bytes[end] & 0xC0 == 0x80 {
            end -= 1;
        }
    }
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// The agent a caller acts as. An agent or worker token is bound to its name: the request's
/// agent must be empty or that name. An operator names any agent.
fn acting_agent(who: &Caller, requested: &str) -> Result<AgentId, Status> {
    match who.role {
        Role::Agent | Role::Worker if requested.is_empty() || requested == who.name => {
            agent_id(&who.name)
        }
        Role::Agent | Role::Worker => Err(Error::PermissionDenied(format!(
            "'{}' holds {} token and may act only as itself, not as '{}': leave agent empty or send '{}'",
            who.name,
            if who.role == Role::Worker {
                "a worker"
            } else {
                "an agent"
            },
            automaton_workflow::excerpt(requested),
            who.name
        ))
        .into_status()),
        Role::Operator if requested.is_empty() => Err(Error::Invalid(
            "no agent named: send the agent that acts (an operator may act for any agent)".into(),
        )
        .into_status()),
        Role::Operator => agent_id(requested),
    }
}

/// The agent a change (transition, release) is made as: an agent token's own; for an
/// operator, the agent named, if any (an operator may act without naming one).
fn agent_of_change(who: &Caller, requested: &str) -> Result<Option<AgentId>, Status> {
    match who.role {
        Role::Agent | Role::Worker => acting_agent(who, requested).map(Some),
        Role::Operator => (!requested.is_empty())
            .then(|| agent_id(requested))
            .transpose(),
    }
}

/// Whether `who` may see the lease id and token of `l`: its holder and operators.
fn may_see_secrets(who: &Caller, l: &Live) -> bool {
    who.role == Role::Operator || l.agent.as_str() == who.name
}

/// Longest lease id a request may name (ours are far shorter).
const MAX_LEASE_ID: usize = 256;

fn lease_id_arg(id: &str) -> Result<&str, Status> {
    if id.len() > MAX_LEASE_ID {
        return Err(Error::Invalid(format!(
            "lease id '{}' is longer than {MAX_LEASE_ID} bytes: send the lease_id a Claim returned",
            automaton_workflow::excerpt(id)
        ))
        .into_status());
    }
    Ok(id)
}

fn summary(e: &automaton_store::ListEntry) -> pb::TaskSummary {
    pb::TaskSummary {
        waiting: String::new(),
        held: String::new(),
        wave: 0,
        estimated_tokens: 0,
        task: e.task.to_string(),
        state: state_str(e.state),
        tracked: e.tracked,
        next: e.next.iter().map(State::to_string).collect(),
        approval_stale: e.approval_stale,
        approval_missing: e.approval_missing,
        error: e.error.clone().unwrap_or_default(),
        lease_holder: e
            .lease_holder
            .as_ref()
            .map(|a| a.to_string())
            .unwrap_or_default(),
        subtasks: e.subtasks.iter().map(summary).collect(),
        verdicts: e.verdicts.as_ref().map(verdicts_pb),
        attention: e.attention.clone().unwrap_or_default(),
        next_command: String::new(),
        last_failure: String::new(),
        delivery: None,
    }
}

fn verdicts_pb(v: &automaton_store::SubtaskVerdicts) -> pb::SubtaskVerdicts {
    pb::SubtaskVerdicts {
        pass: v.pass,
        fail: v.fail,
        needs_review: v.needs_review,
        no_verdict: v.no_verdict,
        not_terminal: v.not_terminal.clone(),
        summary: v.summary.clone(),
    }
}

impl Service {
    /// What dispatch knows of a task's row: why it waits or is held, its wave, whether a
    /// person is needed, and in manual mode the command that moves it on.
    fn annotate(&self, s: &mut pb::TaskSummary) {
        let Ok(t) = s.task.parse::<TaskName>() else {
            return;
        };
        let work = &self.coord.work;
        s.waiting = work.waiting(&t).unwrap_or_default();
        s.held = work.held(&t).unwrap_or_default();
        if !s.held.is_empty() {
            s.last_failure = work.last_failure(&t).unwrap_or_default();
        }
        if s.delivery.is_none() {
            let known = work.inner().deliveries.get(&t).cloned().flatten();
            if let Some(r) = known {
                s.delivery = Some(self.coord.delivery_shown(&t, &r));
            }
        }
        if let Some((w, e)) = work.wave_of(&t) {
            s.wave = w as u32;
            s.estimated_tokens = e;
        }
        if s.attention.is_empty() {
            s.attention = work.attention(&t).unwrap_or_default();
        }
        if !self.coord.engine.policy().autopilot
            && let Ok(state) = s.state.parse::<State>()
        {
            let running = !s.lease_holder.is_empty() || work.requested(&t);
            s.next_command = crate::dispatch::next_command(&t, state, !s.held.is_empty(), running);
        }
    }
}

#[tonic::async_trait]
impl pb::tasks_server::Tasks for Service {
    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task))]
    async fn create_task(&self, req: Request<pb::CreateTaskRequest>) -> Res<pb::TaskSummary> {
        operator(&req, "CreateTask")?;
        let task = task_name(&req.get_ref().task)?;
        self.coord
            .engine
            .create_task(&task)
            .await
            .map_err(crate::status)?;
        Ok(Response::new(pb::TaskSummary {
            task: task.to_string(),
            state: "new".into(),
            tracked: true,
            next: vec!["research".into()],
            ..Default::default()
        }))
    }

    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task))]
    async fn get_task(&self, req: Request<pb::GetTaskRequest>) -> Res<pb::TaskDetail> {
        let who = caller(&req);
        let task = task_name(&req.get_ref().task)?;
        // A lease the CLI took while no coordinator ran is shown once adopted.
        self.coord
            .engine
            .touch_guarded(&task)
            .await
            .map_err(crate::status)?;
        let t = task.clone();
        let mut view = self
            .coord
            .engine
            .read(move |p| p.view(&t, SystemTime::now()))
            .await
            .map_err(crate::status)?;
        // The coordinator's table is the truth; the file view may lag it.
        self.coord
            .engine
            .implementers(&task, &mut view.implementers);
        let live = self.coord.engine.live_of(&task);
        let secrets = live.as_ref().is_some_and(|l| may_see_secrets(&who, l));
        let lease = live.as_ref().map(|l| {
            let mut shown = lease_pb(l, false);
            if !secrets {
                shown.lease_id.clear();
                shown.token = 0;
            }
            shown
        });
        let mut row = pb::TaskSummary {
            task: task.to_string(),
            state: state_str(view.state),
            tracked: view.tracked,
            next: view
                .state
                .map(|s| s.legal_targets())
                .unwrap_or_default()
                .iter()
                .map(State::to_string)
                .collect(),
            approval_stale: matches!(
                view.approval,
                Some(automaton_store::ApprovalView::Approved { stale: true, .. })
            ),
            approval_missing: false,
            error: String::new(),
            lease_holder: live
                .as_ref()
                .map(|l| l.agent.to_string())
                .unwrap_or_default(),
            subtasks: vec![],
            waiting: String::new(),
            held: String::new(),
            wave: 0,
            estimated_tokens: 0,
            verdicts: view.verdicts.as_ref().map(verdicts_pb),
            attention: view.attention.clone().unwrap_or_default(),
            next_command: String::new(),
            last_failure: String::new(),
            delivery: None,
        };
        if let Some(r) = self.coord.delivery_of(&task).await {
            row.delivery = Some(self.coord.delivery_shown(&task, &r));
        }
        self.annotate(&mut row);
        let mut artifacts: Vec<pb::ArtifactFile> = view
            .artifacts
            .iter()
            .map(|a| pb::ArtifactFile {
                artifact: a.artifact.to_string(),
                bytes: a.bytes,
                blank: a.blank,
                content: String::new(),
                truncated: false,
            })
            .collect();
        if req.get_ref().with_contents {
            let (t, which) = (task.clone(), view.artifacts.clone());
            let texts = self
                .coord
                .engine
                .read(move |p| {
                    which
                        .iter()
                        .map(|a| p.read_artifact(&t, a.artifact))
                        .collect::<Result<Vec<_>, _>>()
                })
                .await
                .map_err(crate::status)?;
            for (file, text) in artifacts.iter_mut().zip(texts) {
                let bytes = text.unwrap_or_default();
                file.truncated = bytes.len() > ARTIFACT_SHOWN;
                file.content = text_prefix(&bytes, ARTIFACT_SHOWN);
            }
        }
        let changes = if req.get_ref().with_changes {
            let t = task.clone();
            self.coord
                .engine
                .read(move |p| p.task_changes(&t))
                .await
                .map_err(crate::status)?
                .map(|c| {
                    let mut diff = String::from_utf8_lossy(&c.diff).into_owned();
                    let mut truncated = diff.contains("[changes.diff cut at ");
                    // Within what a client decodes by default (4 MiB), with room to spare.
                    if diff.len() > CHANGES_SHOWN {
                        let mut end = CHANGES_SHOWN;
                        while !diff.is_char_boundary(end) {
                            end -= 1;
                        }
                        diff.truncate(end);
                        truncated = true;
                    }
                    pb::TaskChanges {
                        truncated,
                        base_commit: c.base,
                        head_commit: c.head,
                        diff,
                    }
                })
        } else {
            None
        };
        Ok(Response::new(pb::TaskDetail {
            changes,
            summary: Some(row),
            lease,
            implementers: view.implementers.iter().map(|a| a.to_string()).collect(),
            runs: self.coord.work.runs(&task),
            state_file: view.state_file.display().to_string(),
            parent: view.parent.as_ref().map(|(p, s)| pb::ParentTask {
                task: p.to_string(),
                state: state_str(*s),
            }),
            artifacts,
            approval: view.approval.as_ref().map(approval_pb),
            subtasks: view.subtasks.iter().map(|t| t.to_string()).collect(),
            guidance: view.guidance.as_ref().map(|g| pb::Guidance {
                allowed: g.allowed.clone(),
                forbidden: g.forbidden.clone(),
                next_artifact: g.next_artifact.clone().unwrap_or_default(),
                next: g.next.iter().map(State::to_string).collect(),
                command: g.command.clone(),
            }),
        }))
    }

    async fn list_tasks(&self, _req: Request<pb::ListTasksRequest>) -> Res<pb::ListTasksResponse> {
        let mut entries = self
            .coord
            .engine
            .read(|p| p.list(SystemTime::now()))
            .await
            .map_err(crate::status)?;
        for e in &mut entries {
            e.lease_holder = self.coord.engine.lease_of(&e.task).map(|l| l.agent);
            for s in &mut e.subtasks {
                s.lease_holder = self.coord.engine.lease_of(&s.task).map(|l| l.agent);
            }
        }
        let mut tasks: Vec<pb::TaskSummary> = entries.iter().map(summary).collect();
        for t in &mut tasks {
            self.annotate(t);
            for s in &mut t.subtasks {
                self.annotate(s);
            }
        }
        Ok(Response::new(pb::ListTasksResponse {
            sizing_ratio: self.coord.work.learned_ratio().unwrap_or(0.0),
            tasks,
        }))
    }

    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task, target = %req.get_ref().target))]
    async fn transition(&self, req: Request<pb::TransitionRequest>) -> Res<pb::TransitionResponse> {
        let who = caller(&req);
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let target: State = r
            .target
            .parse()
            .map_err(|_| {
                Error::Invalid(format!(
                    "Unknown phase '{}': name one of {}",
                    r.target,
                    State::all()
                        .iter()
                        .map(State::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })
            .map_err(crate::status)?;
        let agent = agent_of_change(&who, &r.agent)?;
        let presented = Presented {
            agent,
            lease_id: (!r.lease_id.is_empty())
                .then(|| lease_id_arg(&r.lease_id).map(str::to_string))
                .transpose()?,
            token: (r.token != 0).then_some(r.token),
        };
        if who.role.is_bound() && presented.lease_id.is_none() && presented.token.is_none() {
            return Err(Error::PermissionDenied(format!(
                "'{}' is an agent: an agent transitions only under its lease (present lease_id and token)",
                who.name
            ))
            .into_status());
        }
        let (from, ended) = self
            .coord
            .engine
            .transition(&task, target, &presented)
            .await
            .map_err(crate::status)?;
        self.coord
            .task_changed_by_person(&task, &format!("moved {from} → {target}"));
        Ok(Response::new(pb::TransitionResponse {
            task: task.to_string(),
            from: from.to_string(),
            to: target.to_string(),
            released: ended.as_ref().map(|l| lease_pb(l, false)),
        }))
    }

    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task))]
    async fn approve(&self, req: Request<pb::ApproveRequest>) -> Res<pb::ApproveResponse> {
        let who = operator(&req, "Approve")?;
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let approver = if r.approver.is_empty() {
            who.name.clone()
        } else {
            r.approver
        };
        // A review approved is a review of the code it read: not of a branch that moved
        // since, unless a person names the new revision (`--revision`). The store checks the
        // branch is at that commit under the task's lock.
        let revision = match self.coord.state_now(&task).await {
            Ok(state)
                if state.phase == automaton_workflow::Phase::CodeReview
                    && state.gate != automaton_workflow::Gate::Open =>
            {
                let given = (!r.revision.is_empty()).then(|| r.revision.clone());
                match (given, self.coord.review_moved(&task, state).await) {
                    (Some(r), _) => Some(r),
                    (None, Some((read, head))) => {
                        return Err(Error::Refused(format!(
                            "{task}'s code review read commit {read}, and its branch is at {head} since: approving it would authorize code nobody reviewed. Let the review run again on the new head (the coordinator sends it back), or read the new commits and approve them with --revision {}",
                            head.get(..12).unwrap_or(&head)
                        ))
                        .into_status());
                    }
                    (None, None) => self.coord.review_read(&task),
                }
            }
            _ => (!r.revision.is_empty()).then(|| r.revision.clone()),
        };
        let out = self
            .coord
            .engine
            .approve(&task, &approver, revision)
            .await
            .map_err(crate::status)?;
        self.coord
            .task_changed_by_person(&task, &format!("approved by {approver}"));
        Ok(Response::new(pb::ApproveResponse {
            task: task.to_string(),
            from: out.from.to_string(),
            to: out.to.to_string(),
            approver: out.approval.approver.clone(),
            approved_at: Some(timestamp(out.approval.at)),
            sha256: out.approval.sha256.clone().unwrap_or_default(),
            commit: out.approval.commit.clone().unwrap_or_default(),
        }))
    }

    async fn validate_folder(
        &self,
        req: Request<pb::ValidateFolderRequest>,
    ) -> Res<pb::ValidateFolderResponse> {
        // No task: every task and sub-task, as `--validate-folder` without `--task`.
        if req.get_ref().task.is_empty() {
            let all = self
                .coord
                .engine
                .read(|p| p.validate_all())
                .await
                .map_err(crate::status)?;
            return Ok(Response::new(pb::ValidateFolderResponse {
                exit_code: all.exit_code(),
                reports: all.reports.iter().map(folder_report).collect(),
                errors: all
                    .errors
                    .iter()
                    .map(|e| pb::TaskError {
                        task: e.task.to_string(),
                        error: e.error.clone(),
                    })
                    .collect(),
                unaddressable: all.unaddressable.iter().map(unaddressable).collect(),
            }));
        }
        let task = task_name(&req.get_ref().task)?;
        let report = self
            .coord
            .engine
            .read(move |p| p.validate_folder(&task))
            .await
            .map_err(crate::status)?;
        Ok(Response::new(pb::ValidateFolderResponse {
            exit_code: if report.passed() { 0 } else { 1 },
            reports: vec![folder_report(&report)],
            ..Default::default()
        }))
    }

    async fn audit(&self, _req: Request<pb::AuditRequest>) -> Res<pb::AuditResponse> {
        let report = self
            .coord
            .engine
            .read(|p| p.audit())
            .await
            .map_err(crate::status)?;
        Ok(Response::new(audit_pb(&report)))
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl pb::leases_server::Leases for Service {
    // DEBUG, not INFO: the default filter would otherwise build a span on every claim.
    #[tracing::instrument(level = "debug", skip_all, fields(task = %req.get_ref().task, agent = %req.get_ref().agent))]
    async fn claim(&self, req: Request<pb::ClaimRequest>) -> Res<pb::Lease> {
        let who = caller(&req);
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        if r.session_id.len() > MAX_LEASE_ID {
            return Err(Error::Invalid(format!(
                "session id '{}' is longer than {MAX_LEASE_ID} bytes: send the session_id a SessionGranted returned",
                automaton_workflow::excerpt(&r.session_id)
            ))
            .into_status());
        }
        // A worker claims only in its session; an operator may claim in any (the session
        // then names the agent); an agent's own leases belong to no session.
        let (agent, session) = match who.role {
            Role::Worker => (acting_agent(&who, &r.agent)?, Some(r.session_id.as_str())),
            Role::Operator if !r.session_id.is_empty() => {
                let Some(name) = self.coord.session_name(&r.session_id) else {
                    return Err(Error::Refused(format!(
                        "session '{}' has ended (or never existed): the worker must register again",
                        automaton_workflow::excerpt(&r.session_id)
                    ))
                    .into_status());
                };
                if !r.agent.is_empty() && r.agent != name.as_str() {
                    return Err(Error::Invalid(format!(
                        "session '{}' is worker '{name}''s, not '{}': leave agent empty or send '{name}'",
                        r.session_id,
                        automaton_workflow::excerpt(&r.agent)
                    ))
                    .into_status());
                }
                (name, Some(r.session_id.as_str()))
            }
            Role::Agent if !r.session_id.is_empty() => {
                return Err(Error::PermissionDenied(format!(
                    "'{}' holds an agent token: only workers (and operators) claim in a worker session",
                    who.name
                ))
                .into_status());
            }
            _ => (acting_agent(&who, &r.agent)?, None),
        };
        let g = {
            let ttl = r.ttl.as_ref().map(|d| duration_arg("ttl", d)).transpose()?;
            self.coord
                .engine
                .claim_in(&task, &agent, ttl, session)
                .await
                .map_err(crate::status)?
        };
        Ok(Response::new(lease_pb(&g.live, g.renewed)))
    }

    async fn renew(&self, req: Request<pb::RenewRequest>) -> Res<pb::Lease> {
        let who = bound_agent(&caller(&req))?;
        let r = req.into_inner();
        let l = self
            .coord
            .engine
            .renew(
                lease_id_arg(&r.lease_id)?,
                (r.token != 0).then_some(r.token),
                who.as_ref(),
            )
            .await
            .map_err(crate::status)?;
        self.coord.engine.emit_renewed(&l);
        Ok(Response::new(lease_pb(&l, true)))
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Res<pb::ReleaseResponse> {
        let who = caller(&req);
        let r = req.into_inner();
        let agent = agent_of_change(&who, &r.agent)?;
        let l = self
            .coord
            .engine
            .release(
                lease_id_arg(&r.lease_id)?,
                (r.token != 0).then_some(r.token),
                agent.as_ref(),
            )
            .await
            .map_err(crate::status)?;
        Ok(Response::new(pb::ReleaseResponse {
            released: Some(lease_pb(&l, false)),
        }))
    }

    type KeepAliveStream = BoxStream<pb::KeepAliveResponse>;

    async fn keep_alive(
        &self,
        req: Request<Streaming<pb::KeepAliveRequest>>,
    ) -> Res<Self::KeepAliveStream> {
        let who = bound_agent(&caller(&req))?;
        Ok(Response::new(Box::pin(crate::keepalive::KeepAlive::new(
            self.coord.clone(),
            req.into_inner(),
            who,
        ))))
    }
}

#[tonic::async_trait]
impl pb::events_server::Events for Service {
    type WatchEventsStream = BoxStream<pb::Event>;

    async fn watch_events(
        &self,
        req: Request<pb::WatchEventsRequest>,
    ) -> Res<Self::WatchEventsStream> {
        // Fencing tokens are for holders and operators.
        let tokens_shown = caller(&req).role == Role::Operator;
        let mut events = self.coord.engine.subscribe_events();
        let mut stop = self.shutdown.clone();
        let (tx, rx) = mpsc::channel(1024);
        tokio::spawn(async move {
            loop {
                let e = tokio::select! {
                    e = events.rx.recv() => e,
                    _ = stop.changed() => return,
                };
                let msg = match e {
                    Ok(e) => pb::Event {
                        seq: e.seq,
                        at: Some(timestamp(e.at)),
                        kind: e.kind.name().into(),
                        event_kind: pb::EventKind::from(e.kind) as i32,
                        from_state: e.moved.map(|(f, _)| f.to_string()).unwrap_or_default(),
                        to_state: e.moved.map(|(_, t)| t.to_string()).unwrap_or_default(),
                        task: e.task,
                        agent: e.agent,
                        token: if tokens_shown { e.token } else { 0 },
                        detail: e.detail,
                    },
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => pb::Event {
                        kind: EventKind::Lagged.name().into(),
                        event_kind: pb::EventKind::Lagged as i32,
                        detail: format!("{n} events were dropped: this watcher reads too slowly"),
                        at: Some(timestamp(SystemTime::now())),
                        ..Default::default()
                    },
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                };
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_artifacts_text_is_cut_before_a_character_that_does_not_fit() {
        assert_eq!(text_prefix(b"abc", 10), "abc");
        assert_eq!(text_prefix("aé".as_bytes(), 2), "a");
        assert_eq!(text_prefix("aé".as_bytes(), 3), "aé");
        assert_eq!(text_prefix(b"ab\xffc", 10), "ab\u{fffd}c");
        assert_eq!(text_prefix(b"", 0), "");
    }
}
