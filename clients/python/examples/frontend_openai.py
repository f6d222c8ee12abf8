"""Frontend side: an OpenAI-compatible proxy that asks dpcoord which DP rank serves
each request, then forwards it there. Standard library plus the dpcoord client.

Two deployment shapes:

* one server per DP rank (vLLM ``--data-parallel-external-lb`` or one SGLang
  server per rank): pass one ``--engines`` URL per rank, in rank order;
* one server fronting all ranks (vLLM internal DP, SGLang ``--dp-size``): pass a
  single URL; the rank travels as the ``X-data-parallel-rank`` header (which
  vLLM's OpenAI server reads) and as ``data_parallel_rank`` in the JSON body
  (SGLang's ``GenerateReqInput`` field, honoured by its DataParallelController).

What the proxy sends to dpcoord per request: ``prompt_tokens`` (a rough
estimate, for ``least_tokens``), ``session`` (the OpenAI ``user`` field, for
affinity), a pin from an incoming ``X-data-parallel-rank`` header, and
``bootstrap_room`` from the body (PD disaggregation). The chosen rank is echoed
in the ``X-Dpcoord-Rank`` response header. ::

    python examples/frontend_openai.py --route tcp://127.0.0.1:5570 \\
        --engines http://10.0.0.1:8000 http://10.0.0.2:8000 --listen 127.0.0.1:8080
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


def place(client: RouterClient, body: dict[str, Any], headers) -> int:
    """The rank for one request, from dpcoord (or the client's fallback)."""
    pin = headers.get(RANK_HEADER)
    room = body.get("bootstrap_room")
    user = body.get("user")
    [rank] = client.route(
        prompt_tokens=estimate_prompt_tokens(body),
        rank=int(pin) if pin is not None else None,
        bootstrap_room=room if isinstance(room, int) else None,
        session=user if isinstance(user, str) else None,
    )
    return rank


def make_handler(client: RouterClient, engines: list[str], timeout_s: float = 600.0):
    per_rank = len(engines) > 1

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the connection closes after each response: simple streaming

        def log_message(self, fmt, *args):  # quiet by default
            logging.getLogger("frontend").debug(fmt, *args)

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
            try:
                rank = place(client, body, self.headers)
            except (DpcoordError, ValueError) as e:
                # A refusal (say a pin to a rank that is down): tell the caller why.
                code = getattr(e, "code", "bad_request")
                status = 503 if code in ("no_engine_available", "rank_unavailable", "unreachable") else 400
                return self.reply(status, {"error": {"message": str(e), "code": code}})
            if per_rank:
                if rank >= len(engines):
                    return self.reply(503, {"error": {"message": f"rank {rank} has no engine URL configured"}})
                url, headers = engines[rank] + self.path, {}
            else:
                url, headers = engines[0] + self.path, {RANK_HEADER: str(rank)}
                body["data_parallel_rank"] = rank
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


def make_server(client: RouterClient, engines: list[str], host: str = "127.0.0.1", port: int = 8080):
    """A threading HTTP server; ``serve_forever()`` it (port 0 picks a free one)."""
    return ThreadingHTTPServer((host, port), make_handler(client, [e.rstrip("/") for e in engines]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--route", default="tcp://127.0.0.1:5570", help="dpcoord's --route-bind")
    ap.add_argument("--standby", action="append", default=[], help="a standby dpcoord's route endpoint")
    ap.add_argument("--engines", nargs="+", required=True, help="one URL per rank, or one URL for all ranks")
    ap.add_argument("--dp-size", type=int, default=None, help="for the fallback before dpcoord was ever reached")
    ap.add_argument("--timeout-ms", type=int, default=200)
    ap.add_argument("--listen", default="127.0.0.1:8080")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    dp_size = args.dp_size or (len(args.engines) if len(args.engines) > 1 else None)
    client = RouterClient(args.route, timeout_ms=args.timeout_ms, dp_size=dp_size, standby=args.standby)
    host, port = args.listen.rsplit(":", 1)
    server = make_server(client, args.engines, host, int(port))
    logging.info("listening on http://%s:%s, routing through dpcoord at %s", host, port, args.route)
    try:
        server.serve_forever()
    finally:
        client.close()


if __name__ == "__main__":
    main()
