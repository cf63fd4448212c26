//! How fast `automaton status` answers on a project of 1,000 tasks.
//!
//! `cargo bench -p automaton-cli --bench status [-- --tasks N --runs N --json-out FILE]`
//!
//! Measures the real binary as an agent calls it (process start included) for `--task`, and
//! `--list` over every task, plus the store's `view` in-process (the part the coordinator
//! will reuse). Prints a table; `--json-out` also writes the figures as JSON.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use automaton_store::Project;
use automaton_workflow::{State, TaskName};

const BIN: &str = env!("CARGO_BIN_EXE_automaton");

struct Figures {
    name: String,
    runs: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

fn measure(name: &str, runs: usize, mut f: impl FnMut()) -> Figures {
    f(); // warm the page cache and the binary
    let mut samples: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Figures {
        name: name.to_string(),
        runs,
        p50: at(0.50),
        p99: at(0.99),
        max: *samples.last().expect("at least one run"),
    }
}

fn run_bin(project: &Path, args: &[&str]) {
    let out = Command::new(BIN)
        .arg("status")
        .args(args)
        .arg("--project")
        .arg(project)
        .output()
        .expect("run automaton");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A project of `n` tasks spread over the lifecycle, every tenth with two sub-tasks.
fn populate(project: &Project, n: usize) {
    let states = State::all();
    for i in 0..n {
        let name: TaskName = format!("task-{i:04}").parse().expect("valid name");
        let dir = project.create_task(&name).expect("create task");
        let state = states[i % states.len()];
        std::fs::write(dir.join(".state"), format!("{state}\n")).expect("write state");
        for a in automaton_workflow::Artifact::ALL {
            if a.phase() < state.phase
                || (a.phase() == state.phase
                    && !matches!(state.gate, automaton_workflow::Gate::Open))
            {
                std::fs::write(dir.join(a.file_name()), "content\n").expect("write artifact");
            }
        }
        if i % 10 == 0 {
            for s in ["sub-a", "sub-b"] {
                project
                    .create_task(&name.subtask(s).expect("valid"))
                    .expect("create sub-task");
            }
        }
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut tasks, mut runs, mut json_out) = (1000usize, 300usize, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tasks" => tasks = args.next().and_then(|v| v.parse().ok()).expect("--tasks N"),
            "--runs" => runs = args.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--json-out" => json_out = args.next(),
            _ => {} // cargo bench passes --bench
        }
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let project = Project::open(dir.path(), None);
    let t = Instant::now();
    populate(&project, tasks);
    eprintln!(
        "prepared {tasks} tasks (+{} sub-tasks) in {:.1?}",
        tasks / 10 * 2,
        t.elapsed()
    );

    let probe = format!("task-{:04}", tasks / 2);
    let probe_name: TaskName = probe.parse().expect("valid");
    let figures = vec![
        measure("status --task (process)", runs, || {
            run_bin(dir.path(), &["--task", &probe])
        }),
        measure("status --task --json (process)", runs, || {
            run_bin(dir.path(), &["--task", &probe, "--json"])
        }),
        measure("store view (in-process)", runs * 10, || {
            project.view(&probe_name, SystemTime::now()).expect("view");
        }),
        measure("status --list (process)", (runs / 10).max(5), || {
            run_bin(dir.path(), &["--list"])
        }),
    ];
    println!("status on a project of {tasks} tasks");
    println!(
        "{:<34}{:>8}{:>12}{:>12}{:>12}",
        "operation", "runs", "p50", "p99", "max"
    );
    for f in &figures {
        println!(
            "{:<34}{:>8}{:>12.2?}{:>12.2?}{:>12.2?}",
            f.name, f.runs, f.p50, f.p99, f.max
        );
    }
    if let Some(path) = json_out {
        let rows: Vec<String> = figures
            .iter()
            .map(|f| {
                format!(
                    "{{\"operation\":\"{}\",\"runs\":{},\"p50_us\":{},\"p99_us\":{},\"max_us\":{}}}",
                    f.name,
                    f.runs,
                    f.p50.as_micros(),
                    f.p99.as_micros(),
                    f.max.as_micros()
                )
            })
            .collect();
        std::fs::write(
            &path,
            format!("{{\"tasks\":{tasks},\"results\":[{}]}}\n", rows.join(",")),
        )
        .expect("write json");
    }
}
