//! Ingest: stats updates per second that dpcoord absorbs with no loss.
//!
//! One PUB socket per rank (8 ranks, as engines publish) over ipc://, paced
//! at stepped rates and then unpaced; what dpcoord absorbed is the change
//! of `dpcoord_stats_messages_total{result="ok"}` at /metrics, and the rest
//! was lost (PUB/SUB drops at the high-water mark when the reader falls
//! behind). Then the same with concurrent routing load, against route p99
//! without stats traffic.

use std::time::{Duration, Instant};

use crate::report::{num, rate, ratio, Report, Table};
use crate::support::{stats_update, Daemon};
use crate::transport::{load, Measured};
use crate::Mode;

const DP: u32 = 8;
const OK_SERIES: &str = "dpcoord_stats_messages_total{result=\"ok\"}";
/// dpcoord's own count of updates it never saw (gaps in a rank's seq).
const MISSED_SERIES: &str = "dpcoord_stats_missed_total";
/// The ingest target, also the rate offered alongside routing load.
const TARGET: f64 = 200_000.0;
/// REQ clients of the concurrent routing load.
const ROUTE_CLIENTS: usize = 2;

/// How fast the engines publish.
#[derive(Clone, Copy, PartialEq)]
enum Rate {
    /// This many updates per second, paced every 100 us.
    Paced(f64),
    /// As fast as one thread can.
    Unpaced,
}

impl Rate {
    fn name(self) -> String {
        match self {
            Rate::Paced(r) => format!("paced {}/s", rate(r)),
            Rate::Unpaced => "unpaced".into(),
        }
    }
}

/// Engines publishing valid updates, one PUB per rank.
struct Engines {
    pubs: Vec<zmq::Socket>,
    /// The last seq each rank sent (consecutive, so dpcoord sees any gap).
    seq: Vec<u64>,
    buf: Vec<u8>,
}

/// One publishing run: what was offered and what dpcoord counted.
struct Step {
    sent: u64,
    secs: f64,
    absorbed: u64,
    /// Seq gaps dpcoord counted (None when it does not export them).
    gaps: Option<u64>,
}

impl Step {
    fn offered(&self) -> f64 {
        self.sent as f64 / self.secs
    }

    fn absorbed_rate(&self) -> f64 {
        self.absorbed as f64 / self.secs
    }

    fn lost(&self) -> u64 {
        self.sent.saturating_sub(self.absorbed)
    }
}

impl Engines {
    /// Rank `rank`'s next update.
    fn send(&mut self, rank: usize) {
        self.seq[rank] += 1;
        stats_update(&mut self.buf, rank as u32, self.seq[rank], [1, 2, 0, 0, 0]);
        self.pubs[rank].send(&self.buf[..], zmq::DONTWAIT).expect("publish");
    }

    /// Publishes round-robin over ranks for `dur`; returns (sent, seconds).
    fn publish(&mut self, rate: Rate, dur: Duration) -> (u64, f64) {
        let start = Instant::now();
        let mut sent = 0u64;
        loop {
            let elapsed = start.elapsed().min(dur);
            let due = match rate {
                Rate::Paced(r) => (r * elapsed.as_secs_f64()).ceil() as u64,
                Rate::Unpaced if elapsed < dur => sent + 64,
                Rate::Unpaced => sent,
            };
            if sent >= due && elapsed >= dur {
                return (sent, start.elapsed().as_secs_f64());
            }
            if sent >= due {
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            while sent < due {
                self.send((sent % u64::from(DP)) as usize);
                sent += 1;
            }
        }
    }
}

/// dpcoord's ok and missed counts once they stop moving (its queue drained).
fn settled(d: &Daemon) -> Option<(u64, Option<u64>)> {
    let read = || Some((d.metric(OK_SERIES)? as u64, d.metric(MISSED_SERIES).map(|m| m as u64)));
    let mut last = read()?;
    let start = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let now = read()?;
        if now == last || start.elapsed() > Duration::from_secs(3) {
            return Some(now);
        }
        last = now;
    }
}

fn step(d: &Daemon, e: &mut Engines, rate: Rate, dur: Duration) -> Option<Step> {
    let (ok0, gaps0) = settled(d)?;
    let (sent, secs) = e.publish(rate, dur);
    // dpcoord sees updates lost at a rank's tail only in that rank's next
    // one: once the step's traffic drained, every rank sends one more
    // (left out of `absorbed`; if one were lost, the step would own it).
    settled(d)?;
    for rank in 0..DP as usize {
        e.send(rank);
    }
    let (ok1, gaps1) = settled(d)?;
    let gaps = gaps0.zip(gaps1).map(|(a, b)| b.saturating_sub(a));
    Some(Step { sent, secs, absorbed: ok1.saturating_sub(ok0).saturating_sub(DP.into()), gaps })
}

