//! Faults against the real binary: engines that die, hang, restart with a
//! new boot, publish out of order or publish nonsense; a rank flapping up
//! and down; dpcoord itself killed (SIGTERM and SIGKILL) and restarted on
//! the same endpoints while engines keep publishing and frontends keep
//! asking. Every user query gets its reply; epochs are exact; no wait
//! asserts how long it took.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::common::*;
use serde_json::{json, Value};

/// How often a simulated engine publishes.
const BEAT: Duration = Duration::from_millis(20);

const PUBLISH: u8 = 0;
const HANG: u8 = 1;
const DIE: u8 = 2;

/// A simulated engine: publishes a valid update for `rank` every [`BEAT`]
/// (seq 1, 2, ... of `boot`) while its mode is [`PUBLISH`]; keeps its socket
/// but sends nothing on [`HANG`]; closes its socket on [`DIE`].
struct Engine {
    mode: Arc<AtomicU8>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// `bind`: the engine binds `ep` (dpcoord connects with `--stats-connect`); else it connects.
    fn start(ep: &str, bind: bool, rank: u32, boot: u64) -> Engine {
        let mode = Arc::new(AtomicU8::new(PUBLISH));
        let (m, ep) = (Arc::clone(&mode), ep.to_owned());
        let thread = std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let p = ctx.socket(zmq::PUB).unwrap();
            p.set_linger(0).unwrap();
            if bind {
                p.bind(&ep).unwrap();
            } else {
                p.connect(&ep).unwrap();
            }
            let mut seq = 0;
            loop {
                match m.load(Ordering::Relaxed) {
                    PUBLISH => {
                        seq += 1;
                        p.send(encode(&update(rank, boot, seq, [0; 5])), 0).unwrap();
                    }
                    HANG => {}
                    _ => return,
                }
                std::thread::sleep(BEAT);
            }
        });
        Engine { mode, thread: Some(thread) }
    }

    fn set(&self, mode: u8) {
        self.mode.store(mode, Ordering::Relaxed);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.set(DIE);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A frontend routing one query at a time until `stop`: every reply must be
/// an answer (id echoed) placing on a rank in `allowed` at that moment.
/// Returns the `(epoch, ranks)` of every answer.
fn frontend(d: &Daemon, stop: &AtomicBool, allowed: &Mutex<Vec<u64>>) -> Vec<(u64, Vec<u64>)> {
    let c = d.client();
    let mut seen = Vec::new();
    for i in 0u64.. {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        // Lock across the call: the test changes `allowed` only between answers.
        let allowed = allowed.lock().unwrap();
        let r = c.call(json!({"v": 1, "op": "route", "id": i, "n": 2}));
        assert_eq!((&r["ok"], &r["id"]), (&json!(true), &json!(i)), "{r}");
        let ranks = ranks_of(&r);
        assert!(ranks.iter().all(|x| allowed.contains(x)), "{ranks:?} outside {allowed:?}");
        seen.push((r["epoch"].as_u64().unwrap(), ranks));
    }
    seen
}

#[test]
fn engines_that_die_or_hang_go_down_and_come_back_with_exact_epochs() {
    let d = Daemon::start(&[
        "--dp-size",
        "4",
        "--tick-ms",
        "20",
        "--stale-after-ms",
        "300",
        "--down-after-ms",
        "800",
        "--pending-ttl-ms",
        "3600000",
    ]);
    let mut engines: Vec<Engine> = (0..4).map(|r| Engine::start(&d.stats, false, r, 1)).collect();
    let s = eventually("all four up", || Some(d.state()).filter(|s| statuses(s) == json!(["up", "up", "up", "up"])));
    assert_eq!(s["epoch"], json!(4), "one bump per rank coming up");

    let stop = AtomicBool::new(false);
    let allowed = Mutex::new(vec![0, 1, 2, 3]);
    let answers = std::thread::scope(|scope| {
        let _stop = SetOnDrop(&stop);
        let f = scope.spawn(|| frontend(&d, &stop, &allowed));

        // Rank 1's engine dies (its socket closes): down, one epoch bump.
        engines[1].set(DIE);
        let s = d.wait_status(1, "down");
        assert_eq!((s["epoch"].clone(), statuses(&s)), (json!(5), json!(["up", "down", "up", "up"])));
        // Rank 2's engine hangs (connected, silent): down, one more bump.
        *allowed.lock().unwrap() = vec![0, 2, 3];
        engines[2].set(HANG);
        let s = d.wait_status(2, "down");
        assert_eq!((s["epoch"].clone(), statuses(&s)), (json!(6), json!(["up", "down", "down", "up"])));
        *allowed.lock().unwrap() = vec![0, 3];
        let r = d.client().call(json!({"v": 1, "op": "route", "n": 4}));
        let ranks = r["ranks"].as_array().unwrap();
        assert_eq!(ranks.iter().filter(|&x| x == 0).count(), 2, "{r}");
        assert_eq!(ranks.iter().filter(|&x| x == 3).count(), 2, "{r}");

        // Rank 1 restarts (a new process: new socket, boot 2, seq from 1).
        let before = d.routed_pending()[1].0;
        assert!(before > 0, "rank 1 had placements before it died");
        *allowed.lock().unwrap() = vec![0, 1, 3];
        engines[1] = Engine::start(&d.stats, false, 1, 2);
        let s = d.wait_status(1, "up");
        assert_eq!(s["epoch"], json!(7));
        assert_eq!(s["ranks"][1]["boot"], json!(2));
        // Rank 2's engine resumes its boot: readmitted.
        *allowed.lock().unwrap() = vec![0, 1, 2, 3];
        engines[2].set(PUBLISH);
        let s = d.wait_status(2, "up");
        assert_eq!((s["epoch"].clone(), statuses(&s)), (json!(8), json!(["up", "up", "up", "up"])));
        let r = d.client().call(json!({"v": 1, "op": "route", "n": 4}));
        let mut ranks = ranks_of(&r);
        ranks.sort();
        assert_eq!((ranks, &r["epoch"]), (vec![0, 1, 2, 3], &json!(8)), "{r}");
        stop.store(true, Ordering::Relaxed);
        f.join().unwrap()
    });
    // The frontend was answered throughout, and saw each epoch in turn.
    let mut epochs: Vec<u64> = answers.iter().map(|(e, _)| *e).collect();
    epochs.dedup();
    assert!(epochs.windows(2).all(|w| w[0] < w[1]), "{epochs:?}");
    assert!(epochs.iter().all(|e| (4..=8).contains(e)), "{epochs:?}");
    // Rank 1's books started over with boot 2: its routed counts exactly the
    // placements made since it came back (epoch 7 on), the frontend's and ours.
    let since_restart: usize =
        answers.iter().filter(|(e, _)| *e >= 7).map(|(_, r)| r.iter().filter(|&&x| x == 1).count()).sum();
    assert_eq!(d.routed_pending()[1].0, since_restart as u64 + 1);
    drop(engines);
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn out_of_order_seq_is_dropped_as_stale_and_gaps_count_as_missed() {
    let d = Daemon::frozen("1", &[]);
    let p = d.publisher();
    let s = d.bring_up(&p, &[0]);
    p.send(&update(0, 1, s, [7, 0, 0, 0, 0]));
    d.await_counts(0, [7, 0, 0, 0, 0]);
    let metric = |name: &str| d.metric(name).unwrap();
    let (ok, stale, missed) = (
        metric("dpcoord_stats_messages_total{result=\"ok\"}"),
        metric("dpcoord_stats_messages_total{result=\"stale\"}"),
        metric("dpcoord_stats_missed_total"),
    );
    // Arrival order: s+3, s+5, s+4 (late), s+6, s+1 (late), s+6 (duplicate).
    // A late update carries counts that, if applied, would make s+6 go backwards.
    for (seq, waiting, received) in [(3, 1, 1), (5, 2, 2), (4, 9, 90), (6, 3, 3), (1, 9, 90), (6, 9, 90)] {
        p.send(&update(0, 1, s + seq, [waiting, 0, received, 0, 0]));
    }
    d.await_counts(0, [3, 0, 3, 0, 0]);
    // A barrier after the duplicate, so every update above was handled.
    p.send(&update(0, 1, s + 7, [4, 0, 3, 0, 0]));
    d.await_counts(0, [4, 0, 3, 0, 0]);
    assert_eq!(metric("dpcoord_stats_messages_total{result=\"ok\"}") - ok, 4.0);
    assert_eq!(metric("dpcoord_stats_messages_total{result=\"stale\"}") - stale, 3.0);
    // Gaps seen when applied: s -> s+3 (2 missed), s+3 -> s+5 (1), then none.
    assert_eq!(metric("dpcoord_stats_missed_total") - missed, 3.0);
    assert_eq!(d.ranks()[0]["status"], json!("up"));
}

/// Every sample in `/metrics` is a number, and the request gauges are not
/// negative. The KV usage of a rank whose updates carry none is NaN by
/// definition (docs/operations.md), so it is not counted.
fn assert_sane_metrics(d: &Daemon) {
    let (_, body) = d.http_get("/metrics");
    for line in body.lines().filter(|l| !l.starts_with('#') && !l.starts_with("dpcoord_engine_kv_usage{")) {
        let value = line.rsplit_once(' ').unwrap().1;
        assert_ne!(value, "NaN", "{line}");
        if line.starts_with("dpcoord_engine_requests{") || line.starts_with("dpcoord_engine_penalty{") {
            assert!(!value.starts_with('-'), "negative: {line}");
        }
    }
}

/// Every rank's penalty is a number within `0..=max_penalty` (10).
fn penalties(d: &Daemon) -> Vec<f64> {
    let s = d.state();
    s["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let p = r["penalty"].as_f64().unwrap_or_else(|| panic!("penalty is not a number: {r}"));
            assert!((0.0..=10.0).contains(&p), "penalty out of range: {r}");
            p
        })
        .collect()
}

fn least_load(dp: &str) -> Daemon {
    Daemon::frozen(dp, &["--policy", "least_load", "--tick-ms", "20"])
}

#[test]
fn absurd_ttft_is_capped_at_max_penalty_and_the_other_ranks_take_the_traffic() {
    let d = least_load("3");
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0, 1, 2]);
    let with = |rank: u32, seq: u64, ttft: f64, tpot: f64| Update::new(rank, 1, seq).ttft(ttft).tpot(tpot).value();
    // The median is 100: rank 0's ratio is 1e298, far above anything the
    // penalty formula can use; f64::MAX would overflow a careless sum.
    p.send(&with(0, seq, 1e300, f64::MAX));
    p.send(&with(1, seq, 50.0, 1e-300));
    p.send(&with(2, seq, 100.0, 0.0));
    eventually("the ttft penalty", || (penalties(&d) == [10.0, 0.0, 0.0]).then_some(()));
    // Rank 0 costs (0 + 1) * (1 + 10) = 11: the others take placements until
    // their own (4 * pending + 1) passes that.
    let r = d.client().call(json!({"v": 1, "op": "route", "n": 6}));
    assert_eq!(per_rank(&ranks_of(&r), 3), [0, 3, 3], "{r}");
    let r = d.client().call(json!({"v": 1, "op": "route"}));
    assert_eq!(r["ranks"], json!([0]), "a penalized rank still takes traffic when the others are loaded");
    // The whole fleet slows to absurd values: the median moves with it, nobody is singled out.
    p.send(&with(0, seq + 1, f64::MAX, 1e300));
    p.send(&with(1, seq + 1, f64::MAX, 1e300));
    p.send(&with(2, seq + 1, f64::MAX, 1e300));
    eventually("penalties back to 0", || (penalties(&d) == [0.0, 0.0, 0.0]).then_some(()));
    assert_sane_metrics(&d);
    assert_eq!(d.stop().code(), Some(0), "the coordinator survived");
}

