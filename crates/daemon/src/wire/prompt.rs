//! A query's prompt (docs/PROTOCOL.md §4, §11a): token ids, or the chained
//! block keys a client computed, with the LoRA name and salt that seed a
//! token chain. Checked once when the query is decoded: token ids are read
//! into the caller's buffer in that same pass (so the array is walked
//! once), block keys are kept as the MessagePack array they came in.

use super::msgpack::{ReadError, Reader, Value};
use super::{ErrorCode, WireError};

/// Block keys per token of `limits.max_prompt_tokens` (a key covers at
/// least one block, and blocks are at least this many tokens in practice).
pub const TOKENS_PER_KEY: u32 = 16;

/// A checked prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Prompt<'a> {
    Tokens { tokens: &'a [u32], lora: Option<&'a str>, salt: Option<&'a str> },
    Keys { array: &'a [u8], count: u32 },
}

impl Prompt<'_> {
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
/// Token ids go into `tokens` (emptied first), up to `max_tokens` of them:
/// an array longer than that is refused by its count.
pub(super) fn scan_array<'a>(
    r: &mut Reader<'a>,
    first: Value<'a>,
    kind: ArrayKind,
    tokens: &mut Vec<u32>,
    max_tokens: u32,
) -> Result<Result<u32, WireError>, ReadError> {
    let Value::Array(n) = first else {
        r.skip_rest(first)?;
        return Ok(Err(bad(format!("`{}` must be an array, got {}", kind.name(), first.type_name()))));
    };
    let keep = if kind == ArrayKind::Tokens { n.min(max_tokens) } else { 0 };
    tokens.clear();
    let mut i = 0;
    while i < n {
        if kind == ArrayKind::Tokens {
            // The common case, in bulk: kept up to `keep`, then only checked.
            if i < keep {
                i += r.small_uints_into(keep - i, tokens);
            }
            if i >= keep {
                i += r.small_uints(n - i, |_| ());
            }
            if i == n {
                break;
            }
        }
        // One element the general way: an unsigned int without building a `Value`.
        let at = i;
        i += 1;
        let wrong = match r.uint64() {
            Some(v) if kind == ArrayKind::Keys || v <= u64::from(u32::MAX) => {
                if at < keep {
                    tokens.push(v as u32);
                }
                continue;
            }
            Some(v) => v.to_string(),
            None => match r.read()? {
                // A non-negative int in a signed encoding.
                Value::Int(t) if t >= 0 && (kind == ArrayKind::Keys || t <= i128::from(u32::MAX)) => {
                    if at < keep {
                        tokens.push(t as u32);
                    }
                    continue;
                }
                Value::Int(t) => t.to_string(),
                other => {
                    r.skip_rest(other)?;
                    other.type_name().to_owned()
                }
            },
        };
        // Skip what is left of the array, then report the first bad element.
        for _ in i..n {
            let v = r.read()?;
            r.skip_rest(v)?;
        }
        return Ok(Err(bad(format!("`{}[{at}]` must be {}, got {wrong}", kind.name(), kind.what()))));
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
    /// The token ids' count (the ids are in the decoder's buffer).
    pub tokens: Option<Result<u32, WireError>>,
    pub block_keys: Option<Scanned<'a>>,
    pub lora: Option<Value<'a>>,
    pub salt: Option<Value<'a>>,
}

/// The prompt of a query, if it has one; `max_tokens` is
/// `limits.max_prompt_tokens`, `tokens` the ids `scan_array` read.
pub(super) fn decode_prompt<'a>(
    f: &PromptFields<'a>,
    max_tokens: u32,
    tokens: &'a [u32],
) -> Result<Option<Prompt<'a>>, WireError> {
    let (lora, salt) = (opt_str("lora", f.lora)?, opt_str("salt", f.salt)?);
    match (&f.tokens, &f.block_keys) {
        (None, None) if lora.is_some() || salt.is_some() => Err(bad("`lora` and `salt` go with `tokens`")),
        (None, None) => Ok(None),
        (Some(_), Some(_)) => Err(bad("send `tokens` or `block_keys`, not both")),
        (Some(count), None) => {
            check_count(ArrayKind::Tokens, count.clone()?, max_tokens)?;
            Ok(Some(Prompt::Tokens { tokens, lora, salt }))
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
