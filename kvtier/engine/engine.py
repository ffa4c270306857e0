"""Engine (synchronous step loop) and AsyncEngine (asyncio front end).

    add_request(Request) -> scheduler.waiting
    step():  scheduler.schedule() -> Batch -> runner.execute() -> logits
             -> sampler -> append tokens -> detokenize + stops -> [Output]

Overlap scheduling (`overlap`, on for CUDA): a decode step's sampled ids stay on the
device and the host goes on to plan and launch the next decode step before reading
them back, so the GPU never waits for the host between steps:

    host:  plan n | launch n | read back n-1, outputs | plan n+1 | launch n+1 | read back n ...
    GPU:          [ step n ..................... ][ step n+1 .................... ]

Until it is read back, a sampled token sits in `seq.tokens` as PENDING_TOKEN; step n+1
takes its input ids from step n's device tensor (step_plan.Feed). A sequence that
stopped at step n has had one extra step computed: its row is dropped at read back.
Steps chain only while that is all that can differ (`_can_chain`): no request waiting,
every running sequence decoding, none at its last token, a free page for each that
needs one (no eviction, offload or preemption), sampling that reads no token history
(no penalties, no grammar). Anything else reads the step in flight back first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from kvtier.config import EngineConfig, prefill_chunk_for
from kvtier.device import to_device
from kvtier.engine.request import (ContextOverflowError, KVCapacityError, Output, PinnedBudget, Progress, Request,
                                   Usage)
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampler import needs_history, sample
from kvtier.engine.scheduler import Batch, Scheduler, SeqStatus, Sequence
from kvtier.engine.step_plan import Feed, decode_step
from kvtier.engine.stops import StopChecker
from kvtier.kv.formats import make_format
from kvtier.kv.stats import cache_stats
from kvtier.kv.manager import CacheManager
from kvtier.engine.calibrate import calibrate_pool, calibration_tokens
from kvtier.kv.pool import PagePool, kv_bytes_per_token
from kvtier.layers.backends import choose_backend, make_backend
from kvtier.layers.retrieval import GRAPH_SELECTORS, graph_capable
from kvtier.models.decoder import compute_dtype
from kvtier.models.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("kvtier")

# KV budget when nothing else is said: CPU RAM is plentiful, GPU memory is planned.
DEFAULT_CPU_KV_MIB = 1024
# Share of free GPU memory given to the KV pool when no size is set.
GPU_KV_FRACTION = 0.6


@dataclass
class _SeqOut:
    """Per-request output state: detokenizer, stop strings, sampling RNG, grammar."""

    detok: IncrementalDetokenizer
    stops: StopChecker
    generator: torch.Generator | None
    grammar: object | None
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)


# A sampled token still on the device (overlap scheduling): its place in `seq.tokens` until read back.
PENDING_TOKEN = -1


@dataclass
class _InFlight:
    """A decode step launched and not yet read back (overlap scheduling)."""

    rows: list[Sequence]  # the sequences it samples for, in batch order
    index: list[int]  # where each row's PENDING_TOKEN sits in seq.tokens
    tokens: torch.Tensor  # [rows] int64 on the compute device: the next step's input ids
    host: torch.Tensor  # the same ids, readable once `done` has completed
    done: torch.cuda.Event | None


class _NoDetok:
    """Stands in for the detokenizer of a model run without a tokenizer (benchmarks)."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""

