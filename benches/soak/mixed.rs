//! Phase 2: minutes of mixed traffic, a line per interval.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::flood::garbage;
use crate::harness::*;

/// What the soak's frontends saw in one interval.
#[derive(Default)]
struct Window {
    lat: Latencies,
    refused: u64,
}

/// A paced frontend: `qps` mixed route queries a second until `stop`.
fn frontend(d: &Dpcoord, id: u64, qps: f64, stop: &AtomicBool, window: &Mutex<Window>) -> u64 {
    let c = d.req(&d.route, DEADLINE);
    let mut rng = SmallRng::seed_from_u64(100 + id);
    let every = Duration::from_secs_f64(1.0 / qps);
    let start = Instant::now();
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let due = start + every.mul_f64(i as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let q = match i % 10 {
            0..=4 => json!({"v": 1, "op": "route", "id": i}),
            5 => json!({"v": 1, "op": "route", "id": i, "n": 4}),
            6 | 7 => json!({"v": 1, "op": "route", "id": i, "session": format!("s-{}", rng.random_range(0..50_000))}),
            8 => json!({"v": 1, "op": "route", "id": i, "rank": rng.random_range(0..DP)}),
            _ => json!({"v": 1, "op": "route", "id": i, "prompt_tokens": rng.random_range(1..8000)}),
        };
        let t = Instant::now();
        let r = call(&c, &q).unwrap_or_else(|| panic!("frontend {id}: query {i} was not answered"));
        let took = t.elapsed();
        assert_eq!(r["id"], json!(i), "{r}");
        let mut w = window.lock().unwrap();
        w.lat.push(took);
        w.refused += u64::from(r["ok"] != json!(true));
        i += 1;
    }
    i
}

/// A paced prober: health routes and reports (one in 20 failed).
fn prober(d: &Dpcoord, qps: f64, stop: &AtomicBool) -> u64 {
    let c = d.req(&d.health, DEADLINE);
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let r = call(&c, &json!({"v": 1, "op": "health_route"})).expect("a health query was not answered");
        if let Some(rank) = r["rank"].as_u64() {
            let report = json!({"v": 1, "op": "health_report", "rank": rank, "ok": !i.is_multiple_of(20)});
            call(&c, &report).expect("a health report was not answered");
        }
        i += 1;
        std::thread::sleep(Duration::from_secs_f64(1.0 / qps));
    }
    i
}

/// A one-second garbage burst every `every`, plus a DEALER that sends 5000
/// queries and never reads (closed after the burst).
fn bursts(d: &Dpcoord, every: Duration, burst: Duration, stop: &AtomicBool) -> (u64, u64) {
    let (mut sent, mut n) = (0, 0);
    let mut next = Instant::now() + every / 2;
    while !stop.load(Ordering::Relaxed) {
        if Instant::now() < next {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        let halt = Arc::new(AtomicBool::new(false));
        let threads = garbage(d, Arc::clone(&halt));
        let never = d.ctx.socket(zmq::DEALER).unwrap();
        never.set_linger(0).unwrap();
        never.connect(&d.route).unwrap();
        let q = encode(&json!({"v": 1, "op": "ping"}));
        for _ in 0..5000 {
            if never.send_multipart([&b""[..], &q[..]], zmq::DONTWAIT).is_err() {
                break;
            }
        }
        let until = Instant::now() + burst;
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(20));
        }
        halt.store(true, Ordering::Relaxed);
        sent += threads.into_iter().map(|t| t.join().unwrap()).sum::<u64>();
        n += 1;
        next += every;
    }
    (n, sent)
}

