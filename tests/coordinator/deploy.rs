//! Issue 13, `deploy/`: the operators' files are checked by their tools' own validators
//! (`deploy/check`), use only flags the real binaries accept, and the Grafana dashboard
//! queries only the metrics the coordinator and the workers export.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::harness::{COORDINATOR, worker_bin};

/// The metric names the dashboard is built against, each with its labels (issue 13).
/// Histograms also give `_bucket` (with `le`), `_sum` and `_count`.
pub(crate) const METRICS: &[(&str, &[&str])] = &[
    // The coordinator's /metrics.
    ("automaton_workers_connected", &["gpu_model"]),
    ("automaton_workers", &["state"]),
    ("automaton_leases_held", &[]),
    ("automaton_lease_claims_total", &[]),
    ("automaton_lease_renewals_total", &[]),
    ("automaton_lease_releases_total", &[]),
    ("automaton_lease_expiries_total", &["reason"]),
    ("automaton_lease_refusals_total", &["reason"]),
    ("automaton_dispatch_latency_seconds", &[]),
    ("automaton_dispatch_assignments_total", &["phase"]),
    ("automaton_dispatch_answer_seconds", &["answer"]),
    ("automaton_dispatch_decisions_total", &[]),
    ("automaton_dispatch_decide_seconds_total", &[]),
    ("automaton_phase_duration_seconds", &["phase", "outcome"]),
    ("automaton_tasks", &["phase"]),
    ("automaton_tasks_waiting", &["reason"]),
    ("automaton_scrape_store_reads_total", &[]),
    // A worker's /metrics.
    ("automaton_worker_connected", &[]),
    ("automaton_worker_runs_active", &[]),
    ("automaton_worker_runs_total", &["phase", "outcome"]),
    ("automaton_worker_run_duration_seconds", &["phase"]),
    ("automaton_worker_gpu_memory_bytes", &["gpu", "kind"]),
    ("automaton_worker_budget_tokens", &[]),
    ("automaton_worker_heartbeat_rtt_seconds", &[]),
];

const HISTOGRAMS: &[&str] = &[
    "automaton_dispatch_latency_seconds",
    "automaton_dispatch_answer_seconds",
    "automaton_phase_duration_seconds",
    "automaton_worker_run_duration_seconds",
    "automaton_worker_heartbeat_rtt_seconds",
];

/// Labels Prometheus adds to every series (target labels), and deploy/prometheus.yml's own.
const TARGET_LABELS: &[&str] = &["instance", "job", "worker"];

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Files of `dir` whose names end with `suffix`, sorted.
fn files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    out.sort();
    out
}

#[test]
fn deploy_files_pass_their_validators() {
    let bin_dir = Path::new(COORDINATOR)
        .parent()
        .expect("the coordinator binary has a folder");
    // deploy/check runs the worker's unit against it: make sure it was built.
    let _ = worker_bin();
    let out = Command::new(deploy_dir().join("check"))
        .env("AUTOMATON_BIN_DIR", bin_dir)
        .output()
        .expect("run deploy/check");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        panic!(
            "deploy/check cannot run, a validator is missing (tests/setup installs them):\n{stderr}"
        );
    }
    assert!(
        out.status.success(),
        "deploy/check failed ({:?}):\n{stdout}{stderr}",
        out.status
    );
    // It checked every kind of file (a check that ran nothing would pass too).
    for file in [
        "deploy/Dockerfile",
        "deploy/compose.yaml",
        "deploy/otel-collector.yaml",
        "deploy/prometheus.yml",
        "deploy/grafana/automaton.json",
        "deploy/systemd/automaton-coordinator.service",
        "deploy/systemd/automaton-worker.service",
        "deploy/k8s/40-worker.yaml",
        "deploy/coordinator.example.toml",
        // High availability on etcd.
        "deploy/compose-ha.yaml",
        "deploy/k8s/25-etcd.yaml",
        "deploy/k8s/35-coordinator-ha.yaml",
        "deploy/systemd/automaton-coordinator.service.d/etcd.conf",
        "deploy/coordinator-ha.example.toml",
    ] {
        assert!(
            stdout.contains(&format!("ok   {file} ")),
            "deploy/check did not check {file}:\n{stdout}"
        );
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Binary {
    Coordinator,
    Worker,
}

impl Binary {
    fn name(self) -> &'static str {
        match self {
            Binary::Coordinator => "automaton-coordinator",
            Binary::Worker => "automaton-worker",
        }
    }
}

/// Every `--flag` the binary's `--help` (and its subcommands') lists.
fn accepted_flags(bin: &Path, subcommands: &[&str]) -> BTreeSet<String> {
    let mut flags = BTreeSet::new();
    let mut runs = vec![vec!["--help"]];
    runs.extend(subcommands.iter().map(|s| vec![*s, "--help"]));
    for args in runs {
        let out = Command::new(bin).args(&args).output().expect("run --help");
        // A subcommand this build does not have yet (`run`) is skipped.
        if !out.status.success() {
            continue;
        }
        flags.extend(flag_words(&String::from_utf8_lossy(&out.stdout)));
    }
    assert!(
        flags.contains("--help"),
        "no flags read from {}",
        bin.display()
    );
    flags
}

