"""Shared checks of the paged prefill kernel (kvtier/kernels/paged_attention.py) against its reference.

Used by tests/layers/test_paged_prefill_interp.py (TRITON_INTERPRET=1 on CPU, tiny sizes;
run as a script) and tests/gpu/test_paged_prefill.py (CUDA). The pools, tables and sinks
are paged_attention_cases' (real rows written through PagePool.write in every slot, so the
new rows' K/V are already stored, as the engine writes before it attends); q is T packed rows.

A batch mixes (context after the step, new rows):

    (9, 9)    a first chunk from position 0 over several pages
    (13, 6)   a chunk starting mid-page after a cached prefix
    (1, 1)    one token at position 0
    (40, 23)  a long chunk: several key tiles, several query tiles
    (22, 1)   a decode row inside a prefill batch
    (5, 0)    no new rows (a padding sequence)
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from paged_attention_cases import REL_TOLERANCE, TOLERANCE, Case, interp_dtype, make_case, with_alt_pages

from kvtier.kv.formats import FORMAT_NAMES


@dataclass
class PrefillCase:
    """Inputs of one paged_prefill call (the pool, tables and sinks of a decode Case)."""

    base: Case
    q: torch.Tensor  # [T, Hq, D] packed new rows
    query_start_loc: torch.Tensor  # [B+1] int32


def make_prefill_case(name: str, kv_heads: int, gqa: int, page_size: int, head_dim: int,
                      lens: list[tuple[int, int]], with_sink: list[bool], dtype: torch.dtype, device: str,
                      seed: int) -> PrefillCase:
    """lens: (context after the step, new rows) per sequence; new rows <= context."""
    base = make_case(name, kv_heads, gqa, page_size, head_dim, [c for c, _ in lens], with_sink, dtype, device, seed)
    qsl = [0]
    for _, n in lens:
        qsl.append(qsl[-1] + n)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(qsl[-1], kv_heads * gqa, head_dim, generator=g).to(device, dtype)
    return PrefillCase(base, q, torch.tensor(qsl, dtype=torch.int32, device=device))


def check_prefill(pa: ModuleType, case: PrefillCase, use_sink: bool,
                  blocks: tuple[int, int, int, int] | None = None, alt: object | None = None) -> None:
    """Kernel == reference (to the compute dtype's tolerance). max_new is given with sinks and
    left to the kernel (a host sync) without, so both launch paths run."""
    c = case.base
    sink = c.sink if use_sink else None
    fmt = c.pool.fmt
    args = (case.q, c.st, fmt, c.block_table, c.seq_lens, case.query_start_loc, c.scale)
    max_new = int((case.query_start_loc[1:] - case.query_start_loc[:-1]).max()) if use_sink else None
    got = pa.paged_prefill(*args, sink=sink, max_new=max_new, blocks=blocks, alt=alt)
    want = pa.paged_prefill_reference(*args, sink=sink, alt=alt)
    assert got.shape == case.q.shape and got.dtype == case.q.dtype
    tol = TOLERANCE[case.q.dtype]
    err = (got.float() - want.float()).abs().max().item()
    where = f"{c.fmt_name} sink={use_sink} blocks={blocks}"
    assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), f"{where}: max |kernel - ref| = {err:.3g}"
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert rel < REL_TOLERANCE[case.q.dtype], f"{where}: relative error {rel:.3g}"
    if use_sink and alt is None and bool((c.sink[2][c.block_table[:, 0].long()] >= 0).any()):
        plain = pa.paged_prefill_reference(*args)
        assert not torch.allclose(plain, want, rtol=tol, atol=tol), "the sink rows changed nothing: vacuous test"


# (context, new rows) per sequence: see the module docstring
LENS = [(9, 9), (13, 6), (1, 1), (40, 23), (22, 1), (5, 0)]
SINKS = [True, False, True, True, False, True]
# Small blocks (16 rows x 16 keys; warps and stages mean nothing to the interpreter) so the tiny
# cases cross several query and key tiles, full and diagonal; None: the kernel's own (fp32: 32 x 32).
INTERP_BLOCKS = (16, 16, 4, 2)
# (format, gqa, page_size, head_dim, quantized-format compute dtype, blocks)
INTERP_CASES = [(name, gqa, 4, 16, torch.float32, INTERP_BLOCKS) for name in FORMAT_NAMES for gqa in (1, 2, 4)]
INTERP_CASES += [
    ("int4", 2, 4, 64, torch.float32, INTERP_BLOCKS),  # several int4 scale groups a row
    ("k8v4", 1, 8, 32, torch.float32, None),  # default blocks
    ("int8", 4, 2, 16, torch.float16, (32, 16, 4, 2)),  # fp16 dots, 8 rows x 4 heads a tile
    ("fp8", 2, 16, 16, torch.float16, INTERP_BLOCKS),  # a page as long as a key tile
    ("k8v4", 4, 16, 32, torch.float16, (128, 64, 8, 3)),  # a Hopper 16-bit shape: 32 rows x 4 heads a tile
    ("int4", 2, 4, 32, torch.float16, INTERP_BLOCKS),  # word-wise int4 -> fp16 decode
]


ALT_CASES = [("fp32", 2, 4, 16, torch.float32, INTERP_BLOCKS), ("k8v4", 1, 4, 32, torch.float16, INTERP_BLOCKS),
             ("int4", 2, 4, 64, torch.float32, INTERP_BLOCKS)]


def main() -> None:
    """Run every interpreter case (TRITON_INTERPRET=1 must be set before triton is imported)."""
    import kvtier.kernels.paged_attention as pa
    failures = []
    for i, (name, gqa, ps, hd, qdt, blocks) in enumerate(INTERP_CASES):
        kv_heads = 1 if gqa == 4 else 2  # 4 query heads at most: the interpreter runs programs one by one
        case = make_prefill_case(name, kv_heads, gqa, ps, hd, LENS, SINKS, interp_dtype(name, qdt), "cpu", seed=i)
        for use_sink in (False, True):
            try:
                check_prefill(pa, case, use_sink, blocks)
            except AssertionError as e:
                failures.append(f"{name} gqa={gqa} ps={ps} D={hd}: {e}")
    for i, (name, gqa, ps, hd, qdt, blocks) in enumerate(ALT_CASES):  # negative ids: AltPages (staged host pages)
        case = make_prefill_case(name, 2, gqa, ps, hd, LENS, SINKS, interp_dtype(name, qdt), "cpu", seed=50 + i)
        base, alt = with_alt_pages(case.base, seed=60 + i)
        case = PrefillCase(base, case.q, case.query_start_loc)
        for use_sink in (False, True):
            try:
                check_prefill(pa, case, use_sink, blocks, alt=alt)
            except AssertionError as e:
                failures.append(f"{name} alt gqa={gqa} ps={ps} D={hd}: {e}")
    print("\n".join(failures) if failures else "ALL OK")


if __name__ == "__main__":
    main()
