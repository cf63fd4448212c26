//! The etcd backend: a coordinator's lease records and task files as keys under its
//! project's prefix in etcd, every write a transaction fenced by the writer's leadership
//! (`automaton_etcd::Leadership::txn`: the leader key's create revision must still be its
//! own). A deposed leader — stopped, partitioned, slow — writes nothing: its first write
//! fails, the log stops for good, and the coordinator stops serving.
//!
//! Keys, under `{prefix}` (`/automaton/{project}/`):
//! - `leases/{lease_id}`: a live grant, as its record's line (an end deletes it);
//! - `holders/{task}/{agent}/{state}`: a holder not yet in its task's files;
//! - `mark`: every token up to it may have been issued;
//! - `files/{path}`: a file of the task store ([`Replica`]), at most [`MAX_FILE_BYTES`];
//! - `seeded`: the files were seeded from a first leader's local store.
//!
//! One writer task takes lease records and file writes in the order they were queued and
//! commits whatever waits as one batch of transactions of at most 127 operations (etcd's
//! `--max-txn-ops` is 128): the same group commit as the files backend's `fdatasync`. An
//! etcd member lost or an election under way is waited out while the leadership lasts
//! (a retried batch re-applies the same puts and deletes in the same order: the end state is
//! the same). It must not decide anything about leases: replay is [`crate::replay`]'s.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use automaton_etcd::{Client, Leadership, Op};
use automaton_store::Replica;
use tokio::sync::{mpsc, oneshot, watch};

use crate::{Backend, BoxFuture, Commit, Grant, LeaseLog, Record};

/// The largest file the etcd backend holds: etcd refuses requests over 1.5 MiB by default
/// (`--max-request-bytes`), and a transaction carries a file whole.
pub const MAX_FILE_BYTES: usize = 1 << 20;

/// Grants written since the last rewrite before one is wanted (a rewrite also clears keys a
/// log written by an older version left behind).
const REWRITE_AFTER_GRANTS: u64 = 100_000;

/// How often the leader compacts etcd's history, to the revision it saw one period ago
/// (etcd's own periodic auto-compaction does the same): without compaction a churn of a
/// million keys takes etcd down to ~100 writes/s.
const COMPACT_EVERY: Duration = Duration::from_secs(60);

/// Records and file writes waiting for the writer.
enum Job {
    Ops {
        ops: Vec<Op>,
        done: Option<Done>,
    },
    /// Replace the lease and holder keys with exactly these records.
    Rewrite {
        live: Vec<Record>,
        done: Done,
    },
}

/// Who waits for a job: the engine's [`Commit`], or a store change on a blocking thread.
enum Done {
    Async(oneshot::Sender<Result<(), String>>),
    Sync(std::sync::mpsc::SyncSender<Result<(), String>>),
}

impl Done {
    fn send(self, r: Result<(), String>) {
        match self {
            Done::Async(tx) => drop(tx.send(r)),
            Done::Sync(tx) => drop(tx.send(r)),
        }
    }
}

struct Shared {
    client: Client,
    leadership: Arc<Leadership>,
    prefix: String,
    jobs: mpsc::UnboundedSender<Job>,
    /// Why the writer stopped, once it has.
    failed: watch::Sender<Option<String>>,
    grants: AtomicU64,
    rewriting: AtomicBool,
    /// The revision of the last batch committed (for compaction).
    revision: AtomicI64,
}

/// The etcd backend of one project, writing under one leadership. Cheap to clone.
#[derive(Clone)]
pub struct EtcdBackend {
    shared: Arc<Shared>,
}

