//! The lease log: an append-only file with group commit. Every grant and end of a lease is a
//! line; a writer thread appends whatever arrived while the previous batch was syncing and
//! acknowledges the whole batch after one `fdatasync`. This is what makes an acknowledged
//! claim or release survive `kill -9`; the `.state.lock` files are only its materialised view.
//!
//! The log is rewritten with only the live leases at every start and, while running, whenever
//! what was appended since the last rewrite outgrows both a threshold and twice the rewrite
//! (see [`Wal::wants_rewrite`]): its size stays bounded by the live leases, not by history.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use automaton_workflow::{AgentId, State, TaskName};
use tokio::sync::oneshot;

use crate::leases::Live;

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    Grant {
        task: TaskName,
        agent: AgentId,
        lease_id: String,
        token: u64,
        ttl: Duration,
        state: State,
    },
    /// Released, expired, or ended by a transition.
    End { lease_id: String },
}

impl Record {
    fn render(&self, out: &mut Vec<u8>) {
        match self {
            Record::Grant {
                task,
                agent,
                lease_id,
                token,
                ttl,
                state,
            } => render_grant(task, agent, lease_id, *token, *ttl, *state, out),
            Record::End { lease_id } => render_end(lease_id, out),
        }
    }

    fn parse(line: &str) -> Option<Record> {
        let f: Vec<&str> = line.split('\t').collect();
        match f.as_slice() {
            ["G", task, agent, lease_id, token, ttl, state] => Some(Record::Grant {
                task: task.parse().ok()?,
                agent: agent.parse().ok()?,
                lease_id: lease_id.to_string(),
                token: token.parse().ok()?,
                ttl: Duration::from_millis(ttl.parse().ok()?),
                state: state.parse().ok()?,
            }),
            ["E", lease_id] => Some(Record::End {
                lease_id: lease_id.to_string(),
            }),
            _ => None,
        }
    }
}

fn render_grant(
    task: &TaskName,
    agent: &AgentId,
    lease_id: &str,
    token: u64,
    ttl: Duration,
    state: State,
    out: &mut Vec<u8>,
) {
    // Writing into a Vec cannot fail.
    let _ = writeln!(
        out,
        "G\t{task}\t{agent}\t{lease_id}\t{token}\t{}\t{state}",
        ttl.as_millis()
    );
}

fn render_end(lease_id: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(b"E\t");
    out.extend_from_slice(lease_id.as_bytes());
    out.push(b'\n');
}

/// Reads a log. The records end at the first NUL byte (the zeroed space written ahead, see
/// [`Log`]). A last line without its newline was being written when the process died and was
/// never acknowledged: it is ignored. Any other unreadable line is an error.
pub(crate) fn read(path: &Path) -> Result<Vec<Record>, String> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    let complete = match bytes[..end].iter().rposition(|&b| b == b'\n') {
        Some(i) => &bytes[..=i],
        None => &[],
    };
    let complete = std::str::from_utf8(complete)
        .map_err(|e| format!("{} is not a lease log: {e}", path.display()))?;
    complete
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(i, l)| {
            Record::parse(l).ok_or_else(|| {
                format!(
                    "{} line {} is not a lease record: '{l}'",
                    path.display(),
                    i + 1
                )
            })
        })
        .collect()
}

enum Job {
    Append {
        bytes: Vec<u8>,
        done: Option<oneshot::Sender<Result<(), String>>>,
    },
    /// Replace the log with exactly these (rendered) records.
    Rewrite {
        bytes: Vec<u8>,
        done: Option<oneshot::Sender<Result<(), String>>>,
    },
}

/// Sizes the writer keeps, for deciding when to rewrite.
#[derive(Default)]
struct Sizes {
    /// Bytes appended since the last rewrite.
    appended: AtomicU64,
    /// Size of the last rewrite.
    base: AtomicU64,
    /// A rewrite is queued and not yet done.
    rewriting: AtomicBool,
    /// Tests: fail the next commit without writing it.
    #[cfg(test)]
    fail_next: AtomicBool,
    /// Tests: held, no commit starts.
    #[cfg(test)]
    held: std::sync::Mutex<()>,
}

impl Sizes {
    /// Whether a test asked the next commit to fail.
    fn failing(&self) -> bool {
        #[cfg(test)]
        return self.fail_next.swap(false, Ordering::Relaxed);
        #[cfg(not(test))]
        false
    }
}

