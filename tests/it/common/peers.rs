//! ZeroMQ peers of the daemon: a REQ client, DEALER calls and a stats publisher.

use std::time::Duration;

use serde_json::{json, Value};

use super::{encode, eventually, update, DEADLINE};

/// A socket of `kind` connected to `endpoint`: linger 0, and a receive that
/// fails after [`DEADLINE`].
pub fn connected(ctx: &zmq::Context, kind: zmq::SocketType, endpoint: &str) -> zmq::Socket {
    let s = ctx.socket(kind).unwrap();
    s.set_linger(0).unwrap();
    s.set_rcvtimeo(DEADLINE.as_millis() as i32).unwrap();
    s.connect(endpoint).unwrap();
    s
}

/// A REQ client; every call must be answered within [`DEADLINE`].
pub struct Client {
    sock: zmq::Socket,
}

impl Client {
    pub fn connect(ctx: &zmq::Context, endpoint: &str) -> Client {
        Client { sock: connected(ctx, zmq::REQ, endpoint) }
    }

    /// Sends raw bytes as one frame and decodes the reply.
    pub fn call_raw(&self, bytes: &[u8]) -> Value {
        self.send(bytes);
        self.recv()
    }

    /// The first half of [`Client::call_raw`].
    pub fn send(&self, bytes: &[u8]) {
        self.sock.send(bytes, 0).unwrap();
    }

    /// The second half of [`Client::call_raw`]: the decoded reply.
    pub fn recv(&self) -> Value {
        let reply = self.sock.recv_bytes(0).expect("dpcoord did not answer in time");
        rmp_serde::from_slice(&reply).expect("reply is a MessagePack map")
    }

    pub fn call(&self, query: Value) -> Value {
        self.call_raw(&encode(&query))
    }

    /// The error code of a refused query (panics if it was answered ok).
    pub fn error_code(&self, query: Value) -> String {
        let r = self.call(query);
        assert_eq!(r["ok"], json!(false), "expected an error, got {r}");
        r["error"]["code"].as_str().unwrap().to_owned()
    }

    /// The ranks a route query is answered with (fails the test on a refusal).
    pub fn route(&self, query: Value) -> Vec<u64> {
        let r = self.call(query.clone());
        assert_eq!(r["ok"], json!(true), "{query} -> {r}");
        ranks_of(&r)
    }

    /// The rank a `health_route` query is answered with (fails the test on a refusal).
    pub fn health_rank(&self, query: Value) -> u64 {
        let r = self.call(query.clone());
        assert_eq!(r["ok"], json!(true), "{query} -> {r}");
        r["rank"].as_u64().unwrap()
    }
}

/// The `ranks` of a route reply, as numbers.
pub fn ranks_of(reply: &Value) -> Vec<u64> {
    reply["ranks"]
        .as_array()
        .unwrap_or_else(|| panic!("no ranks in {reply}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The status of every rank in a `state` reply (or `/state` body), as an array.
pub fn statuses(state: &Value) -> Value {
    state["ranks"].as_array().unwrap().iter().map(|r| r["status"].clone()).collect()
}

/// How many of `ranks` went to each of `dp` ranks.
pub fn per_rank(ranks: &[u64], dp: usize) -> Vec<u64> {
    let mut count = vec![0; dp];
    ranks.iter().for_each(|&r| count[r as usize] += 1);
    count
}

/// Sends `body` from a DEALER (after the empty delimiter) and returns the
/// decoded reply, which must be the delimiter and one payload frame.
pub fn dealer_call(s: &zmq::Socket, body: Vec<Vec<u8>>) -> Value {
    dealer_send(s, body);
    dealer_reply(s)
}

/// Sends `body` from a DEALER, after the empty delimiter.
pub fn dealer_send(s: &zmq::Socket, body: Vec<Vec<u8>>) {
    let mut frames = vec![Vec::new()];
    frames.extend(body);
    s.send_multipart(frames, 0).unwrap();
}

/// The next reply to a DEALER: the empty delimiter, then one payload frame (decoded).
pub fn dealer_reply(s: &zmq::Socket) -> Value {
    let reply = s.recv_multipart(0).expect("dpcoord did not answer the DEALER in time");
    assert_eq!(reply.len(), 2, "reply is the empty delimiter and one payload frame");
    assert!(reply[0].is_empty(), "the delimiter comes back first");
    rmp_serde::from_slice(&reply[1]).unwrap()
}

pub struct Publisher {
    sock: zmq::Socket,
}

impl Publisher {
    /// A PUB socket connected to `endpoint` (a daemon's stats bind), with a 1 s linger.
    pub fn connect(ctx: &zmq::Context, endpoint: &str) -> Publisher {
        let sock = ctx.socket(zmq::PUB).unwrap();
        sock.set_linger(1000).unwrap();
        sock.connect(endpoint).unwrap();
        Publisher { sock }
    }

    pub fn send(&self, update: &Value) {
        self.send_raw(&encode(update));
    }

    pub fn send_raw(&self, bytes: &[u8]) {
        self.sock.send(bytes, 0).unwrap();
    }

    /// The PUB socket, for [`publish_until`].
    pub fn socket(&self) -> &zmq::Socket {
        &self.sock
    }
}

/// Publishes `update(rank, 1, seq, counts)` on `sock` with `seq` = `*seq`,
/// `*seq + 1`, ... every 10 ms until `done()` (PUB/SUB drops what is sent
/// before the subscription is wired); leaves `*seq` the next unsent one.
pub fn publish_until(
    what: &str,
    sock: &zmq::Socket,
    rank: u32,
    seq: &mut u64,
    counts: [u64; 5],
    mut done: impl FnMut() -> bool,
) {
    eventually(what, || {
        sock.send(encode(&update(rank, 1, *seq, counts)), 0).unwrap();
        *seq += 1;
        std::thread::sleep(Duration::from_millis(10));
        done().then_some(())
    });
}
