"""Tokenizer from GGUF metadata == transformers' own GGUF tokenizer; chat templates; detokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvtier.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines\n\n",
    "emoji 👋🏽 and family 👨‍👩‍👧 and flags 🇫🇷",
    "CJK 你好，世界。日本語のテキスト 한국어",
    "code: def f(x):\n    return x**2  # 平方",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "ünïcödé — “quotes” … ½ ≠ ∞",
    "",
]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "{\"temp_c\": 21}"},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "And in 東京?"},
]


def _reference(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def smol(smollm2_path: Path):
    return Tokenizer.from_checkpoint(smollm2_path), _reference(smollm2_path)


@pytest.fixture(scope="module")
def qwen(qwen_coder_05b_path: Path):
    return Tokenizer.from_checkpoint(qwen_coder_05b_path), _reference(qwen_coder_05b_path)


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_encode_decode_match_transformers(which: str, request: pytest.FixtureRequest) -> None:
    tok, ref = request.getfixturevalue(which)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == ref.decode(ids) == text, text
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text, add_special_tokens=True)
    assert tok.vocab_size == len(ref)
    assert tok.bos_token_id == ref.bos_token_id
    assert ref.eos_token_id in tok.eos_token_ids and tok.eos_token_id == ref.eos_token_id


def test_special_ids(smol, qwen) -> None:
    s, q = smol[0], qwen[0]
    assert s.id_to_token(s.eos_token_id) == "<|im_end|>" and s.token_to_id("<|endoftext|>") in s.eos_token_ids
    # Qwen: generation ends at <|im_end|> (eos) and <|endoftext|> (as in its generation_config)
    assert {q.token_to_id("<|im_end|>"), q.token_to_id("<|endoftext|>")} <= q.eos_token_ids
    assert q.token_to_id("<|im_start|>") not in q.eos_token_ids


def test_chat_template_matches_transformers(smol, qwen) -> None:
    simple = [{"role": "user", "content": "Hi there 👋"}]
    for tok, ref in (smol, qwen):
        for msgs in (simple, [{"role": "system", "content": "Be brief."}, *simple,
                              {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "再见"}]):
            for gen in (True, False):
                assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == ref.apply_chat_template(
                    msgs, add_generation_prompt=gen, tokenize=False)
    assert not smol[0].has_tool_support and qwen[0].has_tool_support


def test_tools_and_tool_results_match_transformers(qwen) -> None:
    tok, ref = qwen
    got = tok.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL])
    assert got == ref.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                          tokenize=False)
    assert "<tools>" in got and "get_weather" in got and "<tool_response>" in got
    # OpenAI-style JSON-string arguments render the same as an object
    as_string = [m if "tool_calls" not in m else {**m, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
        for m in TOOL_CHAT]
    assert tok.apply_chat_template(as_string, tools=[WEATHER_TOOL]) == got


def test_detokenizer_emoji_split_across_tokens(smol) -> None:
    tok, _ = smol
    text = "Hi 👋🏽! 你好 🇫🇷 done"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    assert "" in pieces  # held back at least once mid-character
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + det.flush() == tok.decode(ids) == text


@pytest.mark.parametrize("which", ["smol", "qwen"])
def test_detokenizer_invariant_random_ids(which: str, request: pytest.FixtureRequest) -> None:
    """Any id stream, even one that decodes to invalid UTF-8: pushes + flush == decode."""
    tok, _ = request.getfixturevalue(which)
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (False, True):
            det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
            out = "".join(det.push(i) for i in ids) + det.flush()
            assert out == tok.decode(ids, skip_special_tokens=skip), ids
    # real text round trip through the detokenizer
    ids = tok.encode(" ".join(TEXTS))
    det = IncrementalDetokenizer(tok)
    assert "".join(det.push(i) for i in ids) + det.flush() == " ".join(TEXTS)


def test_hf_dir_tokenizer(tmp_path: Path, smol) -> None:
    """An HF directory (tokenizer.json + tokenizer_config.json) gives the same tokenizer."""
    _, ref = smol
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    tok = Tokenizer.from_checkpoint(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    assert tok.eos_token_ids >= {0, 2} and tok.eos_token_id == 2
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
