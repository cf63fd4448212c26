//! The files backend (the default): the lease log, an append-only file with group commit. Every grant and end of a lease is a
//! line; a writer thread appends whatever arrived while the previous batch was syncing and
//! acknowledges the whole batch after one `fdatasync`. This is what makes an acknowledged
//! claim or release survive `kill -9`; the `.state.lock` files are only its materialised view.
//!
//! The log is rewritten with only the live leases at every start and, while running, whenever
//! what was appended since the last rewrite outgrows both a threshold and twice the rewrite
//! (see [`FileLog::wants_rewrite`]): its size stays bounded by the live leases, not by history.

use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use tokio::sync::oneshot;

use crate::{Backend, BoxFuture, Commit, Grant, LeaseLog, Record};

/// Reads a log. The records end at the first NUL byte (the zeroed space written ahead, see
/// [`Log`]). A last line without its newline was being written when the process died and was
/// never acknowledged: it is ignored. Any other unreadable line is an error.
pub fn read(path: &Path) -> Result<Vec<Record>, String> {
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
                    "{} line {} is not a lease record: '{}'",
                    path.display(),
                    i + 1,
                    automaton_workflow::excerpt(l)
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

/// Test hooks that make the log's disk fail on purpose, so that fail-stop can be tested
/// against the real binary. Set from `AUTOMATON_FAILPOINTS` (see `docs/coordinator.md`);
/// never set in production.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Failpoints {
    /// The commit after this many successful ones fails as a failed `fdatasync` would.
    pub log_sync_fails_after: Option<u64>,
    /// A rewrite fails after its rename, as a failed directory sync would.
    pub log_rewrite_dir_sync_fails: bool,
    /// Every commit takes at least this long, as on a slow or busy disk.
    pub log_sync_delay: Option<Duration>,
    /// The coordinator aborts (as a `kill -9` would stop it) right after a delivery's step:
    /// one of [`DELIVERY_STEPS`].
    pub delivery_crash_after: Option<&'static str>,
    /// A delivery stalls for [`DELIVERY_STALL`] right after this step (one of
    /// [`DELIVERY_STEPS`]), as a paused or overloaded leader would.
    pub delivery_stall_after: Option<&'static str>,
}

/// How long `delivery-stall-after` stalls.
pub const DELIVERY_STALL: Duration = Duration::from_secs(8);

/// The points a delivery can be crashed at: after its record says each state, and after
/// the base moved but before the record says so (`landed`).
pub const DELIVERY_STEPS: [&str; 5] = ["requested", "preparing", "ready", "merging", "landed"];

/// The delivery step `step` names (`delivery-{what}-after=STEP`), or one line saying which.
fn delivery_step(item: &str, what: &str, step: &str) -> Result<&'static str, String> {
    DELIVERY_STEPS
        .iter()
        .copied()
        .find(|s| *s == step.trim())
        .ok_or_else(|| {
            format!(
                "failpoint '{item}': write delivery-{what}-after= one of {}",
                DELIVERY_STEPS.join(", ")
            )
        })
}

impl Failpoints {
    /// `log-sync-fails-after=N`, `log-rewrite-dir-sync-fails`, `log-sync-delay-ms=N`,
    /// comma-separated.
    pub fn parse(text: &str) -> Result<Failpoints, String> {
        let mut f = Failpoints::default();
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item.split_once('=') {
                Some(("log-sync-fails-after", n)) => {
                    f.log_sync_fails_after =
                        Some(n.trim().parse().map_err(|_| {
                            format!("failpoint '{item}': write log-sync-fails-after=N")
                        })?)
                }
                Some(("log-sync-delay-ms", n)) => {
                    let ms: u64 = n.trim().parse().map_err(|_| {
                        format!("failpoint '{item}': write log-sync-delay-ms=N (at most 10000)")
                    })?;
                    if ms > 10_000 {
                        return Err(format!("failpoint '{item}': at most 10000 ms"));
                    }
                    f.log_sync_delay = Some(Duration::from_millis(ms));
                }
                None if item == "log-rewrite-dir-sync-fails" => f.log_rewrite_dir_sync_fails = true,
                Some(("delivery-stall-after", step)) => {
                    f.delivery_stall_after = Some(delivery_step(item, "stall", step)?);
                }
                Some(("delivery-crash-after", step)) => {
                    f.delivery_crash_after = Some(delivery_step(item, "crash", step)?);
                }
                _ => {
                    return Err(format!(
                        "unknown failpoint '{item}': use log-sync-fails-after=N, log-rewrite-dir-sync-fails, log-sync-delay-ms=N, delivery-crash-after=STEP or delivery-stall-after=STEP"
                    ));
                }
            }
        }
        Ok(f)
    }
}

