"""Linear layers over weight-only quantized matrices (QuantWeight, layers/qweight.py): one copy each.

Where the weight lives decides how it is held and multiplied:

    CUDA           the QuantWeight itself; every batch size goes to
                   kvtier.kernels.wq_matmul.wq_linear (Triton: skinny / tiled / dequant+cuBLAS)
    CPU, bf16      repacked once at build time for torch's CPU kernels, and the QuantWeight freed:
                   AVX512-VNNI CPUs: every 4- and 8-bit matrix -> VNNIWeight: the codes as they are
                                              with fp16 scale / min, kernels/cpu_ops.py's qv_gemm;
                   elsewhere:
                     4-bit, group 32..256  -> Int4PackCPU: torch's int4pack (w = (q - 8) s + z,
                                              bf16 s and z), `_weight_int4pack_mm_for_cpu`
                     8-bit (Q8_0, Q6_K, ..) -> Int8SplitCPU: the codes exactly, as two int4pack
                                              halves (groups of 16 re-rounded to 32 first)
                     8-bit holding 5 bits  -> Int8RowsCPU: one int8 code and bf16 scale per row
                       (Q5_0)                 over power-of-two column scales
                                              (`_weight_int8pack_mm`), requantized (pack_for says why)
                   batches up to the packing's gemv_max_rows (CPU_GEMV_MAX_ROWS; per-row int8:
                   INT8_ROWS_GEMV_MAX_ROWS) run those kernels; larger ones dequantize
                   CPU_SCRATCH_ELEMS weights at a time into one reused bf16 buffer (`Scratch`,
                   shared by a model's layers) for the dense GEMM.
    CPU, other     QuantRef: the QuantWeight, dequantized chunk by chunk into the scratch for
                   every call (the exact fp32 path; slow, for references and tests)

Every packing can also hand back single rows (`rows`): a tied embedding reads its table from
the lm_head's packing, so the table is held once.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvtier.kernels import cpu_ops
from kvtier.layers.qweight import INT8_MAX, QuantWeight, pack_int4

# Rows of x up to which CPU matmuls run torch's int4 / int8 weight kernels; above, dequantize +
# dense GEMM. Measured on a 2-core AVX512-BF16 EPYC (no AMX): the kernels match or beat dequantize
# + GEMM up to 512 rows (int4 [9728, 896]: 20 ms vs 96 ms at 128 rows, 75 vs 64 ms at 512), since
# dequantizing costs more than a GEMM of a few hundred rows. CPU prefill chunks are 512 tokens.
CPU_GEMV_MAX_ROWS = 1024
# The same bound for the VNNI kernel (qv_gemm), whose weights dequantize through the C++ qv_dequant:
# on a 2-core AMX Xeon, bf16, [17920, 1536] 4-bit: qv_gemm 3.3 / 11.7 / 45.7 / 204.6 ms at 16 / 64 /
# 256 / 1024 rows against dequantize 7.3 ms + GEMM 2.4 / 4.1 / 9.2 / 45.5 ms ([1536, 8960]: 1.5 /
# 5.9 / 24.9 / 102.7 vs 3.6 + 1.1 / 1.9 / 4.4 / 13.5): even at 64 rows, the GEMM above.
VNNI_GEMV_MAX_ROWS = 64
# Per-row int8 dequantizes fast (one multiply, 3 ms for [9728, 896] on one core) and its kernel
# gains nothing from more rows (27 ms at 256 rows vs 3 + 10 ms dequantize + bf16 GEMM; even at 64):
# batches above this many rows take the dense GEMM.
INT8_ROWS_GEMV_MAX_ROWS = 48
# torch's CPU int4pack interleaves output rows in blocks of 64 (row d and d + 32 of a block share
# a byte); weights are padded to a multiple of this.
INT4PACK_BLOCK_N = 64
INT4PACK_GROUPS = (32, 64, 128, 256)  # group sizes `_weight_int4pack_mm_for_cpu` accepts
INT4_OFFSET = 8  # torch's int4pack: w = (q - 8) * scale + zero
# Weights dequantized at once for a GEMM: 16M bf16 = 32 MiB of scratch, whatever the model.
CPU_SCRATCH_ELEMS = 16 << 20
# Rows requantized at once when building a per-row int8 copy (bounds the fp32 temporary).
REQUANT_ROWS = 1024
# Smallest column scale of Int8RowsCPU (an all-zero column keeps a normal power of two).
COL_SCALE_MIN = 2.0 ** -60
PACK_ROWS = 16 * 64  # rows repacked to int4pack at once (a multiple of INT4PACK_BLOCK_N)
# The q4v / q8v layouts (VNNIWeight): output rows in blocks of 16 (one AVX-512 register of fp32 results).
Q4V_BLOCK = 16
# Rows packed at once into a VNNIWeight (the load's peak memory holds one chunk's temporaries: the
# codes unpacked, their scales; the PyTorch packing, without the C++ kernels, adds int64 words at
# ~24 bytes a weight; tools/rss_load.py).
VNNI_PACK_ROWS = 64
# Columns a layout's word spans (q4v, q5v's fifth-bit words, q8v): a group must be a multiple.
VNNI_GROUP_MULTIPLE = {4: 8, 5: 32, 6: 16, 8: 4}
INT8_CODE_OFFSET = 128  # signed codes are held as unsigned bytes (VNNI multiplies u8 x s8): + 2^(bits-1)
# VNNIWeight keeps scales / mins in fp16 when that rounds each no worse than bf16 would (2^-9
# relative); a matrix with values outside fp16's range keeps Int4PackCPU.
FP16_SCALE_RTOL = 2.0 ** -9


class Scratch:
    """One reusable buffer for dequantized weights; a model's layers share it (they run one at a time)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def get(self, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised [n, k] view; the buffer grows to the largest request."""
        if self.buf is None or self.buf.numel() < n * k or self.buf.dtype != dtype or self.buf.device != device:
            self.buf = torch.empty(max(n * k, 0 if self.buf is None else self.buf.numel()), dtype=dtype,
                                   device=device)
        return self.buf[:n * k].view(n, k)


