"""GGUF block formats -> QuantWeight (layers/qweight.py), keeping what the file holds.

Each GGML block is a run of `block_size` consecutive values of one row with its own header
(a scale, sometimes a min, and for K-quants per-sub-block 6-bit factors). The repack keeps
the block's integer codes and turns its header into the group scale / min of QuantWeight:

    type   block  QuantWeight            code          scale          min
    Q4_0     32   4-bit, group 32        q (0..15)     d              -8 d
    Q4_1     32   4-bit, group 32        q (0..15)     d              m
    Q4_K    256   4-bit, group 32        q (0..15)     d * sc_j       -dmin * m_j
    Q8_0     32   8-bit, group 32        q             d              -
    Q5_0     32   8-bit, group 32        q - 16        d              -
    Q5_1     32   8-bit, group 32        q (0..31)     d              m
    Q5_K    256   8-bit, group 32        q (0..31)     d * sc_j       -dmin * m_j
    Q6_K    256   8-bit, group 16        q - 32        d * sc_j       -
    Q3_K    256   8-bit, group 16        q (-4..3)     d * (sc_j-32)  -
    Q2_K    256   8-bit, group 16        q (0..3)      d * sc_j       -dmin * m_j

Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 dequantize to exactly what `gguf.quants.dequantize` gives
(scale and min are the fp16 header values; q * d + m is the same fp32 arithmetic). The
K-quants' two-level scale d * sc_j (fp32 in gguf) is rounded once to fp16: a relative error
of at most 2^-11 on a group's scale and min (tests/models/test_repack.py measures it).

Q2_K / Q3_K widen to 8-bit codes (the layout has no 2/3-bit codes, and torch's CPU int4
kernel takes no group of 16): exact in the codes, more bytes than the file.

Tensors are repacked in row chunks of about CHUNK_BYTES of file data, so the numpy temporaries
stay small whatever the tensor's size.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvtier.layers.qweight import QuantWeight

_Q = GGMLQuantizationType
QK_K = 256  # values per K-quant super-block
# File bytes repacked per step: bounds the numpy temporaries (a few times this) per thread.
CHUNK_BYTES = 8 << 20

# A block repack: blocks uint8 [n, type_size] -> (codes [n, block] uint8 0..15 (4-bit) or
# int8 (8-bit), scales fp16 [n, block // group], mins fp16 [n, block // group] or None).
BlockRepack = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray | None]]


def _f16(b: np.ndarray) -> np.ndarray:
    """b: [n, 2] uint8 (little-endian half) -> [n, 1] float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles_split16(qs: np.ndarray) -> np.ndarray:
    """qs [n, 16] (value j low nibble, value j + 16 high nibble) -> [n, 32] uint8 in value order."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _q5_high(qh: np.ndarray) -> np.ndarray:
    """qh [n, 4] bytes (bit j = 5th bit of value j) -> [n, 32] uint8 of 0 / 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")  # [n, 32]
    return bits << np.uint8(4)


def _q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return _nibbles_split16(b[:, 2:]), d.astype(np.float16), (-8 * d).astype(np.float16)


def _q4_1(b: np.ndarray):
    return _nibbles_split16(b[:, 4:]), _f16(b[:, 0:2]).astype(np.float16), _f16(b[:, 2:4]).astype(np.float16)


def _q8_0(b: np.ndarray):
    return b[:, 2:].view(np.int8), _f16(b[:, 0:2]).astype(np.float16), None


def _q5_0(b: np.ndarray):
    q = _nibbles_split16(b[:, 6:]) | _q5_high(b[:, 2:6])
    return (q.astype(np.int8) - np.int8(16)), _f16(b[:, 0:2]).astype(np.float16), None


