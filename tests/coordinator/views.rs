//! Issue 13, live views: `automaton watch` and `automaton top` against the real coordinator
//! (and a real worker), `top` driven in a real terminal: a detached tmux session.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::*;
use crate::work::FLEET;
use crate::workers::Worker;

/// A running `automaton watch ARGS`, its stdout lines and stderr collected as they come.
struct Watch {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Watch {
    fn spawn(env: &Env, args: &[&str]) -> Watch {
        let mut c = Command::new(cli_bin());
        c.arg("watch").args(args);
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        c.env("HOME", env.home.path())
            .env_remove("NO_COLOR")
            .current_dir(env.root())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn automaton watch");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let out = child.stdout.take().expect("stdout");
        let sink = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { return };
                sink.lock().unwrap_or_else(|p| p.into_inner()).push(l);
            }
        });
        let err = child.stderr.take().expect("stderr");
        let sink = stderr.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines() {
                let Ok(l) = l else { return };
                let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
                s.push_str(&l);
                s.push('\n');
            }
        });
        Watch {
            child,
            lines,
            stderr,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Waits (bounded) for a line containing `needle`.
    async fn wait_line(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.lines().iter().any(|l| l.contains(needle)) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// Creates `{prefix}-1`, `{prefix}-2`, … until one shows: from then on the watch is
    /// subscribed and sees every event.
    async fn warm_up(&self, api: &mut Api, prefix: &str) {
        for i in 1..=100 {
            let name = format!("{prefix}-{i}");
            api.create(&name)
                .await
                .unwrap_or_else(|s| panic!("CreateTask {name}: {s:?}"));
            if self.wait_line(&name, Duration::from_millis(200)).await {
                return;
            }
        }
        panic!(
            "automaton watch showed none of 100 creations;\nstdout: {:?}\nstderr: {}",
            self.lines(),
            self.stderr()
        );
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn watch_prints_one_line_per_event() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let watch = Watch::spawn(&env, &["--coordinator", &coord.url]);
    watch.warm_up(&mut api, "warm").await;
    // The events as the coordinator sends them, to compare line for line.
    let mut events = Events::watch(&api).await;

    api.create("t1").await.expect("create t1");
    api.transition("t1", "research")
        .await
        .expect("t1 → research");
    let lease = api.claim("t1", "agent-a", 60_000).await.expect("claim t1");
    api.release(&lease.lease_id, lease.token)
        .await
        .expect("release t1");
    events.expect("lease_released", "t1").await;
    assert!(
        watch
            .wait_line("lease_released", Duration::from_secs(5))
            .await,
        "{:?}",
        watch.lines()
    );

    let sent: Vec<_> = events
        .settle(Duration::from_millis(300))
        .await
        .iter()
        .filter(|e| e.task == "t1")
        .cloned()
        .collect();
    let shown: Vec<String> = watch
        .lines()
        .into_iter()
        .filter(|l| l.split_whitespace().nth(2) == Some("t1"))
        .collect();
    let kinds: Vec<&str> = sent.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "task_created",
            "transitioned",
            "lease_granted",
            "lease_released"
        ]
    );
    assert_eq!(
        shown.len(),
        sent.len(),
        "one line per event;\nlines: {shown:#?}\nevents: {sent:#?}"
    );
    for (line, e) in shown.iter().zip(&sent) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        // time, kind, task, agent, token, detail
        let at =
            e.at.and_then(|t| std::time::SystemTime::try_from(t).ok())
                .map(automaton_store::format_time_millis)
                .expect("every event has a time");
        assert!(at.ends_with(cols[0]), "time of day of {at}: {line}");
        assert_eq!(cols[1], e.kind, "{line}");
        let agent = if e.agent.is_empty() { "-" } else { &e.agent };
        assert_eq!(cols[3], agent, "{line}");
        let token = if e.token == 0 {
            "-".to_string()
        } else {
            format!("#{}", e.token)
        };
        assert_eq!(cols[4], token, "{line}");
        assert!(line.ends_with(e.detail.as_str()), "{line}");
        // Not a terminal: no colour.
        assert!(!line.contains('\x1b'), "{line:?}");
    }
    assert!(shown[1].ends_with("new → research"), "{}", shown[1]);
    assert!(
        shown[2].contains(&format!("#{}", lease.token)),
        "{}",
        shown[2]
    );
}

