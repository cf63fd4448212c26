//! `automaton-worker doctor` (issue 21): the real binary runs one dry implement phase in a
//! scratch workspace under `--work-dir`, with small shell templates as the agent against the
//! OpenAI-compatible fake (`tests/common/model_server.rs`, which here also answers
//! `/v1/models` as vLLM does). A good setup passes every check and exits 0; each broken one
//! fails its own check, naming the fix, and exits 1.

use std::path::Path;
use std::process::Command;

use crate::model_server::{ModelServer, Reply, Seen, openai};
use crate::run::Run;

/// A secret in the agent's environment that must never be printed.
const SECRET: &str = "sk-doctor-secret-0123456789";

/// vLLM's `/v1/models` (the window the doctor reads), else the fake's chat completions.
fn vllm(req: &Seen) -> Reply {
    if req.method == "GET" && req.path == "/v1/models" {
        return Reply::Body(
            200,
            "application/json",
            r#"{"object":"list","data":[{"id":"m","object":"model","max_model_len":32768}]}"#
                .into(),
        );
    }
    openai(req)
}

/// A chat completion through `$URL` (a shell expression), output dropped.
fn curl(url: &str) -> String {
    format!(
        r#"curl -s -o /dev/null "{url}/chat/completions" -H 'content-type: application/json' -d '{{"model":"m","messages":[{{"role":"user","content":"hello"}}]}}'"#
    )
}

/// Writes the artifact where it belongs.
const ARTIFACT: &str = r#"printf '# Implementation\n\nsub added.\n' > {artifact}"#;
/// Changes the code in the workspace root.
const CODE: &str = r#"printf 'pub fn sub(a: i32, b: i32) -> i32 {\n    a - b\n}\n' >> src/lib.rs"#;

fn good_agent() -> String {
    format!("{}; {ARTIFACT}; {CODE}", curl("$OPENAI_BASE_URL"))
}

fn doctor(work: &Path, path: Option<&str>, args: &[&str]) -> Run {
    let mut c = Command::new(env!("CARGO_BIN_EXE_automaton-worker"));
    c.arg("doctor")
        .args(["--timeout", "30s", "--kill-grace", "1s", "--work-dir"])
        .arg(work)
        .args(args)
        .env("HOME", work)
        .env("OPENAI_API_KEY", SECRET);
    if let Some(p) = path {
        c.env("PATH", p);
    }
    let r: Run = c.output().expect("run automaton-worker doctor").into();
    assert!(
        !r.stdout.contains(SECRET) && !r.stderr.contains(SECRET),
        "a secret was printed:\n{}\n{}",
        r.stdout,
        r.stderr
    );
    r
}

/// `doctor --agent AGENT --model-server URL` in `work`, against `server`.
fn doctor_agent(work: &Path, server: &ModelServer, agent: &str) -> Run {
    doctor(
        work,
        None,
        &["--agent", agent, "--model-server", &server.url],
    )
}

/// The line of check `name`.
fn line<'a>(r: &'a Run, name: &str) -> &'a str {
    let prefix = |v: &str| format!("{v} {name}: ");
    r.stdout
        .lines()
        .find(|l| l.starts_with(&prefix("PASS")) || l.starts_with(&prefix("FAIL")))
        .unwrap_or_else(|| panic!("no {name} line:\n{}\n{}", r.stdout, r.stderr))
}

fn passes(r: &Run, name: &str) {
    let l = line(r, name);
    assert!(l.starts_with("PASS"), "{l}\n{}\n{}", r.stdout, r.stderr);
}

/// Check `name` fails, and its line says each of `says`, with a fix.
fn fails(r: &Run, name: &str, says: &[&str]) {
    let l = line(r, name);
    assert!(l.starts_with("FAIL") && l.contains(" — fix: "), "{l}");
    for s in says {
        assert!(l.contains(s), "{name}: no {s:?} in\n{l}");
    }
}

/// The scratch folders left under `work` (the doctor's own, not HOME's files).
fn scratch_left(work: &Path) -> Vec<String> {
    std::fs::read_dir(work)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("automaton-doctor-"))
        .collect()
}

