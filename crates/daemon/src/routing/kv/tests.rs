use std::time::{Duration, Instant};

use prometheus::Registry;

use super::*;
use crate::config::Settings;
use crate::engines::kv::{KvEvent, Stored};
use crate::engines::prefix::keys::{chain_keys, chain_seed};

/// One stream with a replay socket, no rank hint, 2 ranks.
fn streams() -> (KvStreams, Registry) {
    let r = Registry::new();
    let mut s =
        KvStreams::new(&Settings::default().kv, Settings::default().memory.events_index, 2, KvMetrics::new(&r, 2));
    s.set_endpoints(&[KvEndpoint { connect: "tcp://a:1".into(), replay: Some("tcp://a:2".into()), rank: None }]);
    (s, r)
}

/// A batch for rank 0 storing one chain-starting block of tokens `[t, t]`, engine hash `t`.
fn store(t: u32) -> Payload {
    let ev = KvEvent::Stored(Stored {
        hashes: vec![u64::from(t)],
        parent: None,
        tokens: vec![t, t],
        block_size: 2,
        medium: Medium::Gpu,
        lora: None,
        salt: None,
        unmatchable: None,
        group: 0,
    });
    Ok(KvBatch { rank: Some(0), events: vec![ev] })
}

fn msg(from_replay: bool, seq: u64, batch: Payload) -> KvMessage {
    KvMessage { stream: 0, from_replay, body: KvBody::Batch { seq, batch } }
}

fn end() -> KvMessage {
    KvMessage { stream: 0, from_replay: true, body: KvBody::ReplayEnd }
}

/// Whether rank 0 holds the block `[t, t]`.
fn holds(s: &KvStreams, t: u32) -> bool {
    let mut keys = Vec::new();
    chain_keys(chain_seed(None, None), &[t, t], 2, &mut keys);
    let mut out = Vec::new();
    s.index().leading(&keys, &mut out);
    out[0] == 1
}

fn counter(r: &Registry, name: &str, label: (&str, &str)) -> u64 {
    let fams = r.gather();
    let fam = fams.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("no {name}"));
    let m = fam
        .get_metric()
        .iter()
        .find(|m| label.0.is_empty() || m.get_label().iter().any(|l| l.name() == label.0 && l.value() == label.1));
    m.map_or(0, |m| m.get_counter().get_value() as u64)
}

/// The replays asked, as `(stream, from)`.
fn asks(s: &mut KvStreams) -> Vec<(u16, u64)> {
    let mut out = Vec::new();
    s.take_asks(&mut out);
    let replay = |r: crate::wire::SourceRequest| match r.to {
        crate::wire::SourceKind::KvEvents { stream, replay: true } => (stream, u64::from_be_bytes(r.body)),
        other => panic!("a request to {other:?}"),
    };
    out.into_iter().map(replay).collect()
}

#[test]
fn the_first_batch_asks_for_history_and_a_gap_is_replayed_in_order() {
    let (mut s, r) = streams();
    let t0 = Instant::now();
    s.on_message(msg(false, 5, store(5)), t0);
    assert_eq!(asks(&mut s), vec![(0, 0)], "history from 0");
    assert!(!holds(&s, 5), "buffered until the replay ends");
    // The publisher's buffer starts at 3: history before it is unknown, not a gap.
    for seq in 3..=5 {
        s.on_message(msg(true, seq, store(seq as u32)), t0);
    }
    s.on_message(end(), t0);
    assert!(holds(&s, 3) && holds(&s, 4) && holds(&s, 5));
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "gap")), 0);
    // Live 6, then 8: 7 is missing; live 9 arrives during the replay.
    s.on_message(msg(false, 6, store(6)), t0);
    s.on_message(msg(false, 8, store(8)), t0);
    assert_eq!(asks(&mut s), vec![(0, 7)]);
    s.on_message(msg(false, 9, store(9)), t0);
    for seq in 7..=9 {
        s.on_message(msg(true, seq, store(seq as u32)), t0);
    }
    s.on_message(end(), t0);
    assert!((6..=9).all(|t| holds(&s, t)));
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "recovered")), 1);
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "stale")), 3, "live 5, then 8 and 9, came twice");
    assert_eq!(counter(&r, "dpcoord_kv_event_gaps_total", ("", "")), 1, "7 was missing");
}

