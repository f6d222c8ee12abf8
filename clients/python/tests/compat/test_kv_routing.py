"""``cache_aware`` routing on the engines' real KV events: dpcoord runs with
``--policy cache_aware`` on two ranks whose prefix caches are the classes the engines
use by default, and a route query carrying a prompt's token ids goes to the rank that
holds its prefix, by the engine's own account (``held``), and by load where no rank
holds it.

vLLM 0.33.0: the real ``KVCacheManager`` per rank (test_kv_unmatchable.py's
``VllmScheduledKv``: prefix caching and KV events on, the scheduler's request path),
published by the real ``ZmqEventPublisher``. SGLang 0.5.23: its default tree cache,
``UnifiedRadixCache`` (``sglang_kv(..., unified=True)``), published by the
scheduler's ``SchedulerKvEventsPublisher``."""

from __future__ import annotations

import random

from conftest import bring_up, eventually
from test_kv_events import Prompt, free_ports, join, prefix, sglang_kv, start, tokens, vllm_kv  # noqa: F401
from test_kv_unmatchable import VllmScheduledKv


def route(d, p: Prompt) -> int:
    reply = d.call("route", {"v": 1, "op": "route", "tokens": list(p.tokens)})
    assert reply.get("ok") is True, reply
    [rank] = reply["ranks"]
    return rank


def routes_to_the_holder(d, engines: list, rng: random.Random) -> None:
    """Rank 1 holds ``a``, rank 0 holds ``b``; each is asked for with a longer prompt
    that continues it, and an unrelated prompt goes by load (rank 0: rank 1 took a
    placement just before)."""
    block = engines[0].block_size
    a, b = Prompt(tokens(rng, 8 * block)), Prompt(tokens(rng, 6 * block))
    engines[1].cache_prompt(a)
    engines[1].step()
    engines[0].cache_prompt(b)
    engines[0].step()
    assert [e.held(a) for e in engines] == [0, 8] and [e.held(b) for e in engines] == [6, 0]
    eventually("dpcoord's index has both", lambda: prefix(d, a)["matched"] == [0, 8] and prefix(d, b)["matched"] == [6, 0])
    assert route(d, Prompt(a.tokens + tokens(rng, 2 * block))) == 1
    assert route(d, Prompt(b.tokens + tokens(rng, 2 * block))) == 0
    assert route(d, Prompt(a.tokens)) == 1, "the holder again, its pending placement notwithstanding"
    assert route(d, Prompt(tokens(rng, 4 * block))) == 0, "no holder: by load"


def test_cache_aware_routes_to_the_rank_whose_kv_cache_manager_holds_the_prefix(
    vllm_kv, real, start_daemon, engines  # noqa: F811
):
    rng = random.Random(51)
    base = free_ports(4)
    pub, rep = base, base + 2
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank",
              "--policy", "cache_aware")
    kv = [VllmScheduledKv(vllm_kv.v, real, r, pub, rep) for r in (0, 1)]  # vLLM adds the rank to both ports
    vllm_kv.made.extend(kv)
    bring_up(d, engines, [0, 1])
    for r, e in enumerate(kv):
        join(d, e, r, rng)
    routes_to_the_holder(d, kv, rng)


def test_cache_aware_routes_to_the_rank_whose_default_sglang_tree_cache_holds_the_prefix(
    sglang_kv, start_daemon, engines  # noqa: F811
):
    rng = random.Random(53)
    base = free_ports(4)
    pub, rep = base, base + 2
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank",
              "--policy", "cache_aware")
    kv = [sglang_kv(r, 2, pub, rep, page_size=16, unified=True) for r in (0, 1)]
    bring_up(d, engines, [0, 1])
    for r, e in enumerate(kv):
        join(d, e, r, rng)
    routes_to_the_holder(d, kv, rng)
