//! File descriptors are a budget: every TCP or ipc:// peer, each ZeroMQ
//! socket and each HTTP connection holds one. At start the soft `nofile`
//! limit is raised to the hard one, and the HTTP server may hold at most
//! [`HTTP_SHARE`] of it, so ZeroMQ peers and engines can still connect while
//! HTTP is full (docs/failure-behaviour.md, "File descriptors and HTTP
//! connections").

use rlimit::Resource;

/// The HTTP server's share of the soft limit: one descriptor in this many.
pub const HTTP_SHARE: u64 = 4;

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
}
