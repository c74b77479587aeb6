"""Stop strings and stop tokens end to end on the CPU: the scheduler's finish check (``Req.check_finished``)
decides where a request ends, the detokenizer (``IncrementalDetokenizer``) renders its text, and both are
checked against vLLM's rule computed from full ``tokenizer.decode`` calls:

- after each new token, a stop string counts if it ends in the text that token added, and only once the
  output is longer than ``min_tokens`` (vLLM's ``check_stop_strings`` / ``min_tokens``); the stop strings are
  tried in the list's order;
- the text is cut right before the stop string (right after it with ``include_stop_str_in_output``);
- a stop token id (or EOS) that ends the request leaves its text out unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

import random

import pytest

from rollout.detokenize_state import REPLACEMENT_CHAR, IncrementalDetokenizer
from rollout.io_struct import GenerateReq, TokenOut
from rollout.request_state import ReqState, build_output
from rollout.sampling_params import SamplingParams
from rollout.scheduler.req import Req
from tests.test_detokenize_state import _BUILDERS

@pytest.fixture(scope="module")
def byte_level():
    return _BUILDERS["byte_level_bpe"]()


def _decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True,
                      clean_up_tokenization_spaces=False)


def _vllm_rule(tok, ids, stop, min_tokens, include):
    """(tokens used, matched stop string or None, final text) by vLLM's rule, from full decodes."""
    prev = ""
    for i in range(1, len(ids) + 1):
        text = _decode(tok, ids[:i]).rstrip(REPLACEMENT_CHAR)
        if i > min_tokens:
            for s in stop:
                idx = text.find(s, max(0, len(prev) - len(s) + 1))
                if idx >= 0:
                    return i, s, text[:idx + len(s)] if include else text[:idx]
        prev = text
    return len(ids), None, _decode(tok, ids)


def _run_engine_side(tok, ids, params, eos=(), tokenizer_eos=()):
    """Feed ``ids`` one at a time through the scheduler's finish check and the detokenizer, as the engine
    does (``eos``: the model's EOS ids, ``tokenizer_eos`` the request's); return (tokens used, FinishReason,
    final text, texts shown while unfinished)."""
    req = Req(GenerateReq("r", [1, 2, 3], params, seed=0, eos_token_ids=tuple(tokenizer_eos)), tuple(eos),
              context_len=100_000)
    det = IncrementalDetokenizer(tok, params.skip_special_tokens, True, params.stop,
                                 params.include_stop_str_in_output, min_new_tokens=params.min_new_tokens)
    shown = []
    for tid in ids:
        req.output_ids.append(tid)
        req.check_finished(tok)
        finished = req.finished is not None
        det.step([tid], finished, req.finished.matched if finished else None)
        if finished:
            return len(req.output_ids), req.finished, det.text, shown
        shown.append(det.text)
    raise AssertionError("the request never finished")


