//! The engines' KV-cache event stream (vLLM `--kv-events-config`, SGLang's
//! KV event publisher), decoded into [`KvMessage`]s (docs/PROTOCOL.md §11a).
//!
//! A live message is `[topic, seq (8 bytes BE), payload]`; a replayed one
//! arrives on a DEALER as `["", topic, seq, payload]`, and the replay ends
//! with `["", "", ff*8, ""]`. The payload is a `KVEventBatch`: an array
//! `[ts, events, dp_rank]` or a map; each event a map tagged by `type` or a
//! tagged array. Unknown fields are skipped; nothing here allocates beyond
//! what the payload's own bytes hold.

use super::msgpack::{ReadError, Reader, Value};
use crate::engines::kv::{KvBatch, KvBody, KvEvent, KvMessage, Medium, Stored};

/// The replay socket's end-of-replay `seq` (-1 as 8 bytes).
const END_SEQ: [u8; 8] = [0xff; 8];

/// Why the frames of a KV message are not a KV message at all (a payload
/// that does not decode is still a numbered batch: see [`KvBody::Batch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum KvFrameError {
    #[error("KV events: the seq frame is {0} bytes, not 8")]
    SeqBytes(usize),
    #[error("KV events: a replayed message must start with an empty frame")]
    Delimiter,
    #[error("KV events: a message of this source is {want} frames, got {got}")]
    Frames { got: usize, want: usize },
    #[error("KV events: the topic is not valid UTF-8")]
    Topic,
}

fn seq_of(frame: &[u8]) -> Result<[u8; 8], KvFrameError> {
    frame.try_into().map_err(|_| KvFrameError::SeqBytes(frame.len()))
}

/// Decodes one message of KV publisher `stream`: live frames are
/// `[topic, seq, payload]`, replayed ones carry an empty delimiter first.
pub fn decode_kv_message<F: std::ops::Deref<Target = [u8]>>(
    stream: u16,
    from_replay: bool,
    frames: &[F],
    max_payload: usize,
) -> Result<KvMessage, KvFrameError> {
    let frames = match (from_replay, frames) {
        (false, f) => f,
        (true, [delim, rest @ ..]) if delim.is_empty() => rest,
        (true, [_, ..]) => return Err(KvFrameError::Delimiter),
        (true, []) => return Err(KvFrameError::Frames { got: 0, want: 4 }),
    };
    let [topic, seq, payload] = frames else {
        return Err(KvFrameError::Frames {
            got: frames.len() + usize::from(from_replay),
            want: 3 + usize::from(from_replay),
        });
    };
    std::str::from_utf8(topic).map_err(|_| KvFrameError::Topic)?;
    let seq = seq_of(seq)?;
    let body = if from_replay && seq == END_SEQ && topic.is_empty() {
        KvBody::ReplayEnd
    } else {
        let batch = if payload.len() > max_payload {
            Err(format!("KV events: a batch of {} bytes, above kv_events.max_batch_bytes {max_payload}", payload.len()))
        } else {
            decode_batch(payload).map_err(|e| format!("KV events: {e}"))
        };
        KvBody::Batch { seq: u64::from_be_bytes(seq), batch }
    };
    Ok(KvMessage { stream, from_replay, body })
}