#[test]
fn issue21_doctor_passes_on_a_good_setup_and_removes_its_scratch() {
    let server = ModelServer::start(vllm);
    let work = tempfile::tempdir().unwrap();
    let agent = good_agent();
    let r = doctor_agent(work.path(), &server, &agent);
    r.ok();
    assert_eq!(r.stdout.lines().count(), 5, "{}", r.stdout);
    for name in ["program", "model-server", "metering", "artifact", "code"] {
        passes(&r, name);
    }
    assert!(line(&r, "program").contains("curl"), "{}", r.stdout);
    assert!(line(&r, "model-server").contains("32768"), "{}", r.stdout);
    assert!(
        line(&r, "metering").contains("1 with usage"),
        "{}",
        r.stdout
    );
    assert!(line(&r, "code").contains("src/lib.rs"), "{}", r.stdout);
    // The request went through the proxy to the server, with its run's prefix taken off.
    assert!(
        server
            .seen()
            .iter()
            .any(|s| s.method == "POST" && s.path == "/v1/chat/completions"),
        "{:?}",
        server.seen()
    );
    assert!(scratch_left(work.path()).is_empty());

    // --keep keeps it, and says where.
    let r = doctor(
        work.path(),
        None,
        &["--agent", &agent, "--model-server", &server.url, "--keep"],
    );
    r.ok();
    let kept = scratch_left(work.path());
    assert_eq!(kept.len(), 1, "{kept:?}");
    assert!(r.stderr.contains(&kept[0]), "{}", r.stderr);
}

#[test]
fn issue21_doctor_names_a_missing_program_and_how_to_install_it() {
    let server = ModelServer::start(vllm);
    let work = tempfile::tempdir().unwrap();
    // A template: its first word after the assignments.
    let r = doctor(
        work.path(),
        None,
        &[
            "--agent",
            "FOO=1 no-such-agent-21 --message-file {prompt_file}",
            "--model-server",
            &server.url,
        ],
    );
    r.code(1);
    fails(
        &r,
        "program",
        &["no-such-agent-21 is not on PATH", "install"],
    );
    passes(&r, "model-server");
    // A later program of the template, which only the shell finds missing.
    let agent = format!("{ARTIFACT}; no-such-tool-21 --go");
    let r = doctor_agent(work.path(), &server, &agent);
    r.code(1);
    fails(&r, "program", &["command not found: no-such-tool-21"]);
    // A preset on a PATH without its program: the preset's install line.
    let bin = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink("/bin/sh", bin.path().join("sh")).unwrap();
    let path = bin.path().to_string_lossy().into_owned();
    let r = doctor(
        work.path(),
        Some(&path),
        &[
            "--agent",
            "claude-code",
            "--model",
            "m",
            "--model-server",
            &server.url,
        ],
    );
    r.code(1);
    fails(
        &r,
        "program",
        &[
            "claude is not on PATH",
            "npm install -g @anthropic-ai/claude-code",
        ],
    );
    assert!(scratch_left(work.path()).is_empty());
}

#[test]
fn issue21_doctor_says_the_model_server_is_down() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let work = tempfile::tempdir().unwrap();
    let agent = good_agent();
    let r = doctor(
        work.path(),
        None,
        &["--agent", &agent, "--model-server", &url],
    );
    r.code(1);
    fails(
        &r,
        "model-server",
        &["does not answer", "start the model server", &url],
    );
    fails(
        &r,
        "metering",
        &[
            "model server unreachable (1 of 1 requests failed",
            "start the model server",
        ],
    );
    passes(&r, "program");
    passes(&r, "artifact");
    passes(&r, "code");
}

#[test]
fn issue21_doctor_names_an_agent_that_bypasses_the_metering_proxy() {
    let server = ModelServer::start(vllm);
    let work = tempfile::tempdir().unwrap();
    // Straight to the server the worker was given, not the run's proxy.
    let agent = format!("{}; {ARTIFACT}; {CODE}", curl("$AUTOMATON_MODEL_SERVER/v1"));
    let r = doctor_agent(work.path(), &server, &agent);
    r.code(1);
    fails(
        &r,
        "metering",
        &[
            "no model request passed through the metering proxy",
            "$AUTOMATON_MODEL_URL",
        ],
    );
    // The agent did ask the model: past the proxy.
    assert!(
        server.seen().iter().any(|s| s.method == "POST"),
        "{:?}",
        server.seen()
    );
    for name in ["program", "model-server", "artifact", "code"] {
        passes(&r, name);
    }
}