impl EtcdBackend {
    /// A backend writing under `leadership`, keys under `prefix` (ends with `/`). Starts its
    /// writer and compactor on the current Tokio runtime.
    pub fn new(client: Client, leadership: Arc<Leadership>, prefix: String) -> EtcdBackend {
        let (jobs, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            client,
            leadership,
            prefix,
            jobs,
            failed: watch::channel(None).0,
            grants: AtomicU64::new(0),
            rewriting: AtomicBool::new(false),
            revision: AtomicI64::new(0),
        });
        tokio::spawn(writer(Arc::downgrade(&shared), rx));
        tokio::spawn(compactor(Arc::downgrade(&shared)));
        EtcdBackend { shared }
    }

    /// The prefix of a project's keys: one etcd cluster holds many projects.
    pub fn prefix_of(project: &str) -> String {
        format!("/automaton/{project}/")
    }

    /// This backend as the task store's replica.
    pub fn replica(&self) -> Arc<dyn Replica> {
        Arc::new(self.clone())
    }

    /// Every file the backend holds, by its store path: what a leader's view is rebuilt from.
    pub async fn files(&self) -> Result<Vec<(String, Vec<u8>)>, String> {
        let prefix = format!("{}files/", self.shared.prefix);
        let kvs = self
            .shared
            .client
            .range_prefix(prefix.clone())
            .await
            .map_err(|e| e.to_string())?;
        Ok(kvs
            .into_iter()
            .filter_map(|kv| {
                let path = String::from_utf8(kv.key).ok()?;
                Some((path.strip_prefix(&prefix)?.to_string(), kv.value))
            })
            .collect())
    }

    /// Whether the files were ever seeded (a first leader's local store, see [`seed`]).
    ///
    /// [`seed`]: EtcdBackend::seed
    pub async fn seeded(&self) -> Result<bool, String> {
        let key = format!("{}seeded", self.shared.prefix);
        Ok(self
            .shared
            .client
            .get(key)
            .await
            .map_err(|e| e.to_string())?
            .is_some())
    }

    /// Puts `files` (a first leader's local store) and marks the backend seeded, fenced.
    pub async fn seed(&self, files: &[(String, Vec<u8>)]) -> Result<(), String> {
        let mut ops = Vec::with_capacity(files.len() + 1);
        for (path, bytes) in files {
            check_size(path, bytes.len())?;
            ops.push(Op::put(self.key("files/", path), bytes.clone()));
        }
        ops.push(Op::put(
            format!("{}seeded", self.shared.prefix),
            b"1".to_vec(),
        ));
        self.shared
            .leadership
            .txn_in_batches(ops)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    fn key(&self, kind: &str, rest: &str) -> String {
        format!("{}{kind}{rest}", self.shared.prefix)
    }

    fn submit(&self, job: Job) -> Result<(), String> {
        if let Some(why) = self.shared.failed.borrow().clone() {
            return Err(why);
        }
        self.shared
            .jobs
            .send(job)
            .map_err(|_| "the etcd lease log has stopped".to_string())
    }

    fn queue(&self, ops: Vec<Op>) -> Result<Commit, String> {
        let (tx, commit) = Commit::channel();
        self.submit(Job::Ops {
            ops,
            done: Some(Done::Async(tx)),
        })?;
        Ok(commit)
    }

    /// Queues `ops` and waits on this (blocking) thread for them to be durable.
    fn write_blocking(&self, ops: Vec<Op>) -> Result<(), String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.submit(Job::Ops {
            ops,
            done: Some(Done::Sync(tx)),
        })?;
        wait_blocking(&rx)
    }

    /// The key a record lives at (an end deletes its grant's).
    fn record_key(&self, r: &Record) -> String {
        match r {
            Record::Grant { lease_id, .. } | Record::End { lease_id } => {
                self.key("leases/", lease_id)
            }
            Record::Mark { .. } => self.key("mark", ""),
            Record::Holder { task, agent, state } => {
                self.key("holders/", &format!("{task}/{agent}/{state}"))
            }
        }
    }

    fn record_op(&self, r: &Record) -> Op {
        let key = self.record_key(r);
        if let Record::End { .. } = r {
            return Op::delete(key);
        }
        let mut line = String::new();
        r.render(&mut line);
        Op::put(key, line)
    }

    /// What the backend holds now, by key (lease and holder keys, and the mark).
    async fn current(&self) -> Result<HashMap<String, Vec<u8>>, String> {
        let mut out = HashMap::new();
        for kind in ["leases/", "holders/"] {
            let kvs = self
                .shared
                .client
                .range_prefix(self.key(kind, ""))
                .await
                .map_err(|e| e.to_string())?;
            for kv in kvs {
                if let Ok(k) = String::from_utf8(kv.key) {
                    out.insert(k, kv.value);
                }
            }
        }
        if let Some(kv) = self
            .shared
            .client
            .get(self.key("mark", ""))
            .await
            .map_err(|e| e.to_string())?
        {
            out.insert(self.key("mark", ""), kv.value);
        }
        Ok(out)
    }

    /// The operations that turn what the backend holds into exactly `live`: puts first, then
    /// deletes (a crash between batches leaves a superset, never a lease lost); the mark
    /// never goes down.
    async fn rewrite_ops(&self, live: &[Record]) -> Result<Vec<Op>, String> {
        let now = self.current().await?;
        let mark_key = self.key("mark", "");
        let held_mark = now
            .get(&mark_key)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|l| match Record::parse(l.trim_end()) {
                Some(Record::Mark { token }) => Some(token),
                _ => None,
            })
            .unwrap_or(0);
        let mut want: HashMap<String, Vec<u8>> = HashMap::new();
        let mut mark = held_mark;
        for r in live {
            match r {
                Record::Mark { token } => mark = mark.max(*token),
                Record::End { .. } => {}
                _ => {
                    let mut line = String::new();
                    r.render(&mut line);
                    want.insert(self.record_key(r), line.into_bytes());
                }
            }
        }
        let mut ops = Vec::new();
        for (k, v) in &want {
            if now.get(k) != Some(v) {
                ops.push(Op::put(k.clone(), v.clone()));
            }
        }
        if mark > held_mark {
            ops.push(self.record_op(&Record::Mark { token: mark }));
        }
        for k in now.keys() {
            if *k != mark_key && !want.contains_key(k) {
                ops.push(Op::delete(k.clone()));
            }
        }
        Ok(ops)
    }
}

