//! The cap on connected peers per bound socket (`server.*_max_peers`),
//! enforced by the ZAP handler from counts that libzmq's socket monitors
//! keep: peers within the cap are served, a new one beyond it is refused
//! during its handshake and counted, peers already connected are never
//! touched, and each socket has its own cap.

use std::collections::HashMap;

use crate::common::*;
use serde_json::json;

fn connected(d: &Daemon, socket: &str) -> Option<f64> {
    d.metric(&format!("dpcoord_peers_connected{{socket=\"{socket}\"}}"))
}

fn refused(d: &Daemon, socket: &str) -> Option<f64> {
    refused_for(d, socket, "socket_full")
}

fn refused_for(d: &Daemon, socket: &str, reason: &str) -> Option<f64> {
    d.metric(&format!("dpcoord_peers_refused_total{{reason=\"{reason}\",socket=\"{socket}\"}}"))
}

/// Polls until `series` reads exactly `want`.
fn reaches(what: &str, want: f64, mut read: impl FnMut() -> Option<f64>) {
    eventually(&format!("{what} = {want}"), || (read() == Some(want)).then_some(()));
}

/// A dpcoord whose route and health sockets hold at most 5 peers each,
/// its route socket on `route` (a private ipc endpoint when `None`).
fn capped(route: Option<&str>, dir: &tempfile::TempDir) -> Daemon {
    let config = dir.path().join("dpcoord.toml");
    std::fs::write(&config, "[server]\nroute_max_peers = 5\nhealth_max_peers = 5\n").unwrap();
    let d = Daemon::start_with_route(route, &["--config", config.to_str().unwrap()]);
    // The readiness check's client has left.
    reaches("route peers", 0.0, || connected(&d, "route"));
    reaches("health peers", 0.0, || connected(&d, "health"));
    d
}

fn dealer(ctx: &zmq::Context, endpoint: &str) -> zmq::Socket {
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    s.connect(endpoint).unwrap();
    s
}

fn ping(s: &zmq::Socket, id: u64) {
    assert_eq!(dealer_call(s, vec![query("ping", id, &[])])["id"], json!(id));
}

/// Five peers are served; a sixth is refused (exactly once: it is told not
/// to reconnect) and never answered while the five stay; the gauge reads
/// the connected count; the health socket is not affected; once one of the
/// five leaves, a new peer is served.
fn cap_holds(route: &str, d: &Daemon) {
    let ctx = zmq::Context::new();
    let five: Vec<zmq::Socket> = (0..5).map(|_| dealer(&ctx, route)).collect();
    for (i, s) in five.iter().enumerate() {
        ping(s, i as u64);
    }
    reaches("route peers", 5.0, || connected(d, "route"));
    assert_eq!(refused(d, "route"), Some(0.0));

    let sixth = ctx.socket(zmq::DEALER).unwrap();
    sixth.set_linger(0).unwrap();
    sixth.set_reconnect_ivl(-1).unwrap();
    // Refused before the send, a DEALER that may not reconnect has no pipe and
    // would block on a send for good: bounded, and its outcome is not the point.
    sixth.set_sndtimeo(DEADLINE.as_millis() as i32).unwrap();
    sixth.connect(route).unwrap();
    let _ = sixth.send_multipart(vec![Vec::new(), query("ping", 6, &[])], 0);
    reaches("route refusals", 1.0, || refused(d, "route"));
    // Its connection is closed: the gauge is back at the five.
    reaches("route peers", 5.0, || connected(d, "route"));
    assert_eq!(sixth.poll(zmq::POLLIN, 300).unwrap(), 0, "the sixth peer was answered");
    assert_eq!(refused(d, "route"), Some(1.0));
    for (i, s) in five.iter().enumerate() {
        ping(s, 10 + i as u64);
    }

    // The health socket has a cap of its own.
    let health = d.health_client();
    assert_eq!(health.call(json!({"v": 1, "op": "ping", "id": 1}))["ok"], json!(true));
    reaches("health peers", 1.0, || connected(d, "health"));
    assert_eq!(refused(d, "health"), Some(0.0));

    let mut five = five;
    drop(five.pop());
    reaches("route peers", 4.0, || connected(d, "route"));
    let newcomer = dealer(&ctx, route);
    ping(&newcomer, 20);
    reaches("route peers", 5.0, || connected(d, "route"));
    assert_eq!(refused(d, "route"), Some(1.0));
}

#[test]
fn the_sixth_peer_of_an_ipc_socket_capped_at_five_is_refused_until_one_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let d = capped(None, &dir);
    cap_holds(&d.route.clone(), &d);
}

#[test]
fn the_sixth_peer_of_a_tcp_socket_capped_at_five_is_refused_until_one_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let route = format!("tcp://127.0.0.1:{}", free_port());
    let d = capped(Some(&route), &dir);
    cap_holds(&route, &d);
}

