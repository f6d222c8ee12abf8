//! The gateway's endpoints as the addresses it forwards to. Envoy sends a
//! request to the `IP:port` the picker names and matches the subset hint
//! and the served endpoint as such, so a `host:port` of `gateway.endpoints`
//! given by name is resolved ([`crate::resolve`]: at once, then every
//! 5 s, on its own thread); an IP literal is used as written. Requests read
//! a resolved copy of the settings, rebuilt only when the settings (a
//! reload) or the addresses change.

use std::sync::{Arc, Mutex};

use crate::resolve::{Addresses, Resolver};
use dpcoord_daemon::config::Gateway;

pub struct Endpoints {
    resolver: Resolver,
    last: Mutex<Last>,
}

/// The settings and addresses the resolved copy was made from.
struct Last {
    configured: Arc<Gateway>,
    addresses: Addresses,
    resolved: Arc<Gateway>,
}

/// `g` with each endpoint replaced by its address, or by "" (no endpoint:
/// its ranks are not offered) while it does not resolve.
fn resolve(g: &Gateway, addresses: &Addresses) -> Arc<Gateway> {
    let endpoints = (0..g.endpoints.len())
        .map(|i| addresses.get(i).copied().flatten().map_or(String::new(), |a| a.to_string()))
        .collect();
    Arc::new(Gateway { endpoints, ..g.clone() })
}

impl Endpoints {
    pub fn new(configured: Arc<Gateway>) -> Endpoints {
        let resolver = Resolver::start(configured.endpoints.clone());
        let addresses = resolver.addresses();
        let resolved = resolve(&configured, &addresses);
        Endpoints { resolver, last: Mutex::new(Last { configured, addresses, resolved }) }
    }

    /// The settings in force, `configured`, with addresses for endpoints.
    pub fn resolved(&self, configured: Arc<Gateway>) -> Arc<Gateway> {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        let reloaded = !Arc::ptr_eq(&last.configured, &configured);
        if reloaded && last.configured.endpoints != configured.endpoints {
            self.resolver.set(configured.endpoints.clone(), &last.configured.endpoints);
        }
        let addresses = self.resolver.addresses();
        if reloaded || !Arc::ptr_eq(&addresses, &last.addresses) {
            last.resolved = resolve(&configured, &addresses);
            (last.configured, last.addresses) = (configured, addresses);
        }
        Arc::clone(&last.resolved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gateway(endpoints: &[&str], header: Option<&str>) -> Arc<Gateway> {
        let endpoints = endpoints.iter().map(|e| e.to_string()).collect();
        Arc::new(Gateway {
            endpoints,
            rank_header: header.map(str::to_owned),
            max_body_bytes: 1 << 20,
            ..Gateway::default()
        })
    }

    #[test]
    fn names_become_addresses_and_a_reload_is_taken_at_once() {
        let g = gateway(&["10.0.0.1:8000", "localhost:8001"], None);
        let e = Endpoints::new(Arc::clone(&g));
        let r = e.resolved(Arc::clone(&g));
        assert_eq!(r.endpoint(0), Some("10.0.0.1:8000"));
        let local: std::net::SocketAddr = r.endpoint(1).expect("localhost resolves").parse().unwrap();
        assert!(local.ip().is_loopback() && local.port() == 8001, "{local}");
        assert!(Arc::ptr_eq(&r, &e.resolved(g)), "unchanged settings and addresses: the same copy");
        let reloaded = gateway(&["10.0.0.9:9000"], Some("x-data-parallel-rank"));
        let r = e.resolved(reloaded);
        assert_eq!((r.endpoint(0), r.endpoint(5)), (Some("10.0.0.9:9000"), Some("10.0.0.9:9000")));
    }

    #[test]
    fn an_endpoint_without_an_address_serves_no_rank() {
        let g = gateway(&["10.0.0.1:8000", "10.0.0.2:8000"], None);
        let none: Addresses = Arc::from(vec![Some("10.0.0.1:8000".parse().unwrap()), None]);
        let r = resolve(&g, &none);
        assert_eq!((r.endpoint(0), r.endpoint(1)), (Some("10.0.0.1:8000"), None));
        assert_eq!(r.ranks_of("10.0.0.1:8000", 2).collect::<Vec<_>>(), [0]);
    }
}
