//! `automaton-worker probe`: no GPU, simulated GPUs, each kind of model server (and one
//! that hangs, one that answers garbage), physics from a real config.json, config.md
//! overrides and the cache.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::run::Run;

fn probe(home: &Path, args: &[&str]) -> Run {
    Command::new(env!("CARGO_BIN_EXE_automaton-worker"))
        .arg("probe")
        .args(args)
        .env("HOME", home)
        .env_remove("HOSTNAME")
        .output()
        .expect("run automaton-worker")
        .into()
}

fn probe_json(home: &Path, args: &[&str]) -> Value {
    let mut a = args.to_vec();
    a.push("--json");
    let r = probe(home, &a);
    r.ok();
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("not JSON ({e}):\n{}", r.stdout))
}

fn fixture(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/probe/fixtures")
        .join(name)
        .display()
        .to_string()
}

/// What the fake model server does with one request.
enum Reply {
    /// A status and a JSON (or any) body, with Content-Length.
    Body(u16, String),
    /// The same, chunked.
    Chunked(String),
    /// Accept and never answer.
    Hang,
}

/// An HTTP server on 127.0.0.1:0 answering `route(method, path, body)`; returns its URL and
/// the requests it saw (`METHOD PATH BODY`).
fn serve(route: fn(&str, &str, &str) -> Reply) -> (String, Arc<Mutex<Vec<String>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in l.incoming() {
            let Ok(mut s) = s else { continue };
            let (method, path, body) = read_request(&mut s);
            log.lock().unwrap().push(format!("{method} {path} {body}"));
            match route(&method, &path, &body) {
                Reply::Hang => held.push(s),
                Reply::Body(status, b) => {
                    let _ = write!(
                        s,
                        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
                        b.len()
                    );
                }
                Reply::Chunked(b) => {
                    let (a, c) = b.split_at(b.len() / 2);
                    let _ = write!(
                        s,
                        "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{a}\r\n{:x}\r\n{c}\r\n0\r\n\r\n",
                        a.len(),
                        c.len()
                    );
                }
            }
        }
    });
    (url, seen)
}

fn read_request(s: &mut TcpStream) -> (String, String, String) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let mut b = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        match s.read(&mut b) {
            Ok(0) | Err(_) => return (String::new(), String::new(), String::new()),
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
        })
        .unwrap_or(0);
    while buf.len() < head_end + 4 + len {
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
    let mut words = head.split_whitespace();
    let method = words.next().unwrap_or("").to_string();
    let path = words.next().unwrap_or("").to_string();
    let body = String::from_utf8_lossy(&buf[head_end + 4..]).to_string();
    (method, path, body)
}

fn not_found() -> Reply {
    Reply::Body(404, "404 page not found".into())
}

fn context_source(j: &Value) -> String {
    j["sources"]["context"].as_str().unwrap_or("").to_string()
}

