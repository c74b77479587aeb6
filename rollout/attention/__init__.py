"""Attention backends behind one interface (``base.AttentionBackend``), built by name in ``registry``:
``torch_native`` (any device), ``flashinfer_backend`` (FlashInfer prefill and decode), ``triton_backend`` and
``xqa_backend`` (decode only), ``hybrid`` (one backend for prefill, another for decode). Importing this
package imports nothing heavy: the GPU backends import flashinfer / Triton kernels only when built."""
