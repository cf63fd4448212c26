//! What a decomposed parent hands its sub-tasks and gets back: `VRAM_CONFIG.md`,
//! `PARENT_SPEC.md`, the aggregation of the sub-tasks' verdicts, and the fix / review /
//! tie-break tasks a verdict calls for in manual mode. Seed 002 lines 340-466 and seed 000
//! lines 34-66 are the source; each rule names its line.

use std::collections::HashSet;
use std::fmt;

use crate::decomposition::{SubtaskSpec, kebab};
use crate::names::{MAX_NAME_LEN, TaskName};
use crate::phase::Phase;
use crate::verdict::{Verdict, parse_verdict};

/// The VRAM figures of seed 002 §"VRAM Config Propagation" (lines 385-403), from the
/// detection script or `~/.automaton/config.md`.
#[derive(Debug, Clone, PartialEq)]
pub struct VramConfig {
    pub auto_detect: bool,
    /// Target VRAM context, k tokens (16 = 16k).
    pub target_kb: u64,
    /// Headroom as a fraction: 0.25 is 25%.
    pub headroom: f64,
    /// Max peak context per sub-task, k tokens (12 = 12,000 tokens).
    pub max_peak_context_kb: u64,
    pub gpu_vram_gb: Option<f64>,
    pub ram_gb: f64,
    /// Model context window, k tokens; `None` when unknown.
    pub model_context_kb: Option<u64>,
    pub framework_overhead_tokens: u64,
}

/// `12000` → `12`, `12500` → `12.5`: tokens as k without trailing zeros.
fn as_k(tokens: u64) -> String {
    let whole = tokens / 1000;
    let frac = tokens % 1000;
    if frac == 0 {
        whole.to_string()
    } else {
        format!("{whole}.{frac:03}")
            .trim_end_matches('0')
            .to_string()
    }
}

