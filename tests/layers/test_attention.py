"""DensePagedAttention against a naive causal-softmax reference on random pages."""

from __future__ import annotations

import math
import random

import torch

from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention

PS, HQ, HKV, D = 4, 4, 2, 8


def naive(q, k, v, ctx: int, n_new: int) -> torch.Tensor:
    """q [n, Hq, D]; k, v [ctx, Hkv, D] contiguous history -> [n, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = torch.empty_like(q)
    for i in range(n_new):
        pos = ctx - n_new + i
        s = torch.einsum("hd,thd->ht", q[i], k[:pos + 1]) / math.sqrt(q.shape[-1])
        out[i] = torch.einsum("ht,thd->hd", s.softmax(-1), v[:pos + 1])
    return out


def run_case(ctx_lens: list[int], new_lens: list[int], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    pool = PagePool(make_format("fp32"), 1, 64, HKV, PS, D, "cpu")
    free = list(range(64))
    rnd.shuffle(free)  # pages of a sequence are scattered, not contiguous
    tables, hist_k, hist_v = [], [], []
    for ctx, n in zip(ctx_lens, new_lens):
        pt = [free.pop() for _ in range(-(-ctx // PS))]
        tables.append(pt)
        k, v = torch.randn(ctx, HKV, D, generator=g), torch.randn(ctx, HKV, D, generator=g)
        old = torch.tensor([pt[p // PS] * PS + p % PS for p in range(ctx - n)], dtype=torch.long)
        pool.write(0, old, k[:ctx - n], v[:ctx - n])
        hist_k.append(k)
        hist_v.append(v)
    q = torch.randn(sum(new_lens), HQ, D, generator=g)
    qsl = [0]
    for n in new_lens:
        qsl.append(qsl[-1] + n)
    slots = torch.tensor([pt[p // PS] * PS + p % PS for pt, ctx, n in zip(tables, ctx_lens, new_lens)
                          for p in range(ctx - n, ctx)], dtype=torch.long)
    k_new = torch.cat([k[ctx - n:] for k, ctx, n in zip(hist_k, ctx_lens, new_lens)])
    v_new = torch.cat([v[ctx - n:] for v, ctx, n in zip(hist_v, ctx_lens, new_lens)])
    meta = AttentionMetadata(qsl, ctx_lens, tables, slots, torch.tensor([qsl[-1] - 1]))
    out = DensePagedAttention(pool, D ** -0.5).forward(0, q, k_new, v_new, meta)
    for b, (ctx, n) in enumerate(zip(ctx_lens, new_lens)):
        ref = naive(q[qsl[b]:qsl[b + 1]], hist_k[b], hist_v[b], ctx, n)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, rtol=1e-5, atol=1e-5)


def test_mixed_prefill_and_decode_matches_naive():
    run_case([7, 13, 1, 20], [7, 3, 1, 5], seed=1)


def test_batched_decode_path_matches_naive():
    run_case([5, 17, 2, 33, 8], [1, 1, 1, 1, 1], seed=2)
