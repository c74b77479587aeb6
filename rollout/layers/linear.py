"""Tensor-parallel linear layers whose parameters load (and expose) Hugging Face tensors in place.

Every parameter carries two attributes that the checkpoint loader, the weight-update paths and the
fingerprint all use:

- ``shard_view(param, shard_id) -> (view, ShardSpec)``: the slice of ``param`` that holds this rank's
  part of one Hugging Face tensor, and where that part sits in the full tensor;
- ``weight_loader(param, full_tensor, shard_id=None)``: copy this rank's part of ``full_tensor`` into
  that view (``copy_``, never rebinding, so CUDA graphs and IPC handles stay valid).

With ``quant="fp8"`` a layer's ``weight`` is float8_e4m3fn and a float32 ``weight_scale`` [local rows]
sits beside it (``weight.scale`` points to it); the loader quantizes the full HF tensor's rows as it
copies (``rollout.layers.quantization``), and ``forward`` runs ``fp8_linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollout.config import QUANTIZATION_METHODS
from rollout.distributed import TPGroup
from rollout.layers.split_k import SPLIT_K_MAX_ROWS, SplitKPartials, split_k_matmul, split_k_supported


@dataclass(frozen=True)
class ShardSpec:
    """Where a rank's view sits in the full HF tensor: ``full.narrow(dim, start, length)``.

    ``dim is None`` means the rank holds the whole tensor (replicated).
    """

    dim: int | None = None
    start: int = 0
    length: int = 0

    def take(self, full: torch.Tensor) -> torch.Tensor:
        return full if self.dim is None else full.narrow(self.dim, self.start, self.length)


ShardViewFn = Callable[[nn.Parameter, Any], "tuple[torch.Tensor, ShardSpec]"]


def load_shard(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
    """The shared ``weight_loader``: copy this rank's part of ``full`` into ``param`` in place."""
    view, spec = param.shard_view(param, shard_id)
    part = spec.take(full)
    if part.shape != view.shape:
        raise ValueError(f"shape mismatch: expected {tuple(view.shape)} for this shard, got {tuple(part.shape)}")
    view.copy_(part)


