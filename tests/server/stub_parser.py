"""A small stand-in for kvtier.server.parsing.OutputParser, used by the server tests
only while the real parser is still a skeleton (its feed() raises NotImplementedError).

Streaming-safe enough for scripted outputs: holds back any suffix that could
start a tag, emits a whole tool call once its closing tag arrives.
"""

from __future__ import annotations

import json
import secrets

from kvtier.server import parsing
from kvtier.server.parsing import ReasoningDelta, TextDelta, ToolCall, ToolCallArgsDelta, ToolCallEnd, ToolCallStart

OPEN_THINK, CLOSE_THINK, OPEN_CALL, CLOSE_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"


def _holdback(buf: str, tags: list[str]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a tag."""
    best = 0
    for tag in tags:
        for n in range(1, len(tag)):
            if buf.endswith(tag[:n]):
                best = max(best, n)
    return best


class StubParser:
    def __init__(self, tools: bool, reasoning: bool, starts_in_reasoning: bool = False, id_factory=None):
        self.tools, self.reasoning = tools, reasoning
        self.mode = "think" if starts_in_reasoning else "text"
        self.buf = ""
        self.tool_calls: list[ToolCall] = []
        self.malformed = False
        self.text = ""

    def _opens(self) -> list[str]:
        return ([OPEN_THINK] if self.reasoning else []) + ([OPEN_CALL] if self.tools else [])

    def feed(self, delta: str) -> list:
        self.buf += delta
        events: list = []
        while True:
            if self.mode == "text":
                hits = [(self.buf.find(t), t) for t in self._opens() if t in self.buf]
                if not hits:
                    keep = _holdback(self.buf, self._opens())
                    out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    if out:
                        events.append(TextDelta(out))
                    return events
                pos, tag = min(hits)
                if self.buf[:pos]:
                    events.append(TextDelta(self.buf[:pos]))
                self.buf = self.buf[pos + len(tag):]
                self.mode = "think" if tag == OPEN_THINK else "tool"
            elif self.mode == "think":
                if CLOSE_THINK not in self.buf:
                    keep = _holdback(self.buf, [CLOSE_THINK])
                    out, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    if out:
                        events.append(ReasoningDelta(out))
                    return events
                pos = self.buf.index(CLOSE_THINK)
                if self.buf[:pos]:
                    events.append(ReasoningDelta(self.buf[:pos]))
                self.buf, self.mode = self.buf[pos + len(CLOSE_THINK):], "text"
            else:
                body = self.buf.lstrip()
                try:
                    obj, end = json.JSONDecoder().raw_decode(body)
                except json.JSONDecodeError:
                    return events
                rest = body[end:]
                if CLOSE_CALL not in rest:
                    return events
                events += self._call(obj, body[:end])
                self.buf, self.mode = rest[rest.index(CLOSE_CALL) + len(CLOSE_CALL):].lstrip("\n"), "text"

    def _call(self, obj, raw: str) -> list:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            self.malformed = True
            return [TextDelta(OPEN_CALL + "\n" + raw + "\n" + CLOSE_CALL)]
        args = json.dumps(obj.get("arguments", {}), ensure_ascii=False)
        i = len(self.tool_calls)
        call = ToolCall("call_" + secrets.token_hex(12), obj["name"], args)
        self.tool_calls.append(call)
        half = len(args) // 2
        return [ToolCallStart(i, call.id, call.name), ToolCallArgsDelta(i, args[:half]),
                ToolCallArgsDelta(i, args[half:]), ToolCallEnd(i)]

    def finish(self, truncated: bool = False) -> list:
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.mode == "think":
            return [ReasoningDelta(rest)]
        if self.mode == "tool":
            self.malformed = True
            return [TextDelta(OPEN_CALL + rest)]
        return [TextDelta(rest)]


def real_parser_ready() -> bool:
    try:
        parsing.OutputParser(tools=False, reasoning=False).feed("x")
    except NotImplementedError:
        return False
    return True


def install_if_needed() -> None:
    """Point the server at StubParser while the real parser is unfinished."""
    if not real_parser_ready():
        import kvtier.server.generation as gen
        gen.OutputParser = StubParser
