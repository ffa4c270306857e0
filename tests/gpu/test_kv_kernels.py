"""KV quant kernels and pool transfers on CUDA (skipped without a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvtier.kv.formats import FORMAT_NAMES, make_format
from kvtier.kv.pool import PagePool

_spec = importlib.util.spec_from_file_location("kv_kernel_cases", Path(__file__).parents[1] / "kv" / "kernel_cases.py")
kernel_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_cases)
QUANT_FORMATS, check_store_load = kernel_cases.QUANT_FORMATS, kernel_cases.check_store_load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("name", QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_match_reference_cuda(name: str, dtype: torch.dtype, head_dim: int) -> None:
    import kvtier.kernels.kv_quant as kq
    check_store_load(kq, name, heads=8, page_size=16, head_dim=head_dim, num_pages=64, n_rows=500,
                     device="cuda", dtype=dtype, exact_fp8=True)


@pytest.mark.parametrize("name", QUANT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_transform_store_matches_pool_reference_cuda(name: str, dtype: torch.dtype, head_dim: int) -> None:
    """smooth + rotate + encode in one kernel (and native_q / native_out kernels) == the reference."""
    import kvtier.kernels.kv_transform as kt
    for rows in (333, 3):  # tiled programs (prefill), one row a program (decode)
        kernel_cases.check_fused_store(kt, name, heads=8, page_size=16, head_dim=head_dim, num_pages=64,
                                       n_rows=rows, device="cuda", dtype=dtype, gqa=4)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype,gqa", [(torch.bfloat16, 1), (torch.bfloat16, 4), (torch.bfloat16, 8),
                                       (torch.float32, 4)])  # the GQA ratios in bf16
def test_rope_store_matches_unfused_cuda(name: str, dtype: torch.dtype, head_dim: int, gqa: int) -> None:
    """norm + rotary + K / V store in one kernel == the qk_norm_rope kernel (q, k up to its rare
    rounding flips, check_rope_store), then the pool's reference write; decode rows (one a
    program) and prefill tiles, with and without the per-head norm."""
    import kvtier.kernels.kv_transform as kt
    for rows, norm in ((3, True), (333, True), (1, False), (40, False)):
        kernel_cases.check_rope_store(kt, name, heads=8, page_size=16, head_dim=head_dim, num_pages=64,
                                      n_rows=rows, device="cuda", dtype=dtype, gqa=gqa, norm=norm)


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_plain_store_kernel_matches_reference_cuda(name: str) -> None:
    import kvtier.kernels.kv_quant as kq
    kernel_cases.check_plain_store(kq, name, heads=8, page_size=16, head_dim=128, num_pages=64, n_rows=500,
                                   device="cuda")


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_cuda_pool_matches_cpu_pool(name: str) -> None:
    """PagePool on CUDA (kernels) reads back what the CPU pool (reference) reads back."""
    fmt = make_format(name)
    gpu = PagePool(fmt, 2, 32, 4, 16, 128, "cuda", compute_dtype=torch.float32)
    cpu = PagePool(fmt, 2, 32, 4, 16, 128, "cpu", compute_dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    slots = torch.randperm(32 * 16, generator=g)[:200]
    k, v = torch.randn(2, 200, 4, 128, generator=g)
    for pool in (gpu, cpu):
        pool.write(1, slots.to(pool.device), k.to(pool.device), v.to(pool.device))
    ids = torch.arange(32)
    for a, b in zip(gpu.read(1, ids.cuda()), cpu.read(1, ids)):
        if fmt.rotate_k or fmt.rotate_v:  # each pool calibrates its own K smoothing (CUDA and CPU
            # medians / spreads differ in the last bits) and rotations round differently, so codes
            # on a rounding edge flip by one step (an int4 step is 1/7 of its group's range); code
            # equality under shared constants is check_fused_store's
            tol = 5e-3 if name in ("k8v4", "int4") else 1e-3
            assert ((a.cpu() - b).norm() / b.norm()) < tol
        elif name == "fp8":  # CPU and GPU e4m3 casts agree on all but rare ties
            assert (a.cpu() != b).float().mean() < 1e-3
        else:
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("name", ["bf16", "int4"])
def test_copy_to_gpu_pinned_host_round_trip(name: str) -> None:
    fmt = make_format(name)
    gpu = PagePool(fmt, 3, 40, 4, 16, 128, "cuda", compute_dtype=torch.bfloat16)
    host = PagePool(fmt, 3, 100, 4, 16, 128, "cpu", compute_dtype=torch.bfloat16, pin=True)
    assert host.layers[0]["k"].is_pinned()
    slots = torch.arange(40 * 16, device="cuda")
    for layer in range(3):
        k, v = torch.randn(2, 40 * 16, 4, 128, device="cuda")
        gpu.write(layer, slots, k, v)
    before = [gpu.read(layer, torch.arange(40, device="cuda")) for layer in range(3)]
    src, dst = list(range(0, 40, 2)), list(range(99, 79, -1))
    codes = {name: t[:, src].cpu() for name, t in gpu.storage.items()}
    gpu.copy_to(host, src, dst)
    gpu.sync()  # the kernel path returns without waiting; the CPU reads host pages only after sync
    for name, t in host.storage.items():
        assert torch.equal(t[:, dst], codes[name])
    gpu.copy_to(gpu, list(range(1, 40, 2)), src)  # overwrite the copied-out pages on the GPU
    host.copy_to(gpu, dst, src)  # and bring them back
    for layer in range(3):
        after = gpu.read(layer, torch.tensor(src, device="cuda"))
        for x, y in zip(before[layer], after):
            assert torch.equal(x[src], y)


@pytest.mark.parametrize("name", QUANT_FORMATS)
def test_cuda_attention_in_rotated_domain_and_host_sinks(name: str) -> None:
    """On CUDA (bf16): attention in the stored domain == rotating every row back; pages (and the
    first page's sink row) copied to pinned host memory read back, via the page-copy kernel,
    exactly as they read in the GPU pool."""
    from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
    g = torch.Generator().manual_seed(1)
    hq, hkv, ps, d, n = 8, 2, 16, 128, 150
    table = [9, 3, 14, 0, 7, 11, 2, 5, 12, 6]
    slots = torch.tensor([table[p // ps] * ps + p % ps for p in range(n)], device="cuda")
    k, v = (torch.randn(2, n, hkv, d, generator=g) * 2 + 0.3).to("cuda", torch.bfloat16)
    q = torch.randn(n, hq, d, generator=g).to("cuda", torch.bfloat16)
    outs = []
    for fold in (True, False):
        pool = PagePool(make_format(name), 1, 16, hkv, ps, d, "cuda", compute_dtype=torch.bfloat16)
        att = DensePagedAttention(pool, d ** -0.5, fold_rotation=fold)
        meta = AttentionMetadata([0, n], [n], [table], slots, torch.tensor([n - 1], device="cuda"))
        outs.append(att.forward(0, q, k, v, meta).float())
    err = (outs[0] - outs[1]).norm() / outs[1].norm()
    assert err < 1e-2, err
    host = PagePool(make_format(name), 1, 40, hkv, ps, d, "cpu", compute_dtype=torch.bfloat16, pin=True)
    pages = -(-n // ps)
    pool.copy_to(host, table[:pages], list(range(20, 20 + pages)))
    assert host.sink_pages() == {20}
    first = torch.tensor([0], device="cuda")
    for native in (True, False):
        a = pool.read(0, torch.tensor(table[:pages], device="cuda"), first, native=native)
        b = pool.read_from(host, 0, torch.arange(20, 20 + pages), first.cpu(), native=native)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
