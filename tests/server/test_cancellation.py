"""Clients that leave abort their requests: 50 dropped streams, then a short request is fast."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import API_KEY
from tests.server.sse_util import drop_stream

MODEL = "smollm2-135m"

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
N_DROPPED = 50
SHORT_REQUEST_LIMIT_S = 5.0
SETTLE_LIMIT_S = 2.0  # one fake step is 2 ms; allow slack for a loaded CI box


async def _stats(c: httpx.AsyncClient) -> dict:
    return (await c.get("/_test/stats")).json()


async def _drop_stream(url: str, path: str, body: dict) -> None:
    await drop_stream(url, path, body, HEADERS, timeout=30)


async def _scenario(url: str) -> tuple[float, dict, dict]:
    long_chat = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "LONG"}]}
    long_msg = {"model": MODEL, "stream": True, "max_tokens": 2000, "messages": [{"role": "user", "content": "LONG"}]}
    long_resp = {"model": MODEL, "stream": True, "input": "LONG"}
    jobs = []
    for i in range(N_DROPPED):
        path, body = [("/v1/chat/completions", long_chat), ("/v1/messages", long_msg),
                      ("/v1/responses", long_resp)][i % 3]
        jobs.append(_drop_stream(url, path, body))
    await asyncio.gather(*jobs)
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=30) as c:
        # a non-streamed request whose client times out is aborted too
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", timeout=0.3,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "LONG"}]})
        t0 = time.monotonic()
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 10,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        elapsed = time.monotonic() - t0
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + SETTLE_LIMIT_S
        stats = await _stats(c)
        while stats["running"] and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            stats = await _stats(c)
        health = (await c.get("/health")).json()
    return elapsed, stats, health


@pytest.mark.timeout(120)
def test_dropped_streams_are_aborted(fake_server):
    elapsed, stats, health = asyncio.run(_scenario(fake_server.url))
    assert elapsed < SHORT_REQUEST_LIMIT_S
    assert stats["running"] == 0, stats
    assert health["active"] == 0 and health["queued"] == 0, health
    # every dropped request that reached the engine was aborted, not run to the end
    assert stats["aborted"] >= 1
