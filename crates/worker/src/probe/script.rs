//! Seed 002's detection priority 1: `vram_detect.sh`, the operator's own probe, found by the
//! layered lookup (`{project}/.automaton/scripts/` over `~/.automaton/scripts/`) on the
//! worker's own disk — never a script that a task folder or the coordinator supplies. It runs
//! in its own process group with a time box; what it prints (at most `MAX_STDOUT`) must be
//! one JSON object with seed 002's fields. Whatever goes wrong is one line, and the caller
//! falls back to the built-in probe saying so.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, WaitId, WaitIdOptions, kill_process_group, waitid};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::files::Found;

/// Where the layered lookup looks, below `.automaton/`.
pub const RELATIVE: &str = "scripts/vram_detect.sh";
/// The script gets this long (nvidia-smi on a cold driver takes a second or two); then its
/// whole process group is killed.
pub const TIMEOUT: Duration = Duration::from_secs(5);
/// What is read of its stdout; more is a script gone wrong.
pub const MAX_STDOUT: usize = 64 * 1024;
/// What is kept of its stderr for the reason line (the rest is drained).
const MAX_STDERR: usize = 2 * 1024;
/// Token counts above this are not a real model's (the largest windows are ~10M).
pub const MAX_TOKENS: u64 = 10_000_000;
/// GiB above this are not one machine's.
const MAX_GIB: f64 = 1_000_000.0;
/// How much of the script feeds the cache key (with its size and mtime).
const MAX_HASHED: u64 = 1 << 20;
/// After the group is killed, how long its pipes may take to close.
const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// Seed 002's fields as the script gave them (tokens for `_kb`), checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub recommended_kb: u64,
    pub headroom: Option<f64>,
    pub max_peak_context_kb: Option<u64>,
    pub model_context_kb: Option<u64>,
    pub framework_overhead_tokens: Option<u64>,
    pub gpu_vram_gb: Option<f64>,
    pub ram_gb: Option<f64>,
    /// Informational fields that were unusable and ignored (one line each).
    #[serde(default)]
    pub ignored: Vec<String>,
}

/// What feeds the cache key: the path, size, mtime and a hash of the first MiB, so that an
/// edited script is run again instead of serving the old result.
pub fn identity(f: &Found) -> String {
    let path = f.path.display();
    let meta = match std::fs::metadata(&f.path) {
        Ok(m) => m,
        Err(e) => return format!("{path}: {e}"),
    };
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let hash = match super::files::read_capped(f, MAX_HASHED) {
        Ok(Some(c)) => automaton_workflow::sha256_hex(&c.bytes),
        Ok(None) => "absent".into(),
        Err(e) => e,
    };
    format!(
        "{path} {} {mtime} {:o} {hash}",
        meta.len(),
        meta.permissions().mode()
    )
}

/// Runs the script (in `cwd`) and checks what it printed; `Err` says why it is not used.
pub fn run(f: &Found, cwd: Option<&Path>) -> Result<Report, String> {
    f.check_links()?;
    let meta = std::fs::metadata(&f.path).map_err(|e| format!("cannot stat ({e})"))?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    let out = execute(f, meta.permissions().mode() & 0o111 != 0, cwd)?;
    parse(&out)
}

enum End {
    Exited,
    TooMuch,
    TimedOut,
}

