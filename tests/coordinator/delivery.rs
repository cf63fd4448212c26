//! Issue 31: finished work comes together and is delivered, with the real coordinator on real
//! git repositories. Sub-tasks that change the same lines (one merges, the other goes back to
//! implement on the new head and lands after its reviews ran again); a top-level task merged
//! into `main` exactly as reviewed; `main` moved by a person meanwhile (a clean merge lands, a
//! conflicting one waits and says why); a remote base pushed with a lease, a commit pushed
//! there meanwhile kept; a `kill -9` at each delivery step, ending with exactly one merge.

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::forge::{self, FakeForge, FakeKind};
use crate::harness::*;
use crate::waves::{approve_all, approved_decomposition, spec};
use crate::work::{FLEET, git, git_init, scripted_worker as worker};

/// `sh -c script` in the project; its trimmed stdout.
fn sh(env: &Env, script: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(script)
        .current_dir(env.root())
        .env("HOME", env.home.path())
        .output()
        .expect("sh");
    assert!(out.status.success(), "{script}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A commit on `branch` (made from `from`) adding `path`, with plumbing: the checkout, its
/// index and HEAD are not touched. Its id.
pub(crate) fn commit_on(env: &Env, branch: &str, from: &str, path: &str, content: &str) -> String {
    let blob = sh(
        env,
        &format!("printf '%s' '{content}' | git hash-object -w --stdin"),
    );
    let tree = sh(
        env,
        &format!(
            "export GIT_INDEX_FILE=$(mktemp -u); git read-tree {from} && git update-index --add --cacheinfo 100644,{blob},{path} && git write-tree; rm -f $GIT_INDEX_FILE"
        ),
    );
    let commit = sh(
        env,
        &format!(
            "git -c user.name=agent -c user.email=agent@x commit-tree {tree} -p {from} -m '{path}'"
        ),
    );
    sh(env, &format!("git update-ref refs/heads/{branch} {commit}"));
    commit
}

/// A person's commit on the checked-out `main`, through git.
fn person_commits(env: &Env, path: &str, content: &str) -> String {
    std::fs::write(env.root().join(path), content).expect("write");
    git(env, &["add", path]);
    git(
        env,
        &[
            "-c",
            "user.name=person",
            "-c",
            "user.email=person@x",
            "commit",
            "-q",
            "-m",
            &format!("a person's {path}"),
        ],
    );
    git(env, &["rev-parse", "HEAD"]).trim().to_string()
}

/// A top-level task at `referee` with a PASS verdict and a commit on its branch adding
/// `path`; moved to `complete` over the API once the coordinator runs. Returns the commit.
fn finished_task(env: &Env, task: &str, path: &str, content: &str) -> String {
    let dir = env.task_dir(task);
    std::fs::create_dir_all(&dir).expect("task dir");
    std::fs::write(dir.join(".state"), "referee\n").expect("state");
    std::fs::write(
        dir.join("SPEC.md"),
        format!("# {task}: add {path}\n\nThe spec.\n"),
    )
    .expect("spec");
    std::fs::write(dir.join("VERDICT.md"), "# VERDICT\n\nVerdict: PASS\n").expect("verdict");
    commit_on(env, &format!("automaton/{task}"), "main", path, content)
}

fn rev(env: &Env, what: &str) -> String {
    git(env, &["rev-parse", what]).trim().to_string()
}

fn is_ancestor(env: &Env, ancestor: &str, of: &str) -> bool {
    Command::new("git")
        .args(["merge-base", "--is-ancestor", ancestor, of])
        .current_dir(env.root())
        .status()
        .expect("git")
        .success()
}

async fn delivery(api: &mut Api, task: &str) -> automaton_proto::v1::Delivery {
    api.get(task)
        .await
        .expect("get")
        .summary
        .and_then(|s| s.delivery)
        .unwrap_or_default()
}

/// Issue 31, part 2: two sub-tasks of one wave change the same lines (the scripted agent's
/// shared file), both started from one head. The first merges; the second's merge conflicts,
/// so it goes back to implement on the parent's new head with CONFLICTS.md, its reviews of
/// the old revision kept as PREVIOUS_*, its reviews run again — and then it lands, and the
/// parent completes with both on its branch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sub_tasks_on_the_same_lines_one_merges_the_other_reworks_on_the_new_head_and_lands() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let rows = spec(&[("one", "-", 4), ("two", "-", 4)]);
    approved_decomposition(&mut api, &env, "p", &rows[rows.find('|').unwrap_or(0)..]).await;
    for sub in ["p/one", "p/two"] {
        events.expect("subtask_created", sub).await;
    }
    for b in ["automaton/p--one", "automaton/p--two"] {
        git(&env, &["branch", b, "HEAD"]);
    }
    let shared = [("AUTOMATON_SCRIPTED_SHARED_FILE", "1")];
    let _a = worker(&coord, "gpu-a", "sim:24GiB", &shared);
    let _b = worker(&coord, "gpu-b", "sim:24GiB", &shared);
    let approver = approve_all(&api);
    let rework = events
        .find("a rework", Duration::from_secs(60), |e| e.kind == "rework")
        .await;
    let second = rework.task.clone();
    assert!(
        rework.detail.contains("AUTOMATON_SCRIPTED.md")
            && rework.detail.contains("back to implement"),
        "{rework:?}"
    );
    let end = events
        .find("the parent's end", Duration::from_secs(90), |e| {
            e.kind == "parent_ended" && e.task == "p"
        })
        .await;
    approver.abort();
    assert!(end.detail.contains("PASS: 2"), "{end:?}");
    assert_eq!(api.state("p").await, "complete");
    // Both on the parent's branch, no conflict marker; the second built on the first.
    let on_parent = git(&env, &["show", "automaton/p:AUTOMATON_SCRIPTED.md"]);
    assert!(!on_parent.contains("<<<<<<<"), "{on_parent}");
    for t in ["p/one", "p/two"] {
        assert!(
            on_parent.contains(&format!("task {t},")),
            "{t}: {on_parent}"
        );
    }
    // Its reviews ran again on the new revision: the old ones kept, new ones written.
    let dir = env.task_dir(&second);
    let conflicts = std::fs::read_to_string(dir.join("CONFLICTS.md")).expect("CONFLICTS.md");
    assert!(conflicts.contains("AUTOMATON_SCRIPTED.md"), "{conflicts}");
    for f in [
        "PREVIOUS_CODE_REVIEW.md",
        "PREVIOUS_VERDICT.md",
        "CODE_REVIEW.md",
        "VERDICT.md",
    ] {
        assert!(dir.join(f).exists(), "{second} has no {f}");
    }
    let reviews = events
        .settle(Duration::from_millis(10))
        .await
        .iter()
        .filter(|e| e.task == second && e.kind == "assigned" && e.detail.starts_with("code_review"))
        .count();
    assert!(reviews >= 2, "{second}'s code review ran {reviews} time(s)");
    // The dispatch record counts it (a second conflict would wait for a person).
    let record = std::fs::read_to_string(dir.join(".state.dispatch")).expect("record");
    assert!(record.contains("\"reworks\": 1"), "{record}");
}

/// Issue 31, part 2 with `on_conflict = "person"`: the second sub-task's merge conflicts and
/// writes nothing — the parent's branch holds the first one's file, no marker — and the
/// parent waits for a person, held durably with seed 002's line naming the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_conflict_person_a_conflicting_merge_lands_nothing_and_holds_the_parent_naming_the_path()
 {
    let env = Env::with_config("[delivery]\non_conflict = \"person\"\n");
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let rows = spec(&[("one", "-", 4), ("two", "-", 4)]);
    approved_decomposition(&mut api, &env, "p", &rows[rows.find('|').unwrap_or(0)..]).await;
    for sub in ["p/one", "p/two"] {
        events.expect("subtask_created", sub).await;
    }
    for b in ["automaton/p--one", "automaton/p--two"] {
        git(&env, &["branch", b, "HEAD"]);
    }
    let shared = [("AUTOMATON_SCRIPTED_SHARED_FILE", "1")];
    let _a = worker(&coord, "gpu-a", "sim:24GiB", &shared);
    let _b = worker(&coord, "gpu-b", "sim:24GiB", &shared);
    let approver = approve_all(&api);
    let held = events
        .find("the parent held", Duration::from_secs(60), |e| {
            e.kind == "task_held" && e.task == "p"
        })
        .await;
    approver.abort();
    assert!(
        held.detail.contains("HUMAN INTERVENTION REQUIRED")
            && held.detail.contains("conflicts in AUTOMATON_SCRIPTED.md")
            && held.detail.contains("on_conflict = person"),
        "{held:?}"
    );
    let merged = events
        .find("a sub-task merged", Duration::from_secs(5), |e| {
            e.kind == "subtask_merged"
        })
        .await;
    let first = merged.task.clone();
    let second = if first == "p/one" { "p/two" } else { "p/one" };
    assert!(held.detail.contains(second), "{held:?}");
    let on_parent = git(&env, &["show", "automaton/p:AUTOMATON_SCRIPTED.md"]);
    assert!(!on_parent.contains("<<<<<<<"), "{on_parent}");
    assert!(
        !on_parent.contains(&format!("task {second},")),
        "{on_parent}"
    );
    assert_eq!(api.state("p").await, "decomposition:approved");
    // Durable: the parent's dispatch record says it waits.
    let record =
        std::fs::read_to_string(env.task_dir("p").join(".state.dispatch")).expect("record");
    assert!(record.contains("AUTOMATON_SCRIPTED.md"), "{record}");
    assert!(!env.task_dir(second).join("CONFLICTS.md").exists());
}

/// Issue 31, part 3: `mode = "merge"` lands a finished task's branch on the branch it
/// started from — a fast-forward here, the checked-out `main` and its files following — and
/// `status --task`, `tasks` and their `--json` say where it went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merge_delivery_lands_a_finished_task_on_main_as_reviewed_and_every_view_says_where() {
    let env = Env::with_config("[delivery]\nmode = \"merge\"\n");
    git_init(&env);
    let revision = finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    api.transition("feat", "complete").await.expect("complete");
    let merged = events.expect("merged", "feat").await;
    assert!(merged.detail.contains(&revision), "{merged:?}");
    assert_eq!(rev(&env, "main"), revision);
    assert_eq!(
        std::fs::read_to_string(env.root().join("feat.rs")).expect("the checkout followed"),
        "pub fn feat() {}\n"
    );
    let d = delivery(&mut api, "feat").await;
    assert_eq!(
        (
            d.state.as_str(),
            d.commit.as_str(),
            d.base.as_str(),
            d.how.as_str()
        ),
        ("merged", revision.as_str(), "main", "fast-forward")
    );
    assert_eq!(d.revision, revision);
    let status = cli_at(&env, &coord, &["status", "--task", "feat"]);
    status.ok();
    assert!(
        status
            .stdout
            .contains(&format!("Delivery: merged into main at {revision}")),
        "{}",
        status.stdout
    );
    let json = cli_at(&env, &coord, &["status", "--task", "feat", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json.ok().stdout).expect("json");
    assert_eq!(v["delivery"]["state"], "merged", "{v:#}");
    let tasks = cli_at(&env, &coord, &["tasks"]);
    assert!(
        tasks.ok().stdout.contains("delivery: merged into main"),
        "{}",
        tasks.stdout
    );
    let tasks = cli_at(&env, &coord, &["tasks", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&tasks.ok().stdout).expect("json");
    assert_eq!(v[0]["delivery"]["commit"], revision.as_str(), "{v:#}");
    // Nothing more happens: no second merge, and it cannot be abandoned now.
    let abandon = cli_at(&env, &coord, &["abandon", "feat"]);
    assert_ne!(abandon.code, 0, "{abandon:?}");
    assert!(
        abandon.error_line().contains("merged already"),
        "{abandon:?}"
    );
}

/// Issue 31, part 3: with `approve = true` a delivery waits for an operator; a person moves
/// `main` meanwhile. A task that changed other paths lands as a merge commit holding both;
/// one that changed a path the person changed does not land — it waits, naming the path —
/// and `automaton abandon` gives it up; `automaton gc --branches` then removes both branches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn main_moved_by_a_person_meanwhile_a_clean_merge_lands_a_conflicting_one_waits_and_gc_collects_both()
 {
    let env = Env::with_config(
        "[delivery]\nmode = \"merge\"\napprove = true\non_conflict = \"person\"\n",
    );
    git_init(&env);
    let a = finished_task(&env, "clean", "clean.rs", "pub fn clean() {}\n");
    finished_task(&env, "clash", "README.md", "# the task readme\n");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    for t in ["clean", "clash"] {
        api.transition(t, "complete").await.expect("complete");
        events.expect("delivery_awaiting_approval", t).await;
    }
    let start = rev(&env, "main");
    let person = person_commits(&env, "README.md", "# the person readme\n");
    assert_eq!(rev(&env, "main"), person, "nothing landed before approval");
    // Not an operator's word yet: the same on a repeated read.
    assert_eq!(delivery(&mut api, "clean").await.state, "requested");
    cli_at(&env, &coord, &["deliver", "clean"]).ok();
    let merged = events.expect("merged", "clean").await;
    assert!(merged.detail.contains("merge commit"), "{merged:?}");
    let main = rev(&env, "main");
    assert!(is_ancestor(&env, &person, &main) && is_ancestor(&env, &a, &main));
    assert_eq!(
        git(&env, &["show", "main:README.md"]),
        "# the person readme\n"
    );
    cli_at(&env, &coord, &["deliver", "clash"]).ok();
    let waits = wait_for_delivery(&mut api, "clash", |d| !d.waiting.is_empty()).await;
    assert!(
        waits.waiting.contains("README.md")
            && waits.waiting.contains("HUMAN INTERVENTION REQUIRED"),
        "{waits:?}"
    );
    assert_eq!(rev(&env, "main"), main, "a conflicting delivery moved main");
    assert!(!is_ancestor(&env, "automaton/clash", &main));
    assert!(is_ancestor(&env, &start, &main));
    let abandon = cli_at(
        &env,
        &coord,
        &["abandon", "clash", "--reason", "superseded"],
    );
    assert!(abandon.ok().stdout.contains("abandoned by"), "{abandon:?}");
    assert_eq!(delivery(&mut api, "clash").await.state, "abandoned");
    events.expect("delivery_abandoned", "clash").await;
    let again = cli_at(&env, &coord, &["deliver", "clash"]);
    assert_ne!(again.code, 0, "{again:?}");
    // A sub-task, an unknown task: refused with what to do.
    let unknown = cli_at(&env, &coord, &["deliver", "nope"]);
    assert_ne!(unknown.code, 0);
    // `automaton gc --branches`: the merged branch and the abandoned one go; a dry run first
    // removes nothing.
    let dry = cli_at(&env, &coord, &["gc", "--branches", "--dry-run"]);
    for want in [
        "would remove automaton/clean: merged into main",
        "would remove automaton/clash: its delivery was abandoned by",
    ] {
        assert!(dry.ok().stdout.contains(want), "{want}: {}", dry.stdout);
    }
    let branches = || git(&env, &["branch", "--list", "automaton/*"]);
    assert!(branches().contains("automaton/clean"), "{}", branches());
    cli_at(&env, &coord, &["gc", "--branches"]).ok();
    let left = branches();
    assert!(
        !left.contains("automaton/clean") && !left.contains("automaton/clash"),
        "{left}"
    );
    assert_eq!(rev(&env, "main"), main, "gc moved main");
    let none = cli_at(&env, &coord, &["gc"]);
    assert_ne!(none.code, 0, "gc without --branches: {none:?}");
}

/// Waits (bounded) until `task`'s delivery satisfies `done`.
async fn wait_for_delivery(
    api: &mut Api,
    task: &str,
    done: impl Fn(&automaton_proto::v1::Delivery) -> bool,
) -> automaton_proto::v1::Delivery {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let d = delivery(api, task).await;
        if done(&d) {
            return d;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{task}'s delivery is still {d:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Issue 31, part 3: a base on a remote is moved by a push with a lease; a commit a person
/// pushed there meanwhile is built on, never overwritten; the local `main` is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_base_gets_the_merge_by_a_leased_push_and_a_commit_pushed_meanwhile_survives() {
    let remote = tempfile::tempdir().expect("remote");
    let url = remote.path().display().to_string();
    let env = Env::with_config(&format!(
        "[delivery]\nmode = \"merge\"\napprove = true\nremote = \"{url}\"\n"
    ));
    git_init(&env);
    git(&env, &["init", "-q", "--bare", &url]);
    git(&env, &["push", "-q", &url, "main"]);
    let revision = finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    api.transition("feat", "complete").await.expect("complete");
    events.expect("delivery_awaiting_approval", "feat").await;
    let local_main = rev(&env, "main");
    // A person's commit reaches the remote's main, not this checkout's.
    let pushed = commit_on(&env, "elsewhere", "main", "other.rs", "other");
    git(&env, &["push", "-q", &url, "elsewhere:main"]);
    cli_at(&env, &coord, &["deliver", "feat"]).ok();
    events.expect("merged", "feat").await;
    let on_remote = git(&env, &["--git-dir", &url, "rev-parse", "main"])
        .trim()
        .to_string();
    let d = delivery(&mut api, "feat").await;
    assert_eq!(d.commit, on_remote);
    assert_eq!(d.remote, url);
    for c in [&pushed, &revision] {
        let ok = Command::new("git")
            .args([
                "--git-dir",
                &url,
                "merge-base",
                "--is-ancestor",
                c,
                &on_remote,
            ])
            .status()
            .expect("git")
            .success();
        assert!(ok, "{c} is not on the remote's main {on_remote}");
    }
    assert_eq!(rev(&env, "main"), local_main, "the local main moved");
}

/// Issue 31, part 5: the coordinator stops (as `kill -9` stops it) right after each step of
/// a delivery is recorded — and after the base moved but before that was recorded. After the
/// restart each ends with exactly one merge on `main`, holding both the task's and the
/// person's work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_at_each_delivery_step_ends_after_the_restart_with_exactly_one_merge() {
    for step in ["requested", "preparing", "ready", "merging", "landed"] {
        let env: Arc<Env> = Env::with_config("[delivery]\nmode = \"merge\"\n");
        git_init(&env);
        let revision = finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
        let person = person_commits(&env, "other.rs", "pub fn other() {}\n");
        let failpoint = format!("delivery-crash-after={step}");
        let mut coord =
            Coord::start_with_env(&env, &FLEET, &[("AUTOMATON_FAILPOINTS", &failpoint)]);
        let mut api = coord.api().await;
        api.transition("feat", "complete").await.expect("complete");
        let exit = wait_bounded(&mut coord.child, Duration::from_secs(20));
        assert!(
            exit.is_some_and(|s| !s.success()),
            "{step}: the coordinator did not stop at its failpoint: {exit:?}\n{}",
            coord.stderr()
        );
        coord.restart_after_kill(&FLEET);
        let mut api = coord.api().await;
        let d = wait_for_delivery(&mut api, "feat", |d| d.state == "merged").await;
        let main = rev(&env, "main");
        assert_eq!(d.commit, main, "{step}");
        assert!(
            is_ancestor(&env, &person, &main) && is_ancestor(&env, &revision, &main),
            "{step}"
        );
        let merges = git(&env, &["log", "--format=%s", "main"])
            .lines()
            .filter(|l| l.contains("feat: add feat.rs"))
            .count();
        assert_eq!(
            merges,
            1,
            "{step}: {}",
            git(&env, &["log", "--oneline", "main"])
        );
        assert_eq!(
            git(&env, &["rev-list", "--count", "main"]).trim(),
            "4",
            "{step}: init, the person's, the task's, one merge"
        );
    }
}

/// A project whose finished work goes out as a pull request on `forge`, the branch pushed to
/// a bare remote; the token in a file. Returns the env and the remote's path.
fn pull_request_env(forge: &FakeForge, extra: &str) -> (Arc<Env>, tempfile::TempDir) {
    let remote = tempfile::tempdir().expect("remote");
    let token = remote.path().join("token");
    std::fs::write(&token, format!("{}\n", forge::TOKEN)).expect("token");
    let bare = remote.path().join("shop.git");
    let env = Env::with_config(&format!(
        "[delivery]\nmode = \"pull_request\"\nremote = \"{}\"\nconsole_url = \"https://console.example/\"\n{extra}\n[delivery.forge]\nkind = \"{}\"\napi_url = \"{}\"\nrepository = \"acme/shop\"\ntoken_file = \"{}\"\nmax_wait = \"20s\"\n",
        bare.display(),
        forge.kind().name(),
        forge.api_url(),
        token.display()
    ));
    git_init(&env);
    git(&env, &["init", "-q", "--bare", &bare.display().to_string()]);
    (env, remote)
}

/// Issue 31, part 3: `mode = "pull_request"` against local servers answering as GitHub's,
/// GitLab's and Gitea's documented endpoints: the branch is pushed, one pull request opened
/// with the forge's request shape and auth header, titled from SPEC.md, its body the verdict,
/// the artifacts and the console's page; a `kill -9` and a restart open no second one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_request_delivery_opens_one_pull_request_on_github_gitlab_and_gitea() {
    for kind in FakeKind::ALL {
        let fake = FakeForge::start(kind).await;
        let (env, _remote) = pull_request_env(&fake, "");
        let revision = finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
        let mut coord = Coord::start(&env, &FLEET);
        let mut api = coord.api().await;
        let mut events = Events::watch(&api).await;
        api.transition("feat", "complete").await.expect("complete");
        let opened = events.expect("pull_request_opened", "feat").await;
        let d = delivery(&mut api, "feat").await;
        assert_eq!(d.state, "opened", "{kind:?}: {d:?}");
        assert!(opened.detail.contains(&d.url), "{kind:?}: {opened:?}");
        assert_eq!(fake.count("POST"), 1, "{kind:?}");
        let post = fake
            .requests()
            .into_iter()
            .find(|r| r.method == "POST")
            .expect("POST");
        let (head, base, body) = match kind {
            FakeKind::GitLab => ("source_branch", "target_branch", "description"),
            _ => ("head", "base", "body"),
        };
        assert_eq!(
            post.body[head], "automaton/feat",
            "{kind:?}: {:?}",
            post.body
        );
        assert_eq!(post.body[base], "main", "{kind:?}");
        assert_eq!(post.body["title"], "feat: add feat.rs", "{kind:?}");
        let text = post.body[body].as_str().unwrap_or_default();
        for want in [
            revision.as_str(),
            "**Verdict**: PASS",
            "VERDICT.md",
            "https://console.example/task/feat",
        ] {
            assert!(text.contains(want), "{kind:?}: {want} not in {text}");
        }
        let auth = match kind {
            FakeKind::GitHub => post.header("authorization").map(str::to_string),
            FakeKind::GitLab => post.header("private-token").map(str::to_string),
            FakeKind::Gitea => post.header("authorization").map(str::to_string),
        };
        assert!(
            auth.as_deref().is_some_and(|a| a.contains(forge::TOKEN)),
            "{kind:?}: {auth:?}"
        );
        // The branch is on the remote, at the reviewed revision.
        let remote = Command::new("git")
            .args(["ls-remote", &d.remote, "refs/heads/automaton/feat"])
            .output()
            .expect("git");
        assert!(
            String::from_utf8_lossy(&remote.stdout).starts_with(&revision),
            "{kind:?}: {remote:?}"
        );
        // A kill and a restart: the record says opened, nothing is opened again.
        coord.restart_after_kill(&FLEET);
        let mut api = coord.api().await;
        assert_eq!(delivery(&mut api, "feat").await.url, d.url);
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(fake.count("POST"), 1, "{kind:?}: a second pull request");
        fake.shutdown().await;
    }
}

/// Issue 31, part 3: the forge's errors. A 401 is final: the delivery waits, saying to fix
/// the token (named by its file, never shown), and `automaton deliver` tries again; a 429
/// with `Retry-After` is waited out; a pull request already open for the branch is reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_request_errors_401_waits_for_a_fixed_token_429_is_retried_an_open_one_is_reused() {
    // 401 on GitHub.
    let fake = FakeForge::start(FakeKind::GitHub).await;
    let (env, _remote) = pull_request_env(&fake, "");
    finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    fake.push_answer(401, &[], r#"{"message":"Bad credentials"}"#);
    api.transition("feat", "complete").await.expect("complete");
    let failed = events.expect("delivery_failed", "feat").await;
    let d = wait_for_delivery(&mut api, "feat", |d| !d.waiting.is_empty()).await;
    assert!(d.waiting.contains("token"), "{d:?}");
    assert!(!d.waiting.contains(forge::TOKEN) && !failed.detail.contains(forge::TOKEN));
    assert!(d.waiting.contains("automaton deliver feat"), "{d:?}");
    assert_eq!(fake.count("POST"), 0);
    cli_at(&env, &coord, &["deliver", "feat"]).ok();
    events.expect("pull_request_opened", "feat").await;
    assert_eq!(fake.count("POST"), 1);
    drop(coord);
    fake.shutdown().await;

    // 429 with Retry-After on Gitea: waited out, then opened.
    let fake = FakeForge::start(FakeKind::Gitea).await;
    let (env, _remote) = pull_request_env(&fake, "");
    finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    fake.push_answer(429, &[("retry-after", "1")], r#"{"message":"slow down"}"#);
    api.transition("feat", "complete").await.expect("complete");
    events.expect("delivery_requested", "feat").await;
    let opened = events
        .find("the pull request", Duration::from_secs(20), |e| {
            e.kind == "pull_request_opened"
        })
        .await;
    assert!(opened.task == "feat", "{opened:?}");
    let reqs = fake.requests();
    let (first, last) = (reqs.first().expect("one"), reqs.last().expect("more"));
    assert!(
        last.at.duration_since(first.at) >= Duration::from_secs(1),
        "the Retry-After was not waited out"
    );
    drop(coord);
    fake.shutdown().await;

    // An open merge request for the branch on GitLab: reused, none created.
    let fake = FakeForge::start(FakeKind::GitLab).await;
    let existing = fake.add_open("acme/shop", "automaton/feat", "main");
    let (env, _remote) = pull_request_env(&fake, "");
    finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    api.transition("feat", "complete").await.expect("complete");
    let opened = events.expect("pull_request_opened", "feat").await;
    assert!(opened.detail.contains("the one already open"), "{opened:?}");
    assert_eq!(delivery(&mut api, "feat").await.number, existing);
    assert_eq!(fake.count("POST"), 0);
    drop(coord);
    fake.shutdown().await;
}

/// Two coordinators on `cluster` (project `name`) delivering by merge through a shared bare
/// remote made from A's repository. `prepare` makes commits in A's repository; `push` (refspecs)
/// sends them to the remote before B clones it. A starts with `failpoint` and leads, B
/// follows, and `feat` — at `referee` with a PASS verdict — is moved to `complete` on A.
struct HaDelivery {
    a_env: Arc<Env>,
    a: Coord,
    b: Coord,
    url: String,
    _scratch: tempfile::TempDir,
}

async fn ha_delivery<T>(
    cluster: &crate::cluster::Cluster,
    name: &str,
    failpoint: &str,
    prepare: impl FnOnce(&Env) -> T,
    push: &[&str],
) -> (HaDelivery, T) {
    let scratch = tempfile::tempdir().expect("tempdir");
    let remote = scratch.path().join("shared.git");
    let url = remote.display().to_string();
    let extra = format!("git_remote = {url:?}\n\n[delivery]\nmode = \"merge\"\n");
    let a_env = crate::ha::env_on_with(cluster, name, &extra);
    git_init(&a_env);
    git(&a_env, &["clone", "-q", "--bare", ".", &url]);
    let made = prepare(&a_env);
    git(&a_env, &[&["push", "-q", url.as_str()][..], push].concat());
    let b_env = crate::ha::env_on_with(cluster, name, &extra);
    git(&b_env, &["clone", "-q", &url, "."]);
    let a = Coord::start_with_env(&a_env, &FLEET, &[("AUTOMATON_FAILPOINTS", failpoint)]);
    assert_eq!(
        crate::ha::leader_of(&[&a], Duration::from_secs(20)).await,
        0
    );
    let b = Coord::start(&b_env, &FLEET);
    let mut api = Api::new(connect(&a.url).await, None);
    api.create("feat").await.expect("create");
    a_env.artifact("feat", ".state", "referee\n");
    a_env.artifact("feat", "VERDICT.md", "# VERDICT\n\nVerdict: PASS\n");
    api.transition("feat", "complete").await.expect("complete");
    let ha = HaDelivery {
        a_env,
        a,
        b,
        url,
        _scratch: scratch,
    };
    (ha, made)
}

/// Issue 31, part 5: a failover mid-delivery on etcd. The leader records `merging` (its
/// merge commit built, never pushed) and stops as `kill -9` stops it; the other coordinator
/// takes over, builds the same commit again from the same inputs and lands it on the shared
/// remote's `main` with a leased push: exactly one merge, the person's commit kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_failover_mid_delivery_lands_exactly_one_merge_on_the_shared_remote() {
    let cluster = crate::cluster::Cluster::three().await;
    // The task's reviewed branch, and a person's commit on the remote's main meanwhile.
    let (ha, (revision, person)) = ha_delivery(
        &cluster,
        "deliver",
        "delivery-crash-after=merging",
        |env| {
            let revision = commit_on(env, "automaton/feat", "main", "feat.rs", "pub fn feat() {}");
            let person = commit_on(env, "person", "main", "other.rs", "pub fn other() {}");
            (revision, person)
        },
        &["automaton/feat", "person:main"],
    )
    .await;
    let HaDelivery {
        a_env,
        mut a,
        b,
        url,
        ..
    } = ha;
    let exit = wait_bounded(&mut a.child, Duration::from_secs(20));
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the leader did not stop at its failpoint: {exit:?}\n{}",
        a.stderr()
    );
    assert_eq!(
        crate::ha::leader_of(&[&b], Duration::from_secs(30)).await,
        0
    );
    let mut api = Api::new(connect(&b.url).await, None);
    let d = wait_for_delivery(&mut api, "feat", |d| d.state == "merged").await;
    let on_remote = git(&a_env, &["--git-dir", &url, "rev-parse", "main"])
        .trim()
        .to_string();
    assert_eq!(d.commit, on_remote, "{d:?}");
    let log = git(
        &a_env,
        &["--git-dir", &url, "log", "--format=%H %s", "main"],
    );
    let merges = log
        .lines()
        .filter(|l| l.contains("automaton: feat"))
        .count();
    assert_eq!(merges, 1, "{log}");
    for c in [&person, &revision] {
        assert!(
            log.contains(c.as_str()),
            "{c} is not on the remote's main:\n{log}"
        );
    }
    assert_eq!(
        log.lines().count(),
        4,
        "init, the person's, the task's, one merge:\n{log}"
    );
}