/// Why a `KVEventBatch` payload was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    #[error("not valid MessagePack: {0}")]
    Msgpack(#[from] ReadError),
    #[error("`{field}` must be {want}, got {got}")]
    Field { field: &'static str, want: &'static str, got: &'static str },
    #[error("an event's type {0:?} is none of BlockStored, BlockRemoved, AllBlocksCleared")]
    Tag(String),
    #[error("an event has no `type`")]
    NoTag,
    #[error("the batch has no `events`")]
    NoEvents,
    #[error("medium {0:?} is none of GPU, CPU, CPU_PINNED, STORAGE, DISK, EXTERNAL")]
    Medium(String),
    #[error("a BlockStored event lacks `{0}`")]
    Missing(&'static str),
    #[error("trailing bytes after the batch")]
    Trailing,
}

fn field(field: &'static str, want: &'static str, got: Value<'_>) -> BatchError {
    BatchError::Field { field, want, got: got.type_name() }
}

/// A `KVEventBatch` payload.
pub fn decode_batch(payload: &[u8]) -> Result<KvBatch, BatchError> {
    let mut r = Reader::new(payload);
    let mut rank = None;
    let mut events = None;
    match r.read()? {
        Value::Array(n) => {
            for i in 0..n {
                let v = r.read()?;
                match i {
                    1 => events = Some(read_events(&mut r, v)?),
                    2 => rank = read_rank(v)?,
                    _ => r.skip_rest(v)?,
                }
            }
        }
        Value::Map(n) => {
            for _ in 0..n {
                let k = r.read()?;
                let v = r.read()?;
                match k {
                    Value::Str("events") => events = Some(read_events(&mut r, v)?),
                    Value::Str("data_parallel_rank" | "attn_dp_rank" | "dp_rank") => rank = read_rank(v)?,
                    _ => r.skip_rest(v)?,
                }
            }
        }
        other => return Err(field("KVEventBatch", "an array or a map", other)),
    }
    if !r.at_end() {
        return Err(BatchError::Trailing);
    }
    Ok(KvBatch { rank, events: events.ok_or(BatchError::NoEvents)? })
}

fn read_rank(v: Value<'_>) -> Result<Option<u32>, BatchError> {
    match v {
        Value::Nil => Ok(None),
        Value::Int(n) => u32::try_from(n).map(Some).map_err(|_| field("dp_rank", "a rank (0..2^32)", v)),
        other => Err(field("dp_rank", "an integer or nil", other)),
    }
}

fn read_events(r: &mut Reader<'_>, v: Value<'_>) -> Result<Vec<KvEvent>, BatchError> {
    let Value::Array(n) = v else { return Err(field("events", "an array", v)) };
    // Each event takes at least one byte, so `n` is bounded by the payload.
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(read_event(r)?);
    }
    Ok(out)
}

/// The fields of one event, in whichever shape it came.
#[derive(Default)]
struct Fields<'a> {
    tag: Option<&'a str>,
    hashes: Option<Vec<u64>>,
    parent: Option<u64>,
    tokens: Option<Vec<u32>>,
    block_size: Option<u32>,
    medium: Option<&'a str>,
    lora: Option<&'a str>,
    salt: Option<&'a str>,
    first_extra: Vec<&'a str>,
    /// The strings of later blocks' extra keys, with their block.
    later_extra: Vec<(usize, &'a str)>,
    /// The first block whose extra keys hold a value other than a string
    /// (a multimodal `(identifier, offset)` pair, a prompt-embeddings digest).
    opaque_extra: Option<usize>,
    /// `lookahead_token_ids` named tokens beyond the blocks.
    lookahead: bool,
    /// `token_ids` held token pairs (SGLang's EAGLE bigram pages).
    paired_tokens: bool,
    /// `group_idx`, 0 when absent or nil; above `u32::MAX` it saturates (a
    /// group the index cannot represent either way).
    group: u32,
    /// `group_idx` was neither nil nor a non-negative integer.
    bad_group: bool,
}

/// Positional field names of the tagged-array form, after the tag.
const STORED_ORDER: [&str; 8] =
    ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys"];
const REMOVED_ORDER: [&str; 2] = ["block_hashes", "medium"];

fn read_event<'a>(r: &mut Reader<'a>) -> Result<KvEvent, BatchError> {
    let mut f = Fields::default();
    match r.read()? {
        Value::Map(n) => {
            for _ in 0..n {
                let k = r.read()?;
                let v = r.read()?;
                match k {
                    Value::Str("type") => f.tag = Some(str_of("type", v)?),
                    Value::Str(name) => read_field(r, &mut f, name, v)?,
                    _ => r.skip_rest(v)?,
                }
            }
        }
        Value::Array(n) if n > 0 => {
            let tag = str_of("type", r.read()?)?;
            f.tag = Some(tag);
            let order: &[&str] = match tag {
                "BlockStored" => &STORED_ORDER,
                "BlockRemoved" => &REMOVED_ORDER,
                _ => &[],
            };
            for i in 1..n as usize {
                let v = r.read()?;
                match order.get(i - 1) {
                    Some(name) => read_field(r, &mut f, name, v)?,
                    None => r.skip_rest(v)?,
                }
            }
        }
        other => return Err(field("event", "a map or a tagged array", other)),
    }
    let medium = Medium::parse(f.medium).ok_or_else(|| BatchError::Medium(f.medium.unwrap_or("").to_owned()))?;
    let tag = f.tag.ok_or(BatchError::NoTag)?;
    if f.bad_group && tag != "AllBlocksCleared" {
        return Ok(KvEvent::Unindexable(BAD_GROUP));
    }
    if f.paired_tokens && tag == "BlockStored" {
        return Ok(KvEvent::Unindexable("token pairs (EAGLE bigram pages) are not keyed"));
    }
    match tag {
        "BlockStored" => {
            // vLLM's salt is the first string of the first block's extra keys
            // that is not the LoRA name; SGLang sends `cache_salt`.
            let from_extra = || {
                let mut strs = f.first_extra.iter().copied().peekable();
                if f.lora.is_some() && strs.peek().copied() == f.lora {
                    strs.next();
                }
                strs.next()
            };
            let salt = f.salt.or_else(|| if f.parent.is_none() { from_extra() } else { None });
            let unmatchable = unmatchable(&f, salt);
            Ok(KvEvent::Stored(Stored {
                hashes: f.hashes.ok_or(BatchError::Missing("block_hashes"))?,
                parent: f.parent,
                tokens: f.tokens.ok_or(BatchError::Missing("token_ids"))?,
                block_size: f.block_size.ok_or(BatchError::Missing("block_size"))?,
                medium,
                lora: f.lora.map(str::to_owned),
                salt: salt.map(str::to_owned),
                unmatchable,
                group: f.group,
            }))
        }
        "BlockRemoved" => Ok(KvEvent::Removed { hashes: f.hashes.unwrap_or_default(), medium, group: f.group }),
        "AllBlocksCleared" => Ok(KvEvent::Cleared),
        other => Err(BatchError::Tag(other.to_owned())),
    }
}

