"""The official openai and anthropic SDKs against `kvtier serve` on the embedded SmolLM2-135M.

One server process for the whole session (conftest.real_server); greedy decoding
and small max_tokens keep each request around a second on a 2-core CPU box.
SmolLM2's chat template has no tool support, so every tool test here also shows
the built-in Hermes tool prompt at work, and the grammar making a 135M model
write valid calls and documents.
"""

from __future__ import annotations

import json
import re
import secrets

import anthropic
import httpx
import jsonschema_rs
import openai
import pytest

from tests.server.conftest import API_KEY
from tests.server.sse_util import check_responses_stream

MODEL = "smollm2-135m"
PAGE_SIZE = 16  # the server's KV page: prefix-cache hits are whole pages
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time in a time zone",
                                         "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                                        "required": ["zone"]}}}
R_WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
             "parameters": CITY}
A_WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}
A_GREEDY = {"extra_body": GREEDY}  # this anthropic SDK version has no temperature argument
HI = "Hi"  # greedy SmolLM2 answers in ~10 tokens and stops: the SDK helpers want a natural stop
SHORT = 32
CALL_TOKENS = 48  # one call with a short argument, with room to spare


@pytest.fixture(scope="module")
def oai(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ant(real_server):
    return anthropic.Anthropic(base_url=real_server.url, api_key=API_KEY, max_retries=0, timeout=120)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def check_args(arguments: str, schema: dict) -> dict:
    doc = json.loads(arguments)
    jsonschema_rs.validate(schema, doc)
    return doc


# ---- chat completions --------------------------------------------------------------

def test_chat_create_stream_and_helper(oai):
    c = oai.chat.completions.create(model=MODEL, messages=user(HI), max_tokens=SHORT, **GREEDY)
    text = c.choices[0].message.content
    assert text and c.choices[0].finish_reason == "stop"
    assert c.usage.completion_tokens > 0 and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    chunks = list(oai.chat.completions.create(model=MODEL, messages=user(HI), max_tokens=SHORT, stream=True,
                                              stream_options={"include_usage": True}, **GREEDY))
    assert len({ch.id for ch in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert not any(ch.choices and ch.choices[0].delta.role for ch in chunks[1:])
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == [
        c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == c.usage.completion_tokens
    # the second run reads the prompt from the prefix cache, and says so
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= PAGE_SIZE
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    with oai.chat.completions.stream(model=MODEL, messages=user(HI), max_tokens=SHORT, **GREEDY) as s:
        deltas = [e.delta for e in s if e.type == "content.delta"]
        final = s.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content == text


def _chat_calls(oai, tools, **kw):
    plain = oai.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=tools, max_tokens=CALL_TOKENS,
                                        **GREEDY, **kw)
    with oai.chat.completions.stream(model=MODEL, messages=ASK_WEATHER, tools=tools, max_tokens=CALL_TOKENS,
                                     **GREEDY, **kw) as s:
        events = list(s)
        final = s.get_final_completion()
    return plain, events, final


def test_chat_tool_choice_required_streamed_equals_plain(oai):
    plain, events, final = _chat_calls(oai, [WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    msg = plain.choices[0].message
    assert plain.choices[0].finish_reason == "tool_calls" and not msg.content  # no free text before the call
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0].function.name in ("get_weather", "get_time")
    schema = {"get_weather": CITY, "get_time": TIME["function"]["parameters"]}[msg.tool_calls[0].function.name]
    check_args(msg.tool_calls[0].function.arguments, schema)
    want = [(t.function.name, t.function.arguments) for t in msg.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == want
    assert [(e.name, e.arguments) for e in events if e.type == "tool_calls.function.arguments.done"] == want
    assert final.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].id.startswith("call_") and len(msg.tool_calls[0].id) > 16


def test_chat_named_tool_choice_and_raw_deltas(oai, real_server):
    named = {"type": "function", "function": {"name": "get_time"}}
    plain, _, final = _chat_calls(oai, [WEATHER, TIME], tool_choice=named, parallel_tool_calls=False)
    assert [t.function.name for t in plain.choices[0].message.tool_calls] == ["get_time"]
    check_args(plain.choices[0].message.tool_calls[0].function.arguments, TIME["function"]["parameters"])
    # on the wire: the first delta of a call carries index, id, type and name; later ones only arguments
    body = {"model": MODEL, "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required",
            "parallel_tool_calls": False, "max_tokens": CALL_TOKENS, "stream": True, **GREEDY}
    deltas = []
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                assert "<tool_call>" not in (ch["choices"][0]["delta"].get("content") or "")
                deltas += ch["choices"][0]["delta"].get("tool_calls") or []
    first, rest = deltas[0], deltas[1:]
    assert first["index"] == 0 and first["id"] and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    check_args("".join(d["function"]["arguments"] for d in deltas), CITY)


def test_structured_output_validates_against_its_schema(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    c = oai.chat.completions.create(model=MODEL, messages=user("Describe a famous scientist as JSON."),
                                    response_format=fmt, max_tokens=64, **GREEDY)
    assert c.choices[0].finish_reason == "stop"
    jsonschema_rs.validate(PERSON, json.loads(c.choices[0].message.content))
    obj = oai.chat.completions.create(model=MODEL, messages=user("Give me a JSON object about a cat."),
                                      response_format={"type": "json_object"}, max_tokens=48, **GREEDY)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    r = oai.responses.create(model=MODEL, input="Describe a famous scientist as JSON.", max_output_tokens=64,
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}}, **GREEDY)
    assert r.status == "completed"
    jsonschema_rs.validate(PERSON, json.loads(r.output_text))


def test_openai_error_classes(oai, real_server):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="no-such-model", messages=user("hi"), max_tokens=4)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=5000)
    assert "2048" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=user("hi"), tools=[WEATHER], max_tokens=4,
                                    tool_choice={"type": "function", "function": {"name": "missing"}})
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=4, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input="hi", max_output_tokens=5000)
    bad = openai.OpenAI(base_url=real_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- responses ---------------------------------------------------------------------

def test_responses_create_stream_and_helper(oai):
    r = oai.responses.create(model=MODEL, input=HI, max_output_tokens=SHORT, **GREEDY)
    assert r.id.startswith("resp_") and r.status == "completed" and r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    with oai.responses.stream(model=MODEL, input=HI, max_output_tokens=SHORT, **GREEDY) as s:
        events = list(s)
        final = s.get_final_response()
    check_responses_stream(events, final)
    assert final.output_text == r.output_text and final.id.startswith("resp_")


def test_responses_tool_choice_required_streamed_equals_plain(oai):
    kw = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [R_WEATHER], "tool_choice": "required",
          "parallel_tool_calls": False, "max_output_tokens": CALL_TOKENS, **GREEDY}
    plain = oai.responses.create(**kw)
    calls = [(o.name, o.arguments) for o in plain.output if o.type == "function_call"]
    assert [o.type for o in plain.output] == ["function_call"] and calls[0][0] == "get_weather"
    check_args(calls[0][1], CITY)
    with oai.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == calls
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == calls[0][1]
    follow = [{"role": "user", "content": "What is the weather in Paris?"},
              *[o.model_dump(exclude_none=True) for o in final.output],
              {"type": "function_call_output", "call_id": final.output[0].call_id, "output": "18 C, sunny"}]
    assert oai.responses.create(model=MODEL, input=follow, max_output_tokens=8, **GREEDY).output_text


