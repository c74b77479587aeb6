"""Which running requests of a decode step share a cached prefix, for cascade decode attention.

Requests that matched the same radix-tree node hold the same slots for that node's whole path (a node's
path never changes: a split inserts a new node above it). GRPO's N samples of one prompt: the request that
computed the prompt ends at the node of its last token, the N - 1 that reused it one node above (they match
all but their last prompt token), so a request alone at its node joins the group of its node's parent, over
the parent's shorter prefix. Only prefixes of at least ``min_prefix`` tokens are grouped; groups larger than
``max_members`` are cut into groups of that size (a last group of one is dropped).

Cascade decode costs a second launch and a merge per layer, and the L2 cache already serves much of a
prefix that several requests read at once, so it only pays when it saves a large share of the step's KV
reads (one H200, ``tools/bench_cascade.py``, Qwen3-0.6B heads, 256 requests in groups of 8: 1.11-1.98x with
prefixes of 256-2,000 tokens and 44-63% of the reads saved, 1.07x at 22%, 0.95x at 18%; 0.83-0.92x with
prefixes of 64-128 tokens). A step gets its groups when their prefixes are at least ``min_prefix`` (256, as
vLLM's cascade attention) and the reads they save are at least ``min_saved`` (20%) of the step's.

The search walks every running request (tens of microseconds at 256), so ``SharedPrefixFinder`` skips it
between extend steps once it found no group: groups only form when requests are admitted (or their prefill
is read), and requests that leave or decode cannot make one.
"""

from __future__ import annotations

from rollout.model_executor.forward_batch import SharedPrefixes
from rollout.scheduler.req import Req

MIN_SHARED_PREFIX = 256  # tokens: a shorter shared prefix is not worth a group
MIN_SAVED_SHARE = 0.2  # of the step's KV tokens: cascade decode runs when its groups save at least this many reads


class SharedPrefixFinder:
    """``shared_prefix_groups`` for each decode step, the search skipped while it cannot find a group: after a
    search found none, until the next extend step (``extend_count``, any count that changes with every
    extend step read, moves). ``max_members`` < 2: cascade decode is off, never a group."""

    def __init__(self, max_members: int) -> None:
        self.max_members = max_members
        self._extends_seen: int | None = None
        self._none_possible = False

    def __call__(self, reqs: list[Req], extend_count: int) -> SharedPrefixes | None:
        if self.max_members < 2 or (self._none_possible and extend_count == self._extends_seen):
            return None
        groups = find_shared_prefixes(reqs, self.max_members)
        self._extends_seen, self._none_possible = extend_count, not groups.members
        return groups if worth_cascade(groups, reqs) else None


def shared_prefix_groups(reqs: list[Req], max_members: int, min_prefix: int = MIN_SHARED_PREFIX,
                         min_saved: float = MIN_SAVED_SHARE) -> SharedPrefixes | None:
    """The groups of ``reqs`` (by index) that share at least ``min_prefix`` cached tokens; None when there are
    none, when they save less than ``min_saved`` of the step's KV reads (``worth_cascade``), or when
    ``max_members`` < 2. Every member's KV is longer than its group's prefix (its prefix is cached, its newest
    token is not)."""
    if max_members < 2:
        return None
    groups = find_shared_prefixes(reqs, max_members, min_prefix)
    return groups if worth_cascade(groups, reqs, min_saved) else None


def worth_cascade(groups: SharedPrefixes, reqs: list[Req], min_saved: float = MIN_SAVED_SHARE) -> bool:
    """Whether ``groups`` of ``reqs`` save at least ``min_saved`` of the step's KV reads (each group reads its
    prefix once instead of once per member)."""
    saved = sum((len(m) - 1) * n for n, m in zip(groups.prefix_lens, groups.members))
    return bool(groups.members) and saved >= min_saved * sum(r.kv_len + 1 for r in reqs)


def find_shared_prefixes(reqs: list[Req], max_members: int, min_prefix: int = MIN_SHARED_PREFIX) -> SharedPrefixes:
    """Every group of ``reqs`` (by index, up to ``max_members`` each) over at least ``min_prefix`` shared cached
    tokens, whatever they save (none: empty)."""
    by_node: dict[int, tuple[object, int, list[int]]] = {}  # id(node) -> (node, its path length, rows)
    for i, req in enumerate(reqs):
        if req.prefix_len >= min_prefix:
            by_node.setdefault(id(req.last_node), (req.last_node, req.prefix_len, []))[2].append(i)
    for key, (node, length, rows) in list(by_node.items()):
        parent = node.parent
        if len(rows) > 1 or parent is None or parent.parent is None or length - len(node.key) < min_prefix:
            continue
        by_node.setdefault(id(parent), (parent, length - len(node.key), []))[2].extend(rows)
        del by_node[key]
    lens: list[int] = []
    members: list[tuple[int, ...]] = []
    for _, length, rows in by_node.values():
        for start in range(0, len(rows) - 1, max_members):
            chunk = rows[start:start + max_members]
            if len(chunk) > 1:
                lens.append(length)
                members.append(tuple(chunk))
    return SharedPrefixes(tuple(lens), tuple(members))
