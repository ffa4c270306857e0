"""Requests captured from the real agent clients, replayed in-process over FakeEngine.

fixtures/agent_clients/*.json: one request each (headers and JSON body as the client sent them;
long prompt strings trimmed, the structure exact), captured through a logging proxy in front of
`kvtier serve`: Claude Code 2.1.332 (`claude -p`), Codex CLI 0.171.0 (`codex exec`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.server.convert import SYSTEM_OPEN, render_prompt
from tests.server.conftest import make_client
from tests.server.sse_util import parse_sse

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "agent_clients").glob("*.json"))
MODEL = "smollm2-135m"
CLIENT_CONTEXT = 32768  # the clients' prompts are 5-20K tokens; Qwen2.5's context
BARE_CALL = '```json\n{"name": "Bash", "arguments": {"command": "echo hi > hello.txt"}}\n```'


def _replay(client, fx: dict):
    body = {**fx["body"], "model": MODEL}
    headers = {k: v for k, v in fx["headers"].items() if k not in ("x-api-key", "authorization")}
    url = fx["path"] + (f"?{fx['query']}" if fx["query"] else "")
    return client.request(fx["method"], url, json=body, headers=headers)


def _check_anthropic_stream(text: str) -> list:
    frames = [f for f in parse_sse(text) if f.event]
    events = [f.event for f in frames]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    assert all(f.event == f.data["type"] for f in frames)
    starts = [f.data["index"] for f in frames if f.event == "content_block_start"]
    assert starts == list(range(len(starts)))
    delta = next(f.data for f in frames if f.event == "message_delta")
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    return frames


def _check_responses_stream(text: str) -> list:
    frames = [f for f in parse_sse(text) if f.event]
    events = [f.event for f in frames]
    assert events[0] == "response.created" and events[-1] == "response.completed", events
    assert [f.data["sequence_number"] for f in frames] == list(range(len(frames)))
    done = frames[-1].data["response"]
    assert done["id"] and {"input_tokens", "output_tokens", "total_tokens"} <= set(done["usage"])
    return frames


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_captured_request_is_served(path, engine):
    fx = json.loads(path.read_text())
    engine.max_model_len = CLIENT_CONTEXT
    with make_client(engine) as client:
        r = _replay(client, fx)
    assert r.status_code == 200, r.text
    if fx["path"] == "/v1/messages":
        _check_anthropic_stream(r.text)
        # Claude Code asks for max_tokens 32000 whatever the context: cut to what is left
        req = engine.requests[-1]
        assert req.params.max_tokens == min(fx["body"]["max_tokens"], CLIENT_CONTEXT - len(req.prompt_token_ids))
    else:
        _check_responses_stream(r.text)


def test_claude_code_system_entries_render_in_place(engine, tokenizer):
    fx = json.loads((FIXTURES[0].parent / "claude_code_default_turn.json").read_text())
    assert "system" in [m["role"] for m in fx["body"]["messages"][1:]]
    engine.max_model_len = CLIENT_CONTEXT
    with make_client(engine) as client:
        assert _replay(client, fx).status_code == 200
    prompt = tokenizer.decode(engine.requests[-1].prompt_token_ids)
    mid = next(m for m in fx["body"]["messages"] if m["role"] == "system")["content"][0]["text"]
    assert f"<|im_start|>system\n{mid}" in prompt  # its own system turn, where the client put it
    assert prompt.index("Write hello.txt") < prompt.index(mid[:40])


class LeadingSystemOnly:
    """A tokenizer whose template refuses system turns after the first (as Gemma's / Mistral's do)."""

    def __init__(self, inner):
        self.inner = inner
        self.chat_template = inner.chat_template
        self.has_tool_support = inner.has_tool_support

    def apply_chat_template(self, messages, **kw) -> str:
        if any(m["role"] == "system" for m in messages[1:]):
            raise ValueError("System role only allowed at the start")
        return self.inner.apply_chat_template(messages, **kw)


def test_late_system_folds_into_user_turn_when_template_refuses(tokenizer):
    msgs = [{"role": "system", "content": "S0"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": "A1"}, {"role": "system", "content": "S2"},
            {"role": "user", "content": "U2"}]
    in_place = render_prompt(tokenizer, [dict(m) for m in msgs], None)
    assert "<|im_start|>system\nS2<|im_end|>" in in_place
    folded = render_prompt(LeadingSystemOnly(tokenizer), [dict(m) for m in msgs], None)
    assert f"<|im_start|>user\n{SYSTEM_OPEN}S2" in folded and "U2" in folded
    assert folded.count("<|im_start|>system") == 1
    # the turns before the late system message render exactly as before (prefix cache)
    head = in_place[:in_place.index("<|im_start|>system\nS2")]
    assert folded.startswith(head)


def test_anthropic_system_role_and_bad_roles(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "be brief"}]}]
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 20, "messages": msgs})
    assert r.status_code == 200, r.text
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 20,
                                          "messages": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_unknown_betas_ignored_and_max_tokens_clamped(client, engine):
    engine.max_model_len = 200
    r = client.post("/v1/messages?beta=true", headers={"anthropic-beta": "no-such-beta-2099-01-01,other"},
                    json={"model": MODEL, "max_tokens": 32000, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    req = engine.requests[-1]
    assert req.params.max_tokens == 200 - len(req.prompt_token_ids)
    # the prompt alone past the context is still the client's 400, in Anthropic's shape
    r = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 10,
                                          "messages": [{"role": "user", "content": "word " * 400}]})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("method", ["HEAD", "GET"])
@pytest.mark.parametrize("path", ["/", "/v1", "/v1/", "/health"])
def test_probes_answer_200(engine, method, path):
    with make_client(engine, api_key="secret") as client:  # probes need no key
        r = client.request(method, path)
    assert r.status_code == 200
    assert (r.content == b"") == (method == "HEAD")


def test_head_on_a_keyed_route_still_needs_the_key(engine):
    with make_client(engine, api_key="secret") as client:
        assert client.head("/v1/models").status_code == 401
        assert client.head("/v1/models", headers={"authorization": "Bearer secret"}).status_code == 200


BASH_TOOL = {"name": "Bash", "description": "run a shell command",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}


CALL_JSON = '{"name": "Bash", "arguments": {"command": "echo hi > hello.txt"}}'


@pytest.mark.parametrize("reply", [BARE_CALL, CALL_JSON, f"<tools>\n{CALL_JSON}\n</tools>", f"<tools>{CALL_JSON}"])
def test_bare_json_call_becomes_tool_use(client, engine, reply):
    """Qwen2.5-Coder writes calls without <tool_call> tags (fenced, bare, or inside the <tools> tag
    the tool list came in); a whole-reply call is still a call."""
    engine.script = reply
    body = {"model": MODEL, "max_tokens": 200, "tools": [BASH_TOOL],
            "messages": [{"role": "user", "content": "write hello.txt"}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["stop_reason"] == "tool_use"
    assert [(b["type"], b["name"], b["input"]) for b in msg["content"]] == [
        ("tool_use", "Bash", {"command": "echo hi > hello.txt"})]
    frames = _check_anthropic_stream(client.post("/v1/messages", json={**body, "stream": True}).text)
    assert [f.data["content_block"]["type"] for f in frames if f.event == "content_block_start"] == ["tool_use"]
    # without tools, or naming a tool not offered, the same text stays text
    r = client.post("/v1/messages", json={**body, "tools": [{**BASH_TOOL, "name": "Other"}]})
    assert r.json()["content"][0] == {"type": "text", "text": reply}
