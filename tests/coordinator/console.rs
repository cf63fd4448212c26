//! Issue 23's console, the coordinator's side: `--web-listen` / `web_listen` and its
//! refusals, and the browser test: a real Chromium (over WebDriver) driving the console of a
//! real coordinator with three real workers on a decomposed task. Issue 30's: a token-less
//! console refuses another site's name (DNS rebinding), `back` never leaves the console, and
//! live streams are capped per client and cut when their reader stalls
//! (`web_max_streams`, `web_stall_timeout`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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
        (
            "web_listen = \"127.0.0.1:0\"\nweb_max_streams = 0\n",
            "web_max_streams = 0",
        ),
        (
            "web_listen = \"127.0.0.1:0\"\nweb_stall_timeout = \"0ms\"\n",
            "web_stall_timeout must be above 0",
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

/// The console's address, from the coordinator's `console on http://ADDR/` line.
fn console_addr(coord: &Coord) -> SocketAddr {
    let url = coord.console.clone().expect("a `console on URL` line");
    url.trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|_| panic!("a console address in {url}"))
}

/// One HTTP/1.1 request to the console at `addr` naming `host` (connection closed after);
/// the whole response as text.
async fn http_to(
    addr: SocketAddr,
    host: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\n{headers}\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("an answer in time")
        .expect("read");
    String::from_utf8_lossy(&out).into_owned()
}

fn http_status(resp: &str) -> u16 {
    resp.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn csrf_of(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a csrf field") + 19;
    page[at..].split('"').next().expect("its value").to_string()
}

fn location(resp: &str) -> Option<String> {
    resp.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("location")
            .then(|| v.trim().to_string())
    })
}

/// A task waiting at `research:awaiting_approval`, made through the API.
async fn gate(api: &mut Api, env: &Env, task: &str) {
    api.claimable_task(task).await;
    env.artifact(task, "SPEC.md", "# Spec\nwhat to build\n");
    api.transition(task, "research:awaiting_approval")
        .await
        .unwrap_or_else(|s| panic!("Transition {task} research:awaiting_approval: {s:?}"));
}

/// Issue 30 §6, DNS rebinding: a page on `attacker.example` resolving to 127.0.0.1 names
/// itself in `Host` and `Origin`. The token-less console refuses it 403 in one line on
/// `GET /fleet` and on the approve POST (with the page's real CSRF token), and the gate is
/// still awaiting approval; `127.0.0.1:PORT` and `localhost:PORT` still work (the approve
/// through `localhost` goes through).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_less_console_refuses_a_rebound_host_and_origin_and_the_gate_stays_unapproved() {
    let env = Env::new();
    let coord = Coord::start(&env, &["--web-listen", "127.0.0.1:0", "--no-dispatch"]);
    let console = console_addr(&coord);
    let port = console.port();
    let mut api = coord.api().await;
    gate(&mut api, &env, "research").await;

    let own = format!("127.0.0.1:{port}");
    let page = http_to(console, &own, "GET", "/task/research", "", "").await;
    assert_eq!(http_status(&page), 200, "{page}");
    let csrf = csrf_of(&page);
    let approvals = env.task_file("research", ".state.approvals");

    let evil = format!("attacker.example:{port}");
    let evil_origin = format!("Origin: http://attacker.example:{port}\r\n");
    let refusal = format!(
        "this console has no tokens, so it answers only requests to localhost, 127.0.0.1 or [::1] on port {port}"
    );
    let fleet = http_to(console, &evil, "GET", "/fleet", &evil_origin, "").await;
    assert_eq!(http_status(&fleet), 403, "{fleet}");
    assert!(fleet.contains(&refusal), "{fleet}");
    assert!(
        !fleet.contains("name=\"csrf\""),
        "no CSRF token handed out: {fleet}"
    );
    let approve = format!("task=research&csrf={csrf}&back=%2Ftask%2Fresearch");
    let r = http_to(
        console,
        &evil,
        "POST",
        "/action/approve",
        &evil_origin,
        &approve,
    )
    .await;
    assert_eq!(http_status(&r), 403, "{r}");
    assert!(r.contains(&refusal), "{r}");
    assert_eq!(api.state("research").await, "research:awaiting_approval");
    assert_eq!(env.task_file("research", ".state.approvals"), approvals);

    for host in [own.clone(), format!("localhost:{port}")] {
        let r = http_to(console, &host, "GET", "/fleet", "", "").await;
        assert_eq!(http_status(&r), 200, "{host}: {r}");
    }
    let origin = format!("Origin: http://localhost:{port}\r\n");
    let host = format!("localhost:{port}");
    let r = http_to(console, &host, "POST", "/action/approve", &origin, &approve).await;
    assert_eq!(http_status(&r), 303, "{r}");
    assert_eq!(api.state("research").await, "research:approved");
}