/// The `--flag` words of a text, without any `=value`.
fn flag_words(text: &str) -> Vec<String> {
    text.split(|c: char| c.is_whitespace() || "\"'[],=<>()`".contains(c))
        .filter(|w| {
            w.len() > 2
                && w.starts_with("--")
                && w[2..]
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        })
        .map(str::to_string)
        .collect()
}

/// Where `word` stands alone as a command word in `line` (not `automaton-worker.service`).
fn command_word_at(line: &str, word: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = line[from..].find(word).map(|i| i + from) {
        let before = line[..i].chars().next_back();
        let after = line[i + word.len()..].chars().next();
        let starts = before.is_none_or(|c| " \t\"'[/=`(".contains(c));
        let ends = after.is_none_or(|c| " \t\"',]`".contains(c));
        // `-p automaton-coordinator`, `--bin automaton-worker`: a value, not a command.
        let after_flag = line[..i]
            .split_whitespace()
            .next_back()
            .is_some_and(|w| w.len() > 1 && w.starts_with('-'));
        if starts && ends && !after_flag {
            return Some(i);
        }
        from = i + word.len();
    }
    None
}

/// The commands of `bin` in a file and the flags each passes: a YAML block list (`- bin`,
/// then `- item` lines at the same indent), a flow list (`[bin, ...]` up to `]`), or a
/// command line (systemd `ExecStart=`, shell) continued by trailing backslashes.
fn commands(text: &str, bin: Binary) -> Vec<(usize, Vec<String>)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(at) = command_word_at(line, bin.name()) else {
            continue;
        };
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let mut segment = String::new();
        if trimmed.starts_with("- ") && line[..at].trim() == "-" {
            for next in &lines[i + 1..] {
                let t = next.trim_start();
                if t.starts_with('#') {
                    continue;
                }
                if next.len() - t.len() != indent || !t.starts_with("- ") {
                    break;
                }
                segment.push(' ');
                segment.push_str(&t[2..]);
            }
        } else {
            let in_flow_list = line[..at].contains('[');
            let mut j = i;
            let mut rest = &line[at + bin.name().len()..];
            loop {
                if in_flow_list && let Some(end) = rest.find(']') {
                    segment.push_str(&rest[..end]);
                    break;
                }
                segment.push(' ');
                segment.push_str(rest);
                let continues = rest.trim_end().ends_with('\\') || in_flow_list;
                j += 1;
                if !continues || j >= lines.len() {
                    break;
                }
                rest = lines[j];
            }
        }
        // Markdown: a command in `inline code` ends with it.
        let segment = segment.split('`').next().unwrap_or("");
        // A single-quoted word is a value (`--agent 'aider --yes-always ...'`), not flags.
        let unquoted: String = segment.split('\'').step_by(2).collect::<Vec<_>>().join(" ");
        found.push((i + 1, flag_words(&unquoted)));
    }
    found
}

