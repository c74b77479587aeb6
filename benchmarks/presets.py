"""Random-weight checkpoints with real models' shapes (the bench's ``--preset NAME``): each preset's
config.json, the tensors such a checkpoint stores, and ``write_preset``, which writes bf16 safetensors
and a synthetic word-level tokenizer once into ``<cache_root>/presets/NAME`` (or a given root)."""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from pathlib import Path
from typing import Any, Sequence

MAX_SHARD_BYTES = 2 * 1024**3
PRESET_NAMES = ("tiny", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-8b", "tiny-moe", "qwen3-30b-a3b",
                "qwen3-30b-a3b-4l")
_PRESET_MARKER = "rollout_preset.json"
_INIT_STD = 0.02


def _llama3_rope_scaling(factor: float) -> dict[str, Any]:
    return {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int,
           theta: float, max_pos: int, tie: bool, eps: float, rope_scaling: dict | None) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "rope_theta": theta, "rope_scaling": rope_scaling, "max_position_embeddings": max_pos,
            "tie_word_embeddings": tie, "rms_norm_eps": eps, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "attention_dropout": 0.0, "initializer_range": _INIT_STD,
            "bos_token_id": 128000 if vocab == 128256 else 1, "eos_token_id": 128001 if vocab == 128256 else 2,
            "torch_dtype": "bfloat16", "use_cache": True}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, kv: int, tie: bool) -> dict[str, Any]:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128, "rope_theta": 1000000.0,
            "rope_scaling": None, "max_position_embeddings": 40960, "tie_word_embeddings": tie,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": layers,
            "initializer_range": _INIT_STD, "bos_token_id": 151643, "eos_token_id": 151645,
            "torch_dtype": "bfloat16", "use_cache": True}


def _qwen3_moe(hidden: int, inter: int, moe_inter: int, layers: int, heads: int, kv: int, experts: int, top_k: int,
               vocab: int = 151936) -> dict[str, Any]:
    config = _qwen3(hidden, inter, layers, heads, kv, False)
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=vocab,
                  moe_intermediate_size=moe_inter, num_experts=experts, num_experts_per_tok=top_k,
                  norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001,
                  output_router_logits=False)
    return config


def preset_config(name: str) -> dict[str, Any]:
    """The config.json dict of preset ``name`` (a fresh dict each call): the real model's shapes and rope
    settings (values of the Hugging Face hub configs), or a few-MB Llama for ``tiny``."""
    builders = {
        "tiny": lambda: _llama(1024, 128, 256, 2, 4, 2, 32, 10000.0, 4096, False, 1e-6, None),
        "qwen3-0.6b": lambda: _qwen3(1024, 3072, 28, 16, 8, True),
        "qwen3-8b": lambda: _qwen3(4096, 12288, 36, 32, 8, False),
        "llama-3.2-1b": lambda: _llama(128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 131072, True, 1e-5,
                                       _llama3_rope_scaling(32.0)),
        "llama-3.1-8b": lambda: _llama(128256, 4096, 14336, 32, 32, 8, 128, 500000.0, 131072, False, 1e-5,
                                       _llama3_rope_scaling(8.0)),
        "tiny-moe": lambda: _qwen3_moe(128, 256, 64, 2, 4, 2, 8, 2, vocab=1024),
        "qwen3-30b-a3b": lambda: _qwen3_moe(2048, 6144, 768, 48, 32, 4, 128, 8),
        "qwen3-30b-a3b-4l": lambda: _qwen3_moe(2048, 6144, 768, 4, 32, 4, 128, 8),  # the logits check's
    }
    if name not in builders:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESET_NAMES)}")
    return builders[name]()


