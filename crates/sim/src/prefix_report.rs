//! The prefix scenario's tables, verdict lines and bar chart.

use std::fmt::Write;

use super::prompts::Workload;
use super::report::{join, ms, thousands};
use super::summary::ArmResult;

const COLOURS: [&str; 12] = [
    "#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
    "#393b79", "#ad494a",
];

/// Frontends of an arm run (its name ends in `/N`).
fn frontends(r: &ArmResult) -> &str {
    r.name.rsplit('/').next().unwrap_or("1")
}

/// One row per arm run.
pub fn table(arms: &[ArmResult]) -> String {
    let mut out = format!(
        "{:<20} {:>3} {:>9} {:>4} {:>12} {:>10} {:>10} {:>10} {:>6} {:>6}  placements per rank\n",
        "arm", "fe", "completed", "lost", "input tok/s", "ttft p50", "ttft p90", "ttft p99", "hit %", "std"
    );
    for a in arms {
        let _ = writeln!(
            out,
            "{:<20} {:>3} {:>9} {:>4} {:>12} {:>10} {:>10} {:>10} {:>6.1} {:>6.2}  {}",
            a.policy,
            frontends(a),
            a.completed,
            a.lost,
            thousands(a.input_tps().round() as u64),
            ms(a.ttft_p50),
            ms(a.ttft_p90),
            ms(a.ttft_p99),
            a.hit_rate() * 100.0,
            a.placement_std(),
            join(&a.placements)
        );
    }
    out.push_str("(ttft in ms of virtual time; hit % = cached prompt tokens / prompt tokens of completed requests)\n");
    out
}

fn find<'a>(arms: &'a [ArmResult], policy: &str, fe: &str) -> Option<&'a ArmResult> {
    arms.iter().find(|a| a.policy == policy && frontends(a) == fe)
}

fn pct(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        (a / b - 1.0) * 100.0
    } else {
        0.0
    }
}

/// What the table says about the targets of issue #13, in numbers.
pub fn verdict(w: Workload, arms: &[ArmResult]) -> String {
    let mut out = String::new();
    let (Some(ev), Some(rr), Some(ll)) =
        (find(arms, "cache_aware/events", "1"), find(arms, "round_robin", "1"), find(arms, "least_load", "1"))
    else {
        return out;
    };
    let tps = ArmResult::input_tps;
    let _ = writeln!(
        out,
        "events vs round_robin: throughput x{:.2}, ttft p90 {} vs {} ms; vs least_load: throughput {:+.1} %, \
         ttft p90 {} vs {} ms, p99 {:+.1} %",
        tps(ev) / tps(rr).max(1e-9),
        ms(ev.ttft_p90),
        ms(rr.ttft_p90),
        pct(tps(ev), tps(ll)),
        ms(ev.ttft_p90),
        ms(ll.ttft_p90),
        pct(ev.ttft_p99 as f64, ll.ttft_p99 as f64)
    );
    if let Some(or) = find(arms, "oracle", "1") {
        let _ = writeln!(out, "events vs oracle: throughput {:+.1} %", pct(tps(ev), tps(or)));
    }
    if let Some(ap) = find(arms, "cache_aware/approx", "1") {
        let _ = writeln!(
            out,
            "approx: throughput {} (least_load {}, events {})",
            thousands(tps(ap).round() as u64),
            thousands(tps(ll).round() as u64),
            thousands(tps(ev).round() as u64)
        );
    }
    let four: Vec<String> = arms
        .iter()
        .filter(|a| frontends(a) == "4")
        .filter_map(|a4| find(arms, &a4.policy, "1").map(|a1| format!("{} {:+.1} %", a4.policy, pct(tps(a4), tps(a1)))))
        .collect();
    if !four.is_empty() {
        let _ = writeln!(out, "4 frontends vs 1, throughput: {}", four.join(", "));
    }
    let _ = w;
    out
}

