//! The error of opening and running the sockets, and its constructors,
//! shared by every module of `io` that touches ZeroMQ.

use crate::config::keys::Key;

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{}", crate::io::ipc::endpoint_error(.what, .socket, *.key, .endpoint, .source))]
    Endpoint {
        what: &'static str,
        socket: &'static str,
        key: Option<&'static Key>,
        endpoint: String,
        source: zmq::Error,
    },
    #[error("cannot start the coordinator thread: {0}")]
    Thread(std::io::Error),
    #[error("cannot start a scraper thread: {0}")]
    ScrapeThread(std::io::Error),
    #[error("cannot start the KV decoder thread: {0}")]
    DecodeThread(std::io::Error),
    #[error("zeromq error on the {socket} socket: {source}")]
    Socket { socket: &'static str, source: zmq::Error },
    #[error(transparent)]
    IpcMode(#[from] crate::io::ipc::ModeError),
}

pub(super) fn sock_err(socket: &'static str) -> impl Fn(zmq::Error) -> TransportError {
    move |source| TransportError::Socket { socket, source }
}

/// `what` ("bind", "connect") failed for the `socket` at `endpoint`, which
/// configuration key `key` names (none for dpcoord's in-process sockets).
pub(super) fn endpoint_err(
    what: &'static str,
    socket: &'static str,
    key: Option<&'static Key>,
    endpoint: &str,
) -> impl FnOnce(zmq::Error) -> TransportError {
    let endpoint = endpoint.to_owned();
    move |source| TransportError::Endpoint { what, socket, key, endpoint, source }
}
