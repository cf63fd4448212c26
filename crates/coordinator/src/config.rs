//! The coordinator's configuration: defaults < TOML file < `AUTOMATON_*` environment <
//! flags, validated once before any socket is bound.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::Error;

/// Who a bearer token speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Claim, renew, release, transition under its lease, read.
    Agent,
    /// Everything, including approve and create.
    Operator,
    /// A worker machine: holds a session (`Workers.Session`) under its name and claims only
    /// as itself, within that session; otherwise as an agent.
    Worker,
}

impl Role {
    /// Agents and workers act only as the name their token is bound to.
    pub fn is_bound(self) -> bool {
        matches!(self, Role::Agent | Role::Worker)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Token {
    /// Who this is: the default approver for an operator.
    pub name: String,
    pub role: Role,
    pub token: String,
}

/// A pool of workers that join with tokens minted from one secret
/// (`automaton_workflow::pool_token`), instead of one listed token each: a worker whose name
/// starts with `prefix` presents `pool:{name}:{mac}` and is then bound to that name exactly as
/// a listed worker token is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerPool {
    /// The names the pool admits: this prefix and at least one more character (the whole name
    /// an agent id). Not empty, and admitting no listed token's name and no other pool's: a
    /// pool member can mint a token for any name the prefix admits (`validate` refuses).
    pub prefix: String,
    /// At least 32 bytes (surrounding whitespace is not part of it); workers mint their tokens
    /// from the same secret (`automaton-worker --pool-secret-file`).
    pub secret: String,
}

impl WorkerPool {
    /// Whether `name` is one of this pool's.
    pub fn admits(&self, name: &str) -> bool {
        name.len() > self.prefix.len() && name.starts_with(&self.prefix)
    }
}

/// Where the coordinator's acknowledged state lives (`docs/backends.md`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// The project's own folder: the lease log and the task files (one coordinator).
    #[default]
    Files,
    /// An etcd cluster: any number of coordinators, one leader (`[etcd]`).
    Etcd,
}

impl std::str::FromStr for StoreKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "files" => Ok(StoreKind::Files),
            "etcd" => Ok(StoreKind::Etcd),
            other => Err(format!("store '{other}': write files or etcd")),
        }
    }
}

/// The etcd cluster a coordinator keeps its state in, and how it stands for leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Etcd {
    /// `http://host:2379` or `https://…`, one per member.
    pub endpoints: Vec<String>,
    /// The project's name in etcd (keys under `/automaton/{name}/`; one cluster holds many
    /// projects). Required with `store = etcd`: the same on every coordinator of the project
    /// (env `AUTOMATON_ETCD_NAME`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The URL clients reach this coordinator at, which followers name as the leader's.
    /// Default: `http(s)://` and the bound listen address (not allowed for 0.0.0.0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise: Option<String>,
    /// The leadership lease: a leader that cannot renew it within this long stops
    /// leading, and another takes over about this long after a leader dies. At least 2s;
    /// twice etcd's election time or more keeps leadership through an etcd leader change.
    #[serde(with = "duration")]
    pub election_ttl: Duration,
    /// One attempt of one etcd call (each call retries for about three of these).
    #[serde(with = "duration")]
    pub timeout: Duration,
    /// TLS to etcd: the CA that signed the members' certificates, and a client certificate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<PathBuf>,
    /// The git remote the coordinators share the task branches through (a bare repository:
    /// a path, `ssh://…` or `https://…`, with the machine's git credentials). Without it,
    /// code committed by one leader stays on its machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub git_remote: Option<String>,
    /// etcd authentication: the user, and a file holding its password.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
}

impl Default for Etcd {
    fn default() -> Self {
        Etcd {
            endpoints: Vec::new(),
            name: None,
            advertise: None,
            git_remote: None,
            election_ttl: Duration::from_secs(5),
            timeout: Duration::from_secs(2),
            ca: None,
            cert: None,
            key: None,
            user: None,
            password_file: None,
        }
    }
}

impl Etcd {
    /// The etcd client's configuration (the password read from its file).
    pub fn client_config(&self) -> Result<automaton_etcd::Config, Error> {
        let tls = match (&self.ca, &self.cert, &self.key) {
            (None, None, None) => None,
            (Some(ca), cert, key) => Some(automaton_etcd::TlsConfig {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => {
                return Err(Error::Config(
                    "[etcd] cert and key need ca: name the CA that signed the etcd members' certificates".into(),
                ));
            }
        };
        let user = match (&self.user, &self.password_file) {
            (None, None) => None,
            (Some(u), Some(f)) => {
                let pw = std::fs::read_to_string(f).map_err(|e| {
                    Error::Config(format!(
                        "cannot read the etcd password file {}: {e}",
                        f.display()
                    ))
                })?;
                Some((u.clone(), pw.trim_end_matches(['\r', '\n']).to_string()))
            }
            _ => {
                return Err(Error::Config(
                    "[etcd] user and password_file go together: give both or neither".into(),
                ));
            }
        };
        let cfg = automaton_etcd::Config {
            endpoints: self.endpoints.clone(),
            timeout: self.timeout,
            tls,
            user,
        };
        cfg.validate()
            .map_err(|e| Error::Config(format!("[etcd]: {e}")))?;
        Ok(cfg)
    }
}

/// Where a finished top-level task's work goes (`[delivery]`, docs/delivery.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryMode {
    /// The work stays on the task's branch (`automaton/TASK`) for a person to take.
    Branch,
    /// The task's branch lands on its base branch, exactly as reviewed.
    Merge,
    /// The task's branch is pushed and a pull request opened on the forge.
    PullRequest,
}

/// What a task whose code cannot land as reviewed does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnConflict {
    /// Back to `implement` on the new head (its reviews run again), `max_reworks` times.
    Implement,
    /// Waits for a person.
    Person,
}

