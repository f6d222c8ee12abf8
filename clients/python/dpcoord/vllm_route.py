"""dpcoord's hook in vLLM's own request path: every API server asks dpcoord which
engine gets each request, and keeps exact books of what it sent.

vLLM calls :func:`register` in every process (the ``vllm.general_plugins`` entry
point of this package). It does nothing unless ``DPCOORD_ROUTE_ENDPOINT`` or
``DPCOORD_STATS_ENDPOINT`` is set. Then, once vLLM's client module is imported,
and only if the methods it wraps are the ones it was tested against
(:data:`TESTED`), it wraps:

* ``DPLBAsyncMPClient.add_request_async`` (with ``DPCOORD_ROUTE_ENDPOINT``):
  before vLLM picks an engine, the request's prompt (its token ids, or their
  block keys), LoRA name and cache salt are sent to dpcoord in a ``route`` query,
  awaited at most ``DPCOORD_ROUTE_TIMEOUT_MS``;
* ``DPLBAsyncMPClient.get_core_engine_for_request``: dpcoord's rank is given to
  vLLM's own method as the request's ``data_parallel_rank`` for that one call, so
  vLLM's bookkeeping (in-flight counts, abort routing) runs unchanged, and the
  request the engine receives is the one vLLM built. With no answer, vLLM's own
  rule picks. Requests vLLM pins (``data_parallel_rank``, i.e. the
  ``X-data-parallel-rank`` header; a streaming-input session's later chunks;
  late-interaction pooling) are never sent to dpcoord;
* ``OutputProcessor.abort_requests`` and ``process_outputs``: the requests a
  client aborted, counted on the rank they were sent to (the exact books, see
  :mod:`dpcoord.ledger`); and, for a request sent with its prompt, what the
  engine delivered of dpcoord's prediction: the query asks for ``explain``, and
  when the request's prefill ends vLLM's ``prefill_stats.num_cached_tokens`` (the
  prompt tokens the engine did not compute) goes back to dpcoord with the
  prediction in a ``delivered`` report, unanswered and never waited for.

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
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from . import _core, prefix
from ._after_import import after_import
from .ledger import TALLY
from .route_link import RouteLink

log = logging.getLogger("dpcoord.vllm")

CLIENT = "vllm.v1.engine.core_client"
OUTPUTS = "vllm.v1.engine.output_processor"

#: the vLLM versions the hook is tested against, with a fingerprint (sha256 of the
#: source, first 16 hex digits) of each method it wraps or relies on
TESTED: dict[str, dict[str, str]] = {
    "0.33.0": {
        "DPLBAsyncMPClient.get_core_engine_for_request": "b7f86dbfd4a18280",
        "DPAsyncMPClient.add_request_async": "c79e0731761c7d08",
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
        return f"vLLM {version} is not a version it is tested against ({', '.join(TESTED)})"
    for name, fn in methods.items():
        try:
            found = fingerprint(fn)
        except (OSError, TypeError) as e:
            return f"the source of {name} cannot be read ({e})"
        if found != expected[name]:
            return f"{name} is not the one it was tested against in vLLM {version}"
    return None


HOOK: "Hook | None" = None


def install(settings: RouteSettings) -> "Hook | None":
    """Wraps vLLM's methods (once per process) if they are the tested ones."""
    global HOOK
    if HOOK is not None:
        return HOOK
    import vllm
    from vllm.v1.engine import core_client, output_processor

    lb, dp, out = core_client.DPLBAsyncMPClient, core_client.DPAsyncMPClient, output_processor.OutputProcessor
    methods = {
        "DPLBAsyncMPClient.get_core_engine_for_request": lb.get_core_engine_for_request,
        "DPAsyncMPClient.add_request_async": dp.add_request_async,
        "OutputProcessor.abort_requests": out.abort_requests,
        "OutputProcessor.process_outputs": out.process_outputs,
    }
    why = untested(getattr(vllm, "__version__", "?"), methods)
    if why is not None:
        log.warning("dpcoord: not installed in vLLM's request path: %s; vLLM runs as without dpcoord", why)
        return None
    HOOK = Hook(settings, core_client.get_late_interaction_engine_index)
    _wrap(lb, out, methods)
    TALLY.active = True
    if settings.endpoint:
        log.info("dpcoord: vLLM's API server asks %s for each request's engine", settings.endpoint)
    return HOOK


