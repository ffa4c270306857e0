"""Half2 decode kernel of the weight-only quantized matmul (used by kvtier/kernels/wq_matmul.py).

`_gemv_kernel`: y[m, n] = sum_k x[m, k] W[n, k] on CUDA cores, codes turned into fp16 pairs by bit
tricks and multiply-summed two at a time (HFMA2): an fp16 sum per 16-byte chunk (32 / 16 codes), then fp32.

    grid (M, cdiv(N, BLOCK_N), split)          x row fastest: the M programs of one row block
                                               run together and share its codes through L2
    program: rows [pid_n * BLOCK_N, + BLOCK_N) of W, columns [pid_k * KS, + KS) of K,
             KS = CPT * LANES * CH; a chunk = CH codes = one 16-byte load (4 words):
                 K slice:  | c0 c1 ... c(LANES-1) | cLANES ... | ...      lane l holds chunks
                             lane 0 1 ... LANES-1 | 0 1 ...    |          l, l + LANES, ... (CPT)
    once per program: x of the slice as fp16 pairs in registers, in the order the codes unpack
             (4-bit word: (c0, c4) (c1, c5) (c2, c6) (c3, c7); 8-bit: (c0, c2) (c1, c3)), scaled
             by 2^-XSHIFT (range: module constants), and each chunk's fp32 sum of x;
    loop over the block's rows, ROWS a step (one row per warp): load the rows' chunks (128-bit),
             `_chunk_dot` each, then per chunk  s * 2^XSHIFT * dot + (min + 8 s) * sum x  (4-bit
             codes are centred, c - 8) and a sum over the chunks (in-thread, then lanes).

Code -> fp16 without a conversion instruction: a nibble OR 0x6400 is the fp16 1024 + c, one
LOP3 makes two of them from a 32-bit word ((w & 0x000F000F) | 0x64006400); the next nibble up
stays in place as 1024 + 16 c (mask 0x00F000F0) and an fma by 1/16 recentres it; a byte goes
under 0x64 by one PRMT (8-bit codes, sign bit flipped first). Per 8 4-bit codes: SHF + 4 LOP3 +
4 de-bias HADD2/HFMA2 + 4 HFMA2 = 13 instructions.

ASM False (TRITON_INTERPRET=1 has no inline PTX) computes the same sums from shifted fields in
fp32 over the same fp16-rounded x: the interpreter checks the indexing and the group algebra, the
GPU tests the PTX.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtier.kernels.pdl import wait_before_reads

# x is scaled by 2^-XSHIFT before it becomes fp16 (exact), so that a chunk's fp16 sum stays
# finite: 32 products of |c - 8| <= 8 (4-bit, 2^-5) or 16 of |c| <= 128 (8-bit, 2^-8) overflow only
# past |x| ~ 8k with every product aligned and maximal; x below 2^(XSHIFT - 14) turns subnormal
# (an absolute error of at most 2^(XSHIFT - 25) each). fp16 sums round to ~2^-11 of the chunk's sum.
XSHIFT4 = tl.constexpr(5)
XSHIFT8 = tl.constexpr(8)

# 4-bit: fp16 constants of the de-bias step: 1024 + 8 (even nibbles: h - 1032 = c - 8),
# 1/16 and -72 (odd nibbles: (1024 + 16 c) / 16 - 72 = c - 8).
_Q4_CHAIN = """
    lop3.b32 h, {w}, 0x000F000F, 0x64006400, 0xEA;
    sub.rn.f16x2 h, h, c1032;
    {first} {acc}, h, {xa}{tail};
    lop3.b32 h, {w}, 0x00F000F0, 0x64006400, 0xEA;
    fma.rn.f16x2 h, h, c16th, cm72;
    fma.rn.f16x2 {acc}, h, {xb}, {acc};
    shr.b32 t, {w}, 8;
    lop3.b32 h, t, 0x000F000F, 0x64006400, 0xEA;
    sub.rn.f16x2 h, h, c1032;
    fma.rn.f16x2 {acc}, h, {xc}, {acc};
    lop3.b32 h, t, 0x00F000F0, 0x64006400, 0xEA;
    fma.rn.f16x2 h, h, c16th, cm72;
    fma.rn.f16x2 {acc}, h, {xd}, {acc};"""
# 8-bit: flip the sign bits (c + 128 unsigned), PRMT bytes 0/2 and 1/3 under 0x64 (1024 + c + 128),
# minus 1152 = c.
_Q8_CHAIN = """
    xor.b32 t, {w}, 0x80808080;
    prmt.b32 h, t, c64, 0x4240;
    sub.rn.f16x2 h, h, c1152;
    {first} {acc}, h, {xa}{tail};
    prmt.b32 h, t, c64, 0x4341;
    sub.rn.f16x2 h, h, c1152;
    fma.rn.f16x2 {acc}, h, {xb}, {acc};"""


def _chunk_asm(chain: str) -> str:
    """PTX of one 4-word chunk: $0 out (fp32), $1..$4 the words, $5.. the x pairs (word j, slot p:
    $5 + 4 j + p). Words 0-1 chain into one fp16x2 sum, words 2-3 into another; the two are added,
    then the pair's halves (a swapped add), then one conversion to fp32."""
    body = []
    for j in range(4):
        acc = "a" if j < 2 else "b"
        first = j % 2 == 0
        x = [f"${5 + 4 * j + p}" for p in range(4)]
        body.append(chain.format(w=f"${1 + j}", acc=acc, xa=x[0], xb=x[1], xc=x[2], xd=x[3],
                                 first="mul.rn.f16x2" if first else "fma.rn.f16x2",
                                 tail="" if first else f", {acc}"))
    return ("{\n.reg .b32 h, t, a, b, c1032, c16th, cm72, c64, c1152;\n.reg .b16 l, u;\n"
            "mov.b32 c1032, 0x64086408;\nmov.b32 c16th, 0x2C002C00;\nmov.b32 cm72, 0xD480D480;\n"
            "mov.b32 c64, 0x64646464;\nmov.b32 c1152, 0x64806480;\n" + "\n".join(body) +
            "\nadd.rn.f16x2 a, a, b;\nmov.b32 {l, u}, a;\nmov.b32 b, {u, l};\nadd.rn.f16x2 a, a, b;\n"
            "mov.b32 {l, u}, a;\ncvt.f32.f16 $0, l;\n}")


