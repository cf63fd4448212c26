//! The automaton worker: runs on every GPU machine. It owns what the machine can hold —
//! GPUs through NVML (or `--simulate-gpu` fakes), RAM and CPUs, the model's context window
//! and the token budget derived from them (`probe`) — the worker's one session with the
//! coordinator, the leader among several followed across a failover (`session`, `leader`),
//! and the work it is given: a fresh workspace per assignment
//! (`workspace`), the agent run in its own process group under a guard that ends it if the worker dies
//! (`agent`, `guard`, `scripted`), the artifact
//! and code reported back under the lease (`work`) — each run one span, joined to the
//! coordinator's trace of the phase run — what each run used, read from the model server's
//! answers by a metering proxy the agent is pointed at (`meter`), and its Prometheus metrics
//! (`metrics`). `presets` holds the tested templates for aider, Codex and Claude Code;
//! `doctor` runs one dry phase in a scratch workspace and says what to fix.
//!
//! It must not decide policy: which task runs where, who may review what, when a lease ends
//! are the coordinator's calls. The worker reports and obeys.

pub mod agent;
pub mod doctor;
pub mod guard;
pub mod leader;
pub mod meter;
pub mod metrics;
pub mod output;
pub mod presets;
pub mod probe;
pub mod scripted;
pub mod session;
pub mod work;
pub mod workspace;
