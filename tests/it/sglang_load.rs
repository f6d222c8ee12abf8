//! SGLang's scheduler load stream into `--sglang-load-connect`, against the
//! real binary: three-frame `LoadStat` messages bring ranks up with their
//! gauges and KV usage, a 1 s heartbeat keeps an idle rank up, bad messages (and one
//! naming another rank than its endpoint's) are counted and change nothing, and placements stay pending until a snapshot that
//! could have seen them.

use std::time::{Duration, Instant};

use crate::common::*;
use serde_json::json;

/// A daemon over 2 ranks subscribed to `pubs` SGLang load PUBs (the i-th
/// is rank i), and those publishers.
fn daemon(dir: &tempfile::TempDir, pubs: u32, extra: &[&str]) -> (Daemon, Vec<LoadPub>, zmq::Context) {
    let ctx = zmq::Context::new();
    let eps: Vec<String> = (0..pubs).map(|r| ipc(dir, &format!("sglang-load-{r}"))).collect();
    let publishers = eps.iter().map(|ep| LoadPub::bind(&ctx, ep)).collect();
    let mut args = vec!["--dp-size", "2"];
    for ep in &eps {
        args.extend_from_slice(&["--sglang-load-connect", ep]);
    }
    args.extend_from_slice(extra);
    (Daemon::start(&args), publishers, ctx)
}

#[test]
fn load_stats_bring_ranks_up_with_their_gauges_and_bad_ones_are_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (d, mut p, _ctx) = daemon(&dir, 2, &FROZEN);
    eventually("rank 1 up from its LoadStat", || {
        p[1].send(1, 3, 2, 3000, 9000);
        std::thread::sleep(Duration::from_millis(10));
        (d.ranks()[1]["status"] == "up").then_some(())
    });
    let r = &d.ranks()[1];
    assert_eq!((r["counts"].clone(), r["boot"].clone()), (json!([2, 3, 0, 0, 0]), json!(1)));
    let ok = d.metric(r#"dpcoord_stats_messages_total{result="ok"}"#).unwrap();
    p[1].send_frames(&[b"kv".to_vec(), 0i64.to_be_bytes().to_vec(), b"\x90".to_vec()]); // not the load topic
    p[1].send_frames(&[b"load".to_vec(), b"\x90".to_vec()]); // two frames
    p[1].send(7, 0, 0, 0, 0); // not rank 1, whose endpoint this is
    let malformed = r#"dpcoord_stats_messages_total{result="malformed"}"#;
    let wrong = r#"dpcoord_stats_messages_total{result="wrong_rank"}"#;
    eventually("bad messages counted", || {
        (d.metric(malformed) == Some(2.0) && d.metric(wrong) == Some(1.0)).then_some(())
    });
    assert_eq!(d.metric(r#"dpcoord_stats_messages_total{result="ok"}"#), Some(ok));
    // least_tokens reads SGLang's own total (KV + queued), not the KV in use.
    assert_eq!(d.ranks()[1]["counts"], json!([2, 3, 0, 0, 0]));
    // KV usage: 3,000 of 10,000 tokens; rank 0 has reported nothing.
    assert_eq!([d.ranks()[0]["kv_usage"].clone(), d.ranks()[1]["kv_usage"].clone()], [json!(null), json!(0.3)]);
    // A hybrid model's fuller pool can pass max_total_num_tokens: taken as full.
    p[1].send(1, 3, 2, 12_000, 20_000);
    eventually("usage capped at 1", || (d.ranks()[1]["kv_usage"] == json!(1.0)).then_some(()));
    let gauge = r#"dpcoord_engine_kv_usage{dp_rank="1"}"#;
    eventually("its gauge after a tick", || (d.metric(gauge) == Some(1.0)).then_some(()));
    assert!(d.metric(r#"dpcoord_engine_kv_usage{dp_rank="0"}"#).unwrap().is_nan());
}

#[test]
fn a_one_second_heartbeat_keeps_an_idle_rank_up_at_default_liveness() {
    let dir = tempfile::tempdir().unwrap();
    let (d, mut p, _ctx) = daemon(&dir, 1, &[]);
    eventually("rank 0 up", || {
        p[0].send(0, 0, 0, 0, 0);
        std::thread::sleep(Duration::from_millis(10));
        (d.ranks()[0]["status"] == "up").then_some(())
    });
    // An idle SGLang scheduler re-sends its unchanged stat once a second; the
    // default stale_after (1 s) would flap it; 2.5 heartbeats do not.
    let until = Instant::now() + Duration::from_millis(3500);
    while Instant::now() < until {
        std::thread::sleep(Duration::from_millis(1000));
        p[0].send(0, 0, 0, 0, 0);
        assert_eq!(d.ranks()[0]["status"], "up");
    }
    assert_eq!(d.state()["epoch"], 1, "never left the routable set");
}

#[test]
fn placements_stay_pending_until_a_snapshot_that_could_have_seen_them() {
    let dir = tempfile::tempdir().unwrap();
    // A 1 s transit window, so that "a snapshot right after" is far inside it.
    let file = dir.path().join("dpcoord.toml");
    std::fs::write(&file, "[routing]\npending_transit_ms = 1000\n").unwrap();
    let mut args = FROZEN.to_vec();
    args.extend_from_slice(&["--policy", "least_load", "--config", file.to_str().unwrap()]);
    let (d, mut p, _ctx) = daemon(&dir, 2, &args);
    eventually("ranks up", || {
        p[0].send(0, 0, 0, 0, 0);
        p[1].send(1, 0, 0, 0, 0);
        std::thread::sleep(Duration::from_millis(10));
        (d.ranks()[0]["status"] == "up" && d.ranks()[1]["status"] == "up").then_some(())
    });
    let c = d.client();
    let placed = Instant::now();
    assert_eq!(c.route(json!({"v": 1, "op": "route", "rank": 0, "n": 3})), [0, 0, 0]);
    // A snapshot within the transit window cannot have seen them: it
    // overwrites nothing dpcoord placed.
    p[0].send(0, 1, 0, 0, 0);
    eventually("the snapshot applied", || (d.ranks()[0]["counts"] == json!([0, 1, 0, 0, 0])).then_some(()));
    assert!(placed.elapsed() < Duration::from_millis(1000), "the machine is too slow for this window");
    assert_eq!(d.routed_pending()[0], (3, 3));
    // One that arrives after the window holds them (here: 3 waiting): they stop being pending.
    std::thread::sleep(Duration::from_millis(1000).saturating_sub(placed.elapsed()) + Duration::from_millis(20));
    p[0].send(0, 0, 3, 0, 0);
    eventually("pending reconciled", || (d.routed_pending()[0] == (3, 0)).then_some(()));
    assert_eq!(d.ranks()[0]["counts"], json!([3, 0, 0, 0, 0]));
    // least_load now sees rank 0's 3 waiting (weight 4) against an idle rank 1.
    assert_eq!(c.route(json!({"v": 1, "op": "route"})), [1]);
}
