//! Unit tests of `sglang/mod.rs`, on payloads shaped like SGLang 0.5.23's
//! `LoadStat` (msgspec, tag + array_like).

use super::*;

fn seq(n: i64) -> [u8; 8] {
    n.to_be_bytes()
}

fn payload<T: serde::Serialize>(fields: T) -> Vec<u8> {
    rmp_serde::to_vec(&fields).unwrap()
}

#[test]
fn a_full_load_stat_maps_to_a_gauge_only_report() {
    // running 3, waiting 2, KV 3000 of 10000, rank 5, 500 uncached, KV + queued 9000, then 3 more fields.
    let p = payload(("LoadStat", 3, 2, 3000, 10000, 5, 500, 9000, 64, 7, 8));
    let r = decode_sglang_load(b"load", &seq(41), &p).unwrap();
    assert_eq!(r.rank, 5);
    assert_eq!(r.sequence, Sequence::Restarting { seq: 41 });
    assert_eq!((r.counts.to_array(), r.cumulative, r.heartbeat), ([2, 3, 0, 0, 0], false, Duration::from_secs(1)));
    assert_eq!(r.tokens, Some(TokenLoad { waiting: 6000, running: 3000 }));
    assert_eq!(r.tokens.map(TokenLoad::total), Some(9000));
    assert_eq!(r.kv_usage, Some(0.3));
}

#[test]
fn the_six_field_prefix_decodes_and_capacity_zero_means_unknown() {
    let r = decode_sglang_load(b"load", &seq(0), &payload(("LoadStat", 1, 0, 40, 0, 2))).unwrap();
    assert_eq!((r.rank, r.tokens, r.kv_usage), (2, Some(TokenLoad { waiting: 0, running: 40 }), None));
}

#[test]
fn bad_messages_say_what_is_wrong() {
    let good = payload(("LoadStat", 1, 0, 40, 100, 2));
    let err = |topic: &[u8], s: &[u8], p: &[u8]| decode_sglang_load(topic, s, p).unwrap_err().to_string();
    assert_eq!(err(b"kv", &seq(1), &good), "SGLang load: the topic frame is not `load`");
    assert_eq!(err(b"load", &[0; 4], &good), "SGLang load: the seq frame is 4 bytes, not 8");
    assert_eq!(err(b"load", &seq(-1), &good), "SGLang load: negative seq -1");
    assert_eq!(err(b"load", &seq(1), &payload(("LoadStat", 1, 0))), "SGLang load: LoadStat has 2 fields, fewer than 6");
    assert_eq!(
        err(b"load", &seq(1), &payload(("Other", 1, 0, 40, 100, 2))),
        "SGLang load: the payload is not tagged \"LoadStat\""
    );
    assert_eq!(
        err(b"load", &seq(1), &payload(("LoadStat", -1, 0, 40, 100, 2))),
        "SGLang load: `num_running_reqs` must be a non-negative integer, got an integer"
    );
    assert_eq!(
        err(b"load", &seq(1), &payload(("LoadStat", 1, "x", 40, 100, 2))),
        "SGLang load: `num_waiting_reqs` must be a non-negative integer, got a string"
    );
    assert_eq!(
        err(b"load", &seq(1), &payload(("LoadStat", 1, 0, 40, 100, ()))),
        "SGLang load: `attn_dp_rank` is nil; dpcoord needs the rank"
    );
    assert_eq!(err(b"load", &seq(1), &payload(7)), "SGLang load: the payload must be an array, got an integer");
    let mut trailing = good.clone();
    trailing.push(0xc0);
    assert_eq!(err(b"load", &seq(1), &trailing), "SGLang load: trailing bytes after the LoadStat array");
    assert!(err(b"load", &seq(1), &good[..good.len() - 1]).starts_with("SGLang load: not valid MessagePack"));
}

#[test]
fn absurd_counts_saturate_instead_of_wrapping() {
    let p = payload(("LoadStat", u64::MAX, u64::MAX, u64::MAX, 1, 0, 0, 0));
    let r = decode_sglang_load(b"load", &seq(i64::MAX), &p).unwrap();
    assert_eq!((r.counts.running, r.kv_usage, r.tokens.map(TokenLoad::total)), (u64::MAX, Some(1.0), Some(u64::MAX)));
}