#[test]
fn absurd_counts_and_tokens_from_an_engine_do_not_crash_or_poison_routing() {
    let d = least_load("3");
    let p = d.publisher();
    let seq = d.bring_up(&p, &[0, 1, 2]);
    let max = u64::MAX;
    p.send(&Update::new(0, 1, seq).counts([max; 5]).tokens([max, max]).value());
    d.await_counts(0, [max; 5]);
    // Several ticks see the absurd finished/failed counters.
    eventually("a tick exporting rank 0's gauges", || {
        (d.metric("dpcoord_engine_requests{dp_rank=\"0\",state=\"waiting\"}") != Some(0.0)).then_some(())
    });
    let first = penalties(&d);
    assert_eq!(&first[1..], [0.0, 0.0]);
    assert_sane_metrics(&d);
    // The policy sends everything to the sane ranks; a pin still lands on rank 0.
    let c = d.client();
    let r = c.call(json!({"v": 1, "op": "route", "n": 10}));
    assert_eq!(per_rank(&ranks_of(&r), 3), [0, 5, 5], "{r}");
    let r = c.call(json!({"v": 1, "op": "route", "rank": 0, "n": 2}));
    assert_eq!(r["ranks"], json!([0, 0]), "{r}");
    // The engine restarts and reports absurd counters again (totals across boots).
    p.send(&update(0, 2, 1, [max; 5]));
    eventually("rank 0 on boot 2", || (d.ranks()[0]["boot"] == json!(2)).then_some(()));
    p.send(&update(0, 2, 2, [max; 5]));
    d.await_counts(0, [max; 5]);
    let r = c.call(json!({"v": 1, "op": "route", "n": 4}));
    assert_eq!(per_rank(&ranks_of(&r), 3), [0, 2, 2], "{r}");
    eventually("a tick after the restart", || (d.ranks()[0]["age_ms"].as_u64() > Some(40)).then_some(()));
    penalties(&d);
    assert_sane_metrics(&d);
    assert_eq!(d.stop().code(), Some(0), "the coordinator survived");
}

