//! An engine source as the transport serves it.

use crate::wire::SourceKind;

/// One engine source: its socket, the format it carries and where that is
/// decoded (its row in `io::sockets`).
pub struct Source {
    pub socket: zmq::Socket,
    pub kind: SourceKind,
    /// Decoded on the KV decoder's thread, off the routing thread.
    pub off_thread: bool,
}