/// A reload raises the cap for the next connections; the peers already
/// connected stay.
#[test]
fn a_reload_changes_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let d = capped(None, &dir);
    let ctx = zmq::Context::new();
    let five: Vec<zmq::Socket> = (0..5).map(|_| dealer(&ctx, &d.route)).collect();
    for (i, s) in five.iter().enumerate() {
        ping(s, i as u64);
    }
    std::fs::write(dir.path().join("dpcoord.toml"), "[server]\nroute_max_peers = 6\nhealth_max_peers = 5\n").unwrap();
    let r = d.health_client().call(json!({"v": 1, "op": "reload", "id": 1}));
    assert_eq!(r["ok"], json!(true), "{r}");
    let sixth = dealer(&ctx, &d.route);
    ping(&sixth, 6);
    reaches("route peers", 6.0, || connected(&d, "route"));
    assert_eq!(refused(&d, "route"), Some(0.0));
}

/// A DEALER connected to `route` (a tcp endpoint) from `source`, one of
/// loopback's other addresses (libzmq's `tcp://source;destination` form).
fn dealer_from(ctx: &zmq::Context, source: &str, route: &str) -> zmq::Socket {
    let destination = route.strip_prefix("tcp://").unwrap();
    let s = ctx.socket(zmq::DEALER).unwrap();
    s.set_linger(0).unwrap();
    s.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    s.set_reconnect_ivl(-1).unwrap();
    s.connect(&format!("tcp://{source}:0;{destination}")).unwrap();
    s
}

/// One address holds at most `max_peers_per_address` of a socket, so a
/// host that opens many connections leaves room for the others; the
/// socket's own cap still bounds them all. Route socket capped at 5, two
/// per address: 127.0.0.2 gets two and its third is refused
/// (`address_full`), 127.0.0.3 and 127.0.0.1 get theirs, and the socket's
/// sixth peer, from a fourth address, is refused (`socket_full`).
#[test]
fn one_address_holds_at_most_its_share_of_a_socket() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("dpcoord.toml");
    std::fs::write(&config, "[server]\nroute_max_peers = 5\nmax_peers_per_address = 2\n").unwrap();
    let route = format!("tcp://127.0.0.1:{}", free_port());
    let d = Daemon::start_with_route(Some(&route), &["--config", config.to_str().unwrap()]);
    reaches("route peers", 0.0, || connected(&d, "route"));
    let ctx = zmq::Context::new();
    let first: Vec<zmq::Socket> = (0..2).map(|_| dealer_from(&ctx, "127.0.0.2", &route)).collect();
    for (i, s) in first.iter().enumerate() {
        ping(s, i as u64);
    }
    let third = dealer_from(&ctx, "127.0.0.2", &route);
    dealer_send(&third, vec![query("ping", 3, &[])]);
    reaches("address refusals", 1.0, || refused_for(&d, "route", "address_full"));
    reaches("route peers", 2.0, || connected(&d, "route"));
    assert_eq!(third.poll(zmq::POLLIN, 300).unwrap(), 0, "the third peer of 127.0.0.2 was answered");

    let others = [dealer_from(&ctx, "127.0.0.3", &route), dealer_from(&ctx, "127.0.0.3", &route), dealer(&ctx, &route)];
    for (i, s) in others.iter().enumerate() {
        ping(s, 10 + i as u64);
    }
    reaches("route peers", 5.0, || connected(&d, "route"));
    let sixth = dealer_from(&ctx, "127.0.0.4", &route);
    dealer_send(&sixth, vec![query("ping", 6, &[])]);
    reaches("socket refusals", 1.0, || refused(&d, "route"));
    assert_eq!(refused_for(&d, "route", "address_full"), Some(1.0));
    assert_eq!(sixth.poll(zmq::POLLIN, 300).unwrap(), 0, "the socket's sixth peer was answered");

    // One of 127.0.0.2's leaves: its address may connect once more.
    drop(first);
    reaches("route peers", 3.0, || connected(&d, "route"));
    let again = dealer_from(&ctx, "127.0.0.2", &route);
    ping(&again, 20);
    assert_eq!([refused(&d, "route"), refused_for(&d, "route", "address_full")], [Some(1.0), Some(1.0)]);
}

/// A peer that connects and never greets (a bare TCP connection) is closed
/// when the 5 s handshake deadline passes, freeing its slot: with the cap
/// at five held by five silent connections, a frontend is served once
/// their deadline has passed.
#[test]
fn silent_connections_are_closed_at_the_handshake_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let route = format!("tcp://127.0.0.1:{}", free_port());
    let d = capped(Some(&route), &dir);
    let port: u16 = route.rsplit(':').next().unwrap().parse().unwrap();
    let silent: Vec<std::net::TcpStream> =
        (0..5).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    reaches("route peers", 5.0, || connected(&d, "route"));
    let started = std::time::Instant::now();
    reaches("route peers", 0.0, || connected(&d, "route"));
    let waited = started.elapsed();
    println!("five silent connections closed after {waited:?}");
    ping(&dealer(&zmq::Context::new(), &route), 1);
    assert_eq!(refused(&d, "route"), Some(0.0));
    drop(silent);
}

