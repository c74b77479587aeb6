"""SamplingParams set after construction, as vLLM users do (veRL's ``update_sampling_params`` sets
``max_tokens``, ``n``, ``logprobs``, ... on a shared object): vLLM's names are settable, a misspelt name is an
error, and a value set out of range is the same ValueError for that call as at construction. Passed through
unchecked before, ``logprobs=1000`` killed the scheduler (every caller failed, the engine was dead), ``n=0``
hung its caller, ``max_tokens`` could not be set and ``min_tokens`` was silently ignored."""

from __future__ import annotations

import pytest

from rollout import SamplingParams


def test_vllm_names_are_settable_and_honoured(engine):
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    params.max_tokens = 5
    params.min_tokens = 5
    assert (params.max_new_tokens, params.min_new_tokens) == (5, 5)
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5
    with pytest.raises(AttributeError, match="max_token"):
        params.max_token = 3  # misspelt: it was kept as an attribute nobody reads


@pytest.mark.parametrize("field,value,words", [
    ("logprobs", 1000, "Requested sample logprobs of 1000"),
    ("prompt_logprobs", 600, "Requested prompt logprobs of 600"),
    ("n", 0, "n must be in"),
    ("temperature", -1.0, "temperature"),
    ("max_new_tokens", -3, "max_new_tokens"),
    ("top_p", 0.0, "top_p"),
])
def test_a_value_set_out_of_range_is_refused_for_that_call_only(engine, field, value, words):
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=words):
        engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)
    assert engine.tokenizer_manager.dead is None
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4, logprobs=2),
                          use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_logprobs) == 4


def test_clone_takes_vllm_and_sglang_names():
    """``clone(max_tokens=8)`` raised "'max_new_tokens' and 'max_tokens' name the same setting": every field was
    passed by its own name beside the alias."""
    base = SamplingParams(temperature=0.5, max_tokens=4, stop=["x"])
    copy = base.clone(max_tokens=8, min_tokens=2, sampling_seed=3, no_stop_trim=True)
    assert (copy.max_new_tokens, copy.min_new_tokens, copy.seed, copy.include_stop_str_in_output) == (8, 2, 3, True)
    assert (copy.temperature, copy.stop, base.max_new_tokens) == (0.5, ["x"], 4)
    with pytest.raises(ValueError, match="name the same setting"):
        base.clone(max_tokens=8, max_new_tokens=9)


def test_setting_a_field_after_submitting_changes_no_running_request(engine):
    """The request keeps the values it was submitted with, as vLLM's (it clones the params at submission): the
    front end read the caller's object while building outputs, so ``logprobs`` set to None after submitting
    dropped the logprobs the scheduler computed, and set to 3 on a request without them gave ``logprobs == []``."""
    params = SamplingParams(max_tokens=6, logprobs=2, seed=1)
    stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, stream=True)
    params.logprobs = None
    chunks = list(stream)
    assert sum(len(c.outputs[0].logprobs) for c in chunks) == 6
    params = SamplingParams(max_tokens=6, seed=1)
    stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, stream=True)
    params.logprobs = 3
    assert all(c.outputs[0].logprobs is None for c in stream)


def test_numpy_numbers_are_taken_as_python_numbers(engine):
    """Trainers compute lengths and seeds with numpy (vLLM takes ``max_tokens=np.int64(8)``); they were refused
    as "must be an int". Stored as Python numbers, so the scheduler and the JSON outputs see plain values;
    numpy bools stay refused where an int is wanted."""
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(4), temperature=np.float32(0.0), seed=np.uint32(7),
                            n=np.int32(1), stop_token_ids=[np.int64(3)], top_p=np.float64(1.0), ignore_eos=True)
    assert type(params.max_new_tokens) is int and type(params.temperature) is float
    assert type(params.seed) is int and type(params.stop_token_ids[0]) is int
    out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 4
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        SamplingParams(max_tokens=np.bool_(True))


def test_errors_name_every_field_as_the_caller_typed_it():
    """vLLM's names in the message wherever the caller used them: the second field of a comparison kept the
    internal name ("min_tokens (5) must be <= max_new_tokens (3)" for min_tokens=5, max_tokens=3)."""
    with pytest.raises(ValueError, match=r"^min_tokens \(5\) must be <= max_tokens \(3\)$"):
        SamplingParams(min_tokens=5, max_tokens=3)
    with pytest.raises(ValueError, match=r"^min_new_tokens \(5\) must be <= max_new_tokens \(3\)$"):
        SamplingParams(min_new_tokens=5, max_new_tokens=3)
