"""dpcoord's hook in vLLM's own request path: every API server asks dpcoord which
engine gets each request, and keeps exact books of what it sent.

vLLM calls :func:`register` in every process (the ``vllm.general_plugins`` entry
point of this package). It does nothing unless ``DPCOORD_ROUTE_ENDPOINT`` or
``DPCOORD_STATS_ENDPOINT`` is set. Then, once vLLM's client module is imported,
and only on a vLLM release it is tested against whose methods it wraps are the
ones it was tested with (:data:`TESTED`, one entry per release of the support
window; :data:`SEAMS` names them), it wraps:

* ``DPLBAsyncMPClient.add_request_async`` (with ``DPCOORD_ROUTE_ENDPOINT``; the
  internal load balancer of ``--data-parallel-size N``): before vLLM picks an
  engine, the request's prompt (its token ids, or their block keys), LoRA name and
  cache salt are sent to dpcoord in a ``route`` query, awaited at most
  ``DPCOORD_ROUTE_TIMEOUT_MS``;
* ``DPLBAsyncMPClient.get_core_engine_for_request``: dpcoord's rank is given to
  vLLM's own method as the request's ``data_parallel_rank`` for that one call, so
  vLLM's bookkeeping (in-flight counts, abort routing) runs unchanged, and the
  request the engine receives is the one vLLM built. With no answer, vLLM's own
  rule picks. On a node of a multi-node deployment (``--data-parallel-hybrid-lb``:
  the client manages its node's engines only) the query's ``among`` names the
  node's global ranks, and dpcoord's global rank is handed to vLLM as the index of
  that engine among the node's. Requests vLLM pins (``data_parallel_rank``, i.e. the
  ``X-data-parallel-rank`` header; a streaming-input session's later chunks;
  late-interaction pooling) are never sent to dpcoord;
* ``DPAsyncMPClient.get_core_engine_for_request`` (``--data-parallel-external-lb``:
  one engine per API server) and ``AsyncMPClient.add_request_async`` (one engine):
  no choice to make there; each request sent is counted on its engine (the books);
* ``OutputProcessor.abort_requests`` and ``process_outputs``: the requests a
  client aborted, counted on the rank they were sent to (the exact books, see
  :mod:`dpcoord.ledger`); and, for a request sent with its prompt, what the
  engine delivered of dpcoord's prediction: the query asks for ``explain``, and
  when the request's prefill ends vLLM's ``prefill_stats.num_cached_tokens`` (the
  prompt tokens the engine did not compute) goes back to dpcoord with the
  prediction in a ``delivered`` report, unanswered and never waited for.

Books are kept by engine: a request counts on the DP rank its engine identity
names (vLLM's identity is the global rank), which is the rank vLLM's stat loggers
report. A placement dpcoord made that vLLM does not use (its answer came after the
deadline, named an engine this API server does not have, or came for a request
aborted meanwhile) is withdrawn at once with a ``finished`` report naming only the
rank it was ``placed`` on.

Block keys are made in the block size dpcoord keys prompts in (the ``block_size``
of its ``ping`` and ``explain`` replies: the engines' own, from their KV events, or
16 before any); until dpcoord's first answer, in this API server's
``cache_config.block_size``. The link to dpcoord connects when the hook is
installed (vLLM's API server starting), so its first requests find it connected.

Environment:

``DPCOORD_ROUTE_ENDPOINT``    dpcoord's route socket (``--route-bind``), e.g. ``tcp://127.0.0.1:5570``
``DPCOORD_ROUTE_TIMEOUT_MS``  default 5: the longest a request waits for dpcoord's answer
``DPCOORD_ROUTE_SEND``        ``keys`` (default: block keys computed here with vLLM's block
                              size), ``tokens`` (the token ids) or ``length`` (the length only)

Every request's outcome is counted in ``dpcoord_hook_requests_total{outcome}`` on
vLLM's own ``/metrics`` (when ``prometheus_client`` is there, as it is with vLLM)
and in :data:`Hook.counts`; a request that goes by vLLM's rule is logged at most
once a second.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
import os
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import _core, prefix
from ._after_import import after_import
from ._outcomes import Outcomes
from .ledger import TALLY
from .route_link import RouteLink

log = logging.getLogger("dpcoord.vllm")

CLIENT = "vllm.v1.engine.core_client"
OUTPUTS = "vllm.v1.engine.output_processor"

#: every method the hook wraps, by module and qualified name
SEAMS: tuple[tuple[str, str], ...] = (
    (CLIENT, "DPLBAsyncMPClient.get_core_engine_for_request"),
    (CLIENT, "DPAsyncMPClient.add_request_async"),
    (CLIENT, "DPAsyncMPClient.get_core_engine_for_request"),
    (CLIENT, "AsyncMPClient.add_request_async"),
    (OUTPUTS, "OutputProcessor.abort_requests"),
    (OUTPUTS, "OutputProcessor.process_outputs"),
)

#: the vLLM releases the hook is tested against (its support window: vLLM's last
#: three minor releases; and 0.23.0, outside the window, the vLLM that vLLM Ascend
#: 0.23.0 runs on), with a fingerprint (sha256 of the source, first 16 hex digits)
#: of each method of :data:`SEAMS` in that release, as it runs in an API server
TESTED: dict[str, dict[str, str]] = {
    # vLLM Ascend 0.23.0's vLLM. Its platform plugin patches vLLM in the API server
    # (vllm_ascend.patch.platform) but none of these methods: they are vLLM's own.
    "0.23.0": {
        "DPLBAsyncMPClient.get_core_engine_for_request": "123f6a22f856c9f1",
        "DPAsyncMPClient.add_request_async": "e937266fd11defc5",
        "DPAsyncMPClient.get_core_engine_for_request": "08b9afed2a24987e",
        "AsyncMPClient.add_request_async": "1af4694c34b3a43e",
        "OutputProcessor.abort_requests": "d6a984c0f87a525c",
        "OutputProcessor.process_outputs": "3ebaa2ced63c59da",
    },
    "0.32.0": {
        "DPLBAsyncMPClient.get_core_engine_for_request": "964adc43fd38ab32",
        "DPAsyncMPClient.add_request_async": "e937266fd11defc5",
        "DPAsyncMPClient.get_core_engine_for_request": "08b9afed2a24987e",
        "AsyncMPClient.add_request_async": "1af4694c34b3a43e",
        "OutputProcessor.abort_requests": "6dd03abb8ea35e7c",
        "OutputProcessor.process_outputs": "9e116796002e75f2",
    },
    "0.33.0": {
        "DPLBAsyncMPClient.get_core_engine_for_request": "b7f86dbfd4a18280",
        "DPAsyncMPClient.add_request_async": "c79e0731761c7d08",
        "DPAsyncMPClient.get_core_engine_for_request": "08b9afed2a24987e",
        "AsyncMPClient.add_request_async": "1af4694c34b3a43e",
        "OutputProcessor.abort_requests": "6dd03abb8ea35e7c",
        "OutputProcessor.process_outputs": "06811284749d457d",
    },
    "0.34.0": {
        "DPLBAsyncMPClient.get_core_engine_for_request": "b7f86dbfd4a18280",
        "DPAsyncMPClient.add_request_async": "f66ba428ce1caf03",
        "DPAsyncMPClient.get_core_engine_for_request": "08b9afed2a24987e",
        "AsyncMPClient.add_request_async": "69004988b8dfa176",
        "OutputProcessor.abort_requests": "6dd03abb8ea35e7c",
        "OutputProcessor.process_outputs": "06811284749d457d",
    },
}

#: every outcome a request can have, as counted
OUTCOMES = ("dpcoord", "pinned", "unreachable", "timeout", "refused", "bad_reply", "out_of_range", "error")
SENDS = ("keys", "tokens", "length")
#: dpcoord's default ``limits.max_prompt_tokens``: longer prompts are sent by length only
MAX_PROMPT_TOKENS = 262_144


@dataclass(frozen=True)
class RouteSettings:
    endpoint: str | None
    timeout_s: float = 0.005
    send: str = "keys"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RouteSettings":
        timeout = int(env.get("DPCOORD_ROUTE_TIMEOUT_MS", 5))
        if timeout <= 0:
            raise ValueError(f"DPCOORD_ROUTE_TIMEOUT_MS must be a positive number of milliseconds, got {timeout}")
        send = env.get("DPCOORD_ROUTE_SEND", "keys")
        if send not in SENDS:
            raise ValueError(f"DPCOORD_ROUTE_SEND must be one of {', '.join(SENDS)}, got {send!r}")
        return cls(env.get("DPCOORD_ROUTE_ENDPOINT") or None, timeout / 1000.0, send)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: installs the hook when vLLM's
    modules are imported, if dpcoord is configured; never raises into vLLM."""
    if not (os.environ.get("DPCOORD_ROUTE_ENDPOINT") or os.environ.get("DPCOORD_STATS_ENDPOINT")):
        return
    try:
        settings = RouteSettings.from_env()
    except ValueError as e:
        log.error("dpcoord: %s; vLLM balances its engines by itself", e)
        settings = RouteSettings(None)
    after_import((CLIENT, OUTPUTS), lambda: install(settings))


