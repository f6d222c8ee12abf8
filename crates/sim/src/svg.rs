//! A scenario's chart, hand-written SVG: one row per arm. Left, user
//! placements per rank so far, ranks whose lines coincide drawn once and
//! named together; right, a heat strip of the work each rank holds over
//! time (`svg_heat`); a dashed line at each resize of dpcoord's table.

use std::fmt::Write;

use super::model::Micros;
use super::record::{Happened, Sample};
use super::summary::ArmResult;
use super::svg_frame::{nice_step, Frame, PANEL_H};
use super::svg_heat::{heat, marker, shade, window, SHADES};

const PALETTE: [&str; 12] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
    "#393b79", "#ad494a",
];
const WIDTH: f64 = 980.0;
const LINE_X: f64 = 72.0;
const LINE_W: f64 = 380.0;
const HEAT_X: f64 = 560.0;
const HEAT_W: f64 = 340.0;
/// One arm's row: its title, the panels' titles, the panels, the time axis.
const ROW: f64 = 236.0;
/// Title characters per line before it wraps.
const TITLE_CHARS: usize = 118;

/// Escapes text for an SVG text node or attribute.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `0-2, 4-7` for ranks `[0, 1, 2, 4, 5, 6, 7]`.
fn spans(ranks: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        out.push(if j == i { ranks[i].to_string() } else { format!("{}-{}", ranks[i], ranks[j]) });
        i = j + 1;
    }
    out.join(", ")
}

/// Splits `text` into lines of at most `width` characters at spaces.
fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = vec![String::new()];
    for word in text.split(' ') {
        let last = lines.last_mut().expect("one line at least");
        if !last.is_empty() && last.len() + 1 + word.len() > width {
            lines.push(word.to_owned());
        } else {
            if !last.is_empty() {
                last.push(' ');
            }
            last.push_str(word);
        }
    }
    lines
}

/// Ranks whose placement lines never differ by more than one placement,
/// each group with whether its lines are identical.
fn groups(samples: &[Sample], ranks: usize) -> Vec<(Vec<usize>, bool)> {
    let apart = |a: usize, b: usize| samples.iter().map(|s| s.placements[a].abs_diff(s.placements[b])).max();
    let mut out: Vec<(Vec<usize>, bool)> = Vec::new();
    for r in 0..ranks {
        match out.iter_mut().find(|(g, _)| g.iter().all(|&m| apart(m, r).unwrap_or(0) <= 1)) {
            Some((g, same)) => {
                *same &= apart(g[0], r).unwrap_or(0) == 0;
                g.push(r);
            }
            None => out.push((vec![r], true)),
        }
    }
    out
}

