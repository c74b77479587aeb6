"""IncrementalDetokenizer against the reference: ``tokenizer.decode`` of the whole sequence.

Tokenizers are built here (no hub): a byte-level BPE (GPT-2 style), two SentencePiece/Llama-style BPEs
with byte fallback (Llama-2's decoder sequence, and a Metaspace decoder), and the real SmolLM2 tokenizer
from the default-model cache when it has been converted (``python -m rollout.default_model``).
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from rollout.default_model import default_model_dir
from rollout.detokenize_state import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris!",
    "你好，世界！这是一个测试。世界很大。",
    "Emoji time: 🎉 🙂 👍 and café, naïve, Zürich.",
    "def f(x):\n    return x * 2  # code\n\tindent",
]
TEXTS = [
    "Hello world!",
    " leading space and  double  spaces ",
    "The capital of France is Paris.",
    "你好，世界！未见过的字：龘靐齉。",
    "Party 🎉🎉 thumbs 👍🏽 family 👨‍👩‍👧 flag 🇫🇷 done",
    "mixed: café naïve Zürich Ελληνικά русский 日本語 한국어",
    "code:\n\tdef g(y):\n        return y ** 2\n",
    "a\u0301 combining, \u200b zero width, \U0001f9ea test tube",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus():
    return CORPUS * 20


def _byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=SPECIALS[0], bos_token=SPECIALS[1],
                                   eos_token=SPECIALS[2])


def _sentencepiece_bpe(metaspace_decoder: bool) -> PreTrainedTokenizerFast:
    """A Llama-style BPE: ``▁`` for spaces, a leading ``▁`` prepended, ``<0xNN>`` byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                                  limit_alphabet=60)
    tok.train_from_iterator(_corpus(), trainer)
    spec = json.loads(tok.to_str())
    trained = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    rest = [t for t, _ in trained if t not in specials]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(specials + byte_tokens + rest)}
    spec["model"]["byte_fallback"] = True
    spec["model"]["fuse_unk"] = True
    for added in spec["added_tokens"]:
        added["id"] = specials.index(added["content"])
    tok = Tokenizer.from_str(json.dumps(spec))
    if metaspace_decoder:
        tok.normalizer = None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="▁",
                                                                                     prepend_scheme="first")])
    else:
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def _smollm2():
    path = default_model_dir()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 tokenizer not cached at {path}; run `python -m rollout.default_model` to convert it")
    return AutoTokenizer.from_pretrained(str(path))


_BUILDERS = {
    "byte_level_bpe": _byte_level_bpe,
    "sentencepiece_llama": lambda: _sentencepiece_bpe(metaspace_decoder=False),
    "sentencepiece_metaspace": lambda: _sentencepiece_bpe(metaspace_decoder=True),
    "smollm2": _smollm2,
}


@pytest.fixture(scope="module", params=list(_BUILDERS))
def tokenizer(request):
    return _BUILDERS[request.param]()


@pytest.fixture(scope="module")
def byte_level():
    return _byte_level_bpe()


def _stream(tok, ids, skip=True, chunk_rng=None, prompt_ids=None, stop=(), include=False, matched_stop=None,
            finish=True):
    """Feed ``ids`` in chunks of 1-3 (or 1); return (detokenizer, deltas)."""
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip, spaces_between_special_tokens=True,
                                 stop=list(stop), include_stop_str_in_output=include, prompt_token_ids=prompt_ids)
    deltas, i = [], 0
    while i < len(ids):
        n = chunk_rng.randint(1, 3) if chunk_rng else 1
        chunk = ids[i:i + n]
        i += n
        last = finish and i >= len(ids)
        deltas.append(det.step(chunk, finished=last, matched_stop=matched_stop if last else None))
    if finish and not ids:
        deltas.append(det.step([], finished=True, matched_stop=matched_stop))
    return det, deltas