#[test]
fn a_replay_that_cannot_cover_the_gap_clears_the_rank() {
    let (mut s, r) = streams();
    let t0 = Instant::now();
    s.on_message(msg(false, 0, store(1)), t0);
    assert!(holds(&s, 1));
    s.on_message(msg(false, 3, store(3)), t0);
    assert_eq!(asks(&mut s), vec![(0, 1)]);
    // The publisher no longer has 1: it replays from 2.
    s.on_message(msg(true, 2, store(2)), t0);
    s.on_message(msg(true, 3, store(3)), t0);
    s.on_message(end(), t0);
    assert!(!holds(&s, 1), "block 1 was stored before the hole");
    assert!(holds(&s, 3), "the live batch after the hole is applied");
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "incomplete")), 1);
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "gap")), 1);
    // A replay that never ends times out at the tick.
    s.on_message(msg(false, 6, store(6)), t0);
    let engines = EngineTable::new(&crate::engines::testing::settings(2));
    s.tick(t0 + Duration::from_millis(1999), &engines);
    assert!(!holds(&s, 6));
    s.tick(t0 + Duration::from_secs(2), &engines);
    s.finish();
    assert!(holds(&s, 6));
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "timeout")), 1);
}

#[test]
fn a_seq_going_back_is_a_restarted_publisher() {
    let (mut s, r) = streams();
    let t0 = Instant::now();
    s.on_message(msg(false, 0, store(1)), t0);
    s.on_message(msg(false, 1, store(2)), t0);
    // Seq 0 again: the publisher restarted; what it held before is gone.
    s.on_message(msg(false, 0, store(3)), t0);
    assert!(!holds(&s, 1) && !holds(&s, 2) && holds(&s, 3));
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "restart")), 1);
    // A bad batch still takes its seq: 2 next is not a gap.
    s.on_message(msg(false, 1, Err("bad".into())), t0);
    s.on_message(msg(false, 2, store(4)), t0);
    assert!(asks(&mut s).is_empty());
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "malformed")), 1);
    // Restarted again, its seq 0 lost: seq 1 after 2 clears the rank and asks
    // the new publisher for its history from 0.
    s.on_message(msg(false, 1, store(5)), t0);
    assert!(!holds(&s, 3) && !holds(&s, 4));
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "restart")), 2);
    assert_eq!(asks(&mut s), vec![(0, 0)]);
    s.on_message(msg(true, 0, store(6)), t0);
    s.on_message(msg(true, 1, store(5)), t0);
    s.on_message(end(), t0);
    assert!(holds(&s, 6) && holds(&s, 5));
    // A rank out of range is refused.
    let far = Ok(KvBatch { rank: Some(7), events: vec![KvEvent::Cleared] });
    s.on_message(msg(false, 2, far), t0);
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "unknown_rank")), 1);
}

#[test]
fn without_a_replay_socket_a_gap_clears_at_once() {
    let r = Registry::new();
    let mut s =
        KvStreams::new(&Settings::default().kv, Settings::default().memory.events_index, 2, KvMetrics::new(&r, 2));
    s.set_endpoints(&[KvEndpoint { connect: "tcp://a:1".into(), replay: None, rank: Some(0) }]);
    let t0 = Instant::now();
    s.on_message(msg(false, 4, store(1)), t0);
    assert!(holds(&s, 1), "the first batch starts the stream");
    s.on_message(msg(false, 6, store(2)), t0);
    assert!(!holds(&s, 1) && holds(&s, 2));
    assert!(asks(&mut s).is_empty());
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "unavailable")), 1);
}

