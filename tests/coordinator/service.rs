//! The service as a whole: separation of duties, roles, health, reflection, bad input and
//! configuration.

use std::path::Path;
use std::time::Duration;

use automaton_proto::v1 as pb;
use sha2::Digest;
use tonic::Code;

use crate::harness::{
    AGENT_B_TOKEN, AGENT_TOKEN, Coord, Env, OPERATOR_TOKEN, TOKENS_TOML, bearer, connect,
    expect_err, lock_view,
};

/// Issue §Semantics "Separation of duties … reviewer ≠ implementer on claim and on approve,
/// enforced here atomically at claim time" and "An agent can never approve"; §Tests
/// "reviewer ≠ implementer over gRPC; an agent token cannot approve".
#[tokio::test(flavor = "multi_thread")]
async fn reviewer_is_not_implementer_and_agent_token_cannot_approve() {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &[]);
    let mut op = coord.api_as(OPERATOR_TOKEN).await;
    let mut agent = coord.api_as(AGENT_TOKEN).await;
    op.approved_research(&env, "sod", Some("implement")).await;
    assert_eq!(op.state("sod").await, "implement");

    // A implements under its lease and hands over to code review; the lease ends.
    let a = agent
        .claim("sod", "agent-a", 60_000)
        .await
        .expect("A claims implement");
    assert_eq!(a.state, "implement");
    // The implementer is known at once (from the lease log) ...
    assert_eq!(
        agent.get("sod").await.expect("get").implementers,
        vec!["agent-a".to_string()]
    );
    env.artifact("sod", "IMPLEMENTATION.md", "# Implementation\ndone\n");
    let t = agent
        .transition_under("sod", "code_review", &a)
        .await
        .expect("A moves to code_review under its lease");
    // ... and in seed 001's file once the task moves on.
    assert_eq!(
        env.task_file("sod", ".state.implementer").as_deref(),
        Some(&b"agent-a\n"[..])
    );
    assert_eq!(t.released.expect("lease ended").token, a.token);
    assert!(agent.lease_of("sod").await.is_none());
    assert_eq!(
        agent.get("sod").await.expect("get").implementers,
        vec!["agent-a".to_string()]
    );

    // A may not review its own work.
    lock_view(&env, "sod", None).await;
    let before = env.snapshot();
    expect_err(
        agent.claim("sod", "agent-a", 60_000).await,
        Code::FailedPrecondition,
        "reviewer ≠ implementer",
        Some("refused"),
    );
    assert!(before == env.snapshot(), "a refused claim changed files");
    assert!(agent.lease_of("sod").await.is_none());

    // B may (with its own token: a token is bound to its agent).
    let mut agent_b = coord.api_as(AGENT_B_TOKEN).await;
    let b = agent_b
        .claim("sod", "agent-b", 60_000)
        .await
        .expect("B claims code_review");
    assert_eq!(b.state, "code_review");
    assert!(b.token > a.token);
    let review = "# Code review\nlooks right\n";
    env.artifact("sod", "CODE_REVIEW.md", review);
    agent_b
        .transition_under("sod", "code_review:awaiting_approval", &b)
        .await
        .expect("B asks for approval");

    // An agent token can never approve.
    lock_view(&env, "sod", None).await;
    let before = env.snapshot();
    expect_err(
        agent.approve("sod", "").await,
        Code::PermissionDenied,
        "needs an operator token",
        None,
    );
    expect_err(
        agent.approve("sod", "agent-b").await,
        Code::PermissionDenied,
        "needs an operator token",
        None,
    );
    // The implementer is never the approver, even through an operator's token.
    expect_err(
        op.approve("sod", "agent-a").await,
        Code::FailedPrecondition,
        "reviewer ≠ implementer",
        Some("refused"),
    );
    assert!(before == env.snapshot(), "refused approvals changed files");
    assert_eq!(op.state("sod").await, "code_review:awaiting_approval");

    // An operator approves, as itself by default; the approval binds the artifact's hash.
    let ok = op.approve("sod", "").await.expect("operator approves");
    assert_eq!(
        (ok.from.as_str(), ok.to.as_str(), ok.approver.as_str()),
        (
            "code_review:awaiting_approval",
            "code_review:approved",
            "ops"
        )
    );
    let sha = format!("{:x}", sha2::Sha256::digest(review.as_bytes()));
    assert_eq!(ok.sha256, sha);
    let log =
        String::from_utf8(env.task_file("sod", ".state.approvals").expect("log")).expect("utf8");
    assert!(
        log.lines().any(|l| l.starts_with("code_review:approved|")
            && l.contains("|ops|")
            && l.ends_with(&sha)),
        "{log}"
    );
}

