//! HMAC-SHA256 (RFC 2104) over the `sha2` crate, and the signature a delivery carries.

use automaton_workflow::hex;
use sha2::{Digest, Sha256};

/// SHA-256 works on 64-byte blocks.
const BLOCK: usize = 64;

/// HMAC-SHA256 of `message` under `key` (RFC 2104; checked against RFC 4231's vectors).
pub fn hmac_sha256(key: &[u8], message: &[u8]) -> [u8; 32] {
    // A key longer than a block is hashed first; a shorter one is padded with zeros.
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let mut ipad = [0x36u8; BLOCK];
    let mut opad = [0x5cu8; BLOCK];
    for i in 0..BLOCK {
        ipad[i] ^= block[i];
        opad[i] ^= block[i];
    }
    let inner = Sha256::new()
        .chain_update(ipad)
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(opad)
        .chain_update(inner)
        .finalize()
        .into()
}

/// The `X-Automaton-Signature` value for a body sent at `timestamp` (Unix seconds, the
/// `X-Automaton-Timestamp` header): `sha256=` and the hex HMAC-SHA256 of `"{timestamp}.{body}"`.
pub fn signature(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    let mut signed = Vec::with_capacity(body.len() + 21);
    signed.extend_from_slice(timestamp.to_string().as_bytes());
    signed.push(b'.');
    signed.extend_from_slice(body);
    format!("sha256={}", hex(&hmac_sha256(secret, &signed)))
}

/// Whether `header` (an `X-Automaton-Signature` value) is the signature of `body` at
/// `timestamp`, compared in constant time: what a receiver written in Rust does (it also
/// refuses a timestamp too far from its clock, which this does not know).
pub fn verify(secret: &[u8], timestamp: u64, body: &[u8], header: &str) -> bool {
    let expected = signature(secret, timestamp, body);
    constant_time_eq(expected.as_bytes(), header.trim().as_bytes())
}

/// Equal bytes, in a time that depends only on the lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// RFC 4231 §4.2–4.8: test cases 1–4, 6 and 7 (5 is a truncated output).
    #[test]
    fn hmac_sha256_matches_rfc_4231_vectors() {
        let cases: [(Vec<u8>, Vec<u8>, &str); 6] = [
            (
                vec![0x0b; 20],
                b"Hi There".to_vec(),
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe".to_vec(),
                b"what do ya want for nothing?".to_vec(),
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                vec![0xaa; 20],
                vec![0xdd; 50],
                "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
            ),
            (
                unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"),
                vec![0xcd; 50],
                "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
            ),
            (
                vec![0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First".to_vec(),
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
            (
                vec![0xaa; 131],
                b"This is a test using a larger than block-size key and a larger than \
                  block-size data. The key needs to be hashed before being used by the \
                  HMAC algorithm."
                    .to_vec(),
                "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
            ),
        ];
        for (i, (key, data, want)) in cases.iter().enumerate() {
            assert_eq!(hex(&hmac_sha256(key, data)), *want, "RFC 4231 case {i}");
        }
        // A key of exactly one block is used as it is, not hashed.
        assert_ne!(
            hmac_sha256(&[7u8; 64], b"x"),
            hmac_sha256(&Sha256::digest([7u8; 64]), b"x")
        );
    }

    #[test]
    fn a_signature_verifies_and_a_changed_byte_does_not() {
        let sig = signature(b"s3cret", 1_700_000_000, b"{\"a\":1}");
        assert!(sig.starts_with("sha256=") && sig.len() == 7 + 64, "{sig}");
        assert!(verify(b"s3cret", 1_700_000_000, b"{\"a\":1}", &sig));
        assert!(!verify(b"s3cret", 1_700_000_001, b"{\"a\":1}", &sig));
        assert!(!verify(b"s3cret", 1_700_000_000, b"{\"a\":2}", &sig));
        assert!(!verify(b"other", 1_700_000_000, b"{\"a\":1}", &sig));
        assert!(!verify(b"s3cret", 1_700_000_000, b"{\"a\":1}", "sha256="));
        // What Python's hmac module makes of the same (docs/webhooks.md's recipe).
        assert_eq!(
            signature(b"s3cret", 1_700_000_000, b"{\"id\":\"x\"}"),
            "sha256=2382c1d0968a5e57238c68de957f44d87e83d3049a5588ec251442ca372b8aec"
        );
    }
}
