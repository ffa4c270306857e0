"""KV storage formats: how one page of K and V is laid out in memory.

A format owns dtype, scales and bytes per page; the pool allocates what the
format asks for (`layout`) and calls store/load. Every stored tensor has a
leading page axis, so pools can move pages generically:

    "k", "v"              [num_pages, kv_heads, page_size, head_dim (or packed width)]
    "k_scale", "v_scale"  [num_pages, kv_heads, page_size, n_scales]   (quantized formats)

K and V are each encoded by a `Codec` (per (token, head) row of head_dim
values). The codecs here are the plain-PyTorch reference; on CUDA the page pool
(kv/pool.py) calls the Triton kernels of kvtier/kernels/kv_quant.py, which match them.

Two exact transforms make the quantized formats accurate on real models
(measured in docs/benchmarks.md, "KV quality"):

- Rotation (`rotate_k`, `rotate_v`): rows are multiplied by an orthonormal
  block-Hadamard matrix R before encoding and by R again after decoding
  (R @ R = I). It spreads a row's outlier channels over all channels, so a
  per-row or per-group integer scale wastes fewer levels.
- K smoothing (`smooth_k`, applied by the pool that writes the pages): K is
  stored as (k - c) / s with per-(layer, kv head) channel vectors c (shift)
  and s (spread), fixed at the layer's first write. s is multiplied back on
  read; c is not: attention is invariant to it (q.(k - c) = q.k - q.c
  shifts every score of a query row by the same amount). Models such as
  Qwen2 have K channels with means ~100x their spread; removing c and
  equalising the channels before rotating shrinks the range the codes must
  cover by that much.
"""

from __future__ import annotations

import functools
import math

import torch

# Largest finite float8 e4m3 value: amax maps to it.
FP8_E4M3_MAX = 448.0
INT8_MAX = 127
INT4_MAX = 7  # symmetric int4 codes in [-7, 7] (stored biased by 8 in a nibble)
INT4_BIAS = 8
# Values per int4 scale along head_dim (a power of two): small enough to follow outliers, large
# enough that the fp16 scale costs 0.5 bit per value.
INT4_GROUP = 32
# Scales are fp16; clamp to its smallest normal so an all-zero row never divides by 0.
SCALE_DTYPE = torch.float16
MIN_SCALE = 2.0 ** -14

Parts = dict[str, torch.Tensor]
# Rotations of at most this many values (64 rows of 128) run as multiply-sum on CUDA, not a GEMM.
SMALL_ROTATE_ELEMS = 64 * 128


