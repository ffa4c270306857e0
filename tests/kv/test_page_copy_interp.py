"""page_copy Triton kernel vs copy_pages_reference under TRITON_INTERPRET=1 (CPU, small sizes).

The interpreter must be chosen before the kernel is decorated (import time), so the
cases run in a fresh interpreter process: this file run as a script (`main`).
`make_case` / `check_case` are shared with tests/gpu/test_page_copy.py (CUDA, pinned host).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

DTYPES = (torch.bfloat16, torch.uint8, torch.int8, torch.float16)
LAYERS = 3
COUNTS = (1, 7, 300)
# Small stand-ins for the pool layouts (8, 16, 128) data, (8, 16, 1) / (8, 16, 4) scales, (2, 16, 64)
INTERP_SHAPES = ((2, 4, 32), (2, 4, 1), (2, 4, 4), (1, 4, 16))
# Word-size and block edge cases: odd bytes (uint8 words), 2-byte multiples (int16 words),
# one full 4096-word block, a masked second block, two full blocks (8192 int32 words).
EDGE_CASES = (((3, 5, 1), torch.uint8), ((3, 5, 2), torch.uint8), ((3, 5, 1), torch.float16),
              ((4096,), torch.int32), ((4100,), torch.int32), ((8, 16, 128), torch.bfloat16),
              ((2, 3), torch.float8_e4m3fn), ((5,), torch.float32))


def random_pages(layers: int, pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
                 g: torch.Generator, device: str = "cpu", pin: bool = False) -> torch.Tensor:
    """[layers, pages, *page_shape] of random bytes, none of them zero (any dtype, bit patterns)."""
    shape = (layers, pages, *page_shape)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(1, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).view(shape)
    if pin:
        out = torch.empty(shape, dtype=dtype, pin_memory=True)
        out.copy_(raw)
        return out
    return raw.to(device)


def make_case(page_shape: tuple[int, ...], dtype: torch.dtype, n: int, layers: int = LAYERS,
              src_dev: str = "cpu", dst_dev: str = "cpu", pin_src: bool = False, pin_dst: bool = False,
              spare: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """src, dst pools (random, different bytes) and n source pages (repeats allowed) -> n distinct
    random destination pages; the pools have a few more pages than n."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{page_shape}{dtype}{n}{layers}".encode()))
    src = random_pages(layers, n + spare, page_shape, dtype, g, src_dev, pin_src)
    dst = random_pages(layers, n + 2 * spare, page_shape, dtype, g, dst_dev, pin_dst)
    src_idx = torch.randint(0, src.shape[1], (n,), generator=g)
    dst_idx = torch.randperm(dst.shape[1], generator=g)[:n]
    return src, dst, src_idx, dst_idx


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of t's bytes (a copy also for CPU tensors, which .cpu() would alias)."""
    return t.contiguous().view(-1).view(torch.uint8).cpu().clone()


def check_case(pc, src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
               idx_device: str = "cpu") -> None:
    """copy_pages == copy_pages_reference on the whole destination, bit for bit (untouched pages too)."""
    want = dst.clone()
    pc.copy_pages_reference(src, want, src_idx, dst_idx)
    src_before = as_bytes(src)
    pc.copy_pages(src, dst, src_idx.to(idx_device), dst_idx.to(idx_device))
    if dst.is_cuda or src.is_cuda:
        torch.cuda.synchronize()
    got, ref = as_bytes(dst), as_bytes(want)
    assert torch.equal(got, ref), f"{int((got != ref).sum())} of {ref.numel()} bytes differ"
    if src.data_ptr() != dst.data_ptr():  # (within one pool the whole pool was compared above)
        assert torch.equal(as_bytes(src), src_before), "the source was modified"
    moved = as_bytes(want[:, dst_idx])
    assert bool((moved != 0).all())  # random non-zero bytes: a page left unwritten cannot pass


def interp_cases() -> list[tuple[tuple[int, ...], torch.dtype, int]]:
    """Every shape x dtype at n = 1, 7; n = 300 once per shape (the interpreter runs ~1 ms a program)."""
    cases = [(shape, dtype, n) for shape in INTERP_SHAPES for dtype in DTYPES for n in COUNTS[:2]]
    cases += [(shape, DTYPES[i % len(DTYPES)], COUNTS[2]) for i, shape in enumerate(INTERP_SHAPES)]
    return cases + [(shape, dtype, n) for shape, dtype in EDGE_CASES for n in (1, 7)]


