//! The integration tests, one binary: each module spawns the real `dpcoord`
//! binary and talks to it with real ZeroMQ sockets and real HTTP, through
//! the shared harness in `common`. One binary compiles the harness once and
//! links once. Run one file's tests with `cargo test --test it NAME::`.

mod common;

mod access;
mod alerts_prometheus;
mod cli_errors;
mod config_bounds;
mod config_files;
mod core_errors;
mod core_liveness;
mod core_routing;
mod core_signals;
mod core_stats;
mod demo;
mod docs_match;
mod explain;
mod frame_bound;
mod gateway;
mod health_flood;
mod health_penalty;
mod heavy_input;
mod http_limits;
mod http_metrics;
mod ipc_mode;
mod isolation;
mod kv_events;
mod layering;
mod load_aware;
mod logging;
mod memory_budget;
mod memory_ceiling;
mod operations;
mod own_rank;
mod peer_cap;
mod probe;
mod proxy;
mod reliability_faults;
mod reliability_flood;
mod reliability_limits;
mod reload_bounds;
mod sglang_load;
mod sim;
mod sim_prefix;
mod sim_trace;
mod smoke;
mod source_bounds;
mod stalls;
mod vllm_metrics;
mod wire_bounds;
