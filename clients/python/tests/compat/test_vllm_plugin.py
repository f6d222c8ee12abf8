"""dpcoord's vLLM stat-logger plugin, loaded by vLLM 0.33.0's own plugin loader and
driven with vLLM's real SchedulerStats / IterationStats, against the real dpcoord."""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from conftest import eventually


@pytest.fixture
def plugin(real, monkeypatch, tmp_path):
    """``plugin(endpoint, api_servers=1, engines=1)``: one vLLM ``PerEngineStatLoggerAdapter``
    per API server, each built by vLLM from the factory its plugin loader found, for
    engines ``0..engines``."""
    loggers_mod = real["vllm.v1.metrics.loggers"]
    made = []

    def make(endpoint: str, api_servers: int = 1, engines: int = 1, **env: str):
        monkeypatch.setenv("DPCOORD_STATS_ENDPOINT", endpoint)
        monkeypatch.setenv("DPCOORD_STATE_DIR", str(tmp_path / "ledgers"))
        monkeypatch.setenv("DPCOORD_GROUP", uuid.uuid4().hex)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        factories = loggers_mod.load_stat_logger_plugin_factories()
        from dpcoord.vllm_plugin import DpcoordStatLogger

        assert factories == [DpcoordStatLogger], factories
        config = SimpleNamespace(parallel_config=SimpleNamespace(_api_process_count=api_servers))
        servers = [
            loggers_mod.PerEngineStatLoggerAdapter(
                config, list(range(engines)), per_engine_stat_logger_factory=factories[0]
            )
            for _ in range(api_servers)
        ]
        for s in servers:
            s.log_engine_initialized()
            made.extend(s.per_engine_stat_loggers.values())
        return servers

    yield make
    for lg in made:
        lg.close()


def sched(real, waiting=0, running=0, kv=0.0):
    return real["vllm.v1.metrics.stats"].SchedulerStats(
        num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv
    )


def finished(real, *reasons):
    stats = real["vllm.v1.metrics.stats"]
    it = stats.IterationStats()
    it.finished_requests = [stats.FinishedRequestStats(finish_reason=r) for r in reasons]
    return it


def test_plugin_is_a_vllm_stat_logger_found_by_vllm(real):
    loggers_mod = real["vllm.v1.metrics.loggers"]
    [factory] = loggers_mod.load_stat_logger_plugin_factories()
    assert issubclass(factory, loggers_mod.StatLoggerBase)
    assert factory.__module__ == "dpcoord.vllm_plugin"


def test_eight_idle_ranks_stay_up_for_10_s(real, plugin, start_daemon):
    d = start_daemon("--dp-size", "8")  # liveness at the defaults: stale after 1 s, down after 3 s
    [server] = plugin(d.stats, engines=8)
    for engine in range(8):
        server.record(sched(real, running=1, kv=0.1), None, engine_idx=engine)
    eventually("all 8 ranks up", lambda: d.statuses() == ["up"] * 8)
    for engine in range(8):
        server.record(sched(real), finished(real, real["vllm.v1.engine"].FinishReason.STOP), engine_idx=engine)
    seen = set()
    end = time.monotonic() + 10.0
    while time.monotonic() < end:  # the engines are idle: vLLM calls record() no more
        ranks = d.state()["ranks"]
        seen.update(r["status"] for r in ranks)
        assert all(r["age_ms"] < 1000 for r in ranks), ranks
        time.sleep(0.2)
    assert seen == {"up"}
    assert [r["counts"] for r in d.state()["ranks"]] == [[0, 0, 1, 1, 0]] * 8


