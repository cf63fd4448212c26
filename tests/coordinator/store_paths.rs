//! Issue 20, the task store's paths: (A) nothing a Work or Tasks call reads under a task
//! folder follows a symbolic link — a link planted in a task folder (to `/etc/passwd`, to the
//! coordinator's config with every token in it) or a linked task folder refuses the call with
//! FAILED_PRECONDITION naming the link, and none of the target's bytes are served; (B) a patch
//! path that git (core.protectNTFS and core.protectHFS on) reads as `.git`, or that is another
//! spelling of `.gitmodules` and its siblings, is INVALID_ARGUMENT before anything is written,
//! the task branch unchanged. A real coordinator, a real git repository, an agent holding the
//! lease over real gRPC.

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use automaton_proto::v1 as pb;
use pb::work_client::WorkClient;
use tonic::Code;

use crate::harness::*;
use crate::work::{git_init, manifest};

/// The start of `/etc/passwd` on every Linux: its bytes must appear nowhere.
const PASSWD_MARK: &str = "root:";

fn fetch_req(lease: &pb::Lease) -> pb::FetchWorkspaceRequest {
    pb::FetchWorkspaceRequest {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        cached_commits: vec![],
    }
}

/// The whole workspace as served: every file's bytes, joined (manifest and data).
async fn fetch_all(
    work: &mut WorkClient<tonic::transport::Channel>,
    api: &Api,
    lease: &pb::Lease,
) -> Result<Vec<u8>, tonic::Status> {
    let mut stream = work
        .fetch_workspace(api.req(fetch_req(lease)))
        .await?
        .into_inner();
    let mut all = Vec::new();
    while let Some(chunk) = stream.message().await? {
        match chunk.part {
            Some(pb::workspace_chunk::Part::Manifest(m)) => {
                all.extend(format!("{m:?}").into_bytes());
            }
            Some(pb::workspace_chunk::Part::Data(d)) => all.extend(d.data),
            None => {}
        }
    }
    Ok(all)
}

/// `s` is FAILED_PRECONDITION, one line naming `link` as a symbolic link, with none of
/// `secrets` in it.
#[track_caller]
fn refused_naming(what: &str, s: &tonic::Status, link: &Path, secrets: &[&str]) {
    assert_eq!(s.code(), Code::FailedPrecondition, "{what}: {s:?}");
    let m = s.message();
    assert!(m.contains(&link.display().to_string()), "{what}: {m}");
    assert!(m.contains("symbolic link"), "{what}: {m}");
    assert!(!m.contains('\n') && m.len() < 600, "{what}: {m}");
    for secret in secrets {
        assert!(!m.contains(secret), "{what} leaks {secret}: {m}");
    }
}

/// An upload of `body` as SPEC.md under `lease`, in one message.
fn spec_chunk(lease: &pb::Lease, body: &[u8]) -> pb::ArtifactChunk {
    use sha2::Digest;
    pb::ArtifactChunk {
        lease_id: lease.lease_id.clone(),
        token: lease.token,
        name: "SPEC.md".into(),
        sha256: sha2::Sha256::digest(body)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
        size: body.len() as u64,
        data: body.to_vec(),
    }
}

fn swap_for_link(dir: &Path, to: &Path) -> PathBuf {
    let aside = dir.with_extension("aside");
    std::fs::rename(dir, &aside).expect("move the folder aside");
    symlink(to, dir).expect("link");
    aside
}

