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

/// Writes `body` as `dir/.automaton/scripts/vram_detect.sh` (a `#!/bin/sh` script), executable
/// or not; returns its path.
fn vram_detect_sh(dir: &Path, body: &str, executable: bool) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let scripts = dir.join(".automaton/scripts");
    std::fs::create_dir_all(&scripts).unwrap();
    let path = scripts.join("vram_detect.sh");
    let _ = std::fs::remove_file(&path);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    let mode = if executable { 0o755 } else { 0o644 };
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

fn source_of(j: &Value, key: &str) -> String {
    j["sources"][key].as_str().unwrap_or("").to_string()
}

#[test]
fn issue24_9_vram_detect_sh_in_the_project_is_detection_priority_one() {
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let p = project.path().display().to_string();
    // It runs in the project's root: ran.log counts the runs.
    let script = vram_detect_sh(
        project.path(),
        r#"echo "run ${AUTOMATON_TOKEN:-without the worker's token}" >> ran.log
cat <<'JSON'
{"gpu_vram_gb": 12, "ram_gb": 32, "model_context_kb": 96000, "framework_overhead_tokens": 3000,
 "recommended_kb": 23000, "recommended_k": 23, "headroom": 0.2, "max_peak_context_kb": 17000}
JSON"#,
        true,
    );
    // A simulated 80 GiB GPU: the built-in probe would say 124k (128k − 4k), not 23k.
    let args = ["--project", p.as_str(), "--simulate-gpu", "a:80GiB"];
    let r: Run = Command::new(env!("CARGO_BIN_EXE_automaton-worker"))
        .arg("probe")
        .args(args)
        .arg("--json")
        .env("HOME", home.path())
        .env("AUTOMATON_TOKEN", "the-worker-s-token")
        .output()
        .unwrap()
        .into();
    r.ok();
    let j: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        (
            j["recommended_kb"].as_u64(),
            j["recommended_k"].as_u64(),
            j["max_peak_context_kb"].as_u64(),
            j["model_context_kb"].as_u64(),
            j["framework_overhead_tokens"].as_u64(),
        ),
        (
            Some(23_000),
            Some(23),
            Some(17_000),
            Some(96_000),
            Some(3000)
        ),
        "{j}"
    );
    assert_eq!(j["headroom"], 0.2);
    assert_eq!(j["auto_detect"], true);
    let used = format!("vram_detect.sh ({}): used", script.display());
    assert_eq!(source_of(&j, "vram_detect"), used, "{j}");
    assert!(source_of(&j, "budget").starts_with(&used), "{j}");
    assert_eq!(
        context_source(&j),
        format!(
            "vram_detect.sh ({}): model_context_kb 96000",
            script.display()
        )
    );
    assert_eq!(j["vram_detect"]["gpu_vram_gb"], 12.0);
    assert_eq!(
        std::fs::read_to_string(project.path().join("ran.log")).unwrap(),
        "run without the worker's token\n"
    );

    // Cached: not run again.
    let again = probe_json(home.path(), &args);
    assert!(source_of(&again, "cache").starts_with("reused"), "{again}");
    assert_eq!(again["recommended_kb"], 23_000);
    assert_eq!(
        std::fs::read_to_string(project.path().join("ran.log"))
            .unwrap()
            .lines()
            .count(),
        1
    );

    // Edited (and no longer executable: it runs through sh): the cache is not served.
    vram_detect_sh(
        project.path(),
        r#"echo run >> ran.log
echo '{"recommended_kb": 24000}'"#,
        false,
    );
    let edited = probe_json(home.path(), &args);
    assert!(
        source_of(&edited, "cache").contains("inputs changed"),
        "{edited}"
    );
    assert_eq!(edited["recommended_kb"], 24_000, "{edited}");
    // No headroom or max peak given: 25% and 18k; the window is detected as before (128k).
    assert_eq!(edited["max_peak_context_kb"], 18_000);
    assert_eq!(edited["headroom"], 0.25);
    assert_eq!(edited["model_context_kb"], 128_000);
    let r = probe(home.path(), &["--project", &p, "--simulate-gpu", "a:80GiB"]);
    r.ok();
    assert!(
        r.stdout
            .contains("- **Recommended: 24k tokens** (vram_detect.sh, 25% headroom)"),
        "{}",
        r.stdout
    );

    // config.md's Auto-detect: No still wins, and the script is not run at all.
    std::fs::write(
        project.path().join(".automaton/config.md"),
        "## VRAM Configuration\n- **Auto-detect**: No\n- **Target context**: 20k tokens\n",
    )
    .unwrap();
    let runs = std::fs::read_to_string(project.path().join("ran.log")).unwrap();
    let manual = probe_json(home.path(), &args);
    assert_eq!(manual["recommended_kb"], 20_000, "{manual}");
    assert_eq!(manual["auto_detect"], false);
    assert!(
        source_of(&manual, "vram_detect").ends_with("not run (config.md Auto-detect: No)"),
        "{manual}"
    );
    assert_eq!(
        std::fs::read_to_string(project.path().join("ran.log")).unwrap(),
        runs
    );
}

