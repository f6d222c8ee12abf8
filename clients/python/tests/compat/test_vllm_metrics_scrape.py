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


def vllm_config(model_name="m", everything=False, max_loras=0, max_model_len=4096):
    """`everything`: the hidden and the KV-cache families too."""
    observability = NS(show_hidden_metrics=everything, kv_cache_metrics=everything, custom_histogram_buckets=None)
    model = NS(served_model_name=model_name, max_model_len=max_model_len, is_diffusion=False)
    cache = NS(num_gpu_blocks=2048, metrics_info=lambda: {"block_size": "16", "num_gpu_blocks": "2048"})
    lora = NS(max_loras=max_loras) if max_loras else None
    return NS(observability_config=observability, model_config=model, cache_config=cache, speculative_config=None,
              kv_transfer_config=None, ec_transfer_config=None, watermark_config=None, lora_config=lora)


def fresh_registry():
    """One API server per process: a fresh registry."""
    registry = prometheus_client.REGISTRY
    for collector in list(registry._collector_to_names):
        registry.unregister(collector)
    return registry


def render(real, rank: int, running: int, waiting: int, kv: float) -> bytes:
    """What rank `rank`'s own API server serves at /metrics."""
    registry = fresh_registry()
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
        assert [r["kv_usage"] for r in d.state()["ranks"]] == [0.5, 0.125]
        eventually("the KV gauges", lambda: [d.metric("dpcoord_engine_kv_usage", f'dp_rank="{r}"') for r in (0, 1)]
                   == [0.5, 0.125])
        assert d.metric("dpcoord_scrapes_total", 'result="malformed"') == 0
        # least_load: 4*3 + 4 = 16 against 1 on rank 1 (at usage 0.5, no KV pressure yet).
        assert d.call("route", {"v": 1, "op": "route"})["ranks"] == [1]
    finally:
        server.shutdown()


#: dpcoord's cap on a scraped body (crates/daemon/src/wire/vllm_metrics/mod.rs, MAX_BODY_BYTES).
MAX_BODY_BYTES = 1 << 20
#: What the cap must leave over the largest realistic body.
HEADROOM = 2.0


def test_the_largest_realistic_body_fits_the_cap_and_is_read(real, start_daemon):
    """The biggest /metrics a realistic server renders: 8 engines behind one API server
    (a node of a hybrid-LB deployment), every family vLLM 0.33 has (the hidden and the
    KV-cache ones included), a long model name, a 128k context (more histogram buckets
    for token counts) and 4 LoRAs in 16 combinations (each
    adds a `vllm:lora_requests_info` series). It must fit dpcoord's body cap with
    `HEADROOM` to spare and be read whole (the 8 engines summed). ``pytest -s`` prints
    the sizes (docs/engines.md)."""
    loggers, stats = real["vllm.v1.metrics.loggers"], real["vllm.v1.metrics.stats"]
    sizes = {}
    for engines, loras, everything in ((1, 0, False), (1, 4, True), (8, 0, False), (8, 4, True)):
        registry = fresh_registry()
        config = vllm_config("meta-llama/Llama-3.1-70B-Instruct", everything, loras, max_model_len=131_072)
        logger = loggers.PrometheusStatLogger(config, engine_indexes=list(range(engines)))
        logger.log_engine_initialized()
        names = [f"adapter-{i}" for i in range(loras)]
        for e in range(engines):
            for combo in range(16 if loras else 1):
                s = stats.SchedulerStats(num_running_reqs=e + 1, num_waiting_reqs=2, kv_cache_usage=0.25)
                s.running_lora_adapters = {n: 1 for j, n in enumerate(names) if combo >> j & 1}
                s.waiting_lora_adapters = {n: 1 for j, n in enumerate(names) if not combo >> j & 1}
                logger.record(s, None, engine_idx=e)
        sizes[(engines, loras, everything)] = prometheus_client.generate_latest(registry)
    for (engines, loras, everything), body in sizes.items():
        print(f"vLLM /metrics, {engines} engine(s), {loras} LoRAs, every family: {everything}: "
              f"{len(body):,} B ({len(body) // engines:,} B per engine); the cap is "
              f"{MAX_BODY_BYTES / len(body):.2f}x")
    largest = sizes[(8, 4, True)]
    assert len(largest) * HEADROOM <= MAX_BODY_BYTES, len(largest)

    Metrics.bodies = {"/big": largest}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        d = start_daemon("--dp-size", "1", "--vllm-metrics-url", f"http://127.0.0.1:{server.server_address[1]}/big")
        eventually("the rank up from the largest body", lambda: d.statuses() == ["up"])
        # 8 engines of 2 waiting each; running 1 + 2 + ... + 8.
        assert d.state()["ranks"][0]["counts"][:2] == [16, 36]
        assert d.metric("dpcoord_scrapes_total", 'result="too_large"') == 0
        assert d.metric("dpcoord_scrapes_total", 'result="malformed"') == 0
    finally:
        server.shutdown()


def render_steps(real, rank: int, running: int, steps: int) -> bytes:
    """Rank `rank`'s /metrics after `steps` engine steps of 8 generated tokens each,
    recorded by vLLM's own logger (its token counters are what dpcoord reads as progress)."""
    registry = fresh_registry()
    stats_mod = real["vllm.v1.metrics.stats"]
    logger = real["vllm.v1.metrics.loggers"].PrometheusStatLogger(vllm_config(), engine_indexes=[rank])
    logger.log_engine_initialized()
    for _ in range(steps):
        it = stats_mod.IterationStats()
        it.num_generation_tokens = 8
        logger.record(stats_mod.SchedulerStats(num_running_reqs=running, kv_cache_usage=0.25), it, engine_idx=rank)
    return prometheus_client.generate_latest(registry)


def test_a_rank_whose_token_counters_stop_with_work_is_stalled(real, start_daemon, tmp_path):
    """The API server answers /metrics while its engine is wedged: the gauges still
    say 3 running, and only the token counters (prompt + generation) tell that the
    engine stopped stepping. dpcoord reads them as progress: stalled, then back."""
    Metrics.bodies = {"/rank0": render_steps(real, 0, running=3, steps=4)}
    assert b'vllm:generation_tokens_total{engine="0",model_name="m"} 32.0' in Metrics.bodies["/rank0"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    cfg = tmp_path / "stall.toml"
    cfg.write_text("[engines]\nstall_after_ms = 1000\n")
    try:
        d = start_daemon("--dp-size", "1", "--config", str(cfg), "--vllm-metrics-url", f"http://127.0.0.1:{port}/rank0")
        eventually("rank 0 up", lambda: d.statuses() == ["up"])
        eventually("rank 0 stalled", lambda: d.statuses() == ["stalled"], deadline=10)
        assert d.state()["ranks"][0]["stall"] == "progress"
        stepping = threading.Event()

        def engine_steps_again():
            steps = 5
            while not stepping.is_set():
                Metrics.bodies = {"/rank0": render_steps(real, 0, running=3, steps=steps)}
                steps += 1
                stepping.wait(0.1)

        t = threading.Thread(target=engine_steps_again, daemon=True)
        t.start()
        try:
            eventually("rank 0 back once its counters move", lambda: d.statuses() == ["up"])
        finally:
            stepping.set()
            t.join()
    finally:
        server.shutdown()
