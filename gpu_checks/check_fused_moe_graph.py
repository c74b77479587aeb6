"""The fused MoE kernel inside a CUDA graph (GPU only; CI runs the kernel's other tests under Triton's CPU
interpreter): capture once, change the routing in place, replay, compare with the torch reference.

    python gpu_checks/check_fused_moe_graph.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from test_fused_moe import reference_moe, route  # noqa: E402

from rollout.kernels.fused_moe import fused_moe  # noqa: E402


def main() -> int:
    gen = torch.Generator().manual_seed(11)
    t, top_k, num_experts, h, inter = 24, 4, 16, 256, 128
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).cuda()
    w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) / h ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(num_experts, h, inter, generator=gen) / inter ** 0.5).to(torch.bfloat16).cuda()
    topk_ids = route(t, top_k, num_experts, gen).cuda()
    topk_weights = torch.rand(t, top_k, generator=gen).cuda()
    fused_moe(x, w13, w2, topk_weights, topk_ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    topk_ids.copy_(route(t, top_k, num_experts, gen))
    graph.replay()
    torch.cuda.synchronize()
    want = reference_moe(x.cpu(), w13.cpu(), w2.cpu(), topk_weights.cpu(), topk_ids.cpu())
    err = (out.cpu().float() - want.float()).abs().max().item()
    ok = torch.allclose(out.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)
    print(f"fused_moe replayed in a CUDA graph with new routing: max |diff| {err:.3e} -> {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
