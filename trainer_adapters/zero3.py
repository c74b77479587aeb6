"""DeepSpeed: ZeRO-3 partitions every parameter over the trainer ranks.

A partitioned parameter has ``ds_id`` and its full shape in ``ds_shape``; its ``.data`` is a local
fragment until ``deepspeed.zero.GatheredParameters([...])`` all-gathers it on every rank. The source
gathers one bucket at a time (every rank enters the context in step), the sending rank broadcasts
while the bucket is gathered, and the context frees it again. Under ZeRO-1/2 the parameters are
whole on every rank and nothing is gathered.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from trainer_adapters.gather import ParamSource


def is_deepspeed(model: Any) -> bool:
    """A ``DeepSpeedEngine``, or a module with ZeRO-3 partitioned parameters."""
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(model).__mro__):
        return True
    return any(hasattr(p, "ds_id") for p in model.parameters())


def is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id") and hasattr(p, "ds_shape")


class ZeRO3Source(ParamSource):
    """Parameters of a DeepSpeed model; full shapes from ``ds_shape``, gathers per bucket."""

    kind = "deepspeed"

    def full_shape(self, p: torch.Tensor) -> torch.Size:
        return torch.Size(p.ds_shape) if is_partitioned(p) else p.shape

    def gathered(self, plan: list[list[int]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in plan:
            params = [self.params[i][1] for i in bucket]
            partitioned = [p for p in params if is_partitioned(p)]
            with _gathered(partitioned):
                yield [(self.params[i][0], p.data.detach()) for i, p in zip(bucket, params)]


def _gathered(params: list[torch.Tensor]) -> Any:
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def init_deepspeed_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:
    """``deepspeed.init_distributed(dist_backend, **kwargs)``; on a machine without a GPU it first turns
    off DeepSpeed's shared-memory all-reduce kernel. That kernel serves only DeepSpeed-inference's
    ``inference_all_reduce`` (training collectives go through torch.distributed), and building it is a
    C++ compile of about a minute the first time on a small CPU machine."""
    import deepspeed
    import deepspeed.ops

    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=dist_backend, **kwargs)
