"""The Python API: chat, async, streaming, abort, bad input (per request), two engines at once."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import threading
import time

import pytest
import torch

from conftest import prompts_of_lengths
from rollout import Engine, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


def test_text_prompts_and_output_shape(engine, path, hf_reference):
    outs = engine.generate(["hello world", "the sky is"], SamplingParams(temperature=0, max_new_tokens=6, logprobs=2),
                           use_tqdm=False)
    assert len(outs) == 2 and all(isinstance(o, RequestOutput) for o in outs)
    for out in outs:
        ids = engine.tokenizer.encode(out.prompt)
        assert out.prompt_token_ids == ids and out.finished
        c = out.outputs[0]
        assert c.token_ids == hf_reference(path).greedy(ids, 6, stop_at_eos=True)
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert len(c.logprobs) == len(c.token_ids) == len(c.token_logprobs)
        for tok, lp, entry in zip(c.token_ids, c.token_logprobs, c.logprobs):
            assert entry[tok].logprob == lp and 1 <= len(entry) <= 3
            assert all(v.logprob <= max(x.logprob for x in entry.values()) for v in entry.values())
            for tid, v in entry.items():  # vLLM's decoded_token: the token's text alone, not its vocabulary piece
                assert v.decoded_token == engine.tokenizer.decode([tid]), (tid, v.decoded_token)
        assert c.cumulative_logprob == pytest.approx(sum(c.token_logprobs))
        assert out.weight_version == "0"


def test_get_tokenizer_is_vllms(engine, path):
    """vLLM's ``LLM.get_tokenizer()``: the tokenizer the engine uses; refused without one."""
    assert engine.get_tokenizer() is engine.tokenizer
    assert engine.get_tokenizer().decode(engine.get_tokenizer().encode("hello world")) == "hello world"
    with Engine(path, dtype="float32", device="cpu", skip_tokenizer_init=True) as bare:
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            bare.get_tokenizer()


def test_detokenize_off_gives_token_ids_without_text(engine):
    """vLLM's ``detokenize=False``: the same tokens, no text, no decoded logprob tokens; stop strings need the
    text, so they are refused with it (vLLM's check)."""
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, logprobs=1)
    plain, bare = (engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=p, use_tqdm=False)[0].outputs[0]
                   for p in (params, params.clone(detokenize=False)))
    assert bare.token_ids == plain.token_ids and bare.token_logprobs == pytest.approx(plain.token_logprobs, abs=1e-5)
    assert plain.text and bare.text == ""
    assert all(v.decoded_token is None for entry in bare.logprobs for v in entry.values())
    chunks = list(engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params.clone(detokenize=False),
                                  stream=True))
    assert [t for c in chunks for t in c.outputs[0].token_ids] == plain.token_ids
    assert all(c.outputs[0].text == "" for c in chunks)
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(stop=["x"], detokenize=False)


def test_chat_uses_the_template(engine):
    messages = [{"role": "user", "content": "the sky is"}]
    ids = engine.apply_chat_template(messages)
    via_chat = engine.chat(messages, GREEDY, use_tqdm=False)[0]
    direct = engine.generate(prompt_token_ids=[ids], sampling_params=GREEDY, use_tqdm=False)[0]
    assert via_chat.prompt_token_ids == ids
    assert via_chat.outputs[0].token_ids == direct.outputs[0].token_ids
    # the prompt is the rendered conversation, as vLLM's LLM.chat reports it (it was None), also for a
    # conversation passed to generate
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert via_chat.prompt == text
    assert engine.generate([messages], GREEDY, use_tqdm=False)[0].prompt == text


