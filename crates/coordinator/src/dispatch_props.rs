//! Properties of the dispatcher's decisions, over random fleets and random decompositions:
//! `dispatch::choose` (which idle worker), `dispatch::offer_order` (in which order, given
//! who implemented the task and whose run failed), `dispatch::waiting_reason` (why none) and
//! `waves::ready` (whether a sub-task's wave may start), as pure functions.
//!
//! Seeded (splitmix64 from `fuzz.rs`), so a failure names a case that reproduces:
//! `AUTOMATON_FUZZ_SEED` sets the base seed, `AUTOMATON_FUZZ_ITERS` the cases per property
//! (default 2 000).

use std::collections::HashMap;
use std::sync::Arc;

use automaton_workflow::{AgentId, Decomposition, parse_decomposition};

use crate::dispatch::waves::{Dep, ready};
use crate::dispatch::{Slot, choose, leaves_a_reviewer, offer_order, waiting_reason};
use crate::fuzz::{Rng, iterations};

const CASES: u64 = 2_000;
/// Budgets workers often have (and needs often equal them: the `>=` edge).
const COMMON_BUDGETS: &[u64] = &[0, 12_000, 36_000, 93_000, 128_000, 200_000];
/// What a separated phase needs of its sub-task's estimate (`waves::SEPARATED_SHARE`).
const SEPARATED_SHARE: f64 = 0.5;

fn seed() -> u64 {
    std::env::var("AUTOMATON_FUZZ_SEED")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0xd15_9a7c4)
}

/// Runs `check` on `iterations(CASES)` seeded generators; the failing case's seed in the panic.
fn cases(name: &str, check: impl Fn(&mut Rng)) {
    let base = seed();
    let n = iterations(CASES);
    for i in 0..n {
        let s = base.wrapping_add(i.wrapping_mul(0x9E37_79B9));
        let mut rng = Rng::new(s);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&mut rng)));
        if let Err(e) = caught {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("{name}: case {i} (seed {s:#x}) failed: {msg}");
        }
    }
}

fn budget(rng: &mut Rng) -> u64 {
    if rng.below(2) == 0 {
        *rng.pick(COMMON_BUDGETS)
    } else {
        rng.below(200_001) as u64
    }
}

/// 1–20 workers, budgets 0–200k, capacity 0–3, some with leases already (free < capacity).
fn fleet(rng: &mut Rng) -> Vec<Slot> {
    let n = 1 + rng.below(20);
    (0..n)
        .map(|i| {
            let capacity = rng.below(4) as u32;
            let busy = if rng.below(3) == 0 {
                rng.below(capacity as usize + 1)
            } else {
                0
            };
            Slot {
                session: Arc::from(format!("s{i}").as_str()),
                name: format!("w{i:02}").parse::<AgentId>().expect("agent id"),
                free: capacity as usize - busy,
                capacity,
                budget: budget(rng),
                gpu: format!("{} GiB", 8 * (1 + rng.below(10))),
            }
        })
        .collect()
}

/// A need: often exactly a worker's budget, else 1k–250k; sometimes unsized.
fn need(rng: &mut Rng, fleet: &[Slot]) -> Option<u64> {
    match rng.below(10) {
        0 => None,
        1..=3 => Some(rng.pick(fleet).budget.max(1_000)),
        _ => Some(1_000 + rng.below(249_001) as u64),
    }
}

fn fits(s: &Slot, need: Option<u64>) -> bool {
    s.free > 0 && need.is_none_or(|n| s.budget >= n)
}

/// What `Sessions::largest_budget` gives for this fleet: the largest budget among workers
/// that take work (capacity > 0), busy or not.
fn largest(fleet: &[Slot]) -> Option<(u64, AgentId, String)> {
    fleet
        .iter()
        .filter(|s| s.capacity > 0)
        .map(|s| (s.budget, s.name.clone(), s.gpu.clone()))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(&a.1)))
}