/// At most two decimals, trailing zeros dropped: `24.0` → `24`, `23.5` → `23.5`.
fn decimal(x: f64) -> String {
    let s = format!("{x:.2}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

fn yes_no(b: bool) -> &'static str {
    if b { "Yes" } else { "No" }
}

/// A sub-task's `VRAM_CONFIG.md`: seed 002's block (lines 389-400) field for field, with the
/// units of its "Important" paragraph (line 403): target and this sub-task's estimate in k
/// (`16k tokens`), the max peak context as the raw token count (`12000 tokens`). After the
/// seed's fields, one line of ours: the largest budget among the fleet's workers
/// (`largest_worker`: its name and budget in tokens), which is what `fits` was decided
/// against.
pub fn vram_config_md(
    config: &VramConfig,
    estimate_tokens: u64,
    fits: bool,
    largest_worker: Option<(&str, u64)>,
) -> String {
    let gpu = config
        .gpu_vram_gb
        .map_or("None".to_string(), |g| format!("{}GB", decimal(g)));
    let model = config
        .model_context_kb
        .map_or("Unknown".to_string(), |k| format!("{k}k tokens"));
    let largest = largest_worker.map_or("None (no worker registered)".to_string(), |(w, t)| {
        format!("{}k tokens ({w})", as_k(t))
    });
    format!(
        "# VRAM Configuration for this sub-task\n\
         \n\
         - **Auto-detect**: {}\n\
         - **Target VRAM context**: {}k tokens\n\
         - **Headroom**: {}%\n\
         - **Max peak context per sub-task**: {} tokens\n\
         - **GPU VRAM detected**: {gpu}\n\
         - **RAM detected**: {}GB\n\
         - **Model context window**: {model}\n\
         - **Framework overhead**: ~{} tokens\n\
         - **This sub-task's estimated peak context**: {}k tokens\n\
         - **Fits within VRAM**: {}\n\
         - **Largest worker budget**: {largest}\n",
        yes_no(config.auto_detect),
        config.target_kb,
        decimal(config.headroom * 100.0),
        config.max_peak_context_kb.saturating_mul(1000),
        decimal(config.ram_gb),
        config.framework_overhead_tokens,
        as_k(estimate_tokens),
        yes_no(fits),
    )
}

/// A sub-task's `PARENT_SPEC.md` (seed 002 lines 361-365 and 405-413): the sub-task's own
/// scope / acceptance from the decomposition and the parent's name. It takes no parent SPEC:
/// the seed forbids copying it (circular references, lines 365 and 411). The VRAM figures are in
/// `VRAM_CONFIG.md` beside it, which this file points to.
pub fn parent_spec_md(
    parent: &TaskName,
    spec: &SubtaskSpec,
    wave: usize,
    depends_on: &[String],
) -> String {
    let deps = if depends_on.is_empty() {
        "nothing (it can start at once)".to_string()
    } else {
        depends_on
            .iter()
            .map(|d| format!("`{d}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "# Parent specification for sub-task `{name}`\n\
         \n\
         - **Parent task**: `{parent}`\n\
         - **Sub-task**: `{parent}/{name}` ({title})\n\
         - **Wave**: {wave}\n\
         - **Depends on**: {deps}\n\
         - **Estimated peak context**: {k}k tokens\n\
         - **From**: the parent's DECOMPOSITION.md, line {line}\n\
         \n\
         ## Scope and acceptance\n\
         \n\
         {scope}\n\
         \n\
         ## Notes\n\
         \n\
         - This sub-task is responsible for the scope above and nothing else; the parent's \
         SPEC.md is deliberately not copied here.\n\
         - The VRAM configuration for this sub-task is in `VRAM_CONFIG.md` in this folder.\n",
        name = spec.name,
        title = spec.title,
        k = as_k(spec.peak_context_tokens),
        line = spec.line,
        scope = spec.scope,
    )
}

/// The sub-tasks' verdicts counted (seed 002 lines 449-457), with the names behind the counts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Aggregate {
    pub pass: usize,
    pub fail: usize,
    pub needs_review: usize,
    /// Sub-tasks without a `VERDICT.md` (or without a verdict in it): not terminal (line 423).
    pub missing: usize,
    /// FAIL and NEEDS_REVIEW sub-tasks with their verdict, in the order given.
    pub failing: Vec<(String, Verdict)>,
    pub waiting: Vec<String>,
}

impl Aggregate {
    /// `PASS: 2, FAIL: 1, NEEDS_REVIEW: 0, no verdict: 1`: the seed's summary (lines 453-456).
    pub fn summary(&self) -> String {
        format!(
            "PASS: {}, FAIL: {}, NEEDS_REVIEW: {}, no verdict: {}",
            self.pass, self.fail, self.needs_review, self.missing
        )
    }
}

pub fn aggregate(verdicts: &[(String, Option<Verdict>)]) -> Aggregate {
    let mut a = Aggregate::default();
    for (name, v) in verdicts {
        match v {
            Some(Verdict::Pass) => a.pass += 1,
            Some(v @ Verdict::Fail) => {
                a.fail += 1;
                a.failing.push((name.clone(), *v));
            }
            Some(v @ Verdict::NeedsReview) => {
                a.needs_review += 1;
                a.failing.push((name.clone(), *v));
            }
            None => {
                a.missing += 1;
                a.waiting.push(name.clone());
            }
        }
    }
    a
}

/// Where a decomposed parent stands given its sub-tasks' verdicts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParentOutcome {
    Complete,
    /// `reason` is the text after seed 002's "⚠️ **HUMAN INTERVENTION REQUIRED**: ".
    HumanIntervention {
        reason: String,
    },
    Waiting,
}

impl fmt::Display for ParentOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParentOutcome::Complete => f.write_str("complete"),
            ParentOutcome::Waiting => f.write_str("waiting for sub-tasks"),
            ParentOutcome::HumanIntervention { reason } => {
                write!(f, "⚠️ **HUMAN INTERVENTION REQUIRED**: {reason}")
            }
        }
    }
}

