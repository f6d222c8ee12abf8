//! Result-metric penalty inputs.
//!
//! A rank's penalty is recomputed every tick from what the rank did lately;
//! it lives in `[0, penalty.max_penalty]` and load-aware policies multiply a
//! rank's load by `1 + penalty`.

use std::time::{Duration, Instant};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
