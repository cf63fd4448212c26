//! Leader election on one etcd key, after client-go's leaderelection and etcd's
//! concurrency.Election (written here, not ported): a candidate holds the key by creating it
//! under its own lease, keeps the lease alive, and knows how long it may believe it leads.
//! It must not stand in for fencing: every write a leader makes must go through
//! [`Leadership::txn`], which etcd applies only while the key is still this candidate's.
//!
//! # Election is not fencing
//!
//! As client-go says of its own: a leader that stalls (a GC pause, a partition, a stopped
//! process) keeps believing it leads until its local deadline, and its writes may still be in
//! flight after another candidate won. The deadline here is conservative (it runs from when a
//! keepalive was *sent*, minus a margin of ttl/6, so it ends before etcd can expire the
//! lease), but only the fence makes a stale write harmless: [`Leadership::txn`] compares the
//! leader key's create_revision with [`Leadership::revision`], which a new leader always
//! changes.
//!
//! # How waiting works
//!
//! A candidate that finds the key held polls it with a read every ttl/6 (no watch): simpler
//! to make robust across endpoint failures, and at most ttl/6 later than a watch. A resigned
//! leader's key goes at once (its lease is revoked), so the next candidate takes over within
//! about ttl/6; a leader that vanished leaves its key until etcd expires its lease (ttl, or a
//! little more across an etcd leader change, which extends leases).
//!
//! # Choosing the TTL
//!
//! While etcd elects a new raft leader (1-2 s after a kill -9 with the default 1 s election
//! timeout) no keepalive can succeed. A leader keeps its leadership through that only when
//! the election ends before its deadline less the margin: up to ttl/3 of the TTL may already
//! be used when etcd's leader dies, so the TTL should be at least twice etcd's election time
//! (5 s or more with etcd's defaults). With 3 s a leader sometimes loses leadership across an
//! etcd leader kill, cleanly: `lost()` resolves and the next candidate wins.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{Instant, sleep_until};

use crate::txn::{Cmp, Compare, Op, OpResponse, Txn, TxnResponse, split_ops};
use crate::{Client, Error};

/// The shortest TTL an election takes (etcd's TTLs are whole seconds; its minimum is 2 s
/// with the default election timeout, which only makes a lease outlive the local deadline).
pub const MIN_TTL: Duration = Duration::from_secs(1);

/// The longest TTL an election takes: a leader that vanished blocks the key this long.
pub const MAX_TTL: Duration = Duration::from_secs(3600);

/// One candidate for leadership of one key.
#[derive(Clone)]
pub struct Election {
    client: Client,
    key: Vec<u8>,
    value: Vec<u8>,
    ttl: Duration,
}

impl Election {
    /// A candidate for `key` (e.g. `/automaton/<project>/leader`) whose `value` (its address)
    /// followers read to find the leader; `ttl` is how long the key outlives a leader that
    /// stopped renewing it (e.g. 3 s).
    pub fn new(
        client: Client,
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
        ttl: Duration,
    ) -> Result<Election, Error> {
        let key: String = key.into();
        if key.is_empty() {
            return Err(Error::Config("the election key is empty: name one".into()));
        }
        if !(MIN_TTL..=MAX_TTL).contains(&ttl) {
            return Err(Error::Config(format!(
                "election TTL {ttl:?} is out of range: give {MIN_TTL:?} to {MAX_TTL:?} (e.g. 3 s)"
            )));
        }
        Ok(Election {
            client,
            key: key.into_bytes(),
            value: value.into(),
            ttl,
        })
    }

