"""Bytes per decode step and the memory-bandwidth floor: what one TP rank's decode step must read
(weights and KV), the device-to-device copy bandwidth measured on the spot, and their quotient."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rollout.config import ModelConfig


@dataclass(frozen=True)
class ModelBytes:
    """Bytes on one TP rank: all weights, the weights one decode step reads, and KV bytes per token."""

    weight_bytes: int
    weight_bytes_read: int
    kv_bytes_per_token: int


def model_bytes(cfg: ModelConfig, tp_size: int, elem_bytes: int, kv_elem_bytes: int | None = None,
                quantization: str | None = None) -> ModelBytes:
    """Count from the config, sharded as the engine shards: heads, MLP columns and vocabulary rows are
    split across ranks; norms are replicated; KV heads are replicated when ``tp_size > num_kv_heads``.
    A decode step reads every weight except an untied input-embedding table (only the batch's rows).
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
    read = cfg.num_layers * (proj_bytes + other * elem_bytes) + (h + vocab_rows * h) * elem_bytes  # + final norm, LM head
    stored = read + (0 if cfg.tie_word_embeddings else vocab_rows * h * elem_bytes)
    kv = 2 * cfg.num_layers * kv_heads * d * (kv_elem_bytes or elem_bytes)
    return ModelBytes(stored, read, kv)


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


def floor_ms(mb: ModelBytes, kv_tokens: float, bandwidth: float) -> float:
    """Memory-bandwidth floor of one decode step in ms: (weights read + KV read) / copy bandwidth."""
    return 1000.0 * (mb.weight_bytes_read + kv_tokens * mb.kv_bytes_per_token) / bandwidth