/// What the writer shares with the append side.
struct Shared {
    /// Bytes appended since the last rewrite.
    appended: AtomicU64,
    /// Size of the last rewrite.
    base: AtomicU64,
    /// A rewrite is queued and not yet done.
    rewriting: AtomicBool,
    /// Commits left before a failpoint fails one (`u64::MAX`: never).
    commits_before_failure: AtomicU64,
    rewrite_dir_sync_fails: AtomicBool,
    sync_delay: Option<Duration>,
    /// Why the writer stopped, once it has: the coordinator then stops too.
    failed: tokio::sync::watch::Sender<Option<String>>,
    /// Test hooks: while held, no commit starts ([`FileLog::hold_commits`]).
    held: std::sync::Mutex<()>,
}

impl Shared {
    /// Whether a failpoint fails this commit.
    fn failing(&self) -> bool {
        self.commits_before_failure
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n != u64::MAX).then(|| n.saturating_sub(1))
            })
            .is_ok_and(|n| n == 0)
    }
}

/// The append side of the log.
#[derive(Clone)]
pub struct FileLog {
    tx: mpsc::Sender<Job>,
    shared: Arc<Shared>,
    compact_bytes: u64,
}

fn render_all(records: &[Record]) -> Vec<u8> {
    let mut text = String::new();
    for r in records {
        r.render(&mut text);
    }
    text.into_bytes()
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

/// How a rewrite failed: before its rename the old log is whole and stays in use; after it,
/// the old file is unlinked and the new one's name may not be durable: the writer must stop.
enum RewriteError {
    Before(std::io::Error),
    After(std::io::Error),
}

impl Log {
    /// Writes `bytes` and zeroed space to a temporary file and syncs it, ready to be renamed.
    fn prepare(tmp: &Path, bytes: &[u8]) -> std::io::Result<Log> {
        let mut log = Log {
            file: OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(tmp)?,
            at: 0,
            len: 0,
        };
        log.file.write_all_at(bytes, 0)?;
        log.at = bytes.len() as u64;
        log.len = log.at;
        log.zero_to(log.at + AHEAD)?;
        log.file.sync_all()?;
        Ok(log)
    }

    /// Writes `bytes` and zeroed space as the whole log: temporary file, synced, renamed,
    /// directory synced.
    fn create(path: &Path, bytes: &[u8], dir_sync_fails: bool) -> Result<Log, RewriteError> {
        let tmp = path.with_extension("wal.tmp");
        let log = Self::prepare(&tmp, bytes).map_err(|e| {
            let _ = fs::remove_file(&tmp);
            RewriteError::Before(e)
        })?;
        if let Err(e) = fs::rename(&tmp, path) {
            let _ = fs::remove_file(&tmp);
            return Err(RewriteError::Before(e));
        }
        if dir_sync_fails {
            return Err(RewriteError::After(std::io::Error::other(
                "directory sync failure injected",
            )));
        }
        if let Some(dir) = path.parent() {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(RewriteError::After)?;
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

    /// Writes `buf` after the records and syncs it. A failure is final: after a failed
    /// `fdatasync` the page cache can no longer be trusted (fsyncgate), so the caller stops.
    fn append(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let end = self.at + buf.len() as u64;
        if end > self.len {
            self.zero_to(end + AHEAD)?;
        }
        self.file.write_all_at(buf, self.at)?;
        self.file.sync_data()?;
        self.at = end;
        Ok(())
    }
}

impl FileLog {
    /// Starts a fresh log holding exactly `live` (compacted: written to a temporary file,
    /// synced, renamed, directory synced) and the writer thread that appends to it. While
    /// running, a rewrite is wanted once `compact_bytes` were appended since the last one.
    pub fn create(
        path: &Path,
        live: &[Record],
        compact_bytes: u64,
        failpoints: Failpoints,
    ) -> std::io::Result<FileLog> {
        let bytes = render_all(live);
        let log = Log::create(path, &bytes, false).map_err(|e| match e {
            RewriteError::Before(e) | RewriteError::After(e) => e,
        })?;
        let shared = Arc::new(Shared {
            appended: AtomicU64::new(0),
            base: AtomicU64::new(bytes.len() as u64),
            rewriting: AtomicBool::new(false),
            commits_before_failure: AtomicU64::new(
                failpoints.log_sync_fails_after.unwrap_or(u64::MAX),
            ),
            rewrite_dir_sync_fails: AtomicBool::new(failpoints.log_rewrite_dir_sync_fails),
            sync_delay: failpoints.log_sync_delay,
            failed: tokio::sync::watch::channel(None).0,
            held: std::sync::Mutex::new(()),
        });
        let (tx, rx) = mpsc::channel::<Job>();
        let path: PathBuf = path.to_path_buf();
        let writer_shared = shared.clone();
        std::thread::Builder::new()
            .name("lease-log".into())
            .spawn(move || writer(log, &path, rx, &writer_shared))?;
        Ok(FileLog {
            tx,
            shared,
            compact_bytes,
        })
    }

    fn send(&self, job: Job) -> Result<(), String> {
        self.tx
            .send(job)
            .map_err(|_| "the lease log writer has stopped after a disk failure".to_string())
    }

    /// Queues rendered records for the next commit.
    fn submit(&self, text: String) -> Result<Commit, String> {
        let (done, wait) = Commit::channel();
        self.send(Job::Append {
            bytes: text.into_bytes(),
            done: Some(done),
        })?;
        Ok(wait)
    }

    /// Tests: no commit starts until the guard is dropped.
    #[doc(hidden)]
    pub fn hold_commits(&self) -> std::sync::MutexGuard<'_, ()> {
        self.shared.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tests: the next commit fails, and writes nothing.
    #[doc(hidden)]
    pub fn fail_next_commit(&self) {
        self.shared
            .commits_before_failure
            .store(0, Ordering::Relaxed);
    }
}

impl LeaseLog for FileLog {
    fn grant(&self, grant: Grant<'_>) -> Result<Commit, String> {
        let mut text = String::with_capacity(96);
        grant.render(&mut text);
        self.submit(text)
    }

    fn grant_displacing(&self, grant: Grant<'_>, ended: &str) -> Result<Commit, String> {
        let mut text = String::with_capacity(96 + ended.len());
        crate::render_end(ended, &mut text);
        grant.render(&mut text);
        self.submit(text)
    }

    fn ends(&self, lease_ids: &mut dyn Iterator<Item = &str>) -> Result<Commit, String> {
        let mut text = String::new();
        for id in lease_ids {
            Record::End {
                lease_id: id.to_string(),
            }
            .render(&mut text);
        }
        self.submit(text)
    }

    fn barrier(&self) -> Result<Commit, String> {
        self.submit(String::new())
    }

    fn end_nowait(&self, lease_id: &str) {
        let mut text = String::with_capacity(lease_id.len() + 3);
        Record::End {
            lease_id: lease_id.to_string(),
        }
        .render(&mut text);
        let _ = self.send(Job::Append {
            bytes: text.into_bytes(),
            done: None,
        });
    }

    fn failed(&self) -> BoxFuture<'_, String> {
        Box::pin(async move {
            let mut rx = self.shared.failed.subscribe();
            match rx.wait_for(Option::is_some).await {
                Ok(why) => why.clone().unwrap_or_default(),
                Err(_) => "the lease log writer has stopped after a disk failure".to_string(),
            }
        })
    }

    /// Whether the log has grown enough since its last rewrite to be rewritten: more than
    /// the threshold and more than twice the last rewrite, and no rewrite already queued.
    fn wants_rewrite(&self) -> bool {
        let appended = self.shared.appended.load(Ordering::Relaxed);
        appended > self.compact_bytes
            && appended > 2 * self.shared.base.load(Ordering::Relaxed)
            && !self.shared.rewriting.load(Ordering::Relaxed)
    }

    fn rewrite(&self, live: &[Record]) -> Commit {
        let (done, wait) = Commit::channel();
        self.shared.rewriting.store(true, Ordering::Relaxed);
        if self
            .send(Job::Rewrite {
                bytes: render_all(live),
                done: Some(done),
            })
            .is_err()
        {
            self.shared.rewriting.store(false, Ordering::Relaxed);
        }
        wait
    }
}

/// The files backend: the lease log at `path` (`{project}/.automaton/leases.wal`).
#[derive(Debug, Clone)]
pub struct FileBackend {
    pub path: PathBuf,
    /// Rewrite the log once this much was appended since its last rewrite.
    pub compact_bytes: u64,
    pub failpoints: Failpoints,
}

impl Backend for FileBackend {
    fn name(&self) -> &'static str {
        "files"
    }

    fn load(&self) -> Result<Vec<Record>, String> {
        read(&self.path)
    }

    fn start(&self, live: &[Record]) -> Result<Arc<dyn LeaseLog>, String> {
        let log = FileLog::create(&self.path, live, self.compact_bytes, self.failpoints)
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))?;
        Ok(Arc::new(log))
    }
}

