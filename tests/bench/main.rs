//! Cross-process tests of the benchmark: the real `automaton-bench` binary drives a real
//! `automaton-coordinator` it spawns on `127.0.0.1:0`, and its own echo servers (the
//! ceilings it measures against), through each of its two clients; every figure it reports
//! must come from calls that succeeded.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

#[path = "../common/run.rs"]
mod run;
use run::Run;

const BENCH: &str = env!("CARGO_BIN_EXE_automaton-bench");

/// The coordinator binary, built next to the bench by `cargo test --workspace`.
fn coordinator_bin() -> PathBuf {
    sibling_bin("automaton-coordinator")
}

/// A binary of the workspace in target/<profile>/, next to the bench.
fn sibling_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("the test binary lives in target/<profile>/deps");
    let bin = dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    assert!(
        bin.is_file(),
        "the {name} binary is missing at {}: run `cargo test --workspace` (or `cargo build --workspace`) first",
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

/// A short run with `client` against `server` (`--spawn-coordinator BIN` or `--coordinator
/// URL`); returns the JSON report.
fn measure(server: &[&str], client: &str) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("report.json");
    let mut args = vec!["leases"];
    args.extend_from_slice(server);
    args.extend_from_slice(&[
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
    ]);
    bench(&args).ok();
    serde_json::from_str(&std::fs::read_to_string(&json).expect("report written"))
        .expect("report is JSON")
}

fn measure_coordinator(client: &str) -> serde_json::Value {
    let coordinator = coordinator_bin();
    measure(
        &[
            "--spawn-coordinator",
            coordinator.to_str().expect("utf-8 path"),
        ],
        client,
    )
}

/// A running `automaton-bench echo-server` on `127.0.0.1:0`; killed when dropped.
struct EchoServer {
    child: Child,
    url: String,
}

