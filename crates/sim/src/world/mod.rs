//! The discrete-event loop of one simulated run.
//!
//! Events (step ends, arrivals, retries, probes, a rank's death or hang,
//! frontends' request timeouts, the operator's resizes of dpcoord's table,
//! samples, requests reaching their engine after a hop, SGLang load
//! publishers' calls) are taken in virtual-time order from one queue on one
//! thread, so the order of every query sent to dpcoord follows from the model alone. With
//! a stepped coordinator (`stepped`), dpcoord's clock is the run's virtual
//! time too, so every run repeats exactly. Pacing maps virtual time to wall
//! time (`speed` virtual seconds per real second, 0 = as fast as possible),
//! which only matters to a daemon on its own thread: it measures liveness,
//! `pending_ttl_ms`, `pending_transit_ms` and penalties in wall time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::cluster::Cluster;
use super::error::NetError;
use super::link::Link;
use super::model::{Advance, Micros};
use super::net::Answer;
use super::nodes::Nodes;
use super::prompts::{Prompt, Source};
use super::record::{bump, Death, Happened, Live, Recorder};
pub use super::spec::{ArmSpec, CacheWeights, Handoff, Probe, Prompts};
use super::stale::StalePicker;
use super::workload::{Frontend, Load};

mod requests;

/// Wait before a failed or refused request is placed again.
const RETRY_AFTER: Micros = 50_000;
/// A paced event handled this long after its wall-clock due time is counted late.
const LATE: Duration = Duration::from_millis(4);
/// Under a stepped coordinator, every live engine re-sends its stats this
/// often (virtual time), so an idle rank stays `up`.
pub const BEAT: Micros = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    StepEnd(usize),
    Arrival(u32),
    Retry(u64),
    Probe,
    Kill(u32),
    /// Rank `.0` hangs.
    Hang(u32),
    /// Request `.0`'s frontend checks its placement on rank `.1` (its
    /// attempt `.2`; the rank's progress `.3` when the check was set).
    Timeout(u64, u32, u32, u64),
    Resize(u32),
    Sample,
    /// Request `.0` reaches rank `.1`.
    Deliver(u64, u32),
    /// The SGLang load publishers' throttled call.
    Publish,
    /// Engines' heartbeat (stepped coordinator only).
    Beat,
}

struct World<'a> {
    spec: &'a ArmSpec,
    link: &'a mut Link,
    live: Option<&'a Live>,
    cluster: Cluster,
    frontends: Vec<Frontend>,
    /// Each frontend's prompts, when requests carry tokens.
    sources: Vec<Source>,
    /// Each frontend's share of a replayed trace, in order.
    replays: Vec<VecDeque<Arc<Prompt>>>,
    /// Where the oracle's next scan starts.
    cursor: u32,
    /// Frontends placing requests themselves from stale snapshots.
    local: Option<StalePicker>,
    /// Over more than one node: how API servers and ranks split over them.
    split: Option<Nodes>,
    /// Over nodes: requests each frontend issued so far.
    issued: Vec<u64>,
    /// Over nodes: each request's API server, by id.
    servers: Vec<u32>,
    rec: Recorder,
    queue: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    seq: u64,
    now: Micros,
    moved: Vec<Advance>,
    /// Resizes still to come.
    resizes_left: usize,
    /// Removed ranks still finishing what they hold.
    draining: Vec<u32>,
    /// Draws each request's hop to its engine.
    rng: SmallRng,
    /// Each open-loop frontend's latest arrival, off the event grid (so
    /// rounding up to the grid does not slow the arrivals down).
    arrivals: Vec<Micros>,
}

