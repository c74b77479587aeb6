"""The engine against transformers on tiny random checkpoints: greedy ids and logprobs (float32, CPU)."""

from __future__ import annotations

import pytest

from conftest import prompts_of_lengths
from rollout import Engine, SamplingParams

LENGTHS = [3, 17, 5, 40, 9, 1, 26, 12, 64, 7]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_and_logprobs_match_transformers(arch, tiny_dir, hf_reference):
    path = tiny_dir(arch)
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True, logprobs=0)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, ignore_eos=True, logprobs=0, seed=7)
    with Engine(path, dtype="float32", device="cpu") as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        samples = engine.generate(prompt_token_ids=prompts, sampling_params=sampled, use_tqdm=False)
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        assert out.prompt_token_ids == prompt
        assert got.token_ids == hf.greedy(prompt, 16), f"prompt of {len(prompt)} tokens"
        assert got.finish_reason == "length"
        ref = hf.logprobs(prompt, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref)) < 1e-4
    for prompt, out in zip(prompts, samples):
        got = out.outputs[0]
        assert len(got.token_ids) == 12
        ref = hf.logprobs(prompt, got.token_ids)
        assert max(abs(a - b) for a, b in zip(got.token_logprobs, ref)) < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("use_sliding_window", [None, True, False])
def test_sliding_window_as_transformers_reads_the_config(model_type, use_sliding_window):
    """A config's ``sliding_window`` limits attention where transformers applies it: always for Mistral and
    Mixtral, for Qwen only with ``use_sliding_window`` (default False), never for Llama (its attention has no
    window). A Qwen checkpoint that carries a window with the switch absent must keep its full context."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    raw = CONFIG_MAPPING[model_type](sliding_window=8, **(
        {} if use_sliding_window is None else {"use_sliding_window": use_sliding_window})).to_dict()
    if use_sliding_window is None:
        raw.pop("use_sliding_window", None)
    raw["sliding_window"] = 8  # as the checkpoint's config.json has it, whatever transformers normalizes
    want = None if model_type == "llama" else CONFIG_MAPPING[model_type](**raw).sliding_window
    assert ModelConfig.from_dict(raw).sliding_window == want


@pytest.mark.parametrize("keys", [dict(max_window_layers=28), dict(max_window_layers=1), dict(max_window_layers=0),
                                  dict(max_window_layers=0, layer_types=["full_attention"] * 2),
                                  dict(max_window_layers=2, layer_types=["full_attention", "sliding_attention"])],
                         ids=["none-by-max_window_layers", "one-by-max_window_layers", "all", "none-by-layer_types",
                              "one-by-layer_types"])
@pytest.mark.parametrize("written_layer_types", [True, False], ids=["transformers-5", "transformers-4"])
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_qwen_window_applies_only_where_a_layer_slides(model_type, written_layer_types, keys):
    """Qwen2 and Qwen3 with ``use_sliding_window`` window only the layers their ``layer_types`` mark (by default
    those from ``max_window_layers`` on, 28 in their classes): with none marked, transformers attends fully and
    the engine must not cap the context at the window. transformers 4 wrote no ``layer_types``."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    raw = _small_config(model_type, num_hidden_layers=2, use_sliding_window=True, sliding_window=8, **keys)
    if not written_layer_types and "layer_types" not in keys:
        raw.pop("layer_types")
    hf = CONFIG_MAPPING[model_type](**raw)
    want = hf.sliding_window if "sliding_attention" in hf.layer_types else None
    assert ModelConfig.from_dict(raw).sliding_window == want


