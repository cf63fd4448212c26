//! The model's context window, first answer wins: `--context-window`, config.md's
//! `Override context window`, `vram_detect.sh`'s `model_context_kb`, the model server (vLLM `/v1/models`, llama.cpp `/props`,
//! Ollama `/api/ps` + `/api/show`), the config.json's `max_position_embeddings`, seed 002's
//! model-name table, then 128k. Every step that falls through says why.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::ProbeError;
use super::http::{self, Url};

/// Each request to the model server gets at most this long.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(2);
/// All requests to the model server together get at most this long.
pub const TOTAL_TIMEOUT: Duration = Duration::from_secs(6);
pub const DEFAULT_WINDOW: u64 = 128_000;

/// seed 002's model-name table.
const TABLE: &[(&str, u64)] = &[
    ("gpt-4o-mini", 128_000),
    ("gpt-4o", 128_000),
    ("gpt-4-turbo", 128_000),
    ("gpt-4", 128_000),
    ("claude-3-5-sonnet", 200_000),
    ("claude-3-5-haiku", 200_000),
    ("claude-3-opus", 200_000),
    ("claude-3-sonnet", 200_000),
    ("claude-3-haiku", 200_000),
    ("claude-2", 200_000),
];

/// seed 002's table: `gpt-4o-2024-08-06` and `openai/gpt-4o` are gpt-4o; `gpt-4.1` is not
/// gpt-4 (a name matches only up to the end or a `-`).
pub fn lookup_name(model: &str) -> Option<(&'static str, u64)> {
    let m = model.trim().to_ascii_lowercase();
    let m = m.rsplit('/').next().unwrap_or("");
    TABLE
        .iter()
        .filter(|(k, _)| {
            m.strip_prefix(k)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('-'))
        })
        .max_by_key(|(k, _)| k.len())
        .copied()
}

/// What Ollama said about the model (for `Budget.num_ctx`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ollama {
    pub model: String,
    /// `model_info.<arch>.context_length`: the trained maximum.
    pub trained_max: Option<u64>,
    /// `/api/ps` `context_length`: the window the loaded model runs with now.
    pub runtime: Option<u64>,
    /// The Modelfile's `num_ctx`.
    pub modelfile_num_ctx: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub window: u64,
    /// Where the window came from, after the reasons earlier steps fell through.
    pub source: String,
    pub ollama: Option<Ollama>,
}

pub struct Inputs<'a> {
    pub flag: Option<u64>,
    pub config_override: Option<u64>,
    /// `vram_detect.sh`'s `model_context_kb`, with where it came from.
    pub script: Option<(u64, String)>,
    pub server: Option<&'a str>,
    pub max_position: Option<(u64, String)>,
    /// `--model`, else config.md's `Model:`, else `.agent.md`, `.env` or `config.yaml`, with
    /// where it came from.
    pub model: Option<(&'a str, &'a str)>,
}

pub fn detect(i: &Inputs) -> Answer {
    let mut fell = Vec::new();
    let done = |window: u64, how: String, fell: Vec<String>, ollama| {
        let mut parts = fell;
        parts.push(how);
        Answer {
            window,
            source: parts.join("; "),
            ollama,
        }
    };
    if let Some(n) = i.flag {
        return done(n, format!("--context-window {n}"), fell, None);
    }
    if let Some(n) = i.config_override {
        return done(
            n,
            format!("config.md Override context window: {n}"),
            fell,
            None,
        );
    }
    if let Some((n, from)) = &i.script {
        return done(*n, format!("{from}: model_context_kb {n}"), fell, None);
    }
    if let Some(server) = i.server {
        match ask_server(server, i.model.map(|m| m.0)) {
            Ok((n, how, ollama)) => {
                // What this server did not answer (e.g. /v1/models before /props) still says
                // which kind of server it is.
                let (how, earlier) = how;
                if !earlier.is_empty() {
                    fell.push(format!("--model-server {server}: {earlier}"));
                }
                return done(n, how, fell, ollama);
            }
            Err(why) => fell.push(format!("--model-server {server}: {why}")),
        }
    }
    if let Some((n, from)) = &i.max_position {
        return done(
            *n,
            format!("{from}: max_position_embeddings {n}"),
            fell,
            None,
        );
    }
    if let Some((model, from)) = i.model {
        match lookup_name(model) {
            Some((key, n)) => {
                return done(
                    n,
                    format!("model-name table: {model} ({from}) is {key}, {}k", n / 1000),
                    fell,
                    None,
                );
            }
            None => fell.push(format!("model-name table: {model} ({from}) not listed")),
        }
    }
    done(
        DEFAULT_WINDOW,
        "fell through to 128k default".into(),
        fell,
        None,
    )
}

