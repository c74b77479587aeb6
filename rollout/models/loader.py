"""Build a model from a local Hugging Face directory and load its safetensors weights."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Iterator

import torch

from rollout.config import ModelConfig
from rollout.distributed import TPGroup
from rollout.models.llama import LlamaForCausalLM
from rollout.weights.weight_map import HFWeightMap


def iter_safetensors(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the checkpoint (sharded index or single/multiple files)."""
    from safetensors import safe_open

    for path in _safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _safetensors_files(model_path: str) -> list[str]:
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory")
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
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

    out = {}
    for path in _safetensors_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
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
        load_weights(weight_map, iter_safetensors(model_path))
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
