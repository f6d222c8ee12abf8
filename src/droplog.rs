//! Rate-limited warnings for dropped stats updates: at most one line per
//! second per cause, saying how many were dropped since the last line.

use std::time::{Duration, Instant};

use crate::metrics::StatsResult;

const EVERY: Duration = Duration::from_secs(1);

#[derive(Debug, Default)]
pub struct DropLog {
    /// Per cause: when it was last logged, and drops since then.
    last: [(Option<Instant>, u64); 4],
}

impl DropLog {
    /// Notes one drop; returns whether a line was logged.
    pub fn note(&mut self, cause: StatsResult, why: &str, now: Instant) -> bool {
        let i = StatsResult::ALL.iter().position(|c| *c == cause).unwrap_or(0);
        let (at, suppressed) = &mut self.last[i];
        if at.is_some_and(|t| now.saturating_duration_since(t) < EVERY) {
            *suppressed += 1;
            return false;
        }
        tracing::warn!(result = cause.as_str(), reason = why, suppressed = *suppressed, "dropped a stats update");
        *at = Some(now);
        *suppressed = 0;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_second_per_cause() {
        let t0 = Instant::now();
        let mut d = DropLog::default();
        assert!(d.note(StatsResult::Malformed, "x", t0));
        assert!(!d.note(StatsResult::Malformed, "x", t0 + Duration::from_millis(999)));
        assert!(d.note(StatsResult::Stale, "x", t0));
        assert!(d.note(StatsResult::Malformed, "x", t0 + EVERY));
    }
}
