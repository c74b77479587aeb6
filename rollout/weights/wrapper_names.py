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


def plain_name(name: str) -> str:
    """``name`` with every wrapper's part dropped (``hf_name``), PEFT's ``base_model.model.`` and ``.base_layer``
    too, by spelling alone: for a message about a name with no model at hand (``hf_named_parameters`` tells a
    PEFT layer from its structure)."""
    return hf_name(name.replace("base_model.model.", "", 1).replace(".base_layer.", "."))


def hf_named_parameters(model: Any) -> list[tuple[str, Any]]:
    """``model``'s parameters under the names the engine takes: unwrapped (``unwrap_model``), wrapper
    components dropped (``hf_name``). A plain ``transformers`` model's names come back unchanged.

    A PEFT model (``get_peft_model``, or transformers' ``add_adapter``) gives its base weights under their
    own names and leaves the adapter weights out, as TRL and verl send it; that is the model it computes only
    with its adapters merged (``merge_adapter()`` before the push, ``unmerge_adapter()`` after), so adapters
    that are active and not merged are a ``ValueError``."""
    model = unwrap_model(model)
    layers = _tuner_layers(model)
    out = []
    for name, p in model.named_parameters():
        name = _base_name(name, layers) if layers else name
        if name is not None:
            out.append((hf_name(name, strip_outer=False), p))
    return out


def _tuner_layers(model: Any) -> set[str]:
    """Names of the PEFT tuner layers of ``model`` (a LoRA ``Linear`` holding ``base_layer``); ValueError when
    one has an active adapter that is not merged into its base layer."""
    layers, unmerged = set(), []
    for name, m in model.named_modules():
        if not all(hasattr(m, a) for a in ("base_layer", "merged_adapters", "active_adapters",
                                            "adapter_layer_names")):
            continue
        layers.add(name)
        held = {a for attr in m.adapter_layer_names for a in getattr(m, attr, {})}
        if not getattr(m, "disable_adapters", False) and (set(m.active_adapters) & held) - set(m.merged_adapters):
            unmerged.append(name)
    if unmerged:
        raise ValueError(f"{len(unmerged)} PEFT layers (e.g. {unmerged[0]!r}) have active adapters that are not "
                         "merged: the engine serves plain weights, so call model.merge_adapter() before the push and "
                         "model.unmerge_adapter() after it (or push merge_and_unload()'s model)")
    return layers


def _base_name(name: str, layers: set[str]) -> str | None:
    """The name of a PEFT model's parameter in the model its merged adapters make (None: an adapter weight, or
    the frozen original beside a ``modules_to_save`` copy): ``...q_proj.base_layer.weight`` → ``...q_proj.weight``,
    ``lm_head.modules_to_save.default.weight`` → ``lm_head.weight``."""
    parts = name.split(".")
    if "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        del parts[i:i + 2]
    for k in range(len(parts) - 1, 0, -1):
        if ".".join(parts[:k]) in layers:
            return ".".join(parts[:k] + parts[k + 1:]) if parts[k] == "base_layer" else None
    return ".".join(parts)


def unwrap_model(model: Any) -> Any:
    """The innermost ``nn.Module``: through ``.module`` (DDP, DeepSpeedEngine, Accelerate) and
    ``._orig_mod`` (torch.compile). FSDP2 wraps in place, so an FSDP2 model comes back as is."""
    import torch.nn as nn

    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        inner = _peft_inner(model)
        if inner is not None:
            model = inner
            continue
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and _is_wrapper(model):
            model = inner
    return model


def _peft_inner(model: Any) -> Any:
    """The model a PEFT ``PeftModel`` (``base_model``) or tuner model (``LoraModel``: ``model``) wraps, else None."""
    import torch.nn as nn

    classes = {cls.__name__ for cls in type(model).__mro__}
    attr = "base_model" if "PeftModel" in classes else "model" if "BaseTuner" in classes else None
    inner = getattr(model, attr, None) if attr else None
    return inner if isinstance(inner, nn.Module) else None


_WRAPPERS = frozenset({"DistributedDataParallel", "DataParallel", "DeepSpeedEngine", "PipelineEngine",
                       "_FabricModule"})


def _is_wrapper(model: Any) -> bool:
    """A known wrapper class, or a module whose only child is ``module`` (a generic wrapper); a model
    that merely has a submodule called ``module`` is not one."""
    if {cls.__name__ for cls in type(model).__mro__} & _WRAPPERS:
        return True
    children = [name for name, _ in model.named_children()]
    return children == ["module"]
