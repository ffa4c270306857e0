"""Paged prefill kernel (kvtier/kernels/paged_attention.py) on CUDA (skipped without a GPU).

- kernel == reference for every KV format x GQA 1/4/8 x head_dim 64/128 (and 256 for bf16),
  a mixed batch (whole prompts, chunks after cached pages, decode rows, a sequence with no new
  rows), sinks on and off (cases of tests/layers/prefill_cases.py, shared with the interpreter);
- every block shape the sweep below times == reference;
- `pytest tests/gpu/test_paged_prefill.py -s -k print`: 2048 new rows of one sequence over
  2K / 8K / 32K contexts (bf16, Hq 32 / Hkv 8 / D 128): TFLOP/s of the kernel per format, of
  torch SDPA (flash) on the same K/V already dense, and of gather + SDPA (what
  DensePagedAttention does today); then a sweep of the kernel's block shapes.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.kv.formats import FORMAT_NAMES, make_format


def _load(name: str) -> ModuleType:
    """A tests/layers module by path (prefill_cases imports paged_attention_cases by name)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "layers" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # its dataclasses look their module up while it executes
    spec.loader.exec_module(mod)
    return mod


base = _load("paged_attention_cases")
cases = _load("prefill_cases")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PS = 16
KV_HEADS = 2
# (context after the step, new rows): one token at 0, a whole prompt, chunks after cached pages
# (mid-page starts), a decode row, a long chunk, a sequence without new rows
LENS = [(1, 1), (77, 77), (300, 45), (1000, 513), (2100, 1), (3001, 1200), (64, 0)]
SINKS = [True, False, True, True, False, True, True]

# Timing shape: Llama-3-8B-like attention, one 2048-row prefill chunk.
T_KV_HEADS, T_GQA, T_D, T_NEW = 8, 4, 128, 2048
T_CONTEXTS = (2048, 8192, 32768)
T_FORMATS = ("bf16", "int8", "k8v4", "int4")
# Block shapes the sweep times (BLOCK_M, BLOCK_N, warps, stages); the first is the default.
SWEEP = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 8, 3),
         (64, 32, 4, 4)]
WARMUP, REPEATS = 3, 10
H200_BF16_TFLOPS = 989.0  # H200 SXM dense bf16 tensor-core peak (spec sheet), for the printed fraction


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_kernel_matches_reference_cuda(name: str, gqa: int, head_dim: int) -> None:
    from kvtier.kernels import paged_attention as pa
    dtype = base.compute_dtype(name, torch.bfloat16)
    case = cases.make_prefill_case(name, KV_HEADS, gqa, PS, head_dim, LENS, SINKS, dtype, "cuda",
                                   seed=gqa * 1000 + head_dim)
    for use_sink in (False, True):
        cases.check_prefill(pa, case, use_sink)


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4", "int4"])
def test_alt_pages_match_reference_cuda(name: str) -> None:
    """Negative block-table ids read a staging tensor (AltPages), as prefill over host pages does."""
    from kvtier.kernels import paged_attention as pa
    dtype = base.compute_dtype(name, torch.bfloat16)
    case = cases.make_prefill_case(name, KV_HEADS, 4, PS, 128, LENS, SINKS, dtype, "cuda", seed=91)
    b, alt = base.with_alt_pages(case.base, seed=92)
    case = cases.PrefillCase(b, case.q, case.query_start_loc)
    for use_sink in (False, True):
        cases.check_prefill(pa, case, use_sink, alt=alt)


@pytest.mark.parametrize("name", ["bf16", "k8v4", "int4"])
def test_head_dim_256_matches_reference_cuda(name: str) -> None:
    from kvtier.kernels import paged_attention as pa
    case = cases.make_prefill_case(name, KV_HEADS, 4, PS, 256, LENS, SINKS, torch.bfloat16, "cuda", seed=256)
    cases.check_prefill(pa, case, use_sink=True)


@pytest.mark.parametrize("blocks", SWEEP)
def test_swept_blocks_match_reference_cuda(blocks: tuple[int, int, int, int]) -> None:
    from kvtier.kernels import paged_attention as pa
    for name in ("bf16", "k8v4"):
        case = cases.make_prefill_case(name, KV_HEADS, 4, PS, 128, LENS, SINKS, torch.bfloat16, "cuda", seed=7)
        cases.check_prefill(pa, case, use_sink=True, blocks=blocks)


def _random_pages(name: str, num_pages: int) -> dict[str, torch.Tensor]:
    return base.random_pages(name, num_pages, T_KV_HEADS, PS, T_D)


def _median_ms(fn: Callable[[], object]) -> float:
    return base.median_us(fn, WARMUP, REPEATS) / 1e3


def _causal_flops(ctx: int, n_new: int, heads: int, head_dim: int) -> float:
    """QK^T and PV multiply-adds of causal rows at positions ctx - n_new .. ctx - 1 (2 flops each)."""
    keys = n_new * (ctx - n_new) + n_new * (n_new + 1) / 2  # sum over rows of (position + 1)
    return 4.0 * keys * heads * head_dim


