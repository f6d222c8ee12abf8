//! One request's rank, for both fronts of the gateway (the picker and the
//! proxy): the body's prompt keyed, a `route` query through the bridge,
//! the reply read as a rank and its endpoint or as the HTTP refusal the
//! client gets; a request without a prompt given a routable rank in turn;
//! the end of a request booked with `finished`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock};

use dpcoord_daemon::io::niceness::lower_this_thread;
use tokio::sync::Semaphore;

use super::bridge::{Bridge, Query};
use super::endpoints::Endpoints;
use super::metrics::{GatewayMetrics, Outcome};
use super::prompt::Encoded;
use super::prompts::Prompts;
use super::{body, subset};
use dpcoord_daemon::config::Gateway;
use dpcoord_daemon::routing::Published;
use dpcoord_daemon::wire::ErrorCode;

/// How many prompts the model's tokenizer encodes at once: half the cores
/// (at least one), so the routing thread keeps one however many large
/// prompts arrive together.
static TOKENIZING: LazyLock<Semaphore> = LazyLock::new(|| {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    Semaphore::new((cores / 2).max(1))
});

/// What a front needs to decide.
pub struct Decider {
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
    /// The turn of requests without a prompt among the routable ranks.
    pub bodyless: AtomicU32,
}

/// An answer instead of a rank: the HTTP status, why, and its outcome.
#[derive(Debug)]
pub struct Refusal {
    pub status: u16,
    pub why: String,
    pub outcome: Outcome,
}

impl Refusal {
    pub fn new(status: u16, why: impl Into<String>, outcome: Outcome) -> Refusal {
        Refusal { status, why: why.into(), outcome }
    }

    /// A body above `gateway.max_body_bytes`: 413.
    pub fn too_large(cap: usize) -> Refusal {
        let why = format!("the request body is above gateway.max_body_bytes = {cap} bytes");
        Refusal::new(413, why, Outcome::RejectedTooLarge)
    }

    /// The request body cannot be routed: 400.
    pub fn bad_body(e: &body::BodyError) -> Refusal {
        Refusal::new(400, e.to_string(), Outcome::RejectedBadRequest)
    }
}

/// The rank a routed request was booked on and where it goes.
#[derive(Debug)]
pub struct Decision {
    pub rank: u32,
    pub endpoint: String,
    /// The ranks the policy would take next, with their endpoints (none
    /// already named, none with `gateway.rank_header`).
    pub fallbacks: Vec<(u32, String)>,
    /// The settings the endpoints were read from (`rank_header`...).
    pub gateway: Arc<Gateway>,
    /// Prompt tokens predicted cached on `rank`, when asked for and made
    /// (a prefix-weighing policy, a prompt).
    pub predicted: Option<u64>,
}

impl Decider {
    /// The settings in force, endpoints as addresses.
    pub fn gateway(&self) -> Arc<Gateway> {
        self.endpoints.resolved(self.published.gateway())
    }

    /// Routes a parsed request among the eligible ranks (`subset`: the
    /// gateway's hint), asking for `fallbacks` next-best ranks and, with
    /// `explain`, the prediction. The rank is booked (pending) by the
    /// coordinator; counted `routed`.
    pub async fn route(
        &self,
        parsed: body::OpenAiRequest,
        subset: Option<&[String]>,
        fallbacks: u8,
        explain: bool,
    ) -> Result<Decision, Refusal> {
        let gateway = self.gateway();
        let dp = self.published.dp_size();
        let among = match subset::eligible(&gateway, dp, subset) {
            // Every rank eligible: the route is not restricted.
            Ok(among) if among.len() == dp as usize => None,
            Ok(among) => Some(among),
            Err(why) => return Err(Refusal::new(503, why, Outcome::RejectedNoRank)),
        };
        // With one endpoint for every rank, another rank is no fallback.
        let fallbacks = (fallbacks > 0 && gateway.rank_header.is_none()).then_some(fallbacks);
        let session = parsed.user.clone();
        let shed_waiting = gateway.shed_waiting;
        let explain = explain.then_some(true);
        let mut q = Query { op: "route", session, among, fallbacks, shed_waiting, explain, ..Query::default() };
        self.key_prompt(&mut q, &gateway, parsed.prompt).await;
        // The same query without its prompt, kept for the retry below: the
        // prompt's ids are moved, not copied.
        let prompt = (q.tokens.take(), q.block_keys.take());
        let bare = q.clone();
        (q.tokens, q.block_keys) = prompt;
        let mut reply = self.bridge.ask(q).await;
        if reply
            .as_ref()
            .and_then(|r| r.error.as_ref())
            .is_some_and(|e| ErrorCode::parse(&e.code) == Some(ErrorCode::TooLarge))
        {
            // A reload lowered limits.max_prompt_tokens between the cut and
            // the decision: route on the length alone.
            reply = self.bridge.ask(bare).await;
        }
        let Some(r) = reply else {
            return Err(Refusal::new(500, "dpcoord's coordinator is not answering", Outcome::RejectedError));
        };
        let explained = r.explain.map(|e| e.chosen).unwrap_or_default();
        let rank = match (r.ok, r.ranks.first(), r.error) {
            (true, Some(&rank), _) => rank,
            (_, _, Some(e))
                if matches!(
                    ErrorCode::parse(&e.code),
                    Some(ErrorCode::NoEngineAvailable | ErrorCode::RankUnavailable)
                ) =>
            {
                return Err(Refusal::new(503, e.message, Outcome::RejectedNoRank))
            }
            (_, _, Some(e)) if ErrorCode::parse(&e.code) == Some(ErrorCode::Saturated) => {
                return Err(Refusal::new(429, e.message, Outcome::RejectedShed))
            }
            (_, _, e) => {
                let why = e.map_or("no rank in the reply".into(), |e| format!("{}: {}", e.code, e.message));
                return Err(Refusal::new(500, why, Outcome::RejectedError));
            }
        };
        let Some(endpoint) = gateway.endpoint(rank).map(str::to_owned) else {
            return Err(Refusal::new(503, format!("rank {rank} has no endpoint"), Outcome::RejectedNoRank));
        };
        self.metrics.outcome(Outcome::Routed);
        let mut named = vec![endpoint.clone()];
        let mut next = Vec::new();
        for &f in &r.fallbacks {
            if let Some(e) = gateway.endpoint(f).filter(|e| !named.iter().any(|n| n == e)) {
                named.push(e.to_owned());
                next.push((f, e.to_owned()));
            }
        }
        let predicted = explained.iter().find(|c| c.rank == rank).map(|c| c.predicted);
        Ok(Decision { rank, endpoint, fallbacks: next, gateway, predicted })
    }

