"""KV formats and PagePool: round-trip error bounds, layout, batched page copies."""

from __future__ import annotations

import pytest
import torch

from kvtier.kv.formats import (FORMAT_NAMES, INT4_GROUP, INT4_MAX, INT8_MAX, Int4Codec, KVFormat, PlainCodec,
                               hadamard, make_format)
from kvtier.kv.manager import CacheManager
from kvtier.kv.pool import PagePool

H, S, D = 2, 4, 64  # kv heads, page size, head dim of the test pools
# Relative Frobenius error of K/V on N(0, 1) data: well above what each format
# measures (fp8 ~0.025, int8 ~0.006, int4 ~0.10) yet far below a broken codec (~1).
REL_ERR = {"fp32": 0.0, "fp16": 1e-3, "bf16": 5e-3, "fp8": 0.04, "int8": 0.01, "k8v4": 0.12, "int4": 0.12}
BYTES_PER_TOKEN = {  # K+V of one token, one layer, H=2, D=64 (scales are fp16)
    "fp32": 1024, "bf16": 512, "fp16": 512, "fp8": 2 * 2 * (64 + 2), "int8": 2 * 2 * (64 + 2),
    "k8v4": 2 * (64 + 2) + 2 * (32 + 2 * 2), "int4": 2 * 2 * (32 + 2 * 2)}


