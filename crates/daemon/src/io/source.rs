//! An engine source as the transport serves it.

use crate::wire::SourceKind;

/// One engine source: a SUB socket and the format it carries.
pub struct Source {
    pub socket: zmq::Socket,
    pub kind: SourceKind,
}
