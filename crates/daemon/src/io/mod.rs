//! Everything that touches the outside: ZeroMQ sockets, the HTTP server,
//! the coordinator's thread.

pub mod access;
pub mod daemon;
mod error;
pub mod fds;
mod frames;
pub mod http;
pub mod ipc;
mod kv_decode;
mod links;
mod monitor;
pub mod niceness;
mod peer_sources;
mod peers;
pub mod probe;
mod queries;
pub mod reload;
pub mod scrape;
pub mod signals;
pub mod sockets;
mod source;
pub mod transport;
mod trim;
mod zap;
