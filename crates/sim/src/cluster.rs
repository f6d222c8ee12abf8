//! The simulated DP ranks and how their steps line up in time.
//!
//! Free-running: each rank steps on its own. **Lockstep** (DP attention,
//! MoE all-to-all): all ranks step together and a step lasts as long as the
//! slowest rank's share, so a rank with more work holds every other rank up
//! and an idle rank's capacity is wasted. Both are "step groups": one group
//! per rank, or one group of all ranks.

use super::model::{Advance, Job, Micros, SimEngine, StepCost};
use super::prefix_cache::CacheSpec;

/// Engine settings shared by every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineSpec {
    /// Prefill token budget per step per rank.
    pub chunk: u32,
    pub max_running: usize,
    pub cost: StepCost,
    /// Each rank's prefix cache, if any.
    pub cache: Option<CacheSpec>,
}

#[derive(Debug, Clone)]
struct Group {
    ranks: Vec<u32>,
    busy: bool,
}

#[derive(Debug, Clone)]
pub struct Cluster {
    pub engines: Vec<SimEngine>,
    groups: Vec<Group>,
}

impl Cluster {
    /// `speed_pct[r]` is rank r's speed (100 = nominal).
    pub fn new(spec: EngineSpec, speed_pct: &[u32], lockstep: bool) -> Cluster {
        let engines: Vec<SimEngine> = speed_pct
            .iter()
            .map(|&s| SimEngine::new(spec.chunk, spec.max_running, spec.cost, s).with_cache(spec.cache))
            .collect();
        let ranks = 0..engines.len() as u32;
        let groups: Vec<Group> = if lockstep {
            vec![Group { ranks: ranks.collect(), busy: false }]
        } else {
            ranks.map(|r| Group { ranks: vec![r], busy: false }).collect()
        };
        Cluster { engines, groups }
    }

    /// Hands a job to a rank; `false` when the rank is dead.
    pub fn admit(&mut self, rank: u32, job: Job) -> bool {
        self.engines[rank as usize].admit(job)
    }

    /// Starts a step in every idle group that has work; returns `(group, end)`.
    pub fn start_steps(&mut self, now: Micros) -> Vec<(usize, Micros)> {
        let mut started = Vec::new();
        for (g, group) in self.groups.iter_mut().enumerate() {
            if group.busy || !group.ranks.iter().any(|&r| self.engines[r as usize].has_work()) {
                continue;
            }
            let mut longest = 0;
            for &r in &group.ranks {
                let e = &mut self.engines[r as usize];
                let tokens = e.plan();
                longest = longest.max(e.step_us(tokens));
            }
            group.busy = true;
            started.push((g, now + longest.max(1)));
        }
        started
    }

    /// Ends group `g`'s step at `now`, reporting every job it moved.
    pub fn end_step(&mut self, g: usize, now: Micros, out: &mut Vec<Advance>) {
        self.groups[g].busy = false;
        for &r in &self.groups[g].ranks {
            self.engines[r as usize].finish(now, out);
        }
    }

    /// The ranks of group `g`.
    pub fn group_ranks(&self, g: usize) -> &[u32] {
        &self.groups[g].ranks
    }

    /// Prompt tokens prefilled so far over every rank.
    pub fn prefilled(&self) -> u64 {
        self.engines.iter().map(SimEngine::prefilled).sum()
    }

    /// Rank `rank` dies: the jobs it held, which have failed.
    pub fn kill(&mut self, rank: u32) -> Vec<Job> {
        self.engines[rank as usize].kill()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::DEFAULT_COST;

    const SPEC: EngineSpec = EngineSpec { chunk: 8192, max_running: 256, cost: DEFAULT_COST, cache: None };

    #[test]
    fn lockstep_steps_last_as_long_as_the_slowest_rank() {
        let mut c = Cluster::new(SPEC, &[100, 50], true);
        c.admit(0, Job::new(1, 8192, 1, 0));
        c.admit(1, Job::new(2, 100, 1, 0));
        // Rank 1 at half speed: (20000 + 100 * 80) * 2 = 56000 < 675360.
        assert_eq!(c.start_steps(0), [(0, 675_360)]);
        assert_eq!(c.start_steps(5), []);
        let mut out = Vec::new();
        c.end_step(0, 675_360, &mut out);
        let ids: Vec<u64> = out.iter().map(|a| a.id).collect();
        assert_eq!(ids, [1, 2]);
        assert_eq!(c.start_steps(675_360), []);
    }

    #[test]
    fn free_running_ranks_step_on_their_own() {
        let mut c = Cluster::new(SPEC, &[100, 50], false);
        c.admit(0, Job::new(1, 8192, 1, 0));
        c.admit(1, Job::new(2, 100, 1, 0));
        assert_eq!(c.start_steps(10), [(0, 675_370), (1, 56_010)]);
        assert_eq!(c.group_ranks(1), [1]);
        let lost = c.kill(0);
        assert_eq!(lost.len(), 1);
        assert!(!c.admit(0, Job::new(3, 1, 1, 0)));
    }
}
