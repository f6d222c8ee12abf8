//! File descriptors are a budget: every TCP or ipc:// peer, each ZeroMQ
//! socket and each HTTP connection holds one. At start the soft `nofile`
//! limit is raised to the hard one, and the HTTP server may hold at most
//! [`HTTP_SHARE`] of it, so ZeroMQ peers and engines can still connect while
//! HTTP is full; each bound ZeroMQ socket's peers hold at most their own
//! share ([`Budget::peer_share`]), so what the four together may hold
//! leaves a quarter for connections dpcoord makes, ipc peers' listeners,
//! files and libzmq's own (docs/failure-behaviour.md, "File descriptors and
//! HTTP connections").

use rlimit::Resource;

use crate::config::PeerCaps;

/// The HTTP server's share of the soft limit: one descriptor in this many.
pub const HTTP_SHARE: u64 = 4;

/// A gateway front's share of the soft limit: one descriptor in this many,
/// for the proxy's client connections (its connections to the ranks'
/// servers take as many again, so the proxy holds an eighth of the quarter
/// left for connections dpcoord makes) and for the picker's connections
/// in their TLS handshake.
pub const FRONT_SHARE: u64 = 16;

/// The share of the soft limit each bound ZeroMQ socket's peers may hold:
/// one descriptor in this many (route and stats bind a fifth, health a tenth).
const PEER_SHARES: [(&str, u64); 3] = [("route", 5), ("health", 10), ("stats", 5)];

/// The `nofile` limits: the soft one found at start, the one in force, the hard one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub soft_at_start: u64,
    pub soft: u64,
    pub hard: u64,
}

/// What is assumed when the limits cannot be read: Linux's usual soft limit.
const ASSUMED: u64 = 1024;

impl Budget {
    /// The limits in force, unchanged ([`ASSUMED`] if they cannot be read).
    pub fn current() -> Budget {
        let (soft, hard) = Resource::NOFILE.get().unwrap_or_else(|e| {
            tracing::warn!(error = %e, assumed = ASSUMED, "cannot read the nofile limit");
            (ASSUMED, ASSUMED)
        });
        Budget { soft_at_start: soft, soft, hard }
    }

    /// Raises the soft limit to the hard one and logs both at info. When the
    /// raise fails, the soft limit stays and a warning says why.
    pub fn raise() -> Budget {
        let mut b = Budget::current();
        if b.soft < b.hard {
            match rlimit::increase_nofile_limit(b.hard) {
                Ok(soft) => b.soft = soft,
                Err(e) => tracing::warn!(soft = b.soft, hard = b.hard, error = %e, "cannot raise the nofile limit"),
            }
        }
        tracing::info!(
            soft_at_start = b.soft_at_start,
            soft = b.soft,
            hard = b.hard,
            http_share = b.http_share(),
            "file descriptors: nofile soft limit {} (was {}), hard limit {}",
            b.soft,
            b.soft_at_start,
            b.hard
        );
        b
    }

    /// The most descriptors the HTTP server may hold: a [`HTTP_SHARE`]th of
    /// the soft limit, at least 1.
    pub fn http_share(&self) -> usize {
        usize::try_from(self.soft / HTTP_SHARE).unwrap_or(usize::MAX).max(1)
    }

    /// The most descriptors a gateway front may hold for its clients (the
    /// proxy's connections, the picker's handshakes): a [`FRONT_SHARE`]th
    /// of the soft limit, at least 1.
    pub fn front_share(&self) -> usize {
        usize::try_from(self.soft / FRONT_SHARE).unwrap_or(usize::MAX).max(1)
    }

    /// The most peers a bound ZeroMQ socket (a ZAP domain: `route`,
    /// `health`, `stats`) may hold whatever its `*_max_peers` says: its
    /// share of the soft limit, at least 1; no bound for other names.
    pub fn peer_share(&self, domain: &str) -> u32 {
        PEER_SHARES
            .iter()
            .find(|(name, _)| *name == domain)
            .map_or(u32::MAX, |(_, one_in)| u32::try_from(self.soft / one_in).unwrap_or(u32::MAX).max(1))
    }

    /// A socket's peer cap in force: `configured` within its share.
    pub fn peer_cap(&self, domain: &str, configured: u32) -> u32 {
        configured.min(self.peer_share(domain))
    }

    /// Logs the peer caps in force, with a warning for each that its share
    /// of the descriptors lowered.
    pub fn log_peer_caps(&self, caps: &PeerCaps) {
        for (domain, _) in PEER_SHARES {
            let configured = caps.of(domain).unwrap_or(u32::MAX);
            let in_force = self.peer_cap(domain, configured);
            if in_force < configured {
                tracing::warn!(
                    socket = domain,
                    configured,
                    in_force,
                    nofile = self.soft,
                    "{domain}_max_peers {configured} is above the {domain} socket's share of the nofile limit: \
                     it holds at most {in_force} peers"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_takes_a_quarter_and_at_least_one() {
        let b = |soft| Budget { soft_at_start: soft, soft, hard: soft };
        assert_eq!(b(1024).http_share(), 256);
        assert_eq!(b(1023).http_share(), 255);
        assert_eq!(b(3).http_share(), 1);
    }

    #[test]
    fn each_bound_socket_takes_its_share_and_at_least_one() {
        let b = Budget { soft_at_start: 1024, soft: 1024, hard: 1024 };
        let shares = ["route", "health", "stats", "other"].map(|d| b.peer_share(d));
        assert_eq!(shares, [204, 102, 204, u32::MAX]);
        assert_eq!([b.peer_cap("route", 1024), b.peer_cap("route", 100)], [204, 100]);
        let tiny = Budget { soft_at_start: 3, soft: 3, hard: 3 };
        assert_eq!(tiny.peer_share("health"), 1);
        // Together with HTTP's quarter, the peers take three quarters.
        assert_eq!(shares[..3].iter().sum::<u32>() + b.http_share() as u32, 766);
    }
}
