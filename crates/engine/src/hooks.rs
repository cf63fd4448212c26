//! What the engine tells the parts wired around it (dispatch, the worker sessions) without
//! knowing them: the engine calls these, never the other way round, so the engine imports
//! neither. Calls on the lease path (a grant in a session, an end) are one `dyn` call each.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use automaton_workflow::{AgentId, TaskName};

use crate::Error;
use crate::table::Live;

pub trait Hooks: Send + Sync {
    /// The session a claim by `agent` goes into: `requested`, or (empty) `agent`'s live
    /// session. Called under the lease table's lock, so a session cannot die between this
    /// check and the grant's insertion without the grant being ended with it.
    fn session_for_claim(&self, agent: &AgentId, requested: &str) -> Result<Arc<str>, Error>;

    /// Lease `l` ended for `reason`, durably: its session hears of it, and its task may be
    /// dispatched again.
    fn lease_ended(&self, l: &Live, reason: automaton_workflow::LeaseEnd);

    /// A task changed (a transition, an approval, an escalation): there may be work.
    fn task_changed(&self);

    /// `task` was created.
    fn task_created(&self, task: &TaskName);

    /// `task`'s phase is about to end under its lease: dispatch reads what it counts of the
    /// task (runs, failures, iterations) before the move changes it.
    fn load_counts<'a>(
        &'a self,
        task: &'a TaskName,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

    /// `task`'s phase is done under its lease (counted before the lease ends, so no round
    /// can offer the next phase first). Whether a manual-mode run request was used up.
    fn phase_done(&self, task: &TaskName) -> bool;

    /// A run request used up by `task`'s transition is written away before the answer (a
    /// restart must not run a phase nobody asked for).
    fn save_run_request<'a>(
        &'a self,
        task: &'a TaskName,
    ) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>>;
}
