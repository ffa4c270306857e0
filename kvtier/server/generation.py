"""Drive one engine request and turn its Output stream into parsed events.

    engine.generate(Request) -> Output(text delta, progress, finish)
        -> OutputParser.feed/finish -> TextDelta | ReasoningDelta | ToolCall*
        -> + Progress / Finished events, consumed by the per-API formatters

The request is aborted in the engine whenever its consumer stops early
(client disconnect, cancellation, error), so nothing keeps generating for a
client that left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from kvtier.engine.request import ContextOverflowError, Output, Progress, Request, Usage
from kvtier.server.bare_calls import BareCallHold
from kvtier.server.history import OutputMemory, Reply, ReplyCall
from kvtier.server.parsing import (OutputParser, ReasoningDelta, TextDelta, ToolCallArgsDelta,
                                   ToolCallEnd, ToolCallStart)

log = logging.getLogger("kvtier.server")

# Server-log progress lines per request: at most one per this many seconds.
PROGRESS_LOG_INTERVAL_S = 1.0
T = TypeVar("T")


@dataclass
class Prepared:
    """An API request turned into an engine request plus how to parse its output."""

    request: Request
    tools: bool  # parse <tool_call> blocks into tool calls
    starts_in_reasoning: bool  # the prompt ends inside an open <think>
    reasoning: bool = True  # parse <think> blocks (off for raw completions)
    prompt_text: str = ""
    tool_names: tuple[str, ...] = ()
    memory: OutputMemory | None = None  # remembers the output's token ids for the next turn
    prefill: str = ""  # the assistant text the output continues (part of the turn the client sends back)
    progress_log_s: float = PROGRESS_LOG_INTERVAL_S  # seconds between a request's progress lines in the log


@dataclass
class ProgressEvent:
    progress: Progress


@dataclass
class Finished:
    """The last event. finish_reason: stop | length | tool_calls | abort | error."""

    finish_reason: str
    usage: Usage
    stop_reason: str | int | None = None
    error: str | None = None
    overflow: ContextOverflowError | None = None


@dataclass
class ToolCallOut:
    id: str
    name: str
    arguments: str


@dataclass
class Collected:
    """The whole result of a non-streamed request."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    finished: Finished | None = None
    _calls: dict[int, ToolCallOut] = field(default_factory=dict, repr=False)

    def add(self, ev: object) -> None:
        """Fold one event in; a call abandoned as malformed gets no End and is left out."""
        if isinstance(ev, TextDelta):
            self.content += ev.text
        elif isinstance(ev, ReasoningDelta):
            self.reasoning += ev.text
        elif isinstance(ev, ToolCallStart):
            self._calls[ev.index] = ToolCallOut(ev.id, ev.name, "")
        elif isinstance(ev, ToolCallArgsDelta):
            self._calls[ev.index].arguments += ev.text
        elif isinstance(ev, ToolCallEnd):
            self.tool_calls.append(self._calls[ev.index])
        elif isinstance(ev, Finished):
            self.finished = ev


