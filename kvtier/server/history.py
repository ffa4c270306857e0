"""Replies the server produced, remembered as the token ids the model sampled.

An agent's next turn sends the previous reply back as structured data (text, reasoning, tool
calls with their ids). Rendering that again through the chat template rarely gives the sampled
tokens: a bare or fenced JSON call comes back as a tagged `<tool_call>` block, a native template
re-serialises the arguments, and even equal text can encode to other ids (BPE has several
spellings of one text, a grammar forces text, not tokens). The KV prefix cache then misses from
the first differing token on. So an assistant message that matches a remembered reply is
rendered as a stand-in and encoded as the reply's own ids:

    turn 1:  prompt_1 = render(history) + lead        -> sampled ids O (raw text T)
             client receives Reply(content, reasoning, calls[id, name, args])
    turn 2:  history + [assistant message == that Reply] + [tool results...]
             render with the message's content := lead + STAND_IN (no tool_calls, no reasoning)
             encode:  encode(text before STAND_IN) + O + encode(text after STAND_IN)
             == prompt_1 + O + ...                    (a real prefix: the cache covers turn 1)

`lead` is an Anthropic-style prefill the reply continued ("" otherwise). Splitting the encoding
at the stand-in's edges is exact for templates that put the reply right after the generation
prompt and close it with a special token (ChatML `<|im_end|>` and the like). A spliced reply is
what the model wrote, reasoning included, even when the client left its reasoning out.

A message matches only if it says what the client received: tool calls by id (the strongest
key; Anthropic's `toolu_` ids carry the same hex as the `call_` ids), name and arguments
(compared as parsed JSON), and the text and reasoning (edge whitespace aside). Anything edited
renders from the client's own text. One memory per server context, so per model.
"""

from __future__ import annotations

import json
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# Replies remembered per server: a few agent sessions' worth of turns.
DEFAULT_CAPACITY = 512
# Call id prefixes that differ per API around the same hex (parsing.default_call_id, anthropic._tool_id).
CALL_ID_PREFIXES = ("call_", "toolu_")


@dataclass(frozen=True)
class ReplyCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Reply:
    """One produced reply: what the model sampled and what the client received."""

    token_ids: tuple[int, ...]  # decode to exactly `text` (no stop token, no cut stop string)
    text: str  # the raw generated text
    content: str
    reasoning: str
    calls: tuple[ReplyCall, ...]
    lead: str = ""  # a prefill the reply continued (the client sends back lead + content)

    def key(self) -> str:
        return _call_key(self.calls[0].id) if self.calls else _text_key(self.lead + self.content)

    def matches(self, msg: dict) -> bool:
        """True when the assistant message `msg` (normalised shape) is this reply unedited."""
        if _strip(msg.get("content")) != (self.lead + self.content).strip():
            return False
        reasoning = _strip(msg.get("reasoning_content"))
        # Left out is fine when calls identify the reply; a text reply must bring its reasoning back.
        if reasoning != self.reasoning.strip() and (reasoning or not self.calls):
            return False
        calls = msg.get("tool_calls") or []
        return len(calls) == len(self.calls) and all(_same_call(c, r) for c, r in zip(calls, self.calls))


@dataclass(frozen=True)
class Spliced:
    """A prompt whose remembered replies keep their own ids."""

    text: str  # the prompt text, each spliced reply as its raw text
    token_ids: list[int]


class OutputMemory:
    """LRU of produced replies, found again by the assistant messages that send them back."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._replies: OrderedDict[str, Reply] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replies)

    def remember(self, reply: Reply) -> None:
        if not reply.token_ids or not (reply.calls or reply.content.strip()):
            return
        key = reply.key()
        self._replies[key] = reply
        self._replies.move_to_end(key)
        while len(self._replies) > self.capacity:
            self._replies.popitem(last=False)

    def find(self, msg: dict) -> Reply | None:
        if msg.get("role") != "assistant":
            return None
        calls = msg.get("tool_calls") or []
        key = _call_key(calls[0].get("id") or "") if calls else _text_key(_strip(msg.get("content")))
        reply = self._replies.get(key)
        if reply is None or not reply.matches(msg):
            return None
        self._replies.move_to_end(key)
        return reply

    def render(self, tokenizer, messages: list[dict], render) -> Spliced:
        """`render(messages) -> text`, encoded with matching replies spliced in as their own ids.

        Falls back to a plain render when the template refuses the stand-ins or does not carry
        each through exactly once (it dropped or repeated a turn).
        """
        nonce = secrets.token_hex(8)
        stand_ins: dict[str, Reply] = {}
        msgs = []
        for m in messages:
            reply = self.find(m)
            if reply is None:
                msgs.append(m)
                continue
            mark = f"\ue000{nonce}:{len(stand_ins)}\ue001"  # private-use marks: no template touches them
            stand_ins[mark] = reply
            msgs.append({"role": "assistant", "content": reply.lead + mark})
        if stand_ins:
            try:
                text = render(msgs)
            except Exception:  # a template that checks calls against results: the plain render decides
                text = ""
            if all(text.count(mark) == 1 for mark in stand_ins):
                return _splice(tokenizer, text, stand_ins)
        text = render([dict(m) for m in messages])
        return Spliced(text, list(tokenizer.encode(text)))


def _splice(tokenizer, text: str, stand_ins: dict[str, Reply]) -> Spliced:
    order = sorted(stand_ins, key=text.index)
    ids: list[int] = []
    plain: list[str] = []
    pos = 0
    for mark in order:
        start = text.index(mark)
        if start > pos:
            ids += tokenizer.encode(text[pos:start])
        ids += stand_ins[mark].token_ids
        plain += [text[pos:start], stand_ins[mark].text]
        pos = start + len(mark)
    if pos < len(text):
        ids += tokenizer.encode(text[pos:])
    plain.append(text[pos:])
    return Spliced("".join(plain), ids)


def _strip(value: Any) -> str:
    return value.strip() if isinstance(value, str) else ""


def _text_key(content: str) -> str:
    return "text:" + content.strip()


def _call_key(call_id: str) -> str:
    for prefix in CALL_ID_PREFIXES:
        if call_id.startswith(prefix):
            return "call:" + call_id[len(prefix):]
    return "call:" + call_id


def _same_call(call: dict, ours: ReplyCall) -> bool:
    fn = call.get("function") or {}
    return (_call_key(call.get("id") or "") == _call_key(ours.id) and fn.get("name") == ours.name
            and _canonical(fn.get("arguments")) is not None
            and _canonical(fn.get("arguments")) == _canonical(ours.arguments))


def _canonical(arguments: Any) -> str | None:
    """Arguments as sorted-key JSON (so re-serialised equal arguments compare equal); None if not JSON."""
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
        return json.dumps(value, sort_keys=True, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