/// A batch for rank 0 storing `blocks` blocks of 16 tokens, `t` the first
/// block's engine hash: about 100 bytes a block once decoded.
fn big(t: u32, blocks: u32) -> Payload {
    let ev = KvEvent::Stored(Stored {
        hashes: (0..blocks).map(|i| u64::from(t) + u64::from(i)).collect(),
        parent: None,
        tokens: (0..blocks * 16).map(|i| t + i / 16).collect(),
        block_size: 16,
        medium: Medium::Gpu,
        lora: None,
        salt: None,
        unmatchable: None,
        group: 0,
    });
    Ok(KvBatch { rank: Some(0), events: vec![ev] })
}

/// Live batches kept during a replay are bounded in bytes, not only in
/// count: ten batches of 4 MiB decoded pass the 32 MiB budget, and the
/// replay is given up (the rank cleared, everything after applied in
/// order) instead of memory growing; with no replay running the budget is
/// whole again, and a gap whose first batch does not fit is not replayed.
#[test]
fn live_batches_kept_during_a_replay_are_bounded_in_bytes() {
    let (mut s, r) = streams();
    let t0 = Instant::now();
    let blocks = (4 << 20) / 72; // 64 bytes of tokens and 8 of hash a block
    let one = held_bytes(&big(0, blocks));
    assert!(((4 << 20)..(4 << 20) + 4096).contains(&one), "{one}");
    s.on_message(msg(false, 0, store(1)), t0);
    s.on_message(msg(false, 2, big(100, blocks)), t0);
    assert_eq!(asks(&mut s), vec![(0, 1)]);
    let fit = MAX_BUFFERED_BYTES / one;
    for seq in 3..2 + fit as u64 {
        s.on_message(msg(false, seq, big(100, blocks)), t0);
    }
    assert_eq!(s.buffered_bytes, fit * one, "{fit} batches kept");
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "incomplete")), 0);
    s.on_message(msg(false, 2 + fit as u64, big(100, blocks)), t0);
    assert_eq!(s.buffered_bytes, 0, "the replay was given up");
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "incomplete")), 1);
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "gap")), 1);
    assert!(!holds(&s, 1), "block 1 was stored before the hole");
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "ok")), 2 + fit as u64, "all applied");
    s.on_message(msg(false, 3 + fit as u64, store(7)), t0);
    assert!(holds(&s, 7), "the stream goes on in order");
    // A gap whose batch alone passes the budget is not replayed at all.
    let huge = (MAX_BUFFERED_BYTES / 72 + 1) as u32;
    s.on_message(msg(false, 5 + fit as u64, big(9_000_000, huge)), t0);
    assert_eq!(asks(&mut s), vec![], "no replay asked");
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "incomplete")), 2);
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "gap")), 2);
    assert_eq!(s.buffered_bytes, 0);
}

/// Every reset of rank `rank`'s index, whatever its cause.
fn resets(r: &Registry, rank: &str) -> u64 {
    let fams = r.gather();
    let fam = fams.iter().find(|f| f.name() == "dpcoord_kv_index_resets_total").unwrap();
    let of_rank =
        |m: &&prometheus::proto::Metric| m.get_label().iter().any(|l| l.name() == "dp_rank" && l.value() == rank);
    fam.get_metric().iter().filter(of_rank).map(|m| m.get_counter().get_value() as u64).sum()
}

/// `[t, t]` stored, in a batch naming `rank` (or none).
fn store_naming(rank: Option<u32>, t: u32) -> Payload {
    let Ok(KvBatch { events, .. }) = store(t) else { unreachable!() };
    Ok(KvBatch { rank, events })
}

/// Whether `rank` holds the block `[t, t]`.
fn held(s: &KvStreams, rank: usize, t: u32) -> bool {
    let mut keys = Vec::new();
    chain_keys(chain_seed(None, None), &[t, t], 2, &mut keys);
    let mut out = Vec::new();
    s.index().leading(&keys, &mut out);
    out[rank] == 1
}