def test_a_qwen_window_on_no_layer_keeps_the_whole_context(tmp_path, hf_reference):
    """A Qwen2 checkpoint with ``use_sliding_window`` and an 8-token window, its two layers under
    ``max_window_layers`` (28): transformers attends fully over a 20-token prompt; the engine capped the
    context at 8 and refused the prompt."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "qwen2"), "qwen2", use_sliding_window=True, sliding_window=8)
    _check_greedy_against_transformers(path, hf_reference, [20, 4], seed=3, tol=1e-5)


@pytest.mark.parametrize("model_type,architectures,window", [
    ("mistral", ["LlamaForCausalLM"], 8), ("llama", ["MistralForCausalLM"], None),
    ("qwen2", ["LlamaForCausalLM"], None), ("qwen3", ["Qwen3ForSequenceClassification"], None), ("qwen3", None, None),
    ("qwen3_moe", ["MixtralForCausalLM"], None)])
def test_the_model_is_chosen_by_model_type_as_transformers_chooses_it(model_type, architectures, window, tmp_path):
    """transformers' AutoModelForCausalLM builds the class of the config's ``model_type``, whatever
    ``architectures`` says; the engine took ``architectures[0]``: a Mistral labelled ``LlamaForCausalLM``
    attended past its window without a word (a Llama labelled Mistral had its context cut at the window), a
    Qwen2 labelled Llama was refused at load, a Qwen3 labelled as a classifier refused."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.config import ModelConfig

    raw = _small_config(model_type, sliding_window=8)
    raw.pop("architectures", None)
    if architectures is not None:
        raw["architectures"] = architectures
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path)))
    cfg = ModelConfig.from_dict(raw)
    assert (cfg.architecture, cfg.sliding_window) == (type(hf).__name__, window)


def test_a_qwen2_checkpoint_labelled_llama_loads_as_transformers_loads_it(tmp_path, hf_reference):
    """A Qwen2 config.json whose ``architectures`` says ``LlamaForCausalLM``: transformers builds Qwen2 (its
    ``model_type``); the engine built Llama and refused the checkpoint ('unknown parameter name ...k_proj.bias')."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "qwen2"), "qwen2")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    _check_greedy_against_transformers(path, hf_reference, [9, 4], seed=3, tol=1e-5)


def test_a_model_type_the_engine_lacks_is_refused_whatever_architectures_says():
    """A Qwen2-MoE config labelled ``Qwen2ForCausalLM`` is a Qwen2-MoE to transformers: refused by its model_type,
    not run as a dense Qwen2."""
    from rollout.config import ModelConfig

    raw = {**_small_config("qwen2"), "model_type": "qwen2_moe", "architectures": ["Qwen2ForCausalLM"]}
    with pytest.raises(ValueError, match="unsupported model_type 'qwen2_moe'"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("model_type,flags", [("llama", {"attention_bias": True}), ("llama", {"mlp_bias": True}),
                                              ("qwen3", {"attention_bias": True}),
                                              ("qwen3_moe", {"attention_bias": True})])
def test_projection_biases_the_engine_lacks_are_refused_by_name(model_type, flags):
    """transformers puts these biases on q/k/v/o_proj or the MLP; refused naming the config flag, not later as
    an unknown checkpoint tensor."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    with pytest.raises(ValueError, match=f"{next(iter(flags))}=true"):
        ModelConfig.from_dict(CONFIG_MAPPING[model_type](**flags).to_dict())


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_a_bias_flag_is_refused_where_transformers_adds_biases_the_engine_lacks(model_type, flag):
    """Refused exactly where transformers' model gets projection biases from the flag (Qwen2's q/k/v biases are
    always there, and served); elsewhere transformers ignores the flag, and so does the engine."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from rollout.config import ModelConfig

    raw = _small_config(model_type, **{flag: True})
    hf = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**raw))
    served = ("q_proj.bias", "k_proj.bias", "v_proj.bias") if model_type == "qwen2" else ()
    if any(n.endswith("bias") and not n.endswith(served) for n, _ in hf.named_parameters()):
        with pytest.raises(ValueError, match=f"{flag}=true"):
            ModelConfig.from_dict(raw)
    else:
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("model_type", ["mistral", "qwen3"])
def test_bias_flags_transformers_ignores_are_ignored(model_type, tmp_path, hf_reference):
    """``attention_bias`` / ``mlp_bias`` where transformers' model never reads them (Mistral's projections have
    no biases, nor any Qwen MLP): transformers loads the checkpoint and runs it without biases; the engine
    refused it ('mlp_bias=true ... is not supported')."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / model_type), model_type, sliding_window=None)
    _edit_config(path, mlp_bias=True, **({} if model_type == "qwen3" else {"attention_bias": True}))
    _check_greedy_against_transformers(path, hf_reference, [9, 4], seed=3, tol=1e-5)


