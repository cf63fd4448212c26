//! What dispatch decides by, without I/O: which idle worker gets a phase ([`choose`]), why a
//! task waits ([`waiting_reason`]), the pauses after failures and refusals, what manual mode
//! says to run next, and how long texts are kept.

use std::sync::Arc;
use std::time::Duration;

use automaton_workflow::{AgentId, State, TaskName};

/// A round runs at least this often (the offer timeouts, a worker back from a refusal).
pub(crate) const ROUND_EVERY: Duration = Duration::from_millis(250);
/// Rounds start at most this often, however often they are poked.
pub(crate) const ROUND_GAP: Duration = Duration::from_millis(5);
/// An offer the worker has not answered in this long is taken back.
pub(crate) const OFFER_TIMEOUT: Duration = Duration::from_secs(10);
/// A worker that refused work is not offered more for this long.
pub(crate) const REFUSAL_PAUSE: Duration = Duration::from_secs(1);
/// Runs kept per task.
pub(crate) const RUNS_KEPT: usize = 10;
/// The most of a run's output tail kept in memory (what a worker sends at most).
pub(crate) const TAIL_KEPT: usize = 16 * 1024;
/// A run's warnings kept, and the length of each.
pub(crate) const WARNINGS_KEPT: usize = 4;
pub(crate) const WARNING_BYTES: usize = 400;
/// After a failed run its task waits this long before it is offered again, doubled with
/// each further failure of the same phase, up to `RETRY_MAX_PAUSE`.
pub(crate) const RETRY_FIRST_PAUSE: Duration = Duration::from_secs(1);
pub(crate) const RETRY_MAX_PAUSE: Duration = Duration::from_secs(30);
/// How an operator's hold begins (`automaton stop`).
pub(crate) const STOPPED_BY: &str = "stopped by an operator";

/// Whether a hold waits for a person's decision (a limit's, failed runs', MAX_PHASE_TIME's:
/// durable and not an operator's own stop), shown with seed 002's line.
pub(crate) fn awaits_a_person(why: &str, durable: bool) -> bool {
    durable && !why.starts_with(STOPPED_BY)
}

/// Why a task with work waits in manual mode.
pub(crate) fn manual_waiting(task: &TaskName, work: State) -> String {
    format!("manual mode (Autopilot: Disabled): `automaton run {task}` runs its {work}")
}

/// Manual mode: the command that moves a task in `state` on next, if any (`held`: it is held
/// from dispatch; `running`: it has a live lease or a run asked for).
pub(crate) fn next_command(task: &TaskName, state: State, held: bool, running: bool) -> String {
    use automaton_workflow::{Gate, Phase};
    if held {
        return format!("automaton stop {task} --resume");
    }
    // A gate waits for a person even while the lease that reached it is still ending.
    if state.gate == Gate::AwaitingApproval {
        return format!("automaton approve {task}");
    }
    if running || state.phase.is_terminal() {
        return String::new();
    }
    match (state.phase, state.gate) {
        // Its sub-tasks run, each on its own.
        (Phase::Decomposition, Gate::Approved) => String::new(),
        _ => format!("automaton run {task}"),
    }
}

/// The last `max` bytes of `s` at most (from a character boundary): an output's tail.
pub(crate) fn clip_front(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].to_string()
}

/// The pause before a task whose phase failed `n` times (n ≥ 1) is offered again.
pub(crate) fn retry_pause(n: u32) -> Duration {
    RETRY_FIRST_PAUSE
        .saturating_mul(1u32 << n.saturating_sub(1).min(16))
        .min(RETRY_MAX_PAUSE)
}

/// `s` cut to at most `max` bytes (on a character boundary), marked when cut.
pub(crate) fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// An idle worker: a live, attached, undrained session with room for more leases.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub session: Arc<str>,
    pub name: AgentId,
    pub free: usize,
    pub capacity: u32,
    /// The largest estimated peak context (tokens) the worker takes.
    pub budget: u64,
    /// Its GPU memory, for people (`24 GiB`).
    pub gpu: String,
}

