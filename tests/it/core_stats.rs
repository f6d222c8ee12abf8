//! Engine stats over a real PUB socket: every `StatsUpdate` rule drops a bad
//! update whole without changing state; an engine restart (higher `boot`)
//! starts its counters and `routed` over; a lower `boot` is dropped.
//!
//! Technique: PUB/SUB keeps order per connection, so after each bad update
//! a valid "marker" update follows with distinct counts. The bad update
//! carries the marker's own `seq` and a `received` above the marker's, so
//! if it were applied the marker would be dropped (stale, or counters going
//! backwards) and `state` would show the bad counts instead; a wrongly
//! applied lower `boot` would make the marker a restart, resetting `routed`.

use crate::common::*;
use rmpv::Value as M;
use serde_json::json;

/// Liveness and pending expiry far out, so only updates and queries change state.
fn daemon(dp: &str) -> Daemon {
    Daemon::frozen(dp, &[])
}

/// The bad updates' counts: far above the markers' `received`, `finished`, `failed`.
const BAD_COUNTS: [u64; 5] = [9, 9, 100, 90, 5];

/// A well-formed update for rank 0, boot 1, `seq`, with [`BAD_COUNTS`].
fn base(seq: u64) -> Update {
    Update::new(0, 1, seq).counts(BAD_COUNTS)
}

fn with(seq: u64, key: &'static str, v: M) -> Vec<u8> {
    base(seq).set(key, v).bytes()
}

fn without(seq: u64, key: &str) -> Vec<u8> {
    base(seq).without(key).bytes()
}

/// dp_size 2: rank 0 up (boot 1) with 6 placements, 2 acknowledged; rank 1 unknown.
struct Rig {
    d: Daemon,
    p: Publisher,
    /// The last `seq` applied for rank 0.
    seq: u64,
    cases: u64,
}

impl Rig {
    fn new() -> Rig {
        let d = daemon("2");
        let p = d.publisher();
        let seq = d.bring_up(&p, &[0]);
        let r = d.client().call(json!({"v": 1, "op": "route", "n": 6}));
        assert_eq!(r["ranks"], json!([0, 0, 0, 0, 0, 0]));
        p.send(&update(0, 1, seq, [1, 1, 2, 1, 1]));
        let e = d.await_counts(0, [1, 1, 2, 1, 1]);
        assert_eq!((&e["routed"], &e["pending"], &e["boot"]), (&json!(6), &json!(4), &json!(1)));
        Rig { d, p, seq, cases: 0 }
    }

    /// Publishes `bad(seq)` then a marker at that same `seq`, and checks
    /// that only the marker was applied.
    fn dropped(&mut self, what: &str, bad: impl FnOnce(u64) -> Vec<u8>) {
        let before = self.d.books();
        let seq = self.seq + 1;
        self.p.send_raw(&bad(seq));
        self.cases += 1;
        // Gauges move (up and down) with every marker; counters stay put.
        let marker = [10 + self.cases % 7, self.cases % 3, 2, 1, 1];
        let mut polls = 0;
        let after = eventually(&format!("{what}: the marker update"), || {
            // The marker is re-sent now and then (a duplicate is a stale drop):
            // an oversized update may cost the publisher its connection.
            if polls % 20 == 0 {
                self.p.send(&update(0, 1, seq, marker));
            }
            polls += 1;
            let v = self.d.books();
            (v["ranks"][0]["counts"] != before["ranks"][0]["counts"]).then_some(v)
        });
        let mut want = before;
        want["ranks"][0]["counts"] = json!(marker);
        assert_eq!(after, want, "{what}: the bad update changed state");
        self.seq = seq;
    }

