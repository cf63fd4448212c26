//! The KeepAlive response stream. It polls the client's requests itself, so a renewal is
//! answered in the same task that read it: no task hand-off per message, which matters on
//! the service's hottest path. Loss notices arrive on the stream's own channel, only for the
//! leases this stream has renewed (see `watchers.rs`).

use std::collections::{HashSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use automaton_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Status, Streaming};

use crate::state::Coordinator;
use crate::watchers::Notice;

pub(crate) struct KeepAlive {
    coord: Arc<Coordinator>,
    inbound: Streaming<pb::KeepAliveRequest>,
    /// This stream's id among the coordinator's watchers, and its notices.
    id: u64,
    notices: mpsc::UnboundedReceiver<Notice>,
    /// The leases this client has named: the ones whose loss it must hear about.
    named: HashSet<String>,
    pending: VecDeque<pb::KeepAliveResponse>,
    done: bool,
}

impl KeepAlive {
    pub(crate) fn new(coord: Arc<Coordinator>, inbound: Streaming<pb::KeepAliveRequest>) -> Self {
        let (id, notices) = coord.watchers.open();
        KeepAlive {
            coord,
            inbound,
            id,
            notices,
            named: HashSet::new(),
            pending: VecDeque::new(),
            done: false,
        }
    }

    fn renew(&mut self, id: String) -> pb::KeepAliveResponse {
        let watched = self.coord.watched();
        let first = !self.named.contains(&id);
        let (coord, stream) = (&self.coord, self.id);
        let renewed = self.coord.renew_with(&id, None, |l| {
            if first {
                // Under the table's lock: the lease cannot end before this stream is told.
                coord.watchers.watch(stream, &l.lease_id);
            }
            // Only what the holder does not already know.
            let lease = pb::Lease {
                lease_id: l.lease_id.clone(),
                token: l.token,
                ttl_ms: l.ttl.as_millis() as u64,
                remaining_ms: l.ttl.as_millis() as u64,
                renewed: true,
                ..Default::default()
            };
            (lease, watched.then(|| l.clone()))
        });
        match renewed {
            Ok((lease, event)) => {
                if let Some(l) = event {
                    self.coord.emit_renewed(&l);
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
            Err(_) => pb::KeepAliveResponse {
                lost: Some(pb::LeaseLost {
                    task: String::new(),
                    token: 0,
                    reason: "unknown".into(),
                }),
                lease_id: id,
                lease: None,
            },
        }
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.coord.watchers.close(self.id, self.named.iter());
    }
}

impl Stream for KeepAlive {
    type Item = Result<pb::KeepAliveResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(r) = this.pending.pop_front() {
            return Poll::Ready(Some(Ok(r)));
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
                                reason: n.reason.into(),
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
                    for id in m.lease_ids {
                        let r = this.renew(id);
                        this.pending.push_back(r);
                    }
                    if let Some(r) = this.pending.pop_front() {
                        return Poll::Ready(Some(Ok(r)));
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
