"""Engine-level retrieval attention on a tiny random Qwen3: budget >= context == dense greedy output;
a small budget runs mixed steps (prefill chunks beside selecting decode rows) and keeps the pools whole;
with the host tier forced (a compute pool smaller than one sequence), selections that fetch host
pages give the same tokens as the same selections over one big compute pool.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import CacheConfig, EngineConfig, ModelSpec
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams
from kvtier.layers.retrieval import RetrievalAttention, RetrievalConfig
from kvtier.models.decoder import Decoder
from kvtier.models.registry import expected_shapes

SPEC = ModelSpec(arch="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=2,
                 num_heads=8, num_kv_heads=2, head_dim=16, qk_norm=True, max_position_embeddings=512)
PS = 4


def tiny_model() -> Decoder:
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) * 0.3 for n, s in expected_shapes(SPEC).items()}
    return Decoder.from_tensors(SPEC, tensors, torch.float32, "cpu")


def engine(model: Decoder, retrieval: RetrievalConfig | None, num_pages: int = 160, host_kv_mib: int = 0,
           kv_dtype: str = "auto", **kw) -> Engine:
    cache = CacheConfig(num_pages=num_pages, page_size=PS, host_kv_mib=host_kv_mib, kv_dtype=kv_dtype)
    cfg = EngineConfig(device="cpu", dtype="fp32", cache=cache, retrieval=retrieval or RetrievalConfig(), **kw)
    eng = Engine(model, None, cfg, max_model_len=512)
    assert isinstance(eng.runner.backend, RetrievalAttention) == (retrieval is not None)
    return eng


def generate(eng: Engine, n_new: int = 24) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist() for n in (37, 90, 61)]
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    res = eng.generate_sync(reqs)
    return [[t for o in res[r.request_id] for t in o.token_ids] for r in reqs]


def test_budget_at_least_context_is_dense_greedy_output():
    model = tiny_model()
    dense = generate(engine(model, None, prefill_chunk=32))
    eng = engine(model, RetrievalConfig(budget=512, sink=4, window=16), prefill_chunk=32)
    assert generate(eng) == dense
    assert eng.runner.backend.retrieved_rows == 0


def test_small_budget_mixed_steps_run_and_select():
    model = tiny_model()
    eng = engine(model, RetrievalConfig(budget=48, sink=4, window=16), prefill_chunk=16, max_batch=3)
    out = generate(eng)
    assert all(len(o) == 24 for o in out)
    assert eng.runner.backend.retrieved_rows > 0  # decode rows past 48 tokens selected their pages
    eng.manager.check_integrity()
    eng.pool.check_integrity()


@pytest.mark.parametrize("budget", [0, 48])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_host_tier_forced_equals_one_big_pool(kv_dtype, budget):
    """14 compute pages (56 tokens) for prompts of up to 90 + 24 tokens: every sequence offloads its
    oldest pages; with a budget its decode rows select among pages of both tiers (fetching the host
    ones), without one (0) they stream every host page. Run twice: the second time the prompts hit
    the prefix cache in the host tier, and admission swaps pages in that the same round offloads
    again (kv/manager.py's ordered transfer phases)."""
    model = tiny_model()
    cfg = RetrievalConfig(budget=48, sink=4, window=16) if budget else None
    ref = generate(engine(model, cfg, prefill_chunk=16, max_batch=1, kv_dtype=kv_dtype))
    eng = engine(model, cfg, prefill_chunk=16, max_batch=1, num_pages=14, host_kv_mib=1, kv_dtype=kv_dtype)
    assert generate(eng) == ref
    assert eng.manager.stats()["offloads"] > 0
    assert generate(eng) == ref
    assert eng.manager.stats()["hit_tokens_host"] > 0
    if budget:
        st = eng.runner.backend.fetch_stats
        assert st["misses"] > 0 and st["hits"] > 0 and st["asked"] == st["hits"] + st["misses"]
        assert st["miss_bytes"] == st["misses"] * eng.host_pool.bytes_per_page() // SPEC.num_layers
        assert eng.runner.backend.retrieved_rows > 0
    eng.manager.check_integrity()
    eng.pool.check_integrity()
    eng.host_pool.check_integrity()


@pytest.fixture
def graph_formulation(monkeypatch):
    """Decode steps planned as a captured step plans them (layers/retrieval.py `_graph_tables`:
    every row selects, tables over the whole block-table width, pinned pages from `pin_buf`),
    here eagerly on CPU: that formulation's selections are checked where CUDA graphs are absent."""
    monkeypatch.setattr(RetrievalAttention, "graphable", property(lambda self: not self.record))


def test_graph_formulation_budget_at_least_context_is_dense(graph_formulation):
    model = tiny_model()
    dense = generate(engine(model, None, prefill_chunk=32))
    eng = engine(model, RetrievalConfig(budget=512, sink=4, window=16), prefill_chunk=32)
    assert generate(eng) == dense
    assert eng.runner.backend.retrieved_rows > 0  # every decode row selected: all its pages


@pytest.mark.parametrize("selector", ["quest", "hybrid", "hybrid-mid"])
def test_graph_formulation_equals_eager_selection(monkeypatch, selector):
    model = tiny_model()
    cfg = RetrievalConfig(budget=48, sink=4, window=16, selector=selector)
    eager = generate(engine(model, cfg, prefill_chunk=16, max_batch=3))
    monkeypatch.setattr(RetrievalAttention, "graphable", property(lambda self: not self.record))
    eng = engine(model, cfg, prefill_chunk=16, max_batch=3)
    assert generate(eng) == eager
    assert eng.runner.backend.pin_buf is not None  # the graph formulation ran


@pytest.mark.parametrize("kv_dtype,selector,bits", [("auto", "hybrid", 16), ("int8", "hybrid", 16),
                                                   ("auto", "hybrid-mid", 16), ("auto", "hybrid-mid", 8),
                                                   ("int8", "quest", 8)])
def test_graph_formulation_host_tier_forced_equals_one_big_pool(graph_formulation, kv_dtype, selector, bits):
    """bits 8: the 8-bit summaries travel with their pages between the tiers (kv/summaries.py)."""
    model = tiny_model()
    cfg = RetrievalConfig(budget=48, sink=4, window=16, selector=selector, summary_bits=bits)
    ref = generate(engine(model, cfg, prefill_chunk=16, max_batch=1, kv_dtype=kv_dtype))
    eng = engine(model, cfg, prefill_chunk=16, max_batch=1, num_pages=14, host_kv_mib=1, kv_dtype=kv_dtype)
    assert generate(eng) == ref
    assert eng.manager.stats()["offloads"] > 0 and eng.runner.backend.pin_buf is not None
    backend = eng.runner.backend  # hybrid-mid keeps no key sums, in either tier
    assert (backend.summaries.ksum is None) == (backend.host_summaries.ksum is None) == (selector != "hybrid")
    assert backend.summaries.codes == backend.host_summaries.codes == (bits == 8)


def test_gpu_cache_needs_cuda_and_says_so(caplog):
    """--kvmem-gpu-cache is a CUDA feature (kernels/hot_pages.py): asked for on the CPU, the engine
    reserves no pages, warns why, and the host tier keeps its planned size."""
    model = tiny_model()
    with caplog.at_level("WARNING", logger="kvtier"):
        eng = engine(model, RetrievalConfig(budget=48, sink=4, window=16, gpu_cache=-1), num_pages=40,
                     host_kv_mib=1)
    assert eng.gpu_cache_pages == 0 and eng.runner.backend.hot is None
    assert eng.manager.num_gpu_pages == 40
    assert any("--kvmem-gpu-cache ignored" in r.message and "CUDA" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvtier"):
        engine(model, RetrievalConfig(budget=48, sink=4, window=16), num_pages=40, host_kv_mib=1)
    assert not caplog.records  # off by default: nothing to say
