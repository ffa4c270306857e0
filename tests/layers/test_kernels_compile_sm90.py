"""The kernels that rotate through kernels/hadamard.py's transform, and the retrieval selection's
kernels, compile for sm_90 on this CPU box (Triton's bundled ptxas).

The interpreter (TRITON_INTERPRET=1) runs their Python semantics only: a construct the compiler
refuses (a constexpr reassigned inside a static loop was one) passes there and fails on the first
GPU launch. The numbers are checked by the interpreter cases and tests/gpu.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.kv.formats import make_format

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="interpreter mode: kernels are Python functions")

_SIG = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int8: "*i8",
        torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64"}
INV_SQRT_128 = 128 ** -0.5


def _compile(fn, ptrs: dict[str, str], const: dict[str, object], floats: tuple[str, ...] = (), warps: int = 4,
             stages: int = 2, **options: object) -> object:
    """Compile `fn` for sm_90: pointer arguments typed by `ptrs`, `const` as constexprs, `floats`
    fp32 scalars, every other argument i32 -> the compiled kernel."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    try:
        return triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, **options})
    except FileNotFoundError as e:  # a Triton build without its bundled ptxas
        pytest.skip(f"no ptxas: {e}")


def _pages(name: str) -> dict[str, str]:
    lay = {key: dtype for key, (_, dtype) in make_format(name).layout(8, 16, 128).items()}
    return {"k": _SIG[lay["k"]], "ks": _SIG[lay.get("k_scale", lay["k"])], "v": _SIG[lay["v"]],
            "vs": _SIG[lay.get("v_scale", lay["v"])]}


def _split_ptrs(pg: dict[str, str]) -> dict[str, str]:
    """Pointer types of paged_attention._split_kernel for a format's pages (`_pages`)."""
    return {"q_ptr": "*bf16", "k_ptr": pg["k"], "ks_ptr": pg["ks"], "v_ptr": pg["v"], "vs_ptr": pg["vs"],
            "bt_ptr": "*i32", "lens_ptr": "*i32", "idx_ptr": "*i32", "ok_ptr": "*i32", "sk_ptr": "*bf16",
            "sv_ptr": "*bf16", "slot_ptr": "*i64", "o_ptr": "*fp32", "lse_ptr": "*fp32", "cs_ptr": "*fp32"}


def _store_args(name: str, block: int) -> tuple[dict[str, str], dict[str, object]]:
    """(pointer types of the store kernels' page arguments, their shared constexprs) for format `name`."""
    import kvtier.kernels.kv_transform as kt
    fmt, pg = make_format(name), _pages(name)
    const = dict(D=128, BLOCK_T=block, INV_SQRT_D=INV_SQRT_128, K_SMOOTH=1 if fmt.quantized else 0,
                 K_ROTATE=fmt.rotate_k, V_ROTATE=fmt.rotate_v, BIAS=8.0, MIN_S=1e-8,
                 **kt._codec_args("K", fmt.k_codec, 128), **kt._codec_args("V", fmt.v_codec, 128))
    pages = {"kd_ptr": pg["k"], "ks_ptr": pg["ks"], "vd_ptr": pg["v"], "vs_ptr": pg["vs"], "slot_ptr": "*i64",
             "shift_ptr": "*fp32", "cs_ptr": "*fp32"}
    return pages, const


# rope_store's own pointers and constexprs (besides `_store_args`')
ROPE_PTRS = {"qkv_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
             "q_ptr": "*bf16", "k_ptr": "*bf16"}
ROPE_CONST = dict(HQ=32, HKV=8, HAS_NORM=True)
GEMV_PTRS = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*fp16", "mn_ptr": "*fp16", "b_ptr": "*bf16",
             "r_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "sem_ptr": "*i32"}


def _gemv_const(bits: int, **over: object) -> dict[str, object]:
    """The half2 GEMV's constexprs (16-row programs, 4 chunks a thread), with `over` changed."""
    return dict(BITS=bits, GROUP=32, HAS_MINS=bits == 4, HAS_BIAS=False, HAS_RES=True, BLOCK_N=16, ROWS=4, LANES=32,
                CPT=4, PARTIAL=False, PREFETCH=True, ASM=True, DOT_PREC="tf32") | over


