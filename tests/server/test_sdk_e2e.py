"""The official openai and anthropic SDKs against a real uvicorn process (FakeEngine behind it)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.server.conftest import API_KEY
from tests.server.sse_util import check_responses_stream
from tests.server.fakes import TRICKY_ARGS

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
A_WEATHER = {"name": "get_weather", "description": "weather", "input_schema": WEATHER["function"]["parameters"]}


@pytest.fixture(scope="module")
def oai(fake_server):
    return openai.OpenAI(base_url=fake_server.url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def ant(fake_server):
    return anthropic.Anthropic(base_url=fake_server.url, api_key=API_KEY, max_retries=0)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- chat ------------------------------------------------------------------------

def test_chat_create_and_stream(oai):
    c = oai.chat.completions.create(model=MODEL, messages=user("hello"))
    assert c.choices[0].message.content.startswith("Hello!") and c.usage.total_tokens > 0
    assert c.usage.prompt_tokens_details.cached_tokens is not None
    parts = []
    for chunk in oai.chat.completions.create(model=MODEL, messages=user("hello"), stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        else:
            assert chunk.usage.completion_tokens > 0
    assert "".join(parts) == c.choices[0].message.content


def test_chat_stream_helper_final_completion(oai):
    with oai.chat.completions.stream(model=MODEL, messages=user("THINK hard")) as s:
        deltas = [e.delta for e in s if e.type == "content.delta"]
        final = s.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content
    assert final.choices[0].message.content.strip() == "The answer is 4."


def test_chat_tool_calls_required_streamed_equals_plain(oai):
    for marker, tools in (("TWO_TOOLS", [WEATHER, TIME]), ("TRICKY", [{"type": "function", "function": {
            "name": "run_code", "parameters": {"type": "object"}}}])):
        plain = oai.chat.completions.create(model=MODEL, messages=user(marker), tools=tools, tool_choice="required")
        assert plain.choices[0].finish_reason == "tool_calls"
        want = [(t.function.name, t.function.arguments) for t in plain.choices[0].message.tool_calls]
        with oai.chat.completions.stream(model=MODEL, messages=user(marker), tools=tools,
                                         tool_choice="required") as s:
            done_events = [e for e in s if e.type == "tool_calls.function.arguments.done"]
            final = s.get_final_completion()
        got = [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls]
        assert got == want and [(e.name, e.arguments) for e in done_events] == want
        assert final.choices[0].finish_reason == "tool_calls"
    assert json.loads(want[0][1]) == TRICKY_ARGS


def test_structured_output_validates(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    c = oai.chat.completions.create(model=MODEL, messages=user("JSON_PERSON"), response_format=fmt)
    doc = json.loads(c.choices[0].message.content)
    assert set(doc) == set(PERSON["required"]) and isinstance(doc["age"], int) and isinstance(doc["name"], str)
    r = oai.responses.create(model=MODEL, input="JSON_PERSON",
                             text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    assert json.loads(r.output_text) == doc


def test_openai_error_classes(oai, fake_server):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=user("hi"))
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=10**6)
    assert "4096" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=user("hi"), tools=[WEATHER],
                                    tool_choice={"type": "function", "function": {"name": "missing"}})
    bad = openai.OpenAI(base_url=fake_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- responses -------------------------------------------------------------------

def test_responses_create_and_stream(oai):
    r = oai.responses.create(model=MODEL, input="hello", instructions="Be brief.")
    assert r.id.startswith("resp_") and r.status == "completed" and r.output_text.startswith("Hello!")
    assert r.usage.input_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    with oai.responses.stream(model=MODEL, input="hello") as s:
        events = list(s)
        final = s.get_final_response()
    check_responses_stream(events, final)


def test_responses_tool_calls_and_reasoning(oai):
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]},
             {"type": "function", "name": "get_time", "parameters": TIME["function"]["parameters"]}]
    plain = oai.responses.create(model=MODEL, input="TWO_TOOLS", tools=tools, tool_choice="required")
    calls = [(o.name, o.arguments) for o in plain.output if o.type == "function_call"]
    assert [n for n, _ in calls] == ["get_weather", "get_time"]
    with oai.responses.stream(model=MODEL, input="TWO_TOOLS", tools=tools, tool_choice="required") as s:
        list(s)
        final = s.get_final_response()
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == calls
    # a follow-up turn with the call outputs is accepted
    assert [o.type for o in final.output] == ["function_call", "function_call"]
    follow = [{"role": "user", "content": "TWO_TOOLS"}] + [o.model_dump(exclude_none=True) for o in final.output] + [
        {"type": "function_call_output", "call_id": o.call_id, "output": "ok"} for o in final.output]
    assert oai.responses.create(model=MODEL, input=follow).status == "completed"
    think = oai.responses.create(model=MODEL, input="THINK")
    assert [o.type for o in think.output] == ["reasoning", "message"]
    assert "<think>" not in think.output_text


def test_responses_incomplete_and_failed(oai, fake_server):
    r = oai.responses.create(model=MODEL, input="LONG", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    with oai.responses.stream(model=MODEL, input="LONG " * 10, max_output_tokens=4095) as s:
        events = list(s)
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.code == "context_length_exceeded"


# ---- anthropic -------------------------------------------------------------------

def test_messages_create_and_stream(ant):
    m = ant.messages.create(model=MODEL, max_tokens=64, messages=user("hello"))
    assert m.content[0].type == "text" and m.content[0].text.startswith("Hello!")
    assert m.stop_reason == "end_turn" and m.usage.output_tokens > 0
    with ant.messages.stream(model=MODEL, max_tokens=64, messages=user("hello")) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[0].text == final.content[0].text
    assert final.usage.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens \
        - final.usage.cache_read_input_tokens


def test_messages_tools_thinking_and_count(ant):
    m = ant.messages.create(model=MODEL, max_tokens=200, messages=user("TOOL_WEATHER"), tools=[A_WEATHER],
                            tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    tool = [b for b in m.content if b.type == "tool_use"][0]
    assert tool.name == "get_weather" and tool.input == {"city": "Paris", "unit": "celsius"}
    with ant.messages.stream(model=MODEL, max_tokens=200, messages=user("TOOL_WEATHER"), tools=[A_WEATHER],
                             tool_choice={"type": "any"}) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [tool.input]
    follow = user("TOOL_WEATHER") + [{"role": "assistant", "content": [b.model_dump() for b in final.content]},
                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                                                   "content": "18 C"}]}]
    assert ant.messages.create(model=MODEL, max_tokens=20, messages=follow, tools=[A_WEATHER]).content
    with ant.messages.stream(model=MODEL, max_tokens=200, messages=user("THINK")) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    n = ant.messages.count_tokens(model=MODEL, messages=user("hello"), tools=[A_WEATHER])
    assert n.input_tokens > ant.messages.count_tokens(model=MODEL, messages=user("hello")).input_tokens


def test_anthropic_error_classes(ant, fake_server):
    with pytest.raises(anthropic.NotFoundError):
        ant.messages.create(model="nope", max_tokens=5, messages=user("hi"))
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=5, messages=user("word " * 4200))  # prompt past the context
    bad = anthropic.Anthropic(base_url=fake_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=MODEL, max_tokens=5, messages=user("hi"))
