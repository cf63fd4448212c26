//! The token budget: VRAM physics when the model's shape and weights are known, seed 002's
//! heuristics otherwise. Pure arithmetic; the caller gathers the inputs.

use std::path::Path;

use serde_json::Value;

use super::ProbeError;
use super::gpu::GIB;

/// seed 002: with a GPU, 2k tokens per GB of VRAM (8 GB → 16k).
pub const TOKENS_PER_GIB: u64 = 2000;
/// seed 002's fallback without a GPU.
pub const NO_GPU_TOKENS: u64 = 8000;
pub const DEFAULT_HEADROOM: f64 = 0.25;
pub const DEFAULT_OVERHEAD_TOKENS: u64 = 4000;
pub const DEFAULT_RESERVE_GIB: f64 = 1.5;

/// What the KV cache needs per token, and (if known) how big the weights are.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub layers: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub bytes_per_element: u64,
    /// The trained maximum (`max_position_embeddings`), a context-window candidate.
    pub max_position: Option<u64>,
    /// Weights estimated from the config's fields (dense models only), bytes.
    pub estimated_weights: Option<u64>,
    /// What the shape came from and what was assumed, one line.
    pub note: String,
}

impl Shape {
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element
    }
}

fn field(v: &Value, k: &str) -> Option<u64> {
    v.get(k).and_then(Value::as_u64)
}

/// A Hugging Face `config.json` → its KV shape.
pub fn shape_from_config(path: &Path) -> Result<Shape, ProbeError> {
    let bad = |why: String| ProbeError::ModelConfig {
        path: path.to_path_buf(),
        why,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    // Multimodal configs nest the language model.
    let v = v.get("text_config").cloned().unwrap_or(v);
    let need = |k: &str| field(&v, k).ok_or_else(|| bad(format!("no {k}")));
    let layers = need("num_hidden_layers")?;
    let heads = need("num_attention_heads")?;
    let kv_heads = field(&v, "num_key_value_heads").unwrap_or(heads);
    let hidden = field(&v, "hidden_size");
    let head_dim = match field(&v, "head_dim") {
        Some(d) => d,
        None => hidden
            .filter(|_| heads > 0)
            .map(|h| h / heads)
            .ok_or_else(|| bad("no head_dim and no hidden_size".into()))?,
    };
    let mut note = String::new();
    let dtype = v.get("torch_dtype").and_then(Value::as_str).unwrap_or("");
    let bytes_per_element = match dtype {
        "float32" => 4,
        "bfloat16" | "float16" => 2,
        d if d.contains("float8") || d == "int8" => 1,
        _ => {
            note = format!("torch_dtype {dtype:?} unknown, assumed 2 bytes; ");
            2
        }
    };
    let estimated_weights =
        estimate_params(&v, layers, heads, kv_heads, head_dim).map(|p| p * bytes_per_element);
    note.push_str(&format!(
        "{}: {layers} layers × {kv_heads} KV heads × head dim {head_dim} × {bytes_per_element} B",
        path.display()
    ));
    Ok(Shape {
        layers,
        kv_heads,
        head_dim,
        bytes_per_element,
        max_position: field(&v, "max_position_embeddings"),
        estimated_weights,
        note,
    })
}

/// Parameter count of a dense decoder (Llama/Qwen2/Mistral layout) from its config fields;
/// `None` for anything else (mixture-of-experts, missing fields): better to require
/// `--weights-gib` than to guess.
fn estimate_params(
    v: &Value,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
) -> Option<u64> {
    let dense = ["llama", "qwen2", "mistral"];
    let model_type = v.get("model_type").and_then(Value::as_str)?;
    if !dense.contains(&model_type)
        || ["num_local_experts", "num_experts", "n_routed_experts"]
            .iter()
            .any(|k| v.get(k).is_some())
    {
        return None;
    }
    let hidden = field(v, "hidden_size")?;
    let inter = field(v, "intermediate_size")?;
    let vocab = field(v, "vocab_size")?;
    let tied = v
        .get("tie_word_embeddings")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let q = heads * head_dim;
    let kv = kv_heads * head_dim;
    let attn = hidden * q + 2 * hidden * kv + q * hidden;
    // Qwen2 has biases on q, k and v.
    let bias = if model_type == "qwen2" { q + 2 * kv } else { 0 };
    let layer = attn + bias + 3 * hidden * inter + 2 * hidden;
    let embed = vocab * hidden * if tied { 1 } else { 2 };
    Some(layers * layer + embed + hidden)
}

/// What the budget is computed from.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    pub context_window: u64,
    pub overhead: u64,
    pub headroom: f64,
    /// Free bytes summed over the GPUs (tensor parallel); `None` without a GPU.
    pub free_bytes: Option<u64>,
    pub shape: Option<Shape>,
    /// Weights in bytes: `--weights-gib`, else the config's estimate.
    pub weights: Option<(u64, String)>,
    pub reserve_bytes: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Computed {
    pub recommended: u64,
    pub max_peak: u64,
    pub source: String,
    /// Short label for the text block's Recommended line.
    pub label: String,
}

pub fn max_peak(recommended: u64, headroom: f64) -> u64 {
    (recommended as f64 * (1.0 - headroom)).floor() as u64
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / GIB as f64)
}

