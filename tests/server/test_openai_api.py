"""/v1/chat/completions, /v1/completions, /v1/models over FakeEngine (in-process)."""

from __future__ import annotations

import pytest

import json

from tests.server.fakes import TRICKY_ARGS
from tests.server.sse_util import data_frames, parse_sse

MODEL = "smollm2-135m"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
CODE_TOOL = {"type": "function", "function": {
    "name": "run_code", "parameters": {"type": "object", "properties": {
        "code": {"type": "string"}, "note": {"type": "string"}}}}}


def chat(client, content: str, **kw):
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], **kw})


def stream_chunks(client, content: str, **kw) -> list:
    r = chat(client, content, stream=True, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    frames = data_frames(r.text)
    assert frames[-1] == "[DONE]"
    return frames[:-1]


def test_chat_non_streamed_text_and_usage(client, engine, tokenizer):
    r = chat(client, "hello there", temperature=0, max_tokens=100)
    assert r.status_code == 200, r.text
    body = r.json()
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello! I am a scripted test model. How can I help?"}
    assert body["choices"][0]["finish_reason"] == "stop"
    req = engine.requests[-1]
    assert body["usage"]["prompt_tokens"] == len(req.prompt_token_ids)
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    # rendered with the model's own chat template
    assert tokenizer.decode(req.prompt_token_ids) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}])
    assert req.params.temperature == 0 and req.params.max_tokens == 100


def test_chat_stream_format(client):
    chunks = stream_chunks(client, "hello", stream_options={"include_usage": True})
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    roles = [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]]
    assert roles[0] == "assistant" and all(r is None for r in roles[1:])
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["stop"] and finishes[-1] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "Hello! I am a scripted test model. How can I help?"


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = stream_chunks(client, "hello")
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)


def test_newlines_stream_as_they_come_unless_tools_are_offered(client):
    """Without tools a paragraph break streams when the model writes it; with tools offered,
    whitespace is held until text follows (never an empty message beside a call), same text."""
    def contents(**kw):
        chunks = stream_chunks(client, "PARAGRAPHS", **kw)
        return [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    plain, with_tools = contents(), contents(tools=[WEATHER_TOOL])
    assert "".join(x or "" for x in plain) == "".join(x or "" for x in with_tools) == \
        "First paragraph.\n\nSecond paragraph."
    assert any(x and not x.strip() for x in plain), f"no whitespace-only delta: the break was held: {plain}"
    assert not any(x and not x.strip() for x in with_tools)


def test_unicode_deltas_are_whole_characters(client):
    chunks = stream_chunks(client, "UNICODE")
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "Caf\u00e9 \u2603 \U0001F600 \u65e5\u672c\u8a9e."
    assert all("\ufffd" not in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_reasoning_goes_to_reasoning_content(client):
    body = chat(client, "THINK please").json()
    msg = body["choices"][0]["message"]
    assert "<think>" not in msg["content"] and "</think>" not in msg["content"]
    assert msg["content"].strip() == "The answer is 4."
    assert "2+2" in msg["reasoning_content"]
    chunks = stream_chunks(client, "THINK please")
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert reasoning == msg["reasoning_content"] and content == msg["content"]


def _streamed_calls(chunks) -> tuple[list[dict], list[str]]:
    calls: dict[int, dict] = {}
    finishes = []
    for c in chunks:
        ch = c["choices"][0]
        if ch["finish_reason"]:
            finishes.append(ch["finish_reason"])
        assert "<tool_call>" not in (ch["delta"].get("content") or "")
        for tc in ch["delta"].get("tool_calls") or []:
            if tc["index"] not in calls:
                assert tc["id"] and len(tc["id"]) > 16 and tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert "name" not in tc["function"] and "id" not in tc
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments") or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], finishes


def test_tool_calls_streamed_equal_non_streamed(client):
    for marker, tools in (("TOOL_WEATHER", [WEATHER_TOOL]), ("TWO_TOOLS", [WEATHER_TOOL, TIME_TOOL]),
                          ("TRICKY", [CODE_TOOL])):
        body = chat(client, marker, tools=tools, tool_choice="required").json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        plain = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                 for c in choice["message"]["tool_calls"]]
        streamed, finishes = _streamed_calls(stream_chunks(client, marker, tools=tools, tool_choice="required"))
        assert finishes == ["tool_calls"]
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in streamed] == plain
    assert json.loads(plain[0]["arguments"]) == TRICKY_ARGS


