//! `dpcoord sim prefix`: what prefix-cache awareness buys, and what it
//! must never cost. Every rank has a prefix cache (blocks, a capacity, LRU
//! eviction of unreferenced blocks) and prefills only what it misses; the
//! engines publish their stores and evictions as vLLM KV-event batches that
//! dpcoord ingests through `kv_events.connect`. Three workloads (shared
//! prefixes, multi-turn chat, no sharing), five arms (`round_robin`,
//! `least_load`, `cache_aware` approximate, `cache_aware` with events, and
//! an oracle that reads every rank's true cache), each at 1 and 4 frontends.
//! `--sweep` varies the `cache_aware` weights instead.

use super::args::SimArgs;
use super::arms;
use super::cluster::EngineSpec;
use super::error::SimError;
use super::local::DaemonSettings;
use super::model::DEFAULT_COST;
use super::prefix_cache::CacheSpec;
use super::prefix_report as report;
use super::prompts::{workloads, Workload};
use super::scenario::{base, run_arm, Outcome};
use super::summary::ArmResult;
use super::workload::Load;
use super::world::{ArmSpec, CacheWeights, Prompts};

/// Tokens per KV block of the simulated engines.
pub const BLOCK: u32 = 16;

/// Requests per arm unless `--requests` says otherwise.
pub const REQUESTS: u64 = 960;

fn weights_of(w: CacheWeights) -> Vec<(&'static str, toml::Value)> {
    vec![
        ("cache_prefill_weight", toml::Value::Float(w.prefill)),
        ("cache_balance_abs_tokens", toml::Value::Integer(w.balance_abs as i64)),
        ("cache_balance_rel", toml::Value::Float(w.balance_rel)),
    ]
}

/// One arm's run on workload `w` and its daemon's settings.
pub fn arm(a: &SimArgs, w: Workload, arm: &str, frontends: u32, weights: CacheWeights) -> (ArmSpec, DaemonSettings) {
    let (mut spec, settings) = routed(a, arm, frontends, weights);
    spec.load = Load::Closed { concurrency: a.prefix_concurrency };
    spec.prompts = Some(a.requests.unwrap_or(REQUESTS));
    spec.prompts_of.workload = Some(w);
    (spec, settings)
}

/// An arm's engines (prefix caches of `--cache-blocks`), daemon settings
/// and who places requests, for requests that carry tokens; the load is
/// the caller's.
pub fn routed(a: &SimArgs, arm: &str, frontends: u32, weights: CacheWeights) -> (ArmSpec, DaemonSettings) {
    let name = format!("{arm}/{frontends}");
    let cache = CacheSpec { block: BLOCK, capacity: a.cache_blocks() as usize, bounded: false };
    let (policy, kv_events, on_wire, oracle, mode) = match arm {
        "round_robin" | "least_load" => (arm, false, false, None, None),
        "cache_aware/approx" => ("cache_aware", false, true, None, Some("approximate")),
        "cache_aware/events" => ("cache_aware", true, true, None, Some("events")),
        "lmetric/events" => ("lmetric", true, true, None, Some("events")),
        _ => ("round_robin", false, false, Some(weights), None),
    };
    let mut routing = weights_of(weights);
    routing.extend(mode.map(|m| ("prefix_mode", toml::Value::String(m.into()))));
    let settings = DaemonSettings {
        stale_after_ms: 200,
        down_after_ms: 600,
        tick_ms: 20,
        pending_ttl_ms: 1000,
        kv_events,
        routing,
        ..DaemonSettings::defaults(a.ranks, policy)
    };
    let spec = ArmSpec {
        engine: EngineSpec { chunk: a.chunk, max_running: 256, cost: DEFAULT_COST, cache: Some(cache) },
        lockstep: a.lockstep.unwrap_or(false),
        frontends,
        sample_every: 250_000,
        horizon: 3_600_000_000,
        prompts_of: Prompts { workload: None, on_wire, oracle, local: None },
        ..base(a, &name, false)
    };
    (spec, settings)
}

/// Runs one arm; its result is labelled with the arm's name.
pub fn run(a: &SimArgs, w: Workload, name: &str, frontends: u32, weights: CacheWeights) -> Result<ArmResult, SimError> {
    let (spec, settings) = arm(a, w, name, frontends, weights);
    let mut r = run_arm(&spec, &settings, a)?;
    r.policy = name.to_owned();
    Ok(r)
}

