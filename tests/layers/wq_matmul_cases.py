"""Shared checks of the weight-only quantized matmul kernels (kvtier/kernels/wq_matmul.py)
against `wq_linear_reference`.

Used by tests/layers/test_wq_matmul_interp.py (TRITON_INTERPRET=1 on CPU, tiny sizes: this file
runs as a script in a fresh interpreter, since the interpreter must be chosen before triton is
first imported) and tests/gpu/test_wq_matmul.py (CUDA, Qwen3-8B sizes).
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from collections.abc import Callable
from types import ModuleType

import torch

from kvtier.layers.qweight import QuantWeight, pack_int4, quantize_rtn

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Max |kernel - reference| as a share of the reference's rms (the kernels may round the dequantized
# weight to x.dtype before a tensor-core product; fp32 differs in summation order only) ...
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-2, torch.float32: 1e-4}
# ... plus this many rounding steps of the largest output: both sides round once to x.dtype, from
# fp32 sums that differ in their last bits, so a rounding can flip (the interpreter truncates).
ROUNDING_STEPS = 1
WEIGHT_STD = 0.05


def gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))  # hash() is salted per process


def make_weight(n: int, k: int, bits: int, group: int, mins: bool, device: str, g: torch.Generator) -> QuantWeight:
    """A random QuantWeight. 4-bit with mins / 8-bit without: RTN of a Gaussian (GGUF Q4_1 / Q8_0 like);
    the other two: random codes over the full range with random-sign scales (and random mins)."""
    if (bits, mins) in ((4, True), (8, False)):
        return quantize_rtn(WEIGHT_STD * torch.randn(n, k, generator=g), bits, group).to(device)
    ng = k // group
    scales = (WEIGHT_STD / 8 * torch.randn(n, ng, generator=g)).to(torch.float16)
    mn = (WEIGHT_STD * torch.randn(n, ng, generator=g)).to(torch.float16) if mins else None
    if bits == 4:
        codes = pack_int4(torch.randint(0, 16, (n, k), generator=g))
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    return QuantWeight(bits, group, codes, scales, mn).to(device)


def make_inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, residual: bool, strided: bool,
                device: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] (strided: a column slice of a wider tensor), bias [N], residual [M, N]; never zero."""
    x = (torch.randn(m, k + (8 if strided else 0), generator=g) * 2 + 0.1)[:, :k]
    b = torch.randn(n, generator=g) * 0.5 + 0.1 if bias else None
    r = torch.randn(m, n, generator=g) + 0.1 if residual else None
    return tuple(None if t is None else t.to(device=device, dtype=dtype) for t in (x, b, r))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if want.numel() == 0:
        return
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all(), f"{what}: non-finite output"
    rms = float(w.pow(2).mean().sqrt())
    err = float((g - w).abs().max())
    bound = REL_TOL[want.dtype] * rms + ROUNDING_STEPS * torch.finfo(want.dtype).eps * float(w.abs().max())
    assert err <= bound, f"{what}: max err {err:.3g} > {bound:.3g} (rms {rms:.3g})"


def check(wq: ModuleType, run: Callable, label: str, m: int, n: int, k: int, bits: int, group: int, mins: bool,
          dtype: torch.dtype, device: str, bias: bool = False, residual: bool = False,
          strided: bool = False) -> None:
    """run(x, w, bias, residual) == wq_linear_reference on random data of these sizes."""
    g = gen(m, n, k, bits, group, mins, dtype, bias, residual, strided)
    w = make_weight(n, k, bits, group, mins, device, g)
    x, b, r = make_inputs(m, n, k, dtype, bias, residual, strided, device, g)
    what = f"{label} M={m} N={n} K={k} bits={bits} group={group} mins={mins} {dtype} bias={bias} res={residual}"
    assert_close(run(x, w, b, r), wq.wq_linear_reference(x, w, b, r), what)


