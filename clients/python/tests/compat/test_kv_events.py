"""dpcoord's KV-cache index (PROTOCOL §11a, the health socket's ``prefix`` op, the
``dpcoord_kv_*`` metrics) fed by the engines' own event publishers, with events the
engines' own prefix caches produce, and nothing of dpcoord's in between.

vLLM 0.33.0: ``vllm.v1.core.block_pool.BlockPool`` (prefix caching and KV-cache events
on), driven the way ``KVCacheManager`` drives it (prefix hits touched, new blocks
allocated, full blocks cached chunk by chunk, requests freed tail first, eviction under
allocation pressure, ``reset_prefix_cache``), its events taken with ``take_events()``
and published as the scheduler does, ``KVEventBatch(ts, events)``, through the
``ZmqEventPublisher`` that vLLM's ``EventPublisherFactory`` builds from a
``KVEventsConfig``.

SGLang 0.5.23: ``RadixCache`` in its own memory-pool-free mode (``create_simulated``)
with KV events on, whose ``KVCacheEventRecorder`` records the events, and the
scheduler's ``SchedulerKvEventsPublisher``, which builds SGLang's ``ZmqEventPublisher``
from a ``--kv-events-config`` string and publishes ``take_events()`` per step.

Stubbed: the heavy imports (standins.py); SGLang's JIT-compiled page hash (a Python
port, standins.native_page_hash); which parallel rank an SGLang scheduler is (as in
test_sglang_load_publisher.py); and one decision of vLLM's publisher, which binds only
wildcard (``tcp://*``) and ipc endpoints: here it binds the loopback endpoint it is given,
so the suite stays off the network. Ports, rank offsets, framing, seq numbers, replay
buffers and payloads are the engines' own.

What the tests hold dpcoord to: after every step, for each prompt, ``prefix`` answers,
for each rank, the number of leading whole blocks that rank's prefix cache holds (asked
of the engine itself: vLLM's ``get_cached_block``, SGLang's ``match_prefix``), ``state``
shows each rank's block count, and the ``dpcoord_kv_*`` counters moved by exactly what
was published."""

from __future__ import annotations

import importlib
import logging
import random
import re
import socket
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable

import pytest

from conftest import DEADLINE, eventually
from record import record

# The ZmqEventPublisher of vLLM 0.33 (and SGLang 0.5.23's copy of it) races
# its own thread on shutdown(): it clears `_running` before queueing the stop
# sentinel, so an idle thread can exit first and leave the sentinel behind,
# and shutdown warns "Queue still has 1 items" after a 1 s wait. Nothing is
# lost (the sentinel is the item); the warning is kept out of a passing run.
for publisher_module in ("vllm.distributed.kv_events", "sglang.srt.disaggregation.kv_events"):
    logging.getLogger(publisher_module).setLevel(logging.ERROR)

# -- dpcoord side ---------------------------------------------------------------------

SAMPLE = re.compile(r"^(dpcoord_kv_[a-z_]+)(?:\{(.*)\})?\s+(\S+)$")
LABEL = re.compile(r'([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"')
GAUGES = {"dpcoord_kv_blocks"}


def kv_series(d) -> dict[str, float]:
    """Every ``dpcoord_kv_*`` sample of ``/metrics``, keyed ``name{label=value,...}`` with the labels sorted."""
    out = {}
    for line in d.metrics().splitlines():
        m = SAMPLE.match(line)
        if m:
            labels = ",".join(f"{k}={v}" for k, v in sorted(LABEL.findall(m.group(2) or "")))
            out[f"{m.group(1)}{{{labels}}}"] = float(m.group(3))
    return out


def key(name: str, **labels: Any) -> str:
    return f"{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}"


def events(rank: int, result: str) -> str:
    """``dpcoord_kv_events_total`` counts events, not the blocks they list (§12: "KV
    events applied or dropped"): a BlockStored of 4 blocks counts 1."""
    return key("dpcoord_kv_events_total", dp_rank=rank, result=result)


def resets(rank: int, cause: str) -> str:
    return key("dpcoord_kv_index_resets_total", dp_rank=rank, cause=cause)


def batches(result: str) -> str:
    return key("dpcoord_kv_batches_total", result=result)


def replays(result: str) -> str:
    return key("dpcoord_kv_replays_total", result=result)


GAPS = key("dpcoord_kv_event_gaps_total")


def counters(d) -> dict[str, float]:
    return {k: v for k, v in kv_series(d).items() if k.split("{")[0] not in GAUGES}


def moved(after: dict[str, float], before: dict[str, float], ignore: tuple[str, ...] = ()) -> dict[str, float]:
    """The counters that moved between two snapshots, by how much (a series that appeared counts from 0)."""
    out = {}
    for k, v in after.items():
        if k in ignore:
            continue
        if v != before.get(k, 0.0):
            out[k] = v - before.get(k, 0.0)
    return out


def settle(what: str, observe: Callable[[], Any], expected: Any, deadline: float = DEADLINE) -> None:
    """Polls ``observe`` until it equals ``expected``; on the deadline fails showing both."""
    last: list[Any] = [None]

    def done():
        last[0] = observe()
        return last[0] == expected

    end = time.monotonic() + deadline
    while not done():
        if time.monotonic() > end:
            pytest.fail(f"{what}: after {deadline} s dpcoord shows\n  {last[0]!r}\nexpected\n  {expected!r}")
        time.sleep(0.02)


def settle_counters(d, before: dict[str, float], expected: dict[str, float], ignore: tuple[str, ...] = ()) -> None:
    settle("dpcoord_kv_* counters moved by", lambda: moved(counters(d), before, ignore), expected)


@dataclass(frozen=True)
class Prompt:
    tokens: tuple[int, ...]
    lora: str | None = None
    salt: str | None = None

    def query(self) -> dict[str, Any]:
        q: dict[str, Any] = {"v": 1, "op": "prefix", "tokens": list(self.tokens)}
        if self.lora is not None:
            q["lora"] = self.lora
        if self.salt is not None:
            q["salt"] = self.salt
        return q


def prefix(d, p: Prompt) -> dict[str, Any]:
    reply = d.call("health", p.query())
    assert reply.get("ok") is True, f"prefix refused: {reply}"
    return reply


