"""OutputParser: Hermes tool calls and <think> reasoning, streaming-safe at every split.

Each case is fed whole, then split into 2 and 3 pieces at every character
position (and one character at a time); after merge_deltas the events must be
identical to the whole-output events. Deltas the engine sends are UTF-8-safe
text, so a character boundary is the finest split that can occur.
"""

from __future__ import annotations

import itertools
import json

import pytest

from kvtier.server.parsing import (CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN, OutputParser, ReasoningDelta,
                                   TextDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallStart, merge_deltas)

TAGS = (CALL_OPEN, CALL_CLOSE, THINK_OPEN, THINK_CLOSE)
TRICKY_ARGS = {"code": 'print("hi")\nx = {"a": [1, 2]}', "note": "caf\u00e9 \u2603 \U0001F600 </tool_call> done",
               "path": "C:\\temp\\new", "flag": True, "none": None, "n": -1.5e3}


def call_block(name: str, args_text: str) -> str:
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name)}, "arguments": {args_text}}}\n{CALL_CLOSE}'


def new_parser(**kw) -> OutputParser:
    ids = itertools.count()
    kw.setdefault("tools", True)
    kw.setdefault("reasoning", True)
    return OutputParser(id_factory=lambda: f"call_{next(ids)}", **kw)


def run(chunks: list[str], truncated: bool = False, **kw) -> tuple[OutputParser, list]:
    p = new_parser(**kw)
    events: list = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish(truncated)
    return p, events


def splits(text: str, three: bool = True):
    """Every way to cut `text` into 2 and (three) into 3 non-empty pieces, plus one char at a time."""
    n = len(text)
    for i in range(1, n):
        yield [text[:i], text[i:]]
    for i in range(1, n - 1 if three else 1):
        for j in range(i + 1, n):
            yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def check_streaming(text: str, truncated: bool = False, three: bool = True, **kw) -> tuple[OutputParser, list]:
    """Whole-output events, after asserting every split gives the same events and leaks no tag."""
    whole_parser, whole = run([text], truncated, **kw)
    whole = merge_deltas(whole)
    for chunks in splits(text, three):
        p, events = run(chunks, truncated, **kw)
        assert merge_deltas(events) == whole, chunks
        assert (p.text, p.reasoning, p.tool_calls, p.malformed, p.truncated_call) == (
            whole_parser.text, whole_parser.reasoning, whole_parser.tool_calls, whole_parser.malformed,
            whole_parser.truncated_call), chunks
        # A held-back partial tag that leaked would differ from `whole` above; a whole tag
        # may only reach content as a malformed block's raw text or with parsing off.
        if not (whole_parser.malformed or whole_parser.truncated_call) and kw.get("tools", True) and kw.get("reasoning", True):
            for e in events:
                if isinstance(e, TextDelta):
                    assert not any(t in e.text for t in TAGS), (chunks, e)
    check_call_shape(whole, abandon_ok=whole_parser.malformed)
    return whole_parser, whole


def check_call_shape(events: list, abandon_ok: bool = False) -> None:
    """Indices 0, 1, 2 ... in order; each call opens with Start (id, name) and closes with End.

    abandon_ok: a started call that turned out malformed may stop without an End
    (its raw block follows as text); its index is spent, never reused."""
    seen: list[int] = []
    open_: int | None = None
    for e in events:
        if isinstance(e, ToolCallStart):
            assert open_ is None and e.index == len(seen) and e.id and e.name
            seen.append(e.index)
            open_ = e.index
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index == open_
        elif isinstance(e, ToolCallEnd):
            assert e.index == open_
            open_ = None
        else:
            assert open_ is None or abandon_ok, "text or reasoning inside a call"
            open_ = None


def texts(events: list, kind) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


# ---- tool calls ------------------------------------------------------------------

