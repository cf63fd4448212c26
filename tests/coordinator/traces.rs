//! Issue 13, traces: a real OTLP receiver (opentelemetry-proto's `TraceService`, served by
//! tonic on 127.0.0.1:0 in the test) takes what a real coordinator and a real worker export
//! while one phase runs; one trace holds both processes' spans, parent-linked, with the
//! attributes people read. Without an endpoint nothing is built, exported or logged.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use tonic::{Request, Response, Status};

use crate::harness::*;
use crate::work::{FLEET, git_init, scripted_worker};
use crate::workers::Worker;

/// Collects every export request.
#[derive(Clone, Default)]
struct Receiver {
    got: Arc<Mutex<Vec<ExportTraceServiceRequest>>>,
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        req: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        self.got
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(req.into_inner());
        Ok(Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Serves on 127.0.0.1:0; returns the receiver and its `http://` URL.
    async fn start() -> (Receiver, String) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let addr = listener.local_addr().expect("receiver address");
        let r = Receiver::default();
        let svc = TraceServiceServer::new(r.clone());
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (r, format!("http://{addr}"))
    }

    fn spans(&self) -> Vec<Span> {
        let got = self.got.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for req in got.iter() {
            for rs in &req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| text(&r.attributes, "service.name"))
                    .unwrap_or_default();
                for ss in &rs.scope_spans {
                    for s in &ss.spans {
                        out.push(Span {
                            service: service.clone(),
                            name: s.name.clone(),
                            trace: hex(&s.trace_id),
                            id: hex(&s.span_id),
                            parent: hex(&s.parent_span_id),
                            attrs: s
                                .attributes
                                .iter()
                                .filter_map(|kv| Some((kv.key.clone(), value(kv)?)))
                                .collect(),
                            error: s
                                .status
                                .as_ref()
                                .filter(|st| st.code == StatusCode::Error as i32)
                                .map(|st| st.message.clone()),
                        });
                    }
                }
            }
        }
        out
    }
}

/// One exported span, flattened for assertions.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
    attrs: HashMap<String, String>,
    /// The status message when the status is ERROR.
    error: Option<String>,
}

impl Span {
    fn attr(&self, k: &str) -> &str {
        self.attrs.get(k).map(String::as_str).unwrap_or("")
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn value(kv: &KeyValue) -> Option<String> {
    Some(match kv.value.as_ref()?.value.as_ref()? {
        Value::StringValue(s) => s.clone(),
        Value::IntValue(i) => i.to_string(),
        Value::BoolValue(b) => b.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        _ => return None,
    })
}

fn text(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs.iter().find(|kv| kv.key == key).and_then(value)
}

/// Names of the threads of process `pid` (`/proc/PID/task/*/comm`).
fn threads(pid: u32) -> Vec<String> {
    let mut out = Vec::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in dir.flatten() {
            if let Ok(c) = std::fs::read_to_string(t.path().join("comm")) {
                out.push(c.trim().to_string());
            }
        }
    }
    out
}

/// The variables that point both processes at `url`, batches sent every `delay_ms`.
fn otel_env(url: &str, delay_ms: u64) -> Vec<(&'static str, String)> {
    vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT", url.to_string()),
        ("OTEL_BSP_SCHEDULE_DELAY", delay_ms.to_string()),
    ]
}

/// Waits (bounded) until `task` has a run that stopped with `reason` (the worker has
/// reported it: its span has ended).
async fn wait_run(api: &mut Api, task: &str, reason: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let runs = api.get(task).await.map(|d| d.runs).unwrap_or_default();
        if runs.iter().any(|r| r.stop_reason == reason) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{task} has no run stopped '{reason}': {runs:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn the<'a>(spans: &'a [Span], service: &str, name: &str, trace: &str) -> &'a Span {
    spans
        .iter()
        .find(|s| s.service == service && s.name == name && s.trace == trace)
        .unwrap_or_else(|| {
            panic!(
                "no {name} span of {service} in trace {trace}; spans:\n{}",
                listing(spans)
            )
        })
}

