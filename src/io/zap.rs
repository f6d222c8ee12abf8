//! The ZAP handler: answers libzmq's questions about every new peer of the
//! bound sockets, from the allowlists and peer caps in force (a reload may
//! change them; the decisions themselves are in `access` and `peers`). An
//! empty allowlist admits everyone; a socket holding its cap admits nobody new.

use std::time::Instant;

use super::access::{self, Verdict};
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
    /// Per socket, allowlist refusals (0..3) and cap refusals (3..6).
    log: LogLimiter<6>,
}

impl<'a> Gate<'a> {
    pub fn new(peers: Peers, monitors: &'a [Monitor]) -> Gate<'a> {
        Gate { peers, monitors, log: LogLimiter::default() }
    }

    /// Reads monitor `i`'s events; `true` when the batch limit stopped it first.
    pub fn count(&mut self, i: usize) -> Result<bool, zmq::Error> {
        self.peers.drain(i, &self.monitors[i].socket)
    }

    /// Whether `domain`'s socket is over its cap with the peer asking now.
    /// libzmq reports a connection (`ACCEPTED`) before its handshake can
    /// begin, so once its ZAP request is here, its event is in the monitor:
    /// reading the monitor now counts it, even when the event came after
    /// this round's read of the monitors.
    fn over_cap(&mut self, domain: &str, cap: Option<u32>) -> Result<bool, zmq::Error> {
        let (Some(cap), Some(i)) = (cap, self.peers.index(domain)) else { return Ok(false) };
        while self.count(i)? {}
        Ok(self.peers.refuse(domain, cap))
    }
}

/// Answers one ZAP request: admit the peer if its socket's allowlist has
/// its address and the socket holds fewer peers than its cap.
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
    let verdict = if !listed {
        coord.metrics().access_denied(req.domain);
        Verdict::NotAllowed
    } else if gate.over_cap(req.domain, coord.peer_cap(req.domain))? {
        Verdict::Full
    } else {
        Verdict::Admit
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
        Verdict::Full => {
            if let Some(suppressed) = gate.log.allow(3 + socket, Instant::now()) {
                tracing::warn!(
                    socket = req.domain,
                    peer = req.address,
                    connected = gate.peers.connected(req.domain),
                    suppressed,
                    "connection refused: the socket holds its *_max_peers"
                );
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
