"""Memory plan: what a model + context + KV format needs, checked before anything loads.

    GPU limit = weights + scratch (activations of one prefill chunk) + runtime reserve
                + GPU KV pool (+ retrieval's page summaries)
    context KV = context tokens x KV bytes/token; what the GPU pool cannot hold
                 must fit the pinned host tier.

With retrieval attention (--kvmem-budget) every page of both tiers has key summaries on the GPU
(kv/summaries.py): a host-tier token costs GPU memory too, so a longer context leaves fewer
tokens for the GPU pool.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from rich.table import Table

from kvtier.config import (CUDA_PREFILL_CHUNK, DEFAULT_PAGE_SIZE, EngineConfig, ModelSpec,
                           prefill_chunk_for)

GIB = 2**30
MIB = 2**20
# CUDA context, cuBLAS workspaces and allocator slack that torch keeps for itself.
CUDA_RUNTIME_RESERVE = 768 * MIB
# Captured decode graphs keep their own static buffers.
CUDA_GRAPH_RESERVE = 256 * MIB
# Live activations per prefill-chunk token, in hidden-size multiples (q/k/v/o, mlp, residuals).
ACTIVATION_FACTOR = 12
# The GPU pool must hold at least this many pages for every running sequence's working set.
MIN_GPU_PAGES = 64
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class MemoryPlan:
    spec: ModelSpec
    weight_bytes: int
    scratch_bytes: int
    runtime_bytes: int  # CUDA context, cuBLAS workspaces, allocator slack
    graph_bytes: int  # captured decode graphs' static buffers
    kv_bytes_per_token: float
    kv_format: str
    gpu_limit: int | None
    context: int
    gpu_kv_bytes: int
    host_kv_bytes: int
    host_available: int
    problems: tuple[str, ...]
    notes: tuple[str, ...] = ()  # worth knowing, not a reason to refuse
    weight_format: str = "bf16"  # how the weights are held (weight_bytes counts that)
    # Streamed layers (layers/offload.py): the last `offload_layers` layers' weights stay in host
    # RAM (offload_bytes), copied each step into a staging buffer of one layer; weight_bytes is
    # then what the GPU holds: the resident weights and that buffer.
    offload_layers: int = 0
    offload_bytes: int = 0
    # Retrieval (--kvmem-budget): page summaries of both tiers' pages, kept on the GPU.
    summary_bytes: int = 0

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def reserve_bytes(self) -> int:
        return self.runtime_bytes + self.graph_bytes

    @property
    def gpu_total_bytes(self) -> int:
        """Everything kvtier allocates on the GPU under this plan."""
        return self.weight_bytes + self.scratch_bytes + self.reserve_bytes + self.gpu_kv_bytes + self.summary_bytes

    @property
    def gpu_kv_tokens(self) -> int:
        return int(self.gpu_kv_bytes // self.kv_bytes_per_token)

    @property
    def host_kv_tokens(self) -> int:
        return int(self.host_kv_bytes // self.kv_bytes_per_token)


def parse_size(text: str) -> int:
    """'12GiB', '500MiB', '12G', '1.5GB', '4096' (MiB) -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.I)
    if not m:
        raise ValueError(f"cannot read the size {text!r}: use e.g. 12GiB or 500MiB")
    num, unit, suffix = float(m.group(1)), m.group(2).upper(), (m.group(3) or "")
    if not unit:
        return int(num * MIB)
    base = 1024 if suffix.lower() != "b" else 1000
    return int(num * base ** "KMGT".index(unit) * base)


def param_count(spec: ModelSpec) -> int:
    from kvtier.models.registry import expected_shapes

    return sum(math.prod(s) for s in expected_shapes(spec).values())


def layer_share(spec: ModelSpec) -> float:
    """The decoder layers' share of the parameters (the rest: embedding, head, final norm)."""
    from kvtier.models.registry import expected_shapes

    shapes = expected_shapes(spec)
    return sum(math.prod(s) for n, s in shapes.items() if n.startswith("model.layers.")) / param_count(spec)


