"""KV smoothing calibration: fixed constants from a fixed text, before any request.

Quantized formats store K as (k - shift) / channel_scale per (layer, kv head)
(kv/pool.py). Taking those constants from whatever the first request happens
to be made a server's quantized KV depend on its traffic (two servers, or two
runs with requests in another order, gave different codes). Instead the engine
calibrates each pool once at start: one forward of CALIBRATION_TOKENS tokens of
a fixed prose text (the Python Language Reference shipped with CPython) with a
backend that attends densely over the chunk itself and hands every layer's K
rows to `PagePool.calibrate`. Nothing is written into the pool's pages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtier.layers.attention import AttentionMetadata

# Rows the constants are estimated from (median / spread per channel): the chunk kv_kl measured with.
CALIBRATION_TOKENS = 256


def prose_text() -> str:
    """Prose paragraphs of the Python Language Reference (stdlib `pydoc_data.topics`), fixed order.

    Indented blocks (code, grammar) and heading underlines are dropped, so what
    remains is running English text.
    """
    from pydoc_data.topics import topics

    paras: list[str] = []
    for name in sorted(topics):
        for para in topics[name].split("\n\n"):
            lines = para.strip("\n").splitlines()
            if not lines or any(ln[:1].isspace() or set(ln) <= set("*=-") for ln in lines):
                continue
            paras.append(" ".join(ln.strip() for ln in lines))
    return "\n\n".join(paras)


def calibration_tokens(tokenizer: object | None, vocab_size: int, n: int = CALIBRATION_TOKENS) -> list[int]:
    """n token ids of the fixed prose (or, without a tokenizer, fixed pseudo-random ids)."""
    if tokenizer is not None:
        ids = tokenizer.encode(prose_text()[:n * 16])[:n]  # type: ignore[attr-defined]
        if len(ids) == n:
            return ids
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (n,), generator=g).tolist()


class _CalibrationBackend:
    """Causal attention over the chunk alone; K rows go to the pool's calibration, nothing is stored."""

    def __init__(self, pool: object, scale: float):
        self.pool = pool
        self.scale = scale

    def rope_store(self, layer: int, qkv: torch.Tensor, rope: object, meta: AttentionMetadata) -> None:
        return None  # nothing is stored

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        self.pool.calibrate(layer, k)  # type: ignore[attr-defined]
        qq, kk, vv = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, T, D]
        o = F.scaled_dot_product_attention(qq, kk.to(qq.dtype), vv.to(qq.dtype), is_causal=True,
                                           scale=self.scale, enable_gqa=q.shape[1] != k.shape[1])
        return o[0].transpose(0, 1).to(q.dtype)


@torch.inference_mode()
def calibrate_pool(model: torch.nn.Module, pool: object, tokens: list[int]) -> None:
    """Fix `pool`'s K smoothing constants for every layer from one forward over `tokens`."""
    if not getattr(pool.fmt, "smooth_k", False) or not tokens:  # type: ignore[attr-defined]
        return
    device = next(model.parameters()).device
    n = len(tokens)
    meta = AttentionMetadata(query_start_loc=[0, n], seq_lens=[n], page_tables=[[]],
                             slot_mapping=torch.empty(0, dtype=torch.long, device=device),
                             logits_indices=torch.tensor([n - 1], device=device))
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    model(ids, torch.arange(n, device=device), meta, _CalibrationBackend(pool, model.spec.head_dim ** -0.5))
