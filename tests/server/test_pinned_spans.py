"""Pinned spans (issue 12): with retrieval attention on, every chat API pins the system prompt +
tools and the current user turn + its live tool trajectory, exactly (checked on the decoded span
text of the real SmolLM2 template); spans that cannot fit the budget are a 400 in each API's shape."""

from __future__ import annotations

import json

import pytest

from kvtier.config import RetrievalConfig
from kvtier.engine.request import PinnedBudget
from kvtier.server.spans import current_turn
from tests.server.conftest import make_client
from tests.server.fakes import FakeEngine

MODEL = "smollm2-135m"
PAGE = 16
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SYSTEM = "SYS_START You are a careful weather agent. SYS_END"
EARLY_Q, EARLY_A = "EARLY_Q: hello there", "EARLY_A: hi, ask me about the weather"
CURRENT = "CURRENT_TURN: what is the weather in Paris?"
RESULT = "TOOL_RESULT: 18 C and sunny"
REMINDER = "REMINDER: answer briefly"
ARGS = '{"city": "Paris"}'


class PinningEngine(FakeEngine):
    """The fake engine as if it ran retrieval attention with `budget` tokens."""

    def __init__(self, tokenizer, budget: int):
        super().__init__(tokenizer)
        self.pinned_budget = PinnedBudget(RetrievalConfig(budget=budget, sink=16, window=64), PAGE)


@pytest.fixture
def pin_engine(tokenizer):
    return PinningEngine(tokenizer, budget=100_000)


@pytest.fixture
def pin_client(pin_engine):
    with make_client(pin_engine) as c:
        yield c


def chat_body(system: str = SYSTEM) -> dict:
    return {"model": MODEL, "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}],
            "messages": [
                {"role": "developer", "content": system},
                {"role": "user", "content": EARLY_Q},
                {"role": "assistant", "content": EARLY_A},
                {"role": "user", "content": CURRENT},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]}


def messages_body(system: str = SYSTEM) -> dict:
    return {"model": MODEL, "max_tokens": 8, "system": system,
            "tools": [{"name": "get_weather", "input_schema": PARAMS}],
            "messages": [
                {"role": "user", "content": EARLY_Q},
                {"role": "assistant", "content": EARLY_A},
                {"role": "user", "content": CURRENT},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                # Text sent beside tool results (Claude Code's reminders) is part of the trajectory.
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT},
                                             {"type": "text", "text": REMINDER}]}]}


def responses_body(system: str = SYSTEM) -> dict:
    return {"model": MODEL, "max_output_tokens": 8, "instructions": system,
            "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}],
            "input": [
                {"type": "message", "role": "user", "content": EARLY_Q},
                {"type": "message", "role": "assistant", "content": EARLY_A},
                {"type": "message", "role": "user", "content": CURRENT},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": ARGS},
                {"type": "function_call_output", "call_id": "call_1", "output": RESULT}]}


APIS = {"chat": ("/v1/chat/completions", chat_body), "messages": ("/v1/messages", messages_body),
        "responses": ("/v1/responses", responses_body)}


def _spans_text(engine, tokenizer) -> tuple[str, list[str]]:
    req = engine.requests[-1]
    ids = req.prompt_token_ids
    return tokenizer.decode(ids), [tokenizer.decode(ids[a:b]) for a, b in req.pinned_spans]


@pytest.mark.parametrize("api", list(APIS))
def test_spans_cover_system_tools_and_the_current_turn_exactly(pin_client, pin_engine, tokenizer, api):
    path, body = APIS[api]
    r = pin_client.post(path, json=body())
    assert r.status_code == 200, r.text
    prompt, (head, tail) = _spans_text(pin_engine, tokenizer)
    # span 1: the system turn with the Hermes tool prompt, up to the first user text
    assert head == prompt[:prompt.index(EARLY_Q)]
    assert head.startswith("<|im_start|>system\n" + SYSTEM) and '"get_weather"' in head
    assert head.endswith("<|im_end|>\n<|im_start|>user\n")
    # span 2: the current user text to the end: the call, the result, the generation prompt
    assert tail == prompt[prompt.index(CURRENT):]
    assert "<tool_call>" in tail and RESULT in tail and tail.endswith("<|im_start|>assistant\n")
    assert (REMINDER in tail) == (api == "messages")
    assert EARLY_A not in head + tail


