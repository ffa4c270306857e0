"""CacheManager: sequences -> page ids across the GPU and host tiers. Torch-free.

Plain Python over integer page ids; the tensors live in PagePools owned by the
runner, which executes the `Transfers` this class queues.

Every GPU page is in exactly one state:

    free    on the free list, holds nothing
    used    refcount > 0: in the page table of >= 1 live sequence
    cached  refcount 0 but indexed (a full page of a finished prefix), in the
            LRU; evictable: dropped, or copied down to the host tier first

Every host page is free, cached (holds an indexed node's KV, in the host LRU),
pinned (the source of a queued host->GPU copy, until `take_transfers`) or held
(an offloaded page of a running sequence, see below).

A sequence's page table, with prefix hits at the front:

    | hit (gpu) | hit (host->gpu) | computed here ...        | partial |
    0           matched pages     committed full pages       num_tokens

A sequence longer than the GPU pool: when `ensure` finds no GPU page, the
sequence's own oldest computed full pages are offloaded to held host pages
(a queued GPU->host copy; the GPU page is released). The page table then
starts with host references, which attention streams through the GPU:

    | host_ref(h0) host_ref(h1) ... | gpu pages ...              | partial |
    0      offloaded (held)         len(host_refs)               num_tokens

`host_ref(h) = -1 - h`: negative entries name host pages, so one list of
ints keeps naming every page of the sequence in token order.

Ordering contract for the runner: run `Transfers.phases` in order (each a batch of
copies in one direction), then the forward. Copies are queued in the order the
bookkeeping made them, and that order matters both ways: a GPU page is returned to
the free list as soon as its copy-down is queued, so it may be the destination of a
swap-in queued after it; and a page swapped in for a prefix hit may be offloaded
again by the same round's `ensure` (a long sequence), so its copy-down must run
after the swap-in that fills it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.kv.prefix import PrefixIndex, PrefixNode


def host_ref(host_page: int) -> int:
    """Page-table entry naming host page `host_page` (entries >= 0 are GPU pages)."""
    return -1 - host_page


def host_page_of(ref: int) -> int:
    """Inverse of host_ref: the host page id of a negative page-table entry."""
    return -1 - ref


@dataclass
class Transfers:
    """Page copies the runner performs (batched) before the step's forward.

    phases: (to_host, [(src, dst), ...]) batches to run in this order; host_to_gpu /
    gpu_to_host: every copy of each direction (for counting; their relative order is
    in `phases` only). While the manager queues, phases holds one copy each, in order
    (`CacheManager.take_transfers` batches them and fills the two lists)."""

    host_to_gpu: list[tuple[int, int]] = field(default_factory=list)  # (host id, gpu id)
    gpu_to_host: list[tuple[int, int]] = field(default_factory=list)  # (gpu id, host id)
    phases: list[tuple[bool, list[tuple[int, int]]]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.phases)

    def queue(self, to_host: bool, src: int, dst: int) -> None:
        self.phases.append((to_host, [(src, dst)]))


@dataclass
class _Seq:
    pages: list[int]  # GPU page ids in order, after the offloaded head
    chain: list[PrefixNode]  # prefix nodes of this seq's first full pages, in order
    namespace: str
    indexing: bool = True  # False once the chain broke (parent evicted): stop indexing
    # offloaded head: its held host pages, as page-table entries (host_ref), so that `page_table`
    # copies them without per-page Python (a 256K sequence: 16K pages)
    host_refs: list[int] = field(default_factory=list)
    committed: int = 0  # tokens whose KV is computed (last commit)

    @property
    def num_pages(self) -> int:
        return len(self.host_refs) + len(self.pages)


class CacheManager:
    """Page tables, refcounts, prefix hits and two-tier eviction for all sequences."""

    def __init__(self, num_gpu_pages: int, page_size: int, num_host_pages: int = 0,
                 enable_prefix: bool = True, namespace: str = "", offload: bool = True):
        if num_gpu_pages < 1:
            raise ValueError(f"num_gpu_pages must be >= 1, got {num_gpu_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_host_pages < 0:
            raise ValueError(f"num_host_pages must be >= 0, got {num_host_pages}")
        self.num_gpu_pages = num_gpu_pages
        self.num_host_pages = num_host_pages
        self.page_size = page_size
        self.enable_prefix = enable_prefix
        self.namespace = namespace
        self.offload = offload and num_host_pages > 0  # long sequences spill their own pages
        # tokens one sequence may hold at most: the GPU pool, plus the host tier it spills to
        self.capacity_tokens = (num_gpu_pages + (num_host_pages if self.offload else 0)) * page_size
        self.index = PrefixIndex(page_size)
        self._seqs: dict[str, _Seq] = {}
        # GPU tier
        self._gpu_free: list[int] = list(range(num_gpu_pages - 1, -1, -1))  # pop() -> lowest id
        self._refcount = [0] * num_gpu_pages
        self._gpu_node: list[PrefixNode | None] = [None] * num_gpu_pages
        self._gpu_lru: OrderedDict[int, None] = OrderedDict()  # cached pages, oldest first
        # host tier
        self._host_free: list[int] = list(range(num_host_pages - 1, -1, -1))
        self._host_node: list[PrefixNode | None] = [None] * num_host_pages
        self._host_lru: OrderedDict[int, None] = OrderedDict()
        self._host_pinned: set[int] = set()
        self._host_release: set[int] = set()  # pinned pages whose node died: free at take_transfers
        self._host_held: set[int] = set()  # offloaded pages of running sequences
        self._xfer = Transfers()
        self._stats = dict.fromkeys(
            ("lookups", "hits", "misses", "prompt_tokens", "hit_tokens_gpu", "hit_tokens_host",
             "computed_tokens", "evictions_gpu", "evictions_host", "dropped_pages", "swaps_in",
             "swaps_out", "offloads"), 0)

    # ---------------------------------------------------------------- queries
    def num_free_gpu_pages(self) -> int:
        return len(self._gpu_free)

    def num_evictable_gpu_pages(self) -> int:
        return len(self._gpu_lru)

    def can_allocate(self, n_pages: int) -> bool:
        """True if `n_pages` new GPU pages can be had (free or by evicting cached ones)."""
        return n_pages <= len(self._gpu_free) + len(self._gpu_lru)

    def has_sequence(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def page_table(self, seq_id: str) -> list[int]:
        """Page ids of the sequence in token order: host_ref(h) for offloaded pages, then GPU ids."""
        seq = self._seq(seq_id)
        return seq.host_refs + seq.pages  # a new list

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def peek_prefix(self, prompt: list[int]) -> int:
        """Tokens `add_sequence` would find cached now (no side effects, any tier)."""
        if not self.enable_prefix:
            return 0
        return len(self.index.match(prompt, self.namespace, self._max_hit_pages(prompt))) * self.page_size

    # ------------------------------------------------------------- sequences
    def add_sequence(self, seq_id: str, prompt: list[int], namespace: str | None = None) -> int:
        """Register a sequence and take its prefix hits; returns cached token count.

        Hits are whole pages and leave >= 1 prompt token to compute. GPU hits
        are shared (refcount++); host hits get a new GPU page and a queued
        host->GPU copy. If GPU pages run out, the hit is cut short there.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already exists")
        ns = self.namespace if namespace is None else namespace
        seq = _Seq(pages=[], chain=[], namespace=ns, indexing=self.enable_prefix)
        self._seqs[seq_id] = seq
        if not self.enable_prefix:
            return 0
        self._stats["lookups"] += 1
        self._stats["prompt_tokens"] += len(prompt)
        chain = self.index.match(prompt, ns, self._max_hit_pages(prompt))
        # Take every GPU-resident hit and pin every host-only one first, so that
        # allocating pages for the swap-ins cannot evict the rest of the chain.
        for node in chain:
            if node.gpu_page is not None:
                self._incref(node.gpu_page)
            else:
                self._pin_host(node.host_page)
        n_ok, n_swapped = len(chain), 0
        for i, node in enumerate(chain):
            if node.gpu_page is None:
                gpu = self._alloc_gpu()
                if gpu is None:
                    n_ok = i
                    break
                self._swap_in(node, gpu)
                n_swapped += 1
        for node in chain[n_ok:]:  # cut short: give back what the tail took
            if node.gpu_page is not None:
                self._decref(node.gpu_page)
            else:
                self._unpin_host(node.host_page)  # type: ignore[arg-type]
        chain = chain[:n_ok]
        self._stats["hit_tokens_gpu"] += (n_ok - n_swapped) * self.page_size
        seq.chain = chain
        seq.pages = [n.gpu_page for n in chain]  # type: ignore[misc]
        seq.committed = len(chain) * self.page_size
        for node in reversed(chain):  # parents most recent: leaves are evicted first
            if node.host_page is not None and node.host_page in self._host_lru:
                self._host_lru.move_to_end(node.host_page)
        self._stats["hits" if chain else "misses"] += 1
        return len(chain) * self.page_size

    def ensure(self, seq_id: str, num_tokens: int) -> bool:
        """Grow the page table to cover `num_tokens`; False (no change) if impossible.

        Takes free pages, then evicts cached ones, then (with a host tier)
        offloads this sequence's own oldest computed pages to the host.
        """
        seq = self._seq(seq_id)
        need = self.num_pages_for(num_tokens) - seq.num_pages
        if need <= 0:
            return True
        if not self.can_allocate(need) and not self._offload(seq, need):
            return False
        for _ in range(need):
            page = self._alloc_gpu()
            if page is None:  # cannot happen after can_allocate; keep the invariant loud
                raise RuntimeError("GPU page allocation failed after can_allocate said yes")
            seq.pages.append(page)
        return True

    def commit(self, seq_id: str, token_ids: list[int], num_tokens: int | None = None) -> None:
        """KV of the first `num_tokens` of `token_ids` (None: all of them; all tokens so far) is
        computed: index newly full pages. (A count instead of a slice: a decode step of a 256K
        sequence need not copy its token list.)"""
        seq = self._seq(seq_id)
        ps = self.page_size
        n = len(token_ids) if num_tokens is None else num_tokens
        if n > len(token_ids):
            raise ValueError(f"commit of {n} tokens but only {len(token_ids)} given for {seq_id!r}")
        if self.num_pages_for(n) > seq.num_pages:
            raise ValueError(f"commit of {n} tokens but sequence {seq_id!r} "
                             f"has only {seq.num_pages} pages of {ps}")
        if n < len(seq.chain) * ps:
            raise ValueError(f"commit of {n} tokens is shorter than the "
                             f"{len(seq.chain) * ps} already indexed for {seq_id!r}")
        self._stats["computed_tokens"] += max(0, n - seq.committed)
        seq.committed = max(seq.committed, n)
        while seq.indexing and len(seq.chain) < n // ps:
            i = len(seq.chain)
            parent = seq.chain[-1] if seq.chain else None
            if parent is not None and not parent.alive:
                seq.indexing = False  # a shared ancestor was dropped: the chain is gone
                break
            tokens = token_ids[i * ps:(i + 1) * ps]
            if i < len(seq.host_refs):  # offloaded before it was indexed: cannot happen, stay loud
                raise RuntimeError(f"page {i} of {seq_id!r} was offloaded before it was indexed")
            page = seq.pages[i - len(seq.host_refs)]
            node = self.index.find(parent, tokens, seq.namespace)
            if node is None:
                node = self.index.insert(parent, tokens, seq.namespace)
                self._attach_gpu(node, page)
            elif node.gpu_page is None and self._gpu_node[page] is None:
                self._attach_gpu(node, page)  # host-only duplicate: our page becomes its GPU copy
            # else: identical page computed twice; ours stays unindexed, the chain follows `node`
            seq.chain.append(node)

    def free(self, seq_id: str) -> None:
        """Drop the sequence: indexed pages stay cached (evictable), the rest are freed."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r}")
        for page in reversed(seq.pages):  # leaves enter the LRU first (evicted first)
            self._decref(page)
        for host in map(host_page_of, seq.host_refs):
            self._host_held.discard(host)
            self._host_free.append(host)

    def take_transfers(self) -> Transfers:
        """Queued copies since the last call; host pages pinned for them are released.

        Within a phase a destination written twice keeps only its last copy (the
        earlier one was for a page since evicted; nothing in a phase reads the
        pages it writes), so each phase has distinct destinations and can be
        executed as one scatter.
        """
        xfer, self._xfer = self._xfer, Transfers()
        xfer.phases = [(to_host, _last_per_destination(pairs)) for to_host, pairs in _phases(xfer.phases)]
        xfer.gpu_to_host = [p for to_host, pairs in xfer.phases if to_host for p in pairs]
        xfer.host_to_gpu = [p for to_host, pairs in xfer.phases if not to_host for p in pairs]
        for host in list(self._host_pinned):
            self._unpin_host(host)
        return xfer

    # ------------------------------------------------------------ accounting
    def stats(self) -> dict[str, int]:
        """Counters (hits, misses, hit tokens per tier, evictions, swaps) and page states per tier."""
        used = sum(1 for r in self._refcount if r > 0)
        return {
            **self._stats,
            "gpu_pages_total": self.num_gpu_pages,
            "gpu_pages_used": used,
            "gpu_pages_cached": len(self._gpu_lru),
            "gpu_pages_free": len(self._gpu_free),
            "host_pages_total": self.num_host_pages,
            "host_pages_used": len(self._host_pinned) + len(self._host_held),
            "host_pages_cached": len(self._host_lru),
            "host_pages_free": len(self._host_free),
            "prefix_nodes": len(self.index),
            "sequences": len(self._seqs),
        }

    def check_integrity(self) -> None:
        """Raise RuntimeError with detail if any bookkeeping invariant is broken."""
        errors = self._gpu_errors() + self._host_errors() + self._index_errors()
        if errors:
            raise RuntimeError("CacheManager integrity: " + "; ".join(errors[:10]))

    def _gpu_errors(self) -> list[str]:
        err: list[str] = []
        free, cached = self._gpu_free, set(self._gpu_lru)
        used = {p for p, r in enumerate(self._refcount) if r > 0}
        if len(set(free)) != len(free):
            err.append("GPU free list has duplicates")
        for name, a, b in (("free&cached", set(free), cached), ("free&used", set(free), used),
                           ("cached&used", cached, used)):
            if a & b:
                err.append(f"GPU pages in two states ({name}): {sorted(a & b)[:8]}")
        if len(set(free)) + len(cached) + len(used) != self.num_gpu_pages:
            err.append(f"GPU free {len(free)} + cached {len(cached)} + used {len(used)} "
                       f"!= total {self.num_gpu_pages}")
        counts = [0] * self.num_gpu_pages
        for sid, seq in self._seqs.items():
            if len(set(seq.pages)) != len(seq.pages):
                err.append(f"sequence {sid!r} holds a page twice")
            for p in seq.pages:
                counts[p] += 1
        if counts != self._refcount:
            bad = [p for p in range(self.num_gpu_pages) if counts[p] != self._refcount[p]]
            err.append(f"refcounts disagree with page tables at pages {bad[:8]}")
        for p in cached:
            if self._gpu_node[p] is None:
                err.append(f"cached GPU page {p} is not indexed")
        for p in free:
            if self._gpu_node[p] is not None:
                err.append(f"free GPU page {p} is still indexed")
        return err

    def _host_errors(self) -> list[str]:
        err: list[str] = []
        free, cached, pinned = set(self._host_free), set(self._host_lru), self._host_pinned
        held = self._host_held
        if len(free) != len(self._host_free):
            err.append("host free list has duplicates")
        states = (free, cached, pinned, held)
        if sum(len(a) for a in states) != len(set().union(*states)):
            err.append("host pages in two states")
        if len(free) + len(cached) + len(pinned) + len(held) != self.num_host_pages:
            err.append(f"host free {len(free)} + cached {len(cached)} + pinned {len(pinned)} + held "
                       f"{len(held)} != total {self.num_host_pages}")
        seq_held = [host_page_of(r) for seq in self._seqs.values() for r in seq.host_refs]
        if len(seq_held) != len(set(seq_held)) or set(seq_held) != held:
            err.append("held host pages disagree with the sequences' offloaded pages")
        for h in held:
            if self._host_node[h] is not None:
                err.append(f"held host page {h} is indexed")
        if not self._host_release <= pinned:
            err.append("host pages awaiting release are not pinned")
        for h in cached | (pinned - self._host_release):
            if self._host_node[h] is None:
                err.append(f"host page {h} holds no node")
        for h in free:
            if self._host_node[h] is not None:
                err.append(f"free host page {h} still holds a node")
        return err

    def _index_errors(self) -> list[str]:
        err: list[str] = []
        n_nodes = 0
        for node in self.index.nodes():
            n_nodes += 1
            if not node.alive:
                err.append("dead node in the index")
            if node.parent is not None and (not node.parent.alive or node not in node.parent.children):
                err.append(f"node {node!r} has a dead or unlinked parent")
            if node.gpu_page is None and node.host_page is None:
                err.append(f"node {node!r} lives in no tier")
            if node.gpu_page is not None and self._gpu_node[node.gpu_page] is not node:
                err.append(f"GPU page {node.gpu_page} does not point back to its node")
            if node.host_page is not None and self._host_node[node.host_page] is not node:
                err.append(f"host page {node.host_page} does not point back to its node")
        n_gpu = sum(n is not None for n in self._gpu_node)
        n_host = sum(n is not None for n in self._host_node)
        if n_nodes != len(self.index):
            err.append(f"index count {len(self.index)} != nodes {n_nodes}")
        live_gpu = sum(1 for n in self.index.nodes() if n.gpu_page is not None)
        live_host = sum(1 for n in self.index.nodes() if n.host_page is not None)
        if (n_gpu, n_host) != (live_gpu, live_host):
            err.append(f"page->node maps ({n_gpu} gpu, {n_host} host) disagree with the index "
                       f"({live_gpu}, {live_host})")
        return err

    # ---------------------------------------------------------------- GPU tier
    def _max_hit_pages(self, prompt: list[int]) -> int:
        return max(0, (len(prompt) - 1) // self.page_size)

    def _seq(self, seq_id: str) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown sequence {seq_id!r}") from None

    def _incref(self, page: int) -> None:
        if self._refcount[page] == 0:
            del self._gpu_lru[page]  # KeyError here = an unindexed page was free: a bug
        self._refcount[page] += 1

    def _decref(self, page: int) -> None:
        self._refcount[page] -= 1
        if self._refcount[page] < 0:
            raise RuntimeError(f"GPU page {page} refcount went negative")
        if self._refcount[page] == 0:
            if self._gpu_node[page] is not None:
                self._gpu_lru[page] = None
            else:
                self._gpu_free.append(page)

    def _attach_gpu(self, node: PrefixNode, page: int) -> None:
        node.gpu_page = page
        self._gpu_node[page] = node

    def _alloc_gpu(self) -> int | None:
        """One GPU page with refcount 1, evicting the LRU cached page if needed."""
        if not self._gpu_free and not self._evict_gpu():
            return None
        page = self._gpu_free.pop()
        self._refcount[page] = 1
        return page

    def _evict_gpu(self) -> bool:
        """Free the least recently used cached GPU page: copy down to host, or drop."""
        if not self._gpu_lru:
            return False
        page, _ = self._gpu_lru.popitem(last=False)
        node = self._gpu_node[page]
        assert node is not None  # cached pages are indexed by definition
        self._stats["evictions_gpu"] += 1
        node.gpu_page = None
        self._gpu_node[page] = None
        self._gpu_free.append(page)
        if node.host_page is None:
            host = self._alloc_host()  # may drop this node (its ancestor was the host LRU)
            if not node.alive:
                if host is not None:
                    self._host_free.append(host)
            elif host is None:
                self._drop_node(node)
            else:
                node.host_page = host
                self._host_node[host] = node
                self._host_lru[host] = None
                self._xfer.queue(True, page, host)
                self._stats["swaps_out"] += 1
        return True

    def _swap_in(self, node: PrefixNode, gpu: int) -> None:
        host = node.host_page
        assert host is not None
        self._attach_gpu(node, gpu)
        self._xfer.queue(False, host, gpu)
        self._stats["swaps_in"] += 1
        self._stats["hit_tokens_host"] += self.page_size

    def _offload(self, seq: _Seq, need: int) -> bool:
        """Offload `seq`'s oldest computed GPU pages to held host pages until `need` GPU
        pages can be allocated. False (no change) if that cannot be done.

        Offloading keeps the page table's order (host head, GPU tail), so pages go
        oldest first; the page being computed stays on the GPU. A page shared with
        another sequence moves too (this sequence gets a private host copy) but
        frees nothing. A released GPU page that is indexed stays cached (still a
        prefix-cache entry); otherwise it is freed.
        """
        if not self.offload:
            return False
        done = max(0, seq.committed // self.page_size - len(seq.host_refs))  # computed full GPU pages
        short = need - len(self._gpu_free) - len(self._gpu_lru)
        n_move, gained = 0, 0
        for page in seq.pages[:done]:
            if gained >= short:
                break
            n_move += 1
            gained += self._refcount[page] == 1
        if gained < short or n_move > len(self._host_free) + len(self._host_lru):
            return False
        for _ in range(n_move):
            page = seq.pages.pop(0)
            host = self._alloc_host()
            if host is None:  # cannot happen after the room check; keep the invariant loud
                raise RuntimeError("host page allocation failed after the room check")
            self._xfer.queue(True, page, host)
            self._host_held.add(host)
            seq.host_refs.append(host_ref(host))
            self._decref(page)
            self._stats["offloads"] += 1
        return self.can_allocate(need)

    # --------------------------------------------------------------- host tier
    def _alloc_host(self) -> int | None:
        if not self._host_free and not self._evict_host():
            return None
        return self._host_free.pop()

    def _evict_host(self) -> bool:
        if not self._host_lru:
            return False
        host, _ = self._host_lru.popitem(last=False)
        node = self._host_node[host]
        assert node is not None
        self._stats["evictions_host"] += 1
        node.host_page = None
        self._host_node[host] = None
        self._host_free.append(host)
        if node.gpu_page is None:
            self._drop_node(node)
        return True

    def _pin_host(self, host: int | None) -> None:
        if host is None:
            raise RuntimeError("indexed node has neither a GPU nor a host page")
        del self._host_lru[host]
        self._host_pinned.add(host)

    def _unpin_host(self, host: int) -> None:
        self._host_pinned.discard(host)
        if host in self._host_release:
            self._host_release.discard(host)
            self._host_free.append(host)
        else:
            self._host_lru[host] = None

    def _drop_node(self, node: PrefixNode) -> None:
        """Remove a node and its now unreachable descendants; free what they held."""
        for n in self.index.remove(node):
            self._stats["dropped_pages"] += 1
            if n.gpu_page is not None:
                page, n.gpu_page = n.gpu_page, None
                self._gpu_node[page] = None
                if self._refcount[page] == 0:
                    del self._gpu_lru[page]
                    self._gpu_free.append(page)
            if n.host_page is not None:
                host, n.host_page = n.host_page, None
                self._host_node[host] = None
                if host in self._host_pinned:
                    self._host_release.add(host)
                else:
                    del self._host_lru[host]
                    self._host_free.append(host)


def _phases(queue: list[tuple[bool, list[tuple[int, int]]]]) -> list[tuple[bool, list[tuple[int, int]]]]:
    """Copies in queue order -> batches to run in order. Usually two: every copy-down, then every
    swap-in (a copy-down only reads a GPU page and writes a host page, so running it before a
    swap-in queued earlier is safe unless that swap-in fills its source GPU page or reads its
    destination host page). When some copy-down depends so on an earlier swap-in, consecutive
    copies of one direction are batched instead, keeping the queue's order."""
    ops = [(to_host, src, dst) for to_host, pairs in queue for src, dst in pairs]
    filled_gpu, read_host = set(), set()
    ordered = False
    for to_host, src, dst in ops:
        if not to_host:
            filled_gpu.add(dst)
            read_host.add(src)
        elif src in filled_gpu or dst in read_host:
            ordered = True
            break
    if not ordered:
        down = [(src, dst) for to_host, src, dst in ops if to_host]
        up = [(src, dst) for to_host, src, dst in ops if not to_host]
        return [(d, pairs) for d, pairs in ((True, down), (False, up)) if pairs]
    out: list[tuple[bool, list[tuple[int, int]]]] = []
    for to_host, src, dst in ops:
        if not out or out[-1][0] != to_host:
            out.append((to_host, []))
        out[-1][1].append((src, dst))
    return out


def _last_per_destination(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(src, dst) pairs, keeping the last one per dst, in first-seen dst order."""
    last: dict[int, int] = {}
    for src, dst in pairs:
        last[dst] = src
    return [(src, dst) for dst, src in last.items()]
