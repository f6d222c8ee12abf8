//! dpcoord's block keys (docs/PROTOCOL.md §11a): xxh3-64 over each block's
//! token ids as little-endian u32s, seeded with the previous block's key,
//! the first block seeded by the LoRA name and cache salt. A key thus
//! covers its whole prefix, and any client can compute it (Python's
//! `xxhash.xxh3_64_intdigest(data, seed)`).

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Tokens per block that keys are computed over without a heap buffer.
const STACK_TOKENS: usize = 64;

/// The seed of a chain: `xxh3_64("dpcoord-kv-1\0" lora "\0" salt)`.
pub fn chain_seed(lora: Option<&str>, salt: Option<&str>) -> u64 {
    let (lora, salt) = (lora.unwrap_or(""), salt.unwrap_or(""));
    let mut buf = Vec::with_capacity(14 + lora.len() + salt.len());
    buf.extend_from_slice(b"dpcoord-kv-1\0");
    buf.extend_from_slice(lora.as_bytes());
    buf.push(0);
    buf.extend_from_slice(salt.as_bytes());
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
        let seed = xxh3_64(b"dpcoord-kv-1\0\0");
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
        // Long blocks take the heap path and give the same function.
        let long: Vec<u32> = (0..100).collect();
        let bytes: Vec<u8> = long.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(block_key(7, &long), xxh3_64_with_seed(&bytes, 7));
    }
}
