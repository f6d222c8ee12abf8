"""Frontend side: an OpenAI-compatible proxy that asks dpcoord which DP rank serves
each request, then forwards it there. Standard library plus the dpcoord client.

Two deployment shapes:

* one server per DP rank (vLLM ``--data-parallel-external-lb`` or one SGLang
  server per rank): pass one ``--engines`` URL per rank, in rank order;
* one server fronting all ranks (vLLM internal DP, SGLang ``--dp-size``): pass a
  single URL and say which engine it is. The rank travels as that engine reads
  it: ``--engine vllm`` (the default) sends the ``X-data-parallel-rank`` header,
  ``--engine sglang`` sets ``routed_dp_rank`` in the JSON body (SGLang takes no
  rank for embeddings: its controller places those itself).

What the proxy sends to dpcoord per request: the prompt's token ids
(``tokens``: ``cache_aware`` matches them against what each rank has cached, and
their count is the prompt length ``least_tokens`` weighs), ``session`` (the
OpenAI ``user`` field, for affinity), a pin from an incoming
``X-data-parallel-rank`` header or ``routed_dp_rank`` field, and
``bootstrap_room`` from the body (PD disaggregation). The token ids come from
the engine itself, ``POST /tokenize`` on the first ``--engines`` URL (the chat
form for chat requests, so the chat template is in them); ids already in the
body are used as they are. When that fails, or with ``--no-tokenize``, dpcoord
gets an estimate of the length instead (four characters a token) and the log
says so. The chosen rank is echoed in the ``X-Dpcoord-Rank`` response header. ::

    python examples/frontend_openai.py --route tcp://127.0.0.1:5570 \\
        --engine sglang --engines http://10.0.0.1:30000 --listen 127.0.0.1:8080
"""

from __future__ import annotations

import argparse
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dpcoord import DpcoordError, RouterClient

