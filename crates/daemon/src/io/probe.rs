//! `dpcoord probe`: GET `/healthz` (or `/readyz`) of a running dpcoord and
//! exit 0 on `200`, 1 otherwise, so container health checks need no curl.
//!
//! std only: one `TcpStream` under a single deadline (resolving, connecting,
//! writing and reading each get what is left of it), a minimal HTTP/1.1 GET
//! with `Connection: close`, and the status line parsed. It never waits past
//! `--timeout-ms`.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What the probe checks when neither `--url` nor [`URL_ENV`] is given.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9570/healthz";
/// The environment variable read when `--url` is not given (the Dockerfile sets it).
pub const URL_ENV: &str = "DPCOORD_HEALTH_URL";
/// Reading stops here; the status line and the body's first line come first.
const MAX_RESPONSE: usize = 64 * 1024;
/// How much of the body's first line a message shows.
const MAX_SHOWN: usize = 200;

#[derive(clap::Args, Debug)]
pub struct ProbeArgs {
    /// URL to GET, as http://HOST:PORT/PATH [default: $DPCOORD_HEALTH_URL, else http://127.0.0.1:9570/healthz]
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,
    /// Check /readyz (on the URL's host and port) instead of the URL's path
    #[arg(long)]
    pub ready: bool,
    /// Give up after this many milliseconds in all
    #[arg(long, value_name = "MS", default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub timeout_ms: u64,
}

/// An `http://HOST:PORT/PATH` URL (HOST a name, an IPv4 or a bracketed IPv6 address).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    /// As written (IPv6 in brackets), for the `Host` header.
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl Url {
    pub fn parse(s: &str) -> Result<Url, String> {
        let bad = || format!("`{s}` is not a URL of the form http://HOST:PORT/PATH");
        let rest = s.strip_prefix("http://").ok_or_else(bad)?;
        let (authority, path) = rest.find('/').map(|i| rest.split_at(i)).ok_or_else(bad)?;
        let (host, port) = authority.rsplit_once(':').ok_or_else(bad)?;
        let port_ok = !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit());
        let port = port.parse::<u16>().ok().filter(|&p| p != 0 && port_ok).ok_or_else(bad)?;
        let host_ok = match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
            Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
            None => !host.is_empty() && host.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.'),
        };
        if !host_ok || !path.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad());
        }
        Ok(Url { host: host.to_owned(), port, path: path.to_owned() })
    }
}

impl std::fmt::Display for Url {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "http://{}:{}{}", self.host, self.port, self.path)
    }
}

/// The URL the arguments name: `--url`, else [`URL_ENV`], else [`DEFAULT_URL`];
/// with `--ready` its path becomes `/readyz`. `Err` names the bad source.
pub fn target(args: &ProbeArgs, env: Option<String>) -> Result<Url, String> {
    let (source, text) = match (&args.url, env.filter(|e| !e.is_empty())) {
        (Some(url), _) => ("--url", url.clone()),
        (None, Some(env)) => (URL_ENV, env),
        (None, None) => ("--url", DEFAULT_URL.to_owned()),
    };
    let mut url = Url::parse(&text).map_err(|e| format!("{source}: {e}"))?;
    if args.ready {
        url.path = "/readyz".into();
    }
    Ok(url)
}

/// What is left until `deadline`; `Err` once it has passed.
fn left(deadline: Instant, timeout: Duration, doing: &str) -> Result<Duration, String> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(format!("timed out after {} ms {doing}", timeout.as_millis()));
    }
    Ok(d)
}

