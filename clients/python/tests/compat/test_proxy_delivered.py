"""The proxy (`server.proxy_bind`, policy `cache_aware`) reads the count of cached
prompt tokens that vLLM 0.33.0 and SGLang 0.5.23 put in their responses, and
reports it against the router's prediction: `dpcoord_prefix_reported_tokens_total`
`{kind="delivered"}` adds the engine's count, `{kind="predicted"}` the prediction,
equal to `dpcoord_prefix_predicted_tokens_total{of="chosen"}` over the same requests.

Every body is produced by the engine's own serving code, as its server produces it,
and served on 127.0.0.1 (one server per rank, also serving vLLM's own rendering of
its /metrics so dpcoord marks the rank up):

- vLLM: `OpenAIServingCompletion.request_output_to_completion_response` and
  `completion_stream_generator`, `OpenAIServingChat.chat_completion_full_generator`
  and `chat_completion_stream_generator`, on instances made with `object.__new__`
  carrying only the attributes those methods read (the server's flags:
  `--enable-prompt-tokens-details`, `--enable-force-include-usage`; no parsers; the
  fingerprint from vLLM's `build_system_fingerprint`). They are given real
  `RequestOutput`s (as the engine client yields them: deltas for a stream, the final
  output otherwise) and the real `CompletionRequest`/`ChatCompletionRequest` parsed
  from the body the proxy forwarded; serialized as vLLM's api_router does:
  `JSONResponse(content=response.model_dump())`, or a `StreamingResponse` over
  `with_sse_keep_alive(generator, 0)` (the default interval), written chunk by chunk.
- SGLang: `OpenAIServingCompletion._handle_non_streaming_request` (which calls
  `_build_completion_response`) and `_handle_streaming_request` (its
  `_generate_completion_stream`), on an `object.__new__` instance whose
  `tokenizer_manager` is a stand-in yielding the dicts SGLang's TokenizerManager
  builds (`meta_info` with `cached_tokens`, ...); `--enable-cache-report` set by
  SGLang's own `get_context().override_server_args(enable_cache_report=True)` (a
  ServerArgs resolved and projected into `get_serving()`, which the serving code
  reads); serialized by SGLang's `model_json_response` as its http_server does.
  (SGLang's chat serving imports jsonschema, which this suite does not install:
  completions only.)

Stand-ins of this file, beyond the suite's import stand-ins: the engine itself (a
prompt's token ids are its UTF-8 bytes, a chat template renders `<|role|>` lines,
and its prefix cache is whole 16-token blocks seen before, warm with the system
prompt, so each count is a block multiple below the prompt's length)."""

from __future__ import annotations

import asyncio
import http.server
import importlib
import json
import socket
import threading
import time
import urllib.request
import uuid
from types import SimpleNamespace as NS

import pytest
from starlette.responses import JSONResponse, StreamingResponse

from conftest import DEADLINE, eventually, free_port
from test_vllm_metrics_scrape import render

BLOCK = 16
SYSTEM = "You are a concise assistant for operators of data-parallel LLM serving. Answer in one sentence."
QUESTIONS = (
    "Why does a prefix cache hit make the first token come sooner?",
    "What does data parallelism replicate across ranks?",
    "When is a rank considered stalled?",
    "How should a router weigh queued requests against cached prefixes?",
    "What happens to a request whose rank goes down mid-stream?",
)
#: what every engine generates: 4 tokens, then `length`
WORDS = (" Because", " its", " KV", " blocks")
MODEL = "m"


def tokens(text: str) -> list[int]:
    return list(text.encode())


def render_chat(messages) -> str:
    """The engine's chat template, roughly."""
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class PrefixCache:
    """An engine's prefix cache: the whole blocks of a prompt seen before, from its
    start; the prompt's last token is always computed."""

    def __init__(self, *warm: str):
        self.blocks: set[tuple[int, ...]] = set()
        for text in warm:
            self.serve(tokens(text))

    def serve(self, ids: list[int]) -> int:
        full, hit = len(ids) // BLOCK, 0
        while hit < full and tuple(ids[: (hit + 1) * BLOCK]) in self.blocks:
            hit += 1
        self.blocks.update(tuple(ids[: (i + 1) * BLOCK]) for i in range(full))
        cached = hit * BLOCK
        return cached - BLOCK if cached == len(ids) else cached


