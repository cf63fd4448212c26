//! etcd 3.4 doing the equivalent work with its own leases:
//! claim = `LeaseGrant` + a put-if-absent `Txn` (create_revision == 0 → put key with the
//! lease); renew = one `LeaseKeepAlive` stream round trip; release = `LeaseRevoke` (which
//! also deletes the key).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::backend::{Backend, Renewer};
use crate::coord::status_err;

#[allow(clippy::all, clippy::unwrap_used)]
pub mod pb {
    tonic::include_proto!("etcdserverpb");
}

use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::request_op::Request;
use pb::{
    Compare, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseRevokeRequest,
    PutRequest, RangeRequest, RequestOp, TxnRequest,
};

pub struct Etcd {
    kv: Vec<KvClient<Channel>>,
    lease: Vec<LeaseClient<Channel>>,
    clients: usize,
    per_client: usize,
    ttl_s: i64,
}

impl Etcd {
    pub fn new(channels: &[Channel], clients: usize, per_client: usize, ttl_s: i64) -> Self {
        Etcd {
            kv: channels.iter().cloned().map(KvClient::new).collect(),
            lease: channels.iter().cloned().map(LeaseClient::new).collect(),
            clients,
            per_client,
            ttl_s,
        }
    }

    fn key(&self, client: usize, slot: usize) -> Vec<u8> {
        format!(
            "/automaton-bench/tasks/bench-c{}-{}",
            self.clients,
            client * self.per_client + slot
        )
        .into_bytes()
    }

    fn lease_client(&self, client: usize) -> LeaseClient<Channel> {
        self.lease[client % self.lease.len()].clone()
    }
}

impl Backend for Etcd {
    type Lease = i64;
    type Renewer = EtcdRenewer;

    async fn claim(&self, client: usize, slot: usize) -> Result<i64> {
        let mut leases = self.lease_client(client);
        let granted = leases
            .lease_grant(LeaseGrantRequest {
                ttl: self.ttl_s,
                id: 0,
            })
            .await
            .map_err(status_err)?
            .into_inner();
        if !granted.error.is_empty() {
            bail!("LeaseGrant: {}", granted.error);
        }
        let key = self.key(client, slot);
        let txn = TxnRequest {
            compare: vec![Compare {
                result: CompareResult::Equal as i32,
                target: CompareTarget::Create as i32,
                key: key.clone(),
                range_end: Vec::new(),
                target_union: Some(TargetUnion::CreateRevision(0)),
            }],
            success: vec![RequestOp {
                request: Some(Request::RequestPut(PutRequest {
                    key,
                    value: format!("bench-agent-{client}").into_bytes(),
                    lease: granted.id,
                    ..PutRequest::default()
                })),
            }],
            failure: Vec::new(),
        };
        let done = self.kv[client % self.kv.len()]
            .clone()
            .txn(txn)
            .await
            .map_err(status_err);
        match done {
            Ok(r) if r.get_ref().succeeded => Ok(granted.id),
            other => {
                let _ = leases
                    .lease_revoke(LeaseRevokeRequest { id: granted.id })
                    .await;
                match other {
                    Ok(_) => bail!("key already held"),
                    Err(e) => Err(e.context("Txn")),
                }
            }
        }
    }

    async fn release(&self, client: usize, lease: i64) -> Result<()> {
        self.lease_client(client)
            .lease_revoke(LeaseRevokeRequest { id: lease })
            .await
            .map_err(status_err)?;
        Ok(())
    }

    async fn renewer(&self, client: usize, lease: &i64) -> Result<EtcdRenewer> {
        let (tx, rx) = mpsc::channel(1);
        let request = LeaseKeepAliveRequest { id: *lease };
        // etcd sends the response headers only with the first message.
        tx.send(request).await.context("queue the first renewal")?;
        let stream = self
            .lease_client(client)
            .lease_keep_alive(ReceiverStream::new(rx))
            .await
            .map_err(status_err)?
            .into_inner();
        let mut r = EtcdRenewer {
            tx,
            stream,
            request,
        };
        r.receive().await?;
        Ok(r)
    }
}

pub struct EtcdRenewer {
    tx: mpsc::Sender<LeaseKeepAliveRequest>,
    stream: tonic::Streaming<LeaseKeepAliveResponse>,
    request: LeaseKeepAliveRequest,
}

impl EtcdRenewer {
    async fn receive(&mut self) -> Result<()> {
        match self.stream.message().await.map_err(status_err)? {
            Some(r) if r.ttl > 0 => Ok(()),
            Some(r) => bail!("lease {} lost (TTL {})", r.id, r.ttl),
            None => bail!("etcd closed the LeaseKeepAlive stream"),
        }
    }
}

impl Renewer for EtcdRenewer {
    async fn renew(&mut self) -> Result<()> {
        self.tx
            .send(self.request)
            .await
            .context("the LeaseKeepAlive request stream closed")?;
        self.receive().await
    }
}

/// Waits until etcd answers a read, for at most `limit`.
pub async fn wait_ready(channel: &Channel, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    let mut kv = KvClient::new(channel.clone());
    loop {
        let r = kv
            .range(RangeRequest {
                key: b"/automaton-bench/ready".to_vec(),
                ..RangeRequest::default()
            })
            .await;
        match r {
            Ok(_) => return Ok(()),
            Err(s) if Instant::now() >= deadline => {
                return Err(status_err(s).context("etcd does not answer Range"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}
