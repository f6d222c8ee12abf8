//! The ZAP handler: answers libzmq's questions about every new peer of the
//! bound sockets, from the allowlists and peer caps in force (a reload may
//! change them; the decisions themselves are in `access` and `peers`). An
//! empty allowlist admits everyone; a socket holding its cap admits nobody new,
//! and an address holding its per-address cap on a socket admits no more there.

use std::time::Instant;

use super::access::{self, Verdict};
use super::fds::Budget;
use super::peer_sources::Source;
use super::peers::{Monitor, Peers, Refusal};
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
    /// Per socket, allowlist refusals (0..3) and cap refusals (3..6).
    log: LogLimiter<6>,
}

impl<'a> Gate<'a> {
    pub fn new(peers: Peers, monitors: &'a [Monitor]) -> Gate<'a> {
        Gate { peers, monitors, fds: Budget::current(), log: LogLimiter::default() }
    }

    /// Reads monitor `i`'s events; `true` when the batch limit stopped it first.
    pub fn count(&mut self, i: usize) -> Result<bool, zmq::Error> {
        self.peers.drain(i, &self.monitors[i].socket)
    }

    /// Whether the peer asking now, from `source`, takes `domain`'s socket
    /// over its cap or its source over the per-address cap, and which.
    /// libzmq reports a connection (`ACCEPTED`) before its handshake can
    /// begin, so once its ZAP request is here, its event is in the monitor:
    /// reading the monitor now counts it, even when the event came after
    /// this round's read of the monitors.
    fn over_cap(
        &mut self,
        domain: &str,
        source: Option<Source>,
        caps: Option<(u32, u32)>,
    ) -> Result<Option<Refusal>, zmq::Error> {
        let (Some((cap, per_source)), Some(i)) = (caps, self.peers.index(domain)) else { return Ok(None) };
        while self.count(i)? {}
        Ok(self.peers.refuse(domain, source, self.fds.peer_cap(domain, cap), per_source))
    }
}

/// Answers one ZAP request: admit the peer if its socket's allowlist has
/// its address and neither the socket nor that address holds its cap.
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
    let listed = coord.allowlist(req.domain).map_or(true, |list| list.is_empty() || list.allows(req.address));
    let source = Source::parse(req.address);
    let verdict = if !listed {
        coord.metrics().access_denied(req.domain);
        Verdict::NotAllowed
    } else {
        match gate.over_cap(req.domain, source, coord.peer_cap(req.domain))? {
            None => Verdict::Admit,
            Some(Refusal::SocketFull) => Verdict::Full,
            Some(Refusal::AddressFull) => Verdict::AddressFull,
        }
    };
    // A refused peer may reconnect on its own, so this can repeat quickly.
    match verdict {
        Verdict::Admit => {}
        Verdict::NotAllowed => {
            if let Some(suppressed) = gate.log.allow(socket, Instant::now()) {
                tracing::warn!(
                    socket = req.domain,
                    peer = req.address,
                    suppressed,
                    "connection refused: peer not in the allowlist"
                );
            }
        }
        Verdict::Full | Verdict::AddressFull => {
            if let Some(suppressed) = gate.log.allow(3 + socket, Instant::now()) {
                let (connected, from_address) = gate.peers.connected(req.domain, source);
                let why = if verdict == Verdict::Full {
                    "connection refused: the socket holds its *_max_peers"
                } else {
                    "connection refused: the peer's address holds server.max_peers_per_address on this socket"
                };
                tracing::warn!(socket = req.domain, peer = req.address, connected, from_address, suppressed, "{why}");
            }
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
