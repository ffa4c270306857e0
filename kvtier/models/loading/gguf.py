"""GGUF checkpoints: validated header scan, tensors in their stored format, the llama q/k un-permutation.

The header is parsed here with bounds checks on every read (gguf.GGUFReader builds a numpy
field per vocabulary string, ~5 s on a 49K vocab, and fails with bare numpy errors on damaged
files). Tensor bytes are memory-mapped and read one tensor at a time, when the consumer asks for it
(base.LazyTensors): `weights="stored"` repacks
quantized blocks into QuantWeight (repack.py) without losing what the file holds, "dense"
dequantizes with `gguf.quants.dequantize` (the fp32 reference), "int8" / "int4" dequantize and
re-round each matmul weight (quantize_rtn). Each tensor's mapped pages are dropped once it is
read, so the file's pages do not stay in the process's resident memory.

File layout (v2/v3, little endian):

    | magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv | kv pairs ... |
    | tensor infos: name, u32 n_dims, u64 dims[n_dims], u32 type, u64 offset ... |
    | padding to `general.alignment` | tensor data (offsets relative to here) ... |
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from kvtier.config import ModelSpec
from kvtier.layers.qweight import QuantWeight
from kvtier.models.loading.base import (LOAD_WEIGHTS, Checkpoint, LazyTensors, ModelFileError,
                                        check_tensor_shapes, quantize_at_load)
from kvtier.models.loading.dequant import dequantize_q5
from kvtier.models.loading.repack import DENSE_TYPES, REPACKS, dense_from_bytes, permute_rows, repack
from kvtier.models.registry import (ARCHS, GGUF_IGNORED_TENSORS, SUPPORTED_ARCHS, arch_info,
                                    expected_shapes, gguf_to_hf_name, optional_shapes)

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)  # v1 used 32-bit counts and is long obsolete
DEFAULT_ALIGNMENT = 32  # the GGUF spec's default when general.alignment is absent
MAX_DIMS = 4  # GGML_MAX_DIMS: more dims means the header is corrupt
# Dequantization threads: all cores, capped where memory bandwidth stops scaling.
LOAD_THREADS = min(8, os.cpu_count() or 1)
_Q = GGMLQuantizationType
# Types we dequantize (and test); others known to gguf are refused at load with a clear error.
SUPPORTED_QUANT_TYPES = frozenset({
    _Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
})
# metadata value type id -> (struct format, numpy dtype); 8 = string, 9 = array
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (row) dimension
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """Row-major shape as HF/PyTorch see it ([out, in] for a Linear weight)."""
        return tuple(reversed(self.shape))


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # numeric arrays are np.ndarray, string arrays list[str]
    tensors: list[GGUFTensorInfo]
    data_offset: int
    file_size: int


class _Cursor:
    """Bounds-checked little-endian reads over a buffer; errors name the file."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def take(self, n: int, what: str) -> memoryview:
        if n > self.size:
            raise ModelFileError(self.path, f"corrupt header: {what} claims {n} bytes at offset {self.pos}, "
                                            f"more than the whole file ({self.size} bytes)")
        if self.pos + n > self.size:
            raise ModelFileError(self.path, f"truncated file: header needs bytes up to {self.pos + n} "
                                            f"while reading {what}, the file has {self.size}")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        return bytes(self.take(n, what)).decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], f"value of {key}")
        if vtype == _STRING:
            return self.string(f"value of {key}")
        if vtype != _ARRAY:
            raise ModelFileError(self.path, f"corrupt header: unknown metadata value type {vtype} for key {key!r}")
        etype, count = self.scalar("<I", f"array type of {key}"), self.scalar("<Q", f"array length of {key}")
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][1])
            return np.frombuffer(self.take(count * dt.itemsize, f"array {key}"), dtype=dt).copy()
        if count > self.size:
            raise ModelFileError(self.path, f"corrupt header: array {key!r} claims {count} elements")
        return [self.value(etype, key) for _ in range(count)]


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse and validate a GGUF header without reading tensor data.

    Raises ModelFileError for a missing file, bad magic, unsupported version, corrupt or
    truncated header, unknown tensor type, or tensor data extending past the end of the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(path, "file not found")
    size = path.stat().st_size
    if size < 4:
        raise ModelFileError(path, f"truncated file: {size} bytes is too short for a GGUF header")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        try:
            header = _parse(cur, path, size)
        finally:
            cur.buf = b""  # drop exported memoryviews' owner before the mmap closes
    return header