def dpcoord_view(d, prompts: dict[str, Prompt]) -> dict[str, Any]:
    """What dpcoord says: per prompt ``matched`` (one entry per rank), per rank ``kv_blocks``
    from ``state`` and the ``dpcoord_kv_blocks{medium="GPU"}`` gauge."""
    view: dict[str, Any] = {name: prefix(d, p)["matched"] for name, p in prompts.items()}
    ranks = d.state()["ranks"]
    view["kv_blocks"] = [r.get("kv_blocks", "<absent>") for r in ranks]
    series = kv_series(d)
    view["gauge"] = [
        series.get(key("dpcoord_kv_blocks", dp_rank=r, medium="GPU"), "<absent>") for r in range(len(ranks))
    ]
    return view


def engine_view(engines: list, prompts: dict[str, Prompt]) -> dict[str, Any]:
    """What the engines hold, in the shape of :func:`dpcoord_view`."""
    view: dict[str, Any] = {name: [e.held(p) for e in engines] for name, p in prompts.items()}
    view["kv_blocks"] = [{"GPU": e.blocks()} if e.blocks() else {} for e in engines]
    view["gauge"] = [float(e.blocks()) for e in engines]
    return view


def agree(what: str, d, engines: list, prompts: dict[str, Prompt],
          expected: dict[str, list[int]] | None = None, deadline: float = DEADLINE) -> None:
    """dpcoord's index equals what the engines hold. ``expected`` (prompt -> blocks held
    per rank) pins the engines' own answer too, so the scenario is the one intended."""
    truth = engine_view(engines, prompts)
    if expected is not None:
        assert {k: truth[k] for k in expected} == expected, f"{what}: the engines hold {truth}"
    settle(what, lambda: dpcoord_view(d, prompts), truth, deadline)


def differ(what: str, d, engines: list, prompts: dict[str, Prompt],
           engine: dict[str, Any], dpcoord: dict[str, Any]) -> None:
    """Where dpcoord knowingly holds less than the engine (docs/prefix-cache.md, "Limits,
    known": a miss, never a phantom): the engines hold ``engine`` and dpcoord shows
    ``dpcoord`` (each a partial view: the keys given are compared)."""
    truth = engine_view(engines, prompts)
    assert {k: truth[k] for k in engine} == engine, f"{what}: the engines hold {truth}"
    settle(what, lambda: {k: v for k, v in dpcoord_view(d, prompts).items() if k in dpcoord}, dpcoord)