RANK_HEADER = "X-data-parallel-rank"
ROUTED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/generate")
ENGINES = ("vllm", "sglang")
log = logging.getLogger("frontend")


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """About four characters per token: enough to tell long prompts from short."""
    text = ""
    if isinstance(body.get("messages"), list):
        for m in body["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                text += content
            elif isinstance(content, list):
                text += "".join(p.get("text", "") for p in content if isinstance(p, dict))
    for key in ("prompt", "input", "text"):
        if isinstance(body.get(key), str):
            text += body[key]
    return max(1, len(text) // 4)


def is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 0 and all(type(t) is int for t in value)


def engine_token_ids(engine_url: str, body: dict[str, Any], timeout_s: float = 5.0) -> list[int]:
    """The prompt's token ids as the engine will see them. vLLM and SGLang both
    serve ``POST /tokenize``: ``{"model", "messages", "tools"}`` renders the chat
    template as a chat completion does, ``{"model", "prompt"}`` encodes text;
    both answer ``{"tokens": [...], "count": ..., "max_model_len": ...}``."""
    for key in ("input_ids", "prompt", "input"):  # ids given by the caller
        if is_token_ids(body.get(key)):
            return body[key]
    if isinstance(body.get("messages"), list):
        req = {k: body[k] for k in ("messages", "tools", "chat_template_kwargs") if body.get(k) is not None}
    else:
        text = next((body[k] for k in ("prompt", "input", "text") if isinstance(body.get(k), str)), None)
        if text is None:
            raise ValueError("no prompt text to tokenize")
        req = {"prompt": text}
    if isinstance(body.get("model"), str):
        req["model"] = body["model"]
    http = urllib.request.Request(
        engine_url + "/tokenize", data=json.dumps(req).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(http, timeout=timeout_s) as r:
        tokens = json.loads(r.read()).get("tokens")
    if not is_token_ids(tokens):
        raise ValueError("/tokenize answered no token ids")
    return tokens


def place(client: RouterClient, body: dict[str, Any], headers, tokens: list[int] | None) -> int:
    """The rank for one request, from dpcoord (or the client's fallback)."""
    pin = headers.get(RANK_HEADER, body.pop("routed_dp_rank", None))  # re-set below for SGLang
    room = body.get("bootstrap_room")
    user = body.get("user")
    if tokens is None:
        prompt = {"prompt_tokens": estimate_prompt_tokens(body)}
    elif len(tokens) > client.max_prompt_tokens:  # above dpcoord's limit: the length only
        prompt = {"prompt_tokens": len(tokens)}
    else:
        prompt = {"tokens": tokens}
    [rank] = client.route(
        rank=int(pin) if pin is not None else None,
        bootstrap_room=room if isinstance(room, int) else None,
        session=user if isinstance(user, str) else None,
        **prompt,
    )
    return rank


def make_handler(
    client: RouterClient, engines: list[str], engine: str = "vllm", tokenize: bool = True, timeout_s: float = 600.0
):
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    per_rank = len(engines) > 1

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the connection closes after each response: simple streaming

        def log_message(self, fmt, *args):  # quiet by default
            log.debug(fmt, *args)

        def reply(self, status: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            if self.path.split("?")[0] not in ROUTED_PATHS:
                return self.reply(404, {"error": {"message": f"no route for {self.path}"}})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except json.JSONDecodeError as e:
                return self.reply(400, {"error": {"message": f"body is not JSON: {e}"}})
            tokens = None
            if tokenize:
                try:
                    tokens = engine_token_ids(engines[0], body)
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                    log.warning("no token ids for %s (%s): dpcoord gets an estimated prompt length", self.path, e)
            try:
                rank = place(client, body, self.headers, tokens)
            except (DpcoordError, ValueError) as e:
                # A refusal (say a pin to a rank that is down): tell the caller why.
                code = getattr(e, "code", "bad_request")
                status = 503 if code in ("no_engine_available", "rank_unavailable", "unreachable") else 400
                return self.reply(status, {"error": {"message": str(e), "code": code}})
            headers = {}
            if per_rank:
                if rank >= len(engines):
                    return self.reply(503, {"error": {"message": f"rank {rank} has no engine URL configured"}})
                url = engines[rank] + self.path
            else:
                url = engines[0] + self.path
                if engine == "sglang":
                    body["routed_dp_rank"] = rank
                else:
                    headers[RANK_HEADER] = str(rank)
            req = urllib.request.Request(
                url,
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", **headers},
                method="POST",
            )
            try:
                upstream = urllib.request.urlopen(req, timeout=timeout_s)
            except urllib.error.HTTPError as e:
                upstream = e
            except OSError as e:
                return self.reply(502, {"error": {"message": f"rank {rank} ({url}) failed: {e}"}})
            with upstream:
                self.send_response(upstream.status)
                for k in ("Content-Type", "Content-Length"):
                    if upstream.headers.get(k):
                        self.send_header(k, upstream.headers[k])
                self.send_header("X-Dpcoord-Rank", str(rank))
                self.end_headers()
                read = getattr(upstream, "read1", upstream.read)
                while chunk := read(65536):
                    self.wfile.write(chunk)
                    self.wfile.flush()

    return Handler


def make_server(
    client: RouterClient,
    engines: list[str],
    host: str = "127.0.0.1",
    port: int = 8080,
    engine: str = "vllm",
    tokenize: bool = True,
):
    """A threading HTTP server; ``serve_forever()`` it (port 0 picks a free one)."""
    handler = make_handler(client, [e.rstrip("/") for e in engines], engine, tokenize)
    return ThreadingHTTPServer((host, port), handler)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", default="tcp://127.0.0.1:5570", help="dpcoord's --route-bind")
    ap.add_argument("--standby", action="append", default=[], help="a standby dpcoord's route endpoint")
    ap.add_argument("--engines", nargs="+", required=True, help="one URL per rank, or one URL for all ranks")
    ap.add_argument("--engine", choices=ENGINES, default="vllm", help="how a single URL takes the rank")
    ap.add_argument("--no-tokenize", action="store_true", help="send dpcoord an estimated length, no token ids")
    ap.add_argument("--dp-size", type=int, default=None, help="for the fallback before dpcoord was ever reached")
    ap.add_argument("--timeout-ms", type=int, default=200)
    ap.add_argument("--listen", default="127.0.0.1:8080")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.no_tokenize:
        log.info("--no-tokenize: dpcoord gets estimated prompt lengths and no token ids (cache_aware cannot match)")
    dp_size = args.dp_size or (len(args.engines) if len(args.engines) > 1 else None)
    client = RouterClient(args.route, timeout_ms=args.timeout_ms, dp_size=dp_size, standby=args.standby)
    host, port = args.listen.rsplit(":", 1)
    server = make_server(client, args.engines, host, int(port), args.engine, not args.no_tokenize)
    logging.info("listening on http://%s:%s, routing through dpcoord at %s", host, port, args.route)
    try:
        server.serve_forever()
    finally:
        client.close()


if __name__ == "__main__":
    main()
