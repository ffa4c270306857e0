"""Agent loops keep their prefix: a reply sent back unedited is re-encoded as the ids the model sampled.

The fake engine "samples" each reply in a spelling the tokenizer never produces (three characters
per piece), so turn 2's prompt starts with turn 1's whole sequence only if the server spliced the
remembered ids in; an edited reply must come back as the client's own text, plainly encoded.
"""

from __future__ import annotations

import json

import pytest

from kvtier.server.history import OutputMemory, Reply, ReplyCall

MODEL = "smollm2-135m"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REPLIES = {
    "bare": CALL,
    "fenced": "```json\n" + CALL + "\n```",
    "tagged": "<tool_call>\n" + CALL + "\n</tool_call>",
    "text+call": "Let me look that up.\n<tool_call>\n" + CALL + "\n</tool_call>",
    "text": "The weather in Paris is mild and sunny today.",
    "think+text": "<think>\nThe user asks about Paris. I know it.\n</think>\n\nParis is mild and sunny today.",
}
# Piece length of the fake's odd spelling (any split the BPE would not choose).
PIECE = 3


@pytest.fixture
def odd_engine(engine, tokenizer):
    engine.spelling = lambda text: [i for k in range(0, len(text), PIECE)
                                    for i in tokenizer.encode(text[k:k + PIECE])]
    return engine


# ---- one client per API: turn 1, then the next turn's request from what came back -------------

def chat_turn1(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    base = {"model": MODEL, "tools": tools}
    history = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.post("/v1/chat/completions", json={**base, "messages": history})
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    return base, history, msg


def chat_turn2(client, base, history, msg, edit=None):
    msg = edit(msg) if edit else msg
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "18 C"} for c in msg.get("tool_calls") or []]
    r = client.post("/v1/chat/completions", json={**base, "messages": [
        *history, msg, *results, {"role": "user", "content": "And Rome?"}]})
    assert r.status_code == 200, r.text


def responses_turn1(client):
    base = {"model": MODEL, "tools": [{"type": "function", "name": "get_weather", "parameters": PARAMS}]}
    history = [{"type": "message", "role": "user", "content": "Weather in Paris?"}]
    r = client.post("/v1/responses", json={**base, "input": history})
    assert r.status_code == 200, r.text
    return base, history, r.json()["output"]


def responses_turn2(client, base, history, output, edit=None):
    output = edit(output) if edit else output
    results = [{"type": "function_call_output", "call_id": o["call_id"], "output": "18 C"}
               for o in output if o["type"] == "function_call"]
    r = client.post("/v1/responses", json={**base, "input": [
        *history, *output, *results, {"type": "message", "role": "user", "content": "And Rome?"}]})
    assert r.status_code == 200, r.text


def messages_turn1(client):
    base = {"model": MODEL, "max_tokens": 200,
            "tools": [{"name": "get_weather", "input_schema": PARAMS}]}
    history = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.post("/v1/messages", json={**base, "messages": history})
    assert r.status_code == 200, r.text
    return base, history, r.json()["content"]


def messages_turn2(client, base, history, content, edit=None):
    content = edit(content) if edit else content
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "18 C"}
               for b in content if b["type"] == "tool_use"]
    r = client.post("/v1/messages", json={**base, "messages": [
        *history, {"role": "assistant", "content": content},
        {"role": "user", "content": [*results, {"type": "text", "text": "And Rome?"}]}]})
    assert r.status_code == 200, r.text


APIS = {"chat": (chat_turn1, chat_turn2), "responses": (responses_turn1, responses_turn2),
        "messages": (messages_turn1, messages_turn2)}


def _edit_chat(msg):
    if msg.get("tool_calls"):
        call = msg["tool_calls"][0]["function"]
        return {**msg, "tool_calls": [{**msg["tool_calls"][0],
                                       "function": {**call, "arguments": '{"city": "Lyon"}'}}]}
    return {**msg, "content": msg["content"].replace("Paris", "Lyon")}


def _edit_responses(output):
    out = []
    for o in output:
        if o["type"] == "function_call":
            o = {**o, "arguments": '{"city": "Lyon"}'}
        elif o["type"] == "message":
            o = {**o, "content": [{**p, "text": p["text"].replace("Paris", "Lyon")} for p in o["content"]]}
        out.append(o)
    return out


def _edit_messages(content):
    return [{**b, "input": {"city": "Lyon"}} if b["type"] == "tool_use"
            else {**b, "text": b["text"].replace("Paris", "Lyon")} if b["type"] == "text" else b
            for b in content]