def free_ports(n: int) -> int:
    """A base port with ``n`` consecutive free loopback ports."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    pytest.fail(f"no {n} consecutive free loopback ports")


def tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 150_000) for _ in range(n))


class Wire:
    """Stands between a real publisher and its PUB socket: the batches whose seq is in
    ``drop`` are not sent (the publisher still buffers them for replay, as it does for
    a batch the network lost)."""

    def __init__(self, publisher):
        self.sock = publisher._pub
        self.drop: set[int] = set()
        self.dropped: list[int] = []
        self.sent: list[bytes] = []  # the payloads sent, in order
        publisher._pub = self

    def send_multipart(self, frames, *args, **kwargs):
        seq = int.from_bytes(frames[1], "big")
        if seq in self.drop:
            self.drop.discard(seq)
            self.dropped.append(seq)
            return None
        record("kv_batch", bytes(frames[2]))
        self.sent.append(bytes(frames[2]))
        return self.sock.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def join(d, engine, rank: int, rng: random.Random, joined: Callable[[dict[str, float]], bool] | None = None) -> None:
    """Until dpcoord's subscription to ``engine``'s publisher is wired (PUB drops what it
    sends before), the engine keeps caching fresh one-block prompts and publishing each
    step, until dpcoord has applied one of them on ``rank`` (or ``joined(counters)``)."""
    joined = joined or (lambda c: c.get(events(rank, "stored"), 0) >= 1)

    def probe():
        engine.cache_prompt(Prompt(tokens(rng, engine.block_size + 1)))
        engine.step()
        return joined(counters(d))

    eventually(f"dpcoord takes a batch from rank {rank}'s publisher", probe, interval=0.02)
    # A publisher's first batch asks for a replay from 0; counters move until it ends,
    # when the rank's index is exact again (in `state` and in the gauge, which follows it).
    degraded = key("dpcoord_kv_index_degraded", dp_rank=rank)
    eventually(f"rank {rank}'s index exact",
               lambda: d.state()["ranks"][rank].get("kv_index") == "exact" and kv_series(d).get(degraded) == 0)
    drain(d, engine, rank)


def drain(d, engine, rank: int) -> None:
    """Until dpcoord has applied every batch ``engine`` published so far: ``joined`` can
    hold from a batch applied while the probe's last one is still on its way, and a test
    that snapshots the counters then would see that batch counted as its own. The engine's
    publisher sends a removal of a block nobody stored (its module's own event classes);
    one publisher's batches apply in order, so once dpcoord counts that removal
    (``unknown_block``), everything before it has been counted."""
    mod = importlib.import_module(type(engine.publisher).__module__)
    unknown = events(rank, "unknown_block")
    seen = counters(d).get(unknown, 0)
    marker = mod.BlockRemoved(block_hashes=[random.getrandbits(62)], medium="GPU")
    engine.publisher.publish(mod.KVEventBatch(ts=time.time(), events=[marker]))
    if hasattr(engine, "seq"):  # the engines that count their batches, for Wire.drop
        engine.seq += 1
    eventually(f"rank {rank}'s publisher drained", lambda: counters(d).get(unknown, 0) == seen + 1)


def start(start_daemon, dp: int, pub: str, replay: str | None, *extra: str):
    args = ["--dp-size", str(dp), "--kv-events-connect", pub]
    if replay is not None:
        args += ["--kv-events-replay", replay]
    return start_daemon(*args, *extra)


# -- vLLM -----------------------------------------------------------------------------


@pytest.fixture
def vllm_kv(real, monkeypatch):
    v = SimpleNamespace(
        **{
            name: importlib.import_module(mod)
            for name, mod in (
                ("events", "vllm.distributed.kv_events"),
                ("config", "vllm.config.kv_events"),
                ("block_pool", "vllm.v1.core.block_pool"),
                ("utils", "vllm.v1.core.kv_cache_utils"),
                ("request", "vllm.v1.request"),
                ("sampling", "vllm.sampling_params"),
                ("lora", "vllm.lora.request"),
                ("hashing", "vllm.utils.hashing"),
            )
        }
    )
    # vLLM binds only tcp://* and ipc endpoints (and connects to the rest); bind the loopback one.
    monkeypatch.setattr(v.events.ZmqEventPublisher, "_is_bind_endpoint", staticmethod(lambda endpoint: True))
    v.hash_fn = v.hashing.get_hash_fn_by_name("sha256")  # --prefix-caching-hash-algo's default
    v.utils.init_none_hash(v.hash_fn)
    made: list[VllmEngine] = []

    def make(*args, **kwargs) -> VllmEngine:
        e = VllmEngine(v, *args, **kwargs)
        made.append(e)
        return e

    make.v, make.made = v, made  # for engines built otherwise (test_kv_unmatchable.py)
    yield make
    for e in made:
        e.publisher.shutdown()


class VllmEngine:
    """One vLLM DP rank's KV side: the real BlockPool and the real publisher."""

    def __init__(self, v, rank: int, pub_port: int, replay_port: int, *, buffer_steps: int = 10_000,
                 block_size: int = 16, num_blocks: int = 512):
        self.v, self.rank, self.block_size = v, rank, block_size
        self.pool = v.block_pool.BlockPool(num_blocks, enable_caching=True, hash_block_size=block_size,
                                           enable_kv_cache_events=True)
        self.hasher = v.utils.get_request_block_hasher(block_size, v.hash_fn)
        # The engine's --kv-events-config; the factory offsets both ports by the DP rank.
        config = v.config.KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=buffer_steps,
        )
        self.publisher = v.events.EventPublisherFactory.create(config, data_parallel_rank=rank)
        assert isinstance(self.publisher, v.events.ZmqEventPublisher)
        assert self.publisher._endpoint == f"tcp://127.0.0.1:{pub_port + rank}"
        self.wire = Wire(self.publisher)
        self.seq = 0  # the seq of the next batch published
        self.sent: Counter[str] = Counter()  # events published, by type
        self.running: dict[str, tuple[Any, list]] = {}  # request id -> (request, blocks)
        self.ids = 0

    # requests, as KVCacheManager drives the pool
    def request(self, p: Prompt):
        self.ids += 1
        lora = self.v.lora.LoRARequest(p.lora, 1, f"/adapters/{p.lora}") if p.lora else None
        return self.v.request.Request(
            f"r{self.rank}-{self.ids}", list(p.tokens), self.v.sampling.SamplingParams(max_tokens=1), None,
            lora_request=lora, cache_salt=p.salt, block_hasher=self.hasher,
        )

    def schedule(self, p: Prompt):
        """Admits a request: its prefix hits are touched (held by it). As in
        KVCacheManager.get_computed_blocks, a hit stops one token short of the prompt's
        end (the last token is computed again for its logits)."""
        req = self.request(p)
        hits = min(self.held(p, req), (len(p.tokens) - 1) // self.block_size)
        cached = [self.pool.get_cached_block(h, [0])[0] for h in req.block_hashes[:hits]]
        self.pool.touch(cached)
        self.running[req.request_id] = (req, cached)
        return req

    def compute(self, req, upto: int | None = None) -> None:
        """The request's full blocks up to ``upto`` are computed: allocated and cached."""
        _, blocks = self.running[req.request_id]
        upto = len(req.block_hashes) if upto is None else upto
        done = len(blocks)
        blocks.extend(self.pool.get_new_blocks(upto - done))
        self.pool.cache_full_blocks(req, blocks, done, upto, self.block_size, 0)

    def finish(self, req) -> list:
        """Frees the request's blocks, tail first (the tail is evicted first)."""
        _, blocks = self.running.pop(req.request_id)
        self.pool.free_blocks(reversed(blocks))
        return blocks

    def cache_prompt(self, p: Prompt):
        req = self.schedule(p)
        self.compute(req)
        return self.finish(req)

    def pressure(self, evictions: int) -> None:
        """Allocates (then frees) blocks until ``evictions`` cached blocks were evicted."""
        taken = []
        removed = lambda: sum(isinstance(e, self.v.events.BlockRemoved) for e in self.pool.kv_event_queue)
        start = removed()
        while removed() - start < evictions:
            taken += self.pool.get_new_blocks(1)
        self.pool.free_blocks(taken)

    def step(self, drop: bool = False) -> list:
        """Publishes the step's events as the scheduler does (nothing when there are none)."""
        evs = self.pool.take_events()
        if evs:
            if drop:
                self.wire.drop.add(self.seq)
            self.publisher.publish(self.v.events.KVEventBatch(ts=time.time(), events=evs))
            self.seq += 1
            self.sent.update(type(e).__name__ for e in evs)
        return evs

    # what the engine holds
    def held(self, p: Prompt, req=None) -> int:
        req = req or self.request(p)
        n = 0
        while n < len(req.block_hashes) and self.pool.get_cached_block(req.block_hashes[n], [0]) is not None:
            n += 1
        return n

    def blocks(self) -> int:
        return len(self.pool.cached_block_hash_to_block)


@pytest.mark.parametrize("hashes", ["int", "bytes"])
def test_vllm_block_pool_stores_evictions_and_clear(vllm_kv, start_daemon, monkeypatch, hashes):
    # vLLM publishes the low 64 bits of its 32-byte block hashes as uint64, or the raw
    # 32 bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0.
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if hashes == "int" else "0")
    rng = random.Random(12)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = vllm_kv(0, port, port + 1)
    B = e.block_size
    a = Prompt(tokens(rng, 4 * B + 3))  # 4 whole blocks and a partial one (never cached)
    prompts = {
        "a": a,
        "b": Prompt(a.tokens[: 2 * B] + tokens(rng, 2 * B + 5)),  # a's first 2 blocks, then its own
        "a+lora+salt": Prompt(a.tokens, lora="sql-lora", salt="tenant-7"),
        "a+salt": Prompt(a.tokens, salt="tenant-7"),
        "a+lora": Prompt(a.tokens, lora="sql-lora"),
    }
    before_any = prefix(d, a)
    assert before_any["matched"] == [0]  # nothing known, and no block size learned yet
    assert d.state().get("kv_block_size", "<absent>") is None

    join(d, e, 0, rng)
    assert e.pool.reset_prefix_cache()  # (an RLHF weight update): a clean start on both sides
    e.step()
    agree("after the engine's reset", d, [e], prompts, {"a": [0]})
    assert d.state()["kv_block_size"] == B
    assert prefix(d, a)["blocks"] == 4
    before, seq0, sent0 = counters(d), e.seq, e.sent.copy()

    # Stores: a prompt; a second sharing its first two blocks (prefix hits, then a store
    # whose parent is a's block 1); the same tokens under a LoRA and a cache salt, and
    # under the salt alone (vLLM keys them apart: other hashes, extra_keys per block).
    ra = e.schedule(prompts["a"])
    e.compute(ra)
    e.step()
    agree("a stored", d, [e], prompts, {"a": [4], "b": [2], "a+salt": [0]})
    rb = e.schedule(prompts["b"])
    e.compute(rb)
    [stored_b] = e.step()
    assert stored_b.parent_block_hash is not None and len(stored_b.block_hashes) == 2
    rc = e.schedule(prompts["a+lora+salt"])
    e.compute(rc)
    rd = e.schedule(prompts["a+salt"])
    e.compute(rd)
    evs = e.step()
    assert [ev.extra_keys[0] for ev in evs] == [("sql-lora", "tenant-7"), ("tenant-7",)]
    assert [ev.lora_name for ev in evs] == ["sql-lora", None]
    agree("a, b, a under LoRA + salt, a under the salt", d, [e], prompts,
          {"a": [4], "b": [4], "a+lora+salt": [4], "a+salt": [4], "a+lora": [0]})

    # Evictions: all four finish (blocks freed tail first, still cached), then allocation
    # pressure evicts the blocks freed first: a's blocks 3 and 2, then b's block 3.
    for r in (ra, rb, rc, rd):
        e.finish(r)
    assert e.step() == []
    e.pressure(3)
    assert len(e.step()) == 3  # vLLM removes one hash per event
    agree("3 blocks evicted", d, [e], prompts, {"a": [2], "b": [3], "a+lora+salt": [4]})
    # A KV connector evicts a's first block by id: nothing of a or b leads any more, though
    # a's block 1 and b's block 2 are still held.
    [a0] = [blk.block_id for blk in e.pool.blocks if blk.block_hash is not None
            and e.v.utils.get_block_hash(blk.block_hash) == e.request(a).block_hashes[0]]
    e.pool.evict_blocks({a0})
    e.step()
    agree("a's first block evicted", d, [e], prompts, {"a": [0], "b": [0], "a+salt": [4]})
    assert e.blocks() == 10
    e.pressure(4)
    e.step()
    agree("4 more evicted", d, [e], prompts, {"a": [0], "b": [0], "a+lora+salt": [2], "a+salt": [4]})

    # kv_cache_report_mode "full": a prefix hit publishes its blocks again. Held once.
    rd = e.schedule(prompts["a+salt"])
    e.pool.emit_cached_block_events(rd, 4, B, 0)
    e.finish(rd)
    assert len(e.step()) == 1
    agree("a+salt reported again", d, [e], prompts, {"a+salt": [4]})

    # A clear (reset_prefix_cache: AllBlocksCleared), then a store after it.
    assert e.pool.reset_prefix_cache()
    e.step()
    agree("after AllBlocksCleared", d, [e], prompts, {"a": [0], "a+salt": [0]})
    e.cache_prompt(prompts["b"])
    e.step()
    agree("b stored after the clear", d, [e], prompts, {"a": [2], "b": [4]})
    assert (e.seq - seq0, e.sent - sent0) == (9, Counter(BlockStored=6, BlockRemoved=8, AllBlocksCleared=1))
    settle_counters(d, before, {
        batches("ok"): 9,
        events(0, "stored"): 6,
        events(0, "removed"): 8,
        events(0, "cleared"): 1,
        resets(0, "cleared"): 1,
    })


