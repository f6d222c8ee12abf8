//! One panel of the chart: its place, height and time scale, its axes and
//! the dashed lines at resizes. Below both columns, `svg` (the chart and its
//! left column) and `svg_heat` (the right), which draw into panels.

use std::fmt::Write;

use super::model::Micros;

/// A panel's height.
pub const PANEL_H: f64 = 150.0;

/// A step of 1, 2 or 5 times a power of ten giving at most `n` ticks up to `max`.
pub fn nice_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(1e-9);
    let pow = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * pow).find(|s| *s >= raw).unwrap_or(10.0 * pow)
}

/// One panel's place and time scale.
pub struct Frame {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub t_max: f64,
}

impl Frame {
    pub fn px(&self, at: Micros) -> f64 {
        self.x + at as f64 / 1e6 / self.t_max.max(1e-9) * self.w
    }

    /// The frame, time ticks and the time axis' title.
    pub fn axes(&self, out: &mut String) {
        let (x, y, w, h) = (self.x, self.y, self.w, PANEL_H);
        let _ = write!(out, r##"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="none" stroke="#999"/>"##);
        let step = nice_step(self.t_max, 6.0);
        let digits = usize::from(step < 1.0);
        for k in 0..=(self.t_max / step + 1e-9) as u32 {
            let t = f64::from(k) * step;
            let px = self.px((t * 1e6) as Micros);
            let _ = write!(
                out,
                r##"<line x1="{px:.1}" y1="{}" x2="{px:.1}" y2="{}" stroke="#999"/><text x="{px:.1}" y="{}" font-size="10" text-anchor="middle">{t:.digits$}</text>"##,
                y + h,
                y + h + 4.0,
                y + h + 14.0
            );
        }
        let _ = write!(
            out,
            r##"<text x="{}" y="{}" font-size="10" fill="#444" text-anchor="middle">virtual time (s)</text>"##,
            x + w / 2.0,
            y + h + 27.0
        );
    }

    /// A dashed line at each resize of dpcoord's table.
    pub fn resizes(&self, out: &mut String, resizes: &[(Micros, u32)]) {
        for &(at, _) in resizes {
            let px = self.px(at);
            let _ = write!(
                out,
                r##"<line x1="{px:.1}" y1="{}" x2="{px:.1}" y2="{}" stroke="#222" stroke-width="1.2" stroke-dasharray="5 3"/>"##,
                self.y,
                self.y + PANEL_H
            );
        }
    }
}
