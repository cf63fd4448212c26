//! The built-in deterministic agent (`--agent scripted`): the worker's hidden
//! `scripted-agent` subcommand, run as a real child so the same machinery (process group,
//! timeout, kill) is exercised as with a real agent CLI. It reads the `AUTOMATON_*`
//! environment and writes a plausible artifact for the phase; in a phase that allows code
//! edits it also appends a line to `AUTOMATON_SCRIPTED.md` at the workspace root — a
//! sub-task to `AUTOMATON_SCRIPTED.{sub}.md`, its own file, so the sub-tasks of one wave
//! merge into their parent's branch cleanly, and its implement artifact names the other
//! sub-tasks' files it found in its workspace (its dependencies' code, merged before it
//! started). `AUTOMATON_SCRIPTED_SHARED_FILE=1` makes sub-tasks share `AUTOMATON_SCRIPTED.md`
//! again, for the merge-conflict tests.
//!
//! `AUTOMATON_SCRIPTED_BEHAVIOUR` picks a failure for tests: `exit-1`, `hang` (sleeps for
//! ever, ignoring SIGTERM), `no-artifact` (exit 0, nothing written), `slow=<ms>` (sleeps,
//! then behaves normally, printing a line every 100 ms), `fail-after=<ms>` (sleeps, then exits
//! 1). It prints what it does on stdout, and `AUTOMATON_SCRIPTED_SAY` verbatim. The referee's verdict is FAIL when any task input under
//! `.automaton-task/` contains `SCRIPTED: FAIL`, else PASS.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use automaton_workflow::Phase;

use crate::workspace::TASK_DIR;

/// The marker in a task input that makes the scripted referee say FAIL.
pub const FAIL_MARKER: &str = "SCRIPTED: FAIL";
/// The file a code-editing phase appends to.
pub const CODE_FILE: &str = "AUTOMATON_SCRIPTED.md";
/// How much of each input file is read when looking for the marker.
const MAX_INPUT_READ: u64 = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0} is not set: the scripted agent runs under automaton-worker")]
    MissingVar(&'static str),
    #[error("{var} is '{value}': {why}")]
    BadVar {
        var: &'static str,
        value: String,
        why: &'static str,
    },
    #[error(
        "unknown AUTOMATON_SCRIPTED_BEHAVIOUR '{0}': use exit-1, hang, no-artifact, slow=<ms> or fail-after=<ms>"
    )]
    BadBehaviour(String),
    #[error("phase {0} produces no artifact")]
    NoArtifact(Phase),
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot wait: {0}")]
    Runtime(std::io::Error),
}

/// What `AUTOMATON_SCRIPTED_BEHAVIOUR` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    Normal,
    Exit1,
    Hang,
    NoArtifact,
    Slow(Duration),
    FailAfter(Duration),
}

impl Behaviour {
    pub fn parse(s: &str) -> Result<Behaviour, Error> {
        Ok(match s.trim() {
            "" | "normal" => Behaviour::Normal,
            "exit-1" => Behaviour::Exit1,
            "hang" => Behaviour::Hang,
            "no-artifact" => Behaviour::NoArtifact,
            other => {
                let ms = |prefix: &str| {
                    other
                        .strip_prefix(prefix)
                        .and_then(|v| v.parse::<u64>().ok())
                        .map(Duration::from_millis)
                };
                if let Some(d) = ms("slow=") {
                    Behaviour::Slow(d)
                } else if let Some(d) = ms("fail-after=") {
                    Behaviour::FailAfter(d)
                } else {
                    return Err(Error::BadBehaviour(other.to_string()));
                }
            }
        })
    }
}

