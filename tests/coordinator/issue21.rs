//! Issue 21: reviewers see the change — in the phases after implement, the workspace holds
//! `changes.diff` (the task branch against where it started) and the manifest names that
//! base commit; earlier phases get neither.

use std::collections::BTreeMap;
use std::time::Duration;

use automaton_proto::v1 as pb;
use pb::work_client::WorkClient;

use crate::harness::*;
use crate::waves::approve_all;
use crate::work::{FLEET, git, git_init, scripted_worker as worker};
use crate::workers::Worker;

/// The workspace served under `lease`: its manifest and each task file's bytes.
async fn workspace(
    work: &mut WorkClient<tonic::transport::Channel>,
    lease: &pb::Lease,
) -> (pb::WorkspaceManifest, BTreeMap<String, Vec<u8>>) {
    let mut stream = crate::work::fetch_workspace(work, lease).await;
    let mut manifest = None;
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    while let Some(chunk) = stream.message().await.expect("a chunk") {
        match chunk.part {
            Some(pb::workspace_chunk::Part::Manifest(m)) => {
                for f in &m.files {
                    if f.kind == "task" {
                        files.insert(f.path.clone(), Vec::new());
                    }
                }
                manifest = Some(m);
            }
            Some(pb::workspace_chunk::Part::Data(d)) if d.kind == "task" => {
                files.entry(d.path).or_default().extend(d.data);
            }
            _ => {}
        }
    }
    (manifest.expect("a manifest"), files)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_review_phases_get_changes_diff_and_the_base_commit() {
    let env = Env::new();
    git_init(&env);
    let base = git(&env, &["rev-parse", "HEAD"]).trim().to_string();
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // One worker: it implements, and may not review its own work, so code_review waits.
    let w = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    let approver = approve_all(&api);
    poll(
        "implement done, code_review waiting",
        Duration::from_secs(40),
        || {
            let mut api = api.clone();
            async move {
                let open = api.state("t").await == "code_review";
                (open && api.lease_of("t").await.is_none()).then_some(())
            }
        },
    )
    .await;
    approver.abort();
    let mut work = WorkClient::new(coord.channel().await);
    let lease = api
        .claim("t", "reviewer", 60_000)
        .await
        .expect("claim code_review");
    let (m, files) = workspace(&mut work, &lease).await;
    assert_eq!(m.base_commit, base, "{m:?}");
    let head = git(&env, &["rev-parse", "automaton/t"]).trim().to_string();
    assert_eq!(m.commit, head);
    assert_ne!(head, base, "implement committed the code");
    let diff = String::from_utf8(files.get("changes.diff").cloned().unwrap_or_default())
        .expect("UTF-8 diff");
    // The implement commit's change, as `git diff base head` shows it.
    assert!(diff.contains("+++ b/AUTOMATON_SCRIPTED.md"), "{diff}");
    let want = git(
        &env,
        &["diff", &base, &head, "--", ".", ":(exclude).automaton"],
    );
    let added = |d: &str| -> Vec<String> {
        d.lines()
            .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(added(&diff), added(&want), "{diff}\n---\n{want}");
    assert!(
        !diff.contains(".automaton/"),
        "the task store is no part of it: {diff}"
    );
    api.release(&lease.lease_id, lease.token)
        .await
        .expect("release");

    // Research is given neither (the worker gone, nobody else takes it).
    drop(w);
    api.create("u").await.expect("create");
    api.transition("u", "research").await.expect("research");
    let lease = poll("u claimable", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move { api.claim("u", "other", 60_000).await.ok() }
    })
    .await;
    let (m, files) = workspace(&mut work, &lease).await;
    assert_eq!(m.base_commit, "", "{m:?}");
    assert!(!files.contains_key("changes.diff"), "{files:?}");
}

/// Where `tests/setup` installs the agent CLIs: `target/agent-tools/{aider/bin,npm/node_modules/.bin}`.
fn agent_tools(sub: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/agent-tools")
        .join(sub)
}

/// `PATH` with `dir` first, after checking `program` is there (a missing agent is a failure
/// that says how to install it, never a skip).
fn path_with(dir: &std::path::Path, program: &str) -> String {
    assert!(
        dir.join(program).is_file(),
        "{program} is not installed at {}: run tests/setup (it installs the pinned agent CLIs)",
        dir.display()
    );
    format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// The body a scripted model writes for each artifact; the referee passes.
fn artifact_body(name: &str) -> String {
    match name {
        "VERDICT.md" => {
            "# Verdict\n\nVerdict: PASS\n\nEverything the spec asks for is there.\n".into()
        }
        "SPEC.md" => "# Spec\n\nAdd a function `added_by_agent` to src/lib.rs.\n".into(),
        other => format!("# {other}\n\nDone: the change adds `added_by_agent`.\n"),
    }
}

/// An OpenAI-compatible model server that answers aider in its whole-file format: the
/// artifact aider was given (the file "added to the chat" under `.automaton-task/`) written
/// whole, and in implement a change to `src/lib.rs`; with usage, so runs are metered.
fn aider_model(req: &crate::model_server::Seen) -> crate::model_server::Reply {
    use crate::model_server::Reply;
    // vLLM's model list, with the window the worker's probe (and the doctor) read.
    if req.method == "GET" && req.path == "/v1/models" {
        return Reply::Body(
            200,
            "application/json",
            r#"{"object":"list","data":[{"id":"test-model","object":"model","max_model_len":32768}]}"#.into(),
        );
    }
    if req.method != "POST" || !req.path.ends_with("/v1/chat/completions") {
        return Reply::Body(404, "application/json", r#"{"error":"not found"}"#.into());
    }
    let v = req.json();
    let text: String = v["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"].as_str())
        .filter(|c| c.contains("added these files to the chat"))
        .collect();
    let artifact = artifact_in(&text);
    let mut content = format!(
        ".automaton-task/{artifact}\n```\n{}```\n",
        artifact_body(&artifact)
    );
    if artifact == "IMPLEMENTATION.md" {
        content.push_str(&format!("\nsrc/lib.rs\n```\n{LIB}```\n"));
    }
    let (p, c) = crate::model_server::usage_for(&v);
    let body = serde_json::json!({
        "id": "chatcmpl-aider",
        "object": "chat.completion",
        "model": v["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
    });
    Reply::Body(200, "application/json", body.to_string())
}

/// Waits (bounded) for `task` to end; a hold fails at once, with the runs that led to it.
async fn ended_or_held(api: &mut Api, task: &str, timeout: Duration) -> String {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let d = api.get(task).await.expect("GetTask");
        let s = d.summary.clone().unwrap_or_default();
        if s.state == "complete" || s.state == "human_intervention" {
            return s.state;
        }
        assert!(
            s.held.is_empty(),
            "{task} held: {}; runs: {:#?}",
            s.held,
            d.runs
        );
        assert!(
            std::time::Instant::now() < deadline,
            "{task} is still {} after {timeout:?}; runs: {:#?}",
            s.state,
            d.runs
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One preset end to end: a real coordinator and two real workers running `preset` against
/// `model` take a task from `new` to `complete`; every artifact as the model wrote it, the
/// implement commit with the code and no tool state, every run metered, reviewer ≠
/// implementer.
async fn preset_end_to_end(preset: &str, path: &str, model: &crate::model_server::ModelServer) {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let args = |name: &'static str| {
        vec![
            "--name".to_string(),
            name.into(),
            "--simulate-gpu".into(),
            "sim:24GiB".into(),
            "--agent".into(),
            preset.into(),
            "--model".into(),
            "test-model".into(),
            "--model-server".into(),
            model.url.clone(),
            "--kill-grace".into(),
            "300ms".into(),
        ]
    };
    let (a_args, b_args) = (args("gpu-a"), args("gpu-b"));
    let a_args: Vec<&str> = a_args.iter().map(String::as_str).collect();
    let b_args: Vec<&str> = b_args.iter().map(String::as_str).collect();
    let envs = [("PATH", path)];
    let _a = Worker::start(&coord.url, &a_args, &envs);
    let _b = Worker::start(&coord.url, &b_args, &envs);
    api.create("t").await.expect("create");
    let approver = approve_all(&api);
    let end = ended_or_held(&mut api, "t", Duration::from_secs(240)).await;
    approver.abort();
    let d = api.get("t").await.expect("GetTask");
    assert_eq!(end, "complete", "{:#?}", d.runs);
    // Every phase's artifact, as the model wrote it.
    for a in [
        "SPEC.md",
        "IMPLEMENTATION.md",
        "CODE_REVIEW.md",
        "BUG_REPORT.md",
        "ADVERSARIAL_BUG_REPORT.md",
        "DOC_REVIEW.md",
        "VERDICT.md",
    ] {
        let body = String::from_utf8(env.task_file("t", a).unwrap_or_default()).unwrap_or_default();
        assert_eq!(body, artifact_body(a), "{a}");
    }
    // The implement commit holds the code, and no tool state.
    let files = git(&env, &["ls-tree", "-r", "--name-only", "automaton/t"]);
    assert!(files.lines().any(|f| f == "src/lib.rs"), "{files}");
    for f in files.lines() {
        assert!(
            !f.starts_with(".aider")
                && !f.starts_with(".claude")
                && !f.starts_with(".codex")
                && !f.starts_with(".automaton-task")
                && !f.starts_with(".git/"),
            "tool state on the branch: {f}\n{files}"
        );
    }
    let lib = git(&env, &["show", "automaton/t:src/lib.rs"]);
    assert!(lib.contains("pub fn added_by_agent()"), "{lib}");
    // Metered from the model server, and reviewed by the other worker.
    let done: Vec<&pb::Run> = d
        .runs
        .iter()
        .filter(|r| r.stop_reason == "completed")
        .collect();
    assert!(
        done.iter().all(|r| r.peak_context_tokens > 0),
        "every run metered: {done:#?}"
    );
    let by = |phase: &str| {
        done.iter()
            .rev()
            .find(|r| r.phase == phase)
            .map(|r| r.worker.clone())
            .unwrap_or_else(|| panic!("no {phase} run: {done:#?}"))
    };
    assert_ne!(by("implement"), by("code_review"), "reviewer ≠ implementer");
    assert!(!model.seen().is_empty());
}

/// The new content of `src/lib.rs` an implement writes.
const LIB: &str = "pub fn f() {}\n\npub fn added_by_agent() -> u32 {\n    42\n}\n";

/// The artifact a request is about: the first `.automaton-task/NAME.md` of an upper-case
/// name in `text`.
fn artifact_in(text: &str) -> String {
    text.split(".automaton-task/")
        .skip(1)
        .filter_map(|rest| {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '.')
                .collect();
            let name = name.trim_end_matches('.').to_string();
            (name.ends_with(".md") && name.chars().next().is_some_and(|c| c.is_ascii_uppercase()))
                .then_some(name)
        })
        .next()
        .unwrap_or_else(|| "NOTES.md".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_preset_aider_takes_a_task_from_new_to_complete() {
    let path = path_with(&agent_tools("aider/bin"), "aider");
    let model = crate::model_server::ModelServer::start(aider_model);
    preset_end_to_end("aider", &path, &model).await;
}

/// An Anthropic Messages server that answers Claude Code as a model would: a `Write` of the
/// artifact (absolute, under the working directory the system prompt names) — in implement
/// with a `Read` of `src/lib.rs`, and once that is answered a `Write` of it (Claude Code
/// writes an existing file only after reading it) — then the end of the turn. Claude Code
/// folds a turn's tool calls into one assistant message, so where the conversation stands is
/// read from the tool-call ids it holds. Streamed (SSE) when asked, with usage in
/// `message_start`/`message_delta`, as the metering proxy reads it.
fn anthropic_model(req: &crate::model_server::Seen) -> crate::model_server::Reply {
    use crate::model_server::Reply;
    if req.method != "POST" || !req.path.contains("/v1/messages") {
        return Reply::Body(404, "application/json", r#"{"error":"not found"}"#.into());
    }
    let v = req.json();
    let all = v.to_string();
    let messages = v["messages"].as_array().cloned().unwrap_or_default();
    let used: Vec<String> = messages
        .iter()
        .filter(|m| m["role"] == "assistant")
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|b| b["id"].as_str().map(str::to_string))
        .collect();
    let user_text: String = messages
        .iter()
        .filter(|m| m["role"] == "user")
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|b| b["text"].as_str().map(str::to_string))
        .collect();
    let wd = all
        .split("Primary working directory: ")
        .nth(1)
        .map(|r| r.split("\\n").next().unwrap_or("").to_string())
        .unwrap_or_default();
    let artifact = artifact_in(&user_text);
    let implement = artifact == "IMPLEMENTATION.md";
    let lib = format!("{wd}/src/lib.rs");
    let tool = |id: &str, name: &str, input: serde_json::Value| serde_json::json!({"type": "tool_use", "id": id, "name": name, "input": input});
    let mut blocks = Vec::new();
    let has = |id: &str| used.iter().any(|u| u == id);
    if !wd.is_empty() && !has("toolu_artifact") {
        blocks.push(tool(
            "toolu_artifact",
            "Write",
            serde_json::json!({"file_path": format!("{wd}/.automaton-task/{artifact}"), "content": artifact_body(&artifact)}),
        ));
        if implement {
            blocks.push(tool(
                "toolu_read",
                "Read",
                serde_json::json!({"file_path": lib}),
            ));
        }
    } else if !wd.is_empty() && implement && !has("toolu_lib") {
        blocks.push(tool(
            "toolu_lib",
            "Write",
            serde_json::json!({"file_path": lib, "content": LIB}),
        ));
    }
    if blocks.is_empty() {
        blocks.push(serde_json::json!({"type": "text", "text": "Done."}));
    }
    let stop = if blocks.iter().any(|b| b["type"] == "tool_use") {
        "tool_use"
    } else {
        "end_turn"
    };
    let input = (all.len() / 4) as u64;
    if v["stream"] != serde_json::Value::Bool(true) {
        let body = serde_json::json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": v["model"],
            "content": blocks, "stop_reason": stop, "stop_sequence": null,
            "usage": {"input_tokens": input, "output_tokens": 20},
        });
        return Reply::Body(200, "application/json", body.to_string());
    }
    let mut out = String::new();
    let mut event = |name: &str, data: serde_json::Value| {
        out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
    };
    event(
        "message_start",
        serde_json::json!({"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": v["model"], "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": input, "output_tokens": 1}}}),
    );
    for (i, b) in blocks.iter().enumerate() {
        if b["type"] == "text" {
            event(
                "content_block_start",
                serde_json::json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}),
            );
            event(
                "content_block_delta",
                serde_json::json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": b["text"]}}),
            );
        } else {
            event(
                "content_block_start",
                serde_json::json!({"type": "content_block_start", "index": i, "content_block": {"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}}),
            );
            event(
                "content_block_delta",
                serde_json::json!({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": b["input"].to_string()}}),
            );
        }
        event(
            "content_block_stop",
            serde_json::json!({"type": "content_block_stop", "index": i}),
        );
    }
    event(
        "message_delta",
        serde_json::json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": 20}}),
    );
    event("message_stop", serde_json::json!({"type": "message_stop"}));
    Reply::Body(200, "text/event-stream", out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_preset_claude_code_takes_a_task_from_new_to_complete() {
    let path = path_with(&agent_tools("npm/node_modules/.bin"), "claude");
    let model = crate::model_server::ModelServer::start(anthropic_model);
    preset_end_to_end("claude-code", &path, &model).await;
}

/// An OpenAI Responses server that answers Codex as a model would: one `exec_command` call
/// that writes the artifact (and in implement `src/lib.rs`) with heredocs, in the workspace
/// Codex runs it in; once its output is back, the final message. Streamed (SSE), with usage
/// in `response.completed`, as the metering proxy reads it.
fn responses_model(req: &crate::model_server::Seen) -> crate::model_server::Reply {
    use crate::model_server::Reply;
    if req.method != "POST" || !req.path.ends_with("/v1/responses") {
        return Reply::Body(404, "application/json", r#"{"error":"not found"}"#.into());
    }
    let v = req.json();
    let input = v["input"].as_array().cloned().unwrap_or_default();
    let answered = input.iter().any(|i| i["type"] == "function_call_output");
    let user_text: String = input
        .iter()
        .filter(|i| i["role"] == "user")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["text"].as_str().map(str::to_string))
        .collect();
    let artifact = artifact_in(&user_text);
    let item = if answered {
        serde_json::json!({"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Done.", "annotations": []}]})
    } else {
        let mut cmd = format!(
            "cat > .automaton-task/{artifact} <<'AUTOMATON_EOF'\n{}AUTOMATON_EOF\n",
            artifact_body(&artifact)
        );
        if artifact == "IMPLEMENTATION.md" {
            cmd.push_str(&format!(
                "cat > src/lib.rs <<'AUTOMATON_EOF'\n{LIB}AUTOMATON_EOF\n"
            ));
        }
        serde_json::json!({"type": "function_call", "id": "fc_1", "call_id": "call_1", "status": "completed",
            "name": "exec_command", "arguments": serde_json::json!({"cmd": cmd}).to_string()})
    };
    let tokens = (v.to_string().len() / 4) as u64;
    let mut out = String::new();
    let mut event = |data: serde_json::Value| {
        out.push_str(&format!(
            "event: {}\ndata: {data}\n\n",
            data["type"].as_str().unwrap_or("")
        ));
    };
    event(
        serde_json::json!({"type": "response.created", "response": {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}}),
    );
    event(
        serde_json::json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
    );
    event(
        serde_json::json!({"type": "response.completed", "response": {"id": "resp_1", "object": "response", "status": "completed", "output": [item],
        "usage": {"input_tokens": tokens, "output_tokens": 20, "total_tokens": tokens + 20,
            "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}}),
    );
    Reply::Body(200, "text/event-stream", out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_preset_codex_takes_a_task_from_new_to_complete() {
    let path = path_with(&agent_tools("npm/node_modules/.bin"), "codex");
    let model = crate::model_server::ModelServer::start(responses_model);
    preset_end_to_end("codex", &path, &model).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_patch_exclude_keeps_a_configured_path_off_the_branch() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // The scripted agent's only code change is AUTOMATON_SCRIPTED.md: excluded, nothing
    // reaches the branch, and the implement run says it changed no code.
    let _w = Worker::start(
        &coord.url,
        &[
            "--name",
            "gpu-a",
            "--simulate-gpu",
            "sim:24GiB",
            "--agent",
            "scripted",
            "--patch-exclude",
            "AUTOMATON_SCRIPTED*",
        ],
        &[],
    );
    api.create("t").await.expect("create");
    let approver = approve_all(&api);
    let d = poll("implement done", Duration::from_secs(40), || {
        let mut api = api.clone();
        async move {
            let d = api.get("t").await.ok()?;
            d.runs
                .iter()
                .any(|r| r.phase == "implement" && r.state == "stopped")
                .then_some(d)
        }
    })
    .await;
    approver.abort();
    let run = d
        .runs
        .iter()
        .find(|r| r.phase == "implement")
        .expect("the implement run");
    assert!(
        run.warnings
            .iter()
            .any(|w| w
                .contains("implement changed no code (only tool state: AUTOMATON_SCRIPTED.md)")),
        "{run:#?}"
    );
    let files = git(&env, &["ls-tree", "-r", "--name-only", "automaton/t"]);
    assert!(!files.contains("AUTOMATON_SCRIPTED.md"), "{files}");
    // A pattern that is no top-level name is refused at start, in one line.
    let mut bad = Worker::spawn(
        &coord.url,
        &["--agent", "scripted", "--patch-exclude", "src/x"],
        &[],
    );
    let status = wait_bounded(&mut bad.child, Duration::from_secs(20)).expect("exits");
    assert_eq!(status.code(), Some(2), "{}", bad.stderr());
    assert!(
        bad.wait_stderr("give a top-level name", Duration::from_secs(5)),
        "{}",
        bad.stderr()
    );
}

#[test]
fn issue21_doctor_passes_with_the_real_aider_preset() {
    let path = path_with(&agent_tools("aider/bin"), "aider");
    let model = crate::model_server::ModelServer::start(aider_model);
    let home = tempfile::tempdir().expect("home");
    let mut c = std::process::Command::new(worker_bin());
    c.args([
        "doctor",
        "--agent",
        "aider",
        "--model",
        "test-model",
        "--model-server",
        &model.url,
        "--timeout",
        "120s",
    ]);
    for k in SCRUBBED_ENV {
        c.env_remove(k);
    }
    c.env("HOME", home.path()).env("PATH", &path);
    let out = run_bounded(c, Duration::from_secs(150));
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    for check in ["program", "model-server", "metering", "artifact", "code"] {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with(&format!("PASS {check}"))),
            "{check}:\n{}",
            out.stdout
        );
    }
}
