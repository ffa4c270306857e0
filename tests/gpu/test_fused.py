"""Fused Triton kernels (kvtier/kernels/fused.py) on CUDA at model sizes (skipped without a GPU).

Kernel == PyTorch reference (bit-exact for silu_mul and rotary alone; norms up to rare
rounding flips from the reduction order), no host synchronisation, CUDA-graph replay ==
eager, and a random bf16 Qwen3 / Llama decoder gives the same logits with the fused kernels
on and off.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.config import ModelSpec  # noqa: E402
from kvtier.kernels import fused  # noqa: E402
from kvtier.kv.formats import PlainFormat  # noqa: E402
from kvtier.kv.pool import PagePool  # noqa: E402
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention  # noqa: E402
from kvtier.models.decoder import Decoder  # noqa: E402
from kvtier.models.registry import expected_shapes  # noqa: E402
from tests.layers import fused_cases as cases  # noqa: E402

CUDA = "cuda"
ROWS = (1, 7, 300)  # decode, small batch, a prefill chunk
# Qwen3-8B (H=4096, 32/8 heads of 128, I=12288), Qwen2-0.5B (896, 14/2 of 64, 4864), wider rows.
HIDDEN = (896, 4096, 5120, 8192)
HEADS = ((32, 8, 128), (32, 32, 128), (64, 8, 128), (14, 2, 64))
INTER = (4864, 12288, 30000)
QWEN3_8B = {"h": 4096, "hq": 32, "hkv": 8, "d": 128, "inter": 12288}
# Decoder on vs off: both bf16, differing only in rare rounding flips of the norms.
BF16_REL_TOL = 2e-2
PAGE_SIZE = 16
WEIGHT_STD = 0.05


@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("t", ROWS)
def test_rms_norm(dtype: torch.dtype, h: int, t: int) -> None:
    cases.check_rms_norm(fused, t, h, dtype, CUDA, strided=t % 2 == 1)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "rotary_only"])
@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("hq,hkv,d", HEADS)
@pytest.mark.parametrize("t", ROWS)
def test_qk_norm_rope(qk_norm: bool, dtype: torch.dtype, hq: int, hkv: int, d: int, t: int) -> None:
    cases.check_qk_norm_rope(fused, t, hq, hkv, d, dtype, CUDA, qk_norm, exact=True)


@pytest.mark.parametrize("dtype", cases.DTYPES, ids=str)
@pytest.mark.parametrize("inter", INTER)
@pytest.mark.parametrize("t", ROWS)
def test_silu_mul_bit_exact(dtype: torch.dtype, inter: int, t: int) -> None:
    cases.check_silu_mul(fused, t, inter, dtype, CUDA, strided=t % 2 == 1, exact=True)


def test_empty_batch() -> None:
    cases.check_empty(fused, CUDA)


def _qwen3_step(t: int, dtype: torch.dtype = torch.bfloat16) -> tuple[list[torch.Tensor], Callable]:
    """Static inputs of one Qwen3-8B-sized layer's fused ops, and a function running all three."""
    s = QWEN3_8B
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, s["h"], generator=g).to(CUDA, dtype)
    qkv = torch.randn(t, (s["hq"] + 2 * s["hkv"]) * s["d"], generator=g).to(CUDA, dtype)
    gu = torch.randn(t, 2 * s["inter"], generator=g).to(CUDA, dtype)
    w = (1 + 0.3 * torch.randn(s["h"], generator=g)).to(CUDA, dtype)
    qw, kw = ((1 + 0.3 * torch.randn(s["d"], generator=g)).to(CUDA, dtype) for _ in range(2))
    cos, sin = cases.rotary_tables(s["d"], t, dtype, CUDA, g)

    def run() -> list[torch.Tensor]:
        q, k = fused.qk_norm_rope(qkv, s["hq"], s["hkv"], s["d"], cos, sin, qw, kw, cases.EPS)
        return [fused.rms_norm(x, w, cases.EPS), q, k, fused.silu_mul(gu)]

    return [x, qkv, gu], run


def test_no_host_sync() -> None:
    _, run = _qwen3_step(5)
    run()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("t", [1, 8])
def test_cuda_graph_replay_equals_eager(t: int) -> None:
    inputs, run = _qwen3_step(t)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm up off the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    g = torch.Generator().manual_seed(100 + t)
    for _ in range(2):
        for x in inputs:  # new values in the captured buffers
            x.copy_(torch.randn(x.shape, generator=g).to(CUDA, x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, run()):
            assert torch.equal(got, want)


# ---------------------------------------------------------------- decoder level

def _spec(arch: str) -> ModelSpec:
    """A small random model with Qwen3-8B's head layout (GQA 4, head_dim 128)."""
    return ModelSpec(arch=arch, vocab_size=512, hidden_size=512, intermediate_size=1408, num_layers=3,
                     num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=arch == "qwen3",
                     max_position_embeddings=256)


def _random_decoder(spec: ModelSpec) -> Decoder:
    g = torch.Generator().manual_seed(len(spec.arch))
    tensors = {n: (1 + 0.3 * torch.randn(s, generator=g)) if n.endswith("norm.weight")
               else WEIGHT_STD * torch.randn(s, generator=g) for n, s in expected_shapes(spec).items()}
    return Decoder.from_tensors(spec, tensors, torch.bfloat16, CUDA)


def _run_sequence(model: Decoder, ids: list[int], n_prefill: int) -> torch.Tensor:
    """Prefill ids[:n_prefill], then decode the rest one token per step -> last-row logits [steps, V]."""
    layers, kv_heads, head_dim = model.kv_shape
    n_pages = (len(ids) + PAGE_SIZE - 1) // PAGE_SIZE
    pool = PagePool(PlainFormat(torch.bfloat16), layers, n_pages, kv_heads, PAGE_SIZE, head_dim, CUDA,
                    compute_dtype=torch.bfloat16)
    backend = DensePagedAttention(pool, scale=head_dim ** -0.5)
    out = []
    for start, end in [(0, n_prefill)] + [(i, i + 1) for i in range(n_prefill, len(ids))]:
        meta = AttentionMetadata(query_start_loc=[0, end - start], seq_lens=[end],
                                 page_tables=[list(range(n_pages))],
                                 slot_mapping=torch.arange(start, end, device=CUDA),
                                 logits_indices=torch.tensor([end - start - 1], device=CUDA))
        out.append(model(torch.tensor(ids[start:end], device=CUDA), torch.arange(start, end, device=CUDA),
                         meta, backend))
    return torch.cat(out)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts calls of the three fused launchers (the layers look them up on the module)."""
    calls = {"rms_norm": 0, "qk_norm_rope": 0, "silu_mul": 0}
    for name in calls:
        def counted(*args, _fn=getattr(fused, name), _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_name] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(fused, name, counted)
    yield calls


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_decoder_logits_fused_on_equal_off(arch: str, kernel_calls: dict[str, int]) -> None:
    model = _random_decoder(_spec(arch))
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with fused.disabled():
        off = _run_sequence(model, ids, n_prefill=33)
    assert sum(kernel_calls.values()) == 0
    on = _run_sequence(model, ids, n_prefill=33)
    assert all(n > 0 for n in kernel_calls.values()), kernel_calls
    err = float((on.float() - off.float()).abs().max() / off.float().abs().max())
    assert err <= BF16_REL_TOL, f"fused vs plain logits: rel err {err}"
