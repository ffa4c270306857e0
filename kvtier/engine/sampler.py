"""Token sampling: pure tensor functions, batched over B rows with per-row params.

One step, per row b (HF `generate` order, then OpenAI penalties):

    logits[b]                         [V] fp32 from the model
      -> grammar mask                 disallowed tokens -> -inf
      -> repetition_penalty           HF: seen (prompt+output) logit l -> l/r if l>0 else l*r
      -> presence/frequency penalty   OpenAI: l -= freq*count + pres*(count>0), output only
      -> temperature == 0 ?           argmax (exact greedy), done
      -> / temperature -> top_k -> top_p -> min_p -> softmax -> draw

Draws use the inverse CDF: one uniform u per row (fp64) against the cumulative
mass of the row's kept tokens picks token i with probability p_i. A filtered row
(top_k / top_p / min_p) keeps a set within its largest logits, so it sorts only
its top 256 or 1,024 ranks (TOP_SORTED; on a CPU, where they provably hold the set) and draws
from them in descending order; an unfiltered row draws from its whole vocabulary
in vocabulary order, nothing sorted. A row with its own `torch.Generator` draws
its u from that generator alone, so a seeded request gives the same tokens
whatever else is in the batch and wherever it sits.

`filtered_probs` exposes the final distribution (speculative verification
needs it); `sample` is the step function the runner calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.device import to_device
from kvtier.engine.request import SamplingParams

# A -inf logit gives probability exactly 0 after softmax; used for every filter.
NEG_INF = float("-inf")


class Grammar(Protocol):
    """Per-request token-mask provider for structured output (engine/grammar.py).

    The runner calls `allowed_mask()` before sampling a row and `accept(tok)`
    with the sampled token; a terminated grammar means the request is done.
    """

    def allowed_mask(self) -> torch.Tensor:  # bool [V]
        ...

    def accept(self, token_id: int) -> bool:
        ...

    def is_terminated(self) -> bool:
        ...

    def rollback(self, num_tokens: int) -> None:
        ...


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """The per-request generator for `seed` (None -> use the global RNG)."""
    if seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def needs_history(p: SamplingParams) -> bool:
    """The row's penalties read its token history (so its last token must be known)."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_masks(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> None:
    """In place: logits[b, ~masks[b]] = -inf for each row with a mask.

    logits: [B, V] fp32; masks[b]: bool [V] (True = allowed) or None.
    The caller must not pass an all-False mask (a terminated grammar ends its request).
    """
    rows = [b for b, m in enumerate(masks) if m is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    for b in rows:
        if masks[b].shape != (vocab,):
            raise ValueError(f"grammar mask of row {b} has shape {tuple(masks[b].shape)}, "
                             f"expected ({vocab},) (the model's logits vocab)")
    allowed = torch.stack([masks[b] for b in rows]).to(logits.device, torch.bool)  # [R, V]
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed, NEG_INF)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    history: Sequence[Sequence[int]], prompt_lens: Sequence[int] | None) -> None:
    """In place: repetition (HF, over prompt+output) and presence/frequency
    (OpenAI, over output tokens only) penalties.

    logits: [B, V]; history[b]: prompt + generated ids of row b;
    prompt_lens[b]: how many of history[b] are prompt (needed only when some
    row has a presence/frequency penalty).
    """
    B, V = logits.shape
    dev = logits.device
    rep_rows = [b for b in range(B) if params[b].repetition_penalty != 1.0]
    if rep_rows:
        rows, toks = _flatten([history[b] for b in rep_rows], rep_rows)
        seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
        seen[rows.to(dev), toks.to(dev)] = True
        r = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype,
                         device=dev).unsqueeze(1)  # [B, 1]
        penalized = torch.where(logits > 0, logits / r, logits * r)
        logits.copy_(torch.where(seen, penalized, logits))
    pf_rows = [b for b in range(B) if params[b].presence_penalty != 0.0
               or params[b].frequency_penalty != 0.0]
    if pf_rows:
        if prompt_lens is None:
            raise ValueError("presence/frequency penalties need prompt_lens "
                             "(they count generated tokens only)")
        rows, toks = _flatten([history[b][prompt_lens[b]:] for b in pf_rows], pf_rows)
        counts = torch.zeros(B, V, dtype=logits.dtype, device=dev)
        counts.index_put_((rows.to(dev), toks.to(dev)),
                          torch.ones(rows.numel(), dtype=logits.dtype, device=dev), accumulate=True)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=dev)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=dev)
        logits -= counts * freq.unsqueeze(1) + (counts > 0).to(logits.dtype) * pres.unsqueeze(1)


