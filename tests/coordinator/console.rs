//! Issue 23's console, the coordinator's side: `--web-listen` / `web_listen` and its
//! refusals, and the browser test: a real Chromium (over WebDriver) driving the console of a
//! real coordinator with three real workers on a decomposed task.

use std::path::PathBuf;
use std::time::Duration;

use automaton_proto::v1 as pb;

use crate::harness::*;
use crate::waves::{approve_all, plan};
use crate::webdriver::Browser;
use crate::work::{FLEET, git_init, scripted_worker};

/// `web_listen` that cannot work is refused in one line before anything binds: on the metrics
/// port, on a public address without tokens, and a trace URL without `{trace_id}`.
#[test]
fn bad_console_config_is_refused_in_one_line_before_anything_binds() {
    for (toml, says) in [
        (
            "metrics_listen = \"127.0.0.1:7393\"\nweb_listen = \"127.0.0.1:7393\"\n",
            "give the console another port",
        ),
        (
            "web_listen = \"0.0.0.0:0\"\n",
            "refusing to serve the console on 0.0.0.0:0 without authentication",
        ),
        (
            "web_listen = \"127.0.0.1:0\"\ntrace_url = \"http://jaeger:16686/trace/\"\n",
            "{trace_id}",
        ),
    ] {
        crate::harness::refused_before_binding(toml, says);
    }
}

/// Where the browser test saves its screenshots: `target/console-screenshots/`.
fn screenshot_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/<profile>/deps/coordinator-HASH
    exe.ancestors()
        .nth(3)
        .expect("the test binary lives in target/<profile>/deps")
        .join("console-screenshots")
}

/// What the board shows of the sub-tasks now: `name=state` per sub-task card, in page order.
const SUBTASK_CARDS: &str = "return Array.from(document.querySelectorAll('.wave .card')).map(function (c) { var s = c.querySelector('.state'); return c.getAttribute('data-task') + '=' + (s ? s.textContent : ''); }).join(' ');";

