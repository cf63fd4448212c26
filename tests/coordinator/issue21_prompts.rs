//! Issue 21, "default phase prompts, built in": a fresh project with no prompts serves each
//! phase's built-in prompt to a real worker; a project prompt overrides the user's
//! `~/.automaton/prompts/`, which overrides the built-in one; `automaton init` writes the
//! `.automaton/` skeleton once, keeps what exists, and its `.gitignore` leaves out exactly
//! what a running coordinator writes. Real coordinator, real worker (its agent copies
//! `.automaton-task/prompt.md` into the artifact, so the served prompt lands in the task
//! folder), real CLI.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use automaton_workflow::{BUILT_IN_MARK, Phase, State, built_in_prompt, guidance};

use crate::harness::*;
use crate::work::{FLEET, git, git_init};
use crate::workers::Worker;

/// The agent: the served prompt becomes the artifact, byte for byte.
const COPY_PROMPT: &str = "cp {prompt_file} {artifact}";

fn copying_worker(coord: &Coord) -> Worker {
    Worker::start(
        &coord.url,
        &[
            "--name",
            "gpu-p",
            "--simulate-gpu",
            "sim:24GiB",
            "--agent",
            COPY_PROMPT,
            "--kill-grace",
            "300ms",
        ],
        &[],
    )
}

/// Creates `task` (the coordinator starts its research) and waits for its research run to
/// finish; the SPEC.md it wrote (the prompt it was served).
async fn research_prompt(api: &mut Api, env: &Env, w: &Worker, task: &str) -> String {
    api.create(task).await.expect("create");
    poll(
        &format!("{task}'s research run to write SPEC.md"),
        Duration::from_secs(60),
        || {
            let mut api = api.clone();
            async move { (api.state(task).await == "research:awaiting_approval").then_some(()) }
        },
    )
    .await;
    let spec = env.task_file(task, "SPEC.md").unwrap_or_default();
    String::from_utf8(spec).unwrap_or_else(|_| panic!("SPEC.md is text; {}", w.stderr()))
}

