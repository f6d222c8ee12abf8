//! The engines' KV-cache events through the real binary (docs/PROTOCOL.md
//! §11a): per-rank publishers found by `tcp://HOST:PORT+rank`, stores,
//! removals and clears seen through the health socket's `prefix` op,
//! `state` and `/metrics`; a lost batch recovered by replay, one that replay
//! cannot recover, and a rank that goes down. The engine side
//! (`crate::common::engines`) binds a PUB and a replay ROUTER per rank, as vLLM's
//! and SGLang's publishers do (their real classes are driven in
//! clients/python/tests/compat).

use std::time::Duration;

use crate::common::*;
use serde_json::json;

const PROMPT: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

/// One publisher with its replay socket (ports `p`, `r`) and a daemon of one
/// rank subscribed to it, whose index holds `PROMPT`'s 3 blocks.
fn one_rank_holding_the_prompt(ctx: &zmq::Context) -> (Vec<Engine>, u16, u16, Daemon) {
    let (mut e, p, r) = engines(ctx, 1);
    let d = subscribed("1", p, r);
    join(&d, &mut e);
    e[0].publish(vec![stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [3]}));
    (e, p, r, d)
}

/// A daemon of `dp` ranks subscribed to the publishers at `pub_port + rank`,
/// with their replay sockets at `replay_port + rank`.
fn subscribed(dp: &str, pub_port: u16, replay_port: u16) -> Daemon {
    let (connect, replay) = (format!("tcp://127.0.0.1:{pub_port}+rank"), format!("tcp://127.0.0.1:{replay_port}+rank"));
    Daemon::frozen(dp, &["--kv-events-connect", &connect, "--kv-events-replay", &replay])
}

#[test]
fn stores_removals_and_clears_reach_each_ranks_index() {
    let ctx = zmq::Context::new();
    let (mut e, p, r) = engines(&ctx, 2);
    let d = subscribed("2", p, r);
    assert_eq!(prefix(&d, &PROMPT), json!({"blocks": 0, "matched": [0, 0]}), "no block size known yet");
    join(&d, &mut e);
    e[0].publish(vec![stored(&[10, 11], None, &[1, 2, 3, 4]), stored(&[12], Some(11), &[5, 6])]);
    e[1].publish(vec![stored(&[20], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [3, 1]}));
    let s = d.state();
    assert_eq!(s["kv_block_size"], json!(2));
    assert_eq!((&s["ranks"][0]["kv_blocks"], &s["ranks"][1]["kv_blocks"]), (&json!({"GPU": 3}), &json!({"GPU": 1})));
    // The tail block evicted on rank 0; everything cleared on rank 1.
    e[0].publish(vec![removed(&[12])]);
    e[1].publish(vec![cleared()]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [2, 0]}));
    assert_eq!(d.metric("dpcoord_kv_index_resets_total{cause=\"cleared\",dp_rank=\"1\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"stored\"}"), Some(2.0), "events, not blocks");
    assert_eq!(d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"removed\"}"), Some(1.0));
    eventually("the block gauges at the next tick", || {
        let g = |r: &str| d.metric(&format!("dpcoord_kv_blocks{{dp_rank=\"{r}\",medium=\"GPU\"}}"));
        (g("0") == Some(2.0) && g("1") == Some(0.0)).then_some(())
    });
    // A LoRA or salt is another chain: nothing matches.
    let r = d.health_client().call(json!({"v": 1, "op": "prefix", "tokens": PROMPT, "salt": "tenant"}));
    assert_eq!(r["matched"], json!([0, 0]));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn a_lost_batch_is_replayed_and_one_replay_cannot_cover_clears_the_rank() {
    let ctx = zmq::Context::new();
    let (mut e, _, _, d) = one_rank_holding_the_prompt(&ctx);
    // Lost on the way (kept in the publisher's buffer): the next batch shows the gap.
    e[0].emit(vec![stored(&[30], None, &[7, 7])], true);
    e[0].publish(vec![stored(&[31], Some(30), &[8, 8])]);
    await_prefix(&d, &[7, 7, 8, 8], json!({"blocks": 2, "matched": [2]}));
    assert_eq!(d.metric("dpcoord_kv_replays_total{result=\"recovered\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_event_gaps_total"), Some(1.0));
    // Lost and gone from the buffer: the replay starts after it, so the rank is cleared.
    let gone = e[0].emit(vec![removed(&[10])], true);
    e[0].forget_through(gone);
    e[0].publish(vec![stored(&[40], None, &[5, 5])]);
    await_prefix(&d, &[5, 5], json!({"blocks": 1, "matched": [1]}));
    assert_eq!(prefix(&d, &PROMPT)["matched"], json!([0]), "no phantom of block 10");
    assert_eq!(d.metric("dpcoord_kv_replays_total{result=\"incomplete\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_index_resets_total{cause=\"gap\",dp_rank=\"0\"}"), Some(1.0));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn bad_batches_are_counted_and_a_rank_that_goes_down_loses_its_index() {
    let ctx = zmq::Context::new();
    let (mut e, p, _) = engines(&ctx, 1);
    // Liveness short enough to see a rank go down; no replay endpoint.
    let d = Daemon::start(&[
        "--dp-size",
        "1",
        "--stale-after-ms",
        "300",
        "--down-after-ms",
        "600",
        "--kv-events-connect",
        &format!("tcp://127.0.0.1:{p}"),
    ]);
    let stats = d.publisher();
    let mut seq = d.bring_up(&stats, &[0]);
    join(&d, &mut e);
    // Not MessagePack, a rank out of range, then a good one: the daemon goes on.
    e[0].publisher.send_multipart([&b""[..], &e[0].next.to_be_bytes(), b"\xc1"], 0).unwrap();
    e[0].next += 1;
    e[0].rank = 5;
    e[0].publish(vec![cleared()]);
    e[0].rank = 0;
    e[0].publish(vec![stored(&[10], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1]}));
    assert_eq!(d.metric("dpcoord_kv_batches_total{result=\"malformed\"}"), Some(1.0));
    assert_eq!(d.metric("dpcoord_kv_batches_total{result=\"unknown_rank\"}"), Some(1.0));
    // Keep the rank up for a while, then let it go silent.
    publish_until("a stats update after the KV batch", stats.socket(), 0, &mut seq, [0; 5], || true);
    d.wait_status(0, "down");
    // Its index emptied and its block size forgotten (prompts are keyed in 16s again).
    await_prefix(&d, &PROMPT, json!({"blocks": 0, "matched": [0]}));
    let s = d.state();
    assert_eq!(
        (&s["kv_block_size"], &s["ranks"][0]["kv_block_size"], &s["ranks"][0]["kv_blocks"]),
        (&json!(null), &json!(null), &json!({}))
    );
    assert_eq!(d.metric("dpcoord_kv_index_resets_total{cause=\"down\",dp_rank=\"0\"}"), Some(1.0));
    assert_eq!(d.stop().code(), Some(0));
}

