"""Prefix-aware picks through the gateway picker: with the model's tokenizer
configured (`gateway.tokenizer`) a prompt is keyed by the engine's token ids,
without it by its text; either way `cache_aware` sends a prompt seen before
to the rank that holds it, and `dpcoord_gateway_prompts_total{mode}` says which
keying served. Real binary, real gRPC; the tokenizer is Qwen3's (the fixture
the prompt encoder's unit tests read, crates/gateway/testdata/tokenizers), and
the expected ids come from the golden file transformers wrote."""

from __future__ import annotations

import gzip
import json
import math
import shutil
import subprocess
from pathlib import Path

import grpc

from conftest import DEADLINE, bring_up, eventually, free_port
from test_gateway_epp import A, B, Stream, pending, picked, request, respond

FIXTURES = Path(__file__).resolve().parents[3] / "crates/gateway/testdata/tokenizers"
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())["models"]["qwen3"]
# The longest completion of the golden file: some hundreds of tokens.
CASE = max((c for c in GOLDEN if c["kind"] == "completion"), key=lambda c: len(c["ids"]))
BODY = json.dumps({"model": "qwen3", "prompt": CASE["prompt"]}).encode()


def start(start_daemon, tmp_path, tokenizer: bool):
    lines = ""
    if tokenizer:
        tok = tmp_path / "tokenizer.json"
        with gzip.open(FIXTURES / "qwen3/tokenizer.json.gz") as src, open(tok, "wb") as dst:
            shutil.copyfileobj(src, dst)
        shutil.copy(FIXTURES / "qwen3/tokenizer_config.json", tmp_path / "tokenizer_config.json")
        lines = f'tokenizer = "{tok}"\ntokenizer_config = "{tmp_path / "tokenizer_config.json"}"\n'
    port = free_port()
    cfg = tmp_path / "epp.toml"
    cfg.write_text(
        f'[server]\nepp_bind = "127.0.0.1:{port}"\nepp_tls = "off"\n[engines]\ndp_size = 2\n'
        '[routing]\npolicy = "cache_aware"\npending_ttl_ms = 600000\n'
        f'[gateway]\nendpoints = ["{A}", "{B}"]\n{lines}'
    )
    d = start_daemon("--config", str(cfg))
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=DEADLINE)
    return d, channel


def twice(d, ch) -> list[int]:
    """The same prompt twice, the first ended before the second: the ranks picked."""
    ranks = []
    for _ in range(2):
        s = Stream(ch)
        request(s, BODY)
        endpoint, _ = picked(s, BODY)
        ranks.append([A, B].index(endpoint))
        respond(s, endpoint)
        eventually("the request ended", lambda: pending(d) == [0, 0])
    return ranks


def predicted(d, rank: int) -> float:
    return d.metric("dpcoord_prefix_predicted_tokens_total", f'dp_rank="{rank}",of="chosen"')


def test_the_engines_token_ids_key_the_prompt(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, tokenizer=True)
    bring_up(d, engines, [0, 1])
    first, second = twice(d, ch)
    assert second == first, "the prompt went back to the rank that holds it"
    # Nothing was cached for the first; the second finds every whole 16-token
    # block of the ids transformers computes for this prompt (Qwen3 adds no BOS).
    assert predicted(d, first) == len(CASE["ids"]) // 16 * 16
    assert d.metric("dpcoord_gateway_prompts_total", 'mode="tokenizer"') == 2
    assert d.metric("dpcoord_gateway_prompts_total", 'mode="text"') == 0


def test_without_a_tokenizer_the_text_keys_the_prompt(start_daemon, engines, tmp_path):
    d, ch = start(start_daemon, tmp_path, tokenizer=False)
    bring_up(d, engines, [0, 1])
    first, second = twice(d, ch)
    assert second == first
    text = CASE["prompt"].encode()
    # Whole blocks of 16 pseudo-tokens (64 bytes), at most the estimated length.
    assert predicted(d, first) == min(len(text) // 64 * 16, math.ceil(len(text) / 4))
    assert d.metric("dpcoord_gateway_prompts_total", 'mode="text"') == 2
    assert d.metric("dpcoord_gateway_prompts_total", 'mode="tokenizer"') == 0


def test_a_tokenizer_that_does_not_load_stops_the_start(dpcoord_bin, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ not a tokenizer")
    cfg = tmp_path / "epp.toml"
    cfg.write_text(
        f'[server]\nepp_bind = "127.0.0.1:{free_port()}"\nepp_tls = "off"\n[engines]\ndp_size = 1\n'
        f'[gateway]\nendpoints = ["{A}"]\ntokenizer = "{bad}"\n'
    )
    r = subprocess.run([dpcoord_bin, "--config", str(cfg)], capture_output=True, text=True, timeout=DEADLINE)
    assert r.returncode == 2, r
    assert "gateway.tokenizer" in r.stderr and str(bad) in r.stderr, r.stderr
