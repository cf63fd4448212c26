//! Seed 002's "detect the model name from `.agent.md` or config files (`.env`,
//! `config.yaml`)", after `--model` and config.md's `Model:`. Only the model line is used, of
//! at most the first 10 KB of each file (a line cut by the cap is dropped: a cut name would be
//! a wrong one). Files are tried in order and the first model line wins; a file that holds
//! what looks like an API key is warned about, naming the key, never its value.

use std::path::PathBuf;

use super::config::MAX_CONFIG_BYTES;
use super::files::{self, Found};

/// How a file's model line is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `Model: x` or `- **Model**: x` (the `.agent.md` line format of `automaton-workflow`'s
    /// policy parser).
    AgentMd,
    /// `MODEL=x` (also `AUTOMATON_MODEL`, `OPENAI_MODEL`, `ANTHROPIC_MODEL`, `LLM_MODEL`,
    /// `MODEL_NAME`; `export` allowed, quotes stripped); `AUTOMATON_MODEL` wins in a file.
    Env,
    /// A top-level `model: x` (an indented one belongs to some other mapping).
    Yaml,
}

impl Kind {
    fn line(self) -> &'static str {
        match self {
            Kind::AgentMd => "Model: line",
            Kind::Env => "MODEL= line",
            Kind::Yaml => "model: line",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    pub file: Found,
    pub kind: Kind,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lookup {
    /// The model and where it came from (`{path} {kind} line`).
    pub model: Option<(String, String)>,
    /// Caps hit, links refused, keys found: one line each.
    pub notes: Vec<String>,
}

const ENV_KEYS: &[&str] = &[
    "AUTOMATON_MODEL",
    "MODEL",
    "MODEL_NAME",
    "LLM_MODEL",
    "OPENAI_MODEL",
    "ANTHROPIC_MODEL",
];
/// At most this many keys are named per file.
const MAX_KEYS_NAMED: usize = 5;

/// Tries `places` in order; the first file with a usable model line wins.
pub fn find(places: &[Place]) -> Lookup {
    let mut out = Lookup::default();
    for p in places {
        let shown = p.file.path.display().to_string();
        let capped = match files::read_capped(&p.file, MAX_CONFIG_BYTES) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(e) => {
                out.notes.push(format!("{e}: not read"));
                continue;
            }
        };
        let mut text = String::from_utf8_lossy(&capped.bytes).into_owned();
        if capped.truncated() {
            out.notes.push(format!(
                "{shown}: {} bytes, only the first {} read",
                capped.size,
                capped.bytes.len()
            ));
            // The last line may be cut by the cap: never use half of it.
            match text.rfind('\n') {
                Some(i) => text.truncate(i),
                None => text.clear(),
            }
        }
        let scan = scan(&text, p.kind);
        if !scan.keys.is_empty() {
            let mut named: Vec<String> = scan.keys.iter().take(MAX_KEYS_NAMED).cloned().collect();
            if scan.keys.len() > MAX_KEYS_NAMED {
                named.push(format!("{} more", scan.keys.len() - MAX_KEYS_NAMED));
            }
            out.notes.push(format!(
                "warning: {shown} holds what look like API keys ({}); the probe reads only its model line and never shows their values, but a vram_detect.sh may read them",
                named.join(", ")
            ));
        }
        if let Some(m) = scan.model {
            out.model = Some((m, format!("{shown} {}", p.kind.line())));
            break;
        }
    }
    out
}

#[derive(Debug, Default, PartialEq, Eq)]
struct Scan {
    model: Option<String>,
    /// The names (never the values) of keys that look like credentials and are set.
    keys: Vec<String>,
}

fn scan(text: &str, kind: Kind) -> Scan {
    let mut s = Scan::default();
    let mut env_rank = usize::MAX;
    for line in text.lines() {
        let Some((key, value)) = key_value(line, kind) else {
            continue;
        };
        if looks_secret(&key) && !value.is_empty() {
            s.keys.push(key_name(&key));
            continue;
        }
        let Some(name) = model_value(&value) else {
            continue;
        };
        match kind {
            Kind::AgentMd | Kind::Yaml => {
                if key.eq_ignore_ascii_case("model") && s.model.is_none() {
                    s.model = Some(name);
                }
            }
            Kind::Env => {
                let upper = key.to_ascii_uppercase();
                // The first model line in the file, unless AUTOMATON_MODEL (rank 0) comes later.
                if let Some(rank) = ENV_KEYS.iter().position(|k| *k == upper)
                    && (env_rank == usize::MAX || (rank == 0 && env_rank != 0))
                {
                    env_rank = rank;
                    s.model = Some(name);
                }
            }
        }
    }
    s
}

/// The key and the raw value of one line in the file's format.
fn key_value(line: &str, kind: Kind) -> Option<(String, String)> {
    match kind {
        Kind::AgentMd => {
            // automaton-workflow's `.agent.md` format: `Key: value`, `- **Key**: value`.
            let line = line.trim().trim_start_matches(['-', '*', '+']).trim();
            let (key, value) = line.split_once(':')?;
            let key = key.replace(['*', '`'], "").trim().to_string();
            let value = value.trim().trim_start_matches("**").replace('`', "");
            let value = value.trim().trim_end_matches("**").trim().to_string();
            (!key.is_empty() && key.len() < 40).then_some((key, value))
        }
        Kind::Env => {
            let t = line.trim();
            if t.starts_with('#') {
                return None;
            }
            let t = t.strip_prefix("export ").unwrap_or(t);
            let (key, value) = t.split_once('=')?;
            let key = key.trim();
            (!key.is_empty() && !key.contains(char::is_whitespace))
                .then(|| (key.to_string(), value.trim().to_string()))
        }
        Kind::Yaml => {
            let t = line.trim_start();
            if t.starts_with('#') {
                return None;
            }
            let top = t.len() == line.len();
            let (key, value) = t.split_once(':')?;
            let key = key.trim().trim_matches(['"', '\'']).to_string();
            // Only a top-level `model:` names the model; a key may be set at any depth.
            let key = if top || looks_secret(&key) {
                key
            } else {
                String::new()
            };
            (!key.is_empty()).then(|| (key, value.trim().to_string()))
        }
    }
}

/// A key like `OPENAI_API_KEY`, `api_key`, `GITHUB_TOKEN`, `client_secret`, `PASSWORD` (but
/// not `max_tokens`).
fn looks_secret(key: &str) -> bool {
    let k = key.to_ascii_uppercase();
    let token = k
        .match_indices("TOKEN")
        .any(|(i, _)| !k[i + 5..].starts_with('S'));
    token
        || ["KEY", "SECRET", "PASSWORD", "PASSWD"]
            .iter()
            .any(|w| k.contains(w))
}

/// The key as it may be shown: its own characters only, short.
fn key_name(key: &str) -> String {
    key.chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ' '))
        .take(40)
        .collect()
}

