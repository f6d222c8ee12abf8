"""Blocks whose cache identity in the engine is more than the tokens, LoRA name and salt
a route query carries (docs/prefix-cache.md, "Unmatchable blocks"): dpcoord holds them
but never matches them, so ``prefix`` never claims a block the engine would not hit (a
miss, never a phantom), and the event counts ``dpcoord_kv_events_total{result=
"unmatchable"}``.

vLLM 0.33.0, driven as its scheduler drives it: the real ``KVCacheManager``
(vllm_engine.make_kv_cache_manager: one full-attention group, prefix caching and KV
events on, the engine core's request block hasher), requests built from an
``EngineCoreRequest`` with ``Request.from_engine_core_request``, prefilled through
``get_computed_blocks`` + ``allocate_slots`` (which caches the full blocks and queues
their ``BlockStored``) and released with ``free``; the step's events from
``KVCacheManager.take_events`` published through the ``ZmqEventPublisher`` that
``EventPublisherFactory`` builds (test_kv_events.py's fixture and helpers).

SGLang 0.5.23's default tree cache, ``UnifiedRadixCache`` (FULL component, Python tree
core; test_kv_events.py's ``sglang_kv`` with ``unified=True``), published by the
scheduler's ``SchedulerKvEventsPublisher``: a request's
``extra_key`` without LoRA namespaces the tree but reaches no event field, so dpcoord
cannot tell its blocks apart; that test pins the limit as it stands."""

from __future__ import annotations

import itertools
import random
import time
from array import array
from collections import Counter
from dataclasses import dataclass

from test_kv_events import (  # noqa: F401  (vllm_kv, sglang_kv are fixtures)
    Prompt, Values, Wire, batches, counters, differ, events, free_ports, join, settle_counters, start, tokens,
    sglang_kv, vllm_kv,
)


@dataclass(frozen=True)
class MmPrompt(Prompt):
    """A prompt with an image: ``length`` placeholder tokens at ``offset`` stand for the
    image ``identifier``. The route query carries the tokens only (``Prompt.query``)."""

    image: tuple[str, int, int] | None = None


class VllmScheduledKv:
    """One vLLM DP rank's KV side as the scheduler owns it: the real KVCacheManager and
    the real publisher."""

    _ids = itertools.count()

    def __init__(self, v, real, rank: int, pub_port: int, replay_port: int, *, lookahead: int = 0,
                 block_size: int = 16):
        import vllm_engine

        self.v, self.real, self.ve, self.rank, self.block_size = v, real, vllm_engine, rank, block_size
        self.manager = vllm_engine.make_kv_cache_manager(real, block_size, num_hash_lookahead_tokens=lookahead)
        config = v.config.KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=10_000,
        )
        self.publisher = v.events.EventPublisherFactory.create(config, data_parallel_rank=rank)
        self.wire = Wire(self.publisher)
        self.sent: Counter[str] = Counter()

    def request(self, p: Prompt):
        mm = None
        if getattr(p, "image", None):
            identifier, offset, length = p.image
            mm = [self.ve.image_feature(self.real, identifier, offset, length)]
        core = self.ve.make_request(self.real, f"u{self.rank}-{next(self._ids)}", list(p.tokens),
                                    lora_name=p.lora, cache_salt=p.salt, mm_features=mm)
        return core

    def cache_prompt(self, p: Prompt) -> None:
        """Prefills ``p`` (prefix hits first) and finishes it."""
        req = self.ve.schedule_prompt(self.real, self.manager, self.request(p))
        self.manager.free(req)

    def step(self) -> list:
        evs = self.manager.take_events()
        if evs:
            self.publisher.publish(self.v.events.KVEventBatch(ts=time.time(), events=evs))
            self.sent.update(type(e).__name__ for e in evs)
        return evs

    def held(self, p: Prompt) -> int:
        """The leading blocks of ``p`` this rank's prefix cache holds, by the engine's own
        hashes of ``p`` (lookahead and image included)."""
        req = self.v.request.Request.from_engine_core_request(self.request(p), self.manager.block_hasher)
        pool, n = self.manager.block_pool, 0
        while n < len(req.block_hashes) and pool.get_cached_block(req.block_hashes[n], [0]) is not None:
            n += 1
        return n

    def blocks(self) -> int:
        return len(self.manager.block_pool.cached_block_hash_to_block)


def engine(vllm_kv, real, port: int, **kw) -> VllmScheduledKv:
    """A rank-0 engine; vllm_kv (test_kv_events.py) shuts the publisher down at the end."""
    e = VllmScheduledKv(vllm_kv.v, real, 0, port, port + 1, **kw)
    vllm_kv.made.append(e)
    return e


def joined(c: dict[str, float]) -> bool:
    """dpcoord applied a BlockStored from rank 0, keyed or not."""
    return c.get(events(0, "stored"), 0) + c.get(events(0, "unmatchable"), 0) >= 1


