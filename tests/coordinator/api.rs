//! The API as a product (issue 13): typed answers, times and durations as the well-known
//! types, every field documented, and a client in another language (Python, grpcio) that
//! claims, renews and releases against the real coordinator.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use automaton_proto::prost_types;
use automaton_proto::v1 as pb;
use prost::Message;
use tonic::Code;

use crate::cli::same_as_local;
use crate::harness::{Coord, Env, Events, expect_err, ms, run_bounded};

/// Where `tests/setup` installs grpcio (pinned in tests/requirements.txt).
const PIP_INSTALL: &str = "tests/setup";

/// The Python of `target/test-tools` (`tests/setup`), else the one on PATH.
fn python() -> Command {
    let venv = repo().join("target/test-tools/bin/python3");
    if venv.exists() {
        Command::new(venv)
    } else {
        Command::new("python3")
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn client_file() -> PathBuf {
    repo().join("docs/api/automaton_client.py")
}

/// Fails in one line, saying what to install, when Python's gRPC is missing.
fn require_grpcio() {
    let probe = python().args(["-c", "import grpc, grpc_tools"]).output();
    match probe {
        Ok(o) if o.status.success() => {}
        _ => panic!(
            "python3 cannot import grpc and grpc_tools: run `{PIP_INSTALL}` (it installs grpcio into target/test-tools)"
        ),
    }
}

/// The time on a line of the client's output: `… expires 2026-12-01T08:26:07.534712257Z`.
fn expires(line: &str) -> SystemTime {
    let t = line
        .split_whitespace()
        .skip_while(|w| *w != "expires")
        .nth(1)
        .unwrap_or_else(|| panic!("no expiry in {line:?}"));
    humantime::parse_rfc3339(t).unwrap_or_else(|e| panic!("expiry {t:?}: {e}"))
}

/// The fencing token on a line of the client's output.
fn token(line: &str) -> u64 {
    line.split_whitespace()
        .skip_while(|w| *w != "token")
        .nth(1)
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no token in {line:?}"))
}

/// Issue 13: "a short Python client (grpcio) that claims, renews and releases; a test runs
/// that Python client against the real coordinator."
#[tokio::test(flavor = "multi_thread")]
async fn python_client_claims_renews_and_releases_against_the_real_coordinator() {
    require_grpcio();
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.claimable_task("fix-login").await;
    let mut events = Events::watch(&api).await;

    let mut c = python();
    c.arg(client_file())
        .args([&coord.addr.to_string(), "fix-login", "agent-a"])
        .env_remove("AUTOMATON_TOKEN")
        .env_remove("AUTOMATON_PROTO");
    let run = run_bounded(c, Duration::from_secs(60));
    run.ok();
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(lines.len(), 3, "claimed, renewed, released: {run:?}");
    let [claimed, renewed, released] = [lines[0], lines[1], lines[2]];
    assert!(claimed.starts_with("claimed fix-login lease "), "{claimed}");
    assert!(renewed.starts_with("renewed fix-login lease "), "{renewed}");
    assert!(
        released.starts_with("released fix-login lease "),
        "{released}"
    );
    assert!(claimed.contains(" ttl 30s "), "the TTL sent: {claimed}");
    let t = token(claimed);
    assert_eq!((token(renewed), token(released)), (t, t), "{run:?}");
    // The client waits 1.5 s between claim and renew: the renewal moved the expiry on.
    let moved = expires(renewed)
        .duration_since(expires(claimed))
        .unwrap_or_default();
    assert!(
        moved >= Duration::from_secs(1),
        "renew did not extend: {run:?}"
    );

    // The coordinator's view agrees: it granted, renewed and released that very lease.
    for kind in ["lease_granted", "lease_renewed", "lease_released"] {
        let e = events.expect(kind, "fix-login").await;
        assert_eq!((e.agent.as_str(), e.token), ("agent-a", t), "{kind}: {e:?}");
    }
    // Released: the task is free, and another agent gets it at once.
    assert!(api.lease_of("fix-login").await.is_none(), "still leased");
    let next = api
        .claim("fix-login", "agent-b", 0)
        .await
        .expect("the task is free after the release");
    assert!(next.token > t, "{next:?}");
}

/// A refusal reaches the Python client as one line with the code and the error kind.
#[tokio::test(flavor = "multi_thread")]
async fn python_client_reports_a_refusal_in_one_line() {
    require_grpcio();
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut c = python();
    c.arg(client_file())
        .args([&coord.addr.to_string(), "no-such-task", "agent-a"]);
    let run = run_bounded(c, Duration::from_secs(60));
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr
            .starts_with("ERROR: NOT_FOUND (notfound): Task 'no-such-task' not found"),
        "{run:?}"
    );
    assert_eq!(run.stderr.trim_end().lines().count(), 1, "{run:?}");
}

/// Issue 13: "`docs/api.md` shows … a short Python client": the file, verbatim.
#[test]
fn docs_api_md_contains_the_python_client_verbatim() {
    let doc = std::fs::read_to_string(repo().join("docs/api.md")).expect("docs/api.md");
    let client = std::fs::read_to_string(client_file()).expect("the client");
    assert!(
        doc.contains(&format!("```python\n{client}```\n")),
        "docs/api.md must include docs/api/automaton_client.py verbatim in a ```python block"
    );
}

/// Issue 13: "Validate incoming durations: negative, nanos out of range, or overflow →
/// INVALID_ARGUMENT with a one-line message"; zero is below the shortest TTL; unset is the
/// project's default. A refused claim changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn claim_ttl_negative_malformed_huge_or_zero_is_invalid_argument_and_unset_is_the_default() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.claimable_task("t").await;
    let before = env.snapshot();
    let d = |seconds, nanos| prost_types::Duration { seconds, nanos };
    for (ttl, says) in [
        (d(-1, 0), "ttl is negative"),
        (d(0, -1), "ttl is negative"),
        (d(i64::MIN, 0), "ttl is negative"),
        (
            d(1, 1_000_000_000),
            "ttl.nanos is 1000000000, outside 0..999999999",
        ),
        (d(0, i32::MAX), "outside 0..999999999"),
        (d(i64::MAX, 999_999_999), "outside the allowed 1s to 7days"),
        (
            d(u32::MAX as i64 * 1000, 0),
            "outside the allowed 1s to 7days",
        ),
        (d(0, 0), "outside the allowed 1s to 7days"),
    ] {
        let req = api.req(pb::ClaimRequest {
            task: "t".into(),
            agent: "agent-a".into(),
            ttl: Some(ttl),
            ..Default::default()
        });
        expect_err(
            api.leases.claim(req).await.map(|r| r.into_inner()),
            Code::InvalidArgument,
            says,
            Some("invalid"),
        );
    }
    assert!(before == env.snapshot(), "a refused claim changed files");
    assert!(api.lease_of("t").await.is_none(), "a refused claim granted");
    let l = api.claim("t", "agent-a", 0).await.expect("unset TTL");
    assert_eq!(
        ms(&l.ttl),
        30 * 60 * 1000,
        "the default lock timeout: {l:?}"
    );
    let expires = SystemTime::try_from(l.expires_at.expect("expires_at")).expect("a time");
    let claimed = SystemTime::try_from(l.claimed_at.expect("claimed_at")).expect("a time");
    assert!(expires > claimed + Duration::from_secs(29 * 60), "{l:?}");
}

