"""paged_decode_reference (kernels/paged_attention.py) == what the engine computes today (CPU).

The kernel is checked against the reference (tests/layers/paged_attention_cases.py);
here the reference is checked against DensePagedAttention's decode step over a
real pool (native reads of the rotated, smoothed formats, sink rows at position 0),
so kernel == reference == engine.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.kernels.paged_attention import (MAX_SPLITS, MIN_SPLIT_TOKENS, PROGRAMS_PER_SM,
                                            choose_num_splits, paged_decode_reference)
from kvtier.kv.formats import FORMAT_NAMES, make_format
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention

PS, HQ, HKV, D = 4, 4, 2, 16
TABLES = [[5, 2, 9], [0, 7], [11, 3, 4, 6, 1]]  # scattered pages, one sequence per row
LENS = [10, 6, 17]  # prefill lengths; the decode token makes them 11, 7, 18


def engine_and_reference(name: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill + one batched decode step through DensePagedAttention, and the reference
    over the same pool in the stored domain (native_q / native_out around it)."""
    g = torch.Generator().manual_seed(seed)
    pool = PagePool(make_format(name), 1, 16, HKV, PS, D, "cpu", compute_dtype=dtype)
    att = DensePagedAttention(pool, D ** -0.5)
    ks = [(torch.randn(n + 1, HKV, D, generator=g) * 2 + 1).to(dtype) for n in LENS]  # +1: the decode token
    vs = [torch.randn(n + 1, HKV, D, generator=g).to(dtype) for n in LENS]
    qsl = [0]
    for n in LENS:
        qsl.append(qsl[-1] + n)
    slots = torch.tensor([pt[p // PS] * PS + p % PS for pt, n in zip(TABLES, LENS) for p in range(n)])
    q = torch.randn(qsl[-1], HQ, D, generator=g).to(dtype)
    att.forward(0, q, torch.cat([k[:-1] for k in ks]), torch.cat([v[:-1] for v in vs]),
                AttentionMetadata(qsl, LENS, TABLES, slots, torch.tensor([0])))
    q1 = torch.randn(len(LENS), HQ, D, generator=g).to(dtype)
    slots1 = torch.tensor([pt[n // PS] * PS + n % PS for pt, n in zip(TABLES, LENS)])
    lens1 = [n + 1 for n in LENS]
    meta1 = AttentionMetadata(list(range(len(LENS) + 1)), lens1, TABLES, slots1, torch.arange(len(LENS)))
    out = att.forward(0, q1, torch.stack([k[-1] for k in ks]), torch.stack([v[-1] for v in vs]), meta1)

    table = torch.zeros(len(TABLES), max(map(len, TABLES)), dtype=torch.int32)
    for b, pt in enumerate(TABLES):
        table[b, :len(pt)] = torch.tensor(pt)
    sink = pool.kernel_sink(0)
    if sink is not None:
        assert bool((pool.sink_slot[table[:, 0].long()] >= 0).all())  # the prefill kept every row 0
    qn = pool.native_q(0, q1) if att.native else q1
    ref = paged_decode_reference(qn, pool.layers[0], pool.fmt, table, torch.tensor(lens1, dtype=torch.int32),
                                 D ** -0.5, sink=sink)
    return out, pool.native_out(ref) if att.native else ref


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_reference_equals_dense_backend_fp32(name: str) -> None:
    out, ref = engine_and_reference(name, torch.float32, seed=1)
    torch.testing.assert_close(ref, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4"])
def test_reference_equals_dense_backend_bf16(name: str) -> None:
    out, ref = engine_and_reference(name, torch.bfloat16, seed=2)
    torch.testing.assert_close(ref.float(), out.float(), rtol=1e-2, atol=1e-2)


def test_reference_zero_length_rows_are_zero() -> None:
    fmt = make_format("int4")
    st = fmt.allocate(4, HKV, PS, D, torch.device("cpu"))
    st["k"].random_(0, 256)
    st["v"].random_(0, 256)
    st["k_scale"].fill_(0.5)
    st["v_scale"].fill_(0.5)
    q = torch.randn(2, HQ, D)
    out = paged_decode_reference(q, st, fmt, torch.tensor([[1, 2], [3, 0]], dtype=torch.int32),
                                 torch.tensor([5, 0], dtype=torch.int32), 0.25)
    assert out[0].abs().sum() > 0 and not out[1].any()


@pytest.mark.parametrize("batch", [1, 4, 32, 256])
@pytest.mark.parametrize("context", [1, 100, 1024, 32768])
def test_choose_num_splits_bounds(batch: int, context: int) -> None:
    n = choose_num_splits(batch, 8, context, 16, 132)
    assert 1 <= n <= MAX_SPLITS
    assert n == 1 or context / n >= MIN_SPLIT_TOKENS / 2  # no split far below the minimum size
    if batch * 8 >= PROGRAMS_PER_SM * 132:
        assert n == 1  # enough programs without splitting
    if batch == 1 and context == 32768:
        assert n > 8  # one long sequence spreads over the GPU


# torch dtype -> Triton signature type of a pointer argument
_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
        torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}


@pytest.mark.parametrize("name", ["bf16", "k8v4", "int4"])
def test_split_kernel_compiles_for_h200(name: str) -> None:
    """The split kernel compiles for sm_90 on this CPU box (Triton's bundled ptxas): tensor-core
    mma and cp.async-pipelined page loads. Catches GPU-only compile errors early."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("interpreter mode: kernels are Python functions")
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import kvtier.kernels.paged_attention as pa
    fmt, compute = make_format(name), torch.bfloat16
    lay = {key: dtype for key, (_, dtype) in fmt.layout(8, 16, 128).items()}
    ptrs = {"q_ptr": compute, "k_ptr": lay["k"], "ks_ptr": lay.get("k_scale", lay["k"]), "v_ptr": lay["v"],
            "vs_ptr": lay.get("v_scale", lay["v"]), "bt_ptr": torch.int32, "lens_ptr": torch.int32,
            "sk_ptr": compute, "sv_ptr": compute, "slot_ptr": torch.int64, "o_ptr": torch.float32,
            "lse_ptr": torch.float32}
    const = pa.split_constants(fmt, 128, 16, 4, compute, fmt.quantized, False)
    names = pa._split_kernel.arg_names
    sig = {n: _SIG[ptrs[n]] if n in ptrs else "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32"
           for n in names}
    aligned = [*ptrs, "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_os"]  # as the JIT sees them
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(pa._split_kernel, sig, constexprs=const, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": pa.NUM_WARPS, "num_stages": pa.NUM_STAGES})
    except FileNotFoundError as e:  # a Triton build without its bundled ptxas
        pytest.skip(f"no ptxas: {e}")
    ptx = kernel.asm["ptx"]
    assert "mma.sync" in ptx and "cp.async" in ptx