/// Why blocks of a `BlockStored` are not keyed by its tokens, LoRA name and
/// salt alone (docs/prefix-cache.md, "Unmatchable blocks").
pub const LOOKAHEAD: &str = "the engine's hash covers lookahead tokens (speculative decoding)";
pub const OPAQUE_EXTRA: &str = "the engine's hash covers multimodal inputs or prompt embeddings";
/// Why an event is not applied: its `group_idx` is malformed.
pub const BAD_GROUP: &str = "group_idx is not a non-negative integer";
pub const UNKNOWN_EXTRA: &str = "the engine's hash covers an extra key other than the LoRA name and salt";

/// The first block, if any, whose identity the event's tokens, LoRA name
/// and salt do not carry, with why. vLLM lists per block the LoRA name,
/// then multimodal pairs, then (first block of a chain only) the salt,
/// then prompt-embedding digests; anything else is unknown and kept out too.
fn unmatchable(f: &Fields<'_>, salt: Option<&str>) -> Option<(usize, &'static str)> {
    if f.lookahead {
        return Some((0, LOOKAHEAD));
    }
    let mut first = f.opaque_extra.map(|b| (b, OPAQUE_EXTRA));
    let mut take = |b: usize| {
        if !matches!(first, Some((at, _)) if at <= b) {
            first = Some((b, UNKNOWN_EXTRA));
        }
    };
    let mut strs = f.first_extra.iter().copied().peekable();
    if f.lora.is_some() && strs.peek().copied() == f.lora {
        strs.next();
    }
    if f.parent.is_none() && f.salt.is_none() && strs.peek().copied() == salt {
        strs.next();
    }
    if strs.next().is_some() {
        take(0);
    }
    if let Some(&(b, _)) = f.later_extra.iter().find(|&&(_, s)| Some(s) != f.lora) {
        take(b);
    }
    first
}

fn str_of<'a>(name: &'static str, v: Value<'a>) -> Result<&'a str, BatchError> {
    match v {
        Value::Str(s) => Ok(s),
        other => Err(field(name, "a string", other)),
    }
}

fn opt_str<'a>(name: &'static str, v: Value<'a>) -> Result<Option<&'a str>, BatchError> {
    match v {
        Value::Nil => Ok(None),
        other => str_of(name, other).map(Some),
    }
}

/// An engine block hash: an unsigned or signed 64-bit integer, or bytes
/// (vLLM's raw hash), of which the last 8 are kept, as vLLM's integer form does.
fn hash_of(v: Value<'_>) -> Result<u64, BatchError> {
    match v {
        Value::Int(n) if n >= i128::from(i64::MIN) && n <= i128::from(u64::MAX) => Ok(n as u64),
        Value::Bin(b) if !b.is_empty() => {
            let tail = &b[b.len().saturating_sub(8)..];
            Ok(tail.iter().fold(0u64, |acc, &x| (acc << 8) | u64::from(x)))
        }
        other => Err(field("block hash", "a 64-bit integer or bytes", other)),
    }
}

