"""Shared checks of the kv_quant Triton kernels against the PyTorch reference codecs.

Used by tests/kv/test_kv_kernels.py (TRITON_INTERPRET=1 on CPU, tiny sizes)
and tests/gpu/test_kv_kernels.py (CUDA, model sizes).
"""

from __future__ import annotations

import zlib
from types import ModuleType

import torch

from kvtier.kv.formats import make_format  # noqa: E402

QUANT_FORMATS = ("int8", "fp8", "k8v4", "int4")
FP8_MIN_NORMAL = 2.0 ** -6  # e4m3: smallest normal value
FP8_SUBNORMAL_STEP = 2.0 ** -9  # e4m3: spacing of the subnormals


def fp8_codes_match(ref: torch.Tensor, got: torch.Tensor, exact: bool) -> None:
    """Codes equal; the interpreter's fp32->e4m3 cast may halve a value rounding up to 2^n."""
    diff = ref != got
    if exact or not diff.any():
        assert not diff.any(), f"{int(diff.sum())} fp8 codes differ"
        return
    a = ref[diff].view(torch.float8_e4m3fn).float()
    b = got[diff].view(torch.float8_e4m3fn).float()
    # normal range: a value rounding up to 2^n comes out as 2^(n-1); subnormals (|x| < 2^-6):
    # the interpreter's cast may land one subnormal step (2^-9) off
    binade = (b * 2 == a) & (torch.log2(a.abs()).round() == torch.log2(a.abs()))
    subnormal = (a.abs() < FP8_MIN_NORMAL) & ((a - b).abs() <= FP8_SUBNORMAL_STEP)
    assert bool((binade | subnormal).all()), \
        f"fp8 codes differ beyond the interpreter's rounding quirks: {a.tolist()} vs {b.tolist()}"
    assert diff.float().mean() < 0.05


