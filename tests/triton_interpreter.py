"""Run Triton kernels under the CPU interpreter when there is no CUDA device.

Import this module before ``triton`` anywhere in a test: without CUDA it sets TRITON_INTERPRET and
patches three bugs of Triton 3.6's interpreter (compiled kernels are unaffected):
- a loaded scalar as a ``tl.range`` bound: it calls ``int(ndarray_of_shape_1)``, which numpy 2 refuses;
- ``tl.dot`` of bfloat16 or float8 operands: it multiplies their raw bit patterns as integers (here
  they are widened to float32 first, exactly);
- casts to float8 and bfloat16: it truncates mantissa bits (and clamps e4m3fn's exponent wrongly);
  here torch's round-to-nearest-even cast does them, as the GPU's ``cvt.rn`` does.

It also stops the interpreter re-patching ``triton.language`` on every call of a ``@triton.jit`` helper
inside a kernel (``inspect.getmembers`` over tl, tl.tensor and tl.math each time: about a third of a
sampling kernel's interpreted time): a helper whose language modules the running launch already patched
finds them patched, which is the state the repeated patch would leave; the launch's own scope restores them
at its end as before.
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

    def _as_float32(handle):
        import numpy as np
        import triton.language as tl

        if handle.dtype == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return _interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}.get(handle.dtype)
        if fp8 is not None:  # raw uint8 bits -> their float32 values
            bits = torch.from_numpy(np.ascontiguousarray(handle.data).view(np.uint8))
            return _interpreter.TensorHandle(bits.view(fp8).float().numpy(), tl.float32)
        return handle

    _create_dot = _interpreter.InterpreterBuilder.create_dot

    def _create_dot_widened(self, a, b, d, input_precision, max_num_imprecise_acc):
        return _create_dot(self, _as_float32(a), _as_float32(b), d, input_precision,
                           max_num_imprecise_acc)

    def _rounded_cast(src, dst_type):
        """``src`` cast to a float8 or bfloat16 ``dst_type`` by torch (round to nearest even); None for
        other casts."""
        import numpy as np
        import triton.language as tl

        narrow = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.float8e5: (torch.float8_e5m2, torch.uint8),
                  tl.bfloat16: (torch.bfloat16, torch.int16)}.get(dst_type.scalar)
        if narrow is None or src.dtype.scalar not in (tl.float32, tl.float16, tl.bfloat16):
            return None
        wide = _as_float32(src).data.astype(np.float32)
        out = torch.from_numpy(np.ascontiguousarray(wide)).to(narrow[0]).view(narrow[1]).numpy()
        return _interpreter.TensorHandle(out.view(np.uint16) if narrow[1] == torch.int16 else out, dst_type.scalar)

    _create_fp_to_fp = _interpreter.InterpreterBuilder.create_fp_to_fp
    _create_fp_trunc = _interpreter.InterpreterBuilder.create_fp_trunc

    def _create_fp_to_fp_rne(self, src, dst_type, rounding_mode):
        out = _rounded_cast(src, dst_type)
        return _create_fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    def _create_fp_trunc_rne(self, src, dst_type):
        out = _rounded_cast(src, dst_type)
        return _create_fp_trunc(self, src, dst_type) if out is None else out

    _patch_lang = _interpreter._patch_lang
    _patched_langs: set[frozenset[int]] = set()  # language-module sets the running launch has patched

    class _AlreadyPatched:
        @staticmethod
        def restore() -> None:
            pass

    def _patch_lang_once(fn):
        import triton.language as tl

        key = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        if key in _patched_langs:
            return _AlreadyPatched
        scope = _patch_lang(fn)
        _patched_langs.add(key)
        restore = scope.restore

        def restore_and_forget() -> None:  # the launch's scope: its end unpatches every set
            _patched_langs.clear()
            restore()

        scope.restore = restore_and_forget
        return scope

    if getattr(_interpreter._patch_lang_tensor, "__name__", "") != "_patch_lang_tensor_numpy2":
        _interpreter._patch_lang = _patch_lang_once
        _interpreter._patch_lang_tensor = _patch_lang_tensor_numpy2
        _interpreter.InterpreterBuilder.create_dot = _create_dot_widened
        _interpreter.InterpreterBuilder.create_fp_to_fp = _create_fp_to_fp_rne
        _interpreter.InterpreterBuilder.create_fp_trunc = _create_fp_trunc_rne