/// `[delivery]`: how finished work is delivered, and how a sub-task's or a delivery's
/// conflict is handled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Delivery {
    pub mode: DeliveryMode,
    /// `merge` mode: `ff-only`, `merge` (a fast-forward when possible) or `squash`.
    pub strategy: String,
    /// The branch work lands on; default: the branch HEAD named when the task started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    /// A delivery waits for an operator (`automaton deliver TASK`).
    pub approve: bool,
    /// A conflict (a sub-task's merge into its parent's branch, or a delivery whose merge
    /// would not be the reviewed tree) sends the task back to implement, or to a person.
    pub on_conflict: OnConflict,
    /// Conflicts a task is sent back to implement for; the next one waits for a person.
    pub max_reworks: u32,
    /// The git remote the base lives on (a name or URL); pushed with a lease. Default: this
    /// repository (or, with `store = etcd`, `[etcd] git_remote`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
    /// The console's URL as people reach it (`https://automaton.example/`): a pull request
    /// links the task's page there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub console_url: Option<String>,
    /// `mode = "pull_request"`: the forge that opens it (`[delivery.forge]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forge: Option<automaton_forge::Config>,
}

impl Default for Delivery {
    fn default() -> Self {
        Delivery {
            mode: DeliveryMode::Branch,
            strategy: "merge".into(),
            base: None,
            approve: false,
            on_conflict: OnConflict::Implement,
            max_reworks: 1,
            remote: None,
            console_url: None,
            forge: None,
        }
    }
}

impl Delivery {
    /// One-line errors that say what to write.
    pub fn validate(&self) -> Result<(), String> {
        if automaton_store::Strategy::parse(&self.strategy).is_none() {
            return Err(format!(
                "[delivery] strategy '{}': write ff-only, merge or squash",
                automaton_workflow::excerpt(&self.strategy)
            ));
        }
        if let Some(b) = &self.base
            && !git_branch_name_ok(b)
        {
            return Err(format!(
                "[delivery] base '{}' is not a branch name git accepts: name a branch, e.g. main",
                automaton_workflow::excerpt(b)
            ));
        }
        if let Some(r) = &self.remote
            && (r.is_empty() || r.starts_with('-') || r.contains(['\n', '\0']))
        {
            return Err(
                "[delivery] remote must be a git remote's name or URL (not empty, not starting with '-')"
                    .into(),
            );
        }
        if self.mode == DeliveryMode::PullRequest && self.remote.is_none() {
            return Err(
                "[delivery] mode = \"pull_request\" needs remote: the git remote the forge serves (e.g. origin), where the task's branch is pushed".into(),
            );
        }
        match (&self.forge, self.mode) {
            (None, DeliveryMode::PullRequest) => {
                return Err("[delivery] mode = \"pull_request\" needs [delivery.forge]: kind (github, gitlab or gitea), api_url, repository and token_file or token_env".into());
            }
            (Some(f), _) => f.validate().map_err(|e| format!("[delivery.forge]: {e}"))?,
            (None, _) => {}
        }
        if let Some(u) = &self.console_url
            && !(u.starts_with("http://") || u.starts_with("https://"))
        {
            return Err(format!(
                "[delivery] console_url '{}' must be an http(s) URL",
                automaton_workflow::excerpt(u)
            ));
        }
        Ok(())
    }
}

