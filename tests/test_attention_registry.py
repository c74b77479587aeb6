"""rollout.attention's registry (names to backends, and its refusals), HybridAttnBackend's routing, and the
torch fill of a decode graph's inputs (``copy_decode_inputs``: the replay path of FlashInfer decode graphs).
The GPU backends themselves run in gpu_checks/check_attention_and_engine.py."""

from __future__ import annotations

import pytest
import torch

from rollout.attention import registry
from rollout.attention.base import AttentionBackend, copy_decode_inputs, require_decode
from rollout.attention.common import AttentionSpec, kv_indices_for
from rollout.attention.hybrid import HybridAttnBackend
from rollout.attention.registry import create_attention_backend
from rollout.attention.torch_native import TorchNativeBackend
from rollout.config import ATTENTION_BACKENDS, DECODE_ATTENTION_BACKENDS
from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode

SENTINEL = -7


def spec(device: str = "cpu", page_size: int = 1) -> AttentionSpec:
    return AttentionSpec(4, 2, 16, 0.25, torch.float32, torch.float32, torch.device(device), max_batch_size=4,
                         max_context_len=32, page_size=page_size)


def test_names_map_to_backends():
    assert set(registry.BACKENDS) == set(ATTENTION_BACKENDS) - {"auto"}
    assert set(registry.DECODE_BACKENDS) == set(DECODE_ATTENTION_BACKENDS) - {"auto"}
    for name in ("auto", "torch_native"):  # on the CPU "auto" is torch_native, whatever the decode name
        for decode in DECODE_ATTENTION_BACKENDS:
            assert type(create_attention_backend(spec(), name, decode)) is TorchNativeBackend
    assert registry.resolve_attention_backend("auto", torch.device("cpu")) == "torch_native"
    assert registry.resolve_attention_backend("flashinfer", torch.device("cpu")) == "flashinfer"
    assert spec().max_kv_indices == 4 * 32 + 1