/// A quick engine restart, as a user of vLLM saw it: the new publisher
/// (same ports) is at a `seq` past the old one's next before dpcoord hears
/// it, and the stats side shows no new boot. By `seq` alone that was a gap:
/// dpcoord replayed from the new buffer and kept the old blocks (claimed,
/// not held). The link's new session clears the rank; the new publisher's
/// history comes back by a replay from 0, and `state` says the index is
/// `degraded` until then and `exact` after.
#[test]
fn a_restarted_publisher_whose_seq_passed_the_old_one_leaves_no_old_block() {
    let ctx = zmq::Context::new();
    let (e, p, r, d) = one_rank_holding_the_prompt(&ctx);
    assert_eq!(d.ranks()[0]["kv_index"], json!("exact"));
    let old_next = e[0].next;
    drop(e);
    // The new engine made blocks of its own, and its seq is past the old next.
    // libzmq closes the old listeners on its I/O thread, a moment later.
    let mut new = eventually("the ports free again", || Engine::bind(&ctx, 0, p, r).ok());
    for t in 0..old_next + 4 {
        new.emit(vec![stored(&[100 + t], None, &[9, t as u32])], true);
    }
    let reconnect = "dpcoord_kv_index_resets_total{cause=\"reconnect\",dp_rank=\"0\"}";
    eventually("the new publisher heard", || {
        new.publish(vec![]);
        std::thread::sleep(Duration::from_millis(20));
        // The replay from 0 may still run after the first live block is in:
        // the rank is `degraded` until it ends.
        let exact = d.ranks()[0]["kv_index"] == json!("exact");
        let heard = prefix(&d, &[9, 0]) == json!({"blocks": 1, "matched": [1]});
        (d.metric(reconnect) == Some(1.0) && heard && exact).then_some(())
    });
    assert_eq!(prefix(&d, &PROMPT), json!({"blocks": 3, "matched": [0]}), "no block of the old engine");
    assert_eq!(d.metric("dpcoord_kv_event_gaps_total"), Some(0.0), "a new publisher, not a gap");
    assert_eq!(d.metric("dpcoord_kv_index_degraded{dp_rank=\"0\"}"), Some(0.0));
}

/// `stored` with one more field, as vLLM adds it.
fn stored_with(hashes: &[u64], parent: Option<u64>, tokens: &[u32], field: &str, value: rmpv::Value) -> rmpv::Value {
    let mut ev = stored(hashes, parent, tokens);
    if let rmpv::Value::Map(fields) = &mut ev {
        fields.push((field.into(), value));
    }
    ev
}

