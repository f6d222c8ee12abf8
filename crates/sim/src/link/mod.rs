//! The connections one simulated cluster holds to dpcoord: a REQ socket per
//! frontend replica, the prober's socket (on the health socket, or on the
//! route socket for a frontend that mixes health and user traffic), an
//! observer on the health socket for `state` and `resize`, and a stats PUB
//! per engine, or, when dpcoord subscribes to SGLang load streams, a load
//! PUB each engine binds. Only the engines inside dpcoord's table publish:
//! one started before the operator's `resize` takes it in would have its
//! updates dropped. Sync mode, waiting before a user placement until
//! dpcoord has taken what was published, is in `sync`.

use std::time::{Duration, Instant};

use super::error::NetError;
use super::kv_pub::KvPub;
use super::local::Endpoints;
use super::model::{Micros, SimEngine};
use super::net::{Answer, Rpc, StatsPub};
use super::prefix_cache::KvEvent;
use super::publisher::{LoadPub, Publisher};
use super::stepped::Wiring;
use dpcoord_daemon::wire::Channel;

mod sync;

/// Engines re-send their stats at least this often (real time), as liveness.
const HEARTBEAT: Duration = Duration::from_millis(25);
/// Longest wait for every rank to be `up` at the start.
const BRING_UP: Duration = Duration::from_secs(10);

/// Where the prober sends its placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeVia {
    /// `health_route` + `health_report` on the health socket.
    Health,
    /// `route` on the user route socket: the probe takes a user placement.
    Route,
}

pub struct Link {
    frontends: Vec<Rpc>,
    prober: Rpc,
    via: ProbeVia,
    observer: Rpc,
    pubs: Vec<Publisher>,
    /// KV-event PUBs, one per engine (none when engines publish no events).
    kv: Vec<KvPub>,
    /// `(taken, sent)` KV batches when the KV sync's count started.
    kv_counted_from: (u64, u64),
    /// dpcoord's registry, whose message counter a load-stream sync waits on.
    registry: Option<prometheus::Registry>,
    /// `(taken, sent)` when the sync's count started.
    counted_from: (u64, u64),
    /// Ranks in dpcoord's table (0..ranks); engines above publish nothing.
    ranks: u32,
    dead: Vec<bool>,
    sync: bool,
    /// Whether updates carry `ttft_ms` (which feeds dpcoord's penalty).
    ttft: bool,
    dirty: bool,
    last_beat: Instant,
    /// Syncs that gave up waiting (the run is then not exactly reproducible).
    pub sync_timeouts: u64,
    // Dropped last, after every socket.
    wiring: Wiring,
}

impl Link {
    /// A link over ZeroMQ for `engines` simulated engines (some may join
    /// dpcoord's table later).
    pub fn open(eps: &Endpoints, frontends: u32, via: ProbeVia, engines: u32, sync: bool) -> Result<Link, NetError> {
        Link::wire(Wiring::Zmq(zmq::Context::new()), eps, frontends, via, engines, sync)
    }

