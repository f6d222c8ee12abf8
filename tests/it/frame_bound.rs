//! The frames of one message are bounded. libzmq 4.3.4 checks
//! each frame against `ZMQ_MAXMSGSIZE` and counts its high-water marks in
//! whole messages, so a peer that sends frames flagged MORE and never ends
//! the message made dpcoord hold every frame: 9 MB on the wire took it from
//! 9 to 197 MB. dpcoord builds libzmq with a patch (vendor/README.md) under
//! which the frames of a message share the limit, each frame before the
//! last counted as at least 64 bytes.
//!
//! The first test checks the patch's arithmetic on libzmq sockets (this
//! test binary links the same patched libzmq as dpcoord); the others attack
//! the real binary with a hand-written ZMTP peer, as a hostile one would:
//! on the route socket, and as a source dpcoord connects to.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};

use crate::common::*;
use serde_json::json;

/// What each frame before a message's last is counted as, at least.
const FRAME_FLOOR: usize = 64;
/// How many bytes of one-byte MORE frames the attacks send at most:
/// 5.6 million frames, which unpatched took dpcoord past 350 MB.
const FLOOD_BYTES: usize = 16 << 20;

/// A PULL bound with `ZMQ_MAXMSGSIZE` 1,000 receives `frames` from a PUSH:
/// `Some(frames)` if they arrived as one message, `None` if libzmq closed
/// the connection instead (its monitor saw `DISCONNECTED`).
fn through_a_limit_of_1000(frames: &[Vec<u8>]) -> Option<Vec<Vec<u8>>> {
    let ctx = zmq::Context::new();
    let pull = ctx.socket(zmq::PULL).unwrap();
    pull.set_maxmsgsize(1000).unwrap();
    pull.set_linger(0).unwrap();
    pull.monitor("inproc://pull", zmq::SocketEvent::DISCONNECTED as i32).unwrap();
    let monitor = ctx.socket(zmq::PAIR).unwrap();
    monitor.connect("inproc://pull").unwrap();
    let ep = format!("tcp://127.0.0.1:{}", free_port());
    pull.bind(&ep).unwrap();
    let push = ctx.socket(zmq::PUSH).unwrap();
    push.set_linger(0).unwrap();
    push.connect(&ep).unwrap();
    push.send_multipart(frames, 0).unwrap();
    eventually("the message, or the connection closed", || {
        if let Ok(message) = pull.recv_multipart(zmq::DONTWAIT) {
            return Some(Some(message));
        }
        monitor.recv_multipart(zmq::DONTWAIT).ok().map(|_| None)
    })
}

#[test]
fn the_frames_of_a_message_share_the_frame_limit() {
    let one = |n: usize| vec![vec![7u8]; n];
    // One frame: as libzmq has it, at most the limit.
    assert!(through_a_limit_of_1000(&[vec![1; 1000]]).is_some());
    assert_eq!(through_a_limit_of_1000(&[vec![1; 1001]]), None);
    // Frames share it: 500 + 500 fit, 500 + 501 do not.
    assert!(through_a_limit_of_1000(&[vec![1; 500], vec![2; 500]]).is_some());
    assert_eq!(through_a_limit_of_1000(&[vec![1; 500], vec![2; 501]]), None);
    // A one-byte frame before the last counts 64: 15 of them and a last
    // byte are 961, 16 and a last byte 1,025.
    assert_eq!(through_a_limit_of_1000(&one(16)), Some(one(16)));
    assert_eq!(through_a_limit_of_1000(&one(17)), None);
    assert_eq!(15 * FRAME_FLOOR + 1, 961);
    // Empty frames count too, so a message cannot be padded with them forever.
    let empties = |n: usize| vec![Vec::new(); n];
    assert!(through_a_limit_of_1000(&empties(16)).is_some());
    assert_eq!(through_a_limit_of_1000(&empties(17)), None);
}

/// The ZMTP 3.0 greeting of a peer using the NULL mechanism.
fn greeting() -> Vec<u8> {
    let mut g = vec![0u8; 64];
    (g[0], g[9], g[10]) = (0xff, 0x7f, 3);
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command of a `socket_type` peer.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend(b"READY");
    body.push(11);
    body.extend(b"Socket-Type");
    body.extend((socket_type.len() as u32).to_be_bytes());
    body.extend(socket_type.as_bytes());
    let mut command = vec![0x04, body.len() as u8];
    command.extend(body);
    command
}

