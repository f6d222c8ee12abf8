"""vLLM 0.33.0's own front-end routing and KV-cache objects for the compat tests, built
without engines, sockets or a model; import it once the ``real`` fixture has installed
the stand-ins. Each helper's ``real_modules`` is that fixture's value, taken so a test
cannot call it before the stand-ins are in place; the vLLM modules are imported by name.

- :func:`make_request`: a real ``EngineCoreRequest``, as the front end sends to an engine.
- :func:`make_dplb_client`: a real ``DPLBAsyncMPClient`` (vLLM's internal DP load
  balancer) with the attributes its routing, abort and output methods read, and a
  ``_send_input`` that records ``(request_type, request, engine)`` in ``client.sent``
  instead of sending. Engines are vLLM's ZMQ identities: rank ``r`` is
  ``r.to_bytes(2, "little")``, in rank order.
- :func:`make_kv_cache_manager` / :func:`kv_events_for_prompt`: a real ``KVCacheManager``
  (one full-attention group, prefix caching and KV events on) driven as the scheduler
  drives it, and the events it emits for a prompt; :func:`event_batch_payload` encodes
  them as vLLM's ``ZmqEventPublisher`` does.
- :func:`make_hybrid_kv_cache_manager`: the same for a hybrid model, a full-attention
  and a sliding-window KV cache group."""

from __future__ import annotations

import collections
import importlib
import itertools
import math
import time
import weakref
import zlib
from types import SimpleNamespace
from typing import Any

#: vLLM's ``--prefix-caching-hash-algo`` default
HASH_ALGO = "sha256"


def _mod(name: str):
    return importlib.import_module(name)  # under the stand-ins the ``real`` fixture installed


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity vLLM's MPClient gives DP rank ``rank`` (core_client.py)."""
    return rank.to_bytes(2, "little")


def lora_request(real_modules, lora_name: str):
    """A real ``LoRARequest``; its id (which must be > 0) is derived from the name."""
    return _mod("vllm.lora.request").LoRARequest(
        lora_name, 1 + zlib.crc32(lora_name.encode()) % (2**31 - 1), f"/adapters/{lora_name}"
    )


def make_request(real_modules, request_id: str, prompt_token_ids: list[int], data_parallel_rank: int | None = None,
                 lora_name: str | None = None, cache_salt: str | None = None, resumable: bool = False,
                 mm_features: list | None = None):
    """A real ``vllm.v1.engine.EngineCoreRequest`` for a token prompt, sampling one token.
    ``external_req_id`` is ``request_id``, as ``InputProcessor.assign_request_id`` sets it
    with VLLM_DISABLE_REQUEST_ID_RANDOMIZATION (else it appends 8 random characters to
    ``request_id``); ``OutputProcessor`` requires it."""
    engine = _mod("vllm.v1.engine")
    return engine.EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        mm_features=mm_features,
        sampling_params=_mod("vllm.sampling_params").SamplingParams(max_tokens=1),
        pooling_params=None,
        arrival_time=time.time(),
        lora_request=lora_request(real_modules, lora_name) if lora_name is not None else None,
        cache_salt=cache_salt,
        data_parallel_rank=data_parallel_rank,
        resumable=resumable,
        external_req_id=request_id,
    )


class _Started:
    """Stands for a started asyncio task in ``BackgroundResources``: the client's
    ``_ensure_output_queue_task`` / ``_ensure_stats_update_task`` then start nothing."""

    def done(self) -> bool:
        return False

    def cancel(self) -> bool:
        return False


def make_dplb_client(real_modules, dp_size: int, client_count: int = 1, client_index: int = 0,
                     node_ranks: list[int] | None = None):
    """A real ``DPLBAsyncMPClient`` for ``dp_size`` engines, its ``__init__`` (which starts
    engines and sockets) skipped: the attributes are the ones ``__init__`` sets for an
    internal-LB front end, with no load reported yet (``lb_engines`` all ``[0, 0, 0.0]``;
    a test may set them as the coordinator's stats would). With ``node_ranks``, the
    client of one node of a hybrid-LB deployment (``--data-parallel-hybrid-lb``): it
    manages that node's engines only, global ranks ``node_ranks`` in order, and its
    ``vllm_config.parallel_config`` says so (``local_engines_only``)."""
    ranks = list(range(dp_size)) if node_ranks is None else list(node_ranks)
    assert len(ranks) > 1, "DPLBAsyncMPClient asserts more than one engine"
    client = _bare_client("DPLBAsyncMPClient", ranks, client_count, client_index)
    client.vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(data_parallel_size=dp_size, local_engines_only=node_ranks is not None),
    )
    # vLLM 0.23 (vLLM Ascend's) keeps [waiting, running] per engine and no per-engine
    # in-flight count; later releases [waiting, running, kv_cache_usage] and the count.
    client.lb_engines = [[0, 0, 0.0] if KEEPS_INFLIGHT else [0, 0] for _ in client.core_engines]
    client.reqs_in_flight = {}
    client.streaming_reqs = set()
    client.engine_inflight = collections.Counter()  # vLLM 0.23 never reads it: see engine_inflight()
    client.eng_start_index = (len(ranks) * client_index) // client_count
    return client


