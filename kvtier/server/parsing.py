"""Streaming-safe parsing of model output into text, reasoning and tool calls.

Hermes tool calls (Qwen2.5 / Qwen3 chat templates) and `<think>` reasoning:

    <think>\\n ...reasoning... \\n</think>\\n\\n content ...
    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>

The parser works one character at a time, so the events do not depend on how
the output was split into deltas (up to merging adjacent deltas):

- text that may still become a tag (`<tool_c`) is held back, never emitted;
- a call's JSON is scanned as it arrives: `ToolCallStart` as soon as the name
  is known, then `ToolCallArgsDelta`s whose concatenation is exactly the
  "arguments" JSON text as written; `</tool_call>` inside a JSON string does
  not end the call;
- inside `<think>` only `</think>` is a tag (a `<tool_call>` there is reasoning);
- whitespace right after `<think>` / `</think>`, before `</think>`, and around
  tool calls is dropped (it is template formatting, not content).

A call whose block is not a JSON object with a string "name" is malformed: its
raw block (tags included) is emitted as text and `malformed` is set. If it had
already been started, it gets no `ToolCallEnd` and is absent from
`tool_calls`; indices are never reused.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Callable

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
JSON_WS = " \t\r\n"
# Random hex bytes in a default tool-call id (OpenAI ids look like call_<24 hex>).
CALL_ID_BYTES = 12


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgsDelta:
    index: int
    text: str


@dataclass
class ToolCallEnd:
    index: int


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of "arguments" exactly as the model wrote it


def default_call_id() -> str:
    return "call_" + secrets.token_hex(CALL_ID_BYTES)


def merge_deltas(events: list[Event]) -> list[Event]:
    """Join adjacent TextDelta / ReasoningDelta / same-index ToolCallArgsDelta events."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, (TextDelta, ReasoningDelta)) and type(last) is type(e):
            out[-1] = type(e)(last.text + e.text)  # type: ignore[union-attr]
        elif (isinstance(e, ToolCallArgsDelta) and isinstance(last, ToolCallArgsDelta)
              and last.index == e.index):
            out[-1] = ToolCallArgsDelta(e.index, last.text + e.text)
        else:
            out.append(e)
    return out


class _CallScanner:
    """Incremental scanner of one call's JSON: string/escape/depth state plus the
    top-level keys, so "name" and "arguments" can be reported as they arrive.

    feed(c) returns signals: ("name", name) once, ("args", text) pieces.
    """

    def __init__(self) -> None:
        self.text = ""
        self.in_str = False
        self._esc = False
        self.depth = 0
        self._phase = "start"  # start|key|in_key|colon|value|in_value|after|done|broken
        self._key_buf = ""
        self._key: str | None = None
        self._kind = ""  # value kind: str | box | scalar
        self._value = ""
        self.name: str | None = None
        self.has_args = False

    def feed(self, c: str) -> list[tuple[str, str]]:
        self.text += c
        if self.in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self.in_str = False
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
        out: list[tuple[str, str]] = []
        self._step(c, out)
        return out

    def _step(self, c: str, out: list[tuple[str, str]]) -> None:
        ph, ws = self._phase, c in JSON_WS
        if ph == "in_value":
            self._in_value(c, out)
        elif ph == "in_key":
            if self.in_str:
                self._key_buf += c
            else:
                self._key = _loads_str('"' + self._key_buf + '"')
                self._phase = "colon"
        elif ws or ph == "broken":
            return
        elif ph == "start":
            self._phase = "key" if c == "{" else "broken"
        elif ph == "key":
            self._phase = {'"': "in_key", "}": "done"}.get(c, "broken")
            self._key_buf = ""
        elif ph == "colon":
            self._phase = "value" if c == ":" else "broken"
        elif ph == "value":
            self._kind = "str" if c == '"' else "box" if c in "{[" else "scalar"
            self._value, self._phase = c, "in_value"
            if self._key == "arguments":
                self.has_args = True
                if self._kind != "str":
                    out.append(("args", c))
        elif ph == "after":
            self._phase = {",": "key", "}": "done"}.get(c, "broken")
        else:  # done: only whitespace may follow the object
            self._phase = "broken"

    def _in_value(self, c: str, out: list[tuple[str, str]]) -> None:
        is_args = self._key == "arguments"
        if self._kind == "scalar" and (c in JSON_WS or c in ",}"):
            self._end_value(out)
            self._step(c, out)
            return
        self._value += c
        if is_args and self._kind != "str":
            out.append(("args", c))
        if (self._kind == "str" and not self.in_str) or (self._kind == "box" and self.depth == 1):
            self._end_value(out)

    def _end_value(self, out: list[tuple[str, str]]) -> None:
        self._phase = "after"
        if self._key == "name" and self.name is None:
            name = _loads_str(self._value)
            if name is not None:
                self.name = name
                out.append(("name", name))
        elif self._key == "arguments" and self._kind == "str":
            # arguments given as a JSON string holding JSON: report its content
            decoded = _loads_str(self._value)
            out.append(("args", decoded if decoded is not None else self._value))