#[test]
fn absurd_prompt_tokens_from_a_frontend_do_not_crash_or_poison_least_tokens() {
    let d = Daemon::frozen("2", &["--policy", "least_tokens"]);
    d.bring_up(&d.publisher(), &[0, 1]);
    let c = d.client();
    let max = u64::MAX;
    // Two absurd requests on each rank, then ordinary ones: the ranks are
    // equally (absurdly) loaded, so ordinary traffic still alternates.
    let r = c.call(json!({"v": 1, "op": "route", "n": 4, "prompt_tokens": max}));
    assert_eq!(per_rank(&ranks_of(&r), 2), [2, 2], "{r}");
    let r = c.call(json!({"v": 1, "op": "route", "n": 6, "prompt_tokens": 100}));
    assert_eq!(per_rank(&ranks_of(&r), 2), [3, 3], "{r}");
    // A tick has exported the books (gauges are refreshed on ticks).
    eventually("a tick exporting the placements", || {
        (d.metric("dpcoord_engine_requests{dp_rank=\"0\",state=\"pending\"}") == Some(5.0)).then_some(())
    });
    // Each placement's prompt length is capped at 2^32 - 1 tokens: two absurd
    // ones and three of 100 tokens per rank, exactly.
    for rank in d.ranks() {
        assert_eq!(rank["load"], json!(2.0 * 4294967295.0 + 300.0), "{rank}");
    }
    assert_sane_metrics(&d);
    assert_eq!(d.stop().code(), Some(0), "the coordinator survived");
}

