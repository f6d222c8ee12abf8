//! The chart's right column: a heat strip of the work each rank holds over
//! time, a row per rank, hatched where the rank is dead or outside
//! dpcoord's table, with a marker at each death, change of dpcoord's view
//! and health probe.

use std::fmt::Write;

use super::model::Micros;
use super::record::{Happened, Sample};
use super::summary::ArmResult;
use super::svg_frame::{Frame, PANEL_H};

/// Shades of the heat strip, white (nothing held) to dark blue (the most any rank held).
pub const SHADES: usize = 12;
pub const DIED: &str = "#d62728";
const HUNG: &str = "#9467bd";
const SEEN: &str = "#ff7f0e";
const BACK: &str = "#2ca02c";

/// `#rrggbb` between white and dark blue, shade `i` of `SHADES - 1`.
pub fn shade(i: usize) -> String {
    let t = i as f64 / (SHADES - 1) as f64;
    let mix = |white: f64, dark: f64| (white + (dark - white) * t).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(255.0, 8.0), mix(255.0, 48.0), mix(255.0, 107.0))
}

/// The shade of `work` tokens on a scale up to `max`.
pub fn level(work: u64, max: f64) -> usize {
    if work == 0 {
        return 0;
    }
    ((work as f64 / max.max(1.0) * (SHADES - 1) as f64).ceil() as usize).clamp(1, SHADES - 1)
}

/// A marker of `what` centred at `(x, y)`, `size` across.
pub fn marker(out: &mut String, what: &Happened, x: f64, y: f64, size: f64) {
    let r = size / 2.0;
    let _ = match what {
        Happened::Died => write!(
            out,
            r#"<path d="M{:.1},{:.1}l{size:.1},{size:.1}m0,-{size:.1}l-{size:.1},{size:.1}" stroke="{DIED}" stroke-width="2.5"/>"#,
            x - r,
            y - r
        ),
        Happened::Hung => write!(
            out,
            r#"<path d="M{:.1},{:.1}l{size:.1},{size:.1}m0,-{size:.1}l-{size:.1},{size:.1}" stroke="{HUNG}" stroke-width="2.5"/>"#,
            x - r,
            y - r
        ),
        Happened::SeenDown(_) => write!(
            out,
            r##"<path d="M{:.1},{:.1}h{size:.1}l-{r:.1},{size:.1}z" fill="{SEEN}" stroke="#fff" stroke-width="0.5"/>"##,
            x - r,
            y - r
        ),
        Happened::Readmitted => write!(
            out,
            r##"<path d="M{:.1},{:.1}h{size:.1}l-{r:.1},-{size:.1}z" fill="{BACK}" stroke="#fff" stroke-width="0.5"/>"##,
            x - r,
            y + r
        ),
        Happened::Probe { ok } => write!(
            out,
            r#"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{}" stroke-width="1.2"/>"#,
            y - r,
            y + r,
            if *ok { "#000" } else { DIED }
        ),
    };
}

/// The work each rank holds over time, a row per rank, with its events.
pub fn heat(out: &mut String, f: &Frame, arm: &ArmResult, w_max: f64) {
    let ranks = arm.samples.first().map_or(0, |s| s.work.len());
    let row = PANEL_H / ranks.max(1) as f64;
    let font = row.clamp(6.0, 10.0);
    for (rank, from, to, why, labelled) in absences(arm, ranks) {
        let (x0, x1) = (f.px(from), f.px(to));
        let ry = f.y + row * rank as f64;
        let _ = write!(
            out,
            r#"<rect x="{x0:.1}" y="{ry:.1}" width="{:.1}" height="{row:.1}" fill="url(#off)"/>"#,
            (x1 - x0).max(0.0)
        );
        if labelled && x1 - x0 > 110.0 && row >= 9.0 {
            let _ = write!(
                out,
                r##"<text x="{:.1}" y="{:.1}" font-size="{font:.0}" fill="#555" text-anchor="middle">{why}</text>"##,
                (x0 + x1) / 2.0,
                ry + row / 2.0 + font / 3.0
            );
        }
    }
    for rank in 0..ranks {
        let ry = f.y + row * rank as f64;
        let _ = write!(
            out,
            r#"<text x="{}" y="{:.1}" font-size="{font:.0}" text-anchor="end">rank {rank}</text>"#,
            f.x - 4.0,
            ry + row / 2.0 + font / 3.0
        );
        let work = smoothed(&arm.samples, rank);
        // One rectangle per run of samples of the same shade.
        let mut i = 0;
        while i + 1 < work.len() {
            let l = level(work[i], w_max);
            let mut j = i + 1;
            while j + 1 < work.len() && level(work[j], w_max) == l {
                j += 1;
            }
            if l > 0 {
                let (x0, x1) = (f.px(arm.samples[i].at), f.px(arm.samples[j].at));
                let _ = write!(
                    out,
                    r#"<rect x="{x0:.1}" y="{ry:.1}" width="{:.1}" height="{row:.1}" fill="{}"/>"#,
                    (x1 - x0).max(0.5),
                    shade(l)
                );
            }
            i = j;
        }
    }
    for m in &arm.marks {
        let rank = m.rank as usize;
        if rank >= ranks {
            continue;
        }
        let cy = f.y + row * (rank as f64 + 0.5);
        let size = match m.what {
            Happened::Probe { .. } => row * 0.5,
            _ => (row * 0.9).clamp(7.0, 12.0),
        };
        marker(out, &m.what, f.px(m.at), cy, size);
    }
}

/// Samples averaged over for one heat cell: a fortieth of the run.
pub fn window(samples: usize) -> usize {
    (samples / 40).max(1)
}

/// Rank `rank`'s work at each sample, the mean over the window around it.
fn smoothed(samples: &[Sample], rank: usize) -> Vec<u64> {
    let half = window(samples.len()) / 2;
    (0..samples.len())
        .map(|i| {
            let span = &samples[i.saturating_sub(half)..(i + half + 1).min(samples.len())];
            span.iter().map(|s| s.work[rank]).sum::<u64>() / span.len() as u64
        })
        .collect()
}

/// `(rank, from, to, why, labelled)`: spans where a rank is dead or outside
/// dpcoord's table (a block of ranks out of the table is labelled once).
fn absences(arm: &ArmResult, ranks: usize) -> Vec<(usize, Micros, Micros, &'static str, bool)> {
    let end = arm.samples.last().map_or(0, |s| s.at);
    let mut out = Vec::new();
    for m in arm.marks.iter().filter(|m| m.what == Happened::Died) {
        out.push((m.rank as usize, m.at, end, "engine dead", true));
    }
    for (i, p) in arm.phases.iter().enumerate() {
        let to = arm.phases.get(i + 1).map_or(end, |n| n.from);
        for rank in p.dp_size as usize..ranks {
            out.push((rank, p.from, to, "not in dpcoord's table", rank == p.dp_size as usize));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shades_and_levels() {
        assert_eq!((level(0, 10.0), level(1, 100.0), level(10, 10.0)), (0, 1, SHADES - 1));
        assert_eq!((shade(0).as_str(), shade(SHADES - 1).as_str()), ("#ffffff", "#08306b"));
        assert_eq!(window(200), 5);
    }
}
