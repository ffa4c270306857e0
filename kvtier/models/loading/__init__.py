"""Checkpoint loading: one entry point for GGUF files and HF safetensors directories."""

from __future__ import annotations

from pathlib import Path

import torch

from kvtier.models.loading.base import Checkpoint, ModelFileError
from kvtier.models.loading.gguf import load_gguf, read_gguf_header
from kvtier.models.loading.safetensors import load_safetensors_dir

__all__ = ["Checkpoint", "ModelFileError", "load_checkpoint", "load_gguf", "load_safetensors_dir",
           "read_gguf_header"]


def load_checkpoint(path: str | Path, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a .gguf file or an HF directory (config.json + *.safetensors) as a Checkpoint.

    Tensors are HF-named and dequantized to `dtype`. Raises ModelFileError (a ValueError)
    with a one-line message naming the file for anything missing, damaged or unsupported.
    """
    path = Path(path)
    if path.is_dir():
        return load_safetensors_dir(path, dtype)
    if not path.exists():
        raise ModelFileError(path, "file not found")
    if path.suffix == ".safetensors":
        return load_safetensors_dir(path.parent, dtype)
    return load_gguf(path, dtype)
