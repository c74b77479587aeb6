"""Scheduler control calls for live weight updates (SGLang's SchedulerUpdateWeightsMixin shape).

Every TP rank runs these in lockstep. Calls that change weights wait in ``pending_updates`` until no
request is in flight (or generation is paused), while new requests are held; then they run in order.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from rollout.io_struct import FinishReason
from rollout.mem_cache.radix_cache import RadixCache
from rollout.weight_updater import TransferError, UpdateResult, parse_specs, unflatten

logger = logging.getLogger(__name__)

WEIGHT_OPS = frozenset({"update_weight", "update_weights_from_distributed", "update_weights_from_disk",
                        "update_weights_from_tensor", "rollback_weights"})
PAUSE_MODES = ("abort", "retract", "in_place")


class WeightUpdateMixin:
    """Needs from the scheduler: updater, tree, running, waiting, chunked, paused, weight_version, ..."""

    # ---- gating -------------------------------------------------------------------------------

    @property
    def admitting(self) -> bool:
        """New requests may start: no pending update, not paused, weights complete and consistent."""
        return not self.pending_updates and self.paused is None and self.updater.state == "consistent"

    def run_ready_updates(self) -> None:
        """Run queued weight updates once nothing is in flight (or generation is paused)."""
        if not self.pending_updates:
            return
        in_flight = self.running or self.chunked is not None or self.in_flight is not None  # (a prefill's)
        if in_flight and self.paused != "in_place":
            return
        self.sync()  # no forward may read the weights while they change
        while self.pending_updates:
            self.reply(self.run_control(self.pending_updates.popleft()))

    def check_weight_state(self) -> None:
        """Fail queued requests while the weights are inconsistent."""
        if self.updater.state == "inconsistent":
            for req in list(self.waiting):
                self.waiting.remove(req)
                self.finish(req, FinishReason("abort", message=self.refusal(), error_type="RuntimeError"))

    def expire_session(self) -> None:
        """The open update session's trainer went silent for its group timeout: the weights are a mix, so
        mark them inconsistent, fail the held requests with that reason, and tear down its group."""
        up = self.updater
        if not up.session:
            return
        group_name = up.session_group
        timeout = up.group_timeouts.get(group_name or "", 600.0)
        self._drop_group(group_name)
        up.mark_inconsistent(f"the update session was abandoned: no update call on group {group_name!r} within its "
                             f"timeout of {timeout:g} s (the trainer stopped or died)")
        logger.error("%s", up.inconsistent)
        self.check_weight_state()

    def refusal(self) -> str:
        return f"the engine refuses to generate: {self.updater.inconsistent}"

    # ---- groups -------------------------------------------------------------------------------

    def handle_init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str = "nccl", timeout: float | None = None) -> bool:
        self.updater.init_group(master_address, master_port, rank_offset, world_size, group_name, backend, timeout)
        return True

    def handle_destroy_process_group(self, group_name: str) -> bool:
        self.updater.destroy_group(group_name)
        return True

    # ---- updates ------------------------------------------------------------------------------

    def handle_update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False,
                             group_name: str | None = None) -> dict[str, Any]:
        """OpenRLHF's per-tensor call; the sender is already broadcasting, so always receive."""
        return self.handle_update_weights_from_distributed([name], [dtype], [shape], group_name,
                                                           flush_cache=empty_cache)

    def handle_update_weights_from_distributed(self, names: Any, dtypes: Any, shapes: Any, group_name: str | None,
                                               flush_cache: bool = True, weight_version: str | None = None,
                                               load_format: str | None = None, check_finite: bool = False
                                               ) -> dict[str, Any]:
        start = time.perf_counter()
        if load_format not in (None, "flattened_bucket", "auto"):
            raise ValueError(f"unsupported load_format {load_format!r} (use None or 'flattened_bucket')")
        specs = parse_specs(names, dtypes, shapes)
        group_name, group = self.updater.group(group_name)
        problems = self.updater.problems(specs)
        t_recv = time.perf_counter()
        try:
            tensors = self.updater.receive(specs, group, load_format == "flattened_bucket")
        except TransferError as e:
            self._transfer_failed(group_name, str(e))
            raise
        self.timing = {"validate_s": t_recv - start, "receive_s": time.perf_counter() - t_recv}
        return self._apply(tensors, problems, start, flush_cache, weight_version, check_finite, group_name)

    def handle_update_weights_from_tensor(self, specs: list[tuple[str, Any, list[int]]], payload: Any,
                                          flush_cache: bool = True, weight_version: str | None = None,
                                          check_finite: bool = False) -> dict[str, Any]:
        """Colocated trainer: tensors shared by handle (CUDA IPC) or through a shared-memory buffer."""
        start = time.perf_counter()
        parsed = parse_specs([s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs])
        problems = self.updater.problems(parsed)
        tensors = _open_shared(parsed, payload)
        return self._apply(tensors, problems, start, flush_cache, weight_version, check_finite, None)

    def handle_update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> dict[str, Any]:
        """Reload every parameter from a checkpoint directory (checked against its headers first)."""
        from rollout.models.loader import iter_safetensors, read_safetensors_shapes

        start = time.perf_counter()
        shapes = read_safetensors_shapes(model_path)
        wm = self.updater.weight_map
        names = [n for n in shapes if not wm.is_ignored(n)]
        problems = self.updater.problems(parse_specs(names, [shapes[n][0] for n in names],
                                                     [list(shapes[n][1]) for n in names]))
        missing = sorted(set(wm.shapes) - {wm.canonical(n) for n in names})
        if missing:
            problems.append(f"checkpoint {model_path!r} lacks {len(missing)} parameters, e.g. {missing[:3]}")
        if problems:
            raise ValueError("; ".join(problems[:5]))
        nbytes = 0
        try:
            for name, tensor in iter_safetensors(model_path):
                if not wm.is_ignored(name):
                    self.updater.load([(name, tensor)])
                    nbytes += tensor.numel() * tensor.element_size()
        except Exception as e:  # noqa: BLE001 - a read failing half way leaves mixed weights
            self.updater.mark_inconsistent(f"reloading from {model_path!r} failed: {e}")
            raise RuntimeError(self.updater.inconsistent) from e
        return self._finish(start, len(names), nbytes, self.updater.end_session(explicit=True), weight_version)

    def handle_rollback_weights(self) -> dict[str, Any]:
        start = time.perf_counter()
        self.updater.rollback()
        self.weight_version = self.version_before_session or self.weight_version
        self._invalidate_cache()
        return {"weight_version": self.weight_version, "seconds": time.perf_counter() - start}

    def handle_benchmark_receive(self, nbytes: int, num_chunks: int, group_name: str | None = None) -> float:
        """Receive ``num_chunks`` raw broadcasts of ``nbytes`` each and discard them (the transport's
        ceiling for ``weight_sync.bench``); returns the seconds this rank spent."""
        _, group = self.updater.group(group_name)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.runner.device)
        start = time.perf_counter()
        for _ in range(num_chunks):
            torch.distributed.broadcast(buf, src=0, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        return time.perf_counter() - start

    # ---- control ------------------------------------------------------------------------------

    def handle_pause_generation(self, mode: str = "abort") -> bool:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            for req in list(self.waiting) + list(self.running) + ([self.chunked] if self.chunked else []):
                self.abort(req.rid)
        elif mode == "retract":
            while self.running:
                self.retract(self.running.pop())
            if self.chunked is not None:
                self.retract(self.chunked)
                self.chunked = None
        return True

    def handle_continue_generation(self) -> bool:
        self.paused = None
        return True

    def handle_flush_cache(self) -> bool:
        """Drop the prefix cache (False while running requests hold entries); ends a per-tensor session."""
        if self.updater.end_session(explicit=True):
            self._complete(None)
            return True
        return self.tree.flush()

    def handle_update_weight_version(self, weight_version: str) -> str:
        self.weight_version = str(weight_version)
        return self.weight_version

    def handle_get_weight_state(self) -> dict[str, Any]:
        up = self.updater
        return {"state": up.state, "reason": up.inconsistent, "updated": len(up.session),
                "total": len(up.weight_map.shapes), "weight_version": self.weight_version,
                "groups": sorted(up.groups), "paused": self.paused}

    def handle_get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        from rollout.weight_updater import assemble

        wm = self.updater.weight_map
        wm.check(name, wm.shapes.get(wm.canonical(name), ()))
        parts = self.tp.gather_object(self.updater.local_tensor(name))
        if self.tp.rank != 0:
            return []
        full = assemble(parts, wm.shapes[wm.canonical(name)])
        return full.float().flatten()[:truncate_size].tolist()

    def handle_weights_fingerprint(self) -> str:
        from rollout.weight_updater import combine_fingerprint

        parts = self.tp.gather_object(self.updater.fingerprint_parts())
        if self.tp.rank != 0:
            return ""
        return combine_fingerprint(parts, self.updater.weight_map.fingerprint_shapes)

    # ---- internals ----------------------------------------------------------------------------

    def _apply(self, tensors: list[tuple[str, torch.Tensor]], problems: list[str], start: float, flush_cache: bool,
               weight_version: str | None, check_finite: bool, group_name: str | None) -> dict[str, Any]:
        """Reject (weights untouched) or load, then close the session if it is complete."""
        if problems:
            raise ValueError("; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
        if check_finite:
            bad = self.updater.nonfinite(tensors)
            if bad:
                raise ValueError(f"non-finite values in {bad[:5]}")
        if not self.updater.session:
            self.version_before_session = self.weight_version
        t_load = time.perf_counter()
        self.updater.load(tensors)
        self.timing["load_s"] = time.perf_counter() - t_load
        self.updater.touch_deadline(group_name)
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        done = self.updater.end_session(explicit=flush_cache or weight_version is not None)
        return self._finish(start, len(tensors), nbytes, done, weight_version)

    def _finish(self, start: float, loaded: int, nbytes: int, complete: bool, weight_version: str | None
                ) -> dict[str, Any]:
        t_flush = time.perf_counter()
        if complete:
            self._complete(weight_version)
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
        self.timing["flush_s"] = time.perf_counter() - t_flush
        result = UpdateResult(loaded, nbytes, time.perf_counter() - start, complete, self.weight_version)
        return {**result.__dict__, **self.timing}

    def _complete(self, weight_version: str | None) -> None:
        """Weights are whole again: drop stale KV and name the new version."""
        self.updates_completed += 1
        self.weight_version = str(weight_version) if weight_version is not None else _next_version(self.weight_version)
        self._invalidate_cache()

    def _invalidate_cache(self) -> None:
        if self.tree.flush():
            return
        stale = self.tree  # running requests (paused in place) still hold entries: retire the whole tree
        stale.evict(stale.evictable_size)
        self.stale_trees.append(stale)
        self.tree = RadixCache(self.allocator.free, disabled=self.config.disable_radix_cache,
                               page_size=self.config.page_size)

    def _drop_group(self, group_name: str | None) -> None:
        """Forget and tear down a group whose trainer is gone (nothing more can travel on it)."""
        from weight_sync.group import destroy_process_group

        group = self.updater.groups.pop(group_name, None)
        self.updater.group_timeouts.pop(group_name, None)
        if self.updater.last_group == group_name:
            self.updater.last_group = next(iter(self.updater.groups), None)
        if group is not None:
            destroy_process_group(group)

    def _transfer_failed(self, group_name: str, message: str) -> None:
        self._drop_group(group_name)
        if self.updater.session:
            self.updater.mark_inconsistent(f"a transfer failed mid-update ({message})")
        logger.error("weight transfer on group %r failed: %s", group_name, message)


def _next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"


def _open_shared(specs: list[Any], payload: Any) -> list[tuple[str, torch.Tensor]]:
    """Tensors from a colocated sender: ("cuda_ipc", [rebuild args]) or ("shm", name)."""
    kind, data = payload
    if kind == "cuda_ipc":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return [(spec.name, rebuild_cuda_tensor(*args)) for spec, args in zip(specs, data)]
    if kind == "shm":
        from multiprocessing import resource_tracker, shared_memory

        shm = shared_memory.SharedMemory(name=data, create=False)
        resource_tracker.unregister(shm._name, "shared_memory")  # the sender owns and unlinks it
        try:
            flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=sum(s.nbytes for s in specs))
            tensors = [(n, t.clone()) for n, t in unflatten(flat, specs)]
            del flat  # release the buffer export before closing the mapping
            return tensors
        finally:
            shm.close()
    raise ValueError(f"unknown shared tensor payload {kind!r}")

