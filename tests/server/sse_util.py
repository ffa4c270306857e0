"""Parse SSE bodies in tests: frames as (event, data, comment)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass
class Frame:
    event: str | None
    data: object | None  # parsed JSON, or the raw string ("[DONE]")
    comment: str | None


def parse_sse(text: str) -> list[Frame]:
    frames = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event = data = comment = None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                raw = line[6:]
                data = raw if raw == "[DONE]" else json.loads(raw)
            elif line.startswith(":"):
                comment = line[1:].strip()
        frames.append(Frame(event, data, comment))
    return frames


def data_frames(text: str) -> list:
    return [f.data for f in parse_sse(text) if f.data is not None]
