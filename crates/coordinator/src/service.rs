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
use crate::leases::Live;
use crate::state::{Coordinator, Presented, format_millis};

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

fn require_operator(c: &Caller, what: &str) -> Result<(), Status> {
    if c.role == Role::Operator {
        Ok(())
    } else {
        Err(Error::PermissionDenied(format!(
            "{what} needs an operator token; '{}' is an agent",
            c.name
        ))
        .into())
    }
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
    }
}

fn summary(e: &automaton_store::ListEntry) -> pb::TaskSummary {
    pb::TaskSummary {
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
        let task = task_name(&req.get_ref().task)?;
        let t = task.clone();
        let mut view = self
            .coord
            .read(move |p| p.view(&t, SystemTime::now()))
            .await?;
        // The coordinator's table is the truth; the file view may lag it. One lookup serves
        // both the view and the typed lease.
        let live = self.coord.live_of(&task);
        view.lease = live
            .as_ref()
            .map(|l| l.as_store_lease(std::time::Instant::now()));
        let lease = live.as_ref().map(|l| lease_pb(l, false));
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
            }),
            lease,
            implementers: view.implementers.iter().map(|a| a.to_string()).collect(),
            view_json: json(&view)?,
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
        Ok(Response::new(pb::ListTasksResponse {
            tasks: entries.iter().map(summary).collect(),
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
        let presented = Presented {
            agent: (!r.agent.is_empty())
                .then(|| agent_id(&r.agent))
                .transpose()?,
            lease_id: (!r.lease_id.is_empty()).then_some(r.lease_id),
            token: (r.token != 0).then_some(r.token),
        };
        if who.role == Role::Agent && presented.lease_id.is_none() && presented.token.is_none() {
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
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let agent = agent_id(&r.agent)?;
        let ttl = (r.ttl_ms != 0).then(|| Duration::from_millis(r.ttl_ms));
        let g = self.coord.claim(&task, &agent, ttl).await?;
        Ok(Response::new(lease_pb(&g.live, g.renewed)))
    }

    async fn renew(&self, req: Request<pb::RenewRequest>) -> Res<pb::Lease> {
        let r = req.into_inner();
        let l = self
            .coord
            .renew(&r.lease_id, (r.token != 0).then_some(r.token))?;
        self.coord.emit_renewed(&l);
        Ok(Response::new(lease_pb(&l, true)))
    }

    async fn release(&self, req: Request<pb::ReleaseRequest>) -> Res<pb::ReleaseResponse> {
        let r = req.into_inner();
        let l = self
            .coord
            .release(&r.lease_id, (r.token != 0).then_some(r.token))
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
        Ok(Response::new(Box::pin(crate::keepalive::KeepAlive::new(
            self.coord.clone(),
            req.into_inner(),
        ))))
    }
}

#[tonic::async_trait]
impl pb::events_server::Events for Service {
    type WatchEventsStream = BoxStream<pb::Event>;

    async fn watch_events(
        &self,
        _req: Request<pb::WatchEventsRequest>,
    ) -> Res<Self::WatchEventsStream> {
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
                        token: e.token,
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