impl EchoServer {
    fn start(extra: &[&str]) -> EchoServer {
        let mut child = Command::new(BENCH)
            .args(["echo-server", "--listen", "127.0.0.1:0"])
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the echo server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("read the echo server's first line");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("unexpected first line: {line:?}"));
        EchoServer {
            url: format!("http://{addr}"),
            child,
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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
    assert_all_measured(&measure_coordinator("raw"), "raw");
}

#[test]
fn tonic_client_measures_the_same_operations_for_a_cross_check() {
    assert_all_measured(&measure_coordinator("tonic"), "tonic");
}

#[test]
fn both_echo_servers_answer_every_operation_through_both_clients() {
    for server in [&[][..], &["--inline"][..]] {
        let echo = EchoServer::start(server);
        for client in ["raw", "tonic"] {
            assert_all_measured(&measure(&["--coordinator", &echo.url], client), client);
        }
    }
}

/// The inline server speaks gRPC to a stock client too: every renewal answered in order, the
/// stream ended cleanly when the client ends it, an unserved method refused by its code.
#[tokio::test]
async fn inline_echo_server_answers_a_stock_grpc_client() {
    use automaton_proto::v1 as pb;
    let echo = EchoServer::start(&["--inline"]);
    let channel = tonic::transport::Endpoint::from_shared(echo.url.clone())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let mut leases = pb::leases_client::LeasesClient::new(channel.clone());
    let requests = tokio_stream::iter((0..3).map(|i| pb::KeepAliveRequest {
        lease_ids: vec![format!("lease-{i}")],
    }));
    let mut answers = leases
        .keep_alive(requests)
        .await
        .expect("KeepAlive opens")
        .into_inner();
    for i in 0..3 {
        let a = answers
            .message()
            .await
            .expect("an answer")
            .expect("not the end yet");
        assert_eq!(a.lease_id, format!("lease-{i}"));
        assert!(a.lease.expect("renewed").renewed);
    }
    assert!(
        answers.message().await.expect("a clean end").is_none(),
        "the stream ends once the client's requests do"
    );
    let lease = leases
        .claim(pb::ClaimRequest {
            task: "t".into(),
            agent: "a".into(),
            ..Default::default()
        })
        .await
        .expect("claim answered")
        .into_inner();
    assert_eq!((lease.task.as_str(), lease.agent.as_str()), ("t", "a"));
    // A renewal of that lease carries its token, as the coordinator's answer does: both put
    // the same fields on the wire per renewal.
    let mut answers = leases
        .keep_alive(tokio_stream::iter([pb::KeepAliveRequest {
            lease_ids: vec![lease.lease_id.clone()],
        }]))
        .await
        .expect("KeepAlive opens")
        .into_inner();
    let renewed = answers
        .message()
        .await
        .expect("an answer")
        .and_then(|a| a.lease)
        .expect("renewed");
    assert_eq!(
        (
            renewed.lease_id.as_str(),
            renewed.token,
            renewed.ttl.is_some()
        ),
        (lease.lease_id.as_str(), lease.token, true)
    );
    let refused = pb::tasks_client::TasksClient::new(channel)
        .approve(pb::ApproveRequest::default())
        .await
        .expect_err("the echo server approves nothing");
    assert_eq!(refused.code(), tonic::Code::Unimplemented, "{refused}");
}

#[test]
fn compare_export_measures_claims_with_trace_export_off_and_on_and_the_sink_gets_spans() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("report.json");
    let coordinator = coordinator_bin();
    bench(&[
        "leases",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf-8 path"),
        "--compare-export",
        "--clients",
        "2",
        "--duration",
        "300ms",
        "--slices",
        "1",
        "--tasks-per-client",
        "5",
        "--ops",
        "claim-release",
        "--json-out",
        json.to_str().expect("utf-8 path"),
    ])
    .ok();
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("report written"))
            .expect("report is JSON");
    for system in ["automaton", "automaton+otlp"] {
        let claim = report["results"]
            .as_array()
            .expect("results")
            .iter()
            .find(|r| r["system"] == system && r["op"] == "claim")
            .unwrap_or_else(|| panic!("no {system} claim row: {report}"));
        assert_eq!(claim["errors"], 0, "{claim}");
        assert!(claim["ops"].as_u64().expect("ops") > 0, "{claim}");
    }
    let k = report["export_comparisons"]
        .as_array()
        .expect("export comparisons")
        .iter()
        .find(|k| k["op"] == "claim")
        .unwrap_or_else(|| panic!("no claim comparison: {report}"));
    assert!(k["throughput_ratio"].as_f64().expect("ratio") > 0.0, "{k}");
    assert_eq!(k["target_ratio"], 0.9);
    // The exporting coordinator did export (its prepare calls' spans), flushed at its stop.
    assert!(
        report["otlp_spans_received"].as_u64().expect("span count") > 0,
        "{report}"
    );
}

/// `leases --spawn-echo` with `--ops` and an optional extra flag; returns the JSON report and
/// the printed table.
fn measure_with_echo(ops: &str, extra: &[&str]) -> (serde_json::Value, String) {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("report.json");
    let coordinator = coordinator_bin();
    let mut args = vec![
        "leases",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf-8 path"),
        "--spawn-echo",
        "--clients",
        "1",
        "--duration",
        "1s",
        "--ops",
        ops,
        "--slices",
        "1",
        "--tasks-per-client",
        "5",
        "--json-out",
        json.to_str().expect("utf-8 path"),
    ];
    args.extend_from_slice(extra);
    let run = bench(&args);
    run.ok();
    let report = serde_json::from_str(&std::fs::read_to_string(&json).expect("report written"))
        .expect("report is JSON");
    (report, run.stdout)
}

/// The row of `system`'s `op`, which measured calls and had none fail.
fn measured_row<'a>(
    report: &'a serde_json::Value,
    system: &str,
    op: &str,
) -> &'a serde_json::Value {
    let r = report["results"]
        .as_array()
        .expect("results")
        .iter()
        .find(|r| r["system"] == system && r["op"] == op && r["clients"] == 1)
        .unwrap_or_else(|| panic!("no {system} {op} row: {report}"));
    assert_eq!(r["errors"], 0, "{system} {op} failed: {r}");
    assert!(
        r["ops"].as_u64().expect("ops") > 0,
        "no {system} {op} measured: {r}"
    );
    r
}

