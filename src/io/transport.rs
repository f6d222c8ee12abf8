//! ZeroMQ transport: the only module that touches sockets.
//!
//! One thread polls the stats SUB and the route and health ROUTER sockets,
//! hands each payload to the coordinator, and sends the reply back along the
//! request's envelope. There is no routing logic here.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::io::access::{self, Allowlist};
use crate::observability::metrics::Metrics;
use crate::observability::ratelimit::LogLimiter;
use crate::routing::Coordinator;
use crate::wire::Channel;

/// Frames kept of one request's envelope and body; more is refused.
const MAX_FRAMES: usize = 8;
/// Messages taken from one socket per poll round, so no socket starves
/// another (stats included: a flood of updates delays a query by one batch).
const BATCH: usize = 256;
/// Longest poll wait, which bounds how fast a stop request is seen.
const MAX_WAIT: Duration = Duration::from_millis(50);
/// How long close waits to flush replies already queued.
const LINGER: Duration = Duration::from_millis(1000);
/// On stop, queries are answered until the query sockets have been quiet
/// this long: a query a peer sent just before may still be on its way (in
/// the peer's or the kernel's buffers), and once closed a REQ peer would
/// wait forever for its reply.
const STOP_QUIET: Duration = Duration::from_millis(100);
/// The longest that answering goes on after a stop, so peers that never
/// pause cannot hold shutdown open; with LINGER, under the 2 s promise.
const STOP_BUDGET: Duration = Duration::from_millis(500);
/// High-water marks, in messages. Stats may be dropped when dpcoord falls
/// this far behind (libzmq drops at the publisher's pipe; the gap shows in
/// `dpcoord_stats_missed_total`); a burst from every engine fits easily.
const STATS_HWM: i32 = 10_000;
/// Per peer, each way. A REQ peer has one reply outstanding, so its replies
/// are never dropped; only a DEALER with this many unread replies loses more.
const QUERY_HWM: i32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("cannot {what} the {socket} socket to {endpoint}: {source}")]
    Endpoint { what: &'static str, socket: &'static str, endpoint: String, source: zmq::Error },
    #[error("cannot start the coordinator thread: {0}")]
    Thread(std::io::Error),
    #[error("zeromq error on the {socket} socket: {source}")]
    Socket { socket: &'static str, source: zmq::Error },
}

pub struct Sockets {
    // Field order matters: sockets close before the context drops.
    /// Engine stats from publishers that connect to `stats_bind`.
    stats: zmq::Socket,
    /// Engine stats from the `stats_connect` endpoints dpcoord connects to
    /// itself. A socket of their own: the peer allowlist guards who may
    /// connect to the bind (on a shared socket libzmq would check these
    /// outgoing links against it too, and refuse engines not listed), and no
    /// libzmq size limit (a connecting socket never reconnects a link libzmq
    /// closed over an oversized frame); the coordinator drops such updates.
    links: zmq::Socket,
    route: zmq::Socket,
    health: zmq::Socket,
    /// The ZAP handler, present when some socket has a peer allowlist.
    zap: Option<(zmq::Socket, Access)>,
    _ctx: zmq::Context,
}

/// The allowlists the ZAP handler enforces, by ZAP domain.
struct Access {
    route: Allowlist,
    health: Allowlist,
    stats: Allowlist,
}

/// libzmq's fixed ZAP endpoint.
const ZAP_ENDPOINT: &str = "inproc://zeromq.zap.01";

/// Asks libzmq to consult the ZAP handler for this socket's peers.
fn guard(s: &zmq::Socket, name: &'static str, list: &Allowlist) -> Result<(), TransportError> {
    if list.is_empty() {
        return Ok(());
    }
    s.set_zap_domain(name).map_err(sock_err(name))
}

fn sock_err(socket: &'static str) -> impl Fn(zmq::Error) -> TransportError {
    move |source| TransportError::Socket { socket, source }
}

/// libzmq's own size limit (`ZMQ_MAXMSGSIZE`) on the bound sockets, far
/// above `max_message_bytes`, which dpcoord enforces itself: a frame over it
/// is a protocol error that closes the peer's link without a reply (the peer
/// reconnects by itself).
fn backstop(cfg: &Config) -> i64 {
    (cfg.settings.limits.max_message_bytes as i64).saturating_mul(16)
}

