//! The picker's TLS (`server.epp_tls`), as the Inference Extension's own
//! endpoint picker serves: TLS 1.2 or 1.3 (rustls on ring) with ALPN `h2`,
//! on a certificate made at start (`self_signed`, for `localhost` and the
//! listener's address: gateways skip verifying it) or read from PEM files
//! (`files`), read again when either file changes. `off` is plaintext.
//!
//! The picker accepts TCP itself ([`accept`]): each connection's handshake
//! runs in a task of its own within [`HANDSHAKE_DEADLINE`] (a connection
//! that never finishes it is closed, so silent ones cannot pile up), at
//! most [`MAX_HANDSHAKES`] at once (fewer when the `nofile` limit is low:
//! a front's share of it), and tonic serves the finished ones.

use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use dpcoord_daemon::config::{keys, ConfigError, EppTls, Server, MAX_PEM_BYTES};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls::ServerConfig;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, Semaphore};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How long a connection has from its accept to the end of its TLS
/// handshake; then it is closed.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(5);
/// Handshakes in flight at once, at most (and within the descriptors'
/// share, [`Tls::within`]); a connection beyond them is closed at once.
pub const MAX_HANDSHAKES: usize = 1024;
/// How often `files` are looked at (their size, inode and mtime).
pub const RELOAD_EVERY: Duration = Duration::from_secs(2);

/// The picker's TLS, ready before the daemon starts.
pub struct Tls {
    acceptor: TlsAcceptor,
    /// With `files`: the pair in force and what it was read from.
    files: Option<Arc<Files>>,
    /// Handshakes in flight at once; a connection beyond them is closed at once.
    most_handshakes: usize,
}

impl Tls {
    /// At most `descriptors` handshakes in flight (a front's share of the
    /// `nofile` limit), and never more than [`MAX_HANDSHAKES`].
    pub fn within(mut self, descriptors: usize) -> Tls {
        self.most_handshakes = descriptors.clamp(1, MAX_HANDSHAKES);
        self
    }

    /// The TLS `server.epp_tls` asks for on a picker listening on `addr`;
    /// `None` for plaintext. A file that does not load is an error naming
    /// its key.
    pub fn load(tls: &EppTls, addr: SocketAddr) -> Result<Option<Tls>, ConfigError> {
        let (current, files) = match tls {
            EppTls::Off => return Ok(None),
            EppTls::SelfSigned => (Arc::new(Current::new(self_signed(addr)?)), None),
            EppTls::Files { cert, key } => {
                let seen = (stamp(cert), stamp(key));
                let current = Arc::new(Current::new(read_pair(cert, key)?));
                let files = Files { cert: cert.clone(), key: key.clone(), seen: Mutex::new(seen), current };
                (Arc::clone(&files.current), Some(Arc::new(files)))
            }
        };
        let config = server_config(current).map_err(|e| err(&keys::EPP_TLS, format!("cannot serve TLS: {e}")))?;
        Ok(Some(Tls { acceptor: TlsAcceptor::from(Arc::new(config)), files, most_handshakes: MAX_HANDSHAKES }))
    }

