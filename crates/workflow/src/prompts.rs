//! The built-in phase prompts: what an agent is told when neither
//! `{project}/.automaton/prompts/{phase}.md` nor `~/.automaton/prompts/{phase}.md` exists.
//!
//! Each phase with work has a markdown template, compiled into the binary
//! (`src/prompts/{phase}.md`), written from seeds 000–004's phase descriptions. The parts that
//! the lifecycle decides are not written in the templates but filled in from this crate when
//! a prompt is rendered, so that a prompt cannot drift from what `automaton status --task`
//! prints or from what the coordinator enforces:
//!
//! | placeholder | filled with |
//! | --- | --- |
//! | `{{phase}}` | the phase's name |
//! | `{{artifact}}`, `{{artifact_path}}` | the artifact (`SPEC.md`) and where it goes (`.automaton-task/SPEC.md`) |
//! | `{{allowed}}`, `{{forbidden}}` | [`guidance`]'s lists for the open phase, one `- ` line each |
//! | `{{inputs}}` | the `.automaton-task/` files the phase may be given |
//! | `{{code_edits}}` | whether the phase may edit code ([`Phase::allows_code_edits`]) |
//! | `{{next}}` | for a gated phase, the legal `Next:` values and the default ([`after_approval`]) |
//! | `{{stop}}` | the stop condition: write the artifact, exit 0, run no transition |
//!
//! Pure functions, like the rest of the crate: the store decides when the built-in prompt is
//! served and `automaton init` writes copies of it.

use crate::artifact::{Artifact, forbidden_in};
use crate::guidance::guidance;
use crate::phase::{Phase, State};
use crate::progress::after_approval;

/// The folder of the workspace the worker puts a run's inputs in, and its artifact.
pub const TASK_DIR: &str = ".automaton-task";

/// How every built-in prompt begins, before the phase's name: the line says where the served
/// prompt came from and how to replace it.
pub const BUILT_IN_MARK: &str = "<!-- automaton: built-in prompt for ";

/// The templates, in lifecycle order.
const TEMPLATES: [(Phase, &str); 10] = [
    (Phase::Research, include_str!("prompts/research.md")),
    (
        Phase::Decomposition,
        include_str!("prompts/decomposition.md"),
    ),
    (Phase::Design, include_str!("prompts/design.md")),
    (Phase::TestDesign, include_str!("prompts/test_design.md")),
    (Phase::Implement, include_str!("prompts/implement.md")),
    (Phase::CodeReview, include_str!("prompts/code_review.md")),
    (Phase::BugFind, include_str!("prompts/bug_find.md")),
    (
        Phase::AdversarialBugFind,
        include_str!("prompts/adversarial_bug_find.md"),
    ),
    (Phase::DocReview, include_str!("prompts/doc_review.md")),
    (Phase::Referee, include_str!("prompts/referee.md")),
];

/// The phases that have a built-in prompt: every phase an agent works in.
pub fn prompt_phases() -> impl Iterator<Item = Phase> {
    TEMPLATES.iter().map(|(p, _)| *p)
}

/// The unrendered template of `phase`, `None` for a phase without work (`new`, `complete`,
/// `human_intervention`).
pub fn prompt_template(phase: Phase) -> Option<&'static str> {
    TEMPLATES.iter().find(|(p, _)| *p == phase).map(|(_, t)| *t)
}

/// The first line of the built-in prompt of `phase`: where it came from, how to override it.
pub fn built_in_header(phase: Phase) -> String {
    let p = phase.name();
    format!(
        "{BUILT_IN_MARK}{p}; override it with {{project}}/.automaton/prompts/{p}.md or ~/.automaton/prompts/{p}.md (`automaton init` writes a copy to edit) -->"
    )
}

/// The built-in prompt of `phase` as it is served: [`built_in_header`], then
/// [`prompt_body`]. `None` for a phase without work.
pub fn built_in_prompt(phase: Phase) -> Option<String> {
    let body = prompt_body(phase)?;
    Some(format!("{}\n{body}", built_in_header(phase)))
}

/// The template of `phase` with every placeholder filled (no header line).
pub fn prompt_body(phase: Phase) -> Option<String> {
    let template = prompt_template(phase)?;
    let artifact = phase.artifact()?;
    let g = guidance("TASK", State::open(phase));
    let values = [
        ("phase", phase.name().to_string()),
        ("artifact", artifact.file_name().to_string()),
        ("artifact_path", artifact_path(artifact)),
        ("allowed", bullets(&g.allowed)),
        ("forbidden", bullets(&g.forbidden)),
        ("inputs", inputs(phase, artifact)),
        ("code_edits", code_edits(phase, artifact)),
        ("next", next(phase, artifact)),
        ("stop", stop(phase, artifact)),
    ];
    let mut out = template.to_string();
    for (key, value) in values {
        out = out.replace(&format!("{{{{{key}}}}}"), &value);
    }
    Some(out)
}