def test_tool_choice_controls_grammar_and_prompt(client, engine):
    chat(client, "hi", tools=[WEATHER_TOOL], tool_choice="none")
    req = engine.requests[-1]
    assert req.grammar is None and "<tools>" not in engine.tokenizer.decode(req.prompt_token_ids)
    chat(client, "hi", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    req = engine.requests[-1]
    assert req.grammar is not None
    # SmolLM2's template has no tool support: the Hermes tool prompt carries the tools
    prompt = engine.tokenizer.decode(req.prompt_token_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt


def test_unknown_named_function_is_400(client):
    r = chat(client, "hi", tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
    assert "nope" in r.json()["error"]["message"]


def test_response_format_json_schema(client, engine):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    r = chat(client, "JSON_PERSON", response_format={"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": schema}})
    assert r.status_code == 200, r.text
    assert engine.requests[-1].grammar is not None
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == {"name": "Ada Lovelace", "age": 36}
    bad = chat(client, "x", response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert bad.status_code == 400


def test_history_renders_tool_turns_back_to_the_same_tokens(client, engine, tokenizer):
    """Turn 2's prompt starts with turn 1's prompt + what the model produced (prefix sharing)."""
    first = [{"role": "user", "content": "TOOL_WEATHER in Paris?"}]
    body = client.post("/v1/chat/completions", json={"model": MODEL, "messages": first,
                                                      "tools": [WEATHER_TOOL]}).json()
    turn1 = engine.requests[-1].prompt_token_ids
    produced = engine.seen[-1][len(turn1):]
    msg = body["choices"][0]["message"]
    second = first + [msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "18 C"},
                      {"role": "user", "content": "thanks"}]
    body2 = client.post("/v1/chat/completions", json={"model": MODEL, "messages": second,
                                                       "tools": [WEATHER_TOOL]}).json()
    turn2 = engine.requests[-1].prompt_token_ids
    assert tokenizer.decode(turn2).startswith(tokenizer.decode(turn1 + produced))
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(turn1) + len(produced)) // 16 * 16 - 16


def test_progress_comments_and_return_progress(client):
    r = chat(client, "PREFILL now", stream=True, return_progress=True)
    frames = parse_sse(r.text)
    comments = [json.loads(f.comment.split(" ", 1)[1]) for f in frames if f.comment and f.comment.startswith("progress")]
    assert len(comments) == 3 and all(set(c) == {"processed", "total", "cached"} for c in comments)
    assert [c["processed"] for c in comments] == sorted(c["processed"] for c in comments)
    progress_chunks = [f.data for f in frames if isinstance(f.data, dict) and "prompt_progress" in f.data]
    assert len(progress_chunks) == 3
    plain = parse_sse(chat(client, "PREFILL now", stream=True).text)
    assert not any(isinstance(f.data, dict) and "prompt_progress" in f.data for f in plain)


def test_max_tokens_length_and_stop(client, engine):
    body = chat(client, "LONG", max_tokens=5).json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 5
    body = chat(client, "hello", stop=["scripted", ""]).json()
    assert engine.requests[-1].params.stop == ("scripted",)
    assert body["choices"][0]["finish_reason"] == "stop"
    chat(client, "hello", stop="xyz", max_completion_tokens=7)
    assert engine.requests[-1].params.stop == ("xyz",) and engine.requests[-1].params.max_tokens == 7


def test_completions(client, tokenizer):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(tokenizer.encode("Once upon", add_special_tokens=True))
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3, "stream": True})
    frames = data_frames(r.text)
    assert frames[-1] == "[DONE]" and frames[-2]["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [10**9], "max_tokens": 3})
    assert r.status_code == 400


def test_models(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == MODEL
    assert client.get(f"/v1/models/{MODEL}").status_code == 200
    assert client.get("/v1/models/other").status_code == 404


def test_server_sampling_defaults_fill_what_a_request_leaves_out(engine):
    """serve --temperature/--top-p/--top-k/--min-p: defaults for omitted knobs; a request's own value wins."""
    from tests.server.conftest import make_client

    msgs = [{"role": "user", "content": "hi"}]
    with make_client(engine, default_temperature=0.0, default_top_p=0.9, default_top_k=40,
                     default_min_p=0.05) as c:
        assert c.post("/v1/chat/completions", json={"model": "smollm2-135m", "messages": msgs,
                                                    "max_tokens": 4}).status_code == 200
        assert c.post("/v1/messages", json={"model": "smollm2-135m", "messages": msgs, "max_tokens": 4,
                                            "temperature": 0.7}).status_code == 200
    first, second = (r.params for r in engine.requests[-2:])
    assert (first.temperature, first.top_p, first.top_k, first.min_p) == (0.0, 0.9, 40, 0.05)
    assert second.temperature == 0.7 and second.top_k == 40
    with make_client(engine) as c:  # no defaults set: OpenAI's
        c.post("/v1/chat/completions", json={"model": "smollm2-135m", "messages": msgs, "max_tokens": 4})
    p = engine.requests[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (1.0, 1.0, 0, 0.0)


def test_serve_rejects_bad_sampling_defaults():
    from kvtier.config import ServerConfig

    with pytest.raises(ValueError, match="temperature"):
        ServerConfig(default_temperature=3.0)
