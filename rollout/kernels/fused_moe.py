"""Fused mixture-of-experts MLP in Triton, in the shape of vLLM's / SGLang's ``fused_moe``.

``fused_moe(x, w13, w2, topk_weights, topk_ids)[t] = Σ_k topk_weights[t, k] · w2[e] @ (silu(g) · u)`` with
``e = topk_ids[t, k]`` and ``[g | u] = w13[e] @ x[t]``. The T·K (token, slot) pairs are grouped by expert
(``moe_align_block_size``) into blocks of BLOCK_M rows of one expert each; one grouped-GEMM kernel then runs
both projections, a program per (row block, BLOCK_N output columns), gathering its rows of the activations
and reading only its expert's weights. Everything is sized from T·K, E and BLOCK_M alone and nothing waits
on the device (no ``.item()``, no data-dependent shapes): the whole layer can be captured in a CUDA graph.
Weights are stored as ``nn.Linear`` keeps them, [E, out, in] with ``in`` contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_launch, pdl_prologue


@dataclass(frozen=True)
class MoeLaunch:
    """Tile sizes of both grouped GEMMs (BLOCK_M is also the alignment of the expert groups), the grouped
    ordering of row blocks (``group_m`` row blocks share a column tile in L2) and the pipeline."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 4


def default_moe_launch(t: int, e: int, n: int, k: int, top_k: int) -> MoeLaunch:
    """The launch for T tokens routed to ``top_k`` of ``e`` experts, weights [e, n, k] (bf16, H100/H200), after
    vLLM's ``get_default_config``: 16-row blocks (``mma.sync``) while experts get few rows each, wgmma-sized
    blocks and grouped ordering once they get many. Untuned starting points: see tools/bench_fused_moe.py."""
    per_expert = t * top_k / e
    if per_expert <= 16:
        return MoeLaunch(16, 64, 128, 1, 4, 4 if k >= 1024 else 3)
    if per_expert <= 64:
        return MoeLaunch(32, 64, 128, 1, 4, 3)
    if per_expert <= 192:
        return MoeLaunch(64, 128, 64, 8, 4, 3)
    return MoeLaunch(128, 128, 64, 8, 8, 3)


