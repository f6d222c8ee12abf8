//! `cache_aware` (and `lmetric`) through the coordinator: the prefix term from
//! KV events, the balance guard, approximate mode, the load of a rank that
//! reports no tokens, and what it leaves alone.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::*;
use crate::config::{KvEndpoint, PrefixMode};
use crate::engines::kv::{KvBatch, KvBody, KvEvent, KvMessage, Medium, Stored};
use crate::engines::testing::settings;
use crate::routing::PolicyKind;

/// A prompt of 20 tokens: 5 blocks of 4.
const PROMPT: [u32; 20] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20];

fn coordinator(dp: u32, weight: f64, mode: PrefixMode) -> Coordinator {
    coordinator_for(PolicyKind::CacheAware, dp, weight, mode)
}

fn coordinator_for(policy: PolicyKind, dp: u32, weight: f64, mode: PrefixMode) -> Coordinator {
    let mut s = settings(dp);
    s.routing.policy = policy;
    s.routing.cache.prefill_weight = weight;
    s.routing.cache.mode = mode;
    let now = Instant::now();
    let kv = KvEndpoint { connect: "tcp://127.0.0.1:1".into(), replay: None, rank: None };
    let mut c = Coordinator::new(&s, Metrics::new(dp), now).with_kv_endpoints(&[kv]);
    for rank in 0..dp {
        let u = rmp_serde::to_vec_named(&json!({"v": 1, "rank": rank, "boot": 1, "seq": 1, "counts": [0, 0, 0, 0, 0]}))
            .unwrap();
        c.on_source(SourceKind::Stats, Some(&[&u[..]][..]), now);
    }
    c
}

/// Rank `rank` stores the first `blocks` blocks (of 4 tokens) of `PROMPT`, batch `seq`.
fn store(c: &mut Coordinator, seq: u64, rank: u32, blocks: usize) {
    store_sized(c, seq, rank, 4, blocks);
}

/// As [`store`], in blocks of `size` tokens.
fn store_sized(c: &mut Coordinator, seq: u64, rank: u32, size: usize, blocks: usize) {
    let ev = KvEvent::Stored(Stored {
        hashes: (0..blocks as u64).map(|b| 100 * u64::from(rank) + b).collect(),
        parent: None,
        tokens: PROMPT[..blocks * size].to_vec(),
        block_size: size as u32,
        medium: Medium::Gpu,
        lora: None,
        salt: None,
        unmatchable: None,
        group: 0,
    });
    let batch = Ok(KvBatch { rank: Some(rank), events: vec![ev] });
    c.on_event(
        EngineEvent::Kv(KvMessage { stream: 0, from_replay: false, body: KvBody::Batch { seq, batch } }),
        Instant::now(),
    );
}

fn ask(c: &mut Coordinator, ch: Channel, q: Value) -> Value {
    let mut out = Vec::new();
    c.on_query(ch, &rmp_serde::to_vec_named(&q).unwrap(), Instant::now(), &mut out);
    rmp_serde::from_slice(&out).unwrap()
}

fn place(c: &mut Coordinator, q: Value) -> u64 {
    let r = ask(c, Channel::Route, q);
    r["ranks"][0].as_u64().unwrap_or_else(|| panic!("{r}"))
}

fn with_prompt() -> Value {
    json!({"v": 1, "op": "route", "tokens": PROMPT})
}

#[test]
fn the_holder_wins_until_its_load_outweighs_what_its_cache_saves() {
    let mut c = coordinator(4, 4.0, PrefixMode::Events);
    store(&mut c, 0, 2, 4);
    // Rank 2 prefills 4 tokens, the others 20: at weight 4 that is 16 + 1
    // against 80 + 1; each placement adds its 20 prompt tokens to its rank.
    let got: Vec<u64> = (0..5).map(|_| place(&mut c, with_prompt())).collect();
    assert_eq!(got, vec![2, 2, 2, 2, 3], "17, 37, 57, 77 < 81; then 97 > 81");
    // Keys sent instead of tokens are the same prompt.
    let mut keys = Vec::new();
    let seed = crate::engines::prefix::keys::chain_seed(None, None);
    crate::engines::prefix::keys::chain_keys(seed, &PROMPT, 4, &mut keys);
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "block_keys": keys}));
    assert_eq!((&r["blocks"], &r["matched"]), (&json!(5), &json!([0, 0, 4, 0])));
    // A request without a prompt is least_tokens: rank 0 and 1 are idle.
    assert_eq!(place(&mut c, json!({"v": 1, "op": "route"})), 0);
}

