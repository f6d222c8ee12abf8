//! `dpcoord demo`: the first command to run. One process holds dpcoord (on
//! its embedded default config, private `ipc://` endpoints, HTTP metrics on
//! 127.0.0.1), 8 simulated engines, 2 frontends and a health prober, and
//! shows dpcoord's per-rank table live, then a summary. Needs no setup.

use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::io::http;
use crate::sim::cluster::EngineSpec;
use crate::sim::link::{Link, ProbeVia};
use crate::sim::local::{DaemonSettings, Local};
use crate::sim::model::DEFAULT_COST;
use crate::sim::net::NetError;
use crate::sim::prefix_cache::CacheSpec;
use crate::sim::prompts::Workload;
use crate::sim::record::{std_dev, Live, Recorder};
use crate::sim::report::thousands;
use crate::sim::workload::{Lengths, Load};
use crate::sim::world::{self, ArmSpec, Handoff, Probe, Prompts};
use crate::sim::SimError;
use crate::wire::StateView;

const RANKS: u32 = 8;
const FRONTENDS: u32 = 2;
const PROBE_EVERY_MS: u64 = 250;

/// `dpcoord demo` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// How long to run, in seconds (Ctrl-C stops earlier).
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub seconds: u64,
    /// `routing.policy`; `cache_aware` runs a shared-prefix workload (48 tenants, 3k-token
    /// system prompts) with prefix caches and KV events, and shows each rank's cache hit rate.
    #[arg(long, value_name = "NAME", default_value = "round_robin", value_parser = crate::sim::policy_names())]
    pub policy: String,
}

/// The simulated cluster: endless closed-loop traffic at wall-clock speed.
fn workload(policy: &str) -> ArmSpec {
    let cache_aware = policy == "cache_aware";
    let shared = Workload::Shared { tenants: 48, prefix: 3072, question: 640, output: 32 };
    ArmSpec {
        name: "demo".into(),
        ranks: RANKS,
        engine: EngineSpec {
            chunk: 8192,
            max_running: 256,
            cost: DEFAULT_COST,
            cache: cache_aware.then_some(CacheSpec { block: 16, capacity: 4096 }),
        },
        lockstep: false,
        slow: None,
        kill: None,
        resizes: Vec::new(),
        frontends: FRONTENDS,
        load: Load::Closed { concurrency: 32 },
        prompts: None,
        lengths: Lengths { input: (500, 8000), output: (16, 128) },
        probe: Some(Probe { every: PROBE_EVERY_MS * 1000, via: ProbeVia::Health }),
        seed: 1,
        speed: 1.0,
        sync: false,
        sample_every: 1_000_000,
        handoff: Handoff::default(),
        horizon: u64::MAX,
        prompts_of: Prompts { workload: cache_aware.then_some(shared), on_wire: cache_aware, oracle: None },
    }
}

/// What the demo runs, printed once above the live table.
pub fn intro(metrics: SocketAddr, policy: &str) -> String {
    format!(
        "dpcoord demo: {RANKS} simulated engines publish stats to an in-process dpcoord ({policy});\n\
         {FRONTENDS} frontends route every request through it; a prober uses the health channel.\n\
         metrics: http://{metrics}/metrics (also /state, /healthz, /readyz). Ctrl-C stops early.\n"
    )
}

/// The live table: dpcoord's view of each rank plus the prober's count.
pub fn render(view: &StateView, live: &Live, elapsed: Duration, total: Duration) -> String {
    let width = 30;
    let done = ((elapsed.as_secs_f64() / total.as_secs_f64().max(1e-9)) * width as f64).round() as usize;
    let bar: String = (0..width).map(|i| if i < done.min(width) { '#' } else { '.' }).collect();
    let mut out = format!(
        "[{bar}] {:>5.1}/{} s  epoch {}\n\
         rank  status  placements  waiting  running  pending  penalty  probes\n",
        elapsed.as_secs_f64(),
        total.as_secs(),
        view.epoch
    );
    let cache = live.prompt.iter().any(|p| p.load(Ordering::Relaxed) > 0);
    if cache {
        out.insert_str(out.len() - 1, "   hit %");
    }
    for r in &view.ranks {
        let probes = live.probes.get(r.rank as usize).map_or(0, |p| p.load(Ordering::Relaxed));
        out.push_str(&format!(
            "{:>4}  {:<6}  {:>10}  {:>7}  {:>7}  {:>7}  {:>7.2}  {:>6}",
            r.rank, r.status, r.routed, r.counts.waiting, r.counts.running, r.pending, r.penalty, probes
        ));
        match live.hit_rate(r.rank as usize) {
            Some(h) if cache => out.push_str(&format!("  {:>6.1}\n", h * 100.0)),
            _ if cache => out.push_str("       -\n"),
            _ => out.push('\n'),
        }
    }
    let routed: Vec<u64> = view.ranks.iter().map(|r| r.routed).collect();
    let secs = live.now_us.load(Ordering::Relaxed) as f64 / 1e6;
    let tokens = live.input_tokens.load(Ordering::Relaxed) as f64;
    out.push_str(&format!(
        "completed {} requests, {} input tokens/s, placement std {:.2}\n",
        live.completed.load(Ordering::Relaxed),
        thousands(if secs > 0.0 { (tokens / secs).round() as u64 } else { 0 }),
        std_dev(&routed)
    ));
    out
}

