//! Who has held each phase of each task (`.state.holders`, and `.state.implementer` for
//! implement): no holder may approve its phase's gate, and an implementer may not review.
//!
//! The log is what makes a holder durable: every grant record names its agent, task and
//! phase, and every rewrite of the log carries an `H` record for each holder not yet written
//! to its task's files. The files are written when they are needed — before an approval of
//! the task, before a transition moves it on (so a phase's holders are in its files by the
//! time anyone can approve or review it), and at shutdown — each durably. Writing them on
//! every first claim of a (task, phase, agent) cost a fifth of the claims at 64 clients, even
//! from a background thread: two syncs, a temporary file and a rename in a large folder each.
//! A holder is pending from the moment its grant is in the table; only once the grant is
//! committed may it reach the files (a grant taken back leaves no trace).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use automaton_store::Project;
use automaton_workflow::{AgentId, Phase, State, TaskName};

use automaton_backend::Record;

type Key = (TaskName, AgentId, State);

/// One pending holder of a task: who, in which state, and whether its grant is committed.
type Entry = (AgentId, State, bool);

/// The holders on their way to the files, by task (a lookup allocates nothing: the same
/// holder claiming again, the common case, costs one map probe).
#[derive(Clone, Default)]
pub(crate) struct Holders {
    inner: Arc<Mutex<HashMap<TaskName, Vec<Entry>>>>,
}

impl Holders {
    /// `recovered`: the holders the log names (all committed).
    pub(crate) fn new(recovered: Vec<Key>) -> Holders {
        let holders = Holders::default();
        {
            let mut p = holders.lock();
            for (task, agent, state) in recovered {
                let e = p.entry(task).or_default();
                if !e.iter().any(|(a, s, _)| *a == agent && *s == state) {
                    e.push((agent, state, true));
                }
            }
        }
        holders
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<TaskName, Vec<Entry>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A grant just entered the table (call under the table's lock, before its record is
    /// queued: a rewrite's snapshot then carries it).
    pub(crate) fn granted(&self, task: &TaskName, agent: &AgentId, state: State) {
        let mut p = self.lock();
        match p.get_mut(task) {
            Some(e) if e.iter().any(|(a, s, _)| a == agent && *s == state) => {}
            Some(e) => e.push((agent.clone(), state, false)),
            None => {
                p.insert(task.clone(), vec![(agent.clone(), state, false)]);
            }
        }
    }

    /// The grant is durable: its holder may reach the files.
    pub(crate) fn committed(&self, task: &TaskName, agent: &AgentId, state: State) {
        if let Some(e) = self.lock().get_mut(task)
            && let Some(h) = e.iter_mut().find(|(a, s, _)| a == agent && *s == state)
        {
            h.2 = true;
        }
    }

    /// The grant was taken back before it was durable.
    pub(crate) fn taken_back(&self, task: &TaskName, agent: &AgentId, state: State) {
        let mut p = self.lock();
        if let Some(e) = p.get_mut(task) {
            e.retain(|(a, s, committed)| *committed || a != agent || *s != state);
            if e.is_empty() {
                p.remove(task);
            }
        }
    }

    /// The agents that implemented `task` by grants not yet in its files.
    pub(crate) fn pending_implementers(&self, task: &TaskName) -> Vec<AgentId> {
        self.lock().get(task).map_or_else(Vec::new, |e| {
            e.iter()
                .filter(|(_, s, _)| s.phase == Phase::Implement)
                .map(|(a, _, _)| a.clone())
                .collect()
        })
    }

    /// `H` records for every pending holder, for a rewrite of the log.
    pub(crate) fn records(&self) -> Vec<Record> {
        self.lock()
            .iter()
            .flat_map(|(task, e)| {
                e.iter().map(|(agent, state, _)| Record::Holder {
                    task: task.clone(),
                    agent: agent.clone(),
                    state: *state,
                })
            })
            .collect()
    }

    /// Writes `task`'s committed pending holders to its files, durably (before an approval
    /// reads them, before a transition moves the task on). Blocking: call off the async
    /// threads.
    pub(crate) fn flush(&self, project: &Project, task: &TaskName) -> Result<(), crate::Error> {
        self.write(project, |t| t == task)
    }

    /// Writes every committed pending holder (at shutdown).
    pub(crate) fn flush_all(&self, project: &Project) -> Result<(), crate::Error> {
        self.write(project, |_| true)
    }

    fn write(
        &self,
        project: &Project,
        which: impl Fn(&TaskName) -> bool,
    ) -> Result<(), crate::Error> {
        let due: Vec<Key> = self
            .lock()
            .iter()
            .filter(|(t, _)| which(t))
            .flat_map(|(t, e)| {
                e.iter()
                    .filter(|(_, _, committed)| *committed)
                    .map(|(a, s, _)| (t.clone(), a.clone(), *s))
            })
            .collect();
        for (task, agent, state) in due {
            project.record_holder(&task, &agent, state)?;
            let mut p = self.lock();
            if let Some(e) = p.get_mut(&task) {
                e.retain(|(a, s, _)| *a != agent || *s != state);
                if e.is_empty() {
                    p.remove(&task);
                }
            }
        }
        Ok(())
    }
}
