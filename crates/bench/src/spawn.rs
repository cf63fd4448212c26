//! Starting and stopping the systems under test on loopback, in a temp folder.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};

/// A folder under the system temp dir for this run: project, data dirs and logs.
pub fn scratch_dir() -> Result<PathBuf> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("automaton-bench-{}-{nanos}", std::process::id()));
    fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

/// A child process that is stopped (SIGTERM, then SIGKILL after 10 s) when dropped.
pub struct Spawned {
    name: &'static str,
    child: Child,
    pub url: String,
    pub log: PathBuf,
    stopped: bool,
}

impl Spawned {
    /// Stops the process; says how it ended.
    pub fn stop(&mut self) -> String {
        self.stopped = true;
        if let Ok(Some(st)) = self.child.try_wait() {
            return format!("{} had already exited: {st}", self.name);
        }
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = self.child.try_wait() {
                return format!("{} stopped by SIGTERM: {st}", self.name);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let st = self.child.wait();
        format!(
            "{} did not exit within 10 s of SIGTERM; killed ({st:?})",
            self.name
        )
    }

    /// SIGKILL, at once (a crash), and reaps the process.
    pub fn kill9(&mut self) {
        self.stopped = true;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The process id (for reading its /proc figures).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(st)) => Some(st.to_string()),
            _ => None,
        }
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// Starts `automaton-coordinator --project DIR/project --listen 127.0.0.1:0` on a fresh
/// project, and waits for its `listening on ADDR` line.
pub fn coordinator(bin: &Path, scratch: &Path) -> Result<Spawned> {
    let project = scratch.join("project");
    fs::create_dir_all(&project)?;
    coordinator_on(bin, &project, scratch)
}

/// Starts `automaton-coordinator --project PROJECT --listen 127.0.0.1:0`, logging under
/// `scratch` (appending: a restart keeps the earlier lines), and waits for `listening on`.
pub fn coordinator_on(bin: &Path, project: &Path, scratch: &Path) -> Result<Spawned> {
    coordinator_with(bin, project, scratch, &[])
}

/// As `coordinator_on`, with `extra` flags after `--listen`.
pub fn coordinator_with(
    bin: &Path,
    project: &Path,
    scratch: &Path,
    extra: &[String],
) -> Result<Spawned> {
    coordinator_env(bin, project, scratch, extra, &[])
}

/// As `coordinator_with`, with `envs` set for it. The OTLP endpoint variables are never
/// inherited: a coordinator exports traces only when `envs` says where to.
pub fn coordinator_env(
    bin: &Path,
    project: &Path,
    scratch: &Path,
    extra: &[String],
    envs: &[(&str, String)],
) -> Result<Spawned> {
    coordinator_at(bin, project, scratch, "127.0.0.1:0", extra, envs)
}

/// As `coordinator_env`, listening on `listen` (a fixed port: a coordinator restarted on the
/// address its clients were given).
pub fn coordinator_at(
    bin: &Path,
    project: &Path,
    scratch: &Path,
    listen: &str,
    extra: &[String],
    envs: &[(&str, String)],
) -> Result<Spawned> {
    let log = scratch.join("coordinator.log");
    let mut cmd = Command::new(bin);
    cmd.arg("--project")
        .arg(project)
        .args(["--listen", listen])
        .args(extra)
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .envs(envs.iter().map(|(k, v)| (*k, v.as_str())));
    announced(
        "coordinator",
        cmd,
        &log,
        &scratch.join("coordinator.stdout"),
    )
    .with_context(|| format!("start {}", bin.display()))
}

/// Starts `bin echo-server --listen 127.0.0.1:0` (this benchmark's own binary; with
/// `inline`, `--inline`), logging to `scratch/echo.log`, and waits for `listening on`.
pub fn echo(bin: &Path, inline: bool, scratch: &Path) -> Result<Spawned> {
    let mut cmd = Command::new(bin);
    cmd.args(["echo-server", "--listen", "127.0.0.1:0"]);
    if inline {
        cmd.arg("--inline");
    }
    announced(
        "echo-server",
        cmd,
        &scratch.join("echo.log"),
        &scratch.join("echo.stdout"),
    )
    .with_context(|| format!("start {} echo-server", bin.display()))
}

/// Starts `cmd` (stdin closed, stderr appended to `log`, stdout copied to `out_log`) and
/// waits up to 60 s for the first `listening on ADDR` line on its stdout; the process's URL
/// is that address.
fn announced(name: &'static str, mut cmd: Command, log: &Path, out_log: &Path) -> Result<Spawned> {
    let stderr = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("open {}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()?;
    let stdout = child.stdout.take().context("no stdout pipe")?;
    let mut spawned = Spawned {
        name,
        child,
        url: String::new(),
        log: log.to_path_buf(),
        stopped: false,
    };
    // Read stdout on a thread for the whole run (so the pipe never fills), copying it to
    // the log, and hand over the first address announced.
    let (tx, rx) = mpsc::channel();
    let out_log = out_log.to_path_buf();
    std::thread::spawn(move || {
        let mut copy = File::create(out_log).ok();
        let mut tx = Some(tx);
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(f) = copy.as_mut() {
                let _ = writeln!(f, "{line}");
            }
            if let Some(addr) = listening_addr(&line)
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(addr);
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(addr) => {
                spawned.url = if addr.starts_with("http") {
                    addr
                } else {
                    format!("http://{addr}")
                };
                return Ok(spawned);
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!(
                    "the {name} closed stdout without printing `listening on`; stderr ({}):\n{}",
                    log.display(),
                    tail(log)
                );
            }
        }
        if let Some(st) = spawned.exited() {
            bail!(
                "the {name} exited ({st}) before listening; stderr ({}):\n{}",
                log.display(),
                tail(log)
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "the {name} printed no `listening on` line within 60 s; stderr ({}):\n{}",
                log.display(),
                tail(log)
            );
        }
    }
}

/// Starts `cmd` (stdin closed, stdout and stderr to `log`); stopped like the others.
pub fn process(name: &'static str, mut cmd: Command, log: PathBuf) -> Result<Spawned> {
    let out = File::create(&log).with_context(|| format!("create {}", log.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("start {name}"))?;
    Ok(Spawned {
        name,
        child,
        url: String::new(),
        log,
        stopped: false,
    })
}

/// `listening on 127.0.0.1:PORT` (also with a scheme, or trailing punctuation) → the address.
pub fn listening_addr(line: &str) -> Option<String> {
    let at = line.find("listening on ")?;
    let rest = line[at + "listening on ".len()..].trim_start();
    let token = rest.split_whitespace().next()?;
    let token = token.trim_end_matches([',', '.', ';', ')']);
    (!token.is_empty()).then(|| token.to_string())
}

pub fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("find a free port")?;
    Ok(l.local_addr()?.port())
}

/// Starts a single-member etcd on 127.0.0.1 with free ports and a data dir under `scratch`,
/// default durability (fsync of its WAL). The caller waits for it to answer.
pub fn etcd(bin: &str, scratch: &Path) -> Result<Spawned> {
    let client = free_port()?;
    let mut peer = free_port()?;
    for _ in 0..10 {
        if peer != client {
            break;
        }
        peer = free_port()?;
    }
    let data = scratch.join("etcd-data");
    let log = scratch.join("etcd.log");
    let out = File::create(&log)?;
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new(bin)
        .args(["--name", "bench"])
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("bench={peer_url}")])
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("start {bin}"))?;
    Ok(Spawned {
        name: "etcd",
        child,
        url: client_url,
        log,
        stopped: false,
    })
}

