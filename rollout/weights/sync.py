"""``WeightSync``: the scheduler's weight-update component (SGLang's SchedulerUpdateWeightsMixin, as a
component with explicit dependencies instead of a mixin).

Every TP rank runs these handlers in lockstep, each with the typed request from ``rollout.io_struct``. The
scheduler runs the ``WeightUpdateReq`` ones only when no request is in flight (or generation is paused in
place), so no forward reads weights while they change. A completed update drops the KV computed by the old
weights (``KVCacheManager.invalidate``) and names the new ``weight_version``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

import torch

from rollout.config import ModelConfig
from rollout.distributed import TPGroup
from rollout.io_struct import (BenchmarkReceiveReq, DestroyProcessGroupReq, FlushCacheReq, GetWeightsByNameReq,
                               GetWeightVersionReq, InitProcessGroupReq, RollbackWeightsReq, UpdateWeightReq,
                               UpdateWeightsFromDiskReq, UpdateWeightsFromDistributedReq, UpdateWeightsFromTensorReq,
                               UpdateWeightVersionReq, WeightsFingerprintReq)
from rollout.weights.buckets import parse_specs
from rollout.weights.group import WeightGroups
from rollout.weights.ipc_protocol import OpenedIpcTensors
from rollout.weights.shared_tensors import close_shared, open_shared
from rollout.weights.updater import TransferError, WeightUpdater, assemble
from rollout.weights.weight_map import TIED_HEAD, same_bits

logger = logging.getLogger(__name__)

LOAD_FORMATS = (None, "flattened_bucket", "auto")


@dataclass
class UpdateResult:
    """What one update call did (the reply of every update call, with its timings)."""

    loaded: int
    bytes: int
    seconds: float
    complete: bool
    weight_version: str


class WeightSync:
    """Update calls, groups and the weight version of one TP rank.

    ``cache`` is the rank's ``KVCacheManager``: a completed update calls its ``invalidate()``."""

    def __init__(self, updater: WeightUpdater, tp: TPGroup, device: torch.device, cache: Any,
                 weight_version: str, blocked: Callable[[], str | None] = lambda: None) -> None:
        """``blocked()``: why updates cannot load now (the weights' memory is released), else None."""
        self.updater = updater
        self.blocked = blocked
        self.groups = WeightGroups()
        self.tp = tp
        self.device = device
        self.cache = cache
        self.weight_version = weight_version
        self.versions_named = {weight_version}  # every version these weights had: a bump never names another again
        self.version_before_session: str | None = None
        # why the last update call was refused while no session was open (nothing loaded since) and it was not
        # the push's last (flush_cache=False): the calls after it are the rest of that push, so they complete
        # an update only by loading every parameter
        self.refused_before_session: str | None = None
        self.version_named_in_session = False  # update_weight_version named the weights the open session loads
        self.timing: dict[str, float] = {}
        self.opened = OpenedIpcTensors()  # a colocated trainer's storages kept mapped (ipc_protocol)

    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        """The control requests this component runs, by type (part of ``Scheduler.control_handlers``)."""
        return {
            InitProcessGroupReq: self.init_process_group, DestroyProcessGroupReq: self.destroy_process_group,
            UpdateWeightReq: self.update_weight,
            UpdateWeightsFromDistributedReq: self.update_weights_from_distributed,
            UpdateWeightsFromTensorReq: self.update_weights_from_tensor,
            UpdateWeightsFromDiskReq: self.update_weights_from_disk, RollbackWeightsReq: self.rollback_weights,
            BenchmarkReceiveReq: self.benchmark_receive, FlushCacheReq: self.flush_cache,
            UpdateWeightVersionReq: self.update_weight_version, GetWeightVersionReq: self.get_weight_version,
            GetWeightsByNameReq: self.get_weights_by_name, WeightsFingerprintReq: self.weights_fingerprint,
        }

    # ---- groups -------------------------------------------------------------------------------

    def init_process_group(self, req: InitProcessGroupReq) -> bool:
        if req.rank_offset < 1 or req.rank_offset + self.tp.size > req.world_size:
            # checked before the rendezvous (which would block until its timeout): as rank 0 this rank would be the
            # broadcast's source and load its own scratch buffer as the trainer's weights
            raise ValueError(f"rank_offset {req.rank_offset} with world_size {req.world_size}: this engine's "
                             f"{self.tp.size} TP rank(s) join as rank_offset + r, which must lie in 1..world_size-1 "
                             f"(rank 0 of the weight-update group is the trainer, the source of every broadcast)")
        self.groups.join(req.master_address, req.master_port, req.rank_offset + self.tp.rank, req.world_size,
                         req.group_name, req.backend, req.timeout, self.device.type)
        return True

    def destroy_process_group(self, req: DestroyProcessGroupReq) -> bool:
        self.groups.leave(req.group_name)
        return True

    # ---- updates ------------------------------------------------------------------------------

    def update_weight(self, req: UpdateWeightReq) -> dict[str, Any]:
        """OpenRLHF's per-tensor call; the sender is already broadcasting, so always receive."""
        return self._from_distributed([req.name], [req.dtype], [req.shape], req.group_name, req.empty_cache,
                                      None, None, False)

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedReq) -> dict[str, Any]:
        return self._from_distributed(req.names, req.dtypes, req.shapes, req.group_name, req.flush_cache,
                                      req.weight_version, req.load_format, req.check_finite)

    def _from_distributed(self, names: Any, dtypes: Any, shapes: Any, group_name: str | None, flush_cache: bool,
                          weight_version: str | None, load_format: str | None, check_finite: bool) -> dict[str, Any]:
        start = time.perf_counter()
        if load_format not in LOAD_FORMATS:
            raise ValueError(f"unsupported load_format {load_format!r} (use None or 'flattened_bucket')")
        specs = parse_specs(names, dtypes, shapes)
        group_name, group = self.groups.get(group_name)
        problems = self._problems(specs) + _version_problems(weight_version)
        t_recv = time.perf_counter()
        try:
            tensors = self.updater.receive(specs, group, load_format == "flattened_bucket")
        except TransferError as e:
            self._transfer_failed(group_name, str(e))
            raise
        self.timing = {"validate_s": t_recv - start, "receive_s": time.perf_counter() - t_recv}
        return self._apply(tensors, problems, start, flush_cache, weight_version, check_finite, group_name)

    def update_weights_from_tensor(self, req: UpdateWeightsFromTensorReq) -> dict[str, Any]:
        """Colocated trainer: tensors shared by handle (CUDA IPC) or through a shared-memory buffer."""
        start = time.perf_counter()
        try:  # mapped even when refused: each exported CUDA IPC handle is mapped and closed exactly once
            specs = parse_specs([s[0] for s in req.specs], [s[1] for s in req.specs], [s[2] for s in req.specs])
            tensors = open_shared(specs, req.payload, self.opened, self.tp.rank)
            t_open = time.perf_counter()
            problems = self._problems(specs) + _version_problems(req.weight_version)
            self.timing = {"open_s": t_open - start, "validate_s": time.perf_counter() - t_open}
            result = self._apply(tensors, problems, start, req.flush_cache, req.weight_version, req.check_finite,
                                 None)
            del tensors
            close_shared(req.payload, self.opened, self.tp.rank)
            return result
        except BaseException:
            self.opened.clear()  # the sender forgets its exports too when told of the failure
            raise

    def update_weights_from_disk(self, req: UpdateWeightsFromDiskReq) -> dict[str, Any]:
        """Reload every parameter from a checkpoint directory (checked against its headers first)."""
        from rollout.models.loader import iter_safetensors, read_safetensors_shapes, tied_head_skip

        start = time.perf_counter()
        wm = self.updater.weight_map
        _check_same_model(req.model_path, wm.cfg)
        shapes = read_safetensors_shapes(req.model_path)
        skip = tied_head_skip(req.model_path, shapes, wm)
        names = [n for n in shapes if not wm.is_ignored(n) and n not in skip]
        problems = self._problems(parse_specs(names, [shapes[n][0] for n in names],
                                              [list(shapes[n][1]) for n in names]))
        problems += _version_problems(req.weight_version)
        missing = sorted(set(wm.shapes) - {c for n in names for c in wm.covered(n)})
        if missing:
            problems.append(f"checkpoint {req.model_path!r} lacks {len(missing)} parameters, e.g. {missing[:3]}")
        if problems:
            raise ValueError("; ".join(problems[:5]))
        self._note_version_kept()
        self.refused_before_session = None  # a reload sets every parameter
        nbytes = 0
        try:
            for name, tensor in iter_safetensors(req.model_path, skip):
                if not wm.is_ignored(name):
                    self.updater.load([(name, tensor)])
                    nbytes += tensor.numel() * tensor.element_size()
        except Exception as e:  # noqa: BLE001 - a read failing half way leaves mixed weights
            self.mark_inconsistent(f"reloading from {req.model_path!r} failed: {e}")
            raise RuntimeError(self.updater.inconsistent) from e
        self.timing = {}
        return self._finish(start, len(names), nbytes, self.updater.end_session(explicit=True), req.weight_version)

    def rollback_weights(self, req: Any = None) -> dict[str, Any]:
        if self.blocked() is not None:
            raise ValueError(self.blocked())
        start = time.perf_counter()
        self.updater.rollback()
        self.refused_before_session = None
        self.version_named_in_session = False
        self.weight_version = self.version_before_session or self.weight_version
        self.cache.invalidate()
        return {"weight_version": self.weight_version, "seconds": time.perf_counter() - start}

    def benchmark_receive(self, req: BenchmarkReceiveReq) -> float:
        """Receive ``num_chunks`` raw broadcasts of ``nbytes`` each and discard them (the transport's
        ceiling for the weight-sync benchmark); returns the seconds this rank spent."""
        _, group = self.groups.get(req.group_name)
        buf = torch.empty(req.nbytes, dtype=torch.uint8, device=self.device)
        start = time.perf_counter()
        for _ in range(req.num_chunks):
            torch.distributed.broadcast(buf, src=0, group=group)
        if buf.is_cuda:
            torch.cuda.synchronize(buf.device)
        return time.perf_counter() - start

    # ---- sessions, version, state --------------------------------------------------------------

    def flush_cache(self, req: Any = None) -> bool:
        """Drop the prefix cache (False while running requests hold entries); ends a per-tensor session."""
        if self.updater.end_session(explicit=True):
            self._complete(None)
            return True
        if not self.updater.session:
            self.refused_before_session = None  # the caller ends what it sent: a later update starts afresh
        return self.cache.flush()

    def expire_session(self) -> None:
        """The open session's trainer went silent for its group timeout: the weights are a mix, so mark them
        inconsistent and tear down the group (the scheduler then fails the held requests)."""
        up = self.updater
        if not up.session:
            return
        name = up.session_group
        timeout = self.groups.timeout(name)
        self.groups.drop(name)
        self.mark_inconsistent(f"the update session was abandoned: no update call on group {name!r} within its "
                               f"timeout of {timeout:g} s (the trainer stopped or died)")
        logger.error("%s", up.inconsistent)

    def update_weight_version(self, req: UpdateWeightVersionReq) -> str:
        """Name the served weights; while an update session is open, the weights it is loading (its close then
        keeps the name instead of incrementing it)."""
        problems = _version_problems(req.weight_version)
        if problems:
            raise ValueError(problems[0])
        self.weight_version = str(req.weight_version)
        self.versions_named.add(self.weight_version)
        self.version_named_in_session = bool(self.updater.session)
        return self.weight_version

    def get_weight_version(self, req: Any = None) -> str:
        return self.weight_version

    def state(self) -> dict[str, Any]:
        up = self.updater
        return {"state": up.state, "reason": up.inconsistent, "updated": len(up.session),
                "total": len(up.weight_map.shapes), "weight_version": self.weight_version,
                "groups": self.groups.names()}

    def mark_inconsistent(self, reason: str) -> None:
        """An update failed and left the weights a mix (``WeightUpdater.mark_inconsistent``). A version named while its
        session was open (``update_weight_version``) names weights that never fully loaded: the served name goes back
        to the one from before the session (what ``rollback_weights`` restores), so neither it nor a later update
        closing the session (a reload from disk) claims them."""
        self.updater.mark_inconsistent(reason)
        if self.version_named_in_session:
            self.weight_version = self.version_before_session or self.weight_version
            self.version_named_in_session = False

    def refusal(self) -> str:
        return f"the engine refuses to generate: {self.updater.inconsistent}"

    # ---- verification -------------------------------------------------------------------------

    def _check_readable(self) -> None:
        """ValueError while the weights' memory is released (asleep): reading it would crash the process."""
        blocked = self.blocked()
        if blocked is not None:
            raise ValueError("the weights' memory is released (asleep): wake_up(tags=['weights']) before reading them")

    def get_weights_by_name(self, req: GetWeightsByNameReq) -> list[Any]:
        """SGLang's ``param.tolist()[:truncate_size]``: the first ``truncate_size`` rows of the HF tensor (values of
        a 1-D one), as transformers' ``get_parameter(name)[:truncate_size].tolist()`` gives them, for any name an
        update takes (transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj`` and Mixtral's
        ``mlp.gate.weight`` too: the rows of its first experts only are gathered)."""
        self._check_readable()
        wm = self.updater.weight_map
        wm.check(req.name, wm.full_shape(req.name) or ())  # an unknown name: its error
        names = wm.read_sources(req.name, req.truncate_size)
        parts = self.tp.gather_object([self.updater.local_tensor(name) for name in names])
        if self.tp.rank != 0:
            return []
        full = [assemble([rank[i] for rank in parts], wm.shapes[wm.canonical(name)]) for i, name in enumerate(names)]
        return wm.read_join(req.name, full).float()[:req.truncate_size].tolist()

    def weights_fingerprint(self, req: Any = None) -> str:
        from rollout.weights.fingerprint import combine_fingerprint

        self._check_readable()
        parts = self.tp.gather_object(self.updater.fingerprint_parts())
        if self.tp.rank != 0:
            return ""
        return combine_fingerprint(parts, self.updater.weight_map.fingerprint_shapes)

    # ---- internals ----------------------------------------------------------------------------

    def _problems(self, specs: list[Any]) -> list[str]:
        """Why an update of ``specs`` cannot load (checked before anything is loaded; empty when it can)."""
        blocked = self.blocked()
        return ([blocked] if blocked is not None else []) + self.updater.problems(specs)

    def _note_version_kept(self) -> None:
        """An update is about to load: name the weights ``rollback_weights`` restores. That is the copy
        ``WeightUpdater.load`` keeps, which it takes only of whole weights at a session's start: after a failed
        update, or a release of the weights without a copy (``sleep(level=2)``), the copy and its version stay
        those of the last whole weights."""
        if not self.updater.session and self.updater.inconsistent is None:
            self.version_before_session = self.weight_version

    def _apply(self, tensors: list[tuple[str, torch.Tensor]], problems: list[str], start: float, flush_cache: bool,
               weight_version: str | None, check_finite: bool, group_name: str | None) -> dict[str, Any]:
        """Reject (weights untouched) or load, then close the session if it is complete. A call rejected while
        a session is open leaves the earlier calls' parameters loaded: the weights are marked inconsistent,
        so only a complete update (not a later call that merely asks to close the session) makes them whole."""
        tensors = self.updater.loadable(tensors)
        if not problems:
            problems = _tied_conflict(tensors, self.updater.weight_map)
        if check_finite and not problems:
            bad = self.updater.nonfinite(tensors)
            problems = [f"non-finite values in {bad[:5]}"] if bad else []
        if problems:
            reason = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
            if self.updater.session and self.updater.inconsistent is None:
                self.mark_inconsistent(f"an update call was refused mid-update ({reason})")
            elif not self.updater.session:  # a call announcing more to come (flush_cache=False) starts a push
                closes = flush_cache or weight_version is not None
                self.refused_before_session = None if closes else reason
            raise ValueError(reason)
        tensors = self._without_served_tied_head(tensors)
        if not tensors:
            return self._apply_nothing(start, flush_cache, weight_version, group_name)
        refused = None
        self._note_version_kept()
        if not self.updater.session:
            refused, self.refused_before_session = self.refused_before_session, None
        t_load = time.perf_counter()
        self.updater.load(tensors)
        if refused is not None and not self.updater.covers_all:
            self.mark_inconsistent(f"the update call before this update's first was refused ({refused}), so "
                                   "this update may lack its parameters")
        self.timing["load_s"] = time.perf_counter() - t_load
        self.updater.touch_deadline(group_name, self.groups.timeout(group_name))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        done = self.updater.end_session(explicit=flush_cache or weight_version is not None)
        return self._finish(start, len(tensors), nbytes, done, weight_version)

    def _without_served_tied_head(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``tensors`` without a tied ``lm_head.weight`` equal (on every rank) to the embedding served, while no session
        is open: a tied model's ``state_dict`` pushed in order ends with it after the call that completed the weights,
        and loading it again would open a second session, a second version and an unnamed one between the two."""
        up = self.updater
        head = next((t for name, t in tensors if name == TIED_HEAD), None)
        untied = up.weight_map.canonical(TIED_HEAD) == TIED_HEAD
        if head is None or untied or up.session or up.inconsistent is not None or self.refused_before_session:
            return tensors
        if not self.tp.all_true(up.holds(TIED_HEAD, head)):
            return tensors
        return [(name, t) for name, t in tensors if name != TIED_HEAD]

    def _apply_nothing(self, start: float, flush_cache: bool, weight_version: str | None, group_name: str | None
                       ) -> dict[str, Any]:
        """A call left with nothing to load (only buffers the engine computes itself, as a ``state_dict``'s last
        bucket of rotary ``inv_freq`` may be): it closes an open session as asked; with none open (the push's
        earlier calls completed the weights), its ``weight_version`` names the weights served."""
        self.updater.touch_deadline(group_name, self.groups.timeout(group_name))
        done = self.updater.end_session(explicit=flush_cache or weight_version is not None)
        whole = not self.updater.session and self.updater.inconsistent is None and self.refused_before_session is None
        if not done and weight_version is not None and whole:
            self.weight_version = str(weight_version)
            self.versions_named.add(self.weight_version)
        return self._finish(start, 0, 0, done, weight_version)

    def _finish(self, start: float, loaded: int, nbytes: int, complete: bool, weight_version: str | None
                ) -> dict[str, Any]:
        t_flush = time.perf_counter()
        if complete:
            self._complete(weight_version)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timing["flush_s"] = time.perf_counter() - t_flush
        result = UpdateResult(loaded, nbytes, time.perf_counter() - start, complete, self.weight_version)
        return {**asdict(result), **self.timing}

    def _complete(self, weight_version: str | None) -> None:
        """Weights are whole again: drop stale KV and name the new version."""
        if weight_version is None and self.version_named_in_session:
            weight_version = self.weight_version
        self.version_named_in_session = False
        if weight_version is not None:
            self.weight_version = str(weight_version)
        else:  # after a rollback the next number may have named the weights rolled back: skip what was used
            version = _next_version(self.weight_version)
            while version in self.versions_named:
                version = _next_version(version)
            self.weight_version = version
        self.versions_named.add(self.weight_version)
        self.cache.invalidate()

    def _transfer_failed(self, group_name: str, message: str) -> None:
        self.groups.drop(group_name)
        if self.updater.session:
            self.mark_inconsistent(f"a transfer failed mid-update ({message})")
        logger.error("weight transfer on group %r failed: %s", group_name, message)


def _version_problems(weight_version: Any) -> list[str]:
    """Why ``weight_version`` cannot name weights: '' is no name (an output's version when none is known, and the
    next bump would make '+1' of it). None (bump the number) and anything else (its ``str``) can."""
    if weight_version is not None and str(weight_version) == "":
        return ["weight_version must be a non-empty string (or None to increment the version)"]
    return []


def _next_version(version: str) -> str:
    return str(int(version) + 1) if version.isdigit() else f"{version}+1"


# ModelConfig fields a checkpoint of the same model may change: its storage dtype, its stop tokens
_RELOAD_MAY_CHANGE = ("torch_dtype", "eos_token_ids")


def _check_same_model(model_path: str, running: Any) -> None:
    """ValueError when ``model_path``'s config.json (if it has one) describes another model than ``running``
    (a ``ModelConfig``): its weights would load by name and shape and compute something else."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return
    new = ModelConfig.from_path(model_path)
    differ = [f.name for f in fields(ModelConfig)
              if f.compare and f.name not in _RELOAD_MAY_CHANGE and getattr(new, f.name) != getattr(running, f.name)]
    if differ:
        detail = ", ".join(f"{n}: {getattr(running, n)!r} -> {getattr(new, n)!r}" for n in differ[:4])
        raise ValueError(f"checkpoint {model_path!r} is a different model than the one served ({detail}); "
                         "update_weights_from_disk reloads weights only: start an engine on it instead")


def _tied_conflict(tensors: list[tuple[str, torch.Tensor]], weight_map: Any) -> list[str]:
    """With tied embeddings ``lm_head.weight`` and ``model.embed_tokens.weight`` are one parameter: a call
    carrying both (a ``state_dict``) must carry the same bits in the stored dtype, NaNs included (else whichever
    came last would win, where transformers' ``load_state_dict`` keeps the head's: a bfloat16 head before a float32
    embedding, or a -0.0 beside a 0.0, left the embedding's)."""
    named = dict(tensors)
    pair = weight_map.tied_pair(named)
    if pair is None:
        return []
    if same_bits(named[pair[0]].to(weight_map.stored_dtype(pair[1])), named[pair[1]]):
        return []
    return ["lm_head.weight differs from model.embed_tokens.weight, which a model with tied embeddings holds "
            "as one parameter: send the same values (or only the embedding)"]