#[test]
fn each_rank_is_matched_and_costed_in_its_own_block_size() {
    let mut c = coordinator(3, 4.0, PrefixMode::Events);
    // Ranks 0 and 1 hold 4 tokens in one block of 4; rank 2 holds 12 in blocks of 2.
    store(&mut c, 0, 0, 1);
    store(&mut c, 1, 1, 1);
    store_sized(&mut c, 2, 2, 2, 6);
    let view = c.state_view(Instant::now());
    let sizes: Vec<Option<u32>> = view.ranks.iter().map(|r| r.kv_block_size).collect();
    assert_eq!((view.kv_block_size, sizes), (Some(4), vec![Some(4), Some(4), Some(2)]), "4: most ranks use it");
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    assert_eq!((&r["blocks"], &r["matched"]), (&json!(5), &json!([1, 1, 6])), "each in its own blocks");
    // Rank 2 prefills 8 tokens, ranks 0 and 1 prefill 16 each.
    assert_eq!(place(&mut c, with_prompt()), 2);
    // Keys made in blocks of 4 match only the ranks of that size.
    let mut keys = Vec::new();
    let seed = crate::engines::prefix::keys::chain_seed(None, None);
    crate::engines::prefix::keys::chain_keys(seed, &PROMPT, 4, &mut keys);
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "block_keys": keys}));
    assert_eq!(r["matched"], json!([1, 1, 0]));
}

#[test]
fn the_guard_drops_affinity_when_loads_spread_too_far() {
    let mut c = coordinator(2, 4.0, PrefixMode::Events);
    store(&mut c, 0, 1, 5);
    let explained = json!({"v": 1, "op": "route", "tokens": PROMPT, "explain": true});
    // Rank 1 holds the whole prompt (0 to prefill): the prefix decides.
    let r = ask(&mut c, Channel::Route, explained.clone());
    assert_eq!((&r["ranks"], r["explain"].get("guarded")), (&json!([1]), None), "{r}");
    // Rank 0 gets a large pinned request: 40,000 tokens, beyond the
    // guard's 32,768 and 2x. Load alone decides, and the reply says so.
    place(&mut c, json!({"v": 1, "op": "route", "rank": 0, "prompt_tokens": 40_000}));
    let r = ask(&mut c, Channel::Route, explained.clone());
    assert_eq!((&r["ranks"], &r["explain"]["guarded"]), (&json!([1]), &json!(true)), "rank 1 is idle: {r}");
    // Now load rank 1 far beyond rank 0.
    place(&mut c, json!({"v": 1, "op": "route", "rank": 1, "prompt_tokens": 100_000}));
    // Spread 60,040 > 32,768 and 100,040 > 2 x 40,000: rank 0, whatever it holds.
    let r = ask(&mut c, Channel::Route, explained);
    assert_eq!((&r["ranks"], &r["explain"]["guarded"]), (&json!([0]), &json!(true)), "{r}");
    assert_eq!(r["explain"]["best"], json!(20), "{r}");
}

#[test]
fn approximate_mode_learns_from_policy_picks_and_forgets_after_the_ttl() {
    let mut c = coordinator(3, 4.0, PrefixMode::Approximate);
    // Prompts are keyed in blocks of 16 before any event: 20 tokens are one block.
    let first = place(&mut c, with_prompt());
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    let mut want = vec![0, 0, 0];
    want[first as usize] = 1;
    assert_eq!(r["matched"], json!(want));
    // A pin teaches nothing.
    let pinned = (first + 1) % 3;
    place(&mut c, json!({"v": 1, "op": "route", "rank": pinned, "tokens": PROMPT}));
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    assert_eq!(r["matched"], json!(want));
    // Events are ignored in this mode.
    store(&mut c, 0, 2, 5);
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    assert_eq!(r["matched"][2], json!(if first == 2 { 1 } else { 0 }));
    // After the TTL (120 s by default) with no new placement, it is forgotten.
    c.tick(Instant::now() + Duration::from_secs(121));
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    assert_eq!(r["matched"], json!([0, 0, 0]));
}

