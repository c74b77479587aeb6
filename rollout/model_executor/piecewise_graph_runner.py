"""Piecewise CUDA graphs for extend (prefill) steps, SGLang's piecewise CUDA graph: the layers between two
attentions are replayed as graphs, the attention runs eagerly between them.

An eager prefill step launches ~10 kernels a layer from Python (norms, four GEMMs, rope + KV store,
SiLU·mul, attention), a host cost per step of the same order as the GPU time of a 16k-token step, so the
step is paced by the host on a slow CPU. Here the model is cut at each attention: piece 0 is the embedding
and layer 0 up to its attention (``LlamaDecoderLayer.attention_inputs``), piece i (1..L-1) is layer i-1 after
its attention (``attention_output``) and layer i up to its attention, piece L is the last layer after its
attention and the final norm. Each piece is captured once per token count of ``sizes`` (largest first, one
memory pool). A step of T tokens is padded to the smallest size >= T: its inputs are copied into fixed
buffers (padding tokens: id 0, position 0, KV slot 0, the pool's scratch slot that no request reads), then
each piece is replayed with the attention of the first T rows run between them, planned as always
(``init_forward_metadata``) and writing into the buffer the next piece reads. Rows past T compute garbage
that no real row sees: every op of a piece is row-wise.

On with ``EngineConfig.enable_piecewise_cuda_graph``. They are captured before the decode graphs and on the
same stream: captured after them, or on a stream of their own, they cost every decode graph replay ~0.1 ms on
an H100 (the decode graph's kernels stopped overlapping through programmatic dependent launch;
docs/rl_rollouts.md). Supported: the fused CUDA path of a dense model (no mixture of experts, no fp8 weights),
one TP rank, a KV pool in the model dtype (a float8 pool wants the new tokens' K/V in the attention call:
``wants_fresh_kv``). The model runner falls back to the eager forward otherwise, and for steps of more than
``max(sizes)`` tokens. Weights are never rebound (updates copy in place), so graphs stay valid across updates.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from rollout.model_executor.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from rollout.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """The token counts captured: 64, 128, 256, 512, 768, every 512 from 1,024 to 4,096, then every 1,024,
    up to ``max_tokens`` (which is always one). Padding costs at most a 512-token (1,024 above 4,096) slice
    of a step's GPU time."""
    sizes = [64, 128, 256, 512, 768] + list(range(1024, 4097, 512)) + list(range(5120, max_tokens + 1, 1024))
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


class _CaptureBackend:
    """The attention backend the pieces see while captured: they only ask whether the attention wants the new
    tokens' K/V passed to it (never, for a supported pool); the attention itself runs outside the pieces."""

    @staticmethod
    def wants_fresh_kv(batch: ForwardBatch) -> bool:
        return False


class PiecewiseCudaGraphRunner:
    """Captures the pieces of the extend forward for each of ``sizes`` and replays them (``forward``)."""

    def __init__(self, runner: "ModelRunner", sizes: list[int], stream: torch.cuda.Stream | None = None) -> None:
        """``stream``: where the pieces are captured (the model runner's one capture stream; default a new one)."""
        self.runner = runner
        self.stream = stream if stream is not None else torch.cuda.Stream(runner.device)
        self.sizes = sorted(sizes)
        self.max_tokens = self.sizes[-1]
        self.model = model = runner.model.model
        self.layers = list(model.layers)
        attn = self.layers[0].self_attn.attn
        dev, dtype, n = runner.device, runner.dtype, self.max_tokens
        hidden = model.embed_tokens.weight.shape[1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        with runner.memory.region("kv_cache"):  # scratch that sleep releases with the KV cache
            self.residual = torch.zeros(n, hidden, dtype=dtype, device=dev)
            self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=dev)
            self.attn = torch.zeros(n, attn.num_heads * attn.head_dim, dtype=dtype, device=dev)
            self.hidden = torch.zeros(n, hidden, dtype=dtype, device=dev)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.replays = 0  # extend steps replayed (Engine.get_step_stats)
        self.pool = None
        start, reserved = time.perf_counter(), torch.cuda.memory_reserved(dev)
        self.capture()
        torch.cuda.empty_cache()  # the warm-ups' blocks: what stays reserved is the graphs' pool
        self.graph_bytes = torch.cuda.memory_reserved(dev) - reserved  # which sleep cannot release
        logger.info("captured piecewise CUDA graphs for extend steps of %s tokens in %.1f s, %.2f GiB",
                    self.sizes, time.perf_counter() - start, self.graph_bytes / 2**30)

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def _padded(self, num_tokens: int) -> int:
        return next(s for s in self.sizes if s >= num_tokens)

    def _capture_batch(self, size: int) -> ForwardBatch:
        r = self.runner
        return ForwardBatch(
            mode=ForwardMode.EXTEND, input_ids=self.input_ids[:size], positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size], req_pool_indices=self.input_ids[:1], seq_lens=self.positions[:1],
            seq_lens_cpu=[size], extend_lens=[size], kv_pool=r.kv_pool, req_to_token=r.req_to_token.table,
            attn_backend=_CaptureBackend())

    def _piece(self, i: int, size: int, batch: ForwardBatch) -> None:
        """Piece ``i`` over the first ``size`` rows of the fixed buffers (see the module doc)."""
        residual = self.residual[:size]
        if i == 0:
            x, res_in = self.model.embed_tokens(batch.input_ids), None
        else:
            x, res_in = self.layers[i - 1].attention_output(self.attn[:size], residual, batch)
        if i == len(self.layers):
            self.hidden[:size].copy_(self.model.norm(x, res_in)[0])
            return
        out = self.layers[i].attention_inputs(batch.positions, x, res_in, batch, q_out=self.q[:size])
        if out[-1].data_ptr() != residual.data_ptr():  # the first layer's residual is the embedding
            residual.copy_(out[-1])

    def capture(self) -> None:
        dev = self.runner.device
        stream, current = self.stream, torch.cuda.current_stream(dev)
        stream.wait_stream(current)
        with torch.no_grad(), torch.cuda.stream(stream):
            for size in reversed(self.sizes):  # largest first, so smaller sizes reuse its memory
                batch = self._capture_batch(size)
                for i in range(len(self.layers) + 1):  # warm up outside the graphs (allocations, lazy inits)
                    self._piece(i, size, batch)
                graphs = []
                for i in range(len(self.layers) + 1):
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(*(() if self.pool is None else (self.pool,)), capture_error_mode="thread_local")
                    try:
                        self._piece(i, size, batch)
                    finally:
                        graph.capture_end()
                    self.pool = graph.pool()
                    graphs.append(graph)
                self.graphs[size] = graphs
        current.wait_stream(stream)
        torch.cuda.synchronize(dev)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The final hidden states [T, hidden] of an extend ``batch`` of T <= ``max_tokens`` tokens (attention
        planned), as ``LlamaModel.forward`` computes them; a view of a fixed buffer, valid until the next
        step. Nothing waits for the GPU."""
        t = batch.input_ids.shape[0]
        size = self._padded(t)
        for buf, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                         (self.out_cache_loc, batch.out_cache_loc)):
            buf[:t].copy_(src)
            if size > t:
                buf[t:size].zero_()
        graphs = self.graphs[size]
        q, attn = self.q[:t], self.attn[:t]
        for layer, graph in zip(self.layers, graphs):
            graph.replay()
            layer.self_attn.attn(q, None, None, batch, out=attn)
        graphs[-1].replay()
        self.replays += 1
        return self.hidden[:t]