def _q5_1(b: np.ndarray):
    q = _nibbles_split16(b[:, 8:]) | _q5_high(b[:, 4:8])
    return q.view(np.int8), _f16(b[:, 0:2]).astype(np.float16), _f16(b[:, 2:4]).astype(np.float16)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K / Q5_K block -> (sc, m) [n, 8] 6-bit factors (gguf's get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_headers(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: d, dmin, 12 scale bytes -> fp16 (scale, min) [n, 8] (gguf: d * sc, dmin * m in fp32)."""
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return (d * sc.astype(np.float32)).astype(np.float16), (-(dmin * mn.astype(np.float32))).astype(np.float16)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """qs [n, 128]: 4 chunks of 32 bytes, each the low nibbles of 32 values then their high
    nibbles -> [n, 256] uint8 in value order."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(-1, QK_K)


def _q4_k(b: np.ndarray):
    scale, mn = _k_headers(b)
    return _k_low_nibbles(b[:, 16:]), scale, mn


def _q5_k(b: np.ndarray):
    scale, mn = _k_headers(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)  # [n, 8, 32]
    q = _k_low_nibbles(b[:, 48:]) | ((qh & np.uint8(1)) << np.uint8(4)).reshape(-1, QK_K)
    return q.view(np.int8), scale, mn


def _q6_k(b: np.ndarray):
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(-1, 8, 32)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(-1, 8, 32)
    q = ((ql | (qh << np.uint8(4))).astype(np.int8) - np.int8(32)).reshape(-1, QK_K)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    return q, (_f16(b[:, 208:210]) * sc).astype(np.float16), None


def _q3_k(b: np.ndarray):
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lo = (packed[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    hi = (packed[:, 8:].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((lo & np.uint8(0x0F)) | ((hi & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    ql = qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    ql = (ql.reshape(-1, QK_K) & np.uint8(3)).astype(np.int8)
    qh = (qh.reshape(-1, QK_K) & np.uint8(1)) ^ np.uint8(1)  # the -4 offset applies where the bit is 0
    q = ql - (qh << np.uint8(2)).astype(np.int8)
    return q, (d * sc.astype(np.float32)).astype(np.float16), None


def _q2_k(b: np.ndarray):
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    scale = (d * (scales & np.uint8(0x0F)).astype(np.float32)).astype(np.float16)
    mn = (-(dmin * (scales >> np.uint8(4)).astype(np.float32))).astype(np.float16)
    return q.reshape(-1, QK_K).view(np.int8), scale, mn


# qtype -> (bits, group, repack of whole blocks)
REPACKS: dict[GGMLQuantizationType, tuple[int, int, BlockRepack]] = {
    _Q.Q4_0: (4, 32, _q4_0), _Q.Q4_1: (4, 32, _q4_1), _Q.Q4_K: (4, 32, _q4_k),
    _Q.Q8_0: (8, 32, _q8_0), _Q.Q5_0: (8, 32, _q5_0), _Q.Q5_1: (8, 32, _q5_1), _Q.Q5_K: (8, 32, _q5_k),
    _Q.Q6_K: (8, 16, _q6_k), _Q.Q3_K: (8, 16, _q3_k), _Q.Q2_K: (8, 16, _q2_k),
}
DENSE_TYPES = frozenset({_Q.F32, _Q.F16, _Q.BF16})
ASYMMETRIC = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q4_K, _Q.Q5_1, _Q.Q5_K, _Q.Q2_K})  # repacks with mins


def dense_from_bytes(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor's bytes -> a torch tensor of its own dtype and `shape` (copied)."""
    if qtype == _Q.F32:
        t = torch.from_numpy(raw.view(np.float32).copy())
    elif qtype == _Q.F16:
        t = torch.from_numpy(raw.view(np.float16).copy())
    elif qtype == _Q.BF16:
        t = torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    else:
        raise ValueError(f"{qtype.name} is not a dense type")
    return t.reshape(shape)


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, n: int, k: int) -> QuantWeight:
    """One quantized [N, K] tensor's bytes (uint8, N rows of K values) -> QuantWeight.

    Works through CHUNK_BYTES of rows at a time into preallocated outputs.
    """
    if qtype not in REPACKS:
        raise ValueError(f"no QuantWeight repack for {qtype.name}")
    bits, group, fn = REPACKS[qtype]
    block, type_size = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise ValueError(f"{qtype.name}: row of {k} values is not a multiple of the block size {block}")
    row_bytes = k // block * type_size
    rows = raw.reshape(n, row_bytes)
    qweight = torch.empty((n, k // 2) if bits == 4 else (n, k), dtype=torch.uint8 if bits == 4 else torch.int8)
    scales = torch.empty((n, k // group), dtype=torch.float16)
    mins = None
    step = max(1, CHUNK_BYTES // row_bytes)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        codes, sc, mn = fn(np.ascontiguousarray(rows[r0:r1]).reshape(-1, type_size))
        codes = codes.reshape(r1 - r0, k)
        if bits == 4:
            qweight[r0:r1] = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4)))
        else:
            qweight[r0:r1] = torch.from_numpy(codes)
        scales[r0:r1] = torch.from_numpy(sc.reshape(r1 - r0, -1))
        if mn is not None:
            if mins is None:
                mins = torch.empty_like(scales)
            mins[r0:r1] = torch.from_numpy(mn.reshape(r1 - r0, -1))
    return QuantWeight(bits, group, qweight, scales, mins)


def permute_rows(w: QuantWeight, perm: torch.Tensor) -> QuantWeight:
    """Rows of w reordered: row i of the result is row perm[i] of w (scales and mins with them)."""
    sel = (lambda t: None if t is None else t.index_select(0, perm))
    return QuantWeight(w.bits, w.group, sel(w.qweight), sel(w.scales), sel(w.mins))
