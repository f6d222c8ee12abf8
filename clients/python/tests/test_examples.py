"""The examples run against the real dpcoord: the engine loop and the proxy."""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
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
    logger.close()

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


def test_example_stat_logger_keeps_an_idle_rank_up_and_a_wedged_one_out(start_daemon, tmp_path):
    """The example logger repeats its last update while the engine does not step
    (an idle rank stays up past down_after_ms, 3 s), and its updates carry the
    steps as ``progress`` (a rank with work that stopped stepping is stalled)."""
    ex = load("engine_publisher")
    cfg = tmp_path / "stall.toml"
    cfg.write_text("[engines]\nstall_after_ms = 1000\n")
    d = start_daemon("--dp-size", "2", "--config", str(cfg))
    idle = ex.DpcoordStatLogger(None, 0, endpoint=d.stats)
    wedged = ex.DpcoordStatLogger(None, 1, endpoint=d.stats)
    try:
        def stats(running: int) -> SimpleNamespace:
            return SimpleNamespace(num_waiting_reqs=0, num_running_reqs=running, kv_cache_usage=0.1)

        def step_both() -> bool:
            idle.record(stats(0), None)
            wedged.record(stats(2), None)
            return d.statuses() == ["up", "up"]

        eventually("both publishing", step_both)
        eventually("rank 1 stalled", lambda: d.statuses()[1] == "stalled", deadline=10)
        end = time.monotonic() + 3.5
        while time.monotonic() < end:
            assert d.statuses()[0] == "up", "the idle rank went down"
            time.sleep(0.1)
        assert d.state()["ranks"][1]["stall"] == "progress"
    finally:
        idle.close()
        wedged.close()


class FakeEngine(ThreadingHTTPServer):
    """Answers any POST with what it saw, tagged with its index; ``/tokenize``
    answers one token id per character, 100000 + its code point (``tokenize_status``
    other than 200 makes it fail), and keeps each request and its ids."""

    def __init__(self, index: int, tokenize_status: int = 200):
        self.index, self.tokenize_status = index, tokenize_status
        self.tokenized: list[tuple[dict, list[int]]] = []
        engine = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def answer(self, status: int, obj: dict) -> None:
                out = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/tokenize":
                    rank = self.headers.get("X-data-parallel-rank")
                    return self.answer(200, {"served_by": engine.index, "rank_header": rank, "body": body})
                if engine.tokenize_status != 200:
                    return self.answer(engine.tokenize_status, {"error": {"message": "no tokenizer here"}})
                text = json.dumps(body["messages"]) if "messages" in body else body["prompt"]
                ids = [100_000 + ord(ch) for ch in text]
                engine.tokenized.append((body, ids))
                self.answer(200, {"tokens": ids, "count": len(ids), "max_model_len": 4096})

        super().__init__(("127.0.0.1", 0), H)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


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

    def start(client: RouterClient, engines: list[str], **kw) -> str:
        s = ex.make_server(client, engines, "127.0.0.1", 0, **kw)
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

    # One URL for all ranks: the rank travels as the engine reads it, vLLM's header
    # or SGLang's body field, where a caller's pin is honoured too.
    url = proxy(client, [fakes[0].url])
    status, rank, body = post(url + "/v1/chat/completions", chat)
    assert status == 200 and body["rank_header"] == rank and "routed_dp_rank" not in body["body"]
    url = proxy(client, [fakes[0].url], engine="sglang")
    status, rank, body = post(url + "/v1/chat/completions", chat)
    assert status == 200 and body["rank_header"] is None and body["body"]["routed_dp_rank"] == int(rank)
    status, rank, body = post(url + "/generate", {"text": "x", "routed_dp_rank": 1})
    assert (status, rank, body["body"]["routed_dp_rank"]) == (200, "1", 1)
    assert client.fallbacks == 0
    client.close()
    for f in fakes:
        f.close()


def test_openai_proxy_sends_the_engines_token_ids(start_daemon, engines, proxy, tmp_path, caplog):
    """The route query carries the ids the engine's /tokenize returned. The oracle
    is dpcoord: in cache_aware approximate mode it records a routed prompt's blocks
    (of 16 tokens before any KV event) for the rank it picked, and the health
    socket's ``prefix`` op tells which rank holds a prompt's leading blocks."""
    config = tmp_path / "cache_aware.toml"
    config.write_text('[routing]\npolicy = "cache_aware"\nprefix_mode = "approximate"\npending_ttl_ms = 60000\n')
    d = start_daemon("--config", str(config), "--dp-size", "2")
    bring_up(d, engines, [0, 1])
    fake, broken = FakeEngine(0), FakeEngine(1, tokenize_status=500)
    client = RouterClient(d.route, d.health, timeout_ms=5000)

    def holders(ids: list[int], rank: str) -> bool:
        """Rank ``rank`` holds every whole block of ``ids``, the other rank none."""
        reply = client.call("prefix", channel="health", tokens=ids)
        blocks = len(ids) // 16
        return blocks > 0 and reply["blocks"] == blocks and reply["matched"] == [
            blocks if r == int(rank) else 0 for r in range(2)
        ]

    # SGLang, one URL: the chat form of /tokenize, its ids to dpcoord, the rank in the body.
    url = proxy(client, [fake.url], engine="sglang")
    chat = {"model": "m", "messages": [{"role": "user", "content": "what is cached? " * 8}], "max_tokens": 4}
    status, rank, body = post(url + "/v1/chat/completions", chat)
    assert status == 200 and body["body"]["routed_dp_rank"] == int(rank) and body["rank_header"] is None
    [(asked, ids)] = fake.tokenized
    assert asked == {"model": "m", "messages": chat["messages"]}
    assert holders(ids, rank)
    # So cache_aware sends the same conversation back to the rank holding its prefix.
    assert post(url + "/v1/chat/completions", chat)[1] == rank

    # vLLM, one URL: a completion's text prompt, the rank as the header.
    url = proxy(client, [fake.url])
    completion = {"model": "m", "prompt": "once upon a time " * 4}
    status, rank, body = post(url + "/v1/completions", completion)
    assert status == 200 and body["rank_header"] == rank and "routed_dp_rank" not in body["body"]
    asked, ids = fake.tokenized[-1]
    assert asked == {"model": "m", "prompt": completion["prompt"]} and holders(ids, rank)
    # Token ids in the body go as they are, without asking the engine.
    asks, given = len(fake.tokenized), list(range(5000, 5040))
    status, rank, _ = post(url + "/v1/completions", {"model": "m", "prompt": given})
    assert status == 200 and len(fake.tokenized) == asks and holders(given, rank)

    # No token ids: /tokenize fails (the log says so), or tokenize=False (--no-tokenize).
    # dpcoord gets the estimated length and the request still goes through.
    with caplog.at_level(logging.WARNING, logger="frontend"):
        assert post(proxy(client, [broken.url]) + "/v1/completions", completion)[0] == 200
    assert "/v1/completions (HTTP Error 500" in caplog.text and "estimated prompt length" in caplog.text
    assert post(proxy(client, [fake.url], tokenize=False) + "/v1/completions", completion)[0] == 200
    assert len(fake.tokenized) == asks
    assert client.fallbacks == 0
    client.close()
    fake.close()
    broken.close()
