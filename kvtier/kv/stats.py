"""KV cache metrics: the manager's counters plus the pools' swap traffic, in one dict.

The server turns these into prometheus metrics and usage fields:

    prompt_tokens          prompt tokens looked up (each admission, resumes included)
    cached_tokens_gpu      of those, served by GPU-resident prefix pages
    cached_tokens_host     ... by host-tier pages swapped back in
    computed_tokens        tokens whose KV was computed (prefill and decode)
    {gpu,host}_pages_{total,used,cached,free}   pages per tier and state
    swap_out_bytes / swap_out_seconds / swap_out_gbps   GPU -> host page copies
    swap_in_bytes / swap_in_seconds / swap_in_gbps      host -> GPU page copies
"""

from __future__ import annotations

from typing import Any

from kvtier.kv.manager import CacheManager
from kvtier.kv.pool import PagePool


def cache_stats(manager: CacheManager, gpu_pool: PagePool, host_pool: PagePool | None = None) -> dict[str, Any]:
    """Manager counters and page states, plus swap bytes, seconds and GB/s per direction."""
    st: dict[str, Any] = dict(manager.stats())
    st["cached_tokens_gpu"] = st["hit_tokens_gpu"]
    st["cached_tokens_host"] = st["hit_tokens_host"]
    st["cached_tokens"] = st["hit_tokens_gpu"] + st["hit_tokens_host"]
    st["gpu_pool_bytes"] = gpu_pool.bytes_total()
    st["host_pool_bytes"] = host_pool.bytes_total() if host_pool is not None else 0
    out = gpu_pool.transfer_stats()  # copies out of the GPU pool go down to the host tier
    back = host_pool.transfer_stats() if host_pool is not None else {}
    for name, src in (("swap_out", out), ("swap_in", back)):
        st[f"{name}_bytes"] = int(src.get("copy_bytes", 0))
        st[f"{name}_seconds"] = float(src.get("copy_seconds", 0.0))
        st[f"{name}_gbps"] = float(src.get("copy_gbps", 0.0))
    return st
