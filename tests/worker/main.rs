//! Cross-process tests of automaton-worker: every test runs the real binary with HOME set
//! to a temporary folder (the real `~/.automaton` is never touched) and, where a model
//! server is needed, a small HTTP server on `127.0.0.1:0` in a thread. The metering proxy's
//! tests (`meter`) run the library's proxy in front of such a server, with raw HTTP clients.
//! The agent guard's (`guard`) run a real worker against a fake coordinator and kill it.
//! `doctor` runs `automaton-worker doctor` with small shell templates as the agent.

#![allow(clippy::unwrap_used)]

mod doctor;
mod guard;
mod meter;
#[path = "../common/model_server.rs"]
mod model_server;
mod probe;
#[path = "../common/run.rs"]
mod run;
