//! Live agent output: what workers stream of each run (`Work.StreamOutput`) kept as a bounded
//! tail per run, in memory, and served to operators (`Workers.TailOutput`: `automaton logs`,
//! the console). Output is for people watching, not state: it is not made durable, a
//! restart or a failover starts with none, and a full tail drops its oldest bytes. Bounds:
//! [`RUN_TAIL_BYTES`] per run, [`MAX_RUNS`] runs, ended runs evicted oldest first once all
//! kept tails pass [`TOTAL_BYTES`].
//!
//! It must not block a worker on a slow reader: readers copy out under a short lock and wait
//! on a `Notify`; a reader that falls behind the tail is told how many bytes it skipped.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use automaton_engine::{Engine, Error};
use automaton_proto::v1 as pb;
use automaton_workflow::TaskName;
use tokio::sync::Notify;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::IntoStatus;
use crate::auth::caller;
use crate::wire::{bound_agent, operator, task_name};

/// The most of one run's output kept (its end).
pub const RUN_TAIL_BYTES: usize = 256 << 10;
/// Runs whose output is kept at most (live and ended).
pub const MAX_RUNS: usize = 1024;
/// Ended runs' tails are evicted, oldest first, while all tails hold more than this.
pub const TOTAL_BYTES: usize = 64 << 20;
/// The largest `OutputChunk.data` taken.
pub const MAX_CHUNK_BYTES: usize = 64 << 10;
/// The largest offset taken (an output of 1 PiB): far past any run, far from overflow.
pub const MAX_OFFSET: u64 = 1 << 50;
/// Most bytes per `OutputEvent` sent to a reader.
const EVENT_BYTES: usize = 64 << 10;
/// How often a follower looks whether the run's lease still lives, when nothing comes.
const LIVENESS_CHECK: Duration = Duration::from_secs(2);

/// One run's kept output.
pub(crate) struct RunOutput {
    pub task: TaskName,
    pub lease_id: String,
    pub token: u64,
    pub phase: String,
    pub worker: String,
    tail: Mutex<Tail>,
    notify: Notify,
}

#[derive(Default)]
struct Tail {
    bytes: VecDeque<u8>,
    /// The offset of `bytes[0]` in the run's whole output.
    start: u64,
    /// Why the output ended, once it has.
    ended: Option<String>,
}

impl Tail {
    fn end(&self) -> u64 {
        self.start + self.bytes.len() as u64
    }
}

/// What a reader gets from one look at a tail.
struct Read {
    skipped: u64,
    offset: u64,
    data: Vec<u8>,
    ended: Option<String>,
}

impl RunOutput {
    fn lock(&self) -> MutexGuard<'_, Tail> {
        self.tail.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes `data` at `offset`: what is already here is skipped, a jump ahead is a gap.
    /// Returns the end of what is kept.
    fn append(&self, offset: u64, data: &[u8]) -> u64 {
        let mut t = self.lock();
        if t.ended.is_some() {
            return t.end();
        }
        let end = t.end();
        let new = if offset >= end {
            if offset > end {
                // A gap: what the worker dropped (or sent elsewhere) is not kept.
                t.bytes.clear();
                t.start = offset;
            }
            data
        } else {
            let have = usize::try_from(end - offset).unwrap_or(usize::MAX);
            &data[have.min(data.len())..]
        };
        t.bytes.extend(new);
        let over = t.bytes.len().saturating_sub(RUN_TAIL_BYTES);
        if over > 0 {
            t.bytes.drain(..over);
            t.start += over as u64;
        }
        let end = t.end();
        drop(t);
        if !new.is_empty() {
            self.notify.notify_waiters();
        }
        end
    }

    /// An event of this run at `offset`, with no bytes.
    fn event_at(&self, offset: u64) -> pb::OutputEvent {
        pb::OutputEvent {
            task: self.task.to_string(),
            lease_id: self.lease_id.clone(),
            phase: self.phase.clone(),
            worker: self.worker.clone(),
            offset,
            ..Default::default()
        }
    }

