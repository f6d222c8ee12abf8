//! Encoding of replies. Each function clears `out` and writes one MessagePack
//! map into it, so the caller can reuse one buffer for every reply.

use serde::Serialize;

use super::{Id, WireError};
use crate::engines::Counts;

const V: u8 = 1;
/// The longest error message a refusal carries, in bytes (longer ones are
/// cut at a character boundary): with the id's cap, it bounds every refusal.
pub const MAX_ERROR_MESSAGE_BYTES: usize = 512;

/// This process's identity, random at each start: `ping` and `state` carry
/// it (as 16 hex digits), so a client tells a restarted dpcoord from one
/// whose engines all went down.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Instance(pub u64);

crate::names! {
    /// Where the rank count in force came from, as the `resize` and `reload`
    /// replies say it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum DpSizeFrom {
        /// `engines.dp_size` of the configuration (the file with the flags).
        File => "file",
        /// A `resize` op; reloads keep it until the configuration's
        /// `engines.dp_size` changes.
        Resize => "resize",
    }
}

impl Serialize for DpSizeFrom {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl Instance {
    /// A fresh instance id. std's `RandomState` is keyed from the operating
    /// system's randomness once per process; the time and process id are
    /// hashed in too, so two starts never share one in practice.
    pub fn random() -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        h.write_u128(since.as_nanos());
        Instance(h.finish())
    }
}

impl Serialize for Instance {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // A string: JSON readers (and /state) lose precision on 64-bit integers.
        let mut digits = [0u8; 16];
        for (i, d) in digits.iter_mut().enumerate() {
            *d = b"0123456789abcdef"[((self.0 >> (60 - 4 * i)) & 0xf) as usize];
        }
        s.serialize_str(std::str::from_utf8(&digits).unwrap_or_default())
    }
}

#[derive(Serialize)]
struct Ranks<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    ranks: &'a [u32],
    epoch: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    explain: Option<Explain<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fallbacks: Option<&'a [u32]>,
}

crate::names! {
    /// Where a rank's predicted prefix came from.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum PrefixSource {
        /// The rank's KV events.
        Events => "events",
        /// dpcoord's own placements.
        Approximate => "approximate",
        /// An events-only rank whose index is degraded: no credit.
        Degraded => "degraded",
    }
}

impl Serialize for PrefixSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// One rank a route placed on, in its `explain`: the prompt tokens
/// predicted cached there, and where the prediction came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Chosen {
    pub rank: u32,
    pub predicted: u64,
    pub index: PrefixSource,
}

/// A route reply's `explain`: the most any rank was predicted to hold,
/// whether the balance guard set the prefix aside (sent only when it did),
/// each distinct rank placed on, in order of first placement, and the
/// block size the prompt was keyed in (what a caller's `block_keys` use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Explain<'a> {
    pub best: u64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub guarded: bool,
    pub chosen: &'a [Chosen],
    pub block_size: u32,
}

#[derive(Serialize)]
struct HealthRank<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    rank: u32,
    epoch: u64,
}

#[derive(Serialize)]
struct Resized<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    dp_size: u32,
    dp_size_from: DpSizeFrom,
    epoch: u64,
}

#[derive(Serialize)]
struct Ok<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    epoch: Option<u64>,
}

#[derive(Serialize)]
struct Ping<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    epoch: u64,
    instance: Instance,
    block_size: u32,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    code: &'static str,
    message: &'a str,
}

#[derive(Serialize)]
struct Error<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    epoch: Option<u64>,
    error: ErrorBody<'a>,
}

/// One rank in a `state` reply (and in `/state`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankView {
    pub rank: u32,
    pub status: &'static str,
    /// Why a `stalled` rank is: `progress` or `probe`; nil otherwise.
    pub stall: Option<&'static str>,
    pub counts: Counts,
    pub pending: u64,
    pub routed: u64,
    pub penalty: f64,
    /// Milliseconds since the last valid update; nil while `unknown`.
    pub age_ms: Option<u64>,
    pub boot: Option<u64>,
    /// The active policy's load estimate for this rank.
    pub load: f64,
    /// KV blocks indexed, by medium (only media with blocks).
    pub kv_blocks: std::collections::BTreeMap<&'static str, u64>,
    /// The block size this rank's KV events use; nil until it stores one.
    pub kv_block_size: Option<u32>,
    /// Whether this rank's KV-event index is `exact` or `degraded`; nil
    /// until its publisher sends a batch.
    pub kv_index: Option<&'static str>,
    /// The KV-cache usage (0..=1) of the last accepted update; nil when it
    /// carried none.
    pub kv_usage: Option<f64>,
}

