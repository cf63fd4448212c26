//! The lease engine: one project's leases while a coordinator runs. It owns the lease table
//! (expiry by its own monotonic clock), fencing tokens that strictly increase across
//! restarts, claims, renewals, releases and the check of a lease presented with a change,
//! task changes through `automaton-store` (transition, approve, create), recovery at start
//! and the first touch of a task, who held each phase, the `.state.lock` views, the
//! operators' event feed and the lease counters. Every grant and end is acknowledged only
//! once the backend's lease log (`Arc<dyn LeaseLog>`, `automaton-backend`) has it.
//!
//! It must not name gRPC (`tonic`, `automaton-proto`) nor know dispatch or worker sessions:
//! what they need to hear of goes through [`Hooks`]. It decides no lifecycle rule itself
//! (`automaton-workflow` does) and reads and writes no task file but through
//! `automaton-store`.

mod commit;
mod counters;
mod engine;
mod error;
mod events;
mod fencing;
mod holders;
mod hooks;
mod lease_ops;
mod open;
mod recovery;
pub mod table;
mod task_changes;
mod views;
pub mod watchers;

pub use counters::{Counters, END_REASONS, Refusal, phase_index};
pub use engine::{Engine, MAX_BLOCKING_READS, Options};
pub use error::Error;
pub use events::{Event, Subscription};
pub use hooks::Hooks;
pub use lease_ops::{Granted, Presented, Refused};
pub use table::{Live, Table, later};
