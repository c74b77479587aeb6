"""Cascade decode's groups (``rollout.scheduler.prefix_groups``): which running requests share cached KV slots,
found through the real radix cache as the scheduler fills it (GRPO's N samples of a prompt), and their host
packing for the kernel (``SharedPrefixes.pack``). The kernel itself: tests/test_triton_decode.py."""

from __future__ import annotations

import pytest
import torch

from conftest import prefill_request

from rollout.mem_cache.kv_pool import ReqToTokenPool, SlotAllocator
from rollout.model_executor.forward_batch import SharedPrefixes
from rollout.sampling_params import SamplingParams
from rollout.io_struct import GenerateReq
from rollout.scheduler.cache import KVCacheManager
from rollout.scheduler.prefix_groups import SharedPrefixFinder, shared_prefix_groups
from rollout.scheduler.req import Req


def _cache() -> KVCacheManager:
    return KVCacheManager(SlotAllocator(4096, 1), ReqToTokenPool(32, 512, "cpu"), 1)


def _req(rid: str, prompt: list[int]) -> Req:
    return Req(GenerateReq(rid, prompt, SamplingParams(max_tokens=8), seed=0), (2,), context_len=512)


def _running(cache: KVCacheManager, req: Req) -> Req:
    """Prefill ``req`` as the scheduler does (``prefill_request``), then take its first decode slot."""
    prefill_request(cache, req)
    req.output_ids.append(5)
    cache.alloc_decode([req])
    return req


def _same_slots(cache: KVCacheManager, reqs: list[Req], n: int) -> bool:
    rows = [cache.req_pool.slots(r.pool_row, n) for r in reqs]
    return all(torch.equal(rows[0], r) for r in rows[1:])


def test_grpo_samples_of_a_prompt_form_one_group_over_its_shared_slots():
    cache = _cache()
    a, b = list(range(100, 200)), list(range(300, 380))  # two prompts of 100 and 80 tokens
    reqs = [_running(cache, _req(f"a{i}", a)) for i in range(4)]
    reqs.insert(2, _running(cache, _req("other", list(range(600, 620)))))  # 20 tokens: too short to group
    reqs += [_running(cache, _req(f"b{i}", b)) for i in range(3)]
    shared = shared_prefix_groups(reqs, max_members=8, min_prefix=64)
    # each sample hands its prompt to the tree after its prefill and ends at the node of the whole prompt
    assert shared.members == ((0, 1, 3, 4), (5, 6, 7)) and shared.prefix_lens == (100, 80)
    for rows, n in zip(shared.members, shared.prefix_lens):
        members = [reqs[i] for i in rows]
        assert _same_slots(cache, members, n) and all(r.kv_len + 1 > n for r in members)  # decode: kv_len + 1
    assert shared_prefix_groups(reqs, max_members=1, min_prefix=64) is None
    assert shared_prefix_groups(reqs[2:3], max_members=8, min_prefix=64) is None


def test_a_request_alone_below_a_group_node_joins_it_over_the_shorter_prefix():
    """A prompt that extends the samples' prompt ends one node deeper, alone: it joins their group over the
    prompt they share (its parent node's path), not over its own longer prefix."""
    cache = _cache()
    a = list(range(100, 200))
    reqs = [_running(cache, _req(f"a{i}", a)) for i in range(2)] + [_running(cache, _req("x", a + [7, 8, 9]))]
    assert reqs[2].prefix_len == 103 and reqs[2].last_node.parent is reqs[0].last_node
    shared = shared_prefix_groups(reqs, max_members=8, min_prefix=64)
    assert shared.members == ((0, 1, 2),) and shared.prefix_lens == (100,)
    assert _same_slots(cache, reqs, 100)
    lone = [_running(cache, _req("y", a + [1, 2])), _running(cache, _req("z", a + [3, 4]))]
    # two singletons under one node that holds no row of its own
    shared = shared_prefix_groups(lone, max_members=8, min_prefix=64)
    assert shared.members == ((0, 1),) and shared.prefix_lens == (100,)


def test_large_groups_are_cut_and_a_last_single_row_is_dropped():
    cache = _cache()
    reqs = [_running(cache, _req(f"s{i}", list(range(10, 90)))) for i in range(7)]
    shared = shared_prefix_groups(reqs, max_members=3, min_prefix=64)
    assert shared.members == ((0, 1, 2), (3, 4, 5)) and shared.prefix_lens == (80, 80)
    assert shared_prefix_groups(reqs[:1], max_members=8, min_prefix=64) is None  # one request shares with nobody


def test_groups_come_only_with_long_prefixes_that_save_a_large_share_of_the_reads():
    """By default a prefix must be 256 tokens (vLLM's threshold) and the groups must save 20% of the step's KV
    reads: the measured points where cascade decode stops paying (tools/bench_cascade.py)."""
    cache = _cache()
    reqs = [_running(cache, _req(f"s{i}", list(range(10, 110)))) for i in range(4)]  # 100 shared tokens
    assert shared_prefix_groups(reqs, max_members=8) is None
    cache = _cache()
    reqs = [_running(cache, _req(f"l{i}", list(range(10, 310)))) for i in range(2)]  # 300 shared tokens
    assert shared_prefix_groups(reqs, max_members=8).prefix_lens == (300,)  # saves 300 of 602 reads
    reqs.append(_running(cache, _req("own", list(range(400, 500)) * 3)))  # 300 tokens of its own
    assert shared_prefix_groups(reqs, max_members=8).members == ((0, 1),)  # 300 of 903
    assert shared_prefix_groups(reqs, max_members=8, min_saved=0.34) is None


