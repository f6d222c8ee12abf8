//! `dpcoord sim elastic`: vLLM's elastic data parallelism, scale-up and
//! scale-down under load. dpcoord starts with `--ranks` ranks (8); at T1
//! half as many engines again start and the operator sends `resize` (12) on
//! the health socket: the new ranks take placements once they publish. At T2
//! the operator sends `resize` down to three quarters (6) first, so dpcoord
//! places nothing more on the removed ranks from that reply on; they finish
//! what they hold and stop. Nothing may be lost, and no removed rank may get
//! a placement after its reply: a run that breaks either fails.

use std::fmt::Write;

use super::args::SimArgs;
use super::error::SimError;
use super::link::ProbeVia;
use super::local::DaemonSettings;
use super::phase::Phase;
use super::report::{self, join, ms, thousands};
use super::scenario::{base, describe, nominal_us, policies, probe, run_arm, Outcome};
use super::summary::ArmResult;
use super::svg;
use super::world::ArmSpec;

/// The table's sizes: `(start, up, down)`, 8 -> 12 -> 6 for 8 ranks.
fn sizes(ranks: u32) -> (u32, u32, u32) {
    (ranks, (ranks + ranks / 2).max(ranks + 1), (ranks * 3 / 4).max(1))
}

/// The arm: the resizes at a third and at 55 % of the nominal run time
/// (what 8 ranks would need), so each phase serves about a third of the prompts.
fn spec(a: &SimArgs) -> ArmSpec {
    let (_, up, down) = sizes(a.ranks);
    let nominal = nominal_us(a);
    let resizes = vec![(nominal / 3, up), (nominal * 11 / 20, down)];
    ArmSpec { resizes, probe: probe(a, ProbeVia::Health), ..base(a, "elastic", true) }
}

/// `first-last`, or the one rank.
fn span(from: u32, to: u32) -> String {
    if to <= from + 1 {
        from.to_string()
    } else {
        format!("{from}-{}", to - 1)
    }
}

fn secs(us: u64) -> String {
    format!("{:.1}", us as f64 / 1e6)
}

/// What happened at the start of phase `i` (the same virtual time in every arm).
fn heading(i: usize, p: &Phase, before: Option<u32>) -> String {
    let ranks = format!("phase {}: {} ranks ({})", i + 1, p.dp_size, span(0, p.dp_size));
    match before {
        None => format!("{ranks} from the start"),
        Some(b) if b < p.dp_size => format!(
            "{ranks}; at {} s ranks {} start and the operator sends resize {}: they take placements once they publish",
            secs(p.from),
            span(b, p.dp_size),
            p.dp_size
        ),
        Some(b) => format!(
            "{ranks}; at {} s the operator sends resize {}: ranks {} take no placement from its reply on, \
             finish what they hold and stop",
            secs(p.from),
            p.dp_size,
            span(p.dp_size, b)
        ),
    }
}

/// One table for phase `i`: a row per arm.
fn table(arms: &[ArmResult], i: usize) -> String {
    let name = |p: &Phase| format!("{}-ranks", p.dp_size);
    let rows: Vec<(&ArmResult, &Phase)> = arms.iter().filter_map(|a| a.phases.get(i).map(|p| (a, p))).collect();
    let pol_w = arms.iter().map(|a| a.policy.len()).max().unwrap_or(6).max(6);
    let mut out = format!(
        "{:<9}{:<pol_w$}  {:>5}  {:>6}  {:>6}  {:>9}  {:>11}  {:>11}  {:>11}  {:>5}  {:>7}  {:>9}  placements per rank\n",
        "phase", "policy", "epoch", "from s", "to s", "completed", "input tok/s", "ttft p50 ms", "ttft p99 ms", "std",
        "removed", "drained s"
    );
    for (a, p) in rows {
        let _ = writeln!(
            out,
            "{:<9}{:<pol_w$}  {:>5}  {:>6}  {:>6}  {:>9}  {:>11}  {:>11}  {:>11}  {:>5.2}  {:>7}  {:>9}  {}",
            name(p),
            a.policy,
            p.epoch,
            secs(p.from),
            secs(p.to),
            p.completed,
            thousands(p.input_tps().round() as u64),
            ms(p.ttft_p50),
            ms(p.ttft_p99),
            p.placement_std(),
            p.removed.as_ref().map_or("-".into(), |(_, n)| n.to_string()),
            p.drained.map_or("-".into(), secs),
            join(&p.placements)
        );
    }
    out
}