/// A random DAG of 1–30 sub-tasks (each depends on some earlier ones), estimates 1k–250k,
/// written as a `DECOMPOSITION.md` and parsed by the real parser.
fn decomposition(rng: &mut Rng) -> Decomposition {
    let n = 1 + rng.below(30);
    let mut text = String::from(
        "# DECOMPOSITION\n\n| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n| --- | --- | --- | --- |\n",
    );
    for i in 0..n {
        let mut deps: Vec<String> = (0..i)
            .filter(|_| rng.below(4) == 0)
            .map(|j| format!("s{j}"))
            .collect();
        deps.truncate(4);
        let deps = if deps.is_empty() {
            "-".to_string()
        } else {
            deps.join(", ")
        };
        // 1000 or more: raw tokens.
        let estimate = 1_000 + rng.below(249_001);
        text.push_str(&format!(
            "| s{i} | {deps} | {estimate} | part {i}; its tests pass |\n"
        ));
    }
    parse_decomposition(&text).unwrap_or_else(|e| panic!("generated table: {e}\n{text}"))
}

/// (a) `choose` never returns a worker whose budget is below the need (nor one with no room).
#[test]
fn dispatch_never_assigns_a_subtask_larger_than_the_budget() {
    cases("budget", |rng| {
        let fleet = fleet(rng);
        let need = need(rng, &fleet);
        let order = choose(need, &fleet);
        let mut seen = vec![false; fleet.len()];
        for &i in &order {
            assert!(!seen[i], "slot {i} chosen twice: {order:?}");
            seen[i] = true;
            let s = &fleet[i];
            assert!(s.free > 0, "{} has no free room: {s:?}", s.name);
            if let Some(n) = need {
                assert!(
                    s.budget >= n,
                    "{} holds {} < need {n}: {order:?} of {fleet:?}",
                    s.name,
                    s.budget
                );
            }
        }
        // And every worker that fits is in the order (the grant may refuse some).
        let fitting = fleet.iter().filter(|s| fits(s, need)).count();
        assert_eq!(
            order.len(),
            fitting,
            "need {need:?}: {order:?} of {fleet:?}"
        );
    });
}

/// (b) Best fit: the first choice has the smallest budget among the workers that hold the
/// need, and the order never goes to a smaller budget after a larger one.
#[test]
fn dispatch_prefers_the_best_fit() {
    cases("best fit", |rng| {
        let fleet = fleet(rng);
        let Some(n) = need(rng, &fleet) else {
            return;
        };
        let order = choose(Some(n), &fleet);
        let smallest = fleet
            .iter()
            .filter(|s| fits(s, Some(n)))
            .map(|s| s.budget)
            .min();
        assert_eq!(
            order.first().map(|&i| fleet[i].budget),
            smallest,
            "need {n}: {order:?} of {fleet:?}"
        );
        for w in order.windows(2) {
            let (a, b) = (&fleet[w[0]], &fleet[w[1]]);
            assert!(
                a.budget <= b.budget,
                "need {n}: {} ({}) before {} ({})",
                a.name,
                a.budget,
                b.name,
                b.budget
            );
            // Same budget: the most free room first.
            if a.budget == b.budget {
                assert!(a.free >= b.free, "{a:?} before {b:?}");
            }
        }
    });
}

/// (c) A sub-task is ready exactly when every sub-task it depends on passed: one whose
/// dependency is open or ended without passing never is, and those are named, in the order
/// written (open ones and failed ones apart). Ready sub-tasks are all in later waves than
/// their (passed) dependencies.
#[test]
fn dispatch_never_starts_a_wave_early() {
    cases("waves", |rng| {
        let d = decomposition(rng);
        let status: HashMap<String, u64> = d
            .subtasks
            .iter()
            .map(|s| (s.name.clone(), rng.below(3) as u64))
            .collect();
        let dep = |n: &str| match status.get(n).copied().unwrap_or(0) {
            0 => Dep::Open,
            1 => Dep::Passed,
            _ => Dep::Ended("human_intervention".into()),
        };
        let wave: HashMap<String, usize> = d
            .waves()
            .into_iter()
            .enumerate()
            .flat_map(|(i, w)| w.into_iter().map(move |n| (n, i + 1)))
            .collect();
        for spec in &d.subtasks {
            let of = |k: u64| -> Vec<String> {
                spec.depends_on
                    .iter()
                    .filter(|d| status.get(*d).copied().unwrap_or(0) == k)
                    .cloned()
                    .collect()
            };
            let (open, failed) = (of(0), of(2));
            match ready(spec, dep) {
                Ok(()) => {
                    assert!(
                        open.is_empty() && failed.is_empty(),
                        "{} ready with {open:?} open and {failed:?} failed",
                        spec.name
                    );
                    for dep in &spec.depends_on {
                        assert!(
                            wave.get(dep) < wave.get(&spec.name),
                            "{dep} not in an earlier wave than {}",
                            spec.name
                        );
                    }
                }
                Err(why) => {
                    assert_eq!(why.open, open, "{}", spec.name);
                    let named: Vec<String> = why.failed.iter().map(|(n, _)| n.clone()).collect();
                    assert_eq!(named, failed, "{}", spec.name);
                }
            }
        }
        // Wave 1 needs nothing: always ready.
        if let Some(first) = d.waves().first() {
            for name in first {
                let spec = d.get(name).expect("in the table");
                assert_eq!(ready(spec, |_| Dep::Open), Ok(()), "{name}");
            }
        }
    });
}

