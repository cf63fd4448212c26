//! `automaton-worker`: `probe` reports what this machine can hold; `doctor` runs one dry
//! phase of an agent setup and says what to fix; without a subcommand the worker joins the
//! coordinator's fleet and holds its session.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

use automaton_worker::{guard, probe, scripted, session};

#[derive(Parser)]
#[command(
    name = "automaton-worker",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// The coordinator to join, e.g. http://10.0.0.5:7070 (also AUTOMATON_COORDINATOR). Give
    /// a comma-separated list for a fleet of coordinators on etcd (store = "etcd"), e.g.
    /// http://c0:7070,http://c1:7070: the worker finds the leader at every (re)connect and
    /// follows it across a failover.
    #[arg(long, value_name = "URL[,URL…]")]
    coordinator: Option<String>,
    /// This worker's name (an agent id; with a worker token, the token's name). Default: the
    /// host name, made an agent id.
    #[arg(long)]
    name: Option<String>,
    /// The worker token (also AUTOMATON_TOKEN): `role = "worker"` in the coordinator's config.
    /// Give one of --token, --token-file and --pool-secret-file.
    #[arg(long, value_name = "TOKEN")]
    token: Option<String>,
    /// Read the worker token from this file instead (also AUTOMATON_TOKEN_FILE): a regular
    /// file of at most 4096 bytes, e.g. one written by `automaton-worker mint-token`.
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Join a worker pool instead (also AUTOMATON_POOL_SECRET_FILE): the file holds the
    /// secret of one of the coordinator's `[[worker_pools]]`, and the worker mints its token
    /// for its --name (which the pool's prefix must admit).
    #[arg(long, value_name = "PATH")]
    pool_secret_file: Option<PathBuf>,
    /// How many leases this worker works on at once.
    #[arg(long, default_value_t = 1)]
    capacity: u32,
    /// End a live session under the same name instead of being refused.
    #[arg(long)]
    replace: bool,
    /// The longest wait between reconnection attempts.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    max_backoff: Duration,
    /// The agent to run for each assignment: `scripted` (the built-in deterministic agent);
    /// a preset — `aider` (needs aider-chat and git), `codex` (@openai/codex), `claude-code`
    /// (@anthropic-ai/claude-code), each with --model NAME and --model-server URL; or a
    /// command template run with `sh -c` in the workspace (placeholders: {workspace},
    /// {prompt_file}, {task}, {phase}, {artifact}, {model_url}; see docs/worker.md). Without
    /// it the worker holds its session but takes no work.
    #[arg(long, value_name = "AGENT")]
    agent: Option<String>,
    /// A path that is the agent's tool state, never part of a patch, besides the defaults
    /// (`.aider*`, `.claude/`, `.codex/`, …): `name/` a top-level folder, `prefix*` a
    /// top-level name so starting, else that name. Repeat for more.
    #[arg(long, value_name = "PATTERN", value_parser = parse_exclude)]
    patch_exclude: Vec<String>,
    /// Where fresh workspaces are made (default: a folder under the system's temp dir).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<std::path::PathBuf>,
    /// Where code trees are cached by commit (default: ~/.cache/automaton-worker). Workers
    /// on one machine may share it: a tree in use is never evicted.
    #[arg(long, value_name = "DIR")]
    cache_dir: Option<std::path::PathBuf>,
    /// How many code trees the cache keeps (trees in use are kept beyond it).
    #[arg(long, value_name = "N", default_value_t = automaton_worker::workspace::DEFAULT_KEEP, value_parser = parse_keep)]
    cache_keep: usize,
    /// How long a call to the coordinator under a run (fetch, upload, complete) is retried
    /// while the coordinator is unreachable; keep it well above the coordinator's session
    /// timeout (default 10 s), within which a restarted coordinator keeps the run's lease.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    work_retry: Duration,
    /// Between SIGTERM and SIGKILL of a stopped agent's process group.
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
    kill_grace: Duration,
    /// Read each run's peak context from the model server's answers: agents are pointed at a
    /// proxy in front of `--model-server` ($AUTOMATON_MODEL_URL, $OPENAI_BASE_URL). Default:
    /// on whenever an agent runs and `--model-server` is a plain http:// URL.
    #[arg(long, value_name = "on|off", value_parser = ["on", "off"])]
    meter_usage: Option<String>,
    /// Log format on stderr: text (default) or json.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    log_format: String,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0 picks a free one; the chosen
    /// address is logged). Off by default.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    detect: probe::DetectArgs,
}

