//! What this machine can hold: GPUs (NVML, or `--simulate-gpu` fakes), RAM and CPUs
//! (sysinfo), the model's context window (flags, `vram_detect.sh`, the model server, seed
//! 002's name table for a model named by a flag, config.md, `.agent.md`, `.env` or
//! `config.yaml`, 128k) and the token budget derived from them (the operator's
//! `vram_detect.sh` first, else VRAM physics when the model's shape is known, else seed 002's
//! heuristics; `config.md` overrides on top).
//!
//! The types here are what the session registers with the coordinator; how each value is
//! found lives in the submodules.

pub mod budget;
pub mod cache;
pub mod config;
pub mod context;
pub mod files;
pub mod gpu;
pub mod http;
pub mod model_name;
pub mod script;

use std::collections::BTreeMap;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use gpu::{GIB, GpuSource};

/// What can go wrong inside the probe's steps; each step turns it into a reason and moves on.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(
        "--simulate-gpu {0:?}: expected NAME:SIZE, e.g. sim-a:24GiB (SIZE in GiB, GB, MiB or MB)"
    )]
    SimulatedGpu(String),
    #[error("model server {url:?}: {why}")]
    Url { url: String, why: String },
    #[error("timed out after {}s", .0.as_secs_f32())]
    TimedOut(Duration),
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("bad HTTP answer: {0}")]
    Http(String),
    #[error("--model-config {path}: {why}")]
    ModelConfig { path: PathBuf, why: String },
}

/// One GPU as NVML (or `--simulate-gpu`) reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub total_bytes: u64,
    /// Free now: a GPU already holding someone's model server has less to give.
    pub free_bytes: u64,
    pub driver: String,
}

/// Seed 002's budget fields, with its names and units (the `_kb` fields are raw token
/// counts: `recommended_kb: 16000` is 16k tokens), and where each came from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    pub model_context_kb: u64,
    pub framework_overhead_tokens: u64,
    pub recommended_kb: u64,
    pub recommended_k: u64,
    pub headroom: f64,
    pub max_peak_context_kb: u64,
    /// Where the budget came from, one line (e.g. `vram-physics: llama, 24.0 GiB free`).
    pub source: String,
    /// Where the context window came from, and why earlier steps fell through.
    pub context_source: String,
    /// The `num_ctx` every request to the model server must send (Ollama), if any.
    pub num_ctx: Option<u64>,
    /// `false` when `config.md` says `Auto-detect: No` and its values are used.
    pub auto_detect: bool,
    /// 2 × layers × KV heads × head dim × bytes per element, when the shape is known.
    #[serde(default)]
    pub kv_bytes_per_token: Option<u64>,
}

/// Everything the worker knows about its machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Probe {
    pub host: String,
    pub gpus: Vec<Gpu>,
    /// Why no GPU was found (no NVIDIA library, no device), when none was.
    pub gpu_note: Option<String>,
    /// The GPUs are `--simulate-gpu` fakes.
    pub simulated: bool,
    pub ram_bytes: u64,
    pub cpus: u32,
    pub budget: Budget,
    /// The model name, from `--model`, config.md's `Model:`, `.agent.md`, `.env`,
    /// `config.yaml` or the Ollama server.
    #[serde(default)]
    pub model: Option<String>,
    /// What `vram_detect.sh` reported, when its output was used.
    #[serde(default)]
    pub vram_detect: Option<script::Report>,
    /// Where each value came from (`gpu`, `ram`, `context`, `budget`, `config`, `cache`, …).
    #[serde(default)]
    pub sources: BTreeMap<String, String>,
}

