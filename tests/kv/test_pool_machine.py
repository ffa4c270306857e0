"""PagePool under random writes and batched copies between two tiers (hypothesis state machine).

A model keeps, per page of each pool, the exact stored codes it must hold;
after every step both pools pass check_integrity() and hold exactly the model,
and every page decodes (through the writing pool) to what was written there.
Writes at sequence position 0 keep their row exactly (sink rows): the model
tracks which page holds which exact row 0, through copies in both directions.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvtier.kv.formats import make_format
from kvtier.kv.pool import PagePool

L, H, S, D = 2, 2, 4, 16  # layers, kv heads, page size, head dim


def snapshot(pool: PagePool, page: int) -> list[torch.Tensor]:
    return [pool.layers[layer][name][page].clone() for layer in range(L) for name in sorted(pool.layers[layer])]


class PoolMachine(RuleBasedStateMachine):
    @initialize(fmt=st.sampled_from(["fp32", "int8", "k8v4", "int4"]), n_gpu=st.integers(2, 6),
                n_host=st.integers(2, 8))
    def init(self, fmt: str, n_gpu: int, n_host: int) -> None:
        f = make_format(fmt)
        self.gpu = PagePool(f, L, n_gpu, H, S, D, "cpu")
        self.host = PagePool(f, L, n_host, H, S, D, "cpu")
        self.want = {"gpu": [snapshot(self.gpu, p) for p in range(n_gpu)],
                     "host": [snapshot(self.host, p) for p in range(n_host)]}
        self.sinks: dict[str, dict[int, list[tuple[torch.Tensor, torch.Tensor]]]] = {"gpu": {}, "host": {}}
        self.seed = 0

    @rule(page=st.integers(0, 5), n=st.integers(1, S), sink=st.booleans())
    def write(self, page: int, n: int, sink: bool) -> None:
        page %= self.gpu.num_pages
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        slots = page * S + torch.arange(n)
        sink_slots = self.gpu.assign_sinks([page]) if sink else None
        exact = []
        for layer in range(L):
            k, v = torch.randn(2, n, H, D, generator=g) * 3 + 1
            self.gpu.write(layer, slots, k, v, sink=None if sink_slots is None else (torch.tensor([0]), sink_slots))
            shift = self.gpu.k_shift[layer]
            exact.append((k[0] - (shift if shift is not None else 0), v[0]))
        self.want["gpu"][page] = snapshot(self.gpu, page)
        if sink_slots is not None:
            self.sinks["gpu"][page] = exact

    @rule(data=st.data(), down=st.booleans())
    def copy(self, data: st.DataObject, down: bool) -> None:
        src, dst = (self.gpu, self.host) if down else (self.host, self.gpu)
        n = data.draw(st.integers(0, min(src.num_pages, dst.num_pages)))
        s_ids = data.draw(st.lists(st.integers(0, src.num_pages - 1), min_size=n, max_size=n))
        d_ids = data.draw(st.lists(st.integers(0, dst.num_pages - 1), min_size=n, max_size=n, unique=True))
        src.copy_to(dst, s_ids, d_ids)
        a, b = ("gpu", "host") if down else ("host", "gpu")
        moved = [(self.want[a][s], self.sinks[a].get(s)) for s in s_ids]
        for d, (w, sink) in zip(d_ids, moved):
            self.want[b][d] = w
            self.sinks[b].pop(d, None)
            if sink is not None:
                self.sinks[b][d] = sink

    @invariant()
    def pools_hold_the_model(self) -> None:
        for name, pool in (("gpu", self.gpu), ("host", self.host)):
            pool.check_integrity()
            for p in range(pool.num_pages):
                assert all(torch.equal(x, y) for x, y in zip(snapshot(pool, p), self.want[name][p]))
            assert pool.sink_pages() == set(self.sinks[name]) or pool.sink_slots == 0
        # a page holding a sink row reads it back exactly as row 0 when read as a sequence's first page
        first = torch.tensor([0])
        for name, pool in (("gpu", self.gpu), ("host", self.host)):
            for p, rows in self.sinks[name].items():
                if not self.gpu.sink_slots:
                    break
                for layer, (k0, v0) in enumerate(rows):
                    if name == "gpu":
                        k, v = self.gpu.read(layer, torch.tensor([p]), first)
                    else:
                        k, v = self.gpu.read_from(self.host, layer, torch.tensor([p]), first)
                    torch.testing.assert_close(k[0, :, 0], k0, rtol=1e-5, atol=1e-5)
                    torch.testing.assert_close(v[0, :, 0], v0, rtol=1e-5, atol=1e-5)
        # a page decodes the same through the writing pool wherever it sits
        ids = torch.arange(min(self.gpu.num_pages, self.host.num_pages))
        for layer in range(L):
            via_host = self.gpu.read_from(self.host, layer, ids)
            for p in ids.tolist():
                same = all(torch.equal(x, y) for x, y in zip(snapshot(self.host, p), snapshot(self.gpu, p)))
                if same:
                    assert torch.equal(via_host[0][p], self.gpu.read(layer, torch.tensor([p]))[0][0])


def test_pool_state_machine() -> None:
    run_state_machine_as_test(PoolMachine, settings=settings(max_examples=40, stateful_step_count=15,
                                                             deadline=None))
