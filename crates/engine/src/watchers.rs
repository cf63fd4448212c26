//! Who must hear that a lease is gone. Each `KeepAlive` stream registers the leases it renews;
//! when a lease ends only the streams that named it are told, through their own channel. No
//! broadcast that every stream polls (a shared lock per renewal) and none that can drop a
//! notice for a slow reader.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use automaton_workflow::TaskName;
use tokio::sync::mpsc;

/// A lease that is gone, for the streams that named it.
#[derive(Debug, Clone)]
pub struct Lost {
    pub lease_id: String,
    pub task: TaskName,
    pub token: u64,
    pub reason: automaton_workflow::LeaseEnd,
}

/// What a stream is told.
#[derive(Debug)]
pub enum Notice {
    Lost(Lost),
    /// The server is shutting down: end the stream so the drain can complete.
    Stop,
}

#[derive(Default)]
pub struct Watchers {
    inner: Mutex<Inner>,
    /// Open streams: a lease ending while nobody streams costs no lock.
    open: AtomicUsize,
}

#[derive(Default)]
struct Inner {
    next: u64,
    stopped: bool,
    streams: HashMap<u64, mpsc::UnboundedSender<Notice>>,
    by_lease: HashMap<String, Vec<u64>>,
}

impl Watchers {
    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new stream: its id and its notices.
    pub fn open(&self) -> (u64, mpsc::UnboundedReceiver<Notice>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut inner = self.inner();
        inner.next += 1;
        let id = inner.next;
        if inner.stopped {
            let _ = tx.send(Notice::Stop);
        }
        inner.streams.insert(id, tx);
        self.open.fetch_add(1, Ordering::Relaxed);
        (id, rx)
    }

    /// `stream` must hear when `lease_id` ends. Call while the lease is known to be live
    /// (under the lease table's lock), so its end cannot slip in before the registration.
    pub fn watch(&self, stream: u64, lease_id: &str) {
        self.inner()
            .by_lease
            .entry(lease_id.to_string())
            .or_default()
            .push(stream);
    }

    /// A stream ended: forget it and the leases it named.
    pub fn close<'a>(&self, stream: u64, named: impl Iterator<Item = &'a String>) {
        let mut inner = self.inner();
        if inner.streams.remove(&stream).is_some() {
            self.open.fetch_sub(1, Ordering::Relaxed);
        }
        for id in named {
            if let Some(v) = inner.by_lease.get_mut(id) {
                v.retain(|s| *s != stream);
                if v.is_empty() {
                    inner.by_lease.remove(id);
                }
            }
        }
    }

    /// Whether any stream is open.
    pub fn any(&self) -> bool {
        self.open.load(Ordering::Relaxed) > 0
    }

    /// Tells the streams that named `lost.lease_id`.
    pub fn lost(&self, lost: &Lost) {
        let mut inner = self.inner();
        let Some(streams) = inner.by_lease.remove(&lost.lease_id) else {
            return;
        };
        for s in streams {
            if let Some(tx) = inner.streams.get(&s) {
                let _ = tx.send(Notice::Lost(lost.clone()));
            }
        }
    }

    /// Ends every stream, now and later (shutdown).
    pub fn stop_all(&self) {
        let mut inner = self.inner();
        inner.stopped = true;
        for tx in inner.streams.values() {
            let _ = tx.send(Notice::Stop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(id: &str) -> Lost {
        Lost {
            lease_id: id.into(),
            task: "t".parse().expect("valid"),
            token: 1,
            reason: automaton_workflow::LeaseEnd::Released,
        }
    }

    #[test]
    fn only_the_streams_that_named_a_lease_hear_of_its_end() {
        let w = Watchers::default();
        let (a, mut ra) = w.open();
        let (_b, mut rb) = w.open();
        w.watch(a, "x");
        w.lost(&lost("x"));
        assert!(matches!(ra.try_recv(), Ok(Notice::Lost(l)) if l.lease_id == "x"));
        assert!(rb.try_recv().is_err());
        // Told once: the registration ends with the lease.
        w.lost(&lost("x"));
        assert!(ra.try_recv().is_err());
    }

    #[test]
    fn a_closed_stream_is_forgotten_and_stop_reaches_late_streams() {
        let w = Watchers::default();
        let (a, _ra) = w.open();
        w.watch(a, "x");
        w.close(a, [String::from("x")].iter());
        assert!(w.inner().by_lease.is_empty());
        assert_eq!(w.open.load(Ordering::Relaxed), 0);
        w.stop_all();
        let (_c, mut rc) = w.open();
        assert!(matches!(rc.try_recv(), Ok(Notice::Stop)));
    }
}
