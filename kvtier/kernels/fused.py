"""Fused elementwise Triton kernels for the GPU decode step, each beside its plain-PyTorch reference.

Decode on a GPU runs many tiny kernels per layer; under CUDA graphs each still costs
a few microseconds. Three fusions, each one launch:

    rms_norm      x [T, H] -> y [T, H]                 (was cast, pow, mean, add, rsqrt, mul, cast, mul)
    qk_norm_rope  qkv [T, (Hq + 2 Hkv) * D] -> q, k    (was 2 x (norm + mul, roll, addcmul): 22 kernels;
                                                        3 without QK-norm)
    silu_mul      gu [T, 2I] -> silu(gu[:, :I]) * gu[:, I:]   (was silu + mul)

The `*_reference` functions are the plain-PyTorch paths (what RMSNorm, GatedMLP and
DecoderLayer run on CPU); the kernels round where they round, so on CUDA the results are
bit-equal except where a sum of squares is reduced in another order (the norms: rstd may
differ in its last fp32 bit, which flips a bf16 rounding now and then):
  * statistics in fp32; for bf16 / fp16 the normalised value is rounded to the input
    dtype before the weight multiply, and the product rounded again (HF's RMSNorm);
  * rotary: a = round(x * cos), out = round(fma(roll(x, D/2), sin_signed, a)), as torch's
    mul and addcmul (CUDA addcmul with value=1 is an explicit fma in fp32);
  * silu: x / (1 + expf(-x)) with libdevice's expf and IEEE division, as torch's CUDA silu,
    rounded, then times `up` and rounded again.

Every kernel launches a grid fixed by the shapes, reads no value back on the host and
allocates outputs only from shapes, so all of them are CUDA-graph capturable. T = 0 returns
empty outputs without a launch.

Sizes: one program per row for the norm, looping over the row in NORM_BLOCK chunks twice
(sum of squares, then normalise): hidden sizes up to 8192 take one or two chunks, the second
pass re-reads the row from L1/L2 (16 KiB for an 8192-wide bf16 row), and any H works. silu_mul is a
2-D grid (row, column block) so any I (30000 included) spreads over many programs, also at T=1.

Not fused here: residual add + norm (`add_rms_norm`). The decoder adds residuals inside the
GEMM (`Linear.add_to` = addmm), which torch runs as copy(residual -> out) + GEMM with beta=1.
A GEMM into a fresh buffer + fused add_rms_norm is also two kernels (and it rounds x @ W to
bf16 before the add, so it changes numerics); the copy is removed bit-exactly by accumulating
into the residual in place (`residual.addmm_(x, W.t())`, the residual being dead after it),
which belongs in kvtier/layers/linear.py. So add+norm would save nothing over that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.kernels import cpu_ops, pdl
from kvtier.layers.rotary import apply_rotary

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from kvtier.kernels.pdl import wait_before_reads
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: callers take the reference paths
    HAVE_TRITON = False

# Row chunk of the norm kernel: a whole 4096-wide hidden row in one chunk (16 fp32 per thread
# at 8 warps); wider rows loop.
NORM_BLOCK = 4096
# Columns per silu_mul program: large enough to stream, small enough that I=12288 at T=1
# still spreads over 12 SMs.
SILU_BLOCK = 1024
# Elements per warp that keep ~4-16 values in registers per thread.
ELEMS_PER_WARP = 256
# Warps per program at most: a row program's cross-warp reduction grows with more.
MAX_WARPS = 8
# torch rounds x*x, the mean and (mean + eps) as separate ops: no contraction into FMAs (the
# rotary fma is written explicitly, as torch's addcmul does). Also Triton 3.10's default.
FP_FUSION = False

_enabled = True  # flipped only by `disabled()`


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, `use_kernels` is False: the plain-PyTorch paths run on CUDA too (A/B tests)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def use_kernels(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused kernels serve these tensors (None entries are ignored): Triton importable,
    not switched off, all on CUDA, one dtype, last dim contiguous. Anything else (CPU above all)
    takes the reference path, so CPU results never change."""
    ts = [t for t in tensors if t is not None]
    return (HAVE_TRITON and _enabled and bool(ts) and all(t.is_cuda for t in ts)
            and len({t.dtype for t in ts}) == 1 and all(t.stride(-1) == 1 for t in ts))


