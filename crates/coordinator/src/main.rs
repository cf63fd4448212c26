//! `automaton-coordinator --project DIR --listen 127.0.0.1:7070`: owns one project's task
//! store and serves it over gRPC until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use automaton_coordinator::{
    Config, Coordinator, Failpoints, Overrides, Ownership, StoreKind, config::parse_duration, serve,
};
use automaton_store::Project;
use automaton_telemetry::trace::LogFormat;
use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "automaton-coordinator",
    version,
    about = "Owns one project's task leases and serves them over gRPC"
)]
struct Flags {
    /// The project whose task store this coordinator owns.
    #[arg(long, value_name = "DIR")]
    project: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free one; the chosen address is printed).
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// Serve Prometheus metrics at http://ADDR/metrics (port 0 picks a free one; the
    /// chosen address is logged). Off by default.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Serve the operator's console at http://ADDR/ (port 0 picks a free one; the URL is
    /// printed: `console on URL`). Off by default.
    #[arg(long, value_name = "ADDR")]
    web_listen: Option<SocketAddr>,
    /// TOML configuration file (also AUTOMATON_CONFIG).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Serve a non-loopback address without any token.
    #[arg(long)]
    insecure: bool,
    /// Minimum life of every lease after a restart (e.g. 30s).
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| parse_duration(s).ok_or("write e.g. 30s or 2m"))]
    grace_period: Option<std::time::Duration>,
    /// Shortest TTL a claim may ask for (default 1s; shorter ones get INVALID_ARGUMENT).
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| parse_duration(s).ok_or("write e.g. 1s or 500ms"))]
    lease_ttl_min: Option<std::time::Duration>,
    /// Longest TTL a claim may ask for (default 7d).
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| parse_duration(s).ok_or("write e.g. 7d or 12h"))]
    lease_ttl_max: Option<std::time::Duration>,
    /// A worker session silent this long is dead and its leases end (default 10s).
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| parse_duration(s).ok_or("write e.g. 10s or 500ms"))]
    session_timeout: Option<std::time::Duration>,
    /// How often workers heartbeat (default 2s; at most a third of the session timeout).
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| parse_duration(s).ok_or("write e.g. 2s or 200ms"))]
    heartbeat_interval: Option<std::time::Duration>,
    /// How long an agent run may take before it is stopped `timed_out` (default 1h).
    #[arg(long, value_name = "DURATION", value_parser = |s: &str| parse_duration(s).ok_or("write e.g. 1h or 90s"))]
    max_phase_time: Option<std::time::Duration>,
    /// Offer no work to workers: sessions and leases only (agents claim tasks themselves).
    #[arg(long)]
    no_dispatch: bool,
    /// Where acknowledged state lives: files (default: this project's folder, one
    /// coordinator) or etcd (several coordinators, one leader; needs --etcd).
    #[arg(long, value_name = "STORE", value_parser = |s: &str| s.parse::<automaton_coordinator::StoreKind>())]
    store: Option<automaton_coordinator::StoreKind>,
    /// The etcd endpoints, comma-separated (http://a:2379,http://b:2379,http://c:2379).
    #[arg(long, value_name = "URLS")]
    etcd: Option<String>,
    /// With --store etcd: the URL clients reach this coordinator at (followers name it as
    /// the leader's). Default: http(s):// and the bound address.
    #[arg(long, value_name = "URL")]
    advertise: Option<String>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    print_config: bool,
    /// Log format on stderr: text (default) or json.
    #[arg(long, value_name = "FORMAT", default_value = "text")]
    log_format: String,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ERROR: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let format: LogFormat = flags.log_format.parse()?;
    // Before anything logs; export over OTLP only when OTEL_EXPORTER_OTLP_ENDPOINT is set.
    let telemetry = automaton_telemetry::trace::init("automaton-coordinator", format)?;
    let result = serve_until_stopped(flags);
    // The runtime has stopped (its tasks' spans are closed): send the last spans.
    telemetry.shutdown();
    result
}

