"""Hugging Face parameter names from whatever wrapping a trainer put around its model: the functions live in
``rollout.weights.wrapper_names`` (``weight_sync.fingerprint`` names a wrapped model's parameters the same way)."""

from rollout.weights.wrapper_names import hf_name, hf_named_parameters, unwrap_model

__all__ = ["hf_name", "hf_named_parameters", "unwrap_model"]