def test_vllm_dropped_batch_is_recovered_by_replay(vllm_kv, start_daemon):
    rng = random.Random(13)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = vllm_kv(0, port, port + 1)
    B = e.block_size
    long = Prompt(tokens(rng, 6 * B + 1))
    prompts = {"long": long, "other": Prompt(tokens(rng, 2 * B))}
    join(d, e, 0, rng)
    agree("joined", d, [e], prompts, {"long": [0]})  # every probe replayed or received: the index equals the pool
    before = counters(d)

    # Chunked prefill: blocks 0-1, then 2-3 (that batch is lost on the wire; the publisher
    # keeps it for replay), then 4-5, whose parent is block 3. dpcoord must replay the
    # lost batch before it applies the next one.
    r = e.schedule(long)
    e.compute(r, 2)
    e.step()
    agree("chunk 1 stored", d, [e], prompts, {"long": [2]})
    e.compute(r, 4)
    e.step(drop=True)
    e.compute(r, 6)
    [chunk3] = e.step()
    assert chunk3.parent_block_hash is not None
    agree("the lost chunk replayed", d, [e], prompts, {"long": [6]})
    assert e.wire.dropped == [e.seq - 2]
    # The same again for a batch of removals (a KV connector evicts long's last two
    # blocks), followed by a store.
    blocks = e.finish(r)
    e.pool.evict_blocks({blocks[4].block_id, blocks[5].block_id})
    e.step(drop=True)
    e.cache_prompt(prompts["other"])
    e.step()
    agree("the lost removals replayed", d, [e], prompts, {"long": [4], "other": [2]})
    settle_counters(d, before, {
        events(0, "stored"): 4,
        events(0, "removed"): 2,
        GAPS: 2,
        replays("recovered"): 2,
    }, ignore=(batches("ok"), batches("stale")))  # a replayed batch that also arrived live: either


