"""Weight-only quantized matmul: y = x @ dequant(W)^T (+ bias) (+ residual) for the QuantWeight layout.

    x [M, K] bf16 / fp16 / fp32,  W: QuantWeight [N, K] (bits 4 or 8, group 16..128, mins or not)
    -> y [M, N] in x.dtype; fp32 accumulation, one rounding at the end (as the reference).

Four paths, chosen by M (`wq_linear`):

    M <= GEMV_MAX_M     `wq_gemv` (kvtier/kernels/wq_kernels.py), 4-bit weights (GEMV_BITS): decode on CUDA cores in fp16
                        pairs: 16-bit x, codes read as 16-byte chunks, x of a program's K slice
                        converted once to fp16 pairs and reused over all its rows; codes become
                        fp16 by LOP3/PRMT under an exponent of 1024 (no conversion instruction) and
                        are multiply-summed two at a time (HFMA2), fp32 per chunk. One x row per
                        program, grid x row fastest (M programs share a row block's codes in L2).
    M <= SKINNY_MAX_M   `wq_skinny`: decode (fp32 x and 4-bit groups of 16 at any M <= 32). Reads every code byte once; bandwidth-bound.
                        grid (cdiv(N, BLOCK_N), split_k, cdiv(M, BLOCK_M)); a program owns
                        BLOCK_N rows of W, K / split_k of K, BLOCK_M rows of x:
                            rows of W:  | prog 0 | prog 1 | ...            (axis 0)
                            K:          | split 0 | split 1 | ...          (axis 1)
                        split_k > 1 writes fp32 partials [split_k, M, N], summed in a fixed
                        order by `_reduce_kernel` (deterministic, no atomics), which also runs
                        the epilogue. Inner product on CUDA cores (M <= FMA_MAX_M: one row of
                        x per program, each code unpacked and multiply-summed in registers) or on
                        tensor cores with W's rows as the MMA's M side (swap-AB: the codes tile
                        [BLOCK_N, BLOCK_K] is the A operand, x^T [BLOCK_K, 16 or 32] the B one,
                        so M = 1..32 pads to an n16/n32 tile, not to 64 rows of x).
    M < DEQUANT_MIN_M   `wq_gemm`: a tiled GEMM that dequantizes each [BLOCK_N, BLOCK_K] weight
                        tile in registers and feeds it to tl.dot (the mixed-precision pattern).
    M >= DEQUANT_MIN_M  `wq_dequant_matmul`: dequantize W into a scratch [chunk, K] in x.dtype
                        (`_dequant_kernel`), then cuBLAS; the extra ~2 + 2 bytes a weight are
                        small against 2 M flops a weight once M is large.

Tricks behind switches (SkinnyConfig) so tools/sweep_wq.py can time each:
  * group_scale: sum_k x_k (q_k s + m) = s sum_k x_k q_k + m sum_k x_k; the scale and min are
    applied once per group to the partial sums (sum x per group computed once per program),
    not once per weight.
  * words: 4-bit / 8-bit codes loaded as int32 words (8 / 4 codes a load) and unpacked with
    shifts and masks, vs bytes.
  * cvt, how codes become floats: "cvt" (cvt.rn.f32.s32: 16/clk/SM on sm_90, too few for 4-bit
    codes at full bandwidth); "magic": OR the code into the mantissa of 2^23 and subtract 2^23
    (LOP + FADD, exact); "unit": the code u (c + 128 for 8-bit) shifted into the top mantissa bits
    of 1.0, f = 1 + u / 2^bits (SHF + LOP, no FADD), the 1 and the bias folded into each group's
    scale and min: c s + m = f 2^bits s + (m - (2^bits + bias) s), and with group_scale
    sum_k x_k c_k = 2^bits sum_k x_k f_k - (2^bits + bias) sum_k x_k. Not with use_dot and
    group_scale (1 + u / 256 is not exact in bf16).

  * prefetch: the next iteration's codes, scales (and x) are loaded before this iteration's math
    (Triton's pipeliner only streams loads that feed tl.dot directly).

Why the defaults (static SASS counts of the main loop from offline sm_90 builds, Triton 3.9 +
ptxas, nvdisasm; instructions per thread over the codes it handles, not measurements):

    path                         instr / weight   instr / code byte   registers, spills
    skinny fma ("unit", 4-bit)   ~5.5             ~11                 123, none
    skinny dot (wgmma, 4-bit)    ~6.7             ~13
    gemv 4-bit (half2)           2.56 (328 / 128)  5.1                128, none (x: 64 of them)
    gemv 8-bit (half2)           3.95 (253 / 64)   3.95               88, none

An H200 issues 132 SMs x 4 schedulers x ~1.9 GHz ~ 1.0e12 warp instructions/s; reading 4 TB/s
with one instruction per 32 lanes costs instr_per_byte / 32 * 4e12 issue slots a second: ~11 a
byte (the old fma path) needs ~140% of the SMs' issue rate (the measured 31-55% of bandwidth at
M = 1), 5.1 needs ~64%, 3.95 ~50%. Of gemv's 4-bit loop, 224 of 328 are the 4 chunks' PTX (per
8 codes: SHF + 4 LOP3 + 4 de-bias HADD2/HFMA2 + 4 HFMA2), the rest loads (4 LDG.E.128 + 8
LDG.E.U16 of scales and mins), addresses, the per-chunk scale/min FFMAs and the row's lane
reduction (5 SHFL). Each x row costs the same again, so M = 4 is ~20 a byte (4-bit): the
tensor-core path takes M > GEMV_MAX_M. The sweep (tools/sweep_wq.py) times all of them.

Every launch depends on shapes only and reads nothing back on the host: CUDA-graph capturable.
`wq_linear_reference` is the plain-PyTorch definition (fp32 dequantize + matmul) that CPU runs
and every kernel is tested against (tests/layers/wq_matmul_cases.py, tests/gpu/test_wq_matmul.py).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from kvtier.kernels import pdl
from kvtier.layers.qweight import QuantWeight

try:
    import triton
    import triton.language as tl
    from kvtier.kernels.pdl import wait_before_reads
    from kvtier.kernels.wq_kernels import _epilogue, _gemv_kernel
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: the reference path only
    HAVE_TRITON = False

# Rows of x up to which the skinny kernel runs: batch-32 decode reads W once for all 32 rows
# in one m32 tile; above it the GEMM's 64+ row tiles reuse W better.
SKINNY_MAX_M = 32
# Rows of x up to which `wq_gemv` (half2 CUDA cores, one x row per program, the M programs of a row
# block sharing its codes through L2) runs: each row costs ~2.6 (4-bit) / ~4 (8-bit) SASS
# instructions a code byte (static count of its loop), so 4 rows is ~10-16 a byte, about what the
# SMs issue at full bandwidth; larger M takes the tensor-core skinny path.
GEMV_MAX_M = 4
# Weight bits `wq_linear` sends to the gemv. 8-bit weights take the skinny kernel at every M <= 32:
# H100 (tools/sweep_wq.py, the five Qwen3-8B layers at 8 bits, us a call summed): M = 1 gemv 350
# against skinny fma 311, M = 2 591 / 481, M = 4 1,153 / 442; the int8 engine at 1K (bench
# qwen3-8b-int8, same machine) 214.8 / 215.4 tok/s with the gemv, 230.5 (65% of the bound) without.
GEMV_BITS = (4,)
# Programs `choose_gemv_block_n` aims at per SM (x is converted once per program: fewer, longer
# programs waste less of it; small layers need the parallelism).
GEMV_PROGRAMS_PER_SM = 2
# Rows of W per gemv program at most (an x slice converted once serves them all), and at least
# (H100, 4-bit, vector_x: o_proj 4096 x 4096 at M = 1 10.7 us with 8-row programs, 8.4 with 16).
GEMV_MAX_BLOCK_N = 64
GEMV_MIN_BLOCK_N = 16
# Rows of x up to which the skinny kernel multiply-sums on CUDA cores by default: each extra
# row adds an FMA per weight to ~5 ALU ops of unpacking, while the tensor-core path pads x to
# 16 rows for free; 1 until the sweep says otherwise.
FMA_MAX_M = 1
# Rows of x from which dequantize-then-cuBLAS beats the fused GEMM: dequantizing reads 0.5-1 and
# writes 2 bytes a weight (~15 us for a 4096 x 4096 layer on an H200), noise against a cuBLAS
# GEMM of 2 * 1024 * N * K flops, while the fused GEMM's register dequant costs every M tile.
DEQUANT_MIN_M = 1024
# Dense scratch of wq_dequant_matmul at most this many elements (256 MiB of bf16): bigger
# weights (lm_head, 151936 x 4096) are dequantized and multiplied in row chunks.
DEQUANT_MAX_ELEMS = 1 << 27
# Codes tile of the dequantize kernel: [64 rows, 256 columns], 8 warps.
DEQUANT_BLOCK = (64, 256, 8)
# Split-K: aim at this many programs per SM (several resident programs hide load latency),
SPLIT_PROGRAMS_PER_SM = 4
# ... with every split at least this many columns (two 256-wide iterations) ...
MIN_SPLIT_K = 512
# ... and the fp32 partials (written + read) at most this share of the weight bytes.
PARTIAL_BUDGET = 0.1
# Columns of the split-K reduce program.
REDUCE_BLOCK = 1024
# Smallest operand side Triton's tl.dot takes.
MIN_DOT = 16
# Rows of x per program of the CUDA-core path: one, so that every tensor is 2-D [BLOCK_N, ...] in the
# codes' layout (offline sm_90 builds with a [BLOCK_M, BLOCK_N, BLOCK_K] product put K across lanes
# and shuffled/converted the whole tile every iteration). More rows take the tensor-core path.
MAX_FMA_BLOCK_M = 1
# fp32 x: three tf32 tensor-core products (about fp32 accuracy; "ieee" FMA dots of 128 x 128 GEMM
# tiles need far more registers). 16-bit x: ignored by tl.dot.
FP32_DOT = "tf32x3"
# Programs per SM assumed off CUDA (the interpreter), so split-K has a capacity to aim at.
INTERPRETER_SMS = 2
# The Triton interpreter runs no inline PTX: `wq_gemv` then computes its sums in plain Triton.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of `wq_skinny` (block_k: codes a program iteration reads per row)."""

    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False  # tensor cores (swap-AB tl.dot) vs CUDA-core multiply-sum
    group_scale: bool = True  # scale/min per group after the partial sum (see module docstring)
    words: bool = True  # codes loaded as int32 words
    cvt: str = "unit"  # codes -> floats: "cvt", "magic" or "unit" (module docstring)
    prefetch: bool = True  # issue the next iteration's loads before this one's math (by hand:
    # Triton's pipeliner only streams loads that feed tl.dot directly, not codes that are unpacked)
    split_k: int = 0  # 0: `choose_split_k`
    # Programmatic dependent launch (kernels/pdl.py), with the reduce kernel after a split: a
    # program loads its first codes and groups (PREFETCH) before waiting for the kernel before.
    # Off until timed (8-bit weights took this kernel at M = 1 in the seventeenth session).
    pdl: bool = False


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters of `wq_gemm` (group_m: M tiles walked per N tile, for L2 reuse of W)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    words: bool = False
    cvt: str = "unit"  # "cvt", "magic" or "unit" (module docstring)


