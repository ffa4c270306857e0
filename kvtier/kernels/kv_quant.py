"""Triton kernels: quantize-and-scatter new K/V rows into pages, gather-and-dequantize pages.

The plain-PyTorch reference is the codecs of kvtier/kv/formats.py (Int8Codec,
Fp8Codec, Int4Codec, used through KVFormat.store/load on CPU); these kernels
produce the same codes and scales (same fp16 scale rounding, same
floor(x + 0.5) rounding). tests/kv/test_kv_kernels.py checks them against the
reference under TRITON_INTERPRET=1; tests/gpu/test_kv_kernels.py on CUDA.

Layouts (contiguous, one layer of a pool):
    data  [num_pages, H, S, W]   W = D (int8 / fp8 bytes) or D // 2 (int4, two codes a byte)
    scale [num_pages, H, S, NS]  NS = 1 (per token-head) or D // group (int4), fp16
"""

from __future__ import annotations

import torch

from kvtier.kv.formats import (FP8_E4M3_MAX, INT4_BIAS, INT4_MAX, INT8_MAX, MIN_SCALE, Codec, Fp8Codec,
                               Int4Codec, Int8Codec, KVFormat, PlainCodec)

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the reference path is used
    HAVE_TRITON = False


if HAVE_TRITON:
    @triton.jit
    def _row_store_kernel(x_ptr, slot_ptr, data_ptr, scale_ptr, stride_xt, stride_xh, H, S,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr,
                          MIN_S: tl.constexpr, IS_FP8: tl.constexpr):
        """One (token, head) row: int8 / fp8 codes with one fp16 scale."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t)
        row = ((slot // S) * H + h) * S + slot % S
        d = tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        s = tl.maximum(amax / QMAX, MIN_S).to(tl.float16)
        y = tl.math.div_rn(x, s.to(tl.float32))  # IEEE division, as torch does
        if IS_FP8:
            y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
            q = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX), QMAX).to(tl.int8)
        tl.store(data_ptr + row * D + d, q, mask=m)
        tl.store(scale_ptr + row, s)

    @triton.jit
    def _plain_store_kernel(x_ptr, slot_ptr, data_ptr, stride_xt, stride_xh, H, S,
                            D: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (token, head) row copied as is (plain formats), cast to the page dtype."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        row = ((slot // S) * H + h) * S + slot % S
        d = tl.arange(0, BLOCK_D)
        m = d < D
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=m)
        tl.store(data_ptr + row * D + d, x.to(data_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _row_load_kernel(data_ptr, scale_ptr, pid_ptr, out_ptr, H, S,
                         D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         IS_FP8: tl.constexpr):
        """One (selected page, head): [S, D] codes * scales -> out dtype."""
        p = tl.program_id(0)
        h = tl.program_id(1)
        page = tl.load(pid_ptr + p)
        s = tl.arange(0, BLOCK_S)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        m = (s < S) & (d < D)
        src = (page * H + h) * S + s
        q = tl.load(data_ptr + src * D + d, mask=m, other=0)
        if IS_FP8:
            y = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            y = q.to(tl.float32)
        sc = tl.load(scale_ptr + src, mask=s < S, other=0.0).to(tl.float32)
        dst = (p * H + h) * S + s
        tl.store(out_ptr + dst * D + d, y * sc, mask=m)

    @triton.jit
    def _int4_store_kernel(x_ptr, slot_ptr, data_ptr, scale_ptr, stride_xt, stride_xh, H, S,
                           D: tl.constexpr, G: tl.constexpr, NG_P: tl.constexpr, QMAX: tl.constexpr,
                           BIAS: tl.constexpr, MIN_S: tl.constexpr):
        """One (token, head) row: groups of G values -> fp16 scale + packed nibbles."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t)
        row = ((slot // S) * H + h) * S + slot % S
        gi = tl.arange(0, NG_P)
        pair = gi[:, None] * (G // 2) + tl.arange(0, G // 2)[None, :]  # [NG_P, G/2] byte index
        m = (gi[:, None] < D // G) & (pair < D // 2)
        xrow = x_ptr + t * stride_xt + h * stride_xh
        xe = tl.load(xrow + 2 * pair, mask=m, other=0.0).to(tl.float32)
        xo = tl.load(xrow + 2 * pair + 1, mask=m, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [NG_P]
        s = tl.maximum(amax / QMAX, MIN_S).to(tl.float16)
        sf = s.to(tl.float32)[:, None]
        qe = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(xe, sf) + 0.5), -QMAX), QMAX) + BIAS
        qo = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(xo, sf) + 0.5), -QMAX), QMAX) + BIAS
        byte = qe.to(tl.uint8) | (qo.to(tl.uint8) << 4)
        tl.store(data_ptr + row * (D // 2) + pair, byte, mask=m)
        tl.store(scale_ptr + row * (D // G) + gi, s, mask=gi < D // G)

    @triton.jit
    def _int4_load_kernel(data_ptr, scale_ptr, pid_ptr, out_ptr, H, S,
                          D: tl.constexpr, G: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_W: tl.constexpr, BIAS: tl.constexpr):
        """One (selected page, head): unpack [S, D/2] bytes to [S, D] values."""
        p = tl.program_id(0)
        h = tl.program_id(1)
        page = tl.load(pid_ptr + p)
        s = tl.arange(0, BLOCK_S)[:, None]
        i = tl.arange(0, BLOCK_W)[None, :]
        m = (s < S) & (i < D // 2)
        src = (page * H + h) * S + s
        b = tl.load(data_ptr + src * (D // 2) + i, mask=m, other=0).to(tl.int32)
        sc = tl.load(scale_ptr + src * (D // G) + (2 * i) // G, mask=m, other=0.0).to(tl.float32)
        lo = ((b & 0xF) - BIAS).to(tl.float32) * sc
        hi = ((b >> 4) - BIAS).to(tl.float32) * sc
        # interleave to [S, 2W] so the store is one contiguous row (value 2i = lo, 2i+1 = hi)
        vals = tl.reshape(tl.join(lo, hi), (BLOCK_S, 2 * BLOCK_W))
        j = tl.arange(0, 2 * BLOCK_W)[None, :]
        mj = (s < S) & (j < D)
        tl.store(out_ptr + ((p * H + h) * S + s) * D + j, vals, mask=mj)


    # _transform SMOOTH modes: what happens to a row before the rotation.
    SMOOTH_NONE = tl.constexpr(0)
    SMOOTH_K = tl.constexpr(1)  # (x - shift[h]) / channel_scale[h]: K as the pool stores it
    SMOOTH_Q = tl.constexpr(2)  # x * channel_scale[h // G]: q in the stored K domain
    # _transform_store_kernel MODE: the codec of the stored rows.
    MODE_PLAIN = tl.constexpr(0)
    MODE_INT8 = tl.constexpr(1)
    MODE_FP8 = tl.constexpr(2)
    MODE_INT4 = tl.constexpr(3)

    @triton.jit
    def _transformed(x_ptr, t, tm, stride_xt, x_off, ph, shift_ptr, cs_ptr, D: tl.constexpr,
                     BLOCK_T: tl.constexpr, BK: tl.constexpr, SMOOTH: tl.constexpr, ROTATE: tl.constexpr,
                     INV_SQRT_D: tl.constexpr):
        """Rows t [BLOCK_T] of one head (x_ptr + t * stride_xt + x_off + d) -> smoothed (param row
        ph) and rotated rows [BLOCK_T, D] fp32.

        The math of PagePool.write / native_q (fp32, IEEE division) and KVFormat.rotate: x @ R
        with R the Sylvester Hadamard matrix / sqrt(D) (kv/formats.py hadamard, one block for a
        power-of-two D). R is never loaded: its sign at (i, j) is the parity of popcount(i & j),
        built in registers BK rows at a time, and the exact +-1 products run on tensor cores
        (tf32x3: about fp32 accuracy); 1 / sqrt(D) scales the sums.
        """
        if ROTATE:
            acc = tl.zeros([BLOCK_T, D], tl.float32)
            j = tl.arange(0, D)
            for k0 in tl.static_range(0, D, BK):
                kk = k0 + tl.arange(0, BK)
                x = tl.load(x_ptr + t[:, None] * stride_xt + x_off + kk[None, :], mask=tm,
                            other=0.0).to(tl.float32)
                x = _smooth(x, kk, ph, shift_ptr, cs_ptr, D, SMOOTH)
                v = kk[:, None] & j[None, :]
                v = v ^ (v >> 8)
                v = v ^ (v >> 4)
                v = v ^ (v >> 2)
                v = v ^ (v >> 1)
                sign = 1.0 - 2.0 * (v & 1).to(tl.float32)  # [BK, D]
                acc += tl.dot(x, sign, input_precision="tf32x3")
            return acc * INV_SQRT_D
        d = tl.arange(0, D)
        x = tl.load(x_ptr + t[:, None] * stride_xt + x_off + d[None, :], mask=tm, other=0.0).to(tl.float32)
        return _smooth(x, d, ph, shift_ptr, cs_ptr, D, SMOOTH)

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

    @triton.jit(do_not_specialize=["T", "H", "G"])
    def _transform_rows_kernel(x_ptr, out_ptr, cs_ptr, stride_xt, stride_xh, stride_ot, stride_oh, T, H, G,
                               D: tl.constexpr, BLOCK_T: tl.constexpr, BK: tl.constexpr, SMOOTH: tl.constexpr,
                               ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr):
        """BLOCK_T rows of head h: out = R (x * channel_scale[h // G]) (or R x), in out's dtype."""
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = (t < T)[:, None]
        y = _transformed(x_ptr, t, tm, stride_xt, h * stride_xh, h // G, cs_ptr, cs_ptr, D, BLOCK_T, BK,
                         SMOOTH, ROTATE, INV_SQRT_D)
        d = tl.arange(0, D)[None, :]
        tl.store(out_ptr + t[:, None] * stride_ot + h * stride_oh + d, y.to(out_ptr.dtype.element_ty), mask=tm)

    @triton.jit(do_not_specialize=["T", "H"])
    def _transform_store_kernel(x_ptr, slot_ptr, data_ptr, scale_ptr, shift_ptr, cs_ptr,
                                stride_xt, stride_xh, T, H, S, D: tl.constexpr, BLOCK_T: tl.constexpr,
                                BK: tl.constexpr, MODE: tl.constexpr, GROUP: tl.constexpr, SMOOTH: tl.constexpr,
                                ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr, QMAX: tl.constexpr,
                                BIAS: tl.constexpr, MIN_S: tl.constexpr):
        """BLOCK_T new rows of head h: smooth + rotate + quantize + scatter into their page slots,
        one launch for what PagePool.write did in ~7 (same codes as the codecs, up to the
        rotation's last-bit rounding)."""
        h = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        tm = tmask[:, None]
        d = tl.arange(0, D)
        x = _transformed(x_ptr, t, tm, stride_xt, h * stride_xh, h, shift_ptr, cs_ptr, D, BLOCK_T, BK, SMOOTH,
                         ROTATE, INV_SQRT_D)
        slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
        row = ((slot // S) * H + h) * S + slot % S  # [BLOCK_T]
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


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def codec_store(codec: Codec, x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor,
                scale: torch.Tensor) -> bool:
    """Quantize x: [T, H, D] into data/scale pages at slots [T]; False if no kernel fits."""
    if not HAVE_TRITON or not isinstance(codec, (Int8Codec, Fp8Codec, Int4Codec)):
        return False
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, d = x.shape
    if t == 0:
        return True
    _, _, s, _ = data.shape
    grid = (t, h)
    if isinstance(codec, Int4Codec):
        g = codec.group_for(d)
        _int4_store_kernel[grid](x, slots, data, scale, x.stride(0), x.stride(1), h, s, D=d, G=g,
                                 NG_P=_pow2(d // g), QMAX=float(INT4_MAX), BIAS=float(INT4_BIAS),
                                 MIN_S=MIN_SCALE)
    else:
        fp8 = isinstance(codec, Fp8Codec)
        _row_store_kernel[grid](x, slots, data, scale, x.stride(0), x.stride(1), h, s, D=d,
                                BLOCK_D=_pow2(d), QMAX=FP8_E4M3_MAX if fp8 else float(INT8_MAX),
                                MIN_S=MIN_SCALE, IS_FP8=fp8)
    return True


def codec_load(codec: Codec, data: torch.Tensor, scale: torch.Tensor, page_ids: torch.Tensor,
               head_dim: int, out_dtype: torch.dtype) -> torch.Tensor | None:
    """Dequantize pages page_ids [P] -> [P, H, S, D] in out_dtype; None if no kernel fits."""
    if not HAVE_TRITON or not isinstance(codec, (Int8Codec, Fp8Codec, Int4Codec)):
        return None
    _, h, s, _ = data.shape
    n = page_ids.numel()
    out = torch.empty((n, h, s, head_dim), dtype=out_dtype, device=data.device)
    if n == 0:
        return out
    grid = (n, h)
    if isinstance(codec, Int4Codec):
        _int4_load_kernel[grid](data, scale, page_ids, out, h, s, D=head_dim, G=codec.group_for(head_dim),
                                BLOCK_S=_pow2(s), BLOCK_W=_pow2(head_dim // 2), BIAS=INT4_BIAS)
    else:
        _row_load_kernel[grid](data, scale, page_ids, out, h, s, D=head_dim, BLOCK_S=_pow2(s),
                               BLOCK_D=_pow2(head_dim), IS_FP8=isinstance(codec, Fp8Codec))
    return out


def plain_store(x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor) -> None:
    """data[slot // S, :, slot % S] = x (cast): x [T, H, D], data [P, H, S, D], one launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h, d = x.shape
    if t:
        _plain_store_kernel[(t, h)](x, slots, data, x.stride(0), x.stride(1), h, data.shape[2], D=d,
                                    BLOCK_D=_pow2(d))


def store_rows(fmt: KVFormat, st: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> bool:
    """KVFormat.store through the kernels; False (nothing written) if a codec has none."""
    codecs = (("k", fmt.k_codec, k), ("v", fmt.v_codec, v))
    if HAVE_TRITON and all(isinstance(c, PlainCodec) for _, c, _ in codecs):
        plain_store(k, slots, st["k"])
        plain_store(v, slots, st["v"])
        return True
    if not HAVE_TRITON or not all(isinstance(c, (Int8Codec, Fp8Codec, Int4Codec)) for _, c, _ in codecs):
        return False
    for kv, codec, x in codecs:
        codec_store(codec, x, slots, st[kv], st[kv + "_scale"])
    return True


def load_pages(fmt: KVFormat, st: dict[str, torch.Tensor], page_ids: torch.Tensor,
               out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """KVFormat.load through the kernels; None if a codec has none."""
    codecs = (("k", fmt.k_codec), ("v", fmt.v_codec))
    if not HAVE_TRITON or not all(isinstance(c, (Int8Codec, Fp8Codec, Int4Codec)) for _, c in codecs):
        return None
    head_dim = fmt.head_dim_of(st)
    k = codec_load(fmt.k_codec, st["k"], st["k_scale"], page_ids, head_dim, out_dtype)
    v = codec_load(fmt.v_codec, st["v"], st["v_scale"], page_ids, head_dim, out_dtype)
    return k, v  # type: ignore[return-value]


# Rows per program of the transform kernels: tl.dot needs >= 16; decode steps bring 1-32.
TRANSFORM_BLOCK_T = 16
# Columns of x (rows of the Hadamard signs) per tl.dot of the rotation: bounds registers at any D.
TRANSFORM_BK = 32


def transform_supported(x: torch.Tensor) -> bool:
    """Whether the fused transform kernels take rows x [T, H, D]: Triton, a power-of-two D >= 16
    (where formats.hadamard is one Sylvester block, which the kernels build in registers)."""
    d = x.shape[-1]
    return HAVE_TRITON and d >= 16 and d & (d - 1) == 0


def _rotation_args(d: int, rotate: bool) -> dict[str, object]:
    return dict(D=d, BLOCK_T=TRANSFORM_BLOCK_T, BK=min(TRANSFORM_BK, d), ROTATE=rotate,
                INV_SQRT_D=float(torch.tensor(d ** -0.5, dtype=torch.float32)))


def transform_rows(x: torch.Tensor, rotate: bool, channel_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H, D] -> R (x * channel_scale[h // G]) (PagePool.native_q) or R x (native_out) in
    one launch. channel_scale: [Hkv, D] with H = G * Hkv, or None; R: formats.hadamard(D)."""
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=out_dtype or x.dtype, device=x.device)
    if t == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    g = h // channel_scale.shape[0] if channel_scale is not None else 1
    grid = (triton.cdiv(t, TRANSFORM_BLOCK_T), h)
    _transform_rows_kernel[grid](x, out, channel_scale if channel_scale is not None else x,
                                 x.stride(0), x.stride(1), out.stride(0), out.stride(1), t, h, g,
                                 SMOOTH=SMOOTH_Q if channel_scale is not None else SMOOTH_NONE,
                                 **_rotation_args(d, rotate))
    return out


def _codec_mode(codec: Codec) -> tuple[int, float]:
    """(MODE, QMAX) of a codec for _transform_store_kernel."""
    if isinstance(codec, PlainCodec):
        return 0, 1.0
    if isinstance(codec, Int8Codec):
        return 1, float(INT8_MAX)
    if isinstance(codec, Fp8Codec):
        return 2, FP8_E4M3_MAX
    if isinstance(codec, Int4Codec):
        return 3, float(INT4_MAX)
    raise ValueError(f"no fused store for codec {type(codec).__name__}")


def transform_store(codec: Codec, x: torch.Tensor, slots: torch.Tensor, data: torch.Tensor,
                    scale: torch.Tensor | None, rotate: bool,
                    smooth: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Rows x [T, H, D] -> (x - shift) / channel_scale (smooth = (shift, scale), each [H, D]),
    rotated by formats.hadamard(D) (or not), encoded by `codec` into data/scale pages at slots [T]."""
    t, h, d = x.shape
    if t == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    mode, qmax = _codec_mode(codec)
    group = codec.group_for(d) if isinstance(codec, Int4Codec) else 1
    shift, cs = smooth if smooth is not None else (x, x)
    grid = (triton.cdiv(t, TRANSFORM_BLOCK_T), h)
    _transform_store_kernel[grid](x, slots, data, scale if scale is not None else data, shift, cs,
                                  x.stride(0), x.stride(1), t, h, data.shape[2], MODE=mode, GROUP=group,
                                  SMOOTH=SMOOTH_K if smooth is not None else SMOOTH_NONE, QMAX=qmax,
                                  BIAS=float(INT4_BIAS), MIN_S=MIN_SCALE, **_rotation_args(d, rotate))
