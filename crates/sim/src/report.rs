//! Text reports: one table row per arm, then what the arms say side by side.

use std::fmt::Write;

use super::summary::ArmResult;

/// Groups digits in threes: `94812` -> `94,812`.
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Microseconds as milliseconds with one decimal.
pub fn ms(us: u64) -> String {
    format!("{:.1}", us as f64 / 1000.0)
}

/// Numbers separated by spaces.
pub fn join(xs: &[u64]) -> String {
    xs.iter().map(u64::to_string).collect::<Vec<_>>().join(" ")
}

/// The per-arm table.
pub fn table(arms: &[ArmResult]) -> String {
    let name_w = arms.iter().map(|a| a.name.len()).max().unwrap_or(3).max(3);
    let pol_w = arms.iter().map(|a| a.policy.len()).max().unwrap_or(6).max(6);
    let mut out = format!(
        "{:<name_w$}  {:<pol_w$}  {:>9}  {:>4}  {:>7}  {:>12}  {:>12}  {:>12}  {:>5}  user placements per rank\n",
        "arm", "policy", "completed", "lost", "retries", "input tok/s", "ttft p50 ms", "ttft p99 ms", "std"
    );
    for a in arms {
        let _ = writeln!(
            out,
            "{:<name_w$}  {:<pol_w$}  {:>9}  {:>4}  {:>7}  {:>12}  {:>12}  {:>12}  {:>5.2}  {}",
            a.name,
            a.policy,
            a.completed,
            a.lost,
            a.retries,
            thousands(a.input_tps().round() as u64),
            ms(a.ttft_p50),
            ms(a.ttft_p99),
            a.placement_std(),
            join(&a.placements)
        );
    }
    out
}

/// Probe placements per rank, for arms that probed.
pub fn probes(arms: &[ArmResult]) -> String {
    let mut out = String::new();
    for a in arms.iter().filter(|a| a.probes.iter().sum::<u64>() > 0) {
        let _ = writeln!(
            out,
            "probes in {} ({}): {} ({} failed), per rank {}",
            a.name,
            a.policy,
            a.probes.iter().sum::<u64>(),
            a.probe_failures,
            join(&a.probes)
        );
    }
    out
}

/// The policies whose `score` is highest, comma-separated (ties all named).
pub fn best(arms: &[ArmResult], score: impl Fn(&ArmResult) -> f64) -> String {
    let top = arms.iter().map(&score).fold(f64::NEG_INFINITY, f64::max);
    let names: Vec<&str> = arms.iter().filter(|a| score(a) == top).map(|a| a.policy.as_str()).collect();
    names.join(", ")
}

/// `arm` against `base`: placements and input throughput.
pub fn versus(arm: &ArmResult, base: &ArmResult) -> String {
    let same = if arm.placements == base.placements { "identical placements" } else { "different placements" };
    let change = if base.input_tps() > 0.0 { (arm.input_tps() / base.input_tps() - 1.0) * 100.0 } else { 0.0 };
    format!(
        "{} vs {}: {same} (std {:.2} vs {:.2}), input tokens/s {:+.2} %, ttft p99 {} vs {} ms\n",
        arm.name,
        base.name,
        arm.placement_std(),
        base.placement_std(),
        change,
        ms(arm.ttft_p99),
        ms(base.ttft_p99)
    )
}

/// A warning line when a run was not exactly reproducible.
pub fn caveats(arms: &[ArmResult]) -> String {
    let mut out = String::new();
    for a in arms.iter().filter(|a| a.sync_timeouts > 0) {
        let _ = writeln!(
            out,
            "note: {}: {} stats syncs timed out; this run may not repeat exactly",
            a.name, a.sync_timeouts
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Recorder;

    #[test]
    fn digits_are_grouped() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(94_812), "94,812");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn ties_name_every_best_policy() {
        let rec = Recorder::new(1);
        let arms: Vec<ArmResult> = ["a", "b", "c"].iter().map(|p| rec.summarize("x", p, 0)).collect();
        let score = |r: &ArmResult| if r.policy == "b" { 1.0 } else { 2.0 };
        assert_eq!(best(&arms, score), "a, c");
        assert_eq!(best(&arms[1..2], score), "b");
    }

    #[test]
    fn versus_states_placements_and_throughput() {
        let mut rec = Recorder::new(2);
        rec.placements = vec![2, 2];
        let mut base = rec.summarize("off", "round_robin", 0);
        base.input_tokens = 1000;
        base.makespan = 1_000_000;
        let mut arm = base.clone();
        arm.name = "on".into();
        arm.makespan = 2_000_000;
        assert_eq!(
            versus(&arm, &base),
            "on vs off: identical placements (std 0.00 vs 0.00), input tokens/s -50.00 %, ttft p99 0.0 vs 0.0 ms\n"
        );
    }
}