def _loads_str(text: str) -> str | None:
    try:
        v = json.loads(text)
    except ValueError:
        return None
    return v if isinstance(v, str) else None


def _parse_call(text: str) -> dict | None:
    """The call object if `text` is a JSON object with a string "name"."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None


class OutputParser:
    """Splits one request's output stream into text, reasoning and tool calls.

    One per request; no shared state. `tools`: parse Hermes tool calls;
    `reasoning`: parse `<think>` blocks; `starts_in_reasoning`: the prompt
    already opened `<think>` (e.g. Qwen3 with thinking on).
    After `finish`: `tool_calls`, `text`, `reasoning`, `malformed`, and
    `truncated_call` (output was cut inside a call -> finish_reason "length").
    """

    def __init__(self, tools: bool, reasoning: bool, starts_in_reasoning: bool = False,
                 id_factory: Callable[[], str] = default_call_id) -> None:
        self._tools, self._reasoning, self._new_id = tools, reasoning, id_factory
        self.tool_calls: list[ToolCall] = []
        self.text = ""
        self.reasoning = ""
        self.malformed = False
        self.truncated_call = False
        self._mode = "reasoning" if reasoning and starts_in_reasoning else "text"
        self._tag = ""  # held-back possible tag prefix (text / reasoning modes)
        self._ws = ""  # held-back whitespace of the current channel
        self._skip_ws = self._mode == "reasoning"  # drop whitespace opening a block
        self._after_call = False  # only whitespace since the last call ended
        self._next_index = 0
        self._call: _CallScanner | None = None
        self._call_raw = ""
        self._call_end = ""  # held-back possible "</tool_call>" prefix
        self._call_id: str | None = None
        self._call_name = ""
        self._call_args = ""
        self._pending_args = ""  # arguments seen before the name
        self._events: list[Event] = []
        self._finished = False

    # ----- public API ---------------------------------------------------------------

    def feed(self, text_delta: str) -> list[Event]:
        """Events made final by this delta (held-back text comes later)."""
        if self._finished:
            raise ValueError("OutputParser.feed after finish")
        for c in text_delta:
            self._char(c)
        return self._take()

    def finish(self, truncated: bool = False) -> list[Event]:
        """End of output: flush held-back text. `truncated`: the output was cut
        (max_tokens / context), not ended by the model."""
        if self._finished:
            return []
        self._finished = True
        if self._mode == "call":
            self._finish_call(truncated)
        elif self._mode == "reasoning":
            self._emit_reasoning(self._tag, hold_ws=False)
        elif (self._ws + self._tag).strip() or not self._after_call:
            self._emit_text(self._tag, hold_ws=False)  # held whitespace goes out first
        self._tag = self._ws = ""
        return self._take()

    def finish_reason(self, engine_reason: str) -> str:
        """The API finish reason: "tool_calls" when calls were made and the model
        stopped; "length" when the output was cut (inside a call or not)."""
        if self.truncated_call:
            return "length"
        if engine_reason == "stop" and self.tool_calls:
            return "tool_calls"
        return engine_reason

    # ----- text / reasoning modes ---------------------------------------------------

    def _char(self, c: str) -> None:
        if self._mode == "call":
            self._call_char(c)
            return
        if self._mode == "text":
            tags = ([CALL_OPEN] if self._tools else []) + ([THINK_OPEN] if self._reasoning else [])
        else:
            tags = [THINK_CLOSE]
        buf = self._tag + c
        if buf in tags:
            self._tag = ""
            self._on_tag(buf)
        elif any(t.startswith(buf) for t in tags):
            self._tag = buf
        else:  # tags hold a single '<', so only a new '<' can start another
            self._tag = "<" if c == "<" and tags else ""
            self._emit(buf[:-1] if self._tag else buf)

    def _emit(self, text: str) -> None:
        if self._mode == "text":
            # trailing whitespace waits where a call could follow, or a <think> block could still
            # open the reply; past the reply's first text (no tools) newlines stream as they come
            self._emit_text(text, hold_ws=self._tools or (self._reasoning and not self.text))
        else:
            self._emit_reasoning(text, hold_ws=True)

    def _channel_text(self, text: str, hold_ws: bool) -> str:
        if self._skip_ws:
            text = text.lstrip(JSON_WS)
            if not text:
                return ""
            self._skip_ws = False
        text = self._ws + text
        body = text.rstrip(JSON_WS) if hold_ws else text
        self._ws = text[len(body):]
        return body

    def _emit_text(self, text: str, hold_ws: bool) -> None:
        body = self._channel_text(text, hold_ws)
        if body:
            if self._after_call:
                body = body.lstrip(JSON_WS)
                self._after_call = False
            self.text += body
            self._events.append(TextDelta(body))

    def _emit_reasoning(self, text: str, hold_ws: bool) -> None:
        body = self._channel_text(text, hold_ws)
        if body:
            self.reasoning += body
            self._events.append(ReasoningDelta(body))

    def _on_tag(self, tag: str) -> None:
        self._ws = ""  # whitespace before a tag is formatting
        if tag == THINK_OPEN:
            self._mode, self._skip_ws = "reasoning", True
        elif tag == THINK_CLOSE:
            self._mode, self._skip_ws = "text", True
        else:
            self._mode, self._skip_ws = "call", False
            self._call, self._call_raw, self._call_end = _CallScanner(), CALL_OPEN, ""
            self._call_id, self._call_args, self._pending_args = None, "", ""

    # ----- call mode ----------------------------------------------------------------

    def _call_char(self, c: str) -> None:
        scanner = self._call
        assert scanner is not None
        if not scanner.in_str and (self._call_end or c == "<"):
            buf = self._call_end + c
            if buf == CALL_CLOSE:
                self._call_raw += c
                self._end_call()
                return
            if CALL_CLOSE.startswith(buf):
                self._call_end = buf
                self._call_raw += c
                return
            # not the end tag: replay the held characters through the scanner
            self._call_end = ""
            self._call_raw = self._call_raw[:len(self._call_raw) - len(buf) + 1] + buf[0]
            self._scan(buf[0])
            for ch in buf[1:]:
                self._call_char(ch)
            return
        self._call_raw += c
        self._scan(c)

    def _scan(self, c: str) -> None:
        assert self._call is not None
        for kind, value in self._call.feed(c):
            if kind == "name":
                self._start_call(value)
            elif self._call_id is not None:
                self._call_args += value
                self._events.append(ToolCallArgsDelta(self._next_index, value))
            else:
                self._pending_args += value

    def _start_call(self, name: str) -> None:
        self._call_id, self._call_name = self._new_id(), name
        self._events.append(ToolCallStart(self._next_index, self._call_id, name))
        if self._pending_args:
            self._call_args = self._pending_args
            self._events.append(ToolCallArgsDelta(self._next_index, self._pending_args))
            self._pending_args = ""

    def _end_call(self) -> None:
        """`</tool_call>` seen (or output ended after a complete JSON object)."""
        scanner = self._call
        assert scanner is not None
        obj = _parse_call(scanner.text)
        if obj is None:
            self._call_malformed(mark=True)
            return
        if self._call_id is None:
            self._start_call(scanner.name or obj["name"])
        if not scanner.has_args:
            args = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
            self._call_args += args
            self._events.append(ToolCallArgsDelta(self._next_index, args))
        self._close_call()

    def _close_call(self) -> None:
        assert self._call_id is not None and self._call is not None
        self._events.append(ToolCallEnd(self._next_index))
        self.tool_calls.append(ToolCall(self._call_id, self._call_name, self._call_args))
        self._next_index += 1
        self._mode, self._call, self._after_call, self._skip_ws = "text", None, True, False

    def _call_malformed(self, mark: bool) -> None:
        """The block is not a call: its raw text (tags included) becomes content."""
        self.malformed = self.malformed or mark
        if self._call_id is not None:
            self._next_index += 1  # the started index is spent
        raw = self._call_raw
        self._mode, self._call, self._after_call, self._skip_ws = "text", None, False, False
        self._emit_text(raw, hold_ws=not self._finished)

    def _finish_call(self, truncated: bool) -> None:
        scanner = self._call
        assert scanner is not None
        if truncated:
            self.truncated_call = True
            if self._call_id is not None:
                self._close_call()
            else:
                self._call_malformed(mark=False)
        elif _parse_call(scanner.text) is not None:
            self._end_call()  # the model ended after the JSON but without </tool_call>
        else:
            self._call_malformed(mark=True)

    def _take(self) -> list[Event]:
        out, self._events = merge_deltas(self._events), []
        return out
