//! etcd 3.4 doing the equivalent work with its own leases:
//! claim = `LeaseGrant` + a put-if-absent `Txn` (create_revision == 0 → put key with the
//! lease); renew = one `LeaseKeepAlive` stream round trip; release = `LeaseRevoke` (which
//! also deletes the key).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::backend::{Backend, Renewer};
use crate::rpc::{Client, Stream};

/// etcd's API types: the ones `automaton-etcd` generates (one copy of etcd's protos).
pub use automaton_etcd::pb;

use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::request_op::Request;
use pb::{
    Compare, LeaseGrantRequest, LeaseGrantResponse, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseRevokeRequest, LeaseRevokeResponse, PutRequest, RangeRequest, RangeResponse, RequestOp,
    TxnRequest, TxnResponse,
};

const LEASE_GRANT: &str = "/etcdserverpb.Lease/LeaseGrant";
const LEASE_REVOKE: &str = "/etcdserverpb.Lease/LeaseRevoke";
const LEASE_KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";
const TXN: &str = "/etcdserverpb.KV/Txn";
const RANGE: &str = "/etcdserverpb.KV/Range";

pub struct Etcd {
    clients: Vec<Client>,
    /// How many clients measure (part of the keys' names).
    count: usize,
    per_client: usize,
    ttl_s: i64,
}

impl Etcd {
    pub fn new(clients: Vec<Client>, count: usize, per_client: usize, ttl_s: i64) -> Self {
        Etcd {
            clients,
            count,
            per_client,
            ttl_s,
        }
    }

    fn key(&self, client: usize, slot: usize) -> Vec<u8> {
        format!(
            "/automaton-bench/tasks/bench-c{}-{}",
            self.count,
            client * self.per_client + slot
        )
        .into_bytes()
    }

    fn client(&self, client: usize) -> &Client {
        &self.clients[client % self.clients.len()]
    }
}

impl Backend for Etcd {
    type Lease = i64;
    type Renewer = EtcdRenewer;

    async fn claim(&self, client: usize, slot: usize) -> Result<i64> {
        let conn = self.client(client);
        let granted: LeaseGrantResponse = conn
            .unary(
                LEASE_GRANT,
                LeaseGrantRequest {
                    ttl: self.ttl_s,
                    id: 0,
                },
            )
            .await?;
        if !granted.error.is_empty() || granted.id == 0 {
            bail!("LeaseGrant: {:?} (lease {})", granted.error, granted.id);
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
        let done = conn.unary::<_, TxnResponse>(TXN, txn).await;
        match done {
            Ok(r) if r.succeeded => Ok(granted.id),
            other => {
                let _ = conn
                    .unary::<_, LeaseRevokeResponse>(
                        LEASE_REVOKE,
                        LeaseRevokeRequest { id: granted.id },
                    )
                    .await;
                match other {
                    Ok(_) => bail!("key already held"),
                    Err(e) => Err(e.context("Txn")),
                }
            }
        }
    }

    async fn release(&self, client: usize, lease: i64) -> Result<()> {
        let _: LeaseRevokeResponse = self
            .client(client)
            .unary(LEASE_REVOKE, LeaseRevokeRequest { id: lease })
            .await?;
        Ok(())
    }

    async fn renewer(&self, client: usize, lease: &i64) -> Result<EtcdRenewer> {
        let request = LeaseKeepAliveRequest { id: *lease };
        // etcd sends the response headers only with the first message: it goes with the call.
        let stream = self
            .client(client)
            .stream(LEASE_KEEP_ALIVE, request)
            .await?;
        let mut r = EtcdRenewer { stream, request };
        r.receive().await?;
        Ok(r)
    }
}

pub struct EtcdRenewer {
    stream: Stream<LeaseKeepAliveRequest, LeaseKeepAliveResponse>,
    request: LeaseKeepAliveRequest,
}

impl EtcdRenewer {
    async fn receive(&mut self) -> Result<()> {
        match self.stream.receive().await? {
            Some(r) if r.ttl > 0 => Ok(()),
            Some(r) => bail!("lease {} lost (TTL {})", r.id, r.ttl),
            None => bail!("etcd closed the LeaseKeepAlive stream"),
        }
    }
}

impl Renewer for EtcdRenewer {
    async fn renew(&mut self) -> Result<()> {
        self.stream.send(self.request).await?;
        self.receive().await
    }
}

/// Waits until etcd answers a read, for at most `limit`.
pub async fn wait_ready(client: &Client, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let r = client
            .unary::<_, RangeResponse>(
                RANGE,
                RangeRequest {
                    key: b"/automaton-bench/ready".to_vec(),
                    ..RangeRequest::default()
                },
            )
            .await;
        match r {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                return Err(e.context("etcd does not answer Range"));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// etcd 3.4 holding leases the way the coordinator in etcd mode keeps them, as data: claim =
/// one put-if-absent `Txn` of the task key (no etcd lease), release = one `Txn` deleting the
/// key if it is still the claim's (its mod revision unchanged). One raft commit per call.
pub struct EtcdTxn {
    clients: Vec<Client>,
    count: usize,
    per_client: usize,
}

impl EtcdTxn {
    pub fn new(clients: Vec<Client>, count: usize, per_client: usize) -> Self {
        EtcdTxn {
            clients,
            count,
            per_client,
        }
    }

    fn key(&self, client: usize, slot: usize) -> Vec<u8> {
        format!(
            "/automaton-bench/txn/bench-c{}-{}",
            self.count,
            client * self.per_client + slot
        )
        .into_bytes()
    }

    fn client(&self, client: usize) -> &Client {
        &self.clients[client % self.clients.len()]
    }
}

/// A key held by an [`EtcdTxn`] claim: the key and the revision that wrote it.
pub struct TxnLease {
    key: Vec<u8>,
    revision: i64,
}

impl Backend for EtcdTxn {
    type Lease = TxnLease;
    type Renewer = NoRenewer;

    async fn claim(&self, client: usize, slot: usize) -> Result<TxnLease> {
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
                    key: key.clone(),
                    value: format!("bench-agent-{client}").into_bytes(),
                    ..PutRequest::default()
                })),
            }],
            failure: Vec::new(),
        };
        let r: TxnResponse = self.client(client).unary(TXN, txn).await?;
        if !r.succeeded {
            bail!("key already held");
        }
        let revision = r.header.map_or(0, |h| h.revision);
        Ok(TxnLease { key, revision })
    }

    async fn release(&self, client: usize, lease: TxnLease) -> Result<()> {
        let txn = TxnRequest {
            compare: vec![Compare {
                result: CompareResult::Equal as i32,
                target: CompareTarget::Mod as i32,
                key: lease.key.clone(),
                range_end: Vec::new(),
                target_union: Some(TargetUnion::ModRevision(lease.revision)),
            }],
            success: vec![RequestOp {
                request: Some(Request::RequestDeleteRange(pb::DeleteRangeRequest {
                    key: lease.key,
                    ..pb::DeleteRangeRequest::default()
                })),
            }],
            failure: Vec::new(),
        };
        let r: TxnResponse = self.client(client).unary(TXN, txn).await?;
        if !r.succeeded {
            bail!("the key is no longer this claim's");
        }
        Ok(())
    }

    async fn renewer(&self, _client: usize, _lease: &TxnLease) -> Result<NoRenewer> {
        bail!("a lease kept as data is renewed by its holder's writes: not measured here")
    }
}

/// [`EtcdTxn`] measures no renewals.
pub struct NoRenewer;

impl Renewer for NoRenewer {
    async fn renew(&mut self) -> Result<()> {
        bail!("not measured")
    }
}
