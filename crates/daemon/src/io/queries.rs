//! Answering queries on the route and health sockets: one query received,
//! answered and sent back along its envelope; a `reload` op handed to
//! `io::reload` to be answered after its read; and the health socket's
//! share of each poll round.

use std::time::{Duration, Instant};

use super::error::{sock_err, TransportError};
use super::frames::{Drops, Frames, Parsed};
use super::reload::{Reloads, Waiter};
use crate::routing::{Answered, Coordinator};
use crate::wire::{Channel, OwnedId, WireError};

/// Work on health queries per poll round (one query at least, then until
/// this much time has passed) before the other sockets, route first, are
/// served again; the rest waits in libzmq's queue for the next round. A
/// `prefix` op keys a whole prompt, so a flood of them would otherwise hold
/// route queries for a batch of them (256 x a long prompt).
pub(super) const HEALTH_BUDGET: Duration = Duration::from_micros(100);

/// Receives one query and answers it, or drops it when its envelope
/// breaks a bound; `false` when none was waiting. A `reload` op is
/// answered once the configuration has been read (`io::reload`).
pub(super) fn serve_one(s: &zmq::Socket, ch: Channel, q: &mut Queries<'_>) -> Result<bool, zmq::Error> {
    let Queries { frames: f, coord, drops, reloads } = q;
    if !f.recv(s)? {
        return Ok(false);
    }
    let now = Instant::now();
    let mut reply = std::mem::take(&mut f.reply);
    let envelope = match f.parse() {
        Parsed::Drop(why, size) => {
            drops.count(ch, why, size, now);
            f.reply = reply;
            return Ok(true);
        }
        Parsed::Query { envelope, body: [payload], frames: 1 } => match coord.on_query(ch, payload, now, &mut reply) {
            Answered::Now => envelope,
            Answered::AfterReload(id) => {
                let waiter = Waiter { envelope: envelope.iter().map(|m| m.to_vec()).collect(), id };
                f.reply = reply;
                reloads.ask(Some(waiter), coord, now, &mut answer_along(s));
                return Ok(true);
            }
        },
        Parsed::Query { envelope, frames, .. } => {
            coord.on_bad_frames(ch, frames, now, &mut reply);
            envelope
        }
    };
    send_along(s, ch, envelope.iter().map(|m| &m[..]), &reply)?;
    f.reply = reply;
    Ok(true)
}

/// Sends `reply` back along a request's `envelope`.
fn send_along<'a>(
    s: &zmq::Socket,
    ch: Channel,
    envelope: impl Iterator<Item = &'a [u8]>,
    reply: &[u8],
) -> Result<(), zmq::Error> {
    for frame in envelope {
        s.send(frame, zmq::SNDMORE | zmq::DONTWAIT)?;
    }
    if let Err(e) = s.send(reply, zmq::DONTWAIT) {
        // ROUTER drops replies to peers that are gone or not reading.
        tracing::debug!(channel = ch.as_str(), error = %e, "reply not sent");
    }
    Ok(())
}

/// Answers a `reload` op that waited for its read, on the health socket.
pub(super) fn answer_along(health: &zmq::Socket) -> impl FnMut(&Coordinator, Waiter, &Result<(), WireError>) + '_ {
    move |coord, w, outcome| {
        let mut reply = Vec::new();
        coord.reload_reply(w.id.as_ref().map(OwnedId::as_id), outcome, &mut reply);
        if let Err(e) = send_along(health, Channel::Health, w.envelope.iter().map(Vec::as_slice), &reply) {
            tracing::debug!(error = %e, "reload reply not sent");
        }
    }
}

/// What answering queries needs: the receive buffer, the coordinator, the
/// count of dropped queries, and the reloads in flight.
pub(super) struct Queries<'a> {
    pub frames: Frames,
    pub coord: &'a mut Coordinator,
    pub drops: Drops,
    pub reloads: Reloads,
}

/// Answers queries until EAGAIN; `true` when `limit` or `budget` (the time
/// since the first) stopped it first.
pub(super) fn drain_queries(
    s: &zmq::Socket,
    ch: Channel,
    q: &mut Queries<'_>,
    limit: usize,
    budget: Option<Duration>,
) -> Result<bool, TransportError> {
    let name = ch.as_str();
    let started = budget.map(|b| (Instant::now(), b));
    for _ in 0..limit {
        if !serve_one(s, ch, q).map_err(sock_err(name))? {
            return Ok(false);
        }
        if started.is_some_and(|(t0, b)| t0.elapsed() >= b) {
            return Ok(true);
        }
    }
    Ok(true)
}
