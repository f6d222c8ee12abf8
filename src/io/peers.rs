//! Connected peers per bound socket (route, health, stats bind), counted
//! from libzmq's socket monitors, and the cap the ZAP handler enforces.
//!
//! Every peer costs libzmq about 38 KB (its stream buffers and the
//! connection's pipes), and nothing else bounds how many connect, so each
//! bound socket holds at most its `server.*_max_peers`; the ZAP handler
//! refuses a new peer during its handshake when its socket is full, or
//! when its source address holds `server.max_peers_per_address` there
//! (counted per socket by `peer_sources`).
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

use std::os::fd::RawFd;

use super::peer_sources::{BySource, Source};
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
    sources: BySource,
    gauge: IntGauge,
    /// Refusals by [`Refusal`], in its order.
    refused: [IntCounter; 2],
}

/// The connected peers of every bound socket.
pub struct Peers {
    counts: Vec<Count>,
}

/// A connection event: its kind and file descriptor (libzmq's event frame
/// is the event id, u16, then its value, u32, native byte order).
fn event_of(frame: &[u8]) -> Option<(u16, RawFd)> {
    let id = u16::from_ne_bytes(frame.get(..2)?.try_into().ok()?);
    let value = u32::from_ne_bytes(frame.get(2..6)?.try_into().ok()?);
    Some((id, value as RawFd))
}

/// Why a new peer is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its socket holds its `*_max_peers`.
    SocketFull,
    /// Its source address holds `max_peers_per_address` on that socket.
    AddressFull,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::SocketFull => "socket_full",
            Refusal::AddressFull => "address_full",
        }
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
                    "New peers refused: their socket held its *_max_peers (socket_full), or their \
                     address held max_peers_per_address on it (address_full).",
                ),
                &["socket", "reason"],
            )),
        );
        let counts = monitors
            .iter()
            .map(|m| Count {
                name: m.name,
                connected: 0,
                sources: BySource::default(),
                gauge: gauge.with_label_values(&[m.name]),
                refused: [Refusal::SocketFull, Refusal::AddressFull]
                    .map(|r| refused.with_label_values(&[m.name, r.label()])),
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
            match event_of(&event[0]) {
                Some((ACCEPTED, fd)) => {
                    count.connected = count.connected.saturating_add(1);
                    count.sources.accepted(fd);
                }
                Some((DISCONNECTED, fd)) => {
                    count.connected = count.connected.saturating_sub(1);
                    count.sources.disconnected(fd);
                }
                _ => {}
            }
            count.gauge.set(i64::from(count.connected));
        }
        Ok(true)
    }

    /// Whether a new peer of `domain`'s socket from `source`, already
    /// counted, makes the socket hold more than `cap` or its source more
    /// than `per_source`; a refusal is counted.
    pub fn refuse(&mut self, domain: &str, source: Option<Source>, cap: u32, per_source: u32) -> Option<Refusal> {
        let count = self.counts.iter().find(|c| c.name == domain)?;
        let refusal = if count.connected > cap {
            Refusal::SocketFull
        } else if source.is_some_and(|s| count.sources.count(s) > per_source) {
            Refusal::AddressFull
        } else {
            return None;
        };
        count.refused[refusal as usize].inc();
        Some(refusal)
    }

    /// The place of `domain`'s monitor, to read it before a decision.
    pub fn index(&self, domain: &str) -> Option<usize> {
        self.counts.iter().position(|c| c.name == domain)
    }

    /// Connections `domain`'s socket holds, and of those, `source`'s.
    pub fn connected(&self, domain: &str, source: Option<Source>) -> (u32, u32) {
        self.counts
            .iter()
            .find(|c| c.name == domain)
            .map_or((0, 0), |c| (c.connected, source.map_or(0, |s| c.sources.count(s))))
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
    fn events_carry_their_kind_and_descriptor() {
        assert_eq!(event_of(&event(ACCEPTED)), Some((ACCEPTED, 7)));
        assert_eq!(event_of(&event(DISCONNECTED)), Some((DISCONNECTED, 7)));
        assert_eq!(event_of(&[1, 0, 7]), None);
    }
}