def fingerprint(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def untested(version: str, methods: dict[str, Any]) -> str | None:
    """Why the hook must not go in on this vLLM (None: it may)."""
    expected = TESTED.get(version)
    if expected is None:
        newest = max(TESTED, key=lambda v: tuple(int(x) for x in v.split(".")))
        return (
            f"vLLM {version} is not a release it is tested against ({', '.join(TESTED)}); install one of them"
            f" (pip install 'vllm=={newest}'), or let a frontend or gateway ask dpcoord (docs/engines.md)"
        )
    for name, fn in methods.items():
        try:
            found = fingerprint(fn)
        except (OSError, TypeError) as e:
            return f"the source of {name} cannot be read ({e})"
        if found != expected[name]:
            return f"{name} is not the one it was tested against in vLLM {version}"
    return None


def seam(module: str, name: str) -> Any:
    """The function ``Class.method`` of ``module`` (imported) as vLLM defines it."""
    cls, method = name.split(".")
    return getattr(getattr(sys.modules[module], cls), method)


HOOK: "Hook | None" = None


def install(settings: RouteSettings) -> "Hook | None":
    """Wraps vLLM's methods (once per process) if they are the tested ones."""
    global HOOK
    if HOOK is not None:
        return HOOK
    import vllm

    methods = {name: seam(module, name) for module, name in SEAMS}
    why = untested(getattr(vllm, "__version__", "?"), methods)
    if why is not None:
        log.warning("dpcoord: not installed in vLLM's request path: %s; vLLM runs as without dpcoord", why)
        return None
    HOOK = Hook(settings, sys.modules[CLIENT].get_late_interaction_engine_index)
    _wrap(methods)
    TALLY.active = True
    if settings.endpoint:
        log.info("dpcoord: vLLM's API server asks %s for each request's engine", settings.endpoint)
    return HOOK


class Hook:
    """This process's hook: the link to dpcoord, the requests in flight, the counts."""

    def __init__(self, settings: RouteSettings, late_interaction: Callable[[Any, int], int | None]):
        self.settings = settings
        self.late_interaction = late_interaction
        self.outcomes = Outcomes(OUTCOMES, _metric(), log, "vLLM's own rule", settings.endpoint)
        self.counts, self.count = self.outcomes.counts, self.outcomes.count
        self.links: dict[asyncio.AbstractEventLoop, RouteLink | None] = {}
        #: request id -> the index of the engine dpcoord chose, from its answer until vLLM's method takes it
        self.chosen: dict[str, int] = {}
        #: request id -> rank, for the requests this API server sent and has not seen end
        self.placed: dict[str, int] = {}
        #: request id -> (rank, prompt tokens dpcoord predicted cached there), until its prefill ends
        self.predicted: dict[str, tuple[int, int]] = {}
        #: the requests awaiting dpcoord's answer, and those of them aborted meanwhile
        self.routing: set[str] = set()
        self.aborted_in_route: set[str] = set()
        #: placements withdrawn because vLLM did not use them, per rank
        self.withdrawn: Counter[int] = Counter()
        #: whether the endpoint could not be connected to (said once, never tried again)
        self.bad_endpoint = False
        #: the link made now, so it is connected before the first request; the first
        #: event loop to ask takes it
        self.warm: RouteLink | None = self._connect(attach=False) if settings.endpoint else None

    def eligible(self, client: Any, request: Any) -> bool:
        """Whether vLLM leaves the choice open: no pin, no session, no pooling rule."""
        return (
            request.data_parallel_rank is None
            and request.request_id not in client.reqs_in_flight
            and not getattr(request, "abort_immediately", False)
            and self.late_interaction(request.pooling_params, len(client.core_engines)) is None
        )

    async def ask(self, client: Any, request: Any) -> int | None:
        """The engine dpcoord chose for ``request``, as vLLM's ``data_parallel_rank``
        (the index of one of this client's engines), or None (vLLM's rule); ``_SKIP``
        if vLLM aborted the request while dpcoord was answering."""
        rid = request.request_id
        self.routing.add(rid)
        link = None
        try:
            if not self.eligible(client, request):
                rank, reason = None, "pinned"
            elif (link := self.link()) is None or link.unreachable():
                rank, reason = None, "unreachable"
            else:
                if self.settings.send == "keys":
                    await link.ready()  # the first time: dpcoord's block size
                rank, reason, predicted = await link.explained(self.query(client, request, link))
        except Exception:  # noqa: BLE001 - nothing of dpcoord's may fail a request
            log.exception("dpcoord: asking for request %s's engine failed", rid)
            rank, reason = None, "error"
        finally:
            self.routing.discard(rid)
        if rid in self.aborted_in_route:
            self.aborted_in_route.discard(rid)
            if rank is not None:
                self.withdraw(link, rank)
            return _SKIP
        local = None if rank is None else local_index(client, rank)
        if rank is not None and local is None:
            self.withdraw(link, rank)
            rank, reason = None, "out_of_range"
        if rank is not None and predicted is not None:
            self.predicted[rid] = (rank, predicted)
        self.count(reason or "dpcoord")
        return local

    def sent(self, request: Any, engine: bytes) -> None:
        """vLLM sends ``request`` to ``engine`` (a ZeroMQ identity: the global DP rank,
        2 bytes little-endian): counted there unless it is a later chunk of a request
        already counted (a streaming-input session) or vLLM aborts it at once."""
        rid = request.request_id
        if rid in self.placed or getattr(request, "abort_immediately", False):
            return
        rank = int.from_bytes(engine, "little")
        self.placed[rid] = rank
        TALLY.sent(rank)

    def query(self, client: Any, request: Any, link: RouteLink) -> dict[str, Any]:
        tokens = request.prompt_token_ids
        query: dict[str, Any] = {"v": _core.VERSION, "op": "route", "id": request.request_id}
        if _local_engines_only(client):
            # A node of a multi-node deployment (hybrid LB): only this node's engines.
            query["among"] = list(client.engine_ranks_managed)
        if tokens is None:
            return query
        query["prompt_tokens"] = len(tokens)
        if len(tokens) > MAX_PROMPT_TOKENS:
            return query  # beyond dpcoord's default limit: the length alone
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        salt = request.cache_salt
        if self.settings.send == "keys":
            block_size = link.block_size or client.vllm_config.cache_config.block_size
            query.update(block_keys=prefix.block_keys(tokens, block_size, lora, salt), explain=True)
        elif self.settings.send == "tokens":
            query.update({"tokens": tokens, "lora": lora, "salt": salt, "explain": True})
        return query

    def delivered(self, output: Any) -> None:
        """Reports what the engine delivered of dpcoord's prediction for ``output``'s
        request, once its prefill ended (vLLM's ``prefill_stats`` comes with it)."""
        stats = output.prefill_stats
        if stats is None or (placed := self.predicted.pop(output.request_id, None)) is None:
            return
        rank, predicted = placed
        try:
            if (link := self.link()) is not None:
                report = {"v": _core.VERSION, "op": "delivered", "rank": rank, "predicted": predicted}
                link.report(dict(report, delivered=stats.num_cached_tokens))
        except Exception:  # noqa: BLE001 - nothing of dpcoord's may fail a request
            log.exception("dpcoord: reporting request %s's cached tokens failed", output.request_id)

    def withdraw(self, link: RouteLink | None, rank: int) -> None:
        """dpcoord's placement on ``rank`` that vLLM did not use: withdrawn at once."""
        self.withdrawn[rank] += 1
        if link is not None:
            link.report({"v": _core.VERSION, "op": "finished", "placed": rank})

    def link(self) -> RouteLink | None:
        """This event loop's link to dpcoord: the one made at install if this process
        made it and no loop has taken it, else one made now; None if the endpoint is invalid."""
        loop = asyncio.get_running_loop()
        if self.bad_endpoint:
            return None
        if loop not in self.links:
            warm, self.warm = self.warm, None
            # A forked child must not touch its parent's socket (pyzmq leaves it unclosed).
            self.links[loop] = warm if warm is not None and warm.pid == os.getpid() else self._connect(attach=True)
            for old in [lp for lp in self.links if lp.is_closed()]:
                gone = self.links.pop(old)
                if gone is not None:
                    gone.close()
        return self.links[loop]

    def _connect(self, attach: bool) -> RouteLink | None:
        try:
            link = RouteLink(self.settings.endpoint, self.settings.timeout_s, attach=attach)
        except Exception as e:  # noqa: BLE001 - a bad endpoint must not stop vLLM
            log.error("dpcoord: cannot connect to %s (%s); vLLM balances its engines by itself", self.settings.endpoint, e)
            self.bad_endpoint = True
            return None
        link.on_late = lambda rank: self.withdraw(link, rank)
        return link


def local_index(client: Any, rank: int) -> int | None:
    """The index among ``client``'s engines (vLLM's ``data_parallel_rank`` for it) of
    global DP rank ``rank``; None if this client has no engine of that rank."""
    try:
        return client.engine_ranks_managed.index(rank)
    except ValueError:
        return None


def _local_engines_only(client: Any) -> bool:
    """Whether ``client`` manages only its node's engines (vLLM's hybrid or external
    load balancing), not every rank of the deployment."""
    parallel = getattr(getattr(client, "vllm_config", None), "parallel_config", None)
    return bool(getattr(parallel, "local_engines_only", False))


def _wrap(methods: dict[str, Any]) -> None:
    """Puts the hook around vLLM's methods; each call goes to the process's
    :data:`HOOK` (straight to vLLM's method while there is none)."""
    client = sys.modules[CLIENT]
    lb, dp, single = client.DPLBAsyncMPClient, client.DPAsyncMPClient, client.AsyncMPClient
    out = sys.modules[OUTPUTS].OutputProcessor
    add = methods["DPAsyncMPClient.add_request_async"]
    pick = methods["DPLBAsyncMPClient.get_core_engine_for_request"]
    own_engine = methods["DPAsyncMPClient.get_core_engine_for_request"]
    add_one = methods["AsyncMPClient.add_request_async"]
    abort = methods["OutputProcessor.abort_requests"]
    process = methods["OutputProcessor.process_outputs"]

    async def add_request_async(client, request):
        hook = HOOK
        rank = await hook.ask(client, request) if hook is not None and hook.settings.endpoint else None
        if rank == _SKIP:
            return
        if rank is not None:
            hook.chosen[request.request_id] = rank
        try:
            await add(client, request)
        finally:
            if rank is not None:
                hook.chosen.pop(request.request_id, None)

    def get_core_engine_for_request(client, request):
        hook = HOOK
        if hook is None:
            return pick(client, request)
        rank = hook.chosen.pop(request.request_id, None)
        if rank is None:
            engine = pick(client, request)
        else:
            pinned, request.data_parallel_rank = request.data_parallel_rank, rank
            try:
                engine = pick(client, request)
            finally:
                request.data_parallel_rank = pinned
        hook.sent(request, engine)
        return engine

    def external_lb_engine(client, request):
        engine = own_engine(client, request)
        if HOOK is not None:
            HOOK.sent(request, engine)
        return engine

    async def add_to_the_engine(client, request):
        if HOOK is not None:
            HOOK.sent(request, client.core_engine)
        await add_one(client, request)

    def abort_requests(processor, request_ids, internal):
        aborted = abort(processor, request_ids, internal)
        hook = HOOK
        for rid in aborted if hook is not None else ():
            hook.predicted.pop(rid, None)
            if rid in hook.routing:
                hook.aborted_in_route.add(rid)
            elif (rank := hook.placed.pop(rid, None)) is not None:
                TALLY.aborted(rank)
        return aborted

    def process_outputs(processor, engine_core_outputs, *args, **kwargs):
        result = process(processor, engine_core_outputs, *args, **kwargs)
        hook = HOOK
        for output in engine_core_outputs if hook is not None else ():
            hook.delivered(output)
            if output.request_id not in processor.request_states:
                hook.placed.pop(output.request_id, None)
                hook.predicted.pop(output.request_id, None)
        return result

    lb.add_request_async = add_request_async
    lb.get_core_engine_for_request = get_core_engine_for_request
    dp.get_core_engine_for_request = external_lb_engine
    single.add_request_async = add_to_the_engine
    out.abort_requests = abort_requests
    out.process_outputs = process_outputs


#: :meth:`Hook.ask`'s answer for a request aborted while dpcoord answered: vLLM has
#: already answered its caller, so it is not sent to any engine
_SKIP = -1


_METRIC: Any = None


def _metric() -> Any:
    """``dpcoord_hook_requests_total`` in the process's Prometheus registry (vLLM's
    ``/metrics``, in multiprocess mode too), made once; None without ``prometheus_client``."""
    global _METRIC
    if _METRIC is None:
        try:
            from prometheus_client import Counter as PromCounter
        except ImportError:
            return None
        _METRIC = PromCounter(
            "dpcoord_hook_requests",
            "Requests of this vLLM API server by how their engine was chosen: by dpcoord, pinned by vLLM,"
            " or by vLLM's own rule because dpcoord was unreachable, late, refused, answered badly or out of range",
            ["outcome"],
        )
    return _METRIC
