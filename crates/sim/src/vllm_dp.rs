//! `dpcoord sim vllm-dp`: vLLM's own balancing against the same API
//! servers asking dpcoord. K API servers (frontends) share 8 ranks with
//! prefix caches on the shared-prefix workload of `prefix`; in `vllm-rule`
//! each places its requests itself by vLLM 0.33's rule (see `stale`: no
//! prefix awareness), in the other arms each asks dpcoord instead, which
//! runs `least_load`, or `cache_aware` on the engines' KV events. Each arm
//! runs at 2 and 4 API servers. `--workload` runs other workloads instead.
//! `--nodes 2` also runs every arm over 2 nodes of half the ranks each
//! (`nodes`): vLLM's rule per API server over its node's ranks, dpcoord's
//! arms asking with `among` = the node's ranks.

use std::fmt::Write;

use super::args::SimArgs;
use super::arms;
use super::error::SimError;
use super::prefix;
use super::prefix_report as report;
use super::prompts::{workloads, Workload};
use super::report::{ms, thousands};
use super::scenario::{run_arm, Outcome};
use super::stale::StaleRule;
use super::summary::ArmResult;
use super::world::CacheWeights;

/// API servers per run (`--api-server-count`).
pub const API_SERVERS: [u32; 2] = [2, 4];

/// Requests per arm unless `--requests` says otherwise: enough that TTFT
/// p99 is not the cold start (the first 64 requests on empty caches).
pub const REQUESTS: u64 = 4800;

/// vLLM's coordinator publishes the engines' counts this often.
const SNAPSHOT_US: u64 = 100_000;

/// Runs one arm with `k` API servers over `nodes` nodes; its result is
/// labelled with the arm's name.
fn run(a: &SimArgs, w: Workload, arm: &str, k: u32, nodes: u32) -> Result<ArmResult, SimError> {
    let vllm = arm == arms::VLLM_DP[0];
    // vLLM's API servers pin their own picks; dpcoord's settings are then unused.
    let (mut spec, settings) = prefix::arm(a, w, if vllm { "least_load" } else { arm }, k, CacheWeights::default());
    if vllm {
        spec.prompts_of.local = Some(StaleRule { every: SNAPSHOT_US, guess: true });
    }
    spec.nodes = nodes;
    spec.name = if nodes > 1 { format!("{nodes} nodes: {arm}/{k}") } else { format!("{arm}/{k}") };
    let mut r = run_arm(&spec, &settings, a)?;
    r.policy = arm.to_owned();
    Ok(r)
}

/// `--workload`, or the shared-prefix workload.
fn chosen(a: &SimArgs) -> Vec<Workload> {
    let named = |w: &Workload| a.workloads.iter().any(|n| n == w.name());
    let [shared, ..] = workloads();
    let picked: Vec<Workload> = workloads().into_iter().filter(named).collect();
    if picked.is_empty() {
        vec![shared]
    } else {
        picked
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// The run of `arm` at `k` API servers among `arms` (all at one node count).
fn find<'a>(arms: &'a [ArmResult], arm: &str, k: u32) -> Option<&'a ArmResult> {
    arms.iter().find(|r| r.policy == arm && r.name.ends_with(&format!("{arm}/{k}")))
}

/// Each dpcoord arm against vLLM's rule at the same number of API servers;
/// `lead` starts each line.
fn verdict(arms: &[ArmResult], lead: &str) -> String {
    let mut out = String::new();
    for k in API_SERVERS {
        let at = |arm: &str| find(arms, arm, k);
        let Some(vllm) = at(arms::VLLM_DP[0]) else { continue };
        for arm in &arms::VLLM_DP[1..] {
            let Some(d) = at(arm) else { continue };
            let _ = writeln!(out, "{lead}{k} API servers, {arm} vs vllm-rule: {}", versus(d, vllm));
        }
    }
    out
}

/// Run `a` against run `b`: input tok/s, TTFT p50 and p99, hit rate.
fn versus(a: &ArmResult, b: &ArmResult) -> String {
    format!(
        "input tok/s {} vs {} (x{:.2}), ttft p50 {} vs {} ms, p99 {} vs {} ms (x{:.2}), hit {:.1} vs {:.1} %",
        thousands(a.input_tps().round() as u64),
        thousands(b.input_tps().round() as u64),
        ratio(a.input_tps(), b.input_tps()),
        ms(a.ttft_p50),
        ms(b.ttft_p50),
        ms(a.ttft_p99),
        ms(b.ttft_p99),
        ratio(a.ttft_p99 as f64, b.ttft_p99 as f64),
        a.hit_rate() * 100.0,
        b.hit_rate() * 100.0
    )
}

/// What the split over `nodes` costs each arm at each number of API
/// servers (`split` against `one`, the one-node runs), and whether every
/// placement kept to its API server's node.
fn node_verdict(one: &[ArmResult], split: &[ArmResult], nodes: u32) -> String {
    let mut out = String::new();
    for k in API_SERVERS {
        for arm in arms::VLLM_DP {
            let (Some(o), Some(s)) = (find(one, arm, k), find(split, arm, k)) else { continue };
            let _ = writeln!(out, "{k} API servers, {arm} on {nodes} nodes vs 1: {}", versus(s, o));
        }
    }
    out.push_str(&verdict(split, &format!("{nodes} nodes, ")));
    let off: u64 = split.iter().map(|r| r.off_node).sum();
    if off == 0 {
        out.push_str("every placement on its API server's node\n");
    } else {
        let _ = writeln!(out, "{off} placements outside their API server's node");
    }
    out
}

