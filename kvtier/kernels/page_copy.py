"""Triton kernel: copy scattered KV pages between two page pools, all layers in one launch.

A pool's storage tensor is `[L, P, *page_shape]` (kvtier/kv/pool.py, `PagePool.storage`).
`copy_pages` does, for every layer l and i, `dst[l, dst_idx[i]] = src[l, src_idx[i]]`
with ONE kernel launch, whatever L and n are. Either side may be pinned host
memory: the GPU then reads (host->GPU) or writes (GPU->host) the host pages
directly over PCIe (zero-copy through UVA), so no CPU gather into a staging
buffer, no extra copy and no CPU scatter are needed.

Pages are moved as raw words: each page is reinterpreted as int32 words when its
byte size (and both base addresses) allow, else int16, else uint8, so every dtype
(bf16, fp16 scales, int8 / uint8 / float8 codes, ...) is copied bit-exactly.

Pinned host pointers and Triton: Triton launches take `data_ptr()` and translate it
with `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`; for page-locked
memory that is mapped into the device address space (torch `pin_memory()`, which
allocates with `cudaHostAlloc`; under UVA that memory is mapped and the device
pointer equals the host pointer) this succeeds; for pageable memory it fails with
"Pointer argument cannot be accessed from Triton (cpu tensor?)" - hence `available`
requires `is_pinned()`. Triton 3.6 (torch 2.11, H200) accepts a pinned CPU tensor
as is; still, the host-side tensor is handed over wrapped in `_HostPointer` (an
object exposing only `data_ptr()` and `dtype`, all a launch reads of a pointer
argument), so no Triton version can reject it for its `device` being "cpu"; the
pointer still goes through the launcher's translation above. Memory pinned with
`cudaHostRegister` (PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True) works
too (seen on the H200 below).

Measured on an H200 (PCIe; a contiguous pinned->GPU copy_ moves 55 GB/s): 2048
scattered (8, 16, 128) uint8 pages x 36 layers move at 50-51 GB/s host->GPU and
52 GB/s GPU->host, against 31-38 GB/s for PagePool's staged gather/copy/scatter;
1 KiB pages ((8, 16, 4) fp16) at 48-49 / 49-50 GB/s against 18-20 GB/s. Block size
and warps barely matter (the bus is the limit); `pytest -s tests/gpu/test_page_copy.py`
prints these figures.

Caveats:
  * Asynchronous: the copy is queued on the current CUDA stream (the caller picks the
    stream). After GPU->host, synchronize that stream before the CPU reads the pages.
  * The host tensor must stay alive until the copy has run: PyTorch's caching host
    allocator only knows about uses by its own copies (`copy_`), not by kernels, so a
    freed pinned block could be handed out again while the kernel still touches it.
    Pool storage lives as long as the pool, so this holds for PagePool.
  * Indices are not range-checked here (that would need a device sync): the caller
    (kv/transfer.py PageTransfers._check) validates them. `dst_idx` must be distinct.
  * Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (both sides on CPU), which
    is how tests/kv/test_page_copy_interp.py checks it without a GPU.

The plain-PyTorch reference is `copy_pages_reference` (index_select / index_copy_ per layer).
"""

from __future__ import annotations

import math

import torch

from kvtier.device import tensor_to

try:
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # CPU-only installs: callers use the reference / staged path
    HAVE_TRITON = False

# Largest number of words one program copies: large pages use few programs
# (an (8, 16, 128) bf16 page, 8192 int32 words, takes two); small pages use one
# program each with a block just covering them.
MAX_BLOCK = 4096


