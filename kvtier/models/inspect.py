"""`kvtier inspect`: what a model file is and what it costs in memory, without dequantizing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table

from kvtier.config import ModelSpec
from kvtier.kv.formats import make_format
from kvtier.models.hub import sha256_file
from kvtier.models.loading.base import ModelFileError
from kvtier.layers.qlinear import INT4PACK_BLOCK_N, INT4PACK_GROUPS
from kvtier.models.loading.gguf import GGUFHeader, read_gguf_header, spec_from_gguf
from kvtier.models.loading.repack import ASYMMETRIC, REPACKS
from kvtier.models.registry import gguf_to_hf_name
from kvtier.models.loading.safetensors import (check_safetensors_file, read_config, shard_files,
                                               spec_from_config)

KV_FORMATS_SHOWN = ("bf16", "fp8", "int8", "int4")
TOKENS_PER_ESTIMATE = 1024  # KV memory is reported per 1K tokens of context
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def inspect_model(path: str | Path, with_sha256: bool = True) -> dict[str, Any]:
    """Facts and memory estimates of a .gguf file or HF directory. Raises ModelFileError.

    Keys: path, format, arch, name, hidden_size, intermediate_size, num_layers, num_heads,
    num_kv_heads, head_dim, vocab_size, context_length, tie_word_embeddings, attention_bias,
    qk_norm, rope_theta, quant_types {type: tensor count}, n_tensors, n_params, file_size,
    sha256 (None for directories or with_sha256=False), weights_bytes (as stored),
    weights_bf16_bytes, resident_bytes {device: bytes the engine's default load holds},
    kv_bytes_per_1k {fmt: bytes}.
    """
    path = Path(path)
    if path.is_dir():
        spec, quant, n_params, stored, size, fmt = _inspect_hf(path)
        digest = None
        resident = {"cpu": 2 * n_params, "cuda": 2 * n_params}  # dense bf16
    else:
        header = read_gguf_header(path)
        spec = spec_from_gguf(header)
        quant = Counter(t.qtype.name for t in header.tensors)
        n_params = sum(_numel(t.shape) for t in header.tensors)
        stored = sum(t.nbytes for t in header.tensors)
        size, fmt = header.file_size, "gguf"
        digest = sha256_file(path) if with_sha256 else None
        resident = gguf_resident_bytes(header, spec)
    return {
        "path": str(path), "format": fmt, "arch": spec.arch, "name": spec.name,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_layers": spec.num_layers, "num_heads": spec.num_heads, "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "vocab_size": spec.vocab_size,
        "context_length": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias, "qk_norm": spec.qk_norm, "rope_theta": spec.rope_theta,
        "quant_types": dict(sorted(quant.items(), key=lambda kv: -kv[1])),
        "n_tensors": sum(quant.values()), "n_params": n_params, "file_size": size, "sha256": digest,
        "weights_bytes": stored, "weights_bf16_bytes": 2 * n_params, "resident_bytes": resident,
        "kv_bytes_per_1k": kv_bytes_per_1k(spec),
    }


def gguf_resident_bytes(header: GGUFHeader, spec: ModelSpec) -> dict[str, int]:
    """Weight bytes the engine holds after loading a GGUF as stored (models/loading/repack.py), by
    device: "cuda" the QuantWeight layout itself; "cpu" (bf16) the packings of layers/qlinear.py
    (int4pack for 4-bit groups of 32+, per-row int8 for other 8-bit matmuls, the lm_head's 8-bit
    codes as two int4pack halves; an untied embedding stays a QuantWeight). Dense tensors: bf16."""
    cuda = cpu = 0
    for t in header.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            continue
        numel = _numel(t.shape)
        if t.qtype not in REPACKS or len(t.shape) != 2:
            cuda, cpu = cuda + 2 * numel, cpu + 2 * numel
            continue
        bits, group, _ = REPACKS[t.qtype]
        n, k = t.torch_shape
        has_min = t.qtype in ASYMMETRIC
        qw = numel * bits // 8 + n * (k // group) * 2 * (2 if has_min else 1)
        cuda += qw
        head = hf == "lm_head.weight" or (hf == "model.embed_tokens.weight" and spec.tie_word_embeddings)
        int4pack = (-(-n // INT4PACK_BLOCK_N) * INT4PACK_BLOCK_N) * (k // 2 + (k // max(group, 1)) * 4)
        if hf == "model.embed_tokens.weight" and not spec.tie_word_embeddings:
            cpu += qw
        elif bits == 4 and group in INT4PACK_GROUPS:
            cpu += int4pack
        elif head and bits == 8 and group in INT4PACK_GROUPS:
            cpu += 2 * int4pack
        else:
            cpu += numel + 2 * n
    return {"cpu": cpu, "cuda": cuda}


def kv_bytes_per_1k(spec: ModelSpec) -> dict[str, int]:
    """KV cache bytes (K+V, all layers, scales included) per 1K tokens in each shown format."""
    return {f: int(make_format(f).bytes_per_token(spec.num_kv_heads, spec.head_dim)
                   * spec.num_layers * TOKENS_PER_ESTIMATE) for f in KV_FORMATS_SHOWN}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _inspect_hf(model_dir: Path) -> tuple[ModelSpec, Counter, int, int, int, str]:
    spec = spec_from_config(read_config(model_dir), model_dir / "config.json")
    quant: Counter = Counter()
    n_params = stored = size = 0
    for f in shard_files(model_dir):
        size += f.stat().st_size
        for name, info in check_safetensors_file(f).items():
            if name == "__metadata__":
                continue
            quant[info["dtype"]] += 1
            n = _numel(tuple(info["shape"]))
            n_params += n
            stored += n * _ST_BYTES.get(info["dtype"], 4)
    return spec, quant, n_params, stored, size, "safetensors"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_inspect(d: dict[str, Any]) -> Group:
    """A rich renderable (two tables) of an inspect_model result."""
    facts = Table(title=f"{Path(d['path']).name}  ({d['format']})", show_header=False)
    facts.add_column("field", style="bold")
    facts.add_column("value")
    rows = [
        ("architecture", f"{d['arch']}" + (f"  ({d['name']})" if d["name"] else "")),
        ("layers", d["num_layers"]), ("hidden / ffn", f"{d['hidden_size']} / {d['intermediate_size']}"),
        ("heads / kv heads / head dim", f"{d['num_heads']} / {d['num_kv_heads']} / {d['head_dim']}"),
        ("vocab", d["vocab_size"]), ("trained context", f"{d['context_length']:,} tokens"),
        ("features", ", ".join(k for k in ("tie_word_embeddings", "attention_bias", "qk_norm") if d[k]) or "-"),
        ("rope theta", f"{d['rope_theta']:g}"),
        ("tensors", ", ".join(f"{k} x{v}" for k, v in d["quant_types"].items())),
        ("parameters", f"{d['n_params'] / 1e6:,.1f} M"), ("file size", _mib(d["file_size"])),
        ("sha256", d["sha256"] or "-"),
        ("weights as stored", _mib(d["weights_bytes"])), ("weights at bf16", _mib(d["weights_bf16_bytes"])),
        ("weights resident", ", ".join(f"{_mib(n)} on {dev}" for dev, n in d["resident_bytes"].items())),
    ]
    for k, v in rows:
        facts.add_row(k, str(v))
    kv = Table(title=f"KV cache per {TOKENS_PER_ESTIMATE:,} tokens")
    kv.add_column("format")
    kv.add_column("bytes", justify="right")
    kv.add_column(f"at {d['context_length']:,} tokens", justify="right")
    for fmt, n in d["kv_bytes_per_1k"].items():
        kv.add_row(fmt, _mib(n), _mib(n * d["context_length"] // TOKENS_PER_ESTIMATE))
    return Group(facts, kv)


__all__ = ["ModelFileError", "format_inspect", "inspect_model", "kv_bytes_per_1k"]
