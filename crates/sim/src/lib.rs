//! The simulator: dpcoord routing simulated DP serving (`dpcoord sim`).
//!
//! Simulated engines publish `StatsUpdate` over ZeroMQ like real ranks;
//! simulated frontends ask dpcoord's route socket where each request goes and
//! hand it to that engine; a prober uses the health socket (or, to reproduce
//! the documented failure, the user route socket). dpcoord runs in-process,
//! unchanged, on private `ipc://` endpoints. Time is virtual and paced
//! against the wall clock (`--speed`), so a 100-second serving run takes a
//! couple of seconds.
//!
//! - `model`: one rank's scheduler and step-time model (pure)
//! - `cluster`: ranks stepping on their own or in lockstep
//! - `workload`: frontends (closed or open loop), seeded lengths
//! - `net`, `link`, `publisher`: the ZeroMQ peers (stats or SGLang load
//!   streams, routes, probes, `resize`)
//! - `spec`, `world`: what defines a run; the discrete-event loop
//! - `record`, `phase`, `report`, `svg`: results, phases between resizes, text, chart
//! - `local`: an in-process daemon on private endpoints
//! - `stepped`: dpcoord's coordinator stepped on the run's virtual clock
//! - `scenario`: health-matrix, slow-rank, dead-rank, hetero-prompts
//! - `hung`: a rank that stops stepping and keeps publishing (hung-rank),
//!   with dpcoord's progress check on and off
//! - `elastic`: scale-up and scale-down under load (8 -> 12 -> 6 ranks)
//! - `pending`: dpcoord's pending placements against the truth, with
//!   `received` counters, reconciled by time, or overwritten by snapshots
//! - `prefix`, `prefix_cache`, `prompts`, `kv_pub`, `oracle`,
//!   `prefix_report`: prefix caches per rank (LRU, prefill of uncached
//!   tokens only), vLLM KV-event batches to dpcoord, shared-prefix / chat /
//!   no-sharing workloads with token ids, the oracle arm, the `cache_aware` sweep
//! - `trace`, `trace_file`, `trace_replay`, `trace_gen`, `trace_bound`:
//!   published request traces (Mooncake, Bailian) replayed on their
//!   timestamps over prefix caches, generated traces of their shape, and
//!   the bound no placement can beat
//! - `vllm_dp`: vLLM's own DP balancing (`stale`) against the same API
//!   servers asking dpcoord, on shared prefixes
//! - `stale`: frontends placing requests themselves (a stale snapshot, or
//!   vLLM 0.33's rule)
//! - `nodes`: API servers and ranks split over nodes (vLLM's hybrid load
//!   balancing), and the round-robin balancer in front of them
//! - `demo`, `demo_view`, `demo_summary`: `dpcoord demo`, its live view,
//!   and its closing comparison and verdict

pub mod cluster;
pub mod demo;
pub mod demo_summary;
pub mod demo_view;
pub mod elastic;
pub mod hung;
pub mod kv_pub;
pub mod link;
pub mod local;
pub mod model;
pub mod net;
pub mod nodes;
pub mod oracle;
pub mod pending;
pub mod phase;
pub mod prefix;
pub mod prefix_cache;
pub mod prefix_report;
pub mod prompts;
pub mod publisher;
pub mod record;
pub mod report;
pub mod scenario;
pub mod spec;
pub mod stale;
pub mod stepped;
pub mod svg;
pub mod svg_heat;
pub mod trace;
pub mod trace_bound;
pub mod trace_file;
pub mod trace_gen;
pub mod trace_replay;
pub mod vllm_dp;
pub mod workload;
pub mod world;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::builder::PossibleValuesParser;
use clap::{ArgAction, ValueEnum};

