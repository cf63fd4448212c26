//! Cross-process tests of automaton-coordinator: every test starts the real
//! `automaton-coordinator` binary on `127.0.0.1:0` over a fresh temporary project and talks
//! to it over real gRPC (and through the real `automaton` CLI).

mod api;
mod cli;
#[path = "../etcd/cluster.rs"]
#[allow(dead_code)]
mod cluster;
mod console;
mod delivery;
mod deploy;
mod durable;
mod faults;
#[path = "../common/forge.rs"]
mod forge;
mod ha;
mod ha_waves;
mod ha_workers;
mod harness;
mod history;
mod issue14;
mod issue20;
mod issue21;
mod issue21_failures;
mod issue21_prompts;
mod issue24;
mod leases;
mod lifecycles;
mod limits;
mod logs;
mod metrics;
#[path = "../common/model_server.rs"]
mod model_server;
mod restart;
mod service;
mod store_paths;
mod traces;
mod uploads;
mod usage;
mod views;
mod waves;
mod webdriver;
mod webhooks;
mod work;
mod workers;
