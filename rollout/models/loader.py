"""Build a model from a local Hugging Face directory and load its safetensors weights."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Iterator

import torch

from rollout.config import ModelConfig
from rollout.distributed import TPGroup
from rollout.models.llama import LlamaForCausalLM
from rollout.weights.weight_map import HFWeightMap, equal_values


def iter_safetensors(model_path: str, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint (see ``_safetensors_files``) but ``skip``."""
    return _iter_tensors(model_path, lambda name: name not in skip)


def tied_head_skip(model_path: str, names: Any, weight_map: HFWeightMap) -> frozenset[str]:
    """The checkpoint names to leave out of a load: with tied embeddings, a ``lm_head.weight`` stored beside the
    embedding is the same parameter, so it is left out when equal to it, and a ValueError when it differs
    (transformers then unties the two; an engine serving them tied cannot)."""
    pair = weight_map.tied_pair(names)
    if pair is None:
        return frozenset()
    head, embed = pair
    values = dict(iter_named(model_path, pair))
    if not equal_values(values[head], values[embed]):
        raise ValueError(f"checkpoint {model_path!r} has tie_word_embeddings=true but a lm_head.weight that differs "
                         "from model.embed_tokens.weight (transformers unties them): set tie_word_embeddings to "
                         "false in its config.json, or save the tied weights")
    return frozenset({head})


def iter_named(model_path: str, wanted: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for the checkpoint's tensors named in ``wanted`` only."""
    return _iter_tensors(model_path, lambda name: name in wanted)


def _iter_tensors(model_path: str, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in _safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)


def _safetensors_files(model_path: str) -> list[str]:
    """The checkpoint's weight files in transformers' order of preference: ``model.safetensors``, else the
    files ``model.safetensors.index.json`` names, else every ``*.safetensors`` (a tensor in two of them is
    refused by ``read_safetensors_shapes``)."""
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory")
    single = os.path.join(model_path, "model.safetensors")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_path, name) for name in files]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_path!r}")
    return files


def read_safetensors_shapes(model_path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype name, shape)} from the checkpoint's safetensors headers, without reading data."""
    from safetensors import safe_open

    out, where = {}, {}
    for path in _safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in where:
                    raise ValueError(f"tensor {name!r} is in two weight files of {model_path!r}: "
                                     f"{os.path.basename(where[name])} and {os.path.basename(path)}")
                where[name] = path
                meta = f.get_slice(name)
                out[name] = (_SAFETENSORS_DTYPES.get(meta.get_dtype(), meta.get_dtype()), tuple(meta.get_shape()))
    return out


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def load_weights(weight_map: HFWeightMap, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Load every tensor through the name map; ValueError if a parameter is missing. Returns the count."""
    seen: set[str] = set()
    for name, tensor in tensors:
        if weight_map.is_ignored(name):
            continue
        weight_map.load(name, tensor)
        seen.update(weight_map.covered(name))
    missing = [n for n in weight_map.shapes if n not in seen]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameters, e.g. {missing[:3]}")
    return len(seen)


def build_model(cfg: ModelConfig, model_path: str | None, max_positions: int, tp: TPGroup,
                dtype: torch.dtype, device: Any, load_format: str = "auto", seed: int = 0, fused: bool = False,
                quant: str | None = None) -> tuple[LlamaForCausalLM, HFWeightMap]:
    """The model with its weights loaded from ``model_path``; ``load_format="dummy"`` fills them with
    seeded random values instead (vLLM's dummy format, for benchmarks); no path leaves them unset."""
    model = LlamaForCausalLM(cfg, max_positions, tp, dtype, device, fused, quant).eval()
    weight_map = HFWeightMap(model, cfg)
    if load_format == "dummy":
        init_dummy_weights(weight_map, seed)
    elif model_path is not None:
        names = read_safetensors_shapes(model_path)  # headers: a tensor in two files is refused here
        load_weights(weight_map, iter_safetensors(model_path, tied_head_skip(model_path, names, weight_map)))
    return model, weight_map


def init_dummy_weights(weight_map: HFWeightMap, seed: int) -> None:
    """Norm weights 1, everything else N(0, 0.02), from a generator seeded per rank (an fp8 weight:
    those values in its model dtype, quantized; its ``weight_scale`` follows from them)."""
    with torch.no_grad():
        for name, param in weight_map.params.items():
            if "norm" in name:
                param.fill_(1.0)
                continue
            if name.endswith(".weight_scale"):
                continue
            gen = torch.Generator(device=param.device).manual_seed(seed + sum(map(ord, name)))
            if getattr(param, "scale", None) is None:
                param.normal_(0.0, 0.02, generator=gen)
                continue
            from rollout.layers.quantization import quantize_fp8_rows

            values = torch.empty(param.shape, dtype=param.dequant_dtype, device=param.device)
            q, scale = quantize_fp8_rows(values.normal_(0.0, 0.02, generator=gen))
            param.copy_(q)
            param.scale.copy_(scale)