use dpcoord::config::{ConfigError, PolicyKind};
use dpcoord::io::sockets::TransportError;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{0}")]
    Net(#[from] net::NetError),
    #[error("{0}")]
    Daemon(#[from] TransportError),
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Http(#[from] dpcoord::io::http::BindError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Trace(#[from] trace_file::TraceError),
    #[error("{scenario}: {what}")]
    Broken { scenario: &'static str, what: String },
}

/// A scenario of `dpcoord sim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Health probes off / on the health channel / mixed into the user route socket.
    HealthMatrix,
    /// Rank 0 at half speed, every policy.
    SlowRank,
    /// Rank 3 dies mid-run, every policy; its requests are retried.
    DeadRank,
    /// Prompt lengths spread around --input-tokens, every policy.
    HeteroPrompts,
    /// Rank 3 hangs mid-run and keeps publishing, every policy with dpcoord's progress
    /// check on and off; frontends place a request again after 30 s without a token from it.
    HungRank,
    /// dpcoord's table resized 8 -> 12 -> 6 ranks under load, every policy; nothing lost.
    Elastic,
    /// Pending placements with a hop to the engine: exact counters, SGLang load
    /// snapshots reconciled by time, snapshots overwriting; 1, 4 and 16 frontends.
    Pending,
    /// Prefix caches per rank with KV events: round_robin, least_load, cache_aware
    /// (approximate, events) and an oracle on shared-prefix, chat and no-sharing
    /// workloads, at 1 and 4 frontends (`--sweep`: the cache_aware weights).
    Prefix,
    /// vLLM 0.33's own DP balancing against the same 2 and 4 API servers asking dpcoord
    /// (least_load, cache_aware with KV events), shared prefixes and prefix caches.
    VllmDp,
    /// Replays FILE, a Mooncake or Bailian trace, on its timestamps over prefix caches: the
    /// prefix arms and a bound no placement beats, as recorded and with nothing shared, at 1
    /// and 4 frontends (`--generate SHAPE` writes FILE instead).
    Trace,
    /// Each of the above in turn, except prefix, vllm-dp and trace (runs of their own).
    All,
}

/// Where the simulator's dpcoord runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DaemonMode {
    /// The coordinator on the simulator's thread, stepped on virtual time.
    Stepped,
    /// The daemon on its own thread and private ipc:// sockets, on the wall clock.
    Threaded,
}

/// `dpcoord sim` arguments. The defaults are the documented deployment:
/// 8 ranks, 8k-token chunks, concurrency 16 over 160 prompts of 60k/1 tokens.
#[derive(clap::Args, Debug, Clone)]
pub struct SimArgs {
    #[arg(value_enum)]
    pub scenario: Scenario,
    /// trace: the trace to replay (JSON Lines in Mooncake's or Bailian's format), or the file
    /// `--generate` writes.
    #[arg(value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// trace: write FILE, a trace in Mooncake's format with the published shape of this
    /// workload (`--requests` rows [default: 2000], `--seed`), and run nothing.
    #[arg(long, value_enum, value_name = "SHAPE")]
    pub generate: Option<trace_gen::Shape>,
    /// trace: replay the trace this many times as fast as it was recorded.
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    pub time_scale: f64,
    /// Directory for the text reports and SVG charts.
    #[arg(long, value_name = "DIR", default_value = "sim-out")]
    pub out: PathBuf,
    /// Virtual seconds per wall-clock second; 0 runs as fast as possible.
    #[arg(long, value_name = "X", default_value_t = 50.0)]
    pub speed: f64,
    /// Seed of prompt lengths and open-loop arrivals.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// DP ranks (simulated engines).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub ranks: u32,
    /// Prompts over all frontends.
    #[arg(long, value_name = "N", default_value_t = 160, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub prompts: u64,
    /// Closed loop: requests in flight over all frontends.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub concurrency: u32,
    /// Open loop instead: requests per virtual second over all frontends.
    #[arg(long, value_name = "R")]
    pub rate: Option<f64>,
    /// Frontend replicas sharing the one dpcoord.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub frontends: u32,
    /// Prompt tokens per request (the mean, in hetero-prompts).
    #[arg(long, value_name = "N", default_value_t = 60_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub input_tokens: u32,
    /// Output tokens per request.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub output_tokens: u32,
    /// Prefill token budget per step per rank.
    #[arg(long, value_name = "N", default_value_t = 8192, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub chunk: u32,
    /// Virtual milliseconds between health probes.
    #[arg(long, value_name = "MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    pub probe_every_ms: u64,
    /// Lockstep steps across ranks (DP attention / MoE); `false` lets ranks step on their own.
    /// Default true, except in slow-rank and hung-rank (in lockstep every rank waits for the slow
    /// one whatever the policy does; a hung one would hold every rank up).
    #[arg(long, value_name = "BOOL", action = ArgAction::Set)]
    pub lockstep: Option<bool>,
    /// Where dpcoord runs: `stepped`, its coordinator on the simulator's thread and virtual clock
    /// (every run repeats exactly, at any --speed); `threaded`, the whole daemon on its own thread
    /// and private ipc:// sockets, on the wall clock.
    #[arg(long, value_enum, value_name = "MODE", default_value_t = DaemonMode::Stepped)]
    pub daemon: DaemonMode,
    /// --daemon threaded: wait for dpcoord to see the latest stats before each placement.
    #[arg(long, value_name = "BOOL", default_value_t = true, action = ArgAction::Set)]
    pub sync: bool,
    /// Engines report `ttft_ms`, which dpcoord turns into a penalty on its tick (with --daemon
    /// threaded, a wall-clock tick: load-aware runs then do not repeat exactly).
    #[arg(long, value_name = "BOOL", default_value_t = false, action = ArgAction::Set)]
    pub ttft: bool,
    /// Policies to compare (repeatable); default every `routing.policy` this build accepts.
    /// health-matrix uses the first (default round_robin).
    #[arg(long = "policy", value_name = "NAME", value_parser = policy_or_arm_names())]
    pub policies: Vec<String>,
    /// prefix, vllm-dp, trace: requests per arm over all frontends [default: 960 in prefix, 4800 in
    /// vllm-dp, every row of the trace in trace].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub requests: Option<u64>,
    /// prefix: requests in flight (closed loop) over all frontends.
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub prefix_concurrency: u32,
    /// prefix, trace: each rank's prefix-cache capacity in blocks of 16 tokens [default: 4096 in
    /// prefix; 16384 in trace, where it is the rank's KV memory and bounds the batch too].
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..=100_000_000))]
    pub cache_blocks: Option<u64>,
    /// prefix: workloads to run (repeatable: shared-prefix, multi-turn-chat, no-sharing); default all.
    #[arg(long = "workload", value_name = "NAME", value_parser = workload_names())]
    pub workloads: Vec<String>,
    /// prefix: sweep the cache_aware weights instead of comparing arms.
    #[arg(long)]
    pub sweep: bool,
    /// vllm-dp: with 2, also runs every arm on 2 nodes of half the ranks each (vLLM's
    /// --data-parallel-hybrid-lb): each node's API servers reach its ranks only, a
    /// round-robin balancer in front alternates each frontend's requests between the nodes.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=2))]
    pub nodes: u32,
}

