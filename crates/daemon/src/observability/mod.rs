//! Prometheus metrics and rate-limited logging.

pub mod kv_metrics;
pub mod memory_metrics;
pub mod metrics;
pub mod prefix_metrics;
pub mod ratelimit;
