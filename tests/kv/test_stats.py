"""KV metrics: prompt / cached-per-tier / computed tokens, pages per tier, swap bytes and GB/s."""

from __future__ import annotations

import torch

from kvtier.kv.formats import make_format
from kvtier.kv.manager import CacheManager
from kvtier.kv.pool import PagePool
from kvtier.kv.stats import cache_stats

H, PS, D, LAYERS = 2, 4, 16, 2


def test_cache_stats_count_tokens_pages_and_swaps() -> None:
    fmt = make_format("int8")
    gpu = PagePool(fmt, LAYERS, 3, H, PS, D, "cpu")
    host = PagePool(fmt, LAYERS, 6, H, PS, D, "cpu")
    m = CacheManager(3, PS, num_host_pages=6)

    def run(sid: str, tokens: list[int]) -> int:
        cached = m.add_sequence(sid, tokens)
        assert m.ensure(sid, len(tokens))
        x = m.take_transfers()
        if x.gpu_to_host:
            gpu.copy_to(host, *zip(*x.gpu_to_host))
        if x.host_to_gpu:
            host.copy_to(gpu, *zip(*x.host_to_gpu))
        table = m.page_table(sid)
        slots = torch.tensor([table[i // PS] * PS + i % PS for i in range(cached, len(tokens))])
        for layer in range(LAYERS):
            gpu.write(layer, slots, torch.randn(len(slots), H, D), torch.randn(len(slots), H, D))
        m.commit(sid, tokens)
        m.free(sid)
        return cached

    conv = list(range(8)) + [100]
    assert run("a", conv) == 0  # 9 tokens: 3 pages, 2 full ones indexed
    st = cache_stats(m, gpu, host)
    assert (st["prompt_tokens"], st["computed_tokens"], st["cached_tokens"]) == (9, 9, 0)
    assert (st["gpu_pages_total"], st["gpu_pages_cached"], st["gpu_pages_free"]) == (3, 2, 1)
    assert st["swap_out_bytes"] == 0 and st["swap_out_gbps"] == 0.0
    run("b", [7] * 12)  # needs all 3 GPU pages: a's two cached pages go down to the host
    assert run("c", conv) == 8  # ... and come back
    st = cache_stats(m, gpu, host)
    page = gpu.bytes_per_page()
    assert page == 2 * LAYERS * PS * H * (D + 2)  # K and V: int8 codes + an fp16 scale per (token, head)
    assert st["prompt_tokens"] == 9 + 12 + 9
    assert st["cached_tokens_host"] == 8 and st["cached_tokens_gpu"] == 0
    assert st["computed_tokens"] == 9 + 12 + 1
    assert st["swap_out_bytes"] >= 2 * page and st["swap_in_bytes"] == 2 * page
    assert st["swap_in_seconds"] > 0 and st["swap_in_gbps"] == st["swap_in_bytes"] / st["swap_in_seconds"] / 1e9
    assert st["host_pages_cached"] + st["host_pages_free"] + st["host_pages_used"] == st["host_pages_total"] == 6
    assert st["gpu_pool_bytes"] == 3 * page and st["host_pool_bytes"] == 6 * page
    m.check_integrity()
