//! `dpcoord sim`'s arguments ([`SimArgs`]), the scenario they name and
//! where its dpcoord runs, and what clap cannot check of them. Below the
//! scenarios, which take them; the arm and workload names `--policy` and
//! `--workload` accept come from `arms` and `prompts`, lower still.

use std::path::PathBuf;

use clap::builder::PossibleValuesParser;
use clap::{ArgAction, ValueEnum};

use dpcoord_daemon::config::PolicyKind;

use super::arms;
use super::error::SimError;
use super::prompts::workloads;
use super::trace_gen::Shape;

/// Each rank's KV memory in `sim trace` unless `--cache-blocks` says
/// otherwise: 256k tokens, some 30 of the agentic trace's requests.
pub const TRACE_CACHE_BLOCKS: u64 = 16_384;

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
    pub generate: Option<Shape>,
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
    let trace_only = arms::TRACE.into_iter().filter(|arm| !arms::PREFIX.contains(arm));
    let arms = arms::PREFIX.into_iter().chain(trace_only).filter(|arm| PolicyKind::parse(arm).is_none());
    PossibleValuesParser::new(PolicyKind::ALL.map(PolicyKind::as_str).into_iter().chain(arms))
}

fn workload_names() -> PossibleValuesParser {
    PossibleValuesParser::new(workloads().map(|w| w.name()))
}

impl SimArgs {
    /// `--cache-blocks`, or the scenario's default.
    pub fn cache_blocks(&self) -> u64 {
        let default = if self.scenario == Scenario::Trace { TRACE_CACHE_BLOCKS } else { 4096 };
        self.cache_blocks.unwrap_or(default)
    }

    /// What clap cannot check: numbers in range, a FILE and flags only where
    /// the scenario takes them, `--policy` names the scenario runs.
    pub(crate) fn check(&self) -> Result<(), SimError> {
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
                let arms = arms::VLLM_DP.join(", ");
                return Err(SimError::Usage(format!(
                    "--policy {p}: vllm-dp runs its arms {arms}, and takes no --policy"
                )));
            }
        }
        let arms: Option<&[&str]> = match self.scenario {
            Scenario::Prefix => Some(&arms::PREFIX),
            Scenario::Trace => Some(&arms::TRACE),
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
                let only = match (of(&arms::PREFIX), of(&arms::TRACE)) {
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
