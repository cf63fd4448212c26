//! The `automaton` binary: parses the command line and hands it to the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = automaton_cli::Cli::parse();
    let code = automaton_cli::run(cli);
    ExitCode::from(u8::try_from(code).unwrap_or(2))
}
