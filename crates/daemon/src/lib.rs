//! dpcoord: a data-parallel rank coordinator for LLM serving.
//!
//! Engines (DP ranks) publish stats over ZeroMQ; frontends ask dpcoord which
//! rank takes each request; probers use a separate health channel whose
//! state cannot touch user routing. See README.md and docs/PROTOCOL.md.
//!
//! The folders are the concerns (docs/code-map.md has every file):
//! - `wire`: bytes <-> typed messages (no I/O, no state)
//! - `engines`: what each rank reported, liveness, penalties, engine events
//! - `routing`: the coordinator and the user side (dispatcher, policies, ledgers, sessions)
//! - `health`: the health channel, which sees engines through a narrow handle only
//! - `io`: ZeroMQ sockets, the HTTP server, the daemon's thread
//! - `observability`: Prometheus metrics and rate-limited logging
//! - `config`: TOML + flags -> checked settings
//!
//! The simulator and `dpcoord demo` (crates/sim) and the gateway's two
//! fronts, the endpoint picker and the proxy (crates/gateway), are crates of
//! their own, which use this one; nothing here names them. A frontend in the
//! same process asks through in-process endpoints the daemon opens on
//! request (`io::sockets::Local`).
// One audited exception, `io::trim::release` (malloc_trim: no preconditions,
// the proof is beside it); everything else is safe code.
#![deny(unsafe_code)]

pub mod config;
pub mod engines;
pub mod health;
pub mod io;
mod names;
pub mod observability;
pub mod routing;
pub mod wire;