Q4_CHUNK_ASM = tl.constexpr(_chunk_asm(_Q4_CHAIN))
Q8_CHUNK_ASM = tl.constexpr(_chunk_asm(_Q8_CHAIN))
CHUNK_CONSTRAINTS = tl.constexpr("=f," + ",".join(["r"] * 20))


@triton.jit
def _epilogue(acc, n, m, mask, b_ptr, r_ptr, y_ptr, N, stride_rm, HAS_BIAS: tl.constexpr,
              HAS_RES: tl.constexpr):
    """y[m, n] = acc (+ bias[n]) (+ residual[m, n]) rounded once; n, m broadcast to acc's shape."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    if HAS_RES:
        acc += tl.load(r_ptr + m.to(tl.int64) * stride_rm + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * N + n, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pack_half2(lo, hi, ASM: tl.constexpr):
    """fp32 lo, hi -> int32 holding their fp16 roundings (lo in bits 0..15)."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        lo16 = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        hi16 = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
        return lo16 | (hi16 << 16)


@triton.jit
def _half(v, HI: tl.constexpr):
    """One fp16 of an int32 pair (`_pack_half2`) as fp32."""
    if HI:
        v = v >> 16
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair_dot(lo_code, hi_code, xp):
    return lo_code.to(tl.float32) * _half(xp, False) + hi_code.to(tl.float32) * _half(xp, True)


@triton.jit
def _split4(t):
    """t [..., 4] -> its four [...] slices (0, 1, 2, 3)."""
    a, b = tl.split(tl.reshape(t, t.shape[:-1] + [2, 2]))  # index 2 i + j -> (i, j): a = 0, 2; b = 1, 3
    t0, t2 = tl.split(a)
    t1, t3 = tl.split(b)
    return t0, t1, t2, t3


@triton.jit
def _word_dot(w, xa, xb, xc, xd, BITS: tl.constexpr):
    """The interpreter's stand-in for a word's part of the PTX chain (fp32 sums of the same products)."""
    if BITS == 4:
        out = (_pair_dot(((w >> 0) & 15) - 8, ((w >> 16) & 15) - 8, xa)
               + _pair_dot(((w >> 4) & 15) - 8, ((w >> 20) & 15) - 8, xb)
               + _pair_dot(((w >> 8) & 15) - 8, ((w >> 24) & 15) - 8, xc)
               + _pair_dot(((w >> 12) & 15) - 8, ((w >> 28) & 15) - 8, xd))
    else:
        out = _pair_dot((w << 24) >> 24, (w << 8) >> 24, xa) + _pair_dot((w << 16) >> 24, w >> 24, xb)
    return out


