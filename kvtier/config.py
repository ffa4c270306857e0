"""Frozen configuration dataclasses, validated once at start.

"auto" values are resolved with `dataclasses.replace` by the code that knows
the answer (the memory planner, the device probe), never by mutation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# Tokens per KV page: small enough that prefix sharing wastes little, large
# enough that page tables and transfers stay cheap.
DEFAULT_PAGE_SIZE = 16
# Tokens per prefill chunk: bounds the step latency seen by running decodes.
DEFAULT_PREFILL_CHUNK = 512
# On CUDA a 512-token chunk is mostly per-step overhead (H200, Qwen3-8B shape: ~11 ms of GEMMs
# in a ~36 ms step); 2048 keeps the GEMMs large while a chunk still takes only ~0.1 s.
CUDA_PREFILL_CHUNK = 2048


def prefill_chunk_for(device_type: str, chunk: int | None) -> int:
    """The prefill chunk a config means on a device: its own, else the device's default."""
    return chunk or (CUDA_PREFILL_CHUNK if device_type == "cuda" else DEFAULT_PREFILL_CHUNK)
# Upper bound of sequences decoded in one step.
DEFAULT_MAX_BATCH = 32
KV_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "k8v4", "int4")
DEVICES = ("auto", "cpu", "cuda")


