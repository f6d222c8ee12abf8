"""A fresh vLLM API server's first burst: how much of it dpcoord places.

Each trial starts one API-server process (clients/python/tests/compat/api_server.py:
vLLM's real ``DPLBAsyncMPClient`` with dpcoord's hook installed by vLLM's own plugin
loader, as ``vllm serve`` does; the vLLM of the project's virtualenv) and, as soon as
it has imported vLLM, adds a burst of requests at once; then a second burst on the
same process, warm. The API server asks a real release dpcoord over TCP on loopback
(``least_load``, 8 ranks up) with the default 5 ms deadline. Printed: per burst, the
requests placed by dpcoord and by vLLM's rule (and why), over all trials.

usage: .venv/bin/python benches/hook_cold_start.py BIN [--trials N] [--burst N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "clients/python"))
from bench_daemon import Daemon  # noqa: E402

API_SERVER = REPO / "clients/python/tests/compat/api_server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trial(route: str, burst: int) -> tuple[Counter, Counter]:
    """One fresh API server: the outcomes of its first burst, then of its second."""
    p = subprocess.Popen(
        [sys.executable, str(API_SERVER), "1", "0", "8", str(burst)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "DPCOORD_ROUTE_ENDPOINT": route},
    )
    try:
        outcomes = []
        for _ in range(2):
            p.stdin.write("go\n")
            p.stdin.flush()
            outcomes.append(Counter(json.loads(p.stdout.readline())["outcomes"]))
    finally:
        p.stdin.close()
        p.wait(30)
    first, both = outcomes
    return first, both - first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--burst", type=int, default=64)
    args = ap.parse_args()
    d = Daemon(args.binary, f"tcp://127.0.0.1:{free_port()}")
    try:
        totals = [Counter(), Counter()]
        all_placed = [0, 0]
        for _ in range(args.trials):
            for i, outcome in enumerate(trial(d.route, args.burst)):
                totals[i] += outcome
                all_placed[i] += outcome["dpcoord"] == args.burst
    finally:
        d.stop()
    n = args.trials * args.burst
    print(f"fresh API servers: {args.trials} trials, bursts of {args.burst} requests at once, dpcoord over TCP (5 ms deadline)")
    print(f"  {'burst':<22}{'by dpcoord':>12}{'share':>9}{'whole bursts':>14}  by vLLM's rule")
    for name, total, whole in zip(("first (fresh process)", "second (warm)"), totals, all_placed):
        rule = {k: v for k, v in sorted(total.items()) if k != "dpcoord"} or "none"
        print(f"  {name:<22}{total['dpcoord']:>12}{total['dpcoord'] / n:>9.1%}{whole:>8}/{args.trials:<5}  {rule}")


if __name__ == "__main__":
    main()