def test_vllm_drop_beyond_the_replay_buffer_clears_the_rank(vllm_kv, start_daemon):
    rng = random.Random(14)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = vllm_kv(0, port, port + 1, buffer_steps=1)  # the publisher keeps the last batch only
    B = e.block_size
    x, y, z = Prompt(tokens(rng, 6 * B + 1)), Prompt(tokens(rng, 3 * B)), Prompt(tokens(rng, 2 * B + 1))
    prompts = {"x": x, "y": y, "z": z}
    join(d, e, 0, rng)
    assert e.pool.reset_prefix_cache()  # probes missed before the join are beyond the buffer: start clean
    e.step()
    agree("joined", d, [e], prompts, {"x": [0]})
    rx = e.schedule(x)
    e.compute(rx, 4)
    e.step()
    agree("x's first 4 blocks stored", d, [e], prompts, {"x": [4]})
    before = counters(d)

    # y's store is lost on the wire and the next batch pushes it out of the buffer:
    # replay cannot cover the gap, so dpcoord forgets rank 0 (a miss costs a prefill; a
    # phantom costs a wrong placement) and applies the live batch on a clean index:
    # z (no parent) is indexed, x's blocks 4-5 (parent: block 3, forgotten) are not.
    e.cache_prompt(y)
    e.step(drop=True)
    e.compute(rx, 6)
    e.cache_prompt(z)
    e.finish(rx)
    stored = e.step()
    assert [(ev.parent_block_hash is None, len(ev.block_hashes)) for ev in stored] == [(False, 2), (True, 2)]
    settle("dpcoord after the unrecoverable gap", lambda: dpcoord_view(d, prompts),
           {"x": [0], "y": [0], "z": [2], "kv_blocks": [{"GPU": 2}], "gauge": [2.0]})
    assert engine_view([e], prompts) == {"x": [6], "y": [3], "z": [2], "kv_blocks": [{"GPU": 11}], "gauge": [11.0]}
    settle_counters(d, before, {
        GAPS: 1,
        replays("incomplete"): 1,
        resets(0, "gap"): 1,
        events(0, "stored"): 1,
        events(0, "unknown_parent"): 1,
    }, ignore=(batches("ok"), batches("stale")))
    # The rank is indexed again from there on.
    e.cache_prompt(x)  # x's 6 blocks are prefix hits: incremental reporting publishes nothing
    assert e.step() == []
    w = Prompt(z.tokens[: 2 * B] + tokens(rng, B))
    e.cache_prompt(w)
    e.step()
    prompts["w"] = w
    settle("dpcoord indexes rank 0 again", lambda: dpcoord_view(d, prompts),
           {"x": [0], "y": [0], "z": [2], "w": [3], "kv_blocks": [{"GPU": 3}], "gauge": [3.0]})


def test_vllm_two_dp_ranks_on_port_plus_rank(vllm_kv, start_daemon):
    """Rank r's publisher binds port + r and replay port + r (vLLM offsets both by the DP
    rank); dpcoord subscribes with the ``+rank`` form, and only after the engines have
    published: its first batch from each asks for a replay from seq 0."""
    rng = random.Random(15)
    base = free_ports(4)
    pub, rep = base, base + 2
    engines = [vllm_kv(r, pub, rep) for r in (0, 1)]
    B = engines[0].block_size
    shared = Prompt(tokens(rng, 4 * B))
    prompts = {"shared": shared, "only0": Prompt(tokens(rng, 3 * B + 2)), "only1": Prompt(tokens(rng, 5 * B))}
    engines[0].cache_prompt(shared)
    engines[0].cache_prompt(prompts["only0"])
    engines[1].cache_prompt(shared)
    engines[1].cache_prompt(prompts["only1"])
    for e in engines:
        e.step()  # nobody subscribed yet: PUB drops these, the replay buffers keep them
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank")
    for r, e in enumerate(engines):
        join(d, e, r, rng)
    agree("both ranks, history replayed", d, engines, prompts,
          {"shared": [4, 4], "only0": [3, 0], "only1": [0, 5]})
    before = counters(d)

    engines[1].pressure(3)  # rank 1's LRU: shared's blocks 3, 2, 1
    engines[1].step()
    agree("rank 1 evicted", d, engines, prompts, {"shared": [4, 1], "only0": [3, 0], "only1": [0, 5]})
    assert engines[0].pool.reset_prefix_cache()
    engines[0].step()
    agree("rank 0 cleared", d, engines, prompts, {"shared": [0, 1], "only0": [0, 0], "only1": [0, 5]})
    settle_counters(d, before, {
        batches("ok"): 2,
        events(1, "removed"): 3,
        events(0, "cleared"): 1,
        resets(0, "cleared"): 1,
    })



def test_vllm_block_the_engine_holds_twice(vllm_kv, start_daemon):
    """A prompt of whole blocks that is fully cached hits only up to its last token (vLLM
    computes that token again for its logits), so its last block is computed into a
    second physical block, cached under the same hash, and published again as a
    BlockStored. vLLM evicts each copy on its own, with a BlockRemoved of that hash each:
    the engine holds the block until the second. (Not in PROTOCOL §11a, which assumes
    one block per engine hash.)"""
    rng = random.Random(16)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = vllm_kv(0, port, port + 1)
    p = Prompt(tokens(rng, 4 * e.block_size))
    prompts = {"p": p}
    join(d, e, 0, rng)
    assert e.pool.reset_prefix_cache()
    e.step()
    agree("joined", d, [e], prompts, {"p": [0]})
    before = counters(d)

    e.cache_prompt(p)
    [first] = e.step()
    agree("p stored", d, [e], prompts, {"p": [4]})
    e.cache_prompt(p)  # hits blocks 0-2, computes block 3 again
    [again] = e.step()
    assert (again.block_hashes, again.parent_block_hash) == (first.block_hashes[3:], first.block_hashes[2])
    agree("p's last block stored again", d, [e], prompts, {"p": [4]})
    e.pressure(1)  # the older copy of block 3 (freed first)
    [removed] = e.step()
    assert removed.block_hashes == first.block_hashes[3:]
    # dpcoord keeps one handle per engine hash: the first removal drops the block
    # (a miss while the engine still holds a copy, never a phantom).
    differ("one copy of p's last block evicted, the other still cached", d, [e], prompts,
           {"p": [4], "kv_blocks": [{"GPU": 4}]}, {"p": [3], "kv_blocks": [{"GPU": 3}]})
    e.pressure(1)
    [removed] = e.step()
    assert removed.block_hashes == first.block_hashes[3:]
    agree("both copies evicted", d, [e], prompts, {"p": [3]})
    settle_counters(d, before, {
        batches("ok"): 4,
        events(0, "stored"): 2,
        events(0, "removed"): 1,
        events(0, "unknown_block"): 1,
    })

# -- SGLang ---------------------------------------------------------------------------


class Values(list):
    """A radix node's KV indices (a torch tensor in SGLang): sliceable and ``clone()``-able."""

    def __getitem__(self, i):
        got = list.__getitem__(self, i)
        return Values(got) if isinstance(i, slice) else got

    def clone(self):
        return Values(self)