// Parsed once at start: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Report what this machine can hold: GPUs, RAM, CPUs, the model's context window and
    /// the token budget, with where each value came from. Always exits 0 when it can print.
    Probe {
        #[command(flatten)]
        detect: probe::DetectArgs,
        /// Print seed 002's JSON fields (plus per-GPU detail and sources).
        #[arg(long)]
        json: bool,
    },
    /// Print the token a worker named NAME mints from a pool's secret (one line), e.g. into
    /// a file for `--token-file`, so that the worker (and its agents) never hold the secret.
    MintToken {
        /// The file that holds the secret of one of the coordinator's `[[worker_pools]]`.
        #[arg(long, value_name = "PATH")]
        pool_secret_file: PathBuf,
        /// The worker's name (an agent id the pool's prefix admits).
        #[arg(long, value_name = "NAME")]
        name: String,
    },
    /// One dry implement phase in a scratch workspace, run as the worker runs an assignment
    /// (metering proxy, guard, built-in prompt), then one line per check, PASS or FAIL with
    /// the fix: the program is on PATH, the model server answers and its window is read,
    /// requests pass through the metering proxy with usage, the artifact is written where it
    /// belongs, code lands in the workspace root. Exits 0 when all pass, 1 when any fails.
    Doctor {
        /// The agent, as the worker takes it: a preset (aider, codex, claude-code),
        /// `scripted`, or a command template.
        #[arg(long, value_name = "AGENT")]
        agent: String,
        /// How long the agent may run.
        #[arg(long, value_name = "DURATION", default_value = "120s", value_parser = parse_duration)]
        timeout: Duration,
        /// Keep the scratch workspace (its path is printed on stderr).
        #[arg(long)]
        keep: bool,
        /// Where the scratch workspace is made (default: the system's temp dir).
        #[arg(long, value_name = "DIR")]
        work_dir: Option<PathBuf>,
        /// Between SIGTERM and SIGKILL of the agent's process group.
        #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = parse_duration)]
        kill_grace: Duration,
        #[command(flatten)]
        detect: probe::DetectArgs,
    },
    /// The built-in deterministic agent, run by the worker itself for `--agent scripted`.
    #[command(hide = true)]
    ScriptedAgent,
    /// Runs an agent command and ends its process group when the worker dies (stdin, a pipe
    /// from the worker, reads EOF); otherwise exits as the agent did. Run by the worker itself.
    #[command(hide = true)]
    AgentGuard {
        /// Between SIGTERM and SIGKILL of the group once the worker is gone.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
        grace: Duration,
        /// The agent: a program and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
}

fn parse_keep(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(format!("'{s}': give how many trees to keep, at least 1")),
    }
}