def _row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """x: [..., n] -> scale [..., 1] in SCALE_DTYPE such that |x| / scale <= qmax."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    return (amax / qmax).clamp_min(MIN_SCALE).to(SCALE_DTYPE)


def round_half_up(x: torch.Tensor) -> torch.Tensor:
    """floor(x + 0.5): the rounding the Triton kernels use too (bit-identical codes)."""
    return torch.floor(x + 0.5)


class Codec:
    """Encodes rows of head_dim values; `parts(head_dim)` names the stored tensors."""

    def parts(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        """suffix -> (last-axis width, dtype) of each stored tensor."""
        raise NotImplementedError

    def head_dim(self, width: int) -> int:
        """head_dim stored in a data row of `width` elements."""
        return width

    def encode(self, x: torch.Tensor) -> Parts:
        """x: [..., D] -> {suffix: [..., width]}."""
        raise NotImplementedError

    def decode(self, parts: Parts, out_dtype: torch.dtype) -> torch.Tensor:
        """{suffix: [..., width]} -> [..., D] in out_dtype."""
        raise NotImplementedError


class PlainCodec(Codec):
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def parts(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"": (head_dim, self.dtype)}

    def encode(self, x: torch.Tensor) -> Parts:
        return {"": x.to(self.dtype)}

    def decode(self, parts: Parts, out_dtype: torch.dtype) -> torch.Tensor:
        return parts[""].to(out_dtype)


class Int8Codec(Codec):
    """Symmetric int8, one fp16 scale per (token, head)."""

    def parts(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"": (head_dim, torch.int8), "_scale": (1, SCALE_DTYPE)}

    def encode(self, x: torch.Tensor) -> Parts:
        scale = _row_scale(x, INT8_MAX)
        q = round_half_up(x.float() / scale.float()).clamp(-INT8_MAX, INT8_MAX)
        return {"": q.to(torch.int8), "_scale": scale}

    def decode(self, parts: Parts, out_dtype: torch.dtype) -> torch.Tensor:
        return (parts[""].float() * parts["_scale"].float()).to(out_dtype)


class Fp8Codec(Codec):
    """float8 e4m3 (stored as raw bytes), one fp16 scale per (token, head)."""

    def parts(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"": (head_dim, torch.uint8), "_scale": (1, SCALE_DTYPE)}

    def encode(self, x: torch.Tensor) -> Parts:
        scale = _row_scale(x, FP8_E4M3_MAX)
        y = (x.float() / scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return {"": y.to(torch.float8_e4m3fn).view(torch.uint8), "_scale": scale}

    def decode(self, parts: Parts, out_dtype: torch.dtype) -> torch.Tensor:
        y = parts[""].view(torch.float8_e4m3fn).float()
        return (y * parts["_scale"].float()).to(out_dtype)


class Int4Codec(Codec):
    """Symmetric int4 with one fp16 scale per group of `group` values, two codes per byte.

    Byte i of a row holds code 2i in its low nibble and code 2i+1 in its high
    nibble; codes are stored biased (q + 8).
    """

    def __init__(self, group: int = INT4_GROUP):
        if group < 2 or group & (group - 1):
            raise ValueError(f"int4 group size must be a power of two >= 2, got {group}")
        self.group = group

    def group_for(self, head_dim: int) -> int:
        """Largest power of two <= `group` dividing head_dim (80 -> 16): kernels need 2^k groups."""
        if head_dim % 2:
            raise ValueError(f"int4 KV packs two values a byte: head_dim must be even, got {head_dim}")
        return math.gcd(self.group, head_dim)

    def head_dim(self, width: int) -> int:
        return 2 * width

    def parts(self, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
        return {"": (head_dim // 2, torch.uint8), "_scale": (head_dim // self.group_for(head_dim), SCALE_DTYPE)}

    def encode(self, x: torch.Tensor) -> Parts:
        d = x.shape[-1]
        g = self.group_for(d)
        xg = x.float().reshape(*x.shape[:-1], d // g, g)  # [..., G, g]
        scale = _row_scale(xg, INT4_MAX)  # [..., G, 1]
        q = round_half_up(xg / scale.float()).clamp(-INT4_MAX, INT4_MAX) + INT4_BIAS
        q = q.to(torch.uint8).reshape(*x.shape[:-1], d // 2, 2)
        packed = q[..., 0] | (q[..., 1] << 4)  # [..., D/2]
        return {"": packed, "_scale": scale.squeeze(-1)}

    def decode(self, parts: Parts, out_dtype: torch.dtype) -> torch.Tensor:
        packed, scale = parts[""], parts["_scale"]  # [..., D/2], [..., G]
        lo = (packed & 0xF).to(torch.int16) - INT4_BIAS
        hi = (packed >> 4).to(torch.int16) - INT4_BIAS
        q = torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1).float()  # [..., D]
        d, n_groups = q.shape[-1], scale.shape[-1]
        q = q.reshape(*q.shape[:-1], n_groups, d // n_groups) * scale.float().unsqueeze(-1)
        return q.reshape(*packed.shape[:-1], d).to(out_dtype)


@functools.lru_cache(maxsize=None)
def inv_sqrt_f32(d: int) -> float:
    """1 / sqrt(d) rounded to fp32, as a Python float: the scale kernels apply after the
    unscaled Hadamard transform (cached: it sits on every layer's launch)."""
    return float(torch.tensor(d ** -0.5, dtype=torch.float32))


def hadamard(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthonormal, symmetric block-diagonal Hadamard matrix [d, d] (H @ H = I).

    Blocks are the largest power of two dividing d (64 -> one 64 block, 80 -> five 16 blocks).
    """
    block = d & -d
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / block ** 0.5] * (d // block)).to(device)


class KVFormat:
    """A K codec and a V codec; store/load rows of pages. Base of every format.

    With `rotate_k` / `rotate_v` the stored rows are R @ x (see the module
    docstring); `load` returns x again. `smooth_k` asks the writing pool to
    subtract its per-layer K shift before `store`.
    """

    name = "base"

    def __init__(self, k_codec: Codec, v_codec: Codec, rotate_k: bool = False, rotate_v: bool = False,
                 smooth_k: bool = False):
        self.k_codec = k_codec
        self.v_codec = v_codec
        self.rotate_k = rotate_k
        self.rotate_v = rotate_v
        self.smooth_k = smooth_k
        self._rot: dict[tuple[int, torch.device], torch.Tensor] = {}

    def rotation(self, head_dim: int, device: torch.device) -> torch.Tensor:
        """R [D, D] fp32 on `device` (cached): the matrix `rotate` multiplies by."""
        key = (head_dim, torch.device(device))
        if key not in self._rot:
            self._rot[key] = hadamard(head_dim, device)
        return self._rot[key]

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., D] -> x @ R in fp32 (R symmetric orthonormal: its own inverse)."""
        r = self.rotation(x.shape[-1], x.device)
        if x.is_cuda and x.numel() <= SMALL_ROTATE_ELEMS:
            # a few rows (decode): cuBLAS picked a ~50 us fp32 kernel for [8, 128] @ [128, 128]
            # on the H200 (2 per layer: most of a decode step); broadcast-multiply-sum is ~5 us
            return (x.float().unsqueeze(-1) * r).sum(-2)
        return x.float() @ r

    @property
    def quantized(self) -> bool:
        return not isinstance(self.k_codec, PlainCodec) or not isinstance(self.v_codec, PlainCodec)

    def layout(self, kv_heads: int, page_size: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (per-page shape, dtype) of every tensor a page of one layer needs."""
        out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for kv, codec in (("k", self.k_codec), ("v", self.v_codec)):
            for suffix, (width, dtype) in codec.parts(head_dim).items():
                out[kv + suffix] = ((kv_heads, page_size, width), dtype)
        return out

    def head_dim_of(self, st: dict[str, torch.Tensor]) -> int:
        """head_dim of a layer's storage (the K data row may be packed)."""
        return self.k_codec.head_dim(st["k"].shape[-1])

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> float:
        """Bytes of K+V (with scales) for one token of one layer."""
        lay = self.layout(kv_heads, 1, head_dim)
        return float(sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in lay.values()))

    def allocate(self, num_pages: int, kv_heads: int, page_size: int, head_dim: int,
                 device: torch.device, pin: bool = False) -> dict[str, torch.Tensor]:
        pin = pin and device.type == "cpu" and torch.cuda.is_available()
        return {name: torch.zeros((num_pages, *shape), dtype=dtype, device=device, pin_memory=pin)
                for name, (shape, dtype) in self.layout(kv_heads, page_size, head_dim).items()}

    def store(self, st: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """slots: [T] int64 flat slot ids (page * page_size + offset); k, v: [T, H, D]."""
        if self.rotate_k:
            k = self.rotate(k)
        if self.rotate_v:
            v = self.rotate(v)
        self.store_codes(st, slots, k, v)

    def load(self, st: dict[str, torch.Tensor], page_ids: torch.Tensor,
             out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """page_ids: [P] -> k, v: [P, H, S, D] in out_dtype."""
        rot = self.rotate_k or self.rotate_v
        k, v = self.load_codes(st, page_ids, torch.float32 if rot else out_dtype)
        if self.rotate_k:
            k = self.rotate(k)
        if self.rotate_v:
            v = self.rotate(v)
        return k.to(out_dtype), v.to(out_dtype)

    def store_codes(self, st: dict[str, torch.Tensor], slots: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor) -> None:
        """The codecs on rows as given (no transforms): the reference of kernels/kv_quant.py
        store_rows, which PagePool uses on CUDA."""
        s = st["k"].shape[2]
        pages, offs = slots // s, slots % s
        for kv, codec, x in (("k", self.k_codec, k), ("v", self.v_codec, v)):
            for suffix, part in codec.encode(x).items():
                st[kv + suffix][pages, :, offs] = part

    def load_codes(self, st: dict[str, torch.Tensor], page_ids: torch.Tensor,
                   out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded rows as stored (still rotated) by the codecs: the reference of
        kernels/kv_quant.py load_pages, which PagePool uses on CUDA."""
        out = []
        for kv, codec in (("k", self.k_codec), ("v", self.v_codec)):
            parts = {name[len(kv):]: t.index_select(0, page_ids) for name, t in st.items() if name.startswith(kv)}
            out.append(codec.decode(parts, out_dtype))
        return out[0], out[1]


class PlainFormat(KVFormat):
    """fp32 / bf16 / fp16 storage, no quantization."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(PlainCodec(dtype), PlainCodec(dtype))
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


class Fp8Format(KVFormat):
    """K and V in float8 e4m3, per-(token, head) scale, smoothed and rotated: ~2x smaller.

    Smoothing must come first: e4m3's error is relative to each value, so
    rotating an unsmoothed outlier channel into all channels makes every
    channel's error large (measured: Qwen2.5 KL 2.6e-3 -> 1.1e-2).
    """

    name = "fp8"

    def __init__(self) -> None:
        super().__init__(Fp8Codec(), Fp8Codec(), rotate_k=True, rotate_v=True, smooth_k=True)


class Int8Format(KVFormat):
    """K and V symmetric int8, per-(token, head) scale, smoothed and rotated: ~2x smaller."""

    name = "int8"

    def __init__(self) -> None:
        super().__init__(Int8Codec(), Int8Codec(), rotate_k=True, rotate_v=True, smooth_k=True)


class K8V4Format(KVFormat):
    """K int8 (attention scores are sensitive to K), V int4 group-wise; smoothed and
    rotated: ~2.6x smaller than bf16."""

    name = "k8v4"

    def __init__(self, group: int = INT4_GROUP) -> None:
        super().__init__(Int8Codec(), Int4Codec(group), rotate_k=True, rotate_v=True, smooth_k=True)


class Int4Format(KVFormat):
    """K and V int4 group-wise, packed two per byte, smoothed and rotated: ~3.5x smaller."""

    name = "int4"

    def __init__(self, group: int = INT4_GROUP) -> None:
        super().__init__(Int4Codec(group), Int4Codec(group), rotate_k=True, rotate_v=True, smooth_k=True)


FORMAT_NAMES = ("fp32", "bf16", "fp16", "fp8", "int8", "k8v4", "int4")


def make_format(name: str) -> KVFormat:
    """KV format by name (one of FORMAT_NAMES)."""
    plain = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if name in plain:
        return PlainFormat(plain[name])
    quant = {"fp8": Fp8Format, "int8": Int8Format, "k8v4": K8V4Format, "int4": Int4Format}
    if name in quant:
        return quant[name]()
    raise ValueError(f"unknown KV format {name!r} (choose from {', '.join(FORMAT_NAMES)})")
