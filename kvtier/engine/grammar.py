"""Structured output through xgrammar: compiled grammars and per-request token masks.

    GrammarCompilerCache (one per model: tokenizer + logits vocab size)
        .json_object() / .json_schema(s) / .structural_tag(spec)
            -> xgrammar.CompiledGrammar   (compiled once, cached by xgrammar)
    GrammarState(compiled)  (one per request; implements sampler.Grammar)
        allowed_mask() -> bool [V]  ->  sampler  ->  accept(token) ...

The model's logits vocab can be larger than the tokenizer's (padded
embeddings); the padding ids are never allowed. The matcher allows a stop
token only once the grammar is complete; accepting it terminates the state.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xgr

# Bits per word of xgrammar's packed int32 token bitmask.
BITMASK_WORD_BITS = 32
# Longest whitespace run allowed between JSON tokens: room for pretty-printed
# nesting, but no runaway whitespace loop (and far cheaper masks).
MAX_JSON_WHITESPACE = 16


class GrammarCompilerCache:
    """Compiles grammars for one tokenizer and logits vocab size.

    hf_tokenizer: a transformers tokenizer (kvtier's `Tokenizer.hf`).
    vocab_size: the model's logits width (>= the tokenizer's size).
    stop_token_ids: ids that end generation (default: the tokenizer's EOS).
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int,
                 stop_token_ids: Sequence[int] | None = None, max_threads: int = 2) -> None:
        if vocab_size < len(hf_tokenizer):
            raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's "
                             f"{len(hf_tokenizer)} tokens")
        stops = list(stop_token_ids) if stop_token_ids is not None else None
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads)

    def json_object(self) -> xgr.CompiledGrammar:
        """Any JSON object (OpenAI `response_format: {"type": "json_object"}`)."""
        return self.json_schema({"type": "object"}, strict=False)

    def json_schema(self, schema: dict[str, Any] | str, strict: bool = True) -> xgr.CompiledGrammar:
        """A JSON value valid under `schema` (dict or JSON text). `strict`: objects
        admit no properties beyond those listed unless the schema says otherwise."""
        text = schema if isinstance(schema, str) else json.dumps(schema)  # keep key order: it is the property order
        try:
            return self._compiler.compile_json_schema(
                text, strict_mode=strict, max_whitespace_cnt=MAX_JSON_WHITESPACE)
        except (RuntimeError, ValueError) as e:  # xgrammar raises these for bad schemas
            raise ValueError(f"invalid or unsupported JSON schema: {e}") from e

    def structural_tag(self, spec: dict[str, Any]) -> xgr.CompiledGrammar:
        """xgrammar structural tag: `{"type": "structural_tag", "format": {...}}` (the server's
        tool calls: server/convert.py `tool_call_tag`). JSON content without its own
        `max_whitespace_cnt` gets MAX_JSON_WHITESPACE, as json_schema() does."""
        text = json.dumps(_bounded_whitespace(spec))
        try:
            return self._compiler.compile_structural_tag(text)
        except (RuntimeError, ValueError, xgr.InvalidStructuralTagError, xgr.InvalidJSONError) as e:
            raise ValueError(f"invalid structural tag: {e}") from e


def _bounded_whitespace(node: Any) -> Any:
    """A copy of a structural-tag spec with every json_schema content's whitespace bounded."""
    if isinstance(node, list):
        return [_bounded_whitespace(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k == "json_schema" else _bounded_whitespace(v)) for k, v in node.items()}
    if out.get("type") == "json_schema":
        out.setdefault("max_whitespace_cnt", MAX_JSON_WHITESPACE)
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's packed mask -> bool [vocab_size]; bit j of word w is token 32*w + j.

    bitmask: int32 [W] with W = ceil(vocab_size / 32).
    """
    shifts = torch.arange(BITMASK_WORD_BITS, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab_size].to(torch.bool)


class GrammarState:
    """One request's position in a compiled grammar (implements sampler.Grammar)."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)  # xgrammar >= 0.2: unlimited rollback
        self.vocab_size: int = compiled.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)  # int32 [1, W]

    def allowed_mask(self) -> torch.Tensor:
        """bool [V]: tokens the grammar allows next (stop tokens once complete)."""
        if self._matcher.is_terminated():
            raise ValueError("grammar already terminated; the request should have finished")
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return unpack_bitmask(self._bitmask[0], self.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar rejects it."""
        return self._matcher.accept_token(token_id)

    def accept_text(self, text: str) -> bool:
        """Advance by literal text (e.g. a forced prefix); one rollback step."""
        return self._matcher.accept_string(text)

    def is_completed(self) -> bool:
        """The output so far is a complete sentence (a stop token may come next)."""
        return self._matcher.is_completed()

    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more may be generated."""
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected draft tokens)."""
        self._matcher.rollback(num_tokens)

    def jump_forward(self) -> str:
        """Text the grammar forces next (may be empty)."""
        return self._matcher.find_jump_forward_string()
