//! The approximate prefix of a prompt without its tokenizer: the prompt's
//! UTF-8 bytes, four to a pseudo-token (a little-endian u32, so roughly one
//! real token of English each), keyed in `kv_block_size`-token blocks as
//! §11a keys token ids, from a seed of its own. Hashing the bytes directly
//! is the same as hashing the pseudo-tokens' `le_u32`s, so no token buffer
//! is built.
//!
//! These keys can match only dpcoord's own placements (the approximate
//! index): an engine's KV events carry real token ids, whose keys are never
//! these.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::ChatMessage;

/// Bytes per pseudo-token.
pub const BYTES_PER_TOKEN: usize = 4;

/// The tag the text chains' seed is the hash of: not a §11a seed (those
/// start `dpcoord-kv-2\0`), so a text key never equals a token key.
const TEXT_SEED_TAG: &[u8] = b"dpcoord-text-1\0";

/// The seed of every text chain.
pub fn text_seed() -> u64 {
    xxh3_64(TEXT_SEED_TAG)
}

/// Appends the key of every whole block of `bytes` (`block_tokens`
/// pseudo-tokens each) to `out`, the first continuing `seed`; a partial last
/// block has no key.
pub fn text_keys(seed: u64, bytes: &[u8], block_tokens: usize, out: &mut Vec<u64>) {
    let block = block_tokens.max(1) * BYTES_PER_TOKEN;
    out.reserve(bytes.len() / block);
    let mut key = seed;
    for chunk in bytes.chunks_exact(block) {
        key = xxh3_64_with_seed(chunk, key);
        out.push(key);
    }
}

/// The bytes a chat is keyed by: each message's role, a NUL, its content
/// and a record separator (0x1E), so `[("user","ab")]` and
/// `[("user","a"),("b",...)]` differ. Templates aside, the same messages
/// make the same prefix, and a conversation that grows keeps its prefix.
pub fn chat_bytes(messages: &[ChatMessage]) -> Vec<u8> {
    let len = messages.iter().map(|m| m.role.len() + m.content.len() + 2).sum();
    let mut buf = Vec::with_capacity(len);
    for m in messages {
        buf.extend_from_slice(m.role.as_bytes());
        buf.push(0);
        buf.extend_from_slice(m.content.as_bytes());
        buf.push(0x1E);
    }
    buf
}

#[cfg(test)]
mod tests {
    use super::*;
    use dpcoord_daemon::engines::prefix::keys::chain_keys;

    #[test]
    fn text_keys_are_the_chained_keys_of_the_pseudo_tokens() {
        let text: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        for block in [1, 2, 16, 64, 65] {
            let tokens: Vec<u32> = text.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            let (mut direct, mut chained) = (Vec::new(), Vec::new());
            text_keys(text_seed(), &text, block, &mut direct);
            chain_keys(text_seed(), &tokens, block, &mut chained);
            assert_eq!(direct, chained, "block {block}");
            assert_eq!(direct.len(), text.len() / (4 * block));
        }
    }

    #[test]
    fn a_shared_prefix_shares_its_keys_and_the_seed_is_not_a_token_seed() {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        text_keys(text_seed(), &[b'x'; 200], 4, &mut a);
        text_keys(text_seed(), &[[b'x'; 100], [b'y'; 100]].concat(), 4, &mut b);
        assert_eq!(a.len(), 12);
        assert_eq!(a[..6], b[..6]);
        assert_ne!(a[6], b[6]);
        assert_ne!(text_seed(), dpcoord_daemon::engines::prefix::keys::chain_seed(None, None));
    }

    #[test]
    fn chat_bytes_separate_the_messages() {
        let m = |r: &str, c: &str| ChatMessage { role: r.into(), content: c.into() };
        assert_eq!(chat_bytes(&[m("user", "ab")]), b"user\0ab\x1e");
        assert_ne!(chat_bytes(&[m("user", "ab")]), chat_bytes(&[m("user", "a"), m("b", "")]));
        let one = chat_bytes(&[m("system", "s"), m("user", "q")]);
        let two = chat_bytes(&[m("system", "s"), m("user", "q"), m("assistant", "a")]);
        assert!(two.starts_with(&one));
    }
}
