"""The picker's TLS (``server.epp_tls``) against the real binary, from
gRPC's own TLS client: a self-signed certificate made at start, a pair of
files read again when they change, plaintext refused, and a connection
that never starts its handshake closed at the deadline (5 s) while others
are served. Certificates are made here with ``cryptography``."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import DEADLINE, bring_up, eventually, free_port
from test_gateway_epp import A, B, Stream, config, pending, picked, request, respond

#: crates/gateway/src/tls.rs: HANDSHAKE_DEADLINE, RELOAD_EVERY.
HANDSHAKE_DEADLINE = 5.0
RELOAD_EVERY = 2.0
SERVING = health_pb2.HealthCheckResponse.SERVING


def start(start_daemon, tmp_path: Path, tls: str, server: str = ""):
    """A picker of 2 ranks serving with ``epp_tls = tls``; the daemon and its port."""
    port = free_port()
    cfg = tmp_path / "epp.toml"
    cfg.write_text(config(port, 2, [A, B], tls=tls, server=server))
    d = start_daemon("--config", str(cfg))
    return d, port


def served_cert(port: int) -> str:
    """The certificate the picker presents to a new connection, PEM."""
    return ssl.get_server_certificate(("127.0.0.1", port), timeout=DEADLINE)


def channel(port: int, trusted: str) -> grpc.Channel:
    """A gRPC TLS channel that trusts ``trusted`` (PEM) alone, connected."""
    creds = grpc.ssl_channel_credentials(root_certificates=trusted.encode())
    ch = grpc.secure_channel(f"127.0.0.1:{port}", creds)
    grpc.channel_ready_future(ch).result(timeout=DEADLINE)
    return ch


def health(ch: grpc.Channel, service: str = "liveness", timeout: float = DEADLINE) -> int:
    stub = health_pb2_grpc.HealthStub(ch)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def pick(d, ch: grpc.Channel) -> str:
    """One streamed request through the picker, answered and ended: its endpoint."""
    s = Stream(ch)
    request(s)
    endpoint, _ = picked(s)
    respond(s, endpoint)
    eventually("the placement completes", lambda: pending(d) == [0, 0])
    return endpoint


def make_pair(name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, and its key (PEM)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        # Its own root: the client trusts it as such.
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode(), key_pem.decode()


def replace(path: Path, text: str) -> None:
    """Writes ``path`` whole at once, as a Secret's volume swaps its files."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def same_cert(a: str, b: str) -> bool:
    return ssl.PEM_cert_to_DER_cert(a) == ssl.PEM_cert_to_DER_cert(b)


def test_self_signed_serves_a_pick_and_health_over_tls(start_daemon, engines, tmp_path):
    d, port = start(start_daemon, tmp_path, "self_signed")
    pem = served_cert(port)
    cert = x509.load_pem_x509_certificate(pem.encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in sans.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("127.0.0.1") in sans.get_values_for_type(x509.IPAddress)
    ch = channel(port, pem)
    assert health(ch, "liveness") == SERVING
    bring_up(d, engines, [0, 1])
    eventually("ready over TLS", lambda: health(ch, "readiness") == SERVING)
    assert health(ch, "envoy.service.ext_proc.v3.ExternalProcessor") == SERVING
    assert {pick(d, ch), pick(d, ch)} == {A, B}, "round robin, over TLS as in plaintext"
    assert d.metric("dpcoord_gateway_requests_total", 'outcome="routed"') == 2
    # TLS 1.3 and 1.2 both, h2 by ALPN (what gRPC clients and Envoy ask for).
    for newest, version in [(ssl.TLSVersion.TLSv1_3, "TLSv1.3"), (ssl.TLSVersion.TLSv1_2, "TLSv1.2")]:
        ctx = ssl.create_default_context(cadata=pem)
        ctx.maximum_version = newest
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                assert (tls.version(), tls.selected_alpn_protocol()) == (version, "h2")
    # No ALPN at all (Envoy's upstream TLS context with nothing set) and
    # HTTP/2 spoken at once: served, the server's SETTINGS first.
    ctx = ssl.create_default_context(cadata=pem)
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            assert tls.selected_alpn_protocol() is None
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
            head = b""
            while len(head) < 9:
                chunk = tls.recv(9 - len(head))
                assert chunk, "closed before a frame"
                head += chunk
            assert head[3] == 4, f"a SETTINGS frame first, got {head!r}"
    # The same certificate for every connection of the process.
    assert same_cert(served_cert(port), pem)


def test_a_plaintext_client_is_refused_when_tls_is_on(start_daemon, tmp_path):
    d, port = start(start_daemon, tmp_path, "self_signed")
    plain = grpc.insecure_channel(f"127.0.0.1:{port}")
    with pytest.raises(grpc.RpcError) as refused:
        health(plain, timeout=3.0)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), refused.value
    plain.close()
    # The picker still serves TLS.
    assert health(channel(port, served_cert(port))) == SERVING


