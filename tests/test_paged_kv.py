"""KV pages of more than one token (``page_size``): the allocator, the radix cache's whole-page sharing, and the
scheduler's invariant that a request's position i sits at offset i % page_size of its (i // page_size)-th page
(what a paged decode kernel such as XQA reads), through prefix sharing, chunked prefill and decode."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import prompts_of_lengths
from rollout import SamplingParams
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import GenerateReq
from rollout.mem_cache.kv_pool import ReqToTokenPool, SlotAllocator
from rollout.mem_cache.radix_cache import RadixCache
from rollout.scheduler.scheduler import Scheduler


def test_allocator_fills_the_last_page_then_takes_whole_pages():
    a = SlotAllocator(32, page_size=4)  # pages 1..8
    assert a.available == 32 and a.slots_needed(6) == 8 and a.slots_needed(2, kv_len=6) == 0
    first = a.alloc(6)
    assert first.tolist() == [4, 5, 6, 7, 8, 9] and a.available == 24
    more = a.alloc(3, kv_len=6, last_slot=int(first[-1]))
    assert more.tolist() == [10, 11, 12] and a.available == 20
    dec = a.alloc_decode([9, 8], torch.tensor([12, 20]))  # 9: the page holding slot 12 has room; 8: a full page, a new one
    assert dec.tolist() == [13, 16] and a.available == 16
    a.free(torch.cat([first, more, dec[:1]]))  # pages 1, 2, 3
    assert a.available == 28
    with pytest.raises(RuntimeError, match="twice"):
        a.free(torch.tensor([5]))
    assert a.alloc(100) is None and a.available == 28


def test_page_size_one_is_plain_slots():
    a = SlotAllocator(8)
    assert a.alloc(3).tolist() == [1, 2, 3]
    assert a.alloc_decode([5, 9], torch.tensor([1, 2])).tolist() == [4, 5]
    a.free(torch.tensor([2, 4]))
    assert a.available == 5


def test_last_slots_reads_each_rows_newest_slot_in_one_gather():
    pool = ReqToTokenPool(4, 8, "cpu")
    pool.write(1, 0, torch.tensor([7, 8, 9]))
    pool.write(3, 0, torch.tensor([20, 21]))
    assert pool.last_slots([1, 3, 2], [3, 1, 0]).tolist() == [9, 20, 0]


def test_radix_cache_shares_whole_pages_only():
    freed: list[int] = []
    tree = RadixCache(lambda s: freed.extend(s.tolist()), page_size=4)
    a = list(range(10))
    assert tree.insert(a, torch.arange(100, 110)) == 0  # only the 8 tokens of whole pages go in
    assert tree.total_size == 8
    slots, _ = tree.match_prefix(a)
    assert slots.tolist() == list(range(100, 108))
    b = [0, 1, 2, 3, 4, 5, 99, 98, 97]  # differs inside the second page: shares the first page only
    assert tree.match_prefix(b)[0].tolist() == [100, 101, 102, 103]
    assert tree.insert(b, torch.arange(200, 209)) == 4
    assert tree.total_size == 12  # 8 + b's second page (its 9th token is no whole page)
    assert tree.match_prefix(b)[0].tolist() == [100, 101, 102, 103, 204, 205, 206, 207]
    assert tree.match_prefix(a[:7])[0].tolist() == [100, 101, 102, 103]
    assert tree.evict(100) == 12 and sorted(freed) == [*range(100, 108), *range(204, 208)]


def _check_pages(sched: Scheduler, page: int) -> None:
    """Every running request's slots: position i at offset i % page of the page of position i - i % page."""
    for req in list(sched.running) + ([sched.prefill.chunked] if sched.prefill.chunked is not None else []):
        if req.pool_row is None or not req.kv_len:
            continue
        slots = sched.cache.req_pool.cpu_table[req.pool_row, :req.kv_len].to(torch.int64)
        pos = torch.arange(req.kv_len)
        assert torch.equal(slots % page, pos % page), f"request {req.rid}: slots off their page offsets"
        assert torch.equal(slots // page, slots[pos - pos % page] // page), f"request {req.rid}: a page is split"


@pytest.mark.parametrize("chunk", [5, 8192])
def test_scheduler_keeps_positions_on_their_pages_and_matches_transformers(tiny_dir, hf_reference, chunk):
    path = tiny_dir("llama")
    page = 4
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True, page_size=page,
                          chunked_prefill_size=chunk, max_prefill_tokens=max(chunk, 12), max_total_tokens=256)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    prefix = prompts_of_lengths([13], seed=81)[0]
    prompts = [prefix + s for s in prompts_of_lengths([3, 6, 1, 9], seed=82)] + prompts_of_lengths([7, 21], seed=83)
    launch = sched.launch
    launches = []

    def checked_launch(reqs, inputs, sampled):
        launches.append(inputs.mode.value)
        _check_pages(sched, page)
        for req in reqs:  # the step's own new slots too
            slots = sched.cache.req_pool.cpu_table[req.pool_row, :req.kv_len + 1].to(torch.int64)
            assert int(slots[-1]) % page == req.kv_len % page
        return launch(reqs, inputs, sampled)

    sched.launch = checked_launch
    ids = itertools.count()
    params = SamplingParams(temperature=0.0, max_new_tokens=11, ignore_eos=True)
    done = []
    for round_prompts in (prompts, prompts[:3]):  # the second round reuses the first round's cached pages
        for p in round_prompts:
            rid = f"r{next(ids)}"
            sched.handle(GenerateReq(rid, p, params, seed=0))
            done.append((p, sched.outputs.live[rid]))
        while sched.busy:
            sched.step()
    assert launches.count("decode") >= 10 and launches.count("extend") >= 2
    hf = hf_reference(path)
    for p, req in done:
        assert req.output_ids == hf.greedy(p, 11)
    assert any(req.cached_tokens >= 12 for _, req in done[len(prompts):])
    assert sched.in_flight is None and not sched.running
    assert sched.cache.allocator.available + sched.cache.tree.total_size == sched.cache.allocator.num_slots
    assert sched.cache.tree.total_size % page == 0 and sched.cache.tree.total_size > 0