@triton.jit
def _chunk_dot(w, xa, xb, xc, xd, BITS: tl.constexpr, ASM: tl.constexpr):
    """Codes words w [..., 4] (int32, a chunk along the last dim) . x pairs (xa..xd [..., 4]: word j's
    pair slots) -> fp32 [...]: the chunk's sum of (c - 8) x' (4-bit) or c x' (8-bit)."""
    w0, w1, w2, w3 = _split4(w)
    a0, a1, a2, a3 = _split4(xa)
    b0, b1, b2, b3 = _split4(xb)
    c0, c1, c2, c3 = _split4(xc)
    d0, d1, d2, d3 = _split4(xd)
    if ASM:
        args = [w0, w1, w2, w3, a0, b0, c0, d0, a1, b1, c1, d1, a2, b2, c2, d2, a3, b3, c3, d3]
        if BITS == 4:
            out = tl.inline_asm_elementwise(Q4_CHUNK_ASM, CHUNK_CONSTRAINTS, args, dtype=tl.float32, is_pure=True,
                                            pack=1)
        else:
            out = tl.inline_asm_elementwise(Q8_CHUNK_ASM, CHUNK_CONSTRAINTS, args, dtype=tl.float32, is_pure=True,
                                            pack=1)
    else:
        out = (_word_dot(w0, a0, b0, c0, d0, BITS) + _word_dot(w1, a1, b1, c1, d1, BITS)
               + _word_dot(w2, a2, b2, c2, d2, BITS) + _word_dot(w3, a3, b3, c3, d3, BITS))
    return out


@triton.jit
def _x_pair(x1, col, a: tl.constexpr, b: tl.constexpr, scale: tl.constexpr, ASM: tl.constexpr):
    """fp16 pair (x[col + a], x[col + b]) * scale."""
    lo = tl.load(x1 + col + a).to(tl.float32) * scale
    hi = tl.load(x1 + col + b).to(tl.float32) * scale
    return _pack_half2(lo, hi, ASM)


@triton.jit
def _x_pairs(x1, col, CPW: tl.constexpr, scale: tl.constexpr, ASM: tl.constexpr):
    """(xa, xb, xc, xd): the fp16 pairs of x each word's chunk math takes ((c_j, c_j+4) at 4 bits,
    (c_j, c_j+2) at 8, where xc, xd repeat xa, xb unused), one 2-byte load a value."""
    if CPW == 8:
        xa = _x_pair(x1, col, 0, 4, scale, ASM)
        xb = _x_pair(x1, col, 1, 5, scale, ASM)
        xc = _x_pair(x1, col, 2, 6, scale, ASM)
        xd = _x_pair(x1, col, 3, 7, scale, ASM)
    else:
        xa = _x_pair(x1, col, 0, 2, scale, ASM)
        xb = _x_pair(x1, col, 1, 3, scale, ASM)
        xc, xd = xa, xb
    return xa, xb, xc, xd


