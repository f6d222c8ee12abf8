//! The ZAP handler: answers libzmq's questions about every new peer of the
//! bound sockets, from the allowlists in force (a reload may change them;
//! the decision itself is in `access`). An empty allowlist admits everyone.

use std::time::Instant;

use super::access;
use crate::observability::ratelimit::LogLimiter;
use crate::routing::Coordinator;

/// ZAP requests answered per poll round.
const BATCH: usize = 256;

/// Answers one ZAP request: admit the peer if its socket's allowlist has its address.
fn answer(zap: &zmq::Socket, coord: &Coordinator, log: &mut LogLimiter<3>) -> Result<(), zmq::Error> {
    let frames = zap.recv_multipart(zmq::DONTWAIT)?;
    let Some(req) = access::parse_request(&frames) else {
        // Not a ZAP request: REP still owes a reply to stay usable.
        return zap.send("", 0);
    };
    let cause = match req.domain {
        "route" => 0,
        "health" => 1,
        _ => 2,
    };
    let allowed = coord.allowlist(req.domain).map_or(true, |list| list.is_empty() || list.allows(req.address));
    if !allowed {
        coord.metrics().access_denied(req.domain);
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
pub fn drain(zap: &zmq::Socket, coord: &Coordinator, log: &mut LogLimiter<3>) -> Result<bool, zmq::Error> {
    for _ in 0..BATCH {
        match answer(zap, coord, log) {
            Ok(()) => {}
            Err(zmq::Error::EAGAIN) => return Ok(false),
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}