def test_qwen2_q_k_v_biases_whatever_attention_bias_says(tmp_path, hf_reference):
    """transformers' Qwen2 gives q/k/v_proj biases (and o_proj none) whatever ``attention_bias`` says; a Qwen2
    config.json with ``attention_bias: false`` (written by a converter) was refused at load, its
    ``k_proj.bias`` an unknown parameter."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "qwen2"), "qwen2")
    _edit_config(path, attention_bias=False)
    _check_greedy_against_transformers(path, hf_reference, [9, 4], seed=3)


def _edit_config(path: str, drop: tuple[str, ...] = (), **changes) -> None:
    """Rewrite ``path``'s config.json without the keys in ``drop`` and with ``changes`` over it."""
    import json

    with open(f"{path}/config.json") as f:
        raw = {k: v for k, v in json.load(f).items() if k not in drop}
    with open(f"{path}/config.json", "w") as f:
        json.dump({**raw, **changes}, f)


def _check_greedy_against_transformers(path: str, hf_reference, lengths: list[int], seed: int,
                                       tol: float = 1e-4) -> None:
    """Six greedy tokens of prompts of ``lengths`` equal transformers' ids, logprobs within ``tol``."""
    prompts = prompts_of_lengths(lengths, seed=seed)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, logprobs=0)
    with Engine(path, dtype="float32", device="cpu") as engine:
        outs = engine.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    hf = hf_reference(path)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf.greedy(prompt, 6)
        ref = hf.logprobs(prompt, out.outputs[0].token_ids)
        assert max(abs(a - b) for a, b in zip(out.outputs[0].token_logprobs, ref)) < tol