# ---- anthropic messages ------------------------------------------------------------

def test_messages_create_stream_and_helper(ant):
    m = ant.messages.create(model=MODEL, max_tokens=SHORT, messages=user(HI), **A_GREEDY)
    assert m.content[0].type == "text" and m.content[0].text
    assert m.stop_reason == "end_turn" and m.usage.output_tokens > 0
    with ant.messages.stream(model=MODEL, max_tokens=SHORT, messages=user(HI), **A_GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == m.content[0].text
    assert final.usage.cache_read_input_tokens >= PAGE_SIZE


def test_messages_tool_choice_any_streamed_equals_plain(ant):
    kw = {"model": MODEL, "max_tokens": CALL_TOKENS, "messages": ASK_WEATHER, "tools": [A_WEATHER],
          "tool_choice": {"type": "any", "disable_parallel_tool_use": True}, **A_GREEDY}
    m = ant.messages.create(**kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    jsonschema_rs.validate(CITY, m.content[0].input)
    with ant.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content] == [(m.content[0].name, m.content[0].input)]
    assert final.stop_reason == "tool_use"
    follow = ASK_WEATHER + [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[0].id,
                                                          "content": "18 C, sunny"}]}]
    assert ant.messages.create(model=MODEL, max_tokens=8, messages=follow, tools=[A_WEATHER], **A_GREEDY).content


def test_tools_reach_a_template_without_tool_support(ant):
    """SmolLM2's template ignores `tools`; the built-in Hermes prompt carries them instead."""
    plain = ant.messages.count_tokens(model=MODEL, messages=ASK_WEATHER).input_tokens
    offered = ant.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=[A_WEATHER]).input_tokens
    assert offered > plain + 60  # the tool prompt plus the tool's JSON definition


def test_anthropic_error_classes(ant, real_server):
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="no-such-model", max_tokens=4, messages=user("hi"))
    with pytest.raises(anthropic.BadRequestError) as e:
        ant.messages.create(model=MODEL, max_tokens=4, messages=user("word " * 2100))  # the prompt alone overflows
    assert "2048" in str(e.value)  # (a max_tokens past the context is cut to it, for Claude Code's 32000)
    r = httpx.post(real_server.url + "/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": MODEL, "messages": user("hi")})  # max_tokens is required here
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    bad = anthropic.Anthropic(base_url=real_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=4, messages=user("hi"))


# ---- agent sessions, progress ------------------------------------------------------

