//! Cross-process tests of automaton-worker: every test runs the real binary with HOME set
//! to a temporary folder (the real `~/.automaton` is never touched) and, where a model
//! server is needed, a small HTTP server on `127.0.0.1:0` in a thread.

#![allow(clippy::unwrap_used)]

mod probe;
#[path = "../common/run.rs"]
mod run;
