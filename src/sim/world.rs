//! The discrete-event loop of one simulated run.
//!
//! Events (step ends, arrivals, retries, probes, a rank's death, the
//! operator's resizes of dpcoord's table, samples)
//! are taken in virtual-time order from one queue on one thread, so the
//! order of every query sent to dpcoord follows from the model alone: with
//! `round_robin`, a run is exactly reproducible. Pacing maps virtual time to
//! wall time (`speed` virtual seconds per real second, 0 = as fast as
//! possible), which matters where dpcoord measures real time: liveness,
//! `pending_ttl_ms`, penalties.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::cluster::{Cluster, EngineSpec};
use super::link::{Link, ProbeVia};
use super::model::{Advance, Job, Micros};
use super::net::{Answer, NetError};
use super::record::{bump, Live, Recorder, Request};
use super::workload::{Frontend, Lengths, Load};

/// Wait before a failed or refused request is placed again.
const RETRY_AFTER: Micros = 50_000;

/// A health prober sending one probe every `every` virtual microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub every: Micros,
    pub via: ProbeVia,
}

/// Everything that defines one run.
#[derive(Debug, Clone)]
pub struct ArmSpec {
    pub name: String,
    pub ranks: u32,
    pub engine: EngineSpec,
    pub lockstep: bool,
    /// `(rank, speed_pct)` of a slow rank.
    pub slow: Option<(u32, u32)>,
    /// `(rank, at)`: the rank dies at virtual time `at`.
    pub kill: Option<(u32, Micros)>,
    /// `(at, dp_size)`: the operator resizes dpcoord's table at `at`. Engines
    /// beyond `ranks` start before the first resize that takes them in;
    /// removed ones finish what they hold, then stop.
    pub resizes: Vec<(Micros, u32)>,
    pub frontends: u32,
    pub load: Load,
    /// Prompts over all frontends; `None` runs until stopped.
    pub prompts: Option<u64>,
    pub lengths: Lengths,
    pub probe: Option<Probe>,
    pub seed: u64,
    /// Virtual seconds per wall second; 0 runs unpaced.
    pub speed: f64,
    pub sync: bool,
    pub sample_every: Micros,
    /// Virtual time after which the run stops (what is unfinished is lost).
    pub horizon: Micros,
}

impl ArmSpec {
    /// Engines simulated: dpcoord's table at its largest.
    pub fn engines(&self) -> u32 {
        self.resizes.iter().map(|&(_, n)| n).fold(self.ranks, u32::max)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    StepEnd(usize),
    Arrival(u32),
    Retry(u64),
    Probe,
    Kill(u32),
    Resize(u32),
    Sample,
}

struct World<'a> {
    spec: &'a ArmSpec,
    link: &'a mut Link,
    live: Option<&'a Live>,
    cluster: Cluster,
    frontends: Vec<Frontend>,
    rec: Recorder,
    queue: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    seq: u64,
    now: Micros,
    moved: Vec<Advance>,
    /// Resizes still to come.
    resizes_left: usize,
    /// Removed ranks still finishing what they hold.
    draining: Vec<u32>,
}

/// Runs one arm until its prompts are done, `stop` is set or the horizon passes.
pub fn run(spec: &ArmSpec, link: &mut Link, stop: &AtomicBool, live: Option<&Live>) -> Result<Recorder, NetError> {
    let mut speeds = vec![100; spec.engines() as usize];
    if let Some((rank, pct)) = spec.slow {
        if let Some(s) = speeds.get_mut(rank as usize) {
            *s = pct;
        }
    }
    let frontends = (0..spec.frontends.max(1))
        .map(|i| Frontend::new(i, spec.frontends.max(1), spec.load, spec.prompts, spec.lengths, spec.seed))
        .collect();
    let mut w = World {
        spec,
        link,
        live,
        cluster: Cluster::new(spec.engine, &speeds, spec.lockstep),
        frontends,
        rec: Recorder::new(spec.engines()),
        queue: BinaryHeap::new(),
        seq: 0,
        now: 0,
        moved: Vec::new(),
        resizes_left: spec.resizes.len(),
        draining: Vec::new(),
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
        w.handle(event)?;
        for (g, end) in w.cluster.start_steps(at) {
            w.at(end, Event::StepEnd(g));
        }
        w.link.heartbeat(&w.cluster.engines)?;
        if let Some(live) = w.live {
            live.now_us.store(at, Ordering::Relaxed);
        }
    }
    w.sample();
    w.rec.prefilled = w.cluster.prefilled();
    Ok(w.rec)
}