/// The sweep: one row per variation, shared prefixes and no sharing.
pub fn sweep_table(rows: &[(String, ArmResult, ArmResult)], least_load: &ArmResult) -> String {
    let mut out = format!(
        "{:<28} {:>14} {:>10} {:>7} {:>14} {:>10} {:>10}\n",
        "variation", "shared tok/s", "p90 ms", "hit %", "none tok/s", "vs ll", "p99 vs ll"
    );
    for (label, s, r) in rows {
        let _ = writeln!(
            out,
            "{:<28} {:>14} {:>10} {:>7.1} {:>14} {:>9.1}% {:>9.1}%",
            label,
            thousands(s.input_tps().round() as u64),
            ms(s.ttft_p90),
            s.hit_rate() * 100.0,
            thousands(r.input_tps().round() as u64),
            pct(r.input_tps(), least_load.input_tps()),
            pct(r.ttft_p99 as f64, least_load.ttft_p99 as f64)
        );
    }
    let _ = writeln!(
        out,
        "(no sharing: least_load {} tok/s, ttft p99 {} ms)",
        thousands(least_load.input_tps().round() as u64),
        ms(least_load.ttft_p99)
    );
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// `N frontend(s)`.
fn fe_count(n: &str) -> String {
    format!("{n} frontend{}", if n == "1" { "" } else { "s" })
}

/// One bar panel: a bar per arm run, runs at the first arm's frontend count solid, others paler.
fn panel(out: &mut String, x: f64, y: f64, title: &str, arms: &[ArmResult], value: impl Fn(&ArmResult) -> f64) {
    let (w, h) = (420.0, 150.0);
    let top = arms.iter().map(&value).fold(0.0, f64::max).max(1e-9);
    let solid = arms.first().map_or("1", frontends);
    let pale =
        arms.iter().map(frontends).find(|&n| n != solid).map_or(String::new(), |n| format!(", {} pale", fe_count(n)));
    let _ = write!(
        out,
        r##"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#bbb"/><text x="{x}" y="{}" font-size="12">{}</text><text x="{}" y="{}" font-size="10" fill="#444" text-anchor="middle">a bar per arm: {} solid{pale}; 0 at the bottom</text>"##,
        y - 6.0,
        esc(title),
        x + w / 2.0,
        y + h + 13.0,
        fe_count(solid)
    );
    let mut labels: Vec<&str> = Vec::new();
    for a in arms {
        if !labels.contains(&a.policy.as_str()) {
            labels.push(&a.policy);
        }
    }
    let slot = w / arms.len().max(1) as f64;
    let mut i = 0.0;
    for (k, label) in labels.iter().enumerate() {
        for a in arms.iter().filter(|a| a.policy == *label) {
            let v = value(a);
            let bh = v / top * (h - 16.0);
            let (bx, by) = (x + i * slot + 2.0, y + h - bh);
            let opacity = if frontends(a) == solid { 1.0 } else { 0.45 };
            let _ = write!(
                out,
                r##"<rect x="{bx:.1}" y="{by:.1}" width="{:.1}" height="{bh:.1}" fill="{}" fill-opacity="{opacity}"/><text x="{:.1}" y="{:.1}" font-size="9" text-anchor="middle">{}</text>"##,
                slot - 4.0,
                COLOURS[k % COLOURS.len()],
                bx + (slot - 4.0) / 2.0,
                by - 2.0,
                if v >= 1000.0 { format!("{:.0}k", v / 1000.0) } else { format!("{v:.0}") }
            );
            i += 1.0;
        }
    }
}

/// Per workload (by name), throughput and TTFT p90 bars per arm; a legend of arms.
pub fn chart(title: &str, rows: &[(&str, Vec<ArmResult>)]) -> String {
    let row_h = 200.0;
    let mut labels: Vec<&str> = Vec::new();
    for a in rows.iter().flat_map(|(_, r)| r) {
        if !labels.contains(&a.policy.as_str()) {
            labels.push(&a.policy);
        }
    }
    let legend_rows = labels.len().div_ceil(5) as f64;
    let top = 40.0 + 16.0 * legend_rows + 20.0;
    let height = top + row_h * rows.len() as f64;
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="960" height="{height}" viewBox="0 0 960 {height}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/><text x="12" y="22" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    for (k, label) in labels.iter().enumerate() {
        let (lx, ly) = (12.0 + 185.0 * (k % 5) as f64, 36.0 + 16.0 * (k / 5) as f64);
        let _ = write!(
            out,
            r#"<rect x="{lx}" y="{ly}" width="10" height="10" fill="{}"/><text x="{}" y="{}" font-size="11">{}</text>"#,
            COLOURS[k % COLOURS.len()],
            lx + 13.0,
            ly + 9.0,
            esc(label)
        );
    }
    for (i, (w, arms)) in rows.iter().enumerate() {
        let y = top + row_h * i as f64 + 10.0;
        let mut sorted: Vec<ArmResult> = Vec::new();
        for label in &labels {
            sorted.extend(arms.iter().filter(|a| a.policy == *label).cloned());
        }
        panel(&mut out, 30.0, y, &format!("{w}: input tokens/s"), &sorted, ArmResult::input_tps);
        panel(&mut out, 500.0, y, &format!("{w}: TTFT p90 (ms)"), &sorted, |a| a.ttft_p90 as f64 / 1000.0);
    }
    out.push_str("</svg>\n");
    out
}
