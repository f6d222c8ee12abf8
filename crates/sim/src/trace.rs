//! `dpcoord sim trace FILE`: a published request trace replayed open loop
//! on its timestamps (`--time-scale` times as fast) over ranks with prefix
//! caches publishing KV events, as in `sim prefix`. Arms: `round_robin`,
//! `least_load`, `lmetric` (events), `cache_aware` approximate and with
//! events, at 1 and 4 frontends, and the bound (`trace_bound`); once as
//! recorded, once with every block made unique (the same lengths and
//! times, nothing shared). `--generate SHAPE` writes a trace instead.

use std::fmt::Write;
use std::path::Path;
use std::sync::Arc;

use super::args::SimArgs;
use super::arms;
use super::error::SimError;
use super::model::DEFAULT_COST;
use super::prefix::{self, BLOCK};
use super::prefix_cache::CacheSpec;
use super::prefix_report as report;
use super::report::thousands;
use super::scenario::{run_arm, Outcome};
use super::summary::ArmResult;
use super::trace_bound::bound;
use super::trace_file::{self, Trace};
use super::trace_gen::{self, Shape};
use super::trace_replay::Replay;
use super::workload::Load;
use super::world::CacheWeights;

/// Rows `--generate` writes unless `--requests` says otherwise.
pub const GENERATED: u64 = 2000;

/// `--generate`: writes the trace and what it is like.
pub fn write_generated(shape: Shape, file: &Path, a: &SimArgs) -> Result<(), SimError> {
    let rows = trace_gen::generate(shape, a.requests.unwrap_or(GENERATED) as usize, a.seed);
    std::fs::write(file, trace_file::to_mooncake(&rows))
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot write {}: {e}", file.display())))?;
    let s = trace_gen::stats(&rows, trace_file::MOONCAKE_BLOCK);
    println!(
        "wrote {}: {} requests over {:.0} s, mean input {:.0} tokens, mean output {:.0}, {:.1} % of prompt tokens \
         reusable",
        file.display(),
        s.requests,
        s.seconds,
        s.mean_input,
        s.mean_output,
        s.reusable * 100.0
    );
    Ok(())
}

/// One arm's run over `replay`.
fn run(a: &SimArgs, replay: &Arc<Replay>, arm: &str, frontends: u32) -> Result<ArmResult, SimError> {
    let (mut spec, mut settings) = prefix::routed(a, arm, frontends, CacheWeights::default());
    // Token ids below 65,536 take at most 3 bytes each in MessagePack.
    let longest = replay.requests.iter().map(|(_, p)| u64::from(p.prompt_len)).max().unwrap_or(0);
    settings.max_message_bytes = settings.max_message_bytes.max(longest * 3 + 4096);
    let last = replay.last_arrival();
    spec.engine.cache = spec.engine.cache.map(|c| CacheSpec { bounded: true, ..c });
    spec.load = Load::Scheduled;
    spec.prompts = None;
    spec.replay = Some(Arc::clone(replay));
    spec.sample_every = (last / 200).max(10_000);
    spec.horizon = last.saturating_mul(10).saturating_add(600_000_000);
    let mut r = run_arm(&spec, &settings, a)?;
    r.policy = arm.to_owned();
    Ok(r)
}

/// The arms `--policy` names (an arm's name or its policy), or all.
fn chosen_arms(a: &SimArgs) -> Vec<&'static str> {
    let named = |arm: &str| a.policies.iter().any(|p| arm == p || arm.split('/').next() == Some(p.as_str()));
    arms::TRACE.into_iter().filter(|arm| a.policies.is_empty() || named(arm)).collect()
}

fn find<'a>(arms: &'a [ArmResult], policy: &str, fe: &str) -> Option<&'a ArmResult> {
    arms.iter().find(|a| a.policy == policy && a.name.ends_with(&format!("/{fe}")))
}

