//! `dpcoord probe`: GET `/healthz` (or `/readyz`) of a running dpcoord and
//! exit 0 on `200`, 1 otherwise, so container health checks need no curl.
//!
//! The GET is `ureq`'s (plain HTTP, no proxy, no redirect followed) under one
//! overall timeout, `--timeout-ms`: resolving, connecting, sending, the
//! response head and the body up to its first line all share it. Reading
//! stops at the body's first line, so a body that never ends does not hold
//! the probe.

use std::io::{BufRead, BufReader, Read};
use std::process::ExitCode;
use std::time::Duration;

/// What the probe checks when neither `--url` nor [`URL_ENV`] is given.
pub const DEFAULT_URL: &str = "http://127.0.0.1:9570/healthz";
/// The environment variable read when `--url` is not given (the Dockerfile sets it).
pub const URL_ENV: &str = "DPCOORD_HEALTH_URL";
/// Reading the body stops here if no line has ended before.
const MAX_BODY: u64 = 64 * 1024;
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
        // What the client cannot send (`<`, `>`, a backquote) is no URL either.
        if !host_ok || !path.bytes().all(|b| b.is_ascii_graphic()) || ureq::http::Uri::try_from(s).is_err() {
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

/// The status code and the body's first line of a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub first_line: String,
}

/// At most [`MAX_SHOWN`] characters of `bytes`, without the line end.
fn shown(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim_end_matches(['\r', '\n']).chars().take(MAX_SHOWN).collect()
}

/// One line for what went wrong, a timeout named as such.
fn problem(e: ureq::Error, timeout: Duration) -> String {
    let timed_out = || format!("timed out after {} ms", timeout.as_millis());
    match e {
        ureq::Error::Timeout(_) => timed_out(),
        ureq::Error::Io(io) => match io.kind() {
            std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => timed_out(),
            std::io::ErrorKind::ConnectionRefused => "connection refused".into(),
            std::io::ErrorKind::UnexpectedEof => "the connection closed before a complete response".into(),
            _ => io.to_string(),
        },
        ureq::Error::Protocol(p) => format!("not an HTTP response: {p}"),
        e => e.to_string(),
    }
}

/// GETs `url` within `timeout`; the response, or what went wrong in one line.
pub fn get(url: &Url, timeout: Duration) -> Result<Response, String> {
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .max_redirects(0)
        // dpcoord is reached directly, whatever proxy the environment names.
        .proxy(None)
        .user_agent("dpcoord-probe")
        .build();
    let agent = ureq::Agent::new_with_config(config);
    let mut response = agent.get(url.to_string()).call().map_err(|e| problem(e, timeout))?;
    let mut first = Vec::new();
    BufReader::new(response.body_mut().as_reader().take(MAX_BODY))
        .read_until(b'\n', &mut first)
        .map_err(|e| problem(e.into(), timeout))?;
    Ok(Response { status: response.status().as_u16(), first_line: shown(&first) })
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
            "http://h:1/a<b",
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

    /// A listener that answers one GET with `pieces`, pausing `gap` after
    /// each (the last pause holds the connection open); its URL.
    fn serve(pieces: Vec<&'static [u8]>, gap: Duration) -> Url {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut byte = [0u8];
            while !request.ends_with(b"\r\n\r\n") && conn.read_exact(&mut byte).is_ok() {
                request.push(byte[0]);
            }
            for piece in pieces {
                // The probe may have gone once it has what it needs.
                let _ = std::io::Write::write_all(&mut conn, piece);
                std::thread::sleep(gap);
            }
        });
        Url { host: "127.0.0.1".into(), port, path: "/healthz".into() }
    }

    fn probe(reply: &'static [u8], hold: Duration, timeout_ms: u64) -> Result<Response, String> {
        get(&serve(vec![reply], hold), Duration::from_millis(timeout_ms))
    }

    fn ok(status: u16, first_line: &str) -> Result<Response, String> {
        Ok(Response { status, first_line: first_line.into() })
    }

    #[test]
    fn responses() {
        let now = Duration::ZERO;
        assert_eq!(probe(b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nok\nmore\n", now, 2000), ok(200, "ok"));
        let unready = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 9\r\n\r\nnot ready";
        assert_eq!(probe(unready, now, 2000), ok(503, "not ready"));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nok\n\r\n0\r\n\r\n";
        assert_eq!(probe(chunked, now, 2000), ok(200, "ok"));
        assert_eq!(probe(b"HTTP/1.1 200 OK\r\n\r\npartial", now, 2000), ok(200, "partial"));
        assert_eq!(probe(b"HTTP/1.1 204 No Content\r\n\r\n", now, 2000), ok(204, ""));
        // Not followed.
        assert_eq!(probe(b"HTTP/1.1 302 Found\r\nLocation: /\r\nContent-Length: 0\r\n\r\n", now, 2000), ok(302, ""));
        let long: &'static [u8] = format!("HTTP/1.1 200 OK\r\n\r\n{}", "x".repeat(100_000)).leak().as_bytes();
        assert_eq!(probe(long, now, 2000), ok(200, &"x".repeat(MAX_SHOWN)));
        let not_http = probe(b"SSH-2.0-OpenSSH\r\n\r\n", now, 2000).unwrap_err();
        assert!(not_http.starts_with("not an HTTP response"), "{not_http}");
        let cut = probe(b"HTTP/1.1 200", now, 2000).unwrap_err();
        assert_eq!(cut, "the connection closed before a complete response");
    }

    #[test]
    fn a_body_that_never_ends_is_read_to_its_first_line_only() {
        let start = std::time::Instant::now();
        assert_eq!(probe(b"HTTP/1.1 200 OK\r\n\r\nok\nand more", Duration::from_secs(5), 2000), ok(200, "ok"));
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    }

    #[test]
    fn one_timeout_covers_the_whole_request_body_included() {
        let hold = Duration::from_secs(5);
        for reply in [&b""[..], b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\n\r\nno line end yet"] {
            let start = std::time::Instant::now();
            assert_eq!(probe(reply, hold, 300), Err("timed out after 300 ms".into()));
            let took = start.elapsed();
            assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(1), "{took:?}");
        }
        // A byte every 100 ms keeps every read short, not the whole.
        let mut drip = vec![&b"HTTP/1.1 200 OK\r\n\r\n"[..]];
        drip.extend([&b"x"[..]; 30]);
        let start = std::time::Instant::now();
        let got = get(&serve(drip, Duration::from_millis(100)), Duration::from_millis(300));
        assert_eq!(got, Err("timed out after 300 ms".into()));
        assert!(start.elapsed() < Duration::from_secs(1), "{:?}", start.elapsed());
    }
}
