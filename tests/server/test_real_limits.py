"""`kvtier serve` on the embedded model: dropped clients abort, admission limits, the loopback guards."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import API_KEY, REPO, free_port, real_server_process
from tests.server.sse_util import drop_stream

MODEL = "smollm2-135m"

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
N_DROPPED = 50
SHORT_REQUEST_LIMIT_S = 5.0
SETTLE_LIMIT_S = 5.0  # an abort lands within one engine step; a step is well under a second here
LONG_TOKENS = 1000  # far more than any test waits for


async def _drop_stream(url: str, path: str, body: dict) -> None:
    await drop_stream(url, path, body, HEADERS, timeout=60)


async def _engine_idle(c: httpx.AsyncClient) -> dict:
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while True:
        health = (await c.get("/health")).json()
        busy = health["engine"]["running"] or health["engine"]["waiting"] or health["active"] or health["queued"]
        if not busy or time.monotonic() > deadline:
            return health
        await asyncio.sleep(0.05)


async def _cancellation(url: str) -> tuple[float, dict]:
    msgs = [{"role": "user", "content": "Write a very long story about a dragon."}]
    bodies = [("/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": LONG_TOKENS, "messages": msgs}),
              ("/v1/messages", {"model": MODEL, "stream": True, "max_tokens": LONG_TOKENS, "messages": msgs}),
              ("/v1/responses", {"model": MODEL, "stream": True, "max_output_tokens": LONG_TOKENS, "input": msgs})]
    await asyncio.gather(*(_drop_stream(url, *bodies[i % 3]) for i in range(N_DROPPED)))
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=60) as c:
        # a non-streamed request whose client gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", timeout=0.5,
                         json={"model": MODEL, "max_tokens": LONG_TOKENS, "messages": msgs})
        t0 = time.monotonic()
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 10, "temperature": 0,
                                                       "messages": [{"role": "user", "content": "Hi"}]})
        elapsed = time.monotonic() - t0
        assert r.status_code == 200, r.text
        return elapsed, await _engine_idle(c)


@pytest.mark.timeout(300)
def test_dropped_streams_are_aborted(real_server):
    elapsed, health = asyncio.run(_cancellation(real_server.url))
    assert elapsed < SHORT_REQUEST_LIMIT_S
    assert health["engine"]["running"] == 0 and health["engine"]["waiting"] == 0, health
    assert health["active"] == 0 and health["queued"] == 0, health


def test_loopback_host_header_guard(real_server):
    ok = httpx.get(real_server.url + "/v1/models", headers={**HEADERS, "Host": f"localhost:{real_server.port}"})
    assert ok.status_code == 200
    r = httpx.get(real_server.url + "/v1/models", headers={**HEADERS, "Host": "attacker.example"})
    assert r.status_code == 403 and "loopback" in r.json()["error"]["message"]


def test_non_loopback_host_needs_an_api_key():
    args = [sys.executable, "-m", "kvtier", "serve", "--host", "0.0.0.0", "--port", str(free_port())]
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_API_KEY"}
    p = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--api-key" in p.stderr + p.stdout


@pytest.fixture(scope="module")
def tiny_server():
    """One request in the engine, none waiting: the next is refused at once."""
    srv = real_server_process("--api-key", API_KEY, "--max-concurrency", "1", "--max-queue", "0")
    yield srv
    srv.stop()


def test_overload_429_and_529(tiny_server):
    url = tiny_server.url
    oai = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    ant = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    body = {"model": MODEL, "stream": True, "max_tokens": LONG_TOKENS,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=60) as held:
        lines = held.iter_lines()  # keep a reference: a collected iterator closes the stream
        for line in lines:  # wait until the held request is generating
            if '"content": "' in line and '"content": ""' not in line:
                break
        with pytest.raises(openai.RateLimitError):
            oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        r = httpx.post(url + "/v1/messages", headers={"x-api-key": API_KEY},
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
        with pytest.raises(anthropic.APIStatusError) as e:
            ant.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 529
    # the held client left: its slot is free again and nothing accepted was lost
    deadline = time.monotonic() + SETTLE_LIMIT_S
    while httpx.get(url + "/health").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    c = oai.chat.completions.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert c.choices[0].message.content
