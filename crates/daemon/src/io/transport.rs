//! ZeroMQ transport: the only code that moves messages on sockets.
//!
//! One thread polls the engine sources, the route and health ROUTER
//! sockets, the ZAP handler, the bound sockets' connection monitors and the
//! connecting sources' link events; it hands each source message (all its
//! frames) and each query to the coordinator, and sends the reply back
//! along the request's envelope. KV messages go to the KV decoder's thread
//! first (`io::kv_decode`), and what they change in the prefix index is
//! applied [`KV_BUDGET`] at a time per poll round. There is no routing
//! logic here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::error::{sock_err, TransportError};
use super::fds::Budget;
use super::frames::{Drops, Frames};
use super::kv_decode::{self, KvDecoder};
use super::links::{Link, Relinks};
use super::peers::{Monitor, Peers};
use super::queries::{answer_along, drain_queries, serve_one, Queries, HEALTH_BUDGET};
use super::reload::{ConfigSource, Reloads};
use super::sockets::Sockets;
use super::source::Source;
use super::zap::{self, Gate};
use crate::routing::Coordinator;
use crate::wire::{Channel, SourceRequest};

/// Messages taken from one socket per poll round, so no socket starves
/// another (sources included: a flood of updates delays a query by one batch).
const BATCH: usize = 256;
/// Work on the prefix index per poll round (KV batches taken and applied)
/// before the sockets are served again.
const KV_BUDGET: Duration = Duration::from_micros(200);
/// Blocks applied between two looks at the clock: tens of microseconds.
const KV_SLICE: usize = 64;
/// Longest poll wait, which bounds how fast a stop request is seen.
const MAX_WAIT: Duration = Duration::from_millis(50);
/// On stop, queries are answered until the query sockets have been quiet
/// this long: a query a peer sent just before may still be on its way (in
/// the peer's or the kernel's buffers), and once closed a REQ peer would
/// wait forever for its reply.
const STOP_QUIET: Duration = Duration::from_millis(100);
/// The longest that answering goes on after a stop, so peers that never
/// pause cannot hold shutdown open; with the sockets' linger, under the 2 s promise.
const STOP_BUDGET: Duration = Duration::from_millis(500);

/// Reads a source until EAGAIN; `true` when the batch limit stopped it
/// first. A source decoded off the routing thread hands its messages to
/// the KV decoder, and stops early (`false`, marked blocked) while the
/// decoder's queue is full.
fn drain_source(src: &Source, q: &mut Queries<'_>, kv: &mut Option<Kv>) -> Result<bool, zmq::Error> {
    let Queries { frames: f, coord, .. } = q;
    if let Some(kv) = kv.as_mut().filter(|_| src.off_thread) {
        for _ in 0..BATCH {
            if !kv.decoder.has_room() {
                kv.blocked = true;
                return Ok(false);
            }
            if !f.recv(&src.socket)? {
                return Ok(false);
            }
            kv.decoder.send(src.kind, f.take_whole(), coord.source_limits());
        }
        return Ok(true);
    }
    for _ in 0..BATCH {
        if !f.recv(&src.socket)? {
            return Ok(false);
        }
        coord.receive(src.kind, f.whole(), Instant::now());
    }
    Ok(true)
}

/// The KV decoder, and whether the KV sockets wait for room in its queue
/// (left out of the poll until then).
struct Kv {
    decoder: KvDecoder,
    blocked: bool,
}

impl Kv {
    /// Takes decoded KV messages and applies what they change, for at most
    /// [`KV_BUDGET`]: a new message only once the last is applied, so the
    /// coordinator holds one batch at a time.
    fn work(&mut self, coord: &mut Coordinator) {
        let started = Instant::now();
        loop {
            if !coord.kv_pending() {
                let Some(d) = self.decoder.take() else { return };
                coord.on_decoded(d.kind, d.event, Instant::now());
            }
            coord.apply_kv(KV_SLICE);
            if started.elapsed() >= KV_BUDGET {
                return;
            }
        }
    }
}

