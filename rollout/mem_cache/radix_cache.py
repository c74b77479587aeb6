"""Radix tree over token ids whose nodes own KV slots (SGLang's RadixCache).

Contract (``page_size`` P, default 1):
- Every node holds a multiple of P tokens, and nodes branch only where whole pages differ, so every
  cached prefix is whole pages whose slots are whole KV pages.
- ``match_prefix(tokens)`` returns the slots of the longest cached prefix (a multiple of P tokens) and
  the node it ends at.
- ``insert(tokens, slots)`` adds the sequence's whole pages (its first len // P * P tokens), takes
  ownership of their slots past the already-cached prefix, and returns that prefix's length (a multiple
  of P; the caller frees its own duplicate slots in that range, and keeps the slots past the whole pages).
- A node with ``lock_ref > 0`` (a running request uses it) and its ancestors are never evicted.
- ``evict(n)`` frees at least ``n`` slots (if possible) from unlocked leaves, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable

import torch


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "uid")

    def __init__(self, uid: int, parent: "TreeNode | None" = None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = []
        self.value: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.lock_ref = 0
        self.last_access = 0
        self.uid = uid

    def __lt__(self, other: "TreeNode") -> bool:
        return self.last_access < other.last_access


def common_len(a: list[int], b: list[int], page_size: int = 1) -> int:
    """Length of the common prefix of ``a`` and ``b``, rounded down to whole pages."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i - i % page_size


class RadixCache:
    """Prefix cache of KV slots; ``free_slots`` returns evicted slots to the allocator."""

    def __init__(self, free_slots: Callable[[torch.Tensor], None], disabled: bool = False, page_size: int = 1) -> None:
        self.free_slots = free_slots
        self.disabled = disabled
        self.page_size = page_size
        self._uids = itertools.count()
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Drop every entry (the caller frees the slots first, see ``flush``)."""
        self.root = TreeNode(next(self._uids))
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    def _child_key(self, tokens: list[int], pos: int) -> int | tuple[int, ...]:
        """The key of the child holding ``tokens[pos:]``: its first token, or its first page."""
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos:pos + self.page_size])

    def _whole_pages(self, tokens: list[int]) -> list[int]:
        return tokens[:len(tokens) - len(tokens) % self.page_size]

    def match_prefix(self, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        tokens = self._whole_pages(tokens)
        if self.disabled or not tokens:
            return torch.empty(0, dtype=torch.int64), self.root
        now = next(self._clock)
        self.root.last_access = now
        path, _ = self._descend(tokens, now)
        slots = torch.cat([n.value for n in path]) if path else torch.empty(0, dtype=torch.int64)
        return slots, path[-1] if path else self.root

    def insert(self, tokens: list[int], slots: torch.Tensor) -> int:
        """Insert the whole pages of ``tokens`` → ``slots``; returns how many leading tokens were already
        cached."""
        if self.disabled:
            return 0
        tokens = self._whole_pages(tokens)
        now = next(self._clock)
        path, pos = self._descend(tokens, now)
        node = path[-1] if path else self.root
        if pos < len(tokens):
            leaf = TreeNode(next(self._uids), node)
            leaf.key = list(tokens[pos:])
            leaf.value = slots[pos:len(tokens)].clone()
            leaf.last_access = now
            node.children[self._child_key(leaf.key, 0)] = leaf
            self.evictable_size += len(leaf.key)
        return pos

    def _descend(self, tokens: list[int], now: int) -> tuple[list[TreeNode], int]:
        """Walk from the root along the longest cached prefix of ``tokens`` (whole pages), splitting the last
        node where the prefix ends inside it, and stamp each node on the way with ``now`` -> (the nodes
        below the root, in order; the prefix's length)."""
        node, pos, path = self.root, 0, []
        while pos < len(tokens) and self._child_key(tokens, pos) in node.children:
            child = node.children[self._child_key(tokens, pos)]
            n = common_len(child.key, tokens[pos:], self.page_size)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            path.append(child)
            node, pos = child, pos + n
        return path, pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split ``child`` so that its first ``n`` tokens become a new parent node; return that node."""
        mid = TreeNode(next(self._uids), child.parent)
        mid.key, mid.value = child.key[:n], child.value[:n]
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.parent.children[self._child_key(mid.key, 0)] = mid
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = mid
        mid.children[self._child_key(child.key, 0)] = child
        return mid

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots from unlocked leaves, LRU first; returns how many were freed."""
        heap = [n for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def flush(self) -> bool:
        """Evict everything; False (nothing changed) if a running request still holds a prefix."""
        if self.protected_size:
            return False
        self.evict(self.evictable_size)
        self.reset()
        return True

    def _leaves(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                out.append(node)
            stack.extend(node.children.values())
        return out
