//! dpcoord: a data-parallel rank coordinator for LLM serving.
//!
//! Engines (DP ranks) publish stats over ZeroMQ; frontends ask dpcoord which
//! rank takes each request; probers use a separate health channel whose
//! state cannot touch user routing. See README.md and PROTOCOL.md.
#![forbid(unsafe_code)]

pub mod access;
pub mod config;
pub mod coordinator;
pub mod daemon;
pub mod demo;
pub mod engine;
pub mod health;
pub mod http;
pub mod ledger;
pub mod load;
pub mod metrics;
pub mod penalty;
pub mod policy;
pub mod ratelimit;
pub mod session;
pub mod sim;
pub mod transport;
pub mod user;
pub mod window;
pub mod wire;
