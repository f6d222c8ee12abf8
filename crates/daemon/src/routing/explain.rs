//! What a placement predicted was cached (docs/PROTOCOL.md §4, `explain`):
//! on each rank placed on and on the best routable rank, counted in the
//! prediction metrics for every placement, and kept for the reply of a
//! route that asked for it.

use super::placement::Placement;
use super::prefix::PrefixView;
use crate::engines::EngineTable;
use crate::observability::prefix_metrics::PrefixMetrics;
use crate::wire::{Chosen, Explain, PrefixSource};

/// The last route's prediction; empty when it made none.
#[derive(Default)]
pub(super) struct Explained {
    made: bool,
    best: u64,
    /// The balance guard set the prefix aside for a policy pick.
    guarded: bool,
    /// One entry per distinct rank placed on, in order of first placement.
    chosen: Vec<Chosen>,
    /// The block size the prompt was keyed in first.
    block_size: u32,
}

impl Explained {
    /// The next route makes no prediction unless [`Explained::record`] says so.
    pub fn clear(&mut self) {
        self.made = false;
        self.chosen.clear();
    }

    /// The placements `placed` were weighed against `view` (or, `guarded`,
    /// the policy's picks against load alone: the balance guard held);
    /// `source` says where each rank's match came from. Each placement is counted.
    pub fn record(
        &mut self,
        view: &PrefixView<'_>,
        guarded: bool,
        placed: &[Placement],
        engines: &EngineTable,
        source: impl Fn(u32) -> PrefixSource,
        metrics: &PrefixMetrics,
    ) {
        let routable = (0..engines.dp_size()).filter(|&r| engines.is_routable(r));
        let best = routable.chain(placed.iter().map(|p| p.rank)).map(|r| view.cached(r)).max().unwrap_or(0);
        self.clear();
        self.made = true;
        self.best = best;
        self.guarded = guarded;
        self.block_size = u32::try_from(view.block_size).unwrap_or(u32::MAX);
        for &Placement { rank, count, .. } in placed {
            let predicted = view.cached(rank);
            metrics.placed(rank, count, predicted, best);
            if !self.chosen.iter().any(|c| c.rank == rank) {
                self.chosen.push(Chosen { rank, predicted, index: source(rank) });
            }
        }
    }

    /// The reply's `explain`, if a prediction was made.
    pub fn reply(&self) -> Option<Explain<'_>> {
        self.made.then_some(Explain {
            best: self.best,
            guarded: self.guarded,
            chosen: &self.chosen,
            block_size: self.block_size,
        })
    }
}
