"""Which checkpoints the engine loads, and how, against transformers: the weight files it reads, a tied head
stored beside the embedding, rope types it cannot serve exactly, and a reload of another model's checkpoint."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams
from rollout.config import ModelConfig
from rollout.layers.rotary import rope_inv_freq
from rollout.models.loader import read_safetensors_shapes
from tiny_models import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = prompts_of_lengths([5, 9], seed=4)


def _greedy(path: str) -> list[list[int]]:
    with Engine(path, dtype="float32", device="cpu") as engine:
        return [o.outputs[0].token_ids for o in engine.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY,
                                                                 use_tqdm=False)]


def test_model_safetensors_is_read_alone_and_a_tensor_in_two_files_is_refused(tiny_dir, tmp_path, hf_reference):
    """transformers reads ``model.safetensors`` when it exists, whatever other ``*.safetensors`` lie beside it
    (Mistral's ``consolidated.safetensors``, an old copy); without it or an index, a tensor stored twice is an
    error rather than whichever file was read last."""
    base = tiny_dir("llama")
    beside = str(tmp_path / "beside")
    shutil.copytree(base, beside)
    weights = load_file(f"{beside}/model.safetensors")
    save_file({k: v * 0.5 for k, v in weights.items()}, f"{beside}/model_old.safetensors")
    save_file({"tok_embeddings.weight": weights["model.embed_tokens.weight"]}, f"{beside}/consolidated.safetensors")
    hf = hf_reference(base)
    assert _greedy(beside) == [hf.greedy(p, 6) for p in PROMPTS]
    (tmp_path / "beside" / "model.safetensors").rename(tmp_path / "beside" / "a.safetensors")
    (tmp_path / "beside" / "consolidated.safetensors").unlink()
    with pytest.raises(ValueError, match="is in two weight files"):
        read_safetensors_shapes(beside)


def test_a_tied_head_stored_beside_the_embedding(tiny_dir, tmp_path, hf_reference):
    """tie_word_embeddings with a lm_head.weight in the checkpoint too: equal to the embedding it is the same
    parameter; different, transformers unties the two, which a tied engine cannot serve: refused."""
    base = tiny_dir("llama", tie_word_embeddings=True)
    weights = load_file(f"{base}/model.safetensors")
    assert "lm_head.weight" not in weights
    equal, different = str(tmp_path / "equal"), str(tmp_path / "different")
    for path, head in ((equal, weights["model.embed_tokens.weight"]),
                       (different, torch.randn_like(weights["model.embed_tokens.weight"]))):
        shutil.copytree(base, path)
        save_file({**weights, "lm_head.weight": head.clone()}, f"{path}/model.safetensors")
    hf = hf_reference(base)
    assert _greedy(equal) == [hf.greedy(p, 6) for p in PROMPTS]
    with pytest.raises(ValueError, match="lm_head.weight that differs"):
        Engine(different, dtype="float32", device="cpu")
    with Engine(base, dtype="float32", device="cpu") as engine:
        before = engine.weights_fingerprint()
        with pytest.raises(ValueError, match="lm_head.weight that differs"):
            engine.update_weights_from_disk(different)
        embed = weights["model.embed_tokens.weight"]
        with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
            engine.update_weights_from_tensor([("model.embed_tokens.weight", embed * 2), ("lm_head.weight", embed)])
        assert engine.weights_fingerprint() == before and engine.get_weight_state()["state"] == "consistent"
        engine.update_weights_from_tensor([("model.embed_tokens.weight", embed), ("lm_head.weight", embed.clone())])
        assert engine.weights_fingerprint() == before  # a state_dict's equal pair is the same parameter
        _push_state_dict_in_order_names_one_version(engine, weights)


def _push_state_dict_in_order_names_one_version(engine, weights) -> None:
    """A tied model's state_dict in order (verl's buckets, the last one flushing): the bucket before the head
    completes the weights, so the head (the same values) must not open a second session: one new version (it
    went 1 -> 3 with an unnamed "2" served between), the same with a version named on the last bucket."""
    sent = [(n, t * 1.5) for n, t in weights.items()] + [("lm_head.weight", weights["model.embed_tokens.weight"] * 1.5)]
    version = int(engine.get_weight_version())
    assert engine.update_weights_from_tensor(sent[:-1], flush_cache=False)["complete"]
    assert engine.get_weight_version() == str(version + 1)
    out = engine.update_weights_from_tensor(sent[-1:], flush_cache=True)
    assert out["weight_version"] == str(version + 1) and engine.get_weight_version() == str(version + 1)
    assert engine.get_weight_state()["state"] == "consistent"
    engine.update_weights_from_tensor(sent[:-1], flush_cache=False)
    assert engine.update_weights_from_tensor(sent[-1:], weight_version="step-9")["weight_version"] == "step-9"
    changed = sent[-1][1].clone()
    changed[0, 0] += 1.0  # a head that differs (the trainer untied it) still loads, as a new update
    engine.update_weights_from_tensor([("lm_head.weight", changed)])
    assert engine.get_weights_by_name("model.embed_tokens.weight", 1)[0][0] == changed[0, 0].item()


def test_a_reload_of_another_models_checkpoint_is_refused(tiny_dir, tmp_path):
    """Names and shapes alike, but another model (rope theta, architecture): its weights would compute
    something else than transformers does with them, so update_weights_from_disk refuses it."""
    base = tiny_dir("llama")
    theta = make_tiny_checkpoint(str(tmp_path / "theta"), "llama", seed=1, rope_theta=100.0)
    mistral = make_tiny_checkpoint(str(tmp_path / "mistral"), "mistral", seed=1, sliding_window=None)
    same = make_tiny_checkpoint(str(tmp_path / "same"), "llama", seed=1)
    with Engine(base, dtype="float32", device="cpu") as engine:
        before = engine.weights_fingerprint()
        for path, words in ((theta, "rope"), (mistral, "architecture")):
            with pytest.raises(ValueError, match=f"is a different model.*{words}"):
                engine.update_weights_from_disk(path)
            assert engine.weights_fingerprint() == before
        assert engine.update_weights_from_disk(same)["complete"]
        assert engine.weights_fingerprint() != before


@pytest.mark.parametrize("rope", [
    dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
         original_max_position_embeddings=64),
    dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    dict(rope_type="linear", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5),
], ids=["longrope", "dynamic", "linear-partial"])
def test_rope_types_the_engine_cannot_serve_exactly_are_refused(rope, tmp_path):
    """longrope and dynamic scaling change their frequencies with the forward's sequence length in
    transformers; a partial rotary factor under a scaled rope type is not applied: each is a clear error
    when the model is built, not different outputs later."""
    path = make_tiny_checkpoint(str(tmp_path / "rope"), "llama", rope_parameters=rope)
    cfg = ModelConfig.from_path(path)
    with pytest.raises(ValueError, match="depends on the sequence length|partial rotary factor"):
        rope_inv_freq(cfg.raw, cfg.rope, cfg.head_dim)


def test_a_config_naming_no_dtype_runs_in_its_weights_dtype(tmp_path):
    """A config.json without ``torch_dtype`` / ``dtype`` (hand-written, converted): transformers loads it in its
    weights' dtype (``dtype="auto"``, its default); the engine's "auto" ran such a bfloat16 checkpoint in
    float32, and its prompt logprobs differed from transformers' by bfloat16's error."""
    import json

    from transformers import AutoModelForCausalLM

    from rollout.config import EngineConfig, resolve_torch_dtype

    path = make_tiny_checkpoint(str(tmp_path / "bf16"), "llama", dtype=torch.bfloat16)
    with open(f"{path}/config.json") as f:
        raw = {k: v for k, v in json.load(f).items() if k not in ("dtype", "torch_dtype")}
    with open(f"{path}/config.json", "w") as f:
        json.dump(raw, f)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert resolve_torch_dtype(EngineConfig(path), ModelConfig.from_path(path)) == hf.dtype == torch.bfloat16
    prompt = PROMPTS[1]
    with Engine(path, device="cpu") as engine:
        out = engine.generate(prompt_token_ids=[prompt], use_tqdm=False,
                              sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    ref = [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]
    got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3
