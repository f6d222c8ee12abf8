//! The picker's metrics: requests by outcome, errors by the rank that served.

use prometheus::{IntCounterVec, Opts, Registry};

use super::prompt::{MODE_TEXT, MODE_TOKENIZER};
use crate::observability::metrics::{built, register};

/// How a request through the gateway ended for the picker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A rank picked and its endpoint given to the gateway.
    Routed,
    /// A request without a body (`GET /v1/models`): a routable rank's
    /// endpoint in turn, nothing booked.
    RoutedBodyless,
    /// A body that cannot be routed (not JSON, no model, no prompt): 400.
    RejectedBadRequest,
    /// A body above `gateway.max_body_bytes`: 413.
    RejectedTooLarge,
    /// No eligible rank (none routable, or none in the subset hint): 503.
    RejectedNoRank,
    /// Every eligible rank's queue at `gateway.shed_waiting` or deeper: 429.
    RejectedShed,
    /// The stream ended before the body did: nothing routed.
    RejectedReset,
    /// The coordinator could not be asked, or refused otherwise: 500.
    RejectedError,
}

impl Outcome {
    pub const ALL: [Outcome; 8] = [
        Outcome::Routed,
        Outcome::RoutedBodyless,
        Outcome::RejectedBadRequest,
        Outcome::RejectedTooLarge,
        Outcome::RejectedNoRank,
        Outcome::RejectedShed,
        Outcome::RejectedReset,
        Outcome::RejectedError,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Routed => "routed",
            Outcome::RoutedBodyless => "routed_bodyless",
            Outcome::RejectedBadRequest => "rejected_bad_request",
            Outcome::RejectedTooLarge => "rejected_too_large",
            Outcome::RejectedNoRank => "rejected_no_rank",
            Outcome::RejectedShed => "rejected_shed",
            Outcome::RejectedReset => "rejected_reset",
            Outcome::RejectedError => "rejected_error",
        }
    }
}

#[derive(Clone)]
pub struct GatewayMetrics {
    requests: IntCounterVec,
    rank_errors: IntCounterVec,
    prompts: IntCounterVec,
}

impl GatewayMetrics {
    /// Registered whether or not the picker is on, so every series exists
    /// from the start: the outcomes, and each rank of `dp_size`'s errors
    /// (a rank added by a resize gets its series at its first error).
    pub fn new(registry: &Registry, dp_size: u32) -> Self {
        let requests = built(IntCounterVec::new(
            Opts::new("dpcoord_gateway_requests_total", "Requests the gateway endpoint picker answered, by outcome"),
            &["outcome"],
        ));
        let rank_errors = built(IntCounterVec::new(
            Opts::new(
                "dpcoord_gateway_rank_errors_total",
                "Requests through the gateway that failed on the rank that served them (status_5xx, reset)",
            ),
            &["dp_rank", "kind"],
        ));
        let prompts = built(IntCounterVec::new(
            Opts::new(
                "dpcoord_gateway_prompts_total",
                "Prompts the gateway endpoint picker routed, by how they were keyed: tokenizer (the engine's token ids) or text",
            ),
            &["mode"],
        ));
        for mode in [MODE_TOKENIZER, MODE_TEXT] {
            prompts.with_label_values(&[mode]);
        }
        for o in Outcome::ALL {
            requests.with_label_values(&[o.as_str()]);
        }
        for rank in 0..dp_size {
            for kind in ["status_5xx", "reset"] {
                rank_errors.with_label_values(&[&rank.to_string(), kind]);
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

    /// `kind`: `status_5xx` or `reset`.
    pub fn rank_error(&self, rank: u32, kind: &str) {
        self.rank_errors.with_label_values(&[&rank.to_string(), kind]).inc();
    }
}