def test_chat_template_options_are_vllms(engine):
    """``chat_template``, ``chat_template_kwargs`` (the template's own variables, e.g. Qwen3's
    ``enable_thinking``), ``add_generation_prompt`` and ``continue_final_message`` reach transformers'
    ``apply_chat_template``."""
    tok = engine.tokenizer
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if shout %}!!{% endif %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    convo = [{"role": "user", "content": "the sky is"}, {"role": "assistant", "content": "blue and"}]
    cases = [dict(chat_template=template, chat_template_kwargs={"shout": True}),
             dict(chat_template=template, add_generation_prompt=False),
             dict(continue_final_message=True, add_generation_prompt=False)]
    for options in cases:
        named = {"add_generation_prompt": True, **{k: v for k, v in options.items() if k != "chat_template_kwargs"}}
        want = tok.apply_chat_template(convo, tokenize=True, **named, **options.get("chat_template_kwargs", {}))
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        out = engine.chat(convo, GREEDY, use_tqdm=False, **options)[0]
        assert out.prompt_token_ids == want, options
    assert tok.decode(engine.chat(convo, GREEDY, use_tqdm=False, **cases[0])[0].prompt_token_ids).endswith(
        "!!<assistant>")
    with pytest.raises(ValueError, match="Cannot set both"):
        engine.chat(convo, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set"):
        engine.chat(convo, GREEDY, chat_template_kwargs={"tokenize": False})


def test_chat_takes_vllms_tools_and_text_content_parts(engine):
    """vLLM's ``LLM.chat(tools=...)`` hands the tools to the template (a TypeError here before); a content of
    OpenAI text parts is rendered as vLLM renders it for a string template, the texts joined by newlines (the
    template's string concatenation raised jinja's TypeError before)."""
    tok = engine.tokenizer
    template = "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}" \
               "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "sky", "parameters": {"type": "object", "properties": {}}}}]
    convo = [{"role": "user", "content": "the sky is"}]
    out = engine.chat(convo, GREEDY, use_tqdm=False, chat_template=template, tools=tools)[0]
    assert tok.decode(out.prompt_token_ids) == "[sky]<user>the sky is"
    parts = [{"role": "user", "content": [{"type": "text", "text": "the sky"}, {"type": "text", "text": "is"}]}]
    want = engine.apply_chat_template([{"role": "user", "content": "the sky\nis"}])
    assert engine.chat(parts, GREEDY, use_tqdm=False)[0].prompt_token_ids == want
    with pytest.raises(ValueError, match="content part"):
        engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    from rollout.server.protocol import ChatMessage
    assert ChatMessage(role="user", content=parts[0]["content"]).text() == "the sky\nis"  # the HTTP server's


def test_stream_chunks_add_up_to_the_result(engine):
    prompts = ["one two three", "the red car", "hello"]
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    final = engine.generate(prompts, params, use_tqdm=False)
    tokens = {o.request_id: [] for o in []}
    texts: dict[str, str] = {}
    ids: dict[str, list[int]] = {}
    finished = set()
    for chunk in engine.generate(prompts, params, stream=True):
        ids.setdefault(chunk.prompt, []).extend(chunk.outputs[0].token_ids)
        texts[chunk.prompt] = texts.get(chunk.prompt, "") + chunk.outputs[0].text
        if chunk.finished:
            finished.add(chunk.prompt)
    assert finished == set(prompts) and not tokens
    for out in final:
        assert ids[out.prompt] == out.outputs[0].token_ids
        assert texts[out.prompt] == out.outputs[0].text


def test_async_generate_concurrent_and_stream(engine):
    prompts = prompts_of_lengths([5, 9, 14, 3], seed=8)

    async def main():
        singles = await asyncio.gather(*[engine.async_generate(prompt_token_ids=[p], sampling_params=GREEDY)
                                         for p in prompts])
        stream = await engine.async_generate(prompt_token_ids=[prompts[0]], sampling_params=GREEDY, stream=True)
        streamed = [t async for chunk in stream for t in chunk.outputs[0].token_ids]
        return [s[0] for s in singles], streamed

    singles, streamed = asyncio.run(main())
    batch = engine.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [s.outputs[0].token_ids for s in singles] == [b.outputs[0].token_ids for b in batch]
    assert streamed == batch[0].outputs[0].token_ids


def test_an_async_stream_made_in_one_event_loop_is_iterated_in_another(engine):
    """The stream's updates went through the creating loop: made in one ``asyncio.run`` and iterated in the next,
    it waited forever (its chunks were dropped with the closed loop)."""
    stream = asyncio.run(engine.async_generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, stream=True))

    async def tokens():
        return [t async for chunk in stream for t in chunk.outputs[0].token_ids]

    streamed = asyncio.run(asyncio.wait_for(tokens(), 60))
    assert streamed == engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY,
                                       use_tqdm=False)[0].outputs[0].token_ids