@pytest.mark.parametrize("api", list(APIS))
def test_a_single_turn_is_pinned_whole(pin_client, pin_engine, api):
    path, body = APIS[api]
    b = body()
    if api == "chat":
        b["messages"] = [{"role": "user", "content": CURRENT}]
    elif api == "messages":
        b["messages"] = [{"role": "user", "content": CURRENT}]
        del b["system"]
    else:
        b["input"] = CURRENT
        del b["instructions"]
    assert pin_client.post(path, json=b).status_code == 200
    req = pin_engine.requests[-1]
    assert req.pinned_spans == ((0, len(req.prompt_token_ids)),)


def test_spans_follow_spliced_replies(pin_client, pin_engine, tokenizer):
    """An earlier reply spliced in as its sampled ids (server/history.py) moves no boundary."""
    pin_engine.spelling = lambda text: [i for k in range(0, len(text), 3) for i in tokenizer.encode(text[k:k + 3])]
    pin_engine.script = EARLY_A
    b = chat_body()
    first = {**b, "messages": b["messages"][:2]}
    reply = pin_client.post("/v1/chat/completions", json=first).json()["choices"][0]["message"]
    b["messages"][2] = {"role": "assistant", "content": reply["content"]}
    pin_engine.script = None
    assert pin_client.post("/v1/chat/completions", json=b).status_code == 200
    turn1 = pin_engine.seen[0]
    ids = pin_engine.requests[-1].prompt_token_ids
    assert ids[:len(turn1)] == turn1  # the reply kept its odd spelling
    prompt, (head, tail) = _spans_text(pin_engine, tokenizer)
    assert head == prompt[:prompt.index(EARLY_Q)] and tail == prompt[prompt.index(CURRENT):]


def test_raw_completions_and_dense_engines_pin_nothing(pin_client, pin_engine, client, engine):
    r = pin_client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4})
    assert r.status_code == 200 and pin_engine.requests[-1].pinned_spans == ()
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    assert engine.requests[-1].pinned_spans == ()


def test_current_turn_skips_text_sent_with_tool_results():
    msgs = [{"role": "system"}, {"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "user"}]
    assert current_turn(msgs) == 1
    assert current_turn(msgs[:1]) is None
    assert current_turn([{"role": "tool"}, {"role": "user"}]) == 1


# ---- over the budget: a 400 in each API's shape, before any stream starts ---------------------------

LONG_SYSTEM = SYSTEM + " " + " ".join(f"rule {i}: be precise." for i in range(80))  # ~500 tokens


@pytest.fixture
def tight_client(tokenizer):
    # budget 512 = 32 pages; sink 1 page + window 64 tokens = 5 pages; the system prompt alone ~ 33 pages
    with make_client(PinningEngine(tokenizer, budget=512)) as c:
        yield c


def _check_message(message: str) -> None:
    assert "system prompt + tools + current turn" in message
    assert "over the --kvmem-budget of 512" in message and "raise the budget or shorten them" in message


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_apis_refuse_pins_past_the_budget(tight_client, api, stream):
    path, body = APIS[api]
    r = tight_client.post(path, json={**body(LONG_SYSTEM), "stream": stream})
    if api == "responses" and stream:  # as for any context overflow: Codex's response.failed
        assert r.status_code == 200
        failed = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and '"response.failed"' in line]
        err = failed[0]["response"]["error"]
        assert err["code"] == "context_length_exceeded"
        _check_message(err["message"])
        return
    assert r.status_code == 400, r.text
    assert r.headers["x-should-retry"] == "false"
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded"
    _check_message(err["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_refuses_pins_past_the_budget(tight_client, stream):
    r = tight_client.post("/v1/messages", json={**messages_body(LONG_SYSTEM), "stream": stream})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    _check_message(body["error"]["message"])