/// Issue §API "the standard grpc.health.v1 service and server reflection"; §Tests "health
/// reports SERVING; reflection lists every service".
#[tokio::test(flavor = "multi_thread")]
async fn health_serving_and_reflection_lists_every_service() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    // With tokens configured: health and reflection stay open to probes and tools.
    let coord = Coord::start(&Env::with_config(TOKENS_TOML), &[]);
    let ch = connect(&coord.url).await;
    let mut health = HealthClient::new(ch.clone());
    for service in [
        "",
        "automaton.v1.Leases",
        "automaton.v1.Tasks",
        "automaton.v1.Events",
    ] {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|s| panic!("health check {service:?}: {s:?}"))
            .into_inner();
        assert_eq!(
            r.status,
            ServingStatus::Serving as i32,
            "service {service:?}"
        );
    }
    expect_err(
        health
            .check(HealthCheckRequest {
                service: "automaton.v1.Nope".into(),
            })
            .await,
        Code::NotFound,
        "",
        None,
    );

    let names = crate::harness::reflected_services!(v1, ch);
    for want in [
        "automaton.v1.Tasks",
        "automaton.v1.Leases",
        "automaton.v1.Events",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
}

/// Issue §Semantics "Who may do what … No token → UNAUTHENTICATED; wrong role →
/// PERMISSION_DENIED … it says which mode it is in at start".
#[tokio::test(flavor = "multi_thread")]
async fn auth_no_token_unauthenticated_wrong_role_permission_denied() {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &[]);
    assert!(
        coord.wait_stderr(
            "bearer tokens (1 operator, 2 agent, 2 worker)",
            Duration::from_secs(5)
        ),
        "the mode line names the protection:\n{}",
        coord.stderr()
    );
    let mut op = coord.api_as(OPERATOR_TOKEN).await;
    op.claimable_task("guarded").await;
    let before = env.snapshot();

    // No token, or an unknown one: UNAUTHENTICATED, on every service.
    let mut anon = coord.api().await;
    expect_err(
        anon.get("guarded").await,
        Code::Unauthenticated,
        "no bearer token",
        None,
    );
    expect_err(
        anon.list().await,
        Code::Unauthenticated,
        "no bearer token",
        None,
    );
    expect_err(
        anon.claim("guarded", "agent-x", 1000).await,
        Code::Unauthenticated,
        "no bearer token",
        None,
    );
    expect_err(anon.create("other").await, Code::Unauthenticated, "", None);
    expect_err(
        anon.events.watch_events(pb::WatchEventsRequest {}).await,
        Code::Unauthenticated,
        "",
        None,
    );
    let mut wrong = coord.api_as("not-a-token-at-all-0000").await;
    expect_err(
        wrong.get("guarded").await,
        Code::Unauthenticated,
        "unknown bearer token",
        None,
    );
    expect_err(
        wrong.approve("guarded", "").await,
        Code::Unauthenticated,
        "unknown bearer token",
        None,
    );
    // "Bearer" is required, not just the secret.
    let mut raw = anon.tasks.clone();
    let mut r = tonic::Request::new(pb::GetTaskRequest {
        task: "guarded".into(),
        with_contents: false,
        with_changes: false,
    });
    r.metadata_mut()
        .insert("authorization", OPERATOR_TOKEN.parse().expect("value"));
    expect_err(raw.get_task(r).await, Code::Unauthenticated, "", None);

    // An agent: reads, claims; but no create, no approve, no lease-less transition.
    let mut agent = coord.api_as(AGENT_TOKEN).await;
    agent.get("guarded").await.expect("an agent reads");
    expect_err(
        agent.create("made-by-agent").await,
        Code::PermissionDenied,
        "needs an operator token",
        None,
    );
    expect_err(
        agent.approve("guarded", "").await,
        Code::PermissionDenied,
        "needs an operator token",
        None,
    );
    expect_err(
        agent
            .transition("guarded", "research:awaiting_approval")
            .await,
        Code::PermissionDenied,
        "transitions only under its lease",
        None,
    );
    assert!(before == env.snapshot(), "refused calls changed files");
    let l = agent
        .claim("guarded", "agent-a", 60_000)
        .await
        .expect("an agent claims");
    agent.renew(&l.lease_id, l.token).await.expect("renews");
    agent.release(&l.lease_id, l.token).await.expect("releases");
    // The operator may do everything.
    op.create("made-by-op").await.expect("operator creates");
}