def _flatten(id_lists: Sequence[Sequence[int]], rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of all ids, as two LongTensors [N] on CPU."""
    row_idx = [r for r, ids in zip(rows, id_lists) for _ in range(len(ids))]
    tok_idx = [t for ids in id_lists for t in ids]
    return torch.tensor(row_idx, dtype=torch.long), torch.tensor(tok_idx, dtype=torch.long)


def _kept(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows' tokens after temperature, top_k, top_p and min_p (HF order), as (values [B, W],
    token ids [B, W]): every row's W largest scaled logits in descending order, those filtered out
    at -inf, W holding every row's kept set (`_candidates`). Rows with no filter at all: (the
    scaled logits [B, V], None), in vocabulary order, nothing sorted."""
    if all(p.temperature == 1.0 for p in params):  # the APIs' default: nothing to divide
        scaled = logits
    else:
        temp = to_device([p.temperature for p in params], logits.dtype, logits.device)
        scaled = logits / temp.unsqueeze(1)  # [B, V]
    if not any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
        return scaled, None
    # the whole row's normaliser, for top_p rows without top_k (computed once, used twice)
    lse = scaled.logsumexp(dim=1, keepdim=True) if any(p.top_k <= 0 and p.top_p < 1.0 for p in params) else None
    vals, idx = _candidates(scaled, params, lse)  # [B, W] descending
    dev, w = vals.device, vals.shape[1]
    if any(p.top_k > 0 for p in params):
        k = to_device([p.top_k if p.top_k > 0 else w for p in params], torch.int64, dev)
        vals = vals.masked_fill(torch.arange(w, device=dev) >= k.unsqueeze(1), NEG_INF)
    if any(p.top_p < 1.0 for p in params):
        # each rank's probability over the whole top-k filtered row (its W ranks hold all of a
        # top-k row; a row without top_k is normalised over its whole vocabulary)
        norm = vals.logsumexp(dim=1, keepdim=True)
        if lse is not None:
            full = to_device([p.top_k <= 0 for p in params], torch.bool, dev).unsqueeze(1)
            norm = torch.where(full, lse, norm)
        probs = (vals - norm).exp()
        before = probs.cumsum(dim=1) - probs  # mass strictly above each rank
        top_p = to_device([p.top_p for p in params], logits.dtype, dev).unsqueeze(1)
        keep = before < top_p  # the smallest top set whose mass reaches top_p (HF keeps >= 1 token)
        keep[:, 0] = True
        vals = vals.masked_fill(~keep, NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        # p < min_p * p_max, the normaliser cancelling: exp(l - l_max) < min_p (rank 0 is the max)
        min_p = to_device([p.min_p for p in params], logits.dtype, dev).unsqueeze(1)
        vals = vals.masked_fill((vals - vals[:, :1]).exp() < min_p, NEG_INF)
    return vals, idx


# Ranks a filtered row's candidates are taken from on a CPU, widest last: a full sort of a 49K-151K
# vocabulary costs milliseconds a step (3 ms for 49K on the 2-core box); topk over 152K columns
# 0.27 ms for 16-256 ranks, 0.71 for 1,024. The kept set is nearly always far smaller; where it may
# reach past the widest, the whole row is sorted.
TOP_SORTED = (256, 1024)


def _candidates(scaled: torch.Tensor, params: Sequence[SamplingParams],
                lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's W largest scaled logits [B, W], descending, and their token ids, W enough for every
    row's kept set: the first of TOP_SORTED's widths (or the largest top_k) whose ranks provably
    hold it (a row with top_k; a top_p row whose mass within them reaches top_p, by its whole row's
    normaliser lse [B, 1]; a min_p row whose last rank is already below its threshold), else the
    whole vocabulary sorted. The exact kept set either way."""
    v = scaled.shape[1]
    if scaled.is_cuda:  # a GPU sorts a vocabulary in microseconds; the checks below would sync
        return scaled.sort(dim=1, descending=True)

    def holds(vals: torch.Tensor, b: int, p: SamplingParams) -> bool:  # row b's kept set in its W ranks
        if p.top_k > 0:
            return True
        if p.top_p < 1.0:  # share of the row's mass in its W ranks
            return bool((vals[b] - lse[b]).exp().sum() >= p.top_p)  # type: ignore[index]
        if p.min_p > 0.0:  # the last rank already below the threshold
            return bool((vals[b, -1] - vals[b, 0]).exp() < p.min_p)
        return False  # no filter: every token is kept

    for width in TOP_SORTED:
        w = max([width] + [p.top_k for p in params])
        if w >= v:
            break
        vals, idx = scaled.topk(w, dim=1)  # sorted, descending
        if all(holds(vals, b, p) for b, p in enumerate(params)):
            return vals, idx
    return scaled.sort(dim=1, descending=True)


# Columns per chunk of inverse_cdf's two-level search (at most; the largest power of two dividing
# the row, padded where that is below 16): a fp64 cumsum over a whole 152K vocabulary takes 1.0 ms
# on the 2-core box, the chunks' fp64 sums 0.03 ms.
CDF_CHUNK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first column whose cumulative mass passes u times the row's total: probs [S, W] >= 0,
    u [S, 1] fp64 in [0, 1) -> [S, 1] int64 columns (< W). Sums in fp64, in two levels: the chunk
    whose cumulative sum passes the target first, then the column within it.

        row:   | chunk 0 | chunk 1 | ... | chunk c | ...      csum[c] = mass of chunks 0..c
                                         ^ target lies here: cumsum within chunk c + csum[c - 1]
    """
    s, w = probs.shape
    size = math.gcd(w, CDF_CHUNK)
    if size < 16:  # a row of odd width: zeros past its end (never picked: the search stops before)
        size = CDF_CHUNK
        probs = torch.nn.functional.pad(probs, (0, -w % size))
    nc = probs.shape[1] // size
    chunks = probs.view(s, nc, size)
    csum = chunks.sum(dim=2, dtype=torch.float64).cumsum(dim=1)  # [S, nc]
    target = u * csum[:, -1:]
    c = torch.searchsorted(csum, target, right=True).clamp_(max=nc - 1)  # [S, 1]
    before = torch.where(c > 0, csum.gather(1, (c - 1).clamp_(min=0)), 0.0)
    within = chunks.gather(1, c[:, :, None].expand(s, 1, size)).squeeze(1).double().cumsum(dim=1) + before
    j = torch.searchsorted(within, target, right=True).clamp_(max=size - 1)
    return (c * size + j).clamp_(max=w - 1)


def _prepare(logits: torch.Tensor, params: Sequence[SamplingParams],
             history: Sequence[Sequence[int]] | None, masks: Sequence[torch.Tensor | None] | None,
             prompt_lens: Sequence[int] | None) -> torch.Tensor:
    """Masked + penalized copy of logits [B, V] (the input is not modified)."""
    if logits.dim() != 2 or len(params) != logits.shape[0]:
        raise ValueError(f"logits must be [B, V] with B == len(params); got {tuple(logits.shape)} "
                         f"and {len(params)} params")
    out = logits.float().clone()
    if masks is not None:
        if len(masks) != len(params):
            raise ValueError("need one mask (or None) per row")
        apply_masks(out, masks)
    if any(needs_history(p) for p in params):
        if history is None or len(history) != len(params):
            raise ValueError("penalties need one history list per row")
        apply_penalties(out, params, history, prompt_lens)
    return out


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams],
                   history: Sequence[Sequence[int]] | None = None,
                   masks: Sequence[torch.Tensor | None] | None = None,
                   prompt_lens: Sequence[int] | None = None) -> torch.Tensor:
    """The distribution `sample` draws from, [B, V] fp32; greedy rows are one-hot."""
    out = _prepare(logits, params, history, masks, prompt_lens)
    probs = torch.zeros_like(out)
    greedy = [b for b, p in enumerate(params) if p.temperature == 0.0]
    sampled = [b for b, p in enumerate(params) if p.temperature > 0.0]
    if greedy:
        g = torch.tensor(greedy, device=out.device)
        probs[g, out[g].argmax(dim=1)] = 1.0
    if sampled:
        s = torch.tensor(sampled, device=out.device)
        rows = out[s]
        vals, idx = _kept(rows, [params[b] for b in sampled])
        p = vals.softmax(dim=1)
        probs[s] = p if idx is None else torch.zeros_like(rows).scatter_(1, idx, p)
    return probs


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None],
           history: Sequence[Sequence[int]] | None = None,
           masks: Sequence[torch.Tensor | None] | None = None,
           prompt_lens: Sequence[int] | None = None) -> torch.Tensor:
    """Sample one token per row.

    logits: [B, V] (any float dtype; computed in fp32) — not modified.
    params[b], generators[b] (None -> global RNG), history[b] = prompt+generated
    ids (only read for rows with penalties), masks[b] = bool [V] allowed tokens
    or None, prompt_lens[b] = prompt part of history[b] (presence/frequency only).
    Returns LongTensor [B] on logits.device.
    """
    B = logits.shape[0]
    if len(generators) != B:
        raise ValueError("need one generator (or None) per row")
    no_masks = masks is None or all(m is None for m in masks)
    if no_masks and all(p.temperature == 0.0 and not needs_history(p) for p in params):
        return logits.argmax(dim=1)  # fast path: plain greedy batch
    out = _prepare(logits, params, history, masks, prompt_lens)
    sampled = [b for b, p in enumerate(params) if p.temperature > 0.0]
    if not sampled:
        return out.argmax(dim=1)
    every = len(sampled) == B
    s = None if every else to_device(sampled, torch.int64, out.device)
    # the kept tokens: a filtered row's candidates in descending order (idx their ids), else the
    # whole row in vocabulary order (idx None)
    vals, idx = _kept(out if every else out[s], [params[b] for b in sampled])
    # the draw needs the mass only up to a factor: on CUDA exp(l - max) in two multi-block launches,
    # where softmax runs one block a row (H100 profile: 38 us for a 152K row, tools/profile_kernels.py);
    # on a CPU softmax's fused loop is the faster (0.09 against 0.27 ms for 152K values)
    probs = (vals - vals.amax(dim=1, keepdim=True)).exp() if vals.is_cuda else vals.softmax(dim=1)  # [S, W]
    # inverse CDF: one uniform draw per row against the cumulative mass (fp64), the first token
    # whose cumulative mass passes it. One draw instead of V exponentials (0.73 ms a step for a
    # 49K vocabulary on a CPU core); a token of zero probability is never passed over to.
    u = torch.empty(len(sampled), 1, dtype=torch.float64, device=probs.device)
    shared = [i for i, b in enumerate(sampled) if generators[b] is None]
    if len(shared) == len(sampled):
        u = torch.rand(len(sampled), 1, dtype=torch.float64, device=probs.device)
    elif shared:
        u[to_device(shared, torch.int64, probs.device)] = torch.rand(len(shared), 1, dtype=torch.float64,
                                                               device=probs.device)
    for i, b in enumerate(sampled):
        if generators[b] is not None:
            u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generators[b])
    pick = inverse_cdf(probs, u)  # [S, 1]
    # u * total rounding up to the total can only pass the last token: fall back to the likeliest
    # (rank 0 of the candidates; a CPU checks first whether any row needs the argmax)
    ok = probs.gather(1, pick) > 0
    if idx is not None:
        drawn = idx.gather(1, torch.where(ok, pick, 0)).squeeze(1)
    elif probs.is_cuda or not bool(ok.all()):
        drawn = torch.where(ok, pick, probs.argmax(dim=1, keepdim=True)).squeeze(1)
    else:
        drawn = pick.squeeze(1)
    if every:
        return drawn
    tokens = out.argmax(dim=1)  # [B]; final for greedy rows
    tokens[s] = drawn
    return tokens
