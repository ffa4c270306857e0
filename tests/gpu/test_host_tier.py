"""Sequences longer than the GPU pool, with the Triton kernels reading the host tier (CUDA only).

The paged kernels take negative page ids as pages of a second source (kernels/paged_attention.py
AltPages): decode steps read the host pages over the bus in place, prefill chunks read a staging
copy made per layer, and retrieval's selected-pages kernel reads the chosen host pages in place.
Each run is checked against one big GPU pool: the same greedy tokens.
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

from kvtier.config import CacheConfig, EngineConfig, ModelSpec, RetrievalConfig  # noqa: E402
from kvtier.engine.engine import Engine  # noqa: E402
from kvtier.engine.request import Request, SamplingParams  # noqa: E402
from kvtier.layers.retrieval import RetrievalAttention  # noqa: E402
from kvtier.models.decoder import Decoder  # noqa: E402
from kvtier.models.registry import expected_shapes  # noqa: E402

SPEC = ModelSpec(arch="qwen3", vocab_size=256, hidden_size=256, intermediate_size=384, num_layers=3,
                 num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True, max_position_embeddings=2048)
PS = 16
LENGTHS = (300, 41, 213)  # two longer than the small pool (10 pages = 160 tokens)
GEN = 20


def random_model(dtype: torch.dtype, spec: ModelSpec = SPEC) -> Decoder:
    """`spec` with seeded random weights on CUDA, in `dtype`."""
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=g) * 0.2 for n, s in expected_shapes(spec).items()}
    return Decoder.from_tensors(spec, tensors, dtype, "cuda")


@pytest.fixture(scope="module")
def model() -> Decoder:
    return random_model(torch.float32)


@pytest.fixture(scope="module")
def model_bf16() -> Decoder:
    return random_model(torch.bfloat16)


def run(model: Decoder, kv: str, num_pages: int, host_kv_mib: int = 0,
        retrieval: RetrievalConfig | None = None, graphs: str = "auto",
        max_batch: int = 2, lengths: tuple[int, ...] = LENGTHS, gen: int = GEN, max_model_len: int = 1024,
        prefill_chunk: int = 64) -> tuple[list[list[int]], Engine]:
    """Greedy tokens of `lengths` random prompts (gen each) through an engine of this config."""
    dtype = "bf16" if model.dtype == torch.bfloat16 else "fp32"
    cfg = EngineConfig(device="cuda", dtype=dtype, max_batch=max_batch, prefill_chunk=prefill_chunk,
                       cuda_graphs=graphs, retrieval=retrieval or RetrievalConfig(),
                       cache=CacheConfig(kv_dtype=kv, num_pages=num_pages, page_size=PS, host_kv_mib=host_kv_mib))
    eng = Engine(model, None, cfg, model_name="random", max_model_len=max_model_len)
    g = torch.Generator().manual_seed(1)
    reqs = [Request(f"r{i}", torch.randint(0, model.spec.vocab_size, (n,), generator=g).tolist(),
                    SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)) for i, n in enumerate(lengths)]
    out = eng.generate_sync(reqs)
    return [[t for o in out[r.request_id] for t in o.token_ids] for r in reqs], eng


@pytest.mark.parametrize("kv", ["fp32", "int8", "k8v4"])
def test_dense_kernels_over_host_pages_equal_one_big_pool(model, kv):
    big, _ = run(model, kv, num_pages=128)
    eager, eng = run(model, kv, num_pages=10, host_kv_mib=16, graphs="off")
    assert eng.runner.backend.name == "triton"
    assert eng.runner.backend.host_steps > GEN // 2  # host pages were read by the kernels, not streamed
    assert eager == big
    small, eng = run(model, kv, num_pages=10, host_kv_mib=16)
    # decode past the pool replays the graphs' host variant (the kernels read host pages in place)
    assert eng.runner.graphs.variants == (False, True) and eng.runner.host_graph_steps > GEN // 2
    assert small == big


@pytest.mark.parametrize("kv", ["fp32", "k8v4"])
def test_retrieval_kernel_over_host_pages_equals_one_big_pool(model, kv):
    cfg = RetrievalConfig(budget=96, sink=4, window=32)
    big, ref = run(model, kv, num_pages=128, retrieval=cfg)
    small, eng = run(model, kv, num_pages=10, host_kv_mib=16, retrieval=cfg)
    be = eng.runner.backend
    assert isinstance(be, RetrievalAttention) and be.host_in_place
    assert be.in_place_host_rows > 0 and ref.runner.backend.retrieved_rows > 0
    # decode steps replayed CUDA graphs, selections over host pages included
    assert eng.runner.graphs.variants == (False, True) and eng.runner.host_graph_steps > GEN // 2
    assert small == big
    eager, eng = run(model, kv, num_pages=10, host_kv_mib=16, retrieval=cfg, graphs="off")
    assert eng.runner.graph_steps == 0 and eager == big


def test_retrieval_bf16_summaries_over_host_pages_equal_one_big_pool(model_bf16):
    """A bf16 model keeps both tiers' page min / max summaries in bf16 on the GPU (sums in fp32);
    the host tier forced gives the tokens of one big pool. One request at a time: a small pool
    batches the requests differently, and bf16 matmuls round by the batch's rows (near-ties of
    this random model then flip; fp32 hides that). bf16 KV only: with k8v4 the first engine of a
    process gave other tokens than every later one of the same config (seen on an H100 with both
    fp32 and bf16 summaries, not yet explained; the closing note of 2026-12-06 has the run)."""
    cfg, kv = RetrievalConfig(budget=96, sink=4, window=32, summary_bits=16), "bf16"  # 16: not CUDA's 8-bit default
    big, ref = run(model_bf16, kv, num_pages=128, retrieval=cfg, max_batch=1)
    small, eng = run(model_bf16, kv, num_pages=10, host_kv_mib=16, retrieval=cfg, max_batch=1)
    be = eng.runner.backend
    assert be.summaries.kmin.dtype == be.host_summaries.kmax.dtype == torch.bfloat16
    assert be.host_summaries.ksum.dtype == torch.float32
    assert be.in_place_host_rows > 0 and ref.runner.backend.retrieved_rows > 0
    assert small == big