impl World<'_> {
    fn at(&mut self, t: Micros, event: Event) {
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
                self.at(gap, Event::Arrival(f as u32));
            }
        }
        if let Some(p) = self.spec.probe {
            self.at(p.every, Event::Probe);
        }
        if let Some((rank, t)) = self.spec.kill.filter(|(r, _)| *r < self.spec.ranks) {
            self.at(t, Event::Kill(rank));
        }
        for &(t, n) in &self.spec.resizes {
            self.at(t, Event::Resize(n));
        }
        self.at(0, Event::Sample);
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
                self.link.kill(rank);
                for job in self.cluster.kill(rank) {
                    self.at(self.now + RETRY_AFTER, Event::Retry(job.id));
                }
                Ok(())
            }
            Event::Resize(n) => self.resize(n),
            Event::Sample => {
                self.sample();
                self.at(self.now + self.spec.sample_every.max(1), Event::Sample);
                Ok(())
            }
        }
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

    fn sample(&mut self) {
        let running = self.cluster.engines.iter().map(|e| e.counts()[1]).collect();
        self.rec.sample(self.now, running);
    }

    fn arrival(&mut self, f: u32) -> Result<(), NetError> {
        self.issue(f)?;
        let fe = &mut self.frontends[f as usize];
        if matches!(fe.load(), Load::Open { .. }) && !fe.exhausted() {
            if let Some(gap) = fe.next_gap() {
                self.at(self.now + gap, Event::Arrival(f));
            }
        }
        Ok(())
    }

    /// Frontend `f` sends its next request, if it has one.
    fn issue(&mut self, f: u32) -> Result<(), NetError> {
        let Some((prompt, output)) = self.frontends[f as usize].next_request() else { return Ok(()) };
        let id = self.rec.requests.len() as u64;
        self.rec.requests.push(Request {
            frontend: f,
            prompt,
            output,
            issued: self.now,
            first_token: None,
            done: None,
            attempts: 0,
        });
        self.dispatch(id)
    }

    /// Asks dpcoord where request `id` goes and hands it to that engine.
    fn dispatch(&mut self, id: u64) -> Result<(), NetError> {
        let r = &mut self.rec.requests[id as usize];
        r.attempts += 1;
        let (f, prompt, output) = (r.frontend, r.prompt, r.output);
        match self.link.route(f as usize, prompt)? {
            Answer::Rank(rank) => {
                self.rec.placements[rank as usize] += 1;
                if self.cluster.admit(rank, Job::new(id, prompt, output, self.now)) {
                    self.link.publish(rank, &self.cluster.engines[rank as usize])?;
                } else {
                    // The engine is gone: the frontend sees the failure and retries.
                    self.at(self.now + RETRY_AFTER, Event::Retry(id));
                }
            }
            Answer::Refused(code) => {
                tracing::debug!(request = id, code = %code, "placement refused; retrying");
                self.rec.refusals += 1;
                self.at(self.now + RETRY_AFTER, Event::Retry(id));
            }
        }
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
            }
            if a.finished {
                r.done = Some(self.now);
                if let Some(live) = self.live {
                    bump(&live.completed, 1);
                    bump(&live.input_tokens, r.prompt.into());
                }
                follow_ups.push(r.frontend);
            }
        }
        moved.clear();
        self.moved = moved;
        self.stop_drained();
        for i in 0..self.cluster.group_ranks(g).len() {
            let rank = self.cluster.group_ranks(g)[i];
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
            let ok = self.cluster.engines[rank as usize].is_alive();
            self.rec.probe_failures += u64::from(!ok);
            self.link.report(rank, ok)?;
        }
        if let Some(p) = self.spec.probe {
            self.at(self.now + p.every, Event::Probe);
        }
        Ok(())
    }
}