/// Sends what the coordinator asks of a source (a KV publisher's replay
/// socket): an empty delimiter, then the body. A request that cannot be
/// sent times out in the coordinator like one that is never answered.
fn send_request(sources: &[Source], r: &SourceRequest) {
    if let Some(src) = sources.iter().find(|s| s.kind == r.to) {
        if let Err(e) = src.socket.send_multipart([&b""[..], &r.body[..]], zmq::DONTWAIT) {
            tracing::debug!(source = r.to.as_str(), error = %e, "a request to a source not sent");
        }
    }
}

/// What other threads ask of the serving loop.
#[derive(Debug, Default)]
pub struct Control {
    /// Answer what is queued and stop.
    pub stop: AtomicBool,
    /// Re-read the configuration (SIGHUP), then clear the flag.
    pub reload: AtomicBool,
}

/// One socket the loop polls, with what it carries.
enum Polled<'a> {
    /// The connection events of a bound socket, the `usize`-th monitor.
    Monitor(usize, &'a Monitor),
    /// The events of the `usize`-th link to a source dpcoord connects to.
    Link(usize, &'a Link),
    Zap(&'a zmq::Socket),
    Source(&'a Source),
    Query(&'a zmq::Socket, Channel),
}

impl Polled<'_> {
    fn socket(&self) -> &zmq::Socket {
        match self {
            Polled::Zap(s) | Polled::Query(s, _) => s,
            Polled::Monitor(_, m) => &m.socket,
            Polled::Link(_, l) => &l.monitor,
            Polled::Source(src) => &src.socket,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Polled::Zap(..) => "zap",
            Polled::Monitor(_, m) => m.name,
            Polled::Link(..) => "links",
            Polled::Source(src) => src.kind.as_str(),
            Polled::Query(_, ch) => ch.as_str(),
        }
    }

    /// Serves what is waiting; `true` when the batch limit stopped it first.
    fn drain(
        &self,
        q: &mut Queries<'_>,
        gate: &mut Gate<'_>,
        relinks: &mut Relinks,
        kv: &mut Option<Kv>,
    ) -> Result<bool, TransportError> {
        let served = match *self {
            Polled::Monitor(i, _) => gate.count(i, q.coord),
            Polled::Link(i, l) => {
                let served = relinks.drain(i, &l.monitor, Instant::now());
                // Before the link's first message of the new session is read
                // (links are served before sources).
                if relinks.take_renewed(i) {
                    q.coord.on_relinked(l.kind);
                }
                served
            }
            Polled::Zap(z) => zap::drain(z, q.coord, gate),
            Polled::Source(src) => drain_source(src, q, kv),
            Polled::Query(s, Channel::Health) => {
                return drain_queries(s, Channel::Health, q, BATCH, Some(HEALTH_BUDGET))
            }
            Polled::Query(s, ch) => return drain_queries(s, ch, q, BATCH, None),
        };
        served.map_err(sock_err(self.name()))
    }
}

/// Serves until `stop` is set, then answers the queries still arriving.
///
/// The wait polls each socket's `ZMQ_FD`, not the socket: `zmq_poll` on
/// sockets asks every socket for `ZMQ_EVENTS` before and after waiting, and
/// each ask is a poll(2) on that socket's command mailbox (3.1 poll(2) calls
/// per query under the transport benchmark; 2.0 this way). A `ZMQ_FD` only
/// signals a change, so every socket is read until EAGAIN, which leaves it
/// armed to signal the next message; a socket its batch limit stopped early
/// is served again without waiting. Sockets are served in the order
/// monitors, ZAP, source links, sources, route, health: a round counts the
/// connections it knows of before it answers ZAP about them; health
/// queries take at most [`HEALTH_BUDGET`] a round. After each
/// round, source links libzmq closed for good are connected again
/// (`io::links`).
/// `fds` is the descriptor budget found at start, which may hold a bound
/// socket's peers below its cap; `source` is where a reload reads.
pub fn serve(
    sockets: Sockets,
    coord: &mut Coordinator,
    control: &Control,
    fds: Budget,
    source: ConfigSource,
) -> Result<(), TransportError> {
    let mut serving = Serving::start(&sockets, coord, fds, source)?;
    while !control.stop.load(Ordering::Relaxed) {
        serving.round(control)?;
    }
    serving.stop()
}

/// The serving loop's state between rounds.
struct Serving<'a> {
    sockets: &'a Sockets,
    /// The sockets in serving order; `items[i]` is `polled[i]`'s descriptor.
    polled: Vec<Polled<'a>>,
    /// A descriptor per `polled`, then the KV decoder's bell (with a
    /// decoder), then the reload reader's (with one).
    items: Vec<zmq::PollItem<'a>>,
    /// Where in `polled` the sources decoded off this thread are.
    kv_sources: Vec<usize>,
    kv: Option<Kv>,
    /// Where in `items` the reload reader's bell is.
    reload_bell: Option<usize>,
    gate: Gate<'a>,
    relinks: Relinks,
    q: Queries<'a>,
    /// What the coordinator asks of sources, sent at the end of a round.
    requests: Vec<SourceRequest>,
    /// Sockets to read again without waiting: their batch limit stopped them.
    unfinished: Vec<bool>,
}

impl<'a> Serving<'a> {
    /// Lists the sockets in serving order with their descriptors, and starts
    /// the KV decoder (when a source is decoded off this thread) and the
    /// reload reader.
    fn start(
        sockets: &'a Sockets,
        coord: &'a mut Coordinator,
        fds: Budget,
        source: ConfigSource,
    ) -> Result<Self, TransportError> {
        let Sockets { sources, route, health, zap, monitors, links, .. } = sockets;
        let polled: Vec<Polled<'a>> = monitors
            .iter()
            .enumerate()
            .map(|(i, m)| Polled::Monitor(i, m))
            .chain([Polled::Zap(zap)])
            .chain(links.iter().enumerate().map(|(i, l)| Polled::Link(i, l)))
            .chain(sources.iter().map(Polled::Source))
            .chain([Polled::Query(route, Channel::Route), Polled::Query(health, Channel::Health)])
            .collect();
        let mut items = Vec::with_capacity(polled.len() + 1);
        for p in &polled {
            items.push(zmq::PollItem::from_fd(p.socket().get_fd().map_err(sock_err(p.name()))?, zmq::POLLIN));
        }
        let kv_sources: Vec<usize> =
            (0..polled.len()).filter(|&i| matches!(&polled[i], Polled::Source(s) if s.off_thread)).collect();
        let kv = match kv_sources.is_empty() {
            true => None,
            false => {
                let bound = kv_decode::queue_bytes(coord.source_limits().kv_batch);
                let decoder = KvDecoder::start(bound).map_err(TransportError::DecodeThread)?;
                items.push(zmq::PollItem::from_fd(decoder.bell_fd(), zmq::POLLIN));
                Some(Kv { decoder, blocked: false })
            }
        };
        let reloads = Reloads::start(source).map_err(TransportError::Thread)?;
        let reload_bell = reloads.bell_fd().map(|fd| {
            items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
            items.len() - 1
        });
        let drops = Drops::new(&coord.metrics().registry);
        let gate = Gate::new(Peers::new(monitors, &coord.metrics().registry), monitors, fds);
        let relinks = Relinks::new(links, sources, &coord.metrics().registry);
        let q = Queries { frames: Frames::new(), coord, drops, reloads };
        // Every socket is read once before the first wait, which arms its ZMQ_FD.
        let unfinished = vec![true; polled.len()];
        let requests = Vec::new();
        Ok(Serving { sockets, polled, items, kv_sources, kv, reload_bell, gate, relinks, q, requests, unfinished })
    }

    /// One poll round: a reload asked for, a tick when due, the wait, the
    /// sockets, what the reload reader finished, KV work, the source links
    /// due again, and what the coordinator asks of sources.
    fn round(&mut self, control: &Control) -> Result<(), TransportError> {
        let Sockets { sources, health, links, .. } = self.sockets;
        let now = Instant::now();
        if control.reload.swap(false, Ordering::Relaxed) {
            // SIGHUP answers no one: counted and logged by the coordinator.
            self.q.reloads.ask(None, self.q.coord, now, &mut answer_along(health));
        }
        self.q.reloads.poll(self.q.coord, now, &mut answer_along(health));
        if now >= self.q.coord.next_tick() {
            self.q.coord.tick(now);
        }
        let wait = self.wait_ms(now);
        let signalled = match zmq::poll(&mut self.items, wait) {
            Ok(n) => n > 0,
            Err(zmq::Error::EINTR) => true,
            Err(e) => return Err(TransportError::Socket { socket: "poll", source: e }),
        };
        // A wait that timed out reads every socket anyway: should an edge of
        // a ZMQ_FD ever be missed, the socket stalls for one wait, not forever.
        self.drain_ready(wait > 0 && !signalled)?;
        if self.reload_bell.is_some_and(|i| self.items[i].is_readable()) {
            self.q.reloads.quiet();
            self.q.reloads.poll(self.q.coord, Instant::now(), &mut answer_along(health));
        }
        self.work_kv();
        self.relinks.reconnect_due(links, sources, Instant::now());
        self.q.coord.take_source_requests(&mut self.requests);
        for r in self.requests.drain(..) {
            send_request(sources, &r);
        }
        Ok(())
    }

    /// How long the poll waits, in ms: not at all while a socket or the KV
    /// work is unfinished, else until the next tick, relink or reload is
    /// due, at most [`MAX_WAIT`].
    fn wait_ms(&mut self, now: Instant) -> i64 {
        let coord = &*self.q.coord;
        let wake = [self.relinks.next_due(), self.q.reloads.next_due()]
            .into_iter()
            .flatten()
            .fold(coord.next_tick(), Instant::min);
        let kv_busy = self.kv.as_mut().is_some_and(|kv| coord.kv_pending() || kv.decoder.has_ready());
        match self.unfinished.contains(&true) || kv_busy {
            true => 0,
            false => wake.saturating_duration_since(now).min(MAX_WAIT).as_millis() as i64 + 1,
        }
    }

    /// Serves each socket that signalled or was left unfinished; every one
    /// after a wait that `timed_out`.
    fn drain_ready(&mut self, timed_out: bool) -> Result<(), TransportError> {
        for (i, p) in self.polled.iter().enumerate() {
            if self.unfinished[i] || timed_out || self.items[i].is_readable() {
                self.unfinished[i] = p.drain(&mut self.q, &mut self.gate, &mut self.relinks, &mut self.kv)?;
            }
        }
        Ok(())
    }

    /// Applies decoded KV work for [`KV_BUDGET`], and keeps the KV sources
    /// out of the poll while the decoder's queue is full.
    fn work_kv(&mut self) {
        let Some(kv) = &mut self.kv else { return };
        if self.items[self.polled.len()].is_readable() {
            kv.decoder.quiet();
        }
        let was_blocked = kv.blocked;
        kv.work(self.q.coord);
        // Blocked KV sockets leave the poll (their descriptor would wake
        // it at once) until the queue has room; then they are read.
        if kv.blocked && kv.decoder.has_room() {
            kv.blocked = false;
        }
        if kv.blocked != was_blocked || kv.blocked {
            let events = if kv.blocked { zmq::PollEvents::empty() } else { zmq::POLLIN };
            for &i in &self.kv_sources {
                self.items[i].set_events(events);
                self.unfinished[i] |= !kv.blocked;
            }
        }
    }

    /// Answers what is queued and what is still on its way (sent before the
    /// stop, not arrived yet): serves until both query sockets have been
    /// quiet for [`STOP_QUIET`], or for [`STOP_BUDGET`] at most; then the
    /// caller closes them (linger flushes).
    fn stop(mut self) -> Result<(), TransportError> {
        let Sockets { route, health, .. } = self.sockets;
        let q = &mut self.q;
        let stopping = Instant::now();
        // A read in flight is not waited for (its thread is never joined).
        q.reloads.stop(q.coord, stopping, &mut answer_along(health));
        let mut quiet_since = stopping;
        let mut items = [route.as_poll_item(zmq::POLLIN), health.as_poll_item(zmq::POLLIN)];
        loop {
            for (s, ch) in [(route, Channel::Route), (health, Channel::Health)] {
                while serve_one(s, ch, q).map_err(sock_err(ch.as_str()))? {
                    quiet_since = Instant::now();
                }
            }
            let left = (quiet_since + STOP_QUIET).min(stopping + STOP_BUDGET).saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            match zmq::poll(&mut items, left.as_millis() as i64 + 1) {
                Ok(_) | Err(zmq::Error::EINTR) => {}
                Err(e) => return Err(TransportError::Socket { socket: "poll", source: e }),
            }
        }
    }
}