/// A name `refs/heads/{name}` may carry (git's check-ref-format rules, the ones that matter).
pub fn git_branch_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 200
        && !name.starts_with(['-', '/', '.'])
        && !name.ends_with(['/', '.'])
        && !name.ends_with(".lock")
        && !name.contains("..")
        && !name.contains("//")
        && !name.contains("@{")
        && !name
            .chars()
            .any(|c| c.is_control() || c.is_whitespace() || "~^:?*[\\".contains(c))
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    pub cert: PathBuf,
    pub key: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// The project whose task store this coordinator owns.
    pub project: PathBuf,
    pub listen: SocketAddr,
    /// Where to serve Prometheus metrics (`GET /metrics`, no authentication); off when
    /// absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<SocketAddr>,
    /// Where to serve the operator's console (docs/console.md); off when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub web_listen: Option<SocketAddr>,
    /// A trace UI's URL for one trace, with `{trace_id}` in it (e.g.
    /// `http://jaeger:16686/trace/{trace_id}`): the console links trace ids there.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_url: Option<String>,
    /// Event and output streams one signed-in console session (without tokens: one client
    /// address) may hold open at once; one more is refused 429.
    pub web_max_streams: usize,
    /// A console client that reads nothing for this long while a write to it waits is
    /// disconnected (its streams end).
    #[serde(with = "duration")]
    pub web_stall_timeout: Duration,
    /// Serve a non-loopback address without any token.
    pub insecure: bool,
    /// After a restart every lease lives at least this long, so holders can reconnect.
    #[serde(with = "duration")]
    pub grace_period: Duration,
    /// Longest a unary request may take before it is answered DEADLINE_EXCEEDED.
    #[serde(with = "duration")]
    pub rpc_timeout: Duration,
    /// Requests served at once per connection; further ones wait (HTTP/2 back-pressure)
    /// until one finishes.
    pub max_in_flight: usize,
    /// Largest request message; larger ones get RESOURCE_EXHAUSTED.
    pub max_message_bytes: usize,
    /// The lease log is rewritten with only the live leases once this many bytes were
    /// appended since its last rewrite (and more than twice that rewrite's size).
    pub log_compact_bytes: u64,
    /// The shortest TTL a claim may ask for (`INVALID_ARGUMENT` below it).
    #[serde(with = "duration")]
    pub lease_ttl_min: Duration,
    /// The longest TTL a claim may ask for; the project's lock timeout is brought inside.
    #[serde(with = "duration")]
    pub lease_ttl_max: Duration,
    /// The most lease ids one KeepAlive message may name.
    pub keepalive_max_ids: usize,
    /// A worker session silent this long is dead, and every lease it holds ends.
    #[serde(with = "duration")]
    pub session_timeout: Duration,
    /// How often workers are told to heartbeat (at most a third of the session timeout).
    #[serde(with = "duration")]
    pub heartbeat_interval: Duration,
    /// How long an agent run may take before it is stopped `timed_out` (seed 002's
    /// MAX_PHASE_TIME).
    #[serde(with = "duration")]
    pub max_phase_time: Duration,
    /// Failed runs of one phase of a task before the task is held from dispatch.
    pub max_attempts: u32,
    /// Offer work to idle workers (`false`: sessions and leases only; agents and operators
    /// claim tasks themselves).
    pub dispatch: bool,
    /// The largest artifact a worker may upload.
    pub max_artifact_bytes: u64,
    /// The bytes every upload in flight together may hold in memory (artifacts and
    /// patches); an upload that would pass it is refused `RESOURCE_EXHAUSTED`.
    pub max_upload_memory_bytes: u64,
    /// Seed 002's MAX_ITERATIONS: completed runs of one task before it is held.
    pub max_iterations: u32,
    /// Seed 002's MAX_TOTAL_TIME: from a task's first run until it is held.
    #[serde(with = "duration")]
    pub max_total_time: Duration,
    pub tls: Option<Tls>,
    pub tokens: Vec<Token>,
    /// Worker pools: workers that join with tokens minted from a pool's secret.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub worker_pools: Vec<WorkerPool>,
    /// Where acknowledged state lives: `files` (default) or `etcd` (then `[etcd]`).
    pub store: StoreKind,
    pub etcd: Etcd,
    /// Receivers told when a person is needed (`[[webhooks]]`, docs/webhooks.md).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub webhooks: Vec<automaton_webhooks::Webhook>,
    /// Where finished work goes (`[delivery]`, docs/delivery.md).
    pub delivery: Delivery,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            project: PathBuf::from("."),
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            metrics_listen: None,
            web_listen: None,
            trace_url: None,
            web_max_streams: automaton_console::DEFAULT_STREAMS_PER_SESSION,
            web_stall_timeout: automaton_console::DEFAULT_STALL_TIMEOUT,
            insecure: false,
            grace_period: Duration::from_secs(30),
            rpc_timeout: Duration::from_secs(30),
            max_in_flight: 1024,
            max_message_bytes: 4 * 1024 * 1024,
            log_compact_bytes: 16 * 1024 * 1024,
            lease_ttl_min: automaton_workflow::TtlBounds::DEFAULT.min,
            lease_ttl_max: automaton_workflow::TtlBounds::DEFAULT.max,
            keepalive_max_ids: 1024,
            session_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(2),
            max_phase_time: Duration::from_secs(3600),
            max_attempts: 3,
            dispatch: true,
            max_artifact_bytes: 8 << 20,
            max_upload_memory_bytes: crate::uploads::DEFAULT_UPLOAD_MEMORY_BYTES,
            max_iterations: 10,
            max_total_time: Duration::from_secs(24 * 3600),
            tls: None,
            tokens: Vec::new(),
            worker_pools: Vec::new(),
            store: StoreKind::Files,
            etcd: Etcd::default(),
            webhooks: Vec::new(),
            delivery: Delivery::default(),
        }
    }
}

/// Flags that override the file and the environment (all optional).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    pub config_file: Option<PathBuf>,
    pub project: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub metrics_listen: Option<SocketAddr>,
    pub web_listen: Option<SocketAddr>,
    pub insecure: bool,
    pub grace_period: Option<Duration>,
    pub lease_ttl_min: Option<Duration>,
    pub lease_ttl_max: Option<Duration>,
    pub session_timeout: Option<Duration>,
    pub heartbeat_interval: Option<Duration>,
    pub max_phase_time: Option<Duration>,
    pub no_dispatch: bool,
    pub store: Option<StoreKind>,
    /// `--etcd a,b,c`: the etcd endpoints.
    pub etcd: Vec<String>,
    pub advertise: Option<String>,
}

/// The webhooks' serde form of a duration (`automaton_webhooks::duration`: written `30s` or
/// `500ms`, refused with the same line), read with this config's grammar, [`parse_duration`]:
/// it caps durations at [`automaton_workflow::MAX_DURATION`] and reads `5M` as minutes, where
/// the webhooks' humantime has no cap and reads months.
mod duration {
    pub use automaton_webhooks::duration::serialize;

    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<std::time::Duration, D::Error> {
        automaton_webhooks::duration::deserialize_with(d, super::parse_duration)
    }
}

/// `500ms`, `30s`, `5m`, `1h` (a bare number is seconds here: these are service timeouts).
/// At most [`automaton_workflow::MAX_DURATION`]: they are added to the clocks.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    if let Some(ms) = s.strip_suffix("ms") {
        return ms
            .trim()
            .parse()
            .ok()
            .map(Duration::from_millis)
            .filter(|d| *d <= automaton_workflow::MAX_DURATION);
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .ok()
            .map(Duration::from_secs)
            .filter(|d| *d <= automaton_workflow::MAX_DURATION);
    }
    automaton_workflow::parse_duration(s)
}

