"""LazyTensors (models/loading/base.py): a GGUF's tensors read when asked for, a bounded window ahead."""

from __future__ import annotations

import threading

import torch

from kvtier.models.loading import base
from kvtier.models.loading.base import LazyTensors


def make(n: int, nbytes: int, monkeypatch, prefetch: int) -> tuple[LazyTensors, list[str], list[str]]:
    monkeypatch.setattr(base, "PREFETCH_BYTES", prefetch)
    read: list[str] = []
    threads: list[str] = []

    def load(name: str) -> torch.Tensor:
        read.append(name)
        threads.append(threading.current_thread().name)
        return torch.full((2, 3), float(name[1:]))

    names = {f"t{i}": (2, 3) for i in range(n)}
    return LazyTensors(names, {k: nbytes for k in names}, load, threads=2), read, threads


def test_read_on_demand_with_bounded_read_ahead(monkeypatch) -> None:
    lazy, read, threads = make(10, 100, monkeypatch, prefetch=250)
    assert lazy.shapes["t4"] == (2, 3) and len(lazy) == 10 and not read  # header facts, nothing read
    assert float(lazy.pop("t0")[0, 0]) == 0.0
    assert set(read) <= {"t0", "t1", "t2", "t3"}  # t0 and at most 250 bytes (3 tensors) ahead
    assert "t0" not in lazy and len(lazy) == 9
    for name in list(lazy):
        assert float(lazy.pop(name)[0, 0]) == float(name[1:])
    assert not lazy and sorted(read) == sorted(f"t{i}" for i in range(10))  # each read once
    assert threading.current_thread().name not in threads  # never on the asking thread
    assert lazy._load is None and lazy._pool is None  # all read: loader and pool let go


def test_mapping_semantics(monkeypatch) -> None:
    lazy, read, _ = make(4, 100, monkeypatch, prefetch=0)
    assert lazy["t2"] is lazy["t2"]  # cached once read
    lazy["t1"] = torch.zeros(5)
    assert lazy.shapes["t1"] == (5,) and float(lazy.pop("t1").sum()) == 0.0
    del lazy["t3"]
    assert sorted(lazy) == ["t0", "t2"] and "t1" not in read
