"""The rank header the gateway picker sets (`gateway.rank_header`), read by the
engines' own OpenAI servers: vLLM 0.33.0's chat and completion serving
(`_get_data_parallel_rank`) and SGLang 0.5.23's (`extract_routed_dp_rank_from_header`,
the base-class method its chat and completion serving both call), each given a
Starlette request carrying exactly the headers dpcoord answered with."""

from __future__ import annotations

import importlib

from starlette.requests import Request

from conftest import bring_up, eventually
from test_gateway_epp import A, Stream, pending, picked, request, respond, start


def as_request(headers: dict[str, str]) -> Request:
    """The request the engine's server sees once the gateway applied dpcoord's header mutation."""
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_vllm_and_sglang_read_the_rank_dpcoord_picked(real, start_daemon, engines, tmp_path):
    vllm_chat = importlib.import_module("vllm.entrypoints.openai.chat_completion.serving").OpenAIServingChat
    vllm_completion = importlib.import_module("vllm.entrypoints.openai.completion.serving").OpenAIServingCompletion
    sglang = importlib.import_module("sglang.srt.entrypoints.openai.serving_completions").OpenAIServingCompletion
    d, ch = start(start_daemon, tmp_path, dp=2, endpoints=[A], rank_header="x-data-parallel-rank")
    bring_up(d, engines, [0, 1])
    seen = []
    for _ in range(2):
        s = Stream(ch)
        request(s)
        endpoint, headers = picked(s)
        assert endpoint == A
        rank = int(headers["x-data-parallel-rank"])
        raw = as_request(headers)
        assert vllm_chat._get_data_parallel_rank(raw) == rank
        assert vllm_completion._get_data_parallel_rank(raw) == rank
        # SGLang's header wins over a body's routed_dp_rank; `self` is used for nothing else.
        assert sglang.extract_routed_dp_rank_from_header(object.__new__(sglang), raw, 1 - rank) == rank
        seen.append(rank)
        respond(s, A)
    assert sorted(seen) == [0, 1], "both ranks were picked once (least_load over two idle ranks)"
    eventually("both requests ended", lambda: pending(d) == [0, 0])