/// The engine table as the `state` op and `/state` show it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StateView {
    pub epoch: u64,
    pub instance: Instance,
    pub policy: &'static str,
    pub ranks: Vec<RankView>,
    /// The KV block size most ranks use (prompts are keyed with it); nil
    /// until a rank stores a block.
    pub kv_block_size: Option<u32>,
}

#[derive(Serialize)]
struct State<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    epoch: u64,
    instance: Instance,
    policy: &'static str,
    ranks: &'a [RankView],
    kv_block_size: Option<u32>,
}

#[derive(Serialize)]
struct Prefix<'a> {
    v: u8,
    ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<Id<'a>>,
    blocks: usize,
    matched: &'a [u32],
}

fn write<T: Serialize>(out: &mut Vec<u8>, value: &T) {
    out.clear();
    // Writing plain structs of strings and numbers into a Vec cannot fail.
    if let Err(e) = rmp_serde::encode::write_named(out, value) {
        unreachable!("encoding a reply into memory failed: {e}");
    }
}

/// `{"v":1,"ok":true,"id":..,"ranks":[..],"epoch":E}`, with `"explain"`
/// and `"fallbacks"` when given.
pub fn encode_ranks(
    out: &mut Vec<u8>,
    id: Option<Id<'_>>,
    ranks: &[u32],
    epoch: u64,
    explain: Option<Explain<'_>>,
    fallbacks: Option<&[u32]>,
) {
    write(out, &Ranks { v: V, ok: true, id, ranks, epoch, explain, fallbacks });
}

/// `{"v":1,"ok":true,"id":..,"rank":r,"epoch":E}`.
pub fn encode_health_rank(out: &mut Vec<u8>, id: Option<Id<'_>>, rank: u32, epoch: u64) {
    write(out, &HealthRank { v: V, ok: true, id, rank, epoch });
}

/// `{"v":1,"ok":true,"id":..,"dp_size":N,"dp_size_from":F,"epoch":E}`
/// (resize, reload).
pub fn encode_admin(out: &mut Vec<u8>, id: Option<Id<'_>>, dp_size: u32, dp_size_from: DpSizeFrom, epoch: u64) {
    write(out, &Resized { v: V, ok: true, id, dp_size, dp_size_from, epoch });
}

/// `{"v":1,"ok":true,"id":..}`, with `epoch` when given.
pub fn encode_ok(out: &mut Vec<u8>, id: Option<Id<'_>>, epoch: Option<u64>) {
    write(out, &Ok { v: V, ok: true, id, epoch });
}

/// `{"v":1,"ok":true,"id":..,"epoch":E,"instance":I,"block_size":B}`
/// (ping; `B`: the block size prompts are keyed in now).
pub fn encode_ping(out: &mut Vec<u8>, id: Option<Id<'_>>, epoch: u64, instance: Instance, block_size: u32) {
    write(out, &Ping { v: V, ok: true, id, epoch, instance, block_size });
}

/// `{"v":1,"ok":false,"id":..,"epoch":E,"error":{"code":C,"message":M}}`;
/// a message above [`MAX_ERROR_MESSAGE_BYTES`] is cut.
pub fn encode_error(out: &mut Vec<u8>, id: Option<Id<'_>>, epoch: Option<u64>, err: &WireError) {
    let mut message = err.message.as_str();
    if message.len() > MAX_ERROR_MESSAGE_BYTES {
        let end = (0..=MAX_ERROR_MESSAGE_BYTES).rev().find(|&i| message.is_char_boundary(i)).unwrap_or(0);
        message = &message[..end];
    }
    let error = ErrorBody { code: err.code.as_str(), message };
    write(out, &Error { v: V, ok: false, id, epoch, error });
}

