"""SGLang 0.5.23's real ``DataParallelController`` for the route-hook tests, built
without its ``__init__`` (which launches the schedulers): :func:`make_controller`
sets the attributes the dispatch path reads, and each rank's worker socket records
what the controller sends it (``controller.sent``: ``(rank, request)``) instead of
sending. Requests go in through the controller's own ``_request_dispatcher``, as
its ``event_loop`` hands them over.

:func:`controller_module` imports the controller's module under the suite's
stand-ins, plus stand-ins for the few modules it imports only to launch or name
processes (``setproctitle``; ``sglang.srt.managers.scheduler``, whose
``run_scheduler_process`` it passes to the processes it starts) and for what that
import pulls in without being installed here (``einops``, ``fsspec``)."""

from __future__ import annotations

import importlib
import sys
import uuid
from array import array
from types import SimpleNamespace
from typing import Any

CONTROLLER = "sglang.srt.managers.data_parallel_controller"
#: imported by the controller's module only to launch and name processes, or pulled
#: in by that import and not installed in this suite
STOOD_IN = ("setproctitle", "einops", "fsspec", "sglang.srt.managers.scheduler")


def controller_module(real_modules) -> Any:
    """``sglang.srt.managers.data_parallel_controller``, imported once."""
    if CONTROLLER in sys.modules:
        return sys.modules[CONTROLLER]
    import standins

    placed = {}
    for name in STOOD_IN:
        if name not in sys.modules:
            placed[name] = sys.modules[name] = standins.StandinModule(name)
    try:
        return importlib.import_module(CONTROLLER)
    finally:
        for name, module in placed.items():
            if sys.modules.get(name) is module and name.startswith("sglang."):
                del sys.modules[name]  # a later import of the real scheduler is not hidden


class Worker:
    """A rank's PUSH socket, as ``sock_send`` uses it: records instead of sending."""

    def __init__(self, rank: int, sent: list):
        self.rank, self.sent = rank, sent

    def send_pyobj(self, obj, flags: int = 0, protocol: int = -1) -> None:
        self.sent.append((self.rank, obj))

    def send(self, data, flags: int = 0) -> None:
        self.sent.append((self.rank, data))


class Snapshots:
    """The load-snapshot reader of ``total_requests`` / ``total_tokens``: no loads."""

    def read_all(self) -> list:
        return []


def make_controller(dpc, dp: int, method: str = "round_robin", page_size: int | None = 16):
    """A real ``DataParallelController`` of ``dp`` ranks with ``--load-balance-method
    method`` and ``--page-size page_size``, every rank active; ``controller.sent``
    lists ``(rank, request)`` as the controller sends them."""
    c = object.__new__(dpc.DataParallelController)
    c.server_args = SimpleNamespace(page_size=page_size)
    c.load_balance_method = dpc.LoadBalanceMethod.from_str(method)
    c.round_robin_counter = 0
    c.health_round_robin_counter = 0
    # As __init__ binds it (its source is in the hook's fingerprints).
    c.dispatching = {
        dpc.LoadBalanceMethod.ROUND_ROBIN: c.round_robin_scheduler,
        dpc.LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM: c.follow_bootstrap_room_scheduler,
        dpc.LoadBalanceMethod.TOTAL_REQUESTS: c.total_requests_scheduler,
        dpc.LoadBalanceMethod.TOTAL_TOKENS: c.total_tokens_scheduler,
    }[c.load_balance_method]
    c.refresh_load_budget_on_dispatch = c.load_balance_method in (
        dpc.LoadBalanceMethod.TOTAL_REQUESTS,
        dpc.LoadBalanceMethod.TOTAL_TOKENS,
    )
    c.launch_dp_size = c.max_dp_size = dp
    c.dp_active = [True] * dp
    c.status = [True] * dp
    c._active_workers = list(range(dp))
    c._active_count_cache = dp
    c.dp_budget = dpc.DPBudget(dp)
    c.load_snapshot_reader = Snapshots()
    c._last_refresh_time = 0.0
    c.control_message_step = 1
    c.sent = []
    c.workers = [Worker(r, c.sent) for r in range(dp)]
    c.init_dispatcher()
    return c


def generate(rid: str | None = None, tokens=(1, 2, 3), **fields: Any):
    """A real ``TokenizedGenerateReqInput``, as SGLang's tokenizer manager sends it."""
    io = importlib.import_module("sglang.srt.managers.io_struct")
    sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    return io.TokenizedGenerateReqInput(
        rid=rid or uuid.uuid4().hex,
        input_text="",
        input_ids=array("q", tokens),  # as the tokenizer manager builds it
        input_embeds=None,
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sampling.SamplingParams(max_new_tokens=1),
        return_logprob=False,
        logprob_start_len=-1,
        top_logprobs_num=0,
        token_ids_logprob=None,
        stream=False,
        **fields,
    )


def embedding(rid: str | None = None, tokens=(1, 2, 3), **fields: Any):
    """A real ``TokenizedEmbeddingReqInput``, as SGLang's tokenizer manager sends it."""
    io = importlib.import_module("sglang.srt.managers.io_struct")
    sampling = importlib.import_module("sglang.srt.sampling.sampling_params")
    return io.TokenizedEmbeddingReqInput(
        rid=rid or uuid.uuid4().hex,
        input_text="",
        input_ids=array("q", tokens),
        mm_inputs=None,
        token_type_ids=None,
        sampling_params=sampling.SamplingParams(max_new_tokens=0),
        **fields,
    )


def health_check():
    """The request SGLang's ``/health_generate`` sends (its rid prefix marks it)."""
    constants = importlib.import_module("sglang.srt.constants")
    return generate(f"{constants.HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}", tokens=(0,))


def dispatch(controller, *requests) -> list[int]:
    """Hands ``requests`` to the controller one by one, as its event loop does; the
    rank each was sent to."""
    before = len(controller.sent)
    for r in requests:
        controller._request_dispatcher(r)
    return [rank for rank, _ in controller.sent[before:]]