/// A deadline over all requests to one server, each also capped by `STEP_TIMEOUT`.
struct Asker {
    url: Url,
    base: String,
    deadline: Instant,
    /// Set once the server timed out or refused: asking it again would only wait again.
    dead: Option<String>,
}

impl Asker {
    fn json(&mut self, path: &str, body: Option<&str>) -> Result<Value, String> {
        if let Some(why) = &self.dead {
            return Err(format!("skipped ({why})"));
        }
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "skipped (the {}s total time box is spent)",
                TOTAL_TIMEOUT.as_secs()
            ));
        }
        let step = left.min(STEP_TIMEOUT);
        let resp = match http::request(&self.url, path, body, step) {
            Ok(r) => r,
            Err(e) => {
                let why = match &e {
                    ProbeError::TimedOut(d) => format!("timed out after {}s", d.as_secs_f32()),
                    other => other.to_string(),
                };
                if matches!(e, ProbeError::TimedOut(_) | ProbeError::Connect(_)) {
                    self.dead = Some(format!("server {why}"));
                }
                return Err(why);
            }
        };
        if !(200..300).contains(&resp.status) {
            return Err(format!("HTTP {}", resp.status));
        }
        serde_json::from_slice(&resp.body).map_err(|e| {
            let head = String::from_utf8_lossy(&resp.body);
            let head: String = head.chars().take(40).collect();
            format!("not JSON ({e}): {head:?}")
        })
    }
}

/// The window, with (how it was found, why earlier endpoints of this server fell through).
type Found = (u64, (String, String), Option<Ollama>);

fn ask_server(server: &str, model: Option<&str>) -> Result<Found, String> {
    let url = Url::parse(server).map_err(|e| e.to_string())?;
    let mut a = Asker {
        url,
        base: server.trim_end_matches('/').to_string(),
        deadline: Instant::now() + TOTAL_TIMEOUT,
        dead: None,
    };
    let mut why = Vec::new();

    match a.json("/v1/models", None).and_then(|v| vllm(&v, model)) {
        Ok((n, id)) => {
            let how = format!(
                "model server {}/v1/models: max_model_len {n} of {id} (vLLM)",
                a.base
            );
            return Ok((n, (how, why.join("; ")), None));
        }
        Err(e) => why.push(format!("/v1/models {e}")),
    }
    match a.json("/props", None).and_then(|v| llama_cpp(&v)) {
        Ok((n, slots)) => {
            let slots = slots.map(|s| format!(", {s} slots")).unwrap_or_default();
            let how = format!(
                "model server {}/props: per-slot n_ctx {n}{slots} (llama.cpp)",
                a.base
            );
            return Ok((n, (how, why.join("; ")), None));
        }
        Err(e) => why.push(format!("/props {e}")),
    }
    match ollama(&mut a, model) {
        Ok(o) => {
            let window = o.trained_max.or(o.modelfile_num_ctx).or(o.runtime);
            if let Some(n) = window {
                let parts = [
                    o.runtime.map(|r| format!("loaded with context_length {r}")),
                    o.trained_max.map(|t| format!("trained maximum {t}")),
                    o.modelfile_num_ctx
                        .map(|m| format!("Modelfile num_ctx {m}")),
                ];
                let parts: Vec<_> = parts.into_iter().flatten().collect();
                let how = format!(
                    "model server {} (Ollama) {}: {}; requests must send num_ctx",
                    a.base,
                    o.model,
                    parts.join(", ")
                );
                return Ok((n, (how, why.join("; ")), Some(o)));
            }
            why.push(format!(
                "Ollama {}: no context length in /api/ps or /api/show",
                o.model
            ));
        }
        Err(e) => why.push(e),
    }
    Err(why.join("; "))
}

/// vLLM: `data[].max_model_len` (the entry named `model` if given, else the first with one).
pub fn vllm(v: &Value, model: Option<&str>) -> Result<(u64, String), String> {
    let data = v
        .get("data")
        .and_then(Value::as_array)
        .ok_or("has no data list")?;
    let with_len = |e: &&Value| e.get("max_model_len").and_then(Value::as_u64).is_some();
    let entry = model
        .and_then(|m| {
            data.iter()
                .filter(with_len)
                .find(|e| e.get("id").and_then(Value::as_str) == Some(m))
        })
        .or_else(|| data.iter().find(with_len))
        .ok_or("no max_model_len in its data entries (not vLLM)")?;
    let n = entry
        .get("max_model_len")
        .and_then(Value::as_u64)
        .ok_or("no max_model_len")?;
    let id = entry.get("id").and_then(Value::as_str).unwrap_or("?");
    Ok((n, id.to_string()))
}

