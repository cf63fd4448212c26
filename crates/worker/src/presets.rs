//! Tested command templates for the agent CLIs people run (`--agent aider`, `--agent codex`,
//! `--agent claude-code`), and the paths no agent's own state may bring onto a task branch.
//!
//! Each preset pins the agent's root to the workspace, keeps the agent's own state (chat
//! history, caches) under `.automaton-task/` or out of the tree, points it at the run's
//! model URL (the metering proxy when usage is metered), and turns its own commits off: the
//! worker makes the patch. A preset is expanded once, at start, into an ordinary command
//! template (`docs/worker.md`, "Presets"); `{model}` is the model name the worker was given
//! (`--model`, or what the probe found).
//!
//! This module only builds strings: running them is `agent`'s.

/// Paths an agent's tool state lives at, never part of a patch (first path component:
/// `name/` a directory, `prefix*` any name so starting, else the exact name).
pub const DEFAULT_PATCH_EXCLUDES: &[&str] = &[
    ".aider*",
    ".claude/",
    ".codex/",
    ".cursor/",
    ".continue/",
    ".git/",
    ".gitignore.aider",
    "__pycache__/",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    "node_modules/",
];

/// A preset the worker knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    /// What must be installed, for `--help` and the docs.
    pub needs: &'static str,
    template: &'static str,
}

/// Why a preset cannot be used as asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PresetError {
    #[error(
        "--agent {preset} needs the model's name: give --model NAME (the name the model server serves it under)"
    )]
    NoModel { preset: &'static str },
    #[error(
        "--agent {preset} needs --model-server URL: the preset sends the agent's requests to the model server through the worker"
    )]
    NoModelServer { preset: &'static str },
}

/// aider: a throwaway git repository makes the workspace aider's root (without one, the root
/// is the folder of the first file named, `.automaton-task/`, and its edits land there);
/// its commits, `.gitignore` edits and repository map (a binary tags cache) are off; its chat
/// and input history go under `.automaton-task/`; the whole-file edit format, which every
/// model can follow; the artifact is named on the command line so aider may create it.
const AIDER: &str = "git init -q . 2>/dev/null; OPENAI_API_KEY=\"${OPENAI_API_KEY:-unused}\" aider --model openai/{model} --openai-api-base \"$AUTOMATON_MODEL_URL/v1\" --yes-always --no-auto-commits --no-dirty-commits --no-gitignore --map-tokens 0 --no-show-model-warnings --no-check-update --analytics-disable --no-pretty --no-stream --edit-format whole --chat-history-file .automaton-task/aider.chat.history.md --input-history-file .automaton-task/aider.input.history --message-file {prompt_file} {artifact}";

/// Codex CLI: `--full-auto` is gone in current releases; with the default provider Codex
/// ignores `OPENAI_BASE_URL` and tries a WebSocket, so a custom provider points at the run's
/// model URL with the Responses API; `workspace-write` lets it edit the workspace and never
/// ask; its home (config, sessions) is `.automaton-task/codex-home`.
const CODEX: &str = "mkdir -p .automaton-task/codex-home && CODEX_HOME=\"$PWD/.automaton-task/codex-home\" OPENAI_API_KEY=\"${OPENAI_API_KEY:-unused}\" codex exec --skip-git-repo-check -s workspace-write -c approval_policy=never -c model_provider=automaton -c model_providers.automaton.name=automaton -c \"model_providers.automaton.base_url=$AUTOMATON_MODEL_URL/v1\" -c model_providers.automaton.wire_api=responses -c model_providers.automaton.env_key=OPENAI_API_KEY -m {model} \"$(cat {prompt_file})\"";

