//! `automaton logs TASK [--follow]`: the live output of a task's run as the coordinator keeps
//! it (a bounded tail per run: docs/worker.md), and with `--follow` each new chunk until the
//! run's output ends — the `kubectl logs -f` habit. The output goes to stdout as the agent
//! printed it, control characters other than newline and tab escaped (`--raw`: unchanged);
//! what the coordinator did not keep, and how the run ended, go to stderr.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use automaton_proto::v1 as pb;
use clap::Args;

use crate::backend::Failure;
use crate::watch::Link;

#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The task (`name` or `parent/sub`): its latest run, unless --run names one.
    pub task: String,
    /// Keep printing what the run prints until its output ends.
    #[arg(long, short = 'f')]
    pub follow: bool,
    /// A run of the task by its lease id (`automaton status --task T` lists its runs).
    #[arg(long, value_name = "LEASE_ID")]
    pub run: Option<String>,
    /// Start at most this many bytes before the end of what is kept.
    #[arg(long, value_name = "BYTES")]
    pub tail: Option<u64>,
    /// Write the output's bytes unchanged (escape sequences included).
    #[arg(long)]
    pub raw: bool,
    #[command(flatten)]
    pub target: crate::workers::Target,
}

/// `bytes` safe for a terminal: control characters other than `\n` and `\t` as escapes, so
/// an agent's output cannot drive the reader's terminal; invalid UTF-8 as U+FFFD.
pub(crate) fn printable(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .chars()
        .map(|c| match c {
            '\n' | '\t' => c.to_string(),
            c if c.is_control() => c.escape_default().to_string(),
            c => c.to_string(),
        })
        .collect()
}

async fn logs(args: &LogsArgs) -> Result<(), Failure> {
    const WHAT: &str = "automaton logs";
    let link = Link::new(
        args.target.project.as_deref(),
        args.target.coordinator.as_deref(),
    )?;
    let address = link.leader(WHAT).await?;
    let mut client = pb::workers_client::WorkersClient::new(Link::channel(&address)?);
    let req = pb::TailOutputRequest {
        task: args.task.clone(),
        follow: args.follow,
        lease_id: args.run.clone().unwrap_or_default(),
        tail_bytes: args.tail.unwrap_or(0),
    };
    // A stream has no deadline; opening it does.
    let mut stream = tokio::time::timeout(
        Duration::from_secs(30),
        client.tail_output(link.request(req, None)),
    )
    .await
    .map_err(|_| {
        Failure::Usage(format!(
            "{WHAT}: the coordinator at {address} did not answer"
        ))
    })?
    .map_err(Failure::from)?
    .into_inner();
    let raw = args.raw;
    let mut told = false;
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    loop {
        let next = tokio::select! {
            m = stream.message() => m,
            _ = &mut interrupted => return Ok(()),
        };
        let Some(ev) = next.map_err(Failure::from)? else {
            return Ok(());
        };
        if !told {
            told = true;
            if std::io::stderr().is_terminal() || args.follow {
                eprintln!(
                    "{WHAT}: {} {} on {} (run {})",
                    ev.task, ev.phase, ev.worker, ev.lease_id
                );
            }
        }
        if ev.skipped > 0 {
            eprintln!("{WHAT}: [{} bytes before this are not kept]", ev.skipped);
        }
        if !ev.data.is_empty() {
            let mut out = std::io::stdout().lock();
            let written = if raw {
                out.write_all(&ev.data)
            } else {
                out.write_all(printable(&ev.data).as_bytes())
            };
            // A closed stdout is the reader saying it has seen enough.
            if written.and_then(|()| out.flush()).is_err() {
                return Ok(());
            }
        }
        if ev.ended {
            eprintln!("{WHAT}: the run's output ended ({})", ev.end_reason);
            return Ok(());
        }
    }
}

/// Runs `automaton logs`; returns the exit code (0 when the output ended, on Ctrl-C or a
/// closed stdout).
pub fn run(args: &LogsArgs) -> i32 {
    match crate::watch::block_on(logs(args)) {
        Ok(()) => 0,
        Err(f) => crate::report_failure(f, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_sequences_in_output_are_shown_not_obeyed() {
        assert_eq!(
            printable(b"ok\n\x1b[2Jgone\tstill\r\n"),
            "ok\n\\u{1b}[2Jgone\tstill\\r\n"
        );
        assert_eq!(printable(&[0xff, b'a']), "\u{fffd}a");
    }
}