/// The closing summary.
pub fn summary(rec: &Recorder, secs: f64, metrics: SocketAddr, policy: &str) -> String {
    let done: Vec<_> = rec.requests.iter().filter(|r| r.done.is_some()).collect();
    let tokens: u64 = done.iter().map(|r| u64::from(r.prompt)).sum();
    let per_rank = |v: &[u64]| v.iter().map(u64::to_string).collect::<Vec<_>>().join(" ");
    format!(
        "summary after {secs:.1} s ({RANKS} simulated ranks, {FRONTENDS} frontends, {policy}):\n\
         \x20 user placements per rank: {}  (std {:.2})\n\
         \x20 completed requests:       {} ({} in flight at stop)\n\
         \x20 input tokens/s:           {}\n\
         \x20 health probes:            {} on the health channel, per rank {}; they took no user placement\n\
         metrics were served at http://{metrics}/metrics (also /state, /healthz, /readyz)\n",
        per_rank(&rec.placements),
        std_dev(&rec.placements),
        done.len(),
        rec.requests.len() - done.len(),
        thousands(if secs > 0.0 { (tokens as f64 / secs).round() as u64 } else { 0 }),
        rec.probes.iter().sum::<u64>(),
        per_rank(&rec.probes),
    )
}

/// The default metrics port if free, else any free port on loopback.
fn metrics_listener() -> Result<std::net::TcpListener, http::BindError> {
    let default: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9570));
    http::bind(default).or_else(|_| http::bind(SocketAddr::from(([127, 0, 0, 1], 0))))
}

/// Redraws the table once a second until the time is up, the world ends, or a signal arrives.
async fn watch(
    local: &Local,
    live: &Live,
    world: &JoinHandle<Result<Recorder, NetError>>,
    total: Duration,
) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut int, mut term) = (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
    let tty = std::io::stdout().is_terminal();
    let start = Instant::now();
    let every = Duration::from_secs(1);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    let mut drawn = 0;
    loop {
        tokio::select! {
            _ = int.recv() => return Ok(()),
            _ = term.recv() => return Ok(()),
            _ = tick.tick() => {}
        }
        let elapsed = start.elapsed().min(total);
        let text = render(&local.published.state(), live, elapsed, total);
        let mut stdout = std::io::stdout().lock();
        if tty && drawn > 0 {
            write!(stdout, "\x1b[{drawn}A\x1b[J")?;
        }
        write!(stdout, "{text}{}", if tty { "" } else { "\n" })?;
        stdout.flush()?;
        drawn = text.lines().count();
        if elapsed >= total || world.is_finished() {
            return Ok(());
        }
    }
}

fn run(args: &DemoArgs) -> Result<(), SimError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let listener = metrics_listener()?;
    let addr = listener.local_addr()?;
    let settings = DaemonSettings {
        metrics_bind: addr.to_string(),
        kv_events: args.policy == "cache_aware",
        ..DaemonSettings::defaults(RANKS, &args.policy)
    };
    let local = Local::start(&settings, "demo")?;
    let web =
        http::spawn(rt.handle(), listener, local.registry.clone(), Arc::clone(&local.published), http::Limits::default());
    let spec = workload(&args.policy);
    let mut link = Link::open(&local.eps, FRONTENDS, ProbeVia::Health, RANKS, false)?;
    let (stop, live) = (Arc::new(AtomicBool::new(false)), Arc::new(Live::new(RANKS)));
    let world = {
        let (stop, live) = (Arc::clone(&stop), Arc::clone(&live));
        std::thread::Builder::new()
            .name("demo-world".into())
            .spawn(move || world::run(&spec, &mut link, &stop, Some(&live)))?
    };
    let total = Duration::from_secs(args.seconds);
    println!("{}", intro(addr, &args.policy));
    let watched = rt.block_on(watch(&local, &live, &world, total));
    stop.store(true, Ordering::Relaxed);
    let rec = match world.join() {
        Ok(r) => r?,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    watched?;
    let secs = live.now_us.load(Ordering::Relaxed) as f64 / 1e6;
    println!("\n{}", summary(&rec, secs, addr, &args.policy));
    if let Err(e) = rt.block_on(web.stop()) {
        tracing::warn!(error = %e, "HTTP server did not stop cleanly");
    }
    local.stop()
}

/// `dpcoord demo`.
pub fn main(args: &DemoArgs) -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dpcoord demo: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::record::Request;

    #[test]
    fn summary_counts_completed_in_flight_and_probes() {
        let mut rec = Recorder::new(RANKS);
        let req = |done| Request {
            frontend: 0,
            prompt: 1000,
            output: 1,
            issued: 0,
            first_token: done,
            done,
            attempts: 1,
            ..Request::default()
        };
        rec.requests = vec![req(Some(5)), req(Some(9)), req(None)];
        rec.placements = vec![1, 1, 1, 0, 0, 0, 0, 0];
        rec.probes = vec![2, 1, 1, 1, 1, 1, 1, 1];
        let addr = SocketAddr::from(([127, 0, 0, 1], 9570));
        let text = summary(&rec, 4.0, addr, "round_robin");
        let want = "summary after 4.0 s (8 simulated ranks, 2 frontends, round_robin):\n\
            \x20 user placements per rank: 1 1 1 0 0 0 0 0  (std 0.48)\n\
            \x20 completed requests:       2 (1 in flight at stop)\n\
            \x20 input tokens/s:           500\n\
            \x20 health probes:            9 on the health channel, per rank 2 1 1 1 1 1 1 1; \
            they took no user placement\n\
            metrics were served at http://127.0.0.1:9570/metrics (also /state, /healthz, /readyz)\n";
        assert_eq!(text, want);
    }
}
