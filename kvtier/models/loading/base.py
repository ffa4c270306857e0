"""What every checkpoint loader returns, and the one error type it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelSpec


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
    laid out as in HF: Linear weights are [out_features, in_features].
    """

    spec: ModelSpec
    tensors: dict[str, torch.Tensor]
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
