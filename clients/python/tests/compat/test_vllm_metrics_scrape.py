"""vLLM 0.33.0's own PrometheusStatLogger renders each rank's /metrics (one API server
per rank: the external-LB deployment); dpcoord scrapes them with --vllm-metrics-url
and routes by what they say. The text is rendered here, by the real logger and the
real prometheus_client, and served on 127.0.0.1."""

from __future__ import annotations

import http.server
import threading
from types import SimpleNamespace as NS

import prometheus_client

from conftest import eventually
from record import record


def vllm_config():
    observability = NS(show_hidden_metrics=False, kv_cache_metrics=False, custom_histogram_buckets=None)
    model = NS(served_model_name="m", max_model_len=4096, is_diffusion=False)
    cache = NS(num_gpu_blocks=2048, metrics_info=lambda: {"block_size": "16", "num_gpu_blocks": "2048"})
    return NS(observability_config=observability, model_config=model, cache_config=cache, speculative_config=None,
              kv_transfer_config=None, ec_transfer_config=None, watermark_config=None, lora_config=None)


def render(real, rank: int, running: int, waiting: int, kv: float) -> bytes:
    """What rank `rank`'s own API server serves at /metrics."""
    registry = prometheus_client.REGISTRY
    for collector in list(registry._collector_to_names):  # one API server per process: a fresh registry
        registry.unregister(collector)
    logger = real["vllm.v1.metrics.loggers"].PrometheusStatLogger(vllm_config(), engine_indexes=[rank])
    logger.log_engine_initialized()
    stats = real["vllm.v1.metrics.stats"].SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting,
                                                           kv_cache_usage=kv)
    logger.record(stats, None, engine_idx=rank)
    body = prometheus_client.generate_latest(registry)
    record("vllm_metrics", body)
    return body


class Metrics(http.server.BaseHTTPRequestHandler):
    bodies: dict[str, bytes] = {}

    def do_GET(self):
        body = self.bodies.get(self.path)
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


def test_real_vllm_metrics_bring_ranks_up_and_steer_least_load(real, start_daemon):
    Metrics.bodies = {
        "/rank0": render(real, 0, running=4, waiting=3, kv=0.5),
        "/rank1": render(real, 1, running=1, waiting=0, kv=0.125),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        d = start_daemon("--dp-size", "2", "--policy", "least_load",
                         "--vllm-metrics-url", f"http://127.0.0.1:{port}/rank0",
                         "--vllm-metrics-url", f"http://127.0.0.1:{port}/rank1")
        eventually("both ranks up from their /metrics", lambda: d.statuses() == ["up", "up"])
        counts = [r["counts"] for r in d.state()["ranks"]]
        assert counts == [[3, 4, 0, 0, 0], [0, 1, 0, 0, 0]], counts
        assert d.metric("dpcoord_scrapes_total", 'result="malformed"') == 0
        # least_load: 4*3 + 4 = 16 against 1 on rank 1.
        assert d.call("route", {"v": 1, "op": "route"})["ranks"] == [1]
    finally:
        server.shutdown()