fn serve_until_stopped(flags: Flags) -> anyhow::Result<()> {
    let cfg = Config::load(&Overrides {
        config_file: flags.config,
        project: flags.project,
        listen: flags.listen,
        metrics_listen: flags.metrics_listen,
        web_listen: flags.web_listen,
        insecure: flags.insecure,
        grace_period: flags.grace_period,
        lease_ttl_min: flags.lease_ttl_min,
        lease_ttl_max: flags.lease_ttl_max,
        session_timeout: flags.session_timeout,
        heartbeat_interval: flags.heartbeat_interval,
        max_phase_time: flags.max_phase_time,
        no_dispatch: flags.no_dispatch,
        store: flags.store,
        etcd: flags
            .etcd
            .as_deref()
            .map(automaton_client::split)
            .unwrap_or_default(),
        advertise: flags.advertise,
    })?;
    if flags.print_config {
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    cfg.validate()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let served = runtime.block_on(async move {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let project = Project::open(&cfg.project, home.as_deref());
        let mut ownership = Ownership::acquire(project.meta())?;
        let listener = tokio::net::TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("cannot listen on {}", cfg.listen))?;
        let addr = listener
            .local_addr()
            .context("cannot read the bound address")?;
        let metrics = match cfg.metrics_listen {
            Some(m) => Some(
                tokio::net::TcpListener::bind(m)
                    .await
                    .with_context(|| format!("cannot listen for metrics on {m}"))?,
            ),
            None => None,
        };
        let web = match cfg.web_listen {
            Some(w) => Some(
                tokio::net::TcpListener::bind(w)
                    .await
                    .with_context(|| format!("cannot listen for the console on {w}"))?,
            ),
            None => None,
        };
        // Test hooks only: make the lease log's disk fail on purpose (docs/coordinator.md).
        let failpoints = match std::env::var("AUTOMATON_FAILPOINTS") {
            Ok(v) => Failpoints::parse(&v).map_err(anyhow::Error::msg)?,
            Err(_) => Failpoints::default(),
        };
        if failpoints != Failpoints::default() {
            tracing::warn!(
                ?failpoints,
                "failpoints set: the lease log will fail on purpose"
            );
        }
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        if cfg.store == StoreKind::Etcd {
            let advertise = cfg
                .etcd
                .advertise
                .clone()
                .unwrap_or_else(|| format!("{scheme}://{addr}"));
            let mut options = cfg.options(failpoints);
            // A file is one etcd value: an artifact over it is refused at upload, clearly.
            options.max_artifact_bytes = options
                .max_artifact_bytes
                .min(automaton_backend::etcd::MAX_FILE_BYTES as u64);
            ownership.publish(&advertise)?;
            let shutdown = start_console(&cfg, web, addr, &project, shutdown_signal()?)?;
            println!("listening on {addr}");
            let listener = listener
                .into_std()
                .context("cannot hand the listener over")?;
            automaton_coordinator::ha::serve_on_etcd(
                &cfg, project, options, listener, metrics, advertise, shutdown,
            )
            .await?;
            return Ok::<_, anyhow::Error>(ownership);
        }
        let (coord, notes) = Coordinator::open(project.clone(), cfg.options(failpoints))?;
        for n in &notes {
            tracing::warn!(note = %n, "recovery");
        }
        if let Some(listener) = metrics {
            automaton_telemetry::metrics::spawn(
                listener,
                automaton_coordinator::metrics::render(coord.clone()),
            )
            .context("cannot read the metrics address")?;
        }
        ownership.publish(&format!("{scheme}://{addr}"))?;
        tracing::info!(
            project = %project.root().display(),
            address = %addr,
            mode = %cfg.mode(),
            leases = coord.live_leases(),
            "coordinator serving"
        );
        // Installed before the line below: a SIGTERM sent as soon as it is read must drain,
        // not kill the process with the default action.
        let shutdown = start_console(&cfg, web, addr, &project, shutdown_signal()?)?;
        // The line on stdout a script or test waits for (after the console's, if any).
        println!("listening on {addr}");
        serve(coord, &cfg, listener, shutdown).await?;
        Ok::<_, anyhow::Error>(ownership)
    });
    // Work a timed-out request left behind (a read or write on a stuck disk) must not hold
    // the exit forever; store writes are atomic, so leaving one unfinished loses nothing.
    // The project stays owned until then: no other coordinator starts under that work.
    runtime.shutdown_timeout(SHUTDOWN_WAIT);
    drop(served?);
    tracing::info!("stopped; leases kept on disk for the next start");
    Ok(())
}

/// Starts the operator's console on `listener` (when `--web-listen` gave one) as a client of
/// the gRPC API on `addr`, and prints `console on URL`. Returns `shutdown`, which now also
/// stops the console.
fn start_console(
    cfg: &Config,
    listener: Option<tokio::net::TcpListener>,
    addr: SocketAddr,
    project: &Project,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    if let Some(listener) = listener {
        let web = listener
            .local_addr()
            .context("cannot read the console's address")?;
        let name = project
            .root()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "automaton".into());
        let options = automaton_coordinator::web::console_options(cfg, addr, name)?;
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        tokio::spawn(async move {
            let stopped = async move {
                let _ = stop_rx.changed().await;
            };
            if let Err(e) = automaton_console::serve(listener, options, stopped).await {
                tracing::error!(error = %e, "the console stopped");
            }
        });
        println!("console on {scheme}://{web}/");
    }
    Ok(async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    })
}

/// How long the exit waits for work that requests which timed out left running.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Resolves on SIGTERM or Ctrl-C; the handlers are installed when this is called.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("cannot install the SIGTERM handler")?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("cannot install the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    })
}
