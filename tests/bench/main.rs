//! Cross-process tests of the benchmark: the real `automaton-bench` binary drives a real
//! `automaton-coordinator` it spawns on `127.0.0.1:0`, through each of its two clients, and
//! every figure it reports must come from calls that succeeded.

use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "../common/run.rs"]
mod run;
use run::Run;

const BENCH: &str = env!("CARGO_BIN_EXE_automaton-bench");

/// The coordinator binary, built next to the bench by `cargo test --workspace`.
fn coordinator_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    let bin = dir.join(format!(
        "automaton-coordinator{}",
        std::env::consts::EXE_SUFFIX
    ));
    assert!(
        bin.is_file(),
        "the coordinator binary is missing at {}: run `cargo test --workspace` (or `cargo build --workspace`) first",
        bin.display()
    );
    bin
}

fn bench(args: &[&str]) -> Run {
    Command::new(BENCH)
        .args(args)
        .output()
        .expect("run automaton-bench")
        .into()
}

/// A short run against a spawned coordinator with `client`; returns the JSON report.
fn measure(client: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("report.json");
    let coordinator = coordinator_bin();
    bench(&[
        "leases",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf-8 path"),
        "--clients",
        "1,3",
        "--duration",
        "300ms",
        "--slices",
        "1",
        "--tasks-per-client",
        "5",
        "--client",
        client,
        "--json-out",
        json.to_str().expect("utf-8 path"),
    ])
    .ok();
    serde_json::from_str(&std::fs::read_to_string(&json).expect("report written"))
        .expect("report is JSON")
}

/// Every operation at every client count measured calls, and none failed.
fn assert_all_measured(report: &serde_json::Value, client: &str) {
    assert_eq!(report["client"], client);
    let results = report["results"].as_array().expect("results");
    for clients in [1, 3] {
        for op in ["claim", "renew", "release"] {
            let r = results
                .iter()
                .find(|r| r["op"] == op && r["clients"] == clients)
                .unwrap_or_else(|| panic!("no {op} row at {clients} clients: {report}"));
            assert_eq!(r["system"], "automaton");
            assert_eq!(r["errors"], 0, "{op} at {clients} clients failed: {r}");
            assert!(r["ops"].as_u64().expect("ops") > 0, "no {op} measured: {r}");
            assert!(r["ops_per_s"].as_f64().expect("ops/s") > 0.0, "{r}");
            assert!(
                r["p99_ms"].as_f64().expect("p99") >= r["p50_ms"].as_f64().expect("p50"),
                "{r}"
            );
        }
    }
}

#[test]
fn raw_client_measures_claim_renew_and_release_against_the_real_coordinator() {
    assert_all_measured(&measure("raw"), "raw");
}

#[test]
fn tonic_client_measures_the_same_operations_for_a_cross_check() {
    assert_all_measured(&measure("tonic"), "tonic");
}

#[test]
fn raw_client_refuses_shared_connections_in_one_line() {
    let r = bench(&[
        "leases",
        "--coordinator",
        "http://127.0.0.1:9",
        "--connections",
        "2",
    ]);
    r.code(1);
    assert!(
        r.error_line().contains("--connections") && r.error_line().contains("--client tonic"),
        "{}",
        r.stderr
    );
}

#[test]
fn raw_client_needs_a_cleartext_url() {
    let r = bench(&["leases", "--coordinator", "https://127.0.0.1:9"]);
    r.code(1);
    assert!(r.error_line().contains("--client tonic"), "{}", r.stderr);
}