def max_padded_len(numel: int, num_experts: int, block_m: int) -> int:
    """An upper bound on ``num_tokens_post_padded`` for ``numel`` (token, slot) pairs, rounded up to whole
    blocks: at most min(E, numel) experts are non-empty, and each pads fewer than ``block_m`` rows."""
    return triton.cdiv(numel + min(num_experts, numel) * (block_m - 1), block_m) * block_m


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups the flat indices ``t*K + k`` of ``topk_ids`` [T, K] (values in [0, num_experts)) by expert.

    Returns, all int32 on ``topk_ids``' device, sized by ``max_padded_len(T*K, num_experts, block_m)`` = P:
    - ``sorted_token_ids`` [P]: each expert's flat indices in increasing order, the experts in increasing
      order, each group padded to a multiple of ``block_m`` with the sentinel ``T*K`` (also filling the tail);
    - ``expert_ids`` [P // block_m]: the expert of each block, -1 for blocks past the last group;
    - ``num_tokens_post_padded`` [1]: the length of the padded groups (a multiple of ``block_m``).
    Torch ops only, none synchronizing with the host (CUDA-graph safe).
    """
    dev = topk_ids.device
    numel = topk_ids.numel()
    padded = max_padded_len(numel, num_experts, block_m)
    experts, order = torch.sort(topk_ids.reshape(-1).long(), stable=True)  # stable: indices increase per expert
    bounds = torch.searchsorted(experts, torch.arange(num_experts + 1, device=dev))  # start of each group
    counts = bounds.diff()
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    shift = padded_end - (counts + block_m - 1) // block_m * block_m - bounds[:-1]  # padded start - start
    dest = torch.arange(numel, device=dev) + shift[experts]
    sorted_ids = torch.full((padded,), numel, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(padded // block_m, device=dev)
    expert_ids = torch.searchsorted(padded_end // block_m, blocks, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, padded_end[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_ids_ptr, num_post_ptr,
                     N, K, num_valid, num_padded, stride_am, stride_be, stride_bn, stride_cm,
                     TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr, NUM_STAGES: tl.constexpr, USE_PDL: tl.constexpr):
    """C[s] = (A[s // TOP_K] @ B[e]ᵀ) (· weights[s]) for the flat indices s of one BLOCK_M block of expert e."""
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_padded, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < num_valid
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (ids // TOP_K)[:, None].to(tl.int64) * stride_am + ks[None, :]
    b_ptrs = b_ptr + expert * stride_be + (cols % N)[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(weights_ptr + ids, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + ids[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor | None,
             sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_post: torch.Tensor, top_k: int,
             launch: MoeLaunch) -> None:
    """``c[s] = a[s // top_k] @ b[e]ᵀ`` (times ``topk_weights.flatten()[s]`` if given) for every flat index s
    of ``sorted_ids`` (from ``moe_align_block_size`` with ``launch.block_m``) routed to expert e; other rows
    of ``c`` are left alone. a [*, K], b [E, N, K], c [T*top_k, N]: rows with unit stride, dtype of a == b's."""
    if a.stride(1) != 1 or b.stride(2) != 1 or c.stride(1) != 1:
        raise ValueError("moe_gemm needs a, b and c with unit stride along their last dimension")
    if a.shape[1] != b.shape[2] or c.shape[1] != b.shape[1] or a.dtype != b.dtype:
        raise ValueError(f"moe_gemm got a {tuple(a.shape)} {a.dtype}, b {tuple(b.shape)} {b.dtype}, "
                         f"c {tuple(c.shape)}")
    n, k = b.shape[1], b.shape[2]
    num_padded = sorted_ids.numel()
    grid = (triton.cdiv(num_padded, launch.block_m) * triton.cdiv(n, launch.block_n),)
    if grid[0] == 0:
        return
    weights = topk_weights.reshape(-1) if topk_weights is not None else c  # c: unused placeholder
    _moe_gemm_kernel[grid](a, b, c, weights, sorted_ids, expert_ids, num_post, n, k, c.shape[0], num_padded,
                           a.stride(0), b.stride(0), b.stride(1), c.stride(0), TOP_K=top_k,
                           MUL_ROUTED_WEIGHT=topk_weights is not None,
                           DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                           BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                           GROUP_M=launch.group_m, NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
                           **pdl_launch(a.device))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, inplace_out: torch.Tensor | None = None,
              launch: MoeLaunch | None = None) -> torch.Tensor:
    """The routed experts' SwiGLU MLP, [T, H] in x's dtype (written into ``inplace_out`` when given; it may be
    ``x`` itself).

    x [T, H]; w13 [E, 2I, H], each expert's gate rows then its up rows; w2 [E, H, I] (x's dtype, last dims
    contiguous); topk_ids [T, K] int in [0, E); topk_weights [T, K] float32 or x's dtype. Both GEMMs
    accumulate in float32 and round their output to x's dtype (SiLU·mul as the torch path, in x's dtype);
    the K weighted expert outputs of a token are summed in float32, then rounded. No host synchronization.
    """
    t, h = x.shape
    e, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if w13.shape[2] != h or w2.shape != (e, h, two_i // 2) or topk_ids.shape != (t, top_k) \
            or topk_weights.shape != (t, top_k):
        raise ValueError(f"fused_moe got x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}")
    out = torch.empty_like(x) if inplace_out is None else inplace_out
    if t == 0:
        return out
    launch = launch or default_moe_launch(t, e, two_i, h, top_k)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, e, launch.block_m)
    gate_up = torch.empty((t * top_k, two_i), dtype=x.dtype, device=x.device)
    moe_gemm(x, w13, gate_up, None, sorted_ids, expert_ids, num_post, top_k, launch)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    down = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device)
    moe_gemm(act, w2, down, topk_weights.contiguous(), sorted_ids, expert_ids, num_post, 1, launch)
    torch.sum(down.view(t, top_k, h), dim=1, out=out)  # accumulates in float32 for 16-bit dtypes too
    return out
