//! The vLLM `/metrics` scraper: one thread per URL of
//! `engines.vllm_metrics_url` (the i-th URL is rank i) GETs its URL every
//! `engines.vllm_metrics_interval_ms`, reads the body into the gauges and the progress
//! dpcoord uses (`wire::read_vllm_metrics`, here, on this thread) and
//! hands them to the transport over an in-process PUSH -> PULL pair as
//! `[rank u32 BE, seq u64 BE, gauges]` (44 bytes in all).
//!
//! So the routing thread never parses a body, whatever its size. Each
//! request has its own overall timeout, so an endpoint that hangs delays
//! only its own rank's next scrape, never another rank or a route query.
//! A body is capped at `VLLM_MAX_BODY_BYTES`, and at most one report waits
//! per URL on the way to the transport (a scrape that finds the pipe full
//! is dropped: the next one is newer). The threads run at a lower CPU
//! priority than the routing thread (`io::niceness`). Every scrape is
//! counted in `dpcoord_scrapes_total` here: `ok` once its report is handed
//! to the transport, or the reason it brought none.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::error::{sock_err, TransportError};
use crate::config::Server;
use crate::observability::metrics::{ScrapeResult, Scrapes};
use crate::observability::ratelimit::LogLimiter;
use crate::wire::{read_vllm_metrics, VllmGauges, VLLM_MAX_BODY_BYTES};

/// Where the transport's PULL is bound.
pub const ENDPOINT: &str = "inproc://dpcoord.vllm-metrics";
/// One request's whole time: connect, send, response and body. It also
/// bounds how long [`Scraper::stop`] waits for a thread mid-request.
const TIMEOUT: Duration = Duration::from_secs(1);
/// Log causes: each `ScrapeResult`, then a body dropped at a full pipe.
const CAUSES: usize = ScrapeResult::ALL.len() + 1;

/// The running scraper threads; [`Scraper::stop`] ends them.
pub struct Scraper {
    /// Dropping a sender wakes and ends its thread.
    stops: Vec<mpsc::Sender<()>>,
    threads: Vec<JoinHandle<()>>,
}

/// One URL's scrape loop.
struct Target {
    rank: u32,
    url: String,
    interval: Duration,
    agent: ureq::Agent,
    push: zmq::Socket,
    /// Bodies sent so far: the report's `seq`.
    sent: u64,
    scrapes: Scrapes,
    log: LogLimiter<CAUSES>,
}

/// A scrape that brought no body: the result counted and why, for the log.
type Failure = (ScrapeResult, String);

fn agent() -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(TIMEOUT))
        .http_status_as_error(false)
        .max_redirects(0)
        // API servers are reached directly, whatever proxy the environment names.
        .proxy(None)
        .build();
    ureq::Agent::new_with_config(config)
}

fn failure(e: ureq::Error) -> Failure {
    let result = match &e {
        ureq::Error::Timeout(_) => ScrapeResult::Timeout,
        ureq::Error::Io(io) if matches!(io.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
            ScrapeResult::Timeout
        }
        ureq::Error::Io(_) | ureq::Error::ConnectionFailed | ureq::Error::HostNotFound => ScrapeResult::ConnectError,
        ureq::Error::BodyExceedsLimit(_) => ScrapeResult::TooLarge,
        _ => ScrapeResult::HttpError,
    };
    (result, e.to_string())
}

/// GETs `url`: its body when the status is 200 and the body within the cap.
fn fetch(agent: &ureq::Agent, url: &str) -> Result<Vec<u8>, Failure> {
    let mut response = agent.get(url).call().map_err(failure)?;
    if response.status() != 200 {
        return Err((ScrapeResult::HttpError, format!("HTTP status {}", response.status())));
    }
    response.body_mut().with_config().limit(VLLM_MAX_BODY_BYTES as u64).read_to_vec().map_err(failure)
}

impl Target {
    fn run(mut self, stop: mpsc::Receiver<()>) {
        super::niceness::lower_this_thread();
        let mut next = Instant::now();
        loop {
            self.scrape();
            // A scrape slower than the interval is followed at once, not by a burst.
            next = (next + self.interval).max(Instant::now());
            match stop.recv_timeout(next.saturating_duration_since(Instant::now())) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }

    fn scrape(&mut self) {
        let read = fetch(&self.agent, &self.url)
            .and_then(|body| read_vllm_metrics(&body).map_err(|e| (ScrapeResult::Malformed, e.to_string())));
        match read {
            Ok(gauges) => self.send(gauges),
            Err((result, why)) => {
                self.scrapes.count(result);
                let cause = ScrapeResult::ALL.iter().position(|r| *r == result).unwrap_or(0);
                self.warn(cause, result.as_str(), &why);
            }
        }
    }

    fn send(&mut self, gauges: VllmGauges) {
        let seq = self.sent + 1;
        let frames = [&self.rank.to_be_bytes()[..], &seq.to_be_bytes()[..], &gauges.to_frame()[..]];
        match self.push.send_multipart(frames, zmq::DONTWAIT) {
            Ok(()) => {
                self.sent = seq;
                self.scrapes.count(ScrapeResult::Ok);
            }
            Err(e) => self.warn(CAUSES - 1, "dropped", &format!("the transport is not reading: {e}")),
        }
    }

    /// Logs at most once per second per cause.
    fn warn(&mut self, cause: usize, result: &str, why: &str) {
        if let Some(suppressed) = self.log.allow(cause, Instant::now()) {
            tracing::warn!(rank = self.rank, url = %self.url, result, reason = why, suppressed, "vLLM scrape failed");
        }
    }
}

impl Scraper {
    /// Starts one thread per URL of `srv.vllm_metrics_url` (none when it is
    /// empty); `ctx` is the context of the transport's sockets.
    pub fn start(ctx: &zmq::Context, srv: &Server, scrapes: &Scrapes) -> Result<Scraper, TransportError> {
        let mut scraper = Scraper { stops: Vec::new(), threads: Vec::new() };
        if srv.vllm_metrics_url.is_empty() {
            return Ok(scraper);
        }
        tracing::info!(
            urls = srv.vllm_metrics_url.len(),
            interval_ms = srv.vllm_metrics_interval.as_millis() as u64,
            "scraping vLLM /metrics; vLLM exports no token load, so least_tokens is blind on these ranks \
             (it sees only the prompt tokens of dpcoord's own pending placements)"
        );
        for (rank, url) in srv.vllm_metrics_url.iter().enumerate() {
            let push = ctx.socket(zmq::PUSH).map_err(sock_err("vllm_metrics"))?;
            push.set_linger(0).map_err(sock_err("vllm_metrics"))?;
            push.set_sndhwm(1).map_err(sock_err("vllm_metrics"))?;
            push.connect(ENDPOINT).map_err(sock_err("vllm_metrics"))?;
            let target = Target {
                rank: rank as u32,
                url: url.clone(),
                interval: srv.vllm_metrics_interval,
                agent: agent(),
                push,
                sent: 0,
                scrapes: scrapes.clone(),
                log: LogLimiter::default(),
            };
            let (tx, rx) = mpsc::channel();
            let thread = std::thread::Builder::new()
                .name(format!("scrape-{rank}"))
                .spawn(move || target.run(rx))
                .map_err(TransportError::ScrapeThread)?;
            scraper.stops.push(tx);
            scraper.threads.push(thread);
        }
        Ok(scraper)
    }

    /// Ends every thread and waits for it: at most one request's timeout.
    pub fn stop(self) {
        drop(self.stops);
        for t in self.threads {
            if let Err(panic) = t.join() {
                std::panic::resume_unwind(panic);
            }
        }
    }
}
