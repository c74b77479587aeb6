"""Bytes per decode step and the memory-bandwidth floor: what one TP rank's decode step must read
(weights and KV), the device-to-device copy bandwidth measured on the spot, and their quotient."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rollout.config import ModelConfig


@dataclass(frozen=True)
class ModelBytes:
    """Bytes on one TP rank: all weights, the weights every decode step reads, and KV bytes per token.
    Mixture-of-experts models: ``expert_bytes`` is one expert of one sparse layer (its gate, up and down
    shards); a step reads the experts its tokens are routed to (``expected_experts``), on top of
    ``weight_bytes_read``."""

    weight_bytes: int
    weight_bytes_read: int
    kv_bytes_per_token: int
    expert_bytes: int = 0
    sparse_layers: int = 0
    num_experts: int = 0
    top_k: int = 0

    def expected_experts(self, batch_size: int) -> float:
        """Distinct experts a step of ``batch_size`` tokens reads per sparse layer when each token picks
        ``top_k`` distinct experts uniformly (random-weight routers are near uniform): E·(1 − (1 − k/E)^B)."""
        if not self.num_experts:
            return 0.0
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** batch_size)

    def bytes_read(self, batch_size: int) -> float:
        """Weight bytes one decode step of ``batch_size`` requests reads."""
        return self.weight_bytes_read + self.sparse_layers * self.expert_bytes * self.expected_experts(batch_size)


def model_bytes(cfg: ModelConfig, tp_size: int, elem_bytes: int, kv_elem_bytes: int | None = None,
                quantization: str | None = None) -> ModelBytes:
    """Count from the config, sharded as the engine shards: heads, MLP columns and vocabulary rows are
    split across ranks; norms are replicated; KV heads are replicated when ``tp_size > num_kv_heads``.
    A decode step reads every weight except an untied input-embedding table (only the batch's rows), and
    of a sparse layer's experts only the routed ones (``ModelBytes.bytes_read``).
    KV entries take ``kv_elem_bytes`` each (default: ``elem_bytes``, the model dtype). Under
    ``quantization="fp8"`` the projections take 1 byte per element plus a float32 scale per local row."""
    heads = cfg.num_heads // tp_size
    kv_heads = cfg.num_kv_heads // tp_size if cfg.num_kv_heads >= tp_size else 1
    vocab_rows = -(-cfg.vocab_size // tp_size)
    h, d = cfg.hidden_size, cfg.head_dim
    qkv_out = (heads + 2 * kv_heads) * d
    mlp = cfg.intermediate_size // tp_size
    proj = h * qkv_out + heads * d * h + 3 * h * mlp  # qkv, o, gate_up, down
    proj_rows = qkv_out + h + 2 * mlp + h
    proj_bytes = proj + 4 * proj_rows if quantization == "fp8" else proj * elem_bytes
    other = 2 * h + (qkv_out if cfg.qkv_bias else 0) + (2 * d if cfg.qk_norm else 0)  # norms, biases
    sparse = len(cfg.sparse_layers)
    read = cfg.num_layers * (proj_bytes + other * elem_bytes) + (h + vocab_rows * h) * elem_bytes  # + final norm, LM head
    if sparse:  # a sparse layer has a router [E, H] instead of the dense MLP; its experts are counted apart
        read += sparse * (cfg.num_experts * h * elem_bytes - 3 * h * mlp * elem_bytes)
    expert = 3 * h * (cfg.moe_intermediate_size // tp_size) * elem_bytes
    stored = read + (0 if cfg.tie_word_embeddings else vocab_rows * h * elem_bytes) + sparse * cfg.num_experts * expert
    kv = 2 * cfg.num_layers * kv_heads * d * (kv_elem_bytes or elem_bytes)
    return ModelBytes(stored, read, kv, expert if sparse else 0, sparse, cfg.num_experts, cfg.num_experts_per_tok)


def measure_copy_bandwidth(device: str, nbytes: int | None = None, repeats: int = 10) -> float:
    """Best-of-``repeats`` device-to-device ``copy_`` bandwidth in bytes/s, counting bytes read plus bytes
    written (2 x size). Default size: 1 GiB on CUDA, 256 MiB on CPU."""
    import torch

    cuda = device.startswith("cuda")
    nbytes = nbytes or (1024**3 if cuda else 256 * 1024**2)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch pages / warm up
    best = float("inf")
    for _ in range(repeats):
        best = min(best, _time_copy(dst, src, cuda))
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes / best


def _time_copy(dst, src, cuda: bool) -> float:
    import torch

    if not cuda:
        start = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0


def floor_ms(mb: ModelBytes, kv_tokens: float, bandwidth: float, batch_size: int = 1) -> float:
    """Memory-bandwidth floor of one decode step of ``batch_size`` requests in ms: (weights read + KV read)
    / copy bandwidth."""
    return 1000.0 * (mb.bytes_read(batch_size) + kv_tokens * mb.kv_bytes_per_token) / bandwidth


def run_decode_floor_s(mb: ModelBytes, input_lens: list[int], output_lens: list[int], bandwidth: float,
                       max_running: int) -> tuple[float, int]:
    """Seconds every decode step of a whole run needs at the bandwidth floor, and the number of steps.

    The schedule: requests take the ``max_running`` slots in order, a freed slot goes to the next one; the
    first token of each comes from its prefill, so request i decodes ``output_lens[i] - 1`` steps, its KV
    growing from ``input_lens[i] + 1``. Prefill time is not included: this is the decode part of the bench's
    bound, ``elapsed - prefill`` over it says how far the decode steps are from the floor taken together
    (small batches in the run's tail included)."""
    pending = list(zip(input_lens, output_lens))[::-1]
    running: list[list[int]] = []  # [kv tokens, decode steps left]
    total, steps = 0.0, 0
    while pending or running:
        while pending and len(running) < max_running:
            n_in, n_out = pending.pop()
            if n_out > 1:
                running.append([n_in + 1, n_out - 1])
        if not running:
            continue
        total += floor_ms(mb, sum(kv for kv, _ in running), bandwidth, len(running)) / 1000.0
        steps += 1
        for r in running:
            r[0] += 1
            r[1] -= 1
        running = [r for r in running if r[1] > 0]
    return total, steps
