"""The GPU cache of selected host pages (kvtier/kernels/hot_pages.py), on CUDA.

- the kernel's invariants (tests/layers/hot_pages_cases.py; programs race here, so not the
  interpreter's exact slots): attention over the rewritten lists == reading the host pages in
  place, rows copied per kv head, repeated selections hit, invalidated pages brought up again;
  plain, int8 and k8v4 pages in pinned host memory, with room and with a ring too small;
- an engine whose sequences outgrow the GPU pool, retrieval's decode reading host pages through
  the cache (CUDA graphs and eager) == one big GPU pool == the host tier read in place without
  the cache: the same greedy tokens; the cache was used (entries looked up, pages brought up).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.config import ModelSpec, RetrievalConfig  # noqa: E402
from kvtier.engine.engine import Engine  # noqa: E402
from kvtier.models.decoder import Decoder  # noqa: E402
from tests.gpu import test_host_tier as host_tier  # noqa: E402
from tests.layers import hot_pages_cases  # noqa: E402


@pytest.mark.parametrize("name,dtype,slots", [("fp32", torch.float32, 64), ("bf16", torch.bfloat16, 64),
                                              ("int8", torch.float16, 64), ("k8v4", torch.bfloat16, 64),
                                              ("k8v4", torch.float16, 4)])
def test_kernel_invariants(name, dtype, slots):
    import kvtier.kernels.hot_pages as hp
    import kvtier.kernels.retrieval_attention as ra
    hot_pages_cases.check_hot_pages(hp, ra, name, dtype, "cuda", 7, slots, exact=False, kernel_attention=True)


SPEC = ModelSpec(arch="qwen3", vocab_size=256, hidden_size=256, intermediate_size=384, num_layers=3,
                 num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=4096)
LENGTHS = (1900, 1700)  # both past the small pool's 96 sequence pages (128 less the 32 cache pages)
GEN = 24
RET = RetrievalConfig(budget=256, sink=4, window=32)
CACHE = 512  # tokens: 32 pages, a quarter of the small pool (HOT_POOL_SHARE)


@pytest.fixture(scope="module")
def model() -> Decoder:
    return host_tier.random_model(torch.float32, SPEC)


def run(model: Decoder, kv: str, num_pages: int, host_kv_mib: int = 0, gpu_cache: int = CACHE,
        graphs: str = "auto") -> tuple[list[list[int]], Engine]:
    ret = RetrievalConfig(budget=RET.budget, sink=RET.sink, window=RET.window, gpu_cache=gpu_cache)
    return host_tier.run(model, kv, num_pages, host_kv_mib, ret, graphs, lengths=LENGTHS, gen=GEN,
                         max_model_len=4096, prefill_chunk=256)


@pytest.mark.parametrize("kv", ["fp32", "k8v4"])
def test_engine_with_cache_equals_one_big_pool(model, kv):
    big, _ = run(model, kv, num_pages=512)
    plain, eng0 = run(model, kv, num_pages=128, host_kv_mib=64, gpu_cache=RetrievalConfig.gpu_cache)  # default: off
    assert eng0.gpu_cache_pages == 0 and eng0.runner.backend.hot is None
    cached, eng = run(model, kv, num_pages=128, host_kv_mib=64)
    be = eng.runner.backend
    assert eng.gpu_cache_pages == 32 and be.hot is not None and be.in_place_host_rows > 0
    assert eng.runner.host_graph_steps > GEN // 2
    stats = be.gpu_cache_stats()
    print(f"\n{kv}: GPU cache {stats}")
    assert stats["asked"] > 0 and stats["brought"] > 0 and stats["hits"] > 0
    assert plain == big
    assert cached == big
    eager, eng = run(model, kv, num_pages=128, host_kv_mib=64, graphs="off")
    assert eng.runner.graph_steps == 0 and eng.runner.backend.gpu_cache_stats()["hits"] > 0
    assert eager == big
