//! dpcoord's block keys (docs/PROTOCOL.md §11a): xxh3-64 over each block's
//! token ids as little-endian u32s, seeded with the previous block's key,
//! the first block seeded by the LoRA name and cache salt (each
//! length-prefixed, so no two pairs share a seed). A key thus
//! covers its whole prefix, and any client can compute it (Python's
//! `xxhash.xxh3_64_intdigest(data, seed)`).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per block that keys are computed over without a heap buffer.
const STACK_TOKENS: usize = 64;

/// The key an unmatchable block is held under (docs/prefix-cache.md,
/// "Unmatchable blocks"): never set as held, so never matched. A real key
/// equal to it (one chance in 2^64) only costs its chain a miss.
pub const UNMATCHABLE: u64 = 0;

/// The tag a chain seed's bytes start with.
const SEED_TAG: &[u8] = b"dpcoord-kv-2\0";

/// The seed of a chain: `xxh3_64("dpcoord-kv-2\0" len(lora) lora
/// len(salt) salt)`, each length the UTF-8 byte count as a little-endian
/// u64, an absent name the same as an empty one. The lengths make every
/// pair its own seed, NUL bytes and all (`"a\0"`+`""` and `"a"`+`"\0"`
/// differ), so any name an engine sends works.
pub fn chain_seed(lora: Option<&str>, salt: Option<&str>) -> u64 {
    let (lora, salt) = (lora.unwrap_or(""), salt.unwrap_or(""));
    let mut buf = Vec::with_capacity(SEED_TAG.len() + 16 + lora.len() + salt.len());
    buf.extend_from_slice(SEED_TAG);
    for part in [lora, salt] {
        buf.extend_from_slice(&(part.len() as u64).to_le_bytes());
        buf.extend_from_slice(part.as_bytes());
    }
    xxh3_64(&buf)
}

/// The key of one block continuing `parent` (a chain seed or the previous
/// block's key).
pub fn block_key(parent: u64, tokens: &[u32]) -> u64 {
    if tokens.len() <= STACK_TOKENS {
        let mut buf = [0u8; STACK_TOKENS * 4];
        for (chunk, t) in buf.chunks_exact_mut(4).zip(tokens) {
            chunk.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&buf[..tokens.len() * 4], parent)
    } else {
        let buf: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
        xxh3_64_with_seed(&buf, parent)
    }
}

/// Appends the keys of every whole block of `tokens` to `out`, the first
/// continuing `parent`; a partial last block has no key.
pub fn chain_keys(parent: u64, tokens: &[u32], block_size: usize, out: &mut Vec<u64>) {
    let mut key = parent;
    for block in tokens.chunks_exact(block_size.max(1)) {
        key = block_key(key, block);
        out.push(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_chain_and_match_the_documented_bytes() {
        // The documented algorithm, spelled out by hand for two blocks of 2.
        let seed = xxh3_64(b"dpcoord-kv-2\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
        assert_eq!(chain_seed(None, None), seed);
        let k0 = xxh3_64_with_seed(&[1, 0, 0, 0, 2, 0, 0, 0], seed);
        let k1 = xxh3_64_with_seed(&[3, 0, 0, 0, 0, 1, 0, 0], k0);
        let mut out = Vec::new();
        chain_keys(seed, &[1, 2, 3, 256, 9], 2, &mut out);
        assert_eq!(out, vec![k0, k1], "the partial block (9) has no key");
        // A key covers the whole prefix: the same block after another parent differs.
        assert_ne!(block_key(k1, &[1, 2]), k0);
        // LoRA and salt separate chains, and so does where the separator falls.
        assert_ne!(chain_seed(Some("a"), None), chain_seed(None, Some("a")));
        assert_ne!(chain_seed(Some("a"), Some("b")), seed);
        assert_eq!(chain_seed(Some(""), Some("")), seed, "absent and empty are the same");
        // Long blocks take the heap path and give the same function.
        let long: Vec<u32> = (0..100).collect();
        let bytes: Vec<u8> = long.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(block_key(7, &long), xxh3_64_with_seed(&bytes, 7));
    }

    #[test]
    fn seeds_are_unambiguous_with_nul_bytes_in_names() {
        // The documented bytes, by hand: tag, then each part length-prefixed.
        let by_hand = xxh3_64(b"dpcoord-kv-2\0\x02\0\0\0\0\0\0\0a\0\x01\0\0\0\0\0\0\0b");
        assert_eq!(chain_seed(Some("a\0"), Some("b")), by_hand);
        // Where a NUL falls no longer moves bytes from one part to the other.
        let pairs =
            [("a\0", ""), ("a", "\0"), ("", "a\0"), ("\0a", ""), ("a", ""), ("", "a"), ("a\0\0", ""), ("\0", "\0")];
        let seeds: std::collections::HashSet<u64> = pairs.iter().map(|&(l, s)| chain_seed(Some(l), Some(s))).collect();
        assert_eq!(seeds.len(), pairs.len(), "every pair has its own seed");
        // The answers the Python client's tests hold (clients/python/tests/test_prefix.py).
        assert_eq!(chain_seed(None, None), 1889521019268027495);
        let (mut out, ramp): (Vec<u64>, Vec<u32>) = (Vec::new(), (0..40).collect());
        chain_keys(chain_seed(Some("adapter-a"), Some("tenant-7")), &ramp, 16, &mut out);
        assert_eq!(out, [16454697871714256322, 10572151411282607089]);
        // A length prefix is not mistaken for name bytes either.
        assert_ne!(chain_seed(Some("\x01\0\0\0\0\0\0\0x"), None), chain_seed(Some(""), Some("x")));
    }
}