/// Seed 002's rules, in this order:
/// - any FAIL or NEEDS_REVIEW sub-task → human intervention, whatever the parent's own
///   verdict says (line 452), even while other sub-tasks have no verdict yet (a failing
///   sub-task pauses the orchestrator, line 428); when the parent's VERDICT.md says PASS the
///   reason is the seed's sentence (line 457);
/// - the parent's own VERDICT.md says FAIL or NEEDS_REVIEW → human intervention;
/// - any sub-task without a verdict → waiting (lines 423, 437);
/// - every sub-task PASS → complete (line 439);
/// - no sub-tasks at all → human intervention (a decomposition always has one; something is
///   wrong).
///
/// Each reason ends with the counts (lines 453-456).
pub fn parent_outcome(agg: &Aggregate, parent_verdict: Option<Verdict>) -> ParentOutcome {
    let counts = format!("Sub-task verdicts: {}.", agg.summary());
    if let Some((first, v)) = agg.failing.first() {
        let reason = if parent_verdict == Some(Verdict::Pass) {
            format!(
                "Parent task VERDICT.md says PASS, but sub-task {first} has VERDICT.md with {v}. Create a fix task for the failing sub-task. {counts}"
            )
        } else {
            let names: Vec<String> = agg
                .failing
                .iter()
                .map(|(n, v)| format!("{n} ({v})"))
                .collect();
            format!(
                "sub-task(s) {} did not pass; create fix tasks for them. {counts}",
                names.join(", ")
            )
        };
        return ParentOutcome::HumanIntervention { reason };
    }
    if let Some(v @ (Verdict::Fail | Verdict::NeedsReview)) = parent_verdict {
        return ParentOutcome::HumanIntervention {
            reason: format!("Parent task VERDICT.md says {v}. {counts}"),
        };
    }
    if agg.missing > 0 {
        return ParentOutcome::Waiting;
    }
    if agg.pass == 0 {
        return ParentOutcome::HumanIntervention {
            reason: format!("the decomposition lists no sub-tasks. {counts}"),
        };
    }
    ParentOutcome::Complete
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowUpKind {
    Fix,
    Review,
    Tiebreak,
}

impl FollowUpKind {
    /// The word in the task's name.
    pub fn word(self) -> &'static str {
        match self {
            FollowUpKind::Fix => "fix",
            FollowUpKind::Review => "review",
            FollowUpKind::Tiebreak => "tiebreak",
        }
    }

    /// Fix and review tasks start at Bug Find (seed 000 lines 42, 48; seed 002 line 433 for
    /// a sub-task's fix); tie-breaks at Research (seed 000 line 54; seed 002 line 464).
    pub fn start_phase(self) -> Phase {
        match self {
            FollowUpKind::Fix | FollowUpKind::Review => Phase::BugFind,
            FollowUpKind::Tiebreak => Phase::Research,
        }
    }
}

/// Copied from the original task into every follow-up (seed 000 lines 43, 49, 55; seed 002
/// lines 216, 222, 228, 434, 465); for a sub-task only those that exist (seed 002 lines 434,
/// 435, 465) — the caller skips the absent ones.
pub const FOLLOW_UP_COPY: [&str; 3] = ["SPEC.md", "BUG_REPORT.md", "ADVERSARIAL_BUG_REPORT.md"];

/// A task the orchestrator creates in manual mode from a verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowUp {
    pub name: TaskName,
    pub kind: FollowUpKind,
    pub start_phase: Phase,
    pub copy: Vec<&'static str>,
    /// The folder gets an empty `IMPLEMENTATION.md` (seed 000 lines 41, 47, 53; seed 002
    /// lines 215, 221, 227, 432, 463).
    pub empty_implementation: bool,
    /// The verdict item it came from (for a sub-task: the sub-task's leaf name).
    pub item: String,
}