#[test]
fn auto_mode_takes_events_for_ranks_that_publish_and_placements_elsewhere() {
    let mut c = coordinator(2, 4.0, PrefixMode::Auto);
    // Rank 1 publishes: its index is event-fed (block size 4 from now on).
    store(&mut c, 0, 1, 2);
    // A pick lands on rank 1 (8 cached tokens); rank 0 learns nothing from it.
    assert_eq!(place(&mut c, with_prompt()), 1);
    // A pick that lands on rank 0 is learned there (rank 0 publishes nothing).
    place(&mut c, json!({"v": 1, "op": "route", "rank": 1, "prompt_tokens": 1000}));
    assert_eq!(place(&mut c, with_prompt()), 0);
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    assert_eq!(r["matched"], json!([5, 2]), "rank 0 from its placement, rank 1 from its events");
}

#[test]
fn health_queries_never_change_a_cache_aware_placement() {
    let run = |probe: bool| {
        let mut c = coordinator(3, 4.0, PrefixMode::Auto);
        store(&mut c, 0, 1, 5);
        (0..6)
            .map(|_| {
                if probe {
                    ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
                    ask(&mut c, Channel::Health, json!({"v": 1, "op": "health_route"}));
                }
                place(&mut c, with_prompt())
            })
            .collect::<Vec<u64>>()
    };
    assert_eq!(run(true), run(false));
}

/// Rank `rank`'s stats update number `seq` (boot 1) with `counts` and no token load.
fn report(c: &mut Coordinator, rank: u32, seq: u64, counts: [u64; 5]) {
    let u = rmp_serde::to_vec_named(&json!({"v": 1, "rank": rank, "boot": 1, "seq": seq, "counts": counts})).unwrap();
    c.on_source(SourceKind::Stats, Some(&[&u[..]][..]), Instant::now());
}

#[test]
fn on_request_counts_alone_a_deep_queue_loses_its_prefix_and_a_balanced_cluster_keeps_it() {
    let mut c = coordinator(4, 4.0, PrefixMode::Events);
    store(&mut c, 0, 2, 4);
    // No rank reports a token load (as vLLM): each queued request weighs the
    // mean prompt of recent placements (20 tokens here).
    for rank in 0..4 {
        report(&mut c, rank, 2, [2, 2, 0, 0, 0]);
    }
    // Balanced: 4 requests x 20 everywhere; rank 2 prefills 4 tokens, the others 20.
    assert_eq!(place(&mut c, with_prompt()), 2, "80 + 4*4 + 20 pending + 1 = 117 < 80 + 4*20 + 1 = 161");
    // Rank 2's queue deepens: 564 requests x 20 tokens outweigh what its cache saves.
    report(&mut c, 2, 3, [500, 64, 1, 0, 0]);
    let got: Vec<u64> = (0..3).map(|_| place(&mut c, with_prompt())).collect();
    assert!(!got.contains(&2), "{got:?}");
    assert_eq!(ask(&mut c, Channel::Route, json!({"v": 1, "op": "state"}))["ranks"][2]["load"], json!(564.0 * 20.0));
}

#[test]
fn lmetric_weighs_uncached_tokens_by_the_requests_in_flight() {
    let mut c = coordinator_for(PolicyKind::LMetric, 4, 4.0, PrefixMode::Events);
    store(&mut c, 0, 2, 4);
    // Rank 2 prefills 4 tokens: (4 + 1) x (in flight + 1) against (20 + 1) x 1
    // on an idle rank; each placement is one more in flight on its rank.
    let got: Vec<u64> = (0..6).map(|_| place(&mut c, with_prompt())).collect();
    assert_eq!(got, vec![2, 2, 2, 2, 3, 0], "5, 10, 15, 20 < 21; then 25 > 21, ties rotating from the last pick");
}

