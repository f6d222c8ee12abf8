//! Connected peers per source address, for the cap one address may hold on
//! each bound socket (`server.max_peers_per_address`), and the means to
//! close a TCP connection the moment it is accepted.
//!
//! The socket-wide cap (`io::peers`) bounds memory, but whoever fills it
//! keeps everyone else out. Counting each socket's connections by their
//! source lets dpcoord refuse one host's excess while others still connect.
//! A source is an IPv4 address or an IPv6 /64 (one host usually owns a
//! whole /64, so its addresses count as one); ipc:// peers have no address
//! and are not counted.
//!
//! libzmq's monitor reports a connection's file descriptor, not its
//! address, so both ends are read from the descriptor (`getsockname`,
//! `getpeername`) when its `ACCEPTED` event is read, and kept by descriptor
//! until its `DISCONNECTED`. The connection may be gone by then and its
//! descriptor reused by a newer one; the newer one's ends are then recorded
//! under both events of the older (whose `DISCONNECTED` comes first, in
//! order), and again at its own `ACCEPTED`, so every count stays exact once
//! the events are read.
//!
//! Closing: dpcoord shuts down (`shutdown(2)`, which does not free the
//! descriptor; libzmq still owns and closes it) a connection it refuses,
//! and only after reading both ends again and finding the ones it
//! recorded. Two live TCP connections never share both ends, so a
//! descriptor libzmq closed and reused meanwhile, for another peer or for
//! any other socket of the process, fails that check and is left alone.
//! libzmq then reads the end of the stream (or fails a write with `EPIPE`:
//! the Rust runtime ignores `SIGPIPE`, see `io::signals`) and closes the
//! connection as if the peer had left, with its `DISCONNECTED`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::os::fd::RawFd;

use nix::sys::socket::{getpeername, getsockname, shutdown, Shutdown, SockaddrStorage};

/// Where a peer connects from: an IPv4 address or an IPv6 /64 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source(IpAddr);

impl Source {
    /// The source of a peer at `ip` (an IPv4-mapped IPv6 address is its IPv4).
    pub fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => Source(IpAddr::V4(v4)),
                None => Source(IpAddr::V6(Ipv6Addr::from_bits(v6.to_bits() & !u128::from(u64::MAX)))),
            },
            v4 => Source(v4),
        }
    }

    /// The source of the address a ZAP request names; `None` for an ipc
    /// peer (whose address is empty).
    pub fn parse(address: &str) -> Option<Source> {
        address.parse().ok().map(Source::of)
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V4(v4) => write!(f, "{v4}"),
            IpAddr::V6(v6) => write!(f, "{v6}/64"),
        }
    }
}

/// A TCP connection's two ends; no two live connections share both.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ends {
    local: SocketAddr,
    peer: SocketAddr,
}

/// An IP socket address, or `None` (a Unix socket, or none).
fn inet(addr: &SockaddrStorage) -> Option<SocketAddr> {
    if let Some(v4) = addr.as_sockaddr_in() {
        Some(SocketAddr::from((v4.ip(), v4.port())))
    } else {
        addr.as_sockaddr_in6().map(|v6| SocketAddr::from((v6.ip(), v6.port())))
    }
}

/// The ends of the TCP connection on descriptor `fd`; `None` when it is
/// not one (ipc) or no longer connected.
fn ends_of(fd: RawFd) -> Option<Ends> {
    let local = inet(&getsockname::<SockaddrStorage>(fd).ok()?)?;
    let peer = inet(&getpeername::<SockaddrStorage>(fd).ok()?)?;
    Some(Ends { local, peer })
}

/// One bound socket's connections by source.
#[derive(Debug, Default)]
pub struct BySource {
    /// The ends and source recorded for each TCP connection's descriptor.
    fds: HashMap<RawFd, (Ends, Source)>,
    /// Connections per source; a source with none has no entry.
    counts: HashMap<Source, u32>,
}

impl BySource {
    /// A connection was accepted on `fd`: counts it under its source,
    /// which it returns (`None` for an ipc peer or one already gone).
    pub fn accepted(&mut self, fd: RawFd) -> Option<Source> {
        let ends = ends_of(fd)?;
        let source = Source::of(ends.peer.ip());
        self.add(fd, Some((ends, source)));
        Some(source)
    }

