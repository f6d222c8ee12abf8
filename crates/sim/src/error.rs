//! The simulator's errors: [`NetError`], what a simulated peer's exchange
//! with dpcoord can fail with, and [`SimError`], what a run of `dpcoord sim`
//! or `dpcoord demo` fails with. Both sit below every other module, so any
//! of them can return either without importing the modules above it.

use std::time::Duration;

use dpcoord_daemon::config::ConfigError;
use dpcoord_daemon::io::sockets::TransportError;

use super::trace_file::TraceError;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("zeromq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("dpcoord did not answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot encode a query: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
    #[error("undecodable reply from dpcoord: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    #[error("dpcoord refused `{op}`: {code}: {message}")]
    Refused { op: &'static str, code: String, message: String },
    #[error("ranks did not come up within {0:?}; are the engines publishing to the stats endpoint?")]
    NotUp(Duration),
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("{0}")]
    Net(#[from] NetError),
    #[error("{0}")]
    Daemon(#[from] TransportError),
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Http(#[from] dpcoord_daemon::io::http::BindError),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Trace(#[from] TraceError),
    #[error("{scenario}: {what}")]
    Broken { scenario: &'static str, what: String },
}