# ---------------------------------------------------------------- plain-PyTorch references

def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H]; HF's RMSNorm: fp32 statistics, and for bf16 / fp16
    the normalised value cast back to x.dtype before the weight multiply."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def qk_norm_rope_reference(qkv: torch.Tensor, hq: int, hkv: int, d: int, cos: torch.Tensor,
                           sin_signed: torch.Tensor, q_weight: torch.Tensor | None,
                           k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv: [T, (hq + 2 hkv) * d]; cos/sin_signed: [T, 1, d] -> q [T, hq, d], k [T, hkv, d].

    Per-head RMSNorm (Qwen3; q_weight/k_weight [d], both or neither) then rotary. Without
    the norm, q and k heads are adjacent and rotate in one pass (q, k are then views).
    """
    _check_qk_weights(q_weight, k_weight)
    t = qkv.shape[0]
    if q_weight is None or k_weight is None:
        qk = apply_rotary(qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d), cos, sin_signed)
        return qk[:, :hq], qk[:, hq:]
    q = apply_rotary(rms_norm_reference(qkv[:, :hq * d].view(t, hq, d), q_weight, eps), cos, sin_signed)
    k = apply_rotary(rms_norm_reference(qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d), k_weight, eps),
                     cos, sin_signed)
    return q, k


def silu_mul_reference(gu: torch.Tensor) -> torch.Tensor:
    """gu: [T, 2I] -> silu(gu[:, :I]) * gu[:, I:] : [T, I], rounded in gu.dtype after each op."""
    inter = gu.shape[-1] // 2
    return F.silu(gu[:, :inter]).mul_(gu[:, inter:])


# ---------------------------------------------------------------- dispatch (what model code calls)

def apply_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm, cast to out_dtype if given: the Triton kernel on CUDA, the C++ kernel for the CPU's
    fp32 residual rows (kernels/cpu_ops.py, casting as it writes), else the reference."""
    if x.dtype == torch.float32 == weight.dtype and x.dim() == 2 and x.stride(-1) == 1 \
            and (ops := cpu_ops.usable(x)) is not None:
        return ops.rms_norm(x, weight, eps, out_dtype or x.dtype)
    y = rms_norm(x, weight, eps) if use_kernels(x, weight) else rms_norm_reference(x, weight, eps)
    return y if out_dtype is None else y.to(out_dtype)