/// (d) Whenever an idle worker (free room) holds the need, `choose` offers someone; an empty
/// choice's reason names the largest idle budget (below the need), or says no worker fits,
/// every fitting one is busy, or none is connected.
#[test]
fn dispatch_never_leaves_a_fitting_subtask_waiting_while_a_fitting_worker_is_idle() {
    cases("idle", |rng| {
        let fleet = fleet(rng);
        let need = need(rng, &fleet);
        let order = choose(need, &fleet);
        let idle_fits = fleet.iter().any(|s| fits(s, need));
        assert_eq!(
            !order.is_empty(),
            idle_fits,
            "need {need:?}: {order:?} of {fleet:?}"
        );
        if !order.is_empty() {
            return;
        }
        let largest = largest(&fleet);
        let why = waiting_reason(need, &fleet, largest.as_ref());
        let k = |t: u64| format!("{}k", t / 1000);
        let largest_idle = fleet.iter().filter(|s| s.free > 0).map(|s| s.budget).max();
        match (need, &largest) {
            (_, None) => assert!(why.contains("no worker that takes work"), "{why}"),
            (Some(n), Some((max, who, _))) if *max < n => {
                assert!(why.contains("no worker fits"), "{why}");
                assert!(why.contains(&format!("holds {} ({who}", k(*max))), "{why}");
            }
            (Some(n), Some(_)) => match largest_idle {
                Some(b) => {
                    assert!(b < n, "an idle worker holding {b} >= {n} waits: {fleet:?}");
                    let named = fleet
                        .iter()
                        .filter(|s| s.free > 0 && s.budget == b)
                        .any(|s| why.contains(&format!("holds {} ({},", k(b), s.name)));
                    assert!(named, "{why} does not name the largest idle worker ({b})");
                }
                None => assert!(why.contains("every worker that fits is busy"), "{why}"),
            },
            (None, Some(_)) => assert!(why.contains("every worker is busy"), "{why}"),
        }
    });
}