/// llama.cpp: `default_generation_settings.n_ctx` is already per slot (`-c` ÷ `total_slots`
/// was done by the server); it is the window, not to be divided again.
pub fn llama_cpp(v: &Value) -> Result<(u64, Option<u64>), String> {
    let n = v
        .get("default_generation_settings")
        .and_then(|d| d.get("n_ctx"))
        .and_then(Value::as_u64)
        .filter(|n| *n > 0)
        .ok_or("has no default_generation_settings.n_ctx (not llama.cpp)")?;
    Ok((n, v.get("total_slots").and_then(Value::as_u64)))
}

fn ollama(a: &mut Asker, model: Option<&str>) -> Result<Ollama, String> {
    let mut why = Vec::new();
    let mut o = Ollama::default();
    match a.json("/api/ps", None) {
        Ok(v) => match ollama_ps(&v, model) {
            Ok((name, ctx)) => {
                o.model = name;
                o.runtime = ctx;
            }
            Err(e) => why.push(format!("/api/ps {e}")),
        },
        Err(e) => why.push(format!("/api/ps {e}")),
    }
    let name = match (model, o.model.is_empty()) {
        (Some(m), _) => m.to_string(),
        (None, false) => o.model.clone(),
        (None, true) => {
            why.push("/api/show skipped (no loaded model and no --model)".into());
            return Err(why.join("; "));
        }
    };
    let body = serde_json::json!({ "model": name }).to_string();
    match a.json("/api/show", Some(&body)) {
        Ok(v) => match ollama_show(&v) {
            Ok((trained, num_ctx)) => {
                o.model = name;
                o.trained_max = trained;
                o.modelfile_num_ctx = num_ctx;
                return Ok(o);
            }
            Err(e) => why.push(format!("/api/show {e}")),
        },
        Err(e) => why.push(format!("/api/show {e}")),
    }
    if o.runtime.is_some() {
        return Ok(o);
    }
    Err(why.join("; "))
}

