//! Issue 12, "sizing that learns", for real agents: the peak context of an agent that writes
//! no `usage.json` is read from its model server's answers by the worker's metering proxy,
//! reported with the run, and learned from by the coordinator. Real coordinator, real worker,
//! a real `sh`/`curl` agent, and an OpenAI-compatible server in a thread.

use std::time::Duration;

use crate::harness::*;
use crate::model_server::{ModelServer, openai};
use crate::work::{FLEET, git_init};
use crate::workers::Worker;

/// Three chat completions through `$OPENAI_BASE_URL`, of (stream, max_tokens, prompt
/// characters): 1000 + 100 plain, 5000 + 1000 streamed, 3000 + 200 streamed. The test server
/// counts one prompt token per character, so the peak is 6000. No `usage.json` is written.
const CURL_AGENT: &str = r#"set -e
req() { printf '{"model":"m","stream":%s,"max_tokens":%s,"messages":[{"role":"user","content":"%s"}]}' "$1" "$2" "$(printf "%0${3}d" 0)"; }
for call in "false 100 1000" "true 1000 5000" "true 200 3000"; do
  req $call | curl -q -sS --fail --noproxy '*' -X POST -H 'Content-Type: application/json' --data-binary @- "$OPENAI_BASE_URL/chat/completions" >> .automaton-task/answers.txt
  echo >> .automaton-task/answers.txt
done
echo "answers with usage: $(grep -o total_tokens .automaton-task/answers.txt | wc -l)" > {artifact}
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_server_usage_is_read_through_the_metering_proxy() {
    let env = Env::new();
    git_init(&env);
    let server = ModelServer::start(openai);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // One sub-task estimated at 8k tokens.
    api.approved_research(&env, "p", Some("decomposition"))
        .await;
    env.artifact(
        "p",
        "DECOMPOSITION.md",
        "| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n\
         | --- | --- | --- | --- |\n\
         | calls | - | 8 | calls the model; its tests pass |\n",
    );
    api.transition("p", "decomposition:awaiting_approval")
        .await
        .expect("await");
    api.approve("p", "").await.expect("approve decomposition");
    let w = Worker::start(
        &coord.url,
        &[
            "--name",
            "gpu-m",
            "--simulate-gpu",
            "sim:24GiB",
            "--model-server",
            &server.url,
            "--agent",
            CURL_AGENT,
            "--kill-grace",
            "300ms",
        ],
        &[],
    );
    let run = poll(
        "the sub-task's first run to stop",
        Duration::from_secs(30),
        || {
            let mut api = api.clone();
            async move {
                let runs = api.get("p/calls").await.ok()?.runs;
                runs.into_iter().find(|r| r.state == "stopped")
            }
        },
    )
    .await;
    assert_eq!(run.stop_reason, "completed", "{run:#?}\n{}", w.stderr());
    assert_eq!(run.estimated_tokens, 8000, "{run:#?}");
    assert_eq!(
        run.peak_context_tokens, 6000,
        "max(prompt + completion): {run:#?}"
    );
    assert_eq!(run.peak_context_source, "model_server", "{run:#?}");
    // Operators see it too: `automaton status --task` and its JSON name the peak and its source.
    let shown = env.cli(&["--task", "p/calls"]);
    assert!(
        shown
            .stdout
            .contains("peak 6000 of 8000 tokens sized (model_server)"),
        "{shown:?}"
    );
    let json = env.cli(&["--task", "p/calls", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json.stdout).expect("--json is JSON");
    assert_eq!(v["runs"][0]["peak_context_tokens"], 6000, "{json:?}");
    assert_eq!(
        v["runs"][0]["peak_context_source"], "model_server",
        "{json:?}"
    );
    // The coordinator learned from it: 6000 used of 8000 estimated.
    let ratio = api.list().await.expect("ListTasks").sizing_ratio;
    assert!((ratio - 0.75).abs() < 1e-9, "sizing_ratio {ratio}");
    // The agent got every answer, usage included; the server saw the requests under its own
    // paths, streamed ones asking for the usage chunk.
    let artifact = env
        .task_dir("p/calls")
        .read_dir()
        .expect("the sub-task's folder")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".md"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .find(|t| t.contains("answers with usage"))
        .unwrap_or_default();
    assert_eq!(artifact.trim(), "answers with usage: 3");
    let chats: Vec<_> = server
        .seen()
        .into_iter()
        .filter(|s| s.path.ends_with("/chat/completions"))
        .collect();
    assert_eq!(chats.len(), 3, "{chats:#?}");
    assert!(chats.iter().all(|s| s.path == "/v1/chat/completions"));
    for s in chats.iter().filter(|s| s.json()["stream"] == true) {
        assert_eq!(
            s.json()["stream_options"]["include_usage"],
            true,
            "{}",
            s.body
        );
    }
    let log = w.stderr();
    assert!(
        log.lines().any(|l| l.contains("run stopped")
            && l.contains("peak_context_tokens=6000")
            && l.contains("model_server")),
        "{log}"
    );
}