/// The flags that decide what the probe finds (shared by `probe` and the session).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DetectArgs {
    /// Replace NVML with a fake GPU, e.g. `sim-a:24GiB` (repeatable). Every report and
    /// registration says the GPUs are simulated.
    #[arg(long = "simulate-gpu", value_name = "NAME:SIZE", value_parser = gpu::validate_simulated)]
    pub simulate_gpu: Vec<String>,
    /// The model's context window in tokens; skips every other detection step.
    #[arg(long, value_name = "TOKENS")]
    pub context_window: Option<u64>,
    /// The model server the agent uses (plain http): vLLM, llama.cpp or Ollama.
    #[arg(long, value_name = "URL")]
    pub model_server: Option<String>,
    /// The model's name (seed 002's table; the model to ask Ollama about).
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// A Hugging Face config.json: the model's shape for VRAM physics.
    #[arg(long, value_name = "PATH")]
    pub model_config: Option<PathBuf>,
    /// Transformer layers (overrides config.json's num_hidden_layers).
    #[arg(long, value_name = "N")]
    pub layers: Option<u64>,
    /// KV heads (overrides config.json's num_key_value_heads).
    #[arg(long, value_name = "N")]
    pub kv_heads: Option<u64>,
    /// Head dimension (overrides config.json's head_dim).
    #[arg(long, value_name = "N")]
    pub head_dim: Option<u64>,
    /// Bytes per KV-cache element: 2 for bf16/fp16, 1 for fp8 (default: config.json's dtype, else 2).
    #[arg(long, value_name = "N")]
    pub kv_bytes_per_element: Option<u64>,
    /// The weights' size in GiB as loaded (quantised weights are smaller than config.json says).
    #[arg(long, value_name = "GIB")]
    pub weights_gib: Option<f64>,
    /// VRAM the model server needs besides weights and KV cache (default 1.5 GiB).
    #[arg(long, value_name = "GIB")]
    pub runtime_reserve_gib: Option<f64>,
    /// Tokens the agent framework itself uses (default 4000).
    #[arg(long, value_name = "TOKENS")]
    pub framework_overhead_tokens: Option<u64>,
    /// Headroom below the recommended budget for a sub-task's peak: `25%` or `0.25` (default).
    #[arg(long, value_name = "PERCENT", value_parser = parse_headroom)]
    pub headroom: Option<f64>,
    /// The project whose `.automaton/config.md` (else `~/.automaton/config.md`) and cache to use.
    #[arg(long, value_name = "DIR")]
    pub project: Option<PathBuf>,
    /// Ignore `.vram_cache.json` and probe again.
    #[arg(long)]
    pub refresh: bool,
}

fn parse_headroom(s: &str) -> Result<f64, String> {
    config::percent(s)
        .ok_or_else(|| format!("{s:?}: expected a percentage below 100, e.g. 25% or 0.25"))
}

fn home() -> Option<PathBuf> {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown".into())
}

/// Total RAM and logical CPUs through sysinfo, with where they came from.
fn ram_and_cpus() -> (u64, u32, String) {
    use sysinfo::{CpuRefreshKind, MemoryRefreshKind, RefreshKind, System};
    let kind = RefreshKind::nothing()
        .with_memory(MemoryRefreshKind::nothing().with_ram())
        .with_cpu(CpuRefreshKind::nothing());
    let fallback_cpus = || {
        std::thread::available_parallelism()
            .map(|n| u32::try_from(n.get()).unwrap_or(u32::MAX))
            .unwrap_or(1)
    };
    match System::new_with_specifics(kind) {
        Ok(s) => {
            let cpus = match u32::try_from(s.cpus().len()) {
                Ok(0) | Err(_) => fallback_cpus(),
                Ok(n) => n,
            };
            (s.total_memory(), cpus, "sysinfo".into())
        }
        Err(e) => (
            0,
            fallback_cpus(),
            format!("sysinfo failed ({e}); RAM unknown"),
        ),
    }
}

/// Where config.md, `vram_detect.sh`, the model-name files and the cache live: `--project` →
/// the project's layered lookup; otherwise `~/.automaton`.
struct Places {
    config: Option<PathBuf>,
    cache: Option<PathBuf>,
    tasks: Vec<PathBuf>,
    script: Option<files::Found>,
    /// Where `vram_detect.sh` runs: the project's root, else `~/.automaton`.
    cwd: Option<PathBuf>,
    /// Where a model name is looked for after `--model` and config.md, in order.
    model_files: Vec<model_name::Place>,
    /// `--project` was given.
    project: bool,
}

