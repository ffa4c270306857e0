"""Streaming-safe parsing of model output into text, reasoning and tool calls.

(API skeleton; implementation in progress.)
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable


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
    return "call_" + secrets.token_hex(12)


class OutputParser:
    """One per request; no shared state."""

    def __init__(self, tools: bool, reasoning: bool, starts_in_reasoning: bool = False,
                 id_factory: Callable[[], str] = default_call_id) -> None:
        self.tool_calls: list[ToolCall] = []
        self.text = ""
        self.reasoning = ""
        self.malformed = False
        self.truncated = False

    def feed(self, text_delta: str) -> list[Event]:
        raise NotImplementedError

    def finish(self, truncated: bool = False) -> list[Event]:
        raise NotImplementedError