@pytest.mark.parametrize("name", ["int8", "k8v4", "int4"])
def test_split_kernel_with_folded_rotation_compiles(name: str) -> None:
    pytest.importorskip("triton")
    import kvtier.kernels.paged_attention as pa
    pg = _pages(name)
    native = pa.NativeDomain(torch.ones(8, 128), True, True)
    const = pa.split_constants(make_format(name), 128, 16, 4, torch.bfloat16, True, False, 64, native)
    _compile(pa._split_kernel, _split_ptrs(pg), const, floats=("qk_scale",), warps=pa.NUM_WARPS,
             stages=pa.NUM_STAGES)
    _compile(pa._merge_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
             dict(D=128, CHUNK=pa.MERGE_CHUNK, ROTATE=True, INV_SQRT_D=INV_SQRT_128))


@pytest.mark.parametrize("block", [1, 16])
@pytest.mark.parametrize("name", ["int8", "k8v4", "bf16"])
def test_store_kernels_compile(name: str, block: int) -> None:
    pytest.importorskip("triton")
    import kvtier.kernels.kv_transform as kt
    pages, const = _store_args(name, block)
    warps = kt.ROW_WARPS if block == 1 else kt.TILE_WARPS
    _compile(kt._rope_store_kernel, {**pages, **ROPE_PTRS}, const | ROPE_CONST, floats=("eps", "inv_d"), warps=warps)
    _compile(kt._transform_store_kernel, {**pages, "k_ptr": "*bf16", "v_ptr": "*bf16"}, const, warps=warps)
    _compile(kt._transform_rows_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "cs_ptr": "*fp32"},
             dict(D=128, BLOCK_T=block, SMOOTH=2, ROTATE=True, INV_SQRT_D=INV_SQRT_128), warps=warps)


def test_selection_kernels_compile() -> None:
    pytest.importorskip("triton")
    import kvtier.kernels.retrieval_attention as ra
    # hybrid-mid: midrange from the same reads; 8-bit summaries (codes, an exponent a page and head)
    for mid, reduce_max, codes in ((False, False, False), (True, False, False), (False, True, False),
                                   (True, False, True), (False, True, True)):
        summ = "*i8" if codes else "*bf16"
        _compile(ra._quest_kernel, {"q_ptr": "*bf16", "ids_ptr": "*i64", "kmin_ptr": summ, "kmax_ptr": summ,
                                    "cnt_ptr": "*i32", "hmin_ptr": summ, "hmax_ptr": summ, "hcnt_ptr": "*i32",
                                    "lim_ptr": "*i64", "cand_ptr": "*i64", "out_ptr": "*fp32", "mid_ptr": "*fp32",
                                    "kexp_ptr": "*i8", "hexp_ptr": "*i8"},
                 dict(D=128, BLOCK_C=ra.SCORE_TILE // 128, REDUCE_MAX=reduce_max, HAS_HOST=True, HAS_LIMIT=True,
                      CENTROID=False, FILL=True, MID=mid, CODES=codes))
    _compile(ra._assemble_kernel, {n: "*i64" for n in ("top_ptr", "cidx_ptr", "cids_ptr", "fidx_ptr", "fids_ptr",
                                                       "topk_ptr", "idx_ptr", "ids_ptr")}, dict(BLOCK=128), warps=1)
    for has_sum in (True, False):
        _compile(ra._summary_rows_kernel, {"slot_ptr": "*i64", "k_ptr": "*bf16", "kmin_ptr": "*fp32",
                                           "kmax_ptr": "*fp32", "ksum_ptr": "*fp32", "cnt_ptr": "*i32"},
                 dict(D=128, HAS_SUM=has_sum, CODES=False), warps=1)
    _compile(ra._summary_rows_kernel, {"slot_ptr": "*i64", "k_ptr": "*bf16", "kmin_ptr": "*i8", "kmax_ptr": "*i8",
                                       "ksum_ptr": "*i8", "cnt_ptr": "*i32", "kexp_ptr": "*i8"},
             dict(D=128, HAS_SUM=False, CODES=True), warps=1)
    _compile(ra._topk_chunk_kernel, {"s_ptr": "*fp32", "live_ptr": "*i64", "out_ptr": "*i64"},
             dict(CH=1024, KP=64, HAS_LIVE=True), warps=ra.TOPK_CHUNK_WARPS)
    # one sort of every chunk's picks; with few live chunks, theirs only; striking the picks from
    # a hybrid's second scores
    for group, exclude in ((0, False), (4, False), (4, True)):
        _compile(ra._topk_merge_kernel, {"key_ptr": "*i64", "live_ptr": "*i64", "out_ptr": "*i64",
                                         "exc_ptr": "*fp32"},
                 dict(KP=64, NP=32 * 64, GROUP=group, EXCLUDE=exclude), warps=16)


