"""Attention backends: the only place model code meets the KV cache.

The model calls `backend.forward(layer, q, k, v, meta)` once per layer. The
backend writes the new K/V rows into the paged pool and attends over every
cached token of each sequence. Dense, retrieval-sparse and quantized paths
are different backends; model code never branches on them.

A step's tokens are packed ("varlen"): T new tokens from B sequences.

    packed rows:   | seq0 new tokens | seq1 new tokens | ... |
    query_start_loc  0               q1                q2 ... T
    seq b attends to its first seq_lens[b] tokens; its new tokens are the last
    (q[b+1]-q[b]) of those, so row i of seq b sits at absolute position
    seq_lens[b] - n_new_b + i and sees keys 0..that position (causal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass
class AttentionMetadata:
    query_start_loc: list[int]  # [B+1] cumulative new-token counts (python ints)
    seq_lens: list[int]  # [B] context length of each seq after this step
    page_tables: list[list[int]]  # [B][n_pages_b] compute-pool page ids, in order
    slot_mapping: torch.Tensor  # [T] int64: page_id * page_size + offset for each new token
    logits_indices: torch.Tensor  # [N] int64 packed rows whose logits are wanted

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class KVStore(Protocol):
    """What a backend needs from the page pool (kv/pool.py implements it)."""

    page_size: int

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new rows. slots: [T] int64, k/v: [T, Hkv, D]."""

    def read(self, layer: int, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Load pages. page_ids: [P] -> k, v: [P, Hkv, page_size, D] in compute dtype."""


class AttentionBackend(Protocol):
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> out [T, Hq, D]."""


class DensePagedAttention:
    """Reference backend: gathers each sequence's pages and runs torch SDPA.

    Exact (no selection); the correctness reference for every other backend.
    """

    def __init__(self, store: KVStore, scale: float):
        self.store = store
        self.scale = scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.store.write(layer, meta.slot_mapping, k, v)
        if len(meta.query_start_loc) - 1 == q.shape[0] and meta.num_seqs > 1:
            return self._decode_batch(layer, q, meta)  # every sequence brings one new token
        out = torch.empty_like(q)
        ps = self.store.page_size
        qsl = meta.query_start_loc
        for b in range(meta.num_seqs):
            lo, hi = qsl[b], qsl[b + 1]
            n_new, ctx = hi - lo, meta.seq_lens[b]
            n_pages = (ctx + ps - 1) // ps
            pages = torch.tensor(meta.page_tables[b][:n_pages], dtype=torch.long, device=q.device)
            kp, vp = self.store.read(layer, pages)  # [P, Hkv, ps, D]
            out[lo:hi] = attend_one(q[lo:hi], kp, vp, ctx, n_new, self.scale)
        return out


    def _decode_batch(self, layer: int, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """All rows are decodes: one padded SDPA call over every sequence's pages.

        q: [B, Hq, D] -> [B, Hq, D]; keys beyond seq_lens[b] are masked out.
        """
        ps = self.store.page_size
        n_pages = [(n + ps - 1) // ps for n in meta.seq_lens]
        max_p = max(n_pages)
        table = torch.zeros(meta.num_seqs, max_p, dtype=torch.long)
        for b, pt in enumerate(meta.page_tables):
            table[b, :n_pages[b]] = torch.tensor(pt[:n_pages[b]], dtype=torch.long)
        table = table.to(q.device)
        kp, vp = self.store.read(layer, table.flatten())  # [B*max_p, Hkv, ps, D]
        bsz, hkv, d = meta.num_seqs, kp.shape[1], kp.shape[3]
        kk = kp.view(bsz, max_p, hkv, ps, d).permute(0, 2, 1, 3, 4).reshape(bsz, hkv, max_p * ps, d)
        vv = vp.view(bsz, max_p, hkv, ps, d).permute(0, 2, 1, 3, 4).reshape(bsz, hkv, max_p * ps, d)
        lens = torch.tensor(meta.seq_lens, device=q.device)
        mask = torch.arange(max_p * ps, device=q.device)[None, :] < lens[:, None]  # [B, L]
        qq = q.unsqueeze(2).to(kk.dtype)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask[:, None, None, :],
                                           scale=self.scale, enable_gqa=q.shape[1] != hkv)
        return o.squeeze(2).to(q.dtype)


def attend_one(q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, ctx: int, n_new: int,
               scale: float) -> torch.Tensor:
    """Causal attention of one sequence's new rows over its paged context.

    q: [n_new, Hq, D]; kp/vp: [P, Hkv, ps, D] (P*ps >= ctx) -> [n_new, Hq, D]
    """
    hq, hkv, d = q.shape[1], kp.shape[1], kp.shape[3]
    kk = kp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]  # [Hkv, ctx, D]
    vv = vp.permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :ctx]
    qq = q.transpose(0, 1).to(kk.dtype)  # [Hq, n_new, D]
    gqa = hq != hkv  # grouped-query attention: each kv head serves hq/hkv query heads
    if n_new == 1:
        o = F.scaled_dot_product_attention(qq, kk, vv, scale=scale, enable_gqa=gqa)
    elif q.is_cuda:
        # flash / memory-efficient kernels: bottom-right-aligned causal mask, no [n, ctx] tensor
        if gqa:
            kk = kk.repeat_interleave(hq // hkv, dim=0)
            vv = vv.repeat_interleave(hq // hkv, dim=0)
        mask = causal_lower_right(n_new, ctx)
        o = F.scaled_dot_product_attention(qq[None], kk[None], vv[None], attn_mask=mask, scale=scale)[0]
    else:
        # row i sits at position ctx - n_new + i and sees keys <= that position
        rows = torch.arange(ctx - n_new, ctx, device=q.device)[:, None]
        cols = torch.arange(ctx, device=q.device)[None, :]
        mask = cols <= rows  # [n_new, ctx]
        o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1).to(q.dtype)
