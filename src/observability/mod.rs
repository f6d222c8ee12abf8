//! Prometheus metrics and rate-limited logging.

pub mod metrics;
pub mod ratelimit;
