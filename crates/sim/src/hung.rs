//! `hung-rank`: at 30 % of the run one rank stops stepping while its stats
//! keep going out, the same counts each time (as vLLM's API-server timer
//! repeats the last gauges). Unlike a dead rank it never goes silent:
//! dpcoord can tell only by its `progress` (the engine's steps) standing
//! still while it reports work, for `engines.stall_after_ms`. Each policy
//! runs twice, detection on (the key's default) and off (0). Frontends give
//! up on a request after [`TIMEOUT`] without a token from it and place it
//! again; the hung rank keeps what it holds.

use std::fmt::Write;

use super::args::{DaemonMode, SimArgs};
use super::error::SimError;
use super::local::DaemonSettings;
use super::model::Micros;
use super::scenario::{base, describe, nominal_us, policies, run_arm, Outcome, Stop};
use super::summary::ArmResult;
use super::world::{ArmSpec, BEAT};
use super::{report, svg};
use dpcoord_daemon::config::keys;

/// A frontend's wait for a request's next token (the first, from its
/// placement) before it places it again.
pub const TIMEOUT: Micros = 30_000_000;

/// The arms of each policy: `engines.stall_after_ms` on (its default) and off.
const ARMS: [(&str, u64); 2] = [("detect", keys::STALL_AFTER_MS.default), ("off", 0)];

pub fn hung_rank(a: &SimArgs) -> Result<Outcome, SimError> {
    let rank = 3 % a.ranks;
    let at = nominal_us(a) * 3 / 10;
    let mut spec = ArmSpec { hang: Some((rank, at)), timeout: Some(TIMEOUT), ..base(a, "", false) };
    // Room for requests placed on the hung rank again and again (detection off).
    spec.horizon = spec.horizon.saturating_add(20 * TIMEOUT);
    let mut results = Vec::new();
    for policy in &policies(a) {
        for (name, stall_after_ms) in ARMS {
            let settings = DaemonSettings { stall_after_ms, ..DaemonSettings::defaults(a.ranks, policy) };
            results.push(run_arm(&ArmSpec { name: name.to_owned(), ..spec.clone() }, &settings, a)?);
        }
    }
    let stall = keys::STALL_AFTER_MS.default;
    let seen = match (a.daemon, a.speed) {
        (DaemonMode::Stepped, _) => format!("{stall} ms of virtual time"),
        (DaemonMode::Threaded, x) if x > 0.0 => {
            format!("{stall} ms of wall time, {:.1} s of virtual time", stall as f64 / 1000.0 * x)
        }
        (DaemonMode::Threaded, _) => format!("{stall} ms of wall time, maybe never in an unpaced run"),
    };
    let title = format!(
        "rank {rank} hangs at {:.1} s (or its first step after) and keeps publishing; dpcoord sees it stalled after {seen} \
         (arm detect) or never (arm off: engines.stall_after_ms = 0)",
        at as f64 / 1e6
    );
    // No prober: the progress check alone tells (a failing probe would too).
    let setup = describe(a, &spec).replace(&format!("prober every {} ms", a.probe_every_ms), "no prober");
    let mut text = format!("hung-rank: {title}\n{setup}\n\n{}", report::table(&results));
    let lost: u64 = results.iter().map(|r| r.lost).sum();
    if lost == 0 {
        text.push_str("zero requests lost in every arm\n");
    } else {
        let _ = writeln!(text, "LOST {lost} requests over all arms");
    }
    let broken = hangs(a, at, &results, &mut text);
    for pair in results.chunks(2) {
        if let [on, off] = pair {
            text.push_str(&versus(on, off));
        }
    }
    text.push_str(&report::caveats(&results));
    let svg = svg::chart(&format!("hung-rank: {title}"), &results);
    Ok(Outcome { name: "hung-rank", svg, text, broken })
}

/// One policy with detection against without: throughput, TTFT p99, timeouts.
fn versus(on: &ArmResult, off: &ArmResult) -> String {
    let change = if off.input_tps() > 0.0 { (on.input_tps() / off.input_tps() - 1.0) * 100.0 } else { 0.0 };
    format!(
        "{}: {} vs {}: input tok/s {} vs {} ({change:+.1} %), ttft p99 {} vs {} ms, timeouts {} vs {}\n",
        on.policy,
        on.name,
        off.name,
        report::thousands(on.input_tps().round() as u64),
        report::thousands(off.input_tps().round() as u64),
        report::ms(on.ttft_p99),
        report::ms(off.ttft_p99),
        on.timeouts,
        off.timeouts
    )
}

/// When dpcoord showed the hung rank `stalled`, and the user placements it
/// gave that rank between the hang and then, and after. A placement after
/// it showed stalled breaks the run, as does a stepped run with detection
/// on in which it never did, or one with detection off in which it did.
fn hangs(a: &SimArgs, planned: Micros, results: &[ArmResult], text: &mut String) -> Option<String> {
    let hung: Vec<_> = results.iter().filter_map(|r| r.hang.map(|h| (r, h))).collect();
    let (_, first) = hung.first()?;
    let (stall, tick) = (keys::STALL_AFTER_MS.default, keys::TICK_MS.default);
    let _ = writeln!(
        text,
        "\nrank {} hangs in its first step from {:.2} s on; a rank with work whose progress stands still for engines.stall_after_ms \
         ({stall} ms) is stalled at the next tick (routing.tick_ms {tick} ms); a frontend places a request \
         again after {} s without a token from it\n{:<14}  {:<6}  {:>9}  {:>16}  {:>10}  {:>24}  {:>16}  {:>8}",
        first.rank,
        planned as f64 / 1e6,
        TIMEOUT / 1_000_000,
        "policy",
        "arm",
        "hung at",
        "shown stalled at",
        "after hang",
        "placements hang->stalled",
        "after it stalled",
        "timeouts"
    );
    let mut broken = Vec::new();
    for (r, h) in &hung {
        let (at, after) = match h.down_at {
            Some(t) => (format!("{:.2} s", t as f64 / 1e6), format!("{:.2} s", (t - h.at) as f64 / 1e6)),
            None => ("never".to_owned(), "-".to_owned()),
        };
        let before = h.after_death - h.after_down;
        let _ = writeln!(
            text,
            "{:<14}  {:<6}  {:>9}  {at:>16}  {after:>10}  {before:>24}  {:>16}  {:>8}",
            r.policy,
            r.name,
            format!("{:.2} s", h.at as f64 / 1e6),
            h.after_down,
            r.timeouts
        );
        if h.after_down > 0 {
            broken.push(format!(
                "{} {}: {} placements on rank {} after dpcoord showed it stalled",
                r.policy, r.name, h.after_down, h.rank
            ));
        }
        // Its progress last moved at its last step end, before it hung.
        let due = h.at + (stall + tick) * 1000 + BEAT;
        let detects = r.name == ARMS[0].0;
        let label = format!("{} {}", r.policy, r.name);
        if !detects {
            if h.down_at.is_some() {
                broken.push(format!("{label}: rank {} shown stalled with detection off", h.rank));
            }
        } else {
            let stop = Stop { label: &label, rank: h.rank, at: h.at, ended: h.ended, event: "hung", shown: "stalled" };
            broken.extend(stop.judge(h.down_at, due, a.daemon == DaemonMode::Threaded, text));
        }
    }
    for b in &broken {
        let _ = writeln!(text, "{b}");
    }
    (!broken.is_empty()).then(|| broken.join("; "))
}