/// Issue 31, part 1: three sub-tasks of one wave, each on its own file and all started from
/// one head, land on the parent's branch in whatever order they pass (a fast-forward, then
/// merge commits), and the parent completes holding all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_sub_tasks_of_one_wave_on_disjoint_files_all_land_on_the_parent_branch() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let rows = spec(&[("one", "-", 4), ("two", "-", 4), ("three", "-", 4)]);
    approved_decomposition(&mut api, &env, "p", &rows[rows.find('|').unwrap_or(0)..]).await;
    for sub in ["p/one", "p/two", "p/three"] {
        events.expect("subtask_created", sub).await;
    }
    for b in ["automaton/p--one", "automaton/p--two", "automaton/p--three"] {
        git(&env, &["branch", b, "HEAD"]);
    }
    let _a = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = worker(&coord, "gpu-b", "sim:24GiB", &[]);
    let approver = approve_all(&api);
    let end = events
        .find("the parent's end", Duration::from_secs(90), |e| {
            e.kind == "parent_ended" && e.task == "p"
        })
        .await;
    approver.abort();
    assert!(end.detail.contains("PASS: 3"), "{end:?}");
    let files = git(&env, &["ls-tree", "-r", "--name-only", "automaton/p"]);
    for sub in ["one", "two", "three"] {
        assert!(
            files.contains(&format!("AUTOMATON_SCRIPTED.{sub}.md")),
            "{sub} is not on the parent's branch:\n{files}"
        );
    }
    let merged = events
        .settle(Duration::from_millis(10))
        .await
        .iter()
        .filter(|e| e.kind == "subtask_merged")
        .count();
    assert_eq!(merged, 3);
    assert!(
        !events.all.iter().any(|e| e.kind == "rework"),
        "disjoint files needed no rework"
    );
}