/// Issue 20: renewals against the zero-work ceiling measured in the same run. The bench
/// spawns its own echo server next to the coordinator (no etcd), measures both in the same
/// slices, and reports automaton / echo with the 80 % target.
#[test]
fn spawn_echo_measures_the_zero_work_ceiling_in_the_same_run_and_reports_the_renew_share() {
    let (report, table) = measure_with_echo("renew", &[]);
    assert_eq!(report["echo_server"], "echo-server", "{report}");
    assert!(
        report["echo"]
            .as_str()
            .expect("echo url")
            .starts_with("http://127.0.0.1:"),
        "{report}"
    );
    let automaton = measured_row(&report, "automaton", "renew");
    let echo = measured_row(&report, "echo", "renew");
    let results = report["results"].as_array().expect("results");
    assert!(
        results
            .iter()
            .all(|r| r["op"] == "renew" && r["system"] != "etcd"),
        "only renewals of the coordinator and the echo: {report}"
    );
    let ceilings = report["ceiling_comparisons"]
        .as_array()
        .expect("ceiling comparisons");
    assert_eq!(ceilings.len(), 1, "{report}");
    let k = &ceilings[0];
    assert_eq!(
        (&k["op"], &k["clients"]),
        (&"renew".into(), &1.into()),
        "{k}"
    );
    let share = automaton["ops_per_s"].as_f64().expect("ops/s")
        / echo["ops_per_s"].as_f64().expect("ops/s");
    let ratio = k["ceiling_ratio"].as_f64().expect("ratio");
    assert!(
        ratio > 0.0 && (ratio - share).abs() < 1e-9,
        "{k} vs {share}"
    );
    assert_eq!(k["target_ratio"], 0.8, "{k}");
    // At one client the target does not apply (16 and 64 clients, as against etcd).
    assert_eq!(k["target_applies"], false, "{k}");
    assert_eq!(k["throughput_met"], ratio >= 0.8, "{k}");
    assert!(
        report["comparisons"]
            .as_array()
            .expect("comparisons")
            .is_empty(),
        "no etcd, no etcd ratios: {report}"
    );
    let echo_row = table
        .lines()
        .find(|l| l.starts_with("echo ") && l.contains("renew"));
    assert!(echo_row.is_some(), "no echo row in the table:\n{table}");
    assert!(
        table.lines().any(|l| l.starts_with("ceiling")
            && l.contains("renew")
            && l.contains("automaton / echo")),
        "no ceiling line in the table:\n{table}"
    );
    assert!(
        report["shutdown"]
            .as_array()
            .expect("shutdown")
            .iter()
            .any(|s| s
                .as_str()
                .is_some_and(|s| s.starts_with("echo-server stopped"))),
        "the echo server was stopped: {report}"
    );
}

/// The inline echo server stands in the same way, and claims and releases are measured
/// against it too: a share of the unary ceiling, with no target.
#[test]
fn spawn_echo_inline_measures_claims_and_releases_as_a_ceiling_without_a_target() {
    let (report, _) = measure_with_echo("claim-release", &["--echo-inline"]);
    assert_eq!(report["echo_server"], "echo-server --inline", "{report}");
    for op in ["claim", "release"] {
        measured_row(&report, "automaton", op);
        measured_row(&report, "echo", op);
        let k = report["ceiling_comparisons"]
            .as_array()
            .expect("ceiling comparisons")
            .iter()
            .find(|k| k["op"] == op)
            .unwrap_or_else(|| panic!("no {op} ceiling: {report}"));
        assert!(k["ceiling_ratio"].as_f64().expect("ratio") > 0.0, "{k}");
        assert!(
            k["target_ratio"].is_null() && k["throughput_met"].is_null(),
            "{k}"
        );
    }
}

