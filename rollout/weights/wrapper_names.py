"""Hugging Face parameter names from whatever wrapping a trainer put around its model.

DDP, DeepSpeed's engine and Accelerate's ``prepare`` put the model under ``module``; FSDP1 and
activation checkpointing insert ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module`` between
layers; ``torch.compile`` adds ``_orig_mod``. The engine takes the names of the plain
``transformers`` model (``model.layers.3.self_attn.q_proj.weight``, ``lm_head.weight``).

Used by the trainer's senders (``trainer_adapters``) and by ``weight_sync.fingerprint`` of a wrapped model, so
both name a parameter as the engine does.
"""

from __future__ import annotations

from typing import Any

# components a wrapper inserts anywhere in a name
_INNER = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
# components a wrapper puts in front of the whole model
_OUTER = frozenset({"module", "_forward_module"})


def hf_name(name: str, strip_outer: bool = True) -> str:
    """``module._orig_mod.model.layers.0._fsdp_wrapped_module.mlp.up_proj.weight`` →
    ``model.layers.0.mlp.up_proj.weight``: drop wrapper components, keep everything else.
    ``strip_outer=False`` keeps a leading ``module.`` (for names of an already unwrapped model, where
    ``module`` is a real submodule)."""
    parts = [p for p in name.split(".") if p not in _INNER]
    while strip_outer and len(parts) > 1 and parts[0] in _OUTER:
        parts.pop(0)
    return ".".join(parts)


def hf_named_parameters(model: Any) -> list[tuple[str, Any]]:
    """``model``'s parameters under the names the engine takes: unwrapped (``unwrap_model``), wrapper
    components dropped (``hf_name``). A plain ``transformers`` model's names come back unchanged."""
    return [(hf_name(n, strip_outer=False), p) for n, p in unwrap_model(model).named_parameters()]


def unwrap_model(model: Any) -> Any:
    """The innermost ``nn.Module``: through ``.module`` (DDP, DeepSpeedEngine, Accelerate) and
    ``._orig_mod`` (torch.compile). FSDP2 wraps in place, so an FSDP2 model comes back as is."""
    import torch.nn as nn

    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and _is_wrapper(model):
            model = inner
    return model


_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine",
                       "_FabricModule"})


def _is_wrapper(model: Any) -> bool:
    """A known wrapper class, or a module whose only child is ``module`` (a generic wrapper); a model
    that merely has a submodule called ``module`` is not one."""
    if {cls.__name__ for cls in type(model).__mro__} & _WRAPPERS:
        return True
    children = [name for name, _ in model.named_children()]
    return children == ["module"]
