"""Trainer integrations: an OpenRLHF-style engine actor for Ray, and one-call weight senders for the
common training wrappers (plain module / transformers, Accelerate, FSDP2, DeepSpeed ZeRO-3).

Ray, DeepSpeed and Accelerate are imported only where used (the ``train`` extra installs them).
"""

from trainer_adapters.cuda_ipc import get_physical_gpu_id, ipc_handles, push_colocated, push_cuda_ipc
from trainer_adapters.handles import ActorEngine, LocalActor, as_engine, get
from trainer_adapters.names import hf_name, unwrap_model
from trainer_adapters.placement import create_engines, ray_engine_actor_class
from trainer_adapters.ray_actor import EngineActor, engine_options, to_sampling_params
from trainer_adapters.senders import (BACKENDS, broadcast_to_engines, full_named_parameters, param_source,
                                      trainer_fingerprint)
from trainer_adapters.zero3 import init_deepspeed_distributed

__all__ = ["EngineActor", "create_engines", "ray_engine_actor_class", "engine_options", "to_sampling_params",
           "broadcast_to_engines", "param_source", "full_named_parameters", "trainer_fingerprint", "BACKENDS",
           "ActorEngine", "LocalActor", "as_engine", "get", "hf_name", "unwrap_model", "get_physical_gpu_id",
           "ipc_handles", "push_cuda_ipc", "push_colocated", "init_deepspeed_distributed"]
