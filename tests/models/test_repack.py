"""GGUF blocks repacked into QuantWeight dequantize to what gguf.quants.dequantize gives for the same bytes.

Exact for the formats whose headers are plain fp16 (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1); the
K-quants' d * sc rounds once to fp16, so there the error is bounded by half an fp16 ulp of the
group's scale times the code, plus half an ulp of its min.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from kvtier.layers.qlinear import cat_rows
from kvtier.models.loading.repack import REPACKS, permute_rows, repack

EXACT = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1]
K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of each format's fp16 header fields inside one block.
F16_OFFSETS = {Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0], Q.Q5_0: [0], Q.Q5_1: [0, 2],
               Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}
FP16_HALF_ULP = 2.0 ** -11  # relative rounding of a normal fp16
FP16_MIN_SUBNORMAL = 2.0 ** -24


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes [rows, row_bytes] of `qtype` whose fp16 headers are finite, of both signs."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    for off in F16_OFFSETS[qtype]:
        halves = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        halves[0, 0] = 0  # an all-zero scale must work too
        raw[..., off:off + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def _check_bound(qw, got: np.ndarray, want: np.ndarray) -> float:
    """Max |got - want| for a K-quant; asserts it is within the fp16 rounding of scale and min."""
    n, k = qw.shape
    code = qw.codes().double().view(n, -1, qw.group)
    scale = qw.scales.double()[..., None]
    mins = qw.mins.double()[..., None] if qw.mins is not None else torch.zeros_like(scale)
    half_ulp = lambda v: torch.clamp(v.abs() * FP16_HALF_ULP, min=FP16_MIN_SUBNORMAL / 2)  # noqa: E731
    bound = (code.abs() * half_ulp(scale) + half_ulp(mins)) * (1 + 1e-6) + 1e-12
    err = torch.from_numpy(np.abs(got.astype(np.float64) - want.astype(np.float64))).view(n, -1, qw.group)
    assert bool((err <= bound).all()), float((err - bound).max())
    return float(err.max())


@pytest.mark.parametrize("qtype", EXACT + K_QUANTS)
def test_repack_matches_gguf_dequantize(qtype: Q) -> None:
    rows, cols = 96, 512
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    qw = repack(raw, qtype, rows, cols)
    bits, group, _ = REPACKS[qtype]
    assert (qw.bits, qw.group, qw.shape) == (bits, group, (rows, cols))
    got = qw.dequantize(torch.float32).numpy()
    want = gguf_quants.dequantize(raw, qtype).reshape(rows, cols)
    if qtype in EXACT:
        np.testing.assert_array_equal(got, want)
    else:
        err = _check_bound(qw, got, want)
        print(f"{qtype.name}: max |repack - gguf| = {err:.3g} (max |w| {np.abs(want).max():.3g})")


def test_repack_in_chunks_equals_whole(monkeypatch) -> None:
    """Row chunking (CHUNK_BYTES) is invisible in the result."""
    import kvtier.models.loading.repack as rp

    raw = random_blocks(Q.Q4_K, 40, 512, seed=7)
    whole = repack(raw, Q.Q4_K, 40, 512)
    monkeypatch.setattr(rp, "CHUNK_BYTES", 3 * raw.shape[1])  # 3 rows a step, last step partial
    parts = repack(raw, Q.Q4_K, 40, 512)
    for a, b in ((whole.qweight, parts.qweight), (whole.scales, parts.scales), (whole.mins, parts.mins)):
        assert torch.equal(a, b)


def test_permute_and_cat_rows() -> None:
    a = repack(random_blocks(Q.Q4_1, 8, 64, seed=1), Q.Q4_1, 8, 64)
    b = repack(random_blocks(Q.Q4_0, 4, 64, seed=2), Q.Q4_0, 4, 64)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(permute_rows(a, perm).dequantize(), a.dequantize()[perm])
    both = cat_rows([a, b])
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    c = repack(random_blocks(Q.Q8_0, 4, 64, seed=3), Q.Q8_0, 4, 64)
    with pytest.raises(ValueError):
        cat_rows([a, c])


REAL_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K, Q.Q8_0)


def _real_files(smollm2_path: Path) -> list[Path]:
    from kvtier.config import default_cache_dir

    cached = sorted(Path(default_cache_dir()).glob("*.gguf"))
    return [smollm2_path] + cached


def test_repack_real_tensors(smollm2_path: Path) -> None:
    """Every quant type in the model files on this machine: one real tensor each, against gguf."""
    from kvtier.models.loading.gguf import read_gguf_header

    seen: set[Q] = set()
    for path in _real_files(smollm2_path):
        header = read_gguf_header(path)
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for t in header.tensors:
            if t.qtype not in REAL_TYPES or t.qtype in seen or len(t.shape) != 2:
                continue
            seen.add(t.qtype)
            n, k = t.torch_shape
            n = min(n, 512)  # the first rows are enough to cover every block layout
            raw = np.asarray(data[t.offset:t.offset + t.nbytes]).reshape(t.torch_shape[0], -1)[:n]
            qw = repack(raw, t.qtype, n, k)
            got, want = qw.dequantize().numpy(), gguf_quants.dequantize(raw, t.qtype)
            if t.qtype in EXACT:
                np.testing.assert_array_equal(got, want, err_msg=f"{path.name} {t.name}")
            else:
                err = _check_bound(qw, got, want)
                print(f"{path.name} {t.name} {t.qtype.name}: max err {err:.3g}, "
                      f"relative to max |w| {err / np.abs(want).max():.3g}")
        del data
    assert Q.Q4_1 in seen and Q.Q8_0 in seen  # SmolLM2's own types at least
