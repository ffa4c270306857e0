"""Tokenizer + chat template from the model's own metadata (GGUF or HF directory).

Encoding/decoding runs on a `tokenizers.Tokenizer` backend. For GGUF the backend is built by
transformers' GGUF tokenizer converter from the metadata we already parsed (AutoTokenizer with
`gguf_file=` re-parses the file with GGUFReader, ~20 s on a 49K vocab). Chat templates are
rendered with jinja2 in the same sandbox and with the same helpers transformers uses, so the
output equals `apply_chat_template(..., tokenize=False)`.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from kvtier.models.loading.base import Checkpoint, ModelFileError

# End-of-generation tokens recognised by their text, as llama.cpp's vocab loader does
# (llama-vocab.cpp): a model may end a turn with any of them, not only its eos id.
END_TOKEN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})
_GGUF_CONTROL = 3  # tokenizer.ggml.token_type value of control tokens
_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence


class Tokenizer:
    """Encode/decode, special ids and chat template of one model."""

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None, eos_token_ids: frozenset[int],
                 chat_template: str | None, add_bos_token: bool = False, pad_token_id: int | None = None,
                 eos_token_id: int | None = None, source: Path | None = None) -> None:
        """eos_token_id: the one end token the metadata declares (rendered as the template's
        eos_token); eos_token_ids: every id that ends generation (includes eos_token_id)."""
        self.backend = backend
        self.bos_token_id = bos_token_id
        self._eos_token_id = eos_token_id
        self.eos_token_ids = eos_token_ids | ({eos_token_id} if eos_token_id is not None else set())
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    # ---- construction ----
    @classmethod
    def from_checkpoint(cls, ckpt_or_path: Checkpoint | str | Path) -> "Tokenizer":
        """Build from a Checkpoint, a .gguf file, or an HF directory."""
        path = ckpt_or_path.path if isinstance(ckpt_or_path, Checkpoint) else Path(ckpt_or_path)
        if path.is_dir():
            return cls.from_hf_dir(path)
        if path.suffix == ".safetensors":
            return cls.from_hf_dir(path.parent)
        return cls.from_gguf(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer":
        from kvtier.models.loading.gguf import read_gguf_header

        path = Path(path)
        md = read_gguf_header(path).metadata
        tokens = md.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError(path, "no tokenizer in the GGUF metadata (tokenizer.ggml.tokens missing)")
        backend = _gguf_backend(path, md)
        token_type = md.get("tokenizer.ggml.token_type")
        eos = {int(md[k]) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md}
        declared = md.get("tokenizer.ggml.eos_token_id")
        for i, text in enumerate(tokens):
            if text in END_TOKEN_TEXTS and (token_type is None or int(token_type[i]) == _GGUF_CONTROL):
                eos.add(i)
        bos = md.get("tokenizer.ggml.bos_token_id")
        pad = md.get("tokenizer.ggml.padding_token_id")
        add_bos = bool(md.get("tokenizer.ggml.add_bos_token", md.get("tokenizer.ggml.model") == "llama"))
        return cls(backend, bos_token_id=None if bos is None else int(bos), eos_token_ids=frozenset(eos),
                   chat_template=md.get("tokenizer.chat_template"), add_bos_token=add_bos,
                   pad_token_id=None if pad is None else int(pad),
                   eos_token_id=None if declared is None else int(declared), source=path)

    @classmethod
    def from_hf_dir(cls, model_dir: str | Path) -> "Tokenizer":
        model_dir = Path(model_dir)
        tok_json = model_dir / "tokenizer.json"
        cfg = _read_json(model_dir / "tokenizer_config.json")
        if tok_json.is_file():
            backend = BackendTokenizer.from_file(str(tok_json))
        else:
            from transformers import AutoTokenizer

            backend = AutoTokenizer.from_pretrained(model_dir).backend_tokenizer
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = model_dir / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text()

        def tid(tok: Any) -> int | None:
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        eos: set[int] = set()
        for src in (_read_json(model_dir / "generation_config.json"), _read_json(model_dir / "config.json")):
            ids = src.get("eos_token_id")
            eos.update([ids] if isinstance(ids, int) else (ids or []))
        eos.update(i for text in END_TOKEN_TEXTS if (i := backend.token_to_id(text)) is not None
                   and text in _special_contents(backend))
        return cls(backend, bos_token_id=tid(cfg.get("bos_token")), eos_token_ids=frozenset(eos),
                   chat_template=template, add_bos_token=bool(cfg.get("add_bos_token", False)),
                   pad_token_id=tid(cfg.get("pad_token")), eos_token_id=tid(cfg.get("eos_token")),
                   source=model_dir)

    # ---- encode / decode ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended when the model wants it."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def eos_token_id(self) -> int | None:
        """The declared end token, else the smallest of eos_token_ids (None when there is none)."""
        if self._eos_token_id is not None:
            return self._eos_token_id
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def special_token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    # ---- chat ----
    @property
    def has_tool_support(self) -> bool:
        """The model's chat template renders a `tools` list."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kw: Any) -> str:
        """Render `messages` (system/user/assistant/tool, with tool_calls) with the model's template.

        Assistant tool_call `arguments` given as a JSON string (OpenAI style) are parsed into an
        object first, as HF templates expect. Extra keywords reach the template (e.g. enable_thinking).
        """
        if not self.chat_template:
            raise ValueError(f"model {self.source} has no chat template")
        context = {
            "bos_token": self.special_token_text(self.bos_token_id),
            "eos_token": self.special_token_text(self.eos_token_id),
            "pad_token": self.special_token_text(self.pad_token_id),
            **kw,
        }
        return _compile(self.chat_template).render(
            messages=[_normalize_message(m) for m in messages], tools=tools,
            add_generation_prompt=add_generation_prompt, **context)