/// `/api/ps`: the loaded model (named `model` if given, else the first) and its window.
pub fn ollama_ps(v: &Value, model: Option<&str>) -> Result<(String, Option<u64>), String> {
    let models = v
        .get("models")
        .and_then(Value::as_array)
        .ok_or("has no models list (not Ollama)")?;
    let name_of = |e: &Value| {
        e.get("name")
            .or_else(|| e.get("model"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let entry = model
        .and_then(|m| {
            models.iter().find(|e| {
                name_of(e)
                    .as_deref()
                    .is_some_and(|n| n == m || n.starts_with(&format!("{m}:")))
            })
        })
        .or_else(|| models.first())
        .ok_or("lists no loaded model")?;
    let name = name_of(entry).ok_or("entry has no name")?;
    Ok((name, entry.get("context_length").and_then(Value::as_u64)))
}

/// `/api/show`: `model_info.<general.architecture>.context_length` and the Modelfile's
/// `num_ctx` from `parameters`.
pub fn ollama_show(v: &Value) -> Result<(Option<u64>, Option<u64>), String> {
    let info = v
        .get("model_info")
        .and_then(Value::as_object)
        .ok_or("has no model_info (not Ollama)")?;
    let trained = info
        .get("general.architecture")
        .and_then(Value::as_str)
        .and_then(|arch| info.get(&format!("{arch}.context_length")))
        .and_then(Value::as_u64);
    let num_ctx = v.get("parameters").and_then(Value::as_str).and_then(|p| {
        p.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("num_ctx"))
                .then(|| w.next().and_then(|n| n.parse::<u64>().ok()))
                .flatten()
        })
    });
    Ok((trained, num_ctx))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn model_name_table_is_seed_002s() {
        for m in [
            "gpt-4o",
            "gpt-4o-mini",
            "gpt-4-turbo",
            "gpt-4",
            "gpt-4o-2024-08-06",
            "openai/gpt-4o",
        ] {
            assert_eq!(lookup_name(m).map(|x| x.1), Some(128_000), "{m}");
        }
        for m in [
            "claude-3-5-sonnet",
            "claude-3-5-haiku",
            "claude-3-opus",
            "claude-3-sonnet",
            "claude-3-haiku",
            "claude-2",
            "claude-3-5-sonnet-20241022",
        ] {
            assert_eq!(lookup_name(m).map(|x| x.1), Some(200_000), "{m}");
        }
        assert_eq!(
            lookup_name("gpt-4o-mini-2024").map(|x| x.0),
            Some("gpt-4o-mini")
        );
        assert_eq!(lookup_name("gpt-4.1"), None);
        assert_eq!(lookup_name("llama3"), None);
    }

    #[test]
    fn detection_order_flag_then_config_then_script_then_max_position_then_table_then_128k() {
        let base = Inputs {
            flag: None,
            config_override: None,
            script: None,
            server: None,
            max_position: None,
            model: None,
        };
        assert_eq!(detect(&base).window, 128_000);
        assert!(detect(&base).source.contains("128k default"));
        let i = Inputs {
            model: Some(("claude-3-opus", "--model")),
            ..base
        };
        assert_eq!(detect(&i).window, 200_000);
        let i = Inputs {
            max_position: Some((131_072, "config.json".into())),
            ..i
        };
        assert_eq!(detect(&i).window, 131_072);
        let i = Inputs {
            script: Some((64_000, "vram_detect.sh (/p)".into())),
            server: Some("http://127.0.0.1:9"),
            ..i
        };
        let a = detect(&i);
        assert_eq!(
            (a.window, a.source.as_str()),
            (64_000, "vram_detect.sh (/p): model_context_kb 64000"),
            "the script's window comes before the model server is asked"
        );
        let i = Inputs {
            config_override: Some(100_000),
            ..i
        };
        assert_eq!(detect(&i).window, 100_000);
        let i = Inputs {
            flag: Some(9000),
            ..i
        };
        let a = detect(&i);
        assert_eq!(
            (a.window, a.source.as_str()),
            (9000, "--context-window 9000")
        );
    }

    #[test]
    fn unknown_model_name_says_so_and_falls_through() {
        let a = detect(&Inputs {
            flag: None,
            config_override: None,
            script: None,
            server: None,
            max_position: None,
            model: Some(("mystery-7b", "--model")),
        });
        assert_eq!(a.window, 128_000);
        assert!(
            a.source.contains("mystery-7b (--model) not listed"),
            "{}",
            a.source
        );
    }

    #[test]
    fn https_model_server_falls_through_saying_plain_http_only() {
        let a = detect(&Inputs {
            flag: None,
            config_override: None,
            script: None,
            server: Some("https://gpu:8000"),
            max_position: None,
            model: None,
        });
        assert_eq!(a.window, 128_000);
        assert!(a.source.contains("plain http only"), "{}", a.source);
    }

    #[test]
    fn vllm_max_model_len_prefers_the_named_model() {
        let v = json!({"data": [{"id": "a", "max_model_len": 4096}, {"id": "b", "max_model_len": 32768}]});
        assert_eq!(vllm(&v, Some("b")).unwrap(), (32768, "b".into()));
        assert_eq!(vllm(&v, None).unwrap().0, 4096);
        assert!(
            vllm(&json!({"data": [{"id": "x"}]}), None)
                .unwrap_err()
                .contains("not vLLM")
        );
    }

    #[test]
    fn llama_cpp_n_ctx_is_per_slot_and_not_divided_again() {
        // `-c 32768` with 4 slots: the server reports n_ctx 8192 per slot.
        let v = json!({"default_generation_settings": {"n_ctx": 8192}, "total_slots": 4});
        assert_eq!(llama_cpp(&v).unwrap(), (8192, Some(4)));
        assert!(llama_cpp(&json!({"total_slots": 4})).is_err());
    }

    #[test]
    fn ollama_show_trained_max_and_modelfile_num_ctx() {
        let v = json!({
            "parameters": "stop \"<|eot_id|>\"\nnum_ctx 8192\ntemperature 0.2",
            "model_info": {"general.architecture": "llama", "llama.context_length": 131072}
        });
        assert_eq!(ollama_show(&v).unwrap(), (Some(131_072), Some(8192)));
        assert_eq!(
            ollama_show(&json!({"model_info": {}})).unwrap(),
            (None, None)
        );
        assert!(ollama_show(&json!({"x": 1})).is_err());
    }

    #[test]
    fn ollama_ps_finds_the_named_loaded_model() {
        let v = json!({"models": [{"name": "qwen2.5:7b", "context_length": 4096},
                                  {"name": "llama3.1:8b", "context_length": 2048}]});
        assert_eq!(
            ollama_ps(&v, Some("llama3.1")).unwrap(),
            ("llama3.1:8b".into(), Some(2048))
        );
        assert_eq!(ollama_ps(&v, None).unwrap().0, "qwen2.5:7b");
        assert!(ollama_ps(&json!({"models": []}), None).is_err());
    }
}
