"""Shared checks of the fused Triton kernels (kvtier/kernels/fused.py) against their PyTorch references.

Used by tests/layers/test_fused_interp.py (TRITON_INTERPRET=1 on CPU, tiny sizes: this file
runs as a script in a fresh interpreter, since the interpreter must be chosen before triton
is first imported) and tests/gpu/test_fused.py (CUDA, model sizes).
"""

from __future__ import annotations

import zlib
from types import ModuleType

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-6
NORM_WEIGHT_STD = 0.3  # norm weights 1 + N(0, 0.3): far enough from 1 that a skipped multiply shows
ROPE_THETA = 10000.0
MAX_POSITION = 4096
# A sum of squares reduced in another order can move rstd by one fp32 ulp, which flips a
# bf16 / fp16 rounding now and then; a rounding done at the wrong place flips far more (> 10%).
MAX_FLIP_FRACTION = 0.01
# Allowed difference for fp32 (summation order only) and for a flipped rounding (2 ulps of
# the largest output magnitude: one flip can pass through the weight and rotary multiplies).
FP32_RTOL = 1e-5
FLIP_ULPS = 2


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))  # hash() is salted per process


def _rows(t: int, width: int, dtype: torch.dtype, device: str, strided: bool, g: torch.Generator) -> torch.Tensor:
    """[t, width] random non-zero values; strided: a row view of a wider tensor (row stride > width)."""
    base = torch.randn(t, width + (7 if strided else 0), generator=g) * 2 + 0.1
    return base.to(device=device, dtype=dtype)[:, :width]


def _norm_weight(n: int, dtype: torch.dtype, device: str, g: torch.Generator) -> torch.Tensor:
    return (1 + NORM_WEIGHT_STD * torch.randn(n, generator=g)).to(device=device, dtype=dtype)