fn check_size(path: &str, len: usize) -> Result<(), String> {
    if len > MAX_FILE_BYTES {
        return Err(format!(
            "{path} is {len} bytes: with the etcd store a file is at most {MAX_FILE_BYTES} bytes (1 MiB, under etcd's request limit); make it smaller"
        ));
    }
    Ok(())
}

/// Commits `ops` under the leadership, waiting out etcd being unreachable while the
/// leadership lasts. Returns the revision of the last transaction.
async fn commit(shared: &Shared, ops: Vec<Op>) -> Result<i64, String> {
    let ops = coalesce(ops);
    if ops.is_empty() {
        return Ok(shared.revision.load(Ordering::Relaxed));
    }
    loop {
        match shared.leadership.txn_in_batches(ops.clone()).await {
            Ok(rs) => return Ok(rs.last().map_or(0, |r| r.revision)),
            Err(automaton_etcd::Error::Unavailable(why)) if shared.leadership.is_leader() => {
                tracing::warn!(error = %why, "etcd unreachable: retrying the batch while leadership lasts");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(format!("the etcd lease log stopped: {e}")),
        }
    }
}

/// Keeps each key's last operation, where the last ones stand: etcd refuses a transaction
/// that names a key twice ("duplicate key given in txn request"), and a batch often holds a
/// grant and its end. Nothing is acknowledged before the whole batch commits, so no one can
/// tell the difference.
fn coalesce(ops: Vec<Op>) -> Vec<Op> {
    let mut last: HashMap<Vec<u8>, usize> = HashMap::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        if let Op::Put { key, .. } | Op::Delete { key } = op {
            last.insert(key.clone(), i);
        }
    }
    ops.into_iter()
        .enumerate()
        .filter(|(i, op)| match op {
            Op::Put { key, .. } | Op::Delete { key } => last.get(key) == Some(i),
            _ => true,
        })
        .map(|(_, op)| op)
        .collect()
}

