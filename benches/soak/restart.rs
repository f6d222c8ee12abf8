//! Phase 3: dpcoord restarted under traffic.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::*;

/// A frontend that survives a dpcoord restart: each query is retried on a
/// fresh REQ socket when no reply came within 250 ms, until answered.
fn retrying_frontend(d: &Dpcoord, stop: &AtomicBool, retries: &AtomicU64) -> u64 {
    let mut c = d.req(&d.route, Duration::from_millis(250));
    let mut answered = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let q = json!({"v": 1, "op": "route", "id": answered});
        let t = Instant::now();
        let r = loop {
            match call(&c, &q) {
                Some(r) => break r,
                None => {
                    assert!(t.elapsed() < DEADLINE, "query {answered} was never answered");
                    retries.fetch_add(1, Ordering::Relaxed);
                    c = d.req(&d.route, Duration::from_millis(250));
                }
            }
        };
        assert_eq!(r["id"], json!(answered), "{r}");
        answered += 1;
        std::thread::sleep(Duration::from_millis(1));
    }
    answered
}

/// Phase 3: dpcoord restarted under traffic; time until every rank is up again.
pub fn restarts(mode: Mode) {
    let mut d = Dpcoord::start(&[]);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop = SetOnDrop(Arc::clone(&stop));
    let eng = engines(d.stats.clone(), Arc::clone(&stop), None);
    wait_for("all ranks up", || all_up(&d).then_some(()));
    println!("\ndpcoord restarted on the same endpoints (8 engines publishing every 50 ms, 2 retrying frontends):");
    let rounds: &[&str] = if mode == Mode::Full { &["TERM", "KILL", "TERM", "KILL"] } else { &["KILL"] };
    for &signal in rounds {
        let (front_stop, retries) = (AtomicBool::new(false), AtomicU64::new(0));
        let route = clone_endpoints(&d);
        let (up_after, answered) = std::thread::scope(|s| {
            let fronts: Vec<_> = (0..2).map(|_| s.spawn(|| retrying_frontend(&route, &front_stop, &retries))).collect();
            std::thread::sleep(Duration::from_millis(100));
            let t = Instant::now();
            d.restart(signal);
            let ready = t.elapsed();
            wait_for("every rank up after the restart", || all_up(&d).then_some(()));
            let up = t.elapsed();
            std::thread::sleep(Duration::from_millis(100));
            front_stop.store(true, Ordering::Relaxed);
            let answered: u64 = fronts.into_iter().map(|f| f.join().unwrap()).sum();
            ((ready, up), answered)
        });
        println!(
            "  SIG{signal:<4}: new process answering {:>5.0} ms after the signal, every rank up at {:>5.0} ms; \
             {answered} queries answered, {} retried",
            up_after.0.as_secs_f64() * 1e3,
            up_after.1.as_secs_f64() * 1e3,
            retries.load(Ordering::Relaxed)
        );
    }
    stop.store(true, Ordering::Relaxed);
    eng.join().unwrap();
}

/// Endpoints of `d` for clients on other threads (no process of its own).
fn clone_endpoints(d: &Dpcoord) -> Dpcoord {
    Dpcoord {
        child: None,
        dir: tempfile::tempdir().unwrap(),
        route: d.route.clone(),
        health: d.health.clone(),
        stats: d.stats.clone(),
        metrics: d.metrics,
        args: Vec::new(),
        ctx: zmq::Context::new(),
    }
}