pub fn compute(i: &Inputs) -> Computed {
    let cap = i.context_window.saturating_sub(i.overhead);
    let capped = |n: u64| n.min(cap);
    let cap_note = |n: u64| {
        if n > cap {
            format!(
                ", capped at window {} − overhead {}",
                i.context_window, i.overhead
            )
        } else {
            String::new()
        }
    };
    let mut why_not_physics = String::new();
    if let (Some(free), Some(shape)) = (i.free_bytes, &i.shape) {
        if let Some((weights, wsrc)) = &i.weights {
            let per_token = shape.kv_bytes_per_token();
            let left = free as i128 - *weights as i128 - i.reserve_bytes as i128;
            if left <= 0 || per_token == 0 {
                return Computed {
                    recommended: 0,
                    max_peak: 0,
                    source: format!(
                        "vram-physics: weights do not fit: {} free − weights {} − reserve {} < 0",
                        gib(free),
                        gib(*weights),
                        gib(i.reserve_bytes)
                    ),
                    label: "VRAM physics: weights do not fit".into(),
                };
            }
            let usable = (left / per_token as i128) as u64;
            let recommended = capped(usable);
            return Computed {
                recommended,
                max_peak: max_peak(recommended, i.headroom),
                source: format!(
                    "vram-physics: ({} free − weights {} [{wsrc}] − reserve {}) ÷ {per_token} B/token = {usable} tokens{}",
                    gib(free),
                    gib(*weights),
                    gib(i.reserve_bytes),
                    cap_note(usable)
                ),
                label: "VRAM physics".into(),
            };
        }
        why_not_physics =
            "; physics skipped: the weights' size is unknown (pass --weights-gib)".into();
    } else if i.shape.is_some() {
        why_not_physics = "; physics skipped: no GPU".into();
    }
    match i.free_bytes {
        Some(free) => {
            let raw = (free as u128 * TOKENS_PER_GIB as u128 / GIB as u128) as u64;
            let recommended = capped(raw);
            Computed {
                recommended,
                max_peak: max_peak(recommended, i.headroom),
                source: format!(
                    "heuristic: 2k tokens per GiB of {} free VRAM = {raw}{}{why_not_physics}",
                    gib(free),
                    cap_note(raw)
                ),
                label: "GPU VRAM-based".into(),
            }
        }
        None => {
            let recommended = capped(NO_GPU_TOKENS);
            Computed {
                recommended,
                max_peak: max_peak(recommended, i.headroom),
                source: format!("fallback: no GPU, seed 002's 8k tokens{why_not_physics}"),
                label: "fallback, no GPU".into(),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Shape {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("src/probe/fixtures")
            .join(name);
        shape_from_config(&p).unwrap()
    }

    fn physics(shape: &Shape, free_gib: u64) -> Computed {
        compute(&Inputs {
            context_window: shape.max_position.unwrap(),
            overhead: DEFAULT_OVERHEAD_TOKENS,
            headroom: DEFAULT_HEADROOM,
            free_bytes: Some(free_gib * GIB),
            shape: Some(shape.clone()),
            weights: shape.estimated_weights.map(|w| (w, "estimated".into())),
            reserve_bytes: (DEFAULT_RESERVE_GIB * GIB as f64) as u64,
        })
    }

    #[test]
    fn kv_bytes_per_token_of_the_three_real_shapes() {
        assert_eq!(
            fixture("llama-3.1-8b.config.json").kv_bytes_per_token(),
            131_072
        );
        assert_eq!(
            fixture("qwen2.5-32b.config.json").kv_bytes_per_token(),
            262_144
        );
        assert_eq!(
            fixture("llama-3.1-70b.config.json").kv_bytes_per_token(),
            327_680
        );
    }

    #[test]
    fn weights_estimated_from_config_match_the_published_sizes() {
        let gb = |n: &str| fixture(n).estimated_weights.unwrap() as f64 / 1e9;
        assert!((gb("llama-3.1-8b.config.json") - 16.06).abs() < 0.1);
        assert!((gb("qwen2.5-32b.config.json") - 65.5).abs() < 0.6);
        assert!((gb("llama-3.1-70b.config.json") - 141.0).abs() < 1.0);
    }

    #[test]
    fn physics_llama_8b_on_24_gib_holds_about_61_8k_tokens() {
        let c = physics(&fixture("llama-3.1-8b.config.json"), 24);
        assert!((61_000..62_500).contains(&c.recommended), "{c:?}");
        assert_eq!(c.max_peak, max_peak(c.recommended, 0.25));
        assert!(c.source.starts_with("vram-physics"), "{}", c.source);
    }

    #[test]
    fn physics_is_capped_by_window_minus_overhead() {
        let c = physics(&fixture("llama-3.1-8b.config.json"), 80);
        assert_eq!(c.recommended, 131_072 - 4000);
        assert!(c.source.contains("capped"), "{}", c.source);
        let c = physics(&fixture("llama-3.1-8b.config.json"), 48);
        assert_eq!(c.recommended, 131_072 - 4000);
    }

    #[test]
    fn physics_qwen_32b_on_80_gib_and_not_on_48() {
        let q = fixture("qwen2.5-32b.config.json");
        let c = physics(&q, 80);
        // (80 − 1.5) GiB − 65.5 GB ≈ 18.8 GB ÷ 256 KiB ≈ 71.6k tokens.
        assert!((70_000..73_500).contains(&c.recommended), "{c:?}");
        let c = physics(&q, 48);
        assert_eq!(c.recommended, 0);
        assert!(c.source.contains("do not fit"), "{}", c.source);
        let c = physics(&q, 24);
        assert_eq!(c.recommended, 0);
    }

    #[test]
    fn physics_llama_70b_bf16_on_80_gib_does_not_fit() {
        let c = physics(&fixture("llama-3.1-70b.config.json"), 80);
        assert_eq!((c.recommended, c.max_peak), (0, 0));
        assert!(c.source.contains("weights do not fit"), "{}", c.source);
    }

    #[test]
    fn heuristic_8_gib_gives_seed_002s_16k_and_12k_peak() {
        let c = compute(&Inputs {
            context_window: 128_000,
            overhead: 4000,
            headroom: 0.25,
            free_bytes: Some(8 * GIB),
            shape: None,
            weights: None,
            reserve_bytes: 0,
        });
        assert_eq!((c.recommended, c.max_peak), (16_000, 12_000));
        assert_eq!(c.label, "GPU VRAM-based");
    }

    #[test]
    fn heuristic_is_capped_by_window_and_no_gpu_falls_back_to_8k() {
        let mut i = Inputs {
            context_window: 32_000,
            overhead: 4000,
            headroom: 0.25,
            free_bytes: Some(80 * GIB),
            shape: None,
            weights: None,
            reserve_bytes: 0,
        };
        assert_eq!(compute(&i).recommended, 28_000);
        i.free_bytes = None;
        i.context_window = 128_000;
        let c = compute(&i);
        assert_eq!((c.recommended, c.max_peak), (8000, 6000));
        assert!(c.source.starts_with("fallback"));
    }

    #[test]
    fn shape_without_weights_says_why_physics_was_skipped() {
        let mut s = fixture("llama-3.1-8b.config.json");
        s.estimated_weights = None;
        let c = compute(&Inputs {
            context_window: 128_000,
            overhead: 4000,
            headroom: 0.25,
            free_bytes: Some(24 * GIB),
            shape: Some(s),
            weights: None,
            reserve_bytes: 0,
        });
        assert!(c.source.contains("--weights-gib"), "{}", c.source);
        assert_eq!(c.recommended, 48_000);
    }

    #[test]
    fn moe_configs_get_no_weights_estimate() {
        let v: Value = serde_json::json!({"model_type": "llama", "num_local_experts": 8,
            "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000});
        assert_eq!(estimate_params(&v, 32, 32, 8, 128), None);
    }
}