    fn add(&mut self, fd: RawFd, recorded: Option<(Ends, Source)>) {
        // libzmq ends every connection with a DISCONNECTED before its
        // descriptor can be reused, so `fd` has no entry; should one be
        // left, it is released rather than counted twice.
        self.disconnected(fd);
        if let Some((ends, source)) = recorded {
            self.fds.insert(fd, (ends, source));
            *self.counts.entry(source).or_default() += 1;
        }
    }

    /// Shuts down the connection accepted on `fd` if it is still the one
    /// recorded there (both ends unchanged); whether it was. libzmq then
    /// sees the connection end and reports its `DISCONNECTED`.
    pub fn close(&self, fd: RawFd) -> bool {
        let Some((ends, _)) = self.fds.get(&fd) else { return false };
        ends_of(fd) == Some(*ends) && shutdown(fd, Shutdown::Both).is_ok()
    }

    /// The connection on `fd` ended.
    pub fn disconnected(&mut self, fd: RawFd) {
        let Some((_, source)) = self.fds.remove(&fd) else { return };
        if let Some(n) = self.counts.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.counts.remove(&source);
            }
        }
    }

    /// Connections from `source`.
    pub fn count(&self, source: Source) -> u32 {
        self.counts.get(&source).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;

    use super::*;

    fn src(s: &str) -> Source {
        Source::parse(s).unwrap()
    }

    #[test]
    fn a_source_is_an_ipv4_address_or_an_ipv6_slash_64() {
        assert_eq!(src("::ffff:10.1.2.3"), src("10.1.2.3"));
        assert_ne!(src("10.1.2.3"), src("10.1.2.4"));
        assert_eq!(src("2001:db8:1:2::1"), src("2001:db8:1:2:ffff::9"));
        assert_ne!(src("2001:db8:1:2::1"), src("2001:db8:1:3::1"));
        assert_eq!(Source::parse(""), None, "an ipc peer");
    }

    fn ends(peer: &str) -> Ends {
        Ends { local: "127.0.0.1:5570".parse().unwrap(), peer: peer.parse().unwrap() }
    }

    #[test]
    fn counts_follow_connections_and_release_reused_descriptors() {
        let mut by = BySource::default();
        let (a, b) = (src("10.0.0.1"), src("10.0.0.2"));
        by.add(7, Some((ends("10.0.0.1:1000"), a)));
        by.add(8, Some((ends("10.0.0.1:1001"), a)));
        by.add(9, Some((ends("10.0.0.2:1000"), b)));
        assert_eq!((by.count(a), by.count(b)), (2, 1));
        by.disconnected(7);
        by.disconnected(7);
        assert_eq!(by.count(a), 1, "a second DISCONNECTED changes nothing");
        by.add(8, Some((ends("10.0.0.2:1001"), b)));
        assert_eq!((by.count(a), by.count(b)), (0, 2), "a reused descriptor's old entry is released");
        by.add(10, None);
        by.disconnected(10);
        by.disconnected(8);
        by.disconnected(9);
        assert_eq!((by.count(a), by.count(b), by.counts.len(), by.fds.len()), (0, 0, 0, 0));
    }

    #[test]
    fn a_connection_is_read_from_its_descriptor_and_closed_only_while_it_is_the_same() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let mut by = BySource::default();
        assert_eq!(by.accepted(server.as_raw_fd()), Some(src("127.0.0.1")));
        assert_eq!(by.accepted(listener.as_raw_fd()), None, "a listener has no peer");
        assert_eq!(by.count(src("127.0.0.1")), 1);
        // The same descriptor now holds another connection: not closed.
        let fd = server.as_raw_fd();
        let (_, (recorded, _)) = by.fds.iter().next().unwrap();
        let other = Ends { local: recorded.local, peer: "127.0.0.1:9".parse().unwrap() };
        let mut stale = BySource::default();
        stale.add(fd, Some((other, src("127.0.0.1"))));
        assert!(!stale.close(fd), "the ends changed: left alone");
        assert!(by.close(fd));
        let mut buf = [0u8; 1];
        assert_eq!(client.read(&mut buf).unwrap(), 0, "the client sees the connection end");
        assert!(!by.close(listener.as_raw_fd()), "nothing recorded there");
    }
}
