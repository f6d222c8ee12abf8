//! SGLang's scheduler load stream (`--load-publish-endpoint`), decoded into
//! a gauge-only load report.
//!
//! One PUB per scheduler; a message is three frames: the topic `load`, the
//! publisher's sequence number (8 bytes, big-endian, from 0 per process),
//! and a MessagePack array `["LoadStat", num_running_reqs,
//! num_waiting_reqs, num_tokens, max_total_num_tokens, attn_dp_rank,
//! num_waiting_uncached_tokens, num_total_tokens, ...]` (msgspec's tagged
//! array form; fields after the eighth are ignored, and a shorter array
//! than eight is SGLang's older six-field prefix). An unchanged stat is
//! re-sent at most every second: that is the source's heartbeat.

use std::fmt;
use std::time::Duration;

use super::msgpack::{ReadError, Reader, Value};
use crate::engines::{Counts, LoadReport, Sequence, TokenLoad};

/// SGLang's `LOAD_PUBLISH_HEARTBEAT_S`.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// Fields up to `attn_dp_rank`: what every version sends.
const PREFIX: u32 = 6;

/// Why a load message could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SglangError {
    Topic,
    SeqBytes(usize),
    NegativeSeq(i64),
    Msgpack(ReadError),
    NotArray(&'static str),
    Short(u32),
    Tag,
    /// Field `name` holds no non-negative integer.
    Field {
        name: &'static str,
        got: &'static str,
    },
    NoRank,
    Trailing,
}

impl fmt::Display for SglangError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            SglangError::Topic => write!(f, "SGLang load: the topic frame is not `load`"),
            SglangError::SeqBytes(n) => write!(f, "SGLang load: the seq frame is {n} bytes, not 8"),
            SglangError::NegativeSeq(s) => write!(f, "SGLang load: negative seq {s}"),
            SglangError::Msgpack(e) => write!(f, "SGLang load: not valid MessagePack: {e}"),
            SglangError::NotArray(got) => write!(f, "SGLang load: the payload must be an array, got {got}"),
            SglangError::Short(n) => write!(f, "SGLang load: LoadStat has {n} fields, fewer than {PREFIX}"),
            SglangError::Tag => write!(f, "SGLang load: the payload is not tagged \"LoadStat\""),
            SglangError::Field { name, got } => {
                write!(f, "SGLang load: `{name}` must be a non-negative integer, got {got}")
            }
            SglangError::NoRank => write!(f, "SGLang load: `attn_dp_rank` is nil; dpcoord needs the rank"),
            SglangError::Trailing => write!(f, "SGLang load: trailing bytes after the LoadStat array"),
        }
    }
}

impl From<ReadError> for SglangError {
    fn from(e: ReadError) -> Self {
        SglangError::Msgpack(e)
    }
}

const NAMES: [&str; 10] = [
    "num_running_reqs",
    "num_waiting_reqs",
    "num_tokens",
    "max_total_num_tokens",
    "attn_dp_rank",
    "num_waiting_uncached_tokens",
    "num_total_tokens",
    "max_running_requests",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
];

/// The six counts dpcoord reads (`num_running_reqs` to `num_total_tokens`
/// without `attn_dp_rank`; `None` where the array is shorter) and the rank.
type Fields = ([Option<u64>; 6], i128);

/// Reads the tagged array: the fields up to `num_total_tokens` are checked,
/// later ones skipped.
fn fields(payload: &[u8]) -> Result<Fields, SglangError> {
    let mut r = Reader::new(payload);
    let len = match r.read()? {
        Value::Array(n) => n,
        other => return Err(SglangError::NotArray(other.type_name())),
    };
    if len < PREFIX {
        return Err(SglangError::Short(len.saturating_sub(1)));
    }
    if r.read()? != Value::Str("LoadStat") {
        return Err(SglangError::Tag);
    }
    let mut got = [None; 6];
    let mut rank = None;
    for i in 0..(len - 1) as usize {
        let v = r.read()?;
        let name = NAMES.get(i).copied().unwrap_or("");
        match (i, v) {
            (4, Value::Int(n)) => rank = Some(n),
            (4, Value::Nil) => return Err(SglangError::NoRank),
            (0..=6, Value::Int(n)) if n >= 0 => got[if i < 4 { i } else { i - 1 }] = Some(n as u64),
            (0..=6, other) => return Err(SglangError::Field { name, got: other.type_name() }),
            _ => r.skip_rest(v)?,
        }
    }
    if !r.at_end() {
        return Err(SglangError::Trailing);
    }
    Ok((got, rank.ok_or(SglangError::NoRank)?))
}

/// Decodes one load message (its three frames) into a report of rank `attn_dp_rank`.
pub fn decode_sglang_load(topic: &[u8], seq: &[u8], payload: &[u8]) -> Result<LoadReport, SglangError> {
    if topic != b"load" {
        return Err(SglangError::Topic);
    }
    let seq: [u8; 8] = seq.try_into().map_err(|_| SglangError::SeqBytes(seq.len()))?;
    let seq = i64::from_be_bytes(seq);
    let seq = u64::try_from(seq).map_err(|_| SglangError::NegativeSeq(seq))?;
    // `num_waiting_uncached_tokens` is checked but not used by a policy yet.
    let ([running, waiting, kv, kv_max, _uncached, total], rank) = fields(payload)?;
    let kv = kv.unwrap_or(0);
    let kv_usage = kv_max.filter(|&m| m > 0).map(|m| (kv as f64 / m as f64).min(1.0));
    // SGLang's own `total_tokens` load: KV in use plus queued (the six-field
    // prefix has no queued count, so its total is the KV in use).
    let queued = total.map_or(0, |t| t.saturating_sub(kv));
    Ok(LoadReport {
        rank,
        sequence: Sequence::Restarting { seq },
        counts: Counts { waiting: waiting.unwrap_or(0), running: running.unwrap_or(0), ..Counts::default() },
        cumulative: false,
        heartbeat: HEARTBEAT,
        tokens: Some(TokenLoad { waiting: queued, running: kv }),
        kv_usage,
        ttft_ms: None,
        tpot_ms: None,
        progress: None,
    })
}

#[cfg(test)]
mod tests;