def assert_matches(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    """exact: bit-equal. Else fp32 within FP32_RTOL; bf16 / fp16 equal but for rare rounding flips."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
    if exact or got.numel() == 0:
        assert torch.equal(got, want), f"{what}: {int((got != want).sum())} of {got.numel()} differ"
        return
    g, w = got.float(), want.float()
    scale = float(w.abs().max())
    if got.dtype == torch.float32:
        torch.testing.assert_close(g, w, rtol=FP32_RTOL, atol=FP32_RTOL * scale, msg=lambda m: f"{what}: {m}")
        return
    flips = float((got != want).float().mean())
    worst = float((g - w).abs().max())
    assert flips <= MAX_FLIP_FRACTION, f"{what}: {flips:.2%} of values differ"
    assert worst <= FLIP_ULPS * torch.finfo(got.dtype).eps * scale, f"{what}: max diff {worst} (scale {scale})"


def check_rms_norm(fz: ModuleType, t: int, h: int, dtype: torch.dtype, device: str, strided: bool) -> None:
    g = _gen("rms", t, h, dtype, strided)
    x = _rows(t, h, dtype, device, strided, g)  # [T, H]
    w = _norm_weight(h, dtype, device, g)
    assert_matches(fz.rms_norm(x, w, EPS), fz.rms_norm_reference(x, w, EPS), False,
                   f"rms_norm T={t} H={h} {dtype} strided={strided}")


def check_silu_mul(fz: ModuleType, t: int, inter: int, dtype: torch.dtype, device: str, strided: bool,
                   exact: bool) -> None:
    gu = _rows(t, 2 * inter, dtype, device, strided, _gen("silu", t, inter, dtype, strided))  # [T, 2I]
    assert_matches(fz.silu_mul(gu), fz.silu_mul_reference(gu), exact,
                   f"silu_mul T={t} I={inter} {dtype} strided={strided}")


def rotary_tables(d: int, t: int, dtype: torch.dtype, device: str,
                  g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_signed: [T, 1, d] from RotaryEmbedding at random positions, as the decoder gets them."""
    from kvtier.layers.rotary import RotaryEmbedding

    rot = RotaryEmbedding(d, ROPE_THETA, MAX_POSITION, dtype=dtype, device=device)
    positions = torch.randint(0, MAX_POSITION, (t,), generator=g).to(device)
    return rot(positions, max_pos=MAX_POSITION - 1)


def check_qk_norm_rope(fz: ModuleType, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str,
                       qk_norm: bool, exact: bool = False) -> None:
    """Kernel == reference on a strided qkv row view; `exact` applies to the rotary-only case."""
    g = _gen("qk", t, hq, hkv, d, dtype, qk_norm)
    qkv = _rows(t, (hq + 2 * hkv) * d, dtype, device, True, g)  # [T, (Hq + 2 Hkv) * D]
    cos, sin = rotary_tables(d, t, dtype, device, g)
    qw = _norm_weight(d, dtype, device, g) if qk_norm else None
    kw = _norm_weight(d, dtype, device, g) if qk_norm else None
    q, k = fz.qk_norm_rope(qkv, hq, hkv, d, cos, sin, qw, kw, EPS)
    q_ref, k_ref = fz.qk_norm_rope_reference(qkv, hq, hkv, d, cos, sin, qw, kw, EPS)
    assert q.is_contiguous() and k.is_contiguous()
    what = f"qk_norm_rope T={t} hq={hq} hkv={hkv} d={d} {dtype} qk_norm={qk_norm}"
    assert_matches(q, q_ref.contiguous(), exact and not qk_norm, what + " q")
    assert_matches(k, k_ref.contiguous(), exact and not qk_norm, what + " k")


def check_empty(fz: ModuleType, device: str) -> None:
    """T = 0: empty outputs of the right shapes, no launch."""
    x = torch.empty(0, 16, device=device)
    assert fz.rms_norm(x, torch.ones(16, device=device), EPS).shape == (0, 16)
    assert fz.silu_mul(torch.empty(0, 32, device=device)).shape == (0, 16)
    tab = torch.empty(0, 1, 8, device=device)
    q, k = fz.qk_norm_rope(torch.empty(0, (4 + 2 * 2) * 8, device=device), 4, 2, 8, tab, tab, None, None, EPS)
    assert q.shape == (0, 4, 8) and k.shape == (0, 2, 8)


# Interpreter cases (tiny): odd T and H, a norm row wider than NORM_BLOCK (two chunks), an I wider
# than SILU_BLOCK (two column blocks), GQA ratios 1/4/8, head_dim 64 and 128, with and without QK-norm.
NORM_CASES = ((1, 64, False), (3, 33, True), (2, 4100, True))
SILU_CASES = ((1, 40, False), (3, 33, True), (2, 1500, True))
QK_HEADS = ((4, 4), (8, 2), (8, 1))
HEAD_DIMS = (64, 128)


def _round_bf16_like_the_gpu() -> None:
    """Triton's interpreter narrows fp32 -> bf16 by truncation; the GPU (cvt.rn) rounds to nearest
    even, as torch does. Make the interpreter round like the GPU so bf16 roundings compare exactly."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    truncating = interpreter._convert_float

    def convert(data, src, dst, rounding_mode):  # noqa: ANN001, ANN202 (the interpreter's signature)
        if src == tl.float32 and dst == tl.bfloat16:
            bf = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).to(torch.bfloat16)
            return bf.view(torch.int16).numpy().view(np.uint16)
        return truncating(data, src, dst, rounding_mode)

    interpreter._convert_float = convert


def main() -> None:
    """Run every interpreter case (TRITON_INTERPRET=1 must be set before triton is imported)."""
    _round_bf16_like_the_gpu()
    import kvtier.kernels.fused as fz

    cases = [(check_rms_norm, (fz, t, h, dt, "cpu", s)) for dt in DTYPES for t, h, s in NORM_CASES]
    cases += [(check_silu_mul, (fz, t, i, dt, "cpu", s, False)) for dt in DTYPES for t, i, s in SILU_CASES]
    cases += [(check_qk_norm_rope, (fz, 1 + 2 * (n % 2), hq, hkv, d, dt, "cpu", n < 2))
              for dt in DTYPES for hq, hkv in QK_HEADS for d in HEAD_DIMS for n in range(4)]
    cases.append((check_empty, (fz, "cpu")))
    failures = []
    for check, args in cases:
        try:
            check(*args)
        except AssertionError as e:
            failures.append(f"{check.__name__}{args[1:]}: {e}")
    print("\n".join(failures) if failures else f"ALL OK ({len(cases)} cases)")


if __name__ == "__main__":
    main()
