//! A query's prompt (docs/PROTOCOL.md §4, §11a): token ids, or the chained
//! block keys a client computed, with the LoRA name and salt that seed a
//! token chain. Checked once when the query is decoded and kept as the
//! MessagePack arrays it came in, so decoding allocates nothing.

use super::msgpack::{ReadError, Reader, Value};
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
        if let Prompt::Tokens { array, count, .. } = *self {
            out.reserve(count as usize);
            let mut r = Reader::new(array);
            let _ = r.read(); // the array header
                              // Checked by `scan_array`: every element is an unsigned int below 2^32.
            for _ in 0..count {
                let t = r.small_uint().or_else(|| other_int(&mut r).map(|t| t as u32));
                out.push(t.unwrap_or(0));
            }
        }
    }

    /// The block keys (empty for tokens), into `out`.
    pub fn keys_into(&self, out: &mut Vec<u64>) {
        out.clear();
        if let Prompt::Keys { array, count } = *self {
            out.reserve(count as usize);
            let mut r = Reader::new(array);
            let _ = r.read(); // the array header
                              // Checked by `scan_array`: every element is an unsigned 64-bit int.
            for _ in 0..count {
                let k = r.uint64().or_else(|| other_int(&mut r));
                out.push(k.unwrap_or(0));
            }
        }
    }
}

/// A checked element not in the fast path: a 64-bit unsigned or a
/// non-negative signed encoding.
fn other_int(r: &mut Reader<'_>) -> Option<u64> {
    r.uint64().or_else(|| match r.read() {
        Ok(Value::Int(t)) => u64::try_from(t).ok(),
        _ => None,
    })
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

/// The two arrays a prompt may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ArrayKind {
    /// Token ids: unsigned, below 2^32.
    Tokens,
    /// Block keys: unsigned 64-bit.
    Keys,
}

impl ArrayKind {
    fn name(self) -> &'static str {
        match self {
            ArrayKind::Tokens => "tokens",
            ArrayKind::Keys => "block_keys",
        }
    }

    fn what(self) -> &'static str {
        match self {
            ArrayKind::Tokens => "a token id in 0..2^32",
            ArrayKind::Keys => "an unsigned 64-bit key",
        }
    }
}

/// Reads the rest of a query's `tokens` or `block_keys` value (`first` is
/// its header, just read), checking every element, and leaves the reader
/// after it: `Ok(Ok(count))`, `Ok(Err(why))` for a value that is readable
/// MessagePack but not a valid array, or `Err` when it is not MessagePack.
pub(super) fn scan_array<'a>(
    r: &mut Reader<'a>,
    first: Value<'a>,
    kind: ArrayKind,
) -> Result<Result<u32, WireError>, ReadError> {
    let Value::Array(n) = first else {
        r.skip_rest(first)?;
        return Ok(Err(bad(format!("`{}` must be an array, got {}", kind.name(), first.type_name()))));
    };
    for i in 0..n {
        // The common case, an unsigned int, without building a `Value`.
        let wrong = match r.uint64() {
            Some(v) if kind == ArrayKind::Keys || v <= u64::from(u32::MAX) => continue,
            Some(v) => v.to_string(),
            None => match r.read()? {
                // A non-negative int in a signed encoding.
                Value::Int(t) if t >= 0 && (kind == ArrayKind::Keys || t <= i128::from(u32::MAX)) => continue,
                Value::Int(t) => t.to_string(),
                other => {
                    r.skip_rest(other)?;
                    other.type_name().to_owned()
                }
            },
        };
        // Skip what is left of the array, then report the first bad element.
        for _ in i + 1..n {
            let v = r.read()?;
            r.skip_rest(v)?;
        }
        return Ok(Err(bad(format!("`{}[{i}]` must be {}, got {wrong}", kind.name(), kind.what()))));
    }
    Ok(Ok(n))
}

/// The largest a checked array may be, `kind` elements.
fn check_count(kind: ArrayKind, count: u32, max: u32) -> Result<u32, WireError> {
    if count > max {
        let msg = format!("`{}` has {count} elements, above the limit of {max}", kind.name());
        return Err(WireError::new(ErrorCode::TooLarge, msg));
    }
    Ok(count)
}

/// A checked array as the query map had it (its bytes and element count),
/// or why it is not one.
type Scanned<'a> = Result<(&'a [u8], u32), WireError>;

/// The raw fields of a prompt, as the query map had them.
#[derive(Default)]
pub(super) struct PromptFields<'a> {
    pub tokens: Option<Scanned<'a>>,
    pub block_keys: Option<Scanned<'a>>,
    pub lora: Option<Value<'a>>,
    pub salt: Option<Value<'a>>,
}

/// The prompt of a query, if it has one; `max_tokens` is `limits.max_prompt_tokens`.
pub(super) fn decode_prompt<'a>(f: &PromptFields<'a>, max_tokens: u32) -> Result<Option<Prompt<'a>>, WireError> {
    let (lora, salt) = (opt_str("lora", f.lora)?, opt_str("salt", f.salt)?);
    match (&f.tokens, &f.block_keys) {
        (None, None) if lora.is_some() || salt.is_some() => Err(bad("`lora` and `salt` go with `tokens`")),
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(bad("send `tokens` or `block_keys`, not both")),
        (Some(tokens), None) => {
            let (array, count) = tokens.clone()?;
            let count = check_count(ArrayKind::Tokens, count, max_tokens)?;
            Ok(Some(Prompt::Tokens { array, count, lora, salt }))
        }
        (None, Some(_)) if lora.is_some() || salt.is_some() => {
            Err(bad("`lora` and `salt` are already in `block_keys`; send them only with `tokens`"))
        }
        (None, Some(keys)) => {
            let (array, count) = keys.clone()?;
            let count = check_count(ArrayKind::Keys, count, (max_tokens / TOKENS_PER_KEY).max(1))?;
            Ok(Some(Prompt::Keys { array, count }))
        }
    }
}
