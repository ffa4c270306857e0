"""Statistical and exact tests of kvtier.engine.sampler against plain-Python references."""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.engine.request import SamplingParams
from kvtier.engine.sampler import filtered_probs, make_generator, sample

V = 12  # small vocab: every token's frequency is measurable
N = 120_000  # draws per distribution test: per-token std <= sqrt(.25/N) ~ 0.0014


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Plain-Python HF-order filter: temperature -> top_k -> top_p -> min_p -> softmax."""
    z = [x / p.temperature for x in logits]
    alive = [not math.isinf(x) for x in z]

    def softmax() -> list[float]:
        m = max(z[i] for i in range(len(z)) if alive[i])
        e = [math.exp(z[i] - m) if alive[i] else 0.0 for i in range(len(z))]
        s = sum(e)
        return [x / s for x in e]

    order = sorted(range(len(z)), key=lambda i: -z[i])
    if p.top_k > 0:
        for i in order[p.top_k:]:
            alive[i] = False
    if p.top_p < 1.0:
        probs, mass = softmax(), 0.0
        for i in order:
            if not alive[i]:
                continue
            if mass >= p.top_p:
                alive[i] = False
            mass += probs[i]
    if p.min_p > 0.0:
        probs = softmax()
        top = max(probs)
        for i in range(len(z)):
            if probs[i] < p.min_p * top:
                alive[i] = False
    return softmax()


def draw(logits_row: torch.Tensor, p: SamplingParams, n: int = N, **kw) -> torch.Tensor:
    """n independent draws (one batch of n identical rows) -> token frequencies [V]."""
    torch.manual_seed(1234)
    logits = logits_row.expand(n, -1).clone()
    toks = sample(logits, [p] * n, [None] * n, **kw)
    return torch.bincount(toks, minlength=logits.shape[1]).double() / n


def chi_square(freq: torch.Tensor, ref: list[float], n: int) -> tuple[float, int]:
    stat, dof = 0.0, -1
    for f, r in zip(freq.tolist(), ref):
        if r > 0:
            stat += (f * n - r * n) ** 2 / (r * n)
            dof += 1
    return stat, dof


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=1.5, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("p", CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_distribution_matches_reference(p: SamplingParams) -> None:
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g) * 1.5
    ref = reference_probs(row.tolist(), p)
    freq = draw(row, p)
    support = [i for i in range(V) if ref[i] > 0]
    # support is exact: nothing outside it, everything inside it appears
    assert all(freq[i] == 0 for i in range(V) if ref[i] == 0)
    assert all(freq[i] > 0 for i in support)
    tv = 0.5 * sum(abs(f - r) for f, r in zip(freq.tolist(), ref))
    assert tv < 0.01, tv
    stat, dof = chi_square(freq, ref, N)
    # chi-square critical value at p=1e-4 is below dof + 6*sqrt(2*dof) + 10 for dof <= 12
    assert stat < dof + 6 * math.sqrt(2 * max(dof, 1)) + 10, (stat, dof)
    # filtered_probs is the same distribution, analytically
    fp = filtered_probs(row.unsqueeze(0), [p])[0]
    assert torch.allclose(fp, torch.tensor(ref, dtype=torch.float32), atol=1e-5)


def test_support_exact_on_large_vocab() -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 1000, generator=g) * 3
    params = [SamplingParams(temperature=1.0, top_k=1 + b % 7, top_p=0.5 + (b % 5) / 10,
                             min_p=(b % 3) / 10) for b in range(64)]
    refs = [reference_probs(logits[b].tolist(), params[b]) for b in range(64)]
    for _ in range(20):
        toks = sample(logits, params, [None] * 64)
        for b in range(64):
            assert refs[b][toks[b]] > 0


def test_greedy_is_exact_argmax_and_mixed_batch() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    greedy = SamplingParams(temperature=0.0)
    params = [greedy, SamplingParams(temperature=1.0), greedy, SamplingParams(top_k=3), greedy, greedy]
    for _ in range(10):
        toks = sample(logits, params, [None] * 6)
        for b in (0, 2, 4, 5):
            assert toks[b] == logits[b].argmax()
    assert torch.equal(sample(logits, [greedy] * 6, [None] * 6), logits.argmax(dim=1))
    # greedy ignores top_k/top_p/min_p but honours the mask
    mask = torch.zeros(50, dtype=torch.bool)
    mask[[3, 17, 40]] = True
    t = sample(logits[:1], [SamplingParams(temperature=0.0, top_k=1)], [None], masks=[mask])
    assert t[0] == max([3, 17, 40], key=lambda i: logits[0, i])


def test_mask_restricts_sampling() -> None:
    logits = torch.zeros(2000, 30)
    mask = torch.zeros(30, dtype=torch.bool)
    allowed = [2, 9, 29]
    mask[allowed] = True
    toks = sample(logits, [SamplingParams()] * 2000, [None] * 2000, masks=[mask] * 2000)
    assert set(toks.tolist()) == set(allowed)
    with pytest.raises(ValueError, match="mask"):
        sample(logits[:1], [SamplingParams()], [None], masks=[torch.ones(29, dtype=torch.bool)])


def test_penalties_match_hand_computed_reference() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]])
    prompt, output = [0, 1], [3, 3, 4, 1]
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0, presence_penalty=0.5,
                       frequency_penalty=0.25)
    # by hand: repetition over {0,1,3,4}: 2->1, -1->-2, 3->1.5, -2->-4 (token 2 and 5 unseen)
    # output counts: 3:2, 4:1, 1:1 -> subtract 0.25*c + 0.5*(c>0)
    expected = [1.0, -2.0 - 0.75, 0.5, 1.5 - 1.0, -4.0 - 0.75, 0.0]
    probs = filtered_probs(logits, [p], history=[prompt + output], prompt_lens=[len(prompt)])
    ref = torch.tensor(expected).softmax(dim=0)
    assert torch.allclose(probs[0], ref, atol=1e-6)
    # presence/frequency count output only: a prompt-only token is not penalized
    p2 = SamplingParams(presence_penalty=1.0)
    probs2 = filtered_probs(logits, [p2], history=[[5, 5, 2]], prompt_lens=[2])
    ref2 = torch.tensor([2.0, -1.0, -0.5, 3.0, -2.0, 0.0]).softmax(dim=0)
    assert torch.allclose(probs2[0], ref2, atol=1e-6)
    with pytest.raises(ValueError, match="prompt_lens"):
        sample(logits, [p2], [None], history=[[5]])
    # greedy with repetition penalty: argmax of penalized logits
    g = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert sample(logits, [g], [None], history=[[3]]).item() == 0  # 3.0 -> 0.75 < 2.0


def test_input_logits_not_modified() -> None:
    logits = torch.randn(3, 20)
    copy = logits.clone()
    mask = torch.ones(20, dtype=torch.bool)
    mask[0] = False
    sample(logits, [SamplingParams(repetition_penalty=1.3, top_k=5)] * 3, [None] * 3,
           history=[[1, 2]] * 3, masks=[mask, None, mask])
    assert torch.equal(logits, copy)


def test_seed_reproducible_and_independent_of_batch_position() -> None:
    g = torch.Generator().manual_seed(9)
    steps, vocab = 40, 200
    target = torch.randn(steps, vocab, generator=g)
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(batch: int, pos: int, other_seed: int) -> list[int]:
        torch.manual_seed(other_seed)  # the unseeded neighbours use the global RNG
        gen = make_generator(p.seed)
        others = [make_generator(s) if s % 2 else None for s in range(batch)]
        out = []
        for t in range(steps):
            logits = torch.randn(batch, vocab) * 2
            logits[pos] = target[t]
            gens = list(others)
            gens[pos] = gen
            params = [SamplingParams(temperature=0.5 + 0.1 * i) for i in range(batch)]
            params[pos] = p
            out.append(sample(logits, params, gens)[pos].item())
        return out

    alone = run(1, 0, 0)
    assert alone == run(1, 0, 1)
    assert alone == run(5, 3, 2)
    assert alone == run(8, 0, 3)
    p_other = make_generator(43)
    other = [sample(target[t:t + 1], [p], [p_other])[0].item() for t in range(steps)]
    assert other != alone  # a different seed gives a different stream


def test_seeded_draws_follow_the_distribution() -> None:
    row = torch.randn(V, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, top_k=7)
    gen = make_generator(7)
    n = 8_000
    toks = torch.tensor([sample(row.unsqueeze(0), [p], [gen])[0].item() for _ in range(n)])
    freq = torch.bincount(toks, minlength=V).double() / n
    ref = reference_probs(row.tolist(), p)
    assert 0.5 * sum(abs(f - r) for f, r in zip(freq.tolist(), ref)) < 0.04


def test_large_vocab_filters_match_the_full_sort() -> None:
    """On a 50K vocabulary top-k / top-p sort only the top ranks (sampler.TOP_SORTED) when those
    hold each row's top_p mass, else everything: the same distribution as the reference either way
    (a peaked row stops early, a flat one falls back, top_k above TOP_SORTED widens the ranks)."""
    g = torch.Generator().manual_seed(3)
    v = 50_000
    peaked = torch.randn(v, generator=g) * 4
    flat = torch.randn(v, generator=g) * 0.1
    cases = [(peaked, SamplingParams(temperature=1.0, top_p=0.9)),
             (flat, SamplingParams(temperature=1.0, top_p=0.9)),
             (flat, SamplingParams(temperature=0.7, top_k=2000, top_p=0.95)),
             (peaked, SamplingParams(temperature=1.0, top_k=50, min_p=0.01))]
    logits = torch.stack([row for row, _ in cases])
    params = [p for _, p in cases]
    probs = filtered_probs(logits, params)
    for b, (row, p) in enumerate(cases):
        ref = torch.tensor(reference_probs(row.tolist(), p), dtype=torch.float32)
        assert torch.allclose(probs[b], ref, atol=1e-6), b
        assert int((ref > 0).sum()) > (1024 if b == 1 else 1)  # the flat row keeps more than the top ranks
    toks = sample(logits, params, [None] * len(cases))
    assert all(probs[b, toks[b]] > 0 for b in range(len(cases)))


@pytest.mark.parametrize("width", [1024, 151936, 1000, 37])
def test_inverse_cdf_matches_a_full_cumsum(width: int) -> None:
    """The two-level search (sampler.inverse_cdf) picks the column a fp64 cumsum over the whole row
    picks, on rows with zeros (filtered tokens) and widths no power of two divides (padded)."""
    from kvtier.engine.sampler import inverse_cdf
    g = torch.Generator().manual_seed(width)
    probs = torch.rand(6, width, generator=g) ** 4
    probs[probs < 0.05] = 0.0
    probs[0, :] = 0.0
    probs[0, width // 3] = 1.0  # one token: every u picks it
    u = torch.rand(6, 1, dtype=torch.float64, generator=g)
    u[1] = 0.0
    cdf = probs.double().cumsum(dim=1)
    want = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=width - 1)
    got = inverse_cdf(probs, u)
    assert torch.equal(got, want), (got.squeeze(1).tolist(), want.squeeze(1).tolist())
    assert bool((probs.gather(1, got) > 0).all())


def test_mixed_filters_in_one_batch_on_a_large_vocab() -> None:
    """Rows with different filters share a batch on a 50K vocabulary: each keeps exactly its own
    set. (Before, a top_k row beside a top_p-only row indexed past the sorted ranks and raised, and
    an unfiltered row beside a top_p row was cut to the top 1,024 ranks.)"""
    g = torch.Generator().manual_seed(11)
    v = 50_000
    logits = torch.randn(4, v, generator=g) * 4
    logits[2] /= 4  # no probability of the unfiltered row underflows fp32
    params = [SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=0.8, top_p=0.9),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    probs = filtered_probs(logits, params)
    for b, p in enumerate(params[:3]):
        ref = torch.tensor(reference_probs(logits[b].tolist(), p), dtype=torch.float32)
        assert torch.allclose(probs[b], ref, atol=1e-6), b
    assert int((probs[2] > 0).sum()) == v  # the unfiltered row keeps every token
    toks = sample(logits, params, [None] * 4)
    assert all(probs[b, toks[b]] > 0 for b in range(3)) and toks[3] == logits[3].argmax()


def test_random_batches_match_the_reference() -> None:
    """Random batches (mixed temperatures, filters, seeds and grammar masks; greedy rows among
    them; vocabularies on both sides of the candidate widths): filtered_probs equals the plain-Python
    reference row by row, and every sampled token has probability > 0."""
    import random

    from kvtier.engine.sampler import make_generator

    rng = random.Random(0)
    for _ in range(60):
        v, b = rng.choice([7, 300, 3000]), rng.randint(1, 4)
        g = torch.Generator().manual_seed(rng.randrange(1 << 30))
        logits = torch.randn(b, v, generator=g) * rng.choice([0.3, 1.0, 3.0])
        masks = [None] * b
        for r in range(b):
            if rng.random() < 0.3:
                masks[r] = torch.rand(v, generator=g) < 0.5
                masks[r][rng.randrange(v)] = True
        params = [SamplingParams(temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_k=rng.choice([0, 0, 1, 5, 400]),
                                 top_p=rng.choice([1.0, 1.0, 0.3, 0.9]), min_p=rng.choice([0.0, 0.0, 0.05, 0.5]),
                                 seed=rng.choice([None, 9])) for _ in range(b)]
        probs = filtered_probs(logits, params, masks=masks)
        for r, p in enumerate(params):
            row = logits[r].masked_fill(~masks[r], float("-inf")) if masks[r] is not None else logits[r]
            if p.temperature == 0.0:
                assert probs[r, row.argmax()] == 1.0
                continue
            ref = torch.tensor(reference_probs(row.tolist(), p), dtype=torch.float32)
            assert torch.allclose(probs[r], ref, atol=1e-5), (v, p)
        toks = sample(logits, params, [make_generator(p.seed) for p in params], masks=masks)
        assert all(probs[r, toks[r]] > 0 for r in range(b))
