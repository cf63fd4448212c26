//! Arbitrary bytes against every parser of this crate: task names, agent ids, phases and
//! states (`.state`), `VERDICT.md`, `.agent.md` and its durations. What parses is used the
//! way callers use it — rendered, re-parsed, and durations added to the clocks, as the store
//! and the coordinator do with a lock timeout — so a panic hiding after the parse shows too.

use std::time::{Duration, Instant, SystemTime};

use crate::fuzz::{assert_no_panics, iterations, run};
use crate::{AgentId, Phase, Policy, PolicyFile, State, TaskName, parse_duration, parse_verdict};

const CASES: u64 = 20_000;

fn text(bytes: &[u8]) -> String {
    // Readers refuse invalid UTF-8; the lossy form still puts the parser to work on the rest.
    String::from_utf8_lossy(bytes).into_owned()
}

/// A duration as callers use one: a lease expiry (`now + ttl`), the coordinator's view of it
/// two TTLs ahead, and a monotonic deadline.
fn use_duration(d: Duration) {
    let now = SystemTime::now();
    let _ = now + d;
    let _ = now + d * 2;
    let _ = Instant::now() + d;
}

#[test]
fn fuzz_task_names() {
    let seeds = ["add-user-auth", "parent/sub-a", "a", "v2", "a1-b2-c3"];
    let words = ["a", "-", "/", "..", "x-y", &"a".repeat(64), &"b".repeat(65)];
    assert_no_panics(run("task name", iterations(CASES), &seeds, &words, |b| {
        let s = text(b);
        let Ok(t) = s.parse::<TaskName>() else {
            return false;
        };
        assert_eq!(t.to_string(), s, "a task name renders as it was written");
        assert_eq!(t.parts().join("/"), s);
        let _ = (t.parent(), t.leaf(), t.is_subtask(), t.subtask("sub"));
        true
    }));
}

#[test]
fn fuzz_agent_ids() {
    let seeds = ["agent-1", "a", "bob@gpu-b.example", "w_3.x"];
    let words = ["@", ".", "_", &"a".repeat(64)];
    assert_no_panics(run("agent id", iterations(CASES), &seeds, &words, |b| {
        let s = text(b);
        let Ok(a) = s.parse::<AgentId>() else {
            return false;
        };
        assert_eq!(a.to_string(), s, "an agent id renders as it was written");
        assert_eq!(a.as_str().parse::<AgentId>().as_ref(), Ok(&a));
        true
    }));
}

#[test]
fn fuzz_phases_and_states() {
    let all: Vec<String> = State::all().iter().map(|s| s.to_string()).collect();
    let seeds: Vec<&str> = all.iter().map(String::as_str).collect();
    let words = [":approved", ":awaiting_approval", "code_review", "new"];
    assert_no_panics(run(".state", iterations(CASES), &seeds, &words, |b| {
        let s = text(b);
        if let Ok(p) = s.parse::<Phase>() {
            assert_eq!(p.name(), s);
            let _ = (
                p.is_gated(),
                p.is_terminal(),
                p.artifact(),
                p.allows_code_edits(),
            );
        }
        // `.state` is read trimmed.
        let Ok(st) = s.trim().parse::<State>() else {
            return false;
        };
        assert_eq!(
            st.to_string(),
            s.trim(),
            "a state renders as it was written"
        );
        assert_eq!(st.to_string().parse::<State>(), Ok(st));
        let _ = (st.legal_targets(), st.approval_target(), st.is_terminal());
        true
    }));
}

#[test]
fn fuzz_verdict_md() {
    let seeds = [
        "# Review\n\nVerdict: PASS\n",
        "**Verdict:** fail",
        "- **Verdict**: needs_review",
        "## `PASS`",
        "_PASS_",
        "__NEEDS_REVIEW__",
        "Summary\nVerdict: maybe\nFAIL\n",
        "> - Verdict: _Pass_.",
    ];
    let words = [
        "PASS",
        "FAIL",
        "NEEDS_REVIEW",
        "Verdict:",
        "_",
        "__",
        "- ",
        "> ",
    ];
    assert_no_panics(run("VERDICT.md", iterations(CASES), &seeds, &words, |b| {
        let Some(v) = parse_verdict(&text(b)) else {
            return false;
        };
        assert_eq!(parse_verdict(&v.to_string()), Some(v));
        true
    }));
}

#[test]
fn fuzz_agent_md() {
    let seeds = [
        "# Agent\nMode: multi-agent\nLock timeout: 45m\n",
        "- **mode**: Multi-Agent\n- **Lock Timeout**: 45 minutes\n",
        "Separated phases: code_review, bug_find\n",
        "Separated phases: none\nlock_timeout: 2d\n",
        "* `Lock-Timeout`: **90s**\n",
    ];
    let words = [
        "Lock timeout: ",
        "Separated phases: ",
        "Mode: ",
        "s",
        "m",
        "h",
        "d",
        " days",
        "213503982334601d",
        "5124095576030431h",
        "307445734561825860m",
    ];
    assert_no_panics(run(".agent.md", iterations(CASES), &seeds, &words, |b| {
        let Ok(f) = PolicyFile::parse(&text(b)) else {
            return false;
        };
        let p = Policy::layered(&f, &PolicyFile::default());
        use_duration(p.lock_timeout);
        true
    }));
}

#[test]
fn fuzz_durations() {
    let seeds = [
        "90s",
        "30m",
        "1h",
        "2d",
        "30 minutes",
        "1 hour",
        "30",
        "7 days",
    ];
    let words = [
        "s",
        "m",
        "h",
        "d",
        "minutes",
        "18446744073709551615",
        "213503982334601",
    ];
    assert_no_panics(run("duration", iterations(CASES), &seeds, &words, |b| {
        let Some(d) = parse_duration(&text(b)) else {
            return false;
        };
        assert!(d > Duration::ZERO);
        use_duration(d);
        true
    }));
}
