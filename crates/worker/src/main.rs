//! `automaton-worker`: `probe` reports what this machine can hold; without a subcommand the
//! worker joins the coordinator's fleet and holds its session.

use clap::{Parser, Subcommand};

use automaton_worker::probe;

#[derive(Parser)]
#[command(name = "automaton-worker", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

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
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let out = match cli.cmd {
        Some(Cmd::Probe { detect, json }) => probe::run(&detect, json),
        None => Err(anyhow::anyhow!(
            "no coordinator given: run `automaton-worker probe`, or join with --coordinator URL"
        )),
    };
    match out {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("automaton-worker: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
