//! The `ext_proc` stream of one request through the gateway: headers and
//! body in (buffered, or `FULL_DUPLEX_STREAMED` chunks), a pick through
//! the coordinator, the endpoint out as a header and as `envoy.lb` dynamic
//! metadata; then the response's headers (the endpoint that served it) and
//! its end, booked with a `finished` query.

use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3 as ep;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use ep::processing_request::Request as In;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::decide::{Decider, Refusal};
use super::metrics::Outcome;
use super::reach::Reach;
use super::reply::{self, Pick, SERVED};
use super::{body, subset};

/// Envoy's `BodySendMode::BUFFERED` and `BUFFERED_PARTIAL`: the body in
/// one message, after the headers were answered.
const BUFFERED: [i32; 2] = [2, 3];
/// Envoy's `BodySendMode::FULL_DUPLEX_STREAMED`.
const FULL_DUPLEX: i32 = 4;

#[derive(Clone)]
pub struct Picker {
    pub decider: Arc<Decider>,
    /// Where the ranks' 5xx answers go (`reach.rs`).
    pub reach: Arc<Reach>,
}

/// One request's stream, as far as it went.
#[derive(Default)]
struct Stream {
    body: Vec<u8>,
    subset: Option<Vec<String>>,
    buffered: bool,
    response_streamed: bool,
    /// The rank booked by the pick, then the rank that served it.
    placed: Option<u32>,
    served: Option<u32>,
    /// The served endpoint as the gateway's metadata named it.
    served_endpoint: Option<String>,
    /// The request's headers came, then its body's end: each at most once.
    headers: bool,
    picked: bool,
    /// The response is over (or was never to come).
    finished: bool,
    /// Served elsewhere: the placement was moved when the response's
    /// headers said so, nothing is left to book at its end.
    moved: bool,
}

type Out = mpsc::Sender<Result<ep::ProcessingResponse, Status>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ep::ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: Request<Streaming<ep::ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(16);
        let picker = self.clone();
        tokio::spawn(async move { picker.serve(request.into_inner(), tx).await });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

impl Picker {
    async fn serve(self, mut input: Streaming<ep::ProcessingRequest>, out: Out) {
        let mut s = Stream::default();
        while let Ok(Some(msg)) = input.message().await {
            if let Some(cfg) = msg.protocol_config {
                s.buffered = BUFFERED.contains(&cfg.request_body_mode);
                s.response_streamed = cfg.response_body_mode == FULL_DUPLEX;
            }
            if let Some(m) = msg.metadata_context.as_ref() {
                if s.subset.is_none() {
                    s.subset = subset::hint(m);
                }
                if let Some(served) = reply::served_metadata(m) {
                    s.served_endpoint = Some(served);
                }
            }
            let Some(req) = msg.request else { continue };
            let done = self.step(&mut s, req, &out).await;
            if done {
                break;
            }
        }
        // A stream that ends before its response did: the request is over.
        if let (Some(placed), false) = (s.placed, s.finished) {
            let rank = s.served.unwrap_or(placed);
            self.decider.metrics.rank_error(rank, "reset");
            if !s.moved {
                self.decider.finish(rank, placed).await;
            }
        } else if s.placed.is_none() && !s.finished {
            self.decider.metrics.outcome(Outcome::RejectedReset);
        }
    }

