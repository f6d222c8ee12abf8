//! Phase 4: what refused peers that keep coming back cost a frontend.
//!
//! dpcoord cannot stop a peer from connecting: each attempt costs it an
//! accept, a ZMTP handshake and a ZAP answer on its serving thread, and the
//! refused peer is closed within milliseconds. Here 1,000 DEALERs from
//! 127.0.0.2 (the attacker's address; 128 of them are held, at
//! `max_peers_per_address`) take turns to disconnect and connect again,
//! 2,000 connections a second in all, while one frontend from 127.0.0.1
//! routes; its latency is compared with the same frontend's before the
//! churn, and dpcoord's peak RSS and CPU time are shown. A
//! refused DEALER also connects again by itself every 100 ms (libzmq's
//! default), so the refusals outnumber the connections the bench makes. (All at once, thousands of
//! connects overflow the listen backlog and wait out SYN retransmissions:
//! the attack would measure the kernel, not dpcoord.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::harness::*;

pub fn churn(mode: Mode) {
    // Peers, new connections a second they make together, seconds measured.
    let (wanted, rate, phase) = match mode {
        Mode::Full => (1000, 2000.0, Duration::from_secs(5)),
        // A debug build handshakes slowly: fewer, so the smoke run keeps up.
        Mode::Smoke => (200, 400.0, Duration::from_millis(200)),
    };
    // Each DEALER holds two descriptors (its connection and its mailbox).
    let nofile = rlimit::increase_nofile_limit(u64::MAX).unwrap_or(1024);
    let n = wanted.min((nofile.saturating_sub(256) / 2) as usize);
    let port = free_addr().port();
    let d = Dpcoord::start_on(Some(format!("tcp://127.0.0.1:{port}")), &[]);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop = SetOnDrop(Arc::clone(&stop));
    let eng = engines(d.stats.clone(), Arc::clone(&stop), None);
    wait_for("all ranks up", || all_up(&d).then_some(()));
    let measure = || {
        let halt = AtomicBool::new(false);
        std::thread::scope(|s| {
            let m = s.spawn(|| measure_routes(&d, &halt));
            std::thread::sleep(phase);
            halt.store(true, Ordering::Relaxed);
            m.join().unwrap()
        })
    };
    // A burst of connections can take the socket past its own cap before
    // the address cap is counted, so both reasons are refusals here.
    let refusals = || {
        ["address_full", "socket_full"]
            .map(|r| d.metric(&format!(r#"dpcoord_peers_refused_total{{reason="{r}",socket="route"}}"#)))
            .iter()
            .map(|v| v.expect("the refusal series"))
            .sum::<f64>()
    };
    let mut quiet = measure();
    // A libzmq context holds at most 1,023 sockets: contexts of 500.
    let contexts: Vec<zmq::Context> = (0..n.div_ceil(500)).map(|_| zmq::Context::new()).collect();
    let endpoint = format!("tcp://127.0.0.2:0;127.0.0.1:{port}");
    let peers: Vec<zmq::Socket> = (0..n)
        .map(|i| {
            let s = contexts[i / 500].socket(zmq::DEALER).unwrap();
            s.set_linger(0).unwrap();
            s.connect(&endpoint).unwrap();
            s
        })
        .collect();
    let halt = Arc::new(AtomicBool::new(false));
    let churner = std::thread::spawn({
        let (halt, endpoint) = (Arc::clone(&halt), endpoint.clone());
        move || {
            let started = Instant::now();
            for i in 0u64.. {
                if halt.load(Ordering::Relaxed) {
                    break;
                }
                let s = &peers[i as usize % peers.len()];
                // A refused link may already be gone (ENOENT): connect anyway.
                let _ = s.disconnect(&endpoint);
                s.connect(&endpoint).unwrap();
                let due = started + Duration::from_secs_f64(i as f64 / rate);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
            }
            peers
        }
    });
    let _halt = SetOnDrop(Arc::clone(&halt));
    // How many refusals a turn of every peer brings depends on how many
    // connections dpcoord handshakes before their peers reconnect: wait
    // for the first, then for a whole turn.
    wait_for("the churn under way", || (refusals() > 0.0).then_some(()));
    std::thread::sleep(Duration::from_secs_f64(n as f64 / rate));
    let (first, t, cpu) = (refusals(), Instant::now(), d.cpu());
    let mut loud = measure();
    let refused = refusals() - first;
    let (refused_rate, cpu_used) = (refused / t.elapsed().as_secs_f64(), d.cpu() - cpu);
    halt.store(true, Ordering::Relaxed);
    drop(churner.join().unwrap());
    drop(contexts);
    // Every connection the churn made ended: the counts are back to none.
    let held = || d.metric(r#"dpcoord_peers_connected{socket="route"}"#);
    wait_for("the route socket empty again", || (held() == Some(0.0)).then_some(()));
    println!(
        "\nrefused peers reconnecting: {n} DEALERs from 127.0.0.2 taking turns, {rate:.0} connections/s offered \
         ({refused_rate:.0} refusals/s), one frontend from 127.0.0.1, {:.1} s each:",
        phase.as_secs_f64()
    );
    println!("  {:<7} {:>9} {:>8} {:>8} {:>8}", "", "queries", "p50 us", "p99 us", "max us");
    for (name, l) in [("quiet", &mut quiet), ("churn", &mut loud)] {
        let q = l.0.len();
        println!("  {name:<7} {q:>9} {:>8} {:>8} {:>8}", l.quantile(0.5), l.quantile(0.99), l.quantile(1.0));
    }
    let ratio = f64::from(loud.quantile(0.99)) / f64::from(quiet.quantile(0.99).max(1));
    let judged = if mode == Mode::Smoke { " (smoke run: not judged)" } else { "" };
    println!("  p99 churn/quiet = {ratio:.2}{judged}; dpcoord peak RSS {} KiB", d.status_kib("VmHWM:"));
    println!(
        "  dpcoord CPU during the churn: {:.0}% of a core (every thread, the frontend's queries included)",
        cpu_used.as_secs_f64() / phase.as_secs_f64() * 100.0
    );
    stop.store(true, Ordering::Relaxed);
    eng.join().unwrap();
}
