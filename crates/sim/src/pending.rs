//! `dpcoord sim pending`: dpcoord's count of its own placements not yet in
//! an engine's reports, against the truth, when a request takes a hop
//! (20-50 ms of virtual time) from its placement to its engine.
//!
//! Three arms, each with 1, 4 and 16 frontends under `least_load`:
//! - `exact`: engines publish `StatsUpdate` with the cumulative `received`,
//!   so `pending = routed - received`;
//! - `reconcile`: engines publish SGLang load snapshots (gauges only, on
//!   change and a 1 s heartbeat, on a 10 ms call throttle) on their own PUBs,
//!   and a snapshot arriving `routing.pending_transit_ms` (100, the default)
//!   after a placement is taken to include it;
//! - `overwrite`: the same snapshots with `pending_transit_ms = 0`, so each
//!   one overwrites dpcoord's own counts (the herding of vllm#48027).
//!
//! Before each placement the simulator reads dpcoord's `pending` per rank
//! and compares it with the truth, which it knows exactly: the rank's
//! placements that the latest report dpcoord has does not include.
//! Under `--daemon threaded`, `pending_transit_ms` is wall time, so the
//! `reconcile` arms run paced at one virtual second per second whatever
//! `--speed` says; a stepped coordinator measures it in virtual time.

use std::fmt::Write;

use super::args::{DaemonMode, SimArgs};
use super::error::SimError;
use super::local::DaemonSettings;
use super::model::{Micros, SimEngine, DEFAULT_COST};
use super::report::{self, join, ms, thousands};
use super::scenario::{base, run_arm, Outcome};
use super::summary::ArmResult;
use super::svg;
use super::workload::Load;
use super::world::{ArmSpec, Handoff};

const FRONTENDS: [u32; 3] = [1, 4, 16];
const ARMS: [&str; 3] = ["exact", "reconcile", "overwrite"];
/// The frontend -> engine hop (virtual time).
const TRANSIT: (Micros, Micros) = (20_000, 50_000);
/// The event grid, and the SGLang publishers' call throttle.
const GRID: Micros = 10_000;

/// The workload: four times `--prompts`, uniform around `--input-tokens /
/// 64` tokens, open loop at `--rate` or at 90 % of the ranks' prefill
/// capacity, so several requests arrive within one hop of each other.
fn spec(a: &SimArgs, frontends: u32) -> ArmSpec {
    let mean = (a.input_tokens / 64).max(2);
    let lo = (mean / 8).max(1);
    let step_s = SimEngine::new(a.chunk, 1, DEFAULT_COST, 100).step_us(a.chunk) as f64 / 1e6;
    let capacity = f64::from(a.ranks) * f64::from(a.chunk) / step_s;
    let rate = a.rate.unwrap_or(0.9 * capacity / f64::from(mean));
    let mut spec = base(a, "pending", true);
    spec.frontends = frontends;
    spec.prompts = Some(a.prompts * 4);
    spec.load = Load::Open { rate };
    spec.lengths.input = (lo, 2 * mean - lo);
    spec.handoff = Handoff { transit: TRANSIT, grid: GRID };
    let span = (a.prompts as f64 * 4.0 / rate * 1e6) as Micros;
    spec.sample_every = (span / 200).max(10_000);
    spec.horizon = span.saturating_mul(20).saturating_add(60_000_000);
    spec
}

/// One arm's run: its daemon settings and its pace.
fn run(a: &SimArgs, arm: &str, frontends: u32) -> Result<ArmResult, SimError> {
    let policy = a.policies.first().cloned().unwrap_or_else(|| "least_load".into());
    let mut settings = DaemonSettings::defaults(a.ranks, &policy);
    let mut spec = ArmSpec { name: format!("{arm}/{frontends}"), ..spec(a, frontends) };
    match arm {
        "exact" => {}
        "reconcile" => {
            settings.sglang_load = true;
            if a.daemon == DaemonMode::Threaded {
                spec.speed = 1.0;
            }
        }
        _ => {
            settings.sglang_load = true;
            settings.pending_transit_ms = 0;
        }
    }
    run_arm(&spec, &settings, a)
}

/// The comparison table: a row per frontend count and arm.
fn table(arms: &[ArmResult]) -> String {
    let mut out =
        format!(
        "{:<9}  {:<9}  {:>9}  {:>4}  {:>5}  {:>7}  {:>7}  {:>6}  {:>6}  {:>11}  {:>11}  {:>11}  placements per rank\n",
        "frontends", "arm", "completed", "lost", "std", "double", "missed", "max 2x", "max 0x", "input tok/s",
        "ttft p50 ms", "ttft p99 ms"
    );
    for a in arms {
        let (arm, frontends) = a.name.split_once('/').unwrap_or((&a.name, ""));
        let p = &a.pending;
        let _ = writeln!(
            out,
            "{frontends:<9}  {arm:<9}  {:>9}  {:>4}  {:>5.2}  {:>7.3}  {:>7.3}  {:>6}  {:>6}  {:>11}  {:>11}  {:>11}  {}",
            a.completed,
            a.lost,
            a.placement_std(),
            p.mean_over(),
            p.mean_under(),
            p.max_over,
            p.max_under,
            thousands(a.input_tps().round() as u64),
            ms(a.ttft_p50),
            ms(a.ttft_p99),
            join(&a.placements)
        );
    }
    out
}

/// Each arm's structural promise, checked over every frontend count.
fn promises(arms: &[ArmResult]) -> String {
    let all = |arm: &str, ok: fn(&ArmResult) -> bool| {
        arms.iter().filter(|a| a.name.split_once('/').is_some_and(|(n, _)| n == arm)).all(ok)
    };
    let held = |ok: bool| if ok { "holds" } else { "BROKEN" };
    let exact = all("exact", |a| a.pending.over + a.pending.under == 0);
    let reconcile = all("reconcile", |a| a.pending.under == 0);
    let overwrite = all("overwrite", |a| a.pending.over == 0);
    format!(
        "exact: pending equals the truth at every check: {}\n\
         reconcile: no placement counted nowhere (missed 0): {}\n\
         overwrite: no placement counted twice (double 0): {}\n",
        held(exact),
        held(reconcile),
        held(overwrite)
    )
}

/// Runs the three arms for 1, 4 and 16 frontends.
pub fn pending(a: &SimArgs) -> Result<Outcome, SimError> {
    let mut results = Vec::new();
    for frontends in FRONTENDS {
        for arm in ARMS {
            results.push(run(a, arm, frontends)?);
        }
    }
    let s = spec(a, 1);
    let Load::Open { rate } = s.load else { unreachable!("the pending workload is an open loop") };
    let title = "pending: a 20-50 ms hop to the engine; exact received / snapshots reconciled by time / \
                 snapshots overwriting";
    let mut text = format!(
        "{title}\n{} ranks in lockstep, least_load, open loop at {rate:.1} requests/s over all frontends, {} prompts \
         of {}..={} in / {} out tokens, speed {}x{}, seed {}\n\
         double / missed: placements dpcoord counted twice (as pending and in a report) / nowhere, summed over \
         ranks, mean over the checks before each placement; max 2x / 0x: the most on one rank at one check\n\n{}\n",
        a.ranks,
        a.prompts * 4,
        s.lengths.input.0,
        s.lengths.input.1,
        a.output_tokens,
        a.speed,
        if a.daemon == DaemonMode::Threaded { " (reconcile: 1x)" } else { "" },
        a.seed,
        table(&results)
    );
    text.push_str(&promises(&results));
    let lost: u64 = results.iter().map(|r| r.lost).sum();
    let broken = (lost > 0).then(|| format!("LOST {lost} requests over all arms"));
    match &broken {
        None => text.push_str("zero requests lost in every arm\n"),
        Some(b) => {
            let _ = writeln!(text, "{b}");
        }
    }
    for r in results.iter().filter(|r| r.name.starts_with("reconcile/") && r.late > 0) {
        let _ =
            writeln!(text, "note: {}: {} events ran over 4 ms late; this run may not repeat exactly", r.name, r.late);
    }
    text.push_str(&report::caveats(&results));
    Ok(Outcome { name: "pending", svg: svg::chart(title, &results), text, broken })
}