/// `automaton init [--project ROOT]` with HOME = `home`.
fn init(root: &Path, home: &Path, project_flag: bool) -> Run {
    let mut c = Command::new(cli_bin());
    c.arg("init");
    if project_flag {
        c.arg("--project").arg(root);
    }
    for k in SCRUBBED_ENV {
        c.env_remove(k);
    }
    c.env("HOME", home)
        .current_dir(if project_flag { home } else { root });
    run_bounded(c, Duration::from_secs(30))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_prompts_a_fresh_project_serves_the_built_in_prompt_to_a_real_worker() {
    let env = Env::new();
    git_init(&env);
    assert!(!env.root().join(".automaton/prompts").exists());
    assert!(!env.home.path().join(".automaton").exists());
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // What `automaton status --task` prints in research, before any worker takes it.
    api.create("s").await.expect("create");
    api.transition("s", "research").await.expect("research");
    let status = env.cli(&["--task", "s"]);
    status.ok();
    let printed = |heading: &str| -> Vec<String> {
        status
            .stdout
            .lines()
            .skip_while(|l| *l != heading)
            .skip(1)
            .map_while(|l| l.strip_prefix("  - "))
            .map(str::to_string)
            .collect()
    };
    let w = copying_worker(&coord);
    let served = research_prompt(&mut api, &env, &w, "t").await;
    let want = built_in_prompt(Phase::Research).expect("a research prompt");
    assert_eq!(served, want, "the built-in prompt, byte for byte");
    // What the agent reads: where it came from, its artifact and where it goes, what it may
    // not do (as `automaton status --task` prints it), and when to stop.
    assert!(
        served.starts_with(&format!("{BUILT_IN_MARK}research; override it with")),
        "{served}"
    );
    assert!(served.contains("Write **SPEC.md** at `.automaton-task/SPEC.md`"));
    let g = guidance("t", State::open(Phase::Research));
    assert!(g.forbidden.len() >= 5);
    for f in &g.forbidden {
        assert!(served.contains(&format!("\n- {f}\n")), "forbidden: {f}");
    }
    for a in &g.allowed {
        assert!(served.contains(&format!("\n- {a}\n")), "allowed: {a}");
    }
    assert_eq!(printed("Forbidden actions:"), g.forbidden, "{status:?}");
    assert_eq!(printed("Allowed actions:"), g.allowed, "{status:?}");
    assert!(served.contains("then exit with status 0"));
    assert!(served.contains("Do not run `automaton status --transition`"));
    assert!(served.contains("`Next: decomposition`"));
    assert!(served.contains(
        "| sub-task | depends on | estimated peak context (k tokens) | scope / acceptance |"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_prompts_a_project_prompt_overrides_the_home_one_which_overrides_the_built_in() {
    let env = Env::new();
    git_init(&env);
    // The coordinator's HOME is env.home: its ~/.automaton/prompts/ is the user's layer.
    let user = env.home.path().join(".automaton/prompts");
    std::fs::create_dir_all(&user).expect("mkdir");
    std::fs::write(user.join("research.md"), "HOME research prompt\n").expect("home prompt");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let w = copying_worker(&coord);
    assert_eq!(
        research_prompt(&mut api, &env, &w, "a").await,
        "HOME research prompt\n"
    );
    // `automaton init` does not shadow the user's prompt with a copy of the built-in one.
    let r = init(env.root(), env.home.path(), true);
    r.ok();
    let own = env.root().join(".automaton/prompts/research.md");
    assert!(
        r.stdout.contains(&format!(
            "skipped {} ({} is read instead",
            own.display(),
            user.join("research.md").display()
        )),
        "{r:?}"
    );
    assert!(!own.exists());
    assert_eq!(
        research_prompt(&mut api, &env, &w, "b").await,
        "HOME research prompt\n"
    );
    // The project's own prompt wins over the user's.
    std::fs::write(&own, "PROJECT research prompt\n").expect("project prompt");
    assert_eq!(
        research_prompt(&mut api, &env, &w, "c").await,
        "PROJECT research prompt\n"
    );
    // And with neither, the built-in one again.
    std::fs::remove_file(&own).expect("rm");
    std::fs::remove_file(user.join("research.md")).expect("rm");
    assert_eq!(
        research_prompt(&mut api, &env, &w, "d").await,
        built_in_prompt(Phase::Research).expect("built in")
    );
    // The skeleton's .gitignore, after a coordinator and a worker ran four tasks: git sees
    // the project's record and nothing of the running fleet.
    let untracked = git(&env, &["status", "--porcelain", "-uall", ".automaton"]);
    let paths: Vec<&str> = untracked
        .lines()
        .filter_map(|l| l.strip_prefix("?? "))
        .collect();
    let record = |p: &str| {
        let rel = p.strip_prefix(".automaton/").unwrap_or(p);
        let name = rel.rsplit('/').next().unwrap_or(rel);
        matches!(rel, ".agent.md" | ".gitignore")
            || (rel.starts_with("prompts/") && name.ends_with(".md"))
            || (rel.starts_with("tasks/")
                && (matches!(
                    name,
                    ".state" | ".state.approvals" | ".state.holders" | ".state.implementer"
                ) || name.ends_with(".md")))
    };
    let runtime: Vec<&&str> = paths.iter().filter(|p| !record(p)).collect();
    assert!(
        runtime.is_empty(),
        "not ignored by .automaton/.gitignore: {runtime:?}"
    );
    for t in ["a", "b", "c", "d"] {
        for f in [".state", "SPEC.md"] {
            let p = format!(".automaton/tasks/{t}/{f}");
            assert!(paths.contains(&p.as_str()), "{p} is versioned: {untracked}");
        }
    }
    let ignored = git(
        &env,
        &["status", "--porcelain", "--ignored", "-uall", ".automaton"],
    );
    for runtime in [
        ".automaton/leases.wal",
        ".automaton/coordinator.lock",
        ".automaton/fencing",
        ".automaton/tasks/a/.state.dispatch",
    ] {
        assert!(
            ignored.contains(&format!("!! {runtime}\n")),
            "{runtime}: {ignored}"
        );
    }
    assert!(ignored.contains("!! .automaton/completions/"), "{ignored}");
}

#[test]
fn issue21_prompts_init_writes_the_skeleton_says_so_and_never_overwrites() {
    let env = Env::new();
    let meta = env.root().join(".automaton");
    std::fs::create_dir_all(&meta).expect("mkdir");
    let mine = "# Our policy\nMode: multi-agent\n";
    std::fs::write(meta.join(".agent.md"), mine).expect("agent.md");
    let r = init(env.root(), env.home.path(), false);
    r.ok();
    let lines: Vec<&str> = r.stdout.lines().collect();
    let phases: Vec<&str> = automaton_workflow::prompt_phases()
        .map(Phase::name)
        .collect();
    assert_eq!(phases.len(), 10);
    assert_eq!(
        lines.len(),
        2 + phases.len() + 1,
        "one line per file: {r:?}"
    );
    assert_eq!(
        lines[0],
        format!(
            "kept    {} (it exists; not overwritten)",
            meta.join(".agent.md").display()
        )
    );
    assert_eq!(
        lines[1],
        format!("wrote   {}", meta.join(".gitignore").display())
    );
    for (line, phase) in lines[2..].iter().zip(&phases) {
        let path = meta.join(format!("prompts/{phase}.md"));
        assert_eq!(*line, format!("wrote   {}", path.display()));
        let text = std::fs::read_to_string(&path).expect("prompt");
        let (header, body) = text.split_once('\n').expect("a header line");
        assert!(header.starts_with("<!-- automaton init: a copy of the built-in prompt for "));
        let phase: Phase = phase.parse().expect("phase");
        let built_in = built_in_prompt(phase).expect("built in");
        assert_eq!(
            Some(body),
            built_in.split_once('\n').map(|(_, b)| b),
            "{phase}"
        );
    }
    assert!(lines[12].starts_with("Wrote 11 files."), "{r:?}");
    assert_eq!(
        std::fs::read_to_string(meta.join(".agent.md")).expect("agent.md"),
        mine
    );
    // Again: nothing written, and it says so; not a byte changed.
    let before = env.snapshot();
    let again = init(env.root(), env.home.path(), true);
    again.ok();
    assert_eq!(env.snapshot(), before);
    assert!(
        again
            .stdout
            .lines()
            .take(12)
            .all(|l| l.starts_with("kept    ")),
        "{again:?}"
    );
    assert_eq!(
        again.stdout.lines().last(),
        Some("Nothing written: every file of the skeleton is already in place.")
    );
    // A fresh project gets the .agent.md too, with the defaults the policy reads.
    let fresh = Env::new();
    init(fresh.root(), fresh.home.path(), true).ok();
    let agent_md = fresh.root().join(".automaton/.agent.md");
    let text = std::fs::read_to_string(&agent_md).expect("agent.md");
    for key in [
        "Mode: single-agent",
        "Lock timeout: 30m",
        "Separated phases: code_review",
        "Autopilot: Enabled",
    ] {
        assert!(text.lines().any(|l| l == key), "{key}: {text}");
    }
    // `status` reads it (a broken .agent.md would refuse every task command).
    fresh.cli(&["--create-task", "t"]).ok();
    fresh.cli(&["--task", "t"]).ok();
    // A root-level .agent.md, still honoured, is not silently replaced by a new one.
    let legacy = Env::new();
    std::fs::write(legacy.root().join(".agent.md"), "Mode: multi-agent\n").expect("legacy");
    let r = init(legacy.root(), legacy.home.path(), true);
    r.ok();
    assert!(
        r.stdout
            .lines()
            .next()
            .is_some_and(|l| l.starts_with(&format!(
                "skipped {}",
                legacy.root().join(".automaton/.agent.md").display()
            ))),
        "{r:?}"
    );
    assert!(!legacy.root().join(".automaton/.agent.md").exists());
}

#[test]
fn issue21_prompts_init_refuses_what_it_cannot_write_in_one_line() {
    let env = Env::new();
    let file = env.root().join("not-a-folder");
    std::fs::write(&file, "x").expect("file");
    let missing = env.root().join("missing");
    let blocked = Env::new();
    std::fs::write(blocked.root().join(".automaton"), "x").expect("a file named .automaton");
    let linked = Env::new();
    std::fs::create_dir_all(linked.root().join(".automaton")).expect("mkdir");
    std::os::unix::fs::symlink(env.home.path(), linked.root().join(".automaton/prompts"))
        .expect("link");
    for (root, says) in [
        (file.as_path(), "is not a folder: pass --project"),
        (missing.as_path(), "cannot open the project folder"),
        (
            blocked.root(),
            ".automaton is a file, not a folder: move it away",
        ),
        (linked.root(), "prompts is a symbolic link"),
    ] {
        let r = init(root, env.home.path(), true);
        r.code(2);
        assert_eq!(r.stderr.lines().count(), 1, "{r:?}");
        assert!(
            r.error_line().starts_with("ERROR: ") && r.error_line().contains(says),
            "{says}: {r:?}"
        );
        assert!(r.stdout.is_empty(), "{r:?}");
    }
    assert!(
        std::fs::read_dir(env.home.path())
            .expect("home")
            .next()
            .is_none(),
        "nothing written through the link"
    );
}
