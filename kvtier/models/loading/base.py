"""What every checkpoint loader returns, and the one error type it raises."""

from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelSpec
from kvtier.layers.qweight import QuantWeight, quantize_rtn

# How a loader returns matmul weights: "dense" in the compute dtype (GGUF dequantized: the fp32
# reference), "stored" in the checkpoint's own format (GGUF blocks as QuantWeight; safetensors
# dense), "int8" / "int4" re-rounded at load with quantize_rtn.
LOAD_WEIGHTS = ("dense", "stored", "int8", "int4")
RTN_BITS = {"int8": 8, "int4": 4}
RTN_GROUP = 32  # quantize_rtn's group: the GGUF block size


class ModelFileError(ValueError):
    """A model file is missing, damaged or unsupported; the message is one line naming the file."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = " ".join(str(problem).split())  # always one line
        super().__init__(f"{self.path}: {self.problem}")


@dataclass
class Checkpoint:
    """A loaded decoder checkpoint.

    `tensors` are named exactly as Hugging Face names them (model.embed_tokens.weight,
    model.layers.{i}.self_attn.q_proj.weight, ...; lm_head.weight absent when tied) and are
    laid out as in HF: Linear weights are [out_features, in_features]. A weight is a dense
    tensor or, loaded with weights "stored" / "int8" / "int4", a QuantWeight.
    """

    spec: ModelSpec
    tensors: dict[str, torch.Tensor | QuantWeight]
    path: Path
    format: str  # "gguf" | "safetensors"
    metadata: dict[str, Any] = field(default_factory=dict)


def check_tensor_shapes(path: Path, shapes: dict[str, tuple[int, ...]],
                        expected: dict[str, tuple[int, ...]],
                        optional: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise ModelFileError for the first missing tensor or shape mismatch.

    `shapes` are the HF-named shapes found in the file; `expected` must all be present;
    `optional` may be present and, if so, must match too.
    """
    for name, want in expected.items():
        if name not in shapes:
            raise ModelFileError(path, f"missing tensor {name} (expected shape {list(want)})")
        if tuple(shapes[name]) != tuple(want):
            raise ModelFileError(path, f"shape mismatch for {name}: file has {list(shapes[name])}, "
                                       f"the model config implies {list(want)}")
    for name, want in (optional or {}).items():
        if name in shapes and tuple(shapes[name]) != tuple(want):
            raise ModelFileError(path, f"shape mismatch for {name}: file has {list(shapes[name])}, "
                                       f"the model config implies {list(want)}")


def is_matrix_weight(name: str, t: torch.Tensor | QuantWeight) -> bool:
    """Matmul and embedding matrices (what weights "int8" / "int4" quantize); norms and biases are not."""
    return len(t.shape) == 2 and name.endswith(".weight") and "norm" not in name


def quantize_at_load(name: str, t: torch.Tensor, weights: str, dtype: torch.dtype) -> torch.Tensor | QuantWeight:
    """A dense tensor as `weights` asks: cast to dtype, or quantize_rtn'd (int8 / int4) when a matrix
    whose K the group divides."""
    bits = RTN_BITS.get(weights)
    if bits is None or not is_matrix_weight(name, t) or t.shape[1] % RTN_GROUP:
        return t.to(dtype)
    return quantize_rtn(t, bits, RTN_GROUP)


def release_free_memory() -> None:
    """Hand memory freed during loading back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading frees many mid-sized temporaries (numpy block unpacking in worker threads, the
    QuantWeights each layer repacks); glibc keeps such freed memory in its per-thread arenas,
    where it would stay in the resident set for good.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
