//! Dispatch: the coordinator offers work over the workers' sessions.
//!
//! A round looks at every task, oldest first. A task in `new` is started (moved to
//! `research`); an approved gate moves on to the phase its artifact declares with a `Next:`
//! line, or to the default path (`automaton_workflow::progress`); a task with work (an open
//! phase with a deliverable) that nobody holds goes to an idle worker, chosen by
//! [`choose`], with a lease owned by that worker's session. The grant enforces every rule
//! (separation of duties included): a refused grant tries the next worker. The worker
//! accepts or refuses on its stream; an offer unanswered for [`OFFER_TIMEOUT`] is taken back.
//!
//! Rounds run when something changes (a lease ends, a task is created, approved or
//! transitioned, a worker joins or answers) and every [`ROUND_EVERY`] otherwise.
//!
//! Runs: workers report each agent run's lifecycle (seed 003: requested → starting → active
//! → stopping → stopped, with a stop reason); the last ones per task are kept for
//! `automaton status --task` and `automaton workers`, with a failed run's output tail (the
//! worker's last 16 KiB in memory, its last 4 KiB in `.state.dispatch`) and a run's warnings
//! (an implement that changed no code is also a `no_code_change` event). A failed run
//! releases its lease and is logged at WARN; its task is offered again only after a pause
//! ([`retry_pause`]: 1 s, doubled with each failure of the phase, at most 30 s, kept in
//! `.state.dispatch` across restarts) and to another fitting idle worker before the one that
//! failed it; after `max_attempts` failed runs of one phase the task is held from dispatch,
//! with the reason.
//!
//! Restarts: what dispatch must not forget — an operator's and the limits' holds, the failure
//! and iteration counts, when a task's first run was offered, the need a sub-task was first
//! dispatched with, what its runs used, its last runs — is each task's `.state.dispatch`
//! (store), written durably when a hold or count changes and when a run stops (a hold before
//! it is acknowledged), read for every task before the first round and before any change to
//! a task. The live runs are rebuilt from the workers: a resumed session reports the runs it
//! still has and the coordinator adopts them; a lease of a resumed session whose run the
//! worker no longer has ends (`run_lost`) and its task is offered again (see
//! [`Coordinator::resumed_runs`]); a `stopped` for a run the coordinator does not know is
//! applied to its lease all the same.

mod delivery;
mod holds;
mod parents;
mod policy;
mod rounds;
mod runs;
pub(crate) mod waves;
mod work;

pub(crate) use policy::{Slot, next_command};
#[cfg(test)]
pub(crate) use policy::{choose, leaves_a_reviewer, offer_order, waiting_reason};
pub(crate) use work::{Limits, Work};
