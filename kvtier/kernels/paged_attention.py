"""Split-K ("flash-decoding") paged decode attention that reads every KV format in place.

One query row per sequence (the newest token) attends over the sequence's
pages straight from a PagePool layer's storage: plain bf16/fp16/fp32 pages,
or int8 / fp8 / int4 codes with their fp16 scales, decoded in registers with
the math of kvtier/kernels/kv_quant.py (value = code * scale; int4 nibbles
biased by 8, one scale per group). Nothing is rotated or smoothed here: q comes
in the stored domain (PagePool.native_q) and the output goes back out through
PagePool.native_out, as DensePagedAttention does with native reads.

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

`paged_decode_reference` is the same computation in plain PyTorch (the codecs of
kvtier/kv/formats.py); tests/layers/paged_attention_cases.py checks one
against the other (TRITON_INTERPRET=1 on CPU, and on CUDA in tests/gpu).
"""

from __future__ import annotations

import math

import torch

from kvtier.kv.formats import INT4_BIAS, Codec, Fp8Codec, Int4Codec, Int8Codec, KVFormat, PlainCodec

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: only the reference and the heuristic are usable
    HAVE_TRITON = False

# (sink_k [num_slots, Hkv, D], sink_v [num_slots, Hkv, D], sink_slot [num_pages] int64 page -> slot or -1)
Sink = tuple[torch.Tensor, torch.Tensor, torch.Tensor]

# Bytes of one decoded K (or V) tile [BLOCK_N, D] in the compute dtype: 64 tokens at D = 128 in
# bf16. Compiled for sm_90 offline: 80-140 registers a thread, no spills, for every format at
# D = 64..256; fp32 at twice this spilled (D = 64: 128 B, D = 256: 5 KB of stack).
TILE_BYTES = 16384
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

