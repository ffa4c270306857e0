"""The default CPU path (bf16 activations, the GGUF's int4 / int8 codes, bf16 KV) gives the same
greedy tokens with the C++ decode kernels (kvtier/kernels/cpu_ops.py) as with their PyTorch
references, alone and batched: the kernels round where the references round."""

from __future__ import annotations

import pytest

from kvtier.config import CacheConfig, EngineConfig
from kvtier.engine.request import Request, SamplingParams
from kvtier.kernels import cpu_ops

PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three colors:",
           "Once upon a time, in a land far away, there lived a dragon who loved to read books about"]

pytestmark = pytest.mark.skipif(not cpu_ops.wanted(), reason="KVTIER_CPU_KERNELS=0")


def _build(path, **kw):
    from kvtier.engine.build import build_engine

    # no prefix cache: each run computes its own K/V
    return build_engine(str(path), EngineConfig(device="cpu", cache=CacheConfig(enable_prefix_cache=False), **kw),
                        show_progress=False)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    """The default path: bf16 activations over the file's codes, bf16 KV."""
    return _build(smollm2_path)


@pytest.fixture(scope="module")
def engine_fp32(smollm2_path):
    return _build(smollm2_path, dtype="fp32")


@pytest.fixture(scope="module")
def truth(smollm2_path):
    """The fp32-dequantized reference (issue 11's KL reference), PyTorch paths."""
    return _build(smollm2_path, dtype="fp32", decode_weights="dense")


def _greedy(engine, prompts: list[str], tag: str, logits: list | None = None) -> list[list[int]]:
    """Greedy tokens of each prompt (batched together); `logits` collects each step's last row
    as log-probabilities."""
    tok = engine.tokenizer
    reqs = [Request(f"{tag}{i}", tok.encode(p), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            for i, p in enumerate(prompts)]
    model = engine.runner.model
    forward = model.forward
    if logits is not None:
        def record(*args, **kw):
            out = forward(*args, **kw)
            if out.shape[0]:
                logits.append(out[-1].log_softmax(-1))
            return out
        model.forward = record
    try:
        res = engine.generate_sync(reqs)
    finally:
        model.forward = forward
    return [[t for o in res[r.request_id] for t in o.token_ids] for r in reqs]


def _agreeing_steps(*runs: list[int]) -> int:
    """How many leading steps every run's tokens agree on (their logits saw the same inputs)."""
    n = min(len(r) for r in runs)
    return next((i for i in range(n) if len({r[i] for r in runs}) > 1), n)


def test_fp32_kernels_match_the_references(engine_fp32):
    """fp32 activations: the kernels differ from the references only in summation order, so the
    log-probabilities agree to ~1e-4 and the greedy tokens are the same (bar a near-tie)."""
    assert cpu_ops.available(), "the CPU kernels did not build"
    assert engine_fp32.pool.plain_pages(0) is not None  # a plain KV pool: the kernels run
    for i, prompt in enumerate(PROMPTS):
        got_lp, ref_lp = [], []
        got = _greedy(engine_fp32, [prompt], f"k{i}-", got_lp)[0]
        with cpu_ops.disabled():
            ref = _greedy(engine_fp32, [prompt], f"r{i}-", ref_lp)[0]
        n = _agreeing_steps(got, ref)
        for step in range(n + (n < len(ref))):
            top = ref_lp[step].topk(8).indices  # where the probability is
            assert float((got_lp[step][top] - ref_lp[step][top]).abs().max()) < 2e-3, f"prompt {i} step {step}"
        if n < len(ref):  # a divergence must be a near-tie of the reference
            assert float(ref_lp[n][ref[n]] - ref_lp[n][got[n]]) < 2e-3, f"prompt {i} step {n}"


def test_default_path_is_as_faithful_with_the_kernels(engine, truth):
    """bf16 activations round differently in another summation order, so the kernels' and the
    references' log-probabilities differ by as much as either departs from the fp32 truth
    (~0.05): what must hold is that the kernels depart from the truth no more than the references
    do (mean KL over the steps where all three agree on the tokens)."""
    kl = {"kernels": [], "reference": []}
    for i, prompt in enumerate(PROMPTS):
        t_lp, k_lp, r_lp = [], [], []
        with cpu_ops.disabled():
            t_tok = _greedy(truth, [prompt], f"t{i}-", t_lp)[0]
            r_tok = _greedy(engine, [prompt], f"r{i}-", r_lp)[0]
        k_tok = _greedy(engine, [prompt], f"k{i}-", k_lp)[0]
        for step in range(_agreeing_steps(t_tok, r_tok, k_tok)):
            p = t_lp[step].exp()
            kl["kernels"].append(float((p * (t_lp[step] - k_lp[step])).sum()))
            kl["reference"].append(float((p * (t_lp[step] - r_lp[step])).sum()))
    assert len(kl["kernels"]) >= 20
    mean = {k: sum(v) / len(v) for k, v in kl.items()}
    assert mean["kernels"] <= 1.5 * mean["reference"] + 1e-4, mean


def test_batched_decode_equals_each_alone(engine):
    """One kernel call serves every row of a batched decode step: batched == alone, except where
    the prefill's bf16 GEMM rounds by its row count (MKL's AMX kernels block by M, so prompts
    prefilled together and alone differ in the last bits): there, the first differing token must
    be a near-tie of the run alone."""
    batched = _greedy(engine, PROMPTS, "b")
    for i, p in enumerate(PROMPTS):
        alone_lp: list = []
        alone = _greedy(engine, [p], f"a{i}-", alone_lp)[0]
        n = _agreeing_steps(batched[i], alone)
        if n < len(alone):
            gap = float(alone_lp[n][alone[n]] - alone_lp[n][batched[i][n]])
            assert gap < 0.05, f"prompt {i}: batched decode left the run alone at step {n} (gap {gap:.3f})"
