"""Per-app state shared by the routes: engine, config, admission, grammars."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import ServerConfig
from kvtier.engine.request import PinnedBudget
from kvtier.server.convert import OutputFormat, ToolChoice, tool_call_tag
from kvtier.server.errors import APIError, Flavor, bad_request, overloaded
from kvtier.server.history import OutputMemory

log = logging.getLogger("kvtier.server")


class Admission:
    """At most `max_concurrency` requests in the engine, `max_queue` more waiting.

    admit() refuses at once when both are full (429 / 529); an admitted ticket
    waits for a slot, so nothing accepted is dropped.
    """

    def __init__(self, max_concurrency: int, max_queue: int):
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.max_concurrency = max_concurrency
        self.limit = max_concurrency + max_queue
        self.pending = 0  # admitted and not yet released (running + queued)
        self.active = 0
        self._sem: asyncio.Semaphore | None = None

    def admit(self, flavor: Flavor) -> "Ticket":
        if self.pending >= self.limit:
            raise overloaded(flavor)
        self.pending += 1
        return Ticket(self)

    def _semaphore(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        return self._sem

    @property
    def queued(self) -> int:
        return self.pending - self.active


class Ticket:
    """`async with ticket:` waits for an engine slot; release is idempotent."""

    def __init__(self, adm: Admission):
        self.adm = adm
        self.holding = False
        self.released = False

    async def __aenter__(self) -> "Ticket":
        await self.adm._semaphore().acquire()
        self.holding = True
        self.adm.active += 1
        return self

    async def __aexit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.adm.pending -= 1
        if self.holding:
            self.holding = False
            self.adm.active -= 1
            self.adm._semaphore().release()


class GrammarProvider:
    """tool_choice / response_format -> a compiled grammar for Request.grammar.

    Compilers are built on first use (building the token table takes a while)
    and reused for every request.
    """

    def __init__(self, tokenizer, vocab_size: int | None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self._cache = None

    def _compiler(self):
        if self._cache is None:
            from transformers import PreTrainedTokenizerFast

            from kvtier.engine.grammar import GrammarCompilerCache
            # xgrammar reads the vocabulary through a transformers tokenizer; wrap kvtier's backend.
            hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
            self._cache = GrammarCompilerCache(hf, self.vocab_size,
                                               stop_token_ids=sorted(self.tokenizer.eos_token_ids))
        return self._cache

    def for_request(self, tools: list[dict] | None, choice: ToolChoice, fmt: OutputFormat) -> Any:
        """required / named tool_choice, then response_format, then (tools offered) well-formed calls."""
        try:
            if tools and choice.mode in ("required", "named"):
                compiled = self._compiler().structural_tag(tool_call_tag(tools, choice))
            elif fmt.kind == "json_object":
                compiled = self._compiler().json_object()
            elif fmt.kind == "json_schema":
                if not isinstance(fmt.schema, dict):
                    raise bad_request("json_schema needs a `schema` object", param="response_format")
                compiled = self._compiler().json_schema(fmt.schema)
            elif tools and choice.mode == "auto":
                compiled = self._compiler().structural_tag(tool_call_tag(tools, choice))
            else:
                return None
        except APIError:
            raise
        except (ValueError, TypeError) as e:  # xgrammar rejects the schema
            raise bad_request(f"cannot compile the requested output format: {e}",
                              param="response_format") from e
        return GrammarFactory(compiled)


class GrammarFactory:
    """What Request.grammar holds: a compiled grammar that makes one state per sequence."""

    def __init__(self, compiled: Any):
        self.compiled = compiled

    def new_state(self):
        from kvtier.engine.grammar import GrammarState
        return GrammarState(self.compiled)


@dataclass
class ServerContext:
    engine: Any
    config: ServerConfig
    admission: Admission
    grammars: GrammarProvider
    metrics: Any = None
    served: tuple[str, ...] = field(default_factory=tuple)
    outputs: OutputMemory = field(default_factory=OutputMemory)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def pinned_budget(self) -> PinnedBudget | None:
        """The engine's retrieval budget for pinned spans; None: dense attention, nothing pinned
        (also for engines that predate it, such as the tests' fake)."""
        return getattr(self.engine, "pinned_budget", None)

    @property
    def model_name(self) -> str:
        return self.served[0]

    def check_model(self, name: str) -> None:
        from kvtier.server.errors import not_found_model
        if name not in self.served:
            raise not_found_model(name, self.model_name)