class Allocator:
    """The token-to-KV allocator ``create_simulated`` takes: evictions free segments into it."""

    device = "cpu"

    def __init__(self):
        self.freed = 0

    def free_segment(self, values, start_pos=0):
        self.freed += len(values)


@pytest.fixture
def sglang_kv(real, monkeypatch):
    import standins

    s = SimpleNamespace(
        **{
            name: importlib.import_module(mod)
            for name, mod in (
                ("radix", "sglang.srt.mem_cache.radix_cache"),
                ("params", "sglang.srt.mem_cache.base_prefix_cache"),
                ("init_params", "sglang.srt.mem_cache.cache_init_params"),
                ("events", "sglang.srt.disaggregation.kv_events"),
                ("scheduler", "sglang.srt.managers.scheduler_components.kv_events_publisher"),
                ("native", "sglang.srt.mem_cache.cpp_utils.native_hash"),
            )
        }
    )
    monkeypatch.setattr(s.native, "_load_native_hash_module", lambda: standins.NATIVE_HASH)
    made: list[SglangEngine] = []

    def make(*args, **kwargs) -> SglangEngine:
        e = SglangEngine(s, monkeypatch, *args, **kwargs)
        made.append(e)
        return e

    yield make
    for e in made:
        e.publisher.shutdown()


class SglangEngine:
    """One SGLang scheduler's KV side: the real RadixCache and the real scheduler publisher."""

    def __init__(self, s, monkeypatch, rank: int, dp: int, pub_port: int, replay_port: int, *, page_size: int,
                 buffer_steps: int = 10_000, eagle: bool = False, unified: bool = False):
        self.s, self.rank, self.block_size = s, rank, page_size
        # DP attention: one scheduler (and KV cache) per attention-DP rank; the publisher's
        # ports are offset by attn_dp_rank (plain DP: dp_rank).
        ctx = SimpleNamespace(num_dp_ranks=dp, attn_dp_size=dp, attn_dp_rank=rank, dp_rank=0 if dp > 1 else rank,
                              pp_rank=0, attn_tp_rank=0, attn_cp_rank=0)
        monkeypatch.setattr(s.events, "get_parallel", lambda: ctx)
        monkeypatch.setattr(s.scheduler, "get_parallel", lambda: ctx)
        # create_simulated: SGLang's own memory-pool-free construction (CacheInitParams
        # directly when the tree runs for EAGLE speculative decoding: bigram keys).
        self.cache = s.radix.RadixCache(s.init_params.CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=Allocator(), page_size=page_size,
            is_eagle=eagle, enable_kv_cache_events=True,
        )) if eagle else s.radix.RadixCache.create_simulated(mock_allocator=Allocator(), page_size=page_size,
                                                             enable_kv_cache_events=True)
        if unified:
            # SGLang's default tree cache (mem_cache/registry.py: create_unified_radix_cache), with
            # the FULL component only, as it builds it for a model without SWA or mamba layers.
            components = importlib.import_module("sglang.srt.mem_cache.unified_cache.components")
            self.cache = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache").UnifiedRadixCache(
                s.init_params.CacheInitParams(
                    disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=Allocator(),
                    page_size=page_size, enable_kv_cache_events=True,
                    tree_components=(components.ComponentType.FULL,),
                ))
        self.recorder = self.cache.tree_core.kv_events if unified else self.cache.kv_events
        config = (
            f'{{"publisher": "zmq", "endpoint": "tcp://127.0.0.1:{pub_port}", "bind": true,'
            f' "replay_endpoint": "tcp://127.0.0.1:{replay_port}", "buffer_steps": {buffer_steps}}}'
        )  # --kv-events-config
        self.scheduler = s.scheduler.SchedulerKvEventsPublisher(
            kv_events_config=config, tree_cache=self.cache, send_metrics_from_scheduler=None,
            max_running_requests=1, max_total_num_tokens=1, get_stats=lambda: None,
        )
        self.publisher = self.scheduler.kv_event_publisher
        assert isinstance(self.publisher, s.events.ZmqEventPublisher), "SGLang's gating declined the publisher"
        assert self.publisher._endpoint == f"tcp://127.0.0.1:{pub_port + rank}"
        self.wire = Wire(self.publisher)
        self.seq = 0
        self.sent: Counter[str] = Counter()

    def key(self, p: Prompt):
        return self.s.radix.RadixKey(array("q", p.tokens), cache_salt=p.salt)

    def cache_prompt(self, p: Prompt) -> None:
        assert p.lora is None
        self.cache.insert(self.s.params.InsertParams(key=self.key(p), value=Values(range(len(p.tokens)))))

    def evict(self, pages: int) -> None:
        self.cache.evict(self.s.params.EvictParams(num_tokens=pages * self.block_size))

    def step(self, drop: bool = False) -> list:
        """The scheduler's publish_kv_events: what the tree recorded since the last step."""
        evs = list(self.recorder._queue)
        if evs and drop:
            self.wire.drop.add(self.seq)
        self.scheduler.publish_kv_events()
        if evs:
            self.seq += 1
            self.sent.update(type(e).__name__ for e in evs)
        return evs

    def held(self, p: Prompt) -> int:
        match = self.cache.match_prefix(self.s.params.MatchPrefixParams(key=self.key(p)))
        return match.device_prefix_len // self.block_size

    def blocks(self) -> int:
        size = self.cache.total_size()  # UnifiedRadixCache: (full tokens, auxiliary tokens)
        return (size[0] if isinstance(size, tuple) else size) // self.block_size