def main() -> None:
    """Run every interpreter case (TRITON_INTERPRET=1 must be set before the kernel is imported)."""
    import kvtier.kernels.page_copy as pc
    assert pc._interpreting(), "set TRITON_INTERPRET=1"
    failures = []

    def run(label: str, *case: torch.Tensor) -> None:
        try:
            check_case(pc, *case)
        except AssertionError as e:
            failures.append(f"{label}: {e}")

    for shape, dtype, n in interp_cases():
        run(f"{shape} {dtype} n={n}", *make_case(shape, dtype, n))
    # within one pool (PagePool.copy_to(self)): disjoint source and destination pages
    g = torch.Generator().manual_seed(1)
    pool = random_pages(LAYERS, 20, (2, 4, 4), torch.float16, g)
    perm = torch.randperm(20, generator=g)
    run("same pool", pool, pool, perm[:8], perm[8:16])
    # no pages: nothing written
    src, dst, _, _ = make_case((2, 4, 4), torch.uint8, 1)
    run("n=0", src, dst, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    # int32 indices are accepted (converted to int64)
    src, dst, si, di = make_case((1, 4, 16), torch.bfloat16, 7)
    run("int32 indices", src, dst, si.int(), di.int())
    print("\n".join(failures) if failures else "ALL OK")


def test_page_copy_matches_reference_interpreted() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(Path(__file__).resolve())], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().endswith("ALL OK"), res.stdout[-3000:]


def test_reference_matches_loop() -> None:
    import kvtier.kernels.page_copy as pc
    src, dst, si, di = make_case((2, 4, 4), torch.bfloat16, 7)
    want = dst.clone()
    for layer in range(LAYERS):
        for s, d in zip(si.tolist(), di.tolist(), strict=True):
            want[layer, d] = src[layer, s]
    pc.copy_pages_reference(src, dst, si, di)
    assert torch.equal(as_bytes(dst), as_bytes(want))


def test_word_dtype() -> None:
    import kvtier.kernels.page_copy as pc
    t = torch.zeros(64, dtype=torch.uint8)
    assert pc._word_dtype(8, t) == torch.int32
    assert pc._word_dtype(6, t) == torch.int16
    assert pc._word_dtype(15, t) == torch.uint8
    assert pc._word_dtype(8, t, t[2:]) == torch.int16  # a base address only 2-byte aligned
    assert pc._word_dtype(8, t[1:]) == torch.uint8


def test_bad_arguments_raise() -> None:
    import kvtier.kernels.page_copy as pc
    src = torch.zeros(2, 4, 3, 8, dtype=torch.float16)
    idx = torch.arange(2)
    bad = [(torch.zeros(2, 4, 3, 4, dtype=torch.float16), idx, idx),  # page shape
           (torch.zeros(2, 4, 3, 8, dtype=torch.bfloat16), idx, idx),  # dtype
           (torch.zeros(3, 4, 3, 8, dtype=torch.float16), idx, idx),  # layers
           (torch.zeros(2, 4, 8, 3, dtype=torch.float16).transpose(2, 3), idx, idx),  # not contiguous
           (src.clone(), idx, idx[:1]),  # lengths
           (src.clone(), idx.float(), idx)]  # not integers
    for dst, si, di in bad:
        with pytest.raises(ValueError):
            pc.copy_pages_reference(src, dst, si, di)


def test_not_available_for_pageable_or_cpu_only() -> None:
    import kvtier.kernels.page_copy as pc
    if pc._interpreting():
        pytest.skip("TRITON_INTERPRET is set for this process")
    cpu = torch.zeros(1, 2, 4)
    assert not pc.available(cpu, cpu.clone())
    with pytest.raises(RuntimeError):
        pc.copy_pages(cpu, cpu.clone(), torch.arange(1), torch.arange(1))
    if torch.cuda.is_available():
        assert not pc.available(cpu, cpu.cuda())  # pageable host memory cannot be read by the GPU
        assert pc.available(cpu.pin_memory(), cpu.cuda()) and pc.available(cpu.cuda(), cpu.pin_memory())


if __name__ == "__main__":
    main()
