"""``python -m rollout.bench`` (``benchmarks/``): end-to-end on the tiny preset (engine + HF baseline + JSON), the preset
writer, and the byte counts behind the bandwidth floor."""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from benchmarks.bench import main
from benchmarks.engine_run import steady_step
from benchmarks.memory_floor import ModelBytes, model_bytes, run_decode_floor_s
from benchmarks.report import decode_by_batch
from benchmarks.trace_gaps import load_events
from benchmarks.presets import PRESET_NAMES, preset_config, preset_param_specs, shard_plan, write_preset
from benchmarks.workload import make_workload
from rollout.config import ModelConfig

# Parameter counts of the real models (tied LM heads counted once).
REAL_PARAMS = {"qwen3-0.6b": 596_049_920, "llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
               "qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624}


@pytest.fixture(scope="module")
def preset_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("presets")
    write_preset("tiny", root)
    return str(root)


def _run(args: list[str], json_path) -> dict:
    assert main(args + ["--json", str(json_path), "--device", "cpu"]) == 0
    return json.loads(json_path.read_text())


def _check_run(run: dict, requests: int, input_tokens: int, output_tokens: int) -> None:
    assert run["num_requests"] == requests
    assert run["input_tokens"] == input_tokens
    assert run["output_tokens"] == output_tokens
    assert run["elapsed_s"] > 0 and run["output_tok_s"] > 0
    assert run["total_tok_s"] == pytest.approx((input_tokens + output_tokens) / run["elapsed_s"])


def test_bench_tiny_fixed_lengths(preset_root, tmp_path, capsys):
    report = _run(["--preset", "tiny", "--preset-dir", preset_root, "--num-prompts", "6", "--input-len", "24",
                   "--output-len", "8", "--hf-baseline", "--hf-batch-size", "4", "--batch1-steps", "4"],
                  tmp_path / "out.json")
    _check_run(report["engine"], 6, 6 * 24, 6 * 8)
    _check_run(report["hf"], 6, 6 * 24, 6 * 8)
    assert report["engine_over_hf"] == pytest.approx(report["engine"]["output_tok_s"] / report["hf"]["output_tok_s"])
    assert report["dtype"] == "float32" and report["device"] == "cpu"
    mem = report["memory"]
    assert mem["copy_bandwidth_gb_s"] > 0 and mem["weight_bytes"] > mem["weight_bytes_read"] > 0
    assert mem["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # 2 (K,V) x layers x kv heads x head_dim x fp32
    steady = report["decode_steady"]
    assert steady["batch_size"] == 6 and steady["steps"] == 7  # the first token comes from prefill
    assert steady["mean_step_ms"] > 0 and steady["floor_ms"] > 0
    assert steady["step_over_floor"] == pytest.approx(steady["mean_step_ms"] / steady["floor_ms"])
    batch1 = report["decode_batch1"]
    assert batch1["batch_size"] == 1 and batch1["steps"] == 4 and batch1["mean_step_ms"] > 0
    floor = report["run_floor"]  # 6 requests together, 7 decode steps each at KV 25..31 tokens
    one = model_bytes(ModelConfig.from_path(os.path.join(preset_root, "tiny")), 1, 4)
    want = sum(one.weight_bytes_read + 6 * kv * one.kv_bytes_per_token for kv in range(25, 32))
    assert floor["decode_steps"] == 7
    assert floor["decode_floor_s"] == pytest.approx(want / (mem["copy_bandwidth_gb_s"] * 1e9))
    assert floor["decode_over_floor"] == pytest.approx(floor["decode_s"] / floor["decode_floor_s"])
    prefill = report["prefill"]  # the scheduler's own host time in prefill: scheduling + launching, waiting
    assert prefill["steps"] >= 1 and prefill["launch_seconds"] > 0 and prefill["wait_seconds"] >= 0
    out = capsys.readouterr().out
    assert "output tok/s" in out and "engine / hf" in out and "step/floor" in out and "decode floor" in out
    assert "s scheduling and launching them" in out
    (band,) = report["decode_by_batch"]  # every decode step ran at batch 6; the batch-1 probe's are reset
    assert band["batch"] == [1, 16] and band["steps"] == 7 and "decode by batch size: 1-16: 7 steps" in out


def test_bench_tiny_random_range_greedy(preset_root, tmp_path):
    args = ["--preset", "tiny", "--preset-dir", preset_root, "--num-prompts", "5", "--random-range",
            "--min-len", "4", "--max-len", "20", "--temperature", "0", "--seed", "3", "--no-warmup",
            "--hf-baseline", "--hf-batch-size", "2"]
    report = _run(args, tmp_path / "out.json")
    work = make_workload(5, preset_config("tiny")["vocab_size"], 3, 0, 0, (4, 20))
    _check_run(report["engine"], 5, work.input_tokens, work.output_tokens)
    _check_run(report["hf"], 5, work.input_tokens, work.output_tokens)  # requested tokens only
    assert report["workload"]["random_range"] == [4, 20] and report["decode_batch1"] is None


def test_bench_counts_mixed_steps_of_the_timed_run_only(preset_root, tmp_path, capsys):
    """The report's mixed steps and retractions cover the timed run, as its prefill steps do: the engine's
    counters of them are not reset by ``get_step_stats(reset=True)``, and the warm-up mixes steps too."""
    report = _run(["--preset", "tiny", "--preset-dir", preset_root, "--num-prompts", "8", "--input-len", "16",
                   "--output-len", "8", "--enable-mixed-chunk", "--max-prefill-tokens", "16"], tmp_path / "out.json")
    prefill = report["prefill"]
    assert 0 < report["mixed_steps"] <= prefill["steps"]  # a mixed step is a prefill step
    assert f"in {prefill['steps']} steps" in capsys.readouterr().out


def test_run_decode_floor_counts_every_step_of_the_schedule():
    mb = ModelBytes(weight_bytes=500, weight_bytes_read=100, kv_bytes_per_token=10)
    # two slots: step 1 reads both requests' KV (3 + 4 tokens), step 2 only the first's (4); 1000 B/s
    assert run_decode_floor_s(mb, [2, 3, 9], [3, 2, 1], 1000.0, 2) == (pytest.approx(0.17 + 0.14), 2)
    # one slot: the second request waits for the first; the third (one output token) never decodes
    assert run_decode_floor_s(mb, [2, 3, 9], [3, 2, 1], 1000.0, 1) == (pytest.approx(0.13 + 0.14 + 0.14), 3)


def test_make_workload_is_seeded_and_in_range():
    a = make_workload(20, 50, 7, 0, 0, (3, 9))
    assert a == make_workload(20, 50, 7, 0, 0, (3, 9)) and a != make_workload(20, 50, 8, 0, 0, (3, 9))
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in a.prompts)
    assert all(3 <= n <= 9 for n in a.output_lens)
    fixed = make_workload(4, 50, 0, 11, 5)
    assert [len(p) for p in fixed.prompts] == [11] * 4 and fixed.output_lens == [5] * 4


@pytest.mark.parametrize("name", sorted(REAL_PARAMS))
def test_big_preset_configs(name, tmp_path):
    from transformers import AutoConfig

    config = preset_config(name)
    (tmp_path / "config.json").write_text(json.dumps(config))
    hf = AutoConfig.from_pretrained(str(tmp_path))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(hf, key) == config[key], key
    assert hf.architectures == config["architectures"]
    specs = preset_param_specs(config)  # meta device: no memory
    assert sum(_numel(shape) for _, shape in specs) == REAL_PARAMS[name]
    cfg = ModelConfig.from_dict(config)
    assert model_bytes(cfg, 1, 2).weight_bytes == 2 * REAL_PARAMS[name]
    assert cfg.rope["rope_type"] == ("llama3" if name.startswith("llama") else "default")
    assert all(sum(_numel(s) * 2 for _, s in shard) <= 2 * 1024**3 for shard in shard_plan(specs, 2))


def test_preset_facts():
    llama8 = ModelConfig.from_dict(preset_config("llama-3.1-8b"))
    assert llama8.rope["factor"] == 8.0 and llama8.rope["rope_theta"] == 500000.0
    assert ModelConfig.from_dict(preset_config("llama-3.2-1b")).rope["factor"] == 32.0
    qwen = ModelConfig.from_dict(preset_config("qwen3-8b"))
    assert qwen.qk_norm and not qwen.tie_word_embeddings and qwen.head_dim == 128
    assert ModelConfig.from_dict(preset_config("qwen3-0.6b")).tie_word_embeddings
    assert set(PRESET_NAMES) == set(REAL_PARAMS) | {"tiny", "tiny-moe", "qwen3-30b-a3b-4l"}
    moe = ModelConfig.from_dict(preset_config("qwen3-30b-a3b"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (128, 8, 768, True)
    assert moe.sparse_layers == tuple(range(48)) and moe.qk_norm
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("gpt-5")


def test_model_bytes_tp_sharding():
    cfg = ModelConfig.from_dict(preset_config("llama-3.1-8b"))
    one, two = model_bytes(cfg, 1, 2), model_bytes(cfg, 2, 2)
    assert one.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert one.weight_bytes - one.weight_bytes_read == 2 * 128256 * 4096  # untied input embedding not read
    assert two.weight_bytes_read < one.weight_bytes_read / 2 + 2 * 4096 * 65  # only norms are replicated
    assert model_bytes(cfg, 16, 2).kv_bytes_per_token == 2 * 32 * 1 * 128 * 2  # KV heads replicated


def test_model_bytes_moe_counts_the_routed_experts():
    """A decode step reads attention, routers, norms and LM head always, and each routed expert once."""
    cfg = ModelConfig.from_dict(preset_config("qwen3-30b-a3b"))
    mb = model_bytes(cfg, 1, 2)
    assert mb.weight_bytes == 2 * REAL_PARAMS["qwen3-30b-a3b"]
    assert mb.expert_bytes == 2 * 3 * 2048 * 768 and mb.sparse_layers == 48
    attention = 48 * (2048 * (4096 + 2 * 512) + 4096 * 2048) * 2
    assert mb.weight_bytes_read == attention + 48 * (128 * 2048 + 2 * 2048 + 2 * 128) * 2 + (2048 + 151936 * 2048) * 2
    assert mb.expected_experts(1) == pytest.approx(8) and mb.expected_experts(256) == pytest.approx(128, abs=1e-3)
    assert mb.bytes_read(1) == pytest.approx(mb.weight_bytes_read + 48 * 8 * mb.expert_bytes)
    assert model_bytes(cfg, 2, 2).expert_bytes == mb.expert_bytes // 2


def test_model_bytes_fp8_weights():
    """fp8 projections: 1 byte per element plus a float32 scale per row; everything else unchanged."""
    cfg = ModelConfig.from_dict(preset_config("llama-3.1-8b"))
    bf16, fp8 = model_bytes(cfg, 1, 2), model_bytes(cfg, 1, 2, quantization="fp8")
    proj = 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336)
    rows = 32 * (6144 + 4096 + 2 * 14336 + 4096)
    assert bf16.weight_bytes - fp8.weight_bytes == proj - 4 * rows
    assert bf16.weight_bytes_read - fp8.weight_bytes_read == proj - 4 * rows
    assert fp8.kv_bytes_per_token == bf16.kv_bytes_per_token


def test_write_preset_tiny_loads_and_is_reused(preset_root, tmp_path):
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_preset("tiny", preset_root)
    weights = os.path.join(path, "model.safetensors")
    mtime = os.path.getmtime(weights)
    assert write_preset("tiny", preset_root) == path and os.path.getmtime(weights) == mtime
    hf = AutoConfig.from_pretrained(path)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads, hf.vocab_size) == (128, 2, 2, 1024)
    with safe_open(weights, framework="pt") as f:
        norm = f.get_tensor("model.norm.weight")
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    assert norm.dtype == torch.bfloat16 and bool((norm == 1).all())
    assert q.shape == (4 * 32, 128) and 0.015 < q.float().std().item() < 0.025
    # Sharded: an index plus several files, loadable by transformers with identical tensors.
    sharded = write_preset("tiny", tmp_path, max_shard_bytes=300_000)
    index = json.loads(open(os.path.join(sharded, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) > 1
    a = AutoModelForCausalLM.from_pretrained(path).state_dict()
    b = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_moe_preset_stores_experts_per_expert_and_dummy_presets_store_no_weights(tmp_path):
    """A checkpoint's per-expert tensors (as the hub's Qwen3-MoE checkpoints), which transformers loads into
    its fused experts; ``weights=False`` writes the config and tokenizer only."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = write_preset("tiny-moe", tmp_path)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        gate = f.get_tensor("model.layers.1.mlp.experts.7.gate_proj.weight")
        assert "model.layers.1.mlp.gate.weight" in f.keys()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert torch.equal(model.model.layers[1].mlp.experts.gate_up_proj[7, :64], gate.float())
    config_only = write_preset("tiny-moe", tmp_path, weights=False)
    assert config_only != path and not [n for n in os.listdir(config_only) if n.endswith(".safetensors")]
    assert ModelConfig.from_path(config_only).num_experts == 8


def test_decode_by_batch_sums_each_band_against_its_floor():
    mb = ModelBytes(weight_bytes=500, weight_bytes_read=100, kv_bytes_per_token=10)
    stats = {1: {"steps": 4, "seconds": 2.0, "kv_tokens": 40},     # floor 100 + 10 x 10 B per step
             "16": {"steps": 2, "seconds": 1.0, "kv_tokens": 200},  # 100 + 100 x 10; keys may be strings (JSON)
             300: {"steps": 1, "seconds": 0.5, "kv_tokens": 30}, 700: {"steps": 0, "seconds": 0.0, "kv_tokens": 0}}
    bands = decode_by_batch(stats, mb, 1000.0)
    assert [b["batch"] for b in bands] == [[1, 16], [257, 512]]
    assert bands[0]["steps"] == 6 and bands[0]["seconds"] == pytest.approx(3.0)
    assert bands[0]["floor_s"] == pytest.approx(4 * 0.2 + 2 * 1.1) and bands[0]["over_floor"] == pytest.approx(1.0)
    assert bands[1]["floor_s"] == pytest.approx(0.4) and bands[1]["over_floor"] == pytest.approx(1.25)
    assert decode_by_batch({}, mb, 1000.0) == []


def test_steady_step_picks_most_steps():
    stats = {"decode": {8: {"steps": 3, "seconds": 0.3, "kv_tokens": 300},
                        4: {"steps": 10, "seconds": 0.5, "kv_tokens": 400}}}
    t = steady_step(stats)
    assert (t.batch_size, t.steps, t.mean_step_ms, t.mean_kv_tokens) == (4, 10, pytest.approx(50.0), 40.0)
    assert steady_step({"decode": {}}) is None


def test_replays_between_counts_each_graph_variant_between_two_reads():
    from benchmarks.grpo import replays_between

    before = {"graph_replays": {"plain": 5}}
    after = {"graph_replays": {"plain": 9, "balanced": 3, "cascade": 0}}
    assert replays_between(before, after) == {"plain": 4, "balanced": 3}
    assert replays_between({}, {"graph_replays": {}}) == {}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("colocated", [None, "tensor"])
def test_weight_sync_bench_pushes_an_moe_preset_exactly(colocated, capsys):
    """The weight-sync bench on the MoE preset (transformers 5's fused expert tensors, as a trainer holds
    them): broadcast buckets over gloo, or the colocated push; exit 0 only when the fingerprints agree."""
    from benchmarks.weight_sync_bench import main

    argv = ["--preset", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--repeats", "1"]
    assert main(argv + (["--colocated", colocated] if colocated else ["--skip-per-tensor"])) == 0
    out = capsys.readouterr().out
    assert "fingerprints equal after the" in out and "True" in out.split("fingerprints equal")[-1]
    assert ("25 tensors" if colocated is None else "colocated push (tensor): 25 tensors") in out


def test_grpo_workload_and_rl_steps_drained_and_in_flight(tmp_path, capsys):
    """``--workload grpo --rl-steps 3`` on the tiny preset: both RL loops run every step's requests; drained,
    each step's tokens come from one weight version; in flight, the first batch's tail (only) may sample from
    the next one; the prompts' N samples share the prefix cache."""
    from benchmarks.bench import main

    out = tmp_path / "grpo.json"
    argv = ["--preset", "tiny", "--preset-dir", str(tmp_path), "--device", "cpu", "--workload", "grpo",
            "--num-prompts", "3", "--n", "4", "--min-len", "16", "--max-len", "48", "--output-len", "40",
            "--max-running-requests", "8", "--rl-steps", "3", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert "in flight / drain makespan" in capsys.readouterr().out
    for mode in ("drain", "in_flight"):
        steps = report[mode]["steps"]
        assert len(steps) == 3 and all(s["requests"] == 12 for s in steps)
        assert all(sum(s["versions"].values()) == s["output_tokens"] for s in steps)
        assert all(s["prefix_hit_rate"] > 0.5 for s in steps)  # 4 samples per prompt: 3 of 4 prompts cached
        assert report[mode]["makespan_s"] > 0 and all(s["sync_s"] > 0 for s in steps)
        assert report[mode]["fingerprint_equal"] is True
        assert report[mode]["graph_replays"] == {}  # the CPU runs no CUDA graphs
    assert [set(s["versions"]) for s in report["drain"]["steps"]] == [{"0"}, {"1"}, {"2"}]
    first = report["in_flight"]["steps"][0]
    assert set(first["versions"]) <= {"0", "1"}
    assert first["versions"]["0"] > first["output_tokens"] / 2  # the push lands in the batch's tail, not at its start
    assert [sum(s["output_tokens"] for s in report[m]["steps"]) for m in ("drain", "in_flight")] == \
        [sum(s["output_tokens"] for s in report["drain"]["steps"])] * 2


def test_grpo_rollout_reports_the_median_it_used(preset_root, tmp_path, capsys):
    """One GRPO rollout: the JSON and the table give the output median the workload was drawn with (the default,
    a quarter of the cap and at least 1; the JSON had null, the table 3 // 4 = 0), and the output tokens are
    the workload's capped lengths."""
    import argparse

    from benchmarks.grpo import make_grpo_batch

    argv = ["--preset", "tiny", "--preset-dir", preset_root, "--workload", "grpo", "--num-prompts", "2", "--n", "3",
            "--min-len", "8", "--max-len", "12", "--output-len", "3", "--seed", "5"]
    report = _run(argv, tmp_path / "out.json")
    assert report["workload"]["output_median"] == 1
    assert "outputs lognormal (median 1, sigma 1.0) capped at 3" in capsys.readouterr().out
    work = make_grpo_batch(argparse.Namespace(num_prompts=2, n=3, min_len=8, max_len=12, output_len=3,
                                              output_median=None, output_sigma=1.0), 1024, 5)
    total = report["rollout"]["total"]
    assert total["requests"] == 6 and total["output_tokens"] == sum(work.output_lens)
    assert total["output_tok_s"] == pytest.approx(total["output_tokens"] / total["makespan_s"])


def test_grpo_refuses_requests_longer_than_the_context(preset_root):
    """A 4,090-token prompt asking for 14 tokens on the tiny preset's 4,096-token context: the engine stopped it
    after 6 and the rollout timed those as if they were the workload (the fixed workload refused it already)."""
    argv = ["--preset", "tiny", "--preset-dir", preset_root, "--device", "cpu", "--workload", "grpo",
            "--num-prompts", "1", "--n", "1", "--min-len", "4090", "--max-len", "4090", "--output-len", "20",
            "--output-median", "20"]
    with pytest.raises(ValueError, match="a request needs 4104 tokens but the engine's context is 4096"):
        main(argv)


def test_grpo_rl_steps_with_a_distributed_trainer(tmp_path, capsys):
    """``--rl-sync distributed``: a trainer process (CPU, gloo) joins the engine's weight-update group and
    broadcasts each push in buckets; drained, every step samples from one new version, in flight the first
    batch's tail may sample from the next; the group is left and the trainer exits at the end."""
    from benchmarks.bench import main

    out = tmp_path / "grpo.json"
    argv = ["--preset", "tiny", "--preset-dir", str(tmp_path), "--device", "cpu", "--workload", "grpo",
            "--num-prompts", "2", "--n", "4", "--min-len", "16", "--max-len", "48", "--output-len", "40",
            "--max-running-requests", "8", "--rl-steps", "2", "--rl-sync", "distributed", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "weight push between steps: distributed" in text and "in flight / drain makespan" in text
    assert report["workload"]["rl_sync"] == "distributed"
    for mode in ("drain", "in_flight"):
        steps = report[mode]["steps"]
        assert len(steps) == 2 and all(s["requests"] == 8 and s["sync_s"] > 0 for s in steps)
        assert report[mode]["fingerprint_equal"] is True
        assert all(sum(s["versions"].values()) == s["output_tokens"] for s in steps)
    assert [set(s["versions"]) for s in report["drain"]["steps"]] == [{"0"}, {"1"}]
    assert set(report["in_flight"]["steps"][0]["versions"]) <= {"0", "1"}
    assert not [p for p in multiprocessing.active_children() if p.name == "grpo-trainer"]


@pytest.mark.parametrize("workload", [["--num-prompts", "4", "--input-len", "16", "--output-len", "12"],
                                      ["--workload", "grpo", "--num-prompts", "2", "--n", "3", "--min-len", "8",
                                       "--max-len", "16", "--output-len", "12"]])
def test_bench_profile_writes_a_trace_of_the_chosen_steps(preset_root, tmp_path, capsys, workload):
    """``--profile``: the trace of the timed run's steps 2..4 (``Engine.start_profile``), named in the output."""
    argv = ["--preset", "tiny", "--preset-dir", preset_root, "--device", "cpu", "--profile", "--profile-dir",
            str(tmp_path), "--profile-start-step", "2", "--profile-num-steps", "3"] + workload
    assert main(argv) == 0
    (trace,) = tmp_path.glob("bench-*-TP-0.trace.json.gz")
    out = capsys.readouterr().out
    assert f"profile: {trace}" in out and "no GPU kernels in the trace" in out
    launches = [e["name"] for e in load_events(str(trace)) if e["name"].startswith("launch ")]
    assert len(launches) == 3  # the window: 3 steps


def test_profile_is_not_offered_with_rl_steps(capsys):
    from benchmarks.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny", "--workload", "grpo", "--rl-steps", "2", "--profile"])
    assert "--profile needs" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rl-sync", "distributed"], "--rl-sync and --trainer-device apply to --workload grpo --rl-steps K only"),
    (["--workload", "grpo", "--rl-steps", "2", "--trainer-device", "cpu"], "--trainer-device needs --rl-sync"),
])
def test_rl_sync_options_are_checked(argv, message, capsys):
    from benchmarks.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny"] + argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("median", ["0", "-5"])
def test_grpo_output_median_below_one_is_refused(median, capsys):
    """``--output-median 0`` used to fall back to the default median (cap / 4) without a word, and a negative
    one ended in a math domain error once the engine's model was resolved."""
    from benchmarks.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny", "--workload", "grpo", "--output-median", median])
    assert "--output-median >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--rl-steps", "3"], "--rl-steps and --output-median apply to --workload grpo only"),
    (["--output-median", "64"], "--rl-steps and --output-median apply to --workload grpo only"),
    (["--workload", "grpo", "--batch1-steps", "8"], "no --batch1-steps or --no-warmup"),
    (["--workload", "grpo", "--no-warmup"], "no --batch1-steps or --no-warmup"),
])
def test_flags_of_the_other_workload_are_refused(argv, message, capsys):
    """A flag the chosen workload ignores is an error: ``--rl-steps 3`` without ``--workload grpo`` ran the
    fixed-length bench and printed its tok/s as if the RL steps had been measured."""
    from benchmarks.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--preset", "tiny"] + argv)
    assert message in capsys.readouterr().err


