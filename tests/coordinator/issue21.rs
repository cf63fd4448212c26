//! Issue 21: reviewers see the change — in the phases after implement, the workspace holds
//! `changes.diff` (the task branch against where it started) and the manifest names that
//! base commit; earlier phases get neither.

use std::collections::BTreeMap;
use std::time::Duration;

use automaton_proto::v1 as pb;
use pb::work_client::WorkClient;

use crate::harness::*;
use crate::waves::approve_all;
use crate::work::{FLEET, git, git_init, scripted_worker as worker};

/// The workspace served under `lease`: its manifest and each task file's bytes.
async fn workspace(
    work: &mut WorkClient<tonic::transport::Channel>,
    lease: &pb::Lease,
) -> (pb::WorkspaceManifest, BTreeMap<String, Vec<u8>>) {
    let mut stream = work
        .fetch_workspace(pb::FetchWorkspaceRequest {
            lease_id: lease.lease_id.clone(),
            token: lease.token,
            cached_commits: vec![],
        })
        .await
        .expect("FetchWorkspace")
        .into_inner();
    let mut manifest = None;
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    while let Some(chunk) = stream.message().await.expect("a chunk") {
        match chunk.part {
            Some(pb::workspace_chunk::Part::Manifest(m)) => {
                for f in &m.files {
                    if f.kind == "task" {
                        files.insert(f.path.clone(), Vec::new());
                    }
                }
                manifest = Some(m);
            }
            Some(pb::workspace_chunk::Part::Data(d)) if d.kind == "task" => {
                files.entry(d.path).or_default().extend(d.data);
            }
            _ => {}
        }
    }
    (manifest.expect("a manifest"), files)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue21_review_phases_get_changes_diff_and_the_base_commit() {
    let env = Env::new();
    git_init(&env);
    let base = git(&env, &["rev-parse", "HEAD"]).trim().to_string();
    let coord = Coord::start(&env, &FLEET);
    let mut api = coord.api().await;
    // One worker: it implements, and may not review its own work, so code_review waits.
    let w = worker(&coord, "gpu-a", "sim:24GiB", &[]);
    api.create("t").await.expect("create");
    let approver = approve_all(&api);
    poll(
        "implement done, code_review waiting",
        Duration::from_secs(40),
        || {
            let mut api = api.clone();
            async move {
                let open = api.state("t").await == "code_review";
                (open && api.lease_of("t").await.is_none()).then_some(())
            }
        },
    )
    .await;
    approver.abort();
    let mut work = WorkClient::new(coord.channel().await);
    let lease = api
        .claim("t", "reviewer", 60_000)
        .await
        .expect("claim code_review");
    let (m, files) = workspace(&mut work, &lease).await;
    assert_eq!(m.base_commit, base, "{m:?}");
    let head = git(&env, &["rev-parse", "automaton/t"]).trim().to_string();
    assert_eq!(m.commit, head);
    assert_ne!(head, base, "implement committed the code");
    let diff = String::from_utf8(files.get("changes.diff").cloned().unwrap_or_default())
        .expect("UTF-8 diff");
    // The implement commit's change, as `git diff base head` shows it.
    assert!(diff.contains("+++ b/AUTOMATON_SCRIPTED.md"), "{diff}");
    let want = git(
        &env,
        &["diff", &base, &head, "--", ".", ":(exclude).automaton"],
    );
    let added = |d: &str| -> Vec<String> {
        d.lines()
            .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(added(&diff), added(&want), "{diff}\n---\n{want}");
    assert!(
        !diff.contains(".automaton/"),
        "the task store is no part of it: {diff}"
    );
    api.release(&lease.lease_id, lease.token)
        .await
        .expect("release");

    // Research is given neither (the worker gone, nobody else takes it).
    drop(w);
    api.create("u").await.expect("create");
    api.transition("u", "research").await.expect("research");
    let lease = poll("u claimable", Duration::from_secs(10), || {
        let mut api = api.clone();
        async move { api.claim("u", "other", 60_000).await.ok() }
    })
    .await;
    let (m, files) = workspace(&mut work, &lease).await;
    assert_eq!(m.base_commit, "", "{m:?}");
    assert!(!files.contains_key("changes.diff"), "{files:?}");
}
