//! The error of opening and running the sockets, and its constructors,
//! shared by every module of `io` that touches ZeroMQ.

#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    #[error("{}", crate::io::ipc::endpoint_error(.what, .socket, .endpoint, .source))]
    Endpoint { what: &'static str, socket: &'static str, endpoint: String, source: zmq::Error },
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

pub(super) fn endpoint_err(
    what: &'static str,
    socket: &'static str,
    endpoint: &str,
) -> impl FnOnce(zmq::Error) -> TransportError {
    let endpoint = endpoint.to_owned();
    move |source| TransportError::Endpoint { what, socket, endpoint, source }
}