/// Issue 30 §7: a TAB (or another control character, or whitespace) in an action's `back`
/// does not become the `Location`: the action is done and the answer goes to `/board`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tab_or_control_character_in_back_redirects_to_the_board() {
    let env = Env::new();
    let coord = Coord::start(&env, &["--web-listen", "127.0.0.1:0", "--no-dispatch"]);
    let console = console_addr(&coord);
    let own = console.to_string();
    let mut api = coord.api().await;
    for (i, back) in [
        "%2F%09%2Fevil.example%2F",
        "%2F%0B%2Fevil.example%2F",
        "%2F+%2Fevil.example%2F",
    ]
    .iter()
    .enumerate()
    {
        let task = format!("gate{i}");
        gate(&mut api, &env, &task).await;
        let page = http_to(console, &own, "GET", &format!("/task/{task}"), "", "").await;
        let body = format!("task={task}&csrf={}&back={back}", csrf_of(&page));
        let r = http_to(console, &own, "POST", "/action/approve", "", &body).await;
        assert_eq!(http_status(&r), 303, "{back}: {r}");
        assert_eq!(location(&r).as_deref(), Some("/board"), "{back}: {r}");
        assert_eq!(api.state(&task).await, "research:approved");
    }
}

/// Opens `GET /events` (or another stream) and reads only its answer's headers; the socket
/// stays open, read no further. Not 200: the whole answer as text.
async fn open_stream(socket: tokio::net::TcpSocket, addr: SocketAddr) -> Result<TcpStream, String> {
    let mut s = socket.connect(addr).await.expect("connect");
    let req = format!("GET /events HTTP/1.1\r\nHost: {addr}\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .expect("headers in time")
            .expect("read");
        if n == 0 {
            break;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    if http_status(&head) == 200 {
        return Ok(s);
    }
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    Err(format!("{head}{}", String::from_utf8_lossy(&rest)))
}

fn socket() -> tokio::net::TcpSocket {
    tokio::net::TcpSocket::new_v4().expect("socket")
}

/// Issue 30 §7: `web_max_streams` caps the live streams of one client (no tokens: one
/// address): the one past it is refused 429 in one line; a closed one frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_past_web_max_streams_is_refused_429() {
    let env = Env::with_config("web_max_streams = 2\n");
    let coord = Coord::start(&env, &["--web-listen", "127.0.0.1:0", "--no-dispatch"]);
    let console = console_addr(&coord);
    let first = open_stream(socket(), console).await.expect("first");
    let _second = open_stream(socket(), console).await.expect("second");
    let third = open_stream(socket(), console).await.expect_err("third");
    assert_eq!(http_status(&third), 429, "{third}");
    assert!(
        third.contains("too many live streams open for your address (2 at most, web_max_streams)"),
        "{third}"
    );
    drop(first);
    poll(
        "the closed stream's place",
        Duration::from_secs(10),
        || async { open_stream(socket(), console).await.ok() },
    )
    .await;
}

/// Issue 30 §7: a client that opens `/events` and never reads (a small receive buffer)
/// while refused claims flood the feed is disconnected within `web_stall_timeout` of its
/// buffers filling (its place under `web_max_streams = 1` is free again and its connection
/// ends), and `GET /board` answers meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_events_reader_is_cut_within_web_stall_timeout_while_the_board_answers() {
    let env = Env::with_config("web_max_streams = 1\nweb_stall_timeout = \"1s\"\n");
    let coord = Coord::start(&env, &["--web-listen", "127.0.0.1:0", "--no-dispatch"]);
    let console = console_addr(&coord);
    let small = socket();
    small.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let mut stalled = open_stream(small, console)
        .await
        .expect("the stalled stream");
    // The feed flooded: each refused claim is a `lease_refused` event of some 400 bytes on
    // the page's stream.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut flooders = Vec::new();
    for f in 0..8 {
        let mut api = coord.api().await;
        let (stop, sent) = (stop.clone(), sent.clone());
        flooders.push(tokio::spawn(async move {
            let task = format!("{f}{}", "t".repeat(63));
            let agent = format!("{f}{}", "a".repeat(63));
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = api.claim(&task, &agent, 0).await;
                sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }));
    }
    let started = Instant::now();
    // While the stalled reader holds the one place, the board answers.
    let board = http_to(console, &console.to_string(), "GET", "/board", "", "").await;
    assert_eq!(http_status(&board), 200, "{board}");
    let held = open_stream(socket(), console)
        .await
        .expect_err("the stalled stream holds the place");
    assert_eq!(http_status(&held), 429, "{held}");
    let freed = loop {
        if open_stream(socket(), console).await.is_ok() {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the stalled reader still holds its stream after {:?} ({} claims refused)",
            started.elapsed(),
            sent.load(std::sync::atomic::Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for f in flooders {
        let _ = f.await;
    }
    eprintln!(
        "stalled reader cut {freed:?} after the flood began ({} claims refused)",
        sent.load(std::sync::atomic::Ordering::Relaxed)
    );
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), stalled.read_to_end(&mut rest)).await;
    assert!(ended.is_ok(), "the stalled connection was closed");
    assert!(
        coord.wait_stderr(
            "a client read nothing for the stall timeout",
            Duration::from_secs(5)
        ),
        "{}",
        coord.stderr()
    );
}

/// The `N` of the page's `updated N ago` (`1m 5s` is 65), if it says one.
fn data_age_secs(text: &str) -> Option<u64> {
    let age = text.strip_prefix("updated ")?.split(" ago").next()?;
    age.split(' ').try_fold(0, |sum, part| {
        let (n, unit) = part.split_at(part.find(|c: char| !c.is_ascii_digit())?);
        let n: u64 = n.parse().ok()?;
        Some(
            sum + n * match unit {
                "s" => 1,
                "m" => 60,
                "h" => 3600,
                "d" => 86400,
                _ => return None,
            },
        )
    })
}

/// The page's two facts, as a person reads them: the connection's text, the freshness's
/// state (`fresh` / `stale`) and its `#stale` and `#age` texts.
fn liveness(browser: &Browser) -> (String, String, String, String) {
    let fresh = browser
        .find("#freshness")
        .and_then(|f| browser.attr(&f, "data-state"))
        .unwrap_or_default();
    (
        browser.text_of("#connection"),
        fresh,
        browser.text_of("#stale"),
        browser.text_of("#age"),
    )
}

/// Waits for the coordinator killed at `addr` to free its console port (the coordinator
/// binds with SO_REUSEADDR, as this check does), so the next one can listen there.
fn port_free(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let bound = tokio::net::TcpSocket::new_v4().and_then(|s| {
            s.set_reuseaddr(true)?;
            s.bind(addr)?;
            s.listen(1).map(drop)
        });
        match bound {
            Ok(()) => return,
            Err(e) => assert!(Instant::now() < deadline, "{addr} still taken: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Signs in with the operator's token on the sign-in page the browser shows; the board.
fn sign_in_on_the_page(browser: &Browser) {
    assert!(browser.url().ends_with("/login"), "{}", browser.url());
    browser.type_into("input[name=token]", OPERATOR_TOKEN);
    browser.submit("#login button[type=submit]");
    browser.wait("the board, signed in", Duration::from_secs(10), |b| {
        b.find("#board")
    });
}

/// Issue 36 (seed 003: connection and freshness are two facts): the open board says
/// `connected` with fresh data; within seconds of the coordinator's `kill -9` it says
/// `reconnecting (why)` while still showing what it had, and that data's age keeps growing
/// until it is marked stale; once the coordinator is back on the same project and console
/// port, the page (its sign-in gone with the old process) sends the operator to sign in,
/// and the board is `connected` again, fresh, with the task created while it was down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_says_reconnecting_within_seconds_of_the_coordinators_kill_9_and_connected_after_its_restart()
 {
    let Some(browser) = Browser::start_or_skip("console_says_reconnecting") else {
        return;
    };
    let shots = screenshot_dir();
    let env = Env::with_config(TOKENS_TOML);
    let mut coord = Coord::start(&env, &["--web-listen", "127.0.0.1:0", "--no-dispatch"]);
    let web = console_addr(&coord);
    let console = format!("http://{web}");
    coord
        .api_as(OPERATOR_TOKEN)
        .await
        .create("before-the-kill")
        .await
        .expect("create before-the-kill");

    browser.goto(&format!("{console}/board"));
    sign_in_on_the_page(&browser);
    browser.wait("connected and fresh", Duration::from_secs(10), |b| {
        let (conn, fresh, stale, age) = liveness(b);
        (conn == "connected"
            && fresh == "fresh"
            && stale.is_empty()
            && data_age_secs(&age) <= Some(2))
        .then_some(())
    });
    assert!(browser.find(".card[data-task='before-the-kill']").is_some());
    browser.screenshot(&shots, "36-01-connected");

    coord.kill9();
    let killed = Instant::now();
    let said = browser.wait("reconnecting", Duration::from_secs(10), |b| {
        let conn = b.text_of("#connection");
        conn.starts_with("reconnecting (").then_some(conn)
    });
    let within = killed.elapsed();
    eprintln!("{said:?} {within:?} after the kill");
    assert!(
        within < Duration::from_secs(5),
        "{said} only after {within:?}"
    );
    // Why, as far as the browser can tell.
    let why = browser.wait("why", Duration::from_secs(10), |b| {
        let conn = b.text_of("#connection");
        conn.contains("the console does not answer").then_some(conn)
    });
    assert_eq!(why, "reconnecting (the console does not answer)");
    // What it had stays on the page, and its age grows until it is marked stale.
    assert!(browser.find(".card[data-task='before-the-kill']").is_some());
    let first = data_age_secs(&liveness(&browser).3).expect("an age");
    let (_, _, stale, age) = browser.wait("stale", Duration::from_secs(20), |b| {
        let l = liveness(b);
        (l.1 == "stale").then_some(l)
    });
    assert_eq!(stale, "stale");
    let later = data_age_secs(&age).expect("an age");
    assert!(later >= 10 && later > first, "{first}s, then {age}");
    assert!(
        liveness(&browser).0.starts_with("reconnecting ("),
        "still reconnecting"
    );
    browser.screenshot(&shots, "36-02-reconnecting-stale");

    // Changed while nobody watched: the files, as the CLI writes them without a coordinator.
    env.cli(&["--create-task", "while-down"]).ok();
    port_free(web);
    let web_arg = web.to_string();
    coord = Coord::start(&env, &["--web-listen", &web_arg, "--no-dispatch"]);
    assert_eq!(console_addr(&coord), web);
    // The sign-in lived in the killed process: the page finds it signed out and says so by
    // going to the sign-in page.
    browser.wait("the sign-in page", Duration::from_secs(20), |b| {
        b.url().ends_with("/login").then_some(())
    });
    sign_in_on_the_page(&browser);
    browser.wait(
        "connected and fresh, with what changed",
        Duration::from_secs(10),
        |b| {
            let (conn, fresh, stale, age) = liveness(b);
            (conn == "connected"
                && fresh == "fresh"
                && stale.is_empty()
                && data_age_secs(&age) <= Some(2)
                && b.find(".card[data-task='while-down']").is_some())
            .then_some(())
        },
    );
    browser.screenshot(&shots, "36-03-connected-again");
}

/// Issue 36, the same page through an outage (no tokens: no sign-in to lose): the board
/// open before `kill -9` is still the same page after the coordinator's restart on the same
/// console port — it reconnected by itself, says `connected`, and shows, fresh, the task
/// created while it was down (no event tells of it: the page re-fetched on reconnecting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_open_board_reconnects_by_itself_after_a_restart_and_shows_what_changed_while_it_was_down()
 {
    let Some(browser) = Browser::start_or_skip("the_open_board_reconnects") else {
        return;
    };
    let env = Env::new();
    let mut coord = Coord::start(&env, &["--web-listen", "127.0.0.1:0", "--no-dispatch"]);
    let web = console_addr(&coord);
    browser.goto(&format!("http://{web}/board"));
    browser.wait("connected", Duration::from_secs(10), |b| {
        (liveness(b).0 == "connected").then_some(())
    });
    browser.script("window.automatonMarker = 'same page'; return null;");

    coord.kill9();
    browser.wait("reconnecting", Duration::from_secs(5), |b| {
        liveness(b).0.starts_with("reconnecting (").then_some(())
    });
    env.cli(&["--create-task", "while-down"]).ok();
    assert!(browser.find(".card[data-task='while-down']").is_none());
    port_free(web);
    let web_arg = web.to_string();
    coord = Coord::start(&env, &["--web-listen", &web_arg, "--no-dispatch"]);
    let back = Instant::now();
    browser.wait(
        "connected, fresh, with the task created while down",
        Duration::from_secs(15),
        |b| {
            let (conn, fresh, _, _) = liveness(b);
            (conn == "connected"
                && fresh == "fresh"
                && b.find(".card[data-task='while-down']").is_some())
            .then_some(())
        },
    );
    eprintln!("connected again {:?} after the restart", back.elapsed());
    assert_eq!(
        browser.script("return window.automatonMarker || null;"),
        serde_json::json!("same page"),
        "the page reconnected in place, not reloaded"
    );
    drop(coord);
}
