"""Hugging Face checkpoint directories: config.json + *.safetensors (optionally sharded)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtier.config import ModelSpec
from kvtier.layers.qweight import QuantWeight
from kvtier.models.loading.base import Checkpoint, ModelFileError, check_tensor_shapes, quantize_at_load
from kvtier.models.registry import arch_for_hf_model_type, arch_info, expected_shapes, optional_shapes

INDEX_NAME = "model.safetensors.index.json"
# A safetensors JSON header above this is corrupt (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json of an HF directory, with ModelFileError when missing or not valid JSON."""
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ModelFileError(cfg_path, "config.json missing: an HF model directory needs config.json")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(cfg_path, f"config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(cfg_path, "config.json must hold a JSON object")
    return cfg


def spec_from_config(cfg: dict[str, Any], cfg_path: Path) -> ModelSpec:
    """ModelSpec from an HF config.json dict."""
    try:
        arch = arch_for_hf_model_type(str(cfg.get("model_type", "")))
        info = arch_info(arch)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = _rope_params(cfg)
        rope_theta = float(rope.pop("rope_theta", 10000.0))
        return ModelSpec(
            arch=arch, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=rope_theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=info.attention_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=info.qk_norm, rope_scaling=rope or None,
            name=str(cfg.get("_name_or_path", "")))
    except KeyError as e:
        raise ModelFileError(cfg_path, f"config.json invalid: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelFileError(cfg_path, f"config.json invalid: {e}") from None


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """rope_theta plus scaling, from transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters)."""
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if "rope_theta" in cfg:
        params["rope_theta"] = cfg["rope_theta"]
    if params.get("rope_type", "default") == "default":
        params.pop("rope_type", None)
        return {"rope_theta": params["rope_theta"]} if "rope_theta" in params else {}
    return params


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a directory: from the index when sharded, else all *.safetensors."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelFileError(index, f"invalid safetensors index: {e}") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelFileError(model_dir, "no *.safetensors files in the model directory")
    for f in files:
        if not f.is_file():
            raise ModelFileError(f, "file not found (named by the safetensors index)")
    return files


def check_safetensors_file(path: Path) -> dict[str, Any]:
    """Validate one .safetensors file's header and size; returns its parsed JSON header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(path, f"truncated file: {size} bytes is too short for a safetensors header")
        n = struct.unpack("<Q", head)[0]
        if n > MAX_HEADER_BYTES or 8 + n > size:
            kind = "corrupt header" if n > MAX_HEADER_BYTES else "truncated file"
            raise ModelFileError(path, f"{kind}: header claims {n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(path, f"corrupt header: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(path, "corrupt header: not a JSON object")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ModelFileError(path, f"truncated file: tensor data ends at byte {8 + n + end}, file has {size}")
    return header


def load_safetensors_dir(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                         weights: str = "dense") -> Checkpoint:
    """Load an HF checkpoint directory into HF-named tensors of `dtype`, one tensor at a time.

    weights "int8" / "int4": matrices quantized at load (base.quantize_at_load); "dense" and
    "stored" keep them dense in `dtype`.
    """
    model_dir = Path(model_dir)
    spec = spec_from_config(read_config(model_dir), model_dir / "config.json")
    files = shard_files(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Path] = {}
    for f in files:
        for name, info in check_safetensors_file(f).items():
            if name != "__metadata__":
                shapes[name], owner[name] = tuple(info["shape"]), f
    if spec.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    want = expected_shapes(spec)
    check_tensor_shapes(model_dir, shapes, want, optional_shapes(spec))
    keep = set(want) | (set(optional_shapes(spec)) & set(shapes))
    tensors: dict[str, torch.Tensor | QuantWeight] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if name in keep and owner[name] == f:
                    tensors[name] = quantize_at_load(name, sf.get_tensor(name), weights, dtype)
    return Checkpoint(spec=spec, tensors=tensors, path=model_dir, format="safetensors",
                      metadata={"files": [f.name for f in files],
                                "tensor_types": {k: (str(v.dtype) if isinstance(v, torch.Tensor)
                                                     else f"int{v.bits}") for k, v in tensors.items()},
                                "unmapped_tensors": sorted(set(shapes) - keep)})
