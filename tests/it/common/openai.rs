//! [`OpenAiServer`]: a small OpenAI-style engine for the proxy's tests, on
//! 127.0.0.1, one thread per connection, keep-alive. It records every
//! request it receives, serves vLLM's gauges on `/metrics` (the requests it
//! is answering as `running`), and answers a completion with one JSON
//! object, or, when the body asks to `stream`, with `data:` events sent one
//! at a time, the last only once the test opens the gate. Told a count of
//! cached prompt tokens, it reports it as vLLM does, in the `usage` of the
//! body or of the stream's last event before `[DONE]`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::DEADLINE;

/// A request as the engine received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    /// Header names lowercased.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
}

#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<Seen>>,
    running: AtomicU64,
    /// A streamed response's last event waits until this is set.
    gate_closed: AtomicBool,
    /// Every completion is answered with this status (0: 200).
    status: AtomicU16,
    /// `usage.prompt_tokens_details.cached_tokens` of every completion.
    cached: Mutex<Option<u64>>,
    stop: AtomicBool,
}

pub struct OpenAiServer {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
}

impl OpenAiServer {
    pub fn start() -> OpenAiServer {
        OpenAiServer::on(TcpListener::bind("127.0.0.1:0").unwrap())
    }

    /// Serves on `listener` (a port the test chose, say one that refused before).
    pub fn on(listener: TcpListener) -> OpenAiServer {
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let shared = Arc::new(Shared::default());
        let s = Arc::clone(&shared);
        std::thread::spawn(move || {
            while !s.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => {
                        let s = Arc::clone(&s);
                        std::thread::spawn(move || serve(conn, &s));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        OpenAiServer { addr, shared }
    }

    /// Every request received so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().unwrap().clone()
    }

    /// How many completions (POSTs) it received.
    pub fn completions(&self) -> usize {
        self.seen().iter().filter(|s| s.method == "POST").count()
    }

    /// Holds every stream's last event until [`OpenAiServer::open_gate`].
    pub fn close_gate(&self) {
        self.shared.gate_closed.store(true, Ordering::Relaxed);
    }

    pub fn open_gate(&self) {
        self.shared.gate_closed.store(false, Ordering::Relaxed);
    }

    /// Reports `cached` prompt tokens served from the cache in every
    /// completion's usage from now on.
    pub fn report_cached(&self, cached: u64) {
        *self.shared.cached.lock().unwrap() = Some(cached);
    }

    /// Answers every completion, and `GET /health`, with `status` from now
    /// on (0: 200 again).
    pub fn answer_status(&self, status: u16) {
        self.shared.status.store(status, Ordering::Relaxed);
    }
}

impl Drop for OpenAiServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.open_gate();
    }
}

/// Requests on one connection until it closes.
fn serve(conn: TcpStream, s: &Shared) {
    conn.set_nonblocking(false).unwrap();
    conn.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut out = conn.try_clone().unwrap();
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut words = line.split_whitespace();
        let (method, path) = (words.next().unwrap_or("").to_owned(), words.next().unwrap_or("").to_owned());
        let mut headers = HashMap::new();
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
            }
        }
        let len = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut body = vec![0; len];
        if r.read_exact(&mut body).is_err() {
            return;
        }
        let stream = serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v["stream"] == true);
        s.seen.lock().unwrap().push(Seen { method: method.clone(), path: path.clone(), headers, body });
        let ok = if path == "/metrics" {
            let running = s.running.load(Ordering::Relaxed);
            let text = format!(
                "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} 0.0\n\
                 # TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} {running}.0\n"
            );
            respond(&mut out, 200, &text)
        } else if method == "POST" {
            s.running.fetch_add(1, Ordering::Relaxed);
            let usage = s.cached.lock().unwrap().map(|n| {
                format!(r#""usage":{{"prompt_tokens":100,"total_tokens":101,"completion_tokens":1,"prompt_tokens_details":{{"cached_tokens":{n}}}}}"#)
            });
            let ok = match s.status.load(Ordering::Relaxed) {
                0 if stream => events(&mut out, s, usage),
                0 => match usage {
                    Some(u) => respond(&mut out, 200, &format!(r#"{{"choices":[{{"text":"ok"}}],{u}}}"#)),
                    None => respond(&mut out, 200, r#"{"choices":[{"text":"ok"}]}"#),
                },
                code => respond(&mut out, code, r#"{"error":"engine"}"#),
            };
            s.running.fetch_sub(1, Ordering::Relaxed);
            ok
        } else if path == "/health" {
            // As vLLM's: the engine's failure shows here too.
            match s.status.load(Ordering::Relaxed) {
                0 => respond(&mut out, 200, ""),
                code => respond(&mut out, code, r#"{"error":"engine"}"#),
            }
        } else {
            respond(&mut out, 200, r#"{"object":"list","data":[{"id":"m"}]}"#)
        };
        if !ok {
            return;
        }
    }
}

fn respond(out: &mut TcpStream, status: u16, body: &str) -> bool {
    write!(out, "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len())
        .is_ok()
}

/// Three events, chunked (and one with `usage` before the last); the
/// third after the gate opens.
fn events(out: &mut TcpStream, s: &Shared, usage: Option<String>) -> bool {
    let chunk = |out: &mut TcpStream, data: &str| {
        let event = format!("data: {data}\n\n");
        write!(out, "{:x}\r\n{event}\r\n", event.len()).and_then(|()| out.flush()).is_ok()
    };
    if write!(out, "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n").is_err()
        || !chunk(out, r#"{"i":0}"#)
        || !chunk(out, r#"{"i":1}"#)
    {
        return false;
    }
    let waited = std::time::Instant::now();
    while s.gate_closed.load(Ordering::Relaxed) && waited.elapsed() < DEADLINE {
        std::thread::sleep(Duration::from_millis(2));
    }
    usage.is_none_or(|u| chunk(out, &format!(r#"{{"choices":[],{u}}}"#)))
        && chunk(out, "[DONE]")
        && write!(out, "0\r\n\r\n").is_ok()
}