@dataclass(frozen=True)
class GemvConfig:
    """Launch parameters of `wq_gemv` (kvtier/kernels/wq_kernels.py): block_n rows of W per program
    (0: `choose_gemv_block_n`), `rows` per loop step (one per warp), K slice = chunks (per thread,
    a power of two) x lanes x 16-byte chunks; fewer chunks: more K splits."""

    block_n: int = 0
    lanes: int = 32
    chunks: int = 4
    num_warps: int = 4
    prefetch: bool = True
    # x of the slice loaded a word (16 bytes) at a time, each warp its own copy, and paired in
    # registers, instead of one 2-byte load a value and a second load for the chunk sums. Offline
    # sm_90 build, 4-bit, 4 chunks: the program's prologue 398 -> 382 instructions (no 2-byte x loads;
    # the 33 barriers of the x pairs' layout conversions stay), its loop 328 a 4-row step either way.
    # H100, 4-bit Qwen3-8B layers at M = 1 (tools/scratch gemv_diag, CUDA-graph replay): the four
    # layers 75.5 -> 67.7 us (55% -> 62% of the bandwidth): qkv 12.5 -> 10.2, o_proj 12.2 -> 10.7,
    # gate_up 30.0 -> 28.4, down 20.8 -> 18.5. (Two or four rows a warp a step at 2 or 1 chunks, 72 / 64
    # registers instead of 128, were slower: 79.2 / 95.3 us; occupancy does not bound this kernel.)
    # The 8-bit kernel lost with it: the same layers at 8 bits 100.4 -> 102.9 us (70% -> 68%), so
    # None (the default) means on for 4-bit weights and off for 8-bit ones.
    vector_x: bool | None = None
    # Programmatic dependent launch (kernels/pdl.py): a program loads its first rows' codes before
    # waiting for the kernel before it, whose tail it overlaps. H100, 36 Qwen3-8B layers of norm,
    # GEMVs and SiLU in one graph (tools/pdl_chain.py), M = 1: 4-bit 2,629 -> 2,422 us with the
    # chain's kernels launched so; 8-bit 3,914 -> 4,462 us (and the int8 engine 214.6 -> 189.6 tok/s),
    # 3,970 with every kernel but the GEMV launched so. None (the default): pdl.ENABLED for 4-bit
    # weights, off for 8-bit ones.
    pdl: bool | None = None