fn places(args: &DetectArgs, home: Option<&Path>) -> Places {
    match &args.project {
        Some(dir) => {
            let p = automaton_store::Project::open(dir, home);
            // The project's own layer comes with its repository: run through no link (the
            // store's rule), unless the project is ~/.automaton itself.
            let script = p.layered(script::RELATIVE).map(|s| {
                if p.meta() != p.root() && s.starts_with(p.meta()) {
                    files::Found::projects(s, p.meta())
                } else {
                    files::Found::users(s)
                }
            });
            Places {
                config: p.layered("config.md"),
                cache: Some(p.meta().join(cache::FILE)),
                // The store keeps tasks in `.automaton/tasks`; seed 002 speaks of `{project}/tasks`.
                tasks: vec![p.tasks_dir().to_path_buf(), p.root().join("tasks")],
                script,
                cwd: Some(p.root().to_path_buf()),
                model_files: model_name::project_places(&p),
                project: true,
            }
        }
        None => {
            let meta = home.map(|h| h.join(".automaton"));
            let mine = |rel: &str| {
                meta.as_ref()
                    .map(|m| m.join(rel))
                    .filter(|p| p.exists())
                    .map(files::Found::users)
            };
            Places {
                config: meta
                    .as_ref()
                    .map(|m| m.join("config.md"))
                    .filter(|p| p.exists()),
                cache: meta.as_ref().map(|m| m.join(cache::FILE)),
                tasks: Vec::new(),
                script: mine(script::RELATIVE),
                cwd: meta.clone().filter(|m| m.is_dir()),
                model_files: mine(".agent.md")
                    .map(|file| model_name::Place {
                        file,
                        kind: model_name::Kind::AgentMd,
                    })
                    .into_iter()
                    .collect(),
                project: false,
            }
        }
    }
}