/// The append side of the log.
#[derive(Clone)]
pub(crate) struct Wal {
    tx: mpsc::Sender<Job>,
    sizes: Arc<Sizes>,
    compact_bytes: u64,
}

/// A record queued for the log: resolves once it is on disk, or with why it is not.
pub(crate) struct Commit(oneshot::Receiver<Result<(), String>>);

fn writer_stopped() -> String {
    "the lease log writer has stopped".to_string()
}

/// The writer's answer, or why there is none.
fn settled(answer: Result<Result<(), String>, oneshot::error::RecvError>) -> Result<(), String> {
    answer.map_err(|_| writer_stopped())?
}

impl Commit {
    /// Waits on this thread, which must not be a runtime's.
    pub(crate) fn wait_blocking(self) -> Result<(), String> {
        settled(self.0.blocking_recv())
    }
}

impl std::future::Future for Commit {
    type Output = Result<(), String>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(settled)
    }
}

fn render_all(records: &[Record]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for r in records {
        r.render(&mut bytes);
    }
    bytes
}

/// The zeroed space kept ahead of the records, in steps of this size.
const AHEAD: u64 = 256 << 10;

/// The log file. Records are written over space zeroed ahead of time rather than appended: an
/// overwrite inside the file changes neither its size nor its blocks, so `fdatasync` flushes
/// the data alone, without the inode (on ext4 without a journal that is one synchronous write
/// instead of two per commit; etcd preallocates its WAL segments for the same reason).
struct Log {
    file: File,
    /// Where the records end.
    at: u64,
    /// How far the file is written (records, then zeros).
    len: u64,
}

impl Log {
    /// Writes `bytes` and zeroed space as the whole log: temporary file, synced, renamed,
    /// directory synced.
    fn create(path: &Path, bytes: &[u8]) -> std::io::Result<Log> {
        let tmp = path.with_extension("wal.tmp");
        let mut log = Log {
            file: OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&tmp)?,
            at: 0,
            len: 0,
        };
        log.file.write_all_at(bytes, 0)?;
        log.at = bytes.len() as u64;
        log.len = log.at;
        log.zero_to(log.at + AHEAD)?;
        log.file.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        Ok(log)
    }

    /// Zeroes the file from its written length up to `to`.
    fn zero_to(&mut self, to: u64) -> std::io::Result<()> {
        static ZEROS: [u8; 64 * 1024] = [0; 64 * 1024];
        while self.len < to {
            let n = (to - self.len).min(ZEROS.len() as u64) as usize;
            self.file.write_all_at(&ZEROS[..n], self.len)?;
            self.len += n as u64;
        }
        Ok(())
    }

    /// Writes `buf` after the records and syncs it.
    fn append(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let end = self.at + buf.len() as u64;
        if end > self.len {
            self.zero_to(end + AHEAD)?;
        }
        let result = self
            .file
            .write_all_at(buf, self.at)
            .and_then(|()| self.file.sync_data());
        match result {
            Ok(()) => {
                self.at = end;
                Ok(())
            }
            Err(e) => {
                // Not acknowledged: the next commit writes over it; zero what part of it
                // landed, so no stray tail of it outlives a shorter successor.
                let _ = self.zero_range(self.at, buf.len());
                Err(e)
            }
        }
    }

    fn zero_range(&self, from: u64, n: usize) -> std::io::Result<()> {
        self.file.write_all_at(&vec![0; n], from)
    }
}

