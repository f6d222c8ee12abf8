//! Phase 1: route latency quiet vs under a garbage flood.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::*;

/// Route p99 under the garbage flood below stays within this many times the quiet p99
/// (docs/failure-behaviour.md; measured on a 2-core machine, see there).
const FLOOD_BOUND: f64 = 10.0;

/// Garbage updates a second the flood's PUB offers at most (it would
/// otherwise spin a whole core of a small machine on its own).
const STATS_GARBAGE_RATE: u64 = 200_000;

/// Garbage from three threads until `stop`: DEALERs on the route and health
/// sockets as fast as dpcoord answers (64 in flight, every reply read), and
/// a PUB offering [`STATS_GARBAGE_RATE`] updates a second on the stats
/// socket. Returns how many messages each sent (route, health, stats).
pub fn garbage(d: &Dpcoord, stop: Arc<AtomicBool>) -> Vec<JoinHandle<u64>> {
    let junk: [&[u8]; 6] = [
        b"\xc1",
        b"\x82\xa1v\x01\xa2op",
        b"\xdb\xff\xff\xff\xffabc",
        b"\x81\xa1v\xc6\xff\xff\xff\xff",
        b"\x93\x01\x02\x03",
        b"\x82\xa1v\x02\xa2op\xa5route",
    ];
    let mut threads = Vec::new();
    for ep in [d.route.clone(), d.health.clone()] {
        let stop = Arc::clone(&stop);
        threads.push(std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let s = ctx.socket(zmq::DEALER).unwrap();
            s.set_linger(0).unwrap();
            s.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
            s.connect(&ep).unwrap();
            let mut sent = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for k in 0..64 {
                    s.send_multipart([&b""[..], junk[k % junk.len()]], 0).unwrap();
                }
                for _ in 0..64 {
                    s.recv_multipart(0).expect("garbage was not answered");
                }
                sent += 64;
            }
            sent
        }));
    }
    let stats = d.stats.clone();
    threads.push(std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let p = ctx.socket(zmq::PUB).unwrap();
        p.set_linger(0).unwrap();
        p.connect(&stats).unwrap();
        let stale = encode(&json!({"v": 1, "rank": 0, "boot": 0, "seq": 1, "counts": [0, 0, 0, 0, 0]}));
        let (start, mut sent) = (Instant::now(), 0u64);
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..1000 {
                let msg = if sent % 7 == 0 { &stale[..] } else { junk[sent as usize % junk.len()] };
                let _ = p.send(msg, zmq::DONTWAIT);
                sent += 1;
            }
            let due = start + Duration::from_secs_f64(sent as f64 / STATS_GARBAGE_RATE as f64);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        sent
    }));
    threads
}

/// Phase 1: route latency quiet vs under a garbage flood.
pub fn flood_ratio(mode: Mode) {
    let phase = if mode == Mode::Full { Duration::from_secs(5) } else { Duration::from_millis(200) };
    let d = Dpcoord::start(&["--stale-after-ms", "60000", "--down-after-ms", "120000"]);
    let stop_engines = Arc::new(AtomicBool::new(false));
    let _stop = SetOnDrop(Arc::clone(&stop_engines));
    let eng = engines(d.stats.clone(), Arc::clone(&stop_engines), None);
    wait_for("all ranks up", || all_up(&d).then_some(()));
    let run = |flood: bool| {
        let stop = Arc::new(AtomicBool::new(false));
        let _stop = SetOnDrop(Arc::clone(&stop));
        let junk = if flood { garbage(&d, Arc::clone(&stop)) } else { Vec::new() };
        let lat = std::thread::scope(|s| {
            let m = s.spawn(|| measure_routes(&d, &stop));
            std::thread::sleep(phase);
            stop.store(true, Ordering::Relaxed);
            m.join().unwrap()
        });
        let sent: Vec<u64> = junk.into_iter().map(|t| t.join().unwrap()).collect();
        (lat, sent)
    };
    let dropped = || {
        ["malformed", "stale"]
            .iter()
            .map(|r| d.metric(&format!("dpcoord_stats_messages_total{{result=\"{r}\"}}")))
            .sum::<Option<f64>>()
    };
    let dropped_before = dropped();
    let (mut quiet, _) = run(false);
    let (mut flood, sent) = run(true);
    let (qp99, fp99) = (quiet.quantile(0.99), flood.quantile(0.99));
    let ratio = f64::from(fp99) / f64::from(qp99.max(1));
    println!("\nroute latency seen by a closed-loop REQ client, {:.1} s each:", phase.as_secs_f64());
    println!("  {:<7} {:>9} {:>8} {:>8} {:>8}", "", "queries", "p50 us", "p99 us", "max us");
    for (name, l) in [("quiet", &mut quiet), ("flood", &mut flood)] {
        let n = l.0.len();
        println!("  {name:<7} {n:>9} {:>8} {:>8} {:>8}", l.quantile(0.5), l.quantile(0.99), l.quantile(1.0));
    }
    let secs = phase.as_secs_f64();
    let stats_seen = dropped().zip(dropped_before).map_or(f64::NAN, |(a, b)| a - b);
    let verdict = match (mode, ratio <= FLOOD_BOUND) {
        (Mode::Smoke, _) => "smoke run: not judged".to_owned(),
        (_, true) => format!("within the documented bound of {FLOOD_BOUND}x"),
        (_, false) => format!("ABOVE the documented bound of {FLOOD_BOUND}x"),
    };
    println!(
        "  flood: {:.0} garbage queries/s answered (route + health), {:.0} garbage updates/s offered, {:.0}/s \
         reached dpcoord",
        (sent[0] + sent[1]) as f64 / secs,
        sent[2] as f64 / secs,
        stats_seen / secs
    );
    println!("  p99 flood/quiet = {ratio:.2} ({verdict})");
    stop_engines.store(true, Ordering::Relaxed);
    eng.join().unwrap();
}
