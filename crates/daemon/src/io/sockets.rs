//! Opening dpcoord's ZeroMQ sockets: the engine sources (the scraper's
//! in-process PULL among them), the route and health ROUTERs, and the ZAP
//! handler behind peer allowlists and caps, with the monitors that count peers.

pub use super::error::TransportError;
use super::error::{endpoint_err, sock_err};
use super::frames::{MAX_ENVELOPE_FRAMES, MAX_ENVELOPE_FRAME_BYTES};
use super::links::{self, Link};
use super::peers::{self, Monitor};
use super::scrape;
use super::source::Source;
use crate::config::budget::{KV_LINK_BYTES, SOURCE_LINK_BYTES};
use crate::config::keys::{self, Key};
use crate::config::{Config, Server};
use crate::wire::{Channel, SourceKind, SourceLimits};

/// How long close waits to flush replies already queued.
const LINGER_MS: i32 = 1000;
/// The most messages a source connection queues, whatever their size.
/// Source messages may be dropped when dpcoord falls this far behind
/// (libzmq drops at the publisher's pipe; the gap shows in
/// `dpcoord_stats_missed_total`); a burst from every engine fits easily.
const SOURCE_HWM: usize = 10_000;
/// The most KV event batches a KV connection queues, whatever their size.
const KV_HWM: usize = 1000;
/// A stats or SGLang load source's queue: [`SOURCE_LINK_BYTES`] over the
/// largest frame, within [`MIN_SOURCE_HWM`]..=[`SOURCE_HWM`] messages.
const MIN_SOURCE_HWM: usize = 4;
/// The same for one KV publisher's SUB and for its replay DEALER
/// ([`KV_LINK_BYTES`]), up to [`KV_HWM`].
const MIN_KV_HWM: usize = 1;
/// libzmq's high-water marks count messages, not bytes; dpcoord derives
/// them from byte budgets and the largest message a queue can hold, within
/// these bounds (a mark of 0 would mean no limit).
const MIN_HWM: usize = 1;
const MAX_QUERY_HWM: usize = 1000;
/// Bytes of replies queued for one peer of the route or health socket: a
/// peer that never reads costs at most this (plus the kernel's socket buffers).
pub const PEER_REPLY_BYTES: usize = 2 << 20;
/// Bytes of messages one peer of a bound socket may have queued for dpcoord
/// to read. A full queue stops libzmq reading that peer's connection (the
/// peer waits, nothing is lost), so this bounds memory, not traffic.
pub const PEER_INBOUND_BYTES: usize = 8 << 20;
/// The least a full inbound queue holds, whatever the message size.
const MIN_INBOUND_HWM: usize = 16;
/// What libzmq keeps per queued frame beyond its bytes (the message in the
/// pipe and the header of its heap buffer), rounded up.
const FRAME_OVERHEAD: usize = 128;
/// What a reply's echoed envelope and delimiter add at most, with overheads.
const ENVELOPE_ALLOWANCE: usize =
    MAX_ENVELOPE_FRAMES * (MAX_ENVELOPE_FRAME_BYTES + FRAME_OVERHEAD) + 2 * FRAME_OVERHEAD;
/// How far above `max_message_bytes` libzmq itself still reads a frame
/// (so a query a little too large is answered `too_large`).
const BACKSTOP_SLACK: i64 = 64 << 10;
/// How long a peer of a bound socket has to finish its ZMTP handshake
/// (libzmq's default is 30 s). A connection that never greets holds a peer
/// slot and about 32 KB until then; a real peer greets within milliseconds.
pub const HANDSHAKE_MS: i32 = 5000;
/// Connections the kernel may queue for libzmq to accept (libzmq's default
/// is 100; the kernel caps it at `net.core.somaxconn`, 4096 by default).
/// Under a burst of connections, a full queue drops new SYNs and every
/// newcomer, a frontend too, waits out a retransmission (a second or more).
const BACKLOG: i32 = 1024;
/// libzmq's fixed ZAP endpoint.
const ZAP_ENDPOINT: &str = "inproc://zeromq.zap.01";

/// Where the route socket also listens in-process, when [`Local::route`].
pub const LOCAL_ROUTE: &str = "inproc://dpcoord-route";
/// Where the health socket also listens in-process, when [`Local::health`].
pub const LOCAL_HEALTH: &str = "inproc://dpcoord-health";

/// The in-process endpoints a frontend in the same process asks for: its
/// queries then arrive on the same sockets as every peer's, answered alike.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Local {
    /// The route socket on [`LOCAL_ROUTE`].
    pub route: bool,
    /// The health socket on [`LOCAL_HEALTH`].
    pub health: bool,
}

