"""One engine-handle protocol: the weight-update and control calls that every way of reaching an engine has,
with the same names and signatures, so that a trainer (``weight_sync.WeightSender``,
``trainer_adapters.broadcast_to_engines``) drives any of them:

- ``rollout.Engine`` (in this process), ``rollout.client.EngineClient`` (over HTTP),
  ``weight_sync.remote.RemoteEngine`` (an engine in another process, over a pipe) and
  ``trainer_adapters.ActorEngine`` (a Ray actor, or ``LocalActor``).

Calls that take part in a collective with the trainer (joining a group, receiving a broadcast) take
``async_op``: with ``async_op=True`` they return at once with a ``concurrent.futures.Future`` (the
trainer then broadcasts), else they block for the result. ``tests/test_engine_handle.py`` checks every
implementation against ``EngineHandle``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class EngineHandle(Protocol):
    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "nccl",
                           timeout: float | None = None, async_op: bool = False) -> Any: ...

    def destroy_process_group(self, group_name: str = "weight_update_group", async_op: bool = False) -> Any: ...

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False,
                      async_op: bool = False) -> Any: ...

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        check_finite: bool = False, async_op: bool = False) -> Any: ...

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 async_op: bool = False, *, load_format: str | None = None) -> Any: ...

    def rollback_weights(self) -> Any: ...

    def update_weight_version(self, weight_version: str) -> str: ...

    def get_weight_version(self) -> str: ...

    def get_weight_state(self) -> dict[str, Any]: ...

    def weights_fingerprint(self) -> str: ...

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]: ...

    def flush_cache(self) -> bool: ...

    def pause_generation(self, mode: str = "abort") -> Any: ...

    def continue_generation(self) -> Any: ...

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]: ...

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]: ...

    def sleep(self, level: int = 1) -> dict[str, Any]: ...

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]: ...

    def is_sleeping(self) -> bool: ...


class ForwardingEngineHandle:
    """``EngineHandle`` for a proxy: every call becomes ``self._call(method, async_op, **arguments)``,
    which the subclass sends (a pipe, a Ray actor) and answers with a Future (``async_op``) or the result."""

    def _call(self, method: str, async_op: bool, **kwargs: Any) -> Any:
        raise NotImplementedError

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str = "weight_update_group", backend: str = "nccl",
                           timeout: float | None = None, async_op: bool = False) -> Any:
        return self._call("init_process_group", async_op, master_address=master_address, master_port=master_port,
                          rank_offset=rank_offset, world_size=world_size, group_name=group_name, backend=backend,
                          timeout=timeout)

    def destroy_process_group(self, group_name: str = "weight_update_group", async_op: bool = False) -> Any:
        return self._call("destroy_process_group", async_op, group_name=group_name)

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False,
                      async_op: bool = False) -> Any:
        return self._call("update_weight", async_op, name=name, dtype=dtype, shape=shape, empty_cache=empty_cache)

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[Any],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        weight_version: str | None = None, load_format: str | None = None,
                                        check_finite: bool = False, async_op: bool = False) -> Any:
        return self._call("update_weights_from_distributed", async_op, names=names, dtypes=dtypes, shapes=shapes,
                          group_name=group_name, flush_cache=flush_cache, weight_version=weight_version,
                          load_format=load_format, check_finite=check_finite)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None,
                                 async_op: bool = False, *, load_format: str | None = None) -> Any:
        return self._call("update_weights_from_disk", async_op, model_path=model_path, weight_version=weight_version,
                          load_format=load_format)

    def rollback_weights(self) -> Any:
        return self._call("rollback_weights", False)

    def update_weight_version(self, weight_version: str) -> str:
        return self._call("update_weight_version", False, weight_version=weight_version)

    def get_weight_version(self) -> str:
        return self._call("get_weight_version", False)

    def get_weight_state(self) -> dict[str, Any]:
        return self._call("get_weight_state", False)

    def weights_fingerprint(self) -> str:
        return self._call("weights_fingerprint", False)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[Any]:
        return self._call("get_weights_by_name", False, name=name, truncate_size=truncate_size)

    def flush_cache(self) -> bool:
        return self._call("flush_cache", False)

    def pause_generation(self, mode: str = "abort") -> Any:
        return self._call("pause_generation", False, mode=mode)

    def continue_generation(self) -> Any:
        return self._call("continue_generation", False)

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("release_memory_occupation", False, tags=tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("resume_memory_occupation", False, tags=tags)

    def sleep(self, level: int = 1) -> dict[str, Any]:
        return self._call("sleep", False, level=level)

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        return self._call("wake_up", False, tags=tags)

    def is_sleeping(self) -> bool:
        return self._call("is_sleeping", False)
