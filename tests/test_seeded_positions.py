"""A seeded sample's tokens depend only on (seed, sample index, position) (README), whatever steps run between
its decode steps: a mixed prefill/decode step, a retraction and re-prefill, or an earlier request with the same
id. The scheduler runs in this process, so each case places its event at an exact step."""

from __future__ import annotations

import pytest
import torch

from conftest import prompts_of_lengths
from rollout.config import EngineConfig, ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import ContinueGenerationReq, GenerateReq, PauseGenerationReq
from rollout.sampling_params import SamplingParams
from rollout.scheduler.scheduler import Scheduler

PROMPT = prompts_of_lengths([10], seed=1)[0]
SEEDED = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
SEED = 7


def _scheduler(path: str, **overrides) -> Scheduler:
    config = EngineConfig(path, dtype="float32", device="cpu", skip_tokenizer_init=True, **overrides)
    sched = Scheduler(config, ModelConfig.from_path(path), TPGroup(), torch.device("cpu"))
    sched.reply = lambda reply: None
    return sched


def _submit(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams, seed: int):
    sched.handle(GenerateReq(rid, prompt, params, seed))
    return sched.outputs.live[rid]


def _run(sched: Scheduler, steps: int | None = None) -> None:
    while sched.busy and (steps is None or steps > 0):
        sched.step()
        steps = None if steps is None else steps - 1


def _alone(path: str, **overrides) -> list[int]:
    sched = _scheduler(path, **overrides)
    req = _submit(sched, "A", PROMPT, SEEDED, SEED)
    _run(sched)
    assert len(req.output_ids) == 40
    return req.output_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_mixed_step_between_decode_steps(path, overlap):
    sched = _scheduler(path, enable_mixed_chunk=True, disable_overlap_schedule=not overlap)
    req = _submit(sched, "A", PROMPT, SEEDED, SEED)
    _run(sched, 8)
    _submit(sched, "C", prompts_of_lengths([12], seed=2)[0], SamplingParams(temperature=0.0, max_tokens=1), 1)
    _run(sched)
    assert sched.stats.mixed_steps >= 1
    assert req.output_ids == _alone(path, enable_mixed_chunk=True, disable_overlap_schedule=not overlap)


def test_a_retraction_and_re_prefill_between_decode_steps(path):
    sched = _scheduler(path)
    req = _submit(sched, "A", PROMPT, SEEDED, SEED)
    _run(sched, 8)
    sched.handle(PauseGenerationReq(mode="retract", cid=1))
    _run(sched, 2)
    sched.handle(ContinueGenerationReq(cid=2))
    _run(sched)
    assert req.output_ids == _alone(path)


def test_a_request_id_used_again_gets_its_own_settings(path):
    sched = _scheduler(path)
    _submit(sched, "X", PROMPT, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), 1)
    _run(sched)
    again = _submit(sched, "X", PROMPT, SEEDED, SEED)
    _run(sched)
    assert again.output_ids == _alone(path)