class Hook:
    """This process's hook: the link to dpcoord, the requests in flight, the counts."""

    def __init__(self, settings: RouteSettings, late_interaction: Callable[[Any, int], int | None]):
        self.settings = settings
        self.late_interaction = late_interaction
        self.counts: Counter[str] = Counter()
        self.links: dict[asyncio.AbstractEventLoop, RouteLink | None] = {}
        #: request id -> dpcoord's rank, from its answer until vLLM's method takes it
        self.chosen: dict[str, int] = {}
        #: request id -> rank, for the requests this API server sent and has not seen end
        self.placed: dict[str, int] = {}
        #: request id -> (rank, prompt tokens dpcoord predicted cached there), until its prefill ends
        self.predicted: dict[str, tuple[int, int]] = {}
        #: the requests awaiting dpcoord's answer, and those of them aborted meanwhile
        self.routing: set[str] = set()
        self.aborted_in_route: set[str] = set()
        self.logged_at = 0.0
        self.unlogged: Counter[str] = Counter()
        metric = _metric()
        self.metric = None if metric is None else {o: metric.labels(outcome=o) for o in OUTCOMES}

    def eligible(self, client: Any, request: Any) -> bool:
        """Whether vLLM leaves the choice open: no pin, no session, no pooling rule."""
        return (
            request.data_parallel_rank is None
            and request.request_id not in client.reqs_in_flight
            and not getattr(request, "abort_immediately", False)
            and self.late_interaction(request.pooling_params, len(client.core_engines)) is None
        )

    async def ask(self, client: Any, request: Any) -> int | None:
        """dpcoord's rank for ``request``, or None (vLLM's rule); ``_SKIP`` if vLLM
        aborted the request while dpcoord was answering."""
        rid = request.request_id
        self.routing.add(rid)
        try:
            if not self.eligible(client, request):
                rank, reason = None, "pinned"
            elif (link := self.link()) is None or link.unreachable():
                rank, reason = None, "unreachable"
            else:
                rank, reason, predicted = await link.explained(self.query(client, request))
        except Exception:  # noqa: BLE001 - nothing of dpcoord's may fail a request
            log.exception("dpcoord: asking for request %s's engine failed", rid)
            rank, reason = None, "error"
        finally:
            self.routing.discard(rid)
        if rid in self.aborted_in_route:
            self.aborted_in_route.discard(rid)
            return _SKIP
        if rank is not None and rank >= len(client.core_engines):
            rank, reason = None, "out_of_range"
        if rank is not None and predicted is not None:
            self.predicted[rid] = (rank, predicted)
        self.count(reason or "dpcoord")
        return rank

    def query(self, client: Any, request: Any) -> dict[str, Any]:
        tokens = request.prompt_token_ids
        query: dict[str, Any] = {"v": _core.VERSION, "op": "route", "id": request.request_id}
        if tokens is None:
            return query
        query["prompt_tokens"] = len(tokens)
        if len(tokens) > MAX_PROMPT_TOKENS:
            return query  # beyond dpcoord's default limit: the length alone
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        salt = request.cache_salt
        if self.settings.send == "keys":
            block_size = client.vllm_config.cache_config.block_size
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

    def link(self) -> RouteLink | None:
        """This event loop's link to dpcoord (made on first use; None if the endpoint is invalid)."""
        loop = asyncio.get_running_loop()
        if loop not in self.links:
            try:
                self.links[loop] = RouteLink(self.settings.endpoint, self.settings.timeout_s)
            except Exception as e:  # noqa: BLE001 - a bad endpoint must not stop vLLM
                log.error("dpcoord: cannot connect to %s (%s); vLLM balances its engines by itself", self.settings.endpoint, e)
                self.links[loop] = None
            for old in [lp for lp in self.links if lp.is_closed()]:
                gone = self.links.pop(old)
                if gone is not None:
                    gone.close()
        return self.links[loop]

    def count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.metric is not None:
            self.metric[outcome].inc()
        if outcome in ("dpcoord", "pinned"):
            return
        self.unlogged[outcome] += 1
        now = time.monotonic()
        if now - self.logged_at >= 1.0:
            self.logged_at = now
            what = ", ".join(f"{n} {k}" for k, n in sorted(self.unlogged.items()))
            self.unlogged.clear()
            log.warning("dpcoord: requests placed by vLLM's own rule since the last report: %s (%s)", what, self.settings.endpoint)


def _wrap(lb: type, out: type, methods: dict[str, Any]) -> None:
    """Puts the hook around vLLM's methods; each call goes to the process's
    :data:`HOOK` (straight to vLLM's method while there is none)."""
    add = methods["DPAsyncMPClient.add_request_async"]
    pick = methods["DPLBAsyncMPClient.get_core_engine_for_request"]
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
        new = request.request_id not in client.reqs_in_flight
        if rank is None:
            engine = pick(client, request)
        else:
            pinned, request.data_parallel_rank = request.data_parallel_rank, rank
            try:
                engine = pick(client, request)
            finally:
                request.data_parallel_rank = pinned
        if new and not getattr(request, "abort_immediately", False) and engine in client.core_engines:
            sent = client.core_engines.index(engine)
            hook.placed[request.request_id] = sent
            TALLY.sent(sent)
        return engine

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
