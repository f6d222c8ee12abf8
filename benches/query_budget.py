"""Cost of one route query at dp_size D and n N, against a real (release) dpcoord.

usage: .venv/bin/python benches/query_budget.py BIN D N [POLICY...]
Starts BIN on ipc:// endpoints with D ranks (all brought up by one PUB),
then times route queries with n = N: prints the median and p90 round trip in us.
"""
import os, subprocess, sys, tempfile, time, statistics
import msgpack, zmq

bin_, D, N = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
policies = sys.argv[4:] or ["round_robin", "least_load", "least_tokens", "power_of_two", "cache_aware"]
for policy in policies:
    d = tempfile.mkdtemp()
    cfg = os.path.join(d, "c.toml")
    with open(cfg, "w") as f:
        f.write(f"[engines]\ndp_size = {D}\nstale_after_ms = 600000\ndown_after_ms = 1200000\n"
                f"[routing]\npolicy = \"{policy}\"\npending_ttl_ms = 3600000\n[limits]\nmax_batch = {N}\nmax_message_bytes = 16777216\n")
    route, stats = f"ipc://{d}/route", f"ipc://{d}/stats"
    p = subprocess.Popen([bin_, "--config", cfg, "--route-bind", route, "--health-bind", f"ipc://{d}/health",
                          "--stats-bind", stats, "--metrics-bind", "127.0.0.1:0"], env={**os.environ, "RUST_LOG": "error"})
    try:
        ctx = zmq.Context()
        req = ctx.socket(zmq.REQ); req.connect(route); req.setsockopt(zmq.RCVTIMEO, 60000)
        def call(q):
            req.send(msgpack.packb(q)); return msgpack.unpackb(req.recv(), raw=False, strict_map_key=False)
        pub = ctx.socket(zmq.PUB); pub.setsockopt(zmq.SNDHWM, 0); pub.connect(stats)
        seq = 0
        while True:
            seq += 1
            for r in range(D):
                pub.send(msgpack.packb({"v": 1, "rank": r, "boot": 1, "seq": seq, "counts": [r % 3, r % 5 + 1, 0, 0, 0]}))
            time.sleep(0.3)
            st = call({"v": 1, "op": "state"})
            if all(x["status"] == "up" for x in st["ranks"]):
                break
        times = []
        t_end = time.time() + 3
        while len(times) < 5 or (time.time() < t_end and len(times) < 200):
            t = time.perf_counter()
            rep = call({"v": 1, "op": "route", "n": N})
            times.append((time.perf_counter() - t) * 1e6)
            assert rep["ok"], rep
        times.sort()
        print(f"dp_size={D} n={N} {policy}: median {statistics.median(times):.0f} us, p90 {times[int(len(times)*0.9)]:.0f} us ({len(times)} queries)")
    finally:
        p.terminate(); p.wait()