/// Group commit: take everything that is waiting, write the appends in one go, one
/// `fdatasync`, then acknowledge them all. A rewrite in the batch first commits the appends
/// queued before it. The first write, sync or post-rename failure stops the writer for
/// good (fail-stop): every waiting and later record is refused, and the coordinator exits.
fn writer(mut log: Log, path: &Path, rx: mpsc::Receiver<Job>, shared: &Shared) {
    let mut buf = Vec::with_capacity(64 * 1024);
    let mut waiting: Vec<oneshot::Sender<Result<(), String>>> = Vec::new();
    let commit = |log: &mut Log,
                  buf: &mut Vec<u8>,
                  waiting: &mut Vec<oneshot::Sender<Result<(), String>>>|
     -> Result<(), String> {
        if buf.is_empty() && waiting.is_empty() {
            return Ok(());
        }
        if buf.is_empty() {
            // Only barriers: everything queued before them was committed by an earlier
            // batch, which was synced before it was acknowledged.
            for done in waiting.drain(..) {
                let _ = done.send(Ok(()));
            }
            return Ok(());
        }
        let _held = shared.held.lock();
        if let Some(d) = shared.sync_delay {
            std::thread::sleep(d);
        }
        let result = if shared.failing() {
            Err(format!(
                "cannot sync {}: fdatasync failure injected",
                path.display()
            ))
        } else {
            log.append(buf)
                .map_err(|e| format!("cannot append to {}: {e}", path.display()))
        };
        if result.is_ok() {
            shared
                .appended
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        buf.clear();
        for done in waiting.drain(..) {
            let _ = done.send(result.clone());
        }
        result
    };
    let stop = |why: String| {
        tracing::error!(error = %why, "lease log failed: stopping (fail-stop)");
        shared.failed.send_replace(Some(why));
        // Returning drops the receiver: every job still queued, and every later one, is
        // answered "writer stopped".
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
                    if let Err(why) = commit(&mut log, &mut buf, &mut waiting) {
                        return stop(why);
                    }
                    let appended = shared.appended.load(Ordering::Relaxed);
                    let dir_fails = shared.rewrite_dir_sync_fails.load(Ordering::Relaxed);
                    let result = match Log::create(path, &bytes, dir_fails) {
                        Ok(fresh) => {
                            tracing::debug!(
                                appended,
                                live_bytes = bytes.len(),
                                "lease log rewritten with the live leases"
                            );
                            log = fresh;
                            shared.appended.store(0, Ordering::Relaxed);
                            shared.base.store(bytes.len() as u64, Ordering::Relaxed);
                            Ok(())
                        }
                        Err(RewriteError::Before(e)) => {
                            // The old log is whole and still in place: appends go on to it.
                            let why = format!("cannot rewrite {}: {e}", path.display());
                            tracing::error!(error = %why, "lease log rewrite failed; the old log stays");
                            Err(why)
                        }
                        Err(RewriteError::After(e)) => {
                            let why = format!(
                                "cannot sync the directory of {} after its rewrite: {e}",
                                path.display()
                            );
                            if let Some(done) = done {
                                let _ = done.send(Err(why.clone()));
                            }
                            return stop(why);
                        }
                    };
                    shared.rewriting.store(false, Ordering::Relaxed);
                    if let Some(done) = done {
                        let _ = done.send(result);
                    }
                }
            }
        }
        if let Err(why) = commit(&mut log, &mut buf, &mut waiting) {
            return stop(why);
        }
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
            session: None,
        }
    }

    async fn append(wal: &FileLog, r: &Record) {
        let mut text = String::new();
        r.render(&mut text);
        wal.submit(text).expect("queued").await.expect("append");
    }

    #[test]
    fn a_grant_names_its_session_and_a_grant_without_one_keeps_seven_fields() {
        let mut in_session = grant("x", 1);
        if let Record::Grant { session, .. } = &mut in_session {
            *session = Some("s-00ff".into());
        }
        for r in [grant("y", 2), in_session] {
            let mut line = String::new();
            r.render(&mut line);
            let fields = line.trim_end().split('\t').count();
            let named = matches!(
                &r,
                Record::Grant {
                    session: Some(_),
                    ..
                }
            );
            assert_eq!(fields, if named { 8 } else { 7 }, "{line:?}");
            assert_eq!(Record::parse(line.trim_end()), Some(r));
        }
        // A session field that is not a session id is not a lease record.
        assert_eq!(
            Record::parse("G\tt\ta\tx\t1\t1500\timplement\t../etc"),
            None
        );
        assert_eq!(
            Record::parse("G\tt\ta\tx\t1\t1500\timplement\ts-01\textra"),
            None
        );
    }

    #[tokio::test]
    async fn log_round_trips_and_ignores_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("leases.wal");
        let wal = FileLog::create(&path, &[grant("x", 1)], 1 << 20, Failpoints::default())
            .expect("create");
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
        let wal = FileLog::create(&path, &[], 64, Failpoints::default()).expect("create");
        for i in 0..10 {
            append(&wal, &grant(&format!("old{i}"), i)).await;
        }
        assert!(wal.wants_rewrite(), "10 grants are over 64 bytes");
        let done = wal.rewrite(&[grant("old9", 9)]);
        assert!(!wal.wants_rewrite(), "a rewrite is already queued");
        append(&wal, &grant("new", 11)).await;
        done.await.expect("rewrite");
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