/// `found`: what else decides the probe without being a flag — which `vram_detect.sh` (its
/// path, size, mtime and bytes: an edited script runs again) and the model name found in the
/// project's files.
fn cache_key(args: &DetectArgs, gpus: &[Gpu], config_text: &str, found: &str) -> String {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut a = args.clone();
    a.refresh = false;
    format!("{a:?}").hash(&mut h);
    for g in gpus {
        (&g.uuid, g.total_bytes).hash(&mut h);
    }
    config_text.hash(&mut h);
    found.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// The model's name and where it came from: `--model`, config.md's `Model:`, then the files
/// (seed 002: "after config.md"); the files are not read when a flag or config.md names it.
fn model_of(args: &DetectArgs, cfg: &config::ConfigMd, places: &Places) -> model_name::Lookup {
    let named = args
        .model
        .as_ref()
        .map(|m| (m.clone(), "--model".to_string()))
        .or_else(|| {
            cfg.model
                .as_ref()
                .map(|m| (m.clone(), "config.md Model".to_string()))
        });
    match named {
        Some(m) => model_name::Lookup {
            model: Some(m),
            notes: Vec::new(),
        },
        None => model_name::find(&places.model_files),
    }
}

/// Probes the machine. Never fails: whatever cannot be found is reported with the reason.
pub fn detect(args: &DetectArgs) -> Probe {
    let home = home();
    let mut sources = BTreeMap::new();

    // GPUs first: their set is part of the cache key.
    let (source, sims): (Box<dyn GpuSource>, bool) = if args.simulate_gpu.is_empty() {
        (Box::new(gpu::NvmlSource), false)
    } else {
        let mut fakes = Vec::new();
        for s in &args.simulate_gpu {
            match gpu::parse_simulated(s) {
                Ok(f) => fakes.push(f),
                Err(e) => {
                    sources.insert("gpu_warning".to_string(), e.to_string());
                }
            }
        }
        (Box::new(gpu::Simulated(fakes)), true)
    };
    let (gpus, gpu_note) = match source.gpus() {
        Ok(g) if g.is_empty() => (g, Some("no GPU given".to_string())),
        Ok(g) => (g, None),
        Err(why) => (Vec::new(), Some(why)),
    };
    sources.insert(
        "gpu".into(),
        match &gpu_note {
            Some(n) => format!("none: {n}"),
            None => source.label().to_string(),
        },
    );

    let places = places(args, home.as_deref());
    let config_text = places
        .config
        .as_deref()
        .and_then(config::read_capped)
        .unwrap_or_default();
    let cfg = config::parse(&config_text);
    let model = model_of(args, &cfg, &places);
    let found = format!(
        "script {} | model {:?} {:?}",
        places
            .script
            .as_ref()
            .map(script::identity)
            .unwrap_or_default(),
        model.model,
        model.notes
    );
    let key = cache_key(args, &gpus, &config_text, &found);
    if let Some(path) = &places.cache {
        if args.refresh {
            sources.insert("cache".into(), "bypassed (--refresh)".into());
        } else {
            match cache::load(path, &key, &places.tasks) {
                Ok(mut p) => {
                    p.sources.insert(
                        "cache".into(),
                        format!("reused {} (same inputs)", path.display()),
                    );
                    return p;
                }
                Err(why) => {
                    sources.insert("cache".into(), format!("{}: {why}", path.display()));
                }
            }
        }
    } else {
        sources.insert("cache".into(), "none (no HOME and no --project)".into());
    }

    let mut probe = fresh(
        args,
        GpuSet {
            gpus,
            gpu_note,
            simulated: sims,
        },
        &places,
        &cfg,
        &model,
        sources,
    );
    if let Some(path) = &places.cache {
        let note = match cache::store(path, &key, &probe) {
            Ok(()) => "; written".to_string(),
            Err(e) => format!("; not written ({e})"),
        };
        if let Some(c) = probe.sources.get_mut("cache") {
            c.push_str(&note);
        }
    }
    probe
}

/// The GPUs found before the cache was asked.
struct GpuSet {
    gpus: Vec<Gpu>,
    gpu_note: Option<String>,
    simulated: bool,
}

/// seed 002's priority 1: the operator's `vram_detect.sh`, unless config.md's
/// `Auto-detect: No` (with a valid target) says to use its values instead. The line says
/// which script and whether it was used or why not.
fn run_script(places: &Places, cfg: &config::ConfigMd) -> (Option<script::Report>, String) {
    let Some(f) = &places.script else {
        let line = if places.project {
            "none: no .automaton/scripts/vram_detect.sh in the project or ~/.automaton; built-in probe"
        } else {
            "none: no ~/.automaton/scripts/vram_detect.sh; built-in probe"
        };
        return (None, line.into());
    };
    let name = format!("vram_detect.sh ({})", f.path.display());
    if cfg.auto_detect == Some(false) && cfg.target_context.is_some() {
        return (None, format!("{name}: not run (config.md Auto-detect: No)"));
    }
    match script::run(f, places.cwd.as_deref()) {
        Ok(r) => (Some(r), format!("{name}: used")),
        Err(why) => (
            None,
            format!("{name}: {why}, fell back to the built-in probe"),
        ),
    }
}

fn fresh(
    args: &DetectArgs,
    found: GpuSet,
    places: &Places,
    cfg: &config::ConfigMd,
    model: &model_name::Lookup,
    mut sources: BTreeMap<String, String>,
) -> Probe {
    let GpuSet {
        gpus,
        gpu_note,
        simulated,
    } = found;
    let (ram_bytes, cpus, ram_src) = ram_and_cpus();
    sources.insert("ram".into(), ram_src.clone());
    sources.insert("cpus".into(), ram_src);
    sources.insert(
        "host".into(),
        "/proc/sys/kernel/hostname, else $HOSTNAME".into(),
    );

    let mut config_notes = match &places.config {
        Some(p) => vec![format!("{}", p.display())],
        None => vec!["no config.md".to_string()],
    };
    config_notes.extend(cfg.warnings.iter().cloned());

    // The model's shape: config.json, then flags on top.
    let mut shape = None;
    if let Some(path) = &args.model_config {
        match budget::shape_from_config(path) {
            Ok(s) => shape = Some(s),
            Err(e) => {
                sources.insert("model_config".into(), format!("ignored: {e}"));
            }
        }
    }
    match (&mut shape, args.layers, args.kv_heads, args.head_dim) {
        (Some(s), l, k, d) => {
            let before = s.kv_bytes_per_token();
            s.layers = l.unwrap_or(s.layers);
            s.kv_heads = k.unwrap_or(s.kv_heads);
            s.head_dim = d.unwrap_or(s.head_dim);
            s.bytes_per_element = args.kv_bytes_per_element.unwrap_or(s.bytes_per_element);
            if s.kv_bytes_per_token() != before {
                s.note.push_str(" (flags override)");
            }
        }
        (None, Some(layers), Some(kv_heads), Some(head_dim)) => {
            let bytes_per_element = args.kv_bytes_per_element.unwrap_or(2);
            shape = Some(budget::Shape {
                layers,
                kv_heads,
                head_dim,
                bytes_per_element,
                max_position: None,
                estimated_weights: None,
                note: format!(
                    "flags: {layers} layers × {kv_heads} KV heads × head dim {head_dim} × {bytes_per_element} B"
                ),
            });
        }
        (None, None, None, None) => {}
        (None, ..) => {
            sources.insert(
                "model_config".into(),
                "ignored: --layers, --kv-heads and --head-dim are needed together".into(),
            );
        }
    }
    if let Some(s) = &shape {
        sources.insert("model_shape".into(), s.note.clone());
    }

    let (report, script_line) = run_script(places, cfg);
    sources.insert("vram_detect".into(), script_line.clone());
    if let Some(r) = &report
        && !r.ignored.is_empty()
    {
        sources.insert("vram_detect_warning".into(), r.ignored.join("; "));
    }
    if let Some((m, from)) = &model.model {
        sources.insert("model".into(), format!("{m} ({from})"));
    }
    if !model.notes.is_empty() {
        sources.insert("model_files".into(), model.notes.join("; "));
    }
    let model: Option<(&str, &str)> = model
        .model
        .as_ref()
        .map(|(m, from)| (m.as_str(), from.as_str()));
    let script_name = script_line.trim_end_matches(": used");
    let ctx = context::detect(&context::Inputs {
        flag: args.context_window,
        config_override: cfg.context_window,
        script: report
            .as_ref()
            .and_then(|r| r.model_context_kb)
            .map(|n| (n, script_name.to_string())),
        server: args.model_server.as_deref(),
        max_position: shape
            .as_ref()
            .and_then(|s| s.max_position)
            .map(|n| (n, "--model-config".to_string())),
        model,
    });
    sources.insert("context".into(), ctx.source.clone());

    // The script's own values, where it gives them, over the flags' defaults: its
    // recommended and max peak were computed with them.
    let overhead = report
        .as_ref()
        .and_then(|r| r.framework_overhead_tokens)
        .or(args.framework_overhead_tokens)
        .unwrap_or(budget::DEFAULT_OVERHEAD_TOKENS);
    let headroom = report
        .as_ref()
        .and_then(|r| r.headroom)
        .or(args.headroom)
        .unwrap_or(budget::DEFAULT_HEADROOM);
    let weights = match (args.weights_gib, shape.as_ref().and_then(|s| s.estimated_weights)) {
        (Some(g), _) if g.is_finite() && g >= 0.0 => {
            Some(((g * GIB as f64) as u64, "--weights-gib".to_string()))
        }
        (_, Some(w)) => Some((
            w,
            "estimated from config.json as dense weights in torch_dtype; pass --weights-gib for quantised".into(),
        )),
        _ => None,
    };
    let reserve = args
        .runtime_reserve_gib
        .filter(|r| r.is_finite() && *r >= 0.0)
        .unwrap_or(budget::DEFAULT_RESERVE_GIB);
    let free: u64 = gpus.iter().map(|g| g.free_bytes).sum();
    let computed = match &report {
        Some(r) => from_script(r, script_name, ctx.window, headroom),
        None => budget::compute(&budget::Inputs {
            context_window: ctx.window,
            overhead,
            headroom,
            free_bytes: (!gpus.is_empty()).then_some(free),
            shape: shape.clone(),
            weights,
            reserve_bytes: (reserve * GIB as f64) as u64,
        }),
    };
    let mut b = Budget {
        model_context_kb: ctx.window,
        framework_overhead_tokens: overhead,
        recommended_kb: computed.recommended,
        recommended_k: computed.recommended / 1000,
        headroom,
        max_peak_context_kb: computed.max_peak,
        source: computed.source,
        context_source: ctx.source,
        num_ctx: None,
        auto_detect: true,
        kv_bytes_per_token: shape.as_ref().map(budget::Shape::kv_bytes_per_token),
    };

    // seed 002's manual override.
    if let Some(warning) = apply_manual(&mut b, cfg) {
        config_notes.push(warning);
    }

    let mut model_name = model.map(|m| m.0.to_string());
    if let Some(o) = &ctx.ollama {
        let cap = o.trained_max.unwrap_or(ctx.window);
        b.num_ctx = ollama_num_ctx(b.recommended_kb, cap);
        if let Some(n) = b.num_ctx {
            sources.insert(
                "num_ctx".into(),
                format!("Ollama: every request must send num_ctx {n} (the budget, capped by the trained maximum {cap}), else Ollama truncates to its own default"),
            );
        }
        model_name = model_name.or_else(|| Some(o.model.clone()));
    }
    sources.insert("budget".into(), b.source.clone());
    sources.insert("config".into(), config_notes.join("; "));

    Probe {
        host: hostname(),
        gpus,
        gpu_note,
        simulated,
        ram_bytes,
        cpus,
        budget: b,
        model: model_name,
        vram_detect: report,
        sources,
    }
}

/// The budget as `vram_detect.sh` gave it; a recommendation above the model's window (from
/// a flag or config.md, the script's own was checked) is capped at it, saying so.
fn from_script(r: &script::Report, name: &str, window: u64, headroom: f64) -> budget::Computed {
    let mut recommended = r.recommended_kb;
    let mut note = String::new();
    if recommended > window {
        note = format!(", capped at the window {window}");
        recommended = window;
    }
    let max_peak = r
        .max_peak_context_kb
        .filter(|m| *m <= recommended)
        .unwrap_or_else(|| budget::max_peak(recommended, headroom));
    budget::Computed {
        recommended,
        max_peak,
        source: format!(
            "{name}: used: recommended_kb {}, headroom {headroom}, max_peak_context_kb {max_peak}{note}",
            r.recommended_kb
        ),
        label: "vram_detect.sh".into(),
    }
}

/// seed 002's `Auto-detect: No`: config.md's Target context, Headroom and Max peak replace
/// the detected values. A warning when it says No but gives no usable target.
fn apply_manual(b: &mut Budget, cfg: &config::ConfigMd) -> Option<String> {
    if cfg.auto_detect != Some(false) {
        return None;
    }
    let Some(t) = cfg.target_context else {
        return Some(
            "config.md: Auto-detect: No without a valid Target context; detected values used"
                .into(),
        );
    };
    b.auto_detect = false;
    b.recommended_kb = t;
    b.recommended_k = t / 1000;
    b.headroom = cfg.headroom.unwrap_or(b.headroom);
    b.max_peak_context_kb = cfg
        .max_peak
        .unwrap_or_else(|| budget::max_peak(t, b.headroom));
    b.source = format!(
        "manual override: config.md Auto-detect: No (detected: {})",
        b.source
    );
    None
}

/// Ollama silently truncates every request to its own default window (by VRAM: 4k below
/// 24 GiB) unless the request sends `num_ctx`: send the budget, capped by the trained maximum.
fn ollama_num_ctx(recommended: u64, trained_max: u64) -> Option<u64> {
    Some(recommended.min(trained_max)).filter(|n| *n > 0)
}

/// The Recommended line's basis, from the budget's source.
fn basis(source: &str) -> &'static str {
    if source.starts_with("vram-physics") {
        "VRAM physics"
    } else if source.starts_with("vram_detect.sh") {
        "vram_detect.sh"
    } else if source.starts_with("heuristic") {
        "GPU VRAM-based"
    } else if source.starts_with("manual override") {
        "manual override: config.md"
    } else {
        "fallback, no GPU"
    }
}

