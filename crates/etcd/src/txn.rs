//! The plain-Rust face of etcd's data: key-values, compares, operations, transactions and
//! their answers, converted to and from the generated protobuf types, and the splitting of a
//! long list of operations into transactions etcd accepts. It must not call etcd (that is
//! `client.rs`); conversions from etcd's answers never panic.

use prost::Message;

use crate::pb;
use pb::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::request_op::Request;
use pb::response_op::Response;

/// The most operations this crate puts in one transaction branch. etcd refuses more than
/// `--max-txn-ops` (128 by default) in the compares or in either branch; one is kept spare.
pub const MAX_TXN_OPS: usize = 127;

/// The most encoded bytes of operations [`split_ops`] puts in one transaction: under etcd's
/// default `--max-request-bytes` (1.5 MiB) with room for compares and framing.
pub const MAX_TXN_BYTES: usize = 1024 * 1024;

/// A key and its value as etcd stores it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyValue {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    /// The revision of the put that created the key (since it was last absent).
    pub create_revision: i64,
    /// The revision of the last put to the key.
    pub mod_revision: i64,
    /// How many puts since it was created (1 after the first).
    pub version: i64,
    /// The lease the key is attached to; 0 for none.
    pub lease: i64,
}

impl From<pb::KeyValue> for KeyValue {
    fn from(kv: pb::KeyValue) -> Self {
        KeyValue {
            key: kv.key,
            value: kv.value,
            create_revision: kv.create_revision,
            mod_revision: kv.mod_revision,
            version: kv.version,
            lease: kv.lease,
        }
    }
}

/// How a compare relates the key's field to the given value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmp {
    Equal,
    Greater,
    Less,
    NotEqual,
}

impl From<Cmp> for CompareResult {
    fn from(c: Cmp) -> Self {
        match c {
            Cmp::Equal => CompareResult::Equal,
            Cmp::Greater => CompareResult::Greater,
            Cmp::Less => CompareResult::Less,
            Cmp::NotEqual => CompareResult::NotEqual,
        }
    }
}

/// One condition of a transaction. A key that does not exist has create_revision,
/// mod_revision and version 0.
#[derive(Clone, Debug, PartialEq)]
pub struct Compare(pub(crate) pb::Compare);

impl Compare {
    fn new(key: impl Into<Vec<u8>>, cmp: Cmp, target: CompareTarget, value: TargetUnion) -> Self {
        Compare(pb::Compare {
            result: CompareResult::from(cmp) as i32,
            target: target as i32,
            key: key.into(),
            range_end: Vec::new(),
            target_union: Some(value),
        })
    }

    pub fn create_revision(key: impl Into<Vec<u8>>, cmp: Cmp, revision: i64) -> Self {
        Self::new(
            key,
            cmp,
            CompareTarget::Create,
            TargetUnion::CreateRevision(revision),
        )
    }

    pub fn mod_revision(key: impl Into<Vec<u8>>, cmp: Cmp, revision: i64) -> Self {
        Self::new(
            key,
            cmp,
            CompareTarget::Mod,
            TargetUnion::ModRevision(revision),
        )
    }

    pub fn version(key: impl Into<Vec<u8>>, cmp: Cmp, version: i64) -> Self {
        Self::new(
            key,
            cmp,
            CompareTarget::Version,
            TargetUnion::Version(version),
        )
    }

    pub fn value(key: impl Into<Vec<u8>>, cmp: Cmp, value: impl Into<Vec<u8>>) -> Self {
        Self::new(
            key,
            cmp,
            CompareTarget::Value,
            TargetUnion::Value(value.into()),
        )
    }

    /// The key does not exist.
    pub fn absent(key: impl Into<Vec<u8>>) -> Self {
        Self::create_revision(key, Cmp::Equal, 0)
    }
}

/// One operation in a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
        lease: Option<i64>,
    },
    Delete {
        key: Vec<u8>,
    },
    DeletePrefix {
        prefix: Vec<u8>,
    },
    Get {
        key: Vec<u8>,
    },
}

impl Op {
    pub fn put(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> Self {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }

    pub fn put_with_lease(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>, lease: i64) -> Self {
        Op::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }

    pub fn delete(key: impl Into<Vec<u8>>) -> Self {
        Op::Delete { key: key.into() }
    }

    pub fn delete_prefix(prefix: impl Into<Vec<u8>>) -> Self {
        Op::DeletePrefix {
            prefix: prefix.into(),
        }
    }

    pub fn get(key: impl Into<Vec<u8>>) -> Self {
        Op::Get { key: key.into() }
    }

    pub(crate) fn to_pb(&self) -> pb::RequestOp {
        let request = match self {
            Op::Put { key, value, lease } => Request::RequestPut(pb::PutRequest {
                key: key.clone(),
                value: value.clone(),
                lease: lease.unwrap_or(0),
                ..Default::default()
            }),
            Op::Delete { key } => Request::RequestDeleteRange(pb::DeleteRangeRequest {
                key: key.clone(),
                ..Default::default()
            }),
            Op::DeletePrefix { prefix } => Request::RequestDeleteRange(pb::DeleteRangeRequest {
                key: prefix.clone(),
                range_end: prefix_end(prefix),
                ..Default::default()
            }),
            Op::Get { key } => Request::RequestRange(pb::RangeRequest {
                key: key.clone(),
                ..Default::default()
            }),
        };
        pb::RequestOp {
            request: Some(request),
        }
    }
}

/// A transaction: if every compare holds, the `success` operations run, else the `failure`
/// ones, atomically at one revision.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Txn {
    pub compares: Vec<Compare>,
    pub success: Vec<Op>,
    pub failure: Vec<Op>,
}

