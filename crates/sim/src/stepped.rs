//! dpcoord's coordinator stepped on the simulator's virtual clock.
//!
//! The daemon's transport is one thread that reads the wall clock and
//! polls sockets, so which of two messages from different sockets it takes
//! first, and whether its 100 ms tick falls before or after a query, depend
//! on thread scheduling. Here the simulator's thread calls the same
//! [`Coordinator`] the transport would, with the same message bytes and
//! frames, at the virtual time of the event that sends them: every tick due
//! by then runs first, on its own virtual instant. Liveness, pending expiry
//! and penalties then follow virtual time, and a run repeats exactly.
//!
//! A [`QueryPeer`] or [`SourcePeer`] is where one simulated socket's
//! messages go: a ZeroMQ socket (a daemon on its own thread), or this
//! coordinator.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use dpcoord_daemon::observability::metrics::Metrics;
use dpcoord_daemon::routing::Coordinator;
use dpcoord_daemon::wire::{Channel, SourceKind};

use super::error::{NetError, SimError};
use super::local::{DaemonSettings, Endpoints};
use super::model::Micros;

/// How long any reply from a daemon on its own thread may take before the run fails.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(5);

struct Stepped {
    coord: Coordinator,
    /// Virtual time 0.
    base: Instant,
    now: Micros,
    reply: Vec<u8>,
}

impl Stepped {
    /// Runs every tick due by the current virtual time, each at its own instant.
    fn catch_up(&mut self) -> Instant {
        let now = self.base + Duration::from_micros(self.now);
        while self.coord.next_tick() <= now {
            let at = self.coord.next_tick();
            self.coord.tick(at);
        }
        now
    }
}

/// A coordinator the simulator steps; clones share it.
#[derive(Clone)]
pub struct Core(Arc<Mutex<Stepped>>);

impl Core {
    /// A coordinator with `settings`, and the endpoints its config names
    /// (never bound: they only tell the simulator which peers exist).
    pub fn start(settings: &DaemonSettings) -> Result<(Core, Endpoints), SimError> {
        let ep = |name: &str| format!("ipc://stepped/{name}");
        let per_rank = |on: bool, what: &str| -> Vec<String> {
            (0..settings.ranks).filter(|_| on).map(|r| ep(&format!("{what}-{r}"))).collect()
        };
        let eps = Endpoints {
            route: ep("route"),
            health: ep("health"),
            stats: ep("stats"),
            load: per_rank(settings.sglang_load, "load"),
            kv: per_rank(settings.kv_events, "kv"),
        };
        let cfg = settings.config(&eps)?;
        let metrics = Metrics::new(cfg.settings.engines.dp_size);
        let base = Instant::now();
        let coord = Coordinator::new(&cfg.settings, metrics, base).with_kv_endpoints(&cfg.server.kv_events);
        let stepped = Stepped { coord, base, now: 0, reply: Vec::with_capacity(4096) };
        Ok((Core(Arc::new(Mutex::new(stepped))), eps))
    }

    fn lock(&self) -> MutexGuard<'_, Stepped> {
        // Only the simulator's thread steps the coordinator; a panic there ends the run anyway.
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Moves virtual time on to `now` (it never goes back).
    pub fn set_now(&self, now: Micros) {
        let mut s = self.lock();
        s.now = s.now.max(now);
    }

    fn query(&self, ch: Channel, bytes: &[u8]) -> Vec<u8> {
        let mut s = self.lock();
        let now = s.catch_up();
        let Stepped { coord, reply, .. } = &mut *s;
        reply.clear();
        coord.on_query(ch, bytes, now, reply);
        reply.clone()
    }

    fn source(&self, kind: SourceKind, frames: &[&[u8]]) {
        let mut s = self.lock();
        let now = s.catch_up();
        s.coord.on_source(kind, Some(frames), now);
    }
}

/// What a simulated peer is connected to.
pub enum Wiring {
    /// A daemon on its own thread, over ZeroMQ.
    Zmq(zmq::Context),
    /// A coordinator on the simulator's thread and virtual clock.
    Stepped(Core),
}

