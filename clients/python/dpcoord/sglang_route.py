"""dpcoord's hook in SGLang's data-parallel controller: the controller asks dpcoord
which rank gets each request.

SGLang runs :func:`register` in every process that loads its general plugins
(the ``sglang.srt.plugins`` entry point of this package), the data-parallel
controller's among them, before the controller is built. It does nothing unless
``DPCOORD_ROUTE_ENDPOINT`` is set. Then, once SGLang's controller module is
imported, and only on an SGLang version and methods it was tested against
(:data:`TESTED`), it registers an ``AROUND`` hook with SGLang's own
``HookRegistry`` on each method of :data:`SEAMS`, the controller's load-balance
methods (``--load-balance-method`` ``round_robin``, ``total_requests``,
``total_tokens``; ``auto`` is ``round_robin`` except on a PD prefill server):

* a request SGLang pins (``routed_dp_rank``, from the request body or the
  ``X-Data-Parallel-Rank`` header) goes to SGLang's own method, which sends it
  to its rank or refuses it; dpcoord is not asked;
* any other request is sent to dpcoord in a ``route`` query (its block keys in
  SGLang's page size, or its token ids, with its LoRA name and cache salt, and
  its length), answered within ``DPCOORD_ROUTE_TIMEOUT_MS``; the request goes to
  dpcoord's rank as SGLang sends it to a pinned one, unchanged;
* with no answer in time, a refusal, an answer that is not a route reply, a rank
  this controller has no worker for or holds inactive, or no dpcoord at all, the
  request goes to SGLang's own method, as without dpcoord.

SGLang's health checks never reach those methods (``dispatching_with_trace``
sends them to ``dispatch_health_check``), and ``follow_bootstrap_room`` (PD
disaggregation) is not wrapped: the decode side fails a transfer whose prefill
rank is not ``bootstrap_room % dp_size`` (``disaggregation/common/conn.py``,
"follow_bootstrap_room conflict").

The controller dispatches from one synchronous loop, so the link to dpcoord is
synchronous too (:class:`SyncRouteLink`): nothing is queued for a dpcoord that
is not connected, and after one request waited a whole deadline the link
answers at once until dpcoord answers a ``ping``.

Environment:

``DPCOORD_ROUTE_ENDPOINT``    dpcoord's route socket (``--route-bind``), e.g. ``tcp://127.0.0.1:5570``
``DPCOORD_ROUTE_TIMEOUT_MS``  default 5: the longest a request waits for dpcoord's answer
``DPCOORD_ROUTE_SEND``        ``keys`` (default: block keys in SGLang's page size; the token ids
                              when the page is one token), ``tokens`` or ``length``

Every request's outcome is counted in ``dpcoord_hook_requests_total{outcome}``
(on SGLang's ``/metrics`` with ``--enable-metrics``, when ``prometheus_client``
is there, as it is with SGLang) and in :data:`Hook.counts`; a request placed by
SGLang's own method is logged at most once a second.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import logging
import os
import sys
import time
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import msgpack
import zmq

from . import _core, prefix
from ._after_import import after_import
from ._outcomes import Outcomes
from .route_link import dealer

log = logging.getLogger("dpcoord.sglang")

CONTROLLER = "sglang.srt.managers.data_parallel_controller"

#: what the hook wraps: ``(module, "Class.method")``
SEAMS: tuple[tuple[str, str], ...] = (
    (CONTROLLER, "DataParallelController.round_robin_scheduler"),
    (CONTROLLER, "DataParallelController.total_requests_scheduler"),
    (CONTROLLER, "DataParallelController.total_tokens_scheduler"),
)

#: the SGLang versions the hook is tested against, with a fingerprint (sha256 of the
#: source, first 16 hex digits) of each method it wraps or relies on, all of
#: :data:`CONTROLLER`: ``__init__`` binds ``dispatching`` to the wrapped methods,
#: ``dispatching_with_trace`` keeps health checks off them, and
#: ``maybe_external_dp_rank_routing`` is SGLang's rule for pinned requests
TESTED: dict[str, dict[str, str]] = {
    "0.5.23": {
        "DataParallelController.round_robin_scheduler": "d2ec5a93a2e3d400",
        "DataParallelController.total_requests_scheduler": "fa27761102b40fff",
        "DataParallelController.total_tokens_scheduler": "141e830bb7464531",
        "DataParallelController.maybe_external_dp_rank_routing": "177ebbee592a80fb",
        "DataParallelController.dispatching_with_trace": "7269974ddf789bbe",
        "DataParallelController.__init__": "c3def4d0d2bf6bbf",
    },
}

#: every outcome a request can have, as counted (those of the vLLM hook, and
#: ``inactive``: a rank SGLang holds inactive)
OUTCOMES = ("dpcoord", "pinned", "unreachable", "timeout", "refused", "bad_reply", "out_of_range", "inactive", "error")
SENDS = ("keys", "tokens", "length")
#: dpcoord's default ``limits.max_prompt_tokens``: longer prompts are sent by length only
MAX_PROMPT_TOKENS = 262_144
#: dpcoord's default ``limits.max_message_bytes``: a larger query would be refused, so the
#: prompt goes in a smaller form (token ids instead of keys, then its length only)
MAX_QUERY_BYTES = 65_536
#: how often a link that stopped waiting pings dpcoord
PROBE_EVERY_S = 0.1


@dataclass(frozen=True)
class RouteSettings:
    endpoint: str
    timeout_s: float = 0.005
    send: str = "keys"

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "RouteSettings":
        raw = env.get("DPCOORD_ROUTE_TIMEOUT_MS", "5")
        try:
            timeout = int(raw)
        except ValueError:
            timeout = 0
        if timeout <= 0:
            raise ValueError(f"DPCOORD_ROUTE_TIMEOUT_MS must be a positive number of milliseconds, got {raw}")
        send = env.get("DPCOORD_ROUTE_SEND", "keys")
        if send not in SENDS:
            raise ValueError(f"DPCOORD_ROUTE_SEND must be one of {', '.join(SENDS)}, got {send!r}")
        return cls(env.get("DPCOORD_ROUTE_ENDPOINT", ""), timeout / 1000.0, send)


#: True while :func:`register` runs inside SGLang's ``load_plugins()``, which applies
#: the registered hooks itself when its plugins have run
_LOADING = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hooks the controller's dispatch when
    its module is imported, if ``DPCOORD_ROUTE_ENDPOINT`` is set; never raises into SGLang."""
    global _LOADING
    if not os.environ.get("DPCOORD_ROUTE_ENDPOINT"):
        return
    try:
        settings = RouteSettings.from_env()
    except ValueError as e:
        log.error("dpcoord: %s; SGLang balances its ranks by itself", e)
        return
    _LOADING = True
    try:
        after_import((CONTROLLER,), lambda: install(settings))
    finally:
        _LOADING = False


