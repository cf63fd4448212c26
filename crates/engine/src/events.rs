//! The operators' live feed: events, their subscribers, and how the coordinator emits them
//! (only when somebody watches: building an event costs allocations on the hot path).

use automaton_workflow::{EventKind, State};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::SystemTime;

use tokio::sync::broadcast;

use crate::table::Live;

/// One entry of the operators' live feed.
#[derive(Debug, Clone)]
pub struct Event {
    pub seq: u64,
    pub at: SystemTime,
    pub kind: EventKind,
    pub task: String,
    pub agent: String,
    pub token: u64,
    pub detail: String,
    /// For [`EventKind::Transitioned`]: the state left and the state entered.
    pub moved: Option<(State, State)>,
}

/// A subscriber to the event feed; counted while it lives.
pub struct Subscription {
    pub rx: broadcast::Receiver<Event>,
    count: Arc<AtomicUsize>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The feed: its channel, its subscribers, its sequence.
pub(crate) struct Feed {
    events: broadcast::Sender<Event>,
    /// Live [`Subscription`]s: whether building an event is worth it.
    watchers_of_events: Arc<AtomicUsize>,
    seq: AtomicU64,
}

impl Feed {
    pub(crate) fn new() -> Feed {
        Feed {
            events: broadcast::channel(4096).0,
            watchers_of_events: Arc::new(AtomicUsize::new(0)),
            seq: AtomicU64::new(0),
        }
    }

    /// A feed of every event, for as long as the returned subscription lives.
    pub(crate) fn subscribe(&self) -> Subscription {
        self.watchers_of_events.fetch_add(1, Ordering::Relaxed);
        Subscription {
            rx: self.events.subscribe(),
            count: self.watchers_of_events.clone(),
        }
    }

    pub(crate) fn emit(
        &self,
        kind: EventKind,
        task: &str,
        agent: &str,
        token: u64,
        detail: String,
    ) {
        self.send(kind, task, agent, token, detail, None);
    }

    /// A `transitioned` event: `task` moved `from` → `to` (`detail` says more, if anything).
    pub(crate) fn emit_moved(
        &self,
        task: &str,
        agent: &str,
        token: u64,
        (from, to): (State, State),
        detail: &str,
    ) {
        if !self.watched() {
            return;
        }
        let text = if detail.is_empty() {
            format!("{from} → {to}")
        } else {
            format!("{from} → {to} ({detail})")
        };
        self.send(
            EventKind::Transitioned,
            task,
            agent,
            token,
            text,
            Some((from, to)),
        );
    }

    fn send(
        &self,
        kind: EventKind,
        task: &str,
        agent: &str,
        token: u64,
        detail: String,
        moved: Option<(State, State)>,
    ) {
        if !self.watched() {
            return;
        }
        tracing::debug!(kind = kind.name(), task, agent, token, detail = %detail, "event");
        let _ = self.events.send(Event {
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            at: SystemTime::now(),
            kind,
            task: task.to_string(),
            agent: agent.to_string(),
            token,
            detail,
            moved,
        });
    }

    #[inline]
    pub(crate) fn emit_renewed(&self, l: &Live) {
        if self.watched() {
            self.emit(
                EventKind::LeaseRenewed,
                &l.task.to_string(),
                l.agent.as_str(),
                l.token,
                String::new(),
            );
        }
    }

    /// Whether anyone watches the events (building an event costs allocations).
    #[inline]
    pub(crate) fn watched(&self) -> bool {
        // Not `events.receiver_count()`: that takes the channel's lock, on every request.
        self.watchers_of_events.load(Ordering::Relaxed) > 0
    }
}