# Defaults by regime (to be replaced by the sweep's winners, tools/sweep_wq.py).
FMA_CONFIG = SkinnyConfig()
# Tensor-core path: [64, 128] code tiles keep it near 128 registers (sm_90 offline build, M = 32:
# 256 columns took all 255 registers, i.e. half the resident programs).
DOT_CONFIG = SkinnyConfig(block_n=64, block_k=128, use_dot=True, group_scale=False)
# SkinnyConfig/GemmConfig.cvt -> the kernels' CVT constexpr.
CVT_MODES = {"cvt": 0, "magic": 1, "unit": 2}
GEMM_CONFIG = GemmConfig()
# Half2 CUDA-core decode (M <= GEMV_MAX_M): 4 chunks a thread hold 4 x 16 fp16 pairs of x (64
# registers; 128 registers in all, no spills, offline sm_90 build); 8-bit chunks are 16 codes.
GEMV_CONFIG = GemvConfig()


# ---------------------------------------------------------------- plain-PyTorch reference

def wq_linear_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w)^T [K, N] (+ bias [N]) (+ residual [M, N]) -> [M, N] in x.dtype, all in fp32."""
    _check(x, w, bias, residual)
    y = x.float() @ w.dequantize(torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def _check(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or not x.dtype.is_floating_point:
        raise ValueError(f"wq_linear: x must be a float [M, {k}] tensor, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"wq_linear: bias must be [{n}], got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (x.shape[0], n):
        raise ValueError(f"wq_linear: residual must be [{x.shape[0]}, {n}], got {tuple(residual.shape)}")


# ---------------------------------------------------------------- dispatch

def kernel_supports(w: QuantWeight) -> bool:
    """Groups the kernels tile: powers of two from 16 (tl.dot's smallest K)."""
    return w.group >= MIN_DOT and w.group & (w.group - 1) == 0


def wq_linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(w)^T (+ bias [N]) (+ residual [M, N]) -> [M, N] in x.dtype.

    Triton kernels on CUDA (the path by M: module docstring); the reference anywhere else and
    for groups the kernels do not tile. `residual` is added in the kernel's epilogue (the
    decoder's h + o_proj(attn)).
    """
    _check(x, w, bias, residual)
    if not (HAVE_TRITON and x.is_cuda and w.device == x.device and kernel_supports(w)):
        return wq_linear_reference(x, w, bias, residual)
    m = x.shape[0]
    if m <= GEMV_MAX_M and w.bits in GEMV_BITS and gemv_supports(x, w):
        return wq_gemv(x, w, bias, residual, GEMV_CONFIG)
    if m <= SKINNY_MAX_M:
        return wq_skinny(x, w, bias, residual, FMA_CONFIG if m <= FMA_MAX_M else DOT_CONFIG)
    if m < DEQUANT_MIN_M:
        return wq_gemm(x, w, bias, residual, GEMM_CONFIG)
    return wq_dequant_matmul(x, w, bias, residual)


# ---------------------------------------------------------------- Triton kernels

if HAVE_TRITON:
    @triton.jit
    def _to_float(u, BITS: tl.constexpr, CVT: tl.constexpr):
        """Biased codes u (uint32; `_unpack`) -> fp32.

        CVT 0: the code c = u - bias by a cvt instruction; 1: c exactly by 2^23 + u as bits minus
        2^23 + bias; 2: 1 + u / 2^BITS ("unit": the caller removes the 1 and the bias per group).
        """
        bias: tl.constexpr = 0.0 if BITS == 4 else 128.0
        if CVT == 1:
            f = (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)
        elif CVT == 2:  # u arrives already shifted to the top mantissa bits (`_unpack` AT = 23 - BITS)
            f = (u | 0x3F800000).to(tl.float32, bitcast=True)
        else:
            f = u.to(tl.float32) - bias
        return f

    @triton.jit
    def _load_codes(q_ptr, rows, k0, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr):
        """The stored codes of W rows `rows` [R] (int64), columns k0 .. k0 + BLOCK_K, as loaded:
        uint32 words [R, BLOCK_K / (8 | 4)] (WORDS) or bytes [R, BLOCK_K / (2 | 1)].

        q_ptr: uint8 [N, K/2] / int8 [N, K], or the same memory as int32 (WORDS). K and k0 must be
        whole multiples of BLOCK_K (the loads are declared aligned to it: 16-byte vector loads).
        """
        per: tl.constexpr = (8 if BITS == 4 else 4) if WORDS else (2 if BITS == 4 else 1)  # codes per element
        base = tl.multiple_of(rows[:, None] * (K // per) + k0 // per, [BLOCK_K // per, BLOCK_K // per])
        raw = tl.load(q_ptr + base + tl.arange(0, BLOCK_K // per)[None, :])
        if WORDS:
            raw = raw.to(tl.uint32, bitcast=True)
        elif BITS == 8:
            raw = raw.to(tl.uint8, bitcast=True)
        return raw

    @triton.jit
    def _field(raw, FROM: tl.constexpr, WIDTH: tl.constexpr, TO: tl.constexpr):
        """Bits FROM .. FROM + WIDTH of uint32 `raw`, moved to bits TO .. TO + WIDTH (one shift + one mask)."""
        if TO >= FROM:
            v = raw << (TO - FROM)
        else:
            v = raw >> (FROM - TO)
        return v & (((1 << WIDTH) - 1) << TO)

    @triton.jit
    def _unpack(raw, BITS: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
                AT: tl.constexpr):
        """`_load_codes` output -> biased codes u << AT, uint32 [R, BLOCK_K]: 4-bit u = c (0..15);
        8-bit u = c + 128, the byte with its top bit flipped (0..255). AT: the bit the code lands
        on (`_to_float`'s "unit" wants it at the top of the fp32 mantissa). A little-endian word
        holds columns 8j .. 8j+7 (4-bit, nibble i at bits 4i) or 4j .. 4j+3 (8-bit, byte i at bits
        8i); the joins put them back in column order."""
        if BITS == 4:
            if WORDS:
                n0 = _field(raw, 0, 4, AT)
                n1 = _field(raw, 4, 4, AT)
                n2 = _field(raw, 8, 4, AT)
                n3 = _field(raw, 12, 4, AT)
                n4 = _field(raw, 16, 4, AT)
                n5 = _field(raw, 20, 4, AT)
                n6 = _field(raw, 24, 4, AT)
                n7 = _field(raw, 28, 4, AT)
                # index [.., a, b, c] of the nested joins is column 4a + 2b + c of the word
                t0 = tl.join(tl.join(n0, n4), tl.join(n2, n6))
                t1 = tl.join(tl.join(n1, n5), tl.join(n3, n7))
                u = tl.reshape(tl.join(t0, t1), (R, BLOCK_K))
            else:
                b = raw.to(tl.uint32)
                u = tl.reshape(tl.join(_field(b, 0, 4, AT), _field(b, 4, 4, AT)), (R, BLOCK_K))
        else:
            if WORDS:
                wd = raw ^ 0x80808080  # every byte + 128
                # index [.., a, c] is column 2a + c
                t0 = tl.join(_field(wd, 0, 8, AT), _field(wd, 16, 8, AT))
                t1 = tl.join(_field(wd, 8, 8, AT), _field(wd, 24, 8, AT))
                u = tl.reshape(tl.join(t0, t1), (R, BLOCK_K))
            else:
                u = (raw.to(tl.uint32) ^ 0x80) << AT
        return u

    @triton.jit
    def _codes_f32(raw, BITS: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
                   CVT: tl.constexpr):
        """`_load_codes` output -> fp32 [R, BLOCK_K] by `_to_float` (the "unit" shift done in the unpack)."""
        if CVT == 2:
            return _to_float(_unpack(raw, BITS, R, BLOCK_K, WORDS, 23 - BITS), BITS, CVT)
        else:
            return _to_float(_unpack(raw, BITS, R, BLOCK_K, WORDS, 0), BITS, CVT)

    @triton.jit
    def _load_groups(s_ptr, mn_ptr, rows, k0, K, GROUP: tl.constexpr, GPI: tl.constexpr,
                     HAS_MINS: tl.constexpr):
        """Scales and mins [R, GPI] (fp16, as stored) of the GPI groups from column k0 (mins: the
        scales again without HAS_MINS, unused)."""
        offs = rows[:, None] * (K // GROUP) + k0 // GROUP + tl.arange(0, GPI)[None, :]
        sc = tl.load(s_ptr + offs)
        if HAS_MINS:
            mn = tl.load(mn_ptr + offs)
        else:
            mn = sc
        return sc, mn

    @triton.jit
    def _apply_groups(q, sc, mn, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr,
                      CVT: tl.constexpr):
        """`_to_float` codes q [R, BLOCK_K] -> weights code * scale + min, fp32, per group
        (sc, mn [R, BLOCK_K / GROUP]). CVT 2 (q = 1 + u / 2^B): q * 2^B s + (min - (2^B + bias) s)."""
        R: tl.constexpr = q.shape[0]
        BLOCK_K: tl.constexpr = q.shape[1]
        GPI: tl.constexpr = BLOCK_K // GROUP
        scf = sc.to(tl.float32)
        if CVT == 2:
            unit: tl.constexpr = 2.0 ** BITS
            bias: tl.constexpr = 0.0 if BITS == 4 else 128.0
            mnf = mn.to(tl.float32) if HAS_MINS else 0.0
            w = tl.reshape(q, (R, GPI, GROUP)) * (scf * unit)[:, :, None] + (mnf - scf * (unit + bias))[:, :, None]
        elif HAS_MINS:
            w = tl.reshape(q, (R, GPI, GROUP)) * scf[:, :, None] + mn.to(tl.float32)[:, :, None]
        else:
            w = tl.reshape(q, (R, GPI, GROUP)) * scf[:, :, None]
        return tl.reshape(w, (R, BLOCK_K))

    @triton.jit
    def _dequant(q_ptr, s_ptr, mn_ptr, rows, k0, K, BITS: tl.constexpr, GROUP: tl.constexpr,
                 HAS_MINS: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr, WORDS: tl.constexpr,
                 CVT: tl.constexpr):
        """W[rows, k0 .. k0 + BLOCK_K] = code * scale + min: fp32 [R, BLOCK_K]."""
        q = _codes_f32(_load_codes(q_ptr, rows, k0, K, BITS, BLOCK_K, WORDS), BITS, R, BLOCK_K, WORDS, CVT)
        sc, mn = _load_groups(s_ptr, mn_ptr, rows, k0, K, GROUP, BLOCK_K // GROUP, HAS_MINS)
        return _apply_groups(q, sc, mn, BITS, GROUP, HAS_MINS, CVT)

    @triton.jit(do_not_specialize=["M", "split_len"])
    def _skinny_kernel(x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, r_ptr, y_ptr, p_ptr, M, N, K, split_len,
                       stride_xm, stride_rm, BITS: tl.constexpr, GROUP: tl.constexpr,
                       HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                       PARTIAL: tl.constexpr, USE_DOT: tl.constexpr, GROUP_SCALE: tl.constexpr,
                       WORDS: tl.constexpr, CVT: tl.constexpr, PREFETCH: tl.constexpr,
                       DOT_PREC: tl.constexpr, PDL: tl.constexpr = False):
        """Program (n block, K split, m block): acc[n, m] = sum over the split's K of W[n, k] x[m, k].
        PDL: kernels/pdl.py, the first codes (weights) loaded before the wait."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        GPI: tl.constexpr = BLOCK_K // GROUP  # groups per iteration
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.minimum(n, N - 1).to(tl.int64)  # tail rows/columns re-read the last one;
        xrow = tl.minimum(m, M - 1).to(tl.int64) * stride_xm  # the stores mask them out
        if USE_DOT:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        elif GROUP_SCALE:  # CUDA cores (BLOCK_M == 1): per-group partials, summed after the loop
            acc = tl.zeros([BLOCK_N, GPI], tl.float32)
        else:  # CUDA cores (BLOCK_M == 1): per-element partials, summed after the loop
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        k_lo = tl.multiple_of(pid_k * split_len, BLOCK_K)
        k_last = tl.multiple_of(k_lo + split_len - BLOCK_K, BLOCK_K)
        x1 = x_ptr + tl.minimum(pid_m, M - 1).to(tl.int64) * stride_xm  # the CUDA-core path's one row
        if PREFETCH:  # registers hold the next iteration's loads while this one computes
            raw = _load_codes(q_ptr, rows, k_lo, K, BITS, BLOCK_K, WORDS)
            sc, mn = _load_groups(s_ptr, mn_ptr, rows, k_lo, K, GROUP, GPI, HAS_MINS)
        wait_before_reads(PDL)  # x, the residual, the outputs: after the kernel before
        if PREFETCH:
            if not USE_DOT:
                xr = tl.load(x1 + k_lo + tl.arange(0, BLOCK_K))
        for k0 in range(k_lo, k_lo + split_len, BLOCK_K):
            k0 = tl.multiple_of(k0, BLOCK_K)  # aligned: vector loads of codes and x
            kk = k0 + tl.arange(0, BLOCK_K)
            if PREFETCH:
                raw_c, sc_c, mn_c = raw, sc, mn
                k_next = tl.multiple_of(tl.minimum(k0 + BLOCK_K, k_last), BLOCK_K)  # the last re-reads itself
                raw = _load_codes(q_ptr, rows, k_next, K, BITS, BLOCK_K, WORDS)
                sc, mn = _load_groups(s_ptr, mn_ptr, rows, k_next, K, GROUP, GPI, HAS_MINS)
                if not USE_DOT:
                    xr_c = xr
                    xr = tl.load(x1 + k_next + tl.arange(0, BLOCK_K))
            else:
                raw_c = _load_codes(q_ptr, rows, k0, K, BITS, BLOCK_K, WORDS)
                sc_c, mn_c = _load_groups(s_ptr, mn_ptr, rows, k0, K, GROUP, GPI, HAS_MINS)
                if not USE_DOT:
                    xr_c = tl.load(x1 + kk)
            q = _codes_f32(raw_c, BITS, BLOCK_N, BLOCK_K, WORDS, CVT)  # [BN, BK]
            if not GROUP_SCALE:
                w = _apply_groups(q, sc_c, mn_c, BITS, GROUP, HAS_MINS, CVT)  # [BN, BK] fp32
            if USE_DOT:
                xt = tl.load(x_ptr + xrow[None, :] + kk[:, None])  # x^T [BK, BM]
                if GROUP_SCALE:  # one [BN, G] x [G, BM] product per group, then scale it
                    q3 = tl.permute(tl.reshape(q, (BLOCK_N, GPI, GROUP)), (1, 0, 2)).to(xt.dtype)
                    x3 = tl.reshape(xt, (GPI, GROUP, BLOCK_M))
                    part = tl.dot(q3, x3, input_precision=DOT_PREC) * tl.trans(sc_c.to(tl.float32))[:, :, None]
                    if HAS_MINS:
                        xs = tl.sum(x3.to(tl.float32), axis=1)  # [GPI, BM]
                        part += tl.trans(mn_c.to(tl.float32))[:, :, None] * xs[:, None, :]
                    acc += tl.sum(part, axis=0)
                else:
                    acc = tl.dot(w.to(xt.dtype), xt, acc, input_precision=DOT_PREC)
            else:
                xf = xr_c.to(tl.float32)  # [BK]
                if GROUP_SCALE:
                    x2 = tl.reshape(xf, (GPI, GROUP))
                    part = tl.sum(tl.reshape(q, (BLOCK_N, GPI, GROUP)) * x2[None, :, :], axis=2)  # [BN, GPI]
                    scf = sc_c.to(tl.float32)
                    if CVT == 2:  # part = sum x (1 + u / 2^B): sum x c s = 2^B s part - (2^B + bias) s sum x
                        unit: tl.constexpr = 2.0 ** BITS
                        bias: tl.constexpr = 0.0 if BITS == 4 else 128.0
                        mnf = mn_c.to(tl.float32) if HAS_MINS else 0.0
                        acc += part * (scf * unit) + (mnf - scf * (unit + bias)) * tl.sum(x2, axis=1)[None, :]
                    elif HAS_MINS:
                        acc += part * scf + mn_c.to(tl.float32) * tl.sum(x2, axis=1)[None, :]
                    else:
                        acc += part * scf
                else:
                    acc += w * xf[None, :]  # [BN, BK]
        if not USE_DOT:
            acc = tl.sum(acc, axis=1)[:, None]  # -> [BN, 1]
        mask = (n < N)[:, None] & (m < M)[None, :]
        if PARTIAL:
            tl.store(p_ptr + (pid_k * M + m[None, :]).to(tl.int64) * N + n[:, None], acc, mask=mask)
        else:
            _epilogue(acc, n[:, None], m[None, :], mask, b_ptr, r_ptr, y_ptr, N, stride_rm, HAS_BIAS, HAS_RES)

    @triton.jit(do_not_specialize=["M", "splits"])
    def _reduce_kernel(p_ptr, b_ptr, r_ptr, y_ptr, M, N, splits, stride_rm, HAS_BIAS: tl.constexpr,
                       HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (m, n block): y[m, n] = epilogue(sum over splits s in order of partial[s, m, n])."""
        wait_before_reads(PDL)
        m = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = n < N
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(0, splits):
            acc += tl.load(p_ptr + (s * M + m).to(tl.int64) * N + n, mask=mask, other=0.0)
        _epilogue(acc, n, m, mask, b_ptr, r_ptr, y_ptr, N, stride_rm, HAS_BIAS, HAS_RES)

    @triton.jit(do_not_specialize=["M"])
    def _gemm_kernel(x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, r_ptr, y_ptr, M, N, K, stride_xm, stride_rm,
                     BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, WORDS: tl.constexpr,
                     CVT: tl.constexpr, DOT_PREC: tl.constexpr):
        """Program (M tile, N tile), GROUP_M M tiles walked per N tile: y tile = x tile @ dequant(W tile)^T."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(n, N - 1).to(tl.int64)
        xrow = tl.minimum(m, M - 1).to(tl.int64) * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + xrow[:, None] + (k0 + tl.arange(0, BLOCK_K))[None, :])  # [BM, BK]
            w = _dequant(q_ptr, s_ptr, mn_ptr, rows, k0, K, BITS, GROUP, HAS_MINS, BLOCK_N, BLOCK_K, WORDS,
                         CVT)  # [BN, BK]
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PREC)
        mask = (m < M)[:, None] & (n < N)[None, :]
        _epilogue(acc, n[None, :], m[:, None], mask, b_ptr, r_ptr, y_ptr, N, stride_rm, HAS_BIAS, HAS_RES)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, mn_ptr, out_ptr, row0, rows_out, N, K, BITS: tl.constexpr,
                        GROUP: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, CVT: tl.constexpr):
        """Program (n block, k block): out[r, k] = W[row0 + r, k] for r < rows_out, in out's dtype."""
        r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rows = tl.minimum(row0 + r, N - 1).to(tl.int64)
        w = _dequant(q_ptr, s_ptr, mn_ptr, rows, k0, K, BITS, GROUP, HAS_MINS, BLOCK_N, BLOCK_K, False,
                     CVT)
        dst = out_ptr + r[:, None].to(tl.int64) * K + k0 + tl.arange(0, BLOCK_K)[None, :]
        tl.store(dst, w.to(out_ptr.dtype.element_ty), mask=(r < rows_out)[:, None])


