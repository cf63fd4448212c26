//! `automaton init [--project DIR]`: writes a project's `.automaton/` skeleton — `.agent.md`
//! with the policy's defaults explained, a `.gitignore` for the files a coordinator writes
//! while it runs, and `prompts/{phase}.md`, copies of the built-in prompts to edit — and prints
//! one line per file: `wrote`, `kept` (it exists; never overwritten) or `skipped` (a file
//! elsewhere decides that now, and a new one here would silently replace it).
//!
//! Idempotent: a second run writes nothing and says so. What it writes changes nothing until a
//! person edits it: `.agent.md` sets the defaults, each prompt is the built-in one, and a
//! project file that would shadow the user's `~/.automaton/` file (or a root-level
//! `.agent.md`, still honoured) is not written.
//!
//! Each file appears whole or not at all, and never over one that appeared meanwhile: it is
//! written and synced in `.automaton/tmp/` (named as the store names its temporaries, so a
//! killed run's leftover is swept), then hard-linked into place, which fails on an existing
//! name.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use automaton_store::Project;
use automaton_workflow::{DEFAULT_LOCK_TIMEOUT, Policy, prompt_body, prompt_phases};
use clap::Args;

#[derive(Debug, Args)]
pub struct InitArgs {
    /// Project folder (default: the current directory). The skeleton goes in
    /// {project}/.automaton/ (or in ~/.automaton itself when that is the project).
    #[arg(long, value_name = "PATH")]
    pub project: Option<PathBuf>,
}

/// What happened to one file of the skeleton.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Wrote,
    /// Something is already there; it is left as it is.
    Kept,
    /// Not written: the reason names the file that decides instead.
    Skipped(String),
}

/// One file of the skeleton: where it goes below `.automaton/`, and its content.
struct Entry {
    rel: String,
    content: String,
    /// The file a new one would shadow (the layered lookup reads the project's first).
    shadows: Option<PathBuf>,
}

/// Runs `automaton init`; prints one line per file and returns the exit code.
pub fn run(args: &InitArgs) -> i32 {
    match init(args) {
        Ok(text) => {
            print!("{text}");
            0
        }
        Err(msg) => {
            eprintln!("ERROR: {msg}");
            2
        }
    }
}

fn init(args: &InitArgs) -> Result<String, String> {
    let cwd = std::env::current_dir()
        .map_err(|e| format!("cannot read the current directory: {e}: pass --project DIR"))?;
    let root = args.project.clone().unwrap_or(cwd);
    let home = std::env::var_os("HOME").map(PathBuf::from);
    match fs::metadata(&root) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(format!(
                "{} is not a folder: pass --project with the project's folder",
                root.display()
            ));
        }
        Err(e) => {
            return Err(format!(
                "cannot open the project folder {}: {e}: create it, or pass --project with an existing folder",
                root.display()
            ));
        }
    }
    let project = Project::open(&root, home.as_deref());
    let results = write_skeleton(&project, home.as_deref())?;
    Ok(report(&results))
}

/// Writes every file of the skeleton that is missing; what happened to each, in order.
pub fn write_skeleton(
    project: &Project,
    home: Option<&Path>,
) -> Result<Vec<(PathBuf, Outcome)>, String> {
    let meta = project.meta().to_path_buf();
    let user = home.map(|h| h.join(".automaton"));
    let tmp = meta.join("tmp");
    let entries = entries(project, user.as_deref());
    // Every folder checked before anything is written, so that a refusal leaves nothing
    // half done. The project's own layer is not read through links (the store refuses them):
    // nothing is written through one either. `.automaton` itself may be a link, as the store
    // allows.
    let mut dirs = vec![meta.clone(), tmp.clone()];
    for e in &entries {
        if let Some(parent) = meta.join(&e.rel).parent()
            && !dirs.iter().any(|d| d == parent)
        {
            dirs.push(parent.to_path_buf());
        }
    }
    for dir in &dirs {
        if *dir != meta {
            refuse_link(dir)?;
        }
        refuse_file(dir)?;
    }
    for dir in &dirs {
        fs::create_dir_all(dir).map_err(|e| cannot("create", dir, &e))?;
    }
    let mut out = Vec::new();
    for entry in entries {
        let target = meta.join(&entry.rel);
        let outcome = if target.symlink_metadata().is_ok() {
            Outcome::Kept
        } else if let Some(other) = entry.shadows.filter(|o| o.exists() && !same(o, &target)) {
            Outcome::Skipped(other.display().to_string())
        } else {
            place(&tmp, &target, entry.content.as_bytes())?
        };
        out.push((target, outcome));
    }
    Ok(out)
}