/// Every phase's heading and table.
fn phases(arms: &[ArmResult]) -> String {
    let Some(first) = arms.first() else { return String::new() };
    let mut out = String::new();
    for (i, p) in first.phases.iter().enumerate() {
        let before = i.checked_sub(1).map(|b| first.phases[b].dp_size);
        let _ = write!(out, "{}\n{}\n", heading(i, p, before), table(arms, i));
    }
    out
}

/// What the run promises, stated; `Err` names what it broke.
fn verdict(arms: &[ArmResult]) -> (String, Option<String>) {
    let lost: u64 = arms.iter().map(|a| a.lost).sum();
    let misplaced: u64 = arms.iter().flat_map(|a| &a.phases).filter_map(|p| p.removed.as_ref().map(|r| r.1)).sum();
    let mut text = String::new();
    let mut broken = Vec::new();
    match lost {
        0 => text.push_str("zero requests lost in every arm\n"),
        n => broken.push(format!("LOST {n} requests over all arms")),
    }
    match misplaced {
        0 => text.push_str("no placement on a removed rank after its resize reply, in any arm\n"),
        n => broken.push(format!("{n} placements on removed ranks after their resize reply")),
    }
    for b in &broken {
        let _ = writeln!(text, "{b}");
    }
    (text, (!broken.is_empty()).then(|| broken.join("; ")))
}

/// Runs the scale-up and scale-down under every policy.
pub fn elastic(a: &SimArgs) -> Result<Outcome, SimError> {
    let spec = spec(a);
    let (start, up, down) = sizes(a.ranks);
    let mut results = Vec::new();
    for policy in &policies(a) {
        let settings = DaemonSettings { max_ranks: up, ..DaemonSettings::defaults(a.ranks, policy) };
        results.push(run_arm(&spec, &settings, a)?);
    }
    let title = format!("elastic: dpcoord's table resized {start} -> {up} -> {down} ranks under load");
    let mut text = format!(
        "{title}\n{}\ninput tok/s: prompt tokens prefilled in the phase per second; ttft: requests sent in the phase; \
         removed: user placements on the ranks the phase's resize removed, after its reply; \
         drained: when the last of them stopped\n\n{}",
        describe(a, &spec),
        phases(&results)
    );
    let (verdict, broken) = verdict(&results);
    text.push_str(&verdict);
    text.push_str(&report::probes(&results));
    text.push_str(&report::caveats(&results));
    Ok(Outcome { name: "elastic", svg: svg::chart(&title, &results), text, broken })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eight_ranks_grow_to_twelve_and_shrink_to_six() {
        assert_eq!(sizes(8), (8, 12, 6));
        assert_eq!(sizes(1), (1, 2, 1));
        assert_eq!((span(8, 12), span(0, 1)), ("8-11".to_owned(), "0".to_owned()));
    }

    #[test]
    fn a_lost_request_or_a_placement_on_a_removed_rank_breaks_the_run() {
        let mut rec = crate::record::Recorder::new(2);
        rec.table(0, 2, 2, 0);
        rec.table(10, 1, 3, 0);
        let good = rec.summarize("elastic", "round_robin", 0);
        assert_eq!(verdict(std::slice::from_ref(&good)).1, None);
        let mut lost = good.clone();
        lost.lost = 2;
        rec.placements = vec![0, 1];
        let misplaced = rec.summarize("elastic", "least_load", 0);
        let (text, broken) = verdict(&[lost, misplaced]);
        assert_eq!(
            broken.as_deref(),
            Some("LOST 2 requests over all arms; 1 placements on removed ranks after their resize reply")
        );
        assert!(
            text.ends_with("LOST 2 requests over all arms\n1 placements on removed ranks after their resize reply\n")
        );
    }
}