/// Issue 31, part 3: the compare-and-swap push. The coordinator stops right after recording
/// `ready` (its merge built on the remote's `main` as it was); a person pushes to that `main`
/// meanwhile; after the restart the leased push is refused, the merge is built again on the
/// person's commit, and lands: the person's commit is never overwritten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leased_push_never_overwrites_a_commit_pushed_to_the_remote_meanwhile() {
    let remote = tempfile::tempdir().expect("remote");
    let url = remote.path().display().to_string();
    let env = Env::with_config(&format!(
        "[delivery]\nmode = \"merge\"\nremote = \"{url}\"\n"
    ));
    git_init(&env);
    git(&env, &["init", "-q", "--bare", &url]);
    git(&env, &["push", "-q", &url, "main"]);
    let revision = finished_task(&env, "feat", "feat.rs", "pub fn feat() {}\n");
    let mut coord = Coord::start_with_env(
        &env,
        &FLEET,
        &[("AUTOMATON_FAILPOINTS", "delivery-crash-after=ready")],
    );
    let mut api = coord.api().await;
    api.transition("feat", "complete").await.expect("complete");
    let exit = wait_bounded(&mut coord.child, Duration::from_secs(20));
    assert!(
        exit.is_some_and(|s| !s.success()),
        "{exit:?}\n{}",
        coord.stderr()
    );
    let record =
        std::fs::read_to_string(env.task_dir("feat").join(".state.delivery")).expect("the record");
    let built: serde_json::Value = serde_json::from_str(&record).expect("json");
    assert_eq!(built["state"], "ready", "{record}");
    // The person's push, after the merge was built.
    let pushed = commit_on(&env, "elsewhere", "main", "other.rs", "other");
    git(&env, &["push", "-q", &url, "elsewhere:main"]);
    coord.restart_after_kill(&FLEET);
    let mut api = coord.api().await;
    let d = wait_for_delivery(&mut api, "feat", |d| d.state == "merged").await;
    assert_ne!(
        built["commit"].as_str().unwrap_or_default(),
        d.commit,
        "the merge built before the push landed over it"
    );
    assert!(d.failures >= 1 && d.failure.contains("moved"), "{d:?}");
    for c in [&pushed, &revision] {
        let ok = Command::new("git")
            .args([
                "--git-dir",
                &url,
                "merge-base",
                "--is-ancestor",
                c,
                &d.commit,
            ])
            .status()
            .expect("git")
            .success();
        assert!(ok, "{c} is not under the delivered commit {}", d.commit);
    }
    let on_remote = git(&env, &["--git-dir", &url, "rev-parse", "main"]);
    assert_eq!(on_remote.trim(), d.commit);
}

