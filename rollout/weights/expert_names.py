"""Hugging Face names of mixture-of-experts parameters, in each naming that trainers and checkpoints use.

- Per expert (checkpoints on disk, transformers 4.x ``named_parameters``, OpenRLHF's per-tensor updates;
  transformers 5's ``save_pretrained`` converts back to these too):
  Qwen3-MoE ``model.layers.{n}.mlp.gate.weight`` [E, H] (the router),
  ``model.layers.{n}.mlp.experts.{e}.gate_proj.weight`` [I, H], ``...up_proj.weight`` [I, H],
  ``...down_proj.weight`` [H, I]; Mixtral ``model.layers.{n}.block_sparse_moe.gate.weight`` and
  ``...block_sparse_moe.experts.{e}.w1.weight`` (gate), ``w3.weight`` (up), ``w2.weight`` (down).
- Fused (transformers 5's ``named_parameters``, both architectures): ``model.layers.{n}.mlp.gate.weight``,
  ``model.layers.{n}.mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
  ``model.layers.{n}.mlp.experts.down_proj`` [E, H, I], without a ``.weight`` suffix.

The fingerprint names every MoE parameter one way whatever the architecture or naming it came in: Qwen3-MoE's
per-expert names (``fingerprint_entries``; a Mixtral ``block_sparse_moe.experts.{e}.w1.weight`` enters as
``mlp.experts.{e}.gate_proj.weight``, a fused tensor as its experts' slices). Fused names alone cannot say
which architecture they belong to, so one naming for all is what lets a trainer on transformers 4 or 5 and
the engine agree without knowing the model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_PROJ_NAMES = {"mlp": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
               "block_sparse_moe": {"gate": "w1", "up": "w3", "down": "w2"}}
_CHECKPOINT_BLOCK = {"MixtralForCausalLM": "block_sparse_moe"}  # default: "mlp"
_FUSED = {"gate_up": "gate_up_proj", "down": "down_proj"}

_PER_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_ROUTER_RE = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.gate\.weight$")
_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERTS_RE = re.compile(r"\.(experts|block_sparse_moe)\.")


@dataclass(frozen=True)
class ExpertParam:
    """What an MoE parameter name names: ``proj`` "gate", "up", "down", "gate_up" (fused) or "router";
    ``expert`` None for the router and for fused tensors (every expert)."""

    layer: int
    proj: str
    expert: int | None = None


def checkpoint_name(architecture: str, p: ExpertParam) -> str:
    """The per-expert checkpoint name of ``p`` for ``architecture`` (not for fused tensors)."""
    block = _CHECKPOINT_BLOCK.get(architecture, "mlp")
    prefix = f"model.layers.{p.layer}.{block}."
    if p.proj == "router":
        return prefix + "gate.weight"
    return f"{prefix}experts.{p.expert}.{_PROJ_NAMES[block][p.proj]}.weight"


def fused_name(p: ExpertParam) -> str:
    """transformers 5's name of the fused tensor ``p`` (proj "gate_up" or "down", no expert)."""
    return f"model.layers.{p.layer}.mlp.experts.{_FUSED[p.proj]}"


