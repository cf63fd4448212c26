//! The test harness: real etcd clusters (1 or 3 members) on 127.0.0.1 with free ports and
//! data in a temporary directory, and the faults the tests inject (kill -9 of a member or of
//! the raft leader, SIGSTOP/SIGCONT, a restart). It must not fake etcd: when the `etcd` binary
//! is missing the tests fail and say to run tests/setup. Every process is killed on drop.

use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use automaton_etcd::{Client, Config, TlsConfig};

/// Raft timing as the brief asks: elections settle in about a second.
const RAFT_FLAGS: [&str; 4] = ["--heartbeat-interval", "100", "--election-timeout", "1000"];

/// How long a cluster may take to serve with a leader (2 cores, several clusters at once).
const READY_WITHIN: Duration = Duration::from_secs(20);

static CLUSTERS: AtomicUsize = AtomicUsize::new(0);

pub struct Member {
    pub name: String,
    pub client_url: String,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

pub struct Cluster {
    pub members: Vec<Member>,
    /// With [`Cluster::start_tls`]: what a client needs (the CA and a client certificate).
    pub tls: Option<TlsConfig>,
    // Dropped after the members (declared later): the data outlives the processes.
    dir: tempfile::TempDir,
}

/// The etcd binary on PATH, or a failure that says how to get it.
fn etcd_binary() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("etcd is not on PATH: run tests/setup (it installs Debian's etcd-server)")
        })
}

/// A file of `tests/etcd/fixtures` (test-only TLS material).
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/etcd/fixtures")
        .join(name)
}

/// A port nothing listens on now. Another process may take it before etcd binds it; the
/// cluster start notices (etcd exits) and starts again on new ports.
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local address").port()
}

impl Cluster {
    /// A 3-member cluster.
    pub async fn three() -> Cluster {
        Cluster::start(3, &[]).await
    }

    /// A 1-member cluster.
    pub async fn one() -> Cluster {
        Cluster::start(1, &[]).await
    }

    /// `n` members, each with `extra` flags too; ready when every member answers and one leads.
    pub async fn start(n: usize, extra: &[&str]) -> Cluster {
        Cluster::start_with(n, extra, false).await
    }

    /// `n` members serving clients over TLS only (`https://`, the certificates of
    /// `tests/etcd/fixtures`), and requiring a client certificate signed by its CA.
    #[allow(dead_code)]
    pub async fn start_tls(n: usize) -> Cluster {
        Cluster::start_with(n, &[], true).await
    }

    async fn start_with(n: usize, extra: &[&str], tls: bool) -> Cluster {
        let binary = etcd_binary();
        let mut last = String::new();
        for _ in 0..3 {
            let mut cluster = Cluster::spawn(&binary, n, extra, tls);
            match cluster.wait_ready().await {
                Ok(()) => return cluster,
                // Most likely a port taken between free_port and etcd's bind: new ports.
                Err(e) => last = e,
            }
        }
        panic!("etcd cluster of {n} did not start three times; last: {last}");
    }

    fn spawn(binary: &Path, n: usize, extra: &[&str], tls: bool) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let token = format!(
            "automaton-etcd-test-{}-{}-{nanos}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );
        let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let initial = initial.join(",");
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let name = format!("m{i}");
            let scheme = if tls { "https" } else { "http" };
            let client_url = format!("{scheme}://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let mut args: Vec<String> = [
                "--name",
                &name,
                "--data-dir",
                &dir.path().join(&name).to_string_lossy(),
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &initial,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                &token,
                "--logger",
                "zap",
                "--log-outputs",
                "stderr",
                "--log-level",
                "warn",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            args.extend(RAFT_FLAGS.iter().map(|s| s.to_string()));
            args.extend(extra.iter().map(|s| s.to_string()));
            if tls {
                for (flag, file) in [
                    ("--cert-file", "member.crt"),
                    ("--key-file", "member.key"),
                    ("--trusted-ca-file", "ca.crt"),
                ] {
                    args.push(flag.into());
                    args.push(fixture(file).to_string_lossy().into_owned());
                }
                args.push("--client-cert-auth".into());
            }
            let log = dir.path().join(format!("{name}.log"));
            let mut member = Member {
                name,
                client_url,
                args,
                log,
                child: None,
            };
            member.spawn(binary);
            members.push(member);
        }
        let tls = tls.then(|| TlsConfig {
            ca: fixture("ca.crt"),
            cert: Some(fixture("client.crt")),
            key: Some(fixture("client.key")),
        });
        Cluster { members, tls, dir }
    }

    async fn wait_ready(&mut self) -> Result<(), String> {
        let client = self.client();
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            for m in &mut self.members {
                if let Some(Ok(Some(status))) = m.child.as_mut().map(Child::try_wait) {
                    return Err(format!("{} exited ({status}): {}", m.name, m.log_tail()));
                }
            }
            let all = client.members_status().await;
            let up = all.iter().filter(|(_, s)| s.is_ok()).count();
            if up == self.members.len()
                && all
                    .iter()
                    .any(|(_, s)| s.as_ref().is_ok_and(|s| s.is_leader()))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "not ready within {READY_WITHIN:?}: {all:?}; log of m0: {}",
                    self.members[0].log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// A client on every member with a short timeout (the members are local).
    pub fn client(&self) -> Client {
        self.client_on(&self.endpoints())
    }

    /// A client on these endpoints only, with a 500 ms timeout.
    pub fn client_on(&self, endpoints: &[String]) -> Client {
        let mut cfg = Config::new(endpoints.iter().cloned());
        cfg.timeout = Duration::from_millis(500);
        cfg.tls.clone_from(&self.tls);
        Client::connect(cfg).expect("client")
    }

    /// The index of the member that is the raft leader now (waits for one, up to 10 s).
    pub async fn leader(&self) -> usize {
        // Only the running members: a dead one would cost a timeout per look.
        let running: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.child.is_some())
            .map(|m| m.client_url.clone())
            .collect();
        let client = self.client_on(&running);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(url) = client.leader_endpoint().await
                && let Some(i) = self.members.iter().position(|m| m.client_url == url)
            {
                return i;
            }
            assert!(Instant::now() < deadline, "no etcd leader within 10 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills the raft leader with SIGKILL; returns its index.
    pub async fn kill_leader(&mut self) -> usize {
        let i = self.leader().await;
        self.kill(i);
        i
    }

    /// SIGKILL and reap member `i`.
    pub fn kill(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// Starts member `i` again on its data directory (it rejoins the cluster).
    pub fn restart(&mut self, i: usize) {
        let binary = etcd_binary();
        self.members[i].spawn(&binary);
    }

    /// Freezes member `i` (SIGSTOP): it keeps its sockets but answers nothing.
    pub fn pause(&self, i: usize) {
        self.members[i].signal("-STOP");
    }

    /// Thaws member `i` (SIGCONT).
    pub fn resume(&self, i: usize) {
        self.members[i].signal("-CONT");
    }

    /// The temporary directory holding data and logs.
    #[allow(dead_code)]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Member {
    fn spawn(&mut self, binary: &Path) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("etcd log file");
        let child = Command::new(binary)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.child = Some(child);
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("member is running").id();
        let ok = Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill {signal} {pid} failed");
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            m.kill();
        }
    }
}