fn gb(bytes: u64) -> f64 {
    (bytes as f64 / GIB as f64 * 10.0).round() / 10.0
}

fn gb_text(bytes: u64) -> String {
    let g = gb(bytes);
    if g.fract() == 0.0 {
        format!("{g:.0}GB")
    } else {
        format!("{g:.1}GB")
    }
}

fn k_text(tokens: u64) -> String {
    if tokens.is_multiple_of(1000) {
        format!("{}k", tokens / 1000)
    } else {
        format!("{:.1}k", tokens as f64 / 1000.0)
    }
}

/// `--json`: seed 002's fields at the top level (GiB for `_gb`, tokens for `_kb`), plus detail.
pub fn to_json(p: &Probe) -> serde_json::Value {
    let b = &p.budget;
    let total: u64 = p.gpus.iter().map(|g| g.total_bytes).sum();
    let free: u64 = p.gpus.iter().map(|g| g.free_bytes).sum();
    serde_json::json!({
        "gpu_vram_gb": gb(total),
        "gpu_free_vram_gb": gb(free),
        "ram_gb": gb(p.ram_bytes),
        "ram_bytes": p.ram_bytes,
        "model_context_kb": b.model_context_kb,
        "framework_overhead_tokens": b.framework_overhead_tokens,
        "recommended_kb": b.recommended_kb,
        "recommended_k": b.recommended_k,
        "headroom": b.headroom,
        "max_peak_context_kb": b.max_peak_context_kb,
        "num_ctx": b.num_ctx,
        "auto_detect": b.auto_detect,
        "kv_bytes_per_token": b.kv_bytes_per_token,
        "model": p.model,
        "vram_detect": p.vram_detect,
        "gpus": p.gpus,
        "gpu_note": p.gpu_note,
        "simulated": p.simulated,
        "cpus": p.cpus,
        "host": p.host,
        "sources": p.sources,
    })
}