class Engine:
    """One rank's OpenAI server on 127.0.0.1: the engine's serving code answers
    POSTs with a Starlette response, written as the engine's server writes it
    (a stream one chunk per event); GET /metrics is vLLM's own rendering."""

    def __init__(self, metrics: bytes):
        self.metrics = metrics
        self.cache = PrefixCache(SYSTEM, f"<|system|>\n{SYSTEM}\n")
        self.served: list[bytes] = []
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(engine.metrics)))
                self.end_headers()
                self.wfile.write(engine.metrics)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                asyncio.run(self.write(self.path, body))

            async def write(self, path: str, body: dict):
                response = await engine.respond(path, body)
                self.send_response(response.status_code)
                for name, value in response.raw_headers:
                    self.send_header(name.decode(), value.decode())
                # Each body is recorded before its end is written: the client has it once it has the end.
                if isinstance(response, StreamingResponse):
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    sent = b""
                    async for chunk in response.body_iterator:
                        data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                        sent += data
                    engine.served.append(sent)
                    self.wfile.write(b"0\r\n\r\n")
                else:
                    self.end_headers()
                    engine.served.append(response.body)
                    self.wfile.write(response.body)
                self.wfile.flush()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    async def respond(self, path: str, body: dict):
        raise NotImplementedError

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def bare(cls, **attributes):
    """A serving object without its constructor (which wants an engine client):
    only the attributes the driven methods read."""
    obj = object.__new__(cls)
    for name, value in attributes.items():
        setattr(obj, name, value)
    return obj


class Vllm(Engine):
    """vLLM 0.33.0's OpenAI server for one rank."""

    def __init__(self, real, rank: int, *, prompt_tokens_details: bool, force_include_usage: bool = False):
        super().__init__(render(real, rank, running=0, waiting=0, kv=0.0))
        completion = importlib.import_module("vllm.entrypoints.openai.completion.serving")
        chat = importlib.import_module("vllm.entrypoints.openai.chat_completion.serving")
        fingerprint = importlib.import_module("vllm.entrypoints.serve.utils.fingerprint").build_system_fingerprint(
            NS(compute_hash=lambda: "5f1e0c9a2b7d", parallel_config=None)
        )
        flags = dict(
            enable_prompt_tokens_details=prompt_tokens_details,
            enable_force_include_usage=force_include_usage,
            enable_per_request_metrics=False,
            enable_log_outputs=False,
            request_logger=None,
            return_tokens_as_token_ids=False,
            system_fingerprint=fingerprint,
        )
        self.completion = bare(completion.OpenAIServingCompletion, **flags)
        self.chat = bare(
            chat.OpenAIServingChat, **flags, response_role="assistant", enable_auto_tools=False, parser_cls=None,
            _include_reasoning_tokens_details=False,
        )
        self.protocol = {
            "/v1/completions": importlib.import_module("vllm.entrypoints.openai.completion.protocol").CompletionRequest,
            "/v1/chat/completions": importlib.import_module(
                "vllm.entrypoints.openai.chat_completion.protocol"
            ).ChatCompletionRequest,
        }
        self.outputs = importlib.import_module("vllm.outputs")
        self.metadata = importlib.import_module("vllm.entrypoints.generate.base.protocol").RequestResponseMetadata
        self.keep_alive = importlib.import_module("vllm.entrypoints.serve.utils.sse_keep_alive").with_sse_keep_alive

    def output(self, prompt: str, ids: list[int], cached: int, words, finished: bool):
        """A RequestOutput as vLLM's engine client yields it."""
        out = self.outputs
        return out.RequestOutput(
            request_id=uuid.uuid4().hex, prompt=prompt, prompt_token_ids=ids, prompt_logprobs=None,
            outputs=[out.CompletionOutput(
                index=0, text="".join(words), token_ids=[1000 + WORDS.index(w) for w in words], cumulative_logprob=None,
                logprobs=None, finish_reason="length" if finished else None,
            )],
            finished=finished, num_cached_tokens=cached,
        )

    async def respond(self, path: str, body: dict):
        request = self.protocol[path].model_validate(body)
        is_chat = path == "/v1/chat/completions"
        prompt = render_chat(request.messages) if is_chat else request.prompt
        ids = tokens(prompt)
        cached = self.cache.serve(ids)
        metadata = self.metadata(request_id=uuid.uuid4().hex)
        created = int(time.time())
        if request.stream:  # RequestOutputKind.DELTA: one output per token
            deltas = [self.output(prompt, ids, cached, [w], i == len(WORDS) - 1) for i, w in enumerate(WORDS)]

            async def results():
                for d in deltas:
                    yield d

            async def indexed():
                async for d in results():
                    yield 0, d

            if is_chat:
                generator = self.chat.chat_completion_stream_generator(
                    request, results(), f"chatcmpl-{metadata.request_id}", MODEL, request.messages, None, metadata
                )
            else:
                generator = self.completion.completion_stream_generator(
                    request, [], indexed(), f"cmpl-{metadata.request_id}", created, MODEL, 1, None, metadata
                )
            return StreamingResponse(content=self.keep_alive(generator, 0.0), media_type="text/event-stream")
        final = self.output(prompt, ids, cached, list(WORDS), True)  # RequestOutputKind.FINAL_ONLY
        if is_chat:

            async def results():
                yield final

            response = await self.chat.chat_completion_full_generator(
                request, results(), f"chatcmpl-{metadata.request_id}", MODEL, request.messages, None, metadata
            )
        else:
            response = self.completion.request_output_to_completion_response(
                [final], request, f"cmpl-{metadata.request_id}", created, MODEL, None, metadata
            )
        return JSONResponse(content=response.model_dump())


