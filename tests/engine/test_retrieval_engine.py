"""Engine-level retrieval attention on a tiny random Qwen3: budget >= context == dense greedy output;
a small budget runs mixed steps (prefill chunks beside selecting decode rows) and keeps the pools whole.

The engine builds its backend from EngineConfig (engine/engine.py), which has no kvmem field yet, so
these tests put a RetrievalAttention over the engine's own pool in place of the dense backend.
"""

from __future__ import annotations

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


def engine(model: Decoder, retrieval: RetrievalConfig | None, **kw) -> Engine:
    cfg = EngineConfig(device="cpu", dtype="fp32", cache=CacheConfig(num_pages=160, page_size=PS), **kw)
    eng = Engine(model, None, cfg, max_model_len=512)
    if retrieval is not None:
        eng.runner.backend = RetrievalAttention(eng.pool, SPEC.head_dim ** -0.5, retrieval)
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