#[test]
fn deploy_files_use_only_flags_the_binaries_accept() {
    let accepted: BTreeMap<Binary, BTreeSet<String>> = [
        (
            Binary::Coordinator,
            accepted_flags(Path::new(COORDINATOR), &[]),
        ),
        (
            Binary::Worker,
            accepted_flags(&worker_bin(), &["run", "probe", "mint-token"]),
        ),
    ]
    .into_iter()
    .collect();
    let deploy = deploy_dir();
    let mut systemd = files(&deploy.join("systemd"), ".service");
    systemd.extend(files(
        &deploy.join("systemd/automaton-coordinator.service.d"),
        ".conf",
    ));
    let groups: [(&str, Vec<PathBuf>); 4] = [
        (
            "compose",
            vec![deploy.join("compose.yaml"), deploy.join("compose-ha.yaml")],
        ),
        ("systemd", systemd),
        ("k8s", files(&deploy.join("k8s"), ".yaml")),
        ("README", vec![deploy.join("README.md")]),
    ];
    let mut unknown = Vec::new();
    for (group, paths) in &groups {
        let mut seen = BTreeSet::new();
        for path in paths {
            let text = read(path);
            for bin in [Binary::Coordinator, Binary::Worker] {
                for (line, flags) in commands(&text, bin) {
                    if !flags.is_empty() {
                        seen.insert(bin);
                    }
                    for flag in flags {
                        if !accepted[&bin].contains(&flag) {
                            unknown.push(format!(
                                "{}:{line}: {} has no {flag}",
                                path.display(),
                                bin.name()
                            ));
                        }
                    }
                }
            }
        }
        // Every group starts both binaries with flags: a parser that found nothing fails.
        assert_eq!(
            seen,
            BTreeSet::from([Binary::Coordinator, Binary::Worker]),
            "no command with flags found for some binary in the {group} files"
        );
    }
    assert!(
        unknown.is_empty(),
        "flags the binaries do not accept:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn deploy_flag_parser_reads_each_command_form() {
    let text = [
        "ExecStart=/usr/local/bin/automaton-worker --agent 'x --nope' \\",
        "  --work-dir /w",
        "After=automaton-worker.service --nope",
        "command: [\"automaton-coordinator\", \"--config\", \"/c\"] --nope",
        "    - automaton-coordinator",
        "    - --listen",
        "    - 0.0.0.0:1",
        "  - --nope",
        "`automaton-worker` and `cargo test -p automaton-coordinator --nope`",
    ]
    .join("\n");
    let text = text.as_str();
    assert_eq!(
        commands(text, Binary::Worker),
        vec![
            (1, vec!["--agent".into(), "--work-dir".into()]),
            (9, vec![])
        ]
    );
    assert_eq!(
        commands(text, Binary::Coordinator),
        vec![(4, vec!["--config".into()]), (5, vec!["--listen".into()])]
    );
}

/// Every PromQL expression in the dashboard.
fn dashboard_queries() -> Vec<(String, String, String)> {
    let path = deploy_dir().join("grafana/automaton.json");
    let dash: serde_json::Value = serde_json::from_str(&read(&path)).expect("dashboard is JSON");
    let mut out = Vec::new();
    let mut stack = vec![&dash];
    let mut title = String::new();
    while let Some(v) = stack.pop() {
        match v {
            serde_json::Value::Object(m) => {
                if let Some(t) = m.get("title").and_then(|t| t.as_str()) {
                    title = t.to_string();
                }
                if let Some(expr) = m.get("expr").and_then(|e| e.as_str()) {
                    let legend = m.get("legendFormat").and_then(|l| l.as_str()).unwrap_or("");
                    out.push((title.clone(), expr.to_string(), legend.to_string()));
                }
                stack.extend(m.values());
            }
            serde_json::Value::Array(a) => stack.extend(a.iter().rev()),
            _ => {}
        }
    }
    out
}

/// The metric a series name belongs to (`x_bucket` of a histogram is `x`), if it is known.
fn known_metric(series: &str) -> Option<&'static str> {
    if let Some((name, _)) = METRICS.iter().find(|(n, _)| *n == series) {
        return Some(name);
    }
    HISTOGRAMS.iter().copied().find(|h| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .any(|s| series.strip_prefix(h) == Some(s))
    })
}

fn identifiers(s: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (i, c) in s.char_indices().chain([(s.len(), ' ')]) {
        let part = c.is_ascii_alphanumeric() || c == '_' || c == ':';
        match (part, start) {
            (true, None) => start = Some(i),
            (false, Some(st)) => {
                out.push((st, &s[st..i]));
                start = None;
            }
            _ => {}
        }
    }
    out
}

/// The label names an expression uses: in `by (...)`/`without (...)` and in `{...}` matchers.
fn labels_used(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    for kw in ["by", "without"] {
        for (at, word) in identifiers(expr) {
            if word != kw {
                continue;
            }
            let rest = expr[at + kw.len()..].trim_start();
            if let Some(inner) = rest.strip_prefix('(').and_then(|r| r.split(')').next()) {
                out.extend(inner.split(',').map(|l| l.trim().to_string()));
            }
        }
    }
    for part in expr.split('{').skip(1) {
        let inner = part.split('}').next().unwrap_or("");
        for m in inner.split(',') {
            let name = m.split(['=', '!', '~']).next().unwrap_or("").trim();
            if !name.is_empty() {
                out.push(name.to_string());
            }
        }
    }
    out
}

#[test]
fn dashboard_queries_use_known_metrics() {
    let queries = dashboard_queries();
    assert!(
        queries.len() >= 10,
        "the dashboard has {} queries",
        queries.len()
    );
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    for (panel, expr, legend) in &queries {
        let mut metrics = Vec::new();
        for (at, word) in identifiers(expr) {
            let selector = expr[at + word.len()..].trim_start().starts_with('{');
            if word.starts_with("automaton_") || selector {
                match known_metric(word) {
                    Some(m) => metrics.push(m),
                    None => problems.push(format!("panel '{panel}': {word} is not a known metric")),
                }
            }
        }
        if metrics.is_empty() {
            problems.push(format!("panel '{panel}': `{expr}` queries no known metric"));
        }
        used.extend(metrics.iter().copied());
        let mut allowed: BTreeSet<&str> = TARGET_LABELS.iter().copied().collect();
        for m in &metrics {
            let labels = METRICS.iter().find(|(n, _)| n == m).map(|(_, l)| *l);
            allowed.extend(labels.unwrap_or(&[]));
            if HISTOGRAMS.contains(m) {
                allowed.insert("le");
            }
        }
        let legend_labels = legend
            .split("{{")
            .skip(1)
            .filter_map(|p| p.split("}}").next())
            .map(|l| l.trim().to_string());
        for label in labels_used(expr).into_iter().chain(legend_labels) {
            if !allowed.contains(label.as_str()) {
                problems.push(format!(
                    "panel '{panel}': label '{label}' is not one of {metrics:?}'s"
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // And the dashboard shows every metric there is.
    let missing: Vec<&str> = METRICS
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| !used.contains(n))
        .collect();
    assert!(missing.is_empty(), "metrics no panel shows: {missing:?}");
}
