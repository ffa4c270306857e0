"""What crosses between server/ and engine/: Request in, Output stream back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import RetrievalConfig

# A half-open range [start, end) of prompt token positions.
Span = tuple[int, int]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0 <= self.min_p <= 1):
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")


@dataclass
class Request:
    """One generation request. `grammar` is an optional token-mask provider
    (see engine/sampler.py: `Grammar` protocol) for structured output.

    `pinned_spans`: sorted, disjoint half-open prompt token ranges that retrieval attention
    always attends (server/spans.py: the system prompt + tools, and the current user turn with
    the tool trajectory after it); set by the server only when the engine runs retrieval.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    grammar: Any = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    pinned_spans: tuple[Span, ...] = ()


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (all tiers)
    cached_host_tokens: int = 0  # of which came from the host tier
    computed_tokens: int = 0  # prompt tokens actually prefilled
    completion_tokens: int = 0


@dataclass
class Progress:
    processed: int  # prompt tokens done (cached + computed)
    total: int
    cached: int


@dataclass
class Output:
    """One step's result for one request. The last Output has finish_reason set.

    finish_reason: "stop" (EOS / stop string / stop id), "length" (max_tokens or
    context end), "abort" (client went away), "error" (see `error`).
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # UTF-8-safe text delta (stop strings already removed)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # which stop string / token id matched
    usage: Usage = field(default_factory=Usage)
    progress: Progress | None = None
    error: str | None = None
    drafted: int = 0
    accepted: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class ContextOverflowError(ValueError):
    """The prompt (plus max_tokens) does not fit the model's context."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        super().__init__(
            f"this model's maximum context length is {limit} tokens, but the request has "
            f"{prompt_tokens} prompt tokens and asks for {max_tokens} completion tokens")


class KVCapacityError(ContextOverflowError):
    """The prompt alone needs more KV pages than the GPU pool and the host tier hold together: it
    could never be prefilled. A ContextOverflowError, so the APIs answer it as one (400,
    context_length_exceeded); the engine checks it before queueing anything."""

    def __init__(self, prompt_tokens: int, max_tokens: int, capacity: int):
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, capacity
        ValueError.__init__(
            self, f"the KV cache holds {capacity:,} tokens (GPU pool + host tier) but the request has "
            f"{prompt_tokens:,} prompt tokens: raise --gpu-kv-mib / --host-kv-mib, pick a smaller "
            f"--kv-dtype or shorten the prompt")


class PinnedOverBudgetError(ContextOverflowError):
    """The spans a request pins (system prompt + tools + current turn) plus the sink and recent
    window do not fit retrieval attention's budget. A ContextOverflowError, so every path that
    answers a context overflow (400, code context_length_exceeded) answers this too."""

    def __init__(self, need: int, pinned: int, page_size: int, prompt_tokens: int, max_tokens: int,
                 budget: int):
        self.need = need
        self.pinned = pinned
        self.budget = budget
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, budget
        ValueError.__init__(
            self, f"the system prompt + tools + current turn (with its tool calls and results) need "
            f"{need:,} tokens of attention ({pinned:,} pinned, rounded to pages of {page_size}, plus "
            f"the attention sink and the recent window), over the --kvmem-budget of {budget:,}; "
            f"raise the budget or shorten them")


def span_pages(spans: tuple[Span, ...], page_size: int) -> set[int]:
    """Page indices (position // page_size) the spans touch, each span rounded out to whole pages."""
    pages: set[int] = set()
    for start, end in spans:
        pages.update(range(start // page_size, -(-end // page_size)))
    return pages


@dataclass(frozen=True)
class PinnedBudget:
    """Retrieval attention's budget as an admission rule for pinned spans (the engine builds one
    when `--kvmem-budget` is set; the server reads it to compute spans and refuse early).

    A decode row past the budget attends to the sink pages, the recent window's pages and the
    pinned pages, then retrieves into what is left; so a request whose pinned pages, with the
    sink's, plus the window's pages exceed the budget's pages cannot be served faithfully. A
    request that can never grow past the budget (prompt + max_tokens <= budget) stays dense and
    is always admitted.
    """

    retrieval: RetrievalConfig
    page_size: int

    def check(self, spans: tuple[Span, ...], prompt_len: int, max_tokens: int) -> None:
        """Raise ValueError for malformed spans, PinnedOverBudgetError when they do not fit."""
        prev = 0
        for start, end in spans:
            if not (prev <= start < end <= prompt_len):
                raise ValueError(f"pinned spans must be sorted, disjoint, non-empty ranges inside the "
                                 f"{prompt_len}-token prompt, got {list(spans)}")
            prev = end
        budget = self.retrieval.budget
        if not spans or prompt_len + max_tokens <= budget:
            return
        ps = self.page_size
        sink, window, budget_pages = self.retrieval.page_counts(ps)
        pinned = span_pages(spans, ps)
        need_pages = len(pinned | set(range(sink))) + window
        if need_pages > budget_pages:
            raise PinnedOverBudgetError(need_pages * ps, len(pinned) * ps, ps, prompt_len, max_tokens, budget)