/// The `scripted-agent` subcommand: reads the environment, behaves, returns the exit code.
pub fn run_from_env() -> Result<u8, Error> {
    let var = |k: &'static str| std::env::var(k).map_err(|_| Error::MissingVar(k));
    let behaviour =
        Behaviour::parse(&std::env::var("AUTOMATON_SCRIPTED_BEHAVIOUR").unwrap_or_default())?;
    let phase_s = var("AUTOMATON_PHASE")?;
    let phase: Phase = phase_s.parse().map_err(|_| Error::BadVar {
        var: "AUTOMATON_PHASE",
        value: phase_s.clone(),
        why: "not a phase",
    })?;
    let task = var("AUTOMATON_TASK")?;
    let token_s = var("AUTOMATON_FENCING_TOKEN")?;
    let token: u64 = token_s.parse().map_err(|_| Error::BadVar {
        var: "AUTOMATON_FENCING_TOKEN",
        value: token_s.clone(),
        why: "not a number",
    })?;
    let workspace = PathBuf::from(var("AUTOMATON_WORKSPACE")?);
    let artifact = match std::env::var("AUTOMATON_ARTIFACT") {
        Ok(a) if !a.is_empty() => PathBuf::from(a),
        _ => artifact_path(phase, &workspace)?,
    };
    // What a real agent prints as it works: the live output tests and the demo read it.
    say(&format!(
        "scripted agent: {phase} of {task} (token {token})"
    ));
    if let Ok(line) = std::env::var("AUTOMATON_SCRIPTED_SAY") {
        say(&line);
    }
    match behaviour {
        Behaviour::Exit1 => return Ok(1),
        Behaviour::NoArtifact => return Ok(0),
        Behaviour::Hang => hang()?,
        Behaviour::Slow(d) => {
            // A line every 100 ms while it "thinks".
            let started = std::time::Instant::now();
            let mut n = 0u32;
            while started.elapsed() < d {
                std::thread::sleep(Duration::from_millis(100).min(d - started.elapsed()));
                n += 1;
                say(&format!("working on {task}: step {n}"));
            }
        }
        Behaviour::FailAfter(d) => {
            std::thread::sleep(d);
            return Ok(1);
        }
        Behaviour::Normal => {}
    }
    let inputs = inputs_text(&workspace, &artifact);
    write_to(phase, &workspace, &artifact, &task, token, &inputs)?;
    report_usage(&workspace);
    Ok(0)
}

/// One line on stdout, flushed (a closed stdout is not the agent's failure).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Reports the peak context used (`.automaton-task/usage.json`): the estimate it was given
/// times `AUTOMATON_SCRIPTED_PEAK_FACTOR` (default 0.9), else 3,000 tokens. Deterministic,
/// so tests and the demo can watch the coordinator learn from it.
fn report_usage(workspace: &Path) {
    let estimate = std::env::var("AUTOMATON_ESTIMATED_TOKENS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok());
    let factor = std::env::var("AUTOMATON_SCRIPTED_PEAK_FACTOR")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|f| f.is_finite() && *f > 0.0 && *f < 100.0)
        .unwrap_or(0.9);
    let peak = estimate.map_or(3000, |e| ((e as f64) * factor).round() as u64);
    let path = workspace.join(TASK_DIR).join(crate::agent::USAGE_FILE);
    let _ = fs::write(path, format!("{{\"peak_context_tokens\": {peak}}}\n"));
}

/// Sleeps for ever; SIGTERM is caught and ignored, so only SIGKILL ends it.
fn hang() -> Result<(), Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    rt.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate()).map_err(Error::Runtime)?;
        loop {
            term.recv().await;
        }
    })
}

/// The text of every input under `.automaton-task/` (but the log and the artifact itself),
/// each file's first MiB.
fn inputs_text(workspace: &Path, artifact: &Path) -> String {
    fn visit(dir: &Path, skip: &[PathBuf], out: &mut String) {
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                visit(&path, skip, out);
            } else if meta.is_file()
                && !skip.contains(&path)
                && let Ok(f) = fs::File::open(&path)
            {
                let mut buf = Vec::new();
                let _ = std::io::Read::read_to_end(
                    &mut std::io::Read::take(f, MAX_INPUT_READ),
                    &mut buf,
                );
                out.push_str(&String::from_utf8_lossy(&buf));
                out.push('\n');
            }
        }
    }
    let task_dir = workspace.join(TASK_DIR);
    let skip = [
        task_dir.join(crate::agent::LOG_FILE),
        artifact.to_path_buf(),
    ];
    let mut out = String::new();
    visit(&task_dir, &skip, &mut out);
    out
}

fn artifact_path(phase: Phase, workspace: &Path) -> Result<PathBuf, Error> {
    let a = phase.artifact().ok_or(Error::NoArtifact(phase))?;
    Ok(workspace.join(TASK_DIR).join(a.file_name()))
}

/// Writes `phase`'s artifact at `{workspace}/.automaton-task/{ARTIFACT}` and, in a phase that
/// allows code edits, appends a line naming the task, phase and fencing token to
/// `{workspace}/AUTOMATON_SCRIPTED.md`. `inputs_text` decides the referee's verdict: FAIL if
/// it contains `SCRIPTED: FAIL`.
pub fn write(
    phase: Phase,
    workspace: &Path,
    task: &str,
    token: u64,
    inputs_text: &str,
) -> Result<(), Error> {
    let artifact = artifact_path(phase, workspace)?;
    write_to(phase, workspace, &artifact, task, token, inputs_text)
}

