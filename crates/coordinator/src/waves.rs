//! Decomposed tasks: the sub-tasks a parent's `DECOMPOSITION.md` names, the waves they run
//! in, and how large each is.

use automaton_workflow::TaskName;

use crate::Error;
use crate::state::Coordinator;

/// What stands between a task and a worker besides its state.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sizing {
    /// The estimated peak context (tokens) a worker's budget must hold; `None`: unsized.
    pub need: Option<u64>,
    /// Why it may not start yet (its wave's predecessors), if so.
    pub blocked: Option<String>,
}

impl Coordinator {
    /// A task's size and readiness.
    pub(crate) async fn sizing(&self, _task: &TaskName) -> Sizing {
        Sizing::default()
    }

    /// A parent at `decomposition:approved`: makes its sub-tasks; ends it once they all have.
    pub(crate) async fn advance_parent(&self, _task: &TaskName) -> Result<(), Error> {
        Ok(())
    }
}
