//! A query's prompt (docs/PROTOCOL.md §4, §11a): token ids, or the chained
//! block keys a client computed, with the LoRA name and salt that seed a
//! token chain. Checked once when the query is decoded and kept as the
//! MessagePack arrays it came in, so decoding allocates nothing.

use super::msgpack::{Reader, Value};
use super::{ErrorCode, WireError};

/// Block keys per token of `limits.max_prompt_tokens` (a key covers at
/// least one block, and blocks are at least this many tokens in practice).
pub const TOKENS_PER_KEY: u32 = 16;

/// A checked prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Prompt<'a> {
    Tokens { array: &'a [u8], count: u32, lora: Option<&'a str>, salt: Option<&'a str> },
    Keys { array: &'a [u8], count: u32 },
}

impl Prompt<'_> {
    /// The token ids (empty for keys), into `out`.
    pub fn tokens_into(&self, out: &mut Vec<u32>) {
        out.clear();
        if let Prompt::Tokens { array, .. } = *self {
            let mut r = Reader::new(array);
            if let Ok(Value::Array(n)) = r.read() {
                // Checked by `decode_prompt`: every element is an int below 2^32
                // (a wider encoding of one falls back to the full reader).
                out.extend((0..n).filter_map(|_| {
                    r.small_uint().or_else(|| match r.read() {
                        Ok(Value::Int(t)) => u32::try_from(t).ok(),
                        _ => None,
                    })
                }));
            }
        }
    }

    /// The block keys (empty for tokens), into `out`.
    pub fn keys_into(&self, out: &mut Vec<u64>) {
        out.clear();
        if let Prompt::Keys { array, .. } = *self {
            let mut r = Reader::new(array);
            if let Ok(Value::Array(n)) = r.read() {
                out.extend((0..n).filter_map(|_| {
                    r.uint64().or_else(|| match r.read() {
                        Ok(Value::Int(k)) => u64::try_from(k).ok(),
                        _ => None,
                    })
                }));
            }
        }
    }
}

fn bad(message: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::BadRequest, message)
}

fn opt_str<'a>(name: &str, v: Option<Value<'a>>) -> Result<Option<&'a str>, WireError> {
    match v {
        None => Ok(None),
        Some(Value::Str(s)) => Ok(Some(s)),
        Some(other) => Err(bad(format!("`{name}` must be a string, got {}", other.type_name()))),
    }
}

/// Checks an array field: at most `max` elements, each an integer
/// `fits`; returns its element count.
fn check_array(name: &str, raw: &[u8], max: u32, fits: impl Fn(i128) -> bool, what: &str) -> Result<u32, WireError> {
    let undecodable = |e| bad(format!("query is not valid MessagePack: {e}"));
    let mut r = Reader::new(raw);
    let n = match r.read().map_err(undecodable)? {
        Value::Array(n) if n <= max => n,
        Value::Array(n) => {
            let msg = format!("`{name}` has {n} elements, above the limit of {max}");
            return Err(WireError::new(ErrorCode::TooLarge, msg));
        }
        other => return Err(bad(format!("`{name}` must be an array, got {}", other.type_name()))),
    };
    for i in 0..n {
        // The common case, an unsigned int, without building a `Value`.
        match r.uint64() {
            Some(v) if fits(i128::from(v)) => continue,
            Some(v) => return Err(bad(format!("`{name}[{i}]` must be {what}, got {v}"))),
            None => {}
        }
        match r.read().map_err(undecodable)? {
            Value::Int(t) if fits(t) => {}
            Value::Int(t) => return Err(bad(format!("`{name}[{i}]` must be {what}, got {t}"))),
            other => return Err(bad(format!("`{name}[{i}]` must be {what}, got {}", other.type_name()))),
        }
    }
    Ok(n)
}

/// The raw fields of a prompt, as the query map had them.
#[derive(Default)]
pub(super) struct PromptFields<'a> {
    pub tokens: Option<&'a [u8]>,
    pub block_keys: Option<&'a [u8]>,
    pub lora: Option<Value<'a>>,
    pub salt: Option<Value<'a>>,
}

/// The prompt of a query, if it has one; `max_tokens` is `limits.max_prompt_tokens`.
pub(super) fn decode_prompt<'a>(f: &PromptFields<'a>, max_tokens: u32) -> Result<Option<Prompt<'a>>, WireError> {
    let (lora, salt) = (opt_str("lora", f.lora)?, opt_str("salt", f.salt)?);
    match (f.tokens, f.block_keys) {
        (None, None) if lora.is_some() || salt.is_some() => Err(bad("`lora` and `salt` go with `tokens`")),
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(bad("send `tokens` or `block_keys`, not both")),
        (Some(array), None) => {
            let count = check_array(
                "tokens",
                array,
                max_tokens,
                |t| (0..=i128::from(u32::MAX)).contains(&t),
                "a token id in 0..2^32",
            )?;
            Ok(Some(Prompt::Tokens { array, count, lora, salt }))
        }
        (None, Some(_)) if lora.is_some() || salt.is_some() => {
            Err(bad("`lora` and `salt` are already in `block_keys`; send them only with `tokens`"))
        }
        (None, Some(array)) => {
            let max = (max_tokens / TOKENS_PER_KEY).max(1);
            let count = check_array(
                "block_keys",
                array,
                max,
                |k| (0..=i128::from(u64::MAX)).contains(&k),
                "an unsigned 64-bit key",
            )?;
            Ok(Some(Prompt::Keys { array, count }))
        }
    }
}
