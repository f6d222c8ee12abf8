//! `dpcoord demo`: the first command to run. One process holds dpcoord (on
//! its embedded default config, private `ipc://` endpoints, HTTP metrics on
//! 127.0.0.1), 8 simulated engines with prefix caches, 2 frontends
//! (`--frontends`) sending shared-prefix prompts and a health prober, in
//! three phases: the frontends place requests themselves from a stale
//! snapshot of the engines' counts, then by vLLM 0.33's rule (`stale`),
//! then they ask dpcoord (`cache_aware` on KV events by default). Each
//! phase shows dpcoord's per-rank table live; a comparison of the three and
//! a verdict close. Needs no setup.

use std::io::{IsTerminal, Write};
use std::net::{SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cluster::EngineSpec;
use crate::demo_summary::{summary, Outcome};
use crate::demo_view::{intro, prefix_aware, render, Phase, CACHE_BLOCKS, CONCURRENCY, HOP_MS, RANKS};
use crate::demo_view::{OUTPUT_TOKENS, PREFIX_TOKENS, QUESTION_TOKENS, TENANTS};
use crate::error::NetError;
use crate::error::SimError;
use crate::link::{Link, ProbeVia};
use crate::local::{DaemonSettings, Local};
use crate::model::DEFAULT_COST;
use crate::prefix_cache::CacheSpec;
use crate::prompts::Workload;
use crate::record::{Live, Recorder};
use crate::workload::{Lengths, Load};
use crate::world::{self, ArmSpec, Handoff, Probe, Prompts};
use dpcoord_daemon::io::http;
use dpcoord_daemon::wire::StateView;

const PROBE_EVERY_MS: u64 = 250;

/// `dpcoord demo` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// How long each of the three phases runs, in seconds (Ctrl-C stops earlier).
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub seconds: u64,
    /// `routing.policy` of the third phase: `cache_aware` reads the engines' KV events and sends
    /// each request where its prefix is cached; `least_load` & co. balance load only.
    #[arg(long, value_name = "NAME", default_value = "cache_aware", value_parser = crate::args::policy_names())]
    pub policy: String,
    /// Frontends (API servers) sharing the requests in flight; with more of them, vLLM's rule
    /// guesses more of the others' picks (dpcoord counts them).
    #[arg(long, value_name = "N", default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=32))]
    pub frontends: u32,
}

/// The simulated cluster: endless closed-loop traffic at wall-clock speed.
fn workload(policy: &str, phase: Phase, frontends: u32) -> ArmSpec {
    let shared =
        Workload::Shared { tenants: TENANTS, prefix: PREFIX_TOKENS, question: QUESTION_TOKENS, output: OUTPUT_TOKENS };
    let ms = |v: u64| v * 1000;
    ArmSpec {
        name: "demo".into(),
        ranks: RANKS,
        engine: EngineSpec {
            chunk: 8192,
            max_running: 256,
            cost: DEFAULT_COST,
            cache: Some(CacheSpec { block: 16, capacity: CACHE_BLOCKS, bounded: false }),
        },
        lockstep: false,
        slow: None,
        kill: None,
        hang: None,
        resizes: Vec::new(),
        frontends,
        nodes: 1,
        load: Load::Closed { concurrency: CONCURRENCY },
        prompts: None,
        // The shared-prefix prompts' lengths; their tokens come from `prompts_of`.
        lengths: Lengths {
            input: (PREFIX_TOKENS + QUESTION_TOKENS, PREFIX_TOKENS + QUESTION_TOKENS),
            output: (OUTPUT_TOKENS, OUTPUT_TOKENS),
        },
        probe: Some(Probe { every: ms(PROBE_EVERY_MS), via: ProbeVia::Health }),
        timeout: None,
        seed: 1,
        speed: 1.0,
        sync: false,
        sample_every: ms(100),
        handoff: Handoff { transit: (ms(HOP_MS.0), ms(HOP_MS.1)), grid: 0 },
        horizon: u64::MAX,
        prompts_of: Prompts {
            workload: Some(shared),
            on_wire: prefix_aware(policy) && phase == Phase::Dpcoord,
            oracle: None,
            local: phase.rule(),
        },
        replay: None,
    }
}

/// The default metrics port if free, else any free port on loopback.
fn metrics_listener() -> Result<std::net::TcpListener, http::BindError> {
    let default: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9570));
    http::bind(default).or_else(|_| http::bind(SocketAddr::from(([127, 0, 0, 1], 0))))
}

/// Where the live table goes: redrawn in place once a second on a
/// terminal; written once, as the phase ends, anywhere else (a file, a
/// pipe), so a log holds each phase's final table and not every frame.
struct Screen {
    tty: bool,
    /// Lines of the table drawn last, which the next one replaces.
    drawn: usize,
}