/// The URL's addresses; a name is resolved on a thread so that a slow
/// resolver cannot outlast the deadline.
fn resolve(url: &Url, deadline: Instant, timeout: Duration) -> Result<Vec<SocketAddr>, String> {
    let host = url.host.trim_start_matches('[').trim_end_matches(']').to_owned();
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, url.port)]);
    }
    let (tx, rx) = mpsc::channel();
    let port = url.port;
    std::thread::Builder::new()
        .spawn(move || tx.send((host.as_str(), port).to_socket_addrs().map(Vec::from_iter)))
        .map_err(|e| format!("cannot start a resolver thread: {e}"))?;
    match rx.recv_timeout(left(deadline, timeout, "resolving the host")?) {
        Ok(Ok(addrs)) if !addrs.is_empty() => Ok(addrs),
        Ok(Ok(_)) => Err(format!("{} has no address", url.host)),
        Ok(Err(e)) => Err(format!("cannot resolve {}: {e}", url.host)),
        Err(_) => Err(format!("timed out after {} ms resolving the host", timeout.as_millis())),
    }
}

/// One line for an I/O error, timeouts named as such.
fn io_problem(e: &std::io::Error, timeout: Duration, doing: &str) -> String {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => {
            format!("timed out after {} ms {doing}", timeout.as_millis())
        }
        std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
        _ => format!("{doing}: {e}"),
    }
}

fn connect(url: &Url, deadline: Instant, timeout: Duration) -> Result<TcpStream, String> {
    let mut last = String::from("no address to connect to");
    for addr in resolve(url, deadline, timeout)? {
        match TcpStream::connect_timeout(&addr, left(deadline, timeout, "connecting")?) {
            Ok(s) => return Ok(s),
            Err(e) => last = io_problem(&e, timeout, "connecting"),
        }
    }
    Err(last)
}

/// The status code and the body's first line of a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub first_line: String,
}

/// Parses `buf` once it holds the status line, the headers and the body's
/// first line (or the whole body); `None` while more is needed and may come
/// (`eof` false).
pub fn parse_response(buf: &[u8], eof: bool) -> Option<Result<Response, String>> {
    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return eof.then(|| Err("the connection closed before a complete response".into()));
    };
    let head = String::from_utf8_lossy(&buf[..end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = match status_line.split(' ').collect::<Vec<_>>()[..] {
        [version, code, ..] if version.starts_with("HTTP/1.") && code.len() == 3 => code.parse::<u16>().ok(),
        _ => None,
    };
    let Some(status) = status else {
        return Some(Err(format!("not an HTTP response: {}", shown(status_line.as_bytes()))));
    };
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_ascii_lowercase())
        })
    };
    let mut body = &buf[end + 4..];
    if header("transfer-encoding").is_some_and(|t| t.contains("chunked")) {
        // Skip the first chunk's size line.
        match body.windows(2).position(|w| w == b"\r\n") {
            Some(i) => body = &body[i + 2..],
            None => return eof.then(|| Ok(Response { status, first_line: String::new() })),
        }
    }
    let length = header("content-length").and_then(|l| l.parse::<usize>().ok());
    let first = match body.iter().position(|&b| b == b'\n') {
        Some(i) => &body[..i],
        None if eof || length.is_some_and(|l| body.len() >= l) => body,
        None => return None,
    };
    Some(Ok(Response { status, first_line: shown(first) }))
}

/// At most [`MAX_SHOWN`] characters of `bytes`, without the line end.
fn shown(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim_end_matches(['\r', '\n']).chars().take(MAX_SHOWN).collect()
}

/// GETs `url` within `timeout`; the response, or what went wrong in one line.
pub fn get(url: &Url, timeout: Duration) -> Result<Response, String> {
    let deadline = Instant::now() + timeout;
    let mut s = connect(url, deadline, timeout)?;
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}:{}\r\nUser-Agent: dpcoord-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        url.path, url.host, url.port
    );
    s.set_write_timeout(Some(left(deadline, timeout, "sending the request")?))
        .and_then(|()| s.write_all(request.as_bytes()))
        .map_err(|e| io_problem(&e, timeout, "sending the request"))?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let waiting = "waiting for the response";
        s.set_read_timeout(Some(left(deadline, timeout, waiting)?)).map_err(|e| io_problem(&e, timeout, waiting))?;
        let n = s.read(&mut chunk).map_err(|e| io_problem(&e, timeout, waiting))?;
        buf.extend_from_slice(&chunk[..n]);
        if let Some(parsed) = parse_response(&buf, n == 0 || buf.len() >= MAX_RESPONSE) {
            return parsed;
        }
    }
}

