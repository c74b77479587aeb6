import sys, torch
sys.path.insert(0, "gpu_checks")
from sweep_decode import time_ms
from rollout.layers import triton_fused_quant as m
from rollout.layers.quantization import FP8_MAX, INV_FP8_MAX, _MIN_SCALE
dev = "cuda"
for t in (1, 256):
    gu = torch.randn(t, 2 * 14336, device=dev, dtype=torch.bfloat16)
    out = m._new_activation(t, 14336, gu.dtype, gu.device)
    for w in (8, 16, 32):
        f = lambda: m._silu_mul_quant_kernel[(t,)](gu, out.q, out.scale, 14336, gu.stride(0), out.q.stride(0), FP8_MAX, INV_FP8_MAX, _MIN_SCALE, BLOCK=16384, num_warps=w)
        print(f"silu t{t} w{w}: {time_ms(f) * 1000:.2f} us", flush=True)
    x = torch.randn(t, 4096, device=dev, dtype=torch.bfloat16); r = torch.randn_like(x); wt = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    o2 = m._new_activation(t, 4096, x.dtype, x.device)
    for w in (4, 8, 16):
        f = lambda: m._add_rmsnorm_quant_kernel[(t,)](x, r, wt, o2.q, o2.scale, 4096, x.stride(0), r.stride(0), o2.q.stride(0), 1e-5, FP8_MAX, INV_FP8_MAX, _MIN_SCALE, HAS_RESIDUAL=True, BLOCK=4096, num_warps=w)
        print(f"norm t{t} w{w}: {time_ms(f) * 1000:.2f} us", flush=True)
