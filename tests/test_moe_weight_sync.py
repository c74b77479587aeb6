"""Live weight sync into mixture-of-experts engines (CPU, gloo): a real trainer process pushes transformers 5's
fused expert tensors, per-expert tensors (transformers 4's names, OpenRLHF's per-tensor loop), flattened
buckets, a checkpoint on disk and shared tensors; every engine's fingerprint equals the trainer's
``weight_sync.fingerprint`` and its greedy outputs and logprobs equal transformers' on the new weights."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine
from test_moe import moe_path
from test_weight_sync import check_synced, collect, start_trainer

MODES = ["bucket", "per_expert", "openrlhf", "sglang", "disk", "tensor"]


@pytest.mark.parametrize("variant", ["qwen3_moe_dense_layers", "mixtral"])
def test_every_update_mode_into_tp2_and_tp1_engines(variant, tiny_dir):
    path = moe_path(tiny_dir, variant)
    with Engine(path, dtype="float32", device="cpu", tp_size=2) as tp2, \
            Engine(path, dtype="float32", device="cpu") as tp1:
        plan = [{"kind": "train_and_push", "mode": m} for m in MODES]
        proc, results = start_trainer([tp2, tp1], [2, 1], path, plan)
        steps = collect(proc, results, len(plan))
        proc.join(30)
    for mode, step in zip(MODES, steps):
        check_synced(step, n_engines=2)
    assert len({s["trainer_fp"] for s in steps}) == len(MODES), "each step trained the weights"


def test_malformed_expert_names_are_refused_and_nothing_changes(tiny_dir):
    path = moe_path(tiny_dir, "qwen3_moe")
    bad = {
        "model.layers.0.mlp.experts.8.gate_proj.weight": "expert index 8 out of range",
        "model.layers.0.mlp.experts.0.gate.weight": "unknown expert projection 'gate'",
        "model.layers.0.mlp.experts.gate_up": "malformed expert parameter name",
        "model.layers.0.block_sparse_moe.experts.0.w1.weight": "unknown parameter name",
    }
    with Engine(path, dtype="float32", device="cpu") as engine:
        fp0 = engine.weights_fingerprint()
        for name, message in bad.items():
            with pytest.raises(ValueError, match=message):
                engine.update_weights_from_tensor([(name, torch.zeros(48, 64))])
        with pytest.raises(ValueError, match=r"wrong shape for 'model.layers.1.mlp.experts.gate_up_proj'"):
            engine.update_weights_from_tensor([("model.layers.1.mlp.experts.gate_up_proj", torch.zeros(8, 48, 64))])
        assert engine.weights_fingerprint() == fp0
        assert engine.get_weight_state()["state"] == "consistent"



def test_two_namings_of_one_expert_weight_in_one_update_are_refused(tiny_dir):
    """A fused ``experts.gate_up_proj`` beside one of its experts' ``w1`` (or Mixtral's router under both its
    names) in one call set the same stored weights: that was accepted and whichever came last won, silently.
    Now refused before anything loads; one naming alone still loads."""
    path = moe_path(tiny_dir, "mixtral")
    fused, expert0 = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    routers = ["model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight"]
    with Engine(path, dtype="float32", device="cpu") as engine:
        fp0 = engine.weights_fingerprint()
        gate_up = torch.randn(8, 96, 64)
        for clash in ([(fused, gate_up), (expert0, gate_up[0, :48] * 2)],
                      [(routers[0], torch.randn(8, 64)), (routers[1], torch.randn(8, 64))]):
            with pytest.raises(ValueError, match="set the same weights in one update"):
                engine.update_weights_from_tensor(clash)
            assert engine.weights_fingerprint() == fp0
            assert engine.get_weight_state()["state"] == "consistent"
        engine.update_weights_from_tensor([(fused, gate_up)])
        assert engine.get_weights_by_name(expert0, truncate_size=48) == gate_up[0, :48].tolist()

@pytest.mark.parametrize("variant,mode,tp,dtype", [("qwen3_moe", "bucket", 2, "float32"),
                                                   ("mixtral", "per-tensor", 1, "float32"),
                                                   ("qwen3_moe", "per-tensor", 1, "bfloat16")])
def test_rollout_smoke_passes_on_moe_checkpoints(variant, mode, tp, dtype, tiny_dir, capsys):
    """The smoke CLI (rollout, a real training step, the push, every check against transformers) on MoE. Its
    logprob check replays the engine's routing in transformers (docs/moe.md): in bfloat16 a router near-tie
    that goes the other way moves a logprob by ~1, far past the tolerance, without anything being wrong."""
    from weight_sync.smoke import main

    code = main(["--model", moe_path(tiny_dir, variant), "--mode", mode, "--tp-size", str(tp), "--dtype", dtype])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "OK: all checks passed" in out and ("MixtralForCausalLM" if variant == "mixtral" else "Qwen3MoeForCausalLM") in out
    assert "engine's routing replayed" in out
    if dtype == "float32":
        assert " 0 of " in out, "in float32 the engine's routers choose exactly as transformers'"


def test_fused_gate_up_halves_merge_into_one_copy_only_where_they_continue_each_other():
    """``merge_adjacent``: at TP=1 the gate and up halves of a fused [E, 2I, H] tensor are one copy of the
    whole tensor; a TP rank's halves (apart in the sent tensor) and views that do not touch stay separate."""
    from rollout.layers.linear import ShardSpec
    from rollout.weights.weight_map import merge_adjacent

    e, inter, h = 3, 4, 5
    w13 = torch.zeros(e, 2 * inter, h)
    tp1 = [(w13.narrow(1, 0, inter), ShardSpec(1, 0, inter)), (w13.narrow(1, inter, inter), ShardSpec(1, inter, inter))]
    [(view, spec)] = merge_adjacent(tp1)
    sent = torch.randn(e, 2 * inter, h)
    view.copy_(spec.take(sent))
    assert spec == ShardSpec(1, 0, 2 * inter) and torch.equal(w13, sent)

    n = inter // 2  # rank 0 of TP=2: gate rows [0, n), up rows [I, I + n) of the sent tensor
    local = torch.zeros(e, 2 * n, h)
    tp2 = [(local.narrow(1, 0, n), ShardSpec(1, 0, n)), (local.narrow(1, n, n), ShardSpec(1, inter, n))]
    assert len(merge_adjacent(tp2)) == 2
    apart = [(w13.narrow(1, 0, 1), ShardSpec(1, 0, 1)), (w13.narrow(1, 2, 1), ShardSpec(1, 1, 1))]
    assert len(merge_adjacent(apart)) == 2