fn listing(spans: &[Span]) -> String {
    spans
        .iter()
        .map(|s| {
            format!(
                "{} {} {} id={} parent={} {:?}",
                s.service, s.trace, s.name, s.id, s.parent, s.attrs
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

const COORD: &str = "automaton-coordinator";
const WORKER: &str = "automaton-worker";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_phase_run_is_one_trace_holding_coordinator_and_worker_spans_with_their_attributes() {
    let (receiver, url) = Receiver::start().await;
    // No batch is due within the test: every span arrives through the flush on SIGTERM.
    let vars = otel_env(&url, 600_000);
    let envs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let env = Env::new();
    git_init(&env);
    let mut coord = Coord::start_with_env(&env, &FLEET, &envs);
    let mut api = coord.api().await;
    let mut worker: Worker = scripted_worker(&coord, "gpu-a", "sim:24GiB", &envs);
    // Export on: each process runs the exporter's runtime (the twin of the check below).
    for pid in [coord.pid(), worker.pid()] {
        let names = threads(pid);
        assert!(
            names.iter().any(|n| n == "otlp-export"),
            "no exporter thread in {pid}: {names:?}"
        );
    }
    api.create("t").await.expect("create");
    // One phase: research, run by the worker, completed into research:awaiting_approval.
    wait_run(&mut api, "t", "completed").await;
    assert_eq!(api.state("t").await, "research:awaiting_approval");
    assert!(
        receiver.spans().is_empty(),
        "a batch left before the shutdown flush"
    );
    // A traced caller's failed call: its server span joins the caller's trace, and the
    // error is on it and on the handler's span.
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let mut call = tonic::Request::new(automaton_proto::v1::CompletePhaseRequest {
        lease_id: "no-such-lease".into(),
        token: 1,
        target: String::new(),
    });
    call.metadata_mut().insert(
        "traceparent",
        format!("00-{caller_trace}-{caller_span}-01")
            .parse()
            .expect("ascii"),
    );
    let refused = automaton_proto::v1::work_client::WorkClient::new(coord.channel().await)
        .complete_phase(call)
        .await
        .expect_err("no such lease");
    assert_eq!(refused.code(), tonic::Code::NotFound);
    // Stopping flushes: SIGTERM both, then read what arrived.
    assert!(worker.terminate().success(), "{}", worker.stderr());
    assert!(coord.terminate().success(), "{}", coord.stderr());
    let spans = receiver.spans();

    // The worker's run and the coordinator's dispatch decision share one trace.
    let run = spans
        .iter()
        .find(|s| s.service == WORKER && s.name == "agent.run")
        .unwrap_or_else(|| panic!("no agent.run span from the worker:\n{}", listing(&spans)));
    let trace = run.trace.clone();
    let assign = the(&spans, COORD, "assign", &trace);
    assert_eq!(
        assign.parent, "",
        "the dispatch decision is the trace's root"
    );
    assert_eq!(run.parent, assign.id, "the run is the decision's child");
    for s in [assign, run] {
        assert_eq!(s.attr("automaton.task"), "t", "{s:?}");
        assert_eq!(s.attr("automaton.phase"), "research", "{s:?}");
        assert_eq!(s.attr("automaton.agent"), "gpu-a", "{s:?}");
        assert_eq!(s.attr("automaton.worker"), "gpu-a", "{s:?}");
        assert!(s.attr("automaton.gpu").contains("24 GiB"), "{s:?}");
        assert!(
            s.attr("automaton.budget_tokens")
                .parse::<u64>()
                .is_ok_and(|b| b > 0),
            "{s:?}"
        );
        assert!(s.attr("automaton.lease_id").len() > 8, "{s:?}");
        assert!(
            s.attr("automaton.token")
                .parse::<u64>()
                .is_ok_and(|t| t > 0),
            "{s:?}"
        );
        assert_eq!(s.error, None, "{s:?}");
    }
    assert_eq!(
        assign.attr("automaton.lease_id"),
        run.attr("automaton.lease_id")
    );
    assert_eq!(assign.attr("automaton.token"), run.attr("automaton.token"));
    assert!(
        assign.attr("automaton.why").contains("gpu-a"),
        "the decision says why that worker: {assign:?}"
    );
    assert_eq!(run.attr("automaton.stop_reason"), "completed");

    // The lease grant, under the decision.
    let grant = the(&spans, COORD, "lease.grant", &trace);
    assert_eq!(grant.parent, assign.id);
    assert_eq!(
        grant.attr("automaton.lease_id"),
        assign.attr("automaton.lease_id")
    );
    assert_eq!(
        grant.attr("automaton.token"),
        assign.attr("automaton.token")
    );

    // Each call the run made joins it on the coordinator: the server span is the run's
    // child, the handler's span the server span's.
    let rpc = |method: &str| -> &Span {
        spans
            .iter()
            .find(|s| {
                s.service == COORD
                    && s.name == format!("automaton.v1.Work/{method}")
                    && s.trace == trace
            })
            .unwrap_or_else(|| panic!("no {method} server span:\n{}", listing(&spans)))
    };
    for (method, handler) in [
        ("FetchWorkspace", "work.fetch_workspace"),
        ("UploadArtifact", "work.upload_artifact"),
        ("CompletePhase", "work.complete_phase"),
    ] {
        let server = rpc(method);
        assert_eq!(server.parent, run.id, "{method}: {server:?}");
        assert_eq!(
            server.attr("rpc.service"),
            "automaton.v1.Work",
            "{server:?}"
        );
        assert_eq!(server.error, None, "{server:?}");
        let h = the(&spans, COORD, handler, &trace);
        assert_eq!(h.parent, server.id, "{handler}: {h:?}");
        assert_eq!(h.attr("automaton.task"), "t");
        assert_eq!(
            h.attr("automaton.lease_id"),
            assign.attr("automaton.lease_id")
        );
        assert_eq!(h.attr("automaton.token"), assign.attr("automaton.token"));
        assert_eq!(h.error, None, "{h:?}");
    }
    let upload = the(&spans, COORD, "work.upload_artifact", &trace);
    assert!(
        upload.attr("automaton.detail").starts_with("SPEC.md ("),
        "{upload:?}"
    );
    // The start (new → research) the decision made before its grant.
    let start = spans
        .iter()
        .find(|s| s.name == "task.transition" && s.parent == assign.id)
        .unwrap_or_else(|| panic!("no start under the decision:\n{}", listing(&spans)));
    assert_eq!(start.attr("automaton.from"), "new");
    assert_eq!(start.attr("automaton.target"), "research");
    // The transition that completing the phase made.
    let complete = the(&spans, COORD, "work.complete_phase", &trace);
    let transition = spans
        .iter()
        .find(|s| s.name == "task.transition" && s.parent == complete.id)
        .unwrap_or_else(|| panic!("no transition under CompletePhase:\n{}", listing(&spans)));
    assert_eq!(transition.attr("automaton.from"), "research");
    assert_eq!(
        transition.attr("automaton.target"),
        "research:awaiting_approval"
    );
    let server = the(
        &spans,
        COORD,
        "automaton.v1.Work/CompletePhase",
        caller_trace,
    );
    assert_eq!(server.parent, caller_span);
    assert_eq!(server.attr("rpc.grpc.status_code"), "5");
    assert!(
        server
            .error
            .as_deref()
            .is_some_and(|m| m.contains("No live lease")),
        "{server:?}"
    );
    let handler = the(&spans, COORD, "work.complete_phase", caller_trace);
    assert_eq!(handler.parent, server.id);
    assert!(
        handler
            .error
            .as_deref()
            .is_some_and(|m| m.starts_with("NotFound: No live lease")),
        "{handler:?}"
    );
    if std::env::var_os("AUTOMATON_PRINT_TRACE").is_some() {
        eprintln!("{}", listing(&spans));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_agent_run_is_an_error_span_with_its_stop_reason() {
    let (receiver, url) = Receiver::start().await;
    let vars = otel_env(&url, 100);
    let mut envs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let env = Env::new();
    git_init(&env);
    let mut coord = Coord::start_with_env(&env, &FLEET, &envs);
    let mut api = coord.api().await;
    envs.push(("AUTOMATON_SCRIPTED_BEHAVIOUR", "exit-1"));
    let mut worker = scripted_worker(&coord, "gpu-a", "sim:24GiB", &envs);
    api.create("t").await.expect("create");
    wait_run(&mut api, "t", "agent_error").await;
    assert!(worker.terminate().success(), "{}", worker.stderr());
    assert!(coord.terminate().success(), "{}", coord.stderr());
    let spans = receiver.spans();
    let failed = spans
        .iter()
        .find(|s| {
            s.service == WORKER
                && s.name == "agent.run"
                && s.attr("automaton.stop_reason") == "agent_error"
        })
        .unwrap_or_else(|| panic!("no failed agent.run span:\n{}", listing(&spans)));
    let message = failed
        .error
        .as_deref()
        .unwrap_or_else(|| panic!("the failed run's span has no ERROR status: {failed:?}"));
    assert!(message.starts_with("agent_error: "), "{message}");
    // Still one trace with the decision that sent it there.
    let assign = the(&spans, COORD, "assign", &failed.trace);
    assert_eq!(failed.parent, assign.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_otlp_endpoint_no_exporter_runs_and_nothing_is_logged_about_it() {
    // Every other OTEL variable set: only an endpoint turns export on.
    let envs = [
        ("OTEL_SERVICE_NAME", "should-not-matter"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_TRACES_SAMPLER", "always_on"),
    ];
    let env = Env::new();
    git_init(&env);
    let mut coord = Coord::start_with_env(&env, &FLEET, &envs);
    let mut api = coord.api().await;
    let mut worker = scripted_worker(&coord, "gpu-a", "sim:24GiB", &envs);
    api.create("t").await.expect("create");
    wait_run(&mut api, "t", "completed").await;
    // No exporter runtime and no batch processor thread in either process.
    for pid in [coord.pid(), worker.pid()] {
        let names = threads(pid);
        assert!(!names.is_empty(), "cannot read the threads of {pid}");
        assert!(
            !names
                .iter()
                .any(|n| n == "otlp-export" || n.starts_with("OpenTelemetry")),
            "export machinery running without an endpoint in {pid}: {names:?}"
        );
    }
    assert!(worker.terminate().success(), "{}", worker.stderr());
    assert!(coord.terminate().success(), "{}", coord.stderr());
    for (who, log) in [("coordinator", coord.stderr()), ("worker", worker.stderr())] {
        let lower = log.to_lowercase();
        for word in [
            "otlp",
            "opentelemetry",
            "otel",
            "traceparent",
            "trace export",
        ] {
            assert!(!lower.contains(word), "the {who} logged '{word}':\n{log}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_logs_json_with_log_format_json_and_rust_log_filters_what_it_logs() {
    let env = Env::new();
    let coord = Coord::start(&env, &FLEET);
    let mut json = Worker::start(
        &coord.url,
        &["--name", "w-json", "--log-format", "json"],
        &[],
    );
    let mut quiet = Worker::start(&coord.url, &["--name", "w-quiet"], &[("RUST_LOG", "warn")]);
    let mut text = Worker::start(&coord.url, &["--name", "w-text"], &[]);
    for w in [&mut json, &mut quiet, &mut text] {
        assert!(w.terminate().success(), "{}", w.stderr());
    }
    let lines: Vec<String> = json.stderr().lines().map(str::to_string).collect();
    assert!(!lines.is_empty(), "the json worker logged nothing");
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v.get("level").is_some() && v.get("fields").is_some(), "{l}");
    }
    // Text: one plain line per event, no colours off a terminal.
    let t = text.stderr();
    assert!(t.contains(" INFO "), "{t}");
    assert!(!t.contains('\u{1b}'), "ANSI escapes off a terminal: {t:?}");
    // RUST_LOG=warn: the info lines are gone.
    let q = quiet.stderr();
    assert!(!q.contains(" INFO "), "{q}");
}

#[test]
fn an_unknown_log_format_or_a_bad_rust_log_stops_the_worker_with_one_line() {
    for (args, envs, says) in [
        (
            vec!["--log-format", "yaml"],
            vec![],
            "automaton-worker: unknown --log-format 'yaml': use text or json",
        ),
        (
            vec![],
            vec![("RUST_LOG", "info,=[")],
            "automaton-worker: RUST_LOG is not a valid filter",
        ),
    ] {
        let mut c = std::process::Command::new(worker_bin());
        c.args(["--coordinator", "http://127.0.0.1:1"]).args(&args);
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        c.envs(envs.iter().copied());
        let out = run_bounded(c, Duration::from_secs(20));
        assert_eq!(out.code, 2, "{args:?} {envs:?}: {out:?}");
        assert!(
            out.stderr.starts_with(says) && out.stderr.trim_end().lines().count() == 1,
            "{:?}",
            out.stderr
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_is_logged_and_the_coordinator_serves_on() {
    // Port 1 on loopback: nothing listens there.
    let envs = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let env = Env::new();
    let mut coord = Coord::start_with_env(&env, &[], &envs);
    let mut api = coord.api().await;
    api.create("t").await.expect("create");
    assert!(
        coord.wait_stderr("Export.Failed", Duration::from_secs(20)),
        "{}",
        coord.stderr()
    );
    // Still serving; and the exit is not held up by spans it cannot send.
    api.create("u").await.expect("create after a failed export");
    let stopped = Instant::now();
    assert!(coord.terminate().success(), "{}", coord.stderr());
    assert!(stopped.elapsed() < Duration::from_secs(15));
}