/// Runs one arm until its prompts are done, `stop` is set or the horizon passes.
pub fn run(spec: &ArmSpec, link: &mut Link, stop: &AtomicBool, live: Option<&Live>) -> Result<Recorder, NetError> {
    let mut speeds = vec![100; spec.engines() as usize];
    if let Some((rank, pct)) = spec.slow {
        if let Some(s) = speeds.get_mut(rank as usize) {
            *s = pct;
        }
    }
    let n = spec.frontends.max(1);
    let shares: Vec<Vec<(Micros, Arc<Prompt>)>> =
        spec.replay.iter().flat_map(|r| (0..n).map(move |f| r.frontend(f, n))).collect();
    let frontends = match spec.replay {
        Some(_) => shares.iter().map(|s| Frontend::scheduled(s.iter().map(|(t, _)| *t).collect())).collect(),
        None => (0..n).map(|i| Frontend::new(i, n, spec.load, spec.prompts, spec.lengths, spec.seed)).collect(),
    };
    let mut w = World {
        spec,
        link,
        live,
        cluster: Cluster::new(spec.engine, &speeds, spec.lockstep),
        frontends,
        sources: spec
            .prompts_of
            .workload
            .into_iter()
            .flat_map(|w| (0..spec.frontends.max(1)).map(move |f| (w, f)))
            .map(|(w, f)| Source::new(w, spec.engine.cache.map_or(16, |c| c.block), spec.seed, f))
            .collect(),
        replays: shares.into_iter().map(|s| s.into_iter().map(|(_, p)| p).collect()).collect(),
        cursor: 0,
        local: spec.prompts_of.local.map(|rule| StalePicker::over(rule, spec.split())),
        split: Some(spec.split()).filter(|n| n.count() > 1),
        issued: vec![0; n as usize],
        servers: Vec::new(),
        rec: Recorder::new(spec.engines()),
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        moved: Vec::new(),
        resizes_left: spec.resizes.len(),
        draining: Vec::new(),
        rng: SmallRng::seed_from_u64(spec.seed ^ 0x5eed_7a11),
        arrivals: vec![0; spec.frontends.max(1) as usize],
    };
    let epoch = w.link.bring_up(&w.cluster.engines, spec.ranks)?;
    w.rec.table(0, spec.ranks, epoch, 0);
    w.seed_events();
    let start = Instant::now();
    while let Some(Reverse((at, _, event))) = w.queue.pop() {
        if stop.load(Ordering::Relaxed) || at > spec.horizon || w.all_done() {
            break;
        }
        w.pace(start, at, stop)?;
        w.now = at;
        w.link.set_now(at);
        w.handle(event)?;
        w.start_steps()?;
        w.watch_death()?;
        w.watch_hang()?;
        w.link.heartbeat(&w.cluster.engines)?;
        if let Some(live) = w.live {
            live.now_us.store(at, Ordering::Relaxed);
        }
    }
    w.sample()?;
    w.rec.death = w.rec.death.map(|d| Death { ended: w.now, ..d });
    w.rec.hang = w.rec.hang.map(|d| Death { ended: w.now, ..d });
    w.rec.prefilled = w.cluster.prefilled();
    w.rec.hits = w.cluster.engines.iter().map(|e| e.hits).collect();
    Ok(w.rec)
}

