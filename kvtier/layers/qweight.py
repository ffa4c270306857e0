"""Weight-only quantized matrices: the one layout every loader and matmul kernel shares.

A Linear weight W [N, K] (N outputs, K inputs) is kept as integer codes plus one
scale (and, asymmetric, one min) per group of `group` consecutive inputs of a row:

    W[n, k] = code[n, k] * scales[n, k // group] + mins[n, k // group]     (mins None: + 0)

    bits 4: qweight uint8 [N, K // 2]; byte j of row n holds column 2j in its low nibble
            and column 2j + 1 in its high nibble; codes are unsigned 0..15
            (GGUF Q4_0: scale d, min -8 d; Q4_1: d, m; Q4_K: d * sc, -dmin * m)
    bits 8: qweight int8 [N, K]; codes are signed -128..127
            (GGUF Q8_0: scale d, no min; Q5_0: d, code q - 16; Q6_K: groups of 16)

    scales, mins: [N, K // group] float16 (GGUF block headers are fp16, so Q4_0 / Q4_1 /
    Q8_0 / Q5_0 are reproduced exactly; the K-quants' two-level d * sc rounds once to fp16)

The row-major [N, ...] layout reads contiguously along K for every output row, which is
what a GEMV (decode) wants; kernels that need another order repack at load and say so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bits per code this layout holds.
SUPPORTED_BITS = (4, 8)
# Scales and mins are fp16: the GGUF block headers' own type.
SCALE_DTYPE = torch.float16
INT4_LEVELS = 15  # codes 0..15
INT8_MAX = 127  # symmetric RTN int8 uses -127..127 (the -128 code stays free)


@dataclass
class QuantWeight:
    """Codes + per-group scales (+ mins) of one [N, K] weight; see the module docstring."""

    bits: int
    group: int
    qweight: torch.Tensor  # bits 4: uint8 [N, K // 2]; bits 8: int8 [N, K]
    scales: torch.Tensor  # fp16 [N, K // group]
    mins: torch.Tensor | None  # fp16 [N, K // group] or None (symmetric)

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"QuantWeight bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        n, k = self.shape
        if self.group < 1 or k % self.group:
            raise ValueError(f"QuantWeight group {self.group} does not divide K = {k}")
        want_q = torch.uint8 if self.bits == 4 else torch.int8
        if self.qweight.dtype != want_q or self.qweight.dim() != 2:
            raise ValueError(f"{self.bits}-bit codes must be a 2-D {want_q} tensor, got "
                             f"{self.qweight.dtype} {tuple(self.qweight.shape)}")
        for name, t in (("scales", self.scales), ("mins", self.mins)):
            if t is not None and (tuple(t.shape) != (n, k // self.group) or t.dtype != SCALE_DTYPE):
                raise ValueError(f"QuantWeight {name} must be {SCALE_DTYPE} [{n}, {k // self.group}], got "
                                 f"{t.dtype} {tuple(t.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight."""
        n, w = self.qweight.shape
        return int(n), int(w * 2 if self.bits == 4 else w)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def nbytes(self) -> int:
        """Bytes held: codes, scales and mins."""
        parts = [self.qweight, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)

    def to(self, device: torch.device | str) -> "QuantWeight":
        mv = (lambda t: None if t is None else t.to(device))
        return QuantWeight(self.bits, self.group, mv(self.qweight), mv(self.scales), mv(self.mins))

    def codes(self) -> torch.Tensor:
        """Integer codes [N, K] as int16 (the unpacked nibbles for 4-bit)."""
        if self.bits == 8:
            return self.qweight.to(torch.int16)
        lo = (self.qweight & 0xF).to(torch.int16)
        hi = (self.qweight >> 4).to(torch.int16)
        return torch.stack((lo, hi), dim=-1).reshape(self.qweight.shape[0], -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight [N, K] in `dtype` (computed in fp32): the reference of every kernel."""
        n, k = self.shape
        q = self.codes().float().view(n, k // self.group, self.group)
        w = q * self.scales.float()[..., None]
        if self.mins is not None:
            w = w + self.mins.float()[..., None]
        return w.reshape(n, k).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] integers in 0..15 -> uint8 [N, K // 2] (even column in the low nibble)."""
    c = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def quantize_rtn(weight: torch.Tensor, bits: int, group: int = 32) -> QuantWeight:
    """Round-to-nearest group-wise quantization of a dense weight [N, K].

    4 bits: asymmetric (each group's min..max over 16 levels); 8 bits: symmetric absmax.
    Scales are rounded to fp16 before the codes are chosen, so the codes fit the scale the
    kernels will use.
    """
    n, k = weight.shape
    if k % group:
        raise ValueError(f"quantize_rtn: group {group} does not divide K = {k}")
    w = weight.float().reshape(n, k // group, group)
    if bits == 4:
        lo, hi = w.amin(-1), w.amax(-1)
        scale = torch.where(hi > lo, (hi - lo) / INT4_LEVELS, torch.ones_like(hi)).to(SCALE_DTYPE)
        mins = lo.to(SCALE_DTYPE)
        q = torch.round((w - mins.float()[..., None]) / scale.float()[..., None]).clamp_(0, INT4_LEVELS)
        return QuantWeight(4, group, pack_int4(q.reshape(n, k)), scale.contiguous(), mins.contiguous())
    if bits == 8:
        amax = w.abs().amax(-1)
        scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(SCALE_DTYPE)
        q = torch.round(w / scale.float()[..., None]).clamp_(-INT8_MAX, INT8_MAX)
        return QuantWeight(8, group, q.reshape(n, k).to(torch.int8).contiguous(), scale.contiguous(), None)
    raise ValueError(f"quantize_rtn: bits must be one of {SUPPORTED_BITS}, got {bits}")
