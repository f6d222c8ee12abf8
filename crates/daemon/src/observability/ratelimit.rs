//! Rate limits for warnings that outside input can trigger at full speed
//! (dropped stats updates, refused connections): at most one line per
//! second per cause, each saying how many were suppressed since the last.

use std::time::{Duration, Instant};

const EVERY: Duration = Duration::from_secs(1);

/// `N` independent causes, numbered `0..N`.
#[derive(Debug)]
pub struct LogLimiter<const N: usize> {
    /// Per cause: when it was last logged, and occurrences since then.
    last: [(Option<Instant>, u64); N],
}

impl<const N: usize> Default for LogLimiter<N> {
    fn default() -> Self {
        LogLimiter { last: [(None, 0); N] }
    }
}

impl<const N: usize> LogLimiter<N> {
    /// Notes one occurrence of `cause`; returns how many were suppressed
    /// before it when a line should be logged now, `None` when not.
    pub fn allow(&mut self, cause: usize, now: Instant) -> Option<u64> {
        let (at, suppressed) = self.last.get_mut(cause)?;
        if at.is_some_and(|t| now.saturating_duration_since(t) < EVERY) {
            *suppressed += 1;
            return None;
        }
        *at = Some(now);
        Some(std::mem::take(suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn once_per_second_per_cause_with_the_suppressed_count() {
        let t0 = Instant::now();
        let mut l = LogLimiter::<2>::default();
        assert_eq!(l.allow(0, t0), Some(0));
        assert_eq!(l.allow(0, t0 + Duration::from_millis(500)), None);
        assert_eq!(l.allow(0, t0 + Duration::from_millis(999)), None);
        assert_eq!(l.allow(1, t0), Some(0));
        assert_eq!(l.allow(0, t0 + EVERY), Some(2));
        assert_eq!(l.allow(2, t0), None);
    }
}
