"""Weight-only quantized matmul kernels (kvtier/kernels/wq_matmul.py) on CUDA at Qwen3-8B sizes
(skipped without a GPU).

wq_linear (each M takes its default path) == wq_linear_reference within the relative tolerance
of tests/layers/wq_matmul_cases.py; every path and switch at one shape; no host
synchronisation; deterministic (split-K reduces in a fixed order, no atomics); CUDA-graph
replay == eager.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.kernels import wq_matmul as wq  # noqa: E402
from kvtier.layers.qweight import QuantWeight  # noqa: E402
from tests.layers import wq_matmul_cases as cases  # noqa: E402

CUDA = "cuda"
T = TypeVar("T")
# Qwen3-8B (N, K): qkv, o_proj, down; gate_up and lm_head in their own tests (larger).
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "down": (4096, 12288)}
ROWS = (1, 2, 7, 32, 300, 2048)  # decode, small batches, batch-32 decode, a prefill chunk, a prefill
LAYOUTS = {"q4_1": (4, 32, True), "q8_0": (8, 32, False)}
LM_HEAD = (151936, 4096)


@functools.lru_cache(maxsize=None)
def weight(n: int, k: int, bits: int, group: int, mins: bool) -> QuantWeight:
    return cases.make_weight(n, k, bits, group, mins, CUDA, cases.gen("gpu", n, k, bits, group, mins))


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, residual: bool, seed: object
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    return cases.make_inputs(m, n, k, dtype, bias, residual, False, CUDA, cases.gen("in", seed, m, n, k, dtype))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_wq_linear_matches_reference(layout: str, shape: str, m: int) -> None:
    """bf16 x on every shape; fp16 x on o_proj (each dtype is another compile of every kernel)."""
    (n, k), (bits, group, mins) = SHAPES[shape], LAYOUTS[layout]
    w = weight(n, k, bits, group, mins)
    for dtype in (torch.bfloat16, torch.float16) if shape == "o_proj" else (torch.bfloat16,):
        x, _, r = _inputs(m, n, k, dtype, False, shape == "o_proj", shape)
        cases.assert_close(wq.wq_linear(x, w, residual=r), wq.wq_linear_reference(x, w, residual=r),
                           f"wq_linear {shape} {layout} M={m} {dtype}")


@pytest.mark.parametrize("m", [1, 32])
def test_gate_up_and_lm_head(m: int) -> None:
    for n, k in ((24576, 4096), LM_HEAD):
        w = weight(n, k, 4, 32, True)
        x, _, _ = _inputs(m, n, k, torch.bfloat16, False, False, "big")
        cases.assert_close(wq.wq_linear(x, w), wq.wq_linear_reference(x, w), f"wq_linear N={n} M={m}")


PATHS = cases.paths(wq, interpreted=False)
# (bits, group, mins, x dtype, bias, residual, strided x): every layout the loaders make, each
# dtype, the epilogue's options; M = 5 (a partial tile everywhere) for the skinny paths, 300 else.
PATH_CASES = ((4, 32, True, torch.bfloat16, True, True, False), (8, 32, False, torch.bfloat16, False, False, True),
              (4, 32, False, torch.float16, False, True, True), (8, 16, True, torch.bfloat16, True, False, False),
              (4, 64, True, torch.float32, True, True, False), (8, 128, False, torch.float16, False, False, False))


@pytest.mark.parametrize("path", PATHS)
def test_every_path_matches_reference(path: str) -> None:
    m = 300 if path.startswith(("gemm", "dequant")) else 5
    for bits, group, mins, dtype, bias, residual, strided in PATH_CASES:
        cases.check(wq, PATHS[path], path, m, 1536, 2048, bits, group, mins, dtype, CUDA, bias, residual, strided)


def _calls(m: int) -> tuple[list[torch.Tensor], object]:
    """Static inputs and a function running wq_linear on o_proj (4-bit, residual) and down (8-bit, bias)."""
    w4, w8 = weight(4096, 4096, 4, 32, True), weight(4096, 12288, 8, 32, False)
    x4, _, r4 = _inputs(m, 4096, 4096, torch.bfloat16, False, True, "graph")
    x8, b8, _ = _inputs(m, 4096, 12288, torch.bfloat16, True, False, "graph")
    return [x4, r4, x8], lambda: [wq.wq_linear(x4, w4, residual=r4), wq.wq_linear(x8, w8, bias=b8)]


@pytest.mark.parametrize("m", [1, 7, 32, 300, 2048])
def test_no_host_sync_and_deterministic(m: int) -> None:
    _, run = _calls(m)
    first = run()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def _captured(run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """run() warmed up off the capture (compiles, allocations), then captured: (graph, its outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


@pytest.mark.parametrize("m", [1, 7, 32, 300])
def test_cuda_graph_replay_equals_eager(m: int) -> None:
    inputs, run = _calls(m)
    graph, captured = _captured(run)
    g = torch.Generator().manual_seed(m)
    for _ in range(2):
        for t in inputs:  # new values in the captured buffers
            t.copy_(torch.randn(t.shape, generator=g).to(CUDA, t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, run()):
            assert torch.equal(got, want)