def _reference(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=True)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tokenizer, skip):
    rng = random.Random(1234)
    vocab = len(tokenizer)
    byte_ids = [i for i in range(vocab) if len(tokenizer.convert_ids_to_tokens(i) or "") == 6
                and tokenizer.convert_ids_to_tokens(i).startswith("<0x")]
    special = list(tokenizer.all_special_ids)
    for _ in range(150):
        ids = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            if byte_ids and r < 0.4:
                ids.append(rng.choice(byte_ids))
            elif r < 0.45:
                ids.append(rng.choice(special))
            else:
                ids.append(rng.randrange(vocab))
        det, deltas = _stream(tokenizer, ids, skip=skip, chunk_rng=rng)
        expected = _reference(tokenizer, ids, skip)
        assert "".join(deltas) == expected, ids
        assert det.text == expected


@pytest.mark.parametrize("skip", [True, False])
def test_real_text_streams_without_partial_characters(tokenizer, skip):
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
        det, deltas = _stream(tokenizer, ids, skip=skip)
        expected = _reference(tokenizer, ids, skip)
        assert "".join(deltas) == expected
        assert det.text == expected
        assert all("\ufffd" not in d for d in deltas), deltas
        assert (tokenizer.eos_token in expected) == (not skip)


def test_real_text_round_trips_emoji_and_cjk(byte_level):
    for text in TEXTS:
        ids = byte_level.encode(text, add_special_tokens=False)
        _, deltas = _stream(byte_level, ids)
        assert "".join(deltas) == text
        multi_byte = [d for d in deltas if any(ord(c) > 0x7F for c in d)]
        assert all(d.encode("utf-8").decode("utf-8") == d for d in multi_byte)


def test_split_character_is_held_then_flushed(byte_level):
    ids = byte_level.encode("🧪", add_special_tokens=False)
    assert len(ids) > 1  # the rare emoji is split into byte tokens
    det = IncrementalDetokenizer(byte_level, True, True, [], False)
    assert det.step(ids[:-1], finished=False) == ""
    assert det.step(ids[-1:], finished=False) == "🧪"
    det = IncrementalDetokenizer(byte_level, True, True, [], False)
    assert det.step(ids[:1], finished=False) == ""
    assert det.step([], finished=True) == _reference(byte_level, ids[:1])


def test_byte_fallback_group_is_held_until_closed():
    tok = _sentencepiece_bpe(metaspace_decoder=False)
    valid = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "é".encode()]
    stray = tok.convert_tokens_to_ids("<0x80>")
    word = tok.encode("the", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, True, True, [], False)
    # "é" decodes fine on its own, but a following stray byte turns the whole group into "���".
    assert det.step(valid, finished=False) == ""
    assert det.step([stray], finished=False) == ""
    det.step(word, finished=True)
    assert det.text == _reference(tok, valid + [stray] + word)


@pytest.mark.parametrize("name", ["sentencepiece_llama", "sentencepiece_metaspace", "byte_level_bpe", "smollm2"])
def test_prompt_seed_keeps_first_leading_space(name):
    tok = _BUILDERS[name]()
    for text in ["Hello there my friend, the capital of France is Paris.", "你好 世界 🎉 is fine"]:
        full = tok.encode(text, add_special_tokens=False)
        for cut in range(1, len(full)):
            prompt, output = full[:cut], full[cut:]
            det, deltas = _stream(tok, output, prompt_ids=prompt)
            full_text, prompt_text = _reference(tok, full), _reference(tok, prompt)
            if "\ufffd" in prompt_text:
                continue  # the prompt ends inside a character: no seed is used
            assert full_text.startswith(prompt_text)
            assert "".join(deltas) == full_text[len(prompt_text):]
    if name.startswith("sentencepiece"):
        # The output starts with a "▁word" token: decoded alone its space is stripped, after the prompt it is kept.
        full = tok.encode("Hello there friend", add_special_tokens=False)
        cut = max(k for k, t in enumerate(tok.convert_ids_to_tokens(full)) if k > 0 and t.startswith("▁"))
        seeded, _ = _stream(tok, full[cut:], prompt_ids=full[:cut])
        unseeded, _ = _stream(tok, full[cut:])
        assert seeded.text.startswith(" ") and seeded.text == " " + unseeded.text


