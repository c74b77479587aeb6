"""The one map from Hugging Face parameter names to the engine's fused, sharded parameters.

The checkpoint loader, every weight-update path, ``get_weights_by_name`` and the fingerprint all go
through ``HFWeightMap``: trainers speak Hugging Face names and layouts, the engine stores fused
``qkv_proj`` / ``gate_up_proj`` shards.

Mixture-of-experts layers (``rollout.weights.expert_names``): ``shapes`` lists the checkpoint's per-expert
names; a trainer may also send transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` (and
Mixtral's router as ``mlp.gate.weight``), the ``aliases``, each covering several checkpoint names. All of
them load into the stacked ``FusedMoE`` tensors ``w13_weight`` / ``w2_weight``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from rollout.config import ModelConfig
from rollout.weights import expert_names
from rollout.weights.expert_names import ExpertParam

# (fused internal name, HF name, shard id)
_STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"  # one parameter when tied
# buffers a model computes itself, which a state_dict may still carry (vLLM and SGLang skip them too)
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|original_inv_freq|cos_cached|sin_cached)$")


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
        if n in cfg.sparse_layers:
            shapes.update(expert_names.checkpoint_shapes(cfg.architecture, n, cfg.num_experts, h,
                                                         cfg.moe_intermediate_size))
        else:
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def expert_aliases(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """{other name: (full shape, the ``expected_hf_shapes`` names it covers)} of an MoE model's sparse layers."""
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    for n in cfg.sparse_layers:
        out.update(expert_names.aliases(cfg.architecture, n, cfg.num_experts, cfg.hidden_size,
                                        cfg.moe_intermediate_size))
    return out


def trainer_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The parameters a transformers 5 model of ``cfg`` names (its ``named_parameters``): ``expected_hf_shapes``
    with each sparse layer's per-expert tensors replaced by the fused ``gate_up_proj`` / ``down_proj`` and
    Mixtral's router by ``mlp.gate.weight`` (every alias, in place of the first name it covers)."""
    first: dict[str, tuple[str, tuple[int, ...]]] = {}  # the first name an alias covers -> (alias, its shape)
    covered: set[str] = set()
    for alias, (shape, names) in expert_aliases(cfg).items():
        first[names[0]] = (alias, shape)
        covered.update(names)
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in expected_hf_shapes(cfg).items():
        if name in first:
            out[first[name][0]] = first[name][1]
        elif name not in covered:
            out[name] = shape
    return out


