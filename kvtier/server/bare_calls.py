"""Tool calls written without their `<tool_call>` tags.

Small Qwen2.5(-Coder) models, asked for Hermes calls, mostly answer with the call's JSON alone:

    {"name": "Bash", "arguments": {"command": "ls"}}          bare
    ```json\\n{"name": "Bash", "arguments": {...}}\\n```       fenced (also a list of such objects)

llama.cpp's Hermes parser takes these as calls; so does this filter, but only when the *whole*
reply is such a document naming offered tools (a reply that merely contains JSON stays text).
It holds text back only while the reply still starts like one (`{`, `[` or a fence), so ordinary
prose streams as before; at the end a held reply becomes tool-call events, or is released as text.
"""

from __future__ import annotations

import json
import re

from kvtier.server.parsing import TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, default_call_id

FENCE = re.compile(r"^```(?:json)?\s*\n(.*?)\n?```\s*$", re.DOTALL)
# Tags other than <tool_call> that llama.cpp's Hermes parser takes around a call's JSON.
WRAPPERS = ("tools", "tool", "function_call", "response", "json", "xml", "JSON")
WRAPPED = re.compile(rf"^<({'|'.join(WRAPPERS)})>\s*(.*?)\s*(?:</\1>)?$", re.DOTALL)
# What a held reply may still start with: an object, a list, or a code fence (``` + optional "json").
OPENERS = ("{", "[", "```")


class BareCallHold:
    """Filter over parser events: whole-reply bare / fenced JSON calls -> ToolCall events."""

    def __init__(self, tool_names: tuple[str, ...]):
        self.names = set(tool_names)
        self.held = ""
        self.passing = not self.names  # no tools offered: nothing to hold
        self.calls = 0

    def filter(self, events: list, final: bool) -> list:
        out: list = []
        for ev in events:
            if self.passing:
                out.append(ev)
            elif isinstance(ev, TextDelta):
                self.held += ev.text
                if not _may_be_call(self.held):
                    out += self._release()
            else:  # a tagged call or reasoning came: the reply is not a bare call
                out += self._release() + [ev]
        if final and not self.passing:
            calls = self._parse(self.held)
            out += self._call_events(calls) if calls else self._release()
            self.passing = True
        return out

    def _release(self) -> list:
        self.passing = True
        text, self.held = self.held, ""
        return [TextDelta(text)] if text else []

    def _parse(self, text: str) -> list[tuple[str, str]] | None:
        body = text.strip()
        fenced = FENCE.match(body)
        wrapped = WRAPPED.match(body)
        if fenced:
            body = fenced.group(1).strip()
        elif wrapped:
            body = wrapped.group(2)
        try:
            doc = json.loads(body)
        except json.JSONDecodeError:
            return None
        items = doc if isinstance(doc, list) else [doc]
        calls = []
        for item in items:
            if not (isinstance(item, dict) and set(item) <= {"name", "arguments"}
                    and item.get("name") in self.names and isinstance(item.get("arguments", {}), dict)):
                return None
            calls.append((item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
        return calls or None

    def _call_events(self, calls: list[tuple[str, str]]) -> list:
        out: list = []
        for i, (name, args) in enumerate(calls):
            out += [ToolCallStart(i, default_call_id(), name), ToolCallArgsDelta(i, args), ToolCallEnd(i)]
        self.calls = len(calls)
        self.held = ""
        return out


def _may_be_call(text: str) -> bool:
    s = text.lstrip()
    if not s:
        return True
    if s[0] in "{[":
        return True
    if s[0] == "<":
        return _may_be_wrapped(s)
    if len(s) < len(OPENERS[2]):
        return OPENERS[2].startswith(s)
    if not s.startswith(OPENERS[2]):
        return False
    head = s[3:]  # optional "json", then a newline, then the document
    tag, nl, rest = head.partition("\n")
    if not nl:
        return "json".startswith(tag.strip()) or tag.strip() == ""
    rest = rest.lstrip()
    return tag.strip() in ("", "json") and (not rest or rest[0] in "{[")


def _may_be_wrapped(s: str) -> bool:
    """`s` (starting with `<`) may still become a wrapper tag and then a JSON document."""
    tag, closed, rest = s[1:].partition(">")
    if not closed:
        return any(w.startswith(tag) for w in WRAPPERS)
    rest = rest.lstrip()
    return tag in WRAPPERS and (not rest or rest[0] in "{[")