class _Setup:
    """One sequence of `ctx` tokens on scattered pages of a `name` layer, T_NEW new rows."""

    def __init__(self, name: str, ctx: int):
        self.fmt = make_format(name)
        pages = ctx // PS
        self.st = _random_pages(name, pages)
        self.table = torch.randperm(pages, device="cuda").to(torch.int32)[None, :]
        self.lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        self.qsl = torch.tensor([0, T_NEW], dtype=torch.int32, device="cuda")
        self.q = torch.randn(T_NEW, T_KV_HEADS * T_GQA, T_D, device="cuda", dtype=torch.bfloat16)
        self.sink = None
        if self.fmt.quantized:  # as the engine: the first page has an exact sink row
            sk = torch.randn(1, T_KV_HEADS, T_D, device="cuda", dtype=torch.bfloat16)
            slot = torch.full((pages,), -1, dtype=torch.long, device="cuda")
            slot[self.table[0, 0].long()] = 0
            self.sink = (sk, sk.clone(), slot)

    def kernel(self, blocks: tuple[int, int, int, int] | None = None) -> torch.Tensor:
        from kvtier.kernels import paged_attention as pa
        return pa.paged_prefill(self.q, self.st, self.fmt, self.table, self.lens, self.qsl, T_D ** -0.5,
                                sink=self.sink, max_new=T_NEW, blocks=blocks)


def test_print_prefill_tflops() -> None:
    """Kernel per format vs SDPA flash on dense K/V vs gather + SDPA; run with -s."""
    hq = T_KV_HEADS * T_GQA
    print(f"\npaged_prefill  {T_NEW} new rows, B=1, Hkv={T_KV_HEADS} Hq={hq} D={T_D} page={PS} bf16")
    print(f"{'context':>7} {'what':>14} {'ms':>8} {'TFLOP/s':>8} {'of peak':>7}")
    for ctx in T_CONTEXTS:
        flops = _causal_flops(ctx, T_NEW, hq, T_D)

        def row(what: str, ms: float) -> None:
            tf = flops / (ms * 1e-3) / 1e12
            print(f"{ctx:>7} {what:>14} {ms:>8.3f} {tf:>8.1f} {tf / H200_BF16_TFLOPS:>7.0%}")

        for name in T_FORMATS:
            s = _Setup(name, ctx)
            row(f"kernel {name}", _median_ms(s.kernel))
            if name == "bf16":
                kp = s.st["k"].index_select(0, s.table[0].long())  # [P, Hkv, ps, D]
                vp = s.st["v"].index_select(0, s.table[0].long())
                qq = s.q.transpose(0, 1)[None]  # [1, Hq, n, D]

                def dense(k_pages: torch.Tensor) -> torch.Tensor:  # [P, Hkv, ps, D] -> [1, Hq, ctx, D]
                    kk = k_pages.permute(1, 0, 2, 3).reshape(T_KV_HEADS, ctx, T_D)
                    return kk.repeat_interleave(T_GQA, dim=0)[None]

                kd, vd = dense(kp), dense(vp)
                mask = causal_lower_right(T_NEW, ctx)
                row("sdpa dense", _median_ms(lambda: F.scaled_dot_product_attention(
                    qq, kd, vd, attn_mask=mask, scale=T_D ** -0.5)))
                idx = s.table[0].long()
                row("gather+sdpa", _median_ms(lambda: F.scaled_dot_product_attention(
                    qq, dense(s.st["k"].index_select(0, idx)), dense(s.st["v"].index_select(0, idx)),
                    attn_mask=mask, scale=T_D ** -0.5)))
            del s
            torch.cuda.empty_cache()


def test_print_prefill_block_sweep() -> None:
    """TFLOP/s of the kernel per KV format and block shape (PREFILL_BLOCKS tuning); run with -s."""
    hq = T_KV_HEADS * T_GQA
    print(f"\npaged_prefill block sweep  {T_NEW} new rows, Hq={hq} Hkv={T_KV_HEADS} D={T_D}")
    print(f"{'format':>6} {'context':>7} {'BM,BN,warps,stages':>20} {'ms':>8} {'TFLOP/s':>8}")
    for name in ("bf16", "int8", "k8v4", "int4"):
        for ctx in (8192, 32768):
            s = _Setup(name, ctx)
            flops = _causal_flops(ctx, T_NEW, hq, T_D)
            for blocks in SWEEP:
                try:
                    ms = _median_ms(lambda: s.kernel(blocks))
                except Exception as e:  # noqa: BLE001 (a shape out of shared memory: report, go on)
                    print(f"{name:>6} {ctx:>7} {str(blocks):>20} failed: {type(e).__name__}: {str(e)[:60]}")
                    continue
                print(f"{name:>6} {ctx:>7} {str(blocks):>20} {ms:>8.3f} {flops / (ms * 1e-3) / 1e12:>8.1f}")
            del s
            torch.cuda.empty_cache()
