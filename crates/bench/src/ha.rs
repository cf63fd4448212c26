//! What the high-availability benches share: a 3-member etcd cluster on loopback, the
//! coordinators of one project over it (`--store etcd`, each on a fixed port so a restart
//! comes back at the address its clients were given), who leads, and the leader key as etcd
//! sees it through a failover.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automaton_proto::v1 as pb;
use tonic::transport::{Channel, Endpoint};

use crate::spawn::{self, Spawned};

/// The project's name in etcd (keys under `/automaton/{ETCD_NAME}/`).
pub const ETCD_NAME: &str = "bench-ha";

/// How long a cluster or a coordinator may take to come up on a loaded 2-core machine.
const READY_WITHIN: Duration = Duration::from_secs(30);

/// A spawned etcd cluster and a control-plane client on every member.
pub struct Cluster {
    pub members: Vec<Spawned>,
    pub endpoints: Vec<String>,
    pub client: automaton_etcd::Client,
}

impl Cluster {
    /// Starts `n` members under `scratch/cluster-{try}` and waits until every member answers
    /// and one leads; a member that exits (a port taken meanwhile) means new ports, three
    /// times at most.
    pub async fn start(bin: &str, scratch: &Path, n: usize) -> Result<Cluster> {
        let mut last = String::new();
        for attempt in 0..3 {
            let dir = scratch.join(format!("cluster-{attempt}"));
            std::fs::create_dir_all(&dir)?;
            let members = spawn::etcd_cluster(bin, &dir, n)?;
            let endpoints: Vec<String> = members.iter().map(|m| m.url.clone()).collect();
            let mut cfg = automaton_etcd::Config::new(endpoints.iter().cloned());
            cfg.timeout = Duration::from_millis(500);
            let client = automaton_etcd::Client::connect(cfg)
                .map_err(|e| anyhow::anyhow!("etcd client: {e}"))?;
            let mut cluster = Cluster {
                members,
                endpoints,
                client,
            };
            match cluster.wait_ready().await {
                Ok(()) => return Ok(cluster),
                Err(e) => {
                    last = format!("{e:#}");
                    cluster.stop();
                }
            }
        }
        bail!("the etcd cluster of {n} did not start three times; last: {last}")
    }