/// The fix / review / tie-break tasks a `VERDICT.md` calls for in manual mode (in autopilot
/// none are created: seed 000 line 57, seed 002 line 231).
///
/// A top-level task (`parent` is `None` and `task` has none): one task per item, named
/// `{task}-fix-{issue}` for each item under "Findings" when the verdict is FAIL (seed 000
/// line 39, seed 002 line 213), `{task}-review-{issue}` for each item under "Remaining
/// Issues" when it is NEEDS_REVIEW (seed 000 line 45, seed 002 line 219), and
/// `{task}-tiebreak-{issue}` for each item under "Tasks for Review / Tie-Breaks" whatever the
/// verdict (seed 000 line 51, seed 002 line 225).
///
/// A sub-task (`parent` given, or `task` is `parent/sub`): seed 002 stands. One
/// `{parent}-fix-{sub}` when the verdict is FAIL or NEEDS_REVIEW (line 431), one
/// `{parent}-tiebreak-{sub}` when the verdict lists tie-breaks (line 462).
///
/// Names are cut to 64 characters (the issue first; the task's own name too when it leaves
/// fewer than 16 for the issue) and made unique with `-2`, `-3`, ….
pub fn follow_up_tasks(
    task: &TaskName,
    verdict_text: &str,
    parent: Option<&TaskName>,
) -> Vec<FollowUp> {
    let verdict = parse_verdict(verdict_text);
    let sections = sections(verdict_text);
    let parent = parent.cloned().or_else(|| task.parent());
    let mut taken = HashSet::new();
    let mut out = Vec::new();
    let mut push = |kind: FollowUpKind, base: &str, item: &str, issue: &str| {
        if let Some(name) = compose(base, kind.word(), issue, &mut taken) {
            out.push(FollowUp {
                name,
                kind,
                start_phase: kind.start_phase(),
                copy: FOLLOW_UP_COPY.to_vec(),
                empty_implementation: true,
                item: item.to_string(),
            });
        }
    };
    match parent {
        Some(parent) => {
            let base = parent.leaf();
            let sub = task.leaf();
            if matches!(verdict, Some(Verdict::Fail | Verdict::NeedsReview)) {
                push(FollowUpKind::Fix, base, sub, sub);
            }
            if !sections.tiebreaks.is_empty() {
                push(FollowUpKind::Tiebreak, base, sub, sub);
            }
        }
        None => {
            let base = task.leaf();
            let mut each = |kind, items: &[String]| {
                for (i, item) in items.iter().enumerate() {
                    let issue = issue_of(item);
                    let issue = if issue.is_empty() {
                        format!("item-{}", i + 1)
                    } else {
                        issue
                    };
                    push(kind, base, item, &issue);
                }
            };
            if verdict == Some(Verdict::Fail) {
                each(FollowUpKind::Fix, &sections.findings);
            }
            if verdict == Some(Verdict::NeedsReview) {
                each(FollowUpKind::Review, &sections.remaining);
            }
            each(FollowUpKind::Tiebreak, &sections.tiebreaks);
        }
    }
    out
}

/// Cut to `max` bytes (all ASCII here), no trailing hyphen.
fn cut(s: &str, max: usize) -> &str {
    s[..s.len().min(max)].trim_end_matches('-')
}

/// `{base}-{word}-{issue}` within 64 characters, not in `taken`.
fn compose(base: &str, word: &str, issue: &str, taken: &mut HashSet<String>) -> Option<TaskName> {
    const MIN_ISSUE: usize = 16;
    let fixed = word.len() + 2;
    let room = MAX_NAME_LEN.saturating_sub(base.len() + fixed);
    let (base, issue) = if room >= issue.len().min(MIN_ISSUE) {
        (base, cut(issue, room))
    } else {
        let issue = cut(issue, MIN_ISSUE);
        (cut(base, MAX_NAME_LEN - fixed - issue.len()), issue)
    };
    let name = format!("{base}-{word}-{issue}");
    let mut candidate = name.clone();
    let mut n = 2;
    while taken.contains(&candidate) {
        let suffix = format!("-{n}");
        candidate = format!("{}{suffix}", cut(&name, MAX_NAME_LEN - suffix.len()));
        n += 1;
    }
    taken.insert(candidate.clone());
    candidate.parse().ok()
}

/// The short form of a verdict item: its bold lead (`**Null handling** crashes…`), else the
/// text before the first `: `, ` — ` or `. `, in kebab-case.
fn issue_of(item: &str) -> String {
    let t = item.trim();
    if let Some(rest) = t.strip_prefix("**")
        && let Some((lead, _)) = rest.split_once("**")
        && !kebab(lead).is_empty()
    {
        return kebab(lead);
    }
    let mut head = t;
    for sep in [": ", " — ", " – ", " - ", ". "] {
        if let Some((h, _)) = head.split_once(sep) {
            head = h;
        }
    }
    kebab(head)
}

#[derive(Debug, Default)]
struct Sections {
    findings: Vec<String>,
    remaining: Vec<String>,
    tiebreaks: Vec<String>,
}

#[derive(Clone, Copy)]
enum Section {
    Findings,
    Remaining,
    Tiebreaks,
}