def test_content_then_call():
    args = '{"city": "Paris", "unit": "celsius"}'
    p, ev = check_streaming("Let me check.\n" + call_block("get_weather", args))
    assert ev == [TextDelta("Let me check."), ToolCallStart(0, "call_0", "get_weather"),
                  ToolCallArgsDelta(0, args), ToolCallEnd(0)]
    assert p.finish_reason("stop") == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in p.tool_calls] == [("call_0", "get_weather", args)]


def test_three_calls_get_indices_0_1_2():
    text = "\n".join(call_block(n, a) for n, a in (("a", '{"x": 1}'), ("b", "{}"), ("c", '{"y": [true, null]}')))
    p, ev = check_streaming(text)
    starts = [e for e in ev if isinstance(e, ToolCallStart)]
    assert [(s.index, s.id, s.name) for s in starts] == [(0, "call_0", "a"), (1, "call_1", "b"), (2, "call_2", "c")]
    assert [c.arguments for c in p.tool_calls] == ['{"x": 1}', "{}", '{"y": [true, null]}']
    assert not texts(ev, TextDelta)


def test_tricky_arguments_round_trip_exactly():
    args = json.dumps(TRICKY_ARGS, ensure_ascii=False)
    p, ev = check_streaming(call_block("run_code", args))
    assert texts(ev, TextDelta) == "" and not p.malformed
    assert p.tool_calls[0].arguments == args and json.loads(p.tool_calls[0].arguments) == TRICKY_ARGS
    # ASCII-escaped unicode is kept as written too
    escaped = json.dumps(TRICKY_ARGS)
    p, _ = check_streaming(call_block("run_code", escaped), three=False)
    assert p.tool_calls[0].arguments == escaped


def test_arguments_before_name_string_encoded_and_missing():
    p, ev = check_streaming(f'{CALL_OPEN}\n{{"arguments": {{"a": "}}"}}, "name": "f"}}\n{CALL_CLOSE}')
    assert ev[0] == ToolCallStart(0, "call_0", "f") and p.tool_calls[0].arguments == '{"a": "}"}'
    p, _ = check_streaming(f'{CALL_OPEN}\n{{"name": "f", "arguments": "{{\\"a\\": 1}}"}}\n{CALL_CLOSE}')
    assert p.tool_calls[0].arguments == '{"a": 1}'  # not double-encoded
    p, _ = check_streaming(f'{CALL_OPEN}\n{{"name": "f"}}\n{CALL_CLOSE}')
    assert p.tool_calls[0].arguments == "{}"


def test_text_between_and_after_calls():
    text = "First.\n" + call_block("a", "{}") + "\nThen some words.\n" + call_block("b", '{"k": "v"}') + "\n"
    p, ev = check_streaming(text)
    assert texts(ev, TextDelta) == "First.Then some words."
    assert [c.name for c in p.tool_calls] == ["a", "b"]


def test_angle_brackets_that_are_not_tags_pass_through():
    text = "if a < b and <tool> or <thinking> or <tool_cal then <<think"
    p, ev = check_streaming(text)
    assert texts(ev, TextDelta) == text and not p.tool_calls


def test_tools_off_leaves_tags_as_text():
    text = "x " + call_block("f", "{}")
    _, ev = check_streaming(text, tools=False)
    assert texts(ev, TextDelta) == text


def test_call_ended_by_eos_without_close_tag():
    p, ev = check_streaming(f'{CALL_OPEN}\n{{"name": "f", "arguments": {{"a": 1}}}}')
    assert p.tool_calls[0].arguments == '{"a": 1}' and p.finish_reason("stop") == "tool_calls"


# ---- malformed and truncated -----------------------------------------------------

@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {oops}}', "not json at all", '["f", {}]',
                                  '{"name": 3, "arguments": {}}', '{"name": "f", "arguments": {"a": 1}} trailing'])
def test_malformed_json_falls_back_to_content(body):
    text = f"Sure.\n{CALL_OPEN}\n{body}\n{CALL_CLOSE}"
    p, ev = check_streaming(text)
    assert p.malformed and not p.tool_calls
    assert texts(ev, TextDelta) == f"Sure.{CALL_OPEN}\n{body}\n{CALL_CLOSE}"
    assert not any(isinstance(e, ToolCallEnd) for e in ev)
    assert p.finish_reason("stop") == "stop"


