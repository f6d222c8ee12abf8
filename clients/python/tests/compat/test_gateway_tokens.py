"""The gateway's prompt tokenization (crates/gateway/src/prompt/) against the
tokenizer vLLM uses: transformers' AutoTokenizer over the same tokenizer.json and
tokenizer_config.json, with vLLM 0.33's arguments (completions: ``encode(prompt,
add_special_tokens=True)``, vllm/renderers/base.py ``default_cmpl_tok_params``;
chat: ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``,
which renders the template and encodes the text with ``add_special_tokens=False``,
vllm/renderers/hf.py ``safe_apply_chat_template``).

The ids are recorded in crates/gateway/testdata/tokenizers/golden.json, which the
Rust unit tests (gateway/prompt/tests.rs) check dpcoord's encoder against. This test
recomputes every case with transformers and asserts the file still says the same, so
a drift on either side fails one of the two. Regenerate after changing CASES:

    .venv/bin/python clients/python/tests/compat/test_gateway_tokens.py --write

The tokenizer runs in a child process: the compat suite replaces ``transformers``
and ``tokenizers`` with stand-ins inside this one (standins.py)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

DATA = Path(__file__).resolve().parents[4] / "crates" / "gateway" / "testdata" / "tokenizers"
GOLDEN = DATA / "golden.json"
#: fixture folder -> the model_type of the model's config.json: every real model folder has one,
#: and transformers v5 picks the tokenizer class by it (for deepseek_v3 it overrides the hub's
#: ``LlamaTokenizerFast`` with the plain tokenizer.json pipeline, TokenizersBackend).
MODELS = {"qwen3": "qwen3", "deepseek_v3": "deepseek_v3"}

LONG = " ".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, {i * 7} times." for i in range(40))

#: (kind, input): a completion's prompt text, or a chat's messages.
CASES = [
    ("completion", "Hello, world!"),
    ("completion", "  leading spaces, tabs\tand\nnewlines\n\n  — ünïcödé 中文 🦀 1234567 it's we'll"),
    ("completion", "<|im_start|>user\nspecial token text in a completion<|im_end|>"),
    ("completion", LONG),
    ("chat", [{"role": "user", "content": "What is the capital of France?"}]),
    (
        "chat",
        [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three primes."},
            {"role": "assistant", "content": "2, 3, 5."},
            {"role": "user", "content": "  And three more?\n"},
        ],
    ),
    ("chat", [{"role": "system", "content": "Rules:\n- be brief"}, {"role": "user", "content": LONG}]),
]


def compute() -> dict:
    """Every case's ids (and a chat's rendered text) per model, from transformers."""
    from transformers import AutoTokenizer

    out = {"models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for model, model_type in MODELS.items():
            d = Path(tmp) / model
            d.mkdir()
            (d / "config.json").write_text(json.dumps({"model_type": model_type}))
            (d / "tokenizer.json").write_bytes(gzip.decompress((DATA / model / "tokenizer.json.gz").read_bytes()))
            (d / "tokenizer_config.json").write_bytes((DATA / model / "tokenizer_config.json").read_bytes())
            tok = AutoTokenizer.from_pretrained(str(d))  # as vllm/tokenizers/hf.py does
            cases = []
            for kind, value in CASES:
                if kind == "completion":
                    ids = tok.encode(value, add_special_tokens=True)
                    cases.append({"kind": kind, "prompt": value, "ids": ids})
                else:
                    text = tok.apply_chat_template(value, add_generation_prompt=True, tokenize=False)
                    ids = tok.apply_chat_template(value, add_generation_prompt=True, tokenize=True, return_dict=False)
                    cases.append({"kind": kind, "messages": value, "text": text, "ids": list(ids)})
            out["models"][model] = cases
    return out


def render(doc: dict) -> str:
    return json.dumps(doc, ensure_ascii=False, indent=1) + "\n"


def test_golden_ids_are_what_transformers_produces():
    run = subprocess.run([sys.executable, __file__, "--print"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.stdout == GOLDEN.read_text(encoding="utf-8"), (
        "golden.json differs from what transformers produces now: regenerate it (module docstring)"
        " and check the Rust tests still pass"
    )


if __name__ == "__main__":
    text = render(compute())
    if "--write" in sys.argv:
        GOLDEN.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