def test_abort_a_running_request(engine):
    params = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
    stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, stream=True, request_id="long")
    first = next(stream)
    assert engine.abort("long") is True
    last = first
    for last in stream:
        pass
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert engine.abort("long") is False  # finished: nothing live has that id
    assert engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)[0].finished


@pytest.mark.parametrize("bad,match", [
    (dict(prompt_token_ids=[[]]), "empty"),
    (dict(prompt_token_ids=[[1, 2, 10**6]]), "vocabulary"),
    (dict(prompt_token_ids=[[-1, 2]]), "vocabulary"),
    (dict(prompt_token_ids=[[3] * 600]), "context length"),
    (dict(prompts=[""]), "empty"),
    (dict(prompts=["a\ud800b"]), "lone surrogate"),
    (dict(prompts=[[{"role": "user", "content": "hi \udfff"}]]), "lone surrogate"),
    (dict(prompts=["hi"], sampling_params={"temperature": -1}), "temperature"),
    (dict(prompts=["hi"], sampling_params={"top_p": 1.5}), "top_p"),
    (dict(prompts=["hi"], sampling_params={"max_tokens": -3}), "max_tokens must be"),
    (dict(prompts=["hi"], sampling_params={"bogus": 1}), "bogus"),
    (dict(prompts=["hi"], sampling_params={"stop_token_ids": [10**6]}), "stop_token_ids"),
    (dict(prompts=["hi"], sampling_params={"logprobs": 50}), "logprobs"),
    (dict(prompts={"prompt": 5}), "'prompt' must be a string"),
    (dict(prompts=[{"prompt": None}]), "'prompt' must be a string"),
    (dict(prompts=[{"prompt": "hi", "prompt_token_ids": None}]), "'prompt_token_ids' must be a list"),
    (dict(prompts=[{"prompt_token_ids": 5}]), "'prompt_token_ids' must be a list"),
    (dict(prompts=5), "prompts must be"),
])


def test_bad_input_is_a_clear_value_error_and_the_engine_keeps_serving(engine, bad, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(use_tqdm=False, **bad)
    assert engine.generate(["hello"], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("messages,match", [("hello", "messages must be a conversation"),
                                            ([["hello"]], "a chat message must be a")])
def test_bad_chat_messages_are_a_clear_value_error(engine, messages, match):
    """A string (or a conversation of strings) is not a conversation: it was split into characters and failed
    in transformers with a TypeError, not the documented ValueError."""
    with pytest.raises(ValueError, match=match):
        engine.chat(messages, GREEDY, use_tqdm=False)


def test_request_ids_clashing_with_live_sample_ids_are_refused(engine):
    """A request of n > 1 names its samples '<id>#<i>' for the scheduler: an id equal to a live one, or to one
    of its samples' ids, is refused up front (it used to hang the first request and leak its id)."""
    long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True, n=2)
    stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True, request_id="X")
    next(stream)
    for rid, match in [("X#0", "sample id 'X#0'"), ("X", "duplicate request id 'X'")]:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompt_token_ids=[[5, 6]], sampling_params=GREEDY, request_id=rid, use_tqdm=False)
    with pytest.raises(ValueError, match="sample id 'Y#1'"):  # within one call
        engine.generate(prompt_token_ids=[[5, 6], [7, 8]], sampling_params=[long, GREEDY], request_id=["Y", "Y#1"])
    engine.abort("X")
    last = None
    for last in stream:
        pass
    assert last.finished and [o.finish_reason for o in last.outputs] == ["abort", "abort"]
    outs = engine.generate(prompt_token_ids=[[5, 6], [7, 8]], sampling_params=GREEDY, request_id=["X#0", "X"],
                           use_tqdm=False)
    assert [o.request_id for o in outs] == ["X#0", "X"] and all(o.finished for o in outs)


