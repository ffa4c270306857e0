"""CacheManager: prefix hits, eviction, host tier, and a model-checked state machine.

The state machine simulates the runner: a fake GPU and host pool store, for each
page, the exact token prefix whose KV it holds. Transfers are executed in the
documented order, forward "writes" pages, and every prefix hit is checked
against the pool contents, so a hit on wrong KV cannot go unnoticed.
"""

from __future__ import annotations

import sys

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

import kvtier.kv.prefix as prefix_mod
from kvtier.kv.manager import CacheManager, Transfers, host_page_of
from kvtier.kv.prefix import PrefixIndex

PS = 4  # page size used by the unit tests


def test_manager_imports_no_torch() -> None:
    import importlib
    import subprocess
    code = "import sys, kvtier.kv.manager; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    importlib.import_module("kvtier.kv.manager")


def run_seq(m: CacheManager, sid: str, tokens: list[int]) -> int:
    """Add, allocate, 'compute' and commit a whole sequence; returns cached tokens."""
    cached = m.add_sequence(sid, tokens)
    assert m.ensure(sid, len(tokens))
    m.commit(sid, tokens)
    m.check_integrity()
    return cached


def test_miss_then_hit_full_pages_only() -> None:
    m = CacheManager(num_gpu_pages=16, page_size=PS)
    prompt = list(range(10))  # 2 full pages + 2 tokens
    assert run_seq(m, "a", prompt) == 0
    m.free("a")
    m.check_integrity()
    assert m.stats()["gpu_pages_cached"] == 2
    assert m.peek_prefix(prompt) == 8
    assert run_seq(m, "b", prompt + [99]) == 8
    assert m.page_table("b")[:2] == [0, 1]  # the same physical pages are shared
    s = m.stats()
    assert (s["hits"], s["misses"], s["hit_tokens_gpu"]) == (1, 1, 8)


def test_hit_leaves_one_token_to_compute() -> None:
    m = CacheManager(num_gpu_pages=16, page_size=PS)
    prompt = list(range(8))  # exactly 2 full pages
    run_seq(m, "a", prompt)
    m.free("a")
    assert m.add_sequence("b", prompt) == 4  # capped: last page is recomputed
    assert m.add_sequence("c", prompt[:7] + [42]) == 4  # diverges inside page 1
    assert m.add_sequence("d", [0, 1, 2, 9] + prompt[4:]) == 0  # diverges in page 0
    m.check_integrity()


def test_concurrent_sharing_and_refcounts() -> None:
    m = CacheManager(num_gpu_pages=8, page_size=PS)
    base = list(range(8))
    run_seq(m, "a", base + [50, 51])
    assert run_seq(m, "b", base + [60]) == 8  # a still running: pages shared
    assert m.stats()["gpu_pages_used"] == 4  # 2 shared + 1 each
    m.free("a")
    m.check_integrity()
    assert m.stats()["gpu_pages_used"] == 3
    m.free("b")
    m.check_integrity()
    assert m.stats()["gpu_pages_used"] == 0


def test_ensure_evicts_cached_then_fails_without_change() -> None:
    m = CacheManager(num_gpu_pages=4, page_size=PS)
    run_seq(m, "a", list(range(8)))
    m.free("a")  # 2 cached pages
    run_seq(m, "b", [7] * 8)  # takes the 2 free pages
    assert m.num_free_gpu_pages() == 0 and m.can_allocate(2) and not m.can_allocate(3)
    snap = (m.page_table("b"), m.stats())
    assert not m.ensure("b", 5 * PS)  # needs 3 more: only 2 evictable
    assert (m.page_table("b"), m.stats()) == snap
    assert m.ensure("b", 4 * PS)  # evicts a's 2 cached pages
    s = m.stats()
    assert (s["evictions_gpu"], s["gpu_pages_cached"], s["prefix_nodes"]) == (2, 0, 2)
    m.check_integrity()
    with pytest.raises(ValueError):
        m.commit("b", [7] * (4 * PS + 1))  # more tokens than pages
    with pytest.raises(ValueError):
        m.commit("b", [7] * 8, 9)  # a count past the tokens given
    with pytest.raises(ValueError):
        m.add_sequence("b", [1])