impl World<'_> {
    fn at(&mut self, t: Micros, event: Event) {
        let t = match (self.spec.handoff.grid, event) {
            (0, _) | (_, Event::Publish) => t,
            (grid, _) => t.div_ceil(grid) * grid,
        };
        self.seq += 1;
        self.queue.push(Reverse((t, self.seq, event)));
    }

    fn seed_events(&mut self) {
        for f in 0..self.frontends.len() {
            let n = self.frontends[f].initial();
            for _ in 0..n {
                self.at(0, Event::Arrival(f as u32));
            }
            if let Some(gap) = self.frontends[f].next_gap() {
                self.arrivals[f] = gap;
                self.at(gap, Event::Arrival(f as u32));
            }
        }
        if let Some(p) = self.spec.probe {
            self.at(p.every, Event::Probe);
        }
        if let Some((rank, t)) = self.spec.kill.filter(|(r, _)| *r < self.spec.ranks) {
            self.at(t, Event::Kill(rank));
        }
        if let Some((rank, t)) = self.spec.hang.filter(|(r, _)| *r < self.spec.ranks) {
            self.at(t, Event::Hang(rank));
        }
        for &(t, n) in &self.spec.resizes {
            self.at(t, Event::Resize(n));
        }
        self.at(0, Event::Sample);
        if self.spec.handoff.grid > 0 {
            self.at(self.spec.handoff.grid / 2, Event::Publish);
        }
        if self.link.is_stepped() {
            self.at(BEAT, Event::Beat);
        }
    }

    fn all_done(&self) -> bool {
        self.resizes_left == 0
            && self.frontends.iter().all(Frontend::exhausted)
            && self.rec.requests.iter().all(|r| r.done.is_some())
    }

    /// Sleeps until virtual time `at` is due in wall time, keeping engines' heartbeats going.
    fn pace(&mut self, start: Instant, at: Micros, stop: &AtomicBool) -> Result<(), NetError> {
        if self.spec.speed <= 0.0 {
            return Ok(());
        }
        let due = start + Duration::from_secs_f64(at as f64 / 1e6 / self.spec.speed);
        // Lateness only matters to a daemon on the wall clock.
        let late = Instant::now().saturating_duration_since(due) > LATE && !self.link.is_stepped();
        self.rec.late += u64::from(late);
        loop {
            let now = Instant::now();
            if now >= due || stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            std::thread::sleep((due - now).min(Duration::from_millis(10)));
            self.link.heartbeat(&self.cluster.engines)?;
        }
    }

    fn handle(&mut self, event: Event) -> Result<(), NetError> {
        match event {
            Event::StepEnd(g) => self.step_end(g),
            Event::Arrival(f) => self.arrival(f),
            Event::Retry(id) => self.dispatch(id),
            Event::Probe => self.probe(),
            Event::Kill(rank) => {
                self.rec.mark(self.now, rank, Happened::Died);
                self.rec.death = Some(Death::new(rank, self.now));
                self.link.kill(rank);
                for job in self.cluster.kill(rank) {
                    self.at(self.now + RETRY_AFTER, Event::Retry(job.id));
                }
                Ok(())
            }
            // It hangs in a step: at its first instant with work from then on.
            Event::Hang(rank) if !self.cluster.engines[rank as usize].has_work() => {
                self.at(self.now + BEAT, Event::Hang(rank));
                Ok(())
            }
            Event::Hang(rank) => {
                self.rec.mark(self.now, rank, Happened::Hung);
                self.rec.hang = Some(Death::new(rank, self.now));
                self.cluster.engines[rank as usize].hang();
                Ok(())
            }
            Event::Timeout(id, rank, attempt, progress) => self.timeout(id, rank, attempt, progress),
            Event::Resize(n) => self.resize(n),
            Event::Sample => {
                self.sample()?;
                self.at(self.now + self.spec.sample_every.max(1), Event::Sample);
                Ok(())
            }
            Event::Deliver(id, rank) => self.deliver(id, rank),
            Event::Publish => {
                self.link.call_load(&self.cluster.engines, self.now)?;
                self.at(self.now + self.spec.handoff.grid, Event::Publish);
                Ok(())
            }
            Event::Beat => {
                self.link.beat(&self.cluster.engines)?;
                self.at(self.now + BEAT, Event::Beat);
                Ok(())
            }
        }
    }

    /// Until dpcoord shows the rank that died `down`, looks at its status.
    fn watch_death(&mut self) -> Result<(), NetError> {
        let Some(rank) = self.rec.death.filter(|d| d.down_at.is_none()).map(|d| d.rank) else { return Ok(()) };
        if self.link.statuses()?.get(rank as usize).is_some_and(|s| s == "down") {
            self.rec.death = self.rec.death.map(|d| Death { down_at: Some(self.now), ..d });
        }
        Ok(())
    }

    /// Until dpcoord shows the rank that hung `stalled`, looks at its status.
    fn watch_hang(&mut self) -> Result<(), NetError> {
        let Some(rank) = self.rec.hang.filter(|d| d.down_at.is_none()).map(|d| d.rank) else { return Ok(()) };
        if self.link.statuses()?.get(rank as usize).is_some_and(|s| s == "stalled") {
            self.rec.hang = self.rec.hang.map(|d| Death { down_at: Some(self.now), ..d });
        }
        Ok(())
    }

    /// The operator resizes dpcoord's table; ranks it removed drain, then stop.
    fn resize(&mut self, n: u32) -> Result<(), NetError> {
        let before = self.link.ranks();
        let (dp_size, epoch) = self.link.resize(n, &self.cluster.engines)?;
        self.resizes_left -= 1;
        self.draining.extend(dp_size..before);
        self.rec.table(self.now, dp_size, epoch, self.cluster.prefilled());
        self.stop_drained();
        Ok(())
    }

    /// Removed ranks that hold nothing more stop (and would refuse work).
    fn stop_drained(&mut self) {
        let World { cluster, rec, now, draining, .. } = self;
        draining.retain(|&rank| {
            let busy = cluster.engines[rank as usize].has_work();
            if !busy {
                cluster.kill(rank);
                rec.stopped.push((rank, *now));
            }
            busy
        });
    }

    /// Starts a step in every idle group with work. After a hop, requests
    /// reach ranks between steps, so each rank that starts one publishes
    /// the batch it took (as an engine does when its scheduler moves).
    fn start_steps(&mut self) -> Result<(), NetError> {
        for (g, end) in self.cluster.start_steps(self.now) {
            self.at(end, Event::StepEnd(g));
            if self.spec.handoff.is_delayed() {
                for i in 0..self.cluster.group_ranks(g).len() {
                    let rank = self.cluster.group_ranks(g)[i];
                    self.link.publish(rank, &self.cluster.engines[rank as usize])?;
                }
            }
        }
        Ok(())
    }

    fn sample(&mut self) -> Result<(), NetError> {
        let engines = &self.cluster.engines;
        let held = engines.iter().map(|e| e.counts()[..2].iter().sum()).collect();
        let work = engines.iter().map(|e| e.tokens().iter().sum()).collect();
        self.rec.sample(self.now, held, work);
        let seen = self.link.statuses()?;
        self.rec.saw(self.now, seen);
        Ok(())
    }

    fn step_end(&mut self, g: usize) -> Result<(), NetError> {
        let mut moved = std::mem::take(&mut self.moved);
        self.cluster.end_step(g, self.now, &mut moved);
        let mut follow_ups = Vec::new();
        for &a in &moved {
            let r = &mut self.rec.requests[a.id as usize];
            if a.first_token {
                r.first_token = Some(self.now);
                r.cached = a.cached;
            }
            if a.finished {
                r.done = Some(self.now);
                if let Some(l) = &mut self.local {
                    l.finished(a.id);
                }
                if let Some(live) = self.live {
                    bump(&live.completed, 1);
                    bump(&live.input_tokens, r.prompt.into());
                }
                follow_ups.push(r.frontend);
                if let (Some(c), Some(s)) = (&r.content, self.sources.get_mut(r.frontend as usize)) {
                    s.completed(c);
                }
            }
        }
        moved.clear();
        self.moved = moved;
        self.stop_drained();
        for i in 0..self.cluster.group_ranks(g).len() {
            let rank = self.cluster.group_ranks(g)[i];
            let e = &mut self.cluster.engines[rank as usize];
            if let Some(live) = self.live {
                live.prompt[rank as usize].store(e.hits[0], Ordering::Relaxed);
                live.cached[rank as usize].store(e.hits[1], Ordering::Relaxed);
            }
            let events = e.take_events();
            self.link.publish_kv(rank, &events, e.block_size().unwrap_or(16), self.now)?;
            self.link.publish(rank, &self.cluster.engines[rank as usize])?;
        }
        for f in follow_ups {
            if matches!(self.frontends[f as usize].load(), Load::Closed { .. }) {
                self.issue(f)?;
            }
        }
        Ok(())
    }

    fn probe(&mut self) -> Result<(), NetError> {
        if let Answer::Rank(rank) = self.link.probe()? {
            self.rec.probes[rank as usize] += 1;
            if let Some(live) = self.live {
                bump(&live.probes[rank as usize], 1);
            }
            let ok = self.cluster.engines[rank as usize].answers();
            self.rec.probe_failures += u64::from(!ok);
            self.rec.mark(self.now, rank, Happened::Probe { ok });
            self.link.report(rank, ok)?;
        }
        if let Some(p) = self.spec.probe {
            self.at(self.now + p.every, Event::Probe);
        }
        Ok(())
    }
}