def test_streams_closed_or_dropped_before_their_first_chunk_abort_their_requests(engine):
    """A generator's ``finally`` never runs if it never started: the stream itself aborts on close or drop."""
    long = SamplingParams(temperature=0.0, max_new_tokens=480, ignore_eos=True)
    tm = engine.tokenizer_manager

    def submit(rid: str):
        return engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True, request_id=rid)

    dropped, closed = submit("dropped"), submit("closed")
    states = [tm.states["dropped"], tm.states["closed"]]
    del dropped
    gc.collect()
    closed.close()

    async def aclosed():
        agen = await engine.async_generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True,
                                           request_id="aclosed")
        states.append(tm.states["aclosed"])
        await agen.aclose()

    asyncio.run(aclosed())
    deadline = time.monotonic() + 30
    while not all(s.finished for s in states) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [s.seqs[0].finish_reason for s in states] == ["abort"] * 3
    assert all(len(s.seqs[0].token_ids) < 480 for s in states)


def test_a_stream_closed_while_another_thread_or_task_iterates_it_aborts_its_request(engine):
    """``close()`` from another thread (``aclose()`` from another task) while one iterates the stream raised
    "generator already executing" ("asynchronous generator is already running") and aborted nothing: the request
    ran to its end. The iterating side now ends with the abort's final chunk."""
    long = SamplingParams(temperature=0.0, max_new_tokens=480, ignore_eos=True)
    stream = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
    chunks = [next(stream)]
    reader = threading.Thread(target=lambda: chunks.extend(stream))
    reader.start()
    deadline = time.monotonic() + 30
    while not stream._chunks.gi_running and time.monotonic() < deadline:  # the reader waits inside the stream
        time.sleep(0.01)
    stream.close()
    reader.join(60)
    assert chunks[-1].outputs[0].finish_reason == "abort"
    assert sum(len(c.outputs[0].token_ids) for c in chunks) < 480

    async def main():
        astream = await engine.async_generate(prompt_token_ids=[[5, 6, 7]], sampling_params=long, stream=True)
        first = asyncio.Event()

        async def read():
            got = []
            async for chunk in astream:
                got.append(chunk)
                first.set()
            return got

        reading = asyncio.create_task(read())
        await first.wait()  # the reader now waits inside the stream for its next chunk
        await astream.aclose()
        return await asyncio.wait_for(reading, 60)

    got = asyncio.run(main())
    assert got[-1].outputs[0].finish_reason == "abort"
    assert sum(len(c.outputs[0].token_ids) for c in got) < 480


def test_max_tokens_none_runs_to_the_context_end_and_tiny_temperatures_are_greedy(engine):
    """vLLM's conventions: max_tokens=None means until the context is full (it was silently 128), and a
    temperature below 1e-5 samples greedily (at 1e-38, logits / T overflowed to NaN)."""
    room = engine.context_len - 3
    for params in (SamplingParams(max_tokens=None, ignore_eos=True), {"max_tokens": None, "ignore_eos": True}):
        out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == room and out.finish_reason == "length"
    greedy = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY, use_tqdm=False)[0].outputs[0]
    for t in (1e-38, 1e-6):
        tiny = SamplingParams(temperature=t, max_new_tokens=10, ignore_eos=True, logprobs=0, logprobs_mode="processed")
        out = engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=tiny, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == greedy.token_ids and all(math.isfinite(lp) for lp in out.token_logprobs)


def test_a_bad_request_fails_only_its_caller(engine):
    results: dict[str, object] = {}

    def good():
        results["good"] = engine.generate(["the sky"], SamplingParams(max_new_tokens=40, temperature=0,
                                                                      ignore_eos=True), use_tqdm=False)

    t = threading.Thread(target=good)
    t.start()
    with pytest.raises(ValueError):
        engine.generate(prompt_token_ids=[[1, 2, 10**6]], sampling_params=GREEDY, use_tqdm=False)
    t.join()
    assert len(results["good"][0].outputs[0].token_ids) == 40


