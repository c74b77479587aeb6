"""What real trainers send, by name: wrapped models' fingerprints and a state_dict's rotary buffers (CPU,
gloo). Each push either loads (the engine's fingerprint equals ``weight_sync.fingerprint`` of the trainer's
model, greedy outputs equal transformers') or is refused before anything changes."""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn as nn

import weight_sync
from rollout import SamplingParams
from rollout.ipc import free_port
from weight_sync.hf_compare import hf_greedy
from weight_sync.sender import WeightSender
from tiny_models import scaled_copy


@pytest.fixture(scope="module")
def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_serves(engine, model: nn.Module, fingerprint_of=None) -> None:
    """The engine holds ``model``'s weights: fingerprints equal and greedy tokens equal transformers'."""
    assert engine.get_weight_state()["state"] == "consistent"
    assert engine.weights_fingerprint() == weight_sync.fingerprint(model if fingerprint_of is None else fingerprint_of)
    prompt = [5, 6, 7, 8]
    out = engine.generate(prompt_token_ids=[prompt], use_tqdm=False,
                          sampling_params=SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(model, prompt, 8)


def with_rotary_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as transformers before 4.38 (or remote code) gave it: with persistent rotary
    ``inv_freq`` buffers, the model-wide one and the older per-layer one."""
    sd = dict(model.state_dict())
    inv_freq = model.model.rotary_emb.inv_freq
    sd["model.rotary_emb.inv_freq"] = inv_freq
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = inv_freq.clone()
    sd["model.rotary_emb.original_inv_freq"] = inv_freq.clone()
    return sd


def test_rotary_buffers_of_a_state_dict_are_skipped_on_every_path(hf_model, engine):
    """vLLM and SGLang skip a state_dict's ``rotary_emb.inv_freq`` (the engine computes it), as the engine's own
    reload from disk does; a live update refused the whole call ("unknown parameter name"). Now they are received
    and dropped over shared memory, flattened buckets and per-tensor calls, and the fingerprint leaves them out."""
    group_name = "rotary"
    joined = engine.init_process_group("127.0.0.1", port := free_port(), 1, 2, group_name, backend="gloo",
                                       timeout=60, async_op=True)
    group = weight_sync.init_process_group("127.0.0.1", port, 0, 2, group_name, backend="gloo", timeout=60)
    joined.result(60)
    try:
        for k, send in enumerate(["tensor", "bucket", "per_tensor"]):
            model = scaled_copy(hf_model, 1.0 + 0.01 * (k + 1))
            sd = with_rotary_buffers(model)
            if send == "tensor":
                engine.update_weights_from_tensor(list(sd.items()), weight_version=send)
            else:
                WeightSender([engine], group, group_name, bucket_bytes=64 << 10, mode=send).send(sd.items(), send)
            assert engine.get_weight_version() == send
            assert weight_sync.fingerprint(sd) == weight_sync.fingerprint(model)
            assert_serves(engine, model)
    finally:
        with ThreadPoolExecutor(1) as pool:
            left = pool.submit(engine.destroy_process_group, group_name)
            weight_sync.destroy_process_group(group)
            left.result(60)
        engine.update_weights_from_tensor(list(hf_model.named_parameters()), weight_version="restored")


class Wrapper(nn.Module):
    """A generic wrapper: the model under ``module`` (DDP's and DeepSpeed's layout)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_fingerprint_of_a_wrapped_model_names_its_parameters_as_the_engine_does(hf_model, engine):
    """``weight_sync.fingerprint(model)`` of a DDP-, torch.compile- or checkpoint-wrapped model used the wrapper's
    names (``module.``, ``_orig_mod.``, ``_checkpoint_wrapped_module.``), so after a correct push it differed from
    the engine's: "the weights differ" although they were equal. It now names them as the senders do."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from trainer_adapters import push_colocated

    model = scaled_copy(hf_model, 1.03)
    checkpointed = copy.deepcopy(model)
    checkpointed.model.layers[0] = checkpoint_wrapper(checkpointed.model.layers[0])
    push_colocated(torch.compile(Wrapper(checkpointed)), [engine], weight_version="wrapped")
    assert engine.get_weight_version() == "wrapped"
    for wrapped in (Wrapper(model), torch.compile(model), checkpointed, torch.compile(Wrapper(checkpointed))):
        assert engine.weights_fingerprint() == weight_sync.fingerprint(wrapped)
    assert_serves(engine, model)
    engine.update_weights_from_tensor(list(hf_model.named_parameters()), weight_version="restored")


def test_a_peft_model_with_merged_adapters_pushes_as_its_merged_model(hf_model, engine):
    """TRL and verl push a PEFT model as ``merge_adapter()`` leaves it: base weights under their own names
    (``base_model.model.`` and ``.base_layer`` dropped, a ``modules_to_save`` copy under the module's name) and
    no adapter weights. The engine refused those names whole. Unmerged adapters are refused before any call
    (their base weights are not the model the trainer computes)."""
    import peft  # the test extra installs it
    from trainer_adapters import param_source, push_colocated

    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"],
                             init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(hf_model), config)
    version = engine.get_weight_version()
    with pytest.raises(ValueError, match="not merged"):
        push_colocated(model, [engine], weight_version="unmerged")
    assert engine.get_weight_version() == version
    model.merge_adapter()
    assert [m.name for m in param_source(model).metas()] == [n for n, _ in hf_model.named_parameters()]
    push_colocated(model, [engine], weight_version="peft")
    merged = copy.deepcopy(model).merge_and_unload()
    assert engine.weights_fingerprint() == weight_sync.fingerprint(model) != weight_sync.fingerprint(hf_model)
    assert_serves(engine, merged)
    engine.update_weights_from_tensor(list(hf_model.named_parameters()), weight_version="restored")


def test_a_wrapped_name_sent_to_the_engine_is_refused_with_the_name_to_send(hf_model, engine):
    """The engine takes transformers' names (as vLLM does); a name a wrapper made (DDP's ``module.``,
    ``torch.compile``'s ``_orig_mod.``, PEFT's ``base_model.model.`` / ``.base_layer``) is refused, weights
    untouched, and the error now names the parameter it meant."""
    weight = hf_model.get_parameter("model.layers.0.self_attn.q_proj.weight").detach()
    for sent in ("module.model.layers.0.self_attn.q_proj.weight", "_orig_mod.model.layers.0.self_attn.q_proj.weight",
                 "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"):
        with pytest.raises(ValueError, match="a wrapper's name for 'model.layers.0.self_attn.q_proj.weight'"):
            engine.update_weights_from_tensor([(sent, weight)])
    with pytest.raises(ValueError) as e:
        engine.update_weights_from_tensor([("model.layers.0.self_attn.nope.weight", weight)])
    assert "wrapper" not in str(e.value)
    engine.flush_cache()  # a refused first call marks the next partial update inconsistent until a flush