def paths(wq: ModuleType, interpreted: bool) -> dict[str, Callable]:
    """Every kernel path under a name: the skinny kernel's switches, split-K, the GEMM and the
    dequantize+matmul path. Interpreted: small tiles so a tiny K still takes two iterations."""
    s, gm = wq.SkinnyConfig, wq.GemmConfig
    if interpreted:
        base, gemm = s(block_n=32, block_k=64), gm(block_m=16, block_n=32, block_k=32, group_m=2)
    else:
        base, gemm = s(), wq.GEMM_CONFIG
    chunk = 16 if interpreted else 1000  # rows of W per dequantized chunk: several chunks per weight
    tile = dict(block_n=base.block_n, block_k=base.block_k)
    dot = s(**tile, use_dot=True, group_scale=False)

    def sk(cfg):  # noqa: ANN001, ANN202
        return lambda x, w, b, r: wq.wq_skinny(x, w, b, r, cfg)

    g = wq.GemvConfig
    if interpreted:  # K = 128: 4-bit 4 chunks of 32 codes, 8-bit 8 of 16
        gemv, gemv_split = g(lanes=2, chunks=2, num_warps=1), g(lanes=2, chunks=1, num_warps=2, block_n=4)
    else:
        gemv, gemv_split = wq.GEMV_CONFIG, g(chunks=1, block_n=16)

    def gv(cfg):  # noqa: ANN001, ANN202 (wq_gemv takes 16-bit x and 4-bit groups >= 32: the rest as the reference)
        return lambda x, w, b, r: (wq.wq_gemv(x, w, b, r, cfg) if wq.gemv_supports(x, w)
                                   else wq.wq_linear_reference(x, w, b, r))

    return {
        "gemv": gv(gemv),
        "gemv_split_no_prefetch": gv(replace(gemv_split, prefetch=False)),
        "gemv_split": gv(gemv_split),
        # the default loads x a word at a time for 4-bit weights, a value at a time for 8-bit ones
        "gemv_scalar_x": gv(replace(gemv, vector_x=False)),
        "gemv_vector_x": gv(replace(gemv, vector_x=True)),
        "gemv_split_scalar_x": gv(replace(gemv_split, vector_x=False)),
        "fma": sk(base),
        "fma_magic": sk(s(**tile, cvt="magic")),
        "fma_dequant_first": sk(s(**tile, group_scale=False)),
        "fma_bytes_cvt": sk(s(**tile, words=False, cvt="cvt")),
        "fma_split2_no_prefetch": sk(s(**tile, split_k=2, prefetch=False)),
        "dot": sk(dot),
        "dot_magic": sk(replace(dot, cvt="magic")),
        "dot_group_scale_no_prefetch": sk(s(**tile, use_dot=True, cvt="magic", prefetch=False)),
        "dot_bytes_cvt_split2": sk(s(**tile, use_dot=True, group_scale=False, words=False, cvt="cvt", split_k=2)),
        "gemm": lambda x, w, b, r: wq.wq_gemm(x, w, b, r, gemm),
        "gemm_magic": lambda x, w, b, r: wq.wq_gemm(x, w, b, r, replace(gemm, cvt="magic")),
        "gemm_words_cvt": lambda x, w, b, r: wq.wq_gemm(x, w, b, r, replace(gemm, words=True, cvt="cvt")),
        "dequant_chunked": lambda x, w, b, r: wq.wq_dequant_matmul(x, w, b, r, max_elems=chunk * w.shape[1]),
    }


# Interpreter cases: N = 48 (a partial 32-row tile), K = 128; odd M (a partial 16-row GEMM tile at
# M = 17, a partial dot tile at M = 3); (bits, group, mins) over the layouts GGUF files produce.
WEIGHTS = ((4, 32, True), (4, 32, False), (8, 32, False), (8, 16, True))
N, K = 48, 128


def interpreter_cases(wq: ModuleType) -> list[tuple[str, Callable, tuple]]:
    cases = []
    for name, run in paths(wq, interpreted=True).items():
        for i, (bits, group, mins) in enumerate(WEIGHTS):
            m = (1, 3, 17)[i % 3]
            dtype = DTYPES[i % 2]  # bf16, fp16; fp32 below
            cases.append((name, run, (m, N, K, bits, group, mins, dtype, "cpu", i % 2 == 0, i == 1, i == 3)))
    p = paths(wq, interpreted=True)
    for name in ("fma", "dot", "gemm"):  # fp32 x (ieee products), a 64 and a 128 group
        cases.append((name, p[name], (2, N, K, 4, 64, True, torch.float32, "cpu", True, True)))
        cases.append((name, p[name], (3, N, K, 8, 128, False, torch.bfloat16, "cpu")))
    return cases


def _bf16_dots_in_fp32() -> None:
    """The Triton 3.9 interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those bits
    (errors ~1e10; tests/layers/paged_attention_cases.py runs bf16 dots on the GPU only). Widen
    bf16 operands to fp32 (exact: the top half of an fp32) so the bf16 paths run here too."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    plain = interpreter.InterpreterBuilder.create_dot

    def widen(h):  # noqa: ANN001, ANN202 (interpreter TensorHandles)
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = np.ascontiguousarray(h.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return plain(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def main() -> None:
    """Run every interpreter case (TRITON_INTERPRET=1 must be set before triton is imported)."""
    _bf16_dots_in_fp32()
    import kvtier.kernels.wq_matmul as wq

    failures = []
    cases = interpreter_cases(wq)
    for name, run, args in cases:
        try:
            check(wq, run, name, *args)
        except Exception as e:  # noqa: BLE001 (a kernel that fails to build is a failed case too)
            failures.append(f"{name}{args}: {type(e).__name__}: {e}")
    y = wq.wq_skinny(torch.empty(0, K), make_weight(N, K, 4, 32, True, "cpu", gen(0)))
    if y.shape != (0, N):
        failures.append(f"M=0: shape {tuple(y.shape)}")
    print("\n".join(failures) if failures else f"ALL OK ({len(cases) + 1} cases)")


if __name__ == "__main__":
    main()
