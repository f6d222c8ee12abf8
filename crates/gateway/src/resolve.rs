//! Endpoint names turned into addresses, again and again, on a thread of
//! their own.
//!
//! A gateway forwards a request to the address the picker names
//! (`x-gateway-destination-endpoint` is an IP and a port: Envoy's
//! original-destination cluster does not look names up), while on
//! Kubernetes an engine is reached by a name whose address changes when its
//! pod is replaced (a StatefulSet pod behind a headless Service, a Service's
//! cluster IP). So each configured `host:port` is resolved here, at once and
//! then every [`EVERY`]; readers take the latest table without waiting. An
//! IP literal is used as written, never looked up. A name that does not
//! resolve leaves its slot empty (its rank is not offered) until it does,
//! and a name whose address changed is logged.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often names are looked up again.
pub const EVERY: Duration = Duration::from_secs(5);

/// The addresses of the endpoints, in their configured order.
pub type Addresses = Arc<[Option<SocketAddr>]>;

/// The resolver thread and the table it keeps.
pub struct Resolver {
    table: Arc<RwLock<Addresses>>,
    /// New endpoint lists for the thread; dropping it stops the thread.
    tx: Option<mpsc::Sender<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

/// `endpoint` as an address without a lookup, if it is an IP literal.
fn literal(endpoint: &str) -> Option<SocketAddr> {
    endpoint.parse().ok()
}

/// One lookup of `endpoint` (`host:port`): its first address.
fn lookup(endpoint: &str) -> Result<SocketAddr, String> {
    match endpoint.to_socket_addrs() {
        Ok(mut addrs) => addrs.next().ok_or_else(|| "the name has no address".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

/// Resolves every endpoint; `before` is the last table, for logging changes.
fn resolve_all(endpoints: &[String], before: &[Option<SocketAddr>]) -> Addresses {
    endpoints
        .iter()
        .enumerate()
        .map(|(i, ep)| {
            let was = before.get(i).copied().flatten();
            let first = i >= before.len();
            let now = literal(ep).map(Ok).unwrap_or_else(|| lookup(ep));
            match (&now, was) {
                (Ok(addr), Some(old)) if *addr != old => {
                    tracing::info!(endpoint = %ep, from = %old, to = %addr, "endpoint address changed");
                }
                // Once when it stops resolving (or never did), not every round.
                (Err(why), _) if first || was.is_some() => {
                    tracing::warn!(endpoint = %ep, reason = %why, "endpoint does not resolve; its rank is not offered");
                }
                _ => {}
            }
            now.ok()
        })
        .collect()
}

impl Resolver {
    /// Resolves `endpoints` once before returning (a literal costs nothing),
    /// then again every [`EVERY`] on a thread.
    pub fn start(endpoints: Vec<String>) -> Resolver {
        Resolver::with_interval(endpoints, EVERY)
    }

    fn with_interval(mut endpoints: Vec<String>, every: Duration) -> Resolver {
        let table = Arc::new(RwLock::new(resolve_all(&endpoints, &[])));
        let (tx, rx) = mpsc::channel::<Vec<String>>();
        let shared = Arc::clone(&table);
        let thread = std::thread::Builder::new()
            .name("dpcoord-resolve".into())
            .spawn(move || loop {
                match rx.recv_timeout(every) {
                    Ok(new) => endpoints = new,
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
                let before = Arc::clone(&shared.read().unwrap_or_else(|e| e.into_inner()));
                let after = resolve_all(&endpoints, &before);
                *shared.write().unwrap_or_else(|e| e.into_inner()) = after;
            })
            .ok();
        if thread.is_none() {
            tracing::warn!("could not start the resolver thread: endpoint names are resolved once");
        }
        Resolver { table, tx: Some(tx), thread }
    }

    /// The latest addresses, by configured position.
    pub fn addresses(&self) -> Addresses {
        Arc::clone(&self.table.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// New endpoints (a reload). The caller never waits on a lookup: IP
    /// literals are in the table before this returns, a name kept at its
    /// place keeps its address, and the thread looks up the rest at once.
    pub fn set(&self, endpoints: Vec<String>, before: &[String]) {
        let old = self.addresses();
        let table: Addresses = endpoints
            .iter()
            .enumerate()
            .map(|(i, ep)| {
                literal(ep).or_else(|| (before.get(i) == Some(ep)).then(|| old.get(i).copied().flatten())?)
            })
            .collect();
        *self.table.write().unwrap_or_else(|e| e.into_inner()) = table;
        if let Some(tx) = &self.tx {
            let _ = tx.send(endpoints);
        }
    }
}

impl Drop for Resolver {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            // The thread wakes at the closed channel; a lookup under way
            // finishes first (getaddrinfo has its own timeout).
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn literals_are_used_as_written_and_names_are_looked_up() {
        let r = Resolver::with_interval(strings(&["10.1.2.3:8000", "[fd00::7]:8001", "localhost:8002"]), EVERY);
        let got = r.addresses();
        assert_eq!(got[0], Some("10.1.2.3:8000".parse().unwrap()));
        assert_eq!(got[1].map(|a| a.to_string()), Some("[fd00::7]:8001".to_owned()));
        let local = got[2].expect("localhost resolves from /etc/hosts");
        assert!(local.ip().is_loopback() && local.port() == 8002, "{local}");
    }

    #[test]
    fn a_name_that_does_not_resolve_leaves_its_slot_empty() {
        // Refused before any lookup (tests ask no name server): no port, a
        // port out of range.
        let r = Resolver::with_interval(strings(&["127.0.0.1:1", "no-port", "localhost:99999"]), EVERY);
        assert_eq!(&r.addresses()[..], [Some("127.0.0.1:1".parse().unwrap()), None, None]);
    }

    #[test]
    fn a_name_kept_at_its_place_keeps_its_address_until_looked_up_again() {
        let r = Resolver::with_interval(strings(&["localhost:7"]), EVERY);
        let local = r.addresses()[0].expect("localhost resolves");
        // Moved to another place, it waits for the thread; kept, it stays.
        r.set(strings(&["10.0.0.1:1", "localhost:7"]), &strings(&["localhost:7"]));
        assert_eq!(r.addresses()[0], Some("10.0.0.1:1".parse().unwrap()));
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while r.addresses()[1].is_none() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(r.addresses()[1], Some(local), "the thread looked it up");
        r.set(strings(&["10.0.0.1:1", "localhost:7"]), &strings(&["10.0.0.1:1", "localhost:7"]));
        assert_eq!(r.addresses()[1], Some(local), "kept at once");
    }

    #[test]
    fn set_replaces_the_table_before_it_returns_and_the_thread_keeps_it() {
        let r = Resolver::with_interval(strings(&["127.0.0.1:1"]), Duration::from_millis(5));
        r.set(strings(&["127.0.0.2:2", "127.0.0.3:3"]), &strings(&["127.0.0.1:1"]));
        let want: Vec<Option<SocketAddr>> =
            vec![Some("127.0.0.2:2".parse().unwrap()), Some("127.0.0.3:3".parse().unwrap())];
        assert_eq!(&r.addresses()[..], &want[..]);
        // Several rounds of the thread later, the same table.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut rounds = 0;
        while rounds < 5 && std::time::Instant::now() < deadline {
            let before = r.addresses();
            std::thread::sleep(Duration::from_millis(10));
            if !Arc::ptr_eq(&before, &r.addresses()) {
                rounds += 1;
            }
        }
        assert_eq!(rounds, 5, "the thread resolved again");
        assert_eq!(&r.addresses()[..], &want[..]);
    }
}
