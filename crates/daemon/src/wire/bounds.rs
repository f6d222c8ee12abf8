//! The largest reply each query socket can send, in bytes, for the limits
//! in force: with `id` and error messages capped, only `state` and `prefix`
//! (which grow with `dp_size`) and `route` (which grows with `max_batch`,
//! and its `explain` with the distinct ranks placed on) are more than a few
//! hundred bytes. The transport sizes each socket's
//! send queue from it (docs/PROTOCOL.md §1, "Queues").

use super::query::{MAX_FALLBACKS, MAX_ID_BYTES};
use super::reply::{self, Chosen, Explain, Instance, PrefixSource, RankView, StateView, MAX_ERROR_MESSAGE_BYTES};
use super::{Channel, ErrorCode, Id, WireError};
use crate::engines::kv::Medium;
use crate::engines::Counts;

/// Bytes an array header can grow by past the lengths encoded here (a
/// fixarray is 1 byte, an array32 is 5).
const ARRAY_GROWTH: usize = 4;
/// The longest policy name, with room to spare.
const POLICY: &str = "a-policy-name-of-thirty-two-byte";

/// The longest id a query may carry.
fn longest_id() -> String {
    "i".repeat(MAX_ID_BYTES)
}

fn worst_rank() -> RankView {
    RankView {
        rank: u32::MAX,
        status: "unknown",
        stall: Some("progress"),
        counts: Counts {
            waiting: u64::MAX,
            running: u64::MAX,
            received: u64::MAX,
            finished: u64::MAX,
            failed: u64::MAX,
        },
        pending: u64::MAX,
        routed: u64::MAX,
        penalty: f64::MAX,
        age_ms: Some(u64::MAX),
        boot: Some(u64::MAX),
        load: f64::MAX,
        kv_blocks: Medium::ALL.into_iter().map(|m| (m.as_str(), u64::MAX)).collect(),
        kv_block_size: Some(u32::MAX),
        kv_index: Some("degraded"),
        // A float64 is 9 bytes whatever its value.
        kv_usage: Some(1.0),
    }
}

/// The `state` reply's size with `ranks` worst-case rank entries.
fn state_bytes(ranks: usize, id: &str) -> usize {
    let view = StateView {
        epoch: u64::MAX,
        instance: Instance(u64::MAX),
        policy: POLICY,
        ranks: vec![worst_rank(); ranks],
        kv_block_size: Some(u32::MAX),
    };
    let mut out = Vec::new();
    reply::encode_state(&mut out, Some(Id::Str(id)), &view);
    out.len()
}

/// The largest `state` reply over `dp_size` ranks, from two encodings (one
/// and two ranks), so no reply of `dp_size` entries is built.
pub fn max_state_bytes(dp_size: u32, id: &str) -> usize {
    let (one, two) = (state_bytes(1, id), state_bytes(2, id));
    let per_rank = two - one;
    one - per_rank + per_rank * dp_size as usize + ARRAY_GROWTH
}

/// The route reply's size with no rank, an `explain` of `chosen`
/// worst-case entries and the most fallbacks, each the widest rank.
fn route_bytes(chosen: usize, id: &str) -> usize {
    let longest = PrefixSource::ALL.into_iter().max_by_key(|s| s.as_str().len()).unwrap_or(PrefixSource::Approximate);
    let entries = vec![Chosen { rank: u32::MAX, predicted: u64::MAX, index: longest }; chosen];
    let mut out = Vec::new();
    reply::encode_ranks(
        &mut out,
        Some(Id::Str(id)),
        &[],
        u64::MAX,
        Some(Explain { best: u64::MAX, guarded: true, chosen: &entries, block_size: u32::MAX }),
        Some(&[u32::MAX; MAX_FALLBACKS as usize]),
    );
    out.len()
}

/// The largest route reply: `max_batch` ranks below `dp_size`, and an
/// `explain` entry for each distinct one (the `chosen` array's header
/// growth included; the caller adds the `ranks` array's).
fn max_route_bytes(dp_size: u32, max_batch: u32, id: &str) -> usize {
    let (none, one) = (route_bytes(0, id), route_bytes(1, id));
    let distinct = dp_size.min(max_batch) as usize;
    none + max_batch as usize * uint_bytes(u64::from(dp_size.saturating_sub(1)))
        + distinct * (one - none)
        + ARRAY_GROWTH
}

/// The encoded size of an unsigned integer below `max` (MessagePack's widths).
fn uint_bytes(max: u64) -> usize {
    match max {
        0..=0x7f => 1,
        0x80..=0xff => 2,
        0x100..=0xffff => 3,
        0x1_0000..=0xffff_ffff => 5,
        _ => 9,
    }
}