def test_unsupported_architecture(tmp_path, path):
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*GPT2LMHeadModel"):
        Engine(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="no config.json"):
        Engine(str(tmp_path / "missing"), device="cpu")
    (tmp_path / "config.json").write_text(json.dumps(config)[:-1])  # cut short: a JSONDecodeError naming no file
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        Engine(str(tmp_path), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
@pytest.mark.parametrize("device,tp_size", [("cuda", 1), ("cuda:0", 2)])
def test_a_cuda_device_torch_cannot_see_is_a_clear_value_error(path, device, tp_size):
    """Refused before any child starts (the ranks failed with 'Torch not compiled with CUDA enabled' or
    AttributeError: ... '_cuda_setDevice')."""
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        Engine(path, dtype="float32", device=device, tp_size=tp_size)


def test_a_subprocesss_start_up_value_error_keeps_its_own_message(path):
    """The scheduler's ValueError at start-up is raised as a ValueError with its message (it read 'ValueError:
    ValueError: ...')."""
    with pytest.raises(ValueError, match=r"^not enough memory for the KV cache \(1 slots\)$"):
        Engine(path, dtype="float32", device="cpu", max_total_tokens=1)


def test_two_engines_in_one_process(engine, tiny_dir, hf_reference, path):
    other_path = tiny_dir("qwen3")
    prompts = prompts_of_lengths([6, 12], seed=9)
    results: dict[str, list] = {}
    with Engine(other_path, dtype="float32", device="cpu") as other:
        def run(name, e):
            results[name] = e.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("a", engine), ("b", other))]
        [t.start() for t in threads]
        [t.join() for t in threads]
    for name, p in (("a", path), ("b", other_path)):
        for prompt, out in zip(prompts, results[name]):
            assert out.outputs[0].token_ids == hf_reference(p).greedy(prompt, 10)


def test_the_tokenizers_eos_ends_a_sequence_as_in_vllm(tmp_path, path, hf_reference):
    """vLLM (``InputPreprocessor.get_eos_token_id``) and SGLang (``Req.check_finished``) stop at the tokenizer's
    EOS beside the model's: a checkpoint whose tokenizer names another EOS than its config.json (a fine-tune
    that made ``<|im_end|>`` the EOS of a base model) ran on to max_tokens."""
    import shutil

    from transformers import AutoTokenizer

    ckpt = str(shutil.copytree(path, tmp_path / "own-eos"))
    tok = AutoTokenizer.from_pretrained(ckpt)
    prompt = tok.encode("the sky is")
    greedy = hf_reference(path).greedy(prompt, 8)
    k = next(i for i in range(1, 8) if greedy[i] not in greedy[:i] and greedy[i] != 2)  # 2: config.json's EOS
    tok.eos_token = tok.convert_ids_to_tokens(greedy[k])
    tok.save_pretrained(ckpt)
    with Engine(ckpt, dtype="float32", device="cpu") as e:
        assert e.tokenizer.eos_token_id == greedy[k]
        stopped, ignored = e.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=8),
                                                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)],
                                      use_tqdm=False)
    c = stopped.outputs[0]
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (greedy[:k + 1], "stop", None)
    assert ignored.outputs[0].token_ids == greedy and ignored.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("rank_offset, world_size", [(0, 2), (-1, 2), (2, 2)])
def test_weight_update_group_ranks_are_checked_before_joining(engine, rank_offset, world_size):
    """Rank 0 of the group is the trainer: an engine joining as rank 0 would be the broadcast's source and load its
    own scratch buffer as the new weights (reported a success); a rank past the group would wait for its timeout.
    Refused at once, as the HTTP server and the Ray actor refuse it."""
    from rollout.ipc import free_port

    start = time.monotonic()
    with pytest.raises(ValueError, match="rank_offset"):
        engine.init_process_group("127.0.0.1", free_port(), rank_offset, world_size, "ranks", backend="gloo", timeout=5)
    assert time.monotonic() - start < 4
    assert engine.get_weight_state()["groups"] == []