/// seed 002's "VRAM Detection Results" block, plus a line per GPU and the peak.
pub fn to_text(p: &Probe) -> String {
    let b = &p.budget;
    let mut out = String::from("VRAM Detection Results:\n");
    let total: u64 = p.gpus.iter().map(|g| g.total_bytes).sum();
    let via = if p.simulated { "simulated" } else { "NVML" };
    match &p.gpu_note {
        Some(why) if p.gpus.is_empty() => out.push_str(&format!("- GPU VRAM: None ({why})\n")),
        _ => out.push_str(&format!("- GPU VRAM: {} ({via})\n", gb_text(total))),
    }
    for g in &p.gpus {
        out.push_str(&format!(
            "  - GPU {}: {} {}, {} free, {}, driver {}{}\n",
            g.index,
            g.name,
            gb_text(g.total_bytes),
            gb_text(g.free_bytes),
            g.uuid,
            g.driver,
            if p.simulated { " (simulated)" } else { "" }
        ));
    }
    out.push_str(&format!("- RAM: {}\n", gb_text(p.ram_bytes)));
    if let Some(r) = p
        .vram_detect
        .as_ref()
        .filter(|r| r.gpu_vram_gb.is_some() || r.ram_gb.is_some())
    {
        let gib = |g: Option<f64>| g.map_or("?".to_string(), |g| gb_text((g * GIB as f64) as u64));
        out.push_str(&format!(
            "- vram_detect.sh: GPU VRAM {}, RAM {}\n",
            gib(r.gpu_vram_gb),
            gib(r.ram_gb)
        ));
    }
    out.push_str(&format!(
        "- Model context window: {} ({})\n",
        k_text(b.model_context_kb),
        b.context_source
    ));
    out.push_str(&format!(
        "- Framework overhead: ~{} tokens\n",
        k_text(b.framework_overhead_tokens)
    ));
    let label = basis(&b.source);
    out.push_str(&format!(
        "- **Recommended: {} tokens** ({label}, {}% headroom)\n",
        k_text(b.recommended_kb),
        (b.headroom * 100.0).round()
    ));
    out.push_str(&format!(
        "- **Using: {} tokens** ({})\n",
        k_text(b.recommended_kb),
        if b.auto_detect {
            "auto-detected"
        } else {
            "manual override: config.md"
        }
    ));
    out.push_str(&format!(
        "- Max peak context per sub-task: {} tokens\n",
        k_text(b.max_peak_context_kb)
    ));
    if let Some(n) = b.num_ctx {
        out.push_str(&format!(
            "- num_ctx every request must send: {n} (Ollama)\n"
        ));
    }
    out.push_str(&format!("- Budget source: {}\n", b.source));
    out.push_str(&format!("- Host: {}, CPUs: {}\n", p.host, p.cpus));
    if p.simulated {
        out.push_str("- Simulated: yes (--simulate-gpu; no real GPU was asked)\n");
    }
    out
}

