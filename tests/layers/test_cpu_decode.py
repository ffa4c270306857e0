"""CPU decode fast paths against their references: int8 weight-only GEMV, batched-matmul decode attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.layers.attention import decode_attend_cpu
from kvtier.layers.linear import INT8_GEMV_MAX_ROWS, FusedLinear, Linear, int8_gemv_supported, quantize_rows_int8

needs_int8 = pytest.mark.skipif(not int8_gemv_supported(torch.device("cpu"), torch.bfloat16),
                                reason="torch build has no CPU int8 weight-only kernel")


def test_quantize_rows_int8_error_bound():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.rand(64, 1, generator=g)
    w[3] = 0  # an all-zero row must not divide by zero
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())  # round-to-nearest: half a step at most
    assert bool((q[3] == 0).all())


@needs_int8
@pytest.mark.parametrize("rows", [1, 3, INT8_GEMV_MAX_ROWS, INT8_GEMV_MAX_ROWS + 5])
def test_int8_gemv_matches_dequantized_reference(rows):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(200, 160, generator=g) * 0.1).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    x = torch.randn(rows, 160, generator=g).bfloat16()
    res = torch.randn(rows, 200, generator=g).bfloat16()
    lin = FusedLinear([w[:120], w[120:]], [b[:120], b[120:]])
    dense = lin(x).float()
    lin.enable_int8_gemv()
    got = lin(x).float()
    if rows <= INT8_GEMV_MAX_ROWS:  # the int8 kernel: equal to x @ dequant(q)^T up to bf16 rounding
        q, s = quantize_rows_int8(w)
        ref = x.float() @ (q.float() * s.float()[:, None]).t() + b.float()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-2
    else:  # larger batches keep the dense bf16 GEMM
        assert torch.equal(got, dense)
    assert float((got - dense).abs().max() / dense.abs().max()) < 3e-2
    assert torch.allclose(lin.add_to(res, x).float(), res.float() + got, rtol=2e-2, atol=2e-2)


@needs_int8
def test_int8_gemv_is_batch_invariant():
    """A row's result does not depend on the other rows in the batch (so batching cannot change greedy output)."""
    g = torch.Generator().manual_seed(1)
    lin = Linear(torch.randn(300, 128, generator=g).bfloat16())
    lin.enable_int8_gemv()
    x = torch.randn(INT8_GEMV_MAX_ROWS, 128, generator=g).bfloat16()
    together = lin(x)
    for i in range(x.shape[0]):
        assert torch.equal(lin(x[i:i + 1])[0], together[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (9, 3), (16, 2)])
def test_decode_attend_matches_sdpa(dtype, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv)
    b, L, d = 3, 77, 32
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, L, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, L, d, generator=g).to(dtype)
    lens = torch.tensor([77, 40, 1])
    mask = (torch.arange(L)[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3,
                                         enable_gqa=hq != hkv)
    got = decode_attend_cpu(q, k, v, 0.3, mask)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == ref.shape and got.dtype == dtype
    assert torch.allclose(got.float(), ref, atol=tol, rtol=tol)
    one = decode_attend_cpu(q[0], k[0], v[0], 0.3)  # unbatched, no mask
    assert torch.allclose(one.float(), ref[0], atol=tol, rtol=tol)


def test_quantize_groups_int4_reproduces_q4_1_blocks():
    """Groups that are GGUF Q4_1 blocks (d * q + m, q spanning 0..15) come back exactly."""
    from kvtier.layers.linear import INT4_OFFSET, quantize_groups_int4

    g = torch.Generator().manual_seed(3)
    out_f, in_f, group = 8, 64, 32
    d = (torch.rand(out_f, in_f // group, 1, generator=g) * 0.05 + 0.01).bfloat16().float()
    m = torch.randn(out_f, in_f // group, 1, generator=g) * 0.1
    q = torch.randint(0, 16, (out_f, in_f // group, group), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # each block spans the full range, as Q4_1 blocks do
    w = (d * q + m).reshape(out_f, in_f)
    qi, sz = quantize_groups_int4(w, group)
    scale = sz[..., 0].float().t().repeat_interleave(group, 1)
    zero = sz[..., 1].float().t().repeat_interleave(group, 1)
    back = (qi.float() - INT4_OFFSET) * scale + zero
    assert torch.equal(qi.reshape(q.shape), q.to(torch.int32))
    assert float((back - w).abs().max()) <= 2e-3 * float(w.abs().max())  # bf16 zero rounding only


@pytest.mark.skipif(not hasattr(torch, "_weight_int4pack_mm_for_cpu"), reason="no CPU int4 kernel")
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_int4_gemv_matches_dequantized_reference(rows):
    from kvtier.layers.linear import INT4_OFFSET, quantize_groups_int4

    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 128, generator=g) * 0.1).bfloat16()
    x = torch.randn(rows, 128, generator=g).bfloat16()
    lin = Linear(w)
    dense = lin(x).float()
    lin.enable_int4_gemv()
    got = lin(x).float()
    if rows <= INT8_GEMV_MAX_ROWS:
        qi, sz = quantize_groups_int4(w, 32)
        scale = sz[..., 0].float().t().repeat_interleave(32, 1)
        zero = sz[..., 1].float().t().repeat_interleave(32, 1)
        ref = x.float() @ ((qi.float() - INT4_OFFSET) * scale + zero).t()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-2
        assert float((got - dense).abs().max() / dense.abs().max()) < 0.15  # int4 of gaussian weights
    else:
        assert torch.equal(got, dense)