def test_two_api_servers_publish_one_rank_without_stale_drops(real, plugin, start_daemon):
    d = start_daemon("--dp-size", "1")
    a, b = plugin(d.stats, api_servers=2)
    a.record(sched(real, waiting=2, running=3, kv=0.5), None, engine_idx=0)  # only A gets engine 0's stats
    eventually("rank 0 up with A's stats", lambda: d.state()["ranks"][0]["counts"][:2] == [2, 3])
    time.sleep(1.0)  # settled
    stale = d.metric("dpcoord_stats_messages_total", 'result="stale"')
    ok = d.metric("dpcoord_stats_messages_total", 'result="ok"')
    boot = d.state()["ranks"][0]["boot"]
    end = time.monotonic() + 4.0
    while time.monotonic() < end:
        rank = d.state()["ranks"][0]
        assert rank["status"] == "up" and rank["counts"][:2] == [2, 3], rank
        time.sleep(0.2)
    assert d.metric("dpcoord_stats_messages_total", 'result="stale"') == stale == 0
    assert d.metric("dpcoord_stats_messages_total", 'result="ok"') > ok + 8  # the timer kept publishing
    # The engine's stats move to the other API server (vLLM sends each step's to one of them).
    b.record(sched(real, running=1), finished(real, 0, 0, 0, 0), engine_idx=0)
    a.record(None, finished(real, 0), engine_idx=0)  # A's own request finished in the same step
    b.record(sched(real, running=1), None, engine_idx=0)  # the next step
    eventually("B's steps applied", lambda: d.state()["ranks"][0]["counts"] == [0, 1, 6, 5, 0])
    time.sleep(1.5)
    rank = d.state()["ranks"][0]
    assert rank["status"] == "up" and rank["boot"] == boot and rank["counts"] == [0, 1, 6, 5, 0]
    for key in ("stale", "malformed"):
        assert d.metric("dpcoord_stats_messages_total", f'result="{key}"') == 0, key


def test_kv_cache_usage_is_exported_and_weighs_the_queue(real, plugin, start_daemon):
    """vLLM's own SchedulerStats.kv_cache_usage through the plugin: shown per rank,
    and a nearly full KV cache makes a rank's queue weigh more under least_load."""
    d = start_daemon("--dp-size", "2", "--policy", "least_load")
    [server] = plugin(d.stats, engines=2)
    server.record(sched(real, waiting=2, running=4, kv=0.875), None, engine_idx=0)
    server.record(sched(real, waiting=2, running=4, kv=0.125), None, engine_idx=1)
    eventually("both ranks with their usage", lambda: [r["kv_usage"] for r in d.state()["ranks"]] == [0.875, 0.125])
    # received is inferred as waiting + running, so nothing is pending:
    # 3.25 * 4*2 + 4 = 30 against 4*2 + 4 = 12 (docs/routing.md, KV pressure).
    assert [r["load"] for r in d.state()["ranks"]] == [30.0, 12.0]
    assert d.call("route", {"v": 1, "op": "route"})["ranks"] == [1]
    eventually("the gauges", lambda: [d.metric("dpcoord_engine_kv_usage", f'dp_rank="{r}"') for r in (0, 1)]
               == [0.875, 0.125])
    # A NaN usage is left out of the update (dpcoord would refuse the whole update).
    server.record(sched(real, waiting=2, running=4, kv=float("nan")), None, engine_idx=0)
    eventually("rank 0 without a usage", lambda: d.state()["ranks"][0]["kv_usage"] is None)
    assert d.metric("dpcoord_stats_messages_total", 'result="malformed"') == 0


class Tap:
    """A stats endpoint that records every update and forwards it to dpcoord."""

    def __init__(self, endpoint: str, dpcoord_stats: str):
        ctx = zmq.Context.instance()
        self.sub, self.pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(endpoint)
        self.pub.connect(dpcoord_stats)
        self.updates: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self.sub.poll(50):
                frame = self.sub.recv()
                self.updates.append(msgpack.unpackb(frame))
                self.pub.send(frame)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sub.close(0)
        self.pub.close(0)