@pytest.mark.parametrize("coarse", [False, True])
def test_filtered_topk_kernels_compile(coarse: bool) -> None:
    """The threshold top-k's three kernels (TOPK_FILTER), with the ticket (the default) and with
    TOPK_FILTER_COARSE, at a 256K table's launch settings (k 56: 64 picks, 1,024-key buffer)."""
    pytest.importorskip("triton")
    from kvtier.kernels import retrieval_attention as ra
    w = ra.TOPK_FILTER_WARPS
    _compile(ra._topk_max_kernel, {"s_ptr": "*fp32", "live_ptr": "*i64", "max_ptr": "*i32", "state_ptr": "*i32",
                                   "thr_ptr": "*i32", "cmax_ptr": "*i32"},
             dict(CH=1024, SUB=16, TP=512, KTP=64, HAS_LIVE=True, COARSE=coarse, G=8), warps=w)
    _compile(ra._topk_filter_kernel, {"s_ptr": "*fp32", "live_ptr": "*i64", "thr_ptr": "*i32", "max_ptr": "*i32",
                                      "cnt_ptr": "*i32", "cand_ptr": "*i64"},
             dict(CH=1024, CAP=1024, HAS_LIVE=True, COARSE=coarse, SUB=16, G=8, GR=256, KTP=64), warps=w)
    _compile(ra._topk_pick_kernel, {"s_ptr": "*fp32", "live_ptr": "*i64", "cnt_ptr": "*i32", "cand_ptr": "*i64",
                                    "out_ptr": "*i64", "exc_ptr": "*fp32", "max_ptr": "*i32"},
             dict(KP=64, SMALL=128, MID=512, CAP=1024, TILE=1024, HAS_LIVE=True, EXCLUDE=True, COARSE=coarse,
                  SUB=16, TP=512), warps=w)


