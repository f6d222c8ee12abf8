"""The examples run against the real dpcoord: the engine loop and the proxy."""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import DEADLINE, bring_up, eventually
from dpcoord import RouterClient

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_publisher_loop_and_sglang_hook(start_daemon):
    ex = load("engine_publisher")
    d = start_daemon("--dp-size", "2")
    stop = threading.Event()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("logger", ex.run(d.stats, 0, False, 0.01, None, stop=stop)))
    t.start()
    try:

        def busy():
            r = d.state()["ranks"][0]
            return r["status"] == "up" and r["counts"][3] > 0 and r

        r = eventually("the toy engine finished requests", busy)
        waiting, running, received, finished, failed = r["counts"]
        assert received >= waiting + running + finished + failed
    finally:
        stop.set()
        t.join(DEADLINE)
    logger = result["logger"]
    assert logger.publisher.seq > 0
    logger.publisher.close()

    hook = ex.SglangLoadHook(d.stats, 1)
    hook.on_request("HEALTH_CHECK_abc")  # not counted
    for rid in ("a", "b", "c"):
        hook.on_request(rid)
    hook.on_finish("a", SimpleNamespace(to_json=lambda: {"type": "length"}))
    hook.on_finish("HEALTH_CHECK_abc", None)
    load_report = SimpleNamespace(dp_rank=1, num_running_reqs=1, num_waiting_reqs=1, num_used_tokens=48, num_total_tokens=64)
    eventually(
        "rank 1 from the SGLang hook",
        lambda: hook.on_load(load_report) and d.state()["ranks"][1]["counts"] == [1, 1, 3, 1, 0],
    )
    hook.publisher.close()


class FakeEngine(ThreadingHTTPServer):
    """Answers any POST with what it saw, tagged with its index."""

    def __init__(self, index: int):
        self.index = index
        engine = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                out = json.dumps(
                    {"served_by": engine.index, "rank_header": self.headers.get("X-data-parallel-rank"), "body": body}
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


def post(url: str, body: dict, headers: dict | None = None):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as r:
            return r.status, r.headers.get("X-Dpcoord-Rank"), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None, json.loads(e.read())


@pytest.fixture
def proxy():
    ex = load("frontend_openai")
    servers = []

    def start(client: RouterClient, engines: list[str]) -> str:
        s = ex.make_server(client, engines, "127.0.0.1", 0)
        servers.append(s)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{s.server_address[1]}"

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def test_openai_proxy_routes_through_dpcoord(start_daemon, engines, proxy):
    d = start_daemon("--dp-size", "2", "--policy", "round_robin")
    bring_up(d, engines, [0, 1])
    fakes = [FakeEngine(0), FakeEngine(1)]
    client = RouterClient(d.route, timeout_ms=2000)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hello there " * 10}]}

    # One engine URL per rank.
    url = proxy(client, [f.url for f in fakes])
    got = [post(url + "/v1/chat/completions", chat) for _ in range(4)]
    assert [(s, h, b["served_by"]) for s, h, b in got] == [(200, "0", 0), (200, "1", 1), (200, "0", 0), (200, "1", 1)]
    assert got[0][2]["body"] == chat
    # A pin from the caller is honoured; a bad pin is refused with the contract's code.
    status, rank, body = post(url + "/v1/completions", {"prompt": "x"}, {"X-data-parallel-rank": "1"})
    assert (status, rank, body["served_by"]) == (200, "1", 1)
    status, _, body = post(url + "/v1/completions", {"prompt": "x"}, {"X-data-parallel-rank": "5"})
    assert (status, body["error"]["code"]) == (400, "invalid_rank")
    # A session (the OpenAI `user` field) sticks to its rank.
    ranks = {post(url + "/v1/chat/completions", dict(chat, user="u1"))[1] for _ in range(3)}
    assert len(ranks) == 1

    # One URL for all ranks: the rank travels as a header and in the body.
    url = proxy(client, [fakes[0].url])
    status, rank, body = post(url + "/v1/chat/completions", chat)
    assert status == 200 and body["rank_header"] == rank and body["body"]["data_parallel_rank"] == int(rank)
    assert client.fallbacks == 0
    client.close()
    for f in fakes:
        f.shutdown()
        f.server_close()
