//! Health ops budgeted: route p99 while DEALERs flood the health socket
//! with `prefix` ops, each keying a long prompt, beside route p99 on the
//! same daemon with the health socket quiet, in the same run. The health
//! socket gets a bounded share of each poll round, so the flood should
//! raise route p99 no more than the garbage flood may (10x quiet).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::report::{rate, Report, Table};
use crate::support::{Daemon, Mp, DEADLINE};
use crate::transport::load;
use crate::Mode;

const DP: u32 = 8;
/// Tokens of each flooding prompt (32 KiB as MessagePack: each token below 128 is one byte, so a
/// prompt fits the default 64 KiB message limit).
const TOKENS: u32 = 32_768;
const FLOODERS: usize = 3;
/// `prefix` ops each flooder keeps in flight.
const WINDOW: usize = 32;

fn prefix_query(tokens: u32) -> Vec<u8> {
    let mut b = Vec::new();
    let mut m = Mp(&mut b);
    m.map(3).str("v").uint(1).str("op").str("prefix").str("tokens").array(tokens);
    for i in 0..tokens {
        m.uint(u64::from(i * 7919 % 128));
    }
    b
}

/// Floods `prefix` ops from one DEALER, [`WINDOW`] in flight, until
/// `stop`; returns the replies read (every op sent is waited for).
fn flooder(ctx: &zmq::Context, endpoint: &str, body: &[u8], stop: &AtomicBool) -> u64 {
    let s = ctx.socket(zmq::DEALER).expect("DEALER");
    s.set_linger(0).expect("linger");
    s.set_rcvtimeo(DEADLINE.as_millis() as i32).expect("rcvtimeo");
    s.connect(endpoint).expect("connect health");
    let (mut sent, mut read) = (0u64, 0u64);
    loop {
        let flooding = !stop.load(Ordering::Relaxed);
        while flooding && sent - read < WINDOW as u64 {
            s.send_multipart([&b""[..], body], 0).expect("send a prefix op");
            sent += 1;
        }
        if read == sent {
            return read;
        }
        s.recv_multipart(0).expect("a prefix op answered in time");
        read += 1;
    }
}

pub fn run(mode: Mode, report: &mut Report) {
    let full = mode == Mode::Full;
    let dur = if full { Duration::from_secs(4) } else { Duration::from_millis(200) };
    let tokens = if full { TOKENS } else { TOKENS / 16 };
    let d = Daemon::start(DP, &[]);
    d.bring_up(&[d.publisher(&d.ctx)], DP);
    let body = prefix_query(tokens);
    let mut quiet = load(&d.ctx, &d.route, d.proc(), 2, dur);
    let quiet_p99 = quiet.lat.quantile_us(0.99);
    let mut t = Table::new(
        format!("health flood: route p99 while {FLOODERS} DEALERs send `prefix` ops of {tokens} tokens ({DP} ranks, 2 REQ clients, the same daemon)"),
        &["health socket", "route q/s", "p50 us", "p99 us", "max us", "p99 vs quiet", "failed", "health ops/s"],
    );
    quiet.latency_row(&mut t, "quiet".into(), quiet_p99, "-".into());
    let stop = AtomicBool::new(false);
    let t0 = Instant::now();
    let (mut busy, ops) = std::thread::scope(|s| {
        let floods: Vec<_> = (0..FLOODERS).map(|_| s.spawn(|| flooder(&d.ctx, &d.health, &body, &stop))).collect();
        let busy = load(&d.ctx, &d.route, d.proc(), 2, dur);
        stop.store(true, Ordering::Relaxed);
        let ops: u64 = floods.into_iter().map(|h| h.join().expect("flooder")).sum();
        (busy, ops)
    });
    let ops_per_s = ops as f64 / t0.elapsed().as_secs_f64();
    let what = format!("flood: {} B per op", body.len());
    let p99 = busy.latency_row(&mut t, what, quiet_p99, rate(ops_per_s));
    t.print();
    report.target(
        "route p99 under a flood of `prefix` ops on the health socket",
        "<= 10x quiet (the garbage flood's bound), none failed",
        format!("{:.2}x, {} failed", p99 / quiet_p99, busy.failures),
        p99 <= 10.0 * quiet_p99 && busy.failures == 0,
    );
}
