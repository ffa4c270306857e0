"""Sink rows: the K/V row at sequence position 0 is kept exactly beside its quantized page.

Attention through DensePagedAttention (which attends in the formats' rotated
domain: q and the output are transformed instead of every cached row) must read row 0 of a sequence's first
page from the sink slot (prefill, batched decode) and every other row from
the quantized page; slots follow pages between tiers and run out gracefully.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.kv.formats import make_format
from kvtier.kv.pool import MIN_SINK_SLOTS, PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
from tests.layers.test_attention import naive  # causal softmax over a contiguous history

PS, HQ, HKV, D = 4, 4, 2, 16
QUANT = ["fp8", "int8", "k8v4", "int4"]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 rounding (sink rows are kept in the rotated domain and rotated back)."""
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def history(pool: PagePool, table: list[int], ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What a sequence's pages decode to without sink rows: [ctx, Hkv, D] each."""
    k, v = pool.read(0, torch.tensor(table))
    return (k.permute(0, 2, 1, 3).reshape(-1, HKV, D)[:ctx], v.permute(0, 2, 1, 3).reshape(-1, HKV, D)[:ctx])


@pytest.mark.parametrize("fmt", QUANT)
def test_attention_reads_position_zero_exactly(fmt: str) -> None:
    g = torch.Generator().manual_seed(3)
    pool = PagePool(make_format(fmt), 1, 16, HKV, PS, D, "cpu")
    att = DensePagedAttention(pool, D ** -0.5)
    tables, lens = [[5, 2, 9], [0, 7]], [10, 6]
    ks = [torch.randn(n + 1, HKV, D, generator=g) * 2 + 1 for n in lens]  # +1: the decode token
    vs = [torch.randn(n + 1, HKV, D, generator=g) for n in lens]
    qsl = [0, lens[0], sum(lens)]
    slots = torch.tensor([pt[p // PS] * PS + p % PS for pt, n in zip(tables, lens) for p in range(n)])
    q = torch.randn(sum(lens), HQ, D, generator=g)
    meta = AttentionMetadata(qsl, lens, tables, slots, torch.tensor([0]))
    out = att.forward(0, q, torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]), meta)
    assert pool.sink_pages() == {5, 0}  # each sequence's first page
    shift = pool.k_shift[0]
    for b, (pt, n) in enumerate(zip(tables, lens)):
        k, v = history(pool, pt, n)
        assert not same(k[0], ks[b][0] - shift)  # the page itself holds the quantized row
        k[0], v[0] = ks[b][0] - shift, vs[b][0]
        ref = naive(q[qsl[b]:qsl[b + 1]], k, v, n, n)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, rtol=1e-4, atol=1e-4)
    # one batched decode step for both sequences (the padded all-decode path)
    q1 = torch.randn(2, HQ, D, generator=g)
    slots1 = torch.tensor([pt[n // PS] * PS + n % PS for pt, n in zip(tables, lens)])
    meta1 = AttentionMetadata([0, 1, 2], [n + 1 for n in lens], tables, slots1, torch.tensor([0, 1]))
    out1 = att.forward(0, q1, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), meta1)
    for b, (pt, n) in enumerate(zip(tables, lens)):
        k, v = history(pool, pt, n + 1)
        k[0], v[0] = ks[b][0] - shift, vs[b][0]
        torch.testing.assert_close(out1[b:b + 1], naive(q1[b:b + 1], k, v, n + 1, 1), rtol=1e-4, atol=1e-4)


def test_plain_formats_keep_no_sink_rows() -> None:
    pool = PagePool(make_format("bf16"), 2, 8, HKV, PS, D, "cpu")
    assert pool.sink_slots == 0 and pool.assign_sinks([0, 1]) is None and pool.sink_bytes() == 0


def test_sink_rows_follow_pages_between_tiers_and_slots_run_out() -> None:
    g = torch.Generator().manual_seed(5)
    n = MIN_SINK_SLOTS + 4
    gpu = PagePool(make_format("int8"), 2, n, HKV, PS, D, "cpu")
    host = PagePool(make_format("int8"), 2, n, HKV, PS, D, "cpu")
    exact = {}
    for page in range(n):  # one sequence start per page: more than there are slots
        slot = gpu.assign_sinks([page])
        for layer in range(2):
            k, v = torch.randn(2, PS, HKV, D, generator=g)
            gpu.write(layer, page * PS + torch.arange(PS), k, v, sink=(torch.tensor([0]), slot))
            exact[page, layer] = (k[0] - gpu.k_shift[layer], v[0])
        gpu.check_integrity()
    # the oldest assignments were taken over: those pages read their quantized row 0
    assert gpu.sink_pages() == set(range(4, n))
    first = torch.tensor([0])
    for page in range(n):
        k, v = gpu.read(1, torch.tensor([page]), first)
        assert same(k[0, :, 0], exact[page, 1][0]) == (page >= 4)
        assert torch.equal(k[0, :, 1:], gpu.read(1, torch.tensor([page]))[0][0, :, 1:])
    # down to the host tier and back to other pages: the sink rows travel with them
    gpu.copy_to(host, [7, 2, 11], [0, 1, 2])
    host.check_integrity()
    assert host.sink_pages() == {0, 2}
    k, v = gpu.read_from(host, 0, torch.tensor([0, 2]), torch.tensor([0, 1]))
    assert same(k[:, :, 0], torch.stack([exact[7, 0][0], exact[11, 0][0]]))
    assert same(v[:, :, 0], torch.stack([exact[7, 0][1], exact[11, 0][1]]))
    host.copy_to(gpu, [0, 1], [12, 13])  # page 13 gets a page without a sink row: it loses its own
    gpu.check_integrity()
    assert 12 in gpu.sink_pages() and 13 not in gpu.sink_pages()
    assert same(gpu.read(0, torch.tensor([12]), first)[0][0, :, 0], exact[7, 0][0])


@pytest.mark.parametrize("fmt", QUANT)
def test_attention_in_the_rotated_domain_equals_rotating_every_row_back(fmt: str) -> None:
    g = torch.Generator().manual_seed(11)
    tables, lens = [[3, 8, 1], [6]], [9, 3]
    slots = torch.tensor([pt[p // PS] * PS + p % PS for pt, n in zip(tables, lens) for p in range(n)])
    k, v = torch.randn(2, sum(lens), HKV, D, generator=g) * 3 + 0.5
    q = torch.randn(sum(lens), HQ, D, generator=g)
    q1, k1, v1 = torch.randn(3, 2, HQ, D, generator=g)
    outs = []
    for fold in (True, False):
        pool = PagePool(make_format(fmt), 1, 12, HKV, PS, D, "cpu")
        att = DensePagedAttention(pool, D ** -0.5, fold_rotation=fold)
        assert att.native == fold
        out = att.forward(0, q, k, v, AttentionMetadata([0, 9, 12], lens, tables, slots, torch.tensor([0])))
        slots1 = torch.tensor([pt[n // PS] * PS + n % PS for pt, n in zip(tables, lens)])
        meta1 = AttentionMetadata([0, 1, 2], [n + 1 for n in lens], [[3, 8, 1], [6, 2]], slots1, torch.tensor([0]))
        outs.append((out, att.forward(0, q1, k1[:, :HKV], v1[:, :HKV], meta1)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