fn env_var(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

impl Config {
    /// Defaults, then the TOML file, then `AUTOMATON_*` variables, then flags.
    pub fn load(flags: &Overrides) -> Result<Config, Error> {
        let file = flags
            .config_file
            .clone()
            .or_else(|| env_var("AUTOMATON_CONFIG").map(PathBuf::from));
        let mut cfg = match &file {
            Some(path) => Self::from_file(path)?,
            None => Config::default(),
        };
        cfg.apply_env()?;
        if let Some(p) = &flags.project {
            cfg.project = p.clone();
        }
        if let Some(l) = flags.listen {
            cfg.listen = l;
        }
        if let Some(l) = flags.metrics_listen {
            cfg.metrics_listen = Some(l);
        }
        if let Some(l) = flags.web_listen {
            cfg.web_listen = Some(l);
        }
        if flags.insecure {
            cfg.insecure = true;
        }
        if let Some(g) = flags.grace_period {
            cfg.grace_period = g;
        }
        if let Some(t) = flags.lease_ttl_min {
            cfg.lease_ttl_min = t;
        }
        if let Some(t) = flags.lease_ttl_max {
            cfg.lease_ttl_max = t;
        }
        if let Some(t) = flags.session_timeout {
            cfg.session_timeout = t;
        }
        if let Some(t) = flags.heartbeat_interval {
            cfg.heartbeat_interval = t;
        }
        if let Some(t) = flags.max_phase_time {
            cfg.max_phase_time = t;
        }
        if flags.no_dispatch {
            cfg.dispatch = false;
        }
        if let Some(s) = flags.store {
            cfg.store = s;
        }
        if !flags.etcd.is_empty() {
            cfg.etcd.endpoints = flags.etcd.clone();
        }
        if let Some(a) = &flags.advertise {
            cfg.etcd.advertise = Some(a.clone());
        }
        Ok(cfg)
    }

    pub fn from_file(path: &Path) -> Result<Config, Error> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Config(format!("cannot read config file {}: {e}", path.display()))
        })?;
        toml::from_str(&text).map_err(|e| {
            Error::Config(format!(
                "invalid config file {}: {}",
                path.display(),
                e.message().replace('\n', " ")
            ))
        })
    }

    fn apply_env(&mut self) -> Result<(), Error> {
        let bad =
            |key: &str, v: &str, what: &str| Error::Config(format!("{key}='{v}' is not {what}"));
        if let Some(v) = env_var("AUTOMATON_PROJECT") {
            self.project = PathBuf::from(v);
        }
        if let Some(v) = env_var("AUTOMATON_LISTEN") {
            self.listen = v
                .parse()
                .map_err(|_| bad("AUTOMATON_LISTEN", &v, "an address like 127.0.0.1:7070"))?;
        }
        if let Some(v) = env_var("AUTOMATON_METRICS_LISTEN") {
            self.metrics_listen = Some(v.parse().map_err(|_| {
                bad(
                    "AUTOMATON_METRICS_LISTEN",
                    &v,
                    "an address like 127.0.0.1:9464",
                )
            })?);
        }
        if let Some(v) = env_var("AUTOMATON_WEB_LISTEN") {
            self.web_listen =
                Some(v.parse().map_err(|_| {
                    bad("AUTOMATON_WEB_LISTEN", &v, "an address like 127.0.0.1:8080")
                })?);
        }
        if let Some(v) = env_var("AUTOMATON_TRACE_URL") {
            self.trace_url = Some(v);
        }
        if let Some(v) = env_var("AUTOMATON_INSECURE") {
            self.insecure = matches!(v.as_str(), "1" | "true" | "yes");
        }
        if let Some(v) = env_var("AUTOMATON_STORE") {
            self.store = v
                .parse()
                .map_err(|e: String| Error::Config(format!("AUTOMATON_STORE: {e}")))?;
        }
        if let Some(v) = env_var("AUTOMATON_ETCD") {
            self.etcd.endpoints = automaton_client::split(&v);
        }
        if let Some(v) = env_var("AUTOMATON_ETCD_NAME") {
            self.etcd.name = Some(v);
        }
        if let Some(v) = env_var("AUTOMATON_ADVERTISE") {
            self.etcd.advertise = Some(v);
        }
        if let Some(v) = env_var("AUTOMATON_DISPATCH") {
            self.dispatch = !matches!(v.as_str(), "0" | "false" | "no" | "off");
        }
        for (key, slot) in [
            ("AUTOMATON_GRACE_PERIOD", &mut self.grace_period),
            ("AUTOMATON_RPC_TIMEOUT", &mut self.rpc_timeout),
            ("AUTOMATON_LEASE_TTL_MIN", &mut self.lease_ttl_min),
            ("AUTOMATON_LEASE_TTL_MAX", &mut self.lease_ttl_max),
            ("AUTOMATON_SESSION_TIMEOUT", &mut self.session_timeout),
            ("AUTOMATON_HEARTBEAT_INTERVAL", &mut self.heartbeat_interval),
            ("AUTOMATON_MAX_PHASE_TIME", &mut self.max_phase_time),
            ("AUTOMATON_MAX_TOTAL_TIME", &mut self.max_total_time),
            ("AUTOMATON_WEB_STALL_TIMEOUT", &mut self.web_stall_timeout),
        ] {
            if let Some(v) = env_var(key) {
                *slot = parse_duration(&v).ok_or_else(|| bad(key, &v, "a duration like 30s"))?;
            }
        }
        for (key, slot) in [
            ("AUTOMATON_MAX_IN_FLIGHT", &mut self.max_in_flight),
            ("AUTOMATON_MAX_MESSAGE_BYTES", &mut self.max_message_bytes),
            ("AUTOMATON_KEEPALIVE_MAX_IDS", &mut self.keepalive_max_ids),
            ("AUTOMATON_WEB_MAX_STREAMS", &mut self.web_max_streams),
        ] {
            if let Some(v) = env_var(key) {
                *slot = v.parse().map_err(|_| bad(key, &v, "a number"))?;
            }
        }
        if let Some(v) = env_var("AUTOMATON_MAX_ITERATIONS") {
            self.max_iterations = v
                .parse()
                .map_err(|_| bad("AUTOMATON_MAX_ITERATIONS", &v, "a number"))?;
        }
        if let Some(v) = env_var("AUTOMATON_MAX_ATTEMPTS") {
            self.max_attempts = v
                .parse()
                .map_err(|_| bad("AUTOMATON_MAX_ATTEMPTS", &v, "a number"))?;
        }
        if let Some(v) = env_var("AUTOMATON_MAX_ARTIFACT_BYTES") {
            self.max_artifact_bytes = v
                .parse()
                .map_err(|_| bad("AUTOMATON_MAX_ARTIFACT_BYTES", &v, "a number"))?;
        }
        if let Some(v) = env_var("AUTOMATON_MAX_UPLOAD_MEMORY_BYTES") {
            self.max_upload_memory_bytes = v
                .parse()
                .map_err(|_| bad("AUTOMATON_MAX_UPLOAD_MEMORY_BYTES", &v, "a number"))?;
        }
        if let Some(v) = env_var("AUTOMATON_LOG_COMPACT_BYTES") {
            self.log_compact_bytes = v
                .parse()
                .map_err(|_| bad("AUTOMATON_LOG_COMPACT_BYTES", &v, "a number"))?;
        }
        if let (Some(cert), Some(key)) =
            (env_var("AUTOMATON_TLS_CERT"), env_var("AUTOMATON_TLS_KEY"))
        {
            self.tls = Some(Tls {
                cert: cert.into(),
                key: key.into(),
            });
        }
        for (key, role) in [
            ("AUTOMATON_OPERATOR_TOKEN", Role::Operator),
            ("AUTOMATON_AGENT_TOKEN", Role::Agent),
            ("AUTOMATON_WORKER_TOKEN", Role::Worker),
        ] {
            if let Some(token) = env_var(key) {
                self.tokens.push(Token {
                    name: format!("{role:?}").to_lowercase(),
                    role,
                    token,
                });
            }
        }
        Ok(())
    }

    /// Refuses a configuration that would be unsafe or cannot work, before anything binds.
    pub fn validate(&self) -> Result<(), Error> {
        if !self.authenticates() && !self.listen.ip().is_loopback() && !self.insecure {
            return Err(Error::Config(format!(
                "refusing to listen on {} without authentication: configure [[tokens]] (or AUTOMATON_OPERATOR_TOKEN / AUTOMATON_AGENT_TOKEN), listen on 127.0.0.1, or pass --insecure",
                self.listen
            )));
        }
        if let Some(m) = self.metrics_listen
            && m.port() != 0
            && m.port() == self.listen.port()
            && (m.ip() == self.listen.ip()
                || m.ip().is_unspecified()
                || self.listen.ip().is_unspecified())
        {
            return Err(Error::Config(format!(
                "metrics_listen {m} is the gRPC listen address: give the metrics another port (e.g. 9464)"
            )));
        }
        if let Some(w) = self.web_listen {
            let clash = |other: SocketAddr| {
                w.port() != 0
                    && w.port() == other.port()
                    && (w.ip() == other.ip()
                        || w.ip().is_unspecified()
                        || other.ip().is_unspecified())
            };
            if clash(self.listen) || self.metrics_listen.is_some_and(clash) {
                return Err(Error::Config(format!(
                    "web_listen {w} is already the gRPC or metrics address: give the console another port (e.g. 8080)"
                )));
            }
            // Without tokens the console answers loopback clients only, --insecure or not.
            if !self.authenticates() && !w.ip().is_loopback() {
                return Err(Error::Config(format!(
                    "refusing to serve the console on {w} without authentication: configure [[tokens]] (or AUTOMATON_OPERATOR_TOKEN) so operators sign in, or serve it on 127.0.0.1"
                )));
            }
        }
        if self.web_max_streams == 0 {
            return Err(Error::Config(
                "web_max_streams = 0 would refuse every console page its live updates: give at least 1 (default 16)".into(),
            ));
        }
        if self.web_stall_timeout.is_zero() {
            return Err(Error::Config(
                "web_stall_timeout must be above 0 (default 10s): it is how long a console client may read nothing".into(),
            ));
        }
        if let Some(u) = &self.trace_url
            && (!(u.starts_with("http://") || u.starts_with("https://"))
                || !u.contains("{trace_id}"))
        {
            return Err(Error::Config(format!(
                "trace_url '{u}' must be an http(s) URL with {{trace_id}} in it, e.g. http://jaeger:16686/trace/{{trace_id}}"
            )));
        }
        self.delivery.validate().map_err(Error::Config)?;
        for (i, h) in self.webhooks.iter().enumerate() {
            h.validate().map_err(|e| match e {
                automaton_webhooks::Error::Config { reason, .. } => Error::Config(format!(
                    "[[webhooks]] #{} ({}): {reason}",
                    i + 1,
                    automaton_webhooks::redact(&h.url)
                )),
                other => Error::Config(format!("[[webhooks]] #{}: {other}", i + 1)),
            })?;
        }
        for t in &self.tokens {
            // An agent or worker token speaks for the agent it names: the name must be one.
            if t.role.is_bound() && t.name.parse::<automaton_workflow::AgentId>().is_err() {
                return Err(Error::Config(format!(
                    "{} token name '{}' is not an agent id: use lowercase letters, digits and dashes (it is the name this token may act as)",
                    format!("{:?}", t.role).to_lowercase(),
                    t.name
                )));
            }
            if t.token.len() < 16 {
                return Err(Error::Config(format!(
                    "token of '{}' is shorter than 16 characters: use a long random secret",
                    t.name
                )));
            }
            if t.token.starts_with(automaton_workflow::pool_token::PREFIX) {
                return Err(Error::Config(format!(
                    "token of '{}' starts with '{}', which marks pool tokens: use another secret",
                    t.name,
                    automaton_workflow::pool_token::PREFIX
                )));
            }
        }
        for (i, p) in self.worker_pools.iter().enumerate() {
            let stem_ok = !p.prefix.is_empty()
                && p.prefix.len() < 64
                && format!("{}x", p.prefix)
                    .parse::<automaton_workflow::AgentId>()
                    .is_ok();
            if !stem_ok {
                return Err(Error::Config(format!(
                    "worker pool prefix '{}' cannot begin an agent id: give a prefix such as 'gpu-pool-' (letters, digits, dashes, dots; a pool's names must stay apart from every other name)",
                    automaton_workflow::excerpt(&p.prefix)
                )));
            }
            // A pool member can mint any name its prefix admits: none may be a listed
            // token's (it would act as that agent or worker), nor another pool's.
            if let Some(t) = self.tokens.iter().find(|t| p.admits(&t.name)) {
                return Err(Error::Config(format!(
                    "worker pool prefix '{}' admits '{}', the name of a listed {} token: a pool member could act as it; choose a prefix no listed name starts with",
                    p.prefix,
                    t.name,
                    format!("{:?}", t.role).to_lowercase()
                )));
            }
            if let Some(q) = self.worker_pools[..i]
                .iter()
                .find(|q| q.prefix.starts_with(&p.prefix) || p.prefix.starts_with(&q.prefix))
            {
                return Err(Error::Config(format!(
                    "worker pool prefixes '{}' and '{}' overlap: one pool's secret would mint the other's names; make neither a prefix of the other",
                    q.prefix, p.prefix
                )));
            }
            if p.secret.trim().len() < automaton_workflow::pool_token::MIN_SECRET_BYTES {
                return Err(Error::Config(format!(
                    "worker pool '{}' has a secret shorter than {} bytes: use a long random secret (e.g. openssl rand -hex 32)",
                    p.prefix,
                    automaton_workflow::pool_token::MIN_SECRET_BYTES
                )));
            }
        }
        for (bad, what) in [
            (self.max_in_flight == 0, "max_in_flight must be at least 1"),
            (
                self.max_message_bytes < 1024,
                "max_message_bytes must be at least 1024",
            ),
            (
                self.log_compact_bytes < 4096,
                "log_compact_bytes must be at least 4096",
            ),
            (
                self.keepalive_max_ids == 0,
                "keepalive_max_ids must be at least 1",
            ),
            (
                self.lease_ttl_min.is_zero() || self.lease_ttl_min > self.lease_ttl_max,
                "lease_ttl_min must be above zero and at most lease_ttl_max",
            ),
            (
                self.lease_ttl_max > automaton_workflow::TtlBounds::CEILING,
                "lease_ttl_max must be at most 366 days",
            ),
            (
                self.session_timeout < Duration::from_millis(100),
                "session_timeout must be at least 100ms",
            ),
            (
                self.heartbeat_interval.is_zero()
                    || self.heartbeat_interval.saturating_mul(3) > self.session_timeout,
                "heartbeat_interval must be above zero and at most a third of session_timeout",
            ),
            (
                self.max_phase_time < Duration::from_millis(100),
                "max_phase_time must be at least 100ms",
            ),
            (self.max_attempts == 0, "max_attempts must be at least 1"),
            (
                self.max_iterations == 0,
                "max_iterations must be at least 1",
            ),
            (
                self.max_total_time < Duration::from_secs(1),
                "max_total_time must be at least 1s",
            ),
            (
                self.max_artifact_bytes == 0 || self.max_artifact_bytes > 1 << 30,
                "max_artifact_bytes must be between 1 and 1 GiB",
            ),
            (
                self.max_upload_memory_bytes < self.max_artifact_bytes
                    || self.max_upload_memory_bytes > 64 << 30,
                "max_upload_memory_bytes must be at least max_artifact_bytes and at most 64 GiB",
            ),
        ] {
            if bad {
                return Err(Error::Config(what.into()));
            }
        }
        if let Some(tls) = &self.tls {
            for p in [&tls.cert, &tls.key] {
                if !p.is_file() {
                    return Err(Error::Config(format!(
                        "TLS file {} does not exist",
                        p.display()
                    )));
                }
            }
        }
        if !self.project.is_dir() {
            return Err(Error::Config(format!(
                "project folder {} does not exist: pass --project DIR",
                self.project.display()
            )));
        }
        if self.store == StoreKind::Etcd {
            self.validate_etcd()?;
        }
        Ok(())
    }

    fn validate_etcd(&self) -> Result<(), Error> {
        let e = &self.etcd;
        if e.endpoints.is_empty() {
            return Err(Error::Config(
                "store = etcd needs its endpoints: pass --etcd http://a:2379,http://b:2379 or set [etcd] endpoints".into(),
            ));
        }
        e.client_config()?;
        if e.election_ttl < Duration::from_secs(2) || e.election_ttl > Duration::from_secs(600) {
            return Err(Error::Config(
                "[etcd] election_ttl must be between 2s and 10m (etcd's leases count whole seconds)".into(),
            ));
        }
        if let Some(a) = &e.advertise
            && !(a.starts_with("http://") || a.starts_with("https://"))
        {
            return Err(Error::Config(format!(
                "advertise '{}' is not a URL: write e.g. http://coordinator-0.example:7070",
                automaton_workflow::excerpt(a)
            )));
        }
        if e.advertise.is_none() && self.listen.ip().is_unspecified() {
            return Err(Error::Config(format!(
                "listening on {} with store = etcd: pass --advertise URL, the address clients reach this coordinator at (followers name it as the leader's)",
                self.listen
            )));
        }
        // Every coordinator of one project must name it alike: a default taken from each one's
        // folder made two folders named differently two projects in etcd, each with its own
        // leader granting the same tasks (issue 30, finding 5).
        let Some(name) = e.name.clone() else {
            return Err(Error::Config(
                "store = etcd needs the project's name in etcd, the same on every coordinator of the project: set [etcd] name = \"...\" (or AUTOMATON_ETCD_NAME); without it two folders named differently would lead two projects".into(),
            ));
        };
        if name.is_empty()
            || name.len() > 128
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(Error::Config(format!(
                "the project's etcd name '{}' must be 1-128 letters, digits, '-', '_' or '.': set [etcd] name",
                automaton_workflow::excerpt(&name)
            )));
        }
        Ok(())
    }

    /// The project's name in etcd: `[etcd] name` (required with `store = etcd`; checked).
    pub fn etcd_name(&self) -> String {
        self.etcd.name.clone().unwrap_or_default()
    }

    /// What the coordinator is opened with.
    pub fn options(&self, failpoints: crate::Failpoints) -> crate::Options {
        crate::Options {
            engine: automaton_engine::Options {
                grace: self.grace_period,
                log_compact_bytes: self.log_compact_bytes,
                ttl: self.ttl_bounds(),
                failpoints,
            },
            keepalive_max_ids: self.keepalive_max_ids,
            session_timeout: self.session_timeout,
            heartbeat_interval: self.heartbeat_interval,
            max_phase_time: self.max_phase_time,
            max_attempts: self.max_attempts,
            max_artifact_bytes: self.max_artifact_bytes,
            max_upload_memory_bytes: self.max_upload_memory_bytes,
            max_iterations: self.max_iterations,
            max_total_time: self.max_total_time,
            delivery: self.delivery.clone(),
            shared_remote: self.etcd.git_remote.clone(),
        }
    }

    /// The TTLs a claim may ask for.
    pub fn ttl_bounds(&self) -> automaton_workflow::TtlBounds {
        automaton_workflow::TtlBounds {
            min: self.lease_ttl_min,
            max: self.lease_ttl_max,
        }
    }

    /// Whether requests need a token: some token or worker pool is configured.
    pub fn authenticates(&self) -> bool {
        !self.tokens.is_empty() || !self.worker_pools.is_empty()
    }

    /// The effective configuration as TOML, tokens and pool secrets masked, and webhook URLs
    /// cut to what the logs show of them (a Slack webhook's path is its secret).
    pub fn to_toml(&self) -> String {
        let mut shown = self.clone();
        for t in &mut shown.tokens {
            t.token = "********".into();
        }
        for p in &mut shown.worker_pools {
            p.secret = "********".into();
        }
        for h in &mut shown.webhooks {
            h.url = automaton_webhooks::redact(&h.url);
        }
        toml::to_string(&shown).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// One line for the log: how this coordinator is protected.
    pub fn mode(&self) -> String {
        let tls = if self.tls.is_some() {
            ", TLS"
        } else {
            ", plaintext"
        };
        if !self.authenticates() {
            if self.listen.ip().is_loopback() {
                format!("loopback only, no authentication{tls}")
            } else {
                format!("INSECURE: no authentication on {}{tls}", self.listen)
            }
        } else {
            let count = |r: Role| self.tokens.iter().filter(|t| t.role == r).count();
            let pools = match self.worker_pools.len() {
                0 => String::new(),
                1 => ", 1 worker pool".to_string(),
                n => format!(", {n} worker pools"),
            };
            format!(
                "bearer tokens ({} operator, {} agent, {} worker{pools}){tls}",
                count(Role::Operator),
                count(Role::Agent),
                count(Role::Worker)
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_example_config_parses_with_every_default_key() {
        let cfg: Config = toml::from_str(include_str!("../../../deploy/coordinator.example.toml"))
            .expect("deploy/coordinator.example.toml must stay valid");
        let d = Config::default();
        assert_eq!(
            (
                cfg.rpc_timeout,
                cfg.max_in_flight,
                cfg.max_message_bytes,
                cfg.log_compact_bytes,
                cfg.lease_ttl_min,
                cfg.lease_ttl_max,
                cfg.keepalive_max_ids
            ),
            (
                d.rpc_timeout,
                d.max_in_flight,
                d.max_message_bytes,
                d.log_compact_bytes,
                d.lease_ttl_min,
                d.lease_ttl_max,
                d.keepalive_max_ids
            ),
            "the example shows the defaults"
        );
    }

    #[test]
    fn unknown_config_keys_are_an_error() {
        let e = toml::from_str::<Config>("listen = \"127.0.0.1:1\"\nlisten_port = 3\n")
            .expect_err("unknown key");
        assert!(e.to_string().contains("listen_port"), "{e}");
    }

    #[test]
    fn config_file_round_trips_through_print() {
        let cfg: Config =
            toml::from_str("grace_period = \"45s\"\nrpc_timeout = \"500ms\"\n[[tokens]]\nname = \"ops\"\nrole = \"operator\"\ntoken = \"0123456789abcdef0\"\n")
                .expect("valid");
        assert_eq!(cfg.grace_period, Duration::from_secs(45));
        assert_eq!(cfg.rpc_timeout, Duration::from_millis(500));
        let printed = cfg.to_toml();
        assert!(printed.contains("grace_period = \"45s\""), "{printed}");
        assert!(
            !printed.contains("0123456789abcdef0"),
            "tokens must be masked"
        );
    }

    /// The file's durations are written and refused as the webhooks' are, and read with
    /// `parse_duration`: `5M` is minutes, and nothing past MAX_DURATION or compound passes.
    #[test]
    fn config_durations_read_with_parse_duration() {
        let cfg: Config =
            toml::from_str("grace_period = \"5M\"\nrpc_timeout = \"1500ms\"\n").expect("valid");
        assert_eq!(cfg.grace_period, Duration::from_secs(300));
        assert_eq!(cfg.rpc_timeout, Duration::from_millis(1500));
        let printed = cfg.to_toml();
        assert!(printed.contains("grace_period = \"300s\""), "{printed}");
        assert!(printed.contains("rpc_timeout = \"1500ms\""), "{printed}");
        for bad in ["soon", "1h 30m", "36600d"] {
            let e = toml::from_str::<Config>(&format!("grace_period = \"{bad}\"\n"))
                .expect_err(bad)
                .to_string();
            assert!(
                e.contains(&format!("'{bad}' is not a duration: write e.g. '500ms'")),
                "{e}"
            );
        }
    }

    #[test]
    fn metrics_listen_is_off_by_default_and_printed_once_set() {
        let d = Config::default();
        assert_eq!(d.metrics_listen, None);
        assert!(!d.to_toml().contains("metrics_listen"));
        let cfg: Config = toml::from_str("metrics_listen = \"127.0.0.1:9464\"\n").expect("valid");
        assert_eq!(
            cfg.metrics_listen,
            Some("127.0.0.1:9464".parse().expect("addr"))
        );
        assert!(
            cfg.to_toml()
                .contains("metrics_listen = \"127.0.0.1:9464\""),
            "{}",
            cfg.to_toml()
        );
    }

    #[test]
    fn upload_memory_must_hold_the_largest_artifact() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = |memory: u64| Config {
            project: dir.path().to_path_buf(),
            max_artifact_bytes: 8 << 20,
            max_upload_memory_bytes: memory,
            ..Config::default()
        };
        assert_eq!(
            Config::default().max_upload_memory_bytes,
            512 << 20,
            "docs/coordinator.md says 512 MiB"
        );
        cfg(8 << 20).validate().expect("equal is fine");
        for bad in [0, (8 << 20) - 1, (64 << 30) + 1, u64::MAX] {
            let e = cfg(bad).validate().expect_err("refused");
            assert!(e.to_string().contains("max_upload_memory_bytes"), "{e}");
        }
    }

    #[test]
    fn metrics_listen_on_the_grpc_port_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = Config {
            project: dir.path().to_path_buf(),
            metrics_listen: Some("0.0.0.0:7070".parse().expect("addr")),
            ..Config::default()
        };
        let e = cfg.validate().expect_err("same port");
        assert!(e.to_string().contains("another port"), "{e}");
    }

    #[test]
    fn worker_pools_are_checked_masked_and_count_as_authentication() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pool = |prefix: &str, secret: &str| WorkerPool {
            prefix: prefix.into(),
            secret: secret.into(),
        };
        let long = "s".repeat(32);
        let mut cfg = Config {
            project: dir.path().to_path_buf(),
            listen: "0.0.0.0:7070".parse().expect("addr"),
            worker_pools: vec![pool("gpu-", &long)],
            ..Config::default()
        };
        // A pool alone is authentication: a public address is allowed.
        cfg.validate().expect("a pool authenticates");
        assert!(cfg.mode().contains("1 worker pool"), "{}", cfg.mode());
        let printed = cfg.to_toml();
        assert!(!printed.contains(&long), "the secret is masked: {printed}");
        cfg.tokens = vec![Token {
            name: "ops".into(),
            role: Role::Operator,
            token: "operator-secret-0123456789".into(),
        }];
        for (pools, why) in [
            (
                vec![pool("gpu-", &format!("  {}  ", "s".repeat(31)))],
                "shorter than 32",
            ),
            (vec![pool("-gpu", &long)], "cannot begin an agent id"),
            (vec![pool("GPU/", &long)], "cannot begin an agent id"),
            (vec![pool("", &long)], "cannot begin an agent id"),
            (vec![pool("op", &long)], "admits 'ops'"),
            (
                vec![pool("gpu-", &long), pool("gpu-big-", &long)],
                "overlap",
            ),
            (
                vec![pool("gpu-big-", &long), pool("gpu-", &long)],
                "overlap",
            ),
        ] {
            cfg.worker_pools = pools;
            let e = cfg.validate().expect_err(why).to_string();
            assert!(e.contains(why), "{e}");
        }
        cfg.worker_pools = vec![pool("gpu-", &long), pool("cpu-", &long)];
        cfg.validate()
            .expect("two pools apart from each other and from 'ops'");
        assert!(pool("gpu-", &long).admits("gpu-1") && !pool("gpu-", &long).admits("gpu-"));
        // A listed token may not look like a pool token.
        cfg.tokens = vec![Token {
            name: "ops".into(),
            role: Role::Operator,
            token: "pool:0123456789abcdef".into(),
        }];
        let e = cfg.validate().expect_err("pool-shaped").to_string();
        assert!(e.contains("marks pool tokens"), "{e}");
    }

    #[test]
    fn non_loopback_without_tokens_needs_insecure() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = Config {
            project: dir.path().to_path_buf(),
            listen: "0.0.0.0:7070".parse().expect("addr"),
            ..Config::default()
        };
        assert!(cfg.validate().is_err());
        cfg.insecure = true;
        assert!(cfg.validate().is_ok());
        assert!(cfg.mode().starts_with("INSECURE"));
    }
}