/// A heading's text: a `#` line, or a line that is all bold (`**Findings:**`).
fn heading(line: &str) -> Option<String> {
    let t = line.trim();
    let text = if let Some(h) = t.strip_prefix('#') {
        h.trim_start_matches('#')
    } else if t.starts_with("**") && (t.ends_with("**") || t.ends_with("**:")) && t.len() > 4 {
        t
    } else {
        return None;
    };
    let text: String = text.chars().filter(|c| !matches!(c, '*' | '`')).collect();
    Some(
        text.trim()
            .trim_end_matches(':')
            .trim()
            .to_ascii_lowercase(),
    )
}

fn section_of(heading: &str) -> Option<Section> {
    if heading.contains("tie-break")
        || heading.contains("tiebreak")
        || heading.contains("tasks for review")
    {
        Some(Section::Tiebreaks)
    } else if heading.starts_with("findings") {
        Some(Section::Findings)
    } else if heading.starts_with("remaining issues") {
        Some(Section::Remaining)
    } else {
        None
    }
}

/// A top-level list item's text (`- x`, `* x`, `+ x`, `1. x`, `1) x`; indented by less than
/// two spaces).
fn list_item(line: &str) -> Option<&str> {
    if line.len() - line.trim_start().len() >= 2 {
        return None;
    }
    let t = line.trim_start();
    for marker in ["- ", "* ", "+ "] {
        if let Some(rest) = t.strip_prefix(marker) {
            return Some(rest.trim());
        }
    }
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    if digits > 0 {
        let rest = &t[digits..];
        if let Some(rest) = rest.strip_prefix(". ").or_else(|| rest.strip_prefix(") ")) {
            return Some(rest.trim());
        }
    }
    None
}

/// `None`, `N/A`, `nothing`, and a finding marked as passing (`✅ …`, `PASS: …`) are not items.
fn is_item(text: &str) -> bool {
    let plain: String = text
        .chars()
        .filter(|c| !matches!(c, '*' | '`' | '_'))
        .collect();
    let plain = plain.trim().trim_end_matches('.').to_ascii_lowercase();
    let empty = plain.is_empty()
        || matches!(plain.as_str(), "none" | "n/a" | "nothing" | "-")
        || plain.starts_with("none ")
        || plain.starts_with("none;")
        || plain.starts_with("none,");
    let passing = plain.starts_with('✅') || plain.starts_with("pass");
    !empty && !passing
}