#[test]
fn a_flapping_rank_stays_down_on_isolated_updates_and_the_epoch_moves_once_per_change() {
    const STALE_MS: u64 = 200;
    let d = Daemon::start(&[
        "--dp-size",
        "2",
        "--tick-ms",
        "20",
        "--stale-after-ms",
        "200",
        "--down-after-ms",
        "1000",
        "--pending-ttl-ms",
        "3600000",
    ]);
    // readmit_updates is 2 (the default). Rank 0 publishes throughout.
    let _rank0 = Engine::start(&d.stats, false, 0, 1);
    d.wait_status(0, "up");
    let p = d.publisher();
    let mut seq = d.bring_up(&p, &[1]);
    assert_eq!(d.state()["epoch"], json!(2));
    let epoch = |d: &Daemon| d.state()["epoch"].as_u64().unwrap();
    let stop = AtomicBool::new(false);
    let allowed = Mutex::new(vec![0, 1]);
    // Publishes one update per `waiting`, back to back; returns rank 1 once the last shows.
    let mut send = |waitings: &[u64]| {
        for &w in waitings {
            p.send(&update(1, 1, seq, [w, 0, 0, 0, 0]));
            seq += 1;
        }
        d.await_counts(1, [waitings[waitings.len() - 1], 0, 0, 0, 0])
    };
    let gap = |d: &Daemon| {
        eventually("a gap above stale_after_ms", || (d.ranks()[1]["age_ms"].as_u64() > Some(STALE_MS)).then_some(()))
    };
    let answers = std::thread::scope(|scope| {
        let _stop = SetOnDrop(&stop);
        let f = scope.spawn(|| frontend(&d, &stop, &allowed));
        for round in 0..2u64 {
            // Silent: down, one bump.
            let s = d.wait_status(1, "down");
            assert_eq!(s["epoch"], json!(3 + 2 * round));
            *allowed.lock().unwrap() = vec![0];
            // Isolated updates (each more than stale_after_ms after the last): never readmitted.
            for i in 0..3 {
                gap(&d);
                let r = send(&[10 + i]);
                assert_eq!(r["status"], json!("down"), "round {round}, isolated update {i}");
                assert_eq!(epoch(&d), 3 + 2 * round);
            }
            // Two updates in a row: readmitted, one bump.
            gap(&d);
            *allowed.lock().unwrap() = vec![0, 1];
            assert_eq!(send(&[20, 21])["status"], json!("up"));
            assert_eq!(epoch(&d), 4 + 2 * round);
        }
        stop.store(true, Ordering::Relaxed);
        f.join().unwrap()
    });
    let mut epochs: Vec<u64> = answers.iter().map(|(e, _)| *e).collect();
    epochs.dedup();
    assert!(epochs.windows(2).all(|w| w[0] < w[1]) && epochs.iter().all(|e| (2..=6).contains(e)), "{epochs:?}");
    // While down (odd epochs) rank 1 got nothing; while routable the two alternate.
    for (e, ranks) in &answers {
        if e % 2 == 1 {
            assert_eq!(ranks, &[0, 0], "epoch {e}");
        } else {
            assert_eq!(per_rank(ranks, 2), [1, 1], "epoch {e}");
        }
    }
    assert_eq!(epoch(&d), 6);
}

