"""SGLang's new_token_ratio (``rollout.scheduler.admission.NewTokenRatio``): the reserve admission keeps for the
running requests' next tokens, its decay, and its reset from what requests really generated at a retraction."""

from __future__ import annotations

import pytest

from rollout.config import EngineConfig
from rollout.io_struct import GenerateReq
from rollout.sampling_params import SamplingParams
from rollout.scheduler.admission import (CLIP_MAX_NEW_TOKENS_ESTIMATION, NEW_TOKEN_RATIO_DECAY_STEPS,
                                         RETRACT_DECODE_STEPS, NewTokenRatio)
from rollout.scheduler.req import Req


def _req(max_new: int, prompt: int = 10, output: int = 0, context: int = 100_000) -> Req:
    req = Req(GenerateReq("r", list(range(prompt)), SamplingParams(max_new_tokens=max_new), seed=0), (), context)
    req.output_ids = [1] * output
    return req


def test_starts_at_sglang_init_ratio_and_decays_to_its_floor():
    ratio = NewTokenRatio(1.0)
    assert ratio.value == pytest.approx(0.7)
    req = _req(1000)
    assert ratio.future_tokens(req) == 700 and ratio.admission_tokens(req) == 1000
    for _ in range(NEW_TOKEN_RATIO_DECAY_STEPS // 2):
        ratio.after_decode()
    assert ratio.value == pytest.approx(0.7 - 0.5 * (0.7 - 0.098))
    for _ in range(NEW_TOKEN_RATIO_DECAY_STEPS):
        ratio.after_decode()
    assert ratio.value == pytest.approx(0.7 * 0.14)
    ratio.reset()
    assert ratio.value == pytest.approx(0.7)


def test_reserve_counts_the_remaining_budget_clipped_and_at_least_a_page():
    ratio = NewTokenRatio(2.0, page_size=4)  # 0.7 x 2 is capped at 1
    assert ratio.value == 1.0
    assert ratio.future_tokens(_req(300, output=100)) == 200
    assert ratio.future_tokens(_req(100_000)) == CLIP_MAX_NEW_TOKENS_ESTIMATION
    assert ratio.future_tokens(_req(50, output=50)) == 4  # done by length: still one page
    assert ratio.future_tokens(_req(200, prompt=90, context=100)) == 10  # the context ends it first
    in_flight = _req(300, output=100)
    in_flight.inflight_tokens = 2
    assert ratio.future_tokens(in_flight) == 198
    assert ratio.reserved([_req(300, output=100), _req(50, output=50)]) == 204


def test_a_retraction_sets_the_ratio_from_what_the_rest_generated():
    ratio = NewTokenRatio(1.0)
    remaining = [_req(1000, output=100), _req(3000, output=500)]
    ratio.after_retract(remaining)
    assert ratio.value == pytest.approx((600 + RETRACT_DECODE_STEPS * 2) / 4001)
    ratio.after_retract([_req(100, output=95)])
    assert ratio.value == 1.0


def test_conservativeness_zero_reserves_one_page_per_request():
    ratio = NewTokenRatio(0.0, page_size=2)
    req = _req(5000)
    assert ratio.future_tokens(req) == 2 and ratio.admission_tokens(req) == 2
    ratio.after_retract([req])
    assert ratio.value == 0.0


def test_config_checks_conservativeness():
    assert EngineConfig("/m").schedule_conservativeness == 0.3
    with pytest.raises(ValueError, match="schedule_conservativeness"):
        EngineConfig("/m", schedule_conservativeness=-0.5)
    assert EngineConfig("/m").decode_balance_ratio == 4.0
    with pytest.raises(ValueError, match="decode_balance_ratio"):
        EngineConfig("/m", decode_balance_ratio=-1.0)