def test_grpo_distributed_trainer_failure_is_reported_and_the_trainer_ends(tmp_path, monkeypatch):
    """A trainer that cannot start (a CUDA device on a machine without one) fails the bench with its error;
    its process does not outlive the failure. The placement refuses such a device up front, before anything
    starts; forced past it, the trainer process itself fails."""
    import benchmarks.grpo_trainer as grpo_trainer
    from benchmarks.bench import main
    from weight_sync.placement import TrainerPlacement

    argv = ["--preset", "tiny", "--preset-dir", str(tmp_path), "--device", "cpu", "--workload", "grpo",
            "--num-prompts", "1", "--n", "2", "--min-len", "8", "--max-len", "8", "--output-len", "4",
            "--rl-steps", "1", "--rl-sync", "distributed", "--trainer-device", "cuda:0"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="this machine has 0 CUDA device"):
        main(argv)
    monkeypatch.setattr(grpo_trainer, "distributed_placement", lambda *a: TrainerPlacement("cuda:0", "gloo", False))
    with pytest.raises(RuntimeError, match="the GRPO trainer failed"):
        main(argv)
    assert not [p for p in multiprocessing.active_children() if p.name == "grpo-trainer"]


@pytest.mark.parametrize("device, tp, visible, expected", [
    ("cpu", 1, 0, "cpu"), ("cuda", 1, 2, "cuda:1"), ("cuda:1", 2, 4, "cuda:3"), ("cuda", 1, 1, None),
    ("cuda:2", 2, 4, None),
])
def test_grpo_distributed_trainer_needs_a_gpu_of_its_own(device, tp, visible, expected, monkeypatch):
    """The trainer of ``--rl-sync distributed`` takes the GPU after the engine's TP ranks; with none left the
    bench says so rather than timing gloo through host memory on a shared GPU."""
    import torch

    from benchmarks.grpo_trainer import distributed_placement

    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    if expected is None:
        with pytest.raises(ValueError, match="needs a GPU for the trainer"):
            distributed_placement(device, tp)
    else:
        assert distributed_placement(device, tp).device == expected