impl Wal {
    /// Starts a fresh log holding exactly `live` (compacted: written to a temporary file,
    /// synced, renamed, directory synced) and the writer thread that appends to it. While
    /// running, a rewrite is wanted once `compact_bytes` were appended since the last one.
    pub(crate) fn create(path: &Path, live: &[Record], compact_bytes: u64) -> std::io::Result<Wal> {
        let bytes = render_all(live);
        let log = Log::create(path, &bytes)?;
        let sizes = Arc::new(Sizes::default());
        sizes.base.store(bytes.len() as u64, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel::<Job>();
        let path: PathBuf = path.to_path_buf();
        let writer_sizes = sizes.clone();
        std::thread::Builder::new()
            .name("lease-log".into())
            .spawn(move || writer(log, &path, rx, &writer_sizes))?;
        Ok(Wal {
            tx,
            sizes,
            compact_bytes,
        })
    }

    fn send(&self, job: Job) -> Result<(), String> {
        self.tx.send(job).map_err(|_| writer_stopped())
    }

    /// Queues rendered records for the next commit.
    fn submit(&self, bytes: Vec<u8>) -> Result<Commit, String> {
        let (done, wait) = oneshot::channel();
        self.send(Job::Append {
            bytes,
            done: Some(done),
        })?;
        Ok(Commit(wait))
    }

    /// Queues the grant of `l` (rendered from it, no copy of its fields).
    pub(crate) fn grant(&self, l: &Live) -> Result<Commit, String> {
        let mut bytes = Vec::with_capacity(96);
        render_grant(
            &l.task,
            &l.agent,
            &l.lease_id,
            l.token,
            l.ttl,
            l.state,
            &mut bytes,
        );
        self.submit(bytes)
    }

    /// Queues the end of a lease.
    pub(crate) fn end(&self, lease_id: &str) -> Result<Commit, String> {
        let mut bytes = Vec::with_capacity(lease_id.len() + 3);
        render_end(lease_id, &mut bytes);
        self.submit(bytes)
    }

    /// Appends the grant of `l` and waits until it is on disk.
    pub(crate) async fn append_grant(&self, l: &Live) -> Result<(), String> {
        self.grant(l)?.await
    }

    /// Appends the end of a lease without waiting: for expiries, which a restart would redo
    /// anyway.
    pub(crate) fn append_end_nowait(&self, lease_id: &str) {
        let mut bytes = Vec::with_capacity(lease_id.len() + 3);
        render_end(lease_id, &mut bytes);
        let _ = self.send(Job::Append { bytes, done: None });
    }

    /// Tests: no commit starts until the guard is dropped.
    #[cfg(test)]
    pub(crate) fn hold_commits(&self) -> std::sync::MutexGuard<'_, ()> {
        self.sizes.held.lock().expect("not poisoned")
    }

    /// Tests: the next commit fails, and writes nothing.
    #[cfg(test)]
    pub(crate) fn fail_next_commit(&self) {
        self.sizes.fail_next.store(true, Ordering::Relaxed);
    }

    /// Whether the log has grown enough since its last rewrite to be rewritten: more than
    /// the threshold and more than twice the last rewrite, and no rewrite already queued.
    pub(crate) fn wants_rewrite(&self) -> bool {
        let appended = self.sizes.appended.load(Ordering::Relaxed);
        appended > self.compact_bytes
            && appended > 2 * self.sizes.base.load(Ordering::Relaxed)
            && !self.sizes.rewriting.load(Ordering::Relaxed)
    }

    /// Replaces the log with exactly `live`, after everything queued before it. `live` must
    /// be a snapshot of the lease table taken after every change whose record is queued
    /// before this call: records queued later may repeat a grant of the snapshot (replay
    /// keeps one) or end a lease it no longer holds (replay ignores it). Returns a receiver
    /// that tells when the rewrite is done.
    pub(crate) fn rewrite(&self, live: &[Record]) -> oneshot::Receiver<Result<(), String>> {
        let (done, wait) = oneshot::channel();
        self.sizes.rewriting.store(true, Ordering::Relaxed);
        if self
            .send(Job::Rewrite {
                bytes: render_all(live),
                done: Some(done),
            })
            .is_err()
        {
            self.sizes.rewriting.store(false, Ordering::Relaxed);
        }
        wait
    }
}

