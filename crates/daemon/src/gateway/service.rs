//! The `ext_proc` stream of one request through the gateway: headers and
//! body in (buffered, or `FULL_DUPLEX_STREAMED` chunks), a pick through
//! the coordinator, the endpoint out as a header and as `envoy.lb` dynamic
//! metadata; then the response's headers (the endpoint that served it) and
//! its end, booked with a `finished` query.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3 as ep;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use ep::processing_request::Request as In;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::bridge::{Bridge, Query};
use super::endpoints::Endpoints;
use super::metrics::{GatewayMetrics, Outcome};
use super::prompt::Encoded;
use super::prompts::Prompts;
use super::reply::{self, Pick};
use super::{body, subset};
use crate::routing::Published;

/// The header (and `envoy.lb` metadata key) that names the picked endpoint.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The header the gateway adds to the response: the endpoint that served it.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// Envoy's `BodySendMode::BUFFERED` and `BUFFERED_PARTIAL`: the body in
/// one message, after the headers were answered.
const BUFFERED: [i32; 2] = [2, 3];
/// Envoy's `BodySendMode::FULL_DUPLEX_STREAMED`.
const FULL_DUPLEX: i32 = 4;

#[derive(Clone)]
pub struct Picker {
    pub bridge: Bridge,
    pub published: Arc<Published>,
    /// `gateway.endpoints` as addresses.
    pub endpoints: Arc<Endpoints>,
    /// The prompt encoder in force (`gateway.tokenizer`).
    pub prompts: Arc<Prompts>,
    /// The largest route query the route socket takes
    /// (`limits.max_message_bytes`): a prompt is cut to fit it.
    pub max_query_bytes: usize,
    pub metrics: GatewayMetrics,
    /// The turn of requests without a body among the routable ranks.
    pub bodyless: Arc<AtomicU32>,
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
            self.metrics.rank_error(rank, "reset");
            if !s.moved {
                self.finish(rank, placed).await;
            }
        } else if s.placed.is_none() && !s.finished {
            self.metrics.outcome(Outcome::RejectedReset);
        }
    }

    /// Answers one message; `true` once the stream has nothing more to do.
    async fn step(&self, s: &mut Stream, req: In, out: &Out) -> bool {
        match req {
            In::RequestHeaders(h) => {
                if h.end_of_stream {
                    // A POST without a body is an inference request missing it.
                    if reply::method(h.headers.as_ref()).is_none_or(|m| m == "POST") {
                        return self
                            .reject(s, out, body::BodyError::NoModel.to_string(), 400, Outcome::RejectedBadRequest)
                            .await;
                    }
                    return self.pass(s, out).await;
                }
                if s.buffered {
                    send(out, reply::headers_ok()).await;
                }
                false
            }
            In::RequestBody(b) => {
                let cap = self.published.gateway().max_body_bytes;
                if s.body.len() + b.body.len() > cap {
                    let why = format!("the request body is above gateway.max_body_bytes = {cap} bytes");
                    return self.reject(s, out, why, 413, Outcome::RejectedTooLarge).await;
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
                let gateway = self.endpoints.resolved(self.published.gateway());
                let dp = self.published.dp_size();
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
                        self.metrics.rank_error(rank, "status_5xx");
                    }
                }
                // Served by a fallback (the gateway retried): the placement
                // moves there now, not when the response ends.
                if let (Some(placed), Some(rank)) = (s.placed, s.served) {
                    if rank != placed && !s.moved {
                        s.moved = true;
                        self.finish(rank, placed).await;
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

    /// The whole body is in: parse, ask the coordinator, answer the gateway.
    async fn pick(&self, s: &mut Stream, out: &Out) -> bool {
        let parsed = match body::parse(&s.body) {
            Ok(p) => p,
            Err(e) => return self.reject(s, out, e.to_string(), 400, Outcome::RejectedBadRequest).await,
        };
        let gateway = self.endpoints.resolved(self.published.gateway());
        let dp = self.published.dp_size();

        let among = match subset::eligible(&gateway, dp, s.subset.as_deref()) {
            // Every rank eligible: the route is not restricted.
            Ok(among) if among.len() == dp as usize => None,
            Ok(among) => Some(among),
            Err(why) => return self.reject(s, out, why, 503, Outcome::RejectedNoRank).await,
        };
        // With one endpoint for every rank, another rank is no fallback.
        let fallbacks = (gateway.fallbacks > 0 && gateway.rank_header.is_none()).then_some(gateway.fallbacks);
        let session = parsed.user.clone();
        let shed_waiting = gateway.shed_waiting;
        let mut q = Query { op: "route", session, among, fallbacks, shed_waiting, ..Query::default() };
        self.key_prompt(&mut q, &gateway, parsed.prompt).await;
        // The same query without its prompt, kept for the retry below: the
        // prompt's ids are moved, not copied.
        let prompt = (q.tokens.take(), q.block_keys.take());
        let bare = q.clone();
        (q.tokens, q.block_keys) = prompt;
        let mut reply = self.bridge.ask(q).await;
        if reply.as_ref().and_then(|r| r.error.as_ref()).is_some_and(|e| e.code == "too_large") {
            // A reload lowered limits.max_prompt_tokens between the cut and
            // the decision: route on the length alone.
            reply = self.bridge.ask(bare).await;
        }
        let Some(r) = reply else {
            return self
                .reject(s, out, "dpcoord's coordinator is not answering".into(), 500, Outcome::RejectedError)
                .await;
        };
        let rank = match (r.ok, r.ranks.first(), r.error) {
            (true, Some(&rank), _) => rank,
            (_, _, Some(e)) if e.code == "no_engine_available" || e.code == "rank_unavailable" => {
                return self.reject(s, out, e.message, 503, Outcome::RejectedNoRank).await
            }
            (_, _, Some(e)) if e.code == "saturated" => {
                return self.reject(s, out, e.message, 429, Outcome::RejectedShed).await
            }
            (_, _, e) => {
                let why = e.map_or("no rank in the reply".into(), |e| format!("{}: {}", e.code, e.message));
                return self.reject(s, out, why, 500, Outcome::RejectedError).await;
            }
        };
        let Some(endpoint) = gateway.endpoint(rank) else {
            return self.reject(s, out, format!("rank {rank} has no endpoint"), 503, Outcome::RejectedNoRank).await;
        };
        s.placed = Some(rank);
        self.metrics.outcome(Outcome::Routed);
        let endpoints = with_fallbacks(endpoint, r.fallbacks.iter().filter_map(|&f| gateway.endpoint(f)));
        let pick = Pick { endpoint: &endpoints, rank, rank_header: gateway.rank_header.as_deref() };
        for m in reply::picked(&pick, std::mem::take(&mut s.body), s.buffered) {
            send(out, m).await;
        }
        false
    }

    /// A request without a body (`GET /v1/models`, a health check): the
    /// next routable eligible rank's endpoint, as of the last tick, in
    /// turn; nothing booked, since it is no inference request. The stream
    /// goes on for its response, which books nothing either.
    async fn pass(&self, s: &mut Stream, out: &Out) -> bool {
        let gateway = self.endpoints.resolved(self.published.gateway());
        let state = self.published.state();
        let among = match subset::eligible(&gateway, self.published.dp_size(), s.subset.as_deref()) {
            Ok(among) => among,
            Err(why) => return self.reject(s, out, why, 503, Outcome::RejectedNoRank).await,
        };
        let up: Vec<u32> = (among.into_iter())
            .filter(|&r| state.ranks.get(r as usize).is_some_and(|v| super::routable(v.status)))
            .collect();
        let turn = self.bodyless.fetch_add(1, Ordering::Relaxed) as usize;
        let Some((rank, endpoint)) = up.get(turn % up.len().max(1)).and_then(|&r| Some((r, gateway.endpoint(r)?)))
        else {
            let why = "no routable rank: none of the eligible ranks is up or stale".to_owned();
            return self.reject(s, out, why, 503, Outcome::RejectedNoRank).await;
        };
        self.metrics.outcome(Outcome::RoutedBodyless);
        s.finished = true;
        send(out, reply::picked_headers(&Pick { endpoint, rank, rank_header: gateway.rank_header.as_deref() })).await;
        false
    }

    /// The query's prompt: the engine's token ids (with a tokenizer), else
    /// text keys, each cut to the leading part that fits the route socket's
    /// message limit (a prefix is still a prefix; the length is the
    /// whole, estimated past a cut the tokenizer did not read).
    /// Tokenizing runs on the blocking pool, not the gRPC tasks' thread.
    async fn key_prompt(&self, q: &mut Query, gateway: &crate::config::Gateway, prompt: super::PromptText) {
        let encoder = self.prompts.encoder(gateway);
        let estimate = prompt.estimated_tokens();
        // 2 KiB for the rest of the query; at most 5 bytes an id, 9 a key;
        // and no more than `limits.max_prompt_tokens` lets in. A longer
        // prompt is tokenized only about that far.
        let room = self.max_query_bytes.saturating_sub(2048);
        let most = self.published.max_prompt_tokens() as usize;
        let ids = (room / 5).min(most);
        let encoded = tokio::task::spawn_blocking(move || encoder.encode(&prompt, ids)).await.ok();
        match encoded {
            Some(Encoded::Tokens { ids, whole }) => {
                self.metrics.prompt(super::prompt::MODE_TOKENIZER);
                q.prompt_tokens = Some(whole);
                q.tokens = Some(ids);
            }
            Some(Encoded::TextKeys(mut keys)) => {
                self.metrics.prompt(super::prompt::MODE_TEXT);
                q.prompt_tokens = Some(estimate);
                keys.truncate((room / 9).min(most / 16));
                q.block_keys = Some(keys);
            }
            None => q.prompt_tokens = Some(estimate),
        }
    }

    /// An immediate response: nothing was booked, the stream is over.
    async fn reject(&self, s: &mut Stream, out: &Out, why: String, code: u16, o: Outcome) -> bool {
        self.metrics.outcome(o);
        s.finished = true;
        send(out, reply::immediate(code, &why)).await;
        true
    }

    /// The response is over: the placement is complete.
    async fn complete(&self, s: &mut Stream) -> bool {
        if let (Some(placed), false) = (s.placed, s.finished) {
            s.finished = true;
            if !s.moved {
                self.finish(s.served.unwrap_or(placed), placed).await;
            }
        }
        true
    }

    async fn finish(&self, rank: u32, placed: u32) {
        let q =
            Query { op: "finished", rank: Some(rank), placed: (placed != rank).then_some(placed), ..Query::default() };
        if self.bridge.ask(q).await.is_none_or(|r| !r.ok) {
            tracing::debug!(rank, "a finished request was not booked");
        }
    }
}

/// The destination's value: the picked endpoint, then each fallback's
/// endpoint not already named, comma-separated (the protocol's form).
fn with_fallbacks<'a>(first: &str, fallbacks: impl Iterator<Item = &'a str>) -> String {
    let mut list = first.to_owned();
    let mut named = vec![first];
    for e in fallbacks {
        if !named.contains(&e) {
            named.push(e);
            list.push(',');
            list.push_str(e);
        }
    }
    list
}

async fn send(out: &Out, m: ep::ProcessingResponse) {
    // The gateway closed its stream: nothing is waiting for the answer.
    let _ = out.send(Ok(m)).await;
}