/// TCP connections beyond the cap are closed as soon as they are accepted,
/// whether or not they would ever greet: with the cap of five held by five
/// DEALERs, 20 bare TCP connections (which before were held until their
/// handshake deadline, each with a descriptor) are all closed by dpcoord,
/// each counted once, and the five are still served.
#[test]
fn connections_beyond_the_cap_are_closed_when_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let route = format!("tcp://127.0.0.1:{}", free_port());
    let d = capped(Some(&route), &dir);
    let ctx = zmq::Context::new();
    let five: Vec<zmq::Socket> = (0..5).map(|_| dealer(&ctx, &route)).collect();
    for (i, s) in five.iter().enumerate() {
        ping(s, i as u64);
    }
    let port: u16 = route.rsplit(':').next().unwrap().parse().unwrap();
    let silent: Vec<std::net::TcpStream> =
        (0..20).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    for s in &silent {
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        let mut buf = [0u8; 64];
        // dpcoord's greeting may come first; then the end of the stream.
        loop {
            match std::io::Read::read(&mut &*s, &mut buf) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("a connection beyond the cap was not closed: {e}"),
            }
        }
    }
    reaches("refusals", 20.0, || refused(&d, "route"));
    reaches("route peers", 5.0, || connected(&d, "route"));
    for (i, s) in five.iter().enumerate() {
        ping(s, 10 + i as u64);
    }
    assert_eq!(refused(&d, "route"), Some(20.0));
}

/// What the count rests on, checked against the vendored libzmq (4.3):
/// every accepted connection, whether admitted, refused by ZAP during its
/// handshake, or closed before any handshake, ends with exactly one
/// `DISCONNECTED`, carrying the file descriptor its `ACCEPTED` carried.
#[test]
fn libzmq_ends_every_accepted_connection_with_one_disconnect() {
    let ctx = zmq::Context::new();
    let zap = ctx.socket(zmq::REP).unwrap();
    zap.bind("inproc://zeromq.zap.01").unwrap();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.set_zap_domain("route").unwrap();
    let events = (zmq::SocketEvent::ACCEPTED as i32) | (zmq::SocketEvent::DISCONNECTED as i32);
    router.monitor("inproc://events", events).unwrap();
    let monitor = ctx.socket(zmq::PAIR).unwrap();
    monitor.connect("inproc://events").unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = router.get_last_endpoint().unwrap().unwrap();
    let port: u16 = endpoint.rsplit(':').next().unwrap().parse().unwrap();

    // Peers admitted (even ZAP request ids) and refused (odd), then raw TCP
    // connections that never greet.
    let peers_ctx = zmq::Context::new();
    let peers: Vec<zmq::Socket> = (0..10)
        .map(|_| {
            let s = dealer(&peers_ctx, &endpoint);
            s.set_reconnect_ivl(-1).unwrap();
            s.send("hi", 0).unwrap();
            s
        })
        .collect();
    let mut answered = 0;
    eventually("10 ZAP requests", || {
        while let Ok(f) = zap.recv_multipart(zmq::DONTWAIT) {
            let code: &[u8] = if answered % 2 == 0 { b"200" } else { b"400" };
            zap.send_multipart([&b"1.0"[..], &f[1], code, b"", b"", b""], 0).unwrap();
            answered += 1;
        }
        (answered == 10).then_some(())
    });
    let raw: Vec<std::net::TcpStream> =
        (0..5).map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).unwrap()).collect();
    let mut open: HashMap<u32, i32> = HashMap::new();
    let (mut accepted, mut disconnected) = (0, 0);
    let mut read = |open: &mut HashMap<u32, i32>| {
        while let Ok(f) = monitor.recv_multipart(zmq::DONTWAIT) {
            let id = u16::from_ne_bytes([f[0][0], f[0][1]]);
            let fd = u32::from_ne_bytes(f[0][2..6].try_into().unwrap());
            match id {
                x if x == zmq::SocketEvent::ACCEPTED as u16 => {
                    accepted += 1;
                    *open.entry(fd).or_default() += 1;
                }
                x if x == zmq::SocketEvent::DISCONNECTED as u16 => {
                    disconnected += 1;
                    *open.entry(fd).or_default() -= 1;
                }
                other => panic!("event {other} was not asked for"),
            }
            assert!(open.values().all(|&n| n == 0 || n == 1), "a descriptor disconnected before it was accepted");
        }
        (accepted, disconnected)
    };
    eventually("15 connections accepted", || (read(&mut open).0 == 15).then_some(()));
    drop(peers);
    drop(raw);
    eventually("every connection disconnected", || (read(&mut open) == (15, 15)).then_some(()));
    assert!(open.values().all(|&n| n == 0));
    assert_eq!(monitor.poll(zmq::POLLIN, 200).unwrap(), 0, "a connection ended twice");
}