@pytest.mark.parametrize("vector_x", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_kernel_compiles(bits: int, vector_x: bool) -> None:
    """The half2 GEMV (inline PTX; x paired in registers with vector_x) builds for sm_90."""
    pytest.importorskip("triton")
    import kvtier.kernels.wq_kernels as wk
    _compile(wk._gemv_kernel, GEMV_PTRS, _gemv_const(bits, VEC_X=vector_x), stages=1)


def _loads_before_wait(kernel: object) -> int:
    """Global loads in the PTX before griddepcontrol.wait, which must come after launch_dependents."""
    lines = kernel.asm["ptx"].splitlines()  # type: ignore[attr-defined]
    at = {op: next(i for i, line in enumerate(lines) if f"griddepcontrol.{op}" in line)
          for op in ("launch_dependents", "wait")}
    assert at["launch_dependents"] < at["wait"]
    return sum("ld.global" in line for line in lines[:at["wait"]])


def test_pdl_kernels_wait_before_reading() -> None:
    """kernels/pdl.py's rule in the sm_90 builds of the decode chain's kernels launched with PDL:
    each lets its dependents start, then waits, before any load; only the GEMV loads (its first
    rows' weights) before its wait."""
    pytest.importorskip("triton")
    import kvtier.kernels.fused as fu
    import kvtier.kernels.kv_transform as kt
    import kvtier.kernels.paged_attention as pa
    import kvtier.kernels.wq_kernels as wk
    import kvtier.kernels.wq_matmul as wq
    pdl = dict(PDL=True)
    gemv = _compile(wk._gemv_kernel, GEMV_PTRS, _gemv_const(4, VEC_X=True, **pdl), stages=1, launch_pdl=True)
    assert _loads_before_wait(gemv) > 0
    # the skinny kernel (8-bit weights at decode, SkinnyConfig.pdl): its first codes and groups
    skinny = _compile(wq._skinny_kernel, GEMV_PTRS,
                      dict(BITS=8, GROUP=32, HAS_MINS=False, HAS_BIAS=False, HAS_RES=True, BLOCK_N=32, BLOCK_M=1,
                           BLOCK_K=256, PARTIAL=False, USE_DOT=False, GROUP_SCALE=True, WORDS=True, CVT=2,
                           PREFETCH=True, DOT_PREC="tf32", **pdl), stages=3, launch_pdl=True)
    assert _loads_before_wait(skinny) > 0
    pages, store = _store_args("k8v4", 1)
    split = pa.split_constants(make_format("k8v4"), 128, 16, 4, torch.bfloat16, True, False, 64, None)
    others = [
        _compile(kt._rope_store_kernel, {**pages, **ROPE_PTRS}, store | ROPE_CONST | pdl, floats=("eps", "inv_d"),
                 warps=kt.ROW_WARPS, launch_pdl=True),
        _compile(pa._split_kernel, _split_ptrs(_pages("k8v4")), split | pdl, floats=("qk_scale",), warps=pa.NUM_WARPS,
                 stages=1, launch_pdl=True),
        _compile(pa._merge_kernel, {"part_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16"},
                 dict(D=128, CHUNK=pa.MERGE_CHUNK, **pdl), launch_pdl=True),
        _compile(wq._reduce_kernel, {"p_ptr": "*fp32", "b_ptr": "*bf16", "r_ptr": "*bf16", "y_ptr": "*bf16"},
                 dict(HAS_BIAS=False, HAS_RES=True, BLOCK=wq.REDUCE_BLOCK, **pdl), launch_pdl=True),
        _compile(fu._rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16"},
                 dict(H=4096, BLOCK=1024, **pdl), floats=("eps", "inv_h"), launch_pdl=True),
        _compile(fu._silu_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16"},
                 dict(BLOCK=fu.SILU_BLOCK, EXACT_MATH=True, **pdl), launch_pdl=True),
    ]
    import kvtier.kernels.retrieval_attention as ra  # a retrieval step's selection chain
    others += [
        _compile(ra._summary_rows_kernel, {"slot_ptr": "*i64", "k_ptr": "*bf16", "kmin_ptr": "*bf16",
                                           "kmax_ptr": "*bf16", "ksum_ptr": "*bf16", "cnt_ptr": "*i32"},
                 dict(D=128, HAS_SUM=False, CODES=False, **pdl), warps=1, launch_pdl=True),
        _compile(ra._quest_kernel, {"q_ptr": "*bf16", "ids_ptr": "*i64", "kmin_ptr": "*i8", "kmax_ptr": "*i8",
                                    "cnt_ptr": "*i32", "hmin_ptr": "*i8", "hmax_ptr": "*i8", "hcnt_ptr": "*i32",
                                    "lim_ptr": "*i64", "cand_ptr": "*i64", "out_ptr": "*fp32", "mid_ptr": "*fp32",
                                    "kexp_ptr": "*i8", "hexp_ptr": "*i8"},
                 dict(D=128, BLOCK_C=ra.SCORE_TILE // 128, REDUCE_MAX=False, HAS_HOST=True, HAS_LIMIT=True,
                      CENTROID=False, FILL=True, MID=True, CODES=True, **pdl), launch_pdl=True),
        _compile(ra._topk_chunk_kernel, {"s_ptr": "*fp32", "live_ptr": "*i64", "out_ptr": "*i64"},
                 dict(CH=1024, KP=64, HAS_LIVE=True, **pdl), warps=ra.TOPK_CHUNK_WARPS, launch_pdl=True),
        _compile(ra._topk_merge_kernel, {"key_ptr": "*i64", "live_ptr": "*i64", "out_ptr": "*i64", "exc_ptr": "*fp32"},
                 dict(KP=64, NP=32 * 64, GROUP=4, EXCLUDE=True, **pdl), warps=16, launch_pdl=True),
        _compile(ra._assemble_kernel, {n: "*i64" for n in ("top_ptr", "cidx_ptr", "cids_ptr", "fidx_ptr", "fids_ptr",
                                                           "topk_ptr", "idx_ptr", "ids_ptr")},
                 dict(BLOCK=128, **pdl), warps=1, launch_pdl=True),
    ]
    assert [_loads_before_wait(k) for k in others] == [0] * len(others)


@pytest.mark.parametrize("name", ["bf16", "k8v4"])
def test_hot_pages_kernel_compiles(name: str) -> None:
    """The GPU cache's lookup (atomics and copies under scalar branches) for plain and coded pages."""
    pytest.importorskip("triton")
    import kvtier.kernels.hot_pages as hp
    from kvtier.kv.pool import PagePool
    pg = _pages(name)
    const = hp.launch_constants(PagePool(make_format(name), 1, 1, 8, 16, 128, "cpu").layers[0])
    ptrs = {"ids_ptr": "*i64", "idx_ptr": "*i64", "out_ptr": "*i64", "map_ptr": "*i32", "owner_ptr": "*i32",
            "claim_ptr": "*i64", "base_ptr": "*i64", "stats_ptr": "*i64", "t0": pg["k"], "t1": pg["ks"],
            "t2": pg["v"], "t3": pg["vs"]}
    _compile(hp._hot_kernel, ptrs, const, warps=2)