class PackedWeight(torch.nn.Module):
    """A [N, K] weight in one device-specific layout. Subclasses define the four methods below."""

    shape: tuple[int, int]

    def gemv(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [M, K] (few rows) -> [M, N] with a kernel that reads the packed bytes; None: no such kernel."""
        return None

    def gemv_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        """residual + x @ W^T in the residual's dtype, the add inside the kernel's call; None: the
        packing's kernel has no such form (the caller adds)."""
        return None

    def dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        """Rows r0..r1 of the dense weight into out [r1 - r0, K] (out's dtype). r0 is a multiple of row_align."""
        raise NotImplementedError

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """idx [T] row ids -> the dense rows [T, K] in dtype (embedding lookups)."""
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    row_align = 1  # dequantize_into chunks start at multiples of this
    gemv_max_rows = CPU_GEMV_MAX_ROWS  # larger batches dequantize into the scratch for a dense GEMM


class Int4PackCPU(PackedWeight):
    """torch's CPU int4pack: uint8 [Np / 64, K, 32] (byte = row d | row d + 32 << 4 of a 64-row block)
    and scales_and_zeros bf16 [K / group, Np, 2]; Np = N rounded up to 64 (zero rows pad)."""

    row_align = INT4PACK_BLOCK_N

    def __init__(self, group: int, scale: torch.Tensor, zero: torch.Tensor, k: int,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        """w = (q - 8) * scale + zero with scale, zero fp32 [N, K / group]; the codes start at 0 and
        are filled by pack_rows."""
        super().__init__()
        n = scale.shape[0]
        self.shape, self.group = (n, k), group
        self.register_buffer("packed", torch.zeros(padded_rows(n), k // 2, dtype=torch.uint8), persistent=False)
        self.register_buffer("sz", scales_and_zeros(scale, zero, dtype), persistent=False)

    @classmethod
    def from_qweight(cls, qw: QuantWeight, dtype: torch.dtype = torch.bfloat16) -> "Int4PackCPU":
        """A 4-bit QuantWeight's codes as they are: (q - 8) * scale + (min + 8 scale) == q * scale + min."""
        scale = qw.scales.float()
        zero = INT4_OFFSET * scale
        if qw.mins is not None:
            zero += qw.mins.float()
        out = cls(qw.group, scale, zero, qw.shape[1], dtype)
        for r0 in range(0, qw.shape[0], PACK_ROWS):
            out.pack_rows(r0, qw.qweight[r0:r0 + PACK_ROWS])
        return out

    def pack_rows(self, r0: int, codes: torch.Tensor) -> None:
        """QuantWeight-layout codes uint8 [R, K / 2] of rows r0.. into the packing (r0 a multiple of 64)."""
        r1 = r0 + codes.shape[0]
        self.packed[r0:-(-r1 // INT4PACK_BLOCK_N) * INT4PACK_BLOCK_N] = int4pack_rows(codes)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group, self.sz)
        return y if y.shape[1] == self.shape[0] else y[:, :self.shape[0]]

    def _codes(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks uint8 [B, K, 32] -> codes uint8 [B * 64, K] in row order."""
        b, k, _ = blocks.shape
        codes = torch.empty(b, INT4PACK_BLOCK_N, k, dtype=torch.uint8)
        half = INT4PACK_BLOCK_N // 2
        torch.bitwise_and(blocks, 0xF, out=codes[:, :half].transpose(1, 2))
        torch.bitwise_right_shift(blocks, 4, out=codes[:, half:].transpose(1, 2))
        return codes.view(-1, k)

    def dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        n, k = self.shape
        b0, b1 = r0 // INT4PACK_BLOCK_N, -(-r1 // INT4PACK_BLOCK_N)
        blocks = self.packed.view(-1, k, INT4PACK_BLOCK_N // 2)[b0:b1]
        codes = self._codes(blocks)[r0 - b0 * INT4PACK_BLOCK_N:r1 - b0 * INT4PACK_BLOCK_N]
        self._apply_scales(codes, self.sz[:, r0:r1], out)

    def _apply_scales(self, codes: torch.Tensor, sz: torch.Tensor, out: torch.Tensor) -> None:
        """codes uint8 [R, K], sz [K / group, R, 2] -> out [R, K] = (codes - 8) * scale + zero."""
        r, k = codes.shape
        scale = sz[..., 0].t().to(out.dtype)[..., None]  # [R, G, 1]
        base = (sz[..., 1].t().float() - INT4_OFFSET * sz[..., 0].t().float()).to(out.dtype)[..., None]
        torch.addcmul(base, codes.view(r, -1, self.group), scale, out=out.view(r, -1, self.group))

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        k = self.shape[1]
        half = INT4PACK_BLOCK_N // 2
        blocks = self.packed.view(-1, k, half)
        byte = blocks[idx // INT4PACK_BLOCK_N, :, idx % half]  # [T, K]
        high = (idx % INT4PACK_BLOCK_N >= half)[:, None]
        codes = torch.where(high, byte >> 4, byte & 0xF)
        out = torch.empty(idx.shape[0], k, dtype=dtype)
        self._apply_scales(codes, self.sz[:, idx], out)
        return out


class VNNIWeight(PackedWeight):
    """4- or 8-bit codes in the q4v / q8v layouts of kernels/csrc/cpu_ops.cpp, multiplied by its
    AVX512-VNNI kernel (`qv_gemm`): w = u * scale + min with u the codes as the file has them
    (8-bit codes shifted by 128 to 0..255, min adjusted) and scale / min in fp16 per group (GGUF
    keeps Q4_0 / Q4_1 / Q8_0 scales in fp16: exact; Int4PackCPU / Int8SplitCPU round to bf16):

        codes  int32 [Nb, K / W, 16]     lane r of word (b, j): row 16 b + r, columns W j .. W j + W - 1,
                                         column W j + i in bits B i .. B i + B - 1   (W = 32 / B)
        sm     fp16  [Nb, K / G, 2, 16]  (scale, min) of each row's group;  Nb = ceil(N / 16)

    The kernel reads each code as a byte of an integer dot product with the activations in two
    int8 parts (16-bit fixed point per group): no fp32 conversion per weight, which bounds
    torch's int4pack kernel (14 vs 27 us for a 4-bit [3072, 576] at one row), and 8-bit codes
    are held and read once (1 byte + 1/8 for the scales), not as two int4 halves."""

    row_align = Q4V_BLOCK
    gemv_max_rows = VNNI_GEMV_MAX_ROWS

    def __init__(self, shape: tuple[int, int], group: int, bits: int, sym: float | None = None) -> None:
        """sym: every group's min is sym x its scale (symmetric codes: GGUF Q4_0, Q5_0, Q6_K, Q8_0), so
        sm holds the scales alone and the kernel derives the mins."""
        super().__init__()
        self.shape, self.group, self.bits, self.sym = tuple(shape), group, bits, sym
        self.per_word = 4 if bits == 8 else 8  # 5- and 6-bit: the low four bits as 4-bit words
        # 5- / 6-bit: the fifth (and sixth) bits in `hbits`, one int32 per lane, 32 columns and
        # plane (kernels/csrc/cpu_ops.cpp qv_gemm)
        self.planes = bits - 4 if bits in (5, 6) else 0
        for name, (size, dtype) in self._buffer_shapes(shape, group, bits, sym).items():
            self.register_buffer(name, torch.zeros(size, dtype=dtype) if size is not None else None,
                                 persistent=False)

    @staticmethod
    def _buffer_shapes(shape: tuple[int, int], group: int, bits: int,
                       sym: float | None) -> dict[str, tuple[tuple[int, ...] | None, torch.dtype]]:
        """name -> (size or None, dtype) of the buffers: codes, hbits (5- / 6-bit only), sm."""
        n, k = shape
        nb = -(-n // Q4V_BLOCK)
        planes = bits - 4 if bits in (5, 6) else 0
        return {"codes": ((nb, k // (4 if bits == 8 else 8), Q4V_BLOCK), torch.int32),
                "hbits": ((nb, k // 32, planes, Q4V_BLOCK) if planes else None, torch.int32),
                "sm": ((nb, k // group, 1 if sym is not None else 2, Q4V_BLOCK), torch.float16)}

    @staticmethod
    def supports(k: int, group: int, bits: int = 4) -> bool:
        """Whether the kernel is built here (AVX512-VNNI CPU) and takes this K / group."""
        ops = cpu_ops.ops()
        need = VNNI_GROUP_MULTIPLE.get(bits)
        return (need is not None and ops is not None and ops.qv_supported() and group % need == 0 and k % group == 0
                and (bits not in (5, 6) or k % 32 == 0))

    @staticmethod
    def layout_of(qw: QuantWeight) -> tuple[int, int]:
        """(bits, code offset) a QuantWeight is held in: 4-bit as is; 8-bit codes in the fewest bits
        that hold their range (5: GGUF Q5_0 / Q5_1, groups spanning whole 32-column words; 6: Q6_K,
        groups of 16 or more; else 8). Codes that are already unsigned keep offset 0, so the min
        stays the file's own (an offset moves it by offset x scale, rounded to fp16)."""
        if qw.bits == 4:
            return 4, 0
        lo, hi = int(qw.qweight.amin()), int(qw.qweight.amax())
        for bits in (5, 6):
            top = 1 << bits
            if qw.shape[1] % 32 or qw.group % VNNI_GROUP_MULTIPLE[bits]:
                continue
            if lo >= 0 and hi < top:
                return bits, 0
            if lo >= -top // 2 and hi < top // 2:
                return bits, top // 2
        return 8, 0 if lo >= 0 else INT8_CODE_OFFSET

    @classmethod
    def build(cls, shape: tuple[int, int], group: int, bits: int,
              chunk: Callable[[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
              sym: float | None = None) -> "VNNIWeight | None":
        """chunk(r0, r1) -> (codes [r1 - r0, K] in 0 .. 2^bits - 1, scale, min fp32 [r1 - r0, K / G]) of
        those rows, asked for VNNI_PACK_ROWS rows at a time (no whole-matrix temporaries: a load's
        peak memory). sym: every min is sym x its scale, exactly (checked): the mins are not stored.
        None when fp16 would hold a scale or min less precisely than bf16 does (out of its range)."""
        out = cls(shape, group, bits, sym)
        for r0 in range(0, shape[0], VNNI_PACK_ROWS):
            r1 = min(shape[0], r0 + VNNI_PACK_ROWS)
            codes, scale, minv = chunk(r0, r1)
            s16, m16 = scale.to(torch.float16), minv.to(torch.float16)
            for a, b in ((scale, s16), (minv, m16)):
                if not bool(((b.float() - a).abs() <= a.abs() * FP16_SCALE_RTOL).all()):
                    return None
            if sym is not None and not torch.equal(m16.float(), s16.float() * sym):
                raise ValueError(f"VNNIWeight: mins are not {sym} x the scales")
            out._pack_rows(r0, codes, s16, m16)
        return out

    @staticmethod
    def _sym_of(qw: QuantWeight, bits: int, offset: int) -> float | None:
        """The fixed min / scale ratio of symmetric codes (no mins, or Q4_0's min = -8 x scale), else None."""
        if qw.mins is None:
            return -float(offset)
        if bits == 4 and torch.equal(qw.mins, qw.scales * -8):  # fp16: exact (a power of two)
            return -8.0
        return None

    @classmethod
    def from_qweight(cls, qw: QuantWeight, layout: tuple[int, int] | None = None) -> "VNNIWeight | None":
        """A 4-bit (codes 0..15) or 8-bit (int8 codes, stored + offset) QuantWeight, codes untouched;
        symmetric ones (no mins, or Q4_0's min = -8 x scale) hold their scales alone. layout:
        layout_of(qw) when the caller has it (it reads every code)."""
        bits, offset = layout or cls.layout_of(qw)
        sym = cls._sym_of(qw, bits, offset)

        def chunk(r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            scale = qw.scales[r0:r1].float()
            minv = qw.mins[r0:r1].float() if qw.mins is not None else torch.zeros_like(scale)
            if bits == 4:
                return unpack_int4(qw.qweight[r0:r1]), scale, minv
            return qw.qweight[r0:r1].to(torch.int32) + offset, scale, minv - offset * scale

        return cls.build(qw.shape, qw.group, bits, chunk, sym)

    @classmethod
    def for_qweight(cls, qw: QuantWeight, smaller_than: int | None = None) -> "VNNIWeight | None":
        """from_qweight where this CPU runs the kernel for qw's shape and codes (and, with
        smaller_than, where the packed weight would take fewer bytes: decided before packing), else None."""
        layout = cls.layout_of(qw)
        if not cls.supports(qw.shape[1], qw.group, layout[0]):
            return None
        if smaller_than is not None and cls.nbytes_of(qw.shape, qw.group, layout[0],
                                                      cls._sym_of(qw, *layout)) >= smaller_than:
            return None
        return cls.from_qweight(qw, layout)

    @staticmethod
    def nbytes_of(shape: tuple[int, int], group: int, bits: int, sym: float | None) -> int:
        """Bytes the buffers of VNNIWeight(shape, group, bits, sym) take (as `nbytes()` counts them)."""
        return sum(math.prod(size) * dtype.itemsize
                   for size, dtype in VNNIWeight._buffer_shapes(shape, group, bits, sym).values() if size is not None)

    def _shifts(self) -> torch.Tensor:
        return (32 // self.per_word) * torch.arange(self.per_word, dtype=torch.int64)

    def _pack_rows(self, r0: int, codes: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor) -> None:
        """codes [R, K] of rows r0.. (r0 a multiple of 16), scale / minv fp16 [R, G]."""
        r, k = codes.shape
        rp = -(-r // Q4V_BLOCK) * Q4V_BLOCK
        b0, nb = r0 // Q4V_BLOCK, rp // Q4V_BLOCK
        ops = cpu_ops.ops()
        if ops is not None:  # the same words in C++ (qv_pack)
            ops.qv_pack(codes.to(torch.uint8).contiguous(), self.bits, self.codes[b0:b0 + nb],
                        None if self.hbits is None else self.hbits[b0:b0 + nb])
        else:
            self._pack_codes(b0, nb, codes)
        g, planes = k // self.group, self.sm.shape[2]
        sm = torch.zeros(rp, planes, g, dtype=torch.float16)
        sm[:r, 0] = scale
        if planes == 2:
            sm[:r, 1] = minv
        self.sm[b0:b0 + nb] = sm.view(nb, Q4V_BLOCK, planes, g).permute(0, 3, 2, 1)

    def _pack_codes(self, b0: int, nb: int, codes: torch.Tensor) -> None:
        """The PyTorch reference of qv_pack: codes [R, K] into blocks b0 .. b0 + nb of codes / hbits."""
        r, k = codes.shape
        rp, pw = nb * Q4V_BLOCK, self.per_word
        q = torch.zeros(rp, k, dtype=torch.int64)
        q[:r] = codes
        for plane in range(self.planes):  # bit 8 i + 2 t + p of word c <- bit 4 (+ plane) of column 32 c + 8 t + 2 i + p
            high = ((q >> (4 + plane)) & 1).view(rp, k // 32, 4, 4, 2).permute(0, 1, 3, 2, 4).reshape(rp, k // 32, 32)
            self.hbits[b0:b0 + nb, :, plane] = _words(high, 1).view(nb, Q4V_BLOCK, k // 32).transpose(1, 2)
        if self.planes:
            q = q & 0xF
        words = _words(q.view(rp, k // pw, pw), 32 // pw)  # [Rp, K / W]
        self.codes[b0:b0 + nb] = words.view(nb, Q4V_BLOCK, k // pw).transpose(1, 2)

    def gemv(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] -> x @ W^T [M, N] in x's dtype; with residual [M, N]: residual + that, in the
        residual's dtype (one call: the decoder's residual adds)."""
        ops = cpu_ops.ops()
        if ops is None:  # switched off (cpu_ops.disabled): the reference, fp32 over the dense weight
            return self.gemv_reference(x, residual)
        return ops.qv_gemm(x, self.codes, self.hbits, self.sm, self.group, self.shape[0], self.bits, residual,
                           self.sym or 0.0)

    def gemv_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.gemv(x, residual)

    def gemv_reference(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """What qv_gemm computes, in PyTorch: x @ W^T in fp32 over the dequantized rows, rounded to x's dtype."""
        w = self._unpack(self.codes, self.hbits, self.sm, torch.float32)[:self.shape[0]]
        y = (x.float() @ w.t()).to(x.dtype)
        return y if residual is None else residual + y

    def _codes_of(self, words: torch.Tensor, high: torch.Tensor | None) -> torch.Tensor:
        """words int32 [..., K / W] (and 5- / 6-bit: high [..., K / 32, planes]) -> codes int64 [..., K]."""
        pw = self.per_word
        q = (words.unsqueeze(-1).long() >> self._shifts()) & ((1 << (32 // pw)) - 1)
        q = q.reshape(*words.shape[:-1], -1)
        if high is not None:
            for plane in range(high.shape[-1]):
                h = high[..., plane]
                bits = (h.unsqueeze(-1).long() >> torch.arange(32)) & 1  # [..., K / 32, 32] by bit position
                bits = bits.view(*h.shape, 4, 4, 2).transpose(-3, -2)  # bit 8 i + 2 t + p -> column 8 t + 2 i + p
                q = q | (bits.reshape(q.shape) << (4 + plane))
        return q

    def _unpack(self, blocks: torch.Tensor, high: torch.Tensor | None, sm: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        """blocks int32 [B, K / W, 16] (5- / 6-bit: high [B, K / 32, planes, 16]), their sm [B, G, 2, 16] ->
        dense rows [B * 16, K] in dtype."""
        b, words, _ = blocks.shape
        k = words * self.per_word
        q = self._codes_of(blocks.transpose(1, 2), None if high is None else high.permute(0, 3, 1, 2))  # [B, 16, K]
        q = q.reshape(b * Q4V_BLOCK, k // self.group, self.group)
        scale = sm[:, :, 0].permute(0, 2, 1).reshape(b * Q4V_BLOCK, -1, 1).float()
        minv = (sm[:, :, 1].permute(0, 2, 1).reshape(b * Q4V_BLOCK, -1, 1).float() if self.sym is None
                else scale * self.sym)
        return torch.addcmul(minv, q.float(), scale).reshape(b * Q4V_BLOCK, k).to(dtype)

    def dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        """The C++ kernel (qv_dequant) where it is built, else `_unpack`, which computes the same
        values op by op (each code's int64 shifts: ~30x the prefill GEMM's own time)."""
        if r1 <= r0:
            return
        ops = cpu_ops.usable(out)
        if ops is not None and out.is_contiguous():
            ops.qv_dequant(self.codes, self.hbits, self.sm, self.group, self.bits,
                           self.sym if self.sym is not None else 0.0, r0, out)
            return
        b0, b1 = r0 // Q4V_BLOCK, -(-r1 // Q4V_BLOCK)
        rows = self._unpack(self.codes[b0:b1], None if self.hbits is None else self.hbits[b0:b1], self.sm[b0:b1],
                            out.dtype)
        out.copy_(rows[r0 - b0 * Q4V_BLOCK:r1 - b0 * Q4V_BLOCK])

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Only the asked rows are unpacked (the lm_head's top candidates, a tied embedding's tokens)."""
        blocks, lanes = idx // Q4V_BLOCK, idx % Q4V_BLOCK
        q = self._codes_of(self.codes[blocks, :, lanes], None if self.hbits is None else self.hbits[blocks, :, :, lanes])
        sm = self.sm[blocks, :, :, lanes].float()  # [T, G, 2] (symmetric: [T, G, 1], the scales)
        q = q.reshape(idx.shape[0], -1, self.group).float()
        minv = sm[..., 1:] if self.sym is None else sm[..., :1] * self.sym
        return torch.addcmul(minv, q, sm[..., :1]).reshape(idx.shape[0], -1).to(dtype)


def _words(values: torch.Tensor, width: int) -> torch.Tensor:
    """values int64 [..., W] of `width` bits each -> int32 [...]: value i at bits width * i (the
    unsigned 32-bit word, held in int32)."""
    w = (values << (width * torch.arange(values.shape[-1], dtype=torch.int64))).sum(-1)
    return torch.where(w >= 2 ** 31, w - 2 ** 32, w).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """QuantWeight 4-bit codes uint8 [R, K / 2] (even column in the low nibble) -> [R, K] uint8."""
    r, half = qweight.shape
    out = torch.empty(r, half, 2, dtype=torch.uint8)
    out[..., 0] = qweight & 0xF
    out[..., 1] = qweight >> 4
    return out.view(r, half * 2)


class Int8RowsCPU(PackedWeight):
    """Per-row int8 for torch's `_weight_int8pack_mm`, over inputs scaled per column:

        W[n, k] ~= q[n, k] * scale[n] * col[k]      q int8 [N, K], scale [N], col [K] (powers of two)

    Built from any QuantWeight by dequantizing and re-rounding each row to its own absmax / 127;
    x is multiplied by col (exact: powers of two) before the int8 kernel. col is each input
    column's RMS over the rows, rounded to a power of two, so a few large input channels (Qwen's
    outlier columns) no longer set the step of every row. Lossy: each code moves by at most half
    a row step. On Qwen2.5-Coder-0.5B's Q5_0 matrices the re-rounding adds 5-7% to the noise
    the file's own rounding has (8-11% without col); on Q8_0 / Q6_K it adds 3x, so those take
    Int8SplitCPU (pack_for).
    """

    gemv_max_rows = INT8_ROWS_GEMV_MAX_ROWS

    def __init__(self, qw: QuantWeight, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        n, k = qw.shape
        self.shape = (n, k)
        sumsq = torch.zeros(k)
        for r0 in range(0, n, REQUANT_ROWS):
            sumsq += _slice_rows(qw, r0, min(n, r0 + REQUANT_ROWS)).dequantize().square().sum(0)
        col = torch.exp2(torch.round(torch.log2((sumsq / n).sqrt().clamp_min(COL_SCALE_MIN))))
        q = torch.empty(n, k, dtype=torch.int8)
        s = torch.empty(n, dtype=dtype)
        for r0 in range(0, n, REQUANT_ROWS):
            part = _slice_rows(qw, r0, min(n, r0 + REQUANT_ROWS))
            q[r0:r0 + part.shape[0]], s[r0:r0 + part.shape[0]] = _rows_int8(part.dequantize() / col, dtype)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scale", s, persistent=False)
        self.register_buffer("col", col.to(dtype), persistent=False)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x * self.col, self.q, self.scale)

    def dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        torch.mul(self.q[r0:r1], self.scale[r0:r1, None], out=out)
        out.mul_(self.col)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (self.q[idx] * self.scale[idx, None].float() * self.col.float()).to(dtype)


class Int8SplitCPU(PackedWeight):
    """8-bit codes exactly, as two int4pack halves: with u = q + 128 = 16 hi + lo (hi, lo in 0..15),

        q s + m = ((hi - 8) 16 s + 8 s) + ((lo - 8) s + m)

    so two `_weight_int4pack_mm_for_cpu` calls sum to the weight with the codes untouched (only
    the bf16 rounding of int4pack's scales and zeros: 16 s, 8 s; s, m). The high half is the
    weight to within 8 s, the low half zero-centred, so neither output is a large partial sum
    that the other cancels. 1.25 bytes a weight; the int4 kernel reads a byte ~2x faster than
    `_weight_int8pack_mm` on AVX512-BF16 (module doc), so the split costs about as much time
    as per-row int8 and keeps what the file holds."""

    row_align = INT4PACK_BLOCK_N

    def __init__(self, qw: QuantWeight, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if qw.group not in INT4PACK_GROUPS:
            qw = regroup_int8(qw, INT4PACK_GROUPS[0])
        self.shape = qw.shape
        n, k = qw.shape
        s = qw.scales.float()
        m = qw.mins.float() if qw.mins is not None else torch.zeros_like(s)
        self.hi = Int4PackCPU(qw.group, s * 16, s * INT4_OFFSET, k, dtype)
        self.lo = Int4PackCPU(qw.group, s, m, k, dtype)
        del s, m
        for r0 in range(0, n, PACK_ROWS):
            u = (qw.qweight[r0:r0 + PACK_ROWS].to(torch.int16) + 128).to(torch.uint8)
            self.hi.pack_rows(r0, pack_int4(u >> 4))
            self.lo.pack_rows(r0, pack_int4(u & 0xF))

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.hi.gemv(x).add_(self.lo.gemv(x))

    def dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        self.hi.dequantize_into(r0, r1, out)
        low = torch.empty_like(out)
        self.lo.dequantize_into(r0, r1, low)
        out.add_(low)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.hi.rows(idx, torch.float32).add_(self.lo.rows(idx, torch.float32)).to(dtype)


class QuantRef(PackedWeight):
    """The QuantWeight as it is: dequantized on use (CUDA calls wq_linear on it instead, see QuantLinear)."""

    def __init__(self, qw: QuantWeight) -> None:
        super().__init__()
        self.shape, self.bits, self.group = qw.shape, qw.bits, qw.group
        self.register_buffer("qweight", qw.qweight, persistent=False)
        self.register_buffer("scales", qw.scales, persistent=False)
        self.register_buffer("mins", qw.mins, persistent=False)

    @property
    def qw(self) -> QuantWeight:
        return QuantWeight(self.bits, self.group, self.qweight, self.scales, self.mins)

    def dequantize_into(self, r0: int, r1: int, out: torch.Tensor) -> None:
        out.copy_(_slice_rows(self.qw, r0, r1).dequantize(torch.float32))

    def rows(self, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        qw = self.qw
        sel = (lambda t: None if t is None else t.index_select(0, idx))
        return QuantWeight(qw.bits, qw.group, sel(qw.qweight), sel(qw.scales), sel(qw.mins)).dequantize(dtype)


def padded_rows(n: int) -> int:
    """N rounded up to int4pack's 64-row blocks."""
    return -(-n // INT4PACK_BLOCK_N) * INT4PACK_BLOCK_N


def scales_and_zeros(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 scale, zero [N, K / group] -> int4pack's scales_and_zeros [K / group, Np, 2] in dtype
    (padding rows: scale 0, zero 0)."""
    n, g = scale.shape
    sz = torch.zeros(g, padded_rows(n), 2, dtype=dtype)
    sz[:, :n, 0] = scale.t()
    sz[:, :n, 1] = zero.t()
    return sz


def regroup_int8(qw: QuantWeight, group: int) -> QuantWeight:
    """An 8-bit QuantWeight of a finer group (GGUF's K-quants: 16) re-rounded to `group`-wide 8-bit
    groups (quantize_rtn, REQUANT_ROWS rows at a time): each code moves by at most half a step of
    the coarser scale, amax / 127 of the group, an eighth of a Q6_K step or less."""
    from kvtier.layers.qweight import quantize_rtn

    n, k = qw.shape
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // group, dtype=qw.scales.dtype)
    for r0 in range(0, n, REQUANT_ROWS):
        part = quantize_rtn(_slice_rows(qw, r0, min(n, r0 + REQUANT_ROWS)).dequantize(), 8, group)
        codes[r0:r0 + part.shape[0]], scales[r0:r0 + part.shape[0]] = part.qweight, part.scales
    return QuantWeight(8, group, codes, scales, None)


def int4pack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """QuantWeight 4-bit codes uint8 [R, K / 2] (column 2j low nibble) -> torch's CPU int4pack bytes
    [Rp, K / 2] (Rp = R rounded up to 64, zero rows pad): byte (b, k, d) of the [Rp / 64, K, 32]
    view holds row 64 b + d of column k low and row 64 b + 32 + d high (what
    `torch._convert_weight_to_int4pack_for_cpu(codes, 1)` makes from int32 codes; tested equal)."""
    r, half = qweight.shape
    rp = -(-r // INT4PACK_BLOCK_N) * INT4PACK_BLOCK_N
    codes = torch.zeros(rp, half * 2, dtype=torch.uint8)
    codes[:r, 0::2] = qweight & 0xF
    codes[:r, 1::2] = qweight >> 4
    blocks = codes.view(rp // INT4PACK_BLOCK_N, 2, INT4PACK_BLOCK_N // 2, half * 2)  # [B, lo/hi, 32, K]
    out = (blocks[:, 0] | (blocks[:, 1] << 4)).transpose(1, 2).contiguous()  # [B, K, 32]
    return out.view(rp, half)


def _slice_rows(qw: QuantWeight, r0: int, r1: int) -> QuantWeight:
    return QuantWeight(qw.bits, qw.group, qw.qweight[r0:r1], qw.scales[r0:r1],
                       None if qw.mins is None else qw.mins[r0:r1])


def _rows_int8(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w fp32 [R, K] -> (q int8 [R, K], scale [R] in dtype): absmax / 127 per row, rounded to dtype
    before the codes are chosen, so the codes fit the scale the kernel multiplies by."""
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax)).to(dtype)
    q = torch.round(w / scale.float()[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def fits_5_bits(qw: QuantWeight) -> bool:
    """8-bit codes that hold 5 bits (GGUF Q5_0, -16..15): re-rounded per row to 127 levels."""
    return qw.bits == 8 and int(qw.qweight.amin()) >= -16 and int(qw.qweight.amax()) <= 15


def pack_for(qw: QuantWeight, dtype: torch.dtype, exact_codes: bool = False) -> PackedWeight:
    """The packing a QuantWeight on qw.device multiplies fastest in, computing in dtype (module doc).

    8-bit codes stay exact (Int8SplitCPU) unless they hold only 5 bits (GGUF Q5_0): per-row int8
    (Int8RowsCPU) adds 5-7% to the file's own rounding noise there at half the kernel time, where
    on Q8_0 / Q6_K codes it adds 3x (Qwen2.5-Coder-0.5B, mean KL to the fp32 reference: 1.0e-3
    with Q5_0 per row, 5.3e-4 all split, 1.7e-3 all per row; decode equal, tests/models/
    test_cpu_int8_decode.py). exact_codes: split whatever the codes (the lm_head, whose rows
    Decoder recomputes exactly for the top logits).
    """
    if qw.device.type != "cpu" or dtype != torch.bfloat16:
        return QuantRef(qw)
    has_int4 = hasattr(torch, "_weight_int4pack_mm_for_cpu")
    has_int8 = hasattr(torch, "_weight_int8pack_mm")
    packed = VNNIWeight.for_qweight(qw)  # every code as the file has it
    if packed is not None:
        return packed
    if qw.bits == 4 and has_int4 and qw.group in INT4PACK_GROUPS:
        return Int4PackCPU.from_qweight(qw, dtype)
    if qw.bits == 8 and has_int4 and (exact_codes or not fits_5_bits(qw) or not has_int8):
        return Int8SplitCPU(qw, dtype)
    if has_int8:
        return Int8RowsCPU(qw, dtype)
    return QuantRef(qw)


class QuantLinear(torch.nn.Module):
    """y = x @ W^T + b with W a QuantWeight [N, K], held once in its device's packing (module doc)."""

    def __init__(self, qw: QuantWeight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                 scratch: Scratch | None = None, exact_codes: bool = False) -> None:
        super().__init__()
        self.shape = qw.shape
        self.dtype = dtype
        self.weight = pack_for(qw, dtype, exact_codes)
        self.bias = None if bias is None else torch.nn.Parameter(bias.to(dtype).contiguous(), requires_grad=False)
        self.scratch = scratch or Scratch()
        self.on_cuda = qw.device.type == "cuda"

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] (+ residual [T, N], in x's dtype or the CPU fp32 stream's) -> [T, N] in residual's dtype"""
        if self.on_cuda:
            from kvtier.kernels.wq_matmul import wq_linear  # written alongside; CUDA only
            return wq_linear(x, self.weight.qw, self.bias, residual)
        small = x.shape[0] <= self.weight.gemv_max_rows
        if small and residual is not None and self.bias is None:
            y = self.weight.gemv_add(x, residual)  # the residual add inside the kernel's call, where it has one
            if y is not None:
                return y
        y = self.weight.gemv(x) if small else None
        if y is None:
            y = self._dense_matmul(x)
        if self.bias is not None:
            y = y.add_(self.bias)
        if residual is None:
            return y
        return y.add_(residual) if residual.dtype == y.dtype else residual + y

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual [T, N] + x [T, K] @ W^T (+ b)."""
        return self.forward(x, residual)

    def _dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize CPU_SCRATCH_ELEMS weights at a time into the shared scratch, dense GEMM each."""
        n, k = self.shape
        align = self.weight.row_align
        step = max(align, CPU_SCRATCH_ELEMS // k // align * align)
        if step >= n:
            w = self.scratch.get(n, k, x.dtype, x.device)
            self.weight.dequantize_into(0, n, w)
            return F.linear(x, w)
        out = x.new_empty(x.shape[0], n)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            w = self.scratch.get(r1 - r0, k, x.dtype, x.device)
            self.weight.dequantize_into(r0, r1, w)
            out[:, r0:r1] = F.linear(x, w)
        return out

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Dense rows [T, K] of W (a tied embedding's lookup)."""
        return self.weight.rows(idx, self.dtype)

    def decode_bytes(self) -> int:
        """Bytes one small-batch step reads: the packed weight and the bias."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.nbytes() + bias


class FusedParts(torch.nn.Module):
    """Projections of one input that cannot share one matmul (their formats differ): each part runs
    on its own and the outputs are concatenated, in the order given."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = self.forward(x)
        return y.add_(residual) if residual.dtype == y.dtype else residual + y

    def decode_bytes(self) -> int:
        return sum(p.decode_bytes() for p in self.parts)


def make_linear(weights: list[torch.Tensor | QuantWeight], biases: list[torch.Tensor] | None,
                dtype: torch.dtype, scratch: Scratch | None = None, exact_codes: bool = False) -> torch.nn.Module:
    """One layer computing the stacked projections `weights` (each [N_i, K]) of one input.

    Dense tensors -> Linear / FusedLinear; QuantWeights of one bits and group -> one QuantLinear
    over their rows stacked; otherwise runs of like parts behind FusedParts.
    """
    from kvtier.layers.linear import FusedLinear, Linear

    def kind(w: torch.Tensor | QuantWeight) -> tuple:
        return ("q", w.bits, w.group) if isinstance(w, QuantWeight) else ("dense",)

    runs: list[tuple[tuple, list[int]]] = []
    for i, w in enumerate(weights):
        if runs and runs[-1][0] == kind(w):
            runs[-1][1].append(i)
        else:
            runs.append((kind(w), [i]))
    layers = []
    for k, idx in runs:
        ws = [weights[i] for i in idx]
        bs = None if biases is None else [biases[i] for i in idx]
        if k[0] == "dense":
            layers.append(Linear(ws[0], bs[0] if bs else None) if len(ws) == 1 else FusedLinear(ws, bs))
        else:
            qw = ws[0] if len(ws) == 1 else cat_rows(ws)
            layers.append(QuantLinear(qw, None if bs is None else torch.cat(bs), dtype, scratch, exact_codes))
    return layers[0] if len(layers) == 1 else FusedParts(layers)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """QuantWeights of one K, bits and group stacked along N (a fused qkv / gate_up)."""
    first = parts[0]
    if any(p.bits != first.bits or p.group != first.group or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("cat_rows: parts must share bits, group and K")
    mins = None
    if any(p.mins is not None for p in parts):  # a symmetric part gets zero mins
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
    return QuantWeight(first.bits, first.group, torch.cat([p.qweight for p in parts]),
                       torch.cat([p.scales for p in parts]), mins)
