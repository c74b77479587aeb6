"""The one map from Hugging Face parameter names to the engine's fused, sharded parameters.

The checkpoint loader, every weight-update path, ``get_weights_by_name`` and the fingerprint all go
through ``HFWeightMap``: trainers speak Hugging Face names and layouts, the engine stores fused
``qkv_proj`` / ``gate_up_proj`` shards.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from rollout.config import ModelConfig

# (fused internal name, HF name, shard id)
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|rotary_emb\.cos_cached|rotary_emb\.sin_cached)$")


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the HF model, in HF's order, with its full (unsharded) shape.

    For tied embeddings ``lm_head.weight`` is left out (HF's ``named_parameters`` leaves it out too).
    """
    h, hd, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


class HFWeightMap:
    """Resolves HF names against a model built from ``rollout.models``."""

    def __init__(self, model: nn.Module, cfg: ModelConfig) -> None:
        self.params = dict(model.named_parameters())
        self.cfg = cfg
        self.shapes = expected_hf_shapes(cfg)
        self._targets: tuple[tuple[str, ...], list[Any]] | None = None

    @staticmethod
    def is_ignored(hf_name: str) -> bool:
        return bool(_IGNORED.search(hf_name))

    def canonical(self, hf_name: str) -> str:
        """The name as listed in ``shapes`` (a tied ``lm_head.weight`` is the embedding)."""
        if hf_name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return "model.embed_tokens.weight"
        return hf_name

    def resolve(self, hf_name: str) -> tuple[nn.Parameter, Any]:
        """(internal parameter, shard id) holding ``hf_name``; ValueError for an unknown name."""
        name = self.canonical(hf_name)
        if name not in self.shapes:
            raise ValueError(f"unknown parameter name {hf_name!r}")
        for fused, part, shard_id in _STACKED:
            if f".{part}." in name:
                return self.params[name.replace(f".{part}.", f".{fused}.")], shard_id
        return self.params[name], None

    def check(self, hf_name: str, shape: tuple[int, ...]) -> None:
        """ValueError unless ``hf_name`` is a parameter whose full shape is ``shape``."""
        expected = self.shapes.get(self.canonical(hf_name))
        if expected is None:
            raise ValueError(f"unknown parameter name {hf_name!r}")
        if tuple(shape) != expected:
            raise ValueError(f"wrong shape for {hf_name!r}: expected {list(expected)}, got {list(shape)}")

    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's shard of the full HF tensor into place."""
        self.check(hf_name, tuple(tensor.shape))
        param, shard_id = self.resolve(hf_name)
        param.weight_loader(param, tensor, shard_id)

    def load_all(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """``load`` each tensor, with the views of plain copies cached (``copy_targets``): a push of
        hundreds of tensors spends its time in the copies, not in finding where they go."""
        for (name, tensor), target in zip(tensors, self.copy_targets(tuple(n for n, _ in tensors))):
            if target is None:
                self.load(name, tensor)
                continue
            view, spec = target
            part = spec.take(tensor)
            if part.shape != view.shape:
                raise ValueError(f"wrong shape for {name!r}: this rank expects {tuple(view.shape)} of it, "
                                 f"got {tuple(part.shape)}")
            view.copy_(part)

    def copy_targets(self, names: tuple[str, ...]) -> list[Any]:
        """For each HF name, (this rank's view, its ShardSpec) when a plain copy loads it, None when its
        loader does more (fp8 quantization). Cached for the last list of names (a trainer sends the same
        ones every step; the views stay valid because parameters are never rebound)."""
        from rollout.layers.linear import load_shard

        if self._targets is None or self._targets[0] != names:
            targets = []
            for name in names:
                param, shard_id = self.resolve(name)
                targets.append(param.shard_view(param, shard_id) if param.weight_loader is load_shard else None)
            self._targets = (names, targets)
        return self._targets[1]

    def local_view(self, hf_name: str):
        """(this rank's view of ``hf_name``, its ShardSpec in the full tensor)."""
        param, shard_id = self.resolve(hf_name)
        return param.shard_view(param, shard_id)

    def local_scale_view(self, hf_name: str):
        """(this rank's view of the row scales of fp8-stored ``hf_name``, its ShardSpec in the full
        [rows] vector), or None when ``hf_name`` is stored unquantized."""
        from rollout.layers.linear import scale_shard

        param, shard_id = self.resolve(hf_name)
        return None if getattr(param, "scale", None) is None else scale_shard(param, shard_id)

    @property
    def fingerprint_shapes(self) -> dict[str, tuple[int, ...]]:
        """``shapes`` plus, for each fp8-stored weight, its row scales under ``scale_name(name)``."""
        from rollout.layers.quantization import scale_name

        out = dict(self.shapes)
        for name, shape in self.shapes.items():
            param, _ = self.resolve(name)
            if getattr(param, "scale", None) is not None:
                out[scale_name(name)] = (shape[0],)
        return out
