//! The memory budget against the real binary: the prefix indexes stay in
//! their shares of `limits.memory_budget_bytes` however a peer feeds them,
//! evictions are counted exactly, RSS stays within what the budget
//! promises, and route queries are answered throughout.

use std::time::Duration;

use crate::common::*;
use rmpv::Value as M;
use serde_json::json;

/// RSS the process may add beyond the index's share (its other buffers,
/// the allocator's slack): the budget's estimates must cover the rest.
const SLACK_KIB: u64 = 24 * 1024;

fn config(dir: &tempfile::TempDir, text: &str) -> String {
    let path = dir.path().join("budget.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

fn part(d: &Daemon, part: &str) -> u64 {
    d.metric(&format!("dpcoord_memory_budget_bytes{{part=\"{part}\"}}")).unwrap() as u64
}

/// A route client floods `cache_aware` in approximate mode with distinct
/// prompts of 60,000 tokens. Before the budget, the approximate index kept
/// 1,048,576 keys per rank for the 120 s TTL: 1.1 GB in 15-24 s. Now the
/// index keeps its share, the rest is evicted and counted, key for key.
#[test]
fn distinct_prompts_keep_the_approximate_index_in_its_share() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, "[routing]\npolicy = \"cache_aware\"\nprefix_mode = \"approximate\"\n");
    let d = Daemon::frozen("1", &["--config", &cfg]);
    d.bring_up(&d.publisher(), &[0]);
    let before = status_kib(d.pid(), "VmRSS");
    // Three quarters of the part are the approximate index's (the rest
    // holds recent placements on event-fed ranks).
    let whole = part(&d, "approx_index");
    let share = whole - whole / 4;
    let cap = share / 192;
    // Tokens under 128 are one byte each in MessagePack: 60,000 fit a query.
    const TOKENS: usize = 60_000;
    let keys_per_query = (TOKENS / 16) as u64;
    let queries = cap / keys_per_query + 40;
    let c = d.client();
    for q in 0..queries {
        let mut tokens = vec![(q % 128) as u32, (q / 128 % 128) as u32, (q / 16_384) as u32];
        tokens.extend((3..TOKENS).map(|i| (i % 127) as u32));
        let r = c.call(json!({"v": 1, "op": "route", "id": q, "tokens": tokens}));
        assert_eq!(r["ok"], json!(true), "query {q}: {r}");
    }
    let evicted = d.metric("dpcoord_prefix_approx_evicted_total").unwrap() as u64;
    assert_eq!(evicted, queries * keys_per_query - cap, "every key past the share of {cap} evicted and counted");
    let peak = status_kib(d.pid(), "VmHWM");
    println!("approximate flood: {queries} queries, share {share} bytes, RSS before {before} KiB, peak {peak} KiB");
    assert!(peak < before + share / 1024 + SLACK_KIB, "peak {peak} KiB past the share");
    assert!(peak < LIMIT_KIB, "peak {peak} KiB");
    let (code, _) = d.http_get("/healthz");
    assert_eq!(code, 200);
}

/// A `BlockStored` of `blocks` vLLM-sized blocks (16 tokens) chained from
/// `parent`, hashes from `first` (ranks' floods start at hashes whose
/// tokens differ, so no two ranks share a key).
fn blocks16(first: u64, blocks: u64, parent: Option<u64>) -> M {
    let tokens: Vec<u32> = (0..blocks * 16).map(|i| ((first + i) % 127) as u32).collect();
    stored_sized(&(first..first + blocks).collect::<Vec<_>>(), parent, &tokens, 16)
}

/// Eight publishers fill their ranks far past the KV-event index's share
/// (before the budget, each rank could hold 1,048,576 blocks: 829 MB at 8
/// ranks). Each rank keeps at most its share; what it stored is held or
/// evicted, exactly; one rank's flood takes nothing from another.
#[test]
fn eight_publishers_filling_their_ranks_stay_in_the_index_share() {
    let ctx = zmq::Context::new();
    let (mut engines, port, _) = engines(&ctx, 8);
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(
        &dir,
        &format!(
            "[server]\nroute_max_peers = 64\nhealth_max_peers = 16\nstats_max_peers = 64\nhttp_max_connections = 16\n\
             [routing]\nsession_capacity = 1000\n[limits]\nmemory_budget_bytes = {}\n\
             [kv_events]\nconnect = [\"tcp://127.0.0.1:{port}+rank\"]\n",
            160 << 20
        ),
    );
    let d = Daemon::frozen("8", &["--config", &cfg]);
    d.bring_up(&d.publisher(), &[0, 1, 2, 3, 4, 5, 6, 7]);
    let share = part(&d, "events_index");
    let cap = share / 8 / 100;
    // Rank 7 holds a few blocks the others' floods must leave alone.
    let kept = |d: &Daemon| d.ranks()[7]["kv_blocks"]["GPU"].as_u64().unwrap_or(0);
    eventually("rank 7's first blocks indexed", || {
        engines[7].publish(vec![blocks16(1 << 50, 4, None)]);
        std::thread::sleep(Duration::from_millis(20));
        (kept(&d) == 4).then_some(())
    });
    let before = status_kib(d.pid(), "VmRSS");
    const PER_BATCH: u64 = 4_000;
    let per_rank = (cap / PER_BATCH + 3) * PER_BATCH;
    let c = d.client();
    for (rank, e) in engines.iter_mut().enumerate().take(7) {
        let base = (rank as u64 + 1) << 40;
        for b in 0..per_rank / PER_BATCH {
            let first = base + b * PER_BATCH;
            e.publish(vec![blocks16(first, PER_BATCH, (b > 0).then(|| first - 1))]);
            if b % 8 == 0 {
                assert_eq!(c.call(json!({"v": 1, "op": "route", "id": b}))["ok"], json!(true));
            }
        }
    }
    for rank in 0..7 {
        let stored = format!("dpcoord_kv_blocks_evicted_total{{dp_rank=\"{rank}\"}}");
        let held = eventually(&format!("rank {rank}'s flood applied"), || {
            let held = d.ranks()[rank]["kv_blocks"]["GPU"].as_u64()?;
            let evicted = d.metric(&stored)? as u64;
            (held + evicted == per_rank).then_some(held)
        });
        assert!(held <= cap && held >= cap - cap / 8, "rank {rank} holds {held}, its share is {cap}");
    }
    assert_eq!(kept(&d), 4, "rank 7's blocks are its own share's");
    assert_eq!(d.metric(r#"dpcoord_kv_blocks_evicted_total{dp_rank="7"}"#), Some(0.0));
    let peak = status_kib(d.pid(), "VmHWM");
    println!("KV flood: 7 x {per_rank} blocks, share {share} bytes, RSS before {before} KiB, peak {peak} KiB");
    assert!(peak < before + share / 1024 + SLACK_KIB, "peak {peak} KiB past the share");
    assert_eq!(d.metric("dpcoord_kv_event_gaps_total"), Some(0.0), "no batch was dropped");
}

/// A budget too small for the caps is refused, saying what they need.
#[test]
fn a_budget_below_the_reservations_is_refused_with_what_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(&dir, "[limits]\nmemory_budget_bytes = 16777216\n");
    let (code, err) = run_to_end(&["check-config", &cfg]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("limits.memory_budget_bytes: 16777216 bytes leave the prefix indexes 0")
            && err.contains("peers at their caps reserve 94371840"),
        "{err}"
    );
}