fn sections(text: &str) -> Sections {
    let mut out = Sections::default();
    let mut current: Option<Section> = None;
    for line in text.lines() {
        if let Some(h) = heading(line) {
            current = section_of(&h);
            continue;
        }
        let (Some(section), Some(item)) = (current, list_item(line)) else {
            continue;
        };
        if !is_item(item) {
            continue;
        }
        let list = match section {
            Section::Findings => &mut out.findings,
            Section::Remaining => &mut out.remaining,
            Section::Tiebreaks => &mut out.tiebreaks,
        };
        list.push(item.to_string());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decomposition::parse_decomposition;

    fn config() -> VramConfig {
        VramConfig {
            auto_detect: true,
            target_kb: 16,
            headroom: 0.25,
            max_peak_context_kb: 12,
            gpu_vram_gb: Some(24.0),
            ram_gb: 62.5,
            model_context_kb: Some(128),
            framework_overhead_tokens: 2000,
        }
    }

    fn spec(name: &str, scope: &str) -> SubtaskSpec {
        SubtaskSpec {
            name: name.into(),
            title: "Auth gateway".into(),
            depends_on: vec!["auth-core".into()],
            peak_context_tokens: 10_000,
            scope: scope.into(),
            line: 7,
        }
    }

    fn task(s: &str) -> TaskName {
        s.parse().expect("valid")
    }

    #[test]
    fn vram_config_md_has_the_seed_fields_in_the_seed_units() {
        let md = vram_config_md(&config(), 10_000, true, Some(("gpu-a", 24_000)));
        assert_eq!(
            md,
            "# VRAM Configuration for this sub-task\n\
             \n\
             - **Auto-detect**: Yes\n\
             - **Target VRAM context**: 16k tokens\n\
             - **Headroom**: 25%\n\
             - **Max peak context per sub-task**: 12000 tokens\n\
             - **GPU VRAM detected**: 24GB\n\
             - **RAM detected**: 62.5GB\n\
             - **Model context window**: 128k tokens\n\
             - **Framework overhead**: ~2000 tokens\n\
             - **This sub-task's estimated peak context**: 10k tokens\n\
             - **Fits within VRAM**: Yes\n\
             - **Largest worker budget**: 24k tokens (gpu-a)\n"
        );
        let c = VramConfig {
            auto_detect: false,
            headroom: 0.125,
            gpu_vram_gb: None,
            model_context_kb: None,
            ..config()
        };
        let md = vram_config_md(&c, 12_500, false, None);
        for line in [
            "- **Auto-detect**: No\n",
            "- **Headroom**: 12.5%\n",
            "- **GPU VRAM detected**: None\n",
            "- **Model context window**: Unknown\n",
            "- **This sub-task's estimated peak context**: 12.5k tokens\n",
            "- **Fits within VRAM**: No\n",
            "- **Largest worker budget**: None (no worker registered)\n",
        ] {
            assert!(md.contains(line), "{line}\n{md}");
        }
    }

    #[test]
    fn parent_spec_md_carries_the_scope_and_never_the_parents_spec() {
        // The parent's SPEC.md: PARENT_SPEC.md must not contain it, and the function has no
        // way to receive it.
        let parent_spec = "# SPEC — add-user-auth\n\nSECRET-PARENT-REQUIREMENT: see subtasks/auth-gateway/SPEC.md\n";
        let parent = task("add-user-auth");
        let s = spec("auth-gateway", "Issues tokens; the gateway's tests pass");
        let md = parent_spec_md(&parent, &s, 2, &["auth-core".to_string()]);
        assert!(!md.contains("SECRET-PARENT-REQUIREMENT"), "{md}");
        assert!(!md.contains(parent_spec.trim()), "{md}");
        for want in [
            "# Parent specification for sub-task `auth-gateway`\n",
            "- **Parent task**: `add-user-auth`\n",
            "- **Sub-task**: `add-user-auth/auth-gateway` (Auth gateway)\n",
            "- **Wave**: 2\n",
            "- **Depends on**: `auth-core`\n",
            "- **Estimated peak context**: 10k tokens\n",
            "line 7",
            "## Scope and acceptance\n\nIssues tokens; the gateway's tests pass\n",
            "`VRAM_CONFIG.md`",
        ] {
            assert!(md.contains(want), "{want}\n{md}");
        }
        let md = parent_spec_md(&parent, &s, 1, &[]);
        assert!(
            md.contains("- **Depends on**: nothing (it can start at once)\n"),
            "{md}"
        );
    }

    #[test]
    fn parent_spec_md_from_a_parsed_decomposition() {
        let d = parse_decomposition(
            "| sub-task | depends on | estimate | scope |\n|-|-|-|-|\n| Auth core | - | 4 | core |\n| Auth gateway | Auth core | 10 | gate |\n",
        )
        .expect("parses");
        let s = d.get("auth-gateway").expect("listed");
        let wave = d.wave_of(&s.name).expect("placed");
        let md = parent_spec_md(&task("add-user-auth"), s, wave, &s.depends_on);
        assert!(
            md.contains("- **Wave**: 2\n- **Depends on**: `auth-core`\n"),
            "{md}"
        );
        assert!(md.contains("\ngate\n"), "{md}");
    }

    fn v(list: &[(&str, Option<Verdict>)]) -> Vec<(String, Option<Verdict>)> {
        list.iter().map(|(n, v)| (n.to_string(), *v)).collect()
    }

    #[test]
    fn aggregation_counts_and_parent_outcomes() {
        use Verdict::*;
        let all_pass = aggregate(&v(&[("a", Some(Pass)), ("b", Some(Pass))]));
        assert_eq!(
            (
                all_pass.pass,
                all_pass.fail,
                all_pass.needs_review,
                all_pass.missing
            ),
            (2, 0, 0, 0)
        );
        assert_eq!(parent_outcome(&all_pass, None), ParentOutcome::Complete);
        assert_eq!(
            parent_outcome(&all_pass, Some(Pass)),
            ParentOutcome::Complete
        );

        let waiting = aggregate(&v(&[("a", Some(Pass)), ("b", None)]));
        assert_eq!(waiting.missing, 1);
        assert_eq!(waiting.waiting, ["b"]);
        assert_eq!(parent_outcome(&waiting, None), ParentOutcome::Waiting);
        assert_eq!(parent_outcome(&waiting, Some(Pass)), ParentOutcome::Waiting);

        let mixed = aggregate(&v(&[
            ("a", Some(Pass)),
            ("auth-gateway", Some(Fail)),
            ("c", Some(NeedsReview)),
            ("d", None),
        ]));
        assert_eq!(
            mixed.summary(),
            "PASS: 1, FAIL: 1, NEEDS_REVIEW: 1, no verdict: 1"
        );
        assert_eq!(
            parent_outcome(&mixed, None),
            ParentOutcome::HumanIntervention {
                reason: "sub-task(s) auth-gateway (FAIL), c (NEEDS_REVIEW) did not pass; create fix tasks for them. Sub-task verdicts: PASS: 1, FAIL: 1, NEEDS_REVIEW: 1, no verdict: 1.".into()
            }
        );
        // The parent's own VERDICT.md says PASS: the seed's sentence (002 line 457).
        let out = parent_outcome(&mixed, Some(Pass));
        assert_eq!(
            out.to_string(),
            "⚠️ **HUMAN INTERVENTION REQUIRED**: Parent task VERDICT.md says PASS, but sub-task auth-gateway has VERDICT.md with FAIL. Create a fix task for the failing sub-task. Sub-task verdicts: PASS: 1, FAIL: 1, NEEDS_REVIEW: 1, no verdict: 1."
        );

        let review_only = aggregate(&v(&[("a", Some(Pass)), ("b", Some(NeedsReview))]));
        assert!(
            matches!(parent_outcome(&review_only, Some(Pass)), ParentOutcome::HumanIntervention { reason } if reason.contains("sub-task b has VERDICT.md with NEEDS_REVIEW"))
        );

        assert!(
            matches!(parent_outcome(&all_pass, Some(Fail)), ParentOutcome::HumanIntervention { reason } if reason.starts_with("Parent task VERDICT.md says FAIL."))
        );
        assert!(matches!(
            parent_outcome(&aggregate(&[]), None),
            ParentOutcome::HumanIntervention { .. }
        ));
    }

    const FAIL_VERDICT: &str = "# VERDICT — add-user-auth\n\n## Verdict: FAIL\n\n## Findings\n\n\
        - **Null handling**: the parser crashes on an empty body.\n\
        - Perf regression — login takes 3s.\n\
        - None of the other checks failed.\n  - a nested note, not an item\n\n\
        ## Remaining Issues\n\n- docs are thin\n\n\
        ## Notes\n\n- not an item\n";

    #[test]
    fn follow_ups_from_a_fail_verdict_with_two_findings() {
        let got = follow_up_tasks(&task("add-user-auth"), FAIL_VERDICT, None);
        let names: Vec<String> = got.iter().map(|f| f.name.to_string()).collect();
        assert_eq!(
            names,
            [
                "add-user-auth-fix-null-handling",
                "add-user-auth-fix-perf-regression"
            ]
        );
        for f in &got {
            assert_eq!(f.kind, FollowUpKind::Fix);
            assert_eq!(f.start_phase, Phase::BugFind);
            assert_eq!(
                f.copy,
                ["SPEC.md", "BUG_REPORT.md", "ADVERSARIAL_BUG_REPORT.md"]
            );
            assert!(f.empty_implementation);
        }
        assert_eq!(
            got[0].item,
            "**Null handling**: the parser crashes on an empty body."
        );
    }

    #[test]
    fn follow_ups_from_needs_review_and_tie_breaks() {
        let text = "Verdict: NEEDS_REVIEW\n\n**Findings:**\n- x broke\n\n### Remaining issues\n1. Perf: slow\n2) Perf: slower\n\n## Tasks for Review / Tie-Breaks\n* Auth gateway: which token format?\n";
        let got = follow_up_tasks(&task("add-user-auth"), text, None);
        let summary: Vec<(String, FollowUpKind, Phase)> = got
            .iter()
            .map(|f| (f.name.to_string(), f.kind, f.start_phase))
            .collect();
        assert_eq!(
            summary,
            [
                (
                    "add-user-auth-review-perf".to_string(),
                    FollowUpKind::Review,
                    Phase::BugFind
                ),
                (
                    "add-user-auth-review-perf-2".to_string(),
                    FollowUpKind::Review,
                    Phase::BugFind
                ),
                (
                    "add-user-auth-tiebreak-auth-gateway".to_string(),
                    FollowUpKind::Tiebreak,
                    Phase::Research
                ),
            ]
        );
        // A PASS verdict: findings and remaining issues create nothing; tie-breaks still do.
        let pass = text.replace("NEEDS_REVIEW", "PASS");
        let got = follow_up_tasks(&task("add-user-auth"), &pass, None);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].kind, FollowUpKind::Tiebreak);
    }

    #[test]
    fn follow_ups_of_a_subtask_are_named_after_parent_and_subtask() {
        let parent = task("add-user-auth");
        let sub = task("add-user-auth/auth-gateway");
        let text = format!("{FAIL_VERDICT}\n## Tie-Breaks\n- token format\n");
        for (t, p) in [
            (&sub, Some(&parent)),
            (&sub, None),
            (&task("auth-gateway"), Some(&parent)),
        ] {
            let got = follow_up_tasks(t, &text, p);
            let summary: Vec<(String, FollowUpKind, Phase)> = got
                .iter()
                .map(|f| (f.name.to_string(), f.kind, f.start_phase))
                .collect();
            assert_eq!(
                summary,
                [
                    (
                        "add-user-auth-fix-auth-gateway".to_string(),
                        FollowUpKind::Fix,
                        Phase::BugFind
                    ),
                    (
                        "add-user-auth-tiebreak-auth-gateway".to_string(),
                        FollowUpKind::Tiebreak,
                        Phase::Research
                    ),
                ]
            );
            assert!(
                got.iter()
                    .all(|f| f.empty_implementation && f.copy == FOLLOW_UP_COPY)
            );
        }
        let review = "NEEDS_REVIEW\n## Remaining Issues\n- x\n";
        let got = follow_up_tasks(&sub, review, Some(&parent));
        assert_eq!(got.len(), 1);
        assert_eq!(
            got[0].name.to_string(),
            "add-user-auth-fix-auth-gateway",
            "seed 002 line 431: fix for FAIL or NEEDS_REVIEW"
        );
        assert!(follow_up_tasks(&sub, "PASS\n", Some(&parent)).is_empty());
    }

    #[test]
    fn follow_up_names_fit_64_characters() {
        let long_item = format!("- {}\n", "word ".repeat(30));
        let text = format!("FAIL\n## Findings\n{long_item}{long_item}- ü\n");
        for base in [
            "t".to_string(),
            "a".repeat(40),
            "b".repeat(60),
            "c".repeat(64),
        ] {
            let got = follow_up_tasks(&task(&base), &text, None);
            assert_eq!(got.len(), 3, "{base}");
            let names: HashSet<String> = got.iter().map(|f| f.name.to_string()).collect();
            assert_eq!(names.len(), 3, "unique: {names:?}");
            for n in &names {
                assert!(n.len() <= 64 && n.contains("-fix-"), "{n}");
            }
        }
        let got = follow_up_tasks(&task("t"), &text, None);
        assert_eq!(
            got[2].name.to_string(),
            "t-fix-item-3",
            "an item with nothing usable"
        );
    }

    #[test]
    fn fuzz_follow_ups_never_panic_and_names_stay_valid() {
        use crate::fuzz::{assert_no_panics, iterations, run};
        let seeds = [
            FAIL_VERDICT,
            "NEEDS_REVIEW\n## Remaining Issues\n1. a: b\n## Tie-Breaks\n- **x** y\n",
        ];
        let words = [
            "## Findings\n",
            "- ",
            "**",
            "FAIL\n",
            "1) ",
            "## Tasks for Review / Tie-Breaks\n",
        ];
        let long = task(&"x".repeat(64));
        let parent = task("p");
        assert_no_panics(run("follow-ups", iterations(2_000), &seeds, &words, |b| {
            let text = String::from_utf8_lossy(b);
            let mut n = 0;
            for (t, p) in [(&long, None), (&task("t"), None), (&long, Some(&parent))] {
                for f in follow_up_tasks(t, &text, p) {
                    assert!(f.name.leaf().len() <= 64 && !f.name.is_subtask());
                    n += 1;
                }
            }
            n > 0
        }));
    }
}