/// Runs `dpcoord probe`: 0 on `200`, 1 on anything else (one line on
/// stderr), 2 on a bad URL.
pub fn main(args: &ProbeArgs) -> ExitCode {
    let url = match target(args, std::env::var(URL_ENV).ok()) {
        Ok(url) => url,
        Err(e) => {
            eprintln!("dpcoord: error: {e}");
            return ExitCode::from(2);
        }
    };
    match get(&url, Duration::from_millis(args.timeout_ms)) {
        Ok(r) if r.status == 200 => {
            println!("{url}: 200 {}", r.first_line);
            ExitCode::SUCCESS
        }
        Ok(r) => {
            let body = if r.first_line.is_empty() { String::new() } else { format!(": {}", r.first_line) };
            eprintln!("dpcoord probe: {url}: HTTP {}{body}", r.status);
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("dpcoord probe: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let u = Url::parse("http://127.0.0.1:9570/healthz").unwrap();
        assert_eq!((u.host.as_str(), u.port, u.path.as_str()), ("127.0.0.1", 9570, "/healthz"));
        assert_eq!(Url::parse("http://[::1]:80/readyz").unwrap().host, "[::1]");
        assert_eq!(Url::parse("http://dpcoord.llm.svc:9570/").unwrap().to_string(), "http://dpcoord.llm.svc:9570/");
        for bad in [
            "",
            "127.0.0.1:9570/healthz",
            "https://127.0.0.1:9570/healthz",
            "http://127.0.0.1/healthz",
            "http://127.0.0.1:9570",
            "http://:9570/healthz",
            "http://127.0.0.1:0/healthz",
            "http://127.0.0.1:+80/healthz",
            "http://127.0.0.1:99999/healthz",
            "http://user@host:1/x",
            "http://::1:80/x",
            "http://h:1/a b",
        ] {
            assert!(Url::parse(bad).is_err(), "{bad}");
        }
    }

    fn args(url: Option<&str>, ready: bool) -> ProbeArgs {
        ProbeArgs { url: url.map(str::to_owned), ready, timeout_ms: 2000 }
    }

    #[test]
    fn the_url_comes_from_the_flag_then_the_environment_then_the_default() {
        let env = Some("http://10.0.0.1:1/healthz".to_owned());
        assert_eq!(target(&args(Some("http://h:2/x"), false), env.clone()).unwrap().to_string(), "http://h:2/x");
        assert_eq!(target(&args(None, false), env.clone()).unwrap().to_string(), "http://10.0.0.1:1/healthz");
        assert_eq!(target(&args(None, true), env).unwrap().to_string(), "http://10.0.0.1:1/readyz");
        assert_eq!(target(&args(None, false), Some(String::new())).unwrap().to_string(), DEFAULT_URL);
        assert!(target(&args(None, false), Some("nope".into())).unwrap_err().starts_with("DPCOORD_HEALTH_URL: "));
        assert!(target(&args(Some("nope"), false), None).unwrap_err().starts_with("--url: "));
    }

    #[test]
    fn responses() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nok\nmore\n";
        assert_eq!(parse_response(ok, false), Some(Ok(Response { status: 200, first_line: "ok".into() })));
        let unready = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\nnot ready";
        assert_eq!(parse_response(unready, false).unwrap().unwrap().first_line, "not ready");
        assert_eq!(parse_response(&unready[..40], false), None);
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\n\r\npartial", false), None);
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\n\r\npartial", true).unwrap().unwrap().first_line, "partial");
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nok\n\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked, false).unwrap().unwrap().first_line, "ok");
        assert!(parse_response(b"SSH-2.0-OpenSSH\r\n\r\n", false).unwrap().is_err());
        assert!(parse_response(b"HTTP/1.1 200", true).unwrap().is_err());
    }
}