/// What the run over `nodes` nodes is, for its table's heading.
fn node_setup(a: &SimArgs, nodes: u32) -> String {
    format!(
        "on {nodes} nodes of {} ranks (vLLM's --data-parallel-size {} --data-parallel-size-local {} \
         --data-parallel-hybrid-lb): each node's API servers (fe / {nodes}) reach its ranks only, vllm-rule \
         scans them, dpcoord's arms ask with among = them; a round-robin balancer in front sends frontend f's \
         j-th request to node (f + j) % {nodes}, to the API server of index f / {nodes} there",
        a.ranks / nodes,
        a.ranks,
        a.ranks / nodes
    )
}

/// `dpcoord sim vllm-dp`: one table per workload, verdict lines, the chart;
/// with `--nodes 2`, a second table per workload over the nodes.
pub fn vllm_dp(a: &SimArgs) -> Result<Outcome, SimError> {
    let a = &SimArgs { requests: Some(a.requests.unwrap_or(REQUESTS)), ..a.clone() };
    let mut text = format!(
        "vllm-dp: vLLM 0.33's own DP balancing (vllm-rule) against the same API servers asking dpcoord\n{}; fe: API servers\n",
        prefix::setup(a)
    );
    let mut all = Vec::new();
    let mut rows = Vec::new();
    for w in chosen(a) {
        let mut results = Vec::new();
        for k in API_SERVERS {
            for arm in arms::VLLM_DP {
                results.push(run(a, w, arm, k, 1)?);
            }
        }
        let _ = write!(text, "\n{}: {}\n{}{}", w.name(), w.describe(), report::table(&results), verdict(&results, ""));
        rows.push((w.name().to_owned(), results.clone()));
        all.extend(results.clone());
        if a.nodes > 1 {
            let mut split = Vec::new();
            for k in API_SERVERS {
                for arm in arms::VLLM_DP {
                    split.push(run(a, w, arm, k, a.nodes)?);
                }
            }
            let _ = write!(
                text,
                "\n{} {}\n{}{}",
                w.name(),
                node_setup(a, a.nodes),
                report::table(&split),
                node_verdict(&results, &split, a.nodes)
            );
            rows.push((format!("{}, {} nodes", w.name(), a.nodes), split.clone()));
            all.extend(split);
        }
    }
    let lost: u64 = all.iter().map(|r| r.lost).sum();
    if lost == 0 {
        text.push_str("zero requests lost in every arm\n");
    } else {
        let _ = writeln!(text, "LOST {lost} requests over all arms");
    }
    text.push_str(&super::report::caveats(&all));
    let named: Vec<(&str, Vec<ArmResult>)> = rows.iter().map(|(w, r)| (w.as_str(), r.clone())).collect();
    let svg = report::chart("vllm-dp: throughput and TTFT p90 per arm (solid: 2 API servers, pale: 4)", &named);
    Ok(Outcome { name: "vllm-dp", text, svg, broken: None })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: SimArgs,
    }

    fn args(extra: &[&str]) -> SimArgs {
        let base = ["sim", "vllm-dp", "--speed", "0", "--requests", "240"];
        Cli::parse_from(base.iter().chain(extra)).a
    }

    /// Over 2 nodes, each frontend's requests alternate between the nodes, so each
    /// node takes exactly half, and no arm places one outside its API server's node:
    /// vLLM's rule scans the node's ranks, dpcoord's arms ask with `among`.
    #[test]
    fn over_two_nodes_every_arm_keeps_each_request_on_its_node() {
        let a = args(&["--nodes", "2"]);
        let [shared, ..] = workloads();
        for k in API_SERVERS {
            for arm in arms::VLLM_DP {
                let r = run(&a, shared, arm, k, 2).unwrap();
                assert_eq!((r.completed, r.lost, r.off_node), (240, 0, 0), "{arm} at {k} API servers");
                let node = |ranks: std::ops::Range<usize>| r.placements[ranks].iter().sum::<u64>();
                assert_eq!((node(0..4), node(4..8)), (120, 120), "{arm} at {k}: {:?}", r.placements);
                assert_eq!(r.name, format!("2 nodes: {arm}/{k}"));
            }
        }
    }

    #[test]
    fn the_node_verdict_compares_each_arm_with_its_one_node_run() {
        let rec = crate::record::Recorder::new(8);
        let result = |arm: &str, name: String, tps: u64| ArmResult {
            policy: arm.to_owned(),
            input_tokens: tps,
            makespan: 1_000_000,
            ..rec.summarize(&name, arm, 0)
        };
        let one: Vec<ArmResult> = arms::VLLM_DP.iter().map(|arm| result(arm, format!("{arm}/2"), 1000)).collect();
        let mut split: Vec<ArmResult> =
            arms::VLLM_DP.iter().map(|arm| result(arm, format!("2 nodes: {arm}/2"), 900)).collect();
        let text = node_verdict(&one, &split, 2);
        assert!(text.starts_with(
            "2 API servers, vllm-rule on 2 nodes vs 1: input tok/s 900 vs 1,000 (x0.90), ttft p50 0.0 vs 0.0 ms"
        ));
        assert!(
            text.contains("\n2 nodes, 2 API servers, cache_aware/events vs vllm-rule: input tok/s 900 vs 900 (x1.00)")
        );
        assert!(text.ends_with("every placement on its API server's node\n"), "{text}");
        split[1].off_node = 3;
        assert!(node_verdict(&one, &split, 2).ends_with("3 placements outside their API server's node\n"));
    }
}