def test_sglang_radix_cache_stores_splits_evictions_and_clear(sglang_kv, start_daemon):
    rng = random.Random(22)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = sglang_kv(0, 1, port, port + 1, page_size=16)
    P = e.block_size
    a = Prompt(tokens(rng, 4 * P + 3))  # the radix tree keeps whole pages only
    prompts = {
        "a": a,
        "b": Prompt(a.tokens[: 2 * P] + tokens(rng, 2 * P + 5)),
        "a+salt": Prompt(a.tokens, salt="tenant-7"),
    }
    first = e.step()
    assert [type(ev).__name__ for ev in first] == ["AllBlocksCleared"]  # the tree's reset() at start
    join(d, e, 0, rng)
    e.cache.reset()
    e.step()
    agree("after the tree's reset", d, [e], prompts, {"a": [0]})
    assert d.state()["kv_block_size"] == P
    before, seq0, sent0 = counters(d), e.seq, e.sent.copy()

    # Stores: a; b, which splits a's node after 2 pages and stores its own 2 pages with
    # a's page 1 as parent; a's tokens under a cache salt (a tree of their own).
    e.cache_prompt(a)
    e.step()
    agree("a stored", d, [e], prompts, {"a": [4], "b": [2], "a+salt": [0]})
    e.cache_prompt(prompts["b"])
    [stored_b] = e.step()
    assert stored_b.parent_block_hash is not None and len(stored_b.block_hashes) == 2
    e.cache_prompt(prompts["a+salt"])
    [stored_salted] = e.step()
    assert stored_salted.cache_salt == "tenant-7"
    agree("a, b and a under a salt", d, [e], prompts, {"a": [4], "b": [4], "a+salt": [4]})

    # Evictions: SGLang evicts whole leaves, least recently used first (the last lookup
    # of each prompt was agree()'s, in the order a, b, a+salt).
    e.evict(2)
    [removed] = e.step()
    assert len(removed.block_hashes) == 2
    agree("a's tail evicted", d, [e], prompts, {"a": [2], "b": [4], "a+salt": [4]})
    e.evict(3)  # b's tail, then the shared node that became a leaf: one BlockRemoved, 4 hashes
    [removed] = e.step()
    assert len(removed.block_hashes) == 4
    agree("b evicted", d, [e], prompts, {"a": [0], "b": [0], "a+salt": [4]})

    # A clear (the tree's reset(), e.g. /flush_cache), then a store after it.
    e.cache.reset()
    e.step()
    agree("after AllBlocksCleared", d, [e], prompts, {"a": [0], "b": [0], "a+salt": [0]})
    e.cache_prompt(prompts["b"])
    e.step()
    agree("b stored after the clear", d, [e], prompts, {"a": [2], "b": [4], "a+salt": [0]})
    assert (e.seq - seq0, e.sent - sent0) == (7, Counter(BlockStored=4, BlockRemoved=2, AllBlocksCleared=1))
    settle_counters(d, before, {
        batches("ok"): 7,
        events(0, "stored"): 4,
        events(0, "removed"): 2,
        events(0, "cleared"): 1,
        resets(0, "cleared"): 1,
    })


def test_sglang_two_attn_dp_ranks_with_a_batch_recovered_by_replay(sglang_kv, start_daemon):
    """Page size 1 (SGLang's default: every token is a block), two attention-DP ranks on
    port + attn_dp_rank, dpcoord subscribed with the ``+rank`` form."""
    rng = random.Random(23)
    base = free_ports(4)
    pub, rep = base, base + 2
    d = start(start_daemon, 2, f"tcp://127.0.0.1:{pub}+rank", f"tcp://127.0.0.1:{rep}+rank")
    engines = [sglang_kv(r, 2, pub, rep, page_size=1) for r in (0, 1)]
    s, t, u = Prompt(tokens(rng, 40)), Prompt(tokens(rng, 25)), Prompt(tokens(rng, 30))
    v = Prompt(u.tokens + tokens(rng, 12))
    prompts = {"s": s, "t": t, "u": u, "v": v}
    for r, e in enumerate(engines):
        join(d, e, r, rng)
    agree("both ranks joined", d, engines, prompts, {"s": [0, 0]})
    before = counters(d)

    engines[0].cache_prompt(s)
    engines[0].step()
    engines[1].cache_prompt(s)
    engines[1].cache_prompt(t)
    engines[1].step()
    engines[1].cache_prompt(u)
    engines[1].step(drop=True)  # lost on the wire, kept for replay
    engines[1].cache_prompt(v)  # its parent is u's last page
    [stored_v] = engines[1].step()
    assert stored_v.parent_block_hash is not None
    agree("rank 1's lost batch replayed", d, engines, prompts,
          {"s": [40, 40], "t": [0, 25], "u": [0, 30], "v": [0, 42]})
    engines[0].cache.reset()
    engines[0].step()
    agree("rank 0 cleared", d, engines, prompts, {"s": [0, 40], "t": [0, 25], "u": [0, 30], "v": [0, 42]})
    settle_counters(d, before, {
        events(0, "stored"): 1,
        events(1, "stored"): 4,
        events(0, "cleared"): 1,
        resets(0, "cleared"): 1,
        GAPS: 1,
        replays("recovered"): 1,
    }, ignore=(batches("ok"), batches("stale")))


def test_sglang_drop_beyond_the_replay_buffer_clears_the_rank(sglang_kv, start_daemon):
    rng = random.Random(24)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = sglang_kv(0, 1, port, port + 1, page_size=16, buffer_steps=1)
    P = e.block_size
    x, y, z = Prompt(tokens(rng, 4 * P)), Prompt(tokens(rng, 3 * P)), Prompt(tokens(rng, 2 * P))
    x6 = Prompt(x.tokens + tokens(rng, 2 * P))
    prompts = {"x": x, "x6": x6, "y": y, "z": z}
    join(d, e, 0, rng)
    e.cache.reset()
    e.step()
    agree("joined", d, [e], prompts, {"x": [0]})
    e.cache_prompt(x)
    e.step()
    agree("x stored", d, [e], prompts, {"x": [4], "x6": [4]})
    before = counters(d)

    e.cache_prompt(y)
    e.step(drop=True)  # lost, and pushed out of the 1-batch buffer by the next
    e.cache_prompt(x6)  # x's pages 4-5, parent x's page 3
    e.cache_prompt(z)
    stored = e.step()
    assert [(ev.parent_block_hash is None, len(ev.block_hashes)) for ev in stored] == [(False, 2), (True, 2)]
    settle("dpcoord after the unrecoverable gap", lambda: dpcoord_view(d, prompts),
           {"x": [0], "x6": [0], "y": [0], "z": [2], "kv_blocks": [{"GPU": 2}], "gauge": [2.0]})
    assert engine_view([e], prompts) == {"x": [4], "x6": [6], "y": [3], "z": [2], "kv_blocks": [{"GPU": 11}],
                                         "gauge": [11.0]}
    settle_counters(d, before, {
        GAPS: 1,
        replays("incomplete"): 1,
        resets(0, "gap"): 1,
        events(0, "stored"): 1,
        events(0, "unknown_parent"): 1,
    }, ignore=(batches("ok"), batches("stale")))