pub struct Sockets {
    // Field order matters: sockets close before the context drops.
    /// Engine sources, in the order they are served.
    pub sources: Vec<Source>,
    pub route: zmq::Socket,
    pub health: zmq::Socket,
    /// The ZAP handler, asked about every new peer of the bound sockets.
    pub zap: zmq::Socket,
    /// The connection events of each bound socket (route, health, stats bind).
    pub monitors: Vec<Monitor>,
    /// The link of each source dpcoord connects to, with its events.
    pub links: Vec<Link>,
    ctx: zmq::Context,
}

/// The send high-water mark of a query socket whose largest reply is
/// `max_reply` bytes: [`PEER_REPLY_BYTES`] divided by the largest message
/// (reply, echoed envelope, overheads), within 1..=1000.
pub fn reply_hwm(max_reply: usize) -> i32 {
    let message = max_reply + ENVELOPE_ALLOWANCE + FRAME_OVERHEAD;
    (PEER_REPLY_BYTES / message).clamp(MIN_HWM, MAX_QUERY_HWM) as i32
}

/// How many replies a query socket queues for one peer (its send
/// high-water mark): beyond it libzmq drops them, so a peer with more
/// queries in flight than this can lose answers.
pub fn reply_queue(ch: Channel, cfg: &Config) -> i32 {
    let lim = &cfg.settings.limits;
    reply_hwm(crate::wire::max_reply_bytes(ch, cfg.settings.engines.dp_ceiling(), lim.max_batch))
}

/// A receive high-water mark from a byte budget: `budget` over `limit`,
/// the largest frame libzmq lets in, within `least..=most`. Bound sockets
/// use [`PEER_INBOUND_BYTES`] per peer, connecting sources their own.
fn bytes_hwm(budget: usize, limit: i64, least: usize, most: usize) -> i32 {
    (budget / limit.max(1) as usize).clamp(least, most) as i32
}

/// libzmq's size limit per frame for messages whose own limit (dpcoord's
/// check) is `own` bytes: 64 KiB more, so a message a little too large is
/// still read and refused by dpcoord (answered `too_large`, or counted with
/// a source's link kept); a frame above it is a protocol error that closes
/// the connection without a reply. A peer of a bound socket reconnects by
/// itself; a link dpcoord connects to is connected again by `io::links`.
fn frame_limit(own: usize) -> i64 {
    (own as i64).saturating_add(BACKSTOP_SLACK)
}

/// Asks libzmq to consult the ZAP handler for this bound socket's peers.
/// Every bound socket has a domain, so that a reload can set an allowlist
/// that was empty at start (it applies to connections made after it).
/// Also sets the handshake deadline and the listen backlog every bound
/// socket shares.
fn guard(s: &zmq::Socket, name: &'static str) -> Result<(), TransportError> {
    s.set_handshake_ivl(HANDSHAKE_MS).map_err(sock_err(name))?;
    s.set_backlog(BACKLOG).map_err(sock_err(name))?;
    s.set_zap_domain(name).map_err(sock_err(name))
}

/// libzmq's own size limit (`ZMQ_MAXMSGSIZE`, per frame) on the bound
/// sockets ([`frame_limit`] of `max_message_bytes`): it bounds what dpcoord reads.
fn backstop(cfg: &Config) -> i64 {
    frame_limit(cfg.settings.limits.max_message_bytes)
}

fn router(ctx: &zmq::Context, ch: Channel, ep: &str, cfg: &Config) -> Result<(zmq::Socket, Monitor), TransportError> {
    let name = ch.as_str();
    let s = ctx.socket(zmq::ROUTER).map_err(sock_err(name))?;
    guard(&s, name)?;
    let monitor = peers::watch(ctx, &s, name)?;
    // The decoder answers `too_large`; libzmq's limit stops what is far above it.
    s.set_maxmsgsize(backstop(cfg)).map_err(sock_err(name))?;
    s.set_linger(LINGER_MS).map_err(sock_err(name))?;
    s.set_rcvhwm(bytes_hwm(PEER_INBOUND_BYTES, backstop(cfg), MIN_INBOUND_HWM, MAX_QUERY_HWM))
        .map_err(sock_err(name))?;
    s.set_sndhwm(reply_queue(ch, cfg)).map_err(sock_err(name))?;
    s.set_ipv6(true).map_err(sock_err(name))?;
    let key = match ch {
        Channel::Route => &keys::ROUTE_BIND.key,
        Channel::Health => &keys::HEALTH_BIND.key,
    };
    s.bind(ep).map_err(endpoint_err("bind", name, Some(key), ep))?;
    crate::io::ipc::set_mode(&s, cfg.server.ipc_mode)?;
    Ok((s, monitor))
}