fn write_to(
    phase: Phase,
    workspace: &Path,
    artifact: &Path,
    task: &str,
    token: u64,
    inputs_text: &str,
) -> Result<(), Error> {
    let spec = fs::read_to_string(workspace.join(TASK_DIR).join("SPEC.md")).unwrap_or_default();
    let text = match (phase, planned_table(&spec)) {
        // A plan a person wrote into SPEC.md is what the decomposition becomes.
        (Phase::Decomposition, Some(table)) => format!(
            "# DECOMPOSITION — {task}\n\n## Sub-tasks\n\n{table}\n_Written by the scripted agent (phase {phase}, fencing token {token}) from the plan in SPEC.md._\n"
        ),
        (Phase::Research, Some(_)) => {
            // Keep the person's spec (with its plan) and say decomposition comes next.
            format!("{}\n\nNext: decomposition\n", spec.trim_end())
        }
        // A spec a person wrote is kept: research refines, it does not replace.
        (Phase::Research, None) if !spec.trim().is_empty() => format!(
            "{}\n\n_Reviewed by the scripted agent (phase {phase}, fencing token {token})._\n",
            spec.trim_end()
        ),
        // A follow-up fix task of a failed one passes: the marker travels in its copied
        // SPEC.md, and a fix that failed again would chain fix tasks for ever.
        _ => artifact_text(
            phase,
            task,
            token,
            inputs_text.contains(FAIL_MARKER) && !task.contains("-fix-"),
        )?,
    };
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Write { path, source }
    };
    let file = code_file(task);
    let text = if phase == Phase::Implement && file != CODE_FILE {
        format!(
            "{}\n## Built on\n\n{}",
            text.replace(CODE_FILE, &file),
            built_on(workspace, &file)
        )
    } else {
        text
    };
    if phase.allows_code_edits() {
        let code = workspace.join(&file);
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&code)
            .map_err(err(&code))?;
        writeln!(f, "- task {task}, phase {phase}, fencing token {token}").map_err(err(&code))?;
    }
    if let Some(parent) = artifact.parent() {
        fs::create_dir_all(parent).map_err(err(parent))?;
    }
    fs::write(artifact, text).map_err(err(artifact))
}

/// With this set to `1` every task, sub-tasks included, appends to [`CODE_FILE`]: sub-tasks
/// of one wave then change the same lines (the merge-conflict tests).
pub const SHARED_FILE_ENV: &str = "AUTOMATON_SCRIPTED_SHARED_FILE";

/// The file a code-editing phase of `task` appends to: [`CODE_FILE`], or for a sub-task
/// (`parent/sub`) `AUTOMATON_SCRIPTED.{sub}.md` (unless [`SHARED_FILE_ENV`] is `1`).
pub fn code_file(task: &str) -> String {
    if std::env::var_os(SHARED_FILE_ENV).is_some_and(|v| v == "1") {
        return CODE_FILE.to_string();
    }
    match task.rsplit_once('/') {
        Some((_, sub)) => format!("AUTOMATON_SCRIPTED.{sub}.md"),
        None => CODE_FILE.to_string(),
    }
}

/// The other sub-tasks' files in the workspace (what this one was built on), as markdown.
fn built_on(workspace: &Path, own: &str) -> String {
    let mut found: Vec<String> = fs::read_dir(workspace)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("AUTOMATON_SCRIPTED.") && n.ends_with(".md") && n != own)
        .collect();
    found.sort();
    if found.is_empty() {
        return "No other sub-task's code was in the workspace.\n".to_string();
    }
    found
        .iter()
        .map(|n| {
            let sub = n
                .trim_start_matches("AUTOMATON_SCRIPTED.")
                .trim_end_matches(".md");
            format!("- `{n}`: sub-task {sub}'s code, read from the workspace.\n")
        })
        .collect()
}

