"""The C++ CPU decode kernels (kvtier/kernels/csrc/cpu_ops.cpp) against their PyTorch references,
on random inputs. Where the machine cannot build them the test fails rather than skips: a CPU
without its fast path is a regression the suite must show (KVTIER_CPU_KERNELS=0 opts out)."""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels import cpu_ops, fused
from kvtier.layers.attention import decode_attend_cpu
from kvtier.layers.qlinear import VNNI_GROUP_MULTIPLE
from kvtier.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

pytestmark = pytest.mark.skipif(not cpu_ops.wanted(), reason="KVTIER_CPU_KERNELS=0")


@pytest.fixture(scope="module")
def ops():
    mod = cpu_ops.ops()
    assert mod is not None, "the CPU kernels did not build (see the warning logged by kvtier.kernels.cpu_ops)"
    return mod


def _ulps_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, ulps: float = 2.0) -> None:
    """Equal up to a few roundings of `dtype` relative to the tensor's scale (the kernels sum in
    another order than torch, so a value may round to the neighbouring representable one)."""
    eps = torch.finfo(dtype).eps
    scale = ref.float().abs().max().clamp_min(1e-6)
    err = float((got.float() - ref.float()).abs().max() / scale)
    assert err <= ulps * eps + 1e-6, f"max error {err:.3g} x scale exceeds {ulps} ulps of {dtype}"


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm(ops, out_dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g) * 3
    w = torch.rand(576, generator=g) + 0.5
    ref = fused.rms_norm_reference(x, w, 1e-5).to(out_dtype)
    got = ops.rms_norm(x, w, 1e-5, out_dtype)
    assert got.dtype == out_dtype and got.shape == ref.shape
    _ulps_close(got, ref, out_dtype)
    # a strided view of rows (the decoder's logits rows) reads each row where it is
    big = torch.randn(2 * rows, 576, generator=g)
    _ulps_close(ops.rms_norm(big[::2], w, 1e-5, out_dtype), fused.rms_norm_reference(big[::2], w, 1e-5).to(out_dtype),
                out_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_rope_matches_reference(ops, dtype, qk_norm, d):
    g = torch.Generator().manual_seed(d + qk_norm)
    hq, hkv, t = 6, 2, 4
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 2).to(dtype)
    rot = RotaryEmbedding(d, 10000.0, 64, dtype=dtype)
    cos, sin = rot(torch.tensor([0, 7, 30, 63]))
    qw = kw = None
    if qk_norm:
        qw, kw = (torch.rand(d, generator=g) + 0.5).to(dtype), (torch.rand(d, generator=g) + 0.5).to(dtype)
    q_ref, k_ref = fused.qk_norm_rope_reference(qkv.clone(), hq, hkv, d, cos, sin, qw, kw, 1e-6)
    got = qkv.clone()
    ops.rope_(got, cos, sin, hq, hkv, d, qw, kw, 1e-6)
    q = got[:, :hq * d].view(t, hq, d)
    k = got[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    if qk_norm:  # the per-head norm's sum of squares is reduced in another order: a rounding apart
        _ulps_close(q, q_ref, dtype, 4)
        _ulps_close(k, k_ref, dtype, 4)
    else:  # same products, same roundings: bit-equal
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    assert torch.equal(got[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])  # V untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(ops, dtype):
    g = torch.Generator().manual_seed(3)
    gu = (torch.randn(3, 2 * 1536, generator=g) * 4).to(dtype)
    _ulps_close(ops.silu_mul(gu), fused.silu_mul_reference(gu), dtype)


def _pool(pages, hkv, ps, d, dtype, g):
    return (torch.randn(pages, hkv, ps, d, generator=g).to(dtype), torch.randn(pages, hkv, ps, d, generator=g).to(dtype))


@pytest.mark.parametrize("cache_dtype", DTYPES)
def test_kv_store_matches_indexing(ops, cache_dtype):
    g = torch.Generator().manual_seed(5)
    kc, vc = _pool(8, 3, 16, 64, cache_dtype, g)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    slots = torch.tensor([5, 17, 100, 127])
    qkv = torch.randn(4, 9 * 64, generator=g).bfloat16()  # k and v as the decoder has them: strided views
    k, v = qkv[:, 3 * 64:6 * 64].view(4, 3, 64), qkv[:, 6 * 64:].view(4, 3, 64)
    ops.kv_store(kc, vc, slots, k, v)
    kc_ref[slots // 16, :, slots % 16] = k.to(cache_dtype)
    vc_ref[slots // 16, :, slots % 16] = v.to(cache_dtype)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.kv_store(kc, vc, torch.tensor([0, 1, 2, 128]), k, v)


def _decode_reference(q, kc, vc, tables, lens, scale):
    ps = kc.shape[2]
    out = []
    for b, (pt, n) in enumerate(zip(tables, lens)):
        kp, vp = kc[pt], vc[pt]  # [P, Hkv, ps, D]
        hkv, d = kp.shape[1], kp.shape[3]
        kk = kp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        vv = vp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :n]
        out.append(decode_attend_cpu(q[b][:, None], kk, vv, scale)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("lens", [[1], [37], [700], [5, 300, 16, 1024]])
@pytest.mark.parametrize("min_split", [1, 64, 100000])
def test_paged_decode_matches_reference(ops, cache_dtype, lens, min_split):
    g = torch.Generator().manual_seed(sum(lens))
    hq, hkv, d, ps = 12, 4, 64, 16
    pages = sum(-(-n // ps) for n in lens) + 3
    kc, vc = _pool(pages, hkv, ps, d, cache_dtype, g)
    perm = torch.randperm(pages, generator=g).tolist()  # pages in no particular order
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at:at + -(-n // ps)])
        at += len(tables[-1])
    width = max(len(t) for t in tables) + 2
    block = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        block[b, :len(t)] = torch.tensor(t)
    q = (torch.randn(len(lens), hq, d, generator=g) * 2).to(cache_dtype)
    got = ops.paged_decode(q, kc, vc, block, torch.tensor(lens, dtype=torch.int32), 0.125, min_split)
    ref = _decode_reference(q, kc, vc, tables, lens, 0.125)
    assert got.dtype == q.dtype
    _ulps_close(got, ref, cache_dtype, 4 if cache_dtype == torch.float32 else 2)


@pytest.mark.parametrize("cache_dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (12, 3, 64), (16, 2, 128)])
@pytest.mark.parametrize("min_split", [1, 100000])
def test_paged_decode_lists_matches_the_retrieval_reference(ops, cache_dtype, hq, hkv, d, min_split):
    """Retrieval decode: each (row, kv head) over its own page list, entries in any order, -1
    entries, a partial last page anywhere in the list, a page wholly past the context, a kv head
    with no live entry (zeros), against kernels/retrieval_attention.py's PyTorch reference."""
    from kvtier.kernels.retrieval_attention import paged_decode_selected_reference
    from kvtier.kv.formats import make_format

    g = torch.Generator().manual_seed(hq * d + min_split % 7)
    ps, pages, n = 16, 40, 9
    kc, vc = _pool(pages, hkv, ps, d, cache_dtype, g)
    ctx = torch.tensor([300, 37, 16])  # partial last pages (300, 37) and a full one (16)
    r = len(ctx)
    ids = torch.randint(0, pages, (r, hkv, n), generator=g)
    idx = torch.full((r, hkv, n), -1)
    for b, c in enumerate(ctx.tolist()):
        last = (c - 1) // ps
        for h in range(hkv):
            chosen = torch.randperm(last + 1, generator=g)[:min(n - 1, last + 1)]
            if last not in chosen.tolist():
                chosen[0] = last  # the window's last page is always among the fixed pages
            slots = torch.randperm(n, generator=g)[:len(chosen)]
            idx[b, h, slots] = chosen
    idx[0, 0, idx[0, 0] < 0] = 30  # a page wholly past the context: masked
    idx[2, hkv - 1] = -1  # a kv head with nothing to attend
    q = (torch.randn(r, hq, d, generator=g) * 2).to(cache_dtype)
    got = ops.paged_decode_lists(q, kc, vc, ids, idx, ctx, 0.125, min_split)
    st = {"k": kc, "v": vc}
    ref = paged_decode_selected_reference(q, st, make_format({torch.float32: "fp32", torch.bfloat16: "bf16",
                                                              torch.float16: "fp16"}[cache_dtype]),
                                          ids, idx, None, ctx, 0.125)
    assert got.dtype == q.dtype
    assert torch.equal(got[2, (hkv - 1) * (hq // hkv):], torch.zeros_like(got[2, (hkv - 1) * (hq // hkv):]))
    _ulps_close(got, ref, cache_dtype, 4 if cache_dtype == torch.float32 else 2)


def test_paged_decode_checks_its_tables(ops):
    kc, vc = _pool(4, 2, 16, 64, torch.float32, torch.Generator().manual_seed(0))
    q = torch.randn(1, 4, 64)
    with pytest.raises(RuntimeError, match="page id out of range"):
        ops.paged_decode(q, kc, vc, torch.tensor([[0, 9]]), torch.tensor([20]), 0.125, 1)
    with pytest.raises(RuntimeError, match="longer than its table"):
        ops.paged_decode(q, kc, vc, torch.tensor([[0, 1]]), torch.tensor([40]), 0.125, 1)


def _qweight(n: int, k: int, group: int, seed: int, bits: int = 4):
    """A QuantWeight with fp16 scales: 4-bit (with mins), 8-bit, or 5- / 6-bit (8-bit codes in -16..15 /
    -32..31, GGUF Q5_0's / Q6_K's)."""
    from kvtier.layers.qweight import QuantWeight, quantize_rtn

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05 + 0.01
    if bits not in (5, 6):
        return quantize_rtn(w, bits, group)
    half = 1 << (bits - 1)
    grouped = w.reshape(n, k // group, group)
    scale = (grouped.abs().amax(-1) / half).half()
    q = torch.round(grouped / scale.float()[..., None]).clamp_(-half, half - 1)
    return QuantWeight(8, group, q.reshape(n, k).to(torch.int8), scale, None)


# (bits, n, k, group): every layout with groups it takes (4-bit words span 8 columns, 5-bit's
# fifth bits 32, 6-bit groups 16 (GGUF Q6_K's), 8-bit words 4)
VNNI_CASES = [(b, n, k, g) for b in (4, 5, 6, 8)
              for n, k, g in ((16, 64, 32), (40, 96, 32), (100, 128, 64), (300, 576, 32), (40, 64, 16))
              if g % VNNI_GROUP_MULTIPLE[b] == 0]


@pytest.mark.parametrize("bits,n,k,group", VNNI_CASES)
def test_vnni_packing_round_trips(ops, bits, n, k, group):
    from kvtier.layers.qlinear import VNNIWeight

    qw = _qweight(n, k, group, n, bits)
    packed = VNNIWeight.from_qweight(qw)
    assert packed is not None and packed.bits == bits
    assert packed.sm.shape[2] == (1 if qw.mins is None else 2)  # symmetric codes: scales alone
    dense = qw.dequantize()
    out = torch.empty(n - 16, k)
    packed.dequantize_into(16, n, out)  # from a block boundary to a partial last block (qv_dequant)
    assert torch.equal(out, dense[16:])
    half = torch.empty(n - 16, k, dtype=torch.bfloat16)
    packed.dequantize_into(16, n, half)
    with cpu_ops.disabled():  # the PyTorch unpack: the same values, the same single rounding
        ref = torch.empty(n - 16, k)
        packed.dequantize_into(16, n, ref)
        ref_half = torch.empty(n - 16, k, dtype=torch.bfloat16)
        packed.dequantize_into(16, n, ref_half)
    assert torch.equal(ref, dense[16:]) and torch.equal(half, ref_half)
    idx = torch.tensor([0, n - 1, 17 % n, 5])
    assert torch.equal(packed.rows(idx, torch.float32), dense[idx])
    # the size known before packing (TokenEmbedding keeps the smaller of the two forms)
    assert VNNIWeight.nbytes_of(qw.shape, group, bits, packed.sym) == packed.nbytes()
    assert VNNIWeight.for_qweight(qw, smaller_than=packed.nbytes()) is None
    assert VNNIWeight.for_qweight(qw, smaller_than=packed.nbytes() + 1) is not None


@pytest.mark.parametrize("bits,n,k,group", VNNI_CASES)
def test_qv_pack_matches_the_pytorch_packing(ops, bits, n, k, group):
    """qv_pack (C++) writes the words, high-bit planes and scales _pack_codes builds in PyTorch,
    the last block partial (n not a multiple of 16 in most cases)."""
    from kvtier.layers.qlinear import VNNIWeight

    qw = _qweight(n, k, group, n + 7, bits)
    packed = VNNIWeight.from_qweight(qw)
    with cpu_ops.disabled():
        ref = VNNIWeight.from_qweight(qw)
    assert packed.codes.abs().sum() > 0
    for name in ("codes", "hbits", "sm"):
        a, b = getattr(packed, name), getattr(ref, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


@pytest.mark.skipif(not cpu_ops.wanted() or cpu_ops.ops() is None or not cpu_ops.ops().qv_supported(),
                    reason="this CPU has no AVX512-VNNI (its matrices keep torch's int4pack / int8 packings)")
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 64])
@pytest.mark.parametrize("bits,n,k,group", VNNI_CASES)
def test_qv_gemm_matches_the_dequantized_matmul(ops, bits, x_dtype, m, n, k, group):
    from kvtier.layers.qlinear import VNNIWeight

    packed = VNNIWeight.from_qweight(_qweight(n, k, group, m + n, bits))
    assert packed.bits == bits
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) * 3).to(x_dtype)
    x[0, :group] *= 1e-3  # a group far below the others: its own activation scale
    ref = packed.gemv_reference(x)  # fp32 over the dequantized weight, rounded to x's dtype
    got = packed.gemv(x)
    assert got.dtype == x_dtype and got.shape == (m, n)
    # activations enter as 16-bit fixed point per group (error <= amax / 65024 each): ~1e-4 of
    # the output's scale in fp32, far inside bf16's rounding (a bf16 output is a rounding apart)
    tol = 1e-4 if x_dtype == torch.float32 else 2 * torch.finfo(torch.bfloat16).eps
    assert float((got.float() - ref.float()).abs().max() / ref.float().abs().max()) < tol
    res = torch.randn(m, n, generator=g)  # the fused residual add: residual + the rounded product
    assert torch.allclose(packed.gemv(x, res), res + got.float(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("selector", ["quest", "quest-max"])
@pytest.mark.parametrize("g_heads,d", [(1, 64), (4, 64), (8, 128)])
def test_quest_scores_match_page_scores(ops, selector, g_heads, d):
    """Retrieval's CPU page scores (one C++ pass) against page_scores' PyTorch formula: random keys
    written into some pages, candidates in any order with repeats, unwritten pages +inf."""
    from kvtier.kv.summaries import PageSummaries
    from kvtier.layers.retrieval import page_scores

    gen = torch.Generator().manual_seed(g_heads * d)
    hkv, ps, pages = 2, 16, 24
    summ = PageSummaries(2, pages, hkv, d, ps, "cpu")
    slots = torch.randperm(18 * ps, generator=gen)[:200]  # keys in pages 0..17 only
    summ.update(1, slots, torch.randn(200, hkv, d, generator=gen) * 3)
    cand = torch.randint(0, pages, (3, 40), generator=gen)
    qg = torch.randn(3, hkv, g_heads, d, generator=gen)
    got = page_scores(selector, qg, summ, 1, cand)
    with cpu_ops.disabled():
        ref = page_scores(selector, qg, summ, 1, cand)
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and bool(torch.isinf(ref).any())
    fin = ~torch.isinf(ref)
    torch.testing.assert_close(got[fin], ref[fin], rtol=1e-5, atol=1e-4)


def test_a_killed_build_does_not_wedge_later_loads(tmp_path):
    """torch's extension lock is a plain file every load creates and removes; a process killed in
    between left it behind, and every later start waited on it forever. A fresh process loads
    past such a leftover (it holds kvtier's own OS lock, so the file can only be stale)."""
    import os
    import subprocess
    import sys

    from torch.utils import cpp_extension

    if cpu_ops.ops() is None:
        pytest.skip("no CPU kernels on this machine")
    lock = os.path.join(cpp_extension._get_build_directory(cpu_ops._name(), verbose=False), "lock")
    with open(lock, "w"):
        pass  # as a killed load leaves it
    code = "from kvtier.kernels import cpu_ops; import sys; sys.exit(0 if cpu_ops.ops() is not None else 3)"
    try:
        done = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True, text=True)
    finally:
        if os.path.exists(lock):
            os.remove(lock)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "left by a build that was killed" in done.stderr