    /// A link whose peers reach dpcoord through `wiring`.
    pub fn wire(
        wiring: Wiring,
        eps: &Endpoints,
        frontends: u32,
        via: ProbeVia,
        engines: u32,
        sync: bool,
    ) -> Result<Link, NetError> {
        // A stepped run's engines all boot at 1; a daemon on its own thread
        // may have heard an earlier run's engines, so they boot at the wall time.
        let boot = match wiring {
            Wiring::Stepped(_) => 1,
            Wiring::Zmq(_) => {
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_millis() as u64)
            }
        };
        let (prober_ep, prober_ch) = match via {
            ProbeVia::Health => (&eps.health, Channel::Health),
            ProbeVia::Route => (&eps.route, Channel::Route),
        };
        let w = &wiring;
        Ok(Link {
            frontends: (0..frontends.max(1))
                .map(|_| Rpc::connect(w, &eps.route, Channel::Route))
                .collect::<Result<_, _>>()?,
            prober: Rpc::connect(w, prober_ep, prober_ch)?,
            via,
            observer: Rpc::connect(w, &eps.health, Channel::Health)?,
            pubs: (0..engines).map(|r| publisher(w, eps, r, boot)).collect::<Result<_, _>>()?,
            kv: eps.kv.iter().zip(0..).map(|(ep, r)| KvPub::bind(w, ep, r)).collect::<Result<_, _>>()?,
            kv_counted_from: (0, 0),
            registry: None,
            counted_from: (0, 0),
            ranks: engines,
            dead: vec![false; engines as usize],
            sync,
            ttft: true,
            dirty: false,
            last_beat: Instant::now(),
            sync_timeouts: 0,
            wiring,
        })
    }

    /// Whether dpcoord is a coordinator stepped on virtual time (then
    /// engines' heartbeats are the world's events, not wall-clock ones).
    pub fn is_stepped(&self) -> bool {
        self.wiring.core().is_some()
    }

    /// The virtual time of the event being handled; a stepped coordinator
    /// runs its ticks due by then before taking the event's messages.
    pub fn set_now(&self, now: Micros) {
        if let Some(core) = self.wiring.core() {
            core.set_now(now);
        }
    }

    /// Whether engines report `ttft_ms` (default on). dpcoord turns it into a
    /// penalty on its wall-clock tick, so with it a load-aware run need not
    /// repeat exactly.
    pub fn with_ttft(mut self, on: bool) -> Link {
        self.ttft = on;
        self
    }

    /// Lets a load-stream sync read dpcoord's message counter.
    pub fn with_registry(mut self, registry: prometheus::Registry) -> Link {
        self.registry = Some(registry);
        self
    }

    /// Publishes until dpcoord shows every rank of its table, the first
    /// `ranks` engines, `up` (PUB drops what is sent before the subscription
    /// is wired); the table's epoch then.
    pub fn bring_up(&mut self, engines: &[SimEngine], ranks: u32) -> Result<u64, NetError> {
        self.ranks = ranks;
        self.wait_up(engines)?;
        self.settle();
        self.kv_join(engines)?;
        self.observer.epoch()
    }

    /// Until dpcoord's index shows a marker block from every KV publisher
    /// (a SUB misses what comes before it joins), each publishes one; then
    /// the KV sync's count starts. The markers' tokens appear in no prompt.
    fn kv_join(&mut self, engines: &[SimEngine]) -> Result<(), NetError> {
        let Some(block) = engines.iter().find_map(SimEngine::block_size) else { return Ok(()) };
        let n = self.kv.len().min(self.ranks as usize);
        let marker = |r: usize| vec![u32::MAX - r as u32; block as usize];
        let start = Instant::now();
        let mut heard = vec![false; n];
        while !heard.iter().all(|&h| h) {
            for r in (0..n).filter(|&r| !heard[r]) {
                let e = KvEvent::Stored { hashes: vec![u64::MAX - r as u64], parent: None, tokens: marker(r) };
                self.kv[r].send(&[e], block, 0.0)?;
            }
            if !self.is_stepped() {
                std::thread::sleep(Duration::from_millis(5));
            }
            for (r, h) in heard.iter_mut().enumerate() {
                *h = *h || self.observer.prefix(&marker(r))?.get(r).is_some_and(|&m| m > 0);
            }
            if start.elapsed() > BRING_UP {
                return Err(NetError::NotUp(BRING_UP));
            }
            self.heartbeat(engines)?;
        }
        if self.is_stepped() {
            return Ok(());
        }
        let last = sync::still(|| self.kv_taken());
        self.kv_counted_from = (last, self.kv_sent());
        Ok(())
    }

    /// Publishes rank `rank`'s KV events of its last step as one batch (at
    /// virtual time `now`), unless there are none, the rank is dead or
    /// outside dpcoord's table, or it has no publisher.
    pub fn publish_kv(&mut self, rank: u32, events: &[KvEvent], block: u32, now: Micros) -> Result<(), NetError> {
        let r = rank as usize;
        if events.is_empty() || r >= self.kv.len() || self.dead[r] || rank >= self.ranks {
            return Ok(());
        }
        self.dirty = true;
        self.kv[r].send(events, block, now as f64 / 1e6)
    }

    fn wait_up(&mut self, engines: &[SimEngine]) -> Result<(), NetError> {
        let Link { observer, pubs, ttft, ranks, .. } = self;
        observer.wait_all_up(BRING_UP, || {
            for (p, e) in pubs.iter_mut().zip(engines).take(*ranks as usize) {
                p.send(e, e.ttft_ms().filter(|_| *ttft), 0)?;
            }
            Ok(())
        })?;
        self.dirty = true;
        Ok(())
    }

    /// The operator resizes dpcoord's table to `dp_size` ranks; the reply's
    /// `(dp_size, epoch)`. Added engines then publish until they are `up`;
    /// removed ones publish no more.
    pub fn resize(&mut self, dp_size: u32, engines: &[SimEngine]) -> Result<(u32, u64), NetError> {
        let (now, epoch) = self.observer.resize(dp_size)?;
        let grew = now > self.ranks;
        self.ranks = now.min(self.pubs.len() as u32);
        if grew {
            self.wait_up(engines)?;
        }
        Ok((now, epoch))
    }

    /// Ranks in dpcoord's table.
    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    /// One user placement for frontend `f`, with the prompt's token ids
    /// if given, pinned to `pin` if given, among ranks `among` if given.
    pub fn route(
        &mut self,
        f: usize,
        prompt_tokens: u32,
        tokens: Option<&[u32]>,
        pin: Option<u32>,
        among: Option<&[u32]>,
    ) -> Result<Answer, NetError> {
        self.sync()?;
        self.frontends[f % self.frontends.len()].route_prompt(prompt_tokens.into(), tokens, pin, among)
    }

    /// One probe placement, through the health or the route socket.
    pub fn probe(&mut self) -> Result<Answer, NetError> {
        match self.via {
            ProbeVia::Health => self.prober.health_route(),
            ProbeVia::Route => self.prober.route(1),
        }
    }

    /// Reports a probe's outcome (only a health-channel prober can).
    pub fn report(&mut self, rank: u32, ok: bool) -> Result<(), NetError> {
        match self.via {
            ProbeVia::Health => self.prober.health_report(rank, ok),
            ProbeVia::Route => Ok(()),
        }
    }

    /// Publishes rank `rank`'s stats, unless the rank is dead or outside dpcoord's table.
    pub fn publish(&mut self, rank: u32, e: &SimEngine) -> Result<(), NetError> {
        let r = rank as usize;
        if self.dead[r] || rank >= self.ranks {
            return Ok(());
        }
        if self.pubs[r].is_load() {
            return Ok(());
        }
        self.dirty = true;
        self.pubs[r].send(e, e.ttft_ms().filter(|_| self.ttft), 0)
    }

    /// The load publishers' throttled call at virtual time `now`, for every
    /// live rank in dpcoord's table.
    pub fn call_load(&mut self, engines: &[SimEngine], now: Micros) -> Result<(), NetError> {
        for (rank, e) in engines.iter().enumerate().take(self.ranks as usize) {
            if !self.dead[rank] {
                let before = self.pubs[rank].sent;
                self.pubs[rank].call(e, now)?;
                self.dirty |= self.pubs[rank].sent > before;
            }
        }
        Ok(())
    }

    /// The engine's `received` in rank `rank`'s last message: the placements
    /// that dpcoord's latest report of the rank includes.
    pub fn reported_received(&self, rank: u32) -> u64 {
        self.pubs[rank as usize].received
    }

    /// dpcoord's `pending` per rank once it has the stats sent (in sync mode).
    pub fn pending(&mut self) -> Result<Vec<u64>, NetError> {
        self.sync()?;
        Ok(self.observer.state()?.iter().map(|r| r.pending).collect())
    }

    /// dpcoord's status of each rank of its table (`up`, `stale`, `down`, `unknown`).
    pub fn statuses(&mut self) -> Result<Vec<String>, NetError> {
        Ok(self.observer.state()?.into_iter().map(|r| r.status).collect())
    }

    /// A dead rank publishes nothing more.
    pub fn kill(&mut self, rank: u32) {
        self.dead[rank as usize] = true;
    }

    /// Re-sends every live rank's stats if the last heartbeat is old
    /// enough in wall time (a daemon on its own thread ages ranks by it).
    pub fn heartbeat(&mut self, engines: &[SimEngine]) -> Result<(), NetError> {
        if self.is_stepped() || self.last_beat.elapsed() < HEARTBEAT {
            return Ok(());
        }
        self.beat(engines)
    }

    /// Every live rank in dpcoord's table re-sends its stats now.
    pub fn beat(&mut self, engines: &[SimEngine]) -> Result<(), NetError> {
        self.last_beat = Instant::now();
        for (rank, e) in engines.iter().enumerate() {
            self.publish(rank as u32, e)?;
        }
        Ok(())
    }
}

/// Engine `rank`'s publisher: a load PUB it binds when dpcoord subscribes to
/// load streams, else a `StatsUpdate` PUB to dpcoord's stats bind.
fn publisher(wiring: &Wiring, eps: &Endpoints, rank: u32, boot: u64) -> Result<Publisher, NetError> {
    match eps.load.get(rank as usize) {
        Some(ep) => Ok(Publisher::load(LoadPub::bind(wiring, ep, rank)?, rank)),
        None => Ok(Publisher::stats(StatsPub::connect(wiring, &eps.stats, rank, boot)?, rank)),
    }
}