fn router(
    ctx: &zmq::Context,
    name: &'static str,
    endpoint: &str,
    allow: &Allowlist,
    cfg: &Config,
) -> Result<zmq::Socket, TransportError> {
    let s = ctx.socket(zmq::ROUTER).map_err(sock_err(name))?;
    guard(&s, name, allow)?;
    // The decoder answers `too_large`; libzmq's limit only stops abuse far above it.
    s.set_maxmsgsize(backstop(cfg)).map_err(sock_err(name))?;
    s.set_linger(LINGER.as_millis() as i32).map_err(sock_err(name))?;
    s.set_rcvhwm(QUERY_HWM).map_err(sock_err(name))?;
    s.set_sndhwm(QUERY_HWM).map_err(sock_err(name))?;
    s.set_ipv6(true).map_err(sock_err(name))?;
    s.bind(endpoint).map_err(|source| TransportError::Endpoint {
        what: "bind",
        socket: name,
        endpoint: endpoint.into(),
        source,
    })?;
    Ok(s)
}

impl Sockets {
    /// Creates and binds/connects every socket the config names.
    pub fn open(cfg: &Config) -> Result<Sockets, TransportError> {
        let ctx = zmq::Context::new();
        let srv = &cfg.server;
        let guarded = [&srv.route_allow, &srv.health_allow, &srv.stats_allow].iter().any(|l| !l.is_empty());
        let zap = match guarded {
            // The handler is bound before any guarded socket can accept a peer.
            true => {
                let z = ctx.socket(zmq::REP).map_err(sock_err("zap"))?;
                z.bind(ZAP_ENDPOINT).map_err(|source| TransportError::Endpoint {
                    what: "bind",
                    socket: "zap",
                    endpoint: ZAP_ENDPOINT.into(),
                    source,
                })?;
                let access = Access {
                    route: srv.route_allow.clone(),
                    health: srv.health_allow.clone(),
                    stats: srv.stats_allow.clone(),
                };
                Some((z, access))
            }
            false => None,
        };
        let stats = subscriber(&ctx)?;
        guard(&stats, "stats", &srv.stats_allow)?;
        // The coordinator drops (and counts) an update above max_message_bytes.
        stats.set_maxmsgsize(backstop(cfg)).map_err(sock_err("stats"))?;
        if let Some(ep) = &cfg.server.stats_bind {
            stats.bind(ep).map_err(|source| TransportError::Endpoint {
                what: "bind",
                socket: "stats",
                endpoint: ep.clone(),
                source,
            })?;
        }
        let links = subscriber(&ctx)?;
        for ep in &cfg.server.stats_connect {
            links.connect(ep).map_err(|source| TransportError::Endpoint {
                what: "connect",
                socket: "stats",
                endpoint: ep.clone(),
                source,
            })?;
        }
        let route = router(&ctx, "route", &srv.route_bind, &srv.route_allow, cfg)?;
        let health = router(&ctx, "health", &srv.health_bind, &srv.health_allow, cfg)?;
        Ok(Sockets { stats, links, route, health, zap, _ctx: ctx })
    }
}

/// A stats SUB socket subscribed to everything.
fn subscriber(ctx: &zmq::Context) -> Result<zmq::Socket, TransportError> {
    let s = ctx.socket(zmq::SUB).map_err(sock_err("stats"))?;
    s.set_subscribe(b"").map_err(sock_err("stats"))?;
    s.set_linger(0).map_err(sock_err("stats"))?;
    s.set_rcvhwm(STATS_HWM).map_err(sock_err("stats"))?;
    s.set_ipv6(true).map_err(sock_err("stats"))?;
    Ok(s)
}

/// Reusable frames of one multipart request.
struct Frames {
    frames: Vec<zmq::Message>,
    len: usize,
    overflow: bool,
    reply: Vec<u8>,
}

impl Frames {
    fn new() -> Self {
        Frames {
            frames: (0..MAX_FRAMES).map(|_| zmq::Message::new()).collect(),
            len: 0,
            overflow: false,
            reply: Vec::with_capacity(4096),
        }
    }

