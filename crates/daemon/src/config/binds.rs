//! The binds (`server.route_bind`, `health_bind`, `stats_bind`,
//! `metrics_bind`, `epp_bind`, `proxy_bind`) must not take the same endpoint: the second bind would
//! fail at start-up (a TCP port, an ipc:// path), or, for an ipc:// path,
//! libzmq would unlink the first socket's file and take it over. A clash is
//! a config error naming both keys.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::{Component, PathBuf};

use super::keys;
use super::{err, ConfigError, Server};

/// What a bind occupies, as far as it can be told without resolving names.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Place {
    /// A TCP port on an address; `::` (and ZeroMQ's `*`, which binds `::`
    /// with dpcoord's IPv6 on) is every address, `0.0.0.0` every IPv4 one.
    Tcp { ip: IpAddr, port: u16 },
    /// A TCP port on an interface or host name, compared as written.
    TcpNamed { host: String, port: u16 },
    /// A socket file, its path with `.` and repeated `/` removed.
    File(PathBuf),
    /// An inproc:// name or an abstract `ipc://@name`, compared as written.
    Name(String),
    /// A wildcard port or path: the system picks a free one.
    Any,
}

fn place_of_endpoint(ep: &str) -> Place {
    if let Some(rest) = ep.strip_prefix("tcp://") {
        let Some((host, port)) = rest.rsplit_once(':') else { return Place::Name(ep.to_owned()) };
        let Ok(port) = port.parse::<u16>() else { return Place::Any };
        if host == "*" {
            return Place::Tcp { ip: IpAddr::V6(Ipv6Addr::UNSPECIFIED), port };
        }
        let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        return match bare.parse::<IpAddr>() {
            Ok(ip) => place_of_socket(SocketAddr::new(ip, port)),
            Err(_) => Place::TcpNamed { host: host.to_owned(), port },
        };
    }
    match ep.strip_prefix("ipc://") {
        Some("*") => Place::Any,
        Some(path) if !path.starts_with('@') => {
            Place::File(PathBuf::from(path).components().filter(|c| *c != Component::CurDir).collect())
        }
        _ => Place::Name(ep.to_owned()),
    }
}

fn place_of_socket(addr: SocketAddr) -> Place {
    Place::Tcp { ip: addr.ip(), port: addr.port() }
}

/// Whether a bind on `x` takes the port on `y` as well.
fn covers(x: IpAddr, y: IpAddr) -> bool {
    x == y || (x.is_unspecified() && (x.is_ipv6() || y.is_ipv4()))
}

/// Whether two binds would take the same endpoint.
fn clash(a: &Place, b: &Place) -> bool {
    match (a, b) {
        (Place::Any, _) | (_, Place::Any) => false,
        (&Place::Tcp { ip: x, port: p }, &Place::Tcp { ip: y, port: q }) => p == q && (covers(x, y) || covers(y, x)),
        (Place::Tcp { ip, port: p }, Place::TcpNamed { port: q, .. })
        | (Place::TcpNamed { port: p, .. }, Place::Tcp { ip, port: q }) => p == q && ip.is_unspecified(),
        _ => a == b,
    }
}

/// Errors on the first bind whose endpoint an earlier one already takes,
/// naming both keys.
pub(super) fn check_distinct(s: &Server) -> Result<(), ConfigError> {
    let mut binds = vec![
        (keys::ROUTE_BIND.key.path(), s.route_bind.clone(), place_of_endpoint(&s.route_bind)),
        (keys::HEALTH_BIND.key.path(), s.health_bind.clone(), place_of_endpoint(&s.health_bind)),
    ];
    if let Some(stats) = &s.stats_bind {
        binds.push((keys::STATS_BIND.key.path(), stats.clone(), place_of_endpoint(stats)));
    }
    binds.push((keys::METRICS_BIND.key.path(), s.metrics_bind.to_string(), place_of_socket(s.metrics_bind)));
    for (key, bind) in [(&keys::EPP_BIND, s.epp_bind), (&keys::PROXY_BIND, s.proxy_bind)] {
        if let Some(addr) = bind {
            binds.push((key.key.path(), addr.to_string(), place_of_socket(addr)));
        }
    }
    for (i, (key, value, place)) in binds.iter().enumerate() {
        if let Some((first, taken, _)) = binds[..i].iter().find(|(_, _, p)| clash(p, place)) {
            let same = if taken == value { String::new() } else { format!(" (`{taken}`)") };
            let problem = format!("`{value}` clashes with {first}{same}; each bind needs an endpoint of its own");
            return Err(err(key.as_str(), problem));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clashes(a: &str, b: &str) -> bool {
        clash(&place_of_endpoint(a), &place_of_endpoint(b))
    }

    #[test]
    fn the_same_port_or_path_clashes_however_written() {
        assert!(clashes("tcp://127.0.0.1:5570", "tcp://127.0.0.1:5570"));
        assert!(clashes("tcp://*:5570", "tcp://127.0.0.1:5570"));
        assert!(clashes("tcp://0.0.0.0:5570", "tcp://10.0.0.1:5570"));
        assert!(clashes("tcp://*:5570", "tcp://0.0.0.0:5570"));
        assert!(clashes("tcp://[::1]:5570", "tcp://[::]:5570"));
        assert!(clashes("tcp://*:5570", "tcp://eth0:5570"));
        assert!(clashes("tcp://eth0:5570", "tcp://eth0:5570"));
        assert!(clashes("ipc:///run/d/x.sock", "ipc:///run/./d//x.sock"));
        assert!(clashes("ipc://x.sock", "ipc://./x.sock"));
        assert!(clashes("ipc://@abstract", "ipc://@abstract"));
        assert!(clashes("inproc://q", "inproc://q"));
    }

    #[test]
    fn other_ports_paths_and_wildcards_do_not() {
        assert!(!clashes("tcp://127.0.0.1:5570", "tcp://127.0.0.1:5571"));
        assert!(!clashes("tcp://127.0.0.1:5570", "tcp://127.0.0.2:5570"));
        assert!(!clashes("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"));
        assert!(!clashes("ipc://*", "ipc://*"));
        assert!(!clashes("ipc:///run/d/x.sock", "ipc:///run/d/y.sock"));
        assert!(!clashes("ipc://@x", "ipc:///x"));
        assert!(!clashes("inproc://q", "ipc://q"));
        assert!(!clashes("tcp://eth0:5570", "tcp://eth1:5570"));
        assert!(!clashes("tcp://0.0.0.0:5570", "tcp://[::1]:5570"));
    }

    #[test]
    fn the_metrics_listener_clashes_with_a_zeromq_bind_on_its_port() {
        let metrics: SocketAddr = "127.0.0.1:9570".parse().unwrap();
        assert!(clash(&place_of_endpoint("tcp://*:9570"), &place_of_socket(metrics)));
        assert!(clash(&place_of_endpoint("tcp://127.0.0.1:9570"), &place_of_socket(metrics)));
        assert!(!clash(&place_of_endpoint("tcp://127.0.0.1:9571"), &place_of_socket(metrics)));
    }
}