def test_eviction_drops_leaves_first_without_host() -> None:
    m = CacheManager(num_gpu_pages=4, page_size=PS)
    run_seq(m, "a", list(range(13)))  # 3 full pages + 1 partial: 4 pages
    m.free("a")  # 3 cached, 1 free
    m.add_sequence("b", [100])
    assert m.ensure("b", 2 * PS)  # 1 free + evict the LRU cached page = the deepest one
    m.check_integrity()
    assert m.peek_prefix(list(range(13))) == 2 * PS
    assert m.stats()["evictions_gpu"] == 1


def test_no_cross_namespace_hits() -> None:
    m = CacheManager(num_gpu_pages=16, page_size=PS, namespace="llama/bf16")
    prompt = list(range(9))
    run_seq(m, "a", prompt)
    m.free("a")
    assert m.add_sequence("b", prompt, namespace="llama/int8") == 0
    assert m.add_sequence("c", prompt) == 8
    m.check_integrity()
    idx = PrefixIndex(PS)
    n = idx.insert(None, [1, 2, 3, 4], "m1")
    assert idx.find(None, [1, 2, 3, 4], "m2") is None
    assert idx.find(None, [1, 2, 3, 4], "m1") is n


def test_prefix_disabled_never_hits() -> None:
    m = CacheManager(num_gpu_pages=8, page_size=PS, enable_prefix=False)
    run_seq(m, "a", list(range(9)))
    m.free("a")
    assert run_seq(m, "b", list(range(9))) == 0
    m.free("b")
    m.check_integrity()
    assert m.stats()["gpu_pages_free"] == 8


