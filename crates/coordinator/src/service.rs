//! The gRPC services: proto in, `Coordinator` operations, proto out.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use automaton_proto::v1 as pb;
use automaton_store::format_time;
use automaton_workflow::{AgentId, State, TaskName};
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::Error;
use crate::auth::{Caller, caller};
use crate::config::Role;
use crate::events::format_millis;
use crate::lease_ops::Presented;
use crate::state::Coordinator;
use crate::table::Live;

type Res<T> = Result<Response<T>, Status>;

#[derive(Clone)]
pub struct Service {
    pub(crate) coord: Arc<Coordinator>,
    pub(crate) shutdown: watch::Receiver<bool>,
}

fn task_name(s: &str) -> Result<TaskName, Status> {
    s.parse::<TaskName>()
        .map_err(|e| Error::Store(e.into()).into())
}

fn agent_id(s: &str) -> Result<AgentId, Status> {
    s.parse::<AgentId>()
        .map_err(|e| Error::Store(e.into()).into())
}

fn json<T: serde::Serialize>(v: &T) -> Result<String, Status> {
    serde_json::to_string(v).map_err(|e| Status::internal(format!("cannot encode JSON: {e}")))
}

pub(crate) fn require_operator(c: &Caller, what: &str) -> Result<(), Status> {
    if c.role == Role::Operator {
        Ok(())
    } else {
        Err(Error::PermissionDenied(format!(
            "{what} needs an operator token; '{}' is {}",
            c.name,
            if c.role == Role::Worker {
                "a worker"
            } else {
                "an agent"
            }
        ))
        .into())
    }
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
        .into()),
        Role::Operator if requested.is_empty() => Err(Error::Invalid(
            "no agent named: send the agent that acts (an operator may act for any agent)".into(),
        )
        .into()),
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

/// The agent an agent token is bound to; `None` for operators, who may act for any agent.
fn bound_agent(who: &Caller) -> Result<Option<AgentId>, Status> {
    match who.role {
        Role::Agent | Role::Worker => agent_id(&who.name).map(Some),
        Role::Operator => Ok(None),
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
        .into());
    }
    Ok(id)
}

pub(crate) fn lease_pb(l: &Live, renewed: bool) -> pb::Lease {
    let now = Instant::now();
    pb::Lease {
        task: l.task.to_string(),
        agent: l.agent.to_string(),
        lease_id: l.lease_id.clone(),
        token: l.token,
        state: l.state.to_string(),
        ttl_ms: l.ttl.as_millis() as u64,
        expires_at: format_time(l.expires_at(now)),
        remaining_ms: l.deadline.saturating_duration_since(now).as_millis() as u64,
        renewed,
        session_id: l.session.as_deref().unwrap_or_default().to_string(),
    }
}

fn summary(e: &automaton_store::ListEntry) -> pb::TaskSummary {
    pb::TaskSummary {
        waiting: String::new(),
        held: String::new(),
        wave: 0,
        estimated_tokens: 0,
        task: e.task.to_string(),
        state: e.state.map(|s| s.to_string()).unwrap_or_default(),
        tracked: e.tracked,
        next: e.next.iter().map(State::to_string).collect(),
        approval_stale: e.approval_stale,
        lease_holder: e
            .lease_holder
            .as_ref()
            .map(|a| a.to_string())
            .unwrap_or_default(),
        subtasks: e.subtasks.iter().map(summary).collect(),
    }
}