/// The writer: takes everything waiting, in order, and commits it as one batch; a rewrite
/// first commits what was queued before it. The first failure stops it for good.
async fn writer(shared: std::sync::Weak<Shared>, mut rx: mpsc::UnboundedReceiver<Job>) {
    while let Some(first) = rx.recv().await {
        let Some(s) = shared.upgrade() else { return };
        let backend = EtcdBackend { shared: s.clone() };
        let mut jobs = vec![first];
        while jobs.len() < 4096
            && let Ok(j) = rx.try_recv()
        {
            jobs.push(j);
        }
        let mut ops: Vec<Op> = Vec::new();
        let mut waiting: Vec<Done> = Vec::new();
        let mut outcome: Result<(), String> = Ok(());
        for job in jobs {
            match job {
                Job::Ops { ops: o, done } => {
                    ops.extend(o);
                    waiting.extend(done);
                }
                Job::Rewrite { live, done } => {
                    let before = commit(&s, std::mem::take(&mut ops)).await;
                    let result = match before {
                        Ok(_) => match backend.rewrite_ops(&live).await {
                            Ok(rw) => commit(&s, rw).await.map(drop),
                            Err(e) => Err(e),
                        },
                        Err(e) => Err(e),
                    };
                    s.rewriting.store(false, Ordering::Relaxed);
                    if result.is_ok() {
                        s.grants.store(0, Ordering::Relaxed);
                    }
                    for d in waiting.drain(..) {
                        d.send(result.clone());
                    }
                    done.send(result.clone());
                    if let Err(e) = result {
                        outcome = Err(e);
                        break;
                    }
                }
            }
        }
        if outcome.is_ok() {
            let result = commit(&s, std::mem::take(&mut ops)).await;
            if let Ok(rev) = result {
                s.revision.fetch_max(rev, Ordering::Relaxed);
            }
            let result = result.map(drop);
            for d in waiting.drain(..) {
                d.send(result.clone());
            }
            outcome = result;
        }
        if let Err(why) = outcome {
            tracing::error!(error = %why, "etcd lease log failed: stopping (fail-stop)");
            s.failed.send_replace(Some(why.clone()));
            for d in waiting.drain(..) {
                d.send(Err(why.clone()));
            }
            // Everything still queued, and every later job, is refused.
            rx.close();
            while let Ok(job) = rx.try_recv() {
                match job {
                    Job::Ops { done, .. } => {
                        if let Some(d) = done {
                            d.send(Err(why.clone()));
                        }
                    }
                    Job::Rewrite { done, .. } => done.send(Err(why.clone())),
                }
            }
            return;
        }
    }
}

/// Compacts etcd's history every [`COMPACT_EVERY`] to the revision of one period ago.
async fn compactor(shared: std::sync::Weak<Shared>) {
    let mut last = 0;
    loop {
        tokio::time::sleep(COMPACT_EVERY).await;
        let Some(s) = shared.upgrade() else { return };
        if last > 0
            && s.leadership.is_leader()
            && let Err(e) = s.client.compact(last).await
        {
            tracing::debug!(error = %e, revision = last, "etcd compaction skipped");
        }
        last = s.revision.load(Ordering::Relaxed);
    }
}

impl LeaseLog for EtcdBackend {
    fn grant(&self, grant: Grant<'_>) -> Result<Commit, String> {
        self.shared.grants.fetch_add(1, Ordering::Relaxed);
        let mut line = String::with_capacity(96);
        grant.render(&mut line);
        self.queue(vec![Op::put(self.key("leases/", grant.lease_id), line)])
    }

    fn grant_displacing(&self, grant: Grant<'_>, ended: &str) -> Result<Commit, String> {
        self.shared.grants.fetch_add(1, Ordering::Relaxed);
        let mut line = String::with_capacity(96);
        grant.render(&mut line);
        // One job, the delete first: one transaction unless the batch it joins is split at
        // 127 operations, and then the end's chunk commits first — a crash between the two
        // loses only the grant, which was not acknowledged.
        self.queue(vec![
            Op::delete(self.key("leases/", ended)),
            Op::put(self.key("leases/", grant.lease_id), line),
        ])
    }

    fn ends(&self, lease_ids: &mut dyn Iterator<Item = &str>) -> Result<Commit, String> {
        let ops = lease_ids
            .map(|id| Op::delete(self.key("leases/", id)))
            .collect();
        self.queue(ops)
    }

    fn barrier(&self) -> Result<Commit, String> {
        self.queue(Vec::new())
    }

    fn end_nowait(&self, lease_id: &str) {
        let _ = self.submit(Job::Ops {
            ops: vec![Op::delete(self.key("leases/", lease_id))],
            done: None,
        });
    }

    fn failed(&self) -> BoxFuture<'_, String> {
        Box::pin(async move {
            let mut rx = self.shared.failed.subscribe();
            tokio::select! {
                why = rx.wait_for(Option::is_some) => match why {
                    Ok(why) => why.clone().unwrap_or_default(),
                    Err(_) => "the etcd lease log has stopped".to_string(),
                },
                why = self.shared.leadership.lost() => format!("leadership lost: {why}"),
            }
        })
    }

    fn serving(&self) -> Result<(), String> {
        if self.shared.leadership.is_leader() {
            return Ok(());
        }
        Err(format!(
            "this coordinator cannot prove it still leads (no keepalive of its etcd leadership was acknowledged in time, or it was deposed): nothing answered; retry, and a client given every coordinator finds the leader ({})",
            self.shared.leadership.key_name()
        ))
    }

    fn wants_rewrite(&self) -> bool {
        self.shared.grants.load(Ordering::Relaxed) > REWRITE_AFTER_GRANTS
            && !self.shared.rewriting.load(Ordering::Relaxed)
    }

    fn rewrite(&self, live: &[Record]) -> Commit {
        let (tx, commit) = Commit::channel();
        self.shared.rewriting.store(true, Ordering::Relaxed);
        if let Err(e) = self.submit(Job::Rewrite {
            live: live.to_vec(),
            done: Done::Async(tx),
        }) {
            self.shared.rewriting.store(false, Ordering::Relaxed);
            tracing::debug!(error = %e, "no rewrite: the etcd lease log has stopped");
        }
        commit
    }
}