    /// [`Rig::dropped`] for each `(what, key, value)`: [`base`] with `key` set to `value`.
    fn dropped_each(&mut self, cases: Vec<(&str, &'static str, M)>) {
        for (what, key, v) in cases {
            self.dropped(what, |seq| with(seq, key, v));
        }
    }
}

#[test]
fn undecodable_and_non_map_updates_are_dropped() {
    let mut t = Rig::new();
    t.dropped("reserved marker", |_| vec![0xc1, 0x00]);
    t.dropped("empty frame", |_| Vec::new());
    t.dropped("truncated map", |seq| base(seq).bytes()[..12].to_vec());
    t.dropped("trailing bytes", |seq| [base(seq).bytes(), vec![0xc0]].concat());
    t.dropped("array of the fields", |seq| msgpack(&M::Array(base(seq).pairs().into_iter().map(|(_, v)| v).collect())));
    t.dropped("string", |_| msgpack(&M::from("stats")));
    t.dropped("integer key", |seq| {
        let mut m: Vec<(M, M)> = base(seq).pairs().into_iter().map(|(k, v)| (M::from(k), v)).collect();
        m.push((M::from(7), M::from(7)));
        msgpack(&M::Map(m))
    });
}

#[test]
fn updates_missing_a_required_key_are_dropped() {
    let mut t = Rig::new();
    for key in ["v", "rank", "boot", "seq", "counts"] {
        t.dropped(&format!("missing {key}"), |seq| without(seq, key));
        t.dropped(&format!("nil {key}"), |seq| with(seq, key, M::Nil));
    }
}

#[test]
fn updates_with_a_mistyped_field_or_another_version_are_dropped() {
    let mut t = Rig::new();
    let cases: Vec<(&str, &'static str, M)> = vec![
        ("v is a string", "v", "1".into()),
        ("version 2", "v", 2.into()),
        ("version 0", "v", 0.into()),
        ("rank is a string", "rank", "0".into()),
        ("rank is a float", "rank", 0.0.into()),
        ("boot is a string", "boot", "1".into()),
        ("boot is negative", "boot", (-1).into()),
        ("seq is a float", "seq", 2.5.into()),
        ("seq is negative", "seq", (-1).into()),
        ("counts is an int", "counts", 5.into()),
        ("counts is a map", "counts", M::Map(vec![])),
        ("a count is a float", "counts", M::Array(vec![9.5.into(), 9.into(), 100.into(), 90.into(), 5.into()])),
        ("a count is a string", "counts", M::Array(vec![9.into(), "9".into(), 100.into(), 90.into(), 5.into()])),
        ("tokens is a string", "tokens", "x".into()),
        ("kv_usage is a string", "kv_usage", "0.5".into()),
        ("ttft_ms is a bool", "ttft_ms", true.into()),
        ("tpot_ms is an array", "tpot_ms", ints(&[1])),
    ];
    t.dropped_each(cases);
}

#[test]
fn updates_with_wrong_array_lengths_or_negative_counts_are_dropped() {
    let mut t = Rig::new();
    let cases: Vec<(&str, &'static str, M)> = vec![
        ("4 counts", "counts", ints(&[9, 9, 100, 90])),
        ("6 counts", "counts", ints(&[9, 9, 100, 90, 5, 0])),
        ("no counts", "counts", ints::<u64>(&[])),
        ("negative waiting", "counts", ints(&[-1, 9, 100, 90, 5])),
        ("negative received", "counts", ints(&[9, 9, -100, 90, 5])),
        ("3 tokens", "tokens", ints(&[1, 2, 3])),
        ("negative tokens", "tokens", ints(&[1, -2])),
    ];
    t.dropped_each(cases);
}

#[test]
fn updates_with_nan_infinite_or_out_of_range_floats_are_dropped() {
    let mut t = Rig::new();
    let cases: Vec<(&str, &'static str, M)> = vec![
        ("NaN kv_usage", "kv_usage", f64::NAN.into()),
        ("NaN ttft_ms", "ttft_ms", f64::NAN.into()),
        ("NaN tpot_ms (f32)", "tpot_ms", M::F32(f32::NAN)),
        ("inf ttft_ms", "ttft_ms", f64::INFINITY.into()),
        ("inf tpot_ms", "tpot_ms", f64::INFINITY.into()),
        ("-inf ttft_ms", "ttft_ms", f64::NEG_INFINITY.into()),
        ("inf kv_usage", "kv_usage", f64::INFINITY.into()),
        ("kv_usage 1.5", "kv_usage", 1.5.into()),
        ("kv_usage just above 1", "kv_usage", 1.000_001.into()),
        ("kv_usage 2 as an int", "kv_usage", 2.into()),
        ("negative kv_usage", "kv_usage", (-0.1).into()),
        ("negative ttft_ms", "ttft_ms", (-1.0).into()),
        ("negative tpot_ms", "tpot_ms", (-0.5).into()),
    ];
    t.dropped_each(cases);
}

#[test]
fn counters_going_backwards_within_a_boot_are_dropped() {
    // The current counts are [_, _, received 2, finished 1, failed 1].
    let mut t = Rig::new();
    t.dropped("received 2 -> 1", |seq| with(seq, "counts", ints(&[9, 9, 1, 1, 1])));
    t.dropped("finished 1 -> 0", |seq| with(seq, "counts", ints(&[9, 9, 2, 0, 1])));
    t.dropped("failed 1 -> 0", |seq| with(seq, "counts", ints(&[9, 9, 2, 1, 0])));
}

#[test]
fn unknown_rank_stale_seq_and_stale_boot_are_dropped() {
    let mut t = Rig::new();
    for rank in [2i64, 3, -1, 1 << 32, (1 << 32) + 1, i64::MIN] {
        t.dropped(&format!("rank {rank}"), |seq| with(seq, "rank", rank.into()));
    }
    let last = t.seq;
    t.dropped("seq equal to the last", |_| with(last, "seq", last.into()));
    t.dropped("seq below the last", |_| with(last, "seq", (last - 1).into()));
    t.dropped("seq 0", |_| with(last, "seq", 0.into()));
    t.dropped("boot 0 below boot 1", |seq| with(seq, "boot", 0.into()));
}

#[test]
fn an_update_above_max_message_bytes_is_dropped() {
    let mut t = Rig::new();
    t.dropped("70 kB update", |seq| with(seq, "pad", M::Binary(vec![0; 70_000])));
}

#[test]
fn unknown_keys_nil_optionals_and_edge_floats_are_accepted() {
    // The control for the cases above: an update like theirs, but valid, is applied.
    let t = Rig::new();
    let seq = t.seq + 1;
    let u = base(seq)
        .set("future", M::Map(vec![("nested".into(), ints(&[1, 2]))]))
        .tokens([0, 7])
        .kv_usage(1.0)
        .set("ttft_ms", 0.into())
        .set("tpot_ms", M::Nil);
    t.p.send_raw(&u.bytes());
    let e = t.d.await_counts(0, [9, 9, 100, 90, 5]);
    // The engine reports more received than dpcoord placed: routed is raised to it.
    assert_eq!((&e["routed"], &e["pending"], &e["boot"]), (&json!(100), &json!(0), &json!(1)));
}

#[test]
fn restart_with_a_higher_boot_resets_counts_and_routed_and_a_lower_boot_is_dropped() {
    let d = daemon("2");
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0, 1]);
    let c = d.client();
    assert_eq!(c.call(json!({"v": 1, "op": "route", "n": 4}))["ranks"], json!([0, 1, 0, 1]));
    p.send(&update(0, 1, seq, [0, 1, 1, 1, 0]));
    let e = d.await_counts(0, [0, 1, 1, 1, 0]);
    assert_eq!((&e["routed"], &e["pending"]), (&json!(2), &json!(1)));
    let before = d.books();

    // Boot 7, with seq starting over: counts are the new boot's, and routed
    // becomes the new boot's `received`.
    p.send(&update(0, 7, 1, [0, 1, 3, 2, 0]));
    let e = d.await_counts(0, [0, 1, 3, 2, 0]);
    assert_eq!(e["boot"], json!(7));
    assert_eq!(e["status"], json!("up"));
    assert_eq!((&e["routed"], &e["pending"]), (&json!(3), &json!(0)));
    let after = d.books();
    assert_eq!(after["epoch"], before["epoch"], "a restart is not a routability change");
    assert_eq!(after["ranks"][1], before["ranks"][1], "rank 1 is untouched");

    // The user rotation carries on where it was.
    assert_eq!(c.call(json!({"v": 1, "op": "route", "n": 2}))["ranks"], json!([0, 1]));
    assert_eq!(d.routed_pending(), vec![(4, 1), (3, 3)]);

    // Boots 6 and 1 are older incarnations: dropped, whatever their seq.
    p.send(&update(0, 6, 100, [5, 5, 50, 50, 5]));
    p.send(&update(0, 1, seq + 1, [5, 5, 50, 50, 5]));
    p.send(&update(0, 7, 2, [2, 1, 3, 2, 0]));
    let e = d.await_counts(0, [2, 1, 3, 2, 0]);
    assert_eq!(e["boot"], json!(7));
    assert_eq!(d.routed_pending(), vec![(4, 1), (3, 3)]);
}

#[test]
fn placements_stop_counting_as_pending_after_pending_ttl() {
    let d = Daemon::start(&["--dp-size", "1", "--pending-ttl-ms", "1000", "--tick-ms", "20"]);
    let p = d.publisher();
    d.bring_up(&p, &[0]);
    d.client().call(json!({"v": 1, "op": "route", "n": 3}));
    assert_eq!(d.routed_pending(), vec![(3, 3)]);
    eventually("pending to expire", || (d.routed_pending() == vec![(3, 0)]).then_some(()));
}
