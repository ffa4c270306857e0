"""Prometheus metrics, one registry per app (so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Request-latency buckets (seconds): from a cached short answer to a long agent turn.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


# KV cache figures from Engine.stats()["cache"] (kvtier/kv/stats.py cache_stats), as gauges.
KV_GAUGES = {
    "prompt_tokens": "prompt tokens seen by the cache manager",
    "computed_tokens": "tokens the model computed KV for (uncached prompt tokens and generated ones)",
    "cached_tokens_gpu": "prompt tokens served from prefix-cache pages on the GPU tier",
    "cached_tokens_host": "prompt tokens served from prefix-cache pages on the host tier",
    "gpu_pages_total": "pages in the GPU (compute-device) pool",
    "gpu_pages_used": "GPU pages held by running sequences",
    "gpu_pages_cached": "GPU pages held only by the prefix cache",
    "gpu_pages_free": "free GPU pages",
    "host_pages_total": "pages in the host-RAM tier",
    "host_pages_used": "host pages held by running sequences",
    "host_pages_cached": "host pages held only by the prefix cache",
    "host_pages_free": "free host pages",
    "swap_out_bytes": "bytes copied GPU -> host",
    "swap_in_bytes": "bytes copied host -> GPU",
    "swap_out_gbps": "GPU -> host copy rate, GB/s",
    "swap_in_gbps": "host -> GPU copy rate, GB/s",
}


class Metrics:
    def __init__(self, engine, admission):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_requests", "HTTP API requests", ["endpoint", "status"], registry=r)
        self.finished = Counter("kvtier_finished", "generations by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter("kvtier_cached_prompt_tokens", "prompt tokens from the prefix cache",
                                     registry=r)
        self.completion_tokens = Counter("kvtier_completion_tokens", "generated tokens", registry=r)
        self.latency = Histogram("kvtier_request_seconds", "request wall time", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvtier_time_to_first_token_seconds", "time to first output", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.engine_running = Gauge("kvtier_engine_running", "sequences running in the engine", registry=r)
        self.engine_waiting = Gauge("kvtier_engine_waiting", "sequences waiting in the engine", registry=r)
        self.server_active = Gauge("kvtier_server_active", "requests holding an engine slot", registry=r)
        self.server_queued = Gauge("kvtier_server_queued", "requests queued for a slot", registry=r)
        self.kv = {key: Gauge(f"kvtier_kv_{key}", doc, registry=r) for key, doc in KV_GAUGES.items()}
        self._engine = engine
        self._admission = admission

    def observe_finish(self, reason: str, usage) -> None:
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.completion_tokens.inc(usage.completion_tokens)

    def render(self) -> bytes:
        stats = self._engine.stats()
        self.engine_running.set(stats.get("running", 0))
        self.engine_waiting.set(stats.get("waiting", 0))
        self.server_active.set(self._admission.active)
        self.server_queued.set(self._admission.queued)
        cache = stats.get("cache") or {}
        for key, gauge in self.kv.items():
            if key in cache:
                gauge.set(cache[key])
        return generate_latest(self.registry)
