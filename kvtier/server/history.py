"""Recent outputs remembered as token ids, so re-rendered history keeps the model's own tokens.

Re-encoding a reply's text can give other ids than the model sampled: BPE has
several spellings of one text, and a grammar forces text, not tokens. An agent's
next turn then misses the KV prefix cache from the first differing token on.

    turn 1:  prompt_1 ids  +  output ids O  (text T)         -> remember(T, O)
    turn 2:  render(history) = ...prompt_1 text... T ...next turn...
             encode:  encode(before T) + O + encode(after T)  -> shares prompt_1 + O

Splitting the encoding at T's edges is exact for chat templates that put the
reply right after the generation prompt and close it with a special token
(ChatML `<|im_end|>` and the like), which is where T always sits.
"""

from __future__ import annotations

from collections import OrderedDict

# Replies remembered per server: a few agent sessions' worth of turns.
DEFAULT_CAPACITY = 512
# Shorter outputs are not worth splicing (and would match by accident).
MIN_CHARS = 16


class OutputMemory:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._ids: OrderedDict[str, list[int]] = OrderedDict()

    def remember(self, text: str, token_ids: list[int]) -> None:
        """`token_ids` decode to exactly `text` (no stop token, no cut stop string)."""
        if len(text) < MIN_CHARS or not token_ids:
            return
        self._ids[text] = list(token_ids)
        self._ids.move_to_end(text)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def encode(self, tokenizer, prompt: str) -> list[int]:
        """Token ids of `prompt`, remembered outputs in it spliced in as their own ids."""
        spans: list[tuple[int, int, list[int]]] = []
        for text in reversed(self._ids):  # newest first: it wins an overlap
            start = prompt.find(text)
            while start >= 0:
                end = start + len(text)
                if not any(s < end and start < e for s, e, _ in spans):
                    spans.append((start, end, self._ids[text]))
                start = prompt.find(text, end)
        ids: list[int] = []
        pos = 0
        for start, end, out in sorted(spans, key=lambda s: s[0]):
            if start > pos:
                ids += tokenizer.encode(prompt[pos:start])
            ids += out
            pos = end
        if pos < len(prompt):
            ids += tokenizer.encode(prompt[pos:])
        return ids
