//! Peer allowlists for TCP sockets ([`crate::config::Allowlist`]), enforced
//! through libzmq's ZAP handler.
//!
//! libzmq asks a ZAP handler (a REP socket on `inproc://zeromq.zap.01`)
//! about every new connection to a socket that has a ZAP domain. dpcoord
//! sets the domain (`route`, `health`, `stats`) on every bound socket, tcp
//! and ipc alike (libzmq asks about NULL-mechanism peers only when a domain
//! is set), and answers 200 when the peer's IP falls in one of the socket's
//! networks (or the list is empty) and the socket holds fewer peers than its
//! cap (`io::peers`), 400 otherwise. This module parses requests and builds
//! replies; the transport owns the socket. The vendored libzmq has no CURVE,
//! so traffic itself is not encrypted: use network policy for the rest.

/// The fields of a ZAP request that the decision needs (RFC 27).
#[derive(Debug, PartialEq, Eq)]
pub struct ZapRequest<'a> {
    pub request_id: &'a [u8],
    pub domain: &'a str,
    pub address: &'a str,
}

/// Reads a ZAP request: version "1.0", request id, domain, address, identity, mechanism, credentials...
pub fn parse_request(frames: &[Vec<u8>]) -> Option<ZapRequest<'_>> {
    match frames {
        [version, request_id, domain, address, _identity, _mechanism, ..] if version.as_slice() == b"1.0" => {
            Some(ZapRequest {
                request_id,
                domain: std::str::from_utf8(domain).ok()?,
                address: std::str::from_utf8(address).ok()?,
            })
        }
        _ => None,
    }
}

/// What the ZAP handler answers a new peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Admit,
    /// Its address is not in the socket's allowlist.
    NotAllowed,
    /// Its socket holds its cap of connected peers (`io::peers`; ipc
    /// peers: TCP peers beyond a cap are closed before their handshake).
    Full,
}

/// The reply frames: version, request id, status code, text, user id, metadata.
///
/// Both refusals are 400: libzmq sends the peer an ERROR and the peer
/// closes the connection within milliseconds. A 300 ("temporary") sends no
/// ERROR, and libzmq 4.3 then keeps the connection open until its handshake
/// interval (30 s) ends, at about 32 KB each: a refusal would cost as much
/// as an admitted peer, and the cap would not bound memory. A libzmq peer
/// that receives the ERROR usually does not reconnect that socket
/// (docs/failure-behaviour.md, "Memory ceiling").
pub fn reply(request_id: &[u8], verdict: Verdict) -> [Vec<u8>; 6] {
    let (code, text): (&[u8], &[u8]) = match verdict {
        Verdict::Admit => (b"200", b"OK"),
        Verdict::NotAllowed => (b"400", b"address not allowed"),
        Verdict::Full => (b"400", b"too many peers"),
    };
    [b"1.0".to_vec(), request_id.to_vec(), code.to_vec(), text.to_vec(), Vec::new(), Vec::new()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zap_request_and_reply_frames() {
        let frames: Vec<Vec<u8>> =
            ["1.0", "7", "route", "10.0.0.1", "", "NULL"].iter().map(|s| s.as_bytes().to_vec()).collect();
        let req = parse_request(&frames).unwrap();
        assert_eq!(req, ZapRequest { request_id: b"7", domain: "route", address: "10.0.0.1" });
        assert_eq!(parse_request(&frames[..5]), None);
        let r = reply(b"7", Verdict::NotAllowed);
        assert_eq!((r[0].as_slice(), r[1].as_slice(), r[2].as_slice()), (&b"1.0"[..], &b"7"[..], &b"400"[..]));
    }
}