@pytest.mark.parametrize("name", ["sentencepiece_llama", "sentencepiece_metaspace"])
def test_the_prompt_tail_the_scheduler_sends_seeds_past_a_run_of_byte_tokens(name):
    """A prompt ending in characters spelled by byte-fallback tokens (two 4-byte characters: 8 byte tokens):
    the seed widens back to a whole character, which needs more of the prompt than its last few ids. The
    prompt ids the scheduler sends (``OutputManager.token_out``) keep the output's leading space."""
    from rollout.io_struct import GenerateReq
    from rollout.sampling_params import SamplingParams
    from rollout.scheduler.output import OutputManager
    from rollout.scheduler.req import Req

    tok = _BUILDERS[name]()
    prompt = tok.encode("the sky is blue \U0001d11e\U0001d11e", add_special_tokens=False)
    assert sum(t.startswith("<0x") for t in tok.convert_ids_to_tokens(prompt)[-8:]) == 8
    words = tok.encode("Hello there friend", add_special_tokens=False)
    cut = max(k for k, t in enumerate(tok.convert_ids_to_tokens(words)) if k > 0 and t.startswith("▁"))
    output = words[cut:]  # starts with "▁word": a word with its leading space
    req = Req(GenerateReq("r", prompt, SamplingParams(max_tokens=4), seed=0), (2,), context_len=128)
    for t in output:
        req.append_token(t, None, None, None)
    tail = OutputManager.token_out(req, "0").spec.prompt_tail
    det, deltas = _stream(tok, output, prompt_ids=tail)
    want = _reference(tok, prompt + output)[len(_reference(tok, prompt)):]  # vLLM's text
    assert want.startswith(" ") and "".join(deltas) == det.text == want


class _DecodeSpy:
    """``tok`` whose ``decode`` calls record how many ids each decoded (in ``seen``)."""

    def __init__(self, tok) -> None:
        self.tok, self.seen = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kw):
        self.seen.append(len(ids))
        return self.tok.decode(ids, **kw)


def test_decode_window_stays_small(byte_level):
    spy = _DecodeSpy(byte_level)
    seen = spy.seen
    ids = byte_level.encode(" ".join(TEXTS * 10), add_special_tokens=False)
    assert len(ids) > 500
    det, deltas = _stream(spy, ids)
    assert "".join(deltas) == _reference(byte_level, ids)
    assert max(seen) <= 8


@pytest.mark.parametrize("name", ["byte_level_bpe", "sentencepiece_llama"])
def test_a_run_that_never_settles_is_not_decoded_whole_every_step(name):
    """2,000 ids of one invalid byte (a degenerate rollout): every window ends in U+FFFD (or a byte token), so
    nothing is sent until the end. Each step decoded the whole held window, ~2 million ids in all (measured 0.2 /
    0.7 / 2.9 s of the one detokenizer process at 1,000 / 2,000 / 4,000 ids; quadratic, so minutes at 32,000);
    now the held steps decode a short tail, and the text is still the full decode."""
    tok = _BUILDERS[name]()
    stray = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
    spy = _DecodeSpy(tok)
    ids = tok.encode("ok", add_special_tokens=False) + [stray] * 2000
    det, deltas = _stream(spy, ids)
    assert "".join(deltas) == _reference(tok, ids)
    assert sum(spy.seen) < 20 * len(ids), sum(spy.seen)


# -- stop strings --------------------------------------------------------------------------------


def _first_stop(text: str, stop: list[str]) -> str | None:
    """What a scheduler reports: the stop string that occurs first (earliest end) in ``text``."""
    best = None
    for s in stop:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[0]):
            best = ((i + len(s), i), s)
    return best[1] if best else None


def _stream_until_stop(tok, ids, stop, include):
    """Stream like a scheduler: finish at the first token whose full decode contains a stop string."""
    det = IncrementalDetokenizer(tok, True, True, stop, include)
    deltas, texts = [], []
    for i in range(len(ids)):
        matched = _first_stop(_reference(tok, ids[:i + 1]), stop)
        last = matched is not None or i == len(ids) - 1
        deltas.append(det.step(ids[i:i + 1], finished=last, matched_stop=matched))
        texts.append(det.text)
        if last:
            return det, deltas, texts, ids[:i + 1], matched
    raise AssertionError("empty ids")