def _small_config(model_type: str, **keys) -> dict:
    """transformers' config of ``model_type`` at a size that builds in a moment, as its ``to_dict`` writes it."""
    from transformers import CONFIG_MAPPING

    moe = {"qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
           "mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}.get(model_type, {})
    return CONFIG_MAPPING[model_type](**{**dict(vocab_size=32, hidden_size=64, intermediate_size=32,
                                                num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2),
                                         **moe, **keys}).to_dict()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_head_dim_a_config_leaves_out_is_the_size_transformers_attention_takes(model_type):
    """A config.json without ``head_dim``: transformers' Qwen3 takes its class default, 128, whatever the hidden
    size; the others hidden_size / num_attention_heads. The engine took 64 / 4 = 16 for Qwen3 too."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from rollout.config import ModelConfig

    raw = _small_config(model_type)
    raw.pop("head_dim", None)
    hf = AutoModelForCausalLM.from_config(CONFIG_MAPPING[model_type](**raw))
    assert ModelConfig.from_dict(raw).head_dim == hf.model.layers[0].self_attn.head_dim


def test_a_qwen3_config_without_head_dim_loads_as_transformers_loads_it(tmp_path, hf_reference):
    """A Qwen3 checkpoint of 128-wide heads whose config.json leaves ``head_dim`` out (Qwen3Config's default):
    it was refused at load ('wrong shape for ...k_norm.weight: expected [16], got [128]')."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3", head_dim=128)
    _edit_config(path, drop=("head_dim",))
    _check_greedy_against_transformers(path, hf_reference, [9, 4], seed=3, tol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_keys_a_config_leaves_out_take_the_architectures_defaults(model_type):
    """A config.json without its norm epsilon, context or rope theta reads as transformers reads it: with its
    architecture's defaults (Mixtral's 1e-5 and 1e6, not Llama's 1e-6 and 1e4)."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    hf = CONFIG_MAPPING[model_type]()
    slim = {k: v for k, v in hf.to_dict().items()
            if k not in ("rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling")}
    cfg = ModelConfig.from_dict(slim)
    theta = getattr(hf, "rope_theta", None) or hf.rope_parameters["rope_theta"]
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings, cfg.rope["rope_theta"]) == (
        hf.rms_norm_eps, hf.max_position_embeddings, theta)


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_experts",
         "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_sizes_a_config_leaves_out_take_the_architectures_defaults(model_type):
    """A config.json without its sizes, the experts' included, reads as transformers reads it: with its class's
    defaults (Mixtral's 8 experts of top-2, Qwen3-MoE's 128 of top-8). The engine refused a Mixtral or
    Qwen3-MoE config without its expert counts ('needs num_experts >= 1 ...') and failed with a bare KeyError
    on one without hidden_size or moe_intermediate_size."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    slim = {k: v for k, v in CONFIG_MAPPING[model_type]().to_dict().items() if k not in SIZES}
    hf = CONFIG_MAPPING[model_type](**slim)
    cfg = ModelConfig.from_dict(slim)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.num_attention_heads)
    if cfg.is_moe:
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (
            hf.num_local_experts, hf.num_experts_per_tok, getattr(hf, "moe_intermediate_size", hf.intermediate_size))


def test_a_mixtral_config_without_its_expert_counts_loads_as_transformers_loads_it(tmp_path, hf_reference):
    """The tiny Mixtral has MixtralConfig's 8 experts of top-2; its config.json without them was refused."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "mixtral"), "mixtral", sliding_window=None)
    _edit_config(path, drop=("num_local_experts", "num_experts", "num_experts_per_tok"))
    _check_greedy_against_transformers(path, hf_reference, [9, 4], seed=3, tol=1e-5)


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_rope_scaling_added_to_a_transformers_5_config_is_applied(tmp_path, hf_reference):
    """A transformers 5 config.json (``rope_parameters``) given a ``rope_scaling`` as Qwen's YaRN instructions
    say: transformers takes the ``rope_scaling`` whole (its default theta too, not the ``rope_parameters``' one);
    the engine ran the unscaled rope instead, without a word. Greedy ids and logprobs past the original context."""
    from tiny_models import make_tiny_checkpoint

    path = make_tiny_checkpoint(str(tmp_path / "yarn"), "qwen3", rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 1e6})
    _edit_config(path, rope_scaling=YARN)
    _check_greedy_against_transformers(path, hf_reference, [70, 5], seed=2)


@pytest.mark.parametrize("keys", [
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": YARN},
    {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
     "rope_scaling": {"type": "default"}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_theta": 300.0,
     "rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_theta": 300.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
], ids=["yarn-added", "default-added", "linear-added-with-theta", "transformers-4"])
@pytest.mark.parametrize("model_type", ["llama", "mixtral"])
def test_rope_keys_read_as_transformers_reads_them(model_type, keys):
    """The rope type and theta from ``rope_parameters``, ``rope_scaling`` and ``rope_theta`` together, as
    transformers' config reads them (Mixtral: its own default theta)."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    raw = {k: v for k, v in CONFIG_MAPPING[model_type]().to_dict().items() if k != "rope_parameters"}
    raw.update(keys)
    want = CONFIG_MAPPING[model_type](**raw).rope_parameters
    got = ModelConfig.from_dict(raw).rope
    assert (got["rope_type"], got["rope_theta"], got.get("factor")) == (
        want["rope_type"], want["rope_theta"], want.get("factor"))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral"])
def test_kv_heads_and_window_a_config_leaves_out_read_as_transformers_reads_them(model_type):
    """A config.json without ``num_key_value_heads`` or ``sliding_window``: transformers gives Llama as many KV
    heads as attention heads but the others their class's default (Mistral's 8, Qwen3's 32), and Mistral (or a
    Qwen with ``use_sliding_window``) its 4096-token window. The engine took the attention heads (refusing at
    load a checkpoint transformers loads) and no window (attending past 4096 tokens where transformers' window
    cuts, without a word)."""
    from transformers import CONFIG_MAPPING

    from rollout.config import ModelConfig

    raw = CONFIG_MAPPING[model_type](hidden_size=64, num_attention_heads=4, use_sliding_window=True).to_dict()
    for key in ("num_key_value_heads", "sliding_window"):
        raw.pop(key, None)
    hf = CONFIG_MAPPING[model_type](**raw)
    cfg = ModelConfig.from_dict(raw)
    window = None if model_type == "llama" else hf.sliding_window
    assert (cfg.num_kv_heads, cfg.sliding_window) == (hf.num_key_value_heads, window)
