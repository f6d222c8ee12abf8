//! Binding the ZeroMQ endpoints: what a failed bind or connect says, and
//! the file mode of the ipc:// sockets dpcoord binds (`server.ipc_mode`).
//!
//! A failed bind names the key whose endpoint it is and, where one helps,
//! what to do (create an ipc:// socket's directory, ...). It is the
//! configuration's fault, so the daemon exits 2 (a supervisor does not
//! retry it), except for a port another process holds, which a retry may
//! find free (exit 1).
//!
//! libzmq creates a socket file with the process umask; connecting to it
//! needs write permission, so by default only dpcoord's user (or root) can.
//! With `ipc_mode` set, each bind site calls [`set_mode`] right after its
//! bind, so engines in the socket's group can connect as well.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::config::keys::{self, Key};

/// What to do about `source` at `endpoint`, as a clause to append.
fn hint(endpoint: &str, source: &zmq::Error) -> String {
    let file = endpoint.strip_prefix("ipc://").filter(|p| !p.starts_with('@') && *p != "*").map(Path::new);
    let dir = file.and_then(Path::parent).map(|d| if d.as_os_str().is_empty() { Path::new(".") } else { d });
    match (source, dir) {
        (zmq::Error::ENOENT, Some(dir)) => {
            format!("; the directory {} does not exist: create it first (mkdir -p)", dir.display())
        }
        (zmq::Error::EACCES, Some(dir)) => format!("; dpcoord's user cannot create files in {}", dir.display()),
        (zmq::Error::ENAMETOOLONG, Some(_)) => "; an ipc:// path is at most 107 bytes: use a shorter one".into(),
        (zmq::Error::EADDRNOTAVAIL, None) => "; no interface of this host has that address".into(),
        (zmq::Error::ENODEV, None) => "; no interface of this host has that name".into(),
        (zmq::Error::EADDRINUSE, _) => "; another process holds it".into(),
        _ => String::new(),
    }
}

/// The one line of a failed bind or connect: `KEY: cannot bind EP: why; hint`.
pub fn endpoint_error(what: &str, socket: &str, key: Option<&Key>, endpoint: &str, source: &zmq::Error) -> String {
    let hint = hint(endpoint, source);
    match key {
        Some(key) => format!("{}: cannot {what} {endpoint}: {source}{hint}", key.path()),
        None => format!("cannot {what} the {socket} socket to {endpoint}: {source}{hint}"),
    }
}

/// Whether a bind failed for a reason no retry mends: everything but a
/// port another process holds (or a transient shortage of resources).
pub fn bind_is_config_error(source: &zmq::Error) -> bool {
    use zmq::Error::*;
    matches!(source, ENOENT | EACCES | ENAMETOOLONG | EADDRNOTAVAIL | ENODEV | EINVAL | EPROTONOSUPPORT)
}

/// The same for the HTTP listener (`server.metrics_bind`).
pub fn listen_is_config_error(source: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(source.kind(), AddrNotAvailable | PermissionDenied | InvalidInput)
}

/// The mode could not be set: start-up fails with this one line.
#[derive(Debug, thiserror::Error)]
#[error("{}: cannot set mode {mode:04o} on {path}: {source}", keys::IPC_MODE.key.path())]
pub struct ModeError {
    pub mode: u32,
    pub path: String,
    #[source]
    pub source: std::io::Error,
}

/// Sets `mode` on the socket file `s` was just bound to, when `mode` is set
/// and that bind is a filesystem ipc:// endpoint (tcp://, inproc:// and
/// abstract `ipc://@name` sockets have no file and are left alone).
pub fn set_mode(s: &zmq::Socket, mode: Option<u32>) -> Result<(), ModeError> {
    let Some(mode) = mode else { return Ok(()) };
    // The endpoint as bound (a wildcard `ipc://*` resolved to its path).
    let endpoint = match s.get_last_endpoint() {
        Ok(Ok(ep)) => ep,
        Ok(Err(_)) => {
            let source = std::io::Error::other("the bound endpoint is not UTF-8");
            return Err(ModeError { mode, path: "?".into(), source });
        }
        Err(e) => return Err(ModeError { mode, path: "?".into(), source: std::io::Error::other(e) }),
    };
    match endpoint.strip_prefix("ipc://") {
        Some(path) if !path.starts_with('@') => std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .map_err(|source| ModeError { mode, path: path.to_owned(), source }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bound(ep: &str) -> (zmq::Context, zmq::Socket) {
        let ctx = zmq::Context::new();
        let s = ctx.socket(zmq::ROUTER).unwrap();
        s.set_linger(0).unwrap();
        s.bind(ep).unwrap();
        (ctx, s)
    }

    #[test]
    fn sets_the_mode_of_an_ipc_socket_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (_ctx, s) = bound(&format!("ipc://{}", path.display()));
        set_mode(&s, Some(0o660)).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o660);
        set_mode(&s, Some(0o600)).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
    }

    #[test]
    fn leaves_other_transports_and_no_mode_alone() {
        let (_ctx, s) = bound("tcp://127.0.0.1:*");
        set_mode(&s, Some(0o660)).unwrap();
        let (_ctx, s) = bound("inproc://ipc-mode-test");
        set_mode(&s, Some(0o660)).unwrap();
        set_mode(&s, None).unwrap();
    }

    #[test]
    fn a_bind_error_names_its_key_and_what_to_do() {
        let missing = endpoint_error(
            "bind",
            "stats",
            Some(&keys::STATS_BIND.key),
            "ipc:///no/such/dir/s.sock",
            &zmq::Error::ENOENT,
        );
        assert_eq!(
            missing,
            "server.stats_bind: cannot bind ipc:///no/such/dir/s.sock: No such file or directory; \
             the directory /no/such/dir does not exist: create it first (mkdir -p)"
        );
        let relative =
            endpoint_error("bind", "route", Some(&keys::ROUTE_BIND.key), "ipc://s.sock", &zmq::Error::ENOENT);
        assert!(relative.ends_with("; the directory . does not exist: create it first (mkdir -p)"), "{relative}");
        let busy = endpoint_error(
            "bind",
            "health",
            Some(&keys::HEALTH_BIND.key),
            "tcp://127.0.0.1:5571",
            &zmq::Error::EADDRINUSE,
        );
        assert_eq!(
            busy,
            "server.health_bind: cannot bind tcp://127.0.0.1:5571: Address already in use; another process holds it"
        );
        let inner = endpoint_error("bind", "zap", None, "inproc://zeromq.zap.01", &zmq::Error::EADDRINUSE);
        assert!(inner.starts_with("cannot bind the zap socket to inproc://zeromq.zap.01: "), "{inner}");
        assert!(bind_is_config_error(&zmq::Error::ENOENT) && !bind_is_config_error(&zmq::Error::EADDRINUSE));
    }

    #[test]
    fn a_vanished_socket_file_names_the_key_and_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gone.sock");
        let (_ctx, s) = bound(&format!("ipc://{}", path.display()));
        std::fs::remove_file(&path).unwrap();
        let e = set_mode(&s, Some(0o660)).unwrap_err().to_string();
        assert!(e.starts_with("server.ipc_mode: cannot set mode 0660 on "), "{e}");
        assert!(e.contains(&path.display().to_string()), "{e}");
    }
}
