"""Run Triton kernels under the CPU interpreter when there is no CUDA device.

Import this module before ``triton`` anywhere in a test: without CUDA it sets TRITON_INTERPRET and
patches two bugs of Triton 3.6's interpreter (compiled kernels are unaffected):
- a loaded scalar as a ``tl.range`` bound: it calls ``int(ndarray_of_shape_1)``, which numpy 2 refuses;
- ``tl.dot`` of bfloat16 operands: it multiplies their raw uint16 bit patterns as integers (here they
  are widened to float32 first, exactly);
- casts to float8: it truncates mantissa bits and clamps e4m3fn's exponent wrongly (here torch's
  round-to-nearest-even cast does them, as the GPU's ``cvt.rn`` does).
"""

from __future__ import annotations

import os

import torch

INTERPRETED = not torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"

if INTERPRETED:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.runtime.interpreter as _interpreter

    _patch_lang_tensor = _interpreter._patch_lang_tensor

    def _patch_lang_tensor_numpy2(tensor, scope) -> None:
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def _bf16_as_float32(handle):
        import numpy as np
        import triton.language as tl

        if handle.dtype != tl.bfloat16:
            return handle
        bits = handle.data.astype(np.uint32) << 16
        return _interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    _create_dot = _interpreter.InterpreterBuilder.create_dot

    def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _create_dot(self, _bf16_as_float32(a), _bf16_as_float32(b), d, input_precision,
                           max_num_imprecise_acc)

    _create_fp_to_fp = _interpreter.InterpreterBuilder.create_fp_to_fp

    def _create_fp_to_fp_rne(self, src, dst_type, rounding_mode):
        import numpy as np
        import triton.language as tl

        fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}.get(dst_type.scalar)
        if fp8 is None or src.dtype.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return _create_fp_to_fp(self, src, dst_type, rounding_mode)
        wide = _bf16_as_float32(src).data.astype(np.float32)
        out = torch.from_numpy(np.ascontiguousarray(wide)).to(fp8).view(torch.uint8).numpy()
        return _interpreter.TensorHandle(out, dst_type.scalar)

    if getattr(_interpreter._patch_lang_tensor, "__name__", "") != "_patch_lang_tensor_numpy2":
        _interpreter._patch_lang_tensor = _patch_lang_tensor_numpy2
        _interpreter.InterpreterBuilder.create_dot = _create_dot_bf16
        _interpreter.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp_rne
