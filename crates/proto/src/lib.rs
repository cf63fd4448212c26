//! Code generated from `proto/automaton/v1/*.proto`: messages, clients and servers of the
//! `automaton.v1` package, and the encoded descriptor set for server reflection. Times and
//! durations are the well-known `google.protobuf` types, re-exported as [`prost_types`].
//!
//! This crate must not contain hand-written logic, beyond `vocab`: the one-to-one mapping
//! between the proto's enums and `automaton-workflow`'s vocabulary, so that every peer reads
//! the wire the same way.

pub use prost_types;

pub mod vocab;

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("automaton.v1");

    /// The encoded `FileDescriptorSet` of `automaton.v1`, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/automaton_descriptor.bin"));
}
