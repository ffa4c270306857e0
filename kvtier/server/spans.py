"""Pinned spans: the prompt tokens retrieval attention must always attend (issue 12).

Past `--kvmem-budget` a decode row attends to a few selected pages, so the parts of a chat that
every answer depends on are pinned instead of left to selection:

    prompt ids:  | system + tools | earlier turns ...... | current user turn, tool calls, results, gen prompt |
                 0           sys_end                turn_start                                          len
    spans:       [0, sys_end)                            [turn_start, len)

- span 1: the leading system (developer, instructions) messages and the tool schemas, with
  whatever the template writes around them (a default system prompt included);
- span 2: from the current user turn's text to the end of the prompt: the live tool trajectory
  after it (assistant calls, tool results) and the generation prompt. The current turn is the
  last user message that does not directly follow a tool result (text sent with tool results,
  such as Claude Code's reminders, belongs to the trajectory); no user message: no span 2.

How the boundaries are found. Chat templates are not always prefix-stable (a system prompt
merged into the first user turn, a default system prompt, late system turns folded), so no
render of a part of the conversation is assumed to be a prefix of the prompt. Each boundary is
the length of the token prefix the real prompt shares with one more render, encoded the same way
(`OutputMemory.render`, so remembered replies are spliced in as their own ids on both sides):

    sys_end    = common_prefix(prompt, encode(leading system + [user PLACEHOLDER]))
    turn_start = common_prefix(prompt, encode(messages before the turn + [user PLACEHOLDER]))

The placeholder differs from any real text at its first token, so each shared prefix ends where
the real user text begins (after its role header). Where a template renders the shorter list
differently, the shared prefix only ends earlier: span 2 then starts earlier (more pinned,
never less); span 1 could lose at most the template's separator tokens before the user text.
A render that fails pins conservatively: span 1 up to the current turn, span 2 from span 1's end.

/v1/completions (a raw prompt) gets no spans: nothing says where its parts are, and retrieval
keeps its sink and recent window as for any request.

Cost: two renders and encodings, and only when the engine runs retrieval attention.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from kvtier.server.errors import APIError
from kvtier.server.history import OutputMemory

log = logging.getLogger("kvtier.server")

# Stands in for the user text after a boundary: private-use characters no real text starts with.
PLACEHOLDER = "\ue002\ue003"

Span = tuple[int, int]


def current_turn(messages: list[dict]) -> int | None:
    """Index of the current user turn: the last user message not directly after a tool result
    (else the last user message); None when there is no user message."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for i in reversed(users):
        if i == 0 or messages[i - 1]["role"] != "tool":
            return i
    return users[-1] if users else None


def pinned_spans(tokenizer, memory: OutputMemory, messages: list[dict],
                 render: Callable[[list[dict]], str], prompt_ids: list[int]) -> tuple[Span, ...]:
    """The sorted, disjoint spans of `prompt_ids` (the encoded `render(messages)`, possibly
    followed by a prefill) to pin; see the module docstring."""
    n = len(prompt_ids)
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    turn = current_turn(messages)
    sys_end = _shared_prefix(tokenizer, memory, messages[:lead], render, prompt_ids)
    turn_start = (None if turn is None
                  else _shared_prefix(tokenizer, memory, messages[:turn], render, prompt_ids))
    if sys_end is None:  # render failed: everything before the current turn
        sys_end = n if turn is None else (turn_start if turn_start is not None else n)
    spans = [(0, sys_end)]
    if turn is not None:
        spans.append((sys_end if turn_start is None else turn_start, n))
    return _merge(spans)


def _shared_prefix(tokenizer, memory: OutputMemory, head: list[dict],
                   render: Callable[[list[dict]], str], prompt_ids: list[int]) -> int | None:
    """Tokens `prompt_ids` shares with `head` + a placeholder user turn; None if that fails to render."""
    try:
        probe = memory.render(tokenizer, [*map(dict, head), {"role": "user", "content": PLACEHOLDER}], render)
    except APIError as e:
        log.warning("pinned spans: the chat template cannot render a part of the conversation (%s); "
                    "pinning conservatively", e.message)
        return None
    limit = min(len(probe.token_ids), len(prompt_ids))
    differ = np.flatnonzero(np.asarray(probe.token_ids[:limit]) != np.asarray(prompt_ids[:limit]))
    return int(differ[0]) if len(differ) else limit


def _merge(spans: list[Span]) -> tuple[Span, ...]:
    """Sorted, non-empty, overlapping or touching spans joined."""
    out: list[Span] = []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return tuple(out)
