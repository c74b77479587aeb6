"""``KVCacheManager`` on its own: lock counts, LRU eviction, node splits, the tree retired by a weight update
while requests hold it, and (through a real scheduler) a pause in place across an update."""

from __future__ import annotations

import pytest
import torch

from conftest import prefill_request as _prefill, prompts_of_lengths
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import ContinueGenerationReq, GenerateReq, PauseGenerationReq, UpdateWeightsFromDiskReq
from rollout.mem_cache.kv_pool import ReqToTokenPool, SlotAllocator
from rollout.sampling_params import SamplingParams
from rollout.scheduler.cache import KVCacheManager
from rollout.scheduler.req import Req
from rollout.scheduler.scheduler import Scheduler

SLOTS = 64


def _cache(page: int = 1) -> KVCacheManager:
    return KVCacheManager(SlotAllocator(SLOTS, page), ReqToTokenPool(8, 128, "cpu"), page)


def _req(rid: str, prompt: list[int]) -> Req:
    return Req(GenerateReq(rid, prompt, SamplingParams(max_tokens=4), seed=0), (2,), context_len=128)


def _locks(cache: KVCacheManager) -> list[int]:
    out, stack = [], list(cache.tree.root.children.values())
    while stack:
        node = stack.pop()
        out.append(node.lock_ref)
        stack.extend(node.children.values())
    return out


def test_lock_counts_follow_the_requests_that_hold_a_prefix():
    cache = _cache()
    a, b = _req("a", list(range(10, 20))), _req("b", list(range(10, 20)) + [30, 31])
    _prefill(cache, a)
    assert cache.tree.protected_size == 10 and cache.tree.evictable_size == 0
    _prefill(cache, b)  # shares a's ten tokens: they are locked twice, b's own two once
    assert b.prefix_len == 12
    assert sorted(_locks(cache)) == [1, 2]
    cache.release(a)
    assert sorted(_locks(cache)) == [1, 1]
    cache.release(b)
    assert _locks(cache) and set(_locks(cache)) == {0}, "every lock taken is given back once"
    assert cache.tree.protected_size == 0 and cache.tree.evictable_size == 12
    assert cache.allocator.available + cache.tree.total_size == SLOTS
    assert cache.used == 0


def test_lru_eviction_frees_least_recently_used_unlocked_leaves_first():
    cache = _cache()
    reqs = [_req(str(i), [100 + 10 * i + j for j in range(8)]) for i in range(3)]
    for r in reqs:
        _prefill(cache, r)
        cache.release(r)
    cache.match(reqs[0].fill_ids)  # touch the oldest: now the most recently used
    held = _req("held", reqs[2].fill_ids + [7])
    _prefill(cache, held)  # locks request 2's entry
    free_before = cache.allocator.available
    assert cache.ensure_free(free_before + 8)  # room for 8 more: one leaf goes
    left = {tuple(c.key[:1]) for c in cache.tree.root.children.values()}
    assert left == {(100,), (120,)}, "request 1's entry (least recently used, unlocked) is evicted first"
    assert not cache.ensure_free(SLOTS), "a locked entry is never evicted"
    assert cache.match(reqs[2].fill_ids)[0].numel() == 8
    cache.release(held)


def test_a_partial_match_splits_the_node_and_keeps_the_slots():
    cache = _cache()
    a = _req("a", [1, 2, 3, 4, 5, 6])
    _prefill(cache, a)
    slots_a = cache.req_pool.slots(a.pool_row, 6)
    cache.release(a)
    prefix, node = cache.match([1, 2, 3, 9])
    assert torch.equal(prefix, slots_a[:3]) and node.key == [1, 2, 3]
    assert [c.key for c in node.children.values()] == [[4, 5, 6]]
    b = _req("b", [1, 2, 3, 9, 10])
    _prefill(cache, b)
    assert b.prefix_len == 5 and torch.equal(cache.req_pool.slots(b.pool_row, 3), slots_a[:3])
    assert sorted(c.key[0] for c in node.children.values()) == [4, 9]
    cache.release(b)
    assert cache.allocator.available + cache.tree.total_size == SLOTS


@pytest.mark.parametrize("page", [1, 4])
def test_an_update_retires_the_tree_that_running_requests_hold(page):
    cache = _cache(page)
    cached, running = _req("c", list(range(40, 48))), _req("r", list(range(50, 60)))
    _prefill(cache, cached)
    cache.release(cached)
    _prefill(cache, running)  # paused in place across the update: it keeps its KV
    old = cache.tree
    cache.invalidate()
    assert cache.stale_trees == [old] and cache.tree is not old and cache.tree.total_size == 0
    assert old.evictable_size == 0, "the unlocked entries of the old tree are freed at once"
    assert cache.match(list(range(50, 60)))[0].numel() == 0, "new requests never share KV of old weights"
    fresh = _req("f", list(range(50, 60)))
    _prefill(cache, fresh)
    assert fresh.tree is cache.tree and running.tree is old
    running.output_ids.append(5)  # it resumes, generates on, and finishes
    cache.release(running)
    assert cache.stale_trees == [], "the retired tree goes with its last request"
    cache.release(fresh)
    assert cache.allocator.available + cache.tree.total_size == SLOTS