/// Issue 31, part 5: a leader paused (SIGSTOP) mid-delivery past its lease. It had built its
/// merge on the remote's `main` as it was; a person pushes meanwhile; the other coordinator
/// takes over and lands its own merge on the person's commit. Woken, the deposed leader
/// steps down and its stalled delivery's next step is refused (its record write is fenced:
/// "deposed … nothing written"): it merges nothing, and `main` stays the new leader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_a_leader_paused_mid_delivery_past_its_lease_merges_nothing_when_it_wakes() {
    let cluster = crate::cluster::Cluster::three().await;
    let (ha, revision) = ha_delivery(
        &cluster,
        "paused",
        "delivery-stall-after=ready",
        |env| commit_on(env, "automaton/feat", "main", "feat.rs", "pub fn feat() {}"),
        &["automaton/feat"],
    )
    .await;
    let HaDelivery {
        a_env, a, b, url, ..
    } = ha;
    assert!(
        a.wait_stderr(
            "failpoint delivery-stall-after=ready",
            Duration::from_secs(20)
        ),
        "{}",
        a.stderr()
    );
    let record = std::fs::read_to_string(a_env.task_dir("feat").join(".state.delivery"))
        .expect("the record");
    let built: serde_json::Value = serde_json::from_str(&record).expect("json");
    let old = built["commit"].as_str().unwrap_or_default().to_string();
    signal(a.pid(), "-STOP");
    let pushed = commit_on(&a_env, "elsewhere", "main", "other.rs", "pub fn other() {}");
    git(&a_env, &["push", "-q", &url, "elsewhere:main"]);
    assert_eq!(
        crate::ha::leader_of(&[&b], Duration::from_secs(30)).await,
        0
    );
    let mut api = Api::new(connect(&b.url).await, None);
    let d = wait_for_delivery(&mut api, "feat", |d| d.state == "merged").await;
    assert_ne!(d.commit, old, "{d:?}");
    signal(a.pid(), "-CONT");
    // The woken leader's stalled step goes on, to the next one: refused.
    assert!(
        a.wait_stderr("delivery step failed", Duration::from_secs(20)),
        "the woken leader's delivery did not try its next step:\n{}",
        a.stderr()
    );
    let on_remote = git(&a_env, &["--git-dir", &url, "rev-parse", "main"]);
    assert_eq!(on_remote.trim(), d.commit, "the deposed leader moved main");
    let log = git(
        &a_env,
        &["--git-dir", &url, "log", "--format=%H %s", "main"],
    );
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("automaton: feat"))
            .count(),
        1,
        "{log}"
    );
    for c in [&pushed, &revision] {
        assert!(log.contains(c.as_str()), "{c}:\n{log}");
    }
    let mut api = Api::new(connect(&b.url).await, None);
    assert_eq!(delivery(&mut api, "feat").await.commit, d.commit);
    assert!(
        a.wait_stderr("stepped down", Duration::from_secs(10)),
        "the woken leader did not step down:\n{}",
        a.stderr()
    );
}