/// The dispatcher's one decision: which of the idle workers should get a phase whose work
/// needs `need` tokens of context (its estimated peak; `None`: unsized), in order of
/// preference (the grant may still refuse one, e.g. reviewer ≠ implementer). Only workers
/// whose budget holds the need; **best fit**: the smallest budget that holds it first, so
/// large GPUs stay free for large work; then the most free room, then by name.
pub(crate) fn choose(need: Option<u64>, idle: &[Slot]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..idle.len())
        .filter(|&i| idle[i].free > 0 && need.is_none_or(|n| idle[i].budget >= n))
        .collect();
    order.sort_by(|&a, &b| {
        let fit = match need {
            Some(_) => idle[a].budget.cmp(&idle[b].budget),
            None => std::cmp::Ordering::Equal,
        };
        fit.then_with(|| idle[b].free.cmp(&idle[a].free))
            .then_with(|| idle[a].name.cmp(&idle[b].name))
    });
    order
}

/// The order in which the idle workers are offered a phase: [`choose`]'s, less `excluded`
/// (reviewer ≠ implementer), with `preferred` first and `failed` (the worker whose run just
/// failed) last — stable sorts, so the rest keep their order. Implement is offered to the
/// task's past implementers first: a run on anyone else would bar one more worker from
/// reviewing it (with two workers, a re-run of implement on the other one — after a lost
/// run, a stop, a failover — would leave nobody to review it).
pub(crate) fn offer_order(
    need: Option<u64>,
    idle: &[Slot],
    excluded: &[AgentId],
    preferred: &[AgentId],
    failed: Option<&AgentId>,
) -> Vec<usize> {
    let mut order: Vec<usize> = choose(need, idle)
        .into_iter()
        .filter(|&i| !excluded.contains(&idle[i].name))
        .collect();
    order.sort_by_key(|&i| !preferred.contains(&idle[i].name));
    if let Some(failed) = failed {
        order.sort_by_key(|&i| &idle[i].name == failed);
    }
    order
}

/// Seed 001's rule for placing implement, in `automaton-workflow` with the rest of it.
pub(crate) use automaton_workflow::leaves_a_reviewer;

/// `a, b, c`.
pub(crate) fn names(agents: &[AgentId]) -> String {
    agents
        .iter()
        .map(AgentId::as_str)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a phase needing `need` tokens waits, given the idle workers and the fleet's largest
/// budget: e.g. `needs 90k tokens; largest idle worker holds 38k (gpu-b, 24 GiB)`.
pub(crate) fn waiting_reason(
    need: Option<u64>,
    idle: &[Slot],
    largest: Option<&(u64, AgentId, String)>,
) -> String {
    let k = |t: u64| format!("{}k", t / 1000);
    match (need, largest) {
        (_, None) => "waiting: no worker that takes work is connected".into(),
        (Some(n), Some((max, who, gpu))) if *max < n => format!(
            "waiting: needs {} tokens; the largest worker holds {} ({who}, {gpu}): no worker fits — split it",
            k(n),
            k(*max)
        ),
        (Some(n), Some(_)) => match idle.iter().filter(|s| s.free > 0).max_by_key(|s| s.budget) {
            Some(s) => format!(
                "waiting: needs {} tokens; largest idle worker holds {} ({}, {})",
                k(n),
                k(s.budget),
                s.name,
                s.gpu
            ),
            None => format!(
                "waiting: needs {} tokens; every worker that fits is busy",
                k(n)
            ),
        },
        (None, Some(_)) => "waiting: every worker is busy".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_awaiting_approval_says_approve_even_while_its_lease_is_still_ending() {
        let t: TaskName = "t".parse().expect("task");
        let at = |s: &str| -> State { s.parse().expect("state") };
        for running in [false, true] {
            assert_eq!(
                next_command(&t, at("research:awaiting_approval"), false, running),
                "automaton approve t"
            );
        }
        assert_eq!(next_command(&t, at("research"), false, true), "");
        assert_eq!(
            next_command(&t, at("research"), false, false),
            "automaton run t"
        );
        assert_eq!(
            next_command(&t, at("research:awaiting_approval"), true, false),
            "automaton stop t --resume"
        );
        assert_eq!(next_command(&t, at("complete"), false, false), "");
    }

    #[test]
    fn a_failed_tasks_pause_doubles_from_one_second_to_thirty() {
        let secs: Vec<u64> = (1..=8).map(|n| retry_pause(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_pause(u32::MAX), RETRY_MAX_PAUSE);
    }
}
