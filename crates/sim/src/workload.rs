//! Simulated frontends: how many requests each sends, how long they are, and when.
//!
//! A closed-loop frontend keeps `concurrency` requests in flight and sends
//! the next one when one completes; an open-loop frontend sends at a fixed
//! mean rate (Poisson arrivals) whatever the engines do, or at the times a
//! trace gives (a scheduled frontend). Lengths and gaps
//! come from a seeded `SmallRng` per frontend, so a run is reproducible.

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::model::Micros;

/// When a frontend sends.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Keep this many requests in flight (over all frontends).
    Closed { concurrency: u32 },
    /// Poisson arrivals at this many requests per virtual second (over all frontends).
    Open { rate: f64 },
    /// Arrivals at given times, whatever the engines do (a trace's replay).
    Scheduled,
}

/// Inclusive token-length ranges (`lo == hi` for a fixed length).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lengths {
    pub input: (u32, u32),
    pub output: (u32, u32),
}

/// One frontend replica's request stream.
#[derive(Debug)]
pub struct Frontend {
    load: Load,
    /// Requests still to send; `None` for an endless stream.
    left: Option<u64>,
    lengths: Lengths,
    rng: SmallRng,
    /// A scheduled frontend's arrival times still to come, and its last one.
    times: std::collections::VecDeque<Micros>,
    last: Micros,
}

/// This frontend's share of `total` when split over `of` frontends.
fn share(total: u64, index: u32, of: u32) -> u64 {
    let of = u64::from(of.max(1));
    total / of + u64::from(u64::from(index) < total % of)
}

impl Frontend {
    /// Frontend `index` of `of`, sharing the load and the prompt count.
    pub fn new(index: u32, of: u32, load: Load, prompts: Option<u64>, lengths: Lengths, seed: u64) -> Frontend {
        let load = match load {
            Load::Closed { concurrency } => Load::Closed { concurrency: share(concurrency.into(), index, of) as u32 },
            Load::Open { rate } => Load::Open { rate: rate / f64::from(of.max(1)) },
            Load::Scheduled => Load::Scheduled,
        };
        Frontend {
            load,
            left: prompts.map(|p| share(p, index, of)),
            lengths,
            rng: SmallRng::seed_from_u64(seed ^ (u64::from(index) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            times: Default::default(),
            last: 0,
        }
    }

    /// A frontend sending one request at each of `times` (ascending); the
    /// requests' lengths come with their content.
    pub fn scheduled(times: Vec<Micros>) -> Frontend {
        let lengths = Lengths { input: (1, 1), output: (1, 1) };
        let mut f = Frontend::new(0, 1, Load::Scheduled, Some(times.len() as u64), lengths, 0);
        f.times = times.into();
        f
    }

    pub fn load(&self) -> Load {
        self.load
    }

    /// How many requests this frontend sends at time 0.
    pub fn initial(&self) -> u64 {
        match self.load {
            Load::Closed { concurrency } => self.left.map_or(concurrency.into(), |l| l.min(concurrency.into())),
            Load::Open { .. } | Load::Scheduled => 0,
        }
    }

    pub fn exhausted(&self) -> bool {
        self.left == Some(0)
    }

    /// The next request's `(prompt, output)` tokens, or `None` when all are sent.
    pub fn next_request(&mut self) -> Option<(u32, u32)> {
        match &mut self.left {
            Some(0) => return None,
            Some(n) => *n -= 1,
            None => {}
        }
        let (i, o) = (self.lengths.input, self.lengths.output);
        Some((self.rng.random_range(i.0..=i.1.max(i.0)), self.rng.random_range(o.0..=o.1.max(o.0))))
    }

    /// Time to the next open-loop arrival (exponential with the frontend's
    /// rate, or to the next scheduled time).
    pub fn next_gap(&mut self) -> Option<Micros> {
        match self.load {
            Load::Closed { .. } => None,
            Load::Open { rate } => {
                let u: f64 = self.rng.random_range(f64::EPSILON..1.0);
                Some((-u.ln() / rate.max(1e-9) * 1e6) as Micros)
            }
            Load::Scheduled => {
                let t = self.times.pop_front()?;
                let gap = t.saturating_sub(self.last);
                self.last = t;
                Some(gap)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXED: Lengths = Lengths { input: (60_000, 60_000), output: (1, 1) };

    #[test]
    fn load_and_prompts_are_shared_over_frontends() {
        let fs: Vec<Frontend> =
            (0..3).map(|i| Frontend::new(i, 3, Load::Closed { concurrency: 16 }, Some(160), FIXED, 1)).collect();
        let conc: Vec<u64> = fs.iter().map(Frontend::initial).collect();
        assert_eq!(conc, [6, 5, 5]);
        let left: Vec<Option<u64>> = fs.iter().map(|f| f.left).collect();
        assert_eq!(left, [Some(54), Some(53), Some(53)]);
    }

    #[test]
    fn a_stream_ends_after_its_prompts() {
        let mut f = Frontend::new(0, 1, Load::Closed { concurrency: 4 }, Some(2), FIXED, 1);
        assert_eq!(f.initial(), 2);
        assert_eq!(f.next_request(), Some((60_000, 1)));
        assert_eq!(f.next_request(), Some((60_000, 1)));
        assert!(f.exhausted());
        assert_eq!(f.next_request(), None);
        assert_eq!(f.next_gap(), None);
    }

    #[test]
    fn a_scheduled_frontend_sends_at_its_times() {
        let mut f = Frontend::scheduled(vec![5, 5, 12]);
        assert_eq!(f.initial(), 0);
        let gaps: Vec<Option<Micros>> = (0..4).map(|_| f.next_gap()).collect();
        assert_eq!(gaps, [Some(5), Some(0), Some(7), None]);
        assert_eq!((0..4).filter_map(|_| f.next_request()).count(), 3);
        assert!(f.exhausted());
    }

    #[test]
    fn seeded_streams_repeat_and_stay_in_range() {
        let lengths = Lengths { input: (100, 200), output: (1, 8) };
        let draw = |seed| {
            let mut f = Frontend::new(1, 2, Load::Open { rate: 10.0 }, None, lengths, seed);
            (0..50).map(|_| (f.next_request(), f.next_gap())).collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert_ne!(a, draw(8));
        for (req, gap) in a {
            let (i, o) = req.unwrap();
            assert!((100..=200).contains(&i) && (1..=8).contains(&o), "{i} {o}");
            assert!(gap.is_some());
        }
    }
}