def _keeps_inflight() -> bool:
    import inspect

    return "engine_inflight" in inspect.getsource(_mod("vllm.v1.engine.core_client").DPLBAsyncMPClient.__init__)


class _KeepsInflight:
    """``KEEPS_INFLIGHT``: whether this vLLM's ``DPLBAsyncMPClient`` counts its requests
    in flight per engine (``engine_inflight``, since vLLM 0.32), read once it is imported."""

    def __bool__(self) -> bool:
        return _keeps_inflight()


KEEPS_INFLIGHT = _KeepsInflight()


class _SessionAffinity:
    """``SESSION_AFFINITY``: whether this vLLM's ``DPLBAsyncMPClient`` sends a
    streaming-input session's later chunks to its first chunk's engine (since vLLM 0.32)."""

    def __bool__(self) -> bool:
        import inspect

        return "session affinity" in inspect.getsource(_mod("vllm.v1.engine.core_client"))


SESSION_AFFINITY = _SessionAffinity()


def engine_inflight(client) -> "collections.Counter":
    """The client's requests in flight per engine: vLLM's ``engine_inflight`` where it
    keeps one, else counted from ``reqs_in_flight`` (vLLM 0.23)."""
    if KEEPS_INFLIGHT:
        return client.engine_inflight
    return collections.Counter(client.reqs_in_flight.values())


def make_external_lb_client(real_modules, rank: int, dp_size: int):
    """A real ``DPAsyncMPClient``, as vLLM builds it for the API server of DP rank
    ``rank`` under ``--data-parallel-external-lb``: one engine, that rank's (else as
    :func:`make_dplb_client`)."""
    return _bare_client("DPAsyncMPClient", [rank], dp_size, rank)


def make_single_client(real_modules):
    """A real ``AsyncMPClient``, as vLLM builds it for one engine (no data parallelism)."""
    return _bare_client("AsyncMPClient", [0], 1, 0)


def _bare_client(cls: str, ranks: list[int], client_count: int, client_index: int):
    """An instance of ``core_client.<cls>`` managing the engines of ``ranks``, without
    ``__init__``; what it sends is recorded in ``client.sent``."""
    cc = _mod("vllm.v1.engine.core_client")
    client = object.__new__(getattr(cc, cls))
    client.client_count = client_count
    client.client_index = client_index
    client.engine_ranks_managed = list(ranks)
    client.core_engines = [engine_identity(r) for r in ranks]
    client.core_engine = client.core_engines[0]
    client.current_wave = 0
    client.engines_running = False
    client.utility_results = {}
    client.resources = cc.BackgroundResources(ctx=None, output_queue_task=_Started(), stats_update_task=_Started())
    client._finalizer = weakref.finalize(client, client.resources)  # as MPClient.__init__; shutdown() runs it
    client.sent = []  # (EngineCoreRequestType, request or request ids, engine identity)

    async def _send_input(request_type, request, engine=None):
        client.sent.append((request_type, request, client.core_engine if engine is None else engine))

    client._send_input = _send_input
    client.first_req_send_socket = _Notices()  # vLLM 0.32 tells its coordinator of a first request
    return client


class _Notices:
    """Stands for vLLM 0.32's ``first_req_send_socket``, taking what is sent."""

    def __init__(self):
        self.sent: list[bytes] = []

    async def send(self, message: bytes) -> None:
        self.sent.append(message)


def rank_of(engine: bytes) -> int:
    """The DP rank of an engine identity (the inverse of :func:`engine_identity`)."""
    return int.from_bytes(engine, "little")


