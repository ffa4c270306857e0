"""Triton kernels: the transforms of the quantized KV formats, fused with the store.

A quantized pool (kv/pool.py) stores K as R ((k - shift) / channel_scale) and V as R v
(R: formats.hadamard, K smoothing: PagePool.calibrate), encoded by the format's codecs;
attention runs in that domain with q as R (channel_scale * q) and maps its output back
with R. Done op by op that is ~7 small kernels a layer; here it is:

    transform_store   new K and V rows -> smooth + rotate + encode + scatter, ONE launch
                      (grid axis 2: 0 = K, 1 = V; each with its own codec)
    transform_rows    q -> R (channel_scale * q) (native_q), or o -> R o (native_out)

Two shapes of program, chosen by the row count (shapes only, so CUDA graphs capture one):
T <= ROW_MAX_T (decode) one row per program, else TILE_T rows. Either way the rotation is the
fast Walsh-Hadamard transform in registers (kernels/hadamard.py: R = H / sqrt(D), Sylvester's
signs, no matrix read), then times 1 / sqrt(D).

The kernels follow the reference's math (fp32, IEEE division for the smoothing and the codes'
scales, formats.round_half_up) up to the rotation's last-bit rounding, so a value on a
rounding edge may take the neighbouring code (tests/kv/kernel_cases.py check_fused_store).
"""

from __future__ import annotations

import torch

from kvtier.kernels import pdl
from kvtier.kernels.fused import FP_FUSION, QKRope
from kvtier.kv.formats import (FP8_E4M3_MAX, INT4_BIAS, INT4_MAX, INT8_MAX, MIN_SCALE, Codec, Fp8Codec,
                               Int4Codec, Int8Codec, KVFormat, PlainCodec, inv_sqrt_f32)

try:
    import triton
    import triton.language as tl

    from kvtier.kernels.fused import round_as
    from kvtier.kernels.hadamard import fwht
    from kvtier.kernels.pdl import wait_before_reads
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the pool's reference path is used
    HAVE_TRITON = False

# Rows at most that take the one-row-per-program kernels (a decode step brings one a sequence).
ROW_MAX_T = 16
# Rows per program of the tiled kernels: tl.dot needs >= 16.
TILE_T = 16
# Warps of a one-row program and of a TILE_T-row one.
ROW_WARPS = 4
TILE_WARPS = 4
# Codec modes (tl.constexpr values in the kernels).
_MODE = {PlainCodec: 0, Int8Codec: 1, Fp8Codec: 2, Int4Codec: 3}
_QMAX = {PlainCodec: 1.0, Int8Codec: float(INT8_MAX), Fp8Codec: FP8_E4M3_MAX, Int4Codec: float(INT4_MAX)}