/// `automaton-worker probe`: prints the probe (seed 002's block, or JSON).
pub fn run(args: &DetectArgs, json: bool) -> anyhow::Result<()> {
    let p = detect(args);
    if json {
        println!("{}", serde_json::to_string_pretty(&to_json(&p))?);
    } else {
        print!("{}", to_text(&p));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> Probe {
        Probe {
            host: "h".into(),
            gpus: vec![Gpu {
                index: 0,
                name: "sim-a".into(),
                uuid: "SIM-sim-a".into(),
                total_bytes: 8 * GIB,
                free_bytes: 8 * GIB,
                driver: "simulated".into(),
            }],
            gpu_note: None,
            simulated: true,
            ram_bytes: 16 * GIB,
            cpus: 4,
            budget: Budget {
                model_context_kb: 128_000,
                framework_overhead_tokens: 4000,
                recommended_kb: 16_000,
                recommended_k: 16,
                headroom: 0.25,
                max_peak_context_kb: 12_000,
                source: "heuristic".into(),
                context_source: "fell through to 128k default".into(),
                num_ctx: None,
                auto_detect: true,
                kv_bytes_per_token: None,
            },
            model: None,
            vram_detect: None,
            sources: BTreeMap::new(),
        }
    }

    #[test]
    fn text_block_has_seed_002s_shape() {
        let t = to_text(&sample());
        let want = [
            "VRAM Detection Results:",
            "- GPU VRAM: 8GB (simulated)",
            "- RAM: 16GB",
            "- Model context window: 128k (fell through to 128k default)",
            "- Framework overhead: ~4k tokens",
            "- **Recommended: 16k tokens** (GPU VRAM-based, 25% headroom)",
            "- **Using: 16k tokens** (auto-detected)",
            "- Max peak context per sub-task: 12k tokens",
        ];
        for w in want {
            assert!(t.contains(w), "missing {w:?} in\n{t}");
        }
        assert!(t.starts_with("VRAM Detection Results:\n- GPU VRAM:"), "{t}");
    }

    #[test]
    fn json_has_seed_002s_fields_at_the_top_level() {
        let j = to_json(&sample());
        assert_eq!(j["gpu_vram_gb"], 8.0);
        assert_eq!(j["ram_gb"], 16.0);
        assert_eq!(j["recommended_kb"], 16_000);
        assert_eq!(j["recommended_k"], 16);
        assert_eq!(j["max_peak_context_kb"], 12_000);
        assert_eq!(j["model_context_kb"], 128_000);
        assert_eq!(j["framework_overhead_tokens"], 4000);
        assert_eq!(j["headroom"], 0.25);
        assert_eq!(j["simulated"], true);
    }

    #[test]
    fn config_md_auto_detect_no_replaces_the_detected_budget() {
        let mut b = sample().budget;
        let cfg = config::parse(
            "## VRAM Configuration\n- **Auto-detect**: No\n- **Target context**: 20k tokens\n- **Headroom**: 10%\n",
        );
        assert_eq!(apply_manual(&mut b, &cfg), None);
        assert_eq!(
            (b.recommended_kb, b.recommended_k, b.max_peak_context_kb),
            (20_000, 20, 18_000)
        );
        assert_eq!((b.headroom, b.auto_detect), (0.1, false));
        assert!(
            to_text(&Probe {
                budget: b,
                ..sample()
            })
            .contains("**Using: 20k tokens** (manual override: config.md)")
        );
        let mut b = sample().budget;
        let cfg = config::parse("## VRAM Configuration\n- **Auto-detect**: No\n");
        assert!(apply_manual(&mut b, &cfg).is_some());
        assert_eq!((b.recommended_kb, b.auto_detect), (16_000, true));
        let cfg = config::parse(
            "## VRAM Configuration\n- **Auto-detect**: Yes\n- **Target context**: 20k tokens\n",
        );
        assert_eq!(apply_manual(&mut b, &cfg), None);
        assert_eq!(b.recommended_kb, 16_000);
    }

    #[test]
    fn ollama_num_ctx_is_the_budget_capped_by_the_trained_maximum() {
        assert_eq!(ollama_num_ctx(61_787, 131_072), Some(61_787));
        assert_eq!(ollama_num_ctx(200_000, 131_072), Some(131_072));
        assert_eq!(ollama_num_ctx(0, 131_072), None);
    }

    #[test]
    fn cache_key_changes_with_flags_gpus_and_config_but_not_refresh() {
        let a = DetectArgs::default();
        let g = sample().gpus;
        let k = cache_key(&a, &g, "", "");
        assert_eq!(
            k,
            cache_key(
                &DetectArgs {
                    refresh: true,
                    ..a.clone()
                },
                &g,
                "",
                ""
            )
        );
        assert_ne!(
            k,
            cache_key(
                &DetectArgs {
                    context_window: Some(1),
                    ..a.clone()
                },
                &g,
                "",
                ""
            )
        );
        assert_ne!(k, cache_key(&a, &[], "", ""));
        assert_ne!(k, cache_key(&a, &g, "## VRAM Configuration", ""));
        // Another vram_detect.sh (or the same edited), another model line: not the same.
        assert_ne!(
            k,
            cache_key(&a, &g, "", "script /p/vram_detect.sh 10 1 755 ab")
        );
    }
}