def load_fp8_shard(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
    """``weight_loader`` of an fp8 weight: quantize this rank's part of ``full`` with its full rows' scales."""
    from rollout.layers.quantization import fp8_row_scales, quantize_fp8_rows

    view, spec = param.shard_view(param, shard_id)
    scale_view, _ = scale_shard(param, shard_id)
    part = spec.take(full)
    if part.shape != view.shape:
        raise ValueError(f"shape mismatch: expected {tuple(view.shape)} for this shard, got {tuple(part.shape)}")
    part = part.to(view.device)
    scale = fp8_row_scales(full) if spec.dim == 1 else None  # a column slice: its full rows' scales
    q, scale = quantize_fp8_rows(part, None if scale is None else scale.to(view.device))
    view.copy_(q)
    scale_view.copy_(scale)


def scale_shard(param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
    """(this rank's view of an fp8 weight's row scales, its ShardSpec in the full [rows] scale vector):
    the rows the weight view holds; all of them when the weight is split by columns."""
    view, spec = param.shard_view(param.scale, shard_id)
    return (view, spec) if spec.dim == 0 else (param.scale.data, ShardSpec())


def attach(param: nn.Parameter, shard_view: ShardViewFn, scale: nn.Parameter | None = None) -> nn.Parameter:
    param.shard_view = shard_view
    param.weight_loader = load_shard if scale is None else load_fp8_shard
    param.scale = scale
    return param


def replicated_view(param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
    return param.data, ShardSpec()


def _split(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} ({n}) is not divisible by tp_size ({tp.size})")
    return n // tp.size


def _new_param(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _QuantizableLinear(nn.Module):
    """The weight (model dtype, or fp8 + ``weight_scale`` under ``quant="fp8"``) and its matmul."""

    def _make_weight(self, shape: tuple[int, int], dtype: torch.dtype, device: Any, quant: str | None,
                     shard_view: ShardViewFn) -> None:
        if quant is not None and quant not in QUANTIZATION_METHODS:
            raise ValueError(f"unsupported quantization {quant!r}")
        self.quant = quant
        if quant is None:
            self.weight = attach(_new_param(shape, dtype, device), shard_view)
            return
        from rollout.layers.quantization import FP8_DTYPE

        self.weight_scale = _new_param((shape[0],), torch.float32, device)
        self.weight = attach(_new_param(shape, FP8_DTYPE, device), shard_view, self.weight_scale)
        self.weight.dequant_dtype = dtype

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quant is None:
            return F.linear(x, self.weight, bias)
        from rollout.layers.quantization import fp8_linear

        return fp8_linear(x, self.weight, self.weight_scale, bias)


class ReplicatedLinear(_QuantizableLinear):
    """y = x W^T + b with the whole weight on every rank (SGLang's name; a MoE router, ``gate``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: Any = None) -> None:
        super().__init__()
        self._make_weight((out_features, in_features), dtype, device, None, replicated_view)
        self.bias = attach(_new_param((out_features,), dtype, device), replicated_view) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(_QuantizableLinear):
    """y = x W^T + b with W's output rows split across ranks; the output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: Any = None, quant: str | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.out_local = _split(out_features, tp, "output size")
        self._make_weight((self.out_local, in_features), dtype, device, quant, self._row_view)
        self.bias = attach(_new_param((self.out_local,), dtype, device), self._row_view) if bias else None

    def _row_view(self, param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
        return param.data, ShardSpec(0, self.tp.rank * self.out_local, self.out_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (``gate_up_proj``); shard_id = 0, 1, ..."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: Any = None, quant: str | None = None) -> None:
        self.local_sizes = [_split(n, tp, "output size") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype, device, quant)

    def _row_view(self, param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
        if shard_id is None:
            raise ValueError("a merged column-parallel parameter needs a shard id")
        offset = sum(self.local_sizes[:shard_id])
        size = self.local_sizes[shard_id]
        return param.data.narrow(0, offset, size), ShardSpec(0, self.tp.rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when tp_size > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup, dtype: torch.dtype, device: Any = None, quant: str | None = None) -> None:
        self.head_dim = head_dim
        self.num_heads = _split(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = _split(num_kv_heads, tp, "num_key_value_heads")
            self.kv_shard = tp.rank
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"tp_size ({tp.size}) must divide or be a multiple of num_key_value_heads"
                                 f" ({num_kv_heads})")
            self.num_kv_heads = 1
            self.kv_shard = tp.rank // (tp.size // num_kv_heads)
        total_local = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(hidden_size, total_local * tp.size, bias, tp, dtype, device, quant)

    def _row_view(self, param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return param.data.narrow(0, 0, q), ShardSpec(0, self.tp.rank * q, q)
        if shard_id in ("k", "v"):
            offset = q if shard_id == "k" else q + kv
            return param.data.narrow(0, offset, kv), ShardSpec(0, self.kv_shard * kv, kv)
        raise ValueError(f"qkv shard id must be 'q', 'k' or 'v', got {shard_id!r}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv.split([q, kv, kv], dim=-1)


class RowParallelLinear(_QuantizableLinear):
    """y = all_reduce(x_shard W_shard^T) + b with W's input columns split across ranks.

    ``split_k=True`` (its output goes only to a fused add + RMSNorm): on one rank, unquantized, bias-free and
    where ``split_k_supported``, a batch of at most ``SPLIT_K_MAX_ROWS`` rows returns ``SplitKPartials``
    instead of a tensor (``rollout.layers.split_k``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device: Any = None, quant: str | None = None, split_k: bool = False) -> None:
        super().__init__()
        self.tp = tp
        self.in_local = _split(in_features, tp, "input size")
        self._make_weight((out_features, self.in_local), dtype, device, quant, self._col_view)
        self.bias = attach(_new_param((out_features,), dtype, device), replicated_view) if bias else None
        self.split_k = (split_k and tp.size == 1 and quant is None and not bias
                        and split_k_supported(self.in_local, out_features))

    def _col_view(self, param: nn.Parameter, shard_id: Any = None) -> tuple[torch.Tensor, ShardSpec]:
        return param.data, ShardSpec(1, self.tp.rank * self.in_local, self.in_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor | SplitKPartials:
        if self.tp.size == 1:
            if self.split_k and 0 < x.shape[0] <= SPLIT_K_MAX_ROWS and x.is_contiguous():
                return split_k_matmul(x, self.weight)
            return self.matmul(x, self.bias)
        y = self.tp.all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias
