//! Connected peers per bound socket (route, health, stats bind), counted
//! from libzmq's socket monitors, and the cap the ZAP handler enforces.
//!
//! Every peer costs libzmq about 38 KB (its stream buffers and the
//! connection's pipes), and nothing else bounds how many connect, so each
//! bound socket holds at most its `server.*_max_peers`; the ZAP handler
//! refuses a new peer during its handshake when its socket is full.
//!
//! The count is libzmq's own: `ACCEPTED` adds one, `DISCONNECTED` takes one
//! away. In libzmq 4.3 every accepted connection ends with exactly one
//! `DISCONNECTED` (`stream_engine_base_t::error` emits it on every way out,
//! whether the handshake succeeded, was refused by ZAP, or never began; the
//! only other way out, `terminate`, is taken when the socket itself closes),
//! so the count is every connection the socket holds, handshaking ones
//! included. `HANDSHAKE_SUCCEEDED` would count only admitted peers, but it
//! carries no file descriptor, so its `DISCONNECTED` could not be told from
//! a refused one's; a connection refused at the cap is closed within
//! milliseconds, so the two counts differ only that long.
//! `tests/peer_cap.rs::libzmq_ends_every_accepted_connection_with_one_disconnect`
//! checks this against the vendored libzmq.

use prometheus::{IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::sockets::{sock_err, TransportError};
use crate::observability::metrics::{built, register};

/// Events queued for dpcoord to read, in messages (two per event). libzmq
/// blocks its I/O thread rather than drop a monitor event, so this is far
/// above what one poll round can leave behind (the loop reads every monitor
/// whenever it signals): 50,000 events, about 6 MB at most.
const EVENT_HWM: i32 = 100_000;
/// Events read per poll round, so no socket starves another.
const BATCH: usize = 256;
const ACCEPTED: u16 = zmq::SocketEvent::ACCEPTED as u16;
const DISCONNECTED: u16 = zmq::SocketEvent::DISCONNECTED as u16;

/// The PAIR socket that receives a bound socket's connection events.
pub struct Monitor {
    /// The bound socket's name, which is also its ZAP domain.
    pub name: &'static str,
    pub socket: zmq::Socket,
}

/// Asks libzmq to report `s`'s connections and disconnections, and
/// connects the socket that reads them. Called before `s` binds, so no
/// connection goes uncounted.
pub fn watch(ctx: &zmq::Context, s: &zmq::Socket, name: &'static str) -> Result<Monitor, TransportError> {
    let endpoint = format!("inproc://dpcoord.peers.{name}");
    let events = (zmq::SocketEvent::ACCEPTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32);
    s.monitor(&endpoint, events).map_err(sock_err(name))?;
    let socket = ctx.socket(zmq::PAIR).map_err(sock_err(name))?;
    socket.set_rcvhwm(EVENT_HWM).map_err(sock_err(name))?;
    socket.set_linger(0).map_err(sock_err(name))?;
    socket.connect(&endpoint).map_err(sock_err(name))?;
    Ok(Monitor { name, socket })
}

/// One watched socket's count and metric series.
struct Count {
    name: &'static str,
    connected: u32,
    gauge: IntGauge,
    refused: IntCounter,
}

/// The connected peers of every bound socket.
pub struct Peers {
    counts: Vec<Count>,
}

/// The connection change an event is: +1, -1, or none.
fn change(event: &[u8]) -> i32 {
    match event.get(..2).map(|id| u16::from_ne_bytes([id[0], id[1]])) {
        Some(ACCEPTED) => 1,
        Some(DISCONNECTED) => -1,
        _ => 0,
    }
}

impl Peers {
    /// Counts for the sockets of `monitors`, with their series in `registry`:
    /// `dpcoord_peers_connected{socket}` and `dpcoord_peers_refused_total{socket}`.
    pub fn new(monitors: &[Monitor], registry: &Registry) -> Peers {
        let gauge = register(
            registry,
            built(IntGaugeVec::new(
                Opts::new(
                    "dpcoord_peers_connected",
                    "ZeroMQ connections a bound socket holds (handshaking ones included).",
                ),
                &["socket"],
            )),
        );
        let refused = register(
            registry,
            built(IntCounterVec::new(
                Opts::new(
                    "dpcoord_peers_refused_total",
                    "New peers refused because their socket held its *_max_peers.",
                ),
                &["socket"],
            )),
        );
        let counts = monitors
            .iter()
            .map(|m| Count {
                name: m.name,
                connected: 0,
                gauge: gauge.with_label_values(&[m.name]),
                refused: refused.with_label_values(&[m.name]),
            })
            .collect();
        Peers { counts }
    }

    /// Reads the events of monitor `i` (its place in the list `new` was
    /// given) until EAGAIN; `true` when the batch limit stopped it first.
    pub fn drain(&mut self, i: usize, monitor: &zmq::Socket) -> Result<bool, zmq::Error> {
        let count = &mut self.counts[i];
        for _ in 0..BATCH {
            let event = match monitor.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => return Ok(false),
                Err(e) => return Err(e),
            };
            count.connected = count.connected.saturating_add_signed(change(&event[0]));
            count.gauge.set(i64::from(count.connected));
        }
        Ok(true)
    }

    /// Whether a new peer of `domain`'s socket, already counted, makes it
    /// hold more than `cap`; if so the refusal is counted.
    pub fn refuse(&mut self, domain: &str, cap: u32) -> bool {
        let Some(count) = self.counts.iter().find(|c| c.name == domain) else { return false };
        let over = count.connected > cap;
        if over {
            count.refused.inc();
        }
        over
    }

    /// The place of `domain`'s monitor, to read it before a decision.
    pub fn index(&self, domain: &str) -> Option<usize> {
        self.counts.iter().position(|c| c.name == domain)
    }

    /// Connections `domain`'s socket holds.
    pub fn connected(&self, domain: &str) -> u32 {
        self.counts.iter().find(|c| c.name == domain).map_or(0, |c| c.connected)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(id: u16) -> Vec<u8> {
        let mut e = id.to_ne_bytes().to_vec();
        e.extend_from_slice(&7u32.to_ne_bytes());
        e
    }

    #[test]
    fn accepted_adds_disconnected_removes_others_change_nothing() {
        assert_eq!(change(&event(ACCEPTED)), 1);
        assert_eq!(change(&event(DISCONNECTED)), -1);
        assert_eq!(change(&event(zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16)), 0);
        assert_eq!(change(&[1]), 0);
    }
}