#[tonic::async_trait]
impl pb::tasks_server::Tasks for Service {
    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task))]
    async fn create_task(&self, req: Request<pb::CreateTaskRequest>) -> Res<pb::TaskSummary> {
        require_operator(&caller(&req), "CreateTask")?;
        let task = task_name(&req.get_ref().task)?;
        self.coord.create_task(&task).await?;
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
        self.coord.touch_guarded(&task).await?;
        let t = task.clone();
        let mut view = self
            .coord
            .read(move |p| p.view(&t, SystemTime::now()))
            .await?;
        // The coordinator's table is the truth; the file view may lag it. One lookup serves
        // both the view and the typed lease.
        self.coord.implementers(&task, &mut view.implementers);
        let live = self.coord.live_of(&task);
        let secrets = live.as_ref().is_some_and(|l| may_see_secrets(&who, l));
        let hide = |id: &mut String, token: &mut u64| {
            if !secrets {
                id.clear();
                *token = 0;
            }
        };
        view.lease = live.as_ref().map(|l| {
            let mut shown = l.as_store_lease(std::time::Instant::now());
            hide(&mut shown.lease_id, &mut shown.token);
            shown
        });
        let lease = live.as_ref().map(|l| {
            let mut shown = lease_pb(l, false);
            hide(&mut shown.lease_id, &mut shown.token);
            shown
        });
        Ok(Response::new(pb::TaskDetail {
            summary: Some(pb::TaskSummary {
                task: task.to_string(),
                state: view.state.map(|s| s.to_string()).unwrap_or_default(),
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
                lease_holder: view
                    .lease
                    .as_ref()
                    .map(|l| l.agent.to_string())
                    .unwrap_or_default(),
                subtasks: vec![],
                waiting: self.coord.work.waiting(&task).unwrap_or_default(),
                held: self.coord.work.held(&task).unwrap_or_default(),
                wave: self.coord.work.wave_of(&task).map_or(0, |w| w.0 as u32),
                estimated_tokens: self.coord.work.wave_of(&task).map_or(0, |w| w.1),
            }),
            lease,
            implementers: view.implementers.iter().map(|a| a.to_string()).collect(),
            view_json: json(&view)?,
            runs: self.coord.work.runs(&task),
            held: self.coord.work.held(&task).unwrap_or_default(),
        }))
    }

    async fn list_tasks(&self, _req: Request<pb::ListTasksRequest>) -> Res<pb::ListTasksResponse> {
        let mut entries = self.coord.read(|p| p.list(SystemTime::now())).await?;
        for e in &mut entries {
            e.lease_holder = self.coord.lease_of(&e.task).map(|l| l.agent);
            for s in &mut e.subtasks {
                s.lease_holder = self.coord.lease_of(&s.task).map(|l| l.agent);
            }
        }
        let annotate = |s: &mut pb::TaskSummary| {
            if let Ok(t) = s.task.parse::<TaskName>() {
                s.waiting = self.coord.work.waiting(&t).unwrap_or_default();
                s.held = self.coord.work.held(&t).unwrap_or_default();
                if let Some((w, e)) = self.coord.work.wave_of(&t) {
                    s.wave = w as u32;
                    s.estimated_tokens = e;
                }
            }
        };
        let mut tasks: Vec<pb::TaskSummary> = entries.iter().map(summary).collect();
        for t in &mut tasks {
            annotate(t);
            for s in &mut t.subtasks {
                annotate(s);
            }
        }
        Ok(Response::new(pb::ListTasksResponse {
            sizing_ratio: self.coord.work.learned_ratio().unwrap_or(0.0),
            tasks,
            list_json: json(&entries)?,
        }))
    }

    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task, target = %req.get_ref().target))]
    async fn transition(&self, req: Request<pb::TransitionRequest>) -> Res<pb::TransitionResponse> {
        let who = caller(&req);
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let target: State = r.target.parse().map_err(|_| {
            Error::Invalid(format!(
                "Unknown phase '{}': name one of {}",
                r.target,
                State::all()
                    .iter()
                    .map(State::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
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
            .into());
        }
        let (from, ended) = self.coord.transition(&task, target, &presented).await?;
        Ok(Response::new(pb::TransitionResponse {
            task: task.to_string(),
            from: from.to_string(),
            to: target.to_string(),
            released: ended.as_ref().map(|l| lease_pb(l, false)),
        }))
    }

    #[tracing::instrument(skip_all, fields(task = %req.get_ref().task))]
    async fn approve(&self, req: Request<pb::ApproveRequest>) -> Res<pb::ApproveResponse> {
        let who = caller(&req);
        require_operator(&who, "Approve")?;
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let approver = if r.approver.is_empty() {
            who.name.clone()
        } else {
            r.approver
        };
        let out = self.coord.approve(&task, &approver).await?;
        Ok(Response::new(pb::ApproveResponse {
            task: task.to_string(),
            from: out.from.to_string(),
            to: out.to.to_string(),
            approver: out.approval.approver.clone(),
            approved_at: format_time(out.approval.at),
            sha256: out.approval.sha256.clone().unwrap_or_default(),
        }))
    }

    async fn validate_folder(&self, req: Request<pb::ValidateFolderRequest>) -> Res<pb::Report> {
        // No task: every task and sub-task, as `--validate-folder` without `--task`.
        if req.get_ref().task.is_empty() {
            let all = self.coord.read(|p| p.validate_all()).await?;
            return Ok(Response::new(pb::Report {
                exit_code: all.exit_code(),
                report_json: json(&all)?,
            }));
        }
        let task = task_name(&req.get_ref().task)?;
        let report = self.coord.read(move |p| p.validate_folder(&task)).await?;
        Ok(Response::new(pb::Report {
            exit_code: if report.passed() { 0 } else { 1 },
            report_json: json(&report)?,
        }))
    }

    async fn audit(&self, _req: Request<pb::AuditRequest>) -> Res<pb::Report> {
        let report = self.coord.read(|p| p.audit()).await?;
        Ok(Response::new(pb::Report {
            exit_code: report.exit_code(),
            report_json: json(&report)?,
        }))
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
            .into());
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
                    .into());
                };
                if !r.agent.is_empty() && r.agent != name.as_str() {
                    return Err(Error::Invalid(format!(
                        "session '{}' is worker '{name}''s, not '{}': leave agent empty or send '{name}'",
                        r.session_id,
                        automaton_workflow::excerpt(&r.agent)
                    ))
                    .into());
                }
                (name, Some(r.session_id.as_str()))
            }
            Role::Agent if !r.session_id.is_empty() => {
                return Err(Error::PermissionDenied(format!(
                    "'{}' holds an agent token: only workers (and operators) claim in a worker session",
                    who.name
                ))
                .into());
            }
            _ => (acting_agent(&who, &r.agent)?, None),
        };
        let g = {
            let ttl = (r.ttl_ms != 0).then(|| Duration::from_millis(r.ttl_ms));
            self.coord.claim_in(&task, &agent, ttl, session).await?
        };
        Ok(Response::new(lease_pb(&g.live, g.renewed)))
    }

    async fn renew(&self, req: Request<pb::RenewRequest>) -> Res<pb::Lease> {
        let who = bound_agent(&caller(&req))?;
        let r = req.into_inner();
        let l = self
            .coord
            .renew(
                lease_id_arg(&r.lease_id)?,
                (r.token != 0).then_some(r.token),
                who.as_ref(),
            )
            .await?;
        self.coord.emit_renewed(&l);
        Ok(Response::new(lease_pb(&l, true)))
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Res<pb::ReleaseResponse> {
        let who = caller(&req);
        let r = req.into_inner();
        let agent = agent_of_change(&who, &r.agent)?;
        let l = self
            .coord
            .release(
                lease_id_arg(&r.lease_id)?,
                (r.token != 0).then_some(r.token),
                agent.as_ref(),
            )
            .await?;
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
        let mut events = self.coord.subscribe_events();
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
                        at: format_millis(e.at),
                        kind: e.kind.into(),
                        task: e.task,
                        agent: e.agent,
                        token: if tokens_shown { e.token } else { 0 },
                        detail: e.detail,
                    },
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => pb::Event {
                        kind: "lagged".into(),
                        detail: format!("{n} events were dropped: this watcher reads too slowly"),
                        at: format_millis(SystemTime::now()),
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