def v5_router_name(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def parse(name: str) -> ExpertParam | None:
    """The MoE parameter ``name`` names in any of the namings above; None when it names none (a dense
    parameter, or a malformed expert name: see ``malformed``)."""
    m = _PER_EXPERT_RE.match(name)
    if m:
        projs = {v: k for k, v in _PROJ_NAMES[m.group(2)].items()}
        proj = projs.get(m.group(4))
        return None if proj is None else ExpertParam(int(m.group(1)), proj, int(m.group(3)))
    m = _ROUTER_RE.match(name)
    if m:
        return ExpertParam(int(m.group(1)), "router")
    m = _FUSED_RE.match(name)
    if m:
        return ExpertParam(int(m.group(1)), "gate_up" if m.group(2) == "gate_up_proj" else "down")
    return None


def malformed(name: str, num_experts: int, block: str = "mlp") -> str | None:
    """Why ``name``, which looks like an expert parameter, is not one (None when it does not look like one
    or is well-formed): an expert index out of range, or an unknown projection."""
    if not _EXPERTS_RE.search(name):
        return None
    m = _PER_EXPERT_RE.match(name)
    if m:
        proj, expert = m.group(4), int(m.group(3))
        known = tuple(_PROJ_NAMES[m.group(2)].values())
        if proj not in known:
            return f"unknown expert projection {proj!r} in {name!r} (expected one of {', '.join(known)})"
        if expert >= num_experts:
            return f"expert index {expert} out of range in {name!r} (the model has {num_experts} experts)"
        return None
    if _ROUTER_RE.match(name) or _FUSED_RE.match(name):
        return None
    return (f"malformed expert parameter name {name!r} (expected model.layers.N.{block}.experts.E."
            f"{'/'.join(_PROJ_NAMES[block].values())}.weight, or transformers 5's model.layers.N.mlp.experts."
            "gate_up_proj / down_proj)")


def fingerprint_entries(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The fingerprint's (name, tensor) entries for one trainer tensor: MoE parameters in the canonical
    per-expert naming (a fused tensor split into its experts' views), anything else as it is."""
    p = parse(name)
    if p is None:
        return [(name, tensor)]
    if p.proj == "gate_up":
        inter = tensor.shape[1] // 2
        return [entry for e in range(tensor.shape[0]) for entry in (
            (canonical_name(ExpertParam(p.layer, "gate", e)), tensor[e, :inter]),
            (canonical_name(ExpertParam(p.layer, "up", e)), tensor[e, inter:]))]
    if p.proj == "down" and p.expert is None:
        return [(canonical_name(ExpertParam(p.layer, "down", e)), tensor[e]) for e in range(tensor.shape[0])]
    return [(canonical_name(p), tensor)]


def canonical_name(p: ExpertParam) -> str:
    """The fingerprint's name of the per-expert or router parameter ``p`` (Qwen3-MoE's checkpoint name)."""
    return checkpoint_name("Qwen3MoeForCausalLM", p)


def checkpoint_shapes(architecture: str, layer: int, num_experts: int, hidden: int, inter: int
                      ) -> dict[str, tuple[int, ...]]:
    """The per-expert checkpoint names of one sparse layer with their full shapes, in HF's order (the
    router, then each expert's gate, up and down)."""
    out = {checkpoint_name(architecture, ExpertParam(layer, "router")): (num_experts, hidden)}
    for e in range(num_experts):
        for proj, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            out[checkpoint_name(architecture, ExpertParam(layer, proj, e))] = shape
    return out


def aliases(architecture: str, layer: int, num_experts: int, hidden: int, inter: int
            ) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """The other names a trainer may send for one sparse layer's parameters: {name: (full shape, the
    checkpoint names it covers)} — transformers 5's fused ``gate_up_proj`` / ``down_proj`` and, where the
    checkpoint names the router differently (Mixtral), its ``mlp.gate.weight``."""
    def names(proj: str) -> tuple[str, ...]:
        return tuple(checkpoint_name(architecture, ExpertParam(layer, proj, e)) for e in range(num_experts))

    out = {fused_name(ExpertParam(layer, "gate_up")): ((num_experts, 2 * inter, hidden), names("gate") + names("up")),
           fused_name(ExpertParam(layer, "down")): ((num_experts, hidden, inter), names("down"))}
    router = checkpoint_name(architecture, ExpertParam(layer, "router"))
    if router != v5_router_name(layer):
        out[v5_router_name(layer)] = ((num_experts, hidden), (router,))
    return out


def fingerprint_name(name: str) -> str:
    """The fingerprint's name of one per-expert or router checkpoint name (others unchanged)."""
    p = parse(name)
    return name if p is None else canonical_name(p)