    fn finish(&self, why: &str) {
        let mut t = self.lock();
        if t.ended.is_none() {
            t.ended = Some(why.to_string());
            drop(t);
            self.notify.notify_waiters();
        }
    }

    fn is_ended(&self) -> bool {
        self.lock().ended.is_some()
    }

    fn kept(&self) -> usize {
        self.lock().bytes.len()
    }

    /// Up to `EVENT_BYTES` from `from` (or from the oldest byte kept, counting the skip).
    fn read(&self, from: u64) -> Read {
        let t = self.lock();
        let at = from.max(t.start);
        let skip_in = usize::try_from(at - t.start).unwrap_or(usize::MAX);
        let data: Vec<u8> = t
            .bytes
            .iter()
            .skip(skip_in)
            .take(EVENT_BYTES)
            .copied()
            .collect();
        let caught_up = at + data.len() as u64 >= t.end();
        Read {
            skipped: at - from.min(at),
            offset: at,
            data,
            ended: if caught_up { t.ended.clone() } else { None },
        }
    }
}

/// Every run's kept output.
#[derive(Default)]
pub(crate) struct Outputs {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    runs: HashMap<String, Arc<RunOutput>>,
    /// Lease ids, oldest run first.
    order: VecDeque<String>,
    /// Each task's latest run.
    latest: HashMap<TaskName, String>,
}

impl Outputs {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The run of `lease_id`, made on its first chunk.
    fn run(
        &self,
        task: &TaskName,
        lease_id: &str,
        token: u64,
        phase: &str,
        worker: &str,
    ) -> Arc<RunOutput> {
        let mut inner = self.lock();
        if let Some(r) = inner.runs.get(lease_id) {
            return r.clone();
        }
        let r = Arc::new(RunOutput {
            task: task.clone(),
            lease_id: lease_id.to_string(),
            token,
            phase: phase.to_string(),
            worker: worker.to_string(),
            tail: Mutex::default(),
            notify: Notify::new(),
        });
        inner.runs.insert(lease_id.to_string(), r.clone());
        inner.order.push_back(lease_id.to_string());
        inner.latest.insert(task.clone(), lease_id.to_string());
        inner.evict();
        r
    }

    /// The run of `lease_id`, or `task`'s latest.
    fn find(&self, task: &TaskName, lease_id: &str) -> Option<Arc<RunOutput>> {
        let inner = self.lock();
        let id = if lease_id.is_empty() {
            inner.latest.get(task)?
        } else {
            lease_id
        };
        inner.runs.get(id).filter(|r| &r.task == task).cloned()
    }

    /// Bytes kept over all runs (for tests and metrics).
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.lock().runs.values().map(|r| r.kept()).sum()
    }
}

impl Inner {
    /// Drops ended runs, oldest first, while there are too many runs or too many bytes; then,
    /// past `MAX_RUNS`, the oldest of any.
    fn evict(&mut self) {
        let mut total: usize = self.runs.values().map(|r| r.kept()).sum();
        let mut i = 0;
        while (self.order.len() > MAX_RUNS || total > TOTAL_BYTES) && i < self.order.len() {
            let ended = self.runs.get(&self.order[i]).is_none_or(|r| r.is_ended());
            if ended {
                let id = self.order.remove(i).expect("i < len");
                total -= self.remove(&id);
            } else {
                i += 1;
            }
        }
        while self.order.len() > MAX_RUNS {
            let id = self.order.pop_front().expect("len > MAX_RUNS");
            self.remove(&id);
        }
    }