/// `.automaton-task/SPEC.md`: where the agent writes `artifact`, relative to the workspace.
pub fn artifact_path(artifact: Artifact) -> String {
    format!("{TASK_DIR}/{}", artifact.file_name())
}

fn bullets(items: &[String]) -> String {
    items
        .iter()
        .map(|i| format!("- {i}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The phases that review a change already made: they are given `changes.diff`.
fn reviews_a_change(phase: Phase) -> bool {
    matches!(
        phase,
        Phase::CodeReview
            | Phase::BugFind
            | Phase::AdversarialBugFind
            | Phase::DocReview
            | Phase::Referee
    )
}

/// The `.automaton-task/` files a run of `phase` may be given (the store serves those that
/// exist): the artifacts not forbidden in the phase, a sub-task's and a follow-up's own files,
/// the project's rules and contracts, and the diff for the phases that review a change.
fn inputs(phase: Phase, own: Artifact) -> String {
    let d = TASK_DIR;
    let mut lines = vec![
        format!(
            "Everything is in `{d}/` in the workspace; only the files that exist for this task are there (`ls {d}/`)."
        ),
        String::new(),
        format!("- `{d}/prompt.md`: this prompt."),
    ];
    let earlier: Vec<String> = Artifact::ALL
        .into_iter()
        .filter(|a| *a != own && !forbidden_in(phase).contains(a))
        .map(|a| format!("`{}`", a.file_name()))
        .collect();
    if !earlier.is_empty() {
        lines.push(format!(
            "- The task's artifacts so far, each at `{d}/{{NAME}}`: {}.",
            earlier.join(", ")
        ));
    }
    lines.push(format!(
        "- `{d}/{}` itself, when a run before this one (or the task's creation, for a follow-up task) left one: revise it.",
        own.file_name()
    ));
    lines.push(format!(
        "- `{d}/PARENT_SPEC.md` and `{d}/VRAM_CONFIG.md`, when the task is a sub-task: its scope and acceptance from the parent's DECOMPOSITION.md, and the context budget it must fit."
    ));
    lines.push(format!(
        "- `{d}/PREVIOUS_*.md`, when the task is a fix, review or tie-break task: the original task's artifacts, for what was tried; or when its code went back to implement (below): the reviews of the revision before."
    ));
    if phase == Phase::Implement {
        lines.push(format!(
            "- `{d}/CONFLICTS.md`, when the task's code could not land as it was reviewed (another task changed the same lines first): the paths both changed and both sides. The branch now builds on the other side's code and holds its version of those paths: bring your change back into them, keeping theirs, and say so in IMPLEMENTATION.md."
        ));
    }
    lines.push(format!(
        "- `{d}/rules.md` and `{d}/contracts/*.md`, when the project has them: rules and contracts the work must keep."
    ));
    if reviews_a_change(phase) {
        lines.push(format!(
            "- `{d}/changes.diff`, when the worker provides it: the task branch against its base commit (`$AUTOMATON_BASE_COMMIT`), i.e. what the implementation changed."
        ));
    }
    lines.push(
        "- The project's code: the workspace root (your current directory, `$AUTOMATON_WORKSPACE`), at the head of the task's branch."
            .to_string(),
    );
    lines.join("\n")
}

fn code_edits(phase: Phase, own: Artifact) -> String {
    let path = artifact_path(own);
    if phase.allows_code_edits() {
        format!(
            "Allowed in this phase (`automaton status --can-edit` says ALLOWED). Edit the project's files in place, in the workspace root; every file you change outside `{TASK_DIR}/` becomes this phase's commit on the task's branch. Write `{path}` as well."
        )
    } else {
        format!(
            "Not allowed in this phase (`automaton status --can-edit` says DENIED): it is read-only. Read the code and run it as you need, but change nothing outside `{TASK_DIR}/`: changes to the project's files are not kept. Your only output is `{path}`."
        )
    }
}

/// For a gated phase: what its artifact's `Next:` line may name after approval.
fn next(phase: Phase, own: Artifact) -> String {
    let approved = State::approved(phase);
    let legal: Vec<String> = approved
        .legal_targets()
        .iter()
        .map(|s| format!("`{}`", s.phase))
        .collect();
    if !phase.is_gated() || legal.is_empty() {
        return format!("{} needs no `Next:` line.", own.file_name());
    }
    let default = match after_approval(approved, None) {
        Ok(Some(s)) => format!("without the line, the task goes on to `{}`", s.phase),
        _ => "without the line, the task waits for a person".to_string(),
    };
    format!(
        "Write `Next: <phase>` on a line of its own in {}, naming one of {} ({default}). A phase that is not one of these holds the task for a person.",
        own.file_name(),
        legal.join(", ")
    )
}

fn stop(phase: Phase, own: Artifact) -> String {
    let path = artifact_path(own);
    let then: Vec<String> = State::open(phase)
        .legal_targets()
        .iter()
        .map(|s| format!("`{s}`"))
        .collect();
    let then = match phase {
        Phase::Referee => "`complete` on PASS, `human_intervention` otherwise".to_string(),
        _ if phase.is_gated() => format!(
            "{}, where a person reads and approves it",
            then.join(" or ")
        ),
        _ => then.join(" or "),
    };
    let uploads = if phase.allows_code_edits() {
        "the artifact and your code changes"
    } else {
        "the artifact"
    };
    format!(
        "Write `{path}` (not at the workspace root: it belongs in `{TASK_DIR}/`), non-empty, then exit with status 0. That is the whole stop condition.\n\n\
         Do not run `automaton status --transition`, `--approve` or `--claim` yourself, and do not write another phase's artifact: the worker uploads {uploads} and completes the phase, and the coordinator moves the task to {then}. A missing or empty `{}`, or a non-zero exit, fails the run.",
        own.file_name()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decomposition::parse_decomposition;
    use crate::subtasks::follow_up_tasks;
    use crate::verdict::{Verdict, parse_verdict};

    /// The lines of a `- ` list that follows `heading` in `text`.
    fn section(text: &str, heading: &str) -> Vec<String> {
        text.lines()
            .skip_while(|l| l.trim() != heading)
            .skip(1)
            .skip_while(|l| l.trim().is_empty())
            .take_while(|l| l.starts_with("- "))
            .map(|l| l[2..].to_string())
            .collect()
    }

    /// The first ```markdown block of `text`.
    fn example(text: &str) -> String {
        text.lines()
            .skip_while(|l| l.trim() != "```markdown")
            .skip(1)
            .take_while(|l| l.trim() != "```")
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn issue21_prompts_every_phase_with_work_has_a_prompt_and_no_other_phase_does() {
        let with: Vec<Phase> = prompt_phases().collect();
        let want: Vec<Phase> = Phase::ALL
            .into_iter()
            .filter(|p| p.artifact().is_some())
            .collect();
        assert_eq!(with, want);
        for p in [Phase::New, Phase::Complete, Phase::HumanIntervention] {
            assert_eq!(built_in_prompt(p), None, "{p}");
        }
    }

    #[test]
    fn issue21_prompts_every_prompt_names_its_artifact_and_where_it_goes() {
        for p in prompt_phases() {
            let text = built_in_prompt(p).expect("a prompt");
            let a = p.artifact().expect("an artifact");
            let path = format!(".automaton-task/{}", a.file_name());
            assert!(text.contains(&format!("**{}**", a.file_name())), "{p}");
            assert!(text.contains(&format!("`{path}`")), "{p}: {path}");
            assert!(text.contains("$AUTOMATON_ARTIFACT"), "{p}");
            assert!(!text.contains("{{"), "{p}: a placeholder is left");
            assert!(!text.contains("}}"), "{p}: a placeholder is left");
            assert!(
                text.starts_with(&format!("{BUILT_IN_MARK}{}; ", p.name())),
                "{p}: the header says where it came from"
            );
            assert_eq!(
                text.lines().filter(|l| l.contains(BUILT_IN_MARK)).count(),
                1
            );
            assert!(
                text.contains(&format!(".automaton/prompts/{}.md", p.name())),
                "{p}: the header says how to override it"
            );
        }
    }

    /// The lists are [`guidance`]'s, item for item and in order: the prompt says what
    /// `automaton status --task` prints in the same phase.
    #[test]
    fn issue21_prompts_every_prompts_allowed_and_forbidden_lists_equal_guidance() {
        for p in prompt_phases() {
            let text = built_in_prompt(p).expect("a prompt");
            let g = guidance("any-task", State::open(p));
            assert_eq!(section(&text, "## Allowed actions"), g.allowed, "{p}");
            assert_eq!(section(&text, "## Forbidden actions"), g.forbidden, "{p}");
            assert!(!g.forbidden.is_empty(), "{p}");
        }
    }

    #[test]
    fn issue21_prompts_every_prompt_says_whether_code_may_be_edited_and_when_to_stop() {
        for p in prompt_phases() {
            let text = built_in_prompt(p).expect("a prompt");
            let edits = text
                .split("## Code edits")
                .nth(1)
                .and_then(|s| s.lines().find(|l| !l.trim().is_empty()))
                .unwrap_or_default();
            if p.allows_code_edits() {
                assert!(edits.starts_with("Allowed in this phase"), "{p}: {edits}");
            } else {
                assert!(
                    edits.starts_with("Not allowed in this phase"),
                    "{p}: {edits}"
                );
            }
            assert!(text.contains("then exit with status 0"), "{p}");
            assert!(
                text.contains("Do not run `automaton status --transition`"),
                "{p}"
            );
            assert!(text.contains("`.automaton-task/prompt.md`"), "{p}");
            assert_eq!(
                text.contains("changes.diff"),
                reviews_a_change(p),
                "{p}: the diff is named where it is given"
            );
        }
    }

    #[test]
    fn issue21_prompts_later_phases_name_the_earlier_artifacts_as_inputs() {
        let implement = built_in_prompt(Phase::Implement).expect("a prompt");
        for a in ["SPEC.md", "DESIGN.md", "TEST_PLAN.md"] {
            assert!(implement.contains(&format!("`{a}`")), "{a}");
        }
        let referee = built_in_prompt(Phase::Referee).expect("a prompt");
        for a in Artifact::ALL
            .into_iter()
            .filter(|a| *a != Artifact::Verdict)
        {
            assert!(referee.contains(&format!("`{}`", a.file_name())), "{a}");
        }
        let research = built_in_prompt(Phase::Research).expect("a prompt");
        assert!(!research.contains("The task's artifacts so far"));
        for p in prompt_phases() {
            let text = built_in_prompt(p).expect("a prompt");
            assert!(text.contains("PARENT_SPEC.md") && text.contains("VRAM_CONFIG.md"));
            // Issue 31: a task sent back to implement is told where its conflicts are.
            assert_eq!(text.contains("CONFLICTS.md"), p == Phase::Implement, "{p}");
        }
    }

    /// The research and decomposition prompts' example tables are tables automaton reads.
    #[test]
    fn issue21_prompts_the_sub_task_tables_the_prompts_show_parse() {
        for p in [Phase::Research, Phase::Decomposition] {
            let text = built_in_prompt(p).expect("a prompt");
            let plan = parse_decomposition(&example(&text)).expect("the example parses");
            assert!(plan.subtasks.len() >= 3, "{p}");
        }
        let research = built_in_prompt(Phase::Research).expect("a prompt");
        assert!(research.contains(
            "`Next: <phase>` on a line of its own in SPEC.md, naming one of `decomposition`, `design`, `implement` (without the line, the task goes on to `design`)"
        ));
        for (next, to) in [
            ("Next: implement", Phase::Implement),
            ("Next: design", Phase::Design),
            ("Next: decomposition", Phase::Decomposition),
        ] {
            assert!(research.contains(&format!("`{next}`")), "{next}");
            assert_eq!(
                after_approval(State::approved(Phase::Research), Some(next)),
                Ok(Some(State::open(to)))
            );
        }
    }

    /// The verdict line the referee prompt asks for is the one the parser reads, and its
    /// example's sections make the follow-up tasks the prompt says they make.
    #[test]
    fn issue21_prompts_the_referee_prompt_says_the_verdict_line_the_parser_reads() {
        let text = built_in_prompt(Phase::Referee).expect("a prompt");
        for word in ["PASS", "FAIL", "NEEDS_REVIEW"] {
            let line = format!("Verdict: {word}");
            assert!(text.contains(&format!("`{line}`")), "{line}");
            assert!(parse_verdict(&line).is_some(), "{line}");
        }
        for heading in [
            "## Findings",
            "## Remaining Issues",
            "## Tasks for Review / Tie-Breaks",
        ] {
            assert!(text.contains(&format!("`{heading}`")), "{heading}");
        }
        let verdict = example(&text);
        assert_eq!(parse_verdict(&verdict), Some(Verdict::Fail));
        let task = "add-user-auth".parse().expect("name");
        let made: Vec<String> = follow_up_tasks(&task, &verdict, None)
            .into_iter()
            .map(|f| f.name.to_string())
            .collect();
        assert_eq!(made, vec!["add-user-auth-fix-null-handling"]);
        assert!(text.contains("`{task}-fix-null-handling`"));
        // Nothing in the prompt itself reads as a verdict: an agent quoting it decides nothing.
        assert_eq!(parse_verdict(&text.replace(&verdict, "")), None);
    }
}
