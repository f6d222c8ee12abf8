//! libzmq's socket monitor: a PAIR socket that reads a socket's events.

use super::error::{sock_err, TransportError};

/// Asks libzmq to report `events` of `s` on `inproc`, and connects the PAIR
/// socket that reads them, queueing at most `hwm` messages (two per event).
/// Called before `s` binds or connects, so no event goes unseen.
pub(super) fn monitor(
    ctx: &zmq::Context,
    s: &zmq::Socket,
    inproc: &str,
    events: i32,
    hwm: i32,
    name: &'static str,
) -> Result<zmq::Socket, TransportError> {
    s.monitor(inproc, events).map_err(sock_err(name))?;
    let m = ctx.socket(zmq::PAIR).map_err(sock_err(name))?;
    m.set_rcvhwm(hwm).map_err(sock_err(name))?;
    m.set_linger(0).map_err(sock_err(name))?;
    m.connect(inproc).map_err(sock_err(name))?;
    Ok(m)
}