def test_tpot_ttft_and_client_aborts(real, plugin, start_daemon, tmp_path):
    d = start_daemon("--dp-size", "1")
    tap = Tap(f"ipc://{tmp_path}/tap", d.stats)
    try:
        [server] = plugin(f"ipc://{tmp_path}/tap", DPCOORD_ABORT_GRACE_MS="300")
        stats = real["vllm.v1.metrics.stats"]
        it = stats.IterationStats()
        it.time_to_first_tokens_iter = [0.120, 0.080]
        it.inter_token_latencies_iter = [0.020, 0.040]
        server.record(sched(real, waiting=1, running=2), it, engine_idx=0)
        eventually("rank 0 up", lambda: d.statuses() == ["up"])
        sent = tap.updates[-1]
        assert sent["tpot_ms"] == pytest.approx(30.0) and sent["ttft_ms"] == pytest.approx(100.0)
        assert "tokens" not in sent  # vLLM reports no token load: none is made up
        stop = real["vllm.v1.engine"].FinishReason.STOP
        # One request finishes (STOP), the waiting one starts; then a client aborts one, which
        # vLLM never reports to a stat logger: the engine simply lists it no more.
        server.record(sched(real, waiting=0, running=2), finished(real, stop))
        server.record(sched(real, waiting=0, running=1), None)
        eventually("the abort counted as failed", lambda: d.state()["ranks"][0]["counts"] == [0, 1, 3, 1, 1])
        server.record(sched(real, waiting=0, running=0), finished(real, stop))
        time.sleep(1.0)
        assert d.state()["ranks"][0]["counts"] == [0, 0, 3, 2, 1]  # the abort counted once
        # A stop string found by the API server: finished there while the engine still lists it.
        server.record(sched(real, running=1), None)
        server.record(sched(real, running=1), finished(real, stop))
        server.record(sched(real, running=1), None)
        server.record(sched(real, running=0), None)
        time.sleep(1.0)
        assert d.state()["ranks"][0]["counts"] == [0, 0, 4, 3, 1]  # not an abort too
        assert d.metric("dpcoord_stats_messages_total", 'result="malformed"') == 0
    finally:
        tap.close()


def test_a_wedged_engine_is_stalled_while_the_timer_keeps_reporting(real, start_daemon, tmp_path, monkeypatch):
    """vLLM's own ``StatLoggerManager`` (as ``AsyncLLM`` builds it, the plugin found by
    vLLM's loader and vLLM's ``PrometheusStatLogger`` beside it) calls the plugin on each
    engine step; the plugin's timer runs in the API server and repeats the last gauges
    every 250 ms whether or not the engine stepped. Each update also carries the steps
    the engine made (``progress``), so dpcoord tells a busy engine that stopped stepping
    from an idle one, and brings it back when it steps again."""
    from test_vllm_metrics_scrape import fresh_registry, vllm_config

    cfg = tmp_path / "stall.toml"
    cfg.write_text("[engines]\nstall_after_ms = 1000\n")
    d = start_daemon("--dp-size", "2", "--config", str(cfg))
    monkeypatch.setenv("DPCOORD_STATS_ENDPOINT", d.stats)
    monkeypatch.setenv("DPCOORD_STATE_DIR", str(tmp_path / "ledgers"))
    monkeypatch.setenv("DPCOORD_GROUP", uuid.uuid4().hex)
    loggers_mod = real["vllm.v1.metrics.loggers"]
    factories = loggers_mod.load_stat_logger_plugin_factories()
    fresh_registry()
    manager = loggers_mod.StatLoggerManager(
        vllm_config(), engine_idxs=[0, 1], custom_stat_loggers=factories, enable_default_loggers=False
    )
    manager.log_engine_initialized()
    ours = [lg for a in manager.stat_loggers for lg in getattr(a, "per_engine_stat_loggers", {}).values()]
    assert len(ours) == 2, manager.stat_loggers
    try:
        manager.record(sched(real, running=3), None, engine_idx=0)  # rank 0: a step, then wedged
        manager.record(sched(real), None, engine_idx=1)  # rank 1: a step, then idle
        eventually("both up", lambda: d.statuses() == ["up", "up"])
        eventually("rank 0 stalled, rank 1 up", lambda: d.statuses() == ["stalled", "up"], deadline=10)
        assert d.state()["ranks"][0]["stall"] == "progress"
        for _ in range(2):  # readmit_updates: two updates in a row that show steps
            manager.record(sched(real, running=3), None, engine_idx=0)
            time.sleep(0.05)
        eventually("rank 0 back", lambda: d.statuses() == ["up", "up"])
    finally:
        for lg in ours:
            lg.close()