/// The artifact's markdown.
pub fn artifact_text(phase: Phase, task: &str, token: u64, fail: bool) -> Result<String, Error> {
    let artifact = phase.artifact().ok_or(Error::NoArtifact(phase))?;
    let title = format!(
        "# {} — {task}\n\n",
        artifact.file_name().trim_end_matches(".md")
    );
    let origin = format!(
        "_Written by the scripted agent (phase {phase}, fencing token {token}); deterministic, for tests and demos._\n"
    );
    let body = match phase {
        Phase::Research => format!(
            "## Problem\n\nTask `{task}` asks for a small, testable change.\n\n\
             ## Requirements\n\n- The change is covered by a test.\n- Existing behaviour is kept.\n\n\
             ## Out of scope\n\n- Anything not named above.\n"
        ),
        Phase::Decomposition => format!(
            "## Sub-tasks\n\n\
             | sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |\n\
             | --- | --- | --- | --- |\n\
             | {task}-core | — | 12 | the core change; its unit tests pass |\n\
             | {task}-api | {task}-core | 8 | expose the change; an API test passes |\n\
             | {task}-docs | {task}-api | 4 | document the change; the docs build |\n"
        ),
        Phase::Design => "## Approach\n\nOne module, one public function, errors as values.\n\n\
             ## Alternatives\n\n- A new crate: rejected, too much for the change.\n"
            .to_string(),
        Phase::TestDesign => "## Tests\n\n| test | checks |\n| --- | --- |\n\
             | happy_path | the change works on a plain input |\n\
             | bad_input_refused | a malformed input is an error, nothing written |\n"
            .to_string(),
        Phase::Implement => format!(
            "## What changed\n\n- `{CODE_FILE}`: one line naming the task, phase and fencing token.\n\n\
             ## How to test\n\n- Read `{CODE_FILE}`.\n"
        ),
        Phase::CodeReview => "## Findings\n\nNo blocking findings.\n\n\
             ## Summary\n\nThe change is small and tested. Approve.\n"
            .to_string(),
        Phase::BugFind => {
            "## Bugs found\n\nNone.\n\n## Checked\n\n- Empty input.\n- Repeated runs.\n".to_string()
        }
        Phase::AdversarialBugFind => "## Attacks tried\n\n- Paths with `..`: refused.\n\
             - Oversized input: refused.\n\n## Bugs found\n\nNone.\n"
            .to_string(),
        Phase::DocReview => {
            "## Documentation\n\nThe change is documented; no edits needed.\n".to_string()
        }
        Phase::Referee => {
            let (verdict, why) = if fail {
                (
                    "FAIL",
                    format!("The task inputs carry the marker `{FAIL_MARKER}`."),
                )
            } else {
                (
                    "PASS",
                    "Every phase's artifact is present and no bug is open.".to_string(),
                )
            };
            // A FAIL names its finding, so manual mode has a fix task to make (seed 000).
            let findings = if fail {
                "\n## Findings\n\n- scripted failure requested by the task\n"
            } else {
                ""
            };
            format!("Verdict: {verdict}\n\n## Reasons\n\n{why}\n{findings}")
        }
        Phase::New | Phase::Complete | Phase::HumanIntervention => {
            return Err(Error::NoArtifact(phase));
        }
    };
    Ok(format!("{title}{body}\n{origin}"))
}

/// The header a planned decomposition table starts with.
const PLAN_HEADER: &str = "| sub-task |";

