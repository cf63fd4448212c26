//! The `.state.lock` views: the log's materialised view for file readers, written off the
//! request path at low priority.

use std::collections::hash_map::Entry;
use std::time::{Duration, Instant};

use automaton_store::Project;
use automaton_workflow::TaskName;

use crate::table::{Live, Table};

/// A task's `.state.lock` view is written once its latest change is this old: a lease
/// granted and ended within it never touches the disk at all.
const VIEW_DELAY: Duration = Duration::from_secs(1);
/// ...or once its oldest unwritten change is this old, so a task that keeps changing faster
/// than [`VIEW_DELAY`] still has its view written at this rhythm.
const VIEW_MAX_LAG: Duration = Duration::from_secs(5);

/// Where views go: the writer thread's queue.
pub(crate) struct Views(std::sync::mpsc::Sender<(TaskName, Option<automaton_store::Lease>)>);

impl Views {
    pub(crate) fn send(&self, task: &TaskName, lease: Option<automaton_store::Lease>) {
        let _ = self.0.send((task.clone(), lease));
    }

    /// Sends `l`'s view (`shown`: the lease, or `false` for its removal) only while `l` is
    /// still its task's entry in `table` (or, for a removal, no other lease is): decided and
    /// sent under the table's lock, so the view of a grant or end that finished late never
    /// overwrites a newer lease's. Views of one task are written in the order they are sent.
    pub(crate) fn of(&self, table: &Table, l: &Live, shown: bool) {
        let entry = table.entry(&l.task);
        let current = entry.is_some_and(|e| e.lease_id == l.lease_id);
        if shown && current {
            self.send(&l.task, Some(l.view()));
        } else if !shown && (current || entry.is_none()) {
            self.send(&l.task, None);
        }
    }
}

/// Writes `.state.lock` views off the request path, at low priority. A task's view is written
/// once its latest change is [`VIEW_DELAY`] old (or its oldest unwritten one [`VIEW_MAX_LAG`]
/// old), with only the latest view of that task; removing a view that was never written is
/// skipped. So a lease that lives less than `VIEW_DELAY` never touches the disk,
/// and the file work (path lookups in a large `tasks/` folder are slow on this filesystem)
/// does not compete with requests for the CPU. The thread sleeps between passes rather than
/// waiting on the channel, so senders never have to wake it.
pub(crate) fn spawn_view_writer(
    project: Project,
    written_at_start: std::collections::HashSet<TaskName>,
) -> Views {
    let (tx, rx) = std::sync::mpsc::channel::<(TaskName, Option<automaton_store::Lease>)>();
    let _ = std::thread::Builder::new()
        .name("lease-views".into())
        .spawn(move || {
            // The views are a cache for file readers: under load they wait for spare CPU
            // (and coalesce further) rather than compete with requests. On Linux the
            // priority of "this process" set from a thread is that thread's alone.
            #[cfg(unix)]
            if let Err(e) = rustix::process::setpriority_process(None, 19) {
                tracing::debug!(error = %e, "cannot lower the lease-view thread's priority");
            }
            // Per task: its latest view, when its oldest unwritten change came, and when
            // its latest one did.
            let mut pending: std::collections::HashMap<
                TaskName,
                (Option<automaton_store::Lease>, Instant, Instant),
            > = std::collections::HashMap::new();
            // Views on disk: those the repair at start wrote, then what this thread writes.
            let mut on_disk = written_at_start;
            let tick = VIEW_DELAY / 10;
            loop {
                loop {
                    match rx.try_recv() {
                        Ok((task, lease)) => {
                            let now = Instant::now();
                            match pending.entry(task) {
                                Entry::Occupied(mut e) => {
                                    let e = e.get_mut();
                                    e.0 = lease;
                                    e.2 = now;
                                }
                                Entry::Vacant(e) => {
                                    e.insert((lease, now, now));
                                }
                            }
                        }
                        Err(std::sync::mpsc::TryRecvError::Empty) => break,
                        Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                    }
                }
                let due: Vec<TaskName> = pending
                    .iter()
                    .filter(|(_, (_, first, last))| {
                        last.elapsed() >= VIEW_DELAY || first.elapsed() >= VIEW_MAX_LAG
                    })
                    .map(|(t, _)| t.clone())
                    .collect();
                for task in due {
                    let Some((lease, _, _)) = pending.remove(&task) else {
                        continue;
                    };
                    if lease.is_none() && !on_disk.contains(&task) {
                        continue;
                    }
                    match project.write_lease_view(&task, lease.as_ref()) {
                        Ok(()) if lease.is_some() => {
                            on_disk.insert(task);
                        }
                        Ok(()) => {
                            on_disk.remove(&task);
                        }
                        Err(e) => {
                            tracing::warn!(task = %task, error = %e, "cannot write the lease view")
                        }
                    }
                }
                std::thread::sleep(tick);
            }
        });
    Views(tx)
}
