//! Plain HTTP/1.1 against the metrics server, and reading `/metrics`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};

use super::{eventually, DEADLINE};

/// One HTTP/1.1 request with `Connection: close`; returns the whole response as sent.
pub fn http_raw(addr: SocketAddr, method: &str, path: &str) -> String {
    let mut s = eventually("http connect", || TcpStream::connect(addr).ok());
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw
}

/// One HTTP/1.1 request with `Connection: close`; returns (status, body).
pub fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let raw = http_raw(addr, method, path);
    let status = raw.split(' ').nth(1).and_then(|c| c.parse().ok()).expect("HTTP status line");
    let body = raw.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    (status, body)
}

/// The value of `series` in a `/metrics` body; `None` if absent.
pub fn series(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// The value of `series` scraped from the `/metrics` server at `addr`; `None` if absent.
pub fn metric(addr: SocketAddr, name: &str) -> Option<f64> {
    let (status, body) = http(addr, "GET", "/metrics");
    assert_eq!(status, 200, "{body}");
    series(&body, name)
}