/// The `+rank` endpoint of rank 1 and its replay socket: batches naming
/// rank 0 are refused (taking their `seq`), its publisher restarting
/// clears rank 1 whatever its batch names, and an endpoint that is not a
/// `+rank` form still writes the rank each batch names.
#[test]
fn a_rank_endpoint_and_its_replay_socket_write_their_own_rank_only() {
    let r = Registry::new();
    let mut s =
        KvStreams::new(&Settings::default().kv, Settings::default().memory.events_index, 2, KvMetrics::new(&r, 2));
    let shared = KvEndpoint { connect: "tcp://a:1".into(), replay: None, rank: None };
    let own = KvEndpoint { connect: "tcp://a:2".into(), replay: Some("tcp://a:3".into()), rank: Some(1) };
    s.set_endpoints(&[shared, own]);
    let t0 = Instant::now();
    let on = |s: &mut KvStreams, from_replay, seq, batch| {
        s.on_message(KvMessage { stream: 1, from_replay, body: KvBody::Batch { seq, batch } }, t0)
    };
    s.on_message(msg(false, 0, store_naming(Some(0), 1)), t0);
    s.on_message(msg(false, 1, store_naming(Some(1), 9)), t0);
    on(&mut s, false, 0, store_naming(Some(1), 2));
    on(&mut s, false, 1, store_naming(None, 3));
    assert!(held(&s, 0, 1) && held(&s, 1, 9) && held(&s, 1, 2) && held(&s, 1, 3));
    // Naming rank 0: a phantom store and a clear, both refused.
    on(&mut s, false, 2, store_naming(Some(0), 4));
    on(&mut s, false, 3, Ok(KvBatch { rank: Some(0), events: vec![KvEvent::Cleared] }));
    assert!(held(&s, 0, 1) && !held(&s, 0, 4));
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "wrong_rank")), 2);
    // They took their seq: 4 next is no gap.
    on(&mut s, false, 4, store_naming(Some(1), 5));
    assert!(asks(&mut s).is_empty() && held(&s, 1, 5));
    // A gap: the replayed batch naming rank 0 is refused too, and the replay recovers.
    on(&mut s, false, 7, store_naming(Some(1), 7));
    assert_eq!(asks(&mut s), vec![(1, 5)]);
    on(&mut s, true, 5, store_naming(Some(0), 6));
    on(&mut s, true, 6, store_naming(Some(1), 8));
    on(&mut s, true, 7, store_naming(Some(1), 7));
    s.on_message(KvMessage { stream: 1, from_replay: true, body: KvBody::ReplayEnd }, t0);
    assert!(!held(&s, 0, 6) && held(&s, 1, 8) && held(&s, 1, 7));
    assert_eq!(counter(&r, "dpcoord_kv_replays_total", ("result", "recovered")), 1);
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "wrong_rank")), 3);
    // Its seq going back clears rank 1, the endpoint's, not the rank the batch names.
    on(&mut s, false, 0, Ok(KvBatch { rank: Some(0), events: vec![] }));
    assert!(held(&s, 0, 1) && !held(&s, 1, 2) && !held(&s, 1, 9));
    assert_eq!((resets(&r, "0"), resets(&r, "1")), (0, 1));
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "wrong_rank")), 4);
}