impl Screen {
    fn draw(&mut self, table: &str) -> std::io::Result<()> {
        let mut stdout = std::io::stdout().lock();
        if self.tty && self.drawn > 0 {
            write!(stdout, "\x1b[{}A\x1b[J", self.drawn)?;
        }
        write!(stdout, "{table}")?;
        stdout.flush()?;
        self.drawn = table.lines().count();
        Ok(())
    }
}

/// Prints the phase's heading, then (on a terminal) redraws its table once
/// a second until the time is up, the world ends, or a signal arrives
/// (then `true`). The heading comes once the signals are caught, so a
/// Ctrl-C from then on ends the phase, not the process.
async fn watch(
    screen: &mut Screen,
    heading: &str,
    local: &Local,
    live: &Live,
    world: &JoinHandle<Result<Recorder, NetError>>,
    (start, total): (Instant, Duration),
) -> std::io::Result<bool> {
    use tokio::signal::unix::{signal, SignalKind};
    let (mut int, mut term) = (signal(SignalKind::interrupt())?, signal(SignalKind::terminate())?);
    println!("{heading}");
    let every = Duration::from_secs(1);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            _ = int.recv() => return Ok(true),
            _ = term.recv() => return Ok(true),
            _ = tick.tick() => {}
        }
        let elapsed = start.elapsed().min(total);
        if elapsed >= total || world.is_finished() {
            return Ok(false);
        }
        if screen.tty {
            screen.draw(&render(&local.published.state(), live, elapsed, total))?;
        }
    }
}

/// dpcoord's table from its first tick from now on (at most 10 ticks
/// away), which holds every query it has answered: ticks and queries take
/// turns on its thread.
async fn next_view(local: &Local, tick: Duration) -> Arc<StateView> {
    let (now, deadline) = (local.published.state(), tokio::time::Instant::now() + 10 * tick);
    loop {
        let view = local.published.state();
        if !Arc::ptr_eq(&now, &view) || tokio::time::Instant::now() >= deadline {
            return view;
        }
        tokio::time::sleep(tick / 10).await;
    }
}

/// Runs one phase on a fresh daemon and cluster, serving the daemon's
/// metrics on `listener` meanwhile; its outcome, and whether a signal stopped it.
fn phase(
    rt: &tokio::runtime::Runtime,
    listener: &TcpListener,
    args: &DemoArgs,
    phase: Phase,
) -> Result<(Outcome, bool), SimError> {
    let settings = DaemonSettings {
        metrics_bind: listener.local_addr()?.to_string(),
        kv_events: prefix_aware(&args.policy),
        ..DaemonSettings::defaults(RANKS, &args.policy)
    };
    let local = Local::start(&settings, "demo")?;
    let (registry, published) = (local.registry.clone(), Arc::clone(&local.published));
    let web = http::spawn(rt.handle(), listener.try_clone()?, registry, published, http::Limits::default());
    let spec = workload(&args.policy, phase, args.frontends);
    let mut link = Link::open(&local.eps, args.frontends, ProbeVia::Health, RANKS, false)?;
    let (stop, live) = (Arc::new(AtomicBool::new(false)), Arc::new(Live::new(RANKS)));
    let world = {
        let (stop, live) = (Arc::clone(&stop), Arc::clone(&live));
        std::thread::Builder::new()
            .name("demo-world".into())
            .spawn(move || world::run(&spec, &mut link, &stop, Some(&live)))?
    };
    let heading = phase.heading(&args.policy, args.frontends);
    let mut screen = Screen { tty: std::io::stdout().is_terminal(), drawn: 0 };
    let (start, total) = (Instant::now(), Duration::from_secs(args.seconds));
    let watched = rt.block_on(watch(&mut screen, &heading, &local, &live, &world, (start, total)));
    stop.store(true, Ordering::Relaxed);
    let rec = match world.join() {
        Ok(r) => r?,
        Err(panic) => std::panic::resume_unwind(panic),
    };
    let interrupted = watched?;
    // The final table once the world has stopped: its counts and clock are
    // those the summary reads, so both show the same placements, requests and tok/s.
    let view = rt.block_on(next_view(&local, Duration::from_millis(settings.tick_ms)));
    screen.draw(&render(&view, &live, start.elapsed().min(total), total))?;
    if let Err(e) = rt.block_on(web.stop()) {
        tracing::warn!(error = %e, "HTTP server did not stop cleanly");
    }
    local.stop()?;
    Ok((Outcome::of(phase, &rec, live.now_us.load(Ordering::Relaxed) as f64 / 1e6), interrupted))
}

fn run(args: &DemoArgs) -> Result<(), SimError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let listener = metrics_listener()?;
    let addr = listener.local_addr()?;
    println!("{}", intro(addr, args.seconds, args.frontends));
    let mut outcomes = Vec::new();
    for p in Phase::ALL {
        let (outcome, interrupted) = phase(&rt, &listener, args, p)?;
        println!("\n{}", outcome.ended());
        outcomes.push(outcome);
        if interrupted {
            break;
        }
    }
    println!("{}", summary(&outcomes, addr, args.frontends, &args.policy));
    Ok(())
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
