//! Compiles the minimal etcd v3.4 API subset in proto/etcd with protox (pure Rust: no system
//! protoc), messages only (calls go through the benchmark's own client, `src/rpc.rs`). The coordinator's API comes from the `automaton-proto` crate.

use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proto");
    let file = root.join("etcd/rpc.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(false)
        .compile_fds(fds)?;
    Ok(())
}
