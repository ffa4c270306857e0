"""Paged decode kernel (kvtier/kernels/paged_attention.py) on CUDA (skipped without a GPU).

- kernel == reference for every KV format x GQA 1/4/8 x head_dim 64/128, odd lengths,
  partial pages, a seq_len-0 row, sink rows, num_splits from choose_num_splits and forced 1 / 7
  (cases of tests/layers/paged_attention_cases.py, shared with the interpreter test);
- a captured CUDA graph replayed over new lengths / tables / queries == eager;
- `pytest tests/gpu/test_paged_attention.py -s -k print`: us/call and GB/s of the bytes
  actually read (K + V codes + scales) at B = 1 and 32, contexts 1K / 8K / 32K.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvtier.kv.formats import FORMAT_NAMES, make_format

_spec = importlib.util.spec_from_file_location(
    "paged_attention_cases", Path(__file__).parents[1] / "layers" / "paged_attention_cases.py")
cases = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = cases  # its dataclass looks its module up while the module executes
_spec.loader.exec_module(cases)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PS = 16
KV_HEADS = 2
LENS = [1, 17, 0, 100, 256, 3001, 37, 64]  # one token, partial pages, padding row, page-aligned, long
SINKS = [True, False, True, True, False, True, True, False]
FORCED_SPLITS = (1, 7)

# Bandwidth shape: Llama-3-8B-like attention (8 kv heads, 32 query heads, head_dim 128).
BW_KV_HEADS, BW_GQA, BW_D = 8, 4, 128
BW_FORMATS = ("bf16", "int8", "k8v4", "int4")
BW_CONTEXTS = (1024, 8192, 32768)
BW_BATCHES = (1, 32)
BW_WARMUP, BW_REPEATS = 3, 15
H200_HBM_GBPS = 4800.0  # H200 SXM HBM3e peak (spec sheet), for the printed fraction


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_kernel_matches_reference_cuda(name: str, gqa: int, head_dim: int) -> None:
    """Sinks as the engine passes them: quantized pools have sink rows, plain pools none."""
    from kvtier.kernels import paged_attention as pa
    dtype = cases.compute_dtype(name, torch.bfloat16)
    case = cases.make_case(name, KV_HEADS, gqa, PS, head_dim, LENS, SINKS, dtype, "cuda", seed=gqa * 1000 + head_dim)
    auto = pa.choose_num_splits(len(LENS), KV_HEADS, max(LENS), PS, _num_sms())
    for splits in sorted({auto, *FORCED_SPLITS}):
        cases.check_case(pa, case, splits, use_sink=case.pool.fmt.quantized)


@pytest.mark.parametrize("where", ["pinned", "cuda"])
@pytest.mark.parametrize("name", ["bf16", "fp32", "int8", "k8v4", "int4"])
def test_alt_pages_match_reference_cuda(name: str, where: str) -> None:
    """Negative block-table ids read a second source (AltPages): pinned host pages over the bus
    (UVA, the host tier in decode) or another device tensor (prefill's staging copy)."""
    from kvtier.kernels import paged_attention as pa
    dtype = cases.compute_dtype(name, torch.bfloat16)
    case = cases.make_case(name, KV_HEADS, 4, PS, 128, LENS, SINKS, dtype, "cuda", seed=77)
    case, alt = cases.with_alt_pages(case, seed=78, alt_device=where)
    for splits in (1, 7):
        cases.check_alt_case(pa, case, alt, splits, use_sink=True)


@pytest.mark.parametrize("name", ["bf16", "k8v4"])
def test_cuda_graph_replay_matches_eager(name: str) -> None:
    """Capture once with fixed buffers; new seq_lens / block tables / queries in place; replay."""
    from kvtier.kernels import paged_attention as pa
    dtype = cases.compute_dtype(name, torch.bfloat16)
    case = cases.make_case(name, KV_HEADS, 4, PS, 128, LENS, SINKS, dtype, "cuda", seed=5)
    fmt, sink = case.pool.fmt, case.sink if case.pool.fmt.quantized else None
    capacity = case.block_table.shape[1] * PS  # every table row holds this many tokens' page ids
    splits = pa.choose_num_splits(len(LENS), KV_HEADS, capacity, PS, _num_sms())  # shape-only
    q, table, lens = case.q.clone(), case.block_table.clone(), case.seq_lens.clone()
    out = torch.empty_like(q)

    def step() -> None:
        pa.paged_decode(q, case.st, fmt, table, lens, case.scale, splits, sink=sink, out=out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        new_lens = torch.randint(0, capacity + 1, (len(LENS),), generator=g)
        new_lens[0], new_lens[1] = 0, capacity  # a padding row and a full row
        lens.copy_(new_lens.to(torch.int32))
        table.copy_(table[torch.randperm(len(LENS), generator=g).cuda()])
        q.copy_(torch.randn(q.shape, generator=g).to(q))
        graph.replay()
        eager = pa.paged_decode(q, case.st, fmt, table, lens, case.scale, splits, sink=sink)
        torch.cuda.synchronize()
        assert torch.equal(out, eager), "graph replay differs from the eager launch"
        want = pa.paged_decode_reference(q, case.st, fmt, table, lens, case.scale, sink=sink)
        tol = cases.TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


def _random_pages(name: str, num_pages: int) -> dict[str, torch.Tensor]:
    return cases.random_pages(name, num_pages, BW_KV_HEADS, PS, BW_D)


def _median_us(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    return cases.median_us(fn, warmup, repeats)


def test_print_bandwidth() -> None:
    """us/call and GB/s (K + V codes + scales actually read) on scattered pages; run with -s."""
    from kvtier.kernels import paged_attention as pa
    num_pages = max(BW_BATCHES) * max(BW_CONTEXTS) // PS
    hq = BW_KV_HEADS * BW_GQA
    print(f"\npaged_decode  Hkv={BW_KV_HEADS} Hq={hq} D={BW_D} page={PS}  ({_num_sms()} SMs)")
    print(f"{'format':>6} {'B':>3} {'context':>7} {'splits':>6} {'us/call':>9} {'GB/s':>7} {'of peak':>7}")
    for name in BW_FORMATS:
        fmt = make_format(name)
        st = _random_pages(name, num_pages)
        perm = torch.randperm(num_pages, device="cuda").to(torch.int32)  # scattered pages
        sink = None
        if fmt.quantized:  # as the engine: each sequence's first page has an exact sink row
            sink_k = torch.randn(max(BW_BATCHES), BW_KV_HEADS, BW_D, device="cuda", dtype=torch.bfloat16)
            sink_slot = torch.full((num_pages,), -1, dtype=torch.long, device="cuda")
            sink = (sink_k, sink_k.clone(), sink_slot)
        for batch in BW_BATCHES:
            for ctx in BW_CONTEXTS:
                pages = ctx // PS
                table = perm[:batch * pages].view(batch, pages)
                lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
                if sink is not None:
                    sink[2].fill_(-1)
                    sink[2][table[:, 0].long()] = torch.arange(batch, device="cuda")
                q = torch.randn(batch, hq, BW_D, device="cuda", dtype=torch.bfloat16)
                splits = pa.choose_num_splits(batch, BW_KV_HEADS, ctx, PS, _num_sms())
                out = torch.empty_like(q)
                us = _median_us(lambda: pa.paged_decode(q, st, fmt, table, lens, BW_D ** -0.5, splits,
                                                        sink=sink, out=out), BW_WARMUP, BW_REPEATS)
                gbs = batch * ctx * fmt.bytes_per_token(BW_KV_HEADS, BW_D) / (us * 1e-6) / 1e9
                print(f"{name:>6} {batch:>3} {ctx:>7} {splits:>6} {us:>9.1f} {gbs:>7.0f} {gbs / H200_HBM_GBPS:>7.0%}")
        del st, perm
        torch.cuda.empty_cache()
