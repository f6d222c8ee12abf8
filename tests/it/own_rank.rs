//! A source writes only its own rank, against the real binary over real
//! ZeroMQ (docs/failure-behaviour.md, "A source writes only its own rank"):
//! a `+rank` KV endpoint and its replay socket naming another rank, a
//! `BlockStored` dropped as bad, an SGLang load endpoint naming another
//! rank, and what an update on the stats bind can and cannot do to a
//! rank's KV index.

use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

const PROMPT: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

/// A daemon over `dp` ranks ([`FROZEN`] liveness) subscribed to the
/// `+rank` KV publishers of `dp` engines (and their replay sockets when
/// `replay`), each heard once; and those engines.
fn kv_daemon(ctx: &zmq::Context, dp: u32, replay: bool) -> (Daemon, Vec<Engine>) {
    let (mut e, p, r) = engines(ctx, dp);
    let (connect, replay_ep) = (format!("tcp://127.0.0.1:{p}+rank"), format!("tcp://127.0.0.1:{r}+rank"));
    let mut args = vec!["--kv-events-connect", &connect];
    if replay {
        args.extend_from_slice(&["--kv-events-replay", &replay_ep]);
    }
    let d = Daemon::frozen(&dp.to_string(), &args);
    join(&d, &mut e);
    (d, e)
}

/// Every `dpcoord_kv_index_resets_total` series of `rank`, whatever the cause.
fn resets(d: &Daemon, rank: u32) -> f64 {
    let (_, body) = d.http_get("/metrics");
    ["cleared", "restart", "down", "gap"]
        .iter()
        .map(|c| series(&body, &format!("dpcoord_kv_index_resets_total{{cause=\"{c}\",dp_rank=\"{rank}\"}}")).unwrap())
        .sum()
}

#[test]
fn a_rank_endpoint_and_its_replay_socket_cannot_store_on_or_clear_another_rank() {
    let ctx = zmq::Context::new();
    let (d, mut e) = kv_daemon(&ctx, 2, true);
    e[1].publish(vec![stored(&[20], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [0, 1]}));
    // Rank 0's publisher names rank 1: a phantom prefix and a clear, live...
    e[0].emit_naming(1, vec![stored(&[66, 67], None, &[5, 5, 6, 6])], false);
    e[0].emit_naming(1, vec![cleared()], false);
    // ...and another clear lost on the way, so that its replay socket delivers it.
    e[0].emit_naming(1, vec![cleared()], true);
    e[0].publish(vec![stored(&[10], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 1]}));
    let wrong = r#"dpcoord_kv_batches_total{result="wrong_rank"}"#;
    assert_eq!(d.metric(wrong), Some(3.0), "two live, one replayed");
    assert_eq!(prefix(&d, &[5, 5, 6, 6])["matched"], json!([0, 0]), "no phantom prefix on rank 1");
    let s = d.state();
    assert_eq!((&s["ranks"][0]["kv_blocks"], &s["ranks"][1]["kv_blocks"]), (&json!({"GPU": 1}), &json!({"GPU": 1})));
    // The refused batches took their seq: no gap was left, nothing was cleared.
    for result in ["incomplete", "timeout", "unavailable"] {
        assert_eq!(d.metric(&format!("dpcoord_kv_replays_total{{result=\"{result}\"}}")), Some(0.0), "{result}");
    }
    assert_eq!((resets(&d, 0), resets(&d, 1)), (0.0, 0.0));
    // Rank 1's own publisher goes on, on its own rank.
    e[1].publish(vec![stored(&[21], Some(20), &[3, 4])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 2]}));
    assert_eq!(d.metric(wrong), Some(3.0));
    assert_eq!(d.stop().code(), Some(0));
}

/// `kv_block_size` of the document, then of each rank.
fn block_sizes(s: &Value) -> Value {
    let mut sizes = vec![s["kv_block_size"].clone()];
    sizes.extend(s["ranks"].as_array().unwrap().iter().map(|r| r["kv_block_size"].clone()));
    Value::Array(sizes)
}

