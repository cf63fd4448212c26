//! The connection to an etcd cluster: one lazy tonic channel per endpoint, the auth token, and
//! the one retry loop every call goes through (a timeout per attempt, round-robin across
//! endpoints from the last one that answered, a short pause after each full round), with the
//! KV, lease and maintenance calls on top. It must not know about elections (`election.rs`)
//! and must not retry an answer that another attempt cannot change.
//!
//! Retried writes: like etcd's own client, a write whose attempt timed out or lost its
//! connection may have been applied before it is sent again; puts and deletes are idempotent
//! in what they leave, and a transaction's compares decide its second run.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prost::Message;
use tokio::time::Instant;
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Response, Status};

use crate::config::{Config, endpoint_scheme};
use crate::error::{Verdict, classify};
use crate::pb;
use crate::pb::auth_client::AuthClient;
use crate::pb::kv_client::KvClient;
use crate::pb::lease_client::LeaseClient;
use crate::pb::maintenance_client::MaintenanceClient;
use crate::txn::{Compare, KeyValue, Op, Txn, TxnResponse, prefix_end, split_ops};
use crate::{Error, MAX_TXN_OPS};

/// Keys per page of [`Client::range_prefix`]: pages stay far below the decode limit even with
/// large values, and a huge prefix is read in many small answers.
const PAGE: i64 = 256;

/// The largest answer accepted (tonic's default is 4 MiB; a page of large values can be more).
const MAX_DECODE: usize = 512 * 1024 * 1024;

/// The first pause after a full round of endpoints failed, doubled up to [`MAX_PAUSE`]: no
/// hot loop while the cluster elects a leader or every endpoint refuses connections.
const FIRST_PAUSE: Duration = Duration::from_millis(50);
const MAX_PAUSE: Duration = Duration::from_millis(500);

/// How many times one call authenticates again after etcd called its token invalid.
const MAX_REAUTH: u32 = 2;

/// A handle on an etcd cluster; cheap to clone (clones share connections and the token).
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    members: Vec<Member>,
    /// The index of the endpoint that answered last: where the next call starts.
    next: AtomicUsize,
    timeout: Duration,
    budget: Duration,
    user: Option<(String, String)>,
    token: Mutex<Token>,
    /// What to check when no endpoint answers (it depends on TLS).
    advice: &'static str,
}

struct Member {
    url: String,
    channel: Channel,
}

#[derive(Clone)]
enum Token {
    /// Not asked for yet, or etcd said the last one is invalid.
    Unknown,
    /// etcd has authentication off: calls go without a token.
    NotNeeded,
    Known(AsciiMetadataValue),
}

/// Which endpoints a call may use and until when.
#[derive(Clone, Copy)]
struct Route {
    /// Only this endpoint (a status check of one member); else any, round-robin.
    only: Option<usize>,
    until: Instant,
}

/// One etcd member's view of the cluster, from `Maintenance.Status`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberStatus {
    /// The endpoint asked.
    pub endpoint: String,
    pub member_id: u64,
    /// The member id of the raft leader as this member knows it; 0 when it knows none.
    pub leader: u64,
    pub raft_term: u64,
    pub raft_index: u64,
    /// The backend database's size in bytes.
    pub db_size: i64,
    pub version: String,
    pub is_learner: bool,
    /// Alarms and other errors the member reports.
    pub errors: Vec<String>,
}

impl MemberStatus {
    /// Whether this member is the raft leader.
    pub fn is_leader(&self) -> bool {
        self.member_id != 0 && self.member_id == self.leader
    }
}