    /// A request without a prompt (`GET /v1/models`, a health check): the
    /// next routable eligible rank's endpoint, as of the last tick, in
    /// turn, and the one after it; nothing booked, since it is no inference
    /// request. Counted `routed_bodyless`.
    pub fn bodyless(&self, subset: Option<&[String]>) -> Result<Decision, Refusal> {
        let gateway = self.gateway();
        let state = self.published.state();
        let among = match subset::eligible(&gateway, self.published.dp_size(), subset) {
            Ok(among) => among,
            Err(why) => return Err(Refusal::new(503, why, Outcome::RejectedNoRank)),
        };
        let up: Vec<(u32, String)> = (among.into_iter())
            .filter(|&r| state.ranks.get(r as usize).is_some_and(|v| super::routable(v.status)))
            .filter_map(|r| Some((r, gateway.endpoint(r)?.to_owned())))
            .collect();
        if up.is_empty() {
            let why = "no routable rank: none of the eligible ranks is up or stale";
            return Err(Refusal::new(503, why, Outcome::RejectedNoRank));
        }
        let turn = self.bodyless.fetch_add(1, Ordering::Relaxed) as usize % up.len();
        let (rank, endpoint) = up[turn].clone();
        let fallbacks = (up.len() > 1 && gateway.rank_header.is_none())
            .then(|| up[(turn + 1) % up.len()].clone())
            .into_iter()
            .collect();
        self.metrics.outcome(Outcome::RoutedBodyless);
        Ok(Decision { rank, endpoint, fallbacks, gateway, predicted: None })
    }

    /// The query's prompt: the engine's token ids (with a tokenizer), else
    /// text keys, each cut to the leading part that fits the route socket's
    /// message limit (a prefix is still a prefix; the length is the
    /// whole, estimated past a cut the tokenizer did not read).
    /// Tokenizing runs on the blocking pool, not the tasks' thread, at most
    /// [`TOKENIZING`] prompts at once and at a helper thread's lower CPU
    /// priority; text keys are hashed in place, cheaper than the handoff
    /// (and than the JSON parse the body already had).
    async fn key_prompt(&self, q: &mut Query, gateway: &Gateway, prompt: body::PromptText) {
        let encoder = self.prompts.encoder(gateway);
        let estimate = prompt.estimated_tokens();
        // 2 KiB for the rest of the query; at most 5 bytes an id, 9 a key;
        // and no more than `limits.max_prompt_tokens` lets in. A longer
        // prompt is tokenized only about that far.
        let room = self.max_query_bytes.saturating_sub(2048);
        let most = self.published.max_prompt_tokens() as usize;
        let ids = (room / 5).min(most);
        let encoded = if encoder.has_tokenizer() {
            // A burst of large prompts waits its turn here rather than
            // taking every core from the routing thread.
            let _turn = TOKENIZING.acquire().await.ok();
            tokio::task::spawn_blocking(move || {
                lower_this_thread();
                encoder.encode(&prompt, ids)
            })
            .await
            .ok()
        } else {
            Some(encoder.encode(&prompt, ids))
        };
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

    /// Books the end of a request placed on `placed` that `rank` served
    /// (moved there when they differ), and waits for the answer.
    pub async fn finish(&self, rank: u32, placed: u32) {
        if self.bridge.ask(finished(rank, placed)).await.is_none_or(|r| !r.ok) {
            tracing::debug!(rank, "a finished request was not booked");
        }
    }
}

/// The `finished` query of a request placed on `placed` that `rank` served.
pub fn finished(rank: u32, placed: u32) -> Query {
    Query { op: "finished", rank: Some(rank), placed: (placed != rank).then_some(placed), ..Query::default() }
}

/// The `delivered` report of a request served on `rank`: `predicted`
/// cached there, `delivered` served from the engine's cache.
pub fn delivered(rank: u32, predicted: u64, delivered: u64) -> Query {
    let (predicted, delivered) = (Some(predicted), Some(delivered));
    Query { op: "delivered", rank: Some(rank), predicted, delivered, ..Query::default() }
}

/// The `finished` query that withdraws a placement nothing served.
pub fn withdrawn(placed: u32) -> Query {
    Query { op: "finished", placed: Some(placed), ..Query::default() }
}
