//! `cache_aware`'s decisions explained through the real binary
//! (docs/PROTOCOL.md §4, `explain` and `delivered`): what a placement
//! predicted was cached on its rank and on the best one, from KV events
//! and from dpcoord's own placements, in the reply and in
//! `dpcoord_prefix_predicted_tokens_total`; the engines' reports of what
//! they delivered in `dpcoord_prefix_reported_tokens_total` and the
//! error histogram; refused queries change nothing.

use crate::common::*;
use serde_json::{json, Value};

const PROMPT: [u32; 7] = [1, 2, 3, 4, 5, 6, 7];

fn predicted(d: &Daemon, rank: u32, of: &str) -> Option<f64> {
    d.metric(&format!("dpcoord_prefix_predicted_tokens_total{{dp_rank=\"{rank}\",of=\"{of}\"}}"))
}

fn reported(d: &Daemon, rank: u32, kind: &str) -> Option<f64> {
    d.metric(&format!("dpcoord_prefix_reported_tokens_total{{dp_rank=\"{rank}\",kind=\"{kind}\"}}"))
}

/// A route query for `PROMPT`'s tokens with `extra` keys.
fn route(d: &Daemon, extra: Value) -> Value {
    let mut q = json!({"v": 1, "op": "route", "tokens": PROMPT, "explain": true});
    q.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    let r = d.client().call(q);
    assert_eq!(r["ok"], json!(true), "{r}");
    r
}

