//! Issue 22, proof 1: `kill -9` of the leader coordinator mid-wave of a decomposed task.
//! Two coordinators on a real 3-member etcd cluster share a bare git remote; two real
//! workers with the scripted agent are given both. The wave completes on the new leader,
//! every sub-task reaches `complete`, and the shared remote holds each sub-task's implement
//! commit exactly once.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cluster::Cluster;
use crate::ha::{env_on_with, leader_of};
use crate::harness::{Api, Coord, Env, connect};
use crate::waves::spec;
use crate::work::{FLEET, git_init, scripted_worker_at};

fn git(dir: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .expect("run git");
    assert!(out.status.success(), "git {args:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A coordinator's project on `cluster` sharing the task branches through `remote`.
fn env_with_remote(cluster: &Cluster, remote: &std::path::Path) -> Arc<Env> {
    env_on_with(
        cluster,
        "waves",
        &format!("git_remote = {:?}\n", remote.display().to_string()),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ha_kill9_of_the_leader_mid_wave_the_wave_completes_and_each_implement_commit_lands_once() {
    let cluster = Cluster::three().await;
    // The project's repository, the shared bare remote made from it, and a second clone.
    let scratch = tempfile::tempdir().expect("tempdir");
    let remote = scratch.path().join("shared.git");
    let a_env = env_with_remote(&cluster, &remote);
    git_init(&a_env);
    let a_root = a_env.root().display().to_string();
    git(
        scratch.path(),
        &["clone", "-q", "--bare", &a_root, "shared.git"],
    );
    let b_env = env_with_remote(&cluster, &remote);
    git(
        b_env.root(),
        &["clone", "-q", &remote.display().to_string(), "."],
    );
    let mut a = Coord::start(&a_env, &FLEET);
    assert_eq!(leader_of(&[&a], Duration::from_secs(20)).await, 0);
    let b = Coord::start(&b_env, &FLEET);
    let both = format!("{},{}", a.url, b.url);
    let mut api = Api::new(connect(&a.url).await, None);
    // Three independent sub-tasks in one wave; slow agents, so the kill lands mid-wave.
    api.create("p").await.expect("create");
    api.transition("p", "research").await.expect("to research");
    a_env.artifact(
        "p",
        "SPEC.md",
        &spec(&[("one", "-", 20), ("two", "-", 20), ("three", "-", 20)]),
    );
    let slow = [("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=1500")];
    let _w1 = scripted_worker_at(&both, "gpu-a", "sim:24GiB", &slow);
    let _w2 = scripted_worker_at(&both, "gpu-b", "sim:24GiB", &slow);
    // Approve every gate on whichever coordinator leads.
    let approver = {
        let urls = [a.url.clone(), b.url.clone()];
        tokio::spawn(async move {
            loop {
                for url in &urls {
                    // Lazily: the killed one refuses connections (a connect() would panic).
                    let channel = tonic::transport::Channel::from_shared(url.clone())
                        .expect("url")
                        .connect_timeout(Duration::from_secs(1))
                        .timeout(Duration::from_secs(5))
                        .connect_lazy();
                    let mut api = Api::new(channel, None);
                    if let Ok(list) = api.list().await {
                        let mut all = Vec::new();
                        for t in list.tasks {
                            all.extend(
                                t.subtasks.iter().map(|s| (s.task.clone(), s.state.clone())),
                            );
                            all.push((t.task, t.state));
                        }
                        for (task, state) in all {
                            if state.ends_with(":awaiting_approval") {
                                let _ = api.approve(&task, "ops").await;
                            }
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    // Mid-wave: a sub-task's implement under way.
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let list = api.list().await.expect("list");
        let implementing = list
            .tasks
            .iter()
            .flat_map(|t| t.subtasks.iter())
            .any(|s| s.state.starts_with("implement") || s.state.starts_with("code_review"));
        if implementing {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no sub-task reached implement: {:#?}",
            list.tasks
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let killed = Instant::now();
    a.kill9();
    assert_eq!(leader_of(&[&b], Duration::from_secs(20)).await, 0);
    println!(
        "kill -9 mid-wave to the new leader serving: {:?}",
        killed.elapsed()
    );
    let mut api = Api::new(connect(&b.url).await, None);
    let deadline = Instant::now() + Duration::from_secs(150);
    loop {
        let state = api.state("p").await;
        if state == "complete" || state == "human_intervention" {
            assert_eq!(state, "complete");
            break;
        }
        if Instant::now() >= deadline {
            let mut runs = String::new();
            for sub in ["p/one", "p/two", "p/three"] {
                if let Ok(d) = api.get(sub).await {
                    for r in d.runs {
                        runs.push_str(&format!(
                            "{sub}: {} by {} token {} stop {} {} [{}]\n",
                            r.phase, r.worker, r.token, r.stop_reason, r.why, r.detail
                        ));
                    }
                    runs.push_str(&format!("{sub}: implementers {:?}\n", d.implementers));
                }
            }
            panic!("p is still {state}; runs:\n{runs}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    approver.abort();
    println!(
        "kill -9 mid-wave to the parent complete: {:?}",
        killed.elapsed()
    );
    for sub in ["one", "two", "three"] {
        assert_eq!(api.state(&format!("p/{sub}")).await, "complete", "{sub}");
        // The runs in flight at the kill were adopted, not failed and redone elsewhere: no
        // run failed, no phase completed twice. (A run whose completion was acknowledged
        // just before the kill may read `run_lost`: its `stopped` record was still on its
        // way, as after a single coordinator's crash — the task moved on all the same.)
        let runs = api.get(&format!("p/{sub}")).await.expect("get").runs;
        for phase in ["implement", "code_review"] {
            let done = runs
                .iter()
                .filter(|r| r.phase == phase && r.stop_reason == "completed")
                .count();
            assert!(
                done <= 1,
                "p/{sub}: {phase} completed {done} times: {runs:#?}"
            );
        }
        let failed: Vec<_> = runs
            .iter()
            .filter(|r| r.stop_reason != "completed" && r.stop_reason != "run_lost")
            .map(|r| {
                format!(
                    "{} by {}: {} [{}]",
                    r.phase, r.worker, r.stop_reason, r.detail
                )
            })
            .collect();
        assert!(failed.is_empty(), "p/{sub}: {failed:?}");
        // The shared remote: the sub-task's branch with its implement commit once.
        let log = git(
            &remote,
            &[
                "log",
                "--format=%s",
                &format!("refs/heads/automaton/p--{sub}"),
            ],
        );
        let implements = log
            .lines()
            .filter(|l| l.contains(": implement by "))
            .count();
        assert_eq!(implements, 1, "p/{sub} on the shared remote:\n{log}");
    }
    drop(scratch);
}
