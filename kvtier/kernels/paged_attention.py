"""Split-K ("flash-decoding") paged decode attention that reads every KV format in place.

One query row per sequence (the newest token) attends over the sequence's
pages straight from a PagePool layer's storage: plain bf16/fp16/fp32 pages,
or int8 / fp8 / int4 codes with their fp16 scales, decoded in registers with
the math of kvtier/kernels/kv_quant.py (value = code * scale; int4 nibbles
biased by 8, one scale per group). The pages hold the stored (rotated, smoothed)
domain: q comes in it (PagePool.native_q) and the output goes back out through
PagePool.native_out, as DensePagedAttention does with native reads; or, with a
`NativeDomain`, the split kernel moves raw q into it and the merge moves the output
back (the rotation: kernels/hadamard.py's transform in registers).

Work split (grid = (B, Hkv, num_splits); one program per (sequence, kv head, split)):

    pages of seq b:  | split 0          | split 1          | ... | split n-1 (may be empty) |
                     0                  pps                2*pps     n_pages = cdiv(seq_len, S)
    pps = cdiv(n_pages, num_splits), computed in the kernel from seq_len, so the
    launch depends on shapes only (CUDA-graph capturable; num_splits is chosen from
    capacity by `choose_num_splits`).

    A program walks its pages BLOCK_N = PAGES * S tokens at a time (PAGES page ids
    gathered per iteration) for ALL G = Hq / Hkv query heads of its kv head, so each
    K/V byte is read once, with an online (running max / sum) fp32 softmax. It writes
    an fp32 partial output and its log-sum-exp (base 2); `_merge_kernel` combines the
    splits (an empty split has lse = -inf and weight 0). With num_splits == 1 the
    split kernel writes the output directly and no merge runs.

Sink rows (quantized pools): if sink_slot[block_table[b, 0]] >= 0, key/value 0
comes from that slot (exact, compute dtype) instead of the quantized page row:
split 0 starts its softmax from it and every split skips token 0 of the pages.

Per-kv-head page lists (SELECTED, a constexpr; kvtier/kernels/retrieval_attention.py): the same
kernel with program (b, h, sp) walking entry list (b, h) of a [B, Hkv, n_sel] page-id table
(with page indices for the position masks) instead of block-table row b: retrieval attention.

`paged_prefill` (second half of this file) is the varlen causal counterpart for many new
rows per sequence: a flash-attention loop over the same gathered, decoded tiles (`_tile`),
the same sink start, G query heads of a kv head packed into one tl.dot operand.

`paged_decode_reference` is the same computation in plain PyTorch (the codecs of
kvtier/kv/formats.py); tests/layers/paged_attention_cases.py checks one
against the other (TRITON_INTERPRET=1 on CPU, and on CUDA in tests/gpu).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.kernels import pdl
from kvtier.kv.formats import (INT4_BIAS, Codec, Fp8Codec, Int4Codec, Int8Codec, KVFormat, PlainCodec,
                               inv_sqrt_f32)

try:
    import triton
    import triton.language as tl

    from kvtier.kernels.hadamard import fwht
    from kvtier.kernels.pdl import wait_before_reads
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: only the reference and the heuristic are usable
    HAVE_TRITON = False

# (sink_k [num_slots, Hkv, D], sink_v [num_slots, Hkv, D], sink_slot [num_pages] int64 page -> slot or -1)
Sink = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# Bytes of one decoded K (or V) tile [BLOCK_N, D] in the compute dtype: 64 tokens at D = 128 in
# bf16. Compiled for sm_90 offline: 80-140 registers a thread, no spills, for every format at
# D = 64..256; fp32 at twice this spilled (D = 64: 128 B, D = 256: 5 KB of stack).
TILE_BYTES = 16384
# Plain (bf16) pages split at most LONG_LOOP_SPLITS ways (large batches: every program walks a
# long stretch) take twice the tile. H200, tools/sweep_paged.py --few, B = 32 at 8K (3 splits):
# bf16 311.6 -> 262.9 us; the code formats got slower (int8 267.8 -> 299.2 us), and so did every
# format at B = 1, 32K (64 splits of 512 tokens: bf16 45.0 -> 49.2 us).
LONG_TILE_BYTES = 32768
LONG_LOOP_SPLITS = 4
# Tokens per iteration at most (D <= 64): longer tiles add registers, not bandwidth.
MAX_BLOCK_N = 128
# Query rows of one kv head are padded to this for tl.dot: Triton pads smaller M to an mma tile
# anyway (m16), so padding the G = 1..8 heads costs no extra instructions, only 16 x D fp32
# accumulator registers. tl.dot beats a broadcast-multiply-sum here: [G, BLOCK_N, D] products
# in registers would be 8192 * G values per program.
MIN_DOT_ROWS = 16
# Warps per program: decode is bandwidth-bound; 4 warps and several programs per SM keep enough
# loads in flight (to be tuned on the H200 with test_print_bandwidth).
NUM_WARPS = 4
# Software-pipelining depth of the page loop (next tile's loads overlap this tile's math).
NUM_STAGES = 2
# fp32 q: three tf32 tensor-core products (about fp32 accuracy); "ieee" FMA dots spilled at D = 128.
FP32_DOT = "tf32x3"
# Splits merged per iteration of the merge kernel (bounds its registers for any num_splits).
MERGE_CHUNK = 16
LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E): the kernels use exp2

# choose_num_splits: programs per SM to aim for (several resident programs hide load latency).
PROGRAMS_PER_SM = 4
# A split's partial output and lse cost about as much traffic as ~8 tokens of bf16 K/V of its
# kv head (G * D * 4 bytes vs 2 * D * 2 bytes a token), so 128-token splits keep the merge < ~6%.
MIN_SPLIT_TOKENS = 128
# Upper bound on the heuristic's splits (B = 1, few kv heads, very long contexts).
MAX_SPLITS = 64
# Decode launches given a NativeDomain with this many splits or more (launch_decode) take q into the
# stored domain and the output back in two launches of their own instead of folding both into the
# split and merge kernels. H100, tools/sweep_fold.py, B = 1 (graph replay, us a call): int8 at 32K,
# 64 splits: folded 61.2, separate 47.1 (plain kernel 43.4); at 4K, 32 splits: folded 12.1,
# separate 14.6. The folded kernel's page loop runs slower, so the fold pays only for short splits.
FOLD_MAX_SPLITS = 64

# The split kernel's int8 V tiles as four column sets, one tl.dot each (`code_parts`). H100,
# tools/sweep_paged.py --parts, int8 pages, us a call: B1 32K 46.1 -> 42.4, B32 8K 275.4 -> 265.3,
# B1 4K 11.4 -> 10.8. The same split of int8 K tiles (q split once) and of int4 tiles (eight nibble
# sets) measured slower (int4 V: 57.4 -> 86.7 us for k8v4 at 32K) and is not built.
PARTS_DECODE = True
# Pipeline stages of the split kernel per KV format where the default is not the fastest: H100,
# B = 1, us a call at 32K / 4K (tools/sweep_paged.py --stages): k8v4 (int8 K, int4 V) 2 stages
# 58.4 / 11.9, 1 stage 47.6 / 12.1; int8 and int4 pages were fastest at the default 2.
DECODE_STAGES = {"k8v4": 1}
# At one stage (no software pipelining) the split kernel may load the next tile's page ids under
# the current tile (PREFETCH_IDS; offline sm_90 build, k8v4, 744 -> 813 loop instructions, 128
# registers). Slower at 32K for every format on an H100 (`tools/sweep_paged.py --prefetch`, B = 1,
# us a layer: k8v4 46.8 -> 59.2, int8 44.0 -> 66.8, bf16 59.5 -> 69.5), so off.
PREFETCH_AT_ONE_STAGE = False

# The kernels' alternate-source offsets (AltPages): never specialised on value.
ALT_ARGS = ("ad_k", "ad_ks", "ad_v", "ad_vs", "ad_sk", "ad_sv", "ad_slot")

if HAVE_TRITON:
    # Decode path of one codec (a tl.constexpr: each codec pair compiles its own kernel).
    MODE_PLAIN = tl.constexpr(0)  # stored values, any float dtype
    MODE_INT8 = tl.constexpr(1)  # int8 code * per-row fp16 scale
    MODE_FP8 = tl.constexpr(2)  # e4m3 byte * per-row fp16 scale
    MODE_INT4 = tl.constexpr(3)  # (nibble - 8) * per-group fp16 scale, two codes a byte
    # int8 codes -> fp16 four at a time (_tile): flip each byte's sign bit, put bytes 0/2 (1/3)
    # under an fp16 exponent of 1024 in the two halves of a word, subtract 1024 + 128.
    SIGN_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32
    LOW_BYTES = tl.constexpr(0x00FF00FF)
    FP16_1024X2 = tl.constexpr(0x64006400)  # two fp16 1024.0
    LOW_NIBBLES = tl.constexpr(0x000F000F)
    NO_PAGE = tl.constexpr(-(1 << 62))  # below every page id, alternate (negative) ones included

    @triton.jit
    def _tile(data_ptr, scale_ptr, row, srow, valid, MODE: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BIAS: tl.constexpr, HALF: tl.constexpr = False, SCALED: tl.constexpr = False):
        """Rows of one layer's K or V pages -> (tile [BLOCK_N, D], row scale [BLOCK_N] fp32).

        row / srow: [BLOCK_N] int64 row index (page * Hkv + head) * S + offset into the data /
        scale tensor (they differ only for alternate-source pages, see AltPages); valid: [BLOCK_N].
        int8 / fp8 come back as codes (exact in fp32 and in bf16/fp16) with their per-row
        scale, which the caller applies to the [G, BLOCK_N] scores or probabilities instead
        of the [BLOCK_N, D] tile (D times fewer multiplies). Plain tiles come back as stored,
        int4 tiles decoded in fp32 (their scales vary along D); both with scale 1. SCALED (16-bit
        int8 / fp8 tiles): the tile comes back times its row scales (fp16 products, one rounding,
        as the int4 tiles' group scales) with scale 1, so the scales feed the dot operand and are
        fetched with the codes (the prefill kernel: a separate scale load, used only after the
        dot, was a synchronous global load in its key loop).
        """
        rs = tl.full([BLOCK_N], 1.0, tl.float32)
        if MODE == MODE_INT4 and HALF and GROUP >= 8:
            # eight codes a 32-bit word: nibble k of each half-word under an fp16 exponent of 1024
            # (integer ops, no I2F), minus 1024 + 8; times the fp16 group scale (one rounding, as
            # the fp32 product rounded to fp16)
            NG: tl.constexpr = D // GROUP
            wp = data_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
            w = tl.load(wp + row[:, None] * (D // 8) + tl.arange(0, D // 8)[None, :], mask=valid[:, None],
                        other=0)  # [BLOCK_N, D / 8]
            a0 = _nibbles_f16(w, 0)  # (value 8i, value 8i + 4)
            a1 = _nibbles_f16(w, 4)
            a2 = _nibbles_f16(w, 8)
            a3 = _nibbles_f16(w, 12)
            # value 8i + 4a + 2b + c: tl.join adds a last (fastest) axis, so the innermost join
            # picks a (the half-word), the outermost c
            even = tl.join(tl.join(a0[0], a0[1]), tl.join(a2[0], a2[1]))  # c = 0
            odd = tl.join(tl.join(a1[0], a1[1]), tl.join(a3[0], a3[1]))  # c = 1
            codes = tl.reshape(tl.join(even, odd), (BLOCK_N, NG, GROUP))
            sc = tl.load(scale_ptr + srow[:, None] * NG + tl.arange(0, NG)[None, :], mask=valid[:, None],
                         other=0.0)  # [BLOCK_N, NG] fp16
            tile = tl.reshape(codes * sc[:, :, None], (BLOCK_N, D))
        elif MODE == MODE_INT4:
            NG: tl.constexpr = D // GROUP  # scales per row
            HG: tl.constexpr = GROUP // 2  # bytes per group
            r3 = row[:, None, None]
            s3 = srow[:, None, None]
            m3 = valid[:, None, None]
            byte = r3 * (D // 2) + tl.arange(0, NG)[None, :, None] * HG + tl.arange(0, HG)[None, None, :]
            b = tl.load(data_ptr + byte, mask=m3, other=0).to(tl.int32)  # [BLOCK_N, NG, HG]
            sc = tl.load(scale_ptr + s3 * NG + tl.arange(0, NG)[None, :, None], mask=m3,
                         other=0.0).to(tl.float32)  # [BLOCK_N, NG, 1]
            lo = ((b & 0xF) - BIAS).to(tl.float32) * sc  # value 2i
            hi = ((b >> 4) - BIAS).to(tl.float32) * sc  # value 2i + 1
            if HALF:  # for an fp16 dot: converted here, once, before the interleave
                lo = lo.to(tl.float16)
                hi = hi.to(tl.float16)
            tile = tl.reshape(tl.join(lo, hi), (BLOCK_N, D))  # interleaved back to d order
        elif MODE == MODE_INT8 and HALF:
            b0, b1, b2, b3, rs = _int8_parts(data_ptr, scale_ptr, row, srow, valid, D)
            tile = _join4(b0, b1, b2, b3, BLOCK_N, D)
        else:
            x = tl.load(data_ptr + row[:, None] * D + tl.arange(0, D)[None, :], mask=valid[:, None], other=0)
            if MODE == MODE_PLAIN:
                tile = x
            else:
                # codes straight to fp16 (exact): one conversion an element, not two via fp32;
                # conversions, not bytes, bounded these formats (H200: int8 slower than bf16)
                if MODE == MODE_FP8:
                    tile = x.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                else:
                    tile = x.to(tl.float16)
                rs = tl.load(scale_ptr + srow, mask=valid, other=0.0).to(tl.float32)
        if SCALED and HALF and (MODE == MODE_INT8 or MODE == MODE_FP8):
            tile = tile * rs.to(tl.float16)[:, None]
            rs = tl.full([BLOCK_N], 1.0, tl.float32)
        return tile, rs

    @triton.jit
    def _nibbles_f16(w, shift: tl.constexpr):
        """Nibbles `shift` and `shift + 16` of int32 words -> (low, high) fp16 code - 8 (exact)."""
        x = ((w >> shift) & LOW_NIBBLES) | FP16_1024X2
        return _half_f16(x, False) - 1032.0, _half_f16(x, True) - 1032.0

    @triton.jit
    def _cols4(x, R: tl.constexpr, D: tl.constexpr):
        """x [R, D] -> its columns 4i + j for j = 0, 1, 2, 3: four [R, D / 4] (`_join4` inverts)."""
        c0, c1 = tl.split(tl.reshape(x, (R, D // 4, 2, 2)))  # d = 4i + 2a + c: split on c, then on a
        x0, x2 = tl.split(c0)
        x1, x3 = tl.split(c1)
        return x0, x1, x2, x3

    @triton.jit
    def _join4(x0, x1, x2, x3, R: tl.constexpr, D: tl.constexpr):
        """Inverse of `_cols4` (tl.join adds a last, fastest axis: the inner join picks a, the outer c)."""
        return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (R, D))

    @triton.jit
    def _half_f16(x, HI: tl.constexpr):
        """One fp16 of an int32 pair as fp16 (HI: bits 16..31)."""
        if HI:
            x = x >> 16
        return (x & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _int8_parts(data_ptr, scale_ptr, row, srow, valid, D: tl.constexpr):
        """int8 rows [BLOCK_N] -> their columns 4i + j (j = 0..3) as fp16 codes [BLOCK_N, D / 4] (exact)
        and the row scale [BLOCK_N] fp32: the 16-bit int8 decode, before `_tile` interleaves the sets
        back into d order (the split kernel's V_PARTS dots them as they are). Four codes a 32-bit word
        become fp16 by integer ops instead of one I2F (and a byte extract) per code: (code + 128) |
        0x6400 is the fp16 1024 + code + 128, exact."""
        wp = data_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        w = tl.load(wp + row[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :], mask=valid[:, None], other=0)
        u = w ^ SIGN_BITS  # each byte + 128 (mod 256): unsigned 0..255
        lo = (u & LOW_BYTES) | FP16_1024X2  # bytes 0 and 2 as fp16 pairs
        hi = ((u >> 8) & LOW_BYTES) | FP16_1024X2  # bytes 1 and 3
        rs = tl.load(scale_ptr + srow, mask=valid, other=0.0).to(tl.float32)
        return (_half_f16(lo, False) - 1152.0, _half_f16(hi, False) - 1152.0, _half_f16(lo, True) - 1152.0,
                _half_f16(hi, True) - 1152.0, rs)

    @triton.jit
    def _kv_rows(page, h, in_page, ad_k, ad_ks, ad_v, ad_vs, Hkv, S: tl.constexpr, ALT: tl.constexpr):
        """Rows of the K data, K scale, V data and V scale tensors of the tokens at page ids `page`
        (ALT: a negative id is page -1 - id of the alternate source, ad_* rows from the pool's)."""
        if ALT:
            alt = page < 0
            row = (tl.where(alt, -1 - page, page) * Hkv + h) * S + in_page
            return (row + tl.where(alt, ad_k, 0), row + tl.where(alt, ad_ks, 0), row + tl.where(alt, ad_v, 0),
                    row + tl.where(alt, ad_vs, 0))
        row = (page * Hkv + h) * S + in_page
        return row, row, row, row

    @triton.jit
    def _native_q(q_rows, qm, cs_ptr, dtype: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr,
                  SMOOTH: tl.constexpr, ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr):
        """R (channel_scale * q) of the G query rows at q_rows, rounded to q's dtype as
        PagePool.native_q rounds it (R: kernels/hadamard.py's transform in registers, fp32)."""
        x = tl.load(q_rows + tl.arange(0, D)[None, :], mask=qm, other=0.0).to(tl.float32)
        if SMOOTH:
            x = x * tl.load(cs_ptr + tl.arange(0, D)).to(tl.float32)[None, :]
        if ROTATE:
            x = fwht(x, G_PAD, D) * INV_SQRT_D
        return x.to(dtype)

    @triton.jit
    def _sink_start(q, sk_ptr, sv_ptr, srow, use, qk_scale, m_i, l_i, acc, D: tl.constexpr):
        """Softmax state (m_i, l_i, acc) with the sink row at `srow` as its first key where `use`.

        q: [G_PAD, D]; sink K/V rows of D values in the compute dtype.
        """
        d = tl.arange(0, D)
        sk = tl.load(sk_ptr + srow + d).to(tl.float32)  # [D]
        sv = tl.load(sv_ptr + srow + d).to(tl.float32)
        s0 = tl.sum(q.to(tl.float32) * sk[None, :], axis=1) * qk_scale  # [G_PAD]
        return tl.where(use, s0, m_i), tl.where(use, 1.0, l_i), tl.where(use, acc + sv[None, :], acc)

    @triton.jit
    def _selected_sink_slot(bt_ptr, idx_ptr, ok_ptr, slot_ptr, ad_slot, e0, p_lo, p_hi, BLOCK: tl.constexpr,
                            SEL_VALID: tl.constexpr, ALT: tl.constexpr):
        """(sink slot, alternate) of the page-index-0 entry among entries p_lo .. p_hi-1 of the
        list at e0 (slot -1: none there, or its page has no slot): page index ints only, before
        the page loop. ALT: the entry's page id may be negative (an alternate-source page)."""
        first = tl.full([BLOCK], NO_PAGE, tl.int64)  # per lane: a page id of page index 0
        for j0 in range(p_lo, p_hi, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = j < p_hi
            if SEL_VALID:
                m = m & (tl.load(ok_ptr + e0 + j, mask=m, other=0) != 0)
            m = m & (tl.load(idx_ptr + e0 + j, mask=m, other=-1) == 0)
            ids = tl.load(bt_ptr + e0 + j, mask=m, other=0).to(tl.int64)
            first = tl.maximum(first, tl.where(m, ids, NO_PAGE))
        page = tl.max(first, axis=0)
        found = page != NO_PAGE
        slot, alt = _page_slot(tl.where(found, page, 0), slot_ptr, ad_slot, ALT)
        return tl.where(found, slot, -1), alt & found

    @triton.jit
    def _page_slot(page, slot_ptr, ad_slot, ALT: tl.constexpr):
        """(sink slot, alternate) of page id `page` (a scalar): ALT: a negative id is page -1 - id
        of the alternate source, whose slot table sits ad_slot elements from slot_ptr."""
        if ALT:
            alt = page < 0
            slot = tl.load(slot_ptr + tl.where(alt, -1 - page + ad_slot, page))
        else:
            alt = page < 0  # never, without ALT
            slot = tl.load(slot_ptr + page)
        return slot, alt

    @triton.jit
    def _kv_tiles(k_ptr, ks_ptr, v_ptr, vs_ptr, page, h, in_page, valid, ad_k, ad_ks, ad_v, ad_vs, Hkv,
                  S: tl.constexpr, D: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr,
                  K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BIAS: tl.constexpr,
                  K_HALF: tl.constexpr, V_HALF: tl.constexpr, ALT: tl.constexpr):
        """K and V tiles of the tokens at page ids `page` (int64 [BLOCK_N]), offsets in_page, kv
        head h; 16-bit int8 / fp8 tiles come scaled (`_tile` SCALED), the others with their row
        scales. ALT: a negative id is page -1 - id of the alternate source, whose tensors sit
        ad_* rows from the pool's (AltPages)."""
        k_row, ks_row, v_row, vs_row = _kv_rows(page, h, in_page, ad_k, ad_ks, ad_v, ad_vs, Hkv, S, ALT)
        k, ks = _tile(k_ptr, ks_ptr, k_row, ks_row, valid, K_MODE, D, K_GROUP, BLOCK_N, BIAS, K_HALF, K_HALF)
        v, vs = _tile(v_ptr, vs_ptr, v_row, vs_row, valid, V_MODE, D, V_GROUP, BLOCK_N, BIAS, V_HALF, V_HALF)
        return k, ks, v, vs

    @triton.jit
    def _tile_pages(bt_ptr, idx_ptr, ok_ptr, bt_row, e0, p0, p_hi, seq_len, t_lo, offs, S: tl.constexpr,
                    SELECTED: tl.constexpr, SEL_VALID: tl.constexpr, HAS_SINK: tl.constexpr):
        """The split kernel's tile of pages p0 .. p0 + PAGES - 1 (SELECTED: list entries), per token
        `offs`: (page id int64, valid). bt_row: the sequence's block-table row offset."""
        pidx = p0 + offs // S  # page index within the sequence (SELECTED: entry index), per token
        in_page = offs % S
        if SELECTED:
            e_ok = pidx < p_hi
            pos = tl.load(idx_ptr + e0 + pidx, mask=e_ok, other=-1).to(tl.int32)  # the entry's page index
            if SEL_VALID:  # loaded beside the page index, not before it (no chain of dependent loads)
                pos = tl.where(tl.load(ok_ptr + e0 + pidx, mask=e_ok, other=0) != 0, pos, -1)
            tok = pos * S + in_page
            valid = (pos >= 0) & (tok < seq_len)  # pos is -1 past the split's entries
            page = tl.load(bt_ptr + e0 + pidx, mask=e_ok, other=0).to(tl.int64)
        else:
            tok = pidx * S + in_page
            valid = (pidx < p_hi) & (tok < seq_len)
            page = tl.load(bt_ptr + bt_row + pidx, mask=pidx < p_hi, other=0).to(tl.int64)
        if HAS_SINK:
            valid = valid & (tok >= t_lo)
        return page, valid

    # Runtime ints that may be 1 or multiples of 16: not specialised on value (one compile serves all).
    @triton.jit(do_not_specialize=["Hkv", "G", "num_splits", "stride_bt", "n_sel", *ALT_ARGS])
    def _split_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_ptr, lens_ptr, idx_ptr, ok_ptr, sk_ptr, sv_ptr,
                      slot_ptr, o_ptr, lse_ptr, cs_ptr, qk_scale, stride_qb, stride_qh, stride_bt,
                      stride_ob, stride_oh, stride_os, Hkv, G, num_splits, n_sel,
                      ad_k, ad_ks, ad_v, ad_vs, ad_sk, ad_sv, ad_slot,
                      S: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, PAGES: tl.constexpr,
                      K_MODE: tl.constexpr, V_MODE: tl.constexpr, K_GROUP: tl.constexpr,
                      V_GROUP: tl.constexpr, BIAS: tl.constexpr, HAS_SINK: tl.constexpr,
                      SINGLE: tl.constexpr, DOT_PREC: tl.constexpr, Q_SMOOTH: tl.constexpr,
                      Q_ROTATE: tl.constexpr, INV_SQRT_D: tl.constexpr, SELECTED: tl.constexpr,
                      SEL_VALID: tl.constexpr, ALT: tl.constexpr, V_PARTS: tl.constexpr = 1,
                      PREFETCH_IDS: tl.constexpr = False, PDL: tl.constexpr = False):
        """One (sequence b, kv head h, split sp): softmax partial of the G query heads of h.

        SELECTED (retrieval_attention.paged_decode_selected): row b's kv head h reads its own
        list of n_sel entries instead of the sequence's pages: page id bt_ptr[b, h, j], page
        index idx_ptr[b, h, j] (its keys sit at positions idx * S + t, live iff < lens[b];
        idx < 0, or ok_ptr[b, h, j] == 0 with SEL_VALID: the entry reads nothing); the splits
        cut the list, not the sequence. The sink row stands in for token 0 of the entry with
        page index 0: the split holding that entry finds it first and starts from the sink row.
        ALT (either mode): a negative page id is page -1 - id of the alternate source (AltPages:
        pinned host pages read over the bus, or a staging copy), at ad_* rows from the pool's.
        V_PARTS 4 (int8 V, 16-bit q; `code_parts`): the V code tile stays in the column sets of a 32-bit
        word's four bytes (`_int8_parts`), one tl.dot and one accumulator a set, joined after the loop.
        PREFETCH_IDS (formats run with one pipeline stage, `decode_stages`): each iteration loads the
        next tile's page ids before its own tile's codes, so the codes' loads never wait on an id load.
        PDL: launched with programmatic dependent launch (kernels/pdl.py).
        """
        wait_before_reads(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        BLOCK_N: tl.constexpr = PAGES * S
        seq_len = tl.load(lens_ptr + b)
        if SELECTED:
            e0 = (b * Hkv + h).to(tl.int64) * n_sel  # entry (b, h, 0) of the [B, Hkv, n_sel] tables
            n_pages = n_sel
        else:
            e0 = 0
            n_pages = tl.cdiv(seq_len, S)
        pps = tl.cdiv(n_pages, num_splits)
        p_lo = sp * pps
        p_hi = tl.minimum(p_lo + pps, n_pages)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = h * G + g  # query head h * G + g reads kv head h
        q_rows = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q = tl.load(q_rows + d[None, :], mask=(g < G)[:, None], other=0.0)  # [G_PAD, D]
        if Q_SMOOTH or Q_ROTATE:  # raw q -> the pool's stored domain (PagePool.native_q), in place
            q = _native_q(q_rows, (g < G)[:, None], cs_ptr + h * D, q.dtype, D, G_PAD, Q_SMOOTH, Q_ROTATE,
                          INV_SQRT_D)
        half: tl.constexpr = q.dtype != tl.float32  # 16-bit q: code tiles are dotted in fp16
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max of the scores (log2 units)
        l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([G_PAD, D], tl.float32)  # running sum of exp2(score - m_i) * v
        t_lo = 0  # first token read from the pages (1 when the sink slot supplies token 0)
        if HAS_SINK and not SELECTED:
            slot, s_alt = _page_slot(tl.load(bt_ptr + b * stride_bt).to(tl.int64), slot_ptr, ad_slot, ALT)
            t_lo = tl.where(slot >= 0, 1, 0)
            use = (slot >= 0) & (sp == 0) & (seq_len > 0)  # split 0 starts from the sink row
            m_i, l_i, acc = _sink_start(q, sk_ptr + tl.where(s_alt, ad_sk, 0), sv_ptr + tl.where(s_alt, ad_sv, 0),
                                        (tl.maximum(slot, 0) * Hkv + h) * D, use, qk_scale, m_i, l_i, acc, D)
        if HAS_SINK and SELECTED:  # the split holding the list's page-index-0 entry starts from the sink row
            slot, s_alt = _selected_sink_slot(bt_ptr, idx_ptr, ok_ptr, slot_ptr, ad_slot, e0, p_lo, p_hi, BLOCK_N,
                                              SEL_VALID, ALT)
            t_lo = tl.where(slot >= 0, 1, 0)
            use = (slot >= 0) & (seq_len > 0)
            m_i, l_i, acc = _sink_start(q, sk_ptr + tl.where(s_alt, ad_sk, 0), sv_ptr + tl.where(s_alt, ad_sv, 0),
                                        (tl.maximum(slot, 0) * Hkv + h) * D, use, qk_scale, m_i, l_i, acc, D)

        if V_PARTS == 4:
            acc0, acc1, acc2, acc3 = _cols4(acc, G_PAD, D)
        offs = tl.arange(0, BLOCK_N)
        in_page = offs % S
        if PREFETCH_IDS:
            page_n, valid_n = _tile_pages(bt_ptr, idx_ptr, ok_ptr, b * stride_bt, e0, p_lo, p_hi, seq_len, t_lo, offs,
                                          S, SELECTED, SEL_VALID, HAS_SINK)
        for p0 in range(p_lo, p_hi, PAGES):
            if PREFETCH_IDS:  # this tile's ids came last iteration; the next tile's load now, under this one
                page, valid = page_n, valid_n
                page_n, valid_n = _tile_pages(bt_ptr, idx_ptr, ok_ptr, b * stride_bt, e0, p0 + PAGES, p_hi, seq_len,
                                              t_lo, offs, S, SELECTED, SEL_VALID, HAS_SINK)
            else:
                page, valid = _tile_pages(bt_ptr, idx_ptr, ok_ptr, b * stride_bt, e0, p0, p_hi, seq_len, t_lo, offs,
                                          S, SELECTED, SEL_VALID, HAS_SINK)
            k_row, ks_row, v_row, vs_row = _kv_rows(page, h, in_page, ad_k, ad_ks, ad_v, ad_vs, Hkv, S, ALT)
            k, ks = _tile(k_ptr, ks_ptr, k_row, ks_row, valid, K_MODE, D, K_GROUP, BLOCK_N, BIAS, half)
            if V_PARTS == 1:  # (V_PARTS 4: the sets are loaded at the P @ V product below)
                v, vs = _tile(v_ptr, vs_ptr, v_row, vs_row, valid, V_MODE, D, V_GROUP, BLOCK_N, BIAS, half)
            if K_MODE == MODE_PLAIN or q.dtype == tl.float32:
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [G_PAD, BLOCK_N]
            else:  # fp16 code tiles: the dot in fp16 (q cast once), no conversion of the tile
                s = tl.dot(q.to(tl.float16), tl.trans(k), input_precision=DOT_PREC)
            if K_MODE == MODE_INT8 or K_MODE == MODE_FP8:
                s = s * ks[None, :]
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if V_PARTS == 4:
                v0, v1, v2, v3, vs = _int8_parts(v_ptr, vs_ptr, v_row, vs_row, valid, D)
                p16 = (p * vs[None, :]).to(tl.float16)
                acc0 = tl.dot(p16, v0, acc0 * alpha[:, None])
                acc1 = tl.dot(p16, v1, acc1 * alpha[:, None])
                acc2 = tl.dot(p16, v2, acc2 * alpha[:, None])
                acc3 = tl.dot(p16, v3, acc3 * alpha[:, None])
            else:
                if V_MODE == MODE_INT8 or V_MODE == MODE_FP8:
                    p = p * vs[None, :]
                if V_MODE == MODE_PLAIN or q.dtype == tl.float32:
                    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
                else:
                    pv = tl.dot(p.to(tl.float16), v, input_precision=DOT_PREC)
                acc = acc * alpha[:, None] + pv
            m_i = m_new

        if V_PARTS == 4:
            acc = _join4(acc0, acc1, acc2, acc3, G_PAD, D)

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty split (or seq_len 0): acc is 0, so is o
        o = acc / l_safe[:, None]
        hm = g < G
        dst = o_ptr + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + d[None, :]
        tl.store(dst, o.to(o_ptr.dtype.element_ty), mask=hm[:, None])
        if not SINGLE:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(lse_ptr + (b * Hkv * G + heads) * num_splits + sp, lse, mask=hm)

    @triton.jit(do_not_specialize=["Hq", "num_splits"])
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, Hq, num_splits, D: tl.constexpr,
                      CHUNK: tl.constexpr, ROTATE: tl.constexpr = False, INV_SQRT_D: tl.constexpr = 1.0,
                      PDL: tl.constexpr = False):
        """One (sequence, query head): out = sum_s exp2(lse_s - lse) * part_s (all -inf: zeros);
        ROTATE: times R (PagePool.native_out; kernels/hadamard.py's transform, 1 / sqrt(D) = INV_SQRT_D)."""
        wait_before_reads(PDL)
        b = tl.program_id(0)
        hq = tl.program_id(1)
        base = (b * Hq + hq) * num_splits
        c = tl.arange(0, CHUNK)
        d = tl.arange(0, D)
        m = tl.full([CHUNK], float("-inf"), tl.float32)
        for s0 in range(0, num_splits, CHUNK):
            m = tl.maximum(m, tl.load(lse_ptr + base + s0 + c, mask=s0 + c < num_splits, other=float("-inf")))
        m_max = tl.max(m, axis=0)
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
        acc = tl.zeros([D], tl.float32)
        tot = tl.zeros([CHUNK], tl.float32)
        for s0 in range(0, num_splits, CHUNK):
            mk = s0 + c < num_splits
            w = tl.exp2(tl.load(lse_ptr + base + s0 + c, mask=mk, other=float("-inf")) - m_use)  # [CHUNK]
            part = tl.load(part_ptr + (base + s0 + c)[:, None] * D + d[None, :], mask=mk[:, None], other=0.0)
            acc += tl.sum(w[:, None] * part, axis=0)
            tot += w
        total = tl.sum(tot, axis=0)
        o = acc / tl.where(total == 0.0, 1.0, total)
        if ROTATE:
            o = tl.reshape(fwht(tl.reshape(o, [1, D]), 1, D), [D]) * INV_SQRT_D
        tl.store(out_ptr + b * stride_ob + hq * stride_oh + d, o.to(out_ptr.dtype.element_ty))

    def _mode(codec: Codec) -> tl.constexpr:
        if isinstance(codec, PlainCodec):
            return MODE_PLAIN
        if isinstance(codec, Int8Codec):
            return MODE_INT8
        if isinstance(codec, Fp8Codec):
            return MODE_FP8
        if isinstance(codec, Int4Codec):
            return MODE_INT4
        raise ValueError(f"paged_decode: no decode path for codec {type(codec).__name__}")


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pages_per_tile(head_dim: int, page_size: int, elem_bytes: int, tile_bytes: int = 0) -> int:
    """Pages gathered per loop iteration: BLOCK_N = this * page_size tokens (~TILE_BYTES a tile)."""
    tokens = min(MAX_BLOCK_N, (tile_bytes or TILE_BYTES) // (head_dim * elem_bytes))
    return max(1, tokens // page_size)


def _codec_constants(fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> dict[str, object]:
    """The tl.constexpr arguments that say how K / V tiles are decoded (both kernels)."""
    groups = [c.group_for(head_dim) if isinstance(c, Int4Codec) else 1 for c in (fmt.k_codec, fmt.v_codec)]
    return dict(K_MODE=_mode(fmt.k_codec), V_MODE=_mode(fmt.v_codec), K_GROUP=groups[0], V_GROUP=groups[1],
                BIAS=INT4_BIAS, DOT_PREC=FP32_DOT if dtype == torch.float32 else "tf32")  # (16-bit: ignored)


def split_constants(fmt: KVFormat, head_dim: int, page_size: int, gqa: int, dtype: torch.dtype,
                    has_sink: bool, single: bool, num_splits: int = 0,
                    native: "NativeDomain | None" = None, selected: bool = False,
                    sel_valid: bool = False, alt: bool = False) -> dict[str, object]:
    """The tl.constexpr arguments of the split kernel (one compiled variant per distinct dict).
    Plain pages with few splits (long loops: large batches) take LONG_TILE_BYTES tiles.
    selected / sel_valid: per-(row, kv head) page lists (retrieval_attention), with a validity table."""
    long_loops = not fmt.quantized and 0 < num_splits <= LONG_LOOP_SPLITS
    pages = pages_per_tile(head_dim, page_size, torch.empty((), dtype=dtype).element_size(),
                           LONG_TILE_BYTES if long_loops else TILE_BYTES)
    fold = dict(Q_SMOOTH=False, Q_ROTATE=False, INV_SQRT_D=1.0)
    if native is not None:
        fold = dict(Q_SMOOTH=native.channel_scale is not None, Q_ROTATE=native.rotate_q,
                    INV_SQRT_D=inv_sqrt_f32(head_dim))
    return dict(S=page_size, D=head_dim, G_PAD=max(MIN_DOT_ROWS, _pow2(gqa)), PAGES=pages,
                HAS_SINK=has_sink, SINGLE=single, SELECTED=selected, SEL_VALID=sel_valid, ALT=alt, **fold,
                V_PARTS=code_parts(fmt.v_codec, head_dim, dtype),
                PREFETCH_IDS=PREFETCH_AT_ONE_STAGE and decode_stages(fmt) == 1,
                **_codec_constants(fmt, head_dim, dtype))


def code_parts(codec: Codec, head_dim: int, dtype: torch.dtype) -> int:
    """Column sets the split kernel keeps a V code tile in (1: one tile, `_tile`): int8 codes with a
    16-bit q as the four byte positions of a 32-bit word, each set a tl.dot of its own (>= 16
    columns), so nothing interleaves the decoded codes back into d order inside the page loop."""
    if not PARTS_DECODE or dtype == torch.float32 or not _is_pow2(head_dim):
        return 1
    return 4 if isinstance(codec, Int8Codec) and head_dim // 4 >= MIN_DOT_ROWS else 1


def decode_stages(fmt: KVFormat) -> int:
    """Pipeline stages of the split kernel for pages in `fmt` (DECODE_STAGES, else NUM_STAGES)."""
    return DECODE_STAGES.get(fmt.name, NUM_STAGES)


def choose_num_splits(batch: int, kv_heads: int, max_context: int, page_size: int, num_sms: int) -> int:
    """Splits per (sequence, kv head) for paged_decode: enough programs for the GPU, none tiny.

    Depends on shapes only, never on data: under CUDA graphs pass the capacity (the largest
    context the graph serves) as max_context; eagerly, the batch's longest context.
    batch * kv_heads programs already filling PROGRAMS_PER_SM * num_sms need no split; else
    split until they do, keeping each split >= MIN_SPLIT_TOKENS tokens (and >= 1 page).
    """
    work = max(1, batch * kv_heads)
    want = -(-PROGRAMS_PER_SM * max(1, num_sms) // work)
    most = max(1, min(-(-max_context // MIN_SPLIT_TOKENS), -(-max_context // max(1, page_size)), MAX_SPLITS))
    return max(1, min(want, most))


def _check_pages(who: str, q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat) -> None:
    """q: [rows, Hq, D] against one pool layer's shapes (both kernels)."""
    if q.dim() != 3:
        raise ValueError(f"{who}: q must be [rows, Hq, D], got {tuple(q.shape)}")
    _, hq, d = q.shape
    _, hkv, s, _ = st["k"].shape
    if fmt.head_dim_of(st) != d:
        raise ValueError(f"{who}: q head_dim {d} != stored head_dim {fmt.head_dim_of(st)}")
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"{who}: head_dim must be a power of two >= 16, got {d}")
    if not _is_pow2(s):
        raise ValueError(f"{who}: page_size must be a power of two, got {s}")
    if hq % hkv:
        raise ValueError(f"{who}: {hq} query heads are not a multiple of {hkv} kv heads")


def _check(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, block_table: torch.Tensor,
           seq_lens: torch.Tensor, num_splits: int) -> None:
    _check_pages("paged_decode", q, st, fmt)
    bsz = q.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(f"paged_decode: block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match batch {bsz}")
    if num_splits < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, got {num_splits}")


@dataclass(frozen=True)
class NativeDomain:
    """What paged_decode folds in when a rotating pool's q arrives raw (PagePool.native_q /
    native_out done inside the kernels: two launches fewer a layer).

    channel_scale: [Hkv, D] K smoothing scale (or None); rotate_q / rotate_out: R (formats.hadamard)
    applied to q on the way in / to the output on the way out."""

    channel_scale: torch.Tensor | None
    rotate_q: bool
    rotate_out: bool


@dataclass(frozen=True)
class AltPages:
    """A second page source for the kernels: a page id p < 0 in a block table or page list
    names page -1 - p of `st` (host_ref(h) = -1 - h, kvtier/kv/manager.py).

    st: one layer of a pool with the compute pool's page layout and dtypes (same [Hkv, S, ...]
    per page): pinned host pages, which the GPU reads over the bus (UVA; each byte once: decode),
    or a device staging copy of them (prefill: the chunk's query tiles read each page many times);
    sink: that pool's (sink_k, sink_v, sink_slot) for its pages (pinned on the host too), or None.

    The kernels take no second set of pointers: each alternate tensor is addressed by its
    distance from the compute pool's tensor, in rows of that tensor (`alt_offsets`); under UVA a
    pinned host address is a device address. A launch reads `st` as it is at that moment."""

    st: dict[str, torch.Tensor]
    sink: "Sink | None" = None


def _rows_apart(alt: torch.Tensor, base: torch.Tensor, name: str) -> int:
    """(alt's address - base's) in rows of base (its elements past dim 2; whole elements for
    the sink tables): exact, or a ValueError (the kernels index both by one row number)."""
    if alt.dtype != base.dtype or tuple(alt.shape[1:]) != tuple(base.shape[1:]) or not alt.is_contiguous():
        raise ValueError(f"AltPages: {name} must be contiguous {base.dtype} [*, {tuple(base.shape[1:])}], "
                         f"got {alt.dtype} {tuple(alt.shape)}")
    row = base.element_size() * (math.prod(base.shape[3:]) if base.dim() > 3 else 1)
    gap = alt.data_ptr() - base.data_ptr()
    if gap % row:
        raise ValueError(f"AltPages: {name} is not a whole number of {row}-byte rows from the pool's")
    return gap // row


def alt_offsets(st: dict[str, torch.Tensor], sink: "Sink | None", alt: AltPages | None) -> dict[str, int]:
    """The kernels' ad_* arguments: each alternate tensor's distance from the pool's (zeros without alt)."""
    if alt is None:
        return dict.fromkeys(ALT_ARGS, 0)
    if set(alt.st) != set(st):
        raise ValueError(f"AltPages: tensors {sorted(alt.st)} differ from the pool's {sorted(st)}")
    out = {}
    for arg, name in (("ad_k", "k"), ("ad_ks", "k_scale"), ("ad_v", "v"), ("ad_vs", "v_scale")):
        key = name if name in st else name[0]  # plain formats: the data tensor stands in for the scales
        out[arg] = _rows_apart(alt.st[key], st[key], key)
    out["ad_sk"] = out["ad_sv"] = out["ad_slot"] = 0
    if sink is not None:
        if alt.sink is None:
            raise ValueError("AltPages: the pool has sink rows, the alternate source has none")
        for arg, a, b, name in zip(("ad_sk", "ad_sv", "ad_slot"), alt.sink, sink, ("sink_k", "sink_v", "sink_slot")):
            out[arg] = _rows_apart(a, b, name)  # [slots, Hkv, D] / [pages]: rows of one element
    return out


def with_alt(st: dict[str, torch.Tensor], sink: "Sink | None", table: torch.Tensor,
             alt: AltPages | None) -> tuple[dict[str, torch.Tensor], "Sink | None", torch.Tensor]:
    """For the references: one pool holding the pool's pages then the alternate ones (on the
    pool's device), its sink tables joined the same way, and `table` with each negative id
    -1 - a renamed to num_pages + a."""
    if alt is None:
        return st, sink, table
    dev, n = st["k"].device, st["k"].shape[0]
    joined = {name: torch.cat([t, alt.st[name].to(dev)]) for name, t in st.items()}
    if sink is not None:
        slots = sink[0].shape[0]
        aslot = alt.sink[2].to(dev)
        sink = (torch.cat([sink[0], alt.sink[0].to(dev)]), torch.cat([sink[1], alt.sink[1].to(dev)]),
                torch.cat([sink[2], torch.where(aslot >= 0, aslot + slots, aslot)]))
    t = table.long()
    return joined, sink, torch.where(t < 0, n - 1 - t, t).to(table.dtype)


def fold_native_supported(head_dim: int) -> bool:
    """NativeDomain folding needs R to be one Sylvester block: a power-of-two head_dim >= 16."""
    return HAVE_TRITON and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def paged_decode(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_splits: int, sink: Sink | None = None,
                 out: torch.Tensor | None = None, native: NativeDomain | None = None,
                 alt: AltPages | None = None) -> torch.Tensor:
    """Decode attention of one query row per sequence over its pages, read in place.

    q: [B, Hq, D] (bf16 / fp16 / fp32) in the stored domain (PagePool.native_q), or raw with
    `native` (the kernels move it, and the output back; fold_native_supported);
    st: one pool layer (`pool.layers[layer]`) in `fmt`'s layout, [num_pages, Hkv, S, ...];
    block_table: [B, max_pages] int32 page ids (entries past a sequence's pages: any valid id);
    seq_lens: [B] int32 keys per sequence (0 -> a zero output row);
    sink: (sink_k, sink_v, sink_slot) of the pool's layer, or None;
    num_splits: splits per (sequence, kv head), from shapes only (`choose_num_splits`);
    out: optional [B, Hq, D] destination (last dim contiguous);
    alt: the pages that negative block-table entries name (AltPages; e.g. the pinned host tier).
    -> [B, Hq, D] in q.dtype, in the stored domain (PagePool.native_out maps it back).

    No host synchronisation and no data-dependent shapes: capturable in a CUDA graph.
    """
    if not HAVE_TRITON:
        raise RuntimeError("paged_decode needs Triton; use paged_decode_reference on CPU")
    _check(q, st, fmt, block_table, seq_lens, num_splits)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    return launch_decode(q, st, fmt, block_table, seq_lens, scale, num_splits, sink, out, native, alt=alt)


@dataclass(frozen=True)
class PageLists:
    """Per-(row, kv head) page lists for the split kernel's SELECTED mode (all contiguous, on q's device).

    page_idx: [B, Hkv, n_sel] page index of each entry within its sequence (< 0: no entry);
    valid: [B, Hkv, n_sel] uint8 (0: no entry), or None (page_idx alone says)."""

    page_idx: torch.Tensor
    valid: torch.Tensor | None


def launch_decode(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, table: torch.Tensor,
                  lens: torch.Tensor, scale: float, num_splits: int, sink: Sink | None,
                  out: torch.Tensor | None, native: NativeDomain | None,
                  lists: PageLists | None = None, alt: AltPages | None = None) -> torch.Tensor:
    """The split (+ merge) launch of paged_decode (lists None: table [B, max_pages] block table)
    and of retrieval_attention.paged_decode_selected (table [B, Hkv, n_sel] page ids); inputs
    already checked, tables contiguous along their last dim; alt: where negative ids point."""
    bsz, hq, d = q.shape
    _, hkv, s, _ = st["k"].shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    rotate_out = native is not None and native.rotate_out
    if native is not None and num_splits >= FOLD_MAX_SPLITS:  # long splits: q moved in a launch of its own
        from kvtier.kernels.kv_transform import transform_rows
        if native.rotate_q or native.channel_scale is not None:
            q = transform_rows(q, native.rotate_q, native.channel_scale)
        native = None
    single = num_splits == 1
    if single:  # the split kernel writes the output itself
        dst, lse, strides = out, out, (out.stride(0), out.stride(1), 0)
    else:
        dst = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
        strides = (dst.stride(0), dst.stride(1), dst.stride(2))
    sk, sv, slot = sink if sink is not None else (q, q, table)  # unused placeholders
    cs = q  # placeholder when nothing is folded
    if native is not None:
        if not fold_native_supported(d):
            raise ValueError(f"paged_decode: cannot fold the stored domain at head_dim {d}")
        cs = native.channel_scale if native.channel_scale is not None else q
    idx, ok, n_sel = table, table, 0  # placeholders for whole sequences
    if lists is not None:
        idx, n_sel = lists.page_idx, table.shape[-1]
        ok = lists.valid if lists.valid is not None else table
    launch = pdl.launch_args(q.device)
    _split_kernel[(bsz, hkv, num_splits)](
        q, st["k"], st.get("k_scale", st["k"]), st["v"], st.get("v_scale", st["v"]), table, lens, idx, ok,
        sk.contiguous(), sv.contiguous(), slot, dst, lse, cs, scale * LOG2E,
        q.stride(0), q.stride(1), table.stride(0), *strides, hkv, hq // hkv, num_splits, n_sel,
        **alt_offsets(st, sink, alt),
        **split_constants(fmt, d, s, hq // hkv, q.dtype, sink is not None, single, num_splits, native,
                          selected=lists is not None, sel_valid=lists is not None and lists.valid is not None,
                          alt=alt is not None),
        num_warps=NUM_WARPS, num_stages=decode_stages(fmt), **launch)
    merge_rotates = rotate_out and native is not None and not single
    if not single:
        _merge_kernel[(bsz, hq)](dst, lse, out, out.stride(0), out.stride(1), hq, num_splits, D=d,
                                 CHUNK=MERGE_CHUNK, ROTATE=merge_rotates, INV_SQRT_D=inv_sqrt_f32(d),
                                 num_warps=NUM_WARPS, **launch)
    if rotate_out and not merge_rotates:  # one split (it wrote the output itself) or long splits
        from kvtier.kernels.kv_transform import transform_rows
        transform_rows(out, True, out=out)  # in place (was a new tensor and a copy: one launch more a layer)
    return out


def _decode_pages(codec: Codec, st: dict[str, torch.Tensor], kv: str, pages: torch.Tensor,
                  head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pages [P] of K ("k") or V ("v") decoded by the reference codec -> [P, Hkv, S, D] in dtype."""
    parts = {suffix: st[kv + suffix].index_select(0, pages) for suffix in codec.parts(head_dim)}
    return codec.decode(parts, dtype)


def _sequence_kv(st: dict[str, torch.Tensor], fmt: KVFormat, pages: torch.Tensor, n: int, head_dim: int,
                 dtype: torch.dtype, sink: Sink | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values 0..n-1 of one sequence (pages: its block-table row, n > 0) decoded to
    dtype, token 0 from the sink slot when its first page has one -> k, v: [Hkv, n, D]."""
    hkv, s = st["k"].shape[1], st["k"].shape[2]
    pages = pages[:math.ceil(n / s)]
    k, v = (_decode_pages(c, st, kv, pages, head_dim, dtype).transpose(0, 1).reshape(hkv, -1, head_dim)[:, :n]
            for kv, c in (("k", fmt.k_codec), ("v", fmt.v_codec)))
    if sink is not None:
        slot = int(sink[2][pages[0]])
        if slot >= 0:
            k, v = k.clone(), v.clone()
            k[:, 0], v[:, 0] = sink[0][slot].to(k.dtype), sink[1][slot].to(v.dtype)
    return k, v


def paged_decode_reference(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sink: Sink | None = None, alt: AltPages | None = None) -> torch.Tensor:
    """paged_decode in plain PyTorch (same arguments; any device; syncs on seq_lens).

    Pages are decoded by the format's codecs to q.dtype (as PagePool.read(native=True)
    does in the compute dtype), token 0 taken from the sink slot when its first page has
    one, then an fp32 softmax: q: [B, Hq, D] -> [B, Hq, D] in q.dtype.
    """
    st, sink, block_table = with_alt(st, sink, block_table, alt)
    bsz, hq, d = q.shape
    hkv = st["k"].shape[1]
    out = torch.zeros_like(q)
    table = block_table.long()
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k, v = _sequence_kv(st, fmt, table[b], n, d, q.dtype, sink)  # [Hkv, n, D]
        qg = q[b].float().view(hkv, hq // hkv, d)  # query head h reads kv head h // (Hq / Hkv)
        p = torch.softmax(qg @ k.float().transpose(1, 2) * scale, dim=-1)  # [Hkv, G, n]
        out[b] = (p @ v.float()).reshape(hq, d).to(q.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Prefill: varlen causal attention of many new rows per sequence over its pages.
#
# One program = BLOCK_Q new rows (tokens) of one sequence x the G query heads of one kv head,
# packed as M = BLOCK_Q * G_PAD rows of one tl.dot operand (row r: token r // G_PAD, head
# r % G_PAD), so each K/V tile is read once for all of them. Grid (Hkv, B, cdiv(max_new, BLOCK_Q)),
# tile index reversed: the latest rows (the most keys) start first.
#
#   keys of seq b:  0 ............................ first  last ..... ctx-1
#                   | full tiles (no mask) |  diagonal tiles  |  (not read)
#                   0                   full_end             last+1
#   first / last: positions of the program's first / last real row (new row i of seq b sits
#   at ctx - n_b + i); full_end = (first + 1) rounded down to BLOCK_N: keys every row sees.
# ---------------------------------------------------------------------------------------------

# Per (compute-dtype bytes, head_dim bound): (BLOCK_M rows = tokens x heads, BLOCK_N keys, warps,
# stages). Compiled for sm_90 offline (wgmma, cp.async page gathers; REG / STACK from cuobjdump):
# - 16-bit, D <= 128: the FlashAttention-2 / Triton-tutorial Hopper shape, 128 x 64, 8 warps,
#   3 stages: 186 registers (bf16 pages) to 247 (k8v4 with sinks), no spills, 99 KB shared.
#   128 x 128 also fits (254 registers, 165 KB) for bf16 but spills for k8v4.
# - 16-bit, D = 256: 128 x 32, 8 warps, 2 stages: 239-255 registers, no spills (4 warps spill).
# - fp32 (tf32x3: three dots, twice the bytes): spills at every shape tried; the smallest
#   tiles spill least. fp32 pools are for exactness, not speed.
# Measured on the H200 (tests/gpu/test_paged_prefill.py -k print, 2048 new rows, Hq 32 / Hkv 8):
# 128 x 128 beat 128 x 64 at 8K and 32K context, bf16 (311 / 370 vs 292 / 307 TFLOP/s) and k8v4
# (143 / 151 vs 144 / 134), so it is the 16-bit D <= 128 default despite k8v4's register spills.
# Since int8 / fp8 tiles are scaled as they are decoded (_tile's SCALED), 8-bit keys went the
# other way (H100, the same sweep): k8v4 128 x 64 221 / 206 TFLOP/s at 8K / 32K against 128 x 128
# 160 / 169, while bf16 stayed best at 128 x 128 (347 / 381 vs 297 / 321). So 8-bit keys
# (int8, fp8, k8v4) take PREFILL_BLOCKS_8BIT_K.
PREFILL_BLOCKS = {
    (2, 128): (128, 128, 8, 3),
    (2, 256): (128, 32, 8, 2),
    (4, 128): (32, 32, 4, 2),
    (4, 256): (16, 16, 4, 2),
}
PREFILL_BLOCKS_8BIT_K = (128, 64, 8, 3)  # 16-bit compute, D <= 128

if HAVE_TRITON:
    @triton.jit
    def _prefill_tile(acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, h, n0, ctx, t_lo, pos, qk_scale,
                      ad_k, ad_ks, ad_v, ad_vs,
                      Hkv, S: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, K_MODE: tl.constexpr,
                      V_MODE: tl.constexpr, K_GROUP: tl.constexpr, V_GROUP: tl.constexpr, BIAS: tl.constexpr,
                      CAUSAL: tl.constexpr, HAS_SINK: tl.constexpr, DOT_PREC: tl.constexpr, ALT: tl.constexpr):
        """Keys n0 .. n0 + BLOCK_N - 1 into the softmax state (acc [M, D], m_i / l_i [M], log2 units).

        pos: [M] each row's position (CAUSAL: row r sees keys <= pos[r]); t_lo: 1 when the
        sink slot supplies key 0 (then the page's row 0 is skipped).
        """
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = tok < ctx
        page = tl.load(bt_row + tok // S, mask=valid, other=0).to(tl.int64)
        # 16-bit q: code tiles come decoded to fp16 (word-wise, no per-code I2F) and are dotted in
        # fp16, as in the decode kernel; plain tiles and fp32 q as stored
        k_half: tl.constexpr = q.dtype != tl.float32 and K_MODE != MODE_PLAIN
        v_half: tl.constexpr = q.dtype != tl.float32 and V_MODE != MODE_PLAIN
        k, ks, v, vs = _kv_tiles(k_ptr, ks_ptr, v_ptr, vs_ptr, page, h, tok % S, valid, ad_k, ad_ks, ad_v, ad_vs,
                                 Hkv, S, D, K_MODE, V_MODE, K_GROUP, V_GROUP, BLOCK_N, BIAS, k_half, v_half, ALT)
        if k_half:
            s = tl.dot(q.to(tl.float16), tl.trans(k), input_precision=DOT_PREC)  # [M, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [M, BLOCK_N]
        if (K_MODE == MODE_INT8 or K_MODE == MODE_FP8) and not k_half:
            s = s * (ks * qk_scale)[None, :]  # the row scales times the softmax scale: one multiply
            sc = 1.0
        else:
            sc = qk_scale  # applied in the exp2 argument: one FMA (qk_scale > 0 keeps the max)
        if CAUSAL:
            see = tok[None, :] <= pos[:, None]  # keys past ctx are past every real row's position
            if HAS_SINK:
                see = see & (tok >= t_lo)[None, :]
            s = tl.where(see, s, float("-inf"))
        elif HAS_SINK:
            s = tl.where((tok >= t_lo)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * sc)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s * sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if (V_MODE == MODE_INT8 or V_MODE == MODE_FP8) and not v_half:
            p = p * vs[None, :]
        if v_half:
            acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None], input_precision=DOT_PREC)
        else:
            acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PREC)
        return acc, m_new, l_i

    # Runtime ints that may be 1 or multiples of 16: not specialised on value (one compile serves all).
    @triton.jit(do_not_specialize=["Hkv", "G", "stride_bt", *ALT_ARGS])
    def _prefill_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_ptr, lens_ptr, qsl_ptr, sk_ptr, sv_ptr, slot_ptr,
                        o_ptr, qk_scale, stride_qt, stride_qh, stride_bt, stride_ot, stride_oh, Hkv, G,
                        ad_k, ad_ks, ad_v, ad_vs, ad_sk, ad_sv, ad_slot,
                        S: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                        BLOCK_N: tl.constexpr, K_MODE: tl.constexpr, V_MODE: tl.constexpr, K_GROUP: tl.constexpr,
                        V_GROUP: tl.constexpr, BIAS: tl.constexpr, HAS_SINK: tl.constexpr,
                        DOT_PREC: tl.constexpr, ALT: tl.constexpr):
        """One (kv head h, sequence b, query tile): BLOCK_Q new rows x G query heads of h.
        ALT: negative page ids name pages of the alternate source (as in _split_kernel)."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        m0 = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_Q  # heaviest tiles first
        q0 = tl.load(qsl_ptr + b)
        n_new = tl.load(qsl_ptr + b + 1) - q0
        ctx = tl.load(lens_ptr + b)
        M: tl.constexpr = BLOCK_Q * G_PAD
        r = tl.arange(0, M)
        t = m0 + r // G_PAD  # new-row index within the sequence
        heads = h * G + r % G_PAD  # query head h * G + g reads kv head h
        live = (t < n_new) & (r % G_PAD < G)
        d = tl.arange(0, D)
        rows = (q0 + t).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=live[:, None], other=0.0)  # [M, D]
        pos = ctx - n_new + t
        m_i = tl.full([M], float("-inf"), tl.float32)
        l_i = tl.zeros([M], tl.float32)
        acc = tl.zeros([M, D], tl.float32)
        bt_row = bt_ptr + b * stride_bt
        t_lo = 0
        if HAS_SINK:
            slot, s_alt = _page_slot(tl.load(bt_ptr + b * stride_bt).to(tl.int64), slot_ptr, ad_slot, ALT)
            t_lo = tl.where(slot >= 0, 1, 0)
            m_i, l_i, acc = _sink_start(q, sk_ptr + tl.where(s_alt, ad_sk, 0), sv_ptr + tl.where(s_alt, ad_sv, 0),
                                        (tl.maximum(slot, 0) * Hkv + h) * D, slot >= 0, qk_scale, m_i, l_i, acc, D)
        first = ctx - n_new + m0
        busy = m0 < n_new  # an empty tile (a sequence with fewer new rows) reads nothing
        end = tl.where(busy, ctx - n_new + tl.minimum(m0 + BLOCK_Q, n_new), 0)  # last row's position + 1
        full_end = tl.where(busy, (first + 1) // BLOCK_N * BLOCK_N, 0)
        for n0 in range(0, full_end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, h, n0, ctx, t_lo,
                                          pos, qk_scale, ad_k, ad_ks, ad_v, ad_vs, Hkv, S, D, BLOCK_N, K_MODE, V_MODE,
                                          K_GROUP, V_GROUP,
                                          BIAS, False, HAS_SINK, DOT_PREC, ALT)
        for n0 in range(full_end, end, BLOCK_N):
            acc, m_i, l_i = _prefill_tile(acc, m_i, l_i, q, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_row, h, n0, ctx, t_lo,
                                          pos, qk_scale, ad_k, ad_ks, ad_v, ad_vs, Hkv, S, D, BLOCK_N, K_MODE, V_MODE,
                                          K_GROUP, V_GROUP,
                                          BIAS, True, HAS_SINK, DOT_PREC, ALT)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=live[:, None])


def prefill_blocks(fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_N keys, num_warps, num_stages) of the prefill kernel (PREFILL_BLOCKS)."""
    size = 2 if torch.empty((), dtype=dtype).element_size() <= 2 else 4
    if size == 2 and head_dim <= 128 and isinstance(fmt.k_codec, (Int8Codec, Fp8Codec)):
        return PREFILL_BLOCKS_8BIT_K
    return PREFILL_BLOCKS[(size, 128 if head_dim <= 128 else 256)]


def prefill_constants(fmt: KVFormat, head_dim: int, page_size: int, gqa: int, dtype: torch.dtype,
                      has_sink: bool, block_m: int, block_n: int, alt: bool = False) -> dict[str, object]:
    """The tl.constexpr arguments of the prefill kernel; BLOCK_M rows = BLOCK_Q tokens x G_PAD heads."""
    g_pad = _pow2(gqa)
    return dict(S=page_size, D=head_dim, G_PAD=g_pad, BLOCK_Q=max(1, block_m // g_pad), BLOCK_N=block_n,
                HAS_SINK=has_sink, ALT=alt, **_codec_constants(fmt, head_dim, dtype))


def paged_prefill(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sink: Sink | None = None,
                  max_new: int | None = None, blocks: tuple[int, int, int, int] | None = None,
                  alt: AltPages | None = None) -> torch.Tensor:
    """Causal attention of B sequences' packed new rows over their pages, read in place.

    q: [T, Hq, D] (bf16 / fp16 / fp32) in the stored domain (PagePool.native_q);
    st: one pool layer in `fmt`'s layout, already holding the new rows' K/V;
    block_table: [B, max_pages] int32; seq_lens: [B] int32 context after this step;
    query_start_loc: [B+1] int32, sequence b's new rows are q[qsl[b]:qsl[b+1]], its last
    n_b = qsl[b+1] - qsl[b] positions: row i sits at seq_lens[b] - n_b + i, sees keys <= it;
    sink: (sink_k, sink_v, sink_slot) as paged_decode;
    max_new: max_b n_b or any bound above it (rows past it are not computed), sizes the grid;
    None: read from query_start_loc (a host sync);
    blocks: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of prefill_blocks' (tests, tuning);
    alt: the pages that negative block-table entries name (AltPages: a device staging copy of
    host pages; each key tile is read by every query tile, so not the host pages themselves).
    -> [T, Hq, D] in q.dtype, in the stored domain (PagePool.native_out maps it back).
    """
    if not HAVE_TRITON:
        raise RuntimeError("paged_prefill needs Triton; use paged_prefill_reference on CPU")
    _check_pages("paged_prefill", q, st, fmt)
    n_rows, hq, d = q.shape
    _, hkv, s, _ = st["k"].shape
    bsz = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != bsz or query_start_loc.shape != (bsz + 1,):
        raise ValueError(f"paged_prefill: block_table {tuple(block_table.shape)} / query_start_loc "
                         f"{tuple(query_start_loc.shape)} do not match batch {bsz}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    out = torch.empty((n_rows, hq, d), dtype=q.dtype, device=q.device)
    if max_new is None:
        max_new = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if bsz else 0
    if n_rows == 0 or bsz == 0 or max_new <= 0:
        return out
    block_m, block_n, warps, stages = blocks or prefill_blocks(fmt, d, q.dtype)
    const = prefill_constants(fmt, d, s, hq // hkv, q.dtype, sink is not None, block_m, block_n, alt is not None)
    sk, sv, slot = sink if sink is not None else (q, q, block_table)  # unused placeholders
    grid = (hkv, bsz, triton.cdiv(max_new, const["BLOCK_Q"]))
    _prefill_kernel[grid](
        q, st["k"], st.get("k_scale", st["k"]), st["v"], st.get("v_scale", st["v"]), block_table, seq_lens,
        query_start_loc, sk.contiguous(), sv.contiguous(), slot, out, scale * LOG2E, q.stride(0), q.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), hkv, hq // hkv, **alt_offsets(st, sink, alt), **const,
        num_warps=warps, num_stages=stages)
    return out


def paged_prefill_reference(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat,
                            block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            scale: float, sink: Sink | None = None, alt: AltPages | None = None) -> torch.Tensor:
    """paged_prefill in plain PyTorch (same arguments; any device; syncs on the lengths).

    Each sequence's pages decoded by the codecs to q.dtype (sink row at token 0 as
    paged_decode_reference), then a causal fp32 softmax: q: [T, Hq, D] -> [T, Hq, D] in q.dtype.
    """
    st, sink, block_table = with_alt(st, sink, block_table, alt)
    _, hq, d = q.shape
    hkv = st["k"].shape[1]
    out = torch.zeros_like(q)
    table = block_table.long()
    qsl = query_start_loc.tolist()
    for b, ctx in enumerate(seq_lens.tolist()):
        lo, hi = qsl[b], qsl[b + 1]
        if hi == lo:
            continue
        k, v = _sequence_kv(st, fmt, table[b], ctx, d, q.dtype, sink)  # [Hkv, ctx, D]
        qg = q[lo:hi].float().view(hi - lo, hkv, hq // hkv, d).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
        sc = qg @ k.float().transpose(1, 2)[:, None] * scale  # [Hkv, G, n, ctx]
        pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)[:, None]  # row i's position
        sc.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > pos, float("-inf"))
        o = torch.softmax(sc, dim=-1) @ v.float()[:, None]  # [Hkv, G, n, D]
        out[lo:hi] = o.permute(2, 0, 1, 3).reshape(hi - lo, hq, d).to(q.dtype)
    return out
