"""Routing while the gateway tokenizes: a ZeroMQ frontend's route latency, quiet and
while CLIENTS clients send chat prompts of MIB MiB each through `dpcoord proxy`
with the model's tokenizer (Qwen3's, crates/gateway/testdata/tokenizers), back to
back, for SECONDS each. Prints p50/p99 of both phases, their ratio (the baseline
is the quiet phase of the same run), the prompts sent and dpcoord's peak RSS.
The ranks' servers are ports nothing listens on: each prompt is tokenized and
routed, then answered 502, which is all this measures.

    .venv/bin/python benches/tokenizer_load.py [BINARY] [CLIENTS] [MIB] [SECONDS]

(defaults: target/release/dpcoord 16 2 8). Everything binds 127.0.0.1 and stops
by itself."""

from __future__ import annotations

import gzip
import http.server
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import msgpack
import zmq

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "crates/gateway/testdata/tokenizers/qwen3"


def free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gauges(http.server.BaseHTTPRequestHandler):
    """Each rank's /metrics as vLLM's: idle."""

    def do_GET(self):
        body = b"".join(
            b'# TYPE vllm:num_requests_%s gauge\nvllm:num_requests_%s{engine="0",model_name="m"} 0.0\n' % (g, g)
            for g in (b"waiting", b"running")
        )
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def main() -> None:
    args = sys.argv[1:] + [None] * 4
    binary = args[0] or str(ROOT / "target/release/dpcoord")
    clients, mib, secs = int(args[1] or 16), float(args[2] or 2), float(args[3] or 8)
    work = Path(tempfile.mkdtemp(prefix="dpcoord-tokenizer-load-"))
    with gzip.open(QWEN3 / "tokenizer.json.gz") as src, open(work / "tokenizer.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    gauges = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gauges)
    threading.Thread(target=gauges.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{gauges.server_address[1]}/metrics"
    proxy, route = free(), free()
    body_cap = int((mib + 1) * (1 << 20))
    (work / "dpcoord.toml").write_text(
        f'[server]\nproxy_bind = "127.0.0.1:{proxy}"\nroute_bind = "tcp://127.0.0.1:{route}"\n'
        f'health_bind = "tcp://127.0.0.1:{free()}"\nmetrics_bind = "127.0.0.1:{free()}"\n'
        f"[engines]\ndp_size = 2\nvllm_metrics_url = [{json.dumps(url)}, {json.dumps(url)}]\n"
        f'[gateway]\nendpoints = ["127.0.0.1:{free()}", "127.0.0.1:{free()}"]\n'
        f'tokenizer = "{work / "tokenizer.json"}"\ntokenizer_config = "{QWEN3 / "tokenizer_config.json"}"\n'
        f"max_body_bytes = {body_cap}\n[proxy]\nmax_buffered_bytes = {body_cap * (clients + 1)}\n"
    )
    daemon = subprocess.Popen([binary, "--config", str(work / "dpcoord.toml")], stderr=subprocess.DEVNULL)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.REQ)
        sock.connect(f"tcp://127.0.0.1:{route}")
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        query = msgpack.packb({"v": 1, "op": "route"})
        deadline = time.time() + 20
        while True:
            sock.send(query)
            if msgpack.unpackb(sock.recv()).get("ok"):
                break
            assert time.time() < deadline, "no rank came up"
            time.sleep(0.05)

        def latencies(duration: float) -> tuple[float, float, int]:
            out, end = [], time.time() + duration
            while time.time() < end:
                t = time.perf_counter()
                sock.send(query)
                sock.recv()
                out.append(time.perf_counter() - t)
                time.sleep(0.002)
            out.sort()
            return out[len(out) // 2] * 1e3, out[int(len(out) * 0.99)] * 1e3, len(out)

        quiet = latencies(secs)
        text = ("The quick brown fox jumps over the lazy dog. " * int(mib * (1 << 20) / 45 + 1))[: int(mib * (1 << 20))]
        prompt = json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()
        stop, sent = threading.Event(), [0]

        def client() -> None:
            while not stop.is_set():
                req = urllib.request.Request(f"http://127.0.0.1:{proxy}/v1/chat/completions", prompt)
                try:
                    urllib.request.urlopen(req, timeout=60).read()
                except Exception:  # the 502 of a rank nobody serves
                    pass
                sent[0] += 1

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        busy = latencies(secs)
        stop.set()
        status = Path(f"/proc/{daemon.pid}/status").read_text()
        rss = int(status.split("VmHWM:")[1].split()[0]) / 1024
        print(f"tokenizer load: {clients} clients x {mib:g} MiB chat prompts through dpcoord proxy, {secs:g} s a phase")
        print(f"  quiet route p50 {quiet[0]:.2f} ms  p99 {quiet[1]:.2f} ms  ({quiet[2]} queries)")
        print(f"  busy  route p50 {busy[0]:.2f} ms  p99 {busy[1]:.2f} ms  ({busy[2]} queries)")
        print(f"  busy p99 / quiet p99: {busy[1] / quiet[1]:.1f}x; prompts sent {sent[0]}; dpcoord peak RSS {rss:.0f} MiB")
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
        gauges.shutdown()
        ctx.destroy(linger=0)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
