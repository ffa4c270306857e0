"""StepPlanner: a scheduler Batch -> the step's input tensors, in persistent device buffers.

Everything a forward reads about the batch is written by the host into pinned
staging (numpy views, no torch ops per token) and moved to the device with one
non-blocking copy per buffer. The device buffers never move, so a CUDA graph
captured over them replays any later step of its batch size:

    int64 staging / device buffer `ids` (capacity T = max_tokens):
        | input_ids [T] | positions [T] | slot_mapping [T] | logits_indices [B] |
    int32 staging / device buffer `tables` (capacity B = max_seqs, P = max_pages):
        | seq_lens [B] | query_start_loc [B + 1] | block_table [B * P] (row b: its pages, then 0s) |

Only the used head of each region is copied. Staging is double-buffered: the
copy of step n may still be in flight while step n + 1 is written into the
other half (an event guards each half's reuse).

Padding rows (a graph captured for more sequences than the step has) get
seq_len 0, token 0, position 0 and a slot in the runner's scratch page, so they
write only there and attend to nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier.engine.scheduler import Batch
from kvtier.layers.attention import AttentionMetadata


# Staging halves: step n's copies can be in flight while step n + 1 is being written.
STAGING_BUFFERS = 2


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64 (device)
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    num_rows: int  # rows actually scheduled (<= meta.num_seqs with padding)


def decode_step(batch: Batch) -> bool:
    """Every sequence decodes one sampled token, not its first: the step a captured decode graph
    runs (the one place this is decided; the planner records it in AttentionMetadata.decode_step).
    Whether its tables reach into the host tier is `reads_host`: a second graph variant."""
    return all(s.num_tokens == 1 and s.start > 0 and s.sample for s in batch.seqs)


def reads_host(batch: Batch) -> bool:
    """Some sequence's page table starts with host-tier pages (negative ids head a table): which
    graph variant a step replays, known before planning (AttentionMetadata.reads_host, the same
    fact, is derived from the planned tables)."""
    return any(s.page_table and s.page_table[0] < 0 for s in batch.seqs)


def pinned_page_indices(spans: tuple[tuple[int, int], ...], page_size: int, num_pages: int) -> list[int]:
    """Sorted page indices (position // page_size) touched by the half-open token `spans`, each
    rounded out to whole pages, below `num_pages` (the pages the step's sequence has):

        spans [(0, 5), (13, 20)], page_size 4 -> pages 0, 1 and 3, 4 (page 2 = tokens 8..11 is not)
    """
    pages: list[int] = []
    for start, end in spans:
        first = max(start // page_size, pages[-1] + 1 if pages else 0)
        pages.extend(range(first, min(-(-end // page_size), num_pages)))
    return pages


@dataclass
class Feed:
    """Input ids a step takes from a device tensor instead of the host: row dst[i] of the step
    (a decode: one token a row) reads tokens[src[i]]. dst / src None: rows 0..n-1 read
    tokens[0..n-1] (the common case: the same sequences in the same order as the step before)."""

    tokens: torch.Tensor  # [rows of the step before] int64, on the device
    n: int
    dst: torch.Tensor | None = None
    src: torch.Tensor | None = None

    def apply(self, input_ids: torch.Tensor) -> None:
        if self.dst is None:
            input_ids[:self.n].copy_(self.tokens[:self.n])
        else:
            input_ids.index_copy_(0, self.dst, self.tokens.index_select(0, self.src))


class _Staging:
    """One half of the pinned staging: int64 and int32 host arrays plus the copy's event."""

    def __init__(self, n64: int, n32: int, pin: bool):
        self.i64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.i32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.np64 = self.i64.numpy()
        self.np32 = self.i32.numpy()
        self.done: torch.cuda.Event | None = None


class StepPlanner:
    """Fills fixed-capacity device buffers for each step (see the module docstring)."""

    def __init__(self, device: torch.device, page_size: int, max_tokens: int, max_seqs: int,
                 max_pages: int, scratch_slot: int = 0):
        """max_tokens: most packed tokens in a step; max_seqs: most sequences; max_pages: the
        longest page table; scratch_slot: where padding rows write their K/V (a page no
        sequence owns)."""
        self.device = device
        self.page_size = page_size
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        self.scratch_slot = scratch_slot
        t, b, p = max_tokens, max_seqs, max_pages
        n64, n32 = 3 * t + b, 2 * b + 1 + b * p
        pin = device.type == "cuda"
        self._staging = [_Staging(n64, n32, pin) for _ in range(STAGING_BUFFERS if pin else 1)]
        self._turn = 0
        self.ids = torch.zeros(n64, dtype=torch.int64, device=device)
        self.tables = torch.zeros(n32, dtype=torch.int32, device=device)
        self.input_ids = self.ids[:t]
        self.positions = self.ids[t:2 * t]
        self.slot_mapping = self.ids[2 * t:3 * t]
        self.logits_indices = self.ids[3 * t:]
        self.seq_lens = self.tables[:b]
        self.query_start_loc = self.tables[b:2 * b + 1]
        self.block_table = self.tables[2 * b + 1:].view(b, p)

    def fits(self, batch: Batch) -> bool:
        ps = self.page_size
        return (len(batch.seqs) <= self.max_seqs and batch.num_tokens <= self.max_tokens
                and all(-(-(s.start + s.num_tokens) // ps) <= self.max_pages for s in batch.seqs))

    def plan(self, batch: Batch, pad_to: int = 0, max_seq_len: int = 0, feed: Feed | None = None) -> StepInputs:
        """Stage and copy one step. pad_to: fill rows up to this many sequences (graphs),
        every sequence bringing one token; max_seq_len: the meta's context bound (0: exact);
        feed: input ids still on the device (sampled by the step before, overlap scheduling),
        copied over the staged ones."""
        if not self.fits(batch):
            raise ValueError("step exceeds the planner's capacity")
        st = self._next_staging()
        t_cap, b_cap, p_cap, ps = self.max_tokens, self.max_seqs, self.max_pages, self.page_size
        a64, a32 = st.np64, st.np32
        ids, pos, slots = a64[:t_cap], a64[t_cap:2 * t_cap], a64[2 * t_cap:3 * t_cap]
        rows_out, lens, qsl_out = a64[3 * t_cap:], a32[:b_cap], a32[b_cap:2 * b_cap + 1]
        table = a32[2 * b_cap + 1:].reshape(b_cap, p_cap)
        qsl_out[0] = 0
        qsl, seq_lens, tables, rows = [0], [], [], []
        t = 0
        for b, s in enumerate(batch.seqs):
            n, start = s.num_tokens, s.start
            end = start + n
            used = s.page_table[:-(-end // ps)]
            if n == 1:  # decode: scalar writes beat numpy's per-call overhead
                ids[t] = s.seq.tokens[start]
                pos[t] = start
                slots[t] = used[start // ps] * ps + start % ps
            else:
                ids[t:t + n] = s.seq.tokens[start:end]
                p = np.arange(start, end)
                pos[t:t + n] = p
                slots[t:t + n] = np.asarray(used)[p // ps] * ps + p % ps
            t += n
            table[b, :len(used)] = used
            table[b, len(used):] = 0
            lens[b] = end
            qsl_out[b + 1] = t
            qsl.append(t)
            seq_lens.append(end)
            tables.append(s.page_table)
            if s.sample:
                rows_out[len(rows)] = t - 1
                rows.append(t - 1)
        n_rows = len(batch.seqs)
        n_seqs, n_tok, n_out = n_rows, t, len(rows)
        if pad_to > n_rows:  # graph padding: one token per row, nothing attended
            extra = pad_to - n_rows
            ids[t:t + extra] = 0
            pos[t:t + extra] = 0
            slots[t:t + extra] = self.scratch_slot
            rows_out[n_out:n_out + extra] = np.arange(t, t + extra)
            lens[n_rows:pad_to] = 0
            qsl_out[n_rows + 1:pad_to + 1] = np.arange(t + 1, t + extra + 1)
            table[n_rows:pad_to] = 0
            n_seqs, n_tok, n_out = pad_to, t + extra, n_out + extra
        self._copy(st, n_tok, n_out, n_seqs)
        if feed is not None:
            feed.apply(self.input_ids)
        pinned = None
        if any(s.seq.pinned_spans for s in batch.seqs):
            pinned = [pinned_page_indices(s.seq.pinned_spans, ps, -(-(s.start + s.num_tokens) // ps))
                      for s in batch.seqs]
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, page_tables=tables,
            slot_mapping=self.slot_mapping[:n_tok], logits_indices=self.logits_indices[:n_out],
            block_table=self.block_table[:n_seqs], seq_lens_t=self.seq_lens[:n_seqs],
            query_start_loc_t=self.query_start_loc[:n_seqs + 1],
            max_seq_len=max_seq_len or max(seq_lens, default=1), decode_step=decode_step(batch),
            pinned_pages=pinned)
        return StepInputs(self.input_ids[:n_tok], self.positions[:n_tok], meta, n_rows)

    def idle_inputs(self, n_seqs: int, max_seq_len: int, host: bool = False) -> StepInputs:
        """Inputs over the persistent buffers for capturing a decode graph of n_seqs rows, filled
        as padding rows (nothing attended, K/V to the scratch slot); host: the variant whose
        tables may name host-tier pages. The Python lists describe a placeholder step: backends
        must not read them in graphs."""
        self.input_ids[:n_seqs].zero_()
        self.positions[:n_seqs].zero_()
        self.slot_mapping[:n_seqs].fill_(self.scratch_slot)
        self.logits_indices[:n_seqs].copy_(torch.arange(n_seqs))
        self.seq_lens[:n_seqs].zero_()
        self.query_start_loc[:n_seqs + 1].copy_(torch.arange(n_seqs + 1))
        self.block_table[:n_seqs].zero_()
        return StepInputs(self.input_ids[:n_seqs], self.positions[:n_seqs], AttentionMetadata(
            query_start_loc=list(range(n_seqs + 1)), seq_lens=[max_seq_len] * n_seqs,
            page_tables=[[0]] * n_seqs, slot_mapping=self.slot_mapping[:n_seqs],
            logits_indices=self.logits_indices[:n_seqs], block_table=self.block_table[:n_seqs],
            seq_lens_t=self.seq_lens[:n_seqs], query_start_loc_t=self.query_start_loc[:n_seqs + 1],
            max_seq_len=max_seq_len, decode_step=True, reads_host=host), n_seqs)

    def _next_staging(self) -> _Staging:
        st = self._staging[self._turn]
        self._turn = (self._turn + 1) % len(self._staging)
        if st.done is not None:
            st.done.synchronize()  # its previous copy has left the host buffer
        return st

    def _copy(self, st: _Staging, n_tok: int, n_out: int, n_seqs: int) -> None:
        """Two copies: each buffer from its start to the end of its last used region (the
        unused gaps between regions cost fewer bytes than more copies cost launches)."""
        t, b, p = self.max_tokens, self.max_seqs, self.max_pages
        nb = self.device.type == "cuda"
        n64, n32 = 3 * t + n_out, 2 * b + 1 + n_seqs * p
        self.ids[:n64].copy_(st.i64[:n64], non_blocking=nb)
        self.tables[:n32].copy_(st.i32[:n32], non_blocking=nb)
        if nb:
            st.done = torch.cuda.Event()
            st.done.record()
