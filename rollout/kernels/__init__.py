"""The engine's Triton kernels, one module each (imported only where a CUDA path uses them, or by their
tests under Triton's CPU interpreter): ``decode_attention``, ``decode_indices``, ``rope``, ``sampling``,
``quant``, ``fused_quant``, ``fp8_gemm`` and the ``pdl`` launch helpers. Importing this package imports
nothing heavy."""