class Sglang(Engine):
    """SGLang 0.5.23's OpenAI server for one rank (its /metrics in vLLM's format:
    the load source only brings the rank up here)."""

    def __init__(self, real, rank: int):
        super().__init__(render(real, rank, running=0, waiting=0, kv=0.0))
        serving = importlib.import_module("sglang.srt.entrypoints.openai.serving_completions")
        self.serving = serving.OpenAIServingCompletion
        self.request = importlib.import_module("sglang.srt.entrypoints.openai.protocol").CompletionRequest
        self.json_response = importlib.import_module("sglang.srt.utils.json_response").model_json_response

    async def respond(self, path: str, body: dict):
        assert path == "/v1/completions", path
        request = self.request.model_validate(body)
        ids = tokens(request.prompt)
        cached = self.cache.serve(ids)
        rid = uuid.uuid4().hex
        # What TokenizerManager yields: the text so far, and meta_info (the scheduler's counts).
        contents = [
            {
                "text": "".join(WORDS[: i + 1]),
                "output_ids": [1000 + j for j in range(i + 1)],
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": "length", "length": len(WORDS)} if i == len(WORDS) - 1 else None,
                    "prompt_tokens": len(ids),
                    "weight_version": "default",
                    "num_retractions": 0,
                    "reasoning_tokens": 0,
                    "completion_tokens": i + 1,
                    "cached_tokens": cached,
                },
            }
            for i in range(len(WORDS))
        ]

        async def generate_request(adapted_request, raw_request):
            for content in contents if request.stream else contents[-1:]:
                yield content

        serving = bare(
            self.serving,
            tokenizer_manager=NS(generate_request=generate_request, tokenizer=None, create_abort_task=lambda _: None),
        )
        if request.stream:
            response = await serving._handle_streaming_request(None, request, None)
        else:
            response = await serving._handle_non_streaming_request(None, request, None)
        return self.json_response(response)


@pytest.fixture
def sglang_serving(real):
    """``sglang_serving(enable_cache_report=...)``: SGLang's serving config for this test."""
    runtime = importlib.import_module("sglang.srt.runtime_context")
    installed = []

    def publish(**fields):
        override = runtime.get_context().override_server_args(**fields)
        override.install()
        installed.append(override)
        assert runtime.get_serving().enable_cache_report is fields.get("enable_cache_report", False)

    yield publish
    for override in reversed(installed):
        override.restore()


