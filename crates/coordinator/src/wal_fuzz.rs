//! Arbitrary bytes against the coordinator's readers: the lease log (`automaton_backend::files::read`), the
//! config's durations, and a whole start — `.agent.md`, the log, a `.state.lock` and the
//! fencing mark fuzzed together, then a claim with a fuzzed `ttl_ms` as a request sends it —
//! with the times the coordinator shows computed and formatted.

use std::cell::Cell;
use std::time::{Duration, Instant, SystemTime};

use automaton_store::{Project, format_time};
use automaton_workflow::{AgentId, TaskName};

use crate::Coordinator;
use crate::config::parse_duration;
use crate::fuzz::{assert_no_panics, iterations, run};
use crate::state::Options;
use automaton_backend::files::read;
use automaton_backend::{Failpoints, FileLog};

const CASES: u64 = 20_000;

/// A folder in memory when there is one: the cases that write files sync them.
fn scratch() -> tempfile::TempDir {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .expect("tempdir")
}

const LOGS: &[&str] = &[
    "G\tt\tagent-1\t0a1b2c\t7\t1500\timplement\n",
    "M\t2\nG\tt\ta\tx\t1\t30000\tresearch\nG\tp/s\tbob@gpu-b.example\ty\t2\t1800000\tdesign:approved\nE\tx\n",
    "E\ty\nG\tt\ta\tz\t18446744073709551615\t18446744073709551615\tcode_review\n\0\0\0",
    "G\tt\ta\tid\t3\t0\tnew\nG\tt\ta\tid\t4\t1\tnew\nE\tid\nG\tt\ta\tid\t5\t2\tnew",
    "M\t18446744073709551615\nM\t0\n",
];

const WORDS: &[&str] = &[
    "G\t",
    "E\t",
    "M\t",
    "\t",
    "implement",
    "t",
    "agent-1",
    "\n\0",
];

#[test]
fn fuzz_lease_log() {
    let dir = scratch();
    let path = dir.path().join("leases.wal");
    let rendered = dir.path().join("rendered.wal");
    // A render goes through `Wal::create` (synced writes): only the first parses round-trip.
    let round_trips = Cell::new(0u32);
    assert_no_panics(run("lease log", iterations(CASES), LOGS, WORDS, |b| {
        std::fs::write(&path, b).expect("write");
        let Ok(records) = read(&path) else {
            return false;
        };
        // What a start does with the records is `fuzz_coordinator_start`'s.
        if round_trips.get() < 1000 {
            round_trips.set(round_trips.get() + 1);
            drop(
                FileLog::create(&rendered, &records, 1 << 20, Failpoints::default())
                    .expect("create"),
            );
            assert_eq!(read(&rendered), Ok(records), "the log round-trips");
        }
        true
    }));
}

#[test]
fn fuzz_config_durations() {
    let seeds = ["500ms", "30s", "5m", "1h", "10", "2 days", "0ms"];
    let words = ["ms", "s", "18446744073709551615", "213503982334601"];
    assert_no_panics(run(
        "config duration",
        iterations(CASES),
        &seeds,
        &words,
        |b| {
            let Some(d) = parse_duration(&String::from_utf8_lossy(b)) else {
                return false;
            };
            // The grace period and timeouts end up as deadlines and, for leases, as shown times.
            let _ = Instant::now() + d;
            let _ = format_time(SystemTime::now() + d + d);
            true
        },
    ));
}

/// A start over fuzzed files, then a claim with a fuzzed TTL: the paths a restart after a
/// crash, or any client's request, takes. Fewer cases: each one syncs files.
#[test]
fn fuzz_coordinator_start() {
    const SEP: char = '\u{1e}';
    let seeds: Vec<String> = [
        // The holder renews the lease the log and the file agree on.
        [
            "Mode: multi-agent\n",
            LOGS[0],
            "agent: agent-1\nphase: implement\nclaimed: 2026-06-14T14:30:00Z\nexpires: 9999-12-31T23:59:59Z\nlease: 0a1b2c\ntoken: 7\n",
            "7\n",
            "1500",
        ],
        // A fresh claim for the longest TTL a request can ask.
        ["Mode: multi-agent\n", LOGS[1], "", "", "18446744073709551615"],
        // The longest lock timeout, and the highest tokens, in the log and in the file.
        [
            "Mode: multi-agent\nLock timeout: 36500d\n",
            LOGS[2],
            "agent: a\nphase: implement\nclaimed: 1970-01-01T00:00:00Z\nexpires: 9999-12-31T23:59:59Z\nlease: q\ntoken: 18446744073709551615\n",
            "9223372036854775807\n",
            "0",
        ],
        // A lock file adopted from the CLI's local mode, the lease's own TTL from it.
        [
            "Mode: multi-agent\n",
            LOGS[3],
            "agent: bob@gpu-b.example\nphase: implement\nclaimed: 1970-01-01T00:00:00Z\nexpires: 9999-12-31T23:59:59Z\nlease: q\ntoken: 9223372036854775807\n",
            "",
            "",
        ],
    ]
    .iter()
    .map(|parts| parts.join(&SEP.to_string()))
    .collect();
    let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = scratch();
    let task: TaskName = "t".parse().expect("valid");
    let agent: AgentId = "agent-1".parse().expect("valid");
    let project = Project::open(dir.path(), None);
    let folder = project.create_task(&task).expect("create");
    let files = [
        dir.path().join(".agent.md"),
        project.meta().join("leases.wal"),
        folder.join(".state.lock"),
        project.meta().join("fencing"),
    ];
    let options = Options {
        engine: automaton_engine::Options {
            grace: Duration::from_secs(1),
            log_compact_bytes: 1 << 20,
            ..Default::default()
        },
        ..Options::default()
    };
    let cases = iterations(CASES).div_ceil(40);
    let found = run("coordinator start", cases, &seeds, WORDS, |b| {
        let mut parts = b.split(|&c| c == SEP as u8);
        for f in &files {
            // An empty part stands for a file that does not exist.
            match parts.next().unwrap_or_default() {
                [] => drop(std::fs::remove_file(f)),
                part => std::fs::write(f, part).expect("write"),
            }
        }
        std::fs::write(folder.join(".state"), "implement\n").expect("write");
        let ttl_ms = parts
            .next()
            .and_then(|t| std::str::from_utf8(t).ok()?.trim().parse::<u64>().ok());
        let Ok((coord, notes)) = Coordinator::open(project.clone(), options.clone()) else {
            return false;
        };
        let _ = notes.join("\n");
        let now = Instant::now();
        if let Some(l) = coord.engine.lease_of(&task) {
            let _ = (l.render(), format_time(l.expires));
        }
        // As the service hands a request's `ttl_ms` over (0 means the policy's).
        let ttl = ttl_ms.filter(|&ms| ms != 0).map(Duration::from_millis);
        match rt.block_on(coord.engine.claim(&task, &agent, ttl)) {
            Ok(g) => {
                // What the reply and the `.state.lock` view show.
                let _ = (format_time(g.live.expires_at(now)), g.live.view().render());
                true
            }
            Err(e) => {
                let _ = e.to_string();
                false
            }
        }
    });
    assert_no_panics(found);
}
