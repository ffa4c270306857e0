"""Checkpoint loading: one entry point for GGUF files and HF safetensors directories."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier.models.loading.base import LOAD_WEIGHTS, Checkpoint, ModelFileError
from kvtier.models.loading.gguf import load_gguf, read_gguf_header
from kvtier.models.loading.safetensors import load_safetensors_dir

__all__ = ["Checkpoint", "ModelFileError", "load_checkpoint", "load_gguf", "load_safetensors_dir",
           "read_gguf_header"]


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32, weights: str = "dense") -> Checkpoint:
    """Load a .gguf file or an HF directory (config.json + *.safetensors) as a Checkpoint.

    Tensors are HF-named. weights (base.LOAD_WEIGHTS): "dense" dequantizes everything to
    `dtype`; "stored" keeps GGUF's quantized blocks as QuantWeight; "int8" / "int4" quantize
    the matrices at load. Raises ModelFileError (a ValueError) with a one-line message naming
    the file for anything missing, damaged or unsupported.
    """
    if weights not in LOAD_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(LOAD_WEIGHTS)}, got {weights!r}")
    path = Path(path)
    if path.is_dir():
        return load_safetensors_dir(path, dtype, weights)
    if not path.exists():
        raise ModelFileError(path, "file not found")
    if path.suffix == ".safetensors":
        return load_safetensors_dir(path.parent, dtype, weights)
    return load_gguf(path, dtype, weights)