def finished_outputs(real_modules, *request_ids: str, engine_index: int = 0):
    """A real ``EngineCoreOutputs`` announcing that ``request_ids`` finished, for
    ``DPLBAsyncMPClient.process_engine_outputs(client, outputs)``."""
    return _mod("vllm.v1.engine").EngineCoreOutputs(engine_index=engine_index, finished_requests=set(request_ids))


def make_async_llm(real_modules, engine_core):
    """A real ``AsyncLLM`` front end over ``engine_core`` (e.g. :func:`make_dplb_client`),
    its ``__init__`` (config, renderer, engines) skipped: a real ``OutputProcessor``
    without a tokenizer, default ``SchedulerConfig`` admission limits (none), no stat
    loggers. Its ``_add_request`` and ``abort`` are vLLM's; :func:`add_request` calls the former."""
    llm = object.__new__(_mod("vllm.v1.engine.async_llm").AsyncLLM)
    llm.engine_core = engine_core
    llm.output_processor = _mod("vllm.v1.engine.output_processor").OutputProcessor(None, log_stats=False)
    llm.scheduler_config = _mod("vllm.config").SchedulerConfig.default_factory()
    llm.admission_stats = None
    llm.logger_manager = None
    llm.log_requests = False
    llm.log_stats = False
    # vLLM 0.34's admission check reads whether fault tolerance is on (off by default).
    llm.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(enable_fault_tolerance=False))
    return llm


async def add_request(real_modules, llm, request):
    """``AsyncLLM._add_request`` for a single (not parallel-sampled) request, as
    ``AsyncLLM.add_request`` calls it once the input is processed; returns its output queue."""
    queue = _mod("vllm.v1.engine.output_processor").RequestOutputCollector(
        request.sampling_params.output_kind, request.request_id
    )
    await llm._add_request(request, None, None, 0, queue)
    return queue


# -- KV cache --------------------------------------------------------------------------


def image_feature(real_modules, identifier: str, offset: int, length: int):
    """A real ``MultiModalFeatureSpec`` for an image whose ``length`` placeholder tokens
    start at ``offset``, as the input processor attaches it to a request (its data
    already sent: the engine's prefix cache reads only ``identifier`` and the range)."""
    inputs = _mod("vllm.multimodal.inputs")
    return inputs.MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                        mm_position=inputs.PlaceholderRange(offset=offset, length=length))


def make_kv_cache_manager(real_modules, block_size: int = 16, num_blocks: int = 256, max_model_len: int = 8192,
                          num_hash_lookahead_tokens: int = 0, dcp: int = 1):
    """A real ``KVCacheManager`` as the scheduler builds it for a model with one
    full-attention group: prefix caching and KV events on, the engine's request block
    hasher (sha256) in ``manager.block_hasher``. ``num_hash_lookahead_tokens`` is
    ``VllmConfig.num_hash_lookahead_tokens`` (EAGLE with lookahead block hashes: the
    scheduler passes it to both, and turns its EAGLE block drop off). ``dcp`` is the
    decode-context-parallel size: the scheduler's and the hash block size are then
    ``block_size * dcp`` (``resolve_kv_cache_block_sizes``), and so is the KV events'."""
    kvi = _mod("vllm.v1.kv_cache_interface")
    utils = _mod("vllm.v1.core.kv_cache_utils")
    hash_fn = _mod("vllm.utils.hashing").get_hash_fn_by_name(HASH_ALGO)
    utils.init_none_hash(hash_fn)  # as EngineCore does; sha256's NONE_HASH is fixed
    spec = kvi.FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128,
                                 dtype=_mod("torch").float16)
    config = kvi.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[kvi.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    # Lookahead block hashes came with vLLM 0.33: without them, 0.32's arguments.
    lookahead = (num_hash_lookahead_tokens,) if num_hash_lookahead_tokens else ()
    manager = _mod("vllm.v1.core.kv_cache_manager").KVCacheManager(
        config, max_model_len=max_model_len, scheduler_block_size=block_size * dcp,
        hash_block_size=block_size * dcp, enable_caching=True, enable_kv_cache_events=True, dcp_world_size=dcp,
        **({"num_hash_lookahead_tokens": num_hash_lookahead_tokens} if lookahead else {}),
    )
    manager.block_hasher = utils.get_request_block_hasher(block_size * dcp, hash_fn, *lookahead)
    return manager


def make_hybrid_kv_cache_manager(real_modules, block_size: int = 16, num_blocks: int = 64,
                                 sliding_window: int = 16, max_model_len: int = 8192,
                                 window_block_size: int | None = None):
    """A real ``KVCacheManager`` as the scheduler builds it for a hybrid model (Gemma-3
    style): KV cache group 0 full attention, group 1 sliding window of ``sliding_window``
    tokens, one ``BlockPool`` of ``num_blocks`` shared by both (vLLM's own
    ``KVCacheConfig``, ``KVCacheGroupSpec``, ``FullAttentionSpec``, ``SlidingWindowSpec``,
    so ``HybridKVCacheCoordinator`` runs); prefix caching and KV events on, the engine's
    request block hasher (sha256) in ``manager.block_hasher``. Group 1's blocks are of
    ``window_block_size`` tokens (default ``block_size``); the hash block size is then
    the GCD of the two and the scheduler's the LCM (``resolve_kv_cache_block_sizes``)."""
    kvi = _mod("vllm.v1.kv_cache_interface")
    utils = _mod("vllm.v1.core.kv_cache_utils")
    hash_fn = _mod("vllm.utils.hashing").get_hash_fn_by_name(HASH_ALGO)
    utils.init_none_hash(hash_fn)
    window_block_size = window_block_size or block_size

    def shape(size: int) -> dict:
        return dict(block_size=size, num_kv_heads=8, head_size=128, dtype=_mod("torch").float16)

    config = kvi.KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[
            kvi.KVCacheGroupSpec(["model.layers.0.self_attn.attn"], kvi.FullAttentionSpec(**shape(block_size))),
            kvi.KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                                 kvi.SlidingWindowSpec(sliding_window=sliding_window, **shape(window_block_size))),
        ],
    )
    hash_size = math.gcd(block_size, window_block_size)
    manager = _mod("vllm.v1.core.kv_cache_manager").KVCacheManager(
        config, max_model_len=max_model_len, scheduler_block_size=math.lcm(block_size, window_block_size),
        hash_block_size=hash_size, enable_caching=True, enable_kv_cache_events=True,
    )
    # vLLM Ascend's platform patch (patch_kv_cache_coordinator) makes its own subclass
    assert isinstance(manager.coordinator, _mod("vllm.v1.core.kv_cache_coordinator").HybridKVCacheCoordinator)
    manager.block_hasher = utils.get_request_block_hasher(hash_size, hash_fn)
    return manager


