//! Pickers: which routable rank takes the next placement, given the
//! per-request candidates. Pure functions of their inputs plus the caller's
//! cursor and seeded RNG: no I/O, no hidden state.

use rand::rngs::SmallRng;
use rand::Rng;

use crate::engines::EngineTable;

/// What a picker sees for one request.
#[derive(Debug, Clone, Copy)]
pub struct Candidates<'a> {
    pub engines: &'a EngineTable,
    /// Every rank's cost for this request; infinity when not routable.
    pub costs: &'a [f64],
    /// The routable ranks, ascending.
    pub routable: &'a [u32],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Picker {
    /// The first routable rank at or after the cursor.
    Rotation,
    /// The cheapest rank, scanning from the cursor so equal costs rotate.
    Least,
    /// The cheaper of two distinct random routable ranks (the first drawn on a tie).
    TwoChoices,
}

impl Picker {
    /// A rank, or `None` when no rank is routable.
    pub fn pick(self, c: &Candidates<'_>, cursor: u32, rng: &mut SmallRng) -> Option<u32> {
        match self {
            Picker::Rotation => rotation(c.routable, cursor),
            Picker::Least => least(c.costs, cursor as usize),
            Picker::TwoChoices => two_choices(c.costs, c.routable, rng),
        }
    }
}

/// The first of `routable` (ascending) at or after `cursor`, wrapping.
fn rotation(routable: &[u32], cursor: u32) -> Option<u32> {
    routable.iter().copied().find(|&r| r >= cursor).or(routable.first().copied())
}

/// The cheapest finite-cost rank, scanning from `start` (wrapping) so that
/// among equal costs the first at or after `start` wins.
fn least(costs: &[f64], start: usize) -> Option<u32> {
    let (before, after) = costs.split_at(start.min(costs.len()));
    // Two plain scans (a chained iterator tests which half it is in at
    // every rank): those at or after `start` win a tie.
    let (a, after_min) = first_min(after);
    let (b, before_min) = first_min(before);
    if before_min < after_min {
        Some(b as u32)
    } else {
        after_min.is_finite().then_some((before.len() + a) as u32)
    }
}

/// The position and cost of the first cheapest element (infinity when none is finite).
fn first_min(costs: &[f64]) -> (usize, f64) {
    let mut best = (0, f64::INFINITY);
    for (r, &c) in costs.iter().enumerate() {
        if c < best.1 {
            best = (r, c);
        }
    }
    best
}

fn two_choices(costs: &[f64], routable: &[u32], rng: &mut impl Rng) -> Option<u32> {
    match routable.len() {
        0 => None,
        1 => Some(routable[0]),
        n => {
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (ra, rb) = (routable[a], routable[b]);
            Some(if costs[rb as usize] < costs[ra as usize] { rb } else { ra })
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use rand::SeedableRng;

    use super::*;

    const INF: f64 = f64::INFINITY;

    /// Up to 12 ranks, each with a small cost (so ties happen) or infinity.
    fn costs() -> impl Strategy<Value = Vec<f64>> {
        prop::collection::vec(prop_oneof![3 => (0u8..4).prop_map(f64::from), 1 => Just(INF)], 0..12)
    }

    fn routable(costs: &[f64]) -> Vec<u32> {
        (0..costs.len() as u32).filter(|&r| costs[r as usize].is_finite()).collect()
    }

    #[test]
    fn least_rotates_ties_and_skips_infinite() {
        let costs = [2.0, 1.0, INF, 1.0];
        assert_eq!(least(&costs, 0), Some(1));
        assert_eq!(least(&costs, 2), Some(3));
        assert_eq!(least(&costs, 4), Some(1));
        assert_eq!(least(&[INF, INF], 0), None);
        assert_eq!(least(&[], 0), None);
    }

    proptest! {
        #[test]
        fn least_is_the_first_minimum_at_or_after_the_cursor(costs in costs(), start in 0usize..14) {
            let got = least(&costs, start);
            let min = costs.iter().copied().fold(INF, f64::min);
            match got {
                None => prop_assert!(min.is_infinite()),
                Some(r) => {
                    prop_assert_eq!(costs[r as usize], min);
                    // No rank between the cursor and r (wrapping) costs as little.
                    let n = costs.len();
                    let s = start.min(n);
                    let before = (0..n).map(|i| (s + i) % n).take_while(|&i| i != r as usize);
                    for i in before {
                        prop_assert!(costs[i] > min, "rank {} ties earlier than {}", i, r);
                    }
                }
            }
        }

        #[test]
        fn two_choices_picks_a_routable_rank_never_the_unique_most_expensive(costs in costs(), seed: u64) {
            let routable = routable(&costs);
            let mut rng = SmallRng::seed_from_u64(seed);
            let got = two_choices(&costs, &routable, &mut rng);
            prop_assert_eq!(got.is_some(), !routable.is_empty());
            if let Some(r) = got {
                prop_assert!(routable.contains(&r));
                // The winner is at most as expensive as another routable rank.
                if routable.len() >= 2 {
                    let others = routable.iter().filter(|&&o| o != r);
                    prop_assert!(others.into_iter().any(|&o| costs[o as usize] >= costs[r as usize]));
                }
            }
            // The same seed makes the same choice.
            let again = two_choices(&costs, &routable, &mut SmallRng::seed_from_u64(seed));
            prop_assert_eq!(got, again);
        }
    }
}
