//! Cross-process tests of `automaton status`: every test runs the real binary against a
//! project in a fresh temporary folder, with HOME pointed at another one.

mod harness;
mod issue14;
mod leases;
mod locks;
mod spec;
