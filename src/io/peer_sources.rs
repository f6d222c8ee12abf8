//! Connected peers per source address, for the cap one address may hold on
//! each bound socket (`server.max_peers_per_address`).
//!
//! The socket-wide cap (`io::peers`) bounds memory, but whoever fills it
//! keeps everyone else out. Counting each socket's connections by their
//! source lets the ZAP handler refuse one host's excess while others still
//! connect. A source is an IPv4 address or an IPv6 /64 (one host usually
//! owns a whole /64, so its addresses count as one); ipc:// peers have no
//! address and are not counted.
//!
//! libzmq's monitor reports a connection's file descriptor, not its
//! address, so the address is read from the descriptor (`getpeername`)
//! when its `ACCEPTED` event is read, and kept by descriptor until its
//! `DISCONNECTED`. The connection may be gone by then and its descriptor
//! reused by a newer one; the newer one's address is then recorded under
//! both events of the older (whose `DISCONNECTED` comes first, in order),
//! and again at its own `ACCEPTED`, so every count stays exact once the
//! events are read. A peer whose ZAP request is being answered is still
//! connected, so its own address is the one recorded.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::os::fd::RawFd;

use nix::sys::socket::{getpeername, SockaddrStorage};

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

    /// The source of the connection on descriptor `fd`; `None` when it is
    /// not a TCP connection (ipc) or no longer connected.
    fn of_fd(fd: RawFd) -> Option<Source> {
        let addr: SockaddrStorage = getpeername(fd).ok()?;
        if let Some(v4) = addr.as_sockaddr_in() {
            Some(Source::of(IpAddr::V4(v4.ip())))
        } else {
            addr.as_sockaddr_in6().map(|v6| Source::of(IpAddr::V6(v6.ip())))
        }
    }
}

/// One bound socket's connections by source.
#[derive(Debug, Default)]
pub struct BySource {
    /// The source recorded for each connection's descriptor.
    fds: HashMap<RawFd, Source>,
    /// Connections per source; a source with none has no entry.
    counts: HashMap<Source, u32>,
}

impl BySource {
    /// A connection was accepted on `fd`: counts it under its source.
    pub fn accepted(&mut self, fd: RawFd) {
        self.add(fd, Source::of_fd(fd));
    }

    fn add(&mut self, fd: RawFd, source: Option<Source>) {
        // libzmq ends every connection with a DISCONNECTED before its
        // descriptor can be reused, so `fd` has no entry; should one be
        // left, it is released rather than counted twice.
        self.disconnected(fd);
        if let Some(source) = source {
            self.fds.insert(fd, source);
            *self.counts.entry(source).or_default() += 1;
        }
    }

    /// The connection on `fd` ended.
    pub fn disconnected(&mut self, fd: RawFd) {
        let Some(source) = self.fds.remove(&fd) else { return };
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

    #[test]
    fn counts_follow_connections_and_release_reused_descriptors() {
        let mut by = BySource::default();
        let (a, b) = (src("10.0.0.1"), src("10.0.0.2"));
        by.add(7, Some(a));
        by.add(8, Some(a));
        by.add(9, Some(b));
        assert_eq!((by.count(a), by.count(b)), (2, 1));
        by.disconnected(7);
        by.disconnected(7);
        assert_eq!(by.count(a), 1, "a second DISCONNECTED changes nothing");
        by.add(8, Some(b));
        assert_eq!((by.count(a), by.count(b)), (0, 2), "a reused descriptor's old entry is released");
        by.add(10, None);
        by.disconnected(10);
        by.disconnected(8);
        by.disconnected(9);
        assert_eq!((by.count(a), by.count(b), by.counts.len(), by.fds.len()), (0, 0, 0, 0));
    }

    #[test]
    fn the_source_is_read_from_a_connected_descriptor() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert_eq!(Source::of_fd(server.as_raw_fd()), Some(src("127.0.0.1")));
        assert_eq!(Source::of_fd(listener.as_raw_fd()), None, "a listener has no peer");
        drop(client);
    }
}