class HFWeightMap:
    """Resolves HF names against a model built from ``rollout.models``."""

    def __init__(self, model: nn.Module, cfg: ModelConfig) -> None:
        self.params = dict(model.named_parameters())
        self.cfg = cfg
        self.shapes = expected_hf_shapes(cfg)
        self.aliases = expert_aliases(cfg)
        self._targets: tuple[tuple[str, ...], list[Any]] | None = None

    @staticmethod
    def is_ignored(hf_name: str) -> bool:
        """A buffer the engine computes itself (rotary ``inv_freq``, its caches): accepted wherever sent, never
        loaded, and left out of fingerprints."""
        return bool(_IGNORED.search(hf_name))

    def canonical(self, hf_name: str) -> str:
        """The name as listed in ``shapes`` (a tied ``lm_head.weight`` is the embedding)."""
        if hf_name == TIED_HEAD and self.cfg.tie_word_embeddings:
            return TIED_EMBEDDING
        return hf_name

    def tied_pair(self, names: Any) -> tuple[str, str] | None:
        """(head, embedding) names when ``names`` holds both and the embeddings are tied: two names of one
        parameter, which must carry the same bits (``same_bits``)."""
        if self.cfg.tie_word_embeddings and TIED_HEAD in names and TIED_EMBEDDING in names:
            return TIED_HEAD, TIED_EMBEDDING
        return None

    def covered(self, hf_name: str) -> tuple[str, ...]:
        """The ``shapes`` names that loading ``hf_name`` sets (several for a fused expert tensor)."""
        alias = self.aliases.get(hf_name)
        return alias[1] if alias is not None else (self.canonical(hf_name),)

    def resolve(self, hf_name: str) -> tuple[nn.Parameter, Any]:
        """(internal parameter, shard id) holding ``hf_name``, a name of ``shapes``; ValueError otherwise."""
        targets = self.resolve_all(hf_name)
        if len(targets) != 1 or hf_name in self.aliases:
            raise ValueError(f"{hf_name!r} is not a single stored parameter")
        return targets[0]

    def stored_dtype(self, hf_name: str) -> torch.dtype:
        """The dtype the engine stores ``hf_name`` in (what a load casts it to)."""
        return self.resolve_all(hf_name)[0][0].dtype

    def resolve_all(self, hf_name: str) -> list[tuple[nn.Parameter, Any]]:
        """Every (internal parameter, shard id) that ``hf_name`` (a name of ``shapes`` or an alias) loads."""
        name = self.canonical(hf_name)
        if name not in self.shapes and name not in self.aliases:
            raise ValueError(self._unknown(hf_name))
        expert = expert_names.parse(name) if self.cfg.is_moe else None
        if expert is not None:
            return self._expert_targets(expert)
        for fused, part, shard_id in _STACKED:
            if f".{part}." in name:
                return [(self.params[name.replace(f".{part}.", f".{fused}.")], shard_id)]
        return [(self.params[name], None)]

    def _expert_targets(self, p: ExpertParam) -> list[tuple[nn.Parameter, Any]]:
        prefix = f"model.layers.{p.layer}.mlp."
        if p.proj == "router":
            return [(self.params[prefix + "gate.weight"], None)]
        if p.proj == "down":
            return [(self.params[prefix + "experts.w2_weight"], (p.expert, "down"))]
        w13 = self.params[prefix + "experts.w13_weight"]
        if p.proj == "gate_up":  # transformers 5's fused [E, 2I, H]: its gate half and its up half
            return [(w13, (None, "gate")), (w13, (None, "up"))]
        return [(w13, (p.expert, p.proj))]

    def _unknown(self, hf_name: str) -> str:
        if self.cfg.is_moe:
            block = "block_sparse_moe" if self.cfg.architecture == "MixtralForCausalLM" else "mlp"
            why = expert_names.malformed(hf_name, self.cfg.num_experts, block)
            if why is not None:
                return why
        return f"unknown parameter name {hf_name!r}" + self._wrapper_hint(hf_name)

    def _wrapper_hint(self, hf_name: str) -> str:
        """For a name that a trainer's wrapper (DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``, FSDP1's or
        activation checkpointing's components, PEFT's ``base_model.model.`` / ``.base_layer``) made of a known
        one: what to send instead ("" otherwise). The engine takes the plain ``transformers`` names, as vLLM and
        SGLang do; the senders of ``weight_sync`` and ``trainer_adapters`` unwrap."""
        from rollout.weights.wrapper_names import plain_name

        plain = plain_name(hf_name)
        if plain == hf_name or self.full_shape(plain) is None:
            return ""
        return (f" (a wrapper's name for {plain!r}: send the plain transformers names, as "
                "trainer_adapters.broadcast_to_engines and push_colocated do)")

    def read_sources(self, hf_name: str, rows: int) -> tuple[str, ...]:
        """The ``shapes`` names whose values make the first ``rows`` rows of ``hf_name`` (``read_join`` puts them
        together): the name itself, or for a fused expert alias the experts up to ``rows`` (a ``gate_up_proj``:
        their gate names, then their up names)."""
        names = self.covered(hf_name)
        fused = expert_names.parse(hf_name) if hf_name in self.aliases else None
        if fused is None or fused.proj == "router":
            return names
        k, e = min(max(rows, 1), self.cfg.num_experts), self.cfg.num_experts
        return names[:k] + names[e:e + k] if fused.proj == "gate_up" else names[:k]

    def read_join(self, hf_name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``hf_name``'s tensor in its own layout (a fused alias: its first experts) from the full tensors of
        ``read_sources``: [k, 2I, H] of each expert's gate rows then its up rows, or [k, H, I]."""
        fused = expert_names.parse(hf_name) if hf_name in self.aliases else None
        if fused is None or fused.proj == "router":
            return tensors[0]
        if fused.proj == "gate_up":
            k = len(tensors) // 2
            return torch.cat([torch.stack(tensors[:k]), torch.stack(tensors[k:])], dim=1)
        return torch.stack(tensors)

    def full_shape(self, hf_name: str) -> tuple[int, ...] | None:
        alias = self.aliases.get(hf_name)
        return alias[0] if alias is not None else self.shapes.get(self.canonical(hf_name))

    def check(self, hf_name: str, shape: tuple[int, ...]) -> None:
        """ValueError unless ``hf_name`` is a parameter (or alias) whose full shape is ``shape``."""
        expected = self.full_shape(hf_name)
        if expected is None:
            raise ValueError(self._unknown(hf_name))
        if tuple(shape) != expected:
            raise ValueError(f"wrong shape for {hf_name!r}: expected {list(expected)}, got {list(shape)}")

    def load(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's shard of the full HF tensor into place."""
        self.check(hf_name, tuple(tensor.shape))
        targets = self.resolve_all(hf_name)
        tensor = on_device(tensor, targets[0][0].device)  # every parameter of this rank is on its one device
        for param, shard_id in targets:
            param.weight_loader(param, tensor, shard_id)

    def load_all(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """``load`` each tensor, with the views of plain copies cached (``copy_targets``): a push of
        hundreds of tensors spends its time in the copies, not in finding where they go."""
        for (name, tensor), targets in zip(tensors, self.copy_targets(tuple(n for n, _ in tensors))):
            if targets is None:
                self.load(name, tensor)
                continue
            for view, spec in targets:
                part = spec.take(tensor)
                if part.shape != view.shape:
                    raise ValueError(f"wrong shape for {name!r}: this rank expects {tuple(view.shape)} of it, "
                                     f"got {tuple(part.shape)}")
                view.copy_(on_device(part, view.device))

    def copy_targets(self, names: tuple[str, ...]) -> list[Any]:
        """For each HF name, the [(this rank's view, its ShardSpec)] that plain copies load, None when its
        loader does more (fp8 quantization). Cached for the last list of names (a trainer sends the same
        ones every step; the views stay valid because parameters are never rebound)."""
        from rollout.layers.linear import load_shard

        if self._targets is None or self._targets[0] != names:
            targets = []
            for name in names:
                resolved = self.resolve_all(name)
                plain = all(param.weight_loader is load_shard for param, _ in resolved)
                targets.append(merge_adjacent([param.shard_view(param, shard) for param, shard in resolved])
                               if plain else None)
            self._targets = (names, targets)
        return self._targets[1]

    def local_view(self, hf_name: str):
        """(this rank's view of ``hf_name``, a name of ``shapes``, and its ShardSpec in the full tensor)."""
        param, shard_id = self.resolve(hf_name)
        return param.shard_view(param, shard_id)

    @staticmethod
    def fingerprint_name(name: str) -> str:
        """The fingerprint's name of ``shapes`` name ``name``: one naming of expert parameters for every
        architecture and trainer (``expert_names.fingerprint_entries``)."""
        return expert_names.fingerprint_name(name)

    def local_scale_view(self, hf_name: str):
        """(this rank's view of the row scales of fp8-stored ``hf_name``, its ShardSpec in the full
        [rows] vector), or None when ``hf_name`` is stored unquantized."""
        from rollout.layers.linear import scale_shard

        param, shard_id = self.resolve(hf_name)
        return None if getattr(param, "scale", None) is None else scale_shard(param, shard_id)

    @property
    def fingerprint_shapes(self) -> dict[str, tuple[int, ...]]:
        """``shapes`` under their fingerprint names plus, for each fp8-stored weight, its row scales under ``scale_name(name)``."""
        from rollout.layers.quantization import scale_name

        out = {self.fingerprint_name(name): shape for name, shape in self.shapes.items()}
        for name, shape in self.shapes.items():
            param, _ = self.resolve(name)
            if getattr(param, "scale", None) is not None:
                out[scale_name(name)] = (shape[0],)
        return out


def merge_adjacent(targets: list[tuple[torch.Tensor, Any]]) -> list[tuple[torch.Tensor, Any]]:
    """Join consecutive (view, ShardSpec) copy targets that continue each other along one dimension, both in
    the parameter and in the sent tensor, into one copy: a fused expert ``gate_up_proj`` at TP=1 lands as one
    copy of the whole tensor instead of two strided halves (at TP>1 its halves are apart in the sent tensor)."""
    from rollout.layers.linear import ShardSpec

    out = list(targets[:1])
    for view, spec in targets[1:]:
        prev, pspec = out[-1]
        d = spec.dim
        if (d is not None and pspec.dim == d and spec.start == pspec.start + pspec.length
                and view.dim() == prev.dim() and view.stride() == prev.stride()
                and all(a == b for i, (a, b) in enumerate(zip(view.shape, prev.shape)) if i != d)
                and view.data_ptr() == prev.data_ptr() + prev.shape[d] * prev.stride(d) * prev.element_size()):
            shape = list(prev.shape)
            shape[d] += view.shape[d]
            out[-1] = (prev.as_strided(shape, prev.stride()), ShardSpec(d, pspec.start, pspec.length + spec.length))
        else:
            out.append((view, spec))
    return out


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A CUDA tensor another GPU holds (a trainer on GPU 0 sharing by CUDA IPC with TP
    rank 1) is copied into this GPU's own memory first: after a sleep and wake, a peer copy straight into the
    weights (which torch-memory-saver maps again with ``cuMemMap``, likely with access for this GPU only)
    failed with "CUDA error: invalid argument" (two H200s, ``gpu_checks/check_update_paths.py --tp-size 2``)."""
    return t.to(device) if t.is_cuda and device.type == "cuda" and t.device != device else t


def equal_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and, in ``a``'s dtype, the same values."""
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and, in ``a``'s dtype, the same bits: loading either leaves the same weights (a NaN
    equals itself; -0.0 differs from 0.0, which ``equal_values`` takes as equal)."""
    if a.shape != b.shape:
        return False
    bits = _BITS[a.dtype.itemsize]
    return torch.equal(a.view(bits), b.to(a.dtype).view(bits))