/// Phase 2: mixed traffic for `total`, a line per interval.
pub fn soak(mode: Mode, total: Duration) {
    let interval = match mode {
        Mode::Smoke => total / 3,
        Mode::Full => (total / 6).clamp(Duration::from_secs(5), Duration::from_secs(60)),
    };
    let (restart_every, burst_every) = match mode {
        Mode::Smoke => (Duration::from_millis(200), Duration::from_millis(600)),
        Mode::Full => (Duration::from_secs(5), Duration::from_secs(10)),
    };
    let burst = if mode == Mode::Full { Duration::from_secs(1) } else { Duration::from_millis(100) };
    // Session keys come from a pool of 50 000, 25 times the table's capacity:
    // the table fills in the first seconds and then evicts for the rest of the run.
    let cfg = std::env::temp_dir().join(format!("dpcoord-soak-{}.toml", std::process::id()));
    std::fs::write(&cfg, "[routing]\npolicy = \"least_load\"\nsession_capacity = 2000\n").unwrap();
    let d = Dpcoord::start(&["--config", cfg.to_str().unwrap()]);
    let _ = std::fs::remove_file(&cfg);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop = SetOnDrop(Arc::clone(&stop));
    let eng = engines(d.stats.clone(), Arc::clone(&stop), Some(restart_every));
    wait_for("all ranks up", || all_up(&d).then_some(()));
    let window = Mutex::new(Window::default());
    println!(
        "\nsoak: {:.0} s of mixed traffic (3 frontends x 1000 q/s, prober 100 q/s, 8 engines at 20 Hz \
         restarting one every {:.1} s, a {:.1} s garbage burst every {:.0} s)",
        total.as_secs_f64(),
        restart_every.as_secs_f64(),
        burst.as_secs_f64(),
        burst_every.as_secs_f64()
    );
    println!(
        "  {:>6} {:>9} {:>8} {:>8} {:>8} {:>8}  flags",
        "t s", "RSS KiB", "queries", "refused", "p50 us", "p99 us"
    );
    let started = Instant::now();
    let (answered, probes, (n_bursts, junk), rows) = std::thread::scope(|s| {
        let fronts: Vec<_> = (0..3)
            .map(|id| {
                s.spawn({
                    let (d, stop, window) = (&d, &stop, &window);
                    move || frontend(d, id, 1000.0, stop, window)
                })
            })
            .collect();
        let probe = s.spawn(|| prober(&d, 100.0, &stop));
        let junk = s.spawn(|| bursts(&d, burst_every, burst, &stop));
        let mut rows: Vec<(u64, u32)> = Vec::new();
        let mut end = started;
        while end.duration_since(started) < total {
            end += interval;
            std::thread::sleep(end.saturating_duration_since(Instant::now()));
            let mut w = std::mem::take(&mut *window.lock().unwrap());
            let (rss, p99) = (d.rss_kib(), w.lat.quantile(0.99));
            let (base_rss, base_p99) = rows.first().copied().unwrap_or((rss, p99));
            let mut flags = Vec::new();
            if mode == Mode::Full && rss_grew(base_rss, rss) {
                flags.push("RSS GROWTH");
            }
            if mode == Mode::Full && p99_grew(base_p99, p99) {
                flags.push("P99 GROWTH");
            }
            let t = end.duration_since(started).as_secs_f64();
            let n = w.lat.0.len();
            println!(
                "  {t:>6.0} {rss:>9} {n:>8} {:>8} {:>8} {p99:>8}  {}",
                w.refused,
                w.lat.quantile(0.5),
                flags.join(" ")
            );
            rows.push((rss, p99));
        }
        stop.store(true, Ordering::Relaxed);
        let answered: u64 = fronts.into_iter().map(|f| f.join().unwrap()).sum();
        (answered, probe.join().unwrap(), junk.join().unwrap(), rows)
    });
    let restarts = eng.join().unwrap();
    let (first, last) = (rows[0], rows[rows.len() - 1]);
    let max_rss = rows.iter().map(|r| r.0).max().unwrap_or(0);
    let missed = d.metric("dpcoord_stats_missed_total").unwrap_or(f64::NAN);
    println!(
        "  {answered} route queries and {probes} probes answered; {restarts} engine restarts; {n_bursts} garbage \
         bursts ({junk} messages); stats missed {missed}; dpcoord log lines {}",
        d.log_lines()
    );
    let flat = |grew: bool| match (mode, grew) {
        (Mode::Smoke, _) => "smoke run: not judged",
        (_, true) => "GROWING",
        (_, false) => "flat",
    };
    println!(
        "  RSS first {} KiB, last {} KiB, max {max_rss} KiB: {}; p99 first {} us, last {} us: {}",
        first.0,
        last.0,
        flat(rss_grew(first.0, max_rss)),
        first.1,
        last.1,
        flat(p99_grew(first.1, last.1)),
    );
}

/// RSS more than 20% and 4 MiB above the first interval's.
fn rss_grew(first_kib: u64, kib: u64) -> bool {
    kib > first_kib + first_kib / 5 && kib > first_kib + 4096
}

/// p99 above 3x the first interval's.
fn p99_grew(first_us: u32, us: u32) -> bool {
    us > first_us.saturating_mul(3)
}
