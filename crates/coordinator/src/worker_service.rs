//! The `Workers` service: the session stream, `ListWorkers`, `DrainWorker` (proto in,
//! `sessions.rs` operations, proto out).

use automaton_workflow::EventKind;
use std::pin::Pin;
use std::task::{Context, Poll};

use automaton_proto::v1 as pb;
use pb::coordinator_message::Msg as Out;
use pb::worker_message::Msg as In;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use crate::Error;
use crate::IntoStatus;
use crate::auth::caller;
use crate::config::Role;
use crate::service::Service;
use crate::sessions::Push;
use crate::wire::{operator, task_name};

/// Heartbeat acks waiting to be sent: a worker that heartbeats without reading its stream
/// loses acks (it is not listening anyway), never the coordinator's memory.
const ACKS_QUEUED: usize = 8;

/// A session's outbound messages: notices (lease losses, drains, the end) first, then acks.
/// Ends after the first `Push::End`.
pub struct Outbound {
    rx: mpsc::UnboundedReceiver<Push>,
    acks: mpsc::Receiver<u64>,
    done: bool,
}

impl Stream for Outbound {
    type Item = Result<pb::CoordinatorMessage, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(Push::Msg(m))) => return Poll::Ready(Some(Ok(*m))),
            Poll::Ready(Some(Push::End(s))) => {
                self.done = true;
                return if s.code() == tonic::Code::Ok {
                    Poll::Ready(None)
                } else {
                    Poll::Ready(Some(Err(s)))
                };
            }
            Poll::Ready(None) => return Poll::Ready(None),
            Poll::Pending => {}
        }
        match self.acks.poll_recv(cx) {
            Poll::Ready(Some(seq)) => Poll::Ready(Some(Ok(pb::CoordinatorMessage {
                msg: Some(Out::Ack(pb::HeartbeatAck { seq })),
            }))),
            // The reader is gone; notices still end the stream through `rx`.
            Poll::Ready(None) | Poll::Pending => Poll::Pending,
        }
    }
}

fn msg(m: Out) -> Push {
    Push::Msg(Box::new(pb::CoordinatorMessage { msg: Some(m) }))
}

#[tonic::async_trait]
impl pb::workers_server::Workers for Service {
    type SessionStream = Outbound;
    type TailOutputStream = tokio_stream::wrappers::ReceiverStream<Result<pb::OutputEvent, Status>>;

    async fn tail_output(
        &self,
        req: Request<pb::TailOutputRequest>,
    ) -> Result<Response<Self::TailOutputStream>, Status> {
        crate::output::tail_output(&self.coord.engine, &self.outputs, &self.shutdown, req).await
    }

