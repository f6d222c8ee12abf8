//! The file mode of the ipc:// sockets dpcoord binds (`server.ipc_mode`).
//!
//! libzmq creates a socket file with the process umask; connecting to it
//! needs write permission, so by default only dpcoord's user (or root) can.
//! With `ipc_mode` set, each bind site calls [`set_mode`] right after its
//! bind, so engines in the socket's group can connect as well.

use std::os::unix::fs::PermissionsExt;

/// The mode could not be set: start-up fails with this one line.
#[derive(Debug, thiserror::Error)]
#[error("server.ipc_mode: cannot set mode {mode:04o} on {path}: {source}")]
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
