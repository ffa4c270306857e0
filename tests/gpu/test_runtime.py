"""The GPU runtime end to end: backends, CUDA graphs, engine tokens against HF (CUDA only).

- the backend chooser picks triton on CUDA for every KV format, dense where asked;
- greedy tokens of a batch of mixed-length requests: triton backend with CUDA graphs ==
  triton eager == dense reference == HF generate (fp32 random Qwen3 / Llama weights);
- every KV format: graph replay == eager (same kernels, same codes);
- a batch that shrinks and grows (requests finishing at different lengths) keeps replaying
  graphs of the right size, and sampling with a seed on the GPU is reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.config import CacheConfig, EngineConfig  # noqa: E402
from kvtier.engine.engine import Engine  # noqa: E402
from kvtier.engine.request import Request, SamplingParams  # noqa: E402
from kvtier.kv.formats import FORMAT_NAMES  # noqa: E402
from kvtier.layers.backends import choose_backend, make_backend  # noqa: E402
from kvtier.models.decoder import Decoder  # noqa: E402
from tests.models.test_hf_equivalence import hf_spec_and_tensors, make_hf_model, prompt  # noqa: E402

CUDA = "cuda"
GEN = 24
LENGTHS = (5, 17, 40, 33, 1, 64)  # odd lengths, partial pages, a one-token prompt


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def pair(request, tmp_path_factory):
    hf = make_hf_model(request.param, False, seed=3, max_position_embeddings=256)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    spec, tensors = hf_spec_and_tensors(path)
    return hf.to(CUDA).eval(), Decoder.from_tensors(spec, tensors, torch.float32, CUDA)


def make_engine(model, kv: str = "fp32", backend: str = "auto", graphs: str = "auto", overlap: str = "auto",
                **kw) -> Engine:
    max_batch = kw.pop("max_batch", 8)
    cache = CacheConfig(kv_dtype=kv, num_pages=kw.pop("num_pages", 96), page_size=16, **kw)
    cfg = EngineConfig(device=CUDA, dtype="fp32", max_batch=max_batch, attention_backend=backend,
                       cuda_graphs=graphs, overlap=overlap, cache=cache)
    return Engine(model, None, cfg, model_name="random")


def greedy(engine: Engine, prompts: list[list[int]], gen: int = GEN, **params) -> list[list[int]]:
    reqs = [Request(f"r{i}", ids, SamplingParams(temperature=params.get("temperature", 0.0),
                                                 seed=params.get("seed"), max_tokens=gen - i % 3,
                                                 ignore_eos=True))
            for i, ids in enumerate(prompts)]
    out = engine.generate_sync(reqs)
    return [[t for o in out[r.request_id] for t in o.token_ids] for r in reqs]


def prompts(vocab: int = 320) -> list[list[int]]:
    return [prompt(n, seed=10 + n, vocab=vocab) for n in LENGTHS]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_backend_chooser_per_format(fmt):
    from kvtier.kv.formats import make_format
    from kvtier.kv.pool import PagePool

    assert choose_backend("auto", torch.device(CUDA)) == "triton"
    assert choose_backend("auto", torch.device("cpu")) == "dense"
    pool = PagePool(make_format(fmt), 1, 4, 2, 16, 64, CUDA, compute_dtype=torch.bfloat16)
    assert make_backend("auto", pool, 0.125).name == "triton"
    assert make_backend("dense", pool, 0.125).name == "dense"


def test_graphs_eager_dense_and_hf_agree(pair):
    hf, model = pair
    ps = prompts()
    graphs = make_engine(model)
    assert graphs.runner.graphs is not None and graphs.graph_capture_seconds > 0
    got = greedy(graphs, ps)
    assert graphs.runner.graph_steps > GEN // 2  # decode steps really replayed graphs
    eager = greedy(make_engine(model, graphs="off"), ps)
    dense = greedy(make_engine(model, backend="dense"), ps)
    assert got == eager == dense
    for ids, toks in zip(ps, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([ids], device=CUDA), max_new_tokens=len(toks), do_sample=False,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert toks == want


@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8", "int8", "k8v4", "int4"])
def test_graph_replay_equals_eager_every_format(pair, kv):
    _, model = pair
    ps = prompts()
    a = greedy(make_engine(model, kv=kv), ps)
    b = greedy(make_engine(model, kv=kv, graphs="off"), ps)
    assert a == b


@pytest.mark.parametrize("kv", ["int8", "k8v4"])
def test_unfolded_decode_equals_folded(pair, kv, monkeypatch):
    """Decode with the stored-domain moves as launches of their own (what long splits take,
    FOLD_MAX_SPLITS) == folded into the split / merge kernels (short splits): same greedy tokens."""
    from kvtier.kernels import paged_attention
    _, model = pair
    ps = prompts()
    folded = greedy(make_engine(model, kv=kv), ps)
    monkeypatch.setattr(paged_attention, "FOLD_MAX_SPLITS", 1)
    assert greedy(make_engine(model, kv=kv), ps) == folded


def test_seeded_sampling_on_gpu_is_reproducible(pair):
    _, model = pair
    ps = prompts()[:3]
    a = greedy(make_engine(model), ps, temperature=0.8, seed=7)
    b = greedy(make_engine(model, graphs="off"), ps, temperature=0.8, seed=7)
    assert a == b


@pytest.mark.parametrize("kv", ["fp32", "int8"])
def test_host_tier_forced_equals_gpu_only(pair, kv):
    """A GPU pool of a few pages with a host tier (swaps, offloaded heads streamed by the dense
    path, kernels elsewhere) gives the tokens of one big pool."""
    _, model = pair
    ps = prompts() + [prompts()[2][:30] + [7, 8, 9]]  # a shared prefix: host-tier hits
    big = greedy(make_engine(model, kv=kv), ps)
    small = make_engine(model, kv=kv, num_pages=10, host_kv_mib=16, max_batch=3)
    assert greedy(small, ps) == big
    stats = small.stats()["cache"]
    assert stats.get("swaps_out", 0) + stats.get("offloads", 0) > 0, stats


def test_overlap_scheduling_equals_synchronous(pair):
    """Decode steps launched before the step before them is read back (overlap scheduling) give the
    synchronous loop's tokens, greedy and seeded, with rows ending at different steps."""
    _, model = pair
    ps = prompts()
    eng = make_engine(model, overlap="on")
    assert greedy(eng, ps) == greedy(make_engine(model, overlap="off"), ps)
    assert eng.overlap_steps > GEN // 2 and eng.runner.graph_steps > GEN // 2
    a = greedy(make_engine(model, overlap="on"), ps[:3], temperature=0.8, seed=7)
    assert a == greedy(make_engine(model, overlap="off"), ps[:3], temperature=0.8, seed=7)