#[test]
fn echo_flags_refuse_a_second_echo_and_a_stray_inline_in_one_line() {
    let r = bench(&["leases", "--echo", "http://127.0.0.1:9", "--spawn-echo"]);
    r.code(2);
    assert!(r.stderr.contains("--spawn-echo"), "{}", r.stderr);
    let r = bench(&["leases", "--echo-inline"]);
    r.code(2);
    assert!(r.stderr.contains("--spawn-echo"), "{}", r.stderr);
    let r = bench(&["leases", "--echo", "https://127.0.0.1:9"]);
    r.code(1);
    assert!(r.error_line().contains("--client tonic"), "{}", r.stderr);
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

/// `automaton-bench restart`: every round restarts the real coordinator after `kill -9` on a
/// project of many folders and on the small reference, and reports both times.
#[test]
fn restart_bench_times_every_round_against_the_reference() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("restart.json");
    let coordinator = coordinator_bin();
    let run = bench(&[
        "restart",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--tasks",
        "300",
        "--live-leases",
        "5",
        "--rounds",
        "2",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("JSON");
    let rounds = report["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 2, "{report}");
    for r in rounds {
        for key in ["listening_s", "serving_s", "reference_serving_s"] {
            let v = r[key].as_f64().unwrap_or(-1.0);
            assert!(v > 0.0 && v < 60.0, "{key} = {v} in {r}");
        }
        assert!(r["serving_s"].as_f64() >= r["listening_s"].as_f64(), "{r}");
    }
}

/// `automaton-bench workers`: sessions register and heartbeat against the real coordinator,
/// and every lease of a session that went silent ends by the session's expiry.
#[test]
fn workers_bench_ends_every_killed_lease() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("workers.json");
    let coordinator = coordinator_bin();
    let run = bench(&[
        "workers",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--sessions",
        "20",
        "--heartbeat",
        "200ms",
        "--duration",
        "1s",
        "--kill",
        "5",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("JSON");
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 1, "{report}");
    let r = &results[0];
    assert_eq!(r["sessions"], 20, "{r}");
    assert_eq!(r["session_timeout_ms"], 1000, "{r}");
    assert_eq!(r["session_errors"], 0, "{r}");
    assert!(
        r["heartbeat_rtt"]["count"].as_u64().expect("count") > 0,
        "{r}"
    );
    assert!(r["coordinator_cpu_cores"].as_f64().is_some(), "{r}");
    assert!(
        r["coordinator_rss_peak_mib"].as_f64().expect("rss") > 0.0,
        "{r}"
    );
    assert_eq!(r["killed"], 5, "{r}");
    assert_eq!(r["leases_ended"], 5, "every killed lease ended: {r}");
    assert_eq!(r["lease_end"]["count"], 5, "{r}");
    let p50 = r["lease_end"]["p50_ms"].as_f64().expect("p50");
    assert!(
        p50 >= 900.0,
        "no lease ends well before the session timeout: {r}"
    );
    assert!(run.stdout.contains("lease end"), "{}", run.stdout);
}

/// `automaton-bench phases`: real workers with the scripted agent take every task through
/// every phase, the bench approving each gate, and every ungated hand-off is measured.
#[test]
fn phases_bench_drives_every_task_to_complete() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("phases.json");
    let coordinator = coordinator_bin();
    let worker = sibling_bin("automaton-worker");
    let started = std::time::Instant::now();
    let run = bench(&[
        "phases",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--worker",
        worker.to_str().expect("utf8 path"),
        "--workers",
        "2",
        "--tasks",
        "2",
        "--uploads",
        "2",
        "--timeout",
        "60s",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("JSON");
    assert_eq!(r["completed"], 2, "{r}");
    // Eight phases each, three gates each.
    assert_eq!(r["phases_assigned"], 16, "{r}");
    assert_eq!(r["approvals"], 6, "{r}");
    // implement -> code_review, bug_find -> adversarial_bug_find -> doc_review -> referee.
    assert_eq!(r["turnaround_all"]["count"], 8, "{r}");
    assert!(
        r["turnaround_all"]["p99_ms"].as_f64().expect("p99") > 0.0,
        "{r}"
    );
    assert!(r["tasks_per_min"].as_f64().expect("rate") > 0.0, "{r}");
    let upload = &r["upload"];
    assert_eq!(upload["size"], 8 * 1024 * 1024 - 1, "{r}");
    assert!(upload["p50_mb_per_s"].as_f64().expect("MB/s") > 0.0, "{r}");
    assert!(
        run.stdout.contains("artifact_uploaded -> assigned"),
        "{}",
        run.stdout
    );
}

/// `automaton-bench dispatch`: one wave of sub-tasks from an approved decomposition goes to
/// simulated workers of mixed budgets, every sub-task once, each to a worker whose budget
/// holds its estimate — the smallest such budget (best fit).
#[test]
fn dispatch_bench_assigns_every_subtask_to_a_worker_that_fits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("dispatch.json");
    let coordinator = coordinator_bin();
    let run = bench(&[
        "dispatch",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--workers",
        "20",
        "--subtasks",
        "20",
        "--timeout",
        "30s",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("JSON");
    let r = &report["results"][0];
    assert_eq!(r["subtasks"], 20, "{r}");
    assert_eq!(r["assignments"], 20, "every sub-task assigned: {r}");
    assert_eq!(r["fitting"], 20, "every assignment fits: {r}");
    assert_eq!(r["best_fit"], 20, "every assignment is the best fit: {r}");
    assert_eq!(r["wrong"], 0, "{r}");
    assert_eq!(r["session_errors"], 0, "{r}");
    assert!(r["dispatch_ms"].as_f64().expect("dispatch_ms") > 0.0, "{r}");
    assert!(r["create_ms"].as_f64().expect("create_ms") > 0.0, "{r}");
    assert!(run.stdout.contains("best fit"), "{}", run.stdout);
}

/// The HA benches need etcd 3.4 (`tests/setup` installs Debian's etcd-server): the real one,
/// never a fake.
fn etcd_bin() -> String {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("etcd is not on PATH: run tests/setup (it installs Debian's etcd-server)")
        })
        .display()
        .to_string()
}

fn report_of(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("report")).expect("JSON")
}

/// `automaton-bench failover`: every round kills the leading coordinator with SIGKILL and
/// a claim is granted by the other one, after the dead leader's key outlived it in etcd.
#[test]
fn failover_bench_kills_the_leader_and_claims_through_the_next_every_round() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("failover.json");
    let coordinator = coordinator_bin();
    let etcd = etcd_bin();
    let run = bench(&[
        "failover",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--etcd-bin",
        &etcd,
        "--failovers",
        "3",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let r = report_of(&json);
    let rounds = r["rounds"].as_array().expect("rounds");
    assert_eq!(rounds.len(), 3, "{r}");
    assert_eq!(r["election_ttl_ms"], 2000, "{r}");
    let mut killed = Vec::new();
    for round in rounds {
        let claim = round["claim_s"].as_f64().expect("claim_s");
        let gone = round["key_gone_s"]
            .as_f64()
            .expect("the old key was seen gone");
        let elected = round["elected_s"].as_f64().expect("a new key was seen");
        // A kill -9'd leader resigns nothing: its key lives until its etcd lease expires
        // (2 s TTL, about 2/3 of it or more left: a keepalive every 1/3). A graceful stop
        // revokes it at once (0.01-0.05 s here).
        assert!(
            gone >= 0.5,
            "the old key went {gone} s after the kill: {round}"
        );
        assert!(gone <= elected + 1e-9, "{round}");
        // Polled every 10 ms: the new key may be seen a moment after the claim it allowed.
        assert!(elected <= claim + 0.2, "{round}");
        assert!(claim > 0.5 && claim < 30.0, "{round}");
        // The new leader's log: serving before it granted the claim.
        let serving = round["serving_s"]
            .as_f64()
            .expect("the new leader's log says serving");
        assert!(serving <= claim + 0.05, "{round}");
        assert_ne!(round["killed"], round["granted_by"], "{round}");
        assert!(
            round["attempts"].as_u64().expect("attempts") >= 2,
            "{round}"
        );
        killed.push(round["killed"].as_str().expect("url").to_string());
    }
    // The restarted coordinator rejoins and leads again when the other is killed.
    assert_ne!(killed[0], killed[1], "{r}");
    assert_eq!(killed[0], killed[2], "{r}");
    let s = &r["summary"];
    assert_eq!(s["total"]["count"], 3, "{r}");
    assert_eq!(s["key_gone"]["count"], 3, "{r}");
    assert!(
        s["total"]["p99_ms"].as_f64() >= s["total"]["p50_ms"].as_f64(),
        "{r}"
    );
    assert_eq!(
        s["target_met"].as_bool().expect("target_met"),
        s["total"]["p99_ms"].as_f64().expect("p99") <= 3000.0,
        "{r}"
    );
    assert!(
        run.stdout.contains("kill -9 -> claim granted"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("target: p99"), "{}", run.stdout);
}

/// `automaton-bench ha-leases`: the coordinator in etcd mode, one etcd Txn per call and the
/// files-mode coordinator, measured in one run on one cluster, every call granted.
#[test]
fn ha_leases_bench_measures_etcd_mode_against_one_txn_per_claim() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("ha-leases.json");
    let coordinator = coordinator_bin();
    let etcd = etcd_bin();
    let run = bench(&[
        "ha-leases",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--etcd-bin",
        &etcd,
        "--clients",
        "2,4",
        "--duration",
        "2s",
        "--slices",
        "2",
        "--tasks-per-client",
        "5",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let r = report_of(&json);
    let results = r["results"].as_array().expect("results");
    for clients in [2, 4] {
        for op in ["claim", "release"] {
            for system in ["automaton-etcd", "automaton-files", "etcd-txn"] {
                let row = results
                    .iter()
                    .find(|x| x["system"] == system && x["op"] == op && x["clients"] == clients)
                    .unwrap_or_else(|| panic!("no {system} {op} row at {clients}: {r}"));
                assert_eq!(row["errors"], 0, "{row}");
                assert!(row["ops"].as_u64().expect("ops") > 0, "{row}");
                assert!(row["ops_per_s"].as_f64().expect("ops/s") > 0.0, "{row}");
            }
        }
    }
    let comparisons = r["comparisons"].as_array().expect("comparisons");
    assert_eq!(comparisons.len(), 4, "{r}");
    for k in comparisons {
        let ratio = k["ratio"].as_f64().expect("ratio");
        let want = k["automaton_etcd_ops_per_s"].as_f64().expect("a")
            / k["etcd_txn_ops_per_s"].as_f64().expect("e");
        assert!((ratio - want).abs() < 1e-9, "{k}");
        if k["op"] == "claim" {
            assert_eq!(k["target_ratio"], 3.0, "{k}");
            assert_eq!(k["target_met"].as_bool(), Some(ratio >= 3.0), "{k}");
        }
        assert!(
            k["files_over_etcd_mode"].as_f64().expect("files") > 0.0,
            "{k}"
        );
    }
    assert!(
        run.stdout.contains("automaton-etcd / etcd-txn"),
        "{}",
        run.stdout
    );
}

/// `automaton-bench workers --failover`: sessions on an HA pair, the leader killed: every
/// session finds the new leader and resumes with its lease; none is lost.
#[test]
fn workers_failover_bench_resumes_every_session_with_its_lease() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("workers-failover.json");
    let coordinator = coordinator_bin();
    let etcd = etcd_bin();
    let run = bench(&[
        "workers",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--failover",
        "--etcd-bin",
        &etcd,
        "--sessions",
        "50",
        "--heartbeat",
        "200ms",
        "--duration",
        "1s",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let report = report_of(&json);
    let r = &report["results"][0];
    assert_eq!(r["sessions"], 50, "{r}");
    assert_eq!(r["back"], 50, "{r}");
    assert_eq!(
        r["resumed"], 50,
        "every session resumed, none started anew: {r}"
    );
    assert_eq!(r["new_sessions"], 0, "{r}");
    assert_eq!(r["leases_kept"], 50, "{r}");
    assert_eq!(r["leases_lost"], 0, "{r}");
    assert_eq!(r["leases_on_new_leader"], 50, "{r}");
    assert_eq!(r["heartbeating_after"], 50, "{r}");
    assert_eq!(r["session_errors"], 0, "{r}");
    assert_eq!(r["resume"]["count"], 50, "{r}");
    assert_ne!(r["killed"], r["new_leader"], "{r}");
    // No session can be back before the dead leader's key expired (2 s TTL).
    assert!(
        r["resume"]["p50_ms"].as_f64().expect("p50") >= 1000.0,
        "{r}"
    );
    assert!(
        r["resume"]["max_ms"].as_f64() >= r["resume"]["p99_ms"].as_f64(),
        "{r}"
    );
    let serving = r["new_leader_term"]["serving_s"]
        .as_f64()
        .expect("the new leader's log says serving");
    assert!(
        serving * 1e3 <= r["resume"]["p50_ms"].as_f64().expect("p50") + 50.0,
        "{r}"
    );
    assert_eq!(r["met"], true, "{r}");
    assert!(run.stdout.contains("all resumed, 0 lost"), "{}", run.stdout);
}

/// `automaton-bench console`: every page of the real coordinator's console is fetched
/// without a failure and has a body, and every open event stream gets every churn event.
#[test]
fn console_bench_times_every_page_and_every_stream_gets_the_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("console.json");
    let coordinator = coordinator_bin();
    let run = bench(&[
        "console",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--tasks",
        "30",
        "--workers",
        "3",
        "--requests",
        "3",
        "--streams",
        "4",
        "--stream-duration",
        "2s",
        "--churn-every",
        "200ms",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("JSON");
    let pages = report["pages"].as_array().expect("pages");
    let names: Vec<&str> = pages.iter().filter_map(|p| p["page"].as_str()).collect();
    assert_eq!(
        names,
        [
            "/board",
            "/board?fragment=1",
            "/fleet",
            "/task/bench-0001",
            "ListTasks (gRPC)",
            "ListWorkers (gRPC)"
        ],
        "{report}"
    );
    for p in pages {
        assert_eq!(p["time"]["count"], 3, "{p}");
        assert!(p["bytes"].as_u64().unwrap_or(0) > 100, "{p}");
    }
    let refresh = &report["refresh"];
    assert_eq!(refresh["pages"], 4, "{refresh}");
    assert_eq!(refresh["wall"]["count"], 5, "{refresh}");
    assert!(
        refresh["wall"]["p50_ms"].as_f64().unwrap_or(0.0) > 0.0,
        "{refresh}"
    );
    let s = &report["streams"];
    let sent = s["events_sent"].as_u64().unwrap_or(0);
    assert!(sent >= 4, "{s}");
    // Every stream got the churn's events (two of slack for the last ones in flight on a
    // loaded machine when the streams close).
    assert!(s["events_min"].as_u64().unwrap_or(0) + 2 >= sent, "{s}");
    assert_eq!(s["streams_ended_early"], 0, "{s}");
    assert!(s["rss_end_mib"].as_f64().unwrap_or(0.0) > 1.0, "{s}");
    assert!(run.stdout.contains("| `/board` | 3 |"), "{}", run.stdout);
}

/// `automaton-bench delivery`: tasks completed at once are each merged into the project's
/// `main` exactly once by the real coordinator (the bench checks main's files, commits and
/// merge commits against the events, and fails otherwise), the git CLI merges the same
/// branches as the reference, and a decomposition's sub-tasks are merged into their
/// parent's branch — the first a fast-forward, the rest merge commits.
#[test]
fn delivery_bench_merges_every_task_into_main_once_and_every_subtask_into_its_parent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let json = dir.path().join("delivery.json");
    let coordinator = coordinator_bin();
    let run = bench(&[
        "delivery",
        "--spawn-coordinator",
        coordinator.to_str().expect("utf8 path"),
        "--tasks",
        "5",
        "--subtasks",
        "3",
        "--runs",
        "1",
        "--timeout",
        "60s",
        "--json-out",
        json.to_str().expect("utf8 path"),
    ]);
    assert_eq!(run.code, 0, "{run:?}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("report")).expect("JSON");
    let r = &report["runs"][0];
    let top = &r["top_level"];
    assert_eq!(top["tasks"], 5, "{top}");
    assert_eq!(top["complete_to_merged"]["count"], 5, "{top}");
    assert_eq!(
        top["fast_forwards"], 1,
        "the first lands as a fast-forward: {top}"
    );
    assert_eq!(top["merge_commits"], 4, "{top}");
    assert_eq!(top["git_merge"]["count"], 5, "{top}");
    assert!(top["merges_per_s"].as_f64().unwrap_or(0.0) > 0.0, "{top}");
    let g = &r["integration"];
    assert_eq!(
        g["store_kinds"],
        serde_json::json!(["fast-forward", "merge commit", "merge commit"]),
        "{g}"
    );
    assert_eq!(g["git"]["count"], 3, "{g}");
    assert_eq!(r["split"]["land"]["count"], 5, "{r}");
    assert!(run.stdout.contains("coordinator / git"), "{}", run.stdout);
}
