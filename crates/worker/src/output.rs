//! Live output: a copy of each run's agent output (stdout and stderr, as `agent.log` gets it)
//! streamed to the coordinator (`Work.StreamOutput`) while the agent runs, the worker's
//! secrets redacted, for `automaton logs -f` and the console.
//!
//! It must never slow or stop the agent: the output pumps hand chunks over with `try_send`
//! on a bounded channel and count what did not fit; the coordinator sees that as a gap (the
//! offsets jump), never as a stall. A stream that breaks (a failover) is opened again on the
//! leader, carrying on at the offset reached; once the lease is refused, nothing more is sent.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use automaton_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Chunks of output waiting to be sent (each at most the pumps' 16 KiB read): 4 MiB at most.
const QUEUED: usize = 256;
/// Most bytes per `OutputChunk` (the coordinator's limit).
pub const CHUNK_BYTES: usize = 64 << 10;
/// Secrets shorter than this are not looked for (as in the run's tail).
const MIN_SECRET: usize = 8;
/// How long the end of a stream waits for the coordinator's answer.
const END_WAIT: Duration = Duration::from_secs(1);
/// Before a broken stream is opened again.
const REOPEN_WAIT: Duration = Duration::from_millis(200);

/// Where the output pumps put a copy of what they read.
#[derive(Debug, Clone)]
pub struct OutputSink {
    tx: mpsc::Sender<Vec<u8>>,
    dropped: Arc<AtomicU64>,
}

impl OutputSink {
    /// Hands `bytes` over without waiting; what does not fit is counted as dropped.
    pub fn send(&self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if self.tx.try_send(bytes.to_vec()).is_err() {
            self.dropped
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
    }
}

/// The sending end's other half: what `stream` reads.
pub struct OutputSource {
    rx: mpsc::Receiver<Vec<u8>>,
    dropped: Arc<AtomicU64>,
}

pub fn channel() -> (OutputSink, OutputSource) {
    let (tx, rx) = mpsc::channel(QUEUED);
    let dropped = Arc::new(AtomicU64::new(0));
    (
        OutputSink {
            tx,
            dropped: dropped.clone(),
        },
        OutputSource { rx, dropped },
    )
}

/// Replaces the worker's secrets by `[redacted]` in a stream of bytes, also when one is split
/// across chunks: the end of what it has seen that could start a secret is held back until
/// the next chunk (or the end) says what it is.
pub struct Redactor {
    secrets: Vec<Vec<u8>>,
    held: Vec<u8>,
}

impl Redactor {
    pub fn new(secrets: &[String]) -> Redactor {
        Redactor {
            secrets: secrets
                .iter()
                .filter(|s| s.len() >= MIN_SECRET)
                .map(|s| s.as_bytes().to_vec())
                .collect(),
            held: Vec::new(),
        }
    }