/// Issue 13: "every field documented in the proto" — every service, method, message and
/// field of `automaton.v1` carries its own comment (read from the descriptor set the
/// coordinator serves by reflection).
#[test]
fn every_service_method_message_and_field_of_the_proto_is_documented() {
    let set = prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET).expect("decode");
    let file = set
        .file
        .iter()
        .find(|f| f.package() == "automaton.v1")
        .expect("automaton.v1");
    let info = file.source_code_info.as_ref().expect("source info");
    let documented = |path: &[i32]| {
        info.location.iter().any(|l| {
            l.path == path
                && (!l.leading_comments().trim().is_empty()
                    || !l.trailing_comments().trim().is_empty())
        })
    };
    let mut missing = Vec::new();
    fn walk(
        m: &prost_types::DescriptorProto,
        path: Vec<i32>,
        name: String,
        documented: &dyn Fn(&[i32]) -> bool,
        missing: &mut Vec<String>,
    ) {
        if !documented(&path) {
            missing.push(name.clone());
        }
        for (j, f) in m.field.iter().enumerate() {
            let p = [path.clone(), vec![2, j as i32]].concat();
            if !documented(&p) {
                missing.push(format!("{name}.{}", f.name()));
            }
        }
        for (j, n) in m.nested_type.iter().enumerate() {
            let p = [path.clone(), vec![3, j as i32]].concat();
            walk(n, p, format!("{name}.{}", n.name()), documented, missing);
        }
    }
    for (i, m) in file.message_type.iter().enumerate() {
        walk(
            m,
            vec![4, i as i32],
            m.name().to_string(),
            &documented,
            &mut missing,
        );
    }
    for (i, s) in file.service.iter().enumerate() {
        if !documented(&[6, i as i32]) {
            missing.push(s.name().to_string());
        }
        for (j, r) in s.method.iter().enumerate() {
            if !documented(&[6, i as i32, 2, j as i32]) {
                missing.push(format!("{}.{}", s.name(), r.name()));
            }
        }
    }
    assert!(missing.is_empty(), "undocumented in the proto: {missing:?}");
    // No JSON tunnelled in strings, no `_ms` durations, no times as strings.
    for m in &file.message_type {
        for f in &m.field {
            let n = f.name();
            assert!(
                !n.ends_with("_json") && !n.ends_with("_ms"),
                "{}.{n}: use typed messages and google.protobuf.Duration",
                m.name()
            );
            if n.ends_with("_at") || n == "since" || n == "at" {
                assert_eq!(
                    f.type_name(),
                    ".google.protobuf.Timestamp",
                    "{}.{n} is a time",
                    m.name()
                );
            }
        }
    }
}

