"""RSS per idle HTTP connection and per connected ZeroMQ DEALER, real dpcoord.

usage: .venv/bin/python benches/peer_rss.py BIN [HTTP_CONNS] [DEALERS]
"""
import os, socket, subprocess, sys, tempfile, time, urllib.request
import msgpack, zmq

bin_ = sys.argv[1]
n_http = int(sys.argv[2]) if len(sys.argv) > 2 else 200
n_dealers = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
d = tempfile.mkdtemp()
s = socket.socket(); s.bind(("127.0.0.1", 0)); mport = s.getsockname()[1]; s.close()
s = socket.socket(); s.bind(("127.0.0.1", 0)); rport = s.getsockname()[1]; s.close()
p = subprocess.Popen([bin_, "--route-bind", f"tcp://127.0.0.1:{rport}", "--health-bind", f"ipc://{d}/h",
                      "--stats-bind", f"ipc://{d}/s", "--metrics-bind", f"127.0.0.1:{mport}", "--dp-size", "8"],
                     env={**os.environ, "RUST_LOG": "error"})
def rss():
    for line in open(f"/proc/{p.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
def settle():
    time.sleep(1.0)
    return rss()
try:
    ctx = zmq.Context(); ctx.set(zmq.MAX_SOCKETS, 4096)
    req = ctx.socket(zmq.REQ); req.connect(f"tcp://127.0.0.1:{rport}"); req.send(msgpack.packb({"v": 1, "op": "ping"})); req.recv()
    urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read()
    base = settle()
    conns = [socket.create_connection(("127.0.0.1", mport)) for _ in range(n_http)]
    after_http = settle()
    for c in conns: c.close()
    after_http_closed = settle()
    dealers = []
    for i in range(n_dealers):
        s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0); s.connect(f"tcp://127.0.0.1:{rport}")
        s.send_multipart([b"", msgpack.packb({"v": 1, "op": "ping"})]); dealers.append(s)
    for s in dealers: s.recv_multipart()
    after_dealers = settle()
    for s in dealers: s.close()
    after_dealers_closed = settle()
    print(f"baseline RSS {base} KiB")
    print(f"{n_http} idle HTTP connections: +{after_http - base} KiB = {(after_http - base) / n_http:.1f} KiB each; after they closed: {after_http_closed} KiB")
    print(f"{n_dealers} connected DEALERs (one ping each): +{after_dealers - after_http_closed} KiB = {(after_dealers - after_http_closed) / n_dealers:.1f} KiB each; after they left: {after_dealers_closed} KiB")
finally:
    p.terminate(); p.wait()
