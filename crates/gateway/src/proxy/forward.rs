//! One request through the proxy: its body read whole (within the body
//! cap, the buffer budget and the body timeout), a rank decided, the
//! request sent to that rank's server (once more to the next-best rank
//! when the connection fails), and the response streamed back.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use axum::response::Response;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use tokio::sync::OwnedSemaphorePermit;

use super::booked::{Booked, Booking};
use super::Proxy;
use crate::body;
use crate::decide::{finished, withdrawn, Decision, Refusal};
use crate::metrics::Outcome;

/// The paths whose requests are routed by their prompt (and booked); any
/// other request goes to a routable rank in turn, unbooked.
pub const ROUTED: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// The response header that names the rank that served the request.
pub const RANK_HEADER: &str = "x-dpcoord-rank";

/// Headers of one hop, never forwarded (RFC 9110, 7.6.1), and `host`,
/// which names the rank's server instead.
const HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// A request body's share of `proxy.max_buffered_bytes`, given back (and
/// taken off `dpcoord_proxy_buffered_bytes`) when dropped.
struct Share {
    permits: Option<OwnedSemaphorePermit>,
    bytes: usize,
    gauge: prometheus::IntGauge,
}

impl Share {
    /// `n` more bytes, or `false` when the budget has not got them.
    fn take(&mut self, p: &Proxy, n: usize) -> bool {
        let Ok(more) = Arc::clone(&p.buffered).try_acquire_many_owned(u32::try_from(n).unwrap_or(u32::MAX)) else {
            return false;
        };
        match &mut self.permits {
            Some(held) => held.merge(more),
            None => self.permits = Some(more),
        }
        self.bytes += n;
        self.gauge.add(n as i64);
        true
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.gauge.sub(self.bytes as i64);
    }
}

/// A request body held in memory, with its share of the budget.
struct Held {
    bytes: Bytes,
    _share: Share,
}

pub async fn handle(State(p): State<Arc<Proxy>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let routed = parts.method == Method::POST && ROUTED.contains(&parts.uri.path());
    let held = match read(&p, &parts.headers, body).await {
        Ok(h) => h,
        Err(r) => return refuse(&p, r),
    };
    let decided = if routed {
        match body::parse(&held.bytes) {
            Ok(parsed) => p.decider.route(parsed, None, 1, true).await,
            Err(e) => Err(Refusal::bad_body(&e)),
        }
    } else {
        p.decider.bodyless(None)
    };
    match decided {
        Ok(d) => forward(&p, &parts, held, d, routed).await,
        Err(r) => refuse(&p, r),
    }
}

/// Reads the whole body: 413 past `gateway.max_body_bytes`, 503 when the
/// proxy holds `proxy.max_buffered_bytes` already, 408 past
/// `proxy.body_timeout_ms`; a client gone mid-body books nothing.
async fn read(p: &Proxy, headers: &HeaderMap, mut body: Body) -> Result<Held, Refusal> {
    let cap = p.decider.published.gateway().max_body_bytes;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > cap as u64) {
        return Err(Refusal::too_large(cap));
    }
    let deadline = tokio::time::Instant::now() + p.limits.body_timeout;
    let mut buf: Vec<u8> = Vec::new();
    let mut share = Share { permits: None, bytes: 0, gauge: p.buffered_bytes.clone() };
    loop {
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => {
                let why = format!(
                    "the request body took longer than proxy.body_timeout_ms = {} ms",
                    p.limits.body_timeout.as_millis()
                );
                return Err(Refusal::new(408, why, Outcome::RejectedTimeout));
            }
            Ok(None) => break,
            Ok(Some(Err(_))) => return Err(Refusal::new(400, "the request body was cut off", Outcome::RejectedReset)),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        if buf.len() + data.len() > cap {
            return Err(Refusal::too_large(cap));
        }
        if !share.take(p, data.len()) {
            let why = format!(
                "the proxy holds proxy.max_buffered_bytes = {} bytes of request bodies; try again",
                p.limits.max_buffered_bytes
            );
            return Err(Refusal::new(503, why, Outcome::RejectedBusy));
        }
        buf.extend_from_slice(&data);
    }
    Ok(Held { bytes: Bytes::from(buf), _share: share })
}