/// How a source's socket meets its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reach {
    /// Bound at its endpoint: peers under the socket's allowlist and caps
    /// (ZAP), counted by a monitor, libzmq's size backstop per frame.
    Bind,
    /// Connected to each endpoint, a socket each, its link watched and
    /// connected again should libzmq close it for good (`io::links`).
    Connect,
    /// Bound in-process and fed by dpcoord's own threads (the scraper).
    Inproc,
}

/// What a source's socket may queue: `bytes` over the largest frame
/// libzmq lets in, within `least..=most` messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Queue {
    bytes: usize,
    least: usize,
    most: usize,
}

/// One kind of engine source socket, described once: the key that names
/// its endpoints, its ZeroMQ type and reach, the kind of source behind
/// each endpoint (which fixes its framing and decoder, `wire::decode_source`),
/// its topic, its size limit and queue, and which thread decodes it. A new
/// source is a row here, its `SourceKind` and decoder in `wire`, and its key.
struct Row {
    key: &'static Key,
    socket: zmq::SocketType,
    reach: Reach,
    /// Its endpoints, each with the kind of source behind it.
    endpoints: fn(&Server) -> Vec<(SourceKind, &str)>,
    /// The topic prefix a SUB subscribes to.
    topic: fn(&Server) -> &[u8],
    /// The largest message dpcoord reads from it (libzmq's own limit is
    /// [`frame_limit`] of it).
    limit: fn(&Config) -> usize,
    queue: Queue,
    /// Decoded on the KV decoder's thread, off the routing thread.
    off_thread: bool,
}

/// A connection to a stats or SGLang load source.
const SOURCE_LINK: Queue = Queue { bytes: SOURCE_LINK_BYTES as usize, least: MIN_SOURCE_HWM, most: SOURCE_HWM };
/// A KV publisher's SUB, or its replay DEALER.
const KV_LINK: Queue = Queue { bytes: KV_LINK_BYTES as usize, least: MIN_KV_HWM, most: KV_HWM };

/// The engine sources, in the order the transport serves them.
const SOURCES: [Row; 6] = [
    Row {
        key: &keys::STATS_BIND.key,
        socket: zmq::SUB,
        reach: Reach::Bind,
        endpoints: stats_bind,
        topic: everything,
        limit: max_message,
        queue: Queue { bytes: PEER_INBOUND_BYTES, least: MIN_INBOUND_HWM, most: SOURCE_HWM },
        off_thread: false,
    },
    Row {
        key: &keys::STATS_CONNECT.key,
        socket: zmq::SUB,
        reach: Reach::Connect,
        endpoints: stats_connect,
        topic: everything,
        limit: max_message,
        queue: SOURCE_LINK,
        off_thread: false,
    },
    Row {
        key: &keys::SGLANG_LOAD_CONNECT.key,
        socket: zmq::SUB,
        reach: Reach::Connect,
        endpoints: sglang_load,
        topic: everything,
        limit: max_message,
        queue: SOURCE_LINK,
        off_thread: false,
    },
    Row {
        key: &keys::VLLM_METRICS_URL.key,
        socket: zmq::PULL,
        reach: Reach::Inproc,
        endpoints: vllm_metrics,
        topic: everything,
        limit: scraped_gauges,
        // One body per scraper pipe: a newer one waits for the last to be read.
        queue: Queue { bytes: 0, least: 1, most: 1 },
        off_thread: false,
    },
    Row {
        key: &keys::KV_CONNECT.key,
        socket: zmq::SUB,
        reach: Reach::Connect,
        endpoints: kv_events,
        topic: kv_topic,
        limit: kv_batch,
        queue: KV_LINK,
        off_thread: true,
    },
    Row {
        key: &keys::KV_REPLAY.key,
        socket: zmq::DEALER,
        reach: Reach::Connect,
        endpoints: kv_replay,
        topic: everything,
        limit: kv_batch,
        queue: KV_LINK,
        off_thread: true,
    },
];

fn stats_bind(srv: &Server) -> Vec<(SourceKind, &str)> {
    srv.stats_bind.iter().map(|ep| (SourceKind::Stats, ep.as_str())).collect()
}

