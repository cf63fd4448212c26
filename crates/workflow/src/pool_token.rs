//! Pool tokens: bearer tokens that a coordinator accepts for any name of a worker pool
//! without listing each one. A token is `pool:{name}:{mac}`, where `mac` is the lowercase hex
//! HMAC-SHA256, keyed with the pool's secret, of `automaton pool token v1`, a NUL byte and the
//! name. Whoever holds the pool's secret mints tokens for the pool's names (a worker mints its
//! own when it starts); the coordinator checks the MAC and that the name is one of the pool's
//! (its prefix), and the token is then bound to that name exactly as a listed token is.
//!
//! The name is inside the MACed bytes, so a token minted for one name cannot be presented
//! as another. What a pool gives up against one token per worker: every holder of the
//! secret can mint a token for every name of the pool.

use sha2::{Digest, Sha256};

use crate::digest::hex;

/// What every pool token starts with.
pub const PREFIX: &str = "pool:";
/// Domain separation: the MAC of a pool token is not a MAC of anything else.
const CONTEXT: &[u8] = b"automaton pool token v1\0";
/// The shortest pool secret a coordinator or a worker accepts, in bytes.
pub const MIN_SECRET_BYTES: usize = 32;

/// The token for `name` under the pool `secret`.
pub fn mint(secret: &[u8], name: &str) -> String {
    format!("{PREFIX}{name}:{}", hex(&mac(secret, name)))
}

/// A pool token's name and MAC (hex), if `token` has a pool token's shape.
pub fn split(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix(PREFIX)?;
    let (name, mac) = rest.rsplit_once(':')?;
    (!name.is_empty() && mac.len() == 64).then_some((name, mac))
}

/// Whether `mac_hex` is the MAC of `name` under `secret`, compared in constant time.
pub fn verify(secret: &[u8], name: &str, mac_hex: &str) -> bool {
    let expected = hex(&mac(secret, name));
    let (a, b) = (expected.as_bytes(), mac_hex.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn mac(secret: &[u8], name: &str) -> [u8; 32] {
    let mut msg = Vec::with_capacity(CONTEXT.len() + name.len());
    msg.extend_from_slice(CONTEXT);
    msg.extend_from_slice(name.as_bytes());
    hmac_sha256(secret, &msg)
}

/// HMAC-SHA256 (RFC 2104).
fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| k.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(msg)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test cases 1, 2 and 6 (a key longer than the block).
        assert_eq!(
            hex(&hmac_sha256(&[0x0b; 20], b"Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_eq!(
            hex(&hmac_sha256(
                &[0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First"
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_minted_token_verifies_for_its_name_only() {
        let secret = [7u8; 32];
        let t = mint(&secret, "gpu-node-1.example");
        let (name, mac) = split(&t).expect("shape");
        assert_eq!(name, "gpu-node-1.example");
        assert!(verify(&secret, name, mac));
        assert!(!verify(&secret, "gpu-node-2", mac), "another name");
        assert!(!verify(&[8u8; 32], name, mac), "another secret");
        let mut flipped = mac.to_string();
        flipped.replace_range(0..1, if mac.starts_with('0') { "1" } else { "0" });
        assert!(!verify(&secret, name, &flipped), "a changed MAC");
        assert!(!verify(&secret, name, &mac[..63]), "a short MAC");
    }

    #[test]
    fn only_pool_shaped_tokens_split() {
        for bad in [
            "",
            "pool:",
            "pool::",
            "pool:name",
            "pool:name:abc",
            "name:0000000000000000000000000000000000000000000000000000000000000000",
            "pool::0000000000000000000000000000000000000000000000000000000000000000",
        ] {
            assert_eq!(split(bad), None, "{bad:?}");
        }
    }
}
