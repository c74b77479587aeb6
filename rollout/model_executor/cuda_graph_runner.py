"""CUDA graphs for decode: one graph per padded batch size, captured after the weights load.

Every graph writes its logits into the rows of one shared buffer (``logits``, [max batch size, padded
vocab]). A graph's own output would stay allocated for its replays, all sizes' at once: 256 KB a row at a
128k vocabulary, 4.6 GB over the default sizes up to 1,024, which sleep cannot release. The buffer is
under the ``kv_cache`` memory tag, so sleep releases it with the KV cache.

Inputs live in static buffers; a replay has the attention backend fill them from the real batch (padding
rows write their KV to the scratch slot 0 and read one cached token) and re-plan attention for that size
(``AttentionBackend.prepare_graph_replay``: with Triton or XQA decode both in one kernel launch), and
replays. Two variants of a size's graph besides the plain one: with ``shared_prefix`` and a backend that takes
``shared_prefixes`` groups, each size of at least 2 gets a cascade variant, replayed for steps whose batch has
groups; and a ``balanced`` variant, replayed for steps the scheduler marked to be cut into pieces by length
(``StepInput.balanced_decode``, from ``AttentionBackend.wants_balanced_decode``: a long request among short
ones). A variant is captured when the first such step of its size comes (as a GRPO rollout starts), so an
engine that never needs one spends no startup time on it: the static inputs are first reset to padding (the
warm-up forwards write K/V to the scratch slot 0 only), and the warm-up waits on the device for the step in
flight, once per size.
Weights are never rebound (updates copy in place), so graphs stay valid across updates.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from rollout.attention.base import AttentionBackend, pad_decode_inputs
from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode, SharedPrefixes

if TYPE_CHECKING:
    from rollout.model_executor.model_runner import ModelRunner, StepInput

logger = logging.getLogger(__name__)


def default_batch_sizes(max_bs: int) -> list[int]:
    """The decode batch sizes captured: 1, 2, 4, 8, every 16 up to 256, then every 32, up to ``max_bs``."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16)) + list(range(288, max_bs + 1, 32)) + [max_bs]
    return sorted({min(s, max_bs) for s in sizes})


class CudaGraphRunner:
    """Captures and replays decode forwards for the batch sizes in ``batch_sizes``."""

    def __init__(self, runner: "ModelRunner", backend: "AttentionBackend", batch_sizes: list[int],
                 shared_prefix: bool = False, stream: torch.cuda.Stream | None = None) -> None:
        """``stream``: where the graphs are captured (the model runner's one capture stream; default a new one)."""
        self.runner = runner
        self.stream = stream if stream is not None else torch.cuda.Stream(runner.device)
        self.backend = backend
        self.shared_prefix = shared_prefix and backend.max_shared_prefix_members > 0
        self.batch_sizes = sorted(batch_sizes)
        self.max_bs = self.batch_sizes[-1]
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.rows = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int32, device=dev)
        head = runner.model.lm_head
        with runner.memory.region("kv_cache"):  # scratch that sleep releases (the graphs' own memory it cannot)
            self.logits = torch.empty(self.max_bs, head.padded_vocab_size, dtype=head.weight.dtype, device=dev)
        # keyed by (batch size, variant: "plain", "cascade" or "balanced"); the backend's graph_state per batch
        # size serves all its variants
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.states: dict[int, Any] = {}
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}
        self.replays: dict[str, int] = {}  # decode steps replayed per variant (Engine.get_step_stats)
        self.pool = None
        self.capture()

    def can_run(self, batch_size: int) -> bool:
        return batch_size <= self.max_bs

    def _padded(self, batch_size: int) -> int:
        return next(s for s in self.batch_sizes if s >= batch_size)

    def _batch(self, bs: int, seq_lens_cpu: list[int], shared: SharedPrefixes | None = None,
               balanced: bool = False) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.rows[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu, extend_lens=[1] * bs, kv_pool=self.runner.kv_pool,
            req_to_token=self.runner.req_to_token.table, attn_backend=self.backend, shared_prefixes=shared,
            balanced_decode=balanced)

    def capture(self) -> None:
        for bs in reversed(self.batch_sizes):  # largest first, so smaller graphs reuse its memory
            self.states[bs] = self.backend.graph_state(bs)
            self._capture(bs, "plain")
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def _capture(self, bs: int, variant: str) -> None:
        shared = SharedPrefixes((), ()) if variant == "cascade" else None
        batch = self._batch(bs, [1] * bs, shared, variant == "balanced")
        self.backend.init_graph_metadata(batch, self.states[bs])
        stream, current = self.stream, torch.cuda.current_stream(self.runner.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graph (allocations, lazy inits)
                self.runner.model(batch, self.logits[:bs])
        current.wait_stream(stream)
        # capture_begin / capture_end rather than torch.cuda.graph, which also synchronizes the device, runs the
        # garbage collector and empties the allocator's cache: a lazy capture mid-run needs none of them
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(*(() if self.pool is None else (self.pool,)), capture_error_mode="thread_local")
            try:
                out = self.runner.model(batch, self.logits[:bs])
            finally:
                graph.capture_end()
        self.pool = graph.pool()
        self.graphs[bs, variant], self.outputs[bs, variant] = graph, out

    def _capture_variant(self, bs: int, variant: str) -> None:
        """The cascade or balanced variant of size ``bs``, from static inputs reset to padding rows (see the
        module doc)."""
        start = time.perf_counter()
        pad_decode_inputs(self._batch(bs, [1] * bs), 0)
        if variant == "cascade":
            self.states[bs].prefix.zero_()  # no groups: stage 0 of the warm-up forwards reads nothing
        with self.runner.memory.region("cuda_graph"):
            self._capture(bs, variant)
        logger.info("captured the %s decode CUDA graph for batch size %d in %.0f ms", variant, bs,
                    1e3 * (time.perf_counter() - start))

    def replay(self, step: "StepInput", packed: torch.Tensor, last_token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] for a decode step of B <= max batch size; ``packed`` is ``step.decode_pack()``
        already on the device. Also writes the step's out slots into the device request table. With
        Triton or XQA decode everything before the replay is one kernel; with FlashInfer decode, copies into
        the static buffers and a plan (``AttentionBackend.prepare_graph_replay``). Nothing waits for the GPU."""
        b = len(step.rows)
        bs = self._padded(b)
        shared = step.shared_prefixes if self.shared_prefix and bs >= 2 else None
        balanced = shared is None and step.balanced_decode
        key = (bs, "cascade" if shared is not None else "balanced" if balanced else "plain")
        if key not in self.graphs:
            self._capture_variant(*key)
        batch = self._batch(bs, list(step.seq_lens) + [1] * (bs - b), shared, balanced)
        self.backend.prepare_graph_replay(batch, self.states[bs], packed, last_token_ids)
        self.graphs[key].replay()
        self.replays[key[1]] = self.replays.get(key[1], 0) + 1
        return self.outputs[key][:b]
