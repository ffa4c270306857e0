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


async def drop_stream(url: str, path: str, body: dict, headers: dict, timeout: float = 60) -> None:
    """Start a streamed request, read one frame, hang up (a client that left mid-stream)."""
    import httpx

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as c:
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for _ in r.aiter_bytes():
                break


def check_responses_stream(events: list, final) -> None:
    """An openai SDK responses.stream(): event order, sequence numbers, text deltas == final text."""
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
