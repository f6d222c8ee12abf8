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
    Prompt, counters, events, free_ports, join, moved, settle, start, tokens, vllm_kv,
)
from test_kv_unmatchable import VllmScheduledKv


class HybridKv(VllmScheduledKv):
    """One vLLM DP rank of a hybrid model: full attention and a sliding window."""

    def __init__(self, v, real, rank: int, pub_port: int, replay_port: int, *, num_blocks: int = 32,
                 block_size: int = 16, window_block_size: int | None = None, sliding_window: int | None = None):
        super().__init__(v, real, rank, pub_port, replay_port, block_size=block_size)
        self.manager = self.ve.make_hybrid_kv_cache_manager(real, self.block_size, num_blocks=num_blocks,
                                                            sliding_window=sliding_window or self.block_size,
                                                            window_block_size=window_block_size)

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


def held_by_group(e: HybridKv, p: Prompt) -> list[list[int]]:
    """Which of ``p``'s blocks rank ``e`` holds per group, by the engine's own hashes:
    group 0's blocks of 64 (0, 1, ...), group 1's blocks of 32 that end on a multiple
    of 64 (1, 3, ...)."""
    req = e.v.request.Request.from_engine_core_request(e.request(p), e.manager.block_hasher)
    pool, h = e.manager.block_pool, req.block_hashes  # in blocks of 32, the hash size
    full = [i for i in range(len(h) // 2) if pool.get_cached_block(h[2 * i + 1], [0]) is not None]
    window = [i for i in range(1, len(h), 2) if pool.get_cached_block(h[i], [1]) is not None]
    return [full, window]


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


def test_vllm_hybrid_model_with_groups_of_different_block_sizes(vllm_kv, real, start_daemon):
    """Full attention in blocks of 64 beside a sliding window of 32 in blocks of 32: vLLM
    hashes in blocks of 32 (the GCD) and hits in multiples of 64 (the LCM). Per prompt it
    publishes group 0's blocks of 64; a partial block of 32 where the prompt's last token
    but one ends inside a block of 64 (r, 256 tokens: the unit 192-224;
    ``FullAttentionManager._cache_partial_tail_block``, a lookup entry only a
    fine-grained alignment reads); and of group 1 only the blocks of 32 that end on a
    multiple of 64 (``reachable_block_mask``: the others can serve no hit). dpcoord
    learns each group's size apart and predicts, per rank, exactly the engine's hit
    (``get_computed_blocks``, in blocks of 64, the ranks' ``kv_block_size``), before and
    after evictions; holding one size per rank (group 0's) it predicted 0 everywhere."""
    rng = random.Random(45)
    base = free_ports(4)
    pub, rep = base, base + 2
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank")
    ranks = [HybridKv(vllm_kv.v, real, r, pub, rep, num_blocks=64, block_size=64, window_block_size=32,
                      sliding_window=32) for r in (0, 1)]
    vllm_kv.made.extend(ranks)
    for r, e in enumerate(ranks):
        join(d, e, r, rng)
        assert e.manager.reset_prefix_cache()
        e.step()
    settle("both ranks cleared", lambda: matched(d, {})["kv_blocks"], [0, 0])
    before = counters(d)

    q = Prompt(tokens(rng, 4 * 64 + 1))
    r = Prompt(q.tokens[:255] + (5,))          # q's fourth block but its last token
    s = Prompt(q.tokens[:96] + tokens(rng, 80))  # diverges inside q's second block
    other = Prompt(tokens(rng, 2 * 64 + 1))
    # Asked with one more token: vLLM never hits a prompt's last token (its own r
    # hits one block short on rank 1), dpcoord counts whole blocks.
    prompts = {"q": q, "r": Prompt(r.tokens + (6,)), "s": s, "other": other}
    ranks[0].cache_prompt(q)
    ranks[1].cache_prompt(r)
    ranks[1].cache_prompt(other)
    sent = [e.step() for e in ranks]
    # The scenario: the three kinds of store, as the docstring says.
    shapes = [(ev.block_size, len(ev.block_hashes), len(ev.token_ids), ev.group_idx) for ev in sent[1]]
    assert shapes == [(64, 4, 256, 0), (32, 1, 32, 0), (32, 4, 256, 1),
                      (64, 2, 128, 0), (32, 2, 128, 1)], shapes

    engine = {name: [e.hit(p) for e in ranks] for name, p in prompts.items()}
    assert engine == {"q": [4, 3], "r": [3, 4], "s": [1, 1], "other": [0, 2]}, engine
    blocks = [len(e.manager.block_pool.cached_block_hash_to_block) for e in ranks]
    assert blocks == [4 + 4, 4 + 1 + 4 + 2 + 2]
    settle("dpcoord's prediction is the engine's hit", lambda: matched(d, prompts), {**engine, "kv_blocks": blocks})
    state = d.state()
    assert [x["kv_block_size"] for x in state["ranks"]] == [64, 64] and state["kv_block_size"] == 64
    # Every store indexed; the one partial block held, never matched.
    kv_events = {k: v for k, v in moved(counters(d), before).items() if k.startswith("dpcoord_kv_events_total")}
    assert kv_events == {events(0, "stored"): 2, events(1, "stored"): 4, events(1, "unmatchable"): 1}, kv_events
    # Pressure on rank 0's pool (64 blocks for both groups): fresh prompts evict q's
    # last two blocks of 64 from group 0 while group 1 still holds its four blocks of
    # 32; the engine's hit ends with group 0's, and so does dpcoord's prediction (no
    # phantom of an evicted block, nor one group's length for the other's).
    for _ in range(8):
        ranks[0].cache_prompt(Prompt(tokens(rng, 3 * 64 + 1)))
    ranks[0].cache_prompt(Prompt(tokens(rng, 161)))
    ranks[0].step()
    assert held_by_group(ranks[0], q) == [[0, 1], [1, 3, 5, 7]]
    engine = {name: [e.hit(p) for e in ranks] for name, p in prompts.items()}
    assert engine == {"q": [2, 3], "r": [2, 4], "s": [1, 1], "other": [0, 2]}, engine
    blocks = [len(e.manager.block_pool.cached_block_hash_to_block) for e in ranks]
    settle("dpcoord's prediction after evictions", lambda: matched(d, prompts), {**engine, "kv_blocks": blocks})
    kv_events = {k: v for k, v in moved(counters(d), before).items() if k.startswith("dpcoord_kv_events_total")}
    # Rank 0: q's two stores, two per pressure prompt, and group 0's two evictions.
    assert kv_events == {events(0, "stored"): 2 + 9 * 2, events(0, "removed"): 2,
                         events(1, "stored"): 4, events(1, "unmatchable"): 1}, kv_events