def default_cache_dir() -> Path:
    """Where `kvtier models fetch` stores models (KVTIER_CACHE overrides)."""
    env = os.environ.get("KVTIER_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvtier" / "models"


# Retrieval attention (layers/retrieval.py): what a decode row past the budget attends to.
SELECTORS = ("quest", "quest-max", "meankey", "centroid", "hybrid", "midrange", "hybrid-mid")
# Selectors that read the pages' key sums (the mean key): the others keep no sums (kv/summaries.py).
SUM_SELECTORS = ("meankey", "centroid", "hybrid")
# --kvmem-summary-bits: 0, auto (8 on CUDA, 16 elsewhere); 8; 16 (kv/summaries.py summary_dtype)
SUMMARY_BITS = (0, 8, 16)
# Sink tokens: StreamingLLM keeps the first 4 tokens (the attention sinks); rounded up to pages,
# that is one page at any page size, the least that keeps position 0 in every selection.
DEFAULT_SINK = 4
# Recent tokens always attended: local syntax and the running sentence (8 pages of 16); small
# next to useful budgets (2K-8K) so most of the budget goes to retrieved pages.
DEFAULT_WINDOW = 128
# GPU cache of selected host pages (kernels/hot_pages.py), in budgets (`--kvmem-gpu-cache -1`).
# Real text (SmolLM2, 7K-token prompt, budget 1024: tools/sim_gpu_cache.py): 81% of a step's
# retrieved pages were chosen by the step before; a cache of 1 / 2 / 4 budgets hits 44% / 76% /
# 91% of the retrieved entries.
GPU_CACHE_BUDGETS = 4


@dataclass(frozen=True)
class RetrievalConfig:
    """budget: tokens a decode row may attend to (0: off, always dense); sink: the first tokens
    always kept (>= 1: position 0 is the attention sink and its page heads every selection);
    window: the last tokens always kept; selector: one of SELECTORS (hybrid: half the picks by
    the Quest bound, half by per-head centroid; it recalled as well as dense or better with the
    1.5B at 8K / 16K, had the lowest natural-text KL and alone found every planted needle:
    docs/benchmarks.md; hybrid-mid: the second half by the midpoint of each page's key min and
    max instead, from the same summaries as the bound, so the pages keep no key sums: half the
    summary bytes and reads)."""

    budget: int = 0
    sink: int = DEFAULT_SINK
    window: int = DEFAULT_WINDOW
    selector: str = "hybrid"
    # tokens of GPU pool pages that cache the host pages decode selects (kernels/hot_pages.py;
    # CUDA with the host tier read in place): 0 off (the default: measured slower where tried,
    # docs/benchmarks.md), -1 GPU_CACHE_BUDGETS budgets
    gpu_cache: int = 0
    # bits of the pages' key min / max (kv/summaries.py): 16 (CUDA: the keys' dtype; CPU: fp32), 8
    # (int8 codes with a power-of-two exponent per page and kv head: half the bytes each decode
    # step's scoring reads, and the GPU memory they take) or 0, auto: 8 on CUDA (the same recall
    # as 16 in every planted and real-model cell measured, docs/benchmarks.md), 16 elsewhere (the
    # CPU's C++ scorer reads fp32)
    summary_bits: int = 0

    def __post_init__(self) -> None:
        if self.budget < 0:
            raise ValueError(f"kvmem budget must be >= 0 tokens (0 = off), got {self.budget}")
        if self.sink < 1:
            raise ValueError(f"kvmem sink must be >= 1 token (position 0 is always kept), got {self.sink}")
        if self.window < 0:
            raise ValueError(f"kvmem window must be >= 0 tokens, got {self.window}")
        if self.selector not in SELECTORS:
            raise ValueError(f"kvmem selector must be one of {', '.join(SELECTORS)}, got {self.selector!r}")
        if self.summary_bits not in SUMMARY_BITS:
            raise ValueError(f"kvmem summary bits must be 8, 16 or 0 (auto), got {self.summary_bits}")
        if self.gpu_cache < -1:
            raise ValueError(f"kvmem GPU cache must be >= 0 tokens (-1 = auto, 0 = off), got {self.gpu_cache}")
        if self.budget and self.budget <= self.sink + self.window:
            raise ValueError(f"kvmem budget {self.budget} leaves nothing to retrieve past sink {self.sink} "
                             f"+ window {self.window} tokens")

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    @property
    def key_sums(self) -> bool:
        """Whether the selector reads the pages' key sums (the summaries keep them only then)."""
        return self.selector in SUM_SELECTORS

    def cache_pages(self, page_size: int) -> int:
        """Pool pages of the GPU cache of selected host pages (0: none)."""
        if not self.enabled or self.gpu_cache == 0:
            return 0
        tokens = self.gpu_cache if self.gpu_cache > 0 else GPU_CACHE_BUDGETS * self.budget
        return max(2, -(-tokens // page_size))

    def page_counts(self, page_size: int) -> tuple[int, int, int]:
        """(sink pages, most window pages, budget pages) at `page_size`; ValueError when the budget
        cannot hold the sink, the window and at least one retrieved page."""
        sink = -(-self.sink // page_size)
        window = -(-max(self.window, 1) // page_size) + 1  # an unaligned window touches one more page
        budget = self.budget // page_size
        if budget < sink + window + 1:
            raise ValueError(f"kvmem budget {self.budget} tokens = {budget} pages of {page_size}: needs at "
                             f"least {sink + window + 1} (sink {sink} + window {window} + 1 retrieved)")
        return sink, window, budget


@dataclass(frozen=True)
class ModelSpec:
    """Architecture facts of one decoder model, read from GGUF metadata or config.json."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # qwen2: bias on q/k/v projections
    qk_norm: bool = False  # qwen3: RMSNorm on q and k per head
    rope_scaling: dict | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "qwen2", "qwen3"):
            raise ValueError(f"unsupported architecture {self.arch!r} (supported: llama, qwen2, qwen3)")
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                  "num_kv_heads", "head_dim"):
            if getattr(self, k) <= 0:
                raise ValueError(f"ModelSpec.{k} must be positive, got {getattr(self, k)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    def kv_bytes_per_token(self, bytes_per_elem: float) -> float:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_elem


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = DEFAULT_PAGE_SIZE
    kv_dtype: str = "auto"
    gpu_kv_mib: int | None = None  # None = auto from the memory plan
    host_kv_mib: int = 0  # pinned host tier size; 0 = no host tier
    num_pages: int | None = None  # explicit compute-pool size in pages (tests)
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {self.page_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.host_kv_mib < 0:
            raise ValueError("host_kv_mib must be >= 0")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError("num_pages must be >= 2")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"
    dtype: str = "auto"  # weights/activations: auto = bf16 on CUDA and on CPUs with native bf16, else fp32
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int | None = None  # None: prefill_chunk_for(device)
    max_model_len: int | None = None  # None = the model's trained context
    cache: CacheConfig = field(default_factory=CacheConfig)
    threads: int | None = None
    # CPU threads for decode-only steps (None: `threads`). A server leaves a core to its HTTP
    # thread and the clients: see kvtier/engine/engine.py Engine._set_threads.
    decode_threads: int | None = None
    # Small-batch matmul weights: auto = an int8 copy on CPU with bf16 (layers/linear.py), else dense
    decode_weights: str = "auto"
    # Matmul weights as loaded (models/loading): auto = the file's own format for GGUF (dense with
    # --decode-weights dense, and on CPU for small files: engine/build.py CPU_DENSE_AUTO_MAX_FILE),
    # bf16 (dense) for safetensors; int8 / int4 = quantize_rtn at load
    weights: str = "auto"
    # Decoder layers (the last ones) whose weights stay in host RAM and are copied to the device
    # before each use (layers/offload.py): a model larger than --gpu-memory-limit. None: as the
    # memory plan sizes it (engine/plan.py; 0 without a limit)
    offload_layers: int | None = None
    # layers/backends.py: auto = the fastest the device supports (triton on CUDA, else dense)
    attention_backend: str = "auto"
    # layers/retrieval.py: past `budget` tokens a decode row attends to sink + window + top-k pages (0: dense)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    # CUDA graphs for decode steps (engine/cuda_graph.py): auto = on where the device and the
    # attention backend allow them
    cuda_graphs: str = "auto"
    # Overlap scheduling (engine/engine.py): a decode step is planned and launched while the one
    # before it still runs, its input ids read from the device; auto = on for CUDA
    overlap: str = "auto"

    def __post_init__(self) -> None:
        if self.attention_backend not in ("auto", "dense", "triton"):
            raise ValueError(f"attention_backend must be auto|dense|triton, got {self.attention_backend!r}")
        if self.cuda_graphs not in ("auto", "on", "off"):
            raise ValueError(f"cuda_graphs must be auto|on|off, got {self.cuda_graphs!r}")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError(f"overlap must be auto|on|off, got {self.overlap!r}")
        if self.decode_weights not in ("auto", "dense", "int8"):
            raise ValueError(f"decode_weights must be auto|dense|int8, got {self.decode_weights!r}")
        if self.weights not in ("auto", "bf16", "int8", "int4"):
            raise ValueError(f"weights must be auto|bf16|int8|int4, got {self.weights!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in ("auto", "fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be auto|fp32|bf16|fp16, got {self.dtype!r}")
        if self.offload_layers is not None and self.offload_layers < 0:
            raise ValueError(f"offload_layers must be >= 0, got {self.offload_layers}")
        for name in ("threads", "decode_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    cors: tuple[str, ...] = ()  # allowed browser origins ("*" = any); empty = CORS off
    max_concurrency: int = 64
    max_queue: int = 256
    max_request_bytes: int = 8 * 1024 * 1024
    model_name: str = "smollm2-135m"
    # Sampling for requests that leave a knob out (llama-server's --temp / --top-p / ...): the
    # OpenAI defaults unless the operator sets others. A request's own value always wins.
    default_temperature: float = 1.0
    default_top_p: float = 1.0
    default_top_k: int = 0
    default_min_p: float = 0.0
    progress_log_s: float = 1.0  # seconds between a request's progress lines in the server log

    def __post_init__(self) -> None:
        if self.progress_log_s <= 0:
            raise ValueError(f"progress log interval must be > 0 seconds, got {self.progress_log_s}")
        if not (0 <= self.default_temperature <= 2):
            raise ValueError(f"default temperature must be in [0, 2], got {self.default_temperature}")
        if not (0 < self.default_top_p <= 1) or not (0 <= self.default_min_p <= 1) or self.default_top_k < 0:
            raise ValueError("default top_p must be in (0, 1], min_p in [0, 1], top_k >= 0")
        if not (0 < self.port < 65536):
            raise ValueError(f"port out of range: {self.port}")
        loopback = self.host in ("127.0.0.1", "localhost", "::1")
        if not loopback and not self.api_key:
            raise ValueError(
                f"refusing to listen on {self.host} without an API key: pass --api-key or set KVTIER_API_KEY")