class ProgressLog:
    """Once an interval (a second by default) per request, one line in the server log about what it
    is doing; none for requests done within the interval."""

    def __init__(self, request: Request, interval: float = PROGRESS_LOG_INTERVAL_S):
        self.interval = interval
        self.rid = request.request_id[-8:]
        self.max_tokens = request.params.max_tokens
        self.t0 = time.monotonic()
        self.last = 0.0
        self.decode_t0: float | None = None
        self.tokens = 0
        self.phase = "answering"

    def _due(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        return True

    def prefill(self, p: Progress) -> None:
        if self._due() and time.monotonic() - self.t0 >= self.interval:
            log.info("[%s] reading the prompt: %s of %s tokens (%s cached), %d s so far", self.rid,
                     f"{p.processed:,}", f"{p.total:,}", f"{p.cached:,}", time.monotonic() - self.t0)

    def tokens_out(self, n: int) -> None:
        if self.decode_t0 is None:
            self.decode_t0 = time.monotonic()
        self.tokens += n
        if self._due() and time.monotonic() - self.t0 >= self.interval:
            rate = self.tokens / max(time.monotonic() - self.decode_t0, 1e-6)
            log.info("[%s] %s: %s of max %s tokens, %.1f tok/s, %d s", self.rid, self.phase,
                     f"{self.tokens:,}", f"{self.max_tokens:,}", rate, time.monotonic() - self.t0)


def _phase(ev: object, names: dict[int, str]) -> str | None:
    if isinstance(ev, ReasoningDelta):
        return "thinking"
    if isinstance(ev, TextDelta):
        return "answering"
    if isinstance(ev, ToolCallStart):
        names[ev.index] = ev.name
        return f"writing a tool call: {ev.name}"
    return None


class _WhitespaceHold:
    """Holds whitespace-only text until real text follows, so the newlines a model writes
    between or after tool calls never become an empty message / text block. Only where the
    request offers tools (`active`): elsewhere each newline streams as it comes (held, a model's
    "\n\n" before a paragraph reached the client with the paragraph's first word, one gap of
    three tokens)."""

    def __init__(self, active: bool = True):
        self.pending = ""
        self.active = active

    def filter(self, events: list, final: bool, drop: bool) -> list:
        if not self.active:
            return events
        out = []
        for ev in events:
            if isinstance(ev, TextDelta):
                if not ev.text.strip():
                    self.pending += ev.text
                    continue
                if self.pending:
                    ev, self.pending = TextDelta(self.pending + ev.text), ""
            elif isinstance(ev, ToolCallStart):
                self.pending = ""  # separator before a call
            out.append(ev)
        if final and self.pending and not drop:
            out.append(TextDelta(self.pending))
        if final:
            self.pending = ""
        return out


async def run_events(engine, prep: Prepared) -> AsyncIterator[object]:
    """Yield parser events, ProgressEvent, and finally one Finished; abort on early exit."""
    req = prep.request
    parser = OutputParser(tools=prep.tools, reasoning=prep.reasoning, starts_in_reasoning=prep.starts_in_reasoning)
    plog = ProgressLog(req, prep.progress_log_s)
    names: dict[int, str] = {}
    ws = _WhitespaceHold(active=bool(prep.tools))
    bare = BareCallHold(prep.tool_names if prep.tools else ())
    done = False
    text, ids = [], []
    sent = Collected()  # what the client receives, to know the reply when it comes back
    stream = engine.generate(req)
    try:
        async for out in stream:
            text.append(out.text)
            ids += out.token_ids
            if out.progress is not None and not out.finished:
                plog.prefill(out.progress)
                yield ProgressEvent(out.progress)
            if out.token_ids:
                plog.tokens_out(len(out.token_ids))
            events = parser.feed(out.text) if out.text else []
            if out.finished:
                events += parser.finish(out.finish_reason == "length")
            events = ws.filter(events, final=out.finished, drop=bool(parser.tool_calls))
            for ev in bare.filter(events, final=out.finished):
                phase = _phase(ev, names)
                if phase:
                    plog.phase = phase
                sent.add(ev)
                yield ev
            if out.finished:
                done = True
                if prep.memory is not None:
                    _remember(prep, out, "".join(text), ids, sent)
                reason = out.finish_reason
                if reason in ("stop", "length"):  # tool_calls when calls were made; length if cut in one
                    reason = "tool_calls" if bare.calls else parser.finish_reason(reason)
                yield Finished(reason, out.usage, out.stop_reason, out.error)
                return
        done = True
        yield Finished("error", Usage(prompt_tokens=len(req.prompt_token_ids)),
                       error="the engine ended the stream without a final output")
    except ContextOverflowError as e:
        done = True
        yield Finished("error", Usage(prompt_tokens=len(req.prompt_token_ids)), error=str(e), overflow=e)
    finally:
        if not done:
            engine.abort(req.request_id)
        await _close(stream)


def _remember(prep: Prepared, last: Output, text: str, ids: list[int], sent: Collected) -> None:
    """Keep the reply when its ids decode to exactly the text generated (a stop string is cut
    from the text, so that reply is not kept)."""
    if last.finish_reason == "stop" and isinstance(last.stop_reason, int):  # stop token: no text of its own
        ids = ids[:-1]
    elif last.finish_reason != "length":
        return
    calls = tuple(ReplyCall(c.id, c.name, c.arguments) for c in sent.tool_calls)
    prep.memory.remember(Reply(tuple(ids), text, sent.content, sent.reasoning, calls, lead=prep.prefill))


async def _close(stream) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except (RuntimeError, asyncio.CancelledError):  # already closing / being cancelled
            pass


async def collect(engine, prep: Prepared) -> Collected:
    """Run to completion and gather content, reasoning and tool calls (non-streamed APIs)."""
    res = Collected()
    async for ev in run_events(engine, prep):
        res.add(ev)
    return res


async def until_disconnect(work: Awaitable[T], http_request) -> T | None:
    """Await `work`, but cancel it (aborting its engine request) if the client disconnects.

    Returns None if the client went away first.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(http_request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _wait_disconnect(http_request) -> None:
    while True:
        msg = await http_request.receive()
        if msg.get("type") == "http.disconnect":
            return


__all__ = ["Prepared", "ProgressEvent", "Finished", "Collected", "ToolCallOut", "run_events",
           "collect", "until_disconnect", "TextDelta", "ReasoningDelta", "ToolCallStart",
           "ToolCallArgsDelta", "ToolCallEnd"]
