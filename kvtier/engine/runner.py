"""ModelRunner: turns a scheduler Batch into tensors, runs the model, returns logits.

    batch.seqs:      s0 (prefill chunk, 5 tok)  s1 (decode, 1 tok)  s2 (chunk, 3 tok)
    input_ids:       | t t t t t |               | t |               | t t t |
    query_start_loc: 0           5               6                   9
    logits rows:     the last row of each seq with sample=True
"""

from __future__ import annotations

import torch

from kvtier.engine.scheduler import Batch
from kvtier.kv.pool import PagePool
from kvtier.layers.attention import AttentionBackend, AttentionMetadata


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: PagePool, backend: AttentionBackend,
                 device: torch.device, host_pool: PagePool | None = None):
        self.model = model
        self.pool = pool
        self.host_pool = host_pool
        self.backend = backend
        self.device = device
        self.page_size = pool.page_size

    def run_transfers(self, batch: Batch) -> None:
        """Swap pages between tiers before the forward (down first: it frees GPU slots)."""
        t = batch.transfers
        if t is None or self.host_pool is None:
            return
        if t.gpu_to_host:
            src, dst = zip(*t.gpu_to_host)
            self.pool.copy_to(self.host_pool, list(src), list(dst))
        if t.host_to_gpu:
            src, dst = zip(*t.host_to_gpu)
            self.host_pool.copy_to(self.pool, list(src), list(dst))

    def prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        ps = self.page_size
        for s in batch.seqs:
            end = s.start + s.num_tokens
            ids.extend(s.seq.tokens[s.start:end])
            pos.extend(range(s.start, end))
            slots.extend(s.page_table[p // ps] * ps + p % ps for p in range(s.start, end))
            qsl.append(qsl[-1] + s.num_tokens)
            seq_lens.append(end)
            tables.append(s.page_table)
            if s.sample:
                logit_rows.append(qsl[-1] - 1)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=qsl, seq_lens=seq_lens, page_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            logits_indices=torch.tensor(logit_rows, dtype=torch.long, device=dev))
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Run one step. Returns fp32 logits [n_sampled, vocab], in batch order."""
        self.run_transfers(batch)
        input_ids, positions, meta = self.prepare(batch)
        logits = self.model(input_ids, positions, meta, self.backend)
        return logits.float()