/// Route load alone, or with stats published at `rate` alongside it.
fn with_routing(d: &Daemon, e: &mut Engines, rate: Option<Rate>, dur: Duration) -> (Measured, Option<Step>) {
    std::thread::scope(|scope| {
        let routing = scope.spawn(|| load(&d.ctx, &d.route, d.proc(), ROUTE_CLIENTS, dur));
        let stats = rate.and_then(|r| step(d, e, r, dur));
        (routing.join().expect("routing load"), stats)
    })
}

fn stats_cells(s: &Step) -> Vec<String> {
    let gaps = s.gaps.map_or("n/a".into(), |g| g.to_string());
    vec![rate(s.offered()), rate(s.absorbed_rate()), s.lost().to_string(), gaps]
}

/// Stepped rates, then unpaced; returns the highest lossless rate and how it was reached.
fn rate_steps(d: &Daemon, e: &mut Engines, rates: &[f64], dur: Duration) -> Option<(f64, String)> {
    let title = format!("ingest: {DP} PUB engines over ipc://, {:.2} s per step", dur.as_secs_f64());
    let mut t = Table::new(title, &["offered", "updates/s offered", "updates/s absorbed", "lost", "seq gaps seen"]);
    let mut best = (0.0_f64, String::from("none"));
    for r in rates.iter().map(|&r| Rate::Paced(r)).chain([Rate::Unpaced]) {
        let s = step(d, e, r, dur)?;
        // A paced step the sender kept up with counts at its nominal rate.
        let credited = match r {
            Rate::Paced(nominal) if s.offered() >= 0.99 * nominal => nominal,
            _ => s.offered(),
        };
        if s.lost() == 0 && credited > best.0 {
            best = (credited, format!("{}/s ({}, {}/s actual)", rate(credited), r.name(), rate(s.offered())));
        }
        let mut row = vec![r.name()];
        row.extend(stats_cells(&s));
        t.row(row);
    }
    t.print();
    Some(best)
}

/// Route load without stats, with the target rate, and unpaced; returns
/// the stats step at the target rate.
fn routing_under_stats(d: &Daemon, e: &mut Engines, dur: Duration) -> Option<Step> {
    let title = format!("ingest: route p99 under stats traffic ({ROUTE_CLIENTS} REQ clients, least_load)");
    let header = [
        "stats traffic",
        "route q/s",
        "p50 us",
        "p99 us",
        "p99 vs none",
        "updates/s offered",
        "absorbed",
        "lost",
        "gaps",
    ];
    let mut t = Table::new(title, &header);
    let mut at_target = None;
    let mut alone_p99 = 0.0;
    for r in [None, Some(Rate::Paced(TARGET)), Some(Rate::Unpaced)] {
        let (mut m, s) = with_routing(d, e, r, dur);
        let p99 = m.lat.quantile_us(0.99);
        if r.is_none() {
            alone_p99 = p99;
        }
        let name = r.map_or("none".into(), Rate::name);
        let mut row = vec![name, rate(m.qps()), num(m.lat.quantile_us(0.5), 1), num(p99, 1), ratio(p99, alone_p99)];
        row.extend(s.as_ref().map_or(vec!["-".into(); 4], stats_cells));
        t.row(row);
        if r == Some(Rate::Paced(TARGET)) {
            at_target = s;
        }
    }
    t.print();
    at_target
}

pub fn run(mode: Mode, report: &mut Report) {
    let (rates, dur): (&[f64], _) = match mode {
        Mode::Full => (&[100_000.0, 200_000.0, 400_000.0, 600_000.0, 800_000.0], Duration::from_millis(1500)),
        Mode::Smoke => (&[20_000.0], Duration::from_millis(50)),
    };
    let d = Daemon::start(DP, &["--policy", "least_load"]);
    // The engines get their own context (I/O thread), as separate processes
    // would: sharing the routing clients' one made the generator drop updates.
    let engines_ctx = zmq::Context::new();
    let pubs: Vec<zmq::Socket> = (0..DP).map(|_| d.publisher(&engines_ctx)).collect();
    let next = d.bring_up(&pubs, DP);
    let mut e = Engines { pubs, seq: vec![next - 1; DP as usize], buf: Vec::new() };
    let Some((best, how)) = rate_steps(&d, &mut e, rates, dur) else {
        println!("\ningest: skipped, the daemon does not serve {OK_SERIES} at /metrics");
        return;
    };
    report.target("ingest: lossless updates/s", ">= 200,000/s", how, best >= TARGET);
    if let Some(s) = routing_under_stats(&d, &mut e, dur) {
        report.target(
            "ingest: 200k updates/s with routing load",
            "0 lost",
            format!("{} lost of {} ({}/s offered)", s.lost(), s.sent, rate(s.offered())),
            s.lost() == 0 && s.offered() >= 0.95 * TARGET,
        );
    }
}