def test_sampling_does_not_synchronize():
    """The sampler issues no host-device synchronization (a chained step's sampling must not wait
    for the GPU): greedy, temperature with top-k / top-p / min-p, seeded and not, mixed rows."""
    from kvtier.engine.sampler import make_generator, sample

    logits = torch.randn(4, 1000, device=CUDA)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=1.0, top_k=20, seed=3), SamplingParams(temperature=0.5, min_p=0.1)]
    gens = [None, None, make_generator(3, CUDA), None]
    sample(logits, params, gens)  # first call: lazy init outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, params, gens)
        sample(logits[1:2], params[1:2], gens[1:2])
        sample(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
        sample(logits, [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, seed=5)] * 2,
               [None, make_generator(5, CUDA)] * 2)  # unfiltered rows: the vocabulary-order draw
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("bits", [8, 16])
def test_pages_departing_to_the_host_tier_do_not_synchronize(bits: int):
    """Between two decode steps a full pool copies pages down to the host tier and their page
    summaries with them (runner.run_transfers -> PagePool.copy_to, RetrievalAttention.pages_departed):
    host-side page ids reach the GPU through pinned memory, so nothing waits for the step before
    (a pageable copy synchronized the stream, stalling overlap scheduling once a page)."""
    from kvtier.config import RetrievalConfig
    from kvtier.kv.formats import make_format
    from kvtier.kv.pool import PagePool
    from kvtier.layers.retrieval import RetrievalAttention

    fmt = make_format("k8v4")
    gpu = PagePool(fmt, 2, 16, 2, 16, 64, CUDA, compute_dtype=torch.bfloat16)
    host = PagePool(fmt, 2, 32, 2, 16, 64, "cpu", compute_dtype=torch.bfloat16, pin=True)
    be = RetrievalAttention(gpu, 0.125, RetrievalConfig(budget=96, sink=4, window=32, summary_bits=bits), host_store=host)
    k = torch.randn(16 * 16, 2, 64, device=CUDA)
    for layer in range(2):
        if fmt.smooth_k:
            gpu.calibrate(layer, k)
        gpu.write(layer, torch.arange(16 * 16, device=CUDA), k.bfloat16(), k.bfloat16())
        be.summaries.update(layer, torch.arange(16 * 16, device=CUDA), k)
    gpu.copy_to(host, [3], [5])  # first calls: lazy init (streams, kernels) outside the check
    be.pages_departed([3], [5])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu.copy_to(host, [1, 2], [7, 9])
        be.pages_departed([1, 2], [7, 9])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    hs = be.host_summaries
    for name in ("kmin", "kmax", "count"):
        got, want = getattr(hs, name)[:, [7, 9]], getattr(be.summaries, name)[:, [1, 2]]
        assert torch.equal(got.cpu(), want.to(got.dtype).cpu()), name
