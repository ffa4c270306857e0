"""Prefix index over full pages: exact token-prefix matching, torch-free.

Every full page of a computed sequence becomes a node keyed by
`page_key(parent key, page tokens, namespace)`; the namespace names the model
and KV format, so pages of one model/format never serve another. Chained keys
make a page's key depend on every token before it:

    prompt:  | page 0 tokens | page 1 tokens | page 2 tokens | partial |
    nodes:     n0 = key(0, t0)  n1 = key(n0, t1)  n2 = key(n1, t2)   (not indexed)

The hash only picks a bucket: a match also compares the stored tokens, the
namespace and the parent node itself, so two different prefixes whose keys
collide can never serve each other.

The index only knows where a node's KV lives (`gpu_page`, `host_page`); the
CacheManager decides residency, refcounts and eviction.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence

# Root of every chain: the "parent key" of a prompt's first page.
ROOT_KEY = 0
# 64-bit keys: buckets collide rarely; collisions are still correct (exact compare).
KEY_BYTES = 8


def page_key(parent_key: int, tokens: Sequence[int], namespace: str) -> int:
    """Stable 64-bit key of one full page given its parent's key."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(parent_key.to_bytes(KEY_BYTES, "little"))
    h.update(namespace.encode())
    h.update(b"\0")
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class PrefixNode:
    """One indexed full page. `alive` turns False once removed from the index."""

    __slots__ = ("key", "parent", "tokens", "namespace", "gpu_page", "host_page", "children", "alive")

    def __init__(self, key: int, parent: PrefixNode | None, tokens: tuple[int, ...], namespace: str):
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.namespace = namespace
        self.gpu_page: int | None = None
        self.host_page: int | None = None
        self.children: list[PrefixNode] = []
        self.alive = True

    @property
    def depth(self) -> int:
        d, n = 0, self.parent
        while n is not None:
            d, n = d + 1, n.parent
        return d

    def __repr__(self) -> str:
        return f"PrefixNode(key={self.key:#x}, gpu={self.gpu_page}, host={self.host_page}, n={len(self.tokens)})"


class PrefixIndex:
    """Buckets of nodes by key; exact-match lookups along the chain."""

    def __init__(self, page_size: int):
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self._buckets: dict[int, list[PrefixNode]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def nodes(self) -> Iterator[PrefixNode]:
        for bucket in self._buckets.values():
            yield from bucket

    def find(self, parent: PrefixNode | None, tokens: Sequence[int], namespace: str) -> PrefixNode | None:
        """The node for `tokens` under `parent`, compared exactly (never by hash alone)."""
        tokens = tuple(tokens)
        key = page_key(parent.key if parent is not None else ROOT_KEY, tokens, namespace)
        for node in self._buckets.get(key, ()):
            if node.parent is parent and node.namespace == namespace and node.tokens == tokens:
                return node
        return None

    def match(self, tokens: Sequence[int], namespace: str, max_pages: int) -> list[PrefixNode]:
        """Longest chain of indexed full pages that is an exact prefix of `tokens`."""
        ps = self.page_size
        chain: list[PrefixNode] = []
        parent: PrefixNode | None = None
        for i in range(min(max_pages, len(tokens) // ps)):
            node = self.find(parent, tokens[i * ps:(i + 1) * ps], namespace)
            if node is None:
                break
            chain.append(node)
            parent = node
        return chain

    def insert(self, parent: PrefixNode | None, tokens: Sequence[int], namespace: str) -> PrefixNode:
        """Add a new node; the caller must have checked `find` returned None."""
        tokens = tuple(tokens)
        if len(tokens) != self.page_size:
            raise ValueError(f"only full pages are indexed: got {len(tokens)} tokens, page_size {self.page_size}")
        if parent is not None and not parent.alive:
            raise ValueError("cannot insert under a removed parent node")
        key = page_key(parent.key if parent is not None else ROOT_KEY, tokens, namespace)
        node = PrefixNode(key, parent, tokens, namespace)
        self._buckets.setdefault(key, []).append(node)
        if parent is not None:
            parent.children.append(node)
        self._count += 1
        return node

    def remove(self, node: PrefixNode) -> list[PrefixNode]:
        """Remove `node` and all its descendants (unreachable without it). Returns them, node first."""
        removed: list[PrefixNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            removed.append(n)
            stack.extend(n.children)
            bucket = self._buckets[n.key]
            bucket.remove(n)
            if not bucket:
                del self._buckets[n.key]
            n.alive = False
            self._count -= 1
        if node.parent is not None:
            node.parent.children.remove(node)
        for n in removed:
            n.children = []
        return removed