def test_the_finder_skips_the_search_between_extend_steps_once_it_found_no_group():
    """Groups form only when requests are admitted: after a search without any, the finder answers None at
    once until the extend count moves (the scheduler passes its prefill token count); while groups exist it
    searches every step (members leave, indices shift)."""
    cache = _cache()
    alone = [_running(cache, _req("x", list(range(1000, 1300))))]
    samples = [_running(cache, _req(f"s{i}", list(range(10, 310)))) for i in range(2)]
    finder = SharedPrefixFinder(8)
    assert finder(alone, extend_count=5) is None
    assert finder(alone + samples, extend_count=5) is None  # skipped: no extend step since the empty search
    assert finder(alone + samples, extend_count=6).members == ((1, 2),)
    assert finder(samples, extend_count=6).members == ((0, 1),)  # groups existed: searched again
    assert finder(samples[:1], extend_count=6) is None and finder(samples, extend_count=6) is None
    assert SharedPrefixFinder(0)(samples, extend_count=7) is None  # cascade decode off


def test_pack_lays_out_each_rows_prefix_then_the_padded_group_table():
    shared = SharedPrefixes((99, 79), ((1, 3, 0), (5, 4)))
    out = shared.pack(batch_size=6, max_groups=3, max_members=4)
    assert out.dtype == torch.int32
    assert out[:6].tolist() == [99, 99, 0, 99, 79, 79]
    assert out[6:].view(3, 5).tolist() == [[99, 1, 3, 0, -1], [79, 5, 4, -1, -1], [0, -1, -1, -1, -1]]
    with pytest.raises(ValueError, match="do not fit"):
        shared.pack(batch_size=6, max_groups=1, max_members=4)
    with pytest.raises(ValueError, match="do not fit"):
        shared.pack(batch_size=6, max_groups=3, max_members=2)


@pytest.mark.parametrize("balanced", [False, True])
def test_a_scheduler_with_cascade_decode_groups_the_samples_of_a_prompt_in_its_decode_steps(tiny_dir, hf_reference,
                                                                                            balanced):
    """Through a real scheduler (CPU: its torch backend ignores the groups, so this checks the scheduling side):
    four samples of a 300-token prompt and one other request. After the samples' prefill every decode step
    carries one group of the four over the prompt they share in the radix cache, their table rows agree over
    it, the step stats count the groups, and the outputs are transformers' greedy ones. A step the backend
    wants cut into pieces by length (``balanced``: a straggler) carries no groups."""
    from conftest import prompts_of_lengths
    from rollout.config import EngineConfig, ModelConfig
    from rollout.distributed import TPGroup
    from rollout.model_executor.forward_batch import ForwardMode
    from rollout.scheduler.scheduler import Scheduler

    path = tiny_dir("llama")
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    sched.reply = lambda msg: None
    sched.decode.prefixes = SharedPrefixFinder(8)  # as the Triton decode backend takes them
    assert sched.decode.balanced_decode == sched.runner.attn_backend.wants_balanced_decode
    asked: list[list[int]] = []
    sched.decode.balanced_decode = lambda seq_lens: asked.append(list(seq_lens)) is None and balanced
    steps = []
    run_step = sched.runner.run_step

    def record(step, *args, **kwargs):
        if step.mode == ForwardMode.DECODE:
            groups = step.shared_prefixes
            steps.append(groups)
            assert step.balanced_decode is balanced  # the scheduler's answer travels with the step
            if groups is not None:  # checked as the step launches, while the rows are the samples'
                members = [step.rows[i] for i in groups.members[0]]
                assert groups.prefix_lens == (300,) and sorted(members) == sorted(r.pool_row for r in reqs)
                table = sched.cache.req_pool
                assert all(torch.equal(table.slots(members[0], 300), table.slots(m, 300)) for m in members[1:])
        return run_step(step, *args, **kwargs)

    sched.runner.run_step = record
    prompt, other = prompts_of_lengths([300, 20], seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i in range(4):
        sched.handle(GenerateReq(f"s{i}", prompt, params, 0))
    sched.handle(GenerateReq("other", other, params, 0))
    reqs = [sched.outputs.live[f"s{i}"] for i in range(4)]
    while sched.busy:
        sched.step()
    grouped = [s for s in steps if s is not None]
    assert len(asked) == len(steps) and all(len(lens) >= 4 for lens in asked)  # asked at every decode step
    if balanced:
        assert grouped == []
    else:
        assert len(grouped) >= 4
    assert sched.stats.snapshot(False)["cascade_steps"] == len(grouped)
    want = hf_reference(path).greedy(prompt, 6)
    assert all(r.output_ids == want for r in reqs)