/// etcd's raft timing for the HA benches (as tests/etcd): a heartbeat every 100 ms, an
/// election after 1 s without one.
pub const RAFT_FLAGS: [&str; 4] = ["--heartbeat-interval", "100", "--election-timeout", "1000"];

/// Starts an `n`-member etcd cluster on 127.0.0.1 with free ports, data and logs under
/// `scratch/etcd-m{i}`, [`RAFT_FLAGS`], default durability. The caller waits for it to
/// serve (`ha::Cluster::start` does, and starts again on new ports if a member exits).
pub fn etcd_cluster(bin: &str, scratch: &Path, n: usize) -> Result<Vec<Spawned>> {
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < 2 * n {
        let p = free_port()?;
        if !ports.contains(&p) {
            ports.push(p);
        }
    }
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let token = format!("automaton-bench-{}-{nanos}", std::process::id());
    let peer = |i: usize| format!("http://127.0.0.1:{}", ports[2 * i + 1]);
    let initial: Vec<String> = (0..n).map(|i| format!("m{i}={}", peer(i))).collect();
    let initial = initial.join(",");
    let mut members = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("m{i}");
        let client_url = format!("http://127.0.0.1:{}", ports[2 * i]);
        let log = scratch.join(format!("etcd-{name}.log"));
        let out = File::create(&log)?;
        let child = Command::new(bin)
            .args(["--name", &name])
            .arg("--data-dir")
            .arg(scratch.join(format!("etcd-{name}")))
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer(i)])
            .args(["--initial-advertise-peer-urls", &peer(i)])
            .args(["--initial-cluster", &initial])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &token])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .args(["--log-level", "warn"])
            .args(RAFT_FLAGS)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("start {bin}"))?;
        members.push(Spawned {
            name: "etcd member",
            child,
            url: client_url,
            log,
            stopped: false,
        });
    }
    Ok(members)
}

/// Whether the process has exited (and how).
pub fn has_exited(s: &mut Spawned) -> Option<String> {
    s.exited()
}

/// The last lines of a log, for an error message.
pub fn log_tail(path: &Path) -> String {
    tail(path)
}

/// Writes `bytes` to `dir/name` the way the store does: a temp file, fsync, rename (the
/// references the benches measure the coordinator against).
pub fn durable_write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, dir.join(name))
}

/// fsyncs a folder, so the renames into it are durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::listening_addr;

    #[test]
    fn parses_the_listening_line() {
        assert_eq!(
            listening_addr("listening on 127.0.0.1:4242").as_deref(),
            Some("127.0.0.1:4242")
        );
        assert_eq!(
            listening_addr(
                "automaton-coordinator: listening on http://127.0.0.1:1 (loopback only)"
            )
            .as_deref(),
            Some("http://127.0.0.1:1")
        );
        assert_eq!(listening_addr("starting"), None);
    }
}