fn parse_exclude(s: &str) -> Result<String, String> {
    let bare = s.trim_end_matches(['/', '*']);
    if bare.is_empty() || bare.contains('/') || bare == "." || bare == ".." || s.len() > 255 {
        return Err(format!(
            "{s:?}: give a top-level name, e.g. .aider* (a prefix), .claude/ (a folder) or notes.tmp"
        ));
    }
    Ok(s.to_string())
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|_| format!("'{s}': write e.g. 5s or 500ms"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let out = match cli.cmd {
        Some(Cmd::Probe { ref detect, json }) => probe::run(detect, json),
        Some(Cmd::MintToken {
            ref pool_secret_file,
            ref name,
        }) => mint_token(pool_secret_file, name),
        Some(Cmd::AgentGuard { grace, ref command }) => {
            return ExitCode::from(guard::run(grace, command));
        }
        Some(Cmd::Doctor {
            ref agent,
            timeout,
            keep,
            ref work_dir,
            kill_grace,
            ref detect,
        }) => {
            return doctor(automaton_worker::doctor::Options {
                agent: agent.clone(),
                model: detect.model.clone(),
                model_server: detect.model_server.clone(),
                timeout,
                keep,
                work_dir: work_dir.clone(),
                grace: kill_grace,
            });
        }
        Some(Cmd::ScriptedAgent) => {
            return match scripted::run_from_env() {
                Ok(code) => ExitCode::from(code),
                Err(e) => {
                    eprintln!("automaton-worker scripted-agent: {e}");
                    ExitCode::from(2)
                }
            };
        }
        None => join(cli),
    };
    match out {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("automaton-worker: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// `doctor`: the checks on stdout, one line each; when one failed, how the agent's run ended
/// and the last of its output on stderr. 0 when all pass, 1 when any fails, 2 when it could
/// not run.
fn doctor(o: automaton_worker::doctor::Options) -> ExitCode {
    use std::io::Write;
    let report = match automaton_worker::doctor::run(&o) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("automaton-worker doctor: {e}");
            return ExitCode::from(2);
        }
    };
    let mut out = std::io::stdout().lock();
    for c in &report.checks {
        let _ = writeln!(out, "{}", c.line());
    }
    let _ = out.flush();
    if !report.passed() {
        eprintln!(
            "automaton-worker doctor: the agent's run: {}",
            report.outcome
        );
        if !report.tail.is_empty() {
            eprintln!(
                "automaton-worker doctor: the last of its output:\n{}",
                report.tail
            );
        }
    }
    if let Some(dir) = &report.kept {
        eprintln!(
            "automaton-worker doctor: the scratch workspace is kept at {}",
            dir.display()
        );
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// A name for this worker from the host name: lowercase, other characters made `-`.
fn default_name(host: &str) -> String {
    let n: String = host
        .to_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let n = n.trim_matches('-').to_string();
    if n.is_empty() { "worker".into() } else { n }
}

fn join(cli: Cli) -> anyhow::Result<()> {
    let format: automaton_telemetry::trace::LogFormat = cli.log_format.parse()?;
    // Before anything logs; export over OTLP only when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    let telemetry = automaton_telemetry::trace::init("automaton-worker", format)?;
    let result = serve(cli);
    // The runtime has stopped (every run's span closed): send the last spans.
    telemetry.shutdown();
    result
}

/// The most a token or pool secret file may hold.
const CREDENTIAL_FILE_MAX: u64 = 4096;

/// The text of a small credential file (`what` and `flag` name it in errors), without
/// surrounding whitespace. Opened once, without blocking (a FIFO in its place must not stall
/// the start), and judged by the opened handle: only a regular file of at most 4096 bytes is
/// read.
fn read_credential_file(path: &Path, what: &str, flag: &str) -> anyhow::Result<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .with_context(|| format!("cannot read the {what} {}", path.display()))?;
    let meta = file
        .metadata()
        .with_context(|| format!("cannot read the {what} {}", path.display()))?;
    if !meta.is_file() {
        anyhow::bail!(
            "{} is not a file: {flag} names a regular file that holds the {what}",
            path.display()
        );
    }
    let mut bytes = Vec::new();
    file.take(CREDENTIAL_FILE_MAX + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read the {what} {}", path.display()))?;
    if bytes.len() as u64 > CREDENTIAL_FILE_MAX {
        anyhow::bail!(
            "{} holds more than {CREDENTIAL_FILE_MAX} bytes: {flag} names a file that holds one {what}",
            path.display()
        );
    }
    let text = String::from_utf8(bytes).map_err(|_| {
        anyhow::anyhow!(
            "{} is not UTF-8 text: {flag} names a file that holds one {what}",
            path.display()
        )
    })?;
    Ok(text.trim().to_string())
}

/// A worker pool's secret from `path`, without surrounding whitespace (as the coordinator
/// reads its copy).
fn read_pool_secret(path: &Path) -> anyhow::Result<String> {
    let secret = read_credential_file(path, "pool secret", "--pool-secret-file")?;
    if secret.len() < automaton_workflow::pool_token::MIN_SECRET_BYTES {
        anyhow::bail!(
            "the pool secret in {} is shorter than {} bytes: use the secret of the coordinator's [[worker_pools]] entry",
            path.display(),
            automaton_workflow::pool_token::MIN_SECRET_BYTES
        );
    }
    Ok(secret)
}

/// A worker token from `path` (`--token-file`), without surrounding whitespace.
fn read_token_file(path: &Path) -> anyhow::Result<String> {
    let token = read_credential_file(path, "worker token", "--token-file")?;
    if token.is_empty() {
        anyhow::bail!(
            "{} is empty: --token-file names the file that holds this worker's token",
            path.display()
        );
    }
    Ok(token)
}

/// `--coordinator a,b,c` (or the variable, named by `from`) as the coordinators to join:
/// each URL checked, one line saying which is wrong and how to write it.
fn coordinators(from: &str, list: &str) -> anyhow::Result<Vec<String>> {
    let urls = automaton_client::split(list);
    if urls.is_empty() {
        anyhow::bail!(
            "{from} is empty: give a URL such as http://127.0.0.1:7070 (several: a comma-separated list)"
        );
    }
    for url in &urls {
        automaton_worker::leader::check_url(url).map_err(|e| anyhow::anyhow!("{from}: {e}"))?;
    }
    Ok(urls)
}

fn check_name(name: &str) -> anyhow::Result<()> {
    if name.parse::<automaton_workflow::AgentId>().is_err() {
        anyhow::bail!(
            "--name '{name}' is not a worker name: use 1 to 64 letters, digits, '.', '_', '@' or '-', starting with a letter or digit"
        );
    }
    Ok(())
}

/// `mint-token`: the token alone on stdout, one line.
fn mint_token(pool_secret_file: &Path, name: &str) -> anyhow::Result<()> {
    use std::io::Write;
    check_name(name)?;
    let secret = read_pool_secret(pool_secret_file)?;
    let token = automaton_workflow::pool_token::mint(secret.as_bytes(), name);
    let mut out = std::io::stdout().lock();
    writeln!(out, "{token}")
        .and_then(|()| out.flush())
        .context("cannot write the token to stdout")
}

/// Where the worker's credential comes from: at most one of them.
enum Credential {
    None,
    Token(String),
    TokenFile(PathBuf),
    PoolSecretFile(PathBuf),
}

/// The one credential given by a flag or its variable (a flag wins over its own variable);
/// two kinds at once is an error naming both.
fn credential(
    token: Option<String>,
    token_file: Option<PathBuf>,
    pool_secret_file: Option<PathBuf>,
    env: impl Fn(&str) -> Option<String>,
) -> anyhow::Result<Credential> {
    let pick = |flag: Option<String>, flag_name: &'static str, var: &'static str| match flag {
        Some(v) => Some((flag_name, v)),
        None => env(var).map(|v| (var, v)),
    };
    let given = [
        pick(token, "--token", "AUTOMATON_TOKEN"),
        pick(
            token_file.map(|p| p.to_string_lossy().into_owned()),
            "--token-file",
            "AUTOMATON_TOKEN_FILE",
        ),
        pick(
            pool_secret_file.map(|p| p.to_string_lossy().into_owned()),
            "--pool-secret-file",
            "AUTOMATON_POOL_SECRET_FILE",
        ),
    ];
    let named: Vec<&'static str> = given.iter().flatten().map(|(n, _)| *n).collect();
    if let [a, b, ..] = named[..] {
        anyhow::bail!(
            "both {a} and {b} are given: give the worker one credential (a token, a token file or a pool secret file) and drop the other"
        );
    }
    let [token, token_file, pool] = given;
    Ok(match (token, token_file, pool) {
        (Some((_, t)), _, _) => Credential::Token(t),
        (_, Some((_, p)), _) => Credential::TokenFile(PathBuf::from(p)),
        (_, _, Some((_, p))) => Credential::PoolSecretFile(PathBuf::from(p)),
        (None, None, None) => Credential::None,
    })
}

fn serve(cli: Cli) -> anyhow::Result<()> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let given = match cli.coordinator {
        Some(list) => Some(("--coordinator", list)),
        None => env("AUTOMATON_COORDINATOR").map(|list| ("AUTOMATON_COORDINATOR", list)),
    };
    let coordinators = match given {
        Some((from, list)) => coordinators(from, &list)?,
        None => anyhow::bail!(
            "no coordinator given: join with --coordinator URL[,URL…] (or AUTOMATON_COORDINATOR), or run `automaton-worker probe`"
        ),
    };
    if cli.capacity == 0 {
        anyhow::bail!("--capacity must be at least 1");
    }
    // Before the probe: a refused credential fails the start at once.
    let (mut token, pool_secret) =
        match credential(cli.token, cli.token_file, cli.pool_secret_file, env)? {
            Credential::None => (None, None),
            Credential::Token(t) => (Some(t), None),
            Credential::TokenFile(path) => (Some(read_token_file(&path)?), None),
            Credential::PoolSecretFile(path) => (None, Some(read_pool_secret(&path)?)),
        };
    let probe = probe::detect(&cli.detect);
    automaton_worker::metrics::METRICS.detected(
        probe
            .gpus
            .iter()
            .map(|g| automaton_worker::metrics::GpuMemory {
                index: g.index,
                total: g.total_bytes,
                free: g.free_bytes,
            })
            .collect(),
        probe.budget.max_peak_context_kb,
    );
    // With a token the coordinator knows the name (the token's); without, the host's.
    let name = match (cli.name, &token) {
        (Some(n), _) => n,
        (None, Some(_)) => String::new(),
        (None, None) => default_name(&probe.host),
    };
    if !name.is_empty() {
        check_name(&name)?;
    }
    // Kept out of every output tail the worker reports.
    let mut secrets: Vec<String> = pool_secret.iter().cloned().collect();
    if let Some(secret) = pool_secret {
        token = Some(automaton_workflow::pool_token::mint(
            secret.as_bytes(),
            &name,
        ));
    }
    secrets.extend(token.iter().cloned());
    let opts = session::Options {
        coordinators,
        name,
        token: token.clone(),
        capacity: cli.capacity,
        replace: cli.replace,
        max_backoff: cli.max_backoff.max(Duration::from_millis(100)),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let meter = match (
        cli.meter_usage.as_deref(),
        cli.detect.model_server.as_deref(),
    ) {
        (Some("off"), _) | (None, None) => None,
        _ if cli.agent.is_none() => None,
        (Some(_), None) => {
            anyhow::bail!("--meter-usage on needs --model-server URL: the model server to meter")
        }
        (None, Some(url)) if !url.starts_with("http://") => {
            tracing::info!(server = %url, "usage not metered: the metering proxy forwards plain http:// only");
            None
        }
        (_, Some(url)) => {
            let m = runtime
                .block_on(automaton_worker::meter::Meter::start(url))
                .context("give --model-server as http://HOST:PORT, or --meter-usage off")?;
            tracing::info!(server = %url, proxy = %m.addr(), "metering model server usage");
            Some(std::sync::Arc::new(m))
        }
    };
    let runner = match cli.agent.as_deref() {
        None => {
            tracing::info!("no --agent: this worker holds its session and takes no work");
            None
        }
        Some(a) if a.trim().is_empty() => {
            anyhow::bail!("--agent is empty: give `scripted` or a command template")
        }
        Some(a) => {
            let agent = if a == "scripted" {
                automaton_worker::agent::AgentSpec::Scripted
            } else if let Some(p) = automaton_worker::presets::find(a) {
                let t = p.template(probe.model.as_deref(), cli.detect.model_server.is_some())?;
                tracing::info!(preset = p.name, template = %t, "agent preset");
                automaton_worker::agent::AgentSpec::Command(t)
            } else {
                automaton_worker::agent::AgentSpec::Command(a.to_string())
            };
            let home = std::env::var_os("HOME").map(std::path::PathBuf::from);
            let cache_dir = cli
                .cache_dir
                .or_else(|| home.map(|h| h.join(".cache/automaton-worker")))
                .unwrap_or_else(|| std::env::temp_dir().join("automaton-worker-cache"));
            let work_dir = cli.work_dir.unwrap_or_else(|| {
                std::env::temp_dir().join(format!("automaton-worker-{}", std::process::id()))
            });
            std::fs::create_dir_all(&work_dir)
                .with_context(|| format!("cannot create the work dir {}", work_dir.display()))?;
            let cache = automaton_worker::workspace::Cache::open(&cache_dir)
                .with_context(|| format!("cannot open the cache {}", cache_dir.display()))?
                .with_keep(cli.cache_keep);
            let bearer = match &token {
                Some(t) => Some(format!("Bearer {t}").parse().map_err(|_| {
                    anyhow::anyhow!("the worker token holds characters a header cannot carry: check --token or --token-file")
                })?),
                None => None,
            };
            Some(std::sync::Arc::new(automaton_worker::work::Runner {
                agent,
                work_dir,
                cache,
                budget_tokens: probe.budget.max_peak_context_kb,
                model_server: cli.detect.model_server.clone(),
                meter,
                num_ctx: probe.budget.num_ctx,
                grace: cli.kill_grace,
                bearer,
                gpu: gpu_label(&probe.gpus),
                retry_for: cli.work_retry,
                secrets,
                patch_exclude: automaton_worker::presets::DEFAULT_PATCH_EXCLUDES
                    .iter()
                    .map(|p| p.to_string())
                    .chain(cli.patch_exclude.iter().cloned())
                    .collect(),
            }))
        }
    };
    runtime.block_on(async move {
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        install_signals(stop_tx)?;
        if let Some(addr) = cli.metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("cannot listen for metrics on {addr}"))?;
            automaton_telemetry::metrics::spawn(listener, automaton_worker::metrics::render())
                .context("cannot read the metrics address")?;
        }
        session::run(probe, opts, session::Work::new(runner), stop).await?;
        Ok(())
    })
}

/// The GPUs for people: `NVIDIA A100 80 GiB`, `2 × RTX 4090 48 GiB`, `no GPU`.
fn gpu_label(gpus: &[probe::Gpu]) -> String {
    let total: u64 = gpus.iter().map(|g| g.total_bytes).sum();
    let gib = total as f64 / (1u64 << 30) as f64;
    match gpus {
        [] => "no GPU".into(),
        [g] => format!("{} {gib:.0} GiB", g.name),
        [g, ..] => format!("{} × {} {gib:.0} GiB", gpus.len(), g.name),
    }
}

/// SIGTERM and SIGINT stop the worker: it deregisters (its leases released at once) and
/// exits 0. Installed before the worker connects, so no early signal kills it uncleanly.
fn install_signals(stop: tokio::sync::watch::Sender<bool>) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut int = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        let _ = stop.send(true);
    });
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn given(
        token: Option<&str>,
        token_file: Option<&str>,
        pool: Option<&str>,
        vars: &[(&str, &str)],
    ) -> anyhow::Result<Credential> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        credential(
            token.map(String::from),
            token_file.map(PathBuf::from),
            pool.map(PathBuf::from),
            |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()),
        )
    }

    #[test]
    fn any_two_credentials_at_once_are_refused_naming_both() {
        for (flags, vars, a, b) in [
            (
                (Some("t"), None, None),
                &[("AUTOMATON_POOL_SECRET_FILE", "/s")][..],
                "--token",
                "AUTOMATON_POOL_SECRET_FILE",
            ),
            (
                (None, None, None),
                &[
                    ("AUTOMATON_TOKEN", "t"),
                    ("AUTOMATON_POOL_SECRET_FILE", "/s"),
                ][..],
                "AUTOMATON_TOKEN",
                "AUTOMATON_POOL_SECRET_FILE",
            ),
            (
                (None, Some("/t"), None),
                &[("AUTOMATON_TOKEN", "t")][..],
                "AUTOMATON_TOKEN",
                "--token-file",
            ),
            (
                (None, Some("/t"), Some("/s")),
                &[][..],
                "--token-file",
                "--pool-secret-file",
            ),
            (
                (None, None, Some("/s")),
                &[("AUTOMATON_TOKEN_FILE", "/t")][..],
                "AUTOMATON_TOKEN_FILE",
                "--pool-secret-file",
            ),
        ] {
            let (t, f, p) = flags;
            let Err(e) = given(t, f, p, vars) else {
                panic!("{a} with {b} accepted");
            };
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("both {a} and {b} are given")) && !msg.contains('\n'),
                "{msg}"
            );
        }
    }

    #[test]
    fn a_coordinator_list_is_split_and_each_url_checked_with_a_one_line_error() {
        assert_eq!(
            coordinators("--coordinator", "http://a:1").unwrap(),
            ["http://a:1"],
            "one URL is taken as it is"
        );
        assert_eq!(
            coordinators("--coordinator", " http://a:1, https://b:2 ,,").unwrap(),
            ["http://a:1", "https://b:2"]
        );
        for (list, says) in [
            ("", "--coordinator is empty"),
            (" , ", "--coordinator is empty"),
            ("http://a:1,b:2", "'b:2'"),
            ("http://a:1,http://", "'http://'"),
        ] {
            let e = coordinators("--coordinator", list)
                .expect_err(list)
                .to_string();
            assert!(e.contains(says) && !e.contains('\n'), "{list}: {e}");
        }
        let e = coordinators("AUTOMATON_COORDINATOR", "http://a:1,ftp://b")
            .expect_err("ftp")
            .to_string();
        assert!(
            e.starts_with("AUTOMATON_COORDINATOR: invalid coordinator address 'ftp://b'"),
            "{e}"
        );
    }

    #[test]
    fn one_credential_is_taken_and_a_flag_wins_over_its_own_variable() {
        assert!(matches!(
            given(Some("flag"), None, None, &[("AUTOMATON_TOKEN", "var")]),
            Ok(Credential::Token(t)) if t == "flag"
        ));
        assert!(matches!(
            given(None, None, None, &[("AUTOMATON_TOKEN_FILE", "/t")]),
            Ok(Credential::TokenFile(p)) if p == Path::new("/t")
        ));
        assert!(matches!(
            given(None, None, Some("/s"), &[("AUTOMATON_POOL_SECRET_FILE", "/v")]),
            Ok(Credential::PoolSecretFile(p)) if p == Path::new("/s")
        ));
        assert!(matches!(given(None, None, None, &[]), Ok(Credential::None)));
    }

    #[test]
    fn a_credential_file_is_read_only_when_it_is_a_regular_file_of_at_most_4096_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("token");
        std::fs::write(&ok, format!("  {}\n", "t".repeat(4000))).unwrap();
        assert_eq!(read_token_file(&ok).unwrap(), "t".repeat(4000));
        let full = dir.path().join("full");
        std::fs::write(&full, "t".repeat(4096)).unwrap();
        assert_eq!(read_token_file(&full).unwrap().len(), 4096);
        let big = dir.path().join("big");
        std::fs::write(&big, "t".repeat(4097)).unwrap();
        let fifo = dir.path().join("fifo");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let empty = dir.path().join("empty");
        std::fs::write(&empty, " \n").unwrap();
        for (path, why) in [
            (big.as_path(), "holds more than 4096 bytes"),
            (fifo.as_path(), "is not a file"),
            (dir.path(), "is not a file"),
            (empty.as_path(), "is empty"),
            (&dir.path().join("missing"), "cannot read the worker token"),
        ] {
            let e = read_token_file(path).expect_err(why).to_string();
            assert!(e.contains(why) && !e.contains('\n'), "{why}: {e}");
        }
    }
}