/// The largest refusal: the longest id, code and message.
fn max_error_bytes(id: &str) -> usize {
    let mut out = Vec::new();
    let message = "m".repeat(MAX_ERROR_MESSAGE_BYTES);
    let longest = ErrorCode::ALL.iter().max_by_key(|c| c.as_str().len()).copied().unwrap_or(ErrorCode::BadRequest);
    reply::encode_error(&mut out, Some(Id::Str(id)), Some(u64::MAX), &WireError::new(longest, message));
    out.len()
}

/// The largest reply `ch` can send with `dp_size` ranks and `max_batch`.
pub fn max_reply_bytes(ch: Channel, dp_size: u32, max_batch: u32) -> usize {
    let id = longest_id();
    let mut out = Vec::new();
    let grown = match ch {
        Channel::Route => max_route_bytes(dp_size, max_batch, &id),
        Channel::Health => {
            // A prefix reply: one count per rank, each at most 2^32.
            reply::encode_prefix(&mut out, Some(Id::Str(&id)), usize::MAX, &[]);
            out.len() + dp_size as usize * uint_bytes(u64::from(u32::MAX))
        }
    };
    // ping, health_route, health_report and the admin replies are fixed
    // maps of a few integers and the id: below a refusal's size.
    (grown + ARRAY_GROWTH).max(max_state_bytes(dp_size, &id)).max(max_error_bytes(&id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_bound_holds_for_a_real_worst_case_encoding() {
        let id = longest_id();
        for dp in [1u32, 2, 15, 16, 300] {
            assert!(state_bytes(dp as usize, &id) <= max_state_bytes(dp, &id), "dp {dp}");
            assert!(state_bytes(dp as usize, &id) + ARRAY_GROWTH >= max_state_bytes(dp, &id), "dp {dp}");
        }
    }

    #[test]
    fn route_and_prefix_bounds_hold_for_real_encodings() {
        let id = longest_id();
        let mut out = Vec::new();
        let ranks: Vec<u32> = (0..1024).collect();
        let chosen: Vec<Chosen> =
            ranks.iter().map(|&rank| Chosen { rank, predicted: u64::MAX, index: PrefixSource::Approximate }).collect();
        let explain = Explain { best: u64::MAX, guarded: true, chosen: &chosen, block_size: u32::MAX };
        let fallbacks: Vec<u32> = (1008..1024).collect();
        reply::encode_ranks(&mut out, Some(Id::Str(&id)), &ranks, u64::MAX, Some(explain), Some(&fallbacks));
        assert!(out.len() <= max_reply_bytes(Channel::Route, 1024, 1024));
        assert!(out.len() + 1024 * 3 >= max_route_bytes(1024, 1024, &id), "{}", out.len());
        let matched = vec![u32::MAX; 4096];
        reply::encode_prefix(&mut out, Some(Id::Str(&id)), usize::MAX, &matched);
        assert!(out.len() <= max_reply_bytes(Channel::Health, 4096, 1));
    }

    #[test]
    fn state_leads_at_the_defaults_and_route_at_a_large_max_batch() {
        // dp_size 8, max_batch 1024: the state reply (312 bytes per rank at worst).
        assert_eq!(max_reply_bytes(Channel::Route, 8, 1024), 2749);
        assert_eq!(max_reply_bytes(Channel::Health, 8, 1024), 2749);
        assert_eq!(max_state_bytes(9, &longest_id()) - max_state_bytes(8, &longest_id()), 312);
        // 65,536 ranks of one byte each (all below 128), and an `explain`
        // entry of 48 bytes at most for each of the 8 ranks, outgrow the state of 8.
        let id = longest_id();
        assert_eq!(route_bytes(1, &id) - route_bytes(0, &id), 48);
        let base = route_bytes(0, &id);
        assert_eq!(max_reply_bytes(Channel::Route, 8, 65_536), base + 65_536 + 8 * 48 + 2 * ARRAY_GROWTH);
        // The reply without `explain` is 56 bytes shorter (`guarded` is 9
        // of them, `block_size` 16), without 16 fallbacks 93 (a 10-byte
        // key, a 3-byte array header, 16 ranks of 5 bytes).
        let mut out = Vec::new();
        reply::encode_ranks(&mut out, Some(Id::Str(&id)), &[], u64::MAX, None, None);
        assert_eq!(base - out.len(), 56 + 93);
    }
}
