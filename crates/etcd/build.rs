//! Compiles the etcd v3.4 API subset in proto/etcd into tonic clients with protox (pure Rust:
//! no system protoc). No servers: this crate only calls etcd. It must not compile the
//! coordinator's API (that is the `automaton-proto` crate).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("proto");
    let file = root.join("etcd/rpc.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