/// An engine's stats PUB speaks for any rank.
fn stats_connect(srv: &Server) -> Vec<(SourceKind, &str)> {
    srv.stats_connect.iter().map(|ep| (SourceKind::Stats, ep.as_str())).collect()
}

/// The i-th SGLang load PUB speaks for rank i only.
fn sglang_load(srv: &Server) -> Vec<(SourceKind, &str)> {
    let each = srv.sglang_load_connect.iter().enumerate();
    each.map(|(i, ep)| (SourceKind::SglangLoad { rank: i as u32 }, ep.as_str())).collect()
}

/// One PULL for every scraped URL: the scraper's threads push to it.
fn vllm_metrics(srv: &Server) -> Vec<(SourceKind, &str)> {
    let kind = SourceKind::VllmMetrics { interval: srv.vllm_metrics_interval };
    (!srv.vllm_metrics_url.is_empty()).then_some((kind, scrape::ENDPOINT)).into_iter().collect()
}

/// Per KV publisher (one rank each) its own SUB, so that its `seq` is
/// known to be its own; the config allows at most 65535 publishers.
fn kv_events(srv: &Server) -> Vec<(SourceKind, &str)> {
    let each = srv.kv_events.iter().enumerate();
    each.map(|(i, ep)| (SourceKind::KvEvents { stream: i as u16, replay: false }, ep.connect.as_str())).collect()
}

/// A DEALER to each KV publisher's replay socket, for those that have one.
fn kv_replay(srv: &Server) -> Vec<(SourceKind, &str)> {
    let each = srv.kv_events.iter().enumerate();
    let replay = each.filter_map(|(i, ep)| Some((i as u16, ep.replay.as_deref()?)));
    replay.map(|(stream, ep)| (SourceKind::KvEvents { stream, replay: true }, ep)).collect()
}

fn everything(_: &Server) -> &[u8] {
    b""
}

fn kv_topic(srv: &Server) -> &[u8] {
    srv.kv_topic.as_bytes()
}

fn max_message(cfg: &Config) -> usize {
    cfg.settings.limits.max_message_bytes
}

fn kv_batch(cfg: &Config) -> usize {
    cfg.settings.kv.max_batch_bytes
}

/// The scraper's fixed message size: the source takes no configured limit,
/// so none is passed.
fn scraped_gauges(cfg: &Config) -> usize {
    SourceKind::VllmMetrics { interval: cfg.server.vllm_metrics_interval }.max_bytes(&SourceLimits::NONE)
}

/// Where the sources go, and the links of those that connect.
struct Opened {
    sources: Vec<Source>,
    links: Vec<Link>,
}

/// Opens a row's socket for one endpoint: bound, connected (its link
/// watched) or bound in-process. Connecting sockets are never shared with
/// a bound one: there libzmq would check dpcoord's own outgoing links
/// against the allowlist too.
fn open(
    ctx: &zmq::Context,
    cfg: &Config,
    row: &Row,
    (kind, ep): (SourceKind, &str),
    out: &mut Opened,
    monitors: &mut Vec<Monitor>,
) -> Result<(), TransportError> {
    let name = kind.as_str();
    let s = ctx.socket(row.socket).map_err(sock_err(name))?;
    if row.socket == zmq::SUB {
        s.set_subscribe((row.topic)(&cfg.server)).map_err(sock_err(name))?;
    }
    s.set_linger(0).map_err(sock_err(name))?;
    let limit = frame_limit((row.limit)(cfg));
    let Queue { bytes, least, most } = row.queue;
    s.set_rcvhwm(bytes_hwm(bytes, limit, least, most)).map_err(sock_err(name))?;
    match row.reach {
        Reach::Bind => {
            guard(&s, name)?;
            monitors.push(peers::watch(ctx, &s, name)?);
            s.set_maxmsgsize(limit).map_err(sock_err(name))?;
            s.set_ipv6(true).map_err(sock_err(name))?;
            s.bind(ep).map_err(endpoint_err("bind", name, Some(row.key), ep))?;
            crate::io::ipc::set_mode(&s, cfg.server.ipc_mode)?;
        }
        Reach::Connect => {
            s.set_maxmsgsize(limit).map_err(sock_err(name))?;
            s.set_ipv6(true).map_err(sock_err(name))?;
            out.links.push(links::connect(ctx, &s, out.sources.len(), kind, row.key, ep)?);
        }
        Reach::Inproc => s.bind(ep).map_err(endpoint_err("bind", name, None, ep))?,
    }
    out.sources.push(Source { socket: s, kind, off_thread: row.off_thread });
    Ok(())
}