/// Issue §Semantics "Without any token configured it serves loopback only: asked to listen on
/// another address without tokens, it refuses to start unless --insecure is given, and it
/// says which mode it is in at start".
#[tokio::test(flavor = "multi_thread")]
async fn without_tokens_non_loopback_needs_insecure_and_mode_is_logged() {
    let env = Env::new();
    let run = env.run_coordinator(&["--listen", "0.0.0.0:0"], &[], Duration::from_secs(20));
    assert_ne!(run.code, 0, "must refuse: {run:?}");
    assert!(
        run.stderr
            .contains("refusing to listen on 0.0.0.0:0 without authentication"),
        "{run:?}"
    );
    assert!(run.stderr.contains("--insecure"), "{run:?}");
    assert!(!run.stdout.contains("listening on"), "{run:?}");
    assert!(
        !env.root().join(".automaton/coordinator.lock").exists(),
        "a refused start must not take the project"
    );

    let coord = Coord::start(&env, &["--listen", "0.0.0.0:0", "--insecure"]);
    assert!(coord.printed.starts_with("0.0.0.0:"), "{}", coord.printed);
    assert!(
        coord.wait_stderr("INSECURE", Duration::from_secs(5)),
        "an insecure start says so:\n{}",
        coord.stderr()
    );
    // It serves (reached over loopback).
    let mut api = coord.api().await;
    api.create("open").await.expect("serves without tokens");
    drop(coord);

    let coord = Coord::start(&env, &[]);
    assert!(
        coord.wait_stderr("loopback only, no authentication", Duration::from_secs(5)),
        "the default mode is stated:\n{}",
        coord.stderr()
    );
    assert!(!coord.stderr().contains("INSECURE"));
}

