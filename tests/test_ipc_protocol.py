"""The CUDA IPC handle protocol of ``rollout.weights.shared_tensors`` against torch's reference counting.

torch sets a fresh counter to 1 at every ``reduce_tensor`` of a storage and expects the one mapping made of
it to drop the counter to 0 when closed; a mapping made twice of one export drives it negative (the sender
may then reuse memory a receiver still maps) and an export never mapped leaves it at 1 (the memory is never
given back). The fakes below stand in for ``reduce_tensor`` / ``rebuild_cuda_tensor`` with such counters,
so the protocol is checked on the CPU: every counter ends at 0, never below, over a trainer's pushes, and
what stays mapped after a push is only what the trainer keeps alive.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
import torch.multiprocessing.reductions as reductions

from rollout.weights.buckets import TensorSpec
from rollout.weights.ipc_protocol import IpcHandleCache, OpenedIpcTensors
from rollout.weights.shared_tensors import close_shared, open_shared


class FakeIpc:
    """Exports and mappings with torch's counters. Memory is never really freed here (a mapping is a view of
    the sender's tensor): a test frees a sender's storage with ``free``, which is what the sender's
    ``StorageWeakRef`` then reports, as it would for a storage freed in the trainer's process."""

    def __init__(self) -> None:
        self.counters: dict[int, int] = {}
        self.ids = itertools.count()
        self.maps = 0
        self.freed: set[int] = set()
        self.keep: list[torch.Tensor] = []

    def free(self, tensors: list[torch.Tensor]) -> None:
        self.freed.update(t.untyped_storage()._cdata for t in tensors)
        self.keep.extend(tensors)  # never collected, so no other storage takes its address

    def weak_ref(self, storage):
        fake = self

        class Ref:
            cdata = storage._cdata

            def expired(self) -> bool:
                return self.cdata in fake.freed

        return Ref()

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
    monkeypatch.setattr(reductions, "StorageWeakRef", fake.weak_ref)
    return fake