@pytest.fixture
def ranks():
    """``ranks(engine, ...)``: the engines' servers, closed at teardown."""
    made: list[Engine] = []

    def start(*engines: Engine) -> list[Engine]:
        made.extend(engines)
        return list(engines)

    yield start
    for engine in made:
        engine.close()


def start_proxy(start_daemon, tmp_path, engines: list[Engine]):
    """dpcoord with its proxy over `engines` (rank i = engines[i]), all ranks up."""
    port = free_port()
    urls = json.dumps([f"http://127.0.0.1:{e.port}/metrics" for e in engines])
    endpoints = json.dumps([f"127.0.0.1:{e.port}" for e in engines])
    config = tmp_path / "proxy.toml"
    config.write_text(
        f'[server]\nproxy_bind = "127.0.0.1:{port}"\n'
        f"[engines]\ndp_size = {len(engines)}\nvllm_metrics_url = {urls}\nvllm_metrics_interval_ms = 50\n"
        f"[gateway]\nendpoints = {endpoints}\n"
        '[routing]\npolicy = "cache_aware"\n'
    )
    d = start_daemon("--config", str(config))
    eventually("every rank up from its /metrics", lambda: d.statuses() == ["up"] * len(engines))

    def listening():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=DEADLINE).close()
            return True
        except OSError:
            return False

    eventually("the proxy listening", listening)
    return d, port


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def post(port: int, path: str, body: dict):
    """One request through the proxy: (status, headers, body)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with OPENER.open(request, timeout=DEADLINE) as r:
        return r.status, r.headers, r.read()


def cached_tokens_in(body: bytes) -> int | None:
    """The engine's count, read as a client reads it: the JSON body's usage, or
    the last event of a stream carrying `usage.prompt_tokens_details`."""
    text = body.decode()
    if not text.startswith("data: "):
        details = (json.loads(text).get("usage") or {}).get("prompt_tokens_details")
        return details and details.get("cached_tokens")
    events = [json.loads(line[6:]) for line in text.split("\n") if line.startswith("data: {")]
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    counts = [
        e["usage"]["prompt_tokens_details"]["cached_tokens"]
        for e in events
        if (e.get("usage") or {}).get("prompt_tokens_details")
    ]
    return counts[-1] if counts else None


def reported(d, rank: int, kind: str) -> float:
    return d.metric("dpcoord_prefix_reported_tokens_total", f'dp_rank="{rank}",kind="{kind}"')


def predicted(d, rank: int) -> float:
    return d.metric("dpcoord_prefix_predicted_tokens_total", f'dp_rank="{rank}",of="chosen"')


def booked(d) -> tuple[list[int], int]:
    """Each rank's pending placements, and how many were routed in all."""
    ranks = d.state()["ranks"]
    return [r["pending"] for r in ranks], sum(r["routed"] for r in ranks)


def delivered(d, n: int) -> float:
    return sum(reported(d, r, "delivered") for r in range(n))


def completion(question: str, **extra) -> tuple[str, dict]:
    return "/v1/completions", {"model": MODEL, "prompt": f"{SYSTEM}\n{question}\n", "max_tokens": len(WORDS), **extra}


def chat(question: str, **extra) -> tuple[str, dict]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": len(WORDS), **extra}


def through(d, port: int, engines: list[Engine], path: str, body: dict) -> bytes:
    """One request through the proxy; the body the client got is the one its rank served."""
    status, headers, got = post(port, path, body)
    assert status == 200, got
    rank = int(headers["x-dpcoord-rank"])
    assert 0 <= rank < len(engines)
    assert engines[rank].served and engines[rank].served[-1] == got, "the rank's body, passed through unchanged"
    return got


def check_every_count_delivered(d, port: int, engines: list[Engine], requests) -> None:
    expected = 0
    for path, body in requests:
        got = through(d, port, engines, path, body)
        count = cached_tokens_in(got)
        assert count is not None and count > 0, f"the engine reported no count: {got.decode()}"
        expected += count
        eventually(
            f"{path} (stream: {body.get('stream', False)}): delivered {expected} cached tokens in all",
            lambda: delivered(d, len(engines)) == expected,
        )
    for rank in range(len(engines)):
        assert reported(d, rank, "predicted") == predicted(d, rank), f"rank {rank}: every prediction carried back"
    assert sum(predicted(d, r) for r in range(len(engines))) > 0, "the repeated prompt was predicted cached"