def apply_qk_norm_rope(qkv: torch.Tensor, hq: int, hkv: int, d: int, cos: torch.Tensor, sin_signed: torch.Tensor,
                       q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope: the Triton kernel on CUDA; on CPU the C++ kernel, in place on qkv (which must
    be the caller's own buffer), q and k returned as views of it; else the reference."""
    if qkv.stride(-1) == 1 and cos.dtype == qkv.dtype and (ops := cpu_ops.usable(qkv)) is not None:
        ops.rope_(qkv, cos, sin_signed, hq, hkv, d, q_weight, k_weight, eps)
        t = qkv.shape[0]
        return qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    rope = qk_norm_rope if use_kernels(qkv, cos, sin_signed, q_weight, k_weight) else qk_norm_rope_reference
    return rope(qkv, hq, hkv, d, cos, sin_signed, q_weight, k_weight, eps)


def apply_silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu_mul: the Triton kernel on CUDA, the C++ kernel on CPU, else the reference."""
    if use_kernels(gu):
        return silu_mul(gu)
    if gu.dim() == 2 and gu.stride(-1) == 1 and (ops := cpu_ops.usable(gu)) is not None:
        return ops.silu_mul(gu)
    return silu_mul_reference(gu)


def _check_qk_weights(q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    if (q_weight is None) != (k_weight is None):
        raise ValueError("qk_norm_rope: pass both q_weight and k_weight, or neither")


# ---------------------------------------------------------------- Triton kernels

if HAVE_TRITON:
    @triton.jit
    def round_as(x, DTYPE: tl.constexpr):
        """fp32 x rounded to DTYPE and widened back: where torch stores an intermediate in DTYPE."""
        return x.to(DTYPE).to(tl.float32)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_row_stride, eps, inv_h,
                         H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program t: y[t] = round(w * round(x[t] * rstd)), rstd = rsqrt(sum(x^2) / H + eps)."""
        wait_before_reads(PDL)  # kernels/pdl.py
        dtype = y_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_row_stride
        y_row = y_ptr + row * H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < H, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) * inv_h + eps)
        for start in range(0, H, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, (w * round_as(x * rstd, dtype)).to(dtype), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr,
                             qkv_row_stride, cos_row_stride, sin_row_stride, eps, inv_d,
                             HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                             HAS_NORM: tl.constexpr):
        """Program (t, h): head h of token t (h < HQ: q head h, else k head h - HQ).

        With x the head's D values and p = roll(x, D/2) (the partner of each element):
        x, p <- round(w * round(x * rstd)) (HAS_NORM); out = round(fma(p, sin, round(x * cos))).
        """
        dtype = q_ptr.dtype.element_ty
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK_D)
        mask = offs < D
        partner = tl.where(offs < D // 2, offs + D // 2, offs - D // 2)  # roll(x, D/2)[i] = x[partner[i]]
        head = qkv_ptr + t * qkv_row_stride + h * D
        x = tl.load(head + offs, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(head + partner, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) * inv_d + eps)
            if h < HQ:
                w = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                wp = tl.load(qw_ptr + partner, mask=mask, other=0.0).to(tl.float32)
            else:
                w = tl.load(kw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                wp = tl.load(kw_ptr + partner, mask=mask, other=0.0).to(tl.float32)
            x = round_as(w * round_as(x * rstd, dtype), dtype)
            p = round_as(wp * round_as(p * rstd, dtype), dtype)
        c = tl.load(cos_ptr + t * cos_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * sin_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        out = tl.fma(p, s, round_as(x * c, dtype)).to(dtype)
        if h < HQ:
            tl.store(q_ptr + (t * HQ + h) * D + offs, out, mask=mask)
        else:
            tl.store(k_ptr + (t * HKV + (h - HQ)) * D + offs, out, mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, gu_row_stride, inter, BLOCK: tl.constexpr,
                         EXACT_MATH: tl.constexpr, PDL: tl.constexpr = False):
        """Program (t, b): columns [b * BLOCK, (b + 1) * BLOCK) of row t.

        EXACT_MATH: libdevice's expf (torch's CUDA silu calls expf) instead of Triton's
        ex2.approx-based exp; the interpreter has no libdevice and uses numpy's exp.
        """
        wait_before_reads(PDL)  # kernels/pdl.py
        dtype = out_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        g = tl.load(gu_ptr + row * gu_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * gu_row_stride + inter + offs, mask=mask, other=0.0).to(tl.float32)
        if EXACT_MATH:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        act = round_as(tl.math.div_rn(g, 1.0 + e), dtype) * u
        tl.store(out_ptr + row * inter + offs, act.to(dtype), mask=mask)


def _interpreting() -> bool:
    """Whether the kernels were decorated under TRITON_INTERPRET=1 (decided at import, as Triton does)."""
    return type(_silu_mul_kernel).__name__ == "InterpretedFunction"


def _warps(block: int) -> int:
    return max(1, min(MAX_WARPS, block // ELEMS_PER_WARP))


# ---------------------------------------------------------------- launchers

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm. x: [..., H] (rows may be strided, last dim contiguous), weight: [H] of
    x.dtype -> y: [..., H] contiguous, x.dtype; same rounding as `rms_norm_reference`."""
    h = x.shape[-1]
    if x.stride(-1) != 1 or weight.shape != (h,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (last dim contiguous) needs a [{h}] weight of "
                         f"{x.dtype}, got {tuple(weight.shape)} {weight.dtype}")
    rows = x.reshape(-1, h)  # [T, H]; a view for 2-D x
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0] == 0:
        return y
    block = min(triton.next_power_of_2(h), NORM_BLOCK)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight.contiguous(), y, rows.stride(0), eps, 1.0 / h,
                                       H=h, BLOCK=block, num_warps=_warps(block), enable_fp_fusion=FP_FUSION,
                                       **pdl.launch_args(x.device))
    return y


@dataclass(frozen=True)
class QKRope:
    """A layer's per-head q / k RMSNorm (Qwen3; weights None elsewhere) and rotary for one step's
    qkv rows: what `qk_norm_rope` applies, and what a KV store fusing the rotary with its write
    (kernels/kv_transform.py rope_store) is handed."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    cos: torch.Tensor  # [T, 1, D] (RotaryEmbedding)
    sin_signed: torch.Tensor  # [T, 1, D]
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float

    def check(self, qkv: torch.Tensor) -> None:
        """ValueError unless qkv is [T, (Hq + 2 Hkv) * D] (last dim contiguous, even D) with cos /
        sin_signed [T, 1, D] and both norm weights or neither."""
        _check_qk_weights(self.q_weight, self.k_weight)
        t, hq, hkv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * d or d % 2 or qkv.stride(-1) != 1:
            raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)} is not [T, ({hq} + 2 * {hkv}) * {d}] "
                             "with even head_dim and a contiguous last dim")
        for name, tab in (("cos", self.cos), ("sin_signed", self.sin_signed)):
            if tab.shape[0] != t or tab.shape[-1] != d or tab.stride(-1) != 1 or tab.numel() != t * d:
                raise ValueError(f"qk_norm_rope: {name} {tuple(tab.shape)} is not [{t}, 1, {d}]")

    def apply(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv -> q [T, Hq, D], k [T, Hkv, D] (apply_qk_norm_rope: may rotate qkv in place on CPU)."""
        return apply_qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.cos,
                                  self.sin_signed, self.q_weight, self.k_weight, self.eps)


def qk_norm_rope(qkv: torch.Tensor, hq: int, hkv: int, d: int, cos: torch.Tensor, sin_signed: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-head RMSNorm (if weights are given) + rotary in one launch.

    qkv: [T, (hq + 2 hkv) * d] (rows may be strided); cos/sin_signed: [T, 1, d] (RotaryEmbedding);
    q_weight/k_weight: [d] or both None -> q [T, hq, d], k [T, hkv, d], new contiguous tensors.
    v stays in qkv (the caller slices it).
    """
    QKRope(hq, hkv, d, cos, sin_signed, q_weight, k_weight, eps).check(qkv)
    t = qkv.shape[0]
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, hkv, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q, k
    has_norm = q_weight is not None
    qw = q_weight.contiguous() if q_weight is not None else q  # unread without the norm
    kw = k_weight.contiguous() if k_weight is not None else k
    block_d = triton.next_power_of_2(d)
    _qk_norm_rope_kernel[(t, hq + hkv)](
        qkv, cos, sin_signed, qw, kw, q, k, qkv.stride(0), cos.stride(0), sin_signed.stride(0), eps, 1.0 / d,
        HQ=hq, HKV=hkv, D=d, BLOCK_D=block_d, HAS_NORM=has_norm, num_warps=_warps(block_d),
        enable_fp_fusion=FP_FUSION)
    return q, k


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """Triton SwiGLU activation. gu: [T, 2I] (rows may be strided) -> silu(gu[:, :I]) * gu[:, I:]:
    [T, I] contiguous, gu.dtype; same rounding as `silu_mul_reference`."""
    if gu.dim() != 2 or gu.shape[1] % 2 or gu.stride(-1) != 1:
        raise ValueError(f"silu_mul: gu {tuple(gu.shape)} is not [T, 2I] with a contiguous last dim")
    t, inter = gu.shape[0], gu.shape[1] // 2
    out = torch.empty((t, inter), dtype=gu.dtype, device=gu.device)
    if t == 0 or inter == 0:
        return out
    _silu_mul_kernel[(t, triton.cdiv(inter, SILU_BLOCK))](gu, out, gu.stride(0), inter, BLOCK=SILU_BLOCK,
                                                          EXACT_MATH=not _interpreting(),
                                                          num_warps=_warps(SILU_BLOCK), enable_fp_fusion=FP_FUSION,
                                                          **pdl.launch_args(gu.device))
    return out