    /// Receives one whole multipart message; `false` when none is waiting.
    fn recv(&mut self, s: &zmq::Socket) -> Result<bool, zmq::Error> {
        self.len = 0;
        self.overflow = false;
        let mut scratch = zmq::Message::new();
        loop {
            let flags = if self.len == 0 { zmq::DONTWAIT } else { 0 };
            let msg = if self.len < MAX_FRAMES { &mut self.frames[self.len] } else { &mut scratch };
            match s.recv(msg, flags) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) if self.len == 0 => return Ok(false),
                Err(e) => return Err(e),
            }
            let more = msg.get_more();
            if self.len < MAX_FRAMES {
                self.len += 1;
            } else {
                self.overflow = true;
            }
            if !more {
                return Ok(true);
            }
        }
    }

    /// Splits at the first empty frame after the identity (REQ, or DEALER
    /// with a delimiter); without one, the envelope is the identity alone.
    fn split(&self) -> (usize, &[zmq::Message]) {
        let got = &self.frames[..self.len];
        let env = got.iter().skip(1).position(|f| f.is_empty()).map_or(1, |i| i + 2);
        (env.min(got.len()), &got[env.min(got.len())..])
    }
}

fn serve_one(s: &zmq::Socket, ch: Channel, f: &mut Frames, coord: &mut Coordinator) -> Result<bool, zmq::Error> {
    if !f.recv(s)? {
        return Ok(false);
    }
    let now = Instant::now();
    let mut reply = std::mem::take(&mut f.reply);
    let (env, body) = f.split();
    match body {
        [payload] if !f.overflow => coord.on_query(ch, payload, now, &mut reply),
        _ => coord.on_bad_frames(ch, body.len(), now, &mut reply),
    }
    for frame in &f.frames[..env] {
        s.send(&frame[..], zmq::SNDMORE | zmq::DONTWAIT)?;
    }
    if let Err(e) = s.send(&reply[..], zmq::DONTWAIT) {
        // ROUTER drops replies to peers that are gone or not reading.
        tracing::debug!(channel = ch.as_str(), error = %e, "reply not sent");
    }
    f.reply = reply;
    Ok(true)
}

/// Reads stats until EAGAIN; `true` when the batch limit stopped it first.
fn drain_stats(s: &zmq::Socket, msg: &mut zmq::Message, coord: &mut Coordinator) -> Result<bool, zmq::Error> {
    for _ in 0..BATCH {
        match s.recv(msg, zmq::DONTWAIT) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return Ok(false),
            Err(e) => return Err(e),
        }
        let now = Instant::now();
        if msg.get_more() {
            // A multipart update breaks the one-frame rule: drop all its frames.
            while msg.get_more() {
                s.recv(msg, 0)?;
            }
            coord.on_stats(b"", now);
        } else {
            coord.on_stats(msg, now);
        }
    }
    Ok(true)
}