/// A decomposition table planned in the task's SPEC.md (its header row starts with
/// `| sub-task |`), with its rows.
fn planned_table(spec: &str) -> Option<String> {
    let lines: Vec<&str> = spec.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.trim_start().to_ascii_lowercase().starts_with(PLAN_HEADER))?;
    let table: Vec<&str> = lines[at..]
        .iter()
        .take_while(|l| l.trim_start().starts_with('|'))
        .copied()
        .collect();
    (table.len() > 2).then(|| table.join("\n") + "\n")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use automaton_workflow::{Verdict, parse_verdict};

    #[test]
    fn every_phase_with_an_artifact_gets_a_non_blank_one() {
        for phase in Phase::ALL {
            let ws = tempfile::tempdir().unwrap();
            let r = write(phase, ws.path(), "fix-login", 7, "");
            let Some(a) = phase.artifact() else {
                assert!(matches!(r, Err(Error::NoArtifact(_))), "{phase}");
                continue;
            };
            r.unwrap();
            let text =
                fs::read_to_string(ws.path().join(".automaton-task").join(a.file_name())).unwrap();
            assert!(text.starts_with("# "), "{phase}: {text}");
            assert!(text.contains("fix-login"), "{phase}");
            assert!(text.trim().len() > 50, "{phase}");
            assert_eq!(
                ws.path().join(CODE_FILE).exists(),
                phase.allows_code_edits(),
                "{phase}: code edits only where allowed"
            );
        }
    }

    #[test]
    fn verdict_parses_as_pass_and_as_fail_with_the_marker() {
        let ws = tempfile::tempdir().unwrap();
        write(Phase::Referee, ws.path(), "t", 1, "# Spec\nall good\n").unwrap();
        let text = fs::read_to_string(ws.path().join(".automaton-task/VERDICT.md")).unwrap();
        assert_eq!(parse_verdict(&text), Some(Verdict::Pass), "{text}");
        write(
            Phase::Referee,
            ws.path(),
            "t",
            1,
            "# Spec\nSCRIPTED: FAIL\n",
        )
        .unwrap();
        let text = fs::read_to_string(ws.path().join(".automaton-task/VERDICT.md")).unwrap();
        assert_eq!(parse_verdict(&text), Some(Verdict::Fail), "{text}");
    }

    #[test]
    fn decomposition_has_the_table() {
        let text = artifact_text(Phase::Decomposition, "big", 3, false).unwrap();
        let header =
            "| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |";
        let lines: Vec<&str> = text.lines().collect();
        let at = lines.iter().position(|l| *l == header).expect("the header");
        let rows: Vec<&str> = lines[at + 2..]
            .iter()
            .take_while(|l| l.starts_with('|'))
            .copied()
            .collect();
        assert_eq!(rows.len(), 3, "{text}");
        for row in rows {
            assert_eq!(row.matches('|').count(), 5, "{row}");
        }
    }

    #[test]
    fn implement_appends_a_line_naming_task_phase_and_token() {
        let ws = tempfile::tempdir().unwrap();
        write(Phase::Implement, ws.path(), "fix-login", 41, "").unwrap();
        write(Phase::Implement, ws.path(), "fix-login", 42, "").unwrap();
        let code = fs::read_to_string(ws.path().join(CODE_FILE)).unwrap();
        assert_eq!(
            code,
            "- task fix-login, phase implement, fencing token 41\n\
             - task fix-login, phase implement, fencing token 42\n"
        );
        assert!(ws.path().join(".automaton-task/IMPLEMENTATION.md").exists());
    }

    #[test]
    fn a_sub_task_writes_its_own_file_and_names_the_files_it_was_built_on() {
        let ws = tempfile::tempdir().unwrap();
        fs::write(
            ws.path().join("AUTOMATON_SCRIPTED.cart-model.md"),
            "- cart\n",
        )
        .unwrap();
        write(Phase::Implement, ws.path(), "checkout/checkout-api", 9, "").unwrap();
        let own = ws.path().join("AUTOMATON_SCRIPTED.checkout-api.md");
        assert_eq!(
            fs::read_to_string(&own).unwrap(),
            "- task checkout/checkout-api, phase implement, fencing token 9\n"
        );
        assert!(!ws.path().join(CODE_FILE).exists());
        let text = fs::read_to_string(ws.path().join(".automaton-task/IMPLEMENTATION.md")).unwrap();
        assert!(
            text.contains("`AUTOMATON_SCRIPTED.cart-model.md`: sub-task cart-model's code"),
            "{text}"
        );
        assert!(
            text.contains("`AUTOMATON_SCRIPTED.checkout-api.md`: one line"),
            "{text}"
        );
        // Alone in its workspace it says so.
        let ws = tempfile::tempdir().unwrap();
        write(Phase::Implement, ws.path(), "checkout/cart-model", 3, "").unwrap();
        let text = fs::read_to_string(ws.path().join(".automaton-task/IMPLEMENTATION.md")).unwrap();
        assert!(text.contains("No other sub-task's code"), "{text}");
    }

    #[test]
    fn inputs_are_read_for_the_marker_but_not_the_log() {
        let ws = tempfile::tempdir().unwrap();
        let task = ws.path().join(".automaton-task");
        fs::create_dir_all(task.join("contracts")).unwrap();
        fs::write(task.join("agent.log"), "SCRIPTED: FAIL in a log").unwrap();
        let art = task.join("VERDICT.md");
        assert!(!inputs_text(ws.path(), &art).contains(FAIL_MARKER));
        fs::write(task.join("contracts/c.md"), "SCRIPTED: FAIL").unwrap();
        assert!(inputs_text(ws.path(), &art).contains(FAIL_MARKER));
    }

    #[test]
    fn behaviours_parse() {
        assert_eq!(Behaviour::parse("").unwrap(), Behaviour::Normal);
        assert_eq!(Behaviour::parse("exit-1").unwrap(), Behaviour::Exit1);
        assert_eq!(Behaviour::parse("hang").unwrap(), Behaviour::Hang);
        assert_eq!(
            Behaviour::parse("no-artifact").unwrap(),
            Behaviour::NoArtifact
        );
        assert_eq!(
            Behaviour::parse("slow=250").unwrap(),
            Behaviour::Slow(Duration::from_millis(250))
        );
        assert_eq!(
            Behaviour::parse("fail-after=40").unwrap(),
            Behaviour::FailAfter(Duration::from_millis(40))
        );
        for bad in ["slow=", "slow=x", "crash"] {
            assert!(Behaviour::parse(bad).is_err(), "{bad}");
        }
    }
}