def test_auto_on_cuda_follows_the_gpu_extra(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(registry, "has_gpu_extra", lambda: False)
    assert registry.resolve_attention_backend("auto", cuda) == "torch_native"
    assert type(create_attention_backend(spec("cuda"))) is TorchNativeBackend
    monkeypatch.setattr(registry, "has_gpu_extra", lambda: True)
    assert registry.resolve_attention_backend("auto", cuda) == "flashinfer"


def test_a_float32_model_on_cuda_runs_the_torch_path(monkeypatch):
    """FlashInfer's attention, norm and activation kernels take float16 / bfloat16 only: "auto" picks torch for
    a float32 model on CUDA (rollout-smoke's default dtype), the engine leaves its fused kernels off, and an
    explicit "flashinfer" is refused with the reason."""
    from rollout.config import EngineConfig
    from rollout.model_executor import model_runner

    cuda = torch.device("cuda")
    monkeypatch.setattr(registry, "has_gpu_extra", lambda: True)
    monkeypatch.setattr(model_runner, "_has_module", lambda name: True)
    assert registry.resolve_attention_backend("auto", cuda, torch.float32) == "torch_native"
    assert type(create_attention_backend(spec("cuda"))) is TorchNativeBackend  # spec() is a float32 model
    for dtype in (torch.float16, torch.bfloat16):
        assert registry.resolve_attention_backend("auto", cuda, dtype) == "flashinfer"
    with pytest.raises(ValueError, match="needs a float16 or bfloat16 model, not torch.float32"):
        create_attention_backend(spec("cuda"), "flashinfer")
    config = EngineConfig(model_path="unused")
    assert not model_runner.use_fused_kernels(config, cuda, torch.float32)
    assert model_runner.use_fused_kernels(config, cuda, torch.bfloat16)
    assert not model_runner.use_fused_kernels(config, torch.device("cpu"), torch.bfloat16)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown attention backend 'fa3'"):
        create_attention_backend(spec(), "fa3")
    with pytest.raises(ValueError, match="unknown decode attention backend 'fa3'"):
        create_attention_backend(spec(), "torch_native", "fa3")
    with pytest.raises(ValueError, match="unknown decode attention backend 'fa3'"):
        create_attention_backend(spec(), "flashinfer", "fa3")


@pytest.mark.parametrize("decode", DECODE_ATTENTION_BACKENDS)
def test_gpu_backends_on_cpu_are_refused(decode):
    with pytest.raises(ValueError, match="the flashinfer attention backend needs a CUDA device"):
        create_attention_backend(spec(), "flashinfer", decode)


def test_gpu_backends_without_the_gpu_extra_are_refused(monkeypatch):
    monkeypatch.setattr(registry, "has_gpu_extra", lambda: False)
    for decode in DECODE_ATTENTION_BACKENDS:
        with pytest.raises(ValueError, match=r"needs flashinfer and triton: pip install 'rollout-engine\[gpu\]'"):
            create_attention_backend(spec("cuda"), "flashinfer", decode)


def test_xqa_needs_one_of_its_page_sizes(monkeypatch):
    monkeypatch.setattr(registry, "has_gpu_extra", lambda: True)
    with pytest.raises(ValueError, match="'xqa' needs page_size in"):
        create_attention_backend(spec("cuda", page_size=1), "flashinfer", "xqa")


class Recording(AttentionBackend):
    """A backend that records the calls it gets."""

    def __init__(self, name: str, graphs: bool) -> None:
        self.name, self.calls, self.supports_cuda_graph = name, [], graphs

    def init_forward_metadata(self, batch):
        self.calls.append("init")
        batch.attn_metadata = self.name

    def forward(self, q, k, v, layer, batch, kv_stored=False, out=None):
        self.calls.append(("forward", kv_stored))
        return q

    def wants_fresh_kv(self, batch):
        return self.name == "prefill"

    def wants_balanced_decode(self, seq_lens):
        return self.name == "decode" and max(seq_lens) > 100

    def graph_state(self, batch_size):
        self.calls.append(("graph_state", batch_size))
        return batch_size

    def init_graph_metadata(self, batch, state):
        self.calls.append(("init_graph", state, batch.input_ids.tolist()))


def batch_with_buffers(mode: ForwardMode, bs: int = 4, size: int = 6) -> tuple[ForwardBatch, list[torch.Tensor]]:
    """A batch of ``bs`` rows whose tensors are views of sentinel-filled static buffers of ``size`` (as
    CudaGraphRunner's: input ids, positions, out slots, rows, seq lens), over a random int32 request table of
    5 rows; and those buffers."""
    buffers = [torch.full((size,), SENTINEL, dtype=torch.int64) for _ in range(4)]
    buffers.append(torch.full((size,), SENTINEL, dtype=torch.int32))
    table = torch.randperm(5 * 16, generator=torch.Generator().manual_seed(0)).to(torch.int32).view(5, 16) + 100
    views = [b[:bs] for b in buffers]
    return ForwardBatch(mode, *views, [1] * bs, [1] * bs, None, table, None), buffers


def batch_of(mode: ForwardMode) -> ForwardBatch:
    return batch_with_buffers(mode)[0]


def test_hybrid_routes_extend_to_prefill_and_decode_to_decode():
    prefill, decode = Recording("prefill", graphs=False), Recording("decode", graphs=True)
    hybrid = HybridAttnBackend(prefill, decode)
    assert hybrid.supports_cuda_graph
    assert not HybridAttnBackend(decode, prefill).supports_cuda_graph
    q = torch.ones(2, 4, 16)
    for mode, backend, fresh in ((ForwardMode.EXTEND, prefill, True), (ForwardMode.DECODE, decode, False)):
        other = decode if backend is prefill else prefill
        before = list(other.calls)
        batch = batch_of(mode)
        hybrid.init_forward_metadata(batch)
        assert batch.attn_metadata == backend.name
        assert hybrid.wants_fresh_kv(batch) is fresh
        assert hybrid.forward(q, None, None, None, batch, kv_stored=True) is q
        assert backend.calls[-2:] == ["init", ("forward", True)]
        assert other.calls == before
    assert hybrid.graph_state(8) == 8 and decode.calls[-1] == ("graph_state", 8)
    # the scheduler asks the hybrid whether a decode step is cut into pieces: the decode backend answers
    assert hybrid.wants_balanced_decode([5, 500]) and not hybrid.wants_balanced_decode([5, 50])


def test_prepare_graph_replay_default_fills_inputs_then_plans():
    """The default replay hook (FlashInfer decode graphs): ``copy_decode_inputs``, then ``init_graph_metadata``
    sees the filled inputs; through a hybrid too."""
    decode = Recording("decode", graphs=True)
    batch = batch_of(ForwardMode.DECODE)
    batch.seq_lens_cpu = [5, 9, 1, 1]
    packed = torch.tensor([[3, 1], [4, 8], [71, 72], [5, 9]], dtype=torch.int64)
    last = torch.arange(1000, 1005, dtype=torch.int64)
    HybridAttnBackend(Recording("prefill", graphs=False), decode).prepare_graph_replay(batch, 4, packed, last)
    assert decode.calls == [("init_graph", 4, [1003, 1001, 0, 0])]


def test_copy_decode_inputs_writes_the_table_and_pads_the_static_buffers():
    batch, buffers = batch_with_buffers(ForwardMode.DECODE)  # padded size 4, static buffers of 6
    batch.seq_lens_cpu = [5, 9, 1, 1]
    table_before = batch.req_to_token.clone()
    rows, positions, slots, lens = [3, 1], [4, 8], [71, 72], [5, 9]
    packed = torch.tensor([rows, positions, slots, lens], dtype=torch.int64)
    last = torch.arange(1000, 1005, dtype=torch.int64)
    copy_decode_inputs(batch, packed, last)
    want_table = table_before.clone()
    want_table[rows, positions] = torch.tensor(slots, dtype=torch.int32)
    assert torch.equal(batch.req_to_token, want_table)
    assert batch.input_ids.tolist() == [1003, 1001, 0, 0]
    assert batch.positions.tolist() == positions + [0, 0]
    assert batch.out_cache_loc.tolist() == slots + [0, 0]
    assert batch.req_pool_indices.tolist() == rows + [0, 0]
    assert batch.seq_lens.dtype == torch.int32 and batch.seq_lens.tolist() == lens + [1, 1]
    for buf in buffers:
        assert buf[4:].tolist() == [SENTINEL, SENTINEL]  # past the padded size: untouched
    # what a FlashInfer graph plan then reads: each row's slots, the new one included
    indices = kv_indices_for(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, sum(batch.seq_lens_cpu))
    assert indices[4].item() == 71 and indices[5 + 8].item() == 72
    assert indices[14:].tolist() == [want_table[0, 0].item()] * 2


def test_decode_only_backends_refuse_extend_batches():
    require_decode(batch_of(ForwardMode.DECODE), "triton")
    with pytest.raises(ValueError, match="the triton attention backend runs decode batches only"):
        require_decode(batch_of(ForwardMode.EXTEND), "triton")


def test_piecewise_token_sizes_cover_every_step_up_to_the_largest():
    """The piecewise CUDA graph sizes: sorted, distinct, ending at the largest step; a step pads by at most
    512 tokens up to 4,096 and 1,024 above (its GPU cost), and small steps pad little."""
    from rollout.model_executor.piecewise_graph_runner import piecewise_token_sizes

    sizes = piecewise_token_sizes(16384)
    assert sizes == sorted(set(sizes)) and sizes[-1] == 16384 and sizes[0] == 64
    gaps = [b - a for a, b in zip(sizes, sizes[1:])]
    assert max(g for g, a in zip(gaps, sizes) if a < 4096) <= 512 and max(gaps) <= 1024
    assert piecewise_token_sizes(5000) == [64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 3584, 4096, 5000]
    assert piecewise_token_sizes(100) == [64, 100] and piecewise_token_sizes(8) == [8]


def test_attention_writes_into_a_given_output_buffer():
    """``Attention.forward(out=...)`` (a piecewise CUDA graph's fixed buffer) returns the same values as without,
    written into that buffer: the torch backend over an extend batch."""
    import torch

    from rollout.attention.common import AttentionSpec
    from rollout.attention.registry import create_attention_backend
    from rollout.layers.attention import Attention
    from rollout.mem_cache.kv_pool import KVPool
    from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode

    torch.manual_seed(0)
    heads, kv_heads, dim, t = 4, 2, 16, 6
    spec = AttentionSpec(heads, kv_heads, dim, dim ** -0.5, torch.float32, torch.float32, torch.device("cpu"),
                         max_batch_size=4, max_context_len=16)
    backend = create_attention_backend(spec, "torch_native", "auto")
    pool = KVPool(32, 1, kv_heads, dim, torch.float32, "cpu")
    table = torch.zeros(4, 16, dtype=torch.int32)
    table[0, :t] = torch.arange(1, t + 1)
    batch = ForwardBatch(ForwardMode.EXTEND, torch.zeros(t, dtype=torch.int64), torch.arange(t),
                         torch.arange(1, t + 1), torch.tensor([0]), torch.tensor([t], dtype=torch.int32), [t], [t],
                         pool, table, backend)
    backend.init_forward_metadata(batch)
    layer = Attention(0, heads, kv_heads, dim, dim ** -0.5)
    q, k, v = torch.randn(t, heads * dim), torch.randn(t, kv_heads * dim), torch.randn(t, kv_heads * dim)
    ref = layer(q, k, v, batch)
    out = torch.full((t, heads * dim), float("nan"))
    got = layer(q, k, v, batch, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, ref)