/// Group commit: take everything that is waiting, write the appends in one go, one
/// `fdatasync`, then acknowledge them all. A rewrite in the batch first commits the appends
/// queued before it.
fn writer(mut log: Log, path: &Path, rx: mpsc::Receiver<Job>, sizes: &Sizes) {
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut waiting: Vec<oneshot::Sender<Result<(), String>>> = Vec::new();
    let commit = |log: &mut Log,
                  buf: &mut Vec<u8>,
                  waiting: &mut Vec<oneshot::Sender<Result<(), String>>>| {
        if buf.is_empty() && waiting.is_empty() {
            return;
        }
        #[cfg(test)]
        let _held = sizes.held.lock();
        let result = if sizes.failing() {
            Err(format!(
                "cannot append to {}: failure injected",
                path.display()
            ))
        } else {
            log.append(buf)
                .map_err(|e| format!("cannot append to {}: {e}", path.display()))
        };
        match &result {
            Ok(()) => {
                sizes
                    .appended
                    .fetch_add(buf.len() as u64, Ordering::Relaxed);
            }
            Err(e) => tracing::error!(error = %e, "lease log write failed"),
        }
        buf.clear();
        for done in waiting.drain(..) {
            let _ = done.send(result.clone());
        }
    };
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        while let Some(job) = next.take().or_else(|| rx.try_recv().ok()) {
            match job {
                Job::Append { bytes, done } => {
                    buf.extend_from_slice(&bytes);
                    waiting.extend(done);
                }
                Job::Rewrite { bytes, done } => {
                    commit(&mut log, &mut buf, &mut waiting);
                    let appended = sizes.appended.load(Ordering::Relaxed);
                    let result = Log::create(path, &bytes)
                        .map(|fresh| {
                            tracing::debug!(
                                appended,
                                live_bytes = bytes.len(),
                                "lease log rewritten with the live leases"
                            );
                            log = fresh;
                            sizes.appended.store(0, Ordering::Relaxed);
                            sizes.base.store(bytes.len() as u64, Ordering::Relaxed);
                        })
                        .map_err(|e| format!("cannot rewrite {}: {e}", path.display()));
                    if let Err(e) = &result {
                        // The old log is still whole: appends go on to it.
                        tracing::error!(error = %e, "lease log rewrite failed");
                    }
                    sizes.rewriting.store(false, Ordering::Relaxed);
                    if let Some(done) = done {
                        let _ = done.send(result);
                    }
                }
            }
        }
        commit(&mut log, &mut buf, &mut waiting);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(id: &str, token: u64) -> Record {
        Record::Grant {
            task: "t".parse().expect("valid"),
            agent: "a".parse().expect("valid"),
            lease_id: id.into(),
            token,
            ttl: Duration::from_millis(1500),
            state: "implement".parse().expect("valid"),
        }
    }

    async fn append(wal: &Wal, r: &Record) {
        let mut bytes = Vec::new();
        r.render(&mut bytes);
        wal.submit(bytes).expect("queued").await.expect("append");
    }

    #[tokio::test]
    async fn log_round_trips_and_ignores_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("leases.wal");
        let wal = Wal::create(&path, &[grant("x", 1)], 1 << 20).expect("create");
        append(&wal, &grant("y", 2)).await;
        append(
            &wal,
            &Record::End {
                lease_id: "x".into(),
            },
        )
        .await;
        // A torn record right after the last whole one, in the zeroed space.
        let text = fs::read(&path).expect("read");
        let end = text
            .iter()
            .position(|&b| b == 0)
            .expect("zeroed space ahead");
        let f = OpenOptions::new().write(true).open(&path).expect("open");
        f.write_all_at(b"G\tt\ta\tz\t3", end as u64)
            .expect("torn write");
        let records = read(&path).expect("read");
        assert_eq!(
            records,
            vec![
                grant("x", 1),
                grant("y", 2),
                Record::End {
                    lease_id: "x".into()
                }
            ]
        );
    }

    #[tokio::test]
    async fn a_rewrite_keeps_the_snapshot_and_what_follows_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("leases.wal");
        let wal = Wal::create(&path, &[], 64).expect("create");
        for i in 0..10 {
            append(&wal, &grant(&format!("old{i}"), i)).await;
        }
        assert!(wal.wants_rewrite(), "10 grants are over 64 bytes");
        let done = wal.rewrite(&[grant("old9", 9)]);
        assert!(!wal.wants_rewrite(), "a rewrite is already queued");
        append(&wal, &grant("new", 11)).await;
        done.await.expect("writer alive").expect("rewrite");
        assert_eq!(
            read(&path).expect("read"),
            vec![grant("old9", 9), grant("new", 11)]
        );
        assert!(!wal.wants_rewrite(), "one grant since the rewrite");
    }

    #[test]
    fn a_complete_garbage_line_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("leases.wal");
        fs::write(&path, "G\tt\ta\n").expect("write");
        assert!(read(&path).expect_err("garbage").contains("line 1"));
    }
}
