//! A socket's peer allowlist, as configured (`server.*_allow`); libzmq's
//! ZAP handler (`io::access`) asks it about each new peer.

use std::net::IpAddr;

use ipnet::IpNet;

/// The networks a socket admits; empty means no check.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist(Vec<IpNet>);

impl Allowlist {
    /// Parses `"10.0.0.0/8"`, `"127.0.0.1"` (one host) or IPv6 forms.
    pub fn parse(items: &[String]) -> Result<Allowlist, String> {
        items
            .iter()
            .map(|s| {
                s.parse::<IpNet>()
                    .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| format!("`{s}` is not an IP address or CIDR network"))
            })
            .collect::<Result<_, _>>()
            .map(Allowlist)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether a peer at `addr` (as ZAP reports it) may connect.
    pub fn allows(&self, addr: &str) -> bool {
        let Ok(ip) = addr.parse::<IpAddr>() else { return false };
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        self.0.iter().any(|net| net.contains(&ip))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(items: &[&str]) -> Allowlist {
        Allowlist::parse(&items.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn hosts_networks_and_mapped_addresses() {
        let l = list(&["127.0.0.2", "10.0.0.0/8", "fd00::/8"]);
        assert!(l.allows("127.0.0.2"));
        assert!(!l.allows("127.0.0.1"));
        assert!(l.allows("10.20.30.40"));
        assert!(l.allows("::ffff:10.1.1.1"));
        assert!(l.allows("fd12::1"));
        assert!(!l.allows("fe80::1"));
        assert!(!l.allows("not-an-ip"));
        assert!(Allowlist::parse(&["10.0.0.0/33".to_string()]).is_err());
        assert!(Allowlist::default().is_empty());
    }
}