/// The `state` reply.
pub fn encode_state(out: &mut Vec<u8>, id: Option<Id<'_>>, view: &StateView) {
    let (epoch, instance, policy, ranks) = (view.epoch, view.instance, view.policy, &view.ranks);
    write(out, &State { v: V, ok: true, id, epoch, instance, policy, ranks, kv_block_size: view.kv_block_size });
}

/// `{"v":1,"ok":true,"id":..,"blocks":B,"matched":[..]}` (the `prefix` op).
pub fn encode_prefix(out: &mut Vec<u8>, id: Option<Id<'_>>, blocks: usize, matched: &[u32]) {
    write(out, &Prefix { v: V, ok: true, id, blocks, matched });
}

#[cfg(test)]
mod tests {
    use super::super::ErrorCode;
    use super::*;

    fn decode(b: &[u8]) -> serde_json::Value {
        rmp_serde::from_slice(b).unwrap()
    }

    #[test]
    fn replies_have_the_contract_shape() {
        let mut out = Vec::new();
        encode_ranks(&mut out, Some(Id::Str("a")), &[1, 2], 7, None, None);
        assert_eq!(decode(&out), serde_json::json!({"v":1,"ok":true,"id":"a","ranks":[1,2],"epoch":7}));
        let chosen = [
            Chosen { rank: 1, predicted: 32, index: PrefixSource::Events },
            Chosen { rank: 2, predicted: 0, index: PrefixSource::Approximate },
        ];
        encode_ranks(
            &mut out,
            None,
            &[1, 2, 1],
            7,
            Some(Explain { best: 48, guarded: false, chosen: &chosen, block_size: 16 }),
            None,
        );
        assert_eq!(
            decode(&out),
            serde_json::json!({"v":1,"ok":true,"ranks":[1,2,1],"epoch":7,"explain":{"best":48,"chosen":[
                {"rank":1,"predicted":32,"index":"events"},{"rank":2,"predicted":0,"index":"approximate"}],"block_size":16}})
        );
        encode_health_rank(&mut out, None, 3, 2);
        assert_eq!(decode(&out), serde_json::json!({"v":1,"ok":true,"rank":3,"epoch":2}));
        encode_ok(&mut out, Some(Id::Int(-4)), Some(1));
        assert_eq!(decode(&out), serde_json::json!({"v":1,"ok":true,"id":-4,"epoch":1}));
        encode_admin(&mut out, Some(Id::Int(9)), 12, DpSizeFrom::Resize, 4);
        let resized = serde_json::json!({"v":1,"ok":true,"id":9,"dp_size":12,"dp_size_from":"resize","epoch":4});
        assert_eq!(decode(&out), resized);
        encode_ok(&mut out, None, None);
        assert_eq!(decode(&out), serde_json::json!({"v":1,"ok":true}));
        encode_prefix(&mut out, Some(Id::Int(1)), 3, &[3, 0]);
        assert_eq!(decode(&out), serde_json::json!({"v":1,"ok":true,"id":1,"blocks":3,"matched":[3,0]}));
        encode_error(&mut out, Some(Id::UInt(u64::MAX)), Some(3), &WireError::new(ErrorCode::TooLarge, "big"));
        assert_eq!(
            decode(&out),
            serde_json::json!({"v":1,"ok":false,"id":u64::MAX,"epoch":3,"error":{"code":"too_large","message":"big"}})
        );
        encode_ping(&mut out, Some(Id::Str("p")), 2, Instance(0x0123_4567_89ab_cdef), 64);
        let ping =
            serde_json::json!({"v":1,"ok":true,"id":"p","epoch":2,"instance":"0123456789abcdef","block_size":64});
        assert_eq!(decode(&out), ping);
    }

    #[test]
    fn a_long_error_message_is_cut_at_a_character_boundary() {
        let mut out = Vec::new();
        let long = "é".repeat(MAX_ERROR_MESSAGE_BYTES);
        encode_error(&mut out, None, None, &WireError::new(ErrorCode::BadRequest, long));
        let message = decode(&out)["error"]["message"].as_str().unwrap().to_owned();
        assert_eq!(message, "é".repeat(MAX_ERROR_MESSAGE_BYTES / 2));
    }

    #[test]
    fn instances_differ_between_calls() {
        assert_ne!(Instance::random(), Instance::random());
    }
}
