"""``create_engines``: place ``EngineActor``s on a Ray cluster with a placement group (OpenRLHF's
``create_vllm_engines``).

Bundles are packed (``PACK``: as few nodes as possible, spilling to more nodes when one is full). With
TP=1 there is one bundle per GPU, one engine each. An engine with TP > 1 runs its TP ranks as
subprocesses of its actor, so they must share a node: its bundle holds ``tensor_parallel_size`` GPUs.
Without GPUs in the cluster the bundles are CPU bundles and the engines run on CPU. Engine ``i`` gets
seed ``seed + i``.
"""

from __future__ import annotations

from typing import Any

from trainer_adapters.ray_actor import EngineActor

CONTROL_GROUP = "control"


def ray_engine_actor_class(control_concurrency: int = 4) -> Any:
    """``ray.remote(EngineActor)`` whose ``CONTROL_METHODS`` run in their own concurrency group, so they
    answer while a ``generate`` or a weight update holds the default group (which runs one call at a
    time, in submission order: weight-update announcements must not be reordered)."""
    import ray

    def control(name: str) -> Any:
        base = getattr(EngineActor, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return base(self, *args, **kwargs)

        method.__name__, method.__qualname__, method.__doc__ = name, f"EngineActor.{name}", base.__doc__
        return ray.method(concurrency_group=CONTROL_GROUP)(method)

    namespace = {name: control(name) for name in EngineActor.CONTROL_METHODS}
    namespace["__module__"] = __name__
    cls = type("EngineActor", (EngineActor,), namespace)
    return ray.remote(concurrency_groups={CONTROL_GROUP: control_concurrency})(cls)


def create_engines(num_engines: int, tensor_parallel_size: int, model_path: str, seed: int, *,
                   shared_pg: Any = None, use_gpu: bool | None = None, num_cpus_per_engine: float = 1,
                   num_gpus_per_actor: float | None = None, num_cpus_per_actor: float | None = None,
                   weight_sync_timeout: float | None = None, wait_ready: bool = True,
                   **engine_options: Any) -> list[Any]:
    """Start ``num_engines`` engine actors with ``tensor_parallel_size`` each; returns their handles.

    ``engine_options`` are ``Engine`` options or vLLM engine arguments (``dtype``, ``max_model_len``,
    ``gpu_memory_utilization``, ``enable_prefix_caching``, ``enable_sleep_mode``, ...).

    Colocated with the trainer (OpenRLHF's hybrid engine, ``docs/colocation.md``): ``shared_pg`` places engine
    ``i`` in bundle ``i`` of the trainer's placement group instead of a new one, and ``num_gpus_per_actor`` /
    ``num_cpus_per_actor`` (default: the whole bundle) below the bundle's let the trainer's actor take the
    rest, as OpenRLHF does with 0.2; pass ``enable_sleep_mode=True`` so the engine can ``sleep`` while the
    trainer runs. ``use_gpu`` defaults to whether the cluster has GPUs. With ``wait_ready`` the call returns
    once every engine has loaded its model. Needs ``ray.init()`` first.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if num_engines < 1 or tensor_parallel_size < 1:
        raise ValueError("num_engines and tensor_parallel_size must be >= 1")
    if not ray.is_initialized():
        raise ValueError("create_engines needs a Ray cluster: call ray.init() first")
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    tp = tensor_parallel_size
    if use_gpu:
        bundle = {"GPU": tp, "CPU": tp}
    else:
        bundle = {"CPU": num_cpus_per_engine * tp}
    if shared_pg is None:
        shared_pg = placement_group([dict(bundle) for _ in range(num_engines)], strategy="PACK")
        ray.get(shared_pg.ready())
    engine_options.setdefault("device", "cuda" if use_gpu else "cpu")
    actor_cls = ray_engine_actor_class()
    engines = []
    for i in range(num_engines):
        strategy = PlacementGroupSchedulingStrategy(placement_group=shared_pg, placement_group_bundle_index=i,
                                                    placement_group_capture_child_tasks=True)
        num_gpus = bundle.get("GPU", 0) if num_gpus_per_actor is None else num_gpus_per_actor
        num_cpus = bundle["CPU"] if num_cpus_per_actor is None else num_cpus_per_actor
        engines.append(actor_cls.options(num_cpus=num_cpus, num_gpus=num_gpus,
                                         scheduling_strategy=strategy).remote(
            model_path, tensor_parallel_size=tp, seed=seed + i, weight_sync_timeout=weight_sync_timeout,
            **engine_options))
    if wait_ready:
        ray.get([e.ready.remote() for e in engines])
    return engines
