//! Decomposed tasks: the sub-tasks a parent's `DECOMPOSITION.md` names, the waves they run
//! in, how large each is, and how the parent ends.
//!
//! - When a parent reaches `decomposition:approved`, each sub-task of its decomposition is
//!   created (`parent/sub`, with `PARENT_SPEC.md` and `VRAM_CONFIG.md`, "Fits within VRAM"
//!   judged against the fleet registered at that moment). Running it again changes nothing;
//!   an edited decomposition creates the new sub-tasks and reports the orphans.
//! - A sub-task is ready when everything it depends on passed (`complete`) and was merged
//!   into the parent's branch, where the sub-task's own branch then starts (issue 31); one
//!   that depends on a sub-task that ended otherwise waits for a person. It needs a worker whose
//!   budget holds its estimated peak context (its separated phases — by default code review,
//!   which its implementer may not take — need half, so a sub-task only one worker can hold
//!   can still be reviewed).
//! - Sizing learns: the peak context agents report against their sub-task's estimate gives a
//!   ratio (bounded to 0.5–2) that corrects the estimates of the sub-tasks not yet dispatched.
//! - The parent completes when every sub-task passed; any FAIL or NEEDS_REVIEW makes it
//!   `human_intervention` with seed 002's counts.

use std::sync::Arc;
use std::time::SystemTime;

use automaton_workflow::Decomposition;

/// A sub-task's VRAM configuration file (seed 002).
pub(crate) const VRAM_CONFIG: &str = "VRAM_CONFIG.md";
/// What a separated phase (its implementer may not take it) needs of the sub-task's estimate.
pub(crate) const SEPARATED_SHARE: f64 = 0.5;
/// Bounds of the learned correction.
pub(crate) const RATIO_MIN: f64 = 0.5;
pub(crate) const RATIO_MAX: f64 = 2.0;

/// What stands between a task and a worker besides its state.
#[derive(Debug, Default, Clone)]
pub(crate) struct Sizing {
    /// The estimated peak context (tokens) a worker's budget must hold; `None`: unsized.
    pub need: Option<u64>,
    /// Why it may not start yet (its wave's predecessors), if so.
    pub blocked: Option<String>,
    /// Its wave (1, 2, …), for a sub-task.
    pub wave: Option<usize>,
}

/// A parent's decomposition as last read, with the file's identity (size, mtime).
#[derive(Clone)]
pub(crate) struct Plan {
    pub(crate) stamp: (u64, Option<SystemTime>),
    pub decomposition: Arc<Decomposition>,
    /// The folders of this plan's parent were checked for orphans (once per version of the
    /// decomposition: a listing of every task is not for every dispatch round).
    pub orphans_checked: bool,
}

/// Where a sub-task a sub-task depends on stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Dep {
    /// `complete`: its referee said PASS, and its code is on the parent's branch.
    Passed,
    /// `complete`, its code not merged into the parent's branch yet (the parent's round
    /// merges it).
    Unmerged,
    /// Terminal without passing (`human_intervention`), with its state.
    Ended(String),
    /// Not terminal yet.
    Open,
}

/// Why a sub-task is not ready: the dependencies not terminal yet and those that ended
/// without passing, each in the order written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Unready {
    pub open: Vec<String>,
    pub unmerged: Vec<String>,
    pub failed: Vec<(String, String)>,
}

/// A sub-task's readiness: every sub-task it depends on passed (seed 002: the next wave
/// starts when the sub-tasks it depends on PASS).
pub(crate) fn ready(
    spec: &automaton_workflow::SubtaskSpec,
    dep: impl Fn(&str) -> Dep,
) -> Result<(), Unready> {
    let mut why = Unready::default();
    for d in &spec.depends_on {
        match dep(d) {
            Dep::Passed => {}
            Dep::Ended(state) => why.failed.push((d.clone(), state)),
            Dep::Open => why.open.push(d.clone()),
            Dep::Unmerged => why.unmerged.push(d.clone()),
        }
    }
    if why == Unready::default() {
        Ok(())
    } else {
        Err(why)
    }
}

/// The learned correction from (estimate, actual) pairs: Σ actual / Σ estimate, bounded.
pub(crate) fn ratio(samples: &[(u64, u64)]) -> Option<f64> {
    let (e, a) = samples.iter().fold((0u128, 0u128), |(e, a), (x, y)| {
        (e + *x as u128, a + *y as u128)
    });
    (e > 0).then(|| (a as f64 / e as f64).clamp(RATIO_MIN, RATIO_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_learned_ratio_is_actual_over_estimate_and_bounded() {
        assert_eq!(ratio(&[]), None);
        assert_eq!(ratio(&[(10_000, 8_000), (10_000, 10_000)]), Some(0.9));
        assert_eq!(ratio(&[(10_000, 1)]), Some(RATIO_MIN));
        assert_eq!(ratio(&[(10, 1_000_000)]), Some(RATIO_MAX));
    }
}