fn report(results: &[(PathBuf, Outcome)]) -> String {
    let mut s = String::new();
    for (path, outcome) in results {
        let p = path.display();
        let line = match outcome {
            Outcome::Wrote => format!("wrote   {p}"),
            Outcome::Kept => format!("kept    {p} (it exists; not overwritten)"),
            Outcome::Skipped(other) => format!(
                "skipped {p} ({other} is read instead, and a new file here would replace it; copy it here to give the project its own)"
            ),
        };
        s.push_str(&line);
        s.push('\n');
    }
    let wrote = results.iter().filter(|(_, o)| *o == Outcome::Wrote).count();
    if wrote == 0 {
        s.push_str("Nothing written: every file of the skeleton is already in place.\n");
    } else {
        s.push_str(&format!(
            "Wrote {wrote} file{}. Edit .automaton/prompts/{{phase}}.md to change what agents are told, .automaton/.agent.md for the policy (docs/prompts.md).\n",
            if wrote == 1 { "" } else { "s" }
        ));
    }
    s
}

fn entries(project: &Project, user: Option<&Path>) -> Vec<Entry> {
    // A root-level `.agent.md` is honoured while the project has no `.automaton/.agent.md`:
    // writing one would silently replace it.
    let legacy = project
        .misplaced_agent_md()
        .filter(|(_, honoured)| *honoured)
        .map(|(p, _)| p);
    let mut out = vec![
        Entry {
            rel: ".agent.md".into(),
            content: agent_md(),
            shadows: legacy.or_else(|| user.map(|u| u.join(".agent.md"))),
        },
        Entry {
            rel: ".gitignore".into(),
            content: GITIGNORE.into(),
            shadows: None,
        },
    ];
    for phase in prompt_phases() {
        let rel = format!("prompts/{}.md", phase.name());
        let Some(body) = prompt_body(phase) else {
            continue;
        };
        out.push(Entry {
            content: format!("{}\n{body}", copy_header(phase.name())),
            shadows: user.map(|u| u.join(&rel)),
            rel,
        });
    }
    out
}

/// The first line of a prompt `automaton init` wrote.
pub fn copy_header(phase: &str) -> String {
    format!(
        "<!-- automaton init: a copy of the built-in prompt for {phase}. This file is served instead of it: edit it freely; delete it to go back to the built-in prompt, which follows automaton's upgrades. -->"
    )
}