def _expected_final(full: str, matched: str | None, include: bool) -> str:
    if matched is None:
        return full
    i = full.find(matched)
    return full[:i + len(matched)] if include else full[:i]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_and_holdback(byte_level, include):
    ids = byte_level.encode("Hello world. The END is near, END.", add_special_tokens=False)
    det, deltas, texts, used, matched = _stream_until_stop(byte_level, ids, ["END"], include)
    assert matched == "END"
    final = _expected_final(_reference(byte_level, used), matched, include)
    assert "".join(deltas) == final == det.text
    assert final == ("Hello world. The END" if include else "Hello world. The ")
    assert all(final.startswith(t) for t in texts)


def test_partial_stop_is_held_then_released(byte_level):
    det = IncrementalDetokenizer(byte_level, True, True, ["world!"], False)
    out = det.step(byte_level.encode("Hello wor", add_special_tokens=False), finished=False)
    assert out == "Hello " and det.text == "Hello "
    out = det.step(byte_level.encode("ld?", add_special_tokens=False), finished=False)
    assert det.text == "Hello world?" and out == "world?"
    det.step(byte_level.encode(" wor", add_special_tokens=False), finished=False)
    assert det.text == "Hello world? "
    det.step([], finished=True)  # finished by length: the held text is flushed
    assert det.text == "Hello world? wor"


def test_nothing_sent_after_a_complete_stop_while_unfinished(byte_level):
    det = IncrementalDetokenizer(byte_level, True, True, ["abc", "b"], True)
    det.step(byte_level.encode("xabc yz", add_special_tokens=False), finished=False)
    assert det.text == "xab"  # "b" ends first; nothing past it may be shown
    det.step([], finished=True, matched_stop="b")
    assert det.text == "xab"


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings(byte_level, include):
    rng = random.Random(7)
    alphabet = "ab ,é世"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        ids = byte_level.encode(text, add_special_tokens=False)
        det, deltas, texts, used, matched = _stream_until_stop(byte_level, ids, stop, include)
        final = _expected_final(_reference(byte_level, used), matched, include)
        assert "".join(deltas) == det.text == final, (text, stop)
        assert all(final.startswith(t) for t in texts), (text, stop)
        if not include:
            for t in texts[:-1]:  # while streaming: never a stop string in what was shown
                assert not any(s in t for s in stop)


def test_skip_special_tokens(byte_level):
    ids = byte_level.encode("Hi<|im_end|>there<|endoftext|>", add_special_tokens=False)
    for skip, expected in [(True, "Hithere"), (False, "Hi<|im_end|>there<|endoftext|>")]:
        det, deltas = _stream(byte_level, ids, skip=skip)
        assert "".join(deltas) == det.text == expected == _reference(byte_level, ids, skip)


def test_step_after_finished_raises(byte_level):
    det = IncrementalDetokenizer(byte_level, True, True, [], False)
    det.step(byte_level.encode("hi", add_special_tokens=False), finished=True)
    with pytest.raises(RuntimeError):
        det.step([1], finished=False)


def test_prompt_seed_window_never_starts_inside_a_byte_run():
    """A prompt ending in a long run of byte tokens (here "你好" as six <0xNN> tokens): the seed window
    must start at a character boundary, or the space token that follows is lost (regression)."""
    tok = _BUILDERS["sentencepiece_llama"]()
    space = tok.convert_tokens_to_ids("▁")
    byte_ids = lambda text: [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in text.encode()]  # noqa: E731
    prompt = [space] + byte_ids("你好")
    output = [space] + byte_ids("世界") + [space] + byte_ids("ok")
    _, deltas = _stream(tok, output, prompt_ids=prompt)
    full_text, prompt_text = _reference(tok, prompt + output), _reference(tok, prompt)
    assert "".join(deltas) == full_text[len(prompt_text):] == " 世界 ok"
