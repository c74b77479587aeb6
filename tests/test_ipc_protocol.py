"""The CUDA IPC handle protocol of ``rollout.weights.shared_tensors`` against torch's reference counting.

torch sets a fresh counter to 1 at every ``reduce_tensor`` of a storage and expects the one mapping made of
it to drop the counter to 0 when closed; a mapping made twice of one export drives it negative (the sender
may then reuse memory a receiver still maps) and an export never mapped leaves it at 1 (the memory is never
given back). The fakes below stand in for ``reduce_tensor`` / ``rebuild_cuda_tensor`` with such counters,
so the protocol is checked on the CPU: every counter ends at 0, never below, over a trainer's pushes.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from rollout.weights.shared_tensors import IpcHandleCache, OpenedIpcTensors


class FakeIpc:
    def __init__(self) -> None:
        self.counters: dict[int, int] = {}
        self.ids = itertools.count()
        self.maps = 0

    def reduce_tensor(self, t: torch.Tensor):
        cid = next(self.ids)
        self.counters[cid] = 1
        return reductions.rebuild_cuda_tensor, (cid, t)

    def rebuild_cuda_tensor(self, cid: int, t: torch.Tensor) -> torch.Tensor:
        self.maps += 1
        mapped = t.view(t.shape)  # a new tensor object: its finalizer is the mapping's close
        weakref.finalize(mapped, self.close, cid)
        return mapped

    def close(self, cid: int) -> None:
        self.counters[cid] -= 1

    def open_counts(self) -> dict[int, int]:
        gc.collect()
        return {c: v for c, v in self.counters.items() if v != 0}


@pytest.fixture()
def ipc(monkeypatch):
    fake = FakeIpc()
    monkeypatch.setattr(reductions, "reduce_tensor", fake.reduce_tensor)
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fake.rebuild_cuda_tensor)
    return fake


def push(sender: IpcHandleCache, receivers: list[OpenedIpcTensors], tensors: list[torch.Tensor],
         fail_rank: int | None = None) -> list[list[torch.Tensor]]:
    """One push as Engine and WeightSync run it: every rank opens its exports, loads, drops the tensors;
    a failing rank closes everything, and the sender then forgets its state."""
    exported = sender.export(tensors)
    opened = [r.open(exported[rank]) for rank, r in enumerate(receivers)]
    values = [[t.clone() for t in rank_tensors] for rank_tensors in opened]
    del opened
    if fail_rank is not None:
        receivers[fail_rank].clear()
        sender.reset()
    return values


def test_parameters_are_mapped_once_and_closed_once(ipc):
    params = [torch.randn(4), torch.randn(3, 2)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    modes = []
    for step in range(5):
        exported = sender.export(params)
        modes.append([m for _, m in exported[0]])
        got = receiver.open(exported[0])
        assert all(torch.equal(a, b) for a, b in zip(got, params))
        del got
        params[0].add_(1.0)  # a training step in place: same storage, new values
    assert modes == [["once"] * 2, ["keep"] * 2] + [["reuse"] * 2] * 3
    assert ipc.maps == 4  # 2 tensors mapped at the first push (then closed) and again at the second (kept)
    assert set(ipc.open_counts().values()) == {1}  # the kept mappings, one per parameter
    receiver.clear()
    assert ipc.open_counts() == {}


def test_temporaries_are_never_kept_and_dropped_tensors_are_closed(ipc):
    params = [torch.randn(8) for _ in range(3)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    for _ in range(3):
        gathered = [torch.randn(5)]  # a fresh bucket each push, as FSDP2 gathers it
        push(sender, [receiver], params + gathered)
        assert len(ipc.open_counts()) <= len(params)  # nothing of the temporaries stays mapped
    push(sender, [receiver], params[:1])  # a push without two of them closes their mappings
    assert list(ipc.open_counts().values()) == [1]
    push(sender, [receiver], params[:1] + params[:1])  # one tensor named twice is mapped once
    assert list(ipc.open_counts().values()) == [1]
    assert min(ipc.counters.values()) == 0


def test_a_failed_push_resets_both_sides(ipc):
    params = [torch.randn(6) for _ in range(2)]
    sender, receivers = IpcHandleCache(receivers=2), [OpenedIpcTensors(), OpenedIpcTensors()]
    for _ in range(3):
        push(sender, receivers, params)
    assert len(ipc.open_counts()) == 4  # two ranks, one export each per tensor
    push(sender, receivers, params, fail_rank=1)  # rank 1 failed and closed its mappings; rank 0 kept its own
    assert len(ipc.open_counts()) == 2
    exported = sender.export(params)
    assert {m for rank in exported for _, m in rank} == {"once"}  # fresh exports: nothing is assumed open
    for rank, r in enumerate(receivers):
        assert len(r.open(exported[rank])) == 2  # rank 0 closes its old mappings: this push does not name them
    assert ipc.open_counts() == {} and min(ipc.counters.values()) == 0


def test_a_reuse_the_receiver_lacks_is_refused(ipc):
    params = [torch.randn(2)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    for _ in range(2):
        push(sender, [receiver], params)
    receiver.clear()
    with pytest.raises(RuntimeError, match="not open here"):
        receiver.open(sender.export(params)[0])
