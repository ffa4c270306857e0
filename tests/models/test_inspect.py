"""inspect_model: facts without dequantizing; damaged files raise one-line ModelFileErrors."""

from __future__ import annotations

import struct
from collections import Counter
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader
from rich.console import Console

from kvtier.kv.formats import make_format
from kvtier.models.inspect import format_inspect, inspect_model
from kvtier.models.loading import ModelFileError, load_checkpoint

from .gguf_factory import tiny_hf_model, write_gguf


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    model, cfg = tiny_hf_model("qwen2")
    return write_gguf(tmp_path / "tiny.gguf", "qwen2", cfg, model.state_dict(), qtype=GGMLQuantizationType.Q8_0)


def _assert_error(path: Path, *words: str, fn=inspect_model) -> str:
    with pytest.raises(ModelFileError) as e:
        fn(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_inspect_tiny_gguf(tiny_gguf: Path) -> None:
    d = inspect_model(tiny_gguf)
    reader = GGUFReader(tiny_gguf)  # reference parser
    assert d["quant_types"] == dict(Counter(t.tensor_type.name for t in reader.tensors))
    assert d["n_tensors"] == len(reader.tensors) and d["file_size"] == tiny_gguf.stat().st_size
    assert d["weights_bytes"] == sum(int(t.n_bytes) for t in reader.tensors)
    assert d["n_params"] == sum(int(t.n_elements) for t in reader.tensors)
    assert (d["arch"], d["num_layers"], d["num_heads"], d["num_kv_heads"], d["head_dim"]) == ("qwen2", 2, 4, 2, 16)
    assert d["attention_bias"] and d["vocab_size"] == 96 and d["context_length"] == 256
    import hashlib
    assert d["sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    # KV bytes/1K tokens = layers * format bytes per token-layer * 1024; bf16: 2 (K,V) * kv_heads * head_dim * 2 B
    assert d["kv_bytes_per_1k"]["bf16"] == 2 * 2 * 16 * 2 * 2 * 1024
    for fmt, n in d["kv_bytes_per_1k"].items():
        assert n == int(make_format(fmt).bytes_per_token(2, 16) * 2 * 1024)
    assert d["kv_bytes_per_1k"]["int4"] < d["kv_bytes_per_1k"]["int8"] < d["kv_bytes_per_1k"]["bf16"]
    out = Console(width=120, record=True)
    out.print(format_inspect(d))
    text = out.export_text()
    assert "qwen2" in text and "Q8_0" in text and "int4" in text


def test_inspect_smollm2(smollm2_path: Path) -> None:
    d = inspect_model(smollm2_path)
    assert d["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert d["quant_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert (d["arch"], d["num_layers"], d["hidden_size"], d["num_heads"], d["num_kv_heads"]) == ("llama", 30, 576, 9, 3)
    assert d["tie_word_embeddings"] and d["vocab_size"] == 49152 and d["context_length"] == 8192


def test_inspect_hf_dir(tmp_path: Path) -> None:
    model, _ = tiny_hf_model("qwen3", tied=True)
    model.save_pretrained(tmp_path)
    d = inspect_model(tmp_path)
    assert d["format"] == "safetensors" and d["arch"] == "qwen3" and d["qk_norm"] and d["head_dim"] == 32
    assert d["n_params"] == sum(p.numel() for p in model.parameters())  # tied: stored once


def test_truncated(tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:-1000])  # tensor data cut
    _assert_error(tiny_gguf, "truncated", "ends at byte")
    _assert_error(tiny_gguf, "truncated", fn=load_checkpoint)
    tiny_gguf.write_bytes(data[:300])  # inside the header
    _assert_error(tiny_gguf, "truncated file", "header")
    tiny_gguf.write_bytes(data[:2])
    _assert_error(tiny_gguf, "truncated")


def test_bad_magic(tiny_gguf: Path) -> None:
    tiny_gguf.write_bytes(b"GGML" + tiny_gguf.read_bytes()[4:])
    _assert_error(tiny_gguf, "bad magic", "not a GGUF file")
    _assert_error(tiny_gguf, "bad magic", fn=load_checkpoint)


@pytest.mark.parametrize("version", [1, 4, 999])
def test_bad_version(tiny_gguf: Path, version: int) -> None:
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
    _assert_error(tiny_gguf, f"unsupported GGUF version {version}", "supported: 2, 3")


def test_corrupt_header(tiny_gguf: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    # the first metadata key's length (u64 right after the 24-byte fixed header) -> absurd
    data[24:32] = struct.pack("<Q", 2**60)
    tiny_gguf.write_bytes(bytes(data))
    _assert_error(tiny_gguf, "corrupt header")


def test_unknown_architecture(tmp_path: Path) -> None:
    model, cfg = tiny_hf_model("llama")
    p = write_gguf(tmp_path / "falcon.gguf", "falcon", cfg, model.state_dict())
    msg = _assert_error(p, "unknown architecture 'falcon'", "llama, qwen2, qwen3")
    assert msg == _assert_error(p, fn=load_checkpoint)


def test_unknown_quant_type(tiny_gguf: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    name = b"blk.1.ffn_up.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == GGMLQuantizationType.Q8_0
    struct.pack_into("<I", data, type_at, 250)
    tiny_gguf.write_bytes(bytes(data))
    _assert_error(tiny_gguf, "unknown quant type 250", "blk.1.ffn_up.weight")


def test_missing_file(tmp_path: Path) -> None:
    _assert_error(tmp_path / "absent.gguf", "file not found")