def preset_param_specs(config: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF parameter name, shape) of every tensor a checkpoint of ``config`` stores, in model order; built
    on the ``meta`` device, so nothing is allocated. A tied LM head is not listed (it is the embedding).
    Mixture-of-experts tensors are listed per expert, as checkpoints store them (transformers 5's fused
    ``gate_up_proj`` / ``down_proj`` are split)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    hf_config = AutoConfig.for_model(config["model_type"], **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    specs = [spec for n, p in model.named_parameters() for spec in _per_expert(config["architectures"][0], n,
                                                                                 tuple(p.shape))]
    if config.get("tie_word_embeddings"):
        specs = [(n, s) for n, s in specs if n != "lm_head.weight"]
    return specs


def _per_expert(architecture: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    from rollout.weights.expert_names import ExpertParam, checkpoint_name, parse

    p = parse(name)
    if p is None or p.expert is not None or p.proj == "router":
        return [(name, shape)]
    experts, rows, cols = shape
    if p.proj == "down":
        return [(checkpoint_name(architecture, ExpertParam(p.layer, "down", e)), (rows, cols)) for e in range(experts)]
    return [(checkpoint_name(architecture, ExpertParam(p.layer, proj, e)), (rows // 2, cols))
            for e in range(experts) for proj in ("gate", "up")]


def shard_plan(specs: Sequence[tuple[str, tuple[int, ...]]], bytes_per_elem: int,
               max_shard_bytes: int = MAX_SHARD_BYTES) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split tensors, in order, into shards of at most ``max_shard_bytes`` (a larger tensor gets its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        n = _numel(shape) * bytes_per_elem
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    return shards


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _init_tensor(name: str, shape: tuple[int, ...], seed: int, device: str = "cpu"):
    """Norm weights 1, biases 0, everything else N(0, 0.02) in bf16, seeded by (seed, name) and drawn on
    ``device`` (a GPU draws an 8B model's 16 GB in seconds; the values differ from a CPU draw)."""
    import torch

    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    gen = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.empty(shape, dtype=torch.bfloat16, device=device).normal_(0.0, _INIT_STD, generator=gen).cpu()


def _write_weights(out: Path, specs: list[tuple[str, tuple[int, ...]]], seed: int,
                   max_shard_bytes: int) -> None:
    """Write bf16 safetensors shard by shard (one shard in memory at a time), with an index when sharded."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards = shard_plan(specs, 2, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in tqdm(list(zip(names, shards)), desc="Writing preset shards", unit="shard"):
        tensors = {name: _init_tensor(name, shape, seed, device) for name, shape in shard}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, (out / "config.json").stat().st_mode)  # safetensors writes 0600; use umask's
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token ``<tN>`` per id, so the engine's detokenizer can run."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<t0>").save_pretrained(str(out))


def _marker(name: str, seed: int, weights: bool) -> dict[str, Any]:
    return {"preset": name, "seed": seed} if weights else {"preset": name, "weights": False}


def _preset_complete(path: Path, marker: dict[str, Any]) -> bool:
    file = path / _PRESET_MARKER
    return file.is_file() and json.loads(file.read_text()) == marker


def write_preset(name: str, root: str | os.PathLike[str] | None = None, seed: int = 0,
                 max_shard_bytes: int = MAX_SHARD_BYTES, weights: bool = True) -> str:
    """Return the directory of preset ``name``'s random checkpoint under ``root`` (default
    ``<cache_root>/presets``), writing it first if absent. It is written into a temporary directory and
    renamed into place, so an existing directory with its marker file is always complete.
    ``weights=False`` writes the config and tokenizer only (``NAME-config``), for an engine started with
    ``load_format="dummy"`` (a 30B model's 61 GB need not touch the disk)."""
    from rollout.default_model import cache_root

    config = preset_config(name)
    base = Path(root).expanduser() if root is not None else cache_root() / "presets"
    final = base / (name if weights else f"{name}-config")
    marker = _marker(name, seed, weights)
    if _preset_complete(final, marker):
        return str(final)
    base.mkdir(parents=True, exist_ok=True)
    tmp = base / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if weights:
            _write_weights(tmp, preset_param_specs(config), seed, max_shard_bytes)
        _write_tokenizer(tmp, config["vocab_size"])
        (tmp / _PRESET_MARKER).write_text(json.dumps(marker) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
