//! A sliding window of per-rank placement counts.
//!
//! The window is a ring of `BUCKETS` time buckets; each rank keeps a running
//! total over the live buckets, so reading the totals costs O(ranks) and
//! aging costs O(ranks) per expired bucket.

use std::time::{Duration, Instant};

const BUCKETS: usize = 60;

#[derive(Debug)]
pub struct DispatchWindow {
    origin: Instant,
    length: Duration,
    bucket_len: Duration,
    /// The absolute bucket number the ring's newest slot holds.
    head: u64,
    /// `BUCKETS` rows of per-rank counts, row `b % BUCKETS` for bucket `b`.
    rows: Vec<u64>,
    totals: Vec<u64>,
    ranks: usize,
}

impl DispatchWindow {
    pub fn new(ranks: usize, window: Duration, now: Instant) -> Self {
        DispatchWindow {
            origin: now,
            length: window,
            bucket_len: (window / BUCKETS as u32).max(Duration::from_millis(1)),
            head: 0,
            rows: vec![0; BUCKETS * ranks],
            totals: vec![0; ranks],
            ranks,
        }
    }

    /// The window's length, as configured.
    pub fn length(&self) -> Duration {
        self.length
    }

    /// The ranks it counts.
    #[cfg(test)]
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Keeps the counts of ranks below `ranks`; new ranks start at 0.
    pub fn resize(&mut self, ranks: usize) {
        let mut rows = vec![0; BUCKETS * ranks];
        let keep = ranks.min(self.ranks);
        for b in 0..BUCKETS {
            let (from, to) = (b * self.ranks, b * ranks);
            rows[to..to + keep].copy_from_slice(&self.rows[from..from + keep]);
        }
        self.rows = rows;
        self.totals.resize(ranks, 0);
        self.ranks = ranks;
    }

    fn bucket_of(&self, now: Instant) -> u64 {
        (now.saturating_duration_since(self.origin).as_nanos() / self.bucket_len.as_nanos()) as u64
    }

    /// Moves the ring forward to `now`, dropping buckets that left the window.
    pub fn advance(&mut self, now: Instant) {
        let target = self.bucket_of(now);
        let steps = target.saturating_sub(self.head).min(BUCKETS as u64);
        for b in (target + 1 - steps)..=target {
            let row = (b as usize % BUCKETS) * self.ranks;
            for (total, count) in self.totals.iter_mut().zip(&mut self.rows[row..row + self.ranks]) {
                *total -= *count;
                *count = 0;
            }
        }
        self.head = self.head.max(target);
    }

    pub fn record(&mut self, rank: usize, count: u64, now: Instant) {
        self.advance(now);
        self.rows[(self.head as usize % BUCKETS) * self.ranks + rank] += count;
        self.totals[rank] += count;
    }

    #[cfg(test)]
    pub fn total(&self, rank: usize) -> u64 {
        self.totals[rank]
    }

    /// Population standard deviation of the totals of `ranks`.
    pub fn stddev(&self, ranks: impl Iterator<Item = usize> + Clone) -> f64 {
        let n = ranks.clone().count();
        if n < 2 {
            return 0.0;
        }
        let mean = ranks.clone().map(|r| self.totals[r] as f64).sum::<f64>() / n as f64;
        let var = ranks.map(|r| (self.totals[r] as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        var.sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_leave_the_window_after_its_length() {
        let t0 = Instant::now();
        let s = |x| t0 + Duration::from_secs(x);
        let mut w = DispatchWindow::new(2, Duration::from_secs(60), t0);
        w.record(0, 3, t0);
        w.record(1, 1, s(30));
        assert_eq!((w.total(0), w.total(1)), (3, 1));
        assert_eq!(w.stddev(0..2), 1.0);
        w.advance(s(59));
        assert_eq!(w.total(0), 3);
        w.advance(s(60));
        assert_eq!((w.total(0), w.total(1)), (0, 1));
        w.advance(s(1000));
        assert_eq!((w.total(0), w.total(1)), (0, 0));
        w.record(0, 2, s(1000));
        assert_eq!(w.total(0), 2);
        assert_eq!(w.stddev(0..1), 0.0);
    }

    #[test]
    fn resize_keeps_the_counts_of_surviving_ranks() {
        let t0 = Instant::now();
        let mut w = DispatchWindow::new(3, Duration::from_secs(60), t0);
        w.record(0, 2, t0);
        w.record(2, 5, t0 + Duration::from_secs(1));
        w.resize(5);
        assert_eq!((0..5).map(|r| w.total(r)).collect::<Vec<_>>(), [2, 0, 5, 0, 0]);
        w.record(4, 1, t0);
        w.resize(1);
        assert_eq!(w.total(0), 2);
        // Buckets still age out with the counts they were recorded in.
        w.advance(t0 + Duration::from_secs(61));
        assert_eq!(w.total(0), 0);
    }
}