#[test]
fn issue21_doctor_says_where_a_misplaced_artifact_was_written() {
    let server = ModelServer::start(vllm);
    let work = tempfile::tempdir().unwrap();
    let agent = format!(
        "{}; printf '# Implementation\\n' > IMPLEMENTATION.md; {CODE}",
        curl("$OPENAI_BASE_URL")
    );
    let r = doctor_agent(work.path(), &server, &agent);
    r.code(1);
    fails(
        &r,
        "artifact",
        &[
            "IMPLEMENTATION.md was written at the workspace root, not at .automaton-task/IMPLEMENTATION.md",
            "$AUTOMATON_ARTIFACT",
        ],
    );
    passes(&r, "metering");
}

#[test]
fn issue21_doctor_names_an_agent_that_changed_no_code() {
    let server = ModelServer::start(vllm);
    let work = tempfile::tempdir().unwrap();
    // The artifact, tool state, and the secret printed: nothing in the root's code.
    let agent = format!(
        "{}; {ARTIFACT}; echo chat > .aider.chat.history.md; echo \"key: $OPENAI_API_KEY\"",
        curl("$OPENAI_BASE_URL")
    );
    let r = doctor_agent(work.path(), &server, &agent);
    r.code(1);
    fails(
        &r,
        "code",
        &["implement changed no code (only tool state: .aider.chat.history.md)"],
    );
    assert!(r.stderr.contains("key: [redacted]"), "{}", r.stderr);
    for name in ["program", "model-server", "metering", "artifact"] {
        passes(&r, name);
    }
    // The code written under .automaton-task/, as aider without a root repository does.
    let agent = format!(
        "{}; {ARTIFACT}; mkdir -p .automaton-task/src; echo 'pub fn sub() {{}}' > .automaton-task/src/lib.rs",
        curl("$OPENAI_BASE_URL")
    );
    let r = doctor_agent(work.path(), &server, &agent);
    r.code(1);
    fails(
        &r,
        "code",
        &[
            "the agent wrote under .automaton-task/ instead: src/lib.rs",
            "workspace root",
        ],
    );
    assert!(scratch_left(work.path()).is_empty());
}

#[test]
fn issue21_doctor_stops_an_agent_at_its_timeout_and_still_removes_its_scratch() {
    let server = ModelServer::start(vllm);
    let work = tempfile::tempdir().unwrap();
    let agent = format!("{ARTIFACT}; sleep 60");
    let t = std::time::Instant::now();
    let r: Run = Command::new(env!("CARGO_BIN_EXE_automaton-worker"))
        .args([
            "doctor",
            "--timeout",
            "1s",
            "--kill-grace",
            "1s",
            "--agent",
            &agent,
        ])
        .args(["--model-server", &server.url, "--work-dir"])
        .arg(work.path())
        .env("HOME", work.path())
        .output()
        .unwrap()
        .into();
    r.code(1);
    assert!(
        t.elapsed() < std::time::Duration::from_secs(20),
        "{:?}",
        t.elapsed()
    );
    assert!(
        r.stderr.contains("no result after 1s (--timeout 1s)"),
        "{}",
        r.stderr
    );
    fails(
        &r,
        "metering",
        &["no model request passed through the metering proxy"],
    );
    passes(&r, "artifact");
    assert!(scratch_left(work.path()).is_empty());
}

#[test]
fn issue21_doctor_refuses_bad_usage_with_exit_2() {
    let work = tempfile::tempdir().unwrap();
    let r = doctor(work.path(), None, &["--agent", "aider"]);
    r.code(2);
    assert!(r.stderr.contains("give --model NAME"), "{}", r.stderr);
    let r = doctor(work.path(), None, &["--agent", " "]);
    r.code(2);
    assert!(r.stderr.contains("--agent is empty"), "{}", r.stderr);
    assert!(scratch_left(work.path()).is_empty());
}