    /// The key this election is about.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// Waits until this candidate holds the key. Transient failures (etcd unreachable, no
    /// etcd leader) are waited out; only what waiting cannot fix (configuration, auth) is
    /// returned. Dropping the future gives up; a lease granted just before stays until its
    /// TTL ends.
    pub async fn campaign(&self) -> Result<Leadership, Error> {
        let poll = self.ttl / 6;
        let margin = self.ttl / 6;
        loop {
            // Cheap check first: no lease is granted while someone visibly holds the key.
            match self.client.get(self.key.clone()).await {
                Ok(None) => {}
                Ok(Some(_)) => {
                    tokio::time::sleep(poll).await;
                    continue;
                }
                Err(e) => {
                    wait_out(e, "read the leader key")?;
                    tokio::time::sleep(poll).await;
                    continue;
                }
            }
            let sent = Instant::now();
            let safe_until = sent + self.ttl - margin;
            let lease = match self.client.grant_until(self.ttl, safe_until).await {
                Ok(id) => id,
                Err(e) => {
                    wait_out(e, "grant a lease")?;
                    tokio::time::sleep(poll).await;
                    continue;
                }
            };
            match self.claim(lease, safe_until).await {
                Ok(Some(revision)) if Instant::now() < safe_until => {
                    tracing::info!(key = %String::from_utf8_lossy(&self.key), revision, lease, "etcd election: won");
                    return Ok(Leadership::start(self, lease, revision, sent));
                }
                // Won, but too late to trust the lease's first TTL: give it back and retry.
                Ok(Some(_)) => tracing::warn!("etcd election: the claim took too long; again"),
                Ok(None) => {}
                Err(e) => {
                    if let Err(e) = wait_out(e, "claim the leader key") {
                        self.give_back(lease).await;
                        return Err(e);
                    }
                }
            }
            self.give_back(lease).await;
            tokio::time::sleep(poll).await;
        }
    }

    /// Creates the key under `lease` if it is absent; the key's create_revision if this
    /// candidate now holds it.
    async fn claim(&self, lease: i64, until: Instant) -> Result<Option<i64>, Error> {
        let txn = Txn::new()
            .when([Compare::absent(self.key.clone())])
            .and_then([Op::put_with_lease(
                self.key.clone(),
                self.value.clone(),
                lease,
            )])
            .or_else([Op::get(self.key.clone())]);
        let r = self.client.txn_until(&txn, until).await?;
        if r.succeeded {
            // The put is the transaction's only write: its revision creates the key.
            return Ok(Some(r.revision));
        }
        // Held already, maybe by this very lease: an earlier attempt of this Txn that was
        // applied but whose answer was lost.
        Ok(match r.responses.first() {
            Some(OpResponse::Get(kvs)) => kvs
                .first()
                .filter(|kv| kv.lease == lease)
                .map(|kv| kv.create_revision),
            _ => None,
        })
    }

    async fn give_back(&self, lease: i64) {
        let until = Instant::now() + self.client.timeout();
        if let Err(e) = self.client.revoke_until(lease, until).await {
            // It expires on its own within the TTL.
            tracing::debug!(lease, error = %e, "etcd election: could not revoke an unused lease");
        }
    }

    /// Who leads now: the leader's value and its revision, or `None` when nobody does.
    pub async fn leader(&self) -> Result<Option<(Vec<u8>, i64)>, Error> {
        leader(&self.client, &self.key).await
    }
}

/// Who holds the leader `key`: its value (the leader's address) and create_revision (its
/// fencing revision), or `None` when nobody does.
pub async fn leader(
    client: &Client,
    key: impl AsRef<[u8]>,
) -> Result<Option<(Vec<u8>, i64)>, Error> {
    let kv = client.get(key.as_ref().to_vec()).await?;
    Ok(kv.map(|kv| (kv.value, kv.create_revision)))
}

/// Ok for what a campaign waits out (etcd down or leaderless, or an answer that the next try
/// changes, such as a lease that expired before the claim); the error otherwise.
fn wait_out(e: Error, doing: &str) -> Result<(), Error> {
    match e {
        Error::Unavailable(_) | Error::Etcd(_) => {
            tracing::warn!(error = %e, "etcd election: could not {doing}; trying again");
            Ok(())
        }
        other => Err(other),
    }
}

/// Holding the leader key: a keepalive task renews its lease every ttl/3 and watches for
/// signs it is gone. Dropping it stops the keepalive without waiting (the key then stays
/// until its lease expires); [`Leadership::resign`] hands over at once.
pub struct Leadership {
    shared: Arc<Shared>,
    task: JoinHandle<()>,
}

struct Shared {
    client: Client,
    key: Vec<u8>,
    revision: i64,
    lease: i64,
    ttl: Duration,
    margin: Duration,
    /// The lease's expiry as this process can be sure of: last keepalive sent + ttl.
    deadline: Mutex<Instant>,
    /// `Some(reason)` once leadership is lost; never back to `None`.
    lost: watch::Sender<Option<String>>,
}