if HAVE_TRITON:
    # Decode path of one codec (a tl.constexpr: each codec pair compiles its own kernel).
    MODE_PLAIN = tl.constexpr(0)  # stored values, any float dtype
    MODE_INT8 = tl.constexpr(1)  # int8 code * per-row fp16 scale
    MODE_FP8 = tl.constexpr(2)  # e4m3 byte * per-row fp16 scale
    MODE_INT4 = tl.constexpr(3)  # (nibble - 8) * per-group fp16 scale, two codes a byte

    @triton.jit
    def _tile(data_ptr, scale_ptr, row, valid, MODE: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_N: tl.constexpr, BIAS: tl.constexpr):
        """Rows of one layer's K or V pages -> (tile [BLOCK_N, D], row scale [BLOCK_N] fp32).

        row: [BLOCK_N] int64 row index (page * Hkv + head) * S + offset; valid: [BLOCK_N].
        int8 / fp8 come back as codes (exact in fp32 and in bf16/fp16) with their per-row
        scale, which the caller applies to the [G, BLOCK_N] scores or probabilities instead
        of the [BLOCK_N, D] tile (D times fewer multiplies). Plain tiles come back as stored,
        int4 tiles decoded in fp32 (their scales vary along D); both with scale 1.
        """
        rs = tl.full([BLOCK_N], 1.0, tl.float32)
        if MODE == MODE_INT4:
            NG: tl.constexpr = D // GROUP  # scales per row
            HG: tl.constexpr = GROUP // 2  # bytes per group
            r3 = row[:, None, None]
            m3 = valid[:, None, None]
            byte = r3 * (D // 2) + tl.arange(0, NG)[None, :, None] * HG + tl.arange(0, HG)[None, None, :]
            b = tl.load(data_ptr + byte, mask=m3, other=0).to(tl.int32)  # [BLOCK_N, NG, HG]
            sc = tl.load(scale_ptr + r3 * NG + tl.arange(0, NG)[None, :, None], mask=m3,
                         other=0.0).to(tl.float32)  # [BLOCK_N, NG, 1]
            lo = ((b & 0xF) - BIAS).to(tl.float32) * sc  # value 2i
            hi = ((b >> 4) - BIAS).to(tl.float32) * sc  # value 2i + 1
            tile = tl.reshape(tl.join(lo, hi), (BLOCK_N, D))  # interleaved back to d order
        else:
            x = tl.load(data_ptr + row[:, None] * D + tl.arange(0, D)[None, :], mask=valid[:, None], other=0)
            if MODE == MODE_PLAIN:
                tile = x
            else:
                if MODE == MODE_FP8:
                    tile = x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                else:
                    tile = x.to(tl.float32)
                rs = tl.load(scale_ptr + row, mask=valid, other=0.0).to(tl.float32)
        return tile, rs

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

    # Runtime ints that may be 1 or multiples of 16: not specialised on value (one compile serves all).
    @triton.jit(do_not_specialize=["Hkv", "G", "num_splits", "stride_bt"])
    def _split_kernel(q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, bt_ptr, lens_ptr, sk_ptr, sv_ptr, slot_ptr,
                      o_ptr, lse_ptr, qk_scale, stride_qb, stride_qh, stride_bt, stride_ob, stride_oh,
                      stride_os, Hkv, G, num_splits,
                      S: tl.constexpr, D: tl.constexpr, G_PAD: tl.constexpr, PAGES: tl.constexpr,
                      K_MODE: tl.constexpr, V_MODE: tl.constexpr, K_GROUP: tl.constexpr,
                      V_GROUP: tl.constexpr, BIAS: tl.constexpr, HAS_SINK: tl.constexpr,
                      SINGLE: tl.constexpr, DOT_PREC: tl.constexpr):
        """One (sequence b, kv head h, split sp): softmax partial of the G query heads of h."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        BLOCK_N: tl.constexpr = PAGES * S
        seq_len = tl.load(lens_ptr + b)
        n_pages = tl.cdiv(seq_len, S)
        pps = tl.cdiv(n_pages, num_splits)
        p_lo = sp * pps
        p_hi = tl.minimum(p_lo + pps, n_pages)

        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        heads = h * G + g  # query head h * G + g reads kv head h
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None],
                    other=0.0)  # [G_PAD, D]
        m_i = tl.full([G_PAD], float("-inf"), tl.float32)  # running max of the scores (log2 units)
        l_i = tl.zeros([G_PAD], tl.float32)  # running sum of exp2(score - m_i)
        acc = tl.zeros([G_PAD, D], tl.float32)  # running sum of exp2(score - m_i) * v
        t_lo = 0  # first token read from the pages (1 when the sink slot supplies token 0)
        if HAS_SINK:
            slot = tl.load(slot_ptr + tl.load(bt_ptr + b * stride_bt))
            t_lo = tl.where(slot >= 0, 1, 0)
            use = (slot >= 0) & (sp == 0) & (seq_len > 0)  # split 0 starts from the sink row
            m_i, l_i, acc = _sink_start(q, sk_ptr, sv_ptr, (tl.maximum(slot, 0) * Hkv + h) * D, use, qk_scale,
                                        m_i, l_i, acc, D)

        offs = tl.arange(0, BLOCK_N)
        in_page = offs % S
        for p0 in range(p_lo, p_hi, PAGES):
            pidx = p0 + offs // S  # page index within the sequence, per token of the tile
            tok = pidx * S + in_page
            valid = (pidx < p_hi) & (tok < seq_len)
            if HAS_SINK:
                valid = valid & (tok >= t_lo)
            page = tl.load(bt_ptr + b * stride_bt + pidx, mask=pidx < p_hi, other=0).to(tl.int64)
            row = (page * Hkv + h) * S + in_page
            k, ks = _tile(k_ptr, ks_ptr, row, valid, K_MODE, D, K_GROUP, BLOCK_N, BIAS)
            v, vs = _tile(v_ptr, vs_ptr, row, valid, V_MODE, D, V_GROUP, BLOCK_N, BIAS)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC)  # [G_PAD, BLOCK_N]
            if K_MODE == MODE_INT8 or K_MODE == MODE_FP8:
                s = s * ks[None, :]
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: avoid -inf - -inf
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if V_MODE == MODE_INT8 or V_MODE == MODE_FP8:
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
            m_i = m_new

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # empty split (or seq_len 0): acc is 0, so is o
        o = acc / l_safe[:, None]
        hm = g < G
        dst = o_ptr + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + d[None, :]
        tl.store(dst, o.to(o_ptr.dtype.element_ty), mask=hm[:, None])
        if not SINGLE:
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(lse_ptr + (b * Hkv * G + heads) * num_splits + sp, lse, mask=hm)

    @triton.jit(do_not_specialize=["Hq", "num_splits"])
    def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh, Hq, num_splits,
                      D: tl.constexpr, CHUNK: tl.constexpr):
        """One (sequence, query head): out = sum_s exp2(lse_s - lse) * part_s (all -inf: zeros)."""
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


def pages_per_tile(head_dim: int, page_size: int, elem_bytes: int) -> int:
    """Pages gathered per loop iteration: BLOCK_N = this * page_size tokens (~TILE_BYTES a tile)."""
    tokens = min(MAX_BLOCK_N, TILE_BYTES // (head_dim * elem_bytes))
    return max(1, tokens // page_size)


def split_constants(fmt: KVFormat, head_dim: int, page_size: int, gqa: int, dtype: torch.dtype,
                    has_sink: bool, single: bool) -> dict[str, object]:
    """The tl.constexpr arguments of the split kernel (one compiled variant per distinct dict)."""
    groups = [c.group_for(head_dim) if isinstance(c, Int4Codec) else 1 for c in (fmt.k_codec, fmt.v_codec)]
    return dict(S=page_size, D=head_dim, G_PAD=max(MIN_DOT_ROWS, _pow2(gqa)),
                PAGES=pages_per_tile(head_dim, page_size, torch.empty((), dtype=dtype).element_size()),
                K_MODE=_mode(fmt.k_codec), V_MODE=_mode(fmt.v_codec), K_GROUP=groups[0], V_GROUP=groups[1],
                BIAS=INT4_BIAS, HAS_SINK=has_sink, SINGLE=single,
                DOT_PREC=FP32_DOT if dtype == torch.float32 else "tf32")  # (16-bit operands ignore it)


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


def _check(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, block_table: torch.Tensor,
           seq_lens: torch.Tensor, num_splits: int) -> None:
    if q.dim() != 3:
        raise ValueError(f"paged_decode: q must be [B, Hq, D], got {tuple(q.shape)}")
    bsz, hq, d = q.shape
    _, hkv, s, _ = st["k"].shape
    if fmt.head_dim_of(st) != d:
        raise ValueError(f"paged_decode: q head_dim {d} != stored head_dim {fmt.head_dim_of(st)}")
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"paged_decode: head_dim must be a power of two >= 16, got {d}")
    if not _is_pow2(s):
        raise ValueError(f"paged_decode: page_size must be a power of two, got {s}")
    if hq % hkv:
        raise ValueError(f"paged_decode: {hq} query heads are not a multiple of {hkv} kv heads")
    if block_table.dim() != 2 or block_table.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError(f"paged_decode: block_table {tuple(block_table.shape)} / seq_lens "
                         f"{tuple(seq_lens.shape)} do not match batch {bsz}")
    if num_splits < 1:
        raise ValueError(f"paged_decode: num_splits must be >= 1, got {num_splits}")


def paged_decode(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, num_splits: int, sink: Sink | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention of one query row per sequence over its pages, read in place.

    q: [B, Hq, D] (bf16 / fp16 / fp32) in the stored domain (PagePool.native_q);
    st: one pool layer (`pool.layers[layer]`) in `fmt`'s layout, [num_pages, Hkv, S, ...];
    block_table: [B, max_pages] int32 page ids (entries past a sequence's pages: any valid id);
    seq_lens: [B] int32 keys per sequence (0 -> a zero output row);
    sink: (sink_k, sink_v, sink_slot) of the pool's layer, or None;
    num_splits: splits per (sequence, kv head), from shapes only (`choose_num_splits`);
    out: optional [B, Hq, D] destination (last dim contiguous).
    -> [B, Hq, D] in q.dtype, in the stored domain (PagePool.native_out maps it back).

    No host synchronisation and no data-dependent shapes: capturable in a CUDA graph.
    """
    if not HAVE_TRITON:
        raise RuntimeError("paged_decode needs Triton; use paged_decode_reference on CPU")
    _check(q, st, fmt, block_table, seq_lens, num_splits)
    bsz, hq, d = q.shape
    _, hkv, s, _ = st["k"].shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    if out is None:
        out = torch.empty((bsz, hq, d), dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    single = num_splits == 1
    if single:  # the split kernel writes the output itself
        dst, lse, strides = out, out, (out.stride(0), out.stride(1), 0)
    else:
        dst = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
        strides = (dst.stride(0), dst.stride(1), dst.stride(2))
    sk, sv, slot = sink if sink is not None else (q, q, block_table)  # unused placeholders
    _split_kernel[(bsz, hkv, num_splits)](
        q, st["k"], st.get("k_scale", st["k"]), st["v"], st.get("v_scale", st["v"]), block_table, seq_lens,
        sk.contiguous(), sv.contiguous(), slot, dst, lse, scale * LOG2E, q.stride(0), q.stride(1),
        block_table.stride(0), *strides, hkv, hq // hkv, num_splits,
        **split_constants(fmt, d, s, hq // hkv, q.dtype, sink is not None, single),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    if not single:
        _merge_kernel[(bsz, hq)](dst, lse, out, out.stride(0), out.stride(1), hq, num_splits, D=d,
                                 CHUNK=MERGE_CHUNK, num_warps=NUM_WARPS)
    return out


def _decode_pages(codec: Codec, st: dict[str, torch.Tensor], kv: str, pages: torch.Tensor,
                  head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Pages [P] of K ("k") or V ("v") decoded by the reference codec -> [P, Hkv, S, D] in dtype."""
    parts = {suffix: st[kv + suffix].index_select(0, pages) for suffix in codec.parts(head_dim)}
    return codec.decode(parts, dtype)


def paged_decode_reference(q: torch.Tensor, st: dict[str, torch.Tensor], fmt: KVFormat,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           sink: Sink | None = None) -> torch.Tensor:
    """paged_decode in plain PyTorch (same arguments; any device; syncs on seq_lens).

    Pages are decoded by the format's codecs to q.dtype (as PagePool.read(native=True)
    does in the compute dtype), token 0 taken from the sink slot when its first page has
    one, then an fp32 softmax: q: [B, Hq, D] -> [B, Hq, D] in q.dtype.
    """
    bsz, hq, d = q.shape
    _, hkv, s, _ = st["k"].shape
    out = torch.zeros_like(q)
    table = block_table.long()
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pages = table[b, :math.ceil(n / s)]
        k, v = (_decode_pages(c, st, kv, pages, d, q.dtype).transpose(0, 1).reshape(hkv, -1, d)[:, :n]
                for kv, c in (("k", fmt.k_codec), ("v", fmt.v_codec)))  # [Hkv, n, D]
        if sink is not None:
            slot = int(sink[2][pages[0]])
            if slot >= 0:
                k, v = k.clone(), v.clone()
                k[:, 0], v[:, 0] = sink[0][slot].to(k.dtype), sink[1][slot].to(v.dtype)
        qg = q[b].float().view(hkv, hq // hkv, d)  # query head h reads kv head h // (Hq / Hkv)
        p = torch.softmax(qg @ k.float().transpose(1, 2) * scale, dim=-1)  # [Hkv, G, n]
        out[b] = (p @ v.float()).reshape(hq, d).to(q.dtype)
    return out
