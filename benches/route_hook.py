"""What dpcoord's route hook adds to a vLLM request, measured beside vLLM's own rule.

vLLM 0.33's real DPLBAsyncMPClient (built without engines, as the compat suite
builds it: what it sends is recorded) adds requests one at a time on one asyncio
loop; each arm times `await client.add_request_async(request)`:

- vLLM's rule: the hook's books only (no DPCOORD_ROUTE_ENDPOINT);
- dpcoord up: the hook asks a real release dpcoord (least_load, 8 ranks), the
  prompt sent as block keys (the default), as token ids, or as its length;
- dpcoord down: the same hook, dpcoord killed.

Arms run in interleaved rounds so that drift hits each alike. Then the link alone:
RouteLink.route against a bare pyzmq REQ round trip (sync, and on zmq.asyncio)
with the same query bytes, to the same dpcoord. Everything async runs on uvloop,
as vLLM's API servers do.

usage: .venv/bin/python benches/route_hook.py BIN [--requests N] [--prompt TOKENS]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import msgpack
import uvloop
import zmq
import zmq.asyncio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "clients/python/tests/compat"))
import standins  # noqa: E402

standins.install()
import vllm.v1.engine.async_llm  # noqa: E402,F401 - the modules the hook wraps
import vllm_engine  # noqa: E402

from dpcoord import vllm_route  # noqa: E402
from bench_daemon import Daemon  # noqa: E402
from dpcoord.route_link import RouteLink  # noqa: E402


def hook_for(settings: vllm_route.RouteSettings) -> vllm_route.Hook:
    """A hook with these settings (vLLM's methods are wrapped once; each call goes to ``vllm_route.HOOK``)."""
    return vllm_route.Hook(settings, vllm.v1.engine.core_client.get_late_interaction_engine_index)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def timed_adds(client, prompt: list[int], n: int) -> list[float]:
    out = []
    for _ in range(n):
        r = vllm_engine.make_request(None, uuid.uuid4().hex, prompt)
        t = time.perf_counter_ns()
        await client.add_request_async(r)
        out.append((time.perf_counter_ns() - t) / 1000)
        client.reqs_in_flight.clear()  # the request ended: vLLM's in-flight floor stays level
        client.engine_inflight.clear()
        client.sent.clear()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt length in tokens")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()

    d = Daemon(a.binary)
    real = vllm_route.install(vllm_route.RouteSettings(None))  # wraps vLLM's methods once
    assert real is not None, "the hook did not install on this vLLM"
    client = vllm_engine.make_dplb_client(None, 8)
    client.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(block_size=16))
    prompt = list(range(1000, 1000 + a.prompt))
    per = a.requests // a.rounds
    arms = {
        "vLLM's rule": vllm_route.RouteSettings(None),
        "dpcoord up, block keys": vllm_route.RouteSettings(d.route, 0.005, "keys"),
        "dpcoord up, token ids": vllm_route.RouteSettings(d.route, 0.005, "tokens"),
        "dpcoord up, length only": vllm_route.RouteSettings(d.route, 0.005, "length"),
    }
    times: dict[str, list[float]] = {k: [] for k in arms}
    hooks = {}

    async def run_arms(names):
        for name in names:
            if hooks.get(name) is None:
                hooks[name] = hook_for(arms[name])
                if arms[name].endpoint and name != "dpcoord down":  # connected before the clock starts
                    link = hooks[name].link()
                    while not link.sock.poll(0, zmq.POLLOUT):
                        await asyncio.sleep(0.001)
        for _ in range(a.rounds):
            for name in names:
                vllm_route.HOOK = hooks[name]
                times[name] += await timed_adds(client, prompt, per)

    loop = uvloop.new_event_loop()  # vLLM's API servers run on uvloop
    loop.run_until_complete(run_arms(list(arms)))
    link_rows = loop.run_until_complete(link_alone(d.route, prompt, a.requests))
    d.stop()
    times["dpcoord down"] = []
    arms["dpcoord down"] = vllm_route.RouteSettings(d.route, 0.005, "keys")
    hooks["dpcoord down"] = None
    loop.run_until_complete(run_arms(["vLLM's rule", "dpcoord down"]))
    loop.close()

    rule = times["vLLM's rule"]
    print(f"route hook: {a.requests} requests per arm ({a.rounds} interleaved rounds), {a.prompt}-token prompts,"
          f" vLLM 0.33's DPLBAsyncMPClient.add_request_async, one at a time")
    print(f"{'arm':<26}{'p50 us':>9}{'p99 us':>9}{'added p50':>11}{'added p99':>11}")
    for name, xs in times.items():
        print(f"{name:<26}{pct(xs, .5):>9.1f}{pct(xs, .99):>9.1f}{pct(xs, .5) - pct(rule, .5):>11.1f}{pct(xs, .99) - pct(rule, .99):>11.1f}")
    for name in arms:
        if name != "vLLM's rule":
            print(f"  {name}: outcomes {dict(hooks[name].counts)}")
    print()
    print(f"the link alone, the same {a.prompt}-token route query (block keys) to the same dpcoord, one at a time:")
    base = statistics.median(link_rows[0][1])
    for name, xs in link_rows:
        print(f"{name:<34}{'p50':>5} {statistics.median(xs):7.1f} us  p99 {pct(xs, .99):7.1f} us   {statistics.median(xs) / base:.2f}x")


async def link_alone(endpoint: str, prompt: list[int], n: int):
    from dpcoord import prefix

    query = {"v": 1, "op": "route", "prompt_tokens": len(prompt), "block_keys": prefix.block_keys(prompt, 16)}
    payload = msgpack.packb(query)
    ctx = zmq.Context.instance()
    req = ctx.socket(zmq.REQ)
    req.connect(endpoint)
    actx = zmq.asyncio.Context.instance()
    areq = actx.socket(zmq.REQ)
    areq.connect(endpoint)
    link = RouteLink(endpoint, timeout_s=1.0)
    rows: dict[str, list[float]] = {"bare pyzmq REQ (blocking)": [], "bare zmq.asyncio REQ": [], "RouteLink (the hook's)": []}
    for _ in range(8):
        for _ in range(n // 8):
            t = time.perf_counter_ns()
            req.send(payload)
            req.recv()
            rows["bare pyzmq REQ (blocking)"].append((time.perf_counter_ns() - t) / 1000)
        for _ in range(n // 8):
            t = time.perf_counter_ns()
            await areq.send(payload)
            await areq.recv()
            rows["bare zmq.asyncio REQ"].append((time.perf_counter_ns() - t) / 1000)
        for _ in range(n // 8):
            t = time.perf_counter_ns()
            rank, why = await link.route(dict(query))
            rows["RouteLink (the hook's)"].append((time.perf_counter_ns() - t) / 1000)
            assert why is None, why
    link.close()
    req.close(0)
    areq.close(0)
    return list(rows.items())


if __name__ == "__main__":
    main()
