"""What crosses between server/ and engine/: Request in, Output stream back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


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
    (see engine/sampler.py: `Grammar` protocol) for structured output."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    grammar: Any = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)


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