/// Frontends that survive a dpcoord restart: each query is retried on a
/// fresh REQ socket when no reply came within `TRY` (the Lazy Pirate
/// pattern), until answered. Returns (answers, retries).
fn resilient_frontend(ep: &str, stop: &AtomicBool, done: &AtomicU64) -> (u64, u64) {
    const TRY: i32 = 300;
    let ctx = zmq::Context::new();
    let connect = || {
        let s = ctx.socket(zmq::REQ).unwrap();
        s.set_linger(0).unwrap();
        s.set_rcvtimeo(TRY).unwrap();
        s.connect(ep).unwrap();
        s
    };
    let mut s = connect();
    let (mut answered, mut retries) = (0, 0);
    while !stop.load(Ordering::Relaxed) {
        let id = answered;
        let q = encode(&json!({"v": 1, "op": "route", "id": id}));
        let started = std::time::Instant::now();
        let reply = loop {
            s.send(&q[..], 0).unwrap();
            match s.recv_bytes(0) {
                Ok(r) => break r,
                Err(zmq::Error::EAGAIN) => {
                    assert!(started.elapsed() < DEADLINE, "query {id} never answered");
                    retries += 1;
                    s = connect();
                }
                Err(e) => panic!("{e}"),
            }
        };
        let r: Value = rmp_serde::from_slice(&reply).unwrap();
        assert_eq!(r["id"], json!(id), "{r}");
        // A fresh dpcoord refuses until the first stats arrive; then it places.
        match r["ok"].as_bool() {
            Some(true) => assert!(r["ranks"][0].as_u64().unwrap() < 3, "{r}"),
            _ => assert_eq!(r["error"]["code"], json!("no_engine_available"), "{r}"),
        }
        answered += 1;
        done.fetch_add(1, Ordering::Relaxed);
    }
    (answered, retries)
}