# ---------------------------------------------------------------- launchers

def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def fit_block_k(want: int, k: int, group: int) -> int:
    """The largest block_k <= want (at least one group) made of whole groups that divides K."""
    bk = max(group, _pow2(want))
    while bk > group and k % bk:
        bk //= 2
    return bk


def choose_split_k(m: int, n: int, k: int, bits: int, block_n: int, block_m: int, block_k: int,
                   sms: int) -> int:
    """Splits of K for the skinny kernel: a power of two that brings the programs up to
    SPLIT_PROGRAMS_PER_SM per SM, each split whole block_k iterations and >= MIN_SPLIT_K columns,
    and the fp32 partials (8 bytes per output and split: written, read) within PARTIAL_BUDGET of
    the weight bytes. Shapes only: the same answer eagerly and under a CUDA graph."""
    programs = -(-n // block_n) * -(-m // block_m)
    weight_bytes = n * k * bits / 8
    split = 1
    while (programs * split * 2 <= sms * SPLIT_PROGRAMS_PER_SM and k % (split * 2 * block_k) == 0
           and k // (split * 2) >= MIN_SPLIT_K and 8 * split * 2 * m * n <= PARTIAL_BUDGET * weight_bytes):
        split *= 2
    return split


def _codes_arg(w: QuantWeight, words: bool) -> tuple[torch.Tensor, bool]:
    """The codes as the kernel reads them: int32 words where the rows allow it, else bytes."""
    q = w.qweight
    if words and q.is_contiguous() and q.shape[1] % 4 == 0 and q.storage_offset() % 4 == 0:
        return q.view(torch.int32), True
    return q, False


def _common(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, object]]:
    """Checks; y [M, N] (empty); the constexprs every kernel shares."""
    _check(x, w, bias, residual)
    if not kernel_supports(w):
        raise ValueError(f"wq kernels: group {w.group} is not a power of two >= {MIN_DOT}")
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    return y, dict(BITS=w.bits, GROUP=w.group, HAS_MINS=w.mins is not None, HAS_BIAS=bias is not None,
                   HAS_RES=residual is not None, DOT_PREC=FP32_DOT if x.dtype == torch.float32 else "tf32")


def _operands(x: torch.Tensor, w: QuantWeight, y: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """x, mins, bias, residual as the kernels take them (last dims contiguous; y stands in for
    absent ones, never read) and residual's row stride."""
    x = x if x.stride(-1) == 1 else x.contiguous()
    res = residual if residual is None or residual.stride(-1) == 1 else residual.contiguous()
    return (x, w.mins if w.mins is not None else w.scales, bias if bias is not None else y,
            res if res is not None else y, res.stride(0) if res is not None else 0)


def skinny_block_m(m: int, use_dot: bool) -> int:
    """Rows of x per skinny program: the dot pads to >= 16; the CUDA-core path takes one row."""
    if use_dot:
        return min(max(MIN_DOT, _pow2(m)), SKINNY_MAX_M)
    return min(_pow2(m), MAX_FMA_BLOCK_M)


def wq_skinny(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, cfg: SkinnyConfig = FMA_CONFIG) -> torch.Tensor:
    """The decode kernel (any M works; built for M <= SKINNY_MAX_M). x [M, K] -> [M, N] in x.dtype."""
    y, const = _common(x, w, bias, residual)
    (mrows, n), k = y.shape, w.shape[1]
    if mrows == 0:
        return y
    if cfg.cvt == "unit" and cfg.use_dot and cfg.group_scale:
        raise ValueError("wq_skinny: cvt='unit' codes (1 + u / 2^bits) are not exact in bf16: not with use_dot "
                         "and group_scale")
    block_k = fit_block_k(cfg.block_k, k, w.group)
    block_m = skinny_block_m(mrows, cfg.use_dot)
    split = cfg.split_k or choose_split_k(mrows, n, k, w.bits, cfg.block_n, block_m, block_k, _sm_count(x.device))
    if k % (split * block_k):
        raise ValueError(f"wq_skinny: split_k {split} x block_k {block_k} does not divide K = {k}")
    codes, words = _codes_arg(w, cfg.words)
    x, mins, b, r, stride_rm = _operands(x, w, y, bias, residual)
    part = torch.empty((split, mrows, n), dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(n, cfg.block_n), split, triton.cdiv(mrows, block_m))
    launch = pdl.launch_args(x.device, cfg.pdl)
    _skinny_kernel[grid](x, codes, w.scales, mins, b, r, y, part, mrows, n, k, k // split, x.stride(0), stride_rm,
                         BLOCK_N=cfg.block_n, BLOCK_M=block_m, BLOCK_K=block_k, PARTIAL=split > 1,
                         USE_DOT=cfg.use_dot, GROUP_SCALE=cfg.group_scale, WORDS=words, CVT=CVT_MODES[cfg.cvt],
                         PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **const,
                         **launch)
    if split > 1:
        _reduce_kernel[(mrows, triton.cdiv(n, REDUCE_BLOCK))](
            part, b, r, y, mrows, n, split, stride_rm, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            BLOCK=REDUCE_BLOCK, num_warps=4, **launch)
    return y


def gemv_supports(x: torch.Tensor, w: QuantWeight, lanes: int = 1) -> bool:
    """`wq_gemv` takes: 16-bit x (fp16 pairs of x stand in for it; fp32 x keeps its precision on the
    other paths), 16-byte chunks within one group (4-bit groups >= 32), contiguous 16-byte aligned
    codes, K a whole number of lanes x chunks."""
    chunk = 32 if w.bits == 4 else 16
    q = w.qweight
    return (x.dtype in (torch.float16, torch.bfloat16) and w.group >= chunk and kernel_supports(w)
            and q.is_contiguous() and q.data_ptr() % 16 == 0 and w.shape[1] % (chunk * lanes) == 0)


def gemv_slice(k: int, bits: int, cfg: GemvConfig) -> tuple[int, int]:
    """(lanes, chunks a thread) of `wq_gemv`'s K slice: the configured ones, halved until they divide K."""
    chunk = 32 if bits == 4 else 16
    lanes = min(cfg.lanes, _pow2(k // chunk + 1) // 2)
    while k % (lanes * chunk):
        lanes //= 2
    cpt = cfg.chunks
    while k % (cpt * lanes * chunk):
        cpt //= 2
    return lanes, cpt


def choose_gemv_block_n(m: int, n: int, split: int, rows: int, sms: int) -> int:
    """Rows of W per gemv program: the largest power of two <= GEMV_MAX_BLOCK_N (and >= one step of
    `rows`) that still gives GEMV_PROGRAMS_PER_SM programs per SM. Shapes only (graph-safe)."""
    bn = GEMV_MAX_BLOCK_N
    while bn > max(rows, GEMV_MIN_BLOCK_N) and m * -(-n // bn) * split < GEMV_PROGRAMS_PER_SM * sms:
        bn //= 2
    return max(bn, rows)


def wq_gemv(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, cfg: GemvConfig = GEMV_CONFIG) -> torch.Tensor:
    """Half2 CUDA-core decode (kvtier/kernels/wq_kernels.py); any M works, one x row per program.
    x [M, K] fp16 / bf16 -> [M, N] in x.dtype."""
    y, const = _common(x, w, bias, residual)
    (mrows, n), k = y.shape, w.shape[1]
    if not gemv_supports(x, w):
        raise ValueError(f"wq_gemv: takes fp16/bf16 x, contiguous aligned codes and 4-bit groups >= 32, got "
                         f"{x.dtype}, {w.bits}-bit group {w.group}")
    if mrows == 0:
        return y
    lanes, cpt = gemv_slice(k, w.bits, cfg)
    split = k // (lanes * cpt * (32 if w.bits == 4 else 16))
    rows = cfg.num_warps * max(1, 32 // lanes)  # one row per warp (lanes < 32: the rest of a warp takes rows)
    block_n = cfg.block_n or choose_gemv_block_n(mrows, n, split, rows, _sm_count(x.device))
    block_n = max(block_n, rows)
    x, mins, b, r, stride_rm = _operands(x, w, y, bias, residual)
    part = torch.empty((split, mrows, n), dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (mrows, triton.cdiv(n, block_n), split)
    launch = pdl.launch_args(x.device, cfg.pdl if cfg.pdl is not None else pdl.ENABLED and w.bits == 4)
    _gemv_kernel[grid](x, w.qweight.view(torch.int32), w.scales, mins, b, r, y, part, mrows, n, k, x.stride(0),
                       stride_rm, BLOCK_N=block_n, ROWS=rows, LANES=lanes, CPT=cpt, PARTIAL=split > 1,
                       PREFETCH=cfg.prefetch, ASM=not INTERPRETED,
                       VEC_X=cfg.vector_x if cfg.vector_x is not None else w.bits == 4, num_warps=cfg.num_warps,
                       **const, **launch)
    if split > 1:
        _reduce_kernel[(mrows, triton.cdiv(n, REDUCE_BLOCK))](
            part, b, r, y, mrows, n, split, stride_rm, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            BLOCK=REDUCE_BLOCK, num_warps=4, **launch)
    return y


def wq_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, cfg: GemmConfig = GEMM_CONFIG) -> torch.Tensor:
    """The fused prefill GEMM (dequantize in the K loop). x [M, K] -> [M, N] in x.dtype."""
    y, const = _common(x, w, bias, residual)
    (mrows, n), k = y.shape, w.shape[1]
    if mrows == 0:
        return y
    codes, words = _codes_arg(w, cfg.words)
    x, mins, b, r, stride_rm = _operands(x, w, y, bias, residual)
    grid = (triton.cdiv(mrows, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_kernel[grid](x, codes, w.scales, mins, b, r, y, mrows, n, k, x.stride(0), stride_rm,
                       BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=fit_block_k(cfg.block_k, k, w.group),
                       GROUP_M=cfg.group_m, WORDS=words, CVT=CVT_MODES[cfg.cvt], num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, **const)
    return y


def wq_dequantize(w: QuantWeight, dtype: torch.dtype, row0: int = 0, rows: int | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense rows [row0, row0 + rows) of W in `dtype` by the Triton kernel: [rows, K] (into `out` if given)."""
    if not kernel_supports(w):
        raise ValueError(f"wq_dequantize: group {w.group} is not a power of two >= {MIN_DOT}")
    n, k = w.shape
    rows = n - row0 if rows is None else rows
    if out is None:
        out = torch.empty((rows, k), dtype=dtype, device=w.device)
    bn, bk, warps = DEQUANT_BLOCK
    bk = fit_block_k(bk, k, w.group)
    _dequant_kernel[(triton.cdiv(rows, bn), k // bk)](
        w.qweight, w.scales, w.mins if w.mins is not None else w.scales, out, row0, rows, n, k, BITS=w.bits,
        GROUP=w.group, HAS_MINS=w.mins is not None, BLOCK_N=bn, BLOCK_K=bk, CVT=CVT_MODES["unit"], num_warps=warps)
    return out


def wq_dequant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None, max_elems: int = DEQUANT_MAX_ELEMS) -> torch.Tensor:
    """Dequantize W in row chunks of <= max_elems into a scratch buffer, then cuBLAS.

    Each chunk's GEMM writes its columns of y in place (cuBLAS takes the row stride), with
    bias + residual added in its epilogue (addmm): one rounding, as the reference.
    """
    y, _ = _common(x, w, bias, residual)
    n, k = w.shape
    chunk = max(1, min(n, max_elems // k))
    scratch = torch.empty((chunk, k), dtype=x.dtype, device=x.device)  # the caching allocator reuses it
    base = bias if residual is None else (residual if bias is None else residual + bias)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        wd = wq_dequantize(w, x.dtype, lo, hi - lo, out=scratch[:hi - lo])  # [hi - lo, K]
        if base is None:
            torch.mm(x, wd.t(), out=y[:, lo:hi])
        else:
            torch.addmm(base[..., lo:hi], x, wd.t(), out=y[:, lo:hi])
    return y
