//! `automaton-etcd`: the small etcd v3 client the coordinator uses for high availability —
//! KV reads and writes, transactions, leases, member status, and on top of them leader
//! election with fenced writes (`election.rs`). It owns the wire protocol to etcd (a subset
//! of etcd 3.4's API, generated into [`pb`]) and nothing else: it must not depend on any other
//! automaton crate nor name the coordinator's protobufs.
//!
//! Every call has a per-attempt timeout and retries across the configured endpoints on
//! transient failures (see [`Client`]); what a retry cannot change comes back at once as an
//! [`Error`] whose message is one line saying what to do.

mod client;
mod config;
mod election;
mod error;
mod txn;

/// The generated etcd API types and tonic clients (`etcdserverpb`), for what this crate does
/// not wrap (the tests use them to turn authentication on).
#[allow(clippy::all, clippy::unwrap_used, missing_docs)]
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/etcdserverpb.rs"));
}

pub use client::{Client, MemberStatus};
pub use config::{Config, DEFAULT_TIMEOUT, MAX_TIMEOUT, TlsConfig};
pub use election::{Election, Leadership, MAX_TTL, MIN_TTL, leader};
pub use error::Error;
pub use txn::{
    Cmp, Compare, KeyValue, MAX_TXN_BYTES, MAX_TXN_OPS, Op, OpResponse, Txn, TxnResponse, split_ops,
};