#[test]
fn issue24_9_vram_detect_sh_that_fails_hangs_or_prints_garbage_falls_back_and_says_which() {
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let p = project.path().display().to_string();
    // The built-in probe on a simulated 24 GiB GPU: 48k by seed 002's heuristic.
    let args = ["--project", p.as_str(), "--simulate-gpu", "a:24GiB"];
    let cases = [
        (
            "echo 'nvidia-smi: command not found' >&2\nexit 3",
            "exit status 3 (\"nvidia-smi: command not found\")",
        ),
        ("echo 'GPU busy, try later'", "printed no JSON"),
        (
            r#"echo '{"recommended_kb": 0, "headroom": 0.25}'"#,
            "recommended_kb is 0",
        ),
        (
            r#"echo '{"recommended_kb": 16000, "headroom": 25}'"#,
            "headroom 25 is not a fraction below 1",
        ),
        ("yes '{\"recommended_kb\": 1}'", "printed more than 64 KiB"),
    ];
    for (body, why) in cases {
        let script = vram_detect_sh(project.path(), body, true);
        let start = Instant::now();
        let j = probe_json(home.path(), &args);
        assert!(start.elapsed() < Duration::from_secs(4), "{body}: slow");
        let line = source_of(&j, "vram_detect");
        assert!(
            line.starts_with(&format!("vram_detect.sh ({}): {why}", script.display()))
                && line.ends_with(", fell back to the built-in probe"),
            "{body}: {j}"
        );
        assert_eq!(j["recommended_kb"], 48_000, "{body}: {j}");
        assert!(source_of(&j, "budget").starts_with("heuristic"), "{j}");
        assert_eq!(j["vram_detect"], Value::Null);
    }

    // One that hangs, with a child of its own: the whole group is killed at the time box.
    let pid_file = project.path().join("child.pid");
    let script = vram_detect_sh(
        project.path(),
        &format!("sleep 60 &\necho $! > '{}'\nsleep 60", pid_file.display()),
        true,
    );
    let start = Instant::now();
    let j = probe_json(home.path(), &args);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_secs(5) && took < Duration::from_secs(9),
        "took {took:?}"
    );
    assert_eq!(
        source_of(&j, "vram_detect"),
        format!(
            "vram_detect.sh ({}): timed out after 5s (its process group was killed), fell back to the built-in probe",
            script.display()
        ),
        "{j}"
    );
    assert_eq!(j["recommended_kb"], 48_000);
    let child = std::fs::read_to_string(&pid_file).unwrap();
    let stat = format!("/proc/{}/stat", child.trim());
    let gone = (0..50).any(|_| {
        let alive = std::fs::read_to_string(&stat)
            .map(|s| {
                !s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
            .unwrap_or(false);
        if alive {
            std::thread::sleep(Duration::from_millis(20));
        }
        !alive
    });
    assert!(gone, "the script's background child {child} survived");
}

#[test]
fn issue24_9_vram_detect_sh_in_home_is_used_when_the_project_has_none() {
    use std::os::unix::fs::symlink;
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let dotfiles = tempfile::tempdir().unwrap();
    let p = project.path().display().to_string();
    let args = ["--project", p.as_str(), "--simulate-gpu", "a:24GiB"];
    // ~/.automaton/scripts/vram_detect.sh as a dotfiles manager's link: followed there.
    let real = vram_detect_sh(
        dotfiles.path(),
        r#"echo '{"recommended_kb": 11000, "max_peak_context_kb": 9000}'"#,
        true,
    );
    std::fs::create_dir_all(home.path().join(".automaton/scripts")).unwrap();
    let users = home.path().join(".automaton/scripts/vram_detect.sh");
    symlink(&real, &users).unwrap();
    let j = probe_json(home.path(), &args);
    assert_eq!(
        source_of(&j, "vram_detect"),
        format!("vram_detect.sh ({}): used", users.display()),
        "{j}"
    );
    assert_eq!(
        (
            j["recommended_kb"].as_u64(),
            j["max_peak_context_kb"].as_u64()
        ),
        (Some(11_000), Some(9000))
    );
    // Without --project, the user's too.
    let j = probe_json(home.path(), &["--simulate-gpu", "a:24GiB"]);
    assert_eq!(j["recommended_kb"], 11_000, "{j}");

    // A link in the project's layer is refused, and not passed over for the user's script.
    std::fs::create_dir_all(project.path().join(".automaton/scripts")).unwrap();
    let own = project.path().join(".automaton/scripts/vram_detect.sh");
    symlink(&real, &own).unwrap();
    let j = probe_json(home.path(), &args);
    let line = source_of(&j, "vram_detect");
    assert!(
        line.starts_with(&format!("vram_detect.sh ({}): ", own.display()))
            && line.contains("is a symbolic link in the project")
            && line.ends_with("fell back to the built-in probe"),
        "{line}"
    );
    assert_eq!(j["recommended_kb"], 48_000);

    // The project's own script wins over the user's.
    std::fs::remove_file(&own).unwrap();
    let own = vram_detect_sh(project.path(), r#"echo '{"recommended_kb": 13000}'"#, true);
    let j = probe_json(home.path(), &args);
    assert_eq!(
        source_of(&j, "vram_detect"),
        format!("vram_detect.sh ({}): used", own.display())
    );
    assert_eq!(j["recommended_kb"], 13_000);
}

#[test]
fn issue24_10_the_model_in_agent_md_gives_the_context_window() {
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let p = project.path().display().to_string();
    let args = ["--project", p.as_str()];
    // The user's .agent.md, the project having none.
    std::fs::create_dir_all(home.path().join(".automaton")).unwrap();
    let users = home.path().join(".automaton/.agent.md");
    std::fs::write(
        &users,
        "# Agent\nMode: single-agent\nModel: claude-3-haiku\n",
    )
    .unwrap();
    let j = probe_json(home.path(), &args);
    assert_eq!(j["model"], "claude-3-haiku", "{j}");
    assert_eq!(j["model_context_kb"], 200_000);
    assert_eq!(
        source_of(&j, "model"),
        format!("claude-3-haiku ({} Model: line)", users.display())
    );

    // The project's wins (the bold form); the cache is not served for the old model.
    std::fs::create_dir_all(project.path().join(".automaton")).unwrap();
    let own = project.path().join(".automaton/.agent.md");
    std::fs::write(
        &own,
        "# Agent\n- **Mode**: multi-agent\n- **Model**: claude-3-5-sonnet\n",
    )
    .unwrap();
    let j = probe_json(home.path(), &args);
    assert_eq!(j["model"], "claude-3-5-sonnet", "{j}");
    assert_eq!(j["model_context_kb"], 200_000);
    assert!(
        context_source(&j).contains(&format!(
            "model-name table: claude-3-5-sonnet ({} Model: line) is claude-3-5-sonnet, 200k",
            own.display()
        )),
        "{j}"
    );
    let r = probe(home.path(), &args);
    assert!(
        r.stdout.contains("- Model context window: 200k"),
        "{}",
        r.stdout
    );

    // config.md's Model and --model come first.
    std::fs::write(
        project.path().join(".automaton/config.md"),
        "## Model Configuration\n- **Model**: gpt-4o\n",
    )
    .unwrap();
    let j = probe_json(home.path(), &args);
    assert_eq!(
        (j["model"].as_str(), j["model_context_kb"].as_u64()),
        (Some("gpt-4o"), Some(128_000))
    );
    assert_eq!(source_of(&j, "model"), "gpt-4o (config.md Model)");
    std::fs::remove_file(project.path().join(".automaton/config.md")).unwrap();
    let j = probe_json(home.path(), &["--project", &p, "--model", "gpt-4-turbo"]);
    assert_eq!(j["model"], "gpt-4-turbo");
    assert_eq!(j["model_context_kb"], 128_000);
}

#[test]
fn issue24_10_env_and_config_yaml_are_read_for_the_model_line_only_capped_and_keys_warned() {
    let home = tempfile::tempdir().unwrap();
    let project = tempfile::tempdir().unwrap();
    let p = project.path().display().to_string();
    let args = ["--project", p.as_str()];
    const SECRET: &str = "sk-live-9f8e7d6c5b4a";
    // An .agent.md without a model line does not stop the search.
    std::fs::create_dir_all(project.path().join(".automaton")).unwrap();
    std::fs::write(
        project.path().join(".automaton/.agent.md"),
        "Mode: single-agent\n",
    )
    .unwrap();
    let env = project.path().join(".env");
    std::fs::write(
        &env,
        format!("# keys\nOPENAI_API_KEY={SECRET}\nexport OPENAI_MODEL=\"claude-3-opus\"\n"),
    )
    .unwrap();
    let never_shown = |what: &str, text: &str| {
        assert!(
            !text.contains(SECRET),
            "{what} shows the key's value:\n{text}"
        );
    };
    let r = probe(home.path(), &["--project", &p, "--json"]);
    r.ok();
    never_shown("--json", &r.stdout);
    never_shown("stderr", &r.stderr);
    let j: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["model"], "claude-3-opus", "{j}");
    assert_eq!(j["model_context_kb"], 200_000);
    assert_eq!(
        source_of(&j, "model"),
        format!("claude-3-opus ({} MODEL= line)", env.display())
    );
    let warning = source_of(&j, "model_files");
    assert!(
        warning.contains(&format!(
            "warning: {} holds what look like API keys (OPENAI_API_KEY)",
            env.display()
        )),
        "{warning}"
    );
    let cache =
        std::fs::read_to_string(project.path().join(".automaton/.vram_cache.json")).unwrap();
    never_shown("the cache", &cache);
    let r = probe(home.path(), &["--project", &p, "--refresh"]);
    never_shown("the text block", &r.stdout);

    // No model line in .env: config.yaml at the project root, of which 10 KB are read — a
    // model line past them (in a 1 MiB file) is not seen.
    std::fs::write(&env, format!("OPENAI_API_KEY={SECRET}\n")).unwrap();
    let yaml = project.path().join("config.yaml");
    let mut big = "# padding padding padding padding padding padding padding\n".repeat(18_100);
    big.push_str("model: claude-3-opus\n");
    assert!(big.len() > 1 << 20);
    std::fs::write(&yaml, &big).unwrap();
    let r = probe(home.path(), &["--project", &p, "--json"]);
    r.ok();
    never_shown("--json", &r.stdout);
    let j: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(j["model"], Value::Null, "{j}");
    assert_eq!(j["model_context_kb"], 128_000);
    let notes = source_of(&j, "model_files");
    assert!(
        notes.contains(&format!(
            "{}: {} bytes, only the first 10240 read",
            yaml.display(),
            big.len()
        )),
        "{notes}"
    );
    assert!(notes.contains("(OPENAI_API_KEY)"), "{notes}");

    // Its model line within the first 10 KB is found.
    std::fs::write(
        &yaml,
        format!("provider: anthropic\nmodel: 'claude-3-haiku'\n{big}"),
    )
    .unwrap();
    let j = probe_json(home.path(), &args);
    assert_eq!(j["model"], "claude-3-haiku", "{j}");
    assert_eq!(j["model_context_kb"], 200_000);
    assert_eq!(
        source_of(&j, "model"),
        format!("claude-3-haiku ({} model: line)", yaml.display())
    );

    // The project's root-level .env as a link is not read.
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().join("env");
    std::fs::write(&target, "MODEL=claude-2\n").unwrap();
    std::fs::remove_file(&env).unwrap();
    std::os::unix::fs::symlink(&target, &env).unwrap();
    let j = probe_json(home.path(), &args);
    assert_eq!(j["model"], "claude-3-haiku", "{j}");
    assert!(
        source_of(&j, "model_files").contains(&format!(
            "{} is a symbolic link in the project",
            env.display()
        )),
        "{j}"
    );
}