#[test]
fn probe_without_nvidia_library_exits_0_with_no_gpu_and_right_ram_and_cpus() {
    if Path::new("/proc/driver/nvidia").exists() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let j = probe_json(home.path(), &[]);
    assert_eq!(j["gpus"], serde_json::json!([]));
    assert_eq!(j["simulated"], false);
    let note = j["gpu_note"].as_str().unwrap();
    assert!(note.contains("NVIDIA") && !note.contains('\n'), "{note}");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: f64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    let ram = j["ram_bytes"].as_f64().unwrap();
    assert!(
        (ram - kb * 1024.0).abs() / (kb * 1024.0) < 0.01,
        "ram {ram} vs MemTotal {kb} kB"
    );
    let cpus = j["cpus"].as_u64().unwrap();
    let parallel = std::thread::available_parallelism().unwrap().get() as u64;
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo")
        .map(|c| c.lines().filter(|l| l.starts_with("processor")).count() as u64)
        .unwrap_or(0);
    assert!(
        cpus == parallel || cpus == cpuinfo,
        "cpus {cpus}, available {parallel}, cpuinfo {cpuinfo}"
    );
    // seed 002's fallback without a GPU: 8k with 25% headroom.
    assert_eq!(
        (
            j["recommended_kb"].as_u64(),
            j["max_peak_context_kb"].as_u64()
        ),
        (Some(8000), Some(6000))
    );
    assert_eq!(j["gpu_vram_gb"], 0.0);

    let r = probe(home.path(), &[]);
    r.ok();
    assert!(
        r.stdout.starts_with("VRAM Detection Results:\n"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("- GPU VRAM: None (no NVIDIA library"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("- **Using: 8k tokens** (auto-detected)"),
        "{}",
        r.stdout
    );
}

#[test]
fn probe_simulated_gpus_say_so_in_text_and_json() {
    let home = tempfile::tempdir().unwrap();
    let args = [
        "--simulate-gpu",
        "sim-a:24GiB",
        "--simulate-gpu",
        "sim-b:8192MiB",
    ];
    let j = probe_json(home.path(), &args);
    assert_eq!(j["simulated"], true);
    assert_eq!(j["gpu_vram_gb"], 32.0);
    let gpus = j["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_eq!(gpus[0]["uuid"], "SIM-sim-a");
    assert_eq!(gpus[1]["total_bytes"], 8u64 << 30);
    assert_eq!(gpus[1]["free_bytes"], gpus[1]["total_bytes"]);
    // 2k tokens per GiB of 32 GiB, capped by 128k − 4k: 64k.
    assert_eq!(j["recommended_kb"], 64_000);
    assert_eq!(j["max_peak_context_kb"], 48_000);

    let r = probe(home.path(), &args);
    r.ok();
    assert!(
        r.stdout.contains("- GPU VRAM: 32GB (simulated)"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("GPU 0: sim-a 24GB"), "{}", r.stdout);
    assert!(r.stdout.contains("- Simulated: yes"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("- **Recommended: 64k tokens** (GPU VRAM-based, 25% headroom)"),
        "{}",
        r.stdout
    );
}

#[test]
fn probe_rejects_a_garbage_simulated_gpu_with_one_line_naming_the_form() {
    let home = tempfile::tempdir().unwrap();
    let r = probe(home.path(), &["--simulate-gpu", "sim-a:lots"]);
    assert_ne!(r.code, 0);
    assert!(
        r.error_line()
            .contains("expected NAME:SIZE, e.g. sim-a:24GiB"),
        "{}",
        r.stderr
    );
}

#[test]
fn probe_physics_from_a_real_config_json_on_a_simulated_24_gib_gpu() {
    let home = tempfile::tempdir().unwrap();
    let cfg = fixture("llama-3.1-8b.config.json");
    let j = probe_json(
        home.path(),
        &["--simulate-gpu", "a:24GiB", "--model-config", &cfg],
    );
    assert_eq!(j["kv_bytes_per_token"], 131_072);
    let rec = j["recommended_kb"].as_u64().unwrap();
    assert!((61_000..62_500).contains(&rec), "{rec}");
    assert_eq!(j["recommended_k"], rec / 1000);
    assert_eq!(j["model_context_kb"], 131_072);
    assert!(
        j["sources"]["budget"]
            .as_str()
            .unwrap()
            .starts_with("vram-physics")
    );

    let cfg = fixture("llama-3.1-70b.config.json");
    let j = probe_json(
        home.path(),
        &["--simulate-gpu", "a:80GiB", "--model-config", &cfg],
    );
    assert_eq!(j["recommended_kb"], 0);
    assert!(
        j["sources"]["budget"]
            .as_str()
            .unwrap()
            .contains("do not fit"),
        "{j}"
    );
}

#[test]
fn probe_reads_vllm_max_model_len_from_v1_models() {
    let (url, _) = serve(|_, path, _| {
        match path {
        "/v1/models" => Reply::Body(200, r#"{"object":"list","data":[{"id":"Qwen/Qwen2.5-32B","object":"model","max_model_len":32768}]}"#.into()),
        _ => not_found(),
    }
    });
    let home = tempfile::tempdir().unwrap();
    let j = probe_json(
        home.path(),
        &["--model-server", &url, "--simulate-gpu", "a:80GiB"],
    );
    assert_eq!(j["model_context_kb"], 32_768);
    let src = context_source(&j);
    assert!(
        src.contains(&format!(
            "model server {url}/v1/models: max_model_len 32768"
        )) && src.contains("(vLLM)"),
        "{src}"
    );
    // 160k by VRAM, capped by 32768 − 4000.
    assert_eq!(j["recommended_kb"], 28_768);
}

#[test]
fn probe_reads_llama_cpp_per_slot_n_ctx_and_does_not_divide_it_again() {
    // `llama-server -c 32768 --parallel 4`: /props already reports 8192 per slot.
    let (url, _) = serve(|_, path, _| match path {
        "/v1/models" => Reply::Body(
            200,
            r#"{"object":"list","data":[{"id":"model.gguf","meta":{"n_ctx_train":131072}}]}"#
                .into(),
        ),
        "/props" => Reply::Chunked(
            r#"{"default_generation_settings":{"n_ctx":8192},"total_slots":4}"#.into(),
        ),
        _ => not_found(),
    });
    let home = tempfile::tempdir().unwrap();
    let j = probe_json(home.path(), &["--model-server", &url]);
    assert_eq!(j["model_context_kb"], 8192, "{j}");
    let src = context_source(&j);
    assert!(
        src.contains("per-slot n_ctx 8192, 4 slots (llama.cpp)"),
        "{src}"
    );
    assert!(src.contains("/v1/models no max_model_len"), "{src}");
}

#[test]
fn probe_reads_ollama_ps_and_show_and_reports_the_num_ctx_to_send() {
    let (url, seen) = serve(|method, path, _| {
        match (method, path) {
        ("GET", "/v1/models") => Reply::Body(200, r#"{"object":"list","data":[{"id":"llama3.1:8b","object":"model"}]}"#.into()),
        ("GET", "/api/ps") => Reply::Body(200, r#"{"models":[{"name":"llama3.1:8b","model":"llama3.1:8b","context_length":4096}]}"#.into()),
        ("POST", "/api/show") => Reply::Body(200, r#"{"parameters":"num_ctx 8192\nstop \"<|eot_id|>\"","model_info":{"general.architecture":"llama","llama.context_length":131072}}"#.into()),
        _ => not_found(),
    }
    });
    let home = tempfile::tempdir().unwrap();
    let j = probe_json(
        home.path(),
        &["--model-server", &url, "--simulate-gpu", "a:8GiB"],
    );
    assert_eq!(j["model_context_kb"], 131_072, "{j}");
    // 8 GiB → 16k by seed 002's heuristic; Ollama must be sent it on every request.
    assert_eq!(j["recommended_kb"], 16_000);
    assert_eq!(j["num_ctx"], 16_000);
    assert_eq!(j["model"], "llama3.1:8b");
    let src = context_source(&j);
    assert!(src.contains("(Ollama) llama3.1:8b: loaded with context_length 4096, trained maximum 131072, Modelfile num_ctx 8192"), "{src}");
    assert!(
        j["sources"]["num_ctx"]
            .as_str()
            .unwrap()
            .contains("num_ctx 16000"),
        "{j}"
    );
    let seen = seen.lock().unwrap().clone();
    assert!(
        seen.iter()
            .any(|r| r.starts_with("POST /api/show") && r.contains(r#""model":"llama3.1:8b""#)),
        "{seen:?}"
    );
    let r = probe(
        home.path(),
        &[
            "--model-server",
            &url,
            "--simulate-gpu",
            "a:8GiB",
            "--refresh",
        ],
    );
    assert!(
        r.stdout
            .contains("- num_ctx every request must send: 16000 (Ollama)"),
        "{}",
        r.stdout
    );
}

#[test]
fn probe_gives_up_on_a_hanging_model_server_within_the_time_box() {
    let (url, _) = serve(|_, _, _| Reply::Hang);
    let home = tempfile::tempdir().unwrap();
    let start = Instant::now();
    let j = probe_json(home.path(), &["--model-server", &url, "--model", "gpt-4o"]);
    let took = start.elapsed();
    // One 2 s time box (the server is then skipped), plus a margin for the process.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    let src = context_source(&j);
    assert!(src.contains("/v1/models timed out after 2s"), "{src}");
    assert!(src.contains("model-name table: gpt-4o"), "{src}");
    assert_eq!(j["model_context_kb"], 128_000);
}

#[test]
fn probe_falls_through_a_garbage_model_server_and_says_why() {
    let (url, _) = serve(|_, _, _| Reply::Body(200, "<html>hello</html>".into()));
    let home = tempfile::tempdir().unwrap();
    let j = probe_json(
        home.path(),
        &["--model-server", &url, "--model", "claude-3-opus-20240229"],
    );
    let src = context_source(&j);
    assert!(src.contains("/v1/models not JSON"), "{src}");
    assert!(src.contains("/props not JSON"), "{src}");
    assert!(src.contains("/api/ps not JSON"), "{src}");
    assert_eq!(j["model_context_kb"], 200_000);

    let (url, _) = serve(|_, _, _| Reply::Body(500, r#"{"error":"boom"}"#.into()));
    let j = probe_json(home.path(), &["--model-server", &url]);
    let src = context_source(&j);
    assert!(
        src.contains("/v1/models HTTP 500") && src.contains("fell through to 128k default"),
        "{src}"
    );
}

#[test]
fn probe_config_md_auto_detect_no_is_used_through_the_project_layering() {
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(home.path().join(".automaton")).unwrap();
    std::fs::write(
        home.path().join(".automaton/config.md"),
        "## Model Configuration\n- **Model**: claude-3-5-sonnet\n- **Override context window**: auto\n",
    )
    .unwrap();
    let p = project.path().display().to_string();
    // No project config.md: the user's is used (Model from the name table).
    let j = probe_json(home.path(), &["--project", &p]);
    assert_eq!(j["model_context_kb"], 200_000);
    assert!(
        context_source(&j).contains("claude-3-5-sonnet (config.md Model)"),
        "{j}"
    );

    std::fs::create_dir_all(project.path().join(".automaton")).unwrap();
    std::fs::write(
        project.path().join(".automaton/config.md"),
        "## VRAM Configuration\n- **Auto-detect**: No\n- **Target context**: 20k tokens\n- **Headroom**: 10%\n- **Max peak context per sub-task**: 15k tokens\n\n## Model Configuration\n- **Override context window**: 64k\n- **Model**: gpt-4o\n",
    )
    .unwrap();
    let j = probe_json(home.path(), &["--project", &p]);
    assert_eq!(j["auto_detect"], false);
    assert_eq!(
        (
            j["recommended_kb"].as_u64(),
            j["max_peak_context_kb"].as_u64()
        ),
        (Some(20_000), Some(15_000))
    );
    assert_eq!(j["headroom"], 0.1);
    assert_eq!(j["model_context_kb"], 64_000);
    let r = probe(home.path(), &["--project", &p]);
    assert!(
        r.stdout
            .contains("- **Using: 20k tokens** (manual override: config.md)"),
        "{}",
        r.stdout
    );

    std::fs::write(
        project.path().join(".automaton/config.md"),
        "## VRAM Configuration\n- **Auto-detect**: No\n- **Target context**: lots\n",
    )
    .unwrap();
    let j = probe_json(home.path(), &["--project", &p]);
    assert_eq!(j["auto_detect"], true);
    assert!(
        j["sources"]["config"]
            .as_str()
            .unwrap()
            .contains("ignored malformed \"target context\""),
        "{j}"
    );
}

#[test]
fn probe_cache_is_reused_invalidated_by_a_new_task_and_bypassed_by_refresh() {
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let tasks = project.path().join(".automaton/tasks");
    std::fs::create_dir_all(tasks.join("t1")).unwrap();
    let p = project.path().display().to_string();
    let args = ["--project", p.as_str(), "--simulate-gpu", "a:24GiB"];
    let cache_of = |j: &Value| j["sources"]["cache"].as_str().unwrap_or("").to_string();
    std::thread::sleep(Duration::from_millis(50));

    let first = probe_json(home.path(), &args);
    assert!(
        cache_of(&first).ends_with("written"),
        "{}",
        cache_of(&first)
    );
    assert!(project.path().join(".automaton/.vram_cache.json").exists());
    assert!(!home.path().join(".automaton/.vram_cache.json").exists());

    let second = probe_json(home.path(), &args);
    assert!(
        cache_of(&second).starts_with("reused"),
        "{}",
        cache_of(&second)
    );
    assert_eq!(second["recommended_kb"], first["recommended_kb"]);

    // Other inputs: not reused.
    let other = probe_json(home.path(), &["--project", &p, "--simulate-gpu", "a:48GiB"]);
    assert!(
        cache_of(&other).contains("inputs changed"),
        "{}",
        cache_of(&other)
    );
    let _ = probe_json(home.path(), &args);

    std::thread::sleep(Duration::from_millis(50));
    std::fs::create_dir(tasks.join("t2")).unwrap();
    let third = probe_json(home.path(), &args);
    assert!(
        cache_of(&third).contains("invalidated: a task folder created"),
        "{}",
        cache_of(&third)
    );
    let fourth = probe_json(home.path(), &args);
    assert!(
        cache_of(&fourth).starts_with("reused"),
        "{}",
        cache_of(&fourth)
    );

    let mut refresh = args.to_vec();
    refresh.push("--refresh");
    let fifth = probe_json(home.path(), &refresh);
    assert!(
        cache_of(&fifth).starts_with("bypassed (--refresh)"),
        "{}",
        cache_of(&fifth)
    );

    // A corrupt cache is ignored, never an error.
    std::fs::write(
        project.path().join(".automaton/.vram_cache.json"),
        "{garbage",
    )
    .unwrap();
    let sixth = probe_json(home.path(), &args);
    assert!(cache_of(&sixth).contains("corrupt"), "{}", cache_of(&sixth));
}