/// `grpcurl describe` resolves the well-known types through reflection: they are served
/// with our descriptors.
#[tokio::test(flavor = "multi_thread")]
async fn reflection_serves_the_well_known_types_grpcurl_needs() {
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut refl = ServerReflectionClient::new(coord.channel().await);
    for name in [
        "google/protobuf/timestamp.proto",
        "google/protobuf/duration.proto",
    ] {
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileByFilename(name.into())),
        };
        let mut stream = refl
            .server_reflection_info(tokio_stream::iter(vec![req]))
            .await
            .expect("reflection")
            .into_inner();
        let msg = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("reflection answers")
            .expect("ok")
            .expect("one response");
        let Some(MessageResponse::FileDescriptorResponse(files)) = msg.message_response else {
            panic!("{name} not served: {msg:?}");
        };
        assert!(!files.file_descriptor_proto.is_empty(), "{name}");
    }
}

/// Issue 13: "The CLI … must print byte-for-byte what it prints today when it forwards to a
/// coordinator": the typed answers carry everything the files show — an approval record,
/// out-of-order artifacts, a task that is not one (an unaddressable folder), the audit's
/// categories with git — in text and JSON.
#[tokio::test(flavor = "multi_thread")]
async fn forwarded_status_prints_what_the_files_print_from_the_typed_answers() {
    let env = Env::new();
    crate::work::git_init(&env);
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.approved_research(&env, "alpha", None).await;
    api.create("alpha/sub-one").await.expect("create");
    api.claimable_task("gamma").await;
    env.artifact("gamma", "IMPLEMENTATION.md", "too early\n");
    env.artifact("gamma", "DESIGN.md", "");
    std::fs::create_dir_all(env.root().join(".automaton/tasks/Bad Folder")).expect("mkdir");
    for args in [
        &["--task", "alpha"][..],
        &["--task", "alpha", "--json"],
        &["--task", "alpha/sub-one", "--json"],
        &["--task", "gamma"],
        &["--task", "gamma", "--json"],
        &["--list", "--json"],
        &["--task", "gamma", "--validate-folder"],
        &["--task", "gamma", "--validate-folder", "--json"],
        &["--validate-folder"],
        &["--validate-folder", "--json"],
        &["--audit"],
        &["--audit", "--json"],
    ] {
        same_as_local(&env, args);
    }
    let audit = env.cli(&["--audit", "--json"]);
    assert!(
        audit.stdout.contains("\"status\": \"checked\""),
        "the audit checked git: {}",
        audit.stdout
    );
    let view = env.cli(&["--task", "alpha", "--json"]);
    assert!(
        view.stdout.contains("\"approver\"") && view.stdout.contains("\"sha256\""),
        "the approval record: {}",
        view.stdout
    );
}