/// The handshake as a `socket_type` peer: our greeting and READY, then
/// dpcoord's (its READY comes once its ZAP handler has admitted us; a
/// message sent before it would be a protocol error).
fn handshake(s: &mut TcpStream, socket_type: &str) {
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    s.write_all(&greeting()).unwrap();
    s.write_all(&ready(socket_type)).unwrap();
    let mut theirs = [0u8; 66];
    s.read_exact(&mut theirs).unwrap();
    assert_eq!((theirs[0], theirs[9], &theirs[12..16], theirs[64]), (0xff, 0x7f, &b"NULL"[..], 0x04));
    let mut command = vec![0u8; usize::from(theirs[65])];
    s.read_exact(&mut command).unwrap();
    assert_eq!(&command[..6], b"\x05READY");
}

/// After the handshake, one-byte frames flagged MORE, never a last one,
/// until the peer closes the connection. Returns how many bytes went out
/// before that; fails if all of [`FLOOD_BYTES`] did.
fn endless_message(mut s: TcpStream, socket_type: &str) -> usize {
    handshake(&mut s, socket_type);
    let chunk: Vec<u8> = [0x01u8, 1, b'x'].repeat(64 << 10);
    let mut sent = 0;
    while sent < FLOOD_BYTES {
        match s.write(&chunk) {
            Ok(n) => sent += n,
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) => return sent,
            Err(e) => panic!("writing the frames: {e}"),
        }
    }
    panic!("dpcoord took {sent} bytes of one message's frames and kept the connection");
}

/// A frontend whose one message never ends is disconnected once its frames
/// pass the route socket's limit (`limits.max_message_bytes` plus
/// 64 KiB: about 2,000 frames); dpcoord's memory
/// stays where it was, and a new frontend is answered.
#[test]
fn a_message_that_never_ends_closes_its_connection_on_the_route_socket() {
    let route = format!("tcp://127.0.0.1:{}", free_port());
    let d = Daemon::start_with_route(Some(&route), &[]);
    let before = status_kib(d.pid(), "VmRSS");
    let conn = TcpStream::connect(route.strip_prefix("tcp://").unwrap()).unwrap();
    conn.set_write_timeout(Some(DEADLINE)).unwrap();
    let sent = endless_message(conn, "DEALER");
    let peak = status_kib(d.pid(), "VmHWM");
    println!("route: closed after {sent} bytes were written; RSS before {before} KiB, peak {peak} KiB");
    assert!(peak < before + 16 * 1024, "peak RSS {peak} KiB, {before} KiB before the attack");
    assert!(peak < CEILING_KIB);
    let r = d.client().call(json!({"v": 1, "op": "ping", "id": 2}));
    assert_eq!((r["ok"].clone(), r["id"].clone()), (json!(true), json!(2)));
    assert_eq!(d.stop().code(), Some(0));
}

/// A source dpcoord connects to (here a stats publisher) that sends a
/// message that never ends: libzmq closes the link once its frames pass
/// the link's limit, dpcoord connects it again, and its memory stays where
/// it was.
#[test]
fn a_source_sending_a_message_that_never_ends_is_disconnected_and_connected_again() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = format!("tcp://{}", listener.local_addr().unwrap());
    let d = Daemon::frozen("1", &["--stats-connect", &ep]);
    let before = status_kib(d.pid(), "VmRSS");
    let (conn, _) = listener.accept().unwrap();
    conn.set_write_timeout(Some(DEADLINE)).unwrap();
    let sent = endless_message(conn, "PUB");
    let series = format!("dpcoord_source_reconnects_total{{endpoint=\"{ep}\",source=\"stats\"}}");
    eventually("the link connected again", || (d.metric(&series) == Some(1.0)).then_some(()));
    let (_again, _) = listener.accept().unwrap();
    let peak = status_kib(d.pid(), "VmHWM");
    println!("stats link: closed after {sent} bytes were written; RSS before {before} KiB, peak {peak} KiB");
    assert!(peak < before + 16 * 1024, "peak RSS {peak} KiB, {before} KiB before the attack");
    assert_eq!(d.stop().code(), Some(0));
}