/// Issue 23's proof, in a real browser: an agent's and a worker's token are refused at
/// sign-in (the reason shown); an operator signs in; the fleet page shows the three workers
/// and their GPUs; the board shows the sub-tasks under their parent by wave and moving (the
/// open page changes by itself, from the event stream); the parent's research gate is
/// approved with a click and the task moves on; a running sub-task's page shows the agent's
/// output live. Screenshots go to `target/console-screenshots/`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_in_a_real_browser_signs_in_shows_fleet_and_board_waves_approves_with_a_click_and_streams_live_output()
 {
    let Some(browser) = Browser::start_or_skip("console_in_a_real_browser") else {
        return;
    };
    let shots = screenshot_dir();
    let env = Env::with_config(&tokens_with_gpu_c());
    git_init(&env);
    let mut args = FLEET.to_vec();
    args.extend(["--web-listen", "127.0.0.1:0"]);
    let coord = Coord::start(&env, &args);
    let console = coord
        .console
        .clone()
        .expect("a `console on URL` line before `listening on`");
    let console = console.trim_end_matches('/').to_string();
    let mut ops = coord.api_as(OPERATOR_TOKEN).await;
    // A decomposed task: cart and payments in wave 1, checkout (after cart) in wave 2.
    plan(
        &mut ops,
        &env,
        "shop",
        &[
            ("cart", "-", 8),
            ("payments", "-", 8),
            ("checkout", "cart", 8),
        ],
    )
    .await;
    // Each run takes 3 s, printing a line every 100 ms: the live output has time to show.
    let slow = ("AUTOMATON_SCRIPTED_BEHAVIOUR", "slow=3000");
    let _workers: Vec<_> = [
        ("gpu-a", "sim:24GiB", WORKER_A_TOKEN),
        ("gpu-b", "sim:24GiB", WORKER_B_TOKEN),
        ("gpu-c", "sim:80GiB", WORKER_C_TOKEN),
    ]
    .into_iter()
    .map(|(name, gpu, token)| {
        scripted_worker(&coord, name, gpu, &[("AUTOMATON_TOKEN", token), slow])
    })
    .collect();

    // Sign-in: not signed in, the board sends to /login; an agent's and a worker's token are
    // refused with the reason on the page.
    browser.goto(&format!("{console}/board"));
    assert!(browser.url().ends_with("/login"), "{}", browser.url());
    for (token, says) in [
        (AGENT_TOKEN, "'agent-a' is an agent's token"),
        (WORKER_A_TOKEN, "'gpu-a' is a worker's token"),
    ] {
        browser.type_into("input[name=token]", token);
        browser.submit("#login button[type=submit]");
        let refusal = browser.wait("the refusal", Duration::from_secs(10), |b| {
            Some(b.text_of("#login-error")).filter(|t| !t.is_empty())
        });
        assert!(refusal.contains(says), "{refusal}");
        assert!(browser.find("#board").is_none() && browser.find("#fleet").is_none());
    }
    browser.screenshot(&shots, "01-agent-token-refused");
    browser.type_into("input[name=token]", OPERATOR_TOKEN);
    browser.submit("#login button[type=submit]");
    browser.wait("the board, signed in", Duration::from_secs(10), |b| {
        b.find("#board")
    });
    assert_eq!(browser.text_of("header .operator"), "ops");

    // The fleet: three workers, each with its GPU.
    browser.goto(&format!("{console}/fleet"));
    let workers = browser.wait("three workers", Duration::from_secs(10), |b| {
        let w = b.find_all("#fleet .worker");
        (w.len() == 3).then_some(w)
    });
    let mut names: Vec<String> = workers
        .iter()
        .filter_map(|w| browser.attr(w, "data-name"))
        .collect();
    names.sort();
    assert_eq!(names, ["gpu-a", "gpu-b", "gpu-c"]);
    let gpus: Vec<String> = browser
        .find_all("#fleet .worker .gpu")
        .iter()
        .map(|g| browser.text(g))
        .collect();
    assert_eq!(gpus.len(), 3, "{gpus:?}");
    assert!(
        gpus.iter()
            .any(|g| g.contains("/80.0 GiB free (simulated)")),
        "{gpus:?}"
    );
    assert_eq!(
        gpus.iter()
            .filter(|g| g.contains("/24.0 GiB free (simulated)"))
            .count(),
        2,
        "{gpus:?}"
    );
    browser.screenshot(&shots, "02-fleet");

    // The gate: the parent's research awaits approval; a click approves it and it moves on.
    poll("shop awaiting approval", Duration::from_secs(30), || {
        let mut ops = ops.clone();
        async move {
            let s = ops.state("shop").await;
            (s == "research:awaiting_approval").then_some(())
        }
    })
    .await;
    browser.goto(&format!("{console}/task/shop"));
    browser.wait("the approve button", Duration::from_secs(10), |b| {
        b.find("#approve")
    });
    // The artifact's text is on the page (rendered from markdown).
    assert!(
        browser
            .text_of("#artifacts .artifact-text[data-artifact='SPEC.md']")
            .contains("Planned as sub-tasks."),
        "{}",
        browser.text_of("#artifacts")
    );
    browser.screenshot(&shots, "03-gate-awaiting-approval");
    browser.submit("#approve");
    let moved = browser.wait(
        "the task page to show shop past research",
        Duration::from_secs(20),
        |b| {
            let el = b.find("#task-facts p.state")?;
            let phase = b.attr(&el, "data-phase")?;
            (phase != "research").then(|| b.text(&el))
        },
    );
    assert!(moved.starts_with("decomposition"), "{moved}");
    // Approved as the signed-in operator (`research:approved|TIME|ops|SHA256`).
    let approvals = String::from_utf8_lossy(
        &env.task_file("shop", ".state.approvals")
            .expect(".state.approvals"),
    )
    .into_owned();
    assert!(
        approvals
            .lines()
            .any(|l| l.starts_with("research:approved|") && l.split('|').nth(2) == Some("ops")),
        "{approvals}"
    );
    browser.screenshot(&shots, "04-gate-approved");

    // Every later gate is approved by the test, so the waves move.
    let approver = approve_all(&ops);
    browser.goto(&format!("{console}/board"));
    browser.wait(
        "the sub-tasks under shop, by wave",
        Duration::from_secs(30),
        |b| {
            let wave1 = b.find_all(".card[data-task='shop'] .wave[data-wave='1'] .card");
            let wave2 = b.find_all(".card[data-task='shop'] .wave[data-wave='2'] .card");
            let names = |els: &[String]| -> Vec<String> {
                let mut n: Vec<String> =
                    els.iter().filter_map(|e| b.attr(e, "data-task")).collect();
                n.sort();
                n
            };
            (names(&wave1) == ["shop/cart", "shop/payments"] && names(&wave2) == ["shop/checkout"])
                .then_some(())
        },
    );
    // The open page changes by itself (no navigation: the marker survives).
    browser.script("window.automatonMarker = 'same page'; return null;");
    let first = browser.script(SUBTASK_CARDS);
    browser.screenshot(&shots, "05-board-waves");
    let later = browser.wait("the board to move", Duration::from_secs(20), |b| {
        let now = b.script(SUBTASK_CARDS);
        (now != first).then_some(now)
    });
    assert_eq!(
        browser.script("return window.automatonMarker || null;"),
        serde_json::json!("same page"),
        "the board was updated in place, not reloaded"
    );
    eprintln!("board: {first} -> {later}");
    browser.screenshot(&shots, "06-board-moved");

    // Live output: a running sub-task's page shows what its agent prints while it runs.
    let mut shown = None;
    for _ in 0..5 {
        let running = poll("a running sub-task", Duration::from_secs(20), || {
            let mut ops = ops.clone();
            async move {
                let req = ops.req(pb::ListWorkersRequest {});
                let workers = ops
                    .workers
                    .list_workers(req)
                    .await
                    .ok()?
                    .into_inner()
                    .workers;
                workers.into_iter().find_map(|w| {
                    w.leases
                        .iter()
                        .filter(|l| l.task.starts_with("shop/"))
                        .find(|l| {
                            w.runs
                                .iter()
                                .any(|r| r.token == l.token && r.state == "active")
                        })
                        .map(|l| (l.task.clone(), l.token))
                })
            }
        })
        .await;
        let (task, token) = running;
        browser.goto(&format!("{console}/task/{task}"));
        let needle = format!("working on {task}: step");
        let seen = std::time::Instant::now();
        let mut text = String::new();
        while seen.elapsed() < Duration::from_secs(5) {
            text = browser.text_of("#output");
            if text.contains(&needle) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Shown while that very run still holds the task.
        let live = ops.lease_of(&task).await.is_some_and(|l| l.token == token);
        eprintln!(
            "live output of {task} (run {token}): shown {}, still running {live}",
            text.contains(&needle)
        );
        if text.contains(&needle) && live {
            shown = Some((task, text));
            break;
        }
    }
    let (task, text) = shown.expect("a running sub-task's output shown while it ran");
    assert!(text.contains("scripted agent: "), "{task}: {text}");
    browser.script("document.getElementById('live').scrollIntoView(); return null;");
    browser.screenshot(&shots, "07-live-output");
    approver.abort();
}