def test_tail_counts_the_time_after_the_last_load_sample():
    """8 slots, samples every 20 ms: fewer than 2 running from the sample at 20 ms until the batch ends at
    50 ms is 30 ms of tail; the 10 ms after the last sample were dropped (20 ms)."""
    from benchmarks.grpo import LoadSampler

    load = LoadSampler(engine=None, slots=8)
    load.samples = [(0.0, 10, 0), (0.02, 1, 0), (0.04, 1, 0), (0.06, 0, 0)]
    assert load.tail_s(0.0, 0.05) == pytest.approx(0.03)
    assert load.tail_s(0.0, 0.01) == 0  # a full engine until the end
    assert load.tail_s(0.045, 0.05) == 0  # no sample inside: nothing known


def test_in_flight_push_waits_for_the_tail_of_a_batch_smaller_than_the_slots():
    """1,024 slots, a batch of 16 requests: the push waits until fewer than a quarter of the batch (4) is left,
    not until fewer than a quarter of the slots (256), which would be right away."""
    from benchmarks.grpo import _wait_for_tail

    loads = iter([0, 16, 16, 15, 9, 4, 3, 2])  # requests left of the batch, one per poll

    class Engine:
        polls = 0

        def get_load(self):
            Engine.polls += 1
            return {"running": next(loads), "waiting": 0}

    class Worker:
        done = False

    _wait_for_tail(Engine(), Worker(), min(1024, 16))
    assert Engine.polls == 7  # returned at the first poll with 3 left
