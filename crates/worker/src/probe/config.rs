//! Seed 002's `config.md` overrides: "## VRAM Configuration" (`Auto-detect: No` and the
//! manual values) and "## Model Configuration" (`Model:`, `Override context window:`).
//! A malformed value is a one-line warning and is ignored; nothing here fails.

use std::io::Read;
use std::path::Path;

/// seed 002: read at most 10 KB of a config file.
pub const MAX_CONFIG_BYTES: u64 = 10 * 1024;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct ConfigMd {
    /// `Some(false)` for `Auto-detect: No`.
    pub auto_detect: Option<bool>,
    pub target_context: Option<u64>,
    pub headroom: Option<f64>,
    pub max_peak: Option<u64>,
    pub model: Option<String>,
    pub context_window: Option<u64>,
    pub warnings: Vec<String>,
}

/// The first 10 KB of `path`, lossily decoded; `None` when it cannot be read.
pub fn read_capped(path: &Path) -> Option<String> {
    let f = std::fs::File::open(path).ok()?;
    let mut buf = Vec::new();
    f.take(MAX_CONFIG_BYTES).read_to_end(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

pub fn parse(text: &str) -> ConfigMd {
    let mut c = ConfigMd::default();
    let mut section = String::new();
    for line in text.lines() {
        let t = line.trim();
        if let Some(h) = t.strip_prefix("## ") {
            section = h.trim().to_ascii_lowercase();
            continue;
        }
        if t.starts_with('#') {
            section.clear();
            continue;
        }
        let Some((key, value)) = bullet(t) else {
            continue;
        };
        let warn = |c: &mut ConfigMd, what: &str| {
            c.warnings.push(format!(
                "config.md: ignored malformed {key:?} value {value:?} (expected {what})"
            ));
        };
        match (section.as_str(), key.as_str()) {
            ("vram configuration", "auto-detect") => match value.to_ascii_lowercase().as_str() {
                "yes" | "true" | "auto" => c.auto_detect = Some(true),
                "no" | "false" => c.auto_detect = Some(false),
                _ => warn(&mut c, "Yes or No"),
            },
            ("vram configuration", "target context") => match tokens(&value) {
                Some(n) => c.target_context = Some(n),
                None => warn(&mut c, "like 16k tokens"),
            },
            ("vram configuration", "headroom") => match percent(&value) {
                Some(h) => c.headroom = Some(h),
                None => warn(&mut c, "like 25%"),
            },
            ("vram configuration", "max peak context per sub-task") => match tokens(&value) {
                Some(n) => c.max_peak = Some(n),
                None => warn(&mut c, "like 12k tokens"),
            },
            ("model configuration", "model")
                if !value.eq_ignore_ascii_case("auto") && !value.is_empty() =>
            {
                c.model = Some(value.clone());
            }
            ("model configuration", "override context window")
                if !value.eq_ignore_ascii_case("auto") =>
            {
                match tokens(&value) {
                    Some(n) => c.context_window = Some(n),
                    None => warn(&mut c, "auto or like 128k"),
                }
            }
            _ => {}
        }
    }
    c
}

/// `- **Key**: value  # comment (note)` → (`key`, `value`).
fn bullet(line: &str) -> Option<(String, String)> {
    let rest = line.strip_prefix('-').or_else(|| line.strip_prefix('*'))?;
    let rest = rest.trim().replace("**", "");
    let (k, v) = rest.split_once(':')?;
    let v = v.split(" #").next().unwrap_or("");
    // "(override if Auto-detect: No)" and similar notes are not part of the value.
    let v = v.split(" (").next().unwrap_or("").trim();
    Some((k.trim().to_ascii_lowercase(), v.to_string()))
}

/// `16k tokens`, `16k`, `16000 tokens`, `1.5k` → tokens (k = 1000, as seed 002's fields).
pub fn tokens(v: &str) -> Option<u64> {
    let v = v.to_ascii_lowercase();
    let v = v.trim().trim_end_matches("tokens").trim();
    let (num, mult) = match v.strip_suffix('k') {
        Some(n) => (n.trim(), 1000.0),
        None => (v, 1.0),
    };
    let n: f64 = num.parse().ok()?;
    (n.is_finite() && n > 0.0).then(|| (n * mult).round() as u64)
}

/// `25%` or `0.25` → 0.25; must be below 1.
pub fn percent(v: &str) -> Option<f64> {
    let v = v.trim();
    let h = match v.strip_suffix('%') {
        Some(p) => p.trim().parse::<f64>().ok()? / 100.0,
        None => v.parse::<f64>().ok()?,
    };
    (h.is_finite() && (0.0..1.0).contains(&h)).then_some(h)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const MANUAL: &str = "# Framework config\n\n## VRAM Configuration\n- **Auto-detect**: No\n- **Target context**: 16k tokens (override if Auto-detect: No)\n- **Headroom**: 25% (override if Auto-detect: No)\n- **Max peak context per sub-task**: 12k tokens\n\n## Model Configuration\n- **Model**: claude-3-5-sonnet  # explicit\n- **Override context window**: 200k\n";

    #[test]
    fn config_md_auto_detect_no_gives_the_manual_values() {
        let c = parse(MANUAL);
        assert_eq!(c.auto_detect, Some(false));
        assert_eq!(c.target_context, Some(16_000));
        assert_eq!(c.headroom, Some(0.25));
        assert_eq!(c.max_peak, Some(12_000));
        assert_eq!(c.model.as_deref(), Some("claude-3-5-sonnet"));
        assert_eq!(c.context_window, Some(200_000));
        assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    }

    #[test]
    fn config_md_auto_values_and_missing_sections_mean_detect() {
        let c = parse(
            "## Model Configuration\n- **Model**: auto\n- **Override context window**: auto\n",
        );
        assert_eq!(c, ConfigMd::default());
        // Values outside their section do not count.
        let c = parse("## Other\n- **Auto-detect**: No\n");
        assert_eq!(c.auto_detect, None);
    }

    #[test]
    fn config_md_malformed_values_warn_in_one_line_and_are_ignored() {
        let c = parse(
            "## VRAM Configuration\n- **Auto-detect**: maybe\n- **Target context**: {value}k tokens\n- **Headroom**: 150%\n- **Max peak context per sub-task**: 12k tokens\n",
        );
        assert_eq!(c.auto_detect, None);
        assert_eq!(c.target_context, None);
        assert_eq!(c.headroom, None);
        assert_eq!(c.max_peak, Some(12_000));
        assert_eq!(c.warnings.len(), 3, "{:?}", c.warnings);
        assert!(c.warnings.iter().all(|w| !w.contains('\n')));
    }

    #[test]
    fn token_and_percent_values_parse() {
        assert_eq!(tokens("128k"), Some(128_000));
        assert_eq!(tokens("16000 tokens"), Some(16_000));
        assert_eq!(tokens("lots"), None);
        assert_eq!(percent("25%"), Some(0.25));
        assert_eq!(percent("0.1"), Some(0.1));
        assert_eq!(percent("100%"), None);
    }
}
