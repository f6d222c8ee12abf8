//! The ZAP handler: answers libzmq's questions about every new peer of the
//! bound sockets, from the allowlists and peer caps in force (a reload may
//! change them; the decisions themselves are in `access` and `peers`). An
//! empty allowlist admits everyone; an ipc socket holding its cap admits
//! nobody new. The caps on TCP peers are enforced when a connection is
//! accepted (`peers`), and the monitors that count connections are read
//! here too: the [`Gate`] holds both.

use std::time::Instant;

use super::access::{self, Verdict};
use super::fds::Budget;
use super::peer_sources::Source;
use super::peers::{Monitor, Peers};
use crate::observability::ratelimit::LogLimiter;
use crate::routing::Coordinator;

/// ZAP requests answered per poll round.
const BATCH: usize = 256;

/// What the ZAP handler decides with besides the coordinator's settings:
/// the connected peers of each bound socket, and its log's rate limit.
pub struct Gate<'a> {
    pub peers: Peers,
    pub monitors: &'a [Monitor],
    /// The descriptor budget, which may hold each socket below its cap.
    fds: Budget,
    /// Allowlist refusals, per socket.
    log: LogLimiter<3>,
}

impl<'a> Gate<'a> {
    pub fn new(peers: Peers, monitors: &'a [Monitor], fds: Budget) -> Gate<'a> {
        Gate { peers, monitors, fds, log: LogLimiter::default() }
    }

    /// The caps in force for `domain`'s socket: its `*_max_peers` within
    /// its share of the descriptors, and `max_peers_per_address`.
    fn caps(&self, domain: &str, coord: &Coordinator) -> Option<(u32, u32)> {
        coord.peer_cap(domain).map(|(cap, per)| (self.fds.peer_cap(domain, cap), per))
    }

    /// Reads monitor `i`'s events, closing TCP connections accepted beyond
    /// the caps; `true` when the batch limit stopped it first.
    pub fn count(&mut self, i: usize, coord: &Coordinator) -> Result<bool, zmq::Error> {
        let caps = self.caps(self.monitors[i].name, coord);
        self.peers.drain(i, &self.monitors[i].socket, caps)
    }

    /// Reads `domain`'s monitor to the end, so the peer asking now is
    /// counted, and a TCP peer beyond the caps already closed: libzmq
    /// reports a connection (`ACCEPTED`) before its handshake can begin, so
    /// once its ZAP request is here, its event is in the monitor, even when
    /// it came after this round's read of the monitors. Then whether an ipc
    /// peer (`tcp` false) takes the socket over its cap.
    fn settle_over_cap(&mut self, domain: &str, tcp: bool, coord: &Coordinator) -> Result<bool, zmq::Error> {
        let Some(i) = self.peers.index(domain) else { return Ok(false) };
        while self.count(i, coord)? {}
        match self.caps(domain, coord) {
            Some((cap, _)) if !tcp => Ok(self.peers.refuse_ipc(i, cap)),
            _ => Ok(false),
        }
    }
}

/// Answers one ZAP request: admit the peer if its socket's allowlist has
/// its address and, for an ipc peer, the socket holds no more than its cap.
fn answer(zap: &zmq::Socket, coord: &Coordinator, gate: &mut Gate<'_>) -> Result<(), zmq::Error> {
    let frames = zap.recv_multipart(zmq::DONTWAIT)?;
    let Some(req) = access::parse_request(&frames) else {
        // Not a ZAP request: REP still owes a reply to stay usable.
        return zap.send("", 0);
    };
    let socket = match req.domain {
        "route" => 0,
        "health" => 1,
        _ => 2,
    };
    let listed = coord.allowlist(req.domain).is_none_or(|list| list.is_empty() || list.allows(req.address));
    // TCP peers beyond the caps are closed when accepted (`io::peers`;
    // its answer then never reaches one); an ipc peer has no address and is
    // held to the socket's cap here.
    let tcp = Source::parse(req.address).is_some();
    let verdict = if !listed {
        coord.metrics().access_denied(req.domain);
        Verdict::NotAllowed
    } else if gate.settle_over_cap(req.domain, tcp, coord)? {
        Verdict::Full
    } else {
        Verdict::Admit
    };
    // A refused peer may reconnect on its own, so this can repeat quickly.
    if verdict == Verdict::NotAllowed {
        if let Some(suppressed) = gate.log.allow(socket, Instant::now()) {
            tracing::warn!(
                socket = req.domain,
                peer = req.address,
                suppressed,
                "connection refused: peer not in the allowlist"
            );
        }
    }
    zap.send_multipart(access::reply(req.request_id, verdict), 0)
}

/// Answers ZAP requests until EAGAIN; `true` when the batch limit stopped it first.
pub fn drain(zap: &zmq::Socket, coord: &Coordinator, gate: &mut Gate<'_>) -> Result<bool, zmq::Error> {
    for _ in 0..BATCH {
        match answer(zap, coord, gate) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}
