//! Arbitrary bytes against the store's line formats — `.state.lock`, `.state.approvals`,
//! `.state.implementer`, the times in them — and against a whole task folder read and
//! claimed through [`Project`]. What parses is rendered back and re-read (the formats claim
//! to round-trip, up to the seconds precision of their times), and its times are formatted,
//! as `status` and the coordinator do.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use automaton_workflow::{AgentId, TaskName};

use crate::Project;
use crate::fuzz::{assert_no_panics, iterations, run, run_mix};
use crate::records::{Approval, Lease, format_time, parse_implementers, parse_time};

const CASES: u64 = 20_000;

/// A folder in memory when there is one: the cases that write files sync them.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("tempdir")
}

fn text(bytes: &[u8]) -> String {
    // The store refuses invalid UTF-8; the lossy form still puts the parser to work on the rest.
    String::from_utf8_lossy(bytes).into_owned()
}

/// `t` without its fraction of a second: what a render keeps.
fn seconds(t: SystemTime) -> SystemTime {
    let d = t
        .duration_since(UNIX_EPOCH)
        .expect("parsed times are after 1970");
    UNIX_EPOCH + Duration::from_secs(d.as_secs())
}

const LOCKS: &[&str] = &[
    "agent: agent-1\nphase: implement\nclaimed: 2026-06-14T14:30:00Z\nexpires: 2026-06-14T15:00:00Z\nlease: 0a1b2c\ntoken: 7\n",
    "agent: a\nphase: research\nclaimed: 2026-06-14T14:30:00Z\nexpires: 2026-06-14T15:00:00Z\n",
    "agent: bob@gpu-b.example\r\nphase: design:approved\r\nclaimed: 1970-01-01T00:00:00Z\r\nexpires: 9999-12-31T23:59:59Z\r\nlease: x\r\ntoken: 18446744073709551615\r\n",
    "token: 0\nlease:\nexpires: 2026-06-14 15:00:00.5\nclaimed: 2026-06-14T14:30:00+00:00\nphase: code_review\nagent: w_3.x\n",
];

const TIME_WORDS: &[&str] = &[
    "2026-06-14T14:30:00Z",
    "9999-12-31T23:59:59.999999999Z",
    "1970-01-01T00:00:00Z",
    "agent: ",
    "phase: ",
    "claimed: ",
    "expires: ",
    "token: ",
    "lease: ",
    "implement",
    "research:approved",
];

#[test]
fn fuzz_state_lock() {
    assert_no_panics(run(
        ".state.lock",
        iterations(CASES),
        LOCKS,
        TIME_WORDS,
        |b| {
            let Ok(l) = Lease::parse(&text(b)) else {
                return false;
            };
            let now = SystemTime::now();
            let _ = (l.is_live(now), l.remaining(now));
            let again = Lease::parse(&l.render()).expect("a rendered lease parses");
            let expected = Lease {
                claimed: seconds(l.claimed),
                expires: seconds(l.expires),
                ..l
            };
            assert_eq!(again, expected, "a lease round-trips");
            true
        },
    ));
}

#[test]
fn fuzz_state_approvals() {
    let sha = "a".repeat(64);
    let four = format!("design:approved|2026-06-14T15:00:00Z|bob|{sha}\n");
    let seeds = [
        "research:approved|2026-06-14T14:30:00Z|user\n",
        &four,
        "research:approved|2026-06-14T14:30:00Z|user\n\ncode_review:approved|9999-12-31T23:59:59Z| x y |ABCDEF0123456789abcdef0123456789ABCDEF0123456789abcdef0123456789\r\n",
    ];
    assert_no_panics(run(
        ".state.approvals",
        iterations(CASES),
        &seeds,
        TIME_WORDS,
        |b| {
            let Ok(log) = Approval::parse_log(&text(b)) else {
                return false;
            };
            let rendered: String = log.iter().map(Approval::render).collect();
            let again = Approval::parse_log(&rendered).expect("rendered approvals parse");
            let expected: Vec<Approval> = log
                .into_iter()
                .map(|a| Approval {
                    at: seconds(a.at),
                    ..a
                })
                .collect();
            assert_eq!(again, expected, "approvals round-trip");
            true
        },
    ));
}

#[test]
fn fuzz_state_implementer() {
    let seeds = ["agent-1\n", "agent-1\nbob@gpu-b.example\n\n  w_3.x  \r\n"];
    assert_no_panics(run(
        ".state.implementer",
        iterations(CASES),
        &seeds,
        &[],
        |b| {
            let Ok(agents) = parse_implementers(&text(b)) else {
                return false;
            };
            let rendered: String = agents.iter().map(|a| format!("{a}\n")).collect();
            assert_eq!(parse_implementers(&rendered), Ok(agents));
            true
        },
    ));
}

