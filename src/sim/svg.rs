//! A small hand-written SVG chart: one row per arm, two panels per row
//! (user placements per rank so far, running batch per rank), one colour per
//! rank, so skew is seen rather than read; a dashed line marks each resize
//! of dpcoord's table.

use std::fmt::Write;

use super::model::Micros;
use super::record::{ArmResult, Sample};

const PALETTE: [&str; 12] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f",
    "#393b79", "#ad494a",
];
const WIDTH: f64 = 960.0;
const ROW: f64 = 210.0;
const TOP: f64 = 56.0;
const PANEL_W: f64 = 400.0;
const PANEL_H: f64 = 140.0;
const LEFT: [f64; 2] = [60.0, 530.0];

/// Escapes text for an SVG text node or attribute.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// One panel's frame, labels and one polyline per rank.
struct Panel<'a> {
    x: f64,
    y: f64,
    title: String,
    t_max: f64,
    v_max: f64,
    samples: &'a [Sample],
    /// `(at, label)`: the table's resizes.
    marks: Vec<(Micros, String)>,
}

impl Panel<'_> {
    fn draw(&self, out: &mut String, value: impl Fn(&Sample, usize) -> u64) {
        let (x, y) = (self.x, self.y);
        let _ = write!(
            out,
            r##"<rect x="{x}" y="{y}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#bbb"/><text x="{x}" y="{}" font-size="12">{}</text><text x="{}" y="{}" font-size="10" text-anchor="end">{}</text><text x="{}" y="{}" font-size="10" text-anchor="end">0</text><text x="{}" y="{}" font-size="10" text-anchor="end">{:.0} s</text>"##,
            y - 6.0,
            esc(&self.title),
            x - 4.0,
            y + 10.0,
            self.v_max,
            x - 4.0,
            y + PANEL_H,
            x + PANEL_W,
            y + PANEL_H + 14.0,
            self.t_max,
        );
        for (at, label) in &self.marks {
            let px = x + *at as f64 / 1e6 / self.t_max.max(1e-9) * PANEL_W;
            let _ = write!(
                out,
                r##"<line x1="{px:.1}" y1="{y}" x2="{px:.1}" y2="{}" stroke="#444" stroke-dasharray="4 3"/><text x="{px:.1}" y="{}" font-size="10" fill="#444" text-anchor="middle">{}</text>"##,
                y + PANEL_H + 4.0,
                y + PANEL_H + 14.0,
                esc(label)
            );
        }
        let ranks = self.samples.first().map_or(0, |s| s.running.len());
        for rank in 0..ranks {
            let points: Vec<String> = self
                .samples
                .iter()
                .map(|s| {
                    let px = x + s.at as f64 / 1e6 / self.t_max.max(1e-9) * PANEL_W;
                    let py = y + PANEL_H - value(s, rank) as f64 / self.v_max.max(1.0) * PANEL_H;
                    format!("{px:.1},{py:.1}")
                })
                .collect();
            let colour = PALETTE[rank % PALETTE.len()];
            let _ = write!(
                out,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{}"/>"#,
                points.join(" ")
            );
        }
    }
}

/// The chart for a scenario's arms.
pub fn chart(title: &str, arms: &[ArmResult]) -> String {
    let height = TOP + ROW * arms.len() as f64 + 10.0;
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif"><rect width="100%" height="100%" fill="white"/><text x="12" y="22" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let ranks = arms.first().map_or(0, |a| a.placements.len());
    for rank in 0..ranks {
        let x = 12.0 + 62.0 * rank as f64;
        let _ = write!(
            out,
            r#"<rect x="{x}" y="32" width="10" height="10" fill="{}"/><text x="{}" y="41" font-size="11">rank {rank}</text>"#,
            PALETTE[rank % PALETTE.len()],
            x + 13.0
        );
    }
    let t_max = arms.iter().flat_map(|a| a.samples.last()).map(|s| s.at as f64 / 1e6).fold(0.0, f64::max);
    let max_of = |f: fn(&Sample) -> &Vec<u64>| {
        arms.iter().flat_map(|a| &a.samples).flat_map(|s| f(s).iter().copied()).max().unwrap_or(0) as f64
    };
    let (p_max, r_max) = (max_of(|s| &s.placements), max_of(|s| &s.running));
    for (i, arm) in arms.iter().enumerate() {
        let y = TOP + 24.0 + ROW * i as f64;
        let label = |what: &str| format!("{} ({}): {what}", arm.name, arm.policy);
        let mut panel = Panel {
            x: LEFT[0],
            y,
            title: label("user placements per rank"),
            t_max,
            v_max: p_max,
            samples: &arm.samples,
            marks: arm.phases.iter().skip(1).map(|p| (p.from, format!("resize {}", p.dp_size))).collect(),
        };
        panel.draw(&mut out, |s, r| s.placements[r]);
        panel.x = LEFT[1];
        panel.title = label("running batch per rank");
        panel.v_max = r_max;
        panel.draw(&mut out, |s, r| s.running[r]);
    }
    out.push_str("</svg>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::record::Recorder;

    #[test]
    fn one_polyline_per_rank_and_panel_with_escaped_titles() {
        let mut rec = Recorder::new(2);
        rec.sample(0, vec![0, 0]);
        rec.placements = vec![3, 1];
        rec.sample(2_000_000, vec![2, 1]);
        let arm = rec.summarize("a<b", "round_robin", 0);
        let svg = chart("t & u", &[arm.clone(), arm]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<polyline").count(), 8);
        assert!(svg.contains("t &amp; u") && svg.contains("a&lt;b (round_robin)"));
        assert!(svg.contains(r#"points="60.0,220.0 460.0,173.3""#), "{svg}");
    }
}