fn put_back(dir: &Path, aside: &Path) {
    std::fs::remove_file(dir).expect("unlink");
    std::fs::rename(aside, dir).expect("put back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_in_a_task_folder_to_etc_passwd_or_the_config_is_refused_naming_it_and_never_served()
 {
    let env = Env::with_config(TOKENS_TOML);
    git_init(&env);
    let coord = Coord::start(&env, &["--no-dispatch"]);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    let mut agent = coord.api_as(AGENT_TOKEN).await;
    let mut work = WorkClient::new(coord.channel().await);
    let config = env.config.clone().expect("a config file");
    ops.claimable_task("t").await;
    let lease = agent.claim("t", "agent-a", 60_000).await.expect("claim");
    let clean = fetch_all(&mut work, &agent, &lease)
        .await
        .expect("a folder without links is served");
    assert!(!String::from_utf8_lossy(&clean).contains(OPERATOR_TOKEN));
    let secrets = [PASSWD_MARK, OPERATOR_TOKEN, AGENT_B_TOKEN, WORKER_A_TOKEN];
    for (file, target) in [
        ("PREVIOUS_SPEC.md", Path::new("/etc/passwd")),
        ("SPEC.md", config.as_path()),
        ("PREVIOUS_DESIGN.md", config.as_path()),
    ] {
        let link = env.task_dir("t").join(file);
        symlink(target, &link).expect("plant the link");
        let before = env.snapshot();
        let s = fetch_all(&mut work, &agent, &lease)
            .await
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .expect_err("a linked task file");
        refused_naming(file, &s, &link, &secrets);
        // Status reads it too: GetTask names the link and shows nothing of the target.
        if file == "SPEC.md" {
            let s = ops
                .get("t")
                .await
                .expect_err("GetTask of a linked artifact");
            refused_naming("GetTask", &s, &link, &secrets);
        }
        assert!(
            env.snapshot() == before,
            "{file}: a refused fetch changed files"
        );
        std::fs::remove_file(&link).expect("unlink");
    }
    // An upload replaces a planted link with the file, and leaves its target alone.
    let link = env.task_dir("t").join("SPEC.md");
    symlink(&config, &link).expect("plant the link");
    let config_before = std::fs::read(&config).expect("config");
    let spec = b"# Spec\nreal\n";
    let up = work
        .upload_artifact(agent.req(tokio_stream::iter(vec![spec_chunk(&lease, spec)])))
        .await
        .expect("upload over a link")
        .into_inner();
    assert!(!up.unchanged);
    assert!(std::fs::symlink_metadata(&link).expect("spec").is_file());
    assert_eq!(std::fs::read(&config).expect("config"), config_before);
    let served = fetch_all(&mut work, &agent, &lease).await.expect("served");
    assert!(String::from_utf8_lossy(&served).contains("real"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_a_linked_task_or_subtask_folder_is_refused_naming_it_and_nothing_lands_there() {
    let env = Env::with_config(TOKENS_TOML);
    git_init(&env);
    let coord = Coord::start(&env, &["--no-dispatch"]);
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    let mut agent = coord.api_as(AGENT_TOKEN).await;
    let mut work = WorkClient::new(coord.channel().await);
    // Elsewhere: folders that look like tasks, their spec a copy of the config's tokens.
    let outside = tempfile::tempdir().expect("outside");
    let config = env.config.clone().expect("a config file");
    let elsewhere = outside.path().join("t");
    std::fs::create_dir_all(elsewhere.join("subtasks/s")).expect("mkdir");
    for d in [elsewhere.clone(), elsewhere.join("subtasks/s")] {
        std::fs::write(d.join(".state"), "research\n").expect("state");
        std::fs::copy(&config, d.join("SPEC.md")).expect("spec");
        std::fs::write(d.join(".state.approvals"), "").expect("approvals");
    }
    let outside_files = || {
        let mut out = Vec::new();
        for d in [elsewhere.clone(), elsewhere.join("subtasks/s")] {
            for e in std::fs::read_dir(&d).expect("dir").flatten() {
                out.push((e.path(), std::fs::read(e.path()).ok()));
            }
        }
        out.sort();
        out
    };
    let outside_before = outside_files();
    ops.claimable_task("p").await;
    ops.claimable_task("p/s").await;
    let top = agent.claim("p", "agent-a", 60_000).await.expect("claim p");
    let sub = agent
        .claim("p/s", "agent-a", 60_000)
        .await
        .expect("claim p/s");
    let secrets = [OPERATOR_TOKEN, AGENT_B_TOKEN, WORKER_A_TOKEN];
    let spec = b"# Spec\nthrough a link\n";
    let p_dir = env.task_dir("p");
    let cases: [(&str, PathBuf, PathBuf, &[&pb::Lease]); 3] = [
        ("tasks/p", p_dir.clone(), elsewhere.clone(), &[&top, &sub]),
        (
            "tasks/p/subtasks/s",
            env.task_dir("p/s"),
            elsewhere.join("subtasks/s"),
            &[&sub],
        ),
        (
            "tasks/p/subtasks",
            p_dir.join("subtasks"),
            elsewhere.join("subtasks"),
            &[&sub],
        ),
    ];
    for (what, dir, to, leases) in cases {
        let aside = swap_for_link(&dir, &to);
        for lease in leases {
            let what = format!("{what} ({})", lease.task);
            let s = fetch_all(&mut work, &agent, lease)
                .await
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .expect_err("a linked folder");
            refused_naming(&what, &s, &dir, &secrets);
            let s = work
                .upload_artifact(agent.req(tokio_stream::iter(vec![spec_chunk(lease, spec)])))
                .await
                .expect_err("an upload through a linked folder");
            refused_naming(&what, &s, &dir, &secrets);
            let s = ops.get(&lease.task).await.expect_err("GetTask");
            refused_naming(&what, &s, &dir, &secrets);
        }
        put_back(&dir, &aside);
    }
    assert_eq!(outside_files(), outside_before, "something landed outside");
    // Put back, both are served again.
    fetch_all(&mut work, &agent, &top).await.expect("p");
    fetch_all(&mut work, &agent, &sub).await.expect("p/s");
}

/// Every alias of `.git` the issue names and git's rules add, the `.gitmodules` family's
/// other spellings, and `.automaton`'s at the root.
const ALIASES: &[&str] = &[
    ".g\u{200c}it/config",
    "\u{feff}.git/config",
    ".git\u{202e}/config",
    ".git./config",
    ".git /config",
    ".git . ./config",
    ".git::$INDEX_ALLOCATION/config",
    ".git:/config",
    "git~1/config",
    "GIT~1/config",
    ".GIT/config",
    "src/.Git/hooks/pre-commit",
    "a\\.git\\config",
    "a\\git~1\\config",
    "gitmod~1",
    "gi7eba~1",
    ".gitmodules.",
    ".GITMODULES",
    ".git\u{200c}modules",
    "gi250a~1",
    ".gitattributes ",
    "mailma~1",
    ".AUTOMATON/tasks/t/.state",
    ".automaton./tasks/t/.state",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upload_patch_with_a_git_alias_is_invalid_argument_and_the_branch_is_unchanged() {
    let env = Env::new();
    git_init(&env);
    let coord = Coord::start(&env, &["--no-dispatch"]);
    let mut api = coord.api().await;
    api.approved_research(&env, "t", Some("implement")).await;
    let lease = api.claim("t", "agent-x", 60_000).await.expect("claim");
    let mut work = WorkClient::new(coord.channel().await);
    let base = manifest(&mut work, &lease).await.commit;
    let patch = |path: &str| {
        vec![pb::PatchChunk {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            base_commit: base.clone(),
            change: Some(pb::FileChange {
                path: path.into(),
                deleted: false,
                executable: false,
                data: b"[core]\n\thooksPath = /tmp\n".to_vec(),
                last: true,
            }),
        }]
    };
    let head = || {
        let out = std::process::Command::new("git")
            .args(["rev-parse", "automaton/t"])
            .current_dir(env.root())
            .output()
            .expect("git rev-parse");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    let tip = head();
    assert_eq!(tip, base);
    for alias in ALIASES {
        let s = work
            .upload_patch(tokio_stream::iter(patch(alias)))
            .await
            .expect_err(alias);
        assert_eq!(s.code(), Code::InvalidArgument, "{alias:?}: {s:?}");
        assert!(s.message().contains("Invalid path"), "{alias:?}: {s:?}");
        assert!(
            s.message().len() < 600 && !s.message().contains('\n'),
            "{alias:?}: {s:?}"
        );
        assert_eq!(head(), tip, "{alias:?} moved the branch");
    }
    // What git allows still commits, and git fsck finds nothing wrong with the branch.
    for ok in [
        ".github/x.yml",
        "git/x",
        ".gitkeep",
        "a.git/x",
        ".gitmodules",
    ] {
        let r = work
            .upload_patch(tokio_stream::iter(patch(ok)))
            .await
            .unwrap_or_else(|s| panic!("{ok}: {s:?}"))
            .into_inner();
        assert_eq!(r.files_changed, 1, "{ok}");
    }
    let fsck = std::process::Command::new("git")
        .args(["fsck", "--strict", "--no-dangling"])
        .current_dir(env.root())
        .output()
        .expect("git fsck");
    assert!(fsck.status.success(), "{fsck:?}");
}