/// Sends the request to the decided rank, or to the next-best one when its
/// server cannot be connected to; a routed request's placement follows
/// where it went (moved, or withdrawn when it went nowhere).
async fn forward(p: &Proxy, parts: &axum::http::request::Parts, held: Held, d: Decision, routed: bool) -> Response {
    let rank_header = d.gateway.rank_header.as_deref();
    let tries = std::iter::once((d.rank, d.endpoint.clone())).chain(d.fallbacks.first().cloned());
    for (rank, endpoint) in tries {
        let req = match upstream(parts, &held.bytes, &endpoint, rank_header.map(|h| (h, rank))) {
            Ok(r) => r,
            Err(why) => {
                if routed {
                    p.decider.bridge.tell(withdrawn(d.rank));
                }
                return refuse(p, Refusal::new(400, why, Outcome::RejectedBadRequest));
            }
        };
        match p.client.request(req).await {
            Ok(resp) => {
                p.reach.answered(&p.decider, rank, resp.status().as_u16()).await;
                let booking = match (routed, rank == d.rank) {
                    (true, true) => Some(Booking {
                        bridge: p.decider.bridge.clone(),
                        metrics: p.decider.metrics.clone(),
                        rank,
                        complete: false,
                        predicted: d.predicted,
                    }),
                    // Served by the next-best rank: the placement moves
                    // there now, as the picker books a gateway's retry.
                    (true, false) => {
                        p.decider.bridge.tell(finished(rank, d.rank));
                        None
                    }
                    (false, _) => None,
                };
                return respond(p, resp, rank, booking);
            }
            Err(e) if e.is_connect() => {
                tracing::debug!(rank, endpoint, error = %e, "the proxy could not connect to a rank's server");
                p.decider.metrics.rank_error(rank, "connect");
                p.reach.failed(&p.decider, rank).await;
            }
            Err(e) => {
                // The request may have reached the server: not sent again.
                tracing::debug!(rank, endpoint, error = %e, "a rank's server failed the proxy's request");
                p.decider.metrics.rank_error(rank, "reset");
                if routed {
                    p.decider.bridge.tell(finished(rank, d.rank));
                }
                let why = format!("rank {rank}'s server at {endpoint} failed the request: {e}");
                return refuse(p, Refusal::new(502, why, Outcome::FailedUnreachable));
            }
        }
    }
    if routed {
        p.decider.bridge.tell(withdrawn(d.rank));
    }
    let why = format!("rank {}'s server, and the next-best rank's, refused the connection", d.rank);
    refuse(p, Refusal::new(502, why, Outcome::FailedUnreachable))
}

/// The request as the rank's server gets it: the same method, path,
/// headers (but those of one hop) and body, and the rank in `rank_header`
/// when one endpoint serves every rank.
fn upstream(
    parts: &axum::http::request::Parts,
    body: &Bytes,
    endpoint: &str,
    rank_header: Option<(&str, u32)>,
) -> Result<hyper::Request<Full<Bytes>>, String> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let uri: Uri = format!("http://{endpoint}{path}").parse().map_err(|e| format!("the request's path: {e}"))?;
    let mut req = hyper::Request::builder().method(parts.method.clone()).uri(uri);
    if let Some(h) = req.headers_mut() {
        copy_headers(&parts.headers, h);
        h.remove(header::HOST);
        h.remove(header::CONTENT_LENGTH);
        if let Some((name, rank)) = rank_header {
            if let Ok(name) = HeaderName::from_bytes(name.as_bytes()) {
                h.insert(name, HeaderValue::from(rank));
            }
        }
    }
    req.body(Full::new(body.clone())).map_err(|e| e.to_string())
}

/// Every header but those of one hop, and those `connection` names.
fn copy_headers(from: &HeaderMap, to: &mut HeaderMap) {
    let named: Vec<String> = from
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|t| t.trim().to_ascii_lowercase()))
        .collect();
    for (name, value) in from {
        let n = name.as_str();
        if !HOP.contains(&n) && !named.iter().any(|c| c == n) {
            to.append(name.clone(), value.clone());
        }
    }
}

/// The rank's response, its body streamed through.
fn respond(
    p: &Proxy,
    resp: hyper::Response<hyper::body::Incoming>,
    rank: u32,
    mut booking: Option<Booking>,
) -> Response {
    let (parts, inner) = resp.into_parts();
    if parts.status.is_server_error() {
        p.decider.metrics.rank_error(rank, "status_5xx");
    }
    if !parts.status.is_success() {
        // Nothing was served from a cache for a refused request.
        if let Some(b) = &mut booking {
            b.predicted = None;
        }
    }
    let mut out = Response::new(Body::new(Booked::new(inner, booking)));
    *out.status_mut() = parts.status;
    copy_headers(&parts.headers, out.headers_mut());
    out.headers_mut().insert(RANK_HEADER, HeaderValue::from(rank));
    out
}

/// An answer of the proxy's own, in the OpenAI error shape.
fn refuse(p: &Proxy, r: Refusal) -> Response {
    p.decider.metrics.outcome(r.outcome);
    let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = serde_json::json!({
        "error": {"message": format!("dpcoord: {}", r.why), "type": format!("dpcoord_{}", r.status), "code": r.status}
    });
    let mut out = Response::new(Body::from(body.to_string()));
    *out.status_mut() = status;
    out.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    out
}