/// Answers queries until EAGAIN; `true` when `limit` stopped it first.
fn drain_queries(
    s: &zmq::Socket,
    ch: Channel,
    f: &mut Frames,
    coord: &mut Coordinator,
    limit: usize,
) -> Result<bool, TransportError> {
    let name = ch.as_str();
    for _ in 0..limit {
        if !serve_one(s, ch, f, coord).map_err(sock_err(name))? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Answers one ZAP request: admit the peer if its socket's allowlist has its address.
fn answer_zap(
    zap: &zmq::Socket,
    access: &Access,
    metrics: &Metrics,
    log: &mut LogLimiter<3>,
) -> Result<(), zmq::Error> {
    let frames = zap.recv_multipart(zmq::DONTWAIT)?;
    let Some(req) = access::parse_request(&frames) else {
        // Not a ZAP request: REP still owes a reply to stay usable.
        return zap.send("", 0);
    };
    let (list, cause) = match req.domain {
        "route" => (&access.route, 0),
        "health" => (&access.health, 1),
        _ => (&access.stats, 2),
    };
    let allowed = list.allows(req.address);
    if !allowed {
        metrics.access_denied(req.domain);
        // A refused peer reconnects on its own, so this can repeat quickly.
        if let Some(suppressed) = log.allow(cause, Instant::now()) {
            tracing::warn!(
                socket = req.domain,
                peer = req.address,
                suppressed,
                "connection refused: peer not in the allowlist"
            );
        }
    }
    zap.send_multipart(access::reply(req.request_id, allowed), 0)
}

/// Answers ZAP requests until EAGAIN; `true` when the batch limit stopped it first.
fn drain_zap(
    zap: &zmq::Socket,
    access: &Access,
    metrics: &Metrics,
    log: &mut LogLimiter<3>,
) -> Result<bool, zmq::Error> {
    for _ in 0..BATCH {
        match answer_zap(zap, access, metrics, log) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Serves until `stop` is set, then answers the queries still arriving.
///
/// The wait polls each socket's `ZMQ_FD`, not the socket: `zmq_poll` on
/// sockets asks every socket for `ZMQ_EVENTS` before and after waiting, and
/// each ask is a poll(2) on that socket's command mailbox (3.1 poll(2) calls
/// per query under the transport benchmark; 2.0 this way). A `ZMQ_FD` only
/// signals a change, so every socket is read until EAGAIN, which leaves it
/// armed to signal the next message; a socket its batch limit stopped early
/// is served again without waiting.
pub fn serve(sockets: Sockets, coord: &mut Coordinator, stop: &AtomicBool) -> Result<(), TransportError> {
    let Sockets { stats, links, route, health, zap, _ctx } = &sockets;
    let mut frames = Frames::new();
    let mut stats_msg = zmq::Message::new();
    let polled = [(stats, "stats"), (route, "route"), (health, "health"), (links, "stats")];
    let mut items = Vec::with_capacity(5);
    for (s, name) in polled.into_iter().chain(zap.as_ref().map(|(z, _)| (z, "zap"))) {
        items.push(zmq::PollItem::from_fd(s.get_fd().map_err(sock_err(name))?, zmq::POLLIN));
    }
    // Every socket is read once before the first wait, which arms its ZMQ_FD.
    let mut unfinished = [true, true, true, true, zap.is_some()];
    let mut zap_log = LogLimiter::<3>::default();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= coord.next_tick() {
            coord.tick(now);
        }
        let wait = match unfinished.contains(&true) {
            true => 0,
            false => coord.next_tick().saturating_duration_since(now).min(MAX_WAIT).as_millis() as i64 + 1,
        };
        let signalled = match zmq::poll(&mut items, wait) {
            Ok(n) => n > 0,
            Err(zmq::Error::EINTR) => true,
            Err(e) => return Err(TransportError::Socket { socket: "poll", source: e }),
        };
        // A wait that timed out reads every socket anyway: should an edge of
        // a ZMQ_FD ever be missed, the socket stalls for one wait, not forever.
        let timed_out = wait > 0 && !signalled;
        let ready: [bool; 5] = std::array::from_fn(|i| {
            unfinished[i] || timed_out && i < items.len() || items.get(i).is_some_and(|p| p.is_readable())
        });
        if let (true, Some((z, access))) = (ready[4], zap) {
            unfinished[4] = drain_zap(z, access, coord.metrics(), &mut zap_log).map_err(sock_err("zap"))?;
        }
        for (i, s) in [(0, stats), (3, links)] {
            if ready[i] {
                unfinished[i] = drain_stats(s, &mut stats_msg, coord).map_err(sock_err("stats"))?;
            }
        }
        if ready[1] {
            unfinished[1] = drain_queries(route, Channel::Route, &mut frames, coord, BATCH)?;
        }
        if ready[2] {
            unfinished[2] = drain_queries(health, Channel::Health, &mut frames, coord, BATCH)?;
        }
    }
    // Answer what is queued and what is still on its way (sent before the
    // stop, not arrived yet): serve until both query sockets have been quiet
    // for STOP_QUIET, or for STOP_BUDGET at most; then close (linger flushes).
    let stopping = Instant::now();
    let mut quiet_since = stopping;
    let mut items = [route.as_poll_item(zmq::POLLIN), health.as_poll_item(zmq::POLLIN)];
    loop {
        for (s, ch) in [(route, Channel::Route), (health, Channel::Health)] {
            while serve_one(s, ch, &mut frames, coord).map_err(sock_err(ch.as_str()))? {
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
