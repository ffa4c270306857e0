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