impl Shared {
    fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Until when this process may believe it leads: the deadline less the margin.
    fn safe_until(&self) -> Instant {
        let deadline = self.deadline();
        deadline.checked_sub(self.margin).unwrap_or(deadline)
    }

    fn lose(&self, reason: String) {
        let first = self.lost.send_if_modified(|lost| {
            if lost.is_some() {
                return false;
            }
            *lost = Some(reason.clone());
            true
        });
        if first {
            tracing::warn!(key = %String::from_utf8_lossy(&self.key), revision = self.revision, %reason, "etcd election: leadership lost");
        }
    }

    fn lost_reason(&self) -> Option<String> {
        self.lost.borrow().clone()
    }
}

impl Leadership {
    fn start(election: &Election, lease: i64, revision: i64, sent: Instant) -> Leadership {
        let (lost, _) = watch::channel(None);
        let shared = Arc::new(Shared {
            client: election.client.clone(),
            key: election.key.clone(),
            revision,
            lease,
            ttl: election.ttl,
            margin: election.ttl / 6,
            deadline: Mutex::new(sent + election.ttl),
            lost,
        });
        let task = tokio::spawn(keep(shared.clone(), sent));
        Leadership { shared, task }
    }

    /// The leader key's create_revision: the fencing value. A later leader's is larger.
    pub fn revision(&self) -> i64 {
        self.shared.revision
    }

    pub fn lease_id(&self) -> i64 {
        self.shared.lease
    }

    pub fn key(&self) -> &[u8] {
        &self.shared.key
    }

    /// When the lease could expire at the earliest, as last renewed (sent + ttl).
    pub fn deadline(&self) -> std::time::Instant {
        self.shared.deadline().into_std()
    }

    /// Whether this process may still believe it leads: not lost, and the deadline less the
    /// margin not passed. A belief, not a guarantee: write through [`Leadership::txn`].
    pub fn is_leader(&self) -> bool {
        self.shared.lost_reason().is_none() && Instant::now() < self.shared.safe_until()
    }

    /// Resolves, with the reason, once leadership is lost: no keepalive succeeded before the
    /// deadline less the margin, etcd said the lease is gone, the key is gone or someone
    /// else's, a fenced write found it so, or it was resigned or dropped.
    pub async fn lost(&self) -> String {
        let mut rx = self.shared.lost.subscribe();
        match rx.wait_for(Option::is_some).await {
            Ok(reason) => reason.clone().unwrap_or_default(),
            Err(_) => "the election stopped".to_string(),
        }
    }

    /// Gives leadership up: stops the keepalive and revokes the lease, which deletes the key
    /// so the next candidate takes over within its poll interval.
    pub async fn resign(&self) -> Result<(), Error> {
        self.task.abort();
        self.shared.lose("resigned".into());
        self.shared.client.revoke(self.shared.lease).await
    }

    /// Runs `txn` only while this candidate still holds the leader key (its compares get
    /// `create_revision(key) == revision()`). Fails with [`Error::Deposed`], marking the
    /// leadership lost, when the key is gone or someone else's, or when leadership was already
    /// lost. A failed compare of the caller's own returns `succeeded == false` as usual.
    /// A retried attempt may have been applied before a `Deposed` (see the client's docs).
    pub async fn txn(&self, txn: Txn) -> Result<TxnResponse, Error> {
        if let Some(reason) = self.shared.lost_reason() {
            return Err(Error::Deposed(format!(
                "leadership of {} lost earlier ({reason}): nothing written; campaign again",
                self.key_name()
            )));
        }
        let mut txn = txn.when([Compare::create_revision(
            self.shared.key.clone(),
            Cmp::Equal,
            self.shared.revision,
        )]);
        // Read the leader key when the compares fail, to tell a deposed leader from a failed
        // compare of the caller's.
        txn.failure.insert(0, Op::get(self.shared.key.clone()));
        let mut r = self.shared.client.txn(&txn).await?;
        if r.succeeded {
            return Ok(r);
        }
        let holder = if r.responses.is_empty() {
            OpResponse::Unknown
        } else {
            r.responses.remove(0)
        };
        let now = match holder {
            OpResponse::Get(kvs) => kvs.first().map(|kv| kv.create_revision),
            // Not what was asked for: count it as deposed rather than guess.
            _ => Some(-1),
        };
        if now != Some(self.shared.revision) {
            let held = match now {
                None => "the key is absent".to_string(),
                Some(rev) => format!("the key was created at revision {rev}"),
            };
            let reason = format!(
                "leadership of {} (revision {}) is gone: {held}; nothing written, campaign again",
                self.key_name(),
                self.shared.revision
            );
            self.shared.lose(reason.clone());
            return Err(Error::Deposed(reason));
        }
        Ok(r)
    }