/// A degraded index earns no credit: in `events` mode its matches are 0,
/// in `auto` mode the rank's matches come from dpcoord's own placements,
/// as for a rank that publishes nothing, until its reset is applied (an
/// exact, empty index).
#[test]
fn a_degraded_rank_earns_no_prefix_credit_from_its_events() {
    for mode in [PrefixMode::Events, PrefixMode::Auto] {
        let mut c = coordinator(4, 4.0, mode);
        store(&mut c, 0, 2, 4);
        let matched = |c: &mut Coordinator| ask(c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
        assert_eq!(matched(&mut c)["matched"], json!([0, 0, 4, 0]), "{mode:?}");
        c.on_relinked(crate::wire::SourceKind::KvEvents { stream: 0, replay: false });
        assert_eq!(c.state_view(Instant::now()).ranks[2].kv_index, Some("degraded"));
        assert_eq!(matched(&mut c)["matched"], json!([0, 0, 0, 0]), "{mode:?}: degraded");
        // A policy pick: learned by the approximate index in auto mode only.
        let to = place(&mut c, with_prompt()) as usize;
        let mut want = [0; 4];
        if mode == PrefixMode::Auto {
            want[to] = 5;
        }
        assert_eq!(matched(&mut c)["matched"], json!(want), "{mode:?}: after a placement on {to}");
        while c.kv_pending() {
            c.apply_kv(usize::MAX);
        }
        assert_eq!(c.state_view(Instant::now()).ranks[2].kv_index, Some("exact"));
        assert_eq!(c.state_view(Instant::now()).ranks[0].kv_index, None, "rank 0 never published");
        if to == 2 {
            want[2] = 0;
        }
        assert_eq!(matched(&mut c)["matched"], json!(want), "{mode:?}: rank 2 exact and empty");
    }
}

/// Siblings arriving before the engine's first `BlockStored` (best-of-N):
/// each lands where the first went, as if its placement were cached,
/// until `routing.pending_ttl_ms` passes without events confirming it.
#[test]
fn siblings_land_together_until_events_confirm_or_the_placement_expires() {
    let mut c = coordinator(4, 4.0, PrefixMode::Events);
    for rank in 0..4 {
        store(&mut c, u64::from(rank), rank, 0);
    }
    let first = place(&mut c, with_prompt());
    for _ in 0..3 {
        assert_eq!(place(&mut c, with_prompt()), first, "a sibling follows the first");
    }
    let other = json!({"v": 1, "op": "route", "tokens": [9, 9, 9, 9, 9, 9, 9, 9]});
    assert_ne!(place(&mut c, other), first, "an unrelated prompt goes by load");
    let r = ask(&mut c, Channel::Health, json!({"v": 1, "op": "prefix", "tokens": PROMPT}));
    assert_eq!(r["matched"], json!([0, 0, 0, 0]), "the prefix op reports what events say is held");
    assert!(!c.prefix.recent_is_empty());
    c.tick(Instant::now() + Duration::from_secs(3));
    assert!(c.prefix.recent_is_empty(), "forgotten after pending_ttl_ms");
}

/// `explain` names where each rank's match came from: a degraded rank's
/// events give no credit (`degraded` in `events` mode, dpcoord's own
/// placements in `auto` mode), an exact one's do (`events`).
#[test]
fn explain_names_the_index_each_prediction_came_from() {
    for (mode, degraded) in [(PrefixMode::Events, "degraded"), (PrefixMode::Auto, "approximate")] {
        let mut c = coordinator(4, 4.0, mode);
        store(&mut c, 0, 2, 4);
        let pinned = json!({"v": 1, "op": "route", "tokens": PROMPT, "rank": 2, "explain": true});
        let r = ask(&mut c, Channel::Route, pinned.clone());
        assert_eq!(
            r["explain"],
            json!({"best": 16, "chosen": [{"rank": 2, "predicted": 16, "index": "events"}], "block_size": 4})
        );
        c.on_relinked(crate::wire::SourceKind::KvEvents { stream: 0, replay: false });
        let r = ask(&mut c, Channel::Route, pinned);
        assert_eq!(
            r["explain"],
            json!({"best": 0, "chosen": [{"rank": 2, "predicted": 0, "index": degraded}], "block_size": 4})
        );
    }
}