/// Every engine source the config names, row by row ([`SOURCES`]).
fn sources(ctx: &zmq::Context, cfg: &Config, monitors: &mut Vec<Monitor>) -> Result<Opened, TransportError> {
    let mut out = Opened { sources: Vec::new(), links: Vec::new() };
    for row in &SOURCES {
        for endpoint in (row.endpoints)(&cfg.server) {
            open(ctx, cfg, row, endpoint, &mut out, monitors)?;
        }
    }
    Ok(out)
}

impl Sockets {
    /// Creates and binds/connects every socket the config names, and the
    /// in-process endpoints `local` asks for.
    pub fn open(cfg: &Config, local: Local) -> Result<Sockets, TransportError> {
        let ctx = zmq::Context::new();
        let srv = &cfg.server;
        // The handler is bound before any socket can accept a peer.
        let zap = ctx.socket(zmq::REP).map_err(sock_err("zap"))?;
        zap.bind(ZAP_ENDPOINT).map_err(endpoint_err("bind", "zap", None, ZAP_ENDPOINT))?;
        let mut monitors = Vec::with_capacity(3);
        let Opened { sources, links } = sources(&ctx, cfg, &mut monitors)?;
        let (route, route_peers) = router(&ctx, Channel::Route, &srv.route_bind, cfg)?;
        let (health, health_peers) = router(&ctx, Channel::Health, &srv.health_bind, cfg)?;
        for (on, socket, what, ep) in
            [(local.route, &route, "route", LOCAL_ROUTE), (local.health, &health, "health", LOCAL_HEALTH)]
        {
            if on {
                socket.bind(ep).map_err(endpoint_err("bind", what, None, ep))?;
            }
        }
        monitors.extend([route_peers, health_peers]);
        Ok(Sockets { sources, route, health, zap, monitors, links, ctx })
    }

    /// The sockets' context, for in-process peers (the scraper, a
    /// frontend on [`Local`]'s endpoints).
    pub fn context(&self) -> zmq::Context {
        self.ctx.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::max_reply_bytes;

    #[test]
    fn reply_marks_follow_the_largest_reply_of_the_limits_in_force() {
        let mark = |dp, batch| reply_hwm(max_reply_bytes(Channel::Route, dp, batch));
        assert_eq!([mark(8, 1024), mark(16, 1024), mark(256, 1024), mark(1024, 1024)], [338, 241, 25, 6]);
        assert_eq!(mark(4096, 1024), 1);
        assert_eq!(reply_hwm(0), 608, "a 2 MiB budget over the envelope allowance alone");
        assert_eq!(reply_hwm(64 << 20), 1, "one reply, whatever its size");
    }

    /// The marks come from `engines.max_dp_size` when it is set, so a
    /// resize up to it never makes a full queue larger than 2 MiB.
    #[test]
    fn reply_marks_are_sized_for_the_ceiling_of_the_start() {
        let mut cfg = crate::config::Config::default();
        cfg.settings.engines.max_dp_size = Some(256);
        let dp = cfg.settings.engines.dp_ceiling();
        assert_eq!(dp, 256);
        assert_eq!(reply_hwm(max_reply_bytes(Channel::Route, dp, cfg.settings.limits.max_batch)), 25);
    }

    #[test]
    fn inbound_marks_follow_the_backstop() {
        let inbound = |max: usize, most| bytes_hwm(PEER_INBOUND_BYTES, frame_limit(max), MIN_INBOUND_HWM, most);
        assert_eq!(inbound(65_536, MAX_QUERY_HWM), 64);
        assert_eq!(inbound(16 << 20, MAX_QUERY_HWM), 16);
        assert_eq!(inbound(256, 10_000), 127);
    }

    #[test]
    fn source_link_marks_follow_the_sources_own_limits() {
        let stats = |max: usize| bytes_hwm(SOURCE_LINK_BYTES as usize, frame_limit(max), MIN_SOURCE_HWM, SOURCE_HWM);
        assert_eq!([stats(65_536), stats(256), stats(16 << 20)], [16, 31, 4], "default, least, most");
        let kv = |max: usize| bytes_hwm(KV_LINK_BYTES as usize, frame_limit(max), MIN_KV_HWM, KV_HWM);
        assert_eq!([kv(4 << 20), kv(64 << 10), kv(1024), kv(1 << 28)], [1, 64, 126, 1], "default, small, least, most");
        assert_eq!(frame_limit(4 << 20), (4 << 20) + 65_536);
    }
}