@pytest.mark.parametrize("usage", ["stream_options", "force_include_usage"])
def test_vllm_cached_tokens_are_delivered_against_the_prediction(real, start_daemon, ranks, tmp_path, usage):
    """vLLM with --enable-prompt-tokens-details: the count of a completion and of a
    chat completion, whole or streamed (its final usage chunk, there when the client
    asks `stream_options.include_usage` or the server runs
    --enable-force-include-usage, which also puts usage without the count on every
    chunk before it)."""
    force = usage == "force_include_usage"
    engines = ranks(*(Vllm(real, r, prompt_tokens_details=True, force_include_usage=force) for r in range(2)))
    d, port = start_proxy(start_daemon, tmp_path, engines)
    stream = {"stream": True} if force else {"stream": True, "stream_options": {"include_usage": True}}
    check_every_count_delivered(d, port, engines, [
        completion(QUESTIONS[0]),
        completion(QUESTIONS[0]),  # the same prompt again: predicted cached where it went
        completion(QUESTIONS[1], **stream),
        chat(QUESTIONS[2]),
        chat(QUESTIONS[3], **stream),
        chat(QUESTIONS[3], **stream),
    ])


def test_sglang_cached_tokens_are_delivered_against_the_prediction(real, sglang_serving, start_daemon, ranks, tmp_path):
    """SGLang with --enable-cache-report: the count of a completion, whole or
    streamed (its final usage chunk, with `stream_options.include_usage`)."""
    sglang_serving(enable_cache_report=True)
    engines = ranks(Sglang(real, 0), Sglang(real, 1))
    d, port = start_proxy(start_daemon, tmp_path, engines)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    check_every_count_delivered(d, port, engines, [
        completion(QUESTIONS[0]),
        completion(QUESTIONS[0]),
        completion(QUESTIONS[1], **stream),
        completion(QUESTIONS[4], **stream),
        completion(QUESTIONS[4]),
    ])


@pytest.mark.parametrize("case", ["vllm without prompt tokens details", "sglang without cache report",
                                  "vllm streams without usage"])
def test_without_the_count_nothing_is_delivered(real, sglang_serving, start_daemon, ranks, tmp_path, case):
    """An engine that leaves the count out (vLLM without
    --enable-prompt-tokens-details, SGLang without --enable-cache-report, or a vLLM
    stream whose client did not ask for usage): the proxy books every request
    `finished` and reports nothing, though the router predicted cached tokens."""
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if case.startswith("sglang"):
        sglang_serving()
        engines = ranks(Sglang(real, 0), Sglang(real, 1))
        requests = [completion(QUESTIONS[0]), completion(QUESTIONS[0]), completion(QUESTIONS[1], **stream)]
    elif case == "vllm streams without usage":
        engines = ranks(*(Vllm(real, r, prompt_tokens_details=True) for r in range(2)))
        requests = [completion(QUESTIONS[0], stream=True), completion(QUESTIONS[0], stream=True),
                    chat(QUESTIONS[2], stream=True)]
    else:
        engines = ranks(*(Vllm(real, r, prompt_tokens_details=False) for r in range(2)))
        requests = [completion(QUESTIONS[0]), completion(QUESTIONS[0]), completion(QUESTIONS[1], **stream),
                    chat(QUESTIONS[2]), chat(QUESTIONS[3], **stream)]
    d, port = start_proxy(start_daemon, tmp_path, engines)
    for path, body in requests:
        got = through(d, port, engines, path, body)
        assert b"cached_tokens" not in got, got.decode()
    n = len(engines)
    eventually("every request routed and booked finished", lambda: booked(d) == ([0] * n, len(requests)))
    assert sum(predicted(d, r) for r in range(n)) > 0, "a prediction was there to report"
    for rank in range(n):
        assert reported(d, rank, "delivered") == 0, f"rank {rank}"
        assert reported(d, rank, "predicted") == 0, f"rank {rank}"
