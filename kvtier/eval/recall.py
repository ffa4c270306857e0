"""`kvtier eval recall`: passkey recall and fidelity of retrieval attention against dense attention.

Recall (synthetic passkey, offline): a haystack of `length` tokens, either one sentence group
repeated ("repeated", the classic passkey filler) or running English prose ("varied": the Python
Language Reference shipped with CPython, from a seeded offset), holds 1 or 3 needles ("The pass key
is 12345. Remember it. 12345 is the pass key."); 3 needles sit at depths d, d + 1/3, d + 2/3
(mod 1). The prompt ends with a question; a trial is found when the greedy answer contains every
key. For each (length, depth, trial) the prompt is prefilled ONCE (prefill is dense in every
method) and then decoded by dense attention and by each selector over the same pages, so the
methods differ only in what the decode rows attend to.

Fidelity (natural text): the same prose, teacher-forced past the budget: mean KL(dense || method)
of the next-token distributions, top-1 agreement with dense, and the share of the dense softmax
mass the selected pages cover (mean over decode rows, layers and query heads).

Prompts are cut to a whole number of pages, so decoded tokens start a fresh page: the page
summaries of the prompt stay those of the prompt whichever method decodes after another.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.config import DEFAULT_SINK, DEFAULT_WINDOW, SELECTORS
from kvtier.eval import retrieval_methods
from kvtier.kv.formats import PlainFormat
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionMetadata, DensePagedAttention
from kvtier.layers.retrieval import RetrievalAttention, refresh_from_pool
from kvtier.models.decoder import compute_dtype

DENSE = "dense"
HAYSTACKS = ("repeated", "varied")
REPEATED_FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
INTRO = ("There is important information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about it.\n")
QUESTION = {1: "\nWhat is the pass key? The pass key is",
            3: "\nWhat are the three pass keys? The three pass keys are"}
# Chat prompts (an instruct model's own template): the question ends the user turn, the answer's
# first words open the assistant turn.
CHAT_QUESTION = {1: ("\nWhat is the pass key?", "The pass key is"),
                 3: ("\nWhat are the three pass keys?", "The three pass keys are")}
PROMPT_FORMATS = ("auto", "raw", "chat")
_USER_MARK = "\ue000"  # a private-use character no template or prompt contains
# Greedy tokens per needle: a 5-digit key is 1-5 tokens, plus a separator or two.
TOKENS_PER_NEEDLE = 8
from kvtier.config import DEFAULT_PAGE_SIZE  # noqa: E402
# Prefill chunk: bounds the [chunk, context] attention of the dense reference path.
PREFILL_CHUNK = {"cpu": 512, "cuda": 2048}


@dataclass(frozen=True)
class Trial:
    haystack: str
    needles: int
    length: int
    depth: float
    trial: int
    method: str
    found: bool
    answer: str
    mass: float | None  # retrieval methods with recording: mean selected share of dense mass


@dataclass(frozen=True)
class Fidelity:
    method: str
    mean_kl: float
    top1_agree: float
    mass: float | None


class _Runner:
    """One sequence at a time over pages 0..n-1 of a pool sized for the longest prompt."""

    def __init__(self, model: torch.nn.Module, max_tokens: int, budget: int, selectors: list[str],
                 sink: int, window: int, page_size: int, record: bool):
        layers, kv_heads, head_dim = model.kv_shape
        self.model = model
        self.device = next(model.parameters()).device
        dtype = compute_dtype(model)
        self.ps = page_size
        pages = -(-max_tokens // page_size) + 1
        self.pool = PagePool(PlainFormat(dtype), layers, pages, kv_heads, page_size, head_dim, self.device,
                             compute_dtype=dtype)
        self.table = list(range(pages))
        scale = head_dim ** -0.5
        # a selector named "<selector>/8" scores 8-bit summaries (kv/summaries.py), the others share 16-bit ones
        self.summaries, methods = retrieval_methods(self.pool, scale, selectors, budget, sink, window, record)
        self.backends: dict[str, object] = {DENSE: DensePagedAttention(self.pool, scale), **methods}
        # prefill: dense attention in every method; a retrieval backend also fills its summaries
        # (the others are recomputed from the pool's keys after it: `_sync_summaries`)
        self.prefill_backend = self.backends[selectors[0]] if selectors else self.backends[DENSE]
        self.chunk = PREFILL_CHUNK.get(self.device.type, 2048)

    def step(self, backend: object, ids: list[int], start: int, want_all: bool = False) -> torch.Tensor:
        """Run tokens `ids` at positions start.. -> fp32 logits of the last row ([n, V] if want_all)."""
        n = len(ids)
        rows = torch.arange(n if want_all else 1, device=self.device) + (0 if want_all else n - 1)
        meta = AttentionMetadata(query_start_loc=[0, n], seq_lens=[start + n], page_tables=[self.table],
                                 slot_mapping=torch.arange(start, start + n, device=self.device),
                                 logits_indices=rows)
        backend.plan(meta)  # type: ignore[attr-defined]
        pos = torch.arange(start, start + n, device=self.device)
        return self.model(torch.tensor(ids, device=self.device), pos, meta, backend)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """-> logits [V] after the last prompt token."""
        for lo in range(0, len(ids), self.chunk):
            logits = self.step(self.prefill_backend, ids[lo:lo + self.chunk], lo)
        self._sync_summaries(len(ids))
        return logits[-1]

    def _sync_summaries(self, n: int) -> None:
        """Summaries the prefill backend does not own: recomputed from the pool's keys (a plain
        format: the keys as written) for the prompt's n rows, as incremental updates would give."""
        own = getattr(self.prefill_backend, "summaries", None)
        others = [summ for summ in self.summaries.values() if summ is not own]
        if not others or n == 0:
            return
        ids = torch.arange(-(-n // self.ps), device=self.device)
        rows = (n - ids * self.ps).clamp(max=self.ps).to(torch.int32)
        refresh_from_pool(self.pool, others, ids, rows)

    def greedy(self, method: str, first: int, start: int, max_new: int, stop: frozenset[int]) -> list[int]:
        """Greedy decode from `first` (sampled from the prefill) at position `start`."""
        out = [first]
        while len(out) < max_new and out[-1] not in stop:
            out.append(int(self.step(self.backends[method], [out[-1]], start + len(out) - 1)[-1].argmax()))
        return out

    def take_mass(self, method: str) -> float | None:
        be = self.backends[method]
        if not isinstance(be, RetrievalAttention) or not be.mass_log:
            return None
        m = float(torch.cat(be.mass_log).mean())
        be.mass_log.clear()
        return m


def _filler(tok, haystack: str, n: int, rng: random.Random) -> list[int]:
    """n filler tokens: the repeated sentence group, or prose from a seeded offset (wrapping)."""
    if haystack == "repeated":
        unit = tok.encode(REPEATED_FILLER)
        return (unit * (n // len(unit) + 1))[:n]
    from kvtier.engine.calibrate import prose_text
    text = prose_text()
    start = rng.randrange(len(text) // 2)
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(text[start:start + 8 * n])
        start = 0
    return ids[:n]


def chat_frame(tok) -> tuple[str, str] | None:
    """(text before, text after) the user's content in a one-turn chat with the generation prompt,
    from the model's template; None without one."""
    if not getattr(tok, "chat_template", None):
        return None
    text = tok.apply_chat_template([{"role": "user", "content": _USER_MARK}], add_generation_prompt=True)
    before, _, after = text.partition(_USER_MARK)
    return before, after


def build_prompt(tok, length: int, depth: float, needles: int, haystack: str, rng: random.Random,
                 page_size: int, chat: bool = False) -> tuple[list[int], list[str]]:
    """-> (prompt ids, a multiple of page_size long and <= length, the keys planted). chat: the
    intro, haystack and question as one user turn in the model's template, the answer's first
    words after the generation prompt."""
    keys = [str(rng.randrange(10000, 100000)) for _ in range(needles)]
    needle_ids = [tok.encode(f" The pass key is {k}. Remember it. {k} is the pass key.") for k in keys]
    frame = chat_frame(tok) if chat else None
    if chat and frame is None:
        raise ValueError("chat prompts need a model with a chat template")
    if frame is None:
        head, tail = tok.encode(INTRO), tok.encode(QUESTION[needles])
    else:
        question, primer = CHAT_QUESTION[needles]
        head = tok.encode(frame[0]) + tok.encode(INTRO)
        tail = tok.encode(question) + tok.encode(frame[1]) + tok.encode(primer)
    total = length - length % page_size
    n_fill = total - len(head) - len(tail) - sum(map(len, needle_ids))
    if n_fill < needles:
        raise ValueError(f"length {length} is too short for {needles} needle(s) and the question")
    fill = _filler(tok, haystack, n_fill, rng)
    cuts = sorted((int(((depth + i / needles) % 1.0) * n_fill), i) for i in range(needles))
    body, last = [], 0
    for cut, i in cuts:
        body += fill[last:cut] + needle_ids[i]
        last = cut
    body += fill[last:]
    return head + body + tail, keys


@torch.inference_mode()
def run_recall(model: torch.nn.Module, tok, lengths: list[int], depths: list[float], trials: int = 3,
               needles: int = 1, haystack: str = "repeated", budget: int = 1024,
               selectors: list[str] | None = None, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
               seed: int = 0, page_size: int = DEFAULT_PAGE_SIZE, record_mass: bool = False,
               prompt_format: str = "raw", on_prompt: Callable[[list[Trial]], None] | None = None) -> list[Trial]:
    """Every (length, depth, trial) prompt, decoded by dense attention and each selector.
    prompt_format: raw text, chat (the model's template), auto (chat when the model has one).
    on_prompt: called with each prompt's trials (one per method) as it finishes."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(PROMPT_FORMATS)}")
    chat = prompt_format == "chat" or (prompt_format == "auto" and chat_frame(tok) is not None)
    if needles not in QUESTION or haystack not in HAYSTACKS:
        raise ValueError(f"needles must be 1 or 3 and haystack one of {', '.join(HAYSTACKS)}")
    selectors = list(SELECTORS[:1] if selectors is None else selectors)
    max_new = TOKENS_PER_NEEDLE * needles
    runner = _Runner(model, max(lengths) + max_new, budget, selectors, sink, window, page_size, record_mass)
    stop = frozenset(tok.eos_token_ids)
    out = []
    for length in lengths:
        for depth in depths:
            for t in range(trials):
                rng = random.Random(f"{seed}:{haystack}:{needles}:{length}:{depth}:{t}")
                ids, keys = build_prompt(tok, length, depth, needles, haystack, rng, page_size, chat)
                first = int(runner.prefill(ids).argmax())
                done = []
                for method in [DENSE, *selectors]:
                    gen = runner.greedy(method, first, len(ids), max_new, stop)
                    answer = tok.decode(gen, skip_special_tokens=True)
                    done.append(Trial(haystack, needles, length, depth, t, method,
                                      all(k in answer for k in keys), answer, runner.take_mass(method)))
                out += done
                if on_prompt is not None:
                    on_prompt(done)
    return out


@torch.inference_mode()
def run_fidelity(model: torch.nn.Module, tokens: list[int], n_eval: int, budget: int, selectors: list[str],
                 sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
                 page_size: int = DEFAULT_PAGE_SIZE) -> list[Fidelity]:
    """Teacher-forced decode of tokens[n:n + n_eval] after a prefill of the first n = len(tokens) -
    n_eval (cut to whole pages): KL, top-1 agreement and covered mass of each selector vs dense."""
    n = (len(tokens) - n_eval) // page_size * page_size
    runner = _Runner(model, n + n_eval, budget, selectors, sink, window, page_size, record=True)
    runner.prefill(tokens[:n])
    logp: dict[str, torch.Tensor] = {}
    for method in [DENSE, *selectors]:
        rows = [torch.log_softmax(runner.step(runner.backends[method], [tokens[n + i]], n + i)[-1], -1)
                for i in range(n_eval)]
        logp[method] = torch.stack(rows).cpu()  # [n_eval, V]
    ref = logp[DENSE]
    res = []
    for method in selectors:
        lp = logp[method]
        kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)
        res.append(Fidelity(method, float(kl.mean()), float((lp.argmax(-1) == ref.argmax(-1)).float().mean()),
                            runner.take_mass(method)))
    return res


def summarize(trials: list[Trial]) -> list[list[str]]:
    """Rows: haystack, needles, length, depth, then found/trials per method (methods in run order)."""
    methods = list(dict.fromkeys(t.method for t in trials))
    cells: dict[tuple, dict[str, list[Trial]]] = {}
    for t in trials:
        cells.setdefault((t.haystack, t.needles, t.length, t.depth), {}).setdefault(t.method, []).append(t)
    rows = []
    for (hay, nd, length, depth), by in cells.items():
        row = [hay, str(nd), str(length), f"{depth:.2f}"]
        for m in methods:
            ts = by.get(m, [])
            mass = [t.mass for t in ts if t.mass is not None]
            row.append(f"{sum(t.found for t in ts)}/{len(ts)}" + (f" ({sum(mass) / len(mass):.2f})" if mass else ""))
        rows.append(row)
    total = ["all", "", "", ""] + [f"{sum(t.found for t in trials if t.method == m)}/"
                                   f"{sum(t.method == m for t in trials)}" for m in methods]
    return [["haystack", "needles", "length", "depth", *methods], *rows, total]


def to_markdown(table: list[list[str]]) -> str:
    head, *rows = table
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def print_table(title: str, table: list[list[str]], console=None) -> str:
    """Print a header row + rows as a rich table; -> the same as a markdown section (title as ###)."""
    from rich.console import Console
    from rich.table import Table
    out = Table(title=title)
    for h in table[0]:
        out.add_column(h)
    for r in table[1:]:
        out.add_row(*r)
    (console or Console()).print(out)
    return f"### {title}\n\n{to_markdown(table)}"


def _progress():
    """A rich progress bar on stderr: prompts done, the last prompt's result, time so far and left."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True))


def load(model: str, device: str, dtype: str, weights: str = "auto"):
    """(Decoder, Tokenizer) as `kvtier serve` would run them with these options (engine/build.py:
    on a bf16 CPU, bf16 with the file's quantized weights; `--dtype fp32` for the fp32 reference)."""
    from kvtier.config import EngineConfig
    from kvtier.engine.build import load_model, resolve_device
    from kvtier.models.hub import resolve_model
    from kvtier.models.tokenizer import Tokenizer

    config = resolve_device(EngineConfig(device=device, dtype=dtype, weights=weights))
    net, ckpt = load_model(resolve_model(model), config)
    return net, Tokenizer.from_checkpoint(ckpt)


def main(args: argparse.Namespace) -> int:
    selectors = [s for s in args.selectors.split(",") if s]
    model, tok = load(args.model, args.device, args.dtype, args.weights)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    hays, counts = args.haystack.split(","), [int(x) for x in args.needles.split(",")]
    trials: list[Trial] = []
    with _progress() as prog:
        task = prog.add_task("recall prompts", total=len(hays) * len(counts) * len(lengths) * len(depths) * args.trials)

        def advance(done: list[Trial]) -> None:
            t = done[0]
            found = " ".join(f"{x.method} {'+' if x.found else '-'}" for x in done)
            prog.update(task, advance=1, description=f"{t.needles} needle(s), {t.length} tokens, depth {t.depth:.2f}: {found}")

        for hay in hays:
            for nd in counts:
                trials += run_recall(model, tok, lengths, depths, args.trials, nd, hay, args.budget, selectors,
                                     args.sink, args.window, args.seed, args.page_size, args.mass, args.prompt_format,
                                     on_prompt=advance)
    table = summarize(trials)
    fmt = args.prompt_format if args.prompt_format != "auto" else ("chat" if chat_frame(tok) else "raw")
    title = (f"{args.model}: passkey recall ({fmt} prompts), budget {args.budget} (sink {args.sink}, "
             f"window {args.window}, page {args.page_size}){'; (mean selected mass)' if args.mass else ''}")
    md = [print_table(title, table)]
    if args.fidelity_tokens:
        from kvtier.engine.calibrate import prose_text
        tokens = tok.encode(prose_text())[:max(lengths) + args.fidelity_tokens]
        fid = run_fidelity(model, tokens, args.fidelity_tokens, args.budget, selectors, args.sink, args.window,
                           args.page_size)
        ft = [["method", "mean KL vs dense (nats)", "top-1 agree", "selected mass"]] + [
            [f.method, f"{f.mean_kl:.3e}", f"{100 * f.top1_agree:.1f}%", "-" if f.mass is None else f"{f.mass:.3f}"]
            for f in fid]
        ftitle = f"natural text: {len(tokens) - args.fidelity_tokens} tokens, {args.fidelity_tokens} teacher-forced"
        md += ["", print_table(ftitle, ft)]
    if args.markdown:
        args.markdown.write_text("\n".join(md) + "\n")
    return 0