def test_files_are_served_and_read_again_when_they_change(start_daemon, engines, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    first, first_key = make_pair("first")
    cert.write_text(first)
    key.write_text(first_key)
    d, port = start(start_daemon, tmp_path, "files", f'epp_cert = "{cert}"\nepp_key = "{key}"\n')
    assert same_cert(served_cert(port), first)
    old = channel(port, first)
    bring_up(d, engines, [0, 1])
    assert pick(d, old) in (A, B)

    second, second_key = make_pair("second")
    replace(key, second_key)
    replace(cert, second)
    began = time.monotonic()
    eventually(
        "new connections get the new certificate",
        lambda: same_cert(served_cert(port), second),
        deadline=RELOAD_EVERY + 5,
        interval=0.1,
    )
    assert time.monotonic() - began < RELOAD_EVERY + 3
    assert pick(d, channel(port, second)) in (A, B)
    # A client that trusts only the old certificate cannot connect anew ...
    stale = grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(root_certificates=first.encode()))
    with pytest.raises(grpc.RpcError):
        health(stale, timeout=3.0)
    stale.close()
    # ... while the connection made before the change goes on.
    assert health(old) == SERVING

    # A new pair that does not load keeps the one in force, with a warning.
    replace(cert, "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    eventually("the bad file is reported", lambda: "do not load: the pair in force is kept" in d.log(), interval=0.1)
    assert same_cert(served_cert(port), second)
    assert pick(d, channel(port, second)) in (A, B)


def test_a_connection_that_never_says_hello_is_closed_at_the_deadline(start_daemon, tmp_path):
    d, port = start(start_daemon, tmp_path, "self_signed")
    silent = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE)
    silent.settimeout(HANDSHAKE_DEADLINE + DEADLINE)
    began = time.monotonic()
    # Meanwhile, a client that completes its handshake is served.
    ch = channel(port, served_cert(port))
    assert health(ch) == SERVING
    assert time.monotonic() - began < HANDSHAKE_DEADLINE - 1, "served while the silent one waits"
    try:
        data = silent.recv(1)
    except ConnectionResetError:
        data = b""
    took = time.monotonic() - began
    silent.close()
    assert data == b"", "closed, nothing sent"
    assert HANDSHAKE_DEADLINE - 0.5 <= took <= HANDSHAKE_DEADLINE + 3, f"closed after {took:.2f} s"
    # The established connection is not touched by the deadline.
    assert health(ch) == SERVING


def test_sigterm_over_tls_is_not_ready_at_once_and_exits_zero_within_two_seconds(start_daemon, engines, tmp_path):
    d, port = start(start_daemon, tmp_path, "self_signed")
    ch = channel(port, served_cert(port))
    bring_up(d, engines, [0, 1])
    # A picked request whose response never ends holds its stream open.
    s = Stream(ch)
    request(s)
    picked(s)
    eventually("ready", lambda: health(ch, "readiness") == SERVING)
    started = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)

    def not_ready():
        try:
            return health(ch, "readiness", timeout=0.2) != SERVING
        except grpc.RpcError:
            return True

    eventually("not ready once SIGTERM arrived", not_ready, deadline=1.0)
    assert d.stop() == 0
    assert time.monotonic() - started < 2.0


def test_check_config_parses_the_files_and_refuses_a_pair_that_does_not_match(dpcoord_bin, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    pem, pem_key = make_pair("cert")
    _, other_key = make_pair("other")
    cert.write_text(pem)
    key.write_text(other_key)
    cfg = tmp_path / "epp.toml"
    cfg.write_text(config(free_port(), 2, [A, B], tls="files", server=f'epp_cert = "{cert}"\nepp_key = "{key}"\n'))
    r = subprocess.run([dpcoord_bin, "check-config", str(cfg)], capture_output=True, text=True, timeout=DEADLINE)
    assert r.returncode == 2, r
    assert f"server.epp_key: `{key}` is not the key of the certificate in `{cert}`" in r.stderr, r.stderr
    key.write_text(pem_key)
    r = subprocess.run([dpcoord_bin, "check-config", str(cfg)], capture_output=True, text=True, timeout=DEADLINE)
    assert r.returncode == 0 and ": ok" in r.stdout, r
