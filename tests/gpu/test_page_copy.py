"""page_copy kernel on CUDA: pinned host <-> GPU (zero-copy over UVA) and GPU -> GPU, bit-exact
against copy_pages_reference (skipped without a GPU). `pytest -s` prints transfer rates."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

_spec = importlib.util.spec_from_file_location("page_copy_cases",
                                               Path(__file__).parents[1] / "kv" / "test_page_copy_interp.py")
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = ((8, 16, 128), (8, 16, 1), (8, 16, 4), (2, 16, 64))
DIRECTIONS = {"host_to_cuda": {"src_dev": "cpu", "pin_src": True, "dst_dev": "cuda"},
              "cuda_to_host": {"src_dev": "cuda", "dst_dev": "cpu", "pin_dst": True},
              "cuda_to_cuda": {"src_dev": "cuda", "dst_dev": "cuda"}}


@pytest.fixture(scope="module")
def pc():
    import kvtier.kernels.page_copy as pc
    return pc


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("n", cases.COUNTS)
def test_copy_pages_matches_reference(pc, direction: str, dtype: torch.dtype, shape: tuple[int, ...],
                                      n: int) -> None:
    src, dst, si, di = cases.make_case(shape, dtype, n, layers=cases.LAYERS, **DIRECTIONS[direction])
    assert pc.available(src, dst)
    cases.check_case(pc, src, dst, si, di, idx_device="cuda")


@pytest.mark.parametrize("direction", ["host_to_cuda", "cuda_to_host"])
@pytest.mark.parametrize("shape,dtype", cases.EDGE_CASES, ids=str)
def test_word_size_and_block_edges(pc, direction: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    for n in (1, 7, 300):
        cases.check_case(pc, *cases.make_case(shape, dtype, n, **DIRECTIONS[direction]), idx_device="cuda")


def test_cpu_indices_and_same_pool(pc) -> None:
    src, dst, si, di = cases.make_case((8, 16, 4), torch.float16, 7, **DIRECTIONS["host_to_cuda"])
    cases.check_case(pc, src, dst, si, di, idx_device="cpu")  # moved to the GPU by copy_pages
    g = torch.Generator().manual_seed(2)
    pool = cases.random_pages(3, 64, (2, 16, 64), torch.bfloat16, g, "cuda")
    perm = torch.randperm(64, generator=g)
    cases.check_case(pc, pool, pool, perm[:20], perm[20:40], idx_device="cuda")


def test_runs_on_the_current_stream(pc) -> None:
    """Queued on the caller's stream: it sees that stream's earlier writes, and no sync is needed
    between them."""
    src, dst, si, di = cases.make_case((8, 16, 128), torch.uint8, 300, **DIRECTIONS["cuda_to_host"])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: the copy must wait for the write below
        src.add_(1)
        pc.copy_pages(src, dst, si.cuda(), di.cuda())
    side.synchronize()
    want = src[:, si].cpu()
    assert torch.equal(dst[:, di], want)


def test_offsets_beyond_int32(pc) -> None:
    """A GPU pool of more than 2^31 words (3 layers of ~2^30): layer and page offsets need int64."""
    layers, words = 3, 64 * 1024  # int32 words a page (256 KiB)
    pages = (2 ** 30) // words + 32
    need = 4 * layers * pages * words + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2 ** 30:.1f} GiB free on the GPU")
    big = torch.zeros(layers, pages, words, dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(3)
    src = cases.random_pages(layers, 8, (words,), torch.int32, g, pin=True)
    di = torch.tensor([pages - 1, pages - 50, 5, pages // 2, 2 ** 31 // (layers * words), 0, 1, pages - 2],
                      device="cuda")
    pc.copy_pages(src, big, torch.arange(8, device="cuda"), di)
    torch.cuda.synchronize()
    assert torch.equal(big[:, di].cpu(), src)
    assert int(big.count_nonzero()) == int(src.count_nonzero())  # nothing landed elsewhere
    # and back: read the far pages of every layer into a pinned host pool
    out = torch.zeros(layers, 3, words, dtype=torch.int32, pin_memory=True)
    pc.copy_pages(big, out, di[:2], torch.tensor([2, 0], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(out[:, 2], src[:, 0]) and torch.equal(out[:, 0], src[:, 1]) and not out[:, 1].any()


def _seconds(fn: Callable[[], None], reps: int = 5) -> float:
    fn()  # warm-up (and the kernel's compilation)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _staged(src: torch.Tensor, dst: torch.Tensor, si: torch.Tensor, di: torch.Tensor) -> None:
    """PageTransfers._copy_layers' host -> GPU path (kv/transfer.py): per layer gather into pinned staging,
    copy, scatter."""
    for layer in range(src.shape[0]):
        staged = torch.empty((si.numel(), *src.shape[2:]), dtype=src.dtype, pin_memory=True)
        torch.index_select(src[layer], 0, si, out=staged)
        dst[layer].index_copy_(0, di, staged.to(dst.device, non_blocking=True))


@pytest.mark.parametrize("shape,dtype", [((8, 16, 128), torch.uint8), ((8, 16, 4), torch.float16)], ids=str)
def test_print_host_to_cuda_rates(pc, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Not a speed assertion: GB/s (page bytes moved / s) of 2048 scattered pages x 36 layers."""
    layers, n, pages = 36, 2048, 2560
    g = torch.Generator().manual_seed(4)
    host = torch.empty((layers, pages, *shape), dtype=dtype, pin_memory=True)
    nbytes_pool = host.numel() * host.element_size()  # random non-zero bytes, drawn on the GPU (fast)
    host.view(-1).view(torch.uint8).copy_(torch.randint(1, 256, (nbytes_pool,), dtype=torch.uint8, device="cuda"))
    gpu = torch.zeros((layers, pages, *shape), dtype=dtype, device="cuda")
    si = torch.randperm(pages, generator=g)[:n]
    di = torch.randperm(pages, generator=g)[:n]
    si_d, di_d = si.cuda(), di.cuda()
    nbytes = layers * n * host[0, 0].numel() * host.element_size()
    flat_h = host.view(-1)[:nbytes // host.element_size()]
    flat_d = torch.empty_like(flat_h, device="cuda")
    rates = {
        "kernel host->cuda": _seconds(lambda: pc.copy_pages(host, gpu, si_d, di_d)),
        "kernel cuda->host": _seconds(lambda: pc.copy_pages(gpu, host, di_d, si_d)),
        "staged (PagePool) host->cuda": _seconds(lambda: _staged(host, gpu, si, di_d)),
        "reference host->cuda": _seconds(lambda: pc.copy_pages_reference(host, gpu, si, di_d), reps=3),
        "contiguous copy_ (bus ceiling)": _seconds(lambda: flat_d.copy_(flat_h, non_blocking=True)),
    }
    print(f"\n{n} pages {shape} {dtype} x {layers} layers = {nbytes / 1e6:.1f} MB")
    for name, sec in rates.items():
        print(f"  {name:32s} {sec * 1e3:8.2f} ms  {nbytes / sec / 1e9:7.2f} GB/s")
    want = torch.zeros_like(gpu)
    pc.copy_pages_reference(host, want, si, di_d)
    pc.copy_pages(host, gpu, si_d, di_d)
    torch.cuda.synchronize()
    assert torch.equal(gpu[:, di_d].view(torch.uint8), want[:, di_d].view(torch.uint8))