    /// Looks at the files every [`RELOAD_EVERY`] and takes a new pair that
    /// loads (a bad one keeps the pair in force, with a warning); nothing
    /// to do without `files`. Runs until aborted.
    pub async fn watch(&self) {
        let Some(files) = self.files.clone() else { return std::future::pending().await };
        let mut tick = tokio::time::interval(RELOAD_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        loop {
            tick.tick().await;
            let files = Arc::clone(&files);
            // Reading files blocks: off the runtime's threads.
            let _ = tokio::task::spawn_blocking(move || files.refresh()).await;
        }
    }
}

/// `check-config`'s look at the picker's TLS: with `files`, the pair is
/// read and parsed as the start would (the key must be the certificate's).
pub fn check(server: &Server) -> Result<(), ConfigError> {
    match &server.epp_tls {
        EppTls::Files { cert, key } => read_pair(cert, key).map(drop),
        EppTls::SelfSigned | EppTls::Off => Ok(()),
    }
}

/// Accepts on `listener` until `stopped`, and hands each connection whose
/// handshake ended within [`HANDSHAKE_DEADLINE`] to `served`.
pub async fn accept(
    listener: TcpListener,
    tls: Arc<Tls>,
    served: mpsc::Sender<std::io::Result<TlsStream<TcpStream>>>,
    mut stopped: watch::Receiver<bool>,
) {
    let handshakes = Arc::new(Semaphore::new(tls.most_handshakes));
    let mut last_warned: Option<Instant> = None;
    let mut warn = |what: &str, error: &dyn std::fmt::Display| {
        if last_warned.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
            tracing::warn!(error = %error, "{what}");
            last_warned = Some(Instant::now());
        }
    };
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.wait_for(|s| *s) => return,
            () = served.closed() => return,
        };
        let (tcp, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of descriptors, or reset before it was accepted: wait
                // a little rather than spin.
                warn("cannot accept a picker connection", &e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&handshakes).try_acquire_owned() else {
            warn("picker connection closed: too many TLS handshakes in flight", &tls.most_handshakes);
            continue;
        };
        // A pick is a few small HTTP/2 frames: none waits for the peer's
        // delayed ACK (40 ms on Linux).
        let _ = tcp.set_nodelay(true);
        let (acceptor, served) = (tls.acceptor.clone(), served.clone());
        tokio::spawn(async move {
            let done = tokio::time::timeout(HANDSHAKE_DEADLINE, acceptor.accept(tcp)).await;
            drop(slot);
            match done {
                Ok(Ok(stream)) => {
                    let _ = served.send(Ok(stream)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "picker TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "picker TLS handshake not done within its deadline: closed"),
            }
        });
    }
}

fn err(key: &keys::StrKey, problem: impl Into<String>) -> ConfigError {
    ConfigError { key: key.key.path(), problem: problem.into() }
}

/// The provider of every TLS object here: ring's, named (not the process
/// default, which another crate could install). rustls 0.23.48 deprecates
/// it for having no post-quantum key exchange (aws-lc-rs has one, and
/// wants cmake to build): the picker's handshakes use X25519, P-256 or
/// P-384, with a gateway inside the cluster.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn server_config(current: Arc<Current>) -> Result<ServerConfig, rustls::Error> {
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_no_client_auth()
        .with_cert_resolver(current);
    // gRPC is HTTP/2, which gRPC clients ask for by ALPN.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(config)
}

/// A certificate made now for `localhost` and the listener's address (the
/// loopback ones when it listens on every interface).
fn self_signed(addr: SocketAddr) -> Result<CertifiedKey, ConfigError> {
    let bad = |e: &dyn std::fmt::Display| err(&keys::EPP_TLS, format!("cannot make a self-signed certificate: {e}"));
    let ip = addr.ip();
    let mut names = vec!["localhost".to_owned()];
    match ip.is_unspecified() {
        true => names.extend(["127.0.0.1".to_owned(), "::1".to_owned()]),
        false => names.push(ip.to_string()),
    }
    let made = rcgen::generate_simple_self_signed(names).map_err(|e| bad(&e))?;
    let key = PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
    CertifiedKey::from_der(vec![made.cert.der().clone()], key, &provider()).map_err(|e| bad(&e))
}

/// Reads a PEM file of at most [`MAX_PEM_BYTES`].
fn read_pem(path: &Path) -> Result<Vec<u8>, String> {
    let shown = path.display();
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_PEM_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot read `{shown}`: {e}"))?;
    if bytes.len() as u64 > MAX_PEM_BYTES {
        return Err(format!("`{shown}` is above {MAX_PEM_BYTES} bytes: not a PEM file"));
    }
    Ok(bytes)
}

/// The certificate chain (leaf first) and its key, parsed and matched:
/// an error names `server.epp_cert` or `server.epp_key`.
fn read_pair(cert: &Path, key: &Path) -> Result<CertifiedKey, ConfigError> {
    let (cert_shown, key_shown) = (cert.display(), key.display());
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&read_pem(cert).map_err(|p| err(&keys::EPP_CERT, p))?)
            .collect::<Result<_, _>>()
            .map_err(|e| err(&keys::EPP_CERT, format!("`{cert_shown}` is not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(err(&keys::EPP_CERT, format!("`{cert_shown}` holds no certificate")));
    }
    let der = PrivateKeyDer::from_pem_slice(&read_pem(key).map_err(|p| err(&keys::EPP_KEY, p))?)
        .map_err(|e| err(&keys::EPP_KEY, format!("`{key_shown}` holds no private key: {e}")))?;
    let signing = provider()
        .key_provider
        .load_private_key(der)
        .map_err(|e| err(&keys::EPP_KEY, format!("`{key_shown}` is not a key rustls can sign with: {e}")))?;
    let pair = CertifiedKey::new(certs, signing);
    match pair.keys_match() {
        Ok(()) | Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(pair),
        Err(rustls::Error::InconsistentKeys(_)) => {
            Err(err(&keys::EPP_KEY, format!("`{key_shown}` is not the key of the certificate in `{cert_shown}`")))
        }
        Err(e) => Err(err(&keys::EPP_CERT, format!("`{cert_shown}`: its first certificate does not parse: {e}"))),
    }
}

/// What tells a file changed: its device, inode (a Kubernetes Secret's
/// volume swaps a symlink), size and mtime; `None` when it cannot be read.
type Stamp = Option<(u64, u64, u64, i64, i64)>;

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// The pair each handshake is answered with.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl Current {
    fn new(pair: CertifiedKey) -> Current {
        Current(RwLock::new(Arc::new(pair)))
    }
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0.read().unwrap_or_else(|p| p.into_inner())))
    }
}