def fingerprint(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def untested(version: str, methods: dict[str, Any]) -> str | None:
    """Why the hook must not go in on this SGLang (None: it may)."""
    expected = TESTED.get(version)
    if expected is None:
        return f"SGLang {version} is not a version it is tested against ({', '.join(TESTED)})"
    for name, fn in methods.items():
        try:
            found = fingerprint(fn)
        except (OSError, TypeError) as e:
            return f"the source of {name} cannot be read ({e})"
        if found != expected.get(name):
            return f"{name} is not the one it was tested against in SGLang {version}"
    return None


HOOK: "Hook | None" = None


def install(settings: RouteSettings) -> "Hook | None":
    """Registers the hook with SGLang's ``HookRegistry`` (once per process) if the
    controller's methods are the tested ones."""
    global HOOK
    if HOOK is not None:
        return HOOK
    import sglang
    from sglang.srt.managers import data_parallel_controller as dpc
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    names = next(iter(TESTED.values()))
    methods = {name: _resolve(dpc, name) for name in names}
    why = untested(getattr(sglang, "__version__", "?"), methods)
    if why is not None:
        log.warning("dpcoord: not installed in SGLang's dispatch: %s; SGLang runs as without dpcoord", why)
        return None
    HOOK = Hook(settings)
    for module, name in SEAMS:
        HookRegistry.register(f"{module}.{name}", _around, HookType.AROUND)
    if not _LOADING:  # imported after SGLang's loader ran: apply now
        HookRegistry.apply_hooks()
    log.info("dpcoord: SGLang's data-parallel controller asks %s for each request's rank", settings.endpoint)
    return HOOK


def _resolve(module: Any, name: str) -> Any:
    cls, attr = name.split(".")
    return getattr(getattr(module, cls), attr)


def _around(original: Callable[[Any, Any], Any], controller: Any, req: Any) -> Any:
    """Each wrapped load-balance method: dpcoord's rank, else SGLang's own method."""
    hook = HOOK
    rank = hook.ask(controller, req) if hook is not None else None
    if rank is None:
        return original(controller, req)
    # As SGLang sends a pinned request (maybe_external_dp_rank_routing).
    sys.modules[CONTROLLER].sock_send(controller.workers[rank], req)
    return None


class Hook:
    """This process's hook: its link to dpcoord and its counts."""

    def __init__(self, settings: RouteSettings):
        self.settings = settings
        self.outcomes = Outcomes(OUTCOMES, _metric(), log, "SGLang's own method", settings.endpoint)
        self.counts, self.count = self.outcomes.counts, self.outcomes.count
        #: the link and the process it was made in (a forked child makes its own)
        self.link_of: tuple[int, SyncRouteLink | None] | None = None
        self.ids = itertools.count(1)

    def ask(self, controller: Any, req: Any) -> int | None:
        """dpcoord's rank for ``req``, or None (SGLang's own method decides)."""
        if req.routed_dp_rank is not None:
            self.count("pinned")
            return None
        try:
            link = self.link()
            if link is None:
                rank, reason = None, "unreachable"
            elif (reason := link.unanswered()) is not None:
                rank = None  # known before the query is built
            else:
                rank, reason = link.route(*self.query(controller, req))
            if rank is not None and (reason := _unusable(controller, rank)) is not None:
                link.withdraw(rank)
                rank = None
        except Exception:  # noqa: BLE001 - nothing of dpcoord's may fail a request
            log.exception("dpcoord: asking for request %s's rank failed", getattr(req, "rid", "?"))
            rank, reason = None, "error"
        self.count(reason or "dpcoord")
        return rank

    def query(self, controller: Any, req: Any) -> tuple[bytes, int]:
        """The ``route`` query for ``req``, encoded, and its ``id``: the prompt goes in
        the first of its forms that fits :data:`MAX_QUERY_BYTES`."""
        qid = next(self.ids)
        base: dict[str, Any] = {"v": _core.VERSION, "op": "route", "id": qid}
        ids = req.input_ids
        if ids is None:  # input embeddings: no token ids, no length
            return _core.encode(base), qid
        base["prompt_tokens"] = len(ids)
        for form in self.prompt_forms(controller, req, ids):
            payload = _core.encode({**base, **form})
            if len(payload) <= MAX_QUERY_BYTES:
                return payload, qid
        return _core.encode(base), qid

    def prompt_forms(self, controller: Any, req: Any, ids: Any) -> Iterator[dict[str, Any]]:
        """The prompt as dpcoord may take it, the preferred form first."""
        if self.settings.send == "length" or len(ids) > MAX_PROMPT_TOKENS:
            return
        if getattr(req, "extra_key", None) is not None or (req.lora_id is not None and req.lora_name is None):
            # SGLang keys the cache by more than dpcoord can seed a chain with.
            return
        lora, salt = req.lora_name, getattr(req, "cache_salt", None)
        page = getattr(controller.server_args, "page_size", None)
        if self.settings.send == "keys" and isinstance(page, int) and page > 1:
            keys = prefix.block_keys(ids, page, lora, salt)
            if len(keys) <= MAX_PROMPT_TOKENS // prefix.TOKENS_PER_KEY:
                yield {"block_keys": keys}
        form: dict[str, Any] = {"tokens": ids.tolist() if isinstance(ids, array) else list(ids)}
        if lora is not None:
            form["lora"] = lora
        if salt is not None:
            form["salt"] = salt
        yield form

    def link(self) -> SyncRouteLink | None:
        """This process's link to dpcoord (made on first use; None if the endpoint is invalid)."""
        pid = os.getpid()
        if self.link_of is None or self.link_of[0] != pid:
            try:
                link: SyncRouteLink | None = SyncRouteLink(self.settings.endpoint, self.settings.timeout_s)
            except zmq.ZMQError as e:
                log.error("dpcoord: cannot connect to %s (%s); SGLang balances its ranks by itself", self.settings.endpoint, e)
                link = None
            self.link_of = (pid, link)
        return self.link_of[1]

    def close(self) -> None:
        if self.link_of is not None and self.link_of[1] is not None and self.link_of[0] == os.getpid():
            self.link_of[1].close()
        self.link_of = None


def _unusable(controller: Any, rank: int) -> str | None:
    """Why SGLang cannot send to ``rank`` now (None: it can), by the controller's own
    view: a worker socket for it, active, and not marked unavailable."""
    if rank >= len(controller.workers) or controller.workers[rank] is None:
        return "out_of_range"
    if rank not in controller._active_workers or not controller.status[rank]:
        return "inactive"
    return None


class SyncRouteLink:
    """One DEALER connected to ``endpoint``, for a caller that blocks on each answer.

    :meth:`route` answers within ``timeout_s`` with a rank or the reason there is
    none: ``unreachable`` (no connection: ``ZMQ_IMMEDIATE`` queues nothing for a
    dpcoord that is not there; only the link's first query waits, at most a
    deadline, for the first connection), ``timeout`` (no answer in time; the link
    then stops waiting and answers ``timeout`` at once, pinging dpcoord every
    :data:`PROBE_EVERY_S`, until a ping is answered), ``refused`` (an error reply)
    or ``bad_reply``. A late reply is read by the next query, and the placement it
    names withdrawn (:meth:`withdraw`): SGLang placed that request by itself."""

    def __init__(self, endpoint: str, timeout_s: float, context: zmq.Context | None = None):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.sock = dealer(endpoint, context)
        self.born = time.monotonic()
        self.connected = False
        #: waiting for a ping's answer before asking again
        self.down = False
        self.probe_id: int | None = None
        self.probe_at = 0.0
        self.pings = itertools.count(-1, -1)  # negative ids: never a query's
        #: placements withdrawn because SGLang did not use them, per rank
        self.withdrawn: Counter[int] = Counter()

    def writable(self) -> bool:
        """Whether a send now would be taken (a connection to dpcoord exists)."""
        return bool(self.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT)

    def unanswered(self) -> str | None:
        """The answer a query would have now without being sent (``unreachable``: no
        connection; ``timeout``: waiting for a ping's answer), else None. Reads the
        replies that are there first: a ping's answer brings the link back."""
        self._read(None)
        if self.connected and not self.writable():
            return "unreachable"
        if self.down:
            self._probe()
            return "timeout"
        return None

    def route(self, payload: bytes, qid: int) -> tuple[int | None, str | None]:
        """``(rank, None)`` or ``(None, reason)`` for an encoded route query whose ``id``
        is ``qid`` (a positive int); ask :meth:`unanswered` first."""
        if not self._send(payload):
            if self.connected:
                return None, "unreachable"
            # The first connection may still be being made: wait for it, at most a deadline.
            deadline = self.born + self.timeout_s
            while not (sent := self._send(payload)) and (left := deadline - time.monotonic()) > 0:
                zmq.zmq_poll([(self.sock, zmq.POLLOUT)], max(1, int(left * 1000)))
            self.connected = True
            if not sent:
                return None, "unreachable"
        self.connected = True
        deadline = time.monotonic() + self.timeout_s
        while True:
            answer = self._read(qid)
            if answer is not None:
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                break
            zmq.zmq_poll([(self.sock, zmq.POLLIN)], int(left * 1000))  # 0 near the deadline: spins
        self.down = True
        self.probe_at = 0.0
        return None, "timeout"

    def _send(self, payload: bytes) -> bool:
        try:
            self.sock.send_multipart((b"", payload), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:  # EAGAIN: no connection (ZMQ_IMMEDIATE) or the send queue is full
            return False

    def withdraw(self, rank: int) -> None:
        """dpcoord's placement on ``rank`` that SGLang did not use: a ``finished``
        report naming only the rank it was ``placed`` on, its answer ignored."""
        self.withdrawn[rank] += 1
        self._send(_core.encode({"v": _core.VERSION, "op": "finished", "placed": rank, "id": next(self.pings)}))

    def _probe(self) -> None:
        now = time.monotonic()
        if now - self.probe_at < PROBE_EVERY_S:
            return
        self.probe_at = now
        self.probe_id = next(self.pings)
        self._send(_core.encode({"v": _core.VERSION, "op": "ping", "id": self.probe_id}))

    def _read(self, qid: int | None) -> tuple[int | None, str | None] | None:
        """Reads every reply that is there: a ping's answer brings the link back; the
        answer to ``qid`` is returned; a late answer to an earlier query is withdrawn."""
        found = None
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return found
            try:
                reply = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001 - an undecodable reply answers no query
                continue
            rid = reply.get("id") if isinstance(reply, dict) else None
            if rid is not None and rid == self.probe_id:
                self.down, self.probe_id = False, None
            elif qid is not None and rid == qid:
                found = outcome(reply)
            elif type(rid) is int and rid > 0 and (late := outcome(reply)[0]) is not None:
                self.withdraw(late)

    def close(self) -> None:
        self.sock.close(0)


def outcome(reply: dict[str, Any]) -> tuple[int | None, str | None]:
    """A decoded route reply's rank, or why there is none: ``refused`` (dpcoord's
    error reply) or ``bad_reply`` (anything else)."""
    if reply.get("v") != _core.VERSION:
        return None, "bad_reply"
    if reply.get("ok") is False:
        return None, "refused"
    ranks = reply.get("ranks")
    if reply.get("ok") is True and isinstance(ranks, list) and len(ranks) == 1:
        rank = ranks[0]
        if type(rank) is int and rank >= 0:
            return rank, None
    return None, "bad_reply"


_METRIC: Any = None


def _metric() -> Any:
    """``dpcoord_hook_requests_total``, made once; None without ``prometheus_client``.

    SGLang's ``/metrics`` (``--enable-metrics``) reads every process's samples from
    ``PROMETHEUS_MULTIPROC_DIR``, where a counter made in the controller process
    writes its values whatever registry holds it; it is kept out of the default
    registry, so it never collides with another dpcoord hook's counter of the same
    name in one process."""
    global _METRIC
    if _METRIC is None:
        try:
            from prometheus_client import Counter as PromCounter
        except ImportError:
            return None
        _METRIC = PromCounter(
            "dpcoord_hook_requests",
            "Requests of this SGLang data-parallel controller by how their rank was chosen: by dpcoord, pinned,"
            " or by SGLang's own method because dpcoord was unreachable, late, refused, answered badly,"
            " or answered a rank SGLang has no worker for or holds inactive",
            ["outcome"],
            registry=None,
        )
    return _METRIC
