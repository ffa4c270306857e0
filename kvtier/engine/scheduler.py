"""Continuous batching with chunked prefill. Plain Python: no torch here.

Each step the scheduler builds one `Batch`: every running sequence gets the
next slice of tokens whose KV is not yet computed, decodes (1 token) first,
then prefill chunks, within a token budget. A sequence's tokens:

    tokens:   | prompt .................. | generated ... |
              0          num_computed ^              len(tokens)
    this step computes tokens[num_computed : num_computed + n];
    if that reaches len(tokens) the step samples the next token.

Pages come from the CacheManager (kv/manager.py), which evicts cached pages
and, with a host tier, offloads a sequence's own oldest pages to it; when it
still cannot supply them, the newest running sequence is preempted (its pages
freed, recomputed later, largely from the prefix cache). A prefill slice that
does not fit is halved first, so a sequence longer than the GPU pool advances
in slices the pool can hold.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from kvtier.engine.request import Request
from kvtier.kv.manager import CacheManager, Transfers


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    tokens: list[int]
    prompt_len: int
    num_computed: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    cached_host_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    admitted: bool = False  # admitted at least once (a preempted seq resumes)
    aborted: bool = False

    @property
    def seq_id(self) -> str:
        return self.request.request_id

    @property
    def pinned_spans(self) -> tuple[tuple[int, int], ...]:
        """Prompt token ranges retrieval attention always attends (Request.pinned_spans)."""
        return self.request.pinned_spans

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # tokens computed this step
    page_table: list[int]
    sample: bool  # this step reaches the end of the known tokens: sample one


@dataclass
class Batch:
    """The one object that crosses from scheduler to runner."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    transfers: Transfers | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, manager: CacheManager, max_batch: int, prefill_chunk: int):
        self.manager = manager
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk  # token budget for prefill slices per step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        budget = self.prefill_chunk
        # decodes first: they are latency-critical and cost one token each
        for seq in sorted(self.running, key=lambda s: s.in_prefill):
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted while making room for an earlier sequence
            n = 1 if not seq.in_prefill else min(len(seq.tokens) - seq.num_computed, budget)
            if n <= 0 or (seq.in_prefill and budget <= 0):
                continue
            n = self._reserve(seq, n, batch)
            if n == 0:
                continue
            if seq.in_prefill:
                budget -= n
            batch.seqs.append(self._slice(seq, n))
        budget = self._admit(batch, budget)
        batch.transfers = self.manager.take_transfers()
        return batch

    def _admit(self, batch: Batch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            host_before = self.manager.stats().get("hit_tokens_host", 0)
            cached = self.manager.add_sequence(seq.seq_id, seq.tokens)
            n = min(len(seq.tokens) - cached, budget)
            while n > 1 and not self.manager.ensure(seq.seq_id, cached + n):
                n //= 2  # a first slice the pool can hold
            if not self.manager.ensure(seq.seq_id, cached + n):
                self.manager.free(seq.seq_id)
                break  # no room now; retry next step (FIFO: no overtaking)
            self.waiting.popleft()
            if not seq.admitted:  # a preemption resume keeps the first accounting
                seq.cached_tokens = cached
                seq.cached_host_tokens = self.manager.stats().get("hit_tokens_host", 0) - host_before
                seq.admitted = True
            seq.num_computed = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            budget -= n
            batch.seqs.append(self._slice(seq, n))
        return budget

    def _reserve(self, seq: Sequence, n: int, batch: Batch) -> int:
        """Make pages for up to n more tokens of seq: halve n while it does not fit, then
        preempt newer sequences (not yet in this step's batch). Returns the tokens granted (0: none)."""
        while not self.manager.ensure(seq.seq_id, seq.num_computed + n):
            if n > 1:  # a smaller slice before throwing away another sequence's work
                n //= 2
                continue
            busy = {id(s.seq) for s in batch.seqs} | {id(seq)}
            victim = self._newest_running(exclude=busy)
            if victim is None:
                return 0
            self._preempt(victim)
        return n

    def _newest_running(self, exclude: set[int]) -> Sequence | None:
        for s in reversed(self.running):
            if id(s) not in exclude and s.status is SeqStatus.RUNNING:
                return s
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.manager.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _slice(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed
        return ScheduledSeq(seq=seq, start=start, num_tokens=n,
                            page_table=self.manager.page_table(seq.seq_id),  # a new list each call
                            sample=start + n == len(seq.tokens))

    def after_step(self, batch: Batch) -> None:
        """Advance computed counts and publish newly full pages to the prefix index."""
        for s in batch.seqs:
            s.seq.num_computed = s.start + s.num_tokens
            self.manager.commit(s.seq.seq_id, s.seq.tokens, s.seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.manager.free(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)  # holds no pages while waiting
        seq.status = SeqStatus.FINISHED