def check_store_load(kq: ModuleType, name: str, heads: int, page_size: int, head_dim: int,
                     num_pages: int, n_rows: int, device: str, dtype: torch.dtype, exact_fp8: bool) -> None:
    """Kernel store == reference store (codes and scales); kernel load == reference load."""
    fmt = make_format(name)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # hash() is salted per process
    slots = torch.randperm(num_pages * page_size, generator=g)[:n_rows].to(dev)
    base = torch.randn(n_rows, 3 * heads, head_dim, generator=g) * 2
    k = base[:, :heads].to(dev, dtype)  # a strided view, as sliced from a fused qkv projection
    v = (base[:, heads:2 * heads] + 0.3).to(dev, dtype)
    ref = fmt.allocate(num_pages, heads, page_size, head_dim, dev)
    got = fmt.allocate(num_pages, heads, page_size, head_dim, dev)
    for kv, codec, x in (("k", fmt.k_codec, k), ("v", fmt.v_codec, v)):
        for suffix, part in codec.encode(x).items():
            ref[kv + suffix][slots // page_size, :, slots % page_size] = part
    assert kq.store_rows(fmt, got, slots, k, v)
    for key in ref:
        if key in ("k", "v") and name in ("fp8",):
            fp8_codes_match(ref[key].cpu(), got[key].cpu(), exact_fp8)
        else:
            assert torch.equal(ref[key], got[key]), f"{name}: {key} differs"
    page_ids = torch.randperm(num_pages, generator=g)[:max(1, num_pages // 2)].to(dev)
    out_dtype = dtype if dtype != torch.float32 else torch.float32
    want = [codec.decode({sfx: ref[kv + sfx][page_ids] for sfx in codec.parts(head_dim)}, out_dtype)
            for kv, codec in (("k", fmt.k_codec), ("v", fmt.v_codec))]
    have = kq.load_pages(fmt, ref, page_ids, out_dtype)
    assert have is not None
    for w, h in zip(want, have):
        assert h.shape == (page_ids.numel(), heads, page_size, head_dim) and h.dtype == out_dtype
        assert torch.equal(w, h), f"{name}: load differs by {(w.float() - h.float()).abs().max()}"


def check_plain_store(kq: ModuleType, name: str, heads: int, page_size: int, head_dim: int, num_pages: int,
                      n_rows: int, device: str, cast: bool = True) -> None:
    """The plain-format store kernel == the reference indexing store (exact, strided input).

    cast: fp32 rows into the page dtype (the interpreter's fp32 -> bf16 cast does not round
    to nearest, so interpreter cases pass rows already in the page dtype)."""
    fmt = make_format(name)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(zlib.crc32(b"plain" + name.encode()))
    slots = torch.randperm(num_pages * page_size, generator=g)[:n_rows].to(dev)
    base = (torch.randn(n_rows, 3 * heads, head_dim, generator=g) * 2).to(dev)
    if not cast:
        base = base.to(fmt.k_codec.dtype)
    k, v = base[:, :heads], base[:, heads:2 * heads] + 0.5
    ref = fmt.allocate(num_pages, heads, page_size, head_dim, dev)
    got = fmt.allocate(num_pages, heads, page_size, head_dim, dev)
    for kv, x in (("k", k), ("v", v)):
        ref[kv][slots // page_size, :, slots % page_size] = x.to(ref[kv].dtype)
    assert kq.store_rows(fmt, got, slots, k, v)
    for key in ref:
        assert torch.equal(ref[key], got[key]), f"{name}: plain store of {key} differs"


def _check_pages(name: str, fmt, ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], head_dim: int) -> None:
    """Pages a kernel wrote (got) against the reference's (ref): plain formats exactly; codes
    within one quantization step, almost all exactly (the kernels' rotation rounds in other last
    bits than the reference's fp32 matmul, so a value on a rounding edge may take its neighbour)."""
    if not fmt.quantized:
        for key in ref:
            assert torch.equal(ref[key], got[key].cpu()), f"{name}: {key} pages differ"
        return
    for kv, codec in (("k", fmt.k_codec), ("v", fmt.v_codec)):
        part = {sfx: ref[kv + sfx] for sfx in codec.parts(head_dim)}
        want = codec.decode(part, torch.float32)
        have = codec.decode({sfx: got[kv + sfx].cpu() for sfx in codec.parts(head_dim)}, torch.float32)
        err = (want - have).abs()
        if name == "fp8":  # e4m3 steps are relative (1/8 of a binade); the interpreter's cast may
            # halve a value rounding up to 2^n (see fp8_codes_match): allow that on a few codes
            near = err <= want.abs() / 8 + 1e-3
            assert bool((err <= want.abs() / 2 + 1e-3).all()) and near.float().mean() >= 0.97, \
                f"fp8 {kv}: fused store differs beyond rounding"
        else:
            step = (want.abs().amax(-1, keepdim=True) / (7 if "4" in type(codec).__name__ else 127)).clamp_min(1e-6)
            assert bool((err <= step * 1.01).all()), \
                f"{name} {kv}: fused store off by {float((err / step).max()):.2f} steps"
        same = (ref[kv] == got[kv].cpu()).float().mean()
        assert same >= 0.97, f"{name} {kv}: only {float(same):.3f} of the codes equal the reference"


def check_rope_store(kt: ModuleType, name: str, heads: int, page_size: int, head_dim: int, num_pages: int,
                     n_rows: int, device: str, dtype: torch.dtype, gqa: int = 4, norm: bool = True) -> None:
    """kv_transform.rope_store (per-head norm + rotary of q and k, and K / V transformed, encoded and
    scattered, in one launch): q and k == the qk_norm_rope kernel it replaces (bar a rare one-step
    rounding flip), pages == the pool's reference write of its k and v (as _check_pages)."""
    from kvtier.kernels import fused
    from kvtier.kv.pool import PagePool
    from kvtier.layers.rotary import RotaryEmbedding
    fmt = make_format(name)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(zlib.crc32(b"rope" + name.encode()))
    hq = heads * gqa
    pool = PagePool(fmt, 1, num_pages, heads, page_size, head_dim, "cpu", compute_dtype=dtype)
    if fmt.smooth_k:
        calib = torch.randn(64, heads, head_dim, generator=g) * 3 + torch.randn(heads, head_dim, generator=g) * 5
        pool.calibrate(0, calib.to(dtype))
    slots = torch.randperm(num_pages * page_size, generator=g)[:n_rows]
    qkv = (torch.randn(n_rows, (hq + 2 * heads) * head_dim, generator=g) * 2 + 0.5).to(dtype)
    positions = torch.randint(0, 4096, (n_rows,), generator=g)
    cos, sin = RotaryEmbedding(head_dim, 10000.0, 4096, dtype=dtype, device="cpu")(positions, max_pos=4095)
    qw, kw = ((torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2)) if norm else (None, None)
    eps = 1e-6
    on = (lambda t: None if t is None else t.to(dev))
    rope = fused.QKRope(hq, heads, head_dim, cos.to(dev), sin.to(dev), on(qw), on(kw), eps)
    q_ref, k_ref = (t.cpu() for t in fused.qk_norm_rope(qkv.to(dev), hq, heads, head_dim, rope.cos, rope.sin_signed,
                                                         rope.q_weight, rope.k_weight, eps))
    v_ref = qkv[:, (hq + heads) * head_dim:].view(n_rows, heads, head_dim)
    got = fmt.allocate(num_pages, heads, page_size, head_dim, dev)
    smooth = (pool.k_shift[0].to(dev), pool.k_channel_scale[0].to(dev)) if fmt.smooth_k else None
    q, k, v = kt.rope_store(fmt, got, slots.to(dev), qkv.to(dev), rope, smooth)
    assert torch.equal(v.cpu(), v_ref)
    for nm, want, have in (("q", q_ref, q), ("k", k_ref, k)):
        # the head's sum of squares reduces in another order than qk_norm_rope's (rstd's last fp32
        # bit), which now and then flips a rounding to the compute dtype: about one step of the
        # head's values, rarely
        have = have.cpu()
        step = torch.finfo(want.dtype).eps * want.float().abs().amax(-1, keepdim=True)
        off = (want.float() - have.float()).abs()
        # (fp32: no rounding absorbs rstd's last bit, so most values move by a step or two)
        rare = want.dtype == torch.float32 or float((off > 0).float().mean()) < 0.02
        assert bool((off <= 4 * step).all()) and rare, \
            f"{name}: rope_store {nm} differs from qk_norm_rope by {float(off.max()):.3g}"
    pool.write(0, slots, k.cpu(), v_ref)  # the reference write of the rows rope_store computed
    ref = {key: t[0] for key, t in pool.storage.items()}
    _check_pages(name, fmt, ref, got, head_dim)


def check_fused_store(kt: ModuleType, name: str, heads: int, page_size: int, head_dim: int, num_pages: int,
                      n_rows: int, device: str, dtype: torch.dtype, gqa: int = 4) -> None:
    """kv_transform.transform_store (smooth + rotate + encode + scatter in one launch) == the pool's reference
    path (PagePool._stored_domain, then the codecs), and transform_rows == native_q / native_out.

    The kernel's rotation (tf32x3 dot) and the reference (fp32 matmul) round differently in the
    last bits, so a value on a rounding edge may take the neighbouring code: decoded values must
    agree within one quantization step and almost every code exactly."""
    from kvtier.kv.pool import PagePool
    fmt = make_format(name)
    dev = torch.device(device)
    g = torch.Generator().manual_seed(zlib.crc32(b"fused" + name.encode()))
    pool = PagePool(fmt, 1, num_pages, heads, page_size, head_dim, "cpu", compute_dtype=dtype)
    calib = torch.randn(64, heads, head_dim, generator=g) * 3 + torch.randn(heads, head_dim, generator=g) * 5
    pool.calibrate(0, calib.to(dtype))
    slots = torch.randperm(num_pages * page_size, generator=g)[:n_rows]
    base = torch.randn(n_rows, 3 * heads, head_dim, generator=g) * 2
    k = (base[:, :heads] * 3 + calib[0]).to(dtype)  # a strided view, as sliced from a fused qkv projection
    v = (base[:, heads:2 * heads] + 0.3).to(dtype)
    ks, vs = pool._stored_domain(0, k, v)
    ref = fmt.allocate(num_pages, heads, page_size, head_dim, torch.device("cpu"))
    for kv, codec, x in (("k", fmt.k_codec, ks), ("v", fmt.v_codec, vs)):
        for suffix, part in codec.encode(x).items():
            ref[kv + suffix][slots // page_size, :, slots % page_size] = part
    got = fmt.allocate(num_pages, heads, page_size, head_dim, dev)
    smooth = (pool.k_shift[0].to(dev), pool.k_channel_scale[0].to(dev))
    kt.transform_store(fmt, got, slots.to(dev), k.to(dev), v.to(dev), smooth)
    _check_pages(name, fmt, ref, got, head_dim)
    q = torch.randn(n_rows, heads * gqa, head_dim, generator=g).to(dtype)
    want_q = pool.native_q(0, q)
    have_q = kt.transform_rows(q.to(dev), True, pool.k_channel_scale[0].to(dev)).cpu()
    assert have_q.dtype == q.dtype
    assert torch.allclose(want_q.float(), have_q.float(), rtol=2e-2 if dtype != torch.float32 else 1e-4,
                          atol=1e-3), f"{name}: native_q kernel differs"
    want_o = pool.native_out(q)
    have_o = kt.transform_rows(q.to(dev), True).cpu()
    assert torch.allclose(want_o.float(), have_o.float(), rtol=2e-2 if dtype != torch.float32 else 1e-4,
                          atol=1e-3), f"{name}: native_out kernel differs"
    in_place = q.to(dev)  # out= the input itself: each program reads its rows whole first
    kt.transform_rows(in_place, True, out=in_place)
    assert torch.equal(in_place.cpu(), have_o), f"{name}: native_out in place differs"


INTERP_CASES = [(name, hd, ps) for name in QUANT_FORMATS for hd, ps in ((16, 4), (24, 2))]


def main() -> None:
    """Run every interpreter case (TRITON_INTERPRET=1 must be set before triton is imported)."""
    import kvtier.kernels.kv_quant as kq
    failures = []
    for name, hd, ps in INTERP_CASES:
        try:
            check_store_load(kq, name, heads=2, page_size=ps, head_dim=hd, num_pages=5, n_rows=7,
                             device="cpu", dtype=torch.float32, exact_fp8=False)
        except AssertionError as e:
            failures.append(f"{name} head_dim={hd} page_size={ps}: {e}")
    for name in ("fp32", "bf16"):
        try:
            check_plain_store(kq, name, heads=2, page_size=4, head_dim=16, num_pages=5, n_rows=7, device="cpu",
                              cast=False)
        except AssertionError as e:
            failures.append(f"plain {name}: {e}")
    import kvtier.kernels.kv_transform as kt
    # 19 rows: the tiled (tensor-core) programs; 5: one row a program; head_dim 64: several chunks
    for name, hd, rows in [(n, 16, r) for n in QUANT_FORMATS for r in (19, 5)] + [("k8v4", 64, 19), ("int8", 64, 3)]:
        try:
            check_fused_store(kt, name, heads=2, page_size=4, head_dim=hd, num_pages=8, n_rows=rows, device="cpu",
                              dtype=torch.float32, gqa=2)
        except AssertionError as e:
            failures.append(f"fused {name} head_dim={hd} rows={rows}: {e}")
    # rope + store: plain and quantized formats, with and without the qk norm, row and tiled programs
    for name, rows, norm in [("fp32", 3, True), ("int8", 3, True), ("k8v4", 19, True), ("int4", 2, False),
                             ("fp8", 19, False), ("fp32", 19, False)]:
        try:
            check_rope_store(kt, name, heads=2, page_size=4, head_dim=16, num_pages=8, n_rows=rows, device="cpu",
                             dtype=torch.float32, gqa=2, norm=norm)
        except AssertionError as e:
            failures.append(f"rope_store {name} rows={rows} norm={norm}: {e}")
    print("\n".join(failures) if failures else "ALL OK")


if __name__ == "__main__":
    main()