def test_multi_turn_tool_session_shares_the_previous_turn_prefix(oai):
    """Turn 2's prompt starts with exactly turn 1's prompt + output tokens (cache hit to the page)."""
    history = [{"role": "system", "content": f"Session {secrets.token_hex(4)}."}, *ASK_WEATHER]
    for turn in range(2):
        c = oai.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="required",
                                        parallel_tool_calls=False, max_tokens=CALL_TOKENS, **GREEDY)
        if turn:
            seen = prev.usage.prompt_tokens + prev.usage.completion_tokens
            assert c.usage.prompt_tokens_details.cached_tokens >= seen // PAGE_SIZE * PAGE_SIZE, (prev.usage, c.usage)
        msg = c.choices[0].message
        assert c.choices[0].finish_reason == "tool_calls"
        history += [msg.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "18 C, sunny"},
                    {"role": "user", "content": "And in Rome?"}]
        prev = c


def test_responses_tool_session_caches_the_whole_previous_turn(oai):
    """Codex's loop: output items go back as input; turn 2's cache covers turn 1's prompt + reply."""
    items = [{"type": "message", "role": "system", "content": f"Session {secrets.token_hex(4)}."},
             {"type": "message", "role": "user", "content": ASK_WEATHER[0]["content"]}]
    for turn in range(2):
        r = oai.responses.create(model=MODEL, input=items, tools=[R_WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=CALL_TOKENS, **GREEDY)
        if turn:
            seen = prev.usage.input_tokens + prev.usage.output_tokens
            assert r.usage.input_tokens_details.cached_tokens >= seen // PAGE_SIZE * PAGE_SIZE, (prev.usage, r.usage)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items += [{"type": "function_call_output", "call_id": c.call_id, "output": "18 C, sunny"} for c in calls]
        items.append({"type": "message", "role": "user", "content": "And in Rome?"})
        prev = r


def test_messages_tool_session_caches_the_whole_previous_turn(ant):
    """Claude Code's loop: tool_use blocks go back with `input` re-serialised by the client."""
    history = user(ASK_WEATHER[0]["content"])
    system = f"Session {secrets.token_hex(4)}."
    for turn in range(2):
        m = ant.messages.create(model=MODEL, system=system, messages=history, tools=[A_WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                max_tokens=CALL_TOKENS, **A_GREEDY)
        if turn:
            seen = prev.usage.input_tokens + prev.usage.cache_read_input_tokens + prev.usage.output_tokens
            assert m.usage.cache_read_input_tokens >= seen // PAGE_SIZE * PAGE_SIZE, (prev.usage, m.usage)
        assert m.stop_reason == "tool_use"
        uses = [b for b in m.content if b.type == "tool_use"]
        history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "18 C"}
                                                 for b in uses] + [{"type": "text", "text": "And in Rome?"}]}]
        prev = m


def test_progress_in_sse_comments_and_server_log(real_server):
    nonce = secrets.token_hex(4)  # a prompt the prefix cache has not seen
    words = " ".join(f"item{i} {nonce}" for i in range(130))  # ~1,600 tokens: a few s of prefill
    body = {"model": MODEL, "messages": user(f"Repeat the last word. {words}"), "max_tokens": 256, "stream": True,
            "ignore_eos": True, "return_progress": True, **GREEDY}  # a few s of answering too
    comments, progress_chunks = [], []
    with httpx.stream("POST", real_server.url + "/v1/chat/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith(": progress "):
                comments.append(json.loads(line[len(": progress "):]))
            elif line.startswith("data: {") and "prompt_progress" in line:
                progress_chunks.append(json.loads(line[6:])["prompt_progress"])
    assert len(comments) >= 2 and comments == progress_chunks
    assert all(set(p) == {"processed", "total", "cached"} and p["processed"] <= p["total"] for p in comments)
    assert [p["processed"] for p in comments] == sorted(p["processed"] for p in comments)
    log = real_server.output()
    assert re.search(r"reading the prompt: [\d,]+ of [\d,]+ tokens \([\d,]+ cached\), \d+ s so far", log), log[-2000:]
    assert re.search(r"answering: [\d,]+ of max 256 tokens, [\d.]+ tok/s, \d+ s", log), log[-2000:]


def test_metrics_expose_kv_cache_figures(oai, real_server):
    """/metrics carries the engine's KV figures (pages per tier, prompt/cached/computed tokens, swap)."""
    import re

    import httpx

    oai.chat.completions.create(model=MODEL, messages=user("Say hi."), max_tokens=4, temperature=0)
    text = httpx.get(real_server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text

    def value(name: str) -> float:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        assert m, f"{name} missing from /metrics"
        return float(m.group(1))

    assert value("kvtier_kv_gpu_pages_total") > 0
    assert value("kvtier_kv_prompt_tokens") > 0
    assert value("kvtier_kv_computed_tokens") > 0
    assert value("kvtier_kv_gpu_pages_free") <= value("kvtier_kv_gpu_pages_total")
    value("kvtier_kv_swap_in_bytes")
