//! What defines one simulated run: the cluster, the load, the faults and
//! the operator's resizes, and how a placement reaches its engine.

use super::cluster::EngineSpec;
use super::link::ProbeVia;
use super::model::Micros;
use super::nodes::Nodes;
use super::prompts::Workload;
use super::stale::StaleRule;
use super::trace_replay::Replay;
use super::workload::{Lengths, Load};

/// The `cache_aware` weights (docs/PROTOCOL.md §7), for the oracle.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheWeights {
    pub prefill: f64,
    pub balance_abs: f64,
    pub balance_rel: f64,
}

impl Default for CacheWeights {
    /// The daemon's defaults (`config::keys`).
    fn default() -> CacheWeights {
        use dpcoord_daemon::config::keys::{CACHE_BALANCE_ABS_TOKENS, CACHE_BALANCE_REL, CACHE_PREFILL_WEIGHT};
        CacheWeights {
            prefill: CACHE_PREFILL_WEIGHT.default,
            balance_abs: CACHE_BALANCE_ABS_TOKENS.default as f64,
            balance_rel: CACHE_BALANCE_REL.default,
        }
    }
}

/// What requests say, and who places them (the prefix-cache runs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Prompts {
    /// Requests carry token ids of this workload (else only lengths).
    pub workload: Option<Workload>,
    /// Each `route` carries the prompt's `tokens`.
    pub on_wire: bool,
    /// The simulator places each request itself, reading every rank's true
    /// cache, with these weights (sent to dpcoord as a pin).
    pub oracle: Option<CacheWeights>,
    /// Each frontend places requests itself from periodic snapshots of the
    /// engines' counts, by this rule, telling dpcoord by a pin.
    pub local: Option<StaleRule>,
}

/// A health prober sending one probe every `every` virtual microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub every: Micros,
    pub via: ProbeVia,
}

/// Everything that defines one run.
#[derive(Debug, Clone)]
pub struct ArmSpec {
    pub name: String,
    pub ranks: u32,
    pub engine: EngineSpec,
    pub lockstep: bool,
    /// `(rank, speed_pct)` of a slow rank.
    pub slow: Option<(u32, u32)>,
    /// `(rank, at)`: the rank dies at virtual time `at`.
    pub kill: Option<(u32, Micros)>,
    /// `(rank, at)`: the rank hangs at virtual time `at` (no step from then
    /// on) while its stats keep going out, the same counts each time.
    pub hang: Option<(u32, Micros)>,
    /// `(at, dp_size)`: the operator resizes dpcoord's table at `at`. Engines
    /// beyond `ranks` start before the first resize that takes them in;
    /// removed ones finish what they hold, then stop.
    pub resizes: Vec<(Micros, u32)>,
    pub frontends: u32,
    /// Nodes the frontends' API servers and the ranks split over (`nodes`):
    /// above 1, each request goes to an API server of one node, and only
    /// that node's ranks may take it (the route query's `among`).
    pub nodes: u32,
    pub load: Load,
    /// Prompts over all frontends; `None` runs until stopped.
    pub prompts: Option<u64>,
    pub lengths: Lengths,
    pub probe: Option<Probe>,
    /// A frontend gives up on a request after this long without a token
    /// from it (the first, from its placement), and places it again (none:
    /// it waits forever).
    pub timeout: Option<Micros>,
    pub seed: u64,
    /// Virtual seconds per wall second; 0 runs unpaced.
    pub speed: f64,
    pub sync: bool,
    pub sample_every: Micros,
    pub handoff: Handoff,
    /// Virtual time after which the run stops (what is unfinished is lost).
    pub horizon: Micros,
    pub prompts_of: Prompts,
    /// A trace's requests, sent at its times over the frontends in turn
    /// (instead of `load`, `prompts` and `prompts_of.workload`).
    pub replay: Option<std::sync::Arc<Replay>>,
}

impl ArmSpec {
    /// Engines simulated: dpcoord's table at its largest.
    pub fn engines(&self) -> u32 {
        self.resizes.iter().map(|&(_, n)| n).fold(self.ranks, u32::max)
    }

    /// How the frontends' API servers and the ranks split over `nodes`.
    pub fn split(&self) -> Nodes {
        Nodes::new(self.nodes, self.frontends, self.ranks)
    }
}

/// How a placement reaches its engine, and when engines' reports go out.
/// The default hands a request over at the instant of its placement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Handoff {
    /// The frontend -> engine hop (forwarding, tokenization), uniform in
    /// this inclusive range; `(0, 0)` for none.
    pub transit: (Micros, Micros),
    /// Every event lands on this grid of virtual time (0 for none), and
    /// SGLang load publishers are called once per grid step, half a step
    /// off it: a snapshot is then never within half a step of being a
    /// whole number of steps after a placement, so a paced run splits
    /// dpcoord's wall-clock `pending_transit_ms` the same way every time.
    pub grid: Micros,
}

impl Handoff {
    /// Whether placements take a hop; then each is checked against dpcoord's `pending`.
    pub fn is_delayed(&self) -> bool {
        self.transit.1 > 0
    }
}