def test_get_weights_by_name_gives_the_first_rows_as_sglang_does(engine, path, hf_reference):
    """SGLang returns ``param.tolist()[:truncate_size]`` (rows of a matrix), what its tests compare with
    transformers' ``get_parameter(name)[:truncate_size].tolist()``; a flat list of the first values is not that."""
    hf = hf_reference(path).model
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"):
        assert engine.get_weights_by_name(name, 3) == hf.get_parameter(name).detach()[:3].tolist(), name


def test_check_finite_checks_the_values_the_engine_would_store(engine):
    """1e39 is finite in the float64 sent and inf in the float32 served (a bfloat16 1e5 in a float16 engine
    likewise): check_finite refuses it instead of storing inf in a 'consistent' update."""
    import torch

    name = "model.norm.weight"
    before, version = engine.get_weights_by_name(name, 64), engine.get_weight_version()
    sent = torch.ones(64, dtype=torch.float64)
    sent[0] = 1e39
    with pytest.raises(ValueError, match="non-finite"):
        engine.update_weights_from_tensor([(name, sent)], check_finite=True)
    assert engine.get_weights_by_name(name, 64) == before and engine.get_weight_version() == version


def test_sglangs_load_format_keyword_on_tensor_and_disk_updates(engine, path):
    """SGLang's Engine.update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True) and
    update_weights_from_disk(model_path, load_format=None): callers passing load_format=None got a TypeError."""
    import torch

    name = "model.norm.weight"
    values = torch.tensor(engine.get_weights_by_name(name, 64))
    assert engine.update_weights_from_tensor([(name, values)], load_format=None, flush_cache=True)["complete"]
    assert engine.update_weights_from_disk(path, load_format="auto")["complete"]
    with pytest.raises(ValueError, match="load_format"):
        engine.update_weights_from_tensor([(name, values)], load_format="flattened_bucket")
    assert engine.get_weight_state()["state"] == "consistent"


def test_a_version_named_during_an_update_session_names_the_pushed_weights(engine, path, hf_reference):
    """Buckets sent with flush_cache=False, update_weight_version(v) (SGLang's way to name them), the last bucket
    closes the session: the weights are v (they became 'v+1', a version nobody named)."""
    named = [(n, p.detach()) for n, p in hf_reference(path).model.named_parameters()]
    engine.update_weights_from_tensor(named[:5], flush_cache=False)
    assert engine.get_weight_state()["state"] == "updating"
    engine.update_weight_version("step-7")
    assert engine.update_weights_from_tensor(named[5:])["weight_version"] == "step-7"
    assert engine.get_weight_version() == "step-7" and engine.get_weight_state()["state"] == "consistent"
    assert engine.update_weights_from_tensor(named)["weight_version"] == "step-7+1"  # a later push increments again


def _seeded_sample(engine, seed: int | None) -> list[int]:
    params = SamplingParams(max_tokens=8, seed=seed, ignore_eos=True)
    return engine.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=params, use_tqdm=False)[0].outputs[0].token_ids


def test_seeds_differing_by_2_to_the_63_give_different_samples(engine):
    """A seed is 64-bit (vLLM's range): seeds were reduced mod 2**63, so -2 sampled exactly as 2**63 - 2 and
    0 as -2**63."""
    for a, b in ((-2, 2**63 - 2), (0, -2**63), (5, 5 - 2**63)):
        assert _seeded_sample(engine, a) != _seeded_sample(engine, b)
    assert _seeded_sample(engine, -2) == _seeded_sample(engine, -2)


def test_seed_minus_one_means_no_seed_as_in_vllm(engine):
    """vLLM's SamplingParams turns seed=-1 into None (random samples); here it was a fixed seed, so a vLLM config
    with seed=-1 gave the same samples on every call (every RL step) without a word."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams.from_any({"seed": -1}).seed is None
    samples = [_seeded_sample(engine, -1) for _ in range(3)]
    assert not samples[0] == samples[1] == samples[2]