def _place_mid_chunk(cache: KVCacheManager, req: Req, computed: int) -> None:
    """A request part-way through a chunked prefill: placed with ``computed`` tokens done and no tree entry
    of its own yet (its node is the root)."""
    prefix, node = cache.match(req.fill_ids[:req.prefix_match_len()])
    cache.lock(node)
    cache.place(req, prefix, node)
    assert cache.ensure_free(cache.slots_needed(computed, req.kv_len))
    cache.extend(req, computed)
    req.kv_len += computed


@pytest.mark.parametrize("page", [1, 4])
def test_requests_holding_no_entry_keep_the_retired_tree_until_they_leave(page):
    """A request placed but holding no tree entry (mid-way through a chunked prefill, or shorter than a page)
    belongs to the tree as much as one holding entries: it is released after the tree's other requests, and
    its KV (partly from the old weights) is never shared by the new tree."""
    cache = _cache(page)
    held = _req("held", list(range(50, 60)))
    _prefill(cache, held)
    short = _req("short", [7, 8, 9])  # under a page at page 4; at page 1 mid-chunk below
    if page == 4:
        _prefill(cache, short)
        assert short.last_node is cache.tree.root
    else:
        _place_mid_chunk(cache, short, 2)
    old = cache.tree
    cache.invalidate()
    assert cache.stale_trees == [old] and short.tree is old
    cache.release(held)
    assert cache.stale_trees == [old], "the retired tree stays while a request placed on it runs"
    rest = short.seq_len - short.kv_len  # the chunked prefill completes
    if rest:
        assert cache.ensure_free(rest)
        cache.extend(short, rest)
        short.kv_len += rest
    cache.cache_prefix(short)
    cache.release(short)  # was: ValueError (the retired tree removed twice)
    assert cache.stale_trees == [] and cache.tree.total_size == 0
    assert cache.allocator.available == SLOTS and cache.placed == {}


def test_an_update_retires_the_tree_while_a_chunked_prefill_runs_even_with_no_entry_locked():
    cache = _cache()
    chunked = _req("chunked", list(range(20, 40)))
    _place_mid_chunk(cache, chunked, 8)
    old = cache.tree
    cache.invalidate()  # was: a flush, after which the request's old KV went into the live tree
    assert cache.tree is not old and chunked.tree is old
    cache.extend(chunked, 12)
    chunked.kv_len += 12
    cache.cache_prefix(chunked)
    cache.release(chunked)
    assert cache.tree.total_size == 0, "KV computed partly by the old weights is never shared"
    assert cache.match(list(range(20, 40)))[0].numel() == 0
    assert cache.stale_trees == [] and cache.allocator.available == SLOTS


def test_an_update_with_no_request_running_frees_the_cache_at_once():
    cache = _cache()
    r = _req("r", list(range(5, 25)))
    _prefill(cache, r)
    cache.release(r)
    assert cache.tree.total_size == 20
    cache.invalidate()
    assert cache.stale_trees == [] and cache.tree.total_size == 0 and cache.allocator.available == SLOTS


def test_pause_in_place_across_an_update_keeps_running_requests_and_drops_their_stale_kv(tiny_dir, hf_reference):
    path = tiny_dir("llama")
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    replies = []
    sched.reply = replies.append
    prompt = prompts_of_lengths([12], seed=91)[0]
    sched.handle(GenerateReq("long", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), 0))
    for _ in range(6):
        sched.step()
    sched.handle(PauseGenerationReq(mode="in_place", cid=1))
    running = sched.outputs.live["long"]
    assert running in sched.running and len(running.output_ids) >= 3
    sched.handle(UpdateWeightsFromDiskReq(model_path=path, cid=2))  # the same weights, a new version
    while sched.update_queue:
        sched.step()
    assert [r.ok for r in replies] == [True, True] and replies[1].result["weight_version"] == "1"
    assert sched.cache.stale_trees and running.tree is sched.cache.stale_trees[0]
    sched.handle(ContinueGenerationReq(cid=3))
    sched.handle(GenerateReq("again", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), 0))
    again = sched.outputs.live["again"]
    while sched.busy:
        sched.step()
    assert running.output_ids == hf_reference(path).greedy(prompt, 30)
    assert again.cached_tokens == 0, "a request after the update reuses no KV of the old weights"
    assert sched.cache.stale_trees == [] and not sched.running
    assert sched.cache.allocator.available + sched.cache.tree.total_size == sched.cache.num_slots


def test_a_chunked_prefill_holding_kv_is_retracted_before_a_running_request_that_fits_is_aborted(
        tiny_dir, hf_reference):
    """A running request that fits the pool on its own must not be aborted for want of a slot that a request
    part-way through its chunked prefill holds: that request is retracted (and re-prefilled later) instead."""
    path = tiny_dir("llama")
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_total_tokens=64,
                          chunked_prefill_size=8, max_prefill_tokens=8)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    sched.reply = lambda reply: None
    short, long = prompts_of_lengths([4, 60], seed=3)
    sched.handle(GenerateReq("R", short, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), 0))
    running = sched.outputs.live["R"]
    for _ in range(4):
        sched.step()
    sched.handle(GenerateReq("C", long, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), 0))
    chunked = sched.outputs.live["C"]
    while sched.busy:
        sched.step()
    assert running.finished.type == "length", running.finished  # was: abort, "does not fit in the KV cache"
    assert chunked.finished.type == "length" and sched.stats.retractions >= 1
    hf = hf_reference(path)
    assert running.output_ids == hf.greedy(short, 40) and chunked.output_ids == hf.greedy(long, 3)
    assert sched.cache.used == 0 and sched.cache.allocator.available + sched.cache.tree.total_size == 64
