//! Result-metric penalties.
//!
//! Every tick each rank's penalty is recomputed from what it did since the
//! previous tick:
//!
//! ```text
//! penalty = min(max_penalty,
//!               failure * failure_ratio              (smoothed, 0..1)
//!             + ttft    * max(0, ttft_ms / median_ttft_ms - 1)
//!             + stale   * (1 if the rank is stale)
//!             + health  (failed health_reports, halving every health_half_life))
//! ```
//!
//! Load-aware policies then compare `(load + 1) * (1 + penalty)`.

use std::time::{Duration, Instant};

use crate::config::Penalty;

/// A sum of failure weights that halves every `half_life`.
#[derive(Debug, Clone, Default)]
pub struct HealthScore {
    value: f64,
    at: Option<Instant>,
}

impl HealthScore {
    /// The score at `now`.
    pub fn value(&self, now: Instant, half_life: Duration) -> f64 {
        match self.at {
            None => 0.0,
            Some(at) => {
                let halves = now.saturating_duration_since(at).as_secs_f64() / half_life.as_secs_f64();
                self.value * 0.5f64.powf(halves)
            }
        }
    }

    /// Adds `weight` at `now`.
    pub fn add(&mut self, weight: f64, now: Instant, half_life: Duration) {
        self.value = self.value(now, half_life) + weight;
        self.at = Some(now);
    }
}

/// What one rank showed during the last tick.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TickInputs {
    /// The engine's `finished` and `failed` counters of its current boot.
    pub finished: u64,
    pub failed: u64,
    pub stale: bool,
    /// `ttft_ms / median ttft_ms of up ranks`, when both are known.
    pub ttft_ratio: Option<f64>,
}

/// One rank's penalty memory between ticks.
#[derive(Debug, Clone, Default)]
pub struct PenaltyState {
    pub health: HealthScore,
    /// Smoothed `failed / (finished + failed)`.
    pub failure_ratio: f64,
    seen_finished: u64,
    seen_failed: u64,
}

impl PenaltyState {
    /// The engine restarted: its counters start over from 0.
    pub fn on_restart(&mut self) {
        self.seen_finished = 0;
        self.seen_failed = 0;
    }

    /// Folds in the last tick and returns the new penalty.
    pub fn update(&mut self, cfg: &Penalty, x: TickInputs, now: Instant) -> f64 {
        let finished = x.finished.saturating_sub(self.seen_finished);
        let failed = x.failed.saturating_sub(self.seen_failed);
        (self.seen_finished, self.seen_failed) = (x.finished, x.failed);
        // In f64: an engine may report counters near u64::MAX.
        let completed = finished as f64 + failed as f64;
        if completed > 0.0 {
            let ratio = failed as f64 / completed;
            self.failure_ratio += cfg.failure_smoothing * (ratio - self.failure_ratio);
        }
        let ttft = x.ttft_ratio.map_or(0.0, |r| (r - 1.0).max(0.0));
        let stale = if x.stale { 1.0 } else { 0.0 };
        let sum = cfg.failure * self.failure_ratio
            + cfg.ttft * ttft
            + cfg.stale * stale
            + self.health.value(now, cfg.health_half_life);
        sum.min(cfg.max_penalty)
    }
}

/// The median of `values` (sorted in place); `None` when empty.
pub fn median(values: &mut [f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    Some(if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn cfg() -> Penalty {
        Config::default().settings.penalty
    }

    fn inputs(finished: u64, failed: u64) -> TickInputs {
        TickInputs { finished, failed, stale: false, ttft_ratio: None }
    }

    #[test]
    fn halves_every_half_life() {
        let t0 = Instant::now();
        let hl = Duration::from_secs(2);
        let mut s = HealthScore::default();
        assert_eq!(s.value(t0, hl), 0.0);
        s.add(4.0, t0, hl);
        assert_eq!(s.value(t0, hl), 4.0);
        assert_eq!(s.value(t0 + hl, hl), 2.0);
        s.add(1.0, t0 + hl * 2, hl);
        assert_eq!(s.value(t0 + hl * 2, hl), 2.0);
    }

    #[test]
    fn failure_ratio_is_smoothed_over_tick_deltas() {
        let (c, now) = (cfg(), Instant::now());
        let mut p = PenaltyState::default();
        // 10 finished, 10 failed this tick: ratio 0.5, smoothed 0.25, weight 5.
        assert_eq!(p.update(&c, inputs(10, 10), now), 1.25);
        // Nothing completed: the ratio holds.
        assert_eq!(p.update(&c, inputs(10, 10), now), 1.25);
        // 10 more failed and nothing finished: ratio 1, smoothed 0.625.
        assert_eq!(p.update(&c, inputs(10, 20), now), 3.125);
        // The engine restarts; its first tick has 4 finished, 0 failed.
        p.on_restart();
        assert_eq!(p.update(&c, inputs(4, 0), now), 1.5625);
    }

    #[test]
    fn ttft_stale_health_add_up_and_are_capped() {
        let (c, now) = (cfg(), Instant::now());
        let mut p = PenaltyState::default();
        let slow = TickInputs { ttft_ratio: Some(3.0), ..inputs(0, 0) };
        assert_eq!(p.update(&c, slow, now), 2.0);
        let fast = TickInputs { ttft_ratio: Some(0.5), ..inputs(0, 0) };
        assert_eq!(p.update(&c, fast, now), 0.0);
        p.health.add(1.0, now, c.health_half_life);
        assert_eq!(p.update(&c, TickInputs { stale: true, ..slow }, now), 4.0);
        let worst = TickInputs { ttft_ratio: Some(50.0), ..slow };
        assert_eq!(p.update(&c, worst, now), c.max_penalty);
    }

    #[test]
    fn absurd_counters_and_ttft_stay_within_bounds() {
        let (c, now) = (cfg(), Instant::now());
        let mut p = PenaltyState::default();
        // Ratio 0.5 over completions beyond u64: smoothed 0.25, weight 5.
        assert_eq!(p.update(&c, inputs(u64::MAX, u64::MAX), now), 1.25);
        let huge = TickInputs { ttft_ratio: Some(f64::INFINITY), ..inputs(u64::MAX, u64::MAX) };
        assert_eq!(p.update(&c, huge, now), c.max_penalty);
    }

    #[test]
    fn median_of_odd_and_even_sets() {
        assert_eq!(median(&mut []), None);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), Some(2.5));
    }
}
