//! `automaton-worker`: `probe` reports what this machine can hold; without a subcommand the
//! worker joins the coordinator's fleet and holds its session.

fn main() {}