/// Issue §Semantics "Bad input. Invalid names, unknown tasks, illegal transitions →
/// INVALID_ARGUMENT / NOT_FOUND / FAILED_PRECONDITION with the same one-line messages as the
/// CLI; oversized messages → RESOURCE_EXHAUSTED; all of it leaves the files untouched".
#[tokio::test(flavor = "multi_thread")]
async fn bad_input_gets_its_code_the_cli_message_and_changes_nothing() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.create("fresh").await.expect("create");
    api.claimable_task("held").await;
    let held = api.claim("held", "agent-a", 60_000).await.expect("claim");
    lock_view(&env, "held", Some(held.token)).await;
    let before = env.snapshot();
    let unchanged = |what: &str| {
        assert!(
            before == env.snapshot(),
            "{what} changed the project's files"
        );
    };

    // Invalid names.
    for bad in ["Bad_Name", "", "a/b/c", "-lead", "UPPER"] {
        expect_err(
            api.get(bad).await,
            Code::InvalidArgument,
            "",
            Some("invalid"),
        );
        expect_err(
            api.create(bad).await,
            Code::InvalidArgument,
            "",
            Some("invalid"),
        );
        expect_err(
            api.claim(bad, "agent-a", 1000).await,
            Code::InvalidArgument,
            "",
            Some("invalid"),
        );
        unchanged(&format!("task name {bad:?}"));
    }
    expect_err(
        api.claim("fresh", "Not An Agent!", 1000).await,
        Code::InvalidArgument,
        "",
        Some("invalid"),
    );
    expect_err(
        api.transition("fresh", "no-such-phase").await,
        Code::InvalidArgument,
        "Unknown phase 'no-such-phase'",
        Some("invalid"),
    );
    expect_err(
        api.transition_as("held", "research:awaiting_approval", "Bad Agent", "x", 1)
            .await,
        Code::InvalidArgument,
        "",
        Some("invalid"),
    );
    unchanged("invalid agents and phases");

    // The same one-line message as the CLI for an invalid name.
    let s = expect_err(api.get("Bad_Name").await, Code::InvalidArgument, "", None);
    let cli = env.cli(&["--task", "Bad_Name", "--local"]);
    assert_eq!(cli.code, 2, "{cli:?}");
    assert_eq!(cli.error_line(), format!("ERROR: {}", s.message()));

    // Unknown tasks.
    let s = expect_err(
        api.get("no-such-task").await,
        Code::NotFound,
        "not found",
        Some("notfound"),
    );
    let cli = env.cli(&["--task", "no-such-task", "--local"]);
    assert_eq!(cli.error_line(), format!("ERROR: {}", s.message()));
    assert_eq!(cli.code, 2);
    expect_err(
        api.transition("no-such-task", "research").await,
        Code::NotFound,
        "not found",
        Some("notfound"),
    );
    expect_err(
        api.claim("no-such-task", "agent-a", 1000).await,
        Code::NotFound,
        "not found",
        Some("notfound"),
    );
    expect_err(
        api.approve("no-such-task", "").await,
        Code::NotFound,
        "not found",
        Some("notfound"),
    );
    expect_err(
        api.renew("no-such-lease", 0).await,
        Code::NotFound,
        "No live lease",
        Some("notfound"),
    );
    unchanged("unknown tasks");

    // Illegal transitions: the CLI's one line, verbatim, as the file mode prints it (a twin
    // project without a coordinator) and as the CLI prints it forwarded.
    let twin = Env::new();
    twin.cli(&["--create-task", "fresh"]).ok();
    let refusals: [(&[&str], _); 5] = [
        (&["--transition", "implement"], "implement"),
        (&["--transition", "complete"], "complete"),
        (&["--transition", "research:approved"], "research:approved"),
        (
            &["--transition", "research:awaiting_approval"],
            "research:awaiting_approval",
        ),
        (&["--approve"], ""),
    ];
    for (flags, target) in refusals {
        let s = if flags[0] == "--approve" {
            api.approve("fresh", "").await
        } else {
            api.transition("fresh", target)
                .await
                .map(|_| Default::default())
        };
        let s = expect_err(s, Code::FailedPrecondition, "", Some("refused"));
        let mut args = vec!["--task", "fresh"];
        args.extend_from_slice(flags);
        let file_mode = twin.cli(&args);
        assert_eq!(file_mode.code, 1, "{file_mode:?}");
        assert_eq!(
            file_mode.error_line(),
            format!("ERROR: {}", s.message()),
            "{flags:?}"
        );
        let forwarded = env.cli(&args);
        assert_eq!(
            (forwarded.code, forwarded.error_line()),
            (1, file_mode.error_line()),
            "{flags:?}"
        );
        unchanged(&format!("{flags:?}"));
    }
    // Under someone else's lease, a lease-less transition is refused.
    expect_err(
        api.transition("held", "research:awaiting_approval").await,
        Code::FailedPrecondition,
        "is leased to agent-a",
        Some("refused"),
    );
    unchanged("refused transitions and approvals");

    // Oversized message (default limit 4 MiB).
    let huge = "a".repeat(5 * 1024 * 1024);
    let s = expect_err(api.create(&huge).await, Code::ResourceExhausted, "", None);
    assert!(!s.message().is_empty());
    expect_err(
        api.claim("held", &huge, 1000).await,
        Code::ResourceExhausted,
        "",
        None,
    );
    unchanged("oversized messages");

    // The service is still fine afterwards.
    assert_eq!(api.state("fresh").await, "new");
    assert_eq!(api.lease_of("held").await.expect("lease").agent, "agent-a");
}