def test_sglang_eagle_bigram_pages(sglang_kv, start_daemon):
    """With EAGLE speculative decoding SGLang's radix tree keys its pages by bigrams:
    position j of a key is the pair (t[j], t[j+1]), so n tokens make n - 1 positions, and
    BlockStored.token_ids lists those pairs, ``[[t0, t1], [t1, t2], ...]``. The tokens a
    page holds are the first elements of its pairs. dpcoord's keys cover token blocks,
    and a page's pair reaches one token past it, so it does not key these pages at all
    (PROTOCOL §11a: such a BlockStored is a bad_event; the rest of its batch, clears
    included, applies): a miss on every EAGLE page, never a phantom."""
    rng = random.Random(25)
    port = free_ports(2)
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}")
    e = sglang_kv(0, 1, port, port + 1, page_size=1, eagle=True)
    p = Prompt(tokens(rng, 20))
    q = Prompt(p.tokens[:12] + tokens(rng, 6))
    prompts = {"p": p, "q": q}
    join(d, e, 0, rng, joined=lambda c: sum(v for k, v in c.items() if k.startswith("dpcoord_kv_batches_total")) >= 1)
    e.cache.reset()
    e.step()
    e.cache_prompt(p)
    [stored] = e.step()
    assert stored.token_ids[:2] == [(p.tokens[0], p.tokens[1]), (p.tokens[1], p.tokens[2])]
    assert (len(stored.block_hashes), stored.block_size) == (19, 1)
    # q shares p's first 12 tokens: 11 positions (the 12th pairs p's token 11 with p's 12).
    nothing = {"p": [0], "q": [0], "kv_blocks": [{}], "gauge": [0.0]}
    differ("an EAGLE tree's bigram pages", d, [e], prompts, {"p": [19], "q": [11]}, nothing)
    # Once p's store is counted, every earlier batch (the first clear among them) was
    # applied: a publisher's batches apply in seq order.
    settle("p's pages counted as unindexable", lambda: counters(d).get(events(0, "bad_event"), 0) >= 1, True)
    before = counters(d)
    e.cache_prompt(q)  # splits p's node after 11 positions
    e.evict(3)  # p's tail (8 positions), the least recently used leaf
    e.step()
    differ("an EAGLE tree's bigram pages evicted", d, [e], prompts, {"p": [11], "q": [17]}, nothing)
    # A clear in the same stream still applies (nothing to clear here, but it counts).
    e.cache.reset()
    e.step()
    settle("the clear after EAGLE pages", lambda: counters(d).get(events(0, "cleared"), 0) - before.get(events(0, "cleared"), 0), 1)


# -- The largest batch a big prefill publishes -------------------------------------------

#: ``kv_events.max_batch_bytes``'s default (docs/configuration.md).
MAX_BATCH_BYTES = 4 << 20
#: What the default must leave above the largest batch measured here.
HEADROOM = 1.9


@pytest.mark.parametrize("engine", ["vllm-int", "vllm-bytes", "sglang-page1", "sglang-page16"])
def test_a_32k_and_a_128k_prompt_stored_in_one_step_fit_the_default_batch_limit(
        vllm_kv, sglang_kv, start_daemon, tmp_path, monkeypatch, engine):
    """The largest KV batch a realistic big prefill makes: a 32,768-token and a
    131,072-token prompt (random ids below 150,000, a Qwen-size vocabulary) stored in one
    step, which takes an engine whose prefill budget holds both at once (vLLM
    ``--max-num-batched-tokens`` >= 163,840; SGLang without chunked prefill, or two
    finishing requests). vLLM: block size 16, its hashes as uint64 or as the raw 32
    bytes; SGLang: page size 1 (its default) and 16. The batch decodes and is applied
    under the default ``kv_events.max_batch_bytes`` (exact: the index then equals the
    engine's, and the counters moved by that one batch), with ``HEADROOM`` to spare.
    ``pytest -s`` prints the sizes (docs/prefix-cache.md, "Batch sizes")."""
    import msgpack

    rng = random.Random(31)
    port = free_ports(2)
    config = tmp_path / "big-prompts.toml"
    config.write_text("[limits]\nmax_message_bytes = 4194304\n")  # the prefix queries carry 131,072 tokens
    d = start(start_daemon, 1, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}", "--config", str(config))
    kind, shape = engine.split("-")
    if kind == "vllm":
        monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1" if shape == "int" else "0")
        e = vllm_kv(0, port, port + 1, num_blocks=10_400)
        join(d, e, 0, rng)
        assert e.pool.reset_prefix_cache()
    else:
        e = sglang_kv(0, 1, port, port + 1, page_size=int(shape.removeprefix("page")))
        join(d, e, 0, rng)
        e.cache.reset()
    e.step()
    prompts = {"32k": Prompt(tokens(rng, 32_768)), "128k": Prompt(tokens(rng, 131_072))}
    agree("a clean start", d, [e], prompts, {"32k": [0], "128k": [0]})
    before = counters(d)

    for p in prompts.values():
        if kind == "vllm":
            e.compute(e.schedule(p))
        else:
            e.cache_prompt(p)
    published = len(e.wire.sent)
    assert e.step(), "the step stored nothing"
    B = e.block_size
    # Up to 131,072 blocks applied a slice at a time by a debug build, on a machine
    # that may be busy: more time than the other checks need, never an early pass.
    agree("both prompts stored in one batch", d, [e], prompts,
          {"32k": [32_768 // B], "128k": [131_072 // B]}, deadline=4 * DEADLINE)
    [batch] = e.wire.sent[published:]
    _, evs, *_ = msgpack.unpackb(batch, strict_map_key=False)
    print(f"\n{engine}: one batch of {len(batch):,} bytes, {len(evs)} BlockStored events, "
          f"{len(batch) / (32_768 + 131_072):.2f} bytes per token; default limit / batch = "
          f"{MAX_BATCH_BYTES / len(batch):.2f}")
    assert len(batch) * HEADROOM <= MAX_BATCH_BYTES, f"{len(batch)} bytes leave less than {HEADROOM}x"
    settle_counters(d, before, {batches("ok"): 1, events(0, "stored"): len(evs)})