    fn remove(&mut self, id: &str) -> usize {
        let Some(r) = self.runs.remove(id) else {
            return 0;
        };
        if self.latest.get(&r.task).is_some_and(|l| l == id) {
            self.latest.remove(&r.task);
        }
        // Followers of it see it end rather than wait for ever.
        r.finish("no longer kept");
        r.kept()
    }
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

/// `Work.StreamOutput`: every chunk is checked against the lease (id, token, holder).
pub(crate) async fn stream_output(
    engine: &Arc<Engine>,
    outputs: &Arc<Outputs>,
    req: Request<Streaming<pb::OutputChunk>>,
) -> Result<Response<pb::StreamOutputResponse>, Status> {
    let bound = bound_agent(&caller(&req))?;
    let mut chunks = req.into_inner();
    let mut run: Option<Arc<RunOutput>> = None;
    let mut end = 0;
    while let Some(chunk) = chunks.next().await {
        let c = chunk?;
        if c.data.len() > MAX_CHUNK_BYTES {
            return Err(Error::Invalid(format!(
                "an output chunk of {} bytes is over {MAX_CHUNK_BYTES}: send smaller chunks",
                c.data.len()
            ))
            .into_status());
        }
        if c.offset.saturating_add(c.data.len() as u64) > MAX_OFFSET {
            return Err(Error::Invalid(format!(
                "an output offset of {} is past {MAX_OFFSET}: send offsets from 0, the bytes of the run's output so far",
                c.offset
            ))
            .into_status());
        }
        if run.as_ref().is_some_and(|r| r.lease_id != c.lease_id) {
            return Err(Error::Invalid(
                "one StreamOutput call carries one lease's output: open another call for another lease"
                    .into(),
            )
            .into_status());
        }
        let live = match engine
            .lease_for_work(&c.lease_id, c.token, bound.as_ref())
            .await
        {
            Ok(l) => l,
            Err(e) => {
                if let Some(r) = &run {
                    r.finish("the run's lease ended");
                }
                return Err(e.into_status());
            }
        };
        let r = run.get_or_insert_with(|| {
            outputs.run(
                &live.task,
                &live.lease_id,
                live.token,
                &live.state.phase.to_string(),
                live.agent.as_str(),
            )
        });
        end = r.append(c.offset, &c.data);
        if c.ended {
            r.finish("output closed");
            break;
        }
    }
    Ok(Response::new(pb::StreamOutputResponse { end }))
}

/// `Workers.TailOutput`.
pub(crate) async fn tail_output(
    engine: &Arc<Engine>,
    outputs: &Arc<Outputs>,
    shutdown: &tokio::sync::watch::Receiver<bool>,
    req: Request<pb::TailOutputRequest>,
) -> Result<Response<Stream<pb::OutputEvent>>, Status> {
    operator(&req, "TailOutput")?;
    let r = req.into_inner();
    let task = task_name(&r.task)?;
    let Some(run) = outputs.find(&task, &r.lease_id) else {
        let which = if r.lease_id.is_empty() {
            String::new()
        } else {
            format!(" of run '{}'", automaton_workflow::excerpt(&r.lease_id))
        };
        return Err(Status::not_found(format!(
            "no output{which} of '{task}' is kept: it has run nothing since this coordinator started leading (see `automaton status --task {task}` for its runs)"
        )));
    };
    // A run whose worker died, or whose lease ended with nothing more sent, ends here.
    if !run.is_ended()
        && engine
            .lease_for_work(&run.lease_id, run.token, None)
            .await
            .is_err()
    {
        run.finish("the run's lease ended");
    }
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    let engine = engine.clone();
    let mut shutdown = shutdown.clone();
    tokio::spawn(async move {
        let mut at = {
            let t = run.lock();
            match r.tail_bytes {
                0 => t.start,
                n => t.end().saturating_sub(n).max(t.start),
            }
        };
        loop {
            let notified = run.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let read = run.read(at);
            let sent_bytes = !read.data.is_empty();
            let ended = read.ended.clone();
            if sent_bytes || read.skipped > 0 || ended.is_some() {
                at = read.offset + read.data.len() as u64;
                let ev = pb::OutputEvent {
                    data: read.data,
                    skipped: read.skipped,
                    ended: ended.is_some(),
                    end_reason: ended.clone().unwrap_or_default(),
                    ..run.event_at(read.offset)
                };
                if tx.send(Ok(ev)).await.is_err() || ended.is_some() {
                    return;
                }
                if sent_bytes {
                    continue;
                }
            }
            if !r.follow {
                // What is kept, sent: the reader asked for no more.
                let _ = tx.send(Ok(run.event_at(at))).await;
                return;
            }
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep(LIVENESS_CHECK) => {
                    // A worker that died, or a lease ended while nothing came: the
                    // output will not end on its own.
                    if engine.lease_for_work(&run.lease_id, run.token, None).await.is_err() {
                        run.finish("the run's lease ended");
                    }
                }
                () = tx.closed() => return,
                _ = shutdown.changed() => return,
            }
        }
    });
    Ok(Response::new(ReceiverStream::new(rx)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(s: &str) -> TaskName {
        s.parse().expect("a task name")
    }

    #[test]
    fn a_run_keeps_at_most_its_tail_and_counts_what_a_reader_skipped() {
        let o = Outputs::default();
        let r = o.run(&task("t"), "l1", 1, "research", "gpu-a");
        let big = vec![b'x'; RUN_TAIL_BYTES + 1000];
        assert_eq!(r.append(0, &big), big.len() as u64);
        assert_eq!(r.kept(), RUN_TAIL_BYTES);
        let read = r.read(0);
        assert_eq!(read.skipped, 1000);
        assert_eq!(read.offset, 1000);
        assert_eq!(read.data.len(), EVENT_BYTES);
    }

    #[test]
    fn bytes_sent_again_are_skipped_and_a_jump_ahead_is_a_gap() {
        let o = Outputs::default();
        let r = o.run(&task("t"), "l1", 1, "research", "gpu-a");
        r.append(0, b"hello ");
        // The worker sends again after a failover: the overlap is not doubled.
        assert_eq!(r.append(3, b"lo world"), 11);
        assert_eq!(r.read(0).data, b"hello world");
        // It dropped 5 bytes: they are a gap, not zeros.
        assert_eq!(r.append(16, b"!"), 17);
        let read = r.read(11);
        assert_eq!(
            (read.skipped, read.offset, read.data),
            (5, 16, b"!".to_vec())
        );
    }

    #[test]
    fn ended_runs_are_evicted_first_and_the_total_stays_bounded() {
        let o = Outputs::default();
        let chunk = vec![b'y'; RUN_TAIL_BYTES];
        let live = o.run(&task("live"), "live", 1, "implement", "gpu-a");
        live.append(0, &chunk);
        let n = TOTAL_BYTES / RUN_TAIL_BYTES + 8;
        for i in 0..n {
            let r = o.run(
                &task(&format!("t{i}")),
                &format!("l{i}"),
                1,
                "research",
                "gpu-a",
            );
            r.append(0, &chunk);
            r.finish("output closed");
        }
        // One more run triggers the eviction of what passed the total.
        o.run(&task("last"), "last", 1, "research", "gpu-a");
        assert!(o.kept() <= TOTAL_BYTES, "{} kept", o.kept());
        assert!(o.find(&task("live"), "").is_some(), "a live run is kept");
        assert!(
            o.find(&task("t0"), "").is_none(),
            "the oldest ended run went"
        );
        assert!(o.find(&task(&format!("t{}", n - 1)), "").is_some());
    }

    #[test]
    fn past_max_runs_the_oldest_go_even_live_ones() {
        let o = Outputs::default();
        for i in 0..MAX_RUNS + 10 {
            o.run(
                &task(&format!("t{i}")),
                &format!("l{i}"),
                1,
                "research",
                "gpu-a",
            );
        }
        assert_eq!(o.lock().runs.len(), MAX_RUNS);
        assert!(o.find(&task("t0"), "").is_none());
    }

    #[test]
    fn a_lease_id_of_another_task_is_not_found() {
        let o = Outputs::default();
        o.run(&task("a"), "la", 1, "research", "gpu-a");
        assert!(o.find(&task("b"), "la").is_none());
        assert!(o.find(&task("a"), "la").is_some());
    }
}
