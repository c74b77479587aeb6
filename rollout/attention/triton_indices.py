"""Decode index lists in one Triton launch: ``kv_indptr`` and ``kv_indices`` from the request table.

Semantics (``rollout.attention.flashinfer_backend.kv_indices_for`` is the torch reference):

    indptr[0] = 0, indptr[i + 1] = seq_lens[0] + ... + seq_lens[i]
    indices[indptr[i]:indptr[i + 1]] = req_to_token[rows[i], :seq_lens[i]]

Grid (B, C): program (i, c) finds its request's start by summing the seq lens before it (all B of them
are loaded at once, so B is bounded by what one program holds: a few thousand), then copies chunks c,
c + C, c + 2C, ... of CHUNK tokens of row ``rows[i]``; its loop bound is the loaded seq len, so any
length is covered whatever C is. Program (i, 0) writes ``indptr[i + 1]`` (and (0, 0) ``indptr[0]``).
Nothing is read back to the host; the outputs are written in place (CUDA-graph buffers keep their
addresses).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 1024  # tokens one program copies per loop step
MAX_CHUNK_PROGRAMS = 4096  # cap on C (programs per request); longer requests loop


@triton.jit
def _kv_indices_kernel(req_to_token, rows, seq_lens, indptr, indices, batch, capacity, t_sr, t_sc,
                       BLOCK_B: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_lens + b, mask=b < batch, other=0).to(tl.int32)
    start = tl.sum(tl.where(b < i, lens, 0), axis=0)
    n = tl.load(seq_lens + i).to(tl.int32)
    if c == 0:
        tl.store(indptr + i + 1, start + n)
        if i == 0:
            tl.store(indptr, start)  # start of request 0: zero, in indptr's own type
    src = req_to_token + tl.load(rows + i).to(tl.int64) * t_sr
    dst = indices + start
    t = tl.arange(0, CHUNK)
    for t0 in tl.range(c * CHUNK, n, tl.num_programs(1) * CHUNK):
        pos = t0 + t
        ok = (pos < n) & (start + pos < capacity)
        slots = tl.load(src + pos.to(tl.int64) * t_sc, mask=ok)
        tl.store(dst + pos, slots.to(tl.int32), mask=ok)


def chunk_programs(batch_size: int, total: int) -> int:
    """Programs per request (C): enough CHUNK-token chunks to cover the average request of a batch of
    ``batch_size`` holding ``total`` tokens, at least 1 and at most ``MAX_CHUNK_PROGRAMS``."""
    return max(1, min(triton.cdiv(total, max(batch_size, 1) * CHUNK), MAX_CHUNK_PROGRAMS))


def write_kv_indices(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
                     indptr: torch.Tensor, indices: torch.Tensor, total: int) -> torch.Tensor:
    """Writes ``indptr[:B + 1]`` (cumulative seq lens from 0) and ``indices[:total]`` (the concatenation
    of ``req_to_token[rows[i], :seq_lens[i]]``) in one launch, without a host sync; returns
    ``indices[:total]``.

    ``req_to_token``: int32 [num_rows, max_ctx], any strides; ``rows``: int64 or int32 [B];
    ``seq_lens``: integer [B] on the device; ``indptr``: int32, at least B + 1 elements (later ones
    untouched); ``indices``: int32, at least ``total`` elements (later ones untouched). ``total`` is the
    host's sum of the seq lens: it sizes the grid and the returned view only; the device seq lens decide
    what is written, and writes past ``indices``'s end are dropped rather than made."""
    b = rows.shape[0]
    if seq_lens.shape[0] != b or indptr.numel() < b + 1:
        raise ValueError(f"{b} rows, {seq_lens.shape[0]} seq lens, indptr of {indptr.numel()} (need B + 1)")
    if indptr.dtype != torch.int32 or indices.dtype != torch.int32 or req_to_token.dtype != torch.int32:
        raise TypeError("req_to_token, indptr and indices must be int32")
    if not (indptr.is_contiguous() and indices.is_contiguous()):
        raise ValueError("indptr and indices must be contiguous")
    if total > indices.numel():
        raise ValueError(f"{total} indices do not fit a buffer of {indices.numel()}")
    if b == 0:
        indptr[:1].zero_()
        return indices[:0]
    grid = (b, chunk_programs(b, total))
    _kv_indices_kernel[grid](req_to_token, rows, seq_lens, indptr, indices, b, indices.numel(),
                             req_to_token.stride(0), req_to_token.stride(1),
                             BLOCK_B=triton.next_power_of_2(b), CHUNK=CHUNK, num_warps=4)
    return indices[:total]