@pytest.mark.parametrize("variant", ["qwen3_moe", "mixtral"])
def test_get_weights_by_name_reads_transformers_5_names_as_transformers_gives_them(variant, tiny_dir, hf_reference):
    """A trainer on transformers 5 checks its push with ``get_weights_by_name(name)`` against
    ``get_parameter(name)[:k]`` for its own names: the fused ``mlp.experts.gate_up_proj`` / ``down_proj`` and
    Mixtral's router ``mlp.gate.weight``, which every update takes. They were refused ("wrong shape ... got []")."""
    path = moe_path(tiny_dir, variant)
    hf = hf_reference(path).model
    names = [n for n, _ in hf.named_parameters() if ".mlp.experts." in n or ".mlp.gate.weight" in n]
    assert any(n.endswith("experts.gate_up_proj") for n in names)
    for tp in (1, 2):
        with Engine(path, dtype="float32", device="cpu", tp_size=tp) as engine:
            for name in names:
                for k in (1, 3, 100):
                    assert engine.get_weights_by_name(name, k) == hf.get_parameter(name).detach()[:k].tolist(), name


@pytest.mark.parametrize("variant", ["qwen3_moe_dense_layers", "mixtral"])
def test_trainer_hf_shapes_are_the_names_of_a_transformers_5_model(variant, tiny_dir, hf_reference):
    """``trainer_hf_shapes`` (what the weight-sync benchmarks push, as a transformers 5 trainer would): the names
    and shapes of transformers' own ``named_parameters``. Mixtral's router was listed under its checkpoint
    name ``block_sparse_moe.gate.weight`` instead of transformers 5's ``mlp.gate.weight``."""
    from rollout.config import ModelConfig
    from rollout.weights.weight_map import trainer_hf_shapes

    path = moe_path(tiny_dir, variant)
    want = {name: tuple(p.shape) for name, p in hf_reference(path).model.named_parameters()}
    assert trainer_hf_shapes(ModelConfig.from_path(path)) == want
