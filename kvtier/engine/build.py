"""Build an Engine from a model name or path: resolve, load, place, size the KV pool."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kvtier.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.kernels import cpu_ops
from kvtier.layers.linear import int8_gemv_supported

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(config: EngineConfig) -> EngineConfig:
    """Resolve device/dtype "auto": CUDA when present; fp32 on CPU, bf16 on CUDA."""
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but this torch build sees no CUDA device")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" or cpu_has_native_bf16() else "fp32"
    # "int8": quantized small-batch weights (CPU kernels with bf16; on CUDA the wq_matmul kernels)
    quantized_ok = device == "cuda" or int8_gemv_supported(torch.device(device), DTYPES[dtype])
    decode_weights = config.decode_weights
    if decode_weights == "auto":
        decode_weights = "int8" if quantized_ok else "dense"
    elif decode_weights == "int8" and not quantized_ok:
        raise ValueError(f"int8 decode weights need bf16 on CPU (got {dtype} on {device})")
    if config.offload_layers and device != "cuda":
        raise ValueError("--offload-layers keeps layers in host RAM for a CUDA device; on the CPU every weight "
                         "is in host RAM already")
    if decode_weights == "dense" and config.weights in ("int8", "int4"):
        raise ValueError(f"--weights {config.weights} quantizes the weights; --decode-weights dense asks for dense ones")
    return replace(config, device=device, dtype=dtype, decode_weights=decode_weights)


# `--weights auto` on CPU loads a GGUF of at most this size dense: bf16 matmul weights plus their
# int8 / int4 decode copies, ~3-6x the file, which for a small model is little memory and is faster
# with torch's CPU kernels. Measured on SmolLM2-135M (94 MiB Q4_1), 2-core AVX512-BF16 box,
# `kvtier bench --prompt-tokens 512 --gen-tokens 64`: prefill 1,888 vs 1,011 tok/s, decode 100.4
# vs 78.4 tok/s. Larger files keep their own format, one copy: the memory is what lets big models fit.
CPU_DENSE_AUTO_MAX_FILE = 256 * 2**20


def load_mode(config: EngineConfig, path: Path | None = None) -> str:
    """The loader's `weights` (models/loading/base.py LOAD_WEIGHTS) for a resolved config:
    a GGUF's own blocks unless dense decode weights were asked for, or (auto, CPU) the file is
    small enough that the dense path's speed is worth its memory (CPU_DENSE_AUTO_MAX_FILE)."""
    if config.weights == "auto":
        if config.decode_weights == "dense":
            return "dense"
        small = path is not None and path.is_file() and path.stat().st_size <= CPU_DENSE_AUTO_MAX_FILE
        return "dense" if config.device == "cpu" and small else "stored"
    return {"bf16": "dense", "int8": "int8", "int4": "int4"}[config.weights]


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (oneDNN), not emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepare_model(net, config: EngineConfig, source_types: dict[str, str] | None = None):
    """Apply the resolved config's weight options to a built Decoder: on CPU, int8 / int4 decode
    copies of the matmuls still dense (a safetensors or `--weights bf16` model; QuantLinear layers
    hold their one packed copy already).

    source_types (HF tensor name -> checkpoint quant type) lets 4-bit GGUF tensors decode as int4.
    """
    if config.decode_weights == "int8" and config.device == "cpu":
        net.enable_int8_gemv(source_types)
    if config.offload_layers and net.offload is None:  # built whole (a random-weight shape): move them now
        net.offload_last_layers(config.offload_layers)
    return net


def _mib(by_device: dict[str, int]) -> str:
    return ", ".join(f"{n / 2**20:,.0f} MiB on {d}" for d, n in by_device.items())


def load_model(path: str | Path, config: EngineConfig):
    """(Decoder, checkpoint) of the model file at `path` as a resolved config runs it: tensors read
    one at a time, in the file's own quantized format or cast (load_mode), then prepare_model."""
    from kvtier.models.decoder import Decoder
    from kvtier.models.loading import load_checkpoint

    ckpt = load_checkpoint(path, dtype=DTYPES[config.dtype], weights=load_mode(config, Path(path)))
    # streamed layers move to host RAM as each is built: the device never holds the whole model
    net = Decoder.from_tensors(ckpt.spec, ckpt.tensors, dtype=DTYPES[config.dtype], device=torch.device(config.device),
                               consume=True, offload_layers=config.offload_layers or 0)
    return prepare_model(net, config, ckpt.metadata.get("tensor_types")), ckpt


def build_engine(model: str, config: EngineConfig | None = None, show_progress: bool = True,
                 console: Console | None = None) -> Engine:
    """Resolve `model` (registry name or path), load weights and tokenizer, build the Engine."""
    from kvtier.models.hub import resolve_model
    from kvtier.models.tokenizer import Tokenizer

    config = resolve_device(config or EngineConfig())
    if config.threads:
        torch.set_num_threads(config.threads)
    path = resolve_model(model)
    console = console or Console(stderr=True)
    cols = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    t0 = time.monotonic()
    with Progress(*cols, console=console, transient=True, disable=not show_progress) as prog:
        if config.device == "cpu" and cpu_ops.wanted():
            # built once per machine and source version (tens of seconds), then loaded from the cache
            cpu_task = prog.add_task("CPU kernels (compiled on the first run only)", total=None)
            cpu_ops.ops()
            prog.remove_task(cpu_task)
        task = prog.add_task(f"reading {Path(path).name}", total=2)
        net, ckpt = load_model(path, config)
        prog.update(task, advance=1, description="loading tokenizer")
        tok = Tokenizer.from_checkpoint(ckpt)
        prog.update(task, advance=1)
    name = model if not Path(model).exists() else Path(model).stem
    engine = Engine(net, tok, config, model_name=name)  # its backend reads the host tier it made
    if show_progress:
        spec = ckpt.spec
        console.print(f"[green]loaded[/] {name}: {spec.arch}, {spec.num_layers} layers, "
                      f"hidden {spec.hidden_size}, on {config.device} ({config.dtype}"
                      f"{', int8/int4 decode weights' if config.decode_weights == 'int8' else ''}; "
                      f"weights {_mib(net.weight_bytes())}) "
                      f"in {time.monotonic() - t0:.1f}s; KV {engine.kv_format}, "
                      f"{engine.pool.num_pages} pages x {config.cache.page_size} tokens")
    return engine