# Streamed layers: the staging buffer holds the largest layer; a GGUF mixes types across layers
# (Q4_K_M: some layers' ffn_down / attn_v in Q6_K), so it is sized this much above the mean layer.
STAGING_MARGIN = 1.25
# With layers streamed, the GPU KV pool keeps at least this many tokens (prefill chunks, the
# retrieval window and selections); more memory goes to resident layers first, which save bus
# traffic every step.
OFFLOAD_MIN_GPU_KV_TOKENS = 8192


def offload_split(spec: ModelSpec, weights: int, room: int, layers: int | None = None) -> tuple[int, int, int]:
    """(streamed layers, bytes they keep in host RAM, bytes the GPU then holds for weights) when
    `room` bytes of the GPU are left for weights; `layers`: that many streamed (else the fewest
    that fit). The GPU holds the non-layer weights, the resident layers and one staging layer."""
    n = spec.num_layers
    per_layer = weights * layer_share(spec) / n
    fixed = weights - per_layer * n
    staging = per_layer * STAGING_MARGIN
    if layers is None:
        resident = n if weights <= room else max(0, min(n, int((room - fixed - staging) // per_layer)))
        layers = n - resident
    if layers == 0:
        return 0, 0, weights
    return layers, int(per_layer * layers), int(fixed + per_layer * (n - layers) + staging)


def read_spec(path: Path) -> ModelSpec:
    from kvtier.models.loading.gguf import read_gguf_header, spec_from_gguf
    from kvtier.models.loading.safetensors import read_config, spec_from_config

    if path.is_dir():
        return spec_from_config(read_config(path), path / "config.json")
    return spec_from_gguf(read_gguf_header(path))


def host_ram_available() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def quant_bytes(n: int, bits: int, group: int, mins: bool) -> int:
    """Bytes of n weights as a QuantWeight: the codes plus an fp16 scale (and min) per group."""
    return n * bits // 8 + (n // group) * 2 * (2 if mins else 1)


def held_weight_bytes(model: str, spec: ModelSpec) -> tuple[int, str] | None:
    """(bytes, format) of the weights as the GPU holds them where they stay quantized: a GGUF's
    tensors repacked into QuantWeights (codes + fp16 scales, and mins for asymmetric types;
    loading/repack.py), dense tensors in bf16; a QUANT_SHAPES shape's every matrix at its bits.
    None: dense bf16 throughout (safetensors, dense shapes), counted from the parameters."""
    from kvtier.models.shapes import QUANT_SHAPES, SHAPES

    if model in QUANT_SHAPES:
        _, bits, group = QUANT_SHAPES[model]
        return quant_bytes(param_count(spec), bits, group, mins=True), f"int{bits}, groups of {group}"
    if model in SHAPES:
        return None
    from kvtier.models.hub import resolve_model
    from kvtier.models.loading.gguf import read_gguf_header
    from kvtier.models.loading.repack import ASYMMETRIC, REPACKS

    path = Path(resolve_model(model))
    if path.is_dir():
        return None
    total = 0
    for t in read_gguf_header(path).tensors:
        n = math.prod(t.shape)
        if t.qtype in REPACKS:
            bits, group, _ = REPACKS[t.qtype]
            total += quant_bytes(n, bits, group, mins=t.qtype in ASYMMETRIC)
        else:  # dense tensors, and types the loader dequantizes: bf16
            total += n * 2
    return total, "as stored in the GGUF"


def make_plan(spec: ModelSpec, kv_format: str, context: int | None, gpu_limit: int | None,
              host_kv_bytes: int | None, weight_dtype: str = "bf16",
              prefill_chunk: int = CUDA_PREFILL_CHUNK, held: tuple[int, str] | None = None,
              offload_layers: int | None = None, retrieval: bool = False, key_sums: bool = True,
              summary_bits: int = 16) -> MemoryPlan:
    """held: (bytes, format) of quantized weights (held_weight_bytes); None: dense in weight_dtype.
    offload_layers: layers streamed from host RAM (None: the fewest that let the weights and
    OFFLOAD_MIN_GPU_KV_TOKENS of KV fit gpu_limit; 0 without a limit). retrieval: count the page
    summaries of both tiers on the GPU; key_sums: with the key sums (config.SUM_SELECTORS);
    summary_bits: their min / max in 8 or 16 bits (kv/summaries.py)."""
    from kvtier.kv.formats import make_format

    import torch

    from kvtier.kv.pool import kv_bytes_per_token
    from kvtier.kv.summaries import summary_bytes_per_token, summary_dtype

    fmt = make_format(kv_format)
    compute = torch.float32 if weight_dtype == "fp32" else torch.bfloat16
    kvpt = kv_bytes_per_token(fmt, spec.num_kv_heads, spec.head_dim, DEFAULT_PAGE_SIZE, compute) * spec.num_layers
    spt = summary_bytes_per_token(spec.num_kv_heads, spec.head_dim, DEFAULT_PAGE_SIZE, spec.num_layers,
                                  summary_dtype("cuda", compute, summary_bits), key_sums) if retrieval else 0.0
    weights = held[0] if held is not None else param_count(spec) * WEIGHT_BYTES[weight_dtype]
    scratch = prefill_chunk * spec.hidden_size * ACTIVATION_FACTOR * WEIGHT_BYTES[weight_dtype]
    scratch += prefill_chunk * spec.vocab_size * 4 // 8  # logits of a few rows at most, fp32
    reserve = CUDA_RUNTIME_RESERVE + CUDA_GRAPH_RESERVE
    if context is not None and context < 1:
        raise ValueError(f"--context must be >= 1, got {context}")
    context = context or spec.max_position_embeddings
    page_kv = DEFAULT_PAGE_SIZE * kvpt
    need_kv = int(-(-context // DEFAULT_PAGE_SIZE) * page_kv)  # whole pages
    problems: list[str] = []
    offload, offload_bytes = 0, 0
    host_fixed = None if host_kv_bytes is None else host_kv_bytes / kvpt  # host tier tokens, if given
    summaries_needed = spt * (context if host_fixed is None else host_fixed)  # at least (host pages)
    if offload_layers or (offload_layers is None and gpu_limit is not None):
        kv_floor = min(need_kv, int(OFFLOAD_MIN_GPU_KV_TOKENS * kvpt)) + int(summaries_needed)
        room = (gpu_limit or 0) - scratch - reserve - kv_floor
        offload, offload_bytes, weights = offload_split(spec, weights, room, offload_layers or None)
    if gpu_limit is None:
        gpu_kv = need_kv
    else:
        room = gpu_limit - weights - scratch - reserve
        if not spt:
            gpu_kv = room
        elif host_fixed is not None:  # GPU tokens cost KV + summaries; the host tier's its summaries
            gpu_kv = (room - host_fixed * spt) / (kvpt + spt) * kvpt
        else:  # the host tier takes what the pool cannot: every context token has its summary
            t = room / (kvpt + spt)
            gpu_kv = t * kvpt if t >= context else (room - context * spt)
        min_kv = int(MIN_GPU_PAGES * DEFAULT_PAGE_SIZE * kvpt)
        if gpu_kv < min_kv:
            summ = f" + retrieval's page summaries {(room - max(gpu_kv, 0)) / GIB:.2f} GiB" if spt else ""
            problems.append(
                f"weights {weights / GIB:.2f} GiB + scratch {scratch / MIB:.0f} MiB + runtime and graphs "
                f"{reserve / MIB:.0f} MiB{summ} leave {max(gpu_kv, 0) / MIB:.0f} MiB of the "
                f"{gpu_limit / GIB:.2f} GiB limit for KV (need >= {min_kv / MIB:.0f} MiB, "
                f"{MIN_GPU_PAGES} pages): raise --gpu-memory-limit to at least "
                f"{math.ceil((weights + scratch + reserve + min_kv * (1 + spt / kvpt) + summaries_needed) / MIB)} MiB, "
                f"or use a smaller model"
                + (f" (already streaming {offload} of {spec.num_layers} layers from host RAM)" if offload else ""))
            gpu_kv = max(gpu_kv, 0)
        gpu_kv = min(gpu_kv, need_kv)
        if gpu_kv < need_kv:  # the pool in whole pages, so that the host tier's share is whole pages too
            gpu_kv = (gpu_kv // page_kv) * page_kv
    host_need = max(0, math.ceil(need_kv - gpu_kv))
    host = host_need if host_kv_bytes is None else host_kv_bytes
    summary_bytes = int((int(gpu_kv) + host) / kvpt * spt)
    avail = host_ram_available()
    if host_kv_bytes is not None and host_kv_bytes < host_need:
        problems.append(
            f"a {context}-token context needs {need_kv / GIB:.2f} GiB of {kv_format} KV; the GPU pool "
            f"holds {gpu_kv / GIB:.2f} GiB, so the host tier needs {host_need / MIB:.0f} MiB but "
            f"--host-kv-mib gives {host_kv_bytes / MIB:.0f}: raise it or pick a smaller --kv-dtype")
    if host + offload_bytes > avail:
        what = (f"the host tier ({host / GIB:.2f} GiB) and the streamed layers' weights "
                f"({offload_bytes / GIB:.2f} GiB) need" if offload_bytes else f"the host tier needs {host / GIB:.2f} GiB of")
        problems.append(f"{what} pinned RAM but only {avail / GIB:.2f} GiB is free: use a smaller --kv-dtype "
                        f"or context")
    notes = []
    if context > spec.max_position_embeddings:
        notes.append(f"the model was trained for {spec.max_position_embeddings} tokens; quality past that "
                     f"needs rope scaling")
    if offload:
        notes.append(f"{offload} of {spec.num_layers} layers stream their weights from host RAM: "
                     f"{offload_bytes / GIB:.2f} GiB over the bus every decode step")
    return MemoryPlan(spec, weights, scratch, CUDA_RUNTIME_RESERVE, CUDA_GRAPH_RESERVE, kvpt, kv_format,
                      gpu_limit, context, int(gpu_kv), int(host), avail, tuple(problems), tuple(notes),
                      held[1] if held is not None else weight_dtype, offload, offload_bytes, summary_bytes)


def render(plan: MemoryPlan) -> Table:
    t = Table("item", "size", "tokens", title=f"memory plan: {plan.spec.name or plan.spec.arch}, "
                                              f"{plan.context} tokens, KV {plan.kv_format}")
    if plan.offload_layers:
        n = plan.spec.num_layers
        t.add_row(f"weights on the GPU ({plan.weight_format}; {n - plan.offload_layers} of {n} layers "
                  f"+ a staging layer)", f"{plan.weight_bytes / GIB:.2f} GiB", "")
        t.add_row(f"weights streamed from host RAM ({plan.offload_layers} layers)",
                  f"{plan.offload_bytes / GIB:.2f} GiB", "")
    else:
        t.add_row(f"weights ({plan.weight_format})", f"{plan.weight_bytes / GIB:.2f} GiB", "")
    t.add_row("scratch (one prefill chunk)", f"{plan.scratch_bytes / MIB:.0f} MiB", "")
    t.add_row("CUDA runtime", f"{plan.runtime_bytes / MIB:.0f} MiB", "")
    t.add_row("CUDA graphs", f"{plan.graph_bytes / MIB:.0f} MiB", "")
    t.add_row("GPU KV pool", f"{plan.gpu_kv_bytes / GIB:.2f} GiB", f"{plan.gpu_kv_tokens}")
    if plan.summary_bytes:
        t.add_row("retrieval page summaries (both tiers, on the GPU)", f"{plan.summary_bytes / GIB:.2f} GiB",
                  f"{plan.gpu_kv_tokens + plan.host_kv_tokens}")
    t.add_row("GPU total", f"{plan.gpu_total_bytes / GIB:.2f} GiB", "")
    if plan.gpu_limit is not None:
        t.add_row("GPU limit", f"{plan.gpu_limit / GIB:.2f} GiB", "")
    t.add_row("host KV tier (pinned)", f"{plan.host_kv_bytes / GIB:.2f} GiB "
                                       f"(free RAM {plan.host_available / GIB:.1f} GiB)", f"{plan.host_kv_tokens}")
    t.add_row("KV per token (all layers)", f"{plan.kv_bytes_per_token / 1024:.1f} KiB", "")
    t.add_row("context KV", f"{plan.context * plan.kv_bytes_per_token / GIB:.2f} GiB", f"{plan.context}")
    return t


def spec_for(model: str) -> ModelSpec:
    """ModelSpec of a model name/path, or of a named shape (kvtier.models.shapes)."""
    from kvtier.models.shapes import SHAPES
    from kvtier.models.hub import resolve_model
    from kvtier.models.loading.safetensors import spec_from_config

    if model in SHAPES:
        return spec_from_config(dict(SHAPES[model]), Path(f"<shape {model}>"))
    return read_spec(Path(resolve_model(model)))


# --weights int8 / int4 (quantize_rtn, groups of 32): (bits, mins) of the QuantWeights
RTN_WEIGHTS = {"int8": (8, False), "int4": (4, True)}


def plan_for_args(model: str, kv_dtype: str, context: int | None, gpu_memory_limit: str | None,
                  host_kv_mib: int, prefill_chunk: int = CUDA_PREFILL_CHUNK, weights: str = "auto",
                  offload_layers: int | None = None, retrieval: bool = False, key_sums: bool = True,
                  summary_bits: int = 16) -> MemoryPlan:
    """The plan `kvtier plan` prints and `kvtier serve` checks, from CLI values (no weights read).
    weights: `--weights` (auto: quantized files as stored, else bf16); offload_layers:
    `--offload-layers` (None: as the limit needs); retrieval: `--kvmem-budget` > 0; key_sums:
    the selector reads key sums; summary_bits: `--kvmem-summary-bits`."""
    limit = parse_size(gpu_memory_limit) if gpu_memory_limit else None
    host = host_kv_mib * MIB if host_kv_mib else None
    kv = kv_dtype if kv_dtype != "auto" else "bf16"
    spec = spec_for(model)
    if weights in RTN_WEIGHTS:
        bits, mins = RTN_WEIGHTS[weights]
        held = quant_bytes(param_count(spec), bits, 32, mins), f"{weights}, groups of 32"
    else:
        held = held_weight_bytes(model, spec) if weights == "auto" else None
    return make_plan(spec, kv, context, limit, host, prefill_chunk=prefill_chunk, held=held,
                     offload_layers=offload_layers, retrieval=retrieval, key_sums=key_sums,
                     summary_bits=summary_bits)


def checked_engine_config(config: EngineConfig, model: str, gpu_memory_limit: str | None) -> EngineConfig:
    """`kvtier serve`'s check, before anything loads: the plan for `gpu_memory_limit` must fit.

    Raises ValueError with what to change when it does not. When it fits, the GPU
    pool and host tier not set explicitly are sized from the plan, and on CUDA the
    process is capped at the limit (so a 12 GiB card can be reproduced on a larger one).
    Without a limit the config is returned unchanged.
    """
    if gpu_memory_limit is None:
        return config
    cc = config.cache
    import torch

    # on the CPU every weight is in host RAM already: nothing to stream (the plan refuses instead)
    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    plan = plan_for_args(model, cc.kv_dtype, config.max_model_len, gpu_memory_limit, cc.host_kv_mib,
                         prefill_chunk_for("cuda", config.prefill_chunk), config.weights,
                         0 if on_cpu else config.offload_layers, retrieval=config.retrieval.budget > 0,
                         key_sums=config.retrieval.key_sums, summary_bits=config.retrieval.summary_bits)
    problems = list(plan.problems)
    room = (plan.gpu_limit or 0) - plan.weight_bytes - plan.scratch_bytes - plan.reserve_bytes
    if cc.gpu_kv_mib is not None and cc.gpu_kv_mib * MIB > room:
        problems.append(f"--gpu-kv-mib {cc.gpu_kv_mib} does not fit the {max(room, 0) // MIB} MiB the "
                        f"--gpu-memory-limit leaves for KV: lower it or leave it out (sized from the plan)")
    if problems:
        raise ValueError("the memory plan does not fit (see `kvtier plan`):\n  - " + "\n  - ".join(problems))
    # rounded up: a pool sized to a whole context must not come out a page short of it
    gpu_kv_mib = cc.gpu_kv_mib or max(1, math.ceil(plan.gpu_kv_bytes / MIB))
    host_kv_mib = cc.host_kv_mib or math.ceil(plan.host_kv_bytes / MIB)
    _cap_cuda_memory(plan.gpu_limit or 0, config.device)
    return replace(config, cache=replace(cc, gpu_kv_mib=gpu_kv_mib, host_kv_mib=host_kv_mib),
                   offload_layers=plan.offload_layers)


def _cap_cuda_memory(limit: int, device: str) -> None:
    """Make torch's allocator refuse to grow past `limit` bytes on the CUDA device."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