def test_malformed_after_the_name_abandons_the_started_call():
    text = call_block("f", "{oops}") + "\n" + call_block("g", "{}")
    p, ev = check_streaming(text)
    # the name was streamed before the JSON broke: index 0 is spent, the next call is 1
    assert ev[0] == ToolCallStart(0, "call_0", "f") and not any(e == ToolCallEnd(0) for e in ev)
    assert [(c.id, c.name) for c in p.tool_calls] == [("call_1", "g")]
    assert ToolCallStart(1, "call_1", "g") in ev and p.malformed


def test_malformed_after_a_good_call_keeps_the_good_one():
    text = call_block("a", '{"x": 1}') + f"\n{CALL_OPEN}\n{{broken\n{CALL_CLOSE}"
    p, ev = check_streaming(text)
    assert [c.name for c in p.tool_calls] == ["a"] and p.malformed
    assert CALL_OPEN + "\n{broken" in texts(ev, TextDelta)


def test_call_cut_by_max_tokens_finishes_with_length():
    text = f'Ok.\n{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Par'
    p, ev = check_streaming(text, truncated=True)
    assert p.truncated_call and p.finish_reason("length") == "length" and p.finish_reason("stop") == "length"
    assert ev[0] == TextDelta("Ok.") and ev[1] == ToolCallStart(0, "call_0", "get_weather")
    # cut before the name is known: no call at all, the block is content
    p, ev = check_streaming(f'{CALL_OPEN}\n{{"argu', truncated=True)
    assert p.finish_reason("length") == "length" and not p.tool_calls
    assert not any(isinstance(e, ToolCallStart) for e in ev)


def test_truncated_text_is_not_a_call():
    p, ev = check_streaming("partial <tool_c", truncated=True)
    assert texts(ev, TextDelta) == "partial <tool_c" and p.finish_reason("length") == "length"


# ---- reasoning -------------------------------------------------------------------

def test_reasoning_never_leaks_into_content():
    p, ev = check_streaming(f"{THINK_OPEN}\nsecret plan: 2+2=4\n{THINK_CLOSE}\n\nThe answer is 4.")
    assert texts(ev, ReasoningDelta) == "secret plan: 2+2=4" == p.reasoning
    assert texts(ev, TextDelta) == "The answer is 4." == p.text
    assert isinstance(ev[0], ReasoningDelta) and isinstance(ev[-1], TextDelta)


def test_tool_call_inside_think_is_not_a_call():
    draft = call_block("get_weather", '{"city": "Paris"}')
    p, ev = check_streaming(f"{THINK_OPEN}\nI could do {draft} maybe.\n{THINK_CLOSE}\n\n" + call_block("real", "{}"))
    assert [c.name for c in p.tool_calls] == ["real"]
    assert draft in p.reasoning and not texts(ev, TextDelta)


def test_prompt_opened_think_and_truncated_reasoning():
    p, ev = check_streaming(f"hidden\n{THINK_CLOSE}\n\nshown", starts_in_reasoning=True)
    assert (p.reasoning, p.text) == ("hidden", "shown")
    p, ev = check_streaming(f"{THINK_OPEN}\nstill thinking when cut", truncated=True)
    assert texts(ev, TextDelta) == "" and p.reasoning == "still thinking when cut"
    p, _ = check_streaming(f"{THINK_OPEN}x{THINK_CLOSE}y", reasoning=False)
    assert p.text == f"{THINK_OPEN}x{THINK_CLOSE}y" and not p.reasoning


def test_parser_state_is_per_request():
    a, b = new_parser(), new_parser()
    a.feed(CALL_OPEN + '\n{"name": "f", "arg')
    assert b.feed("plain text") == [TextDelta("plain text")]
    assert b.finish() == [] and not b.tool_calls