# The GPU cache of selected host pages takes at most 1 / this of the pool, and is left out where
# that is less than one budget of pages (a small pool keeps its pages for the sequences' own).
HOT_POOL_SHARE = 4
# --kv-dtype auto: KV stored in the model's compute dtype.
KV_DTYPE_FOR_COMPUTE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def gpu_cache_pages(config: EngineConfig, head_dim: int, device: torch.device, num_pages: int) -> int:
    """Pool pages for retrieval's GPU cache of selected host pages: what --kvmem-gpu-cache asks, at
    most 1 / HOT_POOL_SHARE of the pool; 0 (with a warning saying why, where it was asked for) where
    it cannot run or would hold less than one budget."""
    ret, cc = config.retrieval, config.cache
    asked = ret.cache_pages(cc.page_size)
    if not asked:
        return 0
    if cc.host_kv_mib <= 0 or device.type != "cuda":
        why = "it needs a CUDA device and a host tier (--host-kv-mib)"
    elif not graph_capable(ret, head_dim, device):
        why = f"selector {ret.selector} is not kernel-scored"
    else:
        hot = min(asked, num_pages // HOT_POOL_SHARE)
        if hot >= ret.page_counts(cc.page_size)[2]:
            return hot
        why = f"a quarter of the {num_pages}-page GPU pool is less than one budget of pages"
    log.warning("--kvmem-gpu-cache ignored: %s", why)
    return 0


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer | None, config: EngineConfig,
                 model_name: str = "model", max_model_len: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        spec = model.spec
        self.device = next(model.parameters()).device
        self.max_model_len = max_model_len or config.max_model_len or spec.max_position_embeddings
        cc = config.cache
        compute = compute_dtype(model)
        kv_dtype = cc.kv_dtype if cc.kv_dtype != "auto" else KV_DTYPE_FOR_COMPUTE[compute]
        fmt = make_format(kv_dtype)
        num_pages = cc.num_pages or self._auto_pages(fmt, spec)
        # Pinned spans (system prompt, tools, current turn) must fit the retrieval budget.
        self.pinned_budget = (PinnedBudget(config.retrieval, cc.page_size) if config.retrieval.enabled
                              else None)
        backend_name = ("retrieval" if config.retrieval.enabled
                        else choose_backend(config.attention_backend, self.device))
        graphs = self._use_graphs(backend_name, spec.head_dim)
        # CUDA graphs pad batches with rows that write their K/V into a page no sequence owns
        scratch = num_pages if graphs else None
        # retrieval past the GPU pool: the GPU cache of selected host pages (kernels/hot_pages.py)
        # takes the pool's last pages, which no sequence owns; the host tier grows by as many, so
        # the tiers hold as many tokens as planned
        hot = self.gpu_cache_pages = gpu_cache_pages(config, spec.head_dim, self.device, num_pages)
        self.pool = PagePool(fmt, spec.num_layers, num_pages + (1 if graphs else 0), spec.num_kv_heads,
                             cc.page_size, spec.head_dim, self.device, compute_dtype=compute)
        host_pages = 0
        self.host_pool = None
        if cc.host_kv_mib > 0:
            per_page = kv_bytes_per_token(fmt, spec.num_kv_heads, spec.head_dim, cc.page_size,
                                          compute) * spec.num_layers * cc.page_size
            host_pages = max(2, int(cc.host_kv_mib * 2**20 // per_page)) + hot
            self.host_pool = PagePool(fmt, spec.num_layers, host_pages, spec.num_kv_heads,
                                      cc.page_size, spec.head_dim, "cpu", compute_dtype=compute,
                                      pin=self.device.type == "cuda")
        self.kv_format = fmt.name
        if fmt.smooth_k:  # fixed smoothing constants before any request (engine/calibrate.py)
            calibrate_pool(model, self.pool, calibration_tokens(tokenizer, spec.vocab_size))
        self.manager = CacheManager(num_pages - hot, cc.page_size, num_host_pages=host_pages,
                                    enable_prefix=cc.enable_prefix_cache,
                                    namespace=f"{model_name}|{fmt.name}")
        chunk = prefill_chunk_for(self.device.type, config.prefill_chunk)
        self.scheduler = Scheduler(self.manager, config.max_batch, chunk)
        backend = make_backend(backend_name, self.pool, scale=spec.head_dim ** -0.5, host_store=self.host_pool,
                               max_context=self.max_model_len, retrieval=config.retrieval,
                               hot_pages=(num_pages - hot, hot) if hot else None)
        self.runner = ModelRunner(model, self.pool, backend, self.device, self.host_pool,
                                  max_seqs=config.max_batch, max_tokens=config.max_batch + chunk,
                                  max_model_len=self.max_model_len, scratch_page=scratch)
        self.graph_capture_seconds = self.runner.capture_graphs() if graphs else 0.0
        self.overlap = config.overlap == "on" or (config.overlap == "auto" and self.device.type == "cuda")
        self._inflight: _InFlight | None = None
        # pinned read-back buffers, one per step that can be in flight at once (this one, the last)
        pin = self.device.type == "cuda"
        self._readback = [torch.zeros(config.max_batch, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._readback_turn = 0
        self.overlap_steps = 0  # decode steps launched before the step before them was read back
        self._seqs: dict[str, Sequence] = {}
        self._outs: dict[str, _SeqOut] = {}
        self._all_threads = self._threads_now = torch.get_num_threads()
        self.steps = 0

    def _use_graphs(self, backend_name: str, head_dim: int) -> bool:
        """CUDA graphs: auto = on for a CUDA device with a graph-capable backend (triton; retrieval
        with a kernel-scored selector)."""
        mode = self.config.cuda_graphs
        ok = self.device.type == "cuda" and (
            backend_name == "triton"
            or (backend_name == "retrieval" and graph_capable(self.config.retrieval, head_dim, self.device)))
        if mode == "on" and not ok:
            raise ValueError("CUDA graphs need a CUDA device and the triton attention backend (or retrieval "
                             f"with selector {' / '.join(GRAPH_SELECTORS)})")
        return ok and mode != "off"

    def _auto_pages(self, fmt, spec) -> int:
        ps = self.config.cache.page_size
        compute = compute_dtype(self.model)
        per_page = kv_bytes_per_token(fmt, spec.num_kv_heads, spec.head_dim, ps, compute) * spec.num_layers * ps
        if self.config.cache.gpu_kv_mib:
            budget = self.config.cache.gpu_kv_mib * 2**20
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * GPU_KV_FRACTION
        else:
            budget = DEFAULT_CPU_KV_MIB * 2**20
        return max(2, int(budget // per_page))

    # ---- requests -------------------------------------------------------
    def check_fits(self, n: int, max_tokens: int) -> None:
        """Raise a ContextOverflowError for n prompt tokens + max_tokens past the context, or a
        prompt the KV cache could never hold (KVCapacityError). Fixed at start: any thread."""
        if n + max_tokens > self.max_model_len:
            raise ContextOverflowError(n, max_tokens, self.max_model_len)
        if n > self.manager.capacity_tokens:  # its prompt could never be prefilled
            raise KVCapacityError(n, max_tokens, self.manager.capacity_tokens)

    def add_request(self, req: Request) -> None:
        n, mt = len(req.prompt_token_ids), req.params.max_tokens
        if n == 0:
            raise ValueError("the prompt is empty")
        self.check_fits(n, mt)
        if req.request_id in self._seqs:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if self.pinned_budget is not None:
            self.pinned_budget.check(req.pinned_spans, n, mt)
        p = req.params
        gen = None
        if p.temperature > 0:
            gen = torch.Generator(device=self.device)  # noise is drawn where the logits are
            gen.manual_seed(p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little"))
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else frozenset()
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos)
        grammar = req.grammar.new_state() if req.grammar is not None else None
        seq = Sequence(request=req, tokens=list(req.prompt_token_ids), prompt_len=n)
        self._seqs[req.request_id] = seq
        self._outs[req.request_id] = _SeqOut(
            detok=(IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
                   if self.tokenizer is not None else _NoDetok()),
            stops=StopChecker(list(p.stop)),
            generator=gen, grammar=grammar, stop_ids=stop_ids)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> Output | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        return self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def request_ids(self) -> list[str]:
        """Ids of the requests added and not yet finished."""
        return list(self._seqs)

    # ---- the step -------------------------------------------------------
    def step(self) -> list[Output]:
        outputs: list[Output] = []
        if self._inflight is not None and not self._can_chain():
            outputs = self._read_back()
        batch = self.scheduler.schedule()
        if self._inflight is not None and not self._launchable(batch):
            # cannot happen after _can_chain said yes; stay correct if it does: the inputs of the
            # batch become known, sequences that stopped leave it (their pages are already freed)
            outputs += self._read_back()
            batch.seqs = [s for s in batch.seqs if s.seq.status is SeqStatus.RUNNING]
        if not batch:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing running and the head of the queue still does not fit: it never will
                seq = self.scheduler.waiting[0]
                outputs.append(self._finish(seq, "error", "the KV cache is too small for this request"))
            elif self.scheduler.running and self._inflight is None:
                # running sequences but none got a page and none could be preempted: the one left
                # has filled both tiers; it would wait forever. What it generated stands ("length").
                seq = self.scheduler.running[-1]
                if seq.in_prefill:
                    outputs.append(self._finish(seq, "error", f"the KV cache holds {self.manager.capacity_tokens:,} "
                                                              "tokens"))
                else:
                    outputs.append(self._finish(seq, "length"))
            return outputs
        self._set_threads(batch)
        if self.overlap and self._launchable(batch):
            return outputs + self._launch(batch)
        logits = self.runner.execute(batch)
        self.scheduler.after_step(batch)
        self.steps += 1
        sampled = [s for s in batch.seqs if s.sample]
        if sampled:
            tokens = self._sample(sampled, logits).tolist()
            for s, tok in zip(sampled, tokens):
                outputs.append(self._append(s.seq, tok))
        for s in batch.seqs:
            if not s.sample and s.seq.in_prefill:
                outputs.append(self._progress(s.seq))
        return outputs

    # ---- overlap scheduling (module docstring) ---------------------------
    def _launchable(self, batch: Batch) -> bool:
        """A decode step that may run with its tokens read back later: every row decodes one token
        and samples without reading its token history."""
        if not batch or not decode_step(batch):
            return False
        for s in batch.seqs:
            so = self._outs[s.seq.seq_id]
            if so.grammar is not None or needs_history(s.seq.request.params):
                return False
        return True

    def _can_chain(self) -> bool:
        """The next step may launch before the step in flight is read back: it will be exactly
        the in-flight sequences decoding once more, with pages to spare (module docstring)."""
        sch, ps = self.scheduler, self.manager.page_size
        if sch.waiting:
            return False
        live = [seq for seq in self._inflight.rows if self._seqs.get(seq.seq_id) is seq]
        if len(live) != len(sch.running) or any(seq.status is not SeqStatus.RUNNING for seq in live):
            return False
        new_pages = 0
        for seq in live:
            n = len(seq.tokens)  # the pending token included: it is the next step's input
            if seq.num_output >= seq.request.params.max_tokens or n >= self.max_model_len:
                return False  # the pending token is its last
            new_pages += (n - 1) % ps == 0
        return new_pages <= self.manager.num_free_gpu_pages()

    def _launch(self, batch: Batch) -> list[Output]:
        """Run a decode step, leave its sampled ids on the device, then read back the step before
        it (whose ids this one took as input). -> that step's outputs."""
        prev = self._inflight
        logits = self.runner.execute(batch, feed=self._feed(batch, prev) if prev is not None else None)
        rows = [s.seq for s in batch.seqs]
        tokens = self._sample(batch.seqs, logits)
        host = self._readback[self._readback_turn][:len(rows)]
        self._readback_turn ^= 1
        done = None
        if self.device.type == "cuda":
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host.copy_(tokens)
        index = [len(seq.tokens) for seq in rows]
        for seq in rows:
            seq.tokens.append(PENDING_TOKEN)
        self._inflight = _InFlight(rows, index, tokens, host, done)
        self.steps += 1
        self.overlap_steps += prev is not None
        outputs = self._read_back(prev) if prev is not None else []
        # KV commits hash tokens[:num_computed]: this step's inputs are known only now
        self.scheduler.after_step(Batch([s for s in batch.seqs if s.seq.status is SeqStatus.RUNNING]))
        return outputs

    def _feed(self, batch: Batch, prev: _InFlight) -> Feed:
        """Where each row's pending input id lies in the step before's device tensor."""
        at = {id(seq): j for j, seq in enumerate(prev.rows)}
        dst, src = [], []
        for b, s in enumerate(batch.seqs):
            if s.seq.tokens[s.start] == PENDING_TOKEN:
                dst.append(b)
                src.append(at[id(s.seq)])
        if dst == src == list(range(len(dst))):
            return Feed(prev.tokens, len(dst))
        return Feed(prev.tokens, len(dst), to_device(dst, torch.int64, self.device),
                    to_device(src, torch.int64, self.device))

    def _read_back(self, flight: _InFlight | None = None) -> list[Output]:
        """Wait for a launched step's ids (default: the one in flight, which is then done) and
        append them as the synchronous path does; rows whose request has ended are dropped."""
        if flight is None:
            flight, self._inflight = self._inflight, None
        if flight.done is not None:
            flight.done.synchronize()
        outputs = []
        for seq, i, tok in zip(flight.rows, flight.index, flight.host.tolist()):
            if self._seqs.get(seq.seq_id) is not seq:
                continue  # finished (a stop one step back) or aborted since its launch
            later = seq.tokens[i + 1:]  # the next step's pending token, if it was launched
            del seq.tokens[i:]
            out = self._append(seq, tok)
            if not out.finished:
                seq.tokens += later
            outputs.append(out)
        return outputs

    def _set_threads(self, batch) -> None:
        """CPU: decode-only steps on `decode_threads` (`--decode-threads`; default: all threads),
        others on all threads.

        Measured on the 2-core box, SmolLM2 streamed through `kvtier serve` (256-token prompt,
        256 generated): 95.0 tok/s on 2 threads, 77.6 on 1, once the engine is built on its step
        thread (AsyncEngine.start). Stepped on another thread than the one that built it, 2
        threads gave 34 tok/s: two OpenMP teams, and libgomp stops spin-waiting at barriers.
        """
        want = self.config.decode_threads
        if self.device.type != "cpu" or want is None:
            return
        if batch.num_tokens != len(batch.seqs):  # some sequence brings more than one token
            want = self._all_threads
        if want != self._threads_now:
            torch.set_num_threads(want)
            self._threads_now = want

    def _sample(self, sampled, logits: torch.Tensor) -> torch.Tensor:
        """-> sampled ids [rows] int64 on the logits' device."""
        params = [s.seq.request.params for s in sampled]
        outs = [self._outs[s.seq.seq_id] for s in sampled]
        masks = [o.grammar.allowed_mask() if o.grammar is not None else None for o in outs]
        return sample(logits, params, [o.generator for o in outs], [s.seq.tokens for s in sampled],
                      masks, prompt_lens=[s.seq.prompt_len for s in sampled])

    def _append(self, seq: Sequence, tok: int) -> Output:
        so = self._outs[seq.seq_id]
        seq.tokens.append(tok)
        so.output_ids.append(tok)
        if so.grammar is not None:
            so.grammar.accept(tok)
        p = seq.request.params
        if tok in so.stop_ids:
            return self._finish(seq, "stop", stop_reason=tok, last_token=tok)
        text, matched = so.stops.feed(so.detok.push(tok))
        if matched is not None:
            return self._finish(seq, "stop", stop_reason=matched, last_token=tok, text=text)
        if so.grammar is not None and so.grammar.is_terminated():
            return self._finish(seq, "stop", last_token=tok, text=text)
        if seq.num_output >= p.max_tokens or len(seq.tokens) >= self.max_model_len:
            return self._finish(seq, "length", last_token=tok, text=text)
        return Output(request_id=seq.seq_id, token_ids=[tok], text=text, usage=self._usage(seq))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, stop_reason=None,
                last_token: int | None = None, text: str = "") -> Output:
        so = self._outs.pop(seq.seq_id)
        self._seqs.pop(seq.seq_id, None)
        while seq.tokens and seq.tokens[-1] == PENDING_TOKEN:  # aborted with a step in flight
            seq.tokens.pop()
        self.scheduler.finish(seq)
        if not isinstance(stop_reason, str):  # not a stop string: release held-back text
            text += so.stops.feed(so.detok.flush())[0] + so.stops.flush()
        return Output(request_id=seq.seq_id, token_ids=[] if last_token is None else [last_token],
                      text=text, finish_reason=reason, stop_reason=stop_reason,
                      usage=self._usage(seq), error=error)

    def _usage(self, seq: Sequence) -> Usage:
        return Usage(prompt_tokens=seq.prompt_len, cached_tokens=seq.cached_tokens,
                     cached_host_tokens=seq.cached_host_tokens,
                     computed_tokens=seq.prompt_len - seq.cached_tokens,
                     completion_tokens=seq.num_output)

    def _progress(self, seq: Sequence) -> Output:
        return Output(request_id=seq.seq_id, usage=self._usage(seq),
                      progress=Progress(processed=seq.num_computed, total=seq.prompt_len,
                                        cached=seq.cached_tokens))

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "steps": self.steps, "preemptions": self.scheduler.preemptions,
                "kv_format": self.kv_format, "gpu_pages": self.manager.num_gpu_pages,
                "device": self.device.type, "attention_backend": self.runner.backend.name,
                "graph_steps": self.runner.graph_steps, "overlap_steps": self.overlap_steps,
                "host_pages": self.host_pool.num_pages if self.host_pool else 0,
                "cache": cache_stats(self.manager, self.pool, self.host_pool)}

    # ---- convenience ----------------------------------------------------
    def generate_sync(self, requests: list[Request]) -> dict[str, list[Output]]:
        """Run requests to completion (tests, CLI). Returns all outputs per request id."""
        results: dict[str, list[Output]] = {r.request_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        while self.has_unfinished():
            for o in self.step():
                results[o.request_id].append(o)
        return results


class AsyncEngine:
    """asyncio front end: the step loop runs in its own thread.

    generate() enqueues a request and drains its outputs; a slow client never
    stalls a step. abort() (client disconnect) takes effect before the next step.
    """

    def __init__(self, engine: Engine):
        self._setup(engine)
        self._thread = threading.Thread(target=self._loop, name="kvtier-engine", daemon=True)
        self._thread.start()

    def _setup(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.pinned_budget = engine.pinned_budget  # None: dense attention, the server pins nothing
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model.spec.vocab_size  # logits width (grammar masks match it)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None

    @classmethod
    def start(cls, build: Callable[[], Engine]) -> "AsyncEngine":
        """Build the engine on the step thread itself, then run the step loop there; returns once
        it is built (a build error is raised here).

        On CPU this keeps every torch op of the engine on one thread: libgomp gives each thread
        that runs parallel regions its own OpenMP team, and with two teams' threads on more
        threads than cores it cuts its spin-waiting short (a futex sleep and wake at every
        barrier). Measured on the 2-core box, SmolLM2 decode with 2 threads: 102 tok/s with the
        engine built and stepped on one thread, 36 tok/s stepped on a thread other than the one
        that built it."""
        self = cls.__new__(cls)
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self._setup(build())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failed.append(e)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=run, name="kvtier-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self

    async def generate(self, request: Request) -> AsyncIterator[Output]:
        self.engine.check_fits(len(request.prompt_token_ids), request.params.max_tokens)
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._streams[request.request_id] = (asyncio.get_running_loop(), q)
        self._inbox.put(("add", request))
        self._wake.set()
        finished = False
        try:
            while True:
                out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:  # consumer went away (disconnect, cancellation)
                self.abort(request.request_id)
            with self._lock:
                self._streams.pop(request.request_id, None)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        return self.engine.stats()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _deliver(self, out: Output | BaseException, request_id: str) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(arg)
                except Exception as e:  # validation errors go back to the caller
                    self._deliver(e, arg.request_id)
            else:
                out = self.engine.abort(arg)
                if out is not None:
                    self._deliver(out, arg)

    def _loop(self) -> None:
        while not self._stopped:
            self._drain_inbox()
            if not self.engine.has_unfinished():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails its requests, not the server
                self._fail_all(e)
                continue
            for out in outputs:
                self._deliver(out, out.request_id)

    def _fail_all(self, exc: Exception) -> None:
        for rid in self.engine.request_ids():
            out = self.engine.abort(rid)
            if out is not None:
                out.finish_reason, out.error = "error", f"engine step failed: {exc}"
                self._deliver(out, rid)