/// Issue §Semantics "Config. A TOML file, AUTOMATON_* environment variables and flags, in that
/// order of precedence; unknown keys are an error; --print-config shows the effective config".
#[test]
fn config_precedence_unknown_keys_and_masked_tokens() {
    let toml = format!("grace_period = \"45s\"\nmax_in_flight = 77\n{TOKENS_TOML}");
    let env = Env::with_config(&toml);
    let t = Duration::from_secs(20);

    let file = env.run_coordinator(&["--print-config"], &[], t);
    assert_eq!(file.code, 0, "{file:?}");
    let v: toml::Value = toml::from_str(&file.stdout).expect("--print-config prints TOML");
    assert_eq!(v["grace_period"].as_str(), Some("45s"), "{}", file.stdout);
    assert_eq!(v["max_in_flight"].as_integer(), Some(77));
    assert_eq!(
        v["listen"].as_str(),
        Some("127.0.0.1:0"),
        "the flag wins over the default"
    );
    assert_eq!(
        v["project"]
            .as_str()
            .map(std::path::PathBuf::from)
            .as_deref(),
        Some(env.root())
    );
    // Tokens are shown, masked.
    let tokens = v["tokens"].as_array().expect("tokens");
    assert_eq!(tokens.len(), 5);
    for t in tokens {
        assert_eq!(t["token"].as_str(), Some("********"));
    }
    assert_eq!(tokens[0]["name"].as_str(), Some("ops"));
    assert!(!file.stdout.contains(OPERATOR_TOKEN) && !file.stdout.contains(AGENT_TOKEN));
    assert!(
        !file.stdout.contains("listening on"),
        "--print-config does not serve"
    );

    // Environment over file.
    let envd = env.run_coordinator(&["--print-config"], &[("AUTOMATON_GRACE_PERIOD", "50s")], t);
    assert_eq!(envd.code, 0, "{envd:?}");
    let v: toml::Value = toml::from_str(&envd.stdout).expect("TOML");
    assert_eq!(v["grace_period"].as_str(), Some("50s"));
    assert_eq!(
        v["max_in_flight"].as_integer(),
        Some(77),
        "untouched keys keep the file's value"
    );

    // Flag over environment.
    let flag = env.run_coordinator(
        &["--print-config", "--grace-period", "55s"],
        &[("AUTOMATON_GRACE_PERIOD", "50s")],
        t,
    );
    assert_eq!(flag.code, 0, "{flag:?}");
    let v: toml::Value = toml::from_str(&flag.stdout).expect("TOML");
    assert_eq!(v["grace_period"].as_str(), Some("55s"));

    // An environment token is masked too.
    let with_env_token = env.run_coordinator(
        &["--print-config"],
        &[("AUTOMATON_AGENT_TOKEN", "env-agent-secret-0123456789")],
        t,
    );
    assert_eq!(with_env_token.code, 0);
    assert!(
        !with_env_token.stdout.contains("env-agent-secret"),
        "{with_env_token:?}"
    );

    // Unknown keys: refused, naming the key; nothing starts.
    let bad = Env::with_config("grace_period = \"1s\"\nlisten_port = 7070\n");
    let run = bad.run_coordinator(&[], &[], t);
    assert_ne!(run.code, 0, "{run:?}");
    assert!(
        run.stderr.contains("listen_port"),
        "the unknown key is named: {run:?}"
    );
    assert!(!run.stdout.contains("listening on"));
    let run = bad.run_coordinator(&["--print-config"], &[], t);
    assert_ne!(run.code, 0, "--print-config refuses it as well: {run:?}");
    assert!(run.stderr.contains("listen_port"), "{run:?}");
    let nested = Env::with_config(
        "[[tokens]]\nname = \"x\"\nrole = \"operator\"\ntoken = \"0123456789abcdef0\"\nscope = \"all\"\n",
    );
    let run = nested.run_coordinator(&["--print-config"], &[], t);
    assert_ne!(run.code, 0, "{run:?}");
    assert!(run.stderr.contains("scope"), "{run:?}");
}

