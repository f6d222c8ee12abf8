"""The memory attacks of docs/failure-behaviour.md at the scale first reported, against a real dpcoord.

Each attack gets a fresh daemon (so its peak RSS, VmHWM, is the attack's own)
and prints RSS before, at the peak and after the attackers left, and whether a
new frontend's ping and /healthz were answered while the attack held.
tests/it/memory_ceiling.rs asserts the same in a bounded form; this is the full size.

usage: .venv/bin/python benches/attack_rss.py BIN [ATTACK ...]
  attacks: ids envelope idle_http idle_http_1024 peers peers_spread (default: all)
"""
import os, resource, socket, subprocess, sys, tempfile, time, urllib.request
import msgpack, zmq

PING = msgpack.packb({"v": 1, "op": "ping"})


def free_port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    return port


class Daemon:
    def __init__(self, binary, nofile=None):
        d = tempfile.mkdtemp()
        self.route, self.mport = f"tcp://127.0.0.1:{free_port()}", free_port()
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.p = subprocess.Popen([binary, "--route-bind", self.route, "--health-bind", f"ipc://{d}/h",
                                   "--stats-bind", f"ipc://{d}/s", "--metrics-bind", f"127.0.0.1:{self.mport}",
                                   "--dp-size", "8"], env={**os.environ, "RUST_LOG": "error"}, preexec_fn=limit)
        end = time.monotonic() + 10
        while not self.ping(200):
            assert time.monotonic() < end, "dpcoord did not answer ping"

    def kib(self, key):
        for line in open(f"/proc/{self.p.pid}/status"):
            if line.startswith(key):
                return int(line.split()[1])

    def ping(self, timeout_ms=5000):
        """A new frontend: a fresh REQ socket, one ping."""
        s = zmq.Context.instance().socket(zmq.REQ); s.setsockopt(zmq.LINGER, 0); s.connect(self.route)
        s.send(PING); ok = bool(s.poll(timeout_ms)); s.close()
        return ok

    def healthz(self):
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.mport}/healthz", timeout=5).status == 200
        except OSError:
            return False

    def stop(self):
        self.p.terminate(); self.p.wait()


def dealers(ctx, endpoint, n):
    out = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.setsockopt(zmq.SNDHWM, 0)
        s.connect(endpoint); out.append(s)
    return out


def ids(d, ctx):
    """16 DEALERs that never read send 2,000 pings each with a 60 KB string id (was 1.1 GB)."""
    big = msgpack.packb({"v": 1, "op": "ping", "id": "x" * 60_000})
    socks = dealers(ctx, d.route, 16)
    for s in socks:
        for _ in range(2000):
            s.send_multipart([b"", big])
    return socks


def envelope(d, ctx):
    """300 pings, each behind a 1 MB extra envelope frame, from a peer that never reads (was 845 MB)."""
    socks = dealers(ctx, d.route, 1)
    for _ in range(300):
        socks[0].send_multipart([b"\0" * 1_000_000, b"", PING])
    return socks


def idle(n):
    def attack(d, ctx):
        conns = []
        for _ in range(n):
            c = socket.socket(); c.setblocking(False)
            try:
                c.connect(("127.0.0.1", d.mport))
            except BlockingIOError:
                pass
            conns.append(c)
        return conns
    return attack


def peers(d, ctx):
    """5,000 DEALERs connected at once from 127.0.0.2, one ping each (was 145 MB, ~28 KB each,
    kept). One address holds at most server.max_peers_per_address (128) of them; the new
    frontend comes from 127.0.0.1."""
    socks = dealers(ctx, d.route.replace("tcp://", "tcp://127.0.0.2:0;"), 5000)
    for s in socks:
        s.send_multipart([b"", PING])
    return socks


def peers_spread(d, ctx):
    """5,000 DEALERs from 40 addresses (127.0.1.1-40, 125 each, under the per-address cap):
    the route socket holds at most server.route_max_peers (1024) of them, so memory stays
    bounded, but a new frontend finds the socket full until they leave (failure-behaviour.md:
    allowlists or network policy are the answer to many addresses)."""
    socks = []
    for i in range(40):
        socks += dealers(ctx, d.route.replace("tcp://", f"tcp://127.0.1.{i + 1}:0;"), 125)
    for s in socks:
        s.send_multipart([b"", PING])
    return socks


ATTACKS = {
    "ids": (ids, None, "16 DEALERs x 2,000 pings with a 60 KB id, never read"),
    "envelope": (envelope, None, "300 pings behind a 1 MB envelope frame, never read"),
    "idle_http": (idle(10_000), 20_000, "10,000 idle HTTP connections, nofile 20,000"),
    "idle_http_1024": (idle(1_100), 1024, "1,100 idle HTTP connections, nofile 1024"),
    "peers": (peers, 20_000, "5,000 DEALERs from one address"),
    "peers_spread": (peers_spread, 20_000, "5,000 DEALERs from 40 addresses"),
}


def main():
    binary, names = sys.argv[1], sys.argv[2:] or list(ATTACKS)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the attacker's own descriptors
    print(f"{'attack':<54} {'before':>8} {'peak':>8} {'after':>8}  frontend  /healthz")
    for name in names:
        attack, nofile, what = ATTACKS[name]
        d = Daemon(binary, nofile and min(nofile, hard))
        ctx = zmq.Context(); ctx.set(zmq.MAX_SOCKETS, 8192)
        before = d.kib("VmRSS")
        held = attack(d, ctx)
        time.sleep(2.0)  # let libzmq and dpcoord take in what was sent
        fronted, healthy = d.ping(), d.healthz()
        for h in held:
            h.close()
        ctx.term()
        time.sleep(2.0)  # dpcoord sees them leave; its trim thread returns what they held
        after = d.kib("VmRSS")
        print(f"{what:<54} {before / 1024:>6.1f}MB {d.kib('VmHWM') / 1024:>6.1f}MB {after / 1024:>6.1f}MB"
              f"  {'answered' if fronted else 'NO':>8}  {'200' if healthy else 'NO':>8}")
        d.stop()


if __name__ == "__main__":
    main()