#[test]
fn fuzz_times() {
    let seeds = [
        "2026-06-14T14:30:00Z",
        "2026-06-14 14:30:00",
        "2026-06-14T14:30:00.123456789Z",
        "2026-06-14T14:30:00+00:00",
        "9999-12-31T23:59:59Z",
        "1970-01-01T00:00:00Z",
    ];
    assert_no_panics(run("time", iterations(CASES), &seeds, &[], |b| {
        let Some(t) = parse_time(&text(b)) else {
            return false;
        };
        let shown = format_time(t);
        assert_eq!(parse_time(&shown), Some(seconds(t)), "a time round-trips");
        true
    }));
}

/// Every `SystemTime`, not only parsed ones, must format: expiries are computed (`now + ttl`,
/// git commit times in the audit) and years past 9999 or before 1970 reach `format_time`.
#[test]
fn fuzz_format_time_any_time() {
    let seeds = [
        "0",
        "1781447400",
        "253402300799",
        "253402300800",
        "-1",
        "-62135596800",
        "9223372036854775807",
        "-9223372036854775807",
        "8210266876799",
    ];
    assert_no_panics(run("format_time", iterations(CASES), &seeds, &[], |b| {
        let Ok(secs) = text(b).trim().parse::<i64>() else {
            return false;
        };
        let d = Duration::from_secs(secs.unsigned_abs());
        let Some(t) = (if secs < 0 {
            UNIX_EPOCH.checked_sub(d)
        } else {
            UNIX_EPOCH.checked_add(d)
        }) else {
            return false;
        };
        let shown = format_time(t);
        assert!(parse_time(&shown).is_some(), "'{shown}' reads back");
        true
    }));
}

/// An empty part stands for a file that does not exist.
fn write_or_remove(path: &std::path::Path, bytes: &[u8]) {
    if bytes.is_empty() {
        let _ = std::fs::remove_file(path);
    } else {
        std::fs::write(path, bytes).expect("write");
    }
}

/// The files of one task folder (and the project's `.agent.md` and fencing mark), fuzzed
/// together and read the way `status --task` and `status --claim` read them. Fewer cases:
/// each one writes files.
#[test]
fn fuzz_task_folder() {
    const SEP: char = '\u{1e}';
    let live = "agent: agent-1\nphase: implement\nclaimed: 2026-06-14T14:30:00Z\nexpires: 9999-12-31T23:59:59Z\nlease: 0a1b2c\ntoken: 18446744073709551615\n";
    let seeds: Vec<String> = [
        // A fresh claim (the lease in the file has expired).
        ["Mode: multi-agent\nLock timeout: 30m\n", "implement\n", LOCKS[0], "", "agent-1\n", "7\n"],
        // The holder renews, for the longest lock timeout there is.
        ["- **Mode**: multi-agent\n- **Lock timeout**: 213503982334601d\n", "implement\n", live, "", "agent-1\n", "7\n"],
        // A fresh claim after the highest fencing mark there is.
        ["Mode: multi-agent\n", "bug_find\n", "", "", "", "18446744073709551615\n"],
        // Approved, with a content-bound approval to check.
        [
            "Mode: multi-agent\nSeparated phases: none\n",
            "design:approved\n",
            LOCKS[2],
            "research:approved|2026-06-14T14:30:00Z|user\ndesign:approved|2026-06-14T15:00:00Z|bob|0000000000000000000000000000000000000000000000000000000000000000\n",
            "agent-2\n",
            "",
        ],
    ]
    .iter()
    .map(|parts| parts.join(&SEP.to_string()))
    .collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let dir = scratch();
    let project = Project::open(dir.path(), None);
    let task: TaskName = "t".parse().expect("valid");
    let agent: AgentId = "agent-1".parse().expect("valid");
    let folder = project.create_task(&task).expect("create");
    let files = [
        dir.path().join(".agent.md"),
        folder.join(".state"),
        folder.join(".state.lock"),
        folder.join(".state.approvals"),
        folder.join(".state.implementer"),
        project.meta().join("fencing"),
    ];
    let cases = iterations(CASES).div_ceil(40);
    assert_no_panics(run_mix("task folder", cases, 8, &seeds, TIME_WORDS, |b| {
        let mut parts = b.split(|&c| c == SEP as u8);
        for f in &files {
            write_or_remove(f, parts.next().unwrap_or_default());
        }
        let now = SystemTime::now();
        // Errors are shown to people: their messages format times too.
        let viewed = project.view(&task, now).map_err(|e| e.to_string());
        let claimed = project
            .claim(&task, &agent, None, now)
            .map(|(l, _)| l.render())
            .map_err(|e| e.to_string());
        viewed.is_ok() && claimed.is_ok()
    }));
}