/// User placements per rank so far; coinciding ranks as one line (a band
/// when they differ by one), named in the panel's legend.
fn placements(out: &mut String, f: &Frame, arm: &ArmResult, v_max: f64) {
    let (x, y) = (f.x, f.y);
    // Placements are whole numbers: so are the ticks.
    let step = nice_step(v_max, 4.0).max(1.0) as u64;
    let top =
        v_max.max(1.0).div_euclid(step as f64) as u64 * step + step * u64::from(!(v_max as u64).is_multiple_of(step));
    let py = |v: u64| y + PANEL_H - v as f64 / top.max(1) as f64 * PANEL_H;
    for v in (0..=top).step_by(step as usize) {
        let _ = write!(
            out,
            r##"<text x="{}" y="{:.1}" font-size="10" text-anchor="end">{v}</text>"##,
            x - 4.0,
            py(v) + 3.0
        );
    }
    let _ = write!(
        out,
        r##"<text transform="translate({},{}) rotate(-90)" font-size="10" fill="#444" text-anchor="middle">placements</text>"##,
        x - 34.0,
        y + PANEL_H / 2.0
    );
    let ranks = arm.samples.first().map_or(0, |s| s.placements.len());
    let gs = groups(&arm.samples, ranks);
    let columns = if gs.len() > 4 { 2 } else { 1 };
    for (i, (g, same)) in gs.iter().enumerate() {
        let colour = PALETTE[g[0] % PALETTE.len()];
        let line = |pick: &dyn Fn(&Sample) -> u64| -> Vec<String> {
            arm.samples.iter().map(|s| format!("{:.1},{:.1}", f.px(s.at), py(pick(s)))).collect()
        };
        if !same {
            let mut band = line(&|s| g.iter().map(|&r| s.placements[r]).max().unwrap_or(0));
            band.extend(line(&|s| g.iter().map(|&r| s.placements[r]).min().unwrap_or(0)).into_iter().rev());
            let _ = write!(out, r#"<polygon fill="{colour}" fill-opacity="0.3" points="{}"/>"#, band.join(" "));
        }
        let _ = write!(
            out,
            r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
            line(&|s| s.placements[g[0]]).join(" ")
        );
        let label = match (g.len(), same) {
            (1, _) => format!("rank {}", g[0]),
            (n, true) => format!("{n} ranks, identical ({})", spans(g)),
            (n, false) => format!("{n} ranks within 1 ({})", spans(g)),
        };
        let (lx, ly) = (x + 6.0 + (i % columns) as f64 * 185.0, y + 14.0 + (i / columns) as f64 * 13.0);
        let _ = write!(
            out,
            r##"<rect x="{lx}" y="{}" width="12" height="4" fill="{colour}"/><text x="{}" y="{ly}" font-size="10">{}</text>"##,
            ly - 5.0,
            lx + 16.0,
            esc(&label)
        );
    }
}

/// The chart's key: what each panel shows, the heat scale and the markers.
fn key(out: &mut String, y: f64, w_max: f64) {
    let _ = write!(
        out,
        r##"<text x="12" y="{y}" font-size="11">Left: each rank's user placements so far (ranks whose lines coincide are drawn once; a band spans ranks within 1 placement of each other).</text><text x="12" y="{}" font-size="11">Right: tokens of work each rank holds (prompt not yet prefilled + output still to generate), 0</text>"##,
        y + 15.0
    );
    let x = 536.0;
    for i in 0..SHADES {
        let _ = write!(
            out,
            r##"<rect x="{}" y="{}" width="8" height="10" fill="{}" stroke="#ccc" stroke-width="0.3"/>"##,
            x + 8.0 * i as f64,
            y + 6.0,
            shade(i)
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" font-size="11">{:.0}k tokens (the most any rank held)</text>"#,
        x + 8.0 * SHADES as f64 + 4.0,
        y + 15.0,
        w_max / 1000.0
    );
    let y = y + 30.0;
    let items: [(Happened, &str, f64); 4] = [
        (Happened::Died, "engine dies (purple: hangs)", 12.0),
        (Happened::SeenDown("down".into()), "dpcoord sees it down, stale, stalled", 190.0),
        (Happened::Readmitted, "dpcoord sees it up again", 430.0),
        (Happened::Probe { ok: true }, "health probe (red: to a dead engine)", 640.0),
    ];
    for (what, label, x) in items {
        marker(out, &what, x + 5.0, y - 4.0, 10.0);
        let _ = write!(out, r#"<text x="{}" y="{y}" font-size="11">{label}</text>"#, x + 14.0);
    }
}

/// The chart for a scenario's arms.
pub fn chart(title: &str, arms: &[ArmResult]) -> String {
    let lines = wrap(title, TITLE_CHARS);
    let top = 12.0 + 18.0 * lines.len() as f64 + 60.0;
    let height = top + ROW * arms.len() as f64;
    let mut out = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif"><defs><pattern id="off" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/><line x1="0" y1="0" x2="0" y2="6" stroke="#bbb" stroke-width="1.5"/></pattern></defs><rect width="100%" height="100%" fill="white"/>"##
    );
    for (i, line) in lines.iter().enumerate() {
        let _ = write!(
            out,
            r#"<text x="12" y="{}" font-size="15" font-weight="bold">{}</text>"#,
            26.0 + 18.0 * i as f64,
            esc(line)
        );
    }
    let t_max = arms.iter().flat_map(|a| a.samples.last()).map(|s| s.at as f64 / 1e6).fold(0.0, f64::max);
    let max_of = |f: fn(&Sample) -> &Vec<u64>| {
        arms.iter().flat_map(|a| &a.samples).flat_map(|s| f(s).iter().copied()).max().unwrap_or(0) as f64
    };
    let (p_max, w_max) = (max_of(|s| &s.placements), max_of(|s| &s.work));
    key(&mut out, top - 44.0, w_max);
    for (i, arm) in arms.iter().enumerate() {
        let y = top + ROW * i as f64;
        let _ = write!(
            out,
            r##"<line x1="12" y1="{}" x2="{}" y2="{}" stroke="#ddd"/><text x="12" y="{}" font-size="13" font-weight="bold">{} ({})</text>"##,
            y + 2.0,
            WIDTH - 12.0,
            y + 2.0,
            y + 20.0,
            esc(&arm.name),
            esc(&arm.policy)
        );
        let resizes: Vec<(Micros, u32)> = arm.phases.iter().skip(1).map(|p| (p.from, p.dp_size)).collect();
        let said: Vec<String> =
            resizes.iter().map(|&(at, n)| format!("to {n} ranks at {:.1} s", at as f64 / 1e6)).collect();
        if !said.is_empty() {
            let _ = write!(
                out,
                r##"<text x="{}" y="{}" font-size="11" fill="#222">dashed lines: dpcoord's table resized {}</text>"##,
                LINE_X + 230.0,
                y + 20.0,
                said.join(", ")
            );
        }
        let panel_y = y + 44.0;
        let heat_title = format!(
            "work held per rank (tokens, mean over {:.1} s; darker = more)",
            window(arm.samples.len()) as f64 * t_max / arm.samples.len().max(1) as f64
        );
        for (x, w, what) in [(LINE_X, LINE_W, "user placements per rank, so far"), (HEAT_X, HEAT_W, &heat_title)] {
            let _ = write!(out, r#"<text x="{x}" y="{}" font-size="11">{what}</text>"#, panel_y - 6.0);
            Frame { x, y: panel_y, w, t_max }.axes(&mut out);
        }
        let (left, right) =
            (Frame { x: LINE_X, y: panel_y, w: LINE_W, t_max }, Frame { x: HEAT_X, y: panel_y, w: HEAT_W, t_max });
        left.resizes(&mut out, &resizes);
        placements(&mut out, &left, arm, p_max);
        heat(&mut out, &right, arm, w_max);
        right.resizes(&mut out, &resizes);
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Recorder;
    use crate::svg_heat::DIED;

    #[test]
    fn coinciding_ranks_are_one_line_and_titles_are_escaped() {
        let mut rec = Recorder::new(3);
        rec.sample(0, vec![0, 0, 0], vec![0, 0, 0]);
        rec.placements = vec![3, 3, 1];
        rec.mark(1_000_000, 2, Happened::Died);
        rec.sample(2_000_000, vec![1, 1, 0], vec![500, 1000, 0]);
        let arm = rec.summarize("a<b", "round_robin", 0);
        let svg = chart("t & u", &[arm.clone(), arm]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 4, "ranks 0 and 1 drawn once, rank 2 alone: {svg}");
        assert_eq!(svg.matches("2 ranks, identical (0-1)").count(), 2);
        assert_eq!(svg.matches("<polygon").count(), 0);
        assert!(svg.contains("t &amp; u") && svg.contains("a&lt;b (round_robin)"));
        assert_eq!(svg.matches(r#"text-anchor="end">3</text>"#).count(), 2, "whole ticks 0 to 3 once per arm");
        assert_eq!(svg.matches(r#"text-anchor="end">0.5</text>"#).count(), 0);
        assert_eq!(svg.matches(&format!(r#"stroke="{DIED}" stroke-width="2.5""#)).count(), 3, "key and two arms");
    }

    #[test]
    fn ranks_within_one_placement_share_a_band() {
        let mut rec = Recorder::new(3);
        rec.sample(0, vec![0; 3], vec![0; 3]);
        rec.placements = vec![3, 2, 0];
        rec.sample(1_000_000, vec![0; 3], vec![0; 3]);
        let g = groups(&rec.samples, 3);
        assert_eq!(g, [(vec![0, 1], false), (vec![2], true)]);
    }

    #[test]
    fn helpers() {
        assert_eq!(spans(&[0, 1, 2, 4, 5, 6, 7]), "0-2, 4-7");
        assert_eq!(spans(&[3]), "3");
        assert_eq!(wrap("aa bb cc", 5), ["aa bb", "cc"]);
        assert_eq!((nice_step(120.0, 6.0), nice_step(21.0, 4.0), nice_step(0.7, 6.0)), (20.0, 10.0, 0.2));
    }
}
