"""``KVCacheManager``: the KV slots of one scheduler (the slot allocator, the request table) and the radix
prefix cache that shares them between requests.

Contract (page size P, SGLang's ``page_size``):
- A placed request holds ``kv_len`` slots listed in its table row ``pool_row``. The first ``prefix_len``
  (whole pages) belong to a radix tree, locked through ``req.last_node`` of ``req.tree``; the rest are the
  request's own.
- ``release(req)`` hands the request's computed whole pages to the tree (slots the tree already had are
  freed), frees its last partial page and its row, and unlocks its node: every lock taken is given back
  exactly once.
- ``invalidate()`` after the weights change: KV computed by the old weights must never be shared again.
  With no request placed, the tree is flushed. Otherwise (requests paused in place or running across the
  update, including those that hold no entry yet: mid-way through a chunked prefill, or shorter than a
  page) the whole tree is retired, its unlocked entries freed at once, and a fresh one serves new requests.
  A retired tree's requests free their KV at release (none of it is shared), and the tree is dropped when
  the last request placed on it leaves (``placed`` counts them per tree).
- ``evict`` (through ``ensure_free``) frees least recently used unlocked leaves first.
- The routing of MoE models (``routed_experts``, when enabled) lives per slot beside the KV, so sharing a
  prefix shares its routing; ``read_routed_experts`` reads a request's before ``release``.
"""

from __future__ import annotations

import torch

from rollout.mem_cache.kv_pool import ReqToTokenPool, SlotAllocator
from rollout.mem_cache.radix_cache import RadixCache, TreeNode
from rollout.mem_cache.routed_experts import RoutedExpertsPool
from rollout.scheduler.req import Req


