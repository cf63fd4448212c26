//! The lease log: an append-only file with group commit. Every grant and end of a lease is a
//! line; a writer thread appends whatever arrived while the previous batch was syncing and
//! acknowledges the whole batch after one `fdatasync`. This is what makes an acknowledged
//! claim or release survive `kill -9`; the `.state.lock` files are only its materialised view.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use automaton_workflow::{AgentId, State, TaskName};
use tokio::sync::oneshot;

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
        let line = match self {
            Record::Grant {
                task,
                agent,
                lease_id,
                token,
                ttl,
                state,
            } => format!(
                "G\t{task}\t{agent}\t{lease_id}\t{token}\t{}\t{state}\n",
                ttl.as_millis()
            ),
            Record::End { lease_id } => format!("E\t{lease_id}\n"),
        };
        out.extend_from_slice(line.as_bytes());
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

/// Reads a log. A last line without its newline was being written when the process died and
/// was never acknowledged: it is ignored. Any other unreadable line is an error.
pub(crate) fn read(path: &Path) -> Result<Vec<Record>, String> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
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

struct Job {
    bytes: Vec<u8>,
    done: Option<oneshot::Sender<Result<(), String>>>,
}

/// The append side of the log.
#[derive(Clone)]
pub(crate) struct Wal {
    tx: mpsc::Sender<Job>,
}

impl Wal {
    /// Starts a fresh log holding exactly `live` (compacted: written to a temporary file,
    /// synced, renamed, directory synced) and the writer thread that appends to it.
    pub(crate) fn create(path: &Path, live: &[Record]) -> std::io::Result<Wal> {
        let tmp = path.with_extension("wal.tmp");
        let mut bytes = Vec::new();
        for r in live {
            r.render(&mut bytes);
        }
        {
            let mut f = File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
        }
        fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let file = OpenOptions::new().append(true).open(path)?;
        let (tx, rx) = mpsc::channel::<Job>();
        let path: PathBuf = path.to_path_buf();
        std::thread::Builder::new()
            .name("lease-log".into())
            .spawn(move || writer(file, &path, rx))?;
        Ok(Wal { tx })
    }

    /// Appends and waits until the record is on disk.
    pub(crate) async fn append(&self, record: &Record) -> Result<(), String> {
        let mut bytes = Vec::with_capacity(96);
        record.render(&mut bytes);
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Job {
                bytes,
                done: Some(done),
            })
            .map_err(|_| "the lease log writer has stopped".to_string())?;
        wait.await
            .map_err(|_| "the lease log writer has stopped".to_string())?
    }

    /// Appends without waiting: for expiries, which a restart would redo anyway.
    pub(crate) fn append_nowait(&self, record: &Record) {
        let mut bytes = Vec::with_capacity(64);
        record.render(&mut bytes);
        let _ = self.tx.send(Job { bytes, done: None });
    }
}

/// Group commit: take everything that is waiting, write it in one go, one `fdatasync`, then
/// acknowledge every job of the batch.
fn writer(mut file: File, path: &Path, rx: mpsc::Receiver<Job>) {
    let mut buf = Vec::with_capacity(64 * 1024);
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        buf.clear();
        for j in &batch {
            buf.extend_from_slice(&j.bytes);
        }
        let result = file
            .write_all(&buf)
            .and_then(|()| file.sync_data())
            .map_err(|e| format!("cannot append to {}: {e}", path.display()));
        if let Err(e) = &result {
            tracing::error!(error = %e, "lease log write failed");
        }
        for j in batch {
            if let Some(done) = j.done {
                let _ = done.send(result.clone());
            }
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
        }
    }

    #[tokio::test]
    async fn log_round_trips_and_ignores_a_torn_tail() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("leases.wal");
        let wal = Wal::create(&path, &[grant("x", 1)]).expect("create");
        wal.append(&grant("y", 2)).await.expect("append");
        wal.append(&Record::End {
            lease_id: "x".into(),
        })
        .await
        .expect("append");
        let mut f = OpenOptions::new().append(true).open(&path).expect("open");
        f.write_all(b"G\tt\ta\tz\t3").expect("torn write");
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

    #[test]
    fn a_complete_garbage_line_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("leases.wal");
        fs::write(&path, "G\tt\ta\n").expect("write");
        assert!(read(&path).expect_err("garbage").contains("line 1"));
    }
}