def test_vllm_lookahead_block_hashes_are_never_matched(vllm_kv, real, start_daemon):
    """EAGLE with lookahead block hashes (``VllmConfig.num_hash_lookahead_tokens``, here
    1): each block's hash covers the token after it, and the engine hashes a block only
    once that token exists. ``p`` (33 tokens) is cached as 2 blocks; ``q`` shares p's
    first 32 tokens and then differs, so the engine hits block 0 only (block 1's hash
    takes q's token 32). Keyed by tokens alone, dpcoord would claim 2 for q."""
    rng = random.Random(41)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = engine(vllm_kv, real, port, lookahead=1)
    B = e.block_size
    join(d, e, 0, rng, joined)
    before = counters(d)

    p = Prompt(tokens(rng, 2 * B + 1))
    q = Prompt(p.tokens[: 2 * B] + (p.tokens[2 * B] + 1,))
    e.cache_prompt(p)
    [stored] = e.step()
    assert (len(stored.block_hashes), stored.lookahead_token_ids) == (2, [[p.tokens[B]], [p.tokens[2 * B]]])
    differ("p cached with lookahead hashes", d, [e], {"p": p, "q": q},
           {"p": [2], "q": [1]}, {"p": [0], "q": [0], "kv_blocks": [{"GPU": e.blocks()}]})
    settle_counters(d, before, {batches("ok"): 1, events(0, "unmatchable"): 1})


def test_vllm_blocks_of_an_image_are_never_matched(vllm_kv, real, start_daemon):
    """Two requests with the same token ids and different images (the placeholder tokens
    are the same): vLLM's hash of every block from the image's first on covers the image
    identifier (``extra_keys``: an ``(identifier, offset)`` pair). ``cat`` is cached; a
    query for ``dog`` carries the same tokens. The text block before the image is keyed
    (both hit it); from the image on dpcoord matches nothing, where tokens alone would
    claim all 4 blocks for ``dog``."""
    rng = random.Random(42)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = engine(vllm_kv, real, port)
    B = e.block_size
    join(d, e, 0, rng)
    before = counters(d)

    text = tokens(rng, 4 * B + 3)
    placeholder = (9999,) * (B + 4)  # the image's tokens: blocks 1 and 2
    toks = text[:B] + placeholder + text[2 * B + 4:]
    cat = MmPrompt(toks, image=("img-cat", B, B + 4))
    dog = MmPrompt(toks, image=("img-dog", B, B + 4))
    e.cache_prompt(cat)
    [stored] = e.step()
    assert stored.extra_keys[:3] == [None, (("img-cat", 0),), (("img-cat", -B),)], stored.extra_keys
    differ("cat's blocks cached", d, [e], {"cat": cat, "dog": dog},
           {"cat": [4], "dog": [1]}, {"cat": [1], "dog": [1], "kv_blocks": [{"GPU": e.blocks()}]})
    # A later request continuing cat's chain (its parent is unmatchable) is unmatchable too.
    longer = MmPrompt(toks + tokens(rng, 2 * B), image=("img-cat", B, B + 4))
    e.cache_prompt(longer)
    [more] = e.step()
    assert more.parent_block_hash == stored.block_hashes[-1]
    differ("cat's chain continued", d, [e], {"longer": longer},
           {"longer": [6]}, {"longer": [1], "kv_blocks": [{"GPU": e.blocks()}]})
    settle_counters(d, before, {batches("ok"): 2, events(0, "unmatchable"): 2})


def test_sglang_extra_key_reaches_no_event_field_a_known_limit(sglang_kv, start_daemon):
    """SGLang keys its radix tree by ``(extra_key, tokens)`` (``RadixKey``; a request's
    ``extra_key`` without LoRA, e.g. a caller's classification), so a store under
    ``extra_key="ctx-1"`` is never hit by the same tokens without it. Its ``BlockStored``
    is byte for byte a plain store's (``compute_node_event_hash_values``: "Hash tokens
    with the legacy salt seed; omit extra_key"; no field names it): nothing in the event
    lets dpcoord keep it out, and it claims the blocks for a plain prompt the engine
    would miss (docs/prefix-cache.md, "Limits, known"). If SGLang ever publishes the
    namespace, the equality below fails first."""
    rng = random.Random(43)
    port = free_ports(4)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = sglang_kv(0, 1, port, port + 1, page_size=16, unified=True)
    P = e.block_size
    join(d, e, 0, rng)
    before = counters(d)

    plain = Prompt(tokens(rng, 4 * P))
    radix, params = e.s.radix, e.s.params
    e.cache.insert(params.InsertParams(key=radix.RadixKey(array("q", plain.tokens), extra_key="ctx-1"),
                                       value=Values(range(4 * P))))
    [stored] = e.step()
    twin = sglang_kv(0, 1, port + 2, port + 3, page_size=P, unified=True)  # never published
    twin.cache.insert(params.InsertParams(key=radix.RadixKey(array("q", plain.tokens)), value=Values(range(4 * P))))
    assert stored == twin.recorder._queue[-1], "SGLang's event for an extra_key store now differs from a plain one"
    differ("stored under extra_key ctx-1", d, [e], {"plain": plain}, {"plain": [0]}, {"plain": [4]})
    settle_counters(d, before, {batches("ok"): 1, events(0, "stored"): 1})
