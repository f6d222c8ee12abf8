//! Everything that touches the outside: ZeroMQ sockets, the HTTP server,
//! the coordinator's thread.

pub mod access;
pub mod daemon;
pub mod fds;
pub mod http;
pub mod ipc;
mod kv_decode;
mod links;
mod niceness;
mod peer_sources;
mod peers;
pub mod probe;
pub mod reload;
pub mod scrape;
pub mod signals;
pub mod sockets;
pub mod transport;
mod trim;
mod zap;