    async fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_WITHIN;
        loop {
            for m in &mut self.members {
                if let Some(st) = spawn::has_exited(m) {
                    bail!(
                        "etcd member {} exited ({st}): {}",
                        m.url,
                        spawn::log_tail(&m.log)
                    );
                }
            }
            let all = self.client.members_status().await;
            let up = all.iter().filter(|(_, s)| s.is_ok()).count();
            if up == self.members.len()
                && all
                    .iter()
                    .any(|(_, s)| s.as_ref().is_ok_and(|s| s.is_leader()))
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the etcd cluster is not ready within {READY_WITHIN:?}: {all:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The client URL of the member that is the raft leader now.
    pub async fn raft_leader(&self) -> Result<String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.client.leader_endpoint().await {
                Ok(url) => return Ok(url),
                Err(e) if Instant::now() >= deadline => bail!("no etcd leader: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    /// The endpoints with the raft leader first (a coordinator's client starts with the
    /// first; the reference clients go to the leader too, so neither pays a forward).
    pub async fn endpoints_leader_first(&self) -> Result<Vec<String>> {
        let leader = self.raft_leader().await?;
        let mut out = vec![leader.clone()];
        out.extend(self.endpoints.iter().filter(|e| **e != leader).cloned());
        Ok(out)
    }

    /// The key the coordinators campaign on.
    pub fn leader_key() -> Vec<u8> {
        format!("/automaton/{ETCD_NAME}/leader").into_bytes()
    }

    /// Who holds the leader key now: its value (the leader's URL) and create revision.
    pub async fn leader_key_now(&self) -> Result<Option<(String, i64)>> {
        let found = automaton_etcd::leader(&self.client, &Cluster::leader_key())
            .await
            .map_err(|e| anyhow::anyhow!("read the leader key: {e}"))?;
        Ok(found.map(|(v, rev)| (String::from_utf8_lossy(&v).into_owned(), rev)))
    }

    /// Stops every member (SIGTERM); says how each ended.
    pub fn stop(&mut self) -> Vec<String> {
        self.members.iter_mut().map(Spawned::stop).collect()
    }
}

/// One coordinator of the HA group: its own project folder, config and log under `dir`, a
/// fixed address, and the process when it runs.
pub struct Node {
    pub url: String,
    listen: String,
    project: PathBuf,
    dir: PathBuf,
    args: Vec<String>,
    pub process: Option<Spawned>,
    /// A lazily connecting channel to `url` (it reconnects after a restart).
    pub channel: Channel,
}

/// The `--config` file of a coordinator with `store = etcd` over `endpoints`.
fn write_config(dir: &Path, endpoints: &[String], election_ttl: Duration) -> Result<PathBuf> {
    let list: Vec<String> = endpoints.iter().map(|e| format!("{e:?}")).collect();
    let text = format!(
        "store = \"etcd\"\n[etcd]\nendpoints = [{}]\nname = \"{ETCD_NAME}\"\nelection_ttl = \"{}ms\"\ntimeout = \"1s\"\n",
        list.join(", "),
        election_ttl.as_millis()
    );
    let path = dir.join("coordinator.toml");
    std::fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    Ok(path)
}

impl Node {
    /// A coordinator under `dir` (not started) over `endpoints`, with `extra` flags.
    pub fn new(
        dir: PathBuf,
        endpoints: &[String],
        election_ttl: Duration,
        extra: &[String],
    ) -> Result<Node> {
        let project = dir.join("project");
        std::fs::create_dir_all(&project)?;
        // Multi-agent: worker sessions may register (the workers bench).
        std::fs::write(project.join(".agent.md"), "Mode: multi-agent\n")
            .context("write the project's .agent.md")?;
        let config = write_config(&dir, endpoints, election_ttl)?;
        let listen = format!("127.0.0.1:{}", spawn::free_port()?);
        let url = format!("http://{listen}");
        let mut args = vec!["--config".to_string(), config.display().to_string()];
        args.extend(extra.iter().cloned());
        let channel = lazy_channel(&url)?;
        Ok(Node {
            url,
            listen,
            project,
            dir,
            args,
            process: None,
            channel,
        })
    }

    /// Starts (or restarts) the coordinator on its address; a port still held a moment
    /// after a kill is tried again for up to 5 s.
    pub fn start(&mut self, bin: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let started = tokio::task::block_in_place(|| {
                spawn::coordinator_at(bin, &self.project, &self.dir, &self.listen, &self.args, &[])
            });
            match started {
                Ok(s) => {
                    self.process = Some(s);
                    return Ok(());
                }
                Err(e)
                    if Instant::now() < deadline
                        && format!("{e:#}").contains("cannot listen on") =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// SIGKILL, at once.
    pub fn kill9(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill9();
        }
    }

    pub fn running(&self) -> bool {
        self.process.is_some()
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Spawned::pid)
    }

    pub fn log(&self) -> PathBuf {
        self.dir.join("coordinator.log")
    }

    /// Stops it (SIGTERM); how it ended.
    pub fn stop(&mut self) -> Option<String> {
        self.process.take().map(|mut p| p.stop())
    }
}

/// A channel that connects on first use and again after its connection broke.
pub fn lazy_channel(url: &str) -> Result<Channel> {
    Ok(Endpoint::from_shared(url.to_string())
        .with_context(|| format!("bad URL {url}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(1))
        .connect_lazy())
}

/// What a coordinator answers now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Leader,
    /// A follower, naming the leader if it knows one.
    Follower(Option<String>),
    /// Not answering (down, or between terms).
    Down(String),
}

/// One `ListTasks`, bounded by a second.
pub async fn role(channel: &Channel) -> Role {
    let mut tasks = pb::tasks_client::TasksClient::new(channel.clone());
    let asked = tokio::time::timeout(
        Duration::from_secs(1),
        tasks.list_tasks(pb::ListTasksRequest {}),
    )
    .await;
    match asked {
        Ok(Ok(_)) => Role::Leader,
        Ok(Err(s)) if s.code() == tonic::Code::Unavailable && s.message().contains("follower") => {
            Role::Follower(automaton_client::leader_named(&s))
        }
        Ok(Err(s)) => Role::Down(format!("{:?}: {}", s.code(), s.message())),
        Err(_) => Role::Down("no answer within 1 s".into()),
    }
}

/// Waits until exactly one running node leads; its index.
pub async fn leader_of(nodes: &[Node], within: Duration) -> Result<usize> {
    let deadline = Instant::now() + within;
    loop {
        let mut leading = Vec::new();
        for (i, n) in nodes.iter().enumerate() {
            if n.running() && role(&n.channel).await == Role::Leader {
                leading.push(i);
            }
        }
        match leading.as_slice() {
            [one] => return Ok(*one),
            [] => {}
            many => bail!("more than one coordinator serves as leader: {many:?}"),
        }
        if Instant::now() >= deadline {
            let logs: Vec<String> = nodes
                .iter()
                .map(|n| format!("{}:\n{}", n.url, spawn::log_tail(&n.log())))
                .collect();
            bail!("no leader within {within:?}; logs:\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until `node` is a follower naming `leader` (it rejoined and sees who leads).
pub async fn wait_follower_of(node: &Node, leader: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        let r = role(&node.channel).await;
        if r == Role::Follower(Some(leader.to_string())) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!(
                "{} did not follow {leader} within {within:?} (last: {r:?}); log:\n{}",
                node.url,
                spawn::log_tail(&node.log())
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What etcd showed of the leader key after a leader's kill: when the dead leader's key was
/// first seen gone and when a new one (another create revision) was first seen, each
/// polled every 10 ms.
#[derive(Debug, Clone, Default)]
pub struct Handover {
    pub gone: Option<Instant>,
    pub elected: Option<Instant>,
    pub new_leader: Option<String>,
}

/// Polls the leader key until a key other than `old_revision`'s appears (or `limit`).
pub fn watch_handover(
    client: automaton_etcd::Client,
    old_revision: i64,
    limit: Duration,
) -> tokio::task::JoinHandle<Handover> {
    tokio::spawn(async move {
        let key = Cluster::leader_key();
        let deadline = Instant::now() + limit;
        let mut h = Handover::default();
        while Instant::now() < deadline {
            if let Ok(found) = automaton_etcd::leader(&client, &key).await {
                let at = Instant::now();
                match found {
                    None => {
                        h.gone.get_or_insert(at);
                    }
                    Some((v, rev)) if rev != old_revision => {
                        // Gone no later than it was replaced.
                        h.gone.get_or_insert(at);
                        h.elected = Some(at);
                        h.new_leader = Some(String::from_utf8_lossy(&v).into_owned());
                        return h;
                    }
                    Some(_) => {}
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        h
    })
}

/// Seconds from `t0` to `t`, if `t` came.
pub fn secs_since(t0: Instant, t: Option<Instant>) -> Option<f64> {
    t.map(|t| t.saturating_duration_since(t0).as_secs_f64())
}

/// When a coordinator's log says it began its term after `since` (wall clock): elected,
/// its folder rebuilt from etcd, serving — each as seconds after `since`.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Term {
    pub elected_s: Option<f64>,
    pub rebuilt_s: Option<f64>,
    pub serving_s: Option<f64>,
}

/// Reads [`Term`] from the coordinator log at `log` (its text lines start with an RFC 3339
/// UTC time, e.g. `2026-12-02T04:52:52.522319Z  INFO …`).
pub fn term_after(log: &Path, since: std::time::SystemTime) -> Term {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let since = since
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let mut t = Term::default();
    for line in text.lines() {
        let Some(at) = line.split_whitespace().next().and_then(unix_seconds) else {
            continue;
        };
        if at < since {
            continue;
        }
        let rel = Some(at - since);
        if t.elected_s.is_none() && line.contains("elected leader") {
            t.elected_s = rel;
        } else if t.elected_s.is_some()
            && t.rebuilt_s.is_none()
            && (line.contains("task store rebuilt") || line.contains("etcd seeded"))
        {
            t.rebuilt_s = rel;
        } else if t.elected_s.is_some() && line.contains("leading: serving") {
            t.serving_s = rel;
            break;
        }
    }
    t
}

/// `2026-12-02T04:52:52.522319Z` → seconds since the Unix epoch.
fn unix_seconds(s: &str) -> Option<f64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>());
    let (y, m, day) = (d.next()?.ok()?, d.next()?.ok()?, d.next()?.ok()?);
    let mut t = time.split(':');
    let (hh, mm) = (
        t.next()?.parse::<i64>().ok()?,
        t.next()?.parse::<i64>().ok()?,
    );
    let ss: f64 = t.next()?.parse().ok()?;
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some((days * 86_400 + hh * 3_600 + mm * 60) as f64 + ss)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_log_times() {
        assert_eq!(unix_seconds("1970-01-01T00:00:00Z"), Some(0.0));
        assert_eq!(unix_seconds("2000-03-01T00:00:01.5Z"), Some(951_868_801.5));
        assert_eq!(unix_seconds("2026-12-02T04:52:52Z"), Some(1_796_187_172.0));
        assert_eq!(unix_seconds("INFO"), None);
    }

    #[test]
    fn finds_the_term_after_a_time() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("c.log");
        std::fs::write(
            &log,
            "2026-12-02T04:52:40.000000Z  INFO x: leading: serving leases=0\n\
             2026-12-02T04:52:51.000000Z  INFO x: elected leader: rebuilding the task store from etcd\n\
             2026-12-02T04:52:52.250000Z  INFO x: task store rebuilt from etcd written=2001\n\
             2026-12-02T04:52:52.500000Z  INFO x: leading: serving leases=1000\n",
        )
        .expect("write");
        let since = std::time::UNIX_EPOCH + Duration::from_secs(1_796_187_170);
        let t = term_after(&log, since);
        assert_eq!(t.elected_s, Some(1.0));
        assert_eq!(t.rebuilt_s, Some(2.25));
        assert_eq!(t.serving_s, Some(2.5));
    }
}