/// Every `routing.policy` name: `--policy` of `dpcoord demo`, checked while
/// parsing so an unknown name is refused with the list.
pub(crate) fn policy_names() -> PossibleValuesParser {
    PossibleValuesParser::new(PolicyKind::ALL.map(PolicyKind::as_str))
}

/// `--policy` of `dpcoord sim`: a `routing.policy`, or an arm of the prefix
/// scenario (`SimArgs::check` refuses an arm elsewhere).
fn policy_or_arm_names() -> PossibleValuesParser {
    let trace_only = trace::ARMS.into_iter().filter(|arm| !prefix::ARMS.contains(arm));
    let arms = prefix::ARMS.into_iter().chain(trace_only).filter(|arm| PolicyKind::parse(arm).is_none());
    PossibleValuesParser::new(PolicyKind::ALL.map(PolicyKind::as_str).into_iter().chain(arms))
}

fn workload_names() -> PossibleValuesParser {
    PossibleValuesParser::new(prefix::workloads().map(|w| w.name()))
}

impl SimArgs {
    /// `--cache-blocks`, or the scenario's default.
    pub fn cache_blocks(&self) -> u64 {
        let default = if self.scenario == Scenario::Trace { trace::CACHE_BLOCKS } else { 4096 };
        self.cache_blocks.unwrap_or(default)
    }