/// dpcoord is stopped with `signal` and a new one started on the same
/// endpoints, while 3 engines keep publishing (binding their own endpoints
/// when `engines_bind`, else connecting to dpcoord's) and 4 frontends keep routing.
fn restart_case(signal: &str, engines_bind: bool) {
    let engine_dir = tempfile::tempdir().unwrap();
    let engine_ep = |r: u32| format!("ipc://{}/engine{r}", engine_dir.path().display());
    let mut args: Vec<String> = ["--dp-size", "3", "--tick-ms", "20"].map(String::from).to_vec();
    if engines_bind {
        for r in 0..3 {
            args.extend(["--stats-connect".to_owned(), engine_ep(r)]);
        }
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut d = Daemon::start(&args);
    let _engines: Vec<Engine> =
        (0..3)
            .map(|r| {
                if engines_bind {
                    Engine::start(&engine_ep(r), true, r, 1)
                } else {
                    Engine::start(&d.stats, false, r, 1)
                }
            })
            .collect();
    let s = eventually("all ranks up", || Some(d.state()).filter(|s| statuses(s) == json!(["up", "up", "up"])));
    assert_eq!(s["epoch"], json!(3));

    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let route = d.route.clone();
    let results = std::thread::scope(|scope| {
        let _stop = SetOnDrop(&stop);
        let fronts: Vec<_> = (0..4).map(|_| scope.spawn(|| resilient_frontend(&route, &stop, &done))).collect();
        eventually("frontends busy", || (done.load(Ordering::Relaxed) >= 100).then_some(()));
        let status = d.restart(signal);
        match signal {
            "KILL" => assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9), "{status}"),
            _ => assert_eq!(status.code(), Some(0), "{status}"),
        }
        // The new dpcoord knows nothing, and has every rank up from the next stats.
        let s = eventually("all ranks up after the restart", || {
            Some(d.state()).filter(|s| statuses(s) == json!(["up", "up", "up"]))
        });
        assert_eq!(s["epoch"], json!(3), "a fresh epoch: one bump per rank");
        let after = done.load(Ordering::Relaxed);
        eventually("frontends answered by the new dpcoord", || {
            (done.load(Ordering::Relaxed) >= after + 100).then_some(())
        });
        stop.store(true, Ordering::Relaxed);
        fronts.into_iter().map(|f| f.join().unwrap()).collect::<Vec<_>>()
    });
    println!("SIG{signal}, engines bind: {engines_bind}: (answered, retries) per frontend {results:?}");
    let r = d.client().call(json!({"v": 1, "op": "route", "n": 3}));
    assert_eq!(per_rank(&ranks_of(&r), 3), [1, 1, 1], "{r}");
    assert_eq!(d.stop().code(), Some(0));
}

#[test]
fn dpcoord_stopped_with_sigterm_and_restarted_rebuilds_from_the_next_stats() {
    restart_case("TERM", false);
}

#[test]
fn dpcoord_killed_with_sigkill_and_restarted_rebuilds_from_the_next_stats() {
    restart_case("KILL", true);
}
