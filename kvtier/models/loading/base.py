"""What every checkpoint loader returns, and the one error type it raises."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.config import ModelSpec
from kvtier.layers.qweight import QuantWeight, quantize_rtn

# How a loader returns matmul weights: "dense" in the compute dtype (GGUF dequantized: the fp32
# reference), "stored" in the checkpoint's own format (GGUF blocks as QuantWeight; safetensors
# dense), "int8" / "int4" re-rounded at load with quantize_rtn.
LOAD_WEIGHTS = ("dense", "stored", "int8", "int4")
RTN_BITS = {"int8": 8, "int4": 4}
RTN_GROUP = 32  # quantize_rtn's group: the GGUF block size


class ModelFileError(ValueError):
    """A model file is missing, damaged or unsupported; the message is one line naming the file."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = Path(path)
        self.problem = " ".join(str(problem).split())  # always one line
        super().__init__(f"{self.path}: {self.problem}")


@dataclass
class Checkpoint:
    """A loaded decoder checkpoint.

    `tensors` are named exactly as Hugging Face names them (model.embed_tokens.weight,
    model.layers.{i}.self_attn.q_proj.weight, ...; lm_head.weight absent when tied) and are
    laid out as in HF: Linear weights are [out_features, in_features]. A weight is a dense
    tensor or, loaded with weights "stored" / "int8" / "int4", a QuantWeight. A GGUF's tensors
    are a LazyTensors: each is read when first asked for.
    """

    spec: ModelSpec
    tensors: MutableMapping[str, torch.Tensor | QuantWeight]
    path: Path
    format: str  # "gguf" | "safetensors"
    metadata: dict[str, Any] = field(default_factory=dict)


def check_tensor_shapes(path: Path, shapes: dict[str, tuple[int, ...]],
                        expected: dict[str, tuple[int, ...]],
                        optional: dict[str, tuple[int, ...]] | None = None) -> None:
    """Raise ModelFileError for the first missing tensor or shape mismatch.

    `shapes` are the HF-named shapes found in the file; `expected` must all be present;
    `optional` may be present and, if so, must match too.
    """
    for name, want in expected.items():
        if name not in shapes:
            raise ModelFileError(path, f"missing tensor {name} (expected shape {list(want)})")
        if tuple(shapes[name]) != tuple(want):
            raise ModelFileError(path, f"shape mismatch for {name}: file has {list(shapes[name])}, "
                                       f"the model config implies {list(want)}")
    for name, want in (optional or {}).items():
        if name in shapes and tuple(shapes[name]) != tuple(want):
            raise ModelFileError(path, f"shape mismatch for {name}: file has {list(shapes[name])}, "
                                       f"the model config implies {list(want)}")


def is_matrix_weight(name: str, t: torch.Tensor | QuantWeight) -> bool:
    """Matmul and embedding matrices (what weights "int8" / "int4" quantize); norms and biases are not."""
    return len(t.shape) == 2 and name.endswith(".weight") and "norm" not in name


def quantize_at_load(name: str, t: torch.Tensor, weights: str, dtype: torch.dtype) -> torch.Tensor | QuantWeight:
    """A dense tensor as `weights` asks: cast to dtype, or quantize_rtn'd (int8 / int4) when a matrix
    whose K the group divides."""
    bits = RTN_BITS.get(weights)
    if bits is None or not is_matrix_weight(name, t) or t.shape[1] % RTN_GROUP:
        return t.to(dtype)
    return quantize_rtn(t, bits, RTN_GROUP)