if HAVE_TRITON:
    SMOOTH_NONE = tl.constexpr(0)
    SMOOTH_K = tl.constexpr(1)  # (x - shift[h]) / channel_scale[h]: K as the pool stores it
    SMOOTH_Q = tl.constexpr(2)  # x * channel_scale[h // G]: q in the stored K domain
    MODE_PLAIN = tl.constexpr(0)
    MODE_INT8 = tl.constexpr(1)
    MODE_FP8 = tl.constexpr(2)
    MODE_INT4 = tl.constexpr(3)

    @triton.jit
    def _smooth(x, kk, ph, shift_ptr, cs_ptr, D: tl.constexpr, SMOOTH: tl.constexpr):
        """Columns kk of rows x: (x - shift) / channel_scale (K) or x * channel_scale (q)."""
        if SMOOTH == SMOOTH_K:
            sh = tl.load(shift_ptr + ph * D + kk).to(tl.float32)
            cs = tl.load(cs_ptr + ph * D + kk).to(tl.float32)
            x = tl.math.div_rn(x - sh[None, :], cs[None, :])
        elif SMOOTH == SMOOTH_Q:
            cs = tl.load(cs_ptr + ph * D + kk).to(tl.float32)
            x = x * cs[None, :]
        return x

    @triton.jit
    def _head_rstd(head, t, tm, stride_t, eps, inv_d, D: tl.constexpr):
        """1 / rms of rows t of one head (head + t * stride_t + d) -> [BLOCK_T, 1] fp32, as
        kernels/fused.py's qk_norm_rope computes it."""
        d = tl.arange(0, D)
        x = tl.load(head + t[:, None] * stride_t + d[None, :], mask=tm, other=0.0).to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, axis=1) * inv_d + eps)[:, None]

    @triton.jit
    def _rope_cols(head, t, tm, stride_t, kk, rstd, w_ptr, cos_ptr, sin_ptr, stride_c, stride_s,
                   D: tl.constexpr, HAS_NORM: tl.constexpr, DTYPE: tl.constexpr):
        """Columns kk of rows t of one head after the per-head RMSNorm (HAS_NORM: rstd [BLOCK_T, 1]
        from _head_rstd, weights w_ptr) and rotary (cos / sin rows t), fp32 rounded to DTYPE where
        kernels/fused.py's qk_norm_rope rounds (so the rows stored are those the unfused path
        stores): x, p = round(w * round(x * rstd)); out = round(fma(p, sin, round(x * cos)))."""
        pk = tl.where(kk < D // 2, kk + D // 2, kk - D // 2)  # roll(x, D/2)[i] = x[pk[i]]
        rows = head + t[:, None] * stride_t
        x = tl.load(rows + kk[None, :], mask=tm, other=0.0).to(tl.float32)
        p = tl.load(rows + pk[None, :], mask=tm, other=0.0).to(tl.float32)
        if HAS_NORM:
            w = tl.load(w_ptr + kk).to(tl.float32)[None, :]
            wp = tl.load(w_ptr + pk).to(tl.float32)[None, :]
            x = round_as(w * round_as(x * rstd, DTYPE), DTYPE)
            p = round_as(wp * round_as(p * rstd, DTYPE), DTYPE)
        c = tl.load(cos_ptr + t[:, None] * stride_c + kk[None, :], mask=tm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t[:, None] * stride_s + kk[None, :], mask=tm, other=0.0).to(tl.float32)
        return round_as(tl.fma(p, s, round_as(x * c, DTYPE)), DTYPE)

    @triton.jit
    def _rotated(x, BLOCK_T: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr):
        """Rows x [BLOCK_T, D] fp32 -> x R (ROTATE; R = H / sqrt(D)) or x."""
        if ROTATE:
            return fwht(x, BLOCK_T, D) * INV_SQRT_D
        return x

    @triton.jit
    def _transformed(x_ptr, t, tm, stride_xt, x_off, ph, shift_ptr, cs_ptr, D: tl.constexpr,
                     BLOCK_T: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr,
                     INV_SQRT_D: tl.constexpr):
        """Rows t [BLOCK_T] of one head (x_ptr + t * stride_xt + x_off + d) -> smoothed (param
        row ph) and rotated rows [BLOCK_T, D] fp32."""
        d = tl.arange(0, D)
        x = tl.load(x_ptr + t[:, None] * stride_xt + x_off + d[None, :], mask=tm, other=0.0).to(tl.float32)
        return _rotated(_smooth(x, d, ph, shift_ptr, cs_ptr, D, SMOOTH), BLOCK_T, D, ROTATE, INV_SQRT_D)

    @triton.jit(do_not_specialize=["T", "H", "G"])
    def _transform_rows_kernel(x_ptr, out_ptr, cs_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                               T, H, G, D: tl.constexpr, BLOCK_T: tl.constexpr, SMOOTH: tl.constexpr,
                               ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr):
        """BLOCK_T rows of head h: out = R (x * channel_scale[h // G]) (or R x), in out's dtype."""
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = (t < T)[:, None]
        y = _transformed(x_ptr, t, tm, stride_xt, h * stride_xh, h // G, cs_ptr, cs_ptr, D, BLOCK_T, SMOOTH,
                         ROTATE, INV_SQRT_D)
        d = tl.arange(0, D)[None, :]
        tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d, y.to(out_ptr.dtype.element_ty), mask=tm)

    @triton.jit
    def _encode_rows(x, row, tmask, data_ptr, scale_ptr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                     MODE: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr, BIAS: tl.constexpr,
                     MIN_S: tl.constexpr):
        """Rows x [BLOCK_T, D] fp32 -> codes (+ fp16 scales) at page rows `row` [BLOCK_T]: the codecs
        of kv/formats.py (fp16 scale of amax / QMAX, IEEE division, floor(y + 0.5))."""
        tm = tmask[:, None]
        d = tl.arange(0, D)
        if MODE == MODE_INT4:
            NG: tl.constexpr = D // GROUP
            x3 = tl.reshape(x, (BLOCK_T, NG, GROUP))
            amax = tl.max(tl.abs(x3), axis=2)  # [BLOCK_T, NG]
            s = tl.maximum(amax / QMAX, MIN_S).to(tl.float16)
            y = tl.math.div_rn(x3, s.to(tl.float32)[:, :, None])
            q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX), QMAX) + BIAS
            lo, hi = tl.split(tl.reshape(q, (BLOCK_T, D // 2, 2)))
            byte = lo.to(tl.uint8) | (hi.to(tl.uint8) << 4)
            w = tl.arange(0, D // 2)
            tl.store(data_ptr + row[:, None] * (D // 2) + w[None, :], byte, mask=tm)
            tl.store(scale_ptr + row[:, None] * NG + tl.arange(0, NG)[None, :], s, mask=tm)
        elif MODE == MODE_PLAIN:
            tl.store(data_ptr + row[:, None] * D + d[None, :], x.to(data_ptr.dtype.element_ty), mask=tm)
        else:
            amax = tl.max(tl.abs(x), axis=1)
            s = tl.maximum(amax / QMAX, MIN_S).to(tl.float16)
            y = tl.math.div_rn(x, s.to(tl.float32)[:, None])
            if MODE == MODE_FP8:
                y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
                q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            else:
                q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX), QMAX).to(tl.int8)
            tl.store(data_ptr + row[:, None] * D + d[None, :], q, mask=tm)
            tl.store(scale_ptr + row, s, mask=tmask)

    @triton.jit(do_not_specialize=["T", "H"])
    def _transform_store_kernel(k_ptr, v_ptr, slot_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, shift_ptr, cs_ptr,
                                stride_kt, stride_kh, stride_vt, stride_vh, T, H, S,
                                D: tl.constexpr, BLOCK_T: tl.constexpr, INV_SQRT_D: tl.constexpr,
                                K_MODE: tl.constexpr, K_GROUP: tl.constexpr, K_QMAX: tl.constexpr,
                                K_SMOOTH: tl.constexpr, K_ROTATE: tl.constexpr, V_MODE: tl.constexpr,
                                V_GROUP: tl.constexpr, V_QMAX: tl.constexpr, V_ROTATE: tl.constexpr,
                                BIAS: tl.constexpr, MIN_S: tl.constexpr):
        """BLOCK_T new rows of head h, K (program_id(2) == 0) or V (1): transform, encode, scatter."""
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
        row = ((slot // S) * H + h) * S + slot % S  # [BLOCK_T]
        if tl.program_id(2) == 0:
            x = _transformed(k_ptr, t, tmask[:, None], stride_kt, h * stride_kh, h, shift_ptr, cs_ptr, D, BLOCK_T,
                             K_SMOOTH, K_ROTATE, INV_SQRT_D)
            _encode_rows(x, row, tmask, kd_ptr, ks_ptr, D, BLOCK_T, K_MODE, K_GROUP, K_QMAX, BIAS, MIN_S)
        else:
            x = _transformed(v_ptr, t, tmask[:, None], stride_vt, h * stride_vh, h, shift_ptr, cs_ptr, D, BLOCK_T,
                             SMOOTH_NONE, V_ROTATE, INV_SQRT_D)
            _encode_rows(x, row, tmask, vd_ptr, vs_ptr, D, BLOCK_T, V_MODE, V_GROUP, V_QMAX, BIAS, MIN_S)


    @triton.jit(do_not_specialize=["T"])
    def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, k_ptr, slot_ptr, kd_ptr, ks_ptr,
                           vd_ptr, vs_ptr, shift_ptr, cs_ptr, stride_x, stride_c, stride_s, eps, inv_d,
                           T, S, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                           INV_SQRT_D: tl.constexpr, HAS_NORM: tl.constexpr, K_MODE: tl.constexpr,
                           K_GROUP: tl.constexpr, K_QMAX: tl.constexpr, K_SMOOTH: tl.constexpr,
                           K_ROTATE: tl.constexpr, V_MODE: tl.constexpr, V_GROUP: tl.constexpr,
                           V_QMAX: tl.constexpr, V_ROTATE: tl.constexpr, BIAS: tl.constexpr, MIN_S: tl.constexpr,
                           PDL: tl.constexpr = False):
        """BLOCK_T rows of head h of qkv [T, (HQ + 2 HKV) * D]: h < HQ a q head (norm + rotary -> q);
        h < HQ + HKV a k head (norm + rotary -> k, and smoothed, rotated, encoded into the pages);
        else a v head (rotated, encoded into the pages). PDL: kernels/pdl.py."""
        wait_before_reads(PDL)
        dtype = q_ptr.dtype.element_ty
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        tm = tmask[:, None]
        t = t.to(tl.int64)
        d = tl.arange(0, D)
        head = qkv_ptr + h * D
        rstd = tl.full([BLOCK_T, 1], 1.0, tl.float32)
        if h < HQ:
            if HAS_NORM:
                rstd = _head_rstd(head, t, tm, stride_x, eps, inv_d, D)
            x = _rope_cols(head, t, tm, stride_x, d, rstd, qw_ptr, cos_ptr, sin_ptr, stride_c, stride_s, D,
                           HAS_NORM, dtype)
            tl.store(q_ptr + (t[:, None] * HQ + h) * D + d[None, :], x.to(dtype), mask=tm)
        elif h < HQ + HKV:
            if HAS_NORM:
                rstd = _head_rstd(head, t, tm, stride_x, eps, inv_d, D)
            x = _rope_cols(head, t, tm, stride_x, d, rstd, kw_ptr, cos_ptr, sin_ptr, stride_c, stride_s, D,
                           HAS_NORM, dtype)
            hk = h - HQ
            tl.store(k_ptr + (t[:, None] * HKV + hk) * D + d[None, :], x.to(dtype), mask=tm)
            slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
            row = ((slot // S) * HKV + hk) * S + slot % S
            y = _rotated(_smooth(x, d, hk, shift_ptr, cs_ptr, D, K_SMOOTH), BLOCK_T, D, K_ROTATE, INV_SQRT_D)
            _encode_rows(y, row, tmask, kd_ptr, ks_ptr, D, BLOCK_T, K_MODE, K_GROUP, K_QMAX, BIAS, MIN_S)
        else:
            hv = h - HQ - HKV
            slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
            row = ((slot // S) * HKV + hv) * S + slot % S
            y = _transformed(head, t, tm, stride_x, 0, hv, shift_ptr, cs_ptr, D, BLOCK_T, SMOOTH_NONE, V_ROTATE,
                             INV_SQRT_D)
            _encode_rows(y, row, tmask, vd_ptr, vs_ptr, D, BLOCK_T, V_MODE, V_GROUP, V_QMAX, BIAS, MIN_S)


def transform_supported(x: torch.Tensor) -> bool:
    """Whether the kernels take rows x [T, H, D] (`head_dim_supported(D)`)."""
    return head_dim_supported(x.shape[-1])


def head_dim_supported(d: int) -> bool:
    """Triton and a power-of-two head dim >= 16 (where formats.hadamard is one Sylvester block,
    which kernels/hadamard.py's transform applies)."""
    return HAVE_TRITON and d >= 16 and d & (d - 1) == 0


def _shape_args(t: int, d: int) -> tuple[int, dict]:
    """(row blocks, constexprs) for t rows: one row a program up to ROW_MAX_T, else tiles."""
    block = 1 if t <= ROW_MAX_T else TILE_T
    return triton.cdiv(t, block), dict(D=d, BLOCK_T=block, INV_SQRT_D=inv_sqrt_f32(d),
                                       num_warps=ROW_WARPS if block == 1 else TILE_WARPS)


def transform_rows(x: torch.Tensor, rotate: bool, channel_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D] -> R (x * channel_scale[h // G]) (PagePool.native_q) or R x (native_out) in
    one launch. channel_scale: [Hkv, D] with H = G * Hkv, or None; R: formats.hadamard(D), applied
    as kernels/hadamard.py's transform. out: a [T, H, D] tensor (unit steps along D) written
    instead of a new one; x itself is allowed (each program reads its rows whole before writing
    them)."""
    t, h, d = x.shape
    if out is None:
        out = torch.empty((t, h, d), dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"transform_rows: out must be {tuple(x.shape)} with unit steps along D")
    if t == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    g = h // channel_scale.shape[0] if channel_scale is not None else 1
    blocks, args = _shape_args(t, d)
    _transform_rows_kernel[(blocks, h)](x, out, channel_scale if channel_scale is not None else x,
                                        x.stride(0), x.stride(1), out.stride(0), out.stride(1), t, h, g,
                                        SMOOTH=SMOOTH_Q if channel_scale is not None else SMOOTH_NONE,
                                        ROTATE=rotate, **args)
    return out


def _codec_args(prefix: str, codec: Codec, d: int) -> dict[str, object]:
    if type(codec) not in _MODE:
        raise ValueError(f"no fused store for codec {type(codec).__name__}")
    group = codec.group_for(d) if isinstance(codec, Int4Codec) else 1
    return {f"{prefix}_MODE": _MODE[type(codec)], f"{prefix}_GROUP": group, f"{prefix}_QMAX": _QMAX[type(codec)]}


def transform_store(fmt: KVFormat, st: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, smooth: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """New rows k, v [T, H, D] into one pool layer `st` at slots [T], in one launch: K as
    R ((k - shift) / channel_scale) (smooth = (shift, channel_scale), each [H, D]; None: k),
    V as R v (each rotated where the format says so), encoded by the format's codecs."""
    t, h, d = k.shape
    if t == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    blocks, args = _shape_args(t, d)
    shift, cs = smooth if smooth is not None else (k, k)  # unread without smoothing
    _transform_store_kernel[(blocks, h, 2)](
        k, v, slots, st["k"], st.get("k_scale", st["k"]), st["v"], st.get("v_scale", st["v"]), shift, cs,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), t, h, st["k"].shape[2],
        K_SMOOTH=SMOOTH_K if smooth is not None else SMOOTH_NONE, K_ROTATE=fmt.rotate_k, V_ROTATE=fmt.rotate_v,
        BIAS=float(INT4_BIAS), MIN_S=MIN_SCALE, **_codec_args("K", fmt.k_codec, d),
        **_codec_args("V", fmt.v_codec, d), **args)


def rope_store(fmt: KVFormat, st: dict[str, torch.Tensor], slots: torch.Tensor, qkv: torch.Tensor, rope: QKRope,
               smooth: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A step's qkv rows [T, (Hq + 2 Hkv) * D] -> q, k (after the per-head norm and rotary, as
    `fused.qk_norm_rope` gives them) and v (a view of qkv), with k and v also stored into one pool
    layer `st` at slots [T] as `transform_store` stores them: one launch where the unfused path
    takes two (plain formats: three)."""
    t, hq, hkv, d = qkv.shape[0], rope.num_heads, rope.num_kv_heads, rope.head_dim
    rope.check(qkv)
    q = torch.empty((t, hq, d), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, hkv, d), dtype=qkv.dtype, device=qkv.device)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    if t == 0:
        return q, k, v
    blocks, args = _shape_args(t, d)
    shift, cs = smooth if smooth is not None else (qkv, qkv)  # unread without smoothing
    has_norm = rope.q_weight is not None
    qw = rope.q_weight.contiguous() if has_norm else q  # unread without the norm
    kw = rope.k_weight.contiguous() if has_norm else k
    _rope_store_kernel[(blocks, hq + 2 * hkv)](
        qkv, rope.cos, rope.sin_signed, qw, kw, q, k, slots, st["k"], st.get("k_scale", st["k"]), st["v"],
        st.get("v_scale", st["v"]), shift, cs, qkv.stride(0), rope.cos.stride(0), rope.sin_signed.stride(0),
        rope.eps, 1.0 / d, t, st["k"].shape[2], HQ=hq, HKV=hkv, HAS_NORM=has_norm,
        K_SMOOTH=SMOOTH_K if smooth is not None else SMOOTH_NONE, K_ROTATE=fmt.rotate_k, V_ROTATE=fmt.rotate_v,
        BIAS=float(INT4_BIAS), MIN_S=MIN_SCALE, **_codec_args("K", fmt.k_codec, d),
        **_codec_args("V", fmt.v_codec, d), enable_fp_fusion=FP_FUSION, **args, **pdl.launch_args(qkv.device))
    return q, k, v