/// Issue 36 with issue 31: delivery lands only the revision the referee read. A task run to
/// `complete` by real workers; a commit lands on its branch after the verdict (while the
/// delivery stalls at `requested`, `delivery-stall-after=requested`). The delivery does not
/// land it blind: it waits with seed 002's line naming both commits, `main` unmoved, until a
/// person's `automaton deliver` authorizes the branch as it is now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_after_the_verdict_is_not_delivered_until_a_person_says_so() {
    let env = Env::with_config("[delivery]\nmode = \"merge\"\n");
    git_init(&env);
    let coord = Coord::start_with_env(
        &env,
        &FLEET,
        &[("AUTOMATON_FAILPOINTS", "delivery-stall-after=requested")],
    );
    let mut api = coord.api().await;
    let mut events = Events::watch(&api).await;
    let _a = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    let _b = worker(&coord, "gpu-b", "sim:24GiB", &[]);
    let approver = approve_all(&api);
    api.create("t").await.expect("create");
    events
        .find("the delivery requested", Duration::from_secs(60), |e| {
            e.kind == "delivery_requested" && e.task == "t"
        })
        .await;
    approver.abort();
    let main = rev(&env, "main");
    let late = commit_on(&env, "automaton/t", "automaton/t", "late.rs", "late");
    let waits = wait_for_delivery(&mut api, "t", |d| !d.waiting.is_empty()).await;
    assert!(
        waits.waiting.contains("referee read") && waits.waiting.contains(&late),
        "{waits:?}"
    );
    assert_eq!(rev(&env, "main"), main, "a revision nobody reviewed landed");
    cli_at(&env, &coord, &["deliver", "t"]).ok();
    let d = wait_for_delivery(&mut api, "t", |d| d.state == "merged").await;
    assert!(is_ancestor(&env, &late, &d.commit), "{d:?}");
}