/// Where a frontend's or prober's queries go.
pub enum QueryPeer {
    Socket(zmq::Socket),
    Stepped(Core, Channel),
}

/// Where an engine's published messages go.
pub enum SourcePeer {
    Socket(zmq::Socket),
    Stepped(Core, SourceKind),
}

impl Wiring {
    /// A frontend's or prober's REQ socket to `endpoint`, dpcoord's `ch` socket.
    pub fn query(&self, endpoint: &str, ch: Channel) -> Result<QueryPeer, NetError> {
        match self {
            Wiring::Zmq(ctx) => {
                let sock = ctx.socket(zmq::REQ)?;
                sock.set_linger(0)?;
                sock.set_rcvtimeo(REPLY_TIMEOUT.as_millis() as i32)?;
                sock.set_sndtimeo(REPLY_TIMEOUT.as_millis() as i32)?;
                sock.connect(endpoint)?;
                Ok(QueryPeer::Socket(sock))
            }
            Wiring::Stepped(core) => Ok(QueryPeer::Stepped(core.clone(), ch)),
        }
    }

    /// An engine's PUB socket of source `kind`: bound at `endpoint` (SGLang's
    /// and vLLM's engines bind theirs) or connected to it (dpcoord's stats bind).
    pub fn publisher(&self, endpoint: &str, kind: SourceKind, bind: bool, hwm: i32) -> Result<SourcePeer, NetError> {
        match self {
            Wiring::Zmq(ctx) => {
                let sock = ctx.socket(zmq::PUB)?;
                sock.set_linger(0)?;
                sock.set_sndhwm(hwm)?;
                if bind {
                    sock.bind(endpoint)?;
                } else {
                    sock.connect(endpoint)?;
                }
                Ok(SourcePeer::Socket(sock))
            }
            Wiring::Stepped(core) => Ok(SourcePeer::Stepped(core.clone(), kind)),
        }
    }

    /// The stepped coordinator, if that is what peers reach.
    pub fn core(&self) -> Option<&Core> {
        match self {
            Wiring::Zmq(_) => None,
            Wiring::Stepped(core) => Some(core),
        }
    }
}

impl QueryPeer {
    /// One query and its reply.
    pub fn call(&self, bytes: &[u8]) -> Result<Vec<u8>, NetError> {
        match self {
            QueryPeer::Socket(sock) => {
                let timeout =
                    |e| if e == zmq::Error::EAGAIN { NetError::Timeout(REPLY_TIMEOUT) } else { NetError::Zmq(e) };
                sock.send(bytes, 0).map_err(timeout)?;
                sock.recv_bytes(0).map_err(timeout)
            }
            QueryPeer::Stepped(core, ch) => Ok(core.query(*ch, bytes)),
        }
    }
}

impl SourcePeer {
    /// One published message of these frames.
    pub fn send(&self, frames: &[&[u8]]) -> Result<(), NetError> {
        match self {
            SourcePeer::Socket(sock) => Ok(sock.send_multipart(frames, zmq::DONTWAIT)?),
            SourcePeer::Stepped(core, kind) => {
                core.source(*kind, frames);
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::{Rpc, StatsPub};

    /// A rank heard once at virtual 0 ages on the virtual clock alone, at
    /// the 100 ms ticks: `stale` once silent 1000 ms, `down` once silent 3000 ms.
    #[test]
    fn liveness_follows_virtual_time() {
        let (core, eps) = Core::start(&DaemonSettings::defaults(1, "round_robin")).unwrap();
        let wiring = Wiring::Stepped(core.clone());
        let mut engine = StatsPub::connect(&wiring, &eps.stats, 0, 1).unwrap();
        let observer = Rpc::connect(&wiring, &eps.health, Channel::Health).unwrap();
        engine.publish([0; 5], [0; 2], None, None).unwrap();
        let status = |at: Micros| {
            core.set_now(at);
            observer.state().unwrap()[0].status.clone()
        };
        let seen: Vec<String> = [0, 999_999, 1_000_000, 2_999_999, 3_000_000].map(status).into();
        assert_eq!(seen, ["up", "up", "stale", "stale", "down"]);
    }
}