def rows_of(k_pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[P, H, S, D] pages -> [T, H, D] rows at flat slots."""
    p, h, s, d = k_pages.shape
    return k_pages.permute(0, 2, 1, 3).reshape(p * s, h, d)[slots]


def write_random(pool: PagePool, layer: int, n: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(pool.num_pages * pool.page_size, generator=g)[:n]
    k = torch.randn(n, pool.kv_heads, pool.head_dim, generator=g) * scale
    v = torch.randn(n, pool.kv_heads, pool.head_dim, generator=g) * scale + 0.5
    pool.write(layer, slots, k, v)
    return slots, k, v


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_round_trip_error_and_layout(name: str) -> None:
    fmt = make_format(name)
    assert fmt.name == name
    pool = PagePool(fmt, num_layers=2, num_pages=8, kv_heads=H, page_size=S, head_dim=D, device="cpu")
    pool.check_integrity()
    assert fmt.bytes_per_token(H, D) == BYTES_PER_TOKEN[name]
    assert pool.bytes_per_page() == BYTES_PER_TOKEN[name] * S * 2
    slots, k, v = write_random(pool, 1, 20, seed=1, scale=3.0)
    kp, vp = pool.read(1, torch.arange(8))
    assert kp.shape == (8, H, S, D) and kp.dtype == torch.float32
    if fmt.smooth_k:  # K comes back minus the layer's shift, the median of the first write
        assert torch.equal(pool.k_shift[1], k.median(dim=0).values) and pool.k_shift[0] is None
        k = k - pool.k_shift[1]
    for x, y in ((k, rows_of(kp, slots)), (v, rows_of(vp, slots))):
        rel = ((x - y).norm() / x.norm()).item()
        assert rel <= REL_ERR[name] + 1e-7, f"{name}: relative error {rel}"
        if name != "fp32":
            assert rel > 0  # quantization really happened
    other = pool.read(0, torch.arange(8))[0]
    assert not other.any()  # layer 0 untouched


def test_error_bounds_per_element() -> None:
    """Each code is within half a step of its input (step = the stored scale)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(50, H, D, generator=g) * torch.logspace(-3, 2, 50)[:, None, None]
    slots = torch.arange(50)
    for name in ("int8", "int4", "fp8"):
        codec = make_format(name).k_codec
        parts = codec.encode(x)
        y = codec.decode(parts, torch.float32)
        scale = parts["_scale"].float()  # [T, H, n_scales]
        if name == "int4":
            step = scale.repeat_interleave(INT4_GROUP, dim=-1)
            assert (x.abs() <= step * INT4_MAX * 1.001).all()
            assert ((x - y).abs() <= 0.5 * step * 1.0001 + 1e-9).all()
        elif name == "int8":
            assert (x.abs() <= scale * INT8_MAX * 1.001).all()
            assert ((x - y).abs() <= 0.5 * scale * 1.0001 + 1e-9).all()
        else:  # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative; subnormal step 2^-9 * scale
            assert ((x - y).abs() <= x.abs() / 16 + scale * 2.0 ** -9).all()


def test_hadamard_is_orthonormal_and_its_own_inverse() -> None:
    for d in (16, 64, 80, 128):
        h = hadamard(d)
        assert torch.allclose(h @ h, torch.eye(d), atol=1e-6) and torch.equal(h, h.T)


def test_rotation_round_trip_and_outlier_gain() -> None:
    """A rotated format returns the rows themselves (not rotated ones), with less error on
    rows that have outlier channels than the same codecs unrotated."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, H, D, generator=g)
    x[..., 3] += 40.0  # one outlier channel, as real K has
    slots = torch.arange(40)
    errs = {}
    for rot in (False, True):
        fmt = KVFormat(Int4Codec(), Int4Codec(), rotate_k=rot, rotate_v=rot)
        st = fmt.allocate(10, H, S, D, torch.device("cpu"))
        fmt.store(st, slots, x, x)
        y = rows_of(fmt.load(st, torch.arange(10), torch.float32)[0], slots)
        errs[rot] = ((y - x).norm() / x.norm()).item()
    assert errs[True] < 0.5 * errs[False] and errs[True] < 0.07


def test_k_smoothing_leaves_attention_unchanged() -> None:
    """Attention over shifted K (smooth_k) equals attention over K: softmax is shift-invariant."""
    from kvtier.layers.attention import AttentionMetadata, DensePagedAttention

    g = torch.Generator().manual_seed(6)
    n, hq = 10, 4
    q = torch.randn(n, hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(n, H, D, generator=g, dtype=torch.float64) + 30 * torch.randn(H, D, generator=g,
                                                                                 dtype=torch.float64)
    v = torch.randn(n, H, D, generator=g, dtype=torch.float64)
    meta = AttentionMetadata(query_start_loc=[0, n], seq_lens=[n], page_tables=[[0, 1, 2]],
                             slot_mapping=torch.arange(n), logits_indices=torch.arange(n))
    outs = []
    for smooth in (False, True):
        fmt = KVFormat(PlainCodec(torch.float64), PlainCodec(torch.float64), smooth_k=smooth)
        pool = PagePool(fmt, 1, 3, H, S, D, "cpu", compute_dtype=torch.float64)
        outs.append(DensePagedAttention(pool, scale=D ** -0.5).forward(0, q, k, v, meta))
        assert (pool.k_shift[0] is not None) == smooth
    assert torch.allclose(outs[0], outs[1], atol=1e-9, rtol=0)


def test_zero_rows_and_bf16_inputs() -> None:
    for name in ("fp8", "int8", "k8v4", "int4"):
        fmt = make_format(name)
        st = fmt.allocate(2, H, S, D, torch.device("cpu"))
        x = torch.zeros(3, H, D, dtype=torch.bfloat16)
        x[1] = torch.randn(H, D).bfloat16()
        fmt.store(st, torch.tensor([0, 1, 5]), x, x)
        k, v = fmt.load(st, torch.tensor([0, 1]), torch.bfloat16)
        assert k.dtype == torch.bfloat16 and torch.isfinite(k.float()).all()
        assert not rows_of(k, torch.tensor([0, 5])).any()


def test_make_format_and_pool_validation() -> None:
    with pytest.raises(ValueError, match="unknown KV format"):
        make_format("int3")
    with pytest.raises(ValueError, match="head_dim"):
        make_format("int4").layout(H, S, 31)
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(make_format("bf16"), 1, 0, H, S, D, "cpu")
    pool = PagePool(make_format("int8"), 1, 4, H, S, D, "cpu")
    pool.layers[0]["k_scale"] = torch.zeros(4, H, S, 2)
    with pytest.raises(ValueError, match="k_scale"):
        pool.check_integrity()


@pytest.mark.parametrize("name", ["bf16", "int8", "k8v4", "int4"])
def test_copy_to_between_pools_is_exact(name: str) -> None:
    fmt = make_format(name)
    a = PagePool(fmt, 2, 6, H, S, D, "cpu")
    b = PagePool(fmt, 2, 9, H, S, D, "cpu")
    for layer in range(2):
        write_random(a, layer, 24, seed=10 + layer)
    src, dst = [5, 0, 3], [8, 2, 4]
    a.copy_to(b, src, dst)
    for layer in range(2):
        for name, t in a.layers[layer].items():  # the stored codes move bit for bit
            assert torch.equal(t[src], b.layers[layer][name][dst])
        # decoded by the pool that wrote them (its K smoothing), wherever they sit
        for x, y in zip(a.read(layer, torch.tensor(src)), a.read_from(b, layer, torch.tensor(dst))):
            assert torch.equal(x, y)
        assert not b.read(layer, torch.tensor([0, 1, 3, 5, 6, 7]))[0].any()
    a.copy_to(a, [5], [1])  # within one pool
    assert torch.equal(a.read(1, torch.tensor([1]))[1], a.read(1, torch.tensor([5]))[1])
    a.copy_to(b, [], [])  # no-op
    with pytest.raises(ValueError, match="distinct"):
        a.copy_to(b, [0, 1], [3, 3])
    with pytest.raises(ValueError, match="range"):
        a.copy_to(b, [6], [0])
    with pytest.raises(ValueError, match="format"):
        a.copy_to(PagePool(make_format("fp16"), 2, 4, H, S, D, "cpu"), [0], [0])


def test_host_tier_with_real_pools_matches_gpu_only() -> None:
    """Manager transfers executed by copy_to: KV read back after a host round trip is bit-identical."""
    ps, fmt = S, make_format("k8v4")
    gpu = PagePool(fmt, 2, 3, H, ps, D, "cpu")
    host = PagePool(fmt, 2, 6, H, ps, D, "cpu")
    m = CacheManager(3, ps, num_host_pages=6)

    def run(xfer) -> None:
        for to_host, pairs in xfer.phases:  # the runner's order (engine/runner.py)
            (gpu.copy_to(host, *zip(*pairs)) if to_host else host.copy_to(gpu, *zip(*pairs)))

    def compute(sid: str, tokens: list[int], seed: int) -> dict[int, torch.Tensor]:
        cached = m.add_sequence(sid, tokens)
        assert m.ensure(sid, len(tokens))
        run(m.take_transfers())
        table = m.page_table(sid)
        slots = torch.tensor([table[i // ps] * ps + i % ps for i in range(cached, len(tokens))])
        g = torch.Generator().manual_seed(seed)
        for layer in range(2):
            kv = torch.randn(2, len(slots), H, D, generator=g)
            gpu.write(layer, slots, kv[0], kv[1])
        m.commit(sid, tokens)
        return {i: gpu.read(1, torch.tensor([table[i]]))[0].clone() for i in range(len(tokens) // ps)}

    conv = list(range(8))
    before = compute("a", conv + [100], seed=1)
    m.free("a")
    compute("b", [7] * 12, seed=2)  # pushes a's pages to host
    m.free("b")
    assert m.add_sequence("c", conv + [100]) == 8
    run(m.take_transfers())
    table = m.page_table("c")
    for i in range(2):
        assert torch.equal(gpu.read(1, torch.tensor([table[i]]))[0], before[i])
    assert m.stats()["swaps_in"] == 2
    m.check_integrity()
