"""paged_prefill_reference (kernels/paged_attention.py) == what the engine computes today (CPU).

The kernel is checked against the reference (tests/layers/prefill_cases.py, interpreted here
and on CUDA in tests/gpu/test_paged_prefill.py); here the reference is checked against
DensePagedAttention on a mixed prefill step over a real pool (native reads of the rotated,
smoothed formats, sink rows at position 0), so kernel == reference == engine.

    step 1 (prefill):  seq 0: 10 rows from 0     seq 1: 6 rows from 0
    step 2 (mixed):    seq 0: 7 rows at 10..16 (mid-page)   seq 1: 1 row at 6
                       seq 2: 9 rows from 0                 seq 3: 1 row at 0
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.kernels.paged_attention import paged_decode_reference, paged_prefill_reference
from kvtier.kv.formats import FORMAT_NAMES, make_format
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention

PS, HQ, HKV, D = 4, 4, 2, 16
TABLES = [[5, 2, 9, 12, 14], [0, 7], [11, 3, 4], [6]]  # scattered pages, one sequence per row
STEP1 = [10, 6]  # rows of seqs 0 and 1 in the first step (both from position 0)
STEP2 = [7, 1, 9, 1]  # new rows of every sequence in the mixed step
CONTEXT = [STEP1[0] + STEP2[0], STEP1[1] + STEP2[1], STEP2[2], STEP2[3]]  # after the mixed step


def _meta(news: list[int], ctx: list[int], tables: list[list[int]]) -> AttentionMetadata:
    qsl = [0]
    for n in news:
        qsl.append(qsl[-1] + n)
    slots = torch.tensor([pt[p // PS] * PS + p % PS for pt, n, c in zip(tables, news, ctx) for p in range(c - n, c)])
    return AttentionMetadata(qsl, ctx, tables, slots, torch.tensor([qsl[-1] - 1]))


def engine_and_reference(name: str, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two steps through DensePagedAttention, and the reference of the second over the same pool
    in the stored domain (native_q / native_out around it)."""
    g = torch.Generator().manual_seed(seed)
    pool = PagePool(make_format(name), 1, 16, HKV, PS, D, "cpu", compute_dtype=dtype)
    att = DensePagedAttention(pool, D ** -0.5)

    def rows(n: int, shift: float) -> torch.Tensor:
        return (torch.randn(n, HKV, D, generator=g) * 2 + shift).to(dtype)

    n1 = sum(STEP1)
    att.forward(0, torch.randn(n1, HQ, D, generator=g).to(dtype), rows(n1, 1.0), rows(n1, 0.0),
                _meta(STEP1, STEP1, TABLES[:2]))
    meta = _meta(STEP2, CONTEXT, TABLES)
    n2 = sum(STEP2)
    q = torch.randn(n2, HQ, D, generator=g).to(dtype)
    out = att.forward(0, q, rows(n2, 1.0), rows(n2, 0.0), meta)

    table = torch.zeros(len(TABLES), max(map(len, TABLES)), dtype=torch.int32)
    for b, pt in enumerate(TABLES):
        table[b, :len(pt)] = torch.tensor(pt)
    sink = pool.kernel_sink(0)
    if sink is not None:
        assert bool((pool.sink_slot[table[:, 0].long()] >= 0).all())  # every first chunk kept its row 0
    qn = pool.native_q(0, q) if att.native else q
    ref = paged_prefill_reference(qn, pool.layers[0], pool.fmt, table, torch.tensor(CONTEXT, dtype=torch.int32),
                                  torch.tensor(meta.query_start_loc, dtype=torch.int32), D ** -0.5, sink=sink)
    return out, pool.native_out(ref) if att.native else ref


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_reference_equals_dense_backend_fp32(name: str) -> None:
    out, ref = engine_and_reference(name, torch.float32, seed=1)
    torch.testing.assert_close(ref, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4"])
def test_reference_equals_dense_backend_bf16(name: str) -> None:
    out, ref = engine_and_reference(name, torch.bfloat16, seed=2)
    torch.testing.assert_close(ref.float(), out.float(), rtol=1e-2, atol=1e-2)


def test_one_row_per_sequence_is_decode() -> None:
    """A prefill of one new row per sequence == paged_decode_reference (sinks included)."""
    fmt = make_format("k8v4")
    pool = PagePool(fmt, 1, 8, HKV, PS, D, "cpu", compute_dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    pool.write(0, torch.randperm(8 * PS, generator=g), torch.randn(8 * PS, HKV, D, generator=g),
               torch.randn(8 * PS, HKV, D, generator=g))
    slots = pool.assign_sinks([4])  # seq 0's first page keeps an exact row 0
    pool.write(0, torch.tensor([4 * PS]), torch.randn(1, HKV, D, generator=g), torch.randn(1, HKV, D, generator=g),
               sink=(torch.tensor([0]), slots))
    table = torch.tensor([[4, 1, 2], [5, 0, 0], [6, 7, 3]], dtype=torch.int32)
    lens = torch.tensor([9, 3, 12], dtype=torch.int32)
    q = torch.randn(3, HQ, D, generator=g)
    sink = pool.kernel_sink(0)
    got = paged_prefill_reference(q, pool.layers[0], fmt, table, lens, torch.arange(4, dtype=torch.int32),
                                  0.25, sink=sink)
    want = paged_decode_reference(q, pool.layers[0], fmt, table, lens, 0.25, sink=sink)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# torch dtype -> Triton signature type of a pointer argument
_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
        torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}


@pytest.mark.parametrize("name", ["bf16", "k8v4", "int4"])
def test_prefill_kernel_compiles_for_h200(name: str) -> None:
    """The prefill kernel compiles for sm_90 at Llama-like sizes (GQA 4, D 128, bf16) on this
    CPU box (Triton's bundled ptxas), with tensor-core dots. Catches GPU-only compile errors."""
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
            "qsl_ptr": torch.int32, "sk_ptr": compute, "sv_ptr": compute, "slot_ptr": torch.int64,
            "o_ptr": compute}
    block_m, block_n, warps, stages = pa.prefill_blocks(fmt, 128, compute)
    const = pa.prefill_constants(fmt, 128, 16, 4, compute, fmt.quantized, block_m, block_n)
    names = pa._prefill_kernel.arg_names
    sig = {n: _SIG[ptrs[n]] if n in ptrs else "constexpr" if n in const else "fp32" if n == "qk_scale" else "i32"
           for n in names}
    aligned = [*ptrs, "stride_qt", "stride_qh", "stride_ot", "stride_oh"]  # as the JIT sees them
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(pa._prefill_kernel, sig, constexprs=const, attrs=attrs)
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": warps, "num_stages": stages})
    except FileNotFoundError as e:  # a Triton build without its bundled ptxas
        pytest.skip(f"no ptxas: {e}")
    assert "mma" in kernel.asm["ptx"]
