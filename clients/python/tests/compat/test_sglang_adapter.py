"""dpcoord's SGLang adapter with SGLang 0.5.23's real LoadSnapshot and metrics
SchedulerStats (QueueCount request counts), against the real dpcoord."""

from __future__ import annotations

from dpcoord import EngineCounters, StatsPublisher, publish_sglang
from conftest import eventually


def test_load_snapshot_token_load_is_sglangs_total_tokens(real, start_daemon):
    d = start_daemon("--dp-size", "1", "--policy", "least_tokens")
    snap = real["sglang.srt.managers.load_snapshot"].LoadSnapshot(
        dp_rank=0, num_running_reqs=3, num_waiting_reqs=2, num_used_tokens=700, num_total_tokens=900, token_usage=0.4
    )
    with StatsPublisher(d.stats, 0, bind=False) as pub:
        counters = EngineCounters()

        def shown():
            sent = publish_sglang(pub, snap, counters)
            assert sent["tokens"] == [200, 700] and sent["kv_usage"] == 0.4
            rank = d.state()["ranks"][0]
            return rank["status"] == "up" and rank["counts"] == [2, 3, 5, 0, 0] and rank["load"] == 900

        eventually("the snapshot applied, token load 900", shown)


def test_metrics_scheduler_stats_with_queue_counts(real, start_daemon):
    d = start_daemon("--dp-size", "1")
    mc = real["sglang.srt.observability.metrics_collector"]
    stats = mc.SchedulerStats(
        num_running_reqs=mc.QueueCount(total=4, by_priority={0: 4}),
        num_queue_reqs=mc.QueueCount(total=1),
        num_used_tokens=500,
        token_usage=0.3,
    )
    with StatsPublisher(d.stats, 0, bind=False) as pub:
        counters = EngineCounters()

        def shown():
            sent = publish_sglang(pub, stats, counters, waiting_tokens=120)
            assert sent["tokens"] == [120, 500]
            return d.state()["ranks"][0]["counts"] == [1, 4, 5, 0, 0]

        eventually("the metrics stats applied", shown)
