"""``create_engines``: place ``EngineActor``s on a Ray cluster with a placement group (OpenRLHF's
``create_vllm_engines``, whose positional arguments it takes in the same order).

Bundles are packed (``PACK``: as few nodes as possible, spilling to more nodes when one is full). With
TP=1 there is one bundle per GPU, one engine each. An engine with TP > 1 runs its TP ranks as
subprocesses of its actor, so they must share a node: its bundle holds ``tensor_parallel_size`` GPUs.
Without GPUs in the cluster the bundles are CPU bundles and the engines run on CPU. Engine ``i`` gets
seed ``seed + i``. A call that fails kills the actors it started and removes the placement group it made.
"""

from __future__ import annotations

from typing import Any

from trainer_adapters.ray_actor import EngineActor

CONTROL_GROUP = "control"
GENERATE_GROUP = "generate"
PLACEMENT_TIMEOUT = 600.0


def ray_engine_actor_class(control_concurrency: int = 4, generate_concurrency: int = 8) -> Any:
    """``ray.remote(EngineActor)`` whose ``GENERATE_METHODS`` and ``CONTROL_METHODS`` run in concurrency groups
    of their own: a ``generate`` (held while the engine is paused) never delays a weight update, and control
    calls answer while a ``generate`` or a weight update runs. Everything else runs in the default group, one
    call at a time, in submission order (weight-update announcements must not be reordered)."""
    import ray

    def grouped(name: str, group: str) -> Any:
        base = getattr(EngineActor, name)

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return base(self, *args, **kwargs)

        method.__name__, method.__qualname__, method.__doc__ = name, f"EngineActor.{name}", base.__doc__
        return ray.method(concurrency_group=group)(method)

    namespace = {name: grouped(name, GENERATE_GROUP) for name in EngineActor.GENERATE_METHODS}
    namespace.update({name: grouped(name, CONTROL_GROUP) for name in EngineActor.CONTROL_METHODS})
    namespace["__module__"] = __name__
    cls = type("EngineActor", (EngineActor,), namespace)
    return ray.remote(concurrency_groups={CONTROL_GROUP: control_concurrency,
                                          GENERATE_GROUP: generate_concurrency})(cls)


def create_engines(num_engines: int, tensor_parallel_size: int, model_path: str, seed: int,
                   full_determinism: bool = False, enable_prefix_caching: bool | None = None,
                   enforce_eager: bool | None = None, max_model_len: int | None = None, shared_pg: Any = None,
                   gpu_memory_utilization: float | None = None, vllm_enable_sleep: bool = False, *,
                   use_gpu: bool | None = None, num_cpus_per_engine: float = 1,
                   num_gpus_per_actor: float | None = None, num_cpus_per_actor: float | None = None,
                   weight_sync_timeout: float | None = None, wait_ready: bool = True,
                   placement_timeout: float | None = PLACEMENT_TIMEOUT, **engine_options: Any) -> list[Any]:
    """Start ``num_engines`` engine actors with ``tensor_parallel_size`` each; returns their handles.

    The arguments up to ``vllm_enable_sleep`` are OpenRLHF's ``create_vllm_engines`` ones, in its order (None:
    the engine's default; ``full_determinism`` is accepted and ignored, as the vLLM engine argument of that
    name is by ``EngineActor``). ``vllm_enable_sleep=True`` starts the engines with sleep mode and puts
    them to sleep (level 1) once they are up, as OpenRLHF does; the trainer wakes them before generating.
    Pass its later arguments by keyword (``logprobs_mode="processed_logprobs"``, see ``EngineActor``).
    ``engine_options`` are ``Engine`` options or vLLM engine arguments (``dtype``, ``max_num_seqs``,
    ``enable_sleep_mode``, ...).

    Colocated with the trainer (OpenRLHF's hybrid engine, ``docs/colocation.md``): ``shared_pg`` places engine
    ``i`` in bundle ``i`` of the trainer's placement group instead of a new one, and ``num_gpus_per_actor`` /
    ``num_cpus_per_actor`` (default: the whole bundle) below the bundle's let the trainer's actor take the
    rest, as OpenRLHF does with 0.2; pass ``enable_sleep_mode=True`` so the engine can ``sleep`` while the
    trainer runs. ``use_gpu`` defaults to whether the cluster has GPUs. A placement group made here that is
    not ready within ``placement_timeout`` seconds (None: no limit) is a TimeoutError. With ``wait_ready`` the
    call returns once every engine has loaded its model. If anything fails, the actors started are killed and
    the placement group made here is removed before the error is raised. Needs ``ray.init()`` first.
    """
    import ray

    if num_engines < 1 or tensor_parallel_size < 1:
        raise ValueError("num_engines and tensor_parallel_size must be >= 1")
    if not ray.is_initialized():
        raise ValueError("create_engines needs a Ray cluster: call ray.init() first")
    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    tp = tensor_parallel_size
    bundle = {"GPU": tp, "CPU": tp} if use_gpu else {"CPU": num_cpus_per_engine * tp}
    vllm_args = {"enable_prefix_caching": enable_prefix_caching, "enforce_eager": enforce_eager,
                 "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization}
    engine_options.update({k: v for k, v in vllm_args.items() if v is not None})
    if vllm_enable_sleep:
        engine_options["enable_sleep_mode"] = True
    engine_options.setdefault("device", "cuda" if use_gpu else "cpu")
    resources = {"num_gpus": bundle.get("GPU", 0) if num_gpus_per_actor is None else num_gpus_per_actor,
                 "num_cpus": bundle["CPU"] if num_cpus_per_actor is None else num_cpus_per_actor}
    made_pg = shared_pg is None
    pg = _ready_placement_group([dict(bundle) for _ in range(num_engines)], placement_timeout) if made_pg \
        else shared_pg
    actor_cls, engines = ray_engine_actor_class(), []
    try:
        for i in range(num_engines):
            engines.append(_start_engine(actor_cls, pg, i, resources, model_path, tensor_parallel_size=tp,
                                         seed=seed + i, weight_sync_timeout=weight_sync_timeout, **engine_options))
        if wait_ready or vllm_enable_sleep:
            ray.get([e.ready.remote() for e in engines])
        if vllm_enable_sleep:
            ray.get([e.sleep.remote(1) for e in engines])
    except BaseException:
        _clean_up(engines, pg if made_pg else None)
        raise
    return engines


def _ready_placement_group(bundles: list[dict[str, float]], timeout: float | None) -> Any:
    """A ``PACK`` placement group of ``bundles``, once it is ready; removed again if it is not ready within
    ``timeout`` seconds (TimeoutError, naming what it needs and what the cluster has free)."""
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except BaseException as e:
        _clean_up([], pg)
        if isinstance(e, GetTimeoutError):
            raise TimeoutError(f"create_engines: the placement group of {len(bundles)} bundle(s) {bundles[0]} was not "
                               f"ready after {timeout} s; the cluster has {ray.available_resources()} free "
                               "(actors or placement groups still alive hold the rest)") from None
        raise
    return pg


def _start_engine(actor_cls: Any, pg: Any, index: int, resources: dict[str, float], model_path: str,
                  **options: Any) -> Any:
    """An engine actor in bundle ``index`` of ``pg`` (its TP subprocesses captured by the group too)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=True)
    return actor_cls.options(scheduling_strategy=strategy, **resources).remote(model_path, **options)


def _clean_up(engines: list[Any], pg: Any) -> None:
    """Kill ``engines`` and remove ``pg`` (if given): what a failed ``create_engines`` started."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for engine in engines:
        try:
            ray.kill(engine)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if pg is not None:
        remove_placement_group(pg)