impl Txn {
    pub fn new() -> Self {
        Txn::default()
    }

    /// Adds conditions (all must hold).
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.compares.extend(compares);
        self
    }

    /// Adds operations run when the conditions hold.
    pub fn and_then(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.success.extend(ops);
        self
    }

    /// Adds operations run when a condition fails.
    pub fn or_else(mut self, ops: impl IntoIterator<Item = Op>) -> Self {
        self.failure.extend(ops);
        self
    }

    pub(crate) fn to_pb(&self) -> pb::TxnRequest {
        pb::TxnRequest {
            compare: self.compares.iter().map(|c| c.0.clone()).collect(),
            success: self.success.iter().map(Op::to_pb).collect(),
            failure: self.failure.iter().map(Op::to_pb).collect(),
        }
    }
}

/// What one operation of a transaction returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OpResponse {
    Put,
    /// How many keys were deleted.
    Delete(i64),
    /// The key-values read (none when the key is absent).
    Get(Vec<KeyValue>),
    /// A nested transaction (this crate never sends one; kept so no answer is lost).
    Txn(TxnResponse),
    /// An answer this crate does not know (a newer etcd).
    Unknown,
}

/// What a transaction did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether the compares held (so the `success` branch ran).
    pub succeeded: bool,
    /// The store's revision after the transaction: the revision of its writes, if any.
    pub revision: i64,
    /// One per operation of the branch that ran, in order.
    pub responses: Vec<OpResponse>,
}

impl From<pb::TxnResponse> for TxnResponse {
    fn from(r: pb::TxnResponse) -> Self {
        TxnResponse {
            succeeded: r.succeeded,
            revision: r.header.map_or(0, |h| h.revision),
            responses: r
                .responses
                .into_iter()
                .map(|op| match op.response {
                    Some(Response::ResponsePut(_)) => OpResponse::Put,
                    Some(Response::ResponseDeleteRange(d)) => OpResponse::Delete(d.deleted),
                    Some(Response::ResponseRange(g)) => {
                        OpResponse::Get(g.kvs.into_iter().map(KeyValue::from).collect())
                    }
                    Some(Response::ResponseTxn(t)) => OpResponse::Txn(t.into()),
                    None => OpResponse::Unknown,
                })
                .collect(),
        }
    }
}

/// The end of the range of keys starting with `prefix` (etcd's `range_end`): the prefix with
/// its last byte below 0xff incremented; `[0]` (every key) when there is none.
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Splits `ops` into runs etcd accepts as one transaction each: at most [`MAX_TXN_OPS`]
/// operations and, where more than one, at most [`MAX_TXN_BYTES`] encoded. An operation
/// alone over the byte limit goes alone (etcd then says it is too large).
pub fn split_ops(ops: Vec<Op>) -> Vec<Vec<Op>> {
    let mut out: Vec<Vec<Op>> = Vec::new();
    let mut current: Vec<Op> = Vec::new();
    let mut bytes = 0;
    for op in ops {
        let size = op.to_pb().encoded_len();
        if !current.is_empty() && (current.len() == MAX_TXN_OPS || bytes + size > MAX_TXN_BYTES) {
            out.push(std::mem::take(&mut current));
            bytes = 0;
        }
        bytes += size;
        current.push(op);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn split_ops_keeps_to_the_op_and_byte_limits() {
        let ops: Vec<Op> = (0..300).map(|i| Op::put(format!("k{i}"), "v")).collect();
        let runs = split_ops(ops.clone());
        assert_eq!(
            runs.iter().map(Vec::len).collect::<Vec<_>>(),
            [127, 127, 46]
        );
        assert_eq!(runs.concat(), ops);
        let big: Vec<Op> = (0..5)
            .map(|i| Op::put(format!("k{i}"), vec![0u8; 400 * 1024]))
            .collect();
        assert_eq!(
            split_ops(big).iter().map(Vec::len).collect::<Vec<_>>(),
            [2, 2, 1]
        );
        assert!(split_ops(Vec::new()).is_empty());
    }
}