def _parse(cur: _Cursor, path: Path, size: int) -> GGUFHeader:
    magic = bytes(cur.take(4, "magic"))
    if magic != GGUF_MAGIC:
        raise ModelFileError(path, f"bad magic {magic!r}: not a GGUF file (expected {GGUF_MAGIC!r})")
    version = cur.scalar("<I", "version")
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ModelFileError(path, f"unsupported GGUF version {version} "
                                   f"(supported: {', '.join(map(str, SUPPORTED_GGUF_VERSIONS))})")
    n_tensors, n_kv = cur.scalar("<Q", "tensor count"), cur.scalar("<Q", "metadata count")
    if n_tensors > size or n_kv > size:
        raise ModelFileError(path, f"corrupt header: {n_tensors} tensors / {n_kv} metadata keys")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string("metadata key")
        metadata[key] = cur.value(cur.scalar("<I", f"type of {key}"), key)
    raw_infos = [_tensor_info(cur, path) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ModelFileError(path, f"corrupt header: general.alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, qtype, rel in raw_infos:
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape and shape[0] % block:
            raise ModelFileError(path, f"corrupt header: tensor {name} row of {shape[0]} is not a multiple "
                                       f"of the {qtype.name} block size {block}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * type_size // block
        start = data_offset + rel
        if start + nbytes > size:
            raise ModelFileError(path, f"truncated file: tensor {name} ends at byte {start + nbytes} "
                                       f"but the file has {size} bytes")
        tensors.append(GGUFTensorInfo(name, shape, qtype, start, nbytes))
    return GGUFHeader(path, version, metadata, tensors, data_offset, size)


def _tensor_info(cur: _Cursor, path: Path) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = cur.string("tensor name")
    n_dims = cur.scalar("<I", f"dims of {name}")
    if n_dims > MAX_DIMS:
        raise ModelFileError(path, f"corrupt header: tensor {name!r} has {n_dims} dimensions (max {MAX_DIMS})")
    shape = tuple(cur.scalar("<Q", f"shape of {name}") for _ in range(n_dims))
    raw_type = cur.scalar("<I", f"type of {name}")
    try:
        qtype = GGMLQuantizationType(raw_type)
    except ValueError:
        raise ModelFileError(path, f"unknown quant type {raw_type} for tensor {name}") from None
    return name, shape, qtype, cur.scalar("<Q", f"offset of {name}")


def spec_from_gguf(header: GGUFHeader) -> ModelSpec:
    """Build the ModelSpec from GGUF metadata (and tensor presence for tie/bias/qk-norm)."""
    md, path = header.metadata, header.path
    arch = md.get("general.architecture")
    if arch is None:
        raise ModelFileError(path, "missing metadata general.architecture")
    if arch not in ARCHS:
        raise ModelFileError(path, f"unknown architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    info, names = arch_info(arch), {t.name for t in header.tensors}

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in md:
            raise ModelFileError(path, f"missing metadata {arch}.{key}")
        return md[f"{arch}.{key}"]

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = md.get("tokenizer.ggml.tokens")
    embed = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if tokens is not None:
        vocab = len(tokens)
    elif f"{arch}.vocab_size" in md:
        vocab = int(md[f"{arch}.vocab_size"])
    elif embed is not None:
        vocab = embed.torch_shape[0]
    else:
        raise ModelFileError(path, "missing tensor token_embd.weight")
    head_dim = int(md.get(f"{arch}.attention.key_length", hidden // max(heads, 1)))
    try:
        return ModelSpec(
            arch=arch, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")), num_layers=int(need("block_count")),
            num_heads=heads, num_kv_heads=int(md.get(f"{arch}.attention.head_count_kv", heads)),
            head_dim=head_dim, rope_theta=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rms_norm_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(need("context_length")),
            tie_word_embeddings="output.weight" not in names,
            attention_bias=info.attention_bias or "blk.0.attn_q.bias" in names,
            qk_norm=info.qk_norm or "blk.0.attn_q_norm.weight" in names,
            rope_scaling=_rope_scaling(md, arch), name=str(md.get("general.name", "")))
    except ValueError as e:
        raise ModelFileError(path, f"invalid model metadata: {e}") from None


def _rope_scaling(md: dict[str, Any], arch: str) -> dict | None:
    kind = md.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    out: dict[str, Any] = {"rope_type": kind, "factor": float(md.get(f"{arch}.rope.scaling.factor", 1.0))}
    orig = md.get(f"{arch}.rope.scaling.original_context_length")
    if orig is not None:
        out["original_max_position_embeddings"] = int(orig)
    return out


def unpermute_index(rows: int, n_head: int) -> torch.Tensor:
    """Row order that undoes the llama q/k permutation: unpermute_qk(w) == w[unpermute_index(...)]."""
    return unpermute_qk(torch.arange(rows), n_head)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's llama q/k row permutation (its `permute`).

    The converter maps each head's rows [r0 r1 ... | r(d/2) ...] (HF's rotate-half layout)
    to interleaved pairs; here w: [n_head * d, ...] -> same shape in HF order.
    """
    d = w.shape[0] // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _check_supported(t: GGUFTensorInfo, path: Path) -> None:
    if t.qtype not in SUPPORTED_QUANT_TYPES:
        names = ", ".join(sorted(q.name for q in SUPPORTED_QUANT_TYPES))
        raise ModelFileError(path, f"unsupported quant type {t.qtype.name} for tensor {t.name} (supported: {names})")


def dequantize_tensor(data: np.ndarray, t: GGUFTensorInfo, path: Path) -> np.ndarray:
    """Dequantize one tensor's bytes to float32 of shape t.torch_shape."""
    _check_supported(t, path)
    raw = data[t.offset:t.offset + t.nbytes]
    if t.qtype == _Q.F32:
        out = raw.view(np.float32)
    elif t.qtype == _Q.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif t.qtype == _Q.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        rows = raw.reshape(-1, t.nbytes // max(1, int(np.prod(t.shape[1:], dtype=np.int64))))
        fast = dequantize_q5(rows, t.qtype)
        out = fast if fast is not None else gguf_quants.dequantize(rows, t.qtype)
    return out.reshape(t.torch_shape)


def read_stored(data: np.ndarray, t: GGUFTensorInfo, path: Path) -> torch.Tensor | QuantWeight:
    """One tensor as the file holds it: quantized 2-D blocks -> QuantWeight, others -> a dense tensor."""
    _check_supported(t, path)
    raw = data[t.offset:t.offset + t.nbytes]
    if t.qtype in DENSE_TYPES:
        return dense_from_bytes(raw, t.qtype, t.torch_shape)
    if t.qtype in REPACKS and len(t.torch_shape) == 2:
        return repack(raw, t.qtype, *t.torch_shape)
    return torch.from_numpy(np.array(dequantize_tensor(data, t, path), dtype=np.float32, copy=True))


class _Mapped:
    """The file memory-mapped read-only, as a uint8 array; `drop` releases a byte range's pages."""

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self.mm, dtype=np.uint8)

    def drop(self, start: int, nbytes: int) -> None:
        """MADV_DONTNEED over the pages of [start, start + nbytes): they leave this process's resident
        set (the page cache keeps them; a later read faults them back in)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        lo = start // page * page
        self.mm.madvise(mmap.MADV_DONTNEED, lo, min(len(self.mm), start + nbytes) - lo)


# Llama 3.1+ GGUFs: rope frequency divisors [head_dim / 2] (read into spec.rope_scaling).
ROPE_FREQS_TENSOR = "rope_freqs.weight"


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, weights: str = "dense") -> Checkpoint:
    """Load a GGUF file into HF-named tensors.

    weights: "dense" -> every tensor dequantized to `dtype`; "stored" -> quantized matmul and
    embedding weights as QuantWeight in the file's own blocks (repack.py), the rest in `dtype`;
    "int8" / "int4" -> matmul weights dequantized and re-rounded by quantize_rtn.
    """
    if weights not in LOAD_WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(LOAD_WEIGHTS)}, got {weights!r}")
    header = read_gguf_header(path)
    path = header.path
    spec = spec_from_gguf(header)
    by_hf: dict[str, GGUFTensorInfo] = {}
    unmapped = []
    for t in header.tensors:
        hf = gguf_to_hf_name(t.name)
        if hf is None:
            if t.name not in GGUF_IGNORED_TENSORS:
                unmapped.append(t.name)
            continue
        by_hf[hf] = t
    check_tensor_shapes(path, {k: t.torch_shape for k, t in by_hf.items()}, expected_shapes(spec),
                        optional_shapes(spec))
    for t in by_hf.values():  # refused now, not when the tensor is first read
        _check_supported(t, path)
    mapped = _Mapped(path)
    data = mapped.data
    permuted = arch_info(spec.arch).gguf_permuted_qk
    freqs = next((t for t in header.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if freqs is not None:  # Llama 3.1+: rope scaling as per-frequency divisors
        factors = np.asarray(dequantize_tensor(data, freqs, path), dtype=np.float32).reshape(-1)
        if factors.size != spec.head_dim // 2 or not np.all(factors > 0):
            raise ModelFileError(path, f"{ROPE_FREQS_TENSOR} has {factors.size} entries (or a non-positive "
                                       f"one); expected {spec.head_dim // 2} positive factors")
        spec = dataclasses.replace(spec, rope_scaling={"rope_type": "freq_factors",
                                                       "freq_factors": factors.tolist()})

    def one(hf: str) -> torch.Tensor | QuantWeight:
        t = by_hf[hf]
        if weights == "stored":
            w = read_stored(data, t, path)
        else:
            w = torch.from_numpy(np.array(dequantize_tensor(data, t, path), dtype=np.float32, copy=True))
        mapped.drop(t.offset, t.nbytes)
        heads = (spec.num_heads if ".self_attn.q_proj." in hf else
                 spec.num_kv_heads if ".self_attn.k_proj." in hf else 0)
        if permuted and heads:
            w = (permute_rows(w, unpermute_index(w.shape[0], heads)) if isinstance(w, QuantWeight)
                 else unpermute_qk(w, heads))
        if isinstance(w, QuantWeight):
            return w
        return quantize_at_load(hf, w, weights, dtype)

    # read when asked for, ahead on LOAD_THREADS threads (numpy releases the GIL in its kernels);
    # the file stays mapped until every tensor has been read
    tensors = LazyTensors({hf: t.torch_shape for hf, t in by_hf.items()},
                          {hf: t.nbytes for hf, t in by_hf.items()}, one, LOAD_THREADS)
    return Checkpoint(spec=spec, tensors=tensors, path=path, format="gguf",
                      metadata=_summary_metadata(header, by_hf, unmapped))


# Metadata arrays longer than this (vocabularies, merges) stay out of Checkpoint.metadata.
_MAX_METADATA_ARRAY = 64


def _summary_metadata(header: GGUFHeader, by_hf: dict[str, GGUFTensorInfo],
                      unmapped: list[str]) -> dict[str, Any]:
    md: dict[str, Any] = {}
    for k, v in header.metadata.items():
        if isinstance(v, (list, np.ndarray)):
            if len(v) > _MAX_METADATA_ARRAY:
                continue
            v = v.tolist() if isinstance(v, np.ndarray) else v
        md[k] = v
    md["gguf.version"] = header.version
    md["tensor_types"] = {k: t.qtype.name for k, t in by_hf.items()}
    md["unmapped_tensors"] = unmapped
    md["file_size"] = header.file_size
    return md