/// What the streams decide is applied later, in the order decided, a
/// slice at a time: a batch, the reset a gap calls for, the batch after
/// it; the outcome of a batch is counted once it is whole.
#[test]
fn changes_are_queued_in_order_and_applied_a_slice_at_a_time() {
    let r = Registry::new();
    let mut s =
        KvStreams::new(&Settings::default().kv, Settings::default().memory.events_index, 2, KvMetrics::new(&r, 2));
    s.set_endpoints(&[KvEndpoint { connect: "tcp://a:1".into(), replay: None, rank: Some(0) }]);
    let t0 = Instant::now();
    s.accept(msg(false, 0, big(1, 300)), t0);
    s.accept(msg(false, 2, big(5000, 1)), t0);
    assert!(s.pending() && !s.index().holds_any(0), "nothing applied on arrival");
    let mut slices = Vec::new();
    while s.pending() {
        slices.push(s.work(64));
        if s.index().blocks(0, Medium::Gpu) == 300 {
            assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "ok")), 1);
            assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "gap")), 0, "the reset comes after");
        }
    }
    assert!(slices.iter().all(|&n| n <= 64), "{slices:?}");
    assert!(slices.len() >= 300 / 64 + 2, "{slices:?}");
    assert_eq!(s.index().blocks(0, Medium::Gpu), 1, "the first batch, then the reset, then the second");
    assert_eq!(counter(&r, "dpcoord_kv_batches_total", ("result", "ok")), 2);
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "gap")), 1);
}

/// The sequence a quick engine restart makes: the new publisher's `seq`
/// passes the old one's before dpcoord hears it. By `seq` alone that is a
/// gap whose replay (from the new buffer) keeps the old blocks; the link's
/// new session clears them, and the rank is degraded until the new
/// publisher's history is replayed from 0.
#[test]
fn a_new_session_clears_the_rank_whatever_the_new_seq_and_degrades_it_until_replayed() {
    let (mut s, r) = streams();
    let t0 = Instant::now();
    s.on_message(msg(false, 0, store(1)), t0);
    s.on_message(msg(false, 1, store(2)), t0);
    assert!(holds(&s, 1) && holds(&s, 2) && !s.degraded(0));
    s.new_session(0);
    assert!(s.degraded(0), "a reset is queued");
    s.finish();
    assert!(!holds(&s, 1) && !holds(&s, 2), "the old publisher's blocks are gone");
    assert!(!s.degraded(0), "an applied reset leaves an exact (empty) index");
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "reconnect")), 1);
    // The new publisher is at seq 7: a first batch, so a replay from 0.
    s.on_message(msg(false, 7, store(8)), t0);
    assert_eq!(asks(&mut s), vec![(0, 0)]);
    assert!(s.degraded(0), "replaying");
    s.on_message(msg(true, 6, store(7)), t0);
    s.on_message(msg(true, 7, store(8)), t0);
    s.on_message(end(), t0);
    assert!(holds(&s, 7) && holds(&s, 8) && !holds(&s, 2));
    assert!(!s.degraded(0), "the replay delivered the new publisher's history");
    assert_eq!(counter(&r, "dpcoord_kv_event_gaps_total", ("", "")), 0, "no gap: a new publisher");
}

#[test]
fn a_first_session_or_a_link_never_heard_changes_nothing() {
    let (mut s, r) = streams();
    s.new_session(0);
    s.new_session(9);
    s.finish();
    assert_eq!(counter(&r, "dpcoord_kv_index_resets_total", ("cause", "reconnect")), 0);
    assert!(!s.degraded(0));
}

/// A gap degrades the rank while its replay runs; a replay that cannot
/// cover it clears the rank, and only the applied clear makes it exact.
#[test]
fn a_gap_degrades_the_rank_until_recovered_or_cleared() {
    let (mut s, _r) = streams();
    let t0 = Instant::now();
    s.on_message(msg(false, 0, store(1)), t0);
    s.on_message(msg(false, 2, store(3)), t0);
    assert_eq!(asks(&mut s), vec![(0, 1)]);
    assert!(s.degraded(0));
    s.on_message(msg(true, 1, store(2)), t0);
    s.on_message(msg(true, 2, store(3)), t0);
    s.on_message(end(), t0);
    assert!(!s.degraded(0) && holds(&s, 2), "recovered");
    s.on_message(msg(false, 5, store(6)), t0);
    assert!(s.degraded(0));
    s.on_message(msg(true, 4, store(5)), t0);
    s.accept(end(), t0);
    assert!(s.degraded(0), "the replay missed seq 3: a clear is queued");
    s.finish();
    assert!(!s.degraded(0) && !holds(&s, 1));
}
