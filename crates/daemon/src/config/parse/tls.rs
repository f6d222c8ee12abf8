//! `server.epp_tls` and its files: the mode, and with `files` the
//! certificate chain and the private key, each a readable regular file
//! holding a PEM block of its kind. Parsing the blocks (and checking the
//! key is the certificate's) is the gateway's, which has the TLS crates:
//! `check-config` and the start do it too (crates/gateway/src/tls.rs).

use std::path::PathBuf;

use super::{err, keys, ConfigError, Section};
use crate::config::{EppTls, EppTlsMode};

/// The largest certificate or key file read: a chain of a few certificates
/// is a few KiB.
pub const MAX_PEM_BYTES: u64 = 1 << 20;

pub(super) fn parse_epp_tls(s: &mut Section<'_>) -> Result<EppTls, ConfigError> {
    let name = s.string(&keys::EPP_TLS)?;
    let mode = EppTlsMode::parse(&name).ok_or_else(|| {
        let available = EppTlsMode::ALL.map(EppTlsMode::as_str).join(", ");
        err(keys::EPP_TLS.key.path(), format!("unknown mode \"{name}\"; available: {available}"))
    })?;
    let cert = s.string(&keys::EPP_CERT)?;
    let key = s.string(&keys::EPP_KEY)?;
    let files = [(&keys::EPP_CERT, cert, Pem::Certificate), (&keys::EPP_KEY, key, Pem::PrivateKey)];
    if mode != EppTlsMode::Files {
        if let Some((k, _, _)) = files.iter().find(|(_, v, _)| !v.is_empty()) {
            let why = format!("is read only with {} = \"files\" (it is \"{name}\")", keys::EPP_TLS.key.path());
            return Err(err(k.key.path(), why));
        }
        return Ok(if mode == EppTlsMode::Off { EppTls::Off } else { EppTls::SelfSigned });
    }
    let [cert, key] = files.map(|(k, path, kind)| {
        if path.is_empty() {
            let what = match kind {
                Pem::Certificate => "the certificate chain's PEM file (leaf first)",
                Pem::PrivateKey => "the certificate's private key, a PEM file",
            };
            return Err(err(k.key.path(), format!("{} = \"files\" needs {what} here", keys::EPP_TLS.key.path())));
        }
        check_pem(&path, kind).map_err(|p| err(k.key.path(), p))?;
        Ok(PathBuf::from(path))
    });
    Ok(EppTls::Files { cert: cert?, key: key? })
}

/// What a PEM file must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pem {
    /// `-----BEGIN CERTIFICATE-----`
    Certificate,
    /// `-----BEGIN PRIVATE KEY-----` (PKCS#8), `RSA PRIVATE KEY` (PKCS#1)
    /// or `EC PRIVATE KEY` (SEC1), unencrypted.
    PrivateKey,
}

/// Reads `path` (a regular file of at most [`MAX_PEM_BYTES`]) and looks for
/// a whole PEM block of `kind`: its BEGIN and END lines, base64 between.
fn check_pem(path: &str, kind: Pem) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read `{path}`: {e}"))?;
    if !meta.is_file() {
        return Err(format!("`{path}` is not a file"));
    }
    if meta.len() > MAX_PEM_BYTES {
        return Err(format!("`{path}` is {} bytes, above {MAX_PEM_BYTES}: not a PEM file", meta.len()));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read `{path}`: {e}"))?;
    let labels = pem_labels(&bytes);
    let found = labels.iter().any(|l| match kind {
        Pem::Certificate => l == "CERTIFICATE",
        Pem::PrivateKey => ["PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"].contains(&l.as_str()),
    });
    if found {
        return Ok(());
    }
    let (what, begin) = match kind {
        Pem::Certificate => ("certificate", "-----BEGIN CERTIFICATE-----"),
        Pem::PrivateKey => ("private key", "-----BEGIN PRIVATE KEY-----"),
    };
    if labels.iter().any(|l| l == "ENCRYPTED PRIVATE KEY") {
        return Err(format!("`{path}` holds an encrypted private key: dpcoord reads it unencrypted"));
    }
    let held = match labels.is_empty() {
        true => "no PEM block".to_owned(),
        false => format!("only {}", labels.iter().map(|l| format!("`{l}`")).collect::<Vec<_>>().join(", ")),
    };
    Err(format!("`{path}` holds no PEM {what} ({begin}): {held}"))
}

/// The labels of the whole PEM blocks in `bytes`: a `-----BEGIN L-----`
/// line, base64 lines, and its `-----END L-----` line.
fn pem_labels(bytes: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(bytes);
    let mut labels = Vec::new();
    let mut open: Option<(&str, bool)> = None;
    for line in text.lines().map(str::trim) {
        let label = |prefix: &str| line.strip_prefix(prefix).and_then(|l| l.strip_suffix("-----"));
        match (open, label("-----BEGIN "), label("-----END ")) {
            (_, Some(l), _) => open = Some((l, false)),
            (Some((l, body)), _, Some(end)) => {
                if end == l && body {
                    labels.push(l.to_owned());
                }
                open = None;
            }
            (Some((l, _)), None, None) if !line.is_empty() => {
                let base64 = line.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b));
                open = base64.then_some((l, true));
            }
            _ => {}
        }
    }
    labels
}

#[cfg(test)]
mod tests {
    use super::pem_labels;

    #[test]
    fn whole_blocks_are_found_and_broken_ones_are_not() {
        let cert = "junk\n-----BEGIN CERTIFICATE-----\nMIIB+w==\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_labels(cert.as_bytes()), ["CERTIFICATE"]);
        let two = format!("{cert}-----BEGIN EC PRIVATE KEY-----\nAAAA\nBBBB\n-----END EC PRIVATE KEY-----\n");
        assert_eq!(pem_labels(two.as_bytes()), ["CERTIFICATE", "EC PRIVATE KEY"]);
        for broken in [
            "-----BEGIN CERTIFICATE-----\nMIIB\n",
            "-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n",
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
            "-----BEGIN CERTIFICATE-----\nMIIB\n-----END PRIVATE KEY-----\n",
            "",
        ] {
            assert!(pem_labels(broken.as_bytes()).is_empty(), "{broken:?}");
        }
    }
}