EDITS = {"chat": _edit_chat, "responses": _edit_responses, "messages": _edit_messages}


def _has_call(sent) -> bool:
    """A tool call in what turn 1 returned (chat message, responses output, messages content)."""
    if isinstance(sent, dict):
        return bool(sent.get("tool_calls"))
    return any(x["type"] in ("function_call", "tool_use") for x in sent)


@pytest.mark.parametrize("kind", list(REPLIES))
@pytest.mark.parametrize("api", list(APIS))
def test_next_turn_reuses_the_sampled_ids(client, odd_engine, tokenizer, api, kind):
    odd_engine.script = REPLIES[kind]
    first, second = APIS[api]
    state = first(client)
    assert _has_call(state[2]) == ("call" in kind or kind in ("bare", "fenced", "tagged"))
    turn1 = odd_engine.seen[-1]  # prompt + sampled ids + stop token, as the KV cache holds them
    sampled = turn1[len(odd_engine.requests[-1].prompt_token_ids):-1]
    assert tokenizer.decode(sampled) == REPLIES[kind] and sampled != tokenizer.encode(REPLIES[kind])
    odd_engine.script = "Rome is warm."
    second(client, *state)
    turn2 = odd_engine.requests[-1].prompt_token_ids
    assert turn2[:len(turn1)] == turn1, (tokenizer.decode(turn1), tokenizer.decode(turn2))


@pytest.mark.parametrize("kind", ["bare", "text+call", "text"])
@pytest.mark.parametrize("api", list(APIS))
def test_an_edited_reply_is_rendered_from_the_clients_text(client, odd_engine, tokenizer, api, kind):
    odd_engine.script = REPLIES[kind]
    first, second = APIS[api]
    state = first(client)
    odd_engine.script = "Rome is warm."
    second(client, *state, edit=EDITS[api])
    turn2 = odd_engine.requests[-1].prompt_token_ids
    text = tokenizer.decode(turn2)
    assert "Lyon" in text and "Paris is" not in text and '"Paris"' not in text
    assert turn2 == tokenizer.encode(text)  # plainly encoded: no sampled spelling spliced in


def test_a_dropped_reasoning_still_matches_a_call_but_not_a_text_reply():
    memory = OutputMemory()
    call = Reply((1, 2), "raw", "", "thought", (ReplyCall("call_ab", "f", '{"x": 1}'),))
    text = Reply((3, 4), "raw2", "Some answer text.", "thought", ())
    memory.remember(call)
    memory.remember(text)
    sent = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "toolu_ab", "function": {"name": "f", "arguments": '{ "x" : 1 }'}}]}
    assert memory.find(sent) is call  # Anthropic's id for the same call, arguments re-serialised
    assert memory.find({**sent, "tool_calls": [{**sent["tool_calls"][0], "function": {
        "name": "f", "arguments": '{"x": true}'}}]}) is None
    assert memory.find({"role": "assistant", "content": "Some answer text."}) is None
    assert memory.find({"role": "assistant", "content": "Some answer text.", "reasoning_content": "thought"}) is text


def test_memory_is_bounded_lru():
    memory = OutputMemory(capacity=2)
    replies = [Reply((i,), f"t{i}", f"answer number {i}", "", ()) for i in range(3)]
    memory.remember(replies[0])
    memory.remember(replies[1])
    assert memory.find({"role": "assistant", "content": "answer number 0"}) is replies[0]  # now newest
    memory.remember(replies[2])
    assert len(memory) == 2
    assert memory.find({"role": "assistant", "content": "answer number 1"}) is None
    assert memory.find({"role": "assistant", "content": "answer number 0"}) is replies[0]


def test_streamed_chat_reply_is_remembered_too(client, odd_engine):
    odd_engine.script = REPLIES["fenced"]
    base, history, _ = chat_turn1(client)
    r = client.post("/v1/chat/completions", json={**base, "messages": history, "stream": True})
    turn1 = odd_engine.seen[-1]
    calls = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                got = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                                    "function": {"name": c["function"].get("name"), "arguments": ""}})
                got["function"]["arguments"] += c["function"].get("arguments") or ""
    msg = {"role": "assistant", "content": None, "tool_calls": [calls[i] for i in sorted(calls)]}
    odd_engine.script = "Rome is warm."
    chat_turn2(client, base, history, msg)
    assert odd_engine.requests[-1].prompt_token_ids[:len(turn1)] == turn1