def test_exact_match_under_hash_collisions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_mod, "page_key", lambda parent, tokens, ns: 7)
    m = CacheManager(num_gpu_pages=16, page_size=PS)
    run_seq(m, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    m.free("a")
    assert m.add_sequence("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0  # same key, other tokens
    assert m.add_sequence("c", [1, 2, 3, 4, 9, 9, 9, 9, 0]) == 4
    assert m.add_sequence("d", [5, 6, 7, 8, 1, 2, 3, 4, 0]) == 0  # page 1 as a root: no
    run_seq(m, "e", [9, 9, 9, 9, 1, 1, 1, 1, 0])  # colliding nodes coexist
    m.free("e")
    assert m.add_sequence("f", [9, 9, 9, 9, 1, 1, 1, 1, 0]) == 8
    m.check_integrity()


def test_host_tier_round_trip() -> None:
    m = CacheManager(num_gpu_pages=3, page_size=PS, num_host_pages=8)
    conv = list(range(9))  # 2 full pages + 1
    run_seq(m, "a", conv)
    m.free("a")
    assert m.take_transfers() == Transfers()
    run_seq(m, "b", [50] * 12)  # needs all 3 GPU pages: a's 2 cached pages go to host
    xfer = m.take_transfers()
    assert sorted(g for g, _ in xfer.gpu_to_host) == [0, 1] and not xfer.host_to_gpu
    m.free("b")
    s = m.stats()
    assert s["swaps_out"] == 2 and s["host_pages_cached"] == 2
    # a's conversation comes back from host into new GPU pages
    assert m.peek_prefix(conv + [9]) == 8
    assert m.add_sequence("c", conv + [9]) == 8
    xfer = m.take_transfers()
    host_of = dict((g, h) for g, h in m.take_transfers().gpu_to_host)
    assert len(xfer.host_to_gpu) == 2 and not host_of
    assert [g for _, g in xfer.host_to_gpu] == m.page_table("c")
    s = m.stats()
    assert (s["hit_tokens_host"], s["swaps_in"]) == (8, 2)
    m.check_integrity()


def test_swap_in_cut_short_when_gpu_full() -> None:
    m = CacheManager(num_gpu_pages=3, page_size=PS, num_host_pages=4)
    conv = list(range(12))  # 3 full pages
    run_seq(m, "a", conv)
    m.free("a")
    run_seq(m, "b", [9] * 12)  # evicts all of a's pages to host
    m.take_transfers()
    m.free("b")
    run_seq(m, "hold", [9] * 8)  # re-takes 2 of b's cached pages; 1 GPU page evictable
    got = m.add_sequence("c", conv + [1])  # 3 host hits, only 1 GPU page obtainable
    m.check_integrity()
    assert got == PS
    xfer = m.take_transfers()
    assert len(xfer.host_to_gpu) == 1
    assert m.stats()["host_pages_used"] == 0  # pins released
    m.check_integrity()


def test_copy_down_and_swap_in_share_a_page_in_one_step() -> None:
    """A GPU page copied down may be reused by a swap-in of the same step: order matters."""
    m = CacheManager(num_gpu_pages=3, page_size=PS, num_host_pages=4)
    conv_a, conv_b = list(range(8)), [9] * 12
    run_seq(m, "a", conv_a + [1])
    m.free("a")
    run_seq(m, "b", conv_b)  # a's pages go down to host
    gpu = {p: tuple(conv_b[:(i + 1) * PS]) for i, p in enumerate(m.page_table("b"))}
    host = {h: tuple(conv_a[:(i + 1) * PS]) for i, (g, h) in enumerate(reversed(m.take_transfers().gpu_to_host))}
    m.free("b")
    assert m.add_sequence("c", conv_a + [1]) == 8  # needs 2 GPU pages: evicts b's, reuses them
    x = m.take_transfers()
    assert {g for g, _ in x.gpu_to_host} & {g for _, g in x.host_to_gpu}
    assert [to_host for to_host, _ in x.phases] == [True, False]  # down first, then up
    apply_phases(x, gpu, host)
    assert [gpu[p] for p in m.page_table("c")] == [tuple(conv_a[:4]), tuple(conv_a[:8])]
    m.free("c")
    assert m.add_sequence("d", conv_b + [1]) == 12  # b's pages: back from host, intact
    apply_phases(m.take_transfers(), gpu, host)
    assert [gpu[p] for p in m.page_table("d")] == [tuple(conv_b[:4 * (i + 1)]) for i in range(3)]
    m.check_integrity()


def apply_phases(x: Transfers, gpu: dict, host: dict) -> None:
    """What the runner does with a Transfers, on fake pools (page -> contents)."""
    for to_host, pairs in x.phases:
        for src, dst in pairs:
            if to_host:
                host[dst] = gpu[src]
            else:
                gpu[dst] = host[src]


def test_swap_in_then_offload_in_one_step() -> None:
    """Admission swaps a prefix hit in, and the same round's ensure() offloads those pages again
    (a sequence longer than the GPU pool): the copy-down must run after the swap-in that fills the
    page, or the host copy holds the page's previous contents."""
    m = CacheManager(num_gpu_pages=3, page_size=PS, num_host_pages=16)
    gpu: dict = {}
    host: dict = {}

    def compute(sid: str, tokens: list[int]) -> None:
        m.add_sequence(sid, tokens)
        assert m.ensure(sid, len(tokens))
        apply_phases(m.take_transfers(), gpu, host)
        for i, ref in enumerate(m.page_table(sid)):
            if ref >= 0:
                gpu[ref] = tuple(tokens[:min(PS * (i + 1), len(tokens))])
        m.commit(sid, tokens)
        m.free(sid)

    conv = list(range(20))
    compute("a", conv[:9])  # 2 full pages indexed
    compute("b", [7] * 12)  # a's pages go down to the host tier
    assert m.add_sequence("c", conv) == 8  # hit: 2 pages to swap in
    assert m.ensure("c", len(conv))  # 5 pages on a 3-page GPU: offloads, the hit pages first
    x = m.take_transfers()
    assert {g for _, g in x.host_to_gpu} & {g for g, _ in x.gpu_to_host}  # up and down in one round
    apply_phases(x, gpu, host)
    table = m.page_table("c")
    for i in range(2):
        assert m_held(table[i], gpu, host) == tuple(conv[:PS * (i + 1)])
    m.check_integrity()


def m_held(ref: int, gpu: dict, host: dict):
    return gpu.get(ref) if ref >= 0 else host.get(host_page_of(ref))


def test_swap_in_chain_is_pinned_against_host_eviction() -> None:
    """Allocating GPU pages for host hits must not evict the rest of the hit chain from host."""
    m = CacheManager(num_gpu_pages=3, page_size=PS, num_host_pages=2)
    run_seq(m, "a", list(range(8)) + [1])
    m.free("a")
    run_seq(m, "b", [9] * 12)  # a's 2 pages fill the host tier
    m.take_transfers()
    m.free("b")
    assert m.add_sequence("c", list(range(8)) + [1]) == 8  # b's pages are dropped instead
    m.check_integrity()
    assert len(m.take_transfers().host_to_gpu) == 2
    m.check_integrity()


def test_two_contexts_sharing_a_prefix_share_only_its_pages() -> None:
    """A = P + X and B = P + Y: only P's full pages are shared; nothing after the fork is,
    neither while both run nor later, when either comes back."""
    m = CacheManager(num_gpu_pages=32, page_size=PS, num_host_pages=8)
    p = list(range(10))  # 2 full pages + 2 tokens of shared prefix
    a, b = p + [50] * 9, p + [60] * 9
    run_seq(m, "a", a)
    assert m.add_sequence("b", b) == 8  # the 2 full pages of P, not the partial third page
    assert m.ensure("b", len(b))
    ta, tb = m.page_table("a"), m.page_table("b")
    assert ta[:2] == tb[:2] and not set(ta[2:]) & set(tb[2:])
    m.commit("b", b)
    m.free("a")
    m.free("b")
    for ctx, other in ((a, b), (b, a)):
        got = m.add_sequence("again", ctx + [1])
        assert got == len(ctx) // PS * PS  # its own pages...
        mine = m.page_table("again")
        m.free("again")
        assert m.add_sequence("other", other + [1]) == len(other) // PS * PS
        assert set(m.page_table("other")) & set(mine) == set(m.page_table("other")[:2])  # ...only P shared
        m.free("other")
    m.check_integrity()


BASES = [(0, 1, 0, 1, 1, 1, 0, 0, 1, 0), (0, 1, 1, 0, 2, 2), (1,) * 10]  # shared conversation starts
NAMESPACES = ("t", "u")  # two models/formats: their pages must never serve each other


class ManagerMachine(RuleBasedStateMachine):
    """Random add/compute/free against a simulated runner and pools.

    The fake pools hold, per page, (namespace, token prefix) of the KV it
    stores. After every executed transfer batch, every page of every live
    sequence and every indexed node must hold exactly its own prefix: a page
    lost, overwritten, evicted from under a running sequence, or shared
    between different prefixes cannot go unnoticed.
    """

    def __init__(self) -> None:
        super().__init__()
        self.m: CacheManager | None = None
        self.ctr = 0

    @initialize(gpu=st.integers(2, 10), host=st.sampled_from([0, 3, 8, 24]), ps=st.sampled_from([1, 2, 4]))
    def init(self, gpu: int, host: int, ps: int) -> None:
        self.m = CacheManager(gpu, ps, host, namespace="t")
        self.gpu: dict[int, tuple] = {}  # page -> (namespace, token prefix) whose KV it holds
        self.host: dict[int, tuple] = {}
        self.live: dict[str, dict] = {}

    def _pick(self, i: int) -> str:
        return sorted(self.live)[i % len(self.live)]

    def _held(self, ref: int) -> tuple | None:
        return self.gpu.get(ref) if ref >= 0 else self.host.get(host_page_of(ref))

    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 10), tail=st.lists(st.integers(0, 2), max_size=4),
          gen=st.integers(1, 8), ns=st.sampled_from(NAMESPACES), first_chunk=st.sampled_from([0, 0, 3, 12]))
    def add(self, base: tuple[int, ...], cut: int, tail: list[int], gen: int, ns: str, first_chunk: int) -> None:
        sid = f"s{self.ctr}"
        self.ctr += 1
        prompt = (list(base[:cut]) + tail) or [2]
        tokens = prompt + [3] * gen  # prompt + the tokens it will "generate"
        cached = self.m.add_sequence(sid, prompt, namespace=ns)
        ps = self.m.page_size
        assert cached % ps == 0 and cached < len(prompt)
        assert len(self.m.page_table(sid)) == cached // ps
        self.live[sid] = {"tokens": tokens, "computed": cached, "ns": ns}
        if first_chunk:  # as the scheduler does: admit and allocate the first chunk in one round
            self._compute(sid, first_chunk)
        self._run_transfers()  # the hit's pages must hold exactly this prefix

    def _run_transfers(self) -> None:
        apply_phases(self.m.take_transfers(), self.gpu, self.host)
        self._check_contents()

    def _check_contents(self) -> None:
        ps = self.m.page_size
        owner: dict[int, tuple] = {}
        for sid, s in self.live.items():
            table = self.m.page_table(sid)
            for i in range(-(-s["computed"] // ps)):
                want = (s["ns"], tuple(s["tokens"][:min((i + 1) * ps, s["computed"])]))
                assert self._held(table[i]) == want, f"{sid} page {i} holds wrong KV"
                if table[i] >= 0:  # a GPU page serves one prefix only, whoever holds it
                    assert owner.setdefault(table[i], want) == want, "page shared by different prefixes"
        for node in self.m.index.nodes():
            toks, n = [], node
            while n is not None:
                toks[:0] = n.tokens
                n = n.parent
            want = (node.namespace, tuple(toks))
            if node.gpu_page is not None:
                assert self.gpu.get(node.gpu_page) == want, "indexed GPU page holds wrong KV"
            if node.host_page is not None and node.host_page not in self.m._host_release:
                assert self.host.get(node.host_page) == want, "indexed host page holds wrong KV"

    def _compute(self, sid: str, n: int) -> bool:
        s = self.live[sid]
        lo, hi = s["computed"], min(len(s["tokens"]), s["computed"] + n)
        if lo >= hi:
            return True
        if not self.m.ensure(sid, hi):
            return False
        self._run_transfers()
        ps, table = self.m.page_size, self.m.page_table(sid)
        for i in range(lo // ps, (hi - 1) // ps + 1):  # "forward" writes the pages it touches
            assert table[i] >= 0, "forward writes into an offloaded page"
            assert self.m._gpu_node[table[i]] is None, "forward writes into an indexed page"
            self.gpu[table[i]] = (s["ns"], tuple(s["tokens"][:min((i + 1) * ps, hi)]))
        s["computed"] = hi
        self.m.commit(sid, s["tokens"], hi)  # a count, as the scheduler commits (no token-list copy)
        return True

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50), n=st.integers(1, 6))
    def compute(self, i: int, n: int) -> None:
        self._compute(self._pick(i), n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def finish(self, i: int) -> None:
        """Run a sequence to its end (if memory allows) and free it: the common case."""
        sid = self._pick(i)
        self._compute(sid, 100)
        self.m.free(sid)
        del self.live[sid]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 50))
    def abort(self, i: int) -> None:
        sid = self._pick(i)
        self.m.free(sid)
        del self.live[sid]

    @rule()
    def step(self) -> None:
        self._run_transfers()

    @invariant()
    def integrity(self) -> None:
        if self.m is not None:
            self.m.check_integrity()
            s = self.m.stats()
            assert s["gpu_pages_used"] + s["gpu_pages_cached"] + s["gpu_pages_free"] == s["gpu_pages_total"]
            assert s["host_pages_used"] + s["host_pages_cached"] + s["host_pages_free"] == s["host_pages_total"]
            assert s["prompt_tokens"] >= s["hit_tokens_gpu"] + s["hit_tokens_host"]


MACHINE_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_state_machine() -> None:
    run_state_machine_as_test(ManagerMachine, settings=MACHINE_SETTINGS)


def test_state_machine_colliding_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefix_mod, "page_key", lambda parent, tokens, ns: 1)
    run_state_machine_as_test(ManagerMachine, settings=settings(max_examples=60, stateful_step_count=30,
                                                                 deadline=None))