/// Claude Code: print mode runs one prompt and exits; edits and the shell are allowed
/// without asking; requests go to the run's model URL (Anthropic's Messages API), and no
/// other traffic (telemetry, update checks) leaves the machine; its config is
/// `.automaton-task/claude-home`.
const CLAUDE_CODE: &str = "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 ANTHROPIC_BASE_URL=\"$AUTOMATON_MODEL_URL\" ANTHROPIC_AUTH_TOKEN=\"${ANTHROPIC_AUTH_TOKEN:-unused}\" CLAUDE_CONFIG_DIR=\"$PWD/.automaton-task/claude-home\" claude -p \"$(cat {prompt_file})\" --model {model} --permission-mode acceptEdits --allowedTools \"Read,Edit,Write,Bash\"";

/// Every preset, in the order `--help` lists them.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "aider",
        needs: "aider (pip install aider-chat) and git on PATH; an OpenAI-compatible model server",
        template: AIDER,
    },
    Preset {
        name: "codex",
        needs: "codex (npm install -g @openai/codex) on PATH; a model server with the OpenAI Responses API",
        template: CODEX,
    },
    Preset {
        name: "claude-code",
        needs: "claude (npm install -g @anthropic-ai/claude-code) on PATH; a model server with Anthropic's Messages API",
        template: CLAUDE_CODE,
    },
];

/// The preset called `name`, if any.
pub fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

impl Preset {
    /// The command template, with `{model}` filled in (shell-quoted: a model name cannot
    /// inject a command). Needs a model name and a model server.
    pub fn template(&self, model: Option<&str>, model_server: bool) -> Result<String, PresetError> {
        let model = model
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .ok_or(PresetError::NoModel { preset: self.name })?;
        if !model_server {
            return Err(PresetError::NoModelServer { preset: self.name });
        }
        Ok(self.template.replace("{model}", &shell_quote(model)))
    }
}

/// `s` as one single-quoted shell word.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Whether `path` (relative, `/`-separated) is tool state by `patterns` (see
/// [`DEFAULT_PATCH_EXCLUDES`] for the form).
pub fn excluded<P: AsRef<str>>(path: &str, patterns: &[P]) -> bool {
    let first = path.split('/').next().unwrap_or(path);
    let is_dir = path.contains('/');
    patterns.iter().any(|p| {
        let p = p.as_ref();
        if let Some(dir) = p.strip_suffix('/') {
            is_dir && first == dir
        } else if let Some(prefix) = p.strip_suffix('*') {
            first.starts_with(prefix)
        } else {
            path == p || first == p
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_state_is_excluded_and_code_is_not() {
        let d = DEFAULT_PATCH_EXCLUDES;
        for junk in [
            ".aider.chat.history.md",
            ".aider.tags.cache.v4/cache.db",
            ".claude/settings.json",
            ".codex/config.toml",
            ".git/HEAD",
            "node_modules/x/index.js",
        ] {
            assert!(excluded(junk, d), "{junk}");
        }
        for code in [
            "src/lib.rs",
            "README.md",
            "docs/.aider-notes.md",
            ".claude",
            "src/.git/x",
        ] {
            assert!(!excluded(code, d), "{code}");
        }
    }

    #[test]
    fn a_preset_needs_a_model_and_a_server_and_quotes_the_model() {
        let aider = find("aider").expect("aider");
        assert_eq!(
            aider.template(None, true),
            Err(PresetError::NoModel { preset: "aider" })
        );
        assert_eq!(
            aider.template(Some("m"), false),
            Err(PresetError::NoModelServer { preset: "aider" })
        );
        let t = aider
            .template(Some("qwen'; rm -rf /"), true)
            .expect("a template");
        assert!(t.contains(r"--model openai/'qwen'\''; rm -rf /'"), "{t}");
        for p in PRESETS {
            let t = p.template(Some("m"), true).expect("a template");
            assert!(!t.contains("{model}"), "{}: {t}", p.name);
            assert!(t.contains("AUTOMATON_MODEL_URL"), "{}: {t}", p.name);
        }
        assert!(find("gpt-engineer").is_none());
    }
}