/// The workloads `--workload` names, or all three.
fn chosen(a: &SimArgs) -> Vec<Workload> {
    workloads().into_iter().filter(|w| a.workloads.is_empty() || a.workloads.iter().any(|n| n == w.name())).collect()
}

/// The arms `--policy` names (an arm's name or its policy), or all five.
fn chosen_arms(a: &SimArgs) -> Vec<&'static str> {
    let named = |arm: &str| a.policies.iter().any(|p| arm == p || arm.split('/').next() == Some(p.as_str()));
    arms::PREFIX.into_iter().filter(|arm| a.policies.is_empty() || named(arm)).collect()
}

pub(super) fn setup(a: &SimArgs) -> String {
    format!(
        "{} ranks{}, chunk {} tokens/step/rank, prefix cache {} blocks of {BLOCK} tokens per rank (LRU), \
         closed loop at concurrency {} over {} requests, speed {}x, seed {}",
        a.ranks,
        if a.lockstep.unwrap_or(false) { " in lockstep" } else { " stepping on their own" },
        a.chunk,
        a.cache_blocks(),
        a.prefix_concurrency,
        a.requests.unwrap_or(REQUESTS),
        a.speed,
        a.seed
    )
}

/// `dpcoord sim prefix`: one table per workload, and the chart.
pub fn prefix(a: &SimArgs) -> Result<Outcome, SimError> {
    if a.sweep {
        return sweep(a);
    }
    let mut text = format!("prefix: prefix-cache awareness against load-only routing\n{}\n", setup(a));
    let mut all = Vec::new();
    for w in chosen(a) {
        let mut results = Vec::new();
        for frontends in [1, 4] {
            for name in chosen_arms(a) {
                results.push(run(a, w, name, frontends, CacheWeights::default())?);
            }
        }
        text.push_str(&format!("\n{}: {}\n{}", w.name(), w.describe(), report::table(&results)));
        text.push_str(&report::verdict(w, &results));
        all.push((w, results));
    }
    text.push_str(&super::report::caveats(&all.iter().flat_map(|(_, r)| r.clone()).collect::<Vec<_>>()));
    let named: Vec<(&str, Vec<ArmResult>)> = all.into_iter().map(|(w, r)| (w.name(), r)).collect();
    let svg = report::chart("prefix: throughput and TTFT p90 per arm (solid: 1 frontend, pale: 4)", &named);
    Ok(Outcome { name: "prefix", text, svg, broken: None })
}

/// The sweep's variations around the defaults.
pub fn variations() -> Vec<(String, CacheWeights)> {
    let d = CacheWeights::default();
    let mut v = vec![("defaults".to_owned(), d)];
    for p in [0.0, 0.5, 1.0, 2.0, 8.0] {
        v.push((format!("prefill_weight {p}"), CacheWeights { prefill: p, ..d }));
    }
    for abs in [0.0, 8192.0, 131_072.0, 4_294_967_296.0] {
        v.push((format!("balance_abs {abs}"), CacheWeights { balance_abs: abs, ..d }));
    }
    for rel in [1.25, 4.0] {
        v.push((format!("balance_rel {rel}"), CacheWeights { balance_rel: rel, ..d }));
    }
    v
}

/// `dpcoord sim prefix --sweep`: `cache_aware` with events under each
/// variation, on the shared-prefix and no-sharing workloads.
fn sweep(a: &SimArgs) -> Result<Outcome, SimError> {
    let [shared, _, random] = workloads();
    let mut rows = Vec::new();
    for (label, w) in variations() {
        let s = run(a, shared, "cache_aware/events", 1, w)?;
        let r = run(a, random, "cache_aware/events", 1, w)?;
        rows.push((label, s, r));
    }
    let base = [run(a, random, "least_load", 1, CacheWeights::default())?];
    let mut text = format!("prefix --sweep: cache_aware (events) weights, 1 frontend\n{}\n\n", setup(a));
    text.push_str(&report::sweep_table(&rows, &base[0]));
    let all = [(shared.name(), rows.iter().map(|(l, s, _)| labelled(s, l)).collect())];
    let svg = report::chart("prefix --sweep: shared prefixes under each cache_aware variation", &all);
    Ok(Outcome { name: "prefix-sweep", text, svg, broken: None })
}

fn labelled(r: &ArmResult, label: &str) -> ArmResult {
    ArmResult { policy: label.to_owned(), name: format!("{label}/1"), ..r.clone() }
}