    /// Answers one message; `true` once the stream has nothing more to do.
    async fn step(&self, s: &mut Stream, req: In, out: &Out) -> bool {
        match req {
            // A stream is one request: a second one's headers, or a body
            // after the body's end, would be a second pick and placement.
            In::RequestHeaders(_) if s.headers => return self.violation(out, "a second request's headers").await,
            In::RequestBody(_) if s.picked => return self.violation(out, "request body after its end").await,
            In::RequestHeaders(h) => {
                s.headers = true;
                if h.end_of_stream {
                    // A POST without a body is an inference request missing it.
                    if reply::method(h.headers.as_ref()).is_none_or(|m| m == "POST") {
                        return self.reject(s, out, Refusal::bad_body(&body::BodyError::NoModel)).await;
                    }
                    return self.pass(s, out).await;
                }
                if s.buffered {
                    send(out, reply::headers_ok()).await;
                }
                false
            }
            In::RequestBody(b) => {
                let cap = self.decider.published.gateway().max_body_bytes;
                if s.body.len() + b.body.len() > cap {
                    return self.reject(s, out, Refusal::too_large(cap)).await;
                }
                s.body.extend_from_slice(&b.body);
                if !b.end_of_stream {
                    return false;
                }
                self.pick(s, out).await
            }
            In::ResponseHeaders(h) => {
                let (status, header) = reply::response_facts(h.headers.as_ref(), SERVED);
                let served = s.served_endpoint.take().or(header);
                let gateway = self.decider.gateway();
                let dp = self.decider.published.dp_size();
                s.served = served.and_then(|ep| {
                    let mut ranks = gateway.ranks_of(&ep, dp);
                    let first = ranks.next();
                    // One endpoint for every rank (the rank header): the pick stands.
                    if gateway.rank_header.is_some() {
                        s.placed
                    } else {
                        first
                    }
                });
                if let (Some(code), Some(rank)) = (status, s.served.or(s.placed)) {
                    if code >= 500 {
                        self.decider.metrics.rank_error(rank, "status_5xx");
                    }
                    // Routing hears of it off the stream's path, when
                    // there is something to hear.
                    if self.reach.reports(rank, code) {
                        let (reach, decider) = (Arc::clone(&self.reach), Arc::clone(&self.decider));
                        tokio::spawn(async move { reach.answered(&decider, rank, code).await });
                    }
                }
                // Served by a fallback (the gateway retried): the placement
                // moves there now, not when the response ends.
                if let (Some(placed), Some(rank)) = (s.placed, s.served) {
                    if rank != placed && !s.moved {
                        s.moved = true;
                        self.decider.finish(rank, placed).await;
                    }
                }
                send(out, reply::response_headers_ok()).await;
                if h.end_of_stream {
                    return self.complete(s).await;
                }
                false
            }
            In::ResponseBody(b) => {
                send(out, reply::response_body(&b, s.response_streamed)).await;
                if b.end_of_stream {
                    return self.complete(s).await;
                }
                false
            }
            In::RequestTrailers(_) => {
                send(out, reply::request_trailers_ok()).await;
                false
            }
            In::ResponseTrailers(_) => {
                send(out, reply::response_trailers_ok()).await;
                self.complete(s).await
            }
        }
    }

    /// A message the protocol does not allow at this point: the stream
    /// ends with `INVALID_ARGUMENT` (what it booked is booked `finished`).
    async fn violation(&self, out: &Out, what: &str) -> bool {
        let why = format!("dpcoord: {what} on one ext_proc stream; a stream carries one request");
        let _ = out.send(Err(Status::invalid_argument(why))).await;
        true
    }

    /// The whole body is in: parse, ask the coordinator, answer the gateway.
    async fn pick(&self, s: &mut Stream, out: &Out) -> bool {
        s.picked = true;
        let parsed = match body::parse(&s.body) {
            Ok(p) => p,
            Err(e) => return self.reject(s, out, Refusal::bad_body(&e)).await,
        };
        let fallbacks = self.decider.gateway().fallbacks;
        let d = match self.decider.route(parsed, s.subset.as_deref(), fallbacks, false).await {
            Ok(d) => d,
            Err(r) => return self.reject(s, out, r).await,
        };
        s.placed = Some(d.rank);
        // The pick, then each fallback's endpoint: the protocol's list.
        let endpoints = std::iter::once(d.endpoint.as_str())
            .chain(d.fallbacks.iter().map(|(_, e)| e.as_str()))
            .collect::<Vec<_>>()
            .join(",");
        let pick = Pick { endpoint: &endpoints, rank: d.rank, rank_header: d.gateway.rank_header.as_deref() };
        for m in reply::picked(&pick, std::mem::take(&mut s.body), s.buffered) {
            send(out, m).await;
        }
        false
    }

    /// A request without a body (`GET /v1/models`, a health check): a
    /// routable rank's endpoint in turn, nothing booked. The stream goes
    /// on for its response, which books nothing either.
    async fn pass(&self, s: &mut Stream, out: &Out) -> bool {
        s.picked = true;
        let d = match self.decider.bodyless(s.subset.as_deref()) {
            Ok(d) => d,
            Err(r) => return self.reject(s, out, r).await,
        };
        s.finished = true;
        let pick = Pick { endpoint: &d.endpoint, rank: d.rank, rank_header: d.gateway.rank_header.as_deref() };
        send(out, reply::picked_headers(&pick)).await;
        false
    }

    /// An immediate response: nothing was booked, the stream is over.
    async fn reject(&self, s: &mut Stream, out: &Out, r: Refusal) -> bool {
        self.decider.metrics.outcome(r.outcome);
        s.finished = true;
        send(out, reply::immediate(r.status, &r.why)).await;
        true
    }

    /// The response is over: the placement is complete.
    async fn complete(&self, s: &mut Stream) -> bool {
        if let (Some(placed), false) = (s.placed, s.finished) {
            s.finished = true;
            if !s.moved {
                self.decider.finish(s.served.unwrap_or(placed), placed).await;
            }
        }
        true
    }
}

async fn send(out: &Out, m: ep::ProcessingResponse) {
    // The gateway closed its stream: nothing is waiting for the answer.
    let _ = out.send(Ok(m)).await;
}