impl Backend for EtcdBackend {
    fn name(&self) -> &'static str {
        "etcd"
    }

    fn load(&self) -> Result<Vec<Record>, String> {
        let this = self.clone();
        let current = block_on(async move { this.current().await })?;
        let mut marks = Vec::new();
        let mut grants = Vec::new();
        let mut holders = Vec::new();
        for (key, value) in current {
            let line = std::str::from_utf8(&value)
                .map_err(|_| format!("etcd key {key} is not a lease record (not UTF-8)"))?;
            match Record::parse(line.trim_end()) {
                Some(r @ Record::Mark { .. }) => marks.push(r),
                Some(r @ Record::Grant { .. }) => grants.push(r),
                Some(r @ Record::Holder { .. }) => holders.push(r),
                _ => {
                    return Err(format!(
                        "etcd key {key} is not a lease record: '{}'",
                        automaton_workflow::excerpt(line)
                    ));
                }
            }
        }
        // Replay's order: a grant supersedes the earlier grants of its task, by token.
        grants.sort_by_key(|r| match r {
            Record::Grant { token, .. } => *token,
            _ => 0,
        });
        marks.extend(grants);
        marks.extend(holders);
        Ok(marks)
    }

    fn start(&self, live: &[Record]) -> Result<Arc<dyn LeaseLog>, String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.shared.rewriting.store(true, Ordering::Relaxed);
        self.submit(Job::Rewrite {
            live: live.to_vec(),
            done: Done::Sync(tx),
        })?;
        wait_blocking(&rx)?;
        Ok(Arc::new(self.clone()))
    }
}

impl Replica for EtcdBackend {
    fn put(&self, files: &[(&str, &[u8])]) -> Result<(), String> {
        let mut ops = Vec::with_capacity(files.len());
        for (path, bytes) in files {
            check_size(path, bytes.len())?;
            ops.push(Op::put(self.key("files/", path), bytes.to_vec()));
        }
        self.write_blocking(ops)
    }

    fn remove(&self, path: &str) -> Result<(), String> {
        self.write_blocking(vec![Op::delete(self.key("files/", path))])
    }
}

/// Waits on this thread for the writer's answer. The writer runs on the runtime's other
/// threads: on a worker thread the runtime is told this one blocks; on the blocking pool or
/// a plain thread it just waits. (A current-thread runtime would deadlock: refused.)
fn wait_blocking(rx: &std::sync::mpsc::Receiver<Result<(), String>>) -> Result<(), String> {
    let wait = || {
        rx.recv()
            .unwrap_or_else(|_| Err("the etcd lease log has stopped".to_string()))
    };
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        Ok(_) => Err(CURRENT_THREAD.to_string()),
        Err(_) => wait(),
    }
}

const CURRENT_THREAD: &str =
    "the etcd backend needs a multi-threaded Tokio runtime (its writer runs beside the caller)";

/// Runs `f` to completion from synchronous code on a multi-threaded runtime's thread.
fn block_on<T: Send + 'static>(
    f: impl std::future::Future<Output = Result<T, String>> + Send + 'static,
) -> Result<T, String> {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(|| h.block_on(f))
        }
        _ => Err(CURRENT_THREAD.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_names_each_key_once_with_its_last_operation() {
        let ops = vec![
            Op::put("a", "1"),
            Op::put("b", "1"),
            Op::delete("a"),
            Op::put("c", "1"),
            Op::put("b", "2"),
        ];
        assert_eq!(
            coalesce(ops),
            vec![Op::delete("a"), Op::put("c", "1"), Op::put("b", "2")]
        );
    }
}
