"""vLLM's hybrid models: a KV cache group per kind of layer, each block published once
per group (``group_idx``), and a prefix hit only as far as every group can serve it
(``HybridKVCacheCoordinator``). docs/prefix-cache.md, "Hybrid models: one index per KV
cache group", claims that dpcoord predicts a rank's hit as the least of its groups'
leading blocks: never more than the engine's own hit (no phantom), and the engine's hit
exactly unless a sliding-window group hits past a block it dropped.

vLLM 0.33.0, driven as its scheduler drives it: the real ``KVCacheManager`` of a
hybrid model (vllm_engine.make_hybrid_kv_cache_manager: group 0 full attention, group 1
a sliding window of one block, one shared ``BlockPool``), requests prefilled through
``get_computed_blocks`` + ``allocate_slots`` (in two chunks where the window is to move,
which frees the sliding-window blocks behind it) and released with ``free``; each step's
events from ``KVCacheManager.take_events`` published through the ``ZmqEventPublisher``
that ``EventPublisherFactory`` builds (test_kv_unmatchable.py's ``VllmScheduledKv``).
The engine's hit is ``get_computed_blocks`` itself."""

from __future__ import annotations

import random

from test_kv_events import (  # noqa: F401  (vllm_kv is a fixture)
    Prompt, counters, events, free_ports, join, settle, start, tokens, vllm_kv,
)
from test_kv_unmatchable import VllmScheduledKv


class HybridKv(VllmScheduledKv):
    """One vLLM DP rank of a hybrid model: full attention and a sliding window."""

    def __init__(self, v, real, rank: int, pub_port: int, replay_port: int, *, num_blocks: int = 32):
        super().__init__(v, real, rank, pub_port, replay_port)
        self.manager = self.ve.make_hybrid_kv_cache_manager(real, self.block_size, num_blocks=num_blocks,
                                                            sliding_window=self.block_size)

    def cache_in_chunks(self, p: Prompt, first: int) -> None:
        """Prefills ``p`` in two steps, ``first`` tokens then the rest (chunked prefill):
        the second step frees the sliding-window blocks behind the window, early in the
        pool's LRU order. Then finishes it."""
        req = self.v.request.Request.from_engine_core_request(self.request(p), self.manager.block_hasher)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        assert self.manager.allocate_slots(req, first - hit, hit, blocks) is not None
        req.num_computed_tokens = first
        assert self.manager.allocate_slots(req, req.num_tokens - first) is not None
        req.num_computed_tokens = req.num_tokens
        self.manager.free(req)

    def hit(self, p: Prompt) -> int:
        """The engine's prefix hit for ``p``, in blocks: what its scheduler would reuse."""
        req = self.v.request.Request.from_engine_core_request(self.request(p), self.manager.block_hasher)
        _, hit_tokens, _ = self.manager.get_computed_blocks(req)
        return hit_tokens // self.block_size

    def leading(self, p: Prompt) -> list[int]:
        """Per KV cache group, the leading blocks of ``p`` it holds."""
        req = self.v.request.Request.from_engine_core_request(self.request(p), self.manager.block_hasher)
        pool, out = self.manager.block_pool, []
        for group in (0, 1):
            n = 0
            while n < len(req.block_hashes) and pool.get_cached_block(req.block_hashes[n], [group]) is not None:
                n += 1
            out.append(n)
        return out


def matched(d, prompts: dict[str, Prompt]) -> dict[str, list[int]]:
    """dpcoord's predicted prefix per rank (the health socket's ``prefix`` op), and
    ``state``'s blocks per rank (every group's)."""
    out = {name: d.call("health", p.query())["matched"] for name, p in prompts.items()}
    out["kv_blocks"] = [r.get("kv_blocks", {}).get("GPU", 0) for r in d.state()["ranks"]]
    return out


def test_vllm_hybrid_model_a_sliding_window_eviction_is_no_phantom(vllm_kv, real, start_daemon):
    """Rank 0 prefills ``q`` (8 blocks and a token) in two chunks, so its sliding-window
    group frees blocks 0-3 behind the window while the request runs; three more prompts
    fill the pool and evict those (and one full-attention block, q's last). Rank 1 holds
    ``q`` whole. For ``head`` (q's first 3 blocks and a token) rank 0's full-attention
    group still holds all 3 blocks, its sliding-window group none: the engine hits 0 (no
    block within the window), and so does dpcoord; following group 0 alone it would
    claim 3 and route ``head`` to a rank that recomputes it. For ``q`` itself the
    sliding window needs only block 6, which it holds: the engine hits 7 where dpcoord
    predicts 0, the documented lower bound (a miss, never a phantom)."""
    rng = random.Random(44)
    base = free_ports(4)
    pub, rep = base, base + 2
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank")
    ranks = [HybridKv(vllm_kv.v, real, r, pub, rep) for r in (0, 1)]  # vLLM adds the rank
    vllm_kv.made.extend(ranks)
    B = ranks[0].block_size
    for r, e in enumerate(ranks):
        join(d, e, r, rng)
        # join's probes are cached prompts; start from an empty cache, so the pool's
        # order (which blocks the pressure evicts) is the same every run.
        assert e.manager.reset_prefix_cache()
        e.step()
    settle("both ranks cleared", lambda: matched(d, {})["kv_blocks"], [0, 0])
    before = counters(d)

    q = Prompt(tokens(rng, 8 * B + 1))
    head = Prompt(q.tokens[: 3 * B] + (7,))
    prompts = {"head": head, "q": q}
    ranks[0].cache_in_chunks(q, 5 * B)
    for _ in range(3):
        ranks[0].cache_prompt(Prompt(tokens(rng, 3 * B + 1)))
    ranks[1].cache_prompt(q)
    for e in ranks:
        e.step()

    # The scenario: rank 0's groups disagree, and the engine's hit is their least for
    # head, more than that for q (the sliding window reaches back one block only).
    assert [ranks[0].leading(p) for p in (head, q)] == [[3, 0], [7, 0]]
    engine = {name: [e.hit(p) for e in ranks] for name, p in prompts.items()}
    assert engine == {"head": [0, 3], "q": [7, 8]}, engine
    blocks = [len(e.manager.block_pool.cached_block_hash_to_block) for e in ranks]
    settle("dpcoord's prediction", lambda: matched(d, prompts),
           {"head": engine["head"], "q": [0, 8], "kv_blocks": blocks})
    moved = {k: counters(d).get(k, 0) - before.get(k, 0) for k in (events(0, "bad_event"), events(0, "unmatchable"),
                                                                    events(0, "unknown_parent"))}
    assert set(moved.values()) == {0}, moved