@triton.jit
def _x_pairs_vec(x1, col, CPW: tl.constexpr, ROWS: tl.constexpr, scale: tl.constexpr, ASM: tl.constexpr):
    """`_x_pairs` and each chunk's fp32 sum of x from one contiguous load a word (CPW values: 16 bytes
    of bf16 at 4 bits), paired in registers. col: [CPT, 1, LANES, 4] first column of each word. Every
    row step's warp loads its own copy ([CPT, ROWS, LANES, ...], the codes' shape): L1 serves the
    repeats."""
    col = col + tl.zeros([1, ROWS, 1, 1], tl.int32)
    xw = tl.load(x1 + col[:, :, :, :, None] + tl.arange(0, CPW)[None, None, None, None, :]).to(tl.float32)
    xsum = tl.sum(tl.sum(xw, axis=4), axis=3)  # [CPT, ROWS, LANES]: the chunk's 4 words
    halves = tl.reshape(xw * scale, xw.shape[:-1] + [2, CPW // 2])  # e = (CPW / 2) h + j
    lo, hi = tl.split(tl.permute(halves, 0, 1, 2, 3, 5, 4))  # [..., j]: x[e = j], x[e = CPW / 2 + j]
    pairs = _pack_half2(lo, hi, ASM)  # [CPT, ROWS, LANES, 4, CPW / 2]
    if CPW == 8:
        xa, xb, xc, xd = _split4(pairs)
    else:
        xa, xb = tl.split(pairs)
        xc, xd = xa, xb
    return xa, xb, xc, xd, xsum


@triton.jit
def _gemv_rows(q_ptr, s_ptr, mn_ptr, r0, N, WPR, GPR, woff, goff, ROWS: tl.constexpr, HAS_MINS: tl.constexpr):
    """Code words [CPT, ROWS, LANES, 4] and scales, mins [CPT, ROWS, LANES] of rows r0 .. r0 + ROWS."""
    rows = tl.minimum(r0 + tl.arange(0, ROWS), N - 1).to(tl.int64)[None, :, None]  # [1, ROWS, 1]
    base = tl.multiple_of((rows * WPR + woff)[:, :, :, None], [1, 1, 1, 4])  # 16-byte aligned chunks: LDG.128
    w = tl.load(q_ptr + base + tl.arange(0, 4)[None, None, None, :])
    soff = rows * GPR + goff
    sc = tl.load(s_ptr + soff)
    if HAS_MINS:
        mn = tl.load(mn_ptr + soff)
    else:
        mn = sc
    return w, sc, mn


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, q_ptr, s_ptr, mn_ptr, b_ptr, r_ptr, y_ptr, p_ptr, M, N, K, stride_xm, stride_rm,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                 HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, LANES: tl.constexpr,
                 CPT: tl.constexpr, PARTIAL: tl.constexpr, PREFETCH: tl.constexpr, ASM: tl.constexpr,
                 DOT_PREC: tl.constexpr, VEC_X: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (x row, row block, K slice): module docstring. q_ptr: the codes as int32 words.
    PDL (launched with programmatic dependent launch): the first rows' codes, scales and mins are
    loaded before waiting for the kernel before (the weights are no output of it), then x."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    CPW: tl.constexpr = 32 // BITS  # codes per word
    CH: tl.constexpr = 4 * CPW  # codes per chunk (16 bytes)
    KS: tl.constexpr = CPT * LANES * CH
    XSHIFT: tl.constexpr = XSHIFT4 if BITS == 4 else XSHIFT8
    XSCALE: tl.constexpr = 2.0 ** -XSHIFT
    k_lo = pid_k * KS
    c3 = tl.arange(0, CPT)[:, None, None] * LANES + tl.arange(0, LANES)[None, None, :]  # [CPT, 1, LANES]
    c4 = c3[:, :, :, None]
    col = k_lo + c4 * CH + tl.arange(0, 4)[None, None, None, :] * CPW  # first column of each word
    WPR = K // CPW
    GPR = K // GROUP
    woff = k_lo // CPW + c3 * 4
    goff = (k_lo + c3 * CH) // GROUP
    row_lo = pid_n * BLOCK_N
    row_last = row_lo + BLOCK_N - ROWS
    w, sc, mn = _gemv_rows(q_ptr, s_ptr, mn_ptr, row_lo, N, WPR, GPR, woff, goff, ROWS, HAS_MINS)
    wait_before_reads(PDL)  # x, the residual, the outputs: after the kernel before (kernels/pdl.py)
    x1 = x_ptr + pid_m.to(tl.int64) * stride_xm
    if VEC_X:
        xa, xb, xc, xd, xsum = _x_pairs_vec(x1, col, CPW, ROWS, XSCALE, ASM)
    else:
        xa, xb, xc, xd = _x_pairs(x1, col, CPW, XSCALE, ASM)
        xsum = tl.sum(tl.load(x1 + k_lo + c4 * CH + tl.arange(0, CH)[None, None, None, :]).to(tl.float32), axis=3)
    for r0 in range(row_lo, row_lo + BLOCK_N, ROWS):
        if PREFETCH:  # the next rows' loads in flight during this step's math (the last re-reads itself)
            w_c, sc_c, mn_c = w, sc, mn
            w, sc, mn = _gemv_rows(q_ptr, s_ptr, mn_ptr, tl.minimum(r0 + ROWS, row_last), N, WPR, GPR, woff, goff,
                                   ROWS, HAS_MINS)
        else:
            w_c, sc_c, mn_c = _gemv_rows(q_ptr, s_ptr, mn_ptr, r0, N, WPR, GPR, woff, goff, ROWS, HAS_MINS)
        part = _chunk_dot(w_c, xa, xb, xc, xd, BITS, ASM)  # [CPT, ROWS, LANES]
        scf = sc_c.to(tl.float32)
        acc = part * (scf * (2.0 ** XSHIFT))
        if BITS == 4:  # centred codes: c s + m = (c - 8) s + (m + 8 s)
            off = scf * 8.0
            if HAS_MINS:
                off += mn_c.to(tl.float32)
            acc += off * xsum
        elif HAS_MINS:
            acc += mn_c.to(tl.float32) * xsum
        yr = tl.sum(tl.sum(acc, axis=0, keep_dims=True), axis=2, keep_dims=True)  # [1, ROWS, 1]: threads, lanes
        n = r0 + tl.arange(0, ROWS)[None, :, None]
        if PARTIAL:
            tl.store(p_ptr + (pid_k * M + pid_m).to(tl.int64) * N + n, yr, mask=n < N)
        else:
            _epilogue(yr, n, pid_m, n < N, b_ptr, r_ptr, y_ptr, N, stride_rm, HAS_BIAS, HAS_RES)