/// The `bearer` helper is what the CLI sends too: AUTOMATON_TOKEN.
#[tokio::test(flavor = "multi_thread")]
async fn cli_sends_automaton_token() {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &[]);
    let mut op = coord.api_as(OPERATOR_TOKEN).await;
    op.create("tok").await.expect("create");
    let denied = env.cli(&["--task", "tok"]);
    assert_eq!(denied.code, 2, "no token: {denied:?}");
    assert!(
        denied.error_line().contains("no bearer token"),
        "{denied:?}"
    );
    let ok = env.cli_env(&["--task", "tok"], &[("AUTOMATON_TOKEN", AGENT_TOKEN)]);
    ok.ok();
    let refused = env.cli_env(
        &["--task", "tok", "--transition", "research"],
        &[("AUTOMATON_TOKEN", AGENT_TOKEN)],
    );
    assert_eq!(
        refused.code, 1,
        "an agent without a lease is refused: {refused:?}"
    );
    env.cli_env(
        &["--task", "tok", "--transition", "research"],
        &[("AUTOMATON_TOKEN", OPERATOR_TOKEN)],
    )
    .ok();
    let mut ch = pb::tasks_client::TasksClient::new(connect(&coord.url).await);
    let got = ch
        .get_task(bearer(
            pb::GetTaskRequest {
                task: "tok".into(),
                ..Default::default()
            },
            AGENT_TOKEN,
        ))
        .await
        .expect("get")
        .into_inner();
    assert_eq!(got.summary.expect("summary").state, "research");
}

/// Issue §"Who may do what": "TLS (rustls) when a certificate and key are configured".
/// The fixtures are a throw-away CA and a localhost certificate it signed.
#[tokio::test(flavor = "multi_thread")]
async fn tls_when_certificate_and_key_are_configured() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/coordinator/fixtures");
    let config = format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\n",
        fixtures.join("server.crt").display(),
        fixtures.join("server.key").display()
    );
    let coord = Coord::start(&Env::with_config(&config), &[]);
    assert!(
        coord.wait_stderr("TLS", Duration::from_secs(5)),
        "the mode line names TLS: {}",
        coord.stderr()
    );
    let ca = std::fs::read(fixtures.join("ca.crt")).expect("ca.crt");
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .domain_name("localhost");
    let url = format!("https://127.0.0.1:{}", coord.addr.port());
    let ch = Endpoint::from_shared(url)
        .expect("url")
        .tls_config(tls)
        .expect("tls config")
        .connect()
        .await
        .expect("TLS handshake with the coordinator");
    let mut api = crate::harness::Api::new(ch.clone(), None);
    api.create("over-tls").await.expect("create over TLS");
    assert!(api.get("over-tls").await.is_ok());
    let status = HealthClient::new(ch)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .expect("health over TLS")
        .into_inner()
        .status;
    assert_eq!(
        status,
        tonic_health::pb::health_check_response::ServingStatus::Serving as i32
    );
    // A plaintext client gets nowhere.
    let plain = Endpoint::from_shared(coord.url.clone())
        .expect("url")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2))
        .connect()
        .await;
    if let Ok(ch) = plain {
        assert!(
            HealthClient::new(ch)
                .check(HealthCheckRequest {
                    service: String::new()
                })
                .await
                .is_err(),
            "plaintext must not be served when TLS is configured"
        );
    }
}
