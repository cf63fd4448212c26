//! The KeepAlive response stream. It polls the client's requests itself, so a renewal is
//! answered in the same task that read it: no task hand-off per message, which matters on
//! the service's hottest path. Loss notices arrive on the stream's own channel, only for the
//! leases this stream has renewed (see `watchers.rs`).

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use automaton_engine::{Refused, watchers::Notice};
use automaton_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use automaton_workflow::AgentId;

use crate::state::Coordinator;

pub(crate) struct KeepAlive {
    coord: Arc<Coordinator>,
    inbound: Streaming<pb::KeepAliveRequest>,
    /// This stream's id among the coordinator's watchers, and its notices.
    id: u64,
    notices: mpsc::UnboundedReceiver<Notice>,
    /// The leases this client has named: the ones whose loss it must hear about.
    named: HashSet<String>,
    pending: VecDeque<pb::KeepAliveResponse>,
    /// A lapsed lease's end on its way to the log: answers wait behind it (a client told its
    /// lease is gone must never see it back after a restart).
    durable: Option<automaton_backend::Commit>,
    /// The agent an agent token speaks for: it renews only its own leases.
    who: Option<AgentId>,
    /// An error that ends the stream once the answers before it are sent.
    fail: Option<Status>,
    done: bool,
}

impl KeepAlive {
    pub(crate) fn new(
        coord: Arc<Coordinator>,
        inbound: Streaming<pb::KeepAliveRequest>,
        who: Option<AgentId>,
    ) -> Self {
        let (id, notices) = coord.engine.watchers().open();
        KeepAlive {
            coord,
            inbound,
            id,
            notices,
            named: HashSet::new(),
            pending: VecDeque::new(),
            durable: None,
            who,
            fail: None,
            done: false,
        }
    }

    fn renew(&mut self, id: String) -> pb::KeepAliveResponse {
        let watched = self.coord.engine.watched();
        let first = !self.named.contains(&id);
        let (coord, stream) = (&self.coord, self.id);
        let renewed = self
            .coord
            .engine
            .renew_with(&id, None, self.who.as_ref(), |l| {
                if first {
                    // Under the table's lock: the lease cannot end before this stream is told.
                    coord.engine.watchers().watch(stream, &l.lease_id);
                }
                // Only what the holder does not already know.
                let lease = pb::Lease {
                    lease_id: l.lease_id.clone(),
                    token: l.token,
                    ttl: Some(crate::wire::duration(l.ttl)),
                    remaining: Some(crate::wire::duration(l.ttl)),
                    renewed: true,
                    ..Default::default()
                };
                (lease, watched.then(|| l.clone()))
            });
        match renewed {
            Ok((lease, event)) => {
                if let Some(l) = event {
                    self.coord.engine.emit_renewed(&l);
                }
                if first {
                    self.named.insert(id.clone());
                }
                pb::KeepAliveResponse {
                    lease_id: id,
                    lease: Some(lease),
                    lost: None,
                }
            }
            Err(refused) => {
                if let Refused::OnceDurable(commit, _) = refused {
                    // A later barrier covers an earlier one: keep the newest.
                    self.durable = Some(commit);
                }
                pb::KeepAliveResponse {
                    lost: Some(pb::LeaseLost {
                        task: String::new(),
                        token: 0,
                        reason: "unknown".into(),
                        end: pb::LeaseEnd::Unspecified as i32,
                    }),
                    lease_id: automaton_workflow::excerpt(&id),
                    lease: None,
                }
            }
        }
    }

    /// What the stream yields now from its queued answers: the next one, a wait, or the
    /// error that ends it; `None` when nothing is queued.
    #[allow(clippy::type_complexity)]
    fn answered(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Option<Poll<Option<Result<pb::KeepAliveResponse, Status>>>> {
        match self.next_answer(cx) {
            Poll::Pending => return Some(Poll::Pending),
            Poll::Ready(Some(r)) => return Some(Poll::Ready(Some(Ok(r)))),
            Poll::Ready(None) => {}
        }
        let status = self.fail.take()?;
        self.done = true;
        Some(Poll::Ready(Some(Err(status))))
    }

    /// The next answer, once whatever it waits for is durable.
    fn next_answer(&mut self, cx: &mut Context<'_>) -> Poll<Option<pb::KeepAliveResponse>> {
        if let Some(commit) = &mut self.durable {
            match Pin::new(commit).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => self.durable = None,
                Poll::Ready(Err(e)) => {
                    self.durable = None;
                    self.pending.clear();
                    self.fail = Some(Status::unavailable(e));
                    return Poll::Ready(None);
                }
            }
        }
        Poll::Ready(self.pending.pop_front())
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.coord
            .engine
            .watchers()
            .close(self.id, self.named.iter());
    }
}

impl Stream for KeepAlive {
    type Item = Result<pb::KeepAliveResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(ready) = this.answered(cx) {
            return ready;
        }
        loop {
            match this.notices.poll_recv(cx) {
                Poll::Ready(Some(Notice::Lost(n))) => {
                    if this.named.remove(&n.lease_id) {
                        return Poll::Ready(Some(Ok(pb::KeepAliveResponse {
                            lease_id: n.lease_id,
                            lease: None,
                            lost: Some(pb::LeaseLost {
                                task: n.task.to_string(),
                                token: n.token,
                                reason: n.reason.name().into(),
                                end: pb::LeaseEnd::from(n.reason) as i32,
                            }),
                        })));
                    }
                }
                Poll::Ready(Some(Notice::Stop)) | Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => break,
            }
        }
        loop {
            match Pin::new(&mut this.inbound).poll_next(cx) {
                Poll::Ready(Some(Ok(m))) => {
                    let max = this.coord.options.keepalive_max_ids;
                    if m.lease_ids.len() > max {
                        this.done = true;
                        return Poll::Ready(Some(Err(Status::invalid_argument(format!(
                            "a KeepAlive request named {} leases; at most {max} per request: split it",
                            m.lease_ids.len()
                        )))));
                    }
                    for id in m.lease_ids {
                        let r = this.renew(id);
                        this.pending.push_back(r);
                    }
                    if let Some(ready) = this.answered(cx) {
                        return ready;
                    }
                    // An empty request: read the next one.
                }
                Poll::Ready(Some(Err(_))) | Poll::Ready(None) => {
                    this.done = true;
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}