#[tokio::test]
async fn watch_json_filters_by_task() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.create("p").await.expect("create p");
    let watch = Watch::spawn(
        &env,
        &["--coordinator", &coord.url, "--json", "--task", "p"],
    );
    watch.warm_up(&mut api, "p/warm").await;

    api.create("q").await.expect("create q");
    api.create("p-x").await.expect("create p-x");
    api.create("p/s1").await.expect("create p/s1");
    api.transition("q", "research").await.expect("q → research");
    api.transition("p/s1", "research")
        .await
        .expect("p/s1 → research");
    api.transition("p", "research").await.expect("p → research");
    api.create("p/end").await.expect("create p/end");
    assert!(
        watch.wait_line("\"p/end\"", Duration::from_secs(5)).await,
        "{:?}",
        watch.lines()
    );

    let objects: Vec<serde_json::Value> = watch
        .lines()
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    for o in &objects {
        let mut keys: Vec<&str> = o
            .as_object()
            .expect("an object per line")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            ["agent", "at", "detail", "kind", "seq", "task", "token"],
            "{o}"
        );
        let task = o["task"].as_str().expect("task is a string");
        assert!(
            task == "p" || task.starts_with("p/"),
            "--task p shows only p and its sub-tasks: {o}"
        );
    }
    let seen: Vec<(String, String)> = objects
        .iter()
        .map(|o| {
            (
                o["kind"].as_str().unwrap_or_default().to_string(),
                o["task"].as_str().unwrap_or_default().to_string(),
            )
        })
        .filter(|(_, t)| !t.starts_with("p/warm"))
        .collect();
    let want: Vec<(String, String)> = [
        ("task_created", "p/s1"),
        ("transitioned", "p/s1"),
        ("transitioned", "p"),
        ("task_created", "p/end"),
    ]
    .iter()
    .map(|(k, t)| (k.to_string(), t.to_string()))
    .collect();
    assert_eq!(seen, want);
    let moved = objects
        .iter()
        .find(|o| o["task"] == "p" && o["kind"] == "transitioned")
        .expect("p's transition");
    assert_eq!(moved["detail"], "new → research");
    assert!(moved["seq"].as_u64().is_some_and(|s| s > 0), "{moved}");
    assert!(
        moved["at"].as_str().is_some_and(|a| a.ends_with('Z')),
        "{moved}"
    );
}

/// A local port nobody listens on.
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

#[test]
fn watch_without_a_coordinator_fails_in_one_line() {
    let env = Env::new();
    let run = |args: &[&str]| {
        let mut c = Command::new(cli_bin());
        c.arg("watch").args(args);
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        c.env("HOME", env.home.path()).current_dir(env.root());
        run_bounded(c, Duration::from_secs(30))
    };
    let root = env.root().to_string_lossy().into_owned();
    let none = run(&["--project", &root]);
    none.code(2);
    assert_eq!(none.stderr.lines().count(), 1, "{}", none.stderr);
    assert!(
        none.error_line()
            .starts_with("ERROR: automaton watch needs a running coordinator"),
        "{}",
        none.stderr
    );
    let url = format!("http://127.0.0.1:{}", closed_port());
    let down = run(&["--coordinator", &url]);
    down.code(2);
    assert_eq!(down.stderr.lines().count(), 1, "{}", down.stderr);
    assert!(
        down.error_line()
            .starts_with("ERROR: the coordinator is unavailable"),
        "{}",
        down.stderr
    );
}

#[test]
fn watch_with_a_wrong_token_fails_in_one_line() {
    let env = Env::with_config(TOKENS_TOML);
    let coord = Coord::start(&env, &[]);
    for (token, says) in [
        (None, "no bearer token"),
        (Some("not-a-token"), "unknown bearer token"),
    ] {
        let mut c = Command::new(cli_bin());
        c.args(["watch", "--coordinator", &coord.url]);
        for k in SCRUBBED_ENV {
            c.env_remove(k);
        }
        if let Some(t) = token {
            c.env("AUTOMATON_TOKEN", t);
        }
        c.env("HOME", env.home.path()).current_dir(env.root());
        let run = run_bounded(c, Duration::from_secs(30));
        run.code(1);
        assert_eq!(run.stderr.lines().count(), 1, "{}", run.stderr);
        assert!(run.error_line().contains(says), "{}", run.stderr);
    }
}

