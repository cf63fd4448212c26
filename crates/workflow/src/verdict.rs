//! Reading the referee's verdict out of `VERDICT.md`.

use std::fmt;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Verdict {
    Pass,
    Fail,
    NeedsReview,
}

impl Verdict {
    fn from_word(word: &str) -> Option<Verdict> {
        match word.to_ascii_uppercase().as_str() {
            "PASS" => Some(Verdict::Pass),
            "FAIL" => Some(Verdict::Fail),
            "NEEDS_REVIEW" => Some(Verdict::NeedsReview),
            _ => None,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Pass => "PASS",
            Verdict::Fail => "FAIL",
            Verdict::NeedsReview => "NEEDS_REVIEW",
        })
    }
}

/// The verdict of a `VERDICT.md`: the first line that, stripped of markdown (`#`, `*`, `_`
/// emphasis, backticks, list dashes, spaces), is exactly `PASS`, `FAIL` or `NEEDS_REVIEW`, or
/// reads `Verdict: <word>` with one of those words (any case). `None` when no line does.
pub fn parse_verdict(text: &str) -> Option<Verdict> {
    text.lines().find_map(|line| {
        let cleaned: String = line
            .chars()
            .filter(|c| !matches!(c, '#' | '*' | '`'))
            .collect();
        let cleaned = cleaned.trim().trim_start_matches(['-', '>']).trim();
        let cleaned = strip_underscore_emphasis(cleaned);
        if matches!(cleaned, "PASS" | "FAIL" | "NEEDS_REVIEW") {
            return Verdict::from_word(cleaned);
        }
        let (key, value) = cleaned.split_once(':')?;
        if !key.trim().eq_ignore_ascii_case("verdict") {
            return None;
        }
        Verdict::from_word(strip_underscore_emphasis(value.trim()).trim_end_matches('.'))
    })
}

/// `_PASS_` or `__PASS__` → `PASS`; `NEEDS_REVIEW` keeps its inner underscore.
fn strip_underscore_emphasis(s: &str) -> &str {
    let mut s = s;
    while s.len() > 2 && s.starts_with('_') && s.ends_with('_') {
        s = &s[1..s.len() - 1];
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_bare_words_after_markdown_stripping() {
        assert_eq!(parse_verdict("# PASS\n"), Some(Verdict::Pass));
        assert_eq!(parse_verdict("**FAIL**"), Some(Verdict::Fail));
        assert_eq!(parse_verdict("- NEEDS_REVIEW"), Some(Verdict::NeedsReview));
        assert_eq!(parse_verdict("## `PASS`"), Some(Verdict::Pass));
        assert_eq!(parse_verdict("_PASS_"), Some(Verdict::Pass));
    }

    #[test]
    fn verdict_key_value_form_any_case() {
        assert_eq!(
            parse_verdict("# Review\n\nVerdict: PASS\n"),
            Some(Verdict::Pass)
        );
        assert_eq!(parse_verdict("**Verdict:** fail"), Some(Verdict::Fail));
        assert_eq!(
            parse_verdict("- **Verdict**: needs_review"),
            Some(Verdict::NeedsReview)
        );
    }

    #[test]
    fn verdict_first_matching_line_wins() {
        assert_eq!(parse_verdict("FAIL\nPASS"), Some(Verdict::Fail));
        assert_eq!(
            parse_verdict("Summary\nVerdict: maybe\nPASS"),
            Some(Verdict::Pass)
        );
    }

    #[test]
    fn verdict_absent_or_embedded_in_prose_is_none() {
        assert_eq!(parse_verdict(""), None);
        assert_eq!(parse_verdict("The tests PASS mostly"), None);
        assert_eq!(
            parse_verdict("pass"),
            None,
            "a bare word must be upper case"
        );
        assert_eq!(parse_verdict("Verdict: PASSED"), None);
    }
}