#[test]
fn blocks_keyed_by_more_than_tokens_are_held_and_never_matched() {
    use rmpv::Value as M;
    let ctx = zmq::Context::new();
    let (mut e, p, r) = engines(&ctx, 2);
    let d = subscribed("2", p, r);
    join(&d, &mut e);
    let ints = |xs: &[i64]| M::Array(xs.iter().map(|&x| M::from(x)).collect());
    // Rank 0: lookahead hashes (every block), then a block continuing them.
    let look = M::Array(vec![ints(&[3]), ints(&[5])]);
    e[0].publish(vec![stored_with(&[10, 11], None, &[1, 2, 3, 4], "lookahead_token_ids", look)]);
    e[0].publish(vec![stored(&[12], Some(11), &[5, 6])]);
    // Rank 1: an image in the second block (a multimodal pair in its extra keys).
    let image = M::Array(vec![M::Nil, M::Array(vec![M::Array(vec!["img".into(), 0.into()])]), M::Nil]);
    e[1].publish(vec![stored_with(&[20, 21, 22], None, &[1, 2, 3, 4, 5, 6], "extra_keys", image)]);
    let unmatchable = |r: &str| d.metric(&format!("dpcoord_kv_events_total{{dp_rank=\"{r}\",result=\"unmatchable\"}}"));
    eventually("the three stores applied", || {
        (unmatchable("0") == Some(2.0) && unmatchable("1") == Some(1.0)).then_some(())
    });
    assert_eq!(prefix(&d, &PROMPT), json!({"blocks": 3, "matched": [0, 1]}), "the text block before the image only");
    let s = d.state();
    assert_eq!((&s["ranks"][0]["kv_blocks"], &s["ranks"][1]["kv_blocks"]), (&json!({"GPU": 3}), &json!({"GPU": 3})));
    // Held: removing them is a removal, not an unknown block.
    e[0].publish(vec![removed(&[12, 11, 10])]);
    eventually("the removal applied", || {
        (d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"removed\"}") == Some(1.0)).then_some(())
    });
    assert_eq!(d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"unknown_block\"}"), Some(0.0));
    assert_eq!(d.metric("dpcoord_kv_events_total{dp_rank=\"0\",result=\"unknown_parent\"}"), Some(0.0));
    assert_eq!(d.state()["ranks"][0]["kv_blocks"], json!({}));
    assert_eq!(d.stop().code(), Some(0));
}

/// `stored_sized` in KV cache group `group`, as vLLM's hybrid models send it.
fn grouped(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32, group: u32) -> rmpv::Value {
    let mut ev = stored_sized(hashes, parent, tokens, block_size);
    if let rmpv::Value::Map(fields) = &mut ev {
        fields.push(("group_idx".into(), group.into()));
    }
    ev
}

/// A hybrid model whose KV cache groups have different block sizes, as
/// vLLM publishes a prompt of 8 tokens and one: full attention in blocks
/// of 4, its partial block (the hash unit of 2 ending at 6), and a sliding
/// window in blocks of 2 that keeps only those ending on a multiple of 4.
#[test]
fn groups_of_different_block_sizes_are_each_matched_in_their_own() {
    let ctx = zmq::Context::new();
    let (mut e, p, r) = engines(&ctx, 2);
    let d = subscribed("2", p, r);
    join(&d, &mut e);
    let chain: Vec<u32> = (1..=8).collect();
    let prompt: Vec<u32> = (1..=9).collect();
    e[0].publish(vec![
        grouped(&[20, 40], None, &chain, 4, 0),
        grouped(&[30], Some(20), &chain[4..6], 2, 0),
        grouped(&[20, 40], None, &chain, 2, 1),
    ]);
    e[1].publish(vec![grouped(&[20, 40], None, &chain, 4, 0)]);
    await_prefix(&d, &prompt, json!({"blocks": 2, "matched": [2, 2]}));
    let s = d.state();
    assert_eq!((&s["kv_block_size"], &s["ranks"][0]["kv_block_size"]), (&json!(4), &json!(4)), "group 0's size");
    assert_eq!(s["ranks"][0]["kv_blocks"], json!({"GPU": 5}));
    let events = |res: &str| d.metric(&format!("dpcoord_kv_events_total{{dp_rank=\"0\",result=\"{res}\"}}"));
    assert_eq!((events("stored"), events("unmatchable"), events("bad_event")), (Some(2.0), Some(1.0), Some(0.0)));
    // The window drops the block ending at 8: rank 0's hit ends at 4.
    e[0].publish(vec![removed_in(&[40], 1)]);
    await_prefix(&d, &prompt, json!({"blocks": 2, "matched": [1, 2]}));
    // Group 1 in blocks of 4 is not its size: dropped, nothing changes.
    e[0].publish(vec![grouped(&[40], Some(20), &chain[4..], 4, 1)]);
    eventually("the bad store counted", || (events("bad_event") == Some(1.0)).then_some(()));
    assert_eq!(prefix(&d, &prompt), json!({"blocks": 2, "matched": [1, 2]}));
    assert_eq!(d.stop().code(), Some(0));
}

/// `removed` in KV cache group `group`.
fn removed_in(hashes: &[u64], group: u32) -> rmpv::Value {
    let mut ev = removed(hashes);
    if let rmpv::Value::Map(fields) = &mut ev {
        fields.push(("group_idx".into(), group.into()));
    }
    ev
}