    fn check(&self) -> Result<(), SimError> {
        self.check_policies()?;
        if !(self.speed.is_finite() && self.speed >= 0.0) {
            return Err(SimError::Usage(format!("--speed must be a number >= 0, got {}", self.speed)));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(SimError::Usage(format!("--time-scale must be a number > 0, got {}", self.time_scale)));
        }
        match (self.scenario, &self.file, self.generate) {
            (Scenario::Trace, None, _) => return Err(SimError::Usage("trace needs FILE, the trace to replay".into())),
            (Scenario::Trace, Some(_), _) => {}
            (_, Some(f), _) => {
                return Err(SimError::Usage(format!("{}: only the trace scenario takes a FILE", f.display())))
            }
            (_, None, Some(_)) => return Err(SimError::Usage("--generate belongs to the trace scenario".into())),
            (_, None, None) => {}
        }
        if self.nodes > 1 && self.scenario != Scenario::VllmDp {
            return Err(SimError::Usage(format!("--nodes {}: only vllm-dp runs over nodes", self.nodes)));
        }
        if self.nodes > self.ranks {
            return Err(SimError::Usage(format!(
                "--nodes {}: more nodes than ranks (--ranks {})",
                self.nodes, self.ranks
            )));
        }
        match self.rate {
            Some(r) if !(r.is_finite() && r > 0.0) => {
                Err(SimError::Usage(format!("--rate must be a number > 0, got {r}")))
            }
            _ => Ok(()),
        }
    }

    /// Each `--policy` names something this scenario runs: an arm (or an
    /// arm's policy) in prefix, a `routing.policy` elsewhere.
    fn check_policies(&self) -> Result<(), SimError> {
        let scenario = self.scenario.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
        if self.scenario == Scenario::VllmDp {
            if let Some(p) = self.policies.first() {
                let arms = vllm_dp::ARMS.join(", ");
                return Err(SimError::Usage(format!(
                    "--policy {p}: vllm-dp runs its arms {arms}, and takes no --policy"
                )));
            }
        }
        let arms: Option<&[&str]> = match self.scenario {
            Scenario::Prefix => Some(&prefix::ARMS),
            Scenario::Trace => Some(&trace::ARMS),
            _ => None,
        };
        for p in &self.policies {
            let known = match arms {
                Some(arms) => arms.iter().any(|arm| arm == p || arm.split('/').next() == Some(p.as_str())),
                None => PolicyKind::parse(p).is_some(),
            };
            if known {
                continue;
            }
            let takes = if let Some(arms) = arms {
                format!("the arms {}", arms.join(", "))
            } else {
                let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.as_str()).collect();
                let of = |arms: &[&str]| arms.contains(&p.as_str());
                let only = match (of(&prefix::ARMS), of(&trace::ARMS)) {
                    (true, true) => "the prefix and trace scenarios",
                    (true, false) => "the prefix scenario",
                    _ => "the trace scenario",
                };
                format!("a routing.policy: {} (`{p}` is an arm of {only} only)", names.join(", "))
            };
            return Err(SimError::Usage(format!("--policy {p}: {scenario} runs {takes}")));
        }
        Ok(())
    }
}

/// Makes `--out` before any run, so a path that cannot be a directory is
/// refused at once (exit 2), not after the simulation.
fn make_out(out: &std::path::Path) -> Result<(), SimError> {
    std::fs::create_dir_all(out)
        .map_err(|e| SimError::Usage(format!("--out {}: cannot create the directory: {e}", out.display())))
}

fn write_outcome(out: &std::path::Path, o: &scenario::Outcome) -> Result<(), SimError> {
    let (txt, svg) = (out.join(format!("{}.txt", o.name)), out.join(format!("{}.svg", o.name)));
    for (path, body) in [(&txt, &o.text), (&svg, &o.svg)] {
        std::fs::write(path, body)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot write {}: {e}", path.display())))?;
    }
    println!("{}\nwrote {} and {}\n", o.text, txt.display(), svg.display());
    Ok(())
}

/// `dpcoord sim`: runs the scenario, prints and writes the reports (or,
/// with `--generate`, writes the trace).
pub fn main(args: &SimArgs) -> ExitCode {
    let result = args.check().and_then(|()| match (args.generate, &args.file) {
        (Some(shape), Some(file)) => trace::write_generated(shape, file, args),
        _ => {
            make_out(&args.out).and_then(|()| scenario::run(args.scenario, args, &mut |o| write_outcome(&args.out, &o)))
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e @ SimError::Usage(_)) => {
            eprintln!("dpcoord: error: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("dpcoord sim: error: {e}");
            ExitCode::FAILURE
        }
    }
}