/// `.agent.md` with every key the policy reads, each set to its default and explained.
pub fn agent_md() -> String {
    let d = Policy::default();
    let minutes = DEFAULT_LOCK_TIMEOUT.as_secs() / 60;
    let separated = if d.separated.is_empty() {
        "none".to_string()
    } else {
        d.separated
            .iter()
            .map(|p| p.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mode = if d.multi_agent {
        "multi-agent"
    } else {
        "single-agent"
    };
    let autopilot = if d.autopilot { "Enabled" } else { "Disabled" };
    format!(
        "# Agent policy\n\
\n\
automaton reads the `Key: value` lines of this file (keys in any case; `- **Key**: value`\n\
works too) and ignores everything else. Each value below is the default, so this file as\n\
written changes nothing: edit a value to change it. This file replaces\n\
`~/.automaton/.agent.md` for this project, whole: a key it does not set takes the default.\n\
A coordinator reads it when it starts; restart it after an edit.\n\
\n\
## Mode\n\
\n\
`single-agent` or `multi-agent`. In multi-agent mode an agent claims a task before working\n\
on it (a lease in the task's `.state.lock`, `automaton status --claim`), and a transition\n\
needs the lease.\n\
\n\
Mode: {mode}\n\
\n\
## Lock timeout\n\
\n\
How long a claim lasts without renewal: a number with a unit, e.g. `90s`, `30m`, `1h`,\n\
`30 minutes` (a bare number means minutes).\n\
\n\
Lock timeout: {minutes}m\n\
\n\
## Separated phases\n\
\n\
Phases that the agent who implemented a task may neither work in nor approve (reviewer ≠\n\
implementer): phase names separated by commas, or `none`.\n\
\n\
Separated phases: {separated}\n\
\n\
## Autopilot\n\
\n\
`Enabled`: the coordinator drives every task to `complete` or `human_intervention` and\n\
creates no fix, review or tie-break tasks on its own. `Disabled` (manual mode): no phase\n\
runs until `automaton run TASK`, and a FAIL or NEEDS_REVIEW verdict creates follow-up tasks.\n\
\n\
Autopilot: {autopilot}\n"
    )
}

/// What a coordinator (and the status commands) write below `.automaton/` while they run.
/// The rest is the project's record and is versioned: `.agent.md`, `.rules.md`, `prompts/`,
/// `contracts/`, `scripts/`, and every task's `.state`, `.state.approvals`,
/// `.state.implementer`, `.state.holders` and artifacts.
pub const GITIGNORE: &str = "\
# automaton: files written below .automaton/ while a coordinator or the status commands run.
# They describe this machine's running fleet (leases, fencing counters, completion records,
# temporaries, dispatch bookkeeping, deliveries: the merge itself is in git) and mean nothing in
# another checkout: do not commit them.
# Everything else here is the project's record, to commit: .agent.md, .rules.md, prompts/,
# contracts/, scripts/, and in tasks/ each task's .state, .state.approvals,
# .state.implementer, .state.holders and artifacts (SPEC.md, ...).
/coordinator.lock
/leases.wal
/fencing
/completions/
/tmp/
/.vram_cache.json
tasks/**/.state.lock
tasks/**/.state.dispatch
tasks/**/.state.base
tasks/**/.state.branch
tasks/**/.state.delivery
";

/// Whether `a` and `b` name the same file (the project is `~/.automaton` itself).
fn same(a: &Path, b: &Path) -> bool {
    match (fs::canonicalize(a), b.parent().map(fs::canonicalize)) {
        (Ok(a), Some(Ok(dir))) => b.file_name().is_some_and(|n| dir.join(n) == a),
        _ => false,
    }
}

fn refuse_link(dir: &Path) -> Result<(), String> {
    match dir.symlink_metadata() {
        Ok(m) if m.file_type().is_symlink() => Err(format!(
            "{} is a symbolic link: automaton reads nothing through a link in the project's .automaton/, so init writes nothing through one: replace it with a folder",
            dir.display()
        )),
        _ => Ok(()),
    }
}

fn refuse_file(dir: &Path) -> Result<(), String> {
    match fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Err(format!(
            "{} is a file, not a folder: move it away, then run automaton init again",
            dir.display()
        )),
        _ => Ok(()),
    }
}

fn cannot(action: &str, path: &Path, e: &std::io::Error) -> String {
    format!(
        "cannot {action} {}: {e}: make the project folder writable for this user, or run automaton init as its owner",
        path.display()
    )
}

/// Writes `bytes` at `target` unless something is there by then: synced in `tmp`, then
/// hard-linked into place (which refuses an existing name), then the temporary removed.
fn place(tmp: &Path, target: &Path, bytes: &[u8]) -> Result<Outcome, String> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    // `{pid}.{seq}.{what}.tmp`: the store's own naming, so its sweep removes a killed run's.
    let temp = tmp.join(format!("{}.{seq}.init-{name}.tmp", std::process::id()));
    let written = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(cannot("write", &temp, &e));
    }
    let linked = fs::hard_link(&temp, target);
    let _ = fs::remove_file(&temp);
    match linked {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(Outcome::Kept),
        Err(e) => return Err(cannot("write", target, &e)),
    }
    if let Some(dir) = target.parent() {
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| cannot("sync", dir, &e))?;
    }
    Ok(Outcome::Wrote)
}

#[cfg(test)]
mod tests {
    use super::*;
    use automaton_workflow::PolicyFile;

    /// The skeleton's `.agent.md` sets exactly the defaults, for every key the policy reads.
    #[test]
    fn issue21_prompts_the_agent_md_skeleton_sets_every_key_to_its_default() {
        let text = agent_md();
        let file = PolicyFile::parse(&text).expect("the skeleton parses");
        assert!(file.mode.is_some() && file.lock_timeout.is_some());
        assert!(file.separated.is_some() && file.autopilot.is_some());
        assert_eq!(
            Policy::layered(&file, &PolicyFile::default()),
            Policy::default()
        );
    }

    #[test]
    fn issue21_prompts_the_gitignore_names_the_runtime_files_and_keeps_the_record() {
        for runtime in [
            "/coordinator.lock",
            "/leases.wal",
            "/fencing",
            "/completions/",
            "/tmp/",
            "tasks/**/.state.lock",
            "tasks/**/.state.dispatch",
            "tasks/**/.state.base",
            "tasks/**/.state.delivery",
        ] {
            assert!(GITIGNORE.lines().any(|l| l == runtime), "{runtime}");
        }
        let patterns: Vec<&str> = GITIGNORE.lines().filter(|l| !l.starts_with('#')).collect();
        for kept in [
            ".agent.md",
            "prompts",
            ".state\n",
            ".state.approvals",
            "SPEC.md",
        ] {
            assert!(
                !patterns.iter().any(|p| p.ends_with(kept.trim())),
                "{kept} is versioned"
            );
        }
    }
}