// Multi-threaded: the restart below blocks this thread while the coordinator waits for this
// test's own connection to close.
#[tokio::test(flavor = "multi_thread")]
async fn watch_reconnects_after_the_coordinator_restarts_and_says_so_once() {
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    // Found through the project's coordinator.lock, so the restarted one (a new port) is too.
    let root = env.root().to_string_lossy().into_owned();
    let watch = Watch::spawn(&env, &["--project", &root]);
    watch.warm_up(&mut api, "before").await;

    drop(api);
    coord.restart(&[]);
    let mut api = coord.api().await;
    watch.warm_up(&mut api, "after").await;
    let err = watch.stderr();
    assert_eq!(
        err.matches("lost the coordinator").count(),
        1,
        "said once:\n{err}"
    );
    assert_eq!(err.matches("; reconnecting (").count(), 1, "{err}");
    assert_eq!(err.matches(" again after ").count(), 1, "{err}");
    let back = format!("automaton watch: connected to {} again after ", coord.url);
    let line = err
        .lines()
        .find(|l| l.starts_with(&back))
        .unwrap_or_else(|| panic!("no {back:?} line:\n{err}"));
    assert!(
        line.ends_with("s; events missed while disconnected are not shown"),
        "{line}"
    );
}

#[tokio::test]
async fn watch_exits_0_on_a_closed_stdout_and_on_ctrl_c() {
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;

    // `| head -1`: head exits after one line; the next event's write finds the pipe closed.
    let mut c = Command::new("bash");
    c.arg("-c")
        .arg(r#"set -o pipefail; "$0" watch --coordinator "$1" | head -1; echo "watch exited ${PIPESTATUS[0]}""#)
        .arg(cli_bin())
        .arg(&coord.url);
    for k in SCRUBBED_ENV {
        c.env_remove(k);
    }
    c.env("HOME", env.home.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut pipeline = c.spawn().expect("spawn bash");
    let mut i = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = pipeline.try_wait().expect("try_wait") {
            break s;
        }
        assert!(Instant::now() < deadline, "watch | head -1 did not end");
        i += 1;
        api.create(&format!("pipe-{i}")).await.expect("create");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let out = pipeline.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(status.success(), "{stdout}");
    assert!(stdout.contains("watch exited 0"), "{stdout}");
    assert_eq!(stdout.lines().count(), 2, "{stdout}");
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut watch = Watch::spawn(&env, &["--coordinator", &coord.url]);
    watch.warm_up(&mut api, "sigint").await;
    signal(watch.child.id(), "-INT");
    let st = wait_bounded(&mut watch.child, Duration::from_secs(10)).expect("exit on SIGINT");
    assert_eq!(st.code(), Some(0), "stderr: {}", watch.stderr());
}

/// A tmux server of our own (its socket in a temporary folder), killed on drop.
struct Tmux {
    dir: tempfile::TempDir,
}

/// Waits for `top` (run by `tmux.session`'s script) to exit, then checks it exited 0 and gave
/// the terminal back: cooked mode with echo, the main screen, the cursor shown. The screen.
fn exited_0_with_the_terminal_restored(tmux: &Tmux) -> String {
    let after = tmux.wait_screen(&["top exited", "icanon"], Duration::from_secs(10));
    assert!(after.contains("top exited 0"), "{after}");
    let modes = after
        .lines()
        .skip_while(|l| !l.contains("top exited"))
        .nth(1)
        .unwrap_or("");
    assert_eq!(
        modes.split_whitespace().collect::<Vec<_>>(),
        ["icanon", "echo"],
        "{after}"
    );
    assert_eq!(tmux.format("#{alternate_on}"), "0", "{after}");
    assert_eq!(tmux.format("#{cursor_flag}"), "1", "{after}");
    after
}

impl Tmux {
    fn new() -> Tmux {
        let ok = Command::new("tmux")
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success());
        assert!(
            ok,
            "tmux is missing: install it (run tests/setup). This test drives `automaton top` in a real terminal."
        );
        Tmux {
            dir: tempfile::tempdir().expect("tmux dir"),
        }
    }

    fn cmd(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-S")
            .arg(self.dir.path().join("sock"))
            .args(args)
            .output()
            .expect("run tmux");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `script` (sh) in a new detached session `name` of 120×32.
    fn session(&self, name: &str, script: &str) {
        let path = self.dir.path().join(format!("{name}.sh"));
        std::fs::write(&path, script).expect("write the session's script");
        let run = format!("sh '{}'", path.to_string_lossy());
        self.cmd(&[
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            "120",
            "-y",
            "32",
            &run,
        ]);
    }

    /// What session `name` shows, `-e`: with its colours as escape sequences.
    fn screen_of(&self, name: &str, escapes: bool) -> String {
        let mut args = vec!["capture-pane", "-p", "-t", name];
        if escapes {
            args.push("-e");
        }
        self.cmd(&args)
    }

    fn format(&self, f: &str) -> String {
        self.cmd(&["display-message", "-p", "-t", "top", f])
            .trim()
            .to_string()
    }

    fn wait_screen(&self, needles: &[&str], timeout: Duration) -> String {
        self.wait_screen_of("top", needles, timeout)
    }

    /// Waits (bounded) until session `name` shows every one of `needles`.
    fn wait_screen_of(&self, name: &str, needles: &[&str], timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.screen_of(name, false);
            if needles.iter().all(|n| s.contains(n)) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "the screen never showed {needles:?}:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .arg("-S")
            .arg(self.dir.path().join("sock"))
            .arg("kill-server")
            .output();
    }
}

/// A shell script's opening: no `AUTOMATON_*` from the machine, the test's HOME, the project.
fn prelude(env: &Env) -> String {
    format!(
        "unset {}\nexport HOME={}\ncd {}\n",
        SCRUBBED_ENV.join(" "),
        quote(env.home.path()),
        quote(env.root()),
    )
}

fn quote(p: &Path) -> String {
    format!("'{}'", p.to_string_lossy().replace('\'', r"'\''"))
}

#[tokio::test]
async fn top_in_tmux_shows_the_fleet_and_quits_on_q() {
    let tmux = Tmux::new();
    let env = Env::new();
    let coord = Coord::start(&env, &FLEET);
    let _worker = Worker::start(
        &coord.url,
        &["--name", "gpu-top", "--simulate-gpu", "sim-top:48GiB"],
        &[],
    );
    let mut api = coord.api().await;
    api.create("shown-task").await.expect("create");

    // After top: its exit code, then whether the terminal is back in cooked mode with echo.
    tmux.session(
        "top",
        &format!(
            "{}{} top --project {}\necho \"top exited $?\"\nstty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' '; echo\nexec sleep 600\n",
            prelude(&env),
            quote(&cli_bin()),
            quote(env.root()),
        ),
    );
    let screen = tmux.wait_screen(
        &["gpu-top", "sim-top 48.0/48.0 GiB", "Tasks by phase (1)"],
        Duration::from_secs(30),
    );
    assert!(screen.contains("automaton top"), "{screen}");
    assert_eq!(
        tmux.format("#{alternate_on}"),
        "1",
        "top draws on the alternate screen"
    );

    // A change arrives through the event stream.
    api.transition("shown-task", "research")
        .await
        .expect("→ research");
    tmux.wait_screen(&["1  research"], Duration::from_secs(10));

    tmux.cmd(&["send-keys", "-t", "top", "q"]);
    let after = exited_0_with_the_terminal_restored(&tmux);
    assert!(
        !after.contains("gpu-top"),
        "the dashboard is gone:\n{after}"
    );
}

#[tokio::test]
async fn top_restores_the_terminal_on_sigterm() {
    let tmux = Tmux::new();
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let pid_file = tmux.dir.path().join("top.pid");
    // The inner shell becomes `automaton top` (exec), in the foreground of the terminal.
    tmux.session(
        "top",
        &format!(
            "{}sh -c 'echo $$ > \"$0\"; exec \"$1\" top --coordinator \"$2\"' {} {} {}\necho \"top exited $?\"\nstty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon -e echo -e -echo | tr '\\n' ' '; echo\nexec sleep 600\n",
            prelude(&env),
            quote(&pid_file),
            quote(&cli_bin()),
            coord.url,
        ),
    );
    tmux.wait_screen(&["automaton top", "No workers"], Duration::from_secs(30));
    assert_eq!(tmux.format("#{alternate_on}"), "1");
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .expect("top's pid")
        .trim()
        .parse()
        .expect("a pid");
    signal(pid, "-TERM");
    exited_0_with_the_terminal_restored(&tmux);
}

/// The `N` of `data Ns old` in `top`'s header (`data 1m05s old` is 65); 0 for `fresh`.
fn data_age_secs(head: &str) -> Option<u64> {
    if head.contains("  fresh  ") {
        return Some(0);
    }
    let age = head.split("  data ").nth(1)?.split(" old").next()?;
    let (m, s) = match age.split_once('m') {
        Some((m, s)) => (m.parse::<u64>().ok()?, s),
        None => (0, age),
    };
    Some(m * 60 + s.strip_suffix('s')?.parse::<u64>().ok()?)
}

/// Issue 36 (seed 003: connection and freshness are two facts): `top` running against a
/// coordinator that is `kill -9`ed says `reconnecting (why)` in its header within seconds
/// and, apart from it, how old its data is — an age that keeps growing while it is down
/// (the screen never passes for current) — and once a coordinator owns the project again (a
/// new one, another port, found through `coordinator.lock`) `connected` with `fresh` data
/// that shows what changed meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn top_says_reconnecting_and_a_growing_data_age_after_a_kill_9_and_connected_and_fresh_after_the_restart()
 {
    let tmux = Tmux::new();
    let env = Env::new();
    let mut coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    api.create("before-the-kill").await.expect("create");
    tmux.session(
        "top",
        &format!(
            "{}{} top --project {}\necho \"top exited $?\"\nexec sleep 600\n",
            prelude(&env),
            quote(&cli_bin()),
            quote(env.root()),
        ),
    );
    let head = |s: &str| s.lines().next().unwrap_or("").to_string();
    let up = tmux.wait_screen(&["  fresh  connected", "1  new"], Duration::from_secs(30));
    assert!(
        head(&up).contains("0 workers, 1 task  fresh  connected"),
        "{up}"
    );

    drop(api);
    coord.kill9();
    let killed = Instant::now();
    let down = tmux.wait_screen(&["  reconnecting ("], Duration::from_secs(10));
    eprintln!("{:?} after the kill: {}", killed.elapsed(), head(&down));
    assert!(killed.elapsed() < Duration::from_secs(5), "{down}");
    // The age, apart from the connection, grows while nothing answers.
    let aged = tmux.wait_screen(&[" old  reconnecting ("], Duration::from_secs(10));
    let first = data_age_secs(&head(&aged)).unwrap_or_else(|| panic!("an age: {aged}"));
    std::thread::sleep(Duration::from_secs(3));
    let later_screen = tmux.screen_of("top", false);
    let later =
        data_age_secs(&head(&later_screen)).unwrap_or_else(|| panic!("an age: {later_screen}"));
    assert!(
        later >= first + 2,
        "{first}s, then: {}",
        head(&later_screen)
    );
    assert!(
        head(&later_screen).contains(" old  reconnecting ("),
        "{later_screen}"
    );
    // What it showed stays on the screen, for what it is: old.
    assert!(later_screen.contains("1  new"), "{later_screen}");

    // Changed while nobody watched: the files, as the CLI writes them without a coordinator.
    env.cli(&["--create-task", "while-down"]).ok();
    coord = Coord::start(&env, &[]);
    let back = tmux.wait_screen(&["  fresh  connected", "2  new"], Duration::from_secs(30));
    assert!(head(&back).contains(&coord.url), "{back}");
    assert!(
        head(&back).contains("0 workers, 2 tasks  fresh  connected"),
        "{back}"
    );
    tmux.cmd(&["send-keys", "-t", "top", "q"]);
    tmux.wait_screen(&["top exited 0"], Duration::from_secs(10));
}

#[tokio::test]
async fn watch_colours_kinds_on_a_terminal_unless_no_color() {
    let tmux = Tmux::new();
    let env = Env::new();
    let coord = Coord::start(&env, &[]);
    let mut api = coord.api().await;
    let watch = format!(
        "{}{} watch --coordinator {}\nexec sleep 600\n",
        prelude(&env),
        quote(&cli_bin()),
        coord.url
    );
    tmux.session("col", &watch);
    tmux.session("nocol", &format!("export NO_COLOR=1\n{watch}"));
    let mut shown = false;
    for i in 1..=100 {
        api.create(&format!("tty-{i}")).await.expect("create");
        tokio::time::sleep(Duration::from_millis(100)).await;
        if ["col", "nocol"]
            .iter()
            .all(|s| tmux.screen_of(s, false).contains("task_created"))
        {
            shown = true;
            break;
        }
    }
    assert!(
        shown,
        "both watches show events:\n{}\n{}",
        tmux.screen_of("col", false),
        tmux.screen_of("nocol", false)
    );
    let coloured = tmux.screen_of("col", true);
    assert!(
        coloured.contains("\x1b[32mtask_created"),
        "task_created in green on a terminal: {coloured:?}"
    );
    let plain = tmux.screen_of("nocol", true);
    assert!(plain.contains("task_created"), "{plain:?}");
    assert!(
        !plain.contains("\x1b["),
        "NO_COLOR: no colour at all: {plain:?}"
    );
}

#[test]
fn top_without_a_terminal_says_use_watch_json() {
    let env = Env::new();
    let mut c = Command::new(cli_bin());
    c.args(["top", "--coordinator", "http://127.0.0.1:1"]);
    for k in SCRUBBED_ENV {
        c.env_remove(k);
    }
    c.env("HOME", env.home.path()).current_dir(env.root());
    let run = run_bounded(c, Duration::from_secs(30));
    run.code(2);
    assert_eq!(
        run.stderr.trim_end(),
        "ERROR: automaton top needs a terminal; use `automaton watch --json`"
    );
    assert!(run.stdout.is_empty(), "{}", run.stdout);
}
