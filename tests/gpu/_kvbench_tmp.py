"""Throughput of KV store/load kernels vs torch reference, and copy_to GPU<->pinned host."""
import time, torch
from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool

def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3

H, S, D, P = 8, 16, 128, 4096
for name in ["bf16", "fp8", "int8", "k8v4", "int4"]:
    f = make_format(name)
    pool = PagePool(f, 1, P, H, S, D, "cuda", compute_dtype=torch.bfloat16)
    T = 8192
    slots = torch.randperm(P * S, device="cuda")[:T]
    k = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16); v = torch.randn_like(k)
    ids = torch.randperm(P, device="cuda")[:2048]
    ts = bench(lambda: pool.write(0, slots, k, v))
    tl_ = bench(lambda: pool.read(0, ids))
    # reference path on GPU (the torch codecs) for comparison
    st = pool.layers[0]
    def ref_store():
        s = st["k"].shape[2]; pg, off = slots // s, slots % s
        for kv, codec, x in (("k", f.k_codec, k), ("v", f.v_codec, v)):
            for sfx, part in codec.encode(x).items(): st[kv + sfx][pg, :, off] = part
    def ref_load():
        for kv, codec in (("k", f.k_codec), ("v", f.v_codec)):
            codec.decode({n[1:]: t[ids] for n, t in st.items() if n[0] == kv}, torch.bfloat16)
    rs, rl = bench(ref_store), bench(ref_load)
    out_bytes = 2 * 2048 * H * S * D * 2
    print(f"{name:5s} store {T} rows: {ts:.3f} ms (torch {rs:.3f}); load 2048 pages: {tl_:.3f} ms (torch {rl:.3f}), "
          f"{out_bytes / tl_ / 1e6:.0f} GB/s of bf16 out; bytes/token/layer {f.bytes_per_token(H, D):.0f}")
# copy_to: 28 layers, 256 pages, bf16
for name in ["bf16", "int4"]:
    f = make_format(name)
    g = PagePool(f, 28, 1024, H, S, D, "cuda", compute_dtype=torch.bfloat16)
    h = PagePool(f, 28, 1024, H, S, D, "cpu", compute_dtype=torch.bfloat16, pin=True)
    src = list(range(0, 512, 2)); dst = list(range(256))
    nbytes = g.bytes_per_page() * len(src)
    t1 = bench(lambda: g.copy_to(h, src, dst), 5)
    t2 = bench(lambda: h.copy_to(g, dst, src), 5)
    print(f"copy_to {name}: {len(src)} pages x 28 layers = {nbytes/2**20:.0f} MiB: GPU->host {t1:.2f} ms "
          f"({nbytes/t1/1e6:.1f} GB/s), host->GPU {t2:.2f} ms ({nbytes/t2/1e6:.1f} GB/s)")