/// The goals, each as a ratio of two arms of this run.
fn verdict(recorded: &[ArmResult], unshared: &[ArmResult]) -> String {
    let mut out = String::new();
    let tps = ArmResult::input_tps;
    let ev = |arms| find(arms, "cache_aware/events", "1");
    if let (Some(ev), Some(rr), Some(lm)) =
        (ev(recorded), find(recorded, "round_robin", "1"), find(recorded, "lmetric/events", "1"))
    {
        let _ = writeln!(
            out,
            "as recorded: events / round_robin throughput x{:.3} (goal >= 1.3); events / lmetric ttft p90 x{:.3} \
             (goal <= 0.9)",
            tps(ev) / tps(rr).max(1e-9),
            ev.ttft_p90 as f64 / lm.ttft_p90.max(1) as f64
        );
    }
    if let (Some(ev), Some(ap)) = (ev(recorded), find(recorded, "cache_aware/approx", "1")) {
        let _ = writeln!(
            out,
            "as recorded: approx / events throughput x{:.3}, hit {:.1} % vs {:.1} %",
            tps(ap) / tps(ev).max(1e-9),
            ap.hit_rate() * 100.0,
            ev.hit_rate() * 100.0
        );
    }
    if let (Some(ev), Some(b)) = (ev(recorded), find(recorded, "bound", "1")) {
        let _ = writeln!(
            out,
            "as recorded: events / bound throughput x{:.3}, ttft p90 x{:.1}, hit {:.1} % of at most {:.1} %",
            tps(ev) / tps(b).max(1e-9),
            ev.ttft_p90 as f64 / b.ttft_p90.max(1) as f64,
            ev.hit_rate() * 100.0,
            b.hit_rate() * 100.0
        );
    }
    if let (Some(ev), Some(ll)) = (ev(unshared), find(unshared, "least_load", "1")) {
        let _ = writeln!(
            out,
            "no sharing: events / least_load throughput x{:.3} (goal >= 0.98), ttft p99 x{:.3}",
            tps(ev) / tps(ll).max(1e-9),
            ev.ttft_p99 as f64 / ll.ttft_p99.max(1) as f64
        );
    }
    for (label, arms) in [("as recorded", recorded), ("no sharing", unshared)] {
        if let (Some(four), Some(one)) = (find(arms, "cache_aware/events", "4"), ev(arms)) {
            let _ = writeln!(
                out,
                "{label}: events at 4 frontends / 1 throughput x{:.3} (goal >= 0.98)",
                tps(four) / tps(one).max(1e-9)
            );
        }
    }
    out
}

fn describe(a: &SimArgs, path: &Path, t: &Trace, replay: &Replay) -> String {
    let mut rows = t.rows.clone();
    rows.sort_by(|a, b| a.at_ms.total_cmp(&b.at_ms));
    rows.truncate(replay.requests.len());
    let s = trace_gen::stats(&rows, t.block);
    format!(
        "{}: {} trace, {} of {} requests over {:.0} s as recorded, mean input {:.0} / output {:.0} tokens, {:.1} % of \
         prompt tokens in blocks an earlier request had; replayed {}x as fast, open loop on its timestamps\n{} ranks, \
         chunk {} tokens/step/rank, prefix cache {} blocks of {BLOCK} tokens per rank (LRU), seed {}",
        path.display(),
        t.format,
        thousands(replay.requests.len() as u64),
        thousands(t.rows.len() as u64),
        s.seconds,
        s.mean_input,
        s.mean_output,
        s.reusable * 100.0,
        a.time_scale,
        a.ranks,
        a.chunk,
        a.cache_blocks(),
        a.seed
    )
}

/// `dpcoord sim trace FILE`: a table per variant, the goals, the chart.
pub fn trace(a: &SimArgs) -> Result<Outcome, SimError> {
    let path = a.file.as_deref().ok_or_else(|| SimError::Usage("trace needs FILE".into()))?;
    let t = trace_file::read(path)?;
    let limit = a.requests.map_or(usize::MAX, |n| n as usize);
    let mut text = String::from("trace: prefix-cache routing on a replayed trace\n");
    let mut all: Vec<(&str, Vec<ArmResult>)> = Vec::new();
    for (label, unshared) in [("as recorded", false), ("no sharing", true)] {
        let replay = Arc::new(Replay::new(&t, limit, a.time_scale, BLOCK, unshared));
        if !unshared {
            text.push_str(&describe(a, path, &t, &replay));
            text.push('\n');
        }
        let mut results = Vec::new();
        for frontends in [1, 4] {
            for arm in chosen_arms(a) {
                match arm {
                    "bound" if frontends == 1 => {
                        results.push(bound(&replay, BLOCK, a.chunk, DEFAULT_COST, a.ranks, frontends));
                    }
                    "bound" => {}
                    _ => results.push(run(a, &replay, arm, frontends)?),
                }
            }
        }
        let what = if unshared { "the same rows, every block its own" } else { "the rows as they are" };
        let _ = write!(text, "\n{label}: {what}\n{}", report::table(&results));
        all.push((label, results));
    }
    text.push('\n');
    text.push_str(&verdict(&all[0].1, &all[1].1));
    text.push_str(&super::report::caveats(&all.iter().flat_map(|(_, r)| r.clone()).collect::<Vec<_>>()));
    let svg = report::chart("trace: throughput and TTFT p90 per arm (solid: 1 frontend, pale: 4)", &all);
    Ok(Outcome { name: "trace", text, svg, broken: None })
}
