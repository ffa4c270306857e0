"""`--weights auto`: which loader mode build_engine asks for (engine/build.py load_mode)."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import EngineConfig
from kvtier.engine.build import CPU_DENSE_AUTO_MAX_FILE, load_mode


def _file(tmp_path: Path, size: int) -> Path:
    p = tmp_path / f"m{size}.gguf"
    with open(p, "wb") as f:
        f.truncate(size)  # sparse: only the size matters here
    return p


def test_auto_is_dense_for_small_gguf_on_cpu_and_stored_otherwise(tmp_path):
    small, big = _file(tmp_path, 94 * 2**20), _file(tmp_path, CPU_DENSE_AUTO_MAX_FILE + 1)
    cpu = EngineConfig(device="cpu", decode_weights="int8")
    assert load_mode(cpu, small) == "dense"  # the fast two-copy path for a small model
    assert load_mode(cpu, big) == "stored"  # one copy in the file's format: memory first
    assert load_mode(EngineConfig(device="cuda", decode_weights="int8"), small) == "stored"
    assert load_mode(cpu) == "stored"  # no file to measure


def test_explicit_choices_win(tmp_path):
    small = _file(tmp_path, 2**20)
    assert load_mode(EngineConfig(device="cpu", decode_weights="dense"), small) == "dense"
    for weights, mode in (("bf16", "dense"), ("int8", "int8"), ("int4", "int4")):
        assert load_mode(EngineConfig(device="cpu", decode_weights="int8", weights=weights), small) == mode