impl Client {
    /// Opens a client on `cfg`'s endpoints. Nothing connects yet (each channel connects on
    /// first use), so this works while etcd is down; call it inside a Tokio runtime.
    pub fn connect(cfg: Config) -> Result<Client, Error> {
        cfg.validate()?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::Config(
                "Client::connect needs a Tokio runtime: call it from async code".into(),
            ));
        }
        let tls = cfg.tls.as_ref().map(tls_config).transpose()?;
        let mut members = Vec::with_capacity(cfg.endpoints.len());
        for url in &cfg.endpoints {
            let url = url.trim_end_matches('/').to_string();
            let mut endpoint = Endpoint::from_shared(url.clone())
                .map_err(|e| Error::Config(format!("endpoint {url:?}: {e}")))?
                .connect_timeout(cfg.timeout)
                .tcp_nodelay(true);
            if let (Some(tls), "https") = (&tls, endpoint_scheme(&url)?) {
                endpoint = endpoint.tls_config(tls.clone()).map_err(|e| {
                    Error::Config(format!("endpoint {url:?}: TLS configuration: {e}"))
                })?;
            }
            let channel = endpoint.connect_lazy();
            members.push(Member { url, channel });
        }
        let advice = match &cfg.tls {
            None => ADVICE,
            Some(t) if t.cert.is_none() => ADVICE_TLS,
            Some(_) => ADVICE_MUTUAL_TLS,
        };
        Ok(Client {
            inner: Arc::new(Inner {
                members,
                next: AtomicUsize::new(0),
                advice,
                timeout: cfg.timeout,
                budget: cfg.retry_budget(),
                user: cfg.user,
                token: Mutex::new(Token::Unknown),
            }),
        })
    }

    /// The configured endpoints, as given (without a trailing `/`).
    pub fn endpoints(&self) -> Vec<String> {
        self.inner.members.iter().map(|m| m.url.clone()).collect()
    }

    /// The per-attempt timeout.
    pub fn timeout(&self) -> Duration {
        self.inner.timeout
    }

    fn route(&self) -> Route {
        Route {
            only: None,
            until: Instant::now() + self.inner.budget,
        }
    }

    /// The one retry loop. `f` makes one attempt on a channel with a prepared request.
    async fn call<Q, R, F, Fut>(
        &self,
        what: &str,
        request: Q,
        route: Route,
        f: F,
    ) -> Result<R, Error>
    where
        Q: Message + Clone,
        F: Fn(Channel, Request<Q>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        let inner = &self.inner;
        let n = inner.members.len();
        let first = route
            .only
            .unwrap_or_else(|| inner.next.load(Ordering::Relaxed) % n.max(1));
        let started = Instant::now();
        let mut failures: Vec<String> = Vec::new();
        let mut pause = FIRST_PAUSE;
        let mut attempt = 0usize;
        let mut reauths = 0;
        loop {
            let index = match route.only {
                Some(i) => i,
                None => (first + attempt) % n,
            };
            let Some(member) = inner.members.get(index) else {
                return Err(Error::Config(format!("{what}: no endpoint number {index}")));
            };
            let now = Instant::now();
            let left = route.until.saturating_duration_since(now);
            if left < Duration::from_millis(1) {
                return Err(unavailable(what, started, &failures, inner.advice));
            }
            let per = inner.timeout.min(left);
            let one = async {
                let token = self.token(member, per).await?;
                let mut req = Request::new(request.clone());
                req.set_timeout(per);
                if let Some(token) = token {
                    req.metadata_mut().insert("token", token);
                }
                f(member.channel.clone(), req).await
            };
            let failure = match tokio::time::timeout(per, one).await {
                Ok(Ok(response)) => {
                    if route.only.is_none() {
                        inner.next.store(index, Ordering::Relaxed);
                    }
                    return Ok(response.into_inner());
                }
                Ok(Err(status)) => match classify(what, request.encoded_len(), &status) {
                    Verdict::Fail(e) => return Err(e),
                    Verdict::Reauthenticate(why)
                        if inner.user.is_some() && reauths < MAX_REAUTH =>
                    {
                        // Expired or missing token: ask for a new one on the same endpoint.
                        reauths += 1;
                        tracing::debug!(endpoint = %member.url, %why, "etcd: authenticating again");
                        *lock(&inner.token) = Token::Unknown;
                        continue;
                    }
                    Verdict::Reauthenticate(why) if inner.user.is_none() => {
                        return Err(Error::Auth(format!(
                            "{what}: {why}; etcd has authentication on: configure a user and password"
                        )));
                    }
                    Verdict::Reauthenticate(why) => {
                        return Err(Error::Auth(format!(
                            "{what}: {why}, even with a fresh token; check the user's roles and etcd's auth settings"
                        )));
                    }
                    Verdict::Retry(why) => why,
                },
                Err(_) => format!("no answer within {per:?}"),
            };
            tracing::debug!(endpoint = %member.url, what, failure = %failure, "etcd: attempt failed");
            failures.push(format!("{}: {failure}", member.url));
            attempt += 1;
            // After a full round (or each attempt on one endpoint), pause before the next.
            if route.only.is_some() || attempt.is_multiple_of(n) {
                let left = route.until.saturating_duration_since(Instant::now());
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(MAX_PAUSE);
            }
        }
    }

    /// The token to send on `member`, authenticating there first when there is none yet.
    async fn token(
        &self,
        member: &Member,
        per: Duration,
    ) -> Result<Option<AsciiMetadataValue>, Status> {
        let Some((name, password)) = &self.inner.user else {
            return Ok(None);
        };
        match lock(&self.inner.token).clone() {
            Token::Known(t) => return Ok(Some(t)),
            Token::NotNeeded => return Ok(None),
            Token::Unknown => {}
        }
        let mut req = Request::new(pb::AuthenticateRequest {
            name: name.clone(),
            password: password.clone(),
        });
        req.set_timeout(per);
        let answer = AuthClient::new(member.channel.clone())
            .authenticate(req)
            .await;
        let token = match answer {
            Ok(r) => {
                let token = MetadataValue::try_from(r.into_inner().token).map_err(|_| {
                    Status::unauthenticated("etcd returned a token that is not ASCII")
                })?;
                Token::Known(token)
            }
            Err(s) if s.message().contains("authentication is not enabled") => {
                tracing::warn!("etcd has authentication off: the configured user is not used");
                Token::NotNeeded
            }
            Err(s) => return Err(s),
        };
        *lock(&self.inner.token) = token.clone();
        Ok(match token {
            Token::Known(t) => Some(t),
            _ => None,
        })
    }

    // ---- KV ----

    /// The key's value, or `None` when it is absent.
    pub async fn get(&self, key: impl Into<Vec<u8>>) -> Result<Option<KeyValue>, Error> {
        let request = pb::RangeRequest {
            key: key.into(),
            ..Default::default()
        };
        let r = self.range(request).await?;
        Ok(r.kvs.into_iter().next().map(KeyValue::from))
    }

    async fn range(&self, request: pb::RangeRequest) -> Result<pb::RangeResponse, Error> {
        self.call("Range", request, self.route(), |ch, r| async move {
            kv(ch).range(r).await
        })
        .await
    }

    /// Every key starting with `prefix`, in key order, read in pages of a few hundred keys
    /// at one revision (so the result is one consistent snapshot however large).
    pub async fn range_prefix(&self, prefix: impl Into<Vec<u8>>) -> Result<Vec<KeyValue>, Error> {
        let prefix = prefix.into();
        let mut tries = 0;
        loop {
            match self.range_pages(&prefix).await {
                // A compaction between two pages: start again at the new revision.
                Err(Error::Compacted(_)) if tries < 3 => tries += 1,
                other => return other,
            }
        }
    }

    async fn range_pages(&self, prefix: &[u8]) -> Result<Vec<KeyValue>, Error> {
        let end = prefix_end(prefix);
        let mut out = Vec::new();
        let mut from = prefix.to_vec();
        let mut revision = 0;
        loop {
            let r = self
                .range(pb::RangeRequest {
                    key: from.clone(),
                    range_end: end.clone(),
                    limit: PAGE,
                    revision,
                    ..Default::default()
                })
                .await?;
            if revision == 0 {
                revision = r.header.as_ref().map_or(0, |h| h.revision);
            }
            let more = r.more;
            out.extend(r.kvs.into_iter().map(KeyValue::from));
            match out.last() {
                Some(last) if more => {
                    // The next page starts just after the last key read.
                    from = last.key.clone();
                    from.push(0);
                }
                _ => return Ok(out),
            }
        }
    }

    /// Puts `value` at `key`, attached to `lease` if given; returns the put's revision.
    pub async fn put(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: Option<i64>,
    ) -> Result<i64, Error> {
        let request = pb::PutRequest {
            key: key.into(),
            value: value.into(),
            lease: lease.unwrap_or(0),
            ..Default::default()
        };
        let r = self
            .call("Put", request, self.route(), |ch, r| async move {
                kv(ch).put(r).await
            })
            .await?;
        Ok(r.header.map_or(0, |h| h.revision))
    }

    /// Deletes `key`; returns how many keys went (0 or 1).
    pub async fn delete(&self, key: impl Into<Vec<u8>>) -> Result<i64, Error> {
        self.delete_range(key.into(), Vec::new()).await
    }

    /// Deletes every key starting with `prefix`; returns how many went.
    pub async fn delete_prefix(&self, prefix: impl Into<Vec<u8>>) -> Result<i64, Error> {
        let prefix = prefix.into();
        let end = prefix_end(&prefix);
        self.delete_range(prefix, end).await
    }

    async fn delete_range(&self, key: Vec<u8>, range_end: Vec<u8>) -> Result<i64, Error> {
        let request = pb::DeleteRangeRequest {
            key,
            range_end,
            ..Default::default()
        };
        let r = self
            .call("DeleteRange", request, self.route(), |ch, r| async move {
                kv(ch).delete_range(r).await
            })
            .await?;
        Ok(r.deleted)
    }

    /// Runs one transaction.
    pub async fn txn(&self, txn: &Txn) -> Result<TxnResponse, Error> {
        self.txn_until(txn, self.route().until).await
    }

    /// [`Client::txn`] giving up at `until`.
    pub(crate) async fn txn_until(&self, txn: &Txn, until: Instant) -> Result<TxnResponse, Error> {
        let route = Route { only: None, until };
        let r = self
            .call("Txn", txn.to_pb(), route, |ch, r| async move {
                kv(ch).txn(r).await
            })
            .await?;
        Ok(r.into())
    }

    /// Runs `ops` as consecutive transactions of at most [`MAX_TXN_OPS`] operations (and about
    /// 1 MiB) each, every one guarded by `compares`. Not atomic as a whole: it stops at the
    /// first transaction whose compares fail (its answer, `succeeded == false`, is the last
    /// one returned) and the ones before it stay applied.
    pub async fn txn_in_batches(
        &self,
        compares: &[Compare],
        ops: Vec<Op>,
    ) -> Result<Vec<TxnResponse>, Error> {
        if compares.len() > MAX_TXN_OPS {
            return Err(Error::Config(format!(
                "{} compares in one transaction: etcd takes at most {MAX_TXN_OPS} here",
                compares.len()
            )));
        }
        let mut out = Vec::new();
        for chunk in split_ops(ops) {
            let txn = Txn::new().when(compares.iter().cloned()).and_then(chunk);
            let r = self.txn(&txn).await?;
            let succeeded = r.succeeded;
            out.push(r);
            if !succeeded {
                break;
            }
        }
        Ok(out)
    }

    /// Compacts the key-value history up to `revision` (older revisions can no longer be read).
    pub async fn compact(&self, revision: i64) -> Result<(), Error> {
        let request = pb::CompactionRequest {
            revision,
            physical: false,
        };
        self.call("Compact", request, self.route(), |ch, r| async move {
            kv(ch).compact(r).await
        })
        .await?;
        Ok(())
    }

    // ---- Leases ----

    /// Grants a lease of `ttl` (rounded up to whole seconds, at least 1; etcd may grant more:
    /// its minimum is 1.5 election timeouts); returns its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, Error> {
        self.grant_until(ttl, self.route().until).await
    }

    /// [`Client::grant`] giving up at `until`.
    pub(crate) async fn grant_until(&self, ttl: Duration, until: Instant) -> Result<i64, Error> {
        let route = Route { only: None, until };
        let request = pb::LeaseGrantRequest {
            ttl: ttl_seconds(ttl),
            id: 0,
        };
        let r = self
            .call("LeaseGrant", request, route, |ch, r| async move {
                lease(ch).lease_grant(r).await
            })
            .await?;
        if !r.error.is_empty() || r.id == 0 {
            return Err(Error::Etcd(format!(
                "LeaseGrant: etcd granted no lease ({:?})",
                r.error
            )));
        }
        Ok(r.id)
    }

    /// Revokes the lease, deleting every key attached to it. A lease already gone is fine.
    pub async fn revoke(&self, id: i64) -> Result<(), Error> {
        self.revoke_until(id, self.route().until).await
    }

    /// [`Client::revoke`] giving up at `until`.
    pub(crate) async fn revoke_until(&self, id: i64, until: Instant) -> Result<(), Error> {
        let route = Route { only: None, until };
        let request = pb::LeaseRevokeRequest { id };
        let r = self
            .call("LeaseRevoke", request, route, |ch, r| async move {
                lease(ch).lease_revoke(r).await
            })
            .await;
        match r {
            Ok(_) => Ok(()),
            Err(Error::Etcd(m)) if m.contains("lease not found") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Renews the lease once; returns its TTL in seconds, 0 or less when it is gone.
    pub async fn keep_alive_once(&self, id: i64) -> Result<i64, Error> {
        self.keep_alive_until(id, self.route().until).await
    }

    /// [`Client::keep_alive_once`] giving up at `until`.
    pub(crate) async fn keep_alive_until(&self, id: i64, until: Instant) -> Result<i64, Error> {
        let route = Route { only: None, until };
        let request = pb::LeaseKeepAliveRequest { id };
        // One request per stream: the stream ends after etcd's one answer, so a retry can
        // open the next one on any endpoint (a keepalive every second costs one HTTP/2 stream).
        let r = self
            .call("LeaseKeepAlive", request, route, |ch, r| async move {
                let (metadata, extensions, message) = r.into_parts();
                let stream = Request::from_parts(metadata, extensions, tokio_stream::once(message));
                let mut answers = lease(ch).lease_keep_alive(stream).await?.into_inner();
                match answers.message().await? {
                    Some(m) => Ok(Response::new(m)),
                    None => Err(Status::unavailable(
                        "etcd closed the keepalive stream without an answer",
                    )),
                }
            })
            .await?;
        Ok(r.ttl)
    }

    /// The lease's remaining TTL, or `None` when it is gone.
    pub async fn time_to_live(&self, id: i64) -> Result<Option<Duration>, Error> {
        let request = pb::LeaseTimeToLiveRequest { id, keys: false };
        let r = self
            .call(
                "LeaseTimeToLive",
                request,
                self.route(),
                |ch, r| async move { lease(ch).lease_time_to_live(r).await },
            )
            .await?;
        Ok(u64::try_from(r.ttl).ok().map(Duration::from_secs))
    }

    // ---- Maintenance ----

    /// Asks the member at `endpoint` (one of the configured ones) for its status, one attempt
    /// within the timeout.
    pub async fn status(&self, endpoint: &str) -> Result<MemberStatus, Error> {
        let wanted = endpoint.trim_end_matches('/');
        let Some(index) = self.inner.members.iter().position(|m| m.url == wanted) else {
            return Err(Error::Config(format!(
                "status: {endpoint:?} is not one of the endpoints {:?}",
                self.endpoints()
            )));
        };
        let route = Route {
            only: Some(index),
            until: Instant::now() + self.inner.timeout,
        };
        let r = self
            .call("Status", pb::StatusRequest {}, route, |ch, r| async move {
                MaintenanceClient::new(ch).status(r).await
            })
            .await?;
        Ok(MemberStatus {
            endpoint: wanted.to_string(),
            member_id: r.header.as_ref().map_or(0, |h| h.member_id),
            leader: r.leader,
            raft_term: r.raft_term,
            raft_index: r.raft_index,
            db_size: r.db_size,
            version: r.version,
            is_learner: r.is_learner,
            errors: r.errors,
        })
    }

    /// Every configured endpoint's status (asked at once), in the order configured.
    pub async fn members_status(&self) -> Vec<(String, Result<MemberStatus, Error>)> {
        let mut tasks = tokio::task::JoinSet::new();
        for (i, url) in self.endpoints().into_iter().enumerate() {
            let client = self.clone();
            tasks.spawn(async move {
                let status = client.status(&url).await;
                (i, url, status)
            });
        }
        let mut out = Vec::new();
        while let Some(done) = tasks.join_next().await {
            if let Ok(one) = done {
                out.push(one);
            }
        }
        out.sort_by_key(|(i, _, _)| *i);
        out.into_iter().map(|(_, url, s)| (url, s)).collect()
    }

    /// The endpoint of the member that is the raft leader now.
    pub async fn leader_endpoint(&self) -> Result<String, Error> {
        let all = self.members_status().await;
        let mut seen = Vec::new();
        for (url, status) in all {
            match status {
                Ok(s) if s.is_leader() => return Ok(url),
                Ok(s) => seen.push(format!("{url}: follower of {:x}", s.leader)),
                Err(e) => seen.push(format!("{url}: {e}")),
            }
        }
        Err(Error::Unavailable(format!(
            "no endpoint is the etcd leader ({}); the cluster may be electing one, ask again",
            seen.join("; ")
        )))
    }

    /// [`Client::get`] giving up at `until` (the election bounds its calls by its lease).
    pub(crate) async fn get_until(
        &self,
        key: &[u8],
        until: Instant,
    ) -> Result<Option<KeyValue>, Error> {
        let request = pb::RangeRequest {
            key: key.to_vec(),
            ..Default::default()
        };
        let route = Route { only: None, until };
        let r = self
            .call("Range", request, route, |ch, r| async move {
                kv(ch).range(r).await
            })
            .await?;
        Ok(r.kvs.into_iter().next().map(KeyValue::from))
    }
}

fn kv(ch: Channel) -> KvClient<Channel> {
    KvClient::new(ch).max_decoding_message_size(MAX_DECODE)
}

fn lease(ch: Channel) -> LeaseClient<Channel> {
    LeaseClient::new(ch)
}

/// Whole seconds, rounded up, at least 1 (etcd's TTLs are seconds).
pub(crate) fn ttl_seconds(ttl: Duration) -> i64 {
    let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The token is plain data: a panic elsewhere while holding it leaves nothing half-done.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What to check when no endpoint answered.
const ADVICE: &str = "check that etcd is running, reachable and has a leader";
const ADVICE_TLS: &str = "check that etcd is running, reachable and has a leader, that tls.ca signed its certificate, and — if etcd requires client certificates (--client-cert-auth) — give tls.cert and tls.key";
const ADVICE_MUTUAL_TLS: &str = "check that etcd is running, reachable and has a leader, that tls.ca signed its certificate, and that etcd trusts tls.cert";

fn unavailable(what: &str, started: Instant, failures: &[String], advice: &str) -> Error {
    // The last failure per endpoint is enough to say what happened.
    let mut last: Vec<&str> = Vec::new();
    for f in failures.iter().rev() {
        let url = f.split(": ").next().unwrap_or_default();
        if !last.iter().any(|l| l.starts_with(url)) {
            last.push(f);
        }
    }
    last.reverse();
    let tried = if last.is_empty() {
        "no attempt fit in the time left".to_string()
    } else {
        last.join("; ")
    };
    Error::Unavailable(format!(
        "{what}: no etcd endpoint answered in {:.1?} ({tried}); {advice}",
        started.elapsed()
    ))
}

fn tls_config(tls: &crate::TlsConfig) -> Result<ClientTlsConfig, Error> {
    let read = |path: &std::path::Path, what: &str| {
        std::fs::read(path).map_err(|e| {
            Error::Config(format!(
                "cannot read the TLS {what} {}: {e}",
                path.display()
            ))
        })
    };
    let mut config =
        ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&tls.ca, "CA")?));
    if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
        config = config.identity(Identity::from_pem(
            read(cert, "certificate")?,
            read(key, "key")?,
        ));
    }
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(ttl_seconds(Duration::from_millis(2500)), 3);
        assert_eq!(ttl_seconds(Duration::from_secs(3)), 3);
        assert_eq!(ttl_seconds(Duration::ZERO), 1);
    }

    #[test]
    fn unavailable_names_each_endpoint_once_with_its_last_failure() {
        let failures = [
            "http://a:1: refused".to_string(),
            "http://b:2: no leader".to_string(),
            "http://a:1: timed out".to_string(),
        ];
        let e = unavailable("Put", Instant::now(), &failures, ADVICE).to_string();
        assert!(
            e.contains("http://b:2: no leader; http://a:1: timed out"),
            "{e}"
        );
        assert!(!e.contains("refused"), "{e}");
    }

    #[tokio::test]
    async fn a_call_with_every_endpoint_down_gives_up_in_its_budget_naming_them() {
        let mut cfg = Config::new(["http://127.0.0.1:1", "http://127.0.0.1:2"]);
        cfg.timeout = Duration::from_millis(200);
        let client = Client::connect(cfg).expect("valid");
        let started = std::time::Instant::now();
        let e = client.get("k").await.expect_err("nothing listens");
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "{:?}",
            started.elapsed()
        );
        let e = e.to_string();
        assert!(
            e.contains("127.0.0.1:1") && e.contains("127.0.0.1:2"),
            "{e}"
        );
    }
}