/// A value that names a model: quotes and a trailing ` # comment` stripped; `auto`, empty or
/// prose (spaces, odd characters) is not one.
fn model_value(raw: &str) -> Option<String> {
    let v = raw.trim();
    let v = match (v.chars().next(), v.get(1..)) {
        (Some(q @ ('"' | '\'')), Some(rest)) => rest.split(q).next().unwrap_or(""),
        _ => v.split(" #").next().unwrap_or(""),
    };
    let v = v.trim();
    let ok = !v.is_empty()
        && v.len() <= 128
        && !v.eq_ignore_ascii_case("auto")
        && v.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/' | '@' | '+')
        });
    ok.then(|| v.to_string())
}

/// The project's files in seed 002's order, after config.md: the layered `.agent.md` (the
/// store's [`automaton_store::Project::policy_file`]: the project's, a root-level one it still
/// honours, else the user's), then `{project}/.env` and `{project}/config.yaml`.
pub fn project_places(p: &automaton_store::Project) -> Vec<Place> {
    let (root, meta) = (p.root(), p.meta());
    let mut out = Vec::new();
    if let Some(agent) = p.policy_file() {
        let file = if meta == root {
            // The project is ~/.automaton itself: the operator's own.
            Found::users(agent)
        } else if agent.starts_with(meta) {
            Found::projects(agent, meta)
        } else if agent.starts_with(root) {
            Found::projects(agent, root)
        } else {
            Found::users(agent)
        };
        out.push(Place {
            file,
            kind: Kind::AgentMd,
        });
    }
    for (name, kind) in [(".env", Kind::Env), ("config.yaml", Kind::Yaml)] {
        let path: PathBuf = root.join(name);
        let file = if meta == root {
            Found::users(path)
        } else {
            Found::projects(path, root)
        };
        out.push(Place { file, kind });
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn agent_md_model_line_in_both_forms() {
        for t in [
            "# Agent\nMode: multi-agent\nModel: claude-3-5-sonnet\n",
            "- **Model**: claude-3-5-sonnet  # the one we pay for\n",
            "- **model**: `claude-3-5-sonnet`\n",
        ] {
            assert_eq!(
                scan(t, Kind::AgentMd).model.as_deref(),
                Some("claude-3-5-sonnet"),
                "{t:?}"
            );
        }
        for t in [
            "Model: auto\n",
            "Model: whichever is cheapest\n",
            "Model:\n",
        ] {
            assert_eq!(scan(t, Kind::AgentMd).model, None, "{t:?}");
        }
    }

    #[test]
    fn env_model_keys_and_automaton_model_wins() {
        let s = scan(
            "# comment\nOPENAI_API_KEY=sk-secret-123\nexport OPENAI_MODEL=\"gpt-4o\"\nMODEL=gpt-4\n",
            Kind::Env,
        );
        assert_eq!(s.model.as_deref(), Some("gpt-4o"));
        assert_eq!(s.keys, vec!["OPENAI_API_KEY".to_string()]);
        let s = scan(
            "MODEL=gpt-4\nAUTOMATON_MODEL='claude-3-opus' # ours\n",
            Kind::Env,
        );
        assert_eq!(s.model.as_deref(), Some("claude-3-opus"));
        let s = scan("ANTHROPIC_API_KEY=\nMAX_TOKENS=4096\n", Kind::Env);
        assert_eq!(
            s,
            Scan::default(),
            "an empty key and max_tokens are no secrets"
        );
    }

    #[test]
    fn yaml_top_level_model_only_and_nested_keys_warned() {
        let s = scan(
            "embeddings:\n  model: text-embedding-3\n  api_key: sk-x\nmodel: \"claude-3-haiku\"\nmax_tokens: 100\n",
            Kind::Yaml,
        );
        assert_eq!(s.model.as_deref(), Some("claude-3-haiku"));
        assert_eq!(s.keys, vec!["api_key".to_string()]);
        assert_eq!(scan("llm:\n  model: gpt-4o\n", Kind::Yaml).model, None);
    }

    #[test]
    fn secret_looking_keys() {
        for k in [
            "OPENAI_API_KEY",
            "api_key",
            "apiKey",
            "GITHUB_TOKEN",
            "client_secret",
            "DB_PASSWORD",
            "token",
        ] {
            assert!(looks_secret(k), "{k}");
        }
        for k in ["MODEL", "max_tokens", "MAX_TOKENS", "temperature"] {
            assert!(!looks_secret(k), "{k}");
        }
    }

    #[test]
    fn files_are_capped_at_10_kb_and_the_cut_line_dropped() {
        let d = tempfile::tempdir().unwrap();
        let big = d.path().join("config.yaml");
        let mut text = "# padding\n".repeat(1022); // 10220 bytes: the cap cuts the next line
        text.push_str("model: claude-3-opus-20240229\n");
        text.push_str(&"# more\n".repeat(100));
        std::fs::write(&big, &text).unwrap();
        let place = Place {
            file: Found::projects(big.clone(), d.path()),
            kind: Kind::Yaml,
        };
        let l = find(std::slice::from_ref(&place));
        assert_eq!(l.model, None, "the model line straddles the 10 KB cap");
        assert!(
            l.notes
                .iter()
                .any(|n| n.contains("only the first 10240 read")),
            "{:?}",
            l.notes
        );
        std::fs::write(&big, "model: claude-3-opus\n").unwrap();
        let l = find(&[place]);
        assert_eq!(
            l.model,
            Some((
                "claude-3-opus".to_string(),
                format!("{} model: line", big.display())
            ))
        );
    }
}