if HAVE_TRITON:
    # n (pages a launch copies) is not specialised on value: a one-page copy would otherwise compile
    # its own variants, at the first decode step of a context past the GPU pool (a 250 ms stall)
    @triton.jit(do_not_specialize=["n"])
    def _page_copy_kernel(src_ptr, dst_ptr, src_idx_ptr, dst_idx_ptr, n, src_layer_words, dst_layer_words,
                          W: tl.constexpr, BLOCK: tl.constexpr, EVEN: tl.constexpr):
        """Program (layer * n + i, c): words [c * BLOCK, (c + 1) * BLOCK) of page i of that layer.

        W is the page size in words; all offsets are int64 (pools can exceed 2^31 words).
        """
        pid = tl.program_id(0)
        c = tl.program_id(1)
        layer = (pid // n).to(tl.int64)
        i = pid % n
        s = tl.load(src_idx_ptr + i).to(tl.int64)
        d = tl.load(dst_idx_ptr + i).to(tl.int64)
        off = c.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        src = src_ptr + (layer * src_layer_words + s * W) + off
        dst = dst_ptr + (layer * dst_layer_words + d * W) + off
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            m = off < W
            tl.store(dst, tl.load(src, mask=m), mask=m)


class _HostPointer:
    """What a Triton launch reads of a pointer argument (`data_ptr()`, `dtype`), for pinned host
    tensors: keeps Triton from ever looking at the tensor's "cpu" device (see the module doc).
    Holds the tensor, so it stays alive at least until the launch has been queued."""

    def __init__(self, t: torch.Tensor):
        self._t = t
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self._t.data_ptr()


def _interpreting() -> bool:
    """Whether the kernel was decorated under TRITON_INTERPRET=1 (decided at import, as Triton does)."""
    return HAVE_TRITON and type(_page_copy_kernel).__name__ == "InterpretedFunction"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _word_dtype(page_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """Widest of int32 / int16 / uint8 dividing the page size and every base address."""
    for size, dtype in ((4, torch.int32), (2, torch.int16)):
        if page_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


def _check(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    if src.dim() < 2 or dst.dim() != src.dim():
        raise ValueError(f"copy_pages: src {tuple(src.shape)} / dst {tuple(dst.shape)} must both be "
                         "[L, P, *page_shape]")
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
        raise ValueError(f"copy_pages: src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} "
                         "differ in layers, page shape or dtype")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_pages: src and dst must be contiguous")
    if src_idx.dim() != 1 or dst_idx.dim() != 1 or src_idx.numel() != dst_idx.numel():
        raise ValueError(f"copy_pages: src_idx {tuple(src_idx.shape)} and dst_idx {tuple(dst_idx.shape)} "
                         "must be 1-D of one length")
    if src_idx.dtype.is_floating_point or dst_idx.dtype.is_floating_point:
        raise ValueError("copy_pages: page indices must be integers")


def available(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether `copy_pages` can serve this pair: Triton importable and either the interpreter
    (TRITON_INTERPRET=1, CPU tensors) or a CUDA device involved with every CPU side pinned
    (both CUDA sides on one device)."""
    if not HAVE_TRITON:
        return False
    if _interpreting():
        return src.device.type == "cpu" and dst.device.type == "cpu"
    cuda = [t.device for t in (src, dst) if t.device.type == "cuda"]
    if not cuda or not torch.cuda.is_available() or len(set(cuda)) > 1:
        return False
    return all(t.device.type == "cuda" or (t.device.type == "cpu" and t.is_pinned()) for t in (src, dst))


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[l, dst_idx[i]] = src[l, src_idx[i]] for every layer l and i, in one launch.

    src: [L, P_src, *page_shape], dst: [L, P_dst, *page_shape], contiguous, same dtype and
    page shape; src_idx / dst_idx: integer [n] (moved to the CUDA device if not there).
    One side may be pinned host memory (zero-copy over UVA). Queued on the current CUDA
    stream of the CUDA side's device; see the module doc for the caveats.
    """
    _check(src, dst, src_idx, dst_idx)
    if not available(src, dst):
        raise RuntimeError(f"copy_pages: no kernel for {src.device} (pinned={src.is_pinned()}) -> "
                           f"{dst.device} (pinned={dst.is_pinned()}); use copy_pages_reference")
    n, layers = src_idx.numel(), src.shape[0]
    page_bytes = math.prod(src.shape[2:]) * src.element_size()
    if n == 0 or layers == 0 or page_bytes == 0:
        return
    word = _word_dtype(page_bytes, src, dst)
    w = page_bytes // torch.empty((), dtype=word).element_size()
    src_w = src.view(-1).view(word)  # [L * P_src * W] words
    dst_w = dst.view(-1).view(word)
    block = min(_pow2(w), MAX_BLOCK)
    grid = (n * layers, triton.cdiv(w, block))
    if grid[0] >= 2 ** 31:
        raise ValueError(f"copy_pages: {n} pages x {layers} layers exceeds the launch grid")
    num_warps = max(1, min(8, block // 256))
    if _interpreting():
        _page_copy_kernel[grid](src_w, dst_w, src_idx.to(torch.int64).contiguous(),
                                dst_idx.to(torch.int64).contiguous(), n, src.shape[1] * w, dst.shape[1] * w,
                                W=w, BLOCK=block, EVEN=w % block == 0, num_warps=num_warps)
        return
    dev = src.device if src.device.type == "cuda" else dst.device
    s_idx = tensor_to(src_idx.to(torch.int64), dev).contiguous()  # host ids: pinned, no wait for the GPU
    d_idx = tensor_to(dst_idx.to(torch.int64), dev).contiguous()
    s_arg = src_w if src_w.device.type == "cuda" else _HostPointer(src_w)
    d_arg = dst_w if dst_w.device.type == "cuda" else _HostPointer(dst_w)
    with torch.cuda.device(dev):  # Triton launches on the current device's current stream
        _page_copy_kernel[grid](s_arg, d_arg, s_idx, d_idx, n, src.shape[1] * w, dst.shape[1] * w,
                                W=w, BLOCK=block, EVEN=w % block == 0, num_warps=num_warps)


def copy_pages_reference(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
                         dst_idx: torch.Tensor) -> None:
    """What `copy_pages` does, in plain PyTorch: per layer index_select -> move -> index_copy_."""
    _check(src, dst, src_idx, dst_idx)
    s_idx = src_idx.to(src.device, torch.int64)
    d_idx = dst_idx.to(dst.device, torch.int64)
    layers = src.shape[0]
    if layers == 0 or s_idx.numel() == 0 or src.shape[2:].numel() == 0:
        return
    # raw bytes, as the kernel moves them (index_copy_ has no float8 kernels on CPU)
    src_b = src.view(layers, src.shape[1], -1).view(torch.uint8)
    dst_b = dst.view(layers, dst.shape[1], -1).view(torch.uint8)
    for layer in range(layers):
        dst_b[layer].index_copy_(0, d_idx, src_b[layer].index_select(0, s_idx).to(dst.device))