#[test]
fn a_dropped_block_stored_teaches_no_block_size_and_each_rank_keeps_its_own() {
    let ctx = zmq::Context::new();
    let (d, mut e) = kv_daemon(&ctx, 3, false);
    // Rank 0's first BlockStored is bad (blocks of 999 tokens, 2 tokens sent): dropped.
    e[0].publish(vec![stored_sized(&[10], None, &[1, 2], 999)]);
    e[1].publish(vec![stored(&[20], None, &[1, 2])]);
    e[2].publish(vec![stored(&[30, 31], None, &[1, 2, 3, 4])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [0, 1, 2]}));
    let bad = |rank: u32| d.metric(&format!("dpcoord_kv_events_total{{dp_rank=\"{rank}\",result=\"bad_event\"}}"));
    assert_eq!((bad(0), bad(1), bad(2)), (Some(1.0), Some(0.0), Some(0.0)));
    assert_eq!(block_sizes(&d.state()), json!([2, null, 2, 2]));
    // Rank 0 then stores valid blocks of 4, its own size; the others keep
    // theirs, and prompts are keyed in both.
    e[0].publish(vec![stored_sized(&[11], None, &[1, 2, 3, 4], 4)]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 1, 2]}));
    assert_eq!(block_sizes(&d.state()), json!([2, 4, 2, 2]));
    // On rank 0 blocks of 2 are the bad ones now; rank 1 goes on in blocks of 2.
    e[0].publish(vec![stored(&[12], None, &[1, 2])]);
    eventually("rank 0's second bad event", || (bad(0) == Some(2.0)).then_some(()));
    e[1].publish(vec![stored(&[21], Some(20), &[3, 4])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 2, 2]}));
    assert_eq!((bad(0), bad(1), bad(2)), (Some(2.0), Some(0.0), Some(0.0)));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn an_sglang_load_endpoint_naming_another_rank_is_refused_and_cannot_keep_it_up() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = zmq::Context::new();
    let eps: Vec<String> = (0..2).map(|r| ipc(&dir, &format!("load-{r}"))).collect();
    let mut p: Vec<LoadPub> = eps.iter().map(|ep| LoadPub::bind(&ctx, ep)).collect();
    let d = Daemon::start(&[
        "--dp-size",
        "2",
        "--stale-after-ms",
        "300",
        "--down-after-ms",
        "600",
        "--sglang-load-connect",
        &eps[0],
        "--sglang-load-connect",
        &eps[1],
    ]);
    eventually("both ranks up", || {
        p[0].send(0, 0, 0, 0, 0);
        p[1].send(1, 2, 0, 0, 0);
        std::thread::sleep(Duration::from_millis(10));
        (statuses(&d.state()) == json!(["up", "up"])).then_some(())
    });
    let boot = d.ranks()[1]["boot"].clone();
    // Engine 1 dies. Rank 0's endpoint goes on, for rank 0 and naming rank 1.
    let (wrong, mut sent) = (r#"dpcoord_stats_messages_total{result="wrong_rank"}"#, 0);
    let s = eventually("rank 1 down", || {
        p[0].send(0, 0, 0, 0, 0);
        p[0].send(1, 9, 9, 9, 9);
        sent += 1;
        std::thread::sleep(Duration::from_millis(50));
        let s = d.state();
        assert_eq!(s["ranks"][1]["counts"], json!([0, 2, 0, 0, 0]), "rank 1's load untouched");
        assert_eq!(s["ranks"][1]["boot"], boot, "rank 1 never restarted");
        (s["ranks"][1]["status"] == "down").then_some(s)
    });
    assert_eq!(s["ranks"][0]["status"], "up");
    eventually("every refusal counted", || (d.metric(wrong) == Some(f64::from(sent))).then_some(()));
    // Its own engine back: rank 1 takes its LoadStat and comes back up.
    eventually("rank 1 up again", || {
        p[1].send(1, 1, 0, 0, 0);
        std::thread::sleep(Duration::from_millis(10));
        (d.ranks()[1]["status"] == "up").then_some(())
    });
    assert_eq!(d.ranks()[1]["counts"], json!([0, 1, 0, 0, 0]));
    assert_eq!(d.metric(wrong), Some(f64::from(sent)));
}

#[test]
fn a_refused_or_stale_stats_update_keeps_the_kv_index_and_a_new_boot_clears_its_rank_only() {
    let ctx = zmq::Context::new();
    let (d, mut e) = kv_daemon(&ctx, 2, false);
    let stats = d.publisher();
    let mut seq = d.bring_up(&stats, &[0, 1]);
    e[0].publish(vec![stored(&[10], None, &[1, 2])]);
    e[1].publish(vec![stored(&[20], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 1]}));
    let max = u64::MAX;
    // Refused: boot 2^64-1 with a NaN, and with counts of the wrong length;
    // stale: a lower boot, and a seq not above the last.
    stats.send_raw(&Update::new(1, max, 1).ttft(f64::NAN).bytes());
    stats.send_raw(&Update::new(1, max, 1).counts([0; 4]).bytes());
    stats.send(&update(1, 0, seq, [0; 5]));
    stats.send(&update(1, 1, 1, [0; 5]));
    // A valid update of rank 0 after them: once it shows, all four were read.
    d.publish_until_shown(stats.socket(), 0, &mut seq, [1, 0, 0, 0, 0]);
    let result = |r: &str| d.metric(&format!("dpcoord_stats_messages_total{{result=\"{r}\"}}"));
    assert_eq!((result("malformed"), result("stale")), (Some(2.0), Some(2.0)));
    assert_eq!(prefix(&d, &PROMPT)["matched"], json!([1, 1]));
    assert_eq!((d.ranks()[1]["boot"].clone(), resets(&d, 1)), (json!(1), 0.0));
    // A valid update with a new boot, 2^64-1 included, is a restart of
    // rank 1 (the stats bind speaks for any rank): its index is cleared,
    // rank 0's is not, and the real engine's boot 1 is stale from now on.
    stats.send(&update(1, max, 1, [0; 5]));
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 0]}));
    let restart =
        |rank: u32| d.metric(&format!("dpcoord_kv_index_resets_total{{cause=\"restart\",dp_rank=\"{rank}\"}}"));
    assert_eq!((restart(0), restart(1), resets(&d, 0)), (Some(0.0), Some(1.0), 0.0));
    stats.send(&update(1, 1, seq, [0; 5]));
    eventually("the old boot stale", || (result("stale") == Some(3.0)).then_some(()));
    assert_eq!(d.ranks()[1]["boot"], json!(max));
    // Rank 1's own KV publisher fills its index again.
    e[1].publish(vec![stored(&[21], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [1, 1]}));
    assert_eq!(d.stop().code(), Some(0));
}