class KVCacheManager:
    def __init__(self, allocator: SlotAllocator, req_pool: ReqToTokenPool, page_size: int = 1,
                 disable_radix_cache: bool = False, routed_experts: RoutedExpertsPool | None = None) -> None:
        self.allocator = allocator
        self.routed_experts = routed_experts
        self.req_pool = req_pool
        self.page_size = page_size
        self.disabled = disable_radix_cache
        self.tree = self._new_tree()
        self.placed: dict[RadixCache, int] = {}  # requests placed per tree (the live one and the retired ones)

    def _new_tree(self) -> RadixCache:
        return RadixCache(self.allocator.free, disabled=self.disabled, page_size=self.page_size)

    @property
    def stale_trees(self) -> list[RadixCache]:
        """The retired trees: those that requests placed before a weight update still hold."""
        return [tree for tree in self.placed if tree is not self.tree]

    # ---- accounting ---------------------------------------------------------------------------

    @property
    def num_slots(self) -> int:
        return self.allocator.num_slots

    @property
    def used(self) -> int:
        """Slots held by requests (cached entries that could be evicted do not count)."""
        return self.allocator.num_slots - self.allocator.available - self.tree.evictable_size

    def slots_needed(self, n: int, kv_len: int = 0) -> int:
        """Free-page slots that ``n`` more tokens after ``kv_len`` take."""
        return self.allocator.slots_needed(n, kv_len)

    def can_hold(self, n: int) -> bool:
        """``n`` slots are free or held only by unlocked cache entries (which ``ensure_free`` would evict)."""
        return self.allocator.available + self.tree.evictable_size >= n

    def ensure_free(self, n: int) -> bool:
        """Evict unlocked cache entries until ``n`` slots are free; False if that is impossible."""
        short = n - self.allocator.available
        if short > 0:
            self.tree.evict(short)
        return self.allocator.available >= n

    # ---- placing requests ---------------------------------------------------------------------

    def match(self, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """The slots of the longest cached prefix of ``tokens`` (whole pages) and the node it ends at."""
        return self.tree.match_prefix(tokens)

    def lock(self, node: TreeNode) -> None:
        self.tree.inc_lock_ref(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.dec_lock_ref(node)

    def place(self, req: Req, prefix: torch.Tensor, node: TreeNode) -> None:
        """Give a waiting request a table row starting with the cached ``prefix`` (``node`` already locked)."""
        req.pool_row = self.req_pool.alloc()
        self.req_pool.write(req.pool_row, 0, prefix)
        req.kv_len = req.prefix_len = len(prefix)
        req.last_node, req.tree = node, self.tree
        self.placed[self.tree] = self.placed.get(self.tree, 0) + 1

    def extend(self, req: Req, n: int) -> None:
        """Take ``n`` slots (already ensured free) for the request's next ``n`` tokens, written to the host
        table only: the extend step computing them writes the device table (``ModelRunner.forward``)."""
        last = self.req_pool.last_slot(req.pool_row, req.kv_len)
        self.req_pool.write(req.pool_row, req.kv_len, self.allocator.alloc(n, req.kv_len, last), device=False)

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor:
        """One slot (already ensured free) for each request's next token, written to the host table only
        (the step computing the token, decode or mixed extend, writes the device table)."""
        rows, positions = [r.pool_row for r in reqs], [r.kv_len for r in reqs]
        slots = self.allocator.alloc_decode(positions, self.req_pool.last_slots(rows, positions))
        self.req_pool.write_many(rows, positions, slots, device=False)
        return slots

    def decode_slots_needed(self, reqs: list[Req]) -> int:
        """Free-page slots a decode step over ``reqs`` takes (one token each)."""
        if self.page_size == 1:
            return len(reqs)
        return sum(self.allocator.slots_needed(1, r.kv_len) for r in reqs)

    # ---- sharing and releasing ----------------------------------------------------------------

    def cache_prefix(self, req: Req) -> None:
        """Hand a freshly prefilled request's KV to the tree so later requests can share it (its whole pages:
        a last, partly filled page stays the request's own)."""
        if self.tree.disabled or req.tree is not self.tree:
            return
        tokens = req.fill_ids[:req.kv_len]
        slots = self.req_pool.slots(req.pool_row, req.kv_len)
        already = self.tree.insert(tokens, slots)
        self.allocator.free(slots[req.prefix_len:already])
        shared, node = self.tree.match_prefix(tokens)
        self.req_pool.write(req.pool_row, req.prefix_len, shared[req.prefix_len:already])
        self.tree.inc_lock_ref(node)
        self.tree.dec_lock_ref(req.last_node)
        req.last_node, req.prefix_len = node, len(shared)

    def read_routed_experts(self, req: Req) -> None:
        """Set ``req.routed_experts`` (when it asked for them) from the routing kept beside its KV: positions
        [routed_experts_start_len, seq_len - 1), every one that went through the model. Call before
        ``release``, for any request that ends (finished, or aborted with its partial tokens as SGLang returns
        them). A request whose KV does not cover those positions (aborted while waiting, retracted, or part-way
        through its prefill) gets none."""
        if not req.sampling.return_routed_experts or self.routed_experts is None or req.pool_row is None:
            return
        if req.kv_len < req.seq_len - 1:
            return
        end = req.seq_len - 1
        slots = self.req_pool.slots(req.pool_row, end)[req.sampling.routed_experts_start_len:]
        req.routed_experts = self.routed_experts.read(slots)

    def release(self, req: Req) -> None:
        """Return a request's KV: computed tokens go to the tree (or are freed), its row is freed."""
        if req.pool_row is None:
            return
        slots = self.req_pool.slots(req.pool_row, req.kv_len)
        if self.tree.disabled:
            self.allocator.free(slots)
        elif req.tree is not self.tree:  # KV from older weights: never share it, free it
            self.allocator.free(slots[req.prefix_len:])
            req.tree.dec_lock_ref(req.last_node)
            req.tree.evict(req.tree.evictable_size)
        else:
            already = self.tree.insert(req.fill_ids[:req.kv_len], slots)
            self.allocator.free(slots[req.prefix_len:already])
            self.allocator.free(slots[req.kv_len - req.kv_len % self.page_size:])  # a last partial page
            self.tree.dec_lock_ref(req.last_node)
        self._leave(req.tree)
        self.req_pool.free(req.pool_row)
        req.pool_row, req.kv_len, req.prefix_len, req.last_node, req.tree = None, 0, 0, None, None

    def flush(self) -> bool:
        """Drop every cached entry; False (nothing changed) while running requests hold entries."""
        return self.tree.flush()

    def _leave(self, tree: RadixCache) -> None:
        """A request placed on ``tree`` is released; a retired tree is forgotten with its last one."""
        self.placed[tree] -= 1
        if self.placed[tree] == 0:
            del self.placed[tree]

    def invalidate(self) -> None:
        """The weights changed: no KV computed before may be shared from now on (see the module contract)."""
        if self.tree not in self.placed and self.tree.flush():
            return
        self.tree.evict(self.tree.evictable_size)  # retired: its unlocked entries go now, the rest with its requests
        self.tree = self._new_tree()