    /// What of `data` (after what was held) can be sent now.
    pub fn push(&mut self, data: &[u8]) -> Vec<u8> {
        self.held.extend_from_slice(data);
        let mut out = redact(std::mem::take(&mut self.held), &self.secrets);
        let keep = self
            .secrets
            .iter()
            .map(|s| {
                (1..s.len().min(out.len() + 1))
                    .rev()
                    .find(|&k| out.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        self.held = out.split_off(out.len() - keep);
        out
    }

    /// What was held back, at the end.
    pub fn finish(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }
}

fn redact(mut bytes: Vec<u8>, secrets: &[Vec<u8>]) -> Vec<u8> {
    const REDACTED: &[u8] = b"[redacted]";
    for s in secrets {
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i..].starts_with(s) {
                out.extend_from_slice(REDACTED);
                i += s.len();
            } else {
                out.push(bytes[i]);
                i += 1;
            }
        }
        bytes = out;
    }
    bytes
}

/// Whether a `StreamOutput` failure means the lease is gone (send nothing more).
fn refused_for_good(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::NotFound
            | tonic::Code::FailedPrecondition
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::InvalidArgument
            | tonic::Code::Unimplemented
    )
}

type Call =
    tokio::task::JoinHandle<Result<tonic::Response<pb::StreamOutputResponse>, tonic::Status>>;

/// Sends `source` to the coordinator under the lease until the output ends (every sink
/// dropped), then a last chunk with `ended`. `open` starts one `StreamOutput` call on the
/// leader as it is then. Returns the bytes sent or dropped (the offset reached).
pub async fn stream<F, Fut>(
    mut open: F,
    lease_id: String,
    token: u64,
    mut source: OutputSource,
    secrets: Vec<String>,
) -> u64
where
    F: FnMut(ReceiverStream<pb::OutputChunk>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<pb::StreamOutputResponse>, tonic::Status>>
        + Send
        + 'static,
{
    let mut redactor = Redactor::new(&secrets);
    let mut offset = 0u64;
    let mut call: Option<(mpsc::Sender<pb::OutputChunk>, Call)> = None;
    let mut refused = false;
    let chunk = |offset: u64, data: Vec<u8>, ended: bool| pb::OutputChunk {
        lease_id: lease_id.clone(),
        token,
        offset,
        data,
        ended,
    };
    loop {
        let Some(first) = source.rx.recv().await else {
            break;
        };
        if refused {
            continue;
        }
        // Whatever else is waiting, up to one chunk's worth.
        let mut raw = first;
        while raw.len() < CHUNK_BYTES {
            match source.rx.try_recv() {
                Ok(more) => raw.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        // Bytes the pumps could not hand over: the coordinator sees the offset jump.
        offset += source.dropped.swap(0, Ordering::Relaxed);
        let data = redactor.push(&raw);
        for piece in data.chunks(CHUNK_BYTES) {
            let msg = chunk(offset, piece.to_vec(), false);
            offset += piece.len() as u64;
            match send(&mut open, &mut call, msg).await {
                Sent::Yes => {}
                Sent::Refused => {
                    refused = true;
                    break;
                }
            }
        }
    }
    if !refused {
        offset += source.dropped.swap(0, Ordering::Relaxed);
        let rest = redactor.finish();
        let len = rest.len() as u64;
        let _ = send(&mut open, &mut call, chunk(offset, rest, true)).await;
        offset += len;
    }
    if let Some((tx, handle)) = call {
        drop(tx);
        let _ = tokio::time::timeout(END_WAIT, handle).await;
    }
    offset
}

enum Sent {
    Yes,
    Refused,
}

/// Sends `msg` on the open call, opening one (again) when there is none or it broke: one
/// try on a fresh call, then the chunk is let go (a gap, not a stall).
async fn send<F, Fut>(
    open: &mut F,
    call: &mut Option<(mpsc::Sender<pb::OutputChunk>, Call)>,
    msg: pb::OutputChunk,
) -> Sent
where
    F: FnMut(ReceiverStream<pb::OutputChunk>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<pb::StreamOutputResponse>, tonic::Status>>
        + Send
        + 'static,
{
    for fresh in [false, true] {
        if fresh || call.is_none() {
            if fresh {
                tokio::time::sleep(REOPEN_WAIT).await;
            }
            let (tx, rx) = mpsc::channel(8);
            let handle = tokio::spawn(open(ReceiverStream::new(rx)));
            *call = Some((tx, handle));
        }
        let Some((tx, _)) = call.as_ref() else {
            continue;
        };
        // Never waits: a leader that stopped reading (frozen, partitioned) gets a gap, and
        // the run goes on to its uploads at once.
        match tx.try_send(msg.clone()) {
            Ok(()) | Err(mpsc::error::TrySendError::Full(_)) => return Sent::Yes,
            Err(mpsc::error::TrySendError::Closed(_)) => {}
        }
        // The call ended: why says whether to try again.
        if let Some((_, handle)) = call.take()
            && let Ok(Ok(Err(status))) = tokio::time::timeout(END_WAIT, handle).await
            && refused_for_good(&status)
        {
            tracing::debug!(error = %status.message(), "live output refused: sending no more");
            return Sent::Refused;
        }
    }
    Sent::Yes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_split_across_chunks_is_redacted() {
        let mut r = Redactor::new(&["sekrit-token-1234".into(), "short".into()]);
        let mut out = r.push(b"token: sekrit-to");
        out.extend(r.push(b"ken-1234 and short stays\n"));
        out.extend(r.finish());
        assert_eq!(
            String::from_utf8_lossy(&out),
            "token: [redacted] and short stays\n"
        );
    }

    #[test]
    fn what_cannot_start_a_secret_is_not_held() {
        let mut r = Redactor::new(&["sekrit-token-1234".into()]);
        assert_eq!(r.push(b"hello wor"), b"hello wor");
        // "se" could start the secret: held until the next chunk says.
        assert_eq!(r.push(b"ld se"), b"ld ");
        assert_eq!(r.push(b"e"), b"see");
        assert!(r.finish().is_empty());
    }

    #[tokio::test]
    async fn a_full_channel_drops_and_counts_never_waits() {
        let (sink, source) = channel();
        for _ in 0..QUEUED + 10 {
            sink.send(b"0123456789");
        }
        assert_eq!(source.dropped.load(Ordering::Relaxed), 100);
    }
}
