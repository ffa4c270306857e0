"""Token sampling: pure tensor functions, batched over B rows with per-row params.

One step, per row b (HF `generate` order, then OpenAI penalties):

    logits[b]                         [V] fp32 from the model
      -> grammar mask                 disallowed tokens -> -inf
      -> repetition_penalty           HF: seen (prompt+output) logit l -> l/r if l>0 else l*r
      -> presence/frequency penalty   OpenAI: l -= freq*count + pres*(count>0), output only
      -> temperature == 0 ?           argmax (exact greedy), done
      -> / temperature -> top_k -> top_p -> min_p -> softmax -> draw

Draws use the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks
token i with probability p_i. A row with its own `torch.Generator` draws its
E from that generator alone, so a seeded request gives the same tokens
whatever else is in the batch and wherever it sits.

`filtered_probs` exposes the final distribution (speculative verification
needs it); `sample` is the step function the runner calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvtier.engine.request import SamplingParams
from kvtier.engine.step_plan import to_device

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


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top_k, top_p, min_p (HF order); returns new [B, V] logits
    with filtered-out tokens at -inf. Rows must have temperature > 0."""
    dev = logits.device
    temp = to_device([p.temperature for p in params], logits.dtype, dev)
    out = logits / temp.unsqueeze(1)  # [B, V]
    V = out.shape[1]
    use_k = any(p.top_k > 0 for p in params)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_k or use_p:
        sorted_logits = _top_sorted(out, params)  # [B, W]: each row's W largest, descending
        if use_k:
            k = to_device([min(p.top_k, V) if p.top_k > 0 else V for p in params], torch.int64, dev)
            kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [B, 1]
            out = out.masked_fill(out < kth, NEG_INF)
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)
        if use_p:
            top_p = to_device([p.top_p for p in params], logits.dtype, dev)
            # normalised over the whole (top-k filtered) row: sorted_logits may hold only its top ranks
            sorted_probs = (sorted_logits - out.logsumexp(dim=1, keepdim=True)).exp()
            before = sorted_probs.cumsum(dim=1) - sorted_probs  # mass strictly above each rank
            # keep the smallest top set whose mass reaches top_p (HF keeps >= 1 token)
            keep = before < top_p.unsqueeze(1)
            keep[:, 0] = True
            last = keep.sum(dim=1, keepdim=True) - 1  # [B, 1] rank of the last kept token
            cutoff = sorted_logits.gather(1, last)
            out = out.masked_fill(out < cutoff, NEG_INF)
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], logits.dtype, dev)
        probs = out.softmax(dim=1)
        threshold = probs.max(dim=1, keepdim=True).values * min_p.unsqueeze(1)
        out = out.masked_fill(probs < threshold, NEG_INF)
    return out


# Ranks sorted for top-k / top-p: a full sort of a 49K-151K vocabulary costs milliseconds a step on a
# CPU (3 ms for 49K on the 2-core box, against ~0.1 ms for topk(1024)); the kept set is nearly
# always far smaller. A row whose top_p mass is not reached within these ranks sorts everything.
TOP_SORTED = 1024


def _top_sorted(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's W largest logits in descending order, W enough for every row's top_k and top_p:
    TOP_SORTED ranks (or the largest top_k) when their probability mass reaches each top_p row's
    top_p, else all V (the exact result either way: ranks past W are never kept)."""
    v = logits.shape[1]
    w = max([TOP_SORTED] + [p.top_k for p in params])
    if w >= v or logits.is_cuda:  # a GPU sorts a vocabulary in microseconds; the check below would sync
        return logits.sort(dim=1, descending=True).values
    top = logits.topk(w, dim=1).values  # sorted, descending
    rows = [b for b, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        r = torch.tensor(rows, device=logits.device)
        lse = logits[r].logsumexp(dim=1)
        mass = (top[r] - lse[:, None]).exp().sum(dim=1)  # share of each row's mass in its W ranks
        need = torch.tensor([params[b].top_p for b in rows], dtype=mass.dtype, device=mass.device)
        if not bool((mass >= need).all()):
            return logits.sort(dim=1, descending=True).values
    return top


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
        probs[s] = filter_logits(out[s], [params[b] for b in sampled]).softmax(dim=1)
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
    tokens = out.argmax(dim=1)  # [B]; final for greedy rows
    sampled = [b for b, p in enumerate(params) if p.temperature > 0.0]
    if not sampled:
        return tokens
    every = len(sampled) == B
    s = None if every else to_device(sampled, torch.int64, out.device)
    probs = filter_logits(out if every else out[s], [params[b] for b in sampled]).softmax(dim=1)  # [S, V]
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
    cdf = probs.double().cumsum(dim=1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[1] - 1)  # [S, 1]
    # u * total rounding up to the total can only pass the last token: fall back to the likeliest
    ok = probs.gather(1, pick) > 0
    drawn = torch.where(ok, pick, probs.argmax(dim=1, keepdim=True)).squeeze(1)
    if every:
        return drawn
    tokens[s] = drawn
    return tokens