def _glibc():
    """The C library when it is glibc (has malloc_trim and mallopt), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def release_free_memory() -> None:
    """Hand memory freed during loading back to the OS (glibc's malloc_trim; elsewhere nothing).

    Loading frees many mid-sized temporaries (numpy block unpacking in worker threads, the
    QuantWeights each layer repacks); glibc keeps such freed memory in its per-thread arenas,
    where it would stay in the resident set for good.
    """
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


# glibc's mallopt parameters (malloc.h) and the values used while loading / afterwards
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LOAD_MMAP_THRESHOLD = 1 << 20  # blocks of 1 MiB or more: their own mappings, unmapped when freed
RUN_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold (64-bit)


@contextmanager
def loading_heap() -> Iterator[None]:
    """While a model is built, glibc serves blocks of LOAD_MMAP_THRESHOLD or more from their own
    mappings, so each freed packing temporary leaves the resident set at once; afterwards the
    threshold is RUN_MMAP_THRESHOLD (large step temporaries reused from the heap, no page faults).

    Without it glibc's dynamic threshold climbs to 32 MiB after the first large free, and from
    then the loader's 1-30 MiB temporaries come from arenas that keep them: measured by
    tools/rss_load.py, peak RSS over the runtime base 1.81x -> 1.56x the file on
    qwen2.5-coder-0.5b, 1.46x -> 1.38x on 1.5b. Elsewhere than glibc it does nothing."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, LOAD_MMAP_THRESHOLD)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, 2 * RUN_MMAP_THRESHOLD)


# File bytes read ahead of the tensor being asked for (LazyTensors): enough to keep the loader's
# threads busy while the model packs the previous layer, small next to any model (a few layers of
# Qwen2.5-Coder-0.5B, one of 1.5B), since what is read ahead is held on top of the packed model.
PREFETCH_BYTES = 16 << 20


class LazyTensors(MutableMapping):
    """A checkpoint's tensors read when asked for, so a consumer that pops them one at a time
    (Decoder.from_tensors(consume=True)) holds one model plus a few tensors, not two models.

    `shapes` and `nbytes` (file bytes) are known from the header without reading. `load(name)`
    runs on a thread pool of `threads`, always (never the asking thread, whose torch device
    context must not reach the loader); the tensors that follow the asked one in key order are
    read ahead, up to PREFETCH_BYTES. A read tensor is cached until popped or deleted; set
    items are kept as given. Once every name has been read, `load` and the pool are let go (the
    GGUF loader's mmap goes with them).
    """

    def __init__(self, shapes: dict[str, tuple[int, ...]], nbytes: dict[str, int],
                 load: Callable[[str], Any], threads: int) -> None:
        self.shapes = dict(shapes)
        self._nbytes = nbytes
        self._load: Callable[[str], Any] | None = load
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=threads)
        self._order = list(shapes)  # read-ahead order
        self._pending: dict[str, Future] = {}
        self._done: dict[str, Any] = {}
        self._unread = set(shapes)

    def __getitem__(self, name: str) -> Any:
        if name in self._done:
            return self._done[name]
        if name not in self._unread:
            raise KeyError(name)
        if name not in self._pending:
            self._submit(name)
        self._read_ahead(name)
        value = self._pending.pop(name).result()
        self._unread.discard(name)
        self._done[name] = value
        if not self._unread:
            self._release()
        return value

    def __setitem__(self, name: str, value: Any) -> None:
        self._forget(name)
        self._done[name] = value
        self.shapes[name] = tuple(value.shape)

    def __delitem__(self, name: str) -> None:
        if name not in self._done and name not in self._unread:
            raise KeyError(name)
        self._done.pop(name, None)
        self._forget(name)
        self.shapes.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.shapes))

    def __len__(self) -> int:
        return len(self.shapes)

    def _forget(self, name: str) -> None:
        """Drop an unread name (its pending read, if any, is waited for and discarded)."""
        if name in self._unread:
            future = self._pending.pop(name, None)
            if future is not None:
                future.result()
            self._unread.discard(name)
            if not self._unread:
                self._release()

    def _submit(self, name: str) -> None:
        self._pending[name] = self._pool.submit(self._load, name)

    def _read_ahead(self, name: str) -> None:
        """Submit the unread names after `name` in key order, up to PREFETCH_BYTES of file data."""
        ahead = sum(self._nbytes[n] for n in self._pending if n != name)
        i = self._order.index(name) + 1 if name in self._order else len(self._order)
        while i < len(self._order) and ahead < PREFETCH_BYTES:
            n = self._order[i]
            if n in self._unread and n not in self._pending:
                self._submit(n)
                ahead += self._nbytes[n]
            i += 1

    def _release(self) -> None:
        self._load = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