    async fn session(
        &self,
        req: Request<Streaming<pb::WorkerMessage>>,
    ) -> Result<Response<Outbound>, Status> {
        let who = caller(&req);
        let bound = match who.role {
            Role::Worker => Some(who.name.clone()),
            Role::Operator => None,
            Role::Agent => {
                return Err(Error::PermissionDenied(format!(
                    "'{}' holds an agent token: a worker session needs a worker token (role = \"worker\")",
                    who.name
                ))
                .into_status());
            }
        };
        let mut inbound = req.into_inner();
        // The first message registers; a client that sends nothing is dropped after one
        // session timeout.
        let first = tokio::time::timeout(self.coord.sessions.timeout, inbound.message())
            .await
            .map_err(|_| {
                Status::deadline_exceeded(
                    "no Register within the session timeout: send Register first",
                )
            })??;
        let Some(pb::WorkerMessage {
            msg: Some(In::Register(reg)),
        }) = first
        else {
            return Err(Status::failed_precondition(
                "the first message of a session must be a Register",
            ));
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let (acks_tx, acks) = mpsc::channel(ACKS_QUEUED);
        let joined = self
            .coord
            .register(bound.as_deref(), reg, tx.clone())
            .await
            .map_err(crate::status)?;
        let _ = tx.send(msg(Out::Granted(joined.granted)));
        let coord = self.coord.clone();
        let mut stop = self.shutdown.clone();
        let (id, generation) = (joined.id, joined.generation);
        let name = joined.name;
        let (adopted, run_lost) = (joined.adopted, joined.run_lost);
        // A new worker may take work now.
        self.coord.work.poke();
        tokio::spawn(async move {
            // A resume's runs first (after `Granted`, which must come first on the stream; a
            // lost run's lease end is announced on it), then the worker's messages: its first
            // updates may be of those runs.
            if !adopted.is_empty() || !run_lost.is_empty() {
                coord.resumed_runs(&name, adopted, run_lost).await;
            }
            loop {
                let next = tokio::select! {
                    m = inbound.message() => m,
                    _ = stop.changed() => break,
                };
                match next {
                    Ok(Some(pb::WorkerMessage {
                        msg: Some(In::Heartbeat(h)),
                    })) => match coord.heartbeat(&id, generation) {
                        Ok(()) => {
                            let _ = acks_tx.try_send(h.seq);
                        }
                        Err(s) => {
                            let _ = tx.send(Push::End(s));
                            break;
                        }
                    },
                    Ok(Some(pb::WorkerMessage {
                        msg: Some(In::Answer(a)),
                    })) => coord.answered(&name, a).await,
                    Ok(Some(pb::WorkerMessage {
                        msg: Some(In::Run(r)),
                    })) => coord.run_update(&name, &id, r).await,
                    Ok(Some(pb::WorkerMessage {
                        msg: Some(In::Deregister(_)),
                    })) => {
                        if let Err(e) = coord.deregister(&id, generation).await {
                            let _ = tx.send(Push::End(e.into_status()));
                        } else {
                            let _ = tx.send(Push::End(Status::ok("deregistered")));
                        }
                        break;
                    }
                    Ok(Some(pb::WorkerMessage {
                        msg: Some(In::Register(_)),
                    })) => {
                        let _ = tx.send(Push::End(Status::invalid_argument(
                            "this stream already registered: send Heartbeat or Deregister",
                        )));
                        coord.sessions.detach(&id, generation);
                        break;
                    }
                    Ok(Some(pb::WorkerMessage { msg: None })) => {
                        let _ = tx.send(Push::End(Status::invalid_argument(
                            "an empty WorkerMessage: send Heartbeat or Deregister",
                        )));
                        coord.sessions.detach(&id, generation);
                        break;
                    }
                    // The stream broke or the worker closed it: the session lives on until
                    // its timeout, for the worker to resume.
                    Ok(None) | Err(_) => {
                        coord.sessions.detach(&id, generation);
                        break;
                    }
                }
            }
        });
        Ok(Response::new(Outbound {
            rx,
            acks,
            done: false,
        }))
    }

    async fn list_workers(
        &self,
        req: Request<pb::ListWorkersRequest>,
    ) -> Result<Response<pb::ListWorkersResponse>, Status> {
        let who = caller(&req);
        let workers = self
            .coord
            .workers(who.role == Role::Operator, Some(who.name.as_str()));
        Ok(Response::new(pb::ListWorkersResponse { workers }))
    }

    async fn drain_worker(
        &self,
        req: Request<pb::DrainWorkerRequest>,
    ) -> Result<Response<pb::WorkerInfo>, Status> {
        operator(&req, "DrainWorker")?;
        let r = req.into_inner();
        let name = r
            .name
            .parse()
            .map_err(|e: automaton_workflow::NameError| Error::Invalid(format!("worker name: {e}")))
            .map_err(crate::status)?;
        Ok(Response::new(
            self.coord.drain(&name, r.undo).map_err(crate::status)?,
        ))
    }

    async fn stop_run(
        &self,
        req: Request<pb::StopRunRequest>,
    ) -> Result<Response<pb::StopRunResponse>, Status> {
        let who = operator(&req, "StopRun")?;
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let (worker, held) = self
            .coord
            .stop_run(&task, r.resume, &who.name)
            .await
            .map_err(crate::status)?;
        Ok(Response::new(pb::StopRunResponse {
            task: task.to_string(),
            worker: worker.map(|w| w.to_string()).unwrap_or_default(),
            held,
        }))
    }

    async fn run_task(
        &self,
        req: Request<pb::RunTaskRequest>,
    ) -> Result<Response<pb::RunTaskResponse>, Status> {
        let who = operator(&req, "RunTask")?;
        let r = req.into_inner();
        let task = task_name(&r.task)?;
        let phase = self
            .coord
            .run_task(&task, &who.name)
            .await
            .map_err(crate::status)?;
        Ok(Response::new(pb::RunTaskResponse {
            task: task.to_string(),
            phase: phase.to_string(),
        }))
    }

    async fn deliver(
        &self,
        req: Request<pb::DeliverRequest>,
    ) -> Result<Response<pb::Delivery>, Status> {
        let who = operator(&req, "Deliver")?;
        let task = delivered_task(&self.coord, &req.get_ref().task)?;
        let r = self
            .coord
            .deliver(&task, &who.name)
            .await
            .map_err(crate::status)?;
        Ok(Response::new(self.coord.delivery_shown(&task, &r)))
    }

    async fn abandon(
        &self,
        req: Request<pb::AbandonRequest>,
    ) -> Result<Response<pb::Delivery>, Status> {
        let who = operator(&req, "Abandon")?;
        let task = delivered_task(&self.coord, &req.get_ref().task)?;
        if req.get_ref().reason.len() > 4096 {
            return Err(crate::status(Error::Invalid(
                "the reason is longer than 4096 bytes: say it in one line".into(),
            )));
        }
        let r = self
            .coord
            .abandon(&task, &who.name, &req.get_ref().reason)
            .await
            .map_err(crate::status)?;
        Ok(Response::new(self.coord.delivery_shown(&task, &r)))
    }

    async fn collect_branches(
        &self,
        req: Request<pb::CollectBranchesRequest>,
    ) -> Result<Response<pb::CollectBranchesResponse>, Status> {
        let who = operator(&req, "CollectBranches")?;
        self.coord.engine.leading().map_err(crate::status)?;
        let dry_run = req.get_ref().dry_run;
        let collected = self
            .coord
            .engine
            .read(move |p| p.collect_branches(dry_run))
            .await
            .map_err(crate::status)?;
        let branches: Vec<pb::CollectedBranch> = collected
            .into_iter()
            .map(|c| pb::CollectedBranch {
                task: c.task.to_string(),
                branch: c.branch,
                removed: c.removed,
                why: c.why,
            })
            .collect();
        if !dry_run {
            for b in branches.iter().filter(|b| b.removed) {
                self.coord.engine.emit(
                    EventKind::BranchRemoved,
                    &b.task,
                    &who.name,
                    0,
                    format!("{}: {}", b.branch, b.why),
                );
            }
        }
        Ok(Response::new(pb::CollectBranchesResponse { branches }))
    }
}

/// The top-level task a Deliver or Abandon names, which must exist.
fn delivered_task(
    coord: &crate::state::Coordinator,
    name: &str,
) -> Result<automaton_workflow::TaskName, Status> {
    let task = task_name(name)?;
    if task.parent().is_some() {
        return Err(crate::status(Error::Invalid(format!(
            "{task} is a sub-task: its code is delivered with its parent's ({})",
            task.parent().map(|p| p.to_string()).unwrap_or_default()
        ))));
    }
    if !coord.engine.project().task_dir(&task).is_dir() {
        return Err(crate::status(Error::Store(
            automaton_store::Error::TaskNotFound {
                task,
                tasks: String::new(),
            },
        )));
    }
    Ok(task)
}
