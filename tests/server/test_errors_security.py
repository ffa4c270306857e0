"""Errors in each API's shape, limits, auth, Host guard, CORS, health and metrics."""

from __future__ import annotations

import asyncio

import pytest

from tests.server.conftest import make_client

MODEL = "smollm2-135m"
MSG = [{"role": "user", "content": "hi"}]


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if 400 <= status < 500 and status != 429:
        assert r.headers["x-should-retry"] == "false"
    return err


def _anthropic_error(r, status: int, etype: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == etype
    return body["error"]


def test_malformed_json_is_400(client):
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/completions"):
        r = client.post(path, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
        _openai_error(r, 400)
    r = client.post("/v1/messages", content=b"{nope", headers={"content-type": "application/json"})
    _anthropic_error(r, 400, "invalid_request_error")


def test_wrong_types_and_missing_fields_are_400(client):
    _openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": "hi"}), 400)
    _openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "temperature": "hot"}), 400)
    _openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "n": 3}), 400)
    _openai_error(client.post("/v1/chat/completions", json=[1, 2]), 400)
    _openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    err = _anthropic_error(client.post("/v1/messages", json={"model": MODEL, "messages": MSG}),
                           400, "invalid_request_error")
    assert "max_tokens" in err["message"]


def test_unknown_model_is_404(client):
    err = _openai_error(client.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}), 404)
    assert "gpt-9" in err["message"]
    _openai_error(client.post("/v1/responses", json={"model": "gpt-9", "input": "hi"}), 404)
    _anthropic_error(client.post("/v1/messages", json={"model": "gpt-9", "max_tokens": 5, "messages": MSG}),
                     404, "not_found_error")


def test_context_overflow_names_the_lengths(client, engine):
    engine.max_model_len = 100
    err = _openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG,
                                                                   "max_tokens": 90}), 400)
    assert "100" in err["message"] and "90" in err["message"] and err["code"] == "context_length_exceeded"
    long = [{"role": "user", "content": "word " * 200}]
    _openai_error(client.post("/v1/chat/completions", json={"model": MODEL, "messages": long}), 400)
    err = _anthropic_error(client.post("/v1/messages", json={"model": MODEL, "max_tokens": 90, "messages": long}),
                           400, "invalid_request_error")
    assert "100" in err["message"]
    # Anthropic's max_tokens past the context is cut to the rest of it (clients send 32000 whatever the model)
    assert client.post("/v1/messages", json={"model": MODEL, "max_tokens": 90, "messages": MSG}).status_code == 200
    assert engine.requests[-1].params.max_tokens == 100 - len(engine.requests[-1].prompt_token_ids)
    # no max_tokens: the budget is the rest of the context
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 200
    assert engine.requests[-1].params.max_tokens == 100 - len(engine.requests[-1].prompt_token_ids)


def test_unknown_route_and_method(client):
    _openai_error(client.get("/v1/nothing"), 404)
    assert client.get("/v1/chat/completions").status_code == 405


def test_auth(engine):
    with make_client(engine, api_key="sekrit") as c:
        _openai_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG}), 401)
        _anthropic_error(c.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": MSG}),
                         401, "authentication_error")
        _openai_error(c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "sekrit"}).status_code == 200
        assert c.get("/health").status_code == 200


def test_host_header_guard_on_loopback(engine):
    with make_client(engine) as c:
        r = c.get("/v1/models", headers={"host": "evil.example.com"})
        assert r.status_code == 403
        for host in ("localhost:8000", "127.0.0.1", "[::1]:8000"):
            assert c.get("/v1/models", headers={"host": host}).status_code == 200
    with make_client(engine, host="0.0.0.0", api_key="k") as c:  # off loopback the key is the guard
        assert c.get("/v1/models", headers={"host": "box.lan", "x-api-key": "k"}).status_code == 200


def test_cors_only_when_enabled(engine):
    pre = {"origin": "http://app.example", "access-control-request-method": "POST"}
    with make_client(engine) as c:
        r = c.options("/v1/chat/completions", headers=pre)
        assert "access-control-allow-origin" not in r.headers
    with make_client(engine, cors=("http://app.example",)) as c:
        r = c.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        other = c.options("/v1/chat/completions", headers={**pre, "origin": "http://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "http://evil.example"
    with make_client(engine, cors=("*",)) as c:
        r = c.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://app.example")


def test_request_size_limit(engine):
    with make_client(engine, max_request_bytes=1000) as c:
        big = [{"role": "user", "content": "x" * 5000}]
        _openai_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": big}), 413)
        _anthropic_error(c.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": big}),
                         413, "request_too_large")
        assert c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG}).status_code == 200


@pytest.mark.timeout(60)
def test_overload_429_and_529(tokenizer):
    """max_concurrency 1 + queue 1: a third concurrent request is refused, none accepted is lost."""
    import httpx

    from kvtier.config import ServerConfig
    from kvtier.server.app import create_app
    from tests.server.fakes import FakeEngine

    engine = FakeEngine(tokenizer, token_delay=0.01)
    app = create_app(engine, ServerConfig(max_concurrency=1, max_queue=1))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as c:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            first = [asyncio.create_task(c.post("/v1/chat/completions", json=body)) for _ in range(2)]
            await asyncio.sleep(0.1)
            over = await c.post("/v1/chat/completions", json=body)
            over_a = await c.post("/v1/messages", json={**body, "max_tokens": 5})
            done = await asyncio.gather(*first)
            return over, over_a, done
    over, over_a, done = asyncio.run(scenario())
    assert over.status_code == 429 and over.json()["error"]["code"] == "rate_limit_exceeded"
    assert over_a.status_code == 529 and over_a.json()["error"]["type"] == "overloaded_error"
    assert [r.status_code for r in done] == [200, 200]


def test_health_and_metrics(client):
    client.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL and h["engine"]["running"] == 0
    m = client.get("/metrics")
    assert m.status_code == 200
    assert 'kvtier_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in m.text
    assert "kvtier_completion_tokens_total" in m.text
    assert client.get("/openapi.json").json()["paths"]["/v1/messages"]
    page = client.get("/")
    assert page.status_code == 200 and "<script" in page.text and "http" not in page.text.split("<script")[0].lower()
