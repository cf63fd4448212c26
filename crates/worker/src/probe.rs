//! What this machine can hold: GPUs (NVML, or `--simulate-gpu` fakes), RAM and CPUs
//! (sysinfo), the model's context window (flags, the model server, seed 002's name table,
//! 128k) and the token budget derived from them (VRAM physics when the model's shape is
//! known, seed 002's heuristics otherwise, `config.md` overrides on top).
//!
//! The types here are what the session registers with the coordinator; how each value is
//! found lives in the submodules.

use serde::Serialize;

/// One GPU as NVML (or `--simulate-gpu`) reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
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
#[derive(Debug, Clone, PartialEq, Serialize)]
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
}

/// Everything the worker knows about its machine.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
}

/// The flags that decide what the probe finds (shared by `probe` and the session).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct DetectArgs {
    /// Replace NVML with a fake GPU, e.g. `sim-a:24GiB` (repeatable). Every report and
    /// registration says the GPUs are simulated.
    #[arg(long = "simulate-gpu", value_name = "NAME:SIZE")]
    pub simulate_gpu: Vec<String>,
}

/// Probes the machine. Never fails: whatever cannot be found is reported with the reason.
pub fn detect(args: &DetectArgs) -> Probe {
    let gpus: Vec<Gpu> = args
        .simulate_gpu
        .iter()
        .enumerate()
        .map(|(i, s)| Gpu {
            index: i as u32,
            name: s.clone(),
            uuid: format!("SIM-{i}"),
            total_bytes: 0,
            free_bytes: 0,
            driver: "simulated".into(),
        })
        .collect();
    Probe {
        host: String::new(),
        simulated: !gpus.is_empty(),
        gpus,
        gpu_note: None,
        ram_bytes: 0,
        cpus: 0,
        budget: Budget {
            model_context_kb: 128_000,
            framework_overhead_tokens: 4000,
            recommended_kb: 8000,
            recommended_k: 8,
            headroom: 0.25,
            max_peak_context_kb: 6000,
            source: "placeholder".into(),
            context_source: "placeholder".into(),
            num_ctx: None,
            auto_detect: true,
        },
    }
}

/// `automaton-worker probe`: prints the probe (seed 002's block, or JSON).
pub fn run(args: &DetectArgs, json: bool) -> anyhow::Result<()> {
    let p = detect(args);
    if json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        println!("{p:?}");
    }
    Ok(())
}