/// (e) A round as `dispatch_round` runs it, the grant refusing each sub-task's separated
/// phase (code review, half its estimate) to its implementer: the work never goes to the
/// implementer, goes to another fitting idle worker whenever there is one, and waits
/// otherwise — with the reason the idle workers other than the implementer give. (That
/// reason is computed here: `dispatch_round` records none for a task whose every fitting
/// worker the grant refused, so `status` shows no reason for it today.)
#[test]
fn dispatch_never_gives_the_review_to_the_implementer() {
    cases("separation", |rng| {
        let mut idle = fleet(rng);
        let whole = idle.clone();
        let largest = largest(&whole);
        let d = decomposition(rng);
        for spec in &d.subtasks {
            let need = ((spec.peak_context_tokens as f64) * SEPARATED_SHARE).ceil() as u64;
            // The implementer: one of the fleet (often one that fits), or someone gone.
            let implementer: AgentId = if rng.below(5) == 0 {
                "gone-worker".parse().expect("agent id")
            } else {
                let fitting: Vec<&Slot> = whole.iter().filter(|s| s.budget >= need).collect();
                if !fitting.is_empty() && rng.below(3) > 0 {
                    rng.pick(&fitting).name.clone()
                } else {
                    rng.pick(&whole).name.clone()
                }
            };
            let others_fit: Vec<String> = idle
                .iter()
                .filter(|s| fits(s, Some(need)) && s.name != implementer)
                .map(|s| s.name.to_string())
                .collect();
            let only_implementer = others_fit.is_empty()
                && idle
                    .iter()
                    .any(|s| fits(s, Some(need)) && s.name == implementer);
            // The round: the order `choose` gives, the grant refusing the implementer.
            let mut granted = None;
            for i in choose(Some(need), &idle) {
                if idle[i].name == implementer {
                    continue;
                }
                idle[i].free -= 1;
                granted = Some(idle[i].name.clone());
                break;
            }
            match &granted {
                Some(w) => {
                    assert_ne!(
                        w, &implementer,
                        "{}: the review went to its implementer",
                        spec.name
                    );
                    assert!(others_fit.contains(&w.to_string()), "{w} did not fit");
                }
                None => {
                    assert!(
                        others_fit.is_empty(),
                        "{} (needs {need}) waits while {others_fit:?} fit and are idle (implementer {implementer})",
                        spec.name
                    );
                    if only_implementer {
                        let others: Vec<Slot> = idle
                            .iter()
                            .filter(|s| s.name != implementer)
                            .cloned()
                            .collect();
                        let why = waiting_reason(Some(need), &others, largest.as_ref());
                        assert!(why.starts_with("waiting: "), "{why}");
                        assert!(
                            !why.contains(implementer.as_str()),
                            "{why} names the implementer as a way out"
                        );
                    }
                }
            }
            idle.retain(|s| s.free > 0);
        }
    });
}

/// (d) `offer_order`: the workers `choose` gives, less the excluded, each once; every
/// preferred worker before every other (so a re-run of implement stays with its past
/// implementers and leaves the rest free to review it); the failed worker last.
#[test]
fn implement_goes_to_a_past_implementer_first_and_a_failed_worker_last() {
    cases("offer order", |rng| {
        let fleet = fleet(rng);
        let need = need(rng, &fleet);
        let some = |rng: &mut Rng| -> Vec<AgentId> {
            fleet
                .iter()
                .filter(|_| rng.below(3) == 0)
                .map(|s| s.name.clone())
                .collect()
        };
        let excluded = some(rng);
        let preferred = some(rng);
        let failed = (rng.below(2) == 0).then(|| rng.pick(&fleet).name.clone());
        let order = offer_order(need, &fleet, &excluded, &preferred, failed.as_ref());
        let mut expected: Vec<usize> = choose(need, &fleet)
            .into_iter()
            .filter(|&i| !excluded.contains(&fleet[i].name))
            .collect();
        let mut got = order.clone();
        expected.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, expected, "{order:?}");
        let rank = |i: usize| {
            let name = &fleet[i].name;
            if Some(name) == failed.as_ref() {
                2
            } else if preferred.contains(name) {
                0
            } else {
                1
            }
        };
        assert!(
            order.windows(2).all(|w| rank(w[0]) <= rank(w[1])),
            "preferred {preferred:?}, failed {failed:?}: {:?}",
            order.iter().map(|&i| &fleet[i].name).collect::<Vec<_>>()
        );
    });
}

/// (e) `leaves_a_reviewer`: implement may run on a worker iff it implemented the task before,
/// or the task has no implementer yet, or some other live worker has not implemented it — so
/// after the run, someone is left to review it whenever someone was.
#[test]
fn implement_never_takes_the_last_worker_that_could_review_it() {
    cases("reviewer left", |rng| {
        let fleet = fleet(rng);
        let live: Vec<AgentId> = fleet.iter().map(|s| s.name.clone()).collect();
        let implementers: Vec<AgentId> =
            live.iter().filter(|_| rng.below(3) == 0).cloned().collect();
        let worker = rng.pick(&live).clone();
        let may = leaves_a_reviewer(&worker, &implementers, &live);
        let mut after = implementers.clone();
        if !after.contains(&worker) {
            after.push(worker.clone());
        }
        let reviewers_after = live.iter().filter(|w| !after.contains(w)).count();
        let reviewers_before = live.iter().filter(|w| !implementers.contains(w)).count();
        let expected = implementers.is_empty()
            || implementers.contains(&worker)
            || (reviewers_before > 0 && reviewers_after > 0);
        assert_eq!(
            may, expected,
            "{worker} with implementers {implementers:?} of {live:?}"
        );
    });
}