def _normalize_message(m: dict) -> dict:
    calls = m.get("tool_calls")
    if not calls:
        return m
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                args = fn["arguments"]
            c = {**c, "function": {**fn, "arguments": args}}
        out.append(c)
    return {**m, "tool_calls": out}


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    """Compile like transformers' _compile_jinja_template: sandboxed, trim/lstrip blocks, same helpers."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _gguf_backend(path: Path, md: dict[str, Any]) -> BackendTokenizer:
    """A fast tokenizer from GGUF tokenizer.ggml.* metadata, via transformers' converter."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError:  # older transformers: the public (slower) path
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).backend_tokenizer
    tok_dict: dict[str, Any] = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        v = md.get(f"tokenizer.{key}")
        if v is not None:
            tok_dict[name] = v.tolist() if hasattr(v, "tolist") else v
    try:
        backend, _ = convert_gguf_tokenizer(md.get("general.architecture", ""), tok_dict)
    except (ValueError, KeyError) as e:
        raise ModelFileError(path, f"cannot build the tokenizer from GGUF metadata: {e}") from None
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelFileError(path, f"not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _special_contents(backend: BackendTokenizer) -> set[str]:
    """Texts of the special (added, special=True) tokens of an HF tokenizer."""
    added = backend.get_added_tokens_decoder()
    return {t.content for t in added.values() if t.special}


class IncrementalDetokenizer:
    """Turns a token stream into text deltas that never split a UTF-8 character.

    Invariant: "".join(push(t) for t in ids) + flush() == tokenizer.decode(ids).
    Text is decoded over a short window [prefix, end) of the ids so that each push costs O(window):

        ids:  ... | prefix .. read | read .. end |
                    already emitted   pending (incomplete char or not yet emitted)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window (context for the emitted text)
        self.read = 0  # ids before this have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly "")."""
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT) \
                and new_text.startswith(prefix_text):
            self.prefix, self.read = self.read, len(self.ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still pending (an incomplete character decodes to U+FFFD, as in decode)."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text):]