@pytest.fixture(scope="module", params=["byte_level_bpe", "smollm2"])
def byte_level_tokenizer(request):
    """Byte-level decoders: the text of a prefix of the ids is a prefix of the text (up to U+FFFD)."""
    return _BUILDERS[request.param]()


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_with_min_tokens_follow_vllm(byte_level_tokenizer, include):
    tokenizer = byte_level_tokenizer
    rng = random.Random(11)
    alphabet = ["a", "b", " ", "-", "é", "世", "🎉", "🍕"]
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        m = rng.choice([0, 0, 1, 3, len(ids) // 2])
        params = SamplingParams(max_new_tokens=len(ids), min_new_tokens=min(m, len(ids)), stop=stop,
                                include_stop_str_in_output=include)
        used, s, final = _vllm_rule(tokenizer, ids, stop, params.min_new_tokens, include)
        got_used, reason, got_text, shown = _run_engine_side(tokenizer, ids, params)
        case = (text, stop, params.min_new_tokens)
        assert (got_used, reason.matched if reason.type == "stop" else None) == (used, s), case
        assert got_text == final, case
        assert all(final.startswith(t) for t in shown), case


@pytest.mark.parametrize("stop", [["🎉"], ["🍕"], ["🍕🎉"], ["x", "🎉🍕"]])
def test_emoji_stop_strings_end_the_request(byte_level, stop):
    """Each emoji takes several byte-level tokens: the scheduler's window must span them."""
    ids = byte_level.encode("ab🍕🎉🍕🎉 and more text after it", add_special_tokens=False)
    assert len(ids) > 10
    params = SamplingParams(max_new_tokens=len(ids), stop=stop)
    used, s, final = _vllm_rule(byte_level, ids, stop, 0, False)
    got_used, reason, got_text, _ = _run_engine_side(byte_level, ids, params)
    assert s is not None and used < len(ids)
    assert (got_used, reason.type, reason.matched, got_text) == (used, "stop", s, final)


def test_stop_string_inside_min_tokens_does_not_count(byte_level):
    """The report's case: "-" within the first min_tokens tokens neither stops the request nor cuts the
    text there; the next "-" after them does."""
    ids = byte_level.encode("-and-the-world", add_special_tokens=False)
    m = len(byte_level.encode("-and", add_special_tokens=False))
    params = SamplingParams(max_new_tokens=len(ids), min_new_tokens=m, stop=["-"])
    got_used, reason, got_text, _ = _run_engine_side(byte_level, ids, params)
    assert reason.matched == "-" and got_text == "-and"
    assert got_used == len(byte_level.encode("-and-", add_special_tokens=False))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("skip", [False, True])
def test_eos_text_is_left_out(byte_level, include, skip):
    eos = byte_level.convert_tokens_to_ids("<|im_end|>")
    ids = byte_level.encode("Hi there", add_special_tokens=False) + [eos]
    params = SamplingParams(max_new_tokens=20, include_stop_str_in_output=include, skip_special_tokens=skip)
    used, reason, text, _ = _run_engine_side(byte_level, ids, params, eos=(eos,))
    assert (used, reason.type, reason.matched) == (len(ids), "stop", eos)
    assert text == _decode(byte_level, ids if include else ids[:-1], skip)
    assert text == ("Hi there<|im_end|>" if include and not skip else "Hi there")


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_text_is_left_out(byte_level, include):
    ids = byte_level.encode("Paris. Then more.", add_special_tokens=False)
    dot = byte_level.encode(".", add_special_tokens=False)
    assert len(dot) == 1 and dot[0] in ids
    params = SamplingParams(max_new_tokens=30, stop_token_ids=dot, include_stop_str_in_output=include)
    used, reason, text, _ = _run_engine_side(byte_level, ids, params)
    assert reason.matched == dot[0] and used == ids.index(dot[0]) + 1
    assert text == ("Paris." if include else "Paris")


def test_stop_token_inside_min_tokens_does_not_count(byte_level):
    ids = byte_level.encode("a.b.c.", add_special_tokens=False)
    dot = byte_level.encode(".", add_special_tokens=False)[0]
    first = ids.index(dot) + 1
    params = SamplingParams(max_new_tokens=30, min_new_tokens=first + 1, stop_token_ids=[dot])
    used, reason, text, _ = _run_engine_side(byte_level, ids, params)
    assert reason.matched == dot and used > first
    assert text == _decode(byte_level, ids[:used - 1])


@pytest.mark.parametrize("name", ["sentencepiece_llama", "sentencepiece_metaspace"])
@pytest.mark.parametrize("stop", ["。", "🍕", "界🎉"])
def test_stop_string_inside_a_byte_fallback_group(name, stop):
    """A byte-fallback tokenizer decodes a run of ``<0xNN>`` tokens as one group, all U+FFFD until the run
    is whole, so a window that starts inside the run shows nothing; the check widens it and stops at the
    token that completes the stop string."""
    tok = _BUILDERS[name]()
    text = "ab 龘靐齉。🍕界🎉齉 ab, after"
    ids = tok.encode(text, add_special_tokens=False)
    tokens = tok.convert_ids_to_tokens(ids)
    assert sum(t.startswith("<0x") for t in tokens) > 12  # the CJK and emoji run is byte fallback
    first = next(i for i in range(1, len(ids) + 1) if stop in _decode(tok, ids[:i]))
    params = SamplingParams(max_new_tokens=len(ids), stop=[stop])
    used, reason, got_text, _ = _run_engine_side(tok, ids, params)
    full = _decode(tok, ids[:used])
    assert (used, reason.matched) == (first, stop)
    assert got_text == full[:full.find(stop)]


@pytest.mark.parametrize("name", ["sentencepiece_llama", "sentencepiece_metaspace"])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_a_leading_space_in_the_first_output_tokens(name, include):
    """vLLM decodes the output after the prompt, so a SentencePiece "▁friend" that starts the output reads
    " friend" and the stop string " friend" ends the request there. Decoded alone, the decoder strips that
    space: the scheduler missed the stop and the request ran on with " friend" in its text."""
    tok = _BUILDERS[name]()
    full = tok.encode("Hello there friend", add_special_tokens=False)
    cut = max(k for k, t in enumerate(tok.convert_ids_to_tokens(full)) if k > 0 and t.startswith("\u2581"))
    prompt, ids = full[:cut], full[cut:]
    stop = _decode(tok, full)[len(_decode(tok, prompt)):]
    assert stop.startswith(" ") and not _decode(tok, ids).startswith(" ")
    params = SamplingParams(max_new_tokens=len(ids) + 5, stop=[stop], include_stop_str_in_output=include)
    req = Req(GenerateReq("r", prompt, params, seed=0), (), context_len=100_000)
    det = IncrementalDetokenizer(tok, True, True, params.stop, include, prompt_token_ids=prompt)
    for tid in ids + tok.encode(" and more", add_special_tokens=False):
        req.output_ids.append(tid)
        req.check_finished(tok)
        det.step([tid], req.finished is not None, req.finished.matched if req.finished else None)
        if req.finished is not None:
            break
    assert (len(req.output_ids), req.finished.type, req.finished.matched) == (len(ids), "stop", stop)
    assert det.text == (stop if include else "")


@pytest.mark.parametrize("specials", [1, 3, 40])
def test_stop_string_across_special_tokens_the_text_leaves_out(byte_level, specials):
    """With skip_special_tokens the text (vLLM's and the detokenizer's) reads "HelloYes!" whatever special tokens
    sit between "Yes" and "!", so the stop string "Yes!" ends the request at "!"; a window of the stop's bytes + 1
    ids held only the special tokens and "!" and missed it."""
    special = byte_level.convert_tokens_to_ids("<|im_start|>")
    head = byte_level.encode("HelloYes", add_special_tokens=False)
    ids = head + [special] * specials + byte_level.encode("! more text", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=len(ids), stop=["Yes!"])
    used, reason, text, _ = _run_engine_side(byte_level, ids, params)
    assert (used, reason.type, reason.matched, text) == (len(head) + specials + 1, "stop", "Yes!", "Hello")


def test_stop_reason_is_none_for_eos_and_the_id_for_a_stop_token(byte_level):
    """vLLM's ``CompletionOutput.stop_reason``: None when the tokenizer's EOS ended the sequence, else the stop
    token id, also for the model's other EOS ids (vLLM adds generation_config's EOS ids other than the
    tokenizer's to the stop token ids)."""
    eos = byte_level.convert_tokens_to_ids("<|im_end|>")
    other = byte_level.encode("!", add_special_tokens=False)[0]  # a second EOS id of the model's
    got = {}
    cases = [("eos", SamplingParams(max_new_tokens=9), (eos,), (eos,), eos),
             ("model's other eos", SamplingParams(max_new_tokens=9), (eos, other), (eos,), other),
             ("stop id", SamplingParams(max_new_tokens=9, stop_token_ids=[eos]), (), (), eos)]
    for name, params, eos_ids, tokenizer_eos, last in cases:
        ids = byte_level.encode("Hi", add_special_tokens=False) + [last]
        _, reason, _, _ = _run_engine_side(byte_level, ids, params, eos=eos_ids, tokenizer_eos=tokenizer_eos)
        state = ReqState("r", None, [1], params, lambda s: None)
        state.apply(0, TokenOut("r", ids, finished=reason))
        got[name] = (reason.type, reason.matched, build_output(state, byte_level).outputs[0].stop_reason)
    assert got == {"eos": ("stop", eos, None), "model's other eos": ("stop", other, other), "stop id": ("stop", eos, eos)}


def test_sglang_names_no_stop_trim_and_sampling_seed(byte_level):
    """SGLang's ``no_stop_trim`` keeps the matched stop string or token in the text (``include_stop_str_in_output``);
    ``sampling_seed`` is its name for ``seed``."""
    params = SamplingParams(max_new_tokens=30, stop=[" Then"], no_stop_trim=True, sampling_seed=5)
    assert params.include_stop_str_in_output and params.seed == 5
    ids = byte_level.encode("Paris. Then more.", add_special_tokens=False)
    assert _run_engine_side(byte_level, ids, params)[2] == "Paris. Then"
    with pytest.raises(ValueError, match="name the same setting"):
        SamplingParams(seed=1, sampling_seed=2)


def test_repeated_stop_token_ids_are_kept_once_and_still_stop(byte_level):
    """A stop_token_ids list of 200,000 copies of an id is that id once (in the given order): the finish check and
    min_tokens' ban went through every copy for every token of every sample (a request of 64 samples with
    min_tokens held the engine for 200 s and a tiny request beside it for 52 s)."""
    ids = byte_level.encode("a.b.c.", add_special_tokens=False)
    dot = byte_level.encode(".", add_special_tokens=False)[0]
    params = SamplingParams(max_new_tokens=30, min_new_tokens=2, stop_token_ids=[0] * 200_000 + [dot, 0, dot])
    assert params.stop_token_ids == [0, dot]
    used, reason, _, _ = _run_engine_side(byte_level, ids, params)
    assert (reason.matched, used) == (dot, ids.index(dot) + 1)


def test_repeated_stop_strings_are_kept_once_and_at_most_64_distinct_ones_are_taken():
    """Each stop string is searched for after every token of every sample (scheduler and detokenizer): a list
    is kept once per string, in its order, and more than ``MAX_STOP_STRINGS`` distinct ones are refused."""
    assert SamplingParams(stop=["x"] * 1000 + ["y", "x"]).stop == ["x", "y"]
    assert len(SamplingParams(stop=[f"s{i}" for i in range(64)] * 3).stop) == 64
    with pytest.raises(ValueError, match="stop must hold at most 64 distinct strings, got 20000"):
        SamplingParams(stop=[f"s{i}" for i in range(20000)])