    /// Runs `ops` as fenced transactions of at most [`crate::MAX_TXN_OPS`] operations each
    /// (see [`crate::split_ops`]). Not atomic as a whole: at `Deposed` the chunks before
    /// stay applied and the rest are not run.
    pub async fn txn_in_batches(&self, ops: Vec<Op>) -> Result<Vec<TxnResponse>, Error> {
        let mut out = Vec::new();
        for chunk in split_ops(ops) {
            out.push(self.txn(Txn::new().and_then(chunk)).await?);
        }
        Ok(out)
    }

    /// The leader key, for messages.
    pub fn key_name(&self) -> String {
        String::from_utf8_lossy(&self.shared.key).into_owned()
    }
}

impl Drop for Leadership {
    fn drop(&mut self) {
        // Abort does not wait: dropping never blocks. The lease expires on its own.
        self.task.abort();
        self.shared.lose("dropped".into());
    }
}

/// The keepalive task: renews every ttl/3 from `sent` (when the lease was granted) and stops
/// at the first sign the leadership is lost, then revokes the lease (best effort).
async fn keep(shared: Arc<Shared>, sent: Instant) {
    let period = shared.ttl / 3;
    let mut next = sent + period;
    let mut lost = shared.lost.subscribe();
    loop {
        let safe = shared.safe_until();
        tokio::select! {
            _ = sleep_until(next.min(safe)) => {}
            // Lost elsewhere (a fenced write, resign): stop renewing.
            _ = lost.wait_for(Option::is_some) => break,
        }
        if Instant::now() >= safe {
            shared.lose(format!(
                "no keepalive of lease {} succeeded in time (lease may expire at {:?} from now)",
                shared.lease,
                shared.deadline().saturating_duration_since(Instant::now())
            ));
            break;
        }
        let sent = Instant::now();
        match shared.client.keep_alive_until(shared.lease, safe).await {
            Ok(ttl) if ttl > 0 => {
                let granted = Duration::from_secs(u64::try_from(ttl).unwrap_or(0));
                *shared
                    .deadline
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner) = sent + shared.ttl.min(granted);
                next = sent + period;
            }
            Ok(ttl) => {
                shared.lose(format!(
                    "etcd says lease {} is gone (TTL {ttl}): it expired",
                    shared.lease
                ));
                break;
            }
            Err(e) => {
                tracing::warn!(lease = shared.lease, error = %e, "etcd election: keepalive failed");
                // Try again soon; the deadline check above ends it in time.
                next = Instant::now() + period / 4;
                continue;
            }
        }
        // Someone may have deleted the key (or the lease lost it): check it is still ours.
        match shared
            .client
            .get_until(&shared.key, shared.safe_until())
            .await
        {
            Ok(Some(kv)) if kv.create_revision == shared.revision => {}
            Ok(Some(kv)) => {
                shared.lose(format!(
                    "the leader key is someone else's now (created at revision {}, not {})",
                    kv.create_revision, shared.revision
                ));
                break;
            }
            Ok(None) => {
                shared.lose("the leader key is gone".into());
                break;
            }
            // The next keepalive decides.
            Err(e) => tracing::debug!(error = %e, "etcd election: could not check the leader key"),
        }
    }
    // The lease holds nothing this process trusts any more: let the next candidate in at once.
    let until = Instant::now() + shared.client.timeout();
    if let Err(e) = shared.client.revoke_until(shared.lease, until).await {
        tracing::debug!(lease = shared.lease, error = %e, "etcd election: could not revoke the lost lease");
    }
}