#[test]
fn events_predict_what_each_rank_holds_and_the_reply_tells_it_when_asked() {
    let ctx = zmq::Context::new();
    let (mut e, p, r) = engines(&ctx, 2);
    let (connect, replay) = (format!("tcp://127.0.0.1:{p}+rank"), format!("tcp://127.0.0.1:{r}+rank"));
    let d = Daemon::frozen(
        "2",
        &["--policy", "cache_aware", "--kv-events-connect", &connect, "--kv-events-replay", &replay],
    );
    d.bring_up(&d.publisher(), &[0, 1]);
    join(&d, &mut e);
    // Blocks of 2 tokens: rank 0 holds PROMPT's 3 whole blocks, rank 1 its first.
    e[0].publish(vec![stored(&[10, 11, 12], None, &[1, 2, 3, 4, 5, 6])]);
    e[1].publish(vec![stored(&[20], None, &[1, 2])]);
    await_prefix(&d, &PROMPT, json!({"blocks": 3, "matched": [3, 1]}));

    // Prompts are keyed in the engines' blocks of 2 now, on both sockets' `ping`.
    assert_eq!(d.client().call(json!({"v": 1, "op": "ping"}))["block_size"], json!(2));
    assert_eq!(d.health_client().call(json!({"v": 1, "op": "ping"}))["block_size"], json!(2));
    let r = route(&d, json!({}));
    assert_eq!(r["ranks"], json!([0]));
    assert_eq!(
        r["explain"],
        json!({"best": 6, "chosen": [{"rank": 0, "predicted": 6, "index": "events"}], "block_size": 2})
    );
    // A pin is explained too: it gives up 4 cached tokens.
    let r = route(&d, json!({"rank": 1, "n": 2}));
    assert_eq!(r["ranks"], json!([1, 1]));
    assert_eq!(
        r["explain"],
        json!({"best": 6, "chosen": [{"rank": 1, "predicted": 2, "index": "events"}], "block_size": 2})
    );
    // Not asked: no `explain`, but counted all the same. No prompt: nothing to explain.
    let r = route(&d, json!({"explain": false, "rank": 0}));
    assert_eq!((r["ranks"].clone(), r.get("explain")), (json!([0]), None));
    let r = d.client().call(json!({"v": 1, "op": "route", "explain": true, "rank": 1}));
    assert_eq!((r["ranks"].clone(), r.get("explain")), (json!([1]), None));

    assert_eq!([predicted(&d, 0, "chosen"), predicted(&d, 0, "best")], [Some(12.0), Some(12.0)]);
    assert_eq!([predicted(&d, 1, "chosen"), predicted(&d, 1, "best")], [Some(4.0), Some(12.0)]);
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn without_events_dpcoords_own_placements_predict_and_say_so_and_the_guard_too() {
    let d = Daemon::frozen("2", &["--policy", "cache_aware"]);
    d.bring_up(&d.publisher(), &[0, 1]);
    // No KV event yet: blocks of 16, so 32 tokens are 2 blocks; `ping` says so.
    assert_eq!(d.client().call(json!({"v": 1, "op": "ping"}))["block_size"], json!(16));
    let prompt: Vec<u32> = (1..=32).collect();
    let ask = || d.client().call(json!({"v": 1, "op": "route", "tokens": prompt, "explain": true}));
    let first = ask();
    assert_eq!(first["ranks"], json!([0]));
    assert_eq!(
        first["explain"],
        json!({"best": 0, "chosen": [{"rank": 0, "predicted": 0, "index": "approximate"}], "block_size": 16})
    );
    let second = ask();
    assert_eq!(second["ranks"], json!([0]));
    assert_eq!(
        second["explain"],
        json!({"best": 32, "chosen": [{"rank": 0, "predicted": 32, "index": "approximate"}], "block_size": 16})
    );
    assert_eq!([predicted(&d, 0, "chosen"), predicted(&d, 1, "chosen")], [Some(32.0), Some(0.0)]);
    // A pinned 40,000-token request spreads the loads past the balance
    // guard (32,768 tokens and 2x): load alone decides, and says so.
    d.client().call(json!({"v": 1, "op": "route", "rank": 0, "prompt_tokens": 40_000}));
    let guarded = ask();
    assert_eq!(guarded["ranks"], json!([1]));
    assert_eq!(
        guarded["explain"],
        json!({"best": 32, "guarded": true, "chosen": [{"rank": 1, "predicted": 0, "index": "approximate"}], "block_size": 16})
    );
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn delivered_reports_are_counted_per_rank_with_the_error_of_each() {
    let d = Daemon::frozen("2", &[]);
    let c = d.client();
    let report = |rank: i64, p: Value, dl: Value| {
        c.call(json!({"v": 1, "op": "delivered", "id": 5, "rank": rank, "predicted": p, "delivered": dl}))
    };
    assert_eq!(report(0, json!(32), json!(16)), json!({"v": 1, "ok": true, "id": 5}));
    assert_eq!(report(1, json!(0), json!(16))["ok"], json!(true));
    // Refused, and counted nowhere but in the refusals.
    assert_eq!(report(1, json!(-1), json!(0))["error"]["code"], json!("bad_request"));
    assert_eq!(report(1, json!(1), json!("16"))["error"]["code"], json!("bad_request"));
    assert_eq!(report(2, json!(1), json!(1))["error"]["code"], json!("invalid_rank"));
    let health = d.health_client().call(json!({"v": 1, "op": "delivered", "rank": 0, "predicted": 1, "delivered": 1}));
    assert_eq!(health["error"]["code"], json!("unknown_op"));

    assert_eq!([reported(&d, 0, "predicted"), reported(&d, 0, "delivered")], [Some(32.0), Some(16.0)]);
    assert_eq!([reported(&d, 1, "predicted"), reported(&d, 1, "delivered")], [Some(0.0), Some(16.0)]);
    let bucket = |le: &str| d.metric(&format!("dpcoord_prefix_prediction_error_tokens_bucket{{le=\"{le}\"}}"));
    assert_eq!(
        [bucket("-64"), bucket("-16"), bucket("-1"), bucket("0"), bucket("16"), bucket("+Inf")],
        [Some(0.0), Some(1.0), Some(1.0), Some(1.0), Some(2.0), Some(2.0)]
    );
    assert_eq!(d.metric("dpcoord_prefix_prediction_error_tokens_sum"), Some(0.0));
    assert_eq!(d.metric("dpcoord_route_errors_total{code=\"bad_request\"}"), Some(2.0));
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn an_explain_that_is_not_a_bool_is_refused_and_places_nothing() {
    let d = Daemon::frozen("2", &["--policy", "cache_aware"]);
    d.bring_up(&d.publisher(), &[0, 1]);
    for bad in [json!("yes"), json!(1), json!([true])] {
        let r = d.client().call(json!({"v": 1, "op": "route", "id": "q", "tokens": PROMPT, "explain": bad}));
        assert_eq!(r["error"]["code"], json!("bad_request"), "{r}");
        assert_eq!(r["id"], json!("q"));
    }
    assert_eq!(d.routed(), [0, 0]);
    assert_eq!([predicted(&d, 0, "chosen"), predicted(&d, 1, "chosen")], [Some(0.0), Some(0.0)]);
    assert_eq!(d.stop().code(), Some(0));
}
