//! `dpcoord sim vllm-dp`: vLLM's own balancing against the same API
//! servers asking dpcoord. K API servers (frontends) share 8 ranks with
//! prefix caches on the shared-prefix workload of `prefix`; in `vllm-rule`
//! each places its requests itself by vLLM 0.33's rule (see `stale`: no
//! prefix awareness), in the other arms each asks dpcoord instead, which
//! runs `least_load`, or `cache_aware` on the engines' KV events. Each arm
//! runs at 2 and 4 API servers. `--workload` runs other workloads instead.

use std::fmt::Write;

use super::prefix;
use super::prefix_report as report;
use super::prompts::Workload;
use super::record::ArmResult;
use super::report::{ms, thousands};
use super::scenario::{run_arm, Outcome};
use super::stale::StaleRule;
use super::world::CacheWeights;
use super::{SimArgs, SimError};

/// The arms, in table order.
pub const ARMS: [&str; 3] = ["vllm-rule", "least_load", "cache_aware/events"];

/// API servers per run (`--api-server-count`).
pub const API_SERVERS: [u32; 2] = [2, 4];

/// Requests per arm unless `--requests` says otherwise: enough that TTFT
/// p99 is not the cold start (the first 64 requests on empty caches).
pub const REQUESTS: u64 = 4800;

/// vLLM's coordinator publishes the engines' counts this often.
const SNAPSHOT_US: u64 = 100_000;

/// Runs one arm with `k` API servers; its result is labelled with the arm's name.
fn run(a: &SimArgs, w: Workload, arm: &str, k: u32) -> Result<ArmResult, SimError> {
    let vllm = arm == ARMS[0];
    // vLLM's API servers pin their own picks; dpcoord's settings are then unused.
    let (mut spec, settings) = prefix::arm(a, w, if vllm { "least_load" } else { arm }, k, CacheWeights::default());
    if vllm {
        spec.prompts_of.local = Some(StaleRule { every: SNAPSHOT_US, guess: true });
    }
    spec.name = format!("{arm}/{k}");
    let mut r = run_arm(&spec, &settings, a)?;
    r.policy = arm.to_owned();
    Ok(r)
}

/// `--workload`, or the shared-prefix workload.
fn chosen(a: &SimArgs) -> Vec<Workload> {
    let named = |w: &Workload| a.workloads.iter().any(|n| n == w.name());
    let [shared, ..] = prefix::workloads();
    let picked: Vec<Workload> = prefix::workloads().into_iter().filter(named).collect();
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

/// Each dpcoord arm against vLLM's rule at the same number of API servers.
fn verdict(arms: &[ArmResult]) -> String {
    let mut out = String::new();
    for k in API_SERVERS {
        let at = |arm: &str| arms.iter().find(|r| r.policy == arm && r.name == format!("{arm}/{k}"));
        let Some(vllm) = at(ARMS[0]) else { continue };
        for arm in &ARMS[1..] {
            let Some(d) = at(arm) else { continue };
            let _ = writeln!(
                out,
                "{k} API servers, {arm} vs vllm-rule: input tok/s {} vs {} (x{:.2}), ttft p50 {} vs {} ms, \
                 p99 {} vs {} ms (x{:.2}), hit {:.1} vs {:.1} %",
                thousands(d.input_tps().round() as u64),
                thousands(vllm.input_tps().round() as u64),
                ratio(d.input_tps(), vllm.input_tps()),
                ms(d.ttft_p50),
                ms(vllm.ttft_p50),
                ms(d.ttft_p99),
                ms(vllm.ttft_p99),
                ratio(d.ttft_p99 as f64, vllm.ttft_p99 as f64),
                d.hit_rate() * 100.0,
                vllm.hit_rate() * 100.0
            );
        }
    }
    out
}

/// `dpcoord sim vllm-dp`: one table per workload, verdict lines, the chart.
pub fn vllm_dp(a: &SimArgs) -> Result<Outcome, SimError> {
    let a = &SimArgs { requests: Some(a.requests.unwrap_or(REQUESTS)), ..a.clone() };
    let mut text = format!(
        "vllm-dp: vLLM 0.33's own DP balancing (vllm-rule) against the same API servers asking dpcoord\n{}; fe: API servers\n",
        prefix::setup(a)
    );
    let mut all = Vec::new();
    for w in chosen(a) {
        let mut results = Vec::new();
        for k in API_SERVERS {
            for arm in ARMS {
                results.push(run(a, w, arm, k)?);
            }
        }
        let _ = write!(text, "\n{}: {}\n{}{}", w.name(), w.describe(), report::table(&results), verdict(&results));
        all.push((w, results));
    }
    let lost: u64 = all.iter().flat_map(|(_, r)| r).map(|r| r.lost).sum();
    if lost == 0 {
        text.push_str("zero requests lost in every arm\n");
    } else {
        let _ = writeln!(text, "LOST {lost} requests over all arms");
    }
    text.push_str(&super::report::caveats(&all.iter().flat_map(|(_, r)| r.clone()).collect::<Vec<_>>()));
    let named: Vec<(&str, Vec<ArmResult>)> = all.into_iter().map(|(w, r)| (w.name(), r)).collect();
    let svg = report::chart("vllm-dp: throughput and TTFT p90 per arm (solid: 2 API servers, pale: 4)", &named);
    Ok(Outcome { name: "vllm-dp", text, svg, broken: None })
}