def schedule_prompt(real_modules, manager, request) -> Any:
    """Runs an ``EngineCoreRequest``'s prefill through ``manager`` as the scheduler does
    in one step (prefix hits from ``get_computed_blocks``, then ``allocate_slots`` for
    the rest, which caches its full blocks) and returns the engine-side ``Request``
    (still holding its blocks: ``manager.free(req)`` when it finishes)."""
    req = _mod("vllm.v1.request").Request.from_engine_core_request(request, manager.block_hasher)
    blocks, hit_tokens = manager.get_computed_blocks(req)[:2]  # vLLM 0.23 returns these two only
    new = manager.allocate_slots(req, req.num_tokens - hit_tokens, hit_tokens, blocks)
    assert new is not None, "the KV cache is full"
    req.num_computed_tokens = req.num_tokens
    return req


_kv_ids = itertools.count()


def kv_events_for_prompt(real_modules, token_ids: list[int], block_size: int = 16, *, manager=None,
                         lora_name: str | None = None, cache_salt: str | None = None) -> list:
    """The KV events (``vllm.distributed.kv_events`` objects: ``BlockStored`` for the
    prompt's full blocks) a vLLM engine publishes for one prompt it prefills and
    finishes, from ``manager`` (a fresh :func:`make_kv_cache_manager` of ``block_size``
    when None; pass one to see prefix hits and evictions across prompts)."""
    if manager is None:
        manager = make_kv_cache_manager(real_modules, block_size)
    request = make_request(real_modules, f"kv-{next(_kv_ids)}", token_ids,
                           lora_name=lora_name, cache_salt=cache_salt)
    req = schedule_prompt(real_modules, manager, request)
    manager.free(req)
    return manager.take_events()


def event_batch_payload(real_modules, events: list, data_parallel_rank: int = 0, ts: float | None = None) -> bytes:
    """``events`` as one ``KVEventBatch`` payload, the third frame of what
    ``ZmqEventPublisher`` sends (it encodes with a plain ``msgspec.msgpack.Encoder``)."""
    import msgspec

    batch = _mod("vllm.distributed.kv_events").KVEventBatch(
        ts=time.time() if ts is None else ts, events=events, data_parallel_rank=data_parallel_rank
    )
    return msgspec.msgpack.Encoder().encode(batch)