fn execute(f: &Found, executable: bool, cwd: Option<&Path>) -> Result<Vec<u8>, String> {
    // An executable script runs by its #! line; one without the x bit through sh.
    let mut cmd = if executable {
        Command::new(&f.path)
    } else {
        let mut c = Command::new("sh");
        c.arg(&f.path);
        c
    };
    // The worker's own credentials are no business of a detection script (as for agents).
    cmd.env_remove(crate::agent::WORKER_TOKEN_VAR)
        .env_remove(crate::agent::POOL_SECRET_VAR)
        .env_remove(crate::agent::TOKEN_FILE_VAR)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let mut child = cmd.spawn().map_err(|e| format!("cannot run ({e})"))?;
    // process_group(0): the group id is the leader's pid.
    let pgid = i32::try_from(child.id()).ok().and_then(Pid::from_raw);
    let over = Arc::new(AtomicBool::new(false));
    let (out_tx, out_rx) = mpsc::channel();
    let (err_tx, err_rx) = mpsc::channel();
    if let Some(out) = child.stdout.take() {
        let over = over.clone();
        std::thread::spawn(move || {
            let _ = out_tx.send(read_up_to(out, MAX_STDOUT, Some(&over)));
        });
    }
    if let Some(err) = child.stderr.take() {
        std::thread::spawn(move || {
            let _ = err_tx.send(read_up_to(err, MAX_STDERR, None));
        });
    }

    let deadline = Instant::now() + TIMEOUT;
    let end = loop {
        if exited(pgid, &mut child) {
            break End::Exited;
        }
        if over.load(Ordering::Relaxed) {
            break End::TooMuch;
        }
        if Instant::now() >= deadline {
            break End::TimedOut;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    // The leader is not reaped yet (WNOWAIT), so its pid still names its group: this kill
    // reaches only the script's processes — on a timeout all of them, after an exit whatever
    // it left behind holding its stdout.
    match pgid {
        Some(p) => {
            let _ = kill_process_group(p, Signal::KILL);
        }
        None => {
            let _ = child.kill();
        }
    }
    let status = child
        .wait()
        .map_err(|e| format!("cannot wait for it ({e})"))?;
    let grace = Instant::now() + DRAIN_GRACE;
    let left = || grace.saturating_duration_since(Instant::now());
    let stdout = out_rx.recv_timeout(left());
    let stderr = err_rx.recv_timeout(left()).unwrap_or_default();
    match end {
        End::TimedOut => {
            return Err(format!(
                "timed out after {}s (its process group was killed)",
                TIMEOUT.as_secs()
            ));
        }
        End::TooMuch => return Err(too_much()),
        End::Exited => {}
    }
    if over.load(Ordering::Relaxed) {
        return Err(too_much());
    }
    if !status.success() {
        return Err(format!("{}{}", describe(status), stderr_line(&stderr)));
    }
    stdout.map_err(|_| "its stdout stayed open after it exited".to_string())
}

fn too_much() -> String {
    format!(
        "printed more than {} KiB (its process group was killed)",
        MAX_STDOUT / 1024
    )
}

/// Whether the leader has exited, leaving it waitable (a zombie keeps its pid and group).
fn exited(pgid: Option<Pid>, child: &mut std::process::Child) -> bool {
    match pgid {
        Some(p) => match waitid(
            WaitId::Pid(p),
            WaitIdOptions::EXITED | WaitIdOptions::NOHANG | WaitIdOptions::NOWAIT,
        ) {
            Ok(Some(_)) => true,
            Ok(None) | Err(rustix::io::Errno::INTR) => false,
            // Not our child any more (cannot happen): stop waiting; the kill and wait follow.
            Err(_) => true,
        },
        None => !matches!(child.try_wait(), Ok(None)),
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        (None, None) => format!("{status}"),
    }
}

/// `: <first stderr line>`, short, when it said anything.
fn stderr_line(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    match text.lines().map(str::trim).find(|l| !l.is_empty()) {
        Some(l) => format!(" ({:?})", l.chars().take(120).collect::<String>()),
        None => String::new(),
    }
}

/// Reads up to `cap` bytes; with `over`, more sets it and stops (dropping the pipe), without
/// it the rest is drained so that the writer never blocks.
fn read_up_to(mut r: impl Read, cap: usize, over: Option<&AtomicBool>) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match r.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                let room = cap.saturating_sub(buf.len());
                buf.extend_from_slice(&chunk[..n.min(room)]);
                if n > room
                    && let Some(o) = over
                {
                    o.store(true, Ordering::Relaxed);
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    buf
}

/// One JSON object with seed 002's fields: `recommended_kb` is required; every budget field
/// given must be a sane number (a zero, negative, fractional-headroom-above-1 or absurdly
/// large value makes the whole output unusable: a script that got one field wrong may have
/// got the others wrong too). `gpu_vram_gb` and `ram_gb` are informational: a bad one is
/// ignored with a note.
pub fn parse(out: &[u8]) -> Result<Report, String> {
    let text = String::from_utf8_lossy(out);
    let text = text.trim();
    if text.is_empty() {
        return Err("printed nothing".into());
    }
    let v: Value = serde_json::from_str(text).map_err(|e| {
        let head: String = text.chars().take(40).collect();
        format!("printed no JSON ({e}): {head:?}")
    })?;
    let o = v.as_object().ok_or("printed JSON that is not an object")?;
    let recommended_kb = tokens(o.get("recommended_kb"), "recommended_kb", false)?
        .ok_or("gave no recommended_kb")?;
    let max_peak_context_kb = tokens(o.get("max_peak_context_kb"), "max_peak_context_kb", false)?;
    let model_context_kb = tokens(o.get("model_context_kb"), "model_context_kb", false)?;
    let framework_overhead_tokens = tokens(
        o.get("framework_overhead_tokens"),
        "framework_overhead_tokens",
        true,
    )?;
    let headroom = match o.get("headroom") {
        None | Some(Value::Null) => None,
        Some(h) => Some(
            h.as_f64()
                .filter(|h| h.is_finite() && (0.0..1.0).contains(h))
                .ok_or_else(|| format!("headroom {h} is not a fraction below 1 (0.25 is 25%)"))?,
        ),
    };
    if let Some(m) = max_peak_context_kb
        && m > recommended_kb
    {
        return Err(format!(
            "max_peak_context_kb {m} is above recommended_kb {recommended_kb}"
        ));
    }
    if let Some(w) = model_context_kb
        && recommended_kb > w
    {
        return Err(format!(
            "recommended_kb {recommended_kb} is above model_context_kb {w}"
        ));
    }
    let mut ignored = Vec::new();
    let mut gib = |key: &str| match o.get(key) {
        None | Some(Value::Null) => None,
        Some(g) => {
            let ok = g
                .as_f64()
                .filter(|g| g.is_finite() && (0.0..=MAX_GIB).contains(g));
            if ok.is_none() {
                ignored.push(format!("{key} {g} ignored (not a size in GiB)"));
            }
            ok
        }
    };
    let gpu_vram_gb = gib("gpu_vram_gb");
    let ram_gb = gib("ram_gb");
    Ok(Report {
        recommended_kb,
        headroom,
        max_peak_context_kb,
        model_context_kb,
        framework_overhead_tokens,
        gpu_vram_gb,
        ram_gb,
        ignored,
    })
}

/// A token count: a whole number from 1 (0 too where `zero_ok`) to `MAX_TOKENS`.
fn tokens(v: Option<&Value>, key: &str, zero_ok: bool) -> Result<Option<u64>, String> {
    let v = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => v,
    };
    let n = v
        .as_u64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && f.fract() == 0.0)
                .map(|f| f as u64)
        })
        .ok_or_else(|| format!("{key} {v} is not a whole number of tokens"))?;
    if n == 0 && !zero_ok {
        return Err(format!("{key} is 0"));
    }
    if n > MAX_TOKENS {
        return Err(format!("{key} {n} is absurd (above {MAX_TOKENS} tokens)"));
    }
    Ok(Some(n))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const SEED: &str = r#"{
        "gpu_vram_gb": 8,
        "ram_gb": 16,
        "model_context_kb": 128000,
        "framework_overhead_tokens": 4000,
        "recommended_kb": 16000,
        "recommended_k": 16,
        "headroom": 0.25,
        "max_peak_context_kb": 12000
    }"#;

    #[test]
    fn vram_detect_json_of_seed_002_parses_whole() {
        let r = parse(SEED.as_bytes()).unwrap();
        assert_eq!(
            r,
            Report {
                recommended_kb: 16_000,
                headroom: Some(0.25),
                max_peak_context_kb: Some(12_000),
                model_context_kb: Some(128_000),
                framework_overhead_tokens: Some(4000),
                gpu_vram_gb: Some(8.0),
                ram_gb: Some(16.0),
                ignored: vec![],
            }
        );
        let r = parse(b"\n{\"recommended_kb\": 16000.0}\n").unwrap();
        assert_eq!((r.recommended_kb, r.headroom), (16_000, None));
    }

    #[test]
    fn vram_detect_json_unusable_says_why_in_one_line() {
        for (out, want) in [
            ("", "printed nothing"),
            ("GPU busy", "printed no JSON"),
            ("[1,2]", "not an object"),
            (r#"{"headroom": 0.25}"#, "gave no recommended_kb"),
            (r#"{"recommended_kb": 0}"#, "recommended_kb is 0"),
            (r#"{"recommended_kb": -5}"#, "not a whole number"),
            (r#"{"recommended_kb": "16k"}"#, "not a whole number"),
            (r#"{"recommended_kb": 1e12}"#, "absurd"),
            (
                r#"{"recommended_kb": 16000, "headroom": 25}"#,
                "headroom 25",
            ),
            (
                r#"{"recommended_kb": 16000, "max_peak_context_kb": 20000}"#,
                "above recommended_kb",
            ),
            (
                r#"{"recommended_kb": 16000, "model_context_kb": 8000}"#,
                "above model_context_kb",
            ),
        ] {
            let e = parse(out.as_bytes()).unwrap_err();
            assert!(e.contains(want) && !e.contains('\n'), "{out:?}: {e}");
        }
        let r = parse(br#"{"recommended_kb": 16000, "gpu_vram_gb": "lots"}"#).unwrap();
        assert_eq!(r.gpu_vram_gb, None);
        assert_eq!(r.ignored.len(), 1, "{:?}", r.ignored);
    }

    #[test]
    fn reading_stops_at_the_cap_and_says_so_only_where_asked() {
        let over = AtomicBool::new(false);
        let got = read_up_to(&[7u8; 100][..], 10, Some(&over));
        assert_eq!((got.len(), over.load(Ordering::Relaxed)), (10, true));
        let over = AtomicBool::new(false);
        assert_eq!(read_up_to(&[7u8; 10][..], 10, Some(&over)).len(), 10);
        assert!(!over.load(Ordering::Relaxed));
        assert_eq!(read_up_to(&[7u8; 100][..], 10, None).len(), 10);
    }
}
