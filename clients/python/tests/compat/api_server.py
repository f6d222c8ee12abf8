"""One vLLM API server process for the compat tests with several of them: vLLM's real
``DPLBAsyncMPClient`` (without engines: what it sends is recorded, see vllm_engine.py)
with dpcoord's hook installed by vLLM's own ``load_general_plugins()``, and, when
``DPCOORD_STATS_ENDPOINT`` is set, vLLM's real stat-logger adapter with dpcoord's plugin.

``python api_server.py SERVERS INDEX DP_SIZE REQUESTS [FIRST:COUNT]``, then commands on
stdin, one per line, each answered with one JSON line on stdout. With ``FIRST:COUNT``
the server is one of ``SERVERS`` on a node of a hybrid-LB deployment
(``--data-parallel-hybrid-lb``) whose engines are global ranks ``FIRST..FIRST+COUNT``:

- ``idle``: the engines' stats say this server's engines are idle (as API server 0
  receives them) -> ``{}``
- ``go``: adds ``REQUESTS`` requests at once -> ``{"ranks": [the engine of each],
  "outcomes": {how the hook placed them, counted since the process started}}``
- ``finish``: every request this server sent finishes (STOP), reported as vLLM
  reports it, to this server, per engine -> ``{}``
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

#: where the answers go: vLLM logs to stdout (with vLLM Ascend, its platform plugin at INFO)
ANSWERS, sys.stdout = sys.stdout, sys.stderr

sys.path.insert(0, str(Path(__file__).parent))
import standins  # noqa: E402

standins.install()

import ascend  # noqa: E402
import vllm_engine  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.metrics import loggers, stats  # noqa: E402


def main() -> None:
    servers, index, dp, requests = (int(a) for a in sys.argv[1:5])
    node = [int(x) for x in sys.argv[5].split(":")] if len(sys.argv) > 5 else None
    ranks = list(range(node[0], node[0] + node[1])) if node else list(range(dp))
    from dpcoord import vllm_route

    if ascend.installed():  # vLLM Ascend's platform patches, then every general plugin, as `vllm serve` there
        ascend.start_api_server()
    else:
        load_general_plugins()  # before vLLM's client modules are imported, as in `vllm serve`
        assert vllm_route.HOOK is None
    import vllm.v1.engine.async_llm  # noqa: F401 - what an API server imports: the hook goes in now

    assert vllm_route.HOOK is not None, "the hook was not installed"
    client = vllm_engine.make_dplb_client(None, dp, client_count=servers, client_index=index,
                                          node_ranks=ranks if node else None)
    adapter = None
    factories = loggers.load_stat_logger_plugin_factories()
    if factories:
        config = SimpleNamespace(parallel_config=SimpleNamespace(_api_process_count=servers))
        adapter = loggers.PerEngineStatLoggerAdapter(config, ranks, per_engine_stat_logger_factory=factories[0])
        adapter.log_engine_initialized()
    loop = asyncio.new_event_loop()
    for line in sys.stdin:
        command = line.strip()
        answer: dict = {}
        if command == "idle":
            for engine in ranks:
                adapter.record(stats.SchedulerStats(), None, engine_idx=engine)
        elif command == "go":
            reqs = [vllm_engine.make_request(None, f"s{index}-{uuid.uuid4().hex}", [index, i]) for i in range(requests)]
            async def burst():
                await asyncio.gather(*(client.add_request_async(r) for r in reqs))

            loop.run_until_complete(burst())
            answer["ranks"] = [vllm_engine.rank_of(engine) for _, _, engine in client.sent]
            answer["outcomes"] = dict(vllm_route.HOOK.counts)
        elif command == "finish":
            per_engine = Counter(vllm_engine.rank_of(engine) for _, _, engine in client.sent)
            for engine, n in sorted(per_engine.items()):
                it = stats.IterationStats()
                it.finished_requests = [stats.FinishedRequestStats(finish_reason=FinishReason.STOP) for _ in range(n)]
                adapter.record(stats.SchedulerStats(), it, engine_idx=engine)
        print(json.dumps(answer), file=ANSWERS, flush=True)


if __name__ == "__main__":
    main()