/// `files`: the two paths, what they were when last read, the pair in force.
struct Files {
    cert: PathBuf,
    key: PathBuf,
    seen: Mutex<(Stamp, Stamp)>,
    current: Arc<Current>,
}

impl Files {
    /// Reads the pair again when either file changed since it was last
    /// looked at; a pair that does not load keeps the one in force (until
    /// the files change again).
    fn refresh(&self) {
        let now = (stamp(&self.cert), stamp(&self.key));
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if *seen == now {
                return;
            }
            *seen = now;
        }
        match read_pair(&self.cert, &self.key) {
            Ok(pair) => {
                *self.current.0.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(pair);
                tracing::info!(cert = %self.cert.display(), "the picker's certificate was read again: new connections get it");
            }
            Err(e) => tracing::warn!(
                error = %e,
                "the picker's certificate files changed but do not load: the pair in force is kept"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate for `name` and its key, PEM, in `dir`.
    fn pair(dir: &Path, name: &str) -> (PathBuf, PathBuf) {
        let made = rcgen::generate_simple_self_signed(vec![name.to_owned()]).unwrap();
        let (cert, key) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        (cert, key)
    }

    fn leaf(current: &Current) -> CertificateDer<'static> {
        current.0.read().unwrap().cert[0].clone()
    }

    #[test]
    fn a_self_signed_certificate_names_localhost_and_the_address() {
        for addr in ["127.0.0.1:9002", "0.0.0.0:9002", "[::1]:9002"] {
            let made = self_signed(addr.parse().unwrap()).unwrap();
            assert_eq!(made.keys_match(), Ok(()), "{addr}");
        }
        assert!(Tls::load(&EppTls::Off, "127.0.0.1:1".parse().unwrap()).unwrap().is_none());
        assert!(Tls::load(&EppTls::SelfSigned, "127.0.0.1:1".parse().unwrap()).unwrap().is_some());
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_naming_epp_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = pair(dir.path(), "a");
        let (_, other) = pair(dir.path(), "b");
        assert!(read_pair(&cert, &key).is_ok());
        let e = read_pair(&cert, &other).unwrap_err();
        assert_eq!(e.key, "server.epp_key");
        assert!(e.problem.contains("is not the key of the certificate in"), "{e}");
        // A block of the right shape holding no certificate.
        std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").unwrap();
        assert_eq!(read_pair(&cert, &key).unwrap_err().key, "server.epp_cert");
    }

    #[test]
    fn changed_files_are_read_again_and_a_bad_pair_keeps_the_one_in_force() {
        let dir = tempfile::tempdir().unwrap();
        let (a_cert, a_key) = pair(dir.path(), "a");
        let (b_cert, b_key) = pair(dir.path(), "b");
        let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
        std::fs::copy(&a_cert, &cert).unwrap();
        std::fs::copy(&a_key, &key).unwrap();
        let files = EppTls::Files { cert: cert.clone(), key: key.clone() };
        let tls = Tls::load(&files, "127.0.0.1:1".parse().unwrap()).unwrap().unwrap();
        let files = tls.files.as_ref().unwrap();
        let first = leaf(&files.current);
        files.refresh();
        assert_eq!(leaf(&files.current), first, "nothing changed");
        // Swapped as a Secret's volume does: a new inode under the name.
        for (from, to) in [(&b_key, &key), (&b_cert, &cert)] {
            let tmp = to.with_extension("new");
            std::fs::copy(from, &tmp).unwrap();
            std::fs::rename(&tmp, to).unwrap();
        }
        files.refresh();
        let second = leaf(&files.current);
        assert_ne!(second, first);
        assert_eq!(second.as_ref(), CertificateDer::from_pem_file(&b_cert).unwrap().as_ref());
        std::fs::write(&key, "not a key").unwrap();
        files.refresh();
        assert_eq!(leaf(&files.current), second, "a bad key keeps the pair in force");
    }
}
