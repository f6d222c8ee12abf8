//! The gateway's metrics, one set per front (the picker's
//! `dpcoord_gateway_*`, the proxy's `dpcoord_proxy_*`): requests by
//! outcome, errors by the rank that served, prompts by how they were keyed.

use prometheus::{IntCounterVec, Opts, Registry};

use super::prompt::{MODE_TEXT, MODE_TOKENIZER};
use dpcoord_daemon::observability::metrics::{built, register};

/// The gateway's two fronts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// The endpoint picker (`server.epp_bind`).
    Picker,
    /// The reverse proxy (`server.proxy_bind`).
    Proxy,
}

impl Front {
    fn prefix(self) -> &'static str {
        match self {
            Front::Picker => "dpcoord_gateway",
            Front::Proxy => "dpcoord_proxy",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Front::Picker => "the gateway endpoint picker",
            Front::Proxy => "the proxy",
        }
    }

    /// The outcomes this front can have.
    fn outcomes(self) -> impl Iterator<Item = Outcome> {
        Outcome::ALL.into_iter().filter(move |o| self == Front::Proxy || !o.proxy_only())
    }

    /// The kinds of a rank's errors this front sees.
    fn rank_errors(self) -> &'static [&'static str] {
        match self {
            Front::Picker => &["status_5xx", "reset"],
            Front::Proxy => &["status_5xx", "reset", "connect"],
        }
    }
}

dpcoord_daemon::names! {
    /// How a request through the gateway ended for the picker or the proxy.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Outcome {
        /// A rank picked and its endpoint given to the gateway.
        Routed => "routed",
        /// A request without a body (`GET /v1/models`): a routable rank's
        /// endpoint in turn, nothing booked.
        RoutedBodyless => "routed_bodyless",
        /// A body that cannot be routed (not JSON, no model, no prompt): 400.
        RejectedBadRequest => "rejected_bad_request",
        /// A body above `gateway.max_body_bytes`: 413.
        RejectedTooLarge => "rejected_too_large",
        /// No eligible rank (none routable, or none in the subset hint): 503.
        RejectedNoRank => "rejected_no_rank",
        /// Every eligible rank's queue at `gateway.shed_waiting` or deeper: 429.
        RejectedShed => "rejected_shed",
        /// The stream ended before the body did: nothing routed.
        RejectedReset => "rejected_reset",
        /// The coordinator could not be asked, or refused otherwise: 500.
        RejectedError => "rejected_error",
        /// The proxy only: at `proxy.max_buffered_bytes` of request bodies: 503.
        RejectedBusy => "rejected_busy",
        /// The proxy only: a body slower than `proxy.body_timeout_ms`: 408.
        RejectedTimeout => "rejected_timeout",
        /// The proxy only: the rank, and the next-best one, refused to connect: 502.
        FailedUnreachable => "failed_unreachable",
    }
}

impl Outcome {
    /// Whether only the proxy can end a request so.
    fn proxy_only(self) -> bool {
        matches!(self, Outcome::RejectedBusy | Outcome::RejectedTimeout | Outcome::FailedUnreachable)
    }
}

#[derive(Clone)]
pub struct GatewayMetrics {
    requests: IntCounterVec,
    rank_errors: IntCounterVec,
    prompts: IntCounterVec,
}

impl GatewayMetrics {
    /// Registered whether or not the front is on, so every series exists
    /// from the start: the outcomes, and each rank of `dp_size`'s errors
    /// (a rank added by a resize gets its series at its first error).
    pub fn new(registry: &Registry, dp_size: u32, front: Front) -> Self {
        let (prefix, what) = (front.prefix(), front.what());
        let requests = built(IntCounterVec::new(
            Opts::new(format!("{prefix}_requests_total"), format!("Requests {what} answered, by outcome")),
            &["outcome"],
        ));
        let rank_errors = built(IntCounterVec::new(
            Opts::new(
                format!("{prefix}_rank_errors_total"),
                format!(
                    "Requests through {what} that failed on the rank that served them ({})",
                    front.rank_errors().join(", ")
                ),
            ),
            &["dp_rank", "kind"],
        ));
        let prompts = built(IntCounterVec::new(
            Opts::new(
                format!("{prefix}_prompts_total"),
                format!("Prompts {what} routed, by how they were keyed: tokenizer (the engine's token ids) or text"),
            ),
            &["mode"],
        ));
        for mode in [MODE_TOKENIZER, MODE_TEXT] {
            prompts.with_label_values(&[mode]);
        }
        for o in front.outcomes() {
            requests.with_label_values(&[o.as_str()]);
        }
        for rank in 0..dp_size {
            for kind in front.rank_errors() {
                rank_errors.with_label_values(&[rank.to_string().as_str(), kind]);
            }
        }
        GatewayMetrics {
            requests: register(registry, requests),
            rank_errors: register(registry, rank_errors),
            prompts: register(registry, prompts),
        }
    }

    /// A routed prompt keyed in `mode` (`Encoded::mode`).
    pub fn prompt(&self, mode: &str) {
        self.prompts.with_label_values(&[mode]).inc();
    }

    pub fn outcome(&self, o: Outcome) {
        self.requests.with_label_values(&[o.as_str()]).inc();
    }

    /// `kind`: `status_5xx`, `reset` or (the proxy) `connect`.
    pub fn rank_error(&self, rank: u32, kind: &str) {
        self.rank_errors.with_label_values(&[&rank.to_string(), kind]).inc();
    }
}