def specs_of(tensors: list[torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(f"t{i}", t.dtype, tuple(t.shape)) for i, t in enumerate(tensors)]


def call(sender: IpcHandleCache, receivers: list[OpenedIpcTensors], tensors: list[torch.Tensor],
         ends_push: bool = True, fail_rank: int | None = None) -> list[list[torch.Tensor]]:
    """One call as Engine and WeightSync run it: every rank opens its part, loads (copies), drops the views
    and closes what it is told to; a failing rank closes everything, and the sender then forgets its state."""
    exported = sender.export(tensors, ends_push)
    values = []
    for rank, r in enumerate(receivers):
        opened = r.open(exported[rank], specs_of(tensors))
        values.append([t.clone() for t in opened])
        del opened
        if rank != fail_rank:
            r.close(exported[rank])
    if fail_rank is not None:
        receivers[fail_rank].clear()
        sender.reset()
    return values


def modes(payload) -> list[str]:
    return [m for _, m in payload.storages]


def test_parameters_are_mapped_at_two_pushes_then_reused(ipc):
    params = [torch.randn(4), torch.randn(3, 2)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    seen = []
    for step in range(5):
        exported = sender.export(params)
        seen.append(modes(exported[0]))
        got = receiver.open(exported[0], specs_of(params))
        assert all(torch.equal(a, b) for a, b in zip(got, params))
        del got
        receiver.close(exported[0])
        params[0].add_(1.0)  # a training step in place: same storage, new values
    assert seen == [["map"] * 2, ["map"] * 2] + [["reuse"] * 2] * 3
    assert ipc.maps == 4  # mapped at the first push (closed at its end) and at the second (kept)
    assert set(ipc.open_counts().values()) == {1} and len(receiver) == 2
    receiver.clear()
    assert ipc.open_counts() == {}


def push_buckets(sender: IpcHandleCache, receiver: OpenedIpcTensors, buffers: list[torch.Tensor], tag: int
                 ) -> list[list[str]]:
    """Six buckets written in turn into two buffers (FSDP2's gather), each sent as two views; their modes."""
    seen = []
    for k in range(6):
        buf = buffers[k % 2]
        a, b = buf[:16].view(torch.float32), buf[16:48].view(torch.float32).view(2, 4)
        a.fill_(tag * 10 + k), b.fill_(-k)
        exported = sender.export([a, b], ends_push=k == 5)
        seen.append(modes(exported[0]))
        got = call_one(receiver, exported[0], [a, b])
        assert torch.equal(got[0], a) and torch.equal(got[1], b)
    return seen


def test_a_push_maps_its_bucket_buffers_once_and_closes_them_at_its_end(ipc):
    """Buffers that live for one push: each mapped once in it, the views of every bucket cut out of it, and
    nothing mapped once the push is over (the trainer frees them while it trains)."""
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    for push in range(3):
        buffers = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
        assert push_buckets(sender, receiver, buffers, push) == [["map"]] * 2 + [["reuse"]] * 4
        assert len(receiver) == 0 and ipc.open_counts() == {}
        ipc.free(buffers)
    assert ipc.maps == 6


def test_bucket_buffers_kept_across_pushes_stay_mapped(ipc):
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    buffers = [torch.zeros(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)]
    seen = [push_buckets(sender, receiver, buffers, push) for push in range(3)]
    assert seen[0] == seen[1] == [["map"]] * 2 + [["reuse"]] * 4 and seen[2] == [["reuse"]] * 6
    assert len(receiver) == 2
    ipc.free(buffers)
    call(sender, [receiver], [torch.randn(3)])  # freed buffers are released at the next call
    assert ipc.open_counts() == {}


def call_one(receiver: OpenedIpcTensors, payload, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    got = [t.clone() for t in receiver.open(payload, specs_of(tensors))]
    receiver.close(payload)
    return got


def test_temporaries_are_closed_one_call_later_and_at_the_push_end(ipc):
    params = [torch.randn(8) for _ in range(3)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    for _ in range(3):
        for k in range(3):  # a push in three calls, each with a fresh gathered tensor
            gathered = [torch.randn(5)]
            call(sender, [receiver], params[k:k + 1] + gathered, ends_push=k == 2)
            ipc.free(gathered)
            assert len(receiver) <= len(params) + 1  # the previous call's temporary was released
        assert len(ipc.open_counts()) <= len(params)  # after the push only parameters stay mapped
    call(sender, [receiver], params[:1])  # a push without two of them closes their mappings
    assert list(ipc.open_counts().values()) == [1]
    call(sender, [receiver], params[:1] + params[:1])  # one tensor named twice is mapped once
    assert list(ipc.open_counts().values()) == [1]
    assert min(ipc.counters.values()) == 0


def test_views_of_one_storage_share_one_export(ipc):
    flat = torch.arange(12, dtype=torch.float32)
    views = [flat[:4], flat[4:10].view(2, 3), flat[10:]]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    exported = sender.export(views)
    assert len(exported[0].storages) == 1 and [o for _, o in exported[0].views] == [0, 16, 40]
    got = call_one(receiver, exported[0], views)
    assert all(torch.equal(a, b) for a, b in zip(got, views))
    assert ipc.maps == 1 and ipc.open_counts() == {}


def test_a_failed_push_resets_both_sides(ipc):
    params = [torch.randn(6) for _ in range(2)]
    sender, receivers = IpcHandleCache(receivers=2), [OpenedIpcTensors(), OpenedIpcTensors()]
    for _ in range(3):
        call(sender, receivers, params)
    assert len(ipc.open_counts()) == 4  # two ranks, one export each per tensor
    call(sender, receivers, params, fail_rank=1)  # rank 1 failed and closed its mappings; rank 0 kept its own
    assert len(ipc.open_counts()) == 2
    exported = sender.export(params)
    assert {m for rank in exported for m in modes(rank)} == {"map"}  # a new epoch: nothing is assumed open
    for rank, r in enumerate(receivers):
        assert len(r.open(exported[rank], specs_of(params))) == 2  # rank 0 closes its old epoch's mappings
        r.close(exported[rank])
    assert ipc.open_counts() == {} and min(ipc.counters.values()) == 0


def test_a_reuse_the_receiver_lacks_is_refused(ipc):
    params = [torch.randn(2)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    for _ in range(2):
        call(sender, [receiver], params)
    receiver.clear()
    with pytest.raises(RuntimeError, match="not open here"):
        receiver.open(sender.export(params)[0], specs_of(params))


def test_a_view_past_its_storage_is_refused(ipc):
    t = torch.randn(4)
    payload = IpcHandleCache().export([t])[0]
    with pytest.raises(ValueError, match="runs past its storage"):
        OpenedIpcTensors().open(payload, [TensorSpec("x", torch.float32, (5,))])


def test_the_scheduler_path_keeps_its_mappings_in_the_receiver_it_is_given(ipc):
    """``open_shared`` / ``close_shared`` (what WeightSync calls) with a receiver that has nothing open yet."""
    params = [torch.randn(4), torch.randn(2, 3)]
    sender, receiver = IpcHandleCache(), OpenedIpcTensors()
    for push in range(4):
        payload = ("cuda_ipc_synced", sender.export(params))
        named = open_shared(specs_of(params), payload, receiver)
        assert [n for n, _ in named] == ["t0", "t1"] and all(torch.equal(t, p) for (_, t), p in zip(named, params))
        del named
        close_shared(payload, receiver)
        assert len(receiver) == (0 if push == 0 else 2)
    assert ipc.maps == 4


def test_a_rank_failing_mid_push_leaves_no_mapping_behind(ipc):
    """TP=2, a push of three bucket calls through two reused buffers; rank 1 fails at the second call. Rank
    0 (which succeeded) closes its mappings at the next call, a new epoch; the next push maps afresh and,
    once it is over, nothing is left mapped on either rank."""
    sender, receivers = IpcHandleCache(receivers=2), [OpenedIpcTensors(), OpenedIpcTensors()]

    def push(fail_at: int | None) -> None:
        buffers = [torch.zeros(32, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)]
        for k in range(3):
            views = [buffers[k % 2][:16].view(torch.float32)]
            views[0].fill_(k)
            values = call(sender, receivers, views, ends_push=k == 2, fail_rank=1 if k == fail_at else None)
            assert all(torch.equal(v[0], views[0]) for v in values)
            if k == fail_at:
                break
        ipc.free(buffers)

    push(fail_at=1)
    assert len(receivers[1]) == 0 and len(receivers[0]) == 2  # rank 0 still maps both buffers
    push(fail_at=None)
    assert [len(r) for r in receivers] == [0, 0] and ipc.open_counts() == {}
    assert min(ipc.counters.values()) == 0 and sender.epoch == 1
