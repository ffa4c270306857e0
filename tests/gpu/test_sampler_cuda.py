"""kvtier.engine.sampler on CUDA (skipped without a GPU): the distribution each draw path gives
(the vocabulary-order draw of unfiltered rows from exp(l - max), the sorted candidates of
filtered ones) against the plain-Python reference of tests/engine/test_sampler.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.engine.request import SamplingParams  # noqa: E402
from kvtier.engine.sampler import filtered_probs, sample  # noqa: E402
from tests.engine.test_sampler import CASES, V, reference_probs  # noqa: E402

N = 200_000  # draws a case: per-token std <= sqrt(.25 / N) ~ 0.0011


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_cuda_draws_follow_the_reference(p: SamplingParams) -> None:
    row = torch.randn(V, generator=torch.Generator().manual_seed(0)) * 1.5
    ref = torch.tensor(reference_probs(row.tolist(), p), dtype=torch.float64)
    torch.manual_seed(4321)
    logits = row.cuda().expand(N, -1).clone()
    toks = sample(logits, [p] * N, [None] * N)
    freq = torch.bincount(toks.cpu(), minlength=V).double() / N
    assert bool((freq[ref == 0] == 0).all()) and bool((freq[ref > 0] > 0).all())  # the support, exactly
    assert 0.5 * float((freq - ref).abs().sum()) < 0.01
    fp = filtered_probs(row.cuda().unsqueeze(0), [p])[0].cpu().double()
    assert torch.allclose(fp, ref, atol=1e-5)