fn read_field<'a>(r: &mut Reader<'a>, f: &mut Fields<'a>, name: &str, v: Value<'a>) -> Result<(), BatchError> {
    match name {
        "block_hashes" => {
            let Value::Array(n) = v else { return Err(field("block_hashes", "an array", v)) };
            let mut hashes = Vec::with_capacity(r.room_for(n));
            for _ in 0..n {
                hashes.push(hash_of(r.read()?)?);
            }
            f.hashes = Some(hashes);
        }
        "parent_block_hash" => f.parent = if v == Value::Nil { None } else { Some(hash_of(v)?) },
        "token_ids" => {
            let Value::Array(n) = v else { return Err(field("token_ids", "an array", v)) };
            let mut tokens = Vec::with_capacity(r.room_for(n));
            let mut i = 0;
            while i < n {
                // The common case in bulk, then one element the general way.
                i += r.small_uints_into(n - i, &mut tokens);
                if i == n {
                    break;
                }
                i += 1;
                match r.small_uint() {
                    Some(t) => tokens.push(t),
                    // Not a u32 in any width: a u64 or i64 that is one, a
                    // token pair (skipped: the event is not indexed), or an error.
                    None => match r.read()? {
                        Value::Int(t) if (0..=i128::from(u32::MAX)).contains(&t) => tokens.push(t as u32),
                        pair @ Value::Array(_) => {
                            r.skip_rest(pair)?;
                            f.paired_tokens = true;
                        }
                        other => return Err(field("token_ids", "token ids in 0..2^32", other)),
                    },
                }
            }
            f.tokens = Some(tokens);
        }
        "block_size" => match v {
            Value::Int(n) if (1..=i128::from(u32::MAX)).contains(&n) => f.block_size = Some(n as u32),
            other => return Err(field("block_size", "a positive integer", other)),
        },
        "medium" => f.medium = opt_str("medium", v)?,
        "lora_name" => f.lora = opt_str("lora_name", v)?,
        "cache_salt" => f.salt = opt_str("cache_salt", v)?,
        "extra_keys" => read_extra(r, f, v)?,
        "lookahead_token_ids" => read_lookahead(r, f, v)?,
        "group_idx" => match v {
            Value::Nil => f.group = 0,
            Value::Int(g) if g >= 0 => f.group = u32::try_from(g).unwrap_or(u32::MAX),
            other => {
                r.skip_rest(other)?;
                f.bad_group = true;
            }
        },
        _ => r.skip_rest(v)?,
    }
    Ok(())
}

/// The extra keys of every block: the strings (LoRA name, cache salt) of
/// the first block and of the later ones, and the first block with
/// anything else in them.
fn read_extra<'a>(r: &mut Reader<'a>, f: &mut Fields<'a>, v: Value<'a>) -> Result<(), BatchError> {
    let Value::Array(blocks) = v else { return r.skip_rest(v).map_err(Into::into) };
    for b in 0..blocks as usize {
        match r.read()? {
            Value::Array(n) => {
                for _ in 0..n {
                    match r.read()? {
                        Value::Str(s) if b == 0 => f.first_extra.push(s),
                        Value::Str(s) => f.later_extra.push((b, s)),
                        other => {
                            r.skip_rest(other)?;
                            f.opaque_extra = Some(f.opaque_extra.map_or(b, |o| o.min(b)));
                        }
                    }
                }
            }
            Value::Nil => {}
            other => {
                r.skip_rest(other)?;
                f.opaque_extra = Some(f.opaque_extra.map_or(b, |o| o.min(b)));
            }
        }
    }
    Ok(())
}

/// `lookahead_token_ids`: nil, or per block the tokens after it that the
/// engine's hash covers; any token at all makes the event unmatchable.
fn read_lookahead<'a>(r: &mut Reader<'a>, f: &mut Fields<'a>, v: Value<'a>) -> Result<(), BatchError> {
    let Value::Array(blocks) = v else { return r.skip_rest(v).map_err(Into::into) };
    for _ in 0..blocks {
        match r.read()? {
            Value::Array(0) | Value::Nil => {}
            other => {
                r.skip_rest(other)?;
                f.lookahead = true;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
